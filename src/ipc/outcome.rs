//! Verify outcomes: what one D worker tells the D scheduler each step.
//!
//! After a request's block READs, each worker's
//! [`LeaseVerifier`](crate::consumer::LeaseVerifier) checks the lease slots
//! and reaches a [`Verdict`]; the worker reports it here, by D-side request
//! id, together with the P engines it still owes a heartbeat (see
//! [`crate::consumer::HeartbeatSender::owed_engines`]). The scheduler applies
//! the message with [`crate::consumer::HeartbeatTracker::apply_outcomes`]:
//! once every worker verified a request it is received (the transfer is
//! complete, heartbeats stop); any other verdict fails the KV load at once
//! (`kv_load_failure_policy`). This module owns the bytes only.
//!
//! # Section A: outcome records (16 bytes each)
//!
//! ```text
//!  offset size field
//!       0    4 id_offset  the D-side request id in the id area
//!       4    2 id_len     non-empty
//!       6    1 verdict    1 verified, 2 lapsed, 3 unverifiable,
//!                         4 slot out of range, 5 read failed,
//!                         6 unchecked (verification off)
//!       7    1 error      read failed: the FabricError (below), else 0
//!       8    4 backend    error 12: the backend's status code (i32), else 0
//!      12    4 reserved   0
//! ```
//!
//! FabricError codes: 1 unknown agent, 2 not connected, 3 bad address,
//! 4 peer unreachable, 5 timed out, 6 out of bounds, 7 unknown region,
//! 8 unknown transfer, 9 message too large, 10 full, 11 cancelled,
//! 12 backend, 13 unsupported. The numbers are on the wire: never reuse one.
//!
//! # Section B: owed engines (8 bytes each)
//!
//! ```text
//!  offset size field
//!       0    4 index       } the engine's EngineHandle in the scheduler's tracker
//!       4    4 generation  }
//! ```
//!
//! The header's `from` is the worker's rank. Ids lie back to back in record
//! order and fill the id area; any other arrangement is refused, so a
//! decoded message re-encodes to the very same bytes
//! (`fuzz/fuzz_targets/verify_outcomes.rs` checks it).

use core::fmt;

use bytemuck::{Pod, Zeroable};

use super::{FrameReader, FrameWriter, IpcError, MsgKind};
use crate::fabric::FabricError;
use crate::remote_engine::EngineHandle;
use crate::verdict::Verdict;

/// One request's verdict from one worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Outcome<'a> {
    /// The D-side request id (what the tracker tracks it by).
    pub request_id: &'a str,
    /// What that worker's verifier found.
    pub verdict: Verdict,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
struct Record {
    id_offset: u32,
    id_len: u16,
    verdict: u8,
    error: u8,
    backend: i32,
    reserved: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
struct OwedRecord {
    index: u32,
    generation: u32,
}

/// Bytes of one outcome record (section A).
pub const RECORD_LEN: usize = core::mem::size_of::<Record>();
/// Bytes of one owed-engine record (section B).
pub const OWED_RECORD_LEN: usize = core::mem::size_of::<OwedRecord>();
const _: () = assert!(RECORD_LEN == 16 && OWED_RECORD_LEN == 8);

/// (verdict, error, backend) codes of a verdict.
fn verdict_code(v: Verdict) -> (u8, u8, i32) {
    match v {
        Verdict::Verified => (1, 0, 0),
        Verdict::Lapsed => (2, 0, 0),
        Verdict::Unverifiable => (3, 0, 0),
        Verdict::SlotOutOfRange => (4, 0, 0),
        Verdict::ReadFailed(e) => {
            let (code, backend) = e.code();
            (5, code, backend)
        }
        Verdict::Unchecked => (6, 0, 0),
    }
}

fn verdict_from(r: &Record) -> Result<Verdict, &'static str> {
    let plain = |v| {
        if r.error == 0 && r.backend == 0 {
            Ok(v)
        } else {
            Err("error code on a verdict that is not a failed read")
        }
    };
    match r.verdict {
        1 => plain(Verdict::Verified),
        2 => plain(Verdict::Lapsed),
        3 => plain(Verdict::Unverifiable),
        4 => plain(Verdict::SlotOutOfRange),
        5 => match FabricError::from_code(r.error, r.backend) {
            Some(e) => Ok(Verdict::ReadFailed(e)),
            None if FabricError::from_code(r.error, 0).is_some() => {
                Err("backend status on a fabric error that is not a backend one")
            }
            None => Err("unknown fabric error code"),
        },
        6 => plain(Verdict::Unchecked),
        _ => Err("unknown verdict"),
    }
}

/// Bytes the message carrying `outcomes` and `owed` owed engines takes.
pub fn encoded_len<'o>(outcomes: impl IntoIterator<Item = Outcome<'o>>, owed: u32) -> usize {
    let (n, ids) = outcomes.into_iter().fold((0u64, 0u64), |(n, ids), o| {
        (n + 1, ids + o.request_id.len() as u64)
    });
    let clamp = |x: u64| u32::try_from(x).unwrap_or(u32::MAX);
    super::frame::frame_len(clamp(n), RECORD_LEN, owed, OWED_RECORD_LEN, clamp(ids))
}

/// Encodes the `outcomes` and `owed` engines of worker `rank` as its message
/// number `seq` into `buf`; returns the length. [`IpcError::BufferTooSmall`]
/// when it does not fit (nothing written); [`IpcError::BadRecord`] (by
/// outcome index) for an empty request id or one longer than 65,535 bytes.
pub fn encode<'o, I, J>(
    buf: &mut [u8],
    rank: u32,
    seq: u32,
    outcomes: I,
    owed: J,
) -> Result<usize, IpcError>
where
    I: IntoIterator<Item = Outcome<'o>>,
    I::IntoIter: Clone,
    J: IntoIterator<Item = EngineHandle>,
    J::IntoIter: Clone,
{
    let outcomes = outcomes.into_iter();
    let owed = owed.into_iter();
    let (mut n, mut ids) = (0u32, 0u32);
    for (i, o) in outcomes.clone().enumerate() {
        if o.request_id.is_empty() || o.request_id.len() > usize::from(u16::MAX) {
            return Err(IpcError::BadRecord {
                index: u32::try_from(i).unwrap_or(u32::MAX),
                what: "request id empty or longer than 65535 bytes",
            });
        }
        n = n.saturating_add(1);
        ids = ids.saturating_add(o.request_id.len() as u32);
    }
    let m = u32::try_from(owed.clone().count()).unwrap_or(u32::MAX);
    let mut w = FrameWriter::new(
        buf,
        MsgKind::VerifyOutcomes,
        rank,
        seq,
        n,
        RECORD_LEN,
        m,
        OWED_RECORD_LEN,
        ids,
    )?;
    for o in outcomes {
        let (id_offset, id_len) = w.id(o.request_id.as_bytes());
        let (verdict, error, backend) = verdict_code(o.verdict);
        w.record(&Record {
            id_offset,
            id_len: id_len as u16,
            verdict,
            error,
            backend,
            reserved: 0,
        });
    }
    for h in owed {
        w.extra(&OwedRecord {
            index: h.index,
            generation: h.generation,
        });
    }
    Ok(w.finish())
}

/// A received outcome message, checked in full.
#[derive(Clone, Copy)]
pub struct OutcomeMsg<'a> {
    frame: FrameReader<'a>,
    /// The id area (valid UTF-8 once decoded).
    ids: &'a str,
}

impl<'a> OutcomeMsg<'a> {
    /// Checks the frame and every record: verdict and error codes known and
    /// consistent, reserved bytes 0, ids non-empty, back to back, UTF-8 and
    /// covering the id area. A refused record is [`IpcError::BadRecord`]
    /// with its index.
    pub fn decode(bytes: &'a [u8]) -> Result<OutcomeMsg<'a>, IpcError> {
        let frame =
            FrameReader::parse(bytes, MsgKind::VerifyOutcomes, RECORD_LEN, OWED_RECORD_LEN)?;
        let area = &bytes[bytes.len() - frame.header.ids_len as usize..];
        // An invalid byte fails the id that covers it (ids tile the area).
        let ids = match core::str::from_utf8(area) {
            Ok(s) => s,
            Err(e) => core::str::from_utf8(&area[..e.valid_up_to()]).unwrap_or_default(),
        };
        let mut at = 0u64;
        for index in 0..frame.header.records {
            let r: Record = frame.record(index);
            let bad = |what| IpcError::BadRecord { index, what };
            if r.reserved != 0 {
                return Err(bad("reserved bytes not 0"));
            }
            verdict_from(&r).map_err(bad)?;
            if u64::from(r.id_offset) != at {
                return Err(bad("id not where the previous one ended"));
            }
            let start = r.id_offset as usize;
            match ids.get(start..start + usize::from(r.id_len)) {
                Some(id) if !id.is_empty() => {}
                Some(_) => return Err(bad("empty request id")),
                None => return Err(bad("request id outside the id area or not UTF-8")),
            }
            at += u64::from(r.id_len);
        }
        if at != u64::from(frame.header.ids_len) {
            return Err(IpcError::BadRecord {
                index: frame.header.records,
                what: "id area bytes no record refers to",
            });
        }
        Ok(OutcomeMsg { frame, ids })
    }

    // A message with no outcome may still carry owed engines.
    header_accessors!(rank: "worker", "Outcomes", "outcome");

    /// The outcomes, in the worker's order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = Outcome<'a>> + Clone + 'a {
        let msg = *self;
        (0..self.len()).map(move |i| msg.outcome(i))
    }

    /// The engines the worker still owes a heartbeat.
    pub fn owed(&self) -> impl ExactSizeIterator<Item = EngineHandle> + Clone + 'a {
        let frame = self.frame;
        (0..frame.header.extras).map(move |j| {
            let r: OwedRecord = frame.extra(j);
            EngineHandle {
                index: r.index,
                generation: r.generation,
            }
        })
    }

    /// Outcome `i`. `decode` checked every record, so the fallbacks (an
    /// empty id, a read failure) are unreachable; were one reached, it would
    /// fail the load rather than pass it.
    fn outcome(&self, i: u32) -> Outcome<'a> {
        let r: Record = self.frame.record(i);
        let start = r.id_offset as usize;
        Outcome {
            request_id: self
                .ids
                .get(start..start + usize::from(r.id_len))
                .unwrap_or_default(),
            verdict: verdict_from(&r).unwrap_or(Verdict::ReadFailed(FabricError::Backend(-1))),
        }
    }
}

impl fmt::Debug for OutcomeMsg<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutcomeMsg")
            .field("rank", &self.rank())
            .field("seq", &self.seq())
            .field("outcomes", &self.len())
            .field("owed", &self.frame.header.extras)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> [Outcome<'static>; 4] {
        [
            Outcome {
                request_id: "cmpl-1",
                verdict: Verdict::Verified,
            },
            Outcome {
                request_id: "cmpl-2",
                verdict: Verdict::ReadFailed(FabricError::Backend(-7)),
            },
            Outcome {
                request_id: "ü",
                verdict: Verdict::SlotOutOfRange,
            },
            Outcome {
                request_id: "x",
                verdict: Verdict::ReadFailed(FabricError::TimedOut),
            },
        ]
    }

    const OWED: [EngineHandle; 2] = [
        EngineHandle {
            index: 1,
            generation: 4,
        },
        EngineHandle {
            index: 0,
            generation: u32::MAX,
        },
    ];

    fn bytes() -> Vec<u8> {
        let mut buf = vec![0u8; encoded_len(sample(), 2)];
        let n = encode(&mut buf, 3, 17, sample(), OWED).unwrap();
        assert_eq!(n, buf.len());
        buf
    }

    #[test]
    fn round_trip() {
        let b = bytes();
        assert_eq!(b.len(), 32 + 4 * 16 + 2 * 8 + 6 + 6 + 2 + 1);
        let msg = OutcomeMsg::decode(&b).unwrap();
        assert_eq!((msg.rank(), msg.seq(), msg.len()), (3, 17, 4));
        assert_eq!(msg.iter().collect::<Vec<_>>(), sample());
        assert_eq!(msg.owed().collect::<Vec<_>>(), OWED);
        let mut again = vec![0u8; b.len()];
        let n = encode(&mut again, msg.rank(), msg.seq(), msg.iter(), msg.owed()).unwrap();
        assert_eq!(&again[..n], &b[..]);
        // Every verdict and every fabric error survives the trip.
        let errors = FabricError::EXAMPLES;
        let all: Vec<Outcome<'_>> = [Verdict::Verified, Verdict::Lapsed, Verdict::Unverifiable]
            .into_iter()
            .chain([Verdict::SlotOutOfRange])
            .chain(errors.map(Verdict::ReadFailed))
            .map(|verdict| Outcome {
                request_id: "r",
                verdict,
            })
            .collect();
        let mut buf = vec![0u8; encoded_len(all.iter().copied(), 0)];
        encode(&mut buf, 0, 0, all.iter().copied(), []).unwrap();
        let msg = OutcomeMsg::decode(&buf).unwrap();
        assert_eq!(msg.iter().collect::<Vec<_>>(), all);
    }

    #[test]
    fn bad_records_are_refused_by_index() {
        let b = bytes();
        let rec = |i: usize, field: usize| 32 + i * 16 + field;
        let cases: [(usize, &[u8], u32, &str); 8] = [
            (rec(0, 6), &[0], 0, "unknown verdict"),
            (rec(1, 7), &[14], 1, "unknown fabric error code"),
            (
                rec(0, 7),
                &[4],
                0,
                "error code on a verdict that is not a failed read",
            ),
            (
                rec(3, 8),
                &[1, 0, 0, 0],
                3,
                "backend status on a fabric error that is not a backend one",
            ),
            (rec(2, 12), &[1], 2, "reserved bytes not 0"),
            (rec(1, 0), &[7], 1, "id not where the previous one ended"),
            (rec(3, 4), &[0, 0], 3, "empty request id"),
            (
                rec(2, 4),
                &[1, 0],
                2,
                "request id outside the id area or not UTF-8",
            ),
        ];
        for (at, patch, index, what) in cases {
            let mut bad = b.clone();
            bad[at..at + patch.len()].copy_from_slice(patch);
            assert_eq!(
                OutcomeMsg::decode(&bad).map(|_| ()),
                Err(IpcError::BadRecord { index, what }),
                "{what}"
            );
        }
        // The last id byte becomes a lone UTF-8 lead byte.
        let mut bad = b.clone();
        let last = bad.len() - 1;
        bad[last] = 0xC3;
        assert_eq!(
            OutcomeMsg::decode(&bad).map(|_| ()),
            Err(IpcError::BadRecord {
                index: 3,
                what: "request id outside the id area or not UTF-8"
            })
        );
        // Refusals from the encoder: an empty id, a buffer too small.
        let empty = [Outcome {
            request_id: "",
            verdict: Verdict::Verified,
        }];
        assert_eq!(
            encode(&mut [0u8; 64], 0, 0, empty, []),
            Err(IpcError::BadRecord {
                index: 0,
                what: "request id empty or longer than 65535 bytes"
            })
        );
        assert_eq!(
            encode(&mut [0u8; 40], 0, 0, sample(), []),
            Err(IpcError::BufferTooSmall {
                needed: encoded_len(sample(), 0)
            })
        );
        // A plan is not an outcome message.
        let mut plan = b.clone();
        plan[6] = MsgKind::HeartbeatPlan.code() as u8;
        assert!(matches!(
            OutcomeMsg::decode(&plan),
            Err(IpcError::WrongKind { .. })
        ));
    }
}
