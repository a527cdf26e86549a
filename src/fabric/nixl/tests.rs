//! The side channel's parser, the request cache's descriptor hash and the
//! peer table (ids, eviction order): the parts that need no NIXL runtime.

use super::side_channel::parse_body;
use super::*;

fn sample() -> ClockSample {
    ClockSample {
        local_send: Instant::from_nanos(1),
        remote: Instant::from_nanos(2),
        local_recv: Instant::from_nanos(3),
    }
}

fn body(name: &[u8], slot_region: u32, slot_count: u32, regions: &[(u64, u64)]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&(name.len() as u16).to_le_bytes());
    b.extend_from_slice(name);
    b.extend_from_slice(&slot_region.to_le_bytes());
    b.extend_from_slice(&slot_count.to_le_bytes());
    b.push(1);
    b.extend_from_slice(&(regions.len() as u32).to_le_bytes());
    for (a, l) in regions {
        b.extend_from_slice(&a.to_le_bytes());
        b.extend_from_slice(&l.to_le_bytes());
    }
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(b"md!");
    b
}

#[test]
fn parses_a_well_formed_answer() {
    let r = parse_body(&body(b"P0", 0, 4, &[(4096, 32), (8192, 100)]), sample()).unwrap();
    assert_eq!(r.name, "P0");
    assert_eq!(r.slot_region, Some(0));
    assert_eq!(r.slot_count, 4);
    assert!(r.compact);
    assert_eq!(r.regions, vec![(4096, 32), (8192, 100)]);
    assert_eq!(r.md, b"md!");
    let none = parse_body(&body(b"P0", NO_REGION, 9, &[]), sample()).unwrap();
    assert_eq!((none.slot_region, none.slot_count), (None, 0));
}

#[test]
fn every_truncation_and_corruption_is_a_typed_error() {
    let good = body(b"P0", 0, 4, &[(4096, 32)]);
    for cut in 0..good.len() {
        assert_eq!(
            parse_body(&good[..cut], sample()).unwrap_err(),
            FabricError::PeerUnreachable
        );
    }
    let mut trailing = good.clone();
    trailing.push(0);
    assert!(parse_body(&trailing, sample()).is_err());
    // Slot region out of the table, slot count larger than the region,
    // non-UTF-8 name, empty name, overflowing region, huge counts.
    assert!(parse_body(&body(b"P0", 1, 4, &[(4096, 32)]), sample()).is_err());
    assert!(parse_body(&body(b"P0", 0, 5, &[(4096, 32)]), sample()).is_err());
    assert!(parse_body(&body(&[0xff, 0xfe], 0, 4, &[(4096, 32)]), sample()).is_err());
    assert!(parse_body(&body(b"", 0, 4, &[(4096, 32)]), sample()).is_err());
    assert!(parse_body(&body(b"P0", 0, 4, &[(u64::MAX, 32)]), sample()).is_err());
    let mut huge = body(b"P0", NO_REGION, 0, &[]);
    let at = 2 + 2 + 4 + 4 + 1;
    huge[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(parse_body(&huge, sample()).is_err());
}

#[test]
fn descriptor_hash_depends_on_every_field() {
    let d = ReadDesc {
        local: RegionId(0),
        local_offset: 8,
        remote: RegionId(1),
        remote_offset: 16,
        len: 8,
    };
    let base = desc_hash(&[d]);
    for changed in [
        ReadDesc {
            local: RegionId(1),
            ..d
        },
        ReadDesc {
            local_offset: 0,
            ..d
        },
        ReadDesc {
            remote: RegionId(0),
            ..d
        },
        ReadDesc {
            remote_offset: 8,
            ..d
        },
        ReadDesc { len: 16, ..d },
    ] {
        assert_ne!(desc_hash(&[changed]), base);
    }
    assert_eq!(desc_hash(&[d, d]), desc_hash(&[d, d]));
}

fn peer(state: PeerState, last_used: u64) -> Peer {
    Peer {
        address: format!("p{last_used}"),
        registered: false,
        state,
        name: None,
        last_used,
    }
}

fn ready() -> PeerState {
    PeerState::Ready {
        info: PeerInfo {
            slot_region: None,
            slot_count: 0,
            compact_heartbeats: false,
            clock: None,
        },
        regions: Vec::new(),
    }
}

#[test]
fn peer_ids_carry_a_generation_so_a_retired_id_stays_unknown() {
    for (capacity, bits) in [
        (1, 1),
        (2, 1),
        (3, 2),
        (64, 6),
        (65, 7),
        (MAX_PEER_TABLE, 20),
    ] {
        let mut t = PeerTable::new(capacity);
        let i = capacity - 1;
        let first = t.insert(i, peer(ready(), 1));
        assert_eq!(first, AgentId(i as u32), "generation 0 ids are the entry");
        assert_eq!(t.index(first), Some(i));
        assert!(t.take(i).is_some());
        assert_eq!(t.index(first), None);
        let second = t.insert(i, peer(ready(), 2));
        // Generation 1 sits just above the index bits.
        assert_eq!(
            second,
            AgentId((1 << bits) | i as u32),
            "capacity {capacity}"
        );
        assert_eq!((t.index(first), t.index(second)), (None, Some(i)));
        assert_eq!(t.live(), 1);
    }
    // Ids never issued, or beyond the table, are unknown.
    let t = PeerTable::new(64);
    for id in [0, 13, 77, u32::MAX] {
        assert_eq!(t.index(AgentId(id)), None);
    }
    // A generation wraps after 2^(32 - bits) reuses of one entry, and stays
    // inside its bits (the id's index part is never disturbed).
    let mut t = PeerTable::new(1 << 20);
    let mut ids = Vec::new();
    for round in 0..(1u32 << 12) + 1 {
        ids.push(t.insert(5, peer(ready(), u64::from(round))));
        assert_eq!(ids.last().unwrap().0 & ((1 << 20) - 1), 5);
        t.take(5);
    }
    assert_eq!(ids[0], ids[1 << 12], "wrapped after 4096 reuses");
    assert_ne!(ids[0], ids[1]);
}

#[test]
fn eviction_takes_failed_peers_first_then_the_least_recently_used() {
    let mut t = PeerTable::new(4);
    t.insert(0, peer(ready(), 10));
    t.insert(1, peer(ready(), 5));
    t.insert(2, peer(PeerState::Failed(FabricError::TimedOut), 20));
    t.insert(3, peer(ready(), 1));
    assert_eq!(t.free_entry(), None);
    // A failed peer goes first, however recent.
    assert_eq!(t.victim([].into_iter()), Some(2));
    // ... unless a READ of it is in flight; then the least recently used.
    assert_eq!(t.victim([2, 3].into_iter()), Some(1));
    // The scratch marks do not stick.
    assert_eq!(t.victim([].into_iter()), Some(2));
    t.take(2);
    assert_eq!(t.victim([].into_iter()), Some(3));
    // Every peer busy: nobody.
    assert_eq!(t.victim([0, 1, 3].into_iter()), None);
    assert_eq!(t.free_entry(), Some(2));
    assert_eq!(t.find("p10"), Some(0));
    assert_eq!(t.find("nobody"), None);
}
