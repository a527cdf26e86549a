//! [`EngineKeys`]: the key of the engine in each of the sender's slots,
//! kept so that a P rank's handshake can start again without a plan.
//!
//! This file owns only that store. A plan entry carries every request id of
//! its engine, but the address of a P rank needs only the engine's key
//! (engine id, host, port, TP size) and the rank. Kept from the batch that
//! brought the engine into its slot, the key lets the sender retry a failed
//! handshake when its backoff runs out, or start again with a peer the
//! fabric forgot, at the end of any step, with no plan. So an unreachable P
//! rank costs no plan at all, and the sender asks for an engine only once
//! one of its owed ranks can take the heartbeat (module docs, "Owed
//! heartbeats").
//!
//! Fixed capacity: one key per engine slot, of up to
//! [`SenderConfig::max_address_len`] bytes of engine id and host. A key
//! longer than that is not kept (the default address formats could not
//! address its engine anyway); that engine's retries then wait for a plan,
//! which brings the key.

use crate::remote_engine::{decode_key, encode_key, encoded_key_len, EngineKey};

#[cfg(doc)]
use super::SenderConfig;

#[derive(Debug)]
pub(super) struct EngineKeys {
    bytes: Box<[u8]>,
    /// Per slot: the encoded key's length; 0 when none is kept.
    lens: Box<[u16]>,
    /// Bytes per slot.
    stride: usize,
}

impl EngineKeys {
    /// Room for `engines` keys of up to `max_text` bytes of engine id and
    /// host each.
    pub(super) fn new(engines: u32, max_text: u32) -> EngineKeys {
        let stride = encoded_key_len(max_text as usize, 0).min(usize::from(u16::MAX));
        EngineKeys {
            bytes: vec![0; engines as usize * stride].into_boxed_slice(),
            lens: vec![0; engines as usize].into_boxed_slice(),
            stride,
        }
    }

    /// Keeps `key` for slot `e`, in place of what the slot held. Returns
    /// whether it fit; if not, the slot keeps no key.
    pub(super) fn keep(&mut self, e: u32, key: &EngineKey<'_>) -> bool {
        let Some(len) = self.lens.get_mut(e as usize) else {
            return false;
        };
        *len = 0;
        let need = encoded_key_len(key.engine_id.len(), key.host.len());
        // `stride` is at most u16::MAX, so the lengths fit their u16 fields.
        if need > self.stride {
            return false;
        }
        let at = e as usize * self.stride;
        let Some(buf) = self.bytes.get_mut(at..at + need) else {
            return false;
        };
        let n = encode_key(buf, key.engine_id, key.host, key.port, key.tp_size);
        *len = n as u16;
        true
    }

    /// The key kept for slot `e`, if any.
    pub(super) fn get(&self, e: u32) -> Option<EngineKey<'_>> {
        let len = usize::from(*self.lens.get(e as usize)?);
        if len == 0 {
            return None;
        }
        let at = e as usize * self.stride;
        self.bytes.get(at..at + len).map(decode_key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key<'a>(engine_id: &'a str, host: &'a str) -> EngineKey<'a> {
        EngineKey {
            engine_id,
            host,
            port: 5600,
            tp_size: 2,
        }
    }

    #[test]
    fn keeps_one_key_per_slot_and_refuses_what_does_not_fit() {
        let mut k = EngineKeys::new(3, 17);
        assert_eq!(k.get(0), None);
        assert!(k.keep(0, &key("prefill-0", "10.0.0.7")));
        assert!(k.keep(2, &key("p", "h")));
        assert_eq!(k.get(0), Some(key("prefill-0", "10.0.0.7")));
        assert_eq!(k.get(1), None);
        assert_eq!(k.get(2), Some(key("p", "h")));
        // 18 bytes of id and host: not kept, and the old key is gone.
        assert!(!k.keep(0, &key("prefill-00", "10.0.0.7")));
        assert_eq!(k.get(0), None);
        // A slot beyond the store.
        assert!(!k.keep(3, &key("p", "h")));
        assert_eq!(k.get(3), None);
    }
}
