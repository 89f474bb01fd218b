//! Commands: validate a request against the state and decide the events it causes.
//! The driver then applies those events ([`State::apply`]), appends them, and replies
//! only once they are durable. Handlers may change ephemeral state (pending puts,
//! leases, liveness) directly; durable state changes only through events.

mod grants;
mod leases;
mod maintenance;
mod mixed;
mod objects;
pub mod quota;
mod removal;
mod segments;

use hkvm_events::rpc::submaster::{
    Exist, ExistReply, GetReplicaList, GetReplicaListReply, LeaseReturn, LeaseSpace,
    LeaseSpaceReply, Mixed, MixedReply, MountSegment, PutCommit, PutCommitReply, PutEnd,
    PutEndReply, PutRevoke, PutRevokeReply, PutStart, PutStartReply, Remount, Remove, RemoveAll,
    RemoveAllReply, RemoveMatching, RemoveReply, SegmentStatus, Status, StatusReply,
    UnmountSegment,
};
use hkvm_events::rpc::RpcError;
use hkvm_events::{KvEvent, Limits};

pub use grants::GrantSigner;
pub use maintenance::maintain;

use crate::placement::PlacementStrategy;
use crate::state::State;
use quota::TenantQuotas;
pub use removal::{KeyMatcher, RemoveSlice, RemovedSlice};

/// The rules commands follow.
#[derive(Debug, Clone)]
pub struct Policy {
    /// Read lease granted by `get_replica_list`.
    pub lease_ttl_ms: u64,
    /// An un-ended `put_start` is reclaimed after this long.
    pub put_timeout_ms: u64,
    /// A space lease ends this long after it was granted.
    pub space_lease_ttl_ms: u64,
    /// Most bytes of one space lease, on each of its segments.
    pub max_space_lease: u64,
    /// A node silent this long is declared lost.
    pub node_timeout_ms: u64,
    /// Eviction starts when used/capacity exceeds this.
    pub high_watermark: f64,
    /// Fraction of objects evicted per round.
    pub evict_ratio: f64,
    /// Where replicas go.
    pub strategy: PlacementStrategy,
    /// Most replicas per object.
    pub max_replicas: u32,
    /// Most items in one batch request.
    pub max_batch: usize,
    /// Key and size bounds.
    pub limits: Limits,
    /// Bytes each named tenant may hold (see [`quota`]).
    pub tenant_quotas: TenantQuotas,
    /// Signs the data-port grants of the locations handed out; none: locations
    /// carry no grant, and nodes' data ports refuse them.
    pub grants: Option<GrantSigner>,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            lease_ttl_ms: 10_000,
            put_timeout_ms: 30_000,
            space_lease_ttl_ms: 30_000,
            max_space_lease: 1 << 30,
            node_timeout_ms: 10_000,
            high_watermark: 0.90,
            evict_ratio: 0.05,
            strategy: PlacementStrategy::Random,
            max_replicas: 8,
            max_batch: hkvm_events::rpc::submaster::MAX_BATCH_ITEMS,
            limits: Limits::default(),
            tenant_quotas: TenantQuotas::default(),
            grants: None,
        }
    }
}

/// A decoded request.
#[derive(Debug, Clone)]
pub enum Request {
    /// See [`MountSegment`].
    Mount(MountSegment),
    /// See [`UnmountSegment`].
    Unmount(UnmountSegment),
    /// See [`Remount`].
    Remount(Remount),
    /// See [`PutStart`].
    PutStart(PutStart),
    /// See [`PutEnd`].
    PutEnd(PutEnd),
    /// See [`PutRevoke`].
    PutRevoke(PutRevoke),
    /// See [`GetReplicaList`].
    GetReplicaList(GetReplicaList),
    /// See [`Exist`].
    Exist(Exist),
    /// See [`Remove`].
    Remove(Remove),
    /// See [`RemoveAll`].
    RemoveAll(RemoveAll),
    /// See [`RemoveMatching`].
    RemoveMatching(RemoveMatching),
    /// One slice of a `remove_all` or `remove_matching` (the server's form of
    /// them: one slice per command).
    RemoveSlice(RemoveSlice),
    /// See [`Status`].
    Status(Status),
    /// See [`Mixed`].
    Mixed(Mixed),
    /// See [`LeaseSpace`].
    LeaseSpace(LeaseSpace),
    /// See [`PutCommit`].
    PutCommit(PutCommit),
    /// See [`LeaseReturn`].
    LeaseReturn(LeaseReturn),
}

impl Request {
    /// The node a node's own operation (mount, unmount, remount) names.
    pub fn node(&self) -> Option<&hkvm_events::NodeId> {
        match self {
            Self::Mount(mount) => Some(&mount.node),
            Self::Unmount(unmount) => Some(&unmount.node),
            Self::Remount(remount) => Some(&remount.node),
            _ => None,
        }
    }

    /// Whether the request reads objects (its reply must wait until every earlier
    /// write is durable, so nobody sees state that could still be lost). A
    /// `put_end` or `put_commit` sent again reads one: its `Ok` says an earlier
    /// commit is done.
    pub fn reads_objects(&self) -> bool {
        matches!(
            self,
            Self::GetReplicaList(_)
                | Self::Exist(_)
                | Self::Status(_)
                | Self::Mixed(_)
                | Self::PutEnd(_)
                | Self::PutCommit(_)
        )
    }
}

/// A typed reply.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// Mount, unmount, remount.
    Done,
    /// PutStart.
    PutStart(PutStartReply),
    /// PutEnd.
    PutEnd(PutEndReply),
    /// PutRevoke.
    PutRevoke(PutRevokeReply),
    /// GetReplicaList.
    GetReplicaList(GetReplicaListReply),
    /// Exist.
    Exist(ExistReply),
    /// Remove.
    Remove(RemoveReply),
    /// RemoveAll, RemoveMatching.
    RemoveAll(RemoveAllReply),
    /// RemoveSlice.
    RemovedSlice(RemovedSlice),
    /// Status.
    Status(StatusReply),
    /// Mixed.
    Mixed(MixedReply),
    /// LeaseSpace.
    LeaseSpace(LeaseSpaceReply),
    /// PutCommit.
    PutCommit(PutCommitReply),
}

/// What a command decided: events to append (and apply), and the reply to send once
/// they are durable.
#[derive(Debug)]
pub struct Outcome {
    /// Events, in order.
    pub events: Vec<KvEvent>,
    /// The reply.
    pub reply: Reply,
}

impl Outcome {
    fn reply(reply: Reply) -> Self {
        Self {
            events: Vec::new(),
            reply,
        }
    }
}

/// Who is serving, for `Status` replies.
#[derive(Debug, Clone)]
pub struct ServingInfo {
    /// The producer id of the serving instance.
    pub producer: String,
    /// Its leadership epoch.
    pub epoch: u64,
}

fn check_batch(len: usize, policy: &Policy) -> Result<(), RpcError> {
    if len > policy.max_batch {
        return Err(RpcError::invalid(format!(
            "batch of {len} items exceeds the limit of {}",
            policy.max_batch
        )));
    }
    Ok(())
}

/// Decides `request` at time `now_ms`. Events in the outcome must then be applied
/// with [`State::apply`] before the next request is handled.
///
/// # Errors
/// An [`RpcError`] when the request as a whole is invalid.
pub fn handle(
    state: &mut State,
    request: Request,
    now_ms: u64,
    policy: &Policy,
    serving: &ServingInfo,
) -> Result<Outcome, RpcError> {
    match request {
        Request::Mount(mount) => segments::mount(state, mount, now_ms, policy),
        Request::Unmount(unmount) => segments::unmount(state, &unmount),
        Request::Remount(remount) => segments::remount(state, remount, now_ms, policy),
        Request::PutStart(put) => {
            check_batch(put.items.len(), policy)?;
            Ok(objects::put_start(state, put, now_ms, policy))
        }
        Request::PutEnd(put) => {
            check_batch(put.items.len(), policy)?;
            Ok(objects::put_end(state, put))
        }
        Request::PutRevoke(revoke) => {
            check_batch(revoke.keys.len(), policy)?;
            Ok(objects::put_revoke(state, revoke))
        }
        Request::GetReplicaList(get) => {
            check_batch(get.keys.len(), policy)?;
            Ok(objects::get_replica_list(state, get, now_ms, policy))
        }
        Request::Exist(exist) => {
            check_batch(exist.keys.len(), policy)?;
            Ok(Outcome::reply(Reply::Exist(objects::exist(
                state,
                &exist.keys,
            ))))
        }
        Request::Remove(remove) => {
            check_batch(remove.keys.len(), policy)?;
            Ok(objects::remove(state, remove, now_ms))
        }
        Request::RemoveAll(remove_all) => Ok(removal::remove_whole(
            state,
            RemoveSlice::of_all(&remove_all),
            now_ms,
        )),
        Request::RemoveMatching(matching) => Ok(removal::remove_whole(
            state,
            RemoveSlice::of_matching(&matching)?,
            now_ms,
        )),
        Request::RemoveSlice(step) => Ok(removal::remove_slice(state, &step, now_ms)),
        Request::Status(Status { segments }) => Ok(Outcome::reply(Reply::Status(status(
            state, serving, segments,
        )))),
        Request::Mixed(mixed) => {
            check_batch(mixed.len(), policy)?;
            Ok(mixed::mixed(state, mixed, now_ms, policy))
        }
        Request::LeaseSpace(ask) => leases::lease_space(state, ask, now_ms, policy),
        Request::PutCommit(commit) => {
            check_batch(commit.items.len(), policy)?;
            Ok(leases::put_commit(state, commit, now_ms, policy))
        }
        Request::LeaseReturn(returned) => Ok(leases::lease_return(state, &returned)),
    }
}

fn status(state: &State, serving: &ServingInfo, list_segments: bool) -> StatusReply {
    let (capacity, used) = state.usage();
    let segment_list = if list_segments {
        state
            .segments()
            .map(|(_, segment)| SegmentStatus {
                id: segment.id.clone(),
                node: segment.node.clone(),
                endpoint: segment.endpoint.clone(),
                rdma: segment.rdma.is_some(),
                capacity_bytes: segment.allocator.size(),
                used_bytes: segment.allocator.used_bytes(),
            })
            .collect()
    } else {
        Vec::new()
    };
    let nodes: std::collections::HashSet<_> =
        state.segments().map(|(_, s)| s.node.clone()).collect();
    StatusReply {
        producer: serving.producer.clone(),
        epoch: serving.epoch,
        applied_seq: state.applied_seq,
        objects: state.object_count() as u64,
        pending_puts: state.pending.len() as u64,
        space_leases: state.leases.len() as u64,
        segments: state.segments().count() as u64,
        nodes: nodes.len() as u64,
        used_bytes: used,
        capacity_bytes: capacity,
        segment_list,
    }
}

/// Most keys per `Removed`/`Evicted` event.
pub(crate) const KEYS_PER_EVENT: usize = 4096;
/// Most key bytes per `Removed`/`Evicted` event, so one event stays far below the
/// message size limit even with long keys.
pub(crate) const KEY_BYTES_PER_EVENT: usize = 128 * 1024;

/// Splits `keys` into events of at most [`KEYS_PER_EVENT`] keys and about
/// [`KEY_BYTES_PER_EVENT`] key bytes, built by `make`.
pub(crate) fn chunked(keys: Vec<String>, make: impl Fn(Vec<String>) -> KvEvent) -> Vec<KvEvent> {
    let mut events = Vec::new();
    let mut chunk = Vec::new();
    let mut bytes = 0;
    for key in keys {
        bytes += key.len();
        chunk.push(key);
        if chunk.len() >= KEYS_PER_EVENT || bytes >= KEY_BYTES_PER_EVENT {
            events.push(make(std::mem::take(&mut chunk)));
            bytes = 0;
        }
    }
    if !chunk.is_empty() {
        events.push(make(chunk));
    }
    events
}

#[cfg(test)]
mod tests;
