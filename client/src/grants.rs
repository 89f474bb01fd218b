//! A node's data-port admission: every operation must carry a grant its
//! sub-master signed with the sub-cluster's key ([`hkvm_events::grant`]), for
//! this segment, this range and this access, not expired. The node follows the
//! key in the grants bucket, so a replaced key takes effect without a restart
//! (grants of the key before it are still taken meanwhile).

use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::StreamExt as _;
use hkvm_events::grant::{Access, GrantKey, GrantKeyring, Operation};
use hkvm_events::id::{ClusterId, SubclusterId};
use hkvm_log::grants::{self, GrantKeyError};
use hkvm_log::registry::now_unix_ms;
use hkvm_transfer::frame::Op;
use hkvm_transfer::{Admission, Asked};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// How often a node looks for the grants bucket before its sub-master created it.
const BUCKET_POLL: Duration = Duration::from_millis(200);

/// Admits what the sub-cluster's key granted.
#[derive(Debug, Default)]
pub struct GrantChecker {
    keys: RwLock<GrantKeyring>,
}

impl GrantChecker {
    /// A checker that holds no key yet (it refuses everything until it has one).
    pub fn new() -> Self {
        Self::default()
    }

    /// A checker holding `key`.
    pub fn with_key(key: GrantKey) -> Self {
        Self {
            keys: RwLock::new(GrantKeyring::new(key)),
        }
    }

    /// Takes `key` as the current key.
    pub fn rotate_to(&self, key: GrantKey) {
        let mut keys = self
            .keys
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        keys.rotate_to(key);
    }

    /// The id of the current key, once there is one.
    pub fn current_key_id(&self) -> Option<u32> {
        let keys = self
            .keys
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        keys.current().map(|key| key.id)
    }
}

impl Admission for GrantChecker {
    fn admit(&self, asked: &Asked<'_>) -> Result<(), String> {
        let access = match asked.op {
            Op::Read => Access::Read,
            Op::Write => Access::Write,
        };
        let keys = self
            .keys
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        keys.check(
            asked.grant,
            Operation {
                segment: asked.region,
                access,
                offset: asked.offset,
                len: asked.len,
            },
            now_unix_ms(),
        )
        .map_err(|error| error.to_string())
    }
}

/// Keeps a [`GrantChecker`] on the current key of `subcluster` until dropped.
#[derive(Debug)]
pub struct GrantFollower {
    checker: Arc<GrantChecker>,
    task: JoinHandle<()>,
    first: watch::Receiver<Option<Result<u32, GrantKeyError>>>,
}

impl GrantFollower {
    /// Starts following the key of `subcluster` (waiting for the bucket when no
    /// sub-master created it yet).
    pub fn start(nats: async_nats::Client, cluster: ClusterId, subcluster: SubclusterId) -> Self {
        let checker = Arc::new(GrantChecker::new());
        let (first_tx, first) = watch::channel(None);
        let task = {
            let checker = Arc::clone(&checker);
            tokio::spawn(async move {
                let js = async_nats::jetstream::new(nats);
                let keys = match grants::watch(&js, &cluster, &subcluster, BUCKET_POLL).await {
                    Ok(keys) => keys,
                    Err(error) => {
                        let _ = first_tx.send(Some(Err(error)));
                        return;
                    }
                };
                let mut keys = std::pin::pin!(keys);
                while let Some(key) = keys.next().await {
                    match key {
                        Ok(key) => {
                            tracing::info!(%subcluster, key_id = key.id, "data-port grant key in use");
                            let id = key.id;
                            checker.rotate_to(key);
                            first_tx.send_if_modified(|first| {
                                let unset = first.is_none();
                                if unset {
                                    *first = Some(Ok(id));
                                }
                                unset
                            });
                        }
                        Err(error) => {
                            tracing::warn!(%error, "following the grant key stopped; the keys held stay in use");
                            return;
                        }
                    }
                }
            })
        };
        Self {
            checker,
            task,
            first,
        }
    }

    /// The checker the data port admits with.
    pub fn checker(&self) -> Arc<GrantChecker> {
        Arc::clone(&self.checker)
    }

    /// Waits up to `patience` for the first key; its id.
    ///
    /// # Errors
    /// The reason there is none: the bucket could not be read (a credential
    /// without access), or none appeared in time ([`GrantKeyError::NoKey`]).
    pub async fn ready(
        &self,
        patience: Duration,
        subcluster: &SubclusterId,
    ) -> Result<u32, GrantKeyError> {
        let mut first = self.first.clone();
        let waited = tokio::time::timeout(patience, first.wait_for(Option::is_some)).await;
        match waited {
            Ok(Ok(first)) => first
                .clone()
                .unwrap_or(Err(GrantKeyError::NoKey(subcluster.clone()))),
            _ => Err(GrantKeyError::NoKey(subcluster.clone())),
        }
    }
}

impl Drop for GrantFollower {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use hkvm_events::grant::{GrantRequest, GRANT_SECRET_LEN};

    fn asked<'a>(op: Op, offset: u64, grant: &'a [u8]) -> Asked<'a> {
        Asked {
            op,
            region: "n-seg",
            offset,
            len: 64,
            grant,
        }
    }

    #[test]
    fn the_checker_admits_what_its_key_granted_and_refuses_without_a_key() {
        let key = GrantKey {
            id: 5,
            secret: [9; GRANT_SECRET_LEN],
        };
        let grant = key
            .sign(GrantRequest {
                segment: "n-seg",
                access: Access::Read,
                offset: 0,
                len: 128,
                expires_unix_ms: now_unix_ms() + 60_000,
            })
            .to_wire();
        let empty = GrantChecker::new();
        assert!(empty
            .admit(&asked(Op::Read, 0, &grant))
            .unwrap_err()
            .contains("no grant key"));
        let checker = GrantChecker::with_key(key);
        assert_eq!(checker.current_key_id(), Some(5));
        assert_eq!(checker.admit(&asked(Op::Read, 64, &grant)), Ok(()));
        assert!(checker.admit(&asked(Op::Write, 0, &grant)).is_err());
        assert!(checker.admit(&asked(Op::Read, 65, &grant)).is_err());
        assert!(checker
            .admit(&asked(Op::Read, 0, &[]))
            .unwrap_err()
            .contains("no grant"));
    }
}
