//! The test kit against the real `nats-server` binary: single servers and a 3-node
//! cluster surviving the loss of one node.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use async_nats::jetstream::{self, stream};
use hkvm_testkit::{NatsCluster, NatsServer};

async fn publish_and_count(client: async_nats::Client, name: &str, replicas: usize, n: u64) -> u64 {
    let js = jetstream::new(client);
    let stream_config = stream::Config {
        name: name.to_owned(),
        subjects: vec![format!("{name}.>")],
        num_replicas: replicas,
        ..Default::default()
    };
    let mut stream = js.get_or_create_stream(stream_config).await.unwrap();
    for i in 0..n {
        // A replicated stream can take a moment to accept writes after its creation.
        let mut attempts = 0;
        loop {
            let published = async {
                js.publish(format!("{name}.x"), i.to_string().into())
                    .await?
                    .await
            };
            match published.await {
                Ok(_) => break,
                Err(error) if attempts < 100 => {
                    attempts += 1;
                    let _ = error;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(error) => panic!("publish failed: {error}"),
            }
        }
    }
    stream.info().await.unwrap().state.messages
}

#[tokio::test]
async fn single_server_runs_jetstream_and_keeps_data_across_a_kill() {
    let mut server = NatsServer::start().await.unwrap();
    assert!(server.is_running());
    let client = server.connect().await.unwrap();
    assert_eq!(publish_and_count(client, "ONE", 1, 5).await, 5);

    // A SIGKILL crash and a restart on the same store dir: acknowledged messages stay.
    server.kill();
    assert!(!server.is_running());
    server.restart().await.unwrap();
    let js = jetstream::new(server.connect().await.unwrap());
    let mut stream = js.get_stream("ONE").await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 5);
}

#[tokio::test]
async fn two_servers_do_not_share_ports_or_state() {
    let a = NatsServer::start().await.unwrap();
    let b = NatsServer::start().await.unwrap();
    assert_ne!(a.client_port(), b.client_port());
    assert_ne!(a.store_dir(), b.store_dir());
    let dir = a.dir().to_path_buf();
    drop(a);
    assert!(!dir.exists(), "the temp dir is removed on drop");
    assert!(b.connect().await.is_ok());
}

#[tokio::test]
async fn cluster_keeps_r3_stream_available_when_one_node_dies() {
    let mut cluster = NatsCluster::start(3).await.unwrap();
    let client = cluster.connect().await.unwrap();
    assert_eq!(publish_and_count(client.clone(), "TRIO", 3, 10).await, 10);

    cluster.kill(0).unwrap();
    let js = jetstream::new(client);
    // The client may still be reconnecting to a surviving node, and the stream may
    // be electing a leader: each message is sent again until acknowledged. A send
    // whose acknowledgement was lost may still have been stored, so every message
    // has its own id and a resend is stored once (else the count below is off).
    for n in 0..5 {
        let mut attempts = 0;
        loop {
            let message = jetstream::message::PublishMessage::build()
                .payload("after".into())
                .message_id(format!("after-{n}"));
            let published = async { js.send_publish("TRIO.x", message).await?.await };
            if tokio::time::timeout(Duration::from_secs(2), published)
                .await
                .is_ok_and(|r| r.is_ok())
            {
                break;
            }
            attempts += 1;
            assert!(
                attempts < 100,
                "the R3 stream never accepted writes with one node down"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    cluster.restart(0).await.unwrap();
    let node0 = cluster.node(0).unwrap().connect().await.unwrap();
    let mut stream = jetstream::new(node0).get_stream("TRIO").await.unwrap();
    let mut messages = 0;
    // The restarted node catches up from the others, and the stream may be electing
    // a leader (503s meanwhile); poll generously rather than time anything.
    for _ in 0..300 {
        if let Ok(info) = stream.info().await {
            messages = info.state.messages;
            if messages == 15 {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(messages, 15, "no acknowledged message is lost");

    // Every acknowledged message is still readable by sequence.
    let mut seen = 0;
    for seq in 1..=15 {
        for _ in 0..100 {
            if stream.get_raw_message(seq).await.is_ok() {
                seen += 1;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    assert_eq!(seen, 15);
}
