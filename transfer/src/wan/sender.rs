//! The sending end of a WAN copy: sends every stripe of an object with its recovery
//! shards, paced, then probes; stripes the receiver reports missing are sent again
//! whole in the next round.

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
        let size = self.config.fec.stripe_bytes();
        let start = (stripe as usize * size).min(bytes.len());
        let end = (start + size).min(bytes.len());
        let data = &bytes[start..end];
        let parity = self.codec.encode(data)?;
        let originals = self.config.fec.data_shards;
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
