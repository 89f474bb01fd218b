//! A whole HKVM cluster in one process on a real nats-server: two sub-clusters, each
//! with its sub-master and nodes, and a global master. A block put into one
//! sub-cluster is found by `batch_is_exist` and read byte-exact from the other one.

use std::time::Duration;

use hkvm_client::{GlobalClient, KvError};
use hkvm_events::rpc::global::{BatchIsExist, BatchIsExistReply, GlobalOp};
use hkvm_events::SubclusterId;

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
