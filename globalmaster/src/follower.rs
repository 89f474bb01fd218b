//! The projection as a [`FoldTarget`]: one adapter per followed source, driven by
//! the shared stream follower of [`hkvm_log::follow`]. It takes the projection's
//! write lock per message (queries wait at most one message's fold), records lag
//! and resyncs for `status` and the metrics, and opens the serving gate once every
//! initial source caught up.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use hkvm_events::key_ops::KeyOps;
use hkvm_events::{key_hash, SubclusterId};
use hkvm_log::follow::{FoldTarget, FollowConfig, Follower, OutOfOrder, ResyncReason, Seed};
use hkvm_projector::ProjectorErrorKind;

use crate::metrics::source_label;
use crate::state::Shared;

/// One source of the projection.
struct ProjectionSource {
    shared: Arc<Shared>,
    subcluster: SubclusterId,
    source: usize,
}

/// Follows `subcluster`'s stream into projection source `source` until the task is
/// aborted.
pub(crate) async fn follow(
    shared: Arc<Shared>,
    js: jetstream::Context,
    subcluster: SubclusterId,
    source: usize,
) {
    let config = FollowConfig {
        batch_bytes: shared.config.read_batch_bytes.max(1),
        linger: Duration::from_millis(shared.config.follow_linger_ms),
        ..FollowConfig::default()
    };
    let cluster = shared.config.cluster.clone();
    let target = ProjectionSource {
        shared,
        subcluster: subcluster.clone(),
        source,
    };
    Follower::new(js, cluster, subcluster, target, config)
        .run()
        .await;
}

impl ProjectionSource {
    fn count_resync(&self, reason: &str) {
        let mut labels = source_label(self.subcluster.as_str());
        labels.push(("reason".to_owned(), reason.to_owned()));
        self.shared.metrics.resyncs.get_or_create(&labels).inc();
    }
}

impl FoldTarget for ProjectionSource {
    /// Key operations: an index needs the hashes of the keys put and dropped,
    /// decoded with the keys borrowed from the message.
    type Message = KeyOps;

    fn applied_seq(&self) -> u64 {
        self.shared
            .read()
            .source(self.source)
            .map_or(0, |s| s.applied_seq)
    }

    fn stream_epoch(&self) -> u64 {
        self.shared
            .read()
            .source(self.source)
            .map_or(0, |s| s.stream_epoch)
    }

    fn set_stream_epoch(&mut self, epoch: u64) {
        self.shared.write().set_stream_epoch(self.source, epoch);
    }

    fn reset(&mut self, reason: ResyncReason) {
        self.shared.write().reset_source(self.source);
        self.shared
            .positions()
            .entry(self.source)
            .or_default()
            .resyncs += 1;
        self.count_resync(reason.as_str());
    }

    fn seed(&mut self, seed: Seed<'_>) {
        let snapshot = seed.snapshot;
        self.shared.write().seed_source(
            self.source,
            snapshot.covers_seq,
            snapshot.objects.iter().map(|object| key_hash(&object.key)),
            snapshot
                .segments
                .iter()
                .map(|segment| (segment.segment.clone(), segment.node.clone(), segment.size)),
        );
        self.shared.notify_applied();
    }

    fn apply(&mut self, messages: Vec<KeyOps>) -> Result<(), OutOfOrder> {
        let labels = source_label(self.subcluster.as_str());
        let (mut events, mut folded) = (0u64, 0u64);
        let mut result = Ok(());
        for message in messages {
            // The lock is taken per message, so queries wait at most one message's
            // fold, not a whole chunk's.
            let applied = self.shared.write().apply_key_ops(self.source, message);
            match applied {
                Ok(applied) => {
                    events += applied.events as u64;
                    folded += 1;
                }
                Err(error) => {
                    result = Err(match error.kind() {
                        ProjectorErrorKind::OutOfOrder { expected, found } => OutOfOrder {
                            expected: *expected,
                            found: *found,
                        },
                        // `apply_key_ops` fails only out of order; anything else is
                        // still a reason to re-read.
                        _ => OutOfOrder {
                            expected: self.applied_seq() + 1,
                            found: 0,
                        },
                    });
                    break;
                }
            }
        }
        self.shared.notify_applied();
        let metrics = &self.shared.metrics;
        metrics.events_applied.get_or_create(&labels).inc_by(events);
        metrics
            .messages_applied
            .get_or_create(&labels)
            .inc_by(folded);
        result
    }

    fn skip(&mut self, seq: u64, _unix_ms: u64) {
        self.shared.write().set_applied_seq(self.source, seq);
        self.shared.notify_applied();
        self.count_resync("corrupt message skipped");
    }

    fn observe_last_seq(&mut self, last_seq: u64) {
        self.shared
            .observe_last_seq(self.source, &self.subcluster, last_seq);
    }

    fn caught_up(&mut self) {
        self.shared.mark_caught_up(self.source);
    }
}
