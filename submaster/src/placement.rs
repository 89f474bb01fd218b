//! Choosing where the replicas of a new object go: distinct nodes, each with a free
//! range large enough, by a configurable strategy.

use std::collections::HashMap;

use hkvm_events::NodeId;
use rand::seq::SliceRandom as _;
use serde::Deserialize;

use crate::allocator::aligned;
use crate::state::{Slot, State};

/// How replicas are spread over candidate nodes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlacementStrategy {
    /// Uniformly random nodes (spreads load; the default, as in Mooncake).
    #[default]
    Random,
    /// The nodes with the most free bytes first (fills evenly).
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
/// starting with `preferred` when it can. Returns fewer when not enough nodes have
/// room.
pub fn choose(
    state: &State,
    size: u64,
    replicas: usize,
    preferred: Option<Slot>,
    strategy: PlacementStrategy,
) -> Vec<Slot> {
    let needed = aligned(size);
    // The best segment of each node: the one with the largest free range.
    let mut per_node: HashMap<&NodeId, (Slot, u64, u64)> = HashMap::new();
    for (slot, segment) in state.segments() {
        let largest = segment.allocator.largest_free();
        if largest < needed {
            continue;
        }
        let free = segment.allocator.free_bytes();
        let entry = per_node
            .entry(&segment.node)
            .or_insert((slot, largest, free));
        if largest > entry.1 {
            *entry = (slot, largest, free);
        }
    }
    let mut chosen = Vec::with_capacity(replicas);
    if let Some(slot) = preferred {
        if let Some(segment) = state.segment(slot) {
            if segment.allocator.largest_free() >= needed {
                chosen.push(slot);
                per_node.remove(&segment.node);
            }
        }
    }
    let mut candidates: Vec<(Slot, u64)> = per_node
        .into_values()
        .map(|(slot, _, free)| (slot, free))
        .collect();
    match strategy {
        PlacementStrategy::Random => candidates.shuffle(&mut rand::thread_rng()),
        PlacementStrategy::MostFreeFirst => {
            candidates.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        }
    }
    chosen.extend(
        candidates
            .into_iter()
            .map(|(slot, _)| slot)
            .take(replicas.saturating_sub(chosen.len())),
    );
    chosen.truncate(replicas);
    chosen
}
