//! The `recover` workload: a sub-master's time from start to its first served
//! request over a stream of N events, restoring by full replay (against a raw
//! JetStream replay of the same stream) and from a snapshot plus a tail (against
//! the full replay); and failover from killing the leader to the first served put
//! with a hot standby running, against a cold restart without one. All in the same
//! run. A global master's restart from a checkpoint is measured by `ingest`.

use std::future::IntoFuture as _;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use bytes::Bytes;
use futures::stream::FuturesOrdered;
use futures::StreamExt as _;
use hkvm_client::{RetryPolicy, SubmasterClient};
use hkvm_events::codec::{Header, MessageBuilder};
use hkvm_events::rpc::submaster::{ItemResult, PutEndItem, PutStartItem};
use hkvm_events::subject::{bucket_name, event_subject, message_id, stream_name};
use hkvm_events::{
    ClusterId, KvEvent, NodeId, Placement, ProducerId, PutCommitted, SegmentId, SegmentMounted,
    SubclusterId,
};
use hkvm_log::stream::ensure_stream;
use hkvm_log::SnapshotStore;
use hkvm_log::{Append, EventLog, JetStreamLog};
use hkvm_submaster::server::load_state;
use hkvm_submaster::snapshot;
use hkvm_submaster::{SubmasterConfig, SubmasterHandle};
use tokio::runtime::Runtime;

use super::cluster::key;
use super::report::{BenchResult, Printer};
use super::BenchNats;

const WORKLOAD: &str = "recover";
/// Events per appended message (the group committer's default bound).
const EVENTS_PER_MESSAGE: usize = 4096;
/// Appends in flight while writing.
const WINDOW: usize = 16;
/// Value size of every object; object `i` sits at offset `i * OBJECT_SIZE`.
const OBJECT_SIZE: u64 = 256 * 1024;
/// The longest wait for a killed instance's runtime, counted in the failover time.
const TEARDOWN: Duration = Duration::from_millis(50);
/// How long a step may take before the benchmark gives up.
const STEP_DEADLINE: Duration = Duration::from_secs(300);

/// The stream under test and how to reach it.
pub(super) struct Bench {
    pub(super) config: SubmasterConfig,
    pub(super) log: JetStreamLog,
    segments: [SegmentId; 2],
    /// Events written so far (the next object index is `written - 2`).
    written: usize,
    messages: u64,
}

impl Bench {
    pub(super) async fn new(js: &jetstream::Context, cluster: &str) -> anyhow::Result<Self> {
        let config = Self::config(cluster)?;
        let (cluster, subcluster) = (config.cluster.clone(), config.subcluster.clone());
        let _ = js.delete_stream(stream_name(&cluster, &subcluster)).await;
        for purpose in ["snapshots", "leader", "positions"] {
            let _ = js.delete_object_store(bucket_name(&cluster, purpose)).await;
            let _ = js.delete_key_value(bucket_name(&cluster, purpose)).await;
        }
        ensure_stream(js, &cluster, &subcluster, &config.stream).await?;
        let log = JetStreamLog::new(
            js.clone(),
            stream_name(&cluster, &subcluster),
            event_subject(&cluster, &subcluster),
        );
        Ok(Self {
            config,
            log,
            segments: [
                SegmentId::new("node-0-seg-0")?,
                SegmentId::new("node-1-seg-0")?,
            ],
            written: 0,
            messages: 0,
        })
    }

    /// The configuration of the bench cluster `cluster`'s sub-master (what
    /// [`Bench::new`] writes to and hosts), without touching NATS.
    pub(super) fn config(cluster: &str) -> anyhow::Result<SubmasterConfig> {
        let mut config = SubmasterConfig::new(
            ClusterId::new(cluster)?,
            SubclusterId::new("sc-0")?,
            ProducerId::new("bench-w")?,
        );
        // The stream's nodes never ping: nothing may declare them lost, and the
        // measured instances must not snapshot on their own.
        config.policy.node_timeout_ms = 24 * 3_600_000;
        config.snapshot_every_events = u64::MAX;
        config.snapshot_interval = Duration::from_secs(24 * 3600);
        Ok(config)
    }

    /// The snapshot store of the stream under test.
    pub(super) async fn snapshot_store(
        &self,
        js: &jetstream::Context,
    ) -> anyhow::Result<SnapshotStore> {
        Ok(SnapshotStore::open(
            js,
            &self.config.cluster,
            &self.config.subcluster,
            self.config.stream.replicas,
        )
        .await?)
    }

    /// The configuration of a measured instance.
    pub(super) fn instance(&self, name: &str) -> anyhow::Result<SubmasterConfig> {
        let mut config = self.config.clone();
        config.producer = ProducerId::new(name)?;
        Ok(config)
    }

    /// The `n`-th event of the stream: two mounts, then puts with two replicas.
    fn event(&self, n: usize) -> anyhow::Result<KvEvent> {
        if let Some(segment) = self.segments.get(n) {
            return Ok(KvEvent::SegmentMounted(SegmentMounted {
                node: NodeId::new(format!("node-{n}"))?,
                segment: segment.clone(),
                size: 1 << 44,
                endpoint: format!("127.0.0.1:{}", 7000 + n),
                rdma: None,
            }));
        }
        let i = n - self.segments.len();
        let placements = self
            .segments
            .iter()
            .map(|segment| Placement {
                segment: segment.clone(),
                offset: i as u64 * OBJECT_SIZE,
            })
            .collect();
        Ok(KvEvent::PutCommitted(PutCommitted::new(
            key(i),
            OBJECT_SIZE,
            i as u64,
            placements,
        )))
    }

    /// Appends `count` more events in large messages with a window of acks.
    pub(super) async fn write(&mut self, count: usize) -> anyhow::Result<()> {
        let header = Header {
            producer: self.config.producer.clone(),
            epoch: 1,
            unix_ms: 0,
        };
        let end = self.written + count;
        let mut pending = FuturesOrdered::new();
        let mut next = self.written;
        while next < end {
            let mut builder = MessageBuilder::new(&header, Vec::with_capacity(640 * 1024))?;
            let last = end.min(next + EVENTS_PER_MESSAGE);
            for n in next..last {
                builder.push(&self.event(n)?)?;
            }
            next = last;
            if pending.len() >= WINDOW {
                if let Some(ack) = pending.next().await {
                    let _: hkvm_log::AppendAck = ack?;
                }
            }
            self.messages += 1;
            let append = Append {
                expected_last_seq: None,
                msg_id: message_id(&self.config.producer, 1, self.messages),
                payload: Bytes::from(builder.finish()),
            };
            pending.push_back(self.log.send(append).await?.into_future());
        }
        while let Some(ack) = pending.next().await {
            ack?;
        }
        self.written = end;
        Ok(())
    }

    /// Reads every stored message with a raw pull consumer; returns seconds.
    async fn raw_replay(&self, js: &jetstream::Context) -> anyhow::Result<f64> {
        super::raw::replay_seconds(js, self.log.stream_name(), self.messages, 1024).await
    }
}

/// A sub-master on a runtime (and NATS connection) of its own, as a separate
/// process would have: a restore that keeps its thread busy cannot starve another
/// instance's lease renewals, which would move leadership behind the benchmark's back.
pub(super) struct Hosted {
    pub(super) name: String,
    runtime: Option<Runtime>,
    handle: Option<SubmasterHandle>,
}

impl Hosted {
    pub(super) async fn spawn(nats: &BenchNats, config: SubmasterConfig) -> anyhow::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        let name = config.producer.to_string();
        let url = nats.url.clone();
        let handle = runtime
            .spawn(async move {
                let client = async_nats::ConnectOptions::new()
                    .request_timeout(Some(Duration::from_secs(30)))
                    .connect(url.as_str())
                    .await?;
                anyhow::Ok(SubmasterHandle::spawn(client, config))
            })
            .await??;
        Ok(Self {
            name,
            runtime: Some(runtime),
            handle: Some(handle),
        })
    }

    /// Stops abruptly, as a crash would, and shuts its runtime down so its NATS
    /// connection closes, as a killed process's socket does at once (NATS then stops
    /// routing requests to it). Waits at most [`TEARDOWN`] for that; threads still
    /// blocked after it are left behind.
    pub(super) async fn abort(mut self) -> anyhow::Result<()> {
        if let Some(handle) = self.handle.take() {
            handle.abort();
        }
        if let Some(runtime) = self.runtime.take() {
            tokio::task::spawn_blocking(move || runtime.shutdown_timeout(TEARDOWN)).await?;
        }
        Ok(())
    }

    /// Stops gracefully (hands the lease over).
    pub(super) async fn shutdown(mut self) -> anyhow::Result<()> {
        if let Some(handle) = self.handle.take() {
            handle.shutdown().await?;
        }
        Ok(())
    }
}

impl Drop for Hosted {
    fn drop(&mut self) {
        if let Some(handle) = self.handle.take() {
            handle.abort();
        }
        // Dropping a runtime inside another one's task must not block.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// The producer id of the instance serving `client`'s sub-cluster.
pub(super) async fn serving(client: &SubmasterClient) -> anyhow::Result<String> {
    Ok(client.status().await?.producer)
}

/// Starts a sub-master and returns it with the seconds until it served a request
/// (an `exist` of the newest object answered `true`).
async fn start_until_served(
    nats: &BenchNats,
    client: &SubmasterClient,
    config: SubmasterConfig,
    newest: String,
) -> anyhow::Result<(Hosted, f64)> {
    let started = Instant::now();
    let handle = Hosted::spawn(nats, config).await?;
    loop {
        if let Ok(reply) = client.exist(vec![newest.clone()]).await {
            if reply.first() == Some(&true) {
                return Ok((handle, started.elapsed().as_secs_f64()));
            }
        }
        anyhow::ensure!(started.elapsed() < STEP_DEADLINE, "no sub-master served");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// One put (start and end) of a fresh key; retries until it succeeds. The put
/// carries an id, as a real client's does, so a start whose reply was lost in the
/// failover is answered with its own reservation when sent again (without one it
/// would be refused as pending until the put timeout reclaims it).
pub(super) async fn put_until_served(client: &SubmasterClient, key: String) -> anyhow::Result<()> {
    let started = Instant::now();
    let put_id = rand::random::<u64>().max(1);
    loop {
        let item = PutStartItem {
            key: key.clone(),
            size: OBJECT_SIZE,
            replicas: 1,
            preferred_segment: None,
            hard_pin: false,
            put_id,
            avoid_nodes: Vec::new(),
        };
        if let Ok(reply) = client.put_start(vec![item]).await {
            if matches!(reply.first(), Some(ItemResult::Ok(_))) {
                let end = PutEndItem {
                    key: key.clone(),
                    checksum: 7,
                    put_id,
                };
                if let Ok(reply) = client.put_end(vec![end]).await {
                    if matches!(reply.first(), Some(ItemResult::Ok(()))) {
                        return Ok(());
                    }
                }
            }
        }
        anyhow::ensure!(started.elapsed() < STEP_DEADLINE, "no put was served");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Runs the workload.
///
/// # Errors
/// When NATS fails or a sub-master never serves.
pub async fn run(nats: &BenchNats, quick: bool, printer: &mut Printer) -> anyhow::Result<()> {
    let (events, tail) = if quick {
        (50_000, 5_000)
    } else {
        (10_000_000, 100_000)
    };
    let connection = nats.connect().await?;
    let js = jetstream::new(connection.clone());
    let mut bench = Bench::new(&js, "brecover").await?;
    eprintln!("bench recover: writing {events} events");
    bench.write(events).await?;
    let raw_seconds = bench.raw_replay(&js).await?;
    let client = SubmasterClient::new(
        connection,
        bench.config.cluster.clone(),
        bench.config.subcluster.clone(),
    );
    let newest = |bench: &Bench| key(bench.written - bench.segments.len() - 1);

    eprintln!("bench recover: full replay to first served request");
    let (handle, full_seconds) =
        start_until_served(nats, &client, bench.instance("bench-full")?, newest(&bench)).await?;
    handle.shutdown().await?;
    printer.print(&BenchResult::new(
        WORKLOAD,
        format!("sub-master start to first served request, full replay of {events} events"),
        full_seconds,
        "s",
        format!("raw JetStream pull replay, same {} msgs", bench.messages),
        raw_seconds,
    ));

    eprintln!("bench recover: snapshot, tail of {tail} events");
    let started = Instant::now();
    let loaded = load_state(&js, &bench.config, false).await?;
    let load_seconds = started.elapsed().as_secs_f64();
    let store = bench.snapshot_store(&js).await?;
    let started = Instant::now();
    snapshot::save(&store, &loaded.state).await?;
    let save_seconds = started.elapsed().as_secs_f64();
    drop(loaded);
    bench.write(tail).await?;
    let (leader, snapshot_seconds) =
        start_until_served(nats, &client, bench.instance("bench-snap")?, newest(&bench)).await?;
    for result in [
        BenchResult::new(
            WORKLOAD,
            format!("sub-master start to first served request, snapshot + {tail}-event tail"),
            snapshot_seconds,
            "s",
            "full replay (above) (target ratio <= 0.3)",
            full_seconds,
        ),
        BenchResult::new(
            WORKLOAD,
            "state rebuild by full replay, in-process (load_state)",
            load_seconds,
            "s",
            "raw JetStream pull replay (above)",
            raw_seconds,
        ),
        BenchResult::new(
            WORKLOAD,
            format!("snapshot write ({events} objects)"),
            save_seconds,
            "s",
            "state rebuild by full replay (above)",
            load_seconds,
        ),
    ] {
        printer.print(&result);
    }

    // Failover runs over a smaller stream of its own (the state a hot standby holds
    // does not change how fast it takes over), so a standby is surely caught up
    // after the settle time below.
    leader.shutdown().await?;
    let _ = js.delete_stream(bench.log.stream_name()).await;
    let failover_events = events.min(100_000);
    let mut bench = Bench::new(&js, "brecoverf").await?;
    bench.write(failover_events).await?;
    let client = SubmasterClient::new(
        nats.connect().await?,
        bench.config.cluster.clone(),
        bench.config.subcluster.clone(),
    );
    let (leader, snapshot_seconds) =
        start_until_served(nats, &client, bench.instance("bench-lead")?, newest(&bench)).await?;
    eprintln!(
        "bench recover: failover to a hot standby (twice), then a cold restart, {failover_events} events"
    );
    // A client retrying every 5 ms shows when the sub-cluster serves again; the
    // default client's back-off (20 ms doubling to 1 s) adds its own wait.
    let eager = SubmasterClient::with_policy(
        nats.connect().await?,
        bench.config.cluster.clone(),
        bench.config.subcluster.clone(),
        RetryPolicy {
            min_backoff: Duration::from_millis(5),
            max_backoff: Duration::from_millis(5),
            ..RetryPolicy::default()
        },
    );
    // A standby rebuilds as the leader did, then follows; give it half as long again.
    let settle = Duration::from_secs_f64(snapshot_seconds * 1.5 + 1.0);
    let mut timings = Vec::new();
    let mut leader = leader;
    for (round, who) in [&eager, &client].into_iter().enumerate() {
        let standby = Hosted::spawn(nats, bench.instance(&format!("bench-sb{round}"))?).await?;
        tokio::time::sleep(settle).await;
        put_until_served(who, format!("failover/{round}/warm")).await?;
        // Kill whichever instance serves; if leadership moved while the standby
        // rebuilt, the old leader is rebuilding now: let it finish first.
        let (victim, survivor) = if serving(who).await? == standby.name {
            tokio::time::sleep(settle).await;
            (standby, leader)
        } else {
            (leader, standby)
        };
        let started = Instant::now();
        victim.abort().await?;
        put_until_served(who, format!("failover/{round}/after-kill")).await?;
        timings.push(started.elapsed().as_secs_f64());
        leader = survivor;
    }
    let started = Instant::now();
    leader.abort().await?;
    let cold = Hosted::spawn(nats, bench.instance("bench-cold")?).await?;
    put_until_served(&eager, "failover/after-cold".to_owned()).await?;
    let cold_seconds = started.elapsed().as_secs_f64();
    cold.shutdown().await?;
    let ttl = bench.config.leader_lease_ttl.as_millis();
    for result in [
        BenchResult::new(
            WORKLOAD,
            format!("leader kill to first served put, hot standby (lease TTL {ttl} ms, client retrying every 5 ms, {failover_events} events)"),
            timings[0],
            "s",
            "leader kill to first served put, cold restart (same client)",
            cold_seconds,
        ),
        BenchResult::new(
            WORKLOAD,
            "leader kill to first served put, hot standby, default client back-off",
            timings[1],
            "s",
            "the same with a client retrying every 5 ms (above)",
            timings[0],
        ),
    ] {
        printer.print(&result);
    }
    let _ = js.delete_stream(bench.log.stream_name()).await;
    Ok(())
}
