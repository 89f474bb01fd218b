//! A whole HKVM cluster in one process on a real nats-server: two sub-clusters, each
//! with its sub-master and nodes, and a global master. A block put into one
//! sub-cluster is found by `batch_is_exist` and read byte-exact from the other one.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use hkvm_client::{KvClient, KvError, NodeConfig, NodeHandle, SubmasterClient};
use hkvm_events::rpc::global::{BatchIsExist, BatchIsExistReply, GlobalOp};
use hkvm_events::{ClusterId, NodeId, ProducerId, SubclusterId};
use hkvm_globalmaster::{GlobalClient, GlobalMaster, GlobalMasterConfig};
use hkvm_submaster::{SubmasterConfig, SubmasterHandle};
use hkvm_testkit::NatsServer;
use hkvm_transfer::TcpTransport;

#[tokio::test]
async fn a_block_put_in_one_subcluster_is_read_from_another() {
    let server = NatsServer::start().await.unwrap();
    let cluster = ClusterId::new("x").unwrap();
    let mut masters = Vec::new();
    let mut nodes = Vec::new();
    let mut kv = Vec::new();
    for sc in ["sc-a", "sc-b"] {
        let subcluster = SubclusterId::new(sc).unwrap();
        let mut config = SubmasterConfig::new(
            cluster.clone(),
            subcluster.clone(),
            ProducerId::new(format!("{sc}-sm")).unwrap(),
        );
        config.registry_ttl = Duration::from_secs(3);
        masters.push(SubmasterHandle::spawn(
            server.connect().await.unwrap(),
            config,
        ));
        let metadata =
            SubmasterClient::new(server.connect().await.unwrap(), cluster.clone(), subcluster);
        for n in 0..2 {
            let config =
                NodeConfig::new(NodeId::new(format!("{sc}-n{n}")).unwrap(), 8 << 20).unwrap();
            nodes.push(NodeHandle::start(config, metadata.clone()).await.unwrap());
        }
        kv.push(KvClient::new(metadata, Arc::new(TcpTransport::default())));
    }
    let global = GlobalMaster::start(
        GlobalMasterConfig {
            cluster: cluster.clone(),
            replica: "g1".into(),
            registry_ttl_ms: 3000,
            ..GlobalMasterConfig::default()
        },
        server.connect().await.unwrap(),
    )
    .await
    .unwrap();
    global.wait_serving().await;

    let value: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    kv[0].put("prefix/block-1", &value, 2).await.unwrap();

    // The global index learns about it (weakly consistent: poll until it does).
    let global_client = GlobalClient::new(server.connect().await.unwrap(), cluster.clone());
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
    global.shutdown();
    for master in masters {
        master.shutdown().await.unwrap();
    }
}
