//! The wire format: round trips, pinned bytes, compatibility in both directions, and
//! bad input of every shape (which must give typed errors, never panics).
#![allow(clippy::unwrap_used)]

use hkvm_events::codec::{decode_message, decode_stored, encode_message, Header, ENVELOPE_VERSION};
use hkvm_events::key_ops::{decode_key_ops, KeyOp, KeyOps};
use hkvm_events::{
    DecodeError, EventErrorKind, EventKind, Evicted, KvEvent, Limits, NodeId, NodeLost, Placement,
    ProducerId, PutCommitted, PutFlags, RdmaEndpoint, Removed, SegmentId, SegmentMounted,
    SegmentUnmounted, SnapshotTaken, ValidationError,
};
use proptest::prelude::*;

fn header() -> Header {
    Header {
        producer: ProducerId::new("sm-0").unwrap(),
        epoch: 7,
        unix_ms: 1_700_000_000_000,
    }
}

fn segment(name: &str) -> SegmentId {
    SegmentId::new(name).unwrap()
}

fn one_of_each() -> Vec<KvEvent> {
    let mut pinned = PutCommitted::new(
        "blk-1",
        4096,
        0xdead_beef,
        vec![
            Placement {
                segment: segment("seg-a"),
                offset: 0,
            },
            Placement {
                segment: segment("seg-b"),
                offset: 8192,
            },
        ],
    );
    pinned.flags = PutFlags(PutFlags::HARD_PIN);
    vec![
        KvEvent::SegmentMounted(SegmentMounted {
            node: NodeId::new("node-a").unwrap(),
            segment: segment("seg-a"),
            size: 1 << 30,
            endpoint: "10.0.0.1:7000".into(),
            rdma: None,
        }),
        KvEvent::PutCommitted(pinned),
        KvEvent::Evicted(Evicted {
            keys: vec!["blk-0".into()],
        }),
        KvEvent::Removed(Removed {
            keys: vec!["blk-1".into(), "blk-2".into()],
        }),
        KvEvent::SegmentUnmounted(SegmentUnmounted {
            node: NodeId::new("node-a").unwrap(),
            segment: segment("seg-a"),
        }),
        KvEvent::NodeLost(NodeLost {
            node: NodeId::new("node-b").unwrap(),
        }),
        KvEvent::Snapshot(SnapshotTaken {
            covers_seq: 41,
            object: "snap-41".into(),
            checksum: 9,
        }),
    ]
}

fn decode_all(bytes: &[u8]) -> (Header, Vec<Result<KvEvent, EventErrorKind>>) {
    let message = decode_message(bytes, &Limits::default()).unwrap();
    let events = message.events.map(|e| e.map_err(|e| e.kind)).collect();
    (message.header, events)
}

#[test]
fn every_kind_round_trips() {
    let events = one_of_each();
    assert_eq!(events.len(), EventKind::ALL.len(), "one event of each kind");
    let bytes = encode_message(&header(), &events, &Limits::default()).unwrap();
    let (decoded_header, decoded) = decode_all(&bytes);
    assert_eq!(decoded_header, header());
    let decoded: Vec<KvEvent> = decoded.into_iter().map(Result::unwrap).collect();
    assert_eq!(decoded, events);
}

/// The bytes of version 1 are pinned: a change here breaks every stored stream.
#[test]
fn golden_bytes_of_version_1() {
    let events = one_of_each();
    let bytes = encode_message(&header(), &events[..2], &Limits::default()).unwrap();
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(hex, GOLDEN_V1);
    // And the pinned bytes still decode to the same events.
    let golden: Vec<u8> = (0..GOLDEN_V1.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&GOLDEN_V1[i..i + 2], 16).unwrap())
        .collect();
    let (_, decoded) = decode_all(&golden);
    assert_eq!(decoded, vec![Ok(events[0].clone()), Ok(events[1].clone())]);
}

const GOLDEN_V1: &str = concat!(
    "930183a170a4736d2d30a16507a174cf0000018bcfe56800dd000000029201c60000002984a16ea66e6f",
    "64652d61a167a57365672d61a173ce40000000a165ad31302e302e302e313a373030309204c600000040",
    "86a16ba5626c6b2d31a168cfd4d09c9761b22df9a173cd1000a163cedeadbeefa1709282a167a5736567",
    "2d61a16f0082a167a57365672d62a16fcd2000a16601",
);

// ---- hand-built messages for compatibility checks -------------------------------

fn raw_message(version: u64, events: &[(u64, Vec<u8>)]) -> Vec<u8> {
    let mut buf = Vec::new();
    rmp::encode::write_array_len(&mut buf, 3).unwrap();
    rmp::encode::write_uint(&mut buf, version).unwrap();
    rmp::encode::write_map_len(&mut buf, 3).unwrap();
    for (key, value) in [("p", None), ("e", Some(1u64)), ("t", Some(2u64))] {
        rmp::encode::write_str(&mut buf, key).unwrap();
        match value {
            None => rmp::encode::write_str(&mut buf, "old-producer").unwrap(),
            Some(v) => rmp::encode::write_uint(&mut buf, v).map(|_| ()).unwrap(),
        }
    }
    rmp::encode::write_array_len(&mut buf, events.len() as u32).unwrap();
    for (code, body) in events {
        rmp::encode::write_array_len(&mut buf, 2).unwrap();
        rmp::encode::write_uint(&mut buf, *code).unwrap();
        rmp::encode::write_bin(&mut buf, body).unwrap();
    }
    buf
}

/// A put body as an older writer (no flags field) or a newer one (extra fields).
fn put_body(extra_field: bool, with_flags: bool) -> Vec<u8> {
    let key = "k1";
    let mut buf = Vec::new();
    let fields = 5 + u32::from(extra_field) + u32::from(with_flags);
    rmp::encode::write_map_len(&mut buf, fields).unwrap();
    rmp::encode::write_str(&mut buf, "k").unwrap();
    rmp::encode::write_str(&mut buf, key).unwrap();
    rmp::encode::write_str(&mut buf, "h").unwrap();
    rmp::encode::write_uint(&mut buf, hkvm_events::key_hash(key)).unwrap();
    if extra_field {
        rmp::encode::write_str(&mut buf, "zz_future").unwrap();
        rmp::encode::write_array_len(&mut buf, 2).unwrap();
        rmp::encode::write_str(&mut buf, "nested").unwrap();
        rmp::encode::write_uint(&mut buf, 5).unwrap();
    }
    rmp::encode::write_str(&mut buf, "s").unwrap();
    rmp::encode::write_uint(&mut buf, 10).unwrap();
    rmp::encode::write_str(&mut buf, "c").unwrap();
    rmp::encode::write_uint(&mut buf, 11).unwrap();
    rmp::encode::write_str(&mut buf, "p").unwrap();
    rmp::encode::write_array_len(&mut buf, 1).unwrap();
    rmp::encode::write_map_len(&mut buf, 2).unwrap();
    rmp::encode::write_str(&mut buf, "g").unwrap();
    rmp::encode::write_str(&mut buf, "seg").unwrap();
    rmp::encode::write_str(&mut buf, "o").unwrap();
    rmp::encode::write_uint(&mut buf, 64).unwrap();
    if with_flags {
        rmp::encode::write_str(&mut buf, "f").unwrap();
        rmp::encode::write_uint(&mut buf, 1).unwrap();
    }
    buf
}

#[test]
fn an_older_message_without_newer_fields_reads_with_defaults() {
    let bytes = raw_message(1, &[(4, put_body(false, false))]);
    let (header, events) = decode_all(&bytes);
    assert_eq!(header.producer.as_str(), "old-producer");
    let Ok(KvEvent::PutCommitted(put)) = &events[0] else {
        panic!("{events:?}")
    };
    assert_eq!(put.flags, PutFlags::default());
    assert_eq!(put.placements[0].offset, 64);
}

#[test]
fn unknown_fields_from_a_newer_writer_are_skipped() {
    let bytes = raw_message(1, &[(4, put_body(true, true))]);
    let (_, events) = decode_all(&bytes);
    let Ok(KvEvent::PutCommitted(put)) = &events[0] else {
        panic!("{events:?}")
    };
    assert!(put.flags.hard_pinned());
    assert_eq!(put.size, 10);
}

#[test]
fn an_unknown_kind_is_a_skippable_error_and_the_rest_decodes() {
    let bytes = raw_message(1, &[(999, vec![0x80]), (4, put_body(false, true))]);
    let message = decode_message(&bytes, &Limits::default()).unwrap();
    let events: Vec<_> = message.events.collect();
    let first = events[0].as_ref().unwrap_err();
    assert_eq!(first.kind, EventErrorKind::UnknownKind(999));
    assert!(first.is_skippable());
    assert!(matches!(events[1], Ok(KvEvent::PutCommitted(_))));
}

#[test]
fn an_unknown_envelope_version_is_a_typed_error() {
    let bytes = raw_message(2, &[]);
    assert_eq!(
        decode_message(&bytes, &Limits::default()).unwrap_err(),
        DecodeError::UnknownVersion {
            found: 2,
            supported: ENVELOPE_VERSION
        }
    );
}

#[test]
fn a_malformed_body_names_its_kind() {
    let bytes = raw_message(1, &[(4, vec![0x81, 0xa1, b'k', 0x07])]);
    let (_, events) = decode_all(&bytes);
    assert!(
        matches!(
            &events[0],
            Err(EventErrorKind::Body {
                kind: EventKind::PutCommitted,
                ..
            })
        ),
        "{events:?}"
    );
}

#[test]
fn oversized_keys_and_wrong_key_hashes_are_rejected_both_ways() {
    let limits = Limits {
        max_key_len: 8,
        ..Limits::default()
    };
    let long = PutCommitted::new(
        "123456789",
        1,
        1,
        vec![Placement {
            segment: segment("s"),
            offset: 0,
        }],
    );
    let err =
        encode_message(&header(), &[KvEvent::PutCommitted(long.clone())], &limits).unwrap_err();
    assert!(
        err.to_string().contains("longer than the limit of 8"),
        "{err}"
    );

    // Written under default limits, read under the tight ones.
    let bytes = encode_message(
        &header(),
        &[KvEvent::PutCommitted(long)],
        &Limits::default(),
    )
    .unwrap();
    let message = decode_message(&bytes, &limits).unwrap();
    let errors: Vec<_> = message.events.collect();
    assert!(matches!(
        &errors[0].as_ref().unwrap_err().kind,
        EventErrorKind::Invalid {
            source: ValidationError::KeyTooLong { len: 9, max: 8 },
            ..
        }
    ));

    let mut forged = PutCommitted::new(
        "key",
        1,
        1,
        vec![Placement {
            segment: segment("s"),
            offset: 0,
        }],
    );
    forged.key_hash ^= 1;
    let err = encode_message(
        &header(),
        &[KvEvent::PutCommitted(forged)],
        &Limits::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("does not match"), "{err}");
}

#[test]
fn every_truncation_of_a_message_fails_cleanly() {
    let bytes = encode_message(&header(), &one_of_each(), &Limits::default()).unwrap();
    for cut in 0..bytes.len() {
        if let Ok(message) = decode_message(&bytes[..cut], &Limits::default()) {
            let results: Vec<_> = message.events.collect();
            assert!(
                results.iter().any(Result::is_err),
                "a message cut at {cut} of {} decoded fully",
                bytes.len()
            );
        }
    }
}

#[test]
fn a_huge_announced_event_count_is_refused_before_allocating() {
    let mut bytes = raw_message(1, &[]);
    // Replace the trailing empty array with an array32 announcing 4 billion events.
    bytes.pop();
    bytes.extend_from_slice(&[0xdd, 0xff, 0xff, 0xff, 0xff]);
    assert!(matches!(
        decode_message(&bytes, &Limits::default()),
        Err(DecodeError::TooManyEvents { .. })
    ));
}

// ---- property tests: the decoder is total, and encoding round-trips --------------

fn arb_id() -> impl Strategy<Value = String> {
    "[A-Za-z0-9_-]{1,16}"
}

fn arb_rdma() -> impl Strategy<Value = RdmaEndpoint> {
    (
        "[a-z0-9_]{1,12}",
        any::<[u8; 16]>(),
        any::<u16>(),
        "[a-z0-9.:]{1,20}",
        any::<u32>(),
        any::<u64>(),
        any::<u64>(),
    )
        .prop_map(
            |(device, gid, lid, exchange, rkey, addr, len)| RdmaEndpoint {
                device,
                gid,
                lid,
                exchange,
                rkey,
                addr,
                len,
            },
        )
}

fn arb_event() -> impl Strategy<Value = KvEvent> {
    let put = (
        ".{1,40}",
        any::<u64>(),
        any::<u64>(),
        proptest::collection::vec((arb_id(), any::<u64>()), 1..4),
        any::<u32>(),
    )
        .prop_map(|(key, size, checksum, placements, flags)| {
            let mut put = PutCommitted::new(
                key,
                size % (1 << 40),
                checksum,
                placements
                    .into_iter()
                    .map(|(segment, offset)| Placement {
                        segment: SegmentId::new(segment).unwrap(),
                        offset,
                    })
                    .collect(),
            );
            put.flags = PutFlags(flags);
            KvEvent::PutCommitted(put)
        });
    let keys = proptest::collection::vec(".{1,20}", 0..8);
    prop_oneof![
        put,
        keys.clone()
            .prop_map(|keys| KvEvent::Evicted(Evicted { keys })),
        keys.prop_map(|keys| KvEvent::Removed(Removed { keys })),
        (
            arb_id(),
            arb_id(),
            any::<u32>(),
            "[a-z0-9.:]{0,20}",
            proptest::option::of(arb_rdma())
        )
            .prop_map(|(node, seg, size, endpoint, rdma)| {
                KvEvent::SegmentMounted(SegmentMounted {
                    node: NodeId::new(node).unwrap(),
                    segment: SegmentId::new(seg).unwrap(),
                    size: u64::from(size),
                    endpoint,
                    rdma,
                })
            }),
        arb_id().prop_map(|node| KvEvent::NodeLost(NodeLost {
            node: NodeId::new(node).unwrap()
        })),
    ]
}

proptest! {
    #[test]
    fn encoded_events_decode_to_themselves(events in proptest::collection::vec(arb_event(), 0..20)) {
        let bytes = encode_message(&header(), &events, &Limits::default()).unwrap();
        let (_, decoded) = decode_all(&bytes);
        let decoded: Vec<KvEvent> = decoded.into_iter().map(Result::unwrap).collect();
        prop_assert_eq!(decoded, events);
    }

    /// Fuzzing by property: arbitrary bytes never panic the decoder.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        if let Ok(message) = decode_message(&bytes, &Limits::default()) {
            for event in message.events {
                let _ = event;
            }
        }
    }

    /// Valid messages with a few bytes flipped never panic the decoder.
    #[test]
    fn mutated_messages_never_panic(
        events in proptest::collection::vec(arb_event(), 1..6),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
    ) {
        let bytes = flipped(&events, &flips);
        if let Ok(message) = decode_message(&bytes, &Limits::default()) {
            for event in message.events {
                let _ = event;
            }
        }
    }
}

/// `events` encoded as one message, then bytes overwritten at `flips`.
fn flipped(events: &[KvEvent], flips: &[(prop::sample::Index, u8)]) -> Vec<u8> {
    let mut bytes = encode_message(&header(), events, &Limits::default()).unwrap();
    for (at, value) in flips {
        let at = at.index(bytes.len());
        bytes[at] = *value;
    }
    bytes
}

/// What the key-operation decoder and the owned decoder make of the same bytes:
/// both refuse the message, or both accept it with the same key operations.
fn both_decoders(bytes: &[u8], limits: &Limits) -> Result<(), TestCaseError> {
    let owned = decode_stored(7, 1000, bytes, limits).map(|d| KeyOps::of(&d));
    let borrowed = decode_key_ops(7, 1000, bytes, limits);
    match (owned, borrowed) {
        (Ok(owned), Ok(borrowed)) => prop_assert_eq!(borrowed, owned),
        (Err(owned), Err(borrowed)) => prop_assert_eq!(
            std::mem::discriminant(&borrowed.cause),
            std::mem::discriminant(&owned.cause)
        ),
        (owned, borrowed) => {
            return Err(TestCaseError::fail(format!(
                "owned {owned:?} but key ops {borrowed:?}"
            )));
        }
    }
    Ok(())
}

#[test]
fn key_ops_hash_put_keys_and_dropped_keys_and_keep_other_events() {
    let events = vec![
        KvEvent::PutCommitted(PutCommitted::new(
            "a",
            3,
            9,
            vec![Placement {
                segment: SegmentId::new("s").unwrap(),
                offset: 0,
            }],
        )),
        KvEvent::Evicted(Evicted {
            keys: vec!["b".into(), "c".into()],
        }),
        KvEvent::NodeLost(NodeLost {
            node: NodeId::new("n").unwrap(),
        }),
    ];
    let bytes = encode_message(&header(), &events, &Limits::default()).unwrap();
    let ops = decode_key_ops(5, 6, &bytes, &Limits::default()).unwrap();
    assert_eq!(
        ops.ops,
        [
            KeyOp::Put(hkvm_events::key_hash("a")),
            KeyOp::Drop(hkvm_events::key_hash("b")),
            KeyOp::Drop(hkvm_events::key_hash("c")),
            KeyOp::Event(Box::new(events[2].clone())),
        ]
    );
    assert_eq!(
        (ops.seq, ops.unix_ms, ops.events, ops.skipped),
        (5, 6, 3, 0)
    );
    // A put whose key does not match its carried hash is skipped by both.
    let mut bad = PutCommitted::new(
        "d",
        1,
        1,
        vec![Placement {
            segment: SegmentId::new("s").unwrap(),
            offset: 0,
        }],
    );
    bad.key_hash ^= 1;
    let mut builder = hkvm_events::MessageBuilder::new(&header(), Vec::new()).unwrap();
    builder.push(&KvEvent::PutCommitted(bad)).unwrap();
    builder.push(&events[0]).unwrap();
    let bytes = builder.finish();
    let ops = decode_key_ops(1, 1, &bytes, &Limits::default()).unwrap();
    assert_eq!(ops.ops, [KeyOp::Put(hkvm_events::key_hash("a"))]);
    assert_eq!((ops.events, ops.skipped), (1, 1));
}

proptest! {
    /// The borrowed key-operation decoder agrees with the owned decoder on every
    /// valid message...
    #[test]
    fn key_ops_agree_with_the_owned_decoder(events in proptest::collection::vec(arb_event(), 0..20)) {
        let bytes = encode_message(&header(), &events, &Limits::default()).unwrap();
        both_decoders(&bytes, &Limits::default())?;
        // ...and under limits tight enough to refuse some of the events.
        let tight = Limits {
            max_key_len: 8,
            max_keys_per_event: 3,
            max_replicas: 2,
            max_object_size: 1 << 20,
            ..Limits::default()
        };
        both_decoders(&bytes, &tight)?;
    }

    /// ...on valid messages with bytes flipped...
    #[test]
    fn key_ops_agree_on_mutated_messages(
        events in proptest::collection::vec(arb_event(), 1..6),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
    ) {
        let bytes = flipped(&events, &flips);
        both_decoders(&bytes, &Limits::default())?;
    }

    /// ...and on arbitrary bytes, without panicking.
    #[test]
    fn key_ops_agree_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        both_decoders(&bytes, &Limits::default())?;
    }
}

/// The body of `event` as its writer serializes it (a map of named fields).
fn body_of(event: &KvEvent) -> Vec<u8> {
    match event {
        KvEvent::SegmentMounted(body) => rmp_serde::to_vec_named(body),
        KvEvent::SegmentUnmounted(body) => rmp_serde::to_vec_named(body),
        KvEvent::NodeLost(body) => rmp_serde::to_vec_named(body),
        KvEvent::PutCommitted(body) => rmp_serde::to_vec_named(body),
        KvEvent::Evicted(body) => rmp_serde::to_vec_named(body),
        KvEvent::Removed(body) => rmp_serde::to_vec_named(body),
        KvEvent::Snapshot(body) => rmp_serde::to_vec_named(body),
    }
    .unwrap()
}

/// `events` in one message whose frames are not in the builder's own form: each
/// kind a `uint 8` instead of a fixint, each body the smallest `bin` instead of
/// a `bin 32`.
fn reframed(events: &[KvEvent]) -> Vec<u8> {
    let mut buf = Vec::new();
    rmp::encode::write_array_len(&mut buf, 3).unwrap();
    rmp::encode::write_uint(&mut buf, u64::from(ENVELOPE_VERSION)).unwrap();
    rmp_serde::encode::write_named(&mut buf, &header()).unwrap();
    rmp::encode::write_array_len(&mut buf, events.len() as u32).unwrap();
    for event in events {
        rmp::encode::write_array_len(&mut buf, 2).unwrap();
        rmp::encode::write_u8(&mut buf, u8::try_from(event.kind().code()).unwrap()).unwrap();
        rmp::encode::write_bin(&mut buf, &body_of(event)).unwrap();
    }
    buf
}

proptest! {
    /// The builder's frames are read by a fast path; frames in any other form
    /// go through the general reader and give the same events and key
    /// operations.
    #[test]
    fn frames_in_other_forms_read_as_the_builders(
        events in proptest::collection::vec(arb_event(), 0..20),
    ) {
        let builders = encode_message(&header(), &events, &Limits::default()).unwrap();
        let other = reframed(&events);
        prop_assert_ne!(&builders, &other);
        prop_assert_eq!(decode_all(&other), decode_all(&builders));
        let key_ops = |bytes: &[u8]| decode_key_ops(7, 1000, bytes, &Limits::default()).unwrap();
        prop_assert_eq!(key_ops(&other), key_ops(&builders));
        both_decoders(&other, &Limits::default())?;
    }
}
