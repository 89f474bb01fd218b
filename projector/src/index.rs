//! The key index: key hash (xxh3-64) to the set of sources (sub-clusters) holding
//! the key, in about 20 bytes per key.
//!
//! Every distinct hash gets a dense `u32` id. Per id the index keeps the hash
//! (8 B) and a 32-bit source mask (4 B); an open-addressing table of ids keyed by
//! hash finds the id (4 B per slot, 5-10 B per key at its load factor). Sources 0..31 are
//! bits of the mask; bit 31 means "some source with index 31 or more holds it" and
//! the per-source roaring bitmaps say which. Each source also has a roaring bitmap
//! of the ids it holds (about 2 B per key and source): counts, set algebra (diffs
//! between sub-clusters or pools) and bloom filters come from those. An id whose
//! mask drops to zero is freed and reused.

use roaring::RoaringBitmap;

use crate::table::{HomeOrder, IdTable};

mod writer;
pub use writer::SourceWriter;

/// The mask bit meaning "held by some source at index [`OVERFLOW_BIT`] or more".
pub const OVERFLOW_BIT: usize = 31;

/// Mask value of a freed id.
const FREE: u32 = 0;

/// The key index. Sources are addressed by a dense index (`usize`), assigned by
/// the owner of the index.
#[derive(Debug, Default, Clone)]
pub struct KeyIndex {
    hashes: Vec<u64>,
    masks: Vec<u32>,
    table: IdTable,
    free: Vec<u32>,
    bitmaps: Vec<RoaringBitmap>,
    dropped: u64,
    /// Scratch space of [`SourceWriter`], kept to reuse its allocation.
    pending: Vec<u32>,
}

/// The sources holding a key, in ascending index order.
#[derive(Debug, Clone, Copy)]
pub struct Holders<'a> {
    mask: u32,
    id: u32,
    index: &'a KeyIndex,
}

impl Holders<'_> {
    /// Whether no source holds the key.
    pub fn is_empty(&self) -> bool {
        self.mask == 0
    }

    /// Whether source `source` holds the key.
    pub fn contains(&self, source: usize) -> bool {
        if source < OVERFLOW_BIT {
            self.mask & (1 << source) != 0
        } else {
            self.mask & (1 << OVERFLOW_BIT) != 0
                && self
                    .index
                    .bitmaps
                    .get(source)
                    .is_some_and(|b| b.contains(self.id))
        }
    }

    /// The holding sources.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        // Walk the set bits of the mask below the overflow bit.
        let mut low = self.mask & !(1 << OVERFLOW_BIT);
        let low = std::iter::from_fn(move || {
            (low != 0).then(|| {
                let source = low.trailing_zeros() as usize;
                low &= low - 1;
                source
            })
        });
        let high_count = if self.mask & (1 << OVERFLOW_BIT) != 0 {
            self.index.bitmaps.len()
        } else {
            OVERFLOW_BIT
        };
        low.chain((OVERFLOW_BIT..high_count).filter(|&s| self.contains(s)))
    }

    /// The holding sources below [`OVERFLOW_BIT`] as a bit set (bit `s` for
    /// source `s`), when no source at or past it holds the key; `None`
    /// otherwise (then [`Holders::iter`] lists them).
    pub fn low_mask(&self) -> Option<u32> {
        (self.mask & (1 << OVERFLOW_BIT) == 0).then_some(self.mask)
    }

    /// How many sources hold the key.
    pub fn count(&self) -> usize {
        if self.mask & (1 << OVERFLOW_BIT) == 0 {
            self.mask.count_ones() as usize
        } else {
            self.iter().count()
        }
    }
}

impl KeyIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts loading the first thing a lookup of `hash` reads (its home slot);
    /// a hint only, it changes nothing.
    pub fn prefetch_home(&self, hash: u64) {
        self.table.prefetch_home(hash);
    }

    /// Starts loading the second thing a lookup of `hash` reads (the hash of the
    /// id in its home slot, if the tag matches); best issued a few keys after
    /// [`KeyIndex::prefetch_home`]. A hint only, it changes nothing.
    pub fn prefetch_candidate(&self, hash: u64) {
        self.table.prefetch_candidate(hash, &self.hashes);
    }

    fn find(&self, hash: u64) -> Option<u32> {
        self.table.find(hash, &self.hashes)
    }

    fn bitmap_mut(&mut self, source: usize) -> &mut RoaringBitmap {
        if self.bitmaps.len() <= source {
            self.bitmaps.resize_with(source + 1, RoaringBitmap::new);
        }
        &mut self.bitmaps[source]
    }

    fn allocate(&mut self, hash: u64) -> Option<u32> {
        let id = match self.free.pop() {
            Some(id) => {
                self.hashes[id as usize] = hash;
                id
            }
            None => {
                let id = u32::try_from(self.hashes.len()).ok()?;
                self.hashes.push(hash);
                self.masks.push(FREE);
                id
            }
        };
        self.table.insert(id, &self.hashes);
        Some(id)
    }

    /// The id of `hash`, allocated if it has none; `None` (counted in
    /// [`KeyIndex::dropped`]) when the 2^32 ids are all in use.
    fn find_or_allocate(&mut self, hash: u64) -> Option<u32> {
        let id = self.find(hash).or_else(|| self.allocate(hash));
        if id.is_none() {
            self.dropped += 1;
        }
        id
    }

    /// Records that `source` holds the key with `hash`. Returns whether that is
    /// new. A key beyond the 2^32 distinct ids is counted in [`KeyIndex::dropped`].
    pub fn insert(&mut self, source: usize, hash: u64) -> bool {
        let Some(id) = self.find_or_allocate(hash) else {
            return false;
        };
        if !self.bitmap_mut(source).insert(id) {
            return false;
        }
        self.masks[id as usize] |= 1 << source.min(OVERFLOW_BIT);
        true
    }

    /// A writer of `source`'s keys: the same as [`KeyIndex::insert`] and
    /// [`KeyIndex::remove`] for that source, cheaper for many keys in a row.
    pub fn writer(&mut self, source: usize) -> SourceWriter<'_> {
        SourceWriter::new(self, source)
    }

    /// Records that `source` no longer holds the key with `hash`. Returns whether
    /// it held it.
    pub fn remove(&mut self, source: usize, hash: u64) -> bool {
        let Some(id) = self.find(hash) else {
            return false;
        };
        if !self.bitmaps.get_mut(source).is_some_and(|b| b.remove(id)) {
            return false;
        }
        self.clear_bit(source, id);
        true
    }

    fn clear_bit(&mut self, source: usize, id: u32) {
        let mask = &mut self.masks[id as usize];
        if source < OVERFLOW_BIT {
            *mask &= !(1 << source);
        } else if !self.bitmaps[OVERFLOW_BIT..].iter().any(|b| b.contains(id)) {
            *mask &= !(1 << OVERFLOW_BIT);
        }
        if *mask == FREE {
            let hash = self.hashes[id as usize];
            self.table.remove(hash, &self.hashes);
            self.free.push(id);
        }
    }

    /// Forgets everything `source` holds (before re-reading its stream).
    pub fn clear_source(&mut self, source: usize) {
        let Some(bitmap) = self.bitmaps.get_mut(source) else {
            return;
        };
        let ids = std::mem::take(bitmap);
        for id in &ids {
            self.clear_bit(source, id);
        }
    }

    /// The sources holding the key with `hash`.
    pub fn holders(&self, hash: u64) -> Holders<'_> {
        let (id, mask) = self
            .find(hash)
            .map_or((0, 0), |id| (id, self.masks[id as usize]));
        Holders {
            mask,
            id,
            index: self,
        }
    }

    /// The holders of many keys at once: `out[i]` for `hashes[i]`. Faster than one
    /// [`KeyIndex::holders`] call per key on a large index, because the memory
    /// loads of several keys overlap.
    pub fn holders_many<'a>(&'a self, hashes: &[u64], out: &mut Vec<Holders<'a>>) {
        let mut ids = Vec::with_capacity(hashes.len());
        self.table.find_many(hashes, &self.hashes, &mut ids);
        out.clear();
        out.extend(ids.into_iter().map(|id| {
            let mask = self.masks.get(id as usize).copied().unwrap_or(0);
            Holders {
                mask,
                id,
                index: self,
            }
        }));
    }

    /// Distinct keys held by at least one source.
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.table.len() == 0
    }

    /// Keys held by `source`.
    pub fn source_len(&self, source: usize) -> u64 {
        self.bitmaps.get(source).map_or(0, RoaringBitmap::len)
    }

    /// The ids held by `source` (for set algebra and bloom filters).
    pub fn source_ids(&self, source: usize) -> Option<&RoaringBitmap> {
        self.bitmaps.get(source)
    }

    /// The ids `source` holds and `other` does not (`a.andnot(b)`: what a copy
    /// from `source` to `other` would have to move).
    pub fn missing_from(&self, source: usize, other: usize) -> RoaringBitmap {
        let empty = RoaringBitmap::new();
        let mine = self.bitmaps.get(source).unwrap_or(&empty);
        let theirs = self.bitmaps.get(other).unwrap_or(&empty);
        mine - theirs
    }

    /// The key hash of an id.
    pub fn hash_of(&self, id: u32) -> Option<u64> {
        self.hashes.get(id as usize).copied()
    }

    /// Keys refused because the id space was exhausted.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Bytes the index occupies on the heap (vector capacities, the hash table's
    /// allocation, the bitmaps' serialized size as an estimate of theirs).
    pub fn memory_bytes(&self) -> usize {
        self.hashes.capacity() * 8
            + self.masks.capacity() * 4
            + self.free.capacity() * 4
            + self.table.allocation_size()
            + self
                .bitmaps
                .iter()
                .map(RoaringBitmap::serialized_size)
                .sum::<usize>()
    }

    /// Makes room for `additional` more keys (e.g. the object counts the
    /// sub-masters registered, before a replay), so the index does not grow step by
    /// step.
    pub fn reserve(&mut self, additional: usize) {
        self.hashes.reserve(additional);
        self.masks.reserve(additional);
        self.table.reserve(additional, &self.hashes);
    }

    /// Returns unused capacity to the allocator. The id table is rebuilt at its
    /// size from the ids ([`IdTable::build`]: their hashes read in order, then
    /// placed in the order of their home slots) instead of re-placing its
    /// slots, which would read every hash at random.
    pub fn shrink_to_fit(&mut self) {
        self.hashes.shrink_to_fit();
        self.masks.shrink_to_fit();
        self.free.shrink_to_fit();
        if self.table.is_oversized() {
            match IdTable::build(live_ids(&self.masks), self.table.len(), &self.hashes) {
                Ok(table) => self.table = table,
                // The table holds every hash once, so this is never reached; the
                // oversized table stays correct.
                Err(id) => tracing::warn!(id, "an id's hash is in the index twice"),
            }
        }
    }

    /// The raw parts, for checkpoints: hashes, masks, free ids, bitmaps.
    pub(crate) fn parts(&self) -> (&[u64], &[u32], &[u32], &[RoaringBitmap]) {
        (&self.hashes, &self.masks, &self.free, &self.bitmaps)
    }

    /// Rebuilds an index from checkpointed parts. Fails when they are
    /// inconsistent (lengths differ, an id out of range, a mask without its bits).
    pub(crate) fn from_parts(
        hashes: Vec<u64>,
        masks: Vec<u32>,
        free: Vec<u32>,
        bitmaps: Vec<RoaringBitmap>,
    ) -> Result<Self, String> {
        if hashes.len() != masks.len() {
            return Err("hash and mask counts differ".to_owned());
        }
        let ids = hashes.len() as u64;
        if bitmaps
            .iter()
            .any(|b| b.max().is_some_and(|m| u64::from(m) >= ids))
            || free.iter().any(|&id| u64::from(id) >= ids)
        {
            return Err("an id is out of range".to_owned());
        }
        u32::try_from(masks.len()).map_err(|_| "more ids than fit in 32 bits")?;
        // Two threads: one sorts the ids into the table's order while the
        // other allocates the table and checks the bitmaps against the masks.
        let table = std::thread::scope(|scope| {
            let other = scope.spawn(|| {
                let table = IdTable::with_capacity(live_ids(&masks).count());
                check_bitmaps(&masks, &bitmaps).map(|()| table)
            });
            let order = HomeOrder::new(live_ids(&masks), &hashes);
            let table = other
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
            table
                .fill(&order, &hashes)
                .map_err(|id| format!("a hash appears twice (id {id})"))
        })?;
        Ok(Self {
            hashes,
            masks,
            table,
            free,
            bitmaps,
            dropped: 0,
            pending: Vec::new(),
        })
    }
}

/// Checks that each source's bitmap holds only ids whose mask has the
/// source's bit.
fn check_bitmaps(masks: &[u32], bitmaps: &[RoaringBitmap]) -> Result<(), String> {
    for (source, bitmap) in bitmaps.iter().enumerate() {
        let bit = 1 << source.min(OVERFLOW_BIT);
        if bitmap.iter().any(|id| masks[id as usize] & bit == 0) {
            return Err(format!("source {source} holds ids its mask bit lacks"));
        }
    }
    Ok(())
}

/// The ids in use (a mask that is not [`FREE`]), in order; `masks` holds at
/// most one mask per 32-bit id.
fn live_ids(masks: &[u32]) -> impl Iterator<Item = u32> + Clone + '_ {
    (0..masks.len() as u32).filter(|&id| masks[id as usize] != FREE)
}

#[cfg(test)]
mod tests;
