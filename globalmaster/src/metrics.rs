//! Prometheus metrics of a global master, and a minimal `/metrics` HTTP exporter
//! (one tokio listener, no web framework) that any HKVM service can reuse with its
//! own [`Registry`].

use std::net::SocketAddr;
use std::sync::Arc;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpListener;

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

    /// The registry, for [`serve_metrics`].
    pub fn registry(&self) -> Arc<Registry> {
        Arc::clone(&self.registry)
    }
}

/// Renders `registry` in the Prometheus text format.
pub fn render(registry: &Registry) -> String {
    let mut text = String::new();
    if let Err(error) = encode(&mut text, registry) {
        tracing::warn!(%error, "encoding metrics");
    }
    text
}

/// Binds `addr` and serves `GET /metrics` from `registry` until the task is
/// aborted. Returns the bound address (useful with port 0) and the task.
///
/// # Errors
/// When the address cannot be bound.
pub async fn serve_metrics(
    addr: SocketAddr,
    registry: Arc<Registry>,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = listener.accept().await else {
                continue;
            };
            let registry = Arc::clone(&registry);
            tokio::spawn(async move {
                // One small request per connection: read the request head, answer,
                // close. Anything but `GET /metrics` gets a 404.
                let mut buf = vec![0u8; 2048];
                let read = socket.read(&mut buf).await.unwrap_or(0);
                let head = String::from_utf8_lossy(&buf[..read]);
                let response = if head.starts_with("GET /metrics") {
                    let body = render(&registry);
                    format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    )
                } else {
                    "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                        .to_owned()
                };
                let _ = socket.write_all(response.as_bytes()).await;
                let _ = socket.shutdown().await;
            });
        }
    });
    Ok((bound, task))
}
