//! Following both pools: a registry watcher per pool starts one stream follower per
//! sub-master (on the source side only those the policy's labels allow) and keeps
//! each sub-cluster's labels and fill current; a stream follower folds its
//! sub-cluster's events into the shared [`Diff`](crate::diff::Diff) in bounded
//! batches, and re-reads the stream from its start when it has a gap, was reset or
//! purged past the position, or holds a message that does not decode (a message
//! still undecodable after that is skipped, logged and counted). When the history
//! before the stream's first sequence was purged, the sub-master's newest snapshot
//! covering it seeds the slot.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use futures::StreamExt as _;
use hkvm_events::log::{EventLog, JetStreamLog, LogEntry, LogError, LogErrorKind, ReadOptions};
use hkvm_events::registry::now_unix_ms;
use hkvm_events::registry::{list, open_registry};
use hkvm_events::subject::{event_subject, stream_name};
use hkvm_events::{key_hash, ClusterId, Limits, SubclusterId};
use hkvm_projector::decode;
use hkvm_submaster::snapshot::SnapshotStore;

use crate::diff::{Side, SourceBlock};
use crate::metrics::label;
use crate::policy::Policy;
use crate::shared::{Shared, SubclusterInfo};

/// How often the registry is listed.
const REGISTRY_POLL: Duration = Duration::from_secs(1);
/// Messages folded under one lock.
const CHUNK: usize = 64;
/// How long a read may be idle before the stream's bounds are checked again.
const IDLE_CHECK: Duration = Duration::from_secs(1);
/// Pause before reopening after a transient failure.
const RETRY: Duration = Duration::from_millis(500);

/// One pool as seen from the replicator.
#[derive(Debug, Clone)]
pub(crate) struct Pool {
    /// Which side it is.
    pub side: Side,
    /// Its cluster id.
    pub cluster: ClusterId,
    /// JetStream of its NATS.
    pub js: jetstream::Context,
    /// The registry liveness TTL.
    pub registry_ttl: Duration,
}

/// Lists the pool's registry once and starts followers for sub-masters not yet
/// followed. Returns how many it started.
pub(crate) async fn discover(shared: &Arc<Shared>, pool: &Pool) -> usize {
    let store = match open_registry(&pool.js, &pool.cluster).await {
        Ok(store) => store,
        Err(error) => {
            tracing::debug!(side = pool.side.name(), %error, "no registry yet");
            return 0;
        }
    };
    let entries = match list(&store, pool.registry_ttl).await {
        Ok(entries) => entries,
        Err(error) => {
            tracing::warn!(side = pool.side.name(), %error, "listing the registry");
            return 0;
        }
    };
    let mut started = 0;
    for entry in entries {
        let info = &entry.info;
        let allowed = match pool.side {
            Side::Source => Policy::labels_match(&shared.policy.source_labels, &info.labels),
            Side::Target => true,
        };
        let fill = if info.capacity_bytes > 0 {
            info.used_bytes as f64 / info.capacity_bytes as f64
        } else {
            0.0
        };
        shared.topology(pool.side).insert(
            info.subcluster.clone(),
            SubclusterInfo {
                labels: info.labels.clone(),
                capacity_bytes: info.capacity_bytes,
                used_bytes: info.used_bytes,
                alive: entry.alive,
                followed: allowed,
            },
        );
        if !allowed {
            continue;
        }
        let (slot, new) = {
            let mut diff = shared.diff();
            let new = diff.find_slot(pool.side, &info.subcluster).is_none();
            let slot = diff.slot(pool.side, &info.subcluster);
            diff.set_fill(slot, fill);
            (slot, new)
        };
        if new {
            shared.catching_up().insert(slot);
            tracing::info!(side = pool.side.name(), subcluster = %info.subcluster, slot, "following");
            let task = tokio::spawn(follow_stream(
                Arc::clone(shared),
                pool.clone(),
                info.subcluster.clone(),
                slot,
            ));
            shared.keep(task);
            started += 1;
        }
    }
    started
}

/// Re-lists the pool's registry every second, until the task is aborted.
pub(crate) async fn watch_pool(shared: Arc<Shared>, pool: Pool) {
    loop {
        tokio::time::sleep(REGISTRY_POLL).await;
        discover(&shared, &pool).await;
    }
}

/// Why a read loop ended.
enum Outcome {
    /// Start over from the current position (transient failure).
    Reopen,
    /// Forget the slot and re-read the stream from its start.
    Resync(&'static str),
}

struct Follower {
    shared: Arc<Shared>,
    js: jetstream::Context,
    cluster: ClusterId,
    side: Side,
    subcluster: SubclusterId,
    slot: usize,
    log: JetStreamLog,
    known_corrupt: BTreeSet<u64>,
}

async fn follow_stream(shared: Arc<Shared>, pool: Pool, subcluster: SubclusterId, slot: usize) {
    let log = JetStreamLog::new(
        pool.js.clone(),
        stream_name(&pool.cluster, &subcluster),
        event_subject(&pool.cluster, &subcluster),
    );
    let mut follower = Follower {
        shared,
        js: pool.js.clone(),
        cluster: pool.cluster.clone(),
        side: pool.side,
        subcluster,
        slot,
        log,
        known_corrupt: BTreeSet::new(),
    };
    loop {
        match follower.run_once().await {
            Outcome::Reopen => tokio::time::sleep(RETRY).await,
            Outcome::Resync(reason) => follower.resync(reason),
        }
    }
}

impl Follower {
    fn applied_seq(&self) -> u64 {
        self.shared
            .diff()
            .slots()
            .get(self.slot)
            .map_or(0, |s| s.applied_seq)
    }

    fn caught_up(&self) {
        self.shared.catching_up().remove(&self.slot);
    }

    fn resync(&mut self, reason: &'static str) {
        tracing::warn!(
            side = self.side.name(),
            subcluster = %self.subcluster,
            reason,
            "re-reading the sub-cluster's stream from its start"
        );
        if reason == "stream reset" {
            self.known_corrupt.clear();
        }
        self.shared.diff().reset_slot(self.slot);
        self.shared
            .metrics
            .resyncs
            .get_or_create(&label("side", self.side.name()))
            .inc();
    }

    async fn run_once(&mut self) -> Outcome {
        let bounds = match self.log.bounds().await {
            Ok(bounds) => bounds,
            Err(error) if *error.kind() == LogErrorKind::StreamNotFound => {
                // Registered but nothing appended yet: nothing to catch up with.
                self.caught_up();
                return Outcome::Reopen;
            }
            Err(error) => {
                tracing::warn!(subcluster = %self.subcluster, %error, "reading stream bounds");
                return Outcome::Reopen;
            }
        };
        let mut applied = self.applied_seq();
        if bounds.last_seq < applied {
            return Outcome::Resync("stream reset");
        }
        if applied + 1 < bounds.first_seq {
            if applied > 0 {
                return Outcome::Resync("stream purged past the position");
            }
            if self.seed_from_snapshot(bounds.first_seq).await {
                applied = self.applied_seq();
            } else {
                tracing::warn!(
                    side = self.side.name(),
                    subcluster = %self.subcluster,
                    first_seq = bounds.first_seq,
                    "the stream's history before its first sequence was purged and no \
                     sub-master snapshot covers it: blocks stored before it are not known"
                );
            }
        }
        let target = bounds.last_seq;
        if applied >= target {
            self.caught_up();
        }
        let options = ReadOptions {
            from_seq: (applied + 1).max(bounds.first_seq),
            until_seq: None,
            follow: true,
            batch_messages: 1024,
            batch_bytes: 8 << 20,
        };
        let entries = match self.log.read(options).await {
            Ok(entries) => entries,
            Err(error) => {
                return match error.kind() {
                    LogErrorKind::Truncated { .. } => Outcome::Resync("stream purged"),
                    _ => {
                        tracing::warn!(subcluster = %self.subcluster, %error, "opening a read");
                        Outcome::Reopen
                    }
                };
            }
        };
        let mut chunks = entries.ready_chunks(CHUNK);
        loop {
            match tokio::time::timeout(IDLE_CHECK, chunks.next()).await {
                Ok(Some(chunk)) => {
                    if let Some(outcome) = self.fold_chunk(chunk) {
                        return outcome;
                    }
                    if self.applied_seq() >= target {
                        self.caught_up();
                    }
                }
                Ok(None) => return Outcome::Reopen,
                Err(_) => match self.log.bounds().await {
                    Ok(now) if now.last_seq >= self.applied_seq() => {}
                    Ok(_) => return Outcome::Reopen,
                    Err(error) if *error.kind() == LogErrorKind::StreamNotFound => {
                        return Outcome::Reopen
                    }
                    Err(_) => {}
                },
            }
        }
    }

    /// Seeds the slot from the sub-master's newest snapshot when it reaches the
    /// stream's first sequence (the history before it was purged). The snapshot
    /// has no commit times: its blocks are dated by the first message left in the
    /// stream (they are at least that old). Returns whether it seeded.
    async fn seed_from_snapshot(&self, first_seq: u64) -> bool {
        let loaded = match SnapshotStore::open(&self.js, &self.cluster, &self.subcluster, 1).await {
            Ok(store) => store.load_newest().await,
            Err(error) => Err(error),
        };
        let state = match loaded {
            Ok(Some(state)) if state.applied_seq + 1 >= first_seq => state,
            Ok(_) => return false,
            Err(error) => {
                tracing::warn!(subcluster = %self.subcluster, %error, "loading a sub-master snapshot");
                return false;
            }
        };
        let dated = self
            .first_message_unix_ms(first_seq)
            .await
            .unwrap_or_else(now_unix_ms);
        let objects = state.objects().map(|(key, object)| {
            (
                key_hash(key),
                SourceBlock {
                    key: key.to_owned(),
                    size: object.size,
                    checksum: object.checksum,
                    committed_unix_ms: dated,
                },
            )
        });
        self.shared
            .diff()
            .seed_slot(self.slot, state.applied_seq, dated, objects);
        tracing::info!(
            side = self.side.name(),
            subcluster = %self.subcluster,
            covers_seq = state.applied_seq,
            objects = state.object_count(),
            "seeded from the sub-master's snapshot"
        );
        true
    }

    async fn first_message_unix_ms(&self, seq: u64) -> Option<u64> {
        let options = ReadOptions {
            from_seq: seq,
            until_seq: Some(seq),
            ..ReadOptions::default()
        };
        let mut entries = self.log.read(options).await.ok()?;
        entries.next().await?.ok().map(|entry| entry.unix_ms)
    }

    fn fold_chunk(&mut self, chunk: Vec<Result<LogEntry, LogError>>) -> Option<Outcome> {
        let limits = Limits::default();
        let mut events = 0u64;
        for item in chunk {
            let entry = match item {
                Ok(entry) => entry,
                Err(error) => {
                    return Some(match error.kind() {
                        LogErrorKind::Gap { .. } => Outcome::Resync("sequence gap"),
                        LogErrorKind::Truncated { .. } => Outcome::Resync("stream purged"),
                        LogErrorKind::StreamNotFound => Outcome::Resync("stream reset"),
                        _ => {
                            tracing::warn!(subcluster = %self.subcluster, %error, "read failed");
                            Outcome::Reopen
                        }
                    });
                }
            };
            match decode(entry.seq, entry.unix_ms, &entry.payload, &limits) {
                Ok(decoded) => {
                    events += decoded.events.len() as u64;
                    if let Err(error) = self.shared.diff().apply_decoded(self.slot, &decoded) {
                        tracing::warn!(subcluster = %self.subcluster, %error, "out of order");
                        return Some(Outcome::Resync("sequence gap"));
                    }
                }
                Err(error) if self.known_corrupt.contains(&entry.seq) => {
                    tracing::error!(
                        side = self.side.name(),
                        subcluster = %self.subcluster,
                        %error,
                        "message still undecodable after a re-read: skipping it"
                    );
                    self.shared
                        .diff()
                        .set_applied(self.slot, entry.seq, entry.unix_ms);
                }
                Err(error) => {
                    tracing::warn!(subcluster = %self.subcluster, %error, "undecodable message");
                    self.known_corrupt.insert(entry.seq);
                    return Some(Outcome::Resync("undecodable message"));
                }
            }
        }
        self.shared
            .metrics
            .events_applied
            .get_or_create(&label("side", self.side.name()))
            .inc_by(events);
        None
    }
}
