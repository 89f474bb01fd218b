//! The sending side of a direct connection, the same on both ends. A frame is
//! written by whoever sends it, straight into the socket, whenever nothing
//! waits to be written before it: no task hop, no wake-up of another thread.
//! What the socket does not take at once (its buffer is full) waits in the
//! backlog, in order, behind which every later frame queues, and the sender's
//! flusher task writes it as the socket drains.
//!
//! The connection's write side closes (the peer reads the end of the stream)
//! once the last [`Sender`] handle is dropped and its backlog is written: a
//! non-empty backlog keeps its sender alive until the flusher wrote it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::Notify;

/// Buffer capacity a backlog keeps once written; one that grew past it for a
/// large frame is given back.
const KEPT_CAPACITY: usize = 64 << 10;

/// What waits to be written.
#[derive(Debug)]
struct Backlog<H> {
    /// Bytes of frames not yet written, in order.
    bytes: Vec<u8>,
    /// What the frames in `bytes` hold until they are written (a server's
    /// request slots).
    held: Vec<H>,
    /// The sender itself while `bytes` is not empty, so that it outlives its
    /// other handles until the flusher wrote them.
    keep_alive: Option<Arc<Sender<H>>>,
}

/// One connection's sending side; see the module documentation.
#[derive(Debug)]
pub(crate) struct Sender<H> {
    socket: OwnedWriteHalf,
    backlog: Mutex<Backlog<H>>,
    /// Wakes the flusher: bytes in the backlog, or the sender gone.
    flush: Arc<Notify>,
    /// The connection failed, or the sender was closed: nothing more is sent.
    closed: AtomicBool,
}

impl<H: Send + 'static> Sender<H> {
    /// A sender on `socket`, with its flusher running on the current runtime.
    pub(crate) fn spawn(socket: OwnedWriteHalf) -> Arc<Self> {
        let flush = Arc::new(Notify::new());
        let sender = Arc::new(Self {
            socket,
            backlog: Mutex::new(Backlog {
                bytes: Vec::new(),
                held: Vec::new(),
                keep_alive: None,
            }),
            flush: Arc::clone(&flush),
            closed: AtomicBool::new(false),
        });
        tokio::spawn(flush_backlog(Arc::downgrade(&sender), flush));
        sender
    }

    /// Writes `frame` now, or after the backlog; `held` is dropped once the
    /// frame is written. `false` (and nothing of it written) when the
    /// connection failed or the sender was closed.
    pub(crate) fn send(self: &Arc<Self>, frame: &[u8], held: H) -> bool {
        let mut backlog = lock(&self.backlog);
        if self.closed.load(Ordering::Acquire) {
            return false;
        }
        if !backlog.bytes.is_empty() {
            backlog.bytes.extend_from_slice(frame);
            backlog.held.push(held);
            return true;
        }
        let written = match self.socket.try_write(frame) {
            Ok(written) => written,
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => 0,
            Err(_) => {
                self.closed.store(true, Ordering::Release);
                return false;
            }
        };
        if written < frame.len() {
            backlog.bytes.extend_from_slice(&frame[written..]);
            backlog.held.push(held);
            backlog.keep_alive = Some(Arc::clone(self));
            self.flush.notify_one();
        }
        true
    }

    /// Sends nothing more: frames not yet written are dropped, and the
    /// connection's write side closes once every handle is gone.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Release);
        let dropped = {
            let mut backlog = lock(&self.backlog);
            backlog.bytes.clear();
            backlog.held.clear();
            backlog.keep_alive.take()
        };
        drop(dropped);
    }

    /// Whether the connection failed or the sender was closed.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }
}

impl<H> Drop for Sender<H> {
    fn drop(&mut self) {
        // The flusher ends once it cannot reach the sender any more.
        self.flush.notify_one();
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Writes the backlog as the socket takes it, until the sender is gone.
async fn flush_backlog<H: Send + 'static>(sender: Weak<Sender<H>>, flush: Arc<Notify>) {
    loop {
        flush.notified().await;
        let Some(sender) = sender.upgrade() else {
            return;
        };
        write_backlog(&sender).await;
    }
}

/// Writes `sender`'s backlog until it is empty, or the connection fails (then
/// the sender is closed).
async fn write_backlog<H: Send + 'static>(sender: &Arc<Sender<H>>) {
    loop {
        if sender.is_closed() || sender.socket.writable().await.is_err() {
            sender.close();
            return;
        }
        let (done, released) = {
            let mut backlog = lock(&sender.backlog);
            if backlog.bytes.is_empty() {
                (true, (Vec::new(), backlog.keep_alive.take()))
            } else {
                match sender.socket.try_write(&backlog.bytes) {
                    Ok(written) => {
                        backlog.bytes.drain(..written);
                        if backlog.bytes.is_empty() {
                            backlog.bytes.shrink_to(KEPT_CAPACITY);
                            let held = std::mem::take(&mut backlog.held);
                            (true, (held, backlog.keep_alive.take()))
                        } else {
                            (false, (Vec::new(), None))
                        }
                    }
                    Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {
                        (false, (Vec::new(), None))
                    }
                    Err(_) => {
                        drop(backlog);
                        sender.close();
                        return;
                    }
                }
            }
        };
        // Dropped outside the lock: a held slot or the last handle may run code.
        drop(released);
        if done {
            return;
        }
    }
}
