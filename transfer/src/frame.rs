//! The TCP protocol's frames: a fixed little-endian request header (operation,
//! request id, offset, length, xxh3-64 of the payload, region id) and a fixed response
//! header (status, request id, length, xxh3-64 of the payload), each closed by a
//! 32-bit check of its own bytes so that a corrupted header is refused *before* it
//! is acted on (a flipped offset must never redirect a write). The grant is opaque
//! here: the serving side's [`Admission`](crate::admission::Admission) reads it.
//!
//! ```text
//! request:  magic u16 | version u8 | op u8 | id u64 | offset u64 | len u64
//!           | payload xxh3 u64 | region len u8 | flags u8 | grant len u8 | 0
//!           | region | grant | check u32
//!           then `len` payload bytes for a write
//! response: magic u16 | version u8 | status u8 | id u64 | len u64
//!           | payload xxh3 u64 | check u32
//!           then `len` bytes: the data of a read, or the error message
//! ```

use xxhash_rust::xxh3::xxh3_64;

use crate::error::{ErrorKind, TransferError};
use crate::region::MAX_REGION_ID_LEN;

/// First two bytes of every frame ("HK").
pub const MAGIC: u16 = 0x4b48;
/// The protocol version this build speaks (2: requests carry a grant).
pub const VERSION: u8 = 2;
/// Bytes of a request header before the region id.
pub const REQUEST_FIXED_LEN: usize = 40;
/// The longest grant a request carries.
pub const MAX_GRANT_LEN: usize = 64;
/// The longest request header (fixed part, longest region id and grant, check).
pub const REQUEST_MAX_LEN: usize = REQUEST_FIXED_LEN + MAX_REGION_ID_LEN + MAX_GRANT_LEN + 4;
/// Bytes of a response header.
pub const RESPONSE_LEN: usize = 32;
/// The longest error message a response carries.
pub const MAX_ERROR_MESSAGE: u64 = 4096;
/// The response status of success.
pub const STATUS_OK: u8 = 0;
/// Request flag: the payload is checksummed (writes carry its xxh3-64, reads ask for
/// it in the response).
pub const FLAG_CHECKED: u8 = 1;

/// What a request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Write the payload that follows into the region.
    Write,
    /// Send back `len` bytes of the region.
    Read,
}

impl Op {
    fn code(self) -> u8 {
        match self {
            Self::Write => 1,
            Self::Read => 2,
        }
    }

    fn from_code(code: u8) -> Result<Self, TransferError> {
        match code {
            1 => Ok(Self::Write),
            2 => Ok(Self::Read),
            other => Err(TransferError::Protocol(format!(
                "unknown operation {other}"
            ))),
        }
    }
}

/// A decoded request header; the region id borrows the receive buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request<'a> {
    /// The operation.
    pub op: Op,
    /// The request id, echoed in the response.
    pub id: u64,
    /// The region.
    pub region: &'a str,
    /// Start of the range.
    pub offset: u64,
    /// Length of the range.
    pub len: u64,
    /// xxh3-64 of the payload (checked writes), zero otherwise.
    pub checksum: u64,
    /// Whether the payload is checksummed: a checked write carries `checksum`, a
    /// checked read is answered with the xxh3-64 of its data.
    pub checked: bool,
    /// What allows the operation (empty: nothing), for the serving side's
    /// admission to judge.
    pub grant: &'a [u8],
}

fn check32(bytes: &[u8]) -> u32 {
    // The low half of xxh3-64 is as good a check as any 32-bit hash.
    xxh3_64(bytes) as u32
}

fn u64_at(buf: &[u8], at: usize) -> u64 {
    let mut raw = [0u8; 8];
    raw.copy_from_slice(&buf[at..at + 8]);
    u64::from_le_bytes(raw)
}

fn check_magic(buf: &[u8]) -> Result<(), TransferError> {
    let magic = u16::from_le_bytes([buf[0], buf[1]]);
    if magic != MAGIC {
        return Err(TransferError::Protocol(format!("bad magic {magic:#06x}")));
    }
    if buf[2] != VERSION {
        return Err(TransferError::Protocol(format!(
            "frame version {} (this build speaks {VERSION})",
            buf[2]
        )));
    }
    Ok(())
}

impl Request<'_> {
    /// Appends the encoded header to `out`.
    ///
    /// # Errors
    /// [`TransferError::Invalid`] when the region id is longer than allowed.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), TransferError> {
        let region = self.region.as_bytes();
        let region_len = u8::try_from(region.len())
            .map_err(|_| TransferError::Invalid("region id longer than 255 bytes".into()))?;
        if self.grant.len() > MAX_GRANT_LEN {
            return Err(TransferError::Invalid(format!(
                "grant of {} bytes, longer than {MAX_GRANT_LEN}",
                self.grant.len()
            )));
        }
        let start = out.len();
        out.extend_from_slice(&MAGIC.to_le_bytes());
        out.push(VERSION);
        out.push(self.op.code());
        out.extend_from_slice(&self.id.to_le_bytes());
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        out.extend_from_slice(&self.checksum.to_le_bytes());
        let flags = if self.checked { FLAG_CHECKED } else { 0 };
        out.extend_from_slice(&[region_len, flags, self.grant.len() as u8, 0]);
        out.extend_from_slice(region);
        out.extend_from_slice(self.grant);
        let check = check32(&out[start..]);
        out.extend_from_slice(&check.to_le_bytes());
        Ok(())
    }
}

/// How many bytes follow the fixed part of a request header (region id and check),
/// read from the fixed part.
///
/// # Errors
/// [`TransferError::Protocol`] for a wrong magic or version.
pub fn request_rest_len(fixed: &[u8; REQUEST_FIXED_LEN]) -> Result<usize, TransferError> {
    check_magic(fixed)?;
    if usize::from(fixed[38]) > MAX_GRANT_LEN {
        return Err(TransferError::Protocol(format!(
            "grant of {} bytes, longer than {MAX_GRANT_LEN}",
            fixed[38]
        )));
    }
    Ok(usize::from(fixed[36]) + usize::from(fixed[38]) + 4)
}

/// Decodes a whole request header (fixed part, region id, check).
///
/// # Errors
/// [`TransferError::Corrupt`] when the check fails, [`TransferError::Protocol`] when
/// the fields do not make sense.
pub fn decode_request(buf: &[u8]) -> Result<Request<'_>, TransferError> {
    if buf.len() < REQUEST_FIXED_LEN + 4 {
        return Err(TransferError::Protocol("truncated request header".into()));
    }
    check_magic(buf)?;
    let region_len = usize::from(buf[36]);
    let grant_len = usize::from(buf[38]);
    let region_end = REQUEST_FIXED_LEN + region_len;
    let end = region_end + grant_len;
    if buf.len() != end + 4 {
        return Err(TransferError::Protocol(
            "request header length mismatch".into(),
        ));
    }
    let check = u32::from_le_bytes([buf[end], buf[end + 1], buf[end + 2], buf[end + 3]]);
    if check != check32(&buf[..end]) {
        return Err(TransferError::Corrupt {
            what: "request header",
        });
    }
    if buf[37] & !FLAG_CHECKED != 0 || buf[39] != 0 || grant_len > MAX_GRANT_LEN {
        return Err(TransferError::Protocol("unknown request flags".into()));
    }
    let region = std::str::from_utf8(&buf[REQUEST_FIXED_LEN..region_end])
        .map_err(|_| TransferError::Protocol("region id is not UTF-8".into()))?;
    Ok(Request {
        op: Op::from_code(buf[3])?,
        id: u64_at(buf, 4),
        region,
        offset: u64_at(buf, 12),
        len: u64_at(buf, 20),
        checksum: u64_at(buf, 28),
        checked: buf[37] & FLAG_CHECKED != 0,
        grant: &buf[region_end..end],
    })
}

/// A response header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Response {
    /// [`STATUS_OK`] or the wire code of an [`ErrorKind`].
    pub status: u8,
    /// The request id answered.
    pub id: u64,
    /// Bytes that follow: data of a read, or an error message.
    pub len: u64,
    /// xxh3-64 of those bytes.
    pub checksum: u64,
}

impl Response {
    /// A success header for `len` payload bytes with `checksum`.
    pub fn ok(id: u64, len: u64, checksum: u64) -> Self {
        Self {
            status: STATUS_OK,
            id,
            len,
            checksum,
        }
    }

    /// A failure header followed by `message` (the caller sends those bytes).
    pub fn error(id: u64, kind: ErrorKind, message: &[u8]) -> Self {
        Self {
            status: kind.code(),
            id,
            len: message.len() as u64,
            checksum: xxh3_64(message),
        }
    }

    /// The encoded header.
    pub fn encode(&self) -> [u8; RESPONSE_LEN] {
        let mut out = [0u8; RESPONSE_LEN];
        out[0..2].copy_from_slice(&MAGIC.to_le_bytes());
        out[2] = VERSION;
        out[3] = self.status;
        out[4..12].copy_from_slice(&self.id.to_le_bytes());
        out[12..20].copy_from_slice(&self.len.to_le_bytes());
        out[20..28].copy_from_slice(&self.checksum.to_le_bytes());
        let check = check32(&out[..28]);
        out[28..32].copy_from_slice(&check.to_le_bytes());
        out
    }

    /// Decodes a response header.
    ///
    /// # Errors
    /// [`TransferError::Corrupt`] when the check fails, [`TransferError::Protocol`]
    /// for a wrong magic or version.
    pub fn decode(buf: &[u8; RESPONSE_LEN]) -> Result<Self, TransferError> {
        check_magic(buf)?;
        let check = u32::from_le_bytes([buf[28], buf[29], buf[30], buf[31]]);
        if check != check32(&buf[..28]) {
            return Err(TransferError::Corrupt {
                what: "response header",
            });
        }
        Ok(Self {
            status: buf[3],
            id: u64_at(buf, 4),
            len: u64_at(buf, 12),
            checksum: u64_at(buf, 20),
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn sample() -> Vec<u8> {
        let mut out = Vec::new();
        Request {
            op: Op::Write,
            id: 42,
            region: "node-1-seg-0",
            offset: 1 << 40,
            len: 65536,
            checksum: 0xdead_beef,
            checked: true,
            grant: b"a grant",
        }
        .encode(&mut out)
        .unwrap();
        out
    }

    #[test]
    fn request_round_trips() {
        let bytes = sample();
        let mut fixed = [0u8; REQUEST_FIXED_LEN];
        fixed.copy_from_slice(&bytes[..REQUEST_FIXED_LEN]);
        assert_eq!(
            request_rest_len(&fixed).unwrap() + REQUEST_FIXED_LEN,
            bytes.len()
        );
        let request = decode_request(&bytes).unwrap();
        assert_eq!(request.op, Op::Write);
        assert_eq!(request.id, 42);
        assert_eq!(request.region, "node-1-seg-0");
        assert_eq!(request.offset, 1 << 40);
        assert_eq!(request.len, 65536);
        assert_eq!(request.checksum, 0xdead_beef);
        assert!(request.checked);
        assert_eq!(request.grant, b"a grant");
    }

    #[test]
    fn every_flipped_bit_of_a_request_header_is_refused() {
        let bytes = sample();
        for byte in 0..bytes.len() {
            for bit in 0..8 {
                let mut bad = bytes.clone();
                bad[byte] ^= 1 << bit;
                assert!(decode_request(&bad).is_err(), "byte {byte} bit {bit}");
            }
        }
    }

    #[test]
    fn response_round_trips_and_detects_corruption() {
        let response = Response::error(7, ErrorKind::OutOfBounds, b"too far");
        let bytes = response.encode();
        assert_eq!(Response::decode(&bytes).unwrap(), response);
        for byte in 0..RESPONSE_LEN {
            let mut bad = bytes;
            bad[byte] ^= 0x10;
            assert!(Response::decode(&bad).is_err(), "byte {byte}");
        }
        let mut foreign = bytes;
        foreign[0] = b'G';
        assert_eq!(
            Response::decode(&foreign).unwrap_err().kind(),
            ErrorKind::Protocol
        );
    }

    proptest::proptest! {
        /// Any bytes given to the decoders give a frame or an error, never a
        /// panic; a request they accept encodes back to the same bytes.
        #[test]
        fn the_decoders_take_any_bytes(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400)) {
            if bytes.len() >= REQUEST_FIXED_LEN {
                let mut fixed = [0u8; REQUEST_FIXED_LEN];
                fixed.copy_from_slice(&bytes[..REQUEST_FIXED_LEN]);
                let _ = request_rest_len(&fixed);
            }
            if let Ok(request) = decode_request(&bytes) {
                let mut again = Vec::new();
                request.encode(&mut again).unwrap();
                proptest::prop_assert_eq!(again, bytes.clone());
            }
            if bytes.len() >= RESPONSE_LEN {
                let mut raw = [0u8; RESPONSE_LEN];
                raw.copy_from_slice(&bytes[..RESPONSE_LEN]);
                let _ = Response::decode(&raw);
            }
        }

        /// Every request, whatever its region and grant, decodes as encoded,
        /// and its rest length is read from its fixed part.
        #[test]
        fn requests_round_trip(
            region in "[a-z0-9-]{1,60}",
            grant in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..=MAX_GRANT_LEN),
            id: u64,
            offset: u64,
            len: u64,
            checksum: u64,
            checked: bool,
            read: bool,
        ) {
            let request = Request {
                op: if read { Op::Read } else { Op::Write },
                id,
                region: &region,
                offset,
                len,
                checksum,
                checked,
                grant: &grant,
            };
            let mut bytes = Vec::new();
            request.encode(&mut bytes).unwrap();
            let mut fixed = [0u8; REQUEST_FIXED_LEN];
            fixed.copy_from_slice(&bytes[..REQUEST_FIXED_LEN]);
            proptest::prop_assert_eq!(request_rest_len(&fixed).unwrap() + REQUEST_FIXED_LEN, bytes.len());
            proptest::prop_assert_eq!(decode_request(&bytes).unwrap(), request);
        }
    }

    #[test]
    fn unknown_operations_and_long_ids_are_errors() {
        let mut out = Vec::new();
        let long = "x".repeat(300);
        let request = Request {
            op: Op::Read,
            id: 1,
            region: &long,
            offset: 0,
            len: 1,
            checksum: 0,
            checked: false,
            grant: &[],
        };
        assert_eq!(
            request.encode(&mut out).unwrap_err().kind(),
            ErrorKind::Invalid
        );
        let long_grant = [0u8; MAX_GRANT_LEN + 1];
        let request = Request {
            region: "r",
            grant: &long_grant,
            ..request
        };
        assert_eq!(
            request.encode(&mut out).unwrap_err().kind(),
            ErrorKind::Invalid
        );
        assert_eq!(Op::from_code(9).unwrap_err().kind(), ErrorKind::Protocol);
        assert!(decode_request(&[0u8; 10]).is_err());
    }
}
