//! The end-to-end put case: real nodes, 64 KiB blocks written over TCP, puts with
//! and without space leases, gets verified.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hkvm_client::{KvClient, NodeConfig, NodeHandle, SubmasterClient};
use hkvm_events::{ClusterId, NodeId, ProducerId, SubclusterId};
use hkvm_submaster::{SubmasterConfig, SubmasterHandle};
use hkvm_transfer::TcpTransport;

use super::super::report::{BenchResult, Printer};
use super::super::BenchNats;
use super::WORKLOAD;

/// Values of the end-to-end case: a typical KV block.
const BLOCK: usize = 64 * 1024;
/// Clients of the end-to-end case.
const CLIENTS: usize = 16;
/// Keys each end-to-end client puts, then gets, per round.
const ROUND: usize = 32;

/// Which timed phase of the end-to-end case is running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Put,
    Get,
}

/// Time spent in each phase of the end-to-end case, and whether to go on.
#[derive(Debug)]
struct PhaseClock {
    put: Duration,
    get: Duration,
    running: Option<(Phase, Instant)>,
    go_on: bool,
}

impl Default for PhaseClock {
    fn default() -> Self {
        Self {
            put: Duration::ZERO,
            get: Duration::ZERO,
            running: None,
            go_on: true,
        }
    }
}

impl PhaseClock {
    /// Ends the running phase (if any) and starts `phase`.
    fn start(&mut self, phase: Phase) {
        self.stop();
        self.running = Some((phase, Instant::now()));
    }

    /// Ends the running phase, adding its time to its total.
    fn stop(&mut self) {
        if let Some((phase, since)) = self.running.take() {
            let spent = since.elapsed();
            match phase {
                Phase::Put => self.put += spent,
                Phase::Get => self.get += spent,
            }
        }
    }
}

fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// End to end with real nodes: `put` (write 2 replicas over TCP into the
/// client's space lease → put_commit) and `get` (replica list → read → verify)
/// of 64 KiB blocks by 16 clients, each phase timed on its own; puts against the
/// metadata-only put at the same concurrency and against the same puts through
/// put_start / put_end, in the same run; gets against those puts.
pub(super) async fn end_to_end(
    nats: &BenchNats,
    duration: Duration,
    metadata_16: f64,
    printer: &mut Printer,
) -> anyhow::Result<()> {
    let (put_rate, get_rate) = end_to_end_rates(nats, duration, "e2e", true).await?;
    let (reserving_rate, _) = end_to_end_rates(nats, duration, "e2e-reserving", false).await?;
    printer.print(&BenchResult::new(
        WORKLOAD,
        "end-to-end put 64 KiB x2 replicas, 16 clients",
        put_rate,
        "ops/s",
        "metadata-only put, 16 clients",
        metadata_16,
    ));
    printer.print(&BenchResult::new(
        WORKLOAD,
        "end-to-end put 64 KiB x2 replicas, 16 clients",
        put_rate,
        "ops/s",
        "the same through put_start+put_end (no space lease)",
        reserving_rate,
    ));
    printer.print(&BenchResult::new(
        WORKLOAD,
        "end-to-end get 64 KiB (verified), 16 clients",
        get_rate,
        "ops/s",
        "end-to-end put (above)",
        put_rate,
    ));
    Ok(())
}

/// One end-to-end run in sub-cluster `name`, its puts with space leases or
/// without; returns the put and get rates.
async fn end_to_end_rates(
    nats: &BenchNats,
    duration: Duration,
    name: &str,
    leases: bool,
) -> anyhow::Result<(f64, f64)> {
    let cluster = ClusterId::new("bench")?;
    let subcluster = SubclusterId::new(name)?;
    let config = SubmasterConfig::new(
        cluster.clone(),
        subcluster.clone(),
        ProducerId::new(format!("bench-{name}"))?,
    );
    let master = SubmasterHandle::spawn(nats.connect().await?, config);
    let metadata = SubmasterClient::new(nats.connect().await?, cluster, subcluster);
    let mut nodes = Vec::new();
    for n in 0..2 {
        let node = NodeConfig::new(NodeId::new(format!("{name}-node-{n}"))?, 256 << 20)?;
        nodes.push(NodeHandle::start(node, metadata.clone()).await?);
    }
    let kv = KvClient::new(metadata, Arc::new(TcpTransport::default()))
        .with_space_leases(leases.then_some(hkvm_client::DEFAULT_LEASE_LEN));
    let value: Arc<Vec<u8>> = Arc::new((0..BLOCK).map(|i| i as u8).collect());
    let (puts, gets) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    // The clients move in lockstep, phase by phase: each puts ROUND keys, then
    // reads them back, then removes them (so the segments never fill). The put and
    // get phases are timed separately, from the release of the barrier that starts
    // them to the last client's arrival at the next one.
    let barrier = Arc::new(tokio::sync::Barrier::new(CLIENTS));
    let phases = Arc::new(std::sync::Mutex::new(PhaseClock::default()));
    let deadline = Instant::now() + duration;
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (kv, value, puts, gets, barrier, phases) = (
                kv.clone(),
                Arc::clone(&value),
                Arc::clone(&puts),
                Arc::clone(&gets),
                Arc::clone(&barrier),
                Arc::clone(&phases),
            );
            tokio::spawn(async move {
                let mut round = 0u64;
                loop {
                    // Every client sees the same decision: the leader makes it.
                    if barrier.wait().await.is_leader() {
                        let mut clock = lock(&phases);
                        clock.go_on = Instant::now() < deadline;
                        clock.start(Phase::Put);
                    }
                    barrier.wait().await;
                    if !lock(&phases).go_on {
                        return anyhow::Ok(());
                    }
                    let keys: Vec<String> =
                        (0..ROUND).map(|i| format!("e2e/{c}/{round}/{i}")).collect();
                    round += 1;
                    for key in &keys {
                        kv.put(key, &value, 2).await?;
                        puts.fetch_add(1, Ordering::Relaxed);
                    }
                    if barrier.wait().await.is_leader() {
                        lock(&phases).start(Phase::Get);
                    }
                    barrier.wait().await;
                    for key in &keys {
                        let fetched = kv.get(key).await?;
                        anyhow::ensure!(fetched.value.len() == BLOCK, "short read");
                        gets.fetch_add(1, Ordering::Relaxed);
                    }
                    if barrier.wait().await.is_leader() {
                        lock(&phases).stop();
                    }
                    // Untimed: the blocks are not needed again.
                    kv.metadata().remove(keys, true).await?;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await??;
    }
    let (put_time, get_time) = {
        let clock = lock(&phases);
        (clock.put, clock.get)
    };
    let put_rate = puts.load(Ordering::Relaxed) as f64 / put_time.as_secs_f64();
    let get_rate = gets.load(Ordering::Relaxed) as f64 / get_time.as_secs_f64();
    for node in nodes {
        let _ = node.shutdown().await;
    }
    master.shutdown().await?;
    Ok((put_rate, get_rate))
}
