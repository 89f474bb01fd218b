//! Encoding a snapshot from borrowed parts: the header, and objects handed over
//! one at a time by their holder ([`SnapshotSource`]). A sub-master encodes its
//! state this way with no list of records in between: at 10 M objects that list
//! is about a gigabyte of fresh memory, plus one allocation per object, that
//! the encoding would only read once. [`SnapshotFile::encode`](super::SnapshotFile::encode)
//! is this encoder over its own records, so there is one encoding.

use serde::ser::{Error as _, SerializeSeq, SerializeStruct};
use serde::{Serialize, Serializer};

use super::{ObjectRecord, ObjectView, SnapshotError, SnapshotHeader};

/// What [`encode_from`] reads a snapshot's objects from.
pub trait SnapshotSource {
    /// How many objects [`SnapshotSource::for_each_object`] hands over.
    fn object_count(&self) -> usize;

    /// About how many bytes the encoded objects take; the buffer is sized once
    /// from it. Erring high costs only address space, never touched memory.
    fn encoded_len_hint(&self) -> usize {
        self.object_count().saturating_mul(128)
    }

    /// Hands every object to `each`, oldest first, until `each` returns `false`.
    fn for_each_object(&self, each: &mut dyn FnMut(ObjectView<'_>) -> bool);
}

impl SnapshotSource for [ObjectRecord] {
    fn object_count(&self) -> usize {
        self.len()
    }

    fn encoded_len_hint(&self) -> usize {
        self.iter()
            .map(|object| object.key.len() + 48 + 12 * object.replicas.len())
            .sum()
    }

    fn for_each_object(&self, each: &mut dyn FnMut(ObjectView<'_>) -> bool) {
        for object in self {
            let view = ObjectView {
                key: &object.key,
                size: object.size,
                checksum: object.checksum,
                replicas: &object.replicas,
                flags: object.flags,
                put_id: object.put_id,
            };
            if !each(view) {
                return;
            }
        }
    }
}

/// Encodes the snapshot made of `header` and the objects of `source`:
/// `xxh3-64(body)` as 8 big-endian bytes, then the body, in one buffer.
///
/// # Errors
/// [`SnapshotError::Encode`] when serialization fails, or when `source` hands
/// over a different number of objects than it counted.
pub fn encode_from<S: SnapshotSource + ?Sized>(
    header: &SnapshotHeader,
    source: &S,
) -> Result<Vec<u8>, SnapshotError> {
    let segments_hint = header
        .segments
        .iter()
        .map(|segment| 96 + segment.node.as_str().len() + segment.endpoint.len())
        .sum::<usize>();
    let mut bytes = Vec::with_capacity(
        64usize
            .saturating_add(segments_hint)
            .saturating_add(source.encoded_len_hint()),
    );
    // Room for the checksum, written once the body is.
    bytes.extend_from_slice(&[0; 8]);
    let body = Body {
        header,
        objects: Objects(source),
    };
    rmp_serde::encode::write_named(&mut bytes, &body).map_err(SnapshotError::Encode)?;
    let sum = xxhash_rust::xxh3::xxh3_64(&bytes[8..]);
    bytes[..8].copy_from_slice(&sum.to_be_bytes());
    Ok(bytes)
}

/// The body: the named-field map of [`SnapshotFile`](super::SnapshotFile), its
/// fields in the same order under the same names.
struct Body<'a, S: ?Sized> {
    header: &'a SnapshotHeader,
    objects: Objects<'a, S>,
}

impl<S: SnapshotSource + ?Sized> Serialize for Body<'_, S> {
    fn serialize<Z: Serializer>(&self, serializer: Z) -> Result<Z::Ok, Z::Error> {
        let mut body = serializer.serialize_struct("SnapshotFile", 5)?;
        body.serialize_field("v", &self.header.version)?;
        body.serialize_field("q", &self.header.covers_seq)?;
        body.serialize_field("e", &self.header.max_epoch)?;
        body.serialize_field("g", &self.header.segments)?;
        body.serialize_field("o", &self.objects)?;
        body.end()
    }
}

/// The objects of a source, as the sequence of records the body holds.
struct Objects<'a, S: ?Sized>(&'a S);

impl<S: SnapshotSource + ?Sized> Serialize for Objects<'_, S> {
    fn serialize<Z: Serializer>(&self, serializer: Z) -> Result<Z::Ok, Z::Error> {
        let count = self.0.object_count();
        let mut sequence = serializer.serialize_seq(Some(count))?;
        let mut written = 0usize;
        let mut failed = None;
        self.0.for_each_object(&mut |object| {
            if written == count {
                failed = Some(Z::Error::custom(
                    "the source handed over more objects than it counted",
                ));
                return false;
            }
            match sequence.serialize_element(&Record(object)) {
                Ok(()) => {
                    written += 1;
                    true
                }
                Err(error) => {
                    failed = Some(error);
                    false
                }
            }
        });
        if let Some(error) = failed {
            return Err(error);
        }
        if written != count {
            return Err(Z::Error::custom(format!(
                "the source handed over {written} objects of the {count} it counted"
            )));
        }
        sequence.end()
    }
}

/// One object as [`ObjectRecord`] encodes it.
struct Record<'a>(ObjectView<'a>);

impl Serialize for Record<'_> {
    fn serialize<Z: Serializer>(&self, serializer: Z) -> Result<Z::Ok, Z::Error> {
        let object = &self.0;
        let with_put_id = object.put_id != 0;
        let mut record =
            serializer.serialize_struct("ObjectRecord", 5 + usize::from(with_put_id))?;
        record.serialize_field("k", object.key)?;
        record.serialize_field("s", &object.size)?;
        record.serialize_field("c", &object.checksum)?;
        record.serialize_field("p", object.replicas)?;
        record.serialize_field("f", &object.flags)?;
        if with_put_id {
            record.serialize_field("i", &object.put_id)?;
        } else {
            record.skip_field("i")?;
        }
        record.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::generated::file;
    use crate::snapshot::SnapshotFile;

    /// The derived serialization of the whole file: the format's definition.
    fn derived(file: &SnapshotFile) -> Vec<u8> {
        let mut body = Vec::new();
        rmp_serde::encode::write_named(&mut body, file).unwrap_or_else(|_| unreachable!());
        let mut bytes = xxhash_rust::xxh3::xxh3_64(&body).to_be_bytes().to_vec();
        bytes.extend_from_slice(&body);
        bytes
    }

    proptest::proptest! {
        /// Objects handed over one at a time encode byte for byte as the
        /// derived serialization of the same records.
        #[test]
        fn encoding_from_a_source_is_the_derived_encoding(
            objects in proptest::collection::vec(
                (
                    "[a-z0-9/]{1,40}",
                    proptest::num::u64::ANY,
                    proptest::collection::vec((0u32..4, proptest::num::u64::ANY), 0..4),
                    0u32..4,
                    proptest::prop_oneof![proptest::strategy::Just(0u64), proptest::num::u64::ANY],
                ),
                0..30,
            ),
            segments in 0usize..4,
        ) {
            let file = file(&objects, segments);
            proptest::prop_assert_eq!(file.encode().unwrap_or_default(), derived(&file));
        }
    }

    /// A source that hands over `given` objects after counting `counted`.
    struct Miscounted {
        counted: usize,
        given: usize,
    }

    impl SnapshotSource for Miscounted {
        fn object_count(&self) -> usize {
            self.counted
        }

        fn for_each_object(&self, each: &mut dyn FnMut(ObjectView<'_>) -> bool) {
            for _ in 0..self.given {
                let view = ObjectView {
                    key: "k",
                    size: 1,
                    checksum: 2,
                    replicas: &[],
                    flags: 0,
                    put_id: 0,
                };
                if !each(view) {
                    return;
                }
            }
        }
    }

    #[test]
    fn a_source_that_miscounts_is_an_error_not_a_malformed_snapshot() {
        let header = SnapshotFile::new(1, 1).header();
        for (counted, given) in [(3, 2), (2, 3), (1, 0)] {
            let encoded = encode_from(&header, &Miscounted { counted, given });
            assert!(
                matches!(encoded, Err(SnapshotError::Encode(_))),
                "{counted} counted, {given} given"
            );
        }
        assert!(encode_from(
            &header,
            &Miscounted {
                counted: 2,
                given: 2
            }
        )
        .is_ok());
    }
}
