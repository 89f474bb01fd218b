//! How [`RdmaTransport`] runs a batch: it connects the peer and plans the ops
//! against its regions, moves the bytes that lie in registered caller memory
//! directly and the rest through a staging buffer, posts each round and waits for
//! its signaled completion, routed to the batch by its tag.

use std::sync::{Arc, Mutex};

use tokio::time::Instant;

use super::{lock, Peer, RdmaTransport, StagingLease};
use crate::error::TransferError;
use crate::rdma::batch::{needs_staging, plan, LocalBytes, PlanLimits, PlanOp, Round};
use crate::rdma::completion::{BatchTag, Completion, CompletionRouter, RoundState};
use crate::rdma::ffi::{Mr, PostRequest};
use crate::rdma::local::LocalRegion;
use crate::rdma::status::completion_error;
use crate::transport::{ReadInto, WriteOp};

/// How many completions one poll takes.
const POLL_BATCH: usize = 64;

/// A batch's tag, open in the router for as long as this lives.
struct OpenBatch<'a> {
    router: &'a Mutex<CompletionRouter>,
    tag: BatchTag,
}

impl<'a> OpenBatch<'a> {
    fn new(router: &'a Mutex<CompletionRouter>) -> Self {
        let tag = lock(router).open();
        Self { router, tag }
    }
}

impl Drop for OpenBatch<'_> {
    fn drop(&mut self) {
        // Completions that still arrive for this batch are dropped by the router.
        lock(self.router).close(self.tag);
    }
}

impl RdmaTransport {
    fn limits(&self) -> PlanLimits {
        PlanLimits {
            max_message: self.inner.port.max_message,
            staging_bytes: self.inner.staging.buffer_bytes(),
            max_outstanding: self.inner.config.queue_depth as usize,
        }
    }

    /// Posts one round and waits for its signaled completion. On failure the peer's
    /// queue pair is forgotten (it is in the error state): the next batch reconnects.
    async fn run_round(
        &self,
        endpoint: &str,
        peer: &Arc<Peer>,
        staging: Option<&StagingLease>,
        tag: BatchTag,
        round: &Round,
        opcode: u32,
    ) -> Result<(), TransferError> {
        let outcome = self
            .post_and_wait(endpoint, peer, staging, tag, round, opcode)
            .await;
        if outcome.is_err() {
            self.forget(endpoint, peer).await;
        }
        outcome
    }

    async fn post_and_wait(
        &self,
        endpoint: &str,
        peer: &Peer,
        staging: Option<&StagingLease>,
        tag: BatchTag,
        round: &Round,
        opcode: u32,
    ) -> Result<(), TransferError> {
        let Some(last) = round.requests.last() else {
            return Ok(());
        };
        let last = tag.wr_id(last.wr_id)?;
        let timeout = self.inner.config.completion_timeout;
        let deadline = Instant::now() + timeout;
        let timed_out = || TransferError::Timeout {
            what: "RDMA completion",
            endpoint: endpoint.to_owned(),
            after: timeout,
        };
        // A round has at most `queue_depth` requests (the plan's limit), as many
        // as the semaphore holds.
        let wanted = u32::try_from(round.requests.len()).unwrap_or(u32::MAX);
        let _slots = tokio::time::timeout_at(deadline, peer.slots.acquire_many(wanted))
            .await
            .map_err(|_| timed_out())?
            .map_err(|_| TransferError::Invalid("the peer's send queue is closed".into()))?;
        let requests = round
            .requests
            .iter()
            .map(|w| {
                let (local_addr, lkey) = match (w.local, staging) {
                    (LocalBytes::Direct(direct), _) => (direct.addr, direct.lkey),
                    (LocalBytes::Staged { offset }, Some(staging)) => {
                        (staging.memory().base_ptr() as u64 + offset, staging.lkey())
                    }
                    (LocalBytes::Staged { .. }, None) => {
                        return Err(TransferError::Invalid(
                            "a staged RDMA request without a staging buffer".into(),
                        ))
                    }
                };
                Ok(PostRequest {
                    wr_id: tag.wr_id(w.wr_id)?,
                    opcode,
                    local_addr,
                    lkey,
                    len: w.len,
                    remote_addr: w.remote_addr,
                    rkey: w.rkey,
                    signaled: w.signaled,
                })
            })
            .collect::<Result<Vec<_>, TransferError>>()?;
        peer.qp.post(&requests)?;
        let mut polled: Vec<Completion> = Vec::with_capacity(POLL_BATCH);
        loop {
            let state = {
                // Whoever polls files every completion with its own batch.
                let mut router = lock(&self.inner.router);
                self.inner.cq.poll(&mut polled, POLL_BATCH)?;
                for completion in polled.drain(..) {
                    router.deliver(completion);
                }
                router.round_state(tag, last)
            };
            match state {
                RoundState::Done => return Ok(()),
                RoundState::Failed(failed) => {
                    return Err(completion_error(endpoint, failed.status, failed.vendor_err))
                }
                RoundState::NotOpen => {
                    return Err(TransferError::Invalid(
                        "an RDMA round waited on a closed batch".into(),
                    ))
                }
                RoundState::Pending => {}
            }
            if Instant::now() >= deadline {
                return Err(timed_out());
            }
            tokio::task::yield_now().await;
        }
    }

    /// The registered caller memory holding each op's local bytes, where one does:
    /// those ops move without a copy. The returned references keep the
    /// registrations alive for the batch.
    fn resolve_direct(
        &self,
        ops: &mut [PlanOp<'_>],
        local: impl Fn(usize) -> (usize, usize),
    ) -> Vec<Arc<LocalRegion<Mr>>> {
        let mut held = Vec::new();
        if self.inner.local.is_empty() {
            return held;
        }
        for (index, op) in ops.iter_mut().enumerate() {
            let (ptr, len) = local(index);
            if let Some((region, direct)) = self.inner.local.find(ptr, len) {
                op.direct = Some(direct);
                held.push(region);
            }
        }
        held
    }

    /// Connects (or reuses) the peer and plans the batch against its regions: the
    /// ones it listed when it connected, then the ones its descriptors advertised.
    async fn prepare(
        &self,
        endpoint: &str,
        ops: &[PlanOp<'_>],
    ) -> Result<(Arc<Peer>, Vec<Round>), TransferError> {
        self.check_sizes(ops)?;
        let peer = self.peer(endpoint).await?;
        let listed = &peer.remote.regions;
        let missing = ops
            .iter()
            .any(|op| !listed.iter().any(|r| r.id.as_str() == op.region));
        let rounds = if missing {
            let mut regions = listed.clone();
            if let Some(learned) = lock(&self.inner.learned).get(endpoint) {
                regions.extend(
                    learned
                        .iter()
                        .filter(|r| !listed.iter().any(|l| l.id == r.id))
                        .cloned(),
                );
            }
            plan(ops, &regions, self.limits())?
        } else {
            plan(ops, listed, self.limits())?
        };
        Ok((peer, rounds))
    }

    /// A staging buffer for a batch that copies some of its bytes.
    async fn staging_for(&self, rounds: &[Round]) -> Result<Option<StagingLease>, TransferError> {
        if needs_staging(rounds) {
            Ok(Some(self.inner.staging.checkout().await?))
        } else {
            Ok(None)
        }
    }

    pub(super) async fn write(
        &self,
        endpoint: &str,
        ops: &[WriteOp<'_>],
    ) -> Result<(), TransferError> {
        let mut planned: Vec<PlanOp<'_>> = ops.iter().map(PlanOp::from).collect();
        let _held = self.resolve_direct(&mut planned, |i| {
            (ops[i].data.as_ptr() as usize, ops[i].data.len())
        });
        let (peer, rounds) = self.prepare(endpoint, &planned).await?;
        // Dropped without `release` on any error: the buffer is discarded, since
        // requests of a failed round may still be in flight.
        let staging = self.staging_for(&rounds).await?;
        let batch = OpenBatch::new(&self.inner.router);
        for round in &rounds {
            if let Some(staging) = &staging {
                for w in &round.requests {
                    if let Some(offset) = w.staging_offset() {
                        let start = w.op_offset as usize;
                        let bytes = &ops[w.op].data[start..start + w.len as usize];
                        staging.memory().write_at(offset, bytes)?;
                    }
                }
            }
            let opcode = rdma_sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
            self.run_round(endpoint, &peer, staging.as_ref(), batch.tag, round, opcode)
                .await?;
        }
        drop(batch);
        if let Some(staging) = staging {
            staging.release();
        }
        Ok(())
    }

    pub(super) async fn read(
        &self,
        endpoint: &str,
        ops: &mut [ReadInto<'_>],
    ) -> Result<(), TransferError> {
        let mut planned: Vec<PlanOp<'_>> = ops.iter().map(PlanOp::from).collect();
        let locals: Vec<(usize, usize)> = ops
            .iter_mut()
            .map(|op| (op.buf.as_mut_ptr() as usize, op.buf.len()))
            .collect();
        let _held = self.resolve_direct(&mut planned, |i| locals[i]);
        let (peer, rounds) = self.prepare(endpoint, &planned).await?;
        drop(planned);
        let staging = self.staging_for(&rounds).await?;
        let batch = OpenBatch::new(&self.inner.router);
        for round in &rounds {
            let opcode = rdma_sys::ibv_wr_opcode::IBV_WR_RDMA_READ;
            self.run_round(endpoint, &peer, staging.as_ref(), batch.tag, round, opcode)
                .await?;
            if let Some(staging) = &staging {
                for w in &round.requests {
                    if let Some(offset) = w.staging_offset() {
                        let start = w.op_offset as usize;
                        let out = &mut ops[w.op].buf[start..start + w.len as usize];
                        staging.memory().read_at(offset, out)?;
                    }
                }
            }
        }
        drop(batch);
        if let Some(staging) = staging {
            staging.release();
        }
        Ok(())
    }

    fn check_sizes(&self, ops: &[PlanOp<'_>]) -> Result<(), TransferError> {
        let max = self.inner.config.max_op_bytes;
        match ops.iter().find(|op| op.len > max) {
            Some(op) => Err(TransferError::TooLarge {
                what: "operation",
                len: op.len,
                max,
            }),
            None => Ok(()),
        }
    }
}
