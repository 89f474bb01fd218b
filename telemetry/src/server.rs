//! The `/metrics` endpoint: a minimal HTTP/1.1 server answering `GET /metrics`
//! with the text exposition of a [`MetricsRegistry`], and the GET routes a
//! service adds beside it ([`HttpRoutes`]); any other path gets 404. Small on
//! purpose: one request per connection, no keep-alive, bounded request size.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::{MetricsRegistry, TelemetryError};

/// Largest request head read before answering.
const MAX_REQUEST: usize = 8 * 1024;

/// The answer to one GET of an [`HttpRoutes`] route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpAnswer {
    /// The HTTP status code (200, 400, 404, 500 or 503).
    pub status: u16,
    /// The `Content-Type` header.
    pub content_type: &'static str,
    /// The body.
    pub body: String,
}

impl HttpAnswer {
    /// A 200 answer.
    pub fn ok(content_type: &'static str, body: String) -> Self {
        Self {
            status: 200,
            content_type,
            body,
        }
    }
}

/// The future an [`HttpRoutes::get`] returns.
pub type HttpAnswerFuture<'a> = Pin<Box<dyn Future<Output = Option<HttpAnswer>> + Send + 'a>>;

/// GET routes a service serves next to `/metrics` on the same port.
pub trait HttpRoutes: Send + Sync + 'static {
    /// The answer to `GET path?query` (`query` still percent-encoded, without the
    /// `?`), or `None` for a path these routes do not serve.
    fn get<'a>(&'a self, path: &'a str, query: &'a str) -> HttpAnswerFuture<'a>;
}

/// A running metrics endpoint; stops when dropped.
#[derive(Debug)]
pub struct MetricsServer {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl MetricsServer {
    /// Binds `addr` (port 0 for an ephemeral port) and serves `registry`.
    ///
    /// # Errors
    /// [`TelemetryError::Bind`] when the address cannot be bound.
    pub async fn start(
        addr: SocketAddr,
        registry: MetricsRegistry,
    ) -> Result<Self, TelemetryError> {
        Self::start_with_routes(addr, registry, None).await
    }

    /// Binds `addr` and serves `registry` on `/metrics` and `routes` beside it.
    ///
    /// # Errors
    /// [`TelemetryError::Bind`] when the address cannot be bound.
    pub async fn start_with_routes(
        addr: SocketAddr,
        registry: MetricsRegistry,
        routes: Option<Arc<dyn HttpRoutes>>,
    ) -> Result<Self, TelemetryError> {
        let bind_error = |source| TelemetryError::Bind { addr, source };
        let listener = TcpListener::bind(addr).await.map_err(bind_error)?;
        let addr = listener.local_addr().map_err(bind_error)?;
        let task = tokio::spawn(async move {
            loop {
                match listener.accept().await {
                    Ok((stream, _)) => {
                        let registry = registry.clone();
                        let routes = routes.clone();
                        tokio::spawn(async move {
                            if let Err(error) = answer(stream, &registry, routes.as_deref()).await {
                                tracing::debug!(%error, "metrics request failed");
                            }
                        });
                    }
                    Err(error) => tracing::warn!(%error, "metrics listener accept failed"),
                }
            }
        });
        tracing::info!(%addr, "serving Prometheus metrics on /metrics");
        Ok(Self { addr, task })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        503 => "Service Unavailable",
        _ => "Internal Server Error",
    }
}

async fn answer(
    mut stream: TcpStream,
    registry: &MetricsRegistry,
    routes: Option<&dyn HttpRoutes>,
) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_REQUEST {
        let read = stream.read(&mut buf).await?;
        if read == 0 {
            break;
        }
        head.extend_from_slice(&buf[..read]);
    }
    let request_line = String::from_utf8_lossy(&head);
    let target = request_line.split_whitespace().nth(1).unwrap_or("");
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let answer = if path == "/metrics" {
        match registry.encode() {
            Ok(body) => HttpAnswer::ok(
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                body,
            ),
            Err(_) => HttpAnswer {
                status: 500,
                content_type: "text/plain",
                body: "encoding failed\n".to_owned(),
            },
        }
    } else {
        let routed = match routes {
            Some(routes) => routes.get(path, query).await,
            None => None,
        };
        routed.unwrap_or_else(|| HttpAnswer {
            status: 404,
            content_type: "text/plain",
            body: "try /metrics\n".to_owned(),
        })
    };
    let HttpAnswer {
        status,
        content_type,
        body,
    } = answer;
    let response = format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        reason(status),
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Registrar;

    #[tokio::test]
    async fn serves_the_registry_on_metrics_only() {
        let mut registrar = Registrar::new("hkvm_test");
        let counter = registrar.counter("things", "Things counted");
        counter.inc_by(3);
        let server = MetricsServer::start("127.0.0.1:0".parse().unwrap(), registrar.finish())
            .await
            .unwrap();
        let addr = server.addr();
        let get = |path: &'static str| http_get(addr, path);
        let metrics = get("/metrics").await;
        assert!(metrics.starts_with("HTTP/1.1 200"), "{metrics}");
        assert!(metrics.contains("hkvm_test_things_total 3"), "{metrics}");
        assert!(get("/other").await.starts_with("HTTP/1.1 404"));
    }

    /// The whole answer of `GET path` to the server at `addr`.
    async fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.unwrap();
        answer
    }

    /// Answers `/echo` with its query, and nothing else.
    struct Echo;

    impl HttpRoutes for Echo {
        fn get<'a>(&'a self, path: &'a str, query: &'a str) -> HttpAnswerFuture<'a> {
            Box::pin(async move {
                (path == "/echo").then(|| HttpAnswer {
                    status: if query.is_empty() { 400 } else { 200 },
                    content_type: "text/plain",
                    body: query.to_owned(),
                })
            })
        }
    }

    #[tokio::test]
    async fn serves_added_routes_beside_metrics_with_their_query() {
        let server = MetricsServer::start_with_routes(
            "127.0.0.1:0".parse().unwrap(),
            Registrar::new("hkvm_test").finish(),
            Some(Arc::new(Echo)),
        )
        .await
        .unwrap();
        let addr = server.addr();
        let get = |path: &'static str| http_get(addr, path);
        let echoed = get("/echo?key=a%2Fb").await;
        assert!(echoed.starts_with("HTTP/1.1 200 OK\r\n"), "{echoed}");
        assert!(echoed.ends_with("\r\n\r\nkey=a%2Fb"), "{echoed}");
        assert!(get("/echo").await.starts_with("HTTP/1.1 400 Bad Request"));
        assert!(get("/metrics").await.starts_with("HTTP/1.1 200 OK"));
        assert!(get("/other").await.starts_with("HTTP/1.1 404 Not Found"));
    }
}
