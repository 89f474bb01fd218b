//! Mapping verbs failures to [`TransferError`]s: work completion statuses (their
//! numbers are fixed by the verbs ABI, `enum ibv_wc_status`) and errno values of
//! verbs calls. Pure Rust, so it is tested without a device.

use crate::error::TransferError;

/// `IBV_WC_SUCCESS`.
pub const WC_SUCCESS: u32 = 0;
/// `IBV_WC_WR_FLUSH_ERR`: the queue pair went to the error state earlier.
pub const WC_WR_FLUSH_ERR: u32 = 5;
/// `IBV_WC_REM_ACCESS_ERR`: the rkey or the range is not valid at the peer.
pub const WC_REM_ACCESS_ERR: u32 = 10;
/// `IBV_WC_RETRY_EXC_ERR`: the peer did not answer (gone or unreachable).
pub const WC_RETRY_EXC_ERR: u32 = 12;
/// `IBV_WC_RNR_RETRY_EXC_ERR`: the peer was not ready, retries ran out.
pub const WC_RNR_RETRY_EXC_ERR: u32 = 13;
/// `IBV_WC_RESP_TIMEOUT_ERR`: the response did not come in time.
pub const WC_RESP_TIMEOUT_ERR: u32 = 20;

/// The name of a work completion status.
pub fn status_name(status: u32) -> &'static str {
    const NAMES: [&str; 24] = [
        "success",
        "local length error",
        "local QP operation error",
        "local EE context operation error",
        "local protection error",
        "work request flushed",
        "memory window bind error",
        "bad response",
        "local access error",
        "remote invalid request",
        "remote access error",
        "remote operation error",
        "transport retry counter exceeded",
        "RNR retry counter exceeded",
        "local RDD violation",
        "remote invalid RD request",
        "remote aborted",
        "invalid EE context number",
        "invalid EE context state",
        "fatal error",
        "response timeout",
        "general error",
        "tag matching error",
        "tag matching rendezvous incomplete",
    ];
    NAMES
        .get(status as usize)
        .copied()
        .unwrap_or("unknown status")
}

/// The error of a failed work completion. A peer that stopped answering (or a queue
/// pair already broken by an earlier failure) is `Disconnected`, which callers treat
/// like a lost TCP connection: try another replica.
pub fn completion_error(endpoint: &str, status: u32, vendor_err: u32) -> TransferError {
    let name = status_name(status);
    match status {
        WC_RETRY_EXC_ERR | WC_RNR_RETRY_EXC_ERR | WC_RESP_TIMEOUT_ERR | WC_WR_FLUSH_ERR => {
            TransferError::Disconnected {
                endpoint: endpoint.to_owned(),
                source: std::io::Error::new(std::io::ErrorKind::ConnectionAborted, name),
            }
        }
        _ => TransferError::Rdma {
            call: "work completion",
            reason: format!("{name} (status {status}, vendor error {vendor_err:#x})"),
        },
    }
}

/// The error of a verbs call that failed with `errno`. No device, or a device that
/// went away, is `NoDevice`.
pub fn call_error(call: &'static str, errno: i32) -> TransferError {
    match errno {
        libc::ENODEV | libc::ENXIO | libc::ENOENT | libc::ENOSYS => TransferError::NoDevice(
            format!("{call}: {}", std::io::Error::from_raw_os_error(errno)),
        ),
        _ => TransferError::Rdma {
            call,
            reason: std::io::Error::from_raw_os_error(errno).to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    #[test]
    fn completions_of_a_vanished_peer_are_disconnections() {
        for status in [
            WC_RETRY_EXC_ERR,
            WC_RNR_RETRY_EXC_ERR,
            WC_RESP_TIMEOUT_ERR,
            WC_WR_FLUSH_ERR,
        ] {
            let error = completion_error("10.0.0.1:7000", status, 0);
            assert_eq!(error.kind(), ErrorKind::Disconnected, "{status}");
            assert!(error.is_transient());
        }
        let error = completion_error("peer", WC_REM_ACCESS_ERR, 0x81);
        assert_eq!(error.kind(), ErrorKind::Rdma);
        assert!(error.to_string().contains("remote access error"));
        assert!(error.to_string().contains("0x81"));
        assert_eq!(status_name(99), "unknown status");
    }

    #[test]
    fn errno_values_map_to_kinds() {
        assert_eq!(
            call_error("ibv_open_device", 19).kind(),
            ErrorKind::NoDevice
        );
        assert_eq!(
            call_error("ibv_get_device_list", 2).kind(),
            ErrorKind::NoDevice
        );
        let error = call_error("ibv_reg_mr", 12);
        assert_eq!(error.kind(), ErrorKind::Rdma);
        assert!(error.to_string().contains("ibv_reg_mr"));
    }

    #[cfg(feature = "rdma")]
    #[test]
    fn status_numbers_match_the_verbs_headers() {
        use rdma_sys::ibv_wc_status as s;
        assert_eq!(WC_SUCCESS, s::IBV_WC_SUCCESS);
        assert_eq!(WC_WR_FLUSH_ERR, s::IBV_WC_WR_FLUSH_ERR);
        assert_eq!(WC_REM_ACCESS_ERR, s::IBV_WC_REM_ACCESS_ERR);
        assert_eq!(WC_RETRY_EXC_ERR, s::IBV_WC_RETRY_EXC_ERR);
        assert_eq!(WC_RNR_RETRY_EXC_ERR, s::IBV_WC_RNR_RETRY_EXC_ERR);
        assert_eq!(WC_RESP_TIMEOUT_ERR, s::IBV_WC_RESP_TIMEOUT_ERR);
        assert_eq!(
            status_name(s::IBV_WC_TM_RNDV_INCOMPLETE),
            "tag matching rendezvous incomplete"
        );
    }
}
