//! The data path: `put` = parallel writes into the client's space lease →
//! put_commit with the value's xxh3-64, or, without a usable lease, put_start →
//! parallel writes to every placement → put_end (revoke on failure); `get` = get_replica_list → read the
//! nearest replica → verify the checksum, trying the next replica on a mismatch or a
//! vanished node, and failing with a typed integrity error rather than ever
//! returning wrong bytes. A key that is not in the local sub-cluster is looked up
//! through the global master, which forwards to the owning sub-master.

use std::sync::Arc;

use bytes::Bytes;
use hkvm_events::grant::GRANT_WIRE_LEN;
use hkvm_events::rpc::submaster::{ItemError, ReplicaList, ReplicaLocation};
use hkvm_events::{SegmentId, SubclusterId};
use hkvm_transfer::{TransferError, Transport};

use crate::transports::Transports;

use crate::error::{ClientError, ClientErrorKind};
use crate::submaster::SubmasterClient;

mod read;
mod space;
mod unreachable;
mod write;

pub use space::DEFAULT_LEASE_LEN;
pub use write::PendingPut;

/// Why a put or get failed.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    /// The metadata call failed.
    #[error(transparent)]
    Metadata(#[from] ClientError),
    /// The sub-master refused this item.
    #[error("{key}: {error}")]
    Item {
        /// The key.
        key: String,
        /// The sub-master's reason.
        error: ItemError,
    },
    /// Writing a replica failed (the put was revoked).
    #[error("{key}: writing a replica failed")]
    Write {
        /// The key.
        key: String,
        /// The transfer error.
        #[source]
        source: TransferError,
    },
    /// The value handed to [`KvClient::complete`] has another size than the
    /// reservation (the put was revoked).
    #[error("{key}: value of {len} bytes for a reservation of {reserved} bytes")]
    SizeMismatch {
        /// The key.
        key: String,
        /// The value's length.
        len: u64,
        /// The reserved size.
        reserved: u64,
    },
    /// The caller's buffers cannot hold the value.
    #[error("{key}: value of {size} bytes does not fit buffers of {capacity} bytes")]
    BufferTooSmall {
        /// The key.
        key: String,
        /// The value's size.
        size: u64,
        /// The buffers' total length.
        capacity: u64,
    },
    /// No replica returned bytes matching the recorded checksum.
    #[error("{key}: no intact replica ({tried} tried): {last}")]
    Integrity {
        /// The key.
        key: String,
        /// Replicas tried.
        tried: usize,
        /// What went wrong with the last one.
        last: String,
    },
    /// The key exists nowhere in the cluster.
    #[error("{key}: not found")]
    NotFound {
        /// The key.
        key: String,
    },
    /// The key is not in this sub-cluster, and the global master could not say
    /// whether another one holds it (down, busy or slow): not a "not found".
    #[error("{key}: not in this sub-cluster, and the global master could not say where else")]
    Unresolved {
        /// The key.
        key: String,
        /// Why the global master did not answer.
        #[source]
        source: std::sync::Arc<ClientError>,
    },
}

/// The kind of a [`KvError`], for matching.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvErrorKind {
    /// A metadata call failed; the inner kind says how.
    Metadata(ClientErrorKind),
    /// The sub-master refused the item.
    Item,
    /// A replica write failed.
    Write,
    /// The value does not fit its reservation.
    SizeMismatch,
    /// The caller's buffers are too small.
    BufferTooSmall,
    /// No replica held intact bytes.
    Integrity,
    /// The key is not local and the global master did not answer.
    Unresolved,
    /// The key exists nowhere the client can see.
    NotFound,
}

impl KvError {
    /// The kind.
    pub fn kind(&self) -> KvErrorKind {
        match self {
            Self::Metadata(error) => KvErrorKind::Metadata(error.kind()),
            Self::Item { .. } => KvErrorKind::Item,
            Self::Write { .. } => KvErrorKind::Write,
            Self::SizeMismatch { .. } => KvErrorKind::SizeMismatch,
            Self::BufferTooSmall { .. } => KvErrorKind::BufferTooSmall,
            Self::Integrity { .. } => KvErrorKind::Integrity,
            Self::NotFound { .. } => KvErrorKind::NotFound,
            Self::Unresolved { .. } => KvErrorKind::Unresolved,
        }
    }
}

/// A location's grant in the form a data-port request carries (empty when the
/// location has none: its node then refuses the operation).
pub(crate) struct WireGrant(Option<[u8; GRANT_WIRE_LEN]>);

impl WireGrant {
    /// The grant of `replica`.
    pub(crate) fn of(replica: &ReplicaLocation) -> Self {
        Self(replica.grant.map(|grant| grant.to_wire()))
    }

    /// Its bytes.
    pub(crate) fn as_slice(&self) -> &[u8] {
        self.0.as_ref().map_or(&[], |wire| wire.as_slice())
    }
}

/// Where a value was read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fetched {
    /// The value (verified against its checksum).
    pub value: Bytes,
    /// The sub-cluster that holds it.
    pub subcluster: SubclusterId,
    /// The replica it came from.
    pub replica: ReplicaLocation,
}

/// A KV client of one sub-cluster (with cluster-wide reads through the global
/// master). Cheap to clone.
#[derive(Clone)]
pub struct KvClient {
    metadata: SubmasterClient,
    transports: Arc<Transports>,
    /// This process's own node endpoint, read first when it holds a replica.
    local_endpoint: Option<String>,
    /// Space leases its puts place objects in (none: every put goes through
    /// `put_start` / `put_end`).
    space: Option<Arc<space::SpacePool>>,
    /// Nodes its writes failed to reach lately, which its placements avoid.
    unreachable: Arc<unreachable::UnreachableNodes>,
}

impl std::fmt::Debug for KvClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvClient")
            .field("subcluster", self.metadata.subcluster())
            .field("transports", &self.transports)
            .finish()
    }
}

impl KvClient {
    /// A client over `metadata` moving every replica's bytes with `transport`.
    pub fn new(metadata: SubmasterClient, transport: Arc<dyn Transport>) -> Self {
        Self::with_transports(metadata, Transports::single(transport))
    }

    /// A client over `metadata` choosing per replica among `transports`. Puts use
    /// space leases of [`DEFAULT_LEASE_LEN`] bytes: one `put_commit` per put
    /// instead of `put_start` and `put_end` (coalesced with other calls when
    /// `metadata` coalesces, as a real client serving dummies does).
    pub fn with_transports(metadata: SubmasterClient, transports: Transports) -> Self {
        let unreachable = Arc::default();
        let space = Some(Arc::new(space::SpacePool::new(
            metadata.clone(),
            DEFAULT_LEASE_LEN,
            Arc::clone(&unreachable),
        )));
        Self {
            metadata,
            transports: Arc::new(transports),
            local_endpoint: None,
            space,
            unreachable,
        }
    }

    /// This client with space leases of `len` bytes per segment, or none
    /// (`None`: every put reserves with `put_start`).
    pub fn with_space_leases(mut self, len: Option<u64>) -> Self {
        self.space = len.map(|len| {
            Arc::new(space::SpacePool::new(
                self.metadata.clone(),
                len,
                Arc::clone(&self.unreachable),
            ))
        });
        self
    }

    /// Its transports.
    pub fn transports(&self) -> &Transports {
        &self.transports
    }

    /// Prefer replicas on this endpoint (the caller's own node) when reading.
    pub fn with_local_endpoint(mut self, endpoint: impl Into<String>) -> Self {
        self.local_endpoint = Some(endpoint.into());
        self
    }

    /// The metadata client.
    pub fn metadata(&self) -> &SubmasterClient {
        &self.metadata
    }
}

/// A value's place: the sub-cluster that holds it and its replicas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Located {
    /// The sub-cluster.
    pub subcluster: SubclusterId,
    /// Size, checksum and replicas.
    pub list: ReplicaList,
}

/// How a put is placed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutOptions {
    /// Replicas, on distinct nodes.
    pub replicas: u32,
    /// Put the first replica on this segment when it has room.
    pub preferred_segment: Option<SegmentId>,
    /// Never evict the object (it can still be removed).
    pub hard_pin: bool,
}

impl Default for PutOptions {
    fn default() -> Self {
        Self::replicas(1)
    }
}

impl PutOptions {
    /// `replicas` copies, no preference, no pin.
    pub fn replicas(replicas: u32) -> Self {
        Self {
            replicas,
            preferred_segment: None,
            hard_pin: false,
        }
    }
}
