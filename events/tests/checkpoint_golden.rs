//! The projection checkpoint format: pinned bytes (a change here makes every stored
//! checkpoint unreadable), the same bytes built by hand from the documented layout,
//! older headers, and bad input of every shape (typed errors, never panics).
#![allow(clippy::unwrap_used)]

use hkvm_events::checkpoint::{
    Checkpoint, CheckpointError, CheckpointErrorKind, CheckpointHeader, CheckpointReader,
    CheckpointSource, MAGIC,
};
use hkvm_events::{NodeId, SegmentId, SubclusterId};
use proptest::prelude::*;
use roaring::RoaringBitmap;

/// Two sources (one with segments and a snapshot, one bare), four ids of which
/// one is free, and a bitmap per source.
fn golden() -> Checkpoint {
    Checkpoint {
        sources: vec![
            CheckpointSource {
                subcluster: Some(SubclusterId::new("sc-a").unwrap()),
                stream: "hkvm_c1_sc-a".to_owned(),
                applied_seq: 7,
                applied_unix_ms: 1_700_000_000_123,
                stream_epoch: 42,
                segments: vec![
                    (
                        SegmentId::new("seg-1").unwrap(),
                        NodeId::new("n1").unwrap(),
                        4096,
                    ),
                    (
                        SegmentId::new("seg-2").unwrap(),
                        NodeId::new("n2").unwrap(),
                        8192,
                    ),
                ],
                snapshot: Some((5, "snap-a".to_owned())),
            },
            CheckpointSource {
                subcluster: Some(SubclusterId::new("sc-b").unwrap()),
                stream: "hkvm_c1_sc-b".to_owned(),
                applied_seq: 3,
                applied_unix_ms: 1_700_000_000_456,
                stream_epoch: 0,
                segments: Vec::new(),
                snapshot: None,
            },
        ],
        hashes: vec![0x1111, 0x2222, 0x3333, 0x4444],
        masks: vec![0b11, 0b01, 0b10, 0],
        free: vec![3],
        bitmaps: vec![[0, 1].into_iter().collect(), [0, 2].into_iter().collect()],
    }
}

/// The bytes of [`golden`], section by section.
const GOLDEN: &str = concat!(
    // magic "HKVMPRJ1"
    "484b564d50524a31",
    // header length: 273
    "11010000",
    // header: map of 3, "sources": array of 2
    "83a7736f7572636573",
    "92",
    // source 0: map of 7 (subcluster, stream, applied_seq, applied_unix_ms,
    // stream_epoch, segments, snapshot)
    "87aa737562636c7573746572a473632d61a673747265616dac686b766d5f63315f73632d61",
    "ab6170706c6965645f73657107af6170706c6965645f756e69785f6d73cf0000018bcfe5687b",
    "ac73747265616d5f65706f63682aa87365676d656e74739293a57365672d31a26e31cd1000",
    "93a57365672d32a26e32cd2000a8736e617073686f749205a6736e61702d61",
    // source 1
    "87aa737562636c7573746572a473632d62a673747265616dac686b766d5f63315f73632d62",
    "ab6170706c6965645f73657103af6170706c6965645f756e69785f6d73cf0000018bcfe569c8",
    "ac73747265616d5f65706f636800a87365676d656e747390a8736e617073686f74c0",
    // "ids": 4, "free": 1
    "a369647304a46672656501",
    // hashes, u64 x 4
    "1111000000000000222200000000000033330000000000004444000000000000",
    // masks, u32 x 4
    "03000000010000000200000000000000",
    // free ids, u32 x 1
    "03000000",
    // bitmap of source 0: length 20, portable roaring {0, 1}
    "14000000",
    "3a30000001000000000001001000000000000100",
    // bitmap of source 1: length 20, portable roaring {0, 2}
    "14000000",
    "3a30000001000000000001001000000000000200",
    // xxh3-64 of everything above
    "5c81028251ac6b53",
);

/// The bytes of a checkpoint with no source and no id.
const GOLDEN_EMPTY: &str = concat!(
    "484b564d50524a31",
    "15000000",
    "83a7736f757263657390a369647300a46672656500",
    "faf9e13c219c600c",
);

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(hex: &str) -> Vec<u8> {
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn golden_bytes_are_pinned() {
    assert_eq!(hex(&golden().encode().unwrap()), GOLDEN);
    assert_eq!(hex(&Checkpoint::default().encode().unwrap()), GOLDEN_EMPTY);
}

#[test]
fn golden_bytes_decode_to_the_checkpoint() {
    let bytes = unhex(GOLDEN);
    assert_eq!(Checkpoint::decode(&bytes).unwrap(), golden());
    let header = CheckpointHeader::read(&bytes).unwrap();
    assert_eq!(header.sources, golden().sources);
    assert_eq!((header.ids, header.free), (4, 1));
    assert_eq!(
        Checkpoint::decode(&unhex(GOLDEN_EMPTY)).unwrap(),
        Checkpoint::default()
    );
}

// ---- the same bytes, built from the documented layout -------------------------

fn write_str(out: &mut Vec<u8>, value: &str) {
    rmp::encode::write_str(out, value).unwrap();
}

fn write_uint(out: &mut Vec<u8>, value: u64) {
    rmp::encode::write_uint(out, value).unwrap();
}

/// A source's header map; without `stream_epoch` when `epoch` is `None` (as
/// written before that field existed).
fn write_source(out: &mut Vec<u8>, source: &CheckpointSource, epoch: Option<u64>) {
    rmp::encode::write_map_len(out, if epoch.is_some() { 7 } else { 6 }).unwrap();
    write_str(out, "subcluster");
    match &source.subcluster {
        Some(subcluster) => write_str(out, subcluster.as_str()),
        None => rmp::encode::write_nil(out).unwrap(),
    }
    write_str(out, "stream");
    write_str(out, &source.stream);
    write_str(out, "applied_seq");
    write_uint(out, source.applied_seq);
    write_str(out, "applied_unix_ms");
    write_uint(out, source.applied_unix_ms);
    if let Some(epoch) = epoch {
        write_str(out, "stream_epoch");
        write_uint(out, epoch);
    }
    write_str(out, "segments");
    rmp::encode::write_array_len(out, source.segments.len() as u32).unwrap();
    for (segment, node, size) in &source.segments {
        rmp::encode::write_array_len(out, 3).unwrap();
        write_str(out, segment.as_str());
        write_str(out, node.as_str());
        write_uint(out, *size);
    }
    write_str(out, "snapshot");
    match &source.snapshot {
        Some((seq, object)) => {
            rmp::encode::write_array_len(out, 2).unwrap();
            write_uint(out, *seq);
            write_str(out, object);
        }
        None => rmp::encode::write_nil(out).unwrap(),
    }
}

/// A roaring bitmap of values below 2^16 in the portable format, without run
/// containers: cookie 12346, one container (key 0, cardinality - 1), its offset,
/// then the values as u16.
fn portable_bitmap(values: &[u16]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&12346u32.to_le_bytes());
    out.extend_from_slice(&1u32.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&(values.len() as u16 - 1).to_le_bytes());
    out.extend_from_slice(&16u32.to_le_bytes());
    for value in values {
        out.extend_from_slice(&value.to_le_bytes());
    }
    out
}

/// The golden checkpoint by the layout, field by field; `epochs` false leaves
/// `stream_epoch` out of every source.
fn golden_by_layout(epochs: bool) -> Vec<u8> {
    let checkpoint = golden();
    let mut header = Vec::new();
    rmp::encode::write_map_len(&mut header, 3).unwrap();
    write_str(&mut header, "sources");
    rmp::encode::write_array_len(&mut header, 2).unwrap();
    for source in &checkpoint.sources {
        write_source(&mut header, source, epochs.then_some(source.stream_epoch));
    }
    write_str(&mut header, "ids");
    write_uint(&mut header, 4);
    write_str(&mut header, "free");
    write_uint(&mut header, 1);

    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    out.extend_from_slice(&header);
    for hash in [0x1111u64, 0x2222, 0x3333, 0x4444] {
        out.extend_from_slice(&hash.to_le_bytes());
    }
    for mask in [3u32, 1, 2, 0] {
        out.extend_from_slice(&mask.to_le_bytes());
    }
    out.extend_from_slice(&3u32.to_le_bytes());
    for values in [[0u16, 1], [0, 2]] {
        let bitmap = portable_bitmap(&values);
        out.extend_from_slice(&(bitmap.len() as u32).to_le_bytes());
        out.extend_from_slice(&bitmap);
    }
    seal(out)
}

/// Appends the xxh3-64 checksum of `body`.
fn seal(mut body: Vec<u8>) -> Vec<u8> {
    let sum = xxhash_rust::xxh3::xxh3_64(&body);
    body.extend_from_slice(&sum.to_le_bytes());
    body
}

#[test]
fn golden_bytes_follow_the_documented_layout() {
    assert_eq!(hex(&golden_by_layout(true)), GOLDEN);
}

#[test]
fn headers_without_stream_epoch_read_as_epoch_zero() {
    let decoded = Checkpoint::decode(&golden_by_layout(false)).unwrap();
    let mut expected = golden();
    expected.sources[0].stream_epoch = 0;
    assert_eq!(decoded, expected);
}

#[test]
fn every_cut_and_every_bit_flip_of_the_golden_bytes_is_refused() {
    let bytes = unhex(GOLDEN);
    for cut in 0..bytes.len() {
        assert!(Checkpoint::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        assert!(
            CheckpointHeader::read(&bytes[..cut]).is_err(),
            "cut at {cut}"
        );
    }
    for bit in 0..bytes.len() * 8 {
        let mut flipped = bytes.clone();
        flipped[bit / 8] ^= 1 << (bit % 8);
        let error = Checkpoint::decode(&flipped).unwrap_err();
        assert!(
            matches!(
                error.kind(),
                CheckpointErrorKind::ChecksumMismatch | CheckpointErrorKind::BadMagic
            ),
            "bit {bit}: {error}"
        );
    }
}

// ---- generated checkpoints and hostile bytes ----------------------------------

fn name() -> impl Strategy<Value = String> {
    "x[a-z0-9_-]{0,7}"
}

fn source() -> impl Strategy<Value = CheckpointSource> {
    (
        prop::option::of(name()),
        ".{0,12}",
        any::<[u64; 3]>(),
        prop::collection::vec((name(), name(), any::<u64>()), 0..3),
        prop::option::of((any::<u64>(), ".{0,8}")),
    )
        .prop_map(
            |(subcluster, stream, [seq, unix_ms, epoch], segments, snapshot)| CheckpointSource {
                subcluster: subcluster.map(|s| SubclusterId::new(s).unwrap()),
                stream,
                applied_seq: seq,
                applied_unix_ms: unix_ms,
                stream_epoch: epoch,
                segments: segments
                    .into_iter()
                    .map(|(segment, node, size)| {
                        (
                            SegmentId::new(segment).unwrap(),
                            NodeId::new(node).unwrap(),
                            size,
                        )
                    })
                    .collect(),
                snapshot,
            },
        )
}

/// Scattered values over a few containers, sometimes a long range, sometimes
/// run-compressed.
fn bitmap() -> impl Strategy<Value = RoaringBitmap> {
    (
        prop::collection::vec(0u32..200_000, 0..24),
        prop::option::of((0u32..200_000, 0u32..6_000)),
        any::<bool>(),
    )
        .prop_map(|(values, range, optimize)| {
            let mut bitmap: RoaringBitmap = values.into_iter().collect();
            if let Some((start, len)) = range {
                bitmap.insert_range(start..start + len);
            }
            if optimize {
                bitmap.optimize();
            }
            bitmap
        })
}

fn checkpoint() -> impl Strategy<Value = Checkpoint> {
    (
        prop::collection::vec(source(), 0..4),
        prop::collection::vec((any::<u64>(), any::<u32>()), 0..16),
        prop::collection::vec(any::<u32>(), 0..4),
    )
        .prop_flat_map(|(sources, ids, free)| {
            let count = sources.len();
            (
                Just(sources),
                Just(ids),
                Just(free),
                prop::collection::vec(bitmap(), count..=count),
            )
        })
        .prop_map(|(sources, ids, free, bitmaps)| Checkpoint {
            sources,
            hashes: ids.iter().map(|&(hash, _)| hash).collect(),
            masks: ids.iter().map(|&(_, mask)| mask).collect(),
            free,
            bitmaps,
        })
}

/// A change to the bytes before the checksum.
#[derive(Debug, Clone)]
enum Mutation {
    Flip(prop::sample::Index, u8),
    Set(prop::sample::Index, u8),
    Cut(prop::sample::Index),
    Insert(prop::sample::Index, u8),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<prop::sample::Index>(), 0u8..8).prop_map(|(at, bit)| Mutation::Flip(at, bit)),
        (any::<prop::sample::Index>(), any::<u8>()).prop_map(|(at, b)| Mutation::Set(at, b)),
        any::<prop::sample::Index>().prop_map(Mutation::Cut),
        (any::<prop::sample::Index>(), any::<u8>()).prop_map(|(at, b)| Mutation::Insert(at, b)),
    ]
}

fn mutate(body: &mut Vec<u8>, mutation: &Mutation) {
    if body.is_empty() && !matches!(mutation, Mutation::Insert(..)) {
        return;
    }
    match mutation {
        Mutation::Flip(at, bit) => {
            let at = at.index(body.len());
            body[at] ^= 1 << bit;
        }
        Mutation::Set(at, byte) => {
            let at = at.index(body.len());
            body[at] = *byte;
        }
        Mutation::Cut(at) => body.truncate(at.index(body.len())),
        Mutation::Insert(at, byte) => body.insert(at.index(body.len() + 1), *byte),
    }
}

/// `bytes` fed to a [`CheckpointReader`] in pieces cut at `cuts` (positions,
/// any order, repeats allowed), declared `len` bytes long.
fn read_in_pieces(
    bytes: &[u8],
    len: u64,
    cuts: &[prop::sample::Index],
) -> Result<Checkpoint, CheckpointError> {
    let mut cuts: Vec<usize> = cuts.iter().map(|cut| cut.index(bytes.len() + 1)).collect();
    cuts.push(bytes.len());
    cuts.sort_unstable();
    let mut reader = CheckpointReader::new(len)?;
    let mut from = 0;
    for cut in cuts {
        reader.feed(&bytes[from..cut])?;
        from = cut;
    }
    reader.finish()
}

fn pieces() -> impl Strategy<Value = Vec<prop::sample::Index>> {
    prop::collection::vec(any::<prop::sample::Index>(), 0..12)
}

proptest! {
    /// Read in pieces, a checkpoint decodes to what it decodes to whole; any
    /// bytes that fail whole fail in pieces (maybe as another kind: a piece
    /// can show the damage before the checksum comes).
    #[test]
    fn reading_in_pieces_agrees_with_decoding_whole(
        checkpoint in checkpoint(),
        mutations in prop::collection::vec(mutation(), 0..3),
        reseal in any::<bool>(),
        cuts in pieces(),
    ) {
        let mut bytes = checkpoint.encode().unwrap();
        if reseal {
            bytes.truncate(bytes.len() - 8);
            for mutation in &mutations {
                mutate(&mut bytes, mutation);
            }
            bytes = seal(bytes);
        } else {
            for mutation in &mutations {
                mutate(&mut bytes, mutation);
            }
        }
        let whole = Checkpoint::decode(&bytes);
        let pieces = read_in_pieces(&bytes, bytes.len() as u64, &cuts);
        match (&whole, &pieces) {
            (Ok(whole), Ok(pieces)) => prop_assert_eq!(whole, pieces),
            (Err(_), Err(_)) => {}
            _ => prop_assert!(false, "whole {:?}, in pieces {:?}", whole, pieces),
        }
        if mutations.is_empty() {
            prop_assert_eq!(pieces.unwrap(), checkpoint);
        }
    }

    /// A stream that ends early or runs on past its declared length is
    /// refused, whatever its pieces.
    #[test]
    fn a_stream_of_another_length_than_declared_is_refused(
        checkpoint in checkpoint(),
        cut in any::<prop::sample::Index>(),
        extra in 1u64..64,
        cuts in pieces(),
    ) {
        let bytes = checkpoint.encode().unwrap();
        let len = bytes.len() as u64;
        let short = &bytes[..cut.index(bytes.len())];
        let error = read_in_pieces(short, len, &cuts).unwrap_err();
        prop_assert!(
            matches!(error.kind(), CheckpointErrorKind::Truncated),
            "{}", error
        );
        // Declared shorter than it is: the sections outrun the declared body,
        // or bytes come after its checksum.
        prop_assert!(read_in_pieces(&bytes, len - extra.min(len), &cuts).is_err());
        let mut longer = bytes.clone();
        longer.extend(std::iter::repeat_n(0u8, extra as usize));
        prop_assert!(read_in_pieces(&longer, len, &cuts).is_err());
    }

    #[test]
    fn generated_checkpoints_round_trip(checkpoint in checkpoint()) {
        let bytes = checkpoint.encode().unwrap();
        prop_assert_eq!(&Checkpoint::decode(&bytes).unwrap(), &checkpoint);
        let header = CheckpointHeader::read(&bytes).unwrap();
        prop_assert_eq!(&header.sources, &checkpoint.sources);
        prop_assert_eq!(header.ids, checkpoint.hashes.len() as u64);
    }

    #[test]
    fn arbitrary_bytes_are_refused(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        prop_assert!(Checkpoint::decode(&bytes).is_err());
        prop_assert!(CheckpointHeader::read(&bytes).is_err());
        let mut prefixed = MAGIC.to_vec();
        prefixed.extend_from_slice(&bytes);
        prop_assert!(Checkpoint::decode(&prefixed).is_err());
    }

    #[test]
    fn truncated_checkpoints_are_refused(
        checkpoint in checkpoint(),
        cut in any::<prop::sample::Index>(),
    ) {
        let bytes = checkpoint.encode().unwrap();
        let cut = cut.index(bytes.len());
        prop_assert!(Checkpoint::decode(&bytes[..cut]).is_err());
    }

    #[test]
    fn a_flipped_bit_is_always_refused(
        checkpoint in checkpoint(),
        at in any::<prop::sample::Index>(),
        bit in 0u8..8,
    ) {
        let mut bytes = checkpoint.encode().unwrap();
        let at = at.index(bytes.len());
        bytes[at] ^= 1 << bit;
        let error = Checkpoint::decode(&bytes).unwrap_err();
        prop_assert!(matches!(
            error.kind(),
            CheckpointErrorKind::ChecksumMismatch | CheckpointErrorKind::BadMagic
        ));
    }

    /// Past the checksum (the corruption re-sealed): still a typed error or a
    /// checkpoint that round-trips, never a panic.
    #[test]
    fn resealed_corruption_never_panics(
        checkpoint in checkpoint(),
        mutations in prop::collection::vec(mutation(), 1..4),
    ) {
        let bytes = checkpoint.encode().unwrap();
        let mut body = bytes[..bytes.len() - 8].to_vec();
        for mutation in &mutations {
            mutate(&mut body, mutation);
        }
        let bytes = seal(body);
        let _ = CheckpointHeader::read(&bytes);
        if let Ok(decoded) = Checkpoint::decode(&bytes) {
            let again = Checkpoint::decode(&decoded.encode().unwrap()).unwrap();
            prop_assert_eq!(again, decoded);
        }
    }
}
