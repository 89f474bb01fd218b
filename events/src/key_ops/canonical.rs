//! A committed put read straight from its canonical encoding: the bytes
//! `codec::MessageBuilder` writes (a fixmap of one-letter fixstr names, unsigned
//! integers, strings, an array of placement fixmaps). It is the projector's hot
//! path: a put is read in one pass over its bytes, without serde's visitor calls.
//!
//! It decides nothing on its own. Whenever the bytes are anything else (another
//! integer or map form, an unknown or repeated field, a missing one, bytes left
//! over, a bad string or segment id), it answers `None` and the serde view of the
//! put decides, errors included. So both paths accept the same bodies with the
//! same fields; the tests check that against the serde view.

use crate::id::is_valid_id;

/// The fields of a committed put a key index needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PutFields<'a> {
    /// The key.
    pub(crate) key: &'a str,
    /// The key hash it carries.
    pub(crate) key_hash: u64,
    /// The object's size.
    pub(crate) size: u64,
    /// How many placements it lists (each one's segment id checked).
    pub(crate) placements: usize,
}

/// Reads the body of a committed put in its canonical encoding; `None` when the
/// body is in any other form (see the module documentation).
pub(crate) fn read_put(body: &[u8]) -> Option<PutFields<'_>> {
    let mut reader = Reader { rest: body };
    let fields = reader.fixmap_len()?;
    let mut seen = 0u8;
    let mut put = PutFields {
        key: "",
        key_hash: 0,
        size: 0,
        placements: 0,
    };
    for _ in 0..fields {
        let name = reader.name()?;
        let bit = match name {
            b'k' => {
                put.key = reader.str()?;
                1
            }
            b'h' => {
                put.key_hash = reader.uint()?;
                2
            }
            b's' => {
                put.size = reader.uint()?;
                4
            }
            b'c' => {
                reader.uint()?;
                8
            }
            b'p' => {
                put.placements = reader.placements()?;
                16
            }
            b'f' => {
                u32::try_from(reader.uint()?).ok()?;
                32
            }
            b'i' => {
                reader.uint()?;
                64
            }
            _ => return None,
        };
        first_time(&mut seen, bit)?;
    }
    // k, h, s, c and p are required; f and i have defaults.
    (seen & 0b1_1111 == 0b1_1111 && reader.rest.is_empty()).then_some(put)
}

/// Marks field `bit` as seen; `None` if it was already (a repeated field is
/// left to serde, which refuses it).
fn first_time(seen: &mut u8, bit: u8) -> Option<()> {
    if *seen & bit != 0 {
        return None;
    }
    *seen |= bit;
    Some(())
}

/// A cursor over MessagePack bytes that reads only the canonical forms.
struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    #[inline]
    fn byte(&mut self) -> Option<u8> {
        let (&first, rest) = self.rest.split_first()?;
        self.rest = rest;
        Some(first)
    }

    #[inline]
    fn take(&mut self, len: usize) -> Option<&'a [u8]> {
        if self.rest.len() < len {
            return None;
        }
        let (taken, rest) = self.rest.split_at(len);
        self.rest = rest;
        Some(taken)
    }

    /// The next `N` bytes as a big-endian number.
    #[inline]
    fn be<const N: usize>(&mut self) -> Option<u64> {
        let bytes: [u8; N] = self.take(N)?.try_into().ok()?;
        Some(
            bytes
                .iter()
                .fold(0, |value, &byte| (value << 8) | u64::from(byte)),
        )
    }

    /// A fixmap's length (at most 15 entries).
    #[inline]
    fn fixmap_len(&mut self) -> Option<u8> {
        match self.byte()? {
            marker @ 0x80..=0x8f => Some(marker & 0x0f),
            _ => None,
        }
    }

    /// A one-letter field name (a fixstr of length 1).
    #[inline]
    fn name(&mut self) -> Option<u8> {
        match self.byte()? {
            0xa1 => self.byte(),
            _ => None,
        }
    }

    /// An unsigned integer: a positive fixint or uint 8/16/32/64.
    #[inline]
    fn uint(&mut self) -> Option<u64> {
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
    #[inline]
    fn str_bytes(&mut self) -> Option<&'a [u8]> {
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
    fn str(&mut self) -> Option<&'a str> {
        std::str::from_utf8(self.str_bytes()?).ok()
    }

    /// An array of placements (`{g: segment id, o: offset}` fixmaps, each id
    /// valid); returns how many.
    fn placements(&mut self) -> Option<usize> {
        let count = match self.byte()? {
            marker @ 0x90..=0x9f => u64::from(marker & 0x0f),
            0xdc => self.be::<2>()?,
            0xdd => self.be::<4>()?,
            _ => return None,
        };
        for _ in 0..count {
            let fields = self.fixmap_len()?;
            let mut seen = 0u8;
            for _ in 0..fields {
                let bit = match self.name()? {
                    b'g' => {
                        // A valid id is ASCII: no UTF-8 check needed.
                        is_valid_id(self.str_bytes()?).then_some(())?;
                        1
                    }
                    b'o' => {
                        self.uint()?;
                        2
                    }
                    _ => return None,
                };
                first_time(&mut seen, bit)?;
            }
            if seen != 0b11 {
                return None;
            }
        }
        usize::try_from(count).ok()
    }
}

#[cfg(test)]
mod tests;
