//! Whether a real-NIXL test runs: the runtime is there, or the test is
//! skipped with a message that says so, or (with `KVLEASE_REQUIRE_NIXL=1`,
//! as `.ci/run` sets it) fails. Also serializes the tests of one binary:
//! they share the machine's UCX resources and real-time bounds.
#![allow(dead_code)] // each test binary uses part of it

use std::io::Write;
use std::sync::{Mutex, MutexGuard};

use kvlease::fabric::nixl::runtime_available;

static SERIAL: Mutex<()> = Mutex::new(());

/// Writes straight to the process's stderr, past libtest's output capture.
pub fn say(msg: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{msg}");
}

/// Serializes the tests and decides whether they can run: `None` means skip
/// (the runtime is absent and not required).
pub fn nixl_or_skip() -> Option<MutexGuard<'static, ()>> {
    let guard = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    if runtime_available() {
        return Some(guard);
    }
    if std::env::var("KVLEASE_REQUIRE_NIXL").as_deref() == Ok("1") {
        panic!(
            "NIXL runtime not found (libnixl_capi.so not loadable) and KVLEASE_REQUIRE_NIXL=1: \
             run .ci/nixl-runtime.sh and export the LD_LIBRARY_PATH it prints"
        );
    }
    say("SKIPPED: NIXL runtime not found (run .ci/nixl-runtime.sh)");
    None
}

/// For a test that re-executes itself (see `child.rs`): in the child (its
/// environment has `env=1`) runs the child's side and yields `None`, so the
/// test returns; in the parent, [`nixl_or_skip`].
pub fn nixl_parent_or_child(env: &str, child_main: fn()) -> Option<MutexGuard<'static, ()>> {
    if std::env::var(env).as_deref() == Ok("1") {
        child_main();
        return None;
    }
    nixl_or_skip()
}
