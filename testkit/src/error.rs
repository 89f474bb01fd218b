//! Errors of the test kit.

use hkvm_natsd::NatsdError;

/// Why a NATS server or cluster could not be started or controlled.
#[derive(Debug, thiserror::Error)]
pub enum TestkitError {
    /// A node could not be prepared, spawned, made healthy or connected to.
    #[error(transparent)]
    Server(#[from] NatsdError),
    /// A node index outside the cluster.
    #[error("no node {0} in this cluster")]
    NoSuchNode(usize),
}
