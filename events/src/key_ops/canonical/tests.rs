//! The canonical reader against the serde view of a put: on any body it reads,
//! it must read what serde reads; on the encoder's own output it must not give up.

use proptest::prelude::*;

use super::{read_put, read_put_any_order, read_put_in_order, PutFields};
use crate::event::{Placement, PutCommitted, PutFlags};
use crate::id::SegmentId;
use crate::key_ops::PutView;

/// What serde makes of `body`, as the fields the index needs.
fn serde_fields(body: &[u8]) -> Option<PutFields<'_>> {
    rmp_serde::from_slice::<PutView<'_>>(body)
        .ok()
        .map(|view| view.fields())
}

fn canonical_body(put: &PutCommitted) -> Vec<u8> {
    let mut body = Vec::new();
    serde::Serialize::serialize(
        put,
        &mut rmp_serde::Serializer::new(&mut body).with_struct_map(),
    )
    .unwrap();
    body
}

fn put(key: &str, placements: usize, put_id: u64, flags: u32) -> PutCommitted {
    let placements = (0..placements)
        .map(|i| Placement {
            segment: SegmentId::new(format!("seg-{i}")).unwrap(),
            offset: u64::MAX - i as u64,
        })
        .collect();
    let mut put = PutCommitted::new(key, u64::MAX, 70_000, placements);
    put.put_id = put_id;
    put.flags = PutFlags(flags);
    put
}

#[test]
fn the_encoders_own_puts_are_read_without_serde() {
    let long_key = "k".repeat(300);
    let longer_key = "é".repeat(40_000);
    for put in [
        put("a", 1, 0, 0),
        put("some/key", 2, 7, 1),
        put(&long_key, 3, u64::MAX, u32::MAX),
        put(&longer_key, 20, 1 << 40, 0),
    ] {
        let body = canonical_body(&put);
        let read = read_put(&body).expect("a canonical put is read by the fast path");
        assert_eq!(
            read_put_in_order(&body),
            Some(read),
            "the encoder's own field order takes the straight path"
        );
        assert_eq!(
            read,
            PutFields {
                key: &put.key,
                key_hash: put.key_hash,
                size: put.size,
                placements: put.placements.len(),
            }
        );
        assert_eq!(Some(read), serde_fields(&body));
    }
}

#[test]
fn other_forms_are_left_to_serde() {
    let body = canonical_body(&put("a", 1, 0, 0));
    // A truncated body, a byte left over, a map16 header for the same fields.
    assert_eq!(read_put(&body[..body.len() - 1]), None);
    let mut longer = body.clone();
    longer.push(0xc0);
    assert_eq!(read_put(&longer), None);
    let mut map16 = vec![0xde, 0, (body[0] & 0x0f)];
    map16.extend_from_slice(&body[1..]);
    assert_eq!(read_put(&map16), None);
    assert!(serde_fields(&map16).is_some(), "serde reads the map16 form");
    // The positional (array) form serde also accepts.
    let mut array = Vec::new();
    serde::Serialize::serialize(
        &put("a", 1, 0, 0),
        &mut rmp_serde::Serializer::new(&mut array),
    )
    .unwrap();
    assert_eq!(read_put(&array), None);
}

/// One MessagePack value, in a form chosen to probe the reader.
fn value() -> BoxedStrategy<Vec<u8>> {
    let uint = (any::<u64>(), 0..5u8).prop_map(|(value, width)| uint_bytes(value, width));
    let small_uint = (0..200u64, 0..5u8).prop_map(|(value, width)| uint_bytes(value, width));
    let signed = any::<i64>().prop_map(|value| {
        let mut bytes = Vec::new();
        rmp::encode::write_sint(&mut bytes, value).unwrap();
        bytes
    });
    let text = prop_oneof![
        Just(String::new()),
        Just("seg-1".to_owned()),
        Just("a b".to_owned()),
        "[a-z0-9_-]{1,70}",
        ".{0,40}",
    ];
    let string = (text, 0..4u8).prop_map(|(text, form)| str_bytes(text.as_bytes(), form));
    let bad_utf8 = (0..4u8).prop_map(|form| str_bytes(&[b'a', 0xff], form));
    let other = prop_oneof![
        Just(vec![0xc0]),
        Just(vec![0xc4, 1, b'x']),
        Just(vec![0xc2]),
        Just(vec![0xca, 0, 0, 0, 0]),
    ];
    prop_oneof![
        3 => uint,
        2 => small_uint,
        1 => signed,
        3 => string,
        1 => bad_utf8,
        1 => other,
    ]
    .boxed()
}

fn uint_bytes(value: u64, width: u8) -> Vec<u8> {
    let be = value.to_be_bytes();
    match width {
        0 if value < 0x80 => vec![value as u8],
        1 if value <= 0xff => vec![0xcc, value as u8],
        2 if value <= 0xffff => [&[0xcd][..], &be[6..]].concat(),
        3 if value <= 0xffff_ffff => [&[0xce][..], &be[4..]].concat(),
        _ => [&[0xcf][..], &be[..]].concat(),
    }
}

fn str_bytes(text: &[u8], form: u8) -> Vec<u8> {
    let len = text.len();
    let mut bytes = match form {
        0 if len < 32 => vec![0xa0 | len as u8],
        1 if len < 256 => vec![0xd9, len as u8],
        0..=2 if len < 65_536 => [&[0xda][..], &(len as u16).to_be_bytes()[..]].concat(),
        _ => [&[0xdb][..], &(len as u32).to_be_bytes()[..]].concat(),
    };
    bytes.extend_from_slice(text);
    bytes
}

/// A field name: usually the one-letter fixstr, sometimes another form or name.
fn name(letter: u8) -> BoxedStrategy<Vec<u8>> {
    prop_oneof![
        40 => Just(vec![0xa1, letter]),
        1 => Just(vec![0xd9, 1, letter]),
        1 => Just(vec![0xa1, b'x']),
        1 => Just(vec![0xa2, letter, letter]),
    ]
    .boxed()
}

fn map_header(len: usize, form: u8) -> Vec<u8> {
    if form != 0 && len < 16 {
        vec![0x80 | len as u8]
    } else {
        [&[0xde][..], &(len as u16).to_be_bytes()[..]].concat()
    }
}

/// A map of `letters`, each field present, missing, repeated or oddly typed
/// with some probability; `typed` gives each letter's well-formed value.
fn map(
    letters: &'static [u8],
    typed: impl Fn(u8) -> BoxedStrategy<Vec<u8>> + 'static,
) -> BoxedStrategy<Vec<u8>> {
    let fields: Vec<_> = letters
        .iter()
        .map(|&letter| {
            let well_formed = typed(letter);
            (
                0..40u8,
                name(letter),
                prop_oneof![30 => well_formed, 1 => value()],
            )
        })
        .collect();
    // Half the maps keep the letters' order (the encoder's, which the reader
    // takes a straight path for), half are rotated.
    let shift = prop_oneof![Just(None), any::<prop::sample::Index>().prop_map(Some)];
    (fields, shift, 0..20u8)
        .prop_map(|(fields, shift, form)| {
            let mut entries = Vec::new();
            for (presence, name, value) in fields {
                let copies = match presence {
                    0 => 0,
                    1 => 2,
                    _ => 1,
                };
                for _ in 0..copies {
                    entries.push([name.clone(), value.clone()].concat());
                }
            }
            let len = entries.len();
            if let Some(shift) = shift.filter(|_| len > 1) {
                entries.rotate_left(shift.index(len));
            }
            [map_header(len, form), entries.concat()].concat()
        })
        .boxed()
}

fn placement() -> BoxedStrategy<Vec<u8>> {
    map(b"go", |letter| match letter {
        b'g' => ("[a-z0-9_-]{1,20}", 0..4u8)
            .prop_map(|(id, form)| str_bytes(id.as_bytes(), form))
            .boxed(),
        _ => (any::<u64>(), 0..5u8)
            .prop_map(|(v, w)| uint_bytes(v, w))
            .boxed(),
    })
}

fn placements() -> BoxedStrategy<Vec<u8>> {
    let items = prop_oneof![
        9 => proptest::collection::vec(placement(), 0..4),
        1 => proptest::collection::vec(placement(), 0..20),
    ];
    (items, 0..20u8)
        .prop_map(|(items, form)| {
            let len = items.len();
            let header = match form {
                // Mostly the fixarray; sometimes the longer forms serde also reads.
                0 => [&[0xdd][..], &(len as u32).to_be_bytes()[..]].concat(),
                1 if len < 65_536 => [&[0xdc][..], &(len as u16).to_be_bytes()[..]].concat(),
                _ if len < 16 => vec![0x90 | len as u8],
                _ => [&[0xdc][..], &(len as u16).to_be_bytes()[..]].concat(),
            };
            [header, items.concat()].concat()
        })
        .boxed()
}

fn put_body() -> BoxedStrategy<Vec<u8>> {
    let body = map(b"khscpfi", |letter| match letter {
        b'k' => "[a-z/]{1,40}"
            .prop_map(|key| str_bytes(key.as_bytes(), 0))
            .boxed(),
        b'p' => placements(),
        b'f' => prop_oneof![any::<u32>().prop_map(u64::from), any::<u64>()]
            .prop_flat_map(|v| (0..5u8).prop_map(move |w| uint_bytes(v, w)))
            .boxed(),
        _ => (any::<u64>(), 0..5u8)
            .prop_map(|(v, w)| uint_bytes(v, w))
            .boxed(),
    });
    (body, prop::option::weighted(0.05, value()))
        .prop_map(|(body, extra)| [body, extra.unwrap_or_default()].concat())
        .boxed()
}

/// The generator reaches the fast path often enough for the property to bite,
/// and its perturbations often enough to probe the refusals.
#[test]
fn the_generator_probes_both_paths() {
    use proptest::strategy::ValueTree as _;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = put_body();
    let (mut fast, mut in_order, mut serde_only) = (0, 0, 0);
    for _ in 0..2000 {
        let body = strategy.new_tree(&mut runner).unwrap().current();
        in_order += usize::from(read_put_in_order(&body).is_some());
        match (read_put(&body), serde_fields(&body)) {
            (Some(_), _) => fast += 1,
            (None, Some(_)) => serde_only += 1,
            (None, None) => {}
        }
    }
    assert!(fast > 200, "{fast} of 2000 bodies read by the fast path");
    assert!(
        in_order > 50 && in_order < fast,
        "{in_order} of 2000 bodies read in the encoder's order, {fast} in any order"
    );
    assert!(
        serde_only > 100,
        "{serde_only} of 2000 bodies read by serde alone"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Whatever the fast path reads, serde reads the same.
    #[test]
    fn what_the_fast_path_reads_serde_reads_the_same(body in put_body()) {
        if let Some(fast) = read_put(&body) {
            prop_assert_eq!(Some(fast), serde_fields(&body));
        }
    }

    /// Whatever the straight path reads, the any-order loop reads the same.
    #[test]
    fn what_the_straight_path_reads_the_loop_reads_the_same(body in put_body()) {
        if let Some(straight) = read_put_in_order(&body) {
            prop_assert_eq!(Some(straight), read_put_any_order(&body));
        }
    }

    /// Truncated or flipped canonical bodies: never a different reading.
    #[test]
    fn damaged_bodies_are_never_read_differently(
        key in "[a-z]{1,20}",
        replicas in 1..4usize,
        at in any::<prop::sample::Index>(),
        byte in any::<u8>(),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut body = canonical_body(&put(&key, replicas, 3, 0));
        let at = at.index(body.len());
        body[at] = byte;
        body.truncate(cut.index(body.len() + 1));
        if let Some(fast) = read_put(&body) {
            prop_assert_eq!(Some(fast), serde_fields(&body));
        }
    }
}
