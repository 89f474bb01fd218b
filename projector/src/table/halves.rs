//! Filling an empty id table on two threads, one per half of its slots.
//!
//! Ids in [`HomeOrder`] come sorted by home region, so the ids whose hashes
//! are below 2^63 (home in the lower half) come first. Each thread places its
//! ids into its own half of the slots. An id whose probe would leave its half
//! (a run crossing the middle, or wrapping past the end) is set aside and
//! placed once both halves are done. Any insertion order gives a valid linear
//! probing table: every id sits at the first empty slot its probe met when it
//! was placed, and slots only ever fill after that.

use super::{home_slot, id_of, slot, slot_tag, tag, HomeOrder, IdTable, BUILD_AHEAD, EMPTY_SLOT};
use crate::prefetch::prefetch;

/// Fewer ids than this are placed on one thread: a thread costs more than it
/// saves.
pub(super) const FILL_IN_HALVES_FROM: usize = 1 << 16;

/// The hash at which the upper half of the homes begins.
const MIDDLE_HASH: u64 = 1 << 63;

/// What placing one id in a half did.
enum Placed {
    /// The id is in its slot.
    Yes,
    /// Its hash is in the half already.
    Repeat,
    /// Its probe would leave the half: it is placed afterwards.
    SetAside,
}

/// One half of the slots and where it starts in the whole table.
struct Half<'a> {
    slots: &'a mut [u64],
    first_slot: usize,
    table_slots: usize,
}

impl Half<'_> {
    /// Places `ids` (hashed by `order_hashes`, in home order) and returns the
    /// ids set aside, with their hashes; `Err(id)` names a repeated hash.
    fn fill(
        mut self,
        order_hashes: &[u64],
        ids: &[u32],
        hashes: &[u64],
    ) -> Result<Vec<(u64, u32)>, u32> {
        let mut set_aside = Vec::new();
        for (at, (&hash, &id)) in order_hashes.iter().zip(ids).enumerate() {
            if let Some(&ahead) = order_hashes.get(at + BUILD_AHEAD) {
                self.prefetch_home(ahead);
            }
            match self.place_new(hash, id, hashes) {
                Placed::Yes => {}
                Placed::Repeat => return Err(id),
                Placed::SetAside => set_aside.push((hash, id)),
            }
        }
        Ok(set_aside)
    }

    fn local_home(&self, hash: u64) -> Option<usize> {
        home_slot(hash, self.table_slots).checked_sub(self.first_slot)
    }

    fn prefetch_home(&self, hash: u64) {
        if let Some(slot) = self.local_home(hash).and_then(|at| self.slots.get(at)) {
            prefetch(slot);
        }
    }

    /// [`IdTable::place_new`] within the half, without wrapping.
    fn place_new(&mut self, hash: u64, id: u32, hashes: &[u64]) -> Placed {
        let Some(mut at) = self.local_home(hash) else {
            return Placed::SetAside;
        };
        while let Some(&taken) = self.slots.get(at) {
            if taken == EMPTY_SLOT {
                self.slots[at] = slot(hash, id);
                return Placed::Yes;
            }
            if slot_tag(taken) == tag(hash) && hashes.get(id_of(taken) as usize) == Some(&hash) {
                return Placed::Repeat;
            }
            at += 1;
        }
        Placed::SetAside
    }
}

impl IdTable {
    /// Places the ids of `order` into this empty table, which has room for
    /// them all, on two threads (see the module's comment). `Err(id)` names
    /// an id whose hash an id before it already has.
    pub(super) fn fill_in_halves(mut self, order: &HomeOrder, hashes: &[u64]) -> Result<Self, u32> {
        debug_assert!(self.len == 0 && self.slots.len() >= Self::slots_for(order.ids.len()));
        let table_slots = self.slots.len();
        let middle = home_slot(MIDDLE_HASH, table_slots);
        let split = order.hashes.partition_point(|&hash| hash < MIDDLE_HASH);
        let (low_slots, high_slots) = self.slots.split_at_mut(middle);
        let (low, high) = std::thread::scope(|scope| {
            let high = scope.spawn(|| {
                let half = Half {
                    slots: high_slots,
                    first_slot: middle,
                    table_slots,
                };
                half.fill(&order.hashes[split..], &order.ids[split..], hashes)
            });
            let half = Half {
                slots: low_slots,
                first_slot: 0,
                table_slots,
            };
            let low = half.fill(&order.hashes[..split], &order.ids[..split], hashes);
            let high = high
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            (low, high)
        });
        let (low, high) = (low?, high?);
        self.len = order.ids.len() - low.len() - high.len();
        // Low before high keeps the ids of one hash in their order.
        for (hash, id) in low.into_iter().chain(high) {
            if !self.place_new(hash, id, hashes) {
                return Err(id);
            }
            self.len += 1;
        }
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fills a table of room for `capacity` ids in halves and checks that it
    /// finds every id and no hash it does not hold.
    fn halves_find_every_id(hashes: &[u64], capacity: usize) {
        let order = HomeOrder::new(0..hashes.len() as u32, hashes);
        let table = IdTable::with_capacity(capacity)
            .fill_in_halves(&order, hashes)
            .unwrap();
        assert_eq!(table.len(), hashes.len());
        for (id, &hash) in hashes.iter().enumerate() {
            assert_eq!(table.find(hash, hashes), Some(id as u32), "id {id}");
        }
        // Even hashes away from the crowds are absent; so are the hashes
        // just past each crowd.
        let absent = (0..10_000u64).map(|k| (1 << 61) | (k << 20));
        for hash in absent.chain([MIDDLE_HASH, MIDDLE_HASH - 1, u64::MAX - 1]) {
            assert_eq!(table.find(hash, hashes), None, "hash {hash:#x}");
        }
    }

    /// `count` spread odd hashes, then `crowd` even ones just below the middle
    /// and `crowd` at the very top (so runs cross the middle and wrap).
    fn crowded_hashes(count: u64, crowd: u64) -> Vec<u64> {
        let spread = (0..count).map(|k| k.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let below_middle = (1..=crowd).map(|k| MIDDLE_HASH - k * 2);
        let top = (1..=crowd).map(|k| u64::MAX - 1 - k * 2);
        spread.chain(below_middle).chain(top).collect()
    }

    #[test]
    fn runs_across_the_middle_and_the_end_are_placed_afterwards() {
        for (count, crowd) in [(70_000u64, 500u64), (90_001, 3), (66_000, 2_000)] {
            let hashes = crowded_hashes(count, crowd);
            // Exactly sized, and with an odd number of slots whose middle
            // slot is a home of both halves.
            for capacity in [hashes.len(), hashes.len() + 1, hashes.len() * 2 + 7] {
                halves_find_every_id(&hashes, capacity);
            }
        }
    }

    #[test]
    fn a_repeated_hash_is_named_in_either_half_and_when_set_aside() {
        let hashes = crowded_hashes(80_000, 400);
        let len = hashes.len() as u32;
        // Spread (low or high half), crowded below the middle, crowded at the top.
        for (first, second) in [
            (10, 50),
            (30_000, 60_000),
            (80_010, 80_300),
            (80_450, 80_700),
        ] {
            let mut repeated = hashes.clone();
            repeated[second] = repeated[first];
            let order = HomeOrder::new(0..len, &repeated);
            let result = IdTable::with_capacity(repeated.len()).fill_in_halves(&order, &repeated);
            assert_eq!(
                result.unwrap_err(),
                second as u32,
                "ids {first} and {second}"
            );
        }
    }
}
