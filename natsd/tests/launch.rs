//! The launcher against the real `nats-server` binary: client port choices, a
//! graceful stop, and the temp dir's lifetime.
#![allow(clippy::unwrap_used)]

use std::net::TcpListener;

use hkvm_natsd::{ClientPort, NatsServer, ServerOptions};

#[tokio::test]
async fn a_taken_preferred_port_falls_back_to_a_free_one() {
    let taken = TcpListener::bind(("127.0.0.1", 0)).unwrap();
    let port = taken.local_addr().unwrap().port();
    let server = NatsServer::start_with(ServerOptions {
        name: "hkvm-preferred".to_owned(),
        client_port: ClientPort::Preferred(port),
        ..ServerOptions::default()
    })
    .await
    .unwrap();
    assert_ne!(server.client_port(), port);
    assert_eq!(server.name(), "hkvm-preferred");
    server.connect().await.unwrap();
}

#[tokio::test]
async fn a_free_preferred_port_is_used() {
    let port = hkvm_natsd::free_port().unwrap();
    let server = NatsServer::start_with(ServerOptions {
        client_port: ClientPort::Preferred(port),
        ..ServerOptions::default()
    })
    .await
    .unwrap();
    assert_eq!(server.client_port(), port);
    assert_eq!(server.url(), format!("nats://127.0.0.1:{port}"));
}

#[tokio::test]
async fn a_stopped_server_keeps_its_dir_until_dropped() {
    let mut server = NatsServer::start().await.unwrap();
    assert!(server.is_running());
    assert!(server.pid().is_some());
    server.stop();
    assert!(!server.is_running());
    assert!(server.store_dir().exists(), "JetStream wrote its store");
    assert!(!server.log_tail().is_empty(), "the server logged");
    let dir = server.dir().to_path_buf();
    drop(server);
    assert!(!dir.exists(), "the temp dir is removed on drop");
}
