//! What the P-side roles have seen, as plain numbers: [`SchedulerCounters`]
//! (one per engine), [`RankCounters`] (one per rank) and [`BookCounters`]
//! (the single-process [`crate::LeaseBook`]: the scheduler's and every
//! rank's, summed).
//!
//! This module owns nothing but the counter structs. The roles bump the
//! fields; the engine reads them each step (a borrow or a copy, no
//! allocation) and exports them as metrics. vLLM exports expired requests
//! as `vllm:nixl_num_kv_expired_reqs`: that is the scheduler's `expired`.

/// Monotonic event counts of one P scheduler since construction.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SchedulerCounters {
    /// Leases granted (assigned; with or without a slot).
    pub granted: u64,
    /// Leases granted without a slot because verification is off or the
    /// slot pool was empty. Verifying decoders decline their KV.
    pub granted_without_slot: u64,
    /// Grants refused because `kv_lease_capacity` leases are live.
    pub grant_refused_full: u64,
    /// Grants refused for an empty or over-long request id.
    pub grant_refused_bad_id: u64,
    /// Grants refused because the id is already leased.
    pub grant_refused_duplicate: u64,
    /// Grants refused because the id's previous lease is released but not
    /// drained yet (drain first: the engine must free the old blocks by the
    /// old lease's report, not the new one's).
    pub grant_refused_release_pending: u64,
    /// Directives handed out (in messages or to in-process ranks).
    pub directives_sent: u64,
    /// Rank reports that completed a rank's share of a lease.
    pub reports_applied: u64,
    /// Rank reports for an entry that does not hold that nonce (late, or
    /// from a confused sender): ignored.
    pub reports_stale: u64,
    /// Rank reports repeated by the same rank for the same lease: ignored.
    pub reports_duplicate: u64,
    /// Report messages from a rank this scheduler does not have, or that did
    /// not decode: ignored whole.
    pub report_messages_refused: u64,
    /// Report messages whose sequence number skipped or repeated (a lost or
    /// repeated message on the engine's IPC).
    pub report_seq_gaps: u64,
    /// Leases released because every rank's readers were done.
    pub released_read: u64,
    /// Leases released because at least one rank's lease expired.
    pub expired: u64,
    /// Leases released because the engine cancelled them.
    pub cancelled: u64,
    /// Leases released with some rank that never held them (a missed or
    /// refused Grant, a lost rank): failed closed on that rank.
    pub not_held: u64,
    /// Rank reports of "not held" applied (a rank that missed a Grant).
    pub reports_not_held: u64,
    /// Leases counted as let go by a lost rank (`rank_lost`), including
    /// those granted while it was lost.
    pub lost_rank_releases: u64,
    /// Ranks resynchronised after a restart (`rank_restarted`).
    pub ranks_restarted: u64,
    /// Grants refused because every rank was lost.
    pub grant_refused_no_ranks: u64,
    /// Probes the scheduler sent by itself ([`crate::PrefillScheduler::poll`]):
    /// a started lease's Start again, because some rank let go of it and
    /// another had not answered a `kv_lease_duration` later (it missed the
    /// Grant, or its report was lost, or its readers are slow). Harmless to
    /// a rank that holds the lease.
    pub backstop_probes: u64,
    /// Cancels the scheduler sent by itself: a lease a `kv_lease_duration`
    /// past `kv_lease_max_pin` (never started) or `kv_lease_max_hold`, when
    /// every rank that held it let go by its own rule.
    pub backstop_cancels: u64,
    /// Releases handed to the engine by `drain_released`.
    pub reported: u64,
    /// Slots given back through the scheduler after the engine freed the blocks.
    pub slots_returned: u64,
}

/// Monotonic event counts of one P rank since construction.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RankCounters {
    /// Directives applied.
    pub directives_applied: u64,
    /// Directives that repeated one already applied (same entry and nonce): no-ops.
    pub directives_duplicate: u64,
    /// Directives for a lease this rank no longer holds (it expired or was
    /// read here first): no-ops.
    pub directives_stale: u64,
    /// Directives refused: entry or slot outside this rank's layout, or an
    /// over-long id. The lease is not held on this rank (D's check fails).
    pub directives_refused: u64,
    /// Grants that found their entry or id still held by another lease
    /// (only a lost or reordered report can cause it): the old lease was
    /// released first, its slot zeroed.
    pub directive_conflicts: u64,
    /// Directive messages that did not decode: ignored whole.
    pub directive_messages_refused: u64,
    /// Directive messages whose sequence number skipped or repeated.
    pub directive_seq_gaps: u64,
    /// Renewals applied (by id or by slot and nonce).
    pub renewed: u64,
    /// Renewals that hit the `kv_lease_max_hold` ceiling.
    pub renew_capped: u64,
    /// Renewals for ids (or slots) this rank does not hold: ignored.
    pub renew_unknown: u64,
    /// Compact renewals whose nonce did not match the slot's lease: ignored.
    pub renew_nonce_mismatch: u64,
    /// Empty ids in text heartbeats (`HB:a,,b`): ignored, the rest renewed.
    pub heartbeat_empty_ids: u64,
    /// Read-done notifications that counted toward a release.
    pub read_done: u64,
    /// Of those, notifications that carried no nonce (vLLM form).
    pub read_done_without_nonce: u64,
    /// Read-done notifications for ids this rank does not hold: dropped
    /// ("may have expired").
    pub read_done_unknown: u64,
    /// Read-done notifications whose nonce belongs to an earlier lease with
    /// the same id: dropped.
    pub read_done_stale_nonce: u64,
    /// Notifications that did not decode.
    pub malformed_notifications: u64,
    /// Clock ping/pong notifications ([`crate::clock_ping`]): not this
    /// rank's to answer (the engine answers them before the rank sees
    /// notifications), so counted and ignored.
    pub clock_messages: u64,
    /// This rank's shares released because its readers were done.
    pub released_read: u64,
    /// This rank's shares released because they expired.
    pub expired: u64,
    /// This rank's shares released because the scheduler cancelled them.
    pub cancelled: u64,
    /// Of the expired, leases let go while still pinned (assigned, never
    /// started within `kv_lease_max_pin`).
    pub pinned_expired: u64,
    /// "Not held" reports queued: a Start or Cancel for a lease this rank
    /// does not hold, or a Grant it refused.
    pub not_held_reported: u64,
    /// Read-done notifications from a sender already counted for the lease:
    /// dropped (each (sender, lease) counts once).
    pub read_done_duplicate_sender: u64,
    /// Senders forgotten to make room in the sender table (more distinct
    /// decoder agents than it holds were talking to this rank).
    pub senders_evicted: u64,
    /// Reports dropped because the report queue was full (the engine did
    /// not ship reports for many steps); the scheduler then waits for the
    /// lease until `cancel` or `rank_restarted`.
    pub reports_dropped: u64,
    /// Reports handed to the scheduler (in messages or in process).
    pub reports_sent: u64,
}

/// Monotonic event counts of a single-process [`crate::LeaseBook`]: the
/// scheduler's counts, and every rank's summed (a heartbeat delivered to two
/// ranks counts two renewals).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
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
    /// Grants refused because the id's previous lease is not drained yet.
    pub grant_refused_release_pending: u64,
    /// Renewals applied (by id or by slot and nonce), summed over ranks.
    pub renewed: u64,
    /// Renewals that hit the `kv_lease_max_hold` ceiling.
    pub renew_capped: u64,
    /// Renewals for ids (or slots) the book does not hold: ignored.
    pub renew_unknown: u64,
    /// Compact renewals whose nonce did not match the slot's lease: ignored.
    pub renew_nonce_mismatch: u64,
    /// Empty ids in text heartbeats: ignored, the rest renewed.
    pub heartbeat_empty_ids: u64,
    /// Read-done notifications that counted toward a release.
    pub read_done: u64,
    /// Of those, notifications that carried no nonce (vLLM form).
    pub read_done_without_nonce: u64,
    /// Read-done notifications for ids the book does not hold: dropped.
    pub read_done_unknown: u64,
    /// Read-done notifications whose nonce belongs to an earlier lease with
    /// the same id: dropped.
    pub read_done_stale_nonce: u64,
    /// Read-done notifications from a rank the book does not have.
    pub read_done_bad_rank: u64,
    /// Notifications that did not decode.
    pub malformed_notifications: u64,
    /// Clock ping/pong notifications that reached a rank: ignored.
    pub clock_messages: u64,
    /// Leases released because every rank's readers were done.
    pub released_read: u64,
    /// Leases released because at least one rank's lease expired.
    pub expired: u64,
    /// Leases released because the engine cancelled them.
    pub cancelled: u64,
    /// Leases released with a rank that never held them.
    pub not_held: u64,
    /// Read-done notifications from a sender already counted: dropped.
    pub read_done_duplicate_sender: u64,
    /// Releases handed to the engine by `drain_released`.
    pub reported: u64,
    /// Slots given back through the book after the engine freed the blocks.
    pub slots_returned: u64,
}

impl BookCounters {
    /// The scheduler's counts plus every rank's, summed.
    pub(crate) fn combine(
        s: SchedulerCounters,
        ranks: impl IntoIterator<Item = RankCounters>,
        read_done_bad_rank: u64,
    ) -> BookCounters {
        let mut b = BookCounters {
            granted: s.granted,
            granted_without_slot: s.granted_without_slot,
            grant_refused_full: s.grant_refused_full,
            grant_refused_bad_id: s.grant_refused_bad_id,
            grant_refused_duplicate: s.grant_refused_duplicate,
            grant_refused_release_pending: s.grant_refused_release_pending,
            read_done_bad_rank,
            released_read: s.released_read,
            expired: s.expired,
            cancelled: s.cancelled,
            not_held: s.not_held,
            reported: s.reported,
            slots_returned: s.slots_returned,
            ..BookCounters::default()
        };
        for r in ranks {
            b.renewed += r.renewed;
            b.renew_capped += r.renew_capped;
            b.renew_unknown += r.renew_unknown;
            b.renew_nonce_mismatch += r.renew_nonce_mismatch;
            b.heartbeat_empty_ids += r.heartbeat_empty_ids;
            b.read_done += r.read_done;
            b.read_done_without_nonce += r.read_done_without_nonce;
            b.read_done_unknown += r.read_done_unknown;
            b.read_done_stale_nonce += r.read_done_stale_nonce;
            b.read_done_duplicate_sender += r.read_done_duplicate_sender;
            b.malformed_notifications += r.malformed_notifications;
            b.clock_messages += r.clock_messages;
        }
        b
    }
}
