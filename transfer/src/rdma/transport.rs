//! [`RdmaTransport`]: the RDMA implementation of [`Transport`]. Registered segments
//! become memory regions that peers read and write one-sidedly; a peer connects by
//! dialing the node's out-of-band TCP endpoint, where both sides exchange
//! [`QpInfo`] and bring an RC queue pair up. The client side copies through one
//! registered staging buffer, so its batches run one at a time per transport.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::io::AsyncReadExt as _;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::batch::{plan, PlanLimits, PlanOp, Round};
use super::exchange::{exchange, QpInfo, RemoteRegion};
use super::ffi::{Completion, Context, Cq, DeviceList, Mr, Pd, PostRequest, Qp};
use super::qp::{connect, local_info, PortInfo};
use super::status::completion_error;
use crate::error::TransferError;
use crate::region::{RegionId, RegionTable, Segment};
use crate::tcp::ServerHandle;
use crate::transport::{ReadInto, Transport, WriteOp};

/// Settings of an [`RdmaTransport`].
#[derive(Debug, Clone)]
pub struct RdmaConfig {
    /// The device to open (`None`: the first one).
    pub device: Option<String>,
    /// The port (1-based).
    pub port: u8,
    /// The GID index (RoCE v2 usually needs the index of an IPv4-mapped GID).
    pub gid_index: u8,
    /// Send queue depth and work requests in flight per round.
    pub queue_depth: u32,
    /// Size of the registered staging buffer of the client side.
    pub staging_bytes: u64,
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
            exchange_timeout: Duration::from_secs(5),
            completion_timeout: Duration::from_secs(10),
            max_op_bytes: 1 << 30,
        }
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
    // The out-of-band connection stays open: the peer drops its queue pair when it
    // closes.
    _oob: TcpStream,
}

/// The staging buffer and the completion queue polling happens on.
struct Staging {
    buffer: Arc<Segment>,
    mr: Mr,
}

struct Inner {
    config: RdmaConfig,
    port: PortInfo,
    pd: Arc<Pd>,
    cq: Arc<Cq>,
    regions: RegionTable,
    registrations: Mutex<HashMap<RegionId, Mr>>,
    staging: tokio::sync::Mutex<Staging>,
    peers: tokio::sync::Mutex<HashMap<String, Arc<Peer>>>,
    _context: Arc<Context>,
}

/// The RDMA transport.
#[derive(Clone)]
pub struct RdmaTransport {
    inner: Arc<Inner>,
}

impl RdmaTransport {
    /// Opens the device, allocates a protection domain, a completion queue and the
    /// registered staging buffer.
    ///
    /// # Errors
    /// [`TransferError::NoDevice`] without a device or an active port;
    /// [`TransferError::Rdma`] when a verbs call fails.
    pub fn open(config: RdmaConfig) -> Result<Self, TransferError> {
        let context = DeviceList::new()?.open(config.device.as_deref())?;
        let port = PortInfo::query(&context, config.port, config.gid_index)?;
        let pd = Pd::new(&context)?;
        let depth = i32::try_from(config.queue_depth.max(1) * 2).unwrap_or(i32::MAX);
        let cq = Cq::new(&context, depth)?;
        let buffer = Segment::allocate(RegionId::new("staging")?, config.staging_bytes)?;
        // SAFETY: the staging segment lives in `Staging` next to its registration
        // and is dropped after it (field order).
        let mr = unsafe { Mr::register(&pd, buffer.base_ptr(), buffer.len() as usize)? };
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                port,
                pd,
                cq,
                regions: RegionTable::new(),
                registrations: Mutex::new(HashMap::new()),
                staging: tokio::sync::Mutex::new(Staging { buffer, mr }),
                peers: tokio::sync::Mutex::new(HashMap::new()),
                _context: context,
            }),
        })
    }

    fn advertised(&self) -> Vec<RemoteRegion> {
        let registrations = self
            .inner
            .registrations
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        self.inner
            .regions
            .ids()
            .into_iter()
            .filter_map(|id| {
                let segment = self.inner.regions.get(id.as_str()).ok()?;
                let mr = registrations.get(&id)?;
                Some(RemoteRegion {
                    id,
                    addr: segment.base_ptr() as u64,
                    rkey: mr.rkey(),
                    len: segment.len(),
                })
            })
            .collect()
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
        connect(&qp, &self.inner.port, &local, &remote)?;
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
        connect(&qp, &self.inner.port, &local, &remote)?;
        let peer = Arc::new(Peer {
            qp,
            remote,
            _oob: stream,
        });
        peers.insert(endpoint.to_owned(), Arc::clone(&peer));
        Ok(peer)
    }

    async fn forget(&self, endpoint: &str) {
        self.inner.peers.lock().await.remove(endpoint);
    }

    fn limits(&self) -> PlanLimits {
        PlanLimits {
            max_message: self.inner.port.max_message,
            staging_bytes: self.inner.config.staging_bytes,
            max_outstanding: self.inner.config.queue_depth.max(1) as usize,
        }
    }

    /// Posts one round and waits for its signaled completion. On failure the peer's
    /// queue pair is forgotten (it is in the error state): the next batch reconnects.
    async fn run_round(
        &self,
        endpoint: &str,
        peer: &Peer,
        staging: &Staging,
        round: &Round,
        opcode: u32,
    ) -> Result<(), TransferError> {
        let outcome = self
            .post_and_poll(endpoint, peer, staging, round, opcode)
            .await;
        if outcome.is_err() {
            self.forget(endpoint).await;
        }
        outcome
    }

    async fn post_and_poll(
        &self,
        endpoint: &str,
        peer: &Peer,
        staging: &Staging,
        round: &Round,
        opcode: u32,
    ) -> Result<(), TransferError> {
        let base = staging.buffer.base_ptr() as u64;
        let requests: Vec<PostRequest> = round
            .requests
            .iter()
            .map(|w| PostRequest {
                wr_id: w.wr_id,
                opcode,
                local_addr: base + w.staging_offset,
                lkey: staging.mr.lkey(),
                len: w.len,
                remote_addr: w.remote_addr,
                rkey: w.rkey,
                signaled: w.signaled,
            })
            .collect();
        peer.qp.post(&requests)?;
        let Some(last) = round.requests.last().map(|w| w.wr_id) else {
            return Ok(());
        };
        let deadline = Instant::now() + self.inner.config.completion_timeout;
        let mut completions: Vec<Completion> = Vec::with_capacity(16);
        loop {
            completions.clear();
            self.inner.cq.poll(&mut completions, 16)?;
            for completion in &completions {
                if completion.status != super::status::WC_SUCCESS {
                    return Err(completion_error(
                        endpoint,
                        completion.status,
                        completion.vendor_err,
                    ));
                }
                if completion.wr_id == last {
                    return Ok(());
                }
            }
            if Instant::now() >= deadline {
                return Err(TransferError::Timeout {
                    what: "RDMA completion",
                    endpoint: endpoint.to_owned(),
                    after: self.inner.config.completion_timeout,
                });
            }
            tokio::task::yield_now().await;
        }
    }

    /// Connects (or reuses) the peer and plans the batch against its regions.
    async fn prepare(
        &self,
        endpoint: &str,
        ops: &[PlanOp<'_>],
    ) -> Result<(Arc<Peer>, Vec<Round>), TransferError> {
        self.check_sizes(ops)?;
        let peer = self.peer(endpoint).await?;
        let rounds = plan(ops, &peer.remote.regions, self.limits())?;
        Ok((peer, rounds))
    }

    async fn write(&self, endpoint: &str, ops: &[WriteOp<'_>]) -> Result<(), TransferError> {
        let planned: Vec<PlanOp<'_>> = ops.iter().map(PlanOp::from).collect();
        let (peer, rounds) = self.prepare(endpoint, &planned).await?;
        let staging = self.inner.staging.lock().await;
        for round in &rounds {
            for w in &round.requests {
                let start = w.op_offset as usize;
                let bytes = &ops[w.op].data[start..start + w.len as usize];
                staging.buffer.write_at(w.staging_offset, bytes)?;
            }
            let opcode = rdma_sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
            self.run_round(endpoint, &peer, &staging, round, opcode)
                .await?;
        }
        Ok(())
    }

    async fn read(&self, endpoint: &str, ops: &mut [ReadInto<'_>]) -> Result<(), TransferError> {
        let planned: Vec<PlanOp<'_>> = ops.iter().map(PlanOp::from).collect();
        let (peer, rounds) = self.prepare(endpoint, &planned).await?;
        drop(planned);
        let staging = self.inner.staging.lock().await;
        for round in &rounds {
            let opcode = rdma_sys::ibv_wr_opcode::IBV_WR_RDMA_READ;
            self.run_round(endpoint, &peer, &staging, round, opcode)
                .await?;
            for w in &round.requests {
                let start = w.op_offset as usize;
                let out = &mut ops[w.op].buf[start..start + w.len as usize];
                staging.buffer.read_at(w.staging_offset, out)?;
            }
        }
        Ok(())
    }

    fn check_sizes(&self, ops: &[PlanOp<'_>]) -> Result<(), TransferError> {
        let max = self.inner.config.max_op_bytes;
        match ops.iter().find(|op| op.len > max) {
            Some(op) => Err(TransferError::TooLarge {
                what: "operation",
                len: op.len,
                max,
            }),
            None => Ok(()),
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
        // SAFETY: the segment is kept in the region table for as long as the
        // registration exists (`unregister` removes both together).
        let mr =
            unsafe { Mr::register(&self.inner.pd, segment.base_ptr(), segment.len() as usize)? };
        let id = segment.id().clone();
        self.inner.regions.insert(segment)?;
        self.inner
            .registrations
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .insert(id, mr);
        Ok(())
    }

    fn unregister(&self, id: &RegionId) -> Result<Arc<Segment>, TransferError> {
        // Deregister first, so no peer can reach the memory once it is handed back.
        self.inner
            .registrations
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .remove(id);
        self.inner.regions.remove(id)
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

    /// On a host without an RDMA device (this one, and CI) opening the transport
    /// goes through the real verbs calls and comes back as a typed error.
    #[test]
    fn opening_without_a_device_is_a_typed_error() {
        match RdmaTransport::open(RdmaConfig::default()) {
            Err(error) => assert_eq!(error.kind(), ErrorKind::NoDevice, "{error}"),
            // A host with a device: at least the discovery agrees.
            Ok(transport) => {
                assert_eq!(transport.backend(), "rdma");
                assert!(!devices().unwrap_or_default().is_empty());
            }
        }
        let named = RdmaConfig {
            device: Some("no-such-device-0".into()),
            ..RdmaConfig::default()
        };
        let error = RdmaTransport::open(named).err().map(|e| e.kind());
        assert_eq!(error, Some(ErrorKind::NoDevice));
    }
}
