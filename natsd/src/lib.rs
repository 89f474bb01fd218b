//! The one way HKVM starts `nats-server`: find the binary ([`find_nats_server`]),
//! write its config into a temp dir that also holds its JetStream store and log,
//! spawn it there, and wait until its monitoring endpoint's `/healthz` answers 200
//! (JetStream up, and in a cluster current with the meta leader). The child is
//! killed when its [`NatsServer`] is dropped and, on Linux, when the process that
//! started it dies. `hkvm local` runs its server through here, and so does the test
//! kit for tests and benchmarks.

mod binary;
mod error;
mod health;
mod options;
mod server;

pub use binary::{find_nats_server, ToolsDir, NATS_SERVER_ENV};
pub use error::NatsdError;
pub use options::{ClientPort, Durability, Routes, ServerOptions};
pub use server::{free_port, port_is_free, NatsServer};
