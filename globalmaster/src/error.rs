//! The global master's error type, with a [`GlobalMasterErrorKind`] to match on.

/// A global-master failure.
#[derive(Debug, thiserror::Error)]
#[error("{kind}")]
pub struct GlobalMasterError {
    kind: GlobalMasterErrorKind,
}

/// What went wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GlobalMasterErrorKind {
    /// The configuration is invalid.
    #[error("configuration: {0}")]
    Config(String),
    /// NATS or JetStream failed (subscribing, buckets, object store).
    #[error("nats: {0}")]
    Nats(String),
    /// The registry failed.
    #[error("registry: {0}")]
    Registry(String),
    /// A checkpoint could not be encoded.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// Binding the metrics port failed.
    #[error("metrics listener: {0}")]
    Metrics(String),
}

impl GlobalMasterError {
    /// An error of `kind`.
    pub fn new(kind: GlobalMasterErrorKind) -> Self {
        Self { kind }
    }

    /// What went wrong.
    pub fn kind(&self) -> &GlobalMasterErrorKind {
        &self.kind
    }

    pub(crate) fn config(reason: impl Into<String>) -> Self {
        Self::new(GlobalMasterErrorKind::Config(reason.into()))
    }

    pub(crate) fn nats(cause: impl std::fmt::Display) -> Self {
        Self::new(GlobalMasterErrorKind::Nats(cause.to_string()))
    }
}

impl From<hkvm_events::registry::RegistryError> for GlobalMasterError {
    fn from(error: hkvm_events::registry::RegistryError) -> Self {
        Self::new(GlobalMasterErrorKind::Registry(error.to_string()))
    }
}
