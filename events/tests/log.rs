//! The event log contract, run against both implementations (the in-memory twin and
//! JetStream on a real nats-server), plus group commit and JetStream-only behaviour.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use bytes::Bytes;
use futures::StreamExt as _;
use hkvm_events::commit::{CommitConfig, CommitError, GroupCommitter};
use hkvm_events::log::{
    Append, EventLog, JetStreamLog, LogEntry, LogErrorKind, MemoryLog, ReadOptions,
};
use hkvm_events::stream::{ensure_stream, StreamSettings};
use hkvm_events::subject::{event_subject, stream_name};
use hkvm_events::{
    decode_message, ClusterId, KvEvent, Limits, Placement, ProducerId, PutCommitted, SegmentId,
    SubclusterId,
};
use hkvm_testkit::NatsServer;

fn append(expected: Option<u64>, id: &str, payload: &'static str) -> Append {
    Append {
        expected_last_seq: expected,
        msg_id: id.to_owned(),
        payload: Bytes::from_static(payload.as_bytes()),
    }
}

async fn read_all<L: EventLog>(log: &L, options: ReadOptions) -> Vec<LogEntry> {
    let stream = log.read(options).await.unwrap();
    tokio::time::timeout(
        Duration::from_secs(10),
        stream.map(Result::unwrap).collect(),
    )
    .await
    .expect("a bounded read ends by itself")
}

// ---- the contract ----------------------------------------------------------------

async fn appends_are_fenced_and_deduplicated<L: EventLog>(log: L) {
    assert_eq!(log.bounds().await.unwrap().last_seq, 0);
    let first = log.append(append(Some(0), "m-1", "one")).await.unwrap();
    assert_eq!((first.seq, first.duplicate), (1, false));
    let second = log.append(append(Some(1), "m-2", "two")).await.unwrap();
    assert_eq!(second.seq, 2);

    // A writer that believes the log ends at 1 has been overtaken: fenced.
    let fenced = log
        .append(append(Some(1), "m-3", "stale"))
        .await
        .unwrap_err();
    assert_eq!(fenced.kind(), &LogErrorKind::Fenced { expected: 1 });

    // A retried append (same message id) is stored once and reports the first copy.
    let retried = log.append(append(Some(1), "m-2", "two")).await.unwrap();
    assert_eq!((retried.seq, retried.duplicate), (2, true));

    let entries = read_all(&log, ReadOptions::from(1)).await;
    let payloads: Vec<&[u8]> = entries.iter().map(|e| &e.payload[..]).collect();
    assert_eq!(payloads, vec![&b"one"[..], b"two"]);
    assert_eq!(log.bounds().await.unwrap().last_seq, 2);
}

async fn reads_start_anywhere_and_stop_where_asked<L: EventLog>(log: L) {
    for i in 0..10u64 {
        log.append(append(Some(i), &format!("r-{i}"), "x"))
            .await
            .unwrap();
    }
    let tail = read_all(&log, ReadOptions::from(7)).await;
    assert_eq!(
        tail.iter().map(|e| e.seq).collect::<Vec<_>>(),
        vec![7, 8, 9, 10]
    );
    let middle = read_all(
        &log,
        ReadOptions {
            from_seq: 3,
            until_seq: Some(5),
            batch_messages: 2,
            ..ReadOptions::default()
        },
    )
    .await;
    assert_eq!(
        middle.iter().map(|e| e.seq).collect::<Vec<_>>(),
        vec![3, 4, 5]
    );
    assert!(read_all(&log, ReadOptions::from(11)).await.is_empty());
    assert!(tail.iter().all(|e| e.unix_ms > 1_600_000_000_000));
}

async fn a_follower_sees_later_appends<L: EventLog + Clone>(log: L) {
    log.append(append(Some(0), "f-0", "before")).await.unwrap();
    let mut follow = log
        .read(ReadOptions {
            follow: true,
            ..ReadOptions::from(1)
        })
        .await
        .unwrap();
    assert_eq!(follow.next().await.unwrap().unwrap().seq, 1);
    let writer = log.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        writer
            .append(append(Some(1), "f-1", "after"))
            .await
            .unwrap();
    });
    let next = tokio::time::timeout(Duration::from_secs(10), follow.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!((next.seq, &next.payload[..]), (2, &b"after"[..]));
}

#[tokio::test]
async fn memory_log_keeps_the_contract() {
    appends_are_fenced_and_deduplicated(MemoryLog::new("a")).await;
    reads_start_anywhere_and_stop_where_asked(MemoryLog::new("b")).await;
    a_follower_sees_later_appends(MemoryLog::new("c")).await;
}

async fn jetstream_log(
    server: &NatsServer,
    subcluster: &str,
) -> (JetStreamLog, jetstream::Context) {
    let js = jetstream::new(server.connect().await.unwrap());
    let cluster = ClusterId::new("test").unwrap();
    let sc = SubclusterId::new(subcluster).unwrap();
    ensure_stream(&js, &cluster, &sc, &StreamSettings::default())
        .await
        .unwrap();
    let log = JetStreamLog::new(
        js.clone(),
        stream_name(&cluster, &sc),
        event_subject(&cluster, &sc),
    );
    (log, js)
}

#[tokio::test]
async fn jetstream_log_keeps_the_contract() {
    let server = NatsServer::start().await.unwrap();
    appends_are_fenced_and_deduplicated(jetstream_log(&server, "a").await.0).await;
    reads_start_anywhere_and_stop_where_asked(jetstream_log(&server, "b").await.0).await;
    a_follower_sees_later_appends(jetstream_log(&server, "c").await.0).await;
}

// ---- truncation, gaps, vanished streams ------------------------------------------

#[tokio::test]
async fn a_purged_start_is_reported_as_truncated() {
    let memory = MemoryLog::new("m");
    for i in 0..5u64 {
        memory
            .append(append(Some(i), &format!("t-{i}"), "x"))
            .await
            .unwrap();
    }
    memory.purge_through(3);
    let err = memory.read(ReadOptions::from(2)).await.err().unwrap();
    assert_eq!(
        err.kind(),
        &LogErrorKind::Truncated {
            requested: 2,
            first_seq: 4
        }
    );
    assert_eq!(read_all(&memory, ReadOptions::from(4)).await.len(), 2);

    let server = NatsServer::start().await.unwrap();
    let (log, js) = jetstream_log(&server, "purged").await;
    for i in 0..5u64 {
        log.append(append(Some(i), &format!("t-{i}"), "x"))
            .await
            .unwrap();
    }
    let stream = js.get_stream(log.stream_name()).await.unwrap();
    stream.purge().sequence(4).await.unwrap();
    let err = log.read(ReadOptions::from(2)).await.err().unwrap();
    assert_eq!(
        err.kind(),
        &LogErrorKind::Truncated {
            requested: 2,
            first_seq: 4
        }
    );
    // Appends continue after the purge, fenced on the true last sequence.
    log.append(append(Some(5), "t-5", "x")).await.unwrap();
    assert_eq!(read_all(&log, ReadOptions::from(4)).await.len(), 3);
}

#[tokio::test]
async fn a_vanished_stream_is_a_typed_error() {
    let server = NatsServer::start().await.unwrap();
    let (log, js) = jetstream_log(&server, "gone").await;
    log.append(append(Some(0), "g-0", "x")).await.unwrap();
    js.delete_stream(log.stream_name()).await.unwrap();
    assert_eq!(
        log.bounds().await.unwrap_err().kind(),
        &LogErrorKind::StreamNotFound
    );
    assert_eq!(
        log.read(ReadOptions::from(1)).await.err().unwrap().kind(),
        &LogErrorKind::StreamNotFound
    );
    let err = log.append(append(Some(1), "g-1", "x")).await.unwrap_err();
    assert_eq!(err.kind(), &LogErrorKind::StreamNotFound);
}

#[tokio::test]
async fn ensure_stream_is_idempotent_and_applies_new_settings() {
    let server = NatsServer::start().await.unwrap();
    let js = jetstream::new(server.connect().await.unwrap());
    let cluster = ClusterId::new("test").unwrap();
    let sc = SubclusterId::new("sc-0").unwrap();
    let settings = StreamSettings::default();
    ensure_stream(&js, &cluster, &sc, &settings).await.unwrap();
    let mut again = ensure_stream(&js, &cluster, &sc, &settings).await.unwrap();
    let config = again.info().await.unwrap().config.clone();
    assert_eq!(config.discard, jetstream::stream::DiscardPolicy::New);
    assert!(config.deny_delete);
    assert_eq!(config.storage, jetstream::stream::StorageType::File);

    let bigger = StreamSettings {
        max_bytes: 1 << 30,
        ..settings
    };
    let mut updated = ensure_stream(&js, &cluster, &sc, &bigger).await.unwrap();
    assert_eq!(updated.info().await.unwrap().config.max_bytes, 1 << 30);
}

#[tokio::test]
async fn a_full_stream_refuses_appends_instead_of_dropping_history() {
    let server = NatsServer::start().await.unwrap();
    let js = jetstream::new(server.connect().await.unwrap());
    let cluster = ClusterId::new("test").unwrap();
    let sc = SubclusterId::new("full").unwrap();
    let settings = StreamSettings {
        max_messages: 3,
        ..StreamSettings::default()
    };
    ensure_stream(&js, &cluster, &sc, &settings).await.unwrap();
    let log = JetStreamLog::new(js, stream_name(&cluster, &sc), event_subject(&cluster, &sc));
    for i in 0..3u64 {
        log.append(append(Some(i), &format!("x-{i}"), "x"))
            .await
            .unwrap();
    }
    assert!(log.append(append(Some(3), "x-3", "x")).await.is_err());
    let bounds = log.bounds().await.unwrap();
    assert_eq!(
        (bounds.first_seq, bounds.last_seq),
        (1, 3),
        "nothing was dropped"
    );
}

// ---- group commit ------------------------------------------------------------------

fn put(key: &str) -> KvEvent {
    KvEvent::PutCommitted(PutCommitted::new(
        key,
        100,
        7,
        vec![Placement {
            segment: SegmentId::new("seg").unwrap(),
            offset: 0,
        }],
    ))
}

async fn many_callers_share_messages<L: EventLog + Clone>(log: L) {
    let committer = GroupCommitter::spawn(
        log.clone(),
        ProducerId::new("sm-test").unwrap(),
        1,
        0,
        CommitConfig::default(),
    );
    let callers: Vec<_> = (0..200)
        .map(|i| {
            let committer = committer.clone();
            tokio::spawn(async move { committer.commit(vec![put(&format!("k-{i}"))]).await })
        })
        .collect();
    let mut committed = Vec::new();
    for caller in callers {
        committed.push(caller.await.unwrap().unwrap());
    }
    let messages = read_all(&log, ReadOptions::from(1)).await;
    assert!(
        messages.len() < 200,
        "200 concurrent callers should share messages, got {}",
        messages.len()
    );
    // Every caller's event is exactly where its receipt says.
    let mut found = 0;
    for entry in &messages {
        let decoded = decode_message(&entry.payload, &Limits::default()).unwrap();
        assert_eq!(decoded.header.producer.as_str(), "sm-test");
        let events: Vec<KvEvent> = decoded.events.map(Result::unwrap).collect();
        for receipt in committed.iter().filter(|c| c.seq == entry.seq) {
            assert_eq!(receipt.count, 1);
            assert!(matches!(
                events[receipt.first_index],
                KvEvent::PutCommitted(_)
            ));
            found += 1;
        }
    }
    assert_eq!(found, 200);
    assert_eq!(committer.durable_seq(), messages.len() as u64);
}

#[tokio::test]
async fn group_commit_packs_concurrent_callers_into_few_messages() {
    many_callers_share_messages(MemoryLog::new("gc")).await;
    let server = NatsServer::start().await.unwrap();
    many_callers_share_messages(jetstream_log(&server, "gc").await.0).await;
}

#[tokio::test]
async fn a_fenced_committer_fails_and_stays_stopped() {
    let log = MemoryLog::new("fence");
    // Another writer got there first.
    log.append(append(Some(0), "other", "x")).await.unwrap();
    let committer = GroupCommitter::spawn(
        log.clone(),
        ProducerId::new("deposed").unwrap(),
        1,
        0,
        CommitConfig::default(),
    );
    let err = committer.commit(vec![put("a")]).await.unwrap_err();
    assert!(
        matches!(&err, CommitError::Log(e) if matches!(e.kind(), LogErrorKind::Fenced { expected: 0 })),
        "{err}"
    );
    let later = committer.commit(vec![put("b")]).await.unwrap_err();
    assert!(matches!(later, CommitError::Stopped(_)), "{later}");
    assert_eq!(
        log.bounds().await.unwrap().last_seq,
        1,
        "nothing was appended"
    );
}

#[tokio::test]
async fn invalid_or_oversized_submissions_are_rejected_alone() {
    let log = MemoryLog::new("bad");
    let committer = GroupCommitter::spawn(
        log.clone(),
        ProducerId::new("sm").unwrap(),
        1,
        0,
        CommitConfig {
            limits: Limits {
                max_message_bytes: 4096,
                max_key_len: 64,
                ..Limits::default()
            },
            ..CommitConfig::default()
        },
    );
    let too_long = committer
        .commit(vec![put(&"k".repeat(65))])
        .await
        .unwrap_err();
    assert!(matches!(too_long, CommitError::Rejected(_)), "{too_long}");
    let many: Vec<KvEvent> = (0..100).map(|i| put(&format!("key-{i:040}"))).collect();
    let too_big = committer.commit(many).await.unwrap_err();
    assert!(
        too_big.to_string().contains("larger than the limit"),
        "{too_big}"
    );
    // The committer is still healthy.
    let ok = committer.commit(vec![put("fine")]).await.unwrap();
    assert_eq!(ok.seq, 1);
}

#[tokio::test]
async fn two_committers_on_one_stream_cannot_both_write() {
    let server = NatsServer::start().await.unwrap();
    let (log, _) = jetstream_log(&server, "split").await;
    let leader = GroupCommitter::spawn(
        log.clone(),
        ProducerId::new("leader").unwrap(),
        1,
        0,
        CommitConfig::default(),
    );
    leader.commit(vec![put("a")]).await.unwrap();
    // A second writer that started from the same point (a split brain) is fenced.
    let rival = GroupCommitter::spawn(
        log.clone(),
        ProducerId::new("rival").unwrap(),
        2,
        0,
        CommitConfig::default(),
    );
    assert!(rival.commit(vec![put("b")]).await.is_err());
    let results = Arc::new(leader.commit(vec![put("c")]).await.unwrap());
    assert_eq!(results.seq, 2);
    assert_eq!(read_all(&log, ReadOptions::from(1)).await.len(), 2);
}
