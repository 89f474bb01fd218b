//! The NATS server and cluster a command talks to (`--nats`, `--cluster`), shared by
//! every subcommand that connects.

use hkvm_events::ClusterId;

/// Where HKVM lives: a NATS URL and a cluster name.
#[derive(Debug, Clone, clap::Args)]
pub struct Target {
    /// NATS server URL(s), comma-separated.
    #[arg(
        long = "nats",
        env = "HKVM_NATS_URL",
        default_value = "nats://127.0.0.1:4222"
    )]
    pub nats_url: String,
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
        Ok(hkvm_client::connect(&self.nats_url, "hkvm-cli").await?)
    }
}
