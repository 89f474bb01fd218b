//! Restoring from stored snapshots, read and decoded piece by piece as the
//! object store sends them: the newest snapshot that is whole and intact is
//! the one restored, though damaged newer ones hand their first objects to
//! the decoder before their checksum fails.

use std::sync::Arc;

use hkvm_events::snapshot::{ObjectRecord, SegmentRecord, SnapshotFile};
use hkvm_events::subject::{snapshot_object_name, Bucket};
use hkvm_events::{NodeId, SegmentId, SubclusterId};
use hkvm_log::SnapshotStore;

use crate::fixture::Fixture;

/// A snapshot of `objects` objects in one segment, covering `covers_seq`:
/// a few megabytes, so many chunks and many reads.
fn snapshot(covers_seq: u64, objects: u64) -> SnapshotFile {
    let mut file = SnapshotFile::new(covers_seq, 1);
    file.segments.push(SegmentRecord {
        node: NodeId::new("n1").unwrap(),
        segment: SegmentId::new("s1").unwrap(),
        size: 1 << 40,
        endpoint: "127.0.0.1:7000".to_owned(),
        rdma: None,
    });
    file.objects = (0..objects)
        .map(|i| ObjectRecord {
            key: Arc::from(format!("prefix/{covers_seq}/block-{i}")),
            size: 4096,
            checksum: i,
            replicas: vec![(0, i * 4096)],
            flags: 0,
            put_id: i + 1,
        })
        .collect();
    file
}

#[tokio::test]
async fn a_damaged_newer_snapshot_is_passed_over_for_the_newest_intact_one() {
    let fixture = Fixture::new("t").await;
    let subcluster = SubclusterId::new("sc-a").unwrap();
    let store = SnapshotStore::open(&fixture.js, &fixture.cluster, &subcluster, 1)
        .await
        .unwrap();
    let intact = snapshot(100, 40_000);
    store.save(&intact).await.unwrap();

    // Newer ones, stored as they are: one with a key changed half-way (it
    // decodes, and only its checksum, at the end, fails it), one cut short.
    let raw = fixture
        .js
        .get_object_store(&Bucket::Snapshots.name(&fixture.cluster))
        .await
        .unwrap();
    let mut flipped = snapshot(200, 40_000).encode().unwrap();
    let key = b"prefix/200/block-20000";
    let at = flipped
        .windows(key.len())
        .position(|window| window == key)
        .unwrap();
    flipped[at + key.len() - 1] = b'9';
    let name = snapshot_object_name(&subcluster, 200);
    raw.put(name.as_str(), &mut flipped.as_slice())
        .await
        .unwrap();
    let cut = snapshot(300, 40_000).encode().unwrap();
    let name = snapshot_object_name(&subcluster, 300);
    raw.put(name.as_str(), &mut &cut[..cut.len() / 2])
        .await
        .unwrap();

    let (name, file) = store.load_newest().await.unwrap().unwrap();
    assert_eq!(name, snapshot_object_name(&subcluster, 100));
    assert_eq!(file, intact);

    // A sub-master's restore takes the same one, into its state.
    let state = hkvm_submaster::snapshot::load_newest(&store)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(state.applied_seq, 100);
    assert_eq!(state.object_count(), 40_000);
}
