//! Signing the data-port grants of the locations a leader hands out: a write
//! grant for a `put_start` reservation (until the put times out) and for a space
//! lease (until the lease ends), a read grant for each replica of a
//! `get_replica_list` (until its read lease ends). A node checks them with the
//! sub-cluster's key (`hkvm_events::grant`).

use hkvm_events::grant::{Access, GrantKey, GrantRequest};
use hkvm_events::rpc::submaster::ReplicaLocation;

/// The sub-cluster's grant key and the leader's clock in Unix time: commands
/// keep their state-clock `now_ms`, and a grant's expiry is Unix time.
#[derive(Debug, Clone)]
pub struct GrantSigner {
    key: GrantKey,
    unix_ms_at_zero: u64,
}

/// What one batch of locations is granted.
#[derive(Debug, Clone, Copy)]
pub(super) struct Granting {
    /// Read or write.
    pub access: Access,
    /// Bytes from each location's offset.
    pub len: u64,
    /// Until when, on the state clock.
    pub until_ms: u64,
}

impl GrantSigner {
    /// Signs with `key`; state-clock time 0 is Unix time `unix_ms_at_zero`.
    pub fn new(key: GrantKey, unix_ms_at_zero: u64) -> Self {
        Self {
            key,
            unix_ms_at_zero,
        }
    }

    /// Puts a grant of `granting` into `location`.
    pub(super) fn sign(&self, location: &mut ReplicaLocation, granting: Granting) {
        location.grant = Some(self.key.sign(GrantRequest {
            segment: location.segment.as_str(),
            access: granting.access,
            offset: location.offset,
            len: granting.len,
            expires_unix_ms: self.unix_ms_at_zero.saturating_add(granting.until_ms),
        }));
    }
}
