//! The NATS server and cluster a command talks to (`--nats`, `--cluster`), shared by
//! every subcommand that connects.

use anyhow::Context as _;
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
        // A plain string is parsed as one URL; a list must be split first.
        let servers = self
            .nats_url
            .split(',')
            .map(|url| url.trim().parse::<async_nats::ServerAddr>())
            .collect::<Result<Vec<_>, _>>()
            .with_context(|| format!("parsing the NATS URLs {}", self.nats_url))?;
        let mut options = async_nats::ConnectOptions::new().name("hkvm-cli");
        // `nats://user:password@host` in a list is not applied by the client library
        // on its own: pass the first credentials found explicitly.
        if let Some((user, password)) = servers
            .iter()
            .find_map(|server| Some((server.username()?.to_owned(), server.password()?.to_owned())))
        {
            options = options.user_and_password(user, password);
        }
        options
            .connect(servers)
            .await
            .with_context(|| format!("connecting to NATS at {}", self.nats_url))
    }
}
