//! The RDMA verbs backend. What needs no device is always compiled and tested: the
//! out-of-band exchange of queue pair info over TCP ([`exchange`]), the planning of
//! batches into work requests ([`batch`]), the routing of completions to the batch
//! that posted them ([`completion`]), registered memory and the pool of staging
//! buffers ([`staging`]), registered caller memory ([`local`]), the access each
//! registration and queue pair grants ([`access`]) and the mapping of verbs
//! failures to errors ([`status`]). The verbs themselves (`rdma-sys`) are
//! behind the `rdma` feature: [`RdmaTransport`] then opens a device, registers segments and runs
//! one-sided READ/WRITE on RC queue pairs. Without the feature, [`devices`] says so
//! with a `NoDevice` error. See docs/transfer.md for what has run on hardware.

pub mod access;
pub mod batch;
pub mod completion;
pub mod exchange;
pub mod local;
pub mod staging;
pub mod status;

#[cfg(feature = "rdma")]
mod ffi;
#[cfg(feature = "rdma")]
mod qp;
#[cfg(feature = "rdma")]
mod transport;

#[cfg(feature = "rdma")]
pub use transport::{devices, RdmaConfig, RdmaTransport};

/// What a node's RDMA port looks like to its peers: the device it opened and the
/// port's address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortAddress {
    /// The device's name (for example `mlx5_0`).
    pub device: String,
    /// The port's GID.
    pub gid: [u8; 16],
    /// The port's LID (0 on RoCE).
    pub lid: u16,
}

/// The names of this host's RDMA devices.
///
/// # Errors
/// Always [`TransferError::NoDevice`](crate::TransferError::NoDevice): this build has
/// no RDMA support (the `rdma` feature is off).
#[cfg(not(feature = "rdma"))]
pub fn devices() -> Result<Vec<String>, crate::TransferError> {
    Err(crate::TransferError::NoDevice(
        "this build has no RDMA support (the rdma feature is off)".into(),
    ))
}

#[cfg(all(test, not(feature = "rdma")))]
mod tests {
    #[test]
    fn builds_without_rdma_say_so() {
        let error = super::devices().err().map(|e| e.kind());
        assert_eq!(error, Some(crate::ErrorKind::NoDevice));
    }
}
