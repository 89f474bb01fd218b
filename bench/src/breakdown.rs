//! The `breakdown` workload: where the microseconds of one client's 4 KiB get
//! and put go, one call at a time, layer by layer, each layer against the one
//! below it in the same run.
//!
//! A get through the Rust client of a value its own segment holds is a
//! `get_replica_list` on the direct link to the leader, then a local copy with
//! its checksum. The layers under it: a plain TCP round trip of a small message
//! (the floor of any request), a ping on the direct link (framing, the link and
//! the leader's direct front; no request loop), an `exist` (adds the request
//! loop and a state lookup), a `get_replica_list` (adds the replica list), and
//! a copy of 4 KiB with its xxh3 (the floor of the data move). A put is the
//! local copy and one `put_commit` into a space lease, durable once JetStream
//! stored its event: its floor is a raw JetStream publish fenced as the
//! sub-master's appends are, and its time inside the sub-master is split into
//! the stages of `hkvm_submaster_write_stage_seconds`.

use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use async_nats::jetstream;
use hkvm_client::store::{node_name_for, Store, StoreAddress, StoreConfig};
use hkvm_client::{PutOptions, SubmasterClient};
use hkvm_events::rpc::submaster::Ping;
use hkvm_events::{ClusterId, NodeId, ProducerId, SubclusterId};
use hkvm_submaster::{SubmasterConfig, SubmasterHandle};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use xxhash_rust::xxh3::xxh3_64;

use super::latency::{mean_us, quantile_us};
use super::put::raw_fenced_publish;
use super::report::{BenchResult, Printer};
use super::scale::cpu_seconds;
use super::stages::{print_write_stages, StageReading};
use super::BenchNats;

const WORKLOAD: &str = "breakdown";
/// The size of the values timed.
const VALUE: usize = 4 << 10;
/// The size of the large values timed.
const LARGE_VALUE: usize = 1 << 20;
/// Large values put (well inside the segment).
const LARGE_KEYS: u64 = 400;
/// Distinct keys the gets cycle over.
const KEYS: u64 = 1000;
/// Bytes each way of the plain TCP round trip: about a small request's frame.
const SMALL_MESSAGE: usize = 64;

/// Every latency of `step` run one at a time for `duration` (at least `at_least`
/// times), sorted.
async fn samples<F, Fut>(
    duration: Duration,
    at_least: u64,
    mut step: F,
) -> anyhow::Result<Vec<Duration>>
where
    F: FnMut(u64) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let started = Instant::now();
    let mut latencies = Vec::new();
    let mut done = 0u64;
    while started.elapsed() < duration || done < at_least {
        let sent = Instant::now();
        step(done).await?;
        latencies.push(sent.elapsed());
        done += 1;
    }
    latencies.sort_unstable();
    Ok(latencies)
}

/// Round trips of `SMALL_MESSAGE` bytes each way to an echo task in this
/// process over loopback TCP (no delay, as the direct link sets it).
async fn tcp_round_trips(duration: Duration) -> anyhow::Result<Vec<Duration>> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let echo = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await?;
        stream.set_nodelay(true)?;
        let mut buffer = [0u8; SMALL_MESSAGE];
        loop {
            if stream.read_exact(&mut buffer).await.is_err() {
                return anyhow::Ok(());
            }
            stream.write_all(&buffer).await?;
        }
    });
    let mut stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let started = Instant::now();
    let mut latencies = Vec::new();
    let mut buffer = [7u8; SMALL_MESSAGE];
    while started.elapsed() < duration || latencies.len() < 100 {
        let sent = Instant::now();
        stream.write_all(&buffer).await?;
        stream.read_exact(&mut buffer).await?;
        latencies.push(sent.elapsed());
    }
    echo.abort();
    latencies.sort_unstable();
    Ok(latencies)
}

/// Copies of `value` into another buffer, each with the xxh3 of the copy (a
/// local replica's data move), for `duration` (at least 100), sorted.
fn copy_samples(duration: Duration, value: &[u8]) -> Vec<Duration> {
    let mut target = vec![0u8; value.len()];
    let started = Instant::now();
    let mut latencies = Vec::new();
    while started.elapsed() < duration || latencies.len() < 100 {
        let copied = Instant::now();
        target.copy_from_slice(value);
        std::hint::black_box(xxh3_64(&target));
        latencies.push(copied.elapsed());
    }
    latencies.sort_unstable();
    latencies
}

/// Pings until the client's direct link to the leader is up (a client links
/// once it is busy).
async fn link(client: &SubmasterClient, node: &NodeId) -> anyhow::Result<()> {
    for _ in 0..200 {
        client.ping(Ping { node: node.clone() }).await?;
        if client.direct_link().is_some() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    anyhow::bail!("the direct link to the leader did not come up")
}

/// A floor's row: its p50, compared with nothing (`what` says what it is the
/// floor of).
fn floor(printer: &mut Printer, metric: &str, sorted: &[Duration], what: &str) {
    printer.print(&BenchResult::new(
        WORKLOAD,
        format!("{metric} p50"),
        quantile_us(sorted, 0.5),
        "us",
        format!("none ({what})"),
        0.0,
    ));
}

/// One layer's row: its p50 against the layer below's p50.
fn layer(printer: &mut Printer, metric: &str, sorted: &[Duration], below: (&str, &[Duration])) {
    let (below_name, below_sorted) = below;
    printer.print(&BenchResult::new(
        WORKLOAD,
        format!("{metric} p50"),
        quantile_us(sorted, 0.5),
        "us",
        format!("{below_name} p50"),
        quantile_us(below_sorted, 0.5),
    ));
}

/// Runs `work` (which yields one sample per operation) and the nats-server's CPU
/// (user + system) per operation meanwhile, in microseconds; `None` when the
/// server is not this bench's child.
async fn broker_cpu_per_op<T>(
    nats: &BenchNats,
    work: impl Future<Output = anyhow::Result<Vec<T>>>,
) -> anyhow::Result<(Vec<T>, Option<f64>)> {
    let pid = nats.pid();
    let before = cpu_seconds(pid);
    let done = work.await?;
    let spent = cpu_seconds(pid) - before;
    let per_op = (pid.is_some() && !done.is_empty()).then(|| spent * 1e6 / done.len() as f64);
    Ok((done, per_op))
}

/// Runs the workload.
///
/// # Errors
/// When the sub-master, the store or NATS fails.
pub async fn run(nats: &BenchNats, quick: bool, printer: &mut Printer) -> anyhow::Result<()> {
    let duration = if quick {
        Duration::from_millis(300)
    } else {
        Duration::from_secs(3)
    };
    // A cluster of its own: removing the values at the end asks every
    // sub-cluster registered in it, and other workloads' have stopped.
    let cluster = ClusterId::new("bench-breakdown")?;
    let subcluster = SubclusterId::new("breakdown")?;
    let config = SubmasterConfig::new(
        cluster.clone(),
        subcluster.clone(),
        ProducerId::new("bench-breakdown")?,
    );
    let master = SubmasterHandle::spawn(nats.connect().await?, config);
    let address: StoreAddress = format!("{}/{cluster}/{subcluster}", nats.url)
        .parse()
        .context("the bench's store address")?;
    let mut store_config = StoreConfig::new(address, "localhost");
    store_config.global_segment_size = 1 << 30;
    let store = Store::open(store_config)
        .await
        .context("opening the store")?;
    let store = &store;
    let metadata = store.kv().metadata();
    eprintln!("bench breakdown: {} s per layer", duration.as_secs_f64());

    // Puts first: they also write the values the gets read.
    let value: &[u8] = &[0x5a; VALUE];
    let options = &PutOptions::default();
    let stages_before = StageReading::parse(&master.metrics_text());
    let (puts, put_broker_cpu) = broker_cpu_per_op(
        nats,
        samples(duration, KEYS, |i| async move {
            let key = format!("bd-{i}");
            let mut results = store.put(&[(key.as_str(), &[value][..])], options).await?;
            results.pop().context("no put result")??;
            Ok(())
        }),
    )
    .await?;
    let stages = StageReading::parse(&master.metrics_text()).means_since(&stages_before);
    let large: &[u8] = &vec![0xa5; LARGE_VALUE];
    let large_puts = samples(Duration::ZERO, LARGE_KEYS, |i| async move {
        let key = format!("bd-large-{i}");
        let mut results = store.put(&[(key.as_str(), &[large][..])], options).await?;
        results.pop().context("no put result")??;
        Ok(())
    })
    .await?;
    let large_copies = copy_samples(duration, large);
    let js = jetstream::new(nats.connect().await?);
    let _ = js.delete_stream("BENCH_BREAKDOWN").await;
    js.create_stream(jetstream::stream::Config {
        name: "BENCH_BREAKDOWN".into(),
        subjects: vec!["bench.breakdown".into()],
        ..Default::default()
    })
    .await?;
    let (fenced, append_broker_cpu) =
        broker_cpu_per_op(nats, raw_fenced_publish(&js, "bench.breakdown", duration)).await?;
    let _ = js.delete_stream("BENCH_BREAKDOWN").await;

    let node = NodeId::new(node_name_for(store.hostname()))?;
    link(metadata, &node).await?;
    let round_trips = tcp_round_trips(duration).await?;
    let pings = samples(duration, 100, |_| {
        let node = node.clone();
        async move {
            metadata.ping(Ping { node }).await?;
            Ok(())
        }
    })
    .await?;
    let key = |i: u64| format!("bd-{}", i % KEYS);
    let exists = samples(duration, 100, |i| async move {
        let reply = metadata.exist(vec![key(i)]).await?;
        anyhow::ensure!(reply.first() == Some(&true), "a written key is absent");
        Ok(())
    })
    .await?;
    let replica_lists = samples(duration, 100, |i| async move {
        metadata.get_replica_list(vec![key(i)]).await?;
        Ok(())
    })
    .await?;
    let gets = samples(duration, 100, |i| async move {
        let fetched = store.kv().get(&key(i)).await?;
        anyhow::ensure!(fetched.value.len() == VALUE, "a short value");
        Ok(())
    })
    .await?;
    let copies = copy_samples(duration, value);
    anyhow::ensure!(
        metadata.direct_requests() > 0,
        "no request went on the direct link"
    );

    let tcp = "plain TCP round trip, 64 B each way, loopback";
    floor(
        printer,
        tcp,
        &round_trips,
        "the floor of every request below",
    );
    let ping = "ping on the direct link (framing, the link, the leader's direct front)";
    layer(printer, ping, &pings, (tcp, &round_trips));
    let exist = "exist of 1 key on the direct link (adds the request loop and a lookup)";
    layer(printer, exist, &exists, (ping, &pings));
    let list = "get_replica_list of 1 key on the direct link (adds the replica list)";
    layer(printer, list, &replica_lists, (exist, &exists));
    let copy = "copy of 4 KiB and its xxh3 (the data move of a local replica)";
    floor(printer, copy, &copies, "a floor");
    let get = "get 4 KiB through the Rust client, local replica (replica list, copy, checksum)";
    layer(printer, get, &gets, (list, &replica_lists));

    let append = "raw JetStream publish+ack, fenced as the sub-master appends";
    floor(printer, append, &fenced, "the floor of a durable put");
    let put = "put 4 KiB through the Rust client, local replica (copy, one put_commit, durable)";
    layer(printer, put, &puts, (append, &fenced));
    layer(printer, put, &puts, (exist, &exists));
    let large_copy = "copy of 1 MiB and its xxh3";
    floor(printer, large_copy, &large_copies, "a floor");
    let large_put = "put 1 MiB through the Rust client, local replica";
    layer(printer, large_put, &large_puts, (put, &puts));
    layer(printer, large_put, &large_puts, (large_copy, &large_copies));
    if let (Some(append_cpu), Some(put_cpu)) = (append_broker_cpu, put_broker_cpu) {
        let append_cpu_name = "nats-server CPU per raw fenced append, one at a time";
        printer.print(&BenchResult::new(
            WORKLOAD,
            append_cpu_name,
            append_cpu,
            "us",
            "none (the broker's CPU floor of a durable put)",
            0.0,
        ));
        printer.print(&BenchResult::new(
            WORKLOAD,
            "nats-server CPU per put 4 KiB, one at a time",
            put_cpu,
            "us",
            append_cpu_name,
            append_cpu,
        ));
    }
    print_write_stages(
        WORKLOAD,
        "put 4 KiB",
        "1 client",
        mean_us(&puts),
        &stages,
        printer,
    );
    store.remove_all(Some("^bd-"), None, true).await?;
    store.close().await;
    master.shutdown().await?;
    Ok(())
}
