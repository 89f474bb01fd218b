//! The sub-master's Prometheus metrics.

use std::time::Instant;

use hkvm_events::commit::Committed;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

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
    pub latency: Family<OpLabels, Histogram>,
    /// Where the time of write requests that append goes, by stage.
    pub write_stages: Family<StageLabels, Histogram>,
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
}

fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.000_05, 2.0, 16))
}

fn stage_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.000_002, 2.0, 18))
}

impl SubmasterMetrics {
    /// Creates the metrics and registers them under `hkvm_submaster_`.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self {
            requests: Family::default(),
            latency: Family::new_with_constructor(latency_histogram),
            write_stages: Family::new_with_constructor(stage_histogram),
            events_appended: Counter::default(),
            commit_events: Histogram::new(exponential_buckets(1.0, 2.0, 14)),
            objects: Gauge::default(),
            pending_puts: Gauge::default(),
            space_leases: Gauge::default(),
            used_bytes: Gauge::default(),
            capacity_bytes: Gauge::default(),
            evicted: Counter::default(),
            nodes_lost: Counter::default(),
            role: Gauge::default(),
            applied_seq: Gauge::default(),
            standby_lag: Gauge::default(),
            snapshots: Counter::default(),
            snapshots_rebuilt: Counter::default(),
            purged_messages: Counter::default(),
            history_first_seq: Gauge::default(),
            standby_snapshots: Gauge::default(),
            undecodable: Counter::default(),
            takeovers: Counter::default(),
        };
        let sub = registry.sub_registry_with_prefix("hkvm_submaster");
        sub.register("requests", "Requests handled", metrics.requests.clone());
        sub.register(
            "request_seconds",
            "Request latency",
            metrics.latency.clone(),
        );
        sub.register(
            "write_stage_seconds",
            "Time a write request that appends spends in each stage, receipt to reply",
            metrics.write_stages.clone(),
        );
        sub.register(
            "events_appended",
            "Events appended to the stream",
            metrics.events_appended.clone(),
        );
        sub.register(
            "commit_events",
            "Events per commit",
            metrics.commit_events.clone(),
        );
        sub.register("objects", "Complete objects", metrics.objects.clone());
        sub.register("pending_puts", "Pending puts", metrics.pending_puts.clone());
        sub.register(
            "space_leases",
            "Space leases held by clients",
            metrics.space_leases.clone(),
        );
        sub.register("used_bytes", "Bytes allocated", metrics.used_bytes.clone());
        sub.register(
            "capacity_bytes",
            "Bytes mounted",
            metrics.capacity_bytes.clone(),
        );
        sub.register("evicted", "Objects evicted", metrics.evicted.clone());
        sub.register(
            "nodes_lost",
            "Nodes declared lost",
            metrics.nodes_lost.clone(),
        );
        sub.register(
            "role",
            "0 standby, 1 recovering, 2 leader",
            metrics.role.clone(),
        );
        sub.register(
            "applied_seq",
            "Last applied stream sequence",
            metrics.applied_seq.clone(),
        );
        sub.register(
            "standby_lag",
            "Events behind the stream end",
            metrics.standby_lag.clone(),
        );
        sub.register("snapshots", "Snapshots written", metrics.snapshots.clone());
        sub.register(
            "snapshots_rebuilt",
            "Snapshots a leader without a standby rebuilt from the newest snapshot plus the stream",
            metrics.snapshots_rebuilt.clone(),
        );
        sub.register(
            "purged_messages",
            "Stream messages purged after verified snapshots",
            metrics.purged_messages.clone(),
        );
        sub.register(
            "standby_snapshots",
            "1 while this leader leaves the snapshots to a hot standby",
            metrics.standby_snapshots.clone(),
        );
        sub.register(
            "history_first_seq",
            "The stream's first sequence after the last purge",
            metrics.history_first_seq.clone(),
        );
        sub.register(
            "undecodable",
            "Stream messages or events skipped as undecodable",
            metrics.undecodable.clone(),
        );
        sub.register("takeovers", "Leaderships taken", metrics.takeovers.clone());
        metrics
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

/// Gauge value from an unsigned count.
pub fn gauge_value(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}
