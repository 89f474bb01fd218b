//! The `scale` workload: simulated clients (lightweight tasks, each a node with one
//! segment: one ping a second plus a mix of puts, gets and global
//! `batch_is_exist` at a configurable total rate) against N sub-clusters for N in
//! 1, 2, 4, 8, each client in sub-cluster `client % N`. The masters run as
//! `hkvm submaster` / `hkvm globalmaster` child processes (the `hkvm` binary next to
//! this one, or `$HKVM_BIN`) so their CPU time (utime + stime) and RSS are read from
//! `/proc`. N = 1 is the centralized baseline: every figure is compared with N = 1
//! in the same run.
//!
//! The split: the same clients and offered load at N = 1 as dummy clients, 16
//! behind each real client. A real client is one node: it alone mounts and pings,
//! and its dummies' metadata calls share its coalescing sub-master client. The
//! dummies call it in-process (the Unix-socket hop between a dummy and its real
//! client is per host and measured by the `dummies` workload); what reaches the
//! sub-master is what a deployment of real and dummy clients sends.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context as _;
use async_nats::jetstream;
use futures::StreamExt as _;
use hkvm_events::subject::{bucket_name, stream_name};
use hkvm_events::{ClusterId, SubclusterId};
use tokio::process::{Child, Command};
use tokio::time::Instant;

mod breaking;
mod client;
mod engine;
mod masters;

use client::{deploy, requests_sent, run_client, Client, Deployment, Kind, Record, Schedule};
pub(crate) use masters::wait_global_serves;
use masters::Masters;

use super::memory::rss_bytes;
use super::report::{BenchResult, Printer};
use super::BenchNats;

const WORKLOAD: &str = "scale";
/// NATS connections the simulated clients share.
const CONNECTIONS: usize = 8;
/// Dummy clients behind each real client in the split.
const DUMMIES_PER_REAL: usize = 16;

/// Options of the `scale` workload.
#[derive(Debug, Clone, clap::Args)]
pub struct ScaleArgs {
    /// Simulated clients (`scale`; --quick uses a twentieth).
    #[arg(long, default_value_t = 10_000)]
    pub clients: usize,
    /// Total puts + gets + batch_is_exist per second over all clients, besides the
    /// one ping per client per second (`scale`; --quick uses a tenth).
    #[arg(long, default_value_t = 2_000.0)]
    pub rate: f64,
    /// Percentages of puts, gets and batch_is_exist (`scale`).
    #[arg(long, default_value = "20,60,20", value_parser = parse_mix)]
    pub mix: Mix,
    /// Which loads to drive: `uniform` (the sweep of simulated clients above),
    /// `engine` (cards calling as inference engines do, docs/traffic-model.md),
    /// or both (the default).
    #[arg(long, value_enum, default_values_t = [Model::Uniform, Model::Engine])]
    pub model: Vec<Model>,
    /// The engine model's options.
    #[command(flatten)]
    pub engine: engine::EngineArgs,
}

/// A load of the `scale` workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Model {
    /// Simulated clients with a uniform mix of puts, gets and batch_is_exist.
    Uniform,
    /// Accelerator cards calling as inference engines do.
    Engine,
}

/// Env var naming the `hkvm` binary whose `submaster` and `globalmaster` commands
/// run the masters; by default the `hkvm` next to this binary.
pub const HKVM_BIN_ENV: &str = "HKVM_BIN";

/// What the workload needs before it starts: its options and the `hkvm` binary.
#[derive(Debug)]
pub struct Setup {
    args: ScaleArgs,
    hkvm: PathBuf,
}

impl Setup {
    /// Locates the `hkvm` binary (before any workload runs, so that a missing one
    /// fails at once rather than after the other workloads of `all`).
    ///
    /// # Errors
    /// When `$HKVM_BIN` names no file, or no `hkvm` is next to this binary.
    pub fn new(args: ScaleArgs) -> anyhow::Result<Self> {
        Ok(Self {
            args,
            hkvm: hkvm_binary()?,
        })
    }
}

/// The `hkvm` binary: `$HKVM_BIN`, else `hkvm` in this executable's directory.
pub(crate) fn hkvm_binary() -> anyhow::Result<PathBuf> {
    if let Some(explicit) = std::env::var_os(HKVM_BIN_ENV) {
        let path = PathBuf::from(explicit);
        anyhow::ensure!(
            path.is_file(),
            "${HKVM_BIN_ENV} is {}, which is not a file",
            path.display()
        );
        return Ok(path);
    }
    let exe = std::env::current_exe().context("locating the hkvm-bench binary")?;
    let beside = exe.with_file_name(format!("hkvm{}", std::env::consts::EXE_SUFFIX));
    anyhow::ensure!(
        beside.is_file(),
        "the scale workload runs `hkvm submaster` and `hkvm globalmaster`, but there is \
         no hkvm binary at {} (next to {}); build it (cargo build -p hkvm-cli) or set \
         ${HKVM_BIN_ENV}",
        beside.display(),
        exe.display()
    );
    Ok(beside)
}

/// Percentages of puts, gets and batch_is_exist among the operations.
#[derive(Debug, Clone, Copy)]
pub struct Mix {
    put: u32,
    get: u32,
}

fn parse_mix(text: &str) -> Result<Mix, String> {
    let parts: Vec<u32> = text
        .split(',')
        .map(|p| p.trim().parse::<u32>().map_err(|e| format!("{p:?}: {e}")))
        .collect::<Result<_, _>>()?;
    match parts.as_slice() {
        [put, get, exist] if put + get + exist == 100 => Ok(Mix {
            put: *put,
            get: *get,
        }),
        _ => Err(format!(
            "mix {text:?} is not put,get,exist percentages summing to 100"
        )),
    }
}

/// A cheap per-client random sequence (xorshift64), seeded from the client's
/// index so that runs repeat.
pub(super) struct Rng(u64);

impl Rng {
    /// The sequence of client `index`.
    pub(super) fn of_client(index: usize) -> Self {
        Self(0x9e37_79b9_7f4a_7c15 ^ (index as u64 + 1).wrapping_mul(0xff51_afd7))
    }

    /// The next 64 random bits.
    pub(super) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A uniform number in [0, 1).
    pub(super) fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// An exponential delay of mean `1 / rate` seconds (Poisson arrivals).
    pub(super) fn interval(&mut self, rate: f64) -> Duration {
        let unit = 1.0 - self.unit();
        Duration::from_secs_f64(-unit.ln() / rate.max(1e-6))
    }
}

/// A master child process, killed when dropped.
pub(crate) struct Master {
    child: Child,
}

impl Master {
    /// Starts `exe` with `args`, its output discarded.
    ///
    /// # Errors
    /// When the process cannot be started.
    pub(crate) fn spawn(exe: &Path, args: &[String]) -> anyhow::Result<Self> {
        let child = Command::new(exe)
            .args(args)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {} {}", exe.display(), args.join(" ")))?;
        Ok(Self { child })
    }

    /// The process id (none once it exited and was reaped).
    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.id()
    }
}

/// CPU seconds (user + system, all threads) of a process, from `/proc/<pid>/stat`.
pub(crate) fn cpu_seconds(pid: Option<u32>) -> f64 {
    let Some(pid) = pid else { return 0.0 };
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the parenthesised command name; utime and stime are 14 and 15.
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return 0.0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // USER_HZ is 100 on Linux for every architecture we run on.
    (ticks(11) + ticks(12)) / 100.0
}

/// The machine's busy and total CPU ticks over all cores since boot (`/proc/stat`).
pub(super) fn machine_cpu_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().find(|line| line.starts_with("cpu "))?;
    let ticks: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    // user nice system idle iowait irq softirq steal ...: idle and iowait are not busy.
    let total: u64 = ticks.iter().take(8).sum();
    let idle = ticks.get(3)? + ticks.get(4).copied().unwrap_or(0);
    Some((total.saturating_sub(idle), total))
}

pub(super) fn percentile(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    f64::from(sorted[((sorted.len() - 1) as f64 * p).round() as usize])
}

/// What one point of the sweep measured.
#[derive(Debug, Clone, Copy, Default)]
struct Point {
    ops_per_s: f64,
    requests_per_s: f64,
    /// Requests the clients sent to sub-masters (after coalescing), per second.
    sub_requests_per_s: f64,
    /// Sub-master CPU per 1000 operations (puts, gets, exists).
    sub_cpu_per_kop: f64,
    p50_us: f64,
    p99_us: f64,
    put_p99_us: f64,
    failures: u64,
    sub_cpu_per_k: f64,
    global_cpu_per_k: f64,
    nats_cpu_per_k: f64,
    sub_rss_max: f64,
    sub_rss_total: f64,
    global_rss: f64,
    /// The share of the machine's CPU time (all cores) busy over the window.
    machine_busy: f64,
}

const MIB: f64 = 1024.0 * 1024.0;

/// What each point reports against N = 1: label, unit, figure.
type Figure = (&'static str, &'static str, fn(&Point) -> f64);
const FIGURES: [Figure; 11] = [
    ("sustained ops/s (puts, gets, exists)", "ops/s", |p| {
        p.ops_per_s
    }),
    ("sustained requests/s (ops + pings)", "req/s", |p| {
        p.requests_per_s
    }),
    ("op latency p50", "us", |p| p.p50_us),
    ("op latency p99", "us", |p| p.p99_us),
    ("put latency p99", "us", |p| p.put_p99_us),
    ("sub-master CPU per 1000 requests (all N)", "cpu-s", |p| {
        p.sub_cpu_per_k
    }),
    ("global-master CPU per 1000 requests", "cpu-s", |p| {
        p.global_cpu_per_k
    }),
    ("nats-server CPU per 1000 requests", "cpu-s", |p| {
        p.nats_cpu_per_k
    }),
    ("largest sub-master RSS", "MiB", |p| p.sub_rss_max / MIB),
    ("all sub-masters RSS", "MiB", |p| p.sub_rss_total / MIB),
    ("global-master RSS", "MiB", |p| p.global_rss / MIB),
];

/// The sizes of one sweep.
#[derive(Debug, Clone, Copy)]
struct Sweep {
    clients: usize,
    rate: f64,
    mix: Mix,
    warmup: Duration,
    window: Duration,
}

/// Drops what an earlier run with this cluster name left on the server.
pub(crate) async fn clean(js: &jetstream::Context, cluster: &ClusterId, subclusters: usize) {
    for index in 0..subclusters {
        if let Ok(id) = SubclusterId::new(format!("sc-{index}")) {
            let _ = js.delete_stream(stream_name(cluster, &id)).await;
        }
    }
    for purpose in ["snapshots", "checkpoints", "blooms"] {
        let _ = js.delete_object_store(bucket_name(cluster, purpose)).await;
    }
    for purpose in ["leader", "registry"] {
        let _ = js.delete_key_value(bucket_name(cluster, purpose)).await;
    }
}

/// Starts the masters of `subclusters` sub-clusters and a global master, waits
/// until they serve, mounts one segment per node, runs the clients and reads
/// the masters' CPU time and memory over the measured window.
async fn run_point(
    nats: &BenchNats,
    exe: &Path,
    sweep: &Sweep,
    subclusters: usize,
    deployment: Deployment,
) -> anyhow::Result<Point> {
    let name = match deployment {
        Deployment::Full => format!("bscale{subclusters}"),
        Deployment::Dummies(_) => format!("bscale{subclusters}d"),
    };
    let masters = Masters::start(nats, exe, name, subclusters).await?;
    let connections =
        futures::future::try_join_all((0..CONNECTIONS).map(|_| nats.connect())).await?;
    let (clients, callers) = deploy(
        deployment,
        sweep,
        &masters.cluster,
        &masters.ids,
        &connections,
    )?;
    let nodes = clients.iter().filter(|client| client.is_node());
    let mounts: Vec<anyhow::Result<()>> = futures::stream::iter(nodes.map(Client::mount))
        .buffer_unordered(256)
        .collect()
        .await;
    mounts.into_iter().collect::<anyhow::Result<()>>()?;
    masters.wait_global().await?;

    let start = Instant::now();
    let schedule = Schedule {
        start,
        measure_from: start + sweep.warmup,
        end: start + sweep.warmup + sweep.window,
        op_period: Duration::from_secs_f64(sweep.clients as f64 / sweep.rate.max(1e-3)),
        mix: sweep.mix,
    };
    let tasks: Vec<_> = clients
        .into_iter()
        .map(|client| tokio::spawn(run_client(client, schedule)))
        .collect();
    tokio::time::sleep_until(schedule.measure_from).await;
    let cpu_before = masters.cpu();
    let sent_before = requests_sent(&callers);
    tokio::time::sleep_until(schedule.end).await;
    let cpu_after = masters.cpu();
    let sent = requests_sent(&callers) - sent_before;
    let (sub_pids, global_pid) = masters.pids();
    let rss: Vec<f64> = sub_pids
        .iter()
        .map(|&pid| rss_bytes(pid).unwrap_or(0) as f64)
        .collect();
    let global_rss = rss_bytes(global_pid).unwrap_or(0) as f64;

    let mut all = Record::default();
    for task in tasks {
        let record = task.await.context("a simulated client failed")?;
        for (into, from) in all.latencies.iter_mut().zip(record.latencies) {
            into.extend(from);
        }
        all.failures += record.failures;
    }
    drop(masters);

    let seconds = sweep.window.as_secs_f64();
    let pings = all.latencies[Kind::Ping as usize].len();
    let mut ops: Vec<u32> = all.latencies[1..].iter().flatten().copied().collect();
    ops.sort_unstable();
    let mut puts = std::mem::take(&mut all.latencies[Kind::Put as usize]);
    puts.sort_unstable();
    let requests = (ops.len() + pings) as f64;
    let per_k = |before: f64, after: f64| (after - before) / (requests / 1000.0).max(1e-9);
    Ok(Point {
        ops_per_s: ops.len() as f64 / seconds,
        requests_per_s: requests / seconds,
        sub_requests_per_s: sent as f64 / seconds,
        sub_cpu_per_kop: (cpu_after.submasters - cpu_before.submasters)
            / (ops.len() as f64 / 1000.0).max(1e-9),
        p50_us: percentile(&ops, 0.5),
        p99_us: percentile(&ops, 0.99),
        put_p99_us: percentile(&puts, 0.99),
        failures: all.failures,
        sub_cpu_per_k: per_k(cpu_before.submasters, cpu_after.submasters),
        global_cpu_per_k: per_k(cpu_before.global, cpu_after.global),
        nats_cpu_per_k: per_k(cpu_before.nats, cpu_after.nats),
        sub_rss_max: rss.iter().copied().fold(0.0, f64::max),
        sub_rss_total: rss.iter().sum(),
        global_rss,
        machine_busy: cpu_after.machine_busy_since(&cpu_before),
    })
}

/// Runs the workload.
///
/// # Errors
/// When a master does not start or NATS fails.
pub async fn run(
    nats: &BenchNats,
    quick: bool,
    setup: &Setup,
    printer: &mut Printer,
) -> anyhow::Result<()> {
    let args = &setup.args;
    if args.model.contains(&Model::Uniform) {
        run_uniform(nats, quick, setup, printer).await?;
    }
    if args.model.contains(&Model::Engine) {
        engine::run(nats, &setup.hkvm, &args.engine, quick, printer).await?;
    }
    Ok(())
}

/// The uniform sweep, its split and its break probe.
async fn run_uniform(
    nats: &BenchNats,
    quick: bool,
    setup: &Setup,
    printer: &mut Printer,
) -> anyhow::Result<()> {
    let args = &setup.args;
    let (sweep, points) = if quick {
        let sweep = Sweep {
            clients: (args.clients / 20).max(1),
            rate: args.rate / 10.0,
            mix: args.mix,
            warmup: Duration::from_millis(500),
            window: Duration::from_millis(1500),
        };
        (sweep, vec![1, 2])
    } else {
        let sweep = Sweep {
            clients: args.clients,
            rate: args.rate,
            mix: args.mix,
            warmup: Duration::from_secs(5),
            window: Duration::from_secs(15),
        };
        (sweep, vec![1, 2, 4, 8])
    };
    let mut results: Vec<(usize, Point)> = Vec::new();
    for n in points {
        eprintln!(
            "bench scale: N={n}: {} clients ({} each), {} ops/s offered + 1 ping/s per client, {} s",
            sweep.clients,
            sweep.clients / n,
            sweep.rate,
            sweep.window.as_secs_f64()
        );
        let point = run_point(nats, &setup.hkvm, &sweep, n, Deployment::Full).await?;
        results.push((n, point));
    }
    eprintln!(
        "bench scale: N=1: {} dummy clients behind {} real clients ({DUMMIES_PER_REAL} each), same load",
        sweep.clients,
        sweep.clients.div_ceil(DUMMIES_PER_REAL)
    );
    let split = run_point(
        nats,
        &setup.hkvm,
        &sweep,
        1,
        Deployment::Dummies(DUMMIES_PER_REAL),
    )
    .await?;
    let base = results.first().map(|(_, p)| *p).unwrap_or_default();
    let offered = sweep.rate + sweep.clients as f64;
    for (n, p) in &results {
        let tag = format!("N={n}, {} clients", sweep.clients);
        for (label, unit, figure) in FIGURES {
            printer.print(&BenchResult::new(
                WORKLOAD,
                format!("{tag}: {label}"),
                figure(p),
                unit,
                "N=1 (same run)",
                figure(&base),
            ));
        }
        printer.print(&BenchResult::new(
            WORKLOAD,
            format!("{tag}: failed requests in the window"),
            p.failures as f64,
            "requests",
            "requests offered in the window",
            offered * sweep.window.as_secs_f64(),
        ));
    }
    print_targets(printer, &sweep, &base);
    print_split(printer, &sweep, &split, &base);
    if !quick {
        breaking::probe(nats, &setup.hkvm, &sweep, &results, printer).await;
    }
    Ok(())
}

/// The centralized point (N = 1) against what one sub-master must do: at most 20 µs
/// of CPU per request, and the whole client load at a p99 of at most 10 ms.
fn print_targets(printer: &mut Printer, sweep: &Sweep, one: &Point) {
    let tag = format!("one sub-master (N=1), {} clients", sweep.clients);
    for (label, unit, value, target) in [
        ("CPU per request", "us", one.sub_cpu_per_k * 1e3, 20.0),
        ("op latency p99", "us", one.p99_us, 10_000.0),
    ] {
        printer.print(&BenchResult::new(
            WORKLOAD,
            format!("{tag}: {label}, against its target"),
            value,
            unit,
            "target (at most)",
            target,
        ));
    }
}

/// The split's rows: dummies behind real clients against full clients, N = 1.
fn print_split(printer: &mut Printer, sweep: &Sweep, split: &Point, full: &Point) {
    let reals = sweep.clients.div_ceil(DUMMIES_PER_REAL);
    let tag = format!("N=1, {} dummies behind {reals} real clients", sweep.clients);
    let baseline = format!("{} full clients, same load (same run)", sweep.clients);
    let rows: [Figure; 6] = [
        (
            "sub-master requests/s (after coalescing; pings included)",
            "req/s",
            |p| p.sub_requests_per_s,
        ),
        ("sub-master CPU per 1000 operations", "cpu-s", |p| {
            p.sub_cpu_per_kop
        }),
        ("sustained ops/s (puts, gets, exists)", "ops/s", |p| {
            p.ops_per_s
        }),
        ("op latency p50", "us", |p| p.p50_us),
        ("op latency p99", "us", |p| p.p99_us),
        ("failed requests in the window", "requests", |p| {
            p.failures as f64
        }),
    ];
    for (label, unit, figure) in rows {
        printer.print(&BenchResult::new(
            WORKLOAD,
            format!("{tag}: {label}"),
            figure(split),
            unit,
            baseline.clone(),
            figure(full),
        ));
    }
}
