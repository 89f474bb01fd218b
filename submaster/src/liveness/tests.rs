//! The ping table against the state it mirrors: known nodes follow mounts,
//! unmounts and lost nodes; pings of unknown nodes count for nothing; collected
//! pings reach the state's liveness record only for nodes it still knows.

use hkvm_events::{NodeLost, SegmentId, SegmentMounted, SegmentUnmounted};

use super::*;

fn node(name: &str) -> NodeId {
    NodeId::new(name).unwrap()
}

fn mounted(node_name: &str, segment: &str) -> KvEvent {
    KvEvent::SegmentMounted(SegmentMounted {
        node: node(node_name),
        segment: SegmentId::new(segment).unwrap(),
        size: 1 << 20,
        endpoint: format!("{node_name}:7000"),
        rdma: None,
    })
}

/// Applies `events` to `state` and brings `live` in step, as the leader does.
fn commit(state: &mut State, live: &LiveNodes, events: &[KvEvent]) {
    for event in events {
        state.apply(event);
    }
    live.sync(state, events);
}

#[test]
fn a_ping_counts_only_while_its_node_has_a_segment() {
    let (mut state, live) = (State::new(), LiveNodes::new());
    assert!(live.ping_at(&node("n1"), 10).need_remount);
    assert!(
        live.take_pings().is_empty(),
        "an unknown node's ping is not recorded"
    );

    commit(
        &mut state,
        &live,
        &[mounted("n1", "s1"), mounted("n1", "s2")],
    );
    assert!(!live.ping_at(&node("n1"), 20).need_remount);
    assert!(!live.ping_at(&node("n1"), 30).need_remount);
    let pings = live.take_pings();
    assert_eq!(pings.get(&node("n1")), Some(&30), "the latest ping");
    assert!(live.take_pings().is_empty(), "taken once");

    // One of two segments unmounted: still known.
    let unmount = |segment: &str| {
        KvEvent::SegmentUnmounted(SegmentUnmounted {
            node: node("n1"),
            segment: SegmentId::new(segment).unwrap(),
        })
    };
    commit(&mut state, &live, &[unmount("s1")]);
    assert!(!live.ping_at(&node("n1"), 40).need_remount);
    commit(&mut state, &live, &[unmount("s2")]);
    assert!(
        live.take_pings().is_empty(),
        "the last unmount drops the node's uncollected ping"
    );
    assert!(live.ping_at(&node("n1"), 50).need_remount);
}

#[test]
fn a_lost_node_must_remount_and_its_pings_are_not_collected() {
    let (mut state, live) = (State::new(), LiveNodes::new());
    commit(
        &mut state,
        &live,
        &[mounted("n1", "s1"), mounted("n2", "s2")],
    );
    live.ping_at(&node("n1"), 100);
    live.ping_at(&node("n2"), 100);
    let pings = live.take_pings();
    // n1 is declared lost between the ping and its collection.
    commit(
        &mut state,
        &live,
        &[KvEvent::NodeLost(NodeLost { node: node("n1") })],
    );
    collect_pings(&mut state, pings);
    assert_eq!(state.liveness.get(&node("n1")), None);
    assert_eq!(state.liveness.get(&node("n2")), Some(&100));
    assert!(live.ping_at(&node("n1"), 200).need_remount);
}

#[test]
fn collected_pings_never_move_liveness_back() {
    let (mut state, live) = (State::new(), LiveNodes::new());
    commit(&mut state, &live, &[mounted("n1", "s1")]);
    state.liveness.insert(node("n1"), 500);
    live.ping_at(&node("n1"), 400);
    collect_pings(&mut state, live.take_pings());
    assert_eq!(state.liveness.get(&node("n1")), Some(&500));
}

#[test]
fn a_leadership_starts_from_the_state_it_took_over() {
    let (mut state, live) = (State::new(), LiveNodes::new());
    for event in [mounted("n1", "s1"), mounted("n2", "s2")] {
        state.apply(&event);
    }
    live.ping_at(&node("n1"), 1);
    live.lead(7, Instant::now(), &state);
    assert!(
        live.take_pings().is_empty(),
        "pings of an earlier leadership are dropped"
    );
    let reply = live.ping(&node("n2"));
    assert_eq!(
        reply,
        PingReply {
            epoch: 7,
            need_remount: false
        }
    );
    assert!(live.ping(&node("n3")).need_remount);
    assert!(live.take_pings().contains_key(&node("n2")));
}
