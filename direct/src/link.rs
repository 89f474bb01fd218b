//! The client side of a direct connection: [`DirectLink`] holds one TCP
//! connection to a server, with many requests in flight on it, each matched to
//! its reply by id. Whoever uses it decides where to connect and what to do
//! when a request fails on it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hkvm_events::rpc::direct::{
    decode_reply, encode_hello, frame_len, push_request, DirectHello, DirectWelcome, FrameError,
};
use hkvm_events::rpc::{self, RpcReply};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::TcpStream;
use tokio::sync::oneshot;

use crate::sender::Sender;

/// How long connecting and the hello may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Bytes read from the socket at a time: small, since a server may hold ten
/// thousand connections (a larger frame is read straight into its buffer).
const READ_BUFFER: usize = 8 << 10;
/// Buffer capacity a connection keeps between frames or batches; one that grew
/// past it for a large frame is given back.
const KEPT_CAPACITY: usize = 64 << 10;

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
    /// Where to connect could not be learned (the reason).
    #[error("finding the endpoint: {0}")]
    Discovery(String),
    /// The server takes no direct requests.
    #[error("no direct endpoint")]
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
    /// The server refused the hello (another service's endpoint, or one that
    /// does not serve now).
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
    sender: Arc<Sender<()>>,
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
        let sender = Sender::spawn(write);
        let pending = Arc::new(Pending::default());
        let closed = Arc::new(AtomicBool::new(false));
        tokio::spawn(read_replies(
            read,
            Arc::clone(&pending),
            Arc::clone(&closed),
        ));
        Ok(Self {
            endpoint: endpoint.to_owned(),
            welcome,
            sender,
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
        if !self.sender.send(&frame, ()) {
            self.close();
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
        self.sender.close();
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
        frame.clear();
        frame.shrink_to(KEPT_CAPACITY);
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
