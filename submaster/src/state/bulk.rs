//! Restoring a state in bulk from a snapshot's objects: the inserts into the
//! object table ([`BulkRestore`], a batch at a time in the order of the keys'
//! home buckets) apart from the used ranges that become each segment's
//! allocator ([`UsedRanges`]), so that the two can run on two threads.

use std::sync::Arc;

use super::{Object, Replica, State};
use crate::allocator::SegmentAllocator;
use crate::keyhash::KeyHashBuilder;

/// One decoded object on its way into a [`BulkRestore`]: its key's hash (from
/// [`BulkRestore::hasher`], computed where it is decoded), its key and the
/// object. A batch holds them as `Some` until each is taken in order.
#[derive(Debug)]
pub struct Decoded {
    /// `hasher().hash_one(&*key)` of the restore's table.
    pub hash: u64,
    /// The key.
    pub key: Arc<str>,
    /// The object, admitted by [`UsedRanges::admit`].
    pub object: Object,
}

/// The bulk form of folding a snapshot's objects into a state that holds its
/// segments and nothing else: each object keeps the commit order it is given
/// (its place in the snapshot), and each segment's allocator is built once
/// from all its replicas' ranges ([`UsedRanges`], [`SegmentAllocator::with_used`]) instead of one
/// reservation per replica. The two halves can run on two threads: the ranges
/// and the keys' hashes where the snapshot is decoded, the inserts into the
/// object table (the part that misses the cache) on another.
#[derive(Debug)]
pub struct BulkRestore {
    state: State,
    homes: HomeBuckets,
    /// A batch's sort keys: home bucket, then position (kept to reuse memory).
    sort_keys: Vec<u64>,
}

/// Most objects in one [`BulkRestore::insert_batch`] (2^24: a position fits below the home bucket in one sort key).
pub const MAX_BATCH: usize = 1 << POSITION_BITS;
/// Bits of a batch position in an insertion sort key (below the home bucket).
const POSITION_BITS: u32 = 24;

impl BulkRestore {
    /// Starts restoring into `state` (its segments mounted), expecting about
    /// `objects` objects.
    pub fn new(mut state: State, objects: usize) -> Self {
        state.objects.reserve(objects);
        let homes = HomeBuckets::of_table(&state);
        Self {
            state,
            homes,
            sort_keys: Vec::new(),
        }
    }

    /// The hasher a [`Decoded`] key's hash comes from.
    pub fn hasher(&self) -> KeyHashBuilder {
        *self.state.objects.hasher()
    }

    /// Inserts a batch (at most [`MAX_BATCH`]) of objects admitted by
    /// [`UsedRanges::admit`], their commit order already given (their place in
    /// the snapshot: oldest first), and leaves `batch` empty. The batch goes in
    /// the order of its keys' home buckets, each object moved once, from the
    /// batch into the table; batches may come in any order, and of two records
    /// of one key the later (newer) one wins.
    pub fn insert_batch(&mut self, batch: &mut Vec<Option<Decoded>>) {
        let homes = self.homes;
        self.sort_keys.clear();
        self.sort_keys
            .extend(batch.iter().enumerate().filter_map(|(position, decoded)| {
                let decoded = decoded.as_ref()?;
                Some(homes.of(decoded.hash) << POSITION_BITS | position as u64)
            }));
        // Records of one key keep their order (the position breaks the tie).
        self.sort_keys.sort_unstable();
        let position_mask = (1u64 << POSITION_BITS) - 1;
        for sort_key in &self.sort_keys {
            let Some(Decoded { hash, key, object }) =
                batch[(sort_key & position_mask) as usize].take()
            else {
                continue;
            };
            self.state.next_order = self.state.next_order.max(object.order + 1);
            if self
                .state
                .objects
                .insert_hashed(hash, key, object)
                .is_some()
            {
                tracing::warn!("a snapshot holds a key twice; the newer record wins");
            }
        }
        batch.clear();
    }

    /// The restored state, with the allocators built from every object's ranges.
    pub fn finish(mut self, allocators: RestoredAllocators) -> State {
        for (slot, allocator) in allocators.per_slot.into_iter().enumerate() {
            if let (Some(Some(segment)), Some(allocator)) =
                (self.state.slots.get_mut(slot), allocator)
            {
                segment.allocator = allocator;
            }
        }
        self.state.anomalies.unknown_segment += allocators.unknown_segment;
        self.state.anomalies.overlapping_range += allocators.overlapping_range;
        self.state
    }
}

/// The home bucket of a key in a bulk restore's object table (where a probe
/// for it starts). Inserting a batch in the order of its home buckets sweeps
/// the table once instead of jumping across a table larger than any cache or
/// TLB reach, as inserting it in commit order does.
#[derive(Debug, Clone, Copy)]
struct HomeBuckets {
    mask: u64,
}

impl HomeBuckets {
    /// Where keys land in `state`'s object table as it is sized now.
    fn of_table(state: &State) -> Self {
        let capacity = state.objects.capacity() as u64;
        // The table's bucket count is a power of two holding `capacity` at a
        // load of 7/8; a wrong guess only costs locality, never correctness.
        let buckets = (capacity / 7 * 8).max(1).next_power_of_two();
        Self { mask: buckets - 1 }
    }

    /// The bucket where a probe for a key of `hash` starts.
    fn of(&self, hash: u64) -> u64 {
        hash & self.mask
    }
}

/// The ranges a snapshot's objects use, per segment, collected as the objects
/// are decoded. A replica on a slot without a segment is dropped and a range
/// over used space is not reserved, each counted as in a fold.
#[derive(Debug)]
pub struct UsedRanges {
    /// Usable size of the segment in each slot (none: no segment).
    sizes: Vec<Option<u64>>,
    /// (offset, size) of every replica, per slot.
    ranges: Vec<Vec<(u64, u64)>>,
    unknown_segment: u64,
}

impl UsedRanges {
    /// No ranges yet, over the segments `state` mounts.
    pub fn new(state: &State) -> Self {
        let sizes: Vec<Option<u64>> = state
            .slots
            .iter()
            .map(|slot| slot.as_ref().map(|segment| segment.allocator.size()))
            .collect();
        Self {
            ranges: vec![Vec::new(); sizes.len()],
            sizes,
            unknown_segment: 0,
        }
    }

    /// Keeps `object`'s replicas on mounted segments and records their ranges;
    /// false when none is left (the object is then dropped).
    pub fn admit(&mut self, object: &mut Object) -> bool {
        let sizes = &self.sizes;
        let known = |r: &Replica| sizes.get(r.slot as usize).is_some_and(Option::is_some);
        if !object.replicas.iter().all(known) {
            let unknown = object.replicas.iter().filter(|r| !known(r)).count();
            self.unknown_segment += unknown as u64;
            object.replicas = object.replicas.iter().copied().filter(known).collect();
        }
        for replica in object.replicas.iter() {
            self.ranges[replica.slot as usize].push((replica.offset, object.size));
        }
        !object.replicas.is_empty()
    }

    /// Sizes each segment's range list for `total` objects, extrapolating from
    /// the `seen` admitted so far (plus a sixteenth), so that the lists of a
    /// large restore are not grown by doubling: each doubling copies the list
    /// and touches twice its memory. A segment that got fewer replicas so far
    /// than later (mounted late) still grows as needed.
    pub fn reserve_like_so_far(&mut self, seen: usize, total: usize) {
        if seen == 0 || total <= seen {
            return;
        }
        for ranges in &mut self.ranges {
            let expected = ranges.len().saturating_mul(total) / seen;
            ranges.reserve(
                expected
                    .saturating_add(expected / 16)
                    .saturating_sub(ranges.len()),
            );
        }
    }

    /// Every mounted segment's allocator, built from its ranges.
    pub fn into_allocators(self) -> RestoredAllocators {
        let mut overlapping_range = 0;
        let per_slot = self
            .sizes
            .into_iter()
            .zip(self.ranges)
            .map(|(size, mut ranges)| {
                let size = size?;
                ranges.sort_unstable();
                let (allocator, refused) = SegmentAllocator::with_used(size, &ranges);
                overlapping_range += refused;
                Some(allocator)
            })
            .collect();
        RestoredAllocators {
            per_slot,
            unknown_segment: self.unknown_segment,
            overlapping_range,
        }
    }
}

/// Allocators built by [`UsedRanges::into_allocators`], for [`BulkRestore::finish`].
#[derive(Debug)]
pub struct RestoredAllocators {
    per_slot: Vec<Option<SegmentAllocator>>,
    unknown_segment: u64,
    overlapping_range: u64,
}

#[cfg(test)]
mod tests {
    use hkvm_events::{KvEvent, NodeId, PutFlags, SegmentId, SegmentMounted};

    use super::*;
    use crate::state::Replica;

    fn state_with_segments(count: usize) -> State {
        let mut state = State::new();
        for n in 0..count {
            state.apply(&KvEvent::SegmentMounted(SegmentMounted {
                node: NodeId::new(format!("n-{n}")).unwrap(),
                segment: SegmentId::new(format!("s-{n}")).unwrap(),
                size: 1 << 40,
                endpoint: "127.0.0.1:1".to_owned(),
                rdma: None,
            }));
        }
        state
    }

    fn object(slot: usize, offset: u64) -> Object {
        Object {
            size: 4096,
            checksum: 0,
            replicas: [Replica {
                slot: slot as crate::state::Slot,
                offset,
            }]
            .into_iter()
            .collect(),
            flags: PutFlags(0),
            order: 0,
            lease_until_ms: 0,
            put_id: 0,
        }
    }

    #[test]
    fn range_lists_are_sized_for_the_whole_restore_from_its_start() {
        let state = state_with_segments(2);
        let mut ranges = UsedRanges::new(&state);
        // Three replicas in four on slot 0 so far, of 4,000 objects to come.
        for n in 0..400u64 {
            let slot = usize::from(n % 4 == 3);
            assert!(ranges.admit(&mut object(slot, n * 4096)));
        }
        ranges.reserve_like_so_far(400, 4_000);
        assert!(ranges.ranges[0].capacity() >= 3_000);
        assert!(ranges.ranges[1].capacity() >= 1_000);
        // Within a sixteenth over the extrapolation, not a doubling.
        assert!(ranges.ranges[0].capacity() <= 3_000 + 3_000 / 16 + 16);
        // Nothing to extrapolate from: nothing reserved.
        let mut empty = UsedRanges::new(&state);
        empty.reserve_like_so_far(0, 4_000);
        assert_eq!(empty.ranges[0].capacity(), 0);
    }
}
