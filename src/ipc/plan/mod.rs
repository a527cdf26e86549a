//! Heartbeat plan: what the D scheduler tells every D worker each step.
//!
//! The scheduler's [`HeartbeatTracker`] decides which P engines are due
//! (and which a worker still owes a heartbeat); each worker's
//! [`HeartbeatSender`] turns every planned engine into one batched
//! notification per P rank it reads from. One message carries the whole
//! step and goes, byte for byte the same, to every worker of the engine
//! (vLLM ships `heartbeat_by_engine` inside its connector metadata the same
//! way). This module owns the bytes: the records, [`encode`] (written once,
//! against [`HeartbeatBatch`], for the tracker's batches and for decoded
//! plans alike) and [`HeartbeatPlan::decode`]. It decides nothing.
//!
//! # Section A: engine records (44 bytes each)
//!
//! ```text
//!  offset size field
//!       0    4 index             the engine's slot in the tracker  } EngineHandle
//!       4    4 generation        that slot's generation           }
//!       8    4 tp_size           P's TP size, never 0
//!      12    4 pp_size           P's PP size
//!      16    4 dcp_size          P's DCP size
//!      20    4 first_member      its first record in section B
//!      24    4 member_count      its requests, at least 1
//!      28    4 engine_id_offset  remote_engine_id in the id area
//!      32    4 host_offset       remote_host in the id area
//!      36    2 engine_id_len     non-empty
//!      38    2 host_len          non-empty
//!      40    2 port              remote_port
//!      42    1 kind              1 due, 2 owed, 3 gone
//!      43    1 flags             bit 0: every member has a lease; others 0
//! ```
//!
//! - **due**: the engine's interval ran out: heartbeat every P rank.
//! - **owed**: not due, but a worker reported owing some P rank of it a
//!   heartbeat ([`BatchReason::Owed`]): serve only the ranks still owed.
//! - **gone**: the engine behind (index, generation) is no longer tracked;
//!   a worker that owes it a heartbeat drops the debt. Every field but
//!   index, generation and kind is 0, and gone records follow every due or
//!   owed one.
//!
//! # Section B: member records (24 bytes each)
//!
//! ```text
//!  offset size field
//!       0    8 nonce      remote_lease_nonce, or 0: no lease
//!       8    4 slot       remote_lease_slot, or NO_SLOT (u32::MAX) when no lease
//!      12    4 id_offset  the P-side request id in the id area
//!      16    2 id_len     non-empty, no ','
//!      18    6 reserved   0
//! ```
//!
//! # One encoding per plan
//!
//! Engine `i`'s members are records `first_member .. first_member +
//! member_count` of section B, and the engines' ranges follow each other
//! with no gap or overlap and cover section B. The id area holds, engine by
//! engine, the engine id, the host, then each member's id, back to back,
//! with nothing else. The decoder refuses any other arrangement (an
//! overlapping or stray reference is a sign of corruption, not a valid
//! plan), which makes the encoding unique: a decoded plan re-encodes to the
//! very same bytes (`fuzz/fuzz_targets/heartbeat_plan.rs` checks it).
//!
//! [`HeartbeatTracker`]: crate::consumer::HeartbeatTracker
//! [`HeartbeatSender`]: crate::consumer::HeartbeatSender

use core::fmt;

use bytemuck::{Pod, Zeroable};

use super::{FrameReader, FrameWriter, IpcError, MsgKind, FROM_SCHEDULER};
use crate::heartbeat_batch::{sealed, BatchReason, HeartbeatBatch, TrackedRemote};
use crate::lease_fields::LeaseFields;
use crate::nonce::Nonce;
use crate::remote_engine::{EngineHandle, EngineKey};
use crate::wire::{self, CompactEntry};

/// `slot` of a member without a lease.
pub const NO_SLOT: u32 = u32::MAX;

const KIND_DUE: u8 = 1;
const KIND_OWED: u8 = 2;
const KIND_GONE: u8 = 3;
const FLAG_ALL_LEASED: u8 = 1;

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
struct EngineRecord {
    index: u32,
    generation: u32,
    tp_size: u32,
    pp_size: u32,
    dcp_size: u32,
    first_member: u32,
    member_count: u32,
    engine_id_offset: u32,
    host_offset: u32,
    engine_id_len: u16,
    host_len: u16,
    port: u16,
    kind: u8,
    flags: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
struct MemberRecord {
    nonce: u64,
    slot: u32,
    id_offset: u32,
    id_len: u16,
    reserved: [u8; 6],
}

/// Bytes of one engine record (section A).
pub const ENGINE_RECORD_LEN: usize = core::mem::size_of::<EngineRecord>();
/// Bytes of one member record (section B).
pub const MEMBER_RECORD_LEN: usize = core::mem::size_of::<MemberRecord>();
const _: () = assert!(ENGINE_RECORD_LEN == 44 && MEMBER_RECORD_LEN == 24);

/// Section counts and id bytes of a plan, saturating (a plan that large
/// fits no buffer, so the writer refuses it).
fn sizes<B, I, G>(engines: I, gone: G) -> (u32, u32, u32)
where
    B: HeartbeatBatch,
    I: Iterator<Item = B>,
    G: Iterator<Item = EngineHandle>,
{
    let (mut records, mut members, mut ids) = (0u64, 0u64, 0u64);
    for b in engines {
        let key = b.key();
        records += 1;
        members += b.len() as u64;
        ids += (key.engine_id.len() + key.host.len() + b.id_bytes()) as u64;
    }
    records += gone.count() as u64;
    let clamp = |n: u64| u32::try_from(n).unwrap_or(u32::MAX);
    (clamp(records), clamp(members), clamp(ids))
}

/// Bytes the plan carrying `engines` and the `gone` notices takes.
pub fn encoded_len<B, I, G>(engines: I, gone: G) -> usize
where
    B: HeartbeatBatch,
    I: IntoIterator<Item = B>,
    G: IntoIterator<Item = EngineHandle>,
{
    let (records, members, ids) = sizes(engines.into_iter(), gone.into_iter());
    super::frame::frame_len(records, ENGINE_RECORD_LEN, members, MEMBER_RECORD_LEN, ids)
}

/// Encodes `engines` (due or owed, per [`HeartbeatBatch::reason`]) and the
/// `gone` notices as plan number `seq` into `buf`; returns its length.
/// [`IpcError::BufferTooSmall`] when it does not fit (nothing written);
/// [`IpcError::BadRecord`] (by engine index) for an engine the decoder
/// would refuse: no requests, TP size 0, an empty engine id or host, or one
/// longer than 65,535 bytes (the tracker never holds one).
///
/// [`crate::consumer::HeartbeatTracker::encode_plan`] is this over the
/// tracker's planned engines; a decoded plan re-encodes with
/// `encode(buf, plan.seq(), plan.engines(), plan.gone())`.
pub fn encode<B, I, G>(buf: &mut [u8], seq: u32, engines: I, gone: G) -> Result<usize, IpcError>
where
    B: HeartbeatBatch,
    I: IntoIterator<Item = B>,
    I::IntoIter: Clone,
    G: IntoIterator<Item = EngineHandle>,
    G::IntoIter: Clone,
{
    let engines = engines.into_iter();
    let gone = gone.into_iter();
    for (i, b) in engines.clone().enumerate() {
        let key = b.key();
        let what = if b.is_empty() {
            "engine without requests"
        } else if key.tp_size == 0 {
            "tp_size 0"
        } else if key.engine_id.is_empty() || key.host.is_empty() {
            "empty engine id or host"
        } else if key.engine_id.len() > usize::from(u16::MAX)
            || key.host.len() > usize::from(u16::MAX)
        {
            "engine id or host longer than 65535 bytes"
        } else {
            continue;
        };
        return Err(IpcError::BadRecord {
            index: u32::try_from(i).unwrap_or(u32::MAX),
            what,
        });
    }
    let (records, members, ids) = sizes(engines.clone(), gone.clone());
    let mut w = FrameWriter::new(
        buf,
        MsgKind::HeartbeatPlan,
        FROM_SCHEDULER,
        seq,
        records,
        ENGINE_RECORD_LEN,
        members,
        MEMBER_RECORD_LEN,
        ids,
    )?;
    let mut first = 0u32;
    for b in engines {
        let key = b.key();
        let (engine_id_offset, engine_id_len) = w.id(key.engine_id.as_bytes());
        let (host_offset, host_len) = w.id(key.host.as_bytes());
        let count = b.len() as u32;
        w.record(&EngineRecord {
            index: b.handle().index,
            generation: b.handle().generation,
            tp_size: key.tp_size,
            pp_size: b.pp_size(),
            dcp_size: b.dcp_size(),
            first_member: first,
            member_count: count,
            engine_id_offset,
            host_offset,
            engine_id_len: engine_id_len as u16,
            host_len: host_len as u16,
            port: key.port,
            kind: match b.reason() {
                BatchReason::Due => KIND_DUE,
                BatchReason::Owed => KIND_OWED,
            },
            flags: if b.all_leased() { FLAG_ALL_LEASED } else { 0 },
        });
        for r in b.remotes() {
            // The batch sources (sealed) hold ids of at most 1024 bytes,
            // non-empty and free of ','.
            debug_assert!(wire::check_heartbeat_id(r.remote_request_id).is_ok());
            let (id_offset, id_len) = w.id(r.remote_request_id.as_bytes());
            w.extra(&MemberRecord {
                nonce: r.lease.map_or(0, |l| l.nonce.get()),
                slot: r.lease.map_or(NO_SLOT, |l| l.slot),
                id_offset,
                id_len: id_len as u16,
                reserved: [0; 6],
            });
        }
        first = first.saturating_add(count);
    }
    for h in gone {
        w.record(&EngineRecord {
            index: h.index,
            generation: h.generation,
            kind: KIND_GONE,
            ..EngineRecord::zeroed()
        });
    }
    Ok(w.finish())
}

/// A received heartbeat plan, checked in full: every iterator over it is
/// infallible.
#[derive(Clone, Copy)]
pub struct HeartbeatPlan<'a> {
    frame: FrameReader<'a>,
    /// The id area (valid UTF-8 once decoded).
    ids: &'a str,
    /// Records `0..engines` are due or owed engines; the rest are gone.
    engines: u32,
}

/// Tracks the canonical layout while decoding: where the next id and the
/// next member must start.
struct Cursor<'a> {
    ids: &'a str,
    id_at: u64,
}

impl<'a> Cursor<'a> {
    /// The id at (`offset`, `len`), which must start where the previous one
    /// ended, lie inside the area and fall on character boundaries.
    fn take(&mut self, offset: u32, len: u16) -> Result<&'a str, &'static str> {
        if u64::from(offset) != self.id_at {
            return Err("id not where the previous one ended");
        }
        let start = offset as usize;
        let id = self
            .ids
            .get(start..start + usize::from(len))
            .ok_or("id outside the id area or not UTF-8")?;
        self.id_at += u64::from(len);
        Ok(id)
    }
}

impl<'a> HeartbeatPlan<'a> {
    /// Checks the frame and every record against the layout in the module
    /// docs: sender is the scheduler; kinds known, gone notices last and
    /// zero but for their handle; TP size non-zero; engine id and host
    /// non-empty; member ranges contiguous, non-empty and covering section
    /// B; member ids non-empty, free of `,`; a lease's nonce non-zero and a
    /// missing lease's slot `NO_SLOT`; the all-leased flag true to the
    /// members; ids back to back, UTF-8, covering the id area.
    ///
    /// A refused engine record is [`IpcError::BadRecord`] with its section A
    /// index; a refused member record, with its section B index and a `what`
    /// that starts with "member".
    pub fn decode(bytes: &'a [u8]) -> Result<HeartbeatPlan<'a>, IpcError> {
        let frame = FrameReader::parse(
            bytes,
            MsgKind::HeartbeatPlan,
            ENGINE_RECORD_LEN,
            MEMBER_RECORD_LEN,
        )?;
        if frame.header.from != FROM_SCHEDULER {
            return Err(IpcError::WrongSender {
                expected: FROM_SCHEDULER,
                found: frame.header.from,
            });
        }
        // The frame checked the length: the id area is the message's tail.
        let area = &bytes[bytes.len() - frame.header.ids_len as usize..];
        // An invalid byte fails the id that covers it (ids tile the area).
        let ids = match core::str::from_utf8(area) {
            Ok(s) => s,
            Err(e) => core::str::from_utf8(&area[..e.valid_up_to()]).unwrap_or_default(),
        };
        let mut cursor = Cursor { ids, id_at: 0 };
        let mut next_member = 0u32;
        let mut engines = None;
        for index in 0..frame.header.records {
            let r: EngineRecord = frame.record(index);
            let bad = |what| IpcError::BadRecord { index, what };
            match r.kind {
                KIND_DUE | KIND_OWED => {
                    if engines.is_some() {
                        return Err(bad("engine record after a gone notice"));
                    }
                    check_engine(&frame, &r, &mut cursor, next_member).map_err(
                        |(member, what)| IpcError::BadRecord {
                            index: member.unwrap_or(index),
                            what,
                        },
                    )?;
                    next_member += r.member_count;
                }
                KIND_GONE => {
                    engines.get_or_insert(index);
                    let canonical = EngineRecord {
                        index: r.index,
                        generation: r.generation,
                        kind: KIND_GONE,
                        ..EngineRecord::zeroed()
                    };
                    if r != canonical {
                        return Err(bad("gone notice with fields other than its handle"));
                    }
                }
                _ => return Err(bad("unknown engine record kind")),
            }
        }
        if next_member != frame.header.extras {
            return Err(IpcError::BadRecord {
                index: next_member,
                what: "member record of no engine",
            });
        }
        if cursor.id_at != u64::from(frame.header.ids_len) {
            return Err(IpcError::BadRecord {
                index: frame.header.records,
                what: "id area bytes no record refers to",
            });
        }
        Ok(HeartbeatPlan {
            frame,
            ids,
            engines: engines.unwrap_or(frame.header.records),
        })
    }

    /// The scheduler's plan counter.
    pub fn seq(&self) -> u32 {
        self.frame.header.seq
    }

    /// Engines to heartbeat (due or owed).
    pub fn len(&self) -> u32 {
        self.engines
    }

    /// True when no engine is to be heartbeated (there may be gone notices).
    pub fn is_empty(&self) -> bool {
        self.engines == 0
    }

    /// Requests across all engines.
    pub fn members(&self) -> u32 {
        self.frame.header.extras
    }

    /// The engines to heartbeat, in the scheduler's order.
    pub fn engines(&self) -> PlanEngines<'a> {
        PlanEngines {
            plan: *self,
            next: 0,
        }
    }

    /// The engines the scheduler no longer tracks: drop any heartbeat owed
    /// to them.
    pub fn gone(&self) -> impl ExactSizeIterator<Item = EngineHandle> + Clone + 'a {
        let frame = self.frame;
        (self.engines..frame.header.records).map(move |i| {
            let r: EngineRecord = frame.record(i);
            EngineHandle {
                index: r.index,
                generation: r.generation,
            }
        })
    }

    /// The id at (`offset`, `len`); checked by `decode`, so the fallback
    /// (empty) is unreachable.
    #[inline]
    fn id(&self, offset: u32, len: u16) -> &'a str {
        let start = offset as usize;
        self.ids
            .get(start..start + usize::from(len))
            .unwrap_or_default()
    }

    #[inline]
    fn member(&self, j: u32) -> TrackedRemote<'a> {
        let m: MemberRecord = self.frame.extra(j);
        TrackedRemote {
            remote_request_id: self.id(m.id_offset, m.id_len),
            lease: Nonce::new(m.nonce).map(|nonce| LeaseFields {
                slot: m.slot,
                nonce,
            }),
        }
    }
}

impl fmt::Debug for HeartbeatPlan<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HeartbeatPlan")
            .field("seq", &self.seq())
            .field("engines", &self.len())
            .field("members", &self.members())
            .field("gone", &self.gone().len())
            .finish()
    }
}

/// Checks engine record `r` (due or owed) and its members. Errors carry the
/// member's section B index when a member is at fault.
fn check_engine(
    frame: &FrameReader<'_>,
    r: &EngineRecord,
    cursor: &mut Cursor<'_>,
    first: u32,
) -> Result<(), (Option<u32>, &'static str)> {
    let engine = |what| (None, what);
    if r.tp_size == 0 {
        return Err(engine("tp_size 0"));
    }
    if cursor
        .take(r.engine_id_offset, r.engine_id_len)
        .map_err(engine)?
        .is_empty()
    {
        return Err(engine("empty engine id"));
    }
    if cursor
        .take(r.host_offset, r.host_len)
        .map_err(engine)?
        .is_empty()
    {
        return Err(engine("empty host"));
    }
    if r.flags & !FLAG_ALL_LEASED != 0 {
        return Err(engine("unknown flag bits"));
    }
    if r.first_member != first {
        return Err(engine("member range not right after the previous engine's"));
    }
    let end = match first.checked_add(r.member_count) {
        Some(end) if r.member_count > 0 && end <= frame.header.extras => end,
        _ => return Err(engine("member range empty or outside section B")),
    };
    let mut all_leased = true;
    for j in first..end {
        let member = |what| (Some(j), what);
        let m: MemberRecord = frame.extra(j);
        if m.reserved != [0; 6] {
            return Err(member("member reserved bytes not 0"));
        }
        if m.nonce == 0 && m.slot != NO_SLOT {
            return Err(member("member slot without a nonce"));
        }
        all_leased &= m.nonce != 0;
        let id = cursor
            .take(m.id_offset, m.id_len)
            .map_err(|_| member("member id out of order, outside the id area or not UTF-8"))?;
        if wire::check_heartbeat_id(id).is_err() {
            return Err(member("member id empty or with ','"));
        }
    }
    if all_leased != (r.flags & FLAG_ALL_LEASED != 0) {
        return Err(engine("all-leased flag disagrees with the members"));
    }
    Ok(())
}

#[cfg(test)]
mod tests;

mod engines;

pub use engines::{PlanEngine, PlanEngines, PlanMembers};
