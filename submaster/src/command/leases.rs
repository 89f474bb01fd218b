//! Space lease commands: `lease_space` (allocate a range on several segments of
//! distinct nodes), `put_commit` (commit objects a client placed inside its
//! lease: one round trip and one append per put), `lease_return`, and the end of
//! leases whose time is up.

use hkvm_events::grant::Access;
use hkvm_events::rpc::space_lease::ALIGNMENT;
use hkvm_events::rpc::submaster::{
    ItemError, ItemResult, LeaseReturn, LeaseSpace, PutCommit, PutCommitItem, PutCommitReply,
    SpaceLease as GrantedLease, MAX_AVOIDED_NODES,
};
use hkvm_events::rpc::RpcError;
use hkvm_events::{KvEvent, PutCommitted, PutFlags};

use super::grants::Granting;
use super::objects::{locations, reserve, Placing};
use super::quota::QuotaCheck;
use super::{Outcome, Policy, Reply};
use crate::state::{CarveError, PendingPut, SpaceLease, State};

/// A lease takes at most this share (1/N) of the smallest mounted segment, so
/// that the leases of many clients, which count as used space, never crowd a
/// small pool's objects out (and its eviction watermark with them).
const LEASE_SHARE_OF_SEGMENT: u64 = 16;

/// The length a lease asked for `asked` bytes is granted: at most
/// [`LEASE_SHARE_OF_SEGMENT`] of the smallest mounted segment, aligned down
/// (zero when even that share is under one aligned unit).
fn granted_len(state: &State, asked: u64) -> u64 {
    let smallest = state
        .segments()
        .map(|(_, segment)| segment.allocator.size())
        .min()
        .unwrap_or(0);
    asked.min(smallest / LEASE_SHARE_OF_SEGMENT) / ALIGNMENT * ALIGNMENT
}

/// Grants a lease of `len` bytes (or less: see [`granted_len`]) on `replicas`
/// segments of distinct nodes.
pub(super) fn lease_space(
    state: &mut State,
    ask: LeaseSpace,
    now_ms: u64,
    policy: &Policy,
) -> Result<Outcome, RpcError> {
    if ask.len == 0 || ask.len > policy.max_space_lease {
        return Err(RpcError::invalid(format!(
            "a lease of {} bytes asked; 1 to {} allowed",
            ask.len, policy.max_space_lease
        )));
    }
    if ask.replicas == 0 || ask.replicas > policy.max_replicas {
        return Err(RpcError::invalid(format!(
            "{} replicas asked; 1 to {} allowed",
            ask.replicas, policy.max_replicas
        )));
    }
    let len = granted_len(state, ask.len);
    if len == 0 {
        return Ok(Outcome::reply(Reply::LeaseSpace(ItemResult::Err(
            ItemError::NoSpace {
                replicas: ask.replicas,
                size: ask.len,
            },
        ))));
    }
    if ask.avoid_nodes.len() > MAX_AVOIDED_NODES {
        return Err(RpcError::invalid(format!(
            "{} nodes to avoid; at most {MAX_AVOIDED_NODES}",
            ask.avoid_nodes.len()
        )));
    }
    let placing = Placing {
        size: len,
        replicas: ask.replicas,
        preferred: ask.preferred_segment.as_ref(),
        avoid: &ask.avoid_nodes,
    };
    let ranges = match reserve(state, placing, policy) {
        Ok(ranges) => ranges,
        Err(error) => return Ok(Outcome::reply(Reply::LeaseSpace(ItemResult::Err(error)))),
    };
    let granting = Granting {
        access: Access::Write,
        len,
        until_ms: now_ms.saturating_add(policy.space_lease_ttl_ms),
    };
    let located = locations(state, &ranges, policy, granting);
    let lease = SpaceLease::new(ranges, len, now_ms + policy.space_lease_ttl_ms);
    let len = lease.len;
    let id = state.leases.grant(lease);
    Ok(Outcome::reply(Reply::LeaseSpace(ItemResult::Ok(
        GrantedLease {
            id,
            len,
            ranges: located,
            ttl_ms: policy.space_lease_ttl_ms,
        },
    ))))
}

/// Commits objects written into leases: one `PutCommitted` per item that fits.
pub(super) fn put_commit(
    state: &mut State,
    commit: PutCommit,
    now_ms: u64,
    policy: &Policy,
) -> Outcome {
    let (events, results) = commit_all(state, commit.items, now_ms, policy);
    Outcome {
        events,
        reply: Reply::PutCommit(results),
    }
}

/// The commits of a `put_commit` request or of a mixed request's part: the
/// events to append and each item's result, in order.
pub(super) fn commit_all(
    state: &mut State,
    items: Vec<PutCommitItem>,
    now_ms: u64,
    policy: &Policy,
) -> (Vec<KvEvent>, PutCommitReply) {
    let mut events = Vec::new();
    let mut results: PutCommitReply = Vec::with_capacity(items.len());
    let mut seen = std::collections::HashSet::new();
    let mut quota = QuotaCheck::new(&policy.tenant_quotas);
    for item in items {
        if !seen.insert(item.key.clone()) {
            results.push(ItemResult::Err(ItemError::Invalid(
                "key repeated in one batch".into(),
            )));
            continue;
        }
        let result =
            commit_one(state, item, now_ms, policy, &mut quota).map(|event| events.extend(event));
        results.push(result.into());
    }
    (events, results)
}

fn commit_one(
    state: &mut State,
    item: PutCommitItem,
    now_ms: u64,
    policy: &Policy,
    quota: &mut QuotaCheck<'_>,
) -> Result<Option<KvEvent>, ItemError> {
    if item.put_id != 0
        && state
            .object(&item.key)
            .is_some_and(|object| object.put_id == item.put_id)
    {
        // This very commit sent again: it is done, nothing more to append.
        return Ok(None);
    }
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
    if state.object(&item.key).is_some() || state.pending.contains_key(&item.key) {
        return Err(ItemError::AlreadyExists);
    }
    quota.admit(state, &item.key, item.size)?;
    let lease = state
        .leases
        .get_mut(item.lease)
        .filter(|lease| lease.expires_ms > now_ms)
        .ok_or(ItemError::NoLease)?;
    let replicas = lease
        .carve(item.offset, item.size)
        .map_err(|error| ItemError::Invalid(carve_reason(error, &item)))?;
    let mut event = PutCommitted::new(
        item.key.clone(),
        item.size,
        item.checksum,
        state.placements(&replicas),
    );
    if item.hard_pin {
        event.flags = PutFlags(PutFlags::HARD_PIN);
    }
    event.put_id = item.put_id;
    // Applying the event takes these replicas as they are, as for a put_end.
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
    Ok(Some(KvEvent::PutCommitted(event)))
}

fn carve_reason(error: CarveError, item: &PutCommitItem) -> String {
    let what = match error {
        CarveError::Misaligned => "is not aligned",
        CarveError::OutOfRange => "reaches past the lease",
        CarveError::Taken => "overlaps an object committed into the lease",
    };
    format!("{} bytes at lease offset {} {what}", item.size, item.offset)
}

/// Ends a lease now (an unknown one is ended already).
pub(super) fn lease_return(state: &mut State, returned: &LeaseReturn) -> Outcome {
    end_lease(state, returned.lease);
    Outcome::reply(Reply::Done)
}

/// Ends every lease whose time is up.
pub(super) fn end_expired_leases(state: &mut State, now_ms: u64) {
    for id in state.leases.expired(now_ms) {
        tracing::debug!(lease = id, "space lease ended by time");
        end_lease(state, id);
    }
}

fn end_lease(state: &mut State, id: u64) {
    if let Some(lease) = state.leases.end(id) {
        for (replica, len) in lease.untaken() {
            state.free_replicas(&[replica], len);
        }
    }
}
