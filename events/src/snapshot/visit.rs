//! Streaming decode of a snapshot body: its header, then one call per object
//! with the key borrowed from the snapshot's bytes and the replicas from a
//! buffer the decoder reuses. A restore builds its state straight from the
//! bytes this way, with no list of records in between and no allocation per
//! record; [`SnapshotFile::decode`](super::SnapshotFile::decode) is the same
//! decoder collecting the records.
//!
//! The body is the named-field map the writer produces, header fields before
//! the objects (`v`, `q`, `e`, `g`, then `o`); unknown fields are skipped.

use std::fmt;

use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::{SegmentRecord, SnapshotError, SNAPSHOT_VERSION};

/// The fewest bytes one encoded object takes (a map of its five required
/// fields, each a one-letter name and at least a one-byte value): a count
/// announced by the body is trusted only up to what its length can hold.
pub(super) const MIN_OBJECT_BYTES: usize = 16;

/// Everything in a snapshot but its objects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotHeader {
    /// The format version ([`SNAPSHOT_VERSION`]).
    pub version: u16,
    /// The last stream sequence whose events it includes.
    pub covers_seq: u64,
    /// The highest leader epoch seen.
    pub max_epoch: u64,
    /// Every mounted segment.
    pub segments: Vec<SegmentRecord>,
}

/// One object of a snapshot being decoded, borrowed from the decoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObjectView<'a> {
    /// Its key.
    pub key: &'a str,
    /// Its size in bytes.
    pub size: u64,
    /// xxh3-64 of its value.
    pub checksum: u64,
    /// (index into [`SnapshotHeader::segments`], offset) per replica; every
    /// index has been checked to name a segment.
    pub replicas: &'a [(u32, u64)],
    /// Its [`PutFlags`](crate::PutFlags) bits.
    pub flags: u32,
    /// The id of the put that committed it (0: none).
    pub put_id: u64,
}

impl ObjectView<'_> {
    /// The object as an owned record.
    pub fn to_record(&self) -> super::ObjectRecord {
        super::ObjectRecord {
            key: self.key.into(),
            size: self.size,
            checksum: self.checksum,
            replicas: self.replicas.to_vec(),
            flags: self.flags,
            put_id: self.put_id,
        }
    }
}

/// What a streaming decode hands each part of a snapshot to.
pub trait SnapshotVisitor {
    /// Called once, before any object, with the header and how many objects
    /// follow (a hint, bounded by the body's length).
    fn header(&mut self, header: &SnapshotHeader, objects: usize);
    /// Called for each object, oldest first.
    fn object(&mut self, object: ObjectView<'_>);
}

/// [`decode_body`](super::decode_body) through serde alone: the decoder of every form, and the
/// reference the canonical reader is tested against.
pub(super) fn decode_body_with_serde<V: SnapshotVisitor>(
    body: &[u8],
    visitor: &mut V,
    max_objects: usize,
) -> Result<SnapshotHeader, SnapshotError> {
    let mut failure = None;
    let seed = FileSeed {
        visitor,
        failure: &mut failure,
        max_objects,
    };
    let mut deserializer = rmp_serde::Deserializer::from_read_ref(body);
    seed.deserialize(&mut deserializer)
        .map_err(|error| failure.take().unwrap_or(SnapshotError::Malformed(error)))
}

/// The whole body. A typed error found inside the decode (an unknown version, a
/// bad segment index) is parked in `failure` and returned instead of the
/// decoder's generic one.
struct FileSeed<'v, V> {
    visitor: &'v mut V,
    failure: &'v mut Option<SnapshotError>,
    max_objects: usize,
}

impl<'de, V: SnapshotVisitor> DeserializeSeed<'de> for FileSeed<'_, V> {
    type Value = SnapshotHeader;

    fn deserialize<D: de::Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de, V: SnapshotVisitor> Visitor<'de> for FileSeed<'_, V> {
    type Value = SnapshotHeader;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a snapshot map")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let (mut version, mut covers_seq, mut max_epoch, mut segments) = (None, None, None, None);
        let mut header = None;
        while let Some(field) = map.next_key::<&'de str>()? {
            match field {
                "v" => {
                    let found: u16 = map.next_value()?;
                    if found != SNAPSHOT_VERSION {
                        *self.failure = Some(SnapshotError::UnknownVersion(found));
                        return Err(de::Error::custom("unknown snapshot version"));
                    }
                    version = Some(found);
                }
                "q" => covers_seq = Some(map.next_value()?),
                "e" => max_epoch = Some(map.next_value()?),
                "g" => segments = Some(map.next_value::<Vec<SegmentRecord>>()?),
                "o" if header.is_none() => {
                    let before = |name| de::Error::custom(format!("objects before field `{name}`"));
                    let decoded = SnapshotHeader {
                        version: version.ok_or_else(|| before("v"))?,
                        covers_seq: covers_seq.ok_or_else(|| before("q"))?,
                        max_epoch: max_epoch.ok_or_else(|| before("e"))?,
                        segments: segments.take().ok_or_else(|| before("g"))?,
                    };
                    map.next_value_seed(ObjectsSeed {
                        visitor: &mut *self.visitor,
                        failure: &mut *self.failure,
                        header: &decoded,
                        max_objects: self.max_objects,
                    })?;
                    header = Some(decoded);
                }
                "o" => return Err(de::Error::duplicate_field("o")),
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        header.ok_or_else(|| de::Error::missing_field("o"))
    }
}

/// The object list.
struct ObjectsSeed<'v, V> {
    visitor: &'v mut V,
    failure: &'v mut Option<SnapshotError>,
    header: &'v SnapshotHeader,
    max_objects: usize,
}

impl<'de, V: SnapshotVisitor> DeserializeSeed<'de> for ObjectsSeed<'_, V> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de, V: SnapshotVisitor> Visitor<'de> for ObjectsSeed<'_, V> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of objects")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let announced = seq.size_hint().unwrap_or(0).min(self.max_objects);
        self.visitor.header(self.header, announced);
        let segments = self.header.segments.len();
        let mut replicas = Vec::new();
        while let Some(fields) = seq.next_element_seed(ObjectSeed {
            replicas: &mut replicas,
        })? {
            if let Err(error) = hand_over(&mut *self.visitor, &fields, &replicas, segments) {
                *self.failure = Some(error);
                return Err(de::Error::custom("bad segment index"));
            }
        }
        Ok(())
    }
}

/// Checks that every replica of an object names one of the `segments`
/// segments, then hands the object to `visitor`.
///
/// # Errors
/// [`SnapshotError::BadSegmentIndex`] (the visitor has not seen the object).
#[inline]
pub(super) fn hand_over<V: SnapshotVisitor>(
    visitor: &mut V,
    fields: &ObjectFields<'_>,
    replicas: &[(u32, u64)],
    segments: usize,
) -> Result<(), SnapshotError> {
    if let Some(&(index, _)) = replicas
        .iter()
        .find(|(index, _)| *index as usize >= segments)
    {
        return Err(SnapshotError::BadSegmentIndex {
            key: fields.key.chars().take(64).collect(),
            index,
            segments,
        });
    }
    visitor.object(ObjectView {
        key: fields.key,
        size: fields.size,
        checksum: fields.checksum,
        replicas,
        flags: fields.flags,
        put_id: fields.put_id,
    });
    Ok(())
}

/// An object's fields but its replicas (which go to the reused buffer).
pub(super) struct ObjectFields<'de> {
    pub(super) key: &'de str,
    pub(super) size: u64,
    pub(super) checksum: u64,
    pub(super) flags: u32,
    pub(super) put_id: u64,
}

/// One object, its replicas decoded into a buffer the caller reuses.
pub(super) struct ObjectSeed<'b> {
    pub(super) replicas: &'b mut Vec<(u32, u64)>,
}

impl<'de> DeserializeSeed<'de> for ObjectSeed<'_> {
    type Value = ObjectFields<'de>;

    fn deserialize<D: de::Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for ObjectSeed<'_> {
    type Value = ObjectFields<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object map")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let (mut key, mut size, mut checksum, mut flags, mut put_id) = (None, None, None, None, 0);
        let mut has_replicas = false;
        while let Some(field) = map.next_key::<&'de str>()? {
            match field {
                "k" => key = Some(map.next_value::<&'de str>()?),
                "s" => size = Some(map.next_value()?),
                "c" => checksum = Some(map.next_value()?),
                "p" => {
                    map.next_value_seed(ReplicasSeed(&mut *self.replicas))?;
                    has_replicas = true;
                }
                "f" => flags = Some(map.next_value()?),
                "i" => put_id = map.next_value()?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        if !has_replicas {
            return Err(de::Error::missing_field("p"));
        }
        Ok(ObjectFields {
            key: key.ok_or_else(|| de::Error::missing_field("k"))?,
            size: size.ok_or_else(|| de::Error::missing_field("s"))?,
            checksum: checksum.ok_or_else(|| de::Error::missing_field("c"))?,
            flags: flags.ok_or_else(|| de::Error::missing_field("f"))?,
            put_id,
        })
    }
}

/// An object's replica list, decoded into the reused buffer.
struct ReplicasSeed<'b>(&'b mut Vec<(u32, u64)>);

impl<'de> DeserializeSeed<'de> for ReplicasSeed<'_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for ReplicasSeed<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of (segment index, offset)")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        self.0.clear();
        while let Some(replica) = seq.next_element::<(u32, u64)>()? {
            self.0.push(replica);
        }
        Ok(())
    }
}
