//! The pure core of the inter-DC master: both pools' events folded into one
//! projector [`KeyIndex`] (each sub-cluster of either side is a source of the index),
//! a catalog of the source pool's blocks (key, size, checksum, commit time), and
//! what the copier did. The backlog is roaring set algebra:
//! `union(source sub-clusters) − union(target sub-clusters)`, minus blocks copied,
//! in flight, given up or evicted on purpose at the target, filtered by the
//! [`Policy`] and ordered newest first.
//!
//! No I/O and no clock: followers call [`Diff::apply_decoded`], the copier calls the
//! `mark_*` methods, and tests drive it directly.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use hkvm_events::codec::Decoded;
use hkvm_events::{key_hash, KvEvent, SubclusterId};
use hkvm_projector::KeyIndex;
use roaring::RoaringBitmap;
use serde::{Deserialize, Serialize};

use crate::policy::{Policy, SkipReason};

/// Which pool a sub-cluster belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Side {
    /// The pool blocks are copied from.
    Source,
    /// The pool blocks are copied to.
    Target,
}

impl Side {
    /// `source` or `target`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Source => "source",
            Self::Target => "target",
        }
    }
}

/// One followed sub-cluster stream.
#[derive(Debug, Clone, PartialEq)]
pub struct Slot {
    /// Its pool.
    pub side: Side,
    /// The sub-cluster.
    pub subcluster: SubclusterId,
    /// The last stream sequence folded in.
    pub applied_seq: u64,
    /// When that message was stored, Unix milliseconds.
    pub applied_unix_ms: u64,
    /// The used fraction of the sub-cluster's capacity (from its registry entry).
    pub fill: f64,
}

/// A block of the source pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceBlock {
    /// The key.
    pub key: String,
    /// Bytes.
    pub size: u64,
    /// xxh3-64 of the value.
    pub checksum: u64,
    /// When its put was committed (stream time), Unix milliseconds.
    pub committed_unix_ms: u64,
}

/// A block to copy, with the source sub-cluster to read it from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// xxh3-64 of the key.
    pub hash: u64,
    /// The block.
    pub block: SourceBlock,
    /// A source sub-cluster that holds it.
    pub subcluster: SubclusterId,
}

/// What is left to copy.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Backlog {
    /// Blocks to copy, newest first (at most the number asked for).
    pub next: Vec<Candidate>,
    /// Blocks the source has and the target lacks that the policy lets through
    /// (not counting those in flight; counting those waiting for a retry).
    pub keys: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Blocks the policy skips, by reason.
    pub skipped: BTreeMap<&'static str, u64>,
    /// Blocks in flight.
    pub in_flight: u64,
}

/// Why [`Diff::apply_decoded`] refused a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("slot {slot}: expected sequence {expected}, found {found}")]
pub struct OutOfOrder {
    /// The slot.
    pub slot: usize,
    /// The next sequence expected.
    pub expected: u64,
    /// The sequence offered.
    pub found: u64,
}

/// Both pools' projection and the copier's bookkeeping.
#[derive(Debug, Default, Clone)]
pub struct Diff {
    index: KeyIndex,
    slots: Vec<Slot>,
    blocks: HashMap<u64, SourceBlock>,
    evicted_at_target: HashSet<u64>,
    copied: HashSet<u64>,
    in_flight: HashSet<u64>,
    attempts: HashMap<u64, u32>,
    given_up: HashSet<u64>,
    /// Blocks not to offer before a time (Unix ms): after a failure, or after a
    /// copy settled by events that have not arrived yet.
    deferred: HashMap<u64, u64>,
}

impl Diff {
    /// An empty diff.
    pub fn new() -> Self {
        Self::default()
    }

    /// The slot of `subcluster` on `side`, added if new.
    pub fn slot(&mut self, side: Side, subcluster: &SubclusterId) -> usize {
        if let Some(found) = self.find_slot(side, subcluster) {
            return found;
        }
        self.slots.push(Slot {
            side,
            subcluster: subcluster.clone(),
            applied_seq: 0,
            applied_unix_ms: 0,
            fill: 0.0,
        });
        self.slots.len() - 1
    }

    /// The slot of `subcluster` on `side`, if known.
    pub fn find_slot(&self, side: Side, subcluster: &SubclusterId) -> Option<usize> {
        self.slots
            .iter()
            .position(|s| s.side == side && &s.subcluster == subcluster)
    }

    /// Every slot.
    pub fn slots(&self) -> &[Slot] {
        &self.slots
    }

    /// Sets a slot's used fraction (from the registry).
    pub fn set_fill(&mut self, slot: usize, fill: f64) {
        if let Some(s) = self.slots.get_mut(slot) {
            s.fill = fill;
        }
    }

    fn side_of(&self, slot: usize) -> Option<Side> {
        self.slots.get(slot).map(|s| s.side)
    }

    fn held_on(&self, side: Side, hash: u64) -> bool {
        self.index
            .holders(hash)
            .iter()
            .any(|s| self.side_of(s) == Some(side))
    }

    /// Folds one event of `slot`, stored at `unix_ms`.
    pub fn apply(&mut self, slot: usize, unix_ms: u64, event: &KvEvent) {
        let Some(side) = self.side_of(slot) else {
            return;
        };
        match event {
            KvEvent::PutCommitted(put) => {
                self.index.insert(slot, put.key_hash);
                match side {
                    Side::Source => {
                        self.blocks.insert(
                            put.key_hash,
                            SourceBlock {
                                key: put.key.clone(),
                                size: put.size,
                                checksum: put.checksum,
                                committed_unix_ms: unix_ms,
                            },
                        );
                    }
                    Side::Target => {
                        self.evicted_at_target.remove(&put.key_hash);
                    }
                }
            }
            KvEvent::Evicted(hkvm_events::Evicted { keys })
            | KvEvent::Removed(hkvm_events::Removed { keys }) => {
                for key in keys {
                    let hash = key_hash(key);
                    if !self.index.remove(slot, hash) || self.held_on(side, hash) {
                        continue;
                    }
                    match side {
                        Side::Source => {
                            self.blocks.remove(&hash);
                        }
                        Side::Target => {
                            self.evicted_at_target.insert(hash);
                        }
                    }
                }
            }
            // Segments and node losses show up as Removed events for the objects
            // that lost their last replica; snapshots change nothing here.
            KvEvent::SegmentMounted(_)
            | KvEvent::SegmentUnmounted(_)
            | KvEvent::NodeLost(_)
            | KvEvent::Snapshot(_) => {}
        }
    }

    /// Folds a decoded message of `slot`. Messages at or below the applied
    /// sequence are ignored.
    ///
    /// # Errors
    /// [`OutOfOrder`] when the message skips ahead (the caller re-reads the slot).
    pub fn apply_decoded(&mut self, slot: usize, decoded: &Decoded) -> Result<(), OutOfOrder> {
        let Some(applied) = self.slots.get(slot).map(|s| s.applied_seq) else {
            return Ok(());
        };
        if decoded.seq <= applied {
            return Ok(());
        }
        if applied != 0 && decoded.seq != applied + 1 {
            return Err(OutOfOrder {
                slot,
                expected: applied + 1,
                found: decoded.seq,
            });
        }
        for event in &decoded.events {
            self.apply(slot, decoded.unix_ms, event);
        }
        self.set_applied(slot, decoded.seq, decoded.unix_ms);
        Ok(())
    }

    /// Positions `slot` at `seq` without folding anything (a message skipped as
    /// undecodable).
    pub fn set_applied(&mut self, slot: usize, seq: u64, unix_ms: u64) {
        if let Some(s) = self.slots.get_mut(slot) {
            s.applied_seq = seq;
            s.applied_unix_ms = s.applied_unix_ms.max(unix_ms);
        }
    }

    /// Replaces what `slot` holds with a sub-master snapshot's objects (`(key hash,
    /// block)`), as of stream sequence `covers_seq`: used when the stream's history
    /// before its first sequence was purged. Reading goes on from `covers_seq + 1`.
    pub fn seed_slot(
        &mut self,
        slot: usize,
        covers_seq: u64,
        unix_ms: u64,
        objects: impl IntoIterator<Item = (u64, SourceBlock)>,
    ) {
        let Some(side) = self.side_of(slot) else {
            return;
        };
        self.reset_slot(slot);
        for (hash, block) in objects {
            self.index.insert(slot, hash);
            if side == Side::Source {
                self.blocks.insert(hash, block);
            }
        }
        self.set_applied(slot, covers_seq, unix_ms);
    }

    /// Forgets what `slot` holds (before re-reading its stream from the start).
    /// What was evicted at the target and what was copied is kept.
    pub fn reset_slot(&mut self, slot: usize) {
        let Some(side) = self.side_of(slot) else {
            return;
        };
        let hashes: Vec<u64> = self
            .index
            .source_ids(slot)
            .map(|ids| ids.iter().filter_map(|id| self.index.hash_of(id)).collect())
            .unwrap_or_default();
        self.index.clear_source(slot);
        if side == Side::Source {
            for hash in hashes {
                if !self.held_on(Side::Source, hash) {
                    self.blocks.remove(&hash);
                }
            }
        }
        if let Some(s) = self.slots.get_mut(slot) {
            s.applied_seq = 0;
            s.applied_unix_ms = 0;
        }
    }

    /// Records a block as copied by this replicator (now, or in an earlier run):
    /// it is never copied again.
    pub fn mark_copied(&mut self, hash: u64) {
        self.in_flight.remove(&hash);
        self.attempts.remove(&hash);
        self.deferred.remove(&hash);
        self.copied.insert(hash);
    }

    /// Whether the block was copied by this replicator.
    pub fn was_copied(&self, hash: u64) -> bool {
        self.copied.contains(&hash)
    }

    /// Blocks copied (this run and earlier ones).
    pub fn copied_count(&self) -> usize {
        self.copied.len()
    }

    /// Marks a block as being copied.
    pub fn mark_in_flight(&mut self, hash: u64) {
        self.in_flight.insert(hash);
    }

    /// A copy ended without copying, cleanly (the source lost the block, or the
    /// target got it by other means): the events decide what happens next; until
    /// `retry_at_unix_ms` (time for them to arrive) the block is not offered.
    pub fn mark_settled(&mut self, hash: u64, retry_at_unix_ms: u64) {
        self.in_flight.remove(&hash);
        self.attempts.remove(&hash);
        self.deferred.insert(hash, retry_at_unix_ms);
    }

    /// A copy failed; it is offered again from `retry_at_unix_ms`, and after
    /// `max_attempts` failures it is given up for this run. Returns the attempts
    /// so far, and whether it was given up.
    pub fn mark_failed(
        &mut self,
        hash: u64,
        max_attempts: u32,
        retry_at_unix_ms: u64,
    ) -> (u32, bool) {
        self.in_flight.remove(&hash);
        let attempts = self.attempts.entry(hash).or_insert(0);
        *attempts += 1;
        let attempts = *attempts;
        if attempts >= max_attempts {
            self.attempts.remove(&hash);
            self.deferred.remove(&hash);
            self.given_up.insert(hash);
            return (attempts, true);
        }
        self.deferred.insert(hash, retry_at_unix_ms);
        (attempts, false)
    }

    /// Failed attempts of a block so far.
    pub fn attempts(&self, hash: u64) -> u32 {
        self.attempts.get(&hash).copied().unwrap_or(0)
    }

    /// Blocks given up in this run.
    pub fn given_up_count(&self) -> usize {
        self.given_up.len()
    }

    /// Whether any target sub-cluster holds the key.
    pub fn target_has(&self, key: &str) -> bool {
        self.held_on(Side::Target, key_hash(key))
    }

    /// Whether any source sub-cluster holds the key.
    pub fn source_has(&self, key: &str) -> bool {
        self.held_on(Side::Source, key_hash(key))
    }

    /// The source block with this key, if the source holds it.
    pub fn source_block(&self, key: &str) -> Option<&SourceBlock> {
        self.blocks.get(&key_hash(key))
    }

    fn union(&self, side: Side) -> RoaringBitmap {
        let mut all = RoaringBitmap::new();
        for (slot, s) in self.slots.iter().enumerate() {
            if s.side == side {
                if let Some(ids) = self.index.source_ids(slot) {
                    all |= ids;
                }
            }
        }
        all
    }

    /// What is left to copy at `now_unix_ms` under `policy`, with at most `limit`
    /// candidates (newest first) that are not in flight.
    pub fn backlog(&self, policy: &Policy, now_unix_ms: u64, limit: usize) -> Backlog {
        let missing = self.union(Side::Source) - self.union(Side::Target);
        let mut backlog = Backlog {
            in_flight: self.in_flight.len() as u64,
            ..Backlog::default()
        };
        let mut ready: Vec<(u64, u64, usize)> = Vec::new();
        for id in &missing {
            let Some(hash) = self.index.hash_of(id) else {
                continue;
            };
            if self.copied.contains(&hash)
                || self.in_flight.contains(&hash)
                || self.given_up.contains(&hash)
            {
                continue;
            }
            let Some(block) = self.blocks.get(&hash) else {
                continue;
            };
            if self.deferred.get(&hash).is_some_and(|&at| at > now_unix_ms) {
                backlog.keys += 1;
                backlog.bytes += block.size;
                continue;
            }
            if !policy.recopy_evicted && self.evicted_at_target.contains(&hash) {
                *backlog
                    .skipped
                    .entry(SkipReason::EvictedAtTarget.name())
                    .or_default() += 1;
                continue;
            }
            let Some(slot) = self
                .index
                .holders(hash)
                .iter()
                .find(|&s| self.side_of(s) == Some(Side::Source))
            else {
                continue;
            };
            let age = Duration::from_millis(now_unix_ms.saturating_sub(block.committed_unix_ms));
            let fill = self.slots[slot].fill;
            if let Some(reason) = policy.skip(&block.key, block.size, age, fill) {
                *backlog.skipped.entry(reason.name()).or_default() += 1;
                continue;
            }
            backlog.keys += 1;
            backlog.bytes += block.size;
            ready.push((block.committed_unix_ms, hash, slot));
        }
        // Newest first; ties by hash so the order is deterministic.
        let take = limit.min(ready.len());
        if take > 0 && take < ready.len() {
            ready.select_nth_unstable_by(take - 1, |a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
            ready.truncate(take);
        }
        ready.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        ready.truncate(take);
        backlog.next = ready
            .into_iter()
            .filter_map(|(_, hash, slot)| {
                Some(Candidate {
                    hash,
                    block: self.blocks.get(&hash)?.clone(),
                    subcluster: self.slots[slot].subcluster.clone(),
                })
            })
            .collect();
        backlog
    }
}

#[cfg(test)]
mod tests;
