//! The server side of direct connections, shared by every direct front: a
//! [`DirectServer`] accepts connections on a listener, answers each hello
//! through its [`DirectService`], reads requests and hands each to the service
//! with a [`DirectReply`] to answer it by, now or later; a reply is written by
//! whoever sends it, straight into the socket unless earlier replies wait (the
//! `sender` module). Each connection holds at most [`IN_FLIGHT`] requests
//! unanswered: past that it stops reading, so a client that does not read its
//! replies stalls only itself. A connection that does not start with a hello
//! within [`HELLO_TIMEOUT`], sends bytes that are not frames, or is refused its
//! hello, is closed; the server keeps serving the others. A hello without the
//! server's [`DirectTicket`] (drawn when it starts serving, published by its
//! owner over NATS with the endpoint) is refused `Forbidden` before the service
//! sees it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hkvm_events::rpc::direct::{
    decode_hello, decode_request, frame_len, push_reply, push_welcome, DirectHello, DirectTicket,
    DirectWelcome, FrameError, TICKET_BYTES,
};
use hkvm_events::rpc::{self, RpcError, RpcErrorCode, RpcReply};
use rand::RngCore as _;
use tokio::io::{AsyncReadExt as _, BufReader};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::sender::Sender;

/// Requests one connection may have unanswered before it stops being read.
pub const IN_FLIGHT: usize = 1024;
/// How long a new connection has to send its hello.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// Bytes read from the socket at a time: small, since a server may hold ten
/// thousand connections (a larger frame is read straight into its buffer).
const READ_BUFFER: usize = 8 << 10;
/// Buffer capacity a connection keeps between frames or batches; one that grew
/// past it for a large frame is given back.
const KEPT_CAPACITY: usize = 64 << 10;

/// What a direct front serves.
pub trait DirectService: Send + Sync + 'static {
    /// The answer to a hello: who serves, or why this connection is refused.
    ///
    /// # Errors
    /// The reason the client is told before the connection closes.
    fn welcome(&self, hello: &DirectHello) -> Result<DirectWelcome, RpcError>;

    /// Takes one request of operation `op` (its subject token) with `body`,
    /// received at `received`; answers it through `reply`, now or later.
    fn request(&self, op: &str, body: &[u8], reply: DirectReply, received: Instant);

    /// A connection opened (`1`) or closed (`-1`), for metrics.
    fn connections(&self, delta: i64) {
        let _ = delta;
    }
}

/// One reply owed on a direct connection; sending it (or dropping it) frees the
/// connection's slot for another request.
#[derive(Debug)]
pub struct DirectReply {
    id: u64,
    sender: Arc<Sender<Option<OwnedSemaphorePermit>>>,
    slot: OwnedSemaphorePermit,
}

impl DirectReply {
    /// Writes `body` (an encoded `RpcReply`) on the connection: at once from
    /// the calling thread when nothing waits before it, else behind what does;
    /// nothing when the connection closed.
    pub fn send(self, body: Vec<u8>) {
        let mut frame = Vec::with_capacity(body.len() + 12);
        push_reply(&mut frame, self.id, &body);
        // The slot is free once the reply is on the wire.
        self.sender.send(&frame, Some(self.slot));
    }
}

/// A running direct front; dropping it closes the listener and stops reading
/// every connection (replies owed are still written, then each closes).
#[derive(Debug)]
pub struct DirectServer {
    local_addr: SocketAddr,
    ticket: DirectTicket,
    _tasks: JoinSet<()>,
}

impl DirectServer {
    /// Serves `service` on `listener` until dropped, to clients that show a
    /// ticket drawn now ([`DirectServer::ticket`]).
    ///
    /// # Errors
    /// When the listener has no local address.
    pub fn serve<S: DirectService>(
        listener: TcpListener,
        service: Arc<S>,
    ) -> std::io::Result<Self> {
        let local_addr = listener.local_addr()?;
        let mut random = [0u8; TICKET_BYTES];
        rand::rngs::OsRng.fill_bytes(&mut random);
        let ticket = DirectTicket::from_random(random);
        let ticketed = Arc::new(Ticketed {
            service,
            ticket: ticket.clone(),
        });
        let mut tasks = JoinSet::new();
        tasks.spawn(accept(listener, ticketed));
        Ok(Self {
            local_addr,
            ticket,
            _tasks: tasks,
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The ticket a client must show in its hello: publish it with the
    /// endpoint, over NATS only.
    pub fn ticket(&self) -> &DirectTicket {
        &self.ticket
    }
}

/// A service behind its ticket check.
struct Ticketed<S> {
    service: Arc<S>,
    ticket: DirectTicket,
}

impl<S: DirectService> DirectService for Ticketed<S> {
    fn welcome(&self, hello: &DirectHello) -> Result<DirectWelcome, RpcError> {
        if !self.ticket.admits(hello.ticket.as_ref()) {
            return Err(RpcError::new(
                RpcErrorCode::Forbidden,
                "no valid ticket: a client reads it over NATS with this endpoint",
            ));
        }
        self.service.welcome(hello)
    }

    fn request(&self, op: &str, body: &[u8], reply: DirectReply, received: Instant) {
        self.service.request(op, body, reply, received);
    }

    fn connections(&self, delta: i64) {
        self.service.connections(delta);
    }
}

/// The endpoint clients are told: `advertise` (a host, or a host and port), or
/// the bound address.
pub fn advertised(advertise: Option<&str>, bound: SocketAddr) -> String {
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

async fn accept<S: DirectService>(listener: TcpListener, service: Arc<S>) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    connections.spawn(serve(stream, peer, Arc::clone(&service)));
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
    #[error("hello refused: {0}")]
    Refused(String),
}

async fn serve<S: DirectService>(stream: TcpStream, peer: SocketAddr, service: Arc<S>) {
    let _ = stream.set_nodelay(true);
    service.connections(1);
    let (read, write) = stream.into_split();
    // Replies owed are still written after the reader ends: each holds the
    // sender, and the connection closes once the last one is written.
    let sender = Sender::spawn(write);
    let result = read_requests(read, sender, service.as_ref()).await;
    service.connections(-1);
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
    buffer.clear();
    buffer.shrink_to(KEPT_CAPACITY);
    buffer.resize(len, 0);
    reader.read_exact(buffer).await?;
    Ok(true)
}

async fn read_requests<S: DirectService>(
    read: OwnedReadHalf,
    sender: Arc<Sender<Option<OwnedSemaphorePermit>>>,
    service: &S,
) -> Result<(), ConnectionEnd> {
    let mut reader = BufReader::with_capacity(READ_BUFFER, read);
    let mut frame = Vec::new();
    match tokio::time::timeout(HELLO_TIMEOUT, read_frame(&mut reader, &mut frame)).await {
        Err(_) => return Err(ConnectionEnd::NoHello),
        Ok(Ok(false)) => return Ok(()),
        Ok(Ok(true)) => {}
        Ok(Err(error)) => return Err(error),
    }
    let answer = service.welcome(&decode_hello(&frame)?);
    let refused = answer.as_ref().err().map(ToString::to_string);
    let body = rpc::encode(&RpcReply::<DirectWelcome>::from(answer)).unwrap_or_default();
    let mut welcome = Vec::new();
    push_welcome(&mut welcome, &body);
    sender.send(&welcome, None);
    if let Some(why) = refused {
        return Err(ConnectionEnd::Refused(why));
    }
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
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
            sender: Arc::clone(&sender),
            slot,
        };
        service.request(request.op, request.body, reply, received);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::link::{DirectLink, LinkError, LinkFailure};
    use hkvm_events::{ClusterId, SubclusterId};

    #[test]
    fn the_advertised_endpoint_keeps_a_given_port_and_adds_the_bound_one() {
        let bound: SocketAddr = "10.0.0.5:4100".parse().unwrap();
        assert_eq!(advertised(None, bound), "10.0.0.5:4100");
        assert_eq!(advertised(Some("sm.example"), bound), "sm.example:4100");
        assert_eq!(advertised(Some("sm.example:80"), bound), "sm.example:80");
        assert_eq!(advertised(Some("[::1]:80"), bound), "[::1]:80");
    }

    /// Echoes each request's body back as its reply, later for `slow`.
    struct Echo;

    impl DirectService for Echo {
        fn welcome(&self, hello: &DirectHello) -> Result<DirectWelcome, RpcError> {
            match &hello.subcluster {
                Some(subcluster) if subcluster.as_str() == "mine" => Ok(DirectWelcome {
                    server: "echo".into(),
                    epoch: 7,
                }),
                _ => Err(RpcError::invalid("not mine")),
            }
        }

        fn request(&self, op: &str, body: &[u8], reply: DirectReply, _received: Instant) {
            let body = body.to_vec();
            if op == "slow" {
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    reply.send(body);
                });
            } else {
                reply.send(body);
            }
        }
    }

    fn hello(server: &DirectServer, subcluster: &str) -> DirectHello {
        DirectHello {
            cluster: ClusterId::new("c").unwrap(),
            subcluster: Some(SubclusterId::new(subcluster).unwrap()),
            ticket: Some(server.ticket().clone()),
        }
    }

    /// An echo server and a link to it.
    async fn echo_link() -> (DirectServer, Arc<DirectLink>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let server = DirectServer::serve(listener, Arc::new(Echo)).unwrap();
        let endpoint = server.local_addr().to_string();
        let link = DirectLink::connect(&endpoint, &hello(&server, "mine"))
            .await
            .unwrap();
        (server, Arc::new(link))
    }

    #[tokio::test]
    async fn requests_larger_than_the_socket_takes_at_once_go_out_whole_and_in_order() {
        let (server, link) = echo_link().await;
        // A dozen bodies of 900 KiB, sent at once, far past what a loopback
        // socket takes: most wait in the link's backlog, with small requests
        // between them.
        let mut calls = JoinSet::new();
        for i in 0..36u8 {
            let link = Arc::clone(&link);
            calls.spawn(async move {
                let len = if i % 3 == 0 {
                    900 << 10
                } else {
                    16 + usize::from(i)
                };
                let body: Vec<u8> = (0..len).map(|b| (b as u8).wrapping_add(i)).collect();
                let reply = link.call("fast", &body).await.unwrap();
                assert!(reply == body, "request {i} came back changed");
            });
        }
        while let Some(done) = calls.join_next().await {
            done.unwrap();
        }
        assert!(!link.is_closed());
        drop(server);
    }

    #[tokio::test]
    async fn a_server_dropped_still_writes_the_replies_it_owes_then_closes() {
        let (server, link) = echo_link().await;
        let slow = {
            let link = Arc::clone(&link);
            tokio::spawn(async move { link.call("slow", b"owed").await })
        };
        // Requests are read in order: once a later one is answered, the slow
        // one is in the service's hands.
        tokio::task::yield_now().await;
        assert_eq!(link.call("fast", b"after").await.unwrap(), b"after");
        drop(server);
        assert_eq!(slow.await.unwrap().unwrap(), b"owed");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !link.is_closed() {
            assert!(
                Instant::now() < deadline,
                "the connection stayed open after its last reply"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(link.call("fast", b"late").await, Err(LinkFailure::NotSent));
    }

    #[tokio::test]
    async fn a_closed_link_refuses_requests_without_sending_them() {
        let (_server, link) = echo_link().await;
        assert_eq!(link.call("fast", b"one").await.unwrap(), b"one");
        link.close();
        assert_eq!(link.call("fast", b"two").await, Err(LinkFailure::NotSent));
    }

    #[tokio::test]
    async fn pipelined_requests_get_their_own_replies_whatever_the_order() {
        let (server, link) = echo_link().await;
        let endpoint = server.local_addr().to_string();
        assert_eq!(link.welcome().epoch, 7);
        let mut calls = JoinSet::new();
        for i in 0..200u32 {
            let link = Arc::clone(&link);
            calls.spawn(async move {
                let op = if i % 3 == 0 { "slow" } else { "fast" };
                let body = i.to_be_bytes();
                assert_eq!(link.call(op, &body).await.unwrap(), body);
            });
        }
        while let Some(done) = calls.join_next().await {
            done.unwrap();
        }
        match DirectLink::connect(&endpoint, &hello(&server, "other")).await {
            Err(LinkError::Refused { .. }) => {}
            other => panic!("{other:?}"),
        }
        drop(server);
    }

    #[tokio::test]
    async fn a_hello_without_the_servers_ticket_is_refused_before_the_service_sees_it() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let server = DirectServer::serve(listener, Arc::new(Echo)).unwrap();
        let endpoint = server.local_addr().to_string();
        let other = DirectServer::serve(
            TcpListener::bind("127.0.0.1:0").await.unwrap(),
            Arc::new(Echo),
        )
        .unwrap();
        let without = DirectHello {
            ticket: None,
            ..hello(&server, "mine")
        };
        let another_servers = hello(&other, "mine");
        for refused in [without, another_servers] {
            match DirectLink::connect(&endpoint, &refused).await {
                Err(LinkError::Refused { message, .. }) => {
                    assert!(message.contains("ticket"), "{message}")
                }
                other => panic!("{other:?}"),
            }
        }
        let link = DirectLink::connect(&endpoint, &hello(&server, "mine"))
            .await
            .unwrap();
        assert_eq!(link.call("fast", b"in").await.unwrap(), b"in");
    }
}
