//! Noticing that a NATS connection was replaced. A request sent on a connection
//! that then died gets no answer on the new one: its reply (a JetStream publish
//! acknowledgement, an RPC reply) was lost with the old connection, and the client
//! library lets it wait for its whole timeout (5 s for a JetStream publish, the
//! request timeout for an RPC). A [`ConnectionEpoch`] taken when a request is sent
//! resolves [`ConnectionEpoch::replaced`] as soon as the connection has connected
//! again, so the request is sent again at once instead.
//!
//! Connections learn of their reconnections through [`observe`], which
//! `hkvm_client::connect` installs as the connection's event callback; for a
//! connection made some other way, a slow poll of its connect counter is the
//! fallback.

use std::sync::atomic::Ordering;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use tokio::sync::watch;

/// How often a waiting request checks its connection when no reconnection was
/// announced (connections made without [`observe`]).
const POLL: Duration = Duration::from_millis(500);

/// Bumped whenever any connection of this process connects again.
static RECONNECTED: LazyLock<watch::Sender<u64>> = LazyLock::new(|| watch::Sender::new(0));

/// The event callback of a connection: logs what happened to it and wakes every
/// request waiting on a connection that was replaced. `name` is the connection's
/// name.
pub fn observe(name: &str, event: &async_nats::Event) {
    match event {
        async_nats::Event::Connected => {
            tracing::info!(connection = name, "NATS connection (re)established");
            RECONNECTED.send_modify(|count| *count += 1);
        }
        async_nats::Event::Disconnected => {
            tracing::warn!(
                connection = name,
                "NATS connection lost; reconnecting (requests in flight are sent again)"
            );
        }
        async_nats::Event::LameDuckMode => {
            tracing::warn!(
                connection = name,
                "NATS server entering lame-duck mode; this connection will move"
            );
        }
        other => tracing::debug!(connection = name, event = %other, "NATS connection event"),
    }
}

/// Which connection of a client a request went out on.
#[derive(Debug, Clone)]
pub struct ConnectionEpoch {
    stats: Arc<async_nats::Statistics>,
    connects: u64,
}

impl ConnectionEpoch {
    /// The connection `client` is on now.
    pub fn of(client: &async_nats::Client) -> Self {
        let stats = client.statistics();
        let connects = stats.connects.load(Ordering::Acquire);
        Self { stats, connects }
    }

    /// Whether the client has connected again since this epoch was taken.
    pub fn is_replaced(&self) -> bool {
        self.stats.connects.load(Ordering::Acquire) != self.connects
    }

    /// Resolves once the client has connected again since this epoch was taken
    /// (never, while the connection lasts).
    pub async fn replaced(&self) {
        let mut announced = RECONNECTED.subscribe();
        loop {
            if self.is_replaced() {
                return;
            }
            // Woken by any connection's reconnection, or by the poll.
            let _ = tokio::time::timeout(POLL, announced.changed()).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_reconnection_ends_the_wait_of_a_request_on_the_old_connection() {
        let stats = Arc::new(async_nats::Statistics::default());
        let epoch = ConnectionEpoch {
            stats: Arc::clone(&stats),
            connects: 1,
        };
        stats.connects.store(1, Ordering::Release);
        assert!(!epoch.is_replaced());
        let waiting = tokio::spawn({
            let epoch = epoch.clone();
            async move { epoch.replaced().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        stats.connects.store(2, Ordering::Release);
        observe("test", &async_nats::Event::Connected);
        tokio::time::timeout(Duration::from_millis(200), waiting)
            .await
            .expect("woken by the announcement, well before the poll")
            .unwrap();
        assert!(epoch.is_replaced());
    }
}
