//! Mixed requests: reads, reservations and commits of several kinds in one
//! request, decided by the object and lease commands in a fixed order.

use hkvm_events::rpc::submaster::{Mixed, MixedReply};

use super::{leases, objects, Outcome, Policy, Reply};
use crate::state::State;

/// The parts of a mixed request, decided in the order [`Mixed`] documents: reads
/// first, then reservations, then commits (of reservations, then into leases).
/// Only the commits cause events, and no part reads what a later part changes, so
/// nothing needs applying in between.
pub(super) fn mixed(state: &mut State, mixed: Mixed, now_ms: u64, policy: &Policy) -> Outcome {
    let Mixed {
        exist: exist_keys,
        get_replica_list: get_keys,
        put_start: start_items,
        put_end: end_items,
        put_commit: commit_items,
    } = mixed;
    let exist = objects::exist(state, &exist_keys);
    let get_replica_list =
        objects::locate_all(state, &get_keys, now_ms, policy.lease_ttl_ms, policy);
    let put_start = objects::start_all(state, start_items, now_ms, policy);
    let (mut events, put_end) = objects::end_all(state, end_items);
    let (commit_events, put_commit) = leases::commit_all(state, commit_items, now_ms, policy);
    events.extend(commit_events);
    Outcome {
        events,
        reply: Reply::Mixed(MixedReply {
            exist,
            get_replica_list,
            put_start,
            put_end,
            put_commit,
        }),
    }
}
