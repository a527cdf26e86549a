//! The one place that decides between std and loom atomics.
//!
//! Everything in the crate that is shared between threads (the lease-slot
//! array, the slot pool, the loopback queues) imports its atomics from here,
//! so that building with `RUSTFLAGS="--cfg loom"` runs the very same code
//! under loom's model checker (`loom_tests/`). Nothing else in the crate may
//! name `std::sync::atomic` directly.
//!
//! `Arc` is deliberately *not* switched: it appears in public signatures
//! (`Arc<LeaseSlots>`), which must not change type under loom. Loom models
//! share values through `loom::sync::Arc` themselves; what they check is the
//! atomics inside.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
