//! The one stream follower (`hkvm_log::follow`) against a real JetStream, with a
//! model fold target that records every call: batching, re-created streams,
//! undecodable messages (one re-read, then skipped; resyncs bounded), purges and
//! seeding from a snapshot, a purge past the position. The global master and the
//! inter-DC master fold through this follower, so these behaviours hold for both.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream;
use bytes::Bytes;
use hkvm_events::codec::{Decoded, Header};
use hkvm_events::snapshot::{ObjectRecord, SnapshotFile};
use hkvm_events::{
    encode_message, ClusterId, KvEvent, Limits, ProducerId, PutCommitted, SubclusterId,
};
use hkvm_log::follow::{FoldTarget, FollowConfig, Follower, OutOfOrder, ResyncReason, Seed};
use hkvm_log::SnapshotStore;
use hkvm_log::{Append, EventLog as _, JetStreamLog};

use crate::fixture::Fixture;

/// What the model target saw.
#[derive(Debug, Default)]
struct Seen {
    applied_seq: u64,
    epoch: u64,
    keys: BTreeSet<String>,
    resets: Vec<ResyncReason>,
    seeded_from: Option<u64>,
    /// Messages skipped since the last reset.
    skipped: Vec<u64>,
    apply_calls: usize,
    largest_apply: usize,
    caught_up: bool,
}

/// A fold target over a set of keys, shared with the test.
#[derive(Debug, Clone, Default)]
struct Model(Arc<Mutex<Seen>>);

impl Model {
    fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.0.lock().unwrap()
    }
}

impl FoldTarget for Model {
    type Message = Decoded;

    fn applied_seq(&self) -> u64 {
        self.seen().applied_seq
    }

    fn stream_epoch(&self) -> u64 {
        self.seen().epoch
    }

    fn set_stream_epoch(&mut self, epoch: u64) {
        self.seen().epoch = epoch;
    }

    fn reset(&mut self, reason: ResyncReason) {
        let mut seen = self.seen();
        seen.applied_seq = 0;
        seen.epoch = 0;
        seen.keys.clear();
        seen.skipped.clear();
        seen.resets.push(reason);
    }

    fn seed(&mut self, seed: Seed<'_>) {
        let mut seen = self.seen();
        seen.keys = seed
            .snapshot
            .objects
            .iter()
            .map(|o| o.key.to_string())
            .collect();
        seen.applied_seq = seed.snapshot.covers_seq;
        seen.seeded_from = Some(seed.snapshot.covers_seq);
    }

    fn apply(&mut self, messages: Vec<Decoded>) -> Result<(), OutOfOrder> {
        let mut seen = self.seen();
        seen.apply_calls += 1;
        seen.largest_apply = seen.largest_apply.max(messages.len());
        for message in messages {
            if message.seq <= seen.applied_seq {
                continue;
            }
            if seen.applied_seq != 0 && message.seq != seen.applied_seq + 1 {
                return Err(OutOfOrder {
                    expected: seen.applied_seq + 1,
                    found: message.seq,
                });
            }
            for event in message.events {
                if let KvEvent::PutCommitted(put) = event {
                    seen.keys.insert(put.key);
                }
            }
            seen.applied_seq = message.seq;
        }
        Ok(())
    }

    fn skip(&mut self, seq: u64, _unix_ms: u64) {
        let mut seen = self.seen();
        seen.skipped.push(seq);
        seen.applied_seq = seq;
    }

    fn caught_up(&mut self) {
        self.seen().caught_up = true;
    }
}

/// One stream of a test cluster and a way to append to it.
struct Stream {
    js: jetstream::Context,
    cluster: ClusterId,
    subcluster: SubclusterId,
    log: JetStreamLog,
    counter: u64,
}

impl Stream {
    async fn create(fixture: &Fixture, subcluster: &str) -> Self {
        let log = fixture.stream(subcluster).await;
        Self {
            js: fixture.js.clone(),
            cluster: fixture.cluster.clone(),
            subcluster: SubclusterId::new(subcluster).unwrap(),
            log,
            counter: 0,
        }
    }

    async fn append_payload(&mut self, payload: Vec<u8>) -> u64 {
        self.counter += 1;
        let append = Append {
            expected_last_seq: None,
            msg_id: format!("{}-{}", self.subcluster, self.counter),
            payload: Bytes::from(payload),
        };
        self.log.append(append).await.unwrap().seq
    }

    async fn put(&mut self, key: &str) -> u64 {
        let header = Header {
            producer: ProducerId::new("test").unwrap(),
            epoch: 1,
            unix_ms: 1,
        };
        let event = KvEvent::PutCommitted(PutCommitted::new(key, 1, 1, vec![placement()]));
        let payload = encode_message(&header, &[event], &Limits::default()).unwrap();
        self.append_payload(payload).await
    }

    fn follower(&self, model: &Model, config: FollowConfig) -> tokio::task::JoinHandle<()> {
        let follower = Follower::new(
            self.js.clone(),
            self.cluster.clone(),
            self.subcluster.clone(),
            model.clone(),
            config,
        );
        tokio::spawn(follower.run())
    }
}

fn placement() -> hkvm_events::Placement {
    hkvm_events::Placement {
        segment: hkvm_events::SegmentId::new("seg").unwrap(),
        offset: 0,
    }
}

fn quick() -> FollowConfig {
    FollowConfig {
        idle_check: Duration::from_millis(100),
        retry: Duration::from_millis(50),
        ..FollowConfig::default()
    }
}

/// Waits until `done` holds for what the model saw (the follower runs on its own
/// task); fails with what it saw after 20 s.
async fn until(model: &Model, what: &str, done: impl Fn(&Seen) -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if done(&model.seen()) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: {:?}",
            model.seen()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn keys(range: std::ops::Range<u32>, prefix: &str) -> BTreeSet<String> {
    range.map(|i| format!("{prefix}{i}")).collect()
}

#[tokio::test]
async fn folds_everything_in_chunks_of_the_configured_size() {
    let fixture = Fixture::new("follow").await;
    let mut stream = Stream::create(&fixture, "batches").await;
    for i in 0..40 {
        stream.put(&format!("k{i}")).await;
    }
    let model = Model::default();
    let config = FollowConfig {
        chunk_messages: 5,
        ..quick()
    };
    let task = stream.follower(&model, config);
    until(&model, "all 40 folded", |s| {
        s.applied_seq == 40 && s.caught_up
    })
    .await;
    // Appends after the follower caught up arrive too.
    stream.put("late").await;
    until(&model, "the late put", |s| s.keys.contains("late")).await;
    task.abort();
    let seen = model.seen();
    let mut expected = keys(0..40, "k");
    expected.insert("late".into());
    assert_eq!(seen.keys, expected);
    assert!(seen.largest_apply <= 5, "chunks of at most 5: {seen:?}");
    assert!(seen.resets.is_empty(), "no resync: {:?}", seen.resets);
}

#[tokio::test]
async fn a_deleted_and_recreated_stream_is_read_again_even_when_it_is_longer() {
    let fixture = Fixture::new("follow").await;
    let mut stream = Stream::create(&fixture, "recreated").await;
    for i in 0..3 {
        stream.put(&format!("old{i}")).await;
    }
    let model = Model::default();
    let task = stream.follower(&model, quick());
    until(&model, "the old stream folded", |s| s.applied_seq == 3).await;
    task.abort();
    // While no one reads, the stream is deleted and re-created, then grows past
    // the old position: only its identity tells it is another stream.
    stream
        .js
        .delete_stream(stream.log.stream_name())
        .await
        .unwrap();
    let mut stream = Stream::create(&fixture, "recreated").await;
    for i in 0..5 {
        stream.put(&format!("new{i}")).await;
    }
    let task = stream.follower(&model, quick());
    until(&model, "the new stream folded", |s| {
        s.applied_seq == 5 && s.keys == keys(0..5, "new")
    })
    .await;
    task.abort();
    assert_eq!(model.seen().resets, [ResyncReason::StreamReset]);
}

#[tokio::test]
async fn an_undecodable_message_is_reread_once_then_skipped() {
    let fixture = Fixture::new("follow").await;
    let mut stream = Stream::create(&fixture, "corrupt").await;
    stream.put("a").await;
    let bad = stream.append_payload(b"\x93garbage".to_vec()).await;
    stream.put("b").await;
    let model = Model::default();
    let task = stream.follower(&model, quick());
    until(&model, "past the bad message", |s| s.applied_seq == 3).await;
    task.abort();
    let seen = model.seen();
    assert_eq!(seen.resets, [ResyncReason::Undecodable]);
    assert_eq!(seen.skipped, [bad]);
    assert_eq!(seen.keys, ["a".to_owned(), "b".to_owned()].into());
}

#[tokio::test]
async fn resyncs_for_undecodable_messages_are_bounded() {
    let fixture = Fixture::new("follow").await;
    let mut stream = Stream::create(&fixture, "many-corrupt").await;
    let mut bad = Vec::new();
    for i in 0..4 {
        stream.put(&format!("k{i}")).await;
        bad.push(stream.append_payload(vec![0xc1; 3]).await);
    }
    let model = Model::default();
    let config = FollowConfig {
        max_corrupt_resyncs: 2,
        ..quick()
    };
    let task = stream.follower(&model, config);
    until(&model, "past every bad message", |s| s.applied_seq == 8).await;
    task.abort();
    let seen = model.seen();
    assert_eq!(
        seen.resets,
        [ResyncReason::Undecodable, ResyncReason::Undecodable],
        "two re-reads, then skipping without one"
    );
    assert_eq!(seen.skipped, bad);
    assert_eq!(seen.keys, keys(0..4, "k"));
}

async fn snapshot_covering(stream: &Stream, covers_seq: u64, keys: &[&str]) {
    let store = SnapshotStore::open(&stream.js, &stream.cluster, &stream.subcluster, 1)
        .await
        .unwrap();
    let mut file = SnapshotFile::new(covers_seq, 1);
    file.objects = keys
        .iter()
        .map(|key| ObjectRecord {
            key: (*key).into(),
            size: 1,
            checksum: 1,
            replicas: Vec::new(),
            flags: 0,
            put_id: 0,
        })
        .collect();
    store.save(&file).await.unwrap();
}

async fn purge_before(stream: &Stream, seq: u64) {
    stream
        .js
        .get_stream(stream.log.stream_name())
        .await
        .unwrap()
        .purge()
        .sequence(seq)
        .await
        .unwrap();
}

#[tokio::test]
async fn a_purged_history_is_seeded_from_the_snapshot_then_the_tail_folded() {
    let fixture = Fixture::new("follow").await;
    let mut stream = Stream::create(&fixture, "purged").await;
    for i in 0..6 {
        stream.put(&format!("k{i}")).await;
    }
    // The snapshot says what the first four messages built; they are purged.
    snapshot_covering(&stream, 4, &["k0", "k1", "k2", "k3"]).await;
    purge_before(&stream, 5).await;
    let model = Model::default();
    let task = stream.follower(&model, quick());
    until(&model, "seeded and the tail folded", |s| s.applied_seq == 6).await;
    task.abort();
    let seen = model.seen();
    assert_eq!(seen.seeded_from, Some(4));
    assert_eq!(seen.keys, keys(0..6, "k"));
    assert!(seen.resets.is_empty(), "{:?}", seen.resets);
}

#[tokio::test]
async fn a_reader_behind_the_purge_point_resyncs_and_seeds() {
    let fixture = Fixture::new("follow").await;
    let mut stream = Stream::create(&fixture, "behind").await;
    stream.put("k0").await;
    stream.put("k1").await;
    let model = Model::default();
    let task = stream.follower(&model, quick());
    until(&model, "caught up", |s| s.applied_seq == 2).await;
    task.abort();
    for i in 2..6 {
        stream.put(&format!("k{i}")).await;
    }
    snapshot_covering(&stream, 5, &["k0", "k1", "k2", "k3", "k4"]).await;
    purge_before(&stream, 6).await;
    let task = stream.follower(&model, quick());
    until(&model, "seeded past the purge", |s| s.applied_seq == 6).await;
    task.abort();
    let seen = model.seen();
    assert_eq!(seen.resets, [ResyncReason::PurgedPastPosition]);
    assert_eq!(seen.seeded_from, Some(5));
    assert_eq!(seen.keys, keys(0..6, "k"));
}
