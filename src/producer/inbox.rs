//! Applying notifications off the wire to one P rank.
//!
//! This file owns the dispatch from decoded notifications (`wire`) to the
//! rank's operations; it decides nothing about leases itself. It allocates
//! nothing: decoding borrows from the message and renewal is in place.

use crate::producer::rank::PrefillRank;
use crate::producer::ShareOutcome;
use crate::time::Instant;
use crate::wire::{self, Notification, WireError};

/// What one notification did: on a rank (`R` = [`ShareOutcome`], about the
/// rank's share) or on a [`crate::LeaseBook`] (`R` =
/// [`crate::producer::ReadDoneOutcome`], about the whole lease).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InboxSummary<R = ShareOutcome> {
    /// Leases renewed (fully or up to their max-hold ceiling).
    pub renewed: u32,
    /// Heartbeat entries for leases the rank does not hold (or whose nonce
    /// did not match): ignored, as vLLM ignores unknown ids.
    pub ignored: u32,
    /// The outcome of a read-done notification, if it was one.
    pub read_done: Option<R>,
}

impl<R> Default for InboxSummary<R> {
    fn default() -> Self {
        InboxSummary {
            renewed: 0,
            ignored: 0,
            read_done: None,
        }
    }
}

impl PrefillRank {
    /// Decodes one notification this rank received from agent `sender` (the
    /// sender's name, as the fabric delivers it) and applies it: a heartbeat
    /// renews every id it names that the rank holds, a compact or packed
    /// heartbeat every (slot, nonce) that matches, a read-done counts toward this
    /// rank's release, once per sender and lease. A message that does not decode changes nothing,
    /// is counted in `malformed_notifications`, and its error is returned for
    /// the engine to log.
    ///
    /// A clock ping or pong ([`crate::clock_ping`]) is no read-done: it is
    /// counted in `clock_messages` and changes nothing.
    pub fn on_notification(
        &mut self,
        sender: &str,
        msg: &[u8],
        now: Instant,
    ) -> Result<InboxSummary, WireError> {
        if crate::clock_ping::is_clock_message(msg) {
            self.note_clock_message();
            return Ok(InboxSummary::default());
        }
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
                // vLLM renews every id it holds and ignores empty pieces
                // (`HB:a,,b`): one bad id must not cost the others.
                self.note_empty_ids(ids.empty_pieces() as u32);
                let (renewed, ignored) = self.renew_all(ids.map(str::as_bytes), now);
                summary.renewed = renewed;
                summary.ignored = ignored;
            }
            Notification::CompactHeartbeat(entries) => {
                (summary.renewed, summary.ignored) = self.renew_records(entries, now);
            }
            Notification::PackedHeartbeat(entries) => {
                (summary.renewed, summary.ignored) = self.renew_packed(entries, now);
            }
            Notification::ReadDone(rd) => {
                summary.read_done = Some(self.read_done(
                    sender.as_bytes(),
                    rd.request_id.as_bytes(),
                    rd.consumers,
                    rd.nonce,
                ));
            }
        }
        Ok(summary)
    }

    /// A compact (`HBC:`) heartbeat's records through the one-pass
    /// renewal.
    fn renew_records(
        &mut self,
        entries: impl Iterator<Item = wire::CompactEntry>,
        now: Instant,
    ) -> (u32, u32) {
        self.renew_slots_all(entries.map(|e| (e.slot, e.nonce)), now)
    }

    /// [`PrefillRank::renew_slots_all`] for a packed heartbeat, the form a
    /// kvlease D sends: records decoded a block at a time (a tight loop),
    /// the lines of block `k + 1` prefetched while block `k` is renewed.
    fn renew_packed(&mut self, mut records: wire::PackedEntries<'_>, now: Instant) -> (u32, u32) {
        let mut blocks = [wire::PackedBlock::default(), wire::PackedBlock::default()];
        let mut tally = super::rank::SlotTally::default();
        let wanted = self.renewal_target(now);
        let mut cur = 0;
        records.next_block(&mut blocks[cur]);
        self.prefetch_slots(blocks[cur].records());
        while !blocks[cur].is_empty() {
            let next = cur ^ 1;
            records.next_block(&mut blocks[next]);
            self.prefetch_slots(blocks[next].records());
            for (slot, nonce) in blocks[cur].records() {
                self.renew_slot_to(slot, nonce, wanted, &mut tally);
            }
            cur = next;
        }
        self.add_tally(&tally)
    }
}
