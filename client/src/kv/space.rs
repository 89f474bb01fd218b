//! Leased space: with a space lease (see [`hkvm_events::rpc::space_lease`]) a
//! client places objects itself, so a put is its writes plus one `put_commit`
//! instead of `put_start`, writes and `put_end`. The pool holds one lease per
//! put shape (replicas, preferred segment) and carves objects out of it in
//! order. It never makes a put wait for a lease: without a usable one it
//! answers nothing, asks for one in the background, and the put goes through
//! `put_start` / `put_end`. A lease is used for half its time (the rest is the
//! margin for writes and commits in flight) and returned once retired and no
//! carved put is in flight any more, so the sub-master frees what no commit
//! took at once rather than when the lease times out.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use hkvm_events::rpc::space_lease::ALIGNMENT;
use hkvm_events::rpc::submaster::{ItemResult, LeaseId, LeaseSpace, ReplicaLocation, SpaceLease};
use hkvm_events::SegmentId;

use super::unreachable::UnreachableNodes;
use super::PutOptions;
use crate::submaster::SubmasterClient;

/// The default bytes per lease on each of its segments.
pub const DEFAULT_LEASE_LEN: u64 = 16 << 20;

/// How long the pool stops asking after the sub-master had no room.
const AFTER_NO_SPACE: Duration = Duration::from_secs(1);
/// How long the pool stops asking after a lease request failed (a sub-master
/// from before space leases leaves it unanswered).
const AFTER_FAILURE: Duration = Duration::from_secs(30);

fn aligned(len: u64) -> u64 {
    len.max(1).div_ceil(ALIGNMENT).saturating_mul(ALIGNMENT)
}

/// What puts of one shape share a lease for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Shape {
    replicas: u32,
    preferred: Option<SegmentId>,
}

/// A lease in use: returned to the sub-master when the pool has retired it and
/// the last put carved from it is done (this is dropped then).
struct LeaseToken {
    id: LeaseId,
    metadata: SubmasterClient,
}

impl Drop for LeaseToken {
    fn drop(&mut self) {
        let (id, metadata) = (self.id, self.metadata.clone());
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Err(error) = metadata.lease_return(id).await {
                    tracing::debug!(%error, lease = id, "space lease not returned; it ends by time");
                }
            });
        }
    }
}

struct Held {
    lease: SpaceLease,
    token: Arc<LeaseToken>,
    cursor: u64,
    carve_until: Instant,
}

#[derive(Default)]
struct PoolState {
    held: HashMap<Shape, Held>,
    asking: HashSet<Shape>,
    quiet_until: Option<Instant>,
}

/// An object's place carved out of a lease; holding it keeps the lease from
/// being returned.
pub(crate) struct Carved {
    /// The lease.
    pub(crate) lease: LeaseId,
    /// The object's offset inside the lease.
    pub(crate) offset: u64,
    /// Where its replicas go.
    pub(crate) replicas: Vec<ReplicaLocation>,
    _token: Arc<LeaseToken>,
}

/// The leases one client holds.
pub(crate) struct SpacePool {
    metadata: SubmasterClient,
    lease_len: u64,
    state: Mutex<PoolState>,
    /// Nodes a lease asked for now leaves out.
    unreachable: Arc<UnreachableNodes>,
}

impl std::fmt::Debug for SpacePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpacePool")
            .field("lease_len", &self.lease_len)
            .finish_non_exhaustive()
    }
}

impl SpacePool {
    /// A pool asking `metadata` for leases of `lease_len` bytes on none of the
    /// nodes `unreachable` holds at the time.
    pub(crate) fn new(
        metadata: SubmasterClient,
        lease_len: u64,
        unreachable: Arc<UnreachableNodes>,
    ) -> Self {
        Self {
            metadata,
            lease_len: aligned(lease_len),
            state: Mutex::new(PoolState::default()),
            unreachable,
        }
    }

    fn state(&self) -> MutexGuard<'_, PoolState> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A place for an object of `size` bytes put with `options`, when a usable
    /// lease has the room; otherwise `None` (and a lease is asked for in the
    /// background). Objects over a quarter of a lease (as asked, or as granted
    /// when the sub-master granted less) always go without.
    pub(crate) fn carve(self: &Arc<Self>, size: u64, options: &PutOptions) -> Option<Carved> {
        let need = aligned(size);
        if need > self.lease_len / 4 {
            return None;
        }
        let shape = Shape {
            replicas: options.replicas,
            preferred: options.preferred_segment.clone(),
        };
        let now = Instant::now();
        let mut state = self.state();
        if let Some(held) = state.held.get_mut(&shape) {
            if need > held.lease.len / 4 {
                // Granted less than asked (a small pool): too large for this
                // lease, which stays for the objects that fit.
                return None;
            }
            if now < held.carve_until && held.cursor + need <= held.lease.len {
                let offset = held.cursor;
                held.cursor += need;
                return Some(Carved {
                    lease: held.lease.id,
                    offset,
                    replicas: held
                        .lease
                        .ranges
                        .iter()
                        .map(|range| ReplicaLocation {
                            offset: range.offset + offset,
                            ..range.clone()
                        })
                        .collect(),
                    _token: Arc::clone(&held.token),
                });
            }
            // Used up or out of time: retired (returned once its puts are done).
            state.held.remove(&shape);
        }
        if state.quiet_until.is_some_and(|until| now < until) || !state.asking.insert(shape.clone())
        {
            return None;
        }
        drop(state);
        let pool = Arc::clone(self);
        tokio::spawn(async move { pool.ask(shape).await });
        None
    }

    async fn ask(self: Arc<Self>, shape: Shape) {
        let asked = Instant::now();
        let answer = self
            .metadata
            .lease_space(LeaseSpace {
                len: self.lease_len,
                replicas: shape.replicas,
                preferred_segment: shape.preferred.clone(),
                avoid_nodes: self.unreachable.current(),
            })
            .await;
        let mut state = self.state();
        state.asking.remove(&shape);
        match answer {
            Ok(ItemResult::Ok(lease)) => {
                let carve_until = asked + Duration::from_millis(lease.ttl_ms / 2);
                let token = Arc::new(LeaseToken {
                    id: lease.id,
                    metadata: self.metadata.clone(),
                });
                state.held.insert(
                    shape,
                    Held {
                        lease,
                        token,
                        cursor: 0,
                        carve_until,
                    },
                );
            }
            Ok(ItemResult::Err(error)) => {
                tracing::debug!(%error, "no space lease granted; putting without one");
                state.quiet_until = Some(Instant::now() + AFTER_NO_SPACE);
            }
            Err(error) => {
                tracing::info!(%error, "space lease request failed; putting without leases for a while");
                state.quiet_until = Some(Instant::now() + AFTER_FAILURE);
            }
        }
    }

    /// Stops carving from `lease` (the sub-master no longer holds it: a leader
    /// change, or its time ran out; or a write into one of its ranges failed).
    pub(crate) fn forget(&self, lease: LeaseId) {
        self.state().held.retain(|_, held| held.lease.id != lease);
    }
}
