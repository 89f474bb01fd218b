//! The sub-master against a real nats-server: every operation through the client,
//! error paths, failover to a hot standby, fencing of a deposed leader, and restore
//! from snapshot + tail equal to a full replay.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hkvm_client::{ClientErrorKind, RetryPolicy, SubmasterClient};
use hkvm_events::rpc::submaster::{
    ItemError, ItemResult, MountSegment, Ping, PutEndItem, PutStartItem,
};
use hkvm_events::rpc::RpcErrorCode;
use hkvm_events::subject::submaster_rpc_subject;
use hkvm_events::{decode_message, KvEvent, Limits, NodeId, SegmentId, SubclusterId};
use hkvm_log::{Append, EventLog, JetStreamLog, ReadOptions};
use hkvm_submaster::SubmasterConfig;

use hkvm_testkit::ServerOptions;

use crate::fixture::{logs, poll_until, wait_count, Fixture, WAIT};

/// The sub-cluster every test here runs.
pub(crate) const SC: &str = "sc";

pub(crate) fn config(fixture: &Fixture, producer: &str) -> SubmasterConfig {
    logs();
    let mut config = fixture.submaster_config(SC, producer);
    config.leader_lease_ttl = Duration::from_millis(1500);
    config
}

pub(crate) async fn client(fixture: &Fixture) -> SubmasterClient {
    fixture
        .submaster_client(
            SC,
            RetryPolicy {
                retry_deadline: Duration::from_secs(20),
                ..RetryPolicy::default()
            },
        )
        .await
}

fn log_of(fixture: &Fixture) -> JetStreamLog {
    fixture.log(&SubclusterId::new(SC).unwrap())
}

pub(crate) async fn mount(client: &SubmasterClient, node: &str, size: u64) {
    client
        .mount_segment(MountSegment {
            node: NodeId::new(node).unwrap(),
            segment: SegmentId::new(format!("{node}-seg")).unwrap(),
            size,
            endpoint: format!("127.0.0.1:{}", 7000 + node.len()),
            rdma: None,
        })
        .await
        .unwrap();
}

pub(crate) fn start_item(key: &str, size: u64, replicas: u32) -> PutStartItem {
    PutStartItem {
        key: key.into(),
        size,
        replicas,
        preferred_segment: None,
        hard_pin: false,
        put_id: 0,
        avoid_nodes: Vec::new(),
    }
}

pub(crate) async fn put(client: &SubmasterClient, key: &str) -> Result<(), String> {
    let started = client
        .put_start(vec![start_item(key, 4096, 2)])
        .await
        .map_err(|e| e.to_string())?;
    if let ItemResult::Err(error) = &started[0] {
        return Err(error.to_string());
    }
    let ended = client
        .put_end(vec![PutEndItem {
            key: key.into(),
            checksum: hkvm_events::value_checksum(key.as_bytes()),
            put_id: 0,
        }])
        .await
        .map_err(|e| e.to_string())?;
    match &ended[0] {
        ItemResult::Ok(()) => Ok(()),
        ItemResult::Err(error) => Err(error.to_string()),
    }
}

#[tokio::test]
async fn every_operation_round_trips_and_is_recorded_in_the_stream() {
    let fixture = Fixture::new("t").await;
    let master = fixture.spawn_submaster(config(&fixture, "sm-a")).await;
    let client = client(&fixture).await;
    mount(&client, "n1", 1 << 20).await;
    mount(&client, "n2", 1 << 20).await;
    mount(&client, "n3", 1 << 20).await;

    let ping = client
        .ping(Ping {
            node: NodeId::new("n1").unwrap(),
        })
        .await
        .unwrap();
    assert!(!ping.need_remount);
    let unknown = client
        .ping(Ping {
            node: NodeId::new("ghost").unwrap(),
        })
        .await
        .unwrap();
    assert!(unknown.need_remount);

    put(&client, "a").await.unwrap();
    put(&client, "b").await.unwrap();
    assert_eq!(
        put(&client, "a").await.unwrap_err(),
        ItemError::AlreadyExists.to_string()
    );
    assert_eq!(
        client
            .exist(vec!["a".into(), "b".into(), "c".into()])
            .await
            .unwrap(),
        vec![true, true, false]
    );

    let lists = client
        .get_replica_list(vec!["a".into(), "zzz".into()])
        .await
        .unwrap();
    let ItemResult::Ok(list) = &lists[0] else {
        panic!("{lists:?}")
    };
    assert_eq!(list.size, 4096);
    assert_eq!(list.checksum, hkvm_events::value_checksum(b"a"));
    assert_eq!(list.replicas.len(), 2);
    assert_ne!(list.replicas[0].node, list.replicas[1].node);
    assert_eq!(lists[1], ItemResult::Err(ItemError::NotFound));

    // Leased by the read above: removal needs force.
    assert_eq!(
        client.remove(vec!["a".into()], false).await.unwrap(),
        vec![ItemResult::Err(ItemError::Leased)]
    );
    assert_eq!(
        client.remove(vec!["a".into()], true).await.unwrap(),
        vec![ItemResult::Ok(())]
    );

    client
        .put_start(vec![start_item("revoked", 100, 1)])
        .await
        .unwrap();
    assert_eq!(
        client.put_revoke(vec!["revoked".into()]).await.unwrap(),
        vec![ItemResult::Ok(())]
    );
    assert_eq!(client.remove_all(true).await.unwrap().removed, 1);

    let status = client.status().await.unwrap();
    assert_eq!((status.objects, status.nodes, status.segments), (0, 3, 3));
    assert_eq!(status.producer, "sm-a");

    // The stream holds exactly the durable changes: 3 mounts, 2 puts, 2 removals.
    let log = log_of(&fixture);
    let mut kinds = Vec::new();
    let mut entries = log.read(ReadOptions::from(1)).await.unwrap();
    while let Some(entry) = futures::StreamExt::next(&mut entries).await {
        let entry = entry.unwrap();
        for event in decode_message(&entry.payload, &Limits::default())
            .unwrap()
            .events
        {
            kinds.push(event.unwrap().kind().name());
        }
    }
    assert_eq!(kinds.iter().filter(|k| **k == "segment_mounted").count(), 3);
    assert_eq!(kinds.iter().filter(|k| **k == "put").count(), 2);
    assert_eq!(kinds.iter().filter(|k| **k == "removed").count(), 2);
    master.shutdown().await.unwrap();
}

#[tokio::test]
async fn malformed_and_oversized_requests_get_clean_errors() {
    let fixture = Fixture::new("t").await;
    let master = fixture.spawn_submaster(config(&fixture, "sm-a")).await;
    let client = client(&fixture).await;
    mount(&client, "n1", 1 << 20).await;
    mount(&client, "n2", 1 << 20).await;
    let nats = fixture.connect().await;
    let sc = SubclusterId::new(SC).unwrap();
    for op in ["put_start", "put_end", "exist", "mount_segment", "remove"] {
        let subject = submaster_rpc_subject(&fixture.cluster, &sc, op);
        for body in [&b""[..], b"\xff\xff", b"\x81\xa1k\xc0", &[0x92; 64][..]] {
            let reply = nats
                .request(subject.clone(), body.to_vec().into())
                .await
                .unwrap();
            let decoded: hkvm_events::rpc::RpcReply<()> =
                hkvm_events::rpc::decode(&reply.payload).unwrap();
            let hkvm_events::rpc::RpcReply::Err(error) = decoded else {
                panic!("{op} accepted garbage")
            };
            assert_eq!(error.code, RpcErrorCode::InvalidRequest, "{op}");
        }
    }
    // A key over the limit is refused per item; the sub-master keeps serving.
    let started = client
        .put_start(vec![start_item(&"k".repeat(5000), 10, 1)])
        .await
        .unwrap();
    assert!(matches!(started[0], ItemResult::Err(ItemError::Invalid(_))));
    put(&client, "still-fine").await.unwrap();
    master.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_reply_over_the_nats_payload_limit_is_a_clear_error_not_a_timeout() {
    let fixture = Fixture::with_server(
        "t",
        ServerOptions {
            extra_config: "max_payload: 65536".into(),
            ..ServerOptions::default()
        },
    )
    .await;
    let master = fixture.spawn_submaster(config(&fixture, "sm-a")).await;
    let client = client(&fixture).await;
    mount(&client, "n1", 64 << 20).await;
    mount(&client, "n2", 64 << 20).await;
    // 2,000 objects with two replicas each: their replica lists take ~150 KiB.
    let keys: Vec<String> = (0..2000).map(|i| format!("object-{i:05}")).collect();
    for chunk in keys.chunks(125) {
        let items = chunk.iter().map(|key| start_item(key, 64, 2)).collect();
        assert!(client
            .put_start(items)
            .await
            .unwrap()
            .iter()
            .all(|r| matches!(r, ItemResult::Ok(_))));
        let ends = chunk
            .iter()
            .map(|key| PutEndItem {
                key: key.clone(),
                checksum: 1,
                put_id: 0,
            })
            .collect();
        assert!(client
            .put_end(ends)
            .await
            .unwrap()
            .iter()
            .all(|r| matches!(r, ItemResult::Ok(()))));
    }
    let started = std::time::Instant::now();
    let error = client.get_replica_list(keys.clone()).await.unwrap_err();
    assert_eq!(error.kind(), ClientErrorKind::Rpc, "{error}");
    assert!(error.to_string().contains("payload limit"), "{error}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "answered, not timed out ({:?})",
        started.elapsed()
    );
    // Fewer keys per request fit, and the sub-master keeps serving.
    assert_eq!(
        client
            .get_replica_list(keys[..100].to_vec())
            .await
            .unwrap()
            .len(),
        100
    );
    master.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_look_without_a_lease_keeps_nothing_from_removal() {
    let fixture = Fixture::new("t").await;
    let mut config = config(&fixture, "sm-a");
    config.policy.lease_ttl_ms = 3000;
    let master = fixture.spawn_submaster(config).await;
    let client = client(&fixture).await;
    mount(&client, "n1", 1 << 20).await;
    mount(&client, "n2", 1 << 20).await;
    put(&client, "looked-at").await.unwrap();
    put(&client, "read").await.unwrap();
    // A new leader treats every object as leased for one lease period (readers of
    // the old one may still read): wait until a probe can be removed.
    put(&client, "probe").await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while client.remove(vec!["probe".into()], false).await.unwrap()[0] != ItemResult::Ok(()) {
        assert!(
            std::time::Instant::now() < deadline,
            "the takeover grace never ended"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let looked = client
        .peek_replica_list(vec!["looked-at".into()])
        .await
        .unwrap();
    assert!(matches!(&looked[0], ItemResult::Ok(list) if list.lease_ms == 0));
    client.get_replica_list(vec!["read".into()]).await.unwrap();
    let removed = client
        .remove(vec!["looked-at".into(), "read".into()], false)
        .await
        .unwrap();
    assert_eq!(
        removed,
        vec![ItemResult::Ok(()), ItemResult::Err(ItemError::Leased)]
    );
    master.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_hot_standby_takes_over_and_keeps_every_acknowledged_put() {
    let fixture = Fixture::new("t").await;
    let leader = fixture.spawn_submaster(config(&fixture, "sm-a")).await;
    let client = client(&fixture).await;
    for node in ["n1", "n2", "n3"] {
        mount(&client, node, 64 << 20).await;
    }
    put(&client, "before").await.unwrap();
    let readers = fixture.readers(SC).await;
    let standby = fixture.spawn_submaster(config(&fixture, "sm-b")).await;
    // Hot: the standby has replayed the stream before the leader dies.
    fixture.wait_new_reader_at_end(SC, &readers).await;

    // 16 writers keep putting while the leader dies.
    let stop = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(AtomicUsize::new(0));
    let writers: Vec<_> = (0..16)
        .map(|w| {
            let (client, stop, acked) = (client.clone(), stop.clone(), acked.clone());
            tokio::spawn(async move {
                let mut acknowledged = Vec::new();
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    let key = format!("w{w}-{i}");
                    i += 1;
                    if put(&client, &key).await.is_ok() {
                        acknowledged.push(key);
                        acked.fetch_add(1, Ordering::Relaxed);
                    }
                }
                acknowledged
            })
        })
        .collect();
    wait_count("50 puts before the kill", &acked, 50).await;
    leader.abort();
    let killed = std::time::Instant::now();
    put(&client, "after").await.unwrap();
    println!(
        "first put served {} ms after the leader died",
        killed.elapsed().as_millis()
    );
    let after = acked.load(Ordering::Relaxed) + 50;
    wait_count("50 puts after the failover", &acked, after).await;
    stop.store(true, Ordering::Relaxed);
    let mut acknowledged = vec!["before".to_owned(), "after".to_owned()];
    for writer in writers {
        acknowledged.extend(writer.await.unwrap());
    }
    assert!(
        acknowledged.len() > 100,
        "the writers made progress: {}",
        acknowledged.len()
    );
    let status = client.status().await.unwrap();
    assert_eq!(status.producer, "sm-b", "the standby leads now");
    assert!(status.epoch >= 2);
    let present = client.exist(acknowledged.clone()).await.unwrap();
    let missing: Vec<&String> = acknowledged
        .iter()
        .zip(&present)
        .filter(|(_, p)| !**p)
        .map(|(k, _)| k)
        .collect();
    assert!(missing.is_empty(), "acknowledged puts lost: {missing:?}");
    standby.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_deposed_leader_cannot_append_and_recovers_from_the_log() {
    let fixture = Fixture::new("t").await;
    let master = fixture.spawn_submaster(config(&fixture, "sm-a")).await;
    let client = client(&fixture).await;
    mount(&client, "n1", 1 << 20).await;
    mount(&client, "n2", 1 << 20).await;
    put(&client, "one").await.unwrap();

    // Another writer appends behind the leader's back (a split brain).
    let log = log_of(&fixture);
    let last = log.bounds().await.unwrap().last_seq;
    log.append(Append {
        expected_last_seq: Some(last),
        msg_id: "intruder-1".into(),
        payload: bytes::Bytes::from_static(b"\x93\x01\x80\x90"),
    })
    .await
    .unwrap();

    // The leader's next append is fenced: that put is not acknowledged.
    let fenced = put(&client, "two").await;
    assert!(fenced.is_err(), "a fenced append must not be acknowledged");
    // The sub-master rebuilds from the log and serves again; the history is one.
    put(&client, "three").await.unwrap();
    let present = client
        .exist(vec!["one".into(), "two".into(), "three".into()])
        .await
        .unwrap();
    assert_eq!(present, vec![true, false, true]);
    master.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_sub_cluster_that_does_not_exist_is_a_clear_error_not_a_long_wait() {
    let fixture = Fixture::new("t").await;
    let master = fixture.spawn_submaster(config(&fixture, "sm-a")).await;
    // A mistyped name: nobody answers and no sub-master of it ever started.
    let typo = fixture
        .submaster_client(
            "sx",
            RetryPolicy {
                retry_deadline: Duration::from_secs(30),
                ..RetryPolicy::default()
            },
        )
        .await;
    let started = std::time::Instant::now();
    let error = typo.status().await.unwrap_err();
    assert!(
        matches!(error, hkvm_client::ClientError::NoService { .. }),
        "{error}"
    );
    assert_eq!(error.kind(), ClientErrorKind::NoResponders);
    let text = error.to_string();
    assert!(
        text.contains("hkvm.t.sx.rpc.status") && text.contains("hkvm status"),
        "{text}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "failed before the 30 s retry deadline ({:?})",
        started.elapsed()
    );
    // A sub-cluster that exists but whose sub-master is down is waited for.
    let down = fixture
        .submaster_client(
            SC,
            RetryPolicy {
                retry_deadline: Duration::from_millis(1500),
                presence_check_after: Duration::from_millis(200),
                ..RetryPolicy::default()
            },
        )
        .await;
    master.shutdown().await.unwrap();
    let error = down.status().await.unwrap_err();
    assert!(
        matches!(error, hkvm_client::ClientError::Unavailable { .. }),
        "{error}"
    );
}

#[tokio::test]
async fn requests_during_recovery_get_busy_not_silence() {
    let fixture = Fixture::new("t").await;
    // No sub-master yet: a client with a short deadline reports the outage cleanly.
    let impatient = fixture
        .submaster_client(
            SC,
            RetryPolicy {
                retry_deadline: Duration::from_millis(300),
                ..RetryPolicy::default()
            },
        )
        .await;
    let error = impatient.exist(vec!["x".into()]).await.unwrap_err();
    assert_eq!(error.kind(), ClientErrorKind::NoResponders, "{error}");
    assert!(impatient.stats().leader_waits.load(Ordering::Relaxed) > 0);
    let master = fixture.spawn_submaster(config(&fixture, "sm-a")).await;
    let client = client(&fixture).await;
    assert_eq!(client.exist(vec!["x".into()]).await.unwrap(), vec![false]);
    master.shutdown().await.unwrap();
}

#[tokio::test]
async fn restore_from_snapshot_plus_tail_equals_a_full_replay() {
    let fixture = Fixture::new("t").await;
    let mut cfg = config(&fixture, "sm-a");
    cfg.snapshot_every_events = 25;
    // The full replay below needs the whole history (`history` tests purges).
    cfg.history.purge = false;
    let master = fixture.spawn_submaster(cfg.clone()).await;
    let client = client(&fixture).await;
    for node in ["n1", "n2"] {
        mount(&client, node, 16 << 20).await;
    }
    for i in 0..120 {
        put(&client, &format!("k{i}")).await.unwrap();
        if i % 7 == 0 {
            client.remove(vec![format!("k{i}")], true).await.unwrap();
        }
    }
    // A snapshot is written after the puts it covers were answered, and one still
    // in progress when the sub-master stops is abandoned (its marker included):
    // wait for a marker in the stream before stopping.
    let log = log_of(&fixture);
    poll_until("a snapshot marker in the stream", WAIT, || async {
        (snapshot_markers(&log).await >= 1).then_some(())
    })
    .await;
    master.shutdown().await.unwrap();

    let js = fixture.js.clone();
    let from_snapshot = hkvm_submaster::server::load_state(&js, &cfg, true)
        .await
        .unwrap();
    let full_replay = hkvm_submaster::server::load_state(&js, &cfg, false)
        .await
        .unwrap();
    assert!(
        from_snapshot.snapshot_seq > 0,
        "a snapshot was written and used"
    );
    assert!(from_snapshot.state.same_durable_state(&full_replay.state));
    assert_eq!(full_replay.state.object_count(), 120 - 18);
}

/// How many snapshot marker events `log` holds, reading it from the start to
/// its end now.
async fn snapshot_markers(log: &JetStreamLog) -> usize {
    let mut markers = 0;
    let mut entries = log.read(ReadOptions::from(1)).await.unwrap();
    while let Some(entry) = futures::StreamExt::next(&mut entries).await {
        let entry = entry.unwrap();
        for event in decode_message(&entry.payload, &Limits::default())
            .unwrap()
            .events
        {
            markers += usize::from(matches!(event.unwrap(), KvEvent::Snapshot(_)));
        }
    }
    markers
}
