//! Following one sub-cluster's stream: read bounded batches from the projection's
//! position on, fold them in, and resynchronize (forget the source and re-read it)
//! when the stream has a gap, was reset or purged past the position, vanished, or
//! holds a message that does not decode. Nothing is silently skipped: every resync
//! is logged and counted, and a message that is still undecodable after a resync
//! is skipped with an error log and counted as such. When the history before the
//! stream's first sequence was purged, the sub-master's newest snapshot covering it
//! seeds the source instead.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use futures::StreamExt as _;
use hkvm_events::log::{EventLog, JetStreamLog, LogBounds, LogError, LogErrorKind, ReadOptions};
use hkvm_events::subject::{event_subject, stream_name};
use hkvm_events::SubclusterId;
use hkvm_events::{key_hash, Limits};
use hkvm_projector::{decode, ProjectorErrorKind};
use hkvm_submaster::snapshot::SnapshotStore;

use crate::metrics::source_label;
use crate::state::Shared;

/// Why a read loop ended.
enum Outcome {
    /// Start over from the source's current position (transient failure).
    Reopen,
    /// Forget the source and re-read it from the start of the stream.
    Resync(&'static str),
}

/// Messages folded under one write lock.
const CHUNK: usize = 64;
/// How long a read may be idle before the stream's identity is checked again.
const IDLE_CHECK: Duration = Duration::from_secs(1);
/// Pause before reopening after a transient failure.
const RETRY: Duration = Duration::from_millis(500);

/// After this many undecodable messages in one stream, further ones are skipped
/// without a resync (each resync re-reads the stream).
const MAX_RESYNCS_FOR_CORRUPTION: usize = 64;

struct Follower {
    shared: Arc<Shared>,
    js: jetstream::Context,
    log: JetStreamLog,
    subcluster: SubclusterId,
    source: usize,
    /// Sequences of messages found undecodable: each causes one resync; after it the
    /// message is skipped (counted and logged), so several bad messages cannot make
    /// the follower resync forever.
    known_corrupt: BTreeSet<u64>,
}

/// Follows `subcluster`'s stream until the task is aborted.
pub(crate) async fn follow(
    shared: Arc<Shared>,
    js: jetstream::Context,
    subcluster: SubclusterId,
    source: usize,
) {
    let cluster = shared.config.cluster.clone();
    let log = JetStreamLog::new(
        js.clone(),
        stream_name(&cluster, &subcluster),
        event_subject(&cluster, &subcluster),
    );
    let mut follower = Follower {
        shared,
        js,
        log,
        subcluster,
        source,
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
            .read()
            .source(self.source)
            .map_or(0, |s| s.applied_seq)
    }

    fn resync(&mut self, reason: &'static str) {
        tracing::warn!(
            subcluster = %self.subcluster,
            reason,
            "re-reading the sub-cluster's stream from its start"
        );
        if matches!(reason, "stream deleted" | "stream reset") {
            // A new stream: the old stream's bad sequences mean nothing there.
            self.known_corrupt.clear();
        }
        self.shared.write().reset_source(self.source);
        self.shared
            .positions()
            .entry(self.source)
            .or_default()
            .resyncs += 1;
        let mut labels = source_label(self.subcluster.as_str());
        labels.push(("reason".to_owned(), reason.to_owned()));
        self.shared.metrics.resyncs.get_or_create(&labels).inc();
    }

    /// The stream's bounds and identity (creation time, Unix ns).
    async fn stream_state(&self) -> Result<(LogBounds, u64), LogError> {
        let bounds = self.log.bounds().await?;
        let name = self.log.stream_name();
        let mut stream = self
            .js
            .get_stream(name)
            .await
            .map_err(|e| LogError::other(name, e))?;
        let info = stream.info().await.map_err(|e| LogError::other(name, e))?;
        let epoch = u64::try_from(info.created.unix_timestamp_nanos()).unwrap_or_default();
        Ok((bounds, epoch))
    }

    /// Loads the sub-master's newest snapshot into the projection when it reaches
    /// the stream's first sequence (history before it was purged). Returns whether
    /// it did.
    async fn seed_from_snapshot(&self, first_seq: u64, epoch: u64) -> bool {
        let cluster = &self.shared.config.cluster;
        let loaded = match SnapshotStore::open(&self.js, cluster, &self.subcluster, 1).await {
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
        let mut projection = self.shared.write();
        projection.seed_source(
            self.source,
            state.applied_seq,
            state.objects().map(|(key, _)| key_hash(key)),
            state.segments().map(|(_, segment)| {
                (
                    segment.id.clone(),
                    segment.node.clone(),
                    segment.allocator.size(),
                )
            }),
        );
        projection.set_stream_epoch(self.source, epoch);
        tracing::info!(
            subcluster = %self.subcluster,
            covers_seq = state.applied_seq,
            objects = state.object_count(),
            "seeded from the sub-master's snapshot"
        );
        true
    }

    async fn run_once(&mut self) -> Outcome {
        let (bounds, epoch) = match self.stream_state().await {
            Ok(state) => state,
            Err(error) if *error.kind() == LogErrorKind::StreamNotFound => {
                // Nothing to catch up with; keep what is known until it appears.
                self.shared.mark_caught_up(self.source);
                if self.applied_seq() > 0 {
                    return Outcome::Resync("stream deleted");
                }
                tracing::debug!(subcluster = %self.subcluster, "stream not found yet");
                return Outcome::Reopen;
            }
            Err(error) => {
                tracing::warn!(subcluster = %self.subcluster, %error, "reading stream bounds");
                return Outcome::Reopen;
            }
        };
        let (applied, known_epoch) = {
            let projection = self.shared.read();
            let state = projection.source(self.source);
            (
                state.map_or(0, |s| s.applied_seq),
                state.map_or(0, |s| s.stream_epoch),
            )
        };
        if bounds.last_seq < applied || (known_epoch != 0 && known_epoch != epoch) {
            return Outcome::Resync("stream reset");
        }
        if known_epoch != epoch {
            self.shared.write().set_stream_epoch(self.source, epoch);
        }
        let mut applied = applied;
        if applied + 1 < bounds.first_seq {
            if applied > 0 {
                return Outcome::Resync("stream purged past the position");
            }
            if self.seed_from_snapshot(bounds.first_seq, epoch).await {
                applied = self.applied_seq();
            } else {
                tracing::warn!(
                    subcluster = %self.subcluster,
                    first_seq = bounds.first_seq,
                    "the stream's history before its first sequence was purged and no \
                     sub-master snapshot covers it: keys stored before it are not projected"
                );
            }
        }
        let target = bounds.last_seq;
        self.shared
            .observe_last_seq(self.source, &self.subcluster, target);
        if applied >= target {
            self.shared.mark_caught_up(self.source);
        }
        let from = (applied + 1).max(bounds.first_seq);
        let options = ReadOptions {
            from_seq: from,
            until_seq: None,
            follow: true,
            batch_messages: self.shared.config.read_batch_messages.max(1),
            batch_bytes: self.shared.config.read_batch_bytes.max(1),
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
                }
            }
        };
        let mut chunks = entries.ready_chunks(CHUNK);
        loop {
            match tokio::time::timeout(IDLE_CHECK, chunks.next()).await {
                Ok(Some(chunk)) => {
                    if let Some(outcome) = self.fold_chunk(chunk, target) {
                        return outcome;
                    }
                }
                Ok(None) => return Outcome::Reopen,
                // Idle: a stream deleted or re-created meanwhile would only show
                // up as a missed heartbeat much later, so look now.
                Err(_) => match self.stream_state().await {
                    Ok((now, same)) if same == epoch && now.last_seq >= self.applied_seq() => {}
                    Ok(_) => return Outcome::Reopen,
                    Err(error) if *error.kind() == LogErrorKind::StreamNotFound => {
                        return Outcome::Reopen
                    }
                    Err(_) => {}
                },
            }
        }
    }

    /// Folds a chunk of read results; `Some` ends the read.
    fn fold_chunk(
        &mut self,
        chunk: Vec<Result<hkvm_events::log::LogEntry, hkvm_events::log::LogError>>,
        target: u64,
    ) -> Option<Outcome> {
        let labels = source_label(self.subcluster.as_str());
        let mut end = None;
        let mut last_seen = 0;
        // Decode before taking the lock, so followers of other streams can decode
        // in parallel while one folds.
        let limits = Limits::default();
        let mut decoded = Vec::with_capacity(chunk.len());
        for item in chunk {
            match item {
                Ok(entry) => {
                    last_seen = entry.seq;
                    decoded.push(decode(entry.seq, entry.unix_ms, &entry.payload, &limits));
                }
                Err(error) => {
                    end = Some(match error.kind() {
                        LogErrorKind::Gap { .. } => Outcome::Resync("sequence gap"),
                        LogErrorKind::Truncated { .. } => Outcome::Resync("stream purged"),
                        LogErrorKind::StreamNotFound => Outcome::Resync("stream deleted"),
                        _ => {
                            tracing::warn!(subcluster = %self.subcluster, %error, "read failed");
                            Outcome::Reopen
                        }
                    });
                    break;
                }
            }
        }
        let mut events = 0u64;
        let mut messages = 0u64;
        for message in decoded {
            // The lock is taken per message, so queries wait at most one message's
            // fold, not a whole chunk's.
            let mut projection = self.shared.write();
            let result = message.and_then(|m| projection.apply_decoded(self.source, m));
            match result {
                Ok(applied) => {
                    events += applied.events as u64;
                    messages += 1;
                }
                Err(error) => match error.kind() {
                    ProjectorErrorKind::Undecodable { seq, .. }
                        if self.known_corrupt.contains(seq)
                            || self.known_corrupt.len() >= MAX_RESYNCS_FOR_CORRUPTION =>
                    {
                        tracing::error!(
                            subcluster = %self.subcluster,
                            %error,
                            "message still undecodable after a resync: skipping it"
                        );
                        projection.set_applied_seq(self.source, *seq);
                        let mut skipped = labels.clone();
                        skipped.push(("reason".to_owned(), "corrupt message skipped".to_owned()));
                        self.shared.metrics.resyncs.get_or_create(&skipped).inc();
                    }
                    ProjectorErrorKind::Undecodable { seq, .. } => {
                        tracing::warn!(subcluster = %self.subcluster, %error, "undecodable message");
                        self.known_corrupt.insert(*seq);
                        end = Some(Outcome::Resync("undecodable message"));
                        break;
                    }
                    _ => {
                        end = Some(Outcome::Resync("sequence gap"));
                        break;
                    }
                },
            }
        }
        let applied = self.applied_seq();
        self.shared
            .metrics
            .events_applied
            .get_or_create(&labels)
            .inc_by(events);
        self.shared
            .metrics
            .messages_applied
            .get_or_create(&labels)
            .inc_by(messages);
        self.shared
            .observe_last_seq(self.source, &self.subcluster, last_seen);
        if applied >= target {
            self.shared.mark_caught_up(self.source);
        }
        end
    }
}
