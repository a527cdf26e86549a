//! Rank reports: what one P worker tells the P scheduler each step.
//!
//! A worker releases its share of a lease on its own (its readers are done,
//! its timer expired, or the scheduler cancelled it), zeroes its lease slot,
//! and only then reports the release here. The scheduler frees the blocks once
//! every rank has reported (see [`crate::producer::PrefillScheduler`]).
//!
//! # Record (section A, 16 bytes; no section B, no ids)
//!
//! ```text
//!  offset size field
//!       0    8 nonce   the lease's nonce (names the lease, with the entry)
//!       8    4 entry   the lease's entry
//!      12    1 reason  1 read done, 2 expired, 3 cancelled, 4 not held (the
//!                        rank never held the lease: a missed or refused Grant)
//!      13    3 reserved 0
//! ```
//!
//! The header's `from` is the reporting rank; the scheduler checks it
//! against the rank the engine says the message came from.

use bytemuck::{Pod, Zeroable};

use super::{FrameReader, FrameWriter, IpcError, MsgKind};
use crate::nonce::Nonce;
use crate::release_reason::ReleaseReason;

/// One rank's release of one lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankReport {
    /// The lease's entry.
    pub entry: u32,
    /// The lease's nonce.
    pub nonce: Nonce,
    /// Why this rank released it.
    pub reason: ReleaseReason,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
struct Record {
    nonce: u64,
    entry: u32,
    reason: u8,
    reserved: [u8; 3],
}

/// Bytes of one record.
pub const RECORD_LEN: usize = core::mem::size_of::<Record>();
const _: () = assert!(RECORD_LEN == 16);

fn reason_code(r: ReleaseReason) -> u8 {
    match r {
        ReleaseReason::ReadDone => 1,
        ReleaseReason::Expired => 2,
        ReleaseReason::Cancelled => 3,
        ReleaseReason::NotHeld => 4,
    }
}

fn reason_from(c: u8) -> Option<ReleaseReason> {
    match c {
        1 => Some(ReleaseReason::ReadDone),
        2 => Some(ReleaseReason::Expired),
        3 => Some(ReleaseReason::Cancelled),
        4 => Some(ReleaseReason::NotHeld),
        _ => None,
    }
}

/// Bytes of a message carrying `n` reports.
pub fn encoded_len(n: u32) -> usize {
    super::frame::frame_len(n, RECORD_LEN, 0, 0, 0)
}

/// Encodes `reports` from rank `rank` as message number `seq` into `buf`;
/// returns its length, or [`IpcError::BufferTooSmall`] (nothing written).
pub fn encode<I>(buf: &mut [u8], rank: u32, seq: u32, reports: I) -> Result<usize, IpcError>
where
    I: IntoIterator<Item = RankReport>,
    I::IntoIter: ExactSizeIterator,
{
    let it = reports.into_iter();
    let n = u32::try_from(it.len()).unwrap_or(u32::MAX);
    let mut w = FrameWriter::new(buf, MsgKind::RankReports, rank, seq, n, RECORD_LEN, 0, 0, 0)?;
    for r in it.take(n as usize) {
        w.record(&Record {
            nonce: r.nonce.get(),
            entry: r.entry,
            reason: reason_code(r.reason),
            reserved: [0; 3],
        });
    }
    Ok(w.finish())
}

/// A received report message, checked record by record.
#[derive(Clone, Copy, Debug)]
pub struct ReportMsg<'a> {
    frame: FrameReader<'a>,
}

impl<'a> ReportMsg<'a> {
    /// Checks the frame and every record (reason known, nonce non-zero,
    /// reserved bytes 0; no id area).
    pub fn decode(bytes: &'a [u8]) -> Result<ReportMsg<'a>, IpcError> {
        let frame = FrameReader::parse(bytes, MsgKind::RankReports, RECORD_LEN, 0)?;
        if frame.header.ids_len != 0 {
            return Err(IpcError::BadRecord {
                index: frame.header.records,
                what: "id area bytes no record refers to",
            });
        }
        let msg = ReportMsg { frame };
        for index in 0..frame.header.records {
            let r: Record = frame.record(index);
            if r.reserved != [0; 3] {
                return Err(IpcError::BadRecord {
                    index,
                    what: "reserved bytes not 0",
                });
            }
            msg.check(index)
                .map_err(|what| IpcError::BadRecord { index, what })?;
        }
        Ok(msg)
    }

    fn check(&self, i: u32) -> Result<RankReport, &'static str> {
        let r: Record = self.frame.record(i);
        Ok(RankReport {
            entry: r.entry,
            nonce: Nonce::new(r.nonce).ok_or("zero nonce")?,
            reason: reason_from(r.reason).ok_or("unknown release reason")?,
        })
    }

    header_accessors!(rank: "rank", "Reports", "report");

    /// The reports, in the order the rank released the leases.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = RankReport> + 'a {
        let msg = *self;
        // decode() checked every record; a failure here would be a bug,
        // answered with a cancelled placeholder the scheduler counts as stale.
        (0..self.len()).map(move |i| {
            msg.check(i).unwrap_or(RankReport {
                entry: u32::MAX,
                nonce: Nonce::ONE,
                reason: ReleaseReason::Cancelled,
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_refusals() {
        let reports = [
            RankReport {
                entry: 3,
                nonce: Nonce::new(77).unwrap(),
                reason: ReleaseReason::Expired,
            },
            RankReport {
                entry: 0,
                nonce: Nonce::new(u64::MAX).unwrap(),
                reason: ReleaseReason::ReadDone,
            },
        ];
        let mut buf = [0u8; 64];
        let n = encode(&mut buf, 1, 5, reports).unwrap();
        assert_eq!(n, encoded_len(2));
        let msg = ReportMsg::decode(&buf[..n]).unwrap();
        assert_eq!((msg.rank(), msg.seq(), msg.len()), (1, 5, 2));
        assert_eq!(msg.iter().collect::<Vec<_>>(), reports);

        let mut bad = buf[..n].to_vec();
        bad[32 + 12] = 0;
        assert_eq!(
            ReportMsg::decode(&bad).map(|_| ()),
            Err(IpcError::BadRecord {
                index: 0,
                what: "unknown release reason"
            })
        );
        assert_eq!(
            encode(&mut buf[..40], 1, 5, reports),
            Err(IpcError::BufferTooSmall { needed: 64 })
        );
    }
}
