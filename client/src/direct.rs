//! Direct requests from a client: the [`DirectRoute`] to one service (a
//! sub-cluster's leader, or a global-master replica) holds the current
//! [`DirectLink`] and makes a new one in the background when there is none. A
//! request and its reply on a link cross no NATS broker.
//!
//! NATS stays the discovery and the fallback: a leader's endpoint comes from its
//! lease record (read once, in the background, when a call finds no link) and
//! from its announcement when a new leader serves; a global-master replica's from
//! its status, asked of whichever replica the NATS queue group picks (so clients
//! spread over the replicas). While no link is up, or after one failed, calls go
//! over NATS exactly as before, and a new link is made in the background. A link
//! is dropped the moment it fails in any way (a closed connection, a timeout,
//! `NotLeader`), so a request is never retried on the link that failed it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use hkvm_direct::link::{DirectLink, LinkError, LinkFailure};
use hkvm_events::lease::LeaseHolder;
use hkvm_events::rpc::direct::{is_direct_name, DirectHello, DirectTicket};
use hkvm_events::rpc::global::{GlobalOp, GlobalStatus, GlobalStatusReply};
use hkvm_events::rpc::{self, RpcReply};
use hkvm_events::subject::{global_rpc_subject, Bucket};
use hkvm_events::{ClusterId, SubclusterId};
use tokio::time::Instant;

/// After a failed attempt to link, how long calls go over NATS before the next;
/// it doubles with every failure in a row, up to [`RELINK_AT_MOST`], so that
/// ten thousand clients of a server without a direct port do not keep asking
/// for one.
const RELINK_AFTER: Duration = Duration::from_millis(200);
/// The longest wait between attempts to link.
const RELINK_AT_MOST: Duration = Duration::from_secs(30);
/// A client links once it sends this many requests within [`BUSY_WINDOW`]. A
/// link costs the server a connection, its buffers and a read and a write per
/// request, where NATS carries many clients' requests in one read; a client
/// that sends a ping a second and a few operations (ten thousand of them, each
/// with a connection of its own, cost a sub-master four times the CPU per
/// request and gigabytes of buffers: `hkvm bench scale`) is served better
/// through the broker, and a busy one (an engine's cache traffic) directly.
const BUSY_REQUESTS: u32 = 20;
/// The window [`BUSY_REQUESTS`] is counted over.
const BUSY_WINDOW: Duration = Duration::from_secs(1);
/// How long the global master's status may take when asked for an endpoint.
const STATUS_TIMEOUT: Duration = Duration::from_secs(1);

/// How long to wait after `failures` attempts to link failed in a row.
fn relink_after(failures: u32) -> Duration {
    RELINK_AFTER
        .saturating_mul(1 << failures.saturating_sub(1).min(16))
        .min(RELINK_AT_MOST)
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The direct route of one client to one service: the current link, and making
/// a new one in the background when there is none. Shared by a client's clones.
#[derive(Debug)]
pub struct DirectRoute {
    nats: async_nats::Client,
    hello: DirectHello,
    link: Mutex<Option<Arc<DirectLink>>>,
    /// Whether a background attempt to link runs.
    linking: AtomicBool,
    /// When the last attempt failed, and how many failed in a row.
    failed_at: Mutex<Option<(Instant, u32)>>,
    /// Requests sent over a link (for tests, benchmarks and logs).
    sent: AtomicU64,
    /// Requests that found no link in the current window: since when, and how
    /// many.
    unlinked: Mutex<(Instant, u32)>,
}

impl DirectRoute {
    /// A route to the leader of `subcluster` in `cluster`; nothing is connected
    /// until a call asks for a link.
    pub fn leader(nats: async_nats::Client, cluster: ClusterId, subcluster: SubclusterId) -> Self {
        Self::to(nats, cluster, Some(subcluster))
    }

    /// A route to a global-master replica of `cluster`.
    pub fn global(nats: async_nats::Client, cluster: ClusterId) -> Self {
        Self::to(nats, cluster, None)
    }

    fn to(nats: async_nats::Client, cluster: ClusterId, subcluster: Option<SubclusterId>) -> Self {
        Self {
            nats,
            hello: DirectHello {
                cluster,
                subcluster,
                ticket: None,
            },
            link: Mutex::new(None),
            linking: AtomicBool::new(false),
            failed_at: Mutex::new(None),
            sent: AtomicU64::new(0),
            unlinked: Mutex::new((Instant::now(), 0)),
        }
    }

    /// Whether operation `op` may go on this route's links: a sub-master's hot
    /// operations, or any global-master query.
    pub fn carries(&self, op: &str) -> bool {
        match self.hello.subcluster {
            Some(_) => is_direct_name(op),
            None => GlobalOp::from_name(op).is_some(),
        }
    }

    /// Requests sent over links so far.
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// The endpoint and epoch of the open link, if one is up.
    pub fn linked(&self) -> Option<(String, u64)> {
        lock(&self.link)
            .as_ref()
            .filter(|link| !link.is_closed())
            .map(|link| (link.endpoint().to_owned(), link.welcome().epoch))
    }

    /// The open link, if any; when there is none and the client is busy
    /// ([`BUSY_REQUESTS`] in [`BUSY_WINDOW`]), starts making one in the
    /// background (at most one attempt at a time, and not again within
    /// [`RELINK_AFTER`], doubled per failure in a row, of a failed one), and the
    /// caller goes over NATS.
    pub fn link(self: &Arc<Self>) -> Option<Arc<DirectLink>> {
        {
            let mut current = lock(&self.link);
            match current.as_ref() {
                Some(link) if !link.is_closed() => {
                    self.sent.fetch_add(1, Ordering::Relaxed);
                    return Some(Arc::clone(link));
                }
                Some(_) => *current = None,
                None => {}
            }
        }
        if !self.busy() {
            return None;
        }
        let recently_failed = lock(&self.failed_at)
            .is_some_and(|(at, failures)| at.elapsed() < relink_after(failures));
        if !recently_failed && !self.linking.swap(true, Ordering::AcqRel) {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                let route = Arc::clone(self);
                runtime.spawn(async move { route.relink(None).await });
            } else {
                self.linking.store(false, Ordering::Release);
            }
        }
        None
    }

    /// Counts one request that found no link; whether the client is busy
    /// enough to link.
    fn busy(&self) -> bool {
        let mut unlinked = lock(&self.unlinked);
        if unlinked.0.elapsed() >= BUSY_WINDOW {
            *unlinked = (Instant::now(), 0);
        }
        unlinked.1 = unlinked.1.saturating_add(1);
        unlinked.1 >= BUSY_REQUESTS
    }

    /// Drops `link` when it is still the current one: it failed a request.
    pub fn discard(&self, link: &Arc<DirectLink>) {
        let mut current = lock(&self.link);
        if current.as_ref().is_some_and(|held| Arc::ptr_eq(held, link)) {
            tracing::debug!(endpoint = link.endpoint(), "dropping a direct link");
            link.close();
            *current = None;
        }
    }

    /// A leader announced itself with `announced` (its lease record): a client
    /// linked to another leader links to it (one without a link links when it
    /// is busy, as always).
    pub fn announced(self: &Arc<Self>, announced: &[u8]) {
        let Ok(holder) = LeaseHolder::decode(announced) else {
            return;
        };
        let Some(link) = lock(&self.link).clone() else {
            return;
        };
        if Some(link.endpoint()) == holder.direct.as_deref()
            && link.welcome().epoch == holder.epoch
            && !link.is_closed()
        {
            return;
        }
        self.discard(&link);
        // A new leader: whatever failed before says nothing about it.
        *lock(&self.failed_at) = None;
        if !self.linking.swap(true, Ordering::AcqRel) {
            let route = Arc::clone(self);
            tokio::spawn(async move { route.relink(Some(holder)).await });
        }
    }

    /// Makes a new link to the leader `holder` names, or to the endpoint the
    /// service tells when none is given.
    async fn relink(&self, holder: Option<LeaseHolder>) {
        let target = match holder {
            Some(holder) => holder
                .direct
                .map(|endpoint| (endpoint, holder.direct_ticket))
                .ok_or(LinkError::NoEndpoint),
            None => self.discover().await,
        };
        let result = match target {
            Ok((endpoint, ticket)) => {
                let hello = DirectHello {
                    ticket,
                    ..self.hello.clone()
                };
                DirectLink::connect(&endpoint, &hello).await
            }
            Err(error) => Err(error),
        };
        match result {
            Ok(link) => {
                tracing::debug!(
                    endpoint = link.endpoint(),
                    epoch = link.welcome().epoch,
                    "direct link to the leader"
                );
                *lock(&self.link) = Some(Arc::new(link));
                *lock(&self.failed_at) = None;
            }
            Err(error) => {
                tracing::debug!(%error, "no direct link; requests go over NATS");
                let mut failed = lock(&self.failed_at);
                let failures = failed.map_or(1, |(_, failures)| failures.saturating_add(1));
                *failed = Some((Instant::now(), failures));
            }
        }
        self.linking.store(false, Ordering::Release);
    }

    /// Where the service takes direct requests, and the ticket it wants: the
    /// leader lease record's, or the status of a global-master replica.
    async fn discover(&self) -> Result<(String, Option<DirectTicket>), LinkError> {
        let failed = |e: &dyn std::fmt::Display| LinkError::Discovery(e.to_string());
        match &self.hello.subcluster {
            Some(subcluster) => {
                let js = async_nats::jetstream::new(self.nats.clone());
                let bucket = Bucket::Leader.name(&self.hello.cluster);
                let store = js.get_key_value(&bucket).await.map_err(|e| failed(&e))?;
                let entry = store
                    .entry(subcluster.as_str())
                    .await
                    .map_err(|e| failed(&e))?;
                match entry {
                    Some(entry) if entry.operation == async_nats::jetstream::kv::Operation::Put => {
                        let holder = LeaseHolder::decode(&entry.value).map_err(|e| failed(&e))?;
                        holder
                            .direct
                            .map(|endpoint| (endpoint, holder.direct_ticket))
                            .ok_or(LinkError::NoEndpoint)
                    }
                    _ => Err(LinkError::NoEndpoint),
                }
            }
            None => {
                let subject = global_rpc_subject(&self.hello.cluster, GlobalOp::Status.name());
                let body = rpc::encode(&GlobalStatus {}).map_err(|e| failed(&e))?;
                let asked =
                    tokio::time::timeout(STATUS_TIMEOUT, self.nats.request(subject, body.into()))
                        .await
                        .map_err(|e| failed(&e))?
                        .map_err(|e| failed(&e))?;
                match rpc::decode::<RpcReply<GlobalStatusReply>>(&asked.payload) {
                    Ok(RpcReply::Ok(status)) => status
                        .direct
                        .map(|endpoint| (endpoint, status.direct_ticket))
                        .ok_or(LinkError::NoEndpoint),
                    Ok(RpcReply::Err(error)) => Err(failed(&error)),
                    Err(error) => Err(failed(&error)),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relinking_backs_off_with_every_failure_in_a_row() {
        assert_eq!(relink_after(1), RELINK_AFTER);
        assert_eq!(relink_after(2), RELINK_AFTER * 2);
        assert_eq!(relink_after(4), RELINK_AFTER * 8);
        assert_eq!(relink_after(30), RELINK_AT_MOST);
        assert_eq!(relink_after(u32::MAX), RELINK_AT_MOST);
    }
}
