//! The one stream follower: reads one sub-cluster's stream in bounded batches from
//! a [`FoldTarget`]'s position on, decodes outside the target's lock, folds, and
//! resynchronizes (the target forgets the stream and it is re-read) when the
//! stream has a gap, was reset, deleted and re-created (its creation time
//! changed), purged past the position, or holds a message that does not decode.
//! Nothing is silently skipped: every resync is logged and reported to the target,
//! and a message still undecodable after one re-read (or once too many messages
//! were found undecodable) is skipped with an error log. When the history before
//! the stream's first sequence was purged, the sub-master's newest snapshot that
//! covers it seeds the target instead.
//!
//! The global master's projection and the inter-DC master's diff both follow
//! streams through it; they differ only in their [`FoldTarget`].

mod target;

use std::collections::BTreeSet;
use std::time::Duration;

use async_nats::jetstream;
use futures::StreamExt as _;

use crate::event_log::{
    EventLog as _, JetStreamLog, LogBounds, LogEntry, LogError, LogErrorKind, ReadOptions,
};
use crate::SnapshotStore;
use hkvm_events::id::{ClusterId, SubclusterId};
use hkvm_events::limits::Limits;
use hkvm_events::subject::{event_subject, stream_name};

pub use target::{FoldTarget, OutOfOrder, ResyncReason, Seed, StoredMessage};

/// How a follower reads. Fill what you need and take the rest from `Default`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FollowConfig {
    /// Most messages fetched in one batch of an in-memory log (a JetStream read
    /// is bounded by bytes alone: see [`ReadOptions::batch_messages`]).
    pub batch_messages: usize,
    /// Most bytes fetched in one batch.
    pub batch_bytes: usize,
    /// Most messages handed to [`FoldTarget::apply`] at once.
    pub chunk_messages: usize,
    /// How long a read may be idle before the stream's identity is checked again.
    pub idle_check: Duration,
    /// Pause before reopening a read after a transient failure.
    pub retry: Duration,
    /// After this many undecodable messages in one stream, further ones are skipped
    /// without a resync (each resync re-reads the stream).
    pub max_corrupt_resyncs: usize,
    /// Bounds every decoded message is checked against.
    pub limits: Limits,
    /// A target this many messages or more behind the sub-master's newest
    /// snapshot is seeded from it instead of reading all of them (a target with
    /// nothing folded always is, when a snapshot exists).
    pub seed_when_behind: u64,
    /// Once caught up, how long a read lets new messages gather after the first
    /// before fetching them ([`ReadOptions::linger`]): the follower is at most
    /// this far behind while the stream is busy, and the server delivers one
    /// burst per linger instead of one message per append.
    pub linger: Duration,
}

/// The default [`FollowConfig::linger`]: against one client putting 4 KiB
/// objects one at a time, following without it cost the NATS server about 70 us
/// and the global master about 40 us of CPU per put, and slowed the puts by a
/// fifth (`hkvm bench mooncake`).
pub const DEFAULT_LINGER: Duration = Duration::from_millis(5);

impl Default for FollowConfig {
    fn default() -> Self {
        Self {
            batch_messages: 1024,
            batch_bytes: 8 << 20,
            chunk_messages: 64,
            idle_check: Duration::from_secs(1),
            retry: Duration::from_millis(500),
            max_corrupt_resyncs: 64,
            limits: Limits::default(),
            seed_when_behind: 100_000,
            linger: DEFAULT_LINGER,
        }
    }
}

/// Why a read loop ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// Start over from the target's current position (transient failure).
    Reopen,
    /// Forget the stream's content and re-read it from its start.
    Resync(ResyncReason),
}

/// Follows one sub-cluster's stream into a [`FoldTarget`].
#[derive(Debug)]
pub struct Follower<T> {
    js: jetstream::Context,
    cluster: ClusterId,
    subcluster: SubclusterId,
    log: JetStreamLog,
    target: T,
    config: FollowConfig,
    /// The stream's creation time as last seen (0 = not known yet).
    epoch: u64,
    /// Sequences of messages found undecodable: each causes one resync; after it
    /// the message is skipped, so several bad messages cannot make the follower
    /// resync forever.
    known_corrupt: BTreeSet<u64>,
}

impl<T: FoldTarget> Follower<T> {
    /// A follower of `subcluster`'s stream in `cluster`, folding into `target`.
    pub fn new(
        js: jetstream::Context,
        cluster: ClusterId,
        subcluster: SubclusterId,
        target: T,
        config: FollowConfig,
    ) -> Self {
        let log = JetStreamLog::new(
            js.clone(),
            stream_name(&cluster, &subcluster),
            event_subject(&cluster, &subcluster),
        );
        let epoch = target.stream_epoch();
        Self {
            js,
            cluster,
            subcluster,
            log,
            target,
            config,
            epoch,
            known_corrupt: BTreeSet::new(),
        }
    }

    /// The target.
    pub fn target(&self) -> &T {
        &self.target
    }

    /// Follows the stream until the task is aborted.
    pub async fn run(mut self) {
        loop {
            self.step().await;
        }
    }

    /// One read loop and what follows it (a pause or a resync); returns when the
    /// read ended. [`Follower::run`] calls it forever; tests call it directly.
    pub async fn step(&mut self) {
        match self.read_once().await {
            Outcome::Reopen => tokio::time::sleep(self.config.retry).await,
            Outcome::Resync(reason) => self.resync(reason),
        }
    }

    fn resync(&mut self, reason: ResyncReason) {
        tracing::warn!(
            subcluster = %self.subcluster,
            reason = reason.as_str(),
            "re-reading the sub-cluster's stream from its start"
        );
        if matches!(
            reason,
            ResyncReason::StreamDeleted | ResyncReason::StreamReset
        ) {
            // A new stream: the old stream's bad sequences mean nothing there.
            self.known_corrupt.clear();
        }
        // The target forgets the stream's identity with its content; the next read
        // records it again.
        self.epoch = 0;
        self.target.reset(reason);
    }

    async fn read_once(&mut self) -> Outcome {
        let (bounds, epoch) = match self.log.bounds_and_epoch().await {
            Ok(state) => state,
            Err(error) if *error.kind() == LogErrorKind::StreamNotFound => {
                // Nothing to catch up with; keep what is known until it appears.
                self.target.caught_up();
                if self.target.applied_seq() > 0 {
                    return Outcome::Resync(ResyncReason::StreamDeleted);
                }
                tracing::debug!(subcluster = %self.subcluster, "stream not found yet");
                return Outcome::Reopen;
            }
            Err(error) => {
                tracing::warn!(subcluster = %self.subcluster, %error, "reading stream bounds");
                return Outcome::Reopen;
            }
        };
        let applied = self.target.applied_seq();
        if bounds.last_seq < applied || (self.epoch != 0 && self.epoch != epoch) {
            return Outcome::Resync(ResyncReason::StreamReset);
        }
        if self.epoch != epoch {
            self.epoch = epoch;
            self.target.set_stream_epoch(epoch);
        }
        if applied + 1 < bounds.first_seq {
            if applied > 0 {
                return Outcome::Resync(ResyncReason::PurgedPastPosition);
            }
            if !self.seed_from_snapshot(bounds).await {
                tracing::warn!(
                    subcluster = %self.subcluster,
                    first_seq = bounds.first_seq,
                    "the stream's history before its first sequence was purged and no \
                     sub-master snapshot covers it: keys stored before it are not known"
                );
            }
        } else if self.snapshot_saves_a_replay(applied, bounds).await {
            // Loading what the snapshot holds beats re-reading the history it covers.
            self.seed_from_snapshot(bounds).await;
        }
        let applied = self.target.applied_seq();
        let target = bounds.last_seq;
        self.target.observe_last_seq(target);
        if applied >= target {
            self.target.caught_up();
        }
        let options = ReadOptions {
            from_seq: (applied + 1).max(bounds.first_seq),
            until_seq: None,
            follow: true,
            batch_messages: self.config.batch_messages.max(1),
            batch_bytes: self.config.batch_bytes.max(1),
            linger: self.config.linger,
        };
        let entries = match self.log.read(options).await {
            Ok(entries) => entries,
            Err(error) => {
                return match error.kind() {
                    LogErrorKind::Truncated { .. } => Outcome::Resync(ResyncReason::Purged),
                    _ => {
                        tracing::warn!(subcluster = %self.subcluster, %error, "opening a read");
                        Outcome::Reopen
                    }
                };
            }
        };
        let mut chunks = entries.ready_chunks(self.config.chunk_messages.max(1));
        loop {
            match tokio::time::timeout(self.config.idle_check, chunks.next()).await {
                Ok(Some(chunk)) => {
                    if let Some(outcome) = self.fold_chunk(chunk, target) {
                        return outcome;
                    }
                }
                Ok(None) => return Outcome::Reopen,
                // Idle: a stream deleted or re-created meanwhile would only show up
                // as a missed heartbeat much later, so look now.
                Err(_) => match self.log.bounds_and_epoch().await {
                    Ok((now, same))
                        if same == self.epoch && now.last_seq >= self.target.applied_seq() => {}
                    Ok(_) => return Outcome::Reopen,
                    Err(error) if *error.kind() == LogErrorKind::StreamNotFound => {
                        return Outcome::Reopen
                    }
                    Err(_) => {}
                },
            }
        }
    }

    /// Whether a target at `applied` is far enough behind the newest snapshot (as
    /// its name says; nothing is loaded) that seeding from it saves a replay: it
    /// has nothing folded, or is [`FollowConfig::seed_when_behind`] messages
    /// behind.
    async fn snapshot_saves_a_replay(&self, applied: u64, bounds: LogBounds) -> bool {
        let behind = bounds.last_seq.saturating_sub(applied);
        if behind == 0 || (applied > 0 && behind < self.config.seed_when_behind) {
            return false;
        }
        let newest = match SnapshotStore::open(&self.js, &self.cluster, &self.subcluster, 1).await {
            Ok(store) => store.newest_covered_seq().await.ok().flatten(),
            Err(_) => None,
        };
        newest.is_some_and(|covers| {
            covers <= bounds.last_seq
                && covers > applied
                && (applied == 0 || covers - applied >= self.config.seed_when_behind)
        })
    }

    /// Seeds the target from the sub-master's newest snapshot when it reaches the
    /// stream's first sequence (and not past its last one: a snapshot of an older
    /// stream of the same name). Returns whether it did.
    async fn seed_from_snapshot(&mut self, bounds: LogBounds) -> bool {
        let loaded = match SnapshotStore::open(&self.js, &self.cluster, &self.subcluster, 1).await {
            Ok(store) => store.load_newest().await,
            Err(error) => Err(error),
        };
        let (name, file) = match loaded {
            Ok(Some((name, file)))
                if file.covers_seq + 1 >= bounds.first_seq
                    && file.covers_seq <= bounds.last_seq =>
            {
                (name, file)
            }
            Ok(_) => return false,
            Err(error) => {
                tracing::warn!(subcluster = %self.subcluster, %error, "loading a sub-master snapshot");
                return false;
            }
        };
        let first_unix_ms = self.stored_unix_ms(bounds.first_seq).await;
        tracing::info!(
            subcluster = %self.subcluster,
            snapshot = name,
            covers_seq = file.covers_seq,
            objects = file.objects.len(),
            "seeding from the sub-master's snapshot"
        );
        self.target.seed(Seed {
            snapshot: &file,
            first_unix_ms,
        });
        // Seeding replaces what the target knew of the stream, its identity too.
        self.target.set_stream_epoch(self.epoch);
        true
    }

    /// When the message at `seq` was stored, if it can be read.
    async fn stored_unix_ms(&self, seq: u64) -> Option<u64> {
        let options = ReadOptions {
            from_seq: seq,
            until_seq: Some(seq),
            ..ReadOptions::default()
        };
        let mut entries = self.log.read(options).await.ok()?;
        entries.next().await?.ok().map(|entry| entry.unix_ms)
    }

    /// Decodes and folds a chunk of read results; `Some` ends the read.
    fn fold_chunk(
        &mut self,
        chunk: Vec<Result<LogEntry, LogError>>,
        target: u64,
    ) -> Option<Outcome> {
        let mut end = None;
        let mut decoded: Vec<T::Message> = Vec::with_capacity(chunk.len());
        let mut last_seen = 0;
        for item in chunk {
            let entry = match item {
                Ok(entry) => entry,
                Err(error) => {
                    end = Some(self.read_failure(&error));
                    break;
                }
            };
            last_seen = entry.seq;
            match <T::Message as StoredMessage>::decode(
                entry.seq,
                entry.unix_ms,
                &entry.payload,
                &self.config.limits,
            ) {
                Ok(message) => decoded.push(message),
                Err(error) => {
                    // Fold what decoded before it, then deal with it.
                    if let Some(outcome) = self.apply(std::mem::take(&mut decoded)) {
                        return Some(outcome);
                    }
                    let seen = self.known_corrupt.contains(&entry.seq)
                        || self.known_corrupt.len() >= self.config.max_corrupt_resyncs;
                    if seen {
                        tracing::error!(
                            subcluster = %self.subcluster,
                            error = %error,
                            cause = %error.cause,
                            "message still undecodable after a re-read: skipping it"
                        );
                        self.target.skip(entry.seq, entry.unix_ms);
                    } else {
                        tracing::warn!(
                            subcluster = %self.subcluster,
                            error = %error,
                            cause = %error.cause,
                            "undecodable message"
                        );
                        self.known_corrupt.insert(entry.seq);
                        return Some(Outcome::Resync(ResyncReason::Undecodable));
                    }
                }
            }
        }
        if let Some(outcome) = self.apply(decoded) {
            return Some(outcome);
        }
        if last_seen > 0 {
            self.target.observe_last_seq(last_seen);
        }
        if self.target.applied_seq() >= target {
            self.target.caught_up();
        }
        end
    }

    fn apply(&mut self, decoded: Vec<T::Message>) -> Option<Outcome> {
        if decoded.is_empty() {
            return None;
        }
        match self.target.apply(decoded) {
            Ok(()) => None,
            Err(error) => {
                tracing::warn!(subcluster = %self.subcluster, %error, "out of order");
                Some(Outcome::Resync(ResyncReason::SequenceGap))
            }
        }
    }

    fn read_failure(&self, error: &LogError) -> Outcome {
        match error.kind() {
            LogErrorKind::Gap { .. } => Outcome::Resync(ResyncReason::SequenceGap),
            LogErrorKind::Truncated { .. } => Outcome::Resync(ResyncReason::Purged),
            LogErrorKind::StreamNotFound => Outcome::Resync(ResyncReason::StreamDeleted),
            _ => {
                tracing::warn!(subcluster = %self.subcluster, %error, "read failed");
                Outcome::Reopen
            }
        }
    }
}
