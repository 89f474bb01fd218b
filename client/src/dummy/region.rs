//! The memory a dummy shares with its real client: an anonymous memfd mapped by
//! both processes, and a first-fit allocator over ranges of it (the dummy's
//! memory pool and its staging area).

use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use memmap2::MmapRaw;

/// A shared memory region, mapped read-write in this process.
#[derive(Debug)]
pub struct SharedRegion {
    file: File,
    map: MmapRaw,
}

impl SharedRegion {
    /// Creates a region of `len` bytes (zeroed) in a new memfd.
    ///
    /// # Errors
    /// When the memfd cannot be created, sized or mapped.
    /// The memfd is sealed against shrinking: a peer that maps it can never be
    /// made to touch pages that were cut off under it (a SIGBUS).
    pub fn create(name: &str, len: u64) -> std::io::Result<Self> {
        let fd = rustix::fs::memfd_create(
            name,
            rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING,
        )?;
        rustix::fs::ftruncate(&fd, len)?;
        rustix::fs::fcntl_add_seals(&fd, rustix::fs::SealFlags::SHRINK)?;
        Self::map(fd, len)
    }

    /// Maps a region received from a peer, checking it is `len` bytes long and
    /// sealed against shrinking (its owner could otherwise truncate it and make
    /// this process fault on its next access).
    ///
    /// # Errors
    /// When the descriptor is not a sealed memfd of that length or cannot be
    /// mapped.
    pub fn map(fd: OwnedFd, len: u64) -> std::io::Result<Self> {
        let sealed = rustix::fs::fcntl_get_seals(&fd)
            .is_ok_and(|seals| seals.contains(rustix::fs::SealFlags::SHRINK));
        if !sealed {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "shared region is not a memfd sealed against shrinking (F_SEAL_SHRINK)",
            ));
        }
        let file = File::from(fd);
        let actual = file.metadata()?.len();
        if actual != len || len == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("shared region is {actual} bytes, announced {len}"),
            ));
        }
        let map = MmapRaw::map_raw(&file)?;
        Ok(Self { file, map })
    }

    /// The descriptor, to pass to the peer.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.map.len() as u64
    }

    /// Whether it is empty (never: creation refuses it).
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    /// The address of its first byte in this process.
    pub fn base(&self) -> usize {
        self.map.as_mut_ptr() as usize
    }

    /// The bytes at `[offset, offset + len)`, or `None` outside the region.
    ///
    /// # Safety
    /// The peer process may write the region concurrently: the caller must only
    /// use ranges the protocol gives it for the duration of one request, as with
    /// any memory shared with a device.
    pub unsafe fn slice(&self, offset: u64, len: u64) -> Option<&[u8]> {
        let end = offset.checked_add(len)?;
        if end > self.len() {
            return None;
        }
        // SAFETY: inside the mapping, which lives as long as `self`; concurrency
        // is the caller's contract above.
        Some(unsafe {
            std::slice::from_raw_parts(self.map.as_ptr().add(offset as usize), len as usize)
        })
    }

    /// The bytes at `[offset, offset + len)` for writing, or `None` outside the
    /// region.
    ///
    /// # Safety
    /// As for [`SharedRegion::slice`]; in addition no other slice of the same range
    /// may be alive.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, offset: u64, len: u64) -> Option<&mut [u8]> {
        let end = offset.checked_add(len)?;
        if end > self.len() {
            return None;
        }
        // SAFETY: as above; exclusivity is the caller's contract.
        Some(unsafe {
            std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(offset as usize), len as usize)
        })
    }
}

/// First-fit allocation of ranges inside `[start, start + len)` (offsets, not
/// addresses), with freed neighbours merged.
#[derive(Debug, Clone)]
pub struct RangeAllocator {
    /// Free ranges: start -> length.
    free: BTreeMap<u64, u64>,
    /// Allocated ranges: start -> length.
    used: BTreeMap<u64, u64>,
}

/// Allocations are rounded up to this alignment.
const ALIGN: u64 = 64;

impl RangeAllocator {
    /// An allocator over `[start, start + len)`.
    pub fn new(start: u64, len: u64) -> Self {
        let mut free = BTreeMap::new();
        if len > 0 {
            free.insert(start, len);
        }
        Self {
            free,
            used: BTreeMap::new(),
        }
    }

    /// A range of at least `len` bytes (one byte for `len` 0), or `None` when no
    /// free range is large enough.
    pub fn allocate(&mut self, len: u64) -> Option<u64> {
        let want = len.max(1).checked_add(ALIGN - 1)? / ALIGN * ALIGN;
        let (&start, &size) = self.free.iter().find(|(_, size)| **size >= want)?;
        self.free.remove(&start);
        if size > want {
            self.free.insert(start + want, size - want);
        }
        self.used.insert(start, want);
        Some(start)
    }

    /// Frees the range starting at `start`; whether there was one.
    pub fn free(&mut self, start: u64) -> bool {
        let Some(mut len) = self.used.remove(&start) else {
            return false;
        };
        let mut start = start;
        if let Some((&prev, &prev_len)) = self.free.range(..start).next_back() {
            if prev + prev_len == start {
                self.free.remove(&prev);
                start = prev;
                len += prev_len;
            }
        }
        if let Some(&next_len) = self.free.get(&(start + len)) {
            self.free.remove(&(start + len));
            len += next_len;
        }
        self.free.insert(start, len);
        true
    }

    /// Bytes free in total.
    pub fn free_bytes(&self) -> u64 {
        self.free.values().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_are_aligned_disjoint_and_merge_back() {
        let mut ranges = RangeAllocator::new(1000, 1024);
        let a = ranges.allocate(10).unwrap();
        let b = ranges.allocate(100).unwrap();
        let c = ranges.allocate(64).unwrap();
        assert_eq!((a, b, c), (1000, 1064, 1192));
        assert!(ranges.allocate(2000).is_none());
        assert!(ranges.free(b));
        assert!(!ranges.free(b), "freed twice");
        assert_eq!(
            ranges.allocate(128),
            Some(1064),
            "first fit reuses the hole"
        );
        assert!(ranges.free(a) && ranges.free(c) && ranges.free(1064));
        assert_eq!(ranges.free_bytes(), 1024);
        assert_eq!(ranges.allocate(1024), Some(1000), "everything merged back");
    }

    #[test]
    fn a_region_is_shared_through_its_descriptor() {
        let region = SharedRegion::create("test", 4096).unwrap();
        let fd = region.fd().try_clone_to_owned().unwrap();
        let peer = SharedRegion::map(fd, 4096).unwrap();
        // SAFETY: a test that alone uses both mappings.
        unsafe {
            region.slice_mut(100, 4).unwrap().copy_from_slice(b"abcd");
            assert_eq!(peer.slice(100, 4).unwrap(), b"abcd");
            assert!(peer.slice(4094, 4).is_none());
        }
        let fd = region.fd().try_clone_to_owned().unwrap();
        assert!(
            SharedRegion::map(fd, 8192).is_err(),
            "a wrong length is refused"
        );
    }

    #[test]
    fn a_region_cannot_shrink_under_its_peer_and_an_unsealed_one_is_refused() {
        let region = SharedRegion::create("sealed", 8192).unwrap();
        let truncated = rustix::fs::ftruncate(region.fd(), 4096);
        assert!(truncated.is_err(), "the seal refuses the shrink");
        assert_eq!(region.len(), 8192);
        // A memfd its owner can still truncate: a peer must not map it.
        let loose = rustix::fs::memfd_create("loose", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&loose, 4096).unwrap();
        let error = SharedRegion::map(loose, 4096).unwrap_err();
        assert!(error.to_string().contains("F_SEAL_SHRINK"), "{error}");
        // A plain file neither.
        let file = tempfile::tempfile().unwrap();
        file.set_len(4096).unwrap();
        assert!(SharedRegion::map(OwnedFd::from(file), 4096).is_err());
    }
}
