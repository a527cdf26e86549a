//! [`BookCounters`]: what the lease book has seen, as plain numbers.
//!
//! This module owns nothing but the counter struct. The book bumps the
//! fields; the engine reads them through [`crate::LeaseBook::counters`] each
//! step (a borrow, no allocation) and exports them as metrics. vLLM exports
//! expired requests as `vllm:nixl_num_kv_expired_reqs`; that is `expired`.

/// Monotonic event counts of one lease book since construction.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BookCounters {
    /// Leases granted (with or without a slot).
    pub granted: u64,
    /// Leases granted without a slot because verification is off or the
    /// slot pool was empty. Verifying decoders decline their KV.
    pub granted_without_slot: u64,
    /// Grants refused because the book was full (`kv_lease_capacity`).
    pub grant_refused_full: u64,
    /// Grants refused for an empty or over-long request id.
    pub grant_refused_bad_id: u64,
    /// Grants refused because the id is already held.
    pub grant_refused_duplicate: u64,
    /// Renewals applied (by id or by slot and nonce).
    pub renewed: u64,
    /// Renewals that hit the `kv_lease_max_hold` ceiling.
    pub renew_capped: u64,
    /// Renewals for ids (or slots) the book does not hold: ignored.
    pub renew_unknown: u64,
    /// Compact renewals whose nonce did not match the slot's lease: ignored.
    pub renew_nonce_mismatch: u64,
    /// Read-done notifications that counted toward a release.
    pub read_done: u64,
    /// Of those, notifications that carried no nonce (vLLM form).
    pub read_done_without_nonce: u64,
    /// Read-done notifications for ids the book does not hold: dropped
    /// ("may have expired").
    pub read_done_unknown: u64,
    /// Read-done notifications whose nonce belongs to an earlier lease with
    /// the same id: dropped.
    pub read_done_stale_nonce: u64,
    /// Read-done notifications from a rank the book does not have.
    pub read_done_bad_rank: u64,
    /// Notifications that did not decode.
    pub malformed_notifications: u64,
    /// Leases released because every expected reader reported done.
    pub released_read: u64,
    /// Leases released because they expired.
    pub expired: u64,
    /// Leases released because the engine cancelled them.
    pub cancelled: u64,
    /// Releases handed to the engine by `drain_released`.
    pub reported: u64,
    /// Slots given back through the book after the engine freed the blocks.
    pub slots_returned: u64,
}
