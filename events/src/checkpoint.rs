//! The projection checkpoint format: every source's stream position plus the
//! cluster-wide key index, as one self-checking blob. This module knows the bytes
//! only; what the arrays mean (ids, masks, which source holds which key) belongs to
//! the projector, which converts its projection to and from a [`Checkpoint`].
//!
//! Layout, integers little endian:
//!
//! ```text
//! magic          8 bytes   "HKVMPRJ1"
//! header length  u32       N
//! header         N bytes   MessagePack map with named fields (see below)
//! hashes         u64 x ids
//! masks          u32 x ids
//! free ids       u32 x free
//! bitmaps        per source, in header order:
//!                  u32 length L, then L bytes of a roaring bitmap in the portable
//!                  (standard RoaringFormatSpec) serialization
//! checksum       u64       xxh3-64 of every byte before it
//! ```
//!
//! The header is the map `{sources, ids, free}`: `ids` and `free` (unsigned
//! integers) are the element counts of the hash/mask and free-id arrays, and
//! `sources` an array with one map per source, fields in this order:
//! `subcluster` (string or nil), `stream` (string), `applied_seq`,
//! `applied_unix_ms`, `stream_epoch` (unsigned integers; `stream_epoch` may be
//! absent and then reads as 0), `segments` (array of `[segment, node, size]`) and
//! `snapshot` (nil or `[covered sequence, object name]`). Unknown header fields
//! are ignored when reading.
//!
//! Every declared length is checked against the bytes that remain before anything
//! is allocated for it, so hostile input gives a [`CheckpointError`], never a
//! panic or an allocation larger than the input warrants.

use roaring::RoaringBitmap;
use serde::{Deserialize, Serialize};

use crate::id::{NodeId, SegmentId, SubclusterId};

mod reader;

pub use reader::CheckpointReader;

/// The first eight bytes of every checkpoint.
pub const MAGIC: &[u8; 8] = b"HKVMPRJ1";

/// Bytes of the trailing xxh3-64 checksum.
const CHECKSUM_LEN: usize = 8;

/// Bytes of the header length field.
const LENGTH_LEN: usize = 4;

/// The smallest possible checkpoint: magic, header length and checksum.
const MIN_LEN: usize = MAGIC.len() + LENGTH_LEN + CHECKSUM_LEN;

/// One source (a sub-cluster's event stream) recorded in a checkpoint.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckpointSource {
    /// The sub-cluster (`None` for a source never named).
    pub subcluster: Option<SubclusterId>,
    /// The stream it is read from.
    pub stream: String,
    /// The last stream sequence included.
    pub applied_seq: u64,
    /// When that message was stored, Unix milliseconds.
    pub applied_unix_ms: u64,
    /// The identity of the stream instance read (0 in checkpoints that predate it).
    pub stream_epoch: u64,
    /// Mounted segments: segment, owner node and size in bytes.
    pub segments: Vec<(SegmentId, NodeId, u64)>,
    /// The newest snapshot marker seen: covered sequence and object name.
    pub snapshot: Option<(u64, String)>,
}

/// A decoded checkpoint: the sources and the raw arrays of the key index.
///
/// Decoding always yields exactly one bitmap per source.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Checkpoint {
    /// Every source, by index.
    pub sources: Vec<CheckpointSource>,
    /// Key hash per id.
    pub hashes: Vec<u64>,
    /// Source mask per id (as many as `hashes`).
    pub masks: Vec<u32>,
    /// Ids free for reuse.
    pub free: Vec<u32>,
    /// Per source, the ids it holds.
    pub bitmaps: Vec<RoaringBitmap>,
}

/// A checkpoint borrowed from its owner's memory, to encode without copying the
/// index arrays.
#[derive(Debug, Clone, Copy)]
pub struct CheckpointView<'a> {
    /// Every source, by index.
    pub sources: &'a [CheckpointSource],
    /// Key hash per id.
    pub hashes: &'a [u64],
    /// Source mask per id (as many as `hashes`).
    pub masks: &'a [u32],
    /// Ids free for reuse.
    pub free: &'a [u32],
    /// Per source, the ids it holds; at most one per source, and sources past the
    /// end are written with an empty bitmap.
    pub bitmaps: &'a [RoaringBitmap],
}

/// The header of a checkpoint, read without decoding its arrays.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckpointHeader {
    /// Every source, by index.
    pub sources: Vec<CheckpointSource>,
    /// How many ids (hashes and masks) the checkpoint holds.
    pub ids: u64,
    /// How many free ids it holds.
    pub free: u64,
}

/// Why a checkpoint could not be encoded or decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckpointError {
    /// The bytes end before a section they declare.
    #[error("checkpoint truncated: {section} needs {needed} bytes, {available} left")]
    Truncated {
        /// The section being read.
        section: &'static str,
        /// Bytes it needs.
        needed: u64,
        /// Bytes left.
        available: u64,
    },
    /// The bytes do not start with [`MAGIC`]: not a projection checkpoint.
    #[error("not a projection checkpoint (bad magic)")]
    BadMagic,
    /// The trailing checksum does not match the bytes (corruption).
    #[error("checkpoint checksum mismatch: stored {stored:#018x}, computed {computed:#018x}")]
    ChecksumMismatch {
        /// The checksum in the bytes.
        stored: u64,
        /// The checksum of the bytes before it.
        computed: u64,
    },
    /// A section does not decode, or the parts are inconsistent.
    #[error("malformed checkpoint: {0}")]
    Malformed(String),
    /// A section is too large for the format (or, decoding, for this platform).
    #[error("checkpoint {section} too large: {len}")]
    TooLarge {
        /// The section.
        section: &'static str,
        /// Its length, in bytes or elements.
        len: u64,
    },
}

/// The kind of a [`CheckpointError`], for matching without its details.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CheckpointErrorKind {
    /// See [`CheckpointError::Truncated`].
    Truncated,
    /// See [`CheckpointError::BadMagic`].
    BadMagic,
    /// See [`CheckpointError::ChecksumMismatch`].
    ChecksumMismatch,
    /// See [`CheckpointError::Malformed`].
    Malformed,
    /// See [`CheckpointError::TooLarge`].
    TooLarge,
}

impl CheckpointError {
    /// The kind of failure.
    pub fn kind(&self) -> CheckpointErrorKind {
        match self {
            Self::Truncated { .. } => CheckpointErrorKind::Truncated,
            Self::BadMagic => CheckpointErrorKind::BadMagic,
            Self::ChecksumMismatch { .. } => CheckpointErrorKind::ChecksumMismatch,
            Self::Malformed(_) => CheckpointErrorKind::Malformed,
            Self::TooLarge { .. } => CheckpointErrorKind::TooLarge,
        }
    }
}

/// One source as written in the header (field names and order are the format).
#[derive(Serialize)]
struct SourceOut<'a> {
    subcluster: &'a Option<SubclusterId>,
    stream: &'a str,
    applied_seq: u64,
    applied_unix_ms: u64,
    stream_epoch: u64,
    segments: &'a [(SegmentId, NodeId, u64)],
    snapshot: &'a Option<(u64, String)>,
}

/// The header as written.
#[derive(Serialize)]
struct HeaderOut<'a> {
    sources: Vec<SourceOut<'a>>,
    ids: u64,
    free: u64,
}

/// One source as read from the header.
#[derive(Deserialize)]
struct SourceIn {
    subcluster: Option<SubclusterId>,
    stream: String,
    applied_seq: u64,
    applied_unix_ms: u64,
    #[serde(default)]
    stream_epoch: u64,
    segments: Vec<(SegmentId, NodeId, u64)>,
    snapshot: Option<(u64, String)>,
}

/// The header as read.
#[derive(Deserialize)]
struct HeaderIn {
    sources: Vec<SourceIn>,
    ids: u64,
    free: u64,
}

impl From<SourceIn> for CheckpointSource {
    fn from(s: SourceIn) -> Self {
        Self {
            subcluster: s.subcluster,
            stream: s.stream,
            applied_seq: s.applied_seq,
            applied_unix_ms: s.applied_unix_ms,
            stream_epoch: s.stream_epoch,
            segments: s.segments,
            snapshot: s.snapshot,
        }
    }
}

fn put_len(out: &mut Vec<u8>, section: &'static str, len: usize) -> Result<(), CheckpointError> {
    let len = u32::try_from(len).map_err(|_| CheckpointError::TooLarge {
        section,
        len: len as u64,
    })?;
    out.extend_from_slice(&len.to_le_bytes());
    Ok(())
}

impl CheckpointView<'_> {
    /// Encodes the checkpoint.
    ///
    /// # Errors
    /// [`CheckpointError::Malformed`] when `masks` and `hashes` differ in length or
    /// there are more bitmaps than sources; [`CheckpointError::TooLarge`] when the
    /// header or a bitmap exceeds 4 GiB.
    pub fn encode(&self) -> Result<Vec<u8>, CheckpointError> {
        if self.hashes.len() != self.masks.len() {
            return Err(CheckpointError::Malformed(format!(
                "{} hashes but {} masks",
                self.hashes.len(),
                self.masks.len()
            )));
        }
        if self.bitmaps.len() > self.sources.len() {
            return Err(CheckpointError::Malformed(format!(
                "{} bitmaps for {} sources",
                self.bitmaps.len(),
                self.sources.len()
            )));
        }
        let header = HeaderOut {
            sources: self
                .sources
                .iter()
                .map(|s| SourceOut {
                    subcluster: &s.subcluster,
                    stream: &s.stream,
                    applied_seq: s.applied_seq,
                    applied_unix_ms: s.applied_unix_ms,
                    stream_epoch: s.stream_epoch,
                    segments: &s.segments,
                    snapshot: &s.snapshot,
                })
                .collect(),
            ids: self.hashes.len() as u64,
            free: self.free.len() as u64,
        };
        let header = rmp_serde::to_vec_named(&header)
            .map_err(|e| CheckpointError::Malformed(format!("header: {e}")))?;
        let bitmap_bytes: usize = self
            .bitmaps
            .iter()
            .map(|b| b.serialized_size() + LENGTH_LEN)
            .sum();
        let mut out = Vec::with_capacity(
            MIN_LEN
                + header.len()
                + self.hashes.len() * 12
                + self.free.len() * 4
                + bitmap_bytes
                + (self.sources.len() - self.bitmaps.len()) * 12,
        );
        out.extend_from_slice(MAGIC);
        put_len(&mut out, "header", header.len())?;
        out.extend_from_slice(&header);
        for hash in self.hashes {
            out.extend_from_slice(&hash.to_le_bytes());
        }
        for mask in self.masks {
            out.extend_from_slice(&mask.to_le_bytes());
        }
        for id in self.free {
            out.extend_from_slice(&id.to_le_bytes());
        }
        let empty = RoaringBitmap::new();
        for source in 0..self.sources.len() {
            let bitmap = self.bitmaps.get(source).unwrap_or(&empty);
            put_len(&mut out, "bitmap", bitmap.serialized_size())?;
            bitmap
                .serialize_into(&mut out)
                .map_err(|e| CheckpointError::Malformed(format!("bitmap {source}: {e}")))?;
        }
        let sum = xxhash_rust::xxh3::xxh3_64(&out);
        out.extend_from_slice(&sum.to_le_bytes());
        Ok(out)
    }
}

impl Checkpoint {
    /// Borrows the checkpoint as a [`CheckpointView`].
    pub fn view(&self) -> CheckpointView<'_> {
        CheckpointView {
            sources: &self.sources,
            hashes: &self.hashes,
            masks: &self.masks,
            free: &self.free,
            bitmaps: &self.bitmaps,
        }
    }

    /// Encodes the checkpoint (see [`CheckpointView::encode`]).
    ///
    /// # Errors
    /// As for [`CheckpointView::encode`].
    pub fn encode(&self) -> Result<Vec<u8>, CheckpointError> {
        self.view().encode()
    }

    /// Decodes a checkpoint, checking its magic, checksum and every length.
    ///
    /// # Errors
    /// A [`CheckpointError`] when the bytes are truncated, corrupt or malformed;
    /// never panics on bad input.
    pub fn decode(bytes: &[u8]) -> Result<Checkpoint, CheckpointError> {
        verify(bytes)?;
        let mut reader = CheckpointReader::checked(bytes.len() as u64)?;
        reader.feed(bytes)?;
        reader.finish()
    }
}

impl CheckpointHeader {
    /// Reads a checkpoint's header only (checking its magic and checksum), to see
    /// what it covers without decoding the index.
    ///
    /// # Errors
    /// A [`CheckpointError`] when the bytes are not a valid checkpoint header.
    pub fn read(bytes: &[u8]) -> Result<CheckpointHeader, CheckpointError> {
        let header = open(bytes)?;
        Ok(CheckpointHeader {
            sources: header.sources.into_iter().map(Into::into).collect(),
            ids: header.ids,
            free: header.free,
        })
    }
}

/// A cursor over checkpoint bytes that fails cleanly when they run out.
/// Checks the magic, the length and the checksum of a checkpoint held whole;
/// returns the bytes after the magic and before the checksum.
fn verify(bytes: &[u8]) -> Result<&[u8], CheckpointError> {
    if bytes.len() >= MAGIC.len() && &bytes[..MAGIC.len()] != MAGIC {
        return Err(CheckpointError::BadMagic);
    }
    if bytes.len() < MIN_LEN {
        return Err(CheckpointError::Truncated {
            section: "checkpoint",
            needed: MIN_LEN as u64,
            available: bytes.len() as u64,
        });
    }
    let (body, sum) = bytes.split_at(bytes.len() - CHECKSUM_LEN);
    let mut stored = [0u8; CHECKSUM_LEN];
    stored.copy_from_slice(sum);
    let stored = u64::from_le_bytes(stored);
    let computed = xxhash_rust::xxh3::xxh3_64(body);
    if stored != computed {
        return Err(CheckpointError::ChecksumMismatch { stored, computed });
    }
    Ok(&body[MAGIC.len()..])
}

/// Reads the header of a checkpoint held whole (checks its checksum).
fn open(bytes: &[u8]) -> Result<HeaderIn, CheckpointError> {
    let rest = verify(bytes)?;
    if rest.len() < LENGTH_LEN {
        return Err(CheckpointError::Truncated {
            section: "header length",
            needed: LENGTH_LEN as u64,
            available: rest.len() as u64,
        });
    }
    let (len, rest) = rest.split_at(LENGTH_LEN);
    let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
    if len > rest.len() {
        return Err(CheckpointError::Truncated {
            section: "header",
            needed: len as u64,
            available: rest.len() as u64,
        });
    }
    parse_header(&rest[..len])
}

/// Decodes the MessagePack header.
fn parse_header(bytes: &[u8]) -> Result<HeaderIn, CheckpointError> {
    rmp_serde::from_slice(bytes).map_err(|e| CheckpointError::Malformed(format!("header: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Checkpoint {
        Checkpoint {
            sources: vec![
                CheckpointSource {
                    subcluster: Some(SubclusterId::new("sc-a").unwrap()),
                    stream: "A".to_owned(),
                    applied_seq: 9,
                    applied_unix_ms: 1_000,
                    stream_epoch: 3,
                    segments: vec![(
                        SegmentId::new("s1").unwrap(),
                        NodeId::new("n1").unwrap(),
                        64,
                    )],
                    snapshot: Some((4, "obj".to_owned())),
                },
                CheckpointSource::default(),
            ],
            hashes: vec![10, 20, 30],
            masks: vec![1, 3, 0],
            free: vec![2],
            bitmaps: vec![[0, 1].into_iter().collect(), [1].into_iter().collect()],
        }
    }

    #[test]
    fn round_trips() {
        let checkpoint = sample();
        let bytes = checkpoint.encode().unwrap();
        assert_eq!(Checkpoint::decode(&bytes).unwrap(), checkpoint);
        let header = CheckpointHeader::read(&bytes).unwrap();
        assert_eq!(header.sources, checkpoint.sources);
        assert_eq!((header.ids, header.free), (3, 1));
    }

    #[test]
    fn missing_bitmaps_are_written_empty() {
        let mut checkpoint = sample();
        checkpoint.bitmaps.truncate(1);
        let decoded = Checkpoint::decode(&checkpoint.encode().unwrap()).unwrap();
        assert_eq!(decoded.bitmaps.len(), 2);
        assert!(decoded.bitmaps[1].is_empty());
    }

    #[test]
    fn inconsistent_parts_are_not_encoded() {
        let mut checkpoint = sample();
        checkpoint.masks.pop();
        let error = checkpoint.encode().unwrap_err();
        assert_eq!(error.kind(), CheckpointErrorKind::Malformed);
        let mut checkpoint = sample();
        checkpoint.bitmaps.push(RoaringBitmap::new());
        let error = checkpoint.encode().unwrap_err();
        assert_eq!(error.kind(), CheckpointErrorKind::Malformed);
    }

    #[test]
    fn errors_say_what_is_wrong() {
        let bytes = sample().encode().unwrap();
        let kind = |bytes: &[u8]| Checkpoint::decode(bytes).unwrap_err().kind();
        assert_eq!(kind(&[]), CheckpointErrorKind::Truncated);
        assert_eq!(kind(&bytes[..7]), CheckpointErrorKind::Truncated);
        assert_eq!(kind(&bytes[..MIN_LEN - 1]), CheckpointErrorKind::Truncated);
        assert_eq!(
            kind(b"HKVMPRJ2 and more bytes"),
            CheckpointErrorKind::BadMagic
        );
        assert_eq!(
            kind(&bytes[..bytes.len() - 1]),
            CheckpointErrorKind::ChecksumMismatch
        );
        let mut flipped = bytes.clone();
        flipped[30] ^= 0x40;
        assert_eq!(kind(&flipped), CheckpointErrorKind::ChecksumMismatch);
    }

    /// Re-seals `body` (everything but the checksum) with a valid checksum.
    fn seal(mut body: Vec<u8>) -> Vec<u8> {
        let sum = xxhash_rust::xxh3::xxh3_64(&body);
        body.extend_from_slice(&sum.to_le_bytes());
        body
    }

    #[test]
    fn declared_lengths_beyond_the_bytes_are_refused() {
        // A header declaring 2^40 ids in a few bytes.
        let header = HeaderOut {
            sources: Vec::new(),
            ids: 1 << 40,
            free: 0,
        };
        let header = rmp_serde::to_vec_named(&header).unwrap();
        let mut body = MAGIC.to_vec();
        body.extend_from_slice(&(header.len() as u32).to_le_bytes());
        body.extend_from_slice(&header);
        let error = Checkpoint::decode(&seal(body.clone())).unwrap_err();
        assert_eq!(error.kind(), CheckpointErrorKind::Truncated, "{error}");
        // Counts whose byte length overflows.
        let header = HeaderOut {
            sources: Vec::new(),
            ids: u64::MAX,
            free: 0,
        };
        let header = rmp_serde::to_vec_named(&header).unwrap();
        let mut body = MAGIC.to_vec();
        body.extend_from_slice(&(header.len() as u32).to_le_bytes());
        body.extend_from_slice(&header);
        let error = Checkpoint::decode(&seal(body)).unwrap_err();
        assert_eq!(error.kind(), CheckpointErrorKind::TooLarge, "{error}");
        // A header length past the end.
        let mut body = MAGIC.to_vec();
        body.extend_from_slice(&u32::MAX.to_le_bytes());
        let error = Checkpoint::decode(&seal(body)).unwrap_err();
        assert_eq!(error.kind(), CheckpointErrorKind::Truncated, "{error}");
    }

    #[test]
    fn trailing_bytes_and_bad_sections_are_malformed() {
        let bytes = sample().encode().unwrap();
        let mut body = bytes[..bytes.len() - CHECKSUM_LEN].to_vec();
        body.push(0);
        let error = Checkpoint::decode(&seal(body)).unwrap_err();
        assert_eq!(error.kind(), CheckpointErrorKind::Malformed, "{error}");
        // A header that is not MessagePack.
        let mut body = MAGIC.to_vec();
        body.extend_from_slice(&1u32.to_le_bytes());
        body.push(0xc1);
        let error = Checkpoint::decode(&seal(body)).unwrap_err();
        assert_eq!(error.kind(), CheckpointErrorKind::Malformed, "{error}");
    }
}
