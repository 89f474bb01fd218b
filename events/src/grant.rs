//! Data-port grants: what the sub-master allows a holder to do on a node's data
//! port. A [`Grant`] names a range of one segment, read or write, and an expiry,
//! and carries a 128-bit keyed BLAKE3 tag made with the [`GrantKey`] that the
//! sub-master and the nodes of its sub-cluster share (kept in the `grants` KV
//! bucket, which only sub-masters and nodes may read). A node checks the tag, the
//! access, the range and the expiry of every operation itself, without a round
//! trip; whoever lacks the key cannot make a grant, change one, or stretch it to
//! other bytes.
//!
//! A grant travels in a [`ReplicaLocation`](crate::rpc::submaster::ReplicaLocation)
//! (a `put_start`, a space lease, a `get_replica_list`) and, in its fixed
//! [`GRANT_WIRE_LEN`]-byte form, in every request header of the data port.

use constant_time_eq::constant_time_eq_16;
use serde::{Deserialize, Serialize};

/// Bytes of a grant's wire form ([`Grant::to_wire`]).
pub const GRANT_WIRE_LEN: usize = 45;
/// Bytes of a [`GrantKey`]'s secret.
pub const GRANT_SECRET_LEN: usize = 32;
/// How far past its expiry a node still takes a grant: the clocks of the
/// sub-master and the node may differ by this much.
pub const CLOCK_SKEW_MS: u64 = 2_000;
/// Domain separation of the tag: a grant's tag is never a valid tag of anything
/// else keyed the same way.
const CONTEXT: &[u8] = b"hkvm data-port grant v1";

/// What a grant allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Access {
    /// Reading the range.
    Read,
    /// Writing the range (a reservation or a leased range: not yet visible to
    /// readers).
    Write,
}

impl Access {
    fn code(self) -> u8 {
        match self {
            Self::Read => 1,
            Self::Write => 2,
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(Self::Read),
            2 => Some(Self::Write),
            _ => None,
        }
    }
}

/// A signed permission to read or write `[offset, offset + len)` of one segment
/// until `expires_unix_ms`. The segment is not stored: it is bound by the tag,
/// and named by the request the grant comes with. Serialized as its wire form
/// (MessagePack `bin`, 47 bytes), not as a map of named fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// The key that made the tag.
    pub key_id: u32,
    /// Read or write.
    pub access: Access,
    /// Start of the range.
    pub offset: u64,
    /// Length of the range.
    pub len: u64,
    /// Unix time (ms) after which it is refused.
    pub expires_unix_ms: u64,
    /// Keyed BLAKE3 of everything above and the segment id, first 16 bytes.
    pub tag: [u8; 16],
}

impl Grant {
    /// The fixed-size form carried in a data-port request header.
    pub fn to_wire(&self) -> [u8; GRANT_WIRE_LEN] {
        let mut out = [0u8; GRANT_WIRE_LEN];
        out[..29].copy_from_slice(&self.signed_fields());
        out[29..].copy_from_slice(&self.tag);
        out
    }

    /// Reads the wire form back.
    ///
    /// # Errors
    /// [`GrantError::Malformed`] for a wrong length or an unknown access code.
    pub fn from_wire(bytes: &[u8]) -> Result<Self, GrantError> {
        if bytes.len() != GRANT_WIRE_LEN {
            return Err(GrantError::Malformed(format!(
                "{} bytes, not {GRANT_WIRE_LEN}",
                bytes.len()
            )));
        }
        let u64_at = |at: usize| {
            let mut raw = [0u8; 8];
            raw.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(raw)
        };
        let access = Access::from_code(bytes[4])
            .ok_or_else(|| GrantError::Malformed(format!("access code {}", bytes[4])))?;
        let mut tag = [0u8; 16];
        tag.copy_from_slice(&bytes[29..]);
        Ok(Self {
            key_id: u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]),
            access,
            offset: u64_at(5),
            len: u64_at(13),
            expires_unix_ms: u64_at(21),
            tag,
        })
    }

    fn signed_fields(&self) -> [u8; 29] {
        let mut out = [0u8; 29];
        out[..4].copy_from_slice(&self.key_id.to_le_bytes());
        out[4] = self.access.code();
        out[5..13].copy_from_slice(&self.offset.to_le_bytes());
        out[13..21].copy_from_slice(&self.len.to_le_bytes());
        out[21..29].copy_from_slice(&self.expires_unix_ms.to_le_bytes());
        out
    }

    /// Whether the grant covers `[offset, offset + len)`.
    pub fn covers(&self, offset: u64, len: u64) -> bool {
        offset >= self.offset
            && offset
                .checked_add(len)
                .zip(self.offset.checked_add(self.len))
                .is_some_and(|(end, granted_end)| end <= granted_end)
    }
}

impl Serialize for Grant {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(&self.to_wire())
    }
}

impl<'de> Deserialize<'de> for Grant {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct WireVisitor;

        impl<'de> serde::de::Visitor<'de> for WireVisitor {
            type Value = Grant;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "a grant's {GRANT_WIRE_LEN} bytes")
            }

            fn visit_bytes<E: serde::de::Error>(self, bytes: &[u8]) -> Result<Grant, E> {
                Grant::from_wire(bytes).map_err(E::custom)
            }
        }

        deserializer.deserialize_bytes(WireVisitor)
    }
}

/// The secret a sub-master signs grants with and its nodes check them with.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrantKey {
    /// Its id, carried in every grant it signs (so that keys can be rotated).
    pub id: u32,
    /// The secret.
    pub secret: [u8; GRANT_SECRET_LEN],
}

impl std::fmt::Debug for GrantKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the secret: keys end up in logs through Debug.
        f.debug_struct("GrantKey").field("id", &self.id).finish()
    }
}

/// What is signed for a grant: the range, the access and the expiry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrantRequest<'a> {
    /// The segment.
    pub segment: &'a str,
    /// Read or write.
    pub access: Access,
    /// Start of the range.
    pub offset: u64,
    /// Length of the range.
    pub len: u64,
    /// Unix time (ms) after which it is refused.
    pub expires_unix_ms: u64,
}

impl GrantKey {
    /// Signs a grant.
    pub fn sign(&self, request: GrantRequest<'_>) -> Grant {
        let mut grant = Grant {
            key_id: self.id,
            access: request.access,
            offset: request.offset,
            len: request.len,
            expires_unix_ms: request.expires_unix_ms,
            tag: [0; 16],
        };
        grant.tag = self.tag(request.segment, &grant);
        grant
    }

    fn tag(&self, segment: &str, grant: &Grant) -> [u8; 16] {
        let mut hasher = blake3::Hasher::new_keyed(&self.secret);
        hasher.update(CONTEXT);
        hasher.update(&(segment.len() as u64).to_le_bytes());
        hasher.update(segment.as_bytes());
        hasher.update(&grant.signed_fields());
        let mut tag = [0u8; 16];
        tag.copy_from_slice(&hasher.finalize().as_bytes()[..16]);
        tag
    }

    /// The record kept in the grants bucket.
    ///
    /// # Errors
    /// [`GrantError::Malformed`] when serializing fails (it does not for this type).
    pub fn encode(&self) -> Result<Vec<u8>, GrantError> {
        rmp_serde::to_vec(self).map_err(|e| GrantError::Malformed(e.to_string()))
    }

    /// Reads a record of the grants bucket.
    ///
    /// # Errors
    /// [`GrantError::Malformed`] for anything but a key record.
    pub fn decode(bytes: &[u8]) -> Result<Self, GrantError> {
        rmp_serde::from_slice(bytes).map_err(|e| GrantError::Malformed(e.to_string()))
    }
}

/// The keys a node accepts grants of: the current one and, during a rotation, the
/// one before it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GrantKeyring {
    keys: Vec<GrantKey>,
}

/// What a data-port operation asks to do, checked against its grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Operation<'a> {
    /// The segment.
    pub segment: &'a str,
    /// Read or write.
    pub access: Access,
    /// Start of the range.
    pub offset: u64,
    /// Length of the range.
    pub len: u64,
}

impl GrantKeyring {
    /// A keyring with `current` only.
    pub fn new(current: GrantKey) -> Self {
        Self {
            keys: vec![current],
        }
    }

    /// Makes `key` the current key; the previous current key is still accepted
    /// (grants it signed are in flight), any older one no longer.
    pub fn rotate_to(&mut self, key: GrantKey) {
        if self.keys.first() == Some(&key) {
            return;
        }
        self.keys.retain(|held| held.id != key.id);
        self.keys.insert(0, key);
        self.keys.truncate(2);
    }

    /// The key grants are signed with now.
    pub fn current(&self) -> Option<&GrantKey> {
        self.keys.first()
    }

    /// Checks that `grant` (its wire form, empty when the request carried none)
    /// allows `operation` at `now_unix_ms`.
    ///
    /// # Errors
    /// The first reason it does not: [`GrantError::Missing`],
    /// [`GrantError::Malformed`], [`GrantError::NoKey`], [`GrantError::UnknownKey`],
    /// [`GrantError::Forged`], [`GrantError::WrongAccess`],
    /// [`GrantError::OutOfRange`] or [`GrantError::Expired`].
    pub fn check(
        &self,
        grant: &[u8],
        operation: Operation<'_>,
        now_unix_ms: u64,
    ) -> Result<(), GrantError> {
        if grant.is_empty() {
            return Err(GrantError::Missing);
        }
        let grant = Grant::from_wire(grant)?;
        if self.keys.is_empty() {
            return Err(GrantError::NoKey);
        }
        let key = self
            .keys
            .iter()
            .find(|key| key.id == grant.key_id)
            .ok_or(GrantError::UnknownKey(grant.key_id))?;
        if !constant_time_eq_16(&key.tag(operation.segment, &grant), &grant.tag) {
            return Err(GrantError::Forged);
        }
        if grant.access != operation.access {
            return Err(GrantError::WrongAccess {
                granted: grant.access,
                asked: operation.access,
            });
        }
        if !grant.covers(operation.offset, operation.len) {
            return Err(GrantError::OutOfRange {
                offset: operation.offset,
                len: operation.len,
                granted_offset: grant.offset,
                granted_len: grant.len,
            });
        }
        if now_unix_ms > grant.expires_unix_ms.saturating_add(CLOCK_SKEW_MS) {
            return Err(GrantError::Expired {
                expired_ms_ago: now_unix_ms - grant.expires_unix_ms,
            });
        }
        Ok(())
    }
}

/// Why a data-port operation is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrantError {
    /// The request carried no grant.
    #[error("no grant: the data port serves only what a sub-master granted")]
    Missing,
    /// The grant's bytes are not a grant.
    #[error("malformed grant: {0}")]
    Malformed(String),
    /// The node has no key yet (it has not read its sub-cluster's grant key).
    #[error("this node has no grant key yet")]
    NoKey,
    /// Signed with a key this node does not hold (rotated out, or another
    /// sub-cluster's).
    #[error("grant signed with key {0}, which this node does not hold")]
    UnknownKey(u32),
    /// The tag does not match: made or changed without the key, or for another
    /// segment.
    #[error("grant tag does not match (forged, altered, or for another segment)")]
    Forged,
    /// A read grant used to write, or the other way round.
    #[error("grant allows {granted:?}, the request asks {asked:?}")]
    WrongAccess {
        /// What the grant allows.
        granted: Access,
        /// What the request asked.
        asked: Access,
    },
    /// The request reaches outside the granted range.
    #[error("range {offset}+{len} is outside the granted {granted_offset}+{granted_len}")]
    OutOfRange {
        /// Start asked.
        offset: u64,
        /// Length asked.
        len: u64,
        /// Start granted.
        granted_offset: u64,
        /// Length granted.
        granted_len: u64,
    },
    /// Past its expiry (beyond the allowed clock skew).
    #[error("grant expired {expired_ms_ago} ms ago")]
    Expired {
        /// How long ago.
        expired_ms_ago: u64,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(id: u32, fill: u8) -> GrantKey {
        GrantKey {
            id,
            secret: [fill; GRANT_SECRET_LEN],
        }
    }

    fn write_grant(key: &GrantKey) -> Grant {
        key.sign(GrantRequest {
            segment: "node-a/seg",
            access: Access::Write,
            offset: 4096,
            len: 8192,
            expires_unix_ms: 10_000,
        })
    }

    fn op(access: Access, offset: u64, len: u64) -> Operation<'static> {
        Operation {
            segment: "node-a/seg",
            access,
            offset,
            len,
        }
    }

    #[test]
    fn a_grant_allows_what_it_names_and_nothing_else() {
        let key = key(7, 1);
        let ring = GrantKeyring::new(key.clone());
        let wire = write_grant(&key).to_wire();
        assert_eq!(
            ring.check(&wire, op(Access::Write, 4096, 8192), 9_000),
            Ok(())
        );
        assert_eq!(
            ring.check(&wire, op(Access::Write, 6000, 100), 9_000),
            Ok(())
        );
        assert!(matches!(
            ring.check(&wire, op(Access::Read, 4096, 10), 9_000),
            Err(GrantError::WrongAccess { .. })
        ));
        assert!(matches!(
            ring.check(&wire, op(Access::Write, 4095, 10), 9_000),
            Err(GrantError::OutOfRange { .. })
        ));
        assert!(matches!(
            ring.check(&wire, op(Access::Write, 4096, 8193), 9_000),
            Err(GrantError::OutOfRange { .. })
        ));
        assert!(matches!(
            ring.check(&wire, op(Access::Write, u64::MAX, 2), 9_000),
            Err(GrantError::OutOfRange { .. })
        ));
        let other_segment = Operation {
            segment: "node-b/seg",
            ..op(Access::Write, 4096, 10)
        };
        assert_eq!(
            ring.check(&wire, other_segment, 9_000),
            Err(GrantError::Forged)
        );
        assert_eq!(
            ring.check(&wire, op(Access::Write, 4096, 1), 10_000 + CLOCK_SKEW_MS),
            Ok(())
        );
        assert!(matches!(
            ring.check(&wire, op(Access::Write, 4096, 1), 10_001 + CLOCK_SKEW_MS),
            Err(GrantError::Expired { .. })
        ));
        assert_eq!(
            ring.check(&[], op(Access::Write, 4096, 1), 0),
            Err(GrantError::Missing)
        );
    }

    #[test]
    fn grants_of_another_key_and_without_a_key_are_refused() {
        let ring = GrantKeyring::new(key(1, 1));
        let foreign = write_grant(&key(1, 2)).to_wire();
        assert_eq!(
            ring.check(&foreign, op(Access::Write, 4096, 1), 0),
            Err(GrantError::Forged)
        );
        let unknown = write_grant(&key(9, 1)).to_wire();
        assert_eq!(
            ring.check(&unknown, op(Access::Write, 4096, 1), 0),
            Err(GrantError::UnknownKey(9))
        );
        assert_eq!(
            GrantKeyring::default().check(&unknown, op(Access::Write, 4096, 1), 0),
            Err(GrantError::NoKey)
        );
    }

    #[test]
    fn a_rotation_keeps_the_previous_key_and_drops_older_ones() {
        let mut ring = GrantKeyring::new(key(1, 1));
        let first = write_grant(&key(1, 1)).to_wire();
        ring.rotate_to(key(2, 2));
        assert_eq!(ring.current().map(|k| k.id), Some(2));
        assert_eq!(ring.check(&first, op(Access::Write, 4096, 1), 0), Ok(()));
        ring.rotate_to(key(3, 3));
        assert_eq!(
            ring.check(&first, op(Access::Write, 4096, 1), 0),
            Err(GrantError::UnknownKey(1))
        );
        ring.rotate_to(key(3, 3));
        let second = write_grant(&key(2, 2)).to_wire();
        assert_eq!(ring.check(&second, op(Access::Write, 4096, 1), 0), Ok(()));
    }

    #[test]
    fn a_grant_is_serialized_as_its_wire_bytes() {
        let grant = write_grant(&key(7, 1));
        let bytes = rmp_serde::to_vec_named(&grant).unwrap();
        assert_eq!(bytes.len(), 2 + GRANT_WIRE_LEN);
        assert_eq!(rmp_serde::from_slice::<Grant>(&bytes).unwrap(), grant);
        let short = rmp_serde::to_vec_named(&serde_bytes_of(&[1, 2, 3])).unwrap();
        assert!(rmp_serde::from_slice::<Grant>(&short).is_err());
        assert!(rmp_serde::from_slice::<Grant>(b"\x93\x01\x02\x03").is_err());
    }

    /// Bytes serialized as MessagePack `bin`, as a grant is.
    fn serde_bytes_of(bytes: &[u8]) -> impl Serialize + '_ {
        struct Bin<'a>(&'a [u8]);
        impl Serialize for Bin<'_> {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_bytes(self.0)
            }
        }
        Bin(bytes)
    }

    #[test]
    fn keys_round_trip_and_never_print_their_secret() {
        let key = key(3, 0xab);
        assert_eq!(GrantKey::decode(&key.encode().unwrap()).unwrap(), key);
        assert!(!format!("{key:?}").contains("171"));
        assert!(GrantKey::decode(b"\xc1").is_err());
    }

    proptest! {
        /// Any change to any byte of a grant's wire form is refused: either it
        /// no longer decodes, or its tag no longer matches.
        #[test]
        fn every_altered_byte_is_refused(at in 0..GRANT_WIRE_LEN, flip in 1u8..=255) {
            let key = key(7, 1);
            let ring = GrantKeyring::new(key.clone());
            let mut wire = write_grant(&key).to_wire();
            wire[at] ^= flip;
            prop_assert!(ring.check(&wire, op(Access::Write, 4096, 1), 0).is_err());
        }

        /// The decoder takes any bytes without panicking, and what it accepts
        /// encodes back to the same bytes.
        #[test]
        fn the_wire_decoder_takes_any_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            if let Ok(grant) = Grant::from_wire(&bytes) {
                let wire = grant.to_wire();
                prop_assert_eq!(wire.as_slice(), bytes.as_slice());
            }
        }
    }
}
