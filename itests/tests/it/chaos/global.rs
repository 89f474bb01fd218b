//! Asking the global master from the test: which sub-clusters hold keys, polled
//! until the (weakly consistent) projection has caught up.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use hkvm_client::GlobalClient;
use hkvm_events::rpc::global::{BatchIsExist, BatchIsExistReply, GlobalOp, LabelFilter, LabelMode};
use hkvm_events::ClusterId;

use super::topology::{Topology, CLUSTER};

/// A global-master client from the test (through NATS node `nats`).
pub async fn client(topology: &Topology, nats: usize) -> GlobalClient {
    GlobalClient::new(
        topology.connect(nats).await,
        ClusterId::new(CLUSTER).unwrap(),
    )
}

/// A label filter `key=value` in `mode`.
pub fn labels(key: &str, value: &str, mode: LabelMode) -> Option<LabelFilter> {
    Some(LabelFilter {
        labels: BTreeMap::from([(key.to_owned(), value.to_owned())]),
        mode,
    })
}

/// One `batch_is_exist`: per key, the names of the sub-clusters holding it.
pub async fn holders(
    global: &GlobalClient,
    keys: &[String],
    labels: Option<LabelFilter>,
) -> Vec<Vec<String>> {
    let request = BatchIsExist {
        keys: keys.to_vec(),
        labels,
    };
    let reply: BatchIsExistReply = global.call(GlobalOp::BatchIsExist, &request).await.unwrap();
    (0..keys.len())
        .map(|i| {
            reply
                .holders_of(i)
                .into_iter()
                .map(|s| s.as_str().to_owned())
                .collect()
        })
        .collect()
}

/// Polls until every key is held somewhere (the projection caught up); returns
/// how long that took.
pub async fn wait_all_held(global: &GlobalClient, keys: &[String]) -> Duration {
    let started = Instant::now();
    loop {
        let mut unheld = 0;
        for chunk in keys.chunks(1000) {
            unheld += holders(global, chunk, None)
                .await
                .iter()
                .filter(|h| h.is_empty())
                .count();
        }
        if unheld == 0 {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{unheld} keys never reached the global index"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
