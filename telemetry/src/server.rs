//! The `/metrics` endpoint: a minimal HTTP/1.1 server answering `GET /metrics`
//! (any other path gets 404) with the text exposition of a [`MetricsRegistry`].
//! Small on purpose: one request per connection, no keep-alive, bounded request
//! size.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::{MetricsRegistry, TelemetryError};

/// Largest request head read before answering.
const MAX_REQUEST: usize = 8 * 1024;

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
        let bind_error = |source| TelemetryError::Bind { addr, source };
        let listener = TcpListener::bind(addr).await.map_err(bind_error)?;
        let addr = listener.local_addr().map_err(bind_error)?;
        let task = tokio::spawn(async move {
            loop {
                match listener.accept().await {
                    Ok((stream, _)) => {
                        let registry = registry.clone();
                        tokio::spawn(async move {
                            if let Err(error) = answer(stream, &registry).await {
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

async fn answer(mut stream: TcpStream, registry: &MetricsRegistry) -> std::io::Result<()> {
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
    let path = request_line.split_whitespace().nth(1).unwrap_or("");
    let (status, content_type, body) = if path == "/metrics" {
        match registry.encode() {
            Ok(body) => (
                "200 OK",
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                body,
            ),
            Err(_) => (
                "500 Internal Server Error",
                "text/plain",
                "encoding failed\n".to_owned(),
            ),
        }
    } else {
        ("404 Not Found", "text/plain", "try /metrics\n".to_owned())
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
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
        let get = |path: &'static str| async move {
            let mut stream = TcpStream::connect(addr).await.unwrap();
            stream
                .write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
                .await
                .unwrap();
            let mut answer = String::new();
            stream.read_to_string(&mut answer).await.unwrap();
            answer
        };
        let metrics = get("/metrics").await;
        assert!(metrics.starts_with("HTTP/1.1 200"), "{metrics}");
        assert!(metrics.contains("hkvm_test_things_total 3"), "{metrics}");
        assert!(get("/other").await.starts_with("HTTP/1.1 404"));
    }
}
