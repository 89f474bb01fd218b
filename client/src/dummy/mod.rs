//! Real clients and dummy clients: one process per host (the real client, `hkvm
//! node`) owns the node's memory and talks to the masters for every inference
//! process on the host (its dummy clients), which reach it over an abstract Unix
//! domain socket and share a memory region with it, so values move between a
//! dummy's buffers and the pool without a copy through the socket. The protocol's
//! frames are in `hkvm_events::rpc::dummy`.

mod access;
mod client;
mod fd;
mod region;
mod server;

pub use access::{parse_uids, PeerAccess, TRUSTED_SERVER_UIDS_ENV};
pub use client::{DummyClient, DummyError};
pub use region::{RangeAllocator, SharedRegion};
pub use server::{DummyServer, DummyServerConfig, DummyServerStats};
