//! The snapshot store: one JetStream object store per cluster, holding each
//! sub-cluster's newest [`SNAPSHOTS_KEPT`] snapshots.

use async_nats::jetstream::{self, object_store};
use futures::StreamExt as _;
use tokio::io::AsyncReadExt as _;

use crate::objects;
use crate::pace::{ByteRate, PacedSlice};
use hkvm_events::id::{ClusterId, SubclusterId};
use hkvm_events::snapshot::{
    covered_seq_of, decode_pieces, Records, SnapshotError, SnapshotFile, SnapshotHeader,
    SnapshotVisitor, StoredCheck, SNAPSHOTS_KEPT,
};
use hkvm_events::subject::{bucket_name, snapshot_object_name, snapshot_object_prefix, Bucket};

/// Bytes read at a time when a stored snapshot is verified.
const VERIFY_READ: usize = 1 << 20;
/// Bytes asked of the object store at a time while a snapshot is restored.
const READ_PIECE: usize = 256 << 10;
/// Pieces read ahead of the decoder while a snapshot is restored.
const PIECES_AHEAD: usize = 16;

/// A snapshot decoded as it was read.
struct Streamed<V> {
    /// How the decode ended.
    decoded: Result<SnapshotHeader, SnapshotError>,
    /// The visitor, with what it was handed.
    visitor: V,
    /// When the last byte had arrived, ms after the start.
    read_ms: u64,
    /// The object's size.
    len: u64,
}

/// The snapshot store of one sub-cluster.
#[derive(Clone)]
pub struct SnapshotStore {
    js: jetstream::Context,
    store: object_store::ObjectStore,
    bucket: String,
    subcluster: SubclusterId,
    /// Bytes per second at most while a snapshot is stored or read back to
    /// verify it (`None`: unpaced); a restore reads unpaced.
    write_rate: Option<u64>,
}

impl std::fmt::Debug for SnapshotStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotStore")
            .field("subcluster", &self.subcluster)
            .field("write_rate", &self.write_rate)
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
            js: js.clone(),
            store,
            bucket,
            subcluster: subcluster.clone(),
            write_rate: None,
        })
    }

    /// Stores and verifies snapshots at `bytes_per_sec` at most (`None` or 0:
    /// unpaced), so the NATS server's work for them is spread out instead of
    /// holding up the leader's appends. A restore still reads at full speed.
    #[must_use]
    pub fn with_write_rate(mut self, bytes_per_sec: Option<u64>) -> Self {
        self.write_rate = bytes_per_sec.filter(|&rate| rate > 0);
        self
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
            .put(name.as_str(), &mut PacedSlice::new(&bytes, self.write_rate))
            .await
            .map_err(|e| SnapshotError::store(format!("storing {name}"), e))?;
        let names = self.names().await?;
        for old in names.iter().rev().skip(SNAPSHOTS_KEPT) {
            if let Err(error) =
                objects::delete_for_good(&self.js, &self.store, &self.bucket, old).await
            {
                tracing::warn!(%error, old, "could not drop an old snapshot");
            }
        }
        // Markers left by deletes before this build, or by a process that died
        // between a delete and its purge.
        let prefix = snapshot_object_prefix(&self.subcluster);
        let candidate =
            |old: &str| old.starts_with(&prefix) && !names.iter().any(|name| name == old);
        if let Err(error) = objects::forget_markers(&self.js, &self.bucket, candidate).await {
            tracing::warn!(%error, "could not purge deleted snapshots' markers");
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
        let failed = |e: std::io::Error| SnapshotError::store(format!("reading {name}"), e);
        let mut object = self
            .store
            .get(name)
            .await
            .map_err(|e| SnapshotError::store(format!("reading {name}"), e))?;
        // Checked as it streams in: the object is never held whole.
        let mut check = StoredCheck::new();
        let mut buffer = vec![0; VERIFY_READ];
        let mut rate = ByteRate::new(self.write_rate);
        loop {
            let read = object.read(&mut buffer).await.map_err(failed)?;
            if read == 0 {
                break;
            }
            check.update(&buffer[..read]);
            rate.pass(read).await;
        }
        check.finish(checksum)
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
        let loaded = self.load_newest_with(Records::default).await?;
        Ok(loaded.map(|(name, header, records)| {
            let file = records.into_file(header);
            (name, file)
        }))
    }

    /// As [`SnapshotStore::load_newest`], decoding object by object into a
    /// visitor ([`SnapshotFile::decode_with`]) on a blocking thread. `fresh`
    /// makes one visitor per snapshot tried: one that fails half-way is dropped
    /// with what it had built. Returns the snapshot's name, its header and the
    /// visitor that took it whole.
    ///
    /// # Errors
    /// [`SnapshotError::Store`] when the object store cannot be listed.
    pub async fn load_newest_with<V>(
        &self,
        fresh: impl Fn() -> V,
    ) -> Result<Option<(String, SnapshotHeader, V)>, SnapshotError>
    where
        V: SnapshotVisitor + Send + 'static,
    {
        for name in self.names().await?.into_iter().rev() {
            let started = std::time::Instant::now();
            let streamed = match self.decode_streamed(&name, fresh()).await {
                Ok(streamed) => streamed,
                Err(error) => {
                    tracing::warn!(%error, name, "skipping an unreadable snapshot");
                    continue;
                }
            };
            match streamed.decoded {
                Ok(header) => {
                    tracing::info!(
                        name,
                        covers_seq = header.covers_seq,
                        bytes = streamed.len,
                        read_ms = streamed.read_ms,
                        decode_ms =
                            (started.elapsed().as_millis() as u64).saturating_sub(streamed.read_ms),
                        "snapshot loaded"
                    );
                    return Ok(Some((name, header, streamed.visitor)));
                }
                Err(error) => tracing::warn!(%error, name, "skipping an invalid snapshot"),
            }
        }
        Ok(None)
    }

    /// Reads the object `name` in pieces and decodes them on a blocking thread
    /// as they arrive ([`decode_pieces`]), into `visitor`; `Err` when it
    /// could not be opened.
    async fn decode_streamed<V>(
        &self,
        name: &str,
        mut visitor: V,
    ) -> Result<Streamed<V>, SnapshotError>
    where
        V: SnapshotVisitor + Send + 'static,
    {
        let started = std::time::Instant::now();
        let failed = |e: std::io::Error| SnapshotError::store(format!("reading {name}"), e);
        let mut object = self
            .store
            .get(name)
            .await
            .map_err(|e| SnapshotError::store(format!("reading {name}"), e))?;
        let len = object.info.size as u64;
        let (pieces, received) = tokio::sync::mpsc::channel(PIECES_AHEAD);
        let decoding = tokio::task::spawn_blocking(move || {
            let mut received = received;
            let pieces = std::iter::from_fn(move || received.blocking_recv());
            let decoded = decode_pieces(len, pieces, &mut visitor);
            (decoded, visitor)
        });
        loop {
            let mut piece = vec![0; READ_PIECE];
            let piece = match object.read(&mut piece).await {
                Ok(0) => break,
                Ok(len) => {
                    piece.truncate(len);
                    Ok(piece)
                }
                Err(error) => Err(failed(error)),
            };
            let last = piece.is_err();
            // A decoder that stopped (an error) takes no more.
            if pieces.send(piece).await.is_err() || last {
                break;
            }
        }
        let read_ms = started.elapsed().as_millis() as u64;
        drop(pieces);
        let (decoded, visitor) = decoding
            .await
            .map_err(|e| SnapshotError::store(format!("decoding {name}"), e))?;
        Ok(Streamed {
            decoded,
            visitor,
            read_ms,
            len,
        })
    }
}
