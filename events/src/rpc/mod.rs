//! RPC wire types: every request and reply exchanged over NATS request/reply, so
//! that clients depend on this crate only, never on a server crate. Requests and
//! replies are MessagePack maps (named fields: unknown fields are skipped, missing
//! optional ones default). Every reply is an [`RpcReply`]: the operation's result or
//! an [`RpcError`] with a code the caller can act on (`Busy` means retry later).

pub mod direct;
pub mod dummy;
pub mod global;
pub mod interdc;
pub mod packed;
pub mod space_lease;
pub mod submaster;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// Largest request or reply body accepted (below the NATS default `max_payload`).
pub const MAX_RPC_BYTES: usize = 1 << 20;

/// What went wrong with a request, for the caller to act on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum RpcErrorCode {
    /// The server is recovering or overloaded: retry after the given delay, with
    /// jitter. Never a reason to give up.
    #[error("busy, retry after {retry_after_ms} ms")]
    Busy {
        /// Suggested delay before retrying.
        retry_after_ms: u64,
    },
    /// The request does not decode or breaks a limit.
    #[error("invalid request")]
    InvalidRequest,
    /// The caller is not registered (e.g. a node pinging before mounting).
    #[error("unknown caller")]
    UnknownCaller,
    /// The server lost leadership while handling the request; retry (the new leader
    /// answers on the same subject).
    #[error("not the leader")]
    NotLeader,
    /// The server failed internally (the event log refused an append).
    #[error("internal error")]
    Internal,
    /// A global-master replica asked to see every acknowledged write (`sync`)
    /// could not catch up in time: its answer could be wrong, so it gives none.
    #[error("stale")]
    Stale,
    /// The request came on a subject its kind may not use: an operation that
    /// needs the admin role on the plain subject, or a node's operation on
    /// another node's subject (see [`submaster::Audience`]).
    #[error("forbidden")]
    Forbidden,
}

/// An error reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{code}: {message}")]
pub struct RpcError {
    /// What went wrong.
    #[serde(rename = "c")]
    pub code: RpcErrorCode,
    /// A human-readable explanation.
    #[serde(rename = "m")]
    pub message: String,
}

impl RpcError {
    /// An error with `code` and `message`.
    pub fn new(code: RpcErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    /// A `Busy` error asking to retry after `retry_after_ms`.
    pub fn busy(retry_after_ms: u64, message: impl Into<String>) -> Self {
        Self::new(RpcErrorCode::Busy { retry_after_ms }, message)
    }

    /// An `InvalidRequest` error.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(RpcErrorCode::InvalidRequest, message)
    }
}

/// Every reply on the wire: the result, or an error.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RpcReply<T> {
    /// The operation ran; per-item outcomes are inside `T` for batch operations.
    #[serde(rename = "ok")]
    Ok(T),
    /// The operation did not run.
    #[serde(rename = "err")]
    Err(RpcError),
}

impl<T> From<Result<T, RpcError>> for RpcReply<T> {
    fn from(result: Result<T, RpcError>) -> Self {
        match result {
            Ok(value) => Self::Ok(value),
            Err(error) => Self::Err(error),
        }
    }
}

impl<T> RpcReply<T> {
    /// The reply as a `Result`.
    ///
    /// # Errors
    /// The carried [`RpcError`].
    pub fn into_result(self) -> Result<T, RpcError> {
        match self {
            Self::Ok(value) => Ok(value),
            Self::Err(error) => Err(error),
        }
    }
}

/// Encodes a request or reply (named-field MessagePack).
///
/// # Errors
/// [`RpcError`] with `Internal` if serialization fails (it does not for these types).
pub fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, RpcError> {
    encode_named(value)
}

/// A reply `body` when it fits the server's `max_payload`; otherwise an encoded
/// `InvalidRequest` error saying so, so that the caller gets an answer rather than
/// waiting for a timeout (NATS drops a message over its limit).
pub fn fit_reply(body: Vec<u8>, max_payload: usize) -> Vec<u8> {
    if body.len() <= max_payload {
        return body;
    }
    let error = RpcError::invalid(format!(
        "the reply of {} bytes exceeds the NATS payload limit of {max_payload} bytes; \
         ask for fewer items per request",
        body.len()
    ));
    tracing::warn!(%error, "a reply was too large to send");
    encode(&RpcReply::<()>::Err(error)).unwrap_or_default()
}

fn encode_named<T: Serialize>(value: &T) -> Result<Vec<u8>, RpcError> {
    rmp_serde::to_vec_named(value)
        .map_err(|e| RpcError::new(RpcErrorCode::Internal, format!("encoding: {e}")))
}

/// Decodes a request or reply, refusing oversized bodies.
///
/// # Errors
/// [`RpcErrorCode::InvalidRequest`] naming what did not decode.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, RpcError> {
    if bytes.len() > MAX_RPC_BYTES {
        return Err(RpcError::invalid(format!(
            "body of {} bytes exceeds {MAX_RPC_BYTES}",
            bytes.len()
        )));
    }
    rmp_serde::from_slice(bytes).map_err(|e| RpcError::invalid(format!("malformed body: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_over_the_payload_limit_becomes_an_error_saying_so() {
        let body = encode(&RpcReply::Ok(vec![7u8; 100])).unwrap();
        assert_eq!(fit_reply(body.clone(), body.len()), body);
        let refused = fit_reply(body.clone(), body.len() - 1);
        match decode::<RpcReply<Vec<u8>>>(&refused).unwrap() {
            RpcReply::Err(error) => {
                assert_eq!(error.code, RpcErrorCode::InvalidRequest);
                assert!(error.message.contains("payload limit"), "{error}");
            }
            RpcReply::Ok(_) => panic!("an oversized reply went out"),
        }
    }
}
