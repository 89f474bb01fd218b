//! What a store does across the cluster rather than in its own sub-cluster:
//! `exist` and `remove` of keys the local sub-master lacks (through the global
//! master, and only when the registry names another sub-cluster), and
//! `remove_all` in every registered sub-cluster.

use std::collections::BTreeMap;

use futures::future::join_all;
use hkvm_events::rpc::global::{BatchIsExistReply, GlobalOp, Locate, LocateReply};
use hkvm_events::rpc::submaster::{ItemError, ItemResult};
use hkvm_events::rpc::RpcReply;
use hkvm_events::SubclusterId;

use super::{peers, Store, StoreError};
use crate::kv::KvError;
use crate::SubmasterClient;

impl Store {
    /// Whether a key this sub-cluster does not hold may be held by another: the
    /// registry names another sub-cluster, or has not been read yet.
    pub fn other_subclusters_possible(&self) -> bool {
        self.peers.elsewhere_possible()
    }

    /// Whether each key exists anywhere in the cluster: the local sub-master's
    /// (authoritative) answer, and the global master's for keys it does not hold,
    /// counting only other sub-clusters (the global master's view of this one may
    /// lag a removal the local sub-master already answered for). A global master
    /// that is down or busy counts as "not elsewhere"; it is not asked when the
    /// registry names no other sub-cluster.
    ///
    /// # Errors
    /// When the local sub-master is unreachable, or the store is closed.
    pub async fn exist(&self, keys: &[String]) -> Result<Vec<bool>, StoreError> {
        self.check_open()?;
        let mut exists = self.kv.metadata().exist(keys.to_vec()).await?;
        if !self.peers.elsewhere_possible() {
            return Ok(exists);
        }
        let missing: Vec<usize> = (0..keys.len()).filter(|&i| !exists[i]).collect();
        for chunk in missing.chunks(hkvm_events::rpc::global::MAX_BATCH_KEYS) {
            let asked: Vec<&str> = chunk.iter().map(|&i| keys[i].as_str()).collect();
            if let Ok(RpcReply::Ok(reply)) = self.global.batch_is_exist(&asked, None).await {
                let elsewhere = held_elsewhere(&reply, &self.address.subcluster);
                for (&index, held) in chunk.iter().zip(elsewhere) {
                    exists[index] = held;
                }
            }
        }
        Ok(exists)
    }

    /// Removes keys wherever they are (leased ones only with `force`); one result
    /// per key, in order.
    ///
    /// # Errors
    /// When the local sub-master is unreachable, or the store is closed.
    pub async fn remove(
        &self,
        keys: &[String],
        force: bool,
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        self.check_open()?;
        let local = self.kv.metadata().remove(keys.to_vec(), force).await?;
        let mut results: Vec<Result<(), StoreError>> = Vec::with_capacity(keys.len());
        let mut elsewhere = Vec::new();
        for (index, (key, result)) in keys.iter().zip(local).enumerate() {
            results.push(match result {
                ItemResult::Ok(()) => Ok(()),
                ItemResult::Err(ItemError::NotFound) => {
                    elsewhere.push(index);
                    Err(KvError::NotFound { key: key.clone() }.into())
                }
                ItemResult::Err(error) => Err(KvError::Item {
                    key: key.clone(),
                    error,
                }
                .into()),
            });
        }
        if !elsewhere.is_empty() && self.peers.elsewhere_possible() {
            self.remove_elsewhere(keys, &elsewhere, force, &mut results)
                .await;
        }
        Ok(results)
    }

    /// Removes the keys at `indexes` from the sub-clusters the global master says
    /// hold them, updating their results.
    async fn remove_elsewhere(
        &self,
        keys: &[String],
        indexes: &[usize],
        force: bool,
        results: &mut [Result<(), StoreError>],
    ) {
        let request = Locate {
            keys: indexes.iter().map(|&i| keys[i].clone()).collect(),
            labels: None,
        };
        let Ok(RpcReply::Ok(reply)) = self
            .global
            .call_once::<_, LocateReply>(GlobalOp::Locate, &request)
            .await
        else {
            return;
        };
        let mut by_owner: BTreeMap<SubclusterId, Vec<usize>> = BTreeMap::new();
        for (&index, owners) in indexes.iter().zip(&reply.owners) {
            for owner in owners {
                by_owner
                    .entry(owner.subcluster.clone())
                    .or_default()
                    .push(index);
            }
        }
        for (subcluster, owned) in by_owner {
            let client = self.submaster(&subcluster);
            let owned_keys = owned.iter().map(|&i| keys[i].clone()).collect();
            let Ok(removed) = client.remove(owned_keys, force).await else {
                continue;
            };
            for (index, result) in owned.into_iter().zip(removed) {
                match result {
                    ItemResult::Ok(()) => results[index] = Ok(()),
                    ItemResult::Err(ItemError::NotFound) => {}
                    ItemResult::Err(error) => {
                        results[index] = Err(KvError::Item {
                            key: keys[index].clone(),
                            error,
                        }
                        .into());
                    }
                }
            }
        }
    }

    /// A client of another sub-cluster's sub-master, for one call.
    fn submaster(&self, subcluster: &SubclusterId) -> SubmasterClient {
        SubmasterClient::with_caller(
            self.kv.metadata().caller().clone(),
            self.address.cluster.clone(),
            subcluster.clone(),
        )
        .without_leader_watch()
    }

    /// The sub-clusters of the cluster, as the registry lists them (this one when
    /// the registry cannot be read).
    async fn subclusters(&self) -> Vec<SubclusterId> {
        let listed = peers::registered_subclusters(self.nats.clone(), &self.address.cluster).await;
        let mut subclusters: Vec<SubclusterId> = listed.unwrap_or_else(|error| {
            tracing::warn!(%error, "reading the registry; removing in this sub-cluster only");
            Vec::new()
        });
        subclusters.push(self.address.subcluster.clone());
        // A sub-cluster may be listed once per registered instance.
        subclusters.sort();
        subclusters.dedup();
        subclusters
    }

    /// Removes every object of the cluster, or every object whose key matches
    /// `pattern`, in every registered sub-cluster; with a `tenant`, only that
    /// tenant's (see [`hkvm_events::tenant`]; `"default"`: the keys of no other
    /// tenant). Returns how many were removed.
    ///
    /// # Errors
    /// An invalid pattern or tenant, this sub-cluster's sub-master unreachable,
    /// or the store closed. Other sub-clusters that fail are skipped with a
    /// warning.
    pub async fn remove_all(
        &self,
        pattern: Option<&str>,
        tenant: Option<&str>,
        force: bool,
    ) -> Result<u64, StoreError> {
        self.check_open()?;
        let subclusters = self.subclusters().await;
        let removals = subclusters.iter().map(|subcluster| async move {
            let client = self.submaster(subcluster);
            let reply = match (pattern, tenant) {
                (None, None) => client.remove_all(force).await,
                (pattern, tenant) => {
                    client
                        .remove_matching(pattern.unwrap_or(""), tenant, force)
                        .await
                }
            };
            (subcluster, reply)
        });
        let mut removed = 0;
        for (subcluster, reply) in join_all(removals).await {
            match reply {
                Ok(reply) => removed += reply.removed,
                Err(error) if *subcluster == self.address.subcluster => return Err(error.into()),
                Err(error) if error.rpc_code().is_some() => return Err(error.into()),
                Err(error) => tracing::warn!(%subcluster, %error, "removing there failed"),
            }
        }
        Ok(removed)
    }
}

/// Per key of a global `batch_is_exist` answer, whether a sub-cluster other than
/// `own` holds it.
fn held_elsewhere(reply: &BatchIsExistReply, own: &SubclusterId) -> Vec<bool> {
    let own = reply
        .subclusters
        .iter()
        .position(|subcluster| subcluster == own);
    let mut holders = reply.holders.iter();
    reply
        .counts
        .iter()
        .map(|&count| {
            // Every holder of this key is taken, so the next key starts at its own.
            let mut elsewhere = false;
            for &holder in holders.by_ref().take(usize::from(count)) {
                elsewhere |= Some(usize::from(holder)) != own;
            }
            elsewhere
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use hkvm_events::rpc::packed::Packed;

    use super::*;

    fn subcluster(name: &str) -> SubclusterId {
        SubclusterId::new(name).unwrap()
    }

    #[test]
    fn only_other_subclusters_count_as_elsewhere() {
        // Keys: held by own only; by own and b; by b only; nowhere; by own.
        let reply = BatchIsExistReply {
            subclusters: vec![subcluster("own"), subcluster("b")],
            counts: Packed(vec![1, 2, 1, 0, 1]),
            holders: Packed(vec![0, 0, 1, 1, 0]),
            ..BatchIsExistReply::default()
        };
        assert_eq!(
            held_elsewhere(&reply, &subcluster("own")),
            [false, true, true, false, false]
        );
        assert_eq!(
            held_elsewhere(&reply, &subcluster("c")),
            [true, true, true, false, true],
            "a sub-cluster the answer does not name: every holder is another"
        );
    }
}
