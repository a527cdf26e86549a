//! The tracker's side of verify outcomes: a request's KV counts as received
//! only once every D worker verified its share, and fails at the first
//! worker that did not.
//!
//! This file owns that aggregation (one bit per worker rank, per tracked
//! request) and what an outcome does to tracking: stop it either way, and
//! request the engines the worker still owes a heartbeat. The bytes are
//! [`crate::ipc::outcome`]'s; the failure policy is the engine's.
//!
//! Why aggregate: with D TP > 1 every D worker pulls its own share of the
//! KV from its own P ranks and verifies that share. The request may decode
//! only when all shares are verified; one worker's "verified" says nothing
//! about the others' (vLLM's scheduler likewise sees a request as received
//! only once every worker reported it).

use super::HeartbeatTracker;
use crate::consumer::Verdict;
use crate::ipc::outcome::OutcomeMsg;
use crate::ipc::IpcError;

/// Most D workers one tracker aggregates (one bit each).
const MAX_WORKERS: u32 = u64::BITS;

/// What [`HeartbeatTracker::apply_outcomes`] did with one message.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ApplyReport {
    /// Outcomes in the message.
    pub outcomes: u32,
    /// Requests now received: every worker verified them.
    pub received: u32,
    /// Requests whose load failed on this worker.
    pub failed: u32,
    /// Verified by this worker, still waiting for others.
    pub pending: u32,
    /// Outcomes for requests the tracker does not track (counted no-ops).
    pub untracked: u32,
    /// Owed engines the message named that are still tracked.
    pub owed_live: u32,
}

impl HeartbeatTracker {
    /// Sets how many D workers (D's TP ranks, each with its own verifier)
    /// must verify a request before it counts as received; 1 by default.
    /// Clamped to `1..=64`. Set it before the first outcome arrives: a
    /// request part-verified under the old count keeps its bits.
    pub fn set_workers(&mut self, workers: u32) {
        self.workers = workers.clamp(1, MAX_WORKERS);
    }

    /// The D workers whose outcomes make up a verdict.
    pub fn workers(&self) -> u32 {
        self.workers
    }

    /// Applies one worker's verify-outcome message (`update_connector_output`
    /// in vLLM terms):
    ///
    /// - **verified**: the worker's share is good; once every worker's is,
    ///   the request is received: tracking stops (as
    ///   [`HeartbeatTracker::on_transfer_complete`]) and `on_outcome(id,
    ///   Verdict::Verified)` is called;
    /// - **anything else**: the KV load failed: tracking stops and
    ///   `on_outcome(id, verdict)` is called at once, for the engine to apply
    ///   `kv_load_failure_policy` (later outcomes for the id are untracked);
    /// - an id the tracker does not track is counted and otherwise ignored
    ///   ([`crate::consumer::TrackerCounters::outcomes_untracked`]); an
    ///   engine that pulls requests the tracker refused aggregates those
    ///   itself from [`OutcomeMsg::iter`];
    /// - the owed engines go to [`HeartbeatTracker::request_engines`].
    ///
    /// A message from a rank not below [`HeartbeatTracker::workers`] is
    /// refused whole: [`IpcError::WrongSender`] with `expected` the worker
    /// count; nothing is applied.
    pub fn apply_outcomes(
        &mut self,
        msg: &OutcomeMsg<'_>,
        mut on_outcome: impl FnMut(&str, Verdict),
    ) -> Result<ApplyReport, IpcError> {
        let rank = msg.rank();
        if rank >= self.workers {
            return Err(IpcError::WrongSender {
                expected: self.workers,
                found: rank,
            });
        }
        let everyone = if self.workers == MAX_WORKERS {
            u64::MAX
        } else {
            (1u64 << self.workers) - 1
        };
        let mut report = ApplyReport::default();
        for o in msg.iter() {
            report.outcomes += 1;
            self.counters.outcomes += 1;
            let Some(r) = self.d_ids.get(o.request_id.as_bytes()) else {
                report.untracked += 1;
                self.counters.outcomes_untracked += 1;
                continue;
            };
            if o.verdict.is_verified() {
                let by = &mut self.verified_by[r as usize];
                *by |= 1 << rank;
                if *by != everyone {
                    report.pending += 1;
                    continue;
                }
                self.stop_request(r);
                self.counters.stopped_transfer_complete += 1;
                self.counters.loads_verified += 1;
                report.received += 1;
            } else {
                self.stop_request(r);
                self.counters.loads_failed += 1;
                report.failed += 1;
            }
            on_outcome(o.request_id, o.verdict);
        }
        report.owed_live = self.request_engines(msg.owed());
        Ok(report)
    }
}
