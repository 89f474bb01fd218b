//! The sub-master's side of snapshots: its [`State`] to and from the snapshot
//! format of [`hkvm_events::snapshot`] (which also owns the store). A restored
//! state is rebuilt through [`State::apply`], so it is the same fold.

use hkvm_events::snapshot::{ObjectRecord, SegmentRecord, SnapshotFile, SnapshotStore};
use hkvm_events::{KvEvent, PutCommitted, PutFlags, SegmentMounted};

use crate::error::SubmasterError;
use crate::state::{Object, State};

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
        });
    }
    // Sort small (order, key, object) references, not the records: moving fat
    // records dominated encoding.
    let mut ordered: Vec<(u64, &str, &Object)> = state
        .objects()
        .map(|(key, object)| (object.order, key, object))
        .collect();
    ordered.sort_unstable_by_key(|(order, _, _)| *order);
    file.objects = ordered
        .into_iter()
        .map(|(_, key, object)| ObjectRecord {
            key: key.to_owned(),
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

/// Rebuilds a state from a snapshot (already verified by its decoder).
pub fn from_file(file: SnapshotFile) -> State {
    let mut state = State::new();
    for segment in &file.segments {
        state.apply(&KvEvent::SegmentMounted(SegmentMounted {
            node: segment.node.clone(),
            segment: segment.segment.clone(),
            size: segment.size,
            endpoint: segment.endpoint.clone(),
        }));
    }
    for object in &file.objects {
        let placements = file.placements(object).collect();
        let mut put =
            PutCommitted::new(object.key.clone(), object.size, object.checksum, placements);
        put.flags = PutFlags(object.flags);
        put.put_id = object.put_id;
        state.apply(&KvEvent::PutCommitted(put));
    }
    state.applied_seq = file.covers_seq;
    state.max_epoch = file.max_epoch;
    state
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
    Ok(from_file(SnapshotFile::decode(bytes)?))
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
    Ok(store.load_newest().await?.map(|(_, file)| from_file(file)))
}
