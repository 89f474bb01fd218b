//! The sub-master client: one async method per operation, over NATS request/reply.
//! It retries what is safe to retry — `Busy` (after the server's `retry_after`, with
//! jitter), no responder while a standby takes over, `NotLeader` — until a deadline,
//! so a failover under load costs clients latency, not errors, and never turns into
//! a retry storm.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::RequestErrorKind;
use hkvm_events::rpc::submaster::{
    Exist, ExistReply, GetReplicaList, GetReplicaListReply, MountSegment, Op, Ping, PingReply,
    PutEnd, PutEndItem, PutEndReply, PutRevoke, PutRevokeReply, PutStart, PutStartItem,
    PutStartReply, Remount, Remove, RemoveAll, RemoveAllReply, RemoveReply, Status, StatusReply,
    UnmountSegment,
};
use hkvm_events::rpc::{self, RpcErrorCode, RpcReply};
use hkvm_events::subject::submaster_rpc_subject;
use hkvm_events::{ClusterId, SubclusterId};
use rand::Rng as _;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::time::Instant;

use crate::error::ClientError;

/// Largest batch sent in one request; longer batches are split transparently.
pub const MAX_BATCH: usize = 4096;

/// Timeouts and retry policy.
#[derive(Debug, Clone, Copy)]
pub struct ClientConfig {
    /// How long one request waits for its reply.
    pub request_timeout: Duration,
    /// How long a call keeps retrying `Busy` / no-leader answers.
    pub retry_deadline: Duration,
    /// The first back-off without a server hint; it doubles up to `max_backoff`.
    pub min_backoff: Duration,
    /// The longest back-off.
    pub max_backoff: Duration,
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            request_timeout: Duration::from_secs(2),
            retry_deadline: Duration::from_secs(30),
            min_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_secs(1),
        }
    }
}

/// Counters of what the client went through (for tests, benchmarks and logs).
#[derive(Debug, Default)]
pub struct ClientStats {
    /// `Busy` answers that were retried.
    pub busy: AtomicU64,
    /// Retries because no sub-master answered (takeover in progress) or `NotLeader`.
    pub leader_waits: AtomicU64,
}

/// A client of one sub-cluster's sub-master. Cheap to clone.
#[derive(Debug, Clone)]
pub struct SubmasterClient {
    nats: async_nats::Client,
    cluster: ClusterId,
    subcluster: SubclusterId,
    config: ClientConfig,
    stats: Arc<ClientStats>,
}

/// Whether an operation may be sent again after a timeout without changing its
/// meaning: reads, idempotent mounts, and `put_start` (a reservation made by a leader
/// that then died is gone with it; one made by a live leader makes the resend answer
/// `AlreadyExists` and is reclaimed by the put timeout).
fn safe_to_resend(op: Op) -> bool {
    matches!(
        op,
        Op::Ping
            | Op::GetReplicaList
            | Op::Exist
            | Op::Status
            | Op::MountSegment
            | Op::Remount
            | Op::PutStart
    )
}

impl SubmasterClient {
    /// A client of `subcluster` in `cluster` with default timeouts.
    pub fn new(nats: async_nats::Client, cluster: ClusterId, subcluster: SubclusterId) -> Self {
        Self::with_config(nats, cluster, subcluster, ClientConfig::default())
    }

    /// A client with explicit timeouts and retry policy.
    pub fn with_config(
        nats: async_nats::Client,
        cluster: ClusterId,
        subcluster: SubclusterId,
        config: ClientConfig,
    ) -> Self {
        Self {
            nats,
            cluster,
            subcluster,
            config,
            stats: Arc::new(ClientStats::default()),
        }
    }

    /// The sub-cluster this client talks to.
    pub fn subcluster(&self) -> &SubclusterId {
        &self.subcluster
    }

    /// The cluster this client talks to.
    pub fn cluster(&self) -> &ClusterId {
        &self.cluster
    }

    /// One request to any subject, with this client's timeout and no retry; the
    /// reply decoded as an [`RpcReply`] (used for global-master calls).
    ///
    /// # Errors
    /// [`ClientError`] on timeout, transport failure or an undecodable reply.
    pub async fn raw_request<Req: Serialize, Rep: DeserializeOwned>(
        &self,
        subject: String,
        request: &Req,
    ) -> Result<RpcReply<Rep>, ClientError> {
        let op = "raw";
        let body = rpc::encode(request).map_err(|e| ClientError::Codec {
            op,
            reason: e.to_string(),
        })?;
        let message = tokio::time::timeout(
            self.config.request_timeout,
            self.nats.request(subject, body.into()),
        )
        .await
        .map_err(|_| ClientError::Timeout {
            op,
            ms: self.config.request_timeout.as_millis() as u64,
        })?
        .map_err(|e| ClientError::Unavailable {
            op,
            ms: 0,
            last: e.to_string(),
        })?;
        rpc::decode(&message.payload).map_err(|e| ClientError::Codec {
            op,
            reason: e.to_string(),
        })
    }

    /// What the client went through so far.
    pub fn stats(&self) -> &ClientStats {
        &self.stats
    }

    async fn call<Req: Serialize, Rep: DeserializeOwned>(
        &self,
        op: Op,
        request: &Req,
    ) -> Result<Rep, ClientError> {
        let name = op.name();
        let body = rpc::encode(request).map_err(|e| ClientError::Codec {
            op: name,
            reason: e.to_string(),
        })?;
        let subject = submaster_rpc_subject(&self.cluster, &self.subcluster, name);
        let started = Instant::now();
        let mut backoff = self.config.min_backoff;
        loop {
            let sent = tokio::time::timeout(
                self.config.request_timeout,
                self.nats.request(subject.clone(), body.clone().into()),
            )
            .await;
            let wait = match sent {
                Ok(Ok(message)) => {
                    let reply: RpcReply<Rep> =
                        rpc::decode(&message.payload).map_err(|e| ClientError::Codec {
                            op: name,
                            reason: e.to_string(),
                        })?;
                    match reply {
                        RpcReply::Ok(value) => return Ok(value),
                        RpcReply::Err(error) => match error.code {
                            RpcErrorCode::Busy { retry_after_ms } => {
                                self.stats.busy.fetch_add(1, Ordering::Relaxed);
                                (Duration::from_millis(retry_after_ms), error.to_string())
                            }
                            RpcErrorCode::NotLeader => {
                                self.stats.leader_waits.fetch_add(1, Ordering::Relaxed);
                                (backoff, error.to_string())
                            }
                            _ => {
                                return Err(ClientError::Rpc {
                                    op: name,
                                    source: error,
                                })
                            }
                        },
                    }
                }
                Ok(Err(error)) if error.kind() == RequestErrorKind::NoResponders => {
                    self.stats.leader_waits.fetch_add(1, Ordering::Relaxed);
                    (backoff, "no sub-master is serving".to_owned())
                }
                Ok(Err(error))
                    if error.kind() == RequestErrorKind::TimedOut && safe_to_resend(op) =>
                {
                    (backoff, error.to_string())
                }
                Ok(Err(error)) => {
                    return Err(ClientError::Unavailable {
                        op: name,
                        ms: started.elapsed().as_millis() as u64,
                        last: error.to_string(),
                    })
                }
                Err(_) if safe_to_resend(op) => (backoff, "request timed out".to_owned()),
                Err(_) => {
                    return Err(ClientError::Timeout {
                        op: name,
                        ms: self.config.request_timeout.as_millis() as u64,
                    })
                }
            };
            let (delay, last) = wait;
            if started.elapsed() + delay > self.config.retry_deadline {
                return Err(ClientError::Unavailable {
                    op: name,
                    ms: started.elapsed().as_millis() as u64,
                    last,
                });
            }
            // Full jitter on top of the hint spreads thousands of retrying clients.
            let jitter = rand::thread_rng().gen_range(0..=delay.as_millis() as u64 / 2 + 1);
            tokio::time::sleep(delay + Duration::from_millis(jitter)).await;
            backoff = (backoff * 2).min(self.config.max_backoff);
        }
    }

    /// Calls a batch operation in chunks of at most [`MAX_BATCH`] items (the
    /// server's default bound), concatenating the per-item replies in order.
    async fn call_batched<Item: Clone, Req: Serialize, Rep: DeserializeOwned>(
        &self,
        op: Op,
        items: Vec<Item>,
        request: impl Fn(Vec<Item>) -> Req,
    ) -> Result<Vec<Rep>, ClientError> {
        if items.len() <= MAX_BATCH {
            return self.call(op, &request(items)).await;
        }
        let mut replies = Vec::with_capacity(items.len());
        for chunk in items.chunks(MAX_BATCH) {
            let part: Vec<Rep> = self.call(op, &request(chunk.to_vec())).await?;
            replies.extend(part);
        }
        Ok(replies)
    }

    /// Mounts a segment.
    ///
    /// # Errors
    /// [`ClientError`] when the sub-master refuses or is unreachable.
    pub async fn mount_segment(&self, mount: MountSegment) -> Result<(), ClientError> {
        self.call(Op::MountSegment, &mount).await
    }

    /// Unmounts a segment.
    ///
    /// # Errors
    /// As for [`SubmasterClient::mount_segment`].
    pub async fn unmount_segment(&self, unmount: UnmountSegment) -> Result<(), ClientError> {
        self.call(Op::UnmountSegment, &unmount).await
    }

    /// Re-announces all of a node's segments.
    ///
    /// # Errors
    /// As for [`SubmasterClient::mount_segment`].
    pub async fn remount(&self, remount: Remount) -> Result<(), ClientError> {
        self.call(Op::Remount, &remount).await
    }

    /// Reports a node alive.
    ///
    /// # Errors
    /// As for [`SubmasterClient::mount_segment`].
    pub async fn ping(&self, ping: Ping) -> Result<PingReply, ClientError> {
        self.call(Op::Ping, &ping).await
    }

    /// Reserves space for objects (per-item results).
    ///
    /// # Errors
    /// As for [`SubmasterClient::mount_segment`].
    pub async fn put_start(&self, items: Vec<PutStartItem>) -> Result<PutStartReply, ClientError> {
        self.call_batched(Op::PutStart, items, |items| PutStart { items })
            .await
    }

    /// Commits written objects (per-item results).
    ///
    /// # Errors
    /// As for [`SubmasterClient::mount_segment`].
    pub async fn put_end(&self, items: Vec<PutEndItem>) -> Result<PutEndReply, ClientError> {
        self.call_batched(Op::PutEnd, items, |items| PutEnd { items })
            .await
    }

    /// Abandons pending puts.
    ///
    /// # Errors
    /// As for [`SubmasterClient::mount_segment`].
    pub async fn put_revoke(&self, keys: Vec<String>) -> Result<PutRevokeReply, ClientError> {
        self.call_batched(Op::PutRevoke, keys, |keys| PutRevoke { keys })
            .await
    }

    /// Where objects are, with read leases.
    ///
    /// # Errors
    /// As for [`SubmasterClient::mount_segment`].
    pub async fn get_replica_list(
        &self,
        keys: Vec<String>,
    ) -> Result<GetReplicaListReply, ClientError> {
        self.call(Op::GetReplicaList, &GetReplicaList { keys })
            .await
    }

    /// Which keys exist.
    ///
    /// # Errors
    /// As for [`SubmasterClient::mount_segment`].
    pub async fn exist(&self, keys: Vec<String>) -> Result<ExistReply, ClientError> {
        self.call_batched(Op::Exist, keys, |keys| Exist { keys })
            .await
    }

    /// Removes objects.
    ///
    /// # Errors
    /// As for [`SubmasterClient::mount_segment`].
    pub async fn remove(&self, keys: Vec<String>, force: bool) -> Result<RemoveReply, ClientError> {
        self.call_batched(Op::Remove, keys, |keys| Remove { keys, force })
            .await
    }

    /// Removes every object.
    ///
    /// # Errors
    /// As for [`SubmasterClient::mount_segment`].
    pub async fn remove_all(&self, force: bool) -> Result<RemoveAllReply, ClientError> {
        self.call(Op::RemoveAll, &RemoveAll { force }).await
    }

    /// The sub-master's state summary.
    ///
    /// # Errors
    /// As for [`SubmasterClient::mount_segment`].
    pub async fn status(&self) -> Result<StatusReply, ClientError> {
        self.call(Op::Status, &Status {}).await
    }
}
