//! The one error type of the transfer layer, and the [`ErrorKind`] callers match on.

use std::time::Duration;

/// What kind of failure a [`TransferError`] is, for callers that decide what to do
/// next (try another replica, retry, give up) without parsing messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The region is not registered (locally or at the remote end).
    UnknownRegion,
    /// The range does not fit inside the region.
    OutOfBounds,
    /// One operation or frame is larger than the configured limit.
    TooLarge,
    /// A frame or payload failed its checksum.
    Corrupt,
    /// The peer spoke something that is not this protocol (magic, version, ids).
    Protocol,
    /// The connection could not be made.
    Connect,
    /// The connection was lost before the operation completed.
    Disconnected,
    /// The operation did not complete in time.
    Timeout,
    /// A bad argument (an invalid region id, a duplicate registration, a bad config).
    Invalid,
    /// No RDMA device is present, or the RDMA feature is not compiled in.
    NoDevice,
    /// A verbs call or a work completion failed.
    Rdma,
    /// Forward error correction could not encode or decode.
    Fec,
    /// A WAN copy gave up after its retransmission rounds.
    Exhausted,
    /// A local I/O failure (allocating a segment, binding a listener).
    Io,
    /// The data port refused the operation: no grant, or one that does not allow
    /// it (forged, expired, another range or access).
    Denied,
}

/// Why a transfer operation failed.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// The region is not registered here.
    #[error("unknown region {region:?}")]
    UnknownRegion {
        /// The region id asked for.
        region: String,
    },
    /// The range does not fit inside the region.
    #[error("range {offset}+{len} is outside region {region:?} of {size} bytes")]
    OutOfBounds {
        /// The region.
        region: String,
        /// Start of the range.
        offset: u64,
        /// Length of the range.
        len: u64,
        /// Size of the region.
        size: u64,
    },
    /// An operation larger than the limit.
    #[error("{what} of {len} bytes is larger than the limit of {max}")]
    TooLarge {
        /// What was too large.
        what: &'static str,
        /// Its size.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A frame or a payload failed its checksum.
    #[error("corrupted {what}")]
    Corrupt {
        /// Which part (header, payload, shard).
        what: &'static str,
    },
    /// The peer does not speak this protocol, or answered out of order.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// Connecting failed.
    #[error("connecting to {endpoint}: {source}")]
    Connect {
        /// The endpoint dialled.
        endpoint: String,
        /// The socket error.
        source: std::io::Error,
    },
    /// The connection was lost in the middle of an operation.
    #[error("connection to {endpoint} lost: {source}")]
    Disconnected {
        /// The peer.
        endpoint: String,
        /// The socket error (`UnexpectedEof` when the peer closed).
        source: std::io::Error,
    },
    /// The operation did not finish in time.
    #[error("{what} with {endpoint} timed out after {after:?}")]
    Timeout {
        /// What was being done.
        what: &'static str,
        /// The peer.
        endpoint: String,
        /// The deadline.
        after: Duration,
    },
    /// The remote end refused operation `index` of a batch.
    #[error("operation {index} refused by {endpoint}: {kind:?}: {message}")]
    Remote {
        /// The peer.
        endpoint: String,
        /// The operation's position in its batch.
        index: usize,
        /// The kind of the remote failure.
        kind: ErrorKind,
        /// The remote end's explanation.
        message: String,
    },
    /// A bad argument.
    #[error("invalid: {0}")]
    Invalid(String),
    /// The data port's admission refused the operation.
    #[error("denied: {0}")]
    Denied(String),
    /// No RDMA device, or no RDMA support in this build.
    #[error("no RDMA device: {0}")]
    NoDevice(String),
    /// RDMA was asked for (a named device, or any) and this host has no such device.
    #[error(
        "no RDMA device {} on this host (found: {}){}",
        wanted_name(.wanted),
        found_names(.found),
        detail_suffix(.detail)
    )]
    NoRdmaDevice {
        /// The device asked for (`None`: any device).
        wanted: Option<String>,
        /// The devices this host has (empty when it has none, or no RDMA support).
        found: Vec<String>,
        /// Why the host could not even list devices, when it could not.
        detail: Option<String>,
    },
    /// A verbs call failed.
    #[error("RDMA {call} failed: {reason}")]
    Rdma {
        /// The verbs call or completion.
        call: &'static str,
        /// The errno text or the completion status.
        reason: String,
    },
    /// Forward error correction failed.
    #[error("FEC: {0}")]
    Fec(String),
    /// A WAN copy gave up.
    #[error("WAN copy gave up after {rounds} rounds with {missing} stripes missing")]
    Exhausted {
        /// Rounds attempted.
        rounds: u32,
        /// Stripes still missing.
        missing: usize,
    },
    /// A local I/O failure.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The error.
        source: std::io::Error,
    },
}

impl TransferError {
    /// The kind of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::UnknownRegion { .. } => ErrorKind::UnknownRegion,
            Self::OutOfBounds { .. } => ErrorKind::OutOfBounds,
            Self::TooLarge { .. } => ErrorKind::TooLarge,
            Self::Corrupt { .. } => ErrorKind::Corrupt,
            Self::Protocol(_) => ErrorKind::Protocol,
            Self::Connect { .. } => ErrorKind::Connect,
            Self::Disconnected { .. } => ErrorKind::Disconnected,
            Self::Timeout { .. } => ErrorKind::Timeout,
            Self::Remote { kind, .. } => *kind,
            Self::Invalid(_) => ErrorKind::Invalid,
            Self::Denied(_) => ErrorKind::Denied,
            Self::NoDevice(_) | Self::NoRdmaDevice { .. } => ErrorKind::NoDevice,
            Self::Rdma { .. } => ErrorKind::Rdma,
            Self::Fec(_) => ErrorKind::Fec,
            Self::Exhausted { .. } => ErrorKind::Exhausted,
            Self::Io { .. } => ErrorKind::Io,
        }
    }

    /// Whether the failure says nothing about the data and the same operation may
    /// succeed on a fresh connection (lost connections, timeouts).
    pub fn is_transient(&self) -> bool {
        matches!(
            self.kind(),
            ErrorKind::Connect | ErrorKind::Disconnected | ErrorKind::Timeout
        )
    }
}

fn wanted_name(wanted: &Option<String>) -> String {
    match wanted {
        Some(name) => format!("{name:?}"),
        None => "(any)".to_owned(),
    }
}

fn found_names(found: &[String]) -> String {
    if found.is_empty() {
        "none".to_owned()
    } else {
        found.join(", ")
    }
}

fn detail_suffix(detail: &Option<String>) -> String {
    detail
        .as_ref()
        .map(|detail| format!("; {detail}"))
        .unwrap_or_default()
}

impl ErrorKind {
    /// The code of this kind on the wire (responses of the TCP protocol).
    pub fn code(self) -> u8 {
        match self {
            Self::UnknownRegion => 1,
            Self::OutOfBounds => 2,
            Self::TooLarge => 3,
            Self::Corrupt => 4,
            Self::Protocol => 5,
            Self::Connect => 6,
            Self::Disconnected => 7,
            Self::Timeout => 8,
            Self::Invalid => 9,
            Self::NoDevice => 10,
            Self::Rdma => 11,
            Self::Fec => 12,
            Self::Exhausted => 13,
            Self::Io => 14,
            Self::Denied => 15,
        }
    }

    /// The kind of a wire code; unknown codes (from a newer peer) are `Protocol`.
    pub fn from_code(code: u8) -> Self {
        match code {
            1 => Self::UnknownRegion,
            2 => Self::OutOfBounds,
            3 => Self::TooLarge,
            4 => Self::Corrupt,
            6 => Self::Connect,
            7 => Self::Disconnected,
            8 => Self::Timeout,
            9 => Self::Invalid,
            10 => Self::NoDevice,
            11 => Self::Rdma,
            12 => Self::Fec,
            13 => Self::Exhausted,
            14 => Self::Io,
            15 => Self::Denied,
            _ => Self::Protocol,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_codes_round_trip() {
        for code in 1..=15u8 {
            assert_eq!(ErrorKind::from_code(code).code(), code);
        }
        assert_eq!(ErrorKind::from_code(0), ErrorKind::Protocol);
        assert_eq!(ErrorKind::from_code(200), ErrorKind::Protocol);
    }

    #[test]
    fn a_missing_rdma_device_names_what_was_asked_and_found() {
        let error = TransferError::NoRdmaDevice {
            wanted: Some("mlx5_9".into()),
            found: vec!["mlx5_0".into(), "mlx5_1".into()],
            detail: None,
        };
        assert_eq!(error.kind(), ErrorKind::NoDevice);
        assert_eq!(
            error.to_string(),
            "no RDMA device \"mlx5_9\" on this host (found: mlx5_0, mlx5_1)"
        );
        let error = TransferError::NoRdmaDevice {
            wanted: None,
            found: Vec::new(),
            detail: Some("ibv_get_device_list: Function not implemented".into()),
        };
        assert_eq!(
            error.to_string(),
            "no RDMA device (any) on this host (found: none); \
             ibv_get_device_list: Function not implemented"
        );
        assert!(!error.is_transient());
    }
}
