//! Fixed-capacity collections the step paths share.
//!
//! This module owns three small containers, each allocated once at
//! construction and never again: [`FreeStack`] (free indices, handed out
//! lowest first), [`DenseSet`] (a set of small indices iterated densely) and
//! [`Ring`] (a FIFO of `Copy` values). They know nothing about leases; the
//! structures that use them decide what an index means.
//!
//! None of them grows. Each says in its docs what happens when it is full,
//! and every caller sizes it so that "full" cannot happen for well-formed
//! input (a `debug_assert!` pins that), while malformed input is refused,
//! never a panic in release builds.

mod dense_set;
mod free_stack;
mod ring;

pub(crate) use dense_set::DenseSet;
pub(crate) use free_stack::FreeStack;
pub(crate) use ring::Ring;
