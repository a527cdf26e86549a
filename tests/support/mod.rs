//! Helpers shared by the test binaries: the `it` binary includes this
//! module whole (`#[path = "../support/mod.rs"] mod support;`); the
//! allocator binaries include single files by path.
//!
//! `counting_alloc.rs` is deliberately not a module here: `it` must not
//! install a counting global allocator (only the `*_alloc` binaries do, one
//! per binary).
#![allow(dead_code)] // each test binary uses part of it

pub mod child;
pub mod loopback_p;
#[cfg(feature = "nixl")]
pub mod nixl_gate;
#[cfg(feature = "nixl")]
pub mod nixl_pair;
pub mod pipes;

/// The `--exact` name of the calling module's test function `$test`, as
/// libtest lists it in this binary (`module::path::test`, without the crate
/// name), for tests that re-execute their own binary to run one test as a
/// child process. It names the function, not a string, so renaming the test
/// or moving its module cannot leave a stale name behind.
// Only the NIXL tests re-execute themselves: unused without the feature.
#[allow(unused_macros)]
macro_rules! exact_test_name {
    ($test:ident) => {{
        let _: fn() = $test;
        $crate::support::exact_name(module_path!(), stringify!($test))
    }};
}
#[allow(unused_imports)]
pub(crate) use exact_test_name;

/// `module` (a `module_path!()`) without its crate name, then `test`.
pub fn exact_name(module: &str, test: &str) -> String {
    match module.split_once("::") {
        Some((_crate, path)) => format!("{path}::{test}"),
        None => test.to_owned(),
    }
}

/// The engine's side of P's releases: drains `sched`'s releases into
/// `freed` (id, reason) and frees their blocks at once, so the slots go back
/// to the pool.
pub fn free_released(
    sched: &mut kvlease::PrefillScheduler,
    freed: &mut Vec<(String, kvlease::ReleaseReason)>,
) {
    let mut tickets = Vec::new();
    sched.drain_released(|rel| {
        freed.push((rel.request_id.to_owned(), rel.reason));
        tickets.extend(rel.slot);
    });
    for t in tickets {
        sched.blocks_freed(t);
    }
}
