//! Caller memory registered with the transport (`Transport::register_local`): the
//! buffers an inference engine hands to zero-copy puts and gets. Each range keeps
//! its registration; an operation whose bytes lie inside one range moves straight
//! from or into that memory with its local key. Pure bookkeeping, generic over the
//! registration, so it is tested without a device.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use super::batch::DirectBuffer;
use super::staging::MemoryKeys;
use crate::error::TransferError;

/// One registered range of caller memory.
#[derive(Debug)]
pub struct LocalRegion<M> {
    start: usize,
    len: usize,
    registration: M,
}

impl<M: MemoryKeys> LocalRegion<M> {
    /// Where `[ptr, ptr + len)` is in this region, for a work request.
    fn direct(&self, ptr: usize) -> DirectBuffer {
        DirectBuffer {
            addr: ptr as u64,
            lkey: self.registration.lkey(),
        }
    }

    /// Its first byte's address.
    pub fn start(&self) -> usize {
        self.start
    }

    /// Its length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty (never: empty ranges are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

type Ranges<M> = BTreeMap<usize, Arc<LocalRegion<M>>>;

fn check_free<M>(ranges: &Ranges<M>, start: usize, len: usize) -> Result<(), TransferError> {
    let end = start
        .checked_add(len)
        .filter(|_| start != 0 && len != 0)
        .ok_or_else(|| {
            TransferError::Invalid(format!(
                "cannot register {len} bytes at {start:#x}: null, empty or wrapping"
            ))
        })?;
    let overlaps = ranges
        .range(..end)
        .next_back()
        .is_some_and(|(_, region)| region.start + region.len > start);
    if overlaps {
        return Err(TransferError::Invalid(format!(
            "{len} bytes at {start:#x} overlap a registered buffer"
        )));
    }
    Ok(())
}

/// The registered ranges, keyed by start. A batch holds the `Arc` of every range
/// it uses, so a range unregistered meanwhile is deregistered when the batch ends.
#[derive(Debug)]
pub struct LocalRegions<M> {
    ranges: Mutex<Ranges<M>>,
}

impl<M> Default for LocalRegions<M> {
    fn default() -> Self {
        Self {
            ranges: Mutex::new(BTreeMap::new()),
        }
    }
}

impl<M: MemoryKeys> LocalRegions<M> {
    fn ranges(&self) -> MutexGuard<'_, Ranges<M>> {
        self.ranges.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Checks that `[start, start + len)` may be registered: not null, not empty,
    /// not wrapping, overlapping no registered range (a cheap check before the
    /// registration itself, which pins the memory).
    ///
    /// # Errors
    /// [`TransferError::Invalid`] saying which.
    pub fn check_new(&self, start: usize, len: usize) -> Result<(), TransferError> {
        check_free(&self.ranges(), start, len)
    }

    /// Adds a registered range.
    ///
    /// # Errors
    /// As [`LocalRegions::check_new`], checked again under the lock.
    pub fn insert(&self, start: usize, len: usize, registration: M) -> Result<(), TransferError> {
        let mut ranges = self.ranges();
        check_free(&ranges, start, len)?;
        ranges.insert(
            start,
            Arc::new(LocalRegion {
                start,
                len,
                registration,
            }),
        );
        Ok(())
    }

    /// Removes the range starting at `start`; it is deregistered once no batch
    /// uses it any more.
    pub fn remove(&self, start: usize) -> Option<Arc<LocalRegion<M>>> {
        self.ranges().remove(&start)
    }

    /// The registered range holding all of `[ptr, ptr + len)`, with where those
    /// bytes are for a work request; `None` when no single range holds them (they
    /// are staged then).
    pub fn find(&self, ptr: usize, len: usize) -> Option<(Arc<LocalRegion<M>>, DirectBuffer)> {
        let end = ptr.checked_add(len)?;
        let ranges = self.ranges();
        let (_, region) = ranges.range(..=ptr).next_back()?;
        (region.start <= ptr && end <= region.start + region.len)
            .then(|| (Arc::clone(region), region.direct(ptr)))
    }

    /// How many ranges are registered.
    pub fn len(&self) -> usize {
        self.ranges().len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::ErrorKind;

    #[derive(Debug)]
    struct Keys(u32);

    impl MemoryKeys for Keys {
        fn lkey(&self) -> u32 {
            self.0
        }
        fn rkey(&self) -> u32 {
            self.0 + 1000
        }
    }

    #[test]
    fn only_bytes_inside_one_registered_range_move_directly() {
        let regions = LocalRegions::default();
        regions.insert(0x1000, 0x100, Keys(1)).unwrap();
        regions.insert(0x2000, 0x100, Keys(2)).unwrap();
        let (region, direct) = regions.find(0x1010, 0x20).unwrap();
        assert_eq!((region.start(), region.len()), (0x1000, 0x100));
        assert_eq!(
            direct,
            DirectBuffer {
                addr: 0x1010,
                lkey: 1
            }
        );
        assert_eq!(regions.find(0x2000, 0x100).unwrap().1.lkey, 2);
        // Running past the end, straddling two ranges, or outside any: staged.
        assert!(regions.find(0x10f0, 0x20).is_none());
        assert!(regions.find(0x1000, 0x1001).is_none());
        assert!(regions.find(0x0fff, 2).is_none());
        assert!(regions.find(0x3000, 1).is_none());
        assert!(regions.find(usize::MAX, 2).is_none());
    }

    #[test]
    fn overlapping_null_and_empty_ranges_are_refused() {
        let regions = LocalRegions::default();
        regions.insert(0x1000, 0x100, Keys(1)).unwrap();
        for (start, len) in [(0x10ff, 1), (0x0f00, 0x101), (0, 16), (0x5000, 0)] {
            let error = regions.insert(start, len, Keys(9)).unwrap_err();
            assert_eq!(error.kind(), ErrorKind::Invalid, "{start:#x}+{len}");
        }
        assert!(regions.insert(usize::MAX - 1, 4, Keys(9)).is_err());
        // Adjacent is fine.
        regions.insert(0x1100, 0x100, Keys(2)).unwrap();
        assert_eq!(regions.len(), 2);
    }

    #[test]
    fn a_range_in_use_by_a_batch_outlives_its_removal() {
        let regions = LocalRegions::default();
        regions.insert(0x1000, 0x100, Keys(1)).unwrap();
        let (in_use, _) = regions.find(0x1000, 8).unwrap();
        let removed = regions.remove(0x1000).unwrap();
        assert!(regions.find(0x1000, 8).is_none());
        assert!(regions.is_empty());
        // The batch's reference keeps the registration alive until it ends.
        assert_eq!(Arc::strong_count(&removed), 2);
        drop(removed);
        assert_eq!(in_use.registration.lkey(), 1);
        assert!(regions.remove(0x1000).is_none());
    }
}
