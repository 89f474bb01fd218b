//! The projection as a pure fold: events in, key holders out, no NATS. Includes the
//! property that restoring a checkpoint and folding the tail equals folding all.
#![allow(clippy::unwrap_used)]

use hkvm_events::{
    encode_message, key_hash, Evicted, Header, KvEvent, Limits, NodeId, NodeLost, Placement,
    ProducerId, PutCommitted, Removed, SegmentId, SegmentMounted, SubclusterId,
};
use hkvm_projector::{checkpoint, Projection, ProjectorErrorKind};
use proptest::prelude::*;

fn put(key: &str) -> KvEvent {
    KvEvent::PutCommitted(PutCommitted::new(
        key,
        1,
        0,
        vec![Placement {
            segment: SegmentId::new("g").unwrap(),
            offset: 0,
        }],
    ))
}

fn evicted(keys: &[&str]) -> KvEvent {
    KvEvent::Evicted(Evicted {
        keys: keys.iter().map(|k| (*k).to_owned()).collect(),
    })
}

fn removed(keys: &[&str]) -> KvEvent {
    KvEvent::Removed(Removed {
        keys: keys.iter().map(|k| (*k).to_owned()).collect(),
    })
}

fn message(events: &[KvEvent]) -> Vec<u8> {
    let header = Header {
        producer: ProducerId::new("p").unwrap(),
        epoch: 1,
        unix_ms: 0,
    };
    encode_message(&header, events, &Limits::default()).unwrap()
}

fn holders(projection: &Projection, key: &str) -> Vec<usize> {
    projection.index().holders(key_hash(key)).iter().collect()
}

fn two_sources() -> (Projection, usize, usize) {
    let mut projection = Projection::new();
    let a = projection.source_index(&SubclusterId::new("sc-a").unwrap(), "A");
    let b = projection.source_index(&SubclusterId::new("sc-b").unwrap(), "B");
    (projection, a, b)
}

#[test]
fn a_key_in_two_subclusters_stays_until_both_drop_it() {
    let (mut projection, a, b) = two_sources();
    projection.apply(a, &put("k1"));
    projection.apply(b, &put("k1"));
    projection.apply(a, &put("k2"));
    assert_eq!(holders(&projection, "k1"), vec![a, b]);
    assert_eq!(projection.index().len(), 2);
    projection.apply(a, &evicted(&["k1"]));
    assert_eq!(holders(&projection, "k1"), vec![b]);
    projection.apply(b, &removed(&["k1", "never-there"]));
    assert!(holders(&projection, "k1").is_empty());
    assert_eq!(holders(&projection, "k2"), vec![a]);
    assert_eq!(projection.index().len(), 1);
    assert_eq!(projection.index().source_len(a), 1);
    assert_eq!(projection.index().source_len(b), 0);
}

#[test]
fn segments_follow_mounts_and_node_loss() {
    let (mut projection, a, _) = two_sources();
    for (node, segment) in [("n1", "s1"), ("n1", "s2"), ("n2", "s3")] {
        projection.apply(
            a,
            &KvEvent::SegmentMounted(SegmentMounted {
                node: NodeId::new(node).unwrap(),
                segment: SegmentId::new(segment).unwrap(),
                size: 100,
                endpoint: "h:1".into(),
                rdma: None,
            }),
        );
    }
    assert_eq!(projection.source(a).unwrap().capacity_bytes(), 300);
    projection.apply(
        a,
        &KvEvent::NodeLost(NodeLost {
            node: NodeId::new("n1").unwrap(),
        }),
    );
    assert_eq!(projection.source(a).unwrap().capacity_bytes(), 100);
}

#[test]
fn messages_must_come_in_order_and_decode() {
    let (mut projection, a, _) = two_sources();
    let applied = projection
        .apply_message(a, 1, 5, &message(&[put("x"), put("y")]))
        .unwrap();
    assert_eq!(applied.events, 2);
    // A replayed message is ignored.
    projection
        .apply_message(a, 1, 5, &message(&[removed(&["x"])]))
        .unwrap();
    assert_eq!(holders(&projection, "x"), vec![a]);
    let gap = projection
        .apply_message(a, 3, 5, &message(&[put("z")]))
        .unwrap_err();
    assert_eq!(
        gap.kind(),
        &ProjectorErrorKind::OutOfOrder {
            expected: 2,
            found: 3
        }
    );
    let garbage = projection
        .apply_message(a, 2, 5, b"\x93garbage")
        .unwrap_err();
    assert!(matches!(
        garbage.kind(),
        ProjectorErrorKind::Undecodable(hkvm_events::codec::UndecodableMessage { seq: 2, .. })
    ));
    let mut truncated = message(&[put("t1"), put("t2")]);
    truncated.truncate(truncated.len() - 3);
    assert!(projection.apply_message(a, 2, 5, &truncated).is_err());
    // Nothing of the broken messages was applied.
    assert!(holders(&projection, "t1").is_empty());
    assert_eq!(projection.source(a).unwrap().applied_seq, 1);
    projection.reset_source(a);
    assert!(holders(&projection, "x").is_empty());
    assert_eq!(projection.source(a).unwrap().applied_seq, 0);
}

#[test]
fn bloom_filters_answer_nowhere_without_false_negatives() {
    let (mut projection, a, b) = two_sources();
    for i in 0..500 {
        projection.apply(a, &put(&format!("k{i}")));
    }
    projection
        .apply_message(b, 1, 0, &message(&[put("only-b")]))
        .unwrap();
    let bloom = projection.bloom(a);
    assert!((0..500).all(|i| bloom.may_contain(key_hash(&format!("k{i}")))));
    assert_eq!(projection.bloom(b).covers_seq, 1);
    assert!(projection.bloom(b).may_contain(key_hash("only-b")));
}

#[test]
fn memory_per_key_is_measured() {
    let mut projection = Projection::new();
    let sources: Vec<usize> = (0..8)
        .map(|i| projection.source_index(&SubclusterId::new(format!("sc-{i}")).unwrap(), "s"))
        .collect();
    for i in 0..200_000u64 {
        projection.apply(
            sources[(i % 8) as usize],
            &put(&format!("model/block/{i:012}")),
        );
    }
    let per_key = projection.bytes_per_key();
    assert!(per_key > 8.0 && per_key < 64.0, "{per_key}");
}

#[test]
fn corrupt_checkpoints_are_refused() {
    let (mut projection, a, _) = two_sources();
    projection.apply(a, &put("k"));
    let bytes = checkpoint::encode(&projection).unwrap();
    assert!(checkpoint::decode(&bytes).is_ok());
    for cut in [0, 7, 20, bytes.len() - 1] {
        assert!(checkpoint::decode(&bytes[..cut]).is_err());
    }
    let mut flipped = bytes.clone();
    flipped[30] ^= 0x40;
    assert!(checkpoint::decode(&flipped).is_err());
    assert!(checkpoint::stamp(&bytes).unwrap().sources[0].1 == 0);
}

/// One generated step: which source, and a message of events over a small key
/// space (so puts, evictions and removals collide).
fn step() -> impl Strategy<Value = (usize, Vec<(u8, u8)>)> {
    (0usize..3, prop::collection::vec((0u8..3, 0u8..24), 1..6))
}

fn event_of(op: u8, key: u8) -> KvEvent {
    let key = format!("key-{key}");
    match op {
        0 => put(&key),
        1 => evicted(&[&key]),
        _ => removed(&[&key]),
    }
}

fn fold(projection: &mut Projection, steps: &[(usize, Vec<(u8, u8)>)]) {
    for (source, events) in steps {
        let events: Vec<KvEvent> = events.iter().map(|&(op, key)| event_of(op, key)).collect();
        let seq = projection.source(*source).map_or(0, |s| s.applied_seq) + 1;
        projection
            .apply_message(*source, seq, seq * 10, &message(&events))
            .unwrap();
    }
}

fn fresh() -> Projection {
    let mut projection = Projection::new();
    for i in 0..3 {
        projection.source_index(&SubclusterId::new(format!("sc-{i}")).unwrap(), "s");
    }
    projection
}

proptest! {
    #[test]
    fn restoring_a_checkpoint_and_folding_the_tail_equals_folding_all(
        steps in prop::collection::vec(step(), 0..40),
        cut in 0usize..40,
    ) {
        let cut = cut.min(steps.len());
        let mut all = fresh();
        fold(&mut all, &steps);

        let mut head = fresh();
        fold(&mut head, &steps[..cut]);
        let bytes = checkpoint::encode(&head).unwrap();
        let mut restored = checkpoint::decode(&bytes).unwrap();
        fold(&mut restored, &steps[cut..]);

        prop_assert_eq!(restored.content(), all.content());
        prop_assert_eq!(restored.index().len(), all.index().len());
    }

    #[test]
    fn decoding_arbitrary_bytes_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = checkpoint::decode(&bytes);
    }
}
