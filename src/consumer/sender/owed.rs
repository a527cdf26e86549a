//! [`OwedEngines`]: the engines the sender still owes a heartbeat.

use super::*;

/// The engines a sender owes a heartbeat, as [`EngineHandle`]s
/// ([`HeartbeatSender::owed_engines`]).
#[derive(Clone, Debug)]
pub struct OwedEngines<'s> {
    pub(super) sender_slots: &'s [Slot],
    pub(super) owed: &'s DenseSet,
    pub(super) next: u32,
}

impl Iterator for OwedEngines<'_> {
    type Item = EngineHandle;

    fn next(&mut self) -> Option<EngineHandle> {
        let index = self.owed.get(self.next)?;
        self.next += 1;
        Some(EngineHandle {
            index,
            generation: self.sender_slots.get(index as usize)?.generation,
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.owed.len().saturating_sub(self.next) as usize;
        (left, Some(left))
    }
}

impl ExactSizeIterator for OwedEngines<'_> {}
