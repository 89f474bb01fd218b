//! Transport choice end to end on real NATS and a real sub-master. What needs no
//! device runs everywhere: a segment's RDMA descriptor reaches every replica
//! location and survives a sub-master restart (the stream replayed), and a node or
//! CLI asked for RDMA on a host without the device fails at once with a typed error
//! and mounts nothing. The put/get over RDMA between nodes needs a device: it is
//! `#[ignore]`d (reported as skipped) and `scripts/test` runs it when
//! `HKVM_RDMA_DEVICE` names one.

use std::time::Duration;

use hkvm_client::{NodeConfig, NodeError, NodeHandle, Protocol, RdmaSettings, RetryPolicy};
use hkvm_events::rpc::submaster::{
    ItemResult, MountSegment, PutEndItem, PutStartItem, Remount, ReplicaLocation,
};
use hkvm_events::{value_checksum, NodeId, RdmaEndpoint, SegmentId};
use hkvm_transfer::TransferError;

use crate::fixture::{Fixture, Pool, PoolSpec};
use crate::process::run_hkvm;

fn advert(rkey: u32) -> RdmaEndpoint {
    let mut gid = [0u8; 16];
    gid[10] = 0xff;
    gid[11] = 0xff;
    gid[12..].copy_from_slice(&[10, 0, 0, 7]);
    RdmaEndpoint {
        device: "mlx5_0".into(),
        gid,
        lid: 0,
        exchange: "10.0.0.7:7071".into(),
        rkey,
        addr: 0x7f12_3400_0000,
        len: 1 << 20,
    }
}

fn mount(node: &str, rdma: Option<RdmaEndpoint>) -> MountSegment {
    MountSegment {
        node: NodeId::new(node).unwrap(),
        segment: SegmentId::new(format!("{node}-seg")).unwrap(),
        size: 1 << 20,
        endpoint: format!("{node}:7000"),
        rdma,
    }
}

/// The replica locations of `key`, by node.
async fn locations(
    client: &hkvm_client::SubmasterClient,
    key: &str,
) -> Vec<(String, Option<RdmaEndpoint>)> {
    let lists = client.get_replica_list(vec![key.into()]).await.unwrap();
    let ItemResult::Ok(list) = &lists[0] else {
        panic!("{key}: {:?}", lists[0])
    };
    by_node(&list.replicas)
}

fn by_node(replicas: &[ReplicaLocation]) -> Vec<(String, Option<RdmaEndpoint>)> {
    let mut nodes: Vec<_> = replicas
        .iter()
        .map(|r| (r.node.to_string(), r.rdma.clone()))
        .collect();
    nodes.sort();
    nodes
}

#[tokio::test]
async fn an_rdma_descriptor_reaches_every_replica_location_and_survives_a_restart() {
    let fixture = Fixture::new("rdma-desc").await;
    let config = fixture.submaster_config("sc", "sc-sm");
    let master = fixture.spawn_submaster(config.clone()).await;
    let client = fixture.submaster_client("sc", RetryPolicy::default()).await;
    client
        .mount_segment(mount("fast", Some(advert(0x11))))
        .await
        .unwrap();
    client.mount_segment(mount("plain", None)).await.unwrap();

    let started = client
        .put_start(vec![PutStartItem {
            key: "k".into(),
            size: 4096,
            replicas: 2,
            preferred_segment: None,
            hard_pin: false,
            put_id: 7,
            avoid_nodes: Vec::new(),
        }])
        .await
        .unwrap();
    let ItemResult::Ok(placed) = &started[0] else {
        panic!("{:?}", started[0])
    };
    let expected = vec![
        ("fast".to_owned(), Some(advert(0x11))),
        ("plain".to_owned(), None),
    ];
    assert_eq!(by_node(placed), expected, "put_start's locations");
    let ended = client
        .put_end(vec![PutEndItem {
            key: "k".into(),
            checksum: value_checksum(&[0u8; 4096]),
            put_id: 7,
        }])
        .await
        .unwrap();
    assert!(matches!(ended[0], ItemResult::Ok(())), "{:?}", ended[0]);
    assert_eq!(locations(&client, "k").await, expected);

    // Same TCP endpoint, new registration (the node restarted its RDMA side):
    // recorded, not skipped as an identical remount.
    client
        .remount(Remount {
            node: NodeId::new("fast").unwrap(),
            segments: vec![mount("fast", Some(advert(0x22)))],
        })
        .await
        .unwrap();
    let updated = vec![
        ("fast".to_owned(), Some(advert(0x22))),
        ("plain".to_owned(), None),
    ];
    assert_eq!(locations(&client, "k").await, updated);

    // A new sub-master rebuilds the descriptors from the stream.
    master.shutdown().await.unwrap();
    let again = fixture.spawn_submaster(config).await;
    assert_eq!(locations(&client, "k").await, updated);
    again.shutdown().await.unwrap();
}

fn missing_device() -> Protocol {
    Protocol::Rdma(RdmaSettings {
        devices: vec!["no-such-device-0".into()],
        ..RdmaSettings::default()
    })
}

#[tokio::test]
async fn a_node_asked_for_a_missing_rdma_device_fails_with_a_typed_error_and_mounts_nothing() {
    let fixture = Fixture::new("rdma-none").await;
    let master = fixture
        .spawn_submaster(fixture.submaster_config("sc", "sc-sm"))
        .await;
    let client = fixture.submaster_client("sc", RetryPolicy::default()).await;
    let mut config = NodeConfig::new(NodeId::new("n0").unwrap(), 1 << 20).unwrap();
    config.protocol = missing_device();
    let error = NodeHandle::start(config, client.clone()).await.unwrap_err();
    let NodeError::Transfer(TransferError::NoRdmaDevice { wanted, found, .. }) = &error else {
        panic!("expected NoRdmaDevice, got {error}");
    };
    assert_eq!(wanted.as_deref(), Some("no-such-device-0"));
    assert!(!found.contains(&"no-such-device-0".to_owned()));
    assert_eq!(client.status().await.unwrap().segments, 0);
    // The same node over TCP starts and mounts.
    let tcp = NodeConfig::new(NodeId::new("n0").unwrap(), 1 << 20).unwrap();
    let node = NodeHandle::start(tcp, client.clone()).await.unwrap();
    assert!(node.rdma_endpoint().is_none());
    assert_eq!(client.status().await.unwrap().segments, 1);
    node.shutdown().await.unwrap();
    master.shutdown().await.unwrap();
}

#[tokio::test]
async fn hkvm_node_and_put_asked_for_a_missing_rdma_device_fail_before_connecting() {
    // Nothing listens on port 1: a command that tried to connect first would
    // report NATS, not the device.
    let common = [
        "--nats",
        "nats://127.0.0.1:1",
        "--subcluster",
        "sc",
        "--protocol",
        "rdma",
        "--rdma-devices",
        "no-such-device-0",
    ];
    let mut node = vec!["node", "--segment-size", "1MiB"];
    node.extend(common);
    let mut put = vec!["put"];
    put.extend(common);
    put.extend(["key", "/dev/null"]);
    for args in [node, put] {
        let ran = run_hkvm(&args).await;
        assert!(!ran.success(), "{args:?} succeeded");
        assert!(
            ran.stderr.contains("no RDMA device \"no-such-device-0\""),
            "{args:?}: {}",
            ran.stderr
        );
    }
}

/// The device named by `HKVM_RDMA_DEVICE` (`HKVM_RDMA_GID_INDEX` for RoCE v2).
fn device() -> Protocol {
    let device = std::env::var("HKVM_RDMA_DEVICE")
        .ok()
        .filter(|d| !d.is_empty())
        .expect("needs an RDMA device: set HKVM_RDMA_DEVICE=<device, e.g. mlx5_0 or rxe0>");
    let gid_index = std::env::var("HKVM_RDMA_GID_INDEX")
        .ok()
        .and_then(|i| i.parse().ok())
        .unwrap_or(0);
    Protocol::Rdma(RdmaSettings {
        devices: vec![device],
        gid_index,
        ..RdmaSettings::default()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: set HKVM_RDMA_DEVICE"]
async fn device_puts_and_gets_between_nodes_move_over_rdma() {
    let pool = Pool::start(
        PoolSpec::new("rdma-e2e")
            .subcluster("sc", &[])
            .nodes(2, 64 << 20)
            .protocol(device()),
    )
    .await;
    let kv = &pool.kv["sc"];
    assert!(kv.transports().has_rdma());
    for node in &pool.nodes {
        let rdma = node.rdma_endpoint().expect("the node serves RDMA");
        assert_ne!(rdma.rkey, 0);
    }
    let value: Vec<u8> = (0..(4 << 20)).map(|i| (i % 251) as u8).collect();
    kv.put("big", &value, 2).await.unwrap();
    let lists = kv
        .metadata()
        .get_replica_list(vec!["big".into()])
        .await
        .unwrap();
    let ItemResult::Ok(list) = &lists[0] else {
        panic!("{:?}", lists[0])
    };
    assert!(list.replicas.iter().all(|r| r.rdma.is_some()));
    let routed: Vec<&str> = list
        .replicas
        .iter()
        .map(|r| kv.transports().route(r).transport.backend())
        .collect();
    assert_eq!(routed, ["rdma", "rdma"]);
    let fetched = tokio::time::timeout(Duration::from_secs(30), kv.get("big"))
        .await
        .unwrap()
        .unwrap();
    assert!(fetched.value[..] == value[..]);
    let error = kv.get("absent").await.unwrap_err();
    assert_eq!(error.kind(), hkvm_client::KvErrorKind::NotFound);
    pool.shutdown().await;
}
