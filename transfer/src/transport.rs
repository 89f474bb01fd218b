//! The [`Transport`] trait every backend implements: register local segments so that
//! peers can reach them, and write or read ranges of a peer's segments in batches.

use std::sync::Arc;

use bytes::Bytes;
use futures::future::BoxFuture;

use crate::error::TransferError;
use crate::rdma::exchange::RemoteRegion;
use crate::region::{RegionId, Segment};

/// One write of a batch: `data` goes to `offset` of region `region` at the peer.
#[derive(Debug, Clone, Copy)]
pub struct WriteOp<'a> {
    /// The peer's region (a segment id).
    pub region: &'a str,
    /// Where in the region.
    pub offset: u64,
    /// The bytes, sent straight from this slice.
    pub data: &'a [u8],
    /// What allows the write at the peer (a grant's wire form; empty: nothing).
    pub grant: &'a [u8],
}

/// One read of a batch: `len` bytes at `offset` of region `region` at the peer.
#[derive(Debug, Clone, Copy)]
pub struct ReadOp<'a> {
    /// The peer's region (a segment id).
    pub region: &'a str,
    /// Where in the region.
    pub offset: u64,
    /// How many bytes.
    pub len: u64,
    /// What allows the read at the peer (a grant's wire form; empty: nothing).
    pub grant: &'a [u8],
}

/// One read of a batch into a caller buffer: `buf.len()` bytes at `offset`.
#[derive(Debug)]
pub struct ReadInto<'b> {
    /// The peer's region (a segment id).
    pub region: &'b str,
    /// Where in the region.
    pub offset: u64,
    /// Where the bytes land; its length is the length read.
    pub buf: &'b mut [u8],
    /// What allows the read at the peer (a grant's wire form; empty: nothing).
    pub grant: &'b [u8],
}

/// A way of moving bytes between this process's registered segments and a peer's.
///
/// Endpoints are the strings a node advertises when it mounts its segment (for TCP,
/// `host:port`). Every batch either completes as a whole or returns the first error;
/// a failed batch may have completed some of its writes, which is harmless because a
/// put is committed only after all its writes succeeded.
pub trait Transport: Send + Sync {
    /// The backend's name (`tcp`, `rdma`).
    fn backend(&self) -> &'static str;

    /// The largest single operation this transport accepts, in bytes.
    fn max_op_bytes(&self) -> u64;

    /// Makes a local segment reachable by peers of this transport.
    ///
    /// # Errors
    /// [`TransferError::Invalid`] when a segment of that id is already registered; a
    /// backend-specific error when the memory cannot be registered (RDMA).
    fn register(&self, segment: Arc<Segment>) -> Result<(), TransferError>;

    /// Stops serving a segment; running operations on it finish first.
    ///
    /// # Errors
    /// [`TransferError::UnknownRegion`] when it is not registered.
    fn unregister(&self, id: &RegionId) -> Result<Arc<Segment>, TransferError>;

    /// Records where a peer's region is, as its node advertised it out of band (a
    /// segment descriptor). Backends that address a peer's memory directly (RDMA)
    /// can then reach a region the peer registered after they connected; TCP names
    /// regions by id and ignores it.
    fn learn_region(&self, endpoint: &str, region: RemoteRegion) {
        let _ = (endpoint, region);
    }

    /// Registers caller memory `[ptr, ptr + len)` so that batches whose local bytes
    /// lie inside it move them without a copy: RDMA registers it as a memory
    /// region; TCP, which copies through the socket anyway, records nothing.
    ///
    /// # Safety
    /// The memory must stay mapped, and must not be freed while a batch uses it,
    /// until [`Transport::unregister_local`] for `ptr` returned.
    ///
    /// # Errors
    /// [`TransferError::Invalid`] for a null, empty or overlapping range; a
    /// backend-specific error when the memory cannot be registered.
    unsafe fn register_local(&self, ptr: *mut u8, len: usize) -> Result<(), TransferError> {
        let _ = (ptr, len);
        Ok(())
    }

    /// Ends the registration [`Transport::register_local`] made at `ptr` (once no
    /// running batch uses it); whether there was one. Backends that record nothing
    /// answer `false`.
    fn unregister_local(&self, ptr: *mut u8) -> bool {
        let _ = ptr;
        false
    }

    /// Writes every op of the batch to the peer at `endpoint`.
    ///
    /// # Errors
    /// The first failure: [`TransferError::Remote`] (unknown region, out of bounds,
    /// corrupted payload), [`TransferError::TooLarge`], or a connection failure
    /// (`Connect`, `Disconnected`, `Timeout`).
    fn write_batch<'a>(
        &'a self,
        endpoint: &'a str,
        ops: &'a [WriteOp<'a>],
    ) -> BoxFuture<'a, Result<(), TransferError>>;

    /// Reads every op of the batch from the peer at `endpoint` into the caller's
    /// buffers.
    ///
    /// # Errors
    /// As [`Transport::write_batch`], plus [`TransferError::Corrupt`] when received
    /// data fails its checksum.
    fn read_batch_into<'a, 'b: 'a>(
        &'a self,
        endpoint: &'a str,
        ops: &'a mut [ReadInto<'b>],
    ) -> BoxFuture<'a, Result<(), TransferError>>;

    /// Reads every op of the batch into fresh buffers, in op order.
    ///
    /// # Errors
    /// As [`Transport::read_batch_into`].
    fn read_batch<'a>(
        &'a self,
        endpoint: &'a str,
        ops: &'a [ReadOp<'a>],
    ) -> BoxFuture<'a, Result<Vec<Bytes>, TransferError>> {
        Box::pin(async move {
            let max = self.max_op_bytes();
            let mut buffers = Vec::with_capacity(ops.len());
            for op in ops {
                // Refused before allocating, so a bad length cannot exhaust memory.
                let len = usize::try_from(op.len)
                    .ok()
                    .filter(|_| op.len <= max)
                    .ok_or(TransferError::TooLarge {
                        what: "read",
                        len: op.len,
                        max,
                    })?;
                buffers.push(vec![0u8; len]);
            }
            let mut into: Vec<ReadInto<'_>> = ops
                .iter()
                .zip(buffers.iter_mut())
                .map(|(op, buf)| ReadInto {
                    region: op.region,
                    offset: op.offset,
                    buf: buf.as_mut_slice(),
                    grant: op.grant,
                })
                .collect();
            self.read_batch_into(endpoint, &mut into).await?;
            drop(into);
            Ok(buffers.into_iter().map(Bytes::from).collect())
        })
    }
}
