//! Prometheus metrics of the inter-DC master (served on `/metrics` by the shared
//! `hkvm-telemetry` endpoint).

use std::sync::Arc;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Label set of labelled metrics.
pub type Labels = Vec<(String, String)>;

/// One label pair.
pub fn label(name: &str, value: &str) -> Labels {
    vec![(name.to_owned(), value.to_owned())]
}

/// The inter-DC master's metrics.
#[derive(Clone)]
pub struct Metrics {
    /// Blocks still to copy.
    pub backlog_keys: Gauge,
    /// Bytes still to copy.
    pub backlog_bytes: Gauge,
    /// Blocks being copied.
    pub in_flight: Gauge,
    /// Blocks copied and committed at the target.
    pub copied_blocks: Counter,
    /// Payload bytes copied.
    pub copied_bytes: Counter,
    /// Bytes sent on the WAN (recovery shards, retransmissions, headers included).
    pub wire_bytes: Counter,
    /// Stripes sent again because FEC could not repair them.
    pub stripes_retransmitted: Counter,
    /// Lost shards FEC rebuilt at the receiver.
    pub fec_recoveries: Counter,
    /// Blocks not copied, by reason (the source lost it, the target already had it).
    pub settled: Family<Labels, Counter>,
    /// Failed copy attempts, by reason.
    pub failures: Family<Labels, Counter>,
    /// Blocks given up after too many failed attempts.
    pub given_up: Counter,
    /// Events folded, per side.
    pub events_applied: Family<Labels, Counter>,
    /// Streams re-read from the start, per side.
    pub resyncs: Family<Labels, Counter>,
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

impl Metrics {
    /// Fresh metrics in their own registry (prefix `hkvm_interdc`).
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("hkvm_interdc");
        let metrics = Self {
            backlog_keys: Gauge::default(),
            backlog_bytes: Gauge::default(),
            in_flight: Gauge::default(),
            copied_blocks: Counter::default(),
            copied_bytes: Counter::default(),
            wire_bytes: Counter::default(),
            stripes_retransmitted: Counter::default(),
            fec_recoveries: Counter::default(),
            settled: Family::default(),
            failures: Family::default(),
            given_up: Counter::default(),
            events_applied: Family::default(),
            resyncs: Family::default(),
            registry: Arc::new(Registry::default()),
        };
        registry.register(
            "backlog_keys",
            "Blocks still to copy",
            metrics.backlog_keys.clone(),
        );
        registry.register(
            "backlog_bytes",
            "Bytes still to copy",
            metrics.backlog_bytes.clone(),
        );
        registry.register(
            "in_flight",
            "Blocks being copied",
            metrics.in_flight.clone(),
        );
        registry.register(
            "copied_blocks",
            "Blocks copied and committed at the target",
            metrics.copied_blocks.clone(),
        );
        registry.register(
            "copied_bytes",
            "Payload bytes copied",
            metrics.copied_bytes.clone(),
        );
        registry.register(
            "wire_bytes",
            "Bytes sent on the WAN, recovery shards and retransmissions included",
            metrics.wire_bytes.clone(),
        );
        registry.register(
            "stripes_retransmitted",
            "Stripes sent again because FEC could not repair them",
            metrics.stripes_retransmitted.clone(),
        );
        registry.register(
            "fec_recoveries",
            "Lost shards rebuilt by FEC at the receiver",
            metrics.fec_recoveries.clone(),
        );
        registry.register(
            "settled",
            "Blocks not copied because the source lost them or the target already had them",
            metrics.settled.clone(),
        );
        registry.register("failures", "Failed copy attempts", metrics.failures.clone());
        registry.register(
            "given_up",
            "Blocks given up after too many failed attempts",
            metrics.given_up.clone(),
        );
        registry.register(
            "events_applied",
            "Events folded, per side",
            metrics.events_applied.clone(),
        );
        registry.register(
            "resyncs",
            "Streams re-read from the start, per side",
            metrics.resyncs.clone(),
        );
        Self {
            registry: Arc::new(registry),
            ..metrics
        }
    }

    /// The registry to serve.
    pub fn registry(&self) -> Arc<Registry> {
        Arc::clone(&self.registry)
    }
}
