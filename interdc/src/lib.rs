//! The inter-DC master: the third level of HKVM. It follows two pools' event
//! streams (a prefill pool and a prefill/decode pool in another datacenter, say)
//! into one projector index, keeps the diff as roaring set algebra, and copies
//! every block the source has and the target lacks over a paced, FEC-protected WAN
//! link, newest first, within a bandwidth cap and a policy (key filters, labels of
//! the sub-masters allowed on each side, blocks about to be evicted at the source
//! or evicted on purpose at the target are skipped).
//!
//! A copy reads the block from a source node through a [`Gateway`] in the source
//! datacenter, sends it over UDP with Reed–Solomon stripes, verifies its checksum
//! at the target and writes it through the target's sub-master (put_start → write
//! → put_end), so the target's own events record it. What was copied is kept in a
//! JetStream KV bucket of the target, so a restarted master resumes without
//! sending a finished block again.
//!
//! [`diff::Diff`] is the pure core (no I/O, no clock); [`InterDc`] runs it.

pub mod address;
mod clients;
pub mod copier;
pub mod diff;
mod error;
mod follow;
mod master;
pub mod metrics;
pub mod policy;
pub mod progress;
mod shared;
pub mod status;
pub mod wan;

pub use address::ClusterAddress;
pub use error::{InterDcError, InterDcErrorKind};
pub use master::{read_status, serve, InterDc, InterDcConfig};
pub use policy::Policy;
pub use status::InterDcStatus;
pub use wan::{Gateway, GatewayConfig};
