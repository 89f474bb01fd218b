//! The NATS authorization the containers and tests run with: the generated
//! config of `hkvm_log::permissions` with fixed test passwords.

use hkvm_events::IdError;

pub use hkvm_log::permissions::interdc::{source_user, target_user, GATEWAY_USER};
pub use hkvm_log::permissions::{
    node_user, submaster_user, Deployment, ListedNode, ADMIN_USER, CLIENT_USER, GLOBAL_USER,
    NODE_USER, POOL_ADMIN_USER,
};

/// The password of a user in the test config (tests only: a deployment sets
/// real secrets or uses NKeys/JWTs with the same permissions).
pub fn password(user: &str) -> String {
    format!("{user}-secret")
}

/// [`hkvm_log::permissions::nats_conf`] with the test passwords.
///
/// # Errors
/// When a name is not a valid cluster, sub-cluster or node id.
pub fn nats_conf(
    cluster: &str,
    subclusters: &[&str],
    nodes: &[ListedNode<'_>],
) -> Result<String, IdError> {
    nats_conf_for(&Deployment {
        cluster,
        subclusters,
        nodes,
        ..Deployment::default()
    })
}

/// [`hkvm_log::permissions::nats_conf`] of `deployment` with the test
/// passwords.
///
/// # Errors
/// When a name is not a valid cluster, sub-cluster or node id.
pub fn nats_conf_for(deployment: &Deployment<'_>) -> Result<String, IdError> {
    hkvm_log::permissions::nats_conf(deployment, password)
}
