//! The client library used by inference processes: metadata RPCs to sub-masters and
//! the global master, and the checksummed data path to nodes.

pub mod connect;
pub mod error;
pub mod kv;
pub mod node;
pub mod submaster;

pub use connect::{connect, ConnectError};
pub use error::{ClientError, ClientErrorKind};
pub use kv::{Fetched, KvClient, KvError, PendingPut};
pub use node::{NodeConfig, NodeError, NodeHandle};
pub use submaster::{ClientConfig, ClientStats, SubmasterClient, MAX_BATCH};
