//! Node liveness outside the request loop.
//!
//! Every node pings its sub-master once a second: at 10,000 nodes that is most of
//! a sub-master's requests, and none of them changes durable state. A leader's RPC
//! front answers them itself from [`LiveNodes`]: the set of nodes the leader
//! knows (kept in step with the state by the loop, before any reply that depends
//! on it goes out) and the pings since the loop last collected them. The loop
//! folds those pings into [`State::liveness`](crate::state::State::liveness) with
//! [`collect_pings`] before each round of upkeep, which alone declares nodes lost.

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, MutexGuard, PoisonError};

use hkvm_events::rpc::submaster::PingReply;
use hkvm_events::{KvEvent, NodeId};
use tokio::time::Instant;

use crate::keyhash::KeyHashBuilder;
use crate::state::State;

/// The nodes a leader knows and their pings since the last collection; shared by
/// the RPC front and the request loop.
#[derive(Debug)]
pub struct LiveNodes {
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// The serving epoch, told in every ping reply.
    epoch: u64,
    /// The leader's state clock (its milliseconds are the state's).
    clock: Instant,
    known: HashSet<NodeId, KeyHashBuilder>,
    /// Each known node's latest ping since the last [`LiveNodes::take_pings`].
    pinged: HashMap<NodeId, u64, KeyHashBuilder>,
}

impl Inner {
    fn record(&mut self, node: &NodeId, now_ms: u64) -> PingReply {
        let known = self.known.contains(node);
        if known {
            self.pinged.insert(node.clone(), now_ms);
        }
        PingReply {
            epoch: self.epoch,
            need_remount: !known,
        }
    }
}

impl Default for LiveNodes {
    fn default() -> Self {
        Self::new()
    }
}

impl LiveNodes {
    /// An empty table (no node known, epoch 0) until [`LiveNodes::lead`].
    pub fn new() -> Self {
        Self {
            inner: Mutex::new(Inner {
                epoch: 0,
                clock: Instant::now(),
                known: HashSet::default(),
                pinged: HashMap::default(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Nothing under the lock can panic half-way through a change that matters:
        // a poisoned table is still a consistent one.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts a leadership: its epoch, its state clock and the nodes `state` knows.
    pub fn lead(&self, epoch: u64, clock: Instant, state: &State) {
        let mut inner = self.lock();
        inner.epoch = epoch;
        inner.clock = clock;
        inner.known = state.nodes().cloned().collect();
        inner.pinged.clear();
    }

    /// Records a ping from `node` now (by the leadership's clock) and answers it:
    /// a node the leader does not know must remount (and its ping counts for
    /// nothing).
    pub fn ping(&self, node: &NodeId) -> PingReply {
        let mut inner = self.lock();
        let now_ms = u64::try_from(inner.clock.elapsed().as_millis()).unwrap_or(u64::MAX);
        inner.record(node, now_ms)
    }

    /// [`LiveNodes::ping`] at a given state time (for a caller with its own clock).
    pub fn ping_at(&self, node: &NodeId, now_ms: u64) -> PingReply {
        self.lock().record(node, now_ms)
    }

    /// Brings the known nodes in step with `state` after it applied `events` (a
    /// mount, an unmount or a lost node changes them).
    pub fn sync(&self, state: &State, events: &[KvEvent]) {
        let mut touched = events.iter().filter_map(|event| match event {
            KvEvent::SegmentMounted(mounted) => Some(&mounted.node),
            KvEvent::SegmentUnmounted(unmounted) => Some(&unmounted.node),
            KvEvent::NodeLost(lost) => Some(&lost.node),
            _ => None,
        });
        let Some(first) = touched.next() else {
            return;
        };
        let mut inner = self.lock();
        for node in std::iter::once(first).chain(touched) {
            if state.knows_node(node) {
                inner.known.insert(node.clone());
            } else {
                inner.known.remove(node);
                inner.pinged.remove(node);
            }
        }
    }

    /// The pings since the last call.
    pub fn take_pings(&self) -> HashMap<NodeId, u64, KeyHashBuilder> {
        std::mem::take(&mut self.lock().pinged)
    }
}

/// Folds pings taken from [`LiveNodes`] into the state's liveness record, for the
/// nodes the state still knows.
pub fn collect_pings(state: &mut State, pings: HashMap<NodeId, u64, KeyHashBuilder>) {
    for (node, ms) in pings {
        if state.knows_node(&node) {
            let last = state.liveness.entry(node).or_insert(ms);
            *last = (*last).max(ms);
        }
    }
}

#[cfg(test)]
mod tests;
