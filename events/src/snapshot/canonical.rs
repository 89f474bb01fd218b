//! A snapshot body read straight from its canonical encoding (the bytes
//! [`encode_from`](super::encode_from) writes): the header's fields as a
//! fixmap of one-letter names, then each object in one pass over its bytes,
//! without serde's visitor calls. It is a restore's hot path: at 10 M objects
//! serde's calls were a fifth of the decoding thread's time.
//!
//! It decides nothing on its own. A header in any other form is left whole to
//! the serde decoder ([`decode_body`] answers `None` before the visitor has
//! seen anything); an object in any other form (another integer or map form,
//! an unknown or repeated field, a missing one) is read by serde from there
//! on, so both paths accept the same bodies and fail on the same object with
//! the same error kind. The tests check that against the serde decoder.

use serde::de::DeserializeSeed as _;
use serde::Deserialize as _;

use super::visit::{hand_over, ObjectFields, ObjectSeed};
use super::{SegmentRecord, SnapshotError, SnapshotHeader, SnapshotVisitor, SNAPSHOT_VERSION};
use crate::msgpack::{first_time, CanonicalReader as Reader};

/// Reads a snapshot body (the bytes after its checksum) into `visitor`,
/// announcing at most `max_objects`; `None` when the header is not in its
/// canonical form (the visitor has then seen nothing, and serde decides).
pub(super) fn decode_body<V: SnapshotVisitor>(
    body: &[u8],
    visitor: &mut V,
    max_objects: usize,
) -> Option<Result<SnapshotHeader, SnapshotError>> {
    let mut reader = Reader::new(body);
    let header = read_header(&mut reader)?;
    let count = reader.array_len()?;
    announce(visitor, &header, count, max_objects);
    let segments = header.segments.len();
    let mut replicas = Vec::new();
    for read in 0..count {
        let start = reader.rest;
        match read_object(&mut reader, &mut replicas) {
            Some(fields) => {
                if let Err(error) = hand_over(visitor, &fields, &replicas, segments) {
                    return Some(Err(error));
                }
            }
            None => {
                let left = count - read;
                return Some(serde_objects(start, left, &header, visitor).map(|()| header));
            }
        }
    }
    Some(Ok(header))
}

/// Hands `visitor` the header and how many objects follow: `count`, but at
/// most `max_objects` (what the body's length can hold).
pub(super) fn announce<V: SnapshotVisitor>(
    visitor: &mut V,
    header: &SnapshotHeader,
    count: u64,
    max_objects: usize,
) {
    let announced = usize::try_from(count)
        .unwrap_or(usize::MAX)
        .min(max_objects);
    visitor.header(header, announced);
}

/// The header: a fixmap of five entries, `v`, `q`, `e` and `g` in any order,
/// then `o` (whose array the reader is left at); `None` for anything else, or
/// a version this build does not read (serde names it).
pub(super) fn read_header(reader: &mut Reader<'_>) -> Option<SnapshotHeader> {
    if reader.fixmap_len()? != 5 {
        return None;
    }
    let (mut version, mut covers_seq, mut max_epoch, mut segments) = (0, 0, 0, Vec::new());
    let mut seen = 0u8;
    for _ in 0..4 {
        let bit = match reader.name()? {
            b'v' => {
                version = u16::try_from(reader.uint()?).ok()?;
                1
            }
            b'q' => {
                covers_seq = reader.uint()?;
                2
            }
            b'e' => {
                max_epoch = reader.uint()?;
                4
            }
            b'g' => {
                // Few and small: serde reads them, from where the cursor is,
                // and leaves the cursor after them.
                let mut rest = reader.rest;
                let mut deserializer = rmp_serde::Deserializer::new(&mut rest);
                segments = Vec::<SegmentRecord>::deserialize(&mut deserializer).ok()?;
                reader.rest = rest;
                8
            }
            _ => return None,
        };
        first_time(&mut seen, bit)?;
    }
    (version == SNAPSHOT_VERSION && reader.name()? == b'o').then_some(SnapshotHeader {
        version,
        covers_seq,
        max_epoch,
        segments,
    })
}

/// One object in its canonical form: a fixmap of `k`, `s`, `c`, `p` (an array
/// of `[segment index, offset]` pairs, into `replicas`), `f` and optionally
/// `i`, in any order; `None` for anything else.
#[inline]
pub(super) fn read_object<'a>(
    reader: &mut Reader<'a>,
    replicas: &mut Vec<(u32, u64)>,
) -> Option<ObjectFields<'a>> {
    let fields = reader.fixmap_len()?;
    let mut seen = 0u8;
    let mut object = ObjectFields {
        key: "",
        size: 0,
        checksum: 0,
        flags: 0,
        put_id: 0,
    };
    for _ in 0..fields {
        let bit = match reader.name()? {
            b'k' => {
                object.key = reader.str()?;
                1
            }
            b's' => {
                object.size = reader.uint()?;
                2
            }
            b'c' => {
                object.checksum = reader.uint()?;
                4
            }
            b'p' => {
                read_replicas(reader, replicas)?;
                8
            }
            b'f' => {
                object.flags = u32::try_from(reader.uint()?).ok()?;
                16
            }
            b'i' => {
                object.put_id = reader.uint()?;
                32
            }
            _ => return None,
        };
        first_time(&mut seen, bit)?;
    }
    // k, s, c, p and f are required; i defaults to 0.
    (seen & 0b1_1111 == 0b1_1111).then_some(object)
}

/// An object's replicas: an array of two-element arrays.
#[inline]
fn read_replicas(reader: &mut Reader<'_>, replicas: &mut Vec<(u32, u64)>) -> Option<()> {
    replicas.clear();
    for _ in 0..reader.array_len()? {
        if reader.byte()? != 0x92 {
            return None;
        }
        let index = u32::try_from(reader.uint()?).ok()?;
        replicas.push((index, reader.uint()?));
    }
    Some(())
}

/// The last `left` objects, from `rest` on, read by serde.
pub(super) fn serde_objects<V: SnapshotVisitor>(
    rest: &[u8],
    left: u64,
    header: &SnapshotHeader,
    visitor: &mut V,
) -> Result<(), SnapshotError> {
    let segments = header.segments.len();
    let mut deserializer = rmp_serde::Deserializer::from_read_ref(rest);
    let mut replicas = Vec::new();
    for _ in 0..left {
        let fields = ObjectSeed {
            replicas: &mut replicas,
        }
        .deserialize(&mut deserializer)
        .map_err(SnapshotError::Malformed)?;
        hand_over(visitor, &fields, &replicas, segments)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
