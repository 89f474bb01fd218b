//! What a node advertises, besides its TCP endpoint, so that peers can move a
//! segment's bytes over RDMA: the device and port address (GID, LID), the endpoint of
//! its out-of-band queue-pair exchange, and the segment's remote key and base
//! address. It travels in `MountSegment`, the `SegmentMounted` event, snapshots and
//! every `ReplicaLocation`; a node without RDMA advertises none and is reached over
//! TCP only.

use serde::{Deserialize, Serialize};

/// How a peer reaches one segment over RDMA (RC queue pairs, one-sided READ and
/// WRITE). Every field but `exchange`, `rkey` and `addr` is informational for the
/// peer: the queue-pair exchange repeats the port address.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RdmaEndpoint {
    /// The node's device (for example `mlx5_0`).
    #[serde(rename = "d")]
    pub device: String,
    /// The port's GID (RoCE and routed InfiniBand).
    #[serde(rename = "gid")]
    pub gid: [u8; 16],
    /// The port's LID (InfiniBand; 0 on RoCE).
    #[serde(rename = "l", default)]
    pub lid: u16,
    /// Where the node accepts queue-pair exchanges (`host:port`, TCP).
    #[serde(rename = "x")]
    pub exchange: String,
    /// The remote key of the segment's registration.
    #[serde(rename = "k")]
    pub rkey: u32,
    /// The segment's base virtual address in the node's process: a replica at
    /// `offset` is at `addr + offset`.
    #[serde(rename = "a")]
    pub addr: u64,
    /// The registered length from `addr`.
    #[serde(rename = "n")]
    pub len: u64,
}

impl RdmaEndpoint {
    /// The GID as the usual colon-separated hex (`fe80:0000:...`).
    pub fn gid_text(&self) -> String {
        self.gid
            .chunks(2)
            .map(|pair| format!("{:02x}{:02x}", pair[0], pair[1]))
            .collect::<Vec<_>>()
            .join(":")
    }
}

impl std::fmt::Display for RdmaEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rdma://{}@{} (gid {}, rkey {:#x})",
            self.device,
            self.exchange,
            self.gid_text(),
            self.rkey
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gid_prints_as_hex_groups() {
        let mut gid = [0u8; 16];
        gid[0] = 0xfe;
        gid[1] = 0x80;
        gid[15] = 1;
        let endpoint = RdmaEndpoint {
            device: "mlx5_0".into(),
            gid,
            lid: 0,
            exchange: "10.0.0.7:7071".into(),
            rkey: 0x1234,
            addr: 0x7f00_0000_0000,
            len: 1 << 30,
        };
        assert_eq!(
            endpoint.gid_text(),
            "fe80:0000:0000:0000:0000:0000:0000:0001"
        );
        assert_eq!(
            endpoint.to_string(),
            "rdma://mlx5_0@10.0.0.7:7071 (gid fe80:0000:0000:0000:0000:0000:0000:0001, rkey 0x1234)"
        );
    }
}
