//! State shared by the replicator's tasks: the diff, what the registries say about
//! each sub-cluster, which followers are still catching up, and the metrics.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, MutexGuard};

use hkvm_events::SubclusterId;
use tokio::task::JoinHandle;

use crate::diff::{Diff, Side};
use crate::metrics::Metrics;
use crate::policy::Policy;

/// What a pool's registry says about one sub-cluster.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct SubclusterInfo {
    /// Its sub-master's labels.
    pub labels: BTreeMap<String, String>,
    /// Bytes mounted.
    pub capacity_bytes: u64,
    /// Bytes allocated.
    pub used_bytes: u64,
    /// Whether its heartbeat is younger than the TTL.
    pub alive: bool,
    /// Whether its stream is followed (source side: the labels allow it).
    pub followed: bool,
}

/// Shared state.
pub(crate) struct Shared {
    pub policy: Policy,
    pub metrics: Metrics,
    diff: Mutex<Diff>,
    source_topology: Mutex<BTreeMap<SubclusterId, SubclusterInfo>>,
    target_topology: Mutex<BTreeMap<SubclusterId, SubclusterInfo>>,
    catching_up: Mutex<BTreeSet<usize>>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a lock leaves consistent data here (every update is
    // a single call), so a poisoned lock is simply taken over.
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Shared {
    pub fn new(policy: Policy, diff: Diff) -> Self {
        Self {
            policy,
            metrics: Metrics::new(),
            diff: Mutex::new(diff),
            source_topology: Mutex::default(),
            target_topology: Mutex::default(),
            catching_up: Mutex::default(),
            tasks: Mutex::default(),
        }
    }

    /// The diff (never hold the guard across an await).
    pub fn diff(&self) -> MutexGuard<'_, Diff> {
        lock(&self.diff)
    }

    /// What a pool's registry says, per sub-cluster.
    pub fn topology(&self, side: Side) -> MutexGuard<'_, BTreeMap<SubclusterId, SubclusterInfo>> {
        match side {
            Side::Source => lock(&self.source_topology),
            Side::Target => lock(&self.target_topology),
        }
    }

    /// Slots whose followers have not reached the stream end seen when they started.
    pub fn catching_up(&self) -> MutexGuard<'_, BTreeSet<usize>> {
        lock(&self.catching_up)
    }

    /// Keeps a task, aborted by [`Shared::stop`].
    pub fn keep(&self, task: JoinHandle<()>) {
        lock(&self.tasks).push(task);
    }

    /// Aborts every kept task.
    pub fn stop(&self) {
        for task in lock(&self.tasks).drain(..) {
            task.abort();
        }
    }
}
