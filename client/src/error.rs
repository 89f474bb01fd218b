//! Errors of the client library.

use hkvm_events::rpc::RpcError;

/// Why a call failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ClientError {
    /// The server answered with an error that retrying does not fix.
    #[error("{op}: {source}")]
    Rpc {
        /// The operation.
        op: &'static str,
        /// The server's error.
        source: RpcError,
    },
    /// No answer in time for a request that is not safe to resend; it may or may
    /// not have taken effect.
    #[error("{op}: no answer within {ms} ms")]
    Timeout {
        /// The operation.
        op: &'static str,
        /// The request timeout.
        ms: u64,
    },
    /// The server stayed busy or absent (no leader) until the retry deadline.
    #[error("{op}: unavailable for {ms} ms ({last})")]
    Unavailable {
        /// The operation.
        op: &'static str,
        /// How long we retried.
        ms: u64,
        /// The last reason seen.
        last: String,
    },
    /// The request or reply could not be encoded or decoded.
    #[error("{op}: {reason}")]
    Codec {
        /// The operation.
        op: &'static str,
        /// What went wrong.
        reason: String,
    },
}

/// The kind of a [`ClientError`], for matching.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientErrorKind {
    /// See [`ClientError::Rpc`].
    Rpc,
    /// See [`ClientError::Timeout`].
    Timeout,
    /// See [`ClientError::Unavailable`].
    Unavailable,
    /// See [`ClientError::Codec`].
    Codec,
}

impl ClientError {
    /// The kind.
    pub fn kind(&self) -> ClientErrorKind {
        match self {
            Self::Rpc { .. } => ClientErrorKind::Rpc,
            Self::Timeout { .. } => ClientErrorKind::Timeout,
            Self::Unavailable { .. } => ClientErrorKind::Unavailable,
            Self::Codec { .. } => ClientErrorKind::Codec,
        }
    }
}
