//! Copying one block: fetch it from the source pool over the WAN
//! ([`wan::fetch`](crate::wan::fetch)), then write it through a target sub-master
//! (put_start → write to the placed nodes → put_end with the source checksum), so
//! the target's own events record the copy. The target sub-cluster is chosen by
//! the policy's labels (hard, then preferred), then by free space.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use hkvm_client::{KvClient, KvError, SubmasterClient};
use hkvm_events::rpc::submaster::ItemError;
use hkvm_events::{ClusterId, SubclusterId};
use hkvm_transfer::TcpTransport;

use crate::diff::Candidate;
use crate::policy::Policy;
use crate::shared::SubclusterInfo;
use crate::wan::{fetch, Fetched, ReceiverSettings, SentReport, WanShape};

/// How a copy ended.
#[derive(Debug, Clone)]
pub enum CopyOutcome {
    /// Committed at the target.
    Copied {
        /// The target sub-cluster.
        subcluster: SubclusterId,
        /// What the WAN send cost.
        sent: SentReport,
        /// Lost shards FEC rebuilt at the receiver.
        fec_recoveries: u64,
    },
    /// The source no longer holds the block (evicted or removed mid-copy).
    SourceGone,
    /// The source holds a different value now; the next events will tell.
    SourceChanged,
    /// The target already holds the key (copied by other means meanwhile).
    AlreadyAtTarget,
    /// No allowed target sub-cluster exists or has room.
    NoTarget(String),
    /// The copy failed (retried later).
    Failed(String),
}

impl CopyOutcome {
    /// A short name (metrics label, logs).
    pub fn name(&self) -> &'static str {
        match self {
            Self::Copied { .. } => "copied",
            Self::SourceGone => "source_gone",
            Self::SourceChanged => "source_changed",
            Self::AlreadyAtTarget => "already_at_target",
            Self::NoTarget(_) => "no_target",
            Self::Failed(_) => "failed",
        }
    }
}

/// Everything a copy needs.
pub(crate) struct Copier {
    pub source_nats: async_nats::Client,
    pub source: ClusterId,
    pub target_nats: async_nats::Client,
    pub target: ClusterId,
    pub receiver: ReceiverSettings,
    pub policy: Policy,
    clients: Mutex<HashMap<SubclusterId, KvClient>>,
    transport: Arc<TcpTransport>,
}

impl Copier {
    pub fn new(
        source_nats: async_nats::Client,
        source: ClusterId,
        target_nats: async_nats::Client,
        target: ClusterId,
        receiver: ReceiverSettings,
        policy: Policy,
    ) -> Self {
        Self {
            source_nats,
            source,
            target_nats,
            target,
            receiver,
            policy,
            clients: Mutex::default(),
            transport: Arc::new(TcpTransport::default()),
        }
    }

    fn target_client(&self, subcluster: &SubclusterId) -> KvClient {
        let mut clients = self
            .clients
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        clients
            .entry(subcluster.clone())
            .or_insert_with(|| {
                let metadata = SubmasterClient::new(
                    self.target_nats.clone(),
                    self.target.clone(),
                    subcluster.clone(),
                );
                KvClient::new(metadata, Arc::clone(&self.transport) as _)
            })
            .clone()
    }

    /// Copies one block; `targets` is the target pool's registry view and `shape`
    /// the WAN shape (its rate is this copy's share of the cap).
    pub async fn copy(
        &self,
        candidate: &Candidate,
        targets: &[(SubclusterId, SubclusterInfo)],
        shape: WanShape,
    ) -> CopyOutcome {
        let order = placement_order(&self.policy, targets, candidate.block.size);
        if order.is_empty() {
            return CopyOutcome::NoTarget(
                "no live target sub-master carries the policy's target labels".into(),
            );
        }
        let fetched = match fetch(
            &self.source_nats,
            &self.source,
            &self.receiver,
            candidate,
            shape,
        )
        .await
        {
            Ok(fetched) => fetched,
            Err(error) => return CopyOutcome::Failed(error.to_string()),
        };
        let (value, sent, received) = match fetched {
            Fetched::Block {
                value,
                sent,
                received,
            } => (value, sent, received),
            Fetched::Gone => return CopyOutcome::SourceGone,
            Fetched::Changed => return CopyOutcome::SourceChanged,
        };
        let mut last = String::new();
        for subcluster in order {
            let client = self.target_client(&subcluster);
            match client
                .put(&candidate.block.key, &value, self.policy.target_replicas)
                .await
            {
                Ok(()) => {
                    return CopyOutcome::Copied {
                        subcluster,
                        sent,
                        fec_recoveries: received.fec_recoveries,
                    }
                }
                Err(KvError::Item {
                    error: ItemError::AlreadyExists,
                    ..
                }) => return CopyOutcome::AlreadyAtTarget,
                Err(KvError::Item {
                    error: error @ ItemError::NoSpace { .. },
                    ..
                }) => {
                    last = format!("{subcluster}: {error}");
                }
                Err(error) => return CopyOutcome::Failed(format!("{subcluster}: {error}")),
            }
        }
        CopyOutcome::NoTarget(last)
    }
}

/// The target sub-clusters to try, in order: alive, carrying the hard labels;
/// those carrying the preferred labels first; then most free space first.
/// Sub-clusters that cannot fit the block by their registry figures come last.
pub(crate) fn placement_order(
    policy: &Policy,
    targets: &[(SubclusterId, SubclusterInfo)],
    size: u64,
) -> Vec<SubclusterId> {
    let mut allowed: Vec<&(SubclusterId, SubclusterInfo)> = targets
        .iter()
        .filter(|(_, info)| info.alive && Policy::labels_match(&policy.target_labels, &info.labels))
        .collect();
    allowed.sort_by_key(|(id, info)| {
        let free = info.capacity_bytes.saturating_sub(info.used_bytes);
        (
            !Policy::labels_match(&policy.prefer_target_labels, &info.labels),
            free < size,
            std::cmp::Reverse(free),
            id.clone(),
        )
    });
    allowed.into_iter().map(|(id, _)| id.clone()).collect()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn info(labels: &[(&str, &str)], capacity: u64, used: u64, alive: bool) -> SubclusterInfo {
        SubclusterInfo {
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect::<BTreeMap<_, _>>(),
            capacity_bytes: capacity,
            used_bytes: used,
            alive,
            followed: true,
        }
    }

    fn sc(name: &str) -> SubclusterId {
        SubclusterId::new(name).unwrap()
    }

    #[test]
    fn hard_labels_filter_soft_labels_order_then_free_space() {
        let targets = vec![
            (sc("a"), info(&[("pool", "decode")], 100, 90, true)),
            (
                sc("b"),
                info(&[("pool", "decode"), ("zone", "z1")], 100, 50, true),
            ),
            (sc("c"), info(&[("pool", "decode")], 100, 0, true)),
            (sc("d"), info(&[("pool", "prefill")], 100, 0, true)),
            (sc("e"), info(&[("pool", "decode")], 100, 0, false)),
        ];
        let mut policy = Policy::default();
        policy
            .target_labels
            .insert("pool".to_owned(), "decode".to_owned());
        assert_eq!(
            placement_order(&policy, &targets, 1),
            [sc("c"), sc("b"), sc("a")]
        );
        policy
            .prefer_target_labels
            .insert("zone".to_owned(), "z1".to_owned());
        assert_eq!(
            placement_order(&policy, &targets, 1),
            [sc("b"), sc("c"), sc("a")]
        );
        assert_eq!(
            placement_order(&policy, &targets, 60),
            [sc("b"), sc("c"), sc("a")],
            "preference wins over fit; fit orders the rest"
        );
        assert!(placement_order(&policy, &[], 1).is_empty());
    }
}
