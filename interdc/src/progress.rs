//! The replicator's progress, kept in a JetStream KV bucket of the target cluster
//! (`hkvm_<target>_interdc-<source>`): one record per block it copied (so a
//! restarted replicator never sends a finished block again, even one the target
//! evicted since), one per copy in flight (so a restarted replicator gives back
//! the target reservations a crash left behind instead of waiting for them to
//! time out) and the latest [`InterDcStatus`].

use std::time::Duration;

use async_nats::jetstream::{self, kv};
use futures::StreamExt as _;
use hkvm_events::subject::interdc_progress_bucket;
use hkvm_events::ClusterId;
use serde::{Deserialize, Serialize};

use crate::error::InterDcError;
use crate::status::InterDcStatus;

/// The key of the status record.
pub const STATUS_KEY: &str = "status";
/// The prefix of copy records (`c.<key hash in hex>`).
const COPIED_PREFIX: &str = "c.";
/// The prefix of in-flight records (`f.<key hash in hex>`): a reservation at the
/// target that a crash may have left behind.
const IN_FLIGHT_PREFIX: &str = "f.";

/// A copy in progress: its target reservation (MessagePack, named fields).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InFlightRecord {
    /// The key.
    pub key: String,
    /// The target sub-cluster holding the reservation.
    pub subcluster: String,
    /// When the reservation was made, Unix milliseconds.
    pub unix_ms: u64,
}

/// What earlier runs left in the bucket.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Loaded {
    /// Key hashes of every block copied.
    pub copied: Vec<u64>,
    /// Copies that were in flight when a run stopped, by key hash.
    pub in_flight: Vec<(u64, InFlightRecord)>,
}

fn parse_hash(key: &str, hex: &str) -> Result<u64, InterDcError> {
    u64::from_str_radix(hex, 16).map_err(|e| InterDcError::progress(key.to_owned(), e))
}

/// What was copied (MessagePack, named fields).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopiedRecord {
    /// The key.
    pub key: String,
    /// Bytes.
    pub bytes: u64,
    /// The target sub-cluster it was placed in.
    pub subcluster: String,
    /// When the copy was committed, Unix milliseconds.
    pub unix_ms: u64,
}

/// The progress bucket name for copies from `source` into `target`.
pub fn bucket(source: &ClusterId, target: &ClusterId) -> String {
    interdc_progress_bucket(source, target)
}

/// The progress bucket.
#[derive(Debug, Clone)]
pub struct Progress {
    store: kv::Store,
}

impl Progress {
    /// Opens (creating if needed) the progress bucket in the target cluster.
    /// `retention` bounds how long copy records are kept (zero: forever).
    ///
    /// # Errors
    /// [`InterDcError::Nats`] when JetStream refuses.
    pub async fn open(
        target_js: &jetstream::Context,
        source: &ClusterId,
        target: &ClusterId,
        replicas: usize,
        retention: Duration,
    ) -> Result<Self, InterDcError> {
        let name = bucket(source, target);
        let config = kv::Config {
            bucket: name.clone(),
            description: format!("HKVM inter-DC copies from {source} into {target}"),
            history: 1,
            max_age: retention,
            storage: jetstream::stream::StorageType::File,
            num_replicas: replicas.max(1),
            ..Default::default()
        };
        let store = hkvm_log::buckets::open_or_create(target_js, config)
            .await
            .map_err(|e| InterDcError::nats(format!("creating {name}"), e))?;
        Ok(Self { store })
    }

    /// Opens an existing progress bucket (for `hkvm interdc status`).
    ///
    /// # Errors
    /// [`InterDcError::Nats`] when there is none.
    pub async fn open_existing(
        target_js: &jetstream::Context,
        source: &ClusterId,
        target: &ClusterId,
    ) -> Result<Self, InterDcError> {
        let name = bucket(source, target);
        let store = target_js
            .get_key_value(&name)
            .await
            .map_err(|e| InterDcError::nats(format!("opening {name}"), e))?;
        Ok(Self { store })
    }

    /// Everything earlier runs recorded: copied blocks and copies in flight.
    ///
    /// # Errors
    /// [`InterDcError::Nats`] when the bucket cannot be read,
    /// [`InterDcError::Progress`] for a record that does not decode.
    pub async fn load(&self) -> Result<Loaded, InterDcError> {
        let status = self
            .store
            .status()
            .await
            .map_err(|e| InterDcError::nats("reading the progress bucket", e))?;
        let mut loaded = Loaded::default();
        if status.values() == 0 {
            return Ok(loaded);
        }
        let mut watch = self
            .store
            .watch_with_history(">")
            .await
            .map_err(|e| InterDcError::nats("reading the progress bucket", e))?;
        while let Some(entry) = watch.next().await {
            let entry = entry.map_err(|e| InterDcError::nats("reading the progress bucket", e))?;
            if entry.operation == kv::Operation::Put {
                if let Some(hex) = entry.key.strip_prefix(COPIED_PREFIX) {
                    loaded.copied.push(parse_hash(&entry.key, hex)?);
                } else if let Some(hex) = entry.key.strip_prefix(IN_FLIGHT_PREFIX) {
                    let record = rmp_serde::from_slice(&entry.value)
                        .map_err(|e| InterDcError::progress(entry.key.clone(), e))?;
                    loaded
                        .in_flight
                        .push((parse_hash(&entry.key, hex)?, record));
                }
            }
            if entry.delta == 0 {
                break;
            }
        }
        Ok(loaded)
    }

    /// Records a reservation made at the target for a copy about to cross the WAN.
    ///
    /// # Errors
    /// [`InterDcError::Nats`] when the write fails.
    pub async fn record_in_flight(
        &self,
        hash: u64,
        record: &InFlightRecord,
    ) -> Result<(), InterDcError> {
        let entry = format!("{IN_FLIGHT_PREFIX}{hash:016x}");
        self.put_record(entry, &record.key, record, "recording a copy in flight")
            .await
    }

    async fn put_record<T: Serialize>(
        &self,
        entry: String,
        key: &str,
        record: &T,
        what: &str,
    ) -> Result<(), InterDcError> {
        let value = rmp_serde::to_vec_named(record)
            .map_err(|e| InterDcError::progress(key.to_owned(), e))?;
        self.store
            .put(entry, value.into())
            .await
            .map_err(|e| InterDcError::nats(what, e))?;
        Ok(())
    }

    /// Forgets an in-flight record (the copy ended one way or the other).
    ///
    /// # Errors
    /// [`InterDcError::Nats`] when the delete fails.
    pub async fn clear_in_flight(&self, hash: u64) -> Result<(), InterDcError> {
        self.store
            .purge(format!("{IN_FLIGHT_PREFIX}{hash:016x}"))
            .await
            .map_err(|e| InterDcError::nats("clearing a copy in flight", e))?;
        Ok(())
    }

    /// Records a copied block.
    ///
    /// # Errors
    /// [`InterDcError::Nats`] when the write fails.
    pub async fn record_copied(
        &self,
        hash: u64,
        record: &CopiedRecord,
    ) -> Result<(), InterDcError> {
        let entry = format!("{COPIED_PREFIX}{hash:016x}");
        self.put_record(entry, &record.key, record, "recording a copy")
            .await
    }

    /// Reads a copy record, if there is one.
    ///
    /// # Errors
    /// [`InterDcError::Nats`] when the read fails, [`InterDcError::Progress`] when
    /// the record does not decode.
    pub async fn copied(&self, hash: u64) -> Result<Option<CopiedRecord>, InterDcError> {
        let key = format!("{COPIED_PREFIX}{hash:016x}");
        let Some(bytes) = self
            .store
            .get(&key)
            .await
            .map_err(|e| InterDcError::nats("reading a copy record", e))?
        else {
            return Ok(None);
        };
        rmp_serde::from_slice(&bytes)
            .map(Some)
            .map_err(|e| InterDcError::progress(key, e))
    }

    /// Writes the status record.
    ///
    /// # Errors
    /// [`InterDcError::Nats`] when the write fails.
    pub async fn write_status(&self, status: &InterDcStatus) -> Result<(), InterDcError> {
        let value =
            serde_json::to_vec(status).map_err(|e| InterDcError::progress(STATUS_KEY, e))?;
        self.store
            .put(STATUS_KEY, value.into())
            .await
            .map_err(|e| InterDcError::nats("writing the status", e))?;
        Ok(())
    }

    /// Reads the status record, if one was written.
    ///
    /// # Errors
    /// [`InterDcError::Nats`] when the read fails, [`InterDcError::Progress`] when
    /// the record does not decode.
    pub async fn read_status(&self) -> Result<Option<InterDcStatus>, InterDcError> {
        let Some(bytes) = self
            .store
            .get(STATUS_KEY)
            .await
            .map_err(|e| InterDcError::nats("reading the status", e))?
        else {
            return Ok(None);
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| InterDcError::progress(STATUS_KEY, e))
    }
}
