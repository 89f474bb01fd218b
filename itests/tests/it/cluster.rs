//! A whole HKVM cluster in one process on a real nats-server: two sub-clusters, each
//! with its sub-master and nodes, and a global master. A block put into one
//! sub-cluster is found by `batch_is_exist` and read byte-exact from the other one.

use std::time::Duration;

use std::sync::Arc;

use hkvm_client::{
    GlobalClient, KvClient, KvError, NodeConfig, NodeHandle, RetryPolicy, SubmasterClient,
};
use hkvm_events::rpc::global::{BatchIsExist, BatchIsExistReply, GlobalOp};
use hkvm_events::subject::global_rpc_subject;
use hkvm_events::SubclusterId;
use hkvm_events::{
    KvEvent, NodeId, Placement, ProducerId, PutCommitted, SegmentId, SegmentMounted,
};
use hkvm_globalmaster::GlobalMasterConfig;
use hkvm_log::commit::{CommitConfig, GroupCommitter};
use hkvm_submaster::SubmasterHandle;
use hkvm_transfer::TcpTransport;

use hkvm_client::store::ErrorCode;

use crate::fixture::{Pool, PoolSpec};

#[tokio::test]
async fn a_block_put_in_one_subcluster_is_read_from_another() {
    let mut pool = Pool::start(
        PoolSpec::new("x")
            .subcluster("sc-a", &[])
            .subcluster("sc-b", &[])
            .nodes(2, 8 << 20)
            .global("g1"),
    )
    .await;
    let kv = [&pool.kv["sc-a"], &pool.kv["sc-b"]];

    let value: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    kv[0].put("prefix/block-1", &value, 2).await.unwrap();

    // The global index learns about it (weakly consistent: poll until it does).
    let global_client =
        GlobalClient::new(pool.fixture.connect().await, pool.fixture.cluster.clone());
    let mut holders = Vec::new();
    for _ in 0..100 {
        let request = BatchIsExist {
            keys: vec!["prefix/block-1".into(), "nowhere".into()],
            labels: None,
        };
        let reply: BatchIsExistReply = global_client
            .call(GlobalOp::BatchIsExist, &request)
            .await
            .unwrap();
        holders = reply.holders_of(0).into_iter().cloned().collect::<Vec<_>>();
        assert!(
            reply.holders_of(1).is_empty(),
            "a key put nowhere has no holder"
        );
        if !holders.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(holders, vec![SubclusterId::new("sc-a").unwrap()]);

    // sc-b's client does not have it locally and reads it through the global master.
    let fetched = kv[1].get("prefix/block-1").await.unwrap();
    assert_eq!(fetched.subcluster.as_str(), "sc-a");
    assert!(
        fetched.value[..] == value[..],
        "byte-exact across sub-clusters"
    );
    assert!(matches!(
        kv[1].get("nowhere").await,
        Err(KvError::NotFound { .. })
    ));

    // Removal in sc-a is reflected: the other sub-cluster gets a clean miss.
    kv[0]
        .metadata()
        .remove(vec!["prefix/block-1".into()], true)
        .await
        .unwrap();
    let mut gone = false;
    for _ in 0..100 {
        if matches!(
            kv[1].get("prefix/block-1").await,
            Err(KvError::NotFound { .. })
        ) {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(gone, "a removed key becomes a clean miss everywhere");

    // Without a global master, a key missing here is not reported as absent
    // everywhere: the client says it could not tell.
    if let Some(global) = pool.global.take() {
        global.shutdown();
    }
    // Its subscriptions end after the shutdown returns: until the server has
    // dropped them, a query is delivered to nobody and times out instead.
    let subject = global_rpc_subject(&pool.fixture.cluster, GlobalOp::Status.name());
    let probe = pool.fixture.connect().await;
    let mut unsubscribed = false;
    for _ in 0..100 {
        let asked = tokio::time::timeout(
            Duration::from_millis(200),
            probe.request(subject.clone(), Vec::new().into()),
        )
        .await;
        match asked {
            Ok(Err(error)) if error.kind() == async_nats::RequestErrorKind::NoResponders => {
                unsubscribed = true;
                break;
            }
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    assert!(
        unsubscribed,
        "the stopped global master left its subscriptions"
    );
    let mut unresolved = None;
    for _ in 0..100 {
        match kv[1].get("nowhere").await {
            Err(error @ KvError::Unresolved { .. }) => {
                unresolved = Some(error);
                break;
            }
            // The replica may still answer while it shuts down.
            Err(KvError::NotFound { .. }) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => panic!("{other:?}"),
        }
    }
    let error = unresolved.expect("a miss without a global master stays NotFound");
    assert_eq!(
        ErrorCode::of_kv(&error),
        ErrorCode::RpcFail,
        "not Mooncake's object-not-found"
    );
    pool.shutdown().await;
}

/// Events a global master takes a while to read: a mounted segment and `count`
/// puts on it, in messages of 1000.
fn backlog(count: u32) -> Vec<Vec<KvEvent>> {
    let segment = SegmentId::new("backlog-seg").unwrap();
    let mut messages = vec![vec![KvEvent::SegmentMounted(SegmentMounted {
        node: NodeId::new("backlog-node").unwrap(),
        segment: segment.clone(),
        size: u64::from(count) * 64,
        endpoint: "backlog-node:1".into(),
        rdma: None,
    })]];
    let puts: Vec<KvEvent> = (0..count)
        .map(|i| {
            let placement = Placement {
                segment: segment.clone(),
                offset: u64::from(i) * 64,
            };
            KvEvent::PutCommitted(PutCommitted::new(
                format!("old-{i}"),
                64,
                7,
                vec![placement],
            ))
        })
        .collect();
    messages.extend(puts.chunks(1000).map(<[KvEvent]>::to_vec));
    messages
}

/// Sub-cluster `sc-c` joining `pool` late, with a long history: the global master
/// starts reading it when its sub-master registers and is far behind for a while.
struct LateSubcluster {
    master: SubmasterHandle,
    node: NodeHandle,
    writer: KvClient,
}

impl LateSubcluster {
    async fn start(pool: &Pool) -> Self {
        let fixture = &pool.fixture;
        let log = fixture.stream("sc-c").await;
        let history = GroupCommitter::spawn(
            log,
            ProducerId::new("history").unwrap(),
            1,
            0,
            CommitConfig::default(),
        );
        for message in backlog(200_000) {
            history.commit(message).await.unwrap();
        }
        let mut config = fixture.submaster_config("sc-c", "sc-c-sm");
        config.registry_ttl = Duration::from_secs(3);
        let master = fixture.spawn_submaster(config).await;
        let metadata = SubmasterClient::new(
            fixture.connect().await,
            fixture.cluster.clone(),
            SubclusterId::new("sc-c").unwrap(),
        );
        let node = NodeHandle::start(
            NodeConfig::new(NodeId::new("sc-c-n0").unwrap(), 8 << 20).unwrap(),
            metadata.clone(),
        )
        .await
        .unwrap();
        let writer = KvClient::new(metadata, Arc::new(TcpTransport::default()));
        // The global master has seen it register (and is reading its history).
        let sc_c = SubclusterId::new("sc-c").unwrap();
        let global = pool.global.as_ref().unwrap();
        crate::fixture::poll_until(
            "the global master follows sc-c",
            crate::fixture::WAIT,
            || async {
                global
                    .status()
                    .sources
                    .iter()
                    .any(|source| source.lag.subcluster == sc_c)
                    .then_some(())
            },
        )
        .await;
        Self {
            master,
            node,
            writer,
        }
    }

    async fn stop(self) {
        self.node.shutdown().await.unwrap();
        self.master.shutdown().await.unwrap();
    }
}

/// A pool of `sc-a` with a global master whose sync lookups wait at most
/// `sync_timeout_ms`.
async fn pool_with_sync_timeout(cluster: &str, sync_timeout_ms: u64) -> Pool {
    Pool::start(
        PoolSpec::new(cluster)
            .subcluster("sc-a", &[])
            .nodes(1, 8 << 20)
            .global_with(GlobalMasterConfig {
                replica: "g1".into(),
                registry_ttl_ms: 3000,
                sync_timeout_ms,
                ..GlobalMasterConfig::default()
            }),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_acknowledged_in_one_subcluster_is_never_a_miss_in_another() {
    // Reading the history may take long on a slow machine: the wait must end by
    // catching up, not by the bound.
    let pool = pool_with_sync_timeout("ryw", 60_000).await;
    let late = LateSubcluster::start(&pool).await;
    let value: Vec<u8> = (0..4096u32).map(|b| (b % 253) as u8).collect();
    late.writer.put("fresh", &value, 1).await.unwrap();

    // At once, from the other sub-cluster: found, not "held nowhere". The
    // reader waits as long as the global master may (its default request
    // timeout, 2 s, is below this test's bound: on a loaded machine it ended
    // the wait before the global master had read the history).
    let reader = KvClient::new(
        SubmasterClient::with_policy(
            pool.fixture.connect().await,
            pool.fixture.cluster.clone(),
            SubclusterId::new("sc-a").unwrap(),
            RetryPolicy {
                request_timeout: Duration::from_secs(60),
                ..RetryPolicy::default()
            },
        ),
        Arc::new(TcpTransport::default()),
    );
    let fetched = reader.get("fresh").await.unwrap();
    assert_eq!(fetched.subcluster.as_str(), "sc-c");
    assert!(fetched.value[..] == value[..], "byte-exact");
    late.stop().await;
    pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_global_master_that_cannot_catch_up_in_time_says_stale_not_not_found() {
    // 20 ms: far less than reading 200,000 events takes.
    let pool = pool_with_sync_timeout("stale", 20).await;
    let late = LateSubcluster::start(&pool).await;
    late.writer.put("fresh", &[7u8; 512], 1).await.unwrap();

    let error = pool.kv["sc-a"].get("fresh").await.unwrap_err();
    let KvError::Unresolved { source, .. } = &error else {
        panic!("a miss the global master could not vouch for: {error:?}");
    };
    assert!(
        matches!(
            &**source,
            hkvm_client::ClientError::Rpc { source, .. }
                if source.code == hkvm_events::rpc::RpcErrorCode::Stale
        ),
        "{source:?}"
    );
    assert_eq!(ErrorCode::of_kv(&error), ErrorCode::RpcFail);
    late.stop().await;
    pool.shutdown().await;
}
