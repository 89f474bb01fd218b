//! Buffers the caller registered (`register_buffer`): every zero-copy call checks
//! that the memory it is given lies inside one of them before touching it.

use std::collections::BTreeMap;
use std::sync::Mutex;

/// Registered `[start, start + len)` ranges, keyed by start.
#[derive(Debug, Default)]
pub struct BufferRegistry {
    ranges: Mutex<BTreeMap<usize, usize>>,
}

/// Why a registration was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegisterError {
    /// A null pointer or an empty or wrapping range.
    Invalid,
    /// It overlaps a registered range.
    Overlaps,
}

impl BufferRegistry {
    fn ranges(&self) -> std::sync::MutexGuard<'_, BTreeMap<usize, usize>> {
        self.ranges.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers `[ptr, ptr + len)`.
    ///
    /// # Errors
    /// A null, empty or wrapping range, or one that overlaps a registered range.
    pub fn register(&self, ptr: usize, len: usize) -> Result<(), RegisterError> {
        let end = ptr.checked_add(len).ok_or(RegisterError::Invalid)?;
        if ptr == 0 || len == 0 {
            return Err(RegisterError::Invalid);
        }
        let mut ranges = self.ranges();
        let before = ranges.range(..end).next_back();
        if before.is_some_and(|(start, size)| start + size > ptr) {
            return Err(RegisterError::Overlaps);
        }
        ranges.insert(ptr, len);
        Ok(())
    }

    /// Forgets the range starting at `ptr`; whether there was one.
    pub fn unregister(&self, ptr: usize) -> bool {
        self.ranges().remove(&ptr).is_some()
    }

    /// Whether any registered range overlaps `[ptr, ptr + len)`.
    pub fn overlaps(&self, ptr: usize, len: usize) -> bool {
        let end = ptr.saturating_add(len);
        self.ranges()
            .range(..end)
            .next_back()
            .is_some_and(|(start, size)| start + size > ptr)
    }

    /// Whether `[ptr, ptr + len)` lies inside one registered range (an empty range
    /// at a registered address counts).
    pub fn contains(&self, ptr: usize, len: usize) -> bool {
        let Some(end) = ptr.checked_add(len) else {
            return false;
        };
        self.ranges()
            .range(..=ptr)
            .next_back()
            .is_some_and(|(start, size)| *start <= ptr && end <= start + size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_ranges_inside_a_registration_are_accepted() {
        let registry = BufferRegistry::default();
        registry.register(1000, 100).unwrap();
        registry.register(2000, 50).unwrap();
        assert!(registry.contains(1000, 100));
        assert!(registry.contains(1050, 50));
        assert!(!registry.contains(1050, 51), "runs past the end");
        assert!(!registry.contains(999, 2), "starts before");
        assert!(!registry.contains(1090, 950), "spans two registrations");
        assert!(!registry.contains(usize::MAX, 2), "wraps");
        assert_eq!(registry.register(1099, 10), Err(RegisterError::Overlaps));
        assert_eq!(registry.register(950, 51), Err(RegisterError::Overlaps));
        assert_eq!(registry.register(0, 10), Err(RegisterError::Invalid));
        assert!(registry.overlaps(900, 101) && registry.overlaps(1099, 1));
        assert!(!registry.overlaps(900, 100) && !registry.overlaps(1100, 900));
        assert!(registry.unregister(1000));
        assert!(!registry.contains(1000, 1));
        assert!(!registry.unregister(1000));
    }
}
