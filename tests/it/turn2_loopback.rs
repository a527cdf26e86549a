//! Turn-2 reads over the loopback fabric: P pulls the blocks D cached after
//! turn 1, gated by the clock-offset estimate and checked by the lease
//! verifier, in virtual time.
//!
//! D's clock runs 1000 s ahead of P's (the loopback fabric reports each
//! agent's own clock in the handshake sample). D caches a turn for a 30 s
//! TTL; a READ takes 12 s (a congested link). The cases:
//!
//! - a read that starts early enough finishes before the TTL: verified, the
//!   bytes are turn 1's, and P's read-done frees D's blocks at once;
//! - a read too close to the deadline is declined (a recompute);
//! - a read that the gate let through but that D's TTL overtakes mid-READ,
//!   after which D reuses the blocks for another conversation: **with**
//!   verification the load fails (`Lapsed`); **without** it P gets the other
//!   conversation's bytes and nothing tells it (the silent corruption the
//!   verification prevents).
#![allow(clippy::disallowed_types)] // test memory: leaked std atomics (see clippy.toml)

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::support::free_released;
use kvlease::clock_offset::{ClockOffset, ClockOffsetConfig};
use kvlease::consumer::{LeaseVerifier, Verdict, VerifyTarget};
use kvlease::decoder_cache::{self, CachedBlocks, DecoderCacheScheduler};
use kvlease::fabric::loopback::{LoopbackConfig, LoopbackFabric, LoopbackNetwork};
use kvlease::fabric::{AgentId, Fabric, HandshakeState, PeerInfo, ReadDesc, RegionId, XferState};
use kvlease::turn2_read::{self, Turn2Read};
use kvlease::{EngineShape, Instant, LeaseConfig, LeaseSlots, PrefillRank, ReleaseReason};

const D_AHEAD: Duration = Duration::from_secs(1000);
const TTL: Duration = Duration::from_secs(30);
const READ_LATENCY: Duration = Duration::from_secs(12);
const BLOCK_WORDS: usize = 64;
const TURN_1: u64 = 0x1111_1111_1111_1111;
const OTHER_CONVERSATION: u64 = 0x2222_2222_2222_2222;

fn v(ms: u64) -> Instant {
    Instant::from_millis(ms)
}

fn leak_words(n: usize) -> &'static [AtomicU64] {
    Box::leak((0..n).map(|_| AtomicU64::new(0)).collect())
}

fn register_words(f: &mut LoopbackFabric, words: &'static [AtomicU64]) -> RegionId {
    // SAFETY: leaked, so allocated and unmoved for the process's life; every
    // Rust access to the words is atomic.
    unsafe { f.register_memory(words.as_ptr() as *mut u8, std::mem::size_of_val(words)) }.unwrap()
}

/// D: one worker with its cache rank, its slot array and its KV blocks.
struct D {
    fabric: LoopbackFabric,
    sched: DecoderCacheScheduler,
    rank: PrefillRank,
    kv: &'static [AtomicU64],
    kv_region: RegionId,
    meta: Vec<u8>,
    out: Vec<u8>,
    freed: Vec<(String, ReleaseReason)>,
}

impl D {
    fn clock(at: Instant) -> Instant {
        at + D_AHEAD
    }

    /// Finished decoding `id`: keep its blocks (holding `pattern`) and say
    /// what to export.
    fn finish_turn(&mut self, id: &str, pattern: u64, at: Instant) -> CachedBlocks {
        for w in self.kv {
            w.store(pattern, Ordering::Release);
        }
        let kept = self.sched.keep(id, D::clock(at)).unwrap();
        self.step(at);
        kept
    }

    fn step(&mut self, at: Instant) {
        let now = D::clock(at);
        let n = self
            .sched
            .scheduler_mut()
            .encode_directives(now, &mut self.meta)
            .unwrap();
        self.rank.apply_directives(&self.meta[..n], now).unwrap();
        let rank = &mut self.rank;
        self.fabric
            .drain_notifications(&mut |_, msg| {
                let _ = rank.on_notification("d0", msg, now);
            })
            .unwrap();
        self.rank.poll(now);
        let m = self.rank.encode_reports(&mut self.out).unwrap();
        self.sched
            .scheduler_mut()
            .apply_reports(0, &self.out[..m])
            .unwrap();
        free_released(self.sched.scheduler_mut(), &mut self.freed);
    }
}

/// P: one worker reading turn 2.
struct P {
    fabric: LoopbackFabric,
    to_d: AgentId,
    info: PeerInfo,
    clock: ClockOffset,
    verifier: LeaseVerifier,
    landing: &'static [AtomicU64],
    landing_region: RegionId,
}

struct World {
    net: Arc<LoopbackNetwork>,
    d: D,
    p: P,
}

fn world(verification: bool) -> World {
    let net = LoopbackNetwork::new(LoopbackConfig {
        read_latency: READ_LATENCY,
        transfer_timeout: Duration::from_secs(60),
        ..LoopbackConfig::default()
    });
    let mut df = LoopbackFabric::join(&net, "D").unwrap();
    let mut pf = LoopbackFabric::join(&net, "P").unwrap();
    net.set_clock_offset(df.node(), D_AHEAD.as_nanos() as i64);

    let mut config = LeaseConfig::new(EngineShape {
        num_kv_blocks: 16,
        max_num_seqs: 0,
    });
    config.decoder_kv_blocks_ttl = TTL;
    config.verification = verification;
    let slots = Arc::new(LeaseSlots::new(config.lease_slots));
    if verification {
        df.register_slots(slots.clone(), true).unwrap();
    }
    let kv = leak_words(BLOCK_WORDS);
    let kv_region = register_words(&mut df, kv);
    let sched = DecoderCacheScheduler::new(&config, 1, D::clock(v(0))).unwrap();
    let rank = decoder_cache::new_cache_rank(&config, 0, slots, D::clock(v(0))).unwrap();
    let out = vec![0u8; rank.max_reports_len()];

    let landing = leak_words(BLOCK_WORDS);
    let landing_region = register_words(&mut pf, landing);
    let verifier = LeaseVerifier::new(&mut pf, &kvlease::testkit::verifier_config(16, 4)).unwrap();
    let to_d = pf.start_handshake("D", v(0)).unwrap();
    let mut info = None;
    for ms in 0..100 {
        if let HandshakeState::Ready(i) = pf.handshake_state(to_d, v(ms)) {
            info = Some(i);
            break;
        }
    }
    let info = info.expect("handshake completes");
    let mut clock = ClockOffset::new(ClockOffsetConfig::default());
    clock.observe(
        info.clock
            .expect("the loopback handshake takes a clock sample"),
    );

    World {
        net,
        d: D {
            fabric: df,
            sched,
            rank,
            kv,
            kv_region,
            meta: vec![0u8; 1 << 16],
            out,
            freed: Vec::new(),
        },
        p: P {
            fabric: pf,
            to_d,
            info,
            clock,
            verifier,
            landing,
            landing_region,
        },
    }
}

/// What P ended up with.
#[derive(Debug, PartialEq, Eq)]
enum Load {
    Declined,
    /// The READ completed; the verdict (None: not verified) and the bytes.
    Read(Option<Verdict>, u64),
}

impl World {
    /// P receives turn 2 with D's exported params at virtual `start` and
    /// pulls; D runs its steps (and `d_between` at `reuse_at`) meanwhile.
    fn turn2(
        &mut self,
        id: &str,
        kept: CachedBlocks,
        start: Instant,
        reuse_at: Option<Instant>,
    ) -> Load {
        // The deadline crossed the client as vLLM's float seconds.
        let param = decoder_cache::expiry_time_param(kept.expiry);
        let deadline = decoder_cache::parse_expiry_time(param).unwrap();
        self.net.advance_to(start);
        // P verifies (its kv_lease_verification is on); whether it can
        // depends on what D advertised and exported.
        let plan = turn2_read::decide(
            &mut self.p.clock,
            Some(deadline),
            kept.fields,
            &self.p.info,
            true,
            start,
        );
        if plan == Turn2Read::Decline {
            return Load::Declined;
        }
        let descs = [ReadDesc {
            local: self.p.landing_region,
            local_offset: 0,
            remote: self.d.kv_region,
            remote_offset: 0,
            len: (BLOCK_WORDS * 8) as u64,
        }];
        let xfer = self
            .p
            .fabric
            .post_read(self.p.to_d, &descs, None, start)
            .unwrap();
        let mut at = start;
        let mut reused = false;
        loop {
            at = at + Duration::from_millis(500);
            self.net.advance_to(at);
            self.d.step(at);
            if let Some(r) = reuse_at {
                if !reused && at >= r {
                    // D's TTL freed the blocks; another conversation gets them.
                    assert!(self
                        .d
                        .freed
                        .iter()
                        .any(|(f, why)| f == id && *why == ReleaseReason::Expired));
                    self.d
                        .finish_turn("other-conversation", OTHER_CONVERSATION, at);
                    reused = true;
                }
            }
            match self.p.fabric.read_state(xfer, at) {
                XferState::InProgress => continue,
                XferState::Done => break,
                XferState::Failed(e) => panic!("block READ failed: {e}"),
            }
        }
        let bytes = self.p.landing[0].load(Ordering::Acquire);
        assert!(self
            .p
            .landing
            .iter()
            .all(|w| w.load(Ordering::Acquire) == bytes));
        let Turn2Read::Verified(fields) = plan else {
            return Load::Read(None, bytes);
        };
        // Verify: one slot READ, then the verdict.
        let target = VerifyTarget::from_peer(self.p.to_d, &self.p.info).unwrap();
        self.p.verifier.submit(7, Some(fields), &[target]).unwrap();
        let mut verdict = None;
        while verdict.is_none() {
            at = at + Duration::from_millis(500);
            self.net.advance_to(at);
            self.d.step(at);
            self.p
                .verifier
                .step(&mut self.p.fabric, at, |_, v| verdict = Some(v));
        }
        if verdict == Some(Verdict::Verified) {
            // P's read-done, with the nonce, frees D's blocks now.
            let mut msg = vec![0u8; id.len() + kvlease::wire::MAX_READ_DONE_SUFFIX_LEN];
            let n = kvlease::wire::encode_read_done(id, 1, Some(fields.nonce), &mut msg).unwrap();
            self.p
                .fabric
                .send_notification(self.p.to_d, &msg[..n])
                .unwrap();
            self.d.step(at + Duration::from_millis(10));
        }
        Load::Read(verdict, bytes)
    }
}

#[test]
fn an_early_read_is_verified_and_frees_d_at_once() {
    let mut w = world(true);
    let kept = w.d.finish_turn("conv-1", TURN_1, v(1_000));
    assert_eq!(kept.expiry, D::clock(v(1_000)) + TTL);
    let load = w.turn2("conv-1", kept, v(5_000), None);
    assert_eq!(load, Load::Read(Some(Verdict::Verified), TURN_1));
    assert_eq!(w.d.freed, [("conv-1".to_owned(), ReleaseReason::ReadDone)]);
    assert_eq!(w.p.clock.counters().allowed, 1);
}

#[test]
fn a_read_too_close_to_the_deadline_is_declined() {
    let mut w = world(true);
    let kept = w.d.finish_turn("conv-1", TURN_1, v(1_000));
    // 31 s is D's deadline in P's clock; 27 s leaves 4 s < the 5 s margin.
    assert_eq!(w.turn2("conv-1", kept, v(27_000), None), Load::Declined);
    assert_eq!(w.p.clock.counters().declined, 1);
}

#[test]
fn ttl_expiring_mid_readback_fails_the_load_with_verification() {
    let mut w = world(true);
    let kept = w.d.finish_turn("conv-1", TURN_1, v(1_000));
    // Accepted at 20 s (11 s left > 5 s margin), but the READ takes 12 s:
    // D's TTL passes at 31 s and D reuses the blocks at 31.5 s.
    let load = w.turn2("conv-1", kept, v(20_000), Some(v(31_500)));
    assert_eq!(load, Load::Read(Some(Verdict::Lapsed), OTHER_CONVERSATION));
    assert_eq!(w.p.clock.counters().allowed, 1);
    assert_eq!(w.p.verifier.counters().lapsed, 1);
}

#[test]
fn ttl_expiring_mid_readback_without_verification_is_silent_corruption() {
    let mut w = world(false);
    let kept = w.d.finish_turn("conv-1", TURN_1, v(1_000));
    assert_eq!(kept.fields, None, "vLLM's behaviour: nothing to verify");
    assert_eq!(w.p.info.slot_region, None, "D advertises no slots");
    let load = w.turn2("conv-1", kept, v(20_000), Some(v(31_500)));
    // The READ succeeded and P holds another conversation's KV, with no
    // error anywhere: exactly what verification turns into a failed load.
    assert_eq!(load, Load::Read(None, OTHER_CONVERSATION));
}
