//! The dummy's side: one connection to the real client on this host, over which
//! requests are pipelined, and the shared region (a memory pool the caller
//! allocates buffers from, and a staging area for copying calls). When the real
//! client goes away every request in flight fails at once; the next call connects
//! again, so a restarted real client is picked up without the caller doing
//! anything.

use std::collections::HashMap;
use std::os::fd::{AsFd as _, BorrowedFd, OwnedFd};
use std::os::linux::net::SocketAddrExt as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use hkvm_events::rpc::dummy::{
    decode_frame, dummy_socket_name, encode_frame, frame_len, Attach, DummyReply, DummyRequest,
    Frame, Hello, Welcome, DUMMY_PROTOCOL_VERSION,
};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::oneshot;

use super::access::{PeerAccess, TRUSTED_SERVER_UIDS_ENV};
use super::fd::send_with_fd;
use super::region::{RangeAllocator, SharedRegion};

/// Why a dummy call failed.
#[derive(Debug, thiserror::Error)]
pub enum DummyError {
    /// No real client listens on the socket, or it went away.
    #[error("the real client on {socket} is not reachable")]
    Unreachable {
        /// The socket name.
        socket: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The real client went away while the request was in flight.
    #[error("the real client went away during the request")]
    Disconnected,
    /// The real client refused the connection.
    #[error("the real client refused the connection: {0}")]
    Refused(String),
    /// The process serving the socket is not a real client this dummy trusts
    /// with its memory (another user's process holds the name).
    #[error("{socket} is served by a process this dummy does not trust: {reason}")]
    Untrusted {
        /// The socket name.
        socket: String,
        /// Who serves it.
        reason: String,
    },
    /// The shared region could not be created.
    #[error("creating the shared region")]
    Region(#[source] std::io::Error),
    /// A frame could not be encoded or decoded.
    #[error(transparent)]
    Frame(#[from] hkvm_events::rpc::dummy::FrameError),
}

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<DummyReply>>>>;

/// One live connection.
struct Connection {
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
    pending: Pending,
    reader: tokio::task::JoinHandle<()>,
    hostname: String,
    session: u64,
    /// Set when a write failed: the real client is gone.
    broken: std::sync::atomic::AtomicBool,
}

impl Connection {
    fn alive(&self) -> bool {
        !self.reader.is_finished() && !self.broken.load(Ordering::Relaxed)
    }
}

/// A region this dummy shares besides its pool (a host buffer), attached again
/// whenever the dummy connects again.
struct Share {
    region: u32,
    fd: OwnedFd,
    len: u64,
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// A dummy client. Cheap to share across threads (`Arc`).
pub struct DummyClient {
    socket: String,
    /// The users whose real client may receive this dummy's memory.
    trusted: PeerAccess,
    region: SharedRegion,
    pool_bytes: u64,
    pool: Mutex<RangeAllocator>,
    staging: Mutex<RangeAllocator>,
    connection: tokio::sync::Mutex<Option<Arc<Connection>>>,
    next_id: AtomicU64,
    shares: Mutex<Vec<Share>>,
    next_region: AtomicU64,
}

impl std::fmt::Debug for DummyClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DummyClient")
            .field("socket", &self.socket)
            .field("region_bytes", &self.region.len())
            .finish()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

impl DummyClient {
    /// A dummy of the real client serving `port` on this host, with a shared
    /// region of `pool_bytes` (the caller's memory pool) plus `staging_bytes` (for
    /// copying calls). Connects at once. It trusts a real client of its own user,
    /// and of the users [`TRUSTED_SERVER_UIDS_ENV`] lists.
    ///
    /// # Errors
    /// When the region cannot be created or the real client is not reachable or
    /// not trusted.
    pub async fn connect(
        port: u16,
        pool_bytes: u64,
        staging_bytes: u64,
    ) -> Result<Self, DummyError> {
        let total = pool_bytes
            .checked_add(staging_bytes)
            .filter(|total| *total > 0)
            .ok_or_else(|| DummyError::Region(std::io::Error::other("empty or huge region")))?;
        let trusted = PeerAccess::from_env(TRUSTED_SERVER_UIDS_ENV).map_err(|reason| {
            DummyError::Untrusted {
                socket: dummy_socket_name(port),
                reason,
            }
        })?;
        let region = SharedRegion::create("hkvm-dummy", total).map_err(DummyError::Region)?;
        let client = Self {
            socket: dummy_socket_name(port),
            trusted,
            region,
            pool_bytes,
            pool: Mutex::new(RangeAllocator::new(0, pool_bytes)),
            staging: Mutex::new(RangeAllocator::new(pool_bytes, staging_bytes)),
            connection: tokio::sync::Mutex::new(None),
            next_id: AtomicU64::new(1),
            shares: Mutex::new(Vec::new()),
            next_region: AtomicU64::new(1),
        };
        client.connection().await?;
        Ok(client)
    }

    /// The shared region.
    pub fn region(&self) -> &SharedRegion {
        &self.region
    }

    /// Bytes of the memory pool.
    pub fn pool_bytes(&self) -> u64 {
        self.pool_bytes
    }

    /// An offset of `len` bytes in the memory pool, or `None` when full.
    pub fn pool_alloc(&self, len: u64) -> Option<u64> {
        lock(&self.pool).allocate(len)
    }

    /// Frees a pool offset; whether it was allocated.
    pub fn pool_free(&self, offset: u64) -> bool {
        lock(&self.pool).free(offset)
    }

    /// An offset of `len` bytes in the staging area, or `None` when it has no
    /// room now.
    pub fn staging_alloc(&self, len: u64) -> Option<u64> {
        lock(&self.staging).allocate(len)
    }

    /// Frees a staging offset.
    pub fn staging_free(&self, offset: u64) {
        lock(&self.staging).free(offset);
    }

    /// The real client's endpoint, once connected.
    pub async fn hostname(&self) -> Option<String> {
        self.connection
            .lock()
            .await
            .as_ref()
            .map(|c| c.hostname.clone())
    }

    /// The live connection, made (again) when there is none.
    async fn connection(&self) -> Result<Arc<Connection>, DummyError> {
        let mut slot = self.connection.lock().await;
        self.connected(&mut slot).await
    }

    /// The connection in `slot`, made again (with every shared region attached
    /// again) when it is gone.
    async fn connected(
        &self,
        slot: &mut Option<Arc<Connection>>,
    ) -> Result<Arc<Connection>, DummyError> {
        if let Some(connection) = slot.as_ref() {
            if connection.alive() {
                return Ok(Arc::clone(connection));
            }
        }
        let connection = Arc::new(self.open().await?);
        let shares: Vec<(u32, OwnedFd, u64)> = lock(&self.shares)
            .iter()
            .map(|share| {
                let fd = share.fd.try_clone().map_err(DummyError::Region)?;
                Ok((share.region, fd, share.len))
            })
            .collect::<Result<_, DummyError>>()?;
        for (region, fd, len) in shares {
            self.attach(connection.session, region, fd.as_fd(), len)
                .await?;
        }
        *slot = Some(Arc::clone(&connection));
        Ok(connection)
    }

    fn unreachable(&self, source: std::io::Error) -> DummyError {
        DummyError::Unreachable {
            socket: self.socket.clone(),
            source,
        }
    }

    /// Connects, sends `hello` with `fd` attached and reads the welcome.
    async fn handshake(
        &self,
        hello: Hello,
        fd: BorrowedFd<'_>,
    ) -> Result<(Welcome, OwnedReadHalf, OwnedWriteHalf), DummyError> {
        let address = std::os::unix::net::SocketAddr::from_abstract_name(self.socket.as_bytes())
            .map_err(|e| self.unreachable(e))?;
        let stream = std::os::unix::net::UnixStream::connect_addr(&address)
            .map_err(|e| self.unreachable(e))?;
        // Whoever holds the name gets this memory: make sure it is ours.
        self.trusted
            .check(&stream)
            .map_err(|error| DummyError::Untrusted {
                socket: self.socket.clone(),
                reason: error.to_string(),
            })?;
        let hello = encode_frame(&Frame { id: 0, body: hello })?;
        send_with_fd(stream.as_fd(), &hello, fd).map_err(|e| self.unreachable(e))?;
        stream
            .set_nonblocking(true)
            .map_err(|e| self.unreachable(e))?;
        let stream = tokio::net::UnixStream::from_std(stream).map_err(|e| self.unreachable(e))?;
        let (mut reader, writer) = stream.into_split();
        let welcome: Frame<Welcome> = read_frame(&mut reader)
            .await
            .map_err(|e| self.unreachable(e))?
            .ok_or(DummyError::Disconnected)??;
        Ok((welcome.body, reader, writer))
    }

    /// Attaches `fd` (of `len` bytes) to `session` as `region`.
    async fn attach(
        &self,
        session: u64,
        region: u32,
        fd: BorrowedFd<'_>,
        len: u64,
    ) -> Result<(), DummyError> {
        let hello = Hello {
            version: DUMMY_PROTOCOL_VERSION,
            pid: std::process::id(),
            region_bytes: len,
            attach: Some(Attach { session, region }),
        };
        match self.handshake(hello, fd).await?.0 {
            Welcome::Attached { region: attached } if attached == region => Ok(()),
            Welcome::Refused { reason } => Err(DummyError::Refused(reason)),
            other => Err(DummyError::Refused(format!(
                "an unexpected answer to an attachment: {other:?}"
            ))),
        }
    }

    /// Shares `len` bytes of memory behind `fd` (a memfd the caller mapped, such
    /// as a host buffer from [`SharedRegion::create`]) with the real client, so
    /// that spans of the returned region number move its bytes with no copy. The
    /// region stays shared, across reconnections too, until [`Self::release`].
    ///
    /// # Errors
    /// When the descriptor cannot be kept, or the real client is unreachable or
    /// refuses it.
    pub async fn share(&self, fd: BorrowedFd<'_>, len: u64) -> Result<u32, DummyError> {
        let fd = fd.try_clone_to_owned().map_err(DummyError::Region)?;
        let region = u32::try_from(self.next_region.fetch_add(1, Ordering::Relaxed))
            .map_err(|_| DummyError::Region(std::io::Error::other("region numbers ran out")))?;
        // Under the connection lock, so that a reconnection cannot miss it.
        let mut slot = self.connection.lock().await;
        let connection = self.connected(&mut slot).await?;
        self.attach(connection.session, region, fd.as_fd(), len)
            .await?;
        lock(&self.shares).push(Share { region, fd, len });
        Ok(region)
    }

    /// Stops sharing `region`; whether it was shared.
    ///
    /// # Errors
    /// When the real client is unreachable or refuses.
    pub async fn release(&self, region: u32) -> Result<bool, DummyError> {
        let removed = {
            let mut shares = lock(&self.shares);
            let before = shares.len();
            shares.retain(|share| share.region != region);
            shares.len() != before
        };
        if !removed {
            return Ok(false);
        }
        match self.call(&DummyRequest::ReleaseRegion { region }).await? {
            DummyReply::Codes(codes) if codes == [0] => Ok(true),
            DummyReply::Refused { reason, .. } => Err(DummyError::Refused(reason)),
            other => Err(DummyError::Refused(format!(
                "an unexpected answer to a release: {other:?}"
            ))),
        }
    }

    async fn open(&self) -> Result<Connection, DummyError> {
        let hello = Hello {
            version: DUMMY_PROTOCOL_VERSION,
            pid: std::process::id(),
            region_bytes: self.region.len(),
            attach: None,
        };
        let (welcome, mut reader, writer) = self.handshake(hello, self.region.fd()).await?;
        let (hostname, session) = match welcome {
            Welcome::Ready { hostname, session } => (hostname, session),
            Welcome::Refused { reason } => return Err(DummyError::Refused(reason)),
            Welcome::Attached { .. } => {
                return Err(DummyError::Refused(
                    "an attachment's answer to a connection".into(),
                ))
            }
        };
        let pending: Pending = Arc::default();
        let reader = {
            let pending = Arc::clone(&pending);
            tokio::spawn(async move {
                loop {
                    match read_frame::<DummyReply>(&mut reader).await {
                        Ok(Some(Ok(frame))) => {
                            if let Some(waiter) = lock(&pending).remove(&frame.id) {
                                let _ = waiter.send(frame.body);
                            }
                        }
                        Ok(Some(Err(error))) => {
                            tracing::warn!(%error, "a malformed reply from the real client");
                            break;
                        }
                        Ok(None) | Err(_) => break,
                    }
                }
                // Every request still waiting fails now, not at a timeout.
                lock(&pending).clear();
            })
        };
        tracing::info!(socket = %self.socket, hostname, session, "connected to the real client");
        Ok(Connection {
            writer: tokio::sync::Mutex::new(writer),
            pending,
            reader,
            hostname,
            session,
            broken: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Sends `request` and waits for its reply.
    ///
    /// # Errors
    /// [`DummyError::Unreachable`] when no real client can be connected,
    /// [`DummyError::Disconnected`] when it went away during the request.
    pub async fn call(&self, request: &DummyRequest) -> Result<DummyReply, DummyError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let bytes = encode_frame(&Frame { id, body: request })?;
        // A request that could not be written never reached the real client: it
        // goes once more over a new connection (the real client may be back).
        for attempt in 0..2 {
            let connection = self.connection().await?;
            let (sender, receiver) = oneshot::channel();
            lock(&connection.pending).insert(id, sender);
            let written = connection.writer.lock().await.write_all(&bytes).await;
            if written.is_ok() {
                return receiver.await.map_err(|_| DummyError::Disconnected);
            }
            lock(&connection.pending).remove(&id);
            connection.broken.store(true, Ordering::Relaxed);
            tracing::debug!(attempt, "writing to the real client failed");
        }
        Err(DummyError::Disconnected)
    }
}

/// Reads one frame: `None` at a clean end of stream.
async fn read_frame<T: serde::de::DeserializeOwned>(
    reader: &mut (impl tokio::io::AsyncRead + Unpin),
) -> std::io::Result<Option<Result<Frame<T>, hkvm_events::rpc::dummy::FrameError>>> {
    let mut prefix = [0u8; 4];
    match reader.read_exact(&mut prefix).await {
        Ok(_) => {}
        Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(error) => return Err(error),
    }
    let len = match frame_len(prefix) {
        Ok(len) => len,
        Err(error) => return Ok(Some(Err(error))),
    };
    let mut body = vec![0u8; len];
    reader.read_exact(&mut body).await?;
    Ok(Some(decode_frame(&body)))
}
