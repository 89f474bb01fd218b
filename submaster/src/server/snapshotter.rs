//! Snapshots that never hold up the leader's requests. Where a hot standby runs,
//! it writes them from its own fold (whose position is always a message boundary
//! of the durable stream), and the leader writes none: its request loop does not
//! even copy its state. A leader alone asks its committer for a message boundary
//! and copies its state right after, in its request loop (no await in between), so
//! the copy is exactly the fold of the stream up to the boundary's message.
//! Everything else — waiting for that message to be durable, encoding, storing
//! the object and reading it back to verify it (on a low-priority thread of their
//! own, [`crate::snapshot::store_verified`]), appending
//! the marker event (the leader only: one writer per stream), purging the history
//! it covers ([`Purger`]) — runs on a task of its own. A stream or object store
//! that does not answer (a NATS node lost, a JetStream election) then delays the
//! snapshot, not the requests.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hkvm_events::commit::{CommitError, GroupCommitter};
use hkvm_events::positions::{Positions, ReaderKind};
use hkvm_events::registry::now_unix_ms;
use hkvm_events::snapshot::{SnapshotFile, SnapshotStore};
use hkvm_events::{KvEvent, ProducerId, SnapshotTaken, SubclusterId};
use prometheus_client::metrics::gauge::Gauge;
use tokio::task::JoinHandle;

use super::purger::Purger;
use super::Context;
use crate::metrics::SubmasterMetrics;
use crate::state::State;

/// Where a snapshot goes and what follows it.
#[derive(Clone)]
pub(super) struct SnapshotSink {
    /// The object store.
    pub store: SnapshotStore,
    /// Purges the history a verified snapshot covers (none: history kept).
    pub purger: Option<Purger>,
    /// The sub-master's metrics.
    pub metrics: SubmasterMetrics,
}

/// One snapshot writer: at most one snapshot in progress.
#[derive(Default)]
pub(super) struct Snapshotter {
    running: Option<JoinHandle<()>>,
}

impl Snapshotter {
    /// Whether a snapshot is still being written.
    pub(super) fn busy(&self) -> bool {
        self.running
            .as_ref()
            .is_some_and(|task| !task.is_finished())
    }

    /// The leader's snapshot: copies `state` as of everything submitted to
    /// `committer` so far and writes it in the background, with a marker event.
    ///
    /// # Errors
    /// When the committer has stopped.
    pub(super) async fn start_leading(
        &mut self,
        committer: &GroupCommitter,
        sink: &SnapshotSink,
        state: &State,
    ) -> Result<(), CommitError> {
        let boundary = committer.submit_boundary().await?;
        // Everything applied to `state` was submitted before the boundary.
        let file = crate::snapshot::to_file(state);
        let (committer, sink) = (committer.clone(), sink.clone());
        self.running = Some(tokio::spawn(async move {
            let covers_seq = match boundary.await {
                Ok(committed) => committed.seq,
                // The leader learns of the failure through its own writes.
                Err(error) => return tracing::debug!(%error, "snapshot abandoned"),
            };
            write(file, covers_seq, &sink, Some(&committer)).await;
        }));
        Ok(())
    }

    /// A standby's snapshot: everything `state` holds was read from the stream, so
    /// it covers exactly `state.applied_seq`. No marker is appended (the leader is
    /// the stream's one writer).
    pub(super) fn start_standing_by(&mut self, sink: &SnapshotSink, state: &State) {
        let file = crate::snapshot::to_file(state);
        let (covers_seq, sink) = (state.applied_seq, sink.clone());
        self.running = Some(tokio::spawn(async move {
            write(file, covers_seq, &sink, None).await;
        }));
    }
}

impl Drop for Snapshotter {
    /// A sub-master that stops (or a standby that becomes the leader) abandons
    /// a snapshot in progress: nothing is appended or purged on its behalf
    /// after it stopped.
    fn drop(&mut self) {
        if let Some(task) = self.running.take() {
            task.abort();
        }
    }
}

/// Encodes, stores and verifies `file` as covering `covers_seq` (on the
/// low-priority writer thread, [`crate::snapshot::store_verified`]), appends the
/// marker through `committer` (if any), then purges. Failures are logged; the next
/// snapshot tries again.
async fn write(
    file: SnapshotFile,
    covers_seq: u64,
    sink: &SnapshotSink,
    committer: Option<&GroupCommitter>,
) {
    let objects = file.objects.len();
    let (object, checksum) =
        match crate::snapshot::store_verified(&sink.store, file, covers_seq).await {
            Ok(written) => written,
            Err(error) => return tracing::warn!(%error, "snapshot failed; will retry"),
        };
    sink.metrics.snapshots.inc();
    tracing::info!(object, covers_seq, objects, "snapshot written and verified");
    if let Some(committer) = committer {
        let marker = KvEvent::Snapshot(SnapshotTaken {
            covers_seq,
            object,
            checksum,
        });
        sink.metrics.events_appended.inc();
        if let Err(error) = committer.commit(vec![marker]).await {
            return tracing::debug!(%error, "the snapshot marker was not appended");
        }
    }
    if let Some(purger) = &sink.purger {
        purger.purge_after_snapshot(covers_seq).await;
    }
}

/// How often a standby records its position, which also tells the leader that
/// it writes the snapshots.
const STANDBY_RECORD_EVERY: Duration = Duration::from_secs(1);
/// A standby position younger than this means a standby writes the snapshots.
const STANDBY_FRESH: Duration = Duration::from_secs(3);

/// The leader's view of whether a hot standby writes the snapshots: a task that
/// reads the standbys' recorded positions every [`STANDBY_RECORD_EVERY`], so the
/// request loop only reads a flag. Stops when dropped.
pub(super) struct StandbyWatch {
    fresh: Arc<AtomicBool>,
    task: Option<JoinHandle<()>>,
}

impl StandbyWatch {
    /// Watches `positions` for standbys of `subcluster` other than `me` (and
    /// shows what it sees in `gauge`: 1 while a standby writes the snapshots);
    /// without positions no standby is ever seen (the leader snapshots).
    pub(super) fn spawn(
        positions: Option<Positions>,
        subcluster: SubclusterId,
        me: ProducerId,
        gauge: Gauge,
    ) -> Self {
        let fresh = Arc::new(AtomicBool::new(false));
        gauge.set(0);
        let task = positions.map(|positions| {
            let fresh = Arc::clone(&fresh);
            tokio::spawn(async move {
                // A standby entry of this very instance (it stood by before it
                // led) would hold purges back until it went stale.
                let _ = positions
                    .forget(&subcluster, ReaderKind::Standby, me.as_str())
                    .await;
                let mut ticks = tokio::time::interval(STANDBY_RECORD_EVERY);
                ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    ticks.tick().await;
                    let Ok(listed) = positions.list(&subcluster).await else {
                        fresh.store(false, Ordering::Relaxed);
                        gauge.set(0);
                        continue;
                    };
                    let now = now_unix_ms();
                    let fresh_ms = u64::try_from(STANDBY_FRESH.as_millis()).unwrap_or(u64::MAX);
                    let any = listed.iter().any(|p| {
                        p.kind == ReaderKind::Standby
                            && p.reader != me.as_str()
                            && p.age_ms(now) <= fresh_ms
                    });
                    fresh.store(any, Ordering::Relaxed);
                    gauge.set(i64::from(any));
                }
            })
        });
        Self { fresh, task }
    }

    /// Whether a hot standby wrote its position lately, and so the snapshots.
    pub(super) fn standby_snapshots(&self) -> bool {
        self.fresh.load(Ordering::Relaxed)
    }
}

impl Drop for StandbyWatch {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// A standby's share of the snapshots: it writes them from its own fold, so the
/// leader does not, and records its position (which says so to the leader, and
/// keeps purges from passing it).
pub(super) struct StandbySnapshots {
    snapshotter: Snapshotter,
    /// Events applied since the last snapshot.
    pub(super) events_since: u64,
    last: tokio::time::Instant,
    last_record: Option<tokio::time::Instant>,
    recording: Option<JoinHandle<()>>,
}

impl StandbySnapshots {
    pub(super) fn new() -> Self {
        Self {
            snapshotter: Snapshotter::default(),
            events_since: 0,
            last: tokio::time::Instant::now(),
            last_record: None,
            recording: None,
        }
    }

    /// Records the standby's position (on a task: a bucket that does not answer
    /// must not delay following or the lease poll) and, when one is due, starts a
    /// snapshot of `state`.
    pub(super) fn tick(&mut self, ctx: &Context, state: &State) {
        let Some(positions) = &ctx.positions else {
            return;
        };
        let record_due = self
            .last_record
            .is_none_or(|at| at.elapsed() >= STANDBY_RECORD_EVERY);
        let recording = self.recording.as_ref().is_some_and(|t| !t.is_finished());
        if record_due && !recording {
            self.last_record = Some(tokio::time::Instant::now());
            let (positions, subcluster, me, seq) = (
                positions.clone(),
                ctx.config.subcluster.clone(),
                ctx.config.producer.clone(),
                state.applied_seq,
            );
            self.recording = Some(tokio::spawn(async move {
                let recorded = positions
                    .record(&subcluster, ReaderKind::Standby, me.as_str(), seq)
                    .await;
                if let Err(error) = recorded {
                    tracing::debug!(%error, "recording the standby's position");
                }
            }));
        }
        let config = &ctx.config;
        let due = !self.snapshotter.busy()
            && (self.events_since >= config.snapshot_every_events
                || (self.events_since > 0 && self.last.elapsed() >= config.snapshot_interval));
        if due {
            self.snapshotter
                .start_standing_by(&ctx.snapshot_sink(), state);
            self.events_since = 0;
            self.last = tokio::time::Instant::now();
        }
    }
}

impl Drop for StandbySnapshots {
    fn drop(&mut self) {
        if let Some(task) = self.recording.take() {
            task.abort();
        }
    }
}
