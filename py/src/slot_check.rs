//! `SlotChecker`: D's post-READ lease check for a worker whose NIXL agent
//! lives in Python. The library's `LeaseVerifier` runs unchanged over a
//! `HostFabric`: it decides which slot READs to post (one per P rank per
//! step, coalesced), Python performs them with its `nixl_agent`, reports
//! them done or failed, and the verifier compares the landed words.
//!
//! ```text
//!  checker.add_peer(agent_name, slot_count)      -> peer id (after vLLM's handshake)
//!  checker.landing_regions()                    -> [(addr, nbytes)]: register with nixl_agent once
//!  checker.submit(token, slot, nonce, [peer ids]) after every block READ of the request completed
//!  each step: verdicts = checker.step(now)       -> [(token, verdict)]
//!             for xfer, peer, descs in checker.take_reads():  post a READ (no notification)
//!             ... when NIXL says it is done:       checker.complete(xfer, ok)
//! ```

use kvlease::consumer::{LeaseVerifier, VerifierConfig, VerifyTarget};
use kvlease::fabric::host::{HostConfig, HostFabric};
use kvlease::fabric::{AgentId, Fabric, FabricError, LeaseAdvert, PeerRecord, SlotRegion, XferId};
use kvlease::LeaseFields;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::config::LeaseConfig;
use crate::convert::{counters_dict, instant, nonce};
use crate::decode::verdict_name;
use crate::errors::raise;

/// A slot READ for Python to post: `(xfer, peer, [(local_address,
/// remote_offset, nbytes)])`.
type PostedRead = (u64, u32, Vec<(usize, u64, u64)>);

/// D's lease check after the block READs. See the module docs.
#[pyclass(module = "kvlease._native")]
pub(crate) struct SlotChecker {
    verifier: LeaseVerifier,
    fabric: HostFabric,
    targets: Vec<VerifyTarget>,
}

#[pymethods]
impl SlotChecker {
    /// A checker for up to `capacity` requests waiting for their check,
    /// against up to `max_peers` P ranks, for the worker agent `name`. With
    /// `kv_lease_verification` off every load is accepted as `"unchecked"`
    /// without a READ.
    #[new]
    #[pyo3(signature = (config, capacity, max_peers, name = "kvlease-d"))]
    fn new(config: &LeaseConfig, capacity: u32, max_peers: u32, name: &str) -> PyResult<Self> {
        let vc = VerifierConfig::new(&config.inner, capacity, max_peers);
        let mut fabric = HostFabric::new(
            name,
            HostConfig::for_verifier(capacity, max_peers, config.inner.max_fan_out),
        );
        let verifier = LeaseVerifier::new(&mut fabric, &vc).map_err(|e| raise("FabricError", e))?;
        Ok(SlotChecker {
            verifier,
            fabric,
            targets: Vec::with_capacity(config.inner.max_fan_out as usize),
        })
    }

    /// Registers a P rank by its agent name, exporting `slot_count` lease
    /// slots (what its handshake advertised; 0: it exports none, so its KV
    /// cannot be verified). Returns its peer id. The same name again is a
    /// restarted P: a new id, the old one forgotten.
    fn add_peer(&mut self, agent_name: &str, slot_count: u32) -> PyResult<u32> {
        let advert = (slot_count > 0).then_some(LeaseAdvert {
            slots: Some(SlotRegion {
                addr: 0,
                len: u64::from(slot_count) * 8,
                count: slot_count,
            }),
            compact_heartbeats: false,
            packed_heartbeats: false,
        });
        let record = PeerRecord {
            agent_name,
            metadata: &[],
            advert,
            clock: None,
            regions: &[],
        };
        let id = self
            .fabric
            .add_peer(&record, kvlease::Instant::ZERO)
            .map_err(|e| raise("FabricError", e))?;
        Ok(id.0)
    }

    /// Forgets a P rank; its READs not yet reported fail.
    fn remove_peer(&mut self, peer: u32) -> PyResult<()> {
        self.fabric
            .remove_peer(AgentId(peer))
            .map_err(|e| raise("FabricError", e))
    }

    /// The local buffers slot READs land in, as `(address, nbytes)`:
    /// register each with the worker's `nixl_agent` (DRAM) once.
    fn landing_regions(&self) -> Vec<(usize, usize)> {
        self.fabric
            .local_regions()
            .map(|(_, a, l)| (a, l))
            .collect()
    }

    /// Submits the check of request `token` once **every** block READ of
    /// it completed, read from the P ranks `peers`: its `kv_transfer_params`
    /// lease fields `slot`/`nonce` (int64; `None` when absent: the load
    /// cannot be verified). Raises `VerifyError` when refused (full, too
    /// many ranks): fail the load.
    #[pyo3(signature = (token, slot, nonce_value, peers))]
    fn submit(
        &mut self,
        token: u64,
        slot: Option<u32>,
        nonce_value: Option<i64>,
        peers: Vec<u32>,
    ) -> PyResult<()> {
        self.targets.clear();
        for p in peers {
            let agent = AgentId(p);
            let info = match self.fabric.handshake_state(agent, kvlease::Instant::ZERO) {
                kvlease::fabric::HandshakeState::Ready(info) => info,
                _ => return Err(raise("FabricError", FabricError::UnknownAgent)),
            };
            match VerifyTarget::from_peer(agent, &info) {
                Some(t) => self.targets.push(t),
                // A P without slots: checked without lease fields, which
                // fails as unverifiable.
                None => {
                    self.targets.clear();
                    return self
                        .verifier
                        .submit(token, None, &[])
                        .map_err(|e| raise("VerifyError", e));
                }
            }
        }
        let lease = match (slot, nonce_value.and_then(nonce)) {
            (Some(slot), Some(n)) => Some(LeaseFields { slot, nonce: n }),
            _ => None,
        };
        self.verifier
            .submit(token, lease, &self.targets)
            .map_err(|e| raise("VerifyError", e))
    }

    /// Drives the checks: polls the READs Python completed, posts new ones,
    /// and returns every decided check as `(token, verdict)`: `"verified"`
    /// (use the KV), `"unchecked"` (verification off), or a failure
    /// (`"lapsed"`, `"unverifiable"`, `"slot_out_of_range"`,
    /// `"read_failed: ..."`: fail the load). Call once per step, then
    /// `take_reads`.
    fn step(&mut self, now: f64) -> PyResult<Vec<(u64, String)>> {
        let now = instant(now)?;
        let mut out = Vec::new();
        self.verifier
            .step(&mut self.fabric, now, |t, v| out.push((t, verdict_name(v))));
        Ok(out)
    }

    /// The slot READs to post now, as `(xfer, peer, [(local_address,
    /// remote_offset, nbytes)])`: read `nbytes` from offset `remote_offset`
    /// of the peer's lease-slot array into `local_address`, without a
    /// notification, and report it with `complete(xfer, ok)`.
    fn take_reads(&mut self) -> Vec<PostedRead> {
        let mut out = Vec::new();
        let fabric = &mut self.fabric;
        let mut posted = Vec::new();
        fabric.take_posted(|r| {
            posted.push((
                r.xfer,
                r.agent,
                r.descs
                    .iter()
                    .map(|d| (d.local, d.local_offset, d.remote_offset, d.len))
                    .collect::<Vec<_>>(),
            ))
        });
        for (xfer, agent, descs) in posted {
            let descs = descs
                .into_iter()
                .map(|(local, local_offset, remote_offset, len)| {
                    let base = fabric.local_region(local).map_or(0, |(a, _)| a);
                    (base + local_offset as usize, remote_offset, len)
                })
                .collect();
            out.push((xfer.0, agent.0, descs));
        }
        out
    }

    /// Python finished slot READ `xfer`: `ok`, or failed (`error`: what to
    /// log). Returns whether the READ was known.
    #[pyo3(signature = (xfer, ok, error = None))]
    fn complete(&mut self, xfer: u64, ok: bool, error: Option<&str>) -> bool {
        let _ = error;
        let result = if ok {
            Ok(())
        } else {
            Err(FabricError::Backend(-1))
        };
        self.fabric.complete(XferId(xfer), result)
    }

    /// Checks submitted and not yet decided.
    #[getter]
    fn waiting(&self) -> usize {
        self.verifier.waiting()
    }

    /// Event counts since construction.
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.verifier.counters();
        counters_dict!(
            py,
            c,
            [
                submitted,
                refused,
                verified,
                lapsed,
                unverifiable,
                slot_out_of_range,
                read_failed,
                unchecked,
                slot_reads,
                coalesced_reads,
            ]
        )
    }
}
