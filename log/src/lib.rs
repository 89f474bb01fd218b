//! The JetStream I/O of HKVM's formats (`hkvm-events`): the [`EventLog`] trait with
//! its in-memory twin and its JetStream implementation, group commit, stream
//! followers, stream settings, connection epochs, reader positions, the sub-master
//! registry, the data-port grant keys, pacing, and the snapshot store; and the Mooncake master's HTTP routes,
//! answered by asking sub-masters over NATS ([`mooncake_admin`]). Every byte it
//! reads or writes is encoded and decoded by `hkvm-events`.

pub mod buckets;
pub mod commit;
pub mod connection;
pub mod event_log;
pub mod follow;
pub mod grants;
pub mod mooncake_admin;
pub mod objects;
pub mod pace;
pub mod permissions;
pub mod positions;
pub mod registry;
pub mod snapshot_store;
pub mod stream;

pub use event_log::{
    Append, AppendAck, EntryStream, EventLog, JetStreamLog, LogBounds, LogEntry, LogError,
    LogErrorKind, MemoryLog, ReadOptions, StreamStats,
};
pub use snapshot_store::SnapshotStore;
