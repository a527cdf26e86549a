//! [`LeaseFields`]: the pair `(remote_lease_slot, remote_lease_nonce)` that
//! travels in `kv_transfer_params` from P to D.
//!
//! One type for the three places that handle the pair: P's grant exports it,
//! D's tracker carries it into compact heartbeats, and D's verifier checks it
//! after the READ. A request without the pair (a router dropped it, or P had
//! no free slot) has `Option<LeaseFields>::None`, and a verifying decoder
//! declines its KV.

use crate::nonce::Nonce;
use crate::wire::CompactEntry;

/// A lease's slot on P and the nonce P wrote into it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LeaseFields {
    /// `remote_lease_slot`: the index into every P rank's slot array.
    pub slot: u32,
    /// `remote_lease_nonce`: the value the slot holds while P holds the blocks.
    pub nonce: Nonce,
}

impl LeaseFields {
    /// The pair from `kv_transfer_params` as vLLM carries it (integers, either
    /// possibly absent; the nonce in the seed's signed int64 form, see
    /// [`crate::nonce`]); `None` when either is absent or the nonce is 0,
    /// which no lease ever has.
    pub fn from_params(slot: Option<u32>, nonce: Option<i64>) -> Option<LeaseFields> {
        Some(LeaseFields {
            slot: slot?,
            nonce: Nonce::from_int64(nonce?)?,
        })
    }

    /// `remote_lease_nonce` as `kv_transfer_params` carries it: the seed's
    /// int64 (positive, and below 2^53, for every nonce kvlease draws).
    pub fn nonce_param(&self) -> i64 {
        self.nonce.as_int64()
    }
}

/// A compact heartbeat renews a lease by exactly these two fields.
impl From<LeaseFields> for CompactEntry {
    fn from(f: LeaseFields) -> CompactEntry {
        CompactEntry {
            slot: f.slot,
            nonce: f.nonce,
        }
    }
}

impl From<CompactEntry> for LeaseFields {
    fn from(e: CompactEntry) -> LeaseFields {
        LeaseFields {
            slot: e.slot,
            nonce: e.nonce,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_params_needs_both_and_a_nonzero_nonce() {
        let f = LeaseFields::from_params(Some(3), Some(9)).unwrap();
        assert_eq!((f.slot, f.nonce.get()), (3, 9));
        assert_eq!(LeaseFields::from_params(None, Some(9)), None);
        assert_eq!(LeaseFields::from_params(Some(3), None), None);
        assert_eq!(LeaseFields::from_params(Some(3), Some(0)), None);
    }

    #[test]
    fn a_negative_int64_nonce_from_a_foreign_p_is_a_lease() {
        // A foreign P's int64 slot cell may hold a negative value; its bits
        // are what D's slot READ lands.
        let f = LeaseFields::from_params(Some(3), Some(-42)).unwrap();
        assert_eq!(f.nonce.get(), (-42i64) as u64);
        assert_eq!(f.nonce_param(), -42);
    }
}
