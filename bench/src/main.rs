//! `hkvm-bench`: benchmarks that report every figure as a ratio against a baseline
//! measured in the same run (this machine is noisy), as a table or as one JSON
//! object per result line (`--json`), and `loadgen`, the load generator that the
//! chaos tests run inside the cluster network. `hkvm bench <workload>` and
//! `hkvm loadgen` run this binary. Workloads start what they need (a nats-server
//! child from the test kit) unless given `--nats`. The binary's global allocator
//! counts allocations, so that benchmarks can report allocations per event and
//! bytes per object.

mod alloc;
mod breakdown;
mod cluster;
mod dummies;
mod events;
mod exist;
mod ingest;
mod interdc;
mod latency;
mod loadgen;
mod memory;
mod mooncake;
mod put;
mod python;
mod raw;
mod recover;
mod report;
mod scale;
mod soak;
mod stages;
mod target;
mod transfer;

use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use hkvm_testkit::{NatsServer, ServerOptions};

/// HKVM benchmarks (every figure against a baseline measured in the same run) and
/// the load generator of the chaos tests.
#[derive(Debug, Parser)]
#[command(name = "hkvm-bench", version, about)]
struct Cli {
    /// Log format on stderr.
    #[arg(long, global = true, value_enum, default_value_t = hkvm_telemetry::logging::LogFormat::Text, env = "HKVM_LOG_FORMAT")]
    log_format: hkvm_telemetry::logging::LogFormat,
    #[command(subcommand)]
    command: Command,
}

/// The workloads, `all`, and the load generator.
#[derive(Debug, Subcommand)]
enum Command {
    /// Event encode/decode, append and replay, against rmp-serde and raw JetStream.
    Events(BenchArgs),
    /// TCP transport GB/s against plain TCP and memcpy; FEC GB/s; WAN goodput vs cap.
    Transfer(BenchArgs),
    /// Projector fold rate against raw JetStream replay; bytes per key; restart to
    /// serving with and without a checkpoint.
    Ingest(BenchArgs),
    /// Global batch_is_exist from 1 and 4 clients against in-process lookups.
    Exist(BenchArgs),
    /// Where one client's 4 KiB get and put spend their microseconds, layer by
    /// layer against the one below (plain TCP, raw JetStream).
    Breakdown(BenchArgs),
    /// Durable put_start + put_end through a sub-master (1, 64 clients, batches)
    /// against raw JetStream publish.
    Put(BenchArgs),
    /// Sub-master time to first served request (snapshot + tail, full replay)
    /// against raw JetStream replay; failover to a hot standby against a cold restart.
    Recover(BenchArgs),
    /// Running for a long time: churn with snapshots, purges and a leader kill
    /// (stream bytes, restore time and put p99 at the end against the start), and
    /// put p99 while a large snapshot is written against without.
    Soak(BenchArgs),
    /// Simulated clients against N = 1, 2, 4, 8 sub-clusters: ops/s, latency,
    /// master CPU per 1000 requests and memory, against N = 1.
    Scale(ScaleBenchArgs),
    /// Sub-master bytes per object against the design target.
    Memory(BenchArgs),
    /// The inter-DC replicator over an emulated WAN (25 ms, 1% loss): goodput
    /// against the bandwidth cap, wire bytes against the FEC shape's overhead.
    Interdc(BenchArgs),
    /// The hkvm Python package's operations timed from Python against the same
    /// operations through the Rust client.
    Python(BenchArgs),
    /// 16 dummy clients behind one real client against 16 independent clients:
    /// sub-master requests per operation, 1 MiB put_from/get_into, added latency.
    Dummies(BenchArgs),
    /// One Python workload against Mooncake Store's master (its PyPI wheel,
    /// installed into .tools/mooncake-venv when missing) and against HKVM, in
    /// alternating rounds and with 4 clients at once: HKVM against Mooncake per
    /// operation, and the servers' CPU time. Without the wheel it reports nothing
    /// and says why.
    Mooncake(BenchArgs),
    /// Every workload.
    All(ScaleBenchArgs),
    /// Drive puts, gets or global queries for a while and print one JSON line per
    /// result (for integration and chaos tests).
    Loadgen(Box<loadgen::LoadgenArgs>),
    /// The soak workload's standby process (started by `soak`, not by hand).
    #[command(hide = true)]
    SoakStandby {
        /// The workload's NATS server.
        #[arg(long)]
        nats: String,
        /// The bench cluster whose stream it folds.
        #[arg(long)]
        cluster: String,
    },
}

/// Options every workload takes.
#[derive(Debug, Clone, clap::Args)]
struct BenchArgs {
    /// One JSON object per result line instead of a table.
    #[arg(long)]
    json: bool,
    /// Small sizes, for CI and smoke runs.
    #[arg(long)]
    quick: bool,
    /// Use this NATS server instead of starting one (JetStream must be enabled).
    #[arg(long)]
    nats: Option<String>,
}

/// Options of `scale` and `all`: the common ones and the scale sweep's.
#[derive(Debug, Clone, clap::Args)]
struct ScaleBenchArgs {
    #[command(flatten)]
    bench: BenchArgs,
    #[command(flatten)]
    scale: scale::ScaleArgs,
}

/// One workload to run, with what only it needs.
#[derive(Debug)]
enum Workload {
    Events,
    Transfer,
    Ingest,
    Exist,
    Put,
    Breakdown,
    Recover,
    Soak,
    Scale(scale::Setup),
    Memory,
    Interdc,
    Python,
    Dummies,
    Mooncake,
}

/// Counts allocations so that benchmarks can report allocations per event.
#[global_allocator]
static ALLOCATOR: alloc::CountingAllocator = alloc::CountingAllocator;

/// How long a finished command waits for leftover blocking work (a name lookup
/// stuck on a slow resolver, say) before the process exits anyway.
const EXIT_GRACE: Duration = Duration::from_secs(2);

fn main() {
    let cli = Cli::parse();
    hkvm_telemetry::logging::init(cli.log_format);
    let result = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(anyhow::Error::from)
        .and_then(|runtime| {
            let result = runtime.block_on(run(cli.command));
            // Dropping a runtime waits for every blocking task without limit: a
            // command whose work is done must not hang on one.
            runtime.shutdown_timeout(EXIT_GRACE);
            result
        });
    let code = match result {
        Ok(()) => 0,
        Err(error) => {
            eprintln!("Error: {error:?}");
            1
        }
    };
    // The results are printed: end now. A normal exit runs the C library's exit
    // handlers, which can wait on threads still stuck in the runtime (seen: a load
    // generator that printed its summary and whose container never exited).
    use std::io::Write as _;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: `_exit` ends the process at once; every output was flushed above and
    // nothing else needs to run.
    unsafe { libc::_exit(code) }
}

async fn run(command: Command) -> anyhow::Result<()> {
    let (args, workloads) = match command {
        Command::Loadgen(args) => return loadgen::run(*args).await,
        Command::SoakStandby { nats, cluster } => {
            return soak::standby_snapshot(&nats, &cluster).await
        }
        Command::Events(args) => (args, vec![Workload::Events]),
        Command::Transfer(args) => (args, vec![Workload::Transfer]),
        Command::Ingest(args) => (args, vec![Workload::Ingest]),
        Command::Exist(args) => (args, vec![Workload::Exist]),
        Command::Put(args) => (args, vec![Workload::Put]),
        Command::Breakdown(args) => (args, vec![Workload::Breakdown]),
        Command::Recover(args) => (args, vec![Workload::Recover]),
        Command::Soak(args) => (args, vec![Workload::Soak]),
        Command::Scale(args) => (
            args.bench,
            vec![Workload::Scale(scale::Setup::new(args.scale)?)],
        ),
        Command::Memory(args) => (args, vec![Workload::Memory]),
        Command::Interdc(args) => (args, vec![Workload::Interdc]),
        Command::Python(args) => (args, vec![Workload::Python]),
        Command::Dummies(args) => (args, vec![Workload::Dummies]),
        Command::Mooncake(args) => (args, vec![Workload::Mooncake]),
        // Memory first: its RSS figure needs a process that has not freed much yet.
        Command::All(args) => (
            args.bench,
            vec![
                Workload::Memory,
                Workload::Events,
                Workload::Put,
                Workload::Breakdown,
                Workload::Transfer,
                Workload::Interdc,
                Workload::Ingest,
                Workload::Exist,
                Workload::Recover,
                Workload::Soak,
                Workload::Python,
                Workload::Dummies,
                Workload::Mooncake,
                Workload::Scale(scale::Setup::new(args.scale)?),
            ],
        ),
    };
    bench(args, workloads).await
}

/// The NATS server a benchmark runs against: given, or a child we own.
pub struct BenchNats {
    url: String,
    _child: Option<NatsServer>,
}

impl BenchNats {
    async fn new(url: Option<String>) -> anyhow::Result<Self> {
        match url {
            Some(url) => Ok(Self { url, _child: None }),
            None => Self::start_with(ServerOptions::default()).await,
        }
    }

    /// A benchmark's own nats-server child, started with `options`.
    async fn start_with(options: ServerOptions) -> anyhow::Result<Self> {
        let server = NatsServer::start_with(options)
            .await
            .context("starting a nats-server for the benchmark")?;
        Ok(Self {
            url: server.url(),
            _child: Some(server),
        })
    }

    /// The nats-server child's process id (none when the server was given).
    fn pid(&self) -> Option<u32> {
        self._child.as_ref().and_then(NatsServer::pid)
    }

    /// Connects a client with a generous ack timeout (benchmarks push hard).
    async fn connect(&self) -> anyhow::Result<async_nats::Client> {
        async_nats::ConnectOptions::new()
            .request_timeout(Some(Duration::from_secs(30)))
            .connect(self.url.as_str())
            .await
            .with_context(|| format!("connecting to {}", self.url))
    }
}

/// Runs `workloads` in order and prints their results.
///
/// # Errors
/// When the environment cannot be set up or a step fails.
async fn bench(args: BenchArgs, workloads: Vec<Workload>) -> anyhow::Result<()> {
    let nats = BenchNats::new(args.nats.clone()).await?;
    let mut printer = report::Printer::new(args.json);
    let quick = args.quick;
    for workload in workloads {
        match workload {
            Workload::Events => events::run(&nats, quick, &mut printer).await?,
            Workload::Transfer => transfer::run(quick, &mut printer).await?,
            Workload::Ingest => ingest::run(&nats, quick, &mut printer).await?,
            Workload::Exist => exist::run(&nats, quick, &mut printer).await?,
            Workload::Put => put::run(&nats, quick, &mut printer).await?,
            Workload::Breakdown => breakdown::run(&nats, quick, &mut printer).await?,
            Workload::Recover => recover::run(&nats, quick, &mut printer).await?,
            Workload::Soak => soak::run(&nats, quick, &mut printer).await?,
            Workload::Scale(setup) => scale::run(&nats, quick, &setup, &mut printer).await?,
            Workload::Memory => memory::run(quick, &mut printer)?,
            Workload::Interdc => interdc::run(&nats, quick, &mut printer).await?,
            Workload::Python => python::run(&nats, quick, &mut printer).await?,
            Workload::Dummies => dummies::run(&nats, quick, &mut printer).await?,
            Workload::Mooncake => mooncake::run(&nats, quick, &mut printer).await?,
        }
    }
    printer.finish();
    Ok(())
}
