//! The `ingest` workload: how fast the projector folds sub-cluster streams read
//! from JetStream (every stream at once, decoded in parallel into key operations,
//! folded by one writer), against a raw JetStream replay of the same streams, also
//! all at once and without decoding, in the same run; index bytes per key; and a global master's restart-to-serving
//! time from a checkpoint against the same restart replaying every stream.

use std::time::Instant;

use anyhow::Context as _;
use async_nats::jetstream;
use futures::StreamExt as _;
use hkvm_events::key_ops::{decode_key_ops, KeyOps};
use hkvm_events::subject::{event_subject, stream_name};
use hkvm_events::Limits;
use hkvm_globalmaster::GlobalMaster;
use hkvm_log::{EventLog, JetStreamLog, ReadOptions};
use hkvm_projector::Projection;

use super::cluster::BenchCluster;
use super::latency::median;
use super::report::{BenchResult, Printer};
use super::BenchNats;

const WORKLOAD: &str = "ingest";
/// Alternated runs of the raw replay and of the fold, whose medians are compared.
const ROUNDS: usize = 5;

/// One JetStream context per stream: eight readers pulling 16 MB batches on one
/// connection would exceed nats-server's per-connection pending limit (64 MB) and
/// be cut off as a slow consumer.
async fn contexts(
    nats: &BenchNats,
    cluster: &BenchCluster,
) -> anyhow::Result<Vec<jetstream::Context>> {
    let mut contexts = Vec::new();
    for _ in &cluster.subclusters {
        contexts.push(jetstream::new(nats.connect().await?));
    }
    Ok(contexts)
}

/// Reads every message of every stream with raw pull consumers, all streams at
/// once (as the projector reads them); returns seconds.
async fn raw_replay(nats: &BenchNats, cluster: &BenchCluster) -> anyhow::Result<f64> {
    let contexts = contexts(nats, cluster).await?;
    let mut readers = tokio::task::JoinSet::new();
    let started = Instant::now();
    for (id, js) in cluster.subclusters.iter().zip(contexts) {
        let name = stream_name(&cluster.cluster, id);
        readers.spawn(async move {
            let total = js.get_stream(&name).await?.info().await?.state.messages;
            super::raw::replay_seconds(&js, &name, total, 64).await
        });
    }
    while let Some(read) = readers.join_next().await {
        read??;
    }
    Ok(started.elapsed().as_secs_f64())
}

/// Folds every stream into a fresh projection as a global master does (sized
/// first for the sub-masters' object counts): one task
/// per stream reads it and decodes its messages into key operations (in
/// parallel, keys borrowed), and one folder applies them in order per stream.
/// Returns seconds and the projection.
async fn projector_replay(
    nats: &BenchNats,
    cluster: &BenchCluster,
) -> anyhow::Result<(f64, Projection)> {
    let contexts = contexts(nats, cluster).await?;
    let mut projection = Projection::new();
    // Sized for the objects the sub-masters hold (one per put event here), as a
    // global master sizes its index from the registry before a full replay.
    projection.reserve(cluster.events);
    let (decoded, mut incoming) = tokio::sync::mpsc::channel::<(usize, Vec<KeyOps>)>(64);
    let mut readers = tokio::task::JoinSet::new();
    let started = Instant::now();
    for (id, js) in cluster.subclusters.iter().zip(contexts) {
        let stream = stream_name(&cluster.cluster, id);
        let source = projection.source_index(id, &stream);
        let log = JetStreamLog::new(js, stream, event_subject(&cluster.cluster, id));
        let decoded = decoded.clone();
        let limits = Limits::default();
        readers.spawn(async move {
            let mut entries = log
                .read(ReadOptions {
                    batch_messages: 64,
                    ..ReadOptions::from(1)
                })
                .await?;
            let mut chunk = Vec::with_capacity(64);
            while let Some(entry) = entries.next().await {
                let entry = entry?;
                chunk.push(decode_key_ops(
                    entry.seq,
                    entry.unix_ms,
                    &entry.payload,
                    &limits,
                )?);
                if chunk.len() == 64 {
                    let full = std::mem::replace(&mut chunk, Vec::with_capacity(64));
                    decoded.send((source, full)).await?;
                }
            }
            if !chunk.is_empty() {
                decoded.send((source, chunk)).await?;
            }
            anyhow::Ok(())
        });
    }
    drop(decoded);
    while let Some((source, chunk)) = incoming.recv().await {
        for message in chunk {
            projection.apply_key_ops(source, message)?;
        }
    }
    while let Some(read) = readers.join_next().await {
        read??;
    }
    Ok((started.elapsed().as_secs_f64(), projection))
}

/// What per-sub-cluster `std::collections::HashSet<u64>` of key hashes would take:
/// buckets (a power of two at 7/8 load) of 8 bytes plus one control byte each.
fn hashset_bytes_per_key(projection: &Projection) -> f64 {
    let keys = projection.index().len().max(1) as f64;
    let bytes: u64 = (0..projection.sources().len())
        .map(|source| {
            let len = projection.index().source_len(source);
            let buckets = (len * 8 / 7 + 1).next_power_of_two();
            buckets * 9
        })
        .sum();
    bytes as f64 / keys
}

async fn time_to_serving(
    client: &async_nats::Client,
    cluster: &BenchCluster,
    restore: bool,
) -> anyhow::Result<(f64, GlobalMaster)> {
    let started = Instant::now();
    let master = GlobalMaster::start(cluster.config("bench", restore), client.clone()).await?;
    master.wait_serving().await;
    Ok((started.elapsed().as_secs_f64(), master))
}

/// Runs the workload.
///
/// # Errors
/// When NATS fails or a message does not fold (which would be a bug).
pub async fn run(nats: &BenchNats, quick: bool, printer: &mut Printer) -> anyhow::Result<()> {
    let (subclusters, keys) = if quick { (8, 100_000) } else { (8, 10_000_000) };
    let client = nats.connect().await?;
    let js = jetstream::new(client.clone());
    eprintln!("bench ingest: writing {keys} keys into {subclusters} streams");
    let cluster = BenchCluster::build(&js, "bingest", subclusters, keys).await?;
    let events = cluster.events as f64;

    // Both replays take about a second here, where one run moves by 15% or more:
    // each is timed ROUNDS times, alternating, and the medians are compared.
    let rounds = if quick { 1 } else { ROUNDS };
    let (mut raw_runs, mut fold_runs, mut last) = (Vec::new(), Vec::new(), None);
    for round in 1..=rounds {
        eprintln!("bench ingest: raw replay and projector replay, round {round} of {rounds}");
        raw_runs.push(raw_replay(nats, &cluster).await?);
        drop(last.take());
        let (seconds, projection) = projector_replay(nats, &cluster).await?;
        fold_runs.push(seconds);
        last = Some(projection);
    }
    let (raw_seconds, projector_seconds) = (median(&mut raw_runs), median(&mut fold_runs));
    let mut projection = last.context("no replay round ran")?;
    // As a replica does once caught up: growth by doubling leaves capacity unused.
    projection.shrink_to_fit();
    let raw_rate = events / raw_seconds;
    let fold_rate = events / projector_seconds;
    printer.print(&BenchResult::new(
        WORKLOAD,
        format!("projector fold from JetStream, {subclusters} streams"),
        fold_rate,
        "events/s",
        format!(
            "raw JetStream pull replay, same {} msgs (medians of {rounds} alternated runs; target >= 0.5)",
            cluster.messages
        ),
        raw_rate,
    ));
    printer.print(&BenchResult::new(
        WORKLOAD,
        format!("projector fold from JetStream, {subclusters} streams, against 5 M events/s"),
        fold_rate,
        "events/s",
        "target (at least)",
        5e6,
    ));
    printer.print(&BenchResult::new(
        WORKLOAD,
        format!("index bytes per key ({} keys)", projection.index().len()),
        projection.bytes_per_key(),
        "bytes",
        "HashSet<u64> per sub-cluster (computed)",
        hashset_bytes_per_key(&projection),
    ));
    drop(projection);

    eprintln!("bench ingest: global master cold start, checkpoint, warm start");
    let (cold_seconds, master) = time_to_serving(&client, &cluster, false).await?;
    printer.print(&BenchResult::new(
        WORKLOAD,
        "global master start to serving, replaying all",
        events / cold_seconds,
        "events/s",
        "raw JetStream pull replay",
        raw_rate,
    ));
    let started = Instant::now();
    let checkpoint_bytes = master.checkpoint_now().await?;
    let write_seconds = started.elapsed().as_secs_f64();
    drop(master);
    let (warm_seconds, master) = time_to_serving(&client, &cluster, true).await?;
    anyhow::ensure!(
        master.restored_from().is_some(),
        "the restart did not find the checkpoint"
    );
    drop(master);
    for result in [
        BenchResult::new(
            WORKLOAD,
            "restart to serving from a checkpoint",
            warm_seconds,
            "s",
            "restart replaying every stream (target ratio <= 0.3)",
            cold_seconds,
        ),
        BenchResult::new(
            WORKLOAD,
            "checkpoint size per key",
            checkpoint_bytes as f64 / keys as f64,
            "bytes",
            "none",
            0.0,
        ),
        BenchResult::new(
            WORKLOAD,
            "checkpoint write",
            write_seconds,
            "s",
            "none",
            0.0,
        ),
    ] {
        printer.print(&result);
    }
    Ok(())
}
