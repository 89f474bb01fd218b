//! The WAN leg of a copy. The inter-DC master asks a gateway of the source pool
//! (NATS request on [`interdc_fetch_subject`]) to read a block there and send it to
//! a UDP socket the master opened for this one copy; the gateway reads the block
//! through the source's sub-master and nodes (checksum-verified on the LAN), then
//! sends it with the transfer crate's FEC + pacing mode, and answers the request
//! with what the send cost. The master verifies the received bytes against the
//! source checksum before writing them into the target pool.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt as _;
use hkvm_client::KvError;
use hkvm_events::rpc::interdc::{FetchReply, FetchRequest, SentReport, WanShape, GATEWAY_QUEUE};
use hkvm_events::subject::interdc_fetch_subject;
use hkvm_events::{value_checksum, ClusterId, SubclusterId};
use hkvm_transfer::wan::{
    udp_endpoint, FecConfig, Impairment, ReceiveReport, SendReport, WanConfig, WanReceiver,
    WanSender,
};
use ipnet::IpNet;
use tokio::net::UdpSocket;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use std::sync::atomic::{AtomicU64, Ordering};

use crate::clients::PoolClients;
use crate::diff::Candidate;
use crate::error::InterDcError;

/// The feedback timeout when a shape gives none.
const DEFAULT_FEEDBACK_TIMEOUT: Duration = Duration::from_millis(600);

/// The transfer crate's configuration for a copy of `shape` (both ends use it).
pub fn wan_config(shape: &WanShape) -> WanConfig {
    let rate = shape.rate_bytes_per_sec.max(1);
    WanConfig {
        fec: FecConfig {
            data_shards: usize::from(shape.data_shards),
            parity_shards: usize::from(shape.parity_shards),
            shard_bytes: shape.shard_bytes as usize,
        },
        rate_bytes_per_sec: rate,
        // 20 ms worth of the rate, within sane bounds: enough for the millisecond
        // timer, small enough to stay near the cap.
        burst_bytes: (rate / 50).clamp(16 * 1024, 1 << 20),
        feedback_timeout: if shape.feedback_timeout_ms == 0 {
            DEFAULT_FEEDBACK_TIMEOUT
        } else {
            Duration::from_millis(u64::from(shape.feedback_timeout_ms))
        },
        // Enough probes to ride out a few seconds of total loss at any timeout.
        probes: (3_000 / shape.feedback_timeout_ms.max(1)).clamp(8, 60),
        max_rounds: 30,
        idle_timeout: Duration::from_secs(20),
        ..WanConfig::default()
    }
}

/// What a send cost, as the fetch reply carries it.
fn sent_report(report: &SendReport) -> SentReport {
    SentReport {
        bytes: report.bytes,
        wire_bytes: report.wire_bytes,
        rounds: report.rounds,
        stripes_retransmitted: report.stripes_retransmitted,
    }
}

/// Settings of a gateway.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// The source cluster it serves.
    pub cluster: ClusterId,
    /// Address its UDP sockets bind to.
    pub bind_ip: IpAddr,
    /// Emulated impairment of its egress (tests, benchmarks).
    pub impairment: Impairment,
    /// Sends in flight at once.
    pub max_concurrent: usize,
    /// The networks a requester's reply address must lie in: the gateway
    /// sends a value to no other address (a request naming another is refused
    /// before anything is read).
    pub peers: Vec<IpNet>,
}

/// A running gateway. Dropping it stops it.
#[derive(Debug)]
pub struct Gateway {
    task: JoinHandle<()>,
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Gateway {
    /// Joins the gateway queue group of `config.cluster` on `nats`.
    ///
    /// # Errors
    /// [`InterDcError::Nats`] when the subscription fails.
    pub async fn start(
        nats: async_nats::Client,
        config: GatewayConfig,
    ) -> Result<Self, InterDcError> {
        let subject = interdc_fetch_subject(&config.cluster);
        let mut requests = nats
            .queue_subscribe(subject.clone(), GATEWAY_QUEUE.to_owned())
            .await
            .map_err(|e| InterDcError::nats(format!("subscribing to {subject}"), e))?;
        tracing::info!(%subject, "inter-DC gateway serving");
        let state = Arc::new(GatewayState {
            nats: nats.clone(),
            config: config.clone(),
            clients: PoolClients::new(nats.clone(), config.cluster.clone()),
            permits: Semaphore::new(config.max_concurrent.max(1)),
        });
        let task = tokio::spawn(async move {
            while let Some(message) = requests.next().await {
                let state = Arc::clone(&state);
                tokio::spawn(async move {
                    let reply = state.handle(&message.payload).await;
                    if let Some(to) = message.reply {
                        match rmp_serde::to_vec_named(&reply) {
                            Ok(bytes) => {
                                if let Err(error) = state.nats.publish(to, bytes.into()).await {
                                    tracing::warn!(%error, "answering a fetch");
                                }
                            }
                            Err(error) => tracing::error!(%error, "encoding a fetch reply"),
                        }
                    }
                });
            }
        });
        Ok(Self { task })
    }
}

struct GatewayState {
    nats: async_nats::Client,
    config: GatewayConfig,
    clients: PoolClients,
    permits: Semaphore,
}

impl GatewayState {
    async fn handle(&self, payload: &[u8]) -> FetchReply {
        let request: FetchRequest = match rmp_serde::from_slice(payload) {
            Ok(request) => request,
            Err(error) => return FetchReply::BadRequest(error.to_string()),
        };
        let subcluster = match SubclusterId::new(request.subcluster.clone()) {
            Ok(id) => id,
            Err(error) => return FetchReply::BadRequest(error.to_string()),
        };
        let peer = match self.allowed_peer(&request.reply_addr).await {
            Ok(peer) => peer,
            Err(refusal) => return refusal,
        };
        let Ok(_permit) = self.permits.acquire().await else {
            return FetchReply::Failed("gateway stopping".into());
        };
        // The request names the sub-cluster: ask it alone, not the global master.
        let fetched = match self.clients.get(&subcluster).get_here(&request.key).await {
            Ok(fetched) => fetched,
            Err(KvError::NotFound { .. }) => return FetchReply::Gone,
            Err(error) => return FetchReply::Failed(error.to_string()),
        };
        let checksum = value_checksum(&fetched.value);
        if checksum != request.checksum {
            return FetchReply::Changed { checksum };
        }
        match self.send(&request, peer, &fetched.value).await {
            Ok(report) => FetchReply::Sent(sent_report(&report)),
            Err(error) => FetchReply::Failed(error.to_string()),
        }
    }

    /// Where to send for `reply_addr`, when it resolves into one of the
    /// configured peer networks; otherwise the reply refusing the request.
    async fn allowed_peer(&self, reply_addr: &str) -> Result<SocketAddr, FetchReply> {
        let peer = tokio::net::lookup_host(reply_addr)
            .await
            .map_err(|e| FetchReply::Failed(format!("resolving {reply_addr}: {e}")))?
            .next()
            .ok_or_else(|| FetchReply::Failed(format!("{reply_addr} resolves to nothing")))?;
        if !is_allowed(&self.config.peers, peer.ip()) {
            tracing::warn!(%peer, "inter-DC fetch refused: its reply address is in no configured peer network");
            return Err(FetchReply::BadRequest(format!(
                "reply address {peer} is not a registered peer of this gateway"
            )));
        }
        Ok(peer)
    }

    async fn send(
        &self,
        request: &FetchRequest,
        peer: SocketAddr,
        value: &[u8],
    ) -> Result<SendReport, InterDcError> {
        let socket = UdpSocket::bind(SocketAddr::new(self.config.bind_ip, 0))
            .await
            .map_err(|e| InterDcError::wan_caused("binding a UDP socket", e))?;
        let (sink, source) = udp_endpoint(socket, Some(peer), per_copy(self.config.impairment))
            .map_err(|e| InterDcError::wan_caused("opening the UDP endpoint", e))?;
        let mut sender = WanSender::new(wan_config(&request.shape), sink, source)
            .map_err(|e| InterDcError::wan_caused("setting up the sender", e))?;
        sender
            .send(value)
            .await
            .map_err(|e| InterDcError::wan_caused("sending", e))
    }
}

/// Whether `ip` lies in one of `peers` (an IPv4 address mapped into IPv6
/// counts as itself).
fn is_allowed(peers: &[IpNet], ip: IpAddr) -> bool {
    let ip = match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    };
    peers.iter().any(|net| net.contains(&ip))
}

/// Where the master's receiving sockets live.
#[derive(Debug, Clone)]
pub struct ReceiverSettings {
    /// Address the UDP sockets bind to.
    pub bind_ip: IpAddr,
    /// The host name or address gateways send to.
    pub advertise_host: String,
    /// Emulated impairment of the master's egress (feedback packets).
    pub impairment: Impairment,
}

/// What a fetch brought.
#[derive(Debug, Clone)]
pub enum Fetched {
    /// The block, verified against the expected checksum.
    Block {
        /// Its bytes.
        value: Bytes,
        /// What the send cost (gateway side).
        sent: SentReport,
        /// What the receiver saw.
        received: ReceiveReport,
    },
    /// The source no longer holds it.
    Gone,
    /// The source holds a different value now.
    Changed,
}

/// Fetches one block from the source pool's gateways over the WAN.
///
/// # Errors
/// [`InterDcError::Wan`] when the copy failed or the bytes do not match the
/// checksum, [`InterDcError::Nats`] when no gateway answered.
pub async fn fetch(
    source_nats: &async_nats::Client,
    source: &ClusterId,
    settings: &ReceiverSettings,
    candidate: &Candidate,
    shape: WanShape,
) -> Result<Fetched, InterDcError> {
    let key = candidate.block.key.as_str();
    let checksum = candidate.block.checksum;
    let size = candidate.block.size;
    let socket = UdpSocket::bind(SocketAddr::new(settings.bind_ip, 0))
        .await
        .map_err(|e| InterDcError::wan_caused("binding a UDP socket", e))?;
    let port = socket
        .local_addr()
        .map_err(|e| InterDcError::wan_caused("reading the socket's address", e))?
        .port();
    let (sink, packets) = udp_endpoint(socket, None, settings.impairment)
        .map_err(|e| InterDcError::wan_caused("opening the UDP endpoint", e))?;
    let mut receiver = WanReceiver::new(wan_config(&shape), packets, sink)
        .map_err(|e| InterDcError::wan_caused("setting up the receiver", e))?;
    let receiving = tokio::spawn(async move { receiver.receive().await });
    let _abort_receiver = AbortOnDrop(receiving.abort_handle());
    let request = FetchRequest {
        subcluster: candidate.subcluster.to_string(),
        key: key.to_owned(),
        checksum,
        reply_addr: format!("{}:{port}", settings.advertise_host),
        shape,
    };
    let payload = rmp_serde::to_vec_named(&request)
        .map_err(|e| InterDcError::wan_caused("encoding the fetch request", e))?;
    // Room for the whole send at the paced rate (with recovery shards and a few
    // rounds) plus the LAN read on the far side.
    let expected =
        Duration::from_secs_f64(size as f64 * 2.0 / shape.rate_bytes_per_sec.max(1) as f64);
    let timeout = expected + Duration::from_secs(30);
    let subject = interdc_fetch_subject(source);
    let request = async_nats::Request::new()
        .payload(payload.into())
        .timeout(Some(timeout));
    let message = source_nats
        .send_request(subject.clone(), request)
        .await
        .map_err(|e| InterDcError::nats(format!("fetch request on {subject}"), e))?;
    let reply: FetchReply = rmp_serde::from_slice(&message.payload)
        .map_err(|e| InterDcError::wan_caused("undecodable fetch reply", e))?;
    let sent = match reply {
        FetchReply::Sent(sent) => sent,
        FetchReply::Gone => return Ok(Fetched::Gone),
        FetchReply::Changed { .. } => return Ok(Fetched::Changed),
        FetchReply::BadRequest(reason) | FetchReply::Failed(reason) => {
            return Err(InterDcError::Gateway(reason))
        }
    };
    // The gateway answers after the receiver acknowledged, so the bytes are here
    // or about to be.
    let (value, received) = tokio::time::timeout(Duration::from_secs(10), receiving)
        .await
        .map_err(|e| {
            InterDcError::wan_caused("the receiver did not finish after the gateway's answer", e)
        })?
        .map_err(|e| InterDcError::wan_caused("receiver task", e))?
        .map_err(|e| InterDcError::wan_caused("receiving", e))?;
    let got = value_checksum(&value);
    if got != checksum {
        return Err(InterDcError::wan(format!(
            "{key}: received bytes have checksum {got:016x}, the source's is {checksum:016x}"
        )));
    }
    Ok(Fetched::Block {
        value: value.into(),
        sent,
        received,
    })
}

/// The impairment of one copy's endpoint: the configured one with a seed of its
/// own, so that emulated losses are independent from copy to copy (the same seed
/// would drop the same packet positions of every block).
fn per_copy(impairment: Impairment) -> Impairment {
    static COPIES: AtomicU64 = AtomicU64::new(0);
    let copy = COPIES.fetch_add(1, Ordering::Relaxed);
    Impairment {
        seed: impairment.seed ^ copy.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(29),
        ..impairment
    }
}

struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn shape() -> WanShape {
        WanShape {
            rate_bytes_per_sec: 1_000_000,
            data_shards: 64,
            parity_shards: 16,
            shard_bytes: 1024,
            feedback_timeout_ms: 170,
        }
    }

    #[test]
    fn only_addresses_in_a_peer_network_are_sent_to() {
        let peers: Vec<IpNet> = ["10.1.0.0/16", "192.0.2.7/32", "2001:db8::/32"]
            .iter()
            .map(|net| net.parse().unwrap())
            .collect();
        let allowed = |ip: &str| is_allowed(&peers, ip.parse().unwrap());
        assert!(allowed("10.1.200.3"));
        assert!(allowed("192.0.2.7"));
        assert!(
            allowed("::ffff:10.1.0.9"),
            "a mapped IPv4 address is itself"
        );
        assert!(allowed("2001:db8::1"));
        assert!(!allowed("10.2.0.1"));
        assert!(!allowed("192.0.2.8"));
        assert!(!allowed("127.0.0.1"));
        assert!(
            !is_allowed(&[], "10.1.0.1".parse().unwrap()),
            "no peers: nobody"
        );
    }

    #[test]
    fn the_shape_keeps_the_rate_and_a_usable_burst() {
        let config = wan_config(&shape());
        assert_eq!(config.rate_bytes_per_sec, 1_000_000);
        assert!(config.burst_bytes >= 16 * 1024);
        assert_eq!(config.feedback_timeout, Duration::from_millis(170));
        let unset = WanShape {
            feedback_timeout_ms: 0,
            ..shape()
        };
        assert_eq!(
            wan_config(&unset).feedback_timeout,
            DEFAULT_FEEDBACK_TIMEOUT
        );
        let zero = WanShape {
            rate_bytes_per_sec: 0,
            ..shape()
        };
        assert_eq!(
            wan_config(&zero).rate_bytes_per_sec,
            1,
            "a zero rate is not a division by zero"
        );
    }

    proptest! {
        /// Whatever is read back from the progress bucket decodes or is refused
        /// with an error, never a panic.
        #[test]
        fn arbitrary_records_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = rmp_serde::from_slice::<crate::progress::CopiedRecord>(&bytes);
            let _ = rmp_serde::from_slice::<crate::progress::InFlightRecord>(&bytes);
            let _ = serde_json::from_slice::<crate::status::InterDcStatus>(&bytes);
        }
    }
}
