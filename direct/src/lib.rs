//! Direct requests: the same request and reply bodies as over NATS
//! request/reply, on one TCP connection from a client to a server, many in
//! flight at once, framed as `hkvm_events::rpc::direct` says. [`link`] is the
//! client's connection; [`server`] is what every direct front (a sub-master
//! leader's, a global-master replica's) shares: accepting, the hello, reading
//! requests with a bound on those in flight; the `sender` module is how both ends write:
//! by the sender itself, straight into the socket, unless a backlog waits.

pub mod config;
pub mod link;
mod sender;
pub mod server;

pub use config::{DirectConfig, DirectListen};
pub use link::{DirectLink, LinkError, LinkFailure};
pub use server::{DirectReply, DirectServer, DirectService, IN_FLIGHT};
