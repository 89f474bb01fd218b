//! `hkvm status`: the registry (every sub-master, its labels, whether it is alive,
//! objects, usage, stream position), each sub-cluster's stream (bytes, first and
//! last sequence, the newest snapshot, every reader's recorded position) and, when
//! a global master answers, what its projection holds per sub-cluster and how far
//! behind it is.

use std::time::Duration;

use anyhow::Context as _;
use async_nats::jetstream;
use hkvm_client::{GlobalClient, RetryPolicy};
use hkvm_events::rpc::global::{GlobalOp, GlobalStatus, GlobalStatusReply};
use hkvm_events::subject::{event_subject, stream_name};
use hkvm_events::{ClusterId, SubclusterId};
use hkvm_log::positions::Positions;
use hkvm_log::registry::{list, now_unix_ms, open_registry};
use hkvm_log::JetStreamLog;
use hkvm_log::SnapshotStore;

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

/// Prints, per sub-cluster, what its stream holds, what its newest snapshot
/// covers and where each of its readers recorded it has got to.
async fn print_streams(js: &jetstream::Context, cluster: &ClusterId, subclusters: &[SubclusterId]) {
    println!(
        "\n{:<16} {:>10} {:>12} {:>12} {:>12} {:>12}",
        "stream of", "messages", "bytes", "first_seq", "last_seq", "snapshot_seq"
    );
    let positions = Positions::open(js, cluster, 1).await.ok();
    let now = now_unix_ms();
    for subcluster in subclusters {
        let log = JetStreamLog::new(
            js.clone(),
            stream_name(cluster, subcluster),
            event_subject(cluster, subcluster),
        );
        let snapshot = match SnapshotStore::open(js, cluster, subcluster, 1).await {
            Ok(store) => store.newest_covered_seq().await.ok().flatten(),
            Err(_) => None,
        };
        let snapshot = snapshot.map_or_else(|| "-".to_owned(), |seq| seq.to_string());
        match log.stats().await {
            Ok(stats) => println!(
                "{:<16} {:>10} {:>12} {:>12} {:>12} {:>12}",
                subcluster.as_str(),
                stats.messages,
                stats.bytes,
                stats.bounds.first_seq,
                stats.bounds.last_seq,
                snapshot
            ),
            Err(error) => println!("{:<16} {error}", subcluster.as_str()),
        }
        let Some(positions) = &positions else {
            continue;
        };
        match positions.list(subcluster).await {
            Ok(readers) => {
                for reader in readers {
                    println!(
                        "  reader {:<8} {:<28} at {:>12}, recorded {} s ago",
                        reader.kind.as_str(),
                        reader.reader,
                        reader.position.seq,
                        reader.age_ms(now) / 1000
                    );
                }
            }
            Err(error) => println!("  reader positions unreadable: {error}"),
        }
    }
}

/// Prints the registry, the streams and the global master's view.
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
            let subclusters: Vec<SubclusterId> =
                entries.iter().map(|e| e.info.subcluster.clone()).collect();
            print_streams(&js, cluster, &subclusters).await;
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
