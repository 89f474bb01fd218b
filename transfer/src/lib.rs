//! KV data movement between nodes: a TCP backend that is always available and an
//! RDMA verbs backend (through `rdma-sys`) behind the `rdma` cargo feature, both
//! behind the [`Transport`] trait; plus the WAN mode of inter-datacenter copies
//! (Reed–Solomon FEC and pacing) in [`wan`].
//!
//! A node allocates a [`Segment`], registers it with a transport and serves it; a
//! client writes and reads ranges of a peer's segments in batches by endpoint,
//! region id, offset and the grant that allows it; the serving side puts every
//! operation to its [`Admission`] first.

pub mod admission;
pub mod error;
pub mod frame;
pub mod local;
pub mod rdma;
pub mod region;
pub mod tcp;
pub mod transport;
pub mod wan;

pub use admission::{Admission, AdmitAll, Asked};
pub use error::{ErrorKind, TransferError};
pub use local::LocalTransport;
pub use rdma::exchange::RemoteRegion;
pub use region::{RegionId, RegionTable, Segment};
pub use tcp::{ServerHandle, TcpConfig, TcpTransport};
pub use transport::{ReadInto, ReadOp, Transport, WriteOp};
