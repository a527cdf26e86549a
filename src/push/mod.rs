//! Push mode's guard: D never waits forever on a WRITE that cannot come,
//! never leaks the blocks it registered, and frees them only when no WRITE
//! of P can still land in them.
//!
//! This module owns the two roles of the guard, [`PushPermits`] (D: the
//! write permits it granted) and [`PushWrites`] (P: the registrations it
//! holds, and the gate in front of each WRITE), their settings
//! ([`PushConfig`]) and their notifications ([`wire`]). Like the pull roles
//! they read no clock, allocate nothing after construction, and take bytes
//! off the wire without panicking. They post no WRITE and free no block: the
//! engine does both when the roles say so.
//!
//! # The problem
//!
//! In push mode D allocates blocks for a request and registers them with P
//! (vLLM's `PUSH_REG`); P WRITEs its KV into them after prefill. A WRITE is
//! one-sided: D cannot stop one that is in flight. So D may free registered
//! blocks only once no WRITE into them can still land. Stock vLLM keeps them
//! until P reports the transfer; when that report can never come (P let the
//! request go before the registration arrived, P died, its handshake
//! failed), D keeps them for good, and the request hangs.
//!
//! # The protocol: a write permit, a lease in the other direction
//!
//! The registration carries a **permit**: D's slot, a fresh nonce and a
//! deadline **on D's clock** ([`PermitFields`]). P may *post* a WRITE under
//! it only while the deadline, translated onto P's clock by P's offset
//! estimate of D ([`crate::clock_offset`]) and moved earlier by the
//! estimate's error bound and by `post_margin`, is still ahead. A posted
//! WRITE lands within `write_bound` (a setting: see below). So once D's own
//! clock passes the **fence**,
//!
//! ```text
//! fence = deadline + write_bound * (1 + drift_ppm / 10^6)
//! ```
//!
//! no WRITE of P can land, whatever P does, and D may free without hearing
//! from P. Everything else only makes D free *earlier*, each time on P's
//! word that nothing is or will be in flight:
//!
//! ```text
//!  D (PushPermits)                                  P (PushWrites)
//!  register ── PUSH_REG + permit(slot, nonce, deadline) ─▶ register:
//!                                                  request gone / no clock / past deadline
//!     end: Refused ◀──────────── PEND:R (at once) ─┤ (never posts)
//!                                                  held ──▶ PHB: every interval
//!  PHB: ─▶ deadline = max(deadline, now + extension) ── PRN:(deadline) ─▶ deadline raised
//!                                                  begin_write: gate open? ─▶ post WRITE
//!     end: Written ◀──────────── PEND:W ── write_done(ok) (the data is in D's blocks)
//!     end: EndedByP ◀─────────── PEND:X ── write_done(failed) / gate closed / cancel
//!  revoke (abort, preemption, watchdog) ── PRV: (resent each interval) ─▶
//!                                                  held: ends now; posted: when the WRITE ends
//!     end: Revoked ◀──────────── PEND:* ─┘
//!  poll: now >= fence, no word ─▶ end: Lapsed (open) or Revoked (revoking)
//! ```
//!
//! Fault cases, each ending within the bound:
//!
//! - **The registration reaches P after P let the request go.** P answers
//!   `R` at once; D frees on it (no deadline to wait for).
//! - **P refuses, cannot handshake, or never gets the registration.** No
//!   `PHB:`, no renewal: D ends the permit at the fence of its first
//!   deadline, `duration + write_bound` after registering.
//! - **P dies.** Its heartbeats stop, D stops renewing: the permit ends at
//!   the fence, at most `max(duration, extension + interval) + write_bound`
//!   after P's last heartbeat (the pull side's bound, plus the WRITE).
//! - **D aborts** (or preempts, or its own watchdog gives up). D revokes;
//!   a live P answers as soon as no WRITE is in flight; a dead or cut-off P
//!   is waited out to the fence. A revoked permit is never renewed, so the
//!   fence does not move.
//! - **Lost, duplicated, reordered notifications.** Every message names
//!   (slot, nonce); a stale nonce changes nothing. Lost `PRV:` are resent;
//!   a lost `PEND:` is answered again on the next `PRV:` or duplicate
//!   registration, and otherwise the fence ends the permit. P never answers
//!   a `PRV:` for a permit it does not know: the registration may still be
//!   on its way, and P would then accept it; D waits for the fence instead.
//!   P remembers an ended registration until its deadline has surely
//!   passed (P's clock past the translated deadline plus the estimate's
//!   bound), so that no later estimate, however much tighter, opens the
//!   gate again for a duplicate of it; with no estimate of that D it never
//!   forgets (the model check found the earlier rule, "until the gate is
//!   closed", unsafe when a better estimate arrives).
//! - **Unsynchronized clocks.** P compares D's deadline only through its
//!   estimate, widened by the estimate's bound, which grows with the
//!   sample's age at `drift_ppm`. With no estimate of that D, P refuses.
//!
//! # The write bound, and what happens beyond it
//!
//! `write_bound` is how long a posted WRITE may stay in flight before it
//! lands or fails. kvlease cannot enforce it: an RDMA WRITE that is still
//! in flight past the fence lands in blocks D may have reused. Set it above
//! the transport's own give-up time (UCX's RC retry timeout, for example:
//! after it the operation is failed and nothing lands); the default, 10 s,
//! is above UCX's defaults. A WRITE that P sees end after `write_bound` is
//! counted (`WriteCounters::late_writes`), never silent.
//!
//! # Fail closed
//!
//! Anything that cannot be guarded is a failed load, never an unguarded
//! WRITE: D out of permits ([`PushError::Exhausted`]: the caller fails the
//! load and does not register), P without a clock estimate or without room
//! (refused: `R`, or the fence), a peer that does not speak the guard (the
//! engine's decision: a stock peer gets stock behaviour, unguarded).

mod permits;
pub mod wire;
mod writes;

#[cfg(test)]
mod tests;

use core::time::Duration;

use crate::time::duration_nanos;

pub use permits::{PermitCounters, PermitEnd, PushEnd, PushPermits};
pub use wire::{EndCode, PermitFields, PushWireError};
pub use writes::{PostRefused, PushWrites, Refusal, WriteCounters, WriteHandle};

/// The guard's settings; the same on both sides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PushConfig {
    /// Registrations one side holds at once (D: permits; P: registrations,
    /// ended ones kept for duplicates included).
    pub capacity: u32,
    /// A fresh permit's time (`kv_lease_duration`).
    pub duration: Duration,
    /// A renewal's floor: a `PHB:` moves the deadline to at least
    /// `now + extension` (`duration * 2 // 3` in whole seconds, the pull
    /// side's rule: [`crate::config::lease_extension_of`]).
    pub extension: Duration,
    /// P's `PHB:` and D's `PRV:` resend interval (`duration // 6` in whole
    /// seconds: [`crate::config::heartbeat_interval_of`]).
    pub heartbeat_interval: Duration,
    /// Longest a posted WRITE stays in flight (see the module docs).
    pub write_bound: Duration,
    /// P: the most time between [`PushWrites::begin_write`] and the post.
    pub post_margin: Duration,
    /// How fast the two clocks may drift apart (as the offset estimator's).
    pub drift_ppm: u32,
    /// Largest notification either side sends.
    pub max_message_len: usize,
}

impl Default for PushConfig {
    fn default() -> Self {
        PushConfig::with_duration(Duration::from_secs(12))
    }
}

impl PushConfig {
    /// The defaults for a permit duration (the pull side's
    /// `kv_lease_duration`): extension and interval by the pull side's one
    /// rule (`duration * 2 // 3` and `duration // 6`, whole seconds: under
    /// 6 s the interval is 0 and [`PushConfig::validate`] refuses it), write
    /// bound 10 s, post margin 1 s, 100 ppm, 1,024 registrations, 64 KiB
    /// messages. An engine reading vLLM's config takes
    /// [`PushConfig::from_lease_config`], which also reads the push keys.
    pub fn with_duration(duration: Duration) -> PushConfig {
        PushConfig {
            capacity: 1024,
            duration,
            extension: crate::config::lease_extension_of(duration),
            heartbeat_interval: crate::config::heartbeat_interval_of(duration),
            write_bound: Duration::from_secs(10),
            post_margin: Duration::from_secs(1),
            drift_ppm: 100,
            max_message_len: 64 * 1024,
        }
    }

    /// The guard's settings from an engine's lease config (vLLM's
    /// `kv_connector_extra_config`, parsed once): a permit lasts
    /// `kv_lease_duration`, with the pull side's interval and extension
    /// (one derivation: [`crate::config::heartbeat_interval_of`],
    /// [`crate::config::lease_extension_of`]), `kv_lease_push_write_bound`,
    /// `kv_lease_push_capacity`, and the guard's defaults for the rest.
    ///
    /// ```
    /// use kvlease::push::PushConfig;
    /// use kvlease::{EngineShape, LeaseConfig};
    /// use std::time::Duration;
    ///
    /// let shape = EngineShape { num_kv_blocks: 1024, max_num_seqs: 64 };
    /// let parsed = LeaseConfig::from_extra_config_json(
    ///     r#"{"kv_lease_duration": 12, "kv_lease_push_write_bound": 4.5}"#,
    ///     shape,
    /// )?;
    /// let push = PushConfig::from_lease_config(&parsed.config);
    /// assert_eq!(push.duration, Duration::from_secs(12));
    /// assert_eq!(push.extension, Duration::from_secs(8));
    /// assert_eq!(push.heartbeat_interval, Duration::from_secs(2));
    /// assert_eq!(push.write_bound, Duration::from_millis(4500));
    /// assert_eq!(push.capacity, 1024);
    /// assert!(parsed.unknown_keys.is_empty());
    /// # Ok::<(), kvlease::ConfigError>(())
    /// ```
    pub fn from_lease_config(config: &crate::LeaseConfig) -> PushConfig {
        PushConfig {
            capacity: config.push_capacity,
            write_bound: config.push_write_bound,
            ..PushConfig::with_duration(config.lease_duration())
        }
    }

    /// How long after its post P holds its own blocks for a WRITE that
    /// never reached a terminal state (a WRITE stuck on the wire, a dead D
    /// with UCX error handling `none`): `2 * write_bound + (extension +
    /// write_bound) * (1 + drift)`, then a little more for the drift over
    /// the first two terms.
    ///
    /// Why that is enough: P stops naming a WRITE in its `PHB:` once it is
    /// `write_bound` old ([`PushWrites::poll`]: past the bound P no longer
    /// vouches for it), so the last `PHB:` that can renew D's permit leaves
    /// P by then. Delivered within `write_bound` (the bound the guard
    /// already takes for the WRITE itself, on the same transport), it moves
    /// D's deadline to at most its arrival plus `extension`; D's fence is
    /// `write_bound` (plus drift) later. From then D has failed the load
    /// and will not use what lands, so holding P's blocks protects nothing:
    /// the engine ends the hold, counts it and logs it. Durations only: no
    /// clock estimate is involved.
    pub fn hold_bound(&self) -> Duration {
        let wb = duration_nanos(self.write_bound);
        let tail = duration_nanos(self.extension).saturating_add(wb);
        let drift = |n: u64| {
            n.saturating_mul(u64::from(self.drift_ppm))
                .div_ceil(1_000_000)
        };
        let body = wb.saturating_mul(2).saturating_add(tail);
        Duration::from_nanos(body.saturating_add(drift(body)))
    }

    /// Checks the settings; the roles' constructors call it.
    pub fn validate(&self) -> Result<(), PushError> {
        if self.capacity == 0 || self.capacity > (1 << 30) {
            return Err(PushError::Config("capacity must be 1..=2^30"));
        }
        if self.duration.is_zero() || self.extension.is_zero() {
            return Err(PushError::Config("duration and extension must be > 0"));
        }
        if self.heartbeat_interval.is_zero() || self.heartbeat_interval >= self.extension {
            return Err(PushError::Config(
                "heartbeat_interval must be > 0 and shorter than the extension",
            ));
        }
        if self.post_margin >= self.extension {
            return Err(PushError::Config(
                "post_margin must be shorter than the extension",
            ));
        }
        if self.max_message_len < wire::END_PREFIX.len() + wire::RENEW_RECORD_LEN {
            return Err(PushError::Config("max_message_len cannot hold one record"));
        }
        Ok(())
    }
}

/// The roles' errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PushError {
    /// A setting out of range (which, and why).
    Config(&'static str),
    /// D has no free permit: the push cannot be guarded; fail the load.
    Exhausted,
    /// No live permit with that slot and nonce.
    UnknownPermit,
}

impl core::fmt::Display for PushError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            PushError::Config(why) => write!(f, "push config: {why}"),
            PushError::Exhausted => f.write_str("no free push permit: the load fails"),
            PushError::UnknownPermit => f.write_str("no live push permit with that slot and nonce"),
        }
    }
}

impl std::error::Error for PushError {}
