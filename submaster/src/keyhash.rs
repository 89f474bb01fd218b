//! The hasher of the state's maps: one xxh3-64 call per key, seeded randomly per
//! process like the standard library's hasher. Folding a put hashes its key and its
//! segment names several times, and SipHash-1-3 over 40-byte keys was the largest
//! single cost of replaying a stream.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};

/// Builds [`KeyHasher`]s with this map's seed.
#[derive(Debug, Clone, Copy)]
pub struct KeyHashBuilder {
    seed: u64,
}

impl Default for KeyHashBuilder {
    fn default() -> Self {
        Self {
            seed: RandomState::new().hash_one(0x6b65_7968_6173_6800_u64),
        }
    }
}

impl BuildHasher for KeyHashBuilder {
    type Hasher = KeyHasher;

    fn build_hasher(&self) -> KeyHasher {
        KeyHasher(self.seed)
    }
}

/// Multiplies into 128 bits and folds the halves: every input bit reaches every
/// output bit, which the map's bucket index (low bits) and tag (high bits) need.
fn fold_mul(a: u64, b: u64) -> u64 {
    let product = u128::from(a) * u128::from(b);
    (product as u64) ^ ((product >> 64) as u64)
}

const MIX: u64 = 0x9e37_79b9_7f4a_7c15;

/// The hasher: byte strings go through xxh3-64 seeded with the running state;
/// integers are mixed in with a folded multiply.
#[derive(Debug, Clone, Copy)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        self.0 = xxhash_rust::xxh3::xxh3_64_with_seed(bytes, self.0);
    }

    fn write_u8(&mut self, value: u8) {
        self.write_u64(u64::from(value));
    }

    fn write_u32(&mut self, value: u32) {
        self.write_u64(u64::from(value));
    }

    fn write_u64(&mut self, value: u64) {
        self.0 = fold_mul(self.0 ^ value, MIX);
    }

    fn write_usize(&mut self, value: usize) {
        self.write_u64(value as u64);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_keys_hash_equal_and_different_keys_differ() {
        let builder = KeyHashBuilder::default();
        assert_eq!(builder.hash_one("block/1"), builder.hash_one("block/1"));
        assert_ne!(builder.hash_one("block/1"), builder.hash_one("block/2"));
        // `str` hashing appends a terminator, so these differ too.
        assert_ne!(builder.hash_one(("ab", "c")), builder.hash_one(("a", "bc")));
    }

    #[test]
    fn the_seed_differs_between_maps() {
        let (a, b) = (KeyHashBuilder::default(), KeyHashBuilder::default());
        assert_ne!(a.hash_one("block/1"), b.hash_one("block/1"));
    }
}
