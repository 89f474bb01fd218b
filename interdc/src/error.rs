//! Errors of the inter-DC master and its gateway.

/// Why the inter-DC master or gateway could not do something.
#[derive(Debug, Clone, thiserror::Error)]
pub enum InterDcError {
    /// The policy file is unreadable or holds a bad value.
    #[error("policy: {0}")]
    Policy(String),
    /// A `NATS_URL:CLUSTER` argument does not parse.
    #[error("bad cluster address {0:?}: expected NATS_URL:CLUSTER")]
    Address(String),
    /// NATS or JetStream failed (connect, KV bucket, subscription).
    #[error("{what}: {reason}")]
    Nats {
        /// What was being done.
        what: String,
        /// The underlying error.
        reason: String,
    },
    /// A progress record does not decode.
    #[error("progress record {key}: {reason}")]
    Progress {
        /// The record's key.
        key: String,
        /// Why it does not decode.
        reason: String,
    },
    /// The WAN side failed (socket, FEC, transfer).
    #[error("wan: {0}")]
    Wan(String),
    /// The metrics listener could not start.
    #[error("metrics: {0}")]
    Metrics(String),
}

impl InterDcError {
    /// A NATS failure while doing `what`.
    pub fn nats(what: impl Into<String>, reason: impl std::fmt::Display) -> Self {
        Self::Nats {
            what: what.into(),
            reason: reason.to_string(),
        }
    }
}
