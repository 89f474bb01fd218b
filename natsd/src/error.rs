//! Errors of the nats-server launcher.

use std::path::PathBuf;

/// Why a `nats-server` child process could not be started or reached.
#[derive(Debug, thiserror::Error)]
pub enum NatsdError {
    /// The env var names a path that is not a file.
    #[error(
        "nats-server not found: ${env} is {path}, which is not a file",
        env = crate::NATS_SERVER_ENV,
        path = .0.display()
    )]
    NotAFile(PathBuf),
    /// No usable `nats-server` binary was found.
    #[error(
        "nats-server not found (looked at ${env}, {looked} and PATH); run scripts/provision",
        env = crate::NATS_SERVER_ENV
    )]
    NotFound {
        /// The provisioned locations looked at, comma-separated.
        looked: String,
    },
    /// Reserving a port, creating the temp dir, writing the config or spawning the
    /// process failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The operating system's error.
        source: std::io::Error,
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
    /// The server did not report healthy JetStream in time.
    #[error("nats-server {name} not healthy after {waited_ms} ms: {last}; log tail:\n{log_tail}")]
    NotReady {
        /// The server name.
        name: String,
        /// How long we waited.
        waited_ms: u128,
        /// The last health probe answer or error.
        last: String,
        /// The last lines it logged.
        log_tail: String,
    },
    /// Connecting a client failed.
    #[error("connecting to {url}: {source}")]
    Connect {
        /// The URL dialled.
        url: String,
        /// The client error.
        source: async_nats::ConnectError,
    },
}

impl NatsdError {
    /// An I/O failure while doing `what`.
    pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Self {
        let what = what.into();
        move |source| Self::Io { what, source }
    }
}
