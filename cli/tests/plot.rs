//! `--plot` writes an SVG that parses (balanced, well-formed tags) and holds
//! one series per policy in every panel.

mod common;

use common::sim;

/// Checks that `svg` is well-formed XML as far as tags go: every element is
/// closed, in order, and the document has one root. Returns the element
/// names in document order.
fn elements(svg: &str) -> Vec<String> {
    let mut stack: Vec<String> = Vec::new();
    let mut names = Vec::new();
    let mut rest = svg;
    let mut roots = 0;
    while let Some(i) = rest.find('<') {
        let tail = &rest[i + 1..];
        let end = tail.find('>').expect("unterminated tag");
        let tag = &tail[..end];
        rest = &tail[end + 1..];
        if tag.starts_with('?') || tag.starts_with('!') {
            continue;
        }
        if let Some(name) = tag.strip_prefix('/') {
            let open = stack.pop().expect("close without open");
            assert_eq!(open, name.trim(), "mismatched close tag");
            continue;
        }
        let name: String = tag
            .chars()
            .take_while(|c| !c.is_whitespace() && *c != '/')
            .collect();
        assert!(!name.is_empty(), "empty tag");
        // Attribute quotes must balance.
        assert_eq!(
            tag.matches('"').count() % 2,
            0,
            "unbalanced quotes in <{name}>"
        );
        if stack.is_empty() {
            roots += 1;
        }
        names.push(name.clone());
        if !tag.ends_with('/') {
            stack.push(name);
        }
    }
    assert!(stack.is_empty(), "unclosed elements: {stack:?}");
    assert_eq!(roots, 1, "one root element");
    names
}

#[test]
fn the_plot_parses_and_has_one_series_per_policy_per_panel() {
    let path = std::env::temp_dir().join(format!("kvlease-plot-{}.svg", std::process::id()));
    let p = path.to_str().expect("utf-8 temp path").to_string();
    let out = sim(&[
        "--scenario",
        "happy,decode-crash",
        "--duration",
        "60",
        "--plot",
        &p,
    ]);
    let svg = std::fs::read_to_string(&path).expect("plot written");
    let _ = std::fs::remove_file(&path);
    let names = elements(&svg);
    assert_eq!(names.first().map(String::as_str), Some("svg"));
    let panels = out.report.runs.len();
    assert_eq!(panels, 2);
    let policies = &out.report.runs[0].policies;
    assert_eq!(policies.len(), 4);
    // A series is a 2-px polyline in its policy's colour; its legend swatch
    // is a second one. So each colour appears twice per panel, no more.
    let series: Vec<&str> = svg
        .split("<polyline")
        .skip(1)
        .filter(|e| e.contains("stroke-width=\"2\""))
        .collect();
    assert_eq!(series.len(), 2 * panels * policies.len());
    for colour in ["#1F77B4", "#2CA02C", "#D62728", "#FF7F0E"] {
        let n = series.iter().filter(|e| e.contains(colour)).count();
        assert_eq!(n, 2 * panels, "colour {colour}");
    }
    // Each series has a point per simulated second.
    let longest = series
        .iter()
        .map(|e| {
            e.split("points=\"").nth(1).map_or(0, |pts| {
                pts.split('"')
                    .next()
                    .unwrap_or("")
                    .split_whitespace()
                    .count()
            })
        })
        .max()
        .unwrap_or(0);
    assert!(longest >= 60, "{longest} points");
    for p in policies {
        assert_eq!(
            svg.matches(&format!(">\n{}\n<", p.policy)).count(),
            panels,
            "legend {}",
            p.policy
        );
    }
}
