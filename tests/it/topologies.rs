//! Engine topologies on D (issue 19): P's pipeline stages are heartbeated
//! and verified, one fan-out limit for the sender and the verifier, and
//! `kv_lease_verification = false` as a D-side policy.
//!
//! Each test names what failed before the change.

use std::time::Duration;

use kvlease::consumer::{
    DefaultPeerAddress, HeartbeatSender, HeartbeatTracker, LeaseVerifier, RemotePrefillParams,
    SenderConfig, SenderError, Verdict, VerifierConfig, VerifyError, VerifyTarget,
};
use kvlease::fabric::{AgentId, RegionId};
use kvlease::testkit::{d_side_config, publish_slot, remote_prefill, FakeFabric};
use kvlease::{ConfigError, EngineShape, Instant, LeaseConfig, LeaseFields};

const T0: Instant = Instant::from_secs(50);

fn config() -> LeaseConfig {
    d_side_config(1024, 64, 256, 8, 64)
}

fn params<'a>(p_id: &'a str, p_tp: u32, p_pp: u32) -> RemotePrefillParams<'a> {
    RemotePrefillParams {
        pp_size: Some(p_pp),
        ..remote_prefill("eng", p_id, "p0", 5600, p_tp)
    }
}

/// The P ranks a sender's fabric sent anything to, by the rank in the
/// default address `{host}:{port}/{engine}/{rank}`.
fn ranks_heartbeated(f: &FakeFabric) -> Vec<u32> {
    let mut ranks: Vec<u32> = f
        .sent()
        .filter_map(|(addr, _)| addr.rsplit('/').next()?.parse().ok())
        .collect();
    ranks.sort_unstable();
    ranks.dedup();
    ranks
}

fn one_step(tp: u32, pp: u32, d_tp: u32, d_rank: u32) -> Vec<u32> {
    let cfg = config();
    let mut t = HeartbeatTracker::new(&cfg, d_tp).unwrap();
    t.on_new_request("d1", &params("p1", tp, pp), T0).unwrap();
    let mut s = HeartbeatSender::new(
        FakeFabric::new(4096, 64, 256, 1 << 16),
        DefaultPeerAddress,
        SenderConfig::new(&cfg, d_tp, d_rank),
    )
    .unwrap();
    // Handshakes start at the first step and are polled from the next.
    for k in 0..3u64 {
        s.step(&mut t, T0 + Duration::from_millis(10 * k));
    }
    ranks_heartbeated(s.fabric())
}

/// Item 4. Before: D heartbeated only ranks `0..tp`, so with P TP 2 × PP 2
/// ranks 2 and 3 (stage 1) were never renewed and lapsed under a busy D.
#[test]
fn every_pipeline_stage_of_p_is_heartbeated() {
    assert_eq!(one_step(2, 2, 1, 0), [0, 1, 2, 3]);
    // P TP 4 × PP 2 read by D TP 2: D rank 1 reads TP ranks 2 and 3 of
    // both stages.
    assert_eq!(one_step(4, 2, 2, 1), [2, 3, 6, 7]);
    // P TP 1 × PP 3 read by D TP 2: both D ranks heartbeat every stage.
    assert_eq!(one_step(1, 3, 2, 1), [0, 1, 2]);
}

/// Item 7. Before: the sender allowed 16 targets and the verifier 8, so
/// with P TP 16 and D TP 1 every check failed with `BadTargets` while the
/// heartbeats went out. Now both take `kv_lease_max_fan_out`.
#[test]
fn p_tp16_read_by_d_tp1_is_heartbeated_and_verified() {
    let cfg = config();
    assert_eq!(cfg.max_fan_out, 16);
    assert_eq!(one_step(16, 1, 1, 0), (0..16).collect::<Vec<_>>());

    let mut f = FakeFabric::with_remotes(16, 64);
    for r in &f.remotes {
        publish_slot(r, 5, 0x77);
    }
    let mut v = LeaseVerifier::new(&mut f, &VerifierConfig::new(&cfg, 8, 16)).unwrap();
    let targets: Vec<VerifyTarget> = (0..16)
        .map(|a| VerifyTarget::new(AgentId(a), RegionId(0), 64))
        .collect();
    v.submit(1, LeaseFields::from_params(Some(5), Some(0x77)), &targets)
        .expect("16 targets fit the one limit");
    let mut got = Vec::new();
    v.step(&mut f, T0, |t, verdict| got.push((t, verdict)));
    assert_eq!(got, [(1, Verdict::Verified)]);
}

/// Item 7, continued: a fan-out beyond the configured limit is refused by
/// the sender and the verifier alike, and the limit itself is checked when
/// the configuration is built.
#[test]
fn one_fan_out_limit_refuses_alike_and_is_checked_at_build_time() {
    let mut cfg = config();
    cfg.max_fan_out = 4;
    cfg.validate().unwrap();
    let mut t = HeartbeatTracker::new(&cfg, 1).unwrap();
    t.on_new_request("d1", &params("p1", 4, 2), T0).unwrap();
    let mut s = HeartbeatSender::new(
        FakeFabric::new(4096, 16, 64, 1 << 12),
        DefaultPeerAddress,
        SenderConfig::new(&cfg, 1, 0),
    )
    .unwrap();
    let mut refused = None;
    t.due(T0, |b| refused = Some(s.send_due(&b, T0)));
    assert_eq!(
        refused,
        Some(Err(SenderError::FanOutTooLarge { fan_out: 8, max: 4 }))
    );
    let mut f = FakeFabric::with_remotes(8, 64);
    let mut v = LeaseVerifier::new(&mut f, &VerifierConfig::new(&cfg, 8, 8)).unwrap();
    let targets: Vec<VerifyTarget> = (0..8)
        .map(|a| VerifyTarget::new(AgentId(a), RegionId(0), 64))
        .collect();
    assert_eq!(
        v.submit(1, LeaseFields::from_params(Some(1), Some(9)), &targets),
        Err(VerifyError::BadTargets {
            targets: 8,
            max_fan_out: 4
        })
    );

    let shape = EngineShape {
        num_kv_blocks: 64,
        max_num_seqs: 8,
    };
    for bad in ["0", "65"] {
        let err = LeaseConfig::from_extra_config_json(
            &format!(r#"{{"kv_lease_max_fan_out": {bad}}}"#),
            shape,
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                ConfigError::OutOfRange {
                    key: "kv_lease_max_fan_out",
                    ..
                }
            ),
            "{err:?}"
        );
    }
    let ok = LeaseConfig::from_extra_config_json(r#"{"kv_lease_max_fan_out": 64}"#, shape);
    assert_eq!(ok.unwrap().config.max_fan_out, 64);
}

/// Item 12. Before: no D-side code read `kv_lease_verification`; a load
/// without lease fields was always `Unverifiable`. Now a verifier built
/// with verification off accepts every load unchecked, without a READ.
#[test]
fn verification_off_accepts_loads_unchecked_without_a_read() {
    let shape = EngineShape {
        num_kv_blocks: 64,
        max_num_seqs: 8,
    };
    let cfg = LeaseConfig::from_extra_config_json(r#"{"kv_lease_verification": false}"#, shape)
        .unwrap()
        .config;
    let mut f = FakeFabric::with_remotes(2, 64);
    let mut v = LeaseVerifier::new(&mut f, &VerifierConfig::new(&cfg, 8, 2)).unwrap();
    let target = VerifyTarget::new(AgentId(0), RegionId(0), 64);
    // With lease fields (the slot holds nothing: a verifying D would say
    // Lapsed) and without them (a verifying D would say Unverifiable).
    v.submit(1, LeaseFields::from_params(Some(3), Some(5)), &[target])
        .unwrap();
    v.submit(2, None, &[]).unwrap();
    let mut got = Vec::new();
    v.step(&mut f, T0, |t, verdict| got.push((t, verdict)));
    got.sort_by_key(|x| x.0);
    assert_eq!(got, [(1, Verdict::Unchecked), (2, Verdict::Unchecked)]);
    assert!(f.reads.is_empty(), "no slot READ with verification off");
    assert_eq!(v.counters().unchecked, 2);
    assert!(Verdict::Unchecked.is_usable() && !Verdict::Unchecked.is_verified());
}
