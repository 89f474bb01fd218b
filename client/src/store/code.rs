//! Mooncake Store's integer error codes, which programs written for Mooncake
//! compare results against, and how every HKVM failure maps onto them.

use hkvm_events::rpc::submaster::ItemError;
use hkvm_events::rpc::RpcErrorCode;

use crate::error::ClientErrorKind;
use crate::kv::KvErrorKind;
use crate::{ClientError, KvError};

/// The subset of Mooncake's `ErrorCode` values HKVM returns (same numbers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum ErrorCode {
    /// Success.
    Ok = 0,
    /// An internal failure.
    InternalError = -1,
    /// The destination buffer is too small for the value (or the staging buffer
    /// for a copying call).
    BufferOverflow = -10,
    /// No segment can hold the value: the pool is full.
    NoAvailableHandle = -200,
    /// Bad arguments: a batch length mismatch, an unregistered buffer, a store that
    /// is not set up or is closed, an unsupported option.
    InvalidParams = -600,
    /// A put could not be committed.
    InvalidWrite = -700,
    /// The key does not exist.
    ObjectNotFound = -704,
    /// The key exists already (a put maps this to success).
    ObjectAlreadyExists = -705,
    /// The object is leased by a reader; remove with `force`.
    ObjectHasLease = -706,
    /// Moving bytes to or from a node failed, or no replica held intact bytes.
    TransferFail = -800,
    /// A request to a master failed (none answered, or it stayed busy).
    RpcFail = -900,
    /// A request to a master got no answer in time.
    RpcTimeout = -901,
    /// The operation is not available in this mode (a dummy client, say).
    UnavailableInCurrentMode = -1011,
    /// The put would take its tenant past its quota.
    TenantQuotaExceeded = -1700,
}

impl ErrorCode {
    /// The integer a Python caller sees.
    pub fn value(self) -> i32 {
        self as i32
    }

    /// The code of a sub-master's per-item refusal.
    pub fn of_item(error: &ItemError) -> Self {
        match error {
            ItemError::NotFound => Self::ObjectNotFound,
            ItemError::AlreadyExists => Self::ObjectAlreadyExists,
            ItemError::NoSpace { .. } => Self::NoAvailableHandle,
            ItemError::Leased => Self::ObjectHasLease,
            ItemError::NoPendingPut | ItemError::NoLease => Self::InvalidWrite,
            ItemError::Invalid(_) => Self::InvalidParams,
            ItemError::QuotaExceeded { .. } => Self::TenantQuotaExceeded,
        }
    }

    /// The code of a failed metadata call.
    pub fn of_client(error: &ClientError) -> Self {
        match error.kind() {
            ClientErrorKind::Rpc => match error.rpc_code() {
                Some(RpcErrorCode::InvalidRequest) => Self::InvalidParams,
                _ => Self::RpcFail,
            },
            ClientErrorKind::Timeout => Self::RpcTimeout,
            ClientErrorKind::Busy
            | ClientErrorKind::NotLeader
            | ClientErrorKind::NoResponders
            | ClientErrorKind::Transport
            | ClientErrorKind::Codec => Self::RpcFail,
        }
    }

    /// The code of a failed put or get.
    pub fn of_kv(error: &KvError) -> Self {
        match (error.kind(), error) {
            (_, KvError::Metadata(error)) => Self::of_client(error),
            (_, KvError::Item { error, .. }) => Self::of_item(error),
            (_, KvError::Unresolved { source, .. }) => Self::of_client(source),
            (KvErrorKind::NotFound, _) => Self::ObjectNotFound,
            (KvErrorKind::BufferTooSmall, _) => Self::BufferOverflow,
            (KvErrorKind::SizeMismatch, _) => Self::InvalidParams,
            (KvErrorKind::Write | KvErrorKind::Integrity, _) => Self::TransferFail,
            (KvErrorKind::Metadata(_) | KvErrorKind::Item | KvErrorKind::Unresolved, _) => {
                Self::InternalError
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_numbers_are_mooncakes() {
        assert_eq!(ErrorCode::ObjectNotFound.value(), -704);
        assert_eq!(ErrorCode::InvalidParams.value(), -600);
        assert_eq!(ErrorCode::NoAvailableHandle.value(), -200);
        assert_eq!(ErrorCode::ObjectHasLease.value(), -706);
        assert_eq!(ErrorCode::BufferOverflow.value(), -10);
        assert_eq!(
            ErrorCode::of_kv(&KvError::NotFound { key: "k".into() }),
            ErrorCode::ObjectNotFound
        );
        assert_eq!(
            ErrorCode::of_kv(&KvError::BufferTooSmall {
                key: "k".into(),
                size: 2,
                capacity: 1
            }),
            ErrorCode::BufferOverflow
        );
        assert_eq!(
            ErrorCode::of_item(&ItemError::NoSpace {
                replicas: 1,
                size: 1
            }),
            ErrorCode::NoAvailableHandle
        );
    }
}
