//! Whether a loopback agent is up, crashed or gone, which life it is in, and
//! the guard that keeps its registered memory alive while a READ copies it.
//!
//! This module owns those three facts per agent and nothing else. The fabric
//! consults them on every send, drain, handshake and READ; the network's
//! control methods (`crash`, `restart`) and the fabric's `Drop` change them.
//!
//! # Why "gone" differs from "crashed"
//!
//! A crashed agent's process is frozen: its memory still exists, a restart
//! brings it back. A *gone* agent's fabric was dropped, so the raw memory it
//! registered may already be freed. Nothing may copy from it again, and it
//! cannot be restarted. Because READs against it run on other threads,
//! [`Liveness::retire`] waits until every copy that began before it finished
//! (a Dekker-style handshake on two `SeqCst` atomics: a copier raises
//! `copying` then checks the state; the retirer sets the state then waits for
//! `copying` to drop to zero; one of them must see the other).

use crate::sync::{AtomicU32, Ordering};

const UP: u32 = 0;
const CRASHED: u32 = 1;
const GONE: u32 = 2;

#[derive(Debug)]
pub(crate) struct Liveness {
    state: AtomicU32,
    /// Bumped by each restart. Messages and READs stamped with an older
    /// incarnation belong to a dead process and are discarded.
    incarnation: AtomicU32,
    /// Copies from this agent's memory in progress.
    copying: AtomicU32,
}

/// Proof that a copy from an agent's memory may proceed; ends the copy when
/// dropped.
pub(crate) struct CopyGuard<'a>(&'a Liveness);

impl Drop for CopyGuard<'_> {
    fn drop(&mut self) {
        self.0.copying.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Liveness {
    pub(crate) fn new() -> Liveness {
        Liveness {
            state: AtomicU32::new(UP),
            incarnation: AtomicU32::new(0),
            copying: AtomicU32::new(0),
        }
    }

    /// Freezes the agent. No effect on a gone agent.
    pub(crate) fn crash(&self) {
        let _ = self
            .state
            .compare_exchange(UP, CRASHED, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// Brings a crashed agent back as a new incarnation; a no-op for an
    /// agent that is up or gone.
    pub(crate) fn restart(&self) {
        // Bump first, so that nobody sees the agent up in its old life.
        if self.state.load(Ordering::SeqCst) == CRASHED {
            self.incarnation.fetch_add(1, Ordering::SeqCst);
            let _ = self
                .state
                .compare_exchange(CRASHED, UP, Ordering::SeqCst, Ordering::SeqCst);
        }
    }

    /// Marks the agent gone for good and waits until no copy from its memory
    /// is in progress. Copies are short (one READ's descriptors), so a spin
    /// with yields is enough.
    pub(crate) fn retire(&self) {
        self.state.store(GONE, Ordering::SeqCst);
        while self.copying.load(Ordering::SeqCst) != 0 {
            std::thread::yield_now();
        }
    }

    /// Not answering: crashed or gone.
    pub(crate) fn is_down(&self) -> bool {
        self.state.load(Ordering::SeqCst) != UP
    }

    pub(crate) fn incarnation(&self) -> u32 {
        self.incarnation.load(Ordering::SeqCst)
    }

    /// Starts a copy from this agent's memory, or `None` when it is gone.
    pub(crate) fn begin_copy(&self) -> Option<CopyGuard<'_>> {
        self.copying.fetch_add(1, Ordering::SeqCst);
        let guard = CopyGuard(self);
        (self.state.load(Ordering::SeqCst) != GONE).then_some(guard)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn restart_bumps_the_incarnation_only_after_a_crash() {
        let n = Liveness::new();
        n.restart();
        assert_eq!(n.incarnation(), 0);
        n.crash();
        assert!(n.is_down());
        n.restart();
        assert!(!n.is_down());
        assert_eq!(n.incarnation(), 1);
    }

    #[test]
    fn gone_is_final_and_blocks_copies() {
        let n = Liveness::new();
        assert!(n.begin_copy().is_some());
        n.retire();
        assert!(n.begin_copy().is_none());
        n.restart();
        n.crash();
        assert!(n.is_down());
        assert_eq!(n.copying.load(Ordering::SeqCst), 0);
    }
}
