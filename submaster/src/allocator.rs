//! An offset allocator for one segment: free ranges indexed by offset (for
//! coalescing) and by size (for best fit). Only free ranges are stored, so an object
//! costs the allocator nothing; a range can also be reserved at a given offset, which
//! is how a standby rebuilds the leader's layout from `PutCommitted` events.

use std::collections::{BTreeMap, BTreeSet};

/// Allocations are rounded up to this many bytes (cache-line aligned blocks);
/// clients carving objects out of space leases follow the same rule.
pub const ALIGNMENT: u64 = hkvm_events::rpc::space_lease::ALIGNMENT;

/// Rounds `len` up to the allocation granularity (at least one unit).
pub fn aligned(len: u64) -> u64 {
    len.max(1).div_ceil(ALIGNMENT).saturating_mul(ALIGNMENT)
}

/// Why a range could not be reserved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    /// The range is not entirely free (or lies outside the segment).
    #[error("range {offset}+{len} is not free")]
    NotFree {
        /// Start of the range.
        offset: u64,
        /// Its length.
        len: u64,
    },
}

/// Free-space bookkeeping of one segment.
#[derive(Debug, Clone)]
pub struct SegmentAllocator {
    size: u64,
    free_bytes: u64,
    /// offset -> length of each free range.
    by_offset: BTreeMap<u64, u64>,
    /// (length, offset) of each free range, for best fit.
    by_size: BTreeSet<(u64, u64)>,
}

impl SegmentAllocator {
    /// An allocator over `size` bytes, all free (rounded down to the alignment).
    pub fn new(size: u64) -> Self {
        let usable = size / ALIGNMENT * ALIGNMENT;
        let mut allocator = Self {
            size: usable,
            free_bytes: 0,
            by_offset: BTreeMap::new(),
            by_size: BTreeSet::new(),
        };
        if usable > 0 {
            allocator.insert_free(0, usable);
        }
        allocator
    }

    /// An allocator over `size` bytes (as [`SegmentAllocator::new`]) in which the
    /// ranges `used` (`(offset, len)`, sorted by offset) are taken: the bulk form
    /// of [`SegmentAllocator::reserve_at`] for each, in linear time, for restoring
    /// a snapshot. A range that overlaps one before it, or reaches past the end,
    /// is not taken; their number is returned with the allocator.
    pub fn with_used(size: u64, used: &[(u64, u64)]) -> (Self, u64) {
        let usable = size / ALIGNMENT * ALIGNMENT;
        let mut refused = 0;
        let mut free = Vec::new();
        let mut cursor = 0;
        for &(offset, len) in used {
            let end = offset.checked_add(aligned(len));
            match end {
                Some(end) if offset >= cursor && end <= usable => {
                    if offset > cursor {
                        free.push((cursor, offset - cursor));
                    }
                    cursor = end;
                }
                _ => refused += 1,
            }
        }
        if usable > cursor {
            free.push((cursor, usable - cursor));
        }
        let allocator = Self {
            size: usable,
            free_bytes: free.iter().map(|(_, len)| len).sum(),
            by_size: free.iter().map(|&(offset, len)| (len, offset)).collect(),
            by_offset: free.into_iter().collect(),
        };
        (allocator, refused)
    }

    /// Usable bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Free bytes.
    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// Used bytes (aligned).
    pub fn used_bytes(&self) -> u64 {
        self.size - self.free_bytes
    }

    /// The largest free range.
    pub fn largest_free(&self) -> u64 {
        self.by_size.last().map_or(0, |(len, _)| *len)
    }

    /// External fragmentation: `1 - largest_free / free` (0 when free space is one
    /// range or there is none).
    pub fn fragmentation(&self) -> f64 {
        if self.free_bytes == 0 {
            return 0.0;
        }
        1.0 - self.largest_free() as f64 / self.free_bytes as f64
    }

    /// Number of free ranges.
    pub fn free_ranges(&self) -> usize {
        self.by_offset.len()
    }

    fn insert_free(&mut self, offset: u64, len: u64) {
        self.by_offset.insert(offset, len);
        self.by_size.insert((len, offset));
        self.free_bytes += len;
    }

    fn remove_free(&mut self, offset: u64, len: u64) {
        self.by_offset.remove(&offset);
        self.by_size.remove(&(len, offset));
        self.free_bytes -= len;
    }

    /// Allocates `len` bytes (best fit, lowest offset among equals); `None` when no
    /// free range is large enough.
    pub fn allocate(&mut self, len: u64) -> Option<u64> {
        let len = aligned(len);
        let &(range_len, offset) = self.by_size.range((len, 0)..).next()?;
        self.remove_free(offset, range_len);
        if range_len > len {
            self.insert_free(offset + len, range_len - len);
        }
        Some(offset)
    }

    /// Reserves exactly `[offset, offset + aligned(len))`.
    ///
    /// # Errors
    /// [`AllocError::NotFree`] if any part of it is in use or outside the segment.
    pub fn reserve_at(&mut self, offset: u64, len: u64) -> Result<(), AllocError> {
        let len = aligned(len);
        let not_free = AllocError::NotFree { offset, len };
        let (&start, &range_len) = self
            .by_offset
            .range(..=offset)
            .next_back()
            .ok_or(not_free.clone())?;
        let end = offset.checked_add(len).ok_or(not_free.clone())?;
        if end > start + range_len {
            return Err(not_free);
        }
        self.remove_free(start, range_len);
        if offset > start {
            self.insert_free(start, offset - start);
        }
        if start + range_len > end {
            self.insert_free(end, start + range_len - end);
        }
        Ok(())
    }

    /// Frees `[offset, offset + aligned(len))`, merging it with free neighbours.
    /// Freeing a range that is (partly) free already is ignored, so replaying an
    /// event twice cannot corrupt the free lists.
    pub fn free(&mut self, offset: u64, len: u64) {
        let len = aligned(len);
        let Some(end) = offset.checked_add(len) else {
            return;
        };
        if end > self.size {
            return;
        }
        let overlaps_before = self
            .by_offset
            .range(..=offset)
            .next_back()
            .is_some_and(|(&start, &range_len)| start + range_len > offset);
        let overlaps_after = self.by_offset.range(offset..end).next().is_some();
        if overlaps_before || overlaps_after {
            return;
        }
        let (mut start, mut total) = (offset, len);
        if let Some((&before, &before_len)) = self.by_offset.range(..offset).next_back() {
            if before + before_len == offset {
                self.remove_free(before, before_len);
                start = before;
                total += before_len;
            }
        }
        if let Some(&after_len) = self.by_offset.get(&end) {
            self.remove_free(end, after_len);
            total += after_len;
        }
        self.insert_free(start, total);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn allocates_best_fit_and_coalesces_on_free() {
        let mut a = SegmentAllocator::new(1024);
        let x = a.allocate(100).unwrap();
        let y = a.allocate(64).unwrap();
        let z = a.allocate(64).unwrap();
        assert_eq!((x, y, z), (0, 128, 192));
        assert_eq!(a.used_bytes(), 256);
        a.free(y, 64);
        // A 64-byte hole at 128: best fit puts the next small object there.
        assert_eq!(a.allocate(10), Some(128));
        a.free(128, 64);
        a.free(x, 100);
        a.free(z, 64);
        assert_eq!(a.free_ranges(), 1);
        assert_eq!(a.free_bytes(), 1024);
        assert_eq!(a.fragmentation(), 0.0);
    }

    #[test]
    fn reserve_at_rebuilds_a_layout_and_refuses_overlaps() {
        let mut a = SegmentAllocator::new(4096);
        a.reserve_at(1024, 512).unwrap();
        assert!(matches!(
            a.reserve_at(1200, 64),
            Err(AllocError::NotFree { .. })
        ));
        assert!(a.reserve_at(4096, 64).is_err(), "outside the segment");
        assert!(a.reserve_at(u64::MAX - 10, 64).is_err(), "no overflow");
        assert_eq!(a.allocate(1024), Some(0));
        assert_eq!(a.allocate(64), Some(1536));
    }

    #[test]
    fn exhaustion_and_double_free_are_harmless() {
        let mut a = SegmentAllocator::new(256);
        assert_eq!(a.allocate(256), Some(0));
        assert_eq!(a.allocate(1), None);
        a.free(0, 256);
        a.free(0, 256);
        assert_eq!(a.free_bytes(), 256);
        assert_eq!(a.free_ranges(), 1);
    }

    proptest! {
        /// Random allocate/free sequences keep the books exact: free bytes equal the
        /// sum of free ranges, live allocations never overlap, and freeing all
        /// returns one range.
        #[test]
        fn books_stay_consistent(ops in proptest::collection::vec((any::<bool>(), 1u64..3000), 1..200)) {
            let mut a = SegmentAllocator::new(64 * 1024);
            let mut live: Vec<(u64, u64)> = Vec::new();
            for (alloc, len) in ops {
                if alloc || live.is_empty() {
                    if let Some(offset) = a.allocate(len) {
                        let len = aligned(len);
                        for &(o, l) in &live {
                            prop_assert!(offset + len <= o || o + l <= offset);
                        }
                        live.push((offset, len));
                    }
                } else {
                    let (o, l) = live.swap_remove(len as usize % live.len());
                    a.free(o, l);
                }
                let sum: u64 = a.by_offset.values().sum();
                prop_assert_eq!(sum, a.free_bytes());
                let used: u64 = live.iter().map(|(_, l)| l).sum();
                prop_assert_eq!(used, a.used_bytes());
            }
            for (o, l) in live {
                a.free(o, l);
            }
            prop_assert_eq!(a.free_ranges(), 1);
        }

        /// The bulk form equals reserving each range in offset order, refusals
        /// (overlaps, ranges past the end) included.
        #[test]
        fn with_used_equals_reserving_one_by_one(
            ranges in proptest::collection::vec((0u64..80, 1u64..2000), 0..60)
        ) {
            let size = 64 * 1024;
            let mut used: Vec<(u64, u64)> = ranges.iter().map(|&(slot, len)| (slot * 1024, len)).collect();
            used.sort_unstable();
            let mut one_by_one = SegmentAllocator::new(size);
            let refused_one_by_one = used
                .iter()
                .filter(|&&(offset, len)| one_by_one.reserve_at(offset, len).is_err())
                .count() as u64;
            let (bulk, refused) = SegmentAllocator::with_used(size, &used);
            prop_assert_eq!(refused, refused_one_by_one);
            prop_assert_eq!(bulk.free_bytes(), one_by_one.free_bytes());
            prop_assert_eq!(&bulk.by_offset, &one_by_one.by_offset);
            prop_assert_eq!(&bulk.by_size, &one_by_one.by_size);
        }
    }
}
