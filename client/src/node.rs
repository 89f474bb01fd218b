//! A node ("real client"): owns one memory segment, serves it over TCP (and over
//! RDMA when asked: `Protocol::Rdma`), mounts it with its sub-master advertising
//! both, pings it, remounts when a new leader does not know it (Mooncake's
//! NEED_REMOUNT), and unmounts on shutdown.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hkvm_events::rpc::submaster::{MountSegment, Ping, Remount, UnmountSegment};
use hkvm_events::{NodeId, RdmaEndpoint, SegmentId};
use hkvm_telemetry::repeats::Repeats;
use hkvm_transfer::{
    Admission, RegionId, Segment, ServerHandle, TcpConfig, TcpTransport, Transport,
};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::error::ClientError;
use crate::grants::GrantFollower;
use crate::submaster::SubmasterClient;

/// A failure that repeats while it lasts (a ping to an absent sub-master) is
/// logged at most once per this period, with how many times it happened.
const REPEATS_LOGGED_EVERY: Duration = Duration::from_secs(30);
/// How long a starting node waits for its sub-cluster's grant key (its
/// sub-master creates it when it starts).
const GRANT_KEY_PATIENCE: Duration = Duration::from_secs(30);
use crate::transports::Protocol;

/// How a node runs.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// The node's id.
    pub node: NodeId,
    /// Its segment's id.
    pub segment: SegmentId,
    /// Segment size in bytes.
    pub segment_size: u64,
    /// Where the transfer server listens (`127.0.0.1:0` for an ephemeral port).
    pub listen: SocketAddr,
    /// The address peers use to reach it: `host:port`, or a bare `host` that takes
    /// the listener's port; the listen address when `None`.
    pub advertise: Option<String>,
    /// How often it pings the sub-master.
    pub ping_interval: Duration,
    /// TCP only, or RDMA too (the node then fails to start on a host without the
    /// device asked for).
    pub protocol: Protocol,
    /// Commit the segment's memory before it is mounted (the default), so that
    /// no put pays the kernel's first-touch page faults; `false` leaves them to
    /// the first write of each page.
    pub populate: bool,
}

impl NodeConfig {
    /// A node named `node` with one segment of `segment_size` bytes on an
    /// ephemeral loopback port.
    ///
    /// # Errors
    /// When `<node>-seg` is not a valid segment id.
    pub fn new(node: NodeId, segment_size: u64) -> Result<Self, hkvm_events::IdError> {
        Ok(Self {
            segment: SegmentId::new(format!("{node}-seg"))?,
            node,
            segment_size,
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise: None,
            ping_interval: Duration::from_secs(1),
            protocol: Protocol::Tcp,
            populate: true,
        })
    }
}

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The segment or the transfer server could not be set up.
    #[error("transfer: {0}")]
    Transfer(#[from] hkvm_transfer::TransferError),
    /// The sub-master refused the mount or was unreachable.
    #[error("mount: {0}")]
    Mount(#[from] ClientError),
    /// The sub-cluster's grant key could not be read: without it the data port
    /// would refuse every transfer.
    #[error("data-port grant key: {0}")]
    GrantKey(#[from] hkvm_log::grants::GrantKeyError),
}

/// A running node; [`NodeHandle::shutdown`] unmounts and stops it.
pub struct NodeHandle {
    endpoint: String,
    segment: Arc<Segment>,
    stop: watch::Sender<bool>,
    pinger: JoinHandle<()>,
    server: ServerHandle,
    /// Keeps the data port's grant key current.
    _grants: GrantFollower,
    rdma: Option<RdmaServing>,
    client: SubmasterClient,
    config: NodeConfig,
}

impl std::fmt::Debug for NodeHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeHandle")
            .field("node", &self.config.node)
            .field("endpoint", &self.endpoint)
            .finish()
    }
}

/// The endpoint a node announces: `advertise` as given when it names a port, a
/// bare host with the listener's port, or the listener's address.
fn advertised_endpoint(advertise: Option<&str>, listening: SocketAddr) -> String {
    match advertise {
        None => listening.to_string(),
        Some(host)
            if host
                .rsplit_once(':')
                .is_some_and(|(_, port)| port.parse::<u16>().is_ok()) =>
        {
            host.to_owned()
        }
        Some(host) => format!("{host}:{}", listening.port()),
    }
}

fn mount_request(config: &NodeConfig, endpoint: &str, rdma: Option<&RdmaEndpoint>) -> MountSegment {
    MountSegment {
        node: config.node.clone(),
        segment: config.segment.clone(),
        size: config.segment_size,
        endpoint: endpoint.to_owned(),
        rdma: rdma.cloned(),
    }
}

/// A node's segment served over RDMA: the transport (which peers' queue pairs
/// reach), its exchange server and what the node advertises.
struct RdmaServing {
    transport: Arc<dyn Transport>,
    server: ServerHandle,
    advert: RdmaEndpoint,
}

/// Opens RDMA as `config` asks, registers the segment and serves queue-pair
/// exchanges next to the TCP listener (same address, a port of its own).
#[cfg(feature = "rdma")]
async fn serve_rdma(
    config: &NodeConfig,
    segment: &Arc<Segment>,
    tcp_endpoint: &str,
) -> Result<Option<RdmaServing>, NodeError> {
    let Protocol::Rdma(settings) = &config.protocol else {
        return Ok(None);
    };
    let transport = crate::transports::open_rdma(settings)?;
    transport.register(Arc::clone(segment))?;
    let listener = tokio::net::TcpListener::bind(SocketAddr::new(config.listen.ip(), 0))
        .await
        .map_err(|source| hkvm_transfer::TransferError::Io {
            what: "binding the RDMA exchange listener",
            source,
        })?;
    let server = transport.serve(listener)?;
    let host = tcp_endpoint
        .rsplit_once(':')
        .map_or(tcp_endpoint, |(host, _)| host);
    let port = transport.port_address();
    let region = transport.served_region(segment.id()).ok_or_else(|| {
        hkvm_transfer::TransferError::UnknownRegion {
            region: segment.id().to_string(),
        }
    })?;
    let advert = RdmaEndpoint {
        device: port.device,
        gid: port.gid,
        lid: port.lid,
        exchange: format!("{host}:{}", server.local_addr().port()),
        rkey: region.rkey,
        addr: region.addr,
        len: region.len,
    };
    tracing::info!(node = %config.node, rdma = %advert, "node serves its segment over RDMA");
    Ok(Some(RdmaServing {
        transport,
        server,
        advert,
    }))
}

/// Without the `rdma` feature a node asked for RDMA fails at once.
#[cfg(not(feature = "rdma"))]
async fn serve_rdma(
    config: &NodeConfig,
    _segment: &Arc<Segment>,
    _tcp_endpoint: &str,
) -> Result<Option<RdmaServing>, NodeError> {
    match &config.protocol {
        Protocol::Tcp => Ok(None),
        Protocol::Rdma(settings) => match crate::transports::open_rdma(settings) {
            Err(error) => Err(error.into()),
            Ok(_) => unreachable!("open_rdma always fails without the rdma feature"),
        },
    }
}

/// Commits `segment`'s memory on a blocking thread (before anything is written
/// into it); a kernel that refuses leaves the pages to be committed on first
/// touch, with a warning.
async fn populate(segment: &Arc<Segment>) {
    let started = std::time::Instant::now();
    let populating = Arc::clone(segment);
    match tokio::task::spawn_blocking(move || populating.populate()).await {
        Ok(Ok(())) => tracing::info!(
            bytes = segment.len(),
            ms = started.elapsed().as_millis() as u64,
            "segment memory committed"
        ),
        Ok(Err(error)) => {
            tracing::warn!(%error, "segment memory left to be committed on first touch");
        }
        Err(error) => tracing::warn!(%error, "committing the segment's memory"),
    }
}

impl NodeHandle {
    /// Allocates the segment, serves it over TCP, mounts it and starts pinging.
    ///
    /// # Errors
    /// [`NodeError`] when the segment, the listener or the mount fails.
    pub async fn start(config: NodeConfig, client: SubmasterClient) -> Result<Self, NodeError> {
        // Every read through this transport is the KV client's (for the node's own
        // store or its dummies), which verifies each value end to end.
        let transport = TcpTransport::new(TcpConfig {
            read_checksums: false,
            ..TcpConfig::default()
        });
        let grants = GrantFollower::start(
            client.caller().nats().clone(),
            client.cluster().clone(),
            client.subcluster().clone(),
        );
        // The port first: a port chosen a moment ago is taken at once, not after
        // the segment is populated (seconds for a large one). It serves only what
        // the sub-master granted.
        let server = transport
            .bind(config.listen, grants.checker() as Arc<dyn Admission>)
            .await?;
        let segment =
            Segment::allocate(RegionId::new(config.segment.as_str())?, config.segment_size)?;
        if config.populate {
            populate(&segment).await;
        }
        transport.register(Arc::clone(&segment))?;
        let endpoint = advertised_endpoint(config.advertise.as_deref(), server.local_addr());
        let rdma = serve_rdma(&config, &segment, &endpoint).await?;
        let advert = rdma.as_ref().map(|serving| serving.advert.clone());
        // Mounted only once the data port can check grants: a put placed here at
        // once must not be refused.
        let key_id = grants
            .ready(GRANT_KEY_PATIENCE, client.subcluster())
            .await?;
        tracing::debug!(key_id, "data-port grant key read");
        client
            .mount_segment(mount_request(&config, &endpoint, advert.as_ref()))
            .await?;
        tracing::info!(node = %config.node, segment = %config.segment, size = config.segment_size, %endpoint, rdma = advert.is_some(), "node mounted its segment");
        let (stop, mut stopped) = watch::channel(false);
        let pinger = {
            let (client, config, endpoint) = (client.clone(), config.clone(), endpoint.clone());
            let advert = advert.clone();
            tokio::spawn(async move {
                let ping_failures = Repeats::every(REPEATS_LOGGED_EVERY);
                let mut tick = tokio::time::interval(config.ping_interval);
                loop {
                    tokio::select! {
                        _ = stopped.changed() => return,
                        _ = tick.tick() => {}
                    }
                    match client
                        .ping(Ping {
                            node: config.node.clone(),
                        })
                        .await
                    {
                        Ok(reply) if reply.need_remount => {
                            tracing::warn!(node = %config.node, epoch = reply.epoch, "the leader does not know this node: remounting");
                            let remount = Remount {
                                node: config.node.clone(),
                                segments: vec![mount_request(&config, &endpoint, advert.as_ref())],
                            };
                            if let Err(error) = client.remount(remount).await {
                                tracing::warn!(%error, "remount failed; will retry");
                            }
                        }
                        Ok(_) => {}
                        Err(error) => {
                            if let Some(times) = ping_failures.occur() {
                                tracing::warn!(%error, times, "ping failed (once per {}s at most, with how many times)", REPEATS_LOGGED_EVERY.as_secs());
                            }
                        }
                    }
                }
            })
        };
        Ok(Self {
            endpoint,
            segment,
            stop,
            pinger,
            server,
            _grants: grants,
            rdma,
            client,
            config,
        })
    }

    /// What the node advertises for RDMA, when it serves RDMA.
    pub fn rdma_endpoint(&self) -> Option<&RdmaEndpoint> {
        self.rdma.as_ref().map(|serving| &serving.advert)
    }

    /// The node's RDMA transport, when it serves RDMA: a client in the same process
    /// moves its bytes with it too (one device context, one protection domain).
    pub fn rdma_transport(&self) -> Option<&Arc<dyn Transport>> {
        self.rdma.as_ref().map(|serving| &serving.transport)
    }

    /// The endpoint peers reach this node at.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The node's segment (for tests that inspect or corrupt its bytes).
    pub fn segment(&self) -> &Arc<Segment> {
        &self.segment
    }

    /// Unmounts the segment and stops serving.
    ///
    /// # Errors
    /// When the unmount is refused or unreachable (the node stops anyway).
    pub async fn shutdown(self) -> Result<(), ClientError> {
        let _ = self.stop.send(true);
        let _ = self.pinger.await;
        let unmounted = self
            .client
            .unmount_segment(UnmountSegment {
                node: self.config.node.clone(),
                segment: self.config.segment.clone(),
            })
            .await;
        self.server.shutdown().await;
        if let Some(rdma) = self.rdma {
            rdma.server.shutdown().await;
        }
        unmounted
    }

    /// Stops abruptly, as a crash would: no unmount, the server goes away.
    pub async fn kill(self) {
        self.pinger.abort();
        self.server.shutdown().await;
        if let Some(rdma) = self.rdma {
            rdma.server.shutdown().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bare_host_takes_the_listeners_port() {
        let listening = SocketAddr::from(([127, 0, 0, 1], 4567));
        assert_eq!(advertised_endpoint(None, listening), "127.0.0.1:4567");
        assert_eq!(
            advertised_endpoint(Some("node-a"), listening),
            "node-a:4567"
        );
        assert_eq!(
            advertised_endpoint(Some("node-a:80"), listening),
            "node-a:80"
        );
    }
}
