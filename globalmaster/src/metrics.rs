//! Prometheus metrics of a global master (served on `/metrics` by the shared
//! `hkvm-telemetry` endpoint).

use std::sync::Arc;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Label set of per-source and per-operation metrics.
type Labels = Vec<(String, String)>;

fn latency_histogram() -> Histogram {
    // 20 µs .. ~1.3 s.
    Histogram::new(exponential_buckets(20e-6, 2.0, 17))
}

/// The global master's metrics.
#[derive(Clone)]
pub struct Metrics {
    /// Events folded into the projection, per source.
    pub events_applied: Family<Labels, Counter>,
    /// Messages folded, per source.
    pub messages_applied: Family<Labels, Counter>,
    /// Events per source not yet applied.
    pub lag_events: Family<Labels, Gauge>,
    /// Times a source was re-read from scratch, per source and reason.
    pub resyncs: Family<Labels, Counter>,
    /// Query handling time in seconds, per operation.
    pub query_seconds: Family<Labels, Histogram, fn() -> Histogram>,
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
    registry: Arc<Registry>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// The label set naming one source sub-cluster.
pub fn source_label(subcluster: &str) -> Labels {
    vec![("subcluster".to_owned(), subcluster.to_owned())]
}

/// The label set naming one operation.
pub fn op_label(op: &str) -> Labels {
    vec![("op".to_owned(), op.to_owned())]
}

impl Metrics {
    /// Fresh metrics registered under the `hkvm_global` prefix.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("hkvm_global");
        let metrics = Self {
            events_applied: Family::default(),
            messages_applied: Family::default(),
            lag_events: Family::default(),
            resyncs: Family::default(),
            query_seconds: Family::new_with_constructor(latency_histogram),
            busy: Family::default(),
            sync_waits: Counter::default(),
            keys: Gauge::default(),
            index_bytes: Gauge::default(),
            checkpoints: Counter::default(),
            registry: Arc::new(Registry::default()),
        };
        registry.register(
            "events_applied",
            "Events folded into the projection",
            metrics.events_applied.clone(),
        );
        registry.register(
            "messages_applied",
            "Stream messages folded into the projection",
            metrics.messages_applied.clone(),
        );
        registry.register(
            "lag_events",
            "Events of a source not yet applied",
            metrics.lag_events.clone(),
        );
        registry.register(
            "resyncs",
            "Sources re-read from scratch",
            metrics.resyncs.clone(),
        );
        registry.register(
            "query_seconds",
            "Query handling time",
            metrics.query_seconds.clone(),
        );
        registry.register("busy", "Queries answered Busy", metrics.busy.clone());
        registry.register(
            "sync_waits",
            "Sync lookups that caught up with the event streams before answering a miss",
            metrics.sync_waits.clone(),
        );
        registry.register("keys", "Distinct keys indexed", metrics.keys.clone());
        registry.register(
            "index_bytes",
            "Index memory in bytes",
            metrics.index_bytes.clone(),
        );
        registry.register(
            "checkpoints",
            "Checkpoints written",
            metrics.checkpoints.clone(),
        );
        Self {
            registry: Arc::new(registry),
            ..metrics
        }
    }

    /// The registry, to serve on `/metrics`.
    pub fn registry(&self) -> Arc<Registry> {
        Arc::clone(&self.registry)
    }
}
