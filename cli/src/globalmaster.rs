//! `hkvm globalmaster`: runs one global-master replica (start several: they share
//! the query queue group). Settings come from flags, then an optional TOML file
//! (`--config`, the fields of `GlobalMasterConfig`), then defaults.

use std::net::SocketAddr;
use std::path::PathBuf;

use hkvm_direct::DirectListen;
use hkvm_events::rpc::global::{LabelFilter, LabelMode};
use hkvm_globalmaster::GlobalMasterConfig;

use crate::target::Target;

/// Options of `hkvm globalmaster`.
#[derive(Debug, Clone, clap::Args)]
pub struct GlobalMasterArgs {
    #[command(flatten)]
    pub target: Target,
    /// A TOML file with further settings.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// This replica's name (default: `global-<pid>`).
    #[arg(long)]
    pub replica: Option<String>,
    /// Serve Prometheus metrics on this address (e.g. `127.0.0.1:9102`).
    #[arg(long)]
    pub metrics: Option<SocketAddr>,
    /// Default label filter for queries that carry none, `k=v,k=v`.
    #[arg(long, value_delimiter = ',', value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
    /// With `--labels`: never answer across labels (hard partition).
    #[arg(long)]
    pub hard_labels: bool,
    /// Start from scratch instead of the newest checkpoint.
    #[arg(long)]
    pub no_restore: bool,
    /// Where this replica takes clients' queries directly, without the NATS
    /// broker: `auto` (the address the NATS server sees this process at, any
    /// port), `off`, or an address such as `10.0.0.6:4200`.
    #[arg(long, env = "HKVM_GLOBALMASTER_DIRECT")]
    pub direct: Option<DirectListen>,
    /// The `host` or `host:port` clients are told to connect to for direct
    /// queries, when it is not the listening address (NAT, port mapping).
    #[arg(long)]
    pub direct_advertise: Option<String>,
}

/// Parses `k=v`.
///
/// # Errors
/// When there is no `=`.
pub fn parse_label(text: &str) -> Result<(String, String), String> {
    let (key, value) = text
        .split_once('=')
        .ok_or_else(|| format!("label {text:?} is not k=v"))?;
    Ok((key.trim().to_owned(), value.trim().to_owned()))
}

/// A label filter from `k=v` pairs (none when empty).
pub fn label_filter(labels: &[(String, String)], hard: bool) -> Option<LabelFilter> {
    (!labels.is_empty()).then(|| LabelFilter {
        labels: labels.iter().cloned().collect(),
        mode: if hard {
            LabelMode::Hard
        } else {
            LabelMode::Soft
        },
    })
}

/// Builds the configuration from flags, file and defaults.
///
/// # Errors
/// When the file cannot be read or parsed.
pub fn config(args: &GlobalMasterArgs) -> anyhow::Result<GlobalMasterConfig> {
    let mut config = match &args.config {
        Some(path) => GlobalMasterConfig::from_file(path)?,
        None => GlobalMasterConfig::default(),
    };
    config.cluster = args.target.cluster.clone();
    if let Some(replica) = &args.replica {
        config.replica.clone_from(replica);
    }
    if args.metrics.is_some() {
        config.metrics_addr = args.metrics;
    }
    if let Some(filter) = label_filter(&args.labels, args.hard_labels) {
        config.default_labels = Some(filter);
    }
    if args.no_restore {
        config.restore_checkpoint = false;
    }
    if let Some(listen) = args.direct {
        config.direct.listen = listen;
    }
    if args.direct_advertise.is_some() {
        config.direct.advertise.clone_from(&args.direct_advertise);
    }
    Ok(config)
}

/// Runs the replica until Ctrl-C or SIGTERM.
///
/// # Errors
/// When NATS is unreachable or setup fails.
pub async fn run(args: GlobalMasterArgs) -> anyhow::Result<()> {
    let config = config(&args)?;
    let client = args.target.connect_as("hkvm-globalmaster").await?;
    tracing::info!(cluster = %config.cluster, replica = %config.replica, "starting the global master");
    crate::on_workers(hkvm_globalmaster::serve(
        config,
        client,
        crate::signals::terminated(),
    ))
    .await?;
    Ok(())
}
