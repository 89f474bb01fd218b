//! Segment and node commands: mount, unmount, remount, ping.

use hkvm_events::rpc::submaster::{MountSegment, Remount, UnmountSegment};
use hkvm_events::rpc::{RpcError, RpcErrorCode};
use hkvm_events::{KvEvent, Removed, SegmentMounted, SegmentUnmounted};

use super::{chunked, Outcome, Policy, Reply};
use crate::state::State;

fn check_mount(
    state: &State,
    mount: &MountSegment,
    policy: &Policy,
) -> Result<Option<KvEvent>, RpcError> {
    if mount.size > policy.limits.max_segment_size {
        return Err(RpcError::invalid(format!(
            "segment of {} bytes is too large",
            mount.size
        )));
    }
    if mount.endpoint.len() > policy.limits.max_name_len {
        return Err(RpcError::invalid("endpoint is too long"));
    }
    if let Some(rdma) = &mount.rdma {
        if rdma.exchange.len() > policy.limits.max_name_len
            || rdma.device.len() > policy.limits.max_name_len
        {
            return Err(RpcError::invalid(
                "RDMA device name or exchange endpoint is too long",
            ));
        }
    }
    if let Some(segment) = state
        .slot_of(&mount.segment)
        .and_then(|slot| state.segment(slot))
    {
        if segment.node != mount.node {
            return Err(RpcError::invalid(format!(
                "segment {} belongs to node {}",
                mount.segment, segment.node
            )));
        }
        if segment.endpoint == mount.endpoint && segment.rdma == mount.rdma {
            // Already mounted as asked: idempotent, nothing to record.
            return Ok(None);
        }
    }
    Ok(Some(KvEvent::SegmentMounted(SegmentMounted {
        node: mount.node.clone(),
        segment: mount.segment.clone(),
        size: mount.size,
        endpoint: mount.endpoint.clone(),
        rdma: mount.rdma.clone(),
    })))
}

/// Mounts a segment (idempotent for an identical mount).
pub(super) fn mount(
    state: &mut State,
    mount: MountSegment,
    now_ms: u64,
    policy: &Policy,
) -> Result<Outcome, RpcError> {
    let event = check_mount(state, &mount, policy)?;
    state.liveness.insert(mount.node, now_ms);
    Ok(Outcome {
        events: event.into_iter().collect(),
        reply: Reply::Done,
    })
}

/// Re-announces all of a node's segments after a leader change.
pub(super) fn remount(
    state: &mut State,
    remount: Remount,
    now_ms: u64,
    policy: &Policy,
) -> Result<Outcome, RpcError> {
    let mut events = Vec::new();
    for mount in &remount.segments {
        if mount.node != remount.node {
            return Err(RpcError::invalid(
                "a remount may only name the calling node's segments",
            ));
        }
        events.extend(check_mount(state, mount, policy)?);
    }
    state.liveness.insert(remount.node, now_ms);
    Ok(Outcome {
        events,
        reply: Reply::Done,
    })
}

/// Unmounts a segment: its replicas go, and objects left without one are removed.
pub(super) fn unmount(state: &mut State, unmount: &UnmountSegment) -> Result<Outcome, RpcError> {
    let Some(slot) = state.slot_of(&unmount.segment) else {
        return Err(RpcError::new(
            RpcErrorCode::UnknownCaller,
            format!("segment {} is not mounted", unmount.segment),
        ));
    };
    if state
        .segment(slot)
        .is_some_and(|segment| segment.node != unmount.node)
    {
        return Err(RpcError::invalid(format!(
            "segment {} belongs to another node",
            unmount.segment
        )));
    }
    let lost = state.keys_only_on(&[slot]);
    let mut events = vec![KvEvent::SegmentUnmounted(SegmentUnmounted {
        node: unmount.node.clone(),
        segment: unmount.segment.clone(),
    })];
    events.extend(chunked(lost, |keys| KvEvent::Removed(Removed { keys })));
    Ok(Outcome {
        events,
        reply: Reply::Done,
    })
}
