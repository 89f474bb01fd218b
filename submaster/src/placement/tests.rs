//! Placement against a naive model: the right number of replicas on distinct nodes
//! with room, none on an avoided node, the preferred segment first, most-free
//! order, and random draws that reach every segment and fall back to a scan when
//! room is scarce.

use hkvm_events::event::SegmentMounted;
use hkvm_events::{KvEvent, NodeId, SegmentId};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::SeedableRng as _;

use super::*;

const SEGMENT: u64 = 1 << 20;

/// A state with one segment per entry of `nodes` (the node index of each), each
/// `SEGMENT` bytes with `used[i]` of it allocated.
fn state_of(nodes: &[usize], used: &[u64]) -> State {
    let mut state = State::new();
    for (index, &node) in nodes.iter().enumerate() {
        state.apply(&KvEvent::SegmentMounted(SegmentMounted {
            node: NodeId::new(format!("node-{node}")).unwrap(),
            segment: SegmentId::new(format!("seg-{index}")).unwrap(),
            size: SEGMENT,
            endpoint: format!("node-{node}:7000"),
            rdma: None,
        }));
        let fill = used.get(index).copied().unwrap_or(0);
        if fill > 0 {
            let slot = Slot::try_from(index).unwrap();
            state
                .segment_mut(slot)
                .unwrap()
                .allocator
                .allocate(fill)
                .unwrap();
        }
    }
    state
}

fn node_of(state: &State, slot: Slot) -> NodeId {
    state.segment(slot).unwrap().node.clone()
}

fn has_room(state: &State, slot: Slot, size: u64) -> bool {
    state.segment(slot).unwrap().allocator.largest_free() >= aligned(size)
}

/// `replicas` of `size` bytes, without preference or avoided nodes.
fn plain(size: u64, replicas: usize) -> Wanted<'static> {
    Wanted {
        size,
        replicas,
        preferred: None,
        avoid: &[],
    }
}

/// What most-free-first must give: greedy over every segment sorted by free bytes
/// (ties by slot), skipping nodes already chosen.
fn most_free_model(state: &State, wanted: Wanted<'_>) -> Vec<Slot> {
    let (size, replicas) = (wanted.size, wanted.replicas);
    let usable = |slot: Slot| {
        state.segment(slot).is_some()
            && has_room(state, slot, size)
            && !wanted.avoid.contains(&node_of(state, slot))
    };
    let mut chosen: Vec<Slot> = Vec::new();
    if let Some(slot) = wanted.preferred.filter(|&s| usable(s)) {
        chosen.push(slot);
    }
    let mut order: Vec<(u64, Slot)> = state
        .segments()
        .filter(|&(slot, _)| usable(slot))
        .map(|(slot, segment)| (segment.allocator.free_bytes(), slot))
        .collect();
    order.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    for (_, slot) in order {
        if chosen.len() >= replicas {
            break;
        }
        if chosen
            .iter()
            .all(|&c| node_of(state, c) != node_of(state, slot))
        {
            chosen.push(slot);
        }
    }
    chosen.truncate(replicas);
    chosen
}

proptest! {
    #[test]
    fn chooses_distinct_nodes_with_room_and_never_too_few(
        // Full segments are common, so that random draws often miss.
        layout in prop::collection::vec(
            (0usize..12, prop_oneof![3 => Just(SEGMENT), 1 => Just(0), 1 => 0u64..=SEGMENT]),
            0..48,
        ),
        size in 1u64..(SEGMENT / 2),
        replicas in 1usize..5,
        preferred in prop::option::of(0u32..60),
        avoided in prop::collection::vec(0usize..12, 0..4),
        most_free in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let nodes: Vec<usize> = layout.iter().map(|(node, _)| *node).collect();
        let used: Vec<u64> = layout.iter().map(|(_, used)| *used).collect();
        let state = state_of(&nodes, &used);
        let strategy = if most_free {
            PlacementStrategy::MostFreeFirst
        } else {
            PlacementStrategy::Random
        };
        let avoid: Vec<NodeId> = avoided
            .iter()
            .map(|node| NodeId::new(format!("node-{node}")).unwrap())
            .collect();
        let wanted = Wanted { size, replicas, preferred, avoid: &avoid };
        let mut rng = StdRng::seed_from_u64(seed);
        let chosen = choose_with(&state, wanted, strategy, &mut rng);

        let mut nodes_with_room: Vec<NodeId> = state
            .segments()
            .filter(|&(slot, _)| has_room(&state, slot, size))
            .map(|(_, segment)| segment.node.clone())
            .filter(|node| !avoid.contains(node))
            .collect();
        nodes_with_room.sort();
        nodes_with_room.dedup();
        prop_assert_eq!(chosen.len(), replicas.min(nodes_with_room.len()));
        let mut chosen_nodes: Vec<NodeId> = chosen.iter().map(|&s| node_of(&state, s)).collect();
        chosen_nodes.sort();
        chosen_nodes.dedup();
        prop_assert_eq!(chosen_nodes.len(), chosen.len(), "one replica per node");
        for &slot in &chosen {
            prop_assert!(has_room(&state, slot, size));
        }
        for &slot in &chosen {
            prop_assert!(!avoid.contains(&node_of(&state, slot)), "an avoided node got a replica");
        }
        if let Some(slot) = preferred.filter(|&s| {
            state.segment(s).is_some()
                && has_room(&state, s, size)
                && !avoid.contains(&node_of(&state, s))
        }) {
            prop_assert_eq!(chosen.first(), Some(&slot), "the preferred segment comes first");
        }
        if most_free {
            prop_assert_eq!(chosen, most_free_model(&state, wanted));
        }
    }
}

#[test]
fn random_draws_reach_every_segment() {
    let nodes: Vec<usize> = (0..64).collect();
    let state = state_of(&nodes, &[]);
    let mut rng = StdRng::seed_from_u64(7);
    let mut hits = [0u32; 64];
    for _ in 0..6400 {
        let chosen = choose_with(&state, plain(4096, 2), PlacementStrategy::Random, &mut rng);
        assert_eq!(chosen.len(), 2);
        assert_ne!(chosen[0], chosen[1]);
        for slot in chosen {
            hits[slot as usize] += 1;
        }
    }
    // 12,800 picks over 64 segments: 200 each on average.
    assert!(hits.iter().all(|&h| (100..300).contains(&h)), "{hits:?}");
}

#[test]
fn scarce_room_is_found_by_the_scan_after_the_draws_miss() {
    // 2,000 full segments and two with room, on two nodes: eight draws per
    // replica almost never land on them, so only the fallback scan finds them.
    let nodes: Vec<usize> = (0..2002).collect();
    let mut used = vec![SEGMENT; 2002];
    used[700] = 0;
    used[1500] = 0;
    let state = state_of(&nodes, &used);
    let mut rng = StdRng::seed_from_u64(11);
    for _ in 0..50 {
        let mut chosen = choose_with(&state, plain(4096, 2), PlacementStrategy::Random, &mut rng);
        chosen.sort_unstable();
        assert_eq!(chosen, vec![700, 1500]);
    }
}

#[test]
fn most_free_first_orders_by_free_bytes() {
    // Three nodes; node 0 has the two emptiest segments, so the second replica
    // goes to the next emptiest node.
    let state = state_of(&[0, 0, 1, 2], &[0, 1024, 4096 * 4, 4096 * 2]);
    let mut rng = StdRng::seed_from_u64(1);
    let chosen = choose_with(
        &state,
        plain(4096, 3),
        PlacementStrategy::MostFreeFirst,
        &mut rng,
    );
    assert_eq!(chosen, vec![0, 3, 2]);
}
