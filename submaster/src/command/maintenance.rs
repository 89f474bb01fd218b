//! Periodic upkeep by the leader: reclaim timed-out pending puts and space
//! leases, declare silent
//! nodes lost, and evict oldest-first when usage passes the high watermark.

use hkvm_events::{Evicted, KvEvent, NodeId, NodeLost, Removed};

use super::objects::is_leased;
use super::{chunked, Policy};
use crate::state::State;

/// Runs one round of upkeep at `now_ms` and returns the events it decided (to be
/// applied and appended like any command's).
pub fn maintain(state: &mut State, now_ms: u64, policy: &Policy) -> Vec<KvEvent> {
    reclaim_pending(state, now_ms, policy);
    super::leases::end_expired_leases(state, now_ms);
    let mut events = lost_nodes(state, now_ms, policy);
    events.extend(evict(state, now_ms, policy));
    events
}

fn reclaim_pending(state: &mut State, now_ms: u64, policy: &Policy) {
    let expired: Vec<String> = state
        .pending
        .iter()
        .filter(|(_, pending)| pending.started_ms + policy.put_timeout_ms <= now_ms)
        .map(|(key, _)| key.clone())
        .collect();
    for key in expired {
        if let Some(pending) = state.pending.remove(&key) {
            tracing::info!(key, "reclaiming a put that was never ended");
            state.free_replicas(&pending.replicas, pending.size);
        }
    }
}

fn lost_nodes(state: &mut State, now_ms: u64, policy: &Policy) -> Vec<KvEvent> {
    let mut nodes: Vec<NodeId> = state.segments().map(|(_, s)| s.node.clone()).collect();
    nodes.sort();
    nodes.dedup();
    let mut events = Vec::new();
    for node in nodes {
        // A node without a liveness record (e.g. right after a takeover) gets one now.
        let last = *state.liveness.entry(node.clone()).or_insert(now_ms);
        if last + policy.node_timeout_ms > now_ms {
            continue;
        }
        let slots: Vec<_> = state
            .segments()
            .filter(|(_, s)| s.node == node)
            .map(|(slot, _)| slot)
            .collect();
        let lost_keys = state.keys_only_on(&slots);
        tracing::warn!(node = %node, segments = slots.len(), lost_objects = lost_keys.len(), "node silent past its timeout: declared lost");
        events.push(KvEvent::NodeLost(NodeLost { node }));
        events.extend(chunked(lost_keys, |keys| {
            KvEvent::Removed(Removed { keys })
        }));
    }
    events
}

fn evict(state: &State, now_ms: u64, policy: &Policy) -> Vec<KvEvent> {
    let (capacity, used) = state.usage();
    if capacity == 0 || (used as f64) <= policy.high_watermark * capacity as f64 {
        return Vec::new();
    }
    let wanted = ((state.object_count() as f64 * policy.evict_ratio).ceil() as usize).max(1);
    let mut candidates: Vec<(u64, &str)> = state
        .objects()
        .filter(|(_, o)| !o.flags.hard_pinned() && !is_leased(state, o.lease_until_ms, now_ms))
        .map(|(key, o)| (o.order, key))
        .collect();
    if candidates.len() > wanted {
        candidates.select_nth_unstable(wanted - 1);
        candidates.truncate(wanted);
    }
    candidates.sort_unstable();
    let keys: Vec<String> = candidates
        .into_iter()
        .map(|(_, key)| key.to_owned())
        .collect();
    if !keys.is_empty() {
        tracing::info!(
            evicted = keys.len(),
            used,
            capacity,
            "usage above the high watermark: evicting oldest objects"
        );
    }
    chunked(keys, |keys| KvEvent::Evicted(Evicted { keys }))
}
