//! D-side heartbeat tracking, mirroring vLLM's NixlConnector heartbeat tests:
//! grouping per engine and the reverse map, parallel sizes preserved,
//! non-prefill requests ignored, partial and full stop, throttling, stop on
//! transfer complete and on finish, engines disappearing when empty, and
//! capacity exhaustion (typed and counted).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use kvlease::consumer::{
    EngineBatch, EngineKey, HeartbeatTracker, ParamProblem, RemotePrefillParams, TrackError,
    TrackOutcome, INLINE_ID_LEN,
};
use kvlease::testkit::{d_side_config, remote_prefill, SplitMix64};
use kvlease::wire::CompactEntry;
use kvlease::{EngineShape, Instant, LeaseConfig, Nonce};

fn config(requests: u32, engines: u32) -> LeaseConfig {
    d_side_config(1024, 64, requests, engines, 48)
}

fn params<'a>(engine: &'a str, p_id: &'a str) -> RemotePrefillParams<'a> {
    remote_prefill(engine, p_id, "10.0.0.1", 5600, 1)
}

/// One step's due output: engine id -> sorted P-side ids.
fn due(t: &mut HeartbeatTracker, now: Instant) -> BTreeMap<String, Vec<String>> {
    let mut out = BTreeMap::new();
    t.due(now, |b: EngineBatch<'_>| {
        let mut ids: Vec<String> = b.remote_request_ids().map(str::to_string).collect();
        ids.sort();
        assert_eq!(ids.len(), b.len());
        out.insert(b.key().engine_id.to_string(), ids);
    });
    out
}

fn map(entries: &[(&str, &[&str])]) -> BTreeMap<String, Vec<String>> {
    entries
        .iter()
        .map(|(e, ids)| (e.to_string(), ids.iter().map(|s| s.to_string()).collect()))
        .collect()
}

const T0: Instant = Instant::from_secs(100);

#[test]
fn requests_are_grouped_per_engine_with_a_reverse_map() {
    let mut t = HeartbeatTracker::new(&config(16, 4), 1).expect("tracker");
    for (d, e, p) in [
        ("d1", "engA", "p1"),
        ("d2", "engB", "p2"),
        ("d3", "engA", "p3"),
    ] {
        assert_eq!(
            t.on_new_request(d, &params(e, p), T0),
            Ok(TrackOutcome::Started)
        );
    }
    assert_eq!(t.len(), 3);
    assert_eq!(t.engine_count(), 2);
    assert_eq!(
        due(&mut t, T0),
        map(&[("engA", &["p1", "p3"]), ("engB", &["p2"])])
    );
    // Reverse map: D-side id -> its engine and its P-side id.
    assert_eq!(t.engine_of("d3").unwrap().key().engine_id, "engA");
    assert_eq!(t.engine_of("d2").unwrap().key().engine_id, "engB");
    assert_eq!(t.remote_of("d2").unwrap().remote_request_id, "p2");
    assert!(t.engine_of("p1").is_none(), "keyed by the D-side id");
}

#[test]
fn same_engine_id_on_another_host_port_or_tp_is_another_engine() {
    let mut t = HeartbeatTracker::new(&config(16, 8), 1).expect("tracker");
    let base = params("eng", "p1");
    t.on_new_request("d1", &base, T0).unwrap();
    let other_host = RemotePrefillParams {
        remote_host: Some("10.0.0.2"),
        remote_request_id: Some("p2"),
        ..base
    };
    let other_port = RemotePrefillParams {
        remote_port: Some(5601),
        remote_request_id: Some("p3"),
        ..base
    };
    let other_tp = RemotePrefillParams {
        tp_size: Some(2),
        remote_request_id: Some("p4"),
        ..base
    };
    let same = RemotePrefillParams {
        remote_request_id: Some("p5"),
        ..base
    };
    t.on_new_request("d2", &other_host, T0).unwrap();
    t.on_new_request("d3", &other_port, T0).unwrap();
    t.on_new_request("d4", &other_tp, T0).unwrap();
    t.on_new_request("d5", &same, T0).unwrap();
    assert_eq!(t.engine_count(), 4);
    assert_eq!(t.engine_of("d5").unwrap().len(), 2);
}

#[test]
fn parallel_sizes_are_preserved() {
    let mut t = HeartbeatTracker::new(&config(16, 4), 1).expect("tracker");
    let p = RemotePrefillParams {
        tp_size: Some(4),
        pp_size: Some(2),
        dcp_size: Some(8),
        remote_port: Some(7777),
        remote_host: Some("prefill-3.svc"),
        ..params("engA", "p1")
    };
    t.on_new_request("d1", &p, T0).unwrap();
    let mut seen = 0;
    t.due(T0, |b| {
        seen += 1;
        assert_eq!(
            b.key(),
            EngineKey {
                engine_id: "engA",
                host: "prefill-3.svc",
                port: 7777,
                tp_size: 4,
            }
        );
        assert_eq!((b.pp_size(), b.dcp_size()), (2, 8));
    });
    assert_eq!(seen, 1);
    // Absent pp/dcp default to 1.
    t.on_new_request("d2", &params("engB", "p2"), T0).unwrap();
    let b = t.engine_of("d2").unwrap();
    assert_eq!((b.key().tp_size, b.pp_size(), b.dcp_size()), (1, 1, 1));
}

#[test]
fn non_prefill_requests_and_incomplete_params_are_not_tracked() {
    let mut t = HeartbeatTracker::new(&config(16, 4), 1).expect("tracker");
    let local = RemotePrefillParams {
        do_remote_prefill: false,
        ..params("engA", "p1")
    };
    assert_eq!(
        t.on_new_request("d0", &local, T0),
        Ok(TrackOutcome::NotRemotePrefill)
    );
    let p_side = RemotePrefillParams {
        do_remote_prefill: false,
        do_remote_decode: true,
        ..params("engA", "p1")
    };
    assert_eq!(
        t.on_new_request("d0b", &p_side, T0),
        Ok(TrackOutcome::NotRemotePrefill)
    );
    let full = params("engA", "p1");
    let cases: [(RemotePrefillParams<'_>, &str); 5] = [
        (
            RemotePrefillParams {
                remote_engine_id: None,
                ..full
            },
            "remote_engine_id",
        ),
        (
            RemotePrefillParams {
                remote_request_id: None,
                ..full
            },
            "remote_request_id",
        ),
        (
            RemotePrefillParams {
                remote_host: None,
                ..full
            },
            "remote_host",
        ),
        (
            RemotePrefillParams {
                remote_port: None,
                ..full
            },
            "remote_port",
        ),
        (
            RemotePrefillParams {
                tp_size: None,
                ..full
            },
            "tp_size",
        ),
    ];
    for (i, (p, field)) in cases.iter().enumerate() {
        assert_eq!(
            t.on_new_request(&format!("d{i}"), p, T0),
            Ok(TrackOutcome::MissingParam { field })
        );
    }
    assert!(t.is_empty());
    assert_eq!(t.engine_count(), 0);
    assert!(due(&mut t, T0).is_empty());
    let c = t.counters();
    assert_eq!(c.ignored_not_remote_prefill, 2);
    assert_eq!(c.missing_params, 5);
    assert_eq!(c.not_heartbeated, 5);
    assert_eq!(c.started, 0);
    // Finishing an untracked request is fine and counted as such.
    assert!(!t.on_request_finished("d0"));
    assert_eq!(t.counters().stop_untracked, 1);
}

#[test]
fn partial_and_full_stop() {
    let mut t = HeartbeatTracker::new(&config(16, 4), 1).expect("tracker");
    for (d, p) in [("d1", "p1"), ("d2", "p2"), ("d3", "p3")] {
        t.on_new_request(d, &params("engA", p), T0).unwrap();
    }
    t.on_new_request("d4", &params("engB", "p4"), T0).unwrap();
    assert!(t.on_request_finished("d2"));
    assert_eq!(
        due(&mut t, T0),
        map(&[("engA", &["p1", "p3"]), ("engB", &["p4"])])
    );
    assert!(t.on_transfer_complete("d1"));
    assert!(t.on_request_finished("d3"));
    assert!(t.on_transfer_complete("d4"));
    assert!(t.is_empty());
    assert_eq!(t.engine_count(), 0);
    let later = T0 + Duration::from_secs(3600);
    assert!(due(&mut t, later).is_empty());
}

#[test]
fn first_step_sends_then_throttled_by_the_interval() {
    let cfg = config(16, 4);
    let interval = cfg.heartbeat_interval();
    assert_eq!(interval, Duration::from_secs(5));
    let mut t = HeartbeatTracker::new(&cfg, 1).expect("tracker");
    t.on_new_request("d1", &params("engA", "p1"), T0).unwrap();
    // First step after tracking starts: due at once.
    assert_eq!(due(&mut t, T0).len(), 1);
    // An immediate second step: not due.
    assert!(due(&mut t, T0).is_empty());
    assert!(due(&mut t, T0 + Duration::from_millis(4999)).is_empty());
    // One interval later: due again.
    let t1 = T0 + interval;
    assert_eq!(due(&mut t, t1).len(), 1);
    assert!(due(&mut t, t1 + Duration::from_secs(1)).is_empty());
    // A new engine joining is due at once, independently of the other.
    t.on_new_request("d2", &params("engB", "p2"), t1).unwrap();
    assert_eq!(
        due(&mut t, t1 + Duration::from_secs(1)),
        map(&[("engB", &["p2"])])
    );
    // A request joining a throttled engine waits for that engine's turn.
    t.on_new_request("d3", &params("engA", "p3"), t1).unwrap();
    assert!(due(&mut t, t1 + Duration::from_secs(2)).is_empty());
    assert_eq!(due(&mut t, t1 + interval), map(&[("engA", &["p1", "p3"])]));
    let c = t.counters();
    assert_eq!(c.engines_due, 4);
    assert_eq!(c.requests_due, 1 + 1 + 1 + 2);
}

#[test]
fn a_clock_that_goes_backwards_does_not_silence_an_engine() {
    let mut t = HeartbeatTracker::new(&config(16, 4), 1).expect("tracker");
    t.on_new_request("d1", &params("engA", "p1"), T0).unwrap();
    assert_eq!(due(&mut t, Instant::from_secs(1000)).len(), 1);
    // Far earlier `now` (a caller bug): due rather than silent until 1005 s.
    assert_eq!(due(&mut t, Instant::from_secs(10)).len(), 1);
    assert!(due(&mut t, Instant::from_secs(11)).is_empty());
}

#[test]
fn stop_on_transfer_complete_and_on_request_finished() {
    let mut t = HeartbeatTracker::new(&config(16, 4), 1).expect("tracker");
    t.on_new_request("d1", &params("engA", "p1"), T0).unwrap();
    t.on_new_request("d2", &params("engA", "p2"), T0).unwrap();
    assert!(t.on_transfer_complete("d1"));
    // vLLM reports the finish of a request whose transfer completed too.
    assert!(!t.on_request_finished("d1"));
    assert!(t.on_request_finished("d2"));
    assert!(!t.on_transfer_complete("d2"));
    let c = t.counters();
    assert_eq!(c.stopped_transfer_complete, 1);
    assert_eq!(c.stopped_finished, 1);
    assert_eq!(c.stop_untracked, 2);
    assert!(t.remote_of("d1").is_none());
    // The id can be tracked again (a new request reusing it).
    assert_eq!(
        t.on_new_request("d1", &params("engA", "p9"), T0),
        Ok(TrackOutcome::Started)
    );
}

#[test]
fn an_engine_disappears_when_empty_and_comes_back_fresh() {
    let mut t = HeartbeatTracker::new(&config(16, 1), 1).expect("tracker");
    t.on_new_request("d1", &params("engA", "p1"), T0).unwrap();
    let old = t.engine_of("d1").unwrap().handle();
    assert_eq!(due(&mut t, T0).len(), 1);
    assert!(t.on_request_finished("d1"));
    assert_eq!(t.engine_count(), 0);
    assert!(t.batch(old).is_none());
    assert_eq!(t.engines().count(), 0);
    // With one engine slot, another engine can now be tracked...
    t.on_new_request("d2", &params("engB", "p2"), T0).unwrap();
    let new = t.engine_of("d2").unwrap().handle();
    assert_eq!(new.index, old.index);
    assert_ne!(new.generation, old.generation);
    assert!(t.batch(old).is_none(), "a stale handle finds nothing");
    assert_eq!(t.batch(new).unwrap().key().engine_id, "engB");
    // ...and a returning engine is due at once, not throttled by its past.
    assert!(t.on_request_finished("d2"));
    t.on_new_request("d3", &params("engA", "p3"), T0).unwrap();
    assert_eq!(
        due(&mut t, T0 + Duration::from_millis(1)),
        map(&[("engA", &["p3"])])
    );
}

#[test]
fn capacity_exhaustion_is_typed_and_counted() {
    let mut t = HeartbeatTracker::new(&config(3, 2), 1).expect("tracker");
    t.on_new_request("d1", &params("engA", "p1"), T0).unwrap();
    t.on_new_request("d2", &params("engB", "p2"), T0).unwrap();
    assert_eq!(
        t.on_new_request("d3", &params("engC", "p3"), T0),
        Err(TrackError::EnginesFull { capacity: 2 })
    );
    t.on_new_request("d3", &params("engA", "p3"), T0).unwrap();
    assert_eq!(
        t.on_new_request("d4", &params("engA", "p4"), T0),
        Err(TrackError::RequestsFull { capacity: 3 })
    );
    assert_eq!(
        t.on_new_request("d1", &params("engA", "p1"), T0),
        Err(TrackError::Duplicate)
    );
    let c = t.counters();
    assert_eq!(c.refused_engines_full, 1);
    assert_eq!(c.refused_requests_full, 1);
    assert_eq!(c.refused_duplicate, 1);
    assert_eq!(c.not_heartbeated, 3);
    assert_eq!(c.started, 3);
    // A refusal changes nothing.
    assert_eq!(t.len(), 3);
    assert_eq!(t.engine_count(), 2);
    assert_eq!(
        due(&mut t, T0),
        map(&[("engA", &["p1", "p3"]), ("engB", &["p2"])])
    );
    // Room again after a stop.
    assert!(t.on_transfer_complete("d2"));
    t.on_new_request("d4", &params("engC", "p4"), T0).unwrap();
}

#[test]
fn bad_ids_hosts_and_sizes_are_refused() {
    let mut t = HeartbeatTracker::new(&config(8, 4), 1).expect("tracker");
    let long = "x".repeat(49);
    let host = "h".repeat(256);
    let p = params("engA", "p1");
    let cases: Vec<(&str, RemotePrefillParams<'_>, &str, ParamProblem)> = vec![
        ("", p, "request_id", ParamProblem::Empty),
        (
            &long,
            p,
            "request_id",
            ParamProblem::TooLong { len: 49, max: 48 },
        ),
        (
            "d",
            RemotePrefillParams {
                remote_request_id: Some(""),
                ..p
            },
            "remote_request_id",
            ParamProblem::Empty,
        ),
        (
            "d",
            RemotePrefillParams {
                remote_request_id: Some("a,b"),
                ..p
            },
            "remote_request_id",
            ParamProblem::ContainsComma,
        ),
        (
            "d",
            RemotePrefillParams {
                remote_engine_id: Some(&long),
                ..p
            },
            "remote_engine_id",
            ParamProblem::TooLong { len: 49, max: 48 },
        ),
        (
            "d",
            RemotePrefillParams {
                remote_host: Some(&host),
                ..p
            },
            "remote_host",
            ParamProblem::TooLong { len: 256, max: 255 },
        ),
        (
            "d",
            RemotePrefillParams {
                tp_size: Some(0),
                ..p
            },
            "tp_size",
            ParamProblem::Zero,
        ),
        (
            "d",
            RemotePrefillParams {
                pp_size: Some(0),
                ..p
            },
            "pp_size",
            ParamProblem::Zero,
        ),
        (
            "d",
            RemotePrefillParams {
                dcp_size: Some(0),
                ..p
            },
            "dcp_size",
            ParamProblem::Zero,
        ),
    ];
    let n = cases.len() as u64;
    for (d, params, field, problem) in cases {
        let err = t.on_new_request(d, &params, T0).unwrap_err();
        assert_eq!(err, TrackError::BadParam { field, problem });
        assert!(err.to_string().contains(field));
    }
    assert!(t.is_empty());
    assert_eq!(t.counters().refused_bad_param, n);
    assert_eq!(t.counters().not_heartbeated, n);
}

#[test]
fn leases_are_reported_and_compact_only_when_every_request_has_one() {
    let mut t = HeartbeatTracker::new(&config(8, 4), 1).expect("tracker");
    let leased = |p, slot, nonce| RemotePrefillParams {
        remote_lease_slot: Some(slot),
        remote_lease_nonce: Some(nonce),
        ..params("engA", p)
    };
    t.on_new_request("d1", &leased("p1", 7, 0xabc), T0).unwrap();
    t.on_new_request("d2", &leased("p2", 9, 0xdef), T0).unwrap();
    let b = t.engine_of("d1").unwrap();
    assert!(b.all_leased());
    let mut got: Vec<CompactEntry> = b.leases().collect();
    got.sort_by_key(|e| e.slot);
    assert_eq!(
        got,
        [
            CompactEntry {
                slot: 7,
                nonce: Nonce::new(0xabc).unwrap()
            },
            CompactEntry {
                slot: 9,
                nonce: Nonce::new(0xdef).unwrap()
            },
        ]
    );
    // Nonce 0 is no lease; nor is a slot without a nonce.
    t.on_new_request("d3", &leased("p3", 1, 0), T0).unwrap();
    assert!(!t.engine_of("d1").unwrap().all_leased());
    assert_eq!(t.remote_of("d3").unwrap().lease, None);
    assert!(t.on_request_finished("d3"));
    assert!(t.engine_of("d1").unwrap().all_leased());
    let no_nonce = RemotePrefillParams {
        remote_lease_slot: Some(3),
        ..params("engA", "p4")
    };
    t.on_new_request("d4", &no_nonce, T0).unwrap();
    let b = t.engine_of("d4").unwrap();
    assert!(!b.all_leased());
    assert_eq!(b.leases().count(), 2);
    assert_eq!(b.remotes().filter(|r| r.lease.is_none()).count(), 1);
    assert_eq!(t.counters().started_without_lease, 2);
}

/// Random arrivals and stops against a simple model; every step's due
/// output must match it exactly, and nothing may panic on odd strings.
#[test]
fn matches_a_model_under_random_churn() {
    model_churn(48, 0);
}

/// The same with the default 128-byte id limit and P-side ids of up to 120
/// bytes: ids longer than `INLINE_ID_LEN` take the overflow path, shorter
/// ones move with their members, and both kinds mix in one engine.
#[test]
fn matches_a_model_with_ids_longer_than_the_inline_slot() {
    model_churn(128, 100);
}

fn model_churn(max_id_len: u16, max_pad: u64) {
    let interval = Duration::from_secs(5);
    let mut cfg = config(64, 6);
    cfg.max_request_id_len = max_id_len;
    let mut t = HeartbeatTracker::new(&cfg, 1).expect("tracker");
    // model: d id -> (engine, p id); engine -> next due.
    let mut reqs: BTreeMap<String, (String, String)> = BTreeMap::new();
    let mut next_due: BTreeMap<String, Instant> = BTreeMap::new();
    let mut rng = SplitMix64::new(0x2545_f491_4f6c_dd1du64);
    let mut next = move || rng.next_u64();
    let mut now = T0;
    let engines = ["e0", "e1", "e2", "e3", "e4", "e5", "e6", "ü-ñ"];
    for step in 0..30_000u32 {
        let r = next();
        now = now + Duration::from_millis(r % 700);
        match r >> 60 {
            0..=6 => {
                let d = format!("d{}", r % 97);
                let pad = if max_pad == 0 { 0 } else { (r >> 32) % max_pad };
                let p = format!("p-{step}-é{}", "x".repeat(pad as usize));
                let e = engines[(r >> 8) as usize % engines.len()];
                let res = t.on_new_request(&d, &params(e, &p), now);
                let engine_known = next_due.contains_key(e);
                let want = if reqs.contains_key(&d) {
                    Err(TrackError::Duplicate)
                } else if reqs.len() == 64 {
                    Err(TrackError::RequestsFull { capacity: 64 })
                } else if !engine_known && next_due.len() == 6 {
                    Err(TrackError::EnginesFull { capacity: 6 })
                } else {
                    Ok(TrackOutcome::Started)
                };
                assert_eq!(res, want, "step {step}");
                if res.is_ok() {
                    reqs.insert(d, (e.to_string(), p));
                    next_due.entry(e.to_string()).or_insert(Instant::ZERO);
                }
            }
            7..=12 => {
                let d = format!("d{}", r % 97);
                let tracked = reqs.remove(&d);
                let stopped = if r & 1 == 0 {
                    t.on_request_finished(&d)
                } else {
                    t.on_transfer_complete(&d)
                };
                assert_eq!(stopped, tracked.is_some());
                if let Some((e, _)) = tracked {
                    if !reqs.values().any(|(e2, _)| *e2 == e) {
                        next_due.remove(&e);
                    }
                }
            }
            _ => {
                let got = due(&mut t, now);
                let mut want = BTreeMap::new();
                for (e, at) in next_due.iter_mut() {
                    if *at <= now {
                        *at = now + interval;
                        let mut ids: Vec<String> = reqs
                            .values()
                            .filter(|(e2, _)| e2 == e)
                            .map(|(_, p)| p.clone())
                            .collect();
                        ids.sort();
                        want.insert(e.clone(), ids);
                    }
                }
                assert_eq!(got, want, "step {step}");
            }
        }
        assert_eq!(t.len() as usize, reqs.len());
        assert_eq!(t.engine_count() as usize, next_due.len());
    }
    if max_pad > 0 {
        let long = reqs
            .values()
            .filter(|(_, p)| p.len() > INLINE_ID_LEN)
            .count();
        assert!(long > 0 && long < reqs.len(), "both id kinds present");
    }
    let engines_seen: BTreeSet<_> = t.engines().map(|b| b.key().engine_id.to_string()).collect();
    assert_eq!(engines_seen, next_due.keys().cloned().collect());
}

/// Hostile inputs: random (often invalid) strings, absent fields, huge and
/// zero sizes, stops of unknown ids, `now` jumping back and forth. Nothing
/// may panic, and the tracker's own accounting must stay consistent.
#[test]
fn hostile_inputs_never_panic() {
    let mut rng = SplitMix64::new(0x0123_4567_89ab_cdefu64);
    let mut next = move || rng.next_u64();
    const ALPHABET: [&str; 10] = ["a", ",", "\0", "é", "🦀", ":", "HB:", " ", "-", "Z"];
    let string = |next: &mut dyn FnMut() -> u64| -> String {
        let n = (next() % 70) as usize;
        (0..n)
            .map(|_| ALPHABET[(next() % ALPHABET.len() as u64) as usize])
            .collect()
    };
    let mut t = HeartbeatTracker::new(&config(32, 4), 1).expect("tracker");
    let mut now = T0;
    for _ in 0..50_000 {
        let r = next();
        now = if r % 17 == 0 {
            Instant::from_nanos(next())
        } else {
            now + Duration::from_millis(r % 3000)
        };
        let d = string(&mut next);
        match r % 5 {
            0 | 1 => {
                let e = string(&mut next);
                let p = string(&mut next);
                let h = string(&mut next);
                let pick = next();
                let opt = |bit: u64| pick & (1 << bit) != 0;
                let params = RemotePrefillParams {
                    do_remote_prefill: opt(0) || opt(1),
                    do_remote_decode: opt(2),
                    remote_engine_id: opt(3).then_some(e.as_str()),
                    remote_request_id: opt(4).then_some(p.as_str()),
                    remote_host: opt(5).then_some(h.as_str()),
                    remote_port: opt(6).then_some((pick >> 16) as u16),
                    tp_size: opt(7).then_some([0, 1, 3, u32::MAX][(pick >> 32) as usize % 4]),
                    pp_size: opt(8).then_some((pick >> 40) as u32),
                    dcp_size: opt(9).then_some(0),
                    remote_num_tokens: opt(10).then_some(pick),
                    remote_lease_slot: opt(11).then_some((pick >> 20) as u32),
                    remote_lease_nonce: opt(12).then_some((pick >> (pick % 64)) as i64),
                };
                let _ = t.on_new_request(&d, &params, now);
            }
            2 => {
                let _ = t.on_request_finished(&d);
            }
            3 => {
                let _ = t.on_transfer_complete(&d);
            }
            _ => {
                let mut total = 0;
                t.due(now, |b| {
                    let _ = b.key();
                    assert_eq!(b.remote_request_ids().count(), b.len());
                    assert!(b.leases().count() <= b.len());
                    total += b.len();
                });
                assert!(total <= t.len() as usize);
            }
        }
        let sum: usize = t.engines().map(|b| b.len()).sum();
        assert_eq!(sum, t.len() as usize);
        assert!(t.engine_count() <= 4 && t.len() <= 32);
    }
    let c = t.counters();
    assert!(c.started > 0 && c.refused_bad_param > 0 && c.missing_params > 0);
}

/// vLLM's D queue is unbounded and a waiting request holds no KV block on D,
/// so D's tracking capacity cannot follow D's block count: a burst of 600
/// waiting requests toward each of 4 P engines (2,400, more than the 1,088
/// blocks + seqs of this engine) is heartbeated in full with the defaults.
#[test]
fn default_config_tracks_4_engines_x_600_waiting_requests() {
    let shape = EngineShape {
        num_kv_blocks: 1024,
        max_num_seqs: 64,
    };
    let from_json = LeaseConfig::from_extra_config_json("{}", shape)
        .unwrap()
        .config;
    for config in [LeaseConfig::new(shape), from_json] {
        let mut t = HeartbeatTracker::new(&config, 1).expect("tracker");
        let engines = ["p0", "p1", "p2", "p3"];
        for (e, engine) in engines.iter().enumerate() {
            for i in 0..600 {
                let (d, p) = (format!("d-{e}-{i}"), format!("cmpl-{e}-{i}-0"));
                assert_eq!(
                    t.on_new_request(&d, &params(engine, &p), T0),
                    Ok(TrackOutcome::Started),
                    "{d}"
                );
            }
        }
        assert_eq!(t.len(), 2_400);
        assert_eq!(t.counters().not_heartbeated, 0);
        let mut per_engine = BTreeMap::new();
        t.due(T0, |b: EngineBatch<'_>| {
            per_engine.insert(b.key().engine_id.to_string(), b.len());
        });
        assert_eq!(
            per_engine,
            engines.iter().map(|e| (e.to_string(), 600)).collect()
        );
    }
}

#[test]
fn lease_fields_come_from_both_params_or_none() {
    let mut p = params("engA", "p1");
    assert_eq!(p.lease_fields(), None);
    p.remote_lease_slot = Some(4);
    assert_eq!(p.lease_fields(), None, "a slot without a nonce");
    p.remote_lease_nonce = Some(0);
    assert_eq!(p.lease_fields(), None, "nonce 0 is no lease");
    p.remote_lease_nonce = Some(9);
    let f = p.lease_fields().unwrap();
    assert_eq!((f.slot, f.nonce), (4, Nonce::new(9).unwrap()));
    let mut t = HeartbeatTracker::new(&config(4, 2), 1).expect("tracker");
    t.on_new_request("d1", &p, T0).unwrap();
    assert_eq!(t.remote_of("d1").unwrap().lease, Some(f));
}
