//! An in-process lossy link for testing WAN copies: packets are dropped with a
//! probability and delivered after a delay plus jitter, decided by a seeded RNG so a
//! run is reproducible (on tokio's paused clock, exactly).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::error::TransferError;

/// How the link misbehaves.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkConfig {
    /// Probability that a packet is dropped, 0.0 to 1.0.
    pub loss: f64,
    /// One-way delay of every packet.
    pub delay: Duration,
    /// Extra delay drawn uniformly from `0..=jitter` (reorders packets).
    pub jitter: Duration,
    /// Probability that a delivered packet has one byte flipped.
    pub corrupt: f64,
    /// Seed of the loss, jitter and corruption decisions.
    pub seed: u64,
}

impl Default for LinkConfig {
    fn default() -> Self {
        Self {
            loss: 0.0,
            delay: Duration::from_millis(20),
            jitter: Duration::ZERO,
            corrupt: 0.0,
            seed: 1,
        }
    }
}

/// What happened on a link so far.
#[derive(Debug, Default)]
pub struct LinkStats {
    sent: AtomicU64,
    dropped: AtomicU64,
    corrupted: AtomicU64,
    delivered: AtomicU64,
}

impl LinkStats {
    /// Packets handed to the link.
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// Packets the link dropped.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Packets the link corrupted (one flipped bit each).
    pub fn corrupted(&self) -> u64 {
        self.corrupted.load(Ordering::Relaxed)
    }

    /// Packets delivered to the receiver.
    pub fn delivered(&self) -> u64 {
        self.delivered.load(Ordering::Relaxed)
    }
}

/// A packet in flight: delivered at `at`, in send order among equal times.
type InFlight = Reverse<(Instant, u64, Bytes)>;

/// The sending end of a lossy link.
#[derive(Debug)]
pub struct LinkTx {
    config: LinkConfig,
    rng: StdRng,
    seq: u64,
    tx: mpsc::UnboundedSender<(Instant, u64, Bytes)>,
    stats: Arc<LinkStats>,
}

/// The receiving end of a lossy link.
#[derive(Debug)]
pub struct LinkRx {
    rx: mpsc::UnboundedReceiver<(Instant, u64, Bytes)>,
    queue: BinaryHeap<InFlight>,
    closed: bool,
    stats: Arc<LinkStats>,
}

/// A one-way lossy link.
///
/// # Errors
/// [`TransferError::Invalid`] for a loss probability outside `0.0..=1.0`.
pub fn lossy_link(config: LinkConfig) -> Result<(LinkTx, LinkRx), TransferError> {
    if !(0.0..=1.0).contains(&config.loss) {
        return Err(TransferError::Invalid(format!(
            "loss {} is not a probability",
            config.loss
        )));
    }
    let (tx, rx) = mpsc::unbounded_channel();
    let stats = Arc::new(LinkStats::default());
    Ok((
        LinkTx {
            config,
            rng: StdRng::seed_from_u64(config.seed),
            seq: 0,
            tx,
            stats: Arc::clone(&stats),
        },
        LinkRx {
            rx,
            queue: BinaryHeap::new(),
            closed: false,
            stats,
        },
    ))
}

impl LinkTx {
    /// Hands a packet to the link, which may drop, delay or corrupt it.
    ///
    /// # Errors
    /// [`TransferError::Disconnected`] when the receiving end is gone.
    pub fn send(&mut self, mut packet: Bytes) -> Result<(), TransferError> {
        self.stats.sent.fetch_add(1, Ordering::Relaxed);
        if self.rng.gen_bool(self.config.loss) {
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        let jitter = if self.config.jitter.is_zero() {
            Duration::ZERO
        } else {
            self.config.jitter.mul_f64(self.rng.gen_range(0.0..=1.0))
        };
        if !packet.is_empty() && self.rng.gen_bool(self.config.corrupt) {
            let mut bytes = packet.to_vec();
            let at = self.rng.gen_range(0..bytes.len());
            bytes[at] ^= 1 << self.rng.gen_range(0..8);
            packet = Bytes::from(bytes);
            self.stats.corrupted.fetch_add(1, Ordering::Relaxed);
        }
        let at = Instant::now() + self.config.delay + jitter;
        self.seq += 1;
        self.tx
            .send((at, self.seq, packet))
            .map_err(|_| TransferError::Disconnected {
                endpoint: "lossy link".into(),
                source: std::io::ErrorKind::BrokenPipe.into(),
            })
    }

    /// The link's counters.
    pub fn stats(&self) -> Arc<LinkStats> {
        Arc::clone(&self.stats)
    }
}

impl LinkRx {
    /// The next packet due, waiting for it; `None` once the sender is gone and
    /// nothing is in flight.
    pub async fn recv(&mut self) -> Option<Bytes> {
        loop {
            if let Some(Reverse((at, _, _))) = self.queue.peek() {
                if *at <= Instant::now() {
                    let Reverse((_, _, packet)) = self.queue.pop()?;
                    self.stats.delivered.fetch_add(1, Ordering::Relaxed);
                    return Some(packet);
                }
            }
            let due = self.queue.peek().map(|Reverse((at, _, _))| *at);
            match (due, self.closed) {
                (None, true) => return None,
                (Some(at), true) => tokio::time::sleep_until(at).await,
                (due, false) => {
                    let wake = due.unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
                    tokio::select! {
                        incoming = self.rx.recv() => match incoming {
                            Some(packet) => self.queue.push(Reverse(packet)),
                            None => self.closed = true,
                        },
                        () = tokio::time::sleep_until(wake) => {}
                    }
                }
            }
        }
    }

    /// The next packet, or `None` when none is due within `timeout` (or the link is
    /// closed).
    pub async fn recv_timeout(&mut self, timeout: Duration) -> Option<Bytes> {
        tokio::time::timeout(timeout, self.recv())
            .await
            .ok()
            .flatten()
    }

    /// The link's counters.
    pub fn stats(&self) -> Arc<LinkStats> {
        Arc::clone(&self.stats)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    async fn survivors(config: LinkConfig, count: u32) -> Vec<u32> {
        let (mut tx, mut rx) = lossy_link(config).unwrap();
        for i in 0..count {
            tx.send(Bytes::copy_from_slice(&i.to_le_bytes())).unwrap();
        }
        drop(tx);
        let mut got = Vec::new();
        while let Some(packet) = rx.recv().await {
            got.push(u32::from_le_bytes(packet[..4].try_into().unwrap()));
        }
        got
    }

    #[tokio::test(start_paused = true)]
    async fn losses_are_reproducible_from_the_seed() {
        let config = LinkConfig {
            loss: 0.1,
            ..LinkConfig::default()
        };
        let first = survivors(config, 10_000).await;
        assert_eq!(first, survivors(config, 10_000).await);
        assert!((8_800..9_200).contains(&first.len()), "{}", first.len());
        assert!(
            first.windows(2).all(|w| w[0] < w[1]),
            "no jitter keeps order"
        );
        let other = survivors(LinkConfig { seed: 2, ..config }, 10_000).await;
        assert_ne!(first, other);
    }

    #[tokio::test(start_paused = true)]
    async fn packets_arrive_after_the_delay_and_jitter_reorders_them() {
        let start = Instant::now();
        let config = LinkConfig {
            delay: Duration::from_millis(50),
            jitter: Duration::from_millis(30),
            ..LinkConfig::default()
        };
        let (mut tx, mut rx) = lossy_link(config).unwrap();
        for i in 0..100u32 {
            tx.send(Bytes::copy_from_slice(&i.to_le_bytes())).unwrap();
        }
        let first = rx.recv().await.unwrap();
        assert!(start.elapsed() >= Duration::from_millis(50));
        drop(tx);
        let mut got = vec![u32::from_le_bytes(first[..4].try_into().unwrap())];
        while let Some(packet) = rx.recv().await {
            got.push(u32::from_le_bytes(packet[..4].try_into().unwrap()));
        }
        assert_eq!(got.len(), 100);
        assert!(got.windows(2).any(|w| w[0] > w[1]), "jitter reorders");
        assert!(start.elapsed() <= Duration::from_millis(81));
        assert!(lossy_link(LinkConfig {
            loss: 1.5,
            ..config
        })
        .is_err());
    }
}
