//! The canonical reader against the serde decoder: on every body, canonical
//! or not, intact or damaged, both hand the visitor the same header and
//! objects and end the same way. Likewise the decoder of pieces
//! ([`crate::snapshot::decode_pieces`]) against the decoder of whole bytes.
#![allow(clippy::unwrap_used)]

use proptest::prelude::*;

use crate::snapshot::generated::{file, Generated};
use crate::snapshot::visit::decode_body_with_serde;
use crate::snapshot::{
    ObjectRecord, ObjectView, SnapshotError, SnapshotFile, SnapshotHeader, SnapshotVisitor,
};

/// What a decoder handed over, and how it ended.
#[derive(Debug, Default, PartialEq)]
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

/// How a decode ended: the header, or the error with what tells errors of one
/// kind apart (a malformed body's message may word the same fault differently).
#[derive(Debug, PartialEq)]
enum Ended {
    Header(SnapshotHeader),
    BadSegmentIndex(String, u32, usize),
    UnknownVersion(u16),
    Malformed,
    Other(String),
}

fn ended(result: Result<SnapshotHeader, SnapshotError>) -> Ended {
    match result {
        Ok(header) => Ended::Header(header),
        Err(SnapshotError::BadSegmentIndex {
            key,
            index,
            segments,
        }) => Ended::BadSegmentIndex(key, index, segments),
        Err(SnapshotError::UnknownVersion(version)) => Ended::UnknownVersion(version),
        Err(SnapshotError::Malformed(_)) => Ended::Malformed,
        Err(other) => Ended::Other(other.to_string()),
    }
}

/// Decodes `body` both ways; returns whether the canonical reader took it.
fn both_agree(body: &[u8]) -> Result<bool, TestCaseError> {
    let max_objects = body.len() / 16;
    let mut canonical = Seen::default();
    let taken = super::decode_body(body, &mut canonical, max_objects);
    let took = taken.is_some();
    let canonical_end = match taken {
        Some(result) => ended(result),
        // Not taken: nothing seen, and serde decides (as `visit::decode_body` does).
        None => {
            prop_assert_eq!(&canonical, &Seen::default());
            ended(decode_body_with_serde(body, &mut canonical, max_objects))
        }
    };
    let mut serde = Seen::default();
    let serde_end = ended(decode_body_with_serde(body, &mut serde, max_objects));
    prop_assert_eq!(canonical_end, serde_end);
    prop_assert_eq!(canonical, serde);
    Ok(took)
}

fn spec() -> impl Strategy<Value = Generated> {
    (
        "[a-z0-9/]{0,40}",
        prop_oneof![0u64..200, any::<u64>()],
        proptest::collection::vec((0u32..5, any::<u64>()), 0..4),
        prop_oneof![0u32..4, any::<u32>()],
        prop_oneof![Just(0u64), any::<u64>()],
    )
}

/// One object written in a form the writer never uses: every integer 64 bits
/// wide, the fields in reverse order, and an unknown field `z` first.
fn loose_object(object: &ObjectRecord) -> Vec<u8> {
    let mut bytes = Vec::new();
    rmp::encode::write_map_len(&mut bytes, 7).unwrap();
    rmp::encode::write_str(&mut bytes, "z").unwrap();
    rmp::encode::write_nil(&mut bytes).unwrap();
    rmp::encode::write_str(&mut bytes, "i").unwrap();
    rmp::encode::write_u64(&mut bytes, object.put_id).unwrap();
    rmp::encode::write_str(&mut bytes, "f").unwrap();
    rmp::encode::write_u64(&mut bytes, u64::from(object.flags)).unwrap();
    rmp::encode::write_str(&mut bytes, "p").unwrap();
    rmp::encode::write_array_len(&mut bytes, object.replicas.len() as u32).unwrap();
    for &(index, offset) in &object.replicas {
        rmp::encode::write_array_len(&mut bytes, 2).unwrap();
        rmp::encode::write_u64(&mut bytes, u64::from(index)).unwrap();
        rmp::encode::write_u64(&mut bytes, offset).unwrap();
    }
    rmp::encode::write_str(&mut bytes, "c").unwrap();
    rmp::encode::write_u64(&mut bytes, object.checksum).unwrap();
    rmp::encode::write_str(&mut bytes, "s").unwrap();
    rmp::encode::write_u64(&mut bytes, object.size).unwrap();
    rmp::encode::write_str(&mut bytes, "k").unwrap();
    rmp::encode::write_str(&mut bytes, &object.key).unwrap();
    bytes
}

/// The body of `file` with the objects at `loose` positions written loosely.
fn body_with_loose_objects(file: &SnapshotFile, loose: &[usize]) -> Vec<u8> {
    let mut header = SnapshotFile::new(file.covers_seq, file.max_epoch);
    header.segments = file.segments.clone();
    let empty = header.encode().unwrap();
    // The empty object array is the body's last byte (a fixarray of 0).
    let mut body = empty[8..empty.len() - 1].to_vec();
    rmp::encode::write_array_len(&mut body, file.objects.len() as u32).unwrap();
    for (at, object) in file.objects.iter().enumerate() {
        if loose.contains(&at) {
            body.extend_from_slice(&loose_object(object));
        } else {
            let one = crate::snapshot::encode_from(&header.header(), std::slice::from_ref(object))
                .unwrap();
            // A one-object body ends with a fixarray of 1, then the object.
            let object_len = one.len() - empty.len();
            body.extend_from_slice(&one[one.len() - object_len..]);
        }
    }
    body
}

proptest! {
    /// What the writer writes, the canonical reader takes, with the same result
    /// as serde (bad segment indices included).
    #[test]
    fn a_written_snapshot_reads_the_same_both_ways(
        objects in proptest::collection::vec(spec(), 0..30),
        segments in 0usize..5,
    ) {
        let bytes = file(&objects, segments).encode().unwrap();
        prop_assert!(both_agree(&bytes[8..])?, "the canonical reader refused the writer's own bytes");
    }

    /// Objects in a loose form, anywhere in the list, are read by serde from
    /// there on, to the same result.
    #[test]
    fn loose_objects_read_the_same_both_ways(
        objects in proptest::collection::vec(spec(), 1..20),
        loose in proptest::collection::vec(0usize..20, 1..4),
        segments in 1usize..5,
    ) {
        let file = file(&objects, segments);
        let body = body_with_loose_objects(&file, &loose);
        both_agree(&body)?;
    }

    /// A damaged body (bytes changed, cut short or extended) ends the same way
    /// through both, after handing over the same objects.
    #[test]
    fn a_damaged_body_reads_the_same_both_ways(
        objects in proptest::collection::vec(spec(), 0..12),
        segments in 0usize..4,
        changes in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        cut in proptest::option::of(any::<prop::sample::Index>()),
        tail in proptest::collection::vec(any::<u8>(), 0..3),
    ) {
        let bytes = file(&objects, segments).encode().unwrap();
        let mut body = bytes[8..].to_vec();
        for (at, byte) in changes {
            let at = at.index(body.len());
            body[at] = byte;
        }
        if let Some(cut) = cut {
            body.truncate(cut.index(body.len() + 1));
        }
        body.extend_from_slice(&tail);
        both_agree(&body)?;
    }
}

/// `body` sealed with its checksum, decoded whole and in pieces cut at
/// `cuts`: the same objects and the same end.
fn pieces_agree(body: &[u8], cuts: &[prop::sample::Index]) -> Result<(), TestCaseError> {
    let mut bytes = xxhash_rust::xxh3::xxh3_64(body).to_be_bytes().to_vec();
    bytes.extend_from_slice(body);
    let mut whole = Seen::default();
    let whole_end = ended(SnapshotFile::decode_with(&bytes, &mut whole));
    let mut streamed = Seen::default();
    let streamed_end = ended(decode_in_pieces(
        &bytes,
        bytes.len() as u64,
        cuts,
        &mut streamed,
    ));
    prop_assert_eq!(&streamed_end, &whole_end);
    prop_assert_eq!(streamed, whole);
    Ok(())
}

fn decode_in_pieces(
    bytes: &[u8],
    len: u64,
    cuts: &[prop::sample::Index],
    visitor: &mut Seen,
) -> Result<SnapshotHeader, SnapshotError> {
    let mut cuts: Vec<usize> = cuts.iter().map(|cut| cut.index(bytes.len() + 1)).collect();
    cuts.push(0);
    cuts.push(bytes.len());
    cuts.sort_unstable();
    let pieces = cuts.windows(2).map(|at| Ok(bytes[at[0]..at[1]].to_vec()));
    crate::snapshot::decode_pieces(len, pieces, visitor)
}

fn cuts() -> impl Strategy<Value = Vec<prop::sample::Index>> {
    proptest::collection::vec(any::<prop::sample::Index>(), 0..10)
}

proptest! {
    /// The writer's own snapshots, and ones with loose objects anywhere (bad
    /// segment indices included), read in pieces of any sizes as whole.
    #[test]
    fn a_snapshot_reads_the_same_in_pieces_as_whole(
        objects in proptest::collection::vec(spec(), 0..20),
        loose in proptest::collection::vec(0usize..20, 0..3),
        segments in 1usize..5,
        cuts in cuts(),
    ) {
        let file = file(&objects, segments);
        let body = body_with_loose_objects(&file, &loose);
        pieces_agree(&body, &cuts)?;
    }

    /// Damaged but sealed bodies end the same way in pieces as whole, after
    /// the same objects; unsealed damage is refused in pieces too.
    #[test]
    fn a_damaged_snapshot_reads_the_same_in_pieces_as_whole(
        objects in proptest::collection::vec(spec(), 0..12),
        segments in 0usize..4,
        changes in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        cut in proptest::option::of(any::<prop::sample::Index>()),
        cuts in cuts(),
    ) {
        let bytes = file(&objects, segments).encode().unwrap();
        let mut body = bytes[8..].to_vec();
        for (at, byte) in &changes {
            let at = at.index(body.len());
            body[at] = *byte;
        }
        if let Some(cut) = cut {
            body.truncate(cut.index(body.len() + 1));
        }
        pieces_agree(&body, &cuts)?;
        let mut unsealed = bytes[..8].to_vec();
        unsealed.extend_from_slice(&body);
        if unsealed != bytes {
            let mut seen = Seen::default();
            let len = unsealed.len() as u64;
            prop_assert!(decode_in_pieces(&unsealed, len, &cuts, &mut seen).is_err());
        }
    }

    /// Pieces that add up to another length than declared are refused.
    #[test]
    fn pieces_of_another_length_than_declared_are_refused(
        objects in proptest::collection::vec(spec(), 0..8),
        short in 1u64..40,
        cuts in cuts(),
    ) {
        let bytes = file(&objects, 1).encode().unwrap();
        let len = bytes.len() as u64;
        let mut seen = Seen::default();
        prop_assert!(decode_in_pieces(&bytes, len + short, &cuts, &mut seen).is_err());
        let mut seen = Seen::default();
        prop_assert!(decode_in_pieces(&bytes, len.saturating_sub(short), &cuts, &mut seen).is_err());
    }
}

#[test]
fn a_large_snapshot_is_read_through_a_window_that_moves() {
    // Far more than one window of objects, with keys of many sizes.
    let objects: Vec<Generated> = (0..20_000u64)
        .map(|i| {
            (
                format!("key/{i}/{}", "x".repeat((i % 97) as usize)),
                i,
                vec![(0, i)],
                0,
                i,
            )
        })
        .collect();
    let bytes = file(&objects, 1).encode().unwrap();
    let pieces = bytes.chunks(128 << 10).map(|piece| Ok(piece.to_vec()));
    let mut streamed = Seen::default();
    let header = crate::snapshot::decode_pieces(bytes.len() as u64, pieces, &mut streamed).unwrap();
    let mut whole = Seen::default();
    assert_eq!(
        SnapshotFile::decode_with(&bytes, &mut whole).unwrap(),
        header
    );
    assert_eq!(streamed.objects.len(), 20_000);
    assert_eq!(streamed, whole);
    // A failing piece fails the decode.
    let failing = bytes.chunks(1 << 16).enumerate().map(|(at, piece)| {
        if at == 3 {
            Err(SnapshotError::Truncated { len: 0 })
        } else {
            Ok(piece.to_vec())
        }
    });
    let mut seen = Seen::default();
    assert!(crate::snapshot::decode_pieces(bytes.len() as u64, failing, &mut seen).is_err());
}

#[test]
fn the_loose_writer_is_really_loose_and_the_spliced_body_is_a_snapshot() {
    let file = file(
        &[
            ("a".into(), 1, vec![(0, 7)], 0, 0),
            ("b".into(), 2, vec![], 1, 5),
        ],
        1,
    );
    // Spliced with no loose object, the body is the writer's own.
    let canonical = body_with_loose_objects(&file, &[]);
    assert_eq!(canonical, file.encode().unwrap()[8..]);
    let mut seen = Seen::default();
    assert!(super::read_object(
        &mut crate::msgpack::CanonicalReader::new(&loose_object(&file.objects[0])),
        &mut Vec::new()
    )
    .is_none());
    let body = body_with_loose_objects(&file, &[1]);
    let header = decode_body_with_serde(&body, &mut seen, usize::MAX).unwrap();
    assert_eq!(header, file.header());
    assert_eq!(seen.objects, file.objects);
}
