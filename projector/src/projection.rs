//! The projection: every source sub-cluster's position in its stream, its segments,
//! and the shared [`KeyIndex`]. [`Projection::apply`] is the pure fold of one event;
//! [`Projection::apply_message`] decodes one stream message into key operations
//! (keys borrowed, no allocation per put) and folds them.

use std::collections::BTreeMap;

use hkvm_events::codec::Decoded;
use hkvm_events::key_ops::{decode_key_ops, KeyOp, KeyOps};
use hkvm_events::rpc::global::BloomFilter;
use hkvm_events::{key_hash, KvEvent, Limits, NodeId, SegmentId, SubclusterId};

use crate::error::{ProjectorError, ProjectorErrorKind};
use crate::index::{KeyIndex, SourceWriter};

/// How many key operations ahead a lookup's loads are started
/// ([`KeyIndex::prefetch_home`], [`KeyIndex::prefetch_candidate`]).
const PREFETCH_DISTANCE: usize = 8;

/// What the projection knows about one source sub-cluster.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SourceState {
    /// The sub-cluster.
    pub subcluster: Option<SubclusterId>,
    /// The stream it is read from.
    pub stream: String,
    /// The last stream sequence folded in (0: nothing yet).
    pub applied_seq: u64,
    /// When that message was stored, Unix milliseconds.
    pub applied_unix_ms: u64,
    /// The identity of the stream instance read (its creation time, Unix ns): a
    /// stream deleted and created again under the same name has a new one, and
    /// everything read from the old one must be forgotten.
    pub stream_epoch: u64,
    /// Mounted segments: owner and size.
    pub segments: BTreeMap<SegmentId, (NodeId, u64)>,
    /// The newest `Snapshot` marker seen: (covered sequence, object name).
    pub snapshot: Option<(u64, String)>,
    /// Events folded in since the last reset.
    pub events_applied: u64,
    /// Events that did not decode and were skipped (unknown kinds, bad bodies).
    pub events_skipped: u64,
}

impl SourceState {
    /// Bytes mounted in the sub-cluster.
    pub fn capacity_bytes(&self) -> u64 {
        self.segments.values().map(|(_, size)| size).sum()
    }
}

/// The logical content of one source: sub-cluster, applied sequence, segments and
/// sorted key hashes (see [`Projection::content`]).
pub type SourceContent = (Option<SubclusterId>, u64, Vec<SegmentId>, Vec<u64>);

/// What folding one message did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Applied {
    /// Events folded in.
    pub events: usize,
    /// Events skipped (unknown kind or bad body; the rest of the message was used).
    pub skipped: usize,
}

/// The projection of every source.
#[derive(Debug, Clone, Default)]
pub struct Projection {
    pub(crate) sources: Vec<SourceState>,
    pub(crate) index: KeyIndex,
    pub(crate) limits: Limits,
}

impl Projection {
    /// An empty projection.
    pub fn new() -> Self {
        Self::default()
    }

    /// The index of the source for `subcluster`, adding it (at `applied_seq` 0) if
    /// it is new.
    pub fn source_index(&mut self, subcluster: &SubclusterId, stream: &str) -> usize {
        if let Some(found) = self.find_source(subcluster) {
            return found;
        }
        self.sources.push(SourceState {
            subcluster: Some(subcluster.clone()),
            stream: stream.to_owned(),
            ..SourceState::default()
        });
        self.sources.len() - 1
    }

    /// The index of `subcluster`'s source, if known.
    pub fn find_source(&self, subcluster: &SubclusterId) -> Option<usize> {
        self.sources
            .iter()
            .position(|s| s.subcluster.as_ref() == Some(subcluster))
    }

    /// Every source, by index.
    pub fn sources(&self) -> &[SourceState] {
        &self.sources
    }

    /// One source.
    pub fn source(&self, source: usize) -> Option<&SourceState> {
        self.sources.get(source)
    }

    /// The key index.
    pub fn index(&self) -> &KeyIndex {
        &self.index
    }

    fn source_mut(&mut self, source: usize) -> &mut SourceState {
        if self.sources.len() <= source {
            self.sources.resize_with(source + 1, SourceState::default);
        }
        &mut self.sources[source]
    }

    /// `source`'s state (added if new) and a writer of its keys.
    fn source_and_writer(&mut self, source: usize) -> (&mut SourceState, SourceWriter<'_>) {
        self.source_mut(source);
        (&mut self.sources[source], self.index.writer(source))
    }

    /// Folds one event of `source` into the projection. Pure: no I/O, no clock.
    pub fn apply(&mut self, source: usize, event: &KvEvent) {
        let (state, mut writer) = self.source_and_writer(source);
        fold_event(&mut writer, state, event);
        state.events_applied += 1;
    }

    /// Decodes the message stored at `seq` of `source`'s stream into key
    /// operations and folds them: [`decode_key_ops`] then
    /// [`Projection::apply_key_ops`].
    ///
    /// # Errors
    /// [`ProjectorErrorKind::Undecodable`], or as for [`Projection::apply_key_ops`].
    pub fn apply_message(
        &mut self,
        source: usize,
        seq: u64,
        unix_ms: u64,
        payload: &[u8],
    ) -> Result<Applied, ProjectorError> {
        let message = decode_key_ops(seq, unix_ms, payload, &self.limits)
            .map_err(|e| ProjectorError::new(ProjectorErrorKind::Undecodable(e)))?;
        self.apply_key_ops(source, message)
    }

    /// Folds a decoded message of `source` (every event owned): the same as
    /// folding its [`KeyOps`].
    ///
    /// # Errors
    /// As [`Projection::apply_key_ops`].
    pub fn apply_decoded(
        &mut self,
        source: usize,
        decoded: Decoded,
    ) -> Result<Applied, ProjectorError> {
        self.apply_key_ops(source, KeyOps::of(&decoded))
    }

    /// Folds a message of `source` as key operations. Messages at or below the
    /// applied sequence are ignored (replayed after a checkpoint restore).
    ///
    /// # Errors
    /// [`ProjectorErrorKind::OutOfOrder`] when the message skips ahead of the next
    /// expected sequence (the caller resynchronizes).
    pub fn apply_key_ops(
        &mut self,
        source: usize,
        message: KeyOps,
    ) -> Result<Applied, ProjectorError> {
        let applied_seq = self.source_mut(source).applied_seq;
        if message.seq <= applied_seq {
            return Ok(Applied::default());
        }
        if message.seq != applied_seq + 1 && applied_seq != 0 {
            return Err(ProjectorError::new(ProjectorErrorKind::OutOfOrder {
                expected: applied_seq + 1,
                found: message.seq,
            }));
        }
        // Software-pipelined: while operation i is applied, the home slot of
        // operation i + 2d and the candidate hash of operation i + d are already
        // on their way, so the cache misses of a lookup overlap other work.
        let hash_at = |i: usize| match message.ops.get(i) {
            Some(KeyOp::Put(hash) | KeyOp::Drop(hash)) => Some(*hash),
            _ => None,
        };
        for i in 0..(2 * PREFETCH_DISTANCE).min(message.ops.len()) {
            if let Some(hash) = hash_at(i) {
                self.index.prefetch_home(hash);
            }
        }
        let (state, mut writer) = self.source_and_writer(source);
        for (i, op) in message.ops.iter().enumerate() {
            if let Some(hash) = hash_at(i + 2 * PREFETCH_DISTANCE) {
                writer.prefetch_home(hash);
            }
            if let Some(hash) = hash_at(i + PREFETCH_DISTANCE) {
                writer.prefetch_candidate(hash);
            }
            match op {
                KeyOp::Put(hash) => {
                    writer.insert(*hash);
                }
                KeyOp::Drop(hash) => {
                    writer.remove(*hash);
                }
                KeyOp::Event(event) => fold_event(&mut writer, state, event),
            }
        }
        drop(writer);
        state.events_applied += message.events as u64;
        state.applied_seq = message.seq;
        state.applied_unix_ms = message.unix_ms;
        state.events_skipped += message.skipped as u64;
        Ok(Applied {
            events: message.events,
            skipped: message.skipped,
        })
    }

    /// Marks `source` as positioned at `seq` without folding anything (skipping a
    /// message that cannot be decoded even after a resync).
    pub fn set_applied_seq(&mut self, source: usize, seq: u64) {
        self.source_mut(source).applied_seq = seq;
    }

    /// Replaces everything known about `source` with a sub-master snapshot's
    /// content: the key hashes of its complete objects and its segments (owner,
    /// size), as of stream sequence `covers_seq`. Reading then goes on from
    /// `covers_seq + 1`.
    pub fn seed_source(
        &mut self,
        source: usize,
        covers_seq: u64,
        hashes: impl IntoIterator<Item = u64>,
        segments: impl IntoIterator<Item = (SegmentId, NodeId, u64)>,
    ) {
        self.reset_source(source);
        for hash in hashes {
            self.index.insert(source, hash);
        }
        let state = self.source_mut(source);
        state.segments = segments
            .into_iter()
            .map(|(segment, node, size)| (segment, (node, size)))
            .collect();
        state.applied_seq = covers_seq;
        state.snapshot = Some((covers_seq, String::new()));
    }

    /// Records the identity of the stream instance `source` is read from.
    pub fn set_stream_epoch(&mut self, source: usize, epoch: u64) {
        self.source_mut(source).stream_epoch = epoch;
    }

    /// Forgets everything known about `source` (its keys, segments and position),
    /// before re-reading its stream from the start.
    pub fn reset_source(&mut self, source: usize) {
        self.index.clear_source(source);
        let state = self.source_mut(source);
        *state = SourceState {
            subcluster: state.subcluster.take(),
            stream: std::mem::take(&mut state.stream),
            ..SourceState::default()
        };
    }

    /// A bloom filter of the keys `source` holds, versioned by its applied sequence.
    pub fn bloom(&self, source: usize) -> BloomFilter {
        let covers_seq = self.sources.get(source).map_or(0, |s| s.applied_seq);
        let Some(ids) = self.index.source_ids(source) else {
            return BloomFilter::with_capacity(0, covers_seq);
        };
        let mut bloom = BloomFilter::with_capacity(ids.len() as usize, covers_seq);
        for id in ids {
            if let Some(hash) = self.index.hash_of(id) {
                bloom.insert(hash);
            }
        }
        bloom
    }

    /// Makes room for `keys` more keys in the index (before a replay).
    pub fn reserve(&mut self, keys: usize) {
        self.index.reserve(keys);
    }

    /// Returns the index's unused capacity to the allocator (after a replay, when
    /// growth slows down).
    pub fn shrink_to_fit(&mut self) {
        self.index.shrink_to_fit();
    }

    /// Index memory per distinct key, in bytes (0 when empty).
    pub fn bytes_per_key(&self) -> f64 {
        if self.index.is_empty() {
            return 0.0;
        }
        self.index.memory_bytes() as f64 / self.index.len() as f64
    }

    /// The logical content, for comparing projections built in different ways:
    /// per source its sub-cluster, applied sequence, segments and sorted key hashes.
    pub fn content(&self) -> Vec<SourceContent> {
        self.sources
            .iter()
            .enumerate()
            .map(|(source, state)| {
                let mut hashes: Vec<u64> = self
                    .index
                    .source_ids(source)
                    .map(|ids| ids.iter().filter_map(|id| self.index.hash_of(id)).collect())
                    .unwrap_or_default();
                hashes.sort_unstable();
                (
                    state.subcluster.clone(),
                    state.applied_seq,
                    state.segments.keys().cloned().collect(),
                    hashes,
                )
            })
            .collect()
    }
}

/// Folds one event of a source into its writer and its state.
fn fold_event(writer: &mut SourceWriter<'_>, state: &mut SourceState, event: &KvEvent) {
    match event {
        KvEvent::PutCommitted(put) => {
            writer.insert(put.key_hash);
        }
        KvEvent::Evicted(hkvm_events::Evicted { keys })
        | KvEvent::Removed(hkvm_events::Removed { keys }) => {
            for key in keys {
                writer.remove(key_hash(key));
            }
        }
        KvEvent::SegmentMounted(mounted) => {
            state.segments.insert(
                mounted.segment.clone(),
                (mounted.node.clone(), mounted.size),
            );
        }
        KvEvent::SegmentUnmounted(unmounted) => {
            state.segments.remove(&unmounted.segment);
        }
        KvEvent::NodeLost(lost) => {
            state.segments.retain(|_, (node, _)| *node != lost.node);
        }
        KvEvent::Snapshot(snapshot) => {
            state.snapshot = Some((snapshot.covers_seq, snapshot.object.clone()));
        }
    }
}
