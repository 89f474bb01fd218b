//! Ephemeral space leases (see `hkvm_events::rpc::space_lease`): ranges of the
//! same length on several segments, allocated whole when granted. An object
//! committed into a lease takes its range out of the lease for good (from then on
//! it is the object's, freed with it); when the lease ends, the ranges no commit
//! took are freed. Like pending puts, leases live on the leader only and are gone
//! after a leader change.

use std::collections::{BTreeMap, HashMap};

use hkvm_events::rpc::submaster::LeaseId;

use super::{Replica, Slot};
use crate::allocator::aligned;

/// One lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpaceLease {
    /// Where each range starts (one per replica, distinct nodes).
    pub ranges: Vec<Replica>,
    /// Bytes leased on each segment (aligned).
    pub len: u64,
    /// When it ends (state clock ms).
    pub expires_ms: u64,
    /// Lease offset → aligned length of every range a commit took.
    taken: BTreeMap<u64, u64>,
}

/// Why an object cannot be carved out of a lease at an offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CarveError {
    /// The offset is not a multiple of the allocation alignment.
    Misaligned,
    /// The object reaches past the lease's end.
    OutOfRange,
    /// A commit took (part of) that range already.
    Taken,
}

impl SpaceLease {
    /// A lease of `len` bytes (aligned) at `ranges`, ending at `expires_ms`.
    pub fn new(ranges: Vec<Replica>, len: u64, expires_ms: u64) -> Self {
        Self {
            ranges,
            len: aligned(len),
            expires_ms,
            taken: BTreeMap::new(),
        }
    }

    /// Checks that an object of `size` bytes fits at lease offset `offset`
    /// without touching anything taken.
    ///
    /// # Errors
    /// The [`CarveError`].
    pub fn check(&self, offset: u64, size: u64) -> Result<(), CarveError> {
        if offset % crate::allocator::ALIGNMENT != 0 {
            return Err(CarveError::Misaligned);
        }
        let end = offset
            .checked_add(aligned(size))
            .filter(|&end| end <= self.len)
            .ok_or(CarveError::OutOfRange)?;
        let before = self
            .taken
            .range(..=offset)
            .next_back()
            .is_some_and(|(&start, &len)| start + len > offset);
        let after = self.taken.range(offset..end).next().is_some();
        if before || after {
            return Err(CarveError::Taken);
        }
        Ok(())
    }

    /// Takes an object of `size` bytes at lease offset `offset` out of the lease
    /// and answers its replicas.
    ///
    /// # Errors
    /// As [`SpaceLease::check`]; nothing is taken then.
    pub fn carve(&mut self, offset: u64, size: u64) -> Result<Vec<Replica>, CarveError> {
        self.check(offset, size)?;
        self.taken.insert(offset, aligned(size));
        Ok(self
            .ranges
            .iter()
            .map(|range| Replica {
                slot: range.slot,
                offset: range.offset + offset,
            })
            .collect())
    }

    /// The parts of every range that no commit took: `(replica, len)` to free
    /// when the lease ends.
    pub fn untaken(&self) -> Vec<(Replica, u64)> {
        let mut gaps = Vec::new();
        let mut cursor = 0;
        let mut push_gap = |from: u64, to: u64| {
            if to > from {
                for range in &self.ranges {
                    gaps.push((
                        Replica {
                            slot: range.slot,
                            offset: range.offset + from,
                        },
                        to - from,
                    ));
                }
            }
        };
        for (&start, &len) in &self.taken {
            push_gap(cursor, start);
            cursor = start + len;
        }
        push_gap(cursor, self.len);
        gaps
    }

    /// Bytes no commit took, on each segment.
    pub fn untaken_len(&self) -> u64 {
        self.len - self.taken.values().sum::<u64>()
    }
}

/// Every lease the leader granted and that has not ended.
#[derive(Debug, Default)]
pub struct SpaceLeases {
    leases: HashMap<LeaseId, SpaceLease>,
}

impl SpaceLeases {
    /// Records `lease` and answers its new id: random, so that an id from a
    /// leader before a failover never names a lease of the next one (a commit
    /// into it would place an object where its bytes were never written).
    pub fn grant(&mut self, lease: SpaceLease) -> LeaseId {
        let mut id = rand::random::<LeaseId>();
        while id == 0 || self.leases.contains_key(&id) {
            id = rand::random();
        }
        self.leases.insert(id, lease);
        id
    }

    /// The lease `id`, while it has not ended.
    pub fn get_mut(&mut self, id: LeaseId) -> Option<&mut SpaceLease> {
        self.leases.get_mut(&id)
    }

    /// Ends lease `id` and answers it (its untaken parts are the caller's to free).
    pub fn end(&mut self, id: LeaseId) -> Option<SpaceLease> {
        self.leases.remove(&id)
    }

    /// The ids of leases that ended by `now_ms`.
    pub fn expired(&self, now_ms: u64) -> Vec<LeaseId> {
        self.leases
            .iter()
            .filter(|(_, lease)| lease.expires_ms <= now_ms)
            .map(|(&id, _)| id)
            .collect()
    }

    /// Forgets every lease with a range on `slot` (its segment is gone, so is
    /// the space; the other ranges' untaken parts are answered for freeing).
    pub fn forget_slot(&mut self, slot: Slot) -> Vec<(Replica, u64)> {
        let gone: Vec<LeaseId> = self
            .leases
            .iter()
            .filter(|(_, lease)| lease.ranges.iter().any(|r| r.slot == slot))
            .map(|(&id, _)| id)
            .collect();
        gone.into_iter()
            .filter_map(|id| self.leases.remove(&id))
            .flat_map(|lease| lease.untaken())
            .filter(|(replica, _)| replica.slot != slot)
            .collect()
    }

    /// How many leases are held.
    pub fn len(&self) -> usize {
        self.leases.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.leases.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease() -> SpaceLease {
        let ranges = vec![
            Replica {
                slot: 0,
                offset: 1024,
            },
            Replica {
                slot: 1,
                offset: 4096,
            },
        ];
        SpaceLease::new(ranges, 1000, 50)
    }

    #[test]
    fn a_carved_object_lies_at_the_same_offset_in_every_range() {
        let mut lease = lease();
        assert_eq!(lease.len, 1024);
        let replicas = lease.carve(128, 100).unwrap();
        assert_eq!(
            replicas,
            vec![
                Replica {
                    slot: 0,
                    offset: 1152
                },
                Replica {
                    slot: 1,
                    offset: 4224
                }
            ]
        );
    }

    #[test]
    fn a_range_is_carved_once_and_only_inside_the_lease() {
        let mut lease = lease();
        lease.carve(128, 100).unwrap();
        assert_eq!(lease.carve(128, 64), Err(CarveError::Taken));
        assert_eq!(lease.carve(64, 65), Err(CarveError::Taken));
        assert_eq!(lease.carve(192, 1), Err(CarveError::Taken));
        assert_eq!(
            lease.carve(256, 1),
            Ok(vec![
                Replica {
                    slot: 0,
                    offset: 1280
                },
                Replica {
                    slot: 1,
                    offset: 4352
                }
            ])
        );
        assert_eq!(lease.carve(0, 64).map(|r| r.len()), Ok(2));
        assert_eq!(lease.carve(960, 65), Err(CarveError::OutOfRange));
        assert_eq!(lease.carve(u64::MAX - 63, 64), Err(CarveError::OutOfRange));
        assert_eq!(lease.carve(100, 1), Err(CarveError::Misaligned));
    }

    #[test]
    fn what_no_commit_took_is_freed_on_every_range() {
        let mut lease = lease();
        lease.carve(128, 100).unwrap();
        lease.carve(512, 64).unwrap();
        let gaps = lease.untaken();
        assert_eq!(
            gaps,
            vec![
                (
                    Replica {
                        slot: 0,
                        offset: 1024
                    },
                    128
                ),
                (
                    Replica {
                        slot: 1,
                        offset: 4096
                    },
                    128
                ),
                (
                    Replica {
                        slot: 0,
                        offset: 1280
                    },
                    256
                ),
                (
                    Replica {
                        slot: 1,
                        offset: 4352
                    },
                    256
                ),
                (
                    Replica {
                        slot: 0,
                        offset: 1600
                    },
                    448
                ),
                (
                    Replica {
                        slot: 1,
                        offset: 4672
                    },
                    448
                ),
            ]
        );
        assert_eq!(lease.untaken_len(), 128 + 256 + 448);
    }

    #[test]
    fn leases_end_by_time_and_with_their_segment() {
        let mut leases = SpaceLeases::default();
        let first = leases.grant(lease());
        let second = leases.grant(SpaceLease::new(
            vec![Replica { slot: 2, offset: 0 }],
            64,
            90,
        ));
        assert_ne!(first, second);
        assert_eq!(leases.expired(49), Vec::<LeaseId>::new());
        assert_eq!(leases.expired(50), vec![first]);
        let freed = leases.forget_slot(1);
        assert_eq!(
            freed,
            vec![(
                Replica {
                    slot: 0,
                    offset: 1024
                },
                1024
            )]
        );
        assert!(leases.get_mut(first).is_none());
        assert_eq!(leases.len(), 1);
        assert!(leases.end(second).is_some());
        assert!(leases.is_empty());
    }
}
