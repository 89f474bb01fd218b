//! The `put` workload: durable put_start + put_end through a sub-master (each
//! acknowledged only after JetStream stored the event), with 1 and 64 concurrent
//! clients and with batches, against raw JetStream publishes of one event-sized
//! message per operation at the same concurrency, in the same run.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use async_nats::jetstream;
use bytes::Bytes;
use hkvm_client::{KvClient, NodeConfig, NodeHandle, SubmasterClient};
use hkvm_events::rpc::submaster::{ItemResult, MountSegment, Ping, PutEndItem, PutStartItem};
use hkvm_events::{ClusterId, NodeId, ProducerId, SegmentId, SubclusterId};
use hkvm_submaster::{SubmasterConfig, SubmasterHandle};
use hkvm_transfer::TcpTransport;

use super::report::{BenchResult, Printer};
use super::BenchNats;

const WORKLOAD: &str = "put";

fn item(key: String) -> PutStartItem {
    PutStartItem {
        key,
        size: 256 * 1024,
        replicas: 2,
        preferred_segment: None,
        hard_pin: false,
        put_id: 0,
    }
}

/// Runs `clients` tasks doing puts of `batch` objects each for `duration`;
/// returns objects per second.
async fn run_clients(
    client: &SubmasterClient,
    clients: usize,
    batch: usize,
    duration: Duration,
    tag: &str,
) -> anyhow::Result<f64> {
    let done = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + duration;
    let started = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let (client, done, tag) = (client.clone(), Arc::clone(&done), tag.to_owned());
            tokio::spawn(async move {
                let mut round = 0u64;
                while Instant::now() < deadline {
                    let keys: Vec<String> = (0..batch)
                        .map(|i| format!("{tag}/{c}/{round}/{i}"))
                        .collect();
                    round += 1;
                    let started = client
                        .put_start(keys.iter().cloned().map(item).collect())
                        .await?;
                    let ends: Vec<PutEndItem> = keys
                        .into_iter()
                        .zip(started)
                        .filter(|(_, r)| matches!(r, ItemResult::Ok(_)))
                        .map(|(key, _)| PutEndItem {
                            key,
                            checksum: 7,
                            put_id: 0,
                        })
                        .collect();
                    let ended = client.put_end(ends).await?;
                    let ok = ended
                        .iter()
                        .filter(|r| matches!(r, ItemResult::Ok(())))
                        .count();
                    done.fetch_add(ok as u64, Ordering::Relaxed);
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for task in tasks {
        task.await??;
    }
    Ok(done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64())
}

/// Raw JetStream: `publishers` tasks each publishing one ~140-byte message and
/// awaiting its ack, for `duration`; returns messages per second.
async fn raw_publish(
    js: &jetstream::Context,
    subject: &str,
    publishers: usize,
    duration: Duration,
) -> anyhow::Result<f64> {
    let done = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + duration;
    let started = Instant::now();
    let payload = Bytes::from(vec![0x5a; 140]);
    let tasks: Vec<_> = (0..publishers)
        .map(|_| {
            let (js, done, payload, subject) = (
                js.clone(),
                Arc::clone(&done),
                payload.clone(),
                subject.to_owned(),
            );
            tokio::spawn(async move {
                while Instant::now() < deadline {
                    js.publish(subject.clone(), payload.clone()).await?.await?;
                    done.fetch_add(1, Ordering::Relaxed);
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for task in tasks {
        task.await??;
    }
    Ok(done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64())
}

/// Runs the workload.
///
/// # Errors
/// When the sub-master or NATS fails.
pub async fn run(nats: &BenchNats, quick: bool, printer: &mut Printer) -> anyhow::Result<()> {
    let duration = if quick {
        Duration::from_millis(500)
    } else {
        Duration::from_secs(5)
    };
    let cluster = ClusterId::new("bench")?;
    let subcluster = SubclusterId::new("put")?;
    let config = SubmasterConfig::new(
        cluster.clone(),
        subcluster.clone(),
        ProducerId::new("bench-sm")?,
    );
    let master = SubmasterHandle::spawn(nats.connect().await?, config);
    let client = SubmasterClient::new(nats.connect().await?, cluster, subcluster);
    for node in 0..4 {
        client
            .mount_segment(MountSegment {
                node: NodeId::new(format!("node-{node}"))?,
                segment: SegmentId::new(format!("node-{node}-seg"))?,
                size: 1 << 44,
                endpoint: format!("127.0.0.1:{}", 7000 + node),
                rdma: None,
            })
            .await
            .context("mounting bench segments")?;
    }
    // The bench's nodes stay alive by pinging, as real nodes do.
    let pinger = {
        let client = client.clone();
        tokio::spawn(async move {
            loop {
                for node in 0..4 {
                    if let Ok(node) = NodeId::new(format!("node-{node}")) {
                        let _ = client.ping(Ping { node }).await;
                    }
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        })
    };
    eprintln!("bench put: {} s per case", duration.as_secs_f64());

    let js = jetstream::new(nats.connect().await?);
    let _ = js.delete_stream("BENCH_RAW_PUT").await;
    js.create_stream(jetstream::stream::Config {
        name: "BENCH_RAW_PUT".into(),
        subjects: vec!["bench.raw.put".into()],
        ..Default::default()
    })
    .await?;

    let raw_1 = raw_publish(&js, "bench.raw.put", 1, duration).await?;
    let one = run_clients(&client, 1, 1, duration, "one").await?;
    printer.print(&BenchResult::new(
        WORKLOAD,
        "put_start+put_end, 1 client",
        one,
        "ops/s",
        "raw JetStream publish+ack, 1 publisher",
        raw_1,
    ));

    let raw_64 = raw_publish(&js, "bench.raw.put", 64, duration).await?;
    let many = run_clients(&client, 64, 1, duration, "many").await?;
    printer.print(&BenchResult::new(
        WORKLOAD,
        "put_start+put_end, 64 clients",
        many,
        "ops/s",
        "raw JetStream publish+ack, 64 publishers",
        raw_64,
    ));

    let batched = run_clients(&client, 8, 256, duration, "batch").await?;
    printer.print(&BenchResult::new(
        WORKLOAD,
        "batch put, 8 clients x 256 objects",
        batched,
        "objects/s",
        "raw JetStream publish+ack, 64 publishers",
        raw_64,
    ));

    let metadata_16 = run_clients(&client, 16, 1, duration, "meta16").await?;
    let _ = js.delete_stream("BENCH_RAW_PUT").await;
    pinger.abort();
    master.shutdown().await?;
    end_to_end(nats, duration, metadata_16, printer).await
}

/// Values of the end-to-end case: a typical KV block.
const BLOCK: usize = 64 * 1024;

/// End to end with real nodes: `put` (put_start → write 2 replicas over TCP →
/// put_end) and `get` (replica list → read → verify) of 64 KiB blocks by 16
/// clients, against the metadata-only put at the same concurrency in the same run.
async fn end_to_end(
    nats: &BenchNats,
    duration: Duration,
    metadata_16: f64,
    printer: &mut Printer,
) -> anyhow::Result<()> {
    let cluster = ClusterId::new("bench")?;
    let subcluster = SubclusterId::new("e2e")?;
    let config = SubmasterConfig::new(
        cluster.clone(),
        subcluster.clone(),
        ProducerId::new("bench-e2e")?,
    );
    let master = SubmasterHandle::spawn(nats.connect().await?, config);
    let metadata = SubmasterClient::new(nats.connect().await?, cluster, subcluster);
    let mut nodes = Vec::new();
    for n in 0..2 {
        let node = NodeConfig::new(NodeId::new(format!("e2e-node-{n}"))?, 256 << 20)?;
        nodes.push(NodeHandle::start(node, metadata.clone()).await?);
    }
    let kv = KvClient::new(metadata, Arc::new(TcpTransport::default()));
    let value: Arc<Vec<u8>> = Arc::new((0..BLOCK).map(|i| i as u8).collect());
    let (puts, gets) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let deadline = Instant::now() + duration;
    let started = Instant::now();
    let tasks: Vec<_> = (0..16)
        .map(|c| {
            let (kv, value, puts, gets) = (
                kv.clone(),
                Arc::clone(&value),
                Arc::clone(&puts),
                Arc::clone(&gets),
            );
            tokio::spawn(async move {
                let mut i = 0u64;
                while Instant::now() < deadline {
                    let key = format!("e2e/{c}/{i}");
                    i += 1;
                    kv.put(&key, &value, 2).await?;
                    puts.fetch_add(1, Ordering::Relaxed);
                    let fetched = kv.get(&key).await?;
                    anyhow::ensure!(fetched.value.len() == BLOCK, "short read");
                    gets.fetch_add(1, Ordering::Relaxed);
                    // Keep the segments from filling up: the block is not needed again.
                    kv.metadata().remove(vec![key], true).await?;
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for task in tasks {
        task.await??;
    }
    let seconds = started.elapsed().as_secs_f64();
    let baseline = "metadata-only put, 16 clients";
    let put_rate = puts.load(Ordering::Relaxed) as f64 / seconds;
    let get_rate = gets.load(Ordering::Relaxed) as f64 / seconds;
    printer.print(&BenchResult::new(
        WORKLOAD,
        "end-to-end put 64 KiB x2 replicas, 16 clients",
        put_rate,
        "ops/s",
        baseline,
        metadata_16,
    ));
    printer.print(&BenchResult::new(
        WORKLOAD,
        "end-to-end get 64 KiB (verified), 16 clients",
        get_rate,
        "ops/s",
        baseline,
        metadata_16,
    ));
    for node in nodes {
        let _ = node.shutdown().await;
    }
    master.shutdown().await?;
    Ok(())
}
