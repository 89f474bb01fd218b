//! The sub-master snapshot format, pinned: the bytes of a small snapshot are written
//! here, so a change of the encoding (field names, order, integer widths, checksum)
//! fails this test instead of making stored snapshots unreadable. Decoding hostile
//! bytes is an error, never a panic.
#![allow(clippy::unwrap_used)]

use hkvm_events::snapshot::{
    ObjectRecord, SegmentRecord, SnapshotError, SnapshotErrorKind, SnapshotFile, SNAPSHOT_VERSION,
};
use hkvm_events::{NodeId, Placement, SegmentId};
use proptest::prelude::*;

fn sample() -> SnapshotFile {
    let mut file = SnapshotFile::new(42, 3);
    file.segments = vec![
        SegmentRecord {
            node: NodeId::new("n0").unwrap(),
            segment: SegmentId::new("n0-seg").unwrap(),
            size: 1 << 20,
            endpoint: "10.0.0.1:7000".into(),
            rdma: None,
        },
        SegmentRecord {
            node: NodeId::new("n1").unwrap(),
            segment: SegmentId::new("n1-seg").unwrap(),
            size: 1 << 20,
            endpoint: "10.0.0.2:7000".into(),
            rdma: None,
        },
    ];
    file.objects = vec![
        ObjectRecord {
            key: "a".into(),
            size: 4096,
            checksum: 0x1122_3344_5566_7788,
            replicas: vec![(0, 0), (1, 4096)],
            flags: 0,
            put_id: 0,
        },
        ObjectRecord {
            key: "b".into(),
            size: 10,
            checksum: 7,
            replicas: vec![(1, 0)],
            flags: 1,
            put_id: 0,
        },
    ];
    file
}

/// `sample()` as encoded by this format (checksum, then the MessagePack body).
const GOLDEN: &str = concat!(
    "e4fca883d5cb2b70",
    "85a17601a1712aa16503a1679284a16ea26e30a167a66e302d736567a173ce00100000a165ad31302e30",
    "2e302e313a3730303084a16ea26e31a167a66e312d736567a173ce00100000a165ad31302e302e302e32",
    "3a37303030a16f9285a16ba161a173cd1000a163cf1122334455667788a170929200009201cd1000a166",
    "0085a16ba162a1730aa16307a17091920100a16601"
);

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn the_encoding_is_pinned() {
    let bytes = sample().encode().unwrap();
    assert_eq!(hex(&bytes), GOLDEN, "the snapshot encoding changed");
    let decoded = SnapshotFile::decode(&bytes).unwrap();
    assert_eq!(decoded, sample());
    assert_eq!(decoded.version, SNAPSHOT_VERSION);
}

#[test]
fn placements_name_segments_by_id() {
    let file = sample();
    let placements: Vec<Placement> = file.placements(&file.objects[0]).collect();
    assert_eq!(
        placements,
        [
            Placement {
                segment: SegmentId::new("n0-seg").unwrap(),
                offset: 0
            },
            Placement {
                segment: SegmentId::new("n1-seg").unwrap(),
                offset: 4096
            },
        ]
    );
}

#[test]
fn corrupt_or_foreign_snapshots_are_typed_errors() {
    let bytes = sample().encode().unwrap();
    let mut flipped = bytes.clone();
    let last = flipped.len() - 1;
    flipped[last] ^= 1;
    assert!(matches!(
        SnapshotFile::decode(&flipped),
        Err(SnapshotError::ChecksumMismatch { .. })
    ));
    assert!(matches!(
        SnapshotFile::decode(&bytes[..5]),
        Err(SnapshotError::Truncated { len: 5 })
    ));
    let mut future = sample();
    future.version = SNAPSHOT_VERSION + 1;
    let error = SnapshotFile::decode(&future.encode().unwrap()).unwrap_err();
    assert!(matches!(error, SnapshotError::UnknownVersion(_)), "{error}");
    let mut dangling = sample();
    dangling.objects[1].replicas = vec![(9, 0)];
    let error = SnapshotFile::decode(&dangling.encode().unwrap()).unwrap_err();
    assert!(
        matches!(error, SnapshotError::BadSegmentIndex { index: 9, .. }),
        "{error}"
    );
    assert_eq!(error.kind(), SnapshotErrorKind::Invalid);
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = SnapshotFile::decode(&bytes);
    }

    /// Bytes flipped anywhere in a valid snapshot are refused (the checksum covers
    /// the whole body), never decoded into something else.
    #[test]
    fn flipped_bytes_are_refused(at in any::<usize>(), mask in 1u8..) {
        let mut bytes = sample().encode().unwrap();
        let len = bytes.len();
        bytes[at % len] ^= mask;
        prop_assert!(SnapshotFile::decode(&bytes).is_err());
    }
}
