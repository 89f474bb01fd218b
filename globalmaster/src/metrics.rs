//! Prometheus metrics of a global master (served on `/metrics` by the shared
//! `hkvm-telemetry` endpoint).

use hkvm_telemetry::metrics::{label, Buckets, FloatGauge, HistogramFamily, Labels};
use hkvm_telemetry::{MetricsRegistry, Registrar};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

/// Query handling time: 20 µs .. ~1.3 s.
const LATENCY: Buckets = Buckets::exponential(20e-6, 2.0, 17);

/// The global master's metrics.
#[derive(Debug, Clone)]
pub struct Metrics {
    /// Events folded into the projection, per source.
    pub events_applied: Family<Labels, Counter>,
    /// Messages folded, per source.
    pub messages_applied: Family<Labels, Counter>,
    /// Events per source not yet applied.
    pub lag_events: Family<Labels, Gauge>,
    /// How old a source's newest applied message is while events of it wait
    /// to be applied, in seconds (0 when caught up): the answers' staleness.
    pub lag_seconds: Family<Labels, FloatGauge>,
    /// Times a source was re-read from scratch, per source and reason.
    pub resyncs: Family<Labels, Counter>,
    /// Query handling time in seconds, per operation.
    pub query_seconds: HistogramFamily<Labels>,
    /// Queries answered `Busy`, per operation.
    pub busy: Family<Labels, Counter>,
    /// Sync lookups that caught up with the streams before answering a miss.
    pub sync_waits: Counter,
    /// Distinct keys indexed.
    pub keys: Gauge,
    /// Index memory in bytes.
    pub index_bytes: Gauge,
    /// Checkpoints written.
    pub checkpoints: Counter,
    /// Open direct connections (clients' queries without NATS).
    pub direct_connections: Gauge,
    registry: MetricsRegistry,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// The label set naming one source sub-cluster.
pub fn source_label(subcluster: &str) -> Labels {
    label("subcluster", subcluster)
}

/// The label set naming one operation.
pub fn op_label(op: &str) -> Labels {
    label("op", op)
}

impl Metrics {
    /// Fresh metrics registered under the `hkvm_global` prefix.
    pub fn new() -> Self {
        let mut r = Registrar::new("hkvm_global");
        Self {
            events_applied: r.counters("events_applied", "Events folded into the projection"),
            messages_applied: r.counters(
                "messages_applied",
                "Stream messages folded into the projection",
            ),
            lag_events: r.gauges("lag_events", "Events of a source not yet applied"),
            lag_seconds: r.float_gauges(
                "lag_seconds",
                "How old a source's newest applied event is while later ones wait, in seconds (0 when caught up)",
            ),
            resyncs: r.counters("resyncs", "Sources re-read from scratch"),
            query_seconds: r.histograms("query_seconds", "Query handling time", LATENCY),
            busy: r.counters("busy", "Queries answered Busy"),
            sync_waits: r.counter(
                "sync_waits",
                "Sync lookups that caught up with the event streams before answering a miss",
            ),
            keys: r.gauge("keys", "Distinct keys indexed"),
            index_bytes: r.gauge("index_bytes", "Index memory in bytes"),
            checkpoints: r.counter("checkpoints", "Checkpoints written"),
            direct_connections: r.gauge(
                "direct_connections",
                "Open direct connections of clients (queries without NATS)",
            ),
            registry: r.finish(),
        }
    }

    /// The registry, to serve on `/metrics`.
    pub fn registry(&self) -> MetricsRegistry {
        self.registry.clone()
    }
}
