//! Readiness probing through the server's monitoring endpoint: `/healthz` answers
//! 200 only once JetStream is up (and, in a cluster, current with the meta leader).

use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// How long one probe may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Probes `GET /healthz` on `127.0.0.1:port`; `Ok(())` when it answered 200.
///
/// # Errors
/// A description of what the probe saw, for the not-ready report.
pub(crate) async fn probe(port: u16) -> Result<(), String> {
    let attempt = async {
        let mut stream = TcpStream::connect(("127.0.0.1", port))
            .await
            .map_err(|e| format!("connect: {e}"))?;
        stream
            .write_all(b"GET /healthz HTTP/1.0\r\nHost: localhost\r\n\r\n")
            .await
            .map_err(|e| format!("write: {e}"))?;
        let mut answer = Vec::with_capacity(512);
        stream
            .read_to_end(&mut answer)
            .await
            .map_err(|e| format!("read: {e}"))?;
        let text = String::from_utf8_lossy(&answer);
        let status_line = text.lines().next().unwrap_or_default();
        if status_line.contains(" 200 ") {
            Ok(())
        } else {
            let body = text.split("\r\n\r\n").nth(1).unwrap_or_default();
            Err(format!("{status_line} {body}"))
        }
    };
    match tokio::time::timeout(PROBE_TIMEOUT, attempt).await {
        Ok(result) => result,
        Err(_) => Err("health probe timed out".to_owned()),
    }
}
