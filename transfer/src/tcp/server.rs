//! The server side of the TCP backend: accepts connections and executes their
//! requests against the registered regions, in order, one connection per task.
//! Writes are received straight into the region and reads are sent straight from
//! it; a response leaves as soon as no further request is already buffered, so a
//! pipelined burst of small operations is answered in one system call.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};
use xxhash_rust::xxh3::xxh3_64;

use super::client::CONNECTION_ERROR_ID;
use crate::admission::{Admission, Asked};
use crate::error::{ErrorKind, TransferError};
use crate::frame::{self, Op, Response, REQUEST_FIXED_LEN, REQUEST_MAX_LEN};
use crate::region::RegionTable;

const BUFFER: usize = 256 * 1024;

/// A running server; dropping it (or [`ServerHandle::shutdown`]) stops accepting and
/// closes every connection.
#[derive(Debug)]
pub struct ServerHandle {
    local_addr: SocketAddr,
    task: Option<JoinHandle<()>>,
}

impl ServerHandle {
    /// The address the server listens on (the endpoint peers dial).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops the server and waits until its connections are closed.
    pub async fn shutdown(mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

impl ServerHandle {
    /// Runs `serve` (an accept loop) on `listener` in a task this handle owns.
    ///
    /// # Errors
    /// [`TransferError::Io`] when the listener has no local address.
    pub(crate) fn spawn_with<F, Fut>(listener: TcpListener, serve: F) -> Result<Self, TransferError>
    where
        F: FnOnce(TcpListener) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let local_addr = listener.local_addr().map_err(|source| TransferError::Io {
            what: "reading the listener's address",
            source,
        })?;
        Ok(Self {
            local_addr,
            task: Some(tokio::spawn(serve(listener))),
        })
    }
}

/// Starts serving `regions` on `listener`.
pub(crate) fn spawn(
    listener: TcpListener,
    regions: RegionTable,
    max_op_bytes: u64,
    admission: Arc<dyn Admission>,
) -> Result<ServerHandle, TransferError> {
    ServerHandle::spawn_with(listener, move |listener| async move {
        // Connection tasks live in this set: aborting the accept loop drops the set,
        // which aborts them all.
        let mut connections = JoinSet::new();
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, peer)) => {
                        let regions = regions.clone();
                        let admission = Arc::clone(&admission);
                        connections.spawn(async move {
                            if let Err(error) = serve_connection(stream, &regions, max_op_bytes, &*admission).await {
                                tracing::debug!(%peer, %error, "transfer connection closed");
                            }
                        });
                    }
                    Err(error) => accept_failed(&error).await,
                },
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
            }
        }
    })
}

/// Out of file descriptors and the like: back off instead of spinning.
pub(crate) async fn accept_failed(error: &std::io::Error) {
    tracing::warn!(%error, "accepting a transfer connection");
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
}

struct Connection {
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
    /// Responses not yet sent: they leave together once no request is buffered.
    pending: Vec<u8>,
}

impl Connection {
    /// Queues a response; one whose body would overflow the buffer leaves at once
    /// with what is queued, in one vectored write (no separate send of its header).
    async fn reply(&mut self, response: Response, body: &[u8]) -> std::io::Result<()> {
        self.pending.extend_from_slice(&response.encode());
        if self.pending.len() + body.len() <= BUFFER {
            self.pending.extend_from_slice(body);
            return Ok(());
        }
        super::write_all_vectored(&mut self.writer, &self.pending, body).await?;
        self.pending.clear();
        Ok(())
    }

    /// Sends every queued response.
    async fn flush(&mut self) -> std::io::Result<()> {
        if !self.pending.is_empty() {
            self.writer.write_all(&self.pending).await?;
            self.pending.clear();
        }
        Ok(())
    }

    async fn reply_error(&mut self, id: u64, error: &TransferError) -> std::io::Result<()> {
        let message = error.to_string();
        let mut message = message.as_bytes();
        message = &message[..message.len().min(frame::MAX_ERROR_MESSAGE as usize)];
        self.reply(Response::error(id, error.kind(), message), message)
            .await
    }

    /// Reads and drops `len` payload bytes of a refused write, keeping the stream in
    /// step.
    async fn skip(&mut self, len: u64) -> std::io::Result<()> {
        let copied =
            tokio::io::copy(&mut (&mut self.reader).take(len), &mut tokio::io::sink()).await?;
        if copied < len {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        Ok(())
    }
}

async fn serve_connection(
    stream: TcpStream,
    regions: &RegionTable,
    max_op_bytes: u64,
    admission: &dyn Admission,
) -> Result<(), TransferError> {
    let io = |source| TransferError::Io {
        what: "serving a transfer connection",
        source,
    };
    stream.set_nodelay(true).map_err(io)?;
    let (read_half, write_half) = stream.into_split();
    let mut conn = Connection {
        reader: BufReader::with_capacity(BUFFER, read_half),
        writer: write_half,
        pending: Vec::with_capacity(BUFFER),
    };
    let mut header = [0u8; REQUEST_MAX_LEN];
    loop {
        if conn.reader.buffer().is_empty() {
            conn.flush().await.map_err(io)?;
        }
        let mut fixed = [0u8; REQUEST_FIXED_LEN];
        match conn.reader.read_exact(&mut fixed).await {
            Ok(_) => {}
            Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(error) => return Err(io(error)),
        }
        let rest = match frame::request_rest_len(&fixed) {
            Ok(rest) => rest,
            Err(error) => return refuse_connection(&mut conn, error).await,
        };
        header[..REQUEST_FIXED_LEN].copy_from_slice(&fixed);
        let total = REQUEST_FIXED_LEN + rest;
        conn.reader
            .read_exact(&mut header[REQUEST_FIXED_LEN..total])
            .await
            .map_err(io)?;
        let request = match frame::decode_request(&header[..total]) {
            Ok(request) => request,
            Err(error) => return refuse_connection(&mut conn, error).await,
        };
        let admitted = admission
            .admit(&Asked {
                op: request.op,
                region: request.region,
                offset: request.offset,
                len: request.len,
                grant: request.grant,
            })
            .map_err(TransferError::Denied);
        match request.op {
            Op::Write => {
                if request.len > max_op_bytes {
                    // Skipping gigabytes is pointless (the client is broken or
                    // hostile): refuse and close, so the client drops the connection.
                    let error = too_large(request.len, max_op_bytes);
                    return refuse_connection(&mut conn, error).await;
                }
                let written = match admitted {
                    Ok(()) => {
                        serve_write(
                            &mut conn,
                            regions,
                            request.region,
                            request.offset,
                            request.len,
                            request.checked.then_some(request.checksum),
                        )
                        .await
                    }
                    // Nothing of a refused write touches a region; its payload is
                    // read past to keep the stream in step.
                    Err(error) => conn.skip(request.len).await.map_err(io).and(Err(error)),
                };
                if let Err(error) = written {
                    if error.kind() == ErrorKind::Io {
                        return Err(error);
                    }
                    conn.reply_error(request.id, &error).await.map_err(io)?;
                    continue;
                }
                conn.reply(Response::ok(request.id, 0, 0), &[])
                    .await
                    .map_err(io)?;
            }
            Op::Read => {
                let id = request.id;
                let read = match admitted {
                    Ok(()) => serve_read(&mut conn, regions, &request, max_op_bytes).await,
                    Err(error) => Err(error),
                };
                if let Err(error) = read {
                    if error.kind() == ErrorKind::Io {
                        return Err(error);
                    }
                    conn.reply_error(id, &error).await.map_err(io)?;
                }
            }
        }
    }
}

fn too_large(len: u64, max: u64) -> TransferError {
    TransferError::TooLarge {
        what: "operation",
        len,
        max,
    }
}

/// Tells the peer why its connection is being closed (a header that cannot be
/// trusted cannot be skipped), then closes it.
async fn refuse_connection(
    conn: &mut Connection,
    error: TransferError,
) -> Result<(), TransferError> {
    let _ = conn.reply_error(CONNECTION_ERROR_ID, &error).await;
    let _ = conn.flush().await;
    Err(error)
}

/// Receives a write's payload into its region. Refusals (unknown region, out of
/// bounds, bad checksum) come back as errors of those kinds with the stream in
/// step; a socket failure comes back as `Io`.
async fn serve_write(
    conn: &mut Connection,
    regions: &RegionTable,
    region: &str,
    offset: u64,
    len: u64,
    checksum: Option<u64>,
) -> Result<(), TransferError> {
    let io = |source| TransferError::Io {
        what: "receiving a write",
        source,
    };
    let segment = match regions
        .get(region)
        .and_then(|segment| segment.check(offset, len).map(|_| segment))
    {
        Ok(segment) => segment,
        Err(error) => {
            conn.skip(len).await.map_err(io)?;
            return Err(error);
        }
    };
    // SAFETY: the range was checked above; that no other operation touches an
    // overlapping range meanwhile is the placement protocol's guarantee (see the
    // region module).
    let dest = unsafe { segment.range_mut(offset, len)? };
    conn.reader.read_exact(dest).await.map_err(io)?;
    if checksum.is_some_and(|checksum| xxh3_64(dest) != checksum) {
        return Err(TransferError::Corrupt {
            what: "write payload",
        });
    }
    Ok(())
}

async fn serve_read(
    conn: &mut Connection,
    regions: &RegionTable,
    request: &frame::Request<'_>,
    max_op_bytes: u64,
) -> Result<(), TransferError> {
    if request.len > max_op_bytes {
        return Err(too_large(request.len, max_op_bytes));
    }
    let segment = regions.get(request.region)?;
    // SAFETY: checked by `range`; no concurrent writer of an overlapping range, as
    // for writes above.
    let source = unsafe { segment.range(request.offset, request.len)? };
    let checksum = if request.checked { xxh3_64(source) } else { 0 };
    let response = Response::ok(request.id, request.len, checksum);
    // Larger than the buffer: sent from the region with its header, not copied.
    conn.reply(response, source)
        .await
        .map_err(|source| TransferError::Io {
            what: "sending a read",
            source,
        })
}
