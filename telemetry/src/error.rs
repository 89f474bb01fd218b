//! Errors of the metrics endpoint.

use std::net::SocketAddr;

/// Why the `/metrics` endpoint could not start.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The endpoint could not listen on its address.
    #[error("binding the metrics endpoint to {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// Why it could not be bound.
        source: std::io::Error,
    },
}
