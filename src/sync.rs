//! The one place that decides between std and loom atomics.
//!
//! Everything in the crate that is shared between threads (the lease-slot
//! array, the slot pool, the loopback queues and fault tables, the lease
//! verifier's landing cells) imports its atomics from here, so that building
//! with `RUSTFLAGS="--cfg loom"` runs the very same code under loom's model
//! checker (`loom_tests/`). Nothing else in the crate may name
//! `std::sync::atomic` (or `core::sync::atomic`) atomics directly.
//!
//! # How the rule is enforced
//!
//! `clippy.toml` disallows the std/core `AtomicU64`, `AtomicU32`,
//! `AtomicUsize` and `AtomicBool` types, and `cargo clippy --all-targets
//! -- -D warnings` (the gate) turns a use into an error. The lint matches
//! *types*, not paths, so a plain `pub use std::sync::atomic::AtomicU64`
//! here would make every user of `crate::sync::AtomicU64` trip it too.
//! Outside loom this module therefore exports `#[repr(transparent)]`
//! newtypes that deref to the std atomic: same layout (the slot array and
//! the verifier's landing cells are registered with the fabric as raw
//! `u64` words), the same methods (through `Deref`), no cost, and a type
//! of their own that the lint does not name. This file holds the only
//! `allow(clippy::disallowed_types)` of the library.
//!
//! Test code may use std atomics: they count things across test threads
//! and are not what loom checks. The library's unit tests are allowed in
//! `src/lib.rs` (`cfg_attr(test, allow(..))`: the non-test build of the
//! library, which clippy also checks, stays under the rule), and each
//! integration test or loom model that needs one says so in its own file.
//!
//! Under loom the verifier's landing cells are loom atomics; that compiles,
//! but their raw registration means nothing to loom, so no loom model drives
//! the verifier (a remote READ writing raw bytes is not something loom can
//! model). They are checked by the unit and protocol tests instead.
//!
//! `Arc` is deliberately *not* switched: it appears in public signatures
//! (`Arc<LeaseSlots>`), which must not change type under loom. Loom models
//! share values through `loom::sync::Arc` themselves; what they check is the
//! atomics inside.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::Ordering;

#[cfg(not(loom))]
pub(crate) use std_atomics::{AtomicU32, AtomicU64};

/// The std atomics behind the crate's own types. The `allow` below is the
/// library's only exemption from `clippy.toml`'s `disallowed-types`.
#[cfg(not(loom))]
#[allow(clippy::disallowed_types)]
mod std_atomics {
    use core::fmt;
    use core::ops::Deref;

    macro_rules! atomic {
        ($name:ident, $int:ty) => {
            /// A std atomic under the crate's own name (see the module docs).
            #[repr(transparent)]
            #[derive(Default)]
            pub(crate) struct $name(std::sync::atomic::$name);

            impl $name {
                /// A new atomic holding `v`.
                #[inline]
                pub(crate) const fn new(v: $int) -> $name {
                    $name(std::sync::atomic::$name::new(v))
                }
            }

            impl Deref for $name {
                type Target = std::sync::atomic::$name;
                #[inline(always)]
                fn deref(&self) -> &Self::Target {
                    &self.0
                }
            }

            impl fmt::Debug for $name {
                /// As the std atomic prints: just the value.
                fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    fmt::Debug::fmt(&self.0, f)
                }
            }
        };
    }

    atomic!(AtomicU64, u64);
    atomic!(AtomicU32, u32);

    // The exported words must keep the layout of the integers they hold.
    const _: () = assert!(core::mem::size_of::<AtomicU64>() == 8);
    const _: () = assert!(core::mem::align_of::<AtomicU64>() == 8);
    const _: () = assert!(core::mem::size_of::<AtomicU32>() == 4);
}
