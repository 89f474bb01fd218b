//! KVEvent formats: the versioned message envelope, event kinds, key operations,
//! RPC messages, snapshot and checkpoint formats, ids, validation limits, and every
//! subject and stream name. Formats only: no async runtime and no NATS client, so a
//! decoder links neither; the JetStream I/O that reads and writes them is
//! `hkvm-log`.

pub mod checkpoint;
pub mod codec;
pub mod error;
pub mod event;
pub mod grant;
pub mod id;
pub mod key_ops;
pub mod lease;
pub mod limits;
mod msgpack;
pub mod positions;
pub mod registry;
pub mod rpc;
pub mod snapshot;
pub mod subject;
pub mod tenant;
pub mod transport;

pub use codec::{decode_message, encode_message, DecodedMessage, Header, MessageBuilder};
pub use error::{DecodeError, EncodeError, EventError, EventErrorKind};
pub use event::{
    key_hash, value_checksum, value_checksum_parts, EventKind, Evicted, KvEvent, NodeLost,
    Placement, PutCommitted, PutFlags, Removed, SegmentMounted, SegmentUnmounted, SnapshotTaken,
};
pub use id::{ClusterId, IdError, NodeId, ProducerId, SegmentId, SubclusterId};
pub use limits::{Limits, ValidationError};
pub use transport::RdmaEndpoint;
