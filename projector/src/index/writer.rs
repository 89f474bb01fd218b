//! [`SourceWriter`]: one source's inserts and removes, the ids new to the source
//! added to its bitmap together.

use super::{KeyIndex, OVERFLOW_BIT};

/// Inserts and removes one source's keys ([`KeyIndex::writer`]).
///
/// For a source below [`OVERFLOW_BIT`], whether it already holds a key is its
/// mask bit, so an insert needs no bitmap search: the ids new to the source are
/// collected and added to its bitmap together, as one append when they are
/// ascending and past its largest id (the usual case: ids are handed out in
/// order). They are added before anything else reads the bitmap: before a
/// remove and when the writer is dropped, which the borrow of the index
/// guarantees comes before any read.
#[derive(Debug)]
pub struct SourceWriter<'a> {
    index: &'a mut KeyIndex,
    source: usize,
    /// Ids whose mask bit is set for the source but which its bitmap lacks.
    pending: Vec<u32>,
}

impl<'a> SourceWriter<'a> {
    /// A writer of `source`'s keys in `index`, reusing its scratch space.
    pub(super) fn new(index: &'a mut KeyIndex, source: usize) -> Self {
        let pending = std::mem::take(&mut index.pending);
        Self {
            index,
            source,
            pending,
        }
    }

    /// [`KeyIndex::insert`] for the writer's source.
    pub fn insert(&mut self, hash: u64) -> bool {
        if self.source >= OVERFLOW_BIT {
            return self.index.insert(self.source, hash);
        }
        let Some(id) = self.index.find_or_allocate(hash) else {
            return false;
        };
        let mask = &mut self.index.masks[id as usize];
        let bit = 1 << self.source;
        if *mask & bit != 0 {
            return false;
        }
        *mask |= bit;
        self.pending.push(id);
        true
    }

    /// [`KeyIndex::remove`] for the writer's source.
    pub fn remove(&mut self, hash: u64) -> bool {
        self.flush();
        self.index.remove(self.source, hash)
    }

    /// [`KeyIndex::prefetch_home`].
    pub fn prefetch_home(&self, hash: u64) {
        self.index.prefetch_home(hash);
    }

    /// [`KeyIndex::prefetch_candidate`].
    pub fn prefetch_candidate(&self, hash: u64) {
        self.index.prefetch_candidate(hash);
    }

    /// Adds the pending ids to the source's bitmap.
    fn flush(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let bitmap = self.index.bitmap_mut(self.source);
        if let Err(stopped) = bitmap.append(self.pending.iter().copied()) {
            // Not ascending past the bitmap's largest id (a reused or an older
            // id): the rest one by one.
            let appended = usize::try_from(stopped.valid_until()).unwrap_or(usize::MAX);
            for &id in self.pending.get(appended..).unwrap_or_default() {
                bitmap.insert(id);
            }
        }
        self.pending.clear();
    }
}

impl Drop for SourceWriter<'_> {
    fn drop(&mut self) {
        self.flush();
        self.index.pending = std::mem::take(&mut self.pending);
    }
}
