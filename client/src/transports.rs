//! Which transport moves a replica's bytes. A client (and a node) is configured with
//! a [`Protocol`]: TCP, or RDMA on named devices. Every node serves TCP; a node
//! serving RDMA too advertises an [`RdmaEndpoint`](hkvm_events::RdmaEndpoint) in
//! its segment descriptor. A
//! client configured for RDMA uses it for every replica whose node advertises one,
//! and falls back to TCP, with one log line per node, for the others.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use hkvm_events::rpc::submaster::ReplicaLocation;
use hkvm_events::NodeId;
use hkvm_transfer::{RegionId, RemoteRegion, TransferError, Transport};

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

/// A client's transports: TCP always, RDMA when configured.
pub struct Transports {
    tcp: Arc<dyn Transport>,
    rdma: Option<Arc<dyn Transport>>,
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
            fell_back: Mutex::new(HashSet::new()),
        }
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

    /// The transport and endpoint for `replica`: RDMA when both this client and the
    /// replica's node have it (the transport learns the segment's address from the
    /// descriptor), TCP otherwise.
    pub fn route<'a>(&'a self, replica: &'a ReplicaLocation) -> Route<'a> {
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
