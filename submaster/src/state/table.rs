//! The state's object table: each object stored once, densely, in chunks of a
//! fixed size, and found through an index of 4-byte positions.
//!
//! A map holding the objects in its buckets paid for its empty buckets at the
//! object's full size (104 bytes): the table doubles when it fills, so just
//! after it grows half of it is empty, about 220 bytes per object at 1 M
//! objects. Here the empty buckets of the index cost 5 bytes each, and the
//! entries grow a chunk at a time, so the slack is at most one chunk for the
//! whole table. A vacated entry is reused by the next insert.

use std::collections::HashMap;
use std::hash::BuildHasher as _;
use std::sync::Arc;

use hashbrown::HashTable;
use hkvm_events::tenant;

use super::Object;
use crate::keyhash::KeyHashBuilder;

/// Entries per chunk, as a power of two (16 Ki entries, about 1.7 MB).
const CHUNK_BITS: u32 = 14;
const CHUNK: usize = 1 << CHUNK_BITS;

/// One entry: a key and its object, or vacant.
type Entry = Option<(Arc<str>, Object)>;

/// Objects by key (see the module's documentation).
#[derive(Debug, Default)]
pub struct ObjectTable {
    /// Positions of the occupied entries, by the hash of their keys.
    index: HashTable<u32>,
    /// Every chunk but the last is full; each is allocated at its full size
    /// once and filled by pushes, so an entry is written when it is taken.
    chunks: Vec<Vec<Entry>>,
    /// Vacated positions, reused first.
    vacant: Vec<u32>,
    hasher: KeyHashBuilder,
    /// Bytes of the objects of each tenant but the default
    /// ([`hkvm_events::tenant`]), kept with every insert and removal.
    tenant_bytes: HashMap<Box<str>, u64>,
}

impl ObjectTable {
    /// How many objects it holds.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// How many objects the index holds before it grows.
    pub fn capacity(&self) -> usize {
        self.index.capacity()
    }

    /// The hasher that places keys in the index.
    pub fn hasher(&self) -> &KeyHashBuilder {
        &self.hasher
    }

    /// Makes room for `additional` more objects without growing the index.
    pub fn reserve(&mut self, additional: usize) {
        let Self {
            index,
            chunks,
            hasher,
            ..
        } = self;
        index.reserve(additional, |&position| {
            hasher.hash_one(key_at(chunks, position))
        });
    }

    /// The object under `key`.
    pub fn get(&self, key: &str) -> Option<&Object> {
        let position = self.position(key)?;
        entry(&self.chunks, position)
            .as_ref()
            .map(|(_, object)| object)
    }

    /// The object under `key`, mutably.
    pub fn get_mut(&mut self, key: &str) -> Option<&mut Object> {
        let position = self.position(key)?;
        entry_mut(&mut self.chunks, position)
            .as_mut()
            .map(|(_, object)| object)
    }

    /// Puts `object` under `key`; returns the object it replaced.
    pub fn insert(&mut self, key: Arc<str>, object: Object) -> Option<Object> {
        let hash = self.hasher.hash_one(&*key);
        self.insert_hashed(hash, key, object)
    }

    /// [`ObjectTable::insert`] of a key whose hash was computed already, with
    /// this table's [`ObjectTable::hasher`] (`hasher().hash_one(&*key)`): a
    /// bulk restore hashes each key once, on the thread that decodes it.
    pub fn insert_hashed(&mut self, hash: u64, key: Arc<str>, object: Object) -> Option<Object> {
        debug_assert_eq!(
            hash,
            self.hasher.hash_one(&*key),
            "hashed by another hasher"
        );
        self.charge(&key, object.size, 0);
        let chunks = &self.chunks;
        if let Some(&position) = self
            .index
            .find(hash, |&position| key_at(chunks, position) == &*key)
        {
            let charged = Arc::clone(&key);
            let slot = entry_mut(&mut self.chunks, position);
            let old = slot.replace((key, object)).map(|(_, old)| old);
            if let Some(old) = &old {
                self.charge(&charged, 0, old.size);
            }
            return old;
        }
        let position = self.place(key, object);
        let Self {
            index,
            chunks,
            hasher,
            ..
        } = self;
        index.insert_unique(hash, position, |&position| {
            hasher.hash_one(key_at(chunks, position))
        });
        None
    }

    /// Removes the object under `key`; returns it.
    pub fn remove(&mut self, key: &str) -> Option<Object> {
        let hash = self.hasher.hash_one(key);
        let chunks = &self.chunks;
        let found = self
            .index
            .find_entry(hash, |&position| key_at(chunks, position) == key)
            .ok()?;
        let (position, _) = found.remove();
        self.vacant.push(position);
        let removed = entry_mut(&mut self.chunks, position).take();
        removed.map(|(key, object)| {
            self.charge(&key, 0, object.size);
            object
        })
    }

    /// Bytes of the objects of `tenant` (0 for the default tenant: not kept).
    pub fn tenant_bytes(&self, tenant: &str) -> u64 {
        self.tenant_bytes.get(tenant).copied().unwrap_or(0)
    }

    /// Adds `added` and takes `taken` bytes from the tenant of `key`, if any.
    fn charge(&mut self, key: &str, added: u64, taken: u64) {
        let Some(tenant) = tenant::tenant_of(key) else {
            return;
        };
        let bytes = self.tenant_bytes.entry(tenant.into()).or_insert(0);
        *bytes = bytes.saturating_add(added).saturating_sub(taken);
        if *bytes == 0 {
            self.tenant_bytes.remove(tenant);
        }
    }

    /// Keeps the objects for which `keep` returns true (it may change them).
    pub fn retain(&mut self, mut keep: impl FnMut(&str, &mut Object) -> bool) {
        let Self {
            index,
            chunks,
            vacant,
            ..
        } = self;
        let mut dropped: Vec<(Arc<str>, u64)> = Vec::new();
        index.retain(|&mut position| {
            let slot = entry_mut(chunks, position);
            let kept = slot.as_mut().is_some_and(|(key, object)| keep(key, object));
            if !kept {
                if let Some((key, object)) = slot.take() {
                    if key.starts_with(tenant::TENANT_MARK) {
                        dropped.push((key, object.size));
                    }
                }
                vacant.push(position);
            }
            kept
        });
        for (key, size) in dropped {
            self.charge(&key, 0, size);
        }
    }

    /// Every key and object, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&Arc<str>, &Object)> {
        self.chunks
            .iter()
            .flat_map(|chunk| chunk.iter())
            .filter_map(|entry| entry.as_ref().map(|(key, object)| (key, object)))
    }

    /// How many chunks of entries the table has (see [`ObjectTable::chunk`]).
    pub fn chunk_count(&self) -> usize {
        self.chunks.len()
    }

    /// The objects in chunk `index` of the table (none past the end): a scan of
    /// the table a chunk at a time, with other work in between, sees every
    /// object that stays in the table all along exactly once.
    pub fn chunk(&self, index: usize) -> impl Iterator<Item = (&Arc<str>, &Object)> {
        self.chunks
            .get(index)
            .into_iter()
            .flat_map(|chunk| chunk.iter())
            .filter_map(|entry| entry.as_ref().map(|(key, object)| (key, object)))
    }

    /// Where `key`'s entry is.
    fn position(&self, key: &str) -> Option<u32> {
        let hash = self.hasher.hash_one(key);
        self.index
            .find(hash, |&position| key_at(&self.chunks, position) == key)
            .copied()
    }

    /// Stores an entry in a vacated position, or else in a fresh one (a new
    /// chunk when the last is full); returns the position.
    fn place(&mut self, key: Arc<str>, object: Object) -> u32 {
        if let Some(position) = self.vacant.pop() {
            *entry_mut(&mut self.chunks, position) = Some((key, object));
            return position;
        }
        let full = self.chunks.last().is_none_or(|chunk| chunk.len() == CHUNK);
        if full {
            self.chunks.push(Vec::with_capacity(CHUNK));
        }
        let position = (self.chunks.len() - 1) * CHUNK + self.chunks.last().map_or(0, Vec::len);
        // 2^32 objects would be some 450 GB of state in one sub-master.
        let position = u32::try_from(position)
            .unwrap_or_else(|_| unreachable!("more than 2^32 objects in one sub-master"));
        if let Some(last) = self.chunks.last_mut() {
            last.push(Some((key, object)));
        }
        position
    }
}

/// The entry at `position`.
fn entry(chunks: &[Vec<Entry>], position: u32) -> &Entry {
    let position = position as usize;
    &chunks[position >> CHUNK_BITS][position & (CHUNK - 1)]
}

/// The entry at `position`, mutably.
fn entry_mut(chunks: &mut [Vec<Entry>], position: u32) -> &mut Entry {
    let position = position as usize;
    &mut chunks[position >> CHUNK_BITS][position & (CHUNK - 1)]
}

/// The key at `position`, an occupied entry (every position in the index is).
fn key_at(chunks: &[Vec<Entry>], position: u32) -> &str {
    entry(chunks, position)
        .as_ref()
        .map_or("", |(key, _)| &**key)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;
    use crate::state::{PutFlags, Replicas};

    fn object(size: u64) -> Object {
        Object {
            size,
            checksum: size * 7,
            replicas: Replicas::new(),
            flags: PutFlags::default(),
            order: size,
            lease_until_ms: 0,
            put_id: 0,
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u8, u64),
        Remove(u8),
        Touch(u8, u64),
        RetainBelow(u64),
        Reserve(u16),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            8 => (any::<u8>(), 0u64..1000).prop_map(|(k, v)| Op::Insert(k, v)),
            4 => any::<u8>().prop_map(Op::Remove),
            2 => (any::<u8>(), 0u64..1000).prop_map(|(k, v)| Op::Touch(k, v)),
            1 => (0u64..1000).prop_map(Op::RetainBelow),
            1 => (0u16..3000).prop_map(Op::Reserve),
        ]
    }

    proptest! {
        /// Every operation answers as a map would, and afterwards the table
        /// holds what the map holds.
        #[test]
        fn the_table_behaves_as_a_map(ops in proptest::collection::vec(op(), 0..400)) {
            let mut table = ObjectTable::default();
            let mut model: HashMap<String, Object> = HashMap::new();
            for op in ops {
                match op {
                    Op::Insert(k, v) => {
                        let key = format!("key-{k}");
                        let old = table.insert(Arc::from(key.as_str()), object(v));
                        prop_assert_eq!(old, model.insert(key, object(v)));
                    }
                    Op::Remove(k) => {
                        let key = format!("key-{k}");
                        prop_assert_eq!(table.remove(&key), model.remove(&key));
                    }
                    Op::Touch(k, v) => {
                        let key = format!("key-{k}");
                        if let Some(object) = table.get_mut(&key) {
                            object.lease_until_ms = v;
                        }
                        if let Some(object) = model.get_mut(&key) {
                            object.lease_until_ms = v;
                        }
                    }
                    Op::RetainBelow(limit) => {
                        table.retain(|_, object| {
                            object.checksum += 1;
                            object.size < limit
                        });
                        model.retain(|_, object| {
                            object.checksum += 1;
                            object.size < limit
                        });
                    }
                    Op::Reserve(more) => table.reserve(usize::from(more)),
                }
                prop_assert_eq!(table.len(), model.len());
            }
            let held: HashMap<String, Object> = table
                .iter()
                .map(|(key, object)| (key.to_string(), object.clone()))
                .collect();
            prop_assert_eq!(&held, &model);
            for (key, object) in &model {
                prop_assert_eq!(table.get(key), Some(object));
            }
            prop_assert_eq!(table.get("absent"), None);
        }
    }

    #[test]
    fn vacated_entries_are_reused_and_chunks_grow_one_at_a_time() {
        let mut table = ObjectTable::default();
        for i in 0..CHUNK as u64 {
            table.insert(Arc::from(format!("k{i}").as_str()), object(i));
        }
        assert_eq!(table.chunks.len(), 1);
        table.remove("k5");
        table.insert(Arc::from("fresh"), object(1));
        assert_eq!(table.chunks.len(), 1, "the vacated entry was reused");
        table.insert(Arc::from("one more"), object(2));
        assert_eq!(table.chunks.len(), 2);
        assert_eq!(table.len(), CHUNK + 1);
    }
}
