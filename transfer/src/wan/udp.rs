//! WAN endpoints over UDP sockets: a [`UdpSink`] and a [`UdpSource`] sharing one
//! socket, so a [`super::WanSender`] and a [`super::WanReceiver`] can copy objects
//! between processes and hosts. An endpoint can emulate an impaired egress path
//! ([`Impairment`]: a constant one-way delay and a loss probability, as netem does)
//! for measurements on machines without traffic control.
//!
//! Datagrams a sink sends are delayed on a queue drained by one spawned task, in
//! send order; the task ends once the sink is dropped and what it queued is sent.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use tokio::net::UdpSocket;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::{PacketSink, PacketSource};
use crate::error::TransferError;

/// The largest datagram a source receives; longer ones are truncated by the kernel
/// (and then fail their checksum).
const RECV_BUFFER: usize = 65536;

/// The kernel socket buffers an endpoint asks for (the system may grant less): a
/// paced burst of a few milliseconds at hundreds of MB/s must fit.
const SOCKET_BUFFER: usize = 4 << 20;

/// Emulated impairment applied to datagrams leaving an endpoint (netem-like).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Impairment {
    /// Constant one-way delay added to every datagram (keeps their order).
    pub delay: Duration,
    /// Probability that a datagram is dropped instead of sent, 0.0 to 1.0.
    pub loss: f64,
    /// Seed of the loss decisions.
    pub seed: u64,
}

impl Impairment {
    /// No delay and no loss: datagrams leave as they are sent.
    pub fn none() -> Self {
        Self::default()
    }

    /// Whether this impairment changes nothing (no delay, no loss).
    pub fn is_none(&self) -> bool {
        self.delay.is_zero() && self.loss == 0.0
    }
}

/// Counters of one endpoint.
#[derive(Debug, Default)]
pub struct UdpStats {
    sent: AtomicU64,
    dropped: AtomicU64,
    send_errors: AtomicU64,
    received: AtomicU64,
    ignored: AtomicU64,
}

impl UdpStats {
    /// Datagrams written to the socket.
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// Datagrams dropped before the socket: by the emulated loss, or because no
    /// peer was known yet.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Datagrams the socket refused to send (lost).
    pub fn send_errors(&self) -> u64 {
        self.send_errors.load(Ordering::Relaxed)
    }

    /// Datagrams received from the peer.
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    /// Datagrams received from any other address, and discarded.
    pub fn ignored(&self) -> u64 {
        self.ignored.load(Ordering::Relaxed)
    }
}

/// The peer of an endpoint: set at creation, or by the first datagram received.
type Peer = Arc<OnceLock<SocketAddr>>;

/// A datagram waiting for its departure time.
type Queued = (Instant, SocketAddr, Bytes);

/// The sending half of a UDP endpoint.
#[derive(Debug)]
pub struct UdpSink {
    socket: Arc<UdpSocket>,
    impairment: Impairment,
    rng: StdRng,
    peer: Peer,
    queue: mpsc::UnboundedSender<Queued>,
    /// Datagrams queued and not yet sent by the task (a zero-delay sink sends
    /// directly only when nothing is queued, to keep the order).
    queued: Arc<AtomicU64>,
    stats: Arc<UdpStats>,
}

/// The receiving half of a UDP endpoint.
#[derive(Debug)]
pub struct UdpSource {
    socket: Arc<UdpSocket>,
    local: SocketAddr,
    peer: Peer,
    buf: Vec<u8>,
    stats: Arc<UdpStats>,
}

/// Both halves of one UDP endpoint. `peer = Some(addr)`: send to and accept only
/// from `addr`. `peer = None`: the source locks onto the sender of the first
/// datagram it receives and ignores (counts as `ignored`) datagrams from any other
/// address afterwards; until then the sink drops what it is asked to send (counted
/// as `dropped`).
///
/// The socket's kernel buffers are raised to 4 MiB where the system allows it. Must
/// be called inside a tokio runtime: it spawns the task that sends the sink's
/// datagrams.
///
/// # Errors
/// [`TransferError::Invalid`] for a loss probability outside `0.0..=1.0`;
/// [`TransferError::Io`] when the socket has no local address or no tokio runtime
/// is running.
pub fn udp_endpoint(
    socket: UdpSocket,
    peer: Option<SocketAddr>,
    impairment: Impairment,
) -> Result<(UdpSink, UdpSource), TransferError> {
    if !(0.0..=1.0).contains(&impairment.loss) {
        return Err(TransferError::Invalid(format!(
            "loss {} is not a probability",
            impairment.loss
        )));
    }
    let runtime = tokio::runtime::Handle::try_current().map_err(|error| TransferError::Io {
        what: "starting a UDP endpoint outside a tokio runtime",
        source: io::Error::other(error),
    })?;
    let local = socket.local_addr().map_err(|source| TransferError::Io {
        what: "reading the local address of a UDP socket",
        source,
    })?;
    raise_buffers(&socket);
    let socket = Arc::new(socket);
    let slot = Arc::new(OnceLock::new());
    if let Some(addr) = peer {
        let _ = slot.set(addr);
    }
    let stats = Arc::new(UdpStats::default());
    let queued = Arc::new(AtomicU64::new(0));
    let (queue, rx) = mpsc::unbounded_channel();
    runtime.spawn(drain(
        Arc::clone(&socket),
        rx,
        Arc::clone(&queued),
        Arc::clone(&stats),
    ));
    Ok((
        UdpSink {
            socket: Arc::clone(&socket),
            impairment,
            rng: StdRng::seed_from_u64(impairment.seed),
            peer: Arc::clone(&slot),
            queue,
            queued,
            stats: Arc::clone(&stats),
        },
        UdpSource {
            socket,
            local,
            peer: slot,
            buf: vec![0u8; RECV_BUFFER],
            stats,
        },
    ))
}

/// Best effort: asks for larger kernel buffers so bursts are not lost to overflow.
#[cfg(unix)]
fn raise_buffers(socket: &UdpSocket) {
    use std::os::fd::AsRawFd as _;
    let fd = socket.as_raw_fd();
    let size = libc::c_int::try_from(SOCKET_BUFFER).unwrap_or(libc::c_int::MAX);
    for option in [libc::SO_RCVBUF, libc::SO_SNDBUF] {
        // SAFETY: `fd` is an open socket owned by `socket` for the whole call, and
        // the option value points to a live `c_int` of the length passed.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                option,
                std::ptr::from_ref(&size).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            tracing::debug!(
                error = %io::Error::last_os_error(),
                "cannot raise a UDP socket buffer"
            );
        }
    }
}

#[cfg(not(unix))]
fn raise_buffers(_socket: &UdpSocket) {}

/// Sends queued datagrams when they are due, in order, until the sink is gone and
/// the queue is empty.
async fn drain(
    socket: Arc<UdpSocket>,
    mut rx: mpsc::UnboundedReceiver<Queued>,
    queued: Arc<AtomicU64>,
    stats: Arc<UdpStats>,
) {
    while let Some((due, addr, packet)) = rx.recv().await {
        if due > Instant::now() {
            tokio::time::sleep_until(due).await;
        }
        match socket.send_to(&packet, addr).await {
            Ok(_) => stats.sent.fetch_add(1, Ordering::Relaxed),
            Err(error) => {
                tracing::trace!(%error, %addr, "UDP send failed");
                stats.send_errors.fetch_add(1, Ordering::Relaxed)
            }
        };
        queued.fetch_sub(1, Ordering::Release);
    }
}

impl UdpSink {
    /// The endpoint's counters (shared with its source).
    pub fn stats(&self) -> Arc<UdpStats> {
        Arc::clone(&self.stats)
    }

    /// Sends directly when there is no delay and nothing queued; `false` when the
    /// datagram must be queued instead.
    fn try_send_now(&self, packet: &[u8], addr: SocketAddr) -> bool {
        if !self.impairment.delay.is_zero() || self.queued.load(Ordering::Acquire) != 0 {
            return false;
        }
        match self.socket.try_send_to(packet, addr) {
            Ok(_) => {
                self.stats.sent.fetch_add(1, Ordering::Relaxed);
                true
            }
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => false,
            Err(error) => {
                tracing::trace!(%error, %addr, "UDP send failed");
                self.stats.send_errors.fetch_add(1, Ordering::Relaxed);
                true
            }
        }
    }
}

impl PacketSink for UdpSink {
    /// Drops the datagram with the impairment's loss probability (or when no peer
    /// is known yet), otherwise sends it after the impairment's delay.
    ///
    /// # Errors
    /// [`TransferError::Disconnected`] when the sending task is gone (its runtime
    /// shut down).
    fn send_packet(&mut self, packet: Bytes) -> Result<(), TransferError> {
        let Some(&addr) = self.peer.get() else {
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        };
        if self.impairment.loss > 0.0 && self.rng.gen_bool(self.impairment.loss) {
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        if self.try_send_now(&packet, addr) {
            return Ok(());
        }
        let Some(due) = Instant::now().checked_add(self.impairment.delay) else {
            // A delay beyond the clock's range: the datagram would never leave.
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        };
        self.queued.fetch_add(1, Ordering::Release);
        self.queue.send((due, addr, packet)).map_err(|_| {
            self.queued.fetch_sub(1, Ordering::Release);
            TransferError::Disconnected {
                endpoint: addr.to_string(),
                source: io::ErrorKind::BrokenPipe.into(),
            }
        })
    }
}

impl UdpSource {
    /// The endpoint's counters (shared with its sink).
    pub fn stats(&self) -> Arc<UdpStats> {
        Arc::clone(&self.stats)
    }

    /// The address the endpoint's socket is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The peer: the one given at creation, or the sender of the first datagram
    /// received; `None` before that.
    pub fn peer(&self) -> Option<SocketAddr> {
        self.peer.get().copied()
    }

    /// The next datagram from the peer, waiting for it; datagrams from other
    /// addresses are counted as ignored and skipped.
    async fn recv(&mut self) -> Bytes {
        loop {
            let (len, from) = match self.socket.recv_from(&mut self.buf).await {
                Ok(received) => received,
                Err(error) => {
                    // Transient (an ICMP error reported on the socket, a full
                    // buffer): try again, without spinning.
                    tracing::trace!(%error, "UDP receive failed");
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    continue;
                }
            };
            let peer = *self.peer.get_or_init(|| from);
            if from != peer {
                self.stats.ignored.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            self.stats.received.fetch_add(1, Ordering::Relaxed);
            return Bytes::copy_from_slice(&self.buf[..len.min(self.buf.len())]);
        }
    }

    /// The next datagram from the peer, or `None` when none came within `timeout`.
    async fn recv_timeout(&mut self, timeout: Duration) -> Option<Bytes> {
        tokio::time::timeout(timeout, self.recv()).await.ok()
    }
}

impl PacketSource for UdpSource {
    fn recv_packet(
        &mut self,
        timeout: Duration,
    ) -> impl std::future::Future<Output = Option<Bytes>> + Send {
        self.recv_timeout(timeout)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::wan::{FecConfig, WanConfig, WanReceiver, WanSender};
    use crate::ErrorKind;

    async fn bound() -> UdpSocket {
        UdpSocket::bind("127.0.0.1:0").await.unwrap()
    }

    /// A sender endpoint aimed at a receiver endpoint that learns its peer.
    async fn pair(
        forward: Impairment,
        back: Impairment,
    ) -> ((UdpSink, UdpSource), (UdpSink, UdpSource)) {
        let (a, b) = (bound().await, bound().await);
        let b_addr = b.local_addr().unwrap();
        let sender = udp_endpoint(a, Some(b_addr), forward).unwrap();
        let receiver = udp_endpoint(b, None, back).unwrap();
        (sender, receiver)
    }

    #[tokio::test]
    async fn a_lossy_delayed_copy_arrives_byte_exact_with_fec_repairs() {
        let mut value = vec![0u8; 1 << 20];
        StdRng::seed_from_u64(11).fill(&mut value[..]);
        let forward = Impairment {
            delay: Duration::from_millis(20),
            loss: 0.01,
            seed: 1,
        };
        let back = Impairment { seed: 2, ..forward };
        let ((data_tx, feedback_rx), (feedback_tx, data_rx)) = pair(forward, back).await;
        let (out_stats, in_stats) = (data_tx.stats(), data_rx.stats());
        let config = WanConfig::default();
        let mut sender = WanSender::new(config, data_tx, feedback_rx).unwrap();
        let mut receiver = WanReceiver::new(config, data_rx, feedback_tx).unwrap();
        let copy = async { tokio::join!(sender.send(&value), receiver.receive()) };
        let (sent, received) = tokio::time::timeout(Duration::from_secs(20), copy)
            .await
            .unwrap();
        let sent = sent.unwrap();
        let (bytes, report) = received.unwrap();
        assert!(bytes == value, "the copy differs");
        assert!(report.fec_recoveries > 0, "{report:?} {sent:?}");
        assert!(out_stats.dropped() > 0);
        assert_eq!(out_stats.sent() + out_stats.dropped(), sent.packets);
        assert!(in_stats.received() > 0);
        assert_eq!(in_stats.ignored(), 0);
    }

    #[tokio::test]
    async fn the_source_locks_onto_its_first_sender() {
        let (a, c) = (bound().await, bound().await);
        let a_addr = a.local_addr().unwrap();
        let (mut sink, mut source) = udp_endpoint(bound().await, None, Impairment::none()).unwrap();
        let b_addr = source.local_addr();
        let stats = source.stats();
        assert_eq!(source.peer(), None);

        sink.send_packet(Bytes::from_static(b"nobody")).unwrap();
        assert_eq!(stats.dropped(), 1);

        a.send_to(b"a1", b_addr).await.unwrap();
        let got = source.recv_packet(Duration::from_secs(2)).await.unwrap();
        assert_eq!(&got[..], b"a1");
        assert_eq!(source.peer(), Some(a_addr));

        c.send_to(b"c1", b_addr).await.unwrap();
        a.send_to(b"a2", b_addr).await.unwrap();
        let got = source.recv_packet(Duration::from_secs(2)).await.unwrap();
        assert_eq!(&got[..], b"a2");
        assert_eq!(stats.ignored(), 1);
        assert_eq!(stats.received(), 2);
        c.send_to(b"c2", b_addr).await.unwrap();
        assert!(source
            .recv_packet(Duration::from_millis(100))
            .await
            .is_none());
        assert_eq!(stats.ignored(), 2);

        sink.send_packet(Bytes::from_static(b"b1")).unwrap();
        let mut buf = [0u8; 16];
        let (len, from) = a.recv_from(&mut buf).await.unwrap();
        assert_eq!((&buf[..len], from), (&b"b1"[..], b_addr));
        assert_eq!(stats.sent(), 1);

        // A fixed peer ignores everyone else from the start.
        let (_sink, mut fixed) =
            udp_endpoint(bound().await, Some(a_addr), Impairment::none()).unwrap();
        c.send_to(b"c3", fixed.local_addr()).await.unwrap();
        assert!(fixed
            .recv_packet(Duration::from_millis(100))
            .await
            .is_none());
        assert_eq!(fixed.stats().ignored(), 1);
        assert_eq!(fixed.peer(), Some(a_addr));
    }

    #[tokio::test]
    async fn total_loss_fails_with_timeouts_instead_of_hanging() {
        let all = Impairment {
            delay: Duration::from_millis(5),
            loss: 1.0,
            seed: 3,
        };
        let ((data_tx, feedback_rx), (feedback_tx, data_rx)) = pair(all, all).await;
        let out_stats = data_tx.stats();
        let config = WanConfig {
            fec: FecConfig {
                data_shards: 8,
                parity_shards: 2,
                shard_bytes: 1024,
            },
            feedback_timeout: Duration::from_millis(200),
            probes: 3,
            idle_timeout: Duration::from_secs(1),
            ..WanConfig::default()
        };
        let mut sender = WanSender::new(config, data_tx, feedback_rx).unwrap();
        let mut receiver = WanReceiver::new(config, data_rx, feedback_tx).unwrap();
        let value = vec![7u8; 64 << 10];
        let started = std::time::Instant::now();
        let copy = async { tokio::join!(sender.send(&value), receiver.receive()) };
        let (sent, received) = tokio::time::timeout(Duration::from_secs(5), copy)
            .await
            .unwrap();
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(sent.unwrap_err().kind(), ErrorKind::Timeout);
        assert_eq!(received.unwrap_err().kind(), ErrorKind::Timeout);
        assert_eq!(out_stats.sent(), 0);
        assert!(out_stats.dropped() > 0);
    }

    #[tokio::test]
    async fn invalid_loss_is_rejected() {
        for loss in [-0.1, 1.5, f64::NAN, f64::INFINITY] {
            let impairment = Impairment {
                loss,
                ..Impairment::none()
            };
            let error = udp_endpoint(bound().await, None, impairment).unwrap_err();
            assert_eq!(error.kind(), ErrorKind::Invalid, "{loss}");
        }
        assert!(Impairment::none().is_none());
        assert!(!Impairment {
            loss: 0.5,
            ..Impairment::none()
        }
        .is_none());
        let huge = Impairment {
            delay: Duration::MAX,
            ..Impairment::none()
        };
        let peer = bound().await.local_addr().unwrap();
        let (mut sink, _source) = udp_endpoint(bound().await, Some(peer), huge).unwrap();
        sink.send_packet(Bytes::from_static(b"never")).unwrap();
        assert_eq!(sink.stats().dropped(), 1);
    }
}
