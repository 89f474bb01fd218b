//! The inter-DC master's status: what `hkvm interdc status` prints. The running
//! master writes it to its progress bucket every second, so it can be read while
//! the master runs and after it stopped (with its age).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

/// One followed sub-cluster stream.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StreamStatus {
    /// `source` or `target`.
    pub side: String,
    /// The sub-cluster.
    pub subcluster: String,
    /// The last sequence folded in.
    pub applied_seq: u64,
    /// How far behind the newest folded message is, milliseconds.
    pub lag_ms: u64,
}

/// A snapshot of the replicator.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct InterDcStatus {
    /// The source cluster.
    pub source: String,
    /// The target cluster.
    pub target: String,
    /// When this was written, Unix milliseconds.
    pub unix_ms: u64,
    /// Whether both pools' streams were caught up and copying runs.
    pub copying: bool,
    /// When copying started, Unix milliseconds (0 before).
    #[serde(default)]
    pub copying_since_unix_ms: u64,
    /// Blocks left to copy.
    pub backlog_keys: u64,
    /// Bytes left to copy.
    pub backlog_bytes: u64,
    /// Blocks being copied.
    pub in_flight: u64,
    /// Blocks the policy skips, by reason.
    pub skipped: BTreeMap<String, u64>,
    /// Blocks copied in this run.
    pub copied_blocks: u64,
    /// Blocks copied in this and earlier runs (from the progress bucket).
    pub copied_total: u64,
    /// Payload bytes copied in this run.
    pub copied_bytes: u64,
    /// Bytes sent on the WAN in this run.
    pub wire_bytes: u64,
    /// Goodput over the last interval, bytes per second.
    pub goodput_bytes_per_sec: f64,
    /// The bandwidth cap, bytes per second.
    pub cap_bytes_per_sec: u64,
    /// Stripes retransmitted in this run.
    pub stripes_retransmitted: u64,
    /// Lost shards FEC rebuilt in this run.
    pub fec_recoveries: u64,
    /// Blocks settled without a copy, by reason.
    pub settled: BTreeMap<String, u64>,
    /// Failed attempts in this run.
    pub failures: u64,
    /// Blocks given up in this run.
    pub given_up: u64,
    /// Every followed stream.
    pub streams: Vec<StreamStatus>,
}

fn mb(bytes: f64) -> String {
    format!("{:.2} MB", bytes / 1e6)
}

impl InterDcStatus {
    /// A human-readable rendering; `now_unix_ms` gives the status's age.
    pub fn render(&self, now_unix_ms: u64) -> String {
        let mut out = String::new();
        let age = now_unix_ms.saturating_sub(self.unix_ms);
        let _ = writeln!(
            out,
            "inter-DC {} -> {}   (status written {} ms ago{})",
            self.source,
            self.target,
            age,
            if age > 5_000 {
                ", replicator not running?"
            } else {
                ""
            }
        );
        let _ = writeln!(
            out,
            "state:        {}",
            if self.copying {
                "copying"
            } else {
                "catching up with both pools"
            }
        );
        let _ = writeln!(
            out,
            "backlog:      {} keys, {}  ({} in flight)",
            self.backlog_keys,
            mb(self.backlog_bytes as f64),
            self.in_flight
        );
        let _ = writeln!(
            out,
            "copied:       {} blocks, {} this run; {} blocks in all runs",
            self.copied_blocks,
            mb(self.copied_bytes as f64),
            self.copied_total
        );
        let overhead = if self.copied_bytes > 0 {
            self.wire_bytes as f64 / self.copied_bytes as f64
        } else {
            0.0
        };
        let _ = writeln!(
            out,
            "throughput:   {}/s goodput of a {}/s cap; wire {} ({overhead:.2}x payload)",
            mb(self.goodput_bytes_per_sec),
            mb(self.cap_bytes_per_sec as f64),
            mb(self.wire_bytes as f64)
        );
        let _ = writeln!(
            out,
            "losses:       {} shards rebuilt by FEC, {} stripes retransmitted",
            self.fec_recoveries, self.stripes_retransmitted
        );
        let _ = writeln!(
            out,
            "not copied:   skipped {:?}; settled {:?}; {} failed attempts, {} given up",
            self.skipped, self.settled, self.failures, self.given_up
        );
        for stream in &self.streams {
            let _ = writeln!(
                out,
                "  {:<6} {:<20} seq {:>10}  lag {} ms",
                stream.side, stream.subcluster, stream.applied_seq, stream.lag_ms
            );
        }
        out
    }
}
