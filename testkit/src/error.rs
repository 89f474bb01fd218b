//! Errors of the test kit.

use std::path::PathBuf;

/// Why a NATS child process could not be started or controlled.
#[derive(Debug, thiserror::Error)]
pub enum TestkitError {
    /// No usable `nats-server` binary was found.
    #[error(
        "nats-server not found (looked at ${env}, {local} and PATH); run scripts/provision",
        env = crate::NATS_SERVER_ENV,
        local = .0.display()
    )]
    BinaryNotFound(PathBuf),
    /// Creating the temp dir, writing the config or spawning the process failed.
    #[error("starting nats-server: {0}")]
    Io(#[from] std::io::Error),
    /// The server did not report healthy JetStream in time.
    #[error("nats-server {name} not healthy after {waited_ms} ms: {last}")]
    NotReady {
        /// The server name.
        name: String,
        /// How long we waited.
        waited_ms: u128,
        /// The last health probe answer or error.
        last: String,
    },
    /// The server process exited while we waited for it.
    #[error("nats-server {name} exited early with {status}; log tail:\n{log_tail}")]
    Exited {
        /// The server name.
        name: String,
        /// Its exit status.
        status: std::process::ExitStatus,
        /// The last lines it logged.
        log_tail: String,
    },
    /// A node index outside the cluster.
    #[error("no node {0} in this cluster")]
    NoSuchNode(usize),
    /// Connecting a client failed.
    #[error("connecting to {url}: {source}")]
    Connect {
        /// The URL we dialled.
        url: String,
        /// The client error.
        source: async_nats::ConnectError,
    },
}
