//! Key hashes on the wire as one MessagePack byte string (8 bytes each,
//! little-endian), encoded and decoded as a block instead of one integer at a
//! time. Decoding also takes the older form, an array of integers, so either
//! side may be upgraded first.

use std::fmt;
use std::ops::Deref;

use serde::de::{self, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Bytes per hash on the wire.
const HASH_BYTES: usize = 8;

/// A list of 64-bit key hashes ([`crate::key_hash`]) that travels packed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyHashes(pub Vec<u64>);

impl Deref for KeyHashes {
    type Target = [u64];

    fn deref(&self) -> &[u64] {
        &self.0
    }
}

impl From<Vec<u64>> for KeyHashes {
    fn from(hashes: Vec<u64>) -> Self {
        Self(hashes)
    }
}

impl FromIterator<u64> for KeyHashes {
    fn from_iter<I: IntoIterator<Item = u64>>(hashes: I) -> Self {
        Self(hashes.into_iter().collect())
    }
}

impl Serialize for KeyHashes {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut packed = Vec::with_capacity(self.0.len() * HASH_BYTES);
        for hash in &self.0 {
            packed.extend_from_slice(&hash.to_le_bytes());
        }
        serializer.serialize_bytes(&packed)
    }
}

impl<'de> Deserialize<'de> for KeyHashes {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(KeyHashesVisitor)
    }
}

struct KeyHashesVisitor;

impl<'de> Visitor<'de> for KeyHashesVisitor {
    type Value = KeyHashes;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(
            "key hashes: a byte string of 8-byte little-endian hashes, or an array of integers",
        )
    }

    fn visit_bytes<E: de::Error>(self, packed: &[u8]) -> Result<KeyHashes, E> {
        if packed.len() % HASH_BYTES != 0 {
            return Err(E::invalid_length(packed.len(), &"a multiple of 8 bytes"));
        }
        Ok(KeyHashes(
            packed
                .chunks_exact(HASH_BYTES)
                .map(|chunk| {
                    let mut word = [0u8; HASH_BYTES];
                    word.copy_from_slice(chunk);
                    u64::from_le_bytes(word)
                })
                .collect(),
        ))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<KeyHashes, A::Error> {
        // The size hint comes from the sender: trusted only up to a bound.
        let mut hashes = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
        while let Some(hash) = seq.next_element::<u64>()? {
            hashes.push(hash);
        }
        Ok(KeyHashes(hashes))
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Packed {
        hashes: KeyHashes,
    }

    #[derive(Debug, Serialize)]
    struct AsIntegers {
        hashes: Vec<u64>,
    }

    proptest! {
        #[test]
        fn hashes_round_trip_and_the_array_form_decodes_alike(hashes in proptest::collection::vec(any::<u64>(), 0..200)) {
            let packed = rmp_serde::to_vec(&Packed { hashes: hashes.clone().into() }).unwrap();
            let decoded: Packed = rmp_serde::from_slice(&packed).unwrap();
            prop_assert_eq!(&decoded.hashes.0, &hashes);
            // 8 bytes a hash, plus a few of framing.
            prop_assert!(packed.len() <= hashes.len() * 8 + 16);
            let older = rmp_serde::to_vec(&AsIntegers { hashes: hashes.clone() }).unwrap();
            let decoded: Packed = rmp_serde::from_slice(&older).unwrap();
            prop_assert_eq!(&decoded.hashes.0, &hashes);
        }

        #[test]
        fn arbitrary_bodies_decode_or_fail_cleanly(body in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = rmp_serde::from_slice::<Packed>(&body);
        }
    }

    #[test]
    fn a_byte_string_cut_mid_hash_is_refused() {
        #[derive(Serialize)]
        struct Raw<'a> {
            #[serde(with = "serde_bytes_like")]
            hashes: &'a [u8],
        }
        mod serde_bytes_like {
            pub fn serialize<S: serde::Serializer>(bytes: &&[u8], s: S) -> Result<S::Ok, S::Error> {
                s.serialize_bytes(bytes)
            }
        }
        let body = rmp_serde::to_vec(&Raw {
            hashes: &[1, 2, 3, 4, 5, 6, 7, 8, 9],
        })
        .unwrap();
        let error = rmp_serde::from_slice::<Packed>(&body).unwrap_err();
        assert!(error.to_string().contains("multiple of 8"), "{error}");
    }
}
