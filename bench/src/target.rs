//! The NATS server, cluster and sub-cluster the load generator talks to (`--nats`,
//! `--cluster`, `--subcluster`), with the same flags, environment variables and
//! defaults as the `hkvm` commands.

use hkvm_events::{ClusterId, SubclusterId};

/// Where HKVM lives: a NATS URL and a cluster name.
#[derive(Debug, Clone, clap::Args)]
pub struct Target {
    /// NATS server URL(s), comma-separated [default: the URL a running `hkvm
    /// local` of the cluster recorded, else nats://127.0.0.1:4222].
    #[arg(long = "nats", env = "HKVM_NATS_URL")]
    pub nats_url: Option<String>,
    /// The HKVM cluster name.
    #[arg(long, env = "HKVM_CLUSTER", default_value = "local")]
    pub cluster: ClusterId,
}

impl Target {
    /// Connects to NATS.
    ///
    /// # Errors
    /// When no server accepts the connection.
    pub async fn connect(&self) -> anyhow::Result<async_nats::Client> {
        Ok(hkvm_client::connect(&self.url(), "hkvm-bench").await?)
    }

    /// The NATS URL(s) to use ([`hkvm_client::local_record::resolve`]).
    pub fn url(&self) -> String {
        hkvm_client::local_record::resolve(self.nats_url.as_deref(), &self.cluster)
    }
}

/// A [`Target`] and one of its sub-clusters.
#[derive(Debug, Clone, clap::Args)]
pub struct SubclusterTarget {
    #[command(flatten)]
    pub target: Target,
    /// The sub-cluster.
    #[arg(long, env = "HKVM_SUBCLUSTER")]
    pub subcluster: SubclusterId,
}
