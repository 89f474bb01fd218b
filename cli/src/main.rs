//! `hkvm`: the command-line tool and service launcher of HKVM. Each subcommand lives
//! in its own module; this file only parses arguments and dispatches. `bench` and
//! `loadgen` run the `hkvm-bench` binary (see [`forward`]).

mod data;
mod forward;
mod globalmaster;
mod interdc;
mod local;
mod locate;
mod meta;
mod nats_conf;
mod replay;
mod signals;
mod status;
mod submaster;
mod target;

use clap::{Parser, Subcommand};
use hkvm_telemetry::logging::Verbosity;

/// HKVM: hierarchical KV-cache metadata management over NATS JetStream.
#[derive(Debug, Parser)]
#[command(name = "hkvm", version, about)]
struct Cli {
    /// Log format on stderr.
    #[arg(long, global = true, value_enum, default_value_t = hkvm_telemetry::logging::LogFormat::Text, env = "HKVM_LOG_FORMAT")]
    log_format: hkvm_telemetry::logging::LogFormat,
    /// Log more: commands log only warnings and services what they do; each -v
    /// adds a level (up to debug). `RUST_LOG`, when set, decides instead.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a local HKVM cluster: nats-server with JetStream as a child process in a
    /// temp dir, plus every HKVM service. Ctrl-C stops everything.
    Local(local::LocalArgs),
    /// Print the events of one or all sub-cluster streams, for debugging.
    Replay(replay::ReplayArgs),
    /// Run a benchmark; every figure comes with a baseline measured in the same run
    /// (runs `hkvm-bench`; `hkvm bench --help` lists the workloads).
    #[command(disable_help_flag = true)]
    Bench(forward::Forwarded),
    /// Run the sub-master of one sub-cluster (leader, or hot standby if one leads).
    Submaster(submaster::SubmasterArgs),
    /// Whether keys exist in a sub-cluster.
    Exist(meta::ExistArgs),
    /// Remove keys (or all) from a sub-cluster.
    Rm(meta::RmArgs),
    /// A sub-master's summary, or where keys are.
    Stat(meta::StatArgs),
    /// Run a node: contribute a memory segment and serve transfers.
    Node(data::NodeArgs),
    /// Store a file (or stdin) under a key.
    Put(data::PutArgs),
    /// Read a key's value (checksum-verified).
    Get(data::GetArgs),
    /// Run a global-master replica: registry + projection + cluster-wide queries.
    Globalmaster(globalmaster::GlobalMasterArgs),
    /// Copy blocks one pool has and another (in another datacenter) lacks, over a
    /// paced, FEC-protected WAN link; also its gateway and status.
    Interdc(interdc::InterDcArgs),
    /// Which sub-masters hold keys, cluster-wide (asks the global master).
    Locate(locate::LocateArgs),
    /// The registry (sub-masters, labels, liveness, usage) and the global master's lag.
    Status(status::StatusArgs),
    /// The NATS users of a deployment (one per role, node and inter-DC peer) as a
    /// nats.conf fragment, with their passwords in a file only you may read.
    NatsConf(nats_conf::NatsConfArgs),
    /// Drive puts, gets or global queries for a while and print one JSON line per
    /// result (for integration and chaos tests; runs `hkvm-bench loadgen`).
    #[command(disable_help_flag = true)]
    Loadgen(forward::Forwarded),
}

impl Command {
    /// What it logs unless asked for more: a service what it does, a one-shot
    /// command only warnings (its output is the result).
    fn verbosity(&self) -> Verbosity {
        match self {
            Self::Local(_)
            | Self::Submaster(_)
            | Self::Node(_)
            | Self::Globalmaster(_)
            | Self::Interdc(_)
            | Self::Bench(_)
            | Self::Loadgen(_) => Verbosity::Info,
            Self::Replay(_)
            | Self::Exist(_)
            | Self::Rm(_)
            | Self::Stat(_)
            | Self::Put(_)
            | Self::Get(_)
            | Self::Locate(_)
            | Self::Status(_)
            | Self::NatsConf(_) => Verbosity::Quiet,
        }
    }
}

/// mimalloc: a sub-master's restore and fold allocate and free millions of
/// small keys and replica lists, where glibc's malloc spent a quarter of a
/// restore consolidating free chunks.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// How long a finished command waits for leftover blocking work (a name lookup
/// stuck on a slow resolver, say) before the process exits anyway.
const EXIT_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let command = match cli.command {
        // Another binary, with its own logging and runtime: hand over before
        // setting up either.
        Command::Bench(forwarded) => {
            return forward::exec(forward::Tool::Bench, forwarded.args, cli.log_format)
        }
        Command::Loadgen(forwarded) => {
            return forward::exec(forward::Tool::Loadgen, forwarded.args, cli.log_format)
        }
        command => command,
    };
    let verbosity = Verbosity::raised(command.verbosity(), cli.verbose);
    hkvm_telemetry::logging::init_at(cli.log_format, verbosity);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let result = runtime.block_on(run(command));
    // Dropping a runtime waits for every blocking task without limit: a command
    // whose work is done must not hang on one (seen: a load generator that printed
    // its summary and never exited).
    runtime.shutdown_timeout(EXIT_GRACE);
    result
}

/// Runs a server's future as a task on the runtime's workers and waits for it.
///
/// `main` blocks its own thread on the command; a server's request loop left there
/// would cost a wake-up of that thread for every request its RPC front (a task on
/// a worker) hands over. As a task, it runs on the worker that woke it. A panic in
/// it stays a panic.
pub(crate) async fn on_workers<F>(server: F) -> F::Output
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    match tokio::spawn(server).await {
        Ok(output) => output,
        Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
        // Only a runtime shutting down cancels it, and then nobody waits here.
        Err(error) => panic!("the server task was cancelled: {error}"),
    }
}

async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Local(args) => local::run(args).await,
        Command::Replay(args) => replay::run(args).await,
        Command::Submaster(args) => submaster::run(args).await,
        Command::Exist(args) => meta::exist(args).await,
        Command::Rm(args) => meta::rm(args).await,
        Command::Stat(args) => meta::stat(args).await,
        Command::Node(args) => data::node(args).await,
        Command::Put(args) => data::put(args).await,
        Command::Get(args) => data::get(args).await,
        Command::Globalmaster(args) => globalmaster::run(args).await,
        Command::Interdc(args) => interdc::run(args).await,
        Command::Locate(args) => locate::run(args).await,
        Command::Status(args) => status::run(args).await,
        Command::NatsConf(args) => nats_conf::run(args),
        Command::Bench(_) | Command::Loadgen(_) => {
            unreachable!("forwarded to hkvm-bench before the runtime starts")
        }
    }
}
