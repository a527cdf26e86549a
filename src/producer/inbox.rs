//! Applying notifications off the wire to the lease book.
//!
//! This file owns the dispatch from decoded notifications (`wire`) to the
//! book's operations; it decides nothing about leases itself. It allocates
//! nothing: decoding borrows from the message and renewal is in place.

use crate::producer::book::{LeaseBook, ReadDoneOutcome};
use crate::time::Instant;
use crate::wire::{self, Notification, WireError};

/// What one notification did to the book.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InboxSummary {
    /// Leases renewed (fully or up to their max-hold ceiling).
    pub renewed: u32,
    /// Heartbeat entries for leases the book does not hold (or whose nonce
    /// did not match): ignored, as vLLM ignores unknown ids.
    pub ignored: u32,
    /// The outcome of a read-done notification, if it was one.
    pub read_done: Option<ReadDoneOutcome>,
}

impl LeaseBook {
    /// Decodes one notification received on local rank `rank` and applies
    /// it: a heartbeat renews every id it names that the book holds, a
    /// compact heartbeat every (slot, nonce) that matches, a read-done counts
    /// toward its lease's release. A message that does not decode changes
    /// nothing, is counted in `malformed_notifications`, and its error is
    /// returned for the engine to log.
    pub fn on_notification(
        &mut self,
        rank: u32,
        msg: &[u8],
        now: Instant,
    ) -> Result<InboxSummary, WireError> {
        let decoded = match wire::decode(msg) {
            Ok(n) => n,
            Err(e) => {
                self.note_malformed();
                return Err(e);
            }
        };
        let mut summary = InboxSummary::default();
        match decoded {
            Notification::Heartbeat(ids) => {
                let (renewed, ignored) = self.renew_all(ids.map(str::as_bytes), now);
                summary.renewed += renewed;
                summary.ignored += ignored;
            }
            Notification::CompactHeartbeat(entries) => {
                let (renewed, ignored) =
                    self.renew_slots_all(entries.map(|e| (e.slot, e.nonce)), now);
                summary.renewed += renewed;
                summary.ignored += ignored;
            }
            Notification::ReadDone(rd) => {
                summary.read_done = Some(self.read_done(
                    rank,
                    rd.request_id.as_bytes(),
                    rd.consumers,
                    rd.nonce,
                    now,
                ));
            }
        }
        Ok(summary)
    }
}
