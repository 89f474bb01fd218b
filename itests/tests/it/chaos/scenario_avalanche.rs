//! Scenario 6: the avalanche. A sub-master whose stream holds over a million events
//! (metadata-only puts on large virtual segments; snapshots off, so recovery
//! replays them all) is killed and restarted while thousands of clients retry.
//! It recovers without crashing, its memory stays bounded (peak reported), and no
//! object is lost. Clients first find no sub-master at all (a restarting one does
//! not answer before it leads: "leader waits"), then, once it leads, its request
//! queue (kept small here) overflows under the storm and they are told `Busy`;
//! every one of them succeeds in the end.
//! Skipped when `HKVM_ITESTS_QUICK=1` (local runs only; CI runs it).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use hkvm_client::{RetryPolicy, SubmasterClient};
use hkvm_events::rpc::submaster::{ItemResult, MountSegment, PutEndItem, PutStartItem};
use hkvm_events::{ClusterId, NodeId, SegmentId, SubclusterId};
use tokio::sync::watch;

use super::topology::{Spec, Topology, CLUSTER};
use super::{docker, report};

/// Objects put before the restart (one `put` event each, plus mounts).
const OBJECTS: usize = 1_000_000;
/// Clients retrying during the restart.
const CLIENTS: usize = 2000;

/// Puts `keys` (metadata only); `Ok` only if every item was acknowledged. Each
/// put carries an id, as every client's put does, so its `put_end` may be sent
/// again after a timeout.
async fn put_batch(client: &SubmasterClient, keys: Vec<String>) -> Result<(), String> {
    let ids: Vec<u64> = keys
        .iter()
        .map(|key| hkvm_events::key_hash(key) | 1)
        .collect();
    let starts = keys
        .iter()
        .zip(&ids)
        .map(|(key, &put_id)| PutStartItem {
            key: key.clone(),
            size: 64,
            replicas: 1,
            preferred_segment: None,
            hard_pin: false,
            put_id,
            avoid_nodes: Vec::new(),
        })
        .collect();
    let started = client.put_start(starts).await.map_err(|e| e.to_string())?;
    if let Some(ItemResult::Err(error)) = started.iter().find(|r| matches!(r, ItemResult::Err(_))) {
        return Err(error.to_string());
    }
    let ends = keys
        .into_iter()
        .zip(ids)
        .map(|(key, put_id)| PutEndItem {
            key,
            checksum: 1,
            put_id,
        })
        .collect();
    let ended = client.put_end(ends).await.map_err(|e| e.to_string())?;
    match ended.iter().find(|r| matches!(r, ItemResult::Err(_))) {
        Some(error) => Err(format!("{error:?}")),
        None => Ok(()),
    }
}

/// Polls the container's memory until `stop`; returns the peak in bytes.
async fn peak_memory(
    container: &super::topology::Container,
    mut stop: watch::Receiver<bool>,
) -> u64 {
    let mut peak = 0;
    while !*stop.borrow() {
        peak = peak.max(docker::memory_bytes(container).await.unwrap_or(0));
        let _ = tokio::time::timeout(Duration::from_millis(100), stop.changed()).await;
    }
    peak
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_under_a_retry_storm_recovers_with_bounded_memory() {
    let Some(scenario) =
        report::Scenario::start_slow("6 avalanche restart (1M events, 2000 clients)")
    else {
        return;
    };
    let spec = Spec {
        subclusters: vec![("sc-av", "zone=a")],
        submasters: 1,
        nodes: 0,
        globals: 0,
        submaster_toml: "leader_lease_ttl_ms = 1000\nsnapshot_every_events = 100000000\n\
                         snapshot_interval_ms = 3600000\nrequest_queue = 16\n\
                         node_timeout_ms = 600000\n"
            .to_owned(),
        ..Spec::default()
    };
    let topology = Topology::start(&spec).await;
    let client = topology.client("sc-av").await;
    for node in ["v0", "v1"] {
        client
            .mount_segment(MountSegment {
                node: NodeId::new(node).unwrap(),
                segment: SegmentId::new(format!("{node}-s")).unwrap(),
                size: 1 << 40,
                endpoint: format!("{node}:1"),
                rdma: None,
            })
            .await
            .unwrap();
    }
    let filling = Instant::now();
    let fillers: Vec<_> = (0..8)
        .map(|f| {
            let client = client.clone();
            tokio::spawn(async move {
                for batch in (f..OBJECTS / 4000).step_by(8) {
                    let keys = (0..4000).map(|i| format!("av-{batch}-{i}")).collect();
                    put_batch(&client, keys).await.unwrap();
                }
            })
        })
        .collect();
    for filler in fillers {
        filler.await.unwrap();
    }
    let fill_s = filling.elapsed().as_secs_f64();
    let before = client.status().await.unwrap();
    assert_eq!(before.objects, OBJECTS as u64);
    let sm = topology.container("sc-av/0");
    let rss_before = docker::memory_bytes(sm).await.unwrap_or(0);

    docker::kill(sm).await;
    let (stop_tx, stop_rx) = watch::channel(false);
    let nats = topology.connect(0).await;
    let storm: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let client = SubmasterClient::with_policy(
                nats.clone(),
                ClusterId::new(CLUSTER).unwrap(),
                SubclusterId::new("sc-av").unwrap(),
                RetryPolicy {
                    request_timeout: Duration::from_secs(2),
                    retry_deadline: Duration::from_secs(120),
                    ..RetryPolicy::default()
                },
            );
            tokio::spawn(async move {
                let exists = client.exist(vec![format!("av-0-{c}")]).await;
                let put = put_batch(&client, vec![format!("storm-{c}")]).await;
                let stats = client.stats();
                let failure = match (&exists, &put) {
                    (Ok(found), Ok(())) if *found == vec![true] => None,
                    (Ok(found), Ok(())) => Some(format!("exist answered {found:?}")),
                    (Err(error), _) => Some(format!("exist: {error}")),
                    (_, Err(error)) => Some(format!("put: {error}")),
                };
                (
                    failure,
                    stats.busy.load(Ordering::Relaxed),
                    stats.leader_waits.load(Ordering::Relaxed),
                )
            })
        })
        .collect();
    let restarted = Instant::now();
    sm.start().await.unwrap();
    let (results, peak_bytes) = tokio::join!(
        async {
            let mut results = Vec::new();
            for client in storm {
                results.push(client.await.unwrap());
            }
            let _ = stop_tx.send(true);
            results
        },
        peak_memory(sm, stop_rx),
    );
    let recovered_ms = restarted.elapsed().as_millis();
    let succeeded = results
        .iter()
        .filter(|(failure, _, _)| failure.is_none())
        .count();
    let failures: Vec<&String> = results
        .iter()
        .filter_map(|(f, _, _)| f.as_ref())
        .take(5)
        .collect();
    let busy: u64 = results.iter().map(|(_, b, _)| b).sum();
    let waits: u64 = results.iter().map(|(_, _, w)| w).sum();
    let after = client.status().await.unwrap();
    assert!(sm.is_running().await.unwrap(), "the sub-master crashed");
    assert_eq!(
        succeeded, CLIENTS,
        "every retrying client succeeds; failures: {failures:?}"
    );
    assert_eq!(after.objects, (OBJECTS + CLIENTS) as u64, "no object lost");
    assert!(
        busy > 0,
        "clients were told Busy ({waits} waits for a leader)"
    );
    assert!(peak_bytes < 2 << 30, "peak memory {peak_bytes} bytes");
    scenario.passed(
        &format!("all clients served {recovered_ms} ms after restart"),
        0,
        &format!(
            "{} objects in {} stream messages replayed; peak {} MiB (before kill {} MiB); {busy} Busy, {waits} leader waits; fill {fill_s:.1} s",
            after.objects,
            after.applied_seq,
            peak_bytes >> 20,
            rss_before >> 20
        ),
    );
}
