//! Zero allocation in push mode's guard: after construction, 50,000 steps of
//! a D ([`PushPermits`]) and a P ([`PushWrites`]) exchanging their
//! notifications through fixed buffers (registrations accepted and
//! refused, WRITEs landing and failing, aborts, lost messages, permits
//! lapsing at the fence, the tables full) allocate exactly nothing.

#[path = "support/counting_alloc.rs"]
mod counting_alloc;

use counting_alloc::{count_allocs, CountingAlloc};

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

use std::time::Duration;

use kvlease::clock_offset::{ClockOffset, ClockOffsetConfig};
use kvlease::fabric::ClockSample;
use kvlease::push::{PermitFields, PushConfig, PushPermits, PushWrites, WriteHandle};
use kvlease::testkit::SplitMix64;
use kvlease::{Instant, NonceSource};

const CAP: usize = 256;
const STEPS: u64 = 50_000;
const MSG_SLOTS: usize = 64;
const MSG_LEN: usize = 2048;

/// Messages in flight one way, in fixed storage: a full mailbox drops (a
/// lost notification, which the guard must survive anyway).
struct Mailbox {
    bufs: Box<[[u8; MSG_LEN]]>,
    lens: Box<[usize]>,
    n: usize,
}

impl Mailbox {
    fn new() -> Mailbox {
        Mailbox {
            bufs: vec![[0u8; MSG_LEN]; MSG_SLOTS].into_boxed_slice(),
            lens: vec![0; MSG_SLOTS].into_boxed_slice(),
            n: 0,
        }
    }

    fn push(&mut self, m: &[u8]) {
        if self.n < MSG_SLOTS && m.len() <= MSG_LEN {
            self.bufs[self.n][..m.len()].copy_from_slice(m);
            self.lens[self.n] = m.len();
            self.n += 1;
        }
    }
}

#[test]
fn steady_state_push_steps_allocate_nothing() {
    // ---- construction (may allocate) ----
    let config = PushConfig {
        capacity: CAP as u32,
        max_message_len: MSG_LEN,
        ..PushConfig::with_duration(Duration::from_secs(6))
    };
    let mut d = PushPermits::new(config, NonceSource::from_seed(0, 11, 12)).unwrap();
    let mut p = PushWrites::new(config, 0x5eed).unwrap();
    let mut clock = ClockOffset::new(ClockOffsetConfig::default());
    clock.observe(ClockSample {
        local_send: Instant::from_millis(0),
        remote: Instant::from_millis(500_001),
        local_recv: Instant::from_millis(2),
    });
    let mut to_p = Mailbox::new();
    let mut to_d = Mailbox::new();
    let mut handles: Box<[Option<(WriteHandle, PermitFields, bool)>]> =
        vec![None; CAP].into_boxed_slice();
    let mut rng = SplitMix64::new(7);
    let mut ended = 0u64;

    // ---- steady state (must not allocate) ----
    let (_, counts) = count_allocs(|| {
        for step in 0..STEPS {
            // P's clock; D's reads 500 s more. 10 ms a step.
            let now = Instant::from_millis(10 + step * 10);
            let now_d = Instant::from_millis(500_010 + step * 10);
            let r = rng.next_u64();
            // A registration most steps; the request sometimes gone on P.
            if r % 4 != 0 {
                if let Ok(f) = d.register(1, now_d) {
                    let live = r % 17 != 0;
                    if let Ok(h) = p.register(2, f, live, &clock, now) {
                        if let Some(slot) = handles.iter_mut().find(|s| s.is_none()) {
                            *slot = Some((h, f, false));
                        }
                    }
                }
            }
            // Some held registrations are written, some WRITEs land, some
            // fail, some D revokes, some P cancels.
            for slot in handles.iter_mut() {
                let Some((h, f, posted)) = *slot else {
                    continue;
                };
                match rng.next_u64() % 2048 {
                    0..=3 if !posted => {
                        if p.begin_write(h, &clock, now).is_ok() {
                            *slot = Some((h, f, true));
                        } else {
                            *slot = None;
                        }
                    }
                    4..=6 if posted => {
                        p.write_done(h, rng.next_u64() % 8 != 0, now);
                        *slot = None;
                    }
                    7 => {
                        let _ = d.revoke(f.slot, f.nonce);
                    }
                    8 if !posted => {
                        p.cancel(h);
                        *slot = None;
                    }
                    _ => {}
                }
            }
            // Deliver, losing one in 20.
            for i in 0..to_p.n {
                if rng.next_u64() % 20 != 0 {
                    let _ = p.on_message(2, &to_p.bufs[i][..to_p.lens[i]]);
                }
            }
            to_p.n = 0;
            for i in 0..to_d.n {
                if rng.next_u64() % 20 != 0 {
                    let _ = d.on_message(1, &to_d.bufs[i][..to_d.lens[i]], now_d, |_| ended += 1);
                }
            }
            to_d.n = 0;
            p.poll(|_| Some(&clock), now, |_, m| to_d.push(m));
            d.poll(now_d, |_, m| to_p.push(m), |_| ended += 1);
        }
    });
    assert_eq!(counts.allocs, 0, "push steps allocated: {counts:?}");
    // The run exercised what it claims.
    let (dc, pc) = (d.counters(), p.counters());
    assert!(dc.registered > 10_000 && ended > 10_000, "{dc:?}");
    assert!(
        dc.exhausted > 0 && dc.written > 0 && dc.refused > 0,
        "{dc:?}"
    );
    assert!(
        dc.revoke_ended > 0 && dc.lapsed > 0 && dc.renewed > 0,
        "{dc:?}"
    );
    assert!(pc.posted > 0 && pc.renewed > 0 && pc.revoked > 0, "{pc:?}");
    println!("D {dc:?}\nP {pc:?}");
}
