//! The inputs the tests build over and over, unit and integration tests
//! alike: validated configs sized for a test (P side, D side, and the
//! 6-second leases of the real-time suites), and the `kv_transfer_params` of
//! a remote prefill, the READ descriptors of a lease-slot window. Plain
//! constructors: nothing here keeps state or
//! touches a fabric.

use std::time::Duration;

use crate::config::{EngineShape, LeaseConfig};
use crate::consumer::{RemotePrefillParams, VerifierConfig};
use crate::fabric::{ReadDesc, RegionId};
use crate::slots::LeaseSlots;

/// A validated P-side config: `num_kv_blocks` blocks (and as many slots),
/// no sequence limit, room for `lease_capacity` leases.
pub fn p_side_config(num_kv_blocks: u32, lease_capacity: u32) -> LeaseConfig {
    let mut c = LeaseConfig::new(EngineShape {
        num_kv_blocks,
        max_num_seqs: 0,
    });
    c.lease_capacity = lease_capacity;
    c.validate().expect("a valid test config");
    c
}

/// The shortest lease the config accepts, 6 s (heartbeat interval 1 s,
/// extension 4 s), so that real-time runs stay short; an engine of
/// `num_kv_blocks` blocks and `max_num_seqs` sequences.
pub fn six_second_leases(num_kv_blocks: u32, max_num_seqs: u32) -> LeaseConfig {
    let mut c = LeaseConfig::new(EngineShape {
        num_kv_blocks,
        max_num_seqs,
    });
    c.lease_duration = Duration::from_secs(6);
    c.validate().expect("6 s leases are valid");
    c
}

/// A validated config of an engine with `num_kv_blocks` blocks and
/// `max_num_seqs` sequences, tracking up to `requests` requests on
/// `engines` remote engines, with ids of up to `max_id_len` bytes.
pub fn d_side_config(
    num_kv_blocks: u32,
    max_num_seqs: u32,
    requests: u32,
    engines: u32,
    max_id_len: u16,
) -> LeaseConfig {
    let mut c = LeaseConfig::new(EngineShape {
        num_kv_blocks,
        max_num_seqs,
    });
    c.max_tracked_requests = requests;
    c.max_remote_engines = engines;
    c.max_request_id_len = max_id_len;
    c.validate().expect("a valid test config");
    c
}

/// A verifying verifier's sizing for tests: `capacity` checks against up to
/// `max_agents` P agents, with the default fan-out limit.
pub fn verifier_config(capacity: u32, max_agents: u32) -> VerifierConfig {
    let c = LeaseConfig::new(EngineShape {
        num_kv_blocks: 64,
        max_num_seqs: 8,
    });
    VerifierConfig::new(&c, capacity, max_agents)
}

/// vLLM's `kv_transfer_params` for a request prefilled remotely as `p_id`
/// on `engine` at `host:port`, whose P runs tensor parallel `p_tp`.
pub fn remote_prefill<'a>(
    engine: &'a str,
    p_id: &'a str,
    host: &'a str,
    port: u16,
    p_tp: u32,
) -> RemotePrefillParams<'a> {
    RemotePrefillParams {
        do_remote_prefill: true,
        remote_engine_id: Some(engine),
        remote_request_id: Some(p_id),
        remote_host: Some(host),
        remote_port: Some(port),
        tp_size: Some(p_tp),
        ..Default::default()
    }
}

/// READ descriptors for slots `0..count` of a registered slot array: one
/// 8-byte descriptor per slot word, landing back to back from
/// `landing_offset` in the landing region (the verifier's worst case, when
/// the waiting slots are scattered).
pub fn slot_word_descs(
    landing: RegionId,
    landing_offset: u64,
    slots: RegionId,
    count: u32,
) -> Vec<ReadDesc> {
    (0..count)
        .map(|s| ReadDesc {
            local: landing,
            local_offset: landing_offset + 8 * u64::from(s),
            remote: slots,
            remote_offset: LeaseSlots::offset_of(s),
            len: 8,
        })
        .collect()
}

/// Makes `slot` of a remote slot array hold `nonce`, as a P rank's release
/// (zeroing) and next grant (publishing) do; the verifier's tests stand in
/// for P.
pub fn publish_slot(slots: &LeaseSlots, slot: u32, nonce: u64) {
    slots.clear(slot);
    slots.publish(slot, nonce);
}
