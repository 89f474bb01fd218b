//! The in-process backend: [`LocalTransport`] moves the bytes of segments that live
//! in this very process by memory copy, with no socket in between. A client uses it
//! for the replicas on its own node (the embedded real client of a Python store, or
//! a real client serving its dummies), and TCP or RDMA for every other replica.
//! Values are still verified against their checksums end to end by the caller, as
//! they are on any other transport.

use std::sync::Arc;

use futures::future::BoxFuture;

use crate::error::TransferError;
use crate::region::{RegionId, RegionTable, Segment};
use crate::transport::{ReadInto, Transport, WriteOp};

/// Memory copies to and from this process's own segments. The endpoint of a batch
/// is ignored: which replicas are local is the caller's decision, by the endpoint
/// and segment its own node advertised.
#[derive(Debug, Default)]
pub struct LocalTransport {
    regions: RegionTable,
}

impl LocalTransport {
    /// A transport with no segment yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether segment `id` is registered here.
    pub fn holds(&self, id: &str) -> bool {
        self.regions.get(id).is_ok()
    }
}

impl Transport for LocalTransport {
    fn backend(&self) -> &'static str {
        "local"
    }

    fn max_op_bytes(&self) -> u64 {
        u64::MAX
    }

    fn register(&self, segment: Arc<Segment>) -> Result<(), TransferError> {
        self.regions.insert(segment)
    }

    fn unregister(&self, id: &RegionId) -> Result<Arc<Segment>, TransferError> {
        self.regions.remove(id)
    }

    fn write_batch<'a>(
        &'a self,
        _endpoint: &'a str,
        ops: &'a [WriteOp<'a>],
    ) -> BoxFuture<'a, Result<(), TransferError>> {
        let result = ops
            .iter()
            .try_for_each(|op| self.regions.get(op.region)?.write_at(op.offset, op.data));
        Box::pin(std::future::ready(result))
    }

    fn read_batch_into<'a, 'b: 'a>(
        &'a self,
        _endpoint: &'a str,
        ops: &'a mut [ReadInto<'b>],
    ) -> BoxFuture<'a, Result<(), TransferError>> {
        let result = ops
            .iter_mut()
            .try_for_each(|op| self.regions.get(op.region)?.read_at(op.offset, op.buf));
        Box::pin(std::future::ready(result))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::transport::ReadOp;

    #[tokio::test]
    async fn bytes_written_read_back_and_bad_ranges_are_typed_errors() {
        let local = LocalTransport::new();
        let segment = Segment::allocate(RegionId::new("seg").unwrap(), 1 << 16).unwrap();
        local.register(Arc::clone(&segment)).unwrap();
        assert!(local.holds("seg"));
        assert!(!local.holds("other"));
        let ops = [
            WriteOp {
                grant: &[],
                region: "seg",
                offset: 10,
                data: b"hello",
            },
            WriteOp {
                grant: &[],
                region: "seg",
                offset: 100,
                data: b"world",
            },
        ];
        local.write_batch("ignored", &ops).await.unwrap();
        let read = local
            .read_batch(
                "ignored",
                &[
                    ReadOp {
                        grant: &[],
                        region: "seg",
                        offset: 100,
                        len: 5,
                    },
                    ReadOp {
                        grant: &[],
                        region: "seg",
                        offset: 10,
                        len: 5,
                    },
                ],
            )
            .await
            .unwrap();
        assert_eq!(read, [&b"world"[..], &b"hello"[..]]);
        let past_end = [WriteOp {
            grant: &[],
            region: "seg",
            offset: (1 << 16) - 2,
            data: b"abc",
        }];
        assert!(matches!(
            local.write_batch("ignored", &past_end).await,
            Err(TransferError::OutOfBounds { .. })
        ));
        let mut buf = [0u8; 3];
        let mut unknown = [ReadInto {
            grant: &[],
            region: "other",
            offset: 0,
            buf: &mut buf,
        }];
        assert!(matches!(
            local.read_batch_into("ignored", &mut unknown).await,
            Err(TransferError::UnknownRegion { .. })
        ));
        local.unregister(&RegionId::new("seg").unwrap()).unwrap();
        assert!(!local.holds("seg"));
    }
}
