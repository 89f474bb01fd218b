//! The sub-master's Prometheus metrics.

use std::time::Instant;

use hkvm_log::commit::Committed;
use hkvm_telemetry::metrics::{Buckets, HistogramFamily};
use hkvm_telemetry::{MetricsRegistry, Registrar};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

/// Labels of per-operation metrics.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabels {
    /// The operation (subject token).
    pub op: &'static str,
    /// `ok`, `error` or `busy`.
    pub result: &'static str,
}

/// Labels of the durable-write stage histogram.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageLabels {
    /// One of [`WriteStage::name`]'s values.
    pub stage: &'static str,
}

/// The stages of a write request that appends, from its receipt to its reply; their
/// times add up to the sub-master's part of the request's latency.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteStage {
    /// Received by the RPC front (decoded) until the request loop takes it.
    Queued,
    /// Taken by the request loop until its events are submitted to the group
    /// commit: the state transition and the reply's encoding.
    Handled,
    /// Submitted until its message is handed to the event log: the commit task's
    /// wake-up, packing, and any wait for an in-flight slot.
    Batched,
    /// Handed to the event log until the commit task has JetStream's
    /// acknowledgement: the append's round trip.
    Stored,
    /// Acknowledged until the reply is handed to NATS: waking the task that
    /// replies, and the send.
    Replied,
}

impl WriteStage {
    /// Every stage, in order.
    pub const ALL: [Self; 5] = [
        Self::Queued,
        Self::Handled,
        Self::Batched,
        Self::Stored,
        Self::Replied,
    ];

    /// The stage's label value.
    pub fn name(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Handled => "handled",
            Self::Batched => "batched",
            Self::Stored => "stored",
            Self::Replied => "replied",
        }
    }
}

/// Every metric the sub-master exports.
#[derive(Debug, Clone)]
pub struct SubmasterMetrics {
    /// Requests handled, by operation and result.
    pub requests: Family<OpLabels, Counter>,
    /// Request latency (receipt to reply), by operation.
    pub latency: HistogramFamily<OpLabels>,
    /// Where the time of write requests that append goes, by stage.
    pub write_stages: HistogramFamily<StageLabels>,
    /// Events appended.
    pub events_appended: Counter,
    /// Events per commit submission.
    pub commit_events: Histogram,
    /// Complete objects.
    pub objects: Gauge,
    /// Pending puts.
    pub pending_puts: Gauge,
    /// Space leases held by clients.
    pub space_leases: Gauge,
    /// Bytes allocated.
    pub used_bytes: Gauge,
    /// Bytes mounted.
    pub capacity_bytes: Gauge,
    /// Objects evicted.
    pub evicted: Counter,
    /// Nodes declared lost.
    pub nodes_lost: Counter,
    /// 0 standby, 1 recovering (answering Busy), 2 leader.
    pub role: Gauge,
    /// Last applied stream sequence.
    pub applied_seq: Gauge,
    /// Events the standby is behind the stream end.
    pub standby_lag: Gauge,
    /// Snapshots written.
    pub snapshots: Counter,
    /// Snapshots a leader without a standby rebuilt from the newest snapshot
    /// plus the stream (its request loop copies nothing).
    pub snapshots_rebuilt: Counter,
    /// Stream messages purged after verified snapshots.
    pub purged_messages: Counter,
    /// The stream's first sequence after the last purge.
    pub history_first_seq: Gauge,
    /// 1 while this leader leaves the snapshots to a hot standby.
    pub standby_snapshots: Gauge,
    /// Messages or events in the stream that did not decode (skipped).
    pub undecodable: Counter,
    /// Leaderships taken.
    pub takeovers: Counter,
    /// Open direct connections (clients sending hot operations without NATS).
    pub direct_connections: Gauge,
    registry: MetricsRegistry,
}

/// Request latency: 50 µs .. ~1.6 s.
const LATENCY: Buckets = Buckets::exponential(0.000_05, 2.0, 16);

/// Time in one write stage: 2 µs .. ~0.26 s.
const STAGE: Buckets = Buckets::exponential(0.000_002, 2.0, 18);

/// Events per commit: 1 .. 8192.
const COMMIT_EVENTS: Buckets = Buckets::exponential(1.0, 2.0, 14);

impl Default for SubmasterMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl SubmasterMetrics {
    /// Creates the metrics, registered under `hkvm_submaster_` in their own registry.
    pub fn new() -> Self {
        let mut r = Registrar::new("hkvm_submaster");
        Self {
            requests: r.counters("requests", "Requests handled"),
            latency: r.histograms("request_seconds", "Request latency", LATENCY),
            write_stages: r.histograms(
                "write_stage_seconds",
                "Time a write request that appends spends in each stage, receipt to reply",
                STAGE,
            ),
            events_appended: r.counter("events_appended", "Events appended to the stream"),
            commit_events: r.histogram("commit_events", "Events per commit", COMMIT_EVENTS),
            objects: r.gauge("objects", "Complete objects"),
            pending_puts: r.gauge("pending_puts", "Pending puts"),
            space_leases: r.gauge("space_leases", "Space leases held by clients"),
            used_bytes: r.gauge("used_bytes", "Bytes allocated"),
            capacity_bytes: r.gauge("capacity_bytes", "Bytes mounted"),
            evicted: r.counter("evicted", "Objects evicted"),
            nodes_lost: r.counter("nodes_lost", "Nodes declared lost"),
            role: r.gauge("role", "0 standby, 1 recovering, 2 leader"),
            applied_seq: r.gauge("applied_seq", "Last applied stream sequence"),
            standby_lag: r.gauge("standby_lag", "Events behind the stream end"),
            snapshots: r.counter("snapshots", "Snapshots written"),
            snapshots_rebuilt: r.counter(
                "snapshots_rebuilt",
                "Snapshots a leader without a standby rebuilt from the newest snapshot plus the stream",
            ),
            purged_messages: r.counter(
                "purged_messages",
                "Stream messages purged after verified snapshots",
            ),
            standby_snapshots: r.gauge(
                "standby_snapshots",
                "1 while this leader leaves the snapshots to a hot standby",
            ),
            history_first_seq: r.gauge(
                "history_first_seq",
                "The stream's first sequence after the last purge",
            ),
            undecodable: r.counter(
                "undecodable",
                "Stream messages or events skipped as undecodable",
            ),
            takeovers: r.counter("takeovers", "Leaderships taken"),
            direct_connections: r.gauge(
                "direct_connections",
                "Open direct connections of clients (hot operations without NATS)",
            ),
            registry: r.finish(),
        }
    }

    /// The registry, to serve on `/metrics` and to read in process.
    pub fn registry(&self) -> MetricsRegistry {
        self.registry.clone()
    }

    /// Records one handled request.
    pub fn request(&self, op: &'static str, result: &'static str, seconds: f64) {
        self.requests.get_or_create(&OpLabels { op, result }).inc();
        self.latency
            .get_or_create(&OpLabels { op, result })
            .observe(seconds);
    }

    /// Records where an answered write's time went, stage by stage: it was
    /// received at `received`, taken by the request loop at `picked`, submitted
    /// to the group commit at `submitted`, and committed as `committed` says;
    /// its reply has just been sent.
    pub fn write_stages_of(
        &self,
        received: Instant,
        picked: Instant,
        submitted: Instant,
        committed: &Committed,
    ) {
        let replied = Instant::now();
        for (stage, from, to) in [
            (WriteStage::Queued, received, picked),
            (WriteStage::Handled, picked, submitted),
            (WriteStage::Batched, submitted, committed.sent),
            (WriteStage::Stored, committed.sent, committed.acknowledged),
            (WriteStage::Replied, committed.acknowledged, replied),
        ] {
            self.write_stages
                .get_or_create(&StageLabels {
                    stage: stage.name(),
                })
                .observe(to.saturating_duration_since(from).as_secs_f64());
        }
    }
}
