//! Checkpoints of a [`Projection`]: every source's stream sequence plus the index,
//! as one self-checking blob. Restoring one and folding each source's messages
//! after its recorded sequence gives the same projection as folding everything.
//!
//! The bytes are [`hkvm_events::checkpoint`]'s format; this module converts a
//! projection to and from a [`Checkpoint`] and checks that a decoded index is
//! consistent.

use std::collections::BTreeMap;

use hkvm_events::checkpoint::{
    Checkpoint, CheckpointError, CheckpointHeader, CheckpointSource, CheckpointView,
};
use hkvm_events::SubclusterId;

use crate::error::ProjectorError;
use crate::index::KeyIndex;
use crate::projection::{Projection, SourceState};

/// Where a checkpoint stands, without decoding its index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointStamp {
    /// Per source: sub-cluster and the last sequence included.
    pub sources: Vec<(Option<SubclusterId>, u64)>,
}

fn source_record(state: &SourceState) -> CheckpointSource {
    CheckpointSource {
        subcluster: state.subcluster.clone(),
        stream: state.stream.clone(),
        applied_seq: state.applied_seq,
        applied_unix_ms: state.applied_unix_ms,
        stream_epoch: state.stream_epoch,
        segments: state
            .segments
            .iter()
            .map(|(segment, (node, size))| (segment.clone(), node.clone(), *size))
            .collect(),
        snapshot: state.snapshot.clone(),
    }
}

fn source_state(record: CheckpointSource) -> SourceState {
    SourceState {
        subcluster: record.subcluster,
        stream: record.stream,
        applied_seq: record.applied_seq,
        applied_unix_ms: record.applied_unix_ms,
        stream_epoch: record.stream_epoch,
        segments: record
            .segments
            .into_iter()
            .map(|(segment, node, size)| (segment, (node, size)))
            .collect::<BTreeMap<_, _>>(),
        snapshot: record.snapshot,
        events_applied: 0,
        events_skipped: 0,
    }
}

/// The checkpoint of `projection`, as plain data (copies the index arrays; to
/// write one, [`encode`] does without the copy).
pub fn to_checkpoint(projection: &Projection) -> Checkpoint {
    let (hashes, masks, free, bitmaps) = projection.index.parts();
    let sources: Vec<CheckpointSource> = projection.sources.iter().map(source_record).collect();
    let mut bitmaps = bitmaps[..bitmaps.len().min(sources.len())].to_vec();
    bitmaps.resize_with(sources.len(), Default::default);
    Checkpoint {
        sources,
        hashes: hashes.to_vec(),
        masks: masks.to_vec(),
        free: free.to_vec(),
        bitmaps,
    }
}

/// Restores a projection from a decoded checkpoint.
///
/// # Errors
/// [`crate::ProjectorErrorKind::BadCheckpoint`] (with
/// [`CheckpointError::Malformed`]) when the index parts are inconsistent: lengths
/// differ, an id is out of range, a hash appears twice or a bitmap holds ids its
/// mask bit lacks.
pub fn from_checkpoint(checkpoint: Checkpoint) -> Result<Projection, ProjectorError> {
    let Checkpoint {
        sources,
        hashes,
        masks,
        free,
        bitmaps,
    } = checkpoint;
    let index =
        KeyIndex::from_parts(hashes, masks, free, bitmaps).map_err(CheckpointError::Malformed)?;
    Ok(Projection {
        sources: sources.into_iter().map(source_state).collect(),
        index,
        limits: hkvm_events::Limits::default(),
    })
}

/// Encodes `projection` as a checkpoint.
///
/// # Errors
/// [`crate::ProjectorErrorKind::BadCheckpoint`] if a section exceeds 4 GiB.
pub fn encode(projection: &Projection) -> Result<Vec<u8>, ProjectorError> {
    let (hashes, masks, free, bitmaps) = projection.index.parts();
    let sources: Vec<CheckpointSource> = projection.sources.iter().map(source_record).collect();
    // One bitmap per source: sources without one are written empty.
    let bitmaps = &bitmaps[..bitmaps.len().min(sources.len())];
    let view = CheckpointView {
        sources: &sources,
        hashes,
        masks,
        free,
        bitmaps,
    };
    Ok(view.encode()?)
}

/// The sources and sequences a checkpoint covers (checks the checksum).
///
/// # Errors
/// [`crate::ProjectorErrorKind::BadCheckpoint`] when the bytes are not a valid
/// checkpoint.
pub fn stamp(bytes: &[u8]) -> Result<CheckpointStamp, ProjectorError> {
    let header = CheckpointHeader::read(bytes)?;
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
    from_checkpoint(Checkpoint::decode(bytes)?)
}

#[cfg(test)]
mod tests {
    use hkvm_events::checkpoint::CheckpointErrorKind;
    use hkvm_events::{NodeId, SegmentId};

    use super::*;
    use crate::ProjectorErrorKind;

    fn projection() -> Projection {
        let mut projection = Projection::new();
        let a = projection.source_index(&SubclusterId::new("sc-a").unwrap(), "A");
        let b = projection.source_index(&SubclusterId::new("sc-b").unwrap(), "B");
        projection.sources[a].segments.insert(
            SegmentId::new("s1").unwrap(),
            (NodeId::new("n1").unwrap(), 10),
        );
        projection.sources[b].applied_seq = 4;
        projection.index.insert(a, 1);
        projection.index.insert(b, 1);
        projection.index.insert(b, 2);
        projection.index.insert(a, 3);
        projection.index.remove(a, 3);
        projection
    }

    #[test]
    fn encode_is_the_format_of_to_checkpoint() {
        let projection = projection();
        let checkpoint = to_checkpoint(&projection);
        assert_eq!(encode(&projection).unwrap(), checkpoint.encode().unwrap());
        let restored = from_checkpoint(checkpoint).unwrap();
        assert_eq!(restored.content(), projection.content());
        assert_eq!(restored.sources(), projection.sources());
    }

    #[test]
    fn sources_without_a_bitmap_get_an_empty_one() {
        let mut projection = projection();
        projection.source_index(&SubclusterId::new("sc-c").unwrap(), "C");
        let checkpoint = Checkpoint::decode(&encode(&projection).unwrap()).unwrap();
        assert_eq!(checkpoint.bitmaps.len(), 3);
        assert!(checkpoint.bitmaps[2].is_empty());
        assert_eq!(to_checkpoint(&projection), checkpoint);
    }

    #[test]
    fn an_inconsistent_index_is_a_bad_checkpoint() {
        let mut checkpoint = to_checkpoint(&projection());
        // Source 1 claims an id whose mask lacks its bit.
        checkpoint.bitmaps[1].insert(2);
        let bytes = checkpoint.encode().unwrap();
        let error = decode(&bytes).unwrap_err();
        let ProjectorErrorKind::BadCheckpoint(inner) = error.kind() else {
            panic!("{error}");
        };
        assert_eq!(inner.kind(), CheckpointErrorKind::Malformed);
        let source = std::error::Error::source(&error).map(ToString::to_string);
        assert_eq!(source, Some(inner.to_string()));
    }

    #[test]
    fn a_repeated_hash_or_an_id_out_of_range_is_a_bad_checkpoint() {
        let malformed = |checkpoint: Checkpoint| {
            let error = from_checkpoint(checkpoint).unwrap_err();
            let ProjectorErrorKind::BadCheckpoint(inner) = error.kind() else {
                panic!("{error}");
            };
            assert_eq!(inner.kind(), CheckpointErrorKind::Malformed);
            inner.to_string()
        };
        let mut checkpoint = to_checkpoint(&projection());
        let first = checkpoint.hashes[0];
        checkpoint.hashes[1] = first;
        assert!(malformed(checkpoint).contains("twice (id 1)"));
        let mut checkpoint = to_checkpoint(&projection());
        let ids = checkpoint.hashes.len() as u32;
        checkpoint.bitmaps[0].insert(ids);
        assert!(malformed(checkpoint).contains("out of range"));
    }

    #[test]
    fn format_errors_keep_their_kind() {
        let bytes = encode(&projection()).unwrap();
        let error = decode(&bytes[..bytes.len() - 1]).unwrap_err();
        assert!(matches!(
            error.kind(),
            ProjectorErrorKind::BadCheckpoint(e) if e.kind() == CheckpointErrorKind::ChecksumMismatch
        ));
        let error = stamp(b"not a checkpoint at all").unwrap_err();
        assert!(matches!(
            error.kind(),
            ProjectorErrorKind::BadCheckpoint(e) if e.kind() == CheckpointErrorKind::BadMagic
        ));
        let stamp = stamp(&bytes).unwrap();
        assert_eq!(stamp.sources.len(), 2);
        assert_eq!(stamp.sources[1].1, 4);
    }
}
