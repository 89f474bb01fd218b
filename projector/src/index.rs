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
        let pending = std::mem::take(&mut self.pending);
        SourceWriter {
            index: self,
            source,
            pending,
        }
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

impl SourceWriter<'_> {
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
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// One step: a source and its operations, `(insert?, hash)`.
    fn runs() -> impl Strategy<Value = Vec<(usize, Vec<(bool, u64)>)>> {
        // Few hashes, so keys are shared, dropped and their ids reused; sources
        // on both sides of the overflow bit.
        let op = (prop::bool::weighted(0.7), 0..48u64);
        let source = prop_oneof![0..4usize, 30..34usize];
        prop::collection::vec((source, prop::collection::vec(op, 0..24)), 0..24)
    }

    proptest! {
        #[test]
        fn a_writer_does_what_single_inserts_and_removes_do(runs in runs()) {
            let (mut single, mut written) = (KeyIndex::new(), KeyIndex::new());
            for (source, ops) in &runs {
                let mut writer = written.writer(*source);
                for &(insert, hash) in ops {
                    let (expected, found) = if insert {
                        (single.insert(*source, hash), writer.insert(hash))
                    } else {
                        (single.remove(*source, hash), writer.remove(hash))
                    };
                    prop_assert_eq!(expected, found, "source {} hash {}", source, hash);
                }
            }
            prop_assert_eq!(single.len(), written.len());
            prop_assert_eq!(single.parts().0, written.parts().0);
            prop_assert_eq!(single.parts().1, written.parts().1);
            prop_assert_eq!(single.parts().3, written.parts().3);
            for hash in 0..48 {
                let holders: Vec<usize> = written.holders(hash).iter().collect();
                prop_assert_eq!(single.holders(hash).iter().collect::<Vec<_>>(), holders);
            }
        }
    }

    #[test]
    fn a_writer_appends_new_ids_and_inserts_older_ones() {
        let mut index = KeyIndex::new();
        // Ids 0..100 go to source 1; source 0 then gets some of them (older
        // than its largest id) and new ones, in one writer.
        for hash in 0..100 {
            index.insert(1, hash);
        }
        index.insert(0, 50);
        let mut writer = index.writer(0);
        for hash in [10, 200, 201, 20, 202] {
            assert!(writer.insert(hash));
        }
        assert!(!writer.insert(200));
        drop(writer);
        let ids: Vec<u32> = index.source_ids(0).unwrap().iter().collect();
        assert_eq!(ids, vec![10, 20, 50, 100, 101, 102]);
        assert_eq!(index.source_len(0), 6);
    }

    #[test]
    fn shrinking_a_reserved_index_keeps_every_key() {
        let mut index = KeyIndex::new();
        index.reserve(50_000);
        let hash = |k: u64| k.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        for k in 0..20_000 {
            assert!(index.insert((k % 3) as usize, hash(k)));
        }
        // Freed ids (a hole in the ids) are left out of the rebuilt table.
        for k in (0..20_000).step_by(5) {
            assert!(index.remove((k % 3) as usize, hash(k)));
        }
        let before = index.memory_bytes();
        index.shrink_to_fit();
        assert!(index.memory_bytes() < before / 2);
        assert_eq!(index.len(), 16_000);
        for k in 0..20_000 {
            let held: Vec<usize> = index.holders(hash(k)).iter().collect();
            let expected = if k % 5 == 0 {
                vec![]
            } else {
                vec![(k % 3) as usize]
            };
            assert_eq!(held, expected, "key {k}");
        }
        // The freed ids are still reused after the rebuild.
        let ids = index.parts().0.len();
        assert!(index.insert(0, hash(0)));
        assert_eq!(index.parts().0.len(), ids);
    }

    #[test]
    fn tracks_holders_and_frees_ids() {
        let mut index = KeyIndex::new();
        assert!(index.insert(0, 10));
        assert!(!index.insert(0, 10));
        assert!(index.insert(3, 10));
        assert_eq!(index.holders(10).iter().collect::<Vec<_>>(), vec![0, 3]);
        assert_eq!(index.len(), 1);
        assert!(index.remove(0, 10));
        assert!(!index.remove(0, 10));
        assert_eq!(index.holders(10).iter().collect::<Vec<_>>(), vec![3]);
        assert!(index.remove(3, 10));
        assert!(index.holders(10).is_empty());
        assert!(index.is_empty());
        // The freed id is reused.
        assert!(index.insert(1, 11));
        assert_eq!(index.parts().0.len(), 1);
    }

    #[test]
    fn differences_between_sources_are_set_algebra() {
        let mut index = KeyIndex::new();
        for hash in 0..10 {
            index.insert(0, hash);
        }
        for hash in 5..15 {
            index.insert(1, hash);
        }
        let missing: Vec<u64> = index
            .missing_from(0, 1)
            .iter()
            .filter_map(|id| index.hash_of(id))
            .collect();
        assert_eq!(missing, vec![0, 1, 2, 3, 4]);
        assert_eq!(index.missing_from(1, 0).len(), 5);
        assert_eq!(index.missing_from(0, 7).len(), 10);
    }

    #[test]
    fn sources_past_the_mask_use_bitmaps() {
        let mut index = KeyIndex::new();
        index.insert(40, 7);
        index.insert(33, 7);
        index.insert(2, 7);
        assert_eq!(index.holders(7).iter().collect::<Vec<_>>(), vec![2, 33, 40]);
        index.remove(40, 7);
        assert!(index.holders(7).contains(33));
        index.remove(33, 7);
        assert_eq!(index.holders(7).iter().collect::<Vec<_>>(), vec![2]);
        index.clear_source(2);
        assert!(index.is_empty());
    }

    #[test]
    fn clearing_a_source_keeps_the_others() {
        let mut index = KeyIndex::new();
        for hash in 0..100 {
            index.insert(0, hash);
            if hash % 2 == 0 {
                index.insert(1, hash);
            }
        }
        index.clear_source(0);
        assert_eq!(index.len(), 50);
        assert_eq!(index.source_len(0), 0);
        assert_eq!(index.source_len(1), 50);
        let (hashes, masks, free, bitmaps) = index.parts();
        let rebuilt = KeyIndex::from_parts(
            hashes.to_vec(),
            masks.to_vec(),
            free.to_vec(),
            bitmaps.to_vec(),
        )
        .unwrap();
        assert_eq!(rebuilt.len(), 50);
        assert!(rebuilt.holders(4).contains(1));
        assert!(rebuilt.holders(5).is_empty());
    }
}
