//! The real client's side: accepts dummy clients on an abstract Unix socket, maps
//! each one's shared regions, and serves its requests through the real client's
//! [`Store`], reading and writing values straight in the shared regions. A dummy
//! that goes away takes nothing with it: requests it had in flight finish (a put
//! completes or is revoked by the store as any put), then its regions are
//! unmapped.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::os::linux::net::SocketAddrExt as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use hkvm_events::rpc::dummy::{
    decode_frame, dummy_socket_name, encode_frame, frame_len, Attach, DummyReply, DummyRequest,
    Frame, Hello, Welcome,
};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinHandle;

use super::region::SharedRegion;
use crate::store::{ErrorCode, Store};

mod admission;
mod requests;

pub use admission::DummyServerConfig;
use admission::{handshake, refusal, within_limits};
use requests::handle;

/// How many dummies are connected and what they asked (for logs, metrics, tests).
#[derive(Debug, Default)]
pub struct DummyServerStats {
    /// Connections accepted.
    pub connected: AtomicU64,
    /// Connections closed.
    pub disconnected: AtomicU64,
    /// Requests served.
    pub requests: AtomicU64,
    /// Regions attached after a connection (host buffers).
    pub attached: AtomicU64,
    /// Connections refused: a stranger's, a malformed or slow handshake, a
    /// region over the limits.
    pub refused: AtomicU64,
}

/// A dummy's region as this process maps it, registered with the store's
/// transports for as long as it is mapped, so that RDMA moves the dummy's bytes
/// without a copy (TCP registers nothing).
struct ServedRegion {
    store: Arc<Store>,
    registered: bool,
    region: SharedRegion,
}

impl ServedRegion {
    fn new(region: SharedRegion, store: &Arc<Store>) -> Self {
        let len = usize::try_from(region.len()).unwrap_or(usize::MAX);
        // SAFETY: the mapping lives as long as `region`, and `Drop` ends the
        // registration before `region` unmaps it; requests hold the region (an
        // `Arc` of it) while they use its bytes.
        let registered = match unsafe { store.register_local(region.base() as *mut u8, len) } {
            Ok(()) => true,
            Err(error) => {
                tracing::warn!(%error, "a dummy's region is not registered with the transport: its bytes are copied");
                false
            }
        };
        Self {
            store: Arc::clone(store),
            registered,
            region,
        }
    }
}

impl std::ops::Deref for ServedRegion {
    type Target = SharedRegion;

    fn deref(&self) -> &SharedRegion {
        &self.region
    }
}

impl Drop for ServedRegion {
    fn drop(&mut self) {
        if self.registered {
            self.store.unregister_local(self.region.base() as *mut u8);
        }
    }
}

/// The regions one dummy shares, by number (0: the one shared at connection).
type Regions = HashMap<u32, Arc<ServedRegion>>;

/// One connected dummy.
struct Session {
    /// The connected process, as the kernel reports it.
    pid: Option<i32>,
    regions: Mutex<Regions>,
}

impl Session {
    /// The regions now; a request holds them until it is answered, so a region
    /// released meanwhile stays mapped for it.
    fn regions(&self) -> Regions {
        lock(&self.regions).clone()
    }
}

/// The open sessions, by id.
#[derive(Default)]
struct Sessions {
    next: AtomicU64,
    open: Mutex<HashMap<u64, Arc<Session>>>,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// A running dummy server. Dropping it stops accepting (connected dummies are
/// served until they close).
#[derive(Debug)]
pub struct DummyServer {
    name: String,
    stats: Arc<DummyServerStats>,
    task: JoinHandle<()>,
}

impl Drop for DummyServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl DummyServer {
    /// Listens on the abstract socket of `port` ([`dummy_socket_name`]) and serves
    /// dummies of this process's user through `store`, within the default
    /// limits.
    ///
    /// # Errors
    /// When the socket name is taken (another real client serves that port).
    pub fn start(store: Arc<Store>, port: u16) -> std::io::Result<Self> {
        Self::start_with(store, port, DummyServerConfig::default())
    }

    /// As [`DummyServer::start`], accepting what `config` says.
    ///
    /// # Errors
    /// When the socket name is taken (another real client serves that port).
    pub fn start_with(
        store: Arc<Store>,
        port: u16,
        config: DummyServerConfig,
    ) -> std::io::Result<Self> {
        let config = Arc::new(config);
        let name = dummy_socket_name(port);
        let address = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
        let listener = std::os::unix::net::UnixListener::bind_addr(&address)?;
        listener.set_nonblocking(true)?;
        let listener = tokio::net::UnixListener::from_std(listener)?;
        let stats = Arc::new(DummyServerStats::default());
        let sessions = Arc::new(Sessions::default());
        let task = {
            let stats = Arc::clone(&stats);
            tokio::spawn(async move {
                loop {
                    match listener.accept().await {
                        Ok((stream, _)) => {
                            let (store, stats, sessions, config) = (
                                Arc::clone(&store),
                                Arc::clone(&stats),
                                Arc::clone(&sessions),
                                Arc::clone(&config),
                            );
                            tokio::spawn(async move {
                                if let Err(error) =
                                    serve(stream, store, &stats, &sessions, &config).await
                                {
                                    tracing::warn!(%error, "a dummy client's connection failed");
                                }
                            });
                        }
                        Err(error) => {
                            tracing::warn!(%error, "accepting a dummy client");
                            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        }
                    }
                }
            })
        };
        tracing::info!(socket = %name, "serving dummy clients");
        Ok(Self { name, stats, task })
    }

    /// The abstract socket name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What it served so far.
    pub fn stats(&self) -> &DummyServerStats {
        &self.stats
    }
}

/// Adds the region of an attaching connection to its session: only the process
/// that opened the session may, within the session's limits; the region is
/// mapped (and registered with the transports) only once all that holds.
fn attach(
    sessions: &Sessions,
    config: &DummyServerConfig,
    store: &Arc<Store>,
    request: Attach,
    pid: Option<i32>,
    (fd, bytes): (OwnedFd, u64),
) -> Result<u32, String> {
    let session = lock(&sessions.open)
        .get(&request.session)
        .cloned()
        .ok_or_else(|| format!("no open session {}", request.session))?;
    if session.pid.is_none() || session.pid != pid {
        return Err("a region may only be attached by the process that opened the session".into());
    }
    if request.region == 0 {
        return Err("region 0 is the session's first region".into());
    }
    let mut regions = lock(&session.regions);
    if regions.contains_key(&request.region) {
        return Err(format!("region {} is attached already", request.region));
    }
    within_limits(config, &regions, bytes)?;
    let region = SharedRegion::map(fd, bytes).map_err(|error| error.to_string())?;
    regions.insert(request.region, Arc::new(ServedRegion::new(region, store)));
    Ok(request.region)
}

async fn serve(
    stream: UnixStream,
    store: Arc<Store>,
    stats: &DummyServerStats,
    sessions: &Sessions,
    config: &DummyServerConfig,
) -> std::io::Result<()> {
    let pid = stream.peer_cred().ok().and_then(|cred| cred.pid());
    let handshake = tokio::time::timeout(config.handshake_timeout, handshake(&stream)).await;
    let (hello, fd) = match handshake {
        Ok(Ok(received)) => received,
        Ok(Err(error)) => {
            stats.refused.fetch_add(1, Ordering::Relaxed);
            return Err(error);
        }
        Err(_) => {
            stats.refused.fetch_add(1, Ordering::Relaxed);
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no hello within {:?}", config.handshake_timeout),
            ));
        }
    };
    let refused = refusal(config, &stream, &hello);
    let (reader, mut writer) = stream.into_split();
    let mut opened = None;
    let welcome = if let Some(reason) = refused {
        tracing::warn!(pid = ?pid, %reason, "a dummy client's connection refused");
        Welcome::Refused { reason }
    } else if let Some(request) = hello.attach {
        match attach(
            sessions,
            config,
            &store,
            request,
            pid,
            (fd, hello.region_bytes),
        ) {
            Ok(region) => {
                stats.attached.fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    pid = hello.pid,
                    region,
                    region_bytes = hello.region_bytes,
                    "a dummy client attached a region"
                );
                Welcome::Attached { region }
            }
            Err(reason) => Welcome::Refused { reason },
        }
    } else {
        match SharedRegion::map(fd, hello.region_bytes) {
            Ok(region) => {
                let id = sessions.next.fetch_add(1, Ordering::Relaxed) + 1;
                let region = ServedRegion::new(region, &store);
                let session = Arc::new(Session {
                    pid,
                    regions: Mutex::new(HashMap::from([(0, Arc::new(region))])),
                });
                lock(&sessions.open).insert(id, Arc::clone(&session));
                opened = Some((id, session));
                Welcome::Ready {
                    hostname: store.hostname().to_owned(),
                    session: id,
                }
            }
            Err(error) => Welcome::Refused {
                reason: error.to_string(),
            },
        }
    };
    if matches!(welcome, Welcome::Refused { .. }) {
        stats.refused.fetch_add(1, Ordering::Relaxed);
    }
    let bytes = encode_frame(&Frame {
        id: 0,
        body: welcome,
    })
    .map_err(std::io::Error::other)?;
    let written = writer.write_all(&bytes).await;
    let Some((id, session)) = opened else {
        return written;
    };
    stats.connected.fetch_add(1, Ordering::Relaxed);
    let served = match written {
        Ok(()) => serve_session(reader, writer, &hello, &store, stats, &session, config).await,
        Err(error) => Err(error),
    };
    lock(&sessions.open).remove(&id);
    stats.disconnected.fetch_add(1, Ordering::Relaxed);
    tracing::info!(pid = hello.pid, "a dummy client disconnected");
    served
}

/// Serves one session's requests until the dummy closes it.
async fn serve_session(
    mut reader: tokio::net::unix::OwnedReadHalf,
    mut writer: tokio::net::unix::OwnedWriteHalf,
    hello: &Hello,
    store: &Arc<Store>,
    stats: &DummyServerStats,
    session: &Arc<Session>,
    config: &DummyServerConfig,
) -> std::io::Result<()> {
    let in_flight = Arc::new(Semaphore::new(config.max_in_flight.max(1)));
    tracing::info!(
        pid = hello.pid,
        region_bytes = hello.region_bytes,
        "a dummy client connected"
    );
    let (replies, mut outgoing) = mpsc::channel::<Vec<u8>>(256);
    let writing = tokio::spawn(async move {
        while let Some(bytes) = outgoing.recv().await {
            if writer.write_all(&bytes).await.is_err() {
                break;
            }
        }
    });
    let mut prefix = [0u8; 4];
    loop {
        if reader.read_exact(&mut prefix).await.is_err() {
            break;
        }
        let len = frame_len(prefix).map_err(std::io::Error::other)?;
        let mut body = vec![0u8; len];
        reader.read_exact(&mut body).await?;
        let frame: Frame<DummyRequest> = match decode_frame(&body) {
            Ok(frame) => frame,
            Err(error) => {
                tracing::warn!(%error, pid = hello.pid, "a malformed request; closing");
                break;
            }
        };
        stats.requests.fetch_add(1, Ordering::Relaxed);
        if let DummyRequest::ReleaseRegion { region } = frame.body {
            let body = release(session, region);
            let bytes =
                encode_frame(&Frame { id: frame.id, body }).map_err(std::io::Error::other)?;
            if replies.send(bytes).await.is_err() {
                break;
            }
            continue;
        }
        // At the limit, the next request is not read until one is answered.
        let Ok(permit) = Arc::clone(&in_flight).acquire_owned().await else {
            break;
        };
        let (store, regions, replies) = (Arc::clone(store), session.regions(), replies.clone());
        tokio::spawn(async move {
            let body = handle(&store, &regions, frame.body).await;
            drop(permit);
            if let Ok(bytes) = encode_frame(&Frame { id: frame.id, body }) {
                let _ = replies.send(bytes).await;
            }
        });
    }
    drop(replies);
    let _ = writing.await;
    Ok(())
}

/// Drops an attached region from the session.
fn release(session: &Session, region: u32) -> DummyReply {
    let refused = |reason: String| DummyReply::Refused {
        code: ErrorCode::InvalidParams.value(),
        reason,
    };
    if region == 0 {
        return refused("region 0 lasts as long as the session".into());
    }
    match lock(&session.regions).remove(&region) {
        Some(_) => DummyReply::Codes(vec![0]),
        None => refused(format!("no region {region} is attached")),
    }
}
