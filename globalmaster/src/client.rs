//! Calling the global master: typed requests with `Busy` retried after the
//! suggested delay plus jitter, for the CLI, benchmarks and tests.

use std::time::Duration;

use hkvm_events::rpc::global::GlobalOp;
use hkvm_events::rpc::{decode, encode, RpcError, RpcErrorCode, RpcReply};
use hkvm_events::subject::global_rpc_subject;
use hkvm_events::ClusterId;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// A handle for global-master requests of one cluster.
#[derive(Debug, Clone)]
pub struct GlobalClient {
    client: async_nats::Client,
    cluster: ClusterId,
    /// How long to keep retrying `Busy` answers before giving up.
    pub busy_budget: Duration,
    /// How long one attempt may take before it is retried (queries are read-only,
    /// so a request lost with a replica that stopped is simply asked again).
    pub attempt_timeout: Duration,
}

impl GlobalClient {
    /// A handle over `client` for `cluster`.
    pub fn new(client: async_nats::Client, cluster: ClusterId) -> Self {
        Self {
            client,
            cluster,
            busy_budget: Duration::from_secs(30),
            attempt_timeout: Duration::from_secs(2),
        }
    }

    /// Sends `request` once and returns the decoded reply (which may be `Busy`).
    ///
    /// # Errors
    /// `Internal` when NATS fails or nobody answers; the server's error otherwise.
    pub async fn call_once<Req: Serialize, Rep: DeserializeOwned>(
        &self,
        op: GlobalOp,
        request: &Req,
    ) -> Result<Rep, RpcError> {
        let payload = encode(request)?;
        let answer = self
            .client
            .request(global_rpc_subject(&self.cluster, op.name()), payload.into())
            .await
            .map_err(|e| RpcError::new(RpcErrorCode::Internal, format!("request failed: {e}")))?;
        let reply: RpcReply<Rep> = decode(&answer.payload)?;
        reply.into_result()
    }

    /// Sends `request`, retrying `Busy` answers, attempts without an answer in
    /// [`GlobalClient::attempt_timeout`], and "no responders" (while no replica is
    /// up yet) until [`GlobalClient::busy_budget`] is spent.
    ///
    /// # Errors
    /// The last error when the budget is spent, or any other error at once.
    pub async fn call<Req: Serialize, Rep: DeserializeOwned>(
        &self,
        op: GlobalOp,
        request: &Req,
    ) -> Result<Rep, RpcError> {
        let started = tokio::time::Instant::now();
        let mut attempt: u64 = 0;
        loop {
            let answer = tokio::time::timeout(self.attempt_timeout, self.call_once(op, request))
                .await
                .unwrap_or_else(|_| Err(RpcError::busy(0, "no answer in time")));
            let retry_after = match answer {
                Err(RpcError {
                    code: RpcErrorCode::Busy { retry_after_ms },
                    ..
                }) => retry_after_ms,
                Err(error)
                    if error.code == RpcErrorCode::Internal
                        && error.message.contains("no responders") =>
                {
                    100
                }
                other => return other,
            };
            if started.elapsed() > self.busy_budget {
                return Err(RpcError::busy(retry_after, "still busy, giving up"));
            }
            attempt += 1;
            // Jitter without a random source: spread retries by the attempt count and
            // the clock's low bits, enough to de-synchronize clients.
            let nanos = u64::from(started.elapsed().subsec_nanos());
            let jitter = (nanos ^ attempt.wrapping_mul(0x9e37_79b9)) % (retry_after / 2 + 1);
            tokio::time::sleep(Duration::from_millis(retry_after + jitter)).await;
        }
    }
}
