//! KVEvent wire types and the event log: the versioned message envelope, event kinds,
//! validation limits, every subject and stream name, stream settings, the
//! [`log::EventLog`] trait (in-memory and JetStream) and group commit.

pub mod checkpoint;
pub mod codec;
pub mod commit;
pub mod connection;
pub mod error;
pub mod event;
pub mod follow;
pub mod id;
pub mod key_ops;
pub mod limits;
pub mod log;
mod msgpack;
pub mod objects;
pub mod pace;
pub mod positions;
pub mod registry;
pub mod rpc;
pub mod snapshot;
pub mod stream;
pub mod subject;
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
