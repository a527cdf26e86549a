//! Directives: what the ranks must do this step (grants, starts, cancels),
//! encoded once for every rank and marked sent.

use super::*;

impl PrefillScheduler {
    /// Directives waiting to be handed out.
    pub fn pending_directives(&self) -> u32 {
        self.pending.len()
    }

    /// Bytes [`PrefillScheduler::encode_directives`] needs now.
    pub fn directives_len(&self, now: Instant) -> usize {
        directive::encoded_len(self.directives(now))
    }

    /// Encodes this step's directives into `buf` as the next directive
    /// message (the same bytes go to every worker) and marks them handed
    /// out; returns the message length. With [`IpcError::BufferTooSmall`]
    /// nothing is consumed: grow the buffer to
    /// [`PrefillScheduler::directives_len`] and call again. Lease deadlines
    /// cross as the time remaining at `now`.
    pub fn encode_directives(&mut self, now: Instant, buf: &mut [u8]) -> Result<usize, IpcError> {
        let len = directive::encode(buf, self.directive_seq, self.directives(now))?;
        self.directive_seq = self.directive_seq.wrapping_add(1);
        self.mark_sent();
        Ok(len)
    }

    /// Hands this step's directives to `sink` and marks them handed out (an
    /// engine whose ranks live in this process).
    pub fn drain_directives(&mut self, now: Instant, mut sink: impl FnMut(&Directive<'_>)) {
        for d in self.directives(now) {
            sink(&d);
        }
        self.mark_sent();
    }

    pub(super) fn directives(&self, now: Instant) -> PendingDirectives<'_> {
        PendingDirectives {
            sched: self,
            now,
            k: 0,
            op: 0,
        }
    }

    pub(super) fn mark_sent(&mut self) {
        while let Some(e) = self.pending.get(0) {
            let lease = &mut self.leases[e as usize];
            let ops = lease.ops;
            self.counters.directives_sent += u64::from(
                u8::from(ops & OP_GRANT != 0)
                    + u8::from(ops & OP_START != 0 && ops & OP_GRANT == 0)
                    + u8::from(ops & OP_CANCEL != 0),
            );
            lease.announced |= ops & OP_GRANT != 0;
            lease.ops = 0;
            self.pending.remove(e);
        }
    }
}

/// This step's directives, in entry order of the pending set, each lease's
/// in the order Grant (merged with its Start when both are pending), Start,
/// Cancel. Borrows the scheduler; cloned for the encoder's sizing pass.
#[derive(Clone)]
pub(super) struct PendingDirectives<'a> {
    sched: &'a PrefillScheduler,
    now: Instant,
    /// Position in the pending set.
    k: u32,
    /// Next op to consider for that entry (0: Grant, 1: Start, 2: Cancel).
    op: u8,
}

impl<'a> Iterator for PendingDirectives<'a> {
    type Item = Directive<'a>;

    fn next(&mut self) -> Option<Directive<'a>> {
        loop {
            let e = self.sched.pending.get(self.k)?;
            let lease = &self.sched.leases[e as usize];
            let op = self.op;
            self.op += 1;
            if self.op == 3 {
                self.op = 0;
                self.k += 1;
            }
            let started = lease.status == Some(LeaseStatus::Held);
            let remaining = started.then(|| lease.expiry.saturating_duration_since(self.now));
            let hold = (started && lease.hold_until != Instant::MAX)
                .then(|| lease.hold_until.saturating_duration_since(self.now));
            let base = Directive {
                op: DirectiveOp::Grant,
                entry: e,
                slot: None,
                nonce: lease.nonce,
                lease_remaining: None,
                hold_remaining: None,
                request_id: "",
            };
            match op {
                0 if lease.ops & OP_GRANT != 0 => {
                    return Some(Directive {
                        slot: self.sched.layout.slot_of(e),
                        lease_remaining: remaining,
                        hold_remaining: hold,
                        request_id: core::str::from_utf8(self.sched.ids.id(e)).unwrap_or(""),
                        ..base
                    })
                }
                // A Start queued with its Grant went out inside the Grant.
                1 if lease.ops & OP_START != 0 && lease.ops & OP_GRANT == 0 => {
                    return Some(Directive {
                        op: DirectiveOp::Start,
                        lease_remaining: remaining,
                        hold_remaining: hold,
                        ..base
                    })
                }
                2 if lease.ops & OP_CANCEL != 0 => {
                    return Some(Directive {
                        op: DirectiveOp::Cancel,
                        ..base
                    })
                }
                _ => {}
            }
        }
    }
}
