//! The sub-master snapshot format: the durable state of one sub-cluster (segments
//! and committed objects, oldest first) stamped with the stream sequence it covers,
//! as one self-checking blob (kept in a JetStream object store by `hkvm-log`).
//! The sub-master writes snapshots and restores its state from them; the global
//! master and the inter-DC master read them (through [`SnapshotFile`]) to seed a
//! source whose stream history was purged, without rebuilding a sub-master.
//!
//! Layout: `xxh3-64(body)` as 8 big-endian bytes, then the body: a named-field
//! MessagePack map [`SnapshotFile`] (`v` version, `q` covered sequence, `e` highest
//! leader epoch, `g` segments, `o` objects). Objects are `(k key, s size, c value
//! checksum, p [(segment index, offset)], f flags)`.
//!
//! Objects are named `<subcluster>.<covered sequence, 20 digits>` in the bucket
//! [`Bucket::Snapshots`](crate::subject::Bucket::Snapshots); lexical order is
//! sequence order.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::event::Placement;
use crate::id::{NodeId, SegmentId};

mod canonical;
mod check;
mod encode;
mod pieces;
mod visit;

pub use check::StoredCheck;
pub use encode::{encode_from, SnapshotSource};
pub use pieces::decode_pieces;
pub use visit::{ObjectView, SnapshotHeader, SnapshotVisitor};

/// The snapshot format version this build writes and reads.
pub const SNAPSHOT_VERSION: u16 = 1;
/// Snapshots kept per sub-cluster (older ones are deleted after a save).
pub const SNAPSHOTS_KEPT: usize = 2;

/// One mounted segment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentRecord {
    /// The node that contributes it.
    #[serde(rename = "n")]
    pub node: NodeId,
    /// Its id.
    #[serde(rename = "g")]
    pub segment: SegmentId,
    /// Its size in bytes.
    #[serde(rename = "s")]
    pub size: u64,
    /// Where its node serves transfers.
    #[serde(rename = "e")]
    pub endpoint: String,
    /// How peers reach it over RDMA (none: TCP only).
    #[serde(rename = "r", default, skip_serializing_if = "Option::is_none")]
    pub rdma: Option<crate::transport::RdmaEndpoint>,
}

/// One committed object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectRecord {
    /// Its key (shared: a sub-master's copy of its state and its restore move
    /// keys without copying them).
    #[serde(rename = "k")]
    pub key: Arc<str>,
    /// Its size in bytes.
    #[serde(rename = "s")]
    pub size: u64,
    /// xxh3-64 of its value.
    #[serde(rename = "c")]
    pub checksum: u64,
    /// (index into [`SnapshotFile::segments`], offset) per replica.
    #[serde(rename = "p")]
    pub replicas: Vec<(u32, u64)>,
    /// Its [`PutFlags`](crate::PutFlags) bits.
    #[serde(rename = "f")]
    pub flags: u32,
    /// The id of the put that committed it (0: none).
    #[serde(rename = "i", default, skip_serializing_if = "is_zero")]
    pub put_id: u64,
}

fn is_zero(value: &u64) -> bool {
    *value == 0
}

/// A whole snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotFile {
    /// The format version ([`SNAPSHOT_VERSION`]).
    #[serde(rename = "v")]
    pub version: u16,
    /// The last stream sequence whose events it includes.
    #[serde(rename = "q")]
    pub covers_seq: u64,
    /// The highest leader epoch seen.
    #[serde(rename = "e")]
    pub max_epoch: u64,
    /// Every mounted segment.
    #[serde(rename = "g")]
    pub segments: Vec<SegmentRecord>,
    /// Every committed object, oldest first (a restore keeps the eviction order).
    #[serde(rename = "o")]
    pub objects: Vec<ObjectRecord>,
}

/// Why a snapshot could not be encoded, decoded, stored or loaded.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// Fewer bytes than the checksum.
    #[error("snapshot of {len} bytes is shorter than its checksum")]
    Truncated {
        /// How many bytes there were.
        len: usize,
    },
    /// The body does not match its checksum.
    #[error("snapshot checksum mismatch: stored {stored:#018x}, computed {computed:#018x}")]
    ChecksumMismatch {
        /// The checksum carried.
        stored: u64,
        /// The checksum of the body.
        computed: u64,
    },
    /// A version this build does not read.
    #[error("unknown snapshot version {0}")]
    UnknownVersion(u16),
    /// An object names a segment index the snapshot does not have.
    #[error("object {key:?} names segment index {index} of {segments}")]
    BadSegmentIndex {
        /// The object's key.
        key: String,
        /// The index it carries.
        index: u32,
        /// How many segments the snapshot has.
        segments: usize,
    },
    /// The body is not a snapshot.
    #[error("malformed snapshot body")]
    Malformed(#[source] rmp_serde::decode::Error),
    /// The body could not be encoded.
    #[error("encoding a snapshot")]
    Encode(#[source] rmp_serde::encode::Error),
    /// The object store failed.
    #[error("snapshot store: {what}")]
    Store {
        /// What was being done.
        what: String,
        /// The JetStream error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// The kind of a [`SnapshotError`], for matching.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotErrorKind {
    /// The bytes are not a valid snapshot (truncated, corrupt, unknown version,
    /// inconsistent).
    Invalid,
    /// Encoding failed.
    Encode,
    /// The object store failed.
    Store,
}

impl SnapshotError {
    /// The kind.
    pub fn kind(&self) -> SnapshotErrorKind {
        match self {
            Self::Truncated { .. }
            | Self::ChecksumMismatch { .. }
            | Self::UnknownVersion(_)
            | Self::BadSegmentIndex { .. }
            | Self::Malformed(_) => SnapshotErrorKind::Invalid,
            Self::Encode(_) => SnapshotErrorKind::Encode,
            Self::Store { .. } => SnapshotErrorKind::Store,
        }
    }

    /// A failure of the object store holding snapshots, doing `what`.
    pub fn store(
        what: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self::Store {
            what: what.into(),
            source: Box::new(source),
        }
    }
}

/// Decodes a snapshot body (the bytes after its checksum) into `visitor`, by
/// the canonical reader when it takes the body and by serde otherwise; returns
/// the header. On an error the visitor has seen a prefix of the
/// objects and should be dropped.
fn decode_body<V: SnapshotVisitor>(
    body: &[u8],
    visitor: &mut V,
) -> Result<SnapshotHeader, SnapshotError> {
    let max_objects = body.len() / visit::MIN_OBJECT_BYTES;
    if let Some(decoded) = canonical::decode_body(body, visitor, max_objects) {
        return decoded;
    }
    visit::decode_body_with_serde(body, visitor, max_objects)
}

/// The sequence a snapshot object's name says it covers (`<subcluster>.<seq>`).
pub fn covered_seq_of(name: &str) -> Option<u64> {
    name.rsplit_once('.')?.1.parse().ok()
}

impl SnapshotFile {
    /// An empty snapshot of the current version covering `covers_seq`.
    pub fn new(covers_seq: u64, max_epoch: u64) -> Self {
        Self {
            version: SNAPSHOT_VERSION,
            covers_seq,
            max_epoch,
            segments: Vec::new(),
            objects: Vec::new(),
        }
    }

    /// Encodes the snapshot: checksum, then body.
    ///
    /// # Errors
    /// [`SnapshotError::Encode`] (not expected for these types).
    pub fn encode(&self) -> Result<Vec<u8>, SnapshotError> {
        encode_from(&self.header(), &self.objects[..])
    }

    /// Everything but the objects.
    pub fn header(&self) -> SnapshotHeader {
        SnapshotHeader {
            version: self.version,
            covers_seq: self.covers_seq,
            max_epoch: self.max_epoch,
            segments: self.segments.clone(),
        }
    }

    /// Decodes and verifies a snapshot: checksum, version, and that every replica
    /// names a segment of the snapshot.
    ///
    /// # Errors
    /// [`SnapshotErrorKind::Invalid`] errors.
    pub fn decode(bytes: &[u8]) -> Result<Self, SnapshotError> {
        let mut records = Records::default();
        let header = Self::decode_with(bytes, &mut records)?;
        Ok(records.into_file(header))
    }

    /// Verifies a snapshot's checksum and decodes it object by object into
    /// `visitor` (the same checks as [`SnapshotFile::decode`], without building
    /// the list of records); returns the header.
    ///
    /// # Errors
    /// [`SnapshotErrorKind::Invalid`] errors; the visitor has then seen a prefix
    /// of the objects and should be dropped.
    pub fn decode_with<V: SnapshotVisitor>(
        bytes: &[u8],
        visitor: &mut V,
    ) -> Result<SnapshotHeader, SnapshotError> {
        let (sum, body) = bytes
            .split_first_chunk::<8>()
            .ok_or(SnapshotError::Truncated { len: bytes.len() })?;
        let stored = u64::from_be_bytes(*sum);
        let computed = xxhash_rust::xxh3::xxh3_64(body);
        if stored != computed {
            return Err(SnapshotError::ChecksumMismatch { stored, computed });
        }
        decode_body(body, visitor)
    }

    /// The placements of `object` (segment ids and offsets), in replica order.
    pub fn placements<'a>(
        &'a self,
        object: &'a ObjectRecord,
    ) -> impl Iterator<Item = Placement> + 'a {
        object.replicas.iter().filter_map(|(index, offset)| {
            Some(Placement {
                segment: self.segments.get(*index as usize)?.segment.clone(),
                offset: *offset,
            })
        })
    }
}

/// A visitor collecting the records, for [`SnapshotFile::decode`] and for
/// stores that decode a snapshot as it arrives.
#[derive(Debug, Default)]
pub struct Records(Vec<ObjectRecord>);

impl Records {
    /// The whole snapshot: `header` and the records collected.
    pub fn into_file(self, header: SnapshotHeader) -> SnapshotFile {
        SnapshotFile {
            version: header.version,
            covers_seq: header.covers_seq,
            max_epoch: header.max_epoch,
            segments: header.segments,
            objects: self.0,
        }
    }
}

impl SnapshotVisitor for Records {
    fn header(&mut self, _: &SnapshotHeader, objects: usize) {
        self.0.reserve(objects);
    }

    fn object(&mut self, object: ObjectView<'_>) {
        self.0.push(object.to_record());
    }
}

/// Snapshots made from generated objects, for the format's tests.
#[cfg(test)]
pub(crate) mod generated {
    use std::sync::Arc;

    use super::{ObjectRecord, SegmentRecord, SnapshotFile};
    use crate::{NodeId, SegmentId};

    /// A generated object: key, size, replicas, flags, put id.
    pub(crate) type Generated = (String, u64, Vec<(u32, u64)>, u32, u64);

    /// A snapshot of `objects` (each value's checksum derived from its size)
    /// over `segments` segments.
    pub(crate) fn file(objects: &[Generated], segments: usize) -> SnapshotFile {
        let mut file = SnapshotFile::new(17, 4);
        file.segments = (0..segments)
            .map(|i| SegmentRecord {
                node: NodeId::new(format!("n{i}")).unwrap_or_else(|_| unreachable!()),
                segment: SegmentId::new(format!("n{i}-seg")).unwrap_or_else(|_| unreachable!()),
                size: 1 << 20,
                endpoint: format!("10.0.0.{i}:7000"),
                rdma: None,
            })
            .collect();
        file.objects = objects
            .iter()
            .map(|(key, size, replicas, flags, put_id)| ObjectRecord {
                key: Arc::from(key.as_str()),
                size: *size,
                checksum: size.wrapping_mul(31),
                replicas: replicas.clone(),
                flags: *flags,
                put_id: *put_id,
            })
            .collect();
        file
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::id::SubclusterId;
    use crate::subject::snapshot_object_name;

    proptest::proptest! {
        /// Checking stored bytes piece by piece, however they are split, agrees
        /// with decoding them whole: intact bytes pass, and a flipped bit or a
        /// wrong expected checksum fails.
        #[test]
        fn a_stored_snapshot_checked_in_pieces_agrees_with_the_whole(
            keys in proptest::collection::vec("[a-z]{1,12}", 0..40),
            cuts in proptest::collection::vec(0usize..2000, 0..6),
            flip in proptest::option::of((0usize..2000, 0u8..8)),
        ) {
            let mut file = SnapshotFile::new(9, 2);
            file.objects = keys
                .iter()
                .enumerate()
                .map(|(i, key)| ObjectRecord {
                    key: Arc::from(key.as_str()),
                    size: i as u64,
                    checksum: i as u64 * 31,
                    replicas: Vec::new(),
                    flags: 0,
                    put_id: 0,
                })
                .collect();
            let mut bytes = file.encode().unwrap();
            proptest::prop_assert!(SnapshotFile::decode(&bytes).is_ok());
            let checksum = xxhash_rust::xxh3::xxh3_64(&bytes);
            if let Some((at, bit)) = flip {
                let at = at % bytes.len();
                bytes[at] ^= 1 << bit;
            }
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (bytes.len() + 1)).collect();
            cuts.sort_unstable();
            let mut check = StoredCheck::new();
            let mut from = 0;
            for cut in cuts.into_iter().chain([bytes.len()]) {
                check.update(&bytes[from..cut]);
                from = cut;
            }
            let intact = flip.is_none();
            proptest::prop_assert_eq!(check.finish(checksum).is_ok(), intact);
            proptest::prop_assert_eq!(SnapshotFile::decode(&bytes).is_ok(), intact);
            let mut again = StoredCheck::new();
            again.update(&bytes);
            proptest::prop_assert!(again.finish(checksum ^ 1).is_err());
        }
    }

    #[test]
    fn a_snapshot_name_says_what_it_covers() {
        let subcluster = SubclusterId::new("sc-0").unwrap();
        let name = snapshot_object_name(&subcluster, 4711);
        assert_eq!(covered_seq_of(&name), Some(4711));
        assert_eq!(covered_seq_of("sc-0.not-a-number"), None);
        assert_eq!(covered_seq_of("no-dot"), None);
    }
}
