//! Errors of the inter-DC master and its gateway, with an [`InterDcErrorKind`]
//! callers match on and the underlying error kept as the source.

use std::net::SocketAddr;

/// The underlying error of an [`InterDcError`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why the inter-DC master or gateway could not do something.
#[derive(Debug, thiserror::Error)]
pub enum InterDcError {
    /// The policy holds a bad value.
    #[error("policy: {0}")]
    Policy(String),
    /// The policy file cannot be read or parsed.
    #[error("policy file {path}")]
    PolicyFile {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: BoxError,
    },
    /// A `NATS_URL:CLUSTER` argument does not parse.
    #[error("bad cluster address {0:?}: expected NATS_URL:CLUSTER")]
    Address(String),
    /// NATS or JetStream failed (connect, KV bucket, subscription, request).
    #[error("{what}")]
    Nats {
        /// What was being done.
        what: String,
        /// The underlying error.
        #[source]
        source: BoxError,
    },
    /// A progress record does not encode or decode.
    #[error("progress record {key}")]
    Progress {
        /// The record's key.
        key: String,
        /// The codec's error.
        #[source]
        source: BoxError,
    },
    /// The WAN side failed (socket, FEC, transfer, checksum).
    #[error("wan: {what}")]
    Wan {
        /// What failed.
        what: String,
        /// The underlying error, if any.
        #[source]
        source: Option<BoxError>,
    },
    /// The source's gateway refused or failed the fetch.
    #[error("gateway: {0}")]
    Gateway(String),
    /// The metrics listener could not start.
    #[error("metrics listener on {addr}")]
    Metrics {
        /// The address asked for.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// The kind of an [`InterDcError`], for matching.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InterDcErrorKind {
    /// A bad policy value or file.
    Policy,
    /// A bad cluster address.
    Address,
    /// Nobody answered a request (no gateway, no server up).
    NoResponders,
    /// A request or operation got no answer in time.
    Timeout,
    /// NATS or JetStream failed otherwise.
    Nats,
    /// A progress record is corrupt.
    Progress,
    /// The WAN copy failed.
    Wan,
    /// The gateway refused or failed.
    Gateway,
    /// The metrics listener failed.
    Metrics,
}

impl InterDcError {
    /// A NATS failure while doing `what`.
    pub fn nats(what: impl Into<String>, source: impl Into<BoxError>) -> Self {
        Self::Nats {
            what: what.into(),
            source: source.into(),
        }
    }

    /// A WAN failure without an underlying error.
    pub fn wan(what: impl Into<String>) -> Self {
        Self::Wan {
            what: what.into(),
            source: None,
        }
    }

    /// A WAN failure while doing `what`, caused by `source`.
    pub fn wan_caused(what: impl Into<String>, source: impl Into<BoxError>) -> Self {
        Self::Wan {
            what: what.into(),
            source: Some(source.into()),
        }
    }

    /// A progress record `key` that does not encode or decode.
    pub fn progress(key: impl Into<String>, source: impl Into<BoxError>) -> Self {
        Self::Progress {
            key: key.into(),
            source: source.into(),
        }
    }

    /// The kind.
    pub fn kind(&self) -> InterDcErrorKind {
        match self {
            Self::Policy(_) | Self::PolicyFile { .. } => InterDcErrorKind::Policy,
            Self::Address(_) => InterDcErrorKind::Address,
            Self::Nats { source, .. } => {
                use async_nats::RequestErrorKind;
                match source.downcast_ref::<async_nats::RequestError>() {
                    Some(error) if error.kind() == RequestErrorKind::NoResponders => {
                        InterDcErrorKind::NoResponders
                    }
                    Some(error) if error.kind() == RequestErrorKind::TimedOut => {
                        InterDcErrorKind::Timeout
                    }
                    _ => InterDcErrorKind::Nats,
                }
            }
            Self::Progress { .. } => InterDcErrorKind::Progress,
            Self::Wan { source, .. } => {
                if source
                    .as_ref()
                    .is_some_and(|e| e.downcast_ref::<tokio::time::error::Elapsed>().is_some())
                {
                    InterDcErrorKind::Timeout
                } else {
                    InterDcErrorKind::Wan
                }
            }
            Self::Gateway(_) => InterDcErrorKind::Gateway,
            Self::Metrics { .. } => InterDcErrorKind::Metrics,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_follow_the_cause() {
        assert_eq!(
            InterDcError::Policy("x".into()).kind(),
            InterDcErrorKind::Policy
        );
        let io = std::io::Error::other("refused");
        assert_eq!(
            InterDcError::nats("connecting", io).kind(),
            InterDcErrorKind::Nats
        );
        assert_eq!(InterDcError::wan("short").kind(), InterDcErrorKind::Wan);
        let source = std::error::Error::source(&InterDcError::wan_caused(
            "binding",
            std::io::Error::other("in use"),
        ))
        .map(ToString::to_string);
        assert_eq!(source.as_deref(), Some("in use"), "the cause is kept");
    }
}
