//! The event log over JetStream on a real nats-server: the contract every log
//! keeps (shared with the in-memory twin's tests in `hkvm-events`), truncation,
//! vanished and full streams, stream settings, and group commit.

#[path = "../../../log/tests/support/log_contract.rs"]
mod log_contract;

use std::sync::Arc;

use futures::StreamExt as _;

use async_nats::jetstream;
use hkvm_events::{ProducerId, SubclusterId};
use hkvm_log::commit::{CommitConfig, GroupCommitter};
use hkvm_log::stream::{ensure_stream, StreamSettings};
use hkvm_log::{Append, EventLog, JetStreamLog, LogErrorKind, ReadOptions};
use hkvm_testkit::ServerOptions;

use log_contract::{
    a_follower_sees_later_appends, append, appends_are_fenced_and_deduplicated,
    many_callers_share_messages, put, read_all, reads_start_anywhere_and_stop_where_asked,
};

use crate::fixture::Fixture;

/// A nats-server for cluster `test`.
async fn server() -> Fixture {
    Fixture::new("test").await
}

#[tokio::test]
async fn jetstream_log_keeps_the_contract() {
    let fixture = server().await;
    appends_are_fenced_and_deduplicated(fixture.stream("a").await).await;
    reads_start_anywhere_and_stop_where_asked(fixture.stream("b").await).await;
    a_follower_sees_later_appends(fixture.stream("c").await).await;
}

// ---- truncation, gaps, vanished streams ------------------------------------------

#[tokio::test]
async fn a_purged_start_is_reported_as_truncated() {
    let fixture = server().await;
    let log = fixture.stream("purged").await;
    for i in 0..5u64 {
        log.append(append(Some(i), &format!("t-{i}"), "x"))
            .await
            .unwrap();
    }
    let stream = fixture.js.get_stream(log.stream_name()).await.unwrap();
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
    let fixture = server().await;
    let log = fixture.stream("gone").await;
    log.append(append(Some(0), "g-0", "x")).await.unwrap();
    fixture.js.delete_stream(log.stream_name()).await.unwrap();
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
    let fixture = server().await;
    let (js, cluster) = (&fixture.js, &fixture.cluster);
    let sc = SubclusterId::new("sc-0").unwrap();
    let settings = StreamSettings::default();
    ensure_stream(js, cluster, &sc, &settings).await.unwrap();
    let mut again = ensure_stream(js, cluster, &sc, &settings).await.unwrap();
    let config = again.info().await.unwrap().config.clone();
    assert_eq!(config.discard, jetstream::stream::DiscardPolicy::New);
    assert!(config.deny_delete);
    assert_eq!(config.storage, jetstream::stream::StorageType::File);

    let bigger = StreamSettings {
        max_bytes: 1 << 30,
        ..settings
    };
    let mut updated = ensure_stream(js, cluster, &sc, &bigger).await.unwrap();
    assert_eq!(updated.info().await.unwrap().config.max_bytes, 1 << 30);
}

#[tokio::test]
async fn a_full_stream_refuses_appends_instead_of_dropping_history() {
    let fixture = server().await;
    let settings = StreamSettings {
        max_messages: 3,
        ..StreamSettings::default()
    };
    let log: JetStreamLog = fixture.stream_with("full", &settings).await;
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

// ---- reads whose requests the server ends early ------------------------------------

/// Stream `name` holding `count` messages of `size` bytes (appended pipelined).
async fn filled(fixture: &Fixture, name: &str, count: u64, size: usize) -> JetStreamLog {
    let log = fixture.stream(name).await;
    let body = bytes::Bytes::from(vec![b'x'; size]);
    let mut acks = Vec::new();
    for i in 0..count {
        let message = Append {
            expected_last_seq: Some(i),
            msg_id: format!("f-{i}"),
            payload: body.clone(),
        };
        acks.push(log.send(message).await.unwrap());
    }
    for ack in acks {
        ack.await.unwrap();
    }
    log
}

/// A read from the start asking for `batch_bytes` per pull request.
fn with_batch_bytes(batch_bytes: usize) -> ReadOptions {
    ReadOptions {
        batch_bytes,
        ..ReadOptions::from(1)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_whose_every_request_one_message_fills_never_stall() {
    // With a 64 KiB max_payload a read's requests hold 80 KiB, so each 50 KB
    // message fills one: the server sends it, then ends the request (the next does
    // not fit) and says what was left. A reader that booked a request only after
    // such an answer came would wait on a request the server no longer held.
    // Several busy readers at once make that ordering likely; every read here must
    // simply end, with every entry.
    let fixture = Fixture::with_server(
        "test",
        ServerOptions {
            extra_config: "max_payload: 65536".into(),
            ..ServerOptions::default()
        },
    )
    .await;
    let log = filled(&fixture, "filled", 600, 50_000).await;
    let options = with_batch_bytes(1000);
    let mut readers = tokio::task::JoinSet::new();
    for _ in 0..6 {
        let log = log.clone();
        readers.spawn(async move {
            let mut entries = log.read(options).await.unwrap();
            let mut seqs = Vec::new();
            while let Some(entry) = entries.next().await {
                seqs.push(entry.unwrap().seq);
                // Work on each entry, as a decoding reader does.
                let busy = std::time::Instant::now();
                while busy.elapsed() < std::time::Duration::from_micros(20) {
                    std::hint::spin_loop();
                }
            }
            seqs
        });
    }
    while let Some(seqs) = readers.join_next().await {
        let seqs = seqs.unwrap();
        assert_eq!(seqs.len(), 600);
        assert!(seqs.iter().zip(1..).all(|(seq, expected)| *seq == expected));
    }
}

#[tokio::test]
async fn a_byte_budget_smaller_than_a_message_still_reads_it() {
    // A request whose byte budget no message fits would be refused again and again;
    // the reader raises its budget to what the server's largest message needs.
    let fixture = server().await;
    let log = filled(&fixture, "oversized", 3, 700).await;
    let entries = read_all(&log, with_batch_bytes(100)).await;
    assert_eq!(
        entries.iter().map(|entry| entry.seq).collect::<Vec<_>>(),
        [1, 2, 3]
    );
    assert!(entries.iter().all(|entry| entry.payload.len() == 700));
}

/// A nats-server whose `max_payload` is 4 KiB: a read's requests then hold 20 KiB,
/// so reads of a few thousand messages take many requests.
async fn small_payload_server() -> Fixture {
    Fixture::with_server(
        "test",
        ServerOptions {
            extra_config: "max_payload: 4096".into(),
            ..ServerOptions::default()
        },
    )
    .await
}

/// Counts, on this thread until the guard drops, the warnings of the event log's
/// readers.
fn count_read_warnings() -> (
    Arc<std::sync::atomic::AtomicUsize>,
    tracing::subscriber::DefaultGuard,
) {
    use tracing_subscriber::layer::SubscriberExt as _;
    let warnings = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let guard = tracing::subscriber::set_default(
        tracing_subscriber::registry().with(ReadWarnings(warnings.clone())),
    );
    (warnings, guard)
}

fn assert_no_silent_read(warnings: &std::sync::atomic::AtomicUsize) {
    assert_eq!(
        warnings.load(std::sync::atomic::Ordering::Relaxed),
        0,
        "a read went silent and asked again"
    );
}

/// Counts the warnings the event log's readers log (a read that heard nothing for
/// two heartbeats and asked again logs one).
struct ReadWarnings(Arc<std::sync::atomic::AtomicUsize>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for ReadWarnings {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        let metadata = event.metadata();
        if *metadata.level() == tracing::Level::WARN && metadata.target().starts_with("hkvm_log") {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

#[tokio::test]
async fn a_read_of_messages_of_every_size_never_waits_on_a_request_the_server_dropped() {
    // The reader's books hold exactly the bytes the server still owes only if the
    // server charges a message what the client reads as its length. Were it to
    // charge more, the books would claim budget the server no longer holds, and
    // the read would go silent for two heartbeats and ask again (with a warning);
    // over 8000 messages a charge off by even 2 bytes adds up to more than half a
    // request's budget (4 KiB max_payload: 20 KiB per request).
    let (warnings, _capture) = count_read_warnings();
    let fixture = small_payload_server().await;
    let log = fixture.stream("sizes").await;
    let size = |i: u64| usize::try_from(i * 7919 % 3500 + 1).unwrap();
    // Pipelined a thousand at a time (a JetStream context bounds the acks in flight).
    for first in (0..8000).step_by(1000) {
        let mut acks = Vec::new();
        for i in first..first + 1000 {
            let message = Append {
                expected_last_seq: Some(i),
                msg_id: format!("s-{i}"),
                payload: bytes::Bytes::from(vec![b's'; size(i)]),
            };
            acks.push(log.send(message).await.unwrap());
        }
        for ack in acks {
            ack.await.unwrap();
        }
    }
    let entries = read_all(&log, with_batch_bytes(1)).await;
    assert_eq!(entries.len(), 8000);
    for (i, entry) in (0..).zip(&entries) {
        assert_eq!((entry.seq, entry.payload.len()), (i + 1, size(i)));
    }
    assert_no_silent_read(&warnings);
}

#[tokio::test]
async fn a_lingering_follower_reads_every_append_in_order_through_bursts_and_quiet_spells() {
    // A lingering read drains what is stored, waits for one message, lets more
    // gather, and drains again; only one of its requests is open at a time. Here it
    // catches up through drains its small byte budget ends (4 KiB max_payload:
    // 20 KiB per request), then follows appends made one at a time, in bursts, and
    // after a quiet spell longer than two idle heartbeats: every entry comes, in
    // order, and the read never goes silent.
    let (warnings, _capture) = count_read_warnings();
    let fixture = small_payload_server().await;
    let log = filled(&fixture, "lingering", 500, 1000).await;
    let mut entries = log
        .read(ReadOptions {
            follow: true,
            linger: std::time::Duration::from_millis(5),
            ..with_batch_bytes(1)
        })
        .await
        .unwrap();
    let writer = log.clone();
    let appends = tokio::spawn(async move {
        for i in 500..800u64 {
            match i {
                // A quiet spell: the reader's wake request waits through heartbeats.
                600 => tokio::time::sleep(std::time::Duration::from_millis(2500)).await,
                // Bursts of a hundred, then one at a time with pauses.
                700..=800 => {}
                _ if i % 10 == 0 => tokio::time::sleep(std::time::Duration::from_millis(3)).await,
                _ => {}
            }
            let message = Append {
                expected_last_seq: Some(i),
                msg_id: format!("l-{i}"),
                payload: bytes::Bytes::from(vec![b'l'; usize::try_from(i % 900 + 1).unwrap()]),
            };
            writer.append(message).await.unwrap();
        }
    });
    for expected in 1..=800u64 {
        let entry = tokio::time::timeout(std::time::Duration::from_secs(10), entries.next())
            .await
            .unwrap_or_else(|_| panic!("entry {expected} never came"))
            .unwrap()
            .unwrap();
        assert_eq!(entry.seq, expected);
    }
    appends.await.unwrap();
    assert_no_silent_read(&warnings);
}

// ---- group commit ------------------------------------------------------------------

#[tokio::test]
async fn group_commit_packs_concurrent_callers_into_few_messages() {
    let fixture = server().await;
    many_callers_share_messages(fixture.stream("gc").await).await;
}

#[tokio::test]
async fn two_committers_on_one_stream_cannot_both_write() {
    let fixture = server().await;
    let log = fixture.stream("split").await;
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
