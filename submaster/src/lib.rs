//! The sub-master: the authoritative, strongly consistent metadata master of one
//! sub-cluster, whose state is a fold over its own JetStream event stream.
//!
//! - [`state`]: the state and the pure `apply` fold;
//! - [`command`]: validating requests and deciding their events;
//! - [`allocator`], [`placement`]: where replicas go;
//! - [`liveness`]: node pings, answered outside the request loop;
//! - the driver modules do the I/O: serving RPCs, appending through group commit,
//!   snapshots, the leader lease and the hot standby.

pub mod allocator;
pub mod command;
pub mod config;
pub mod election;
pub mod error;
pub mod keyhash;
pub mod liveness;
pub mod metrics;
pub mod placement;
pub mod server;
pub mod snapshot;
pub mod state;

pub use config::{DirectConfig, DirectListen, HistoryConfig, SnapshotPace, SubmasterConfig};
pub use error::{SubmasterError, SubmasterErrorKind};
pub use server::{run, SubmasterHandle};
