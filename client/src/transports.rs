//! Which transport moves a replica's bytes. A client (and a node) is configured with
//! a [`Protocol`]: TCP, or RDMA on named devices. Every node serves TCP; a node
//! serving RDMA too advertises an [`RdmaEndpoint`](hkvm_events::RdmaEndpoint) in
//! its segment descriptor. A
//! client configured for RDMA uses it for every replica whose node advertises one,
//! and falls back to TCP, with one log line per node, for the others.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, RwLock};

use hkvm_events::rpc::submaster::ReplicaLocation;
use hkvm_events::NodeId;
use hkvm_transfer::{LocalTransport, RegionId, RemoteRegion, Segment, TransferError, Transport};

/// How a node serves, and a client moves, KV bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Protocol {
    /// TCP only (always available).
    #[default]
    Tcp,
    /// RDMA where both ends have it, TCP otherwise.
    Rdma(RdmaSettings),
}

/// Which RDMA device and port to use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaSettings {
    /// Devices to try in order (for example `mlx5_0`); empty: the host's first.
    pub devices: Vec<String>,
    /// The port (1-based).
    pub port: u8,
    /// The GID index (RoCE v2 usually needs the index of an IPv4-mapped GID).
    pub gid_index: u8,
}

impl Default for RdmaSettings {
    fn default() -> Self {
        Self {
            devices: Vec::new(),
            port: 1,
            gid_index: 0,
        }
    }
}

/// Why a protocol name does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown protocol {0:?} (expected tcp or rdma)")]
pub struct UnknownProtocol(pub String);

impl Protocol {
    /// `tcp`, or `rdma` on `devices` (Mooncake's comma-separated `rdma_devices`,
    /// empty for the host's first device). Case-insensitive.
    ///
    /// # Errors
    /// [`UnknownProtocol`] for anything else.
    pub fn parse(name: &str, devices: &str) -> Result<Self, UnknownProtocol> {
        match name.trim().to_ascii_lowercase().as_str() {
            "tcp" => Ok(Self::Tcp),
            "rdma" => Ok(Self::Rdma(RdmaSettings {
                devices: devices
                    .split(',')
                    .map(str::trim)
                    .filter(|d| !d.is_empty())
                    .map(str::to_owned)
                    .collect(),
                ..RdmaSettings::default()
            })),
            _ => Err(UnknownProtocol(name.to_owned())),
        }
    }

    /// The protocol's name (`tcp`, `rdma`).
    pub fn name(&self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Rdma(_) => "rdma",
        }
    }
}

/// Checks, without opening anything, that this host has RDMA and one of the
/// devices `settings` names (any device when it names none): what a node or client
/// asked for RDMA checks first, so that it fails at once, before it connects to
/// anything.
///
/// # Errors
/// [`TransferError::NoRdmaDevice`] naming the devices asked for and the ones this
/// host has (also when this build has no RDMA support).
pub fn check_rdma(settings: &RdmaSettings) -> Result<(), TransferError> {
    let wanted = (!settings.devices.is_empty()).then(|| settings.devices.join(","));
    let found = hkvm_transfer::rdma::devices().map_err(|error| TransferError::NoRdmaDevice {
        wanted: wanted.clone(),
        found: Vec::new(),
        detail: Some(error.to_string()),
    })?;
    let usable = if settings.devices.is_empty() {
        !found.is_empty()
    } else {
        settings.devices.iter().any(|device| found.contains(device))
    };
    if usable {
        Ok(())
    } else {
        Err(TransferError::NoRdmaDevice {
            wanted,
            found,
            detail: None,
        })
    }
}

/// Opens an RDMA transport on the first of `settings.devices` that opens (or the
/// host's first device), failing fast on a host without one.
///
/// # Errors
/// [`TransferError::NoRdmaDevice`] naming the devices asked for and the ones this
/// host has (also when this build has no RDMA support); a verbs failure otherwise.
#[cfg(feature = "rdma")]
pub fn open_rdma(
    settings: &RdmaSettings,
) -> Result<Arc<hkvm_transfer::rdma::RdmaTransport>, TransferError> {
    use hkvm_transfer::rdma::{RdmaConfig, RdmaTransport};
    let config = |device: Option<String>| RdmaConfig {
        device,
        port: settings.port,
        gid_index: settings.gid_index,
        ..RdmaConfig::default()
    };
    if settings.devices.is_empty() {
        return RdmaTransport::open(config(None)).map(Arc::new);
    }
    let mut first_error = None;
    for device in &settings.devices {
        match RdmaTransport::open(config(Some(device.clone()))) {
            Ok(transport) => return Ok(Arc::new(transport)),
            Err(error) => {
                tracing::warn!(device, %error, "RDMA device not usable");
                first_error.get_or_insert(error);
            }
        }
    }
    Err(match first_error {
        Some(TransferError::NoRdmaDevice { found, detail, .. }) => TransferError::NoRdmaDevice {
            wanted: Some(settings.devices.join(",")),
            found,
            detail,
        },
        Some(other) => other,
        None => TransferError::Invalid("no RDMA device to try".into()),
    })
}

/// Without the `rdma` feature: always the typed "no RDMA" failure.
///
/// # Errors
/// Always [`TransferError::NoRdmaDevice`], saying this build has no RDMA support.
#[cfg(not(feature = "rdma"))]
pub fn open_rdma(settings: &RdmaSettings) -> Result<Arc<dyn Transport>, TransferError> {
    Err(TransferError::NoRdmaDevice {
        wanted: (!settings.devices.is_empty()).then(|| settings.devices.join(",")),
        found: Vec::new(),
        detail: Some("this build has no RDMA support (built without the rdma feature)".into()),
    })
}

/// Where one replica's bytes go: the transport and the endpoint it dials.
#[derive(Clone, Copy)]
pub struct Route<'a> {
    /// The transport.
    pub transport: &'a dyn Transport,
    /// The node's endpoint for that transport (TCP: its `host:port`; RDMA: its
    /// queue-pair exchange endpoint).
    pub endpoint: &'a str,
}

impl std::fmt::Debug for Route<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Route")
            .field("backend", &self.transport.backend())
            .field("endpoint", &self.endpoint)
            .finish()
    }
}

/// A client's transports: TCP always, RDMA when configured, and memory copies
/// for the segments of this very process.
pub struct Transports {
    tcp: Arc<dyn Transport>,
    rdma: Option<Arc<dyn Transport>>,
    /// This process's own segments, reached by memory copy.
    local: LocalTransport,
    /// The endpoints under which this process's segments are advertised.
    local_endpoints: RwLock<HashSet<String>>,
    /// Nodes already reported as reached over TCP for want of RDMA.
    fell_back: Mutex<HashSet<NodeId>>,
}

impl std::fmt::Debug for Transports {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transports")
            .field("tcp", &self.tcp.backend())
            .field("rdma", &self.rdma.as_ref().map(|t| t.backend()))
            .finish()
    }
}

impl Transports {
    /// One transport for every replica (TCP, or a test's own).
    pub fn single(tcp: Arc<dyn Transport>) -> Self {
        Self {
            tcp,
            rdma: None,
            local: LocalTransport::new(),
            local_endpoints: RwLock::new(HashSet::new()),
            fell_back: Mutex::new(HashSet::new()),
        }
    }

    /// Reaches `segment`, which this process serves under `endpoint`, by memory
    /// copy instead of through that endpoint.
    ///
    /// # Errors
    /// [`TransferError::Invalid`] when a segment of that id is local already.
    pub fn add_local(&self, endpoint: &str, segment: Arc<Segment>) -> Result<(), TransferError> {
        self.local.register(segment)?;
        self.local_endpoints
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(endpoint.to_owned());
        Ok(())
    }

    /// Whether `replica` is on a segment of this process.
    fn is_local(&self, replica: &ReplicaLocation) -> bool {
        self.local_endpoints
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&replica.endpoint)
            && self.local.holds(replica.segment.as_str())
    }

    /// Adds an RDMA transport, used for the replicas whose node advertises RDMA.
    pub fn with_rdma(mut self, rdma: Arc<dyn Transport>) -> Self {
        self.rdma = Some(rdma);
        self
    }

    /// Whether an RDMA transport is configured.
    pub fn has_rdma(&self) -> bool {
        self.rdma.is_some()
    }

    /// The transport and endpoint for `replica`: a memory copy when its segment is
    /// this process's own; RDMA when both this client and the replica's node have
    /// it (the transport learns the segment's address from the descriptor); TCP
    /// otherwise.
    pub fn route<'a>(&'a self, replica: &'a ReplicaLocation) -> Route<'a> {
        if self.is_local(replica) {
            return Route {
                transport: &self.local,
                endpoint: &replica.endpoint,
            };
        }
        match (&self.rdma, &replica.rdma) {
            (Some(rdma), Some(advert)) => {
                // Segment ids are valid region ids (both 1–255 bytes).
                if let Ok(id) = RegionId::new(replica.segment.as_str()) {
                    rdma.learn_region(
                        &advert.exchange,
                        RemoteRegion {
                            id,
                            addr: advert.addr,
                            rkey: advert.rkey,
                            len: advert.len,
                        },
                    );
                }
                Route {
                    transport: rdma.as_ref(),
                    endpoint: &advert.exchange,
                }
            }
            (Some(_), None) => {
                let first = self
                    .fell_back
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(replica.node.clone());
                if first {
                    tracing::warn!(node = %replica.node, endpoint = replica.endpoint, "node advertises no RDMA: moving its data over TCP");
                }
                self.tcp_route(replica)
            }
            (None, _) => self.tcp_route(replica),
        }
    }

    fn tcp_route<'a>(&'a self, replica: &'a ReplicaLocation) -> Route<'a> {
        Route {
            transport: self.tcp.as_ref(),
            endpoint: &replica.endpoint,
        }
    }

    /// Registers caller memory for batches without a copy with every transport
    /// that uses registrations (RDMA).
    ///
    /// # Safety
    /// As [`Transport::register_local`]: the memory stays mapped until
    /// [`Transports::unregister_local`].
    ///
    /// # Errors
    /// The transport's failure to register it.
    pub unsafe fn register_local(&self, ptr: *mut u8, len: usize) -> Result<(), TransferError> {
        match &self.rdma {
            // SAFETY: forwarded contract.
            Some(rdma) => unsafe { rdma.register_local(ptr, len) },
            None => Ok(()),
        }
    }

    /// Ends a registration of [`Transports::register_local`]; whether there was one.
    pub fn unregister_local(&self, ptr: *mut u8) -> bool {
        self.rdma
            .as_ref()
            .is_some_and(|rdma| rdma.unregister_local(ptr))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use futures::future::BoxFuture;
    use hkvm_events::{RdmaEndpoint, SegmentId};
    use hkvm_transfer::{ReadInto, Segment, WriteOp};

    use super::*;

    /// Moves nothing; records which endpoints it was asked to write to, the
    /// regions it learned and the memory registered with it.
    #[derive(Default)]
    struct Recorder {
        name: &'static str,
        writes: Mutex<Vec<String>>,
        learned: Mutex<Vec<(String, RemoteRegion)>>,
        registered: Mutex<Vec<(usize, usize)>>,
    }

    impl Recorder {
        fn named(name: &'static str) -> Arc<Self> {
            Arc::new(Self {
                name,
                ..Self::default()
            })
        }
    }

    impl Transport for Recorder {
        fn backend(&self) -> &'static str {
            self.name
        }
        fn max_op_bytes(&self) -> u64 {
            u64::MAX
        }
        fn register(&self, _segment: Arc<Segment>) -> Result<(), TransferError> {
            Ok(())
        }
        fn unregister(&self, id: &RegionId) -> Result<Arc<Segment>, TransferError> {
            Err(TransferError::UnknownRegion {
                region: id.to_string(),
            })
        }
        fn learn_region(&self, endpoint: &str, region: RemoteRegion) {
            self.learned
                .lock()
                .unwrap()
                .push((endpoint.to_owned(), region));
        }
        unsafe fn register_local(&self, ptr: *mut u8, len: usize) -> Result<(), TransferError> {
            self.registered.lock().unwrap().push((ptr as usize, len));
            Ok(())
        }
        fn unregister_local(&self, ptr: *mut u8) -> bool {
            let mut registered = self.registered.lock().unwrap();
            let before = registered.len();
            registered.retain(|(start, _)| *start != ptr as usize);
            registered.len() != before
        }
        fn write_batch<'a>(
            &'a self,
            endpoint: &'a str,
            _ops: &'a [WriteOp<'a>],
        ) -> BoxFuture<'a, Result<(), TransferError>> {
            self.writes.lock().unwrap().push(endpoint.to_owned());
            Box::pin(async { Ok(()) })
        }
        fn read_batch_into<'a, 'b: 'a>(
            &'a self,
            _endpoint: &'a str,
            _ops: &'a mut [ReadInto<'b>],
        ) -> BoxFuture<'a, Result<(), TransferError>> {
            Box::pin(async { Ok(()) })
        }
    }

    fn replica(node: &str, rdma: Option<RdmaEndpoint>) -> ReplicaLocation {
        ReplicaLocation {
            node: NodeId::new(node).unwrap(),
            segment: SegmentId::new(format!("{node}-seg")).unwrap(),
            endpoint: format!("{node}:7000"),
            offset: 4096,
            rdma,
            grant: None,
        }
    }

    fn advert(node: &str) -> RdmaEndpoint {
        RdmaEndpoint {
            device: "mlx5_0".into(),
            gid: [7; 16],
            lid: 0,
            exchange: format!("{node}:7071"),
            rkey: 0xabc,
            addr: 0x7f00_0000_0000,
            len: 1 << 30,
        }
    }

    async fn send(transports: &Transports, replica: &ReplicaLocation) -> &'static str {
        let route = transports.route(replica);
        route
            .transport
            .write_batch(route.endpoint, &[])
            .await
            .unwrap();
        route.transport.backend()
    }

    #[tokio::test]
    async fn rdma_is_used_where_both_ends_have_it_and_tcp_elsewhere() {
        let (tcp, rdma) = (Recorder::named("tcp"), Recorder::named("rdma"));
        let transports = Transports::single(tcp.clone()).with_rdma(rdma.clone());
        let fast = replica("fast", Some(advert("fast")));
        let plain = replica("plain", None);
        assert_eq!(send(&transports, &fast).await, "rdma");
        assert_eq!(send(&transports, &plain).await, "tcp");
        assert_eq!(send(&transports, &plain).await, "tcp");
        // RDMA dials the exchange endpoint, TCP the node's endpoint.
        assert_eq!(*rdma.writes.lock().unwrap(), ["fast:7071"]);
        assert_eq!(*tcp.writes.lock().unwrap(), ["plain:7000", "plain:7000"]);
        // The RDMA transport learned the segment from its descriptor.
        let learned = rdma.learned.lock().unwrap().clone();
        assert_eq!(
            learned,
            [(
                "fast:7071".to_owned(),
                RemoteRegion {
                    id: RegionId::new("fast-seg").unwrap(),
                    addr: 0x7f00_0000_0000,
                    rkey: 0xabc,
                    len: 1 << 30,
                }
            )]
        );
        // The fallback is reported once per node, not once per operation.
        let fell_back = transports.fell_back.lock().unwrap().clone();
        assert_eq!(fell_back, HashSet::from([NodeId::new("plain").unwrap()]));
    }

    #[tokio::test]
    async fn a_tcp_client_ignores_rdma_descriptors() {
        let tcp = Recorder::named("tcp");
        let transports = Transports::single(tcp.clone());
        assert!(!transports.has_rdma());
        assert_eq!(
            send(&transports, &replica("fast", Some(advert("fast")))).await,
            "tcp"
        );
        assert_eq!(*tcp.writes.lock().unwrap(), ["fast:7000"]);
        assert!(tcp.learned.lock().unwrap().is_empty());
        assert!(transports.fell_back.lock().unwrap().is_empty());
    }

    #[test]
    fn caller_memory_is_registered_with_rdma_only() {
        let (tcp, rdma) = (Recorder::named("tcp"), Recorder::named("rdma"));
        let mut buffer = vec![0u8; 4096];
        let ptr = buffer.as_mut_ptr();
        let tcp_only = Transports::single(tcp.clone());
        // SAFETY: the recorders never touch the memory.
        unsafe { tcp_only.register_local(ptr, buffer.len()) }.unwrap();
        assert!(!tcp_only.unregister_local(ptr));
        assert!(tcp.registered.lock().unwrap().is_empty());
        let both = Transports::single(tcp.clone()).with_rdma(rdma.clone());
        // SAFETY: as above.
        unsafe { both.register_local(ptr, buffer.len()) }.unwrap();
        assert_eq!(*rdma.registered.lock().unwrap(), [(ptr as usize, 4096)]);
        assert!(both.unregister_local(ptr));
        assert!(!both.unregister_local(ptr));
        assert!(tcp.registered.lock().unwrap().is_empty());
    }

    #[test]
    fn protocols_parse_like_mooncakes_setup_arguments() {
        assert_eq!(Protocol::parse("tcp", "ignored"), Ok(Protocol::Tcp));
        assert_eq!(
            Protocol::parse("RDMA", "mlx5_0, mlx5_1,"),
            Ok(Protocol::Rdma(RdmaSettings {
                devices: vec!["mlx5_0".into(), "mlx5_1".into()],
                ..RdmaSettings::default()
            }))
        );
        assert_eq!(
            Protocol::parse("rdma", ""),
            Ok(Protocol::Rdma(RdmaSettings::default()))
        );
        assert_eq!(
            Protocol::parse("nvlink", ""),
            Err(UnknownProtocol("nvlink".into()))
        );
    }

    /// Through the real `ibv_get_device_list` where the build has RDMA, through
    /// the no-RDMA stub otherwise: either way a typed, immediate failure naming
    /// what was asked for.
    #[test]
    fn a_missing_device_is_a_typed_error_before_anything_opens() {
        let settings = RdmaSettings {
            devices: vec!["no-such-device-0".into()],
            ..RdmaSettings::default()
        };
        for error in [
            check_rdma(&settings).unwrap_err(),
            open_rdma(&settings).err().unwrap(),
        ] {
            let TransferError::NoRdmaDevice { wanted, found, .. } = &error else {
                panic!("expected NoRdmaDevice, got {error}");
            };
            assert_eq!(wanted.as_deref(), Some("no-such-device-0"), "{error}");
            assert!(!found.contains(&"no-such-device-0".to_owned()));
            assert!(
                error.to_string().contains("\"no-such-device-0\""),
                "{error}"
            );
        }
    }
}
