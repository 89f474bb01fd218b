//! The dummy's side: one connection to the real client on this host, over which
//! requests are pipelined, and the shared region (a memory pool the caller
//! allocates buffers from, and a staging area for copying calls). When the real
//! client goes away every request in flight fails at once; the next call connects
//! again, so a restarted real client is picked up without the caller doing
//! anything.

use std::collections::HashMap;
use std::os::fd::AsFd as _;
use std::os::linux::net::SocketAddrExt as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use hkvm_events::rpc::dummy::{
    decode_frame, dummy_socket_name, encode_frame, frame_len, DummyReply, DummyRequest, Frame,
    Hello, Welcome, DUMMY_PROTOCOL_VERSION,
};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::unix::OwnedWriteHalf;
use tokio::sync::oneshot;

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
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// A dummy client. Cheap to share across threads (`Arc`).
pub struct DummyClient {
    socket: String,
    region: SharedRegion,
    pool_bytes: u64,
    pool: Mutex<RangeAllocator>,
    staging: Mutex<RangeAllocator>,
    connection: tokio::sync::Mutex<Option<Arc<Connection>>>,
    next_id: AtomicU64,
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
    /// copying calls). Connects at once.
    ///
    /// # Errors
    /// When the region cannot be created or the real client is not reachable.
    pub async fn connect(
        port: u16,
        pool_bytes: u64,
        staging_bytes: u64,
    ) -> Result<Self, DummyError> {
        let total = pool_bytes
            .checked_add(staging_bytes)
            .filter(|total| *total > 0)
            .ok_or_else(|| DummyError::Region(std::io::Error::other("empty or huge region")))?;
        let region = SharedRegion::create("hkvm-dummy", total).map_err(DummyError::Region)?;
        let client = Self {
            socket: dummy_socket_name(port),
            region,
            pool_bytes,
            pool: Mutex::new(RangeAllocator::new(0, pool_bytes)),
            staging: Mutex::new(RangeAllocator::new(pool_bytes, staging_bytes)),
            connection: tokio::sync::Mutex::new(None),
            next_id: AtomicU64::new(1),
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
        if let Some(connection) = slot.as_ref() {
            if !connection.reader.is_finished() {
                return Ok(Arc::clone(connection));
            }
        }
        let connection = Arc::new(self.open().await?);
        *slot = Some(Arc::clone(&connection));
        Ok(connection)
    }

    async fn open(&self) -> Result<Connection, DummyError> {
        let unreachable = |source| DummyError::Unreachable {
            socket: self.socket.clone(),
            source,
        };
        let address = std::os::unix::net::SocketAddr::from_abstract_name(self.socket.as_bytes())
            .map_err(unreachable)?;
        let stream = std::os::unix::net::UnixStream::connect_addr(&address).map_err(unreachable)?;
        let hello = encode_frame(&Frame {
            id: 0,
            body: Hello {
                version: DUMMY_PROTOCOL_VERSION,
                pid: std::process::id(),
                region_bytes: self.region.len(),
            },
        })?;
        send_with_fd(stream.as_fd(), &hello, self.region.fd()).map_err(unreachable)?;
        stream.set_nonblocking(true).map_err(unreachable)?;
        let stream = tokio::net::UnixStream::from_std(stream).map_err(unreachable)?;
        let (mut reader, writer) = stream.into_split();
        let welcome: Frame<Welcome> = read_frame(&mut reader)
            .await
            .map_err(unreachable)?
            .ok_or(DummyError::Disconnected)??;
        let hostname = match welcome.body {
            Welcome::Ready { hostname } => hostname,
            Welcome::Refused { reason } => return Err(DummyError::Refused(reason)),
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
        tracing::info!(socket = %self.socket, hostname, "connected to the real client");
        Ok(Connection {
            writer: tokio::sync::Mutex::new(writer),
            pending,
            reader,
            hostname,
        })
    }

    /// Sends `request` and waits for its reply.
    ///
    /// # Errors
    /// [`DummyError::Unreachable`] when no real client can be connected,
    /// [`DummyError::Disconnected`] when it went away during the request.
    pub async fn call(&self, request: &DummyRequest) -> Result<DummyReply, DummyError> {
        let connection = self.connection().await?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let bytes = encode_frame(&Frame { id, body: request })?;
        let (sender, receiver) = oneshot::channel();
        lock(&connection.pending).insert(id, sender);
        let written = connection.writer.lock().await.write_all(&bytes).await;
        if written.is_err() {
            lock(&connection.pending).remove(&id);
            return Err(DummyError::Disconnected);
        }
        receiver.await.map_err(|_| DummyError::Disconnected)
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
