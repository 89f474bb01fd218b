//! The NATS server and cluster a command talks to (`--nats`, `--cluster`), shared by
//! every subcommand that connects.

use hkvm_events::ClusterId;

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
        self.connect_as("hkvm-cli").await
    }

    /// Connects to NATS under the connection name `name` (what the server's
    /// monitoring and this process's logs call the connection).
    ///
    /// # Errors
    /// When no server accepts the connection.
    pub async fn connect_as(&self, name: &str) -> anyhow::Result<async_nats::Client> {
        Ok(hkvm_client::connect(&self.url(), name).await?)
    }

    /// The NATS URL(s) to use ([`hkvm_client::local_record::resolve`]).
    pub fn url(&self) -> String {
        hkvm_client::local_record::resolve(self.nats_url.as_deref(), &self.cluster)
    }
}
