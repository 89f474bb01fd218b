//! Object stores written for months: dropping an old snapshot or checkpoint leaves
//! nothing behind that a listing reads (an object store's delete alone leaves a
//! `deleted` marker per name, and snapshot names never repeat).

use std::collections::BTreeSet;

use async_nats::jetstream::{self, object_store::ObjectStore};
use futures::StreamExt as _;
use hkvm_events::snapshot::{SnapshotFile, SNAPSHOTS_KEPT};
use hkvm_events::subject::{snapshot_object_name, Bucket};
use hkvm_events::SubclusterId;
use hkvm_globalmaster::checkpoints;
use hkvm_log::objects;
use hkvm_log::SnapshotStore;

use crate::fixture::{put, Fixture};

/// The names a listing of `store` shows (it reads deleted markers too, but skips
/// them).
async fn listed(store: &ObjectStore) -> BTreeSet<String> {
    let mut live = BTreeSet::new();
    let mut list = store.list().await.unwrap();
    while let Some(info) = list.next().await {
        live.insert(info.unwrap().name);
    }
    live
}

/// Whether a listing of `bucket` reads exactly the metadata of `names`.
async fn reads_only(js: &jetstream::Context, bucket: &str, names: &BTreeSet<String>) -> bool {
    let read: BTreeSet<String> = objects::metadata_names(js, bucket)
        .await
        .unwrap()
        .into_iter()
        .collect();
    read == *names
}

/// Stores a small object under `name` and deletes it the way the object store
/// alone does (as builds before [`objects::delete_for_good`] did): its marker stays.
async fn leave_a_marker(js: &jetstream::Context, store: &ObjectStore, bucket: &str, name: &str) {
    store.put(name, &mut &b"old"[..]).await.unwrap();
    store.delete(name).await.unwrap();
    assert!(!listed(store).await.contains(name));
    assert!(
        objects::metadata_names(js, bucket)
            .await
            .unwrap()
            .iter()
            .any(|read| read == name),
        "the marker is there"
    );
}

#[tokio::test]
async fn snapshot_rounds_leave_only_the_kept_snapshots_in_the_store() {
    let fixture = Fixture::new("t").await;
    let subcluster = SubclusterId::new("sc-a").unwrap();
    let store = SnapshotStore::open(&fixture.js, &fixture.cluster, &subcluster, 1)
        .await
        .unwrap();
    let bucket = Bucket::Snapshots.name(&fixture.cluster);
    let raw = fixture.js.get_object_store(&bucket).await.unwrap();
    // A marker from an earlier build goes with the next round too.
    leave_a_marker(
        &fixture.js,
        &raw,
        &bucket,
        &snapshot_object_name(&subcluster, 1),
    )
    .await;

    let rounds = SNAPSHOTS_KEPT as u64 + 5;
    for round in 1..=rounds {
        store.save(&SnapshotFile::new(round * 10, 1)).await.unwrap();
    }

    let newest: BTreeSet<String> = (rounds + 1 - SNAPSHOTS_KEPT as u64..=rounds)
        .map(|round| snapshot_object_name(&subcluster, round * 10))
        .collect();
    assert_eq!(listed(&raw).await, newest);
    assert!(
        reads_only(&fixture.js, &bucket, &newest).await,
        "no deleted snapshot leaves a marker"
    );
    let (name, file) = store.load_newest().await.unwrap().unwrap();
    assert_eq!(name, snapshot_object_name(&subcluster, rounds * 10));
    assert_eq!(file.covers_seq, rounds * 10);
}

#[tokio::test]
async fn forgetting_purges_only_a_deleted_objects_marker() {
    let fixture = Fixture::new("t").await;
    let bucket = Bucket::Snapshots.name(&fixture.cluster);
    SnapshotStore::open(
        &fixture.js,
        &fixture.cluster,
        &SubclusterId::new("sc-a").unwrap(),
        1,
    )
    .await
    .unwrap();
    let raw = fixture.js.get_object_store(&bucket).await.unwrap();
    let forget = |name: &'static str| objects::forget_if_deleted(&fixture.js, &bucket, name);

    raw.put("live", &mut &b"kept"[..]).await.unwrap();
    assert!(!forget("live").await.unwrap());
    assert!(!forget("never").await.unwrap());

    leave_a_marker(&fixture.js, &raw, &bucket, "gone").await;
    assert!(forget("gone").await.unwrap());
    assert!(!forget("gone").await.unwrap());

    // Written again after its delete: the new object is not a marker.
    leave_a_marker(&fixture.js, &raw, &bucket, "again").await;
    raw.put("again", &mut &b"new"[..]).await.unwrap();
    assert!(!forget("again").await.unwrap());

    objects::delete_for_good(&fixture.js, &raw, &bucket, "live")
        .await
        .unwrap();
    let again = BTreeSet::from(["again".to_owned()]);
    assert_eq!(listed(&raw).await, again);
    assert!(reads_only(&fixture.js, &bucket, &again).await);
    let mut again = raw.get("again").await.unwrap();
    let mut bytes = Vec::new();
    tokio::io::AsyncReadExt::read_to_end(&mut again, &mut bytes)
        .await
        .unwrap();
    assert_eq!(bytes, b"new");
}

#[tokio::test]
async fn dropped_checkpoints_leave_no_marker() {
    let fixture = Fixture::new("t").await;
    let a = fixture.subcluster("sc-a", &[]).await;
    a.commit(vec![put("k")]).await;
    let bucket = Bucket::Checkpoints.name(&fixture.cluster);
    let store = checkpoints::object_store(&fixture.js, &fixture.cluster, Bucket::Checkpoints)
        .await
        .unwrap();
    leave_a_marker(&fixture.js, &store, &bucket, "projection-old").await;
    // Replicas that come and go under new names (a default name holds the pid).
    let replicas = checkpoints::CHECKPOINTS_KEPT + 3;
    for i in 0..replicas {
        let master = fixture.start(&format!("g{i}")).await;
        assert!(master.checkpoint_now().await.unwrap() > 0);
    }
    let live = listed(&store).await;
    assert_eq!(live.len(), checkpoints::CHECKPOINTS_KEPT);
    assert!(
        reads_only(&fixture.js, &bucket, &live).await,
        "no dropped checkpoint leaves a marker"
    );
}
