//! Direct requests to the sub-master leader: hot operations on a TCP link of
//! their own, everything else over NATS, the link following the leader across a
//! failover, NATS alone when the leader takes no direct requests, and foreign
//! bytes on the direct port refused without harm.

use std::time::Duration;

use hkvm_client::SubmasterClient;
use hkvm_events::rpc::direct::{encode_hello, frame_len, DirectHello, DirectTicket, DirectWelcome};
use hkvm_events::rpc::submaster::{ItemResult, PutEndItem};
use hkvm_events::rpc::{self, RpcReply};
use hkvm_events::{ClusterId, SubclusterId};
use hkvm_submaster::DirectListen;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

use crate::fixture::{put as put_event, Fixture};
use crate::submaster_server::{client, config, mount, start_item, SC};

/// Sends `exist` until the client has a direct link up (it links in the
/// background after its first call); returns the link's endpoint and epoch.
async fn wait_linked(client: &SubmasterClient) -> (String, u64) {
    for _ in 0..200 {
        client.exist(vec!["probe".into()]).await.unwrap();
        if let Some(linked) = client.direct_link() {
            return linked;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the client never linked to the leader");
}

/// The ticket the leader of `SC` published with its direct endpoint (what a
/// client reads over NATS).
async fn leader_ticket(fixture: &Fixture) -> Option<DirectTicket> {
    let js = async_nats::jetstream::new(fixture.connect().await);
    let bucket = hkvm_events::subject::Bucket::Leader.name(&fixture.cluster);
    let store = js.get_key_value(bucket).await.unwrap();
    let entry = store.get(SC).await.unwrap().expect("a leader lease");
    hkvm_events::lease::LeaseHolder::decode(&entry)
        .unwrap()
        .direct_ticket
}

/// Puts `key` (put_start then put_end with `put_id`) and checks both succeed.
async fn put(client: &SubmasterClient, key: &str, put_id: u64) {
    let mut item = start_item(key, 4096, 1);
    item.put_id = put_id;
    let started = client.put_start(vec![item]).await.unwrap();
    assert!(matches!(started[0], ItemResult::Ok(_)), "{started:?}");
    let ended = client
        .put_end(vec![PutEndItem {
            key: key.into(),
            checksum: 1,
            put_id,
        }])
        .await
        .unwrap();
    assert_eq!(ended, vec![ItemResult::Ok(())]);
}

#[tokio::test]
async fn hot_operations_go_direct_and_management_stays_on_nats() {
    let fixture = Fixture::new("t").await;
    let leader = fixture.spawn_submaster(config(&fixture, "sm-a")).await;
    let client = client(&fixture).await;
    mount(&client, "n1", 64 << 20).await;
    let (endpoint, epoch) = wait_linked(&client).await;
    assert!(epoch > 0, "linked to a leader in its epoch: {endpoint}");
    let before = client.direct_requests();
    for i in 0..20 {
        put(&client, &format!("k{i}"), 100 + i).await;
    }
    let keys: Vec<String> = (0..21).map(|i| format!("k{i}")).collect();
    let mut expected = vec![true; 20];
    expected.push(false);
    assert_eq!(client.exist(keys).await.unwrap(), expected);
    assert_eq!(
        client.direct_requests() - before,
        41,
        "every put_start, put_end and exist went direct"
    );
    // Management goes over NATS, and answers as before.
    assert_eq!(client.status().await.unwrap().producer, "sm-a");
    assert_eq!(client.direct_requests() - before, 41);
    assert!(
        leader
            .metrics_text()
            .contains("hkvm_submaster_direct_connections 1"),
        "{}",
        leader.metrics_text()
    );
    leader.shutdown().await.unwrap();
}

#[tokio::test]
async fn the_link_follows_the_leader_across_a_failover_and_nothing_acknowledged_is_lost() {
    let fixture = Fixture::new("t").await;
    let leader = fixture.spawn_submaster(config(&fixture, "sm-a")).await;
    let client = client(&fixture).await;
    mount(&client, "n1", 64 << 20).await;
    let (old_endpoint, old_epoch) = wait_linked(&client).await;
    put(&client, "before", 1).await;
    let readers = fixture.readers(SC).await;
    let standby = fixture.spawn_submaster(config(&fixture, "sm-b")).await;
    fixture.wait_new_reader_at_end(SC, &readers).await;
    leader.abort();

    // Through the takeover: the link breaks, calls go over NATS until the new
    // leader serves, then direct to it.
    put(&client, "after", 2).await;
    let (new_endpoint, new_epoch) = wait_linked(&client).await;
    assert!(
        new_epoch > old_epoch,
        "linked to the new leader: {old_endpoint} epoch {old_epoch} -> {new_endpoint} epoch {new_epoch}"
    );
    assert_eq!(
        client
            .exist(vec!["before".into(), "after".into()])
            .await
            .unwrap(),
        vec![true, true]
    );
    assert_eq!(client.status().await.unwrap().producer, "sm-b");
    standby.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_leader_without_a_direct_front_is_reached_over_nats_alone() {
    let fixture = Fixture::new("t").await;
    let mut off = config(&fixture, "sm-a");
    off.direct.listen = DirectListen::Off;
    let leader = fixture.spawn_submaster(off).await;
    let client = client(&fixture).await;
    mount(&client, "n1", 64 << 20).await;
    for i in 0..10 {
        put(&client, &format!("k{i}"), 1 + i).await;
        // Each call may start a background look for an endpoint; none exists.
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    assert_eq!(client.exist(vec!["k9".into()]).await.unwrap(), vec![true]);
    assert_eq!(client.direct_requests(), 0);
    assert_eq!(client.direct_link(), None);
    leader.shutdown().await.unwrap();
}

/// Reads one frame's content from `stream`; `None` at the end of the stream.
async fn read_frame(stream: &mut TcpStream) -> Option<Vec<u8>> {
    let mut prefix = [0u8; 4];
    stream.read_exact(&mut prefix).await.ok()?;
    let mut content = vec![0; frame_len(prefix).unwrap()];
    stream.read_exact(&mut content).await.ok()?;
    Some(content)
}

#[tokio::test]
async fn foreign_bytes_and_another_subclusters_hello_are_refused_without_harm() {
    let fixture = Fixture::new("t").await;
    let leader = fixture.spawn_submaster(config(&fixture, "sm-a")).await;
    let client = client(&fixture).await;
    mount(&client, "n1", 64 << 20).await;
    let (endpoint, epoch) = wait_linked(&client).await;

    // Not a hello: the connection is closed.
    let mut garbage = TcpStream::connect(&endpoint).await.unwrap();
    garbage
        .write_all(b"\x00\x00\x00\x10GET / HTTP/1.1\r\n")
        .await
        .unwrap();
    assert_eq!(read_frame(&mut garbage).await, None);

    // A length past the limit: closed before anything is read.
    let mut oversized = TcpStream::connect(&endpoint).await.unwrap();
    oversized.write_all(&u32::MAX.to_be_bytes()).await.unwrap();
    assert_eq!(read_frame(&mut oversized).await, None);

    let ticket = leader_ticket(&fixture).await;
    assert!(ticket.is_some(), "the leader publishes its direct ticket");

    // A right hello without the ticket (a process that reaches the port but
    // may not read the lease over NATS): refused, then the end.
    let mut unticketed = TcpStream::connect(&endpoint).await.unwrap();
    let hello = DirectHello {
        cluster: fixture.cluster.clone(),
        subcluster: Some(SubclusterId::new(SC).unwrap()),
        ticket: None,
    };
    unticketed.write_all(&encode_hello(&hello)).await.unwrap();
    let answer = read_frame(&mut unticketed).await.expect("an answer");
    let refused: RpcReply<DirectWelcome> = rpc::decode(&answer).unwrap();
    assert!(
        matches!(&refused, RpcReply::Err(error) if error.code == hkvm_events::rpc::RpcErrorCode::Forbidden),
        "{refused:?}"
    );
    assert_eq!(read_frame(&mut unticketed).await, None);

    // Another sub-cluster's hello: an error answer, then the end.
    let mut other = TcpStream::connect(&endpoint).await.unwrap();
    let hello = DirectHello {
        cluster: fixture.cluster.clone(),
        subcluster: Some(SubclusterId::new("elsewhere").unwrap()),
        ticket: ticket.clone(),
    };
    other.write_all(&encode_hello(&hello)).await.unwrap();
    let answer = read_frame(&mut other).await.expect("an answer");
    let refused: RpcReply<DirectWelcome> = rpc::decode(&answer).unwrap();
    assert!(matches!(refused, RpcReply::Err(_)), "{refused:?}");
    assert_eq!(read_frame(&mut other).await, None);

    // The right hello is welcomed by the serving leader.
    let mut right = TcpStream::connect(&endpoint).await.unwrap();
    let hello = DirectHello {
        cluster: ClusterId::new(fixture.cluster.as_str()).unwrap(),
        subcluster: Some(SubclusterId::new(SC).unwrap()),
        ticket,
    };
    right.write_all(&encode_hello(&hello)).await.unwrap();
    let welcome: RpcReply<DirectWelcome> =
        rpc::decode(&read_frame(&mut right).await.unwrap()).unwrap();
    match welcome {
        RpcReply::Ok(welcome) => {
            assert_eq!(welcome.server, "sm-a");
            assert_eq!(welcome.epoch, epoch);
        }
        RpcReply::Err(error) => panic!("{error}"),
    }

    // The leader kept serving through all of it.
    put(&client, "still", 7).await;
    leader.shutdown().await.unwrap();
}

/// Sends one raw `exist` request of `id` on `stream` and reads its reply body.
async fn raw_exist(stream: &mut TcpStream, id: u64) -> RpcReply<Vec<bool>> {
    let body = rpc::encode(&hkvm_events::rpc::submaster::Exist {
        keys: vec!["k".into()],
    })
    .unwrap();
    let mut frame = Vec::new();
    hkvm_events::rpc::direct::push_request(&mut frame, id, "exist", &body);
    stream.write_all(&frame).await.unwrap();
    let reply = read_frame(stream).await.expect("a reply");
    let (replied, body) = hkvm_events::rpc::direct::decode_reply(&reply).unwrap();
    assert_eq!(replied, id);
    rpc::decode(body).unwrap()
}

#[tokio::test]
async fn a_leader_whose_lease_is_unconfirmed_sends_direct_clients_back_to_nats() {
    let fixture = Fixture::new("t").await;
    let leader = fixture.spawn_submaster(config(&fixture, "sm-a")).await;
    let client = client(&fixture).await;
    mount(&client, "n1", 64 << 20).await;
    let (endpoint, _) = wait_linked(&client).await;
    let hello = DirectHello {
        cluster: fixture.cluster.clone(),
        subcluster: Some(SubclusterId::new(SC).unwrap()),
        ticket: leader_ticket(&fixture).await,
    };
    let mut raw = TcpStream::connect(&endpoint).await.unwrap();
    raw.write_all(&encode_hello(&hello)).await.unwrap();
    let welcome: RpcReply<DirectWelcome> =
        rpc::decode(&read_frame(&mut raw).await.unwrap()).unwrap();
    assert!(matches!(welcome, RpcReply::Ok(_)), "{welcome:?}");
    assert!(matches!(raw_exist(&mut raw, 1).await, RpcReply::Ok(_)));

    // The lease can no longer be renewed: within two thirds of its TTL the
    // leader no longer knows it leads.
    let js = async_nats::jetstream::new(fixture.connect().await);
    js.delete_key_value(hkvm_events::subject::Bucket::Leader.name(&fixture.cluster))
        .await
        .unwrap();
    let mut refused = None;
    for id in 2..200 {
        match raw_exist(&mut raw, id).await {
            // A request that passed the front just before the lease went
            // unconfirmed is refused `Busy` by the request loop: ask again.
            RpcReply::Err(error)
                if !matches!(error.code, hkvm_events::rpc::RpcErrorCode::Busy { .. }) =>
            {
                refused = Some(error);
                break;
            }
            _ => tokio::time::sleep(Duration::from_millis(25)).await,
        }
    }
    let refused = refused.expect("the leader kept answering direct requests unconfirmed");
    assert_eq!(
        refused.code,
        hkvm_events::rpc::RpcErrorCode::NotLeader,
        "{refused}"
    );
    // A new link is refused the same way.
    let mut again = TcpStream::connect(&endpoint).await.unwrap();
    again.write_all(&encode_hello(&hello)).await.unwrap();
    let answer: RpcReply<DirectWelcome> =
        rpc::decode(&read_frame(&mut again).await.unwrap()).unwrap();
    match answer {
        RpcReply::Err(error) => {
            assert_eq!(error.code, hkvm_events::rpc::RpcErrorCode::NotLeader)
        }
        RpcReply::Ok(welcome) => panic!("welcomed unconfirmed: {welcome:?}"),
    }
    leader.abort();
}

#[tokio::test]
async fn global_queries_go_direct_to_a_replica_and_move_when_it_stops() {
    let fixture = Fixture::new("t").await;
    let a = fixture.subcluster("sc-a", &[]).await;
    a.commit(vec![put_event("held")]).await;
    let first = fixture.start("g1").await;
    let second = fixture.start("g2").await;
    let global = fixture.global();
    let ask = || async {
        let reply = global
            .batch_is_exist(&["held", "nowhere"], None)
            .await
            .unwrap()
            .into_result()
            .unwrap();
        assert_eq!(reply.counts.0, [1, 0]);
    };
    let mut linked = None;
    for _ in 0..200 {
        ask().await;
        if let Some(endpoint) = global.direct_link() {
            linked = Some(endpoint);
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let linked = linked.expect("the client never linked to a replica");
    let endpoints = [first.direct_endpoint(), second.direct_endpoint()];
    assert!(endpoints.contains(&Some(linked.as_str())), "{linked}");
    let before = global.direct_requests();
    for _ in 0..10 {
        ask().await;
    }
    assert_eq!(
        global.direct_requests() - before,
        10,
        "each query went direct"
    );

    // The linked replica stops: queries go on (over NATS to the other, then on
    // a link to it).
    let (stopping, staying) = if endpoints[0] == Some(linked.as_str()) {
        (first, second)
    } else {
        (second, first)
    };
    stopping.shutdown();
    let mut moved = false;
    for _ in 0..300 {
        ask().await;
        if global.direct_link().as_deref() == staying.direct_endpoint() {
            moved = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(moved, "the client never linked to the remaining replica");
}

#[tokio::test]
async fn a_client_that_sends_little_stays_on_nats() {
    let fixture = Fixture::new("t").await;
    let leader = fixture.spawn_submaster(config(&fixture, "sm-a")).await;
    let client = client(&fixture).await;
    mount(&client, "n1", 64 << 20).await;
    // A node's pings and an occasional operation: a few requests a second.
    for _ in 0..12 {
        client.exist(vec!["k".into()]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    assert_eq!(client.direct_link(), None);
    assert_eq!(client.direct_requests(), 0);
    // Busy now: it links.
    let (endpoint, _) = wait_linked(&client).await;
    assert!(!endpoint.is_empty());
    leader.shutdown().await.unwrap();
}
