//! Registered memory of loopback agents, and the copy a READ performs.
//!
//! This module owns each agent's region table (what region `i` is) and the
//! byte copy from a remote region into a local landing region. It does not
//! decide *when* a READ copies (that is the fabric's `read_state`) and never
//! writes to a lease-slot array: slots are only ever loaded, through
//! [`LeaseSlots::load`], so a READ racing P's zeroing is an atomic load, not a
//! data race.
//!
//! # Region tables
//!
//! An agent's table is a fixed array of write-once cells (`OnceLock`): the
//! owning fabric fills cell `i` at its `i`-th registration and other agents'
//! threads read it lock-free. Regions are never unregistered, so a reference
//! obtained once stays valid as long as the network lives.

use std::sync::OnceLock;

use crate::fabric::{FabricError, RegionId};
use crate::slots::{LeaseSlots, SLOT_BYTES};
use std::sync::Arc;

/// Raw memory registered through `Fabric::register_memory`.
#[derive(Debug)]
pub(crate) struct RawRegion {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the registrant promised (see `Fabric::register_memory`) that the
// bytes stay allocated and unmoved while the fabric lives and that it treats
// them as shared with READs on other threads; the pointer itself is just an
// address, valid from any thread under that promise.
unsafe impl Send for RawRegion {}
// SAFETY: as above; all access goes through `copy_into`, whose callers hold
// the same promise.
unsafe impl Sync for RawRegion {}

/// One registered region.
#[derive(Debug)]
pub(crate) enum Region {
    /// A lease-slot array, read word by word with atomic loads.
    Slots(Arc<LeaseSlots>),
    /// Plain bytes, copied with `ptr::copy`.
    Raw(RawRegion),
}

impl Region {
    /// Length in bytes.
    pub(crate) fn len(&self) -> u64 {
        match self {
            Region::Slots(s) => u64::from(s.len()) * SLOT_BYTES as u64,
            Region::Raw(r) => r.len as u64,
        }
    }

    /// `offset..offset+len` lies inside the region.
    pub(crate) fn contains(&self, offset: u64, len: u64) -> bool {
        fits(self.len(), offset, len)
    }
}

/// `offset..offset+len` lies inside `0..total`, without overflow.
fn fits(total: u64, offset: u64, len: u64) -> bool {
    offset.checked_add(len).is_some_and(|end| end <= total)
}

/// An agent's region table. See the module docs.
#[derive(Debug)]
pub(crate) struct RegionTable {
    cells: Box<[OnceLock<Region>]>,
}

impl RegionTable {
    pub(crate) fn new(capacity: u32) -> RegionTable {
        RegionTable {
            cells: (0..capacity).map(|_| OnceLock::new()).collect(),
        }
    }

    /// Publishes `region` as region `index`. Only the owning fabric calls
    /// this, with increasing indices.
    pub(crate) fn publish(&self, index: u32, region: Region) -> Result<RegionId, FabricError> {
        let cell = self.cells.get(index as usize).ok_or(FabricError::Full)?;
        cell.set(region).map_err(|_| FabricError::Full)?;
        Ok(RegionId(index))
    }

    pub(crate) fn get(&self, id: RegionId) -> Option<&Region> {
        self.cells.get(id.0 as usize).and_then(OnceLock::get)
    }
}

/// Makes a raw region.
///
/// # Safety
///
/// Same contract as `Fabric::register_memory`: `ptr..ptr+len` stays allocated
/// and unmoved until the network is dropped, and is treated as shared.
pub(crate) unsafe fn raw_region(ptr: *mut u8, len: usize) -> Region {
    Region::Raw(RawRegion { ptr, len })
}

/// The region a READ's previous descriptor named, kept by id: READs usually
/// name one region pair for all their descriptors, so the tables are chased
/// once per READ rather than once per descriptor.
pub(crate) struct LastRegion<'a, R>(Option<(RegionId, &'a R)>);

impl<'a, R> LastRegion<'a, R> {
    pub(crate) fn new() -> Self {
        LastRegion(None)
    }

    /// Region `id`: the kept one, or what `look_up` finds (then kept);
    /// [`FabricError::UnknownRegion`] when it finds none.
    #[inline]
    pub(crate) fn get(
        &mut self,
        id: RegionId,
        look_up: impl FnOnce() -> Option<&'a R>,
    ) -> Result<&'a R, FabricError> {
        match self.0 {
            Some((kept, r)) if kept == id => Ok(r),
            _ => {
                let r = look_up().ok_or(FabricError::UnknownRegion)?;
                self.0 = Some((id, r));
                Ok(r)
            }
        }
    }
}

/// Copies `len` bytes of `src` at `src_offset` into `dst` at `dst_offset`.
/// Both ranges must have been checked with [`Region::contains`]; a range that
/// was not is refused with `OutOfBounds` rather than copied.
///
/// # Safety
///
/// `dst` was registered under `register_memory`'s contract, and no Rust
/// reference to `dst`'s target bytes is live (the caller posted a READ into
/// them). If `src` is raw memory, nothing writes its source bytes during the
/// copy (a lease guarantees that in the protocol; a test that overwrites raw
/// source bytes from another thread mid-copy is a data race, as with a real
/// NIC it would be a torn read: use the slot region for that, whose words
/// are loaded atomically).
pub(crate) unsafe fn copy_into(
    src: &Region,
    src_offset: u64,
    dst: &RawRegion,
    dst_offset: u64,
    len: u64,
) -> Result<(), FabricError> {
    if !src.contains(src_offset, len) || !fits(dst.len as u64, dst_offset, len) {
        return Err(FabricError::OutOfBounds);
    }
    // In bounds of regions that exist in memory, so all of these fit usize.
    let (len, dst_offset) = (len as usize, dst_offset as usize);
    // SAFETY: dst_offset + len <= dst.len (checked above) and the region is
    // live (caller's contract).
    let mut out = unsafe { dst.ptr.add(dst_offset) };
    match src {
        Region::Raw(raw) => {
            // SAFETY: in bounds (checked above), both regions live; `copy`
            // (memmove) because an agent may READ from itself into an
            // overlapping range.
            unsafe { core::ptr::copy(raw.ptr.add(src_offset as usize), out, len) };
        }
        Region::Slots(slots) => {
            // Word by word through atomic loads, so a READ overlapping P's
            // `clear` sees either the old or the new word, never a tear.
            let mut off = src_offset as usize;
            let end = off + len;
            while off < end {
                let word = (off / SLOT_BYTES) as u32;
                let within = off % SLOT_BYTES;
                let n = (SLOT_BYTES - within).min(end - off);
                let bytes = slots.load(word).unwrap_or(0).to_le_bytes();
                if n == SLOT_BYTES {
                    // The common case, whole words: one unaligned 8-byte store
                    // instead of a variable-length memcpy call.
                    // SAFETY: `out..out+8` is within dst's checked range (we
                    // advance `out` by exactly `len` bytes in total); the
                    // store makes no alignment assumption.
                    unsafe { out.cast::<[u8; SLOT_BYTES]>().write_unaligned(bytes) };
                } else {
                    // SAFETY: as above, for the `n` bytes of a partial word.
                    unsafe { core::ptr::copy_nonoverlapping(bytes.as_ptr().add(within), out, n) };
                }
                // SAFETY: stays within (or one past) dst's checked range.
                out = unsafe { out.add(n) };
                off += n;
            }
        }
    }
    Ok(())
}
