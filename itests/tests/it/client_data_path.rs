//! The data path end to end on real NATS, a real sub-master and real nodes serving
//! mmap'd segments over TCP: byte-exact round trips, distinct replicas, a node dying
//! mid-put (and puts placed elsewhere while it stays mounted), a vanished replica
//! and corrupted replicas caught by the checksum.

use std::time::Duration;

use hkvm_client::KvError;
use hkvm_events::rpc::submaster::{ItemError, ItemResult, PutStartItem};
use hkvm_transfer::TcpConfig;

use crate::fixture::{quick_failover, Pool, PoolSpec};

/// One sub-cluster `sc` with `nodes` nodes of `segment_size` bytes and a KV
/// client whose transport gives up on a node after 5 s.
async fn cluster(nodes: usize, segment_size: u64) -> Pool {
    Pool::start(
        PoolSpec::new("dp")
            .subcluster("sc", &[])
            .nodes(nodes, segment_size)
            .tcp(TcpConfig {
                request_timeout: Duration::from_secs(5),
                ..TcpConfig::default()
            }),
    )
    .await
}

fn value(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[tokio::test]
async fn values_from_one_byte_to_64_mib_round_trip_byte_exact() {
    let c = cluster(3, 256 << 20).await;
    for (i, len) in [1usize, 1000, 64 << 10, 1 << 20, 64 << 20]
        .into_iter()
        .enumerate()
    {
        let key = format!("v{len}");
        let bytes = value(len, i as u8);
        c.kv["sc"].put(&key, &bytes, 2).await.unwrap();
        let fetched = c.kv["sc"].get(&key).await.unwrap();
        assert_eq!(fetched.value.len(), len);
        assert!(
            fetched.value[..] == bytes[..],
            "value of {len} bytes differs"
        );
    }
    // Replicas are on distinct nodes.
    let lists = c.kv["sc"]
        .metadata()
        .get_replica_list(vec!["v1000".into()])
        .await
        .unwrap();
    let ItemResult::Ok(list) = &lists[0] else {
        panic!()
    };
    assert_eq!(list.replicas.len(), 2);
    assert_ne!(list.replicas[0].node, list.replicas[1].node);
    c.shutdown().await;
}

#[tokio::test]
async fn batch_puts_and_gets_keep_order_and_report_per_item() {
    let c = cluster(2, 16 << 20).await;
    let values: Vec<Vec<u8>> = (0..20).map(|i| value(1000 + i, i as u8)).collect();
    let keys: Vec<String> = (0..20).map(|i| format!("b{i}")).collect();
    let items: Vec<(&str, &[u8])> = keys
        .iter()
        .map(String::as_str)
        .zip(values.iter().map(Vec::as_slice))
        .collect();
    let results = c.kv["sc"].put_many(&items, 2).await.unwrap();
    assert!(results.iter().all(Result::is_ok));
    let again = c.kv["sc"].put_many(&items[..1], 2).await.unwrap();
    assert!(matches!(
        &again[0],
        Err(KvError::Item {
            error: ItemError::AlreadyExists,
            ..
        })
    ));
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let fetched = c.kv["sc"].get_many(&key_refs).await.unwrap();
    for (fetched, expected) in fetched.into_iter().zip(&values) {
        assert_eq!(&fetched.unwrap().value[..], &expected[..]);
    }
    c.shutdown().await;
}

#[tokio::test]
async fn corrupted_replicas_are_caught_and_never_returned() {
    let mut c = cluster(2, 16 << 20).await;
    let bytes = value(4096, 9);
    c.kv["sc"].put("k", &bytes, 2).await.unwrap();
    let lists = c.kv["sc"]
        .metadata()
        .get_replica_list(vec!["k".into()])
        .await
        .unwrap();
    let ItemResult::Ok(list) = &lists[0] else {
        panic!()
    };
    let node_of = |segment: &str| {
        c.nodes
            .iter()
            .position(|n| n.segment().id().as_str() == segment)
            .unwrap()
    };

    // One replica corrupted: the other one is read.
    let first = &list.replicas[0];
    c.nodes[node_of(first.segment.as_str())]
        .segment()
        .write_at(first.offset + 10, b"garbage")
        .unwrap();
    let fetched = c.kv["sc"].get("k").await.unwrap();
    assert_eq!(&fetched.value[..], &bytes[..]);
    assert_eq!(fetched.replica.segment, list.replicas[1].segment);

    // Both corrupted: a typed integrity error, never wrong bytes.
    let second = &list.replicas[1];
    c.nodes[node_of(second.segment.as_str())]
        .segment()
        .write_at(second.offset, b"evil")
        .unwrap();
    let error = c.kv["sc"].get("k").await.unwrap_err();
    assert!(
        matches!(error, KvError::Integrity { tried: 2, .. }),
        "{error}"
    );

    // A vanished node: its replica is skipped.
    c.kv["sc"].put("k2", &bytes, 2).await.unwrap();
    let victim = c.nodes.remove(0);
    victim.kill().await;
    let fetched = c.kv["sc"].get("k2").await.unwrap();
    assert_eq!(&fetched.value[..], &bytes[..]);
    c.shutdown().await;
}

#[tokio::test]
async fn a_put_whose_replica_node_died_fails_cleanly_and_is_revoked() {
    let mut c = cluster(3, 16 << 20).await;
    // Reserve first, then kill one of the chosen nodes before the data is written.
    let started = c.kv["sc"]
        .metadata()
        .put_start(vec![PutStartItem {
            key: "doomed".into(),
            size: 1000,
            replicas: 3,
            preferred_segment: None,
            hard_pin: false,
            put_id: 0,
            avoid_nodes: Vec::new(),
        }])
        .await
        .unwrap();
    assert!(matches!(started[0], ItemResult::Ok(_)));
    c.kv["sc"]
        .metadata()
        .put_revoke(vec!["doomed".into()])
        .await
        .unwrap();
    let victim = c.nodes.remove(2);
    victim.kill().await;
    // With 3 replicas asked and one node unreachable, the write fails and is revoked.
    let error = c.kv["sc"]
        .put("doomed", &value(1000, 1), 3)
        .await
        .unwrap_err();
    assert!(matches!(error, KvError::Write { .. }), "{error}");
    assert_eq!(
        c.kv["sc"]
            .metadata()
            .exist(vec!["doomed".into()])
            .await
            .unwrap(),
        vec![false]
    );
    // The space was given back: the pending put is gone (a new put_start works).
    c.kv["sc"].put("fine", &value(1000, 2), 2).await.ok();
    let status = c.kv["sc"].metadata().status().await.unwrap();
    assert_eq!(status.pending_puts, 0);
    c.shutdown().await;
}

#[tokio::test]
async fn puts_go_to_live_nodes_while_a_dead_node_is_still_mounted() {
    // One of three nodes dies without unmounting (its process is gone): the
    // sub-master counts its segment until the node timeout, so placements still
    // pick it, but no put fails: a failed write is placed again avoiding it, and
    // later placements (space leases too) leave it out.
    let mut c = cluster(3, 16 << 20).await;
    let victim = c.nodes.remove(1);
    let dead_endpoint = victim.endpoint().to_owned();
    victim.kill().await;
    for round in 0..40u8 {
        let key = format!("live-{round}");
        let bytes = value(3000, round);
        let replicas: u32 = if round % 2 == 0 { 1 } else { 2 };
        c.kv["sc"]
            .put(&key, &bytes, replicas)
            .await
            .unwrap_or_else(|e| panic!("{key}: {e}"));
        let fetched = c.kv["sc"].get(&key).await.unwrap();
        assert_eq!(&fetched.value[..], &bytes[..]);
        let located = c.kv["sc"]
            .locate(&[key.as_str()])
            .await
            .unwrap()
            .pop()
            .unwrap()
            .unwrap();
        assert_eq!(located.list.replicas.len() as u32, replicas);
        assert!(
            located
                .list
                .replicas
                .iter()
                .all(|r| r.endpoint != dead_endpoint),
            "{key} placed on the dead node"
        );
    }
    let status = c.kv["sc"].metadata().status().await.unwrap();
    assert_eq!(status.segments, 3, "the dead node is still mounted");
    c.shutdown().await;
}

#[tokio::test]
async fn a_put_whose_reservation_a_leader_change_lost_is_put_again_not_failed() {
    let mut c = Pool::start(
        PoolSpec::new("dp")
            .subcluster("sc", &[])
            .nodes(3, 16 << 20)
            .tweak(quick_failover),
    )
    .await;
    let kv = c.kv["sc"].clone();
    let bytes = value(5000, 9);
    // Reserved on the first leader; the value is written only after it died.
    let pending = kv.reserve("raced", bytes.len() as u64, 2).await.unwrap();
    let readers = c.fixture.readers("sc").await;
    let mut config = c.fixture.submaster_config("sc", "sc-sm-b");
    config.registry_ttl = Duration::from_secs(3);
    quick_failover(&mut config);
    let standby = c.fixture.spawn_submaster(config).await;
    c.fixture.wait_new_reader_at_end("sc", &readers).await;
    c.masters.remove(0).abort();

    kv.complete(pending, &bytes).await.unwrap();
    let fetched = kv.get("raced").await.unwrap();
    assert_eq!(&fetched.value[..], &bytes[..]);
    assert_eq!(kv.metadata().status().await.unwrap().producer, "sc-sm-b");
    standby.shutdown().await.unwrap();
    c.shutdown().await;
}
