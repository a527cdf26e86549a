//! Directives: what the P scheduler tells every P worker each step.
//!
//! The scheduler decides which lease gets which entry, slot and nonce; each
//! worker ([`crate::producer::PrefillRank`]) applies the directives to its
//! own slot array and timers in the step they arrive. One message carries
//! every directive of a step and goes, byte for byte the same, to every
//! worker of the engine (vLLM broadcasts its connector metadata the same way).
//!
//! # Record (section A, 40 bytes; no section B)
//!
//! ```text
//!  offset size field
//!       0    8 nonce              the lease's nonce, never 0
//!       8    8 lease_remaining_ns Grant: NOT_STARTED (u64::MAX) or the lease
//!                                 left at encoding; Start: the lease left
//!      16    8 hold_remaining_ns  renewals never push the expiry past this
//!                                 much from now; NO_HOLD (u64::MAX): no ceiling
//!      24    4 entry              the lease's entry, the same on every rank
//!      28    4 slot               its lease slot, or NO_SLOT (u32::MAX)
//!      32    4 id_offset          Grant: the request id in the id area
//!      36    2 id_len             (0 for Start and Cancel)
//!      38    1 op                 1 Grant, 2 Start, 3 Cancel
//!      39    1 reserved           0
//! ```
//!
//! - **Grant**: index `request_id` at `entry`, write `nonce` into `slot` (if
//!   any). With a remaining lease the lease starts now; with NOT_STARTED the
//!   blocks are pinned for a prefill still running and a Start follows.
//! - **Start**: the prefill finished; the lease runs for the remaining time.
//! - **Cancel**: release now (request aborted, engine shutting down).
//!
//! A directive names its lease by (entry, nonce) so that a worker can tell a
//! late or repeated directive from one for the lease now in that entry.

use core::time::Duration;

use bytemuck::{Pod, Zeroable};

use super::{FrameReader, FrameWriter, IpcError, MsgKind, FROM_SCHEDULER};
use crate::nonce::Nonce;
use crate::time::duration_nanos;

/// `lease_remaining_ns` of a Grant whose lease has not started.
pub const NOT_STARTED: u64 = u64::MAX;
/// `hold_remaining_ns` of a lease with no renewal ceiling.
pub const NO_HOLD: u64 = u64::MAX;
/// `slot` of a lease granted without one.
pub const NO_SLOT: u32 = u32::MAX;

/// What a directive asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DirectiveOp {
    /// A new lease: index the id, publish the nonce, maybe start the timer.
    Grant,
    /// Start the timer of a granted lease (its prefill finished).
    Start,
    /// Release the lease now.
    Cancel,
}

impl DirectiveOp {
    const fn code(self) -> u8 {
        match self {
            DirectiveOp::Grant => 1,
            DirectiveOp::Start => 2,
            DirectiveOp::Cancel => 3,
        }
    }

    const fn from_code(c: u8) -> Option<DirectiveOp> {
        match c {
            1 => Some(DirectiveOp::Grant),
            2 => Some(DirectiveOp::Start),
            3 => Some(DirectiveOp::Cancel),
            _ => None,
        }
    }
}

/// One directive, decoded (borrowing its id from the message) or about to be
/// encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Directive<'a> {
    /// What to do.
    pub op: DirectiveOp,
    /// The lease's entry (the same index on the scheduler and every rank).
    pub entry: u32,
    /// Grant: the lease slot to publish the nonce into, if it has one.
    pub slot: Option<u32>,
    /// The lease's nonce.
    pub nonce: Nonce,
    /// Grant and Start: how long the lease has left, counted from when the
    /// receiver applies it. `None` on a Grant: not started yet.
    pub lease_remaining: Option<Duration>,
    /// The renewal ceiling, counted from when the receiver applies it.
    pub hold_remaining: Option<Duration>,
    /// Grant: the request id (P's `request_id`, what heartbeats name).
    /// Empty for Start and Cancel.
    pub request_id: &'a str,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
struct Record {
    nonce: u64,
    lease_remaining_ns: u64,
    hold_remaining_ns: u64,
    entry: u32,
    slot: u32,
    id_offset: u32,
    id_len: u16,
    op: u8,
    reserved: u8,
}

/// Bytes of one record.
pub const RECORD_LEN: usize = core::mem::size_of::<Record>();
const _: () = assert!(RECORD_LEN == 40);

/// Bytes the message carrying `directives` takes.
pub fn encoded_len<'d>(directives: impl IntoIterator<Item = Directive<'d>>) -> usize {
    let (n, ids) = directives
        .into_iter()
        .fold((0usize, 0usize), |(n, ids), d| {
            (n + 1, ids + d.request_id.len())
        });
    super::frame::frame_len(
        u32::try_from(n).unwrap_or(u32::MAX),
        RECORD_LEN,
        0,
        0,
        u32::try_from(ids).unwrap_or(u32::MAX),
    )
}

/// Encodes `directives` as message number `seq` into `buf`; returns its
/// length. [`IpcError::BufferTooSmall`] when it does not fit (nothing is
/// written); [`IpcError::BadRecord`] for a request id longer than 65,535
/// bytes (the scheduler never holds one).
pub fn encode<'d, I>(buf: &mut [u8], seq: u32, directives: I) -> Result<usize, IpcError>
where
    I: IntoIterator<Item = Directive<'d>>,
    I::IntoIter: Clone,
{
    let it = directives.into_iter();
    let (mut n, mut ids) = (0u32, 0u32);
    for (i, d) in it.clone().enumerate() {
        if d.request_id.len() > usize::from(u16::MAX) {
            return Err(IpcError::BadRecord {
                index: i as u32,
                what: "request id longer than 65535 bytes",
            });
        }
        n = n.saturating_add(1);
        ids = ids.saturating_add(d.request_id.len() as u32);
    }
    let mut w = FrameWriter::new(
        buf,
        MsgKind::Directives,
        FROM_SCHEDULER,
        seq,
        n,
        RECORD_LEN,
        0,
        0,
        ids,
    )?;
    for d in it {
        let (id_offset, id_len) = w.id(d.request_id.as_bytes());
        w.record(&Record {
            nonce: d.nonce.get(),
            lease_remaining_ns: d
                .lease_remaining
                .map_or(NOT_STARTED, |r| duration_nanos(r).min(NOT_STARTED - 1)),
            hold_remaining_ns: d
                .hold_remaining
                .map_or(NO_HOLD, |r| duration_nanos(r).min(NO_HOLD - 1)),
            entry: d.entry,
            slot: d.slot.unwrap_or(NO_SLOT),
            id_offset,
            id_len: id_len as u16,
            op: d.op.code(),
            reserved: 0,
        });
    }
    Ok(w.finish())
}

/// A received directive message, checked record by record.
#[derive(Clone, Copy, Debug)]
pub struct DirectiveMsg<'a> {
    frame: FrameReader<'a>,
}

impl<'a> DirectiveMsg<'a> {
    /// Checks the frame and every record: op known, nonce non-zero, reserved
    /// byte 0, a Grant's id non-empty, inside the id area and UTF-8, ids back
    /// to back and covering the id area, a Start's remaining lease present,
    /// no slot on anything but a Grant.
    pub fn decode(bytes: &'a [u8]) -> Result<DirectiveMsg<'a>, IpcError> {
        let frame = FrameReader::parse(bytes, MsgKind::Directives, RECORD_LEN, 0)?;
        if frame.header.from != FROM_SCHEDULER {
            return Err(IpcError::WrongSender {
                expected: FROM_SCHEDULER,
                found: frame.header.from,
            });
        }
        let msg = DirectiveMsg { frame };
        // Ids lie back to back in record order and fill the id area: the
        // one layout the encoder writes, so decoding and re-encoding agree.
        let mut at = 0u64;
        for index in 0..frame.header.records {
            let r: Record = frame.record(index);
            let bad = |what| IpcError::BadRecord { index, what };
            if r.reserved != 0 {
                return Err(bad("reserved byte not 0"));
            }
            if u64::from(r.id_offset) != at {
                return Err(bad("id not where the previous one ended"));
            }
            at += u64::from(r.id_len);
            msg.check(index).map_err(bad)?;
        }
        if at != u64::from(frame.header.ids_len) {
            return Err(IpcError::BadRecord {
                index: frame.header.records,
                what: "id area bytes no record refers to",
            });
        }
        Ok(msg)
    }

    fn check(&self, i: u32) -> Result<Directive<'a>, &'static str> {
        let r: Record = self.frame.record(i);
        let op = DirectiveOp::from_code(r.op).ok_or("unknown directive op")?;
        let nonce = Nonce::new(r.nonce).ok_or("zero nonce")?;
        let request_id = self
            .frame
            .id(r.id_offset, u32::from(r.id_len))
            .ok_or("request id outside the id area or not UTF-8")?;
        let lease_remaining = (r.lease_remaining_ns != NOT_STARTED)
            .then(|| Duration::from_nanos(r.lease_remaining_ns));
        match op {
            DirectiveOp::Grant if request_id.is_empty() => {
                return Err("grant without a request id")
            }
            DirectiveOp::Start if lease_remaining.is_none() => {
                return Err("start without a remaining lease")
            }
            DirectiveOp::Start | DirectiveOp::Cancel if r.slot != NO_SLOT => {
                return Err("slot on a directive that is not a grant")
            }
            _ => {}
        }
        Ok(Directive {
            op,
            entry: r.entry,
            slot: (r.slot != NO_SLOT).then_some(r.slot),
            nonce,
            lease_remaining,
            hold_remaining: (r.hold_remaining_ns != NO_HOLD)
                .then(|| Duration::from_nanos(r.hold_remaining_ns)),
            request_id,
        })
    }

    header_accessors!("scheduler", "Directives", "directive");

    /// The directives, in the order the scheduler issued them.
    pub fn iter(&self) -> Directives<'a> {
        Directives {
            msg: *self,
            next: 0,
        }
    }
}

/// The directives of a [`DirectiveMsg`], in order.
#[derive(Clone, Debug)]
pub struct Directives<'a> {
    msg: DirectiveMsg<'a>,
    next: u32,
}

impl<'a> Iterator for Directives<'a> {
    type Item = Directive<'a>;

    fn next(&mut self) -> Option<Directive<'a>> {
        while self.next < self.msg.len() {
            let i = self.next;
            self.next += 1;
            // decode() checked every record, so this cannot fail; were it
            // to, the record is skipped rather than panicking.
            if let Ok(d) = self.msg.check(i) {
                return Some(d);
            }
        }
        None
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = (self.msg.len() - self.next) as usize;
        (left, Some(left))
    }
}

impl ExactSizeIterator for Directives<'_> {}

#[cfg(test)]
mod tests {
    use super::*;

    fn nonce(n: u64) -> Nonce {
        Nonce::new(n).unwrap()
    }

    fn sample() -> [Directive<'static>; 3] {
        [
            Directive {
                op: DirectiveOp::Grant,
                entry: 7,
                slot: Some(7),
                nonce: nonce(0xAB),
                lease_remaining: None,
                hold_remaining: Some(Duration::from_secs(45)),
                request_id: "cmpl-1",
            },
            Directive {
                op: DirectiveOp::Start,
                entry: 7,
                slot: None,
                nonce: nonce(0xAB),
                lease_remaining: Some(Duration::from_millis(29_990)),
                hold_remaining: None,
                request_id: "",
            },
            Directive {
                op: DirectiveOp::Cancel,
                entry: 900,
                slot: None,
                nonce: nonce(3),
                lease_remaining: None,
                hold_remaining: None,
                request_id: "",
            },
        ]
    }

    #[test]
    fn round_trip() {
        let ds = sample();
        let mut buf = vec![0u8; encoded_len(ds)];
        let n = encode(&mut buf, 41, ds).unwrap();
        assert_eq!(n, 32 + 3 * 40 + 6);
        let msg = DirectiveMsg::decode(&buf[..n]).unwrap();
        assert_eq!(msg.seq(), 41);
        assert_eq!(msg.iter().len(), 3);
        assert_eq!(msg.iter().collect::<Vec<_>>(), ds);
    }

    #[test]
    fn bad_records_are_refused_by_index() {
        let ds = sample();
        let mut buf = vec![0u8; encoded_len(ds)];
        let n = encode(&mut buf, 1, ds).unwrap();
        let rec = |i: usize, field: usize| 32 + i * 40 + field;
        let cases: [(usize, u8, &str); 4] = [
            (rec(0, 38), 9, "unknown directive op"),
            (rec(2, 38), 1, "grant without a request id"),
            (rec(1, 28), 0, "slot on a directive that is not a grant"),
            (
                rec(0, 36),
                0xFF,
                "request id outside the id area or not UTF-8",
            ),
        ];
        for (at, byte, what) in cases {
            let mut bad = buf[..n].to_vec();
            bad[at] = byte;
            match DirectiveMsg::decode(&bad) {
                Err(IpcError::BadRecord { what: w, .. }) => assert_eq!(w, what),
                other => panic!("{what}: {other:?}"),
            }
        }
        let mut zero = buf[..n].to_vec();
        zero[rec(1, 0)..rec(1, 8)].fill(0);
        assert_eq!(
            DirectiveMsg::decode(&zero).map(|_| ()),
            Err(IpcError::BadRecord {
                index: 1,
                what: "zero nonce"
            })
        );
        let mut from_rank = buf[..n].to_vec();
        from_rank[8..12].copy_from_slice(&0u32.to_le_bytes());
        assert!(matches!(
            DirectiveMsg::decode(&from_rank),
            Err(IpcError::WrongSender { .. })
        ));
    }

    /// Found by the `role_messages` fuzz target: a frame whose id area holds
    /// bytes no record names decoded, and re-encoded to other bytes. One
    /// message, one encoding: refused.
    #[test]
    fn id_area_bytes_no_record_names_are_refused() {
        let ds = sample();
        let mut buf = vec![0u8; encoded_len(ds)];
        let n = encode(&mut buf, 1, ds).unwrap();
        let mut longer = buf[..n].to_vec();
        longer.push(b'x');
        longer[24..28].copy_from_slice(&(6u32 + 1).to_le_bytes());
        assert_eq!(
            DirectiveMsg::decode(&longer).map(|_| ()),
            Err(IpcError::BadRecord {
                index: 3,
                what: "id area bytes no record refers to"
            })
        );
        let mut moved = buf[..n].to_vec();
        moved[32 + 32..32 + 36].copy_from_slice(&1u32.to_le_bytes());
        assert!(matches!(
            DirectiveMsg::decode(&moved),
            Err(IpcError::BadRecord { index: 0, .. })
        ));
        let mut reserved = buf[..n].to_vec();
        reserved[28] = 1;
        assert_eq!(
            DirectiveMsg::decode(&reserved).map(|_| ()),
            Err(IpcError::Header {
                what: "reserved header field not 0"
            })
        );
        let mut extras = buf[..n].to_vec();
        extras[20] = 1;
        assert_eq!(
            DirectiveMsg::decode(&extras).map(|_| ()),
            Err(IpcError::Header {
                what: "section B records in a message kind that has none"
            })
        );
    }
}
