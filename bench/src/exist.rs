//! The `exist` workload: global `batch_is_exist` of 1000-key batches over NATS
//! with 1 and 4 clients (keys/s and per-batch p50/p99) over an index of 10 M keys
//! in 8 sub-clusters, against the in-process lookup of the same batches on the
//! same projection in the same run.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use hkvm_client::GlobalClient;
use hkvm_events::rpc::global::{BatchIsExist, BatchIsExistReply, GlobalOp, Staleness};
use hkvm_globalmaster::{query, GlobalMaster};

use super::cluster::{key, BenchCluster};
use super::report::{BenchResult, Printer};
use super::BenchNats;

const WORKLOAD: &str = "exist";
const BATCH: usize = 1000;

/// `count` batches of keys spread over the key space; about one key in ten is
/// absent (its index is past the last key).
fn batches(keys: usize, count: usize, seed: u64) -> Vec<Vec<String>> {
    let space = (keys as u64 * 10 / 9).max(1);
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..count)
        .map(|_| {
            (0..BATCH)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    key((state % space) as usize)
                })
                .collect()
        })
        .collect()
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let index = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[index].as_secs_f64() * 1e6
}

/// Sends every batch from one client, one at a time; returns per-batch latencies.
async fn one_client(
    global: GlobalClient,
    batches: Vec<Vec<String>>,
) -> anyhow::Result<Vec<Duration>> {
    let mut latencies = Vec::with_capacity(batches.len());
    for keys in batches {
        let started = Instant::now();
        let reply: BatchIsExistReply = global
            .call_once(GlobalOp::BatchIsExist, &BatchIsExist { keys, labels: None })
            .await?
            .into_result()?;
        latencies.push(started.elapsed());
        anyhow::ensure!(reply.counts.len() == BATCH, "short reply");
    }
    Ok(latencies)
}

async fn over_nats(
    nats: &BenchNats,
    cluster: &BenchCluster,
    clients: usize,
    per_client: usize,
) -> anyhow::Result<(f64, Vec<Duration>)> {
    let mut tasks = Vec::new();
    let mut connections = Vec::new();
    for _ in 0..clients {
        connections.push(nats.connect().await?);
    }
    let started = Instant::now();
    for (index, connection) in connections.into_iter().enumerate() {
        let global = GlobalClient::new(connection, cluster.cluster.clone());
        let work = batches(cluster.keys, per_client, 17 + index as u64);
        tasks.push(tokio::spawn(one_client(global, work)));
    }
    let mut latencies = Vec::new();
    for task in tasks {
        latencies.extend(task.await??);
    }
    let seconds = started.elapsed().as_secs_f64();
    latencies.sort_unstable();
    Ok(((clients * per_client * BATCH) as f64 / seconds, latencies))
}

/// Runs the workload.
///
/// # Errors
/// When NATS fails or the global master does not start.
pub async fn run(nats: &BenchNats, quick: bool, printer: &mut Printer) -> anyhow::Result<()> {
    let (keys, per_client) = if quick {
        (100_000, 100)
    } else {
        (10_000_000, 1500)
    };
    let client = nats.connect().await?;
    let js = jetstream::new(client.clone());
    eprintln!("bench exist: writing {keys} keys into 8 streams");
    let cluster = BenchCluster::build(&js, "bexist", 8, keys).await?;
    let master = GlobalMaster::start(cluster.config("bench", false), client.clone()).await?;
    master.wait_serving().await;

    // The in-process baseline: the same lookup code on the same projection.
    let local = batches(keys, per_client, 3);
    let (local_rate, local_batch_us) = master.with_projection(|projection| {
        let views = query::views(projection, &BTreeMap::new(), None);
        let started = Instant::now();
        for batch in &local {
            let _ = query::batch_is_exist(projection, &views, batch, Staleness::default());
        }
        let seconds = started.elapsed().as_secs_f64();
        (
            (local.len() * BATCH) as f64 / seconds,
            seconds / local.len() as f64 * 1e6,
        )
    });

    for clients in [1, 4] {
        eprintln!("bench exist: {clients} client(s) x {per_client} batches of {BATCH}");
        let (rate, latencies) = over_nats(nats, &cluster, clients, per_client).await?;
        let label = format!("{clients} client{}", if clients == 1 { "" } else { "s" });
        for result in [
            BenchResult::new(
                WORKLOAD,
                format!("batch_is_exist over NATS, {label}"),
                rate,
                "keys/s",
                "in-process lookup, same batches",
                local_rate,
            ),
            BenchResult::new(
                WORKLOAD,
                format!("per-batch p50, {label}"),
                percentile(&latencies, 0.5),
                "us",
                "in-process time per batch",
                local_batch_us,
            ),
            BenchResult::new(
                WORKLOAD,
                format!("per-batch p99, {label}"),
                percentile(&latencies, 0.99),
                "us",
                "in-process time per batch",
                local_batch_us,
            ),
        ] {
            printer.print(&result);
        }
    }
    let status = master.status();
    printer.print(&BenchResult::new(
        WORKLOAD,
        format!("index bytes per key ({} keys)", status.keys),
        status.bytes_per_key,
        "bytes",
        "target",
        24.0,
    ));
    Ok(())
}
