//! Lists of integers on the wire as one MessagePack byte string (each integer
//! little-endian, at its full width), encoded and decoded as a block instead of
//! one integer at a time. Decoding also takes the older form, an array of
//! integers, so a reader can be upgraded before the writer.

use std::fmt;
use std::marker::PhantomData;
use std::ops::Deref;

use serde::de::{self, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// An integer that travels in a [`Packed`] list.
pub trait PackedWord: Copy + for<'de> Deserialize<'de> {
    /// Bytes per integer on the wire.
    const BYTES: usize;
    /// What a byte string of these holds, for error messages.
    const EXPECTING: &'static str;

    /// Appends the integer, little-endian.
    fn put(self, out: &mut Vec<u8>);

    /// The integer of `chunk` (exactly [`Self::BYTES`] long), little-endian.
    fn get(chunk: &[u8]) -> Self;
}

/// Implements [`PackedWord`] for an unsigned integer type of `$bytes` bytes.
macro_rules! packed_word {
    ($type:ty, $bytes:literal) => {
        impl PackedWord for $type {
            const BYTES: usize = $bytes;
            const EXPECTING: &'static str = concat!(
                "a byte string of ",
                $bytes,
                "-byte little-endian integers, or an array of integers"
            );

            fn put(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }

            fn get(chunk: &[u8]) -> Self {
                let mut word = [0u8; $bytes];
                word.copy_from_slice(chunk);
                <$type>::from_le_bytes(word)
            }
        }
    };
}

packed_word!(u16, 2);
packed_word!(u64, 8);

/// A list of integers that travels packed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Packed<T>(pub Vec<T>);

/// 64-bit key hashes ([`crate::key_hash`]), packed: 8 bytes a hash.
pub type KeyHashes = Packed<u64>;

impl<T> Deref for Packed<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        &self.0
    }
}

impl<T> From<Vec<T>> for Packed<T> {
    fn from(values: Vec<T>) -> Self {
        Self(values)
    }
}

impl<T> FromIterator<T> for Packed<T> {
    fn from_iter<I: IntoIterator<Item = T>>(values: I) -> Self {
        Self(values.into_iter().collect())
    }
}

impl<'a, T> IntoIterator for &'a Packed<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

impl<T: PartialEq> PartialEq<Vec<T>> for Packed<T> {
    fn eq(&self, other: &Vec<T>) -> bool {
        &self.0 == other
    }
}

impl<T: PackedWord> Serialize for Packed<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut packed = Vec::with_capacity(self.0.len() * T::BYTES);
        for value in &self.0 {
            value.put(&mut packed);
        }
        serializer.serialize_bytes(&packed)
    }
}

impl<'de, T: PackedWord> Deserialize<'de> for Packed<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(PackedVisitor(PhantomData))
    }
}

struct PackedVisitor<T>(PhantomData<T>);

impl<'de, T: PackedWord> Visitor<'de> for PackedVisitor<T> {
    type Value = Packed<T>;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(T::EXPECTING)
    }

    fn visit_bytes<E: de::Error>(self, packed: &[u8]) -> Result<Packed<T>, E> {
        if packed.len() % T::BYTES != 0 {
            return Err(E::invalid_length(
                packed.len(),
                &format!("a multiple of {} bytes", T::BYTES).as_str(),
            ));
        }
        Ok(Packed(packed.chunks_exact(T::BYTES).map(T::get).collect()))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Packed<T>, A::Error> {
        // The size hint comes from the sender: trusted only up to a bound.
        let mut values = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
        while let Some(value) = seq.next_element::<T>()? {
            values.push(value);
        }
        Ok(Packed(values))
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Wire {
        hashes: KeyHashes,
        counts: Packed<u16>,
    }

    #[derive(Debug, Serialize)]
    struct AsIntegers {
        hashes: Vec<u64>,
        counts: Vec<u16>,
    }

    proptest! {
        #[test]
        fn lists_round_trip_and_the_array_form_decodes_alike(
            hashes in proptest::collection::vec(any::<u64>(), 0..200),
            counts in proptest::collection::vec(any::<u16>(), 0..200),
        ) {
            let wire = Wire { hashes: hashes.clone().into(), counts: counts.clone().into() };
            let packed = rmp_serde::to_vec(&wire).unwrap();
            let decoded: Wire = rmp_serde::from_slice(&packed).unwrap();
            prop_assert_eq!(&decoded, &wire);
            // The integers at full width, plus a few bytes of framing.
            prop_assert!(packed.len() <= hashes.len() * 8 + counts.len() * 2 + 24);
            let older = rmp_serde::to_vec(&AsIntegers { hashes: hashes.clone(), counts: counts.clone() }).unwrap();
            let decoded: Wire = rmp_serde::from_slice(&older).unwrap();
            prop_assert_eq!(&decoded, &wire);
        }

        #[test]
        fn arbitrary_bodies_decode_or_fail_cleanly(body in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = rmp_serde::from_slice::<Wire>(&body);
        }
    }

    #[derive(Serialize)]
    struct Raw<'a> {
        #[serde(with = "serde_bytes_like")]
        hashes: &'a [u8],
        #[serde(with = "serde_bytes_like")]
        counts: &'a [u8],
    }

    mod serde_bytes_like {
        pub fn serialize<S: serde::Serializer>(bytes: &&[u8], s: S) -> Result<S::Ok, S::Error> {
            s.serialize_bytes(bytes)
        }
    }

    #[test]
    fn a_byte_string_cut_mid_integer_is_refused() {
        let body = rmp_serde::to_vec(&Raw {
            hashes: &[1, 2, 3, 4, 5, 6, 7, 8, 9],
            counts: &[],
        })
        .unwrap();
        let error = rmp_serde::from_slice::<Wire>(&body).unwrap_err();
        assert!(error.to_string().contains("multiple of 8"), "{error}");
        let body = rmp_serde::to_vec(&Raw {
            hashes: &[],
            counts: &[1, 2, 3],
        })
        .unwrap();
        let error = rmp_serde::from_slice::<Wire>(&body).unwrap_err();
        assert!(error.to_string().contains("multiple of 2"), "{error}");
    }
}
