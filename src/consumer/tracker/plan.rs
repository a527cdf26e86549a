//! The tracker's side of a step: which engines go out this step, and the
//! heartbeat plan that carries them to workers in other processes.
//!
//! This file owns the one selection rule (an engine is planned when its
//! interval ran out, or when a worker still owes one of its P ranks a
//! heartbeat), its commit (throttle, clear the request), the owed-engine
//! requests coming back from workers and the "gone" notices answering the
//! stale ones. [`HeartbeatTracker::due`] (one process) and
//! [`HeartbeatTracker::encode_plan`] (scheduler and workers apart) both go
//! through [`HeartbeatTracker::planned`] and [`HeartbeatTracker::commit_plan`],
//! so they hand out exactly the same engines. The bytes are
//! [`crate::ipc::plan`]'s business.
//!
//! # Owed heartbeats across processes
//!
//! A worker whose P rank was not ready (handshake pending or failed) when
//! the engine was due owes that rank the heartbeat. It reports the engine
//! back ([`crate::consumer::HeartbeatSender::owed_engines`], carried in its
//! verify-outcome message), the scheduler calls
//! [`HeartbeatTracker::request_engines`], and the next plan carries the
//! engine again with [`BatchReason::Owed`], whatever its throttle says. The
//! worker serves only the ranks it owes, and reports the engine again as long
//! as one is still owed. So the owed heartbeat leaves at the first step after
//! the handshake completes, as the seed asks, with no state on the worker
//! beyond what the sender already keeps.
//!
//! A report that names an engine the tracker no longer has (its requests all
//! finished), and an engine that disappears while it is requested, are
//! answered with a "gone" notice in the next plan, so the worker drops the
//! debt instead of reporting it forever.

use super::{EngineBatch, EngineHandle, HeartbeatTracker};
use crate::heartbeat_batch::BatchReason;
use crate::ipc::{plan as msg, IpcError};
use crate::time::Instant;

impl HeartbeatTracker {
    /// Why engine `e` would be planned at `now`, if at all. Changes nothing.
    ///
    /// An engine whose due time lies more than one interval after `now` is
    /// taken as due too: that only happens when `now` went backwards (a
    /// caller bug), and it bounds the resulting silence to one interval.
    #[inline]
    fn selected(&self, e: u32, now: Instant) -> Option<BatchReason> {
        let eng = &self.engines[e as usize];
        let horizon = now.saturating_add(self.interval);
        if eng.next_due > now && eng.next_due <= horizon {
            eng.requested.then_some(BatchReason::Owed)
        } else {
            Some(BatchReason::Due)
        }
    }

    /// The engines planned at `now`, in the order both paths hand them out.
    /// Changes nothing.
    fn planned(&self, now: Instant) -> impl Iterator<Item = EngineBatch<'_>> + Clone {
        (0..self.live.len()).filter_map(move |k| {
            let e = self.live.get(k)?;
            let reason = self.selected(e, now)?;
            Some(EngineBatch {
                tracker: self,
                engine: e,
                reason,
            })
        })
    }

    /// Commits the selection of [`HeartbeatTracker::planned`] at `now`,
    /// handing each planned engine to `visit` after its commit: a due engine
    /// is throttled for the interval, and any request for it is answered.
    /// Returns how many engines were due (not counting owed ones).
    fn commit_plan(&mut self, now: Instant, mut visit: impl FnMut(EngineBatch<'_>)) -> u32 {
        let horizon = now.saturating_add(self.interval);
        let mut due = 0;
        let mut k = 0;
        while let Some(e) = self.live.get(k) {
            k += 1;
            let Some(reason) = self.selected(e, now) else {
                continue;
            };
            let eng = &mut self.engines[e as usize];
            eng.requested = false;
            match reason {
                BatchReason::Due => {
                    eng.next_due = horizon;
                    due += 1;
                    self.counters.engines_due += 1;
                    self.counters.requests_due += u64::from(eng.len);
                }
                BatchReason::Owed => self.counters.engines_owed += 1,
            }
            visit(EngineBatch {
                tracker: self,
                engine: e,
                reason,
            });
        }
        due
    }

    /// One scheduler step in a single process: hands every engine planned
    /// at `now` to `sink` (due ones, then throttled for the heartbeat
    /// interval, and owed ones, see the module docs) and returns how many
    /// were due. The batches borrow the tracker only for the call.
    ///
    /// With the scheduler and its workers in separate processes, use
    /// [`HeartbeatTracker::encode_plan`] instead: it plans the same engines.
    pub fn due<S>(&mut self, now: Instant, sink: S) -> u32
    where
        S: FnMut(EngineBatch<'_>),
    {
        self.commit_plan(now, sink)
    }

    /// Bytes [`HeartbeatTracker::encode_plan`] would write at `now`: size
    /// the buffer with it. Changes nothing.
    pub fn plan_len(&self, now: Instant) -> usize {
        msg::encoded_len(self.planned(now), self.gone_handles())
    }

    /// The D scheduler's step when its workers run in other processes:
    /// encodes the engines planned at `now` (the same ones
    /// [`HeartbeatTracker::due`] would hand out) plus the pending "gone"
    /// notices as one heartbeat plan ([`crate::ipc::plan`]) into `buf`, then
    /// commits the selection. Returns the plan's length; ship those bytes to
    /// every worker.
    ///
    /// A buffer too small for the plan is [`IpcError::BufferTooSmall`] with
    /// the size needed ([`HeartbeatTracker::plan_len`]), and then **nothing
    /// changes**: no engine is throttled, no request or notice is consumed,
    /// so a retry with a larger buffer plans the same engines.
    pub fn encode_plan(&mut self, now: Instant, buf: &mut [u8]) -> Result<usize, IpcError> {
        let n = msg::encode(buf, self.plan_seq, self.planned(now), self.gone_handles())?;
        self.commit_plan(now, |_| {});
        self.clear_gone();
        self.plan_seq = self.plan_seq.wrapping_add(1);
        self.counters.plans_encoded += 1;
        Ok(n)
    }

    /// Engines some worker still owes a heartbeat to one of their P ranks
    /// (from [`crate::consumer::HeartbeatSender::owed_engines`], or the
    /// owed section of a verify-outcome message): each live one is planned
    /// at the next step with [`BatchReason::Owed`] if it is not due anyway.
    /// A handle to an engine that is gone is answered with a "gone" notice
    /// in the next plan ([`HeartbeatTracker::take_gone`] in one process).
    /// Returns how many named a live engine; the rest are counted
    /// ([`crate::consumer::TrackerCounters::owed_stale`]).
    pub fn request_engines<I>(&mut self, handles: I) -> u32
    where
        I: IntoIterator<Item = EngineHandle>,
    {
        let mut live = 0;
        for h in handles {
            match self.engines.get_mut(h.index as usize) {
                Some(eng) if eng.len > 0 && eng.generation == h.generation => {
                    eng.requested = true;
                    live += 1;
                    self.counters.owed_requests += 1;
                }
                _ => {
                    self.counters.owed_stale += 1;
                    self.note_gone(h);
                }
            }
        }
        live
    }

    /// Hands every pending "gone" notice to `sink` and forgets them: the
    /// single-process counterpart of the notices in a plan (each one tells
    /// a sender to drop what it owes the engine behind the handle).
    pub fn take_gone(&mut self, mut sink: impl FnMut(EngineHandle)) {
        while let Some(index) = self.gone.get(0) {
            self.gone.remove(index);
            sink(EngineHandle {
                index,
                generation: self.gone_generation[index as usize],
            });
        }
    }

    /// Remembers that workers owe a heartbeat to the engine behind `h`,
    /// which is gone. Handles beyond the engine slots (from bytes no worker
    /// of this tracker wrote) are dropped: no worker can hold one.
    pub(super) fn note_gone(&mut self, h: EngineHandle) {
        if let Some(g) = self.gone_generation.get_mut(h.index as usize) {
            *g = h.generation;
            self.gone.insert(h.index);
        }
    }

    fn gone_handles(&self) -> impl Iterator<Item = EngineHandle> + Clone + '_ {
        (0..self.gone.len()).filter_map(move |k| {
            let index = self.gone.get(k)?;
            Some(EngineHandle {
                index,
                generation: self.gone_generation[index as usize],
            })
        })
    }

    fn clear_gone(&mut self) {
        while let Some(index) = self.gone.get(0) {
            self.gone.remove(index);
        }
    }
}
