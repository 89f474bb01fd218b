//! The KVEvent kinds: every state change of a sub-master. Each kind has a stable
//! numeric code on the wire; its body is a MessagePack map with short field names,
//! so readers skip fields they do not know and new optional fields default.

use serde::{Deserialize, Serialize};

use crate::id::{NodeId, SegmentId};
use crate::transport::RdmaEndpoint;

/// xxh3-64 of a key: the hash every index uses.
pub fn key_hash(key: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(key.as_bytes())
}

/// xxh3-64 of a value's bytes: the end-to-end checksum of a KV block.
pub fn value_checksum(value: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(value)
}

/// [`value_checksum`] of the concatenation of `parts` (a value scattered over
/// several buffers), without concatenating them.
pub fn value_checksum_parts<P: AsRef<[u8]>>(parts: &[P]) -> u64 {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    for part in parts {
        hasher.update(part.as_ref());
    }
    hasher.digest()
}

/// A node mounted a memory segment with the sub-master.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentMounted {
    /// The node that owns the segment.
    #[serde(rename = "n")]
    pub node: NodeId,
    /// The segment's name.
    #[serde(rename = "g")]
    pub segment: SegmentId,
    /// Its size in bytes.
    #[serde(rename = "s")]
    pub size: u64,
    /// Where the node serves transfers (`host:port`).
    #[serde(rename = "e")]
    pub endpoint: String,
    /// How peers reach the segment over RDMA (none: TCP only).
    #[serde(rename = "r", default, skip_serializing_if = "Option::is_none")]
    pub rdma: Option<RdmaEndpoint>,
}

/// A segment was unmounted; every replica on it is gone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentUnmounted {
    /// The node that owned the segment.
    #[serde(rename = "n")]
    pub node: NodeId,
    /// The segment's name.
    #[serde(rename = "g")]
    pub segment: SegmentId,
}

/// A node stopped pinging past its timeout: its segments and their replicas are gone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeLost {
    /// The lost node.
    #[serde(rename = "n")]
    pub node: NodeId,
}

/// Where one replica of an object lives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// The segment holding the replica.
    #[serde(rename = "g")]
    pub segment: SegmentId,
    /// The byte offset of the replica inside the segment.
    #[serde(rename = "o")]
    pub offset: u64,
}

/// Flag bits of a committed put.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PutFlags(pub u32);

impl PutFlags {
    /// Never evicted (may still be removed explicitly).
    pub const HARD_PIN: u32 = 1;

    /// Whether the object is hard-pinned.
    pub fn hard_pinned(self) -> bool {
        self.0 & Self::HARD_PIN != 0
    }
}

/// A put was committed (`put_end`): the object is complete and readable.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutCommitted {
    /// The key.
    #[serde(rename = "k")]
    pub key: String,
    /// xxh3-64 of the key (checked against the key when decoded).
    #[serde(rename = "h")]
    pub key_hash: u64,
    /// The value's size in bytes.
    #[serde(rename = "s")]
    pub size: u64,
    /// xxh3-64 of the value.
    #[serde(rename = "c")]
    pub checksum: u64,
    /// One placement per replica, on distinct nodes.
    #[serde(rename = "p")]
    pub placements: Vec<Placement>,
    /// Flag bits (see [`PutFlags`]).
    #[serde(rename = "f", default)]
    pub flags: PutFlags,
    /// The id of the put this commits (see `rpc::submaster::PutId`; 0: none), so
    /// that a `put_end` sent again can tell its own commit from another put's.
    #[serde(rename = "i", default, skip_serializing_if = "is_zero")]
    pub put_id: u64,
}

fn is_zero(value: &u64) -> bool {
    *value == 0
}

/// Objects evicted by the sub-master to free space (one event per eviction round).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Evicted {
    /// The evicted keys.
    #[serde(rename = "k")]
    pub keys: Vec<String>,
}

/// Objects removed on request (`remove`, `batch_remove`, `remove_all`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Removed {
    /// The removed keys.
    #[serde(rename = "k")]
    pub keys: Vec<String>,
}

/// A snapshot of the state up to and including `covers_seq` was written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotTaken {
    /// The last stream sequence the snapshot includes.
    #[serde(rename = "q")]
    pub covers_seq: u64,
    /// Where it is stored (object name).
    #[serde(rename = "o")]
    pub object: String,
    /// xxh3-64 of the snapshot bytes.
    #[serde(rename = "c")]
    pub checksum: u64,
}

/// The numeric kind code that precedes every event body on the wire. Codes are never
/// reused; new kinds get new codes and old readers report them as unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u16)]
pub enum EventKind {
    /// [`SegmentMounted`].
    SegmentMounted = 1,
    /// [`SegmentUnmounted`].
    SegmentUnmounted = 2,
    /// [`NodeLost`].
    NodeLost = 3,
    /// [`PutCommitted`].
    PutCommitted = 4,
    /// [`Evicted`].
    Evicted = 5,
    /// [`Removed`].
    Removed = 6,
    /// [`SnapshotTaken`].
    Snapshot = 7,
}

impl EventKind {
    /// Every kind this build knows.
    pub const ALL: [EventKind; 7] = [
        Self::SegmentMounted,
        Self::SegmentUnmounted,
        Self::NodeLost,
        Self::PutCommitted,
        Self::Evicted,
        Self::Removed,
        Self::Snapshot,
    ];

    /// The wire code.
    pub fn code(self) -> u16 {
        self as u16
    }

    /// The kind for a wire code, if this build knows it.
    pub fn from_code(code: u16) -> Option<Self> {
        Self::ALL.into_iter().find(|kind| kind.code() == code)
    }

    /// The name used in logs, `hkvm replay --kind` and JSON output.
    pub fn name(self) -> &'static str {
        match self {
            Self::SegmentMounted => "segment_mounted",
            Self::SegmentUnmounted => "segment_unmounted",
            Self::NodeLost => "node_lost",
            Self::PutCommitted => "put",
            Self::Evicted => "evicted",
            Self::Removed => "removed",
            Self::Snapshot => "snapshot",
        }
    }

    /// The kind with this [`EventKind::name`].
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|kind| kind.name() == name)
    }
}

impl std::fmt::Display for EventKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One state change of a sub-master.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// See [`SegmentMounted`].
    SegmentMounted(SegmentMounted),
    /// See [`SegmentUnmounted`].
    SegmentUnmounted(SegmentUnmounted),
    /// See [`NodeLost`].
    NodeLost(NodeLost),
    /// See [`PutCommitted`].
    PutCommitted(PutCommitted),
    /// See [`Evicted`].
    Evicted(Evicted),
    /// See [`Removed`].
    Removed(Removed),
    /// See [`SnapshotTaken`].
    Snapshot(SnapshotTaken),
}

impl KvEvent {
    /// The event's kind.
    pub fn kind(&self) -> EventKind {
        match self {
            Self::SegmentMounted(_) => EventKind::SegmentMounted,
            Self::SegmentUnmounted(_) => EventKind::SegmentUnmounted,
            Self::NodeLost(_) => EventKind::NodeLost,
            Self::PutCommitted(_) => EventKind::PutCommitted,
            Self::Evicted(_) => EventKind::Evicted,
            Self::Removed(_) => EventKind::Removed,
            Self::Snapshot(_) => EventKind::Snapshot,
        }
    }

    /// Whether the event concerns `key` (for filtering replays).
    pub fn mentions_key(&self, key: &str) -> bool {
        match self {
            Self::PutCommitted(put) => put.key == key,
            Self::Evicted(Evicted { keys }) | Self::Removed(Removed { keys }) => {
                keys.iter().any(|k| k == key)
            }
            _ => false,
        }
    }
}

impl PutCommitted {
    /// A put event for `key`, computing the key hash.
    pub fn new(
        key: impl Into<String>,
        size: u64,
        checksum: u64,
        placements: Vec<Placement>,
    ) -> Self {
        let key = key.into();
        Self {
            key_hash: key_hash(&key),
            key,
            size,
            checksum,
            placements,
            flags: PutFlags::default(),
            put_id: 0,
        }
    }
}

#[cfg(test)]
mod checksum_tests {
    use super::*;

    #[test]
    fn a_scattered_value_has_the_checksum_of_the_whole() {
        let whole: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        let (a, rest) = whole.split_at(3);
        let (b, c) = rest.split_at(4000);
        assert_eq!(value_checksum_parts(&[a, b, c]), value_checksum(&whole));
        assert_eq!(value_checksum_parts::<&[u8]>(&[]), value_checksum(&[]));
    }
}
