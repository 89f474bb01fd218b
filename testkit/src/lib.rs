//! Test helpers that run real NATS: a `nats-server` child process with JetStream on
//! ephemeral ports and a temp store dir, and a 3-node JetStream cluster whose nodes
//! can be killed and restarted. Every test that needs NATS starts it through here;
//! no test assumes a server is already running. Children are killed on drop and
//! (on Linux) when the test process itself dies.

mod binary;
mod cluster;
mod error;
mod health;
mod server;

pub use binary::{find_nats_server, NATS_SERVER_ENV};
pub use cluster::NatsCluster;
pub use error::TestkitError;
pub use server::{NatsServer, ServerOptions};
