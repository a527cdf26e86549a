//! The frame every role message shares: header, two record sections, id area.
//! The byte layout is drawn in the parent module's docs.
//!
//! This file owns only the frame: writing a header and appending records
//! and ids into a caller buffer, and checking a received frame's header and
//! length before any record is looked at. What a record means is the
//! business of the message modules beside it.

use bytemuck::{Pod, Zeroable};

use super::{IpcError, MsgKind};

/// The four bytes every role message starts with.
pub const FRAME_MAGIC: [u8; 4] = *b"KVLR";
/// The frame version this build writes and accepts.
pub const FRAME_VERSION: u16 = 1;
/// Bytes of the frame header.
pub const FRAME_HEADER_LEN: usize = core::mem::size_of::<FrameHeader>();
/// The `from` of a message a scheduler sent.
pub const FROM_SCHEDULER: u32 = u32::MAX;

/// The frame header, as it lies in the first 32 bytes (little-endian).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct FrameHeader {
    /// [`FRAME_MAGIC`].
    pub magic: [u8; 4],
    /// [`FRAME_VERSION`].
    pub version: u16,
    /// [`MsgKind::code`].
    pub kind: u16,
    /// The sender's rank, or [`FROM_SCHEDULER`].
    pub from: u32,
    /// The sender's message counter for this kind.
    pub seq: u32,
    /// Section A records.
    pub records: u32,
    /// Section B records.
    pub extras: u32,
    /// Bytes in the id area.
    pub ids_len: u32,
    /// Zero.
    pub reserved: u32,
}

const _: () = assert!(FRAME_HEADER_LEN == 32);

/// Bytes a frame with these counts takes (saturating: a count no buffer can
/// hold yields a size no buffer has).
pub(crate) fn frame_len(
    records: u32,
    rec_size: usize,
    extras: u32,
    ext_size: usize,
    ids_len: u32,
) -> usize {
    (records as usize)
        .saturating_mul(rec_size)
        .saturating_add((extras as usize).saturating_mul(ext_size))
        .saturating_add(ids_len as usize)
        .saturating_add(FRAME_HEADER_LEN)
}

/// Appends one message into a caller buffer. The counts are declared up
/// front (the id area follows the records, so its start must be known);
/// [`FrameWriter::finish`] checks in debug builds that exactly that many
/// records, extras and id bytes were written.
pub(crate) struct FrameWriter<'b> {
    buf: &'b mut [u8],
    rec_at: usize,
    rec_end: usize,
    ext_at: usize,
    ids_start: usize,
    ids_at: usize,
    end: usize,
}

impl<'b> FrameWriter<'b> {
    /// Writes the header into `buf` and returns a writer for the body, or
    /// [`IpcError::BufferTooSmall`] (nothing written) when `buf` cannot hold
    /// the whole message.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        buf: &'b mut [u8],
        kind: MsgKind,
        from: u32,
        seq: u32,
        records: u32,
        rec_size: usize,
        extras: u32,
        ext_size: usize,
        ids_len: u32,
    ) -> Result<FrameWriter<'b>, IpcError> {
        let needed = frame_len(records, rec_size, extras, ext_size, ids_len);
        if buf.len() < needed {
            return Err(IpcError::BufferTooSmall { needed });
        }
        let header = FrameHeader {
            magic: FRAME_MAGIC,
            version: FRAME_VERSION,
            kind: kind.code(),
            from,
            seq,
            records,
            extras,
            ids_len,
            reserved: 0,
        };
        buf[..FRAME_HEADER_LEN].copy_from_slice(bytemuck::bytes_of(&header));
        let rec_end = FRAME_HEADER_LEN + records as usize * rec_size;
        let ids_start = rec_end + extras as usize * ext_size;
        Ok(FrameWriter {
            buf,
            rec_at: FRAME_HEADER_LEN,
            rec_end,
            ext_at: rec_end,
            ids_start,
            ids_at: ids_start,
            end: needed,
        })
    }

    /// Appends a section A record.
    pub(crate) fn record<R: Pod>(&mut self, r: &R) {
        let bytes = bytemuck::bytes_of(r);
        let end = self.rec_at + bytes.len();
        debug_assert!(end <= self.rec_end, "more records than declared");
        if let Some(dst) = self.buf.get_mut(self.rec_at..end.min(self.rec_end)) {
            if dst.len() == bytes.len() {
                dst.copy_from_slice(bytes);
                self.rec_at = end;
            }
        }
    }

    /// Appends a section B record.
    #[allow(dead_code)] // section B carries the D side's heartbeat plan members
    pub(crate) fn extra<E: Pod>(&mut self, e: &E) {
        let bytes = bytemuck::bytes_of(e);
        let end = self.ext_at + bytes.len();
        debug_assert!(end <= self.ids_start, "more extras than declared");
        if let Some(dst) = self.buf.get_mut(self.ext_at..end.min(self.ids_start)) {
            if dst.len() == bytes.len() {
                dst.copy_from_slice(bytes);
                self.ext_at = end;
            }
        }
    }

    /// Appends `id` to the id area; returns its (offset, length) within it.
    pub(crate) fn id(&mut self, id: &[u8]) -> (u32, u32) {
        let off = self.ids_at - self.ids_start;
        let end = self.ids_at + id.len();
        debug_assert!(end <= self.end, "more id bytes than declared");
        if let Some(dst) = self.buf.get_mut(self.ids_at..end.min(self.end)) {
            if dst.len() == id.len() {
                dst.copy_from_slice(id);
                self.ids_at = end;
            }
        }
        (off as u32, id.len() as u32)
    }

    /// The message's length. Everything declared must have been written.
    pub(crate) fn finish(self) -> usize {
        debug_assert_eq!(self.rec_at, self.rec_end, "fewer records than declared");
        debug_assert_eq!(self.ext_at, self.ids_start, "fewer extras than declared");
        debug_assert_eq!(self.ids_at, self.end, "fewer id bytes than declared");
        self.end
    }
}

/// A received frame whose header and length have been checked.
#[derive(Clone, Copy, Debug)]
#[allow(dead_code)] // section B carries the D side's heartbeat plan members
pub(crate) struct FrameReader<'a> {
    pub(crate) header: FrameHeader,
    records: &'a [u8],
    extras: &'a [u8],
    ids: &'a [u8],
    rec_size: usize,
    ext_size: usize,
}

impl<'a> FrameReader<'a> {
    /// Checks magic, version, kind and length; splits the sections.
    pub(crate) fn parse(
        bytes: &'a [u8],
        kind: MsgKind,
        rec_size: usize,
        ext_size: usize,
    ) -> Result<FrameReader<'a>, IpcError> {
        let Some(head) = bytes.get(..FRAME_HEADER_LEN) else {
            return Err(IpcError::TooShort { len: bytes.len() });
        };
        let header: FrameHeader = bytemuck::pod_read_unaligned(head);
        if header.magic != FRAME_MAGIC {
            return Err(IpcError::BadMagic);
        }
        if header.version != FRAME_VERSION {
            return Err(IpcError::UnsupportedVersion {
                found: header.version,
            });
        }
        if header.kind != kind.code() {
            return Err(IpcError::WrongKind {
                expected: kind.code(),
                found: header.kind,
            });
        }
        // One encoding per message: a reader that accepted junk in reserved
        // or absent fields would let two different byte strings mean the same.
        if header.reserved != 0 {
            return Err(IpcError::Header {
                what: "reserved header field not 0",
            });
        }
        if ext_size == 0 && header.extras != 0 {
            return Err(IpcError::Header {
                what: "section B records in a message kind that has none",
            });
        }
        let records = (header.records as u64).saturating_mul(rec_size as u64);
        let extras = (header.extras as u64).saturating_mul(ext_size as u64);
        let expected = (FRAME_HEADER_LEN as u64)
            .saturating_add(records)
            .saturating_add(extras)
            .saturating_add(u64::from(header.ids_len));
        if expected != bytes.len() as u64 {
            return Err(IpcError::Length {
                expected,
                found: bytes.len(),
            });
        }
        // The length matched, so every section lies inside `bytes`.
        let rec_end = FRAME_HEADER_LEN + records as usize;
        let ext_end = rec_end + extras as usize;
        Ok(FrameReader {
            header,
            records: &bytes[FRAME_HEADER_LEN..rec_end],
            extras: &bytes[rec_end..ext_end],
            ids: &bytes[ext_end..],
            rec_size,
            ext_size,
        })
    }

    /// Section A record `i` (zeroed when out of range; callers stay in range).
    pub(crate) fn record<R: Pod>(&self, i: u32) -> R {
        debug_assert_eq!(core::mem::size_of::<R>(), self.rec_size);
        read_at(self.records, i, self.rec_size)
    }

    /// Section B record `i` (zeroed when out of range; callers stay in range).
    #[allow(dead_code)] // section B carries the D side's heartbeat plan members
    pub(crate) fn extra<E: Pod>(&self, i: u32) -> E {
        debug_assert_eq!(core::mem::size_of::<E>(), self.ext_size);
        read_at(self.extras, i, self.ext_size)
    }

    /// The id at (`offset`, `len`) of the id area, if it lies inside it and
    /// is UTF-8.
    pub(crate) fn id(&self, offset: u32, len: u32) -> Option<&'a str> {
        let start = offset as usize;
        let bytes = self.ids.get(start..start.checked_add(len as usize)?)?;
        core::str::from_utf8(bytes).ok()
    }
}

fn read_at<T: Pod>(section: &[u8], i: u32, size: usize) -> T {
    let start = i as usize * size;
    match section.get(start..start + size) {
        Some(b) if b.len() == core::mem::size_of::<T>() => bytemuck::pod_read_unaligned(b),
        _ => T::zeroed(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
    struct Pair {
        a: u32,
        b: u32,
    }

    fn write(buf: &mut [u8], pairs: &[Pair], ids: &[&str]) -> Result<usize, IpcError> {
        let ids_len: u32 = ids.iter().map(|i| i.len() as u32).sum();
        let mut w = FrameWriter::new(
            buf,
            MsgKind::RankReports,
            3,
            9,
            pairs.len() as u32,
            8,
            0,
            0,
            ids_len,
        )?;
        for p in pairs {
            w.record(p);
        }
        for id in ids {
            w.id(id.as_bytes());
        }
        Ok(w.finish())
    }

    #[test]
    fn round_trips_at_any_alignment() {
        let mut buf = [0u8; 128];
        let pairs = [Pair { a: 1, b: 2 }, Pair { a: u32::MAX, b: 7 }];
        let n = write(&mut buf[1..], &pairs, &["req-a", "b"]).unwrap();
        assert_eq!(n, 32 + 16 + 6);
        let r = FrameReader::parse(&buf[1..1 + n], MsgKind::RankReports, 8, 0).unwrap();
        assert_eq!((r.header.from, r.header.seq, r.header.records), (3, 9, 2));
        assert_eq!(r.record::<Pair>(1), pairs[1]);
        assert_eq!(r.id(0, 5), Some("req-a"));
        assert_eq!(r.id(5, 1), Some("b"));
        assert_eq!(r.id(5, 2), None, "past the id area");
        assert_eq!(r.id(u32::MAX, u32::MAX), None);
    }

    #[test]
    fn refuses_what_it_cannot_vouch_for() {
        let mut buf = [0u8; 64];
        let n = write(&mut buf, &[Pair { a: 1, b: 2 }], &["x"]).unwrap();
        let ok = &buf[..n];
        let parse = |b: &[u8]| FrameReader::parse(b, MsgKind::RankReports, 8, 0).map(|_| ());
        assert_eq!(parse(&ok[..31]), Err(IpcError::TooShort { len: 31 }));
        assert_eq!(
            parse(&ok[..n - 1]),
            Err(IpcError::Length {
                expected: n as u64,
                found: n - 1
            })
        );
        let mut bad = ok.to_vec();
        bad[0] = b'X';
        assert_eq!(parse(&bad), Err(IpcError::BadMagic));
        let mut bad = ok.to_vec();
        bad[4] = 2;
        assert_eq!(parse(&bad), Err(IpcError::UnsupportedVersion { found: 2 }));
        assert_eq!(
            FrameReader::parse(ok, MsgKind::Directives, 8, 0).map(|_| ()),
            Err(IpcError::WrongKind {
                expected: 1,
                found: 2
            })
        );
        let mut bad = ok.to_vec();
        bad[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(parse(&bad), Err(IpcError::Length { .. })));
    }

    #[test]
    fn too_small_a_buffer_is_refused_untouched() {
        let mut buf = [0xAAu8; 40];
        assert_eq!(
            write(&mut buf, &[Pair { a: 1, b: 2 }], &["x"]),
            Err(IpcError::BufferTooSmall { needed: 41 })
        );
        assert!(buf.iter().all(|&b| b == 0xAA));
    }
}
