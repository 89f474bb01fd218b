//! The projector's error type, with a [`ProjectorErrorKind`] callers match on.

use hkvm_events::checkpoint::CheckpointError;

/// A projector failure. Its display and source are those of its kind.
#[derive(Debug, Clone, thiserror::Error)]
#[error(transparent)]
pub struct ProjectorError {
    kind: ProjectorErrorKind,
}

/// What went wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProjectorErrorKind {
    /// A message arrived out of sequence (a gap): the source must be re-read.
    #[error("out of order: expected sequence {expected}, got {found}")]
    OutOfOrder {
        /// The next sequence expected.
        expected: u64,
        /// The sequence that arrived.
        found: u64,
    },
    /// A stream message whose envelope or event frames do not decode.
    #[error(transparent)]
    Undecodable(#[from] hkvm_events::codec::UndecodableMessage),
    /// A checkpoint that is truncated, corrupt (checksum) or inconsistent.
    #[error("invalid checkpoint: {0}")]
    BadCheckpoint(#[from] CheckpointError),
}

impl ProjectorError {
    /// An error of `kind`.
    pub fn new(kind: ProjectorErrorKind) -> Self {
        Self { kind }
    }

    /// What went wrong.
    pub fn kind(&self) -> &ProjectorErrorKind {
        &self.kind
    }
}

impl From<CheckpointError> for ProjectorError {
    fn from(error: CheckpointError) -> Self {
        Self::new(error.into())
    }
}
