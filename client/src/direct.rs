//! Direct requests to a sub-cluster's leader: one TCP connection per client and
//! sub-cluster, many requests in flight on it, framed as
//! [`hkvm_events::rpc::direct`] says, carrying the same bodies as NATS
//! request/reply. A request and its reply then cross no broker.
//!
//! NATS stays the discovery and the fallback: the leader's endpoint comes from
//! its lease record (read once, in the background, when a call finds no link)
//! and from its announcement when a new leader serves; while no link is up, or
//! after one failed, calls go over NATS exactly as before, and a new link is
//! made in the background. A link is dropped the moment it fails in any way (a
//! closed connection, a timeout, `NotLeader`), so a request is never retried
//! on the link that failed it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hkvm_events::lease::LeaseHolder;
use hkvm_events::rpc::direct::{
    decode_reply, encode_hello, frame_len, push_request, DirectHello, DirectWelcome, FrameError,
};
use hkvm_events::rpc::{self, RpcReply};
use hkvm_events::subject::Bucket;
use hkvm_events::{ClusterId, SubclusterId};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

/// How long connecting and the hello may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// After a failed attempt to link, how long calls go over NATS before the next.
const RELINK_AFTER: Duration = Duration::from_millis(200);
/// Request bytes gathered into one write at most.
const WRITE_BATCH: usize = 256 << 10;
/// Bytes read from the socket at a time.
const READ_BUFFER: usize = 64 << 10;

/// Why a request on a link got no reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkFailure {
    /// The link was closed before the request was written: it never left this
    /// process, send it elsewhere.
    NotSent,
    /// The connection closed after the request was handed to it: it may have
    /// been served.
    Lost,
}

/// Why a link could not be made.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// The lease bucket could not be read.
    #[error("reading the leader lease: {0}")]
    Lease(String),
    /// No leader holds the lease, or it takes no direct requests.
    #[error("no leader with a direct endpoint")]
    NoEndpoint,
    /// Connecting or the hello failed.
    #[error("{endpoint}: {source}")]
    Connect {
        /// The endpoint.
        endpoint: String,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// The hello's answer did not decode.
    #[error("{endpoint}: {source}")]
    Frame {
        /// The endpoint.
        endpoint: String,
        /// What did not decode.
        #[source]
        source: FrameError,
    },
    /// The server refused the hello (another sub-cluster's endpoint).
    #[error("{endpoint} refused the hello: {message}")]
    Refused {
        /// The endpoint.
        endpoint: String,
        /// Its reason.
        message: String,
    },
}

/// Replies owed to callers, by request id.
type Pending = Mutex<HashMap<u64, oneshot::Sender<Vec<u8>>>>;

/// One connection to a leader.
#[derive(Debug)]
pub struct DirectLink {
    endpoint: String,
    welcome: DirectWelcome,
    requests: mpsc::UnboundedSender<Vec<u8>>,
    pending: Arc<Pending>,
    next_id: AtomicU64,
    closed: Arc<AtomicBool>,
}

impl DirectLink {
    /// Connects to `endpoint` and says hello for `hello`'s sub-cluster.
    ///
    /// # Errors
    /// [`LinkError::Connect`], [`LinkError::Frame`] or [`LinkError::Refused`].
    pub async fn connect(endpoint: &str, hello: &DirectHello) -> Result<Self, LinkError> {
        let connect_error = |source| LinkError::Connect {
            endpoint: endpoint.to_owned(),
            source,
        };
        let timed_out = || {
            connect_error(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no answer to the hello in time",
            ))
        };
        let greet = async {
            let mut stream = TcpStream::connect(endpoint).await.map_err(connect_error)?;
            stream.set_nodelay(true).map_err(connect_error)?;
            stream
                .write_all(&encode_hello(hello))
                .await
                .map_err(connect_error)?;
            let mut prefix = [0u8; 4];
            stream
                .read_exact(&mut prefix)
                .await
                .map_err(connect_error)?;
            let len = frame_len(prefix).map_err(|source| LinkError::Frame {
                endpoint: endpoint.to_owned(),
                source,
            })?;
            let mut body = vec![0; len];
            stream.read_exact(&mut body).await.map_err(connect_error)?;
            Ok::<_, LinkError>((stream, body))
        };
        let (stream, body) = tokio::time::timeout(CONNECT_TIMEOUT, greet)
            .await
            .map_err(|_| timed_out())??;
        let welcome = match rpc::decode::<RpcReply<DirectWelcome>>(&body) {
            Ok(RpcReply::Ok(welcome)) => welcome,
            Ok(RpcReply::Err(error)) => {
                return Err(LinkError::Refused {
                    endpoint: endpoint.to_owned(),
                    message: error.to_string(),
                })
            }
            Err(error) => {
                return Err(LinkError::Frame {
                    endpoint: endpoint.to_owned(),
                    source: FrameError::Malformed {
                        what: "welcome",
                        message: error.to_string(),
                    },
                })
            }
        };
        let (read, write) = stream.into_split();
        let (requests, outgoing) = mpsc::unbounded_channel();
        let pending = Arc::new(Pending::default());
        let closed = Arc::new(AtomicBool::new(false));
        tokio::spawn(write_requests(
            write,
            outgoing,
            Arc::clone(&pending),
            Arc::clone(&closed),
        ));
        tokio::spawn(read_replies(
            read,
            Arc::clone(&pending),
            Arc::clone(&closed),
        ));
        Ok(Self {
            endpoint: endpoint.to_owned(),
            welcome,
            requests,
            pending,
            next_id: AtomicU64::new(1),
            closed,
        })
    }

    /// The endpoint this link is connected to.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Who answered the hello, in which epoch.
    pub fn welcome(&self) -> &DirectWelcome {
        &self.welcome
    }

    /// Whether the connection closed.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Sends a request of `op` with `body` and waits for its reply body (an
    /// encoded `RpcReply`). The caller bounds the wait.
    ///
    /// # Errors
    /// [`LinkFailure::NotSent`] when the link was closed already,
    /// [`LinkFailure::Lost`] when it closed before the reply came.
    pub async fn call(&self, op: &str, body: &[u8]) -> Result<Vec<u8>, LinkFailure> {
        if self.is_closed() {
            return Err(LinkFailure::NotSent);
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (reply_tx, reply_rx) = oneshot::channel();
        lock(&self.pending).insert(id, reply_tx);
        // Forgets the entry when the caller stops waiting (its timeout).
        let _forget = Forget {
            pending: &self.pending,
            id,
        };
        if self.is_closed() {
            // Closed while the entry went in: the tasks may not see it.
            return Err(LinkFailure::NotSent);
        }
        let mut frame = Vec::with_capacity(body.len() + op.len() + 17);
        push_request(&mut frame, id, op, body);
        if self.requests.send(frame).is_err() {
            return Err(LinkFailure::NotSent);
        }
        // The link's tasks drain every entry when the connection ends.
        reply_rx.await.map_err(|_| LinkFailure::Lost)
    }

    /// Closes the link: its connection ends, and requests waiting on it end as
    /// [`LinkFailure::Lost`].
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        lock(&self.pending).clear();
    }
}

impl Drop for DirectLink {
    fn drop(&mut self) {
        self.close();
    }
}

/// Removes a request's entry when its caller is done with it.
struct Forget<'a> {
    pending: &'a Pending,
    id: u64,
}

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        lock(self.pending).remove(&self.id);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

async fn write_requests(
    mut write: OwnedWriteHalf,
    mut requests: mpsc::UnboundedReceiver<Vec<u8>>,
    pending: Arc<Pending>,
    closed: Arc<AtomicBool>,
) {
    let mut batch = Vec::with_capacity(WRITE_BATCH);
    while let Some(first) = requests.recv().await {
        if closed.load(Ordering::Acquire) {
            break;
        }
        batch.clear();
        batch.extend_from_slice(&first);
        while batch.len() < WRITE_BATCH {
            match requests.try_recv() {
                Ok(frame) => batch.extend_from_slice(&frame),
                Err(_) => break,
            }
        }
        if write.write_all(&batch).await.is_err() {
            break;
        }
    }
    closed.store(true, Ordering::Release);
    // Requests not written, or whose connection broke, end as lost.
    lock(&pending).clear();
    let _ = write.shutdown().await;
}

async fn read_replies(read: OwnedReadHalf, pending: Arc<Pending>, closed: Arc<AtomicBool>) {
    let mut reader = BufReader::with_capacity(READ_BUFFER, read);
    let mut frame = Vec::new();
    loop {
        if closed.load(Ordering::Acquire) {
            break;
        }
        let mut prefix = [0u8; 4];
        if reader.read_exact(&mut prefix).await.is_err() {
            break;
        }
        let Ok(len) = frame_len(prefix) else { break };
        frame.resize(len, 0);
        if reader.read_exact(&mut frame).await.is_err() {
            break;
        }
        let Ok((id, body)) = decode_reply(&frame) else {
            break;
        };
        if let Some(waiter) = lock(&pending).remove(&id) {
            let _ = waiter.send(body.to_vec());
        }
    }
    closed.store(true, Ordering::Release);
    // Every request still waiting ends as lost.
    lock(&pending).clear();
}

/// The direct route of one client to its sub-cluster's leader: the current
/// link, and making a new one in the background when there is none. Shared by
/// a client's clones.
#[derive(Debug)]
pub struct DirectRoute {
    nats: async_nats::Client,
    hello: DirectHello,
    link: Mutex<Option<Arc<DirectLink>>>,
    /// Whether a background attempt to link runs.
    linking: AtomicBool,
    /// When the last attempt failed.
    failed_at: Mutex<Option<Instant>>,
    /// Requests sent over a link (for tests, benchmarks and logs).
    sent: AtomicU64,
}

impl DirectRoute {
    /// A route of `subcluster` in `cluster`; nothing is connected until a call
    /// asks for a link.
    pub fn new(nats: async_nats::Client, cluster: ClusterId, subcluster: SubclusterId) -> Self {
        Self {
            nats,
            hello: DirectHello {
                cluster,
                subcluster,
            },
            link: Mutex::new(None),
            linking: AtomicBool::new(false),
            failed_at: Mutex::new(None),
            sent: AtomicU64::new(0),
        }
    }

    /// Requests sent over links so far.
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// The endpoint and epoch of the open link, if one is up.
    pub fn linked(&self) -> Option<(String, u64)> {
        lock(&self.link)
            .as_ref()
            .filter(|link| !link.is_closed())
            .map(|link| (link.endpoint().to_owned(), link.welcome().epoch))
    }

    /// The open link, if any; when there is none, starts making one in the
    /// background (at most one attempt at a time, and not again within
    /// [`RELINK_AFTER`] of a failed one), and the caller goes over NATS.
    pub fn link(self: &Arc<Self>) -> Option<Arc<DirectLink>> {
        {
            let mut current = lock(&self.link);
            match current.as_ref() {
                Some(link) if !link.is_closed() => {
                    self.sent.fetch_add(1, Ordering::Relaxed);
                    return Some(Arc::clone(link));
                }
                Some(_) => *current = None,
                None => {}
            }
        }
        let recently_failed = lock(&self.failed_at).is_some_and(|at| at.elapsed() < RELINK_AFTER);
        if !recently_failed && !self.linking.swap(true, Ordering::AcqRel) {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                let route = Arc::clone(self);
                runtime.spawn(async move { route.relink(None).await });
            } else {
                self.linking.store(false, Ordering::Release);
            }
        }
        None
    }

    /// Drops `link` when it is still the current one: it failed a request.
    pub fn discard(&self, link: &Arc<DirectLink>) {
        let mut current = lock(&self.link);
        if current.as_ref().is_some_and(|held| Arc::ptr_eq(held, link)) {
            tracing::debug!(endpoint = link.endpoint(), "dropping a direct link");
            link.close();
            *current = None;
        }
    }

    /// A leader announced itself with `announced` (its lease record): link to
    /// it unless the current link already goes there.
    pub fn announced(self: &Arc<Self>, announced: &[u8]) {
        let Ok(holder) = LeaseHolder::decode(announced) else {
            return;
        };
        let current = lock(&self.link).clone();
        if let Some(link) = current {
            if Some(link.endpoint()) == holder.direct.as_deref()
                && link.welcome().epoch == holder.epoch
                && !link.is_closed()
            {
                return;
            }
            self.discard(&link);
        }
        if !self.linking.swap(true, Ordering::AcqRel) {
            let route = Arc::clone(self);
            tokio::spawn(async move { route.relink(Some(holder)).await });
        }
    }

    /// Makes a new link to the leader `holder` names (read from the lease
    /// bucket when none is given).
    async fn relink(&self, holder: Option<LeaseHolder>) {
        let result = match holder {
            Some(holder) => Ok(holder),
            None => self.read_lease().await,
        };
        let result = match result {
            Ok(LeaseHolder {
                direct: Some(endpoint),
                ..
            }) => DirectLink::connect(&endpoint, &self.hello).await,
            Ok(_) => Err(LinkError::NoEndpoint),
            Err(error) => Err(error),
        };
        match result {
            Ok(link) => {
                tracing::debug!(
                    endpoint = link.endpoint(),
                    epoch = link.welcome().epoch,
                    "direct link to the leader"
                );
                *lock(&self.link) = Some(Arc::new(link));
                *lock(&self.failed_at) = None;
            }
            Err(error) => {
                tracing::debug!(%error, "no direct link; requests go over NATS");
                *lock(&self.failed_at) = Some(Instant::now());
            }
        }
        self.linking.store(false, Ordering::Release);
    }

    /// The current leader lease record.
    async fn read_lease(&self) -> Result<LeaseHolder, LinkError> {
        let js = async_nats::jetstream::new(self.nats.clone());
        let bucket = Bucket::Leader.name(&self.hello.cluster);
        let store = js
            .get_key_value(&bucket)
            .await
            .map_err(|e| LinkError::Lease(e.to_string()))?;
        let entry = store
            .entry(self.hello.subcluster.as_str())
            .await
            .map_err(|e| LinkError::Lease(e.to_string()))?;
        match entry {
            Some(entry) if entry.operation == async_nats::jetstream::kv::Operation::Put => {
                LeaseHolder::decode(&entry.value).map_err(|e| LinkError::Lease(e.to_string()))
            }
            _ => Err(LinkError::NoEndpoint),
        }
    }
}
