//! Copying one block: fetch it from the source pool over the WAN
//! ([`wan::fetch`](crate::wan::fetch)), then write it through a target sub-master
//! (put_start → write to the placed nodes → put_end with the source checksum), so
//! the target's own events record the copy. The target sub-cluster is chosen by
//! the policy's labels (hard, then preferred), then by free space.

use std::time::Duration;

use hkvm_client::{KvClient, KvError};
use hkvm_events::rpc::submaster::ItemError;
use hkvm_events::{ClusterId, SubclusterId};
use hkvm_log::registry::now_unix_ms;
use hkvm_transfer::wan::ReceiveReport;

use crate::clients::PoolClients;
use crate::diff::Candidate;
use crate::policy::Policy;
use crate::progress::{InFlightRecord, Progress};
use crate::shared::SubclusterInfo;
use hkvm_events::rpc::interdc::{SentReport, WanShape};

use crate::wan::{fetch, Fetched, ReceiverSettings};

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
    source_nats: async_nats::Client,
    source: ClusterId,
    receiver: ReceiverSettings,
    policy: Policy,
    progress: Progress,
    targets: PoolClients,
}

impl Copier {
    /// A copier from `source` (through its gateways) into `target`.
    pub fn new(
        source_nats: async_nats::Client,
        source: ClusterId,
        target_nats: async_nats::Client,
        target: ClusterId,
        receiver: ReceiverSettings,
        policy: Policy,
        progress: Progress,
    ) -> Self {
        Self {
            source_nats,
            source,
            receiver,
            policy,
            progress,
            targets: PoolClients::new(target_nats, target),
        }
    }

    fn target_client(&self, subcluster: &SubclusterId) -> KvClient {
        self.targets.get(subcluster)
    }

    /// Copies one block; `targets` is the target pool's registry view and `shape`
    /// the WAN shape (its rate is this copy's share of the cap).
    ///
    /// When the WAN send should take well under the target's put timeout, the
    /// target space is reserved first (put_start), so a key the target already
    /// holds, or a full target, costs no WAN bytes; a long send fetches first and
    /// then puts.
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
        let expected = Duration::from_secs_f64(
            candidate.block.size as f64 * 1.5 / shape.rate_bytes_per_sec.max(1) as f64,
        );
        if expected > RESERVE_FIRST_LIMIT {
            return self.fetch_then_put(candidate, &order, shape).await;
        }
        let mut last = String::new();
        for subcluster in order {
            let client = self.target_client(&subcluster);
            let pending = match client
                .reserve(
                    &candidate.block.key,
                    candidate.block.size,
                    self.policy.target_replicas,
                )
                .await
            {
                Ok(pending) => pending,
                Err(error) => match classify(&subcluster, error) {
                    PutFailure::NoSpace(reason) => {
                        last = reason;
                        continue;
                    }
                    PutFailure::Exists => return CopyOutcome::AlreadyAtTarget,
                    PutFailure::Other(reason) => return CopyOutcome::Failed(reason),
                },
            };
            let record = InFlightRecord {
                key: candidate.block.key.clone(),
                subcluster: subcluster.to_string(),
                unix_ms: now_unix_ms(),
            };
            if let Err(error) = self
                .progress
                .record_in_flight(candidate.hash, &record)
                .await
            {
                tracing::warn!(%error, key = %record.key, "recording a copy in flight");
            }
            let outcome = match self.fetch(candidate, shape).await {
                Ok((value, sent, received)) => match client.complete(pending, &value).await {
                    Ok(()) => CopyOutcome::Copied {
                        subcluster,
                        sent,
                        fec_recoveries: received.fec_recoveries,
                    },
                    Err(error) => match classify(&subcluster, error) {
                        PutFailure::Exists => CopyOutcome::AlreadyAtTarget,
                        PutFailure::NoSpace(reason) | PutFailure::Other(reason) => {
                            CopyOutcome::Failed(reason)
                        }
                    },
                },
                Err(outcome) => {
                    client.abandon(pending).await;
                    outcome
                }
            };
            if let Err(error) = self.progress.clear_in_flight(candidate.hash).await {
                tracing::warn!(%error, key = %record.key, "clearing a copy in flight");
            }
            return outcome;
        }
        CopyOutcome::NoTarget(last)
    }

    /// Fetches the block over the WAN; a copy that cannot go on is the `Err`.
    async fn fetch(
        &self,
        candidate: &Candidate,
        shape: WanShape,
    ) -> Result<(bytes::Bytes, SentReport, ReceiveReport), CopyOutcome> {
        match fetch(
            &self.source_nats,
            &self.source,
            &self.receiver,
            candidate,
            shape,
        )
        .await
        {
            Ok(Fetched::Block {
                value,
                sent,
                received,
            }) => Ok((value, sent, received)),
            Ok(Fetched::Gone) => Err(CopyOutcome::SourceGone),
            Ok(Fetched::Changed) => Err(CopyOutcome::SourceChanged),
            Err(error) => Err(CopyOutcome::Failed(error.to_string())),
        }
    }

    async fn fetch_then_put(
        &self,
        candidate: &Candidate,
        order: &[SubclusterId],
        shape: WanShape,
    ) -> CopyOutcome {
        let (value, sent, received) = match self.fetch(candidate, shape).await {
            Ok(fetched) => fetched,
            Err(outcome) => return outcome,
        };
        let mut last = String::new();
        for subcluster in order {
            let client = self.target_client(subcluster);
            match client
                .put(&candidate.block.key, &value, self.policy.target_replicas)
                .await
            {
                Ok(()) => {
                    return CopyOutcome::Copied {
                        subcluster: subcluster.clone(),
                        sent,
                        fec_recoveries: received.fec_recoveries,
                    }
                }
                Err(error) => match classify(subcluster, error) {
                    PutFailure::NoSpace(reason) => last = reason,
                    PutFailure::Exists => return CopyOutcome::AlreadyAtTarget,
                    PutFailure::Other(reason) => return CopyOutcome::Failed(reason),
                },
            }
        }
        CopyOutcome::NoTarget(last)
    }
}

/// A WAN send expected to take longer than this is fetched before the target
/// space is reserved (a reservation lives for the sub-master's put timeout,
/// 30 s by default).
const RESERVE_FIRST_LIMIT: Duration = Duration::from_secs(10);

/// How a target put failed.
enum PutFailure {
    /// The key is already there (complete or being put).
    Exists,
    /// This sub-cluster has no room.
    NoSpace(String),
    /// Anything else.
    Other(String),
}

fn classify(subcluster: &SubclusterId, error: KvError) -> PutFailure {
    match error {
        KvError::Item {
            error: ItemError::AlreadyExists,
            ..
        } => PutFailure::Exists,
        KvError::Item {
            error: error @ ItemError::NoSpace { .. },
            ..
        } => PutFailure::NoSpace(format!("{subcluster}: {error}")),
        error => PutFailure::Other(format!("{subcluster}: {error}")),
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
