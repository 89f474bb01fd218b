//! The client side of the TCP backend: a pool of connections per endpoint, and the
//! pipelined execution of one batch on one connection (all requests go out while the
//! responses come back, on the two halves of the socket, so neither side can stall
//! the other however long the batch).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use xxhash_rust::xxh3::xxh3_64;

use super::TcpConfig;
use crate::error::{ErrorKind, TransferError};
use crate::frame::{self, Op, Request, Response, RESPONSE_LEN, STATUS_OK};
use crate::transport::{ReadInto, WriteOp};

/// Writes smaller than this are copied next to their header so that many small
/// operations leave in one system call; larger ones are sent from the caller's slice.
const COALESCE_BELOW: usize = 32 * 1024;
/// Responses are read through a buffer of this size, so that the answers to many
/// small operations arrive in one system call.
const RECEIVE_BUFFER: usize = 64 * 1024;
/// A read of at least this many bytes has its response header taken from the
/// socket alone (when nothing is buffered), so that its payload lands straight in
/// the caller's buffer instead of passing through the receive buffer.
const DIRECT_READ_FROM: usize = 8 * 1024;
/// The id of a response that refers to no request (the server could not trust the
/// request's header and is closing the connection).
pub(crate) const CONNECTION_ERROR_ID: u64 = u64::MAX;

/// One pooled connection and its next request id.
struct Conn {
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
    next_id: u64,
}

/// The connections to one endpoint.
struct EndpointPool {
    idle: Mutex<Vec<Conn>>,
    permits: Arc<Semaphore>,
}

/// Connections per endpoint, bounded, reused between batches.
pub(crate) struct Pool {
    config: TcpConfig,
    endpoints: Mutex<HashMap<String, Arc<EndpointPool>>>,
}

/// A connection checked out of the pool for one batch.
struct Lease {
    conn: Conn,
    reused: bool,
    pool: Arc<EndpointPool>,
    _permit: OwnedSemaphorePermit,
}

/// The operations of one batch.
pub(crate) enum Batch<'a, 'b> {
    /// Writes, sent from the caller's slices.
    Write(&'a [WriteOp<'a>]),
    /// Reads, received into the caller's buffers.
    Read(&'a mut [ReadInto<'b>]),
}

impl Batch<'_, '_> {
    fn len(&self) -> usize {
        match self {
            Self::Write(ops) => ops.len(),
            Self::Read(ops) => ops.len(),
        }
    }
}

fn disconnected(endpoint: &str, source: std::io::Error) -> TransferError {
    TransferError::Disconnected {
        endpoint: endpoint.to_owned(),
        source,
    }
}

impl Pool {
    pub(crate) fn new(config: TcpConfig) -> Self {
        Self {
            config,
            endpoints: Mutex::new(HashMap::new()),
        }
    }

    fn endpoint(&self, endpoint: &str) -> Arc<EndpointPool> {
        let mut map = self
            .endpoints
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        let pool = map.entry(endpoint.to_owned()).or_insert_with(|| {
            Arc::new(EndpointPool {
                idle: Mutex::new(Vec::new()),
                permits: Arc::new(Semaphore::new(
                    self.config.max_connections_per_endpoint.max(1),
                )),
            })
        });
        Arc::clone(pool)
    }

    async fn connect(&self, endpoint: &str) -> Result<Conn, TransferError> {
        let connecting = TcpStream::connect(endpoint);
        let stream = tokio::time::timeout(self.config.connect_timeout, connecting)
            .await
            .map_err(|_| TransferError::Timeout {
                what: "connect",
                endpoint: endpoint.to_owned(),
                after: self.config.connect_timeout,
            })?
            .map_err(|source| TransferError::Connect {
                endpoint: endpoint.to_owned(),
                source,
            })?;
        stream
            .set_nodelay(true)
            .map_err(|source| TransferError::Connect {
                endpoint: endpoint.to_owned(),
                source,
            })?;
        let (read_half, writer) = stream.into_split();
        Ok(Conn {
            reader: BufReader::with_capacity(RECEIVE_BUFFER, read_half),
            writer,
            next_id: 0,
        })
    }

    async fn checkout(&self, endpoint: &str, fresh: bool) -> Result<Lease, TransferError> {
        let pool = self.endpoint(endpoint);
        let permit = Arc::clone(&pool.permits)
            .acquire_owned()
            .await
            .map_err(|_| TransferError::Protocol("connection pool closed".into()))?;
        let idle = if fresh {
            None
        } else {
            pool.idle
                .lock()
                .unwrap_or_else(|poison| poison.into_inner())
                .pop()
        };
        let (conn, reused) = match idle {
            Some(conn) => (conn, true),
            None => (self.connect(endpoint).await?, false),
        };
        Ok(Lease {
            conn,
            reused,
            pool,
            _permit: permit,
        })
    }

    fn release(&self, lease: Lease) {
        let mut idle = lease
            .pool
            .idle
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        if idle.len() < self.config.max_idle_per_endpoint {
            idle.push(lease.conn);
        }
    }

    /// Runs one batch on a pooled connection, under the request timeout. A batch
    /// that fails because a *reused* connection turned out dead (the peer restarted
    /// since) is retried once on a fresh connection: writes and reads of fixed
    /// ranges are idempotent.
    pub(crate) async fn run(
        &self,
        endpoint: &str,
        mut batch: Batch<'_, '_>,
    ) -> Result<(), TransferError> {
        if batch.len() == 0 {
            return Ok(());
        }
        let checked = match batch {
            Batch::Write(_) => self.config.write_checksums,
            Batch::Read(_) => self.config.read_checksums,
        };
        let headers = encode_requests(&batch, self.config.max_op_bytes, checked)?;
        let deadline = self.config.request_timeout;
        let attempt = async {
            let mut fresh = false;
            loop {
                let mut lease = self.checkout(endpoint, fresh).await?;
                let outcome = exchange(&mut lease.conn, endpoint, &headers, &mut batch).await;
                match outcome {
                    Ok(remote_error) => {
                        self.release(lease);
                        return remote_error.map_or(Ok(()), Err);
                    }
                    Err(error)
                        if lease.reused && error.kind() == ErrorKind::Disconnected && !fresh =>
                    {
                        tracing::debug!(endpoint, %error, "pooled connection was dead, retrying");
                        fresh = true;
                    }
                    Err(error) => return Err(error),
                }
            }
        };
        tokio::time::timeout(deadline, attempt)
            .await
            .map_err(|_| TransferError::Timeout {
                what: "batch",
                endpoint: endpoint.to_owned(),
                after: deadline,
            })?
    }
}

/// Encoded request headers of a batch, one after the other, with their ends.
struct Headers {
    bytes: Vec<u8>,
    ends: Vec<usize>,
    checked: bool,
}

fn encode_requests(
    batch: &Batch<'_, '_>,
    max: u64,
    checked: bool,
) -> Result<Headers, TransferError> {
    let mut headers = Headers {
        bytes: Vec::with_capacity(batch.len() * 64),
        ends: Vec::with_capacity(batch.len()),
        checked,
    };
    let mut push = |op: Op, region: &str, offset: u64, len: u64, checksum: u64, grant: &[u8]| {
        if len > max {
            return Err(TransferError::TooLarge {
                what: "operation",
                len,
                max,
            });
        }
        // Ids are assigned per connection at send time; zero is a placeholder.
        Request {
            op,
            id: 0,
            region,
            offset,
            len,
            checksum,
            checked,
            grant,
        }
        .encode(&mut headers.bytes)?;
        headers.ends.push(headers.bytes.len());
        Ok(())
    };
    match batch {
        Batch::Write(ops) => {
            for op in ops.iter() {
                let checksum = if checked { xxh3_64(op.data) } else { 0 };
                push(
                    Op::Write,
                    op.region,
                    op.offset,
                    op.data.len() as u64,
                    checksum,
                    op.grant,
                )?;
            }
        }
        Batch::Read(ops) => {
            for op in ops.iter() {
                push(
                    Op::Read,
                    op.region,
                    op.offset,
                    op.buf.len() as u64,
                    0,
                    op.grant,
                )?;
            }
        }
    }
    Ok(headers)
}

/// Sends the batch and receives its responses at the same time. `Ok(Some(error))`
/// is an operation the peer refused or a payload that failed its checksum, with the
/// connection still in step; `Err` means the connection is unusable.
async fn exchange(
    conn: &mut Conn,
    endpoint: &str,
    headers: &Headers,
    batch: &mut Batch<'_, '_>,
) -> Result<Option<TransferError>, TransferError> {
    let first_id = conn.next_id;
    let count = batch.len();
    conn.next_id = conn.next_id.wrapping_add(count as u64) % CONNECTION_ERROR_ID;
    let Conn { reader, writer, .. } = conn;
    let (writes, mut reads) = match batch {
        Batch::Write(ops) => (Some(&**ops), None),
        Batch::Read(ops) => (None, Some(&mut **ops)),
    };
    let send = async {
        let mut pending: Vec<u8> = Vec::with_capacity(64 * 1024);
        let mut start = 0;
        for (index, &end) in headers.ends.iter().enumerate() {
            let id = first_id.wrapping_add(index as u64) % CONNECTION_ERROR_ID;
            let header_at = pending.len();
            pending.extend_from_slice(&headers.bytes[start..end]);
            stamp_id(&mut pending[header_at..], id);
            start = end;
            if let Some(ops) = writes {
                let data = ops[index].data;
                if data.len() < COALESCE_BELOW {
                    pending.extend_from_slice(data);
                } else {
                    super::write_all_vectored(writer, &pending, data).await?;
                    pending.clear();
                }
            }
            if pending.len() >= 64 * 1024 {
                writer.write_all(&pending).await?;
                pending.clear();
            }
        }
        writer.write_all(&pending).await?;
        writer.flush().await
    };
    let receive = async {
        let mut first_error = None;
        for index in 0..count {
            let expected = first_id.wrapping_add(index as u64) % CONNECTION_ERROR_ID;
            let buf = reads.as_mut().map(|ops| &mut *ops[index].buf);
            if let Some(error) =
                receive_one(reader, endpoint, index, expected, buf, headers.checked).await?
            {
                first_error.get_or_insert(error);
            }
        }
        Ok::<_, TransferError>(first_error)
    };
    let send = async { send.await.map_err(|source| disconnected(endpoint, source)) };
    let (_, outcome) = tokio::try_join!(send, receive)?;
    Ok(outcome)
}

/// Request ids are chosen when a batch meets its connection; the header check
/// covers them, so stamping re-seals the header.
fn stamp_id(header: &mut [u8], id: u64) {
    header[4..12].copy_from_slice(&id.to_le_bytes());
    let end = header.len() - 4;
    let check = (xxh3_64(&header[..end]) as u32).to_le_bytes();
    header[end..].copy_from_slice(&check);
}

async fn receive_one(
    reader: &mut BufReader<OwnedReadHalf>,
    endpoint: &str,
    index: usize,
    expected: u64,
    buf: Option<&mut [u8]>,
    checked: bool,
) -> Result<Option<TransferError>, TransferError> {
    let mut raw = [0u8; RESPONSE_LEN];
    let large = buf
        .as_ref()
        .is_some_and(|buf| buf.len() >= DIRECT_READ_FROM);
    let header = if large && reader.buffer().is_empty() {
        reader.get_mut().read_exact(&mut raw).await
    } else {
        reader.read_exact(&mut raw).await
    };
    header.map_err(|source| disconnected(endpoint, source))?;
    let response = Response::decode(&raw)?;
    if response.status != STATUS_OK {
        if response.len > frame::MAX_ERROR_MESSAGE {
            return Err(TransferError::Protocol("oversized error message".into()));
        }
        let mut message = vec![0u8; response.len as usize];
        reader
            .read_exact(&mut message)
            .await
            .map_err(|source| disconnected(endpoint, source))?;
        let error = TransferError::Remote {
            endpoint: endpoint.to_owned(),
            index,
            kind: ErrorKind::from_code(response.status),
            message: String::from_utf8_lossy(&message).into_owned(),
        };
        if response.id == CONNECTION_ERROR_ID {
            // The peer closes after this: report its reason, not the EOF that follows.
            return Err(error);
        }
        if response.id != expected {
            return Err(TransferError::Protocol(format!(
                "response id {} where {expected} was due",
                response.id
            )));
        }
        return Ok(Some(error));
    }
    if response.id != expected {
        return Err(TransferError::Protocol(format!(
            "response id {} where {expected} was due",
            response.id
        )));
    }
    let want = buf.as_ref().map_or(0, |buf| buf.len() as u64);
    if response.len != want {
        return Err(TransferError::Protocol(format!(
            "response of {} bytes to an operation of {want}",
            response.len
        )));
    }
    if let Some(buf) = buf {
        reader
            .read_exact(buf)
            .await
            .map_err(|source| disconnected(endpoint, source))?;
        if checked && xxh3_64(buf) != response.checksum {
            return Ok(Some(TransferError::Corrupt {
                what: "read payload",
            }));
        }
    }
    Ok(None)
}
