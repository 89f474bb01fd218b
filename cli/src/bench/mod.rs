//! `hkvm bench <workload>`: benchmarks that report every figure as a ratio against a
//! baseline measured in the same run (this machine is noisy), as a table or as one
//! JSON object per result line (`--json`). Workloads start what they need (a
//! nats-server child from the test kit) unless given `--nats`.

mod alloc;
mod cluster;
mod events;
mod exist;
mod ingest;
mod interdc;
mod memory;
mod put;
mod raw;
mod recover;
mod report;
mod scale;
mod transfer;

use std::time::Duration;

use anyhow::Context as _;
use hkvm_testkit::NatsServer;

pub use alloc::CountingAllocator;

/// Options of `hkvm bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// What to measure.
    #[arg(value_enum)]
    workload: Workload,
    /// One JSON object per result line instead of a table.
    #[arg(long)]
    json: bool,
    /// Small sizes, for CI and smoke runs.
    #[arg(long)]
    quick: bool,
    /// Use this NATS server instead of starting one (JetStream must be enabled).
    #[arg(long)]
    nats: Option<String>,
    #[command(flatten)]
    scale: scale::ScaleArgs,
}

/// The workloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Workload {
    /// Event encode/decode, append and replay, against rmp-serde and raw JetStream.
    Events,
    /// TCP transport GB/s against plain TCP and memcpy; FEC GB/s; WAN goodput vs cap.
    Transfer,
    /// Projector fold rate against raw JetStream replay; bytes per key; restart to
    /// serving with and without a checkpoint.
    Ingest,
    /// Global batch_is_exist over NATS (1 and 4 clients) against in-process lookups.
    Exist,
    /// Durable put_start + put_end through a sub-master (1, 64 clients, batches)
    /// against raw JetStream publish.
    Put,
    /// Sub-master time to first served request (snapshot + tail, full replay)
    /// against raw JetStream replay; failover to a hot standby against a cold restart.
    Recover,
    /// Simulated clients against N = 1, 2, 4, 8 sub-clusters: ops/s, latency,
    /// master CPU per 1000 requests and memory, against N = 1.
    Scale,
    /// Sub-master bytes per object against the design target.
    Memory,
    /// The inter-DC replicator over an emulated WAN (25 ms, 1% loss): goodput
    /// against the bandwidth cap, wire bytes against the FEC shape's overhead.
    Interdc,
    /// Every workload.
    All,
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
            None => {
                let server = NatsServer::start()
                    .await
                    .context("starting a nats-server for the benchmark")?;
                Ok(Self {
                    url: server.url(),
                    _child: Some(server),
                })
            }
        }
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

/// Runs the benchmark and prints its results.
///
/// # Errors
/// When the environment cannot be set up or a step fails.
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let nats = BenchNats::new(args.nats.clone()).await?;
    let mut printer = report::Printer::new(args.json);
    let workloads = match args.workload {
        // Memory first: its RSS figure needs a process that has not freed much yet.
        Workload::All => vec![
            Workload::Memory,
            Workload::Events,
            Workload::Put,
            Workload::Transfer,
            Workload::Interdc,
            Workload::Ingest,
            Workload::Exist,
            Workload::Recover,
            Workload::Scale,
        ],
        one => vec![one],
    };
    for workload in workloads {
        match workload {
            Workload::Events => events::run(&nats, args.quick, &mut printer).await?,
            Workload::Transfer => transfer::run(args.quick, &mut printer).await?,
            Workload::Ingest => ingest::run(&nats, args.quick, &mut printer).await?,
            Workload::Exist => exist::run(&nats, args.quick, &mut printer).await?,
            Workload::Put => put::run(&nats, args.quick, &mut printer).await?,
            Workload::Recover => recover::run(&nats, args.quick, &mut printer).await?,
            Workload::Scale => scale::run(&nats, args.quick, &args.scale, &mut printer).await?,
            Workload::Memory => memory::run(args.quick, &mut printer)?,
            Workload::Interdc => interdc::run(&nats, args.quick, &mut printer).await?,
            Workload::All => {}
        }
    }
    printer.finish();
    Ok(())
}
