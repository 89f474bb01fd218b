//! Errors of the event log, with a [`LogErrorKind`] callers match on.

/// An event-log failure: which log, and what happened.
#[derive(Debug, Clone, thiserror::Error)]
#[error("event log {log}: {kind}")]
pub struct LogError {
    log: String,
    kind: LogErrorKind,
}

/// What went wrong, for callers to act on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LogErrorKind {
    /// The expected last sequence was stale: another writer appended. A leader that
    /// sees this has been deposed and must stop writing.
    #[error("append fenced: expected last sequence {expected}")]
    Fenced {
        /// The sequence the writer expected to be last.
        expected: u64,
    },
    /// The stream does not exist (never created, or deleted).
    #[error("stream not found")]
    StreamNotFound,
    /// The requested start was purged; load a newer snapshot.
    #[error("sequence {requested} was purged; the log starts at {first_seq}")]
    Truncated {
        /// The sequence asked for.
        requested: u64,
        /// The oldest sequence left.
        first_seq: u64,
    },
    /// Sequences jumped while reading (the stream was reset or messages deleted).
    #[error("sequence gap: expected {expected}, got {found}")]
    Gap {
        /// The next sequence expected.
        expected: u64,
        /// The sequence that arrived.
        found: u64,
    },
    /// The message is larger than the server accepts.
    #[error("message too large: {0}")]
    TooLarge(String),
    /// No acknowledgement in time; the append may or may not be stored (retry with
    /// the same message id to find out).
    #[error("timed out")]
    Timeout,
    /// The connection the append went out on was replaced (its NATS server went
    /// away) before the acknowledgement came, so none will come; the append may or
    /// may not be stored (send it again with the same message id to find out).
    #[error("the NATS connection was replaced before the acknowledgement came")]
    ConnectionReplaced,
    /// The log refused or failed for another reason.
    #[error("{0}")]
    Other(String),
}

impl LogError {
    /// An error of `log`.
    pub fn new(log: impl Into<String>, kind: LogErrorKind) -> Self {
        Self {
            log: log.into(),
            kind,
        }
    }

    /// An [`LogErrorKind::Other`] error from any displayable cause.
    pub fn other(log: impl Into<String>, cause: impl std::fmt::Display) -> Self {
        Self::new(log, LogErrorKind::Other(cause.to_string()))
    }

    /// What went wrong.
    pub fn kind(&self) -> &LogErrorKind {
        &self.kind
    }

    /// The log (stream name) concerned.
    pub fn log(&self) -> &str {
        &self.log
    }
}
