//! The receiving end of a WAN copy: gathers shards per stripe, rebuilds each stripe
//! as soon as enough shards arrived (restoring lost originals from recovery shards),
//! and answers every end-of-round probe with an acknowledgement or the list of
//! stripes still missing.

use std::collections::HashMap;

use bytes::Bytes;

use super::fec::StripeCodec;
use super::packet::{ObjectHeader, Packet};
use super::{PacketSink, PacketSource, WanConfig};
use crate::error::TransferError;

/// What one [`WanReceiver::receive`] saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReceiveReport {
    /// Packets received, whatever they were.
    pub packets: u64,
    /// Packets dropped because they failed their checksum or made no sense.
    pub corrupt: u64,
    /// Shards of stripes already rebuilt (retransmissions that crossed an answer).
    pub duplicates: u64,
    /// Original shards restored from recovery shards: losses FEC repaired.
    pub fec_recoveries: u64,
    /// Stripes that needed at least one restored shard.
    pub stripes_recovered: u64,
    /// Probes answered with a list of missing stripes.
    pub nacks: u64,
}

/// The object being received.
struct Incoming {
    header: ObjectHeader,
    out: Vec<u8>,
    done: Vec<bool>,
    partial: HashMap<u32, Vec<Option<Bytes>>>,
    remaining: u32,
}

/// The receiving end of a WAN copy.
pub struct WanReceiver<S, R> {
    config: WanConfig,
    codec: StripeCodec,
    data: R,
    feedback: S,
    last_object: u64,
}

impl<S: PacketSink, R: PacketSource> WanReceiver<S, R> {
    /// A receiver of packets from `data`, answering on `feedback`.
    ///
    /// # Errors
    /// [`TransferError::Fec`] for a bad stripe shape.
    pub fn new(config: WanConfig, data: R, feedback: S) -> Result<Self, TransferError> {
        Ok(Self {
            codec: StripeCodec::new(config.fec)?,
            config,
            data,
            feedback,
            last_object: 0,
        })
    }

    /// Receives the next object, byte-exact.
    ///
    /// # Errors
    /// [`TransferError::Timeout`] when no packet came for `idle_timeout`.
    pub async fn receive(&mut self) -> Result<(Vec<u8>, ReceiveReport), TransferError> {
        let mut report = ReceiveReport::default();
        let mut incoming: Option<Incoming> = None;
        loop {
            let Some(bytes) = self.data.recv_packet(self.config.idle_timeout).await else {
                return Err(TransferError::Timeout {
                    what: "WAN receive",
                    endpoint: "WAN sender".into(),
                    after: self.config.idle_timeout,
                });
            };
            report.packets += 1;
            let Ok(packet) = Packet::decode(&bytes) else {
                report.corrupt += 1;
                continue;
            };
            let header = match &packet {
                Packet::Shard { header, .. } | Packet::Probe { header, .. } => *header,
                Packet::Nack { .. } | Packet::Ack { .. } => continue,
            };
            if header.object <= self.last_object {
                // A late packet of an object already delivered.
                continue;
            }
            if incoming
                .as_ref()
                .is_none_or(|current| current.header.object < header.object)
            {
                match self.start(header) {
                    Some(fresh) => incoming = Some(fresh),
                    None => {
                        report.corrupt += 1;
                        continue;
                    }
                }
            }
            let Some(current) = incoming.as_mut().filter(|c| c.header == header) else {
                report.corrupt += 1;
                continue;
            };
            match packet {
                Packet::Shard {
                    stripe,
                    index,
                    payload,
                    ..
                } => self.add_shard(current, stripe, index, payload, &mut report)?,
                Packet::Probe { round, .. } => {
                    if current.remaining == 0 {
                        for _ in 0..self.config.acks.max(1) {
                            self.feedback.send_packet(
                                Packet::Ack {
                                    object: header.object,
                                }
                                .encode(),
                            )?;
                        }
                        self.last_object = header.object;
                        let done = incoming.take().map(|c| c.out).unwrap_or_default();
                        return Ok((done, report));
                    }
                    let missing = (0..header.stripes)
                        .filter(|&s| !current.done[s as usize])
                        .collect();
                    report.nacks += 1;
                    self.feedback.send_packet(
                        Packet::Nack {
                            object: header.object,
                            round,
                            missing,
                        }
                        .encode(),
                    )?;
                }
                Packet::Nack { .. } | Packet::Ack { .. } => {}
            }
        }
    }

    /// State for a new object, or `None` when its header is not believable.
    fn start(&self, header: ObjectHeader) -> Option<Incoming> {
        if header.len > self.config.max_object_bytes
            || u64::from(header.stripes) != self.config.fec.stripes_for(header.len)
        {
            return None;
        }
        Some(Incoming {
            header,
            out: vec![0u8; usize::try_from(header.len).ok()?],
            done: vec![false; header.stripes as usize],
            partial: HashMap::new(),
            remaining: header.stripes,
        })
    }

    fn add_shard(
        &mut self,
        current: &mut Incoming,
        stripe: u32,
        index: u16,
        payload: Bytes,
        report: &mut ReceiveReport,
    ) -> Result<(), TransferError> {
        let fec = self.config.fec;
        let index = usize::from(index);
        if stripe >= current.header.stripes
            || index >= fec.total_shards()
            || payload.len() != fec.shard_bytes
        {
            report.corrupt += 1;
            return Ok(());
        }
        if current.done[stripe as usize] {
            report.duplicates += 1;
            return Ok(());
        }
        let shards = current
            .partial
            .entry(stripe)
            .or_insert_with(|| vec![None; fec.total_shards()]);
        if shards[index].is_some() {
            report.duplicates += 1;
            return Ok(());
        }
        shards[index] = Some(payload);
        if shards.iter().filter(|s| s.is_some()).count() < fec.data_shards {
            return Ok(());
        }
        let size = fec.stripe_bytes();
        let start = stripe as usize * size;
        let end = (start + size).min(current.out.len());
        let views: Vec<Option<&[u8]>> = shards.iter().map(|s| s.as_deref()).collect();
        let restored = self.codec.decode(&views, &mut current.out[start..end])?;
        if restored > 0 {
            report.fec_recoveries += restored as u64;
            report.stripes_recovered += 1;
        }
        current.partial.remove(&stripe);
        current.done[stripe as usize] = true;
        current.remaining -= 1;
        Ok(())
    }
}
