//! Whether the cluster has sub-clusters other than the store's own, as the
//! registry says: a key this sub-cluster's sub-master does not hold can only be
//! elsewhere when there is an elsewhere. A store alone in its cluster (one
//! sub-cluster: the way every deployment starts) then answers `exist` and
//! `remove` of an absent key from its own sub-master, without asking the global
//! master, which could only have said the same a round trip later.
//!
//! The registry is watched in the background. Until the watch has listed the
//! registry once, and whenever it is broken, other sub-clusters are assumed to
//! exist (the global master is asked, as without this). A sub-cluster once seen
//! stays counted, even when its entry is deleted: a leader deregisters on a
//! graceful handover, and its keys are still there.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use hkvm_events::{ClusterId, SubclusterId};
use hkvm_log::registry::{self, RegistryChange};
use tokio::task::JoinHandle;

/// The first wait before watching the registry again after a failure.
const FIRST_BACKOFF: Duration = Duration::from_millis(200);
/// The longest wait between attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// What the watch knows.
#[derive(Debug, Default)]
struct Known {
    /// The registry was listed and is watched now.
    live: AtomicBool,
    /// Another sub-cluster was registered since the store started watching.
    others: AtomicBool,
}

/// The background watch of the registry; dropping it stops the watch.
#[derive(Debug)]
pub(crate) struct Peers {
    known: Arc<Known>,
    task: JoinHandle<()>,
}

impl Drop for Peers {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Peers {
    /// Starts watching `cluster`'s registry for sub-clusters other than `own`.
    pub(crate) fn watch(nats: async_nats::Client, cluster: ClusterId, own: SubclusterId) -> Self {
        let known = Arc::new(Known::default());
        let task = tokio::spawn(follow(nats, cluster, own, Arc::clone(&known)));
        Self { known, task }
    }

    /// Whether a key this sub-cluster does not hold may be held by another:
    /// `false` only when the registry, listed and watched, names no other
    /// sub-cluster.
    pub(crate) fn elsewhere_possible(&self) -> bool {
        !self.known.live.load(Ordering::Acquire) || self.known.others.load(Ordering::Acquire)
    }
}

/// Watches the registry until the task is aborted, again after every failure.
async fn follow(
    nats: async_nats::Client,
    cluster: ClusterId,
    own: SubclusterId,
    known: Arc<Known>,
) {
    let js = async_nats::jetstream::new(nats);
    let mut backoff = FIRST_BACKOFF;
    loop {
        match watch_once(&js, &cluster, &own, &known).await {
            Ok(()) => tracing::debug!("the registry watch ended; watching again"),
            Err(error) => tracing::debug!(%error, "watching the registry"),
        }
        if known.live.swap(false, Ordering::AcqRel) {
            // It had worked: try again soon.
            backoff = FIRST_BACKOFF;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// One watch: started before the registry is listed, so that no entry put in
/// between is missed; live once the listing is in.
async fn watch_once(
    js: &async_nats::jetstream::Context,
    cluster: &ClusterId,
    own: &SubclusterId,
    known: &Known,
) -> Result<(), registry::RegistryError> {
    let store = registry::open_registry(js, cluster).await?;
    let mut changes = std::pin::pin!(registry::watch(&store).await?);
    let listed = registry::list(&store, registry::DEFAULT_TTL).await?;
    let note = |subcluster: &SubclusterId| {
        if subcluster != own {
            known.others.store(true, Ordering::Release);
        }
    };
    for entry in &listed {
        note(&entry.info.subcluster);
    }
    known.live.store(true, Ordering::Release);
    while let Some(change) = changes.next().await {
        match change? {
            RegistryChange::Put(info) => note(&info.subcluster),
            RegistryChange::Deleted(_) => {}
        }
    }
    Ok(())
}
