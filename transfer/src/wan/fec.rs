//! Reed–Solomon forward error correction over stripes: a stripe is `data_shards`
//! shards of `shard_bytes` each, sent with `parity_shards` recovery shards, and any
//! `data_shards` of the `data_shards + parity_shards` rebuild it (through the
//! `reed-solomon-simd` crate, O(n log n) in the shard count).
//!
//! The last stripe of an object is usually short. It is not padded to a whole
//! stripe: a tail of `L` bytes is cut into `data = ceil(L / shard_bytes)` original
//! shards (the last one zero-padded to `shard_bytes`) and sent with
//! `parity = max(1, ceil(data × parity_shards / data_shards))` recovery shards, the
//! same ratio of losses repaired, so its cost on the wire is proportional to its
//! size. Both ends derive that shape from the object's length
//! ([`FecConfig::shape_of_stripe`]); any `data` of its `data + parity` shards rebuild
//! it.
//!
//! Rebuilding a stripe that lost shards has a fixed cost of a few hundred
//! microseconds whatever its size (the error locator is evaluated over the whole
//! field), so stripes are large by default: 64 + 16 shards of 1 KiB, 64 KiB of data
//! and a fifth of its shards lost before a stripe must be sent again.

use reed_solomon_simd::{ReedSolomonDecoder, ReedSolomonEncoder};

use crate::error::TransferError;

/// The shape of a stripe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FecConfig {
    /// Original shards per stripe.
    pub data_shards: usize,
    /// Recovery shards per stripe: the losses per stripe that need no retransmission.
    pub parity_shards: usize,
    /// Bytes per shard (even; a shard plus its header is one packet on the link).
    pub shard_bytes: usize,
}

impl Default for FecConfig {
    fn default() -> Self {
        Self {
            data_shards: 64,
            parity_shards: 16,
            shard_bytes: 1024,
        }
    }
}

impl FecConfig {
    /// Payload bytes per stripe.
    pub fn stripe_bytes(&self) -> usize {
        self.data_shards * self.shard_bytes
    }

    /// Shards per stripe, original and recovery.
    pub fn total_shards(&self) -> usize {
        self.data_shards + self.parity_shards
    }

    /// Stripes needed for `len` bytes.
    pub fn stripes_for(&self, len: u64) -> u64 {
        len.div_ceil(self.stripe_bytes() as u64)
    }

    /// The shape `(data, parity)` of stripe `stripe` of an object of `len` bytes:
    /// the configured `(data_shards, parity_shards)` for a whole stripe; for the
    /// last stripe of an object holding `L < stripe_bytes` bytes,
    /// `data = ceil(L / shard_bytes)` original shards (the last one zero-padded) and
    /// `parity = max(1, ceil(data × parity_shards / data_shards))` recovery shards,
    /// so a short stripe costs in proportion to its size and tolerates the same
    /// ratio of losses. `(0, 0)` for a stripe past the end of the object (or a
    /// configuration without data shards or shard bytes).
    pub fn shape_of_stripe(&self, len: u64, stripe: u64) -> (usize, usize) {
        let stripe_bytes = self.stripe_bytes() as u64;
        if stripe_bytes == 0 {
            return (0, 0);
        }
        let held = stripe
            .checked_mul(stripe_bytes)
            .map_or(0, |start| len.saturating_sub(start))
            .min(stripe_bytes);
        if held == 0 {
            return (0, 0);
        }
        // `held <= stripe_bytes`, so `data <= data_shards`.
        let data = held.div_ceil(self.shard_bytes as u64) as usize;
        if data == self.data_shards {
            return (self.data_shards, self.parity_shards);
        }
        let parity = (data as u128 * self.parity_shards as u128)
            .div_ceil(self.data_shards as u128)
            .max(1);
        (data, usize::try_from(parity).unwrap_or(usize::MAX))
    }
}

fn fec_error(error: reed_solomon_simd::Error) -> TransferError {
    TransferError::Fec(error.to_string())
}

/// Encodes and decodes stripes of one configuration's shard size, in its full shape
/// or the smaller shape of a short last stripe, reusing its working memory.
pub struct StripeCodec {
    config: FecConfig,
    encoder: ReedSolomonEncoder,
    decoder: ReedSolomonDecoder,
    padded: Vec<u8>,
}

impl std::fmt::Debug for StripeCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StripeCodec")
            .field("config", &self.config)
            .finish()
    }
}

impl StripeCodec {
    /// A codec for stripes of `config`'s shape (and the smaller shapes of short last
    /// stripes, [`FecConfig::shape_of_stripe`]).
    ///
    /// # Errors
    /// [`TransferError::Fec`] for an odd or zero shard size, no data or parity
    /// shards, or counts the code does not support (more than 32768 in total).
    pub fn new(config: FecConfig) -> Result<Self, TransferError> {
        if config.data_shards == 0 || config.parity_shards == 0 {
            return Err(TransferError::Fec(
                "a stripe needs data and parity shards".into(),
            ));
        }
        let encoder =
            ReedSolomonEncoder::new(config.data_shards, config.parity_shards, config.shard_bytes)
                .map_err(fec_error)?;
        let decoder =
            ReedSolomonDecoder::new(config.data_shards, config.parity_shards, config.shard_bytes)
                .map_err(fec_error)?;
        Ok(Self {
            config,
            encoder,
            decoder,
            padded: Vec::new(),
        })
    }

    /// The stripe shape.
    pub fn config(&self) -> FecConfig {
        self.config
    }

    /// The recovery shards of one stripe of the configured shape (`stripe` may be
    /// shorter than a whole stripe: it is zero-padded). Its original shards are
    /// `stripe`'s own `shard_bytes` slices and are not copied.
    ///
    /// # Errors
    /// [`TransferError::Fec`] when `stripe` is longer than a stripe.
    pub fn encode(&mut self, stripe: &[u8]) -> Result<Vec<Vec<u8>>, TransferError> {
        let shape = (self.config.data_shards, self.config.parity_shards);
        self.encode_shaped(shape, stripe)
    }

    /// The recovery shards of one stripe of shape `(data, parity)` (as given by
    /// [`FecConfig::shape_of_stripe`]): `stripe` is cut into `data` original shards
    /// of `shard_bytes`, zero-padded when shorter, and `parity` recovery shards are
    /// returned. The working memory is reused whatever the shape.
    ///
    /// # Errors
    /// [`TransferError::Fec`] when `stripe` is longer than `data` shards, or for a
    /// shape the code does not support (no data or parity shards, too many).
    pub fn encode_shaped(
        &mut self,
        (data, parity): (usize, usize),
        stripe: &[u8],
    ) -> Result<Vec<Vec<u8>>, TransferError> {
        let shard = self.config.shard_bytes;
        check_shape(data, parity, shard, stripe.len())?;
        self.encoder.reset(data, parity, shard).map_err(fec_error)?;
        for index in 0..data {
            let original = shard_of(shard, data, &mut self.padded, stripe, index)?;
            self.encoder
                .add_original_shard(original)
                .map_err(fec_error)?;
        }
        let result = self.encoder.encode().map_err(fec_error)?;
        Ok(result.recovery_iter().map(<[u8]>::to_vec).collect())
    }

    /// Original shard `index` of `stripe`, zero-padded when the stripe is short.
    ///
    /// # Errors
    /// [`TransferError::Fec`] when `stripe` is longer than a stripe or `index` is not
    /// an original shard.
    pub fn original<'s>(
        &'s mut self,
        stripe: &'s [u8],
        index: usize,
    ) -> Result<&'s [u8], TransferError> {
        let config = self.config;
        shard_of(
            config.shard_bytes,
            config.data_shards,
            &mut self.padded,
            stripe,
            index,
        )
    }

    /// Rebuilds a stripe of the configured shape into `out` (`stripe_bytes` long,
    /// or shorter for the last stripe of an object) from the shards received:
    /// `shards[i]` is shard `i` (originals first, then recovery shards), `None` when
    /// lost. Returns how many original shards had to be restored from recovery
    /// shards.
    ///
    /// # Errors
    /// [`TransferError::Fec`] when fewer than `data_shards` shards arrived or a shard
    /// has the wrong size.
    pub fn decode(
        &mut self,
        shards: &[Option<&[u8]>],
        out: &mut [u8],
    ) -> Result<usize, TransferError> {
        let shape = (self.config.data_shards, self.config.parity_shards);
        self.decode_shaped(shape, shards, out)
    }

    /// Rebuilds a stripe of shape `(data, parity)` into `out` (at most `data`
    /// shards long) from the shards received: `shards` holds its `data + parity`
    /// shards, originals first, `None` when lost; any `data` of them suffice.
    /// Returns how many original shards had to be restored from recovery shards.
    ///
    /// # Errors
    /// [`TransferError::Fec`] when `shards` or `out` do not fit the shape, fewer
    /// than `data` shards arrived, a shard has the wrong size, or the shape is not
    /// supported.
    pub fn decode_shaped(
        &mut self,
        (data, parity): (usize, usize),
        shards: &[Option<&[u8]>],
        out: &mut [u8],
    ) -> Result<usize, TransferError> {
        let shard = self.config.shard_bytes;
        check_shape(data, parity, shard, out.len())?;
        if data.checked_add(parity) != Some(shards.len()) {
            return Err(TransferError::Fec("stripe shape mismatch".into()));
        }
        let place = |out: &mut [u8], index: usize, bytes: &[u8]| {
            let start = index.saturating_mul(shard).min(out.len());
            let end = index.saturating_add(1).saturating_mul(shard).min(out.len());
            out[start..end].copy_from_slice(&bytes[..end - start]);
        };
        let (originals, recovery) = shards.split_at(data);
        let missing = originals.iter().filter(|s| s.is_none()).count();
        if missing == 0 {
            for bytes in originals.iter().flatten() {
                check_len(bytes, shard)?;
            }
            for (index, bytes) in originals.iter().enumerate() {
                if let Some(bytes) = bytes {
                    place(out, index, bytes);
                }
            }
            return Ok(0);
        }
        self.decoder.reset(data, parity, shard).map_err(fec_error)?;
        for (index, bytes) in originals.iter().enumerate() {
            if let Some(bytes) = bytes {
                check_len(bytes, shard)?;
                place(out, index, bytes);
                self.decoder
                    .add_original_shard(index, bytes)
                    .map_err(fec_error)?;
            }
        }
        for (index, bytes) in recovery.iter().enumerate() {
            if let Some(bytes) = bytes {
                check_len(bytes, shard)?;
                self.decoder
                    .add_recovery_shard(index, bytes)
                    .map_err(fec_error)?;
            }
        }
        let result = self.decoder.decode().map_err(fec_error)?;
        let mut restored = 0;
        for (index, bytes) in result.restored_original_iter() {
            place(out, index, bytes);
            restored += 1;
        }
        Ok(restored)
    }
}

/// Checks that a stripe of `len` bytes fits `data` shards of `shard` bytes, with
/// data and parity shards.
fn check_shape(data: usize, parity: usize, shard: usize, len: usize) -> Result<(), TransferError> {
    if data == 0 || parity == 0 {
        return Err(TransferError::Fec(
            "a stripe needs data and parity shards".into(),
        ));
    }
    if data.checked_mul(shard).is_none_or(|room| len > room) {
        return Err(TransferError::Fec(format!(
            "a stripe of {len} bytes does not fit {data} shards of {shard} bytes"
        )));
    }
    Ok(())
}

fn shard_of<'s>(
    shard: usize,
    data: usize,
    padded: &'s mut Vec<u8>,
    stripe: &'s [u8],
    index: usize,
) -> Result<&'s [u8], TransferError> {
    if index >= data
        || data
            .checked_mul(shard)
            .is_none_or(|room| stripe.len() > room)
    {
        return Err(TransferError::Fec(format!(
            "shard {index} of a stripe of {} bytes does not exist",
            stripe.len()
        )));
    }
    let start = (index * shard).min(stripe.len());
    let end = ((index + 1) * shard).min(stripe.len());
    if end - start == shard {
        return Ok(&stripe[start..end]);
    }
    padded.clear();
    padded.extend_from_slice(&stripe[start..end]);
    padded.resize(shard, 0);
    Ok(padded)
}

fn check_len(bytes: &[u8], shard: usize) -> Result<(), TransferError> {
    if bytes.len() == shard {
        Ok(())
    } else {
        Err(TransferError::Fec(format!(
            "shard of {} bytes, expected {shard}",
            bytes.len()
        )))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn config() -> FecConfig {
        FecConfig {
            data_shards: 8,
            parity_shards: 3,
            shard_bytes: 64,
        }
    }

    fn shards_of(codec: &mut StripeCodec, stripe: &[u8]) -> Vec<Vec<u8>> {
        let parity = codec.encode(stripe).unwrap();
        let mut all: Vec<Vec<u8>> = (0..8)
            .map(|i| codec.original(stripe, i).unwrap().to_vec())
            .collect();
        all.extend(parity);
        all
    }

    #[test]
    fn any_data_shards_of_a_stripe_rebuild_it() {
        let mut codec = StripeCodec::new(config()).unwrap();
        let stripe: Vec<u8> = (0..500u32).map(|i| (i * 7 + 3) as u8).collect();
        let shards = shards_of(&mut codec, &stripe);
        // Lose three shards in every position pattern of a sliding window.
        for first in 0..9 {
            let received: Vec<Option<&[u8]>> = shards
                .iter()
                .enumerate()
                .map(|(i, s)| (!(first..first + 3).contains(&i)).then_some(s.as_slice()))
                .collect();
            let mut out = vec![0u8; stripe.len()];
            let restored = codec.decode(&received, &mut out).unwrap();
            assert_eq!(out, stripe, "losing {first}..{}", first + 3);
            assert_eq!(restored, (first..first + 3).filter(|&i| i < 8).count());
        }
    }

    #[test]
    fn too_many_losses_are_an_error_not_wrong_bytes() {
        let mut codec = StripeCodec::new(config()).unwrap();
        let stripe = vec![9u8; 512];
        let shards = shards_of(&mut codec, &stripe);
        let received: Vec<Option<&[u8]>> = shards
            .iter()
            .enumerate()
            .map(|(i, s)| (i >= 4).then_some(s.as_slice()))
            .collect();
        let mut out = vec![0u8; 512];
        assert_eq!(
            codec.decode(&received, &mut out).unwrap_err().kind(),
            crate::ErrorKind::Fec
        );
    }

    #[test]
    fn bad_shapes_are_errors() {
        for (data, parity, shard) in [(0, 1, 64), (4, 0, 64), (4, 2, 63), (4, 2, 0)] {
            let config = FecConfig {
                data_shards: data,
                parity_shards: parity,
                shard_bytes: shard,
            };
            assert!(StripeCodec::new(config).is_err(), "{config:?}");
        }
        let mut codec = StripeCodec::new(config()).unwrap();
        assert!(codec.encode(&[0u8; 513]).is_err());
        let short = [0u8; 10];
        let received = vec![Some(&short[..]); 11];
        assert!(codec.decode(&received, &mut [0u8; 512]).is_err());
        assert_eq!(config().stripes_for(0), 0);
        assert_eq!(config().stripes_for(513), 2);
    }

    #[test]
    fn a_short_last_stripe_is_shaped_in_proportion_to_its_size() {
        let fec = FecConfig::default();
        let kib = 1024u64;
        assert_eq!(fec.shape_of_stripe(0, 0), (0, 0));
        assert_eq!(fec.shape_of_stripe(1, 0), (1, 1));
        assert_eq!(fec.shape_of_stripe(kib - 1, 0), (1, 1));
        assert_eq!(fec.shape_of_stripe(kib, 0), (1, 1));
        assert_eq!(fec.shape_of_stripe(kib + 1, 0), (2, 1));
        assert_eq!(fec.shape_of_stripe(4 * kib, 0), (4, 1));
        assert_eq!(fec.shape_of_stripe(4 * kib + 1, 0), (5, 2));
        assert_eq!(fec.shape_of_stripe(33 * kib, 0), (33, 9));
        assert_eq!(fec.shape_of_stripe(64 * kib - 1, 0), (64, 16));
        assert_eq!(fec.shape_of_stripe(64 * kib, 0), (64, 16));
        assert_eq!(fec.shape_of_stripe(64 * kib, 1), (0, 0));
        assert_eq!(fec.shape_of_stripe(64 * kib + 1, 0), (64, 16));
        assert_eq!(fec.shape_of_stripe(64 * kib + 1, 1), (1, 1));
        assert_eq!(fec.shape_of_stripe(160 * kib, 1), (64, 16));
        assert_eq!(fec.shape_of_stripe(160 * kib, 2), (32, 8));
        assert_eq!(fec.shape_of_stripe(160 * kib, 3), (0, 0));
        assert_eq!(fec.shape_of_stripe(u64::MAX, u64::MAX), (0, 0));
        assert_eq!(fec.shape_of_stripe(u64::MAX, 7), (64, 16));
        // Rounding keeps at least the configured ratio of recovery shards.
        assert_eq!(config().shape_of_stripe(3 * 64, 0), (3, 2));
        assert_eq!(config().shape_of_stripe(600, 1), (2, 1));
        for data in 1..=64u64 {
            let (d, p) = fec.shape_of_stripe(data * kib, 0);
            assert_eq!(d as u64, data);
            assert_eq!(p, (d * 16).div_ceil(64).max(1), "{d}+{p}");
        }
        let none = FecConfig {
            data_shards: 0,
            parity_shards: 1,
            shard_bytes: 64,
        };
        assert_eq!(none.shape_of_stripe(100, 0), (0, 0));
    }

    /// Encodes a stripe of `shape` and lists all its shards, originals first.
    fn shaped_shards(
        codec: &mut StripeCodec,
        shape: (usize, usize),
        stripe: &[u8],
    ) -> Vec<Vec<u8>> {
        let parity = codec.encode_shaped(shape, stripe).unwrap();
        assert_eq!(parity.len(), shape.1);
        let mut all: Vec<Vec<u8>> = (0..shape.0)
            .map(|i| codec.original(stripe, i).unwrap().to_vec())
            .collect();
        all.extend(parity);
        all
    }

    #[test]
    fn tail_stripes_rebuild_from_any_data_shards_or_fail_cleanly() {
        use rand::rngs::StdRng;
        use rand::seq::SliceRandom as _;
        use rand::{Rng as _, SeedableRng as _};

        let fec = config();
        let mut codec = StripeCodec::new(fec).unwrap();
        let mut rng = StdRng::seed_from_u64(5);
        for _ in 0..400 {
            // Alternate between full stripes and tails, sharing one codec.
            let len = rng.gen_range(1..=fec.stripe_bytes());
            let mut stripe = vec![0u8; len];
            rng.fill(&mut stripe[..]);
            let shape = fec.shape_of_stripe(len as u64, 0);
            let shards = shaped_shards(&mut codec, shape, &stripe);
            let total = shape.0 + shape.1;
            let mut order: Vec<usize> = (0..total).collect();
            order.shuffle(&mut rng);
            let lost = rng.gen_range(0..=total);
            let received: Vec<Option<&[u8]>> = (0..total)
                .map(|i| (!order[..lost].contains(&i)).then_some(shards[i].as_slice()))
                .collect();
            let mut out = vec![0u8; len];
            match codec.decode_shaped(shape, &received, &mut out) {
                Ok(restored) => {
                    assert!(total - lost >= shape.0, "{shape:?} lost {lost}");
                    assert_eq!(out, stripe, "{shape:?} lost {lost}");
                    let originals_lost = order[..lost].iter().filter(|&&i| i < shape.0).count();
                    assert_eq!(restored, originals_lost);
                }
                Err(error) => {
                    assert!(total - lost < shape.0, "{shape:?} lost {lost}: {error}");
                    assert_eq!(error.kind(), crate::ErrorKind::Fec);
                }
            }
        }
    }

    #[test]
    fn mismatched_shapes_are_errors_not_panics() {
        let fec = config();
        let mut codec = StripeCodec::new(fec).unwrap();
        let stripe = vec![3u8; 130];
        let shape = fec.shape_of_stripe(130, 0);
        assert_eq!(shape, (3, 2));
        let shards = shaped_shards(&mut codec, shape, &stripe);
        let all: Vec<Option<&[u8]>> = shards.iter().map(|s| Some(s.as_slice())).collect();
        let mut out = vec![0u8; 130];
        // Too long for its shape, no data or parity shards, an absurd shape.
        assert!(codec.encode_shaped((2, 1), &stripe).is_err());
        assert!(codec.encode_shaped((0, 1), &[]).is_err());
        assert!(codec.encode_shaped((3, 0), &stripe).is_err());
        assert!(codec.encode_shaped((usize::MAX, 1), &stripe).is_err());
        assert!(codec.encode_shaped((40_000, 40_000), &stripe).is_err());
        // The wrong shard count, an output longer than the shape, a short shard.
        assert!(codec.decode_shaped((3, 1), &all, &mut out).is_err());
        assert!(codec.decode_shaped((4, 2), &all, &mut out).is_err());
        assert!(codec
            .decode_shaped((usize::MAX, 2), &all, &mut out)
            .is_err());
        assert!(codec.decode_shaped(shape, &all, &mut [0u8; 193]).is_err());
        let short = [0u8; 10];
        let mut bad = all.clone();
        bad[4] = Some(&short);
        bad[0] = None;
        assert!(codec.decode_shaped(shape, &bad, &mut out).is_err());
        bad[0] = Some(&short);
        assert!(codec.decode_shaped(shape, &bad, &mut out).is_err());
        // The codec still works after the errors, whatever the shape.
        assert_eq!(codec.decode_shaped(shape, &all, &mut out).unwrap(), 0);
        assert_eq!(out, stripe);
        let whole = vec![1u8; 512];
        let full = shards_of(&mut codec, &whole);
        let mut received: Vec<Option<&[u8]>> = full.iter().map(|s| Some(s.as_slice())).collect();
        received[0] = None;
        let mut out = vec![0u8; 512];
        assert_eq!(codec.decode(&received, &mut out).unwrap(), 1);
        assert_eq!(out, whole);
    }
}
