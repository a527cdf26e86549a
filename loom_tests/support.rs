//! What the loom models in this directory share: [`model`], and the
//! threads, `Arc`, `Mutex` and atomics the model bodies use.
//!
//! Under `RUSTFLAGS="--cfg loom"` (`.ci/run` step 5) [`model`] is
//! `loom::model` and the re-exports are loom's: every interleaving up to
//! `LOOM_MAX_PREEMPTIONS` is explored, against the crate's own atomics,
//! which `src/sync.rs` switches to loom's under the same cfg. Without loom
//! (the plain `cargo test`) the same bodies run once, on std threads and
//! atomics, as tokio's time tests do: a model body that does not even
//! run to completion once is caught by every test run, not only by the
//! loom step. Assertions about what the checker explored (for example that
//! some interleaving reused a ring cell) hold only under loom and say so.
// Std atomics without loom are the point of this shim (clippy.toml's rule
// is for the library; see src/sync.rs).
#![allow(clippy::disallowed_types)]
#![allow(dead_code, unused_imports)] // each model uses part of it

#[cfg(loom)]
pub use loom::sync::atomic::{AtomicU64, Ordering};
#[cfg(loom)]
pub use loom::sync::{Arc, Mutex};
#[cfg(loom)]
pub use loom::thread;

#[cfg(not(loom))]
pub use std::sync::atomic::{AtomicU64, Ordering};
#[cfg(not(loom))]
pub use std::sync::{Arc, Mutex};
#[cfg(not(loom))]
pub use std::thread;

/// Runs `f` under loom's model checker (`cfg(loom)`), else once.
pub fn model(f: impl Fn() + Sync + Send + 'static) {
    #[cfg(loom)]
    loom::model(f);
    #[cfg(not(loom))]
    f();
}
