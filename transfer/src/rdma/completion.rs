//! Routing work completions to the batch that posted them. Every queue pair of a
//! transport completes into one completion queue, and several batches (to the same
//! peer or to different ones) are in flight at once, so whoever polls the queue
//! gets completions of everybody's work requests. Each work request carries its
//! batch's [`BatchTag`] in the high 32 bits of its `wr_id`; the
//! [`CompletionRouter`] files every polled completion in the inbox of that batch,
//! so a failure only ever fails the batch it belongs to. Completions of a batch that
//! already ended (late flushes after a failure, a signaled request that completed
//! after its batch gave up waiting) are logged and dropped. Pure Rust: tested
//! without a device.

use std::collections::hash_map::Entry;
use std::collections::HashMap;

use super::status::{status_name, WC_SUCCESS, WC_WR_FLUSH_ERR};
use crate::error::TransferError;

/// One polled work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The `wr_id` of the work request it completes.
    pub wr_id: u64,
    /// Its status (`enum ibv_wc_status`).
    pub status: u32,
    /// The vendor's error code (meaningful only on failure).
    pub vendor_err: u32,
}

/// The tag of one open batch: the high 32 bits of its work requests' `wr_id`s.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BatchTag(u32);

impl BatchTag {
    /// The `wr_id` of request `seq` (its position in the batch's plan).
    ///
    /// # Errors
    /// [`TransferError::Invalid`] for a batch of more than 2^32 work requests.
    pub fn wr_id(self, seq: u64) -> Result<u64, TransferError> {
        let seq = u32::try_from(seq).map_err(|_| {
            TransferError::Invalid("an RDMA batch has more than 2^32 work requests".into())
        })?;
        Ok((u64::from(self.0) << 32) | u64::from(seq))
    }

    /// The tag a `wr_id` was built from.
    pub fn of(wr_id: u64) -> Self {
        Self((wr_id >> 32) as u32)
    }
}

/// Where [`CompletionRouter::deliver`] put a completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// In the inbox of this open batch.
    Batch(BatchTag),
    /// Its batch has ended: logged and dropped.
    Orphan,
}

/// How a round of a batch stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoundState {
    /// Its signaled request has not completed yet, and nothing of the batch failed.
    Pending,
    /// Its signaled request completed successfully.
    Done,
    /// A request of this batch failed: the first failed completion of the batch.
    Failed(Completion),
    /// The batch is not open (never opened, or already closed).
    NotOpen,
}

#[derive(Debug, Default)]
struct Inbox {
    /// The first failed completion of the batch; later ones (flushes) follow from it.
    failure: Option<Completion>,
    /// Successful completions (only signaled requests produce them) not yet claimed.
    succeeded: Vec<u64>,
}

/// Files completions by the batch that posted them.
#[derive(Debug, Default)]
pub struct CompletionRouter {
    open: HashMap<u32, Inbox>,
    next: u32,
    orphans: u64,
}

impl CompletionRouter {
    /// A router with no open batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Opens a batch and returns its tag, distinct from every other open batch's.
    pub fn open(&mut self) -> BatchTag {
        // Fewer than 2^32 batches are ever open at once (each holds a staging
        // buffer), so a free tag is always found.
        loop {
            let tag = self.next;
            self.next = self.next.wrapping_add(1);
            if let Entry::Vacant(slot) = self.open.entry(tag) {
                slot.insert(Inbox::default());
                return BatchTag(tag);
            }
        }
    }

    /// Closes a batch: completions that still arrive for it are dropped. Returns
    /// whether it was open.
    pub fn close(&mut self, tag: BatchTag) -> bool {
        self.open.remove(&tag.0).is_some()
    }

    /// Files one completion in its batch's inbox, or drops it when its batch has
    /// ended.
    pub fn deliver(&mut self, completion: Completion) -> Delivery {
        let tag = BatchTag::of(completion.wr_id);
        let Some(inbox) = self.open.get_mut(&tag.0) else {
            self.orphans += 1;
            let status = status_name(completion.status);
            if matches!(completion.status, WC_SUCCESS | WC_WR_FLUSH_ERR) {
                tracing::debug!(
                    wr_id = completion.wr_id,
                    status,
                    "completion of a finished RDMA batch dropped"
                );
            } else {
                tracing::warn!(
                    wr_id = completion.wr_id,
                    status,
                    vendor_err = completion.vendor_err,
                    "failed completion of a finished RDMA batch dropped"
                );
            }
            return Delivery::Orphan;
        };
        if completion.status == WC_SUCCESS {
            inbox.succeeded.push(completion.wr_id);
        } else if inbox.failure.is_none() {
            inbox.failure = Some(completion);
        }
        Delivery::Batch(tag)
    }

    /// Whether the round of batch `tag` whose signaled request is `last` has ended.
    /// A failure anywhere in the batch fails the round (a queue pair completes in
    /// order, so nothing after a failed request succeeds). `Done` consumes the
    /// success, so each round is reported done once.
    pub fn round_state(&mut self, tag: BatchTag, last: u64) -> RoundState {
        let Some(inbox) = self.open.get_mut(&tag.0) else {
            return RoundState::NotOpen;
        };
        if let Some(failure) = inbox.failure {
            return RoundState::Failed(failure);
        }
        match inbox.succeeded.iter().position(|&wr_id| wr_id == last) {
            Some(at) => {
                inbox.succeeded.swap_remove(at);
                RoundState::Done
            }
            None => RoundState::Pending,
        }
    }

    /// How many batches are open.
    pub fn open_batches(&self) -> usize {
        self.open.len()
    }

    /// How many completions were dropped because their batch had ended.
    pub fn orphans(&self) -> u64 {
        self.orphans
    }

    #[cfg(test)]
    fn starting_at(next: u32) -> Self {
        Self {
            next,
            ..Self::default()
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::super::status::{completion_error, WC_REM_ACCESS_ERR, WC_RETRY_EXC_ERR};
    use super::*;
    use crate::ErrorKind;

    fn ok(wr_id: u64) -> Completion {
        Completion {
            wr_id,
            status: WC_SUCCESS,
            vendor_err: 0,
        }
    }

    fn failed(wr_id: u64, status: u32) -> Completion {
        Completion {
            wr_id,
            status,
            vendor_err: 0x42,
        }
    }

    #[test]
    fn wr_ids_carry_their_batch() {
        let tag = BatchTag(7);
        let wr_id = tag.wr_id(12).unwrap();
        assert_eq!(wr_id, (7 << 32) | 12);
        assert_eq!(BatchTag::of(wr_id), tag);
        assert_eq!(
            BatchTag(u32::MAX).wr_id(u64::from(u32::MAX)).unwrap(),
            u64::MAX
        );
        assert_eq!(
            tag.wr_id(1 << 32).unwrap_err().kind(),
            ErrorKind::Invalid,
            "a sequence number wider than 32 bits would spill into the tag"
        );
    }

    /// The defect this router fixes: peer A's queue pair broke and its flushed
    /// requests complete after A's batch already failed; the next batch (to peer B)
    /// polls the shared queue and must not take A's flush for its own.
    #[test]
    fn a_stale_flush_of_a_finished_batch_never_fails_the_next_batch() {
        let mut router = CompletionRouter::new();
        let a = router.open();
        let a_first = a.wr_id(0).unwrap();
        let a_last = a.wr_id(9).unwrap();
        assert_eq!(
            router.deliver(failed(a_first, WC_RETRY_EXC_ERR)),
            Delivery::Batch(a)
        );
        let RoundState::Failed(failure) = router.round_state(a, a_last) else {
            panic!("batch A should have failed");
        };
        assert_eq!(failure.status, WC_RETRY_EXC_ERR);
        assert!(router.close(a));

        let b = router.open();
        assert_ne!(a, b);
        let b_last = b.wr_id(3).unwrap();
        // A's remaining requests are flushed, after B started.
        for seq in 1..=9 {
            let flushed = failed(a.wr_id(seq).unwrap(), WC_WR_FLUSH_ERR);
            assert_eq!(router.deliver(flushed), Delivery::Orphan);
        }
        assert_eq!(router.orphans(), 9);
        assert_eq!(router.round_state(b, b_last), RoundState::Pending);
        assert_eq!(router.deliver(ok(b_last)), Delivery::Batch(b));
        assert_eq!(router.round_state(b, b_last), RoundState::Done);
    }

    #[test]
    fn concurrent_batches_each_get_only_their_own_completions() {
        let mut router = CompletionRouter::new();
        let a = router.open();
        let b = router.open();
        let c = router.open();
        // Completions of the three batches arrive interleaved in one poll.
        let polled = [
            ok(b.wr_id(4).unwrap()),
            failed(a.wr_id(2).unwrap(), WC_REM_ACCESS_ERR),
            failed(a.wr_id(3).unwrap(), WC_WR_FLUSH_ERR),
            ok(c.wr_id(0).unwrap()),
            ok(b.wr_id(9).unwrap()),
        ];
        let routed: Vec<Delivery> = polled.iter().map(|&c| router.deliver(c)).collect();
        assert_eq!(
            routed,
            [
                Delivery::Batch(b),
                Delivery::Batch(a),
                Delivery::Batch(a),
                Delivery::Batch(c),
                Delivery::Batch(b),
            ]
        );
        // A failed with its first error, not the flush that followed it.
        let RoundState::Failed(failure) = router.round_state(a, a.wr_id(5).unwrap()) else {
            panic!("batch A should have failed");
        };
        assert_eq!(failure.status, WC_REM_ACCESS_ERR);
        let error = completion_error("a:1", failure.status, failure.vendor_err);
        assert_eq!(error.kind(), ErrorKind::Rdma);
        // B's two rounds and C's one are done, each exactly once.
        assert_eq!(router.round_state(b, b.wr_id(4).unwrap()), RoundState::Done);
        assert_eq!(
            router.round_state(b, b.wr_id(4).unwrap()),
            RoundState::Pending
        );
        assert_eq!(router.round_state(b, b.wr_id(9).unwrap()), RoundState::Done);
        assert_eq!(router.round_state(c, c.wr_id(0).unwrap()), RoundState::Done);
        assert_eq!(router.orphans(), 0);
    }

    #[test]
    fn closed_batches_are_not_open_and_late_successes_are_dropped() {
        let mut router = CompletionRouter::new();
        let a = router.open();
        assert_eq!(router.open_batches(), 1);
        assert!(router.close(a));
        assert!(!router.close(a));
        assert_eq!(router.open_batches(), 0);
        // A signaled request that completed after its batch timed out.
        assert_eq!(router.deliver(ok(a.wr_id(0).unwrap())), Delivery::Orphan);
        assert_eq!(
            router.round_state(a, a.wr_id(0).unwrap()),
            RoundState::NotOpen
        );
    }

    #[test]
    fn tags_wrap_around_without_reusing_an_open_one() {
        let mut router = CompletionRouter::starting_at(u32::MAX - 1);
        let long_lived = router.open();
        assert_eq!(long_lived, BatchTag(u32::MAX - 1));
        let last = router.open();
        assert_eq!(last, BatchTag(u32::MAX));
        let wrapped = router.open();
        assert_eq!(wrapped, BatchTag(0));
        router.close(last);
        // Run the counter all the way round: the still-open tag is skipped.
        router.next = u32::MAX - 1;
        assert_eq!(router.open(), BatchTag(u32::MAX));
        assert_eq!(router.open(), BatchTag(1));
        assert_eq!(router.open_batches(), 4);
    }
}
