//! Test helpers that run real NATS: a `nats-server` child process with JetStream on
//! ephemeral ports and a temp store dir, and a 3-node JetStream cluster whose nodes
//! can be killed and restarted. Every test that needs NATS starts it through here;
//! no test assumes a server is already running. Children are killed on drop and
//! (on Linux) when the test process itself dies. The single servers and the
//! cluster's nodes are `hkvm-natsd` launches, the same `hkvm local` runs.

mod cluster;
mod error;

pub use cluster::NatsCluster;
pub use error::TestkitError;
pub use hkvm_natsd::{
    find_nats_server, Durability, NatsServer, ServerOptions, ToolsDir, NATS_SERVER_ENV,
};
