//! Errors of the sub-master driver, with a [`SubmasterErrorKind`] to match on and
//! the underlying error kept as the source.

use hkvm_events::snapshot::SnapshotError;
use hkvm_log::LogError;

/// The underlying error of a [`SubmasterError`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A sub-master failure.
#[derive(Debug, thiserror::Error)]
#[error("{kind:?}: {message}")]
pub struct SubmasterError {
    kind: SubmasterErrorKind,
    message: String,
    #[source]
    source: Option<BoxError>,
}

/// What failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubmasterErrorKind {
    /// Connecting to NATS or creating streams and buckets.
    Setup,
    /// The event log failed (stream vanished, append refused).
    Log,
    /// Another writer appended: this sub-master is no longer the leader.
    Fenced,
    /// The leader lease bucket failed.
    Lease,
    /// A snapshot could not be written or read.
    Snapshot,
    /// Subscribing to RPC subjects failed.
    Rpc,
}

impl SubmasterError {
    /// An error of `kind` without an underlying error.
    pub fn new(kind: SubmasterErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// An error of `kind` while doing `what`, caused by `source`.
    pub fn caused(
        kind: SubmasterErrorKind,
        what: impl Into<String>,
        source: impl Into<BoxError>,
    ) -> Self {
        Self {
            kind,
            message: what.into(),
            source: Some(source.into()),
        }
    }

    /// What failed.
    pub fn kind(&self) -> SubmasterErrorKind {
        self.kind
    }
}

impl From<LogError> for SubmasterError {
    fn from(error: LogError) -> Self {
        let kind = match error.kind() {
            hkvm_log::LogErrorKind::Fenced { .. } => SubmasterErrorKind::Fenced,
            _ => SubmasterErrorKind::Log,
        };
        // The log's own words (a purged start, a fence) say what to do next.
        Self::caused(kind, format!("event log: {}", error.kind()), error)
    }
}

impl From<SnapshotError> for SubmasterError {
    fn from(error: SnapshotError) -> Self {
        Self::caused(SubmasterErrorKind::Snapshot, "snapshot", error)
    }
}
