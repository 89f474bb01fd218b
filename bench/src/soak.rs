//! The `soak` workload: running for a long time. A sub-cluster with a leader and a
//! hot standby takes minutes of churn — puts from several clients into segments
//! small enough that the leader evicts, removes, and one leader kill half-way —
//! with snapshots and purges running; rows compare the end of the run with its
//! start (stream bytes, restore time, put p99). Then put p99 while a large
//! snapshot is written, as a hot standby writes it in a process of its own (copy,
//! encode, store, read back), against the same load without.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use hkvm_client::SubmasterClient;
use hkvm_events::rpc::submaster::{ItemError, ItemResult, MountSegment, PutEndItem, PutStartItem};
use hkvm_events::subject::Bucket;
use hkvm_events::{NodeId, SegmentId};
use hkvm_submaster::server::load_state;
use hkvm_submaster::SubmasterConfig;

use super::latency::quantile_ms;
use super::recover::{put_until_served, serving, Bench, Hosted};
use super::report::{BenchResult, Printer};
use super::BenchNats;

mod standby;

pub use standby::standby_snapshot;
use standby::{Phase, StandbyProcess};

const WORKLOAD: &str = "soak";
/// Value size of every churned object.
const OBJECT_SIZE: u64 = 64 * 1024;
/// Concurrent put clients.
const CLIENTS: usize = 8;
/// Every this many puts, a client removes one of its earlier keys.
const REMOVE_EVERY: u64 = 10;
/// How long a client waits after finding the pool full.
const NO_SPACE_PAUSE: Duration = Duration::from_millis(5);

/// How long and how big.
struct Sizes {
    windows: usize,
    window: Duration,
    /// Segment size: objects fill it and the leader evicts.
    segment: u64,
    snapshot_every_events: u64,
    snapshot_interval: Duration,
    /// Objects in the state whose snapshot is written under load.
    big_state: usize,
}

impl Sizes {
    fn new(quick: bool) -> Self {
        if quick {
            Self {
                windows: 4,
                window: Duration::from_secs(3),
                segment: 256 << 20,
                snapshot_every_events: 500,
                snapshot_interval: Duration::from_secs(2),
                big_state: 100_000,
            }
        } else {
            Self {
                windows: 9,
                window: Duration::from_secs(20),
                segment: 1 << 30,
                snapshot_every_events: 20_000,
                snapshot_interval: Duration::from_secs(10),
                big_state: 10_000_000,
            }
        }
    }
}

/// The put clients: each puts fresh keys, removes one of its own every
/// [`REMOVE_EVERY`] puts, and records every put's latency.
struct Load {
    stop: Arc<AtomicBool>,
    latencies: Arc<Mutex<Vec<(Instant, Duration)>>>,
    /// What [`Load::take`] handed out: (start, latency) of each put.
    taken: Mutex<Vec<(Instant, Duration)>>,
    failed: Arc<AtomicU64>,
    refused: Arc<AtomicU64>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(client: &SubmasterClient, prefix: &str, replicas: u32) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let latencies = Arc::new(Mutex::new(Vec::new()));
        let failed = Arc::new(AtomicU64::new(0));
        let refused = Arc::new(AtomicU64::new(0));
        let tasks = (0..CLIENTS)
            .map(|worker| {
                let (client, stop) = (client.clone(), Arc::clone(&stop));
                let (latencies, failed) = (Arc::clone(&latencies), Arc::clone(&failed));
                let refused = Arc::clone(&refused);
                let prefix = format!("{prefix}/{worker}");
                tokio::spawn(async move {
                    let mut n = 0u64;
                    // A put lost in a leader change goes again under the same key
                    // (with a new put id): its latency counts from the first try.
                    let mut first_try: Option<Instant> = None;
                    let mut attempt = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let key = format!("{prefix}/{n:012}");
                        let started = *first_try.get_or_insert_with(Instant::now);
                        attempt += 1;
                        let put_id = (worker as u64) << 48 | attempt;
                        match put(&client, &key, replicas, put_id).await {
                            Ok(Put::Done) => lock(&latencies).push((started, started.elapsed())),
                            Ok(Put::NoSpace) => {
                                refused.fetch_add(1, Ordering::Relaxed);
                                first_try = None;
                                tokio::time::sleep(NO_SPACE_PAUSE).await;
                                continue;
                            }
                            Ok(Put::Lost) => continue,
                            Err(error) => {
                                tracing::debug!(%error, key, "a soak put failed");
                                failed.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        first_try = None;
                        if n % REMOVE_EVERY == REMOVE_EVERY - 1 {
                            let old = format!("{prefix}/{:012}", n / 2);
                            let _ = client.remove(vec![old], true).await;
                        }
                        n += 1;
                    }
                })
            })
            .collect();
        Self {
            stop,
            latencies,
            taken: Mutex::default(),
            failed,
            refused,
            tasks,
        }
    }

    /// The latencies since the last call, sorted (and kept for [`Load::timeline`]).
    fn take(&self) -> Vec<Duration> {
        let taken = std::mem::take(&mut *lock(&self.latencies));
        let mut sorted: Vec<Duration> = taken.iter().map(|&(_, latency)| latency).collect();
        lock(&self.taken).extend(taken);
        sorted.sort_unstable();
        sorted
    }

    /// Every put taken so far, as (seconds from `from`, p99 in ms) per `slice`
    /// of their start times: where in a run the tail is.
    fn timeline(&self, from: Instant, slice: Duration) -> Vec<(f64, f64)> {
        let mut slices: std::collections::BTreeMap<u64, Vec<Duration>> = Default::default();
        for &(started, latency) in lock(&self.taken).iter() {
            let at = started.saturating_duration_since(from).as_millis() as u64;
            let index = at / slice.as_millis().max(1) as u64;
            slices.entry(index).or_default().push(latency);
        }
        slices
            .into_iter()
            .map(|(index, mut latencies)| {
                latencies.sort_unstable();
                (index as f64 * slice.as_secs_f64(), p99_ms(&latencies))
            })
            .collect()
    }

    /// Stops the clients; returns how many puts failed and how many found the
    /// pool full.
    async fn stop(self) -> (u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            let _ = task.await;
        }
        (
            self.failed.load(Ordering::Relaxed),
            self.refused.load(Ordering::Relaxed),
        )
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// How a put ended.
enum Put {
    Done,
    /// The pool was full (eviction had not caught up yet): a client waits and
    /// puts again, as Mooncake's do.
    NoSpace,
    /// The reservation went with a leader change (`NoPendingPut`): the put is
    /// definitely not committed, and the client puts it again.
    Lost,
}

/// One durable put (start and end, with a put id so that a resent end is
/// definite).
async fn put(
    client: &SubmasterClient,
    key: &str,
    replicas: u32,
    put_id: u64,
) -> anyhow::Result<Put> {
    let item = PutStartItem {
        key: key.to_owned(),
        size: OBJECT_SIZE,
        replicas,
        preferred_segment: None,
        hard_pin: false,
        put_id,
        avoid_nodes: Vec::new(),
    };
    let started = client.put_start(vec![item]).await?;
    match started.first() {
        Some(ItemResult::Ok(_)) => {}
        Some(ItemResult::Err(ItemError::NoSpace { .. })) => return Ok(Put::NoSpace),
        other => anyhow::bail!("put_start: {other:?}"),
    }
    let end = PutEndItem {
        key: key.to_owned(),
        checksum: 7,
        put_id,
    };
    let ended = client.put_end(vec![end]).await?;
    match ended.first() {
        Some(ItemResult::Ok(())) => Ok(Put::Done),
        Some(ItemResult::Err(ItemError::NoPendingPut)) => Ok(Put::Lost),
        other => anyhow::bail!("put_end: {other:?}"),
    }
}

fn p99_ms(sorted: &[Duration]) -> f64 {
    quantile_ms(sorted, 0.99)
}

/// Restores timed per measurement: their median is the figure (one restore of
/// a churned state takes tens of milliseconds, where one hiccup doubles it).
const RESTORES_TIMED: usize = 5;

/// A timed restore.
#[derive(Debug, Clone, Copy, Default)]
struct Restore {
    /// The median of [`RESTORES_TIMED`] rebuilds.
    seconds: f64,
    /// Objects in the state the last rebuild made.
    objects: usize,
    /// Events the last rebuild folded after its snapshot: a restore's cost
    /// grows with them (up to `snapshot_every_events`) as with the objects.
    tail: u64,
}

/// Rebuilds the state as a restarting sub-master does (newest snapshot plus
/// the tail), [`RESTORES_TIMED`] times.
async fn restore(js: &jetstream::Context, config: &SubmasterConfig) -> anyhow::Result<Restore> {
    let mut seconds = Vec::with_capacity(RESTORES_TIMED);
    let (mut objects, mut tail) = (0, 0);
    for _ in 0..RESTORES_TIMED {
        let started = Instant::now();
        let loaded = load_state(js, config, true).await?;
        seconds.push(started.elapsed().as_secs_f64());
        (objects, tail) = (loaded.state.object_count(), loaded.replayed);
    }
    seconds.sort_by(f64::total_cmp);
    Ok(Restore {
        seconds: seconds[RESTORES_TIMED / 2],
        objects,
        tail,
    })
}

/// How many objects, live or deleted, a listing of `cluster`'s snapshot store reads.
async fn snapshot_store_entries(
    js: &jetstream::Context,
    config: &SubmasterConfig,
) -> anyhow::Result<usize> {
    let bucket = Bucket::Snapshots.name(&config.cluster);
    Ok(hkvm_log::objects::metadata_names(js, &bucket).await?.len())
}

/// Runs the workload.
///
/// # Errors
/// When NATS fails or no sub-master serves.
pub async fn run(nats: &BenchNats, quick: bool, printer: &mut Printer) -> anyhow::Result<()> {
    let sizes = Sizes::new(quick);
    churn(nats, &sizes, printer).await?;
    snapshot_under_load(nats, &sizes, printer).await
}

/// Minutes of churn with snapshots, purges and one leader kill.
async fn churn(nats: &BenchNats, sizes: &Sizes, printer: &mut Printer) -> anyhow::Result<()> {
    let connection = nats.connect().await?;
    let js = jetstream::new(connection.clone());
    let bench = Bench::new(&js, "bsoak").await?;
    let mut config = bench.config.clone();
    config.snapshot_every_events = sizes.snapshot_every_events;
    config.snapshot_interval = sizes.snapshot_interval;
    // Churn evicts all the time: read leases and the takeover grace (every object
    // counts as leased for one lease TTL) are short, and upkeep runs often.
    config.policy.lease_ttl_ms = 1_000;
    config.policy.evict_ratio = 0.10;
    config.maintenance_interval = Duration::from_millis(100);
    let instance = |name: &str| -> anyhow::Result<SubmasterConfig> {
        let mut instance = config.clone();
        instance.producer = hkvm_events::ProducerId::new(name)?;
        Ok(instance)
    };
    let mut leader = Hosted::spawn(nats, instance("soak-a")?).await?;
    let client = SubmasterClient::new(
        connection,
        config.cluster.clone(),
        config.subcluster.clone(),
    );
    for node in 0..2 {
        client
            .mount_segment(MountSegment {
                node: NodeId::new(format!("soak-n{node}"))?,
                segment: SegmentId::new(format!("soak-n{node}-seg"))?,
                size: sizes.segment,
                endpoint: format!("127.0.0.1:{}", 7100 + node),
                rdma: None,
            })
            .await?;
    }
    let mut standby = Hosted::spawn(nats, instance("soak-b")?).await?;
    let capacity = sizes.segment / OBJECT_SIZE;
    eprintln!(
        "bench soak: {} windows of {:?}, {CLIENTS} clients, segments of {capacity} objects, \
         a snapshot every {} events or {:?}",
        sizes.windows, sizes.window, sizes.snapshot_every_events, sizes.snapshot_interval
    );
    let load = Load::start(&client, "soak", 2);
    let mut first: Option<(u64, Restore, f64, usize)> = None;
    let mut last = (0u64, 0.0f64);
    let mut spare = 0;
    for window in 0..sizes.windows {
        tokio::time::sleep(sizes.window).await;
        let latencies = load.take();
        let stats = bench.log.stats().await?;
        let p99 = p99_ms(&latencies);
        eprintln!(
            "bench soak: window {}/{}: {} puts, p99 {p99:.1} ms; stream {} msgs, {} bytes, \
             sequences {}..{}",
            window + 1,
            sizes.windows,
            latencies.len(),
            stats.messages,
            stats.bytes,
            stats.bounds.first_seq,
            stats.bounds.last_seq
        );
        if first.is_none() {
            first = Some((
                stats.bytes,
                restore(&js, &config).await?,
                p99,
                snapshot_store_entries(&js, &config).await?,
            ));
        }
        last = (stats.bytes, p99);
        if window == sizes.windows / 2 {
            // Kill whichever instance leads; the other takes over, and a fresh
            // standby joins, as an operator's restart would bring one.
            let serving = serving(&client).await?;
            eprintln!("bench soak: killing the leader {serving}");
            let survivor = if serving == leader.name {
                leader.abort().await?;
                standby
            } else {
                standby.abort().await?;
                leader
            };
            leader = survivor;
            spare += 1;
            standby = Hosted::spawn(nats, instance(&format!("soak-s{spare}"))?).await?;
        }
    }
    // Timed under the load, as the first window's restore was.
    let end_restore = restore(&js, &config).await?;
    let (failed, refused) = load.stop().await;
    let stats = bench.log.stats().await?;
    let end_entries = snapshot_store_entries(&js, &config).await?;
    let (first_bytes, first_restore, first_p99, first_entries) = first.unwrap_or_default();
    let results = [
        BenchResult::new(
            WORKLOAD,
            "stream bytes at the end of the run",
            last.0 as f64,
            "bytes",
            "stream bytes after the first window",
            first_bytes as f64,
        ),
        BenchResult::new(
            WORKLOAD,
            "messages held by the stream at the end",
            stats.messages as f64,
            "msgs",
            "messages appended over the run",
            stats.bounds.last_seq as f64,
        ),
        BenchResult::new(
            WORKLOAD,
            format!(
                "restore (snapshot + tail) at the end of the run ({} objects, {} tail events; median of 5, under the load)",
                end_restore.objects, end_restore.tail
            ),
            end_restore.seconds,
            "s",
            format!(
                "restore after the first window ({} objects, {} tail events)",
                first_restore.objects, first_restore.tail
            ),
            first_restore.seconds,
        ),
        BenchResult::new(
            WORKLOAD,
            "snapshot-store entries a listing reads at the end (live and deleted)",
            end_entries as f64,
            "objects",
            "entries after the first window",
            first_entries as f64,
        ),
        BenchResult::new(
            WORKLOAD,
            "put p99, last window",
            last.1,
            "ms",
            "put p99, first window",
            first_p99,
        ),
        BenchResult::new(
            WORKLOAD,
            "puts that failed (one leader kill in the run)",
            failed as f64,
            "puts",
            "none",
            0.0,
        ),
        BenchResult::new(
            WORKLOAD,
            "put_start answered no space (the pool full until eviction caught up)",
            refused as f64,
            "puts",
            "none",
            0.0,
        ),
    ];
    for result in &results {
        printer.print(result);
    }
    leader.shutdown().await?;
    standby.shutdown().await?;
    let _ = js.delete_stream(bench.log.stream_name()).await;
    Ok(())
}

/// The cluster name of the large state whose snapshot is written under load.
const BIG_CLUSTER: &str = "bsoaksnap";

/// The slices of the snapshot-under-load run whose put p99 is printed.
const TIMELINE_SLICE: Duration = Duration::from_secs(5);

/// Put p99 while a large state's snapshot is written as a hot standby writes it
/// (in a process of its own, [`standby_snapshot`]), against the same load without.
async fn snapshot_under_load(
    nats: &BenchNats,
    sizes: &Sizes,
    printer: &mut Printer,
) -> anyhow::Result<()> {
    let connection = nats.connect().await?;
    let js = jetstream::new(connection.clone());
    let mut bench = Bench::new(&js, BIG_CLUSTER).await?;
    let objects = sizes.big_state;
    eprintln!("bench soak: writing a stream of {objects} objects");
    bench.write(objects + 2).await?;
    let leader = Hosted::spawn(nats, bench.instance("soak-big")?).await?;
    let client = SubmasterClient::new(
        connection,
        bench.config.cluster.clone(),
        bench.config.subcluster.clone(),
    );
    put_until_served(&client, "soak/warm".to_owned()).await?;
    let mut standby = StandbyProcess::start(&nats.url, BIG_CLUSTER).await?;

    let load = Load::start(&client, "soak-big", 1);
    let load_started = Instant::now();
    // The load's first moments (connections, first allocations) count on
    // neither side; the baseline is a window before the snapshot and one after.
    tokio::time::sleep(sizes.window / 4).await;
    let _ = load.take();
    tokio::time::sleep(sizes.window).await;
    let before = load.take();
    let started = Instant::now();
    standby.ask_for_snapshot().await?;
    let mut phases = Vec::new();
    let mut phase_started = started;
    for phase in Phase::ALL {
        standby.phase_done(phase).await?;
        phases.push((phase, load.take(), phase_started.elapsed().as_secs_f64()));
        phase_started = Instant::now();
    }
    let snapshot_seconds = started.elapsed().as_secs_f64();
    // The standby's exit (the kernel taking its pages back) is not a snapshot's
    // cost, and not a quiet baseline either.
    standby.finish().await?;
    let _ = load.take();
    tokio::time::sleep(sizes.window).await;
    let after = load.take();
    let timeline = load.timeline(load_started, TIMELINE_SLICE);
    let (failed, _) = load.stop().await;
    anyhow::ensure!(failed == 0, "{failed} puts failed during the snapshot");
    let snapshot_at = started.duration_since(load_started).as_secs_f64();
    eprintln!(
        "bench soak: put p99 (ms) per {} s of the load; the snapshot ran from {snapshot_at:.1} s to {:.1} s:",
        TIMELINE_SLICE.as_secs(),
        snapshot_at + snapshot_seconds
    );
    for (at, p99) in timeline {
        eprintln!("bench soak:   {at:>5.0} s  {p99:>8.3}");
    }
    let mut without: Vec<Duration> = before.iter().chain(&after).copied().collect();
    without.sort_unstable();
    let mut during: Vec<Duration> = phases
        .iter()
        .flat_map(|(_, taken, _)| taken)
        .copied()
        .collect();
    during.sort_unstable();
    eprintln!(
        "bench soak: {} puts without a snapshot, {} while one was written ({snapshot_seconds:.1} s)",
        without.len(),
        during.len()
    );
    let mut results = vec![
        BenchResult::new(
            WORKLOAD,
            format!(
                "put p99 while a {objects}-object snapshot is written (as a standby process writes it, paced at the defaults: encode, store, read back)"
            ),
            p99_ms(&during),
            "ms",
            "put p99, same load, no snapshot (target ratio <= 2)",
            p99_ms(&without),
        ),
        BenchResult::new(
            WORKLOAD,
            "put p50 while that snapshot is written",
            quantile_ms(&during, 0.5),
            "ms",
            "put p50, same load, no snapshot",
            quantile_ms(&without, 0.5),
        ),
        BenchResult::new(
            WORKLOAD,
            "put p99 without a snapshot, the window after it",
            p99_ms(&after),
            "ms",
            "the window before it (how much the baseline itself moves)",
            p99_ms(&before),
        ),
    ];
    for (phase, taken, seconds) in &phases {
        results.push(BenchResult::new(
            WORKLOAD,
            format!(
                "put p99 while that snapshot is {} ({seconds:.1} s, {} puts)",
                phase.describe(),
                taken.len()
            ),
            p99_ms(taken),
            "ms",
            "put p99, same load, no snapshot",
            p99_ms(&without),
        ));
    }
    results.push(BenchResult::new(
        WORKLOAD,
        format!("snapshot written under that load ({objects} objects)"),
        snapshot_seconds,
        "s",
        "none",
        0.0,
    ));
    for result in results {
        printer.print(&result);
    }
    leader.shutdown().await?;
    let _ = js.delete_stream(bench.log.stream_name()).await;
    Ok(())
}
