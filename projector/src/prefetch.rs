//! A hint to the CPU to start loading a value's cache line, so that a lookup
//! issued a few keys later finds it in cache while the work in between goes on.
//! A hint only: it never faults, changes nothing, and is a no-op on targets
//! without one.

/// Starts loading the cache line holding `value`.
#[inline]
pub(crate) fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads no memory architecturally and cannot fault; the
    // pointer comes from a live reference anyway. SSE is part of the x86_64
    // baseline, so the target feature is always present.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
            std::ptr::from_ref(value).cast(),
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}
