//! The testcontainers suite: real containers from locally built images on this
//! machine's Docker engine (only with `HKVM_DOCKER_TESTS=1`).

use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use futures::StreamExt as _;
use hkvm_itests::images::{nats_image, NATS_CLIENT_PORT};
use testcontainers::runners::AsyncRunner as _;
use testcontainers::ImageExt as _;

use crate::docker_gate::docker_or_skip;

/// A real NATS container with JetStream: create a stream, publish, read it back.
#[tokio::test]
async fn nats_container_runs_jetstream() {
    if !docker_or_skip("containers::nats_container_runs_jetstream") {
        return;
    }
    let container = nats_image()
        .with_cmd(["-js", "-sd", "/data/jetstream"])
        .with_startup_timeout(Duration::from_secs(60))
        .start()
        .await
        .expect("start the NATS container (run scripts/build-images first)");
    let host = container.get_host().await.unwrap();
    let port = container
        .get_host_port_ipv4(NATS_CLIENT_PORT)
        .await
        .unwrap();
    let client = async_nats::connect(format!("nats://{host}:{port}"))
        .await
        .unwrap();
    let js = jetstream::new(client);

    // The account info request fails unless JetStream is enabled in the server.
    js.query_account()
        .await
        .expect("JetStream is enabled in the container");

    let stream = js
        .create_stream(stream::Config {
            name: "SMOKE".to_owned(),
            subjects: vec!["smoke.>".to_owned()],
            ..Default::default()
        })
        .await
        .unwrap();
    let ack = js
        .publish("smoke.hello", "from the host".into())
        .await
        .unwrap()
        .await
        .unwrap();
    assert_eq!(ack.stream, "SMOKE");
    assert_eq!(ack.sequence, 1);

    let consumer = stream
        .create_consumer(consumer::pull::Config::default())
        .await
        .unwrap();
    let mut messages = consumer.fetch().max_messages(1).messages().await.unwrap();
    let message = messages.next().await.unwrap().unwrap();
    assert_eq!(message.subject.as_str(), "smoke.hello");
    assert_eq!(&message.payload[..], b"from the host");
}
