//! Prometheus metrics of the inter-DC master (served on `/metrics` by the shared
//! `hkvm-telemetry` endpoint).

use hkvm_telemetry::metrics::Labels;
use hkvm_telemetry::{MetricsRegistry, Registrar};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

/// The inter-DC master's metrics.
#[derive(Debug, Clone)]
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
    registry: MetricsRegistry,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Fresh metrics in their own registry (prefix `hkvm_interdc`).
    pub fn new() -> Self {
        let mut r = Registrar::new("hkvm_interdc");
        Self {
            backlog_keys: r.gauge("backlog_keys", "Blocks still to copy"),
            backlog_bytes: r.gauge("backlog_bytes", "Bytes still to copy"),
            in_flight: r.gauge("in_flight", "Blocks being copied"),
            copied_blocks: r.counter("copied_blocks", "Blocks copied and committed at the target"),
            copied_bytes: r.counter("copied_bytes", "Payload bytes copied"),
            wire_bytes: r.counter(
                "wire_bytes",
                "Bytes sent on the WAN, recovery shards and retransmissions included",
            ),
            stripes_retransmitted: r.counter(
                "stripes_retransmitted",
                "Stripes sent again because FEC could not repair them",
            ),
            fec_recoveries: r.counter(
                "fec_recoveries",
                "Lost shards rebuilt by FEC at the receiver",
            ),
            settled: r.counters(
                "settled",
                "Blocks not copied because the source lost them or the target already had them",
            ),
            failures: r.counters("failures", "Failed copy attempts"),
            given_up: r.counter("given_up", "Blocks given up after too many failed attempts"),
            events_applied: r.counters("events_applied", "Events folded, per side"),
            resyncs: r.counters("resyncs", "Streams re-read from the start, per side"),
            registry: r.finish(),
        }
    }

    /// The registry to serve.
    pub fn registry(&self) -> MetricsRegistry {
        self.registry.clone()
    }
}
