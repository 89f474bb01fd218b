//! The sub-master registry: every sub-master announces itself (id, sub-cluster,
//! RPC subjects, labels, capacity, stream position) in one JetStream KV bucket per
//! cluster (`hkvm_<cluster>_registry`), keyed by sub-cluster id, and re-announces it
//! as a heartbeat every second or two. The bucket's `max_age` is the liveness TTL: a
//! sub-master silent for longer than the TTL disappears from the bucket. Global
//! masters and `hkvm status` list and watch the bucket.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::{self, kv};
use futures::{Stream, StreamExt as _};

use hkvm_events::id::{ClusterId, SubclusterId};
use hkvm_events::registry::SubmasterInfo;
use hkvm_events::subject::Bucket;

/// The liveness TTL used when none is configured.
pub const DEFAULT_TTL: Duration = Duration::from_secs(10);

/// A registry entry as read back, with its liveness.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registered {
    /// The announcement.
    pub info: SubmasterInfo,
    /// Whether its last heartbeat is younger than the TTL.
    pub alive: bool,
    /// Age of the last heartbeat in milliseconds (by the bucket's clock).
    pub age_ms: u64,
}

/// A change seen by [`watch`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegistryChange {
    /// A sub-master registered or heartbeat.
    Put(SubmasterInfo),
    /// A sub-master's entry was deleted (graceful deregistration).
    Deleted(SubclusterId),
}

/// What went wrong talking to the registry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistryErrorKind {
    /// The bucket does not exist (no sub-master ever registered).
    #[error("registry bucket not found")]
    BucketNotFound,
    /// An entry does not decode.
    #[error("malformed entry: {0}")]
    Malformed(String),
    /// The KV store failed or NATS is unreachable.
    #[error("{0}")]
    Transport(String),
}

/// A registry failure.
#[derive(Debug, Clone, thiserror::Error)]
#[error("registry {bucket}: {kind}")]
pub struct RegistryError {
    bucket: String,
    kind: RegistryErrorKind,
}

impl RegistryError {
    fn new(bucket: &str, kind: RegistryErrorKind) -> Self {
        Self {
            bucket: bucket.to_owned(),
            kind,
        }
    }

    fn transport(bucket: &str, cause: impl std::fmt::Display) -> Self {
        Self::new(bucket, RegistryErrorKind::Transport(cause.to_string()))
    }

    /// What went wrong.
    pub fn kind(&self) -> &RegistryErrorKind {
        &self.kind
    }
}

/// The current time in Unix milliseconds.
pub fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Creates the registry bucket of `cluster` (entries expire after `ttl`, one
/// replica) or opens it if it exists.
///
/// # Errors
/// [`RegistryErrorKind::Transport`] when JetStream refuses.
pub async fn ensure_registry_bucket(
    js: &jetstream::Context,
    cluster: &ClusterId,
    ttl: Duration,
) -> Result<kv::Store, RegistryError> {
    ensure_replicated_registry_bucket(js, cluster, ttl, 1).await
}

/// Like [`ensure_registry_bucket`] with `replicas` copies (3 in a NATS cluster, so
/// the registry survives the loss of a NATS node).
///
/// # Errors
/// [`RegistryErrorKind::Transport`] when JetStream refuses.
pub async fn ensure_replicated_registry_bucket(
    js: &jetstream::Context,
    cluster: &ClusterId,
    ttl: Duration,
    replicas: usize,
) -> Result<kv::Store, RegistryError> {
    let bucket = Bucket::Registry.name(cluster);
    let config = kv::Config {
        bucket: bucket.clone(),
        description: format!("HKVM sub-master registry of cluster {cluster}"),
        history: 1,
        max_age: ttl,
        storage: jetstream::stream::StorageType::Memory,
        num_replicas: replicas.max(1),
        ..Default::default()
    };
    crate::buckets::open_or_create(js, config)
        .await
        .map_err(|e| RegistryError::transport(&bucket, e))
}

/// Opens the registry bucket of `cluster` without creating it.
///
/// # Errors
/// [`RegistryErrorKind::BucketNotFound`] when no sub-master created it yet.
pub async fn open_registry(
    js: &jetstream::Context,
    cluster: &ClusterId,
) -> Result<kv::Store, RegistryError> {
    let bucket = Bucket::Registry.name(cluster);
    js.get_key_value(&bucket)
        .await
        .map_err(|_| RegistryError::new(&bucket, RegistryErrorKind::BucketNotFound))
}

/// Registers `info` (or refreshes it: registering again is the heartbeat). The
/// announcement's `unix_ms` is set to now.
///
/// # Errors
/// [`RegistryErrorKind::Transport`] when the put fails.
pub async fn register(store: &kv::Store, info: &SubmasterInfo) -> Result<u64, RegistryError> {
    let mut info = info.clone();
    info.unix_ms = now_unix_ms();
    let bytes = info.encode().map_err(|e| {
        RegistryError::new(&store.name, RegistryErrorKind::Malformed(e.to_string()))
    })?;
    store
        .put(info.subcluster.as_str(), bytes.into())
        .await
        .map_err(|e| RegistryError::transport(&store.name, e))
}

/// Sends one heartbeat: the same as [`register`].
///
/// # Errors
/// As for [`register`].
pub async fn heartbeat(store: &kv::Store, info: &SubmasterInfo) -> Result<u64, RegistryError> {
    register(store, info).await
}

/// Removes a sub-master's entry (graceful shutdown).
///
/// # Errors
/// [`RegistryErrorKind::Transport`] when the delete fails.
pub async fn deregister(store: &kv::Store, subcluster: &SubclusterId) -> Result<(), RegistryError> {
    store
        .delete(subcluster.as_str())
        .await
        .map_err(|e| RegistryError::transport(&store.name, e))
}

/// Every registered sub-master, sorted by sub-cluster, with liveness judged against
/// `ttl`. Entries that do not decode are skipped with a warning.
///
/// # Errors
/// [`RegistryErrorKind::Transport`] when listing fails.
pub async fn list(store: &kv::Store, ttl: Duration) -> Result<Vec<Registered>, RegistryError> {
    let mut keys = store
        .keys()
        .await
        .map_err(|e| RegistryError::transport(&store.name, e))?;
    let mut names = Vec::new();
    while let Some(key) = keys.next().await {
        names.push(key.map_err(|e| RegistryError::transport(&store.name, e))?);
    }
    names.sort();
    let now = now_unix_ms();
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        let Some(entry) = store
            .entry(name.as_str())
            .await
            .map_err(|e| RegistryError::transport(&store.name, e))?
        else {
            continue;
        };
        if entry.operation != kv::Operation::Put {
            continue;
        }
        match SubmasterInfo::decode(&entry.value) {
            Ok(info) => {
                let created_ms =
                    u64::try_from(entry.created.unix_timestamp_nanos() / 1_000_000).unwrap_or(0);
                let age_ms = now.saturating_sub(created_ms);
                out.push(Registered {
                    alive: u128::from(age_ms) < ttl.as_millis(),
                    age_ms,
                    info,
                });
            }
            Err(error) => tracing::warn!(key = %name, %error, "skipping a registry entry"),
        }
    }
    Ok(out)
}

/// Watches the registry: first every current entry, then every change. Entries
/// that do not decode are skipped with a warning; entries expiring by TTL are not
/// reported (use [`list`] for liveness).
///
/// # Errors
/// [`RegistryErrorKind::Transport`] when the watch cannot start; the stream yields
/// an error when it breaks.
pub async fn watch(
    store: &kv::Store,
) -> Result<impl Stream<Item = Result<RegistryChange, RegistryError>> + Send + 'static, RegistryError>
{
    let bucket = store.name.clone();
    let watch = store
        .watch_with_history(">")
        .await
        .map_err(|e| RegistryError::transport(&bucket, e))?;
    Ok(watch.filter_map(move |entry| {
        let bucket = bucket.clone();
        async move {
            let entry = match entry {
                Ok(entry) => entry,
                Err(e) => return Some(Err(RegistryError::transport(&bucket, e))),
            };
            match entry.operation {
                kv::Operation::Put => match SubmasterInfo::decode(&entry.value) {
                    Ok(info) => Some(Ok(RegistryChange::Put(info))),
                    Err(error) => {
                        tracing::warn!(key = %entry.key, %error, "skipping a registry entry");
                        None
                    }
                },
                kv::Operation::Delete | kv::Operation::Purge => SubclusterId::new(entry.key)
                    .ok()
                    .map(|sc| Ok(RegistryChange::Deleted(sc))),
            }
        }
    }))
}
