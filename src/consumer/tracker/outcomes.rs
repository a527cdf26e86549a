//! The tracker's side of verify outcomes: a request's KV counts as received
//! only once every D worker verified its share, and fails at the first
//! worker that did not.
//!
//! This file owns that aggregation (one bit per worker rank, per tracked
//! request; the worker count is fixed when the tracker is built) and what an outcome does to tracking: stop it either way, and
//! request the engines the worker still owes a heartbeat. The bytes are
//! [`crate::ipc::outcome`]'s; the failure policy is the engine's.
//!
//! Why aggregate: with D TP > 1 every D worker pulls its own share of the
//! KV from its own P ranks and verifies that share. The request may decode
//! only when all shares are verified; one worker's "verified" says nothing
//! about the others' (vLLM's scheduler likewise sees a request as received
//! only once every worker reported it).

use super::HeartbeatTracker;
use crate::ipc::outcome::OutcomeMsg;
use crate::ipc::IpcError;
use crate::verdict::Verdict;

/// Most D workers one tracker aggregates (one bit each).
pub const MAX_WORKERS: u32 = u64::BITS;

/// What [`HeartbeatTracker::apply_outcomes`] did with one message.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ApplyReport {
    /// Outcomes in the message.
    pub outcomes: u32,
    /// Requests now received: every worker verified them.
    pub received: u32,
    /// Requests whose load failed on this worker (or that a refused message
    /// named).
    pub failed: u32,
    /// Of the received, those accepted without a lease check (verification
    /// off on that worker).
    pub unchecked: u32,
    /// Verified by this worker, still waiting for others.
    pub pending: u32,
    /// Outcomes for requests the tracker does not track (counted no-ops).
    pub untracked: u32,
    /// Owed engines the message named that are still tracked.
    pub owed_live: u32,
}

impl HeartbeatTracker {
    /// The D workers whose outcomes make up a verdict (fixed at construction).
    pub fn workers(&self) -> u32 {
        self.workers
    }

    /// Applies one worker's verify-outcome message (`update_connector_output`
    /// in vLLM terms):
    ///
    /// - **usable** ([`Verdict::is_usable`]: verified, or unchecked with
    ///   verification off): the worker's share is good; once every worker's
    ///   is, the request is received: tracking stops (as
    ///   [`HeartbeatTracker::on_transfer_complete`]) and `on_outcome(id,
    ///   verdict)` is called, with [`Verdict::Unchecked`] if any worker's
    ///   share was unchecked;
    /// - **anything else**: the KV load failed: tracking stops and
    ///   `on_outcome(id, verdict)` is called at once, for the engine to apply
    ///   `kv_load_failure_policy` (later outcomes for the id are untracked);
    /// - an id the tracker does not track is counted and otherwise ignored
    ///   ([`crate::consumer::TrackerCounters::outcomes_untracked`]); an
    ///   engine that pulls requests the tracker refused aggregates those
    ///   itself from [`OutcomeMsg::iter`];
    /// - the owed engines go to [`HeartbeatTracker::request_engines`].
    ///
    /// A message from a rank not below [`HeartbeatTracker::workers`] cannot
    /// vouch for anything: every tracked request it names **fails** (as
    /// [`Verdict::Unverifiable`], through `on_outcome`, so the failure policy
    /// applies), its owed engines are ignored, and
    /// [`IpcError::UnknownWorker`] is returned for the engine to log. (Before
    /// the worker count was part of construction, such a message was dropped
    /// whole, and worker 0's verdict alone made a TP 2 request received.)
    pub fn apply_outcomes(
        &mut self,
        msg: &OutcomeMsg<'_>,
        mut on_outcome: impl FnMut(&str, Verdict),
    ) -> Result<ApplyReport, IpcError> {
        let rank = msg.rank();
        if rank >= self.workers {
            for o in msg.iter() {
                self.counters.outcomes += 1;
                let Some(r) = self.d_ids.get(o.request_id.as_bytes()) else {
                    self.counters.outcomes_untracked += 1;
                    continue;
                };
                self.stop_request(r);
                self.counters.loads_failed += 1;
                self.counters.outcomes_refused += 1;
                on_outcome(o.request_id, Verdict::Unverifiable);
            }
            return Err(IpcError::UnknownWorker {
                rank,
                workers: self.workers,
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
            if o.verdict.is_usable() {
                let by = &mut self.verified_by[r as usize];
                *by |= 1 << rank;
                let unchecked = &mut self.unchecked[r as usize / 64];
                if o.verdict == Verdict::Unchecked {
                    *unchecked |= 1 << (r % 64);
                }
                let any_unchecked = *unchecked & (1 << (r % 64)) != 0;
                if *by != everyone {
                    report.pending += 1;
                    continue;
                }
                self.stop_request(r);
                self.counters.stopped_transfer_complete += 1;
                report.received += 1;
                let verdict = if any_unchecked {
                    self.counters.loads_unverified += 1;
                    report.unchecked += 1;
                    Verdict::Unchecked
                } else {
                    self.counters.loads_verified += 1;
                    Verdict::Verified
                };
                on_outcome(o.request_id, verdict);
            } else {
                self.stop_request(r);
                self.counters.loads_failed += 1;
                report.failed += 1;
                on_outcome(o.request_id, o.verdict);
            }
        }
        report.owed_live = self.request_engines(msg.owed());
        Ok(report)
    }
}
