//! The heartbeat plan's size and cost per D step while a P rank is
//! unreachable (issue 19 item 6): one P engine of TP 2 whose rank 1 never
//! answers a handshake, 10,000 and 100,000 requests queued toward it, one D
//! worker, the scheduler/worker split as bytes.
//!
//! - `owed_steady`: a step between heartbeat intervals, as it is now. The
//!   worker polls rank 1's handshake itself and retries it from the
//!   engine's kept key when a backoff runs out; it asks for the engine only
//!   once a rank is ready, so the plan is the 32-byte header, retries
//!   included (issue 30 item 1: before, each retry's plan carried the
//!   engine).
//! - `replanned_every_step` (the baseline, what the old code did): the owed
//!   engine in every step's plan, every request id encoded, decoded and
//!   walked by the worker. Measured here by making the engine due at every
//!   iteration, which builds the same plan the old owed path built.
//!
//! Each iteration is one whole step: `encode_plan`, `HeartbeatPlan::decode`,
//! `send_plan`, the worker's outcome message, `apply_outcomes`. The plan
//! bytes per step are printed beside the timings. Run with
//! `cargo bench --bench owed_plan`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use kvlease::consumer::{DefaultPeerAddress, HeartbeatSender, HeartbeatTracker, SenderConfig};
use kvlease::ipc::outcome::{self, OutcomeMsg};
use kvlease::ipc::plan::HeartbeatPlan;
use kvlease::testkit::{d_side_config, remote_prefill, FakeFabric, Policy};
use kvlease::Instant;

type Sender = HeartbeatSender<FakeFabric, DefaultPeerAddress>;

struct D {
    tracker: HeartbeatTracker,
    sender: Sender,
    plan: Vec<u8>,
    out: Vec<u8>,
    now: Instant,
}

impl D {
    fn new(queued: u32) -> D {
        let cfg = d_side_config(4096, 256, queued + 16, 4, 64);
        let mut tracker = HeartbeatTracker::new(&cfg, 1).expect("tracker");
        let ids: Vec<String> = (0..queued).map(|i| format!("cmpl-{i:032x}-0")).collect();
        let t0 = Instant::from_secs(100);
        for (i, p) in ids.iter().enumerate() {
            let d = format!("d-{i}");
            let params = remote_prefill("prefill-0", p, "10.0.0.7", 5600, 2);
            tracker.on_new_request(&d, &params, t0).expect("tracked");
        }
        // Messages are not logged: the fake's log would fill over a run.
        let mut fabric = FakeFabric::new(1 << 16, 8, 0, 0);
        fabric.set_policy("10.0.0.7:5600/prefill-0/1", Policy::unreachable());
        let sender =
            Sender::new(fabric, DefaultPeerAddress, SenderConfig::new(&cfg, 1, 0)).expect("sender");
        let mut d = D {
            tracker,
            sender,
            plan: Vec::new(),
            out: vec![0; 4096],
            now: t0,
        };
        // Past the first interval's handshakes and first retries.
        for _ in 0..400 {
            d.step(Duration::from_millis(10));
        }
        d
    }

    /// One D step `dt` after the last; returns the plan's bytes.
    fn step(&mut self, dt: Duration) -> usize {
        self.now = self.now + dt;
        let len = self.tracker.plan_len(self.now);
        if self.plan.len() < len {
            self.plan.resize(len, 0);
        }
        let n = self
            .tracker
            .encode_plan(self.now, &mut self.plan)
            .expect("plan");
        let plan = HeartbeatPlan::decode(&self.plan[..n]).expect("decode");
        black_box(self.sender.send_plan(&plan, self.now));
        let owed = self.sender.owed_engines();
        let m = outcome::encode(&mut self.out, 0, 0, [], owed).expect("outcomes");
        let msg = OutcomeMsg::decode(&self.out[..m]).expect("outcome decode");
        self.tracker
            .apply_outcomes(&msg, |_, _| {})
            .expect("apply outcomes");
        n
    }
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("owed_plan_one_p_rank_unreachable");
    g.sample_size(20);
    for queued in [10_000u32, 100_000] {
        let mut d = D::new(queued);
        // A steady step is 10 ms after the last; the backoff (capped at the
        // 5 s interval) runs out now and then, as in a real run.
        let steady = d.step(Duration::from_millis(10));
        g.bench_function(format!("owed_steady/{queued}"), |b| {
            b.iter(|| d.step(Duration::from_millis(10)))
        });
        let interval = d.tracker.interval();
        let every = d.step(interval);
        g.bench_function(format!("replanned_every_step/{queued}"), |b| {
            b.iter(|| d.step(interval))
        });
        println!(
            "owed_plan {queued} queued: plan {steady} B per steady step, {every} B when the engine is planned"
        );
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
