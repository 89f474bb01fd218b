//! Errors of the client library.

use hkvm_events::rpc::{RpcError, RpcErrorCode};

/// Why a call that was worth retrying was retried (the last such reason is what a
/// call reports when its deadline passes).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RetryCause {
    /// The server answered `Busy` (recovering or overloaded).
    #[error("busy, asked to retry after {retry_after_ms} ms")]
    Busy {
        /// The server's suggested delay.
        retry_after_ms: u64,
    },
    /// The server lost leadership while handling the request.
    #[error("the server is not the leader")]
    NotLeader,
    /// Nobody subscribes to the subject (no server up, or a takeover in progress).
    #[error("no responders on {subject}")]
    NoResponders {
        /// The subject asked.
        subject: String,
    },
    /// A request that is safe to resend got no answer in time.
    #[error("no answer in time")]
    TimedOut,
    /// A request that is safe to resend lost its answer: its connection, or the
    /// server's, was replaced (a NATS server went away) while it waited.
    #[error("the answer was lost with a replaced NATS connection")]
    AnswerLost,
}

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server answered with an error that retrying does not fix.
    #[error("{op}: {source}")]
    Rpc {
        /// The operation.
        op: &'static str,
        /// The server's error.
        #[source]
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
    /// The server stayed busy or absent (no leader, no responder) until the retry
    /// deadline.
    #[error("{op}: unavailable for {ms} ms ({cause})")]
    Unavailable {
        /// The operation.
        op: &'static str,
        /// How long the call retried.
        ms: u64,
        /// The last reason it retried.
        #[source]
        cause: RetryCause,
    },
    /// Nobody answers on the subject, and nothing there is to wait for: the
    /// service does not exist (a mistyped sub-cluster, say), or its server does
    /// not serve the operation (an older build). No attempt of the call reached
    /// a server, so it took no effect.
    #[error("{op}: no responder on {subject}: {why}")]
    NoService {
        /// The operation.
        op: &'static str,
        /// The request subject.
        subject: String,
        /// Why waiting would not help, and what to check.
        why: String,
    },
    /// NATS failed the request for a reason retrying does not fix.
    #[error("{op}: {source}")]
    Transport {
        /// The operation.
        op: &'static str,
        /// The NATS client's error.
        #[source]
        source: async_nats::RequestError,
    },
    /// The request or reply could not be encoded or decoded.
    #[error("{op}: {source}")]
    Codec {
        /// The operation.
        op: &'static str,
        /// What the codec said.
        #[source]
        source: RpcError,
    },
    /// The coalesced batch this call was part of failed.
    #[error("{op}: the batched request failed: {source}")]
    Batch {
        /// The operation.
        op: &'static str,
        /// The batch's failure, shared by every call in it.
        #[source]
        source: std::sync::Arc<ClientError>,
    },
    /// The coalescer of this operation stopped (its runtime shut down).
    #[error("{op}: the coalescer stopped")]
    Stopped {
        /// The operation.
        op: &'static str,
    },
    /// A batch reply had another number of items than the request.
    #[error("a batch of {asked} items was answered with {answered}")]
    Mismatch {
        /// Items asked.
        asked: usize,
        /// Items answered.
        answered: usize,
    },
}

/// The kind of a [`ClientError`], for matching.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientErrorKind {
    /// The server refused the request (see [`ClientError::Rpc`]).
    Rpc,
    /// No answer in time (see [`ClientError::Timeout`], or a resendable request
    /// unanswered until the deadline).
    Timeout,
    /// The server answered `Busy` until the deadline.
    Busy,
    /// The server kept losing leadership until the deadline (fencing: a deposed
    /// leader cannot serve).
    NotLeader,
    /// Nobody answered on the subject until the deadline.
    NoResponders,
    /// NATS itself failed (connection closed, say).
    Transport,
    /// See [`ClientError::Codec`].
    Codec,
}

impl ClientError {
    /// The kind.
    pub fn kind(&self) -> ClientErrorKind {
        match self {
            Self::Rpc { .. } => ClientErrorKind::Rpc,
            Self::Timeout { .. } => ClientErrorKind::Timeout,
            Self::Unavailable { cause, .. } => match cause {
                RetryCause::Busy { .. } => ClientErrorKind::Busy,
                RetryCause::NotLeader => ClientErrorKind::NotLeader,
                RetryCause::NoResponders { .. } => ClientErrorKind::NoResponders,
                RetryCause::TimedOut | RetryCause::AnswerLost => ClientErrorKind::Timeout,
            },
            Self::NoService { .. } => ClientErrorKind::NoResponders,
            Self::Transport { .. } | Self::Stopped { .. } => ClientErrorKind::Transport,
            Self::Codec { .. } | Self::Mismatch { .. } => ClientErrorKind::Codec,
            Self::Batch { source, .. } => source.kind(),
        }
    }

    /// Whether the call gave up on a server that was absent, busy or slow (as
    /// opposed to one that answered with a refusal): the request may succeed later.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self.kind(),
            ClientErrorKind::Timeout
                | ClientErrorKind::Busy
                | ClientErrorKind::NotLeader
                | ClientErrorKind::NoResponders
        )
    }

    /// The server's error code, when the server answered with one.
    pub fn rpc_code(&self) -> Option<&RpcErrorCode> {
        match self {
            Self::Rpc { source, .. } => Some(&source.code),
            Self::Batch { source, .. } => source.rpc_code(),
            _ => None,
        }
    }
}
