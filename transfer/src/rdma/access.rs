//! What peers may do through a registration or a queue pair. Only a node's
//! served segments, and the queue pairs that accept peers, allow remote reads
//! and writes; a client's registered buffers, its staging pool and the queue
//! pairs it opens allow local writes only, so no peer reads or writes a client's
//! memory through them.

/// `IBV_ACCESS_LOCAL_WRITE`.
pub const LOCAL_WRITE: u32 = 1;
/// `IBV_ACCESS_REMOTE_WRITE`.
pub const REMOTE_WRITE: u32 = 1 << 1;
/// `IBV_ACCESS_REMOTE_READ`.
pub const REMOTE_READ: u32 = 1 << 2;

/// The access one registration or queue pair grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Memory peers read and write (a served segment), or a queue pair that
    /// serves them.
    Served,
    /// Memory only this process's own operations touch (caller buffers, staging
    /// buffers), or a queue pair that only initiates operations.
    Local,
}

impl Access {
    /// The verbs access flags (`ibv_access_flags`) it stands for.
    pub fn verbs_flags(self) -> u32 {
        match self {
            Self::Served => LOCAL_WRITE | REMOTE_READ | REMOTE_WRITE,
            Self::Local => LOCAL_WRITE,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_served_memory_and_serving_queue_pairs_allow_remote_access() {
        assert_eq!(
            Access::Local.verbs_flags() & (REMOTE_READ | REMOTE_WRITE),
            0
        );
        assert_eq!(Access::Local.verbs_flags(), LOCAL_WRITE);
        assert_eq!(
            Access::Served.verbs_flags(),
            LOCAL_WRITE | REMOTE_READ | REMOTE_WRITE
        );
    }

    #[cfg(feature = "rdma")]
    #[test]
    fn the_flags_are_the_verbs_values() {
        use rdma_sys::ibv_access_flags as verbs;
        assert_eq!(verbs::IBV_ACCESS_LOCAL_WRITE.0, LOCAL_WRITE);
        assert_eq!(verbs::IBV_ACCESS_REMOTE_WRITE.0, REMOTE_WRITE);
        assert_eq!(verbs::IBV_ACCESS_REMOTE_READ.0, REMOTE_READ);
    }
}
