//! The client library used by inference processes: metadata RPCs to sub-masters and
//! the global master, and the checksummed data path to nodes.

pub mod error;
pub mod submaster;

pub use error::{ClientError, ClientErrorKind};
pub use submaster::{ClientConfig, ClientStats, SubmasterClient, MAX_BATCH};
