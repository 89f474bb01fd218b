//! Building a service's Prometheus metrics. A [`Registrar`] registers every metric
//! under the service's prefix as it creates it, so a metrics struct is one struct
//! literal naming each metric once; [`Buckets`] name a histogram layout, so every
//! histogram of a labelled family is alike; the finished [`MetricsRegistry`] is what
//! the `/metrics` endpoint and in-process readers encode.

use std::hash::Hash;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Metric, Registry};

use crate::{MetricsServer, TelemetryError};

/// A gauge holding a fractional value (seconds, ratios).
pub type FloatGauge = Gauge<f64, AtomicU64>;

/// A label set whose names and values are only known at run time.
pub type Labels = Vec<(String, String)>;

/// The label set of a single label `name="value"`.
pub fn label(name: &str, value: &str) -> Labels {
    vec![(name.to_owned(), value.to_owned())]
}

/// A gauge value from an unsigned count; gauges are signed, so a count past
/// `i64::MAX` reads as `i64::MAX` rather than as a negative number.
pub fn gauge_value<T: TryInto<i64>>(value: T) -> i64 {
    value.try_into().unwrap_or(i64::MAX)
}

/// Exponential histogram buckets: `count` upper bounds, the first `start`, each
/// `factor` times the one before.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Buckets {
    /// The first upper bound.
    pub start: f64,
    /// The ratio of one upper bound to the one before.
    pub factor: f64,
    /// How many upper bounds (the `+Inf` bucket comes on top).
    pub count: u16,
}

impl Buckets {
    /// The layout of `count` bounds from `start`, growing by `factor`.
    pub const fn exponential(start: f64, factor: f64, count: u16) -> Self {
        Self {
            start,
            factor,
            count,
        }
    }

    /// An empty histogram with these buckets.
    pub fn histogram(&self) -> Histogram {
        Histogram::new(exponential_buckets(self.start, self.factor, self.count))
    }
}

impl MetricConstructor<Histogram> for Buckets {
    fn new_metric(&self) -> Histogram {
        self.histogram()
    }
}

/// Histograms per label set, all with the same [`Buckets`].
pub type HistogramFamily<L> = Family<L, Histogram, Buckets>;

/// Creates a service's metrics and registers each one as it is created.
#[derive(Debug)]
pub struct Registrar {
    registry: Registry,
}

impl Registrar {
    /// A registrar whose metrics are all named `<prefix>_<name>`.
    pub fn new(prefix: &str) -> Self {
        Self {
            registry: Registry::with_prefix(prefix),
        }
    }

    /// Registers `metric` as `name` with the `help` text and hands it back, to be
    /// kept by the service that updates it.
    pub fn register<M: Metric + Clone>(&mut self, name: &str, help: &str, metric: M) -> M {
        self.registry.register(name, help, metric.clone());
        metric
    }

    /// A registered counter.
    pub fn counter(&mut self, name: &str, help: &str) -> Counter {
        self.register(name, help, Counter::default())
    }

    /// A registered gauge.
    pub fn gauge(&mut self, name: &str, help: &str) -> Gauge {
        self.register(name, help, Gauge::default())
    }

    /// A registered histogram with `buckets`.
    pub fn histogram(&mut self, name: &str, help: &str, buckets: Buckets) -> Histogram {
        self.register(name, help, buckets.histogram())
    }

    /// Registered counters, one per label set.
    pub fn counters<L>(&mut self, name: &str, help: &str) -> Family<L, Counter>
    where
        L: EncodeLabelSet + Clone + Hash + Eq + Send + Sync + std::fmt::Debug + 'static,
    {
        self.register(name, help, Family::default())
    }

    /// Registered gauges, one per label set.
    pub fn gauges<L>(&mut self, name: &str, help: &str) -> Family<L, Gauge>
    where
        L: EncodeLabelSet + Clone + Hash + Eq + Send + Sync + std::fmt::Debug + 'static,
    {
        self.register(name, help, Family::default())
    }

    /// Registered fractional gauges, one per label set.
    pub fn float_gauges<L>(&mut self, name: &str, help: &str) -> Family<L, FloatGauge>
    where
        L: EncodeLabelSet + Clone + Hash + Eq + Send + Sync + std::fmt::Debug + 'static,
    {
        self.register(name, help, Family::default())
    }

    /// Registered histograms with `buckets`, one per label set.
    pub fn histograms<L>(&mut self, name: &str, help: &str, buckets: Buckets) -> HistogramFamily<L>
    where
        L: EncodeLabelSet + Clone + Hash + Eq + Send + Sync + std::fmt::Debug + 'static,
    {
        self.register(name, help, Family::new_with_constructor(buckets))
    }

    /// Ends registration: the registry to serve and read.
    pub fn finish(self) -> MetricsRegistry {
        MetricsRegistry(Arc::new(self.registry))
    }
}

/// A service's registered metrics, shared by its `/metrics` endpoint and by whoever
/// reads them in process.
#[derive(Debug, Clone)]
pub struct MetricsRegistry(Arc<Registry>);

impl MetricsRegistry {
    /// The metrics in the OpenMetrics text format, as `/metrics` serves them.
    ///
    /// # Errors
    /// When a metric fails to encode itself.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.0)?;
        Ok(text)
    }

    /// The metrics in the OpenMetrics text format; empty if a metric fails to encode.
    pub fn text(&self) -> String {
        self.encode().unwrap_or_default()
    }

    /// Serves these metrics on `/metrics` at `addr`, when an address is given.
    ///
    /// # Errors
    /// [`TelemetryError::Bind`] when the address cannot be bound.
    pub async fn serve(
        &self,
        addr: Option<SocketAddr>,
    ) -> Result<Option<MetricsServer>, TelemetryError> {
        self.serve_with_routes(addr, None).await
    }

    /// [`MetricsRegistry::serve`], with `routes` served beside `/metrics`.
    ///
    /// # Errors
    /// [`TelemetryError::Bind`] when the address cannot be bound.
    pub async fn serve_with_routes(
        &self,
        addr: Option<SocketAddr>,
        routes: Option<std::sync::Arc<dyn crate::HttpRoutes>>,
    ) -> Result<Option<MetricsServer>, TelemetryError> {
        match addr {
            Some(addr) => MetricsServer::start_with_routes(addr, self.clone(), routes)
                .await
                .map(Some),
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_are_registered_under_the_prefix_in_order() {
        let mut registrar = Registrar::new("hkvm_test");
        let things = registrar.counter("things", "Things counted");
        let depth = registrar.gauge("depth", "How deep");
        let seconds = registrar.histograms::<Labels>(
            "seconds",
            "Time taken",
            Buckets::exponential(0.5, 2.0, 2),
        );
        let registry = registrar.finish();
        things.inc_by(3);
        depth.set(gauge_value(u64::MAX));
        seconds.get_or_create(&label("op", "put")).observe(0.7);
        let text = registry.text();
        let things_at = text.find("hkvm_test_things_total 3").expect("the counter");
        let depth_at = text
            .find(&format!("hkvm_test_depth {}", i64::MAX))
            .expect("the gauge, saturated");
        assert!(things_at < depth_at, "{text}");
        assert!(
            text.contains("hkvm_test_seconds_bucket{le=\"1.0\",op=\"put\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("hkvm_test_seconds_bucket{le=\"0.5\",op=\"put\"} 0"),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
