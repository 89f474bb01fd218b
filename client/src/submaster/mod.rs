//! The sub-master client: one async method per operation, every call through the
//! shared [`RpcCaller`] retry policy: hot operations on a direct link to the
//! leader when one is up ([`crate::direct`]), everything else (and everything
//! while no link is up) over NATS request/reply.

use hkvm_events::rpc::submaster::Audience;
use hkvm_events::rpc::submaster::{
    Exist, ExistReply, GetReplicaList, GetReplicaListReply, LeaseId, LeaseReturn, LeaseSpace,
    LeaseSpaceReply, MountSegment, Op, Ping, PingReply, PutCommit, PutCommitItem, PutCommitReply,
    PutEnd, PutEndItem, PutEndReply, PutRevoke, PutRevokeReply, PutStart, PutStartItem,
    PutStartReply, Remount, Remove, RemoveAll, RemoveAllReply, RemoveMatching, RemoveReply, Status,
    StatusReply, UnmountSegment, MAX_BATCH_ITEMS,
};
use hkvm_events::rpc::{RpcError, RpcErrorCode};
use hkvm_events::subject::{
    leader_subject, stream_name, submaster_admin_subject, submaster_node_subject,
    submaster_rpc_subject, user_of_inbox,
};
use hkvm_events::{ClusterId, NodeId, SubclusterId};
use hkvm_log::permissions::may_administer;
use serde::de::DeserializeOwned;
use serde::Serialize;

use std::sync::Arc;

mod mixed;

use crate::coalesce::{CoalesceConfig, Coalescer};
use crate::direct::DirectRoute;
use crate::error::ClientError;
use crate::leader_watch::LeaderWatch;
use crate::retry::{ClientStats, Presence, Resend, RetryPolicy, RpcCaller};
use mixed::{answers_of, Answer, Call};

/// A client of one sub-cluster's sub-master. Cheap to clone.
#[derive(Debug, Clone)]
pub struct SubmasterClient {
    caller: RpcCaller,
    cluster: ClusterId,
    subcluster: SubclusterId,
    /// Set on a real client: concurrent calls share batched requests.
    coalescing: Option<Arc<Coalescer<Call, Answer>>>,
    /// The sub-cluster's leader announcements, which end a failover wait early
    /// (none: waits end by their back-off alone).
    leader: Option<Arc<LeaderWatch>>,
}

/// Whether an operation may be sent again after a timeout without changing its
/// meaning: reads, idempotent mounts, and `put_start` (a reservation made by a leader
/// that then died is gone with it; one made by a live leader is given back again
/// when the put carries an id, and otherwise makes the resend answer
/// `AlreadyExists` and is reclaimed by the put timeout). `put_end` and `mixed` are
/// decided per request: safe when every commit in it carries a put id.
fn resend(op: Op) -> Resend {
    match op {
        Op::Ping
        | Op::GetReplicaList
        | Op::Exist
        | Op::Status
        | Op::MountSegment
        | Op::Remount
        | Op::PutStart
        | Op::LeaseReturn => Resend::Safe,
        // Decided per request (`put_end`, `SubmasterClient::mixed`).
        Op::Mixed | Op::PutEnd | Op::PutCommit => Resend::Unsafe,
        // A lease granted to a request whose answer was lost ends by time.
        Op::LeaseSpace => Resend::Safe,
        Op::UnmountSegment | Op::PutRevoke | Op::Remove | Op::RemoveAll | Op::RemoveMatching => {
            Resend::Unsafe
        }
    }
}

/// How long a mass removal (`remove_all`, `remove_matching`) may take before
/// its caller stops waiting: the sub-master removes a slice of its table at a
/// time between other requests, so removing millions of objects takes seconds.
pub const MASS_REMOVAL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

/// Whether commits may be sent again after a timeout: when each names its put's
/// id, so that the sub-master tells a commit done before from one never made.
pub(super) fn commits_resend(mut put_ids: impl Iterator<Item = u64>) -> Resend {
    if put_ids.all(|put_id| put_id != 0) {
        Resend::Safe
    } else {
        Resend::Unsafe
    }
}

/// Whether `op` came with space leases, so that a leader of an older build
/// does not serve it: such a call ends as [`ClientError::NoService`] instead of
/// waiting out the retry deadline, and its callers do without (`put_commit`'s
/// values are put through `put_start` / `put_end`).
fn served_since_leases(op: Op) -> bool {
    matches!(op, Op::LeaseSpace | Op::PutCommit | Op::LeaseReturn)
}

impl SubmasterClient {
    /// A client of `subcluster` in `cluster` with the default retry policy.
    pub fn new(nats: async_nats::Client, cluster: ClusterId, subcluster: SubclusterId) -> Self {
        Self::with_policy(nats, cluster, subcluster, RetryPolicy::default())
    }

    /// A client with explicit timeouts and retry policy.
    pub fn with_policy(
        nats: async_nats::Client,
        cluster: ClusterId,
        subcluster: SubclusterId,
        policy: RetryPolicy,
    ) -> Self {
        Self::with_caller(RpcCaller::new(nats, policy), cluster, subcluster)
    }

    /// A client sharing `caller` (its connection, policy and stats).
    pub fn with_caller(caller: RpcCaller, cluster: ClusterId, subcluster: SubclusterId) -> Self {
        let direct = Arc::new(DirectRoute::leader(
            caller.nats().clone(),
            cluster.clone(),
            subcluster.clone(),
        ));
        let leader = Some(Arc::new(
            LeaderWatch::new(caller.nats().clone(), leader_subject(&cluster, &subcluster))
                .with_direct(direct),
        ));
        Self {
            caller,
            cluster,
            subcluster,
            coalescing: None,
            leader,
        }
    }

    /// This client with every request over NATS, none on a direct link to the
    /// leader (for comparisons, and where only the broker may be reached).
    pub fn without_direct(self) -> Self {
        let leader = Some(Arc::new(LeaderWatch::new(
            self.caller.nats().clone(),
            leader_subject(&self.cluster, &self.subcluster),
        )));
        Self { leader, ..self }
    }

    /// Requests this client (and its clones) sent on direct links to the leader.
    pub fn direct_requests(&self) -> u64 {
        self.leader
            .as_deref()
            .and_then(LeaderWatch::direct)
            .map_or(0, |direct| direct.sent())
    }

    /// The endpoint and epoch of the leader this client has a direct link to,
    /// if it has one up.
    pub fn direct_link(&self) -> Option<(String, u64)> {
        self.leader
            .as_deref()
            .and_then(LeaderWatch::direct)
            .and_then(|direct| direct.linked())
    }

    /// This client without leader announcements: for a client made for one
    /// short call (the global master's proxy makes one per request), which would
    /// otherwise subscribe to them first.
    pub fn without_leader_watch(self) -> Self {
        Self {
            leader: None,
            ..self
        }
    }

    /// This client with `put_start`, `put_end`, `put_commit`, `get_replica_list`
    /// and `exist` calls coalesced: concurrent calls (from its clones too),
    /// whatever their operation, go out together as one mixed request at a time.
    /// Needs a Tokio runtime.
    pub fn coalesced(self, config: CoalesceConfig) -> Self {
        let plain = Self {
            coalescing: None,
            ..self.clone()
        };
        let coalescer = Coalescer::start(config, move |calls| {
            let plain = plain.clone();
            async move { plain.mixed(calls).await }
        });
        Self {
            coalescing: Some(Arc::new(coalescer)),
            ..self
        }
    }

    /// Sends `items` of `op` through the coalescer when this client coalesces and
    /// they are few enough to share a request; otherwise gives them back (a larger
    /// call goes out alone, in chunks).
    async fn coalesce<I, T>(
        &self,
        op: Op,
        items: Vec<I>,
        call: fn(I) -> Call,
        answer: fn(Answer) -> Option<T>,
    ) -> Result<Result<Vec<T>, ClientError>, Vec<I>> {
        let Some(coalescer) = self
            .coalescing
            .as_deref()
            .filter(|_| items.len() <= MAX_BATCH_ITEMS)
        else {
            return Err(items);
        };
        let calls = items.into_iter().map(call).collect();
        Ok(match coalescer.call(op.name(), calls).await {
            Ok(answers) => answers_of(answers, answer),
            Err(error) => Err(error),
        })
    }

    /// The sub-cluster this client talks to.
    pub fn subcluster(&self) -> &SubclusterId {
        &self.subcluster
    }

    /// The cluster this client talks to.
    pub fn cluster(&self) -> &ClusterId {
        &self.cluster
    }

    /// The caller (connection, retry policy, stats) this client uses.
    pub fn caller(&self) -> &RpcCaller {
        &self.caller
    }

    /// What the client went through so far.
    pub fn stats(&self) -> &ClientStats {
        self.caller.stats()
    }

    async fn call<Req: Serialize, Rep: DeserializeOwned>(
        &self,
        op: Op,
        request: &Req,
    ) -> Result<Rep, ClientError> {
        self.call_with(op, request, resend(op)).await
    }

    /// The subject `op` goes on ([`Op::audience`]); `node` names the calling
    /// node for a node's own operations.
    fn subject(&self, op: Op, node: Option<&NodeId>) -> String {
        let (cluster, subcluster) = (&self.cluster, &self.subcluster);
        match (op.audience(), node) {
            (Audience::Admin, _) => submaster_admin_subject(cluster, subcluster, op.name()),
            (Audience::Node, Some(node)) => {
                submaster_node_subject(cluster, subcluster, node.as_str(), op.name())
            }
            _ => submaster_rpc_subject(cluster, subcluster, op.name()),
        }
    }

    /// Calls a node's own operation for `node`, on that node's subject.
    async fn call_as_node<Req: Serialize, Rep: DeserializeOwned>(
        &self,
        op: Op,
        node: &NodeId,
        request: &Req,
    ) -> Result<Rep, ClientError> {
        self.call_on(
            &self.caller,
            op,
            self.subject(op, Some(node)),
            request,
            resend(op),
        )
        .await
    }

    /// Calls a mass removal (the admin's subject, a long timeout). A
    /// connection logged in as a role of the generated config that may not send
    /// it is refused here, at once, rather than after the timeout its refused
    /// publish would take.
    async fn call_mass_removal<Req: Serialize, Rep: DeserializeOwned>(
        &self,
        op: Op,
        request: &Req,
    ) -> Result<Rep, ClientError> {
        let inbox = self.caller.nats().new_inbox();
        if let Some(user) = user_of_inbox(&inbox).filter(|user| !may_administer(user)) {
            return Err(ClientError::Rpc {
                op: op.name(),
                source: RpcError::new(
                    RpcErrorCode::Forbidden,
                    format!(
                        "{} needs the admin role; this connection logs in as {user}",
                        op.name()
                    ),
                ),
            });
        }
        let caller = self.caller.with_request_timeout(MASS_REMOVAL_TIMEOUT);
        self.call_on(&caller, op, self.subject(op, None), request, resend(op))
            .await
    }

    async fn call_with<Req: Serialize, Rep: DeserializeOwned>(
        &self,
        op: Op,
        request: &Req,
        resend: Resend,
    ) -> Result<Rep, ClientError> {
        self.call_on(&self.caller, op, self.subject(op, None), request, resend)
            .await
    }

    async fn call_on<Req: Serialize, Rep: DeserializeOwned>(
        &self,
        caller: &RpcCaller,
        op: Op,
        subject: String,
        request: &Req,
        resend: Resend,
    ) -> Result<Rep, ClientError> {
        caller
            .call_checked(
                op.name(),
                subject,
                request,
                resend,
                || self.presence(op),
                self.leader.as_deref(),
            )
            .await
    }

    /// Whether `op` has a server to wait for. The sub-cluster exists once any
    /// sub-master of it started (it has a stream): a sub-cluster without one is a
    /// wrong name, or one never started, not a failover to wait out. An
    /// operation an older build lacks ([`served_since_leases`]) also has none
    /// when the leader answers `status` but not it.
    async fn presence(&self, op: Op) -> Presence {
        match self.stream_presence().await {
            Presence::Present if served_since_leases(op) => self.leader_serves(op).await,
            presence => presence,
        }
    }

    /// Whether the leader that serves `status` also serves `op`: a request to
    /// `op` just went unanswered, so an answered `status` means an older build
    /// leads.
    async fn leader_serves(&self, op: Op) -> Presence {
        let subject = submaster_rpc_subject(&self.cluster, &self.subcluster, Op::Status.name());
        let asked = self
            .caller
            .call_once::<Status, StatusReply>(Op::Status.name(), subject, &Status::default())
            .await;
        match asked {
            // Answered (in whatever form that build answers).
            Ok(_) | Err(ClientError::Codec { .. }) => Presence::Absent(format!(
                "the sub-master leading sub-cluster {} answers status but not {}: it runs \
                 an older build",
                self.subcluster,
                op.name()
            )),
            // No leader at all yet: a takeover to wait out.
            Err(_) => Presence::Present,
        }
    }

    /// Whether this sub-cluster's stream exists.
    async fn stream_presence(&self) -> Presence {
        let stream = stream_name(&self.cluster, &self.subcluster);
        let js = async_nats::jetstream::new(self.caller.nats().clone());
        match js.get_stream(&stream).await {
            Ok(_) => Presence::Present,
            Err(error)
                if matches!(
                    error.kind(),
                    async_nats::jetstream::context::GetStreamErrorKind::JetStream(ref js)
                        if js.error_code() == async_nats::jetstream::ErrorCode::STREAM_NOT_FOUND
                ) =>
            {
                Presence::Absent(format!(
                    "no sub-master of sub-cluster {} in cluster {} ever started (it has no \
                     stream {stream}); check the names with `hkvm status`",
                    self.subcluster, self.cluster
                ))
            }
            Err(_) => Presence::Unknown,
        }
    }

    /// Calls a batch operation in chunks of at most [`MAX_BATCH_ITEMS`] items (the
    /// server's default bound), concatenating the per-item replies in order.
    async fn call_batched<Item: Clone, Req: Serialize, Rep: DeserializeOwned>(
        &self,
        op: Op,
        items: Vec<Item>,
        request: impl Fn(Vec<Item>) -> Req,
    ) -> Result<Vec<Rep>, ClientError> {
        self.call_batched_with(op, items, request, resend(op)).await
    }

    async fn call_batched_with<Item: Clone, Req: Serialize, Rep: DeserializeOwned>(
        &self,
        op: Op,
        items: Vec<Item>,
        request: impl Fn(Vec<Item>) -> Req,
        resend: Resend,
    ) -> Result<Vec<Rep>, ClientError> {
        if items.len() <= MAX_BATCH_ITEMS {
            return self.call_with(op, &request(items), resend).await;
        }
        let mut replies = Vec::with_capacity(items.len());
        for chunk in items.chunks(MAX_BATCH_ITEMS) {
            let part: Vec<Rep> = self.call_with(op, &request(chunk.to_vec()), resend).await?;
            replies.extend(part);
        }
        Ok(replies)
    }

    /// Mounts a segment.
    ///
    /// # Errors
    /// [`ClientError`] when the sub-master refuses or is unreachable.
    pub async fn mount_segment(&self, mount: MountSegment) -> Result<(), ClientError> {
        self.call_as_node(Op::MountSegment, &mount.node, &mount)
            .await
    }

    /// Unmounts a segment.
    ///
    /// # Errors
    /// As for [`SubmasterClient::mount_segment`].
    pub async fn unmount_segment(&self, unmount: UnmountSegment) -> Result<(), ClientError> {
        self.call_as_node(Op::UnmountSegment, &unmount.node, &unmount)
            .await
    }

    /// Re-announces all of a node's segments.
    ///
    /// # Errors
    /// As for [`SubmasterClient::mount_segment`].
    pub async fn remount(&self, remount: Remount) -> Result<(), ClientError> {
        self.call_as_node(Op::Remount, &remount.node, &remount)
            .await
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
        let items = match self
            .coalesce(Op::PutStart, items, Call::Start, Answer::into_start)
            .await
        {
            Ok(result) => return result,
            Err(items) => items,
        };
        self.call_batched(Op::PutStart, items, |items| PutStart { items })
            .await
    }

    /// Commits written objects (per-item results). When every item carries its
    /// put's id the request is idempotent and is sent again after a timeout, so
    /// each item ends `Ok` (committed) or [`ItemError::NoPendingPut`] (it never
    /// will be); without ids a timeout leaves the outcome unknown.
    ///
    /// [`ItemError::NoPendingPut`]: hkvm_events::rpc::submaster::ItemError::NoPendingPut
    ///
    /// # Errors
    /// As for [`SubmasterClient::mount_segment`].
    pub async fn put_end(&self, items: Vec<PutEndItem>) -> Result<PutEndReply, ClientError> {
        let items = match self
            .coalesce(Op::PutEnd, items, Call::End, Answer::into_end)
            .await
        {
            Ok(result) => return result,
            Err(items) => items,
        };
        let resend = commits_resend(items.iter().map(|item| item.put_id));
        self.call_batched_with(Op::PutEnd, items, |items| PutEnd { items }, resend)
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
        let keys = match self
            .coalesce(Op::GetReplicaList, keys, Call::Locate, Answer::into_locate)
            .await
        {
            Ok(result) => return result,
            Err(keys) => keys,
        };
        self.call_batched(Op::GetReplicaList, keys, |keys| GetReplicaList {
            keys,
            lease: true,
        })
        .await
    }

    /// Where objects are, without a read lease: a look (`hkvm stat`) that does not
    /// keep them from eviction or removal. Never coalesced.
    ///
    /// # Errors
    /// As for [`SubmasterClient::mount_segment`].
    pub async fn peek_replica_list(
        &self,
        keys: Vec<String>,
    ) -> Result<GetReplicaListReply, ClientError> {
        self.call_batched(Op::GetReplicaList, keys, |keys| GetReplicaList {
            keys,
            lease: false,
        })
        .await
    }

    /// Which keys exist.
    ///
    /// # Errors
    /// As for [`SubmasterClient::mount_segment`].
    pub async fn exist(&self, keys: Vec<String>) -> Result<ExistReply, ClientError> {
        let keys = match self
            .coalesce(Op::Exist, keys, Call::Exist, Answer::into_exist)
            .await
        {
            Ok(result) => return result,
            Err(keys) => keys,
        };
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
        self.call_mass_removal(Op::RemoveAll, &RemoveAll { force })
            .await
    }

    /// Removes every object whose key matches `pattern` (a regular expression);
    /// with a `tenant`, only that tenant's keys, matched as the tenant names them
    /// (see [`hkvm_events::tenant`]).
    ///
    /// # Errors
    /// As for [`SubmasterClient::mount_segment`]; an invalid pattern is refused
    /// (`InvalidRequest`).
    pub async fn remove_matching(
        &self,
        pattern: &str,
        tenant: Option<&str>,
        force: bool,
    ) -> Result<RemoveAllReply, ClientError> {
        self.call_mass_removal(
            Op::RemoveMatching,
            &RemoveMatching {
                pattern: pattern.to_owned(),
                force,
                tenant: tenant.map(str::to_owned),
            },
        )
        .await
    }

    /// The sub-master's state summary.
    ///
    /// # Errors
    /// As for [`SubmasterClient::mount_segment`].
    pub async fn status(&self) -> Result<StatusReply, ClientError> {
        self.call(Op::Status, &Status::default()).await
    }

    /// Whether concurrent calls share batched requests ([`SubmasterClient::coalesced`]).
    pub fn is_coalescing(&self) -> bool {
        self.coalescing.is_some()
    }

    /// Leases space for objects this client places itself (see
    /// [`hkvm_events::rpc::space_lease`]). Never coalesced.
    ///
    /// # Errors
    /// As for [`SubmasterClient::mount_segment`]; a sub-master that does not know
    /// the operation leaves it unanswered until the retry deadline.
    pub async fn lease_space(&self, ask: LeaseSpace) -> Result<LeaseSpaceReply, ClientError> {
        self.call(Op::LeaseSpace, &ask).await
    }

    /// Commits objects written into leases (per-item results). Items carrying
    /// their put's id make the request idempotent, so it is sent again after a
    /// timeout as `put_end` is.
    ///
    /// # Errors
    /// As for [`SubmasterClient::mount_segment`].
    pub async fn put_commit(
        &self,
        items: Vec<PutCommitItem>,
    ) -> Result<PutCommitReply, ClientError> {
        let items = match self
            .coalesce(Op::PutCommit, items, Call::Commit, Answer::into_commit)
            .await
        {
            Ok(result) => return result,
            Err(items) => items,
        };
        let resend = commits_resend(items.iter().map(|item| item.put_id));
        self.call_batched_with(Op::PutCommit, items, |items| PutCommit { items }, resend)
            .await
    }

    /// Ends a lease: what no commit took goes back to the free space.
    ///
    /// # Errors
    /// As for [`SubmasterClient::mount_segment`].
    pub async fn lease_return(&self, lease: LeaseId) -> Result<(), ClientError> {
        self.call(Op::LeaseReturn, &LeaseReturn { lease }).await
    }
}
