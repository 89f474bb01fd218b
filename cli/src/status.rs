//! `hkvm status`: the registry (every sub-master, its labels, whether it is alive,
//! objects, usage, stream position) and, when a global master answers, what its
//! projection holds per sub-cluster and how far behind it is.

use std::time::Duration;

use anyhow::Context as _;
use async_nats::jetstream;
use hkvm_client::{GlobalClient, RetryPolicy};
use hkvm_events::registry::{list, open_registry};
use hkvm_events::rpc::global::{GlobalOp, GlobalStatus, GlobalStatusReply};

use crate::target::Target;

/// Options of `hkvm status`.
#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub target: Target,
    /// Liveness TTL to judge registrations by, e.g. `10s`.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
    pub ttl: Duration,
}

fn gib(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / f64::from(1u32 << 30))
}

/// Prints the registry and the global master's view.
///
/// # Errors
/// When NATS is unreachable.
pub async fn run(args: StatusArgs) -> anyhow::Result<()> {
    let client = args.target.connect().await?;
    let js = jetstream::new(client.clone());
    let cluster = &args.target.cluster;
    println!("cluster {cluster}");
    match open_registry(&js, cluster).await {
        Ok(store) => {
            let entries = list(&store, args.ttl)
                .await
                .context("listing the registry")?;
            println!(
                "{:<16} {:<22} {:<6} {:>7} {:>10} {:>14} {:>10} labels",
                "subcluster", "submaster", "alive", "age_ms", "objects", "used/cap GiB", "last_seq"
            );
            for entry in &entries {
                let info = &entry.info;
                let labels: Vec<String> = info
                    .labels
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect();
                println!(
                    "{:<16} {:<22} {:<6} {:>7} {:>10} {:>14} {:>10} {}",
                    info.subcluster.as_str(),
                    info.id.as_str(),
                    if entry.alive { "yes" } else { "no" },
                    entry.age_ms,
                    info.objects,
                    format!("{}/{}", gib(info.used_bytes), gib(info.capacity_bytes)),
                    info.last_seq,
                    labels.join(",")
                );
            }
            if entries.is_empty() {
                println!("(no sub-master registered)");
            }
        }
        Err(_) => println!("(no registry yet: no sub-master ever registered)"),
    }
    // Ask once: a status report must not wait for a global master that is down.
    let global = GlobalClient::with_policy(
        client,
        cluster.clone(),
        RetryPolicy {
            retry_deadline: Duration::ZERO,
            ..RetryPolicy::default()
        },
    );
    let answer: Result<GlobalStatusReply, _> =
        global.call(GlobalOp::Status, &GlobalStatus {}).await;
    match answer {
        Ok(status) => {
            println!(
                "\nglobal master {} ({}): {} keys, {:.1} B/key",
                status.replica,
                if status.replaying {
                    "replaying"
                } else {
                    "serving"
                },
                status.keys,
                status.bytes_per_key
            );
            println!(
                "{:<16} {:>10} {:>12} {:>12} {:>10} {:>9} {:>8}",
                "subcluster", "keys", "applied_seq", "last_seq", "lag_events", "lag_ms", "resyncs"
            );
            for source in &status.sources {
                println!(
                    "{:<16} {:>10} {:>12} {:>12} {:>10} {:>9} {:>8}",
                    source.lag.subcluster.as_str(),
                    source.keys,
                    source.lag.applied_seq,
                    source.lag.last_seq,
                    source.lag.lag_events,
                    source.lag.lag_ms,
                    source.resyncs
                );
            }
        }
        Err(error) => println!("\nno global master answered: {error}"),
    }
    Ok(())
}
