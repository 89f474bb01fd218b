//! The streaming snapshot decoder ([`SnapshotFile::decode_with`]): it hands over
//! exactly what [`SnapshotFile::decode`] collects, refuses bodies it cannot
//! stream with typed errors, and never trusts a count the bytes cannot hold.
#![allow(clippy::unwrap_used)]

use hkvm_events::snapshot::{
    ObjectRecord, ObjectView, SegmentRecord, SnapshotError, SnapshotErrorKind, SnapshotFile,
    SnapshotHeader, SnapshotVisitor,
};
use hkvm_events::{NodeId, SegmentId};
use proptest::prelude::*;

/// Records what the decoder hands over.
#[derive(Default)]
struct Seen {
    headers: Vec<(SnapshotHeader, usize)>,
    objects: Vec<ObjectRecord>,
}

impl SnapshotVisitor for Seen {
    fn header(&mut self, header: &SnapshotHeader, objects: usize) {
        self.headers.push((header.clone(), objects));
    }

    fn object(&mut self, object: ObjectView<'_>) {
        self.objects.push(object.to_record());
    }
}

/// An object to put in a snapshot: key, size, replicas, put id.
type Spec = (String, u64, Vec<(u32, u64)>, u64);

fn file(objects: &[Spec]) -> SnapshotFile {
    let mut file = SnapshotFile::new(9, 2);
    file.segments = (0..3)
        .map(|i| SegmentRecord {
            node: NodeId::new(format!("n{i}")).unwrap(),
            segment: SegmentId::new(format!("n{i}-seg")).unwrap(),
            size: 1 << 30,
            endpoint: format!("10.0.0.{i}:7000"),
            rdma: None,
        })
        .collect();
    file.objects = objects
        .iter()
        .map(|(key, size, replicas, put_id)| ObjectRecord {
            key: key.as_str().into(),
            size: *size,
            checksum: size.wrapping_mul(31),
            replicas: replicas.clone(),
            flags: (*size % 2) as u32,
            put_id: *put_id,
        })
        .collect();
    file
}

/// `body` with the checksum it needs, so the decoder itself reads it.
fn sealed(body: &[u8]) -> Vec<u8> {
    let mut bytes = xxhash_rust::xxh3::xxh3_64(body).to_be_bytes().to_vec();
    bytes.extend_from_slice(body);
    bytes
}

/// A MessagePack map of already-encoded values.
fn map(entries: &[(&str, Vec<u8>)]) -> Vec<u8> {
    let mut bytes = Vec::new();
    rmp::encode::write_map_len(&mut bytes, entries.len() as u32).unwrap();
    for (name, value) in entries {
        rmp::encode::write_str(&mut bytes, name).unwrap();
        bytes.extend_from_slice(value);
    }
    bytes
}

fn encoded<T: serde::Serialize>(value: &T) -> Vec<u8> {
    rmp_serde::to_vec_named(value).unwrap()
}

/// The header fields of `file`, by name.
fn header_field(file: &SnapshotFile, name: &str) -> (&'static str, Vec<u8>) {
    match name {
        "v" => ("v", encoded(&file.version)),
        "q" => ("q", encoded(&file.covers_seq)),
        "e" => ("e", encoded(&file.max_epoch)),
        "g" => ("g", encoded(&file.segments)),
        "o" => ("o", encoded(&file.objects)),
        _ => unreachable!("not a snapshot field"),
    }
}

/// A body in the writer's format but with its map entries in `order`.
fn body_in_order(file: &SnapshotFile, order: &[&str]) -> Vec<u8> {
    let entries: Vec<(&str, Vec<u8>)> = order.iter().map(|name| header_field(file, name)).collect();
    map(&entries)
}

#[test]
fn objects_before_the_header_are_malformed() {
    let file = file(&[("a".into(), 1, vec![(0, 0)], 0)]);
    let in_order = sealed(&body_in_order(&file, &["v", "q", "e", "g", "o"]));
    assert_eq!(in_order, file.encode().unwrap(), "the writer's order");
    assert_eq!(SnapshotFile::decode(&in_order).unwrap(), file);
    let early = sealed(&body_in_order(&file, &["v", "q", "e", "o", "g"]));
    let error = SnapshotFile::decode(&early).unwrap_err();
    assert!(matches!(error, SnapshotError::Malformed(_)), "{error}");
    assert_eq!(error.kind(), SnapshotErrorKind::Invalid);
    let missing = sealed(&body_in_order(&file, &["v", "q", "e", "g"]));
    assert!(matches!(
        SnapshotFile::decode(&missing),
        Err(SnapshotError::Malformed(_))
    ));
    let twice = sealed(&body_in_order(&file, &["v", "q", "e", "g", "o", "o"]));
    assert!(matches!(
        SnapshotFile::decode(&twice),
        Err(SnapshotError::Malformed(_))
    ));
}

#[test]
fn unknown_fields_are_skipped() {
    let file = file(&[("a".into(), 1, vec![(1, 64)], 5)]);
    let record = &file.objects[0];
    let object = map(&[
        ("k", encoded(&record.key.to_string())),
        ("s", encoded(&record.size)),
        ("c", encoded(&record.checksum)),
        ("later", encoded(&true)),
        ("p", encoded(&record.replicas)),
        ("f", encoded(&record.flags)),
        ("i", encoded(&record.put_id)),
    ]);
    let mut objects = Vec::new();
    rmp::encode::write_array_len(&mut objects, 1).unwrap();
    objects.extend_from_slice(&object);
    let body = map(&[
        header_field(&file, "v"),
        ("z", encoded(&(1u8, "x"))),
        header_field(&file, "q"),
        header_field(&file, "e"),
        header_field(&file, "g"),
        ("o", objects),
    ]);
    assert_eq!(SnapshotFile::decode(&sealed(&body)).unwrap(), file);
}

#[test]
fn an_announced_count_is_bounded_by_the_body() {
    // A body claiming 2^32 - 1 objects in a few bytes.
    let mut body = Vec::new();
    rmp::encode::write_map_len(&mut body, 5).unwrap();
    for (name, value) in [("v", 1u64), ("q", 1), ("e", 0)] {
        rmp::encode::write_str(&mut body, name).unwrap();
        rmp::encode::write_uint(&mut body, value).unwrap();
    }
    rmp::encode::write_str(&mut body, "g").unwrap();
    rmp::encode::write_array_len(&mut body, 0).unwrap();
    rmp::encode::write_str(&mut body, "o").unwrap();
    rmp::encode::write_array_len(&mut body, u32::MAX).unwrap();
    let mut seen = Seen::default();
    let error = SnapshotFile::decode_with(&sealed(&body), &mut seen).unwrap_err();
    assert!(matches!(error, SnapshotError::Malformed(_)), "{error}");
    assert_eq!(seen.headers.len(), 1);
    assert!(
        seen.headers[0].1 <= body.len(),
        "hint {}",
        seen.headers[0].1
    );
}

fn objects() -> impl Strategy<Value = Vec<Spec>> {
    proptest::collection::vec(
        (
            "[a-z0-9/._-]{1,24}",
            any::<u64>(),
            proptest::collection::vec((0u32..3, any::<u64>()), 0..4),
            prop_oneof![Just(0u64), any::<u64>()],
        ),
        0..40,
    )
}

proptest! {
    /// The streaming decoder hands over, in order, exactly the records the
    /// collecting decoder returns, after one header with the exact count.
    #[test]
    fn streaming_hands_over_what_decode_collects(objects in objects()) {
        let file = file(&objects);
        let bytes = file.encode().unwrap();
        let mut seen = Seen::default();
        let header = SnapshotFile::decode_with(&bytes, &mut seen).unwrap();
        prop_assert_eq!(seen.headers.len(), 1);
        prop_assert_eq!(&seen.headers[0].0, &header);
        prop_assert_eq!(seen.headers[0].1, file.objects.len());
        prop_assert_eq!((header.covers_seq, header.max_epoch), (9, 2));
        prop_assert_eq!(&header.segments, &file.segments);
        prop_assert_eq!(&seen.objects, &file.objects);
        prop_assert_eq!(SnapshotFile::decode(&bytes).unwrap(), file);
    }

    /// Any body behind a valid checksum (the decoder itself is fuzzed, not the
    /// checksum) is a typed error or a snapshot, never a panic.
    #[test]
    fn arbitrary_bodies_never_panic(body in proptest::collection::vec(any::<u8>(), 0..512)) {
        let mut seen = Seen::default();
        if let Err(error) = SnapshotFile::decode_with(&sealed(&body), &mut seen) {
            prop_assert_eq!(error.kind(), SnapshotErrorKind::Invalid);
        }
    }

    /// A real snapshot's body with bytes changed and its checksum recomputed: a
    /// typed error or a snapshot, never a panic.
    #[test]
    fn mutated_bodies_never_panic(objects in objects(), at in any::<usize>(), mask in 1u8..) {
        let bytes = file(&objects).encode().unwrap();
        let mut body = bytes[8..].to_vec();
        let len = body.len();
        body[at % len] ^= mask;
        let mut seen = Seen::default();
        if let Err(error) = SnapshotFile::decode_with(&sealed(&body), &mut seen) {
            prop_assert_eq!(error.kind(), SnapshotErrorKind::Invalid);
        }
    }
}
