//! `--plot FILE.svg`: the blocks P holds over time, one line per policy,
//! one panel per scenario (and sweep value).
//!
//! Owns the figure's layout and colours. Drawn with plotters' SVG backend
//! only (no bitmap or font stack: text is SVG text, sized by plotters'
//! built-in estimate). Each policy's series is one `<polyline>` per panel.
//! A series longer than [`MAX_POINTS`] seconds (an hour-long trace) is
//! drawn as the maximum over buckets of whole seconds, so that peaks
//! survive and the lines stay readable; the axis label says the bucket.

use plotters::prelude::*;

use super::Report;
use crate::sim::policy::Policy;

fn colour(p: Policy) -> RGBColor {
    match p {
        Policy::LeaseVerify => RGBColor(0x1f, 0x77, 0xb4),
        Policy::LeaseNoVerify => RGBColor(0x2c, 0xa0, 0x2c),
        Policy::Fixed480 => RGBColor(0xd6, 0x27, 0x28),
        Policy::Fixed30 => RGBColor(0xff, 0x7f, 0x0e),
    }
}

/// Most points per series before bucketing.
pub const MAX_POINTS: usize = 1200;

/// Seconds per point for a run of `secs` seconds.
fn bucket(secs: usize) -> usize {
    if secs <= MAX_POINTS {
        1
    } else {
        // A round number of seconds: 5, 10, 30, 60, ...
        let raw = secs.div_ceil(MAX_POINTS / 2);
        [5, 10, 30, 60, 300, 600, 3600]
            .into_iter()
            .find(|&b| b >= raw)
            .unwrap_or(raw)
    }
}

/// The SVG text of `report`'s plot.
pub fn render(report: &Report) -> Result<String, String> {
    let panels = report.runs.len().max(1);
    let cols = if panels == 1 { 1 } else { 2 };
    let rows = panels.div_ceil(cols);
    let (w, h) = (560 * cols as u32, 320 * rows as u32);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (w, h)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let areas = root.split_evenly((rows, cols));
        for (r, area) in report.runs.iter().zip(areas.iter()) {
            let secs = r
                .series
                .iter()
                .map(|(_, s)| s.len())
                .max()
                .unwrap_or(0)
                .max(1);
            let peak = r
                .series
                .iter()
                .flat_map(|(_, s)| s.iter().copied())
                .max()
                .unwrap_or(0)
                .max(1);
            let b = bucket(secs);
            // A replay's panel is named after its file.
            let name = match &report.trace {
                Some(t) => {
                    let file = std::path::Path::new(&t.file)
                        .file_name()
                        .map_or(t.file.clone(), |f| f.to_string_lossy().into_owned());
                    format!("trace {file}")
                }
                None => r.scenario.name().to_string(),
            };
            let title = match &r.sweep_value {
                Some(v) => format!("{name} (sweep value {v})"),
                None => name,
            };
            let mut chart = ChartBuilder::on(area)
                .caption(title, ("sans-serif", 18))
                .margin(8)
                .x_label_area_size(30)
                .y_label_area_size(56)
                .build_cartesian_2d(0u64..secs as u64, 0u64..peak + peak / 10)
                .map_err(|e| e.to_string())?;
            chart
                .configure_mesh()
                .x_desc("virtual seconds")
                .y_desc(if b == 1 {
                    "P blocks held".to_string()
                } else {
                    format!("P blocks held (max per {b} s)")
                })
                .light_line_style(WHITE.mix(0.0))
                .draw()
                .map_err(|e| e.to_string())?;
            for (policy, series) in &r.series {
                let c = colour(*policy);
                chart
                    .draw_series(LineSeries::new(
                        series.chunks(b).enumerate().map(|(k, vs)| {
                            (
                                (k * b + vs.len()) as u64,
                                vs.iter().copied().max().unwrap_or(0),
                            )
                        }),
                        c.stroke_width(2),
                    ))
                    .map_err(|e| e.to_string())?
                    .label(policy.name())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(2))
                    });
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK.mix(0.3))
                .draw()
                .map_err(|e| e.to_string())?;
        }
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}
