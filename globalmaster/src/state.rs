//! The state one replica shares between its tasks: the projection, the registry as
//! last seen, each source's stream position, and whether it is still replaying.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

use hkvm_events::rpc::global::{SourceLag, SourceStatus, Staleness};
use hkvm_events::SubclusterId;
use hkvm_log::registry::{now_unix_ms, Registered};
use hkvm_projector::Projection;
use hkvm_telemetry::metrics::gauge_value;

use crate::config::GlobalMasterConfig;
use crate::metrics::{source_label, Metrics};

/// What a follower knows about its stream beyond the projection.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Position {
    /// The stream's last sequence when last looked at.
    pub last_seq: u64,
    /// Times the source was re-read from scratch.
    pub resyncs: u64,
    /// Whether the follower reached the end seen when it started.
    pub caught_up: bool,
    /// Whether the source must be caught up before the replica serves.
    pub gates_serving: bool,
}

/// Each sub-cluster's stream end, from one look at the streams.
#[derive(Debug, Clone)]
pub(crate) struct StreamEnds {
    /// When the look started.
    pub started: tokio::time::Instant,
    /// (sub-cluster, last sequence) per followed or registered sub-cluster.
    pub ends: Vec<(SubclusterId, u64)>,
}

/// The newest look at the streams, shared by the waiters of sync lookups
/// (`crate::sync` takes and renews it).
#[derive(Debug, Default)]
pub(crate) struct Looks {
    pub newest: tokio::sync::Mutex<Option<StreamEnds>>,
}

/// Shared by the followers, the query server and the background tasks.
#[derive(Debug)]
pub(crate) struct Shared {
    pub config: GlobalMasterConfig,
    pub projection: RwLock<Projection>,
    pub registry: RwLock<BTreeMap<SubclusterId, Registered>>,
    pub positions: Mutex<BTreeMap<usize, Position>>,
    pub replaying: AtomicBool,
    pub metrics: Metrics,
    /// Bumped whenever a source's applied sequence moves (sync lookups wait on it).
    pub applied: tokio::sync::watch::Sender<u64>,
    /// The newest look at the streams' ends, shared by sync lookups.
    pub looks: Looks,
    /// Where this replica takes direct queries, and the ticket clients show
    /// there, once its front serves.
    pub direct_endpoint: std::sync::OnceLock<(String, hkvm_events::rpc::direct::DirectTicket)>,
}

impl Shared {
    pub fn new(config: GlobalMasterConfig, projection: Projection) -> Self {
        Self {
            config,
            projection: RwLock::new(projection),
            registry: RwLock::new(BTreeMap::new()),
            positions: Mutex::new(BTreeMap::new()),
            replaying: AtomicBool::new(true),
            metrics: Metrics::new(),
            applied: tokio::sync::watch::Sender::new(0),
            looks: Looks::default(),
            direct_endpoint: std::sync::OnceLock::new(),
        }
    }

    /// Tells sync lookups that a source's applied sequence moved.
    pub fn notify_applied(&self) {
        self.applied
            .send_modify(|moves| *moves = moves.wrapping_add(1));
    }

    // A panic while holding a lock leaves the projection usable: every update of it
    // is one message's events, applied after decoding them all.
    pub fn read(&self) -> RwLockReadGuard<'_, Projection> {
        self.projection.read().unwrap_or_else(|p| p.into_inner())
    }

    pub fn write(&self) -> RwLockWriteGuard<'_, Projection> {
        self.projection.write().unwrap_or_else(|p| p.into_inner())
    }

    pub fn registry(&self) -> RwLockReadGuard<'_, BTreeMap<SubclusterId, Registered>> {
        self.registry.read().unwrap_or_else(|p| p.into_inner())
    }

    pub fn positions(&self) -> MutexGuard<'_, BTreeMap<usize, Position>> {
        self.positions.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn is_replaying(&self) -> bool {
        self.replaying.load(Ordering::Acquire)
    }

    /// Updates a source's known stream end (and its lag gauges).
    pub fn observe_last_seq(&self, source: usize, subcluster: &SubclusterId, last_seq: u64) {
        let (applied, applied_unix_ms) = self
            .read()
            .source(source)
            .map_or((0, 0), |s| (s.applied_seq, s.applied_unix_ms));
        let mut positions = self.positions();
        let position = positions.entry(source).or_default();
        position.last_seq = position.last_seq.max(last_seq);
        let lag = position.last_seq.saturating_sub(applied);
        drop(positions);
        let labels = source_label(subcluster.as_str());
        self.metrics
            .lag_events
            .get_or_create(&labels)
            .set(gauge_value(lag));
        let lag_ms = if lag > 0 && applied_unix_ms > 0 {
            now_unix_ms().saturating_sub(applied_unix_ms)
        } else {
            0
        };
        self.metrics
            .lag_seconds
            .get_or_create(&labels)
            .set(lag_ms as f64 / 1000.0);
    }

    /// Marks a source caught up, and the replica serving once every gating source
    /// is.
    pub fn mark_caught_up(&self, source: usize) {
        self.positions().entry(source).or_default().caught_up = true;
        self.open_gate_if_ready();
    }

    /// Starts serving once every gating source has caught up.
    pub fn open_gate_if_ready(&self) {
        let all = self
            .positions()
            .values()
            .all(|p| p.caught_up || !p.gates_serving);
        if all && self.replaying.load(Ordering::Acquire) {
            // Growth by doubling leaves up to half of the index's vectors unused.
            self.write().shrink_to_fit();
        }
        if all && self.replaying.swap(false, Ordering::AcqRel) {
            tracing::info!(replica = %self.config.replica, "caught up: serving queries");
        }
    }

    /// Per source: position and lag, as answers carry them.
    pub fn staleness(&self, projection: &Projection) -> Staleness {
        let positions = self.positions();
        let now = now_unix_ms();
        let sources = projection
            .sources()
            .iter()
            .enumerate()
            .filter_map(|(index, state)| {
                let subcluster = state.subcluster.clone()?;
                let last_seq = positions
                    .get(&index)
                    .map_or(0, |p| p.last_seq)
                    .max(state.applied_seq);
                let lag_events = last_seq - state.applied_seq;
                let lag_ms = if lag_events > 0 && state.applied_unix_ms > 0 {
                    now.saturating_sub(state.applied_unix_ms)
                } else {
                    0
                };
                Some(SourceLag {
                    subcluster,
                    applied_seq: state.applied_seq,
                    last_seq,
                    lag_events,
                    lag_ms,
                })
            })
            .collect();
        Staleness {
            replica: self.config.replica.clone(),
            sources,
        }
    }

    /// Per source: status for `hkvm status` and the status RPC.
    pub fn source_statuses(&self, projection: &Projection) -> Vec<SourceStatus> {
        let staleness = self.staleness(projection);
        let positions = self.positions();
        staleness
            .sources
            .into_iter()
            .filter_map(|lag| {
                let index = projection.find_source(&lag.subcluster)?;
                let state = projection.source(index)?;
                Some(SourceStatus {
                    stream: state.stream.clone(),
                    keys: projection.index().source_len(index),
                    resyncs: positions.get(&index).map_or(0, |p| p.resyncs),
                    lag,
                })
            })
            .collect()
    }

    /// Refreshes the key-count and memory gauges.
    pub fn update_index_gauges(&self) {
        let projection = self.read();
        let index = projection.index();
        self.metrics.keys.set(gauge_value(index.len()));
        self.metrics
            .index_bytes
            .set(gauge_value(index.memory_bytes()));
    }
}

#[cfg(test)]
mod tests {
    use hkvm_events::key_ops::KeyOps;

    use super::*;

    fn lag_gauges(shared: &Shared, subcluster: &SubclusterId) -> (i64, f64) {
        let labels = source_label(subcluster.as_str());
        (
            shared.metrics.lag_events.get_or_create(&labels).get(),
            shared.metrics.lag_seconds.get_or_create(&labels).get(),
        )
    }

    #[test]
    fn the_lag_gauges_say_how_far_and_how_long_a_source_is_behind() {
        let shared = Shared::new(GlobalMasterConfig::default(), Projection::new());
        let subcluster = SubclusterId::new("sc-0").unwrap_or_else(|e| panic!("{e}"));
        let source = shared.write().source_index(&subcluster, "stream");
        let applied_unix_ms = now_unix_ms() - 7_000;
        shared
            .write()
            .apply_key_ops(
                source,
                KeyOps {
                    seq: 1,
                    unix_ms: applied_unix_ms,
                    ops: Vec::new(),
                    events: 0,
                    skipped: 0,
                },
            )
            .unwrap_or_else(|e| panic!("{e}"));

        // Caught up: no lag at all, however old the newest event is.
        shared.observe_last_seq(source, &subcluster, 1);
        assert_eq!(lag_gauges(&shared, &subcluster), (0, 0.0));

        // Three events wait: the lag in seconds is the newest applied one's age.
        shared.observe_last_seq(source, &subcluster, 4);
        let (events, seconds) = lag_gauges(&shared, &subcluster);
        assert_eq!(events, 3);
        assert!((7.0..60.0).contains(&seconds), "{seconds}");
    }
}
