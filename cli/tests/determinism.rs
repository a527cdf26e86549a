//! The same seed gives byte-identical JSON; another seed does not; and the
//! thread count does not matter (runs are independent and deterministic).

use std::process::Command;

fn json(args: &[&str]) -> Vec<u8> {
    let out = Command::new(env!("CARGO_BIN_EXE_kvlease"))
        .arg("sim")
        .args(args)
        .output()
        .expect("run kvlease");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

#[test]
fn same_seed_same_json_bytes() {
    let args = [
        "--scenario",
        "heartbeat-loss,midread-lapse",
        "--json",
        "--seed",
        "42",
    ];
    let a = json(&args);
    let b = json(&[&args[..], &["--jobs", "1"]].concat());
    assert!(!a.is_empty());
    assert_eq!(a, b, "two runs with seed 42 differ");
    let v: serde_json::Value = serde_json::from_slice(&a).expect("valid JSON");
    assert_eq!(v["seed"], 42);
    assert_eq!(v["runs"].as_array().map(Vec::len), Some(2));
    // The report carries its checks: heartbeat-loss's holds on this seed.
    let checks = v["checks"].as_array().expect("checks");
    assert_eq!(checks.len(), 1);
    assert_eq!(checks[0]["holds"], true, "{}", checks[0]["text"]);
    assert!(
        !String::from_utf8_lossy(&a).contains("us_per_step"),
        "wall-clock timings stay out of the JSON"
    );
    let c = json(&[
        "--scenario",
        "heartbeat-loss,midread-lapse",
        "--json",
        "--seed",
        "43",
    ]);
    assert_ne!(a, c, "another seed, another run");
}
