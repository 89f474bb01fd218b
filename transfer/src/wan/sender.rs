//! The sending end of a WAN copy: sends every stripe of an object with its recovery
//! shards, paced, then probes; stripes the receiver reports missing are sent again
//! whole in the next round. A short last stripe is sent with its own, smaller shape
//! ([`FecConfig::shape_of_stripe`](super::FecConfig::shape_of_stripe)), in every
//! round.

use tokio::time::Instant;

use super::fec::StripeCodec;
use super::pacing::TokenBucket;
use super::packet::{ObjectHeader, Packet};
use super::{PacketSink, PacketSource, WanConfig};
use crate::error::TransferError;

/// What one [`WanSender::send`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SendReport {
    /// Object bytes.
    pub bytes: u64,
    /// Stripes in the object.
    pub stripes: u64,
    /// Packets sent (shards and probes).
    pub packets: u64,
    /// Bytes sent on the wire, packet overhead and recovery shards included.
    pub wire_bytes: u64,
    /// Rounds it took.
    pub rounds: u32,
    /// Stripes sent again because they lost more shards than FEC repairs.
    pub stripes_retransmitted: u64,
}

/// The sending end of a WAN copy.
pub struct WanSender<S, R> {
    config: WanConfig,
    codec: StripeCodec,
    pacer: TokenBucket,
    data: S,
    feedback: R,
    next_object: u64,
}

/// The receiver's answer to a probe.
enum Answer {
    Complete,
    Missing(Vec<u32>),
}

impl<S: PacketSink, R: PacketSource> WanSender<S, R> {
    /// A sender of packets to `data`, hearing answers on `feedback`.
    ///
    /// # Errors
    /// [`TransferError::Fec`] or [`TransferError::Invalid`] for a bad configuration.
    pub fn new(config: WanConfig, data: S, feedback: R) -> Result<Self, TransferError> {
        Ok(Self {
            codec: StripeCodec::new(config.fec)?,
            pacer: TokenBucket::new(config.rate_bytes_per_sec, config.burst_bytes)?,
            config,
            data,
            feedback,
            next_object: 1,
        })
    }

    /// The pacer (its `granted` bytes are the bytes this sender put on the wire).
    pub fn pacer(&self) -> &TokenBucket {
        &self.pacer
    }

    /// Copies `bytes` to the receiver.
    ///
    /// # Errors
    /// [`TransferError::Timeout`] when no answer to the probes of a round came back,
    /// [`TransferError::Exhausted`] when stripes are still missing after the last
    /// round, [`TransferError::TooLarge`] for an object of more than `u32::MAX`
    /// stripes.
    pub async fn send(&mut self, bytes: &[u8]) -> Result<SendReport, TransferError> {
        let stripes = self.config.fec.stripes_for(bytes.len() as u64);
        let header = ObjectHeader {
            object: self.next_object,
            stripes: u32::try_from(stripes).map_err(|_| TransferError::TooLarge {
                what: "WAN object",
                len: bytes.len() as u64,
                max: u64::from(u32::MAX) * self.config.fec.stripe_bytes() as u64,
            })?,
            len: bytes.len() as u64,
        };
        self.next_object += 1;
        let mut report = SendReport {
            bytes: header.len,
            stripes,
            ..SendReport::default()
        };
        let mut pending: Vec<u32> = (0..header.stripes).collect();
        for round in 0..self.config.max_rounds {
            if round > 0 {
                report.stripes_retransmitted += pending.len() as u64;
            }
            for &stripe in &pending {
                self.send_stripe(header, round, stripe, bytes, &mut report)
                    .await?;
            }
            report.rounds = round + 1;
            match self.probe(header, round, &mut report).await? {
                Answer::Complete => return Ok(report),
                Answer::Missing(missing) => {
                    pending = missing
                        .into_iter()
                        .filter(|&s| s < header.stripes)
                        .collect();
                }
            }
        }
        Err(TransferError::Exhausted {
            rounds: self.config.max_rounds,
            missing: pending.len(),
        })
    }

    async fn emit(
        &mut self,
        packet: bytes::Bytes,
        report: &mut SendReport,
    ) -> Result<(), TransferError> {
        self.pacer.take(packet.len() as u64).await?;
        report.packets += 1;
        report.wire_bytes += packet.len() as u64;
        self.data.send_packet(packet)
    }

    async fn send_stripe(
        &mut self,
        header: ObjectHeader,
        round: u32,
        stripe: u32,
        bytes: &[u8],
        report: &mut SendReport,
    ) -> Result<(), TransferError> {
        let fec = self.config.fec;
        let size = fec.stripe_bytes();
        let start = (stripe as usize).saturating_mul(size).min(bytes.len());
        let end = start.saturating_add(size).min(bytes.len());
        let data = &bytes[start..end];
        // A short last stripe has fewer shards, in proportion to its size.
        let shape = fec.shape_of_stripe(header.len, u64::from(stripe));
        let parity = self.codec.encode_shaped(shape, data)?;
        let originals = shape.0;
        for index in 0..originals {
            let packet = Packet::shard(
                header,
                round,
                stripe,
                index as u16,
                self.codec.original(data, index)?,
            );
            self.emit(packet, report).await?;
        }
        for (i, shard) in parity.iter().enumerate() {
            let packet = Packet::shard(header, round, stripe, (originals + i) as u16, shard);
            self.emit(packet, report).await?;
        }
        Ok(())
    }

    /// Ends a round: probes until the receiver answers for this round.
    async fn probe(
        &mut self,
        header: ObjectHeader,
        round: u32,
        report: &mut SendReport,
    ) -> Result<Answer, TransferError> {
        for _ in 0..self.config.probes {
            self.emit(Packet::Probe { header, round }.encode(), report)
                .await?;
            let deadline = Instant::now() + self.config.feedback_timeout;
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                let Some(bytes) = self.feedback.recv_packet(left).await else {
                    break;
                };
                match Packet::decode(&bytes) {
                    Ok(Packet::Ack { object }) if object == header.object => {
                        return Ok(Answer::Complete)
                    }
                    Ok(Packet::Nack {
                        object,
                        round: answered,
                        missing,
                    }) if object == header.object && answered == round => {
                        return Ok(Answer::Missing(missing))
                    }
                    // Stale answers, other objects' packets and corrupted ones.
                    _ => {}
                }
            }
        }
        Err(TransferError::Timeout {
            what: "WAN round feedback",
            endpoint: "WAN receiver".into(),
            after: self.config.feedback_timeout * self.config.probes,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::wan::{lossy_link, FecConfig, LinkConfig, LinkRx, LinkTx, WanReceiver};

    fn object(len: usize, seed: u64) -> Vec<u8> {
        (0..len as u64)
            .map(|i| {
                (i ^ seed)
                    .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                    .rotate_right(29) as u8
            })
            .collect()
    }

    type Ends = (WanSender<LinkTx, LinkRx>, WanReceiver<LinkTx, LinkRx>);

    fn ends(config: WanConfig, forward: LinkConfig, back: LinkConfig) -> Ends {
        let (data_tx, data_rx) = lossy_link(forward).unwrap();
        let (feedback_tx, feedback_rx) = lossy_link(back).unwrap();
        (
            WanSender::new(config, data_tx, feedback_rx).unwrap(),
            crate::wan::WanReceiver::new(config, data_rx, feedback_tx).unwrap(),
        )
    }

    /// Copies `value` and checks it arrived byte-exact.
    async fn copy(ends: &mut Ends, value: &[u8]) -> (SendReport, crate::wan::ReceiveReport) {
        let (sender, receiver) = ends;
        let (sent, received) = tokio::join!(sender.send(value), receiver.receive());
        let (bytes, report) = received.unwrap();
        assert!(bytes == value, "a copy of {} bytes differs", value.len());
        (sent.unwrap(), report)
    }

    #[tokio::test(start_paused = true)]
    async fn objects_with_short_last_stripes_arrive_byte_exact_at_5_percent_loss() {
        let config = WanConfig::default();
        let (shard, stripe) = (config.fec.shard_bytes, config.fec.stripe_bytes());
        let forward = LinkConfig {
            loss: 0.05,
            seed: 31,
            ..LinkConfig::default()
        };
        let back = LinkConfig {
            loss: 0.05,
            seed: 32,
            ..LinkConfig::default()
        };
        let mut ends = ends(config, forward, back);
        let mut recoveries = 0;
        for (n, len) in [
            1,
            shard - 1,
            shard + 1,
            stripe - 1,
            stripe + 1,
            stripe * 5 / 2,
        ]
        .into_iter()
        .enumerate()
        {
            let value = object(len, n as u64);
            let (sent, received) = copy(&mut ends, &value).await;
            let stripes = config.fec.stripes_for(len as u64);
            assert_eq!(sent.stripes, stripes);
            // Every stripe went out with its own shape at least once.
            let shards: u64 = (0..stripes)
                .map(|s| {
                    let (data, parity) = config.fec.shape_of_stripe(len as u64, s);
                    (data + parity) as u64
                })
                .sum();
            assert!(sent.packets > shards, "{len}: {sent:?}");
            recoveries += received.fec_recoveries;
        }
        assert!(recoveries > 0, "5% loss needed no repair");
    }

    #[tokio::test(start_paused = true)]
    async fn a_short_last_stripe_is_sent_again_whole_with_its_own_shape() {
        // Objects of one short stripe of 3 + 1 shards, at a loss that often takes
        // two of them: FEC repairs one loss, the rounds resend the stripe otherwise.
        let config = WanConfig {
            fec: FecConfig {
                data_shards: 8,
                parity_shards: 2,
                shard_bytes: 1024,
            },
            ..WanConfig::default()
        };
        assert_eq!(config.fec.shape_of_stripe(3000, 0), (3, 1));
        let forward = LinkConfig {
            loss: 0.3,
            seed: 41,
            ..LinkConfig::default()
        };
        let mut ends = ends(config, forward, LinkConfig::default());
        let (mut retransmitted, mut recoveries) = (0, 0);
        for n in 0..20 {
            let value = object(3000, n);
            let (sent, received) = copy(&mut ends, &value).await;
            assert_eq!(sent.stripes, 1);
            // Each round sends the stripe's 4 shards and at least one probe.
            assert!(sent.packets >= u64::from(sent.rounds) * 5, "{sent:?}");
            assert_eq!(sent.stripes_retransmitted, u64::from(sent.rounds) - 1);
            retransmitted += sent.stripes_retransmitted;
            recoveries += received.fec_recoveries;
        }
        assert!(retransmitted > 0, "no stripe was sent again");
        assert!(recoveries > 0, "no loss was repaired");
    }

    #[tokio::test(start_paused = true)]
    async fn a_short_object_costs_in_proportion_to_its_size() {
        let config = WanConfig::default();
        let mut ends = ends(config, LinkConfig::default(), LinkConfig::default());
        for (len, most) in [(33 * 1024, 1.4), (96 * 1024, 1.35), (1 << 20, 1.35)] {
            let value = object(len, 0);
            let (sent, _) = copy(&mut ends, &value).await;
            let ratio = sent.wire_bytes as f64 / len as f64;
            assert!(ratio < most, "{len} bytes: {ratio:.3}x on the wire");
            // Never less than the configured ratio of recovery shards.
            assert!(ratio > 1.25, "{len} bytes: {ratio:.3}x on the wire");
        }
        // 33 originals and 9 recovery shards, each with its header, and a probe.
        let value = object(33 * 1024, 1);
        let (sent, _) = copy(&mut ends, &value).await;
        let packet = (1024 + super::super::packet::PACKET_OVERHEAD) as u64;
        assert_eq!(
            sent.wire_bytes,
            42 * packet + super::super::packet::PACKET_OVERHEAD as u64
        );
    }
}
