//! Sub-master RPCs (Mooncake-master semantics), one subject per operation:
//! `hkvm.<cluster>.<subcluster>.rpc.<op>` with `op` from [`Op::name`] (under
//! `rpc.node.<node>` or `rpc.admin` for the operations of [`Audience::Node`] and
//! [`Audience::Admin`]). Batch operations answer one [`ItemResult`] per item, in
//! request order.

use serde::{Deserialize, Serialize};

mod op;
pub use op::{Audience, Op};

use crate::grant::Grant;
use crate::id::{NodeId, SegmentId};
use crate::transport::RdmaEndpoint;

pub use super::space_lease::{
    LeaseId, LeaseReturn, LeaseSpace, LeaseSpaceReply, PutCommit, PutCommitItem, PutCommitReply,
    SpaceLease,
};

/// Most items in one batch request a sub-master accepts by default; clients split
/// longer batches into requests of at most this many items.
pub const MAX_BATCH_ITEMS: usize = 4096;

/// Most nodes one placement request may ask to avoid
/// ([`PutStartItem::avoid_nodes`], [`LeaseSpace::avoid_nodes`]).
pub const MAX_AVOIDED_NODES: usize = 64;

/// Why one item of a batch failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum ItemError {
    /// No such object (or not complete yet, for reads).
    #[error("not found")]
    NotFound,
    /// A complete object or a pending put already holds the key.
    #[error("already exists")]
    AlreadyExists,
    /// Not enough free space on enough distinct nodes.
    #[error("no space for {replicas} replicas of {size} bytes")]
    NoSpace {
        /// Replicas asked for.
        replicas: u32,
        /// Object size.
        size: u64,
    },
    /// The object is leased by a reader; use `force` to remove anyway.
    #[error("leased by a reader")]
    Leased,
    /// `put_end` or `put_revoke` for a key without a pending put (never started,
    /// already ended, revoked, timed out, or lost in a leader change).
    #[error("no pending put")]
    NoPendingPut,
    /// The checksum given to `put_end` is missing or the put was already ended.
    #[error("invalid item: {0}")]
    Invalid(String),
    /// `put_commit` into a lease this leader does not hold (never granted,
    /// returned, timed out, its segment unmounted, or lost in a leader change):
    /// put through `put_start` / `put_end` instead.
    #[error("no such space lease")]
    NoLease,
    /// The put would take the key's tenant past its quota (see
    /// [`crate::tenant`]).
    #[error("the tenant holds {held} bytes of its quota of {quota}")]
    QuotaExceeded {
        /// The tenant's quota, bytes.
        quota: u64,
        /// What its objects hold now, bytes.
        held: u64,
    },
}

/// One item's outcome in a batch reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ItemResult<T> {
    /// Success.
    #[serde(rename = "ok")]
    Ok(T),
    /// Failure of this item only.
    #[serde(rename = "err")]
    Err(ItemError),
}

impl<T> From<Result<T, ItemError>> for ItemResult<T> {
    fn from(result: Result<T, ItemError>) -> Self {
        match result {
            Ok(value) => Self::Ok(value),
            Err(error) => Self::Err(error),
        }
    }
}

impl<T> ItemResult<T> {
    /// The outcome as a `Result`.
    ///
    /// # Errors
    /// The item's [`ItemError`].
    pub fn into_result(self) -> Result<T, ItemError> {
        match self {
            Self::Ok(value) => Ok(value),
            Self::Err(error) => Err(error),
        }
    }
}

/// Where a replica lives, with what a client needs to reach it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaLocation {
    /// The node owning the segment.
    pub node: NodeId,
    /// The segment.
    pub segment: SegmentId,
    /// The node's transfer endpoint (`host:port`).
    pub endpoint: String,
    /// Byte offset inside the segment.
    pub offset: u64,
    /// How to reach the segment over RDMA, when its node serves RDMA.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdma: Option<RdmaEndpoint>,
    /// What the node's data port lets the holder do at this location (read a
    /// replica, write a reservation or a leased range), signed by the sub-master.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grant: Option<Grant>,
}

/// A node mounts a memory segment (or re-announces it after a leader change).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountSegment {
    /// The node.
    pub node: NodeId,
    /// The segment's name.
    pub segment: SegmentId,
    /// Size in bytes.
    pub size: u64,
    /// Transfer endpoint (`host:port`).
    pub endpoint: String,
    /// How peers reach the segment over RDMA (none: TCP only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdma: Option<RdmaEndpoint>,
}

/// A node unmounts a segment: every object with a replica there loses it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnmountSegment {
    /// The node.
    pub node: NodeId,
    /// The segment.
    pub segment: SegmentId,
}

/// A node re-announces all its segments (after `PingReply::need_remount`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Remount {
    /// The node.
    pub node: NodeId,
    /// All its segments.
    pub segments: Vec<MountSegment>,
}

/// Node liveness; a node silent past its timeout is declared lost.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ping {
    /// The node.
    pub node: NodeId,
}

/// The answer to a ping.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PingReply {
    /// The serving leader's epoch.
    pub epoch: u64,
    /// The leader does not know this node's segments: send [`Remount`].
    pub need_remount: bool,
}

/// A put's id: random, nonzero, chosen by the client for each attempt of a put
/// (`0` means none). It travels in `put_start`, `put_end` and the commit event.
pub type PutId = u64;

/// Reserve space for new objects (batch).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutStart {
    /// One item per object.
    pub items: Vec<PutStartItem>,
}

/// One object to reserve space for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutStartItem {
    /// The key.
    pub key: String,
    /// Value size in bytes.
    pub size: u64,
    /// Replicas wanted, on distinct nodes.
    pub replicas: u32,
    /// Put the first replica on this segment if it has room.
    #[serde(default)]
    pub preferred_segment: Option<SegmentId>,
    /// Never evict this object.
    #[serde(default)]
    pub hard_pin: bool,
    /// The put's id ([`PutId`]), chosen by the client: a `put_start` sent again
    /// with the same id gets the same reservation back, and the `put_end` naming it
    /// is idempotent. 0: none (the put's commit cannot be asked after).
    #[serde(default)]
    pub put_id: PutId,
    /// Place no replica on these nodes (at most [`MAX_AVOIDED_NODES`]): a client
    /// just failed to write to them, so a put placed again goes to live nodes
    /// while the sub-master still counts them mounted (until its node timeout).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub avoid_nodes: Vec<NodeId>,
}

/// The reply to [`PutStart`]: per item, where to write the replicas.
pub type PutStartReply = Vec<ItemResult<Vec<ReplicaLocation>>>;

/// Commit written objects (batch).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutEnd {
    /// One item per object.
    pub items: Vec<PutEndItem>,
}

/// One object to commit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutEndItem {
    /// The key.
    pub key: String,
    /// xxh3-64 of the value as written.
    pub checksum: u64,
    /// The id its `put_start` carried. With one, `put_end` is idempotent: sent
    /// again after a timeout (to the same leader or the next), it answers `Ok` when
    /// that put is committed, and [`ItemError::NoPendingPut`] when it is not and
    /// never will be (its reservation is gone), so the client always learns which.
    #[serde(default)]
    pub put_id: PutId,
}

/// The reply to [`PutEnd`].
pub type PutEndReply = Vec<ItemResult<()>>;

/// Abandon pending puts (batch).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutRevoke {
    /// The keys.
    pub keys: Vec<String>,
}

/// The reply to [`PutRevoke`].
pub type PutRevokeReply = Vec<ItemResult<()>>;

/// Where complete objects are, with a read lease unless `lease` is false (batch).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GetReplicaList {
    /// The keys.
    pub keys: Vec<String>,
    /// Grant a read lease (a reader is about to read the replicas); false for a
    /// look that must not keep the objects from eviction or removal.
    #[serde(default = "lease_by_default")]
    pub lease: bool,
}

fn lease_by_default() -> bool {
    true
}

/// One object's replicas.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaList {
    /// Value size.
    pub size: u64,
    /// xxh3-64 of the value.
    pub checksum: u64,
    /// The replicas.
    pub replicas: Vec<ReplicaLocation>,
    /// How long the read lease lasts, from now (0: none was asked).
    pub lease_ms: u64,
}

/// The reply to [`GetReplicaList`].
pub type GetReplicaListReply = Vec<ItemResult<ReplicaList>>;

/// Which keys exist as complete objects (batch).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Exist {
    /// The keys.
    pub keys: Vec<String>,
}

/// The reply to [`Exist`]: one flag per key.
pub type ExistReply = Vec<bool>;

/// Several operations' batches in one request: what a real client sends for the
/// concurrent calls of the dummy clients behind it. The sub-master decides the
/// parts in the order exist, get_replica_list, put_start, put_end, put_commit,
/// each against the state before the request plus the parts decided earlier, and
/// answers once the commits are durable. The calls of one request are concurrent,
/// so any order is a valid one; this one needs no event applied between two parts.
///
/// A sub-master built before `put_commit` was a part ignores that field and
/// answers without it; a client reads such a missing part as
/// [`ItemError::NoLease`] for each of its items (that leader holds no lease, and
/// committed nothing).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mixed {
    /// Keys to check, as [`Exist`].
    #[serde(default)]
    pub exist: Vec<String>,
    /// Keys to locate, as [`GetReplicaList`].
    #[serde(default)]
    pub get_replica_list: Vec<String>,
    /// Objects to reserve space for, as [`PutStart`].
    #[serde(default)]
    pub put_start: Vec<PutStartItem>,
    /// Objects to commit, as [`PutEnd`].
    #[serde(default)]
    pub put_end: Vec<PutEndItem>,
    /// Objects written into space leases to commit, as [`PutCommit`] (left out of
    /// the encoding when empty).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub put_commit: Vec<PutCommitItem>,
}

impl Mixed {
    /// Items in all parts together.
    pub fn len(&self) -> usize {
        self.exist.len()
            + self.get_replica_list.len()
            + self.put_start.len()
            + self.put_end.len()
            + self.put_commit.len()
    }

    /// Whether no part has an item.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The reply to [`Mixed`]: each part's reply, items in request order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MixedReply {
    /// As [`ExistReply`].
    #[serde(default)]
    pub exist: ExistReply,
    /// As [`GetReplicaListReply`].
    #[serde(default)]
    pub get_replica_list: GetReplicaListReply,
    /// As [`PutStartReply`].
    #[serde(default)]
    pub put_start: PutStartReply,
    /// As [`PutEndReply`].
    #[serde(default)]
    pub put_end: PutEndReply,
    /// As [`PutCommitReply`] (left out of the encoding when empty).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub put_commit: PutCommitReply,
}

/// Remove objects (batch).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Remove {
    /// The keys.
    pub keys: Vec<String>,
    /// Remove even if leased.
    #[serde(default)]
    pub force: bool,
}

/// The reply to [`Remove`].
pub type RemoveReply = Vec<ItemResult<()>>;

/// Remove every object.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoveAll {
    /// Remove even leased objects.
    #[serde(default)]
    pub force: bool,
}

/// Remove every object whose key matches a pattern (its own operation, so a
/// sub-master that does not know it answers nothing rather than removing all).
/// The reply is a [`RemoveAllReply`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoveMatching {
    /// A regular expression (Rust `regex` syntax, searched anywhere in the key
    /// unless anchored), at most [`MAX_KEY_PATTERN_LEN`] bytes.
    pub pattern: String,
    /// Remove even leased objects.
    #[serde(default)]
    pub force: bool,
    /// Only the keys of this tenant ([`crate::tenant`]), the pattern matched
    /// against the key the tenant calls them by; `"default"`: only keys of no
    /// other tenant. None: every key, as written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

/// Longest pattern of a [`RemoveMatching`].
pub const MAX_KEY_PATTERN_LEN: usize = 4096;

/// The reply to [`RemoveAll`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoveAllReply {
    /// How many objects were removed.
    pub removed: u64,
}

/// Ask for the sub-master's state summary.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    /// Also list every mounted segment ([`StatusReply::segment_list`]); a
    /// sub-master from before this field ignores it and lists none.
    #[serde(default)]
    pub segments: bool,
}

/// One mounted segment, as [`StatusReply::segment_list`] lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentStatus {
    /// Its name.
    pub id: SegmentId,
    /// The node that mounted it.
    pub node: NodeId,
    /// The node's transfer endpoint.
    pub endpoint: String,
    /// Whether peers may reach it over RDMA.
    pub rdma: bool,
    /// Bytes mounted.
    pub capacity_bytes: u64,
    /// Bytes allocated (complete and pending replicas).
    pub used_bytes: u64,
}

/// A sub-master's state summary.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusReply {
    /// The serving instance.
    pub producer: String,
    /// Its leadership epoch.
    pub epoch: u64,
    /// Last applied stream sequence.
    pub applied_seq: u64,
    /// Complete objects.
    pub objects: u64,
    /// Pending puts.
    pub pending_puts: u64,
    /// Space leases held by clients.
    #[serde(default)]
    pub space_leases: u64,
    /// Mounted segments.
    pub segments: u64,
    /// Live nodes.
    pub nodes: u64,
    /// Bytes allocated (complete + pending, all replicas).
    pub used_bytes: u64,
    /// Bytes mounted.
    pub capacity_bytes: u64,
    /// Every mounted segment, when [`Status::segments`] asked for them.
    #[serde(default)]
    pub segment_list: Vec<SegmentStatus>,
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::rpc::{decode, encode};

    /// [`Mixed`] as sub-masters built before its `put_commit` part read it.
    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct MixedBeforeCommits {
        exist: Vec<String>,
        get_replica_list: Vec<String>,
        put_start: Vec<PutStartItem>,
        put_end: Vec<PutEndItem>,
    }

    /// [`MixedReply`] as those sub-masters write it.
    #[derive(Debug, Serialize, Deserialize)]
    struct MixedReplyBeforeCommits {
        exist: ExistReply,
        get_replica_list: GetReplicaListReply,
        put_start: PutStartReply,
        put_end: PutEndReply,
    }

    fn commit(key: &str) -> PutCommitItem {
        PutCommitItem {
            key: key.into(),
            size: 64,
            checksum: 9,
            lease: 7,
            offset: 0,
            hard_pin: false,
            put_id: 3,
        }
    }

    #[test]
    fn a_mixed_request_without_commits_encodes_as_before_the_part_existed() {
        let mixed = Mixed {
            exist: vec!["a".into()],
            put_end: vec![PutEndItem {
                key: "b".into(),
                checksum: 1,
                put_id: 2,
            }],
            ..Mixed::default()
        };
        let before = MixedBeforeCommits {
            exist: mixed.exist.clone(),
            get_replica_list: vec![],
            put_start: vec![],
            put_end: mixed.put_end.clone(),
        };
        assert_eq!(encode(&mixed).unwrap(), encode(&before).unwrap());
    }

    #[test]
    fn an_older_reader_skips_the_commit_part_and_a_newer_one_reads_its_absence_as_empty() {
        let mixed = Mixed {
            exist: vec!["a".into()],
            put_commit: vec![commit("c")],
            ..Mixed::default()
        };
        let old: MixedBeforeCommits = decode(&encode(&mixed).unwrap()).unwrap();
        assert_eq!(old.exist, vec!["a".to_owned()]);
        let old_reply = MixedReplyBeforeCommits {
            exist: vec![true],
            get_replica_list: vec![],
            put_start: vec![],
            put_end: vec![],
        };
        let reply: MixedReply = decode(&encode(&old_reply).unwrap()).unwrap();
        assert_eq!(reply.exist, vec![true]);
        assert!(reply.put_commit.is_empty());
        assert_eq!(decode::<Mixed>(&encode(&mixed).unwrap()).unwrap(), mixed);
    }

    /// [`Status`] as sub-masters and clients built before its `segments` field
    /// wrote and read it.
    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct StatusBeforeSegments {}

    #[test]
    fn a_status_request_from_before_segment_lists_asks_for_none_and_an_old_reply_has_none() {
        let old = encode(&StatusBeforeSegments {}).unwrap();
        assert_eq!(decode::<Status>(&old).unwrap(), Status { segments: false });
        let asked = encode(&Status { segments: true }).unwrap();
        assert_eq!(
            decode::<StatusBeforeSegments>(&asked).unwrap(),
            StatusBeforeSegments {}
        );
        #[derive(Serialize)]
        struct ReplyBeforeSegments {
            producer: String,
            epoch: u64,
            applied_seq: u64,
            objects: u64,
            pending_puts: u64,
            space_leases: u64,
            segments: u64,
            nodes: u64,
            used_bytes: u64,
            capacity_bytes: u64,
        }
        let reply: StatusReply = decode(
            &encode(&ReplyBeforeSegments {
                producer: "p".into(),
                epoch: 1,
                applied_seq: 2,
                objects: 3,
                pending_puts: 0,
                space_leases: 0,
                segments: 1,
                nodes: 1,
                used_bytes: 4,
                capacity_bytes: 8,
            })
            .unwrap(),
        )
        .unwrap();
        assert_eq!((reply.segments, reply.segment_list.len()), (1, 0));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic_a_mixed_decoder(
            bytes in proptest::collection::vec(any::<u8>(), 0..256),
        ) {
            let _ = decode::<Mixed>(&bytes);
            let _ = decode::<MixedReply>(&bytes);
            let _ = decode::<Status>(&bytes);
            let _ = decode::<StatusReply>(&bytes);
        }
    }
}
