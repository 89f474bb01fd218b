//! The id table: an open-addressing hash table (linear probing, backward-shift
//! deletion) of dense `u32` ids keyed by the key hash stored in a side array. A slot
//! is 8 bytes: the id and a 32-bit tag (the hash's low half), so probing past other
//! keys never touches the side array, and a hit reads it once to confirm. The slot
//! count is not a power of two (the home slot is the hash's high half scaled to
//! it), so the table stays at 64-80% load instead of dropping to 40% after growing.
//! Lookups of many keys are pipelined, each key's loads issued a few keys before
//! it is resolved, so that their cache misses overlap.

use crate::prefetch::prefetch;

mod halves;

/// An empty id.
const EMPTY: u32 = u32::MAX;
/// An empty slot.
const EMPTY_SLOT: u64 = u64::MAX;

fn tag(hash: u64) -> u64 {
    hash << 32
}

fn slot_tag(slot: u64) -> u64 {
    slot & 0xffff_ffff_0000_0000
}

fn slot(hash: u64, id: u32) -> u64 {
    tag(hash) | u64::from(id)
}

fn id_of(slot: u64) -> u32 {
    slot as u32
}

/// The home slot of `hash` in a table of `slots` slots: the hash's high bits
/// scaled to the slot count, so homes grow with hashes.
fn home_slot(hash: u64, slots: usize) -> usize {
    // xxh3 mixes well: the high half places, the low half tags.
    ((u128::from(hash) * slots as u128) >> 64) as usize
}

/// Home regions a build sorts ids into ([`HomeOrder`]): at 10 M ids a
/// region spans about 24,000 slots (195 KB of table, within a core's L2), and
/// the 1,024 places the sort writes to stay within the TLB's reach. Measured
/// on 10 M ids: 512 regions build in 0.60x the time of placing the ids in id
/// order (290 against 490 ms), 4,096 in 0.82x, 64 in 0.78x.
const BUILD_REGIONS: u64 = 512;

/// Ids and their hashes in the order of their home slots, to region
/// precision: a stable counting sort by the high bits of each hash (a home
/// slot grows with its hash, whatever the table's size), so ids of one hash
/// keep their order. The hashes are read in id order and carried along, so a
/// build never reads them at random.
#[derive(Debug, Default)]
pub(crate) struct HomeOrder {
    hashes: Vec<u64>,
    ids: Vec<u32>,
}

impl HomeOrder {
    /// `ids` (each hashed by `hashes[id]`) sorted by home region.
    pub fn new(ids: impl Iterator<Item = u32> + Clone, hashes: &[u64]) -> Self {
        let region = |hash: u64| ((u128::from(hash) * u128::from(BUILD_REGIONS)) >> 64) as usize;
        let mut next = vec![0usize; BUILD_REGIONS as usize + 1];
        for id in ids.clone() {
            next[region(hashes[id as usize]) + 1] += 1;
        }
        for at in 1..next.len() {
            next[at] += next[at - 1];
        }
        let total = next[BUILD_REGIONS as usize];
        let mut order = Self {
            hashes: vec![0u64; total],
            ids: vec![0u32; total],
        };
        for id in ids {
            let hash = hashes[id as usize];
            let place = &mut next[region(hash)];
            order.hashes[*place] = hash;
            order.ids[*place] = id;
            *place += 1;
        }
        order
    }
}

/// How many keys ahead [`IdTable::find_many`] fetches a candidate's hash (and
/// twice as far, a home slot). Measured on 10 M keys in 1000-key batches, mean
/// of three runs: 8 ahead 52.5 ns a key, 16 ahead 55.2 ns, and the groups of
/// 16 keys this replaced (each group waiting for its slowest) 69.5 ns.
const FIND_AHEAD: usize = 8;
/// How many ids ahead [`IdTable::build`] loads home slots: placing an id takes
/// a few nanoseconds, a load from memory a hundred or more.
const BUILD_AHEAD: usize = 64;

/// Slots of ids, probed by key hash; `hashes[id]` is the hash of `id`.
#[derive(Debug, Clone, Default)]
pub(crate) struct IdTable {
    slots: Vec<u64>,
    len: usize,
}

impl IdTable {
    /// A table that holds `capacity` ids without growing.
    pub fn with_capacity(capacity: usize) -> Self {
        let mut table = Self::default();
        if capacity > 0 {
            table.slots = vec![EMPTY_SLOT; Self::slots_for(capacity)];
        }
        table
    }

    /// A table of `ids` (each hashed by `hashes[id]`; about `count` of them).
    /// The ids are first put in the order of their home slots (by home
    /// region, [`HomeOrder`]), so that the build sweeps the table once
    /// instead of placing each id somewhere else in a table larger than any
    /// cache; each id's home slot is also loaded [`BUILD_AHEAD`] ids before it
    /// is placed. `Err(id)` names an id whose hash an id before it (in `ids`'
    /// order) already has.
    pub fn build<I>(ids: I, count: usize, hashes: &[u64]) -> Result<Self, u32>
    where
        I: Iterator<Item = u32> + Clone,
    {
        Self::with_capacity(count).fill(&HomeOrder::new(ids, hashes), hashes)
    }

    /// Places the ids of `order` into this table (built as [`Self::build`]
    /// does, for a caller that sorts and allocates on two threads). An empty
    /// table with room for them all is filled on two threads, one per half of
    /// the slots ([`IdTable::fill_in_halves`]). `Err(id)` names an id whose
    /// hash is in the table already.
    pub fn fill(mut self, order: &HomeOrder, hashes: &[u64]) -> Result<Self, u32> {
        if self.len == 0
            && order.ids.len() >= halves::FILL_IN_HALVES_FROM
            && self.slots.len() >= Self::slots_for(order.ids.len())
        {
            return self.fill_in_halves(order, hashes);
        }
        for (at, (&hash, &id)) in order.hashes.iter().zip(&order.ids).enumerate() {
            if let Some(&ahead) = order.hashes.get(at + BUILD_AHEAD) {
                self.prefetch_home(ahead);
            }
            self.make_room_for_one(hashes);
            if !self.place_new(hash, id, hashes) {
                return Err(id);
            }
            self.len += 1;
        }
        Ok(self)
    }

    /// Places `id`, whose hash is `hash`, unless the hash is in the table
    /// already (false then), in one probe: a slot's tag is checked before the
    /// hash it stands for is read.
    fn place_new(&mut self, hash: u64, id: u32, hashes: &[u64]) -> bool {
        let tag = tag(hash);
        let mut at = self.home(hash);
        loop {
            let slot = self.slots[at];
            if slot == EMPTY_SLOT {
                self.slots[at] = self::slot(hash, id);
                return true;
            }
            if slot_tag(slot) == tag && hashes.get(id_of(slot) as usize) == Some(&hash) {
                return false;
            }
            at = self.next(at);
        }
    }

    /// Slots for `len` ids at a load factor of at most 4/5.
    fn slots_for(len: usize) -> usize {
        (len.saturating_mul(5) / 4 + 1).max(8)
    }

    fn home(&self, hash: u64) -> usize {
        home_slot(hash, self.slots.len())
    }

    fn next(&self, at: usize) -> usize {
        if at + 1 == self.slots.len() {
            0
        } else {
            at + 1
        }
    }

    /// Ids stored.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Bytes of the slot array.
    pub fn allocation_size(&self) -> usize {
        self.slots.capacity() * 8
    }

    /// The id whose hash is `hash`.
    pub fn find(&self, hash: u64, hashes: &[u64]) -> Option<u32> {
        if self.slots.is_empty() {
            return None;
        }
        self.probe(hash, hashes, self.home(hash))
    }

    /// Probes from slot `at` on until `hash`'s id or an empty slot.
    fn probe(&self, hash: u64, hashes: &[u64], mut at: usize) -> Option<u32> {
        let tag = tag(hash);
        loop {
            let slot = self.slots[at];
            if slot == EMPTY_SLOT {
                return None;
            }
            if slot_tag(slot) == tag && hashes.get(id_of(slot) as usize) == Some(&hash) {
                return Some(id_of(slot));
            }
            at = self.next(at);
        }
    }

    /// Starts loading `hash`'s home slot (see [`IdTable::prefetch_candidate`]).
    #[inline]
    pub fn prefetch_home(&self, hash: u64) {
        if !self.slots.is_empty() {
            prefetch(&self.slots[self.home(hash)]);
        }
    }

    /// Starts loading the hash of the id in `hash`'s home slot when its tag
    /// matches: the second load of a lookup, issued once the slot (fetched by
    /// [`IdTable::prefetch_home`] a few keys earlier) is likely in cache.
    #[inline]
    pub fn prefetch_candidate(&self, hash: u64, hashes: &[u64]) {
        if self.slots.is_empty() {
            return;
        }
        let slot = self.slots[self.home(hash)];
        if slot != EMPTY_SLOT && slot_tag(slot) == tag(hash) {
            if let Some(candidate) = hashes.get(id_of(slot) as usize) {
                prefetch(candidate);
            }
        }
    }

    /// Looks up every hash of `wanted`, writing its id (or `u32::MAX`) to `out`.
    /// A pipeline over the keys: while a key is resolved, the home slot of the
    /// key `2 * FIND_AHEAD` places on is fetched, and the candidate hash of the
    /// key `FIND_AHEAD` places on (its slot fetched by then), so the two
    /// dependent cache misses of every lookup overlap with those of the keys
    /// around it instead of a group of keys waiting for its slowest.
    pub fn find_many(&self, wanted: &[u64], hashes: &[u64], out: &mut Vec<u32>) {
        out.clear();
        if self.slots.is_empty() {
            out.resize(wanted.len(), EMPTY);
            return;
        }
        out.reserve(wanted.len());
        for (i, &hash) in wanted.iter().enumerate() {
            if let Some(&ahead) = wanted.get(i + 2 * FIND_AHEAD) {
                prefetch(&self.slots[self.home(ahead)]);
            }
            if let Some(&ahead) = wanted.get(i + FIND_AHEAD) {
                self.prefetch_candidate(ahead, hashes);
            }
            out.push(self.probe(hash, hashes, self.home(hash)).unwrap_or(EMPTY));
        }
    }

    /// Inserts `id`, whose hash `hashes[id]` is not in the table yet.
    pub fn insert(&mut self, id: u32, hashes: &[u64]) {
        self.make_room_for_one(hashes);
        self.place(id, hashes);
        self.len += 1;
    }

    /// Grows the table if one more id would take it past its load factor.
    fn make_room_for_one(&mut self, hashes: &[u64]) {
        if Self::slots_for(self.len + 1) > self.slots.len() {
            // Grow by half: amortized constant work per insert, load stays >= 53%.
            let slots =
                (self.slots.len() + self.slots.len() / 2).max(Self::slots_for(self.len + 1));
            self.grow(slots, hashes);
        }
    }

    fn place(&mut self, id: u32, hashes: &[u64]) {
        let hash = hashes[id as usize];
        let mut at = self.home(hash);
        while self.slots[at] != EMPTY_SLOT {
            at = self.next(at);
        }
        self.slots[at] = slot(hash, id);
    }

    fn grow(&mut self, slots: usize, hashes: &[u64]) {
        let old = std::mem::replace(&mut self.slots, vec![EMPTY_SLOT; slots]);
        for slot in old.into_iter().filter(|&slot| slot != EMPTY_SLOT) {
            self.place(id_of(slot), hashes);
        }
    }

    /// Removes the id whose hash is `hash`; returns it.
    pub fn remove(&mut self, hash: u64, hashes: &[u64]) -> Option<u32> {
        let found = self.find(hash, hashes)?;
        let mut hole = self.home(hash);
        while id_of(self.slots[hole]) != found {
            hole = self.next(hole);
        }
        self.slots[hole] = EMPTY_SLOT;
        self.len -= 1;
        // Backward shift: move later members of the probe run into the hole when
        // their home is not between the hole and their slot (cyclically).
        let mut at = hole;
        loop {
            at = self.next(at);
            let slot = self.slots[at];
            if slot == EMPTY_SLOT {
                break;
            }
            let home = self.home(hashes[id_of(slot) as usize]);
            let stays = if hole <= at {
                hole < home && home <= at
            } else {
                hole < home || home <= at
            };
            if !stays {
                self.slots[hole] = slot;
                self.slots[at] = EMPTY_SLOT;
                hole = at;
            }
        }
        Some(found)
    }

    /// Makes room for `additional` more ids without growing.
    pub fn reserve(&mut self, additional: usize, hashes: &[u64]) {
        let wanted = Self::slots_for(self.len.saturating_add(additional));
        if wanted > self.slots.len() {
            self.grow(wanted, hashes);
        }
    }

    /// Whether the slot array is larger than its ids need (as after a
    /// reservation that was more than was inserted); [`IdTable::build`] makes
    /// one of the right size.
    pub fn is_oversized(&self) -> bool {
        self.slots.len() > Self::slots_for(self.len)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn behaves_like_a_map_under_inserts_and_removals() {
        let mut hashes: Vec<u64> = Vec::new();
        let mut table = IdTable::default();
        let mut model: HashMap<u64, u32> = HashMap::new();
        let mut state = 12345u64;
        for step in 0..20_000u64 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            // A small key space with clustered hashes exercises collisions.
            let hash = (state % 3000) << 51 | (state % 7);
            if step % 3 == 2 {
                assert_eq!(table.remove(hash, &hashes), model.remove(&hash));
            } else if let std::collections::hash_map::Entry::Vacant(entry) = model.entry(hash) {
                let id = hashes.len() as u32;
                hashes.push(hash);
                table.insert(id, &hashes);
                entry.insert(id);
            }
            assert_eq!(table.len(), model.len());
        }
        let wanted: Vec<u64> = (0..4000u64).map(|k| (k % 3000) << 51 | (k % 7)).collect();
        let mut out = Vec::new();
        table.find_many(&wanted, &hashes, &mut out);
        for (hash, id) in wanted.iter().zip(&out) {
            assert_eq!(table.find(*hash, &hashes), model.get(hash).copied());
            assert_eq!(model.get(hash).copied().unwrap_or(EMPTY), *id);
        }
    }

    /// `count` distinct pseudo-random hashes.
    fn clustered_hashes(count: u64) -> Vec<u64> {
        (0..count)
            .map(|k| ((k.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 8) << 8) | (k % 7))
            .collect()
    }

    #[test]
    fn a_built_table_finds_what_inserts_would() {
        let hashes = clustered_hashes(200_000);
        // Every third id is left out, as free ids are.
        let ids = (0..hashes.len() as u32).filter(|id| id % 3 != 0);
        let built = IdTable::build(ids.clone(), ids.clone().count(), &hashes).unwrap();
        let mut inserted = IdTable::default();
        for id in ids.clone() {
            inserted.insert(id, &hashes);
        }
        assert_eq!(built.len(), inserted.len());
        for (id, &hash) in hashes.iter().enumerate() {
            let expected = (id % 3 != 0).then_some(id as u32);
            assert_eq!(built.find(hash, &hashes), expected);
            assert_eq!(inserted.find(hash, &hashes), expected);
        }
        // A count below the truth still builds: the table grows as it goes.
        let undersized = IdTable::build(ids.clone(), 10, &hashes).unwrap();
        assert!(ids
            .clone()
            .all(|id| undersized.find(hashes[id as usize], &hashes) == Some(id)));
    }

    #[test]
    fn a_build_names_the_second_id_of_a_hash() {
        // Fewer ids than the build looks ahead, and many more.
        for count in [50u32, 200_000] {
            let mut hashes = clustered_hashes(u64::from(count));
            hashes[40] = hashes[20];
            assert_eq!(
                IdTable::build(0..count, count as usize, &hashes).unwrap_err(),
                40
            );
            // The same tag (low half) and home slot, another hash: not a repeat.
            let mut hashes = clustered_hashes(u64::from(count));
            hashes[40] = hashes[20] ^ (1 << 32);
            let table = IdTable::build(0..count, count as usize, &hashes).unwrap();
            assert_eq!(table.find(hashes[40], &hashes), Some(40));
            assert_eq!(table.find(hashes[20], &hashes), Some(20));
        }
    }

    #[test]
    fn a_table_reserved_for_more_is_oversized_until_rebuilt() {
        let hashes = clustered_hashes(10_000);
        let mut table = IdTable::with_capacity(10_100);
        for id in 0..hashes.len() as u32 {
            table.insert(id, &hashes);
        }
        assert!(table.is_oversized());
        let rebuilt = IdTable::build(0..hashes.len() as u32, hashes.len(), &hashes).unwrap();
        assert!(!rebuilt.is_oversized());
        assert!(rebuilt.allocation_size() < table.allocation_size());
    }
}
