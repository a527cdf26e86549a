//! Helpers for tests whose processes talk over pipes, one line per item:
//! hex for bytes inside a line, a release reason as one word, and a thread
//! that turns stdin into a channel the step loop can poll without blocking.
#![allow(dead_code)] // each test binary uses part of it

use std::io::BufRead;
use std::sync::mpsc::{self, Receiver};

use kvlease::ReleaseReason;

/// `bytes` as lowercase hex.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The inverse of [`hex`]; `None` on anything else.
pub fn unhex(s: &str) -> Option<Vec<u8>> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// A release reason as one word.
pub fn reason_text(r: ReleaseReason) -> &'static str {
    match r {
        ReleaseReason::ReadDone => "read",
        ReleaseReason::Expired => "expired",
        ReleaseReason::Cancelled => "cancelled",
        ReleaseReason::NotHeld => "not-held",
    }
}

/// The inverse of [`reason_text`].
pub fn parse_reason(s: &str) -> Option<ReleaseReason> {
    Some(match s {
        "read" => ReleaseReason::ReadDone,
        "expired" => ReleaseReason::Expired,
        "cancelled" => ReleaseReason::Cancelled,
        "not-held" => ReleaseReason::NotHeld,
        _ => return None,
    })
}

/// Stdin's lines on a channel, read by a thread of their own; `None` once
/// stdin closed (the parent is gone: the child should exit).
pub fn stdin_lines() -> Receiver<Option<String>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if tx.send(Some(line)).is_err() {
                return;
            }
        }
        let _ = tx.send(None);
    });
    rx
}
