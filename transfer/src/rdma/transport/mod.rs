//! [`RdmaTransport`]: the RDMA implementation of [`Transport`]. Registered segments
//! become memory regions that peers read and write one-sidedly; a peer connects by
//! dialing the node's out-of-band TCP endpoint, where both sides exchange
//! [`QpInfo`] and bring an RC queue pair up. On the client side, bytes in caller
//! memory registered with [`Transport::register_local`] move without a copy; the
//! rest is copied through registered staging buffers checked out of a bounded pool,
//! one per batch that needs one, so up to `staging_buffers` such batches run at
//! once. Every queue pair completes into one completion queue; completions are
//! routed to the batch that posted them by the batch tag in their `wr_id`. How a
//! batch runs is in [`rounds`].

use super::access::Access;
use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::io::AsyncReadExt as _;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::completion::CompletionRouter;
use super::exchange::{exchange, QpInfo, RemoteRegion};
use super::ffi::{Context, Cq, DeviceList, Mr, Pd, Qp};
use super::local::LocalRegions;
use super::qp::{connect, local_info, PortInfo};
use super::staging::{Lease, Registered, StagingPool};
use super::PortAddress;
use crate::error::TransferError;
use crate::region::{RegionId, Segment};
use crate::tcp::ServerHandle;
use crate::transport::{ReadInto, Transport, WriteOp};

mod rounds;

/// Settings of an [`RdmaTransport`].
#[derive(Debug, Clone)]
pub struct RdmaConfig {
    /// The device to open (`None`: the first one).
    pub device: Option<String>,
    /// The port (1-based).
    pub port: u8,
    /// The GID index (RoCE v2 usually needs the index of an IPv4-mapped GID).
    pub gid_index: u8,
    /// Send queue depth of each queue pair, and work requests in flight per round.
    pub queue_depth: u32,
    /// Size of each registered staging buffer of the client side.
    pub staging_bytes: u64,
    /// How many staging buffers the client side registers at most: how many of its
    /// batches run at once (buffers are registered as batches need them).
    pub staging_buffers: usize,
    /// Deadline of the out-of-band exchange.
    pub exchange_timeout: Duration,
    /// Deadline of one round's completion.
    pub completion_timeout: Duration,
    /// The largest single operation.
    pub max_op_bytes: u64,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        Self {
            device: None,
            port: 1,
            gid_index: 0,
            queue_depth: 128,
            staging_bytes: 64 << 20,
            staging_buffers: 4,
            exchange_timeout: Duration::from_secs(5),
            completion_timeout: Duration::from_secs(10),
            max_op_bytes: 1 << 30,
        }
    }
}

impl RdmaConfig {
    fn validate(&self) -> Result<(), TransferError> {
        if self.queue_depth == 0 || self.staging_bytes == 0 || self.staging_buffers == 0 {
            return Err(TransferError::Invalid(format!(
                "RDMA queue_depth ({}), staging_bytes ({}) and staging_buffers ({}) \
                 must be positive",
                self.queue_depth, self.staging_bytes, self.staging_buffers
            )));
        }
        Ok(())
    }

    /// Completions that can be outstanding at once: every request of every batch
    /// in flight (failed requests complete even when unsignaled), with room to
    /// spare.
    fn completion_queue_depth(&self) -> i32 {
        let depth = u64::from(self.queue_depth)
            .saturating_mul(self.staging_buffers as u64)
            .saturating_mul(2);
        i32::try_from(depth).unwrap_or(i32::MAX)
    }
}

/// The names of this host's RDMA devices.
///
/// # Errors
/// [`TransferError::NoDevice`] when verbs cannot list devices.
pub fn devices() -> Result<Vec<String>, TransferError> {
    Ok(DeviceList::new()?.names())
}

/// A connected peer: its queue pair and the regions it advertised.
struct Peer {
    qp: Qp,
    remote: QpInfo,
    /// Free slots of the send queue: concurrent batches to this peer share it.
    slots: Semaphore,
    // The out-of-band connection stays open: the peer drops its queue pair when it
    // closes.
    _oob: TcpStream,
}

type StagingLease = Lease<Arc<Pd>>;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poison| poison.into_inner())
}

// Fields drop in order: registrations end before the queue pairs go, and every
// verbs object holds an `Arc` of its parent, so the context closes last.
struct Inner {
    config: RdmaConfig,
    /// The device opened.
    device: String,
    port: PortInfo,
    pd: Arc<Pd>,
    cq: Arc<Cq>,
    router: Mutex<CompletionRouter>,
    /// Served segments, each with its registration (which ends before the segment
    /// is released).
    registrations: Mutex<HashMap<RegionId, Registered<Mr>>>,
    staging: StagingPool<Arc<Pd>>,
    /// Caller memory registered for batches without a copy.
    local: LocalRegions<Mr>,
    /// Regions of peers as their segment descriptors advertised them, by endpoint:
    /// consulted for a region the queue-pair exchange did not list.
    learned: Mutex<HashMap<String, Vec<RemoteRegion>>>,
    peers: tokio::sync::Mutex<HashMap<String, Arc<Peer>>>,
    _context: Arc<Context>,
}

/// The RDMA transport.
#[derive(Clone)]
pub struct RdmaTransport {
    inner: Arc<Inner>,
}

impl RdmaTransport {
    /// Opens the device, allocates a protection domain and a completion queue, and
    /// registers the first staging buffer.
    ///
    /// # Errors
    /// [`TransferError::Invalid`] for a bad config (checked first);
    /// [`TransferError::NoRdmaDevice`] when this host has no RDMA device (or not
    /// the one named), naming what was asked for and what was found;
    /// [`TransferError::NoDevice`] for an inactive port; [`TransferError::Rdma`]
    /// when a verbs call fails.
    pub fn open(config: RdmaConfig) -> Result<Self, TransferError> {
        config.validate()?;
        let list = DeviceList::new().map_err(|error| match error {
            TransferError::NoDevice(detail) => TransferError::NoRdmaDevice {
                wanted: config.device.clone(),
                found: Vec::new(),
                detail: Some(detail),
            },
            other => other,
        })?;
        let (context, device) = list.open(config.device.as_deref())?;
        drop(list);
        let port = PortInfo::query(&context, config.port, config.gid_index)?;
        let pd = Pd::new(&context)?;
        let cq = Cq::new(&context, config.completion_queue_depth())?;
        let staging = StagingPool::new(
            Arc::clone(&pd),
            config.staging_bytes,
            config.staging_buffers,
        )?;
        // One buffer now, so that a host that cannot register memory fails here.
        staging.prefill(1)?;
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                device,
                port,
                pd,
                cq,
                router: Mutex::new(CompletionRouter::new()),
                registrations: Mutex::new(HashMap::new()),
                staging,
                local: LocalRegions::default(),
                learned: Mutex::new(HashMap::new()),
                peers: tokio::sync::Mutex::new(HashMap::new()),
                _context: context,
            }),
        })
    }

    /// The device this transport opened and its port's address, as a node
    /// advertises them in its segment descriptors.
    pub fn port_address(&self) -> PortAddress {
        PortAddress {
            device: self.inner.device.clone(),
            gid: self.inner.port.gid,
            lid: self.inner.port.lid,
        }
    }

    /// What the client side's staging pool holds right now (a batch whose bytes
    /// all lie in registered caller memory checks no buffer out).
    pub fn staging_stats(&self) -> super::staging::PoolStats {
        self.inner.staging.stats()
    }

    /// Where a served segment is for peers (address, rkey, length), as a node
    /// advertises it; `None` when no segment of that id is registered.
    pub fn served_region(&self, id: &RegionId) -> Option<RemoteRegion> {
        lock(&self.inner.registrations)
            .get(id)
            .map(|registered| RemoteRegion {
                id: id.clone(),
                addr: registered.memory().base_ptr() as u64,
                rkey: registered.rkey(),
                len: registered.memory().len(),
            })
    }

    fn advertised(&self) -> Vec<RemoteRegion> {
        let registrations = lock(&self.inner.registrations);
        let mut regions: Vec<RemoteRegion> = registrations
            .iter()
            .map(|(id, registered)| RemoteRegion {
                id: id.clone(),
                addr: registered.memory().base_ptr() as u64,
                rkey: registered.rkey(),
                len: registered.memory().len(),
            })
            .collect();
        regions.sort_by(|a, b| a.id.cmp(&b.id));
        regions
    }

    /// Accepts out-of-band connections on `listener`: each one gets a queue pair
    /// connected to the dialing peer, which then reads and writes the registered
    /// regions without this side's CPU.
    ///
    /// # Errors
    /// [`TransferError::Io`] when the listener has no local address.
    pub fn serve(&self, listener: TcpListener) -> Result<ServerHandle, TransferError> {
        let this = self.clone();
        ServerHandle::spawn_with(listener, move |listener| async move {
            let mut peers = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let (stream, addr) = match accepted {
                            Ok(accepted) => accepted,
                            Err(error) => {
                                crate::tcp::server::accept_failed(&error).await;
                                continue;
                            }
                        };
                        let this = this.clone();
                        peers.spawn(async move {
                            if let Err(error) = this.accept_peer(stream).await {
                                tracing::warn!(%addr, %error, "RDMA peer not connected");
                            }
                        });
                    }
                    Some(_) = peers.join_next(), if !peers.is_empty() => {}
                }
            }
        })
    }

    async fn accept_peer(&self, mut stream: TcpStream) -> Result<(), TransferError> {
        let qp = Qp::new(
            &self.inner.pd,
            &self.inner.cq,
            self.inner.config.queue_depth,
        )?;
        let local = local_info(&qp, &self.inner.port, self.advertised());
        let remote = exchange(&mut stream, &local, self.inner.config.exchange_timeout).await?;
        // The accepting end serves its segments to the peer.
        connect(&qp, &self.inner.port, &local, &remote, Access::Served)?;
        // Hold the queue pair until the peer hangs up.
        let mut sink = [0u8; 64];
        while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
        drop(qp);
        Ok(())
    }

    async fn peer(&self, endpoint: &str) -> Result<Arc<Peer>, TransferError> {
        let mut peers = self.inner.peers.lock().await;
        if let Some(peer) = peers.get(endpoint) {
            return Ok(Arc::clone(peer));
        }
        let mut stream =
            TcpStream::connect(endpoint)
                .await
                .map_err(|source| TransferError::Connect {
                    endpoint: endpoint.to_owned(),
                    source,
                })?;
        let qp = Qp::new(
            &self.inner.pd,
            &self.inner.cq,
            self.inner.config.queue_depth,
        )?;
        let local = local_info(&qp, &self.inner.port, Vec::new());
        let remote = exchange(&mut stream, &local, self.inner.config.exchange_timeout).await?;
        // The initiating end only reads and writes the peer's memory.
        connect(&qp, &self.inner.port, &local, &remote, Access::Local)?;
        let peer = Arc::new(Peer {
            qp,
            remote,
            slots: Semaphore::new(self.inner.config.queue_depth as usize),
            _oob: stream,
        });
        peers.insert(endpoint.to_owned(), Arc::clone(&peer));
        Ok(peer)
    }

    /// Forgets `peer` (its queue pair failed) unless a newer one already took its
    /// place.
    async fn forget(&self, endpoint: &str, peer: &Arc<Peer>) {
        let mut peers = self.inner.peers.lock().await;
        if peers
            .get(endpoint)
            .is_some_and(|known| Arc::ptr_eq(known, peer))
        {
            peers.remove(endpoint);
        }
    }
}

impl Transport for RdmaTransport {
    fn backend(&self) -> &'static str {
        "rdma"
    }

    fn max_op_bytes(&self) -> u64 {
        self.inner.config.max_op_bytes
    }

    fn register(&self, segment: Arc<Segment>) -> Result<(), TransferError> {
        let id = segment.id().clone();
        let duplicate = || TransferError::Invalid(format!("region {id} is already registered"));
        if lock(&self.inner.registrations).contains_key(&id) {
            return Err(duplicate());
        }
        // Registered outside the lock: pinning a large segment takes a while.
        let registered = Registered::new(&self.inner.pd, segment, Access::Served)?;
        match lock(&self.inner.registrations).entry(id.clone()) {
            // Registered concurrently: this registration ends, then its `Arc` goes.
            Entry::Occupied(_) => Err(duplicate()),
            Entry::Vacant(slot) => {
                slot.insert(registered);
                Ok(())
            }
        }
    }

    fn unregister(&self, id: &RegionId) -> Result<Arc<Segment>, TransferError> {
        let registered = lock(&self.inner.registrations).remove(id).ok_or_else(|| {
            TransferError::UnknownRegion {
                region: id.to_string(),
            }
        })?;
        // Deregistered before it is handed back: no peer reaches the memory after.
        Ok(registered.into_memory())
    }

    fn learn_region(&self, endpoint: &str, region: RemoteRegion) {
        let mut learned = lock(&self.inner.learned);
        let regions = learned.entry(endpoint.to_owned()).or_default();
        match regions.iter_mut().find(|known| known.id == region.id) {
            Some(known) => *known = region,
            None => regions.push(region),
        }
    }

    unsafe fn register_local(&self, ptr: *mut u8, len: usize) -> Result<(), TransferError> {
        self.inner.local.check_new(ptr as usize, len)?;
        // SAFETY: the caller keeps `[ptr, ptr + len)` mapped until
        // `unregister_local` (this method's contract); the registration lives in
        // `local` until then, and in the batches using it until they end.
        let mr = unsafe { Mr::register(&self.inner.pd, ptr, len, Access::Local)? };
        self.inner.local.insert(ptr as usize, len, mr)
    }

    fn unregister_local(&self, ptr: *mut u8) -> bool {
        self.inner.local.remove(ptr as usize).is_some()
    }

    fn write_batch<'a>(
        &'a self,
        endpoint: &'a str,
        ops: &'a [WriteOp<'a>],
    ) -> BoxFuture<'a, Result<(), TransferError>> {
        Box::pin(self.write(endpoint, ops))
    }

    fn read_batch_into<'a, 'b: 'a>(
        &'a self,
        endpoint: &'a str,
        ops: &'a mut [ReadInto<'b>],
    ) -> BoxFuture<'a, Result<(), TransferError>> {
        Box::pin(self.read(endpoint, ops))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    /// Asking for RDMA on a host without a device (this one, and CI) goes through
    /// the real `ibv_get_device_list` and comes back quickly as
    /// [`TransferError::NoRdmaDevice`], naming what was asked for and found.
    #[test]
    fn asking_for_rdma_without_a_device_fails_fast_with_a_typed_error() {
        let started = std::time::Instant::now();
        let host = devices().unwrap_or_default();
        match RdmaTransport::open(RdmaConfig::default()) {
            Err(TransferError::NoRdmaDevice {
                wanted,
                found,
                detail,
            }) => {
                assert!(host.is_empty(), "{host:?}");
                assert_eq!(wanted, None);
                assert!(found.is_empty());
                eprintln!("no RDMA device here, as expected (detail: {detail:?})");
            }
            Err(error) => {
                // A host with a device whose port is down, say.
                assert!(!host.is_empty(), "{error}");
                assert_eq!(error.kind(), ErrorKind::NoDevice, "{error}");
            }
            Ok(transport) => {
                assert!(!host.is_empty());
                assert_eq!(transport.backend(), "rdma");
            }
        }
        let named = RdmaConfig {
            device: Some("no-such-device-0".into()),
            ..RdmaConfig::default()
        };
        let Some(error) = RdmaTransport::open(named).err() else {
            panic!("a device named no-such-device-0 opened");
        };
        assert_eq!(error.kind(), ErrorKind::NoDevice);
        let message = error.to_string();
        assert!(message.contains("\"no-such-device-0\""), "{message}");
        let TransferError::NoRdmaDevice { wanted, found, .. } = error else {
            panic!("expected NoRdmaDevice, got {message}");
        };
        assert_eq!(wanted.as_deref(), Some("no-such-device-0"));
        assert_eq!(found, host);
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "took {:?}",
            started.elapsed()
        );
    }

    #[test]
    fn a_bad_config_is_refused_before_any_device_is_touched() {
        for config in [
            RdmaConfig {
                staging_buffers: 0,
                ..RdmaConfig::default()
            },
            RdmaConfig {
                staging_bytes: 0,
                ..RdmaConfig::default()
            },
            RdmaConfig {
                queue_depth: 0,
                ..RdmaConfig::default()
            },
        ] {
            let error = RdmaTransport::open(config).err().map(|e| e.kind());
            assert_eq!(error, Some(ErrorKind::Invalid));
        }
    }

    #[test]
    fn the_completion_queue_holds_every_request_in_flight() {
        let config = RdmaConfig::default();
        let in_flight = i64::from(config.queue_depth) * config.staging_buffers as i64;
        assert!(i64::from(config.completion_queue_depth()) >= in_flight);
        let huge = RdmaConfig {
            queue_depth: u32::MAX,
            staging_buffers: usize::MAX,
            ..RdmaConfig::default()
        };
        assert_eq!(huge.completion_queue_depth(), i32::MAX);
    }
}
