//! Bounded history against a real nats-server: a sub-master purges its stream up
//! to each verified snapshot, never past a fresh reader position; a restore after
//! purges equals the fold of every event ever appended; a reader that comes late
//! seeds from the snapshot; global-master checkpoints record their positions; a
//! stale position no longer holds the purge back.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use hkvm_events::rpc::global::{BatchIsExist, BatchIsExistReply, GlobalOp};
use hkvm_events::{decode_message, Limits, SubclusterId};
use hkvm_log::positions::{Positions, ReaderKind};
use hkvm_log::{EventLog as _, JetStreamLog, ReadOptions};
use hkvm_submaster::state::State;
use tokio::sync::Mutex;

use crate::fixture::{poll_every, poll_until, wait_applied, Fixture, LISTING_POLL, WAIT};
use crate::submaster_server::{client, config, mount, put, SC};

fn sc() -> SubclusterId {
    SubclusterId::new(SC).unwrap()
}

/// A reader of the whole stream as it is written: folds every message into a
/// sub-master state (the model of "everything ever appended") and records its
/// position after each one, as a real reader does, so purges never pass it.
async fn follow_into_model(log: JetStreamLog, positions: Positions, model: Arc<Mutex<State>>) {
    let mut entries = log
        .read(ReadOptions {
            follow: true,
            ..ReadOptions::from(1)
        })
        .await
        .unwrap();
    while let Some(entry) = entries.next().await {
        let entry = entry.unwrap();
        let message = decode_message(&entry.payload, &Limits::default()).unwrap();
        let events: Vec<_> = message.events.map(Result::unwrap).collect();
        model
            .lock()
            .await
            .apply_message(entry.seq, message.header.epoch, &events);
        positions
            .record(&sc(), ReaderKind::Other, "model", entry.seq)
            .await
            .unwrap();
    }
}

async fn first_seq(fixture: &Fixture) -> u64 {
    fixture.log(&sc()).bounds().await.unwrap().first_seq
}

#[tokio::test]
async fn purges_bound_the_history_and_restore_still_equals_everything_ever_appended() {
    let fixture = Fixture::new("t").await;
    let positions = Positions::open(&fixture.js, &fixture.cluster, 1)
        .await
        .unwrap();
    // The model reader is registered before anything is written.
    positions
        .record(&sc(), ReaderKind::Other, "model", 0)
        .await
        .unwrap();
    let mut cfg = config(&fixture, "sm-a");
    cfg.snapshot_every_events = 25;
    let master = fixture.spawn_submaster(cfg.clone()).await;
    let client = client(&fixture).await;
    for node in ["n1", "n2"] {
        mount(&client, node, 16 << 20).await;
    }
    // The stream exists now; the position recorded above kept all of it.
    let model = Arc::new(Mutex::new(State::new()));
    let reader = tokio::spawn(follow_into_model(
        fixture.log(&sc()),
        positions.clone(),
        Arc::clone(&model),
    ));
    for i in 0..200 {
        put(&client, &format!("k{i}")).await.unwrap();
        if i % 7 == 0 {
            client.remove(vec![format!("k{i}")], true).await.unwrap();
        }
    }
    // Snapshots every 25 events: the history before one of them is gone.
    let purged_to = poll_until("a purge of the stream", WAIT, || async {
        let first = first_seq(&fixture).await;
        (first > 1).then_some(first)
    })
    .await;
    master.shutdown().await.unwrap();
    let last = fixture.log(&sc()).bounds().await.unwrap().last_seq;
    poll_until("the model reader at the end", WAIT, || async {
        (model.lock().await.applied_seq >= last).then_some(())
    })
    .await;
    reader.abort();

    // The purge never passed the model reader, which recorded each position only
    // after folding it; and nothing it held back was lost.
    let js = fixture.js.clone();
    let restored = hkvm_submaster::server::load_state(&js, &cfg, true)
        .await
        .unwrap();
    assert!(
        restored.snapshot_seq + 1 >= purged_to,
        "the snapshot covers the purged history"
    );
    let model = model.lock().await;
    assert!(restored.state.same_durable_state(&model));
    assert_eq!(model.object_count(), 200 - 29);
    // Without the snapshot the history is no longer there to replay.
    let full = hkvm_submaster::server::load_state(&js, &cfg, false).await;
    match full {
        Err(error) => assert!(error.to_string().contains("purged"), "{error}"),
        Ok(loaded) => panic!("a full replay of a purged stream succeeded: {loaded:?}"),
    }

    // A reader that comes now seeds from the snapshot and knows the early keys.
    let global = fixture.start("late").await;
    wait_applied(&global, &sc(), last).await;
    let reply: BatchIsExistReply = fixture
        .global()
        .call(
            GlobalOp::BatchIsExist,
            &BatchIsExist {
                keys: vec!["k1".into(), "k7".into(), "k199".into()],
                labels: None,
            },
        )
        .await
        .unwrap();
    let holders: Vec<usize> = (0..3).map(|i| reply.holders_of(i).len()).collect();
    assert_eq!(holders, [1, 0, 1]);
    assert_eq!(global.status().sources[0].resyncs, 0);
}

/// How many snapshot markers the stream still holds (read again when a purge
/// moves its start meanwhile).
async fn markers(log: &JetStreamLog) -> usize {
    'read: loop {
        let bounds = log.bounds().await.unwrap();
        let options = ReadOptions {
            until_seq: Some(bounds.last_seq),
            ..ReadOptions::from(bounds.first_seq)
        };
        let Ok(mut entries) = log.read(options).await else {
            continue;
        };
        let mut count = 0;
        while let Some(entry) = entries.next().await {
            let Ok(entry) = entry else { continue 'read };
            let message = decode_message(&entry.payload, &Limits::default()).unwrap();
            count += message
                .events
                .filter(|event| matches!(event, Ok(hkvm_events::KvEvent::Snapshot(_))))
                .count();
        }
        return count;
    }
}

#[tokio::test]
async fn a_fresh_reader_holds_the_purge_back_until_its_position_goes_stale() {
    let fixture = Fixture::new("t").await;
    let positions = Positions::open(&fixture.js, &fixture.cluster, 1)
        .await
        .unwrap();
    let subcluster = sc();
    let slow = || positions.record(&subcluster, ReaderKind::Other, "slow", 3);
    slow().await.unwrap();
    let mut cfg = config(&fixture, "sm-a");
    cfg.snapshot_every_events = 10;
    cfg.history.reader_ttl = Duration::from_secs(3);
    let _master = fixture.spawn_submaster(cfg).await;
    let client = client(&fixture).await;
    mount(&client, "n1", 16 << 20).await;
    mount(&client, "n2", 16 << 20).await;
    let log = fixture.log(&sc());
    // Two snapshots mean the first one's purge has run (one snapshot at a time).
    let mut i = 0;
    while markers(&log).await < 2 {
        slow().await.unwrap();
        put(&client, &format!("k{i}")).await.unwrap();
        i += 1;
    }
    slow().await.unwrap();
    assert_eq!(
        first_seq(&fixture).await,
        4,
        "purged up to the slow reader, no further"
    );

    // A global master's checkpoints record where it can restart from.
    let mut global_config = fixture.config("g1");
    global_config.checkpoint_interval_ms = 50;
    let global = fixture.start_with(global_config).await;
    let last = log.bounds().await.unwrap().last_seq;
    wait_applied(&global, &sc(), last).await;
    let recorded = poll_until("the global master's recorded position", WAIT, || async {
        let listed = positions.list(&sc()).await.unwrap();
        listed
            .into_iter()
            .find(|p| p.kind == ReaderKind::GlobalMaster && p.reader == "g1")
            .filter(|p| p.position.seq >= last)
    })
    .await;
    assert!(recorded.position.seq <= log.bounds().await.unwrap().last_seq);

    // The slow reader stops recording: three seconds on, it holds nothing back.
    let fixture = &fixture;
    poll_until("a purge past the stale reader", WAIT, || {
        i += 1;
        let (client, key) = (&client, format!("k{i}"));
        async move {
            put(client, &key).await.unwrap();
            let first = first_seq(fixture).await;
            (first > 4).then_some(first)
        }
    })
    .await;
    // The global master, following live, was never left behind the purge.
    assert_eq!(global.status().sources[0].resyncs, 0);
}

#[tokio::test]
async fn a_new_global_master_seeds_from_the_snapshot_instead_of_replaying_from_the_start() {
    let fixture = Fixture::new("t").await;
    let mut cfg = config(&fixture, "sm-a");
    cfg.snapshot_every_events = 20;
    // Nothing is purged: the whole history could be replayed.
    cfg.history.purge = false;
    let master = fixture.spawn_submaster(cfg).await;
    let client = client(&fixture).await;
    mount(&client, "n1", 16 << 20).await;
    mount(&client, "n2", 16 << 20).await;
    for i in 0..60 {
        put(&client, &format!("k{i}")).await.unwrap();
    }
    let log = fixture.log(&sc());
    poll_until("a snapshot", WAIT, || async {
        (markers(&log).await >= 1).then_some(())
    })
    .await;
    master.shutdown().await.unwrap();
    assert_eq!(first_seq(&fixture).await, 1);

    let last = log.bounds().await.unwrap().last_seq;
    let global = fixture.start("g1").await;
    wait_applied(&global, &sc(), last).await;
    let (events, seeded) = global.with_projection(|p| {
        let source = p.source(0).unwrap();
        (source.events_applied, source.snapshot.clone())
    });
    assert!(seeded.is_some(), "seeded from a snapshot");
    assert!(events < 60, "only the tail was folded: {events} events");
    let reply: BatchIsExistReply = fixture
        .global()
        .call(
            GlobalOp::BatchIsExist,
            &BatchIsExist {
                keys: vec!["k0".into(), "k59".into()],
                labels: None,
            },
        )
        .await
        .unwrap();
    assert_eq!(reply.holders_of(0).len() + reply.holders_of(1).len(), 2);
}

/// A loopback address with a port nothing listened on a moment ago, for a
/// sub-master's metrics endpoint.
fn unused_local_addr() -> std::net::SocketAddr {
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    probe.local_addr().unwrap()
}

/// The body of `GET /metrics` at `addr`, or `None` while nothing serves it.
async fn scrape(addr: std::net::SocketAddr) -> Option<String> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut socket = tokio::net::TcpStream::connect(addr).await.ok()?;
    socket
        .write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .ok()?;
    let mut body = String::new();
    socket.read_to_string(&mut body).await.ok()?;
    Some(body)
}

#[tokio::test]
async fn with_a_hot_standby_the_standby_writes_the_snapshots_not_the_leader() {
    let fixture = Fixture::new("t").await;
    let metrics = unused_local_addr();
    let mut leader_config = config(&fixture, "sm-a");
    leader_config.snapshot_every_events = 20;
    leader_config.metrics_addr = Some(metrics);
    let leader = fixture.spawn_submaster(leader_config).await;
    let client = client(&fixture).await;
    mount(&client, "n1", 16 << 20).await;
    mount(&client, "n2", 16 << 20).await;
    let mut standby_config = config(&fixture, "sm-b");
    standby_config.snapshot_every_events = 20;
    let _standby = fixture.spawn_submaster(standby_config).await;
    poll_until(
        "the leader leaving snapshots to the standby",
        WAIT,
        || async {
            let body = scrape(metrics).await?;
            body.lines()
                .any(|line| line == "hkvm_submaster_standby_snapshots 1")
                .then_some(())
        },
    )
    .await;

    let log = fixture.log(&sc());
    let from = log.bounds().await.unwrap().last_seq;
    for i in 0..100 {
        put(&client, &format!("k{i}")).await.unwrap();
    }
    let store = hkvm_log::SnapshotStore::open(&fixture.js, &fixture.cluster, &sc(), 1)
        .await
        .unwrap();
    poll_every(
        LISTING_POLL,
        "a standby snapshot of the new writes, and a purge",
        WAIT,
        || async {
            let covers = store.newest_covered_seq().await.unwrap()?;
            (covers > from + 50 && first_seq(&fixture).await > from).then_some(())
        },
    )
    .await;
    // Only the leader appends markers: none came with these snapshots.
    assert_eq!(markers(&log).await, 0);

    // Alone, the new leader writes its snapshots itself.
    leader.abort();
    for i in 100..160 {
        put(&client, &format!("k{i}")).await.unwrap();
    }
    poll_until("a snapshot by the leader left alone", WAIT, || async {
        (markers(&log).await > 0).then_some(())
    })
    .await;
}

/// The value of the counter `name` in a metrics body, 0 when absent.
fn counter(body: &str, name: &str) -> u64 {
    body.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn a_leader_alone_rebuilds_its_snapshots_from_durable_history_and_copies_nothing() {
    let fixture = Fixture::new("t").await;
    let metrics = unused_local_addr();
    let mut cfg = config(&fixture, "sm-a");
    cfg.snapshot_every_events = 20;
    cfg.metrics_addr = Some(metrics);
    // The full replay below needs the whole history.
    cfg.history.purge = false;
    let leader = fixture.spawn_submaster(cfg.clone()).await;
    let client = client(&fixture).await;
    mount(&client, "n1", 16 << 20).await;
    mount(&client, "n2", 16 << 20).await;
    for i in 0..150 {
        put(&client, &format!("k{i}")).await.unwrap();
        if i % 9 == 0 {
            client.remove(vec![format!("k{i}")], true).await.unwrap();
        }
    }
    // Two at least: the second is rebuilt from the first plus the stream.
    let log = fixture.log(&sc());
    poll_until(
        "two rebuilt snapshots, with their markers",
        WAIT,
        || async {
            let body = scrape(metrics).await?;
            let rebuilt = counter(&body, "hkvm_submaster_snapshots_rebuilt_total");
            (rebuilt >= 2 && markers(&log).await >= 2).then_some(())
        },
    )
    .await;
    leader.shutdown().await.unwrap();

    let from_snapshot = hkvm_submaster::server::load_state(&fixture.js, &cfg, true)
        .await
        .unwrap();
    let full_replay = hkvm_submaster::server::load_state(&fixture.js, &cfg, false)
        .await
        .unwrap();
    assert!(
        from_snapshot.snapshot_seq > 0,
        "a rebuilt snapshot was used"
    );
    assert!(from_snapshot.state.same_durable_state(&full_replay.state));
    assert_eq!(full_replay.state.object_count(), 150 - 17);
}

#[tokio::test]
async fn a_leader_alone_whose_snapshots_are_lost_copies_its_state_once_and_snapshots_go_on() {
    let fixture = Fixture::new("t").await;
    let mut cfg = config(&fixture, "sm-a");
    cfg.snapshot_every_events = 20;
    cfg.snapshot_interval = Duration::from_millis(200);
    let _leader = fixture.spawn_submaster(cfg).await;
    let client = client(&fixture).await;
    mount(&client, "n1", 16 << 20).await;
    mount(&client, "n2", 16 << 20).await;
    for i in 0..60 {
        put(&client, &format!("k{i}")).await.unwrap();
    }
    let store = hkvm_log::SnapshotStore::open(&fixture.js, &fixture.cluster, &sc(), 1)
        .await
        .unwrap();
    // Quiet: a snapshot of everything put, its history purged, none in flight.
    let written = fixture.log(&sc()).bounds().await.unwrap().last_seq;
    poll_every(
        LISTING_POLL,
        "a snapshot of every put, its history purged",
        WAIT,
        || async {
            let covers = store.newest_covered_seq().await.unwrap()?;
            (covers >= written && first_seq(&fixture).await > 1).then_some(())
        },
    )
    .await;
    // Every snapshot lost: the purged history can no longer rebuild one.
    let objects = fixture
        .js
        .get_object_store(hkvm_events::subject::Bucket::Snapshots.name(&fixture.cluster))
        .await
        .unwrap();
    for name in store.names().await.unwrap() {
        objects.delete(&name).await.unwrap();
    }
    let lost_at = fixture.log(&sc()).bounds().await.unwrap().last_seq;
    for i in 60..160 {
        put(&client, &format!("k{i}")).await.unwrap();
    }
    // The rebuild fails, the next snapshot is copied from the leader's state.
    poll_every(
        LISTING_POLL,
        "a new snapshot past the loss",
        WAIT,
        || async {
            let covers = store.newest_covered_seq().await.unwrap()?;
            (covers > lost_at).then_some(())
        },
    )
    .await;
    let (name, file) = store.load_newest().await.unwrap().unwrap();
    assert!(file.covers_seq > lost_at, "{name}");
    assert!(file.objects.len() >= 60, "{} objects", file.objects.len());
}
