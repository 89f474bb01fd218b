//! Leadership of a sub-cluster: a lease in a JetStream KV bucket whose entries expire
//! after the lease TTL (`max_age`). The holder renews it with a revision
//! compare-and-set; a standby takes it with a create that succeeds only when no live
//! entry exists. The lease only decides who *tries* to lead: the event log's
//! expected-last-sequence fencing is what keeps a deposed leader from writing.

use std::time::Duration;

use async_nats::jetstream::{self, kv};
pub use hkvm_events::lease::LeaseHolder;
use hkvm_events::subject::Bucket;
use hkvm_events::{ClusterId, SubclusterId};

use crate::error::{SubmasterError, SubmasterErrorKind};

/// Access to the leader lease of one sub-cluster.
#[derive(Debug, Clone)]
pub struct LeaderLease {
    store: kv::Store,
    key: String,
}

fn lease_error(
    what: &str,
    error: impl std::error::Error + Send + Sync + 'static,
) -> SubmasterError {
    SubmasterError::caused(SubmasterErrorKind::Lease, what, error)
}

impl LeaderLease {
    /// Opens (creating if needed) the lease bucket of `cluster` with entries living
    /// `ttl`, and addresses the key of `subcluster`.
    ///
    /// # Errors
    /// When JetStream refuses the bucket.
    pub async fn open(
        js: &jetstream::Context,
        cluster: &ClusterId,
        subcluster: &SubclusterId,
        ttl: Duration,
        replicas: usize,
    ) -> Result<Self, SubmasterError> {
        let bucket = Bucket::Leader.name(cluster);
        let config = kv::Config {
            bucket: bucket.clone(),
            description: "HKVM sub-master leader leases".to_owned(),
            history: 1,
            max_age: ttl,
            num_replicas: replicas,
            storage: jetstream::stream::StorageType::File,
            ..Default::default()
        };
        let store = hkvm_log::buckets::open_or_create(js, config)
            .await
            .map_err(|e| lease_error("creating the lease bucket", e))?;
        Ok(Self {
            store,
            key: subcluster.to_string(),
        })
    }

    /// The current holder, if a live lease exists.
    ///
    /// # Errors
    /// When the bucket cannot be read.
    pub async fn holder(&self) -> Result<Option<(LeaseHolder, u64)>, SubmasterError> {
        let entry = self
            .store
            .entry(&self.key)
            .await
            .map_err(|e| lease_error("reading the lease", e))?;
        Ok(entry.and_then(|entry| {
            if entry.operation != kv::Operation::Put {
                return None;
            }
            let holder = LeaseHolder::decode(&entry.value).ok()?;
            Some((holder, entry.revision))
        }))
    }

    /// Tries to take the lease; `Some(revision)` when we hold it now.
    ///
    /// # Errors
    /// When the bucket cannot be written for another reason than a live holder.
    pub async fn try_acquire(&self, holder: &LeaseHolder) -> Result<Option<u64>, SubmasterError> {
        let value = holder.encode().map_err(|e| lease_error("encoding", e))?;
        match self.store.create(&self.key, value.into()).await {
            Ok(revision) => Ok(Some(revision)),
            Err(error) if error.kind() == kv::CreateErrorKind::AlreadyExists => Ok(None),
            Err(error) => Err(lease_error("taking the lease", error)),
        }
    }

    /// Renews a held lease; `Ok(None)` when it was lost (another instance holds
    /// it). A lease whose entry expired while the bucket could not be written
    /// (nobody took it) is taken again.
    ///
    /// # Errors
    /// A transport failure or timeout: the lease may still be ours; the caller
    /// retries.
    pub async fn renew(
        &self,
        holder: &LeaseHolder,
        revision: u64,
    ) -> Result<Option<u64>, SubmasterError> {
        let value = holder.encode().map_err(|e| lease_error("encoding", e))?;
        match self.store.update(&self.key, value.into(), revision).await {
            Ok(revision) => Ok(Some(revision)),
            Err(error) if error.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                if self.holder().await?.is_none() {
                    tracing::info!("the leader lease expired unrenewed; taking it again");
                    return self.try_acquire(holder).await;
                }
                tracing::warn!(%error, "the leader lease was taken by another instance");
                Ok(None)
            }
            Err(error) => Err(lease_error("renewing the lease", error)),
        }
    }

    /// Takes over a lease whose holder stopped renewing it: deletes it only if it is
    /// still at the `stale_revision` we watched stand still (compare-and-set, so a
    /// holder that renewed meanwhile keeps it), then tries to take it.
    ///
    /// # Errors
    /// As for [`LeaderLease::try_acquire`].
    pub async fn take_over_stale(
        &self,
        holder: &LeaseHolder,
        stale_revision: u64,
    ) -> Result<Option<u64>, SubmasterError> {
        if self
            .store
            .delete_expect_revision(&self.key, Some(stale_revision))
            .await
            .is_err()
        {
            return Ok(None);
        }
        self.try_acquire(holder).await
    }

    /// Gives a held lease up (graceful shutdown) so a standby takes over at once.
    pub async fn release(&self, revision: u64) {
        if let Err(error) = self
            .store
            .delete_expect_revision(&self.key, Some(revision))
            .await
        {
            tracing::debug!(%error, "releasing the lease");
        }
    }
}
