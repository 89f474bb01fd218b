//! A committed put read straight from its canonical encoding: the bytes
//! `codec::MessageBuilder` writes (a fixmap of one-letter fixstr names, unsigned
//! integers, strings, an array of placement fixmaps). It is the projector's hot
//! path: a put is read in one pass over its bytes, without serde's visitor calls
//! (in a straight line when its fields come in the encoder's order, by a loop
//! over its fields otherwise).
//!
//! It decides nothing on its own. Whenever the bytes are anything else (another
//! integer or map form, an unknown or repeated field, a missing one, bytes left
//! over, a bad string or segment id), it answers `None` and the serde view of the
//! put decides, errors included. So both paths accept the same bodies with the
//! same fields; the tests check that against the serde view.

use crate::id::is_valid_id;
use crate::msgpack::{first_time, CanonicalReader as Reader};

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
    read_put_in_order(body).or_else(|| read_put_any_order(body))
}

/// The encoder's own field order (k, h, s, c, p, f, then i when it is not 0),
/// read in a straight line: no dispatch on each field's name, which costs about
/// as much as reading the fields. `None` when the fields come in another order
/// (or anything else is off); [`read_put_any_order`] then decides.
fn read_put_in_order(body: &[u8]) -> Option<PutFields<'_>> {
    let mut reader = Reader::new(body);
    let fields = reader.fixmap_len()?;
    if !(6..=7).contains(&fields) {
        return None;
    }
    reader.expect_name(b'k')?;
    let key = reader.str()?;
    reader.expect_name(b'h')?;
    let key_hash = reader.uint()?;
    reader.expect_name(b's')?;
    let size = reader.uint()?;
    reader.expect_name(b'c')?;
    reader.uint()?;
    reader.expect_name(b'p')?;
    let placements = placements_in_order(&mut reader)?;
    reader.expect_name(b'f')?;
    u32::try_from(reader.uint()?).ok()?;
    if fields == 7 {
        reader.expect_name(b'i')?;
        reader.uint()?;
    }
    reader.rest.is_empty().then_some(PutFields {
        key,
        key_hash,
        size,
        placements,
    })
}

/// An array of placements, each `{g: segment id, o: offset}` in that order;
/// returns how many.
#[inline(always)]
fn placements_in_order(reader: &mut Reader<'_>) -> Option<usize> {
    let count = reader.array_len()?;
    for _ in 0..count {
        (reader.fixmap_len()? == 2).then_some(())?;
        reader.expect_name(b'g')?;
        // A valid id is ASCII: no UTF-8 check needed.
        is_valid_id(reader.str_bytes()?).then_some(())?;
        reader.expect_name(b'o')?;
        reader.uint()?;
    }
    usize::try_from(count).ok()
}

/// The fields in any order, each at most once.
fn read_put_any_order(body: &[u8]) -> Option<PutFields<'_>> {
    let mut reader = Reader::new(body);
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
                put.placements = placements(&mut reader)?;
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

/// An array of placements (`{g: segment id, o: offset}` fixmaps, each id
/// valid); returns how many.
fn placements(reader: &mut Reader<'_>) -> Option<usize> {
    let count = reader.array_len()?;
    for _ in 0..count {
        let fields = reader.fixmap_len()?;
        let mut seen = 0u8;
        for _ in 0..fields {
            let bit = match reader.name()? {
                b'g' => {
                    // A valid id is ASCII: no UTF-8 check needed.
                    is_valid_id(reader.str_bytes()?).then_some(())?;
                    1
                }
                b'o' => {
                    reader.uint()?;
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

#[cfg(test)]
mod tests;
