//! Pacing to a bandwidth cap: a token bucket on tokio's clock (so tests run it on a
//! paused, virtual clock). Over any interval of `t` seconds it grants at most
//! `burst + rate * t` bytes.

use std::time::Duration;

use tokio::time::Instant;

use crate::error::TransferError;

/// A token bucket of bytes.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
    granted: u64,
    waits: u64,
}

impl TokenBucket {
    /// A full bucket refilling at `rate_bytes_per_sec`, holding at most `burst_bytes`.
    ///
    /// # Errors
    /// [`TransferError::Invalid`] for a zero rate or burst.
    pub fn new(rate_bytes_per_sec: u64, burst_bytes: u64) -> Result<Self, TransferError> {
        if rate_bytes_per_sec == 0 || burst_bytes == 0 {
            return Err(TransferError::Invalid(
                "pacing needs a rate and a burst".into(),
            ));
        }
        Ok(Self {
            rate: rate_bytes_per_sec as f64,
            burst: burst_bytes as f64,
            tokens: burst_bytes as f64,
            last: Instant::now(),
            granted: 0,
            waits: 0,
        })
    }

    /// Bytes granted so far.
    pub fn granted(&self) -> u64 {
        self.granted
    }

    /// How often a caller had to wait for tokens.
    pub fn waits(&self) -> u64 {
        self.waits
    }

    /// Tokens available at `now`.
    pub fn available(&mut self, now: Instant) -> u64 {
        self.refill(now);
        self.tokens as u64
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.rate).min(self.burst);
        self.last = now;
    }

    /// Takes `bytes` tokens at `now` if there are enough; otherwise says how long to
    /// wait until there are.
    ///
    /// # Errors
    /// [`TransferError::TooLarge`] when `bytes` exceeds the burst (it could never be
    /// granted).
    pub fn try_take(
        &mut self,
        bytes: u64,
        now: Instant,
    ) -> Result<Result<(), Duration>, TransferError> {
        if bytes as f64 > self.burst {
            return Err(TransferError::TooLarge {
                what: "paced packet",
                len: bytes,
                max: self.burst as u64,
            });
        }
        self.refill(now);
        let need = bytes as f64;
        if self.tokens >= need {
            self.tokens -= need;
            self.granted += bytes;
            return Ok(Ok(()));
        }
        let wait = (need - self.tokens) / self.rate;
        // Round up to whole microseconds so the wait never falls just short.
        Ok(Err(Duration::from_micros((wait * 1e6).ceil() as u64 + 1)))
    }

    /// Waits until `bytes` tokens are available and takes them.
    ///
    /// # Errors
    /// As [`TokenBucket::try_take`].
    pub async fn take(&mut self, bytes: u64) -> Result<(), TransferError> {
        loop {
            match self.try_take(bytes, Instant::now())? {
                Ok(()) => return Ok(()),
                Err(wait) => {
                    self.waits += 1;
                    tokio::time::sleep(wait).await;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn grants_never_exceed_burst_plus_rate_times_time() {
        let start = Instant::now();
        let mut bucket = TokenBucket::new(100_000, 10_000).unwrap();
        assert!(bucket.try_take(10_000, start).unwrap().is_ok());
        let wait = bucket.try_take(1_000, start).unwrap().unwrap_err();
        assert!(wait >= Duration::from_millis(10));
        let mut sent = 10_000u64;
        while sent < 1_010_000 {
            bucket.take(1_000).await.unwrap();
            sent += 1_000;
            let elapsed = start.elapsed().as_secs_f64();
            assert!(bucket.granted() as f64 <= 10_000.0 + 100_000.0 * elapsed + 1.0);
        }
        assert_eq!(bucket.granted(), 1_010_000);
        // One megabyte past the burst at 100 kB/s takes ten seconds of (virtual) time.
        assert!(start.elapsed() >= Duration::from_secs(10));
        assert!(bucket.waits() > 0);
    }

    #[tokio::test(start_paused = true)]
    async fn idle_time_refills_only_up_to_the_burst() {
        let mut bucket = TokenBucket::new(1_000, 5_000).unwrap();
        tokio::time::advance(Duration::from_secs(100)).await;
        assert_eq!(bucket.available(Instant::now()), 5_000);
        assert!(bucket.try_take(5_001, Instant::now()).is_err());
        assert!(TokenBucket::new(0, 1).is_err());
    }
}
