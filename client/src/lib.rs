//! The client library used by inference processes, tools and the masters
//! themselves: metadata RPCs to sub-masters and the global master (all through one
//! retry policy), and the checksummed data path to nodes. It depends on no server
//! crate: every request and reply is a wire type of `hkvm-events`.

pub mod coalesce;
pub mod connect;
pub mod direct;
pub mod dummy;
pub mod error;
pub mod global;
pub mod grants;
pub mod kv;
pub mod leader_watch;
pub mod local_record;
pub mod node;
pub mod retry;
pub mod spin;
pub mod store;
pub mod submaster;
pub mod transports;

pub use connect::{connect, ConnectError};
pub use error::{ClientError, ClientErrorKind, RetryCause};
pub use global::GlobalClient;
pub use kv::{
    Fetched, KvClient, KvError, KvErrorKind, Located, PendingPut, PutOptions, DEFAULT_LEASE_LEN,
};
pub use leader_watch::LeaderWatch;
pub use node::{NodeConfig, NodeError, NodeHandle};
pub use retry::{ClientStats, Presence, Resend, RetryPolicy, RpcCaller};
pub use submaster::SubmasterClient;
pub use transports::{Protocol, RdmaSettings, Route, Transports};
