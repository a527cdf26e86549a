//! The side channel's parser and the request cache's descriptor hash.

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
