//! Recovery against a real nats-server: checkpoint restore plus tail, streams that
//! were reset, purged or hold a corrupt message, and two replicas serving alike.

use std::collections::BTreeSet;
use std::time::Duration;

use async_nats::jetstream::object_store;
use hkvm_events::key_hash;
use hkvm_events::rpc::global::BloomFilter;
use hkvm_events::rpc::global::GlobalStatusReply;
use hkvm_events::rpc::global::{BatchIsExist, BatchIsExistReply, GlobalOp, GlobalStatus};
use hkvm_events::subject::{event_subject, Bucket};
use hkvm_events::{
    KvEvent, NodeId, Placement, ProducerId, PutCommitted, SegmentId, SegmentMounted,
};
use hkvm_globalmaster::checkpoints;
use hkvm_log::commit::{CommitConfig, GroupCommitter};
use hkvm_log::stream::{ensure_stream, StreamSettings};
use hkvm_log::SnapshotStore;
use hkvm_projector::{Projection, SourceContent};
use tokio::io::AsyncReadExt as _;

use crate::fixture::{keys, poll_every, put, removed, wait_applied, Fixture, LISTING_POLL, WAIT};

fn sorted_content(projection: &Projection) -> Vec<SourceContent> {
    let mut content = projection.content();
    content.sort_by(|a, b| a.0.cmp(&b.0));
    content
}

async fn exists(fixture: &Fixture, names: &[&str]) -> Vec<Vec<String>> {
    let reply: BatchIsExistReply = fixture
        .global()
        .call(
            GlobalOp::BatchIsExist,
            &BatchIsExist {
                keys: keys(names),
                labels: None,
            },
        )
        .await
        .unwrap();
    (0..names.len())
        .map(|i| {
            reply
                .holders_of(i)
                .into_iter()
                .map(ToString::to_string)
                .collect()
        })
        .collect()
}

#[tokio::test]
async fn a_restart_loads_the_checkpoint_and_folds_only_the_tail() {
    let fixture = Fixture::new("t").await;
    let a = fixture.subcluster("sc-a", &[]).await;
    let b = fixture.subcluster("sc-b", &[]).await;
    a.commit(vec![put("a1"), put("both")]).await;
    b.commit(vec![put("both")]).await;
    let first = fixture.start("g1").await;
    assert!(first.restored_from().is_none());
    assert!(first.checkpoint_now().await.unwrap() > 0);
    drop(first);

    let tail = a.commit(vec![removed(&["both"]), put("a2")]).await;
    let mut config = fixture.config("g2");
    config.restore_checkpoint = true;
    let restored = fixture.start_with(config).await;
    assert_eq!(restored.restored_from(), Some("projection-g1"));
    wait_applied(&restored, &a.id, tail).await;

    let mut config = fixture.config("g3");
    config.restore_checkpoint = false;
    let scratch = fixture.start_with(config).await;
    wait_applied(&scratch, &a.id, tail).await;
    assert_eq!(
        restored.with_projection(sorted_content),
        scratch.with_projection(sorted_content)
    );
    assert_eq!(
        exists(&fixture, &["a1", "a2", "both"]).await,
        vec![vec!["sc-a"], vec!["sc-a"], vec!["sc-b"]]
    );
}

#[tokio::test]
async fn a_recreated_stream_is_read_again_from_scratch() {
    let fixture = Fixture::new("t").await;
    let a = fixture.subcluster("sc-a", &[]).await;
    a.commit(vec![put("old-1")]).await;
    a.commit(vec![put("old-2")]).await;
    let master = fixture.start("g1").await;

    fixture.js.delete_stream(a.log.stream_name()).await.unwrap();
    ensure_stream(
        &fixture.js,
        &fixture.cluster,
        &a.id,
        &StreamSettings::default(),
    )
    .await
    .unwrap();
    let committer = GroupCommitter::spawn(
        a.log.clone(),
        ProducerId::new("sm-new").unwrap(),
        2,
        0,
        CommitConfig::default(),
    );
    // As many messages as before, so only the stream's identity tells them apart.
    committer.commit(vec![put("new-1")]).await.unwrap();
    committer.commit(vec![put("new-2")]).await.unwrap();

    tokio::time::timeout(Duration::from_secs(30), async {
        while exists(&fixture, &["old-1", "new-2"]).await != vec![vec![], vec!["sc-a"]] {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the projection forgets the old stream");
    let status = master.status();
    assert!(status.sources[0].resyncs >= 1, "{status:?}");
    assert_eq!(
        exists(&fixture, &["old-2", "new-1"]).await,
        vec![vec![], vec!["sc-a"]]
    );
}

#[tokio::test]
async fn a_corrupt_message_triggers_a_resync_then_is_skipped_and_counted() {
    let fixture = Fixture::new("t").await;
    let a = fixture.subcluster("sc-a", &[]).await;
    a.commit(vec![put("before")]).await;
    fixture
        .js
        .publish(event_subject(&fixture.cluster, &a.id), "not msgpack".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let committer = GroupCommitter::spawn(
        a.log.clone(),
        ProducerId::new("sm-2").unwrap(),
        2,
        2,
        CommitConfig::default(),
    );
    let last = committer.commit(vec![put("after")]).await.unwrap().seq;
    let master = fixture.start("g1").await;
    wait_applied(&master, &a.id, last).await;
    assert_eq!(
        exists(&fixture, &["before", "after"]).await,
        vec![vec!["sc-a"], vec!["sc-a"]]
    );
    assert_eq!(master.status().sources[0].resyncs, 1);
}

#[tokio::test]
async fn several_corrupt_messages_cost_one_resync_each_not_a_loop() {
    let fixture = Fixture::new("t").await;
    let a = fixture.subcluster("sc-a", &[]).await;
    a.commit(vec![put("before")]).await;
    for garbage in ["first garbage", "second garbage"] {
        fixture
            .js
            .publish(event_subject(&fixture.cluster, &a.id), garbage.into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let committer = GroupCommitter::spawn(
        a.log.clone(),
        ProducerId::new("sm-2").unwrap(),
        2,
        3,
        CommitConfig::default(),
    );
    let last = committer.commit(vec![put("after")]).await.unwrap().seq;
    let master = fixture.start("g1").await;
    wait_applied(&master, &a.id, last).await;
    assert_eq!(
        exists(&fixture, &["before", "after"]).await,
        vec![vec!["sc-a"], vec!["sc-a"]]
    );
    assert_eq!(master.status().sources[0].resyncs, 2);
}

#[tokio::test]
async fn history_purged_past_the_checkpoint_forces_a_resync() {
    let fixture = Fixture::new("t").await;
    let a = fixture.subcluster("sc-a", &[]).await;
    a.commit(vec![put("k1")]).await;
    let first = fixture.start("g1").await;
    first.checkpoint_now().await.unwrap();
    drop(first);
    a.commit(vec![put("k2")]).await;
    a.commit(vec![put("k3")]).await;
    let last = a.commit(vec![put("k4")]).await;
    // Purge everything before sequence 3: the checkpoint (at 1) cannot be continued.
    let stream = fixture.js.get_stream(a.log.stream_name()).await.unwrap();
    stream.purge().sequence(3).await.unwrap();

    let restored = fixture.start("g2").await;
    wait_applied(&restored, &a.id, last).await;
    assert_eq!(
        exists(&fixture, &["k1", "k2", "k3", "k4"]).await,
        vec![vec![], vec![], vec!["sc-a"], vec!["sc-a"]]
    );
    assert_eq!(restored.status().sources[0].resyncs, 1);
}

fn placed(key: &str, offset: u64) -> KvEvent {
    KvEvent::PutCommitted(PutCommitted::new(
        key,
        64,
        7,
        vec![Placement {
            segment: SegmentId::new("seg-0").unwrap(),
            offset,
        }],
    ))
}

#[tokio::test]
async fn a_stream_purged_up_to_a_submaster_snapshot_is_seeded_from_it() {
    let fixture = Fixture::new("t").await;
    let a = fixture.subcluster("sc-a", &[]).await;
    let history = vec![
        vec![KvEvent::SegmentMounted(SegmentMounted {
            node: NodeId::new("n0").unwrap(),
            segment: SegmentId::new("seg-0").unwrap(),
            size: 1 << 20,
            endpoint: "127.0.0.1:1".into(),
            rdma: None,
        })],
        vec![placed("old-1", 0), placed("old-2", 4096)],
        vec![removed(&["old-1"])],
    ];
    // What the sub-master folds and snapshots: the same events.
    let mut state = hkvm_submaster::state::State::new();
    for events in history {
        let seq = a.commit(events.clone()).await;
        state.apply_message(seq, 1, &events);
    }
    let covers = state.applied_seq;
    let store = SnapshotStore::open(&fixture.js, &fixture.cluster, &a.id, 1)
        .await
        .unwrap();
    hkvm_submaster::snapshot::save(&store, &state)
        .await
        .unwrap();
    let stream = fixture.js.get_stream(a.log.stream_name()).await.unwrap();
    stream.purge().sequence(covers + 1).await.unwrap();
    let last = a.commit(vec![placed("new", 8192)]).await;

    let master = fixture.start("g1").await;
    wait_applied(&master, &a.id, last).await;
    assert_eq!(
        exists(&fixture, &["old-1", "old-2", "new"]).await,
        vec![vec![], vec!["sc-a"], vec!["sc-a"]]
    );
    let status = master.status();
    assert_eq!(status.sources[0].resyncs, 0);
    assert_eq!(
        master.with_projection(|p| p.source(0).unwrap().capacity_bytes()),
        1 << 20
    );
}

#[tokio::test]
async fn checkpoints_and_bloom_filters_are_published_periodically() {
    let fixture = Fixture::new("t").await;
    let a = fixture.subcluster("sc-a", &[]).await;
    let last = a.commit(vec![put("k1"), put("k2")]).await;
    let mut config = fixture.config("g1");
    config.checkpoint_interval_ms = 50;
    config.bloom_interval_ms = 50;
    let _master = fixture.start_with(config).await;

    let blooms = checkpoints::object_store(&fixture.js, &fixture.cluster, Bucket::Blooms)
        .await
        .unwrap();
    let bloom = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            if let Ok(mut object) = blooms.get("sc-a").await {
                let mut bytes = Vec::new();
                object.read_to_end(&mut bytes).await.unwrap();
                return BloomFilter::from_bytes(&bytes).unwrap();
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("a bloom filter is published");
    assert_eq!(bloom.covers_seq, last);
    assert!(bloom.may_contain(key_hash("k1")) && bloom.may_contain(key_hash("k2")));

    let store = checkpoints::object_store(&fixture.js, &fixture.cluster, Bucket::Checkpoints)
        .await
        .unwrap();
    let (name, restored) = poll_every(LISTING_POLL, "a checkpoint is written", WAIT, || async {
        checkpoints::load_newest(&store).await.unwrap()
    })
    .await;
    assert_eq!(name, "projection-g1");
    assert_eq!(restored.index().len(), 2);
}

#[tokio::test]
async fn two_replicas_share_the_queue_group_and_answer_alike() {
    let fixture = Fixture::new("t").await;
    let a = fixture.subcluster("sc-a", &[]).await;
    a.commit(vec![put("k")]).await;
    let one = fixture.start("g1").await;
    let two = fixture.start("g2").await;
    let mut seen = BTreeSet::new();
    for _ in 0..64 {
        let status: GlobalStatusReply = fixture
            .global()
            .call(GlobalOp::Status, &GlobalStatus {})
            .await
            .unwrap();
        seen.insert(status.replica);
        assert_eq!(exists(&fixture, &["k"]).await, vec![vec!["sc-a"]]);
    }
    assert_eq!(seen, BTreeSet::from(["g1".to_owned(), "g2".to_owned()]));
    // Losing one replica loses no service.
    drop(one);
    for _ in 0..8 {
        assert_eq!(exists(&fixture, &["k"]).await, vec![vec!["sc-a"]]);
    }
    drop(two);
}

#[tokio::test]
async fn only_the_newest_checkpoints_are_kept() {
    let fixture = Fixture::new("t").await;
    let a = fixture.subcluster("sc-a", &[]).await;
    a.commit(vec![put("k")]).await;
    // Replicas that come and go under new names (a default name holds the pid).
    let replicas = checkpoints::CHECKPOINTS_KEPT + 3;
    for i in 0..replicas {
        let master = fixture.start(&format!("g{i}")).await;
        assert!(master.checkpoint_now().await.unwrap() > 0);
    }
    let store = checkpoints::object_store(&fixture.js, &fixture.cluster, Bucket::Checkpoints)
        .await
        .unwrap();
    let mut names = BTreeSet::new();
    let mut list = store.list().await.unwrap();
    while let Some(info) = futures::StreamExt::next(&mut list).await {
        let info = info.unwrap();
        if !info.deleted {
            names.insert(info.name);
        }
    }
    let newest: BTreeSet<String> = (replicas - checkpoints::CHECKPOINTS_KEPT..replicas)
        .map(|i| format!("projection-g{i}"))
        .collect();
    assert_eq!(names, newest);
    let (name, _) = checkpoints::load_newest(&store).await.unwrap().unwrap();
    assert_eq!(name, format!("projection-g{}", replicas - 1));
}

#[tokio::test]
async fn a_damaged_newer_checkpoint_is_passed_over_for_the_newest_sound_one() {
    let fixture = Fixture::new("t").await;
    let a = fixture.subcluster("sc-a", &[]).await;
    a.commit(vec![put("k1"), put("k2")]).await;
    let first = fixture.start("g1").await;
    assert!(first.checkpoint_now().await.unwrap() > 0);
    let expected = first.with_projection(sorted_content);
    drop(first);

    let store = checkpoints::object_store(&fixture.js, &fixture.cluster, Bucket::Checkpoints)
        .await
        .unwrap();
    let mut bytes = Vec::new();
    let mut object = store.get("projection-g1").await.unwrap();
    object.read_to_end(&mut bytes).await.unwrap();
    // Newest first: a sound copy in 16-byte chunks (the reader decodes it
    // piece by piece), then, newer still, copies that are damaged past their
    // first chunk, so they fail only after some of their pieces were taken.
    let store_as = |name: &'static str, bytes: Vec<u8>| {
        let store = store.clone();
        async move {
            let meta = object_store::ObjectMetadata {
                name: name.to_owned(),
                chunk_size: Some(16),
                ..Default::default()
            };
            store.put(meta, &mut bytes.as_slice()).await.unwrap();
        }
    };
    store_as("projection-sound", bytes.clone()).await;
    let mut flipped = bytes.clone();
    let middle = flipped.len() / 2;
    flipped[middle] ^= 0x10;
    store_as("projection-flipped", flipped).await;
    store_as("projection-cut", bytes[..bytes.len() - 9].to_vec()).await;

    let (name, restored) = checkpoints::load_newest(&store).await.unwrap().unwrap();
    assert_eq!(name, "projection-sound");
    assert_eq!(sorted_content(&restored), expected);

    let mut config = fixture.config("g2");
    config.restore_checkpoint = true;
    let second = fixture.start_with(config).await;
    assert_eq!(second.restored_from(), Some("projection-sound"));
    assert_eq!(
        exists(&fixture, &["k1", "k2", "k3"]).await,
        vec![vec!["sc-a"], vec!["sc-a"], vec![]]
    );
}
