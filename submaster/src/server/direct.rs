//! The direct front: the leader's TCP listener for its clients' hot operations,
//! so that a request and its reply cross no NATS broker. It speaks the framing of
//! [`hkvm_events::rpc::direct`] (the same request and reply bodies as the NATS
//! front), many requests in flight per connection, and hands every request to
//! the same [`Gate`] as the NATS front: the same recovery, queue and ping rules,
//! the same state machine, the same durability. It lives exactly as long as the
//! leadership: when the leader steps down, the listener and every connection
//! close, and clients go back to NATS until they reach the next leader.
//!
//! A connection starts with a hello naming the cluster and sub-cluster; one for
//! another sub-cluster, or bytes that are not a hello, are refused and closed.
//! Each connection holds at most [`IN_FLIGHT`] requests unanswered: past that it
//! stops reading, so a client that does not read its replies stalls only itself.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hkvm_events::rpc::direct::{
    decode_hello, decode_request, frame_len, is_direct_op, push_reply, push_welcome, DirectWelcome,
    FrameError,
};
use hkvm_events::rpc::submaster::Op;
use hkvm_events::rpc::{self, RpcError, RpcErrorCode, RpcReply};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::rpc::{encode_error, Gate, ReplyTo};
use super::Context;
use crate::config::DirectListen;
use crate::error::{SubmasterError, SubmasterErrorKind};
use crate::metrics::SubmasterMetrics;

/// Requests one connection may have unanswered before it stops being read.
pub const IN_FLIGHT: usize = 1024;
/// How long a new connection has to send its hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// Reply bytes gathered into one write at most.
const WRITE_BATCH: usize = 256 << 10;
/// Bytes read from the socket at a time.
const READ_BUFFER: usize = 64 << 10;

/// One reply owed on a direct connection; sending it (or dropping it) frees the
/// connection's slot for another request.
#[derive(Debug)]
pub(crate) struct DirectReply {
    id: u64,
    out: mpsc::UnboundedSender<Outgoing>,
    slot: OwnedSemaphorePermit,
}

impl DirectReply {
    /// Queues `body` for the connection's writer (nothing when it closed).
    pub(crate) fn send(self, body: Vec<u8>) {
        let _ = self.out.send(Outgoing::Reply {
            id: self.id,
            body,
            slot: self.slot,
        });
    }
}

/// What the connection's writer sends.
#[derive(Debug)]
enum Outgoing {
    /// The answer to the hello: a whole frame.
    Welcome(Vec<u8>),
    /// A reply, holding its request's slot until it is written.
    Reply {
        id: u64,
        body: Vec<u8>,
        slot: OwnedSemaphorePermit,
    },
}

/// The running direct front; dropping it closes the listener and every
/// connection.
pub(crate) struct DirectFront {
    /// `host:port` clients are told to connect to.
    pub(crate) endpoint: String,
    _tasks: JoinSet<()>,
}

impl DirectFront {
    /// Binds the listener the configuration asks for and serves it: `None` when
    /// direct requests are off (or the address to listen on is unknown).
    ///
    /// # Errors
    /// When the listener cannot be bound.
    pub(crate) async fn start(
        ctx: &Context,
        gate: Gate,
        welcome: DirectWelcome,
    ) -> Result<Option<Self>, SubmasterError> {
        let Some(addr) = listen_addr(ctx) else {
            return Ok(None);
        };
        let listener = TcpListener::bind(addr).await.map_err(|e| {
            SubmasterError::caused(
                SubmasterErrorKind::Rpc,
                format!("binding the direct front on {addr}"),
                e,
            )
        })?;
        let bound = listener.local_addr().map_err(|e| {
            SubmasterError::caused(SubmasterErrorKind::Rpc, "reading the direct address", e)
        })?;
        let endpoint = advertised(ctx.config.direct.advertise.as_deref(), bound);
        tracing::info!(%bound, %endpoint, "taking direct requests");
        let serving = Serving {
            gate,
            client: ctx.client.clone(),
            metrics: ctx.metrics.clone(),
            hello: Welcome {
                cluster: ctx.config.cluster.to_string(),
                subcluster: ctx.config.subcluster.to_string(),
                serving: welcome,
            },
        };
        let mut tasks = JoinSet::new();
        tasks.spawn(accept(listener, serving));
        Ok(Some(Self {
            endpoint,
            _tasks: tasks,
        }))
    }
}

/// Where to listen, from the configuration and the NATS connection.
fn listen_addr(ctx: &Context) -> Option<SocketAddr> {
    match ctx.config.direct.listen {
        DirectListen::Off => None,
        DirectListen::At(addr) => Some(addr),
        DirectListen::Auto => {
            let seen_as = ctx.client.server_info().client_ip;
            match seen_as.parse::<std::net::IpAddr>() {
                Ok(ip) => Some(SocketAddr::new(ip, 0)),
                Err(_) => {
                    tracing::warn!(
                        client_ip = %seen_as,
                        "the NATS server did not say which address it sees this process at: \
                         no direct front (set --direct to an address to have one)"
                    );
                    None
                }
            }
        }
    }
}

/// The endpoint clients are told: `advertise` (a host, or a host and port), or
/// the bound address.
fn advertised(advertise: Option<&str>, bound: SocketAddr) -> String {
    match advertise {
        None => bound.to_string(),
        Some(host_port)
            if host_port
                .rsplit_once(':')
                .is_some_and(|(_, port)| port.parse::<u16>().is_ok()) =>
        {
            host_port.to_owned()
        }
        Some(host) => format!("{host}:{}", bound.port()),
    }
}

/// What every connection of the front shares.
#[derive(Clone)]
struct Serving {
    gate: Gate,
    client: async_nats::Client,
    metrics: SubmasterMetrics,
    hello: Welcome,
}

/// The cluster and sub-cluster a hello must name, and who answers it.
#[derive(Clone)]
struct Welcome {
    cluster: String,
    subcluster: String,
    serving: DirectWelcome,
}

async fn accept(listener: TcpListener, serving: Serving) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    connections.spawn(serve(stream, peer, serving.clone()));
                }
                Err(error) => {
                    // Out of descriptors, or the like: wait a little, keep serving.
                    tracing::warn!(%error, "accepting a direct connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next() => {}
        }
    }
}

/// Why a connection ended.
#[derive(Debug, thiserror::Error)]
enum ConnectionEnd {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Frame(#[from] FrameError),
    #[error("no hello within {HELLO_TIMEOUT:?}")]
    NoHello,
    #[error("{0}")]
    Refused(String),
}

async fn serve(stream: TcpStream, peer: SocketAddr, serving: Serving) {
    let _ = stream.set_nodelay(true);
    serving.metrics.direct_connections.inc();
    let (read, write) = stream.into_split();
    let (out_tx, out_rx) = mpsc::unbounded_channel();
    let writer = tokio::spawn(write_replies(write, out_rx));
    let result = read_requests(read, out_tx, &serving).await;
    // The writer ends once every reply owed was sent (each holds a sender).
    let _ = writer.await;
    serving.metrics.direct_connections.dec();
    match result {
        Ok(()) => tracing::debug!(%peer, "direct connection closed"),
        Err(error) => tracing::debug!(%peer, %error, "direct connection ended"),
    }
}

/// Reads one frame's content into `buffer`; `false` at a clean end of stream.
async fn read_frame(
    reader: &mut BufReader<OwnedReadHalf>,
    buffer: &mut Vec<u8>,
) -> Result<bool, ConnectionEnd> {
    let mut prefix = [0u8; 4];
    match reader.read_exact(&mut prefix).await {
        Ok(_) => {}
        Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(false),
        Err(error) => return Err(error.into()),
    }
    let len = frame_len(prefix)?;
    buffer.resize(len, 0);
    reader.read_exact(buffer).await?;
    Ok(true)
}

async fn read_requests(
    read: OwnedReadHalf,
    out: mpsc::UnboundedSender<Outgoing>,
    serving: &Serving,
) -> Result<(), ConnectionEnd> {
    let mut reader = BufReader::with_capacity(READ_BUFFER, read);
    let mut frame = Vec::new();
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    match tokio::time::timeout(HELLO_TIMEOUT, read_frame(&mut reader, &mut frame)).await {
        Err(_) => return Err(ConnectionEnd::NoHello),
        Ok(Ok(false)) => return Ok(()),
        Ok(Ok(true)) => {}
        Ok(Err(error)) => return Err(error),
    }
    let hello = decode_hello(&frame)?;
    let answer = if hello.cluster.as_str() != serving.hello.cluster
        || hello.subcluster.as_str() != serving.hello.subcluster
    {
        Err(RpcError::invalid(format!(
            "this endpoint serves {}/{}, not {}/{}",
            serving.hello.cluster, serving.hello.subcluster, hello.cluster, hello.subcluster
        )))
    } else if let Some(why) = not_serving(serving) {
        Err(RpcError::new(RpcErrorCode::NotLeader, why))
    } else {
        Ok(serving.hello.serving.clone())
    };
    let refused = answer.as_ref().err().map(ToString::to_string);
    let body = rpc::encode(&RpcReply::<DirectWelcome>::from(answer)).unwrap_or_default();
    let mut welcome = Vec::new();
    push_welcome(&mut welcome, &body);
    let _ = out.send(Outgoing::Welcome(welcome));
    if let Some(why) = refused {
        return Err(ConnectionEnd::Refused(why));
    }
    loop {
        let slot = Arc::clone(&slots)
            .acquire_owned()
            .await
            .map_err(|_| ConnectionEnd::Refused("closing".into()))?;
        if !read_frame(&mut reader, &mut frame).await? {
            return Ok(());
        }
        let received = Instant::now();
        let request = decode_request(&frame)?;
        let reply = DirectReply {
            id: request.id,
            out: out.clone(),
            slot,
        };
        let op = match Op::from_name(request.op) {
            Some(op) if is_direct_op(op) => op,
            _ => {
                let error = RpcError::invalid(format!(
                    "{:?} is not an operation of direct connections; send it over NATS",
                    request.op
                ));
                reply.send(encode_error(&error));
                continue;
            }
        };
        if let Some(why) = not_serving(serving) {
            reply.send(encode_error(&RpcError::new(RpcErrorCode::NotLeader, why)));
            continue;
        }
        if let Some((ReplyTo::Direct(reply), body)) =
            serving
                .gate
                .admit(op, request.body, ReplyTo::Direct(reply), received)
        {
            reply.send(body);
        }
    }
}

/// Why this leader must not answer direct requests now, if it must not. Its
/// clients then drop the link and ask over NATS, which reaches whoever leads:
/// a leader whose lease is unconfirmed, or whose NATS connection is down, may
/// already be replaced, and must neither answer reads from a state a new leader
/// has moved past nor keep its nodes' pings away from the new leader. (Over
/// NATS such a leader answers `Busy`: there the new leader is reached too.)
fn not_serving(serving: &Serving) -> Option<&'static str> {
    if !serving.gate.is_ready() {
        Some("this leader's lease is unconfirmed; ask over NATS")
    } else if serving.client.connection_state() != async_nats::connection::State::Connected {
        Some("this leader lost its NATS connection; ask over NATS")
    } else {
        None
    }
}

async fn write_replies(mut write: OwnedWriteHalf, mut replies: mpsc::UnboundedReceiver<Outgoing>) {
    let mut batch = Vec::with_capacity(WRITE_BATCH);
    while let Some(first) = replies.recv().await {
        batch.clear();
        let mut written = Vec::new();
        let mut next = Some(first);
        while let Some(outgoing) = next.take() {
            match outgoing {
                Outgoing::Welcome(frame) => batch.extend_from_slice(&frame),
                Outgoing::Reply { id, body, slot } => {
                    push_reply(&mut batch, id, &body);
                    written.push(slot);
                }
            }
            if batch.len() < WRITE_BATCH {
                next = replies.try_recv().ok();
            }
        }
        if let Err(error) = write.write_all(&batch).await {
            tracing::debug!(%error, "writing direct replies");
            return;
        }
        // The slots are free once their replies are on the wire.
        drop(written);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_advertised_endpoint_keeps_a_given_port_and_adds_the_bound_one() {
        let bound: SocketAddr = "10.0.0.5:4100".parse().unwrap();
        assert_eq!(advertised(None, bound), "10.0.0.5:4100");
        assert_eq!(advertised(Some("sm.example"), bound), "sm.example:4100");
        assert_eq!(advertised(Some("sm.example:80"), bound), "sm.example:80");
        assert_eq!(advertised(Some("[::1]:80"), bound), "[::1]:80");
    }
}
