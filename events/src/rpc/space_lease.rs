//! Space leases: one RPC per put for a client that places objects itself. A
//! client leases a range of the same length on as many segments (distinct nodes)
//! as it wants replicas ([`LeaseSpace`] → [`SpaceLease`]), carves objects out of
//! it locally, writes their replicas, and commits each with [`PutCommit`]: one
//! round trip and one durable append, where `put_start` + `put_end` take two
//! round trips. A lease is as ephemeral as a `put_start` reservation: it lives in
//! the leader's memory only, ends when returned ([`LeaseReturn`]) or when its
//! time is up, and is gone after a leader change, when a commit into it answers
//! [`ItemError::NoLease`](super::submaster::ItemError::NoLease) and the client
//! puts through `put_start` / `put_end` instead. Whatever a lease holds that no
//! commit took goes back to the free space when it ends.

use serde::{Deserialize, Serialize};

use super::submaster::{ItemResult, PutId, ReplicaLocation};
use crate::id::{NodeId, SegmentId};

/// A lease's id: random, so ids of one leader never name leases of the next.
pub type LeaseId = u64;

/// Sub-masters allocate in multiples of this many bytes: an object committed
/// into a lease sits at a multiple of it and takes its size rounded up to one.
pub const ALIGNMENT: u64 = 64;

/// Lease `len` bytes on `replicas` segments of distinct nodes. The sub-master
/// may grant fewer ([`SpaceLease::len`]): a lease takes at most a small share
/// of the smallest segment mounted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseSpace {
    /// Bytes leased on each segment.
    pub len: u64,
    /// How many segments (one per replica an object committed into it gets).
    pub replicas: u32,
    /// Take the first range from this segment if it has room.
    #[serde(default)]
    pub preferred_segment: Option<SegmentId>,
    /// Take no range on these nodes (see
    /// [`PutStartItem::avoid_nodes`](super::submaster::PutStartItem::avoid_nodes)).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub avoid_nodes: Vec<NodeId>,
}

/// A granted lease: `len` bytes at each location's offset; an object committed at
/// lease offset `o` has its replicas at `location.offset + o`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpaceLease {
    /// The lease's id.
    pub id: LeaseId,
    /// Bytes leased on each segment (at most what was asked).
    pub len: u64,
    /// Where each range starts, one per replica, on distinct nodes.
    pub ranges: Vec<ReplicaLocation>,
    /// How long the lease lasts, from when the leader granted it. A client stops
    /// carving from it well before, since a commit after the end is refused.
    pub ttl_ms: u64,
}

/// The reply to [`LeaseSpace`]: the lease, or
/// [`ItemError::NoSpace`](super::submaster::ItemError::NoSpace) when not enough
/// nodes have the room.
pub type LeaseSpaceReply = ItemResult<SpaceLease>;

/// Commit objects written into leased space (batch).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutCommit {
    /// One item per object.
    pub items: Vec<PutCommitItem>,
}

/// One object written into a lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutCommitItem {
    /// The key.
    pub key: String,
    /// Value size in bytes.
    pub size: u64,
    /// xxh3-64 of the value as written.
    pub checksum: u64,
    /// The lease it was written into.
    pub lease: LeaseId,
    /// Its offset inside the lease (the same in every range).
    pub offset: u64,
    /// Never evict this object.
    #[serde(default)]
    pub hard_pin: bool,
    /// The put's id ([`PutId`]): a commit sent again with the same id answers
    /// `Ok` once that put is committed (0: none; sent again, it answers
    /// `AlreadyExists`).
    pub put_id: PutId,
}

/// The reply to [`PutCommit`].
pub type PutCommitReply = Vec<ItemResult<()>>;

/// End a lease now: what no commit took goes back to the free space.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseReturn {
    /// The lease.
    pub lease: LeaseId,
}
