//! The `exist` workload: global `batch_is_exist` of 1000-key batches from clients
//! (on their direct link to a replica once it is up, over NATS before)
//! (keys sent as 64-bit hashes, as the client sends them) with 1 and 4 clients (keys/s and per-batch p50/p99) over an index of 10 M keys
//! in 8 sub-clusters, against the in-process lookup of the very same batches on
//! the same projection in the same run, with the CPU spent per key (clients,
//! global master and nats-server) and the targets the rows are held to; and the
//! 4-client work again with a second global-master replica in the query group,
//! and with the keys sent as strings, against hashes.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use hkvm_client::GlobalClient;
use hkvm_events::rpc::global::{BatchIsExist, BatchIsExistReply, GlobalOp, Staleness};
use hkvm_globalmaster::{query, GlobalMaster};

use super::cluster::{key, BenchCluster};
use super::latency::quantile_us;
use super::report::{BenchResult, Printer};
use super::BenchNats;

const WORKLOAD: &str = "exist";
const BATCH: usize = 1000;
/// Runs of each client phase (alternating with the in-process baseline) whose
/// medians are reported.
const ROUNDS: usize = 3;

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

/// How a client sends its keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wire {
    /// As 64-bit key hashes, the answer packed (`batch_is_exist_packed`): what
    /// the client sends.
    Hashes,
    /// As strings (`batch_is_exist`): the older form, still served.
    Strings,
}

/// Sends every batch from one client, one at a time; returns per-batch latencies
/// and the batches (freed by the caller once the clock has stopped).
async fn one_client(
    global: GlobalClient,
    batches: Vec<Vec<String>>,
    wire: Wire,
) -> anyhow::Result<(Vec<Duration>, Vec<Vec<String>>)> {
    let mut latencies = Vec::with_capacity(batches.len());
    for keys in &batches {
        let started = Instant::now();
        let reply: BatchIsExistReply = match wire {
            Wire::Hashes => global.batch_is_exist(keys, None).await?,
            Wire::Strings => {
                let request = BatchIsExist {
                    keys: keys.clone(),
                    labels: None,
                };
                global.call_once(GlobalOp::BatchIsExist, &request).await?
            }
        }
        .into_result()?;
        latencies.push(started.elapsed());
        anyhow::ensure!(reply.counts.len() == BATCH, "short reply");
    }
    Ok((latencies, batches))
}

/// The exact batches each of `clients` clients sends (the in-process baseline
/// looks up the very same ones).
fn work(keys: usize, clients: usize, per_client: usize) -> Vec<Vec<Vec<String>>> {
    (0..clients)
        .map(|index| batches(keys, per_client, 17 + index as u64))
        .collect()
}

/// Keys/s, sorted per-batch latencies and CPU seconds spent (this process: the
/// clients and the global master; plus the nats-server child) sending `work`.
async fn over_nats(
    nats: &BenchNats,
    cluster: &BenchCluster,
    work: &[Vec<Vec<String>>],
    wire: Wire,
) -> anyhow::Result<(f64, Vec<Duration>, f64)> {
    let mut connections = Vec::new();
    for _ in work {
        connections.push(nats.connect().await?);
    }
    let cpu = || {
        crate::scale::cpu_seconds(Some(std::process::id())) + crate::scale::cpu_seconds(nats.pid())
    };
    // Each client's copy of its batches is made before the clock starts: the
    // in-process baseline borrows them, so copying them is no part of a query.
    let clients: Vec<_> = connections
        .into_iter()
        .zip(work)
        .map(|(connection, batches)| {
            (
                GlobalClient::new(connection, cluster.cluster.clone()),
                batches.clone(),
            )
        })
        .collect();
    let cpu_before = cpu();
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (global, batches) in clients {
        tasks.push(tokio::spawn(one_client(global, batches, wire)));
    }
    let mut latencies = Vec::new();
    let mut sent = Vec::new();
    for task in tasks {
        let (times, batches) = task.await??;
        latencies.extend(times);
        sent.push(batches);
    }
    let seconds = started.elapsed().as_secs_f64();
    let cpu_spent = cpu() - cpu_before;
    drop(sent);
    latencies.sort_unstable();
    let keys: usize = work.iter().map(|batches| batches.len() * BATCH).sum();
    Ok((keys as f64 / seconds, latencies, cpu_spent))
}

/// What one run of a client phase measured: keys/s, the sorted
/// per-batch latencies and the CPU seconds spent.
type NatsRun = (f64, Vec<Duration>, f64);

/// Runs `work` from the clients and in process `rounds` times, alternating (one run of
/// about a second moves by 15% or more here); returns the NATS run of median
/// rate, and the in-process run of median rate (keys/s, microseconds per batch):
/// the in-process baseline looks up the very same batches.
async fn median_runs(
    nats: &BenchNats,
    cluster: &BenchCluster,
    master: &GlobalMaster,
    work: &[Vec<Vec<String>>],
    rounds: usize,
) -> anyhow::Result<(NatsRun, (f64, f64))> {
    let (mut over, mut local) = (Vec::new(), Vec::new());
    for _ in 0..rounds.max(1) {
        over.push(over_nats(nats, cluster, work, Wire::Hashes).await?);
        local.push(in_process(master, work));
    }
    over.sort_by(|a, b| a.0.total_cmp(&b.0));
    local.sort_by(|a, b| a.0.total_cmp(&b.0));
    let middle = over.len() / 2;
    Ok((over.swap_remove(middle), local[middle]))
}

/// Keys/s and microseconds per batch of the in-process lookup of `work` on the
/// global master's own projection (the same lookup code the RPC runs).
fn in_process(master: &GlobalMaster, work: &[Vec<Vec<String>>]) -> (f64, f64) {
    master.with_projection(|projection| {
        let views = query::views(projection, &BTreeMap::new(), None);
        let all: Vec<&Vec<String>> = work.iter().flatten().collect();
        let started = Instant::now();
        for batch in &all {
            let _ = query::batch_is_exist(projection, &views, batch, Staleness::default());
        }
        let seconds = started.elapsed().as_secs_f64();
        (
            (all.len() * BATCH) as f64 / seconds,
            seconds / all.len() as f64 * 1e6,
        )
    })
}

/// The 4-client work again with a second replica in the query group (its own
/// NATS connection, its own projection folded from the streams), against the
/// 4-client rate of one replica (`one_replica_rate`, the very same batches).
async fn second_replica(
    nats: &BenchNats,
    cluster: &BenchCluster,
    per_client: usize,
    one_replica_rate: f64,
    cores: usize,
) -> anyhow::Result<BenchResult> {
    eprintln!("bench exist: a second replica folds the streams");
    let second =
        GlobalMaster::start(cluster.config("bench-2", false), nats.connect().await?).await?;
    second.wait_serving().await;
    eprintln!("bench exist: 4 clients x {per_client} batches of {BATCH}, 2 replicas");
    let work = work(cluster.keys, 4, per_client);
    let (rate, _, _) = over_nats(nats, cluster, &work, Wire::Hashes).await?;
    second.shutdown();
    Ok(BenchResult::new(
        WORKLOAD,
        format!("batch_is_exist, 4 clients, 2 replicas against 1 ({cores} cores)"),
        rate,
        "keys/s",
        if cores >= 4 {
            "1 replica, same batches (target >= 1.7)".to_owned()
        } else {
            format!(
                "1 replica, same batches (the >= 1.7x target needs cores for each replica; \
                 here both share {cores})"
            )
        },
        one_replica_rate,
    ))
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
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let rounds = if quick { 1 } else { ROUNDS };

    let mut one_client_rate = 0.0;
    let mut four_clients = None;
    for clients in [1, 4] {
        eprintln!(
            "bench exist: {clients} client(s) x {per_client} batches of {BATCH}, {rounds} runs"
        );
        let work = work(cluster.keys, clients, per_client);
        let ((rate, latencies, cpu), (local_rate, local_batch_us)) =
            median_runs(nats, &cluster, &master, &work, rounds).await?;
        let label = format!("{clients} client{}", if clients == 1 { "" } else { "s" });
        let total_keys = (clients * per_client * BATCH) as f64;
        let mut results = vec![
            BenchResult::new(
                WORKLOAD,
                format!("batch_is_exist, {label}"),
                rate,
                "keys/s",
                if clients == 1 {
                    "in-process lookup, same batches (target >= 0.6)"
                } else {
                    "in-process lookup, same batches"
                },
                local_rate,
            ),
            BenchResult::new(
                WORKLOAD,
                format!("per-batch p50, {label}"),
                quantile_us(&latencies, 0.5),
                "us",
                "in-process time per batch",
                local_batch_us,
            ),
        ];
        if clients == 1 {
            one_client_rate = rate;
            results.push(BenchResult::new(
                WORKLOAD,
                format!("per-batch p99, {label}"),
                quantile_us(&latencies, 0.99),
                "us",
                "in-process time per batch",
                local_batch_us,
            ));
        } else {
            results.extend([
                BenchResult::new(
                    WORKLOAD,
                    format!("per-batch p99, {label}"),
                    quantile_us(&latencies, 0.99),
                    "us",
                    "target (at most)",
                    1000.0,
                ),
                BenchResult::new(
                    WORKLOAD,
                    format!("batch_is_exist, {label}, against 1 client ({cores} cores)"),
                    rate,
                    "keys/s",
                    if cores >= 4 {
                        "1 client (above) (target >= 3)"
                    } else {
                        "1 client (above) (the >= 3x target needs 4+ cores; on fewer, CPU per key below)"
                    },
                    one_client_rate,
                ),
            ]);
        }
        if clients == 4 {
            four_clients = Some((rate, cpu / total_keys * 1e6));
        }
        results.push(BenchResult::new(
            WORKLOAD,
            format!("CPU per key, {label} (clients, global master and nats-server)"),
            cpu / total_keys * 1e6,
            "us",
            "target (at most)",
            0.25,
        ));
        for result in results {
            printer.print(&result);
        }
    }
    if let Some((rate, _)) = four_clients {
        let second = second_replica(nats, &cluster, per_client, rate, cores).await?;
        printer.print(&second);
    }
    // The same 4-client work with the keys sent as strings, against hashes.
    if let Some((rate, cpu_per_key)) = four_clients {
        let work = work(cluster.keys, 4, per_client);
        let (strings_rate, _, strings_cpu) =
            over_nats(nats, &cluster, &work, Wire::Strings).await?;
        let strings_cpu_per_key = strings_cpu / (4 * per_client * BATCH) as f64 * 1e6;
        for result in [
            BenchResult::new(
                WORKLOAD,
                "batch_is_exist, 4 clients, keys sent as hashes against as strings",
                rate,
                "keys/s",
                "keys sent as strings (batch_is_exist), same batches",
                strings_rate,
            ),
            BenchResult::new(
                WORKLOAD,
                "CPU per key, 4 clients, keys sent as hashes against as strings",
                cpu_per_key,
                "us",
                "keys sent as strings (batch_is_exist), same batches",
                strings_cpu_per_key,
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
