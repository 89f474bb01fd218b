//! `hkvm interdc`: the inter-DC master (copies blocks the source pool has and the
//! target pool lacks), `hkvm interdc gateway` (the source datacenter's WAN egress
//! that reads blocks and sends them) and `hkvm interdc status`.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use hkvm_events::ClusterId;
use hkvm_interdc::{ClusterAddress, Gateway, GatewayConfig, InterDc, InterDcConfig, Policy};
use hkvm_transfer::wan::{FecConfig, Impairment};

/// Options of `hkvm interdc`.
#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct InterDcArgs {
    #[command(subcommand)]
    command: Option<InterDcCommand>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Debug, clap::Subcommand)]
enum InterDcCommand {
    /// Run a gateway of the source pool: reads blocks there and sends them over
    /// the WAN to the inter-DC master that asked.
    Gateway(GatewayArgs),
    /// Backlog, throughput, retransmits and FEC recoveries of a replicator.
    Status(StatusArgs),
}

/// Emulated WAN impairment (this end's egress).
#[derive(Debug, Clone, clap::Args)]
struct ImpairArgs {
    /// Added one-way delay of outgoing WAN packets, milliseconds (emulation).
    #[arg(long, default_value_t = 0)]
    wan_delay_ms: u64,
    /// Fraction of outgoing WAN packets dropped (emulation), e.g. 0.01.
    #[arg(long, default_value_t = 0.0)]
    wan_loss: f64,
}

impl ImpairArgs {
    fn impairment(&self) -> Impairment {
        Impairment {
            delay: Duration::from_millis(self.wan_delay_ms),
            loss: self.wan_loss,
            seed: u64::from(std::process::id()) ^ hkvm_log::registry::now_unix_ms().rotate_left(17),
        }
    }
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// The pool to copy from, `NATS_URL:CLUSTER`.
    #[arg(long)]
    source: Option<ClusterAddress>,
    /// The pool to copy to, `NATS_URL:CLUSTER`.
    #[arg(long)]
    target: Option<ClusterAddress>,
    /// The replication policy (TOML; see docs/interdc.md).
    #[arg(long)]
    policy: Option<PathBuf>,
    /// Override the policy's bandwidth cap, bytes per second.
    #[arg(long)]
    rate: Option<u64>,
    /// Override the policy's copies in flight.
    #[arg(long)]
    lanes: Option<usize>,
    /// Stripe shape `DATA+PARITY` (shards of `--shard-bytes`).
    #[arg(long, default_value = "64+16")]
    fec: String,
    /// Bytes per shard (one shard per WAN packet).
    #[arg(long, default_value_t = 1024)]
    shard_bytes: usize,
    /// Address the receiving UDP sockets bind to.
    #[arg(long, default_value_t = IpAddr::V4(Ipv4Addr::UNSPECIFIED))]
    wan_bind: IpAddr,
    /// Host name or address the source's gateways send to.
    #[arg(long, default_value = "127.0.0.1")]
    wan_advertise: String,
    #[command(flatten)]
    impair: ImpairArgs,
    /// The WAN's round trip, milliseconds: a lost probe or acknowledgement is
    /// noticed after about three of them.
    #[arg(long, default_value_t = 200)]
    wan_rtt_ms: u64,
    /// Serve Prometheus metrics on this address.
    #[arg(long)]
    metrics: Option<SocketAddr>,
    /// Replicas of the progress bucket (3 on a NATS cluster).
    #[arg(long, default_value_t = 1)]
    progress_replicas: usize,
    /// Exit once both pools are caught up and nothing is left to copy.
    #[arg(long)]
    until_idle: bool,
}

#[derive(Debug, clap::Args)]
struct GatewayArgs {
    /// The pool this gateway serves, `NATS_URL:CLUSTER`.
    #[arg(long)]
    source: ClusterAddress,
    /// Address its UDP sockets bind to.
    #[arg(long, default_value_t = IpAddr::V4(Ipv4Addr::UNSPECIFIED))]
    wan_bind: IpAddr,
    #[command(flatten)]
    impair: ImpairArgs,
    /// Sends in flight at once.
    #[arg(long, default_value_t = 64)]
    max_concurrent: usize,
    /// A network (CIDR, or one address) of the inter-DC masters this gateway
    /// may send values to; repeat for several. A fetch whose reply address lies
    /// in none is refused.
    #[arg(long = "peer", required = true)]
    peers: Vec<ipnet::IpNet>,
}

#[derive(Debug, clap::Args)]
struct StatusArgs {
    /// The target pool, `NATS_URL:CLUSTER` (the status lives there).
    #[arg(long)]
    target: ClusterAddress,
    /// The source pool's cluster id.
    #[arg(long)]
    source_cluster: ClusterId,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

fn parse_fec(text: &str, shard_bytes: usize) -> anyhow::Result<FecConfig> {
    let (data, parity) = text
        .split_once('+')
        .with_context(|| format!("--fec {text:?}: expected DATA+PARITY, e.g. 64+16"))?;
    Ok(FecConfig {
        data_shards: data.trim().parse().context("--fec data shards")?,
        parity_shards: parity.trim().parse().context("--fec parity shards")?,
        shard_bytes,
    })
}

/// Runs `hkvm interdc` and its subcommands.
///
/// # Errors
/// Bad arguments, an unreachable pool, or a failed status read.
pub async fn run(args: InterDcArgs) -> anyhow::Result<()> {
    match args.command {
        Some(InterDcCommand::Gateway(gateway)) => run_gateway(gateway).await,
        Some(InterDcCommand::Status(status)) => print_status(status).await,
        None => run_master(args.run).await,
    }
}

async fn run_gateway(args: GatewayArgs) -> anyhow::Result<()> {
    let nats = args.source.connect("hkvm-interdc-gateway").await?;
    let gateway = Gateway::start(
        nats,
        GatewayConfig {
            cluster: args.source.cluster.clone(),
            bind_ip: args.wan_bind,
            impairment: args.impair.impairment(),
            max_concurrent: args.max_concurrent,
            peers: args.peers.clone(),
        },
    )
    .await?;
    println!("inter-DC gateway of {} ready", args.source);
    crate::signals::terminated().await;
    drop(gateway);
    Ok(())
}

async fn run_master(args: RunArgs) -> anyhow::Result<()> {
    let source = args
        .source
        .context("--source NATS_URL:CLUSTER is required (or a subcommand: gateway, status)")?;
    let target = args
        .target
        .context("--target NATS_URL:CLUSTER is required")?;
    let mut policy = match &args.policy {
        Some(path) => Policy::from_file(path)?,
        None => Policy::default(),
    };
    if let Some(rate) = args.rate {
        policy.rate_bytes_per_sec = rate;
    }
    if let Some(lanes) = args.lanes {
        policy.lanes = lanes;
    }
    policy.validate()?;
    let mut config = InterDcConfig::new(source, target);
    config.policy = policy;
    config.fec = parse_fec(&args.fec, args.shard_bytes)?;
    config.wan_bind_ip = args.wan_bind;
    config.wan_advertise_host = args.wan_advertise;
    config.impairment = args.impair.impairment();
    config.wan_rtt = Duration::from_millis(args.wan_rtt_ms);
    config.metrics_addr = args.metrics;
    config.progress_replicas = args.progress_replicas;
    let mut master = InterDc::start(config).await?;
    if let Some(addr) = master.metrics_addr() {
        tracing::info!(%addr, "serving /metrics");
    }
    let mut last_log = std::time::Instant::now();
    let stop = crate::signals::terminated();
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = &mut stop => break,
            status = master.status_changed() => {
                if last_log.elapsed() >= Duration::from_secs(5) {
                    last_log = std::time::Instant::now();
                    tracing::info!(
                        copying = status.copying,
                        backlog_keys = status.backlog_keys,
                        backlog_bytes = status.backlog_bytes,
                        copied = status.copied_blocks,
                        goodput_mb_s = status.goodput_bytes_per_sec / 1e6,
                        fec_recoveries = status.fec_recoveries,
                        retransmitted = status.stripes_retransmitted,
                        "progress"
                    );
                }
                if args.until_idle && status.copying && status.backlog_keys == 0 && status.in_flight == 0 {
                    println!("{}", status.render(status.unix_ms));
                    break;
                }
            }
        }
    }
    drop(master);
    Ok(())
}

async fn print_status(args: StatusArgs) -> anyhow::Result<()> {
    let status = hkvm_interdc::read_status(&args.target, &args.source_cluster)
        .await?
        .with_context(|| {
            format!(
                "no status recorded for copies from {} into {}",
                args.source_cluster, args.target
            )
        })?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&status)?);
    } else {
        print!("{}", status.render(hkvm_log::registry::now_unix_ms()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fec_shapes_parse() {
        let fec = parse_fec("64+16", 1024).unwrap();
        assert_eq!(
            (fec.data_shards, fec.parity_shards, fec.shard_bytes),
            (64, 16, 1024)
        );
        assert!(parse_fec("64", 1024).is_err());
        assert!(parse_fec("a+b", 1024).is_err());
    }
}
