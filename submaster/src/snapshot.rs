//! Snapshots of the durable state, stamped with the stream sequence they cover and
//! an xxh3-64 checksum, kept in a JetStream object store (the newest two per
//! sub-cluster). Restore = newest snapshot that verifies + replay of the tail; a
//! restored state is rebuilt through [`State::apply`], so it is the same fold.

use async_nats::jetstream::{self, object_store};
use futures::StreamExt as _;
use hkvm_events::subject::bucket_name;
use hkvm_events::{
    ClusterId, KvEvent, NodeId, Placement, PutCommitted, PutFlags, SegmentId, SegmentMounted,
    SubclusterId,
};
use serde::{Deserialize, Serialize};
use tokio::io::AsyncReadExt as _;

use crate::error::{SubmasterError, SubmasterErrorKind};
use crate::state::State;

/// The snapshot format version this build writes and reads.
const SNAPSHOT_VERSION: u16 = 1;
/// Snapshots kept per sub-cluster.
const KEEP: usize = 2;

#[derive(Debug, Serialize, Deserialize)]
struct SegmentRecord {
    #[serde(rename = "n")]
    node: NodeId,
    #[serde(rename = "g")]
    segment: SegmentId,
    #[serde(rename = "s")]
    size: u64,
    #[serde(rename = "e")]
    endpoint: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct ObjectRecord {
    #[serde(rename = "k")]
    key: String,
    #[serde(rename = "s")]
    size: u64,
    #[serde(rename = "c")]
    checksum: u64,
    /// (index into the segment list, offset) per replica.
    #[serde(rename = "p")]
    replicas: Vec<(u32, u64)>,
    #[serde(rename = "f")]
    flags: u32,
}

/// The snapshot file (wire type).
#[derive(Debug, Serialize, Deserialize)]
struct SnapshotFile {
    #[serde(rename = "v")]
    version: u16,
    #[serde(rename = "q")]
    covers_seq: u64,
    #[serde(rename = "e")]
    max_epoch: u64,
    #[serde(rename = "g")]
    segments: Vec<SegmentRecord>,
    /// Oldest first, so a restore keeps the eviction order.
    #[serde(rename = "o")]
    objects: Vec<ObjectRecord>,
}

fn snapshot_error(what: &str, error: impl std::fmt::Display) -> SubmasterError {
    SubmasterError::new(SubmasterErrorKind::Snapshot, format!("{what}: {error}"))
}

/// Encodes the durable part of `state`: an 8-byte xxh3-64 of the body, then the body.
///
/// # Errors
/// Only if serialization fails.
pub fn encode(state: &State) -> Result<Vec<u8>, SubmasterError> {
    let mut index_of = std::collections::HashMap::new();
    let mut segments = Vec::new();
    for (slot, segment) in state.segments() {
        index_of.insert(slot, segments.len() as u32);
        segments.push(SegmentRecord {
            node: segment.node.clone(),
            segment: segment.id.clone(),
            size: segment.allocator.size(),
            endpoint: segment.endpoint.clone(),
        });
    }
    // Sort small (order, key, object) references, not the records: moving fat
    // records dominated encoding.
    let mut ordered: Vec<(u64, &str, &crate::state::Object)> = state
        .objects()
        .map(|(key, object)| (object.order, key, object))
        .collect();
    ordered.sort_unstable_by_key(|(order, _, _)| *order);
    let objects = ordered
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
        })
        .collect();
    let file = SnapshotFile {
        version: SNAPSHOT_VERSION,
        covers_seq: state.applied_seq,
        max_epoch: state.max_epoch,
        segments,
        objects,
    };
    let body = rmp_serde::to_vec_named(&file).map_err(|e| snapshot_error("encoding", e))?;
    let mut bytes = Vec::with_capacity(body.len() + 8);
    bytes.extend_from_slice(&xxhash_rust::xxh3::xxh3_64(&body).to_be_bytes());
    bytes.extend_from_slice(&body);
    Ok(bytes)
}

/// Decodes and verifies a snapshot, rebuilding the state through `apply`.
///
/// # Errors
/// A checksum mismatch, an unknown version, or a malformed body.
pub fn decode(bytes: &[u8]) -> Result<State, SubmasterError> {
    let (sum, body) = bytes
        .split_first_chunk::<8>()
        .ok_or_else(|| snapshot_error("decoding", "shorter than its checksum"))?;
    if u64::from_be_bytes(*sum) != xxhash_rust::xxh3::xxh3_64(body) {
        return Err(snapshot_error("verifying", "checksum mismatch"));
    }
    let file: SnapshotFile =
        rmp_serde::from_slice(body).map_err(|e| snapshot_error("decoding", e))?;
    if file.version != SNAPSHOT_VERSION {
        return Err(snapshot_error(
            "decoding",
            format!("unknown version {}", file.version),
        ));
    }
    let mut state = State::new();
    for segment in &file.segments {
        state.apply(&KvEvent::SegmentMounted(SegmentMounted {
            node: segment.node.clone(),
            segment: segment.segment.clone(),
            size: segment.size,
            endpoint: segment.endpoint.clone(),
        }));
    }
    for object in file.objects {
        let placements = object
            .replicas
            .iter()
            .filter_map(|(index, offset)| {
                Some(Placement {
                    segment: file.segments.get(*index as usize)?.segment.clone(),
                    offset: *offset,
                })
            })
            .collect();
        let mut put = PutCommitted::new(object.key, object.size, object.checksum, placements);
        put.flags = PutFlags(object.flags);
        state.apply(&KvEvent::PutCommitted(put));
    }
    state.applied_seq = file.covers_seq;
    state.max_epoch = file.max_epoch;
    Ok(state)
}

/// The snapshot store of one sub-cluster.
#[derive(Clone)]
pub struct SnapshotStore {
    store: object_store::ObjectStore,
    prefix: String,
}

impl std::fmt::Debug for SnapshotStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotStore")
            .field("prefix", &self.prefix)
            .finish()
    }
}

impl SnapshotStore {
    /// Opens (creating if needed) the cluster's snapshot object store.
    ///
    /// # Errors
    /// When JetStream refuses the store.
    pub async fn open(
        js: &jetstream::Context,
        cluster: &ClusterId,
        subcluster: &SubclusterId,
        replicas: usize,
    ) -> Result<Self, SubmasterError> {
        let bucket = bucket_name(cluster, "snapshots");
        let store = match js.get_object_store(&bucket).await {
            Ok(store) => store,
            Err(_) => js
                .create_object_store(object_store::Config {
                    bucket: bucket.clone(),
                    description: Some("HKVM sub-master snapshots".to_owned()),
                    num_replicas: replicas,
                    storage: jetstream::stream::StorageType::File,
                    ..Default::default()
                })
                .await
                .map_err(|e| snapshot_error("creating the snapshot store", e))?,
        };
        Ok(Self {
            store,
            prefix: format!("{subcluster}."),
        })
    }

    async fn names(&self) -> Result<Vec<String>, SubmasterError> {
        let mut list = self
            .store
            .list()
            .await
            .map_err(|e| snapshot_error("listing", e))?;
        let mut names = Vec::new();
        while let Some(info) = list.next().await {
            let info = info.map_err(|e| snapshot_error("listing", e))?;
            if info.name.starts_with(&self.prefix) && !info.deleted {
                names.push(info.name);
            }
        }
        // Names end in a zero-padded sequence: lexical order is sequence order.
        names.sort();
        Ok(names)
    }

    /// Stores a snapshot of `state` and drops all but the newest [`KEEP`].
    /// Returns the object name and the snapshot's checksum.
    ///
    /// # Errors
    /// When encoding or the object store fails.
    pub async fn save(&self, state: &State) -> Result<(String, u64), SubmasterError> {
        let bytes = encode(state)?;
        let checksum = xxhash_rust::xxh3::xxh3_64(&bytes);
        let name = format!("{}{:020}", self.prefix, state.applied_seq);
        self.store
            .put(name.as_str(), &mut bytes.as_slice())
            .await
            .map_err(|e| snapshot_error("storing", e))?;
        let names = self.names().await?;
        for old in names.iter().rev().skip(KEEP) {
            if let Err(error) = self.store.delete(old).await {
                tracing::warn!(%error, old, "could not drop an old snapshot");
            }
        }
        Ok((name, checksum))
    }

    /// Loads the newest snapshot that verifies; `None` when there is none.
    ///
    /// # Errors
    /// When the object store cannot be listed.
    pub async fn load_newest(&self) -> Result<Option<State>, SubmasterError> {
        for name in self.names().await?.iter().rev() {
            let mut bytes = Vec::new();
            let read = async {
                let mut object = self
                    .store
                    .get(name)
                    .await
                    .map_err(|e| snapshot_error("reading", e))?;
                object
                    .read_to_end(&mut bytes)
                    .await
                    .map_err(|e| snapshot_error("reading", e))
            };
            if let Err(error) = read.await {
                tracing::warn!(%error, name, "skipping an unreadable snapshot");
                continue;
            }
            match decode(&bytes) {
                Ok(state) => {
                    tracing::info!(
                        name,
                        covers_seq = state.applied_seq,
                        objects = state.object_count(),
                        "snapshot loaded"
                    );
                    return Ok(Some(state));
                }
                Err(error) => tracing::warn!(%error, name, "skipping an invalid snapshot"),
            }
        }
        Ok(None)
    }
}
