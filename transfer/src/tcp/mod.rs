//! The TCP backend, always available and the default: [`TcpTransport`] serves its
//! registered segments with [`TcpTransport::serve`] and reaches other nodes' segments
//! through a pool of pipelined connections.

mod client;
pub(crate) mod server;

use std::sync::Arc;
use std::time::Duration;

use std::io::IoSlice;

use futures::future::BoxFuture;
use tokio::io::{AsyncWrite, AsyncWriteExt as _};
use tokio::net::{TcpListener, ToSocketAddrs};

pub use server::ServerHandle;

use crate::admission::Admission;
use crate::error::TransferError;
use crate::region::{RegionId, RegionTable, Segment};
use crate::transport::{ReadInto, Transport, WriteOp};

/// Settings of a [`TcpTransport`], client and server side.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    /// How long a connection attempt may take.
    pub connect_timeout: Duration,
    /// How long one batch may take, from checking out a connection to its last
    /// response.
    pub request_timeout: Duration,
    /// The largest single operation, sent or served.
    pub max_op_bytes: u64,
    /// Connections open at once to one endpoint (batches beyond wait for one).
    pub max_connections_per_endpoint: usize,
    /// Idle connections kept per endpoint for later batches.
    pub max_idle_per_endpoint: usize,
    /// Checksum the payload of every write with xxh3-64: the node verifies it
    /// before acknowledging. Turning it off saves a pass over the bytes on each
    /// side; headers are always checked.
    pub write_checksums: bool,
    /// Checksum the payload of every read with xxh3-64: the node computes it, this
    /// side verifies it. Turn it off where the caller verifies every value it
    /// reads end to end anyway (the KV client checks each against the checksum
    /// recorded at its put, and tries another replica on a mismatch): it saves a
    /// pass over the bytes on each side, a quarter of a 1 MiB read's time here.
    pub read_checksums: bool,
}

impl Default for TcpConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(3),
            request_timeout: Duration::from_secs(30),
            max_op_bytes: 1 << 30,
            max_connections_per_endpoint: 16,
            max_idle_per_endpoint: 16,
            write_checksums: true,
            read_checksums: true,
        }
    }
}

/// The TCP transport: a table of local segments it serves, and a client pool.
pub struct TcpTransport {
    regions: RegionTable,
    pool: client::Pool,
    config: TcpConfig,
}

impl TcpTransport {
    /// A transport with no registered segment and no connection yet.
    pub fn new(config: TcpConfig) -> Self {
        Self {
            regions: RegionTable::new(),
            pool: client::Pool::new(config.clone()),
            config,
        }
    }

    /// The segments this transport serves.
    pub fn regions(&self) -> &RegionTable {
        &self.regions
    }

    /// Serves the registered segments (including those registered later) on
    /// `listener` until the handle is dropped, each operation only once
    /// `admission` admitted it.
    ///
    /// # Errors
    /// [`TransferError::Io`] when the listener has no local address.
    pub fn serve(
        &self,
        listener: TcpListener,
        admission: Arc<dyn Admission>,
    ) -> Result<ServerHandle, TransferError> {
        server::spawn(
            listener,
            self.regions.clone(),
            self.config.max_op_bytes,
            admission,
        )
    }

    /// Binds `addr` (port 0 picks a free port) and serves on it as
    /// [`TcpTransport::serve`] does.
    ///
    /// # Errors
    /// [`TransferError::Io`] when binding fails.
    pub async fn bind(
        &self,
        addr: impl ToSocketAddrs,
        admission: Arc<dyn Admission>,
    ) -> Result<ServerHandle, TransferError> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| TransferError::Io {
                what: "binding the transfer listener",
                source,
            })?;
        self.serve(listener, admission)
    }
}

impl Default for TcpTransport {
    fn default() -> Self {
        Self::new(TcpConfig::default())
    }
}

impl Transport for TcpTransport {
    fn backend(&self) -> &'static str {
        "tcp"
    }

    fn max_op_bytes(&self) -> u64 {
        self.config.max_op_bytes
    }

    fn register(&self, segment: Arc<Segment>) -> Result<(), TransferError> {
        self.regions.insert(segment)
    }

    fn unregister(&self, id: &RegionId) -> Result<Arc<Segment>, TransferError> {
        self.regions.remove(id)
    }

    fn write_batch<'a>(
        &'a self,
        endpoint: &'a str,
        ops: &'a [WriteOp<'a>],
    ) -> BoxFuture<'a, Result<(), TransferError>> {
        Box::pin(self.pool.run(endpoint, client::Batch::Write(ops)))
    }

    fn read_batch_into<'a, 'b: 'a>(
        &'a self,
        endpoint: &'a str,
        ops: &'a mut [ReadInto<'b>],
    ) -> BoxFuture<'a, Result<(), TransferError>> {
        Box::pin(self.pool.run(endpoint, client::Batch::Read(ops)))
    }
}

/// Writes `head` then `body` with as few system calls as the socket allows (one
/// `writev` when it takes both): a header never leaves in a packet of its own.
pub(crate) async fn write_all_vectored<W: AsyncWrite + Unpin>(
    writer: &mut W,
    head: &[u8],
    body: &[u8],
) -> std::io::Result<()> {
    let mut slices = [IoSlice::new(head), IoSlice::new(body)];
    let mut remaining = &mut slices[..];
    IoSlice::advance_slices(&mut remaining, 0);
    while !remaining.is_empty() {
        let written = writer.write_vectored(remaining).await?;
        if written == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut remaining, written);
    }
    Ok(())
}
