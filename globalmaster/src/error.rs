//! The global master's error type, with a [`GlobalMasterErrorKind`] to match on and
//! the underlying error kept as the source.

/// The underlying error of a [`GlobalMasterError`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A global-master failure.
#[derive(Debug, thiserror::Error)]
#[error("{kind}: {what}")]
pub struct GlobalMasterError {
    kind: GlobalMasterErrorKind,
    what: String,
    #[source]
    source: Option<BoxError>,
}

/// What went wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum GlobalMasterErrorKind {
    /// The configuration is invalid.
    #[error("configuration")]
    Config,
    /// NATS or JetStream failed (subscribing, buckets, object store).
    #[error("nats")]
    Nats,
    /// The registry failed.
    #[error("registry")]
    Registry,
    /// A checkpoint could not be encoded or decoded.
    #[error("checkpoint")]
    Checkpoint,
    /// Binding the metrics port failed.
    #[error("metrics listener")]
    Metrics,
}

impl GlobalMasterError {
    /// An error of `kind` while doing `what`, caused by `source`.
    pub fn caused(
        kind: GlobalMasterErrorKind,
        what: impl Into<String>,
        source: impl Into<BoxError>,
    ) -> Self {
        Self {
            kind,
            what: what.into(),
            source: Some(source.into()),
        }
    }

    /// What went wrong.
    pub fn kind(&self) -> GlobalMasterErrorKind {
        self.kind
    }

    pub(crate) fn config(what: impl Into<String>, source: impl Into<BoxError>) -> Self {
        Self::caused(GlobalMasterErrorKind::Config, what, source)
    }

    /// A NATS failure while doing `what`.
    pub(crate) fn nats<E: std::error::Error + Send + Sync + 'static>(
        what: &'static str,
    ) -> impl FnOnce(E) -> Self {
        move |source| Self::caused(GlobalMasterErrorKind::Nats, what, source)
    }
}

impl From<hkvm_log::registry::RegistryError> for GlobalMasterError {
    fn from(error: hkvm_log::registry::RegistryError) -> Self {
        Self::caused(GlobalMasterErrorKind::Registry, "the registry", error)
    }
}
