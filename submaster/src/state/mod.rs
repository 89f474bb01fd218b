//! The sub-master's state and `apply`, the pure fold over its event stream.
//!
//! State has two parts. The **durable** part (segments, allocators, complete
//! objects, the applied sequence) changes only through [`State::apply`], so a standby
//! that folds the same events holds the same state. The **ephemeral** part (pending
//! puts, read leases, node liveness, the takeover grace period) lives only in the
//! serving leader and is changed by command handlers directly; a new leader starts
//! it afresh (pending puts are lost, every object is treated as leased for one lease
//! TTL).

use std::collections::HashMap;
use std::sync::Arc;

use hkvm_events::{
    KvEvent, NodeId, Placement, PutCommitted, PutFlags, RdmaEndpoint, SegmentId, SegmentMounted,
};

use crate::allocator::SegmentAllocator;
use crate::keyhash::KeyHashBuilder;

mod bulk;
mod leases;
mod table;

pub use bulk::{BulkRestore, Decoded, RestoredAllocators, UsedRanges, MAX_BATCH};
pub use leases::{CarveError, SpaceLease, SpaceLeases};
pub use table::ObjectTable;

/// Index of a mounted segment in the state's segment table; objects refer to
/// segments by slot so a replica costs 16 bytes, not a copy of the segment name.
pub type Slot = u32;

/// One replica of an object: a segment slot and an offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replica {
    /// The segment's slot.
    pub slot: Slot,
    /// Byte offset inside the segment.
    pub offset: u64,
}

/// An object's replicas: up to two are held inline (no allocation per
/// object; 40 bytes against a boxed slice's 16 plus a 32-byte allocation for
/// two), more spill to the heap.
pub type Replicas = smallvec::SmallVec<[Replica; 2]>;

/// A complete object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Object {
    /// Value size.
    pub size: u64,
    /// xxh3-64 of the value.
    pub checksum: u64,
    /// Its replicas (at least one).
    pub replicas: Replicas,
    /// Put flags (hard pin).
    pub flags: PutFlags,
    /// Commit order: smaller is older (eviction is oldest-first).
    pub order: u64,
    /// Ephemeral: read lease expiry in the state clock's milliseconds (0: none).
    pub lease_until_ms: u64,
    /// The id of the put that committed it (0: none), so that a `put_end` sent
    /// again learns that its own put is the one committed.
    pub put_id: u64,
}

/// A mounted segment.
#[derive(Debug, Clone)]
pub struct Segment {
    /// Its name.
    pub id: SegmentId,
    /// The owning node.
    pub node: NodeId,
    /// The node's transfer endpoint.
    pub endpoint: String,
    /// How peers reach it over RDMA (none: TCP only).
    pub rdma: Option<RdmaEndpoint>,
    /// Free-space bookkeeping.
    pub allocator: SegmentAllocator,
}

/// An ephemeral reservation made by `put_start`, committed by `put_end`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingPut {
    /// Value size.
    pub size: u64,
    /// The reserved replicas.
    pub replicas: Vec<Replica>,
    /// When it started (state clock ms), for the put timeout.
    pub started_ms: u64,
    /// Whether the object will be hard-pinned.
    pub hard_pin: bool,
    /// The put's id from its `put_start` (0: none).
    pub put_id: u64,
}

/// Counters of events that did not fit the state (a bug or a corrupted stream);
/// they are logged and counted, never a panic.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ApplyAnomalies {
    /// A placement on an unknown segment was dropped.
    pub unknown_segment: u64,
    /// A placement overlapped space already in use.
    pub overlapping_range: u64,
}

/// The whole state of one sub-cluster's master.
#[derive(Debug, Default)]
pub struct State {
    /// Last applied stream sequence.
    pub applied_seq: u64,
    /// Highest leadership epoch seen in the stream.
    pub max_epoch: u64,
    slots: Vec<Option<Segment>>,
    free_slots: Vec<Slot>,
    by_segment: HashMap<SegmentId, Slot, KeyHashBuilder>,
    /// Mounted segments per node, so a ping's "is this node known" is one lookup
    /// instead of a scan of every segment.
    segments_per_node: HashMap<NodeId, u32, KeyHashBuilder>,
    objects: ObjectTable,
    next_order: u64,
    /// Apply anomalies so far.
    pub anomalies: ApplyAnomalies,
    /// Ephemeral: pending puts by key.
    pub pending: HashMap<String, PendingPut, KeyHashBuilder>,
    /// Ephemeral: space leases granted for `put_commit`.
    pub leases: SpaceLeases,
    /// Ephemeral: last ping of each live node (state clock ms).
    pub liveness: HashMap<NodeId, u64, KeyHashBuilder>,
    /// Ephemeral: until this time every object counts as leased (after takeover).
    pub grace_until_ms: u64,
}

impl State {
    /// An empty state.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies every event of the message stored at `seq` by a producer in `epoch`.
    pub fn apply_message<'a>(
        &mut self,
        seq: u64,
        epoch: u64,
        events: impl IntoIterator<Item = &'a KvEvent>,
    ) {
        for event in events {
            self.apply(event);
        }
        self.applied_seq = seq;
        self.max_epoch = self.max_epoch.max(epoch);
    }

    /// Applies one event. Pure: the same events in the same order always give the
    /// same durable state.
    pub fn apply(&mut self, event: &KvEvent) {
        match event {
            KvEvent::SegmentMounted(mounted) => self.mount(mounted),
            KvEvent::SegmentUnmounted(unmounted) => self.unmount(&unmounted.segment),
            KvEvent::NodeLost(lost) => {
                for segment in self.segments_of(&lost.node) {
                    self.unmount(&segment);
                }
                self.liveness.remove(&lost.node);
            }
            KvEvent::PutCommitted(put) => self.commit_put(put),
            KvEvent::Evicted(evicted) => {
                for key in &evicted.keys {
                    self.remove_object(key);
                }
            }
            KvEvent::Removed(removed) => {
                for key in &removed.keys {
                    self.remove_object(key);
                }
            }
            KvEvent::Snapshot(_) => {}
        }
    }

    fn mount(&mut self, mounted: &SegmentMounted) {
        if let Some(&slot) = self.by_segment.get(&mounted.segment) {
            if let Some(Some(segment)) = self.slots.get_mut(slot as usize) {
                // A remount (same name): refresh where it is served, keep its data.
                let old = std::mem::replace(&mut segment.node, mounted.node.clone());
                segment.endpoint.clone_from(&mounted.endpoint);
                segment.rdma.clone_from(&mounted.rdma);
                self.forget_node_segment(&old);
                *self
                    .segments_per_node
                    .entry(mounted.node.clone())
                    .or_insert(0) += 1;
                return;
            }
        }
        let segment = Segment {
            id: mounted.segment.clone(),
            node: mounted.node.clone(),
            endpoint: mounted.endpoint.clone(),
            rdma: mounted.rdma.clone(),
            allocator: SegmentAllocator::new(mounted.size),
        };
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.slots[slot as usize] = Some(segment);
                slot
            }
            None => {
                self.slots.push(Some(segment));
                Slot::try_from(self.slots.len() - 1).unwrap_or(Slot::MAX)
            }
        };
        self.by_segment.insert(mounted.segment.clone(), slot);
        *self
            .segments_per_node
            .entry(mounted.node.clone())
            .or_insert(0) += 1;
    }

    fn forget_node_segment(&mut self, node: &NodeId) {
        if let Some(count) = self.segments_per_node.get_mut(node) {
            *count -= 1;
            if *count == 0 {
                self.segments_per_node.remove(node);
            }
        }
    }

    fn unmount(&mut self, segment: &SegmentId) {
        let Some(slot) = self.by_segment.remove(segment) else {
            return;
        };
        if let Some(entry) = self.slots.get_mut(slot as usize) {
            if let Some(gone) = entry.take() {
                self.forget_node_segment(&gone.node);
            }
        }
        self.free_slots.push(slot);
        // Replicas on it are gone; objects without any replica are gone.
        self.objects.retain(|_, object| {
            if object.replicas.iter().any(|r| r.slot == slot) {
                object.replicas.retain(|r| r.slot != slot);
            }
            !object.replicas.is_empty()
        });
        self.pending
            .retain(|_, pending| pending.replicas.iter().all(|r| r.slot != slot));
        // A lease with a range there ends; its ranges elsewhere go back.
        for (replica, len) in self.leases.forget_slot(slot) {
            self.free_replicas(&[replica], len);
        }
    }

    fn commit_put(&mut self, put: &PutCommitted) {
        if let Some(old) = self.objects.get(put.key.as_str()).cloned() {
            // Last writer wins (a leader never commits an existing key).
            self.free_replicas(&old.replicas, old.size);
            self.objects.remove(put.key.as_str());
        }
        let replicas: Vec<Replica> = match self.pending.remove(&put.key) {
            Some(pending) if self.same_placements(&pending.replicas, &put.placements) => {
                pending.replicas
            }
            other => {
                if let Some(pending) = other {
                    self.free_replicas(&pending.replicas, pending.size);
                }
                self.reserve_placements(&put.placements, put.size)
            }
        };
        if replicas.is_empty() {
            return;
        }
        let order = self.next_order;
        self.next_order += 1;
        self.objects.insert(
            Arc::from(put.key.as_str()),
            Object {
                size: put.size,
                checksum: put.checksum,
                replicas: Replicas::from_slice(&replicas),
                flags: put.flags,
                order,
                lease_until_ms: 0,
                put_id: put.put_id,
            },
        );
    }

    fn same_placements(&self, replicas: &[Replica], placements: &[Placement]) -> bool {
        replicas.len() == placements.len()
            && replicas.iter().zip(placements).all(|(replica, placement)| {
                self.by_segment.get(&placement.segment) == Some(&replica.slot)
                    && replica.offset == placement.offset
            })
    }

    fn reserve_placements(&mut self, placements: &[Placement], size: u64) -> Vec<Replica> {
        let mut replicas = Vec::with_capacity(placements.len());
        for placement in placements {
            let Some(&slot) = self.by_segment.get(&placement.segment) else {
                self.anomalies.unknown_segment += 1;
                tracing::warn!(segment = %placement.segment, "put on an unknown segment; replica dropped");
                continue;
            };
            if let Some(Some(segment)) = self.slots.get_mut(slot as usize) {
                if segment
                    .allocator
                    .reserve_at(placement.offset, size)
                    .is_err()
                {
                    self.anomalies.overlapping_range += 1;
                    tracing::warn!(segment = %placement.segment, offset = placement.offset, size, "put overlaps used space");
                }
            }
            replicas.push(Replica {
                slot,
                offset: placement.offset,
            });
        }
        replicas
    }

    /// Frees the space of `replicas` of an object of `size` bytes.
    pub fn free_replicas(&mut self, replicas: &[Replica], size: u64) {
        for replica in replicas {
            if let Some(Some(segment)) = self.slots.get_mut(replica.slot as usize) {
                segment.allocator.free(replica.offset, size);
            }
        }
    }

    fn remove_object(&mut self, key: &str) {
        if let Some(object) = self.objects.remove(key) {
            self.free_replicas(&object.replicas, object.size);
        }
    }

    // ---- queries ---------------------------------------------------------------

    /// A complete object.
    pub fn object(&self, key: &str) -> Option<&Object> {
        self.objects.get(key)
    }

    /// A complete object, mutably (for ephemeral lease updates).
    pub fn object_mut(&mut self, key: &str) -> Option<&mut Object> {
        self.objects.get_mut(key)
    }

    /// All complete objects.
    pub fn objects(&self) -> impl Iterator<Item = (&str, &Object)> {
        self.objects.iter().map(|(key, object)| (&**key, object))
    }

    /// How many slices [`State::objects_in_slice`] divides the objects into.
    pub fn object_slices(&self) -> usize {
        self.objects.chunk_count()
    }

    /// The complete objects of slice `index` (none past the last): a scan a
    /// slice at a time, with commands applied in between, sees every object
    /// that stays all along exactly once.
    pub fn objects_in_slice(&self, index: usize) -> impl Iterator<Item = (&str, &Object)> {
        self.objects
            .chunk(index)
            .map(|(key, object)| (&**key, object))
    }

    /// All complete objects with their shared keys (a snapshot copies the
    /// pointer, not the key).
    pub fn objects_shared(&self) -> impl Iterator<Item = (&Arc<str>, &Object)> {
        self.objects.iter()
    }

    /// Bytes of the complete objects of `tenant` (each counted once, whatever
    /// its replicas); 0 for the default tenant, which is not counted.
    pub fn tenant_bytes(&self, tenant: &str) -> u64 {
        self.objects.tenant_bytes(tenant)
    }

    /// Number of complete objects.
    pub fn object_count(&self) -> usize {
        self.objects.len()
    }

    /// A segment by slot.
    pub fn segment(&self, slot: Slot) -> Option<&Segment> {
        self.slots.get(slot as usize).and_then(Option::as_ref)
    }

    /// A segment by slot, mutably (for ephemeral reservations).
    pub fn segment_mut(&mut self, slot: Slot) -> Option<&mut Segment> {
        self.slots.get_mut(slot as usize).and_then(Option::as_mut)
    }

    /// The slot of a segment.
    pub fn slot_of(&self, segment: &SegmentId) -> Option<Slot> {
        self.by_segment.get(segment).copied()
    }

    /// Slots in the segment table, mounted or vacant: every slot is below this.
    pub fn slot_count(&self) -> usize {
        self.slots.len()
    }

    /// Every mounted segment with its slot.
    pub fn segments(&self) -> impl Iterator<Item = (Slot, &Segment)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(slot, segment)| Some((Slot::try_from(slot).ok()?, segment.as_ref()?)))
    }

    /// The segments a node has mounted.
    pub fn segments_of(&self, node: &NodeId) -> Vec<SegmentId> {
        self.segments()
            .filter(|(_, segment)| &segment.node == node)
            .map(|(_, segment)| segment.id.clone())
            .collect()
    }

    /// Every node with a segment mounted.
    pub fn nodes(&self) -> impl Iterator<Item = &NodeId> {
        self.segments_per_node.keys()
    }

    /// Whether a node has any segment mounted.
    pub fn knows_node(&self, node: &NodeId) -> bool {
        self.segments_per_node.contains_key(node)
    }

    /// Keys whose every replica is on `slots` (they vanish if those go).
    pub fn keys_only_on(&self, slots: &[Slot]) -> Vec<String> {
        self.objects
            .iter()
            .filter(|(_, object)| object.replicas.iter().all(|r| slots.contains(&r.slot)))
            .map(|(key, _)| key.to_string())
            .collect()
    }

    /// Total and used bytes over all segments.
    pub fn usage(&self) -> (u64, u64) {
        self.segments().fold((0, 0), |(total, used), (_, segment)| {
            (
                total + segment.allocator.size(),
                used + segment.allocator.used_bytes(),
            )
        })
    }

    /// The public placements of replicas (segment names).
    pub fn placements(&self, replicas: &[Replica]) -> Vec<Placement> {
        replicas
            .iter()
            .filter_map(|replica| {
                Some(Placement {
                    segment: self.segment(replica.slot)?.id.clone(),
                    offset: replica.offset,
                })
            })
            .collect()
    }

    /// Durable-state equality: the same segments (names, nodes, endpoints, free
    /// space) and the same objects. Used by tests and the restore check.
    pub fn same_durable_state(&self, other: &State) -> bool {
        let segments = |state: &State| {
            let mut list: Vec<(String, String, String, Option<RdmaEndpoint>, u64, u64)> = state
                .segments()
                .map(|(_, s)| {
                    (
                        s.id.to_string(),
                        s.node.to_string(),
                        s.endpoint.clone(),
                        s.rdma.clone(),
                        s.allocator.size(),
                        s.allocator.free_bytes(),
                    )
                })
                .collect();
            list.sort();
            list
        };
        let objects = |state: &State| {
            let mut list: Vec<(String, u64, u64, Vec<Placement>, u32, u64)> = state
                .objects()
                .map(|(key, o)| {
                    (
                        key.to_owned(),
                        o.size,
                        o.checksum,
                        state.placements(&o.replicas),
                        o.flags.0,
                        o.put_id,
                    )
                })
                .collect();
            list.sort_by(|a, b| a.0.cmp(&b.0));
            list
        };
        self.applied_seq == other.applied_seq
            && segments(self) == segments(other)
            && objects(self) == objects(other)
    }
}

#[cfg(test)]
mod tests {
    use hkvm_events::{NodeLost, SegmentUnmounted};

    use super::*;

    fn mount(state: &mut State, node: &str, segment: &str) {
        state.apply(&KvEvent::SegmentMounted(SegmentMounted {
            node: NodeId::new(node).unwrap(),
            segment: SegmentId::new(segment).unwrap(),
            size: 1 << 20,
            endpoint: "127.0.0.1:1".to_owned(),
            rdma: None,
        }));
    }

    #[test]
    fn a_node_is_known_while_it_has_a_segment() {
        let mut state = State::new();
        let (a, b) = (NodeId::new("a").unwrap(), NodeId::new("b").unwrap());
        mount(&mut state, "a", "a-0");
        mount(&mut state, "a", "a-1");
        assert!(state.knows_node(&a) && !state.knows_node(&b));
        state.apply(&KvEvent::SegmentUnmounted(SegmentUnmounted {
            node: a.clone(),
            segment: SegmentId::new("a-0").unwrap(),
        }));
        assert!(state.knows_node(&a));
        // A remount of a-1 by node b moves it.
        mount(&mut state, "b", "a-1");
        assert!(!state.knows_node(&a) && state.knows_node(&b));
        state.apply(&KvEvent::NodeLost(NodeLost { node: b.clone() }));
        assert!(!state.knows_node(&b));
    }
}
