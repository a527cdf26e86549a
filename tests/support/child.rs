//! Tests that run part of themselves in a second process: this test
//! binary re-executed to run just one test (named with
//! `exact_test_name!`), which sees an environment variable and plays the
//! other side. The child is killed and reaped when the test drops it, also
//! when the test fails; its stdout arrives as lines on a channel, drained
//! for the child's whole life so it never blocks on a full pipe.

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

/// A child process, killed and reaped on drop.
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A started child: the process, its stdin (when asked for), and the lines
/// of its stdout that `keep` kept (as `keep` returned them).
pub struct TestChild {
    pub process: KillOnDrop,
    pub stdin: Option<ChildStdin>,
    pub lines: Receiver<String>,
}

/// Every line as it is.
pub fn every_line(line: &str) -> Option<String> {
    Some(line.to_owned())
}

/// Re-executes this test binary to run only the test `exact`, with `env`
/// set, stdin piped if `piped_stdin` (else null), stderr inherited.
pub fn spawn_test_child(
    exact: &str,
    env: &[(&str, &str)],
    piped_stdin: bool,
    keep: fn(&str) -> Option<String>,
) -> TestChild {
    let mut child = Command::new(std::env::current_exe().expect("the test binary"))
        .args(["--exact", exact, "--nocapture", "--test-threads=1"])
        .envs(env.iter().copied())
        .stdin(if piped_stdin {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("re-execute the test binary");
    let stdin = child.stdin.take();
    let out = child.stdout.take().expect("piped");
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if let Some(kept) = keep(&line) {
                // The test may have stopped listening: keep draining.
                let _ = tx.send(kept);
            }
        }
    });
    TestChild {
        process: KillOnDrop(child),
        stdin,
        lines,
    }
}

/// Waits up to `limit` for a line containing `marker` (libtest's
/// "test ... " may precede it on the same line); returns what follows the
/// marker. Lines before it are consumed.
pub fn wait_for(lines: &Receiver<String>, marker: &str, limit: Duration) -> Option<String> {
    let deadline = Instant::now() + limit;
    loop {
        let line = lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .ok()?;
        if let Some((_, rest)) = line.split_once(marker) {
            return Some(rest.to_owned());
        }
    }
}
