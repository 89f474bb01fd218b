//! The sub-master snapshot format and its store: the durable state of one
//! sub-cluster (segments and committed objects, oldest first) stamped with the
//! stream sequence it covers, as one self-checking blob in a JetStream object store.
//! The sub-master writes snapshots and restores its state from them; the global
//! master and the inter-DC master read them (through [`SnapshotFile`]) to seed a
//! source whose stream history was purged, without rebuilding a sub-master.
//!
//! Layout: `xxh3-64(body)` as 8 big-endian bytes, then the body: a named-field
//! MessagePack map [`SnapshotFile`] (`v` version, `q` covered sequence, `e` highest
//! leader epoch, `g` segments, `o` objects). Objects are `(k key, s size, c value
//! checksum, p [(segment index, offset)], f flags)`.
//!
//! Objects are named `<subcluster>.<covered sequence, 20 digits>` in the bucket
//! [`Bucket::Snapshots`](crate::subject::Bucket::Snapshots); lexical order is
//! sequence order.

use async_nats::jetstream::{self, object_store};
use futures::StreamExt as _;
use serde::{Deserialize, Serialize};
use tokio::io::AsyncReadExt as _;

use crate::event::Placement;
use crate::id::{ClusterId, NodeId, SegmentId, SubclusterId};
use crate::subject::{bucket_name, snapshot_object_name, snapshot_object_prefix, Bucket};

/// The snapshot format version this build writes and reads.
pub const SNAPSHOT_VERSION: u16 = 1;
/// Snapshots kept per sub-cluster (older ones are deleted after a save).
pub const SNAPSHOTS_KEPT: usize = 2;

/// One mounted segment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentRecord {
    /// The node that contributes it.
    #[serde(rename = "n")]
    pub node: NodeId,
    /// Its id.
    #[serde(rename = "g")]
    pub segment: SegmentId,
    /// Its size in bytes.
    #[serde(rename = "s")]
    pub size: u64,
    /// Where its node serves transfers.
    #[serde(rename = "e")]
    pub endpoint: String,
}

/// One committed object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectRecord {
    /// Its key (shared: a sub-master's copy of its state and its restore move
    /// keys without copying them).
    #[serde(rename = "k")]
    pub key: std::sync::Arc<str>,
    /// Its size in bytes.
    #[serde(rename = "s")]
    pub size: u64,
    /// xxh3-64 of its value.
    #[serde(rename = "c")]
    pub checksum: u64,
    /// (index into [`SnapshotFile::segments`], offset) per replica.
    #[serde(rename = "p")]
    pub replicas: Vec<(u32, u64)>,
    /// Its [`PutFlags`](crate::PutFlags) bits.
    #[serde(rename = "f")]
    pub flags: u32,
    /// The id of the put that committed it (0: none).
    #[serde(rename = "i", default, skip_serializing_if = "is_zero")]
    pub put_id: u64,
}

fn is_zero(value: &u64) -> bool {
    *value == 0
}

/// A whole snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotFile {
    /// The format version ([`SNAPSHOT_VERSION`]).
    #[serde(rename = "v")]
    pub version: u16,
    /// The last stream sequence whose events it includes.
    #[serde(rename = "q")]
    pub covers_seq: u64,
    /// The highest leader epoch seen.
    #[serde(rename = "e")]
    pub max_epoch: u64,
    /// Every mounted segment.
    #[serde(rename = "g")]
    pub segments: Vec<SegmentRecord>,
    /// Every committed object, oldest first (a restore keeps the eviction order).
    #[serde(rename = "o")]
    pub objects: Vec<ObjectRecord>,
}

/// Why a snapshot could not be encoded, decoded, stored or loaded.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// Fewer bytes than the checksum.
    #[error("snapshot of {len} bytes is shorter than its checksum")]
    Truncated {
        /// How many bytes there were.
        len: usize,
    },
    /// The body does not match its checksum.
    #[error("snapshot checksum mismatch: stored {stored:#018x}, computed {computed:#018x}")]
    ChecksumMismatch {
        /// The checksum carried.
        stored: u64,
        /// The checksum of the body.
        computed: u64,
    },
    /// A version this build does not read.
    #[error("unknown snapshot version {0}")]
    UnknownVersion(u16),
    /// An object names a segment index the snapshot does not have.
    #[error("object {key:?} names segment index {index} of {segments}")]
    BadSegmentIndex {
        /// The object's key.
        key: String,
        /// The index it carries.
        index: u32,
        /// How many segments the snapshot has.
        segments: usize,
    },
    /// The body is not a snapshot.
    #[error("malformed snapshot body")]
    Malformed(#[source] rmp_serde::decode::Error),
    /// The body could not be encoded.
    #[error("encoding a snapshot")]
    Encode(#[source] rmp_serde::encode::Error),
    /// The object store failed.
    #[error("snapshot store: {what}")]
    Store {
        /// What was being done.
        what: String,
        /// The JetStream error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// The kind of a [`SnapshotError`], for matching.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotErrorKind {
    /// The bytes are not a valid snapshot (truncated, corrupt, unknown version,
    /// inconsistent).
    Invalid,
    /// Encoding failed.
    Encode,
    /// The object store failed.
    Store,
}

impl SnapshotError {
    /// The kind.
    pub fn kind(&self) -> SnapshotErrorKind {
        match self {
            Self::Truncated { .. }
            | Self::ChecksumMismatch { .. }
            | Self::UnknownVersion(_)
            | Self::BadSegmentIndex { .. }
            | Self::Malformed(_) => SnapshotErrorKind::Invalid,
            Self::Encode(_) => SnapshotErrorKind::Encode,
            Self::Store { .. } => SnapshotErrorKind::Store,
        }
    }

    fn store(
        what: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self::Store {
            what: what.into(),
            source: Box::new(source),
        }
    }
}

/// The sequence a snapshot object's name says it covers (`<subcluster>.<seq>`).
pub fn covered_seq_of(name: &str) -> Option<u64> {
    name.rsplit_once('.')?.1.parse().ok()
}

impl SnapshotFile {
    /// An empty snapshot of the current version covering `covers_seq`.
    pub fn new(covers_seq: u64, max_epoch: u64) -> Self {
        Self {
            version: SNAPSHOT_VERSION,
            covers_seq,
            max_epoch,
            segments: Vec::new(),
            objects: Vec::new(),
        }
    }

    /// Encodes the snapshot: checksum, then body.
    ///
    /// # Errors
    /// [`SnapshotError::Encode`] (not expected for these types).
    pub fn encode(&self) -> Result<Vec<u8>, SnapshotError> {
        let body = rmp_serde::to_vec_named(self).map_err(SnapshotError::Encode)?;
        let mut bytes = Vec::with_capacity(body.len() + 8);
        bytes.extend_from_slice(&xxhash_rust::xxh3::xxh3_64(&body).to_be_bytes());
        bytes.extend_from_slice(&body);
        Ok(bytes)
    }

    /// Decodes and verifies a snapshot: checksum, version, and that every replica
    /// names a segment of the snapshot.
    ///
    /// # Errors
    /// [`SnapshotErrorKind::Invalid`] errors.
    pub fn decode(bytes: &[u8]) -> Result<Self, SnapshotError> {
        let (sum, body) = bytes
            .split_first_chunk::<8>()
            .ok_or(SnapshotError::Truncated { len: bytes.len() })?;
        let stored = u64::from_be_bytes(*sum);
        let computed = xxhash_rust::xxh3::xxh3_64(body);
        if stored != computed {
            return Err(SnapshotError::ChecksumMismatch { stored, computed });
        }
        let file: Self = rmp_serde::from_slice(body).map_err(SnapshotError::Malformed)?;
        if file.version != SNAPSHOT_VERSION {
            return Err(SnapshotError::UnknownVersion(file.version));
        }
        for object in &file.objects {
            if let Some((index, _)) = object
                .replicas
                .iter()
                .find(|(index, _)| *index as usize >= file.segments.len())
            {
                return Err(SnapshotError::BadSegmentIndex {
                    key: object.key.chars().take(64).collect(),
                    index: *index,
                    segments: file.segments.len(),
                });
            }
        }
        Ok(file)
    }

    /// The placements of `object` (segment ids and offsets), in replica order.
    pub fn placements<'a>(
        &'a self,
        object: &'a ObjectRecord,
    ) -> impl Iterator<Item = Placement> + 'a {
        object.replicas.iter().filter_map(|(index, offset)| {
            Some(Placement {
                segment: self.segments.get(*index as usize)?.segment.clone(),
                offset: *offset,
            })
        })
    }
}

/// The snapshot store of one sub-cluster.
#[derive(Clone)]
pub struct SnapshotStore {
    store: object_store::ObjectStore,
    subcluster: SubclusterId,
}

impl std::fmt::Debug for SnapshotStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotStore")
            .field("subcluster", &self.subcluster)
            .finish()
    }
}

impl SnapshotStore {
    /// Opens (creating if needed, with `replicas` copies) the cluster's snapshot
    /// object store, for `subcluster`'s snapshots.
    ///
    /// # Errors
    /// [`SnapshotError::Store`] when JetStream refuses the store.
    pub async fn open(
        js: &jetstream::Context,
        cluster: &ClusterId,
        subcluster: &SubclusterId,
        replicas: usize,
    ) -> Result<Self, SnapshotError> {
        let bucket = bucket_name(cluster, Bucket::Snapshots.purpose());
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
                .map_err(|e| SnapshotError::store(format!("creating {bucket}"), e))?,
        };
        Ok(Self {
            store,
            subcluster: subcluster.clone(),
        })
    }

    /// The names of this sub-cluster's snapshots, oldest first.
    ///
    /// # Errors
    /// [`SnapshotError::Store`] when the store cannot be listed.
    pub async fn names(&self) -> Result<Vec<String>, SnapshotError> {
        let prefix = snapshot_object_prefix(&self.subcluster);
        let mut list = self
            .store
            .list()
            .await
            .map_err(|e| SnapshotError::store("listing", e))?;
        let mut names = Vec::new();
        while let Some(info) = list.next().await {
            let info = info.map_err(|e| SnapshotError::store("listing", e))?;
            if info.name.starts_with(&prefix) && !info.deleted {
                names.push(info.name);
            }
        }
        // Names end in a zero-padded sequence: lexical order is sequence order.
        names.sort();
        Ok(names)
    }

    /// Stores `file` and drops all but the newest [`SNAPSHOTS_KEPT`]. Returns the
    /// object name and the checksum of the stored bytes.
    ///
    /// # Errors
    /// When encoding or the object store fails.
    pub async fn save(&self, file: &SnapshotFile) -> Result<(String, u64), SnapshotError> {
        self.save_encoded(file.covers_seq, file.encode()?).await
    }

    /// As [`SnapshotStore::save`], for a file already encoded
    /// ([`SnapshotFile::encode`], say on a blocking thread) that covers `covers_seq`.
    ///
    /// # Errors
    /// When the object store fails.
    pub async fn save_encoded(
        &self,
        covers_seq: u64,
        bytes: Vec<u8>,
    ) -> Result<(String, u64), SnapshotError> {
        let checksum = xxhash_rust::xxh3::xxh3_64(&bytes);
        let name = snapshot_object_name(&self.subcluster, covers_seq);
        self.store
            .put(name.as_str(), &mut bytes.as_slice())
            .await
            .map_err(|e| SnapshotError::store(format!("storing {name}"), e))?;
        let names = self.names().await?;
        for old in names.iter().rev().skip(SNAPSHOTS_KEPT) {
            if let Err(error) = self.store.delete(old).await {
                tracing::warn!(%error, old, "could not drop an old snapshot");
            }
        }
        Ok((name, checksum))
    }

    /// Reads the stored object `name` back and checks that its bytes hash to
    /// `checksum` (what [`SnapshotStore::save_encoded`] returned) and that its body
    /// matches the checksum it carries: the snapshot is then safe to rely on, and
    /// the history it covers may be purged.
    ///
    /// # Errors
    /// [`SnapshotError::Store`] when it cannot be read,
    /// [`SnapshotError::ChecksumMismatch`] or [`SnapshotError::Truncated`] when the
    /// stored bytes differ.
    pub async fn verify(&self, name: &str, checksum: u64) -> Result<(), SnapshotError> {
        let mut bytes = Vec::new();
        let mut object = self
            .store
            .get(name)
            .await
            .map_err(|e| SnapshotError::store(format!("reading {name} back"), e))?;
        object
            .read_to_end(&mut bytes)
            .await
            .map_err(|e| SnapshotError::store(format!("reading {name} back"), e))?;
        let computed = xxhash_rust::xxh3::xxh3_64(&bytes);
        if computed != checksum {
            return Err(SnapshotError::ChecksumMismatch {
                stored: checksum,
                computed,
            });
        }
        let (sum, body) = bytes
            .split_first_chunk::<8>()
            .ok_or(SnapshotError::Truncated { len: bytes.len() })?;
        let (stored, computed) = (u64::from_be_bytes(*sum), xxhash_rust::xxh3::xxh3_64(body));
        if stored != computed {
            return Err(SnapshotError::ChecksumMismatch { stored, computed });
        }
        Ok(())
    }

    /// The sequence the newest stored snapshot covers, read from its name (its
    /// content is not checked); `None` when there is none.
    ///
    /// # Errors
    /// [`SnapshotError::Store`] when the store cannot be listed.
    pub async fn newest_covered_seq(&self) -> Result<Option<u64>, SnapshotError> {
        Ok(self
            .names()
            .await?
            .iter()
            .rev()
            .find_map(|name| covered_seq_of(name)))
    }

    /// Loads the newest snapshot that verifies (skipping unreadable or invalid
    /// ones, with a warning); `None` when there is none.
    ///
    /// # Errors
    /// [`SnapshotError::Store`] when the object store cannot be listed.
    pub async fn load_newest(&self) -> Result<Option<(String, SnapshotFile)>, SnapshotError> {
        for name in self.names().await?.into_iter().rev() {
            let started = std::time::Instant::now();
            let mut bytes = Vec::new();
            let read = async {
                let mut object = self
                    .store
                    .get(&name)
                    .await
                    .map_err(|e| SnapshotError::store(format!("reading {name}"), e))?;
                object
                    .read_to_end(&mut bytes)
                    .await
                    .map_err(|e| SnapshotError::store(format!("reading {name}"), e))
            };
            if let Err(error) = read.await {
                tracing::warn!(%error, name, "skipping an unreadable snapshot");
                continue;
            }
            let read_ms = started.elapsed().as_millis() as u64;
            match SnapshotFile::decode(&bytes) {
                Ok(file) => {
                    tracing::info!(
                        name,
                        covers_seq = file.covers_seq,
                        objects = file.objects.len(),
                        bytes = bytes.len(),
                        read_ms,
                        decode_ms = started.elapsed().as_millis() as u64 - read_ms,
                        "snapshot loaded"
                    );
                    return Ok(Some((name, file)));
                }
                Err(error) => tracing::warn!(%error, name, "skipping an invalid snapshot"),
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_name_says_what_it_covers() {
        let subcluster = SubclusterId::new("sc-0").unwrap();
        let name = snapshot_object_name(&subcluster, 4711);
        assert_eq!(covered_seq_of(&name), Some(4711));
        assert_eq!(covered_seq_of("sc-0.not-a-number"), None);
        assert_eq!(covered_seq_of("no-dot"), None);
    }
}
