//! Snapshots that never hold up the leader's requests. Where a hot standby runs,
//! it writes them from its own fold (whose position is always a message boundary
//! of the durable stream), and the leader writes none. A leader alone asks its
//! committer for a message boundary and nothing more: once that message is
//! durable, the state as of it is rebuilt from durable history (the newest
//! snapshot plus the stream up to the boundary, [`rebuild`]), so its request
//! loop does not copy its state. Only when durable history cannot rebuild it
//! (the snapshots lost and the stream purged) is the next one copied from the
//! leader's state, right after its boundary, once. Everything else — the rebuild, encoding,
//! storing the object and reading it back to verify it (on a low-priority thread
//! of their own, [`crate::snapshot::on_writer_thread`]), appending the marker
//! event (the leader only: one writer per stream), purging the history it
//! covers ([`Purger`]) — runs off the request loop. A stream or object store
//! that does not answer (a NATS node lost, a JetStream election) then delays the
//! snapshot, not the requests.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hkvm_events::{KvEvent, ProducerId, SnapshotTaken, SubclusterId};
use hkvm_log::commit::{CommitError, GroupCommitter};
use hkvm_log::pace::CpuShare;
use hkvm_log::positions::{Positions, ReaderKind};
use hkvm_log::registry::now_unix_ms;
use hkvm_log::JetStreamLog;
use hkvm_log::SnapshotStore;
use prometheus_client::metrics::gauge::Gauge;
use tokio::task::JoinHandle;
use tracing::Instrument as _;

use super::purger::Purger;
use super::{follower, Context};
use crate::election::LeaderLease;
use crate::error::{SubmasterError, SubmasterErrorKind};
use crate::metrics::SubmasterMetrics;
use crate::snapshot::{on_writer_thread, store_bytes_verify};
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
    /// The share of a core the encoder works at ([`crate::SnapshotPace`]).
    pub cpu_share: f64,
}

/// One snapshot writer: at most one snapshot in progress.
#[derive(Default)]
pub(super) struct Snapshotter {
    running: Option<JoinHandle<()>>,
    /// Set when durable history could not rebuild the leader's last snapshot
    /// (the newest snapshot unreadable and the stream purged past the one
    /// before it, say): the next one is copied from the leader's state instead,
    /// once, so snapshots and purges never stop for good.
    copy_next: Arc<AtomicBool>,
}

impl Snapshotter {
    /// Whether a snapshot is still being written.
    pub(super) fn busy(&self) -> bool {
        self.running
            .as_ref()
            .is_some_and(|task| !task.is_finished())
    }

    /// The leader's snapshot, when no hot standby writes them: covers
    /// everything submitted to `committer` so far. It is rebuilt from durable
    /// history ([`rebuild`]), so the request loop copies nothing; only after a
    /// rebuild failed is it copied from `state`, right after the boundary is
    /// submitted (no await in between, so the copy is exactly the fold up to the
    /// boundary's message). Written in the background, with a marker event.
    ///
    /// # Errors
    /// When the committer has stopped.
    pub(super) async fn start_leading(
        &mut self,
        committer: &GroupCommitter,
        sink: &SnapshotSink,
        log: &JetStreamLog,
        state: &State,
    ) -> Result<(), CommitError> {
        let boundary = committer.submit_boundary().await?;
        let copied = self
            .copy_next
            .swap(false, Ordering::Relaxed)
            .then(|| crate::snapshot::to_file(state));
        let (committer, sink, log) = (committer.clone(), sink.clone(), log.clone());
        let cpu_share = sink.cpu_share;
        let copy_next = Arc::clone(&self.copy_next);
        self.running = Some(tokio::spawn(async move {
            let covers_seq = match boundary.await {
                Ok(committed) => committed.seq,
                // The leader learns of the failure through its own writes.
                Err(error) => return tracing::debug!(%error, "snapshot abandoned"),
            };
            let store = sink.store.clone();
            let rebuilt = copied.is_none();
            let written = if let Some(mut file) = copied {
                tracing::info!(covers_seq, "snapshot copied from the leader's state");
                on_writer_thread(move || async move {
                    file.covers_seq = covers_seq;
                    let objects = file.objects.len();
                    let bytes = file.encode()?;
                    drop(file);
                    let (object, checksum) = store_bytes_verify(&store, bytes, covers_seq).await?;
                    Ok(Some(Written {
                        object,
                        checksum,
                        objects,
                    }))
                })
                .await
            } else {
                // The writer thread's logs say whose work they are.
                let span = tracing::info_span!("snapshot_rebuild", covers_seq);
                on_writer_thread(move || {
                    async move {
                        let Some(state) = rebuild(&log, &store, covers_seq).await? else {
                            return Ok(None);
                        };
                        let objects = state.object_count();
                        let pace = CpuShare::new(cpu_share);
                        // Not abandoned mid-way: a stopping leader drops this
                        // job, which ends at its next await.
                        let never = std::sync::atomic::AtomicBool::new(false);
                        let bytes = crate::snapshot::encode_paced(&state, pace, &never)?;
                        drop(state);
                        let (object, checksum) =
                            store_bytes_verify(&store, bytes, covers_seq).await?;
                        Ok(Some(Written {
                            object,
                            checksum,
                            objects,
                        }))
                    }
                    .instrument(span)
                })
                .await
            };
            match written {
                Ok(Some(written)) => {
                    if rebuilt {
                        sink.metrics.snapshots_rebuilt.inc();
                    }
                    finish(written, covers_seq, &sink, Some(&committer)).await;
                }
                Ok(None) => tracing::debug!(covers_seq, "a snapshot at least as new exists"),
                Err(error) if rebuilt => {
                    copy_next.store(true, Ordering::Relaxed);
                    tracing::warn!(
                        %error,
                        "rebuilding the snapshot failed; the next one is copied from the leader's state"
                    );
                }
                Err(error) => tracing::warn!(%error, "snapshot failed; will retry"),
            }
        }));
        Ok(())
    }

    /// A standby's snapshot: everything `state` holds was read from the stream, so
    /// it covers exactly `state.applied_seq`. The standby's fold waits while the
    /// state is encoded, at a low priority; storing and verifying it happen in
    /// the background. No marker is appended (the leader is the stream's one
    /// writer). The encoding stops early once `abandon` is set.
    pub(super) fn start_standing_by(
        &mut self,
        sink: &SnapshotSink,
        state: &State,
        abandon: &AtomicBool,
    ) {
        let encoded = crate::snapshot::encode_at_low_priority(state, sink.cpu_share, abandon);
        let bytes = match encoded {
            Ok(bytes) => bytes,
            Err(error) => return tracing::warn!(%error, "snapshot failed; will retry"),
        };
        let (covers_seq, objects, sink) = (state.applied_seq, state.object_count(), sink.clone());
        self.running = Some(tokio::spawn(async move {
            match crate::snapshot::store_verified(&sink.store, bytes, covers_seq).await {
                Ok((object, checksum)) => {
                    let written = Written {
                        object,
                        checksum,
                        objects,
                    };
                    finish(written, covers_seq, &sink, None).await;
                }
                Err(error) => tracing::warn!(%error, "snapshot failed; will retry"),
            }
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

/// A snapshot stored and verified.
struct Written {
    /// The object's name in the store.
    object: String,
    /// The checksum of its bytes.
    checksum: u64,
    /// Objects it holds.
    objects: usize,
}

/// The state as of `covers_seq`, rebuilt from durable history alone: the newest
/// verified snapshot plus the stream up to `covers_seq`, folded as a restarting
/// sub-master folds them. `None` when a snapshot at least as new exists. Runs on
/// the writer thread: its memory (a second state, while it lasts) and CPU are
/// the price of a leader without a standby never copying its state in its
/// request loop.
///
/// # Errors
/// When the store or the stream cannot be read, or the stream ends before
/// `covers_seq`.
async fn rebuild(
    log: &JetStreamLog,
    store: &SnapshotStore,
    covers_seq: u64,
) -> Result<Option<State>, SubmasterError> {
    let mut state = crate::snapshot::load_newest(store)
        .await?
        .unwrap_or_default();
    if state.applied_seq >= covers_seq {
        return Ok(None);
    }
    // Metrics of their own: the rebuild's gauges are not the leader's.
    let metrics = SubmasterMetrics::new();
    follower::fold_until(log, &mut state, covers_seq, &metrics).await?;
    if state.applied_seq != covers_seq {
        return Err(SubmasterError::new(
            SubmasterErrorKind::Snapshot,
            format!(
                "the stream ends at {} before the snapshot's {covers_seq}",
                state.applied_seq
            ),
        ));
    }
    Ok(Some(state))
}

/// After a snapshot is stored and verified: counts it, appends the marker
/// through `committer` (if any), then purges. Failures are logged; the next
/// snapshot tries again.
async fn finish(
    written: Written,
    covers_seq: u64,
    sink: &SnapshotSink,
    committer: Option<&GroupCommitter>,
) {
    let Written {
        object,
        checksum,
        objects,
    } = written;
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
                record(&positions, &subcluster, &me, seq).await;
            }));
        }
        let config = &ctx.config;
        let due = !self.snapshotter.busy()
            && (self.events_since >= config.snapshot_every_events
                || (self.events_since > 0 && self.last.elapsed() >= config.snapshot_interval));
        if due {
            // The encoding pauses this fold (seconds at 10 M objects), and with
            // it the recording above: a task on another worker goes on
            // recording the position meanwhile, so the leader does not take
            // the standby for gone and rebuild the same snapshot itself.
            let keepalive = tokio::spawn(record_every(
                positions.clone(),
                ctx.config.subcluster.clone(),
                ctx.config.producer.clone(),
                state.applied_seq,
            ));
            // It also pauses this standby's look at the lease: another task
            // looks meanwhile, and stops the encoding once the leader is gone,
            // so a failover waits for no snapshot.
            let abandon = Arc::new(AtomicBool::new(false));
            let watch = tokio::spawn(abandon_when_leader_gone(
                ctx.lease.clone(),
                ctx.config.leader_lease_ttl,
                Arc::clone(&abandon),
            ));
            self.snapshotter
                .start_standing_by(&ctx.snapshot_sink(), state, &abandon);
            keepalive.abort();
            watch.abort();
            self.events_since = 0;
            self.last = tokio::time::Instant::now();
        }
    }
}

/// Sets `abandon` once the leader lease is free or its holder's revision stood
/// still for `ttl` (as the standby's own poll judges it). It only looks: the
/// standby's poll takes the lease over once the encoding has stopped.
async fn abandon_when_leader_gone(lease: LeaderLease, ttl: Duration, abandon: Arc<AtomicBool>) {
    let mut poll = tokio::time::interval(super::LEASE_POLL);
    let mut view = super::LeaseWatch::default();
    loop {
        poll.tick().await;
        let gone = match lease.holder().await {
            Ok(None) => true,
            Ok(Some((_, revision))) => view.stood_still(revision, ttl),
            // Judged over successful reads only, as the standby's poll does.
            Err(_) => {
                view.unreadable();
                false
            }
        };
        if gone {
            tracing::info!(
                "the leader's lease stands still: abandoning the snapshot being encoded"
            );
            abandon.store(true, Ordering::Relaxed);
            return;
        }
    }
}

/// Records the standby `me`'s position `seq`; a failure is logged (the next
/// record tries again).
async fn record(positions: &Positions, subcluster: &SubclusterId, me: &ProducerId, seq: u64) {
    let recorded = positions
        .record(subcluster, ReaderKind::Standby, me.as_str(), seq)
        .await;
    if let Err(error) = recorded {
        tracing::debug!(%error, "recording the standby's position");
    }
}

/// [`record`]s `seq` every [`STANDBY_RECORD_EVERY`] until aborted.
async fn record_every(positions: Positions, subcluster: SubclusterId, me: ProducerId, seq: u64) {
    loop {
        tokio::time::sleep(STANDBY_RECORD_EVERY).await;
        record(&positions, &subcluster, &me, seq).await;
    }
}

impl Drop for StandbySnapshots {
    fn drop(&mut self) {
        if let Some(task) = self.recording.take() {
            task.abort();
        }
    }
}
