//! Nodes a write just failed to reach. A node whose process is gone stays
//! mounted at the sub-master until its node timeout; meanwhile the placements of
//! this client's puts (and space leases) ask to avoid it, and a put whose write
//! failed is placed again on other nodes instead of failing.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hkvm_events::rpc::submaster::MAX_AVOIDED_NODES;
use hkvm_events::NodeId;

/// How long a node is avoided after a failed write: the sub-master's default
/// node timeout, after which it has unmounted a node that stopped pinging.
pub(crate) const AVOID_FOR: Duration = Duration::from_secs(10);

/// The nodes recently found unreachable, each with when it was last.
#[derive(Debug, Default)]
pub(crate) struct UnreachableNodes {
    recent: Mutex<HashMap<NodeId, Instant>>,
}

impl UnreachableNodes {
    /// Notes that a write to `node` failed now.
    pub(crate) fn note(&self, node: &NodeId) {
        self.noted_at(node, Instant::now());
    }

    fn noted_at(&self, node: &NodeId, at: Instant) {
        if self.lock().insert(node.clone(), at).is_none() {
            tracing::info!(%node, "a replica write failed: placing puts elsewhere for a while");
        }
    }

    /// The nodes to avoid now (at most [`MAX_AVOIDED_NODES`], the latest
    /// failures first); forgets those noted longer than [`AVOID_FOR`] ago.
    pub(crate) fn current(&self) -> Vec<NodeId> {
        self.current_at(Instant::now())
    }

    fn current_at(&self, now: Instant) -> Vec<NodeId> {
        let mut recent = self.lock();
        if recent.is_empty() {
            return Vec::new();
        }
        recent.retain(|_, at| now.saturating_duration_since(*at) < AVOID_FOR);
        let mut nodes: Vec<(&NodeId, &Instant)> = recent.iter().collect();
        nodes.sort_by(|a, b| b.1.cmp(a.1));
        nodes
            .into_iter()
            .take(MAX_AVOIDED_NODES)
            .map(|(node, _)| node.clone())
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<NodeId, Instant>> {
        self.recent
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(n: usize) -> NodeId {
        NodeId::new(format!("node-{n}")).unwrap()
    }

    #[test]
    fn a_node_is_avoided_for_a_while_then_forgotten() {
        let nodes = UnreachableNodes::default();
        assert!(nodes.current().is_empty());
        let start = Instant::now();
        nodes.noted_at(&node(1), start);
        assert_eq!(nodes.current_at(start + AVOID_FOR / 2), vec![node(1)]);
        assert!(nodes.current_at(start + AVOID_FOR).is_empty());
        assert!(nodes.lock().is_empty(), "expired entries are dropped");
    }

    #[test]
    fn the_latest_failures_are_kept_within_the_request_limit() {
        let nodes = UnreachableNodes::default();
        let start = Instant::now();
        for n in 0..MAX_AVOIDED_NODES + 5 {
            nodes.noted_at(&node(n), start + Duration::from_millis(n as u64));
        }
        let now = start + Duration::from_secs(1);
        let avoided = nodes.current_at(now);
        assert_eq!(avoided.len(), MAX_AVOIDED_NODES);
        assert_eq!(avoided[0], node(MAX_AVOIDED_NODES + 4));
        assert!(!avoided.contains(&node(0)));
    }
}
