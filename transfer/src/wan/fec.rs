//! Reed–Solomon forward error correction over stripes: a stripe is `data_shards`
//! shards of `shard_bytes` each, sent with `parity_shards` recovery shards, and any
//! `data_shards` of the `data_shards + parity_shards` rebuild it (through the
//! `reed-solomon-simd` crate, O(n log n) in the shard count).
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
}

fn fec_error(error: reed_solomon_simd::Error) -> TransferError {
    TransferError::Fec(error.to_string())
}

/// Encodes and decodes stripes of one shape, reusing its working memory.
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
    /// A codec for stripes of `config`'s shape.
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

    /// The recovery shards of one stripe (`stripe` may be shorter than a whole
    /// stripe: the last one of an object is zero-padded). Its original shards are
    /// `stripe`'s own `shard_bytes` slices and are not copied.
    ///
    /// # Errors
    /// [`TransferError::Fec`] when `stripe` is longer than a stripe.
    pub fn encode(&mut self, stripe: &[u8]) -> Result<Vec<Vec<u8>>, TransferError> {
        self.encoder
            .reset(
                self.config.data_shards,
                self.config.parity_shards,
                self.config.shard_bytes,
            )
            .map_err(fec_error)?;
        for index in 0..self.config.data_shards {
            let original = shard_of(&self.config, &mut self.padded, stripe, index)?;
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
        shard_of(&self.config, &mut self.padded, stripe, index)
    }

    /// Rebuilds a stripe into `out` (`stripe_bytes` long, or shorter for the last
    /// stripe of an object) from the shards received: `shards[i]` is shard `i`
    /// (originals first, then recovery shards), `None` when lost. Returns how many
    /// original shards had to be restored from recovery shards.
    ///
    /// # Errors
    /// [`TransferError::Fec`] when fewer than `data_shards` shards arrived or a shard
    /// has the wrong size.
    pub fn decode(
        &mut self,
        shards: &[Option<&[u8]>],
        out: &mut [u8],
    ) -> Result<usize, TransferError> {
        let config = self.config;
        if shards.len() != config.total_shards() || out.len() > config.stripe_bytes() {
            return Err(TransferError::Fec("stripe shape mismatch".into()));
        }
        let shard = config.shard_bytes;
        let place = |out: &mut [u8], index: usize, bytes: &[u8]| {
            let start = (index * shard).min(out.len());
            let end = ((index + 1) * shard).min(out.len());
            out[start..end].copy_from_slice(&bytes[..end - start]);
        };
        let (originals, recovery) = shards.split_at(config.data_shards);
        let missing = originals.iter().filter(|s| s.is_none()).count();
        if missing == 0 {
            for (index, bytes) in originals.iter().enumerate() {
                if let Some(bytes) = bytes {
                    check_len(bytes, shard)?;
                    place(out, index, bytes);
                }
            }
            return Ok(0);
        }
        self.decoder
            .reset(config.data_shards, config.parity_shards, shard)
            .map_err(fec_error)?;
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

fn shard_of<'s>(
    config: &FecConfig,
    padded: &'s mut Vec<u8>,
    stripe: &'s [u8],
    index: usize,
) -> Result<&'s [u8], TransferError> {
    let shard = config.shard_bytes;
    if stripe.len() > config.stripe_bytes() || index >= config.data_shards {
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
}
