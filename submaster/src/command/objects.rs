//! Object commands: put_start / put_end / put_revoke, get_replica_list and
//! remove (the mass removals are in `removal`).

use hkvm_events::grant::Access;
use hkvm_events::rpc::submaster::{
    GetReplicaList, GetReplicaListReply, ItemError, ItemResult, PutEnd, PutEndItem, PutEndReply,
    PutRevoke, PutStart, PutStartItem, PutStartReply, Remove, ReplicaList, ReplicaLocation,
    MAX_AVOIDED_NODES,
};
use hkvm_events::{KvEvent, NodeId, PutCommitted, PutFlags, Removed, SegmentId};

use super::grants::Granting;
use super::quota::QuotaCheck;
use super::{chunked, Outcome, Policy, Reply};
use crate::placement;
use crate::state::{PendingPut, Replica, State};

/// Where `replicas` are, each with a grant of `granting` when the policy signs
/// grants.
pub(super) fn locations(
    state: &State,
    replicas: &[Replica],
    policy: &Policy,
    granting: Granting,
) -> Vec<ReplicaLocation> {
    replicas
        .iter()
        .filter_map(|replica| {
            let segment = state.segment(replica.slot)?;
            let mut location = ReplicaLocation {
                node: segment.node.clone(),
                segment: segment.id.clone(),
                endpoint: segment.endpoint.clone(),
                rdma: segment.rdma.clone(),
                offset: replica.offset,
                grant: None,
            };
            if let Some(signer) = &policy.grants {
                signer.sign(&mut location, granting);
            }
            Some(location)
        })
        .collect()
}

/// The write grant of a reservation started at `started_ms`: until it times out.
fn reservation(size: u64, started_ms: u64, policy: &Policy) -> Granting {
    Granting {
        access: Access::Write,
        len: size,
        until_ms: started_ms.saturating_add(policy.put_timeout_ms),
    }
}

fn start_one(
    state: &mut State,
    item: PutStartItem,
    now_ms: u64,
    policy: &Policy,
    quota: &mut QuotaCheck<'_>,
) -> Result<Vec<ReplicaLocation>, ItemError> {
    policy
        .limits
        .check_key(&item.key)
        .map_err(|e| ItemError::Invalid(e.to_string()))?;
    if item.size == 0 || item.size > policy.limits.max_object_size {
        return Err(ItemError::Invalid(format!(
            "size {} is out of range",
            item.size
        )));
    }
    if item.replicas == 0 || item.replicas > policy.max_replicas {
        return Err(ItemError::Invalid(format!(
            "{} replicas asked; 1 to {} allowed",
            item.replicas, policy.max_replicas
        )));
    }
    if let Some(pending) = state.pending.get(&item.key) {
        if item.put_id != 0 && pending.put_id == item.put_id {
            // The same put's start sent again (its reply was lost): the same
            // reservation, not a second one.
            let granting = reservation(pending.size, pending.started_ms, policy);
            return Ok(locations(state, &pending.replicas, policy, granting));
        }
        return Err(ItemError::AlreadyExists);
    }
    if state.object(&item.key).is_some() {
        return Err(ItemError::AlreadyExists);
    }
    quota.admit(state, &item.key, item.size)?;
    if item.avoid_nodes.len() > MAX_AVOIDED_NODES {
        return Err(ItemError::Invalid(format!(
            "{} nodes to avoid; at most {MAX_AVOIDED_NODES}",
            item.avoid_nodes.len()
        )));
    }
    let replicas = reserve(
        state,
        Placing {
            size: item.size,
            replicas: item.replicas,
            preferred: item.preferred_segment.as_ref(),
            avoid: &item.avoid_nodes,
        },
        policy,
    )?;
    let reply = locations(
        state,
        &replicas,
        policy,
        reservation(item.size, now_ms, policy),
    );
    state.pending.insert(
        item.key,
        PendingPut {
            size: item.size,
            replicas,
            started_ms: now_ms,
            hard_pin: item.hard_pin,
            put_id: item.put_id,
        },
    );
    Ok(reply)
}

/// What one reservation asks for.
pub(super) struct Placing<'a> {
    /// Bytes on each segment.
    pub(super) size: u64,
    /// Segments, on distinct nodes.
    pub(super) replicas: u32,
    /// The segment to take first when it has room.
    pub(super) preferred: Option<&'a SegmentId>,
    /// Nodes to take nothing on.
    pub(super) avoid: &'a [NodeId],
}

/// Allocates `size` bytes on `replicas` segments of distinct nodes, none of
/// them avoided (the first on `preferred` when it has room); nothing is held
/// when there is no room.
pub(super) fn reserve(
    state: &mut State,
    placing: Placing<'_>,
    policy: &Policy,
) -> Result<Vec<Replica>, ItemError> {
    let Placing {
        size,
        replicas,
        preferred,
        avoid,
    } = placing;
    let no_space = ItemError::NoSpace { replicas, size };
    let preferred = preferred.and_then(|s| state.slot_of(s));
    let slots = placement::choose(
        state,
        size,
        replicas as usize,
        preferred,
        avoid,
        policy.strategy,
    );
    if slots.len() < replicas as usize {
        return Err(no_space);
    }
    let mut reserved = Vec::with_capacity(slots.len());
    for slot in slots {
        match state
            .segment_mut(slot)
            .and_then(|segment| segment.allocator.allocate(size))
        {
            Some(offset) => reserved.push(Replica { slot, offset }),
            None => {
                // Cannot happen (choose() checked the room), but never leak space.
                state.free_replicas(&reserved, size);
                return Err(no_space);
            }
        }
    }
    Ok(reserved)
}

/// Reserves space for each item on distinct nodes (ephemeral: no event yet).
pub(super) fn put_start(state: &mut State, put: PutStart, now_ms: u64, policy: &Policy) -> Outcome {
    Outcome::reply(Reply::PutStart(start_all(state, put.items, now_ms, policy)))
}

/// The reservations of a `put_start` request or of a mixed request's part, in
/// order.
pub(super) fn start_all(
    state: &mut State,
    items: Vec<PutStartItem>,
    now_ms: u64,
    policy: &Policy,
) -> PutStartReply {
    let mut quota = QuotaCheck::new(&policy.tenant_quotas);
    items
        .into_iter()
        .map(|item| ItemResult::from(start_one(state, item, now_ms, policy, &mut quota)))
        .collect()
}

/// Commits pending puts: one `PutCommitted` event per item that had one.
pub(super) fn put_end(state: &mut State, put: PutEnd) -> Outcome {
    let (events, results) = end_all(state, put.items);
    Outcome {
        events,
        reply: Reply::PutEnd(results),
    }
}

/// The completions of a `put_end` request or of a mixed request's part: the
/// events to append and each item's result, in order.
pub(super) fn end_all(state: &State, items: Vec<PutEndItem>) -> (Vec<KvEvent>, PutEndReply) {
    let mut events = Vec::new();
    let mut results = Vec::with_capacity(items.len());
    let mut seen = std::collections::HashSet::new();
    for item in items {
        // Without ids (0 on either side) a reservation is matched by key alone.
        let pending = state.pending.get(&item.key).filter(|pending| {
            item.put_id == 0 || pending.put_id == 0 || pending.put_id == item.put_id
        });
        let Some(pending) = pending else {
            // Not pending: committed already by this very put (a put_end sent
            // again), or its reservation is gone and it never will be.
            let committed = item.put_id != 0
                && state
                    .object(&item.key)
                    .is_some_and(|object| object.put_id == item.put_id);
            results.push(if committed {
                ItemResult::Ok(())
            } else {
                ItemResult::Err(ItemError::NoPendingPut)
            });
            continue;
        };
        if !seen.insert(item.key.clone()) {
            results.push(ItemResult::Err(ItemError::Invalid(
                "key repeated in one batch".into(),
            )));
            continue;
        }
        let mut event = PutCommitted::new(
            item.key,
            pending.size,
            item.checksum,
            state.placements(&pending.replicas),
        );
        if pending.hard_pin {
            event.flags = PutFlags(PutFlags::HARD_PIN);
        }
        event.put_id = if pending.put_id != 0 {
            pending.put_id
        } else {
            item.put_id
        };
        events.push(KvEvent::PutCommitted(event));
        results.push(ItemResult::Ok(()));
    }
    (events, results)
}

/// Which keys are complete objects.
pub(super) fn exist(state: &State, keys: &[String]) -> Vec<bool> {
    keys.iter().map(|key| state.object(key).is_some()).collect()
}

/// Abandons pending puts and frees their space (ephemeral: no event).
pub(super) fn put_revoke(state: &mut State, revoke: PutRevoke) -> Outcome {
    let results = revoke
        .keys
        .iter()
        .map(|key| match state.pending.remove(key) {
            Some(pending) => {
                state.free_replicas(&pending.replicas, pending.size);
                ItemResult::Ok(())
            }
            None => ItemResult::Err(ItemError::NoPendingPut),
        })
        .collect();
    Outcome::reply(Reply::PutRevoke(results))
}

/// Where complete objects are; each found object gets a read lease.
pub(super) fn get_replica_list(
    state: &mut State,
    get: GetReplicaList,
    now_ms: u64,
    policy: &Policy,
) -> Outcome {
    let lease_ms = if get.lease { policy.lease_ttl_ms } else { 0 };
    Outcome::reply(Reply::GetReplicaList(locate_all(
        state, &get.keys, now_ms, lease_ms, policy,
    )))
}

/// Each key's replicas, leased for `lease_ms` (none when 0).
pub(super) fn locate_all(
    state: &mut State,
    keys: &[String],
    now_ms: u64,
    lease_ms: u64,
    policy: &Policy,
) -> GetReplicaListReply {
    let lease_until = now_ms + lease_ms;
    // A read grant lasts as long as a read lease would, leased or not: after
    // that the space may hold another object.
    keys.iter()
        .map(|key| {
            let Some(object) = state.object_mut(key) else {
                return ItemResult::Err(ItemError::NotFound);
            };
            if lease_ms > 0 {
                object.lease_until_ms = object.lease_until_ms.max(lease_until);
            }
            let (size, checksum, replicas) =
                (object.size, object.checksum, object.replicas.clone());
            ItemResult::Ok(ReplicaList {
                size,
                checksum,
                replicas: locations(
                    state,
                    &replicas,
                    policy,
                    Granting {
                        access: Access::Read,
                        len: size,
                        until_ms: now_ms.saturating_add(policy.lease_ttl_ms),
                    },
                ),
                lease_ms,
            })
        })
        .collect()
}

/// Whether an object may be removed or evicted now without `force`.
pub(crate) fn is_leased(state: &State, lease_until_ms: u64, now_ms: u64) -> bool {
    lease_until_ms > now_ms || state.grace_until_ms > now_ms
}

/// Removes objects (leased ones only with `force`).
pub(super) fn remove(state: &mut State, remove: Remove, now_ms: u64) -> Outcome {
    let mut removed = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut results = Vec::with_capacity(remove.keys.len());
    for key in remove.keys {
        let result = match state.object(&key) {
            None => Err(ItemError::NotFound),
            Some(object) if !remove.force && is_leased(state, object.lease_until_ms, now_ms) => {
                Err(ItemError::Leased)
            }
            Some(_) if !seen.insert(key.clone()) => Err(ItemError::NotFound),
            Some(_) => {
                removed.push(key);
                Ok(())
            }
        };
        results.push(ItemResult::from(result));
    }
    Outcome {
        events: chunked(removed, |keys| KvEvent::Removed(Removed { keys })),
        reply: Reply::Remove(results),
    }
}
