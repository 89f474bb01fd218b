//! Registered memory and the pool of staging buffers.
//!
//! A memory registration pins pages and lets the NIC reach them, so it must end
//! *before* the memory it covers is unmapped: otherwise, for a moment, a
//! registration points at freed pages. [`Registered`] owns both halves and its
//! `Drop` ends the registration first and releases the memory second, whatever the
//! order of its fields.
//!
//! A batch copies through a staging buffer. The [`StagingPool`] holds up to
//! `max_buffers` registered buffers, created on demand: a batch checks one out for
//! its whole life, so that many batches run at once and a batch waits only when all
//! are busy. A batch that completed cleanly hands its buffer back with
//! [`Lease::release`]; a lease dropped without that (a failed, timed-out or
//! cancelled batch, whose requests may still be in flight) discards its buffer:
//! the registration ends first, so a late transfer into it fails at the NIC
//! instead of landing in the next batch's data, then the memory is unmapped and
//! the pool may create a fresh buffer in its place.
//!
//! The registration itself is behind [`Registrar`] (the protection domain with the
//! `rdma` feature; a fake in tests), so all of this is tested without a device.

use super::access::Access;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore, TryAcquireError};

use crate::error::TransferError;
use crate::region::{RegionId, Segment};

/// The keys of a memory registration.
pub trait MemoryKeys {
    /// The local key (for scatter/gather entries of this side's requests).
    fn lkey(&self) -> u32;
    /// The remote key (what a peer puts in its requests).
    fn rkey(&self) -> u32;
}

/// Something that registers memory with a device. Dropping the returned
/// registration deregisters it.
pub trait Registrar: Send + Sync + 'static {
    /// A live registration.
    type Registration: MemoryKeys + Send + Sync + 'static;

    /// Registers the whole of `memory` with `access`.
    ///
    /// # Safety
    /// The mapping of `memory` must outlive the returned registration: the caller
    /// drops the registration before the last reference to `memory`.
    /// [`Registered::new`] is the safe way to call this.
    ///
    /// # Errors
    /// The device's refusal.
    unsafe fn register(
        &self,
        memory: &Arc<Segment>,
        access: Access,
    ) -> Result<Self::Registration, TransferError>;
}

/// Memory together with its registration; the registration always ends first.
pub struct Registered<M> {
    /// `Some` from construction until `Drop` or [`Registered::into_memory`].
    registration: Option<M>,
    memory: Arc<Segment>,
}

impl<M> Registered<M> {
    /// Registers `memory` with `registrar`, granting `access`.
    ///
    /// # Errors
    /// The registrar's.
    pub fn new<R>(
        registrar: &R,
        memory: Arc<Segment>,
        access: Access,
    ) -> Result<Self, TransferError>
    where
        R: Registrar<Registration = M>,
    {
        // SAFETY: the registration is stored next to an `Arc` of the memory, and
        // both `Drop` and `into_memory` end the registration before that `Arc` goes.
        let registration = unsafe { registrar.register(&memory, access)? };
        Ok(Self {
            registration: Some(registration),
            memory,
        })
    }

    /// The registered memory.
    pub fn memory(&self) -> &Arc<Segment> {
        &self.memory
    }

    /// The registration.
    pub fn registration(&self) -> &M {
        self.registration
            .as_ref()
            .expect("a registration lives as long as its Registered")
    }

    /// Ends the registration and hands the memory back.
    pub fn into_memory(mut self) -> Arc<Segment> {
        drop(self.registration.take());
        Arc::clone(&self.memory)
    }
}

impl<M> Drop for Registered<M> {
    fn drop(&mut self) {
        // Deregister first; `memory` is released afterwards, with the fields.
        drop(self.registration.take());
    }
}

impl<M: MemoryKeys> Registered<M> {
    /// The local key.
    pub fn lkey(&self) -> u32 {
        self.registration().lkey()
    }

    /// The remote key.
    pub fn rkey(&self) -> u32 {
        self.registration().rkey()
    }
}

type Buffer<R> = Registered<<R as Registrar>::Registration>;

struct Shared<R: Registrar> {
    registrar: R,
    buffer_bytes: u64,
    max_buffers: usize,
    /// One permit per buffer that may exist; a lease holds one.
    permits: Arc<Semaphore>,
    idle: Mutex<Vec<Buffer<R>>>,
    names: AtomicU64,
    created: AtomicU64,
    discarded: AtomicU64,
}

impl<R: Registrar> Shared<R> {
    fn idle(&self) -> std::sync::MutexGuard<'_, Vec<Buffer<R>>> {
        self.idle
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }
}

/// A bounded pool of registered staging buffers of one size.
pub struct StagingPool<R: Registrar> {
    shared: Arc<Shared<R>>,
}

impl<R: Registrar> Clone for StagingPool<R> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

/// What a pool holds right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolStats {
    /// Buffers waiting in the pool.
    pub idle: usize,
    /// Buffers checked out.
    pub leased: usize,
    /// Buffers registered since the pool was made.
    pub created: u64,
    /// Buffers discarded (leases dropped without a release).
    pub discarded: u64,
}

impl<R: Registrar> StagingPool<R> {
    /// A pool of at most `max_buffers` buffers of `buffer_bytes` each, none
    /// registered yet.
    ///
    /// # Errors
    /// [`TransferError::Invalid`] for a zero size or count, or a count larger than
    /// a semaphore holds.
    pub fn new(registrar: R, buffer_bytes: u64, max_buffers: usize) -> Result<Self, TransferError> {
        if buffer_bytes == 0 || max_buffers == 0 || max_buffers > Semaphore::MAX_PERMITS {
            return Err(TransferError::Invalid(format!(
                "a staging pool needs a positive buffer size and count \
                 (got {max_buffers} buffers of {buffer_bytes} bytes)"
            )));
        }
        Ok(Self {
            shared: Arc::new(Shared {
                registrar,
                buffer_bytes,
                max_buffers,
                permits: Arc::new(Semaphore::new(max_buffers)),
                idle: Mutex::new(Vec::new()),
                names: AtomicU64::new(0),
                created: AtomicU64::new(0),
                discarded: AtomicU64::new(0),
            }),
        })
    }

    /// Registers up to `count` buffers now and leaves them idle, so that a
    /// registration failure shows when the transport opens rather than at its first
    /// batch.
    ///
    /// # Errors
    /// The first registration failure.
    pub fn prefill(&self, count: usize) -> Result<(), TransferError> {
        let mut leases = Vec::new();
        for _ in 0..count.min(self.shared.max_buffers) {
            match self.try_checkout()? {
                Some(lease) => leases.push(lease),
                None => break,
            }
        }
        leases.into_iter().for_each(Lease::release);
        Ok(())
    }

    /// Checks a buffer out, waiting while all `max_buffers` are leased.
    ///
    /// # Errors
    /// The registration failure when a new buffer had to be created.
    pub async fn checkout(&self) -> Result<Lease<R>, TransferError> {
        let permit = Arc::clone(&self.shared.permits)
            .acquire_owned()
            .await
            .map_err(|_| TransferError::Invalid("the staging pool is closed".into()))?;
        self.lease(permit)
    }

    /// Checks a buffer out if one is free or may be created, without waiting.
    ///
    /// # Errors
    /// The registration failure when a new buffer had to be created.
    pub fn try_checkout(&self) -> Result<Option<Lease<R>>, TransferError> {
        match Arc::clone(&self.shared.permits).try_acquire_owned() {
            Ok(permit) => self.lease(permit).map(Some),
            Err(TryAcquireError::NoPermits) => Ok(None),
            Err(TryAcquireError::Closed) => {
                Err(TransferError::Invalid("the staging pool is closed".into()))
            }
        }
    }

    fn lease(&self, permit: OwnedSemaphorePermit) -> Result<Lease<R>, TransferError> {
        // Holding a permit means fewer than `max_buffers` are leased, so either an
        // idle buffer exists or there is room for a new one.
        let idle = self.shared.idle().pop();
        let buffer = match idle {
            Some(buffer) => buffer,
            None => {
                let number = self.shared.names.fetch_add(1, Ordering::Relaxed);
                // On failure `permit` drops on return: the slot is free again.
                let buffer = Segment::allocate(
                    RegionId::new(format!("staging-{number}"))?,
                    self.shared.buffer_bytes,
                )
                // Staging buffers are this process's own: no peer reaches them.
                .and_then(|memory| {
                    Registered::new(&self.shared.registrar, memory, Access::Local)
                })?;
                self.shared.created.fetch_add(1, Ordering::Relaxed);
                buffer
            }
        };
        Ok(Lease {
            buffer: Some(buffer),
            shared: Arc::clone(&self.shared),
            _permit: permit,
        })
    }

    /// The size of each buffer.
    pub fn buffer_bytes(&self) -> u64 {
        self.shared.buffer_bytes
    }

    /// The most buffers that exist at once.
    pub fn max_buffers(&self) -> usize {
        self.shared.max_buffers
    }

    /// What the pool holds right now.
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            idle: self.shared.idle().len(),
            leased: self.shared.max_buffers - self.shared.permits.available_permits(),
            created: self.shared.created.load(Ordering::Relaxed),
            discarded: self.shared.discarded.load(Ordering::Relaxed),
        }
    }
}

/// A checked-out staging buffer. [`Lease::release`] returns it to the pool;
/// dropping it without a release discards it (deregistered, then unmapped).
pub struct Lease<R: Registrar> {
    /// `Some` until released or dropped.
    buffer: Option<Buffer<R>>,
    shared: Arc<Shared<R>>,
    /// Released after `Drop::drop` ran, i.e. after the buffer is back in the pool.
    _permit: OwnedSemaphorePermit,
}

impl<R: Registrar> Lease<R> {
    fn buffer(&self) -> &Buffer<R> {
        self.buffer
            .as_ref()
            .expect("a lease holds its buffer until released or dropped")
    }

    /// The buffer's memory.
    pub fn memory(&self) -> &Arc<Segment> {
        self.buffer().memory()
    }

    /// The local key of its registration.
    pub fn lkey(&self) -> u32 {
        self.buffer().lkey()
    }

    /// Returns the buffer to the pool: for a batch whose requests all completed.
    pub fn release(mut self) {
        if let Some(buffer) = self.buffer.take() {
            self.shared.idle().push(buffer);
        }
    }
}

impl<R: Registrar> Drop for Lease<R> {
    fn drop(&mut self) {
        if let Some(buffer) = self.buffer.take() {
            self.shared.discarded.fetch_add(1, Ordering::Relaxed);
            drop(buffer);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::sync::atomic::{AtomicBool, AtomicU32};
    use std::sync::Weak;
    use std::time::Duration;

    use super::*;
    use crate::ErrorKind;

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Event {
        Registered { key: u32, len: u64, access: Access },
        Deregistered { key: u32, memory_mapped: bool },
    }

    /// Registers nothing; records every registration and deregistration, and
    /// whether the memory was still mapped when its registration ended.
    #[derive(Clone, Default)]
    struct Fake {
        log: Arc<Mutex<Vec<Event>>>,
        next_key: Arc<AtomicU32>,
        fail: Arc<AtomicBool>,
    }

    impl Fake {
        fn events(&self) -> Vec<Event> {
            self.log.lock().unwrap().clone()
        }

        fn count(&self, registered: bool) -> usize {
            self.events()
                .iter()
                .filter(|e| matches!(e, Event::Registered { .. }) == registered)
                .count()
        }
    }

    struct FakeMr {
        key: u32,
        memory: Weak<Segment>,
        log: Arc<Mutex<Vec<Event>>>,
    }

    impl MemoryKeys for FakeMr {
        fn lkey(&self) -> u32 {
            self.key
        }
        fn rkey(&self) -> u32 {
            self.key | 0x8000_0000
        }
    }

    impl Drop for FakeMr {
        fn drop(&mut self) {
            self.log.lock().unwrap().push(Event::Deregistered {
                key: self.key,
                memory_mapped: self.memory.strong_count() > 0,
            });
        }
    }

    impl Registrar for Fake {
        type Registration = FakeMr;

        unsafe fn register(
            &self,
            memory: &Arc<Segment>,
            access: Access,
        ) -> Result<FakeMr, TransferError> {
            if self.fail.load(Ordering::Relaxed) {
                return Err(TransferError::Rdma {
                    call: "ibv_reg_mr",
                    reason: "Cannot allocate memory".into(),
                });
            }
            let key = self.next_key.fetch_add(1, Ordering::Relaxed) + 1;
            self.log.lock().unwrap().push(Event::Registered {
                key,
                len: memory.len(),
                access,
            });
            Ok(FakeMr {
                key,
                memory: Arc::downgrade(memory),
                log: Arc::clone(&self.log),
            })
        }
    }

    fn memory(len: u64) -> Arc<Segment> {
        Segment::allocate(RegionId::new("mem").unwrap(), len).unwrap()
    }

    /// The defect this type fixes: the memory was released before its
    /// registration ended. Fails if `Registered` ever drops its memory first
    /// (fields reordered, `Drop` removed).
    #[test]
    fn a_registration_ends_while_its_memory_is_still_mapped() {
        let fake = Fake::default();
        let mem = memory(4096);
        let weak = Arc::downgrade(&mem);
        let registered = Registered::new(&fake, mem, Access::Served).unwrap();
        assert_eq!(registered.lkey(), 1);
        assert_eq!(registered.rkey(), 0x8000_0001);
        assert_eq!(registered.memory().len(), 4096);
        // The `Registered` holds the only reference to the memory.
        drop(registered);
        assert_eq!(
            fake.events(),
            [
                Event::Registered {
                    key: 1,
                    len: 4096,
                    access: Access::Served
                },
                Event::Deregistered {
                    key: 1,
                    memory_mapped: true
                },
            ]
        );
        assert_eq!(weak.strong_count(), 0, "the memory is released afterwards");
    }

    #[test]
    fn handing_the_memory_back_deregisters_it_first() {
        let fake = Fake::default();
        let registered = Registered::new(&fake, memory(64), Access::Served).unwrap();
        let mem = registered.into_memory();
        assert_eq!(
            fake.events().last(),
            Some(&Event::Deregistered {
                key: 1,
                memory_mapped: true
            })
        );
        assert_eq!(Arc::strong_count(&mem), 1);
        mem.write_at(0, b"still mapped").unwrap();
    }

    #[tokio::test]
    async fn released_buffers_are_reused_without_registering_again() {
        let fake = Fake::default();
        let pool = StagingPool::new(fake.clone(), 8192, 2).unwrap();
        assert_eq!(fake.count(true), 0, "buffers are created on demand");
        let lease = pool.checkout().await.unwrap();
        assert_eq!(lease.memory().len(), 8192);
        let key = lease.lkey();
        lease.memory().write_at(0, b"batch one").unwrap();
        lease.release();
        assert_eq!(
            pool.stats(),
            PoolStats {
                idle: 1,
                leased: 0,
                created: 1,
                discarded: 0
            }
        );
        let again = pool.checkout().await.unwrap();
        assert_eq!(again.lkey(), key);
        assert_eq!(fake.count(true), 1);
        assert_eq!(fake.count(false), 0);
        again.release();
        // Staging memory is this process's own: registered for local writes only.
        assert!(fake.events().iter().all(|event| !matches!(
            event,
            Event::Registered {
                access: Access::Served,
                ..
            }
        )));
    }

    #[tokio::test(start_paused = true)]
    async fn at_most_max_buffers_exist_and_a_checkout_waits_for_a_release() {
        let fake = Fake::default();
        let pool = StagingPool::new(fake.clone(), 4096, 2).unwrap();
        let first = pool.checkout().await.unwrap();
        let second = pool.checkout().await.unwrap();
        assert_ne!(first.lkey(), second.lkey());
        assert!(pool.try_checkout().unwrap().is_none());
        assert_eq!(pool.stats().leased, 2);

        let waiter = {
            let pool = pool.clone();
            tokio::spawn(async move { pool.checkout().await.map(|lease| lease.lkey()) })
        };
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!waiter.is_finished(), "a third batch waits while two run");

        let released = first.lkey();
        first.release();
        let got = tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(got, released, "the waiter got the released buffer");
        // The waiter's lease was dropped without a release: discarded.
        assert_eq!(fake.count(true), 2, "never more than two registrations");
        second.release();
        assert_eq!(
            pool.stats(),
            PoolStats {
                idle: 1,
                leased: 0,
                created: 2,
                discarded: 1
            }
        );
    }

    #[tokio::test]
    async fn a_dropped_lease_is_deregistered_then_freed_and_replaced() {
        let fake = Fake::default();
        let pool = StagingPool::new(fake.clone(), 4096, 1).unwrap();
        let lease = pool.checkout().await.unwrap();
        let weak = Arc::downgrade(lease.memory());
        let key = lease.lkey();
        // A failed or cancelled batch: its requests may still be in flight.
        drop(lease);
        assert_eq!(
            fake.events().last(),
            Some(&Event::Deregistered {
                key,
                memory_mapped: true
            })
        );
        assert_eq!(weak.strong_count(), 0);
        assert_eq!((pool.stats().idle, pool.stats().discarded), (0, 1));
        let fresh = pool.checkout().await.unwrap();
        assert_ne!(
            fresh.lkey(),
            key,
            "a new registration, not the discarded one"
        );
        fresh.release();
        assert_eq!(pool.stats().created, 2);
    }

    #[tokio::test]
    async fn a_failed_registration_frees_its_slot() {
        let fake = Fake::default();
        let pool = StagingPool::new(fake.clone(), 4096, 1).unwrap();
        fake.fail.store(true, Ordering::Relaxed);
        let error = pool.checkout().await.err().map(|e| e.kind());
        assert_eq!(error, Some(ErrorKind::Rdma));
        assert_eq!(pool.stats().leased, 0);
        assert_eq!(pool.stats().created, 0);
        fake.fail.store(false, Ordering::Relaxed);
        pool.checkout().await.unwrap().release();
        assert_eq!(pool.stats().created, 1);
    }

    #[test]
    fn prefill_registers_up_to_the_bound_and_the_pool_deregisters_before_freeing() {
        let fake = Fake::default();
        let pool = StagingPool::new(fake.clone(), 4096, 2).unwrap();
        pool.prefill(5).unwrap();
        assert_eq!(pool.stats().idle, 2);
        assert_eq!(fake.count(true), 2);
        drop(pool);
        let events = fake.events();
        assert_eq!(fake.count(false), 2);
        assert!(events.iter().all(|e| match e {
            Event::Deregistered { memory_mapped, .. } => *memory_mapped,
            Event::Registered { .. } => true,
        }));
    }

    #[test]
    fn empty_pools_are_refused() {
        for (bytes, count) in [(0, 1), (1, 0)] {
            let error = StagingPool::new(Fake::default(), bytes, count).err();
            assert_eq!(error.map(|e| e.kind()), Some(ErrorKind::Invalid));
        }
    }
}
