//! An embedded real client with Mooncake Store's semantics, the core behind the
//! Python `MooncakeDistributedStore`: setting it up makes the process a node of its
//! sub-cluster (contributing a memory segment it serves over TCP, and over RDMA with
//! `Protocol::Rdma`) and a client of the whole cluster. Puts go to its sub-master (first writer wins, as in
//! Mooncake); reads, existence and removal find keys in other sub-clusters through
//! the global master. Every value is checksummed end to end.

mod address;
mod buffers;
pub mod choose;
mod cluster_wide;
mod code;
mod host_range;
mod peers;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hkvm_events::rpc::submaster::ItemError;
use hkvm_events::{NodeId, SegmentId, SubclusterId};
use hkvm_transfer::{TcpConfig, TcpTransport};
use tokio::sync::Mutex;

pub use address::{AddressError, StoreAddress};
pub use buffers::{BufferRegistry, RegisterError};
pub use code::ErrorCode;
pub use host_range::{check_host_range, check_in_maps, HostRangeError};

use crate::connect::{connect, ConnectError};
use crate::kv::{KvClient, KvError, Located, PutOptions};
use crate::node::{NodeConfig, NodeError, NodeHandle};
use crate::retry::RetryPolicy;
use crate::transports::{Protocol, Transports};
use crate::{ClientError, GlobalClient, SubmasterClient};
use peers::Peers;

/// How a store is set up.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// NATS servers, cluster and sub-cluster.
    pub address: StoreAddress,
    /// This host as peers reach it: `host` (the node takes a free port) or
    /// `host:port`.
    pub local_hostname: String,
    /// Bytes this process contributes to the pool (0: a client only).
    pub global_segment_size: u64,
    /// The largest value a copying call (put, get, get_buffer) stages; zero-copy
    /// calls on registered buffers are not bounded by it.
    pub local_buffer_size: u64,
    /// Retry policy of every metadata call.
    pub retry: RetryPolicy,
    /// How long setup waits for the sub-master to answer.
    pub setup_timeout: Duration,
    /// The node's id (default: named after its endpoint).
    pub node_id: Option<NodeId>,
    /// Where the node listens (default: the local host name's address, with its
    /// port or a free one).
    pub listen: Option<std::net::SocketAddr>,
    /// Coalesce concurrent metadata calls (a real client serving dummies).
    pub coalesce: Option<crate::coalesce::CoalesceConfig>,
    /// How this process's node serves and its client moves bytes: TCP, or RDMA
    /// where both ends have it (setup fails on a host without the device asked
    /// for).
    pub protocol: Protocol,
}

impl StoreConfig {
    /// A configuration with default timeouts.
    pub fn new(address: StoreAddress, local_hostname: impl Into<String>) -> Self {
        Self {
            address,
            local_hostname: local_hostname.into(),
            global_segment_size: 16 << 20,
            local_buffer_size: 16 << 20,
            retry: RetryPolicy {
                retry_deadline: Duration::from_secs(10),
                ..RetryPolicy::default()
            },
            setup_timeout: Duration::from_secs(5),
            node_id: None,
            listen: None,
            coalesce: None,
            protocol: Protocol::Tcp,
        }
    }
}

/// Why a store call failed; [`StoreError::code`] is the Mooncake code callers see.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The master address does not parse.
    #[error(transparent)]
    Address(#[from] AddressError),
    /// NATS could not be reached.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// The sub-cluster's sub-master did not answer during setup.
    #[error("no sub-master of {subcluster} answered; is it running? (`hkvm status`)")]
    Unreachable {
        /// The sub-cluster.
        subcluster: SubclusterId,
        /// The last failure.
        #[source]
        source: ClientError,
    },
    /// The node (segment, listener, mount) could not start.
    #[error("starting this process's node")]
    Node(#[from] NodeError),
    /// A put or get failed.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// A metadata call failed.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// The arguments are wrong.
    #[error("{0}")]
    InvalidParams(String),
    /// The store was closed.
    #[error("the store is closed")]
    Closed,
    /// The registry could not be read to choose a sub-cluster.
    #[error("reading the registry of sub-masters: {0}")]
    Registry(String),
}

impl StoreError {
    /// The Mooncake error code of this failure.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Address(_) | Self::InvalidParams(_) | Self::Closed => ErrorCode::InvalidParams,
            Self::Connect(_) | Self::Unreachable { .. } | Self::Registry(_) => ErrorCode::RpcFail,
            Self::Node(NodeError::Mount(error)) | Self::Client(error) => {
                ErrorCode::of_client(error)
            }
            // RDMA asked for on a host (or build) without it: a setup argument
            // this host cannot honour.
            Self::Node(NodeError::Transfer(error))
                if error.kind() == hkvm_transfer::ErrorKind::NoDevice =>
            {
                ErrorCode::InvalidParams
            }
            Self::Node(NodeError::Transfer(_)) => ErrorCode::InternalError,
            // The sub-master never started, or this credential may not read
            // the grant key.
            Self::Node(NodeError::GrantKey(_)) => ErrorCode::RpcFail,
            Self::Kv(error) => ErrorCode::of_kv(error),
        }
    }
}

/// What [`Store::health`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum Health {
    /// The sub-master answers.
    Healthy = 0,
    /// The store is closed.
    NotInitialized = 1,
    /// The sub-master does not answer.
    MasterUnreachable = 2,
}

/// A set-up store. Cheap to share across threads (`Arc`).
#[derive(Debug)]
pub struct Store {
    kv: KvClient,
    global: GlobalClient,
    nats: async_nats::Client,
    address: StoreAddress,
    hostname: String,
    node: Mutex<Option<NodeHandle>>,
    closed: AtomicBool,
    /// Whether other sub-clusters exist, from the registry (listed on demand).
    peers: Peers,
}

/// The node and segment name of an endpoint: its characters outside
/// `[A-Za-z0-9_-]` become `-`, and a long one is shortened with a hash, so the
/// same endpoint always names the same node.
pub fn node_name_for(endpoint: &str) -> String {
    let clean: String = endpoint
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '-'
            }
        })
        .collect();
    if clean.len() <= 56 {
        clean
    } else {
        let hash = xxhash_rust::xxh3::xxh3_64(endpoint.as_bytes());
        format!("{}-{hash:016x}", &clean[..39])
    }
}

/// The segment a node serving at `endpoint` mounts (what a Mooncake caller names
/// as a preferred segment, `host:port`).
pub fn segment_for(endpoint: &str) -> Option<SegmentId> {
    SegmentId::new(format!("{}-seg", node_name_for(endpoint))).ok()
}

/// Splits `host` or `host:port` (port 0 when absent).
fn split_host(local_hostname: &str) -> Result<(String, u16), StoreError> {
    match local_hostname.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') => port
            .parse::<u16>()
            .map(|port| (host.to_owned(), port))
            .map_err(|_| StoreError::InvalidParams(format!("bad port in {local_hostname:?}"))),
        _ if local_hostname.is_empty() => {
            Err(StoreError::InvalidParams("empty local_hostname".into()))
        }
        _ => Ok((local_hostname.to_owned(), 0)),
    }
}

/// How many ports a store picks before giving up when each was taken between
/// the pick and the bind.
const PORT_ATTEMPTS: u32 = 8;

/// Whether a node failed to start because its listen port was in use.
fn port_taken(error: &NodeError) -> bool {
    matches!(
        error,
        NodeError::Transfer(hkvm_transfer::TransferError::Io { source, .. })
            if source.kind() == std::io::ErrorKind::AddrInUse
    )
}

/// The ports Mooncake's clients serve their memory on when none is given: the
/// range firewalls between inference hosts are opened for.
pub const MOONCAKE_PORTS: std::ops::RangeInclusive<u16> = 12300..=14300;

/// A free TCP port on `ip`, from [`MOONCAKE_PORTS`] (tried from a random start, so
/// that processes starting together spread over it) and only when all of those
/// are taken any port the kernel gives. The node binds it right after; the race
/// with another process taking it in between is accepted: setup then fails and
/// can be retried.
fn free_port(ip: std::net::IpAddr) -> Result<u16, StoreError> {
    let (first, last) = (*MOONCAKE_PORTS.start(), *MOONCAKE_PORTS.end());
    let span = last - first + 1;
    let start = rand::random::<u16>() % span;
    let in_range = (0..span)
        .map(|step| first + (start + step) % span)
        .find(|&port| std::net::TcpListener::bind((ip, port)).is_ok());
    if let Some(port) = in_range {
        return Ok(port);
    }
    std::net::TcpListener::bind((ip, 0))
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .map_err(|e| StoreError::InvalidParams(format!("no free port on {ip}: {e}")))
}

/// The node a connection logged in as a node's own user (`node-<id>`, docs/
/// security.md) must be: the only one whose segments that user may mount.
fn own_node(nats: &async_nats::Client) -> Option<NodeId> {
    let inbox = nats.new_inbox();
    let user = hkvm_events::subject::user_of_inbox(&inbox)?;
    NodeId::new(user.strip_prefix("node-")?).ok()
}

impl Store {
    /// Connects, checks that the sub-master answers, and (with a segment size)
    /// starts this process's node.
    ///
    /// # Errors
    /// [`StoreError`] for a bad address or host name, NATS or the sub-master out of
    /// reach, or a node that cannot start.
    pub async fn open(config: StoreConfig) -> Result<Self, StoreError> {
        let address = config.address.clone();
        if let Protocol::Rdma(settings) = &config.protocol {
            crate::transports::check_rdma(settings)
                .map_err(|error| StoreError::Node(NodeError::Transfer(error)))?;
        }
        let nats = connect(&address.servers, "hkvm-store").await?;
        let mut metadata = SubmasterClient::with_policy(
            nats.clone(),
            address.cluster.clone(),
            address.subcluster.clone(),
            config.retry,
        );
        if let Some(coalesce) = config.coalesce {
            metadata = metadata.coalesced(coalesce);
        }
        let probe = SubmasterClient::with_policy(
            nats.clone(),
            address.cluster.clone(),
            address.subcluster.clone(),
            RetryPolicy {
                request_timeout: config.setup_timeout,
                retry_deadline: config.setup_timeout,
                ..config.retry
            },
        );
        probe
            .status()
            .await
            .map_err(|source| StoreError::Unreachable {
                subcluster: address.subcluster.clone(),
                source,
            })?;
        let (host, port) = split_host(&config.local_hostname)?;
        let (hostname, node) = if config.global_segment_size > 0 {
            let ip = tokio::net::lookup_host((host.as_str(), 0))
                .await
                .ok()
                .and_then(|mut addrs| addrs.next())
                .map(|addr| addr.ip())
                .ok_or_else(|| StoreError::InvalidParams(format!("cannot resolve {host:?}")))?;
            // A port this process picked may be taken by another picking at the
            // same moment (ranks of one engine start together): pick again.
            let picked_here = config.listen.map_or(port == 0, |listen| listen.port() == 0);
            let mut attempts = 0;
            let node = loop {
                let listen = match config.listen {
                    Some(listen) if listen.port() != 0 => listen,
                    Some(listen) => std::net::SocketAddr::new(listen.ip(), free_port(listen.ip())?),
                    None => {
                        let port = if port == 0 { free_port(ip)? } else { port };
                        std::net::SocketAddr::new(ip, port)
                    }
                };
                let endpoint = format!("{host}:{}", if port == 0 { listen.port() } else { port });
                let node_id = match config.node_id.clone().or_else(|| own_node(&nats)) {
                    Some(id) => id,
                    None => NodeId::new(node_name_for(&endpoint))
                        .map_err(|e| StoreError::InvalidParams(e.to_string()))?,
                };
                let mut node_config = NodeConfig::new(node_id, config.global_segment_size)
                    .map_err(|e| StoreError::InvalidParams(e.to_string()))?;
                node_config.listen = listen;
                node_config.advertise = Some(endpoint.clone());
                node_config.protocol = config.protocol.clone();
                match NodeHandle::start(node_config, metadata.clone()).await {
                    Ok(node) => break node,
                    Err(error) if picked_here && attempts < PORT_ATTEMPTS && port_taken(&error) => {
                        attempts += 1;
                        tracing::debug!(%listen, attempts, "the port picked was taken meanwhile; picking another");
                    }
                    Err(error) => return Err(error.into()),
                }
            };
            (node.endpoint().to_owned(), Some(node))
        } else {
            (config.local_hostname.clone(), None)
        };
        let mut transports = Transports::single(Arc::new(TcpTransport::new(TcpConfig {
            // The KV client verifies every value it reads end to end.
            read_checksums: false,
            ..TcpConfig::default()
        })));
        if let Protocol::Rdma(settings) = &config.protocol {
            let rdma = match node.as_ref().and_then(NodeHandle::rdma_transport) {
                Some(shared) => Arc::clone(shared),
                None => crate::transports::open_rdma(settings)
                    .map_err(|error| StoreError::Node(NodeError::Transfer(error)))?,
            };
            transports = transports.with_rdma(rdma);
        }
        if let Some(node) = &node {
            // Its own segment is read and written by memory copy, not through
            // its own TCP port.
            transports
                .add_local(node.endpoint(), Arc::clone(node.segment()))
                .map_err(|error| StoreError::Node(NodeError::Transfer(error)))?;
        }
        let mut kv = KvClient::with_transports(metadata, transports);
        if let Some(node) = &node {
            kv = kv.with_local_endpoint(node.endpoint());
        }
        tracing::info!(%address, hostname, segment_bytes = config.global_segment_size, protocol = config.protocol.name(), "store set up");
        let global =
            GlobalClient::with_caller(kv.metadata().caller().clone(), address.cluster.clone());
        let peers = Peers::new(
            nats.clone(),
            address.cluster.clone(),
            address.subcluster.clone(),
        );
        Ok(Self {
            kv,
            global,
            nats,
            address,
            hostname,
            node: Mutex::new(node),
            closed: AtomicBool::new(false),
            peers,
        })
    }

    /// This process's transfer endpoint (`host:port`), or the host it was given
    /// when it contributes no segment.
    pub fn hostname(&self) -> &str {
        &self.hostname
    }

    /// The address it was set up with.
    pub fn address(&self) -> &StoreAddress {
        &self.address
    }

    /// The KV client (for callers that need more than this API).
    pub fn kv(&self) -> &KvClient {
        &self.kv
    }

    /// Registers caller memory that zero-copy calls will use, with the transports
    /// that move registered memory without a copy (RDMA: a memory region).
    ///
    /// # Safety
    /// `[ptr, ptr + len)` stays mapped until [`Store::unregister_local`] for `ptr`
    /// returned, and is not freed while a call uses it.
    ///
    /// # Errors
    /// [`StoreError::InvalidParams`] when the transport refuses the range (null,
    /// empty, overlapping, or the device cannot register it).
    pub unsafe fn register_local(&self, ptr: *mut u8, len: usize) -> Result<(), StoreError> {
        // SAFETY: forwarded contract.
        unsafe { self.kv.transports().register_local(ptr, len) }
            .map_err(|error| StoreError::InvalidParams(format!("registering a buffer: {error}")))
    }

    /// Ends a registration of [`Store::register_local`]; whether there was one.
    pub fn unregister_local(&self, ptr: *mut u8) -> bool {
        self.kv.transports().unregister_local(ptr)
    }

    fn check_open(&self) -> Result<(), StoreError> {
        if self.closed.load(Ordering::Acquire) {
            Err(StoreError::Closed)
        } else {
            Ok(())
        }
    }

    /// Unmounts this process's segment and stops its node; later calls fail with
    /// [`StoreError::Closed`]. Closing twice does nothing.
    pub async fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some(node) = self.node.lock().await.take() {
            if let Err(error) = node.shutdown().await {
                tracing::warn!(%error, "unmounting this process's segment");
            }
        }
        let _ = self.nats.flush().await;
    }

    /// Whether the sub-master answers (within a second).
    pub async fn health(&self) -> Health {
        if self.check_open().is_err() {
            return Health::NotInitialized;
        }
        let probe = SubmasterClient::with_policy(
            self.nats.clone(),
            self.address.cluster.clone(),
            self.address.subcluster.clone(),
            RetryPolicy {
                request_timeout: Duration::from_secs(1),
                retry_deadline: Duration::from_secs(1),
                ..RetryPolicy::default()
            },
        );
        match probe.status().await {
            Ok(_) => Health::Healthy,
            Err(_) => Health::MasterUnreachable,
        }
    }

    /// Stores values, each given as parts concatenated in order. A key that exists
    /// already is left as it is and reported as success (Mooncake's put is
    /// first-writer-wins). One result per item, in order.
    ///
    /// # Errors
    /// When the sub-master is unreachable as a whole, or the store is closed.
    pub async fn put(
        &self,
        items: &[(&str, &[&[u8]])],
        options: &PutOptions,
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        self.check_open()?;
        let results = self.kv.put_scattered(items, options).await?;
        Ok(results
            .into_iter()
            .map(|result| match result {
                Ok(()) => Ok(()),
                Err(KvError::Item {
                    error: ItemError::AlreadyExists,
                    ..
                }) => Ok(()),
                Err(error) => Err(error.into()),
            })
            .collect())
    }

    /// Where values are (a read lease each), local sub-cluster first.
    ///
    /// # Errors
    /// When the sub-master is unreachable as a whole, or the store is closed.
    pub async fn locate(
        &self,
        keys: &[&str],
    ) -> Result<Vec<Result<Located, StoreError>>, StoreError> {
        self.check_open()?;
        let located = self.kv.locate(keys).await?;
        Ok(located
            .into_iter()
            .map(|l| l.map_err(StoreError::from))
            .collect())
    }

    /// Reads a located value into `parts` (filled in order), verified. Returns its
    /// size.
    ///
    /// # Errors
    /// [`ErrorCode::BufferOverflow`] when `parts` are too small,
    /// [`ErrorCode::TransferFail`] when no replica is intact.
    pub async fn read_located(
        &self,
        key: &str,
        located: &Located,
        parts: &mut [&mut [u8]],
    ) -> Result<u64, StoreError> {
        self.check_open()?;
        Ok(self.kv.read_located_into(key, located, parts).await?)
    }

    /// Reads values straight into the caller's buffers; one result (the value's
    /// size) per item, in order.
    ///
    /// # Errors
    /// When the sub-master is unreachable as a whole, or the store is closed.
    pub async fn get_into(
        &self,
        items: &mut [(&str, &mut [&mut [u8]])],
    ) -> Result<Vec<Result<u64, StoreError>>, StoreError> {
        self.check_open()?;
        let results = self.kv.get_many_into(items).await?;
        Ok(results
            .into_iter()
            .map(|r| r.map_err(StoreError::from))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_listen_port_in_use_is_told_apart_from_other_start_failures() {
        let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let transport = TcpTransport::default();
        let error = transport
            .bind(
                held.local_addr().unwrap(),
                Arc::new(hkvm_transfer::AdmitAll),
            )
            .await
            .expect_err("the port is held");
        assert!(port_taken(&NodeError::Transfer(error)));
        let other = hkvm_transfer::TransferError::Invalid("segment size 0".into());
        assert!(!port_taken(&NodeError::Transfer(other)));
    }

    #[test]
    fn a_port_is_chosen_from_mooncakes_range_and_skips_taken_ones() {
        let ip = std::net::IpAddr::from([127, 0, 0, 1]);
        let port = free_port(ip).unwrap();
        assert!(MOONCAKE_PORTS.contains(&port), "{port}");
        // Held here, the port is taken: the next choice is another one. (When
        // another process took it first, it was free only a moment ago: the
        // second half proves nothing then, and is skipped.)
        if let Ok(_held) = std::net::TcpListener::bind((ip, port)) {
            let next = free_port(ip).unwrap();
            assert!(MOONCAKE_PORTS.contains(&next) && next != port, "{next}");
        }
    }

    #[test]
    fn endpoints_name_nodes_and_segments_stably() {
        assert_eq!(node_name_for("10.0.0.5:12345"), "10-0-0-5-12345");
        assert_eq!(
            segment_for("localhost:7000").unwrap().as_str(),
            "localhost-7000-seg"
        );
        let long = format!("{}:1", "h".repeat(200));
        let name = node_name_for(&long);
        assert!(name.len() <= 56, "{name}");
        assert_eq!(name, node_name_for(&long));
        assert!(segment_for(&long).is_some());
    }

    #[test]
    fn hosts_and_ports_are_split() {
        assert_eq!(split_host("localhost").unwrap(), ("localhost".into(), 0));
        assert_eq!(split_host("10.0.0.1:80").unwrap(), ("10.0.0.1".into(), 80));
        assert!(split_host("h:notaport").is_err());
        assert!(split_host("").is_err());
    }
}
