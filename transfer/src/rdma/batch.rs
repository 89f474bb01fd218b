//! Turning a batch of reads or writes into RDMA work requests, without a device:
//! every operation is checked against the peer's advertised regions, cut into
//! messages no larger than the port's maximum and the staging buffer, and grouped
//! into rounds that fit the staging buffer and the send queue. An operation whose
//! local bytes lie in caller memory registered with the transport moves straight
//! from (or into) that memory and takes no staging space. Only the last request of a
//! round is signaled: an RC queue pair completes in order, so its completion means
//! the whole round is done.

use crate::error::TransferError;
use crate::region::check_range;
use crate::transport::{ReadInto, WriteOp};

use super::exchange::RemoteRegion;

/// An operation's local bytes in registered caller memory: where they start and
/// the local key of the registration that holds them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirectBuffer {
    /// The virtual address of the operation's first byte.
    pub addr: u64,
    /// The local key of the memory region holding it.
    pub lkey: u32,
}

/// One operation as the planner sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanOp<'a> {
    /// The peer's region.
    pub region: &'a str,
    /// Where in the region.
    pub offset: u64,
    /// How many bytes.
    pub len: u64,
    /// Its local bytes when they are registered memory (`None`: staged).
    pub direct: Option<DirectBuffer>,
}

impl<'a> From<&WriteOp<'a>> for PlanOp<'a> {
    fn from(op: &WriteOp<'a>) -> Self {
        Self {
            region: op.region,
            offset: op.offset,
            len: op.data.len() as u64,
            direct: None,
        }
    }
}

impl<'a> From<&ReadInto<'a>> for PlanOp<'a> {
    fn from(op: &ReadInto<'a>) -> Self {
        Self {
            region: op.region,
            offset: op.offset,
            len: op.buf.len() as u64,
            direct: None,
        }
    }
}

/// The limits a plan respects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanLimits {
    /// The largest message of the port (`max_msg_sz`).
    pub max_message: u32,
    /// The size of the registered staging buffer.
    pub staging_bytes: u64,
    /// Work requests in flight at once (at most the send queue depth).
    pub max_outstanding: usize,
}

/// Where a work request's local bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalBytes {
    /// At this offset of the batch's staging buffer (copied in before a write,
    /// out after a read).
    Staged {
        /// The offset in the staging buffer.
        offset: u64,
    },
    /// In registered caller memory, moved without a copy.
    Direct(DirectBuffer),
}

/// One RDMA READ or WRITE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkRequest {
    /// Its id (position in the batch's plan).
    pub wr_id: u64,
    /// The operation it belongs to.
    pub op: usize,
    /// Where its bytes start inside that operation.
    pub op_offset: u64,
    /// The remote virtual address.
    pub remote_addr: u64,
    /// The remote key.
    pub rkey: u32,
    /// Where its local bytes are.
    pub local: LocalBytes,
    /// Its length.
    pub len: u32,
    /// Whether it asks for a completion.
    pub signaled: bool,
}

impl WorkRequest {
    /// Its offset in the staging buffer, when it is staged.
    pub fn staging_offset(&self) -> Option<u64> {
        match self.local {
            LocalBytes::Staged { offset } => Some(offset),
            LocalBytes::Direct(_) => None,
        }
    }
}

/// Work requests posted together and completed by one signaled completion.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Round {
    /// The requests, in posting order; the last one is signaled.
    pub requests: Vec<WorkRequest>,
    /// Staging bytes the round uses.
    pub staging_bytes: u64,
}

/// Plans a batch.
///
/// # Errors
/// [`TransferError::UnknownRegion`] or [`TransferError::OutOfBounds`] for an
/// operation the peer's regions do not cover; [`TransferError::Invalid`] for
/// zero limits.
pub fn plan(
    ops: &[PlanOp<'_>],
    remote: &[RemoteRegion],
    limits: PlanLimits,
) -> Result<Vec<Round>, TransferError> {
    if limits.max_message == 0 || limits.staging_bytes == 0 || limits.max_outstanding == 0 {
        return Err(TransferError::Invalid(
            "RDMA plan limits must be positive".into(),
        ));
    }
    let staged_chunk = u64::from(limits.max_message).min(limits.staging_bytes);
    let direct_chunk = u64::from(limits.max_message);
    let mut rounds = Vec::new();
    let mut round = Round::default();
    let mut next_id = 0u64;
    for (index, op) in ops.iter().enumerate() {
        let region = remote
            .iter()
            .find(|r| r.id.as_str() == op.region)
            .ok_or_else(|| TransferError::UnknownRegion {
                region: op.region.to_owned(),
            })?;
        check_range(op.region, region.len, op.offset, op.len)?;
        let chunk = if op.direct.is_some() {
            direct_chunk
        } else {
            staged_chunk
        };
        let mut done = 0u64;
        while done < op.len {
            let len = (op.len - done).min(chunk);
            let staged = if op.direct.is_some() { 0 } else { len };
            if round.staging_bytes + staged > limits.staging_bytes
                || round.requests.len() == limits.max_outstanding
            {
                close(&mut round, &mut rounds);
            }
            let local = match op.direct {
                Some(direct) => LocalBytes::Direct(DirectBuffer {
                    addr: direct.addr + done,
                    lkey: direct.lkey,
                }),
                None => LocalBytes::Staged {
                    offset: round.staging_bytes,
                },
            };
            round.requests.push(WorkRequest {
                wr_id: next_id,
                op: index,
                op_offset: done,
                remote_addr: region.addr + op.offset + done,
                rkey: region.rkey,
                local,
                // `chunk` is at most `max_message`, a u32.
                len: len as u32,
                signaled: false,
            });
            next_id += 1;
            round.staging_bytes += staged;
            done += len;
        }
    }
    close(&mut round, &mut rounds);
    Ok(rounds)
}

/// Whether any request of the plan goes through the staging buffer.
pub fn needs_staging(rounds: &[Round]) -> bool {
    rounds.iter().any(|round| round.staging_bytes > 0)
}

fn close(round: &mut Round, rounds: &mut Vec<Round>) {
    if let Some(last) = round.requests.last_mut() {
        last.signaled = true;
        rounds.push(std::mem::take(round));
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::region::RegionId;
    use crate::ErrorKind;

    fn regions() -> Vec<RemoteRegion> {
        vec![RemoteRegion {
            id: RegionId::new("seg").unwrap(),
            addr: 0x1000_0000,
            rkey: 42,
            len: 1 << 20,
        }]
    }

    const LIMITS: PlanLimits = PlanLimits {
        max_message: 4096,
        staging_bytes: 16 * 1024,
        max_outstanding: 3,
    };

    #[test]
    fn large_operations_are_cut_and_rounds_fit_the_staging_buffer() {
        let ops = [
            PlanOp {
                region: "seg",
                offset: 0,
                len: 10_000,
                direct: None,
            },
            PlanOp {
                region: "seg",
                offset: 1 << 19,
                len: 100,
                direct: None,
            },
            PlanOp {
                region: "seg",
                offset: 8,
                len: 20_000,
                direct: None,
            },
        ];
        let rounds = plan(&ops, &regions(), LIMITS).unwrap();
        let all: Vec<&WorkRequest> = rounds.iter().flat_map(|r| &r.requests).collect();
        // Every byte of every op is covered exactly once, in order.
        for (index, op) in ops.iter().enumerate() {
            let parts: Vec<_> = all.iter().filter(|w| w.op == index).collect();
            let mut covered = 0u64;
            for part in parts {
                assert_eq!(part.op_offset, covered);
                assert_eq!(part.remote_addr, 0x1000_0000 + op.offset + covered);
                assert!(part.len <= 4096);
                covered += u64::from(part.len);
            }
            assert_eq!(covered, op.len);
        }
        for round in &rounds {
            assert!(round.staging_bytes <= LIMITS.staging_bytes);
            assert!(round.requests.len() <= LIMITS.max_outstanding);
            let signaled: Vec<bool> = round.requests.iter().map(|w| w.signaled).collect();
            assert_eq!(signaled.iter().filter(|&&s| s).count(), 1);
            assert_eq!(signaled.last(), Some(&true));
            let mut at = 0;
            for request in &round.requests {
                assert_eq!(request.staging_offset(), Some(at));
                at += u64::from(request.len);
            }
        }
        let ids: Vec<u64> = all.iter().map(|w| w.wr_id).collect();
        assert_eq!(ids, (0..all.len() as u64).collect::<Vec<_>>());
    }

    #[test]
    fn bad_operations_are_typed_errors_before_anything_is_posted() {
        let unknown = [PlanOp {
            region: "other",
            offset: 0,
            len: 1,
            direct: None,
        }];
        assert_eq!(
            plan(&unknown, &regions(), LIMITS).unwrap_err().kind(),
            ErrorKind::UnknownRegion
        );
        let outside = [PlanOp {
            region: "seg",
            offset: (1 << 20) - 1,
            len: 2,
            direct: None,
        }];
        assert_eq!(
            plan(&outside, &regions(), LIMITS).unwrap_err().kind(),
            ErrorKind::OutOfBounds
        );
        let zero = PlanLimits {
            max_outstanding: 0,
            ..LIMITS
        };
        assert_eq!(
            plan(&[], &regions(), zero).unwrap_err().kind(),
            ErrorKind::Invalid
        );
        assert!(plan(&[], &regions(), LIMITS).unwrap().is_empty());
    }

    #[test]
    fn registered_caller_memory_moves_directly_and_takes_no_staging_space() {
        let direct = DirectBuffer {
            addr: 0x7f00_0000_0000,
            lkey: 7,
        };
        let ops = [
            // Larger than the staging buffer: direct requests are cut only at
            // the port's message size.
            PlanOp {
                region: "seg",
                offset: 0,
                len: 3 * 4096 + 10,
                direct: Some(direct),
            },
            PlanOp {
                region: "seg",
                offset: 1 << 19,
                len: 100,
                direct: None,
            },
        ];
        let limits = PlanLimits {
            staging_bytes: 1024,
            max_outstanding: 16,
            ..LIMITS
        };
        let rounds = plan(&ops, &regions(), limits).unwrap();
        let all: Vec<&WorkRequest> = rounds.iter().flat_map(|r| &r.requests).collect();
        let direct_parts: Vec<_> = all.iter().filter(|w| w.op == 0).collect();
        assert_eq!(direct_parts.len(), 4);
        for part in &direct_parts {
            assert_eq!(
                part.local,
                LocalBytes::Direct(DirectBuffer {
                    addr: direct.addr + part.op_offset,
                    lkey: 7
                })
            );
            assert_eq!(part.remote_addr, 0x1000_0000 + part.op_offset);
        }
        let staged: Vec<_> = all.iter().filter(|w| w.op == 1).collect();
        assert_eq!(staged.len(), 1);
        assert_eq!(staged[0].staging_offset(), Some(0));
        // Only the staged op's bytes count against the staging buffer.
        assert_eq!(rounds.iter().map(|r| r.staging_bytes).sum::<u64>(), 100);
        assert!(needs_staging(&rounds));
        let only_direct = plan(&ops[..1], &regions(), limits).unwrap();
        assert!(!needs_staging(&only_direct));
        assert_eq!(only_direct.len(), 1, "one round: 4 requests, none staged");
    }
}
