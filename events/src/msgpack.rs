//! A cursor over MessagePack bytes that reads only the canonical forms this
//! crate's encoders write (fixmaps of one-letter fixstr names, unsigned
//! integers, strings, arrays). The hot decoders (a committed put in
//! `key_ops`, a snapshot's objects) read their bodies through it in one pass
//! and hand anything else to serde, which decides.

/// A cursor over MessagePack bytes; every read answers `None` for a form it
/// does not read (or too few bytes), leaving the decision to serde.
pub(crate) struct CanonicalReader<'a> {
    /// The bytes not read yet.
    pub(crate) rest: &'a [u8],
}

impl<'a> CanonicalReader<'a> {
    /// A cursor at the start of `bytes`.
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Self { rest: bytes }
    }

    /// One byte.
    #[inline(always)]
    pub(crate) fn byte(&mut self) -> Option<u8> {
        let (&first, rest) = self.rest.split_first()?;
        self.rest = rest;
        Some(first)
    }

    /// The next `len` bytes.
    #[inline(always)]
    pub(crate) fn take(&mut self, len: usize) -> Option<&'a [u8]> {
        if self.rest.len() < len {
            return None;
        }
        let (taken, rest) = self.rest.split_at(len);
        self.rest = rest;
        Some(taken)
    }

    /// The next `N` bytes as a big-endian number.
    #[inline(always)]
    pub(crate) fn be<const N: usize>(&mut self) -> Option<u64> {
        let bytes: [u8; N] = self.take(N)?.try_into().ok()?;
        Some(
            bytes
                .iter()
                .fold(0, |value, &byte| (value << 8) | u64::from(byte)),
        )
    }

    /// A fixmap's length (at most 15 entries).
    #[inline]
    pub(crate) fn fixmap_len(&mut self) -> Option<u8> {
        match self.byte()? {
            marker @ 0x80..=0x8f => Some(marker & 0x0f),
            _ => None,
        }
    }

    /// An array's length: fixarray or array 16/32.
    #[inline]
    pub(crate) fn array_len(&mut self) -> Option<u64> {
        match self.byte()? {
            marker @ 0x90..=0x9f => Some(u64::from(marker & 0x0f)),
            0xdc => self.be::<2>(),
            0xdd => self.be::<4>(),
            _ => None,
        }
    }

    /// A one-letter field name (a fixstr of length 1).
    #[inline]
    pub(crate) fn name(&mut self) -> Option<u8> {
        match self.byte()? {
            0xa1 => self.byte(),
            _ => None,
        }
    }

    /// The one-letter field name `letter`, or `None`.
    #[inline(always)]
    pub(crate) fn expect_name(&mut self, letter: u8) -> Option<()> {
        match self.rest {
            [0xa1, found, rest @ ..] if *found == letter => {
                self.rest = rest;
                Some(())
            }
            _ => None,
        }
    }

    /// An unsigned integer: a positive fixint or uint 8/16/32/64.
    #[inline(always)]
    pub(crate) fn uint(&mut self) -> Option<u64> {
        match self.byte()? {
            small @ 0x00..=0x7f => Some(u64::from(small)),
            0xcc => self.be::<1>(),
            0xcd => self.be::<2>(),
            0xce => self.be::<4>(),
            0xcf => self.be::<8>(),
            _ => None,
        }
    }

    /// A string's bytes: fixstr or str 8/16/32.
    #[inline(always)]
    pub(crate) fn str_bytes(&mut self) -> Option<&'a [u8]> {
        let len = match self.byte()? {
            marker @ 0xa0..=0xbf => u64::from(marker & 0x1f),
            0xd9 => self.be::<1>()?,
            0xda => self.be::<2>()?,
            0xdb => self.be::<4>()?,
            _ => return None,
        };
        self.take(usize::try_from(len).ok()?)
    }

    /// A UTF-8 string.
    #[inline]
    pub(crate) fn str(&mut self) -> Option<&'a str> {
        std::str::from_utf8(self.str_bytes()?).ok()
    }
}

/// Marks field `bit` as seen in `seen`; `None` if it was already (a repeated
/// field is left to serde, which decides).
#[inline]
pub(crate) fn first_time(seen: &mut u8, bit: u8) -> Option<()> {
    if *seen & bit != 0 {
        return None;
    }
    *seen |= bit;
    Some(())
}
