//! Configuration of a sub-master process.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use hkvm_events::{ClusterId, ProducerId, SubclusterId};
use hkvm_log::commit::CommitConfig;
use hkvm_log::stream::StreamSettings;

pub use hkvm_direct::config::{DirectConfig, DirectListen};

use crate::command::Policy;

/// Everything a sub-master needs to run. Build with `..SubmasterConfig::new(..)`.
#[derive(Debug, Clone)]
pub struct SubmasterConfig {
    /// The cluster.
    pub cluster: ClusterId,
    /// The sub-cluster this master is authoritative for.
    pub subcluster: SubclusterId,
    /// This instance's id (unique among the sub-cluster's leader and standbys).
    pub producer: ProducerId,
    /// Labels published in the registry (e.g. `dc=a,pool=prefill`).
    pub labels: BTreeMap<String, String>,
    /// Command rules (leases, timeouts, eviction, placement, limits).
    pub policy: Policy,
    /// Event stream settings (replicas: 1 locally, 3 in a NATS cluster).
    pub stream: StreamSettings,
    /// Group-commit tuning.
    pub commit: CommitConfig,
    /// Leader lease lifetime: a dead leader is replaced about this long after it died.
    pub leader_lease_ttl: Duration,
    /// Write a snapshot after this many applied events...
    pub snapshot_every_events: u64,
    /// ...or this long after the last one, whichever comes first (if anything changed).
    pub snapshot_interval: Duration,
    /// How hard writing a snapshot may press on this machine and NATS.
    pub snapshot_pace: SnapshotPace,
    /// Bounded history: what may be purged from the stream after a snapshot.
    pub history: HistoryConfig,
    /// How often upkeep runs (liveness, put timeouts, eviction).
    pub maintenance_interval: Duration,
    /// Requests queued for the state machine before new ones get `Busy`.
    pub request_queue: usize,
    /// The `retry_after` given with `Busy`.
    pub busy_retry_after: Duration,
    /// Registry entry lifetime (heartbeats come every third of it).
    pub registry_ttl: Duration,
    /// Serve Prometheus metrics here.
    pub metrics_addr: Option<SocketAddr>,
    /// How long a standby's read of the stream lets new events gather before
    /// fetching them once caught up (zero: each event as soon as it is stored);
    /// a standby that takes over reads what it had not yet fetched first.
    pub standby_linger: Duration,
    /// Where the leader takes direct requests (clients' hot operations without
    /// the NATS broker in between).
    pub direct: DirectConfig,
}

impl SubmasterConfig {
    /// Defaults for `subcluster` of `cluster`, run by `producer`.
    pub fn new(cluster: ClusterId, subcluster: SubclusterId, producer: ProducerId) -> Self {
        Self {
            cluster,
            subcluster,
            producer,
            labels: BTreeMap::new(),
            policy: Policy::default(),
            stream: StreamSettings::default(),
            commit: CommitConfig::default(),
            leader_lease_ttl: Duration::from_secs(1),
            snapshot_every_events: 200_000,
            snapshot_interval: Duration::from_secs(60),
            snapshot_pace: SnapshotPace::default(),
            history: HistoryConfig::default(),
            maintenance_interval: Duration::from_millis(500),
            request_queue: 16_384,
            busy_retry_after: Duration::from_millis(100),
            registry_ttl: Duration::from_secs(10),
            metrics_addr: None,
            standby_linger: hkvm_log::follow::DEFAULT_LINGER,
            direct: DirectConfig::default(),
        }
    }
}

/// How a snapshot is paced so that the requests beside it keep their latency:
/// the encoder works in slices of about a millisecond with rests between
/// ([`hkvm_log::pace::CpuShare`]), and storing it and reading it back to
/// verify it go at a bounded byte rate (the NATS server's work for 860 MB, at
/// 10 M objects, is otherwise a burst that the leader's appends queue behind;
/// at 64 MiB/s its share alone took put p99 beside it from about 2 ms to 4.6-5.2
/// ms on a busy two-core host, at 32 MiB/s to 3.8 ms: `hkvm bench soak`).
/// A slower snapshot costs a standby a longer pause of its fold (it catches up
/// after) and the purge a later start; a restore is never paced.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SnapshotPace {
    /// The share of one core the encoder may use (1 or more: no rests).
    pub cpu_share: f64,
    /// Bytes per second at most while a snapshot is stored and read back (0:
    /// unpaced).
    pub write_bytes_per_sec: u64,
}

impl Default for SnapshotPace {
    fn default() -> Self {
        Self {
            cpu_share: 0.5,
            write_bytes_per_sec: 32 << 20,
        }
    }
}

/// How the leader bounds its stream's history. Fill what you need and take the rest
/// from `Default`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HistoryConfig {
    /// Purge the stream after each verified snapshot, up to what it covers and
    /// every fresh reader position allows. Off, the stream keeps everything (its
    /// own limits aside).
    pub purge: bool,
    /// A reader position older than this no longer holds the purge back: that
    /// reader seeds from the snapshot when it comes back.
    pub reader_ttl: Duration,
}

impl Default for HistoryConfig {
    fn default() -> Self {
        Self {
            purge: true,
            reader_ttl: Duration::from_secs(600),
        }
    }
}
