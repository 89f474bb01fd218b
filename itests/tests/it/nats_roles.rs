//! The roles of the generated NATS permissions (docs/security.md), each user
//! against a real nats-server running the generated config: nodes read their
//! sub-cluster's grant key and clients cannot, nor another user's replies; a
//! client cannot unmount a node, a node cannot unmount another node, and only
//! the admins (the operator, and the pool admin engines that reset their pool
//! log in as) remove everything.

use std::sync::Arc;
use std::time::Duration;

use hkvm_client::store::{Store, StoreAddress, StoreConfig};
use hkvm_client::{ClientError, KvClient, NodeConfig, NodeHandle, SubmasterClient};
use hkvm_events::rpc::submaster::{RemoveAll, Status, StatusReply, UnmountSegment};
use hkvm_events::rpc::{RpcErrorCode, RpcReply};
use hkvm_events::subject::{
    inbox_prefix, submaster_admin_subject, submaster_node_subject, submaster_rpc_subject, Bucket,
};
use hkvm_events::{ClusterId, NodeId, ProducerId, SegmentId, SubclusterId};
use hkvm_itests::security::{self, nats_conf, ListedNode};
use hkvm_log::grants::{self, GrantKeyError};
use hkvm_submaster::{SubmasterConfig, SubmasterHandle};
use hkvm_testkit::{NatsServer, ServerOptions};
use hkvm_transfer::TcpTransport;
use tokio::sync::mpsc;

/// Node `n0` of sub-cluster `sc`, with a user of its own.
const N0: ListedNode<'static> = ListedNode {
    node: "n0",
    subcluster: "sc",
};
/// Node `n1` of sub-cluster `sc`, with a user of its own.
const N1: ListedNode<'static> = ListedNode {
    node: "n1",
    subcluster: "sc",
};
/// Node `gpu7` of sub-cluster `sc`: a full store logs in as it.
const GPU7: ListedNode<'static> = ListedNode {
    node: "gpu7",
    subcluster: "sc",
};

/// A nats-server running the generated config of `cluster` (one sub-cluster,
/// `sc`, and these nodes of their own users), and the sub-cluster's sub-master
/// under its user.
async fn secured_subcluster(
    cluster: &str,
    nodes: &[ListedNode<'_>],
) -> (NatsServer, SubmasterHandle) {
    let server = NatsServer::start_with(ServerOptions {
        extra_config: nats_conf(cluster, &["sc"], nodes).unwrap(),
        ..ServerOptions::default()
    })
    .await
    .unwrap();
    let mut config = SubmasterConfig::new(
        ClusterId::new(cluster).unwrap(),
        SubclusterId::new("sc").unwrap(),
        ProducerId::new(format!("{cluster}-sm")).unwrap(),
    );
    config.policy.node_timeout_ms = 600_000;
    let master = SubmasterHandle::spawn(
        connect_as(&server, &security::submaster_user("sc")).await,
        config,
    );
    (server, master)
}

/// A connection to `server` as `user` of the generated config, with the user's
/// inbox prefix (as HKVM's processes connect), whose requests give up after 2 s
/// (a request the permissions drop gets no answer); the server's errors about it
/// (permissions violations) come out of the receiver.
async fn connect_watched(
    server: &NatsServer,
    user: &str,
) -> (async_nats::Client, mpsc::UnboundedReceiver<String>) {
    let (errors_tx, errors) = mpsc::unbounded_channel();
    let client = async_nats::ConnectOptions::with_user_and_password(
        user.to_owned(),
        security::password(user),
    )
    .custom_inbox_prefix(inbox_prefix(user))
    .request_timeout(Some(Duration::from_secs(2)))
    .event_callback(move |event| {
        if let async_nats::Event::ServerError(error) = event {
            let _ = errors_tx.send(error.to_string());
        }
        async {}
    })
    .connect(server.url())
    .await
    .unwrap();
    (client, errors)
}

async fn connect_as(server: &NatsServer, user: &str) -> async_nats::Client {
    connect_watched(server, user).await.0
}

/// Waits (up to 30 s) for the server to refuse a subscription to `subject`.
async fn subscription_refused(errors: &mut mpsc::UnboundedReceiver<String>, subject: &str) {
    let expected = format!("Subscription to \"{subject}\"");
    tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(error) = errors.recv().await {
            if error.contains(&expected) {
                return;
            }
        }
        panic!("the connection ended before the refusal");
    })
    .await
    .unwrap_or_else(|_| panic!("subscribing to {subject} was not refused"));
}

/// Asks JetStream to purge `stream`: an error when the permissions drop the
/// request (no answer) or JetStream refuses it.
async fn purge(nats: &async_nats::Client, stream: &str) -> Result<(), String> {
    let answer = nats
        .request(format!("$JS.API.STREAM.PURGE.{stream}"), "".into())
        .await
        .map_err(|error| error.to_string())?;
    let body = String::from_utf8_lossy(&answer.payload).into_owned();
    if body.contains("\"success\":true") {
        Ok(())
    } else {
        Err(body)
    }
}

#[tokio::test]
async fn under_the_generated_permissions_nodes_read_the_grant_key_and_clients_cannot_nor_others_replies(
) {
    let (server, master) = secured_subcluster("sec", &[N0]).await;
    let cluster = ClusterId::new("sec").unwrap();
    let subcluster = SubclusterId::new("sc").unwrap();

    // A node under its own user reads the key and serves its segment.
    let node_metadata = SubmasterClient::new(
        connect_as(&server, &security::node_user("n0")).await,
        cluster.clone(),
        subcluster.clone(),
    );
    let node = NodeHandle::start(
        NodeConfig::new(NodeId::new("n0").unwrap(), 16 << 20).unwrap(),
        node_metadata,
    )
    .await
    .unwrap();

    // A client under the client user puts and reads through it with the
    // grants the sub-master hands it...
    let client_nats = connect_as(&server, security::CLIENT_USER).await;
    let kv = KvClient::new(
        SubmasterClient::new(client_nats.clone(), cluster.clone(), subcluster.clone()),
        Arc::new(TcpTransport::default()),
    );
    kv.put("k", &[7u8; 1000], 1).await.unwrap();
    assert_eq!(kv.get("k").await.unwrap().value.to_vec(), vec![7u8; 1000]);

    // ...but cannot read the key it would need to make grants of its own, nor
    // purge the sub-cluster's stream.
    let js = async_nats::jetstream::new(client_nats.clone());
    let refused = grants::read(&js, &cluster, &subcluster).await.unwrap_err();
    assert!(
        matches!(refused, GrantKeyError::Transport { .. }),
        "{refused}"
    );
    let stream = hkvm_events::subject::stream_name(&cluster, &subcluster);
    assert!(purge(&client_nats, &stream).await.is_err());
    // The node user can read the key (so the refusal above is the permission).
    // Nor read another user's replies: its subscriptions stay in its own inbox.
    let (snooper, mut errors) = connect_watched(&server, security::CLIENT_USER).await;
    for subject in ["_INBOX.>", "_INBOX_node-n0.>", "_INBOX_sm-sc.>"] {
        let _ = snooper.subscribe(subject).await.unwrap();
        snooper.flush().await.unwrap();
        subscription_refused(&mut errors, subject).await;
    }
    let node_nats = connect_as(&server, &security::node_user("n0")).await;
    let node_js = async_nats::jetstream::new(node_nats.clone());
    let key = grants::read(&node_js, &cluster, &subcluster).await.unwrap();
    assert!(purge(&node_nats, &stream).await.is_err());
    assert_eq!(
        kv.get("k")
            .await
            .unwrap()
            .replica
            .grant
            .map(|grant| grant.key_id),
        Some(key.id)
    );

    node.shutdown().await.unwrap();
    master.shutdown().await.unwrap();
    // A sub-master may not purge or delete what all sub-clusters share.
    let sub_master = connect_as(&server, &security::submaster_user("sc")).await;
    let grants_stream = format!("KV_{}", Bucket::Grants.name(&cluster));
    let leader_stream = format!("KV_{}", Bucket::Leader.name(&cluster));
    assert!(purge(&sub_master, &grants_stream).await.is_err());
    assert!(purge(&sub_master, &leader_stream).await.is_err());
    // The operator may purge: the refusals above are the permissions'.
    let admin_purge = connect_as(&server, security::ADMIN_USER).await;
    assert_eq!(purge(&admin_purge, &grants_stream).await, Ok(()));
    let admin = connect_as(&server, security::ADMIN_USER).await;
    assert_eq!(purge(&admin, &stream).await, Ok(()));
}

/// The error a raw request on `subject` gets (its body `body`), or `None` when
/// it got no answer: the permissions dropped it.
async fn raw_error(
    nats: &async_nats::Client,
    subject: String,
    body: Vec<u8>,
) -> Option<RpcErrorCode> {
    let answer = nats.request(subject, body.into()).await.ok()?;
    match hkvm_events::rpc::decode::<RpcReply<()>>(&answer.payload) {
        Ok(RpcReply::Err(error)) => Some(error.code),
        other => panic!("expected an error reply, got {other:?}"),
    }
}

/// The segments the sub-master has mounted.
async fn mounted(admin: &SubmasterClient) -> Vec<String> {
    let status: StatusReply = admin
        .caller()
        .call_once(
            "status",
            submaster_rpc_subject(admin.cluster(), admin.subcluster(), "status"),
            &Status { segments: true },
        )
        .await
        .unwrap()
        .into_result()
        .unwrap();
    let mut segments: Vec<String> = status
        .segment_list
        .into_iter()
        .map(|segment| segment.id.to_string())
        .collect();
    segments.sort();
    segments
}

#[tokio::test]
async fn a_client_cannot_unmount_a_node_a_node_only_itself_and_only_an_admin_removes_everything() {
    let (server, master) = secured_subcluster("roles", &[N0, N1, GPU7]).await;
    let cluster = ClusterId::new("roles").unwrap();
    let subcluster = SubclusterId::new("sc").unwrap();
    let metadata_as =
        |nats: async_nats::Client| SubmasterClient::new(nats, cluster.clone(), subcluster.clone());
    // Each node mounts under its own user: on its own subject.
    let mut nodes = Vec::new();
    for listed in [N0, N1] {
        let nats = connect_as(&server, &security::node_user(listed.node)).await;
        let node_config = NodeConfig::new(NodeId::new(listed.node).unwrap(), 8 << 20).unwrap();
        nodes.push(
            NodeHandle::start(node_config, metadata_as(nats))
                .await
                .unwrap(),
        );
    }
    let admin = metadata_as(connect_as(&server, security::ADMIN_USER).await);
    let both = vec!["n0-seg".to_owned(), "n1-seg".to_owned()];
    assert_eq!(mounted(&admin).await, both);
    // A full store (what `hkvm.store` opens) under a node's own user is that
    // node: the only one its user may mount for.
    let gpu7_url = server.url().replacen(
        "nats://",
        &format!("nats://node-gpu7:{}@", security::password("node-gpu7")),
        1,
    );
    let address: StoreAddress = format!("{gpu7_url}/roles/sc").parse().unwrap();
    let store = Store::open(StoreConfig::new(address, "127.0.0.1"))
        .await
        .unwrap();
    let three = vec![
        "gpu7-seg".to_owned(),
        "n0-seg".to_owned(),
        "n1-seg".to_owned(),
    ];
    assert_eq!(mounted(&admin).await, three);
    store.close().await;
    assert_eq!(mounted(&admin).await, both);
    let client_nats = connect_as(&server, security::CLIENT_USER).await;
    let kv = KvClient::new(
        metadata_as(client_nats.clone()),
        Arc::new(TcpTransport::default()),
    );
    for i in 0..10 {
        kv.put(&format!("k{i}"), &[i as u8; 512], 1).await.unwrap();
    }

    // A client unmounts nothing: its publish to a node's subject is dropped,
    // and on the plain subject the sub-master refuses it.
    let unmount_n0 = hkvm_events::rpc::encode(&UnmountSegment {
        node: NodeId::new("n0").unwrap(),
        segment: SegmentId::new("n0-seg").unwrap(),
    })
    .unwrap();
    let n0_subject = submaster_node_subject(&cluster, &subcluster, "n0", "unmount_segment");
    let plain = submaster_rpc_subject(&cluster, &subcluster, "unmount_segment");
    assert_eq!(
        raw_error(&client_nats, n0_subject.clone(), unmount_n0.clone()).await,
        None
    );
    assert_eq!(
        raw_error(&client_nats, plain.clone(), unmount_n0.clone()).await,
        Some(RpcErrorCode::Forbidden)
    );
    // Node n1 may not publish on n0's subject, and on its own a request
    // naming n0 is refused.
    let n1_nats = connect_as(&server, &security::node_user("n1")).await;
    let n1_subject = submaster_node_subject(&cluster, &subcluster, "n1", "unmount_segment");
    assert_eq!(
        raw_error(&n1_nats, n0_subject, unmount_n0.clone()).await,
        None
    );
    assert_eq!(
        raw_error(&n1_nats, n1_subject, unmount_n0).await,
        Some(RpcErrorCode::Forbidden)
    );
    assert_eq!(
        mounted(&admin).await,
        both,
        "every refused unmount left n0 mounted"
    );

    // Removing everything: the client's library refuses at once; a raw publish
    // to the admin subject is dropped; on the plain subject it is refused.
    let client_metadata = metadata_as(client_nats.clone());
    let refused = client_metadata.remove_all(true).await.unwrap_err();
    assert!(
        matches!(&refused, ClientError::Rpc { source, .. } if source.code == RpcErrorCode::Forbidden),
        "{refused}"
    );
    let remove_all = hkvm_events::rpc::encode(&RemoveAll { force: true }).unwrap();
    let admin_subject = submaster_admin_subject(&cluster, &subcluster, "remove_all");
    assert_eq!(
        raw_error(&client_nats, admin_subject, remove_all.clone()).await,
        None
    );
    assert_eq!(
        raw_error(
            &client_nats,
            submaster_rpc_subject(&cluster, &subcluster, "remove_all"),
            remove_all
        )
        .await,
        Some(RpcErrorCode::Forbidden)
    );
    assert_eq!(
        admin.exist(vec!["k0".to_owned()]).await.unwrap(),
        vec![true]
    );
    // The admin may: every object goes, the nodes stay.
    assert_eq!(admin.remove_all(true).await.unwrap().removed, 10);
    assert_eq!(
        admin.exist(vec!["k0".to_owned()]).await.unwrap(),
        vec![false]
    );
    // Each node unmounts itself on leaving.
    for node in nodes {
        node.shutdown().await.unwrap();
    }
    assert_eq!(mounted(&admin).await, Vec::<String>::new());
    master.shutdown().await.unwrap();
}
