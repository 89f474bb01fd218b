//! The global master's configuration: a plain `Default` struct, also readable from
//! a TOML file (every field optional).

use std::net::SocketAddr;
use std::time::Duration;

use hkvm_direct::DirectConfig;
use hkvm_events::rpc::global::LabelFilter;
use hkvm_events::{ClusterId, SubclusterId};
use serde::Deserialize;

/// How a global-master replica runs.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GlobalMasterConfig {
    /// The cluster whose sub-clusters are projected.
    pub cluster: ClusterId,
    /// This replica's name (in answers, logs and checkpoint names).
    pub replica: String,
    /// Liveness TTL of registry entries, ms.
    pub registry_ttl_ms: u64,
    /// Sub-clusters to follow even if not registered (tests, benchmarks, static
    /// deployments).
    pub static_sources: Vec<SubclusterId>,
    /// Most bytes per read batch (the backpressure bound; a read keeps at most
    /// about one and a half batches asked for).
    pub read_batch_bytes: usize,
    /// Once a stream is caught up, how long its read lets new events gather
    /// before fetching them, ms (0: each event as soon as it is stored). The
    /// projection is at most this far behind a busy stream; the NATS server
    /// delivers one burst per linger instead of one message per event.
    pub follow_linger_ms: u64,
    /// Write a checkpoint this often, ms (0: never).
    pub checkpoint_interval_ms: u64,
    /// Load the newest checkpoint at start.
    pub restore_checkpoint: bool,
    /// Rebuild and publish bloom filters this often, ms (0: never).
    pub bloom_interval_ms: u64,
    /// Poll stream bounds (for lag) this often, ms.
    pub lag_poll_ms: u64,
    /// What `Busy` replies ask callers to wait, ms.
    pub busy_retry_ms: u64,
    /// Labels applied when a query has none.
    pub default_labels: Option<LabelFilter>,
    /// How long a proxied sub-master request may take, ms.
    pub proxy_timeout_ms: u64,
    /// How long a `sync` lookup may wait for this replica to catch up with the
    /// event streams before it answers `Stale`, ms.
    pub sync_timeout_ms: u64,
    /// Where to serve `/metrics` (none: not served).
    pub metrics_addr: Option<SocketAddr>,
    /// Where this replica takes direct queries (clients' queries without the
    /// NATS broker in between); TOML table `[direct]`.
    pub direct: DirectConfig,
}

impl Default for GlobalMasterConfig {
    fn default() -> Self {
        Self {
            cluster: ClusterId::new("local").unwrap_or_else(|_| unreachable!("valid id")),
            replica: format!("global-{}", std::process::id()),
            registry_ttl_ms: 10_000,
            static_sources: Vec::new(),
            read_batch_bytes: 1 << 20,
            follow_linger_ms: 5,
            checkpoint_interval_ms: 60_000,
            restore_checkpoint: true,
            bloom_interval_ms: 30_000,
            lag_poll_ms: 1_000,
            busy_retry_ms: 200,
            default_labels: None,
            proxy_timeout_ms: 2_000,
            sync_timeout_ms: 1_000,
            metrics_addr: None,
            direct: DirectConfig::default(),
        }
    }
}

impl GlobalMasterConfig {
    /// The registry TTL.
    pub fn registry_ttl(&self) -> Duration {
        Duration::from_millis(self.registry_ttl_ms)
    }

    /// Reads a TOML config file; missing fields take their defaults.
    ///
    /// # Errors
    /// When the file cannot be read or is not valid.
    pub fn from_file(path: &std::path::Path) -> Result<Self, crate::GlobalMasterError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            crate::GlobalMasterError::config(format!("reading {}", path.display()), e)
        })?;
        toml::from_str(&text)
            .map_err(|e| crate::GlobalMasterError::config(format!("parsing {}", path.display()), e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_toml_file_overrides_some_fields() {
        let dir = std::env::temp_dir().join(format!("hkvm-gm-config-{}", std::process::id()));
        std::fs::write(
            &dir,
            "cluster = \"prod\"\nreplica = \"g-1\"\ncheckpoint_interval_ms = 5\n\
             [default_labels]\nmode = \"hard\"\nlabels = { pool = \"prefill\" }\n",
        )
        .unwrap();
        let config = GlobalMasterConfig::from_file(&dir).unwrap();
        std::fs::remove_file(&dir).unwrap();
        assert_eq!(config.cluster.as_str(), "prod");
        assert_eq!(config.checkpoint_interval_ms, 5);
        assert_eq!(config.lag_poll_ms, 1_000);
        let labels = config.default_labels.unwrap();
        assert_eq!(labels.labels["pool"], "prefill");
        assert!(GlobalMasterConfig::from_file(std::path::Path::new("/nonexistent")).is_err());
    }
}
