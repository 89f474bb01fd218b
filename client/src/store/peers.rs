//! Whether the cluster has sub-clusters other than the store's own, as the
//! registry says: a key this sub-cluster's sub-master does not hold can only be
//! elsewhere when there is an elsewhere. A store alone in its cluster (one
//! sub-cluster: the way every deployment starts) then answers `exist` and
//! `remove` of an absent key from its own sub-master, without asking the global
//! master, which could only have said the same a round trip later.
//!
//! The registry is listed in the background, when a call asks and the last
//! listing is older than [`RELIST_AFTER`]; a store never watches it, so that ten
//! thousand stores do not each receive every sub-master's heartbeat. Until the
//! first listing, and when a listing fails, other sub-clusters are assumed to
//! exist (the global master is asked, as without this). Once another
//! sub-cluster is seen the answer stays "elsewhere possible" and the registry is
//! not listed again: a leader deregisters on a graceful handover, and its keys
//! are still there.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hkvm_events::{ClusterId, SubclusterId};
use hkvm_log::registry;

/// How old a listing that names no other sub-cluster may be before a call
/// lists the registry again: how long a new sub-cluster may go unseen.
pub(crate) const RELIST_AFTER: Duration = Duration::from_secs(5);

/// What the last listing said.
const UNKNOWN: u8 = 0;
const ALONE: u8 = 1;
const OTHERS: u8 = 2;

/// The registry's answer, refreshed on demand.
#[derive(Debug)]
struct Known {
    /// [`UNKNOWN`], [`ALONE`] or [`OTHERS`].
    answer: AtomicU8,
    /// When the last listing ended (or failed).
    listed_at: Mutex<Option<Instant>>,
    /// A listing runs now.
    listing: AtomicBool,
}

/// Where to list the registry, and what it said.
#[derive(Debug)]
pub(crate) struct Peers {
    nats: async_nats::Client,
    cluster: ClusterId,
    own: SubclusterId,
    known: Arc<Known>,
}

impl Peers {
    /// Peers of `own` in `cluster`, listed at the first call that asks.
    pub(crate) fn new(nats: async_nats::Client, cluster: ClusterId, own: SubclusterId) -> Self {
        Self {
            nats,
            cluster,
            own,
            known: Arc::new(Known {
                answer: AtomicU8::new(UNKNOWN),
                listed_at: Mutex::new(None),
                listing: AtomicBool::new(false),
            }),
        }
    }

    /// Whether a key this sub-cluster does not hold may be held by another:
    /// `false` only when the last listing of the registry named no other
    /// sub-cluster. Starts a listing in the background when none was made, or
    /// the last is older than [`RELIST_AFTER`].
    pub(crate) fn elsewhere_possible(&self) -> bool {
        let answer = self.known.answer.load(Ordering::Acquire);
        if answer != OTHERS && self.stale() {
            self.list_in_background();
        }
        answer != ALONE
    }

    fn stale(&self) -> bool {
        let listed_at = *self
            .known
            .listed_at
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        listed_at.is_none_or(|at| at.elapsed() >= RELIST_AFTER)
    }

    fn list_in_background(&self) {
        if self.known.listing.swap(true, Ordering::AcqRel) {
            return;
        }
        let (nats, cluster, own) = (self.nats.clone(), self.cluster.clone(), self.own.clone());
        let known = Arc::clone(&self.known);
        tokio::spawn(async move {
            let answer = match list(nats, &cluster, &own).await {
                Ok(true) => OTHERS,
                Ok(false) => ALONE,
                Err(error) => {
                    tracing::debug!(%error, "listing the registry");
                    UNKNOWN
                }
            };
            known.answer.store(answer, Ordering::Release);
            *known
                .listed_at
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Instant::now());
            known.listing.store(false, Ordering::Release);
        });
    }
}

/// Whether the registry of `cluster` names a sub-cluster other than `own`.
async fn list(
    nats: async_nats::Client,
    cluster: &ClusterId,
    own: &SubclusterId,
) -> Result<bool, registry::RegistryError> {
    let registered = registered_subclusters(nats, cluster).await?;
    Ok(registered.iter().any(|subcluster| subcluster != own))
}

/// The sub-clusters the registry of `cluster` names (one per registered
/// instance: a sub-cluster may come more than once).
///
/// # Errors
/// When the registry cannot be opened or listed.
pub(crate) async fn registered_subclusters(
    nats: async_nats::Client,
    cluster: &ClusterId,
) -> Result<Vec<SubclusterId>, registry::RegistryError> {
    let js = async_nats::jetstream::new(nats);
    let store = registry::open_registry(&js, cluster).await?;
    let listed = registry::list(&store, registry::DEFAULT_TTL).await?;
    Ok(listed
        .into_iter()
        .map(|entry| entry.info.subcluster)
        .collect())
}
