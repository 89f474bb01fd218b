//! The argument shape every zero-copy call shares: per key a list of pointers and
//! a list of sizes. Each (pointer, size) is checked against the registered
//! buffers and becomes a [`Part`] the backend turns into what it uses (a slice of
//! local memory, a span of memory shared with a real client); a key with any
//! part outside registered memory is refused on its own.

use hkvm_client::store::BufferRegistry;

/// A range inside one buffer the caller registered (`register_buffer`). The
/// caller promised to keep that memory valid until it unregisters it, and not to
/// touch it while a call writes it; only [`Part::registered`] makes one.
#[derive(Debug, Clone, Copy)]
pub struct Part {
    ptr: usize,
    size: usize,
}

impl Part {
    /// `[ptr, ptr + size)` when it lies inside one registered buffer.
    pub fn registered(buffers: &BufferRegistry, ptr: usize, size: usize) -> Option<Self> {
        buffers.contains(ptr, size).then_some(Self { ptr, size })
    }

    /// Its address.
    pub fn ptr(self) -> usize {
        self.ptr
    }

    /// Its length in bytes.
    pub fn size(self) -> usize {
        self.size
    }
}

/// A zero-copy request split into the keys that can be served and those refused.
pub struct Selected<T> {
    /// Indexes (into the request's keys) of the keys served, in order.
    pub indexes: Vec<usize>,
    /// Their parts, mapped.
    pub parts: Vec<Vec<T>>,
    /// Indexes of the keys refused (a part outside registered memory).
    pub refused: Vec<usize>,
}

/// Maps every key's parts with `map`, or `None` when the request's shape is wrong
/// (as many pointer lists and size lists as keys, each pointer list as long as its
/// size list).
pub fn select<T>(
    keys: usize,
    ptrs: &[Vec<usize>],
    sizes: &[Vec<usize>],
    mut map: impl FnMut(usize, usize) -> Option<T>,
) -> Option<Selected<T>> {
    if ptrs.len() != keys
        || sizes.len() != keys
        || ptrs.iter().zip(sizes).any(|(p, s)| p.len() != s.len())
    {
        return None;
    }
    let mut selected = Selected {
        indexes: Vec::with_capacity(keys),
        parts: Vec::with_capacity(keys),
        refused: Vec::new(),
    };
    for (index, (p, s)) in ptrs.iter().zip(sizes).enumerate() {
        let parts: Option<Vec<T>> = p
            .iter()
            .zip(s)
            .map(|(&ptr, &size)| map(ptr, size))
            .collect();
        match parts {
            Some(parts) => {
                selected.indexes.push(index);
                selected.parts.push(parts);
            }
            None => selected.refused.push(index),
        }
    }
    Some(selected)
}
