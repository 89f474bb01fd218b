//! A node's data port serves only what its sub-master granted
//! (docs/security.md, "The data port"): a raw TCP client without a grant, with a
//! forged one, a stretched one, an expired one, one for another range or for the
//! other access reads and writes nothing, while the grant the sub-master handed
//! out works. And under the generated NATS permissions, nodes read the grant key
//! and clients cannot, nor another user's replies.

use std::sync::Arc;
use std::time::Duration;

use hkvm_client::{KvClient, NodeConfig, NodeHandle, SubmasterClient};
use hkvm_events::grant::{Access, Grant, GrantKey, GrantRequest};
use hkvm_events::rpc::submaster::{ItemResult, ReplicaLocation};
use hkvm_events::subject::{inbox_prefix, Bucket};
use hkvm_events::{ClusterId, NodeId, ProducerId, SubclusterId};
use hkvm_itests::security::{self, nats_conf};
use hkvm_log::grants::{self, GrantKeyError};
use hkvm_log::registry::now_unix_ms;
use hkvm_submaster::{SubmasterConfig, SubmasterHandle};
use hkvm_testkit::{NatsServer, ServerOptions};
use hkvm_transfer::{ErrorKind, ReadOp, TcpTransport, Transport, WriteOp};
use tokio::sync::mpsc;

use crate::fixture::{Pool, PoolSpec};

const VALUE_LEN: usize = 4096;

/// The one replica of `key`, as a reader gets it from the sub-master.
async fn replica_of(kv: &KvClient, key: &str) -> ReplicaLocation {
    let mut lists = kv
        .metadata()
        .get_replica_list(vec![key.to_owned()])
        .await
        .unwrap();
    let ItemResult::Ok(list) = lists.remove(0) else {
        panic!("{key} is not listed")
    };
    list.replicas.into_iter().next().unwrap()
}

async fn read(
    raw: &TcpTransport,
    replica: &ReplicaLocation,
    grant: &[u8],
) -> Result<Vec<u8>, ErrorKind> {
    raw.read_batch(
        &replica.endpoint,
        &[ReadOp {
            region: replica.segment.as_str(),
            offset: replica.offset,
            len: VALUE_LEN as u64,
            grant,
        }],
    )
    .await
    .map(|mut values| values.remove(0).to_vec())
    .map_err(|error| error.kind())
}

async fn write(
    raw: &TcpTransport,
    replica: &ReplicaLocation,
    grant: &[u8],
) -> Result<(), ErrorKind> {
    raw.write_batch(
        &replica.endpoint,
        &[WriteOp {
            region: replica.segment.as_str(),
            offset: replica.offset,
            data: &[0xee; VALUE_LEN],
            grant,
        }],
    )
    .await
    .map_err(|error| error.kind())
}

fn signed(
    key: &GrantKey,
    replica: &ReplicaLocation,
    change: impl FnOnce(&mut GrantRequest<'_>),
) -> [u8; 45] {
    let mut request = GrantRequest {
        segment: replica.segment.as_str(),
        access: Access::Read,
        offset: replica.offset,
        len: VALUE_LEN as u64,
        expires_unix_ms: now_unix_ms() + 60_000,
    };
    change(&mut request);
    key.sign(request).to_wire()
}

#[tokio::test]
async fn the_data_port_serves_only_what_the_submaster_granted() {
    let pool = Pool::start(
        PoolSpec::new("grants")
            .subcluster("sc", &[])
            .nodes(1, 16 << 20),
    )
    .await;
    let kv = &pool.kv["sc"];
    let secret = vec![0x5a; VALUE_LEN];
    kv.put("secret", &secret, 1).await.unwrap();
    let replica = replica_of(kv, "secret").await;
    let granted: Grant = replica
        .grant
        .expect("the sub-master grants every replica it lists");
    assert_eq!(granted.access, Access::Read);
    let raw = TcpTransport::default();

    // The grant handed out reads the value (so the refusals below can fail).
    assert_eq!(
        read(&raw, &replica, &granted.to_wire()).await,
        Ok(secret.clone())
    );

    // No grant, one made with another key, and the real one stretched to the
    // whole segment or turned into a write grant: refused.
    let foreign = grants::generate_key();
    let stretched = Grant {
        offset: 0,
        len: 16 << 20,
        ..granted
    };
    let as_write = Grant {
        access: Access::Write,
        ..granted
    };
    for (what, grant) in [
        ("no grant", Vec::new()),
        ("another key", signed(&foreign, &replica, |_| {}).to_vec()),
        ("stretched", stretched.to_wire().to_vec()),
        ("turned into a write", as_write.to_wire().to_vec()),
    ] {
        assert_eq!(
            read(&raw, &replica, &grant).await,
            Err(ErrorKind::Denied),
            "read with {what}"
        );
        assert_eq!(
            write(&raw, &replica, &grant).await,
            Err(ErrorKind::Denied),
            "write with {what}"
        );
    }
    let whole_segment = raw
        .read_batch(
            &replica.endpoint,
            &[ReadOp {
                region: replica.segment.as_str(),
                offset: 0,
                len: 16 << 20,
                grant: &granted.to_wire(),
            }],
        )
        .await
        .unwrap_err();
    assert_eq!(whole_segment.kind(), ErrorKind::Denied);

    // With the real key (read as an operator may): expired, another range, the
    // wrong access.
    let key = grants::read(
        &pool.fixture.js,
        &pool.fixture.cluster,
        &SubclusterId::new("sc").unwrap(),
    )
    .await
    .unwrap();
    let expired = signed(&key, &replica, |r| {
        r.expires_unix_ms = now_unix_ms() - 60_000
    });
    let next_range = signed(&key, &replica, |r| r.offset += VALUE_LEN as u64);
    let read_grant = signed(&key, &replica, |_| {});
    assert_eq!(read(&raw, &replica, &expired).await, Err(ErrorKind::Denied));
    assert_eq!(
        read(&raw, &replica, &next_range).await,
        Err(ErrorKind::Denied)
    );
    assert_eq!(
        write(&raw, &replica, &read_grant).await,
        Err(ErrorKind::Denied)
    );
    assert_eq!(read(&raw, &replica, &read_grant).await, Ok(secret.clone()));

    // Nothing written: the value is intact, for the client and in the segment.
    assert_eq!(kv.get("secret").await.unwrap().value.to_vec(), secret);
    let mut stored = vec![0u8; VALUE_LEN];
    pool.nodes[0]
        .segment()
        .read_at(replica.offset, &mut stored)
        .unwrap();
    assert_eq!(stored, secret);
    pool.shutdown().await;
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
    let cluster = ClusterId::new("sec").unwrap();
    let subcluster = SubclusterId::new("sc").unwrap();
    let server = NatsServer::start_with(ServerOptions {
        extra_config: nats_conf("sec", &["sc"]).unwrap(),
        ..ServerOptions::default()
    })
    .await
    .unwrap();
    let mut config = SubmasterConfig::new(
        cluster.clone(),
        subcluster.clone(),
        ProducerId::new("sc-sm").unwrap(),
    );
    config.policy.node_timeout_ms = 600_000;
    let master = SubmasterHandle::spawn(
        connect_as(&server, &security::submaster_user("sc")).await,
        config,
    );

    // A node under the node user reads the key and serves its segment.
    let node_metadata = SubmasterClient::new(
        connect_as(&server, security::NODE_USER).await,
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
    for subject in ["_INBOX.>", "_INBOX_node.>", "_INBOX_sm-sc.>"] {
        let _ = snooper.subscribe(subject).await.unwrap();
        snooper.flush().await.unwrap();
        subscription_refused(&mut errors, subject).await;
    }
    let node_nats = connect_as(&server, security::NODE_USER).await;
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
