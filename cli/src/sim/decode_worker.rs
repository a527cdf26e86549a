//! A D worker process: heartbeats, block READs, lease checks, read-dones.
//!
//! This module owns one D TP rank: its loopback agent, its KV landing words,
//! its in-flight loads, and the library's worker-side roles on it: a
//! [`HeartbeatSender`] fed the scheduler's plan bytes and a
//! [`LeaseVerifier`] (lease policies with verification). Each step it
//! reports to its scheduler with the real outcome message
//! ([`kvlease::ipc::outcome`]: verdicts and owed heartbeats).
//!
//! ```text
//!  start_load_kv  send_plan(plan bytes); handshake the P ranks of new loads;
//!                 post one block READ per P rank (without verification the
//!                 read-done rides on the READ, as vLLM attaches it)
//!  get_finished   poll READs; all done: check what landed (measurement),
//!                 submit the lease check; verifier.step: verdicts ->
//!                 read-done with the nonce to every P rank read from;
//!                 drain the agent; encode the outcome message
//! ```

use std::collections::BTreeMap;
use std::sync::Arc;

use kvlease::consumer::{
    DefaultPeerAddress, HeartbeatSender, LeaseVerifier, SenderConfig, Verdict, VerifierConfig,
    VerifyTarget,
};
use kvlease::fabric::loopback::{LoopbackFabric, LoopbackNetwork, NodeId};
use kvlease::fabric::{
    AgentId, Fabric, FabricError, HandshakeState, LandingWords, PeerInfo, ReadDesc, RegionId,
    XferId, XferState,
};
use kvlease::ipc::outcome::{self, Outcome};
use kvlease::ipc::plan::HeartbeatPlan;
use kvlease::topology::TpMapping;
use kvlease::{wire, Instant, LeaseConfig, LeaseFields};

use super::error::{Context, SimError};
use super::kv::kv_tag;
use super::ledger::{d_request_id, p_request_id, Ledger};
use super::metrics::timed;
use super::prefill::rank_address;

/// The region of a P worker's KV words (its lease slots are region 0).
pub const P_KV_REGION: RegionId = RegionId(1);

/// A load this worker runs: the request's P blocks into its D blocks.
#[derive(Clone, Debug)]
pub struct LoadSpec {
    /// The request.
    pub serial: u64,
    /// Its P engine.
    pub p: u32,
    /// Its lease fields from kv_transfer_params.
    pub lease: Option<LeaseFields>,
    /// P's blocks (`remote_block_ids`).
    pub p_blocks: Vec<u32>,
    /// The D blocks they land in.
    pub d_blocks: Vec<u32>,
}

#[derive(Debug)]
enum Stage {
    Handshake,
    Reading(Vec<Option<XferId>>),
    Checking,
}

#[derive(Debug)]
struct Load {
    spec: LoadSpec,
    stage: Stage,
}

/// What one of this worker's loads came to (before any verdict).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadFact {
    /// Every block READ completed. `corrupt`: some landed word is not this
    /// request's KV; `stale`: P had freed the blocks before the READ finished.
    Landed {
        /// Landed words are another request's.
        corrupt: bool,
        /// P freed the blocks before the READ completed.
        stale: bool,
    },
    /// A block READ (or a handshake it needed) failed.
    Failed(FabricError),
}

/// One D worker. See the module docs.
pub struct DecodeWorker {
    rank: u32,
    mapping: TpMapping,
    sender: HeartbeatSender<LoopbackFabric, DefaultPeerAddress>,
    verifier: Option<LeaseVerifier>,
    landing: Arc<LandingWords>,
    landing_region: RegionId,
    d_blocks: u32,
    peers: BTreeMap<(u32, u32), (AgentId, Option<PeerInfo>)>,
    loads: Vec<Load>,
    verdicts: Vec<(u64, Verdict)>,
    out: Vec<u8>,
    note: Vec<u8>,
    seq: u32,
}

impl DecodeWorker {
    /// Rank `rank` of D engine `d` (`d_tp` ranks) reading from P engines of
    /// `p_tp` ranks, joined to `net`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        d: u32,
        rank: u32,
        d_tp: u32,
        p_tp: u32,
        p_engines: u32,
        d_blocks: u32,
        config: &LeaseConfig,
        net: &Arc<LoopbackNetwork>,
    ) -> Result<DecodeWorker, SimError> {
        let mapping = TpMapping::new(d_tp, p_tp).context("TP sizes")?;
        let fabric = LoopbackFabric::join(net, &format!("d{d}/{rank}")).context("D agent")?;
        let mut sender = HeartbeatSender::new(
            fabric,
            DefaultPeerAddress,
            SenderConfig::new(config, d_tp, rank),
        )
        .context("heartbeat sender")?;
        let verifier = if config.verification {
            // One agent batch per P rank this worker reads from.
            let agents = p_engines * mapping.fan_out();
            Some(
                LeaseVerifier::new(
                    sender.fabric_mut(),
                    &VerifierConfig::new(config, 4096, agents.max(1)),
                )
                .context("lease verifier")?,
            )
        } else {
            None
        };
        let landing = LandingWords::new(d_blocks as usize * mapping.fan_out() as usize);
        let landing_region = sender
            .fabric_mut()
            .register_landing(Arc::clone(&landing))
            .context("register D KV")?;
        Ok(DecodeWorker {
            rank,
            mapping,
            sender,
            verifier,
            landing,
            landing_region,
            d_blocks,
            peers: BTreeMap::new(),
            loads: Vec::new(),
            verdicts: Vec::new(),
            out: Vec::new(),
            note: vec![0; 256],
            seq: 0,
        })
    }

    /// The worker's loopback node.
    pub fn node(&self) -> NodeId {
        self.sender.fabric().node()
    }

    /// Heartbeat messages sent so far.
    pub fn heartbeat_messages(&self) -> u64 {
        self.sender.counters().messages_sent
    }

    /// The P ranks this worker reads from and heartbeats.
    fn targets(&self) -> Vec<u32> {
        self.mapping
            .targets(self.rank)
            .map(|t| t.collect())
            .unwrap_or_default()
    }

    /// A load the scheduler started: READs go out at `start_load_kv`.
    pub fn add_load(&mut self, spec: LoadSpec) {
        self.loads.push(Load {
            spec,
            stage: Stage::Handshake,
        });
    }

    /// start_load_kv, heartbeat half: the scheduler's plan bytes.
    pub fn send_plan(&mut self, plan: &[u8], now: Instant, ns: &mut u64) -> Result<(), SimError> {
        timed(ns, || -> Result<(), SimError> {
            let plan = HeartbeatPlan::decode(plan).context("the scheduler's plan")?;
            self.sender.send_plan(&plan, now);
            Ok(())
        })
    }

    /// P rank `r` of engine `p` once its handshake is done (starting it when
    /// needed); `Err` when it failed.
    fn peer(
        &mut self,
        p: u32,
        r: u32,
        now: Instant,
    ) -> Result<Option<(AgentId, PeerInfo)>, FabricError> {
        let fabric = self.sender.fabric_mut();
        let agent = match self.peers.get(&(p, r)) {
            Some((a, Some(info))) => return Ok(Some((*a, *info))),
            Some((a, None)) => *a,
            None => {
                let a = fabric.start_handshake(&rank_address(p, r), now)?;
                self.peers.insert((p, r), (a, None));
                a
            }
        };
        match fabric.handshake_state(agent, now) {
            HandshakeState::Pending => Ok(None),
            HandshakeState::Ready(info) => {
                self.peers.insert((p, r), (agent, Some(info)));
                Ok(Some((agent, info)))
            }
            HandshakeState::Failed(e) => {
                self.peers.remove(&(p, r));
                Err(e)
            }
        }
    }

    /// start_load_kv, KV half: posts the block READs of loads whose P ranks
    /// are reachable. Failures are reported by the next `get_finished`.
    pub fn start_loads(&mut self, now: Instant, facts: &mut Vec<(u64, ReadFact)>) {
        let targets = self.targets();
        let consumers = self.mapping.consumers_per_p_rank();
        let mut k = 0;
        while k < self.loads.len() {
            if !matches!(self.loads[k].stage, Stage::Handshake) {
                k += 1;
                continue;
            }
            let p = self.loads[k].spec.p;
            let mut ready = Vec::with_capacity(targets.len());
            let mut failed = None;
            for &r in &targets {
                match self.peer(p, r, now) {
                    Ok(Some(a)) => ready.push(a.0),
                    Ok(None) => {}
                    Err(e) => failed = Some(e),
                }
            }
            if let Some(e) = failed {
                let load = self.loads.swap_remove(k);
                self.fail(&load.spec, e, facts);
                continue;
            }
            if ready.len() < targets.len() {
                k += 1;
                continue;
            }
            let verify = self.verifier.is_some();
            let spec = &self.loads[k].spec;
            let mut xfers = Vec::with_capacity(ready.len());
            let mut err = None;
            for (j, agent) in ready.iter().enumerate() {
                let descs = self.descs(spec, j as u32);
                // Without verification the read-done rides on the READ, as
                // vLLM attaches it; with it, it waits for the verdict.
                let note = if verify {
                    None
                } else {
                    let n = wire::encode_read_done(
                        &p_request_id(spec.serial),
                        consumers,
                        None,
                        &mut self.note,
                    )
                    .unwrap_or(0);
                    Some(&self.note[..n])
                };
                match self
                    .sender
                    .fabric_mut()
                    .post_read(*agent, &descs, note, now)
                {
                    Ok(x) => xfers.push(Some(x)),
                    Err(e) => {
                        err = Some(e);
                        break;
                    }
                }
            }
            if let Some(e) = err {
                for x in xfers.into_iter().flatten() {
                    self.sender.fabric_mut().cancel_read(x);
                }
                let load = self.loads.swap_remove(k);
                self.fail(&load.spec, e, facts);
                continue;
            }
            self.loads[k].stage = Stage::Reading(xfers);
            k += 1;
        }
    }

    /// The READ descriptors of `spec` from its `j`-th P rank: one per run of
    /// blocks contiguous on both sides.
    fn descs(&self, spec: &LoadSpec, j: u32) -> Vec<ReadDesc> {
        let base = u64::from(j) * u64::from(self.d_blocks);
        let mut descs: Vec<ReadDesc> = Vec::new();
        for (&pb, &db) in spec.p_blocks.iter().zip(&spec.d_blocks) {
            let remote_offset = u64::from(pb) * 8;
            let local_offset = (base + u64::from(db)) * 8;
            if let Some(last) = descs.last_mut() {
                if last.remote_offset + last.len == remote_offset
                    && last.local_offset + last.len == local_offset
                {
                    last.len += 8;
                    continue;
                }
            }
            descs.push(ReadDesc {
                local: self.landing_region,
                local_offset,
                remote: P_KV_REGION,
                remote_offset,
                len: 8,
            });
        }
        descs
    }

    /// A load failed before its check: with verification the failure is
    /// this worker's verdict; either way P is told the READ is over.
    fn fail(&mut self, spec: &LoadSpec, e: FabricError, facts: &mut Vec<(u64, ReadFact)>) {
        facts.push((spec.serial, ReadFact::Failed(e)));
        if self.verifier.is_some() {
            self.verdicts.push((spec.serial, Verdict::ReadFailed(e)));
        }
        self.send_read_done(spec);
    }

    /// Read-done to every P rank this worker read from (with the nonce when
    /// it verifies).
    fn send_read_done(&mut self, spec: &LoadSpec) {
        let nonce = if self.verifier.is_some() {
            spec.lease.map(|l| l.nonce)
        } else {
            None
        };
        let consumers = self.mapping.consumers_per_p_rank();
        let Ok(n) =
            wire::encode_read_done(&p_request_id(spec.serial), consumers, nonce, &mut self.note)
        else {
            return;
        };
        for r in self.targets() {
            if let Some((agent, _)) = self.peers.get(&(spec.p, r)).copied() {
                // A lost read-done is the fault model's business: P's
                // lease then runs out instead.
                let _ = self
                    .sender
                    .fabric_mut()
                    .send_notification(agent, &self.note[..n]);
            }
        }
    }

    /// get_finished: polls READs, checks what landed, runs the lease checks,
    /// sends read-dones, drains the agent, and encodes the outcome message
    /// (returns its length; the bytes are [`DecodeWorker::outcome_bytes`]).
    /// `facts` receives what every finished load came to.
    pub fn get_finished(
        &mut self,
        now: Instant,
        ledger: &Ledger,
        facts: &mut Vec<(u64, ReadFact)>,
        ns: &mut u64,
    ) -> Result<Option<usize>, SimError> {
        let targets = self.targets();
        let mut k = 0;
        while k < self.loads.len() {
            let Stage::Reading(xfers) = &mut self.loads[k].stage else {
                k += 1;
                continue;
            };
            let mut failed = None;
            for x in xfers.iter_mut() {
                if let Some(id) = *x {
                    match self.sender.fabric_mut().read_state(id, now) {
                        XferState::InProgress => {}
                        XferState::Done => *x = None,
                        XferState::Failed(e) => {
                            *x = None;
                            failed = Some(e);
                        }
                    }
                }
            }
            if let Some(e) = failed {
                let load = self.loads.swap_remove(k);
                if let Stage::Reading(rest) = &load.stage {
                    for x in rest.iter().flatten() {
                        self.sender.fabric_mut().cancel_read(*x);
                    }
                }
                self.fail(&load.spec, e, facts);
                continue;
            }
            if xfers.iter().any(Option::is_some) {
                k += 1;
                continue;
            }
            // Every block READ of this worker completed: what landed?
            let spec = &self.loads[k].spec;
            let mut corrupt = false;
            for (j, &r) in targets.iter().enumerate() {
                let want = kv_tag(spec.serial, r);
                let base = j * self.d_blocks as usize;
                corrupt |= spec.d_blocks[..spec.p_blocks.len()]
                    .iter()
                    .any(|&db| self.landing.load(base + db as usize) != want);
            }
            let stale = ledger
                .get(spec.serial)
                .is_some_and(|r| r.p_freed_at.is_some());
            facts.push((spec.serial, ReadFact::Landed { corrupt, stale }));
            if let Some(verifier) = &mut self.verifier {
                let checks: Vec<VerifyTarget> = targets
                    .iter()
                    .filter_map(|&r| {
                        let (agent, info) = self.peers.get(&(spec.p, r))?;
                        VerifyTarget::from_peer(*agent, info.as_ref()?)
                    })
                    .collect();
                let submitted = timed(ns, || verifier.submit(spec.serial, spec.lease, &checks));
                if submitted.is_err() {
                    // The check was refused: the load fails closed.
                    let spec = self.loads.swap_remove(k).spec;
                    self.verdicts.push((spec.serial, Verdict::Unverifiable));
                    self.send_read_done(&spec);
                    continue;
                }
                self.loads[k].stage = Stage::Checking;
                k += 1;
            } else {
                // Unverified: the load is done (the read-done rode on the READ).
                self.loads.swap_remove(k);
            }
        }
        // The lease checks: one slot READ per P rank, verdicts, read-dones.
        if let Some(verifier) = &mut self.verifier {
            let mut resolved = Vec::new();
            let fabric = self.sender.fabric_mut();
            timed(ns, || {
                verifier.step(fabric, now, |token, v| resolved.push((token, v)))
            });
            for (serial, v) in resolved {
                if let Some(i) = self.loads.iter().position(|l| l.spec.serial == serial) {
                    let spec = self.loads.swap_remove(i).spec;
                    timed(ns, || self.send_read_done(&spec));
                }
                self.verdicts.push((serial, v));
            }
        }
        // Engine-loop progress: drain the agent every step (nothing is
        // addressed to D; NIXL needs the call to move messages).
        let fabric = self.sender.fabric_mut();
        timed(ns, || fabric.drain_notifications(&mut |_, _| {}))
            .context("D worker drains its agent")?;
        // The outcome message: verdicts and owed heartbeats.
        let owed = self.sender.owed_engines().len();
        if self.verdicts.is_empty() && owed == 0 {
            return Ok(None);
        }
        let ids: Vec<String> = self
            .verdicts
            .iter()
            .map(|(s, _)| d_request_id(*s))
            .collect();
        let (out, verdicts, sender, seq, rank) = (
            &mut self.out,
            &self.verdicts,
            &self.sender,
            self.seq,
            self.rank,
        );
        let n = timed(ns, || -> Result<usize, SimError> {
            let outcomes = ids.iter().zip(verdicts).map(|(id, (_, v))| Outcome {
                request_id: id,
                verdict: *v,
            });
            let len = outcome::encoded_len(outcomes.clone(), owed as u32);
            if out.len() < len {
                out.resize(len, 0);
            }
            outcome::encode(out, rank, seq, outcomes, sender.owed_engines()).context("outcomes")
        })?;
        self.verdicts.clear();
        self.seq = self.seq.wrapping_add(1);
        Ok(Some(n))
    }

    /// The outcome message `get_finished` encoded.
    pub fn outcome_bytes(&self, n: usize) -> &[u8] {
        &self.out[..n]
    }
}
