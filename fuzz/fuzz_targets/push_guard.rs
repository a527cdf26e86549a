//! Fuzz target for push mode's guard (`kvlease::push`): a D
//! (`PushPermits`) and a P (`PushWrites`) driven by an arbitrary sequence of
//! operations, with every notification between them lost, duplicated,
//! delayed or forged at the fuzzer's choice, and arbitrary bytes fed to both.
//!
//! Never panics, and holds the guard's safety rule as a ghost check: a
//! WRITE that P let through lands before D's fence for its permit (the
//! harness lands each WRITE at the latest the bound allows, or fails it),
//! and D never ends a permit (frees the blocks) while a WRITE P let through
//! under it is still in flight, unless D's clock passed the fence, by which
//! time the write bound says it landed.
#![no_main]

use std::collections::BTreeMap;
use std::time::Duration;

use arbitrary::Arbitrary;
use kvlease::clock_offset::{ClockOffset, ClockOffsetConfig};
use kvlease::fabric::ClockSample;
use kvlease::push::{PermitFields, PushConfig, PushPermits, PushWrites, WriteHandle};
use kvlease::{Instant, NonceSource};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
enum Op {
    /// D registers a request with P; P's request is live or not.
    Register {
        live: bool,
        deliver: bool,
    },
    /// Time passes (ms, both clocks; the offset stays put).
    Advance {
        ms: u16,
    },
    /// P asks to post the WRITE of its `k`-th registration.
    BeginWrite {
        k: u8,
    },
    /// A posted WRITE ends (landed or failed).
    WriteDone {
        k: u8,
        ok: bool,
    },
    /// P lets the request of its `k`-th registration go.
    Cancel {
        k: u8,
    },
    /// D revokes its `k`-th permit.
    Revoke {
        k: u8,
    },
    /// Both sides poll.
    Poll,
    /// Deliver (or lose, or duplicate) the `k`-th message in flight.
    DeliverToP {
        k: u8,
        dup: bool,
        lose: bool,
    },
    DeliverToD {
        k: u8,
        dup: bool,
        lose: bool,
    },
    /// Raw bytes into either side.
    RawToP(Vec<u8>),
    RawToD(Vec<u8>),
    /// A registration replayed (duplicated) to P.
    ReplayRegistration {
        k: u8,
    },
}

struct Posted {
    fields: PermitFields,
    /// D's clock when P let it through.
    at_d: Instant,
    /// The latest deadline D gave the permit (D only moves it later).
    d_deadline: Instant,
}

fuzz_target!(|ops: Vec<Op>| {
    let config = PushConfig {
        capacity: 8,
        max_message_len: 128,
        ..PushConfig::with_duration(Duration::from_secs(6))
    };
    let mut d = PushPermits::new(config, NonceSource::from_seed(0, 1, 2)).unwrap();
    let mut p = PushWrites::new(config, 3).unwrap();
    // P's estimate of D's clock: D = P + 1000 s, 2 ms round trip.
    let mut clock = ClockOffset::new(ClockOffsetConfig::default());
    clock.observe(ClockSample {
        local_send: Instant::from_millis(0),
        remote: Instant::from_millis(1_000_001),
        local_recv: Instant::from_millis(2),
    });
    let mut now_ms = 2u64;
    let mut regs: Vec<PermitFields> = Vec::new();
    let mut handles: Vec<(WriteHandle, PermitFields)> = Vec::new();
    // In-flight WRITEs, by handle index.
    let mut in_flight: BTreeMap<usize, Posted> = BTreeMap::new();
    let mut to_p: Vec<Vec<u8>> = Vec::new();
    let mut to_d: Vec<Vec<u8>> = Vec::new();

    for op in ops.into_iter().take(400) {
        let now = Instant::from_millis(now_ms);
        let now_d = Instant::from_millis(now_ms + 1_000_000);
        let mut ended = Vec::new();
        match op {
            Op::Register { live, deliver } => {
                if let Ok(f) = d.register(1, now_d) {
                    regs.push(f);
                    if deliver {
                        if let Ok(h) = p.register(2, f, live, &clock, now) {
                            handles.push((h, f));
                        }
                    }
                }
            }
            Op::Advance { ms } => {
                // WRITEs in flight land by the bound: the harness ends them
                // at the latest moment the bound allows.
                let target = now_ms + u64::from(ms);
                let bound = config.write_bound.as_millis() as u64;
                let late: Vec<usize> = in_flight
                    .iter()
                    .filter(|(_, w)| w.at_d.as_nanos() / 1_000_000 + bound <= target + 1_000_000)
                    .map(|(&k, _)| k)
                    .collect();
                for k in late {
                    let w = in_flight.remove(&k).unwrap();
                    // It lands no later than D's fence: P let it through
                    // before D's deadline.
                    assert!(
                        Instant::from_millis(w.at_d.as_nanos() / 1_000_000 + bound)
                            <= d.fence(w.d_deadline),
                        "a WRITE let through could land after D's fence"
                    );
                    p.write_done(handles[k].0, true, now);
                }
                now_ms = target;
            }
            Op::BeginWrite { k } => {
                if let Some(&(h, f)) = handles.get(k as usize) {
                    if p.begin_write(h, &clock, now).is_ok() {
                        assert!(!in_flight.contains_key(&(k as usize)));
                        let d_deadline = d.deadline(f.slot, f.nonce).unwrap_or(f.deadline);
                        in_flight.insert(
                            k as usize,
                            Posted {
                                fields: f,
                                at_d: now_d,
                                d_deadline,
                            },
                        );
                    }
                }
            }
            Op::WriteDone { k, ok } => {
                if in_flight.remove(&(k as usize)).is_some() {
                    assert!(p.write_done(handles[k as usize].0, ok, now));
                }
            }
            Op::Cancel { k } => {
                if let Some(&(h, _)) = handles.get(k as usize) {
                    p.cancel(h);
                }
            }
            Op::Revoke { k } => {
                if let Some(f) = regs.get(k as usize) {
                    let _ = d.revoke(f.slot, f.nonce);
                }
            }
            Op::Poll => {
                p.poll(|_| Some(&clock), now, |_, m| to_d.push(m.to_vec()));
                d.poll(now_d, |_, m| to_p.push(m.to_vec()), |e| ended.push(e));
            }
            Op::DeliverToP { k, dup, lose } => {
                if !to_p.is_empty() {
                    let i = k as usize % to_p.len();
                    let m = if dup { to_p[i].clone() } else { to_p.remove(i) };
                    if !lose {
                        let _ = p.on_message(2, &m);
                    }
                }
            }
            Op::DeliverToD { k, dup, lose } => {
                if !to_d.is_empty() {
                    let i = k as usize % to_d.len();
                    let m = if dup { to_d[i].clone() } else { to_d.remove(i) };
                    if !lose {
                        let _ = d.on_message(1, &m, now_d, |e| ended.push(e));
                    }
                }
            }
            Op::RawToP(bytes) => {
                let _ = p.on_message(2, &bytes);
            }
            Op::RawToD(bytes) => {
                let _ = d.on_message(1, &bytes, now_d, |e| ended.push(e));
            }
            Op::ReplayRegistration { k } => {
                if let Some(&f) = regs.get(k as usize) {
                    if let Ok(h) = p.register(2, f, true, &clock, now) {
                        if !handles.iter().any(|&(x, _)| x == h) {
                            handles.push((h, f));
                        }
                    }
                }
            }
        }
        for w in in_flight.values_mut() {
            if let Some(dl) = d.deadline(w.fields.slot, w.fields.nonce) {
                w.d_deadline = w.d_deadline.max(dl);
            }
        }
        // D freed the blocks of these permits: no WRITE let through under
        // one of them may still be in flight, unless the fence passed (then
        // the bound says it landed, and Advance checks that).
        for e in ended {
            for w in in_flight.values() {
                if w.fields.slot == e.slot && w.fields.nonce == e.nonce {
                    assert!(
                        now_d >= d.fence(w.d_deadline),
                        "D freed blocks under a WRITE in flight: {e:?}"
                    );
                }
            }
        }
    }
});
