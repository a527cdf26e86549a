//! The split P roles: a rank's engine step, the scheduler's engine step, and
//! the role messages, each beside the single-process [`LeaseBook`] and a
//! naive `HashMap` baseline measured in the same run.
//!
//! Sizes: 1k, 10k, 100k, 1M live leases (`kv_lease_capacity` =
//! `kv_lease_slots` = size; 30 s lease, 20 s extension, 10 ms tick), ids
//! `cmpl-<32 hex>-0` (39 bytes).
//!
//! - `roles_rank_step`: one P worker's step: 8 heartbeat messages of 256 ids
//!   (`rank`: text `HB:`, `rank_compact`: `HBC:` records, `rank_packed`:
//!   `HBP:` records) through
//!   `PrefillRank::on_notification`, `poll`, and the step's report message
//!   encoded; `lease_book`: the same step on a one-rank `LeaseBook`;
//!   `baseline`: split, `HashMap` update, full-scan reaper. Throughput in ids.
//! - `roles_heartbeat_round`: one P worker's step when a D's whole heartbeat
//!   round arrives (10k and 100k leases, each named once, in messages of up
//!   to 64 KiB, in D's order, which after churn is no order on P: a random
//!   permutation), then `poll`: `rank` (`HB:`), `rank_compact` (`HBC:`),
//!   `rank_packed` (`HBP:`, what the vLLM plugin's D sends; issue 30's
//!   target, 0.5 ms at 100k, is for this step); `baseline`: the text round
//!   into a `HashMap` plus a full-scan reaper. Throughput in records.
//! - `roles_sched_step`: the scheduler's step under churn at constant size:
//!   a report message releasing 64 leases decoded and applied, the 64
//!   releases drained and their slots freed, 64 new grants, and the
//!   directive message for the workers encoded (`scheduler`); the same churn
//!   through a one-rank `LeaseBook` (read-done, drain, free, grant:
//!   `lease_book`); `baseline`: `HashMap<String, (slot, nonce)>` remove and
//!   insert plus a `format!`-built directive string. Throughput in requests.
//! - `roles_msg`: encode + decode + iterate one message of 256 records:
//!   directives (grants with ids) and reports. Throughput in records.

use std::collections::{HashMap, VecDeque};
use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::measurement::WallTime;
use criterion::{
    criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion, SamplingMode,
    Throughput,
};
use kvlease::ipc::directive::{self, Directive, DirectiveMsg, DirectiveOp};
use kvlease::ipc::report::{self, RankReport, ReportMsg};
use kvlease::testkit::SplitMix64;
use kvlease::wire::{self, CompactEntry};
use kvlease::{
    Instant, LeaseBook, LeaseSlots, Nonce, PrefillRank, PrefillScheduler, ReleaseReason, SlotTicket,
};

mod common;
use common::{granted_book, lease_config, map_poll, permutation, request_id};

const SIZES: [u32; 4] = [1_000, 10_000, 100_000, 1_000_000];
const STEP: Duration = Duration::from_millis(20);
const IDS_PER_MSG: usize = 256;
const MSGS_PER_STEP: usize = 8;
const CHURN: usize = 64;
const T0: Instant = Instant::from_secs(1_000);

fn group<'a>(c: &'a mut Criterion, name: &str, n: u32) -> BenchmarkGroup<'a, WallTime> {
    let mut g = c.benchmark_group(name);
    g.sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    if n >= 1_000_000 {
        g.sample_size(10).sampling_mode(SamplingMode::Flat);
    }
    g
}

/// Grants every id on `sched` and applies the directives to `rank` in
/// messages of at most 4096 directives. Returns each id's (entry, nonce).
fn populate(
    sched: &mut PrefillScheduler,
    ranks: &mut [&mut PrefillRank],
    ids: &[String],
) -> Vec<(u32, Nonce)> {
    let mut out = Vec::with_capacity(ids.len());
    let mut buf = Vec::new();
    for chunk in ids.chunks(4096) {
        for id in chunk {
            let a = sched.assign(id, T0).expect("assign");
            sched.start(id, T0).expect("start");
            out.push((a.entry, a.nonce));
        }
        buf.resize(sched.directives_len(T0), 0);
        let n = sched.encode_directives(T0, &mut buf).expect("encode");
        for r in ranks.iter_mut() {
            r.apply_directives(&buf[..n], T0).expect("apply");
        }
    }
    out
}

// ---- the rank's step ----------------------------------------------------------------

struct RankFixture {
    n: u32,
    rank: PrefillRank,
    book: LeaseBook,
    map: HashMap<String, Instant>,
    extension: Duration,
    text: Vec<String>,
    compact: Vec<Vec<u8>>,
    packed: Vec<Vec<u8>>,
    /// One whole heartbeat round, permuted: text, compact, packed messages.
    round: [Vec<Vec<u8>>; 3],
    report_buf: Vec<u8>,
}

fn rank_fixture(n: u32) -> RankFixture {
    let cfg = lease_config(n);
    let mut rng = SplitMix64::new(0x51ed_270b_27a9_3c11 ^ u64::from(n));
    let ids: Vec<String> = (0..n).map(|_| request_id(&mut rng)).collect();
    let mut sched = PrefillScheduler::new(&cfg, 1, T0).expect("scheduler");
    let mut rank = PrefillRank::new(&cfg, 0, Arc::new(LeaseSlots::new(n)), T0).expect("rank");
    let leases = populate(&mut sched, &mut [&mut rank], &ids);
    let (book, map, _) = granted_book(&cfg, &ids, T0);
    let order = permutation(n, &mut rng);
    let count = (n as usize).div_ceil(IDS_PER_MSG);
    let mut scratch = vec![0u8; 64 * 1024];
    let (mut text, mut compact, mut packed) = (Vec::new(), Vec::new(), Vec::new());
    for j in 0..count {
        let entries: Vec<u32> = (0..IDS_PER_MSG)
            .map(|i| order[(j * IDS_PER_MSG + i) % n as usize])
            .collect();
        wire::encode_heartbeats(
            entries.iter().map(|&e| ids[e as usize].as_str()),
            scratch.len(),
            &mut scratch,
            |m| text.push(String::from_utf8(m.to_vec()).expect("ASCII")),
        )
        .expect("encode");
        wire::encode_compact_heartbeats(
            entries.iter().map(|&e| {
                let (entry, nonce) = leases[e as usize];
                CompactEntry { slot: entry, nonce }
            }),
            4 + 24 * IDS_PER_MSG,
            &mut scratch,
            |m| compact.push(m.to_vec()),
        )
        .expect("encode");
        wire::encode_packed_heartbeats(
            entries.iter().map(|&e| {
                let (entry, nonce) = leases[e as usize];
                CompactEntry { slot: entry, nonce }
            }),
            4 + 16 * IDS_PER_MSG,
            &mut scratch,
            |m| packed.push(m.to_vec()),
        )
        .expect("encode");
    }
    assert_eq!(
        (text.len(), compact.len(), packed.len()),
        (count, count, count)
    );
    // The whole round, at the plugin's 64 KiB limit.
    const ROUND_MSG: usize = 64 * 1024;
    let mut scratch = vec![0u8; ROUND_MSG];
    let mut round: [Vec<Vec<u8>>; 3] = Default::default();
    let records = || {
        order.iter().map(|&e| {
            let (slot, nonce) = leases[e as usize];
            CompactEntry { slot, nonce }
        })
    };
    let [r_text, r_compact, r_packed] = &mut round;
    wire::encode_heartbeats(
        order.iter().map(|&e| ids[e as usize].as_str()),
        ROUND_MSG,
        &mut scratch,
        |m| r_text.push(m.to_vec()),
    )
    .expect("encode");
    wire::encode_compact_heartbeats(records(), ROUND_MSG, &mut scratch, |m| {
        r_compact.push(m.to_vec())
    })
    .expect("encode");
    wire::encode_packed_heartbeats(records(), ROUND_MSG, &mut scratch, |m| {
        r_packed.push(m.to_vec())
    })
    .expect("encode");
    RankFixture {
        n,
        report_buf: vec![0u8; rank.max_reports_len()],
        rank,
        book,
        map,
        extension: cfg.lease_extension(),
        text,
        compact,
        packed,
        round,
    }
}

fn bench_heartbeat_round(c: &mut Criterion, f: &mut RankFixture) {
    let n = f.n;
    let mut g = group(c, "roles_heartbeat_round", n);
    g.throughput(Throughput::Elements(u64::from(n)));
    let names = ["rank", "rank_compact", "rank_packed"];
    for (name, msgs) in names.iter().zip(&f.round) {
        let (mut now, mut renewed) = (T0, 0u64);
        g.bench_function(BenchmarkId::new(*name, n), |b| {
            b.iter(|| {
                now = now + STEP;
                for m in msgs {
                    let s = f
                        .rank
                        .on_notification("d0", black_box(m), now)
                        .expect("decodes");
                    renewed += u64::from(s.renewed);
                }
                f.rank.poll(now);
            })
        });
        assert_eq!(
            renewed % u64::from(n),
            0,
            "{name}: every lease renews each round"
        );
        assert_eq!(f.rank.held(), n, "{name}: nothing expires");
    }
    let (mut now, mut expired) = (T0, 0u64);
    let ext = f.extension;
    g.bench_function(BenchmarkId::new("baseline", n), |b| {
        b.iter(|| {
            now = now + STEP;
            let to = now + ext;
            for msg in &f.round[0] {
                let text = core::str::from_utf8(black_box(msg)).unwrap_or("");
                for id in text.strip_prefix("HB:").unwrap_or("").split(',') {
                    if let Some(d) = f.map.get_mut(id) {
                        *d = (*d).max(to);
                    }
                }
            }
            expired += map_poll(&mut f.map, now);
        })
    });
    assert_eq!(expired, 0, "baseline: nothing expires");
    g.finish();
}

fn bench_rank_step(c: &mut Criterion, f: &mut RankFixture) {
    let n = f.n;
    let mut g = group(c, "roles_rank_step", n);
    g.throughput(Throughput::Elements((IDS_PER_MSG * MSGS_PER_STEP) as u64));
    let count = f.text.len();
    let text: Vec<&[u8]> = f.text.iter().map(|m| m.as_bytes()).collect();
    let compact: Vec<&[u8]> = f.compact.iter().map(|m| m.as_slice()).collect();
    let packed: Vec<&[u8]> = f.packed.iter().map(|m| m.as_slice()).collect();
    for (name, msgs) in [
        ("rank", &text),
        ("rank_compact", &compact),
        ("rank_packed", &packed),
    ] {
        let (mut now, mut j, mut renewed, mut ids) = (T0, 0usize, 0u64, 0u64);
        g.bench_function(BenchmarkId::new(name, n), |b| {
            b.iter(|| {
                now = now + STEP;
                for _ in 0..MSGS_PER_STEP {
                    let msg = black_box(msgs[j]);
                    j = (j + 1) % count;
                    let s = f.rank.on_notification("d0", msg, now).expect("decodes");
                    renewed += u64::from(s.renewed);
                    ids += u64::from(s.renewed + s.ignored);
                }
                f.rank.poll(now);
                let len = f.rank.encode_reports(&mut f.report_buf).expect("fits");
                black_box(&f.report_buf[..len]);
            })
        });
        assert_eq!(renewed, ids, "{name}: every id renews");
        assert_eq!(f.rank.held(), n, "{name}: nothing expires");
    }

    let (mut now, mut j, mut renewed, mut ids) = (T0, 0usize, 0u64, 0u64);
    g.bench_function(BenchmarkId::new("lease_book", n), |b| {
        b.iter(|| {
            now = now + STEP;
            for _ in 0..MSGS_PER_STEP {
                let msg = black_box(f.text[j].as_bytes());
                j = (j + 1) % count;
                let s = f.book.on_notification(0, "d0", msg, now).expect("decodes");
                renewed += u64::from(s.renewed);
                ids += u64::from(s.renewed + s.ignored);
            }
            f.book.poll(now);
            f.book.drain_released(|r| {
                black_box(r);
            });
        })
    });
    assert_eq!(renewed, ids, "lease_book: every id renews");
    assert_eq!(f.book.held(), n, "lease_book: nothing expires");

    let (mut now, mut j, mut expired) = (T0, 0usize, 0u64);
    let ext = f.extension;
    g.bench_function(BenchmarkId::new("baseline", n), |b| {
        b.iter(|| {
            now = now + STEP;
            let to = now + ext;
            for _ in 0..MSGS_PER_STEP {
                let msg = black_box(f.text[j].as_str());
                j = (j + 1) % count;
                for id in msg.strip_prefix("HB:").unwrap_or("").split(',') {
                    if let Some(d) = f.map.get_mut(id) {
                        *d = (*d).max(to);
                    }
                }
            }
            expired += map_poll(&mut f.map, now);
        })
    });
    assert_eq!(expired, 0, "baseline: nothing expires");
    g.finish();
}

// ---- the scheduler's step ------------------------------------------------------------

struct SchedFixture {
    n: u32,
    sched: PrefillScheduler,
    /// Live leases in grant order: (id index, entry, nonce).
    live: VecDeque<(usize, u32, Nonce)>,
    /// Ids not leased now.
    spare: VecDeque<usize>,
    ids: Vec<String>,
    dir_buf: Vec<u8>,
    rep_buf: Vec<u8>,
    tickets: Vec<SlotTicket>,
    book: LeaseBook,
    book_live: VecDeque<(usize, Nonce)>,
    book_spare: VecDeque<usize>,
    map: HashMap<String, (u32, u64)>,
    map_live: VecDeque<usize>,
    map_spare: VecDeque<usize>,
    free_slots: Vec<u32>,
}

fn sched_fixture(n: u32) -> SchedFixture {
    let cfg = lease_config(n);
    let mut rng = SplitMix64::new(0x2f1d_7c53_96e4_0a8b ^ u64::from(n));
    // Twice as many ids as leases: the churn grants fresh ones.
    let ids: Vec<String> = (0..2 * n).map(|_| request_id(&mut rng)).collect();
    let mut sched = PrefillScheduler::new(&cfg, 1, T0).expect("scheduler");
    let leases = populate(&mut sched, &mut [], &ids[..n as usize]);
    let live = leases
        .iter()
        .enumerate()
        .map(|(i, &(e, nonce))| (i, e, nonce))
        .collect();
    let mut book = LeaseBook::new(&cfg, T0);
    let mut book_live = VecDeque::new();
    let mut map = HashMap::with_capacity(n as usize);
    for (i, id) in ids[..n as usize].iter().enumerate() {
        let g = book.grant(id, T0).expect("grant");
        book_live.push_back((i, g.nonce));
        map.insert(id.clone(), (i as u32, i as u64 + 1));
    }
    SchedFixture {
        n,
        sched,
        live,
        spare: (n as usize..2 * n as usize).collect(),
        dir_buf: vec![0u8; 1 << 20],
        rep_buf: vec![0u8; report::encoded_len(CHURN as u32)],
        tickets: Vec::with_capacity(CHURN),
        ids,
        book,
        book_live,
        book_spare: (n as usize..2 * n as usize).collect(),
        map,
        map_live: (0..n as usize).collect(),
        map_spare: (n as usize..2 * n as usize).collect(),
        free_slots: Vec::with_capacity(CHURN),
    }
}

fn bench_sched_step(c: &mut Criterion, f: &mut SchedFixture) {
    let n = f.n;
    let mut g = group(c, "roles_sched_step", n);
    g.throughput(Throughput::Elements(CHURN as u64));
    let mut now = T0;
    g.bench_function(BenchmarkId::new("scheduler", n), |b| {
        b.iter(|| {
            now = now + STEP;
            // The worker's report of 64 releases arrives.
            let mut gone = [(0usize, 0u32, Nonce::ONE); CHURN];
            for g in gone.iter_mut() {
                *g = f.live.pop_front().expect("live");
            }
            let len = report::encode(
                &mut f.rep_buf,
                0,
                0,
                gone.iter().map(|&(_, entry, nonce)| RankReport {
                    entry,
                    nonce,
                    reason: ReleaseReason::ReadDone,
                }),
            )
            .expect("fits");
            let s = f
                .sched
                .apply_reports(0, black_box(&f.rep_buf[..len]))
                .expect("decodes");
            assert_eq!(s.released as usize, CHURN);
            let tickets = &mut f.tickets;
            f.sched.drain_released(|r| tickets.extend(r.slot));
            for t in f.tickets.drain(..) {
                f.sched.blocks_freed(t);
            }
            f.spare.extend(gone.iter().map(|&(i, _, _)| i));
            // 64 new prefills.
            for _ in 0..CHURN {
                let i = f.spare.pop_front().expect("spare");
                let a = f.sched.assign(&f.ids[i], now).expect("assign");
                f.sched.start(&f.ids[i], now).expect("start");
                f.live.push_back((i, a.entry, a.nonce));
            }
            let len = f
                .sched
                .encode_directives(now, &mut f.dir_buf)
                .expect("fits");
            black_box(&f.dir_buf[..len]);
        })
    });
    assert_eq!(f.sched.held(), n);

    let mut now = T0;
    g.bench_function(BenchmarkId::new("lease_book", n), |b| {
        b.iter(|| {
            now = now + STEP;
            for _ in 0..CHURN {
                let (i, nonce) = f.book_live.pop_front().expect("live");
                f.book
                    .read_done(0, "d0", f.ids[i].as_bytes(), 1, Some(nonce), now);
                f.book_spare.push_back(i);
            }
            let tickets = &mut f.tickets;
            f.book.drain_released(|r| tickets.extend(r.slot));
            for t in f.tickets.drain(..) {
                f.book.blocks_freed(t);
            }
            for _ in 0..CHURN {
                let i = f.book_spare.pop_front().expect("spare");
                let g = f.book.grant(&f.ids[i], now).expect("grant");
                f.book_live.push_back((i, g.nonce));
            }
        })
    });
    assert_eq!(f.book.held(), n);

    let mut nonce = u64::from(n) + 1;
    g.bench_function(BenchmarkId::new("baseline", n), |b| {
        b.iter(|| {
            for _ in 0..CHURN {
                let i = f.map_live.pop_front().expect("live");
                if let Some((slot, _)) = f.map.remove(&f.ids[i]) {
                    f.free_slots.push(slot);
                }
                f.map_spare.push_back(i);
            }
            let mut directives = String::new();
            for _ in 0..CHURN {
                let i = f.map_spare.pop_front().expect("spare");
                let slot = f.free_slots.pop().expect("a slot was freed");
                nonce += 1;
                f.map.insert(f.ids[i].clone(), (slot, nonce));
                directives.push_str(&format!("{}:{slot}:{nonce};", f.ids[i]));
                f.map_live.push_back(i);
            }
            black_box(directives);
        })
    });
    assert_eq!(f.map.len(), n as usize);
    g.finish();
}

// ---- the messages ----------------------------------------------------------------------

fn bench_msg(c: &mut Criterion) {
    let mut g = group(c, "roles_msg", 0);
    g.throughput(Throughput::Elements(IDS_PER_MSG as u64));
    let mut rng = SplitMix64::new(7);
    let ids: Vec<String> = (0..IDS_PER_MSG).map(|_| request_id(&mut rng)).collect();
    let directives: Vec<Directive<'_>> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| Directive {
            op: DirectiveOp::Grant,
            entry: i as u32,
            slot: Some(i as u32),
            nonce: Nonce::new(i as u64 + 1).expect("non-zero"),
            lease_remaining: Some(Duration::from_secs(30)),
            hold_remaining: None,
            request_id: id,
        })
        .collect();
    let mut buf = vec![0u8; directive::encoded_len(directives.iter().copied())];
    g.bench_function("directives", |b| {
        b.iter(|| {
            let n = directive::encode(&mut buf, 1, directives.iter().copied()).expect("fits");
            let msg = DirectiveMsg::decode(black_box(&buf[..n])).expect("decodes");
            let mut sum = 0u64;
            for d in msg.iter() {
                sum += u64::from(d.entry) + d.request_id.len() as u64;
            }
            black_box(sum)
        })
    });
    let reports: Vec<RankReport> = (0..IDS_PER_MSG as u32)
        .map(|i| RankReport {
            entry: i,
            nonce: Nonce::new(u64::from(i) + 1).expect("non-zero"),
            reason: ReleaseReason::Expired,
        })
        .collect();
    let mut buf = vec![0u8; report::encoded_len(IDS_PER_MSG as u32)];
    g.bench_function("reports", |b| {
        b.iter(|| {
            let n = report::encode(&mut buf, 0, 1, reports.iter().copied()).expect("fits");
            let msg = ReportMsg::decode(black_box(&buf[..n])).expect("decodes");
            black_box(msg.iter().map(|r| u64::from(r.entry)).sum::<u64>())
        })
    });
    g.finish();
}

fn benches(c: &mut Criterion) {
    bench_msg(c);
    for n in SIZES {
        let mut f = rank_fixture(n);
        bench_rank_step(c, &mut f);
        if n == 10_000 || n == 100_000 {
            bench_heartbeat_round(c, &mut f);
        }
        drop(f);
        let mut f = sched_fixture(n);
        bench_sched_step(c, &mut f);
    }
}

criterion_group!(roles, benches);
criterion_main!(roles);
