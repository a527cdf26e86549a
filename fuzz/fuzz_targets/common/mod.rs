//! What the fuzz targets share: drawing an operation program from the
//! input with `arbitrary`, bounded draws for `#[arbitrary(with = ...)]`,
//! and the IPC frame header that wraps random bodies. Included by the
//! targets with `#[path = "common/mod.rs"] mod common;` (cargo-fuzz builds
//! each target as its own crate).
#![allow(dead_code)] // each target uses part of it

use arbitrary::{Arbitrary, Unstructured};
use kvlease::ipc::{MsgKind, FRAME_MAGIC, FRAME_VERSION};

/// The input as a program: operations drawn until the bytes run out. Every
/// byte string is a valid program (a draw from too few bytes pads with
/// zeros), so no input is rejected.
pub fn program<'a, T: Arbitrary<'a>>(data: &'a [u8]) -> impl Iterator<Item = T> + 'a {
    let mut u = Unstructured::new(data);
    std::iter::from_fn(move || {
        if u.is_empty() {
            None
        } else {
            T::arbitrary(&mut u).ok()
        }
    })
}

/// A draw in `0..=MAX`, for `#[arbitrary(with = upto::<MAX>)]`.
pub fn upto<const MAX: u8>(u: &mut Unstructured<'_>) -> arbitrary::Result<u8> {
    u.int_in_range(0..=MAX)
}

/// `body` behind a frame header of `kind` that agrees with its length:
/// `records` and `extras` fixed-size records of `record_len` and
/// `extra_len` bytes, whatever the body holds beyond them as the id area.
pub struct Frame {
    pub kind: MsgKind,
    pub sender: u32,
    pub seq: u32,
    pub records: u32,
    pub record_len: usize,
    pub extras: u32,
    pub extra_len: usize,
}

impl Frame {
    pub fn wrap(&self, body: &[u8]) -> Vec<u8> {
        let sections =
            self.records as usize * self.record_len + self.extras as usize * self.extra_len;
        let ids_len = body.len().saturating_sub(sections) as u32;
        let mut out = Vec::with_capacity(32 + body.len());
        out.extend_from_slice(&FRAME_MAGIC);
        out.extend_from_slice(&FRAME_VERSION.to_le_bytes());
        out.extend_from_slice(&self.kind.code().to_le_bytes());
        out.extend_from_slice(&self.sender.to_le_bytes());
        out.extend_from_slice(&self.seq.to_le_bytes());
        out.extend_from_slice(&self.records.to_le_bytes());
        out.extend_from_slice(&self.extras.to_le_bytes());
        out.extend_from_slice(&ids_len.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(body);
        out
    }
}
