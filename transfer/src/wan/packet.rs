//! Packets of a WAN copy: shards and end-of-round probes from sender to receiver,
//! acknowledgements and lists of missing stripes back. Each packet ends with the
//! xxh3-64 of everything before it; a packet that fails it is dropped like a lost
//! one.
//!
//! ```text
//! kind u8 | object u64 | round u32 | stripe u32 | shard u16 | stripes u32
//! | object len u64 | payload | xxh3 u64
//! ```

use bytes::{BufMut as _, Bytes, BytesMut};
use xxhash_rust::xxh3::xxh3_64;

use crate::error::TransferError;

const HEADER: usize = 31;
const TRAILER: usize = 8;
/// Bytes a packet adds to its payload.
pub const PACKET_OVERHEAD: usize = HEADER + TRAILER;

/// The object a packet belongs to and its shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObjectHeader {
    /// The object's number on this sender (increasing).
    pub object: u64,
    /// Stripes in the object.
    pub stripes: u32,
    /// The object's length in bytes.
    pub len: u64,
}

/// One packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Packet {
    /// One shard of one stripe.
    Shard {
        /// The object.
        header: ObjectHeader,
        /// The sending round.
        round: u32,
        /// The stripe.
        stripe: u32,
        /// The shard's index: originals first, then recovery shards. The stripe's
        /// shape (smaller for a short last stripe) follows from `header.len`
        /// ([`FecConfig::shape_of_stripe`](super::FecConfig::shape_of_stripe)); the
        /// receiver drops a shard whose index is beyond it.
        index: u16,
        /// The shard's bytes.
        payload: Bytes,
    },
    /// The end of a round: the receiver answers with an `Ack` or a `Nack`.
    Probe {
        /// The object.
        header: ObjectHeader,
        /// The round that ended.
        round: u32,
    },
    /// Stripes still missing after `round`.
    Nack {
        /// The object.
        object: u64,
        /// The round answered.
        round: u32,
        /// The stripes to send again.
        missing: Vec<u32>,
    },
    /// The whole object arrived.
    Ack {
        /// The object.
        object: u64,
    },
}

struct Fields {
    kind: u8,
    object: u64,
    round: u32,
    stripe: u32,
    index: u16,
    stripes: u32,
    len: u64,
}

fn seal(fields: &Fields, payload: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(PACKET_OVERHEAD + payload.len());
    out.put_u8(fields.kind);
    out.put_u64_le(fields.object);
    out.put_u32_le(fields.round);
    out.put_u32_le(fields.stripe);
    out.put_u16_le(fields.index);
    out.put_u32_le(fields.stripes);
    out.put_u64_le(fields.len);
    out.put_slice(payload);
    let check = xxh3_64(&out);
    out.put_u64_le(check);
    out.freeze()
}

impl Packet {
    /// Encodes a shard packet straight from the shard's bytes.
    pub fn shard(
        header: ObjectHeader,
        round: u32,
        stripe: u32,
        index: u16,
        payload: &[u8],
    ) -> Bytes {
        seal(
            &Fields {
                kind: 1,
                object: header.object,
                round,
                stripe,
                index,
                stripes: header.stripes,
                len: header.len,
            },
            payload,
        )
    }

    /// Encodes the packet.
    pub fn encode(&self) -> Bytes {
        match self {
            Self::Shard {
                header,
                round,
                stripe,
                index,
                payload,
            } => Self::shard(*header, *round, *stripe, *index, payload),
            Self::Probe { header, round } => seal(
                &Fields {
                    kind: 2,
                    object: header.object,
                    round: *round,
                    stripe: 0,
                    index: 0,
                    stripes: header.stripes,
                    len: header.len,
                },
                &[],
            ),
            Self::Nack {
                object,
                round,
                missing,
            } => {
                let list: Vec<u8> = missing.iter().flat_map(|s| s.to_le_bytes()).collect();
                seal(
                    &Fields {
                        kind: 3,
                        object: *object,
                        round: *round,
                        stripe: 0,
                        index: 0,
                        stripes: missing.len() as u32,
                        len: 0,
                    },
                    &list,
                )
            }
            Self::Ack { object } => seal(
                &Fields {
                    kind: 4,
                    object: *object,
                    round: 0,
                    stripe: 0,
                    index: 0,
                    stripes: 0,
                    len: 0,
                },
                &[],
            ),
        }
    }

    /// Decodes a packet; a shard's payload shares `bytes`.
    ///
    /// # Errors
    /// [`TransferError::Corrupt`] when the check fails, [`TransferError::Protocol`]
    /// when the fields do not make sense.
    pub fn decode(bytes: &Bytes) -> Result<Self, TransferError> {
        if bytes.len() < PACKET_OVERHEAD {
            return Err(TransferError::Protocol("truncated WAN packet".into()));
        }
        let body = bytes.len() - TRAILER;
        let mut check = [0u8; 8];
        check.copy_from_slice(&bytes[body..]);
        if u64::from_le_bytes(check) != xxh3_64(&bytes[..body]) {
            return Err(TransferError::Corrupt { what: "WAN packet" });
        }
        let b = &bytes[..];
        let u32_at = |at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        let u64_at = |at: usize| {
            let mut raw = [0u8; 8];
            raw.copy_from_slice(&b[at..at + 8]);
            u64::from_le_bytes(raw)
        };
        let object = u64_at(1);
        let round = u32_at(9);
        let header = ObjectHeader {
            object,
            stripes: u32_at(19),
            len: u64_at(23),
        };
        match b[0] {
            1 => Ok(Self::Shard {
                header,
                round,
                stripe: u32_at(13),
                index: u16::from_le_bytes([b[17], b[18]]),
                payload: bytes.slice(HEADER..body),
            }),
            2 => Ok(Self::Probe { header, round }),
            3 => {
                let list = &b[HEADER..body];
                if list.len() != header.stripes as usize * 4 {
                    return Err(TransferError::Protocol("NACK list length mismatch".into()));
                }
                let missing = list
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                Ok(Self::Nack {
                    object,
                    round,
                    missing,
                })
            }
            4 => Ok(Self::Ack { object }),
            kind => Err(TransferError::Protocol(format!(
                "unknown WAN packet kind {kind}"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn packets_round_trip_and_corruption_is_detected() {
        let header = ObjectHeader {
            object: 3,
            stripes: 9,
            len: 100_000,
        };
        let packets = [
            Packet::Shard {
                header,
                round: 2,
                stripe: 7,
                index: 17,
                payload: Bytes::from_static(b"shard bytes"),
            },
            Packet::Probe { header, round: 4 },
            Packet::Nack {
                object: 3,
                round: 4,
                missing: vec![1, 5, 8],
            },
            Packet::Ack { object: 3 },
        ];
        for packet in packets {
            let bytes = packet.encode();
            assert_eq!(Packet::decode(&bytes).unwrap(), packet);
            for at in 0..bytes.len() {
                let mut bad = bytes.to_vec();
                bad[at] ^= 0x08;
                assert!(Packet::decode(&Bytes::from(bad)).is_err(), "byte {at}");
            }
        }
        assert!(Packet::decode(&Bytes::from_static(b"short")).is_err());
    }
}
