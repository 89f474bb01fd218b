//! Allocation counting for benchmarks: the `hkvm-bench` binary's global allocator
//! counts allocations and the bytes in use with one relaxed atomic each (about a
//! nanosecond), so a benchmark can report allocations per event and bytes per
//! object. Underneath is mimalloc, the `hkvm` binary's allocator, so services
//! hosted by a benchmark allocate as they do in production.

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicU64, Ordering};

use mimalloc::MiMalloc;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
/// Requested bytes currently allocated; wrapping arithmetic keeps it exact even if
/// a free is counted before the matching allocation is visible to a reader.
static IN_USE: AtomicU64 = AtomicU64::new(0);

/// mimalloc, counting allocations and bytes in use.
pub struct CountingAllocator;

// SAFETY: every call is forwarded unchanged to mimalloc.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        IN_USE.fetch_add(layout.size() as u64, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { MiMalloc.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        IN_USE.fetch_sub(layout.size() as u64, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { MiMalloc.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        let moved = unsafe { MiMalloc.realloc(ptr, layout, new_size) };
        if !moved.is_null() {
            // Two wrapping updates: the difference may be negative.
            IN_USE.fetch_add(new_size as u64, Ordering::Relaxed);
            IN_USE.fetch_sub(layout.size() as u64, Ordering::Relaxed);
        }
        moved
    }
}

/// Allocations made so far by the whole process.
pub fn allocations() -> u64 {
    ALLOCATIONS.load(Ordering::Relaxed)
}

/// Bytes the whole process has allocated and not freed (as requested, without the
/// allocator's own per-block overhead).
pub fn bytes_in_use() -> u64 {
    IN_USE.load(Ordering::Relaxed)
}
