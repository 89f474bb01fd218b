//! Decoding a checkpoint as its bytes arrive: a restart reads one from an object
//! store in chunks, and copying each chunk straight into the index arrays means
//! the whole blob is never held in memory and the copy overlaps the read.
//!
//! The reader is told the checkpoint's length up front (an object store lists an
//! object's size), so every declared length is checked against the bytes still
//! to come before anything is allocated for it, as for a checkpoint held whole.
//! The checksum is the last eight bytes, so it is compared only at
//! [`CheckpointReader::finish`]: nothing it returned before then may be relied
//! on, and a damaged checkpoint may be refused earlier as truncated or
//! malformed instead of as a checksum mismatch.

use roaring::RoaringBitmap;
use xxhash_rust::xxh3::Xxh3Default;

use super::{
    parse_header, Checkpoint, CheckpointError, HeaderIn, CHECKSUM_LEN, LENGTH_LEN, MAGIC, MIN_LEN,
};

/// Picks an array of the reader and its partial-word buffer.
type Pick<W> = fn(&mut CheckpointReader) -> (&mut Vec<u8>, &mut Vec<W>);

/// Where the reader is in the layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Section {
    /// Magic and header length.
    Prefix,
    /// The MessagePack header, of this many bytes.
    Header(usize),
    /// Key hashes still to read.
    Hashes(u64),
    /// Source masks still to read.
    Masks(u64),
    /// Free ids still to read.
    Free(u64),
    /// The length field of this source's bitmap.
    BitmapLength(usize),
    /// This source's bitmap, of this many bytes.
    Bitmap(usize, usize),
    /// Every section read: only the checksum may follow.
    End,
}

impl Section {
    fn name(self) -> &'static str {
        match self {
            Section::Prefix => "header length",
            Section::Header(_) => "header",
            Section::Hashes(_) => "hashes",
            Section::Masks(_) => "masks",
            Section::Free(_) => "free ids",
            Section::BitmapLength(_) => "bitmap length",
            Section::Bitmap(..) => "bitmap",
            Section::End => "checksum",
        }
    }
}

/// Decodes a checkpoint from consecutive pieces of its bytes.
///
/// ```
/// # use hkvm_events::checkpoint::{Checkpoint, CheckpointReader};
/// let bytes = Checkpoint::default().encode().unwrap();
/// let mut reader = CheckpointReader::new(bytes.len() as u64).unwrap();
/// for piece in bytes.chunks(5) {
///     reader.feed(piece).unwrap();
/// }
/// assert_eq!(reader.finish().unwrap(), Checkpoint::default());
/// ```
pub struct CheckpointReader {
    /// Bytes before the checksum.
    body_len: u64,
    /// Body bytes taken so far.
    taken: u64,
    /// The checksum of the body so far; `None` when the caller checked it.
    hasher: Option<Xxh3Default>,
    /// The stored checksum's bytes, as they arrive.
    stored: Vec<u8>,
    section: Section,
    /// The start of a field that a piece ended inside of.
    partial: Vec<u8>,
    header: Option<HeaderIn>,
    hashes: Vec<u64>,
    masks: Vec<u32>,
    free: Vec<u32>,
    bitmaps: Vec<RoaringBitmap>,
}

impl std::fmt::Debug for CheckpointReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointReader")
            .field("len", &(self.body_len + CHECKSUM_LEN as u64))
            .field("taken", &self.taken)
            .field("section", &self.section)
            .finish_non_exhaustive()
    }
}

impl CheckpointReader {
    /// A reader for a checkpoint of `len` bytes in all.
    ///
    /// # Errors
    /// [`CheckpointError::Truncated`] when `len` is shorter than any checkpoint.
    pub fn new(len: u64) -> Result<Self, CheckpointError> {
        if len < MIN_LEN as u64 {
            return Err(CheckpointError::Truncated {
                section: "checkpoint",
                needed: MIN_LEN as u64,
                available: len,
            });
        }
        Ok(Self {
            body_len: len - CHECKSUM_LEN as u64,
            taken: 0,
            hasher: Some(Xxh3Default::new()),
            stored: Vec::with_capacity(CHECKSUM_LEN),
            section: Section::Prefix,
            partial: Vec::new(),
            header: None,
            hashes: Vec::new(),
            masks: Vec::new(),
            free: Vec::new(),
            bitmaps: Vec::new(),
        })
    }

    /// A reader that leaves the checksum to its caller, who compared it over
    /// the whole checkpoint already.
    pub(super) fn checked(len: u64) -> Result<Self, CheckpointError> {
        let mut reader = Self::new(len)?;
        reader.hasher = None;
        Ok(reader)
    }

    /// Takes the next piece of the checkpoint.
    ///
    /// # Errors
    /// As soon as the bytes so far cannot be a checkpoint of the declared
    /// length: a bad magic, a malformed header or bitmap, a declared length
    /// beyond the bytes still to come, or more bytes than declared. After an
    /// error the reader must be dropped.
    pub fn feed(&mut self, piece: &[u8]) -> Result<(), CheckpointError> {
        let body_left = usize::try_from(self.body_len - self.taken).unwrap_or(usize::MAX);
        let (body, sum) = piece.split_at(piece.len().min(body_left));
        if let Some(hasher) = &mut self.hasher {
            hasher.update(body);
        }
        self.take_body(body)?;
        if self.stored.len() + sum.len() > CHECKSUM_LEN {
            return Err(CheckpointError::Malformed(format!(
                "more than the declared {} bytes",
                self.body_len + CHECKSUM_LEN as u64
            )));
        }
        self.stored.extend_from_slice(sum);
        Ok(())
    }

    /// The checkpoint, once every byte has been fed.
    ///
    /// # Errors
    /// [`CheckpointError::Truncated`] when fewer bytes than declared came,
    /// [`CheckpointError::ChecksumMismatch`] when the checksum differs, and
    /// [`CheckpointError::Malformed`] when the sections end before the body.
    pub fn finish(self) -> Result<Checkpoint, CheckpointError> {
        let fed = self.taken + self.stored.len() as u64;
        let len = self.body_len + CHECKSUM_LEN as u64;
        if fed < len {
            return Err(CheckpointError::Truncated {
                section: "checkpoint",
                needed: len,
                available: fed,
            });
        }
        if let Some(hasher) = &self.hasher {
            let mut stored = [0u8; CHECKSUM_LEN];
            stored.copy_from_slice(&self.stored);
            let stored = u64::from_le_bytes(stored);
            let computed = hasher.digest();
            if stored != computed {
                return Err(CheckpointError::ChecksumMismatch { stored, computed });
            }
        }
        if self.section != Section::End {
            return Err(CheckpointError::Truncated {
                section: self.section.name(),
                needed: self.partial.len() as u64 + 1,
                available: self.partial.len() as u64,
            });
        }
        let header = self.header.expect("the header is read before the end");
        Ok(Checkpoint {
            sources: header.sources.into_iter().map(Into::into).collect(),
            hashes: self.hashes,
            masks: self.masks,
            free: self.free,
            bitmaps: self.bitmaps,
        })
    }

    /// Body bytes still to come after the `taken` so far.
    fn body_left(&self) -> u64 {
        self.body_len - self.taken
    }

    /// Checks that a section of `needed` bytes fits in what is still to come.
    fn fits(&self, section: &'static str, needed: u64) -> Result<(), CheckpointError> {
        if needed > self.body_left() {
            return Err(CheckpointError::Truncated {
                section,
                needed,
                available: self.body_left(),
            });
        }
        Ok(())
    }

    fn take_body(&mut self, mut body: &[u8]) -> Result<(), CheckpointError> {
        while !body.is_empty() {
            let used = match self.section {
                Section::Hashes(left) => {
                    let next = Section::Masks(self.header().ids);
                    let pick: Pick<_> = |r| (&mut r.partial, &mut r.hashes);
                    self.take_array(body, left, pick, Section::Hashes, next)?
                }
                Section::Masks(left) => {
                    let next = Section::Free(self.header().free);
                    let pick: Pick<_> = |r| (&mut r.partial, &mut r.masks);
                    self.take_array(body, left, pick, Section::Masks, next)?
                }
                Section::Free(left) => {
                    let next = Section::BitmapLength(0);
                    let pick: Pick<_> = |r| (&mut r.partial, &mut r.free);
                    self.take_array(body, left, pick, Section::Free, next)?
                }
                Section::End => {
                    return Err(CheckpointError::Malformed(format!(
                        "{} trailing bytes",
                        self.body_left()
                    )));
                }
                field => {
                    let need = match field {
                        Section::Prefix => MAGIC.len() + LENGTH_LEN,
                        Section::Header(len) | Section::Bitmap(_, len) => len,
                        _ => LENGTH_LEN,
                    };
                    let used = (need - self.partial.len()).min(body.len());
                    self.partial.extend_from_slice(&body[..used]);
                    self.taken += used as u64;
                    if field == Section::Prefix {
                        check_magic(&self.partial)?;
                    }
                    if self.partial.len() == need {
                        let whole = std::mem::take(&mut self.partial);
                        self.end_field(field, &whole)?;
                    }
                    used
                }
            };
            body = &body[used..];
        }
        Ok(())
    }

    /// Takes from `body` words of the array section `section(left)` into the
    /// array `array` picks (beside the partial-word buffer), and moves on to
    /// `next` once the section is whole. Returns the bytes of `body` used.
    fn take_array<W: Word>(
        &mut self,
        body: &[u8],
        left: u64,
        array: Pick<W>,
        section: fn(u64) -> Section,
        next: Section,
    ) -> Result<usize, CheckpointError> {
        let (partial, words_out) = array(self);
        let (used, words) = take_words(partial, body, left, words_out);
        self.taken += used as u64;
        self.section = section(left - words);
        if words == left {
            self.enter(next)?;
        }
        Ok(used)
    }

    /// Moves to `section`: checks that its declared length fits in the bytes
    /// still to come, reserves its array, and goes straight on past a section
    /// that is empty.
    fn enter(&mut self, section: Section) -> Result<(), CheckpointError> {
        self.section = section;
        match section {
            Section::Header(len) => {
                self.fits("header", len as u64)?;
                if len == 0 {
                    self.end_field(section, &[])?;
                }
            }
            Section::Hashes(count) => {
                self.fits_words("hashes", count, 8)?;
                self.hashes.reserve_exact(count as usize);
                if count == 0 {
                    self.enter(Section::Masks(0))?;
                }
            }
            Section::Masks(count) => {
                self.fits_words("masks", count, 4)?;
                self.masks.reserve_exact(count as usize);
                if count == 0 {
                    self.enter(Section::Free(self.header().free))?;
                }
            }
            Section::Free(count) => {
                self.fits_words("free ids", count, 4)?;
                self.free.reserve_exact(count as usize);
                if count == 0 {
                    self.enter(Section::BitmapLength(0))?;
                }
            }
            Section::BitmapLength(source) => {
                if source == self.header().sources.len() {
                    self.section = Section::End;
                }
            }
            Section::Bitmap(_, len) => {
                self.fits("bitmap", len as u64)?;
                if len == 0 {
                    self.end_field(section, &[])?;
                }
            }
            Section::Prefix | Section::End => {}
        }
        Ok(())
    }

    /// Checks that `count` words of `size` bytes fit in what is still to come.
    fn fits_words(
        &self,
        section: &'static str,
        count: u64,
        size: u64,
    ) -> Result<(), CheckpointError> {
        let len = count.checked_mul(size).ok_or(CheckpointError::TooLarge {
            section,
            len: count,
        })?;
        self.fits(section, len)
    }

    /// Reads a field held whole and moves to the section after it.
    fn end_field(&mut self, field: Section, bytes: &[u8]) -> Result<(), CheckpointError> {
        match field {
            Section::Prefix => self.enter(Section::Header(le_u32(&bytes[MAGIC.len()..]) as usize)),
            Section::Header(_) => {
                let header = parse_header(bytes)?;
                let ids = header.ids;
                self.header = Some(header);
                self.enter(Section::Hashes(ids))
            }
            Section::BitmapLength(source) => {
                self.enter(Section::Bitmap(source, le_u32(bytes) as usize))
            }
            Section::Bitmap(source, _) => {
                let bitmap = RoaringBitmap::deserialize_from(bytes)
                    .map_err(|e| CheckpointError::Malformed(format!("bitmap {source}: {e}")))?;
                self.bitmaps.push(bitmap);
                self.enter(Section::BitmapLength(source + 1))
            }
            Section::Hashes(_) | Section::Masks(_) | Section::Free(_) | Section::End => {
                unreachable!("only fields read whole end here")
            }
        }
    }

    fn header(&self) -> &HeaderIn {
        self.header.as_ref().expect("arrays come after the header")
    }
}

/// A little-endian word of an array section.
trait Word: Sized {
    /// Bytes per word.
    const SIZE: usize;
    /// The word of exactly [`Self::SIZE`] bytes.
    fn read(bytes: &[u8]) -> Self;
}

impl Word for u64 {
    const SIZE: usize = 8;
    fn read(bytes: &[u8]) -> Self {
        let mut word = [0u8; 8];
        word.copy_from_slice(bytes);
        u64::from_le_bytes(word)
    }
}

impl Word for u32 {
    const SIZE: usize = 4;
    fn read(bytes: &[u8]) -> Self {
        le_u32(bytes)
    }
}

/// Appends to `out` up to `left` words from `body`, the first of them
/// completing the bytes of a word in `partial`; a word that `body` ends inside
/// of is kept in `partial`. Returns the bytes of `body` used and the words
/// appended.
fn take_words<W: Word>(
    partial: &mut Vec<u8>,
    mut body: &[u8],
    left: u64,
    out: &mut Vec<W>,
) -> (usize, u64) {
    let start = body.len();
    let mut words = 0u64;
    if !partial.is_empty() {
        let used = (W::SIZE - partial.len()).min(body.len());
        partial.extend_from_slice(&body[..used]);
        body = &body[used..];
        if partial.len() < W::SIZE {
            return (start - body.len(), 0);
        }
        out.push(W::read(partial));
        partial.clear();
        words = 1;
    }
    let whole = usize::try_from(left - words)
        .unwrap_or(usize::MAX)
        .min(body.len() / W::SIZE);
    let (full, rest) = body.split_at(whole * W::SIZE);
    out.extend(full.chunks_exact(W::SIZE).map(W::read));
    words += whole as u64;
    body = rest;
    if words < left && !body.is_empty() {
        // Fewer than SIZE bytes remain: the start of the next word.
        partial.extend_from_slice(body);
        body = &[];
    }
    (start - body.len(), words)
}

fn check_magic(prefix: &[u8]) -> Result<(), CheckpointError> {
    let seen = prefix.len().min(MAGIC.len());
    if prefix[..seen] != MAGIC[..seen] {
        return Err(CheckpointError::BadMagic);
    }
    Ok(())
}

fn le_u32(bytes: &[u8]) -> u32 {
    u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
}
