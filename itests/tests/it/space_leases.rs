//! Space leases end to end on real NATS, a real sub-master and real nodes: once a
//! client holds a lease, each put is its writes plus one `put_commit`; a lease a
//! leader change lost sends the put through `put_start` / `put_end` instead of
//! failing it; a dropped client returns its lease; a coalescing client commits
//! into its lease inside its mixed requests; a leader of an older build, which
//! serves no lease operation, sends puts through reservations within about a
//! second instead of the retry deadline.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt as _;

use hkvm_client::coalesce::CoalesceConfig;
use hkvm_client::KvClient;
use hkvm_client::{ClientError, RetryPolicy};
use hkvm_events::rpc::submaster::{ItemResult, Op, PutCommitItem};
use hkvm_events::rpc::{encode, RpcError, RpcReply};
use hkvm_events::subject::submaster_rpc_subject;
use hkvm_events::SubclusterId;
use hkvm_submaster::SubmasterHandle;
use hkvm_transfer::TcpTransport;

use crate::fixture::{poll_until, quick_failover, Fixture, Pool, PoolSpec, WAIT};

fn value(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
        .collect()
}

/// Requests of `op` a sub-master answered `ok`, from its metrics.
fn answered(master: &SubmasterHandle, op: &str) -> u64 {
    let labels = format!("op=\"{op}\",result=\"ok\"");
    master
        .metrics_text()
        .lines()
        .filter(|line| line.starts_with("hkvm_submaster_requests_total{") && line.contains(&labels))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// Puts `key` and waits until the client's lease, asked for in the background
/// by that first put, is granted.
async fn put_until_leased(kv: &KvClient, key: &str) {
    kv.put(key, &value(3000, 1), 2).await.unwrap();
    poll_until("a space lease granted", WAIT, || async {
        (kv.metadata().status().await.ok()?.space_leases > 0).then_some(())
    })
    .await;
}

async fn pool(tweak: fn(&mut hkvm_submaster::SubmasterConfig)) -> Pool {
    Pool::start(
        PoolSpec::new("sl")
            .subcluster("sc", &[])
            .nodes(3, 64 << 20)
            .tweak(tweak),
    )
    .await
}

#[tokio::test]
async fn with_a_lease_each_put_is_one_commit_and_a_dropped_client_returns_it() {
    let c = pool(|_| {}).await;
    let kv = KvClient::new(
        c.kv["sc"].metadata().clone(),
        Arc::new(TcpTransport::default()),
    );
    put_until_leased(&kv, "first").await;
    let (starts, commits) = (
        answered(&c.masters[0], "put_start"),
        answered(&c.masters[0], "put_commit"),
    );
    let values: Vec<Vec<u8>> = (0..20).map(|i| value(1000 + 300 * i, i as u8)).collect();
    for (i, bytes) in values.iter().enumerate() {
        kv.put(&format!("k{i}"), bytes, 2).await.unwrap();
    }
    assert_eq!(
        answered(&c.masters[0], "put_start"),
        starts,
        "no reservation"
    );
    assert_eq!(answered(&c.masters[0], "put_commit"), commits + 20);
    for (i, bytes) in values.iter().enumerate() {
        let fetched = kv.get(&format!("k{i}")).await.unwrap();
        assert_eq!(&fetched.value[..], &bytes[..], "k{i}");
        assert_eq!(fetched.value.len(), bytes.len());
    }
    // Both replicas of each object, on distinct nodes, one after another in
    // the lease: the client placed them.
    let lists = kv
        .metadata()
        .peek_replica_list(vec!["k0".into(), "k1".into()])
        .await
        .unwrap();
    let [ItemResult::Ok(k0), ItemResult::Ok(k1)] = &lists[..] else {
        panic!("{lists:?}")
    };
    assert_ne!(k0.replicas[0].node, k0.replicas[1].node);
    for (a, b) in k0.replicas.iter().zip(&k1.replicas) {
        assert_eq!(a.segment, b.segment);
        assert_eq!(b.offset, a.offset + 1024, "1000 bytes take 1024 of a lease");
    }
    // A lease takes at most 1/16 of a 64 MiB segment: a value over a quarter
    // of what was granted goes through a reservation, and the lease stays in use.
    let (starts, commits) = (
        answered(&c.masters[0], "put_start"),
        answered(&c.masters[0], "put_commit"),
    );
    let big = value(2 << 20, 9);
    kv.put("big", &big, 2).await.unwrap();
    kv.put("small-after", &value(100, 4), 2).await.unwrap();
    assert_eq!(answered(&c.masters[0], "put_start"), starts + 1);
    assert_eq!(answered(&c.masters[0], "put_commit"), commits + 1);
    assert_eq!(&kv.get("big").await.unwrap().value[..], &big[..]);
    // A put of the same key again is refused as before.
    assert!(kv.put("k3", b"again", 2).await.is_err());

    let used_by_objects = c.kv["sc"].metadata().status().await.unwrap();
    drop(kv);
    let status = poll_until("the lease returned", WAIT, || async {
        let status = c.kv["sc"].metadata().status().await.ok()?;
        (status.space_leases == 0).then_some(status)
    })
    .await;
    assert!(status.used_bytes < used_by_objects.used_bytes);
    assert_eq!(status.objects, 23);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_coalescing_client_commits_into_its_lease_inside_mixed_requests() {
    let c = pool(|_| {}).await;
    let coalesced = c.kv["sc"]
        .metadata()
        .clone()
        .coalesced(CoalesceConfig::default());
    let kv = KvClient::new(coalesced, Arc::new(TcpTransport::default()));
    put_until_leased(&kv, "first").await;
    let master = &c.masters[0];
    let (mixed, commits, starts) = (
        answered(master, "mixed"),
        answered(master, "put_commit"),
        answered(master, "put_start"),
    );
    let used = c.kv["sc"].metadata().status().await.unwrap().used_bytes;
    let puts = (0..16).map(|i| {
        let kv = kv.clone();
        tokio::spawn(async move { kv.put(&format!("c{i}"), &value(900 + i, i as u8), 2).await })
    });
    for put in futures::future::join_all(puts).await {
        put.unwrap().unwrap();
    }
    // The values were carved out of the lease (already counted as used), and
    // committed inside mixed requests, not by put_commit or put_start alone.
    let status = c.kv["sc"].metadata().status().await.unwrap();
    assert_eq!(
        status.used_bytes, used,
        "the puts took no space outside the lease"
    );
    assert_eq!(status.pending_puts, 0);
    assert_eq!(answered(master, "put_commit"), commits);
    assert_eq!(answered(master, "put_start"), starts);
    let more = answered(master, "mixed") - mixed;
    assert!((1..=16).contains(&more), "{more} mixed requests");
    for i in 0..16 {
        let fetched = kv.get(&format!("c{i}")).await.unwrap();
        assert_eq!(&fetched.value[..], &value(900 + i, i as u8)[..], "c{i}");
    }
    c.shutdown().await;
}

#[tokio::test]
async fn a_put_into_a_lease_a_leader_change_lost_is_put_again_not_failed() {
    let mut c = pool(quick_failover).await;
    let kv = c.kv["sc"].clone();
    put_until_leased(&kv, "before").await;
    let readers = c.fixture.readers("sc").await;
    let mut config = c.fixture.submaster_config("sc", "sc-sm-b");
    config.registry_ttl = Duration::from_secs(3);
    quick_failover(&mut config);
    let standby = c.fixture.spawn_submaster(config).await;
    c.fixture.wait_new_reader_at_end("sc", &readers).await;
    c.masters.remove(0).abort();

    // The client still holds the first leader's lease: the commit is refused
    // (no such lease) and the put goes through a reservation.
    let bytes = value(7000, 5);
    kv.put("after", &bytes, 2).await.unwrap();
    assert_eq!(&kv.get("after").await.unwrap().value[..], &bytes[..]);
    assert_eq!(
        &kv.get("before").await.unwrap().value[..],
        &value(3000, 1)[..]
    );
    assert_eq!(kv.metadata().status().await.unwrap().producer, "sc-sm-b");
    // The next put asks the new leader for a lease.
    kv.put("kick", b"k", 2).await.unwrap();
    poll_until("a lease from the new leader", WAIT, || async {
        (kv.metadata().status().await.ok()?.space_leases > 0).then_some(())
    })
    .await;
    let commits_before = answered(&standby, "put_commit");
    kv.put("leased-again", &value(500, 3), 2).await.unwrap();
    assert_eq!(answered(&standby, "put_commit"), commits_before + 1);
    standby.shutdown().await.unwrap();
    c.shutdown().await;
}

/// A leader of sub-cluster `subcluster` of an older build, as a KV client sees
/// it: it serves the client operations of that build, none of the lease ones
/// (the nodes' pings and mounts are left unanswered, so as not to interleave),
/// and refuses each request it gets, which is enough to show which operations
/// were asked, in order, in the list returned.
async fn older_leader(fixture: &Fixture, subcluster: &str) -> Arc<Mutex<Vec<String>>> {
    let subcluster = SubclusterId::new(subcluster).unwrap();
    let mut subscriptions = Vec::new();
    let served = [
        Op::Status,
        Op::Exist,
        Op::GetReplicaList,
        Op::PutStart,
        Op::PutEnd,
        Op::PutRevoke,
        Op::Remove,
        Op::Mixed,
    ];
    for op in served {
        let subject = submaster_rpc_subject(&fixture.cluster, &subcluster, op.name());
        subscriptions.push(fixture.client.subscribe(subject).await.unwrap());
    }
    fixture.client.flush().await.unwrap();
    let asked = Arc::new(Mutex::new(Vec::new()));
    let (client, record) = (fixture.client.clone(), Arc::clone(&asked));
    tokio::spawn(async move {
        let mut requests = futures::stream::select_all(subscriptions);
        while let Some(request) = requests.next().await {
            let op = request.subject.rsplit('.').next().unwrap().to_owned();
            let refusal = RpcError::invalid(format!("an older build refuses {op} here"));
            record.lock().unwrap().push(op);
            let reply = encode(&RpcReply::<()>::Err(refusal)).unwrap();
            let _ = client.publish(request.reply.unwrap(), reply.into()).await;
        }
    });
    asked
}

#[tokio::test]
async fn after_a_downgrade_a_leased_put_goes_to_a_reservation_not_to_the_deadline() {
    let mut c = pool(|_| {}).await;
    let kv = c.kv["sc"].clone();
    put_until_leased(&kv, "before").await;
    // An older build takes over: it serves neither the client's lease nor
    // `put_commit` at all.
    c.masters.remove(0).shutdown().await.unwrap();
    let asked = older_leader(&c.fixture, "sc").await;
    let started = Instant::now();
    let error = kv.put("after", &value(3000, 2), 2).await.unwrap_err();
    // `put_commit` went unanswered; once `status` showed a leader that lacks
    // it, the put asked for a reservation, which this stand-in refuses.
    assert!(error.to_string().contains("refuses put_start"), "{error}");
    // (The forgotten lease's return may ask `status` too, a second later.)
    assert_eq!(asked.lock().unwrap()[..2], ["status", "put_start"]);
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "well before the 30 s retry deadline ({:?})",
        started.elapsed()
    );
    c.shutdown().await;
}

#[tokio::test]
async fn a_commit_that_may_have_been_delivered_never_ends_as_not_served() {
    let mut c = pool(|_| {}).await;
    c.masters.remove(0).shutdown().await.unwrap();
    let asked = older_leader(&c.fixture, "sc").await;
    // The first `put_commit` reaches a subscriber that never answers and
    // leaves: the commit may have been made, so the silence after it must not
    // be read as a leader that does not serve the operation.
    let subject = submaster_rpc_subject(
        &c.fixture.cluster,
        &SubclusterId::new("sc").unwrap(),
        Op::PutCommit.name(),
    );
    let mut swallower = c.fixture.client.subscribe(subject).await.unwrap();
    c.fixture.client.flush().await.unwrap();
    let swallowed = tokio::spawn(async move { swallower.next().await.is_some() });
    let client = c
        .fixture
        .submaster_client(
            "sc",
            RetryPolicy {
                request_timeout: Duration::from_millis(300),
                presence_check_after: Duration::from_millis(100),
                retry_deadline: Duration::from_secs(3),
                ..RetryPolicy::default()
            },
        )
        .await;
    let item = PutCommitItem {
        key: "k".to_owned(),
        size: 10,
        checksum: 1,
        lease: 7,
        offset: 0,
        hard_pin: false,
        put_id: 99,
    };
    let error = client.put_commit(vec![item]).await.unwrap_err();
    assert!(swallowed.await.unwrap());
    assert!(matches!(error, ClientError::Unavailable { .. }), "{error}");
    assert!(
        asked.lock().unwrap().is_empty(),
        "{:?}",
        asked.lock().unwrap()
    );
    c.shutdown().await;
}
