//! Fuzz target for `kvlease::fabric::LeaseAdvert::decode`, the advert an
//! engine carries in its own handshake message (bytes from a peer).
//!
//! Every input is tried as it is and behind a valid magic and version
//! (so that the rest of the decoder is reached, not only its first check).
//! Decoding never panics; an advert that decodes re-encodes to the very
//! same bytes except for the flag bits this build does not know (3 to 7,
//! which a decoder ignores: the format is otherwise canonical), and
//! describes a usable slot region (at least one slot, 8 bytes each).
#![no_main]

use kvlease::fabric::{LeaseAdvert, ADVERT_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    check(data);
    let mut framed = [0u8; ADVERT_LEN];
    framed[..4].copy_from_slice(b"KVLA");
    framed[4] = 1;
    let n = data.len().min(ADVERT_LEN - 5);
    framed[5..5 + n].copy_from_slice(&data[..n]);
    check(&framed);
});

fn check(bytes: &[u8]) {
    let Ok(advert) = LeaseAdvert::decode(bytes) else {
        return;
    };
    let mut known = [0u8; ADVERT_LEN];
    known.copy_from_slice(bytes);
    known[5] &= 0b111;
    assert_eq!(
        advert.encode(),
        known,
        "decoded adverts re-encode exactly, less the unknown flag bits"
    );
    if let Some(s) = advert.slots {
        assert!(s.count >= 1);
        assert!(s.len >= u64::from(s.count) * 8);
    }
}
