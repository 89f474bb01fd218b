//! Errors of the sub-master driver, with a [`SubmasterErrorKind`] to match on.

use hkvm_events::log::LogError;

/// A sub-master failure.
#[derive(Debug, thiserror::Error)]
#[error("{kind:?}: {message}")]
pub struct SubmasterError {
    kind: SubmasterErrorKind,
    message: String,
}

/// What failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubmasterErrorKind {
    /// Connecting to NATS or creating streams and buckets.
    Setup,
    /// The event log failed (stream vanished, append refused).
    Log,
    /// The leader lease bucket failed.
    Lease,
    /// A snapshot could not be written or read.
    Snapshot,
    /// Subscribing to RPC subjects failed.
    Rpc,
}

impl SubmasterError {
    /// An error of `kind`.
    pub fn new(kind: SubmasterErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// What failed.
    pub fn kind(&self) -> SubmasterErrorKind {
        self.kind
    }
}

impl From<LogError> for SubmasterError {
    fn from(error: LogError) -> Self {
        Self::new(SubmasterErrorKind::Log, error.to_string())
    }
}
