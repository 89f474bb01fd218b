//! `hkvm submaster`: runs the sub-master of one sub-cluster (leader or hot standby;
//! start two for failover). Settings come from flags, then an optional TOML file
//! (`--config`), then defaults.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use hkvm_events::{ProducerId, SubclusterId};
use hkvm_submaster::placement::PlacementStrategy;
use hkvm_submaster::{DirectListen, SubmasterConfig};
use serde::Deserialize;

use crate::globalmaster::parse_label;
use crate::target::Target;

/// Options of `hkvm submaster`.
#[derive(Debug, Clone, clap::Args)]
pub struct SubmasterArgs {
    #[command(flatten)]
    pub target: Target,
    /// The sub-cluster to serve.
    #[arg(long, env = "HKVM_SUBCLUSTER")]
    pub subcluster: SubclusterId,
    /// This instance's id (default: `<subcluster>-<pid>`).
    #[arg(long)]
    pub id: Option<ProducerId>,
    /// Labels for the registry, `k=v,k=v`.
    #[arg(long, value_delimiter = ',', value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
    /// A TOML file with further settings (see docs/operations.md).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Serve Prometheus metrics on this address (e.g. `127.0.0.1:9101`).
    #[arg(long)]
    pub metrics: Option<SocketAddr>,
    /// Stream and bucket replicas (3 in a NATS cluster).
    #[arg(long)]
    pub replicas: Option<usize>,
    /// Where the leader takes clients' hot requests directly, without the NATS
    /// broker: `auto` (the address the NATS server sees this process at, any
    /// port), `off`, or an address such as `10.0.0.5:4100`.
    #[arg(long, env = "HKVM_SUBMASTER_DIRECT")]
    pub direct: Option<DirectListen>,
    /// The `host` or `host:port` clients are told to connect to for direct
    /// requests, when it is not the listening address (NAT, port mapping).
    #[arg(long)]
    pub direct_advertise: Option<String>,
}

/// Tunables a TOML file may set; every field is optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    labels: Option<BTreeMap<String, String>>,
    replicas: Option<usize>,
    metrics: Option<SocketAddr>,
    lease_ttl_ms: Option<u64>,
    put_timeout_ms: Option<u64>,
    space_lease_ttl_ms: Option<u64>,
    max_space_lease: Option<u64>,
    node_timeout_ms: Option<u64>,
    high_watermark: Option<f64>,
    evict_ratio: Option<f64>,
    placement: Option<PlacementStrategy>,
    max_key_len: Option<usize>,
    leader_lease_ttl_ms: Option<u64>,
    snapshot_every_events: Option<u64>,
    snapshot_interval_ms: Option<u64>,
    snapshot_cpu_share: Option<f64>,
    snapshot_write_bytes_per_sec: Option<u64>,
    purge_history: Option<bool>,
    reader_ttl_ms: Option<u64>,
    request_queue: Option<usize>,
    direct: Option<String>,
    direct_advertise: Option<String>,
    /// Bytes each named tenant may hold: `"team-a" = "10GiB"` (or a count).
    tenant_quotas: Option<BTreeMap<String, Quota>>,
}

/// A tenant's quota as written: a byte count, or a size with a unit.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Quota {
    Bytes(u64),
    Text(String),
}

impl Quota {
    /// Bytes: a number with an optional unit `B`, `K`/`KB`/`KiB`, `M…`, `G…`,
    /// `T…`, in powers of 1024 (as Mooncake's quota policy reads them).
    fn bytes(&self) -> anyhow::Result<u64> {
        let text = match self {
            Self::Bytes(bytes) => return Ok(*bytes),
            Self::Text(text) => text.trim(),
        };
        let split = text
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(text.len());
        let (number, unit) = text.split_at(split);
        let number: u64 = number
            .parse()
            .with_context(|| format!("quota {text:?}: no number"))?;
        let shift = match unit.trim().to_ascii_uppercase().as_str() {
            "" | "B" => 0,
            "K" | "KB" | "KIB" => 10,
            "M" | "MB" | "MIB" => 20,
            "G" | "GB" | "GIB" => 30,
            "T" | "TB" | "TIB" => 40,
            other => anyhow::bail!("quota {text:?}: unknown unit {other:?}"),
        };
        number
            .checked_mul(1u64 << shift)
            .with_context(|| format!("quota {text:?} is too large"))
    }
}

/// Builds the sub-master configuration from flags, file and defaults.
///
/// # Errors
/// When the file cannot be read or parsed.
pub fn config(args: &SubmasterArgs) -> anyhow::Result<SubmasterConfig> {
    let file: FileConfig = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?
        }
        None => FileConfig::default(),
    };
    let producer = match &args.id {
        Some(id) => id.clone(),
        None => ProducerId::new(format!("{}-{}", args.subcluster, std::process::id()))?,
    };
    let mut config = SubmasterConfig::new(
        args.target.cluster.clone(),
        args.subcluster.clone(),
        producer,
    );
    config.labels = file.labels.unwrap_or_default();
    config.labels.extend(args.labels.iter().cloned());
    config.stream.replicas = args.replicas.or(file.replicas).unwrap_or(1);
    config.metrics_addr = args.metrics.or(file.metrics);
    let policy = &mut config.policy;
    policy.lease_ttl_ms = file.lease_ttl_ms.unwrap_or(policy.lease_ttl_ms);
    policy.put_timeout_ms = file.put_timeout_ms.unwrap_or(policy.put_timeout_ms);
    policy.space_lease_ttl_ms = file.space_lease_ttl_ms.unwrap_or(policy.space_lease_ttl_ms);
    policy.max_space_lease = file.max_space_lease.unwrap_or(policy.max_space_lease);
    policy.node_timeout_ms = file.node_timeout_ms.unwrap_or(policy.node_timeout_ms);
    policy.high_watermark = file.high_watermark.unwrap_or(policy.high_watermark);
    policy.evict_ratio = file.evict_ratio.unwrap_or(policy.evict_ratio);
    policy.strategy = file.placement.unwrap_or(policy.strategy);
    policy.limits.max_key_len = file.max_key_len.unwrap_or(policy.limits.max_key_len);
    if let Some(ms) = file.leader_lease_ttl_ms {
        config.leader_lease_ttl = Duration::from_millis(ms);
    }
    if let Some(ms) = file.snapshot_interval_ms {
        config.snapshot_interval = Duration::from_millis(ms);
    }
    config.snapshot_every_events = file
        .snapshot_every_events
        .unwrap_or(config.snapshot_every_events);
    let pace = &mut config.snapshot_pace;
    pace.cpu_share = file.snapshot_cpu_share.unwrap_or(pace.cpu_share);
    pace.write_bytes_per_sec = file
        .snapshot_write_bytes_per_sec
        .unwrap_or(pace.write_bytes_per_sec);
    config.history.purge = file.purge_history.unwrap_or(config.history.purge);
    if let Some(ms) = file.reader_ttl_ms {
        config.history.reader_ttl = Duration::from_millis(ms);
    }
    config.request_queue = file.request_queue.unwrap_or(config.request_queue);
    let from_file = match file.direct.as_deref() {
        Some(text) => Some(
            text.parse::<DirectListen>()
                .map_err(|why| anyhow::anyhow!("direct: {why}"))?,
        ),
        None => None,
    };
    config.direct.listen = args.direct.or(from_file).unwrap_or(config.direct.listen);
    config.direct.advertise = args.direct_advertise.clone().or(file.direct_advertise);
    if let Some(quotas) = &file.tenant_quotas {
        let mut bytes = BTreeMap::new();
        for (tenant, quota) in quotas {
            hkvm_events::tenant::check_tenant(tenant)
                .with_context(|| format!("tenant_quotas: tenant {tenant:?}"))?;
            bytes.insert(tenant.clone(), quota.bytes()?);
        }
        config.policy.tenant_quotas = std::sync::Arc::new(bytes);
    }
    Ok(config)
}

/// Runs the sub-master until Ctrl-C or SIGTERM.
///
/// # Errors
/// When NATS is unreachable or setup fails.
pub async fn run(args: SubmasterArgs) -> anyhow::Result<()> {
    let config = config(&args)?;
    let client = args.target.connect_as("hkvm-submaster").await?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        crate::signals::terminated().await;
        let _ = stop.send(true);
    });
    crate::on_workers(hkvm_submaster::run(client, config, stopped)).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotas_read_as_counts_or_sizes_with_units() {
        let parsed: FileConfig = toml::from_str(
            r#"
            [tenant_quotas]
            "team-a" = "10GiB"
            "team-b" = 4096
            "team-c" = "3 MB"
            "#,
        )
        .unwrap();
        let quotas = parsed.tenant_quotas.unwrap();
        assert_eq!(quotas["team-a"].bytes().unwrap(), 10 << 30);
        assert_eq!(quotas["team-b"].bytes().unwrap(), 4096);
        assert_eq!(quotas["team-c"].bytes().unwrap(), 3 << 20);
        assert!(Quota::Text("5 parsecs".into()).bytes().is_err());
        assert!(Quota::Text("GB".into()).bytes().is_err());
        assert!(Quota::Text("99999999999T".into()).bytes().is_err());
    }
}
