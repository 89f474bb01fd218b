//! WAN mode for inter-datacenter copies over slow, lossy links: objects are cut into
//! stripes protected by Reed–Solomon recovery shards ([`fec`]; a short last stripe
//! has proportionally fewer original and recovery shards, derived by both ends
//! from the object's length, see [`FecConfig::shape_of_stripe`]), sent paced to a
//! bandwidth cap ([`pacing`]), and stripes that lost more shards than the code can
//! repair are sent again whole, in rounds driven by the receiver's lists of missing
//! stripes ([`sender`], [`receiver`]). [`link`] is an in-process lossy link to test
//! and measure all of it; [`udp`] carries the packets in UDP datagrams between
//! processes and hosts, optionally through an emulated delay and loss on egress.

pub mod fec;
pub mod link;
pub mod pacing;
pub mod packet;
pub mod receiver;
pub mod sender;
pub mod udp;

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;

pub use fec::{FecConfig, StripeCodec};
pub use link::{lossy_link, LinkConfig, LinkRx, LinkStats, LinkTx};
pub use pacing::TokenBucket;
pub use receiver::{ReceiveReport, WanReceiver};
pub use sender::{SendReport, WanSender};
pub use udp::{udp_endpoint, Impairment, UdpSink, UdpSource, UdpStats};

use crate::error::TransferError;

/// Settings shared by both ends of a WAN copy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WanConfig {
    /// The stripe shape.
    pub fec: FecConfig,
    /// The bandwidth cap of the sender, in bytes per second on the wire.
    pub rate_bytes_per_sec: u64,
    /// The largest burst the sender may send at once, in bytes. Keep it above a few
    /// milliseconds' worth of `rate_bytes_per_sec`: the sender sleeps for tokens, and
    /// tokio's timer has millisecond granularity, so a smaller burst caps the rate
    /// below the configured one.
    pub burst_bytes: u64,
    /// How long the sender waits for an answer to an end-of-round probe.
    pub feedback_timeout: Duration,
    /// Probes per round before the sender gives up on hearing back.
    pub probes: u32,
    /// Rounds (the first send and the retransmissions) before giving up.
    pub max_rounds: u32,
    /// How long the receiver waits for any packet before giving up.
    pub idle_timeout: Duration,
    /// The largest object a receiver accepts.
    pub max_object_bytes: u64,
    /// Acknowledgements the receiver sends when the object is complete (the ack
    /// crosses the lossy link too; the sender gives up only if all are lost).
    pub acks: u32,
}

impl Default for WanConfig {
    fn default() -> Self {
        Self {
            fec: FecConfig::default(),
            rate_bytes_per_sec: 100_000_000,
            burst_bytes: 256 * 1024,
            feedback_timeout: Duration::from_millis(500),
            probes: 5,
            max_rounds: 20,
            idle_timeout: Duration::from_secs(30),
            max_object_bytes: 1 << 30,
            acks: 3,
        }
    }
}

/// Where a WAN endpoint sends packets (a lossy link in tests, a datagram socket in
/// a deployment).
pub trait PacketSink: Send {
    /// Sends one packet, which may be lost.
    ///
    /// # Errors
    /// When the other end is gone for good.
    fn send_packet(&mut self, packet: Bytes) -> Result<(), TransferError>;
}

/// Where a WAN endpoint receives packets from.
pub trait PacketSource: Send {
    /// The next packet, or `None` when none came within `timeout`.
    fn recv_packet(&mut self, timeout: Duration) -> impl Future<Output = Option<Bytes>> + Send;
}

impl PacketSink for LinkTx {
    fn send_packet(&mut self, packet: Bytes) -> Result<(), TransferError> {
        self.send(packet)
    }
}

impl PacketSource for LinkRx {
    fn recv_packet(&mut self, timeout: Duration) -> impl Future<Output = Option<Bytes>> + Send {
        self.recv_timeout(timeout)
    }
}
