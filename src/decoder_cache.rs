//! D's cache of finished turns (bidirectional mode): blocks held for a fixed
//! `decoder_kv_blocks_ttl` so that P can pull them on the next turn.
//!
//! This module owns the *D-side* policy of that cache: which settings the
//! holder runs with (a fixed term, never renewed), what D exports with the
//! request's params (`remote_blocks_expiry_time`, and the lease slot and
//! nonce when verification is on), and how that deadline is written and read
//! back as vLLM's float seconds. It holds no lease logic of its own and
//! touches no slot words, timers or notifications.
//!
//! # Why it is P in reverse
//!
//! Holding blocks for a remote reader until it reports its read done or a
//! deadline passes, with a slot and nonce that the reader checks after its
//! READ, is exactly what P does for D on the first turn. So D runs the same
//! two roles, with the same ordering rules:
//!
//! - D's scheduler runs a [`DecoderCacheScheduler`]: a
//!   [`PrefillScheduler`] whose leases are a fixed term of
//!   `decoder_kv_blocks_ttl` (expiry and renewal ceiling both `start + ttl`,
//!   so a stray heartbeat cannot extend it). It assigns (slot, nonce), hands
//!   out directives, aggregates rank reports and frees the blocks only when
//!   every rank let go.
//! - Each D worker runs a [`PrefillRank`] built by [`new_cache_rank`] over
//!   its own slot array (registered with its own agent, advertised in the
//!   handshake): it writes the nonce when the directive arrives, counts P's
//!   read-done (`id:consumers:nonce=...`), expires on its own clock and
//!   zeroes the slot *before* it reports.
//!
//! ```text
//!  request finished decoding ──keep(id, now)──▶ HELD until now + ttl (fixed)
//!    export: remote_blocks_expiry_time = expiry (D's clock, float seconds)
//!            remote_lease_slot / remote_lease_nonce (verification on, slot free)
//!  HELD ──P's read-done × consumers on every rank──▶ released (read): free blocks
//!  HELD ──ttl passes on a rank──▶ slot zeroed, reported ──every rank──▶ free blocks
//!  engine freed the blocks ──▶ slot back to the pool
//! ```
//!
//! # Which clock the deadline is on
//!
//! P compares the deadline with its estimate of the clock that answered its
//! handshake ([`crate::clock_offset`]), which is the clock of the D worker
//! it handshakes with. So the `now` given to [`DecoderCacheScheduler::keep`]
//! must be on that clock: on one host, pass every D process the same
//! monotonic clock (the OS's); across hosts, the scheduler's clock must be
//! rebased per worker before export, or the TTL shortened by the skew.
//!
//! # Ordering
//!
//! `keep` queues a Grant directive that starts the lease on every rank and
//! writes the nonce. The workers apply it in the next step, while the
//! params are on their way back to the client; a turn-2 read that beats the
//! directive finds the slot zero and fails closed (a recompute), never a
//! silent read.
//!
//! # Allocation
//!
//! None after construction: `keep`, directives, reports, expiry and the
//! drain are the P roles' zero-allocation paths (`tests/bidir_alloc.rs`).

use core::time::Duration;
use std::sync::Arc;

use crate::config::LeaseConfig;
use crate::lease_fields::LeaseFields;
use crate::nonce::NonceSource;
use crate::producer::{GrantError, PrefillRank, PrefillScheduler, RankError, SchedulerError};
use crate::slot_pool::SlotPool;
use crate::slots::LeaseSlots;
use crate::time::Instant;

/// The settings D's cache roles run with: `config` with the lease term set
/// to `decoder_kv_blocks_ttl` (which also sizes the ranks' wheels). Build
/// D's cache ranks from this (or with [`new_cache_rank`]).
pub fn cache_config(config: &LeaseConfig) -> LeaseConfig {
    let mut c = config.clone();
    c.lease_duration = config.decoder_kv_blocks_ttl();
    // The fixed term is set on the scheduler (exact, not whole seconds) and
    // carried to the ranks as each lease's renewal ceiling.
    c.max_hold_secs = None;
    c
}

/// One D worker's cache rank: a [`PrefillRank`] over `slots` with
/// [`cache_config`].
pub fn new_cache_rank(
    config: &LeaseConfig,
    rank: u32,
    slots: Arc<LeaseSlots>,
    now: Instant,
) -> Result<PrefillRank, RankError> {
    PrefillRank::new(&cache_config(config), rank, slots, now)
}

/// What D exports with a finished request in bidirectional mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CachedBlocks {
    /// `remote_blocks_expiry_time`: when D frees the blocks, on D's clock
    /// ([`expiry_time_param`] writes it as vLLM's float seconds).
    pub expiry: Instant,
    /// `remote_lease_slot` / `remote_lease_nonce`, or `None` when the
    /// blocks cannot be verified (verification off, or no free slot): omit
    /// both, and a verifying P declines the read.
    pub fields: Option<LeaseFields>,
}

/// D's scheduler-side cache role. See the module docs.
#[derive(Debug)]
pub struct DecoderCacheScheduler {
    inner: PrefillScheduler,
    ttl: Duration,
}

impl DecoderCacheScheduler {
    /// A cache role for an engine of `ranks` workers, with its own slot pool
    /// and nonces from OS randomness.
    pub fn new(
        config: &LeaseConfig,
        ranks: u32,
        now: Instant,
    ) -> Result<DecoderCacheScheduler, SchedulerError> {
        let pool = Arc::new(SlotPool::new(config.lease_slots));
        DecoderCacheScheduler::with_parts(config, ranks, pool, NonceSource::from_entropy(), now)
    }

    /// As [`DecoderCacheScheduler::new`] with a given pool and nonce source.
    pub fn with_parts(
        config: &LeaseConfig,
        ranks: u32,
        pool: Arc<SlotPool>,
        nonces: NonceSource,
        now: Instant,
    ) -> Result<DecoderCacheScheduler, SchedulerError> {
        let ttl = config.decoder_kv_blocks_ttl();
        let mut inner =
            PrefillScheduler::with_parts(&cache_config(config), ranks, pool, nonces, now)?;
        inner.set_fixed_term(ttl);
        Ok(DecoderCacheScheduler { inner, ttl })
    }

    /// The fixed term: `decoder_kv_blocks_ttl`.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Keeps the blocks of `request_id` (it finished decoding) until
    /// `now + decoder_kv_blocks_ttl`, and says what to export. Errors are the
    /// P scheduler's: on any of them, do not keep the blocks (free them and
    /// export no deadline; P recomputes the next turn).
    pub fn keep(&mut self, request_id: &str, now: Instant) -> Result<CachedBlocks, GrantError> {
        let grant = self.inner.grant(request_id, now)?;
        Ok(CachedBlocks {
            expiry: grant.expiry,
            fields: grant.lease_fields(),
        })
    }

    /// The P scheduler underneath: directives, reports, the drain, the pool.
    pub fn scheduler(&self) -> &PrefillScheduler {
        &self.inner
    }

    /// The P scheduler underneath, mutably: call `encode_directives`,
    /// `apply_reports`, `drain_released`, `blocks_freed` and `cancel` on it.
    pub fn scheduler_mut(&mut self) -> &mut PrefillScheduler {
        &mut self.inner
    }
}

/// `remote_blocks_expiry_time` as vLLM writes it: seconds on D's clock, as a
/// float.
pub fn expiry_time_param(expiry: Instant) -> f64 {
    expiry.as_nanos() as f64 / 1e9
}

/// Why a `remote_blocks_expiry_time` could not be read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ExpiryParamError {
    /// NaN or infinite.
    #[error("remote_blocks_expiry_time is not a finite number")]
    NotFinite,
    /// Below zero: no instant of our clocks.
    #[error("remote_blocks_expiry_time is negative")]
    Negative,
}

/// Reads a `remote_blocks_expiry_time` (outside input: it crossed a router).
/// Rounds down to the nanosecond, so the deadline P compares with is never
/// later than the one D wrote; saturates at [`Instant::MAX`]. P should
/// decline a read whose deadline it cannot read rather than read it
/// unchecked.
pub fn parse_expiry_time(secs: f64) -> Result<Instant, ExpiryParamError> {
    if !secs.is_finite() {
        return Err(ExpiryParamError::NotFinite);
    }
    if secs < 0.0 {
        return Err(ExpiryParamError::Negative);
    }
    // `as` saturates for floats too large for u64.
    let ns = (secs * 1e9).floor() as u64;
    Ok(Instant::from_nanos(ns))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expiry_param_round_trips_never_later() {
        for ns in [0u64, 1, 999_999_999, 480_000_000_000, 1_234_567_890_123_456] {
            let back = parse_expiry_time(expiry_time_param(Instant::from_nanos(ns))).unwrap();
            assert!(back.as_nanos() <= ns, "{ns} -> {back:?}");
            // f64 keeps ~15.9 significant digits: within a microsecond here.
            assert!(ns - back.as_nanos() < 1_000, "{ns} -> {back:?}");
        }
        assert_eq!(
            parse_expiry_time(f64::NAN),
            Err(ExpiryParamError::NotFinite)
        );
        assert_eq!(
            parse_expiry_time(f64::INFINITY),
            Err(ExpiryParamError::NotFinite)
        );
        assert_eq!(parse_expiry_time(-0.5), Err(ExpiryParamError::Negative));
        assert_eq!(parse_expiry_time(1e300), Ok(Instant::MAX));
    }

    #[test]
    fn cache_config_uses_the_ttl_as_the_term() {
        let mut config = LeaseConfig::new(crate::EngineShape {
            num_kv_blocks: 8,
            max_num_seqs: 0,
        });
        config.decoder_kv_blocks_ttl = Duration::from_millis(2_500);
        config.max_hold_secs = Some(600);
        let c = cache_config(&config);
        assert_eq!(c.lease_duration(), Duration::from_millis(2_500));
        assert_eq!(c.max_hold(), None);
    }
}
