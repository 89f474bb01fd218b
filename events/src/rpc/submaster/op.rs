//! The sub-master operations: their subject tokens, and who may send each
//! (which decides the subject it goes on).

/// The sub-master operations and their subject suffixes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// [`MountSegment`](super::MountSegment).
    MountSegment,
    /// [`UnmountSegment`](super::UnmountSegment).
    UnmountSegment,
    /// [`Remount`](super::Remount).
    Remount,
    /// [`Ping`](super::Ping).
    Ping,
    /// [`PutStart`](super::PutStart).
    PutStart,
    /// [`PutEnd`](super::PutEnd).
    PutEnd,
    /// [`PutRevoke`](super::PutRevoke).
    PutRevoke,
    /// [`GetReplicaList`](super::GetReplicaList).
    GetReplicaList,
    /// [`Exist`](super::Exist).
    Exist,
    /// [`Remove`](super::Remove).
    Remove,
    /// [`RemoveAll`](super::RemoveAll).
    RemoveAll,
    /// [`RemoveMatching`](super::RemoveMatching).
    RemoveMatching,
    /// [`Status`](super::Status).
    Status,
    /// [`Mixed`](super::Mixed).
    Mixed,
    /// [`LeaseSpace`](super::LeaseSpace).
    LeaseSpace,
    /// [`PutCommit`](super::PutCommit).
    PutCommit,
    /// [`LeaseReturn`](super::LeaseReturn).
    LeaseReturn,
}

impl Op {
    /// Every operation.
    pub const ALL: [Op; 17] = [
        Op::MountSegment,
        Op::UnmountSegment,
        Op::Remount,
        Op::Ping,
        Op::PutStart,
        Op::PutEnd,
        Op::PutRevoke,
        Op::GetReplicaList,
        Op::Exist,
        Op::Remove,
        Op::RemoveAll,
        Op::RemoveMatching,
        Op::Status,
        Op::Mixed,
        Op::LeaseSpace,
        Op::PutCommit,
        Op::LeaseReturn,
    ];

    /// The last subject token.
    pub fn name(self) -> &'static str {
        match self {
            Op::MountSegment => "mount_segment",
            Op::UnmountSegment => "unmount_segment",
            Op::Remount => "remount",
            Op::Ping => "ping",
            Op::PutStart => "put_start",
            Op::PutEnd => "put_end",
            Op::PutRevoke => "put_revoke",
            Op::GetReplicaList => "get_replica_list",
            Op::Exist => "exist",
            Op::Remove => "remove",
            Op::RemoveAll => "remove_all",
            Op::RemoveMatching => "remove_matching",
            Op::Status => "status",
            Op::Mixed => "mixed",
            Op::LeaseSpace => "lease_space",
            Op::PutCommit => "put_commit",
            Op::LeaseReturn => "lease_return",
        }
    }

    /// The operation with this subject token.
    pub fn from_name(name: &str) -> Option<Op> {
        Op::ALL.into_iter().find(|op| op.name() == name)
    }
}

/// Who may send an operation, which decides the subject it goes on (and so,
/// under the generated NATS permissions, which users can send it at all).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Audience {
    /// Any client: [`submaster_rpc_subject`](crate::subject::submaster_rpc_subject).
    Anyone,
    /// The node the request names, about its own segments:
    /// [`submaster_node_subject`](crate::subject::submaster_node_subject).
    Node,
    /// The operator: [`submaster_admin_subject`](crate::subject::submaster_admin_subject).
    /// Removing everything, or everything matching a pattern, empties a pool
    /// that every engine shares, and its scan is long.
    Admin,
}

impl Op {
    /// Who may send this operation.
    pub fn audience(self) -> Audience {
        match self {
            Op::MountSegment | Op::UnmountSegment | Op::Remount => Audience::Node,
            Op::RemoveAll | Op::RemoveMatching => Audience::Admin,
            _ => Audience::Anyone,
        }
    }
}
