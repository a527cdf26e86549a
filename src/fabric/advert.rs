//! [`LeaseAdvert`]: what a worker tells its peers about its lease slots,
//! as a small versioned blob an engine carries inside its own handshake.
//!
//! This module owns the advertisement's byte format, its encoder and its
//! bounds-checked decoder, and [`PeerRecord`] (with [`RemoteRegion`]),
//! everything [`Fabric::add_peer`](super::Fabric::add_peer) needs to
//! register a remote agent from the engine's own handshake. It touches no
//! fabric state.
//!
//! kvlease's own side channel (the NIXL fabric's listener) carries the same
//! facts in its own answer. An engine that exchanges metadata its own way
//! (vLLM's ZMQ side channel and its `NixlAgentMetadata`, SGLang's bootstrap
//! server, a store such as etcd) instead asks its fabric for
//! [`Fabric::lease_advert`](super::Fabric::lease_advert) after registering
//! the slots, puts [`LeaseAdvert::encode`]'s bytes next to its NIXL metadata,
//! and on the other side hands both to `add_peer`.
//!
//! # Layout (version 1, 32 bytes, little-endian)
//!
//! ```text
//!  byte  0        4    5      6          8                  16                 24          28         32
//!        ┌────────┬────┬──────┬──────────┬──────────────────┬──────────────────┬───────────┬──────────┐
//!        │ "KVLA" │ v=1│flags │ reserved │ slot region addr │ slot region len  │ slot count│ reserved │
//!        └────────┴────┴──────┴──────────┴──────────────────┴──────────────────┴───────────┴──────────┘
//!  flags: bit 0 = exports lease slots, bit 1 = accepts compact heartbeats (`HBC:`),
//!         bit 2 = accepts packed heartbeats (`HBP:`); bits 3-7 = later optional capabilities.
//! ```
//!
//! The slot region address is the fabric's own handle for it: the region's
//! virtual address on NIXL, its region index on loopback. Only a fabric of
//! the same kind interprets it. Without slots (flag bit 0 clear) the three
//! slot fields are 0.
//!
//! # Rules the decoder enforces
//!
//! Exactly 32 bytes, the magic, version 1 (a later version is
//! [`AdvertError::UnsupportedVersion`]: treat that peer as one without
//! verification, as vLLM does), reserved bytes 0, and a consistent slot
//! region: with slots, at least one slot and a region of at least 8 bytes
//! per slot; without, all slot fields 0. Every error is typed; nothing
//! panics.
//!
//! # Flag bits a decoder does not know
//!
//! Flag bits 3 to 7 are ignored: each names an optional capability (a form
//! a peer *accepts*), and a peer that does not know one simply does not use
//! it. So a newer peer can announce a new form without an older one reading
//! its advert as invalid. A change an older peer must not miss needs a new
//! version instead. (Builds before bit 2 existed, none of them released,
//! refused every unknown bit: they read a P that sets bit 2 as an advert
//! they cannot decode, and so as a P without verification.)
//!
//! No clock reading travels in the advert: engines encode their handshake
//! message once and serve it many times, so a timestamp in it would be
//! stale. An engine that samples the clock during its exchange passes the
//! sample in [`PeerRecord::clock`].

use super::ClockSample;

/// The advert's magic bytes.
pub const ADVERT_MAGIC: [u8; 4] = *b"KVLA";
/// The version this build writes and reads.
pub const ADVERT_VERSION: u8 = 1;
/// Encoded length of a version-1 advert.
pub const ADVERT_LEN: usize = 32;

const FLAG_SLOTS: u8 = 1 << 0;
const FLAG_COMPACT: u8 = 1 << 1;
const FLAG_PACKED: u8 = 1 << 2;
/// Bytes per lease slot (one `u64` nonce word).
const SLOT_BYTES: u64 = 8;

/// A worker's lease slots as its peers need to know them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LeaseAdvert {
    /// The exported slot region, if any.
    pub slots: Option<SlotRegion>,
    /// The worker accepts compact (slot, nonce) heartbeats (`HBC:`).
    pub compact_heartbeats: bool,
    /// The worker accepts packed (slot, nonce) heartbeats (`HBP:`, the
    /// same records in 16 bytes instead of 24 hex digits: cheaper to
    /// decode; `wire`, form 5). A sender prefers them when both are set.
    pub packed_heartbeats: bool,
}

/// Where a worker's lease slots live, in its fabric's terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SlotRegion {
    /// The fabric's handle for the region (NIXL: its virtual address;
    /// loopback: its region index).
    pub addr: u64,
    /// The region's length in bytes (at least `8 * count`).
    pub len: u64,
    /// Number of lease slots (at least 1).
    pub count: u32,
}

/// Why an advert was refused.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AdvertError {
    /// Not exactly [`ADVERT_LEN`] bytes.
    #[error("lease advert is not {} bytes", ADVERT_LEN)]
    BadLength,
    /// The first four bytes are not `KVLA`.
    #[error("not a lease advert (bad magic)")]
    BadMagic,
    /// A version this build does not read.
    #[error("lease advert version {0} (this build reads {current})", current = ADVERT_VERSION)]
    UnsupportedVersion(u8),
    /// A reserved byte is not 0.
    #[error("lease advert has reserved bits set")]
    NonCanonical,
    /// The slot fields contradict each other (slots without a region large
    /// enough for them, or slot fields without the slots flag).
    #[error("lease advert's slot region is inconsistent")]
    BadSlotRegion,
}

impl LeaseAdvert {
    /// The advert's bytes (see the module docs for the layout).
    pub fn encode(&self) -> [u8; ADVERT_LEN] {
        let mut b = [0u8; ADVERT_LEN];
        b[0..4].copy_from_slice(&ADVERT_MAGIC);
        b[4] = ADVERT_VERSION;
        let mut flags = 0;
        if self.compact_heartbeats {
            flags |= FLAG_COMPACT;
        }
        if self.packed_heartbeats {
            flags |= FLAG_PACKED;
        }
        if let Some(s) = self.slots {
            flags |= FLAG_SLOTS;
            b[8..16].copy_from_slice(&s.addr.to_le_bytes());
            b[16..24].copy_from_slice(&s.len.to_le_bytes());
            b[24..28].copy_from_slice(&s.count.to_le_bytes());
        }
        b[5] = flags;
        b
    }

    /// Decodes an advert, checking every rule in the module docs.
    ///
    /// ```
    /// use kvlease::fabric::LeaseAdvert;
    ///
    /// let p = LeaseAdvert { slots: None, compact_heartbeats: true, packed_heartbeats: true };
    /// let mut bytes = p.encode();
    /// assert_eq!(LeaseAdvert::decode(&bytes), Ok(p));
    /// // A capability bit this build does not know is ignored.
    /// bytes[5] |= 1 << 7;
    /// assert_eq!(LeaseAdvert::decode(&bytes), Ok(p));
    /// ```
    pub fn decode(bytes: &[u8]) -> Result<LeaseAdvert, AdvertError> {
        let b: &[u8; ADVERT_LEN] = bytes.try_into().map_err(|_| AdvertError::BadLength)?;
        if b[0..4] != ADVERT_MAGIC {
            return Err(AdvertError::BadMagic);
        }
        if b[4] != ADVERT_VERSION {
            return Err(AdvertError::UnsupportedVersion(b[4]));
        }
        let flags = b[5];
        // Unknown flag bits are ignored (module docs); reserved bytes are not.
        if b[6..8] != [0, 0] || b[28..32] != [0; 4] {
            return Err(AdvertError::NonCanonical);
        }
        let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
        let (addr, len) = (word(8), word(16));
        let count = u32::from_le_bytes([b[24], b[25], b[26], b[27]]);
        let slots = if flags & FLAG_SLOTS != 0 {
            if count == 0 || len < u64::from(count) * SLOT_BYTES {
                return Err(AdvertError::BadSlotRegion);
            }
            Some(SlotRegion { addr, len, count })
        } else {
            if addr != 0 || len != 0 || count != 0 {
                return Err(AdvertError::BadSlotRegion);
            }
            None
        };
        Ok(LeaseAdvert {
            slots,
            compact_heartbeats: flags & FLAG_COMPACT != 0,
            packed_heartbeats: flags & FLAG_PACKED != 0,
        })
    }
}

/// A remote agent as the engine's own handshake delivered it: what
/// [`Fabric::add_peer`](super::Fabric::add_peer) registers.
#[derive(Clone, Copy, Debug)]
pub struct PeerRecord<'a> {
    /// The remote agent's name (NIXL: the name its metadata carries;
    /// loopback: its name on the network).
    pub agent_name: &'a str,
    /// The remote agent's NIXL metadata (`get_local_md`), taken after every
    /// registration it exports. Loopback ignores it.
    pub metadata: &'a [u8],
    /// The remote's lease advert, decoded; `None` for a peer that does not
    /// speak kvlease (no verification, text heartbeats only).
    pub advert: Option<LeaseAdvert>,
    /// A clock sample, if the engine's exchange took one.
    pub clock: Option<ClockSample>,
    /// Memory of the remote that READs may name besides its lease slots
    /// (its KV blocks), in its fabric's terms, so that
    /// [`Fabric::post_read`](super::Fabric::post_read) serves the KV pull
    /// too. NIXL: remote region `RegionId(i)` is `regions[i]` (a virtual
    /// address and length the remote registered), and the advertised slot
    /// region, if any, comes after them ([`PeerInfo::slot_region`](super::PeerInfo::slot_region)
    /// says which). Loopback ignores it: READs there name the remote's own
    /// registration indices, as after its handshake. Empty when only the
    /// slots are read.
    pub regions: &'a [RemoteRegion],
}

/// A piece of a remote agent's registered memory, as its engine's
/// handshake describes it (NIXL: the virtual address and length it
/// registered; see [`PeerRecord::regions`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    /// The fabric's handle for the region (NIXL: its virtual address).
    pub addr: u64,
    /// Its length in bytes.
    pub len: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_slots(addr: u64, count: u32, compact: bool) -> LeaseAdvert {
        LeaseAdvert {
            slots: Some(SlotRegion {
                addr,
                len: u64::from(count) * 8,
                count,
            }),
            compact_heartbeats: compact,
            packed_heartbeats: compact,
        }
    }

    #[test]
    fn round_trips() {
        for a in [
            with_slots(0x7f00_1234_5000, 1024, true),
            with_slots(0, 1, false),
            with_slots(u64::MAX - 8, 1, true),
            LeaseAdvert {
                slots: None,
                compact_heartbeats: false,
                packed_heartbeats: false,
            },
            LeaseAdvert {
                slots: None,
                compact_heartbeats: true,
                packed_heartbeats: false,
            },
            LeaseAdvert {
                slots: None,
                compact_heartbeats: false,
                packed_heartbeats: true,
            },
        ] {
            let b = a.encode();
            assert_eq!(LeaseAdvert::decode(&b), Ok(a), "{a:?}");
        }
    }

    #[test]
    fn layout_is_as_documented() {
        let b = with_slots(0x1122_3344_5566_7788, 3, true).encode();
        assert_eq!(&b[0..4], b"KVLA");
        assert_eq!(b[4], 1);
        assert_eq!(b[5], 0b111);
        assert_eq!(&b[8..16], &0x1122_3344_5566_7788u64.to_le_bytes());
        assert_eq!(&b[16..24], &24u64.to_le_bytes());
        assert_eq!(&b[24..28], &3u32.to_le_bytes());
        assert_eq!(&b[28..32], &[0; 4]);
    }

    #[test]
    fn refuses_what_breaks_a_rule() {
        let good = with_slots(4096, 16, true).encode();
        assert_eq!(
            LeaseAdvert::decode(&good[..31]),
            Err(AdvertError::BadLength)
        );
        let mut long = good.to_vec();
        long.push(0);
        assert_eq!(LeaseAdvert::decode(&long), Err(AdvertError::BadLength));
        let mut b = good;
        b[0] = b'X';
        assert_eq!(LeaseAdvert::decode(&b), Err(AdvertError::BadMagic));
        let mut b = good;
        b[4] = 2;
        assert_eq!(
            LeaseAdvert::decode(&b),
            Err(AdvertError::UnsupportedVersion(2))
        );
        for (i, v) in [(6, 1), (7, 1), (28, 1), (31, 1)] {
            let mut b = good;
            b[i] = v;
            assert_eq!(
                LeaseAdvert::decode(&b),
                Err(AdvertError::NonCanonical),
                "byte {i}"
            );
        }
        // Slots flag with zero slots, or a region too small for them.
        let mut b = good;
        b[24..28].copy_from_slice(&0u32.to_le_bytes());
        assert_eq!(LeaseAdvert::decode(&b), Err(AdvertError::BadSlotRegion));
        let mut b = good;
        b[16..24].copy_from_slice(&127u64.to_le_bytes());
        assert_eq!(LeaseAdvert::decode(&b), Err(AdvertError::BadSlotRegion));
        // Slot fields without the flag.
        let mut b = good;
        b[5] = 0;
        assert_eq!(LeaseAdvert::decode(&b), Err(AdvertError::BadSlotRegion));
    }

    #[test]
    fn a_huge_slot_count_does_not_overflow() {
        let mut b = with_slots(0, 1, false).encode();
        b[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
        b[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        let a = LeaseAdvert::decode(&b).expect("u32::MAX slots fit in a u64 length");
        assert_eq!(a.slots.map(|s| s.count), Some(u32::MAX));
    }

    #[test]
    fn unknown_flag_bits_are_ignored_known_ones_kept() {
        let a = with_slots(4096, 16, true);
        for bit in 3..8 {
            let mut b = a.encode();
            b[5] |= 1 << bit;
            assert_eq!(LeaseAdvert::decode(&b), Ok(a), "bit {bit}");
        }
        // Each known bit decodes on its own.
        let mut b = a.encode();
        b[5] = 0b101;
        let d = LeaseAdvert::decode(&b).expect("slots + packed");
        assert!(d.packed_heartbeats && !d.compact_heartbeats);
    }
}
