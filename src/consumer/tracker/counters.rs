//! The tracker's counters.

/// What the tracker has seen, as plain monotonic counts since construction.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TrackerCounters {
    /// Requests tracked.
    pub started: u64,
    /// Of those, requests without lease slot and nonce: their engine can only
    /// be heartbeated in text form.
    pub started_without_lease: u64,
    /// Requests without `do_remote_prefill`: ignored (normal).
    pub ignored_not_remote_prefill: u64,
    /// Remote-prefill requests lacking a field heartbeats need.
    pub missing_params: u64,
    /// Refused: `max_tracked_requests` reached.
    pub refused_requests_full: u64,
    /// Refused: `max_remote_engines` reached.
    pub refused_engines_full: u64,
    /// Refused: the D-side id is tracked already.
    pub refused_duplicate: u64,
    /// Refused: an empty, over-long or comma-bearing id or host, or TP size 0.
    pub refused_bad_param: u64,
    /// Remote-prefill requests that are not heartbeated at all (missing
    /// params plus every refusal). P holds their blocks for the initial
    /// lease only: alert on this.
    pub not_heartbeated: u64,
    /// Requests whose `pp_size`/`dcp_size` differ from their engine's first
    /// request (tracked anyway, under the engine's first values).
    pub engine_shape_mismatch: u64,
    /// Tracking stopped because the KV transfer completed.
    pub stopped_transfer_complete: u64,
    /// Tracking stopped because the request finished or was aborted.
    pub stopped_finished: u64,
    /// Stop calls for ids not tracked (normal: every finished request is
    /// reported, tracked or not, and a completed transfer is reported again
    /// when the request finishes).
    pub stop_untracked: u64,
    /// Engines reported due.
    pub engines_due: u64,
    /// Requests in the engines reported due.
    pub requests_due: u64,
    /// Engines planned again before their interval because a worker still
    /// owed a P rank of them a heartbeat ([`BatchReason::Owed`](crate::consumer::BatchReason::Owed)).
    pub engines_owed: u64,
    /// Owed-engine reports from workers that named a live engine.
    pub owed_requests: u64,
    /// Owed-engine reports that named an engine no longer tracked (its
    /// requests all finished): answered with a "gone" notice so the worker
    /// drops what it owes.
    pub owed_stale: u64,
    /// Heartbeat plans encoded.
    pub plans_encoded: u64,
    /// Verify outcomes applied (one per request per worker message).
    pub outcomes: u64,
    /// Outcomes for requests the tracker does not track (finished, already
    /// failed, refused at arrival, or a duplicate): counted, otherwise no-ops.
    pub outcomes_untracked: u64,
    /// Requests whose KV every worker verified: received, tracking stopped.
    pub loads_verified: u64,
    /// Requests received with at least one worker's share accepted
    /// unchecked (`kv_lease_verification = false` on that worker): what
    /// stock vLLM does, counted so that it shows.
    pub loads_unverified: u64,
    /// Requests failed because an outcome message came from a worker rank
    /// the tracker was not built for (also in `loads_failed`).
    pub outcomes_refused: u64,
    /// Requests whose KV load failed verification on some worker: tracking
    /// stopped, `kv_load_failure_policy` applies.
    pub loads_failed: u64,
}
