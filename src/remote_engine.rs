//! A P engine as D names it: its key ([`EngineKey`]: engine id, host, port,
//! P's TP size), the key's byte form, and the handle of the tracker slot
//! that holds it ([`EngineHandle`]).
//!
//! This module owns only those names. D's scheduler groups requests by key
//! and hands out handles ([`crate::consumer::HeartbeatTracker`]); its
//! workers keep the key to address a P rank again
//! ([`crate::consumer::HeartbeatSender`]); the role messages carry both
//! ([`crate::ipc::plan`], [`crate::ipc::outcome`]). It sits below all three,
//! so each imports it downward; it imports nothing of theirs.

/// Longest `remote_host` accepted, in bytes (a DNS name is at most 253).
pub const MAX_HOST_LEN: usize = 255;

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

/// Bytes the encoded key of an engine id of `id_len` bytes and a host of
/// `host_len` bytes takes.
pub(crate) const fn encoded_key_len(id_len: usize, host_len: usize) -> usize {
    2 + id_len + 2 + host_len + 2 + 4
}

/// Bytes an encoded key can take with ids of up to `max_id_len` bytes.
pub(crate) const fn encoded_key_capacity(max_id_len: usize) -> usize {
    encoded_key_len(max_id_len, MAX_HOST_LEN)
}

/// `[len u16][engine_id][len u16][host][port u16][tp u32]`, little endian:
/// unambiguous for any strings. The caller checked the lengths against
/// `buf` ([`encoded_key_len`]). Returns the length written.
pub(crate) fn encode_key(buf: &mut [u8], engine_id: &str, host: &str, port: u16, tp: u32) -> usize {
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
pub(crate) fn decode_key(b: &[u8]) -> EngineKey<'_> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_round_trips() {
        let mut buf = [0u8; 64];
        let n = encode_key(&mut buf, "eng", "10.0.0.1", 5600, 4);
        assert_eq!(n, encoded_key_len(3, 8));
        let k = decode_key(&buf[..n]);
        assert_eq!(
            k,
            EngineKey {
                engine_id: "eng",
                host: "10.0.0.1",
                port: 5600,
                tp_size: 4
            }
        );
    }
}
