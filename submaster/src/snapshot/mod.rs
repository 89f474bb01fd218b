//! The sub-master's side of snapshots: its [`State`] to and from the snapshot
//! format of [`hkvm_events::snapshot`] (which also owns the store). A restore
//! builds the state while the snapshot is decoded ([`Restorer`]): segments through
//! [`State::apply`], objects in bulk; the result equals the fold of the same events.

use hkvm_events::snapshot::{ObjectRecord, SegmentRecord, SnapshotFile, SnapshotStore};
use std::sync::Arc;

use crate::error::{SubmasterError, SubmasterErrorKind};
use crate::state::{Object, State};

mod restorer;
mod writer;

pub use restorer::Restorer;
pub(crate) use writer::{encode_store_verify, on_writer_thread};
pub use writer::{store_verified, to_file_at_low_priority, WRITER_NICE};

/// The snapshot of the durable part of `state`, objects oldest first.
pub fn to_file(state: &State) -> SnapshotFile {
    let mut index_of = std::collections::HashMap::new();
    let mut file = SnapshotFile::new(state.applied_seq, state.max_epoch);
    for (slot, segment) in state.segments() {
        index_of.insert(slot, file.segments.len() as u32);
        file.segments.push(SegmentRecord {
            node: segment.node.clone(),
            segment: segment.id.clone(),
            size: segment.allocator.size(),
            endpoint: segment.endpoint.clone(),
            rdma: segment.rdma.clone(),
        });
    }
    // Sort small (order, key, object) references, not the records: moving fat
    // records dominated encoding. Keys are shared, not copied.
    let mut ordered: Vec<(u64, &Arc<str>, &Object)> = state
        .objects_shared()
        .map(|(key, object)| (object.order, key, object))
        .collect();
    ordered.sort_unstable_by_key(|(order, _, _)| *order);
    file.objects = ordered
        .into_iter()
        .map(|(_, key, object)| ObjectRecord {
            key: Arc::clone(key),
            size: object.size,
            checksum: object.checksum,
            replicas: object
                .replicas
                .iter()
                .filter_map(|r| Some((*index_of.get(&r.slot)?, r.offset)))
                .collect(),
            flags: object.flags.0,
            put_id: object.put_id,
        })
        .collect();
    file
}

/// Encodes `state` as snapshot bytes.
///
/// # Errors
/// Only if serialization fails.
pub fn encode(state: &State) -> Result<Vec<u8>, SubmasterError> {
    Ok(to_file(state).encode()?)
}

/// Decodes and verifies snapshot bytes into a state.
///
/// # Errors
/// A checksum mismatch, an unknown version, or a malformed body.
pub fn decode(bytes: &[u8]) -> Result<State, SubmasterError> {
    let mut restorer = Restorer::default();
    let header = SnapshotFile::decode_with(bytes, &mut restorer)?;
    Ok(restorer.finish(&header))
}

/// Stores a snapshot of `state`; returns the object name and its checksum.
///
/// # Errors
/// When encoding or the object store fails.
pub async fn save(store: &SnapshotStore, state: &State) -> Result<(String, u64), SubmasterError> {
    Ok(store.save(&to_file(state)).await?)
}

/// Loads the newest snapshot that verifies, as a state; `None` when there is none.
///
/// # Errors
/// When the object store cannot be listed.
pub async fn load_newest(store: &SnapshotStore) -> Result<Option<State>, SubmasterError> {
    let Some((name, header, restorer)) = store.load_newest_with(Restorer::default).await? else {
        return Ok(None);
    };
    let started = std::time::Instant::now();
    // Building the allocators sorts every replica's range: not on a runtime worker.
    let state = tokio::task::spawn_blocking(move || restorer.finish(&header))
        .await
        .map_err(|e| {
            SubmasterError::caused(SubmasterErrorKind::Snapshot, "restoring a snapshot", e)
        })?;
    tracing::info!(
        name,
        objects = state.object_count(),
        finish_ms = started.elapsed().as_millis() as u64,
        "state rebuilt from the snapshot"
    );
    Ok(Some(state))
}

#[cfg(test)]
mod tests {
    use hkvm_events::{
        KvEvent, NodeId, Placement, PutCommitted, Removed, SegmentId, SegmentMounted,
        SegmentUnmounted,
    };
    use proptest::prelude::*;

    use super::*;

    /// One step of a generated history, as a leader would write it: puts never
    /// overlap (each takes fresh space), removes and unmounts come anywhere.
    #[derive(Debug, Clone)]
    enum Step {
        Put { key: u8, size: u16, replicas: u8 },
        Remove { key: u8 },
        Unmount { segment: u8 },
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            6 => (0u8..40, 1u16..8192, 1u8..4).prop_map(|(key, size, replicas)| Step::Put { key, size, replicas }),
            2 => (0u8..40).prop_map(|key| Step::Remove { key }),
            1 => (0u8..3).prop_map(|segment| Step::Unmount { segment }),
        ]
    }

    fn events(steps: &[Step]) -> Vec<KvEvent> {
        let segment = |i: u8| SegmentId::new(format!("seg-{i}")).unwrap();
        let mut events: Vec<KvEvent> = (0..3u8)
            .map(|i| {
                KvEvent::SegmentMounted(SegmentMounted {
                    node: NodeId::new(format!("n{i}")).unwrap(),
                    segment: segment(i),
                    size: 1 << 30,
                    endpoint: format!("127.0.0.1:{}", 7000 + u16::from(i)),
                    // Segment 1's node serves RDMA too: its descriptor must
                    // survive the snapshot.
                    rdma: (i == 1).then(|| hkvm_events::RdmaEndpoint {
                        device: "mlx5_0".into(),
                        gid: [i; 16],
                        lid: 3,
                        exchange: "127.0.0.1:7101".into(),
                        rkey: 0x51,
                        addr: 0x7f00_0000_0000,
                        len: 1 << 30,
                    }),
                })
            })
            .collect();
        for (n, step) in steps.iter().enumerate() {
            events.push(match step {
                Step::Put {
                    key,
                    size,
                    replicas,
                } => {
                    let placements = (0..*replicas)
                        .map(|r| Placement {
                            segment: segment(r),
                            offset: n as u64 * 8192,
                        })
                        .collect();
                    let mut put = PutCommitted::new(
                        format!("k{key}"),
                        u64::from(*size),
                        n as u64,
                        placements,
                    );
                    put.put_id = n as u64 + 1;
                    KvEvent::PutCommitted(put)
                }
                Step::Remove { key } => KvEvent::Removed(Removed {
                    keys: vec![format!("k{key}")],
                }),
                Step::Unmount { segment: i } => KvEvent::SegmentUnmounted(SegmentUnmounted {
                    node: NodeId::new(format!("n{i}")).unwrap(),
                    segment: segment(*i),
                }),
            });
        }
        events
    }

    /// The keys from the oldest commit to the newest.
    fn oldest_first(state: &State) -> Vec<String> {
        let mut keys: Vec<(u64, String)> = state
            .objects()
            .map(|(key, object)| (object.order, key.to_owned()))
            .collect();
        keys.sort_unstable();
        keys.into_iter().map(|(_, key)| key).collect()
    }

    proptest! {
        /// Folding every event equals restoring a snapshot of a prefix and
        /// folding the rest: the bulk restore is the same fold, whether the
        /// objects are inserted in line or by the inserting thread in batches
        /// of any size.
        #[test]
        fn a_snapshot_plus_the_tail_equals_the_whole_fold(
            steps in proptest::collection::vec(step(), 0..120),
            cut in 0usize..130,
            batch in prop_oneof![1usize..9, Just(usize::MAX)],
        ) {
            let events = events(&steps);
            let cut = cut.min(events.len());
            let mut whole = State::new();
            for (seq, event) in events.iter().enumerate() {
                whole.apply_message(seq as u64 + 1, 1, [event]);
            }
            let mut prefix = State::new();
            for (seq, event) in events[..cut].iter().enumerate() {
                prefix.apply_message(seq as u64 + 1, 1, [event]);
            }
            let mut restorer = Restorer::with_batch(batch);
            let header = SnapshotFile::decode_with(&encode(&prefix).unwrap(), &mut restorer).unwrap();
            let mut restored = restorer.finish(&header);
            prop_assert!(restored.same_durable_state(&prefix));
            prop_assert_eq!(oldest_first(&restored), oldest_first(&prefix));
            for (seq, event) in events.iter().enumerate().skip(cut) {
                restored.apply_message(seq as u64 + 1, 1, [event]);
            }
            prop_assert!(restored.same_durable_state(&whole));
            // Eviction goes oldest first: the commit order survives the restore.
            prop_assert_eq!(oldest_first(&restored), oldest_first(&whole));
        }
    }
}
