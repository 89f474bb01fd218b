//! Bounded history. After a snapshot is stored and read back intact, the leader
//! purges its stream up to the point every reader has passed: what the snapshot
//! covers, held back by every fresh reader position (global-master checkpoints,
//! inter-DC masters). A restart then replays only what came after the snapshot,
//! and a reader left behind the purge point seeds from the snapshot.

use std::time::Duration;

use hkvm_events::SubclusterId;
use hkvm_log::positions::{purge_point, Positions};
use hkvm_log::registry::now_unix_ms;
use hkvm_log::JetStreamLog;
use hkvm_telemetry::metrics::gauge_value;

use crate::metrics::SubmasterMetrics;

/// Purges one sub-cluster's stream after its snapshots.
#[derive(Clone)]
pub(super) struct Purger {
    log: JetStreamLog,
    positions: Positions,
    subcluster: SubclusterId,
    reader_ttl: Duration,
    metrics: SubmasterMetrics,
}

impl Purger {
    /// A purger of `log`, bounded by the readers in `positions`.
    pub(super) fn new(
        log: JetStreamLog,
        positions: Positions,
        subcluster: SubclusterId,
        reader_ttl: Duration,
        metrics: SubmasterMetrics,
    ) -> Self {
        Self {
            log,
            positions,
            subcluster,
            reader_ttl,
            metrics,
        }
    }

    /// Purges the stream up to `snapshot_covers` (a verified snapshot's sequence),
    /// or less far when a fresh reader is behind it. Failures are logged: the
    /// history is only kept longer, and the next snapshot tries again.
    pub(super) async fn purge_after_snapshot(&self, snapshot_covers: u64) {
        let readers = match self.positions.list(&self.subcluster).await {
            Ok(readers) => readers,
            Err(error) => {
                // Not knowing where the readers are, keep everything.
                return tracing::warn!(%error, "reader positions unreadable; not purging");
            }
        };
        let through = purge_point(snapshot_covers, &readers, now_unix_ms(), self.reader_ttl);
        let stats = match self.log.stats().await {
            Ok(stats) => stats,
            Err(error) => return tracing::warn!(%error, "stream unreadable; not purging"),
        };
        if through < stats.bounds.first_seq {
            return;
        }
        match self.log.purge_through(through).await {
            Ok(purged) => {
                self.metrics.purged_messages.inc_by(purged);
                self.metrics
                    .history_first_seq
                    .set(gauge_value(through.saturating_add(1)));
                tracing::info!(
                    through,
                    snapshot_covers,
                    readers = readers.len(),
                    purged,
                    bytes_before = stats.bytes,
                    "stream history purged"
                );
            }
            Err(error) => tracing::warn!(%error, through, "purging the stream"),
        }
    }
}
