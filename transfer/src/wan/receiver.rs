//! The receiving end of a WAN copy: gathers shards per stripe, rebuilds each stripe
//! as soon as enough shards arrived (any `data` of its `data + parity`, restoring
//! lost originals from recovery shards), and answers every end-of-round probe with
//! an acknowledgement or the list of stripes still missing. The shape of each stripe,
//! smaller for a short last one, follows from the object's length in the packet
//! header ([`FecConfig::shape_of_stripe`](super::FecConfig::shape_of_stripe)).

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
        // The stripe's own shape: the configured one, or a smaller one for a short
        // last stripe; an index beyond it is no shard of this object.
        let (data, parity) = fec.shape_of_stripe(current.header.len, u64::from(stripe));
        let total = data + parity;
        if stripe >= current.header.stripes || index >= total || payload.len() != fec.shard_bytes {
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
            .or_insert_with(|| vec![None; total]);
        if shards[index].is_some() {
            report.duplicates += 1;
            return Ok(());
        }
        shards[index] = Some(payload);
        if shards.iter().filter(|s| s.is_some()).count() < data {
            return Ok(());
        }
        let size = fec.stripe_bytes();
        let start = stripe as usize * size;
        let end = (start + size).min(current.out.len());
        let views: Vec<Option<&[u8]>> = shards.iter().map(|s| s.as_deref()).collect();
        let restored =
            self.codec
                .decode_shaped((data, parity), &views, &mut current.out[start..end])?;
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::time::Duration;

    use rand::rngs::StdRng;
    use rand::{Rng as _, SeedableRng as _};

    use super::*;
    use crate::wan::{lossy_link, FecConfig, LinkConfig, LinkRx, LinkTx, StripeCodec};

    fn config() -> WanConfig {
        WanConfig {
            fec: FecConfig {
                data_shards: 8,
                parity_shards: 2,
                shard_bytes: 1024,
            },
            idle_timeout: Duration::from_secs(1),
            max_object_bytes: 1 << 20,
            ..WanConfig::default()
        }
    }

    /// A receiver fed by the returned `LinkTx` over a lossless link, answering on
    /// the returned `LinkRx`.
    fn receiver(config: WanConfig) -> (LinkTx, LinkRx, WanReceiver<LinkTx, LinkRx>) {
        let (data_tx, data_rx) = lossy_link(LinkConfig::default()).unwrap();
        let (feedback_tx, feedback_rx) = lossy_link(LinkConfig::default()).unwrap();
        let receiver = WanReceiver::new(config, data_rx, feedback_tx).unwrap();
        (data_tx, feedback_rx, receiver)
    }

    #[tokio::test(start_paused = true)]
    async fn shards_beyond_a_short_stripe_s_shape_are_dropped_and_it_rebuilds() {
        let config = config();
        let value: Vec<u8> = (0..3000u32).map(|i| (i * 31 + 7) as u8).collect();
        let header = ObjectHeader {
            object: 1,
            stripes: 1,
            len: value.len() as u64,
        };
        let shape = config.fec.shape_of_stripe(header.len, 0);
        assert_eq!(shape, (3, 1));
        let mut codec = StripeCodec::new(config.fec).unwrap();
        let parity = codec.encode_shaped(shape, &value).unwrap();
        let (mut tx, _answers, mut receiver) = receiver(config);
        let shard = |index: u16, payload: &[u8]| Packet::shard(header, 0, 0, index, payload);
        tx.send(shard(0, codec.original(&value, 0).unwrap()))
            .unwrap();
        // Indexes of the full shape but not of this stripe's, another stripe, a
        // short shard, another length for the same object, garbage.
        let junk = [
            shard(4, &parity[0]),
            shard(9, &parity[0]),
            shard(u16::MAX, &parity[0]),
            Packet::shard(header, 0, 1, 0, &parity[0]),
            shard(1, &parity[0][..1023]),
            Packet::shard(
                ObjectHeader {
                    len: 9000,
                    stripes: 2,
                    ..header
                },
                0,
                0,
                1,
                &parity[0],
            ),
            Bytes::from_static(b"not a packet at all, but long enough to be checked"),
        ];
        for packet in &junk {
            tx.send(packet.clone()).unwrap();
        }
        // Original 2 is lost: rebuilt from the one recovery shard.
        tx.send(shard(1, codec.original(&value, 1).unwrap()))
            .unwrap();
        tx.send(shard(3, &parity[0])).unwrap();
        tx.send(Packet::Probe { header, round: 0 }.encode())
            .unwrap();
        let (bytes, report) = receiver.receive().await.unwrap();
        assert!(bytes == value);
        assert_eq!(report.corrupt, junk.len() as u64, "{report:?}");
        assert_eq!(report.fec_recoveries, 1);
        assert_eq!(report.stripes_recovered, 1);
        assert_eq!(report.duplicates, 0);
        assert_eq!(report.nacks, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn random_packets_never_panic_the_receiver() {
        let config = config();
        let mut rng = StdRng::seed_from_u64(77);
        let (mut tx, _answers, mut receiver) = receiver(config);
        // Objects of believable shapes (a short last stripe in most), so shards
        // reach the stripe logic, with random stripes, indexes, lengths and kinds.
        let stripe = config.fec.stripe_bytes() as u64;
        let lens = [
            1,
            1023,
            1025,
            3000,
            stripe - 1,
            stripe,
            stripe + 1,
            stripe * 5 / 2,
        ];
        for object in 1..=300u64 {
            let len = lens[rng.gen_range(0..lens.len())];
            let header = ObjectHeader {
                object,
                stripes: config.fec.stripes_for(len) as u32,
                len,
            };
            for _ in 0..rng.gen_range(1..40) {
                let payload: Vec<u8> = match rng.gen_range(0..4) {
                    0 => vec![0u8; rng.gen_range(0..2048)],
                    _ => vec![rng.gen(); config.fec.shard_bytes],
                };
                let stripe = match rng.gen_range(0..4) {
                    0 => rng.gen(),
                    _ => rng.gen_range(0..=header.stripes),
                };
                let index = match rng.gen_range(0..4) {
                    0 => rng.gen(),
                    _ => rng.gen_range(0..12),
                };
                let packet = match rng.gen_range(0..12) {
                    0 => Packet::Probe { header, round: 0 }.encode(),
                    1 => Packet::Nack {
                        object,
                        round: 0,
                        missing: vec![stripe],
                    }
                    .encode(),
                    2 => {
                        let mut bytes = Packet::shard(header, 0, stripe, index, &payload).to_vec();
                        let at = rng.gen_range(0..bytes.len());
                        bytes[at] = rng.gen();
                        Bytes::from(bytes)
                    }
                    _ => Packet::shard(header, 0, stripe, index, &payload),
                };
                tx.send(packet).unwrap();
            }
        }
        drop(tx);
        // Objects may complete by chance (a probe after enough shards); the rest
        // ends in a timeout, never in a panic or another error.
        let mut completed = 0;
        loop {
            match receiver.receive().await {
                Ok(_) => completed += 1,
                Err(error) => {
                    assert_eq!(error.kind(), crate::ErrorKind::Timeout, "{error}");
                    break;
                }
            }
        }
        assert!(completed <= 300);
    }
}
