//! Checkpoints of a [`Projection`]: every source's stream sequence plus the index,
//! as one self-checking blob. Restoring one and folding each source's messages
//! after its recorded sequence gives the same projection as folding everything.
//!
//! Layout (little endian):
//! ```text
//! "HKVMPRJ1" | header length u32 | header (MessagePack map)
//! | hashes u64 x ids | masks u32 x ids | free ids u32 x free
//! | per source: bitmap length u32, roaring bitmap (portable format)
//! | xxh3-64 of everything before
//! ```

use std::collections::BTreeMap;

use roaring::RoaringBitmap;
use serde::{Deserialize, Serialize};

use hkvm_events::{NodeId, SegmentId, SubclusterId};

use crate::error::ProjectorError;
use crate::index::KeyIndex;
use crate::projection::{Projection, SourceState};

const MAGIC: &[u8; 8] = b"HKVMPRJ1";

/// One source in a checkpoint header.
#[derive(Debug, Serialize, Deserialize)]
struct SourceRecord {
    subcluster: Option<SubclusterId>,
    stream: String,
    applied_seq: u64,
    applied_unix_ms: u64,
    #[serde(default)]
    stream_epoch: u64,
    segments: Vec<(SegmentId, NodeId, u64)>,
    snapshot: Option<(u64, String)>,
}

/// The checkpoint header: what the blob covers and the array lengths.
#[derive(Debug, Serialize, Deserialize)]
struct Header {
    sources: Vec<SourceRecord>,
    ids: u64,
    free: u64,
}

/// Where a checkpoint stands, without decoding its index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointStamp {
    /// Per source: sub-cluster and the last sequence included.
    pub sources: Vec<(Option<SubclusterId>, u64)>,
}

fn put_u32(out: &mut Vec<u8>, value: usize) -> Result<(), ProjectorError> {
    let value = u32::try_from(value).map_err(|_| ProjectorError::checkpoint("section too big"))?;
    out.extend_from_slice(&value.to_le_bytes());
    Ok(())
}

/// Encodes `projection` as a checkpoint.
///
/// # Errors
/// [`crate::ProjectorErrorKind::BadCheckpoint`] if a section exceeds 4 GiB.
pub fn encode(projection: &Projection) -> Result<Vec<u8>, ProjectorError> {
    let (hashes, masks, free, bitmaps) = projection.index.parts();
    let header = Header {
        sources: projection
            .sources
            .iter()
            .map(|s| SourceRecord {
                subcluster: s.subcluster.clone(),
                stream: s.stream.clone(),
                applied_seq: s.applied_seq,
                applied_unix_ms: s.applied_unix_ms,
                stream_epoch: s.stream_epoch,
                segments: s
                    .segments
                    .iter()
                    .map(|(segment, (node, size))| (segment.clone(), node.clone(), *size))
                    .collect(),
                snapshot: s.snapshot.clone(),
            })
            .collect(),
        ids: hashes.len() as u64,
        free: free.len() as u64,
    };
    let header = rmp_serde::to_vec_named(&header)
        .map_err(|e| ProjectorError::checkpoint(format!("header: {e}")))?;
    let bitmap_bytes: usize = bitmaps.iter().map(|b| b.serialized_size() + 4).sum();
    let mut out =
        Vec::with_capacity(24 + header.len() + hashes.len() * 12 + free.len() * 4 + bitmap_bytes);
    out.extend_from_slice(MAGIC);
    put_u32(&mut out, header.len())?;
    out.extend_from_slice(&header);
    for hash in hashes {
        out.extend_from_slice(&hash.to_le_bytes());
    }
    for mask in masks {
        out.extend_from_slice(&mask.to_le_bytes());
    }
    for id in free {
        out.extend_from_slice(&id.to_le_bytes());
    }
    for source in 0..projection.sources.len() {
        let empty = RoaringBitmap::new();
        let bitmap = bitmaps.get(source).unwrap_or(&empty);
        put_u32(&mut out, bitmap.serialized_size())?;
        bitmap
            .serialize_into(&mut out)
            .map_err(|e| ProjectorError::checkpoint(format!("bitmap: {e}")))?;
    }
    let sum = xxhash_rust::xxh3::xxh3_64(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    Ok(out)
}

/// A cursor over checkpoint bytes that fails cleanly when they run out.
struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, len: usize) -> Result<&'a [u8], ProjectorError> {
        if len > self.rest.len() {
            return Err(ProjectorError::checkpoint("truncated"));
        }
        let (head, rest) = self.rest.split_at(len);
        self.rest = rest;
        Ok(head)
    }

    fn u32(&mut self) -> Result<u32, ProjectorError> {
        let bytes = self.take(4)?;
        Ok(u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
    }

    fn array<const N: usize, T>(
        &mut self,
        count: u64,
        convert: fn([u8; N]) -> T,
    ) -> Result<Vec<T>, ProjectorError> {
        let count = usize::try_from(count).map_err(|_| ProjectorError::checkpoint("too big"))?;
        let bytes = self.take(
            count
                .checked_mul(N)
                .ok_or_else(|| ProjectorError::checkpoint("too big"))?,
        )?;
        Ok(bytes
            .chunks_exact(N)
            .map(|chunk| {
                let mut word = [0u8; N];
                word.copy_from_slice(chunk);
                convert(word)
            })
            .collect())
    }
}

/// Checks the checksum and magic; returns the body (without the checksum) and the
/// decoded header, positioned after the header.
fn open(bytes: &[u8]) -> Result<(Header, Reader<'_>), ProjectorError> {
    let body_len = bytes
        .len()
        .checked_sub(8)
        .ok_or_else(|| ProjectorError::checkpoint("too short"))?;
    let (body, sum) = bytes.split_at(body_len);
    let mut sum_bytes = [0u8; 8];
    sum_bytes.copy_from_slice(sum);
    if xxhash_rust::xxh3::xxh3_64(body) != u64::from_le_bytes(sum_bytes) {
        return Err(ProjectorError::checkpoint("checksum mismatch"));
    }
    let mut reader = Reader { rest: body };
    if reader.take(MAGIC.len())? != MAGIC {
        return Err(ProjectorError::checkpoint("not a projection checkpoint"));
    }
    let header_len = reader.u32()? as usize;
    let header: Header = rmp_serde::from_slice(reader.take(header_len)?)
        .map_err(|e| ProjectorError::checkpoint(format!("header: {e}")))?;
    Ok((header, reader))
}

/// The sources and sequences a checkpoint covers (checks the checksum).
///
/// # Errors
/// [`crate::ProjectorErrorKind::BadCheckpoint`] when the bytes are not a valid
/// checkpoint.
pub fn stamp(bytes: &[u8]) -> Result<CheckpointStamp, ProjectorError> {
    let (header, _) = open(bytes)?;
    Ok(CheckpointStamp {
        sources: header
            .sources
            .into_iter()
            .map(|s| (s.subcluster, s.applied_seq))
            .collect(),
    })
}

/// Restores a projection from a checkpoint.
///
/// # Errors
/// [`crate::ProjectorErrorKind::BadCheckpoint`] when the bytes are truncated,
/// corrupt or inconsistent; never panics on bad input.
pub fn decode(bytes: &[u8]) -> Result<Projection, ProjectorError> {
    let (header, mut reader) = open(bytes)?;
    let hashes = reader.array(header.ids, u64::from_le_bytes)?;
    let masks = reader.array(header.ids, u32::from_le_bytes)?;
    let free = reader.array(header.free, u32::from_le_bytes)?;
    let mut bitmaps = Vec::with_capacity(header.sources.len());
    for _ in 0..header.sources.len() {
        let len = reader.u32()? as usize;
        let bitmap = RoaringBitmap::deserialize_from(reader.take(len)?)
            .map_err(|e| ProjectorError::checkpoint(format!("bitmap: {e}")))?;
        bitmaps.push(bitmap);
    }
    if !reader.rest.is_empty() {
        return Err(ProjectorError::checkpoint("trailing bytes"));
    }
    let index =
        KeyIndex::from_parts(hashes, masks, free, bitmaps).map_err(ProjectorError::checkpoint)?;
    let sources = header
        .sources
        .into_iter()
        .map(|s| SourceState {
            subcluster: s.subcluster,
            stream: s.stream,
            applied_seq: s.applied_seq,
            applied_unix_ms: s.applied_unix_ms,
            stream_epoch: s.stream_epoch,
            segments: s
                .segments
                .into_iter()
                .map(|(segment, node, size)| (segment, (node, size)))
                .collect::<BTreeMap<_, _>>(),
            snapshot: s.snapshot,
            events_applied: 0,
            events_skipped: 0,
        })
        .collect();
    Ok(Projection {
        sources,
        index,
        limits: hkvm_events::Limits::default(),
    })
}
