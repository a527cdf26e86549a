//! A P engine as the tracker groups requests: its key (engine id, host,
//! port, TP size), stored encoded in one buffer, and the handle to a live
//! engine.

use super::*;

/// A P engine as heartbeats see it: the grouping key of the tracker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EngineKey<'a> {
    /// `remote_engine_id`.
    pub engine_id: &'a str,
    /// `remote_host`.
    pub host: &'a str,
    /// `remote_port`.
    pub port: u16,
    /// `tp_size` (P's).
    pub tp_size: u32,
}

/// A live engine's slot in the tracker plus the generation that slot had when
/// the handle was taken: a handle to an engine that has since disappeared
/// (and whose slot may hold another engine now) resolves to nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EngineHandle {
    /// Slot index, `0..max_remote_engines`.
    pub index: u32,
    /// Bumped each time the slot takes a new engine.
    pub generation: u32,
}

/// One tracked request as a heartbeat needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TrackedRemote<'t> {
    /// The id P knows the request by.
    pub remote_request_id: &'t str,
    /// Its lease slot and nonce, when P exported them.
    pub lease: Option<LeaseFields>,
}

/// Bytes an encoded key can take with ids of up to `max_id_len` bytes.
pub(super) fn encoded_key_capacity(max_id_len: usize) -> usize {
    2 + max_id_len + 2 + MAX_HOST_LEN + 2 + 4
}

/// `[len u16][engine_id][len u16][host][port u16][tp u32]`, little endian:
/// unambiguous for any strings. The caller checked the lengths against
/// `encoded_key_capacity`. Returns the length written.
pub(super) fn encode_key(buf: &mut [u8], engine_id: &str, host: &str, port: u16, tp: u32) -> usize {
    let mut at = 0;
    let mut put = |bytes: &[u8]| {
        if let Some(dst) = buf.get_mut(at..at + bytes.len()) {
            dst.copy_from_slice(bytes);
        }
        at += bytes.len();
    };
    put(&(engine_id.len() as u16).to_le_bytes());
    put(engine_id.as_bytes());
    put(&(host.len() as u16).to_le_bytes());
    put(host.as_bytes());
    put(&port.to_le_bytes());
    put(&tp.to_le_bytes());
    debug_assert!(at <= buf.len());
    at.min(buf.len())
}

/// Inverse of [`encode_key`]. Keys are written only by `encode_key`, so the
/// fallbacks (empty strings, zeros) are unreachable.
pub(super) fn decode_key(b: &[u8]) -> EngineKey<'_> {
    fn take<'b>(b: &mut &'b [u8], n: usize) -> &'b [u8] {
        let n = n.min(b.len());
        let (head, rest) = b.split_at(n);
        *b = rest;
        head
    }
    fn u16_of(x: &[u8]) -> u16 {
        x.try_into().map(u16::from_le_bytes).unwrap_or(0)
    }
    let mut b = b;
    let elen = usize::from(u16_of(take(&mut b, 2)));
    let engine_id = core::str::from_utf8(take(&mut b, elen)).unwrap_or("");
    let hlen = usize::from(u16_of(take(&mut b, 2)));
    let host = core::str::from_utf8(take(&mut b, hlen)).unwrap_or("");
    let port = u16_of(take(&mut b, 2));
    let tp_size = take(&mut b, 4)
        .try_into()
        .map(u32::from_le_bytes)
        .unwrap_or(0);
    debug_assert!(b.is_empty() && tp_size != 0);
    EngineKey {
        engine_id,
        host,
        port,
        tp_size,
    }
}
