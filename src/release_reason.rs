//! [`ReleaseReason`]: why a P lease, or one rank's share of it, ended.
//!
//! This module owns only the reason and how two ranks' reasons combine. A
//! rank decides it ([`crate::PrefillRank`]), its report carries it to the
//! scheduler ([`crate::ipc::report`]), the scheduler combines every rank's
//! ([`crate::PrefillScheduler`]) and hands the result to the engine. It sits
//! below the roles and the role messages, so each imports it downward; it
//! imports nothing.

/// Why a lease (or one rank's share of it) ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReleaseReason {
    /// Every expected reader reported the READ done.
    ReadDone,
    /// No heartbeat kept it alive (or, not started, its prefill outlasted
    /// `kv_lease_max_pin`).
    Expired,
    /// The engine cancelled it.
    Cancelled,
    /// A rank never held it: it missed or refused the Grant (a lost
    /// directive message, a shorter id limit), or its process was lost. Its
    /// slot stayed 0 there, so no reader could verify on that rank: the
    /// lease failed closed, and the rank's report lets its blocks go.
    NotHeld,
}

impl ReleaseReason {
    /// The reason for the whole lease when one rank ended its share for
    /// `self` and another for `other`: a cancel wins (the engine asked),
    /// then a rank that never held it (the lease was broken from the start
    /// there), then an expiry (some rank's readers may not have finished),
    /// and only when every rank saw its readers done is the lease released
    /// by read.
    pub fn combine(self, other: ReleaseReason) -> ReleaseReason {
        use ReleaseReason::*;
        match (self, other) {
            (Cancelled, _) | (_, Cancelled) => Cancelled,
            (NotHeld, _) | (_, NotHeld) => NotHeld,
            (Expired, _) | (_, Expired) => Expired,
            (ReadDone, ReadDone) => ReadDone,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ReleaseReason::*;

    #[test]
    fn combine_is_symmetric_with_cancel_then_expiry_winning() {
        for a in [ReadDone, Expired, Cancelled, NotHeld] {
            for b in [ReadDone, Expired, Cancelled, NotHeld] {
                assert_eq!(a.combine(b), b.combine(a));
            }
        }
        assert_eq!(ReadDone.combine(ReadDone), ReadDone);
        assert_eq!(ReadDone.combine(Expired), Expired);
        assert_eq!(Expired.combine(NotHeld), NotHeld);
        assert_eq!(NotHeld.combine(Cancelled), Cancelled);
        assert_eq!(Expired.combine(Cancelled), Cancelled);
    }
}
