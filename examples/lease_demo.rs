//! A P engine and two decoders in virtual time, on the real lease book and
//! wire codec: what leases buy over vLLM's single 480 s timeout.
//!
//! - decoder A is healthy but overloaded: its requests wait 3 minutes in the
//!   queue while it heartbeats, then it reads and sends read-done;
//! - decoder B crashes 10 s after its requests arrive.
//!
//! Run: `cargo run --release --example lease_demo`

use std::time::Duration;

use kvlease::wire::{encode_heartbeats, encode_read_done};
use kvlease::{EngineShape, Instant, LeaseBook, LeaseConfig, ReleaseReason};

const STEP: Duration = Duration::from_millis(50);
const FIXED_TIMEOUT: Duration = Duration::from_secs(480); // VLLM_NIXL_ABORT_REQUEST_TIMEOUT
/// Requests each decoder receives.
const REQUESTS: usize = 64;
/// Every number printed comes from these settings, the config, the book's
/// counters or what the run measured; none is typed into a format string.
const A_READS_AT_SECS: u64 = 180;
const B_DIES_AT_SECS: u64 = 10;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let shape = EngineShape {
        num_kv_blocks: 4096,
        max_num_seqs: 256,
    };
    let config = LeaseConfig::from_extra_config_json(r#"{"kv_lease_duration": 30}"#, shape)?.config;
    let mut book = LeaseBook::new(&config, Instant::ZERO);
    println!(
        "lease {} s, heartbeat every {} s, extension {} s",
        secs(config.lease_duration()),
        secs(config.heartbeat_interval()),
        secs(config.lease_extension())
    );

    let a_ids: Vec<String> = (0..REQUESTS).map(|i| format!("cmpl-a{i:04}-0")).collect();
    let b_ids: Vec<String> = (0..REQUESTS).map(|i| format!("cmpl-b{i:04}-0")).collect();
    let mut nonces = std::collections::HashMap::new();
    for id in a_ids.iter().chain(&b_ids) {
        nonces.insert(id.clone(), book.grant(id, Instant::ZERO)?.nonce);
    }

    let a_reads_at = Instant::from_secs(A_READS_AT_SECS);
    let b_dies_at = Instant::from_secs(B_DIES_AT_SECS);
    let mut last_hb_a = None::<Instant>;
    let mut last_hb_b = None::<Instant>;
    let mut scratch = vec![0u8; 4096];
    let mut inbox: Vec<Vec<u8>> = Vec::new();
    let mut released: Vec<(String, ReleaseReason, Instant)> = Vec::new();
    let mut now = Instant::ZERO;
    let mut a_read = false;

    while now < Instant::from_secs(600) && book.held() > 0 {
        // Decoders: heartbeat each interval; A reads at A_READS_AT_SECS.
        let due =
            |last: Option<Instant>| last.is_none_or(|t| now >= t + config.heartbeat_interval());
        if !a_read && due(last_hb_a) {
            encode_heartbeats(a_ids.iter().map(String::as_str), 4096, &mut scratch, |m| {
                inbox.push(m.to_vec())
            })?;
            last_hb_a = Some(now);
        }
        if now < b_dies_at && due(last_hb_b) {
            encode_heartbeats(b_ids.iter().map(String::as_str), 4096, &mut scratch, |m| {
                inbox.push(m.to_vec())
            })?;
            last_hb_b = Some(now);
        }
        if !a_read && now >= a_reads_at {
            for id in &a_ids {
                let mut out = [0u8; 256];
                let n = encode_read_done(id, 1, nonces.get(id).copied(), &mut out)?;
                inbox.push(out[..n].to_vec());
            }
            a_read = true;
        }
        // P's engine step.
        for msg in inbox.drain(..) {
            book.on_notification(0, "d0", &msg, now)?;
        }
        book.poll(now);
        // finished_sending: the engine frees the blocks, then the slots go back.
        let mut freed = Vec::new();
        book.drain_released(|r| {
            released.push((r.request_id.to_string(), r.reason, now));
            freed.extend(r.slot);
        });
        for ticket in freed {
            book.blocks_freed(ticket);
        }
        now = now + STEP;
    }

    let b_released: Vec<Instant> = released
        .iter()
        .filter(|r| r.0.starts_with("cmpl-b"))
        .map(|r| r.2)
        .collect();
    let a_expired = released
        .iter()
        .filter(|r| r.0.starts_with("cmpl-a") && r.1 == ReleaseReason::Expired)
        .count();
    let a_read_done = released
        .iter()
        .filter(|r| r.0.starts_with("cmpl-a") && r.1 == ReleaseReason::ReadDone)
        .count();
    println!(
        "decoder A (overloaded, waits {} s): {a_read_done} of {} leases kept alive and released by read-done, {a_expired} expired early",
        secs(a_reads_at.saturating_duration_since(Instant::ZERO)),
        a_ids.len()
    );
    match b_released.iter().max() {
        Some(last) => println!(
            "decoder B (crashed at {} s): {} leases reclaimed by {:.1} s (a fixed timeout holds them until {} s)",
            secs(b_dies_at.saturating_duration_since(Instant::ZERO)),
            b_released.len(),
            last.as_nanos() as f64 / 1e9,
            secs(FIXED_TIMEOUT)
        ),
        None => println!(
            "decoder B (crashed at {} s): no lease reclaimed within the {:.0} s run",
            secs(b_dies_at.saturating_duration_since(Instant::ZERO)),
            now.as_nanos() as f64 / 1e9
        ),
    }
    let c = book.counters();
    println!(
        "counters: granted {}, renewed {}, expired {}, released by read {}",
        c.granted, c.renewed, c.expired, c.released_read
    );
    Ok(())
}

/// A duration in seconds as a person writes it: `30`, `45.5`.
fn secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s.fract() == 0.0 {
        format!("{s:.0}")
    } else {
        format!("{s}")
    }
}
