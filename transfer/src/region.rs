//! Local memory that peers read and write: a [`Segment`] is one anonymous memory
//! mapping owned by a node, named by a [`RegionId`]; a [`RegionTable`] is the set of
//! segments a transport serves.
//!
//! A segment is shared memory in the sense of a NIC's registered buffer: many
//! connections copy into and out of it at once, through raw pointers, never through
//! long-lived Rust references. Every access is bounds-checked first, so nothing is
//! ever read or written outside the mapping. Two operations on *overlapping* ranges at
//! the same time are not prevented here: the sub-master hands out disjoint ranges and
//! a range is read only after its put ended, so overlap means a misbehaving client,
//! whose bytes may then tear; the value checksum of the client layer catches that.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, RwLock};

use memmap2::{Advice, MmapMut, MmapRaw};

use crate::error::TransferError;

/// The longest region id, in bytes (ids travel in every frame).
pub const MAX_REGION_ID_LEN: usize = 255;

/// The name of a registered region (a node's segment id, e.g. `node-07-seg-0`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegionId(String);

impl RegionId {
    /// Validates a region id: 1 to [`MAX_REGION_ID_LEN`] bytes.
    ///
    /// # Errors
    /// [`TransferError::Invalid`] when empty or too long.
    pub fn new(id: impl Into<String>) -> Result<Self, TransferError> {
        let id = id.into();
        if id.is_empty() || id.len() > MAX_REGION_ID_LEN {
            return Err(TransferError::Invalid(format!(
                "region id must be 1 to {MAX_REGION_ID_LEN} bytes, got {}",
                id.len()
            )));
        }
        Ok(Self(id))
    }

    /// The id as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

// Hashing and equality of `RegionId` are those of its string, so tables keyed by it
// can be searched with the `&str` that arrives on the wire.
impl std::borrow::Borrow<str> for RegionId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RegionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Returns the start of `offset..offset + len` as an index into a region of `size`
/// bytes, or the typed error saying why it does not fit.
///
/// # Errors
/// [`TransferError::OutOfBounds`] when the range overflows or ends past `size`.
pub fn check_range(region: &str, size: u64, offset: u64, len: u64) -> Result<usize, TransferError> {
    match offset.checked_add(len) {
        Some(end) if end <= size => {
            usize::try_from(offset).map_err(|_| out_of_bounds(region, size, offset, len))
        }
        _ => Err(out_of_bounds(region, size, offset, len)),
    }
}

fn out_of_bounds(region: &str, size: u64, offset: u64, len: u64) -> TransferError {
    TransferError::OutOfBounds {
        region: region.to_owned(),
        offset,
        len,
        size,
    }
}

/// One anonymous memory mapping that a node contributes to the pool.
pub struct Segment {
    id: RegionId,
    map: MmapRaw,
    len: usize,
}

impl fmt::Debug for Segment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Segment")
            .field("id", &self.id)
            .field("len", &self.len)
            .finish()
    }
}

impl Segment {
    /// Maps `size` bytes of zeroed anonymous memory (pages are committed lazily by
    /// the kernel, on first touch).
    ///
    /// # Errors
    /// [`TransferError::Invalid`] for a zero size or one larger than the address
    /// space; [`TransferError::Io`] when the kernel refuses the mapping.
    pub fn allocate(id: RegionId, size: u64) -> Result<Arc<Self>, TransferError> {
        let len = usize::try_from(size)
            .ok()
            .filter(|&len| len > 0 && len <= isize::MAX as usize)
            .ok_or_else(|| {
                TransferError::Invalid(format!("segment size {size} is not mappable"))
            })?;
        let map = MmapMut::map_anon(len).map_err(|source| TransferError::Io {
            what: "mapping a segment",
            source,
        })?;
        Ok(Arc::new(Self {
            id,
            map: MmapRaw::from(map),
            len,
        }))
    }

    /// Commits the segment's memory now, so that no write into it pays a
    /// first-touch page fault (one per 4 KiB page: on a virtual machine about
    /// half the time of a 1 MiB put). Asks for transparent huge pages first,
    /// then has the kernel populate every page writable
    /// (`MADV_POPULATE_WRITE`, Linux 5.14), which keeps what is written.
    ///
    /// # Errors
    /// [`TransferError::Io`] when the kernel refuses; the pages are then
    /// committed on first touch, as without this.
    pub fn populate(&self) -> Result<(), TransferError> {
        // Huge pages are a wish: without them (disabled, or an older kernel)
        // population still works, page by page.
        let _ = self.map.advise(Advice::HugePage);
        self.map
            .advise(Advice::PopulateWrite)
            .map_err(|source| TransferError::Io {
                what: "populating a segment",
                source,
            })
    }

    /// The segment's id.
    pub fn id(&self) -> &RegionId {
        &self.id
    }

    /// Its size in bytes.
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    /// Whether it has no bytes (never true: zero-sized segments are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The start of the mapping (for registering it with a NIC).
    pub fn base_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// Checks that `offset..offset + len` lies inside the segment.
    ///
    /// # Errors
    /// [`TransferError::OutOfBounds`] otherwise.
    pub fn check(&self, offset: u64, len: u64) -> Result<usize, TransferError> {
        check_range(self.id.as_str(), self.len as u64, offset, len)
    }

    /// Copies `data` into the segment at `offset`.
    ///
    /// # Errors
    /// [`TransferError::OutOfBounds`] when the range does not fit.
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), TransferError> {
        let start = self.check(offset, data.len() as u64)?;
        // SAFETY: `check` proved start + data.len() <= self.len, so the destination
        // lies inside the live mapping; `data` is caller memory, never the mapping
        // itself through a Rust reference, so the ranges do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.base_ptr().add(start), data.len());
        }
        Ok(())
    }

    /// Copies `out.len()` bytes of the segment at `offset` into `out`.
    ///
    /// # Errors
    /// [`TransferError::OutOfBounds`] when the range does not fit.
    pub fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<(), TransferError> {
        let start = self.check(offset, out.len() as u64)?;
        // SAFETY: as in `write_at`, the source range is inside the mapping and `out`
        // is distinct caller memory.
        unsafe {
            std::ptr::copy_nonoverlapping(self.base_ptr().add(start), out.as_mut_ptr(), out.len());
        }
        Ok(())
    }

    /// A shared view of a checked range, for sending it without a copy.
    ///
    /// # Errors
    /// [`TransferError::OutOfBounds`] when the range does not fit.
    ///
    /// # Safety
    /// The caller must not let a write to an overlapping range run while the slice
    /// lives (see the module docs: disjoint ranges are the placement protocol's job).
    pub(crate) unsafe fn range(&self, offset: u64, len: u64) -> Result<&[u8], TransferError> {
        let start = self.check(offset, len)?;
        // SAFETY: in bounds of the live mapping (checked above); exclusivity of the
        // range against writers is the caller's contract.
        Ok(unsafe { std::slice::from_raw_parts(self.base_ptr().add(start), len as usize) })
    }

    /// A mutable view of a checked range, for receiving into it without a copy.
    ///
    /// # Errors
    /// [`TransferError::OutOfBounds`] when the range does not fit.
    ///
    /// # Safety
    /// The caller must not let another access to an overlapping range run while the
    /// slice lives.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn range_mut(
        &self,
        offset: u64,
        len: u64,
    ) -> Result<&mut [u8], TransferError> {
        let start = self.check(offset, len)?;
        // SAFETY: in bounds of the live mapping (checked above); exclusivity of the
        // range is the caller's contract.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.base_ptr().add(start), len as usize) })
    }
}

/// The regions a transport serves, shared between its server tasks.
#[derive(Debug, Clone, Default)]
pub struct RegionTable {
    inner: Arc<RwLock<HashMap<RegionId, Arc<Segment>>>>,
}

impl RegionTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a segment.
    ///
    /// # Errors
    /// [`TransferError::Invalid`] when a segment of that id is already registered.
    pub fn insert(&self, segment: Arc<Segment>) -> Result<(), TransferError> {
        let mut map = self
            .inner
            .write()
            .unwrap_or_else(|poison| poison.into_inner());
        if map.contains_key(segment.id()) {
            return Err(TransferError::Invalid(format!(
                "region {} is already registered",
                segment.id()
            )));
        }
        map.insert(segment.id().clone(), segment);
        Ok(())
    }

    /// Removes a segment; operations already running on it finish on the mapping,
    /// which lives until the last of them drops it.
    ///
    /// # Errors
    /// [`TransferError::UnknownRegion`] when it is not registered.
    pub fn remove(&self, id: &RegionId) -> Result<Arc<Segment>, TransferError> {
        let mut map = self
            .inner
            .write()
            .unwrap_or_else(|poison| poison.into_inner());
        map.remove(id).ok_or_else(|| TransferError::UnknownRegion {
            region: id.to_string(),
        })
    }

    /// Looks a segment up by its id as it arrives on the wire.
    ///
    /// # Errors
    /// [`TransferError::UnknownRegion`] when it is not registered.
    pub fn get(&self, id: &str) -> Result<Arc<Segment>, TransferError> {
        let map = self
            .inner
            .read()
            .unwrap_or_else(|poison| poison.into_inner());
        map.get(id)
            .map(Arc::clone)
            .ok_or_else(|| TransferError::UnknownRegion {
                region: id.to_owned(),
            })
    }

    /// The registered ids, sorted.
    pub fn ids(&self) -> Vec<RegionId> {
        let map = self
            .inner
            .read()
            .unwrap_or_else(|poison| poison.into_inner());
        let mut ids: Vec<RegionId> = map.keys().cloned().collect();
        ids.sort();
        ids
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn segment(size: u64) -> Arc<Segment> {
        Segment::allocate(RegionId::new("seg").unwrap(), size).unwrap()
    }

    #[test]
    fn region_ids_are_validated() {
        assert!(RegionId::new("").is_err());
        assert!(RegionId::new("x".repeat(256)).is_err());
        assert_eq!(RegionId::new("x".repeat(255)).unwrap().as_str().len(), 255);
    }

    /// This process's resident memory, from /proc.
    fn resident_bytes() -> u64 {
        let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
        let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
        pages * 4096
    }

    #[test]
    fn a_populated_segment_is_resident_and_keeps_what_was_written() {
        let seg = segment(64 << 20);
        seg.write_at(12_345, b"kept").unwrap();
        let before = resident_bytes();
        seg.populate().unwrap();
        let grown = resident_bytes().saturating_sub(before);
        assert!(grown >= 48 << 20, "only {grown} bytes became resident");
        let mut out = [0u8; 4];
        seg.read_at(12_345, &mut out).unwrap();
        assert_eq!(&out, b"kept");
        seg.read_at(64 << 19, &mut out).unwrap();
        assert_eq!(out, [0; 4]);
    }

    #[test]
    fn zero_sized_segments_are_refused() {
        let err = Segment::allocate(RegionId::new("s").unwrap(), 0).unwrap_err();
        assert_eq!(err.kind(), crate::ErrorKind::Invalid);
    }

    #[test]
    fn writes_and_reads_stay_inside_the_segment() {
        let seg = segment(4096);
        seg.write_at(4000, &[7u8; 96]).unwrap();
        let mut out = [0u8; 96];
        seg.read_at(4000, &mut out).unwrap();
        assert_eq!(out, [7u8; 96]);
        for (offset, len) in [(4000, 97), (4096, 1), (u64::MAX, 2), (1, u64::MAX)] {
            let err = seg.check(offset, len).unwrap_err();
            assert_eq!(err.kind(), crate::ErrorKind::OutOfBounds, "{offset}+{len}");
        }
        assert!(seg.write_at(4095, &[1, 2]).is_err());
        assert_eq!(seg.check(4096, 0).unwrap(), 4096);
    }

    #[test]
    fn table_refuses_duplicates_and_reports_unknown_regions() {
        let table = RegionTable::new();
        table.insert(segment(64)).unwrap();
        assert_eq!(
            table.insert(segment(64)).unwrap_err().kind(),
            crate::ErrorKind::Invalid
        );
        assert_eq!(table.get("seg").unwrap().len(), 64);
        assert_eq!(
            table.get("nope").unwrap_err().kind(),
            crate::ErrorKind::UnknownRegion
        );
        table.remove(&RegionId::new("seg").unwrap()).unwrap();
        assert!(table.get("seg").is_err());
    }
}
