//! Choosing where the replicas of a new object go: distinct nodes, each with a free
//! range large enough, by a configurable strategy.
//!
//! A put_start runs this in the leader's request loop, so its cost must not grow
//! with the sub-cluster: the default strategy draws a few segments at random (as a
//! Mooncake master does) and scans every segment only when those draws did not find
//! enough room, so a put never fails while room exists.

use hkvm_events::NodeId;
use rand::Rng;
use serde::Deserialize;

use crate::allocator::aligned;
use crate::state::{Slot, State};

/// Random draws per replica before [`PlacementStrategy::Random`] falls back to a
/// scan of every segment.
const DRAWS_PER_REPLICA: usize = 8;

/// How replicas are spread over candidate nodes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlacementStrategy {
    /// Uniformly random segments with room, on distinct nodes (spreads load; the
    /// default, as in Mooncake).
    #[default]
    Random,
    /// The segments with the most free bytes first, on distinct nodes (fills
    /// evenly).
    MostFreeFirst,
}

impl std::str::FromStr for PlacementStrategy {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "random" => Ok(Self::Random),
            "most_free_first" | "most-free-first" => Ok(Self::MostFreeFirst),
            other => Err(format!(
                "unknown placement strategy {other:?} (random, most_free_first)"
            )),
        }
    }
}

/// Picks up to `replicas` segments on distinct nodes that can hold `size` bytes,
/// none on a node of `avoid`, starting with `preferred` when it can. Returns
/// fewer only when fewer such nodes have room.
pub fn choose(
    state: &State,
    size: u64,
    replicas: usize,
    preferred: Option<Slot>,
    avoid: &[NodeId],
    strategy: PlacementStrategy,
) -> Vec<Slot> {
    choose_with(
        state,
        Wanted {
            size,
            replicas,
            preferred,
            avoid,
        },
        strategy,
        &mut rand::thread_rng(),
    )
}

/// What one placement asks for.
#[derive(Debug, Clone, Copy)]
pub struct Wanted<'a> {
    /// Bytes per replica.
    pub size: u64,
    /// Replicas, on distinct nodes.
    pub replicas: usize,
    /// The segment to take first when it has room.
    pub preferred: Option<Slot>,
    /// Nodes to place nothing on.
    pub avoid: &'a [NodeId],
}

/// [`choose`] with the random source given (tests seed it).
pub fn choose_with(
    state: &State,
    wanted: Wanted<'_>,
    strategy: PlacementStrategy,
    rng: &mut impl Rng,
) -> Vec<Slot> {
    let mut picks = Picks {
        state,
        needed: aligned(wanted.size),
        wanted: wanted.replicas,
        avoid: wanted.avoid,
        chosen: Vec::with_capacity(wanted.replicas),
    };
    if let Some(slot) = wanted.preferred {
        picks.offer(slot);
    }
    match strategy {
        PlacementStrategy::Random => {
            picks.draw(rng);
            picks.shuffled_scan(rng);
        }
        PlacementStrategy::MostFreeFirst => picks.most_free_scan(),
    }
    picks.chosen
}

/// The slots chosen so far for one object.
struct Picks<'a> {
    state: &'a State,
    /// Aligned bytes each replica needs.
    needed: u64,
    wanted: usize,
    /// Nodes that get no replica.
    avoid: &'a [NodeId],
    chosen: Vec<Slot>,
}

impl Picks<'_> {
    fn done(&self) -> bool {
        self.chosen.len() >= self.wanted
    }

    /// The node of a segment that has room for a replica, if any.
    fn node_with_room(&self, slot: Slot) -> Option<&NodeId> {
        let segment = self.state.segment(slot)?;
        (segment.allocator.largest_free() >= self.needed).then_some(&segment.node)
    }

    fn node_taken(&self, node: &NodeId) -> bool {
        self.chosen
            .iter()
            .any(|&slot| self.state.segment(slot).is_some_and(|s| &s.node == node))
    }

    /// Whether `slot` can take a replica: it has room, on a node neither chosen
    /// yet nor avoided.
    fn eligible(&self, slot: Slot) -> bool {
        self.node_with_room(slot)
            .is_some_and(|node| !self.avoid.contains(node) && !self.node_taken(node))
    }

    /// Takes `slot` when it is eligible and more replicas are wanted.
    fn offer(&mut self, slot: Slot) -> bool {
        let take = !self.done() && self.eligible(slot);
        if take {
            self.chosen.push(slot);
        }
        take
    }

    /// A few uniformly random slots: the whole cost of a placement while the pool
    /// has room.
    fn draw(&mut self, rng: &mut impl Rng) {
        let slots = self.state.slot_count();
        if slots == 0 {
            return;
        }
        for _ in 0..DRAWS_PER_REPLICA * self.wanted {
            if self.done() {
                return;
            }
            let slot = rng.gen_range(0..slots);
            // A slot index always fits in `Slot`: `slot_count` counts them.
            if let Ok(slot) = Slot::try_from(slot) {
                self.offer(slot);
            }
        }
    }

    /// Every eligible slot in random order (a partial shuffle: stops once enough
    /// are taken): the draws missed, so room is scarce or the pool is small.
    fn shuffled_scan(&mut self, rng: &mut impl Rng) {
        if self.done() {
            return;
        }
        let mut candidates = self.scan();
        while !self.done() && !candidates.is_empty() {
            let slot = candidates.swap_remove(rng.gen_range(0..candidates.len()));
            self.offer(slot);
        }
    }

    /// Eligible slots by most free bytes first (ties by slot, so the choice is
    /// deterministic); only the head of the order is sorted.
    fn most_free_scan(&mut self) {
        if self.done() {
            return;
        }
        let free = |slot: Slot| {
            self.state
                .segment(slot)
                .map_or(0, |segment| segment.allocator.free_bytes())
        };
        let mut candidates: Vec<(u64, Slot)> = self
            .scan()
            .into_iter()
            .map(|slot| (free(slot), slot))
            .collect();
        let most_free_first = |a: &(u64, Slot), b: &(u64, Slot)| b.0.cmp(&a.0).then(a.1.cmp(&b.1));
        // Several segments of one node can lead the order: look at a head a few
        // times the replicas wanted, and at everything only when that is short.
        let head = (4 * self.wanted).max(16);
        if candidates.len() > head {
            let (first, _, _) = candidates.select_nth_unstable_by(head, most_free_first);
            first.sort_unstable_by(most_free_first);
            for &(_, slot) in first.iter() {
                self.offer(slot);
            }
            if self.done() {
                return;
            }
        }
        candidates.sort_unstable_by(most_free_first);
        for (_, slot) in candidates {
            self.offer(slot);
        }
    }

    /// Every eligible slot, in slot order.
    fn scan(&self) -> Vec<Slot> {
        self.state
            .segments()
            .map(|(slot, _)| slot)
            .filter(|&slot| self.eligible(slot))
            .collect()
    }
}

#[cfg(test)]
mod tests;
