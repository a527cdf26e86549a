//! P's decision on one turn-2 read (bidirectional mode): decline, read as
//! vLLM does, or read and verify.
//!
//! This module owns only the rule that combines the three inputs: the clock
//! gate ([`ClockOffset::check_read`]), whether P verifies
//! (`kv_lease_verification`), and what D offered (lease slots advertised in
//! its handshake, lease fields in the request's params). It posts no READ,
//! submits no check and reads no clock.
//!
//! | gate | P verifies | D advertises slots | fields in params | decision |
//! |---|---|---|---|---|
//! | decline / no sample | any | any | any | [`Turn2Read::Decline`] (recompute) |
//! | read | yes | yes | yes | [`Turn2Read::Verified`]: READ, then `LeaseVerifier::submit` |
//! | read | yes | yes | no | [`Turn2Read::Decline`]: a router dropped them; reading would be unverified |
//! | read | yes | no | any | [`Turn2Read::Unverified`]: a D that does not speak it (vLLM) |
//! | read | no | any | any | [`Turn2Read::Unverified`]: vLLM's behaviour |
//!
//! Verification is therefore on exactly when both sides advertise it. A
//! declined read is a recompute, never a failed request.
//!
//! ```
//! use kvlease::clock_offset::{ClockOffset, ClockOffsetConfig};
//! use kvlease::fabric::{ClockSample, PeerInfo, RegionId};
//! use kvlease::turn2_read::{decide, Turn2Read};
//! use kvlease::{Instant, LeaseFields, Nonce};
//!
//! let mut clock = ClockOffset::new(ClockOffsetConfig::default());
//! clock.observe(ClockSample {
//!     local_send: Instant::from_secs(1),
//!     remote: Instant::from_secs(101),
//!     local_recv: Instant::from_secs(1),
//! });
//! let d = PeerInfo { slot_region: Some(RegionId(0)), slot_count: 64, compact_heartbeats: true, clock: None };
//! let lease = LeaseFields { slot: 3, nonce: Nonce::new(9).unwrap() };
//! let fields = Some(lease);
//! let deadline = Some(Instant::from_secs(100 + 480));
//! let now = Instant::from_secs(2);
//! assert_eq!(decide(&mut clock, deadline, fields, &d, true, now), Turn2Read::Verified(lease));
//! assert_eq!(decide(&mut clock, deadline, None, &d, true, now), Turn2Read::Decline);
//! assert_eq!(decide(&mut clock, deadline, fields, &d, false, now), Turn2Read::Unverified);
//! ```

use crate::clock_offset::{ClockOffset, ReadGate};
use crate::fabric::PeerInfo;
use crate::lease_fields::LeaseFields;
use crate::time::Instant;

/// What P does with one turn-2 read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Turn2Read {
    /// Do not read: recompute the prefix.
    Decline,
    /// Read, then verify these fields on D's slot before using the KV.
    Verified(LeaseFields),
    /// Read and use the KV unverified (vLLM's behaviour).
    Unverified,
}

/// Decides one turn-2 read; see the module docs for the table. The gate's
/// verdict is counted in `clock`'s counters.
pub fn decide(
    clock: &mut ClockOffset,
    remote_deadline: Option<Instant>,
    fields: Option<LeaseFields>,
    d: &PeerInfo,
    verification: bool,
    now: Instant,
) -> Turn2Read {
    if clock.check_read(remote_deadline, now) != ReadGate::Read {
        return Turn2Read::Decline;
    }
    if !verification || d.slot_region.is_none() {
        return Turn2Read::Unverified;
    }
    match fields {
        Some(f) => Turn2Read::Verified(f),
        None => Turn2Read::Decline,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock_offset::ClockOffsetConfig;
    use crate::fabric::{ClockSample, RegionId};
    use crate::nonce::Nonce;

    #[test]
    fn every_row_of_the_table() {
        let mut clock = ClockOffset::new(ClockOffsetConfig::default());
        let lease = LeaseFields {
            slot: 1,
            nonce: Nonce::new(5).unwrap(),
        };
        let fields = Some(lease);
        let slots = PeerInfo {
            slot_region: Some(RegionId(0)),
            slot_count: 8,
            compact_heartbeats: true,
            clock: None,
        };
        let vllm = PeerInfo {
            slot_region: None,
            compact_heartbeats: false,
            ..slots
        };
        let far = Some(Instant::from_secs(1_000));
        let now = Instant::from_secs(10);
        // No sample yet: decline, whatever else holds.
        assert_eq!(
            decide(&mut clock, far, fields, &slots, true, now),
            Turn2Read::Decline
        );
        clock.observe(ClockSample {
            local_send: now,
            remote: now,
            local_recv: now,
        });
        let near = Some(Instant::from_secs(12));
        assert_eq!(
            decide(&mut clock, near, fields, &slots, true, now),
            Turn2Read::Decline
        );
        assert_eq!(
            decide(&mut clock, far, fields, &slots, true, now),
            Turn2Read::Verified(lease)
        );
        assert_eq!(
            decide(&mut clock, far, None, &slots, true, now),
            Turn2Read::Decline
        );
        assert_eq!(
            decide(&mut clock, far, None, &vllm, true, now),
            Turn2Read::Unverified
        );
        assert_eq!(
            decide(&mut clock, far, fields, &slots, false, now),
            Turn2Read::Unverified
        );
        // No deadline (dropped by a router): read, as vLLM does.
        assert_eq!(
            decide(&mut clock, None, fields, &slots, true, now),
            Turn2Read::Verified(lease)
        );
        let c = clock.counters();
        assert_eq!(
            (c.declined_no_sample, c.declined, c.allowed, c.no_deadline),
            (1, 1, 4, 1)
        );
    }
}
