//! Where a sub-cluster's data-port grant key lives: one JetStream KV bucket per
//! cluster (`hkvm_<cluster>_grants`), keyed by sub-cluster id. The first
//! sub-master of a sub-cluster to start creates the key (an atomic create, so a
//! leader and its standby starting together agree on one); its nodes read it and
//! follow it when it is replaced. Only sub-masters and nodes may read the bucket
//! (docs/security.md): a client that could read it could make its own grants.

use std::time::Duration;

use async_nats::jetstream::{self, kv};
use futures::{Stream, StreamExt as _};
use rand::RngCore as _;

use hkvm_events::grant::{GrantKey, GRANT_SECRET_LEN};
use hkvm_events::id::{ClusterId, SubclusterId};
use hkvm_events::subject::Bucket;

/// What went wrong reading or creating a grant key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrantKeyError {
    /// The bucket does not exist yet: no sub-master of the cluster started.
    #[error("grant key bucket {0} not found (no sub-master of this cluster has started yet)")]
    BucketNotFound(String),
    /// The bucket has no key for the sub-cluster yet.
    #[error("no grant key for sub-cluster {0} yet (its sub-master has not started)")]
    NoKey(SubclusterId),
    /// The record is not a key.
    #[error("grant key of sub-cluster {subcluster} is malformed: {reason}")]
    Malformed {
        /// The sub-cluster.
        subcluster: SubclusterId,
        /// Why.
        reason: String,
    },
    /// JetStream refused or NATS is unreachable (a permissions violation too).
    #[error("grant key bucket {bucket}: {reason}")]
    Transport {
        /// The bucket.
        bucket: String,
        /// What failed.
        reason: String,
    },
}

fn transport(bucket: &str, cause: impl std::fmt::Display) -> GrantKeyError {
    GrantKeyError::Transport {
        bucket: bucket.to_owned(),
        reason: cause.to_string(),
    }
}

fn decode(subcluster: &SubclusterId, bytes: &[u8]) -> Result<GrantKey, GrantKeyError> {
    GrantKey::decode(bytes).map_err(|error| GrantKeyError::Malformed {
        subcluster: subcluster.clone(),
        reason: error.to_string(),
    })
}

/// A fresh key with a random id and secret from the operating system.
pub fn generate_key() -> GrantKey {
    let mut secret = [0u8; GRANT_SECRET_LEN];
    rand::rngs::OsRng.fill_bytes(&mut secret);
    GrantKey {
        id: rand::rngs::OsRng.next_u32(),
        secret,
    }
}

/// The grant key of `subcluster`, created (bucket and key, `replicas` copies, on
/// file storage so that it survives NATS restarts) when there is none yet.
///
/// # Errors
/// [`GrantKeyError::Transport`] when JetStream refuses, [`GrantKeyError::Malformed`]
/// for a record that is not a key.
pub async fn ensure_key(
    js: &jetstream::Context,
    cluster: &ClusterId,
    subcluster: &SubclusterId,
    replicas: usize,
) -> Result<GrantKey, GrantKeyError> {
    let bucket = Bucket::Grants.name(cluster);
    let config = kv::Config {
        bucket: bucket.clone(),
        description: format!("HKVM data-port grant keys of cluster {cluster}"),
        history: 1,
        storage: jetstream::stream::StorageType::File,
        num_replicas: replicas.max(1),
        ..Default::default()
    };
    let store = crate::buckets::open_or_create(js, config)
        .await
        .map_err(|e| transport(&bucket, e))?;
    let key = generate_key();
    let encoded = key.encode().map_err(|e| transport(&bucket, e))?;
    match store.create(subcluster.as_str(), encoded.into()).await {
        Ok(_) => {
            tracing::info!(%subcluster, key_id = key.id, "created the sub-cluster's grant key");
            Ok(key)
        }
        // Another sub-master of the sub-cluster created it first, or it exists.
        Err(error) if error.kind() == kv::CreateErrorKind::AlreadyExists => {
            read_key(&store, subcluster).await
        }
        Err(error) => Err(transport(&bucket, error)),
    }
}

async fn read_key(store: &kv::Store, subcluster: &SubclusterId) -> Result<GrantKey, GrantKeyError> {
    match store.get(subcluster.as_str()).await {
        Ok(Some(bytes)) => decode(subcluster, &bytes),
        Ok(None) => Err(GrantKeyError::NoKey(subcluster.clone())),
        Err(error) => Err(transport(&store.name, error)),
    }
}

/// Reads the grant key of `subcluster` once.
///
/// # Errors
/// [`GrantKeyError::BucketNotFound`] / [`GrantKeyError::NoKey`] before its
/// sub-master started; [`GrantKeyError::Transport`] when NATS refuses (a
/// credential without read access to the bucket).
pub async fn read(
    js: &jetstream::Context,
    cluster: &ClusterId,
    subcluster: &SubclusterId,
) -> Result<GrantKey, GrantKeyError> {
    let bucket = Bucket::Grants.name(cluster);
    let store = open(js, &bucket).await?;
    read_key(&store, subcluster).await
}

async fn open(js: &jetstream::Context, bucket: &str) -> Result<kv::Store, GrantKeyError> {
    match js.get_key_value(bucket).await {
        Ok(store) => Ok(store),
        Err(error) if error.kind() == jetstream::context::KeyValueErrorKind::GetBucket => {
            // Either missing or not readable: ask the stream directly to tell apart.
            match js.get_stream(format!("KV_{bucket}")).await {
                Err(e)
                    if matches!(
                        e.kind(),
                        jetstream::context::GetStreamErrorKind::JetStream(ref js_error)
                            if js_error.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
                    ) =>
                {
                    Err(GrantKeyError::BucketNotFound(bucket.to_owned()))
                }
                _ => Err(transport(bucket, error)),
            }
        }
        Err(error) => Err(transport(bucket, error)),
    }
}

/// Every version of the grant key of `subcluster` from now on, the current one
/// first; waits (polling every `poll`) for the bucket to appear. Records that do
/// not decode are logged and skipped.
///
/// # Errors
/// [`GrantKeyError::Transport`] when the watch cannot start; the stream yields an
/// error when it breaks.
pub async fn watch(
    js: &jetstream::Context,
    cluster: &ClusterId,
    subcluster: &SubclusterId,
    poll: Duration,
) -> Result<impl Stream<Item = Result<GrantKey, GrantKeyError>> + Send + 'static, GrantKeyError> {
    let bucket = Bucket::Grants.name(cluster);
    let store = loop {
        match open(js, &bucket).await {
            Ok(store) => break store,
            Err(GrantKeyError::BucketNotFound(_)) => tokio::time::sleep(poll).await,
            Err(error) => return Err(error),
        }
    };
    let watch = store
        .watch_with_history(subcluster.as_str())
        .await
        .map_err(|e| transport(&bucket, e))?;
    let subcluster = subcluster.clone();
    Ok(watch.filter_map(move |entry| {
        let (bucket, subcluster) = (bucket.clone(), subcluster.clone());
        async move {
            let entry = match entry {
                Ok(entry) => entry,
                Err(e) => return Some(Err(transport(&bucket, e))),
            };
            match entry.operation {
                kv::Operation::Put => match decode(&subcluster, &entry.value) {
                    Ok(key) => Some(Ok(key)),
                    Err(error) => {
                        tracing::warn!(%error, "skipping a grant key record");
                        None
                    }
                },
                // A deleted key keeps the node on the keys it holds until the next.
                kv::Operation::Delete | kv::Operation::Purge => None,
            }
        }
    }))
}
