//! Decoding a snapshot as its pieces arrive from the object store, so that a
//! restore decodes while the rest is still being read and never holds the
//! whole blob (860 MB at 10 M objects, all of it fresh memory to fault in).
//!
//! It decides nothing the whole-bytes decoder ([`super::decode_body`])
//! would decide otherwise. Objects are read by the canonical reader from a
//! window of the bytes received so far; one it cannot read is tried again with
//! more bytes, and only at the end of the stream is it handed to serde with
//! everything after it, as the whole-bytes decoder does. A header the
//! canonical reader does not take sends the whole body to the whole-bytes
//! decoder. So with an intact checksum both hand the visitor the same objects
//! and end the same way. The checksum comes first in the layout but covers
//! the whole body, so it is compared at the end: a damaged snapshot may have
//! handed over objects before it is refused, and the visitor is then dropped,
//! as after any decode error.

use xxhash_rust::xxh3::Xxh3Default;

use super::canonical::{announce, read_header, read_object, serde_objects};
use super::decode_body;
use super::visit::{hand_over, MIN_OBJECT_BYTES};
use super::{SnapshotError, SnapshotHeader, SnapshotVisitor};
use crate::msgpack::CanonicalReader as Reader;

/// Bytes gathered before the header is read: room for thousands of segments.
const HEADER_WINDOW: usize = 1 << 20;
/// Bytes gathered past an object's start before it is read; an object that
/// needs more (a key of tens of kilobytes) is tried again with more.
const OBJECT_WINDOW: usize = 64 << 10;
/// Bytes of a checksum.
const CHECKSUM_LEN: usize = 8;

/// Decodes a snapshot of `len` bytes in all from `pieces`, in order, into
/// `visitor`; returns its header once every byte has come and the checksum
/// matched.
///
/// # Errors
/// As [`super::SnapshotFile::decode_with`], and the first error among
/// `pieces`; [`SnapshotError::Truncated`] or [`SnapshotError::Malformed`]
/// when the pieces add up to another length than `len`. On an error the
/// visitor may have seen a prefix of the objects and should be dropped.
pub fn decode_pieces<V, I>(
    len: u64,
    pieces: I,
    visitor: &mut V,
) -> Result<SnapshotHeader, SnapshotError>
where
    V: SnapshotVisitor,
    I: IntoIterator<Item = Result<Vec<u8>, SnapshotError>>,
{
    let body_len = usize::try_from(len.saturating_sub(CHECKSUM_LEN as u64)).unwrap_or(usize::MAX);
    let max_objects = body_len / MIN_OBJECT_BYTES;
    let mut input = Input::new(len, pieces.into_iter());
    input.fill(HEADER_WINDOW)?;
    let mut reader = Reader::new(input.rest());
    let Some((header, count)) =
        read_header(&mut reader).and_then(|header| Some((header, reader.array_len()?)))
    else {
        // Not the canonical header: the whole body, checked first, as a
        // snapshot held whole.
        input.fill(usize::MAX)?;
        input.verify()?;
        return decode_body(input.rest(), visitor);
    };
    let used = input.rest().len() - reader.rest.len();
    input.consume(used);
    announce(visitor, &header, count, max_objects);
    let segments = header.segments.len();
    let mut replicas = Vec::new();
    for read in 0..count {
        input.fill(OBJECT_WINDOW)?;
        loop {
            let mut reader = Reader::new(input.rest());
            if let Some(fields) = read_object(&mut reader, &mut replicas) {
                let used = input.rest().len() - reader.rest.len();
                hand_over(visitor, &fields, &replicas, segments)?;
                input.consume(used);
                break;
            }
            if input.ended {
                // Not in the canonical form (or cut short): serde reads it
                // and the rest, as from a snapshot held whole.
                serde_objects(input.rest(), count - read, &header, visitor)?;
                input.fill(usize::MAX)?;
                input.verify()?;
                return Ok(header);
            }
            let more = input.rest().len().saturating_mul(2).max(OBJECT_WINDOW);
            input.fill(more)?;
        }
    }
    input.fill(usize::MAX)?;
    input.verify()?;
    Ok(header)
}

/// The bytes received so far that are not read yet, and the checksum.
struct Input<I> {
    pieces: I,
    /// Declared length of the whole snapshot.
    len: u64,
    /// Bytes received so far, the checksum included.
    received: u64,
    /// Whether the pieces have ended.
    ended: bool,
    /// The stored checksum's bytes, as they arrive.
    stored: Vec<u8>,
    /// The checksum of the body received so far.
    hasher: Xxh3Default,
    /// Body bytes received and not dropped, read up to `at`.
    window: Vec<u8>,
    at: usize,
}

impl<I: Iterator<Item = Result<Vec<u8>, SnapshotError>>> Input<I> {
    fn new(len: u64, pieces: I) -> Self {
        Self {
            pieces,
            len,
            received: 0,
            ended: false,
            stored: Vec::with_capacity(CHECKSUM_LEN),
            hasher: Xxh3Default::new(),
            window: Vec::new(),
            at: 0,
        }
    }

    /// The body bytes received and not read yet.
    fn rest(&self) -> &[u8] {
        &self.window[self.at..]
    }

    /// Marks `len` more bytes read; drops the read part of the window once
    /// it is most of it.
    fn consume(&mut self, len: usize) {
        self.at += len;
        if self.at >= OBJECT_WINDOW && self.at * 2 >= self.window.len() {
            self.window.drain(..self.at);
            self.at = 0;
        }
    }

    /// Takes pieces until `want` bytes are unread or the pieces end.
    fn fill(&mut self, want: usize) -> Result<(), SnapshotError> {
        while !self.ended && self.rest().len() < want {
            match self.pieces.next() {
                Some(piece) => self.take(&piece?)?,
                None => self.ended = true,
            }
        }
        Ok(())
    }

    fn take(&mut self, piece: &[u8]) -> Result<(), SnapshotError> {
        self.received += piece.len() as u64;
        if self.received > self.len {
            return Err(SnapshotError::Malformed(serde::de::Error::custom(format!(
                "more than the declared {} bytes",
                self.len
            ))));
        }
        let head = (CHECKSUM_LEN - self.stored.len()).min(piece.len());
        self.stored.extend_from_slice(&piece[..head]);
        let body = &piece[head..];
        self.hasher.update(body);
        self.window.extend_from_slice(body);
        Ok(())
    }

    /// Once every piece has come: the declared length and the checksum.
    fn verify(&self) -> Result<(), SnapshotError> {
        if self.stored.len() < CHECKSUM_LEN {
            return Err(SnapshotError::Truncated {
                len: self.stored.len(),
            });
        }
        if self.received < self.len {
            return Err(SnapshotError::Malformed(serde::de::Error::custom(format!(
                "ended after {} of the declared {} bytes",
                self.received, self.len
            ))));
        }
        let mut stored = [0u8; CHECKSUM_LEN];
        stored.copy_from_slice(&self.stored);
        let stored = u64::from_be_bytes(stored);
        let computed = self.hasher.digest();
        if stored != computed {
            return Err(SnapshotError::ChecksumMismatch { stored, computed });
        }
        Ok(())
    }
}
