//! `mooncake`: HKVM side by side with Mooncake Store's master on this machine. One
//! Python workload (`workload.py`: put and get of 4 KiB and 1 MiB, is_exist,
//! batch_is_exist of 1000 keys, put_from / get_into of 1 MiB, batch_put_from /
//! batch_get_into of 32 pages of 64 KiB) runs against `mooncake.store` on a
//! `mooncake_master` and against `hkvm.store` on a sub-master and a global master
//! (`hkvm` processes) with a nats-server of their own, in alternating rounds
//! (Mooncake, HKVM, Mooncake, HKVM), then with 4 clients at once on each. Every
//! row is HKVM's figure against Mooncake's of the same run; the servers' CPU time
//! is read from `/proc` around the measured calls.
//!
//! Mooncake comes from its PyPI wheel (`mooncake-transfer-engine-non-cuda`,
//! pinned), which carries both the Python client and `mooncake_master`; the
//! workload installs it into `.tools/mooncake-venv` when it is missing
//! (`$HKVM_MOONCAKE_PYTHON` names an interpreter that has it instead). When it
//! cannot be had, the workload says why on stderr and reports nothing, without
//! failing. HKVM's client is the `hkvm` package of `$HKVM_PYTHON`, else
//! `.tools/venv` (made by `scripts/python`).

mod clients;
mod servers;

use std::path::Path;

use anyhow::Context as _;

use clients::{OpSummary, Run, Spec};
use servers::{HkvmServers, Mooncake, MooncakeMaster, ServerCpu};

use crate::python::interpreter;
use crate::report::{BenchResult, Printer};
use crate::scale::hkvm_binary;
use crate::BenchNats;

const WORKLOAD: &str = "mooncake";
/// What every row is compared with.
const BASELINE: &str = "Mooncake master, same calls";
/// The baseline of the CPU rows.
const CPU_BASELINE: &str = "Mooncake master, same clients";
/// Clients of the phase where several run at once.
const SHARED_CLIENTS: usize = 4;

/// One operation of the workload script.
struct Operation {
    /// Its name in the script's results.
    name: &'static str,
    /// How the rows name it.
    label: &'static str,
    /// The unit of its rate.
    unit: &'static str,
    /// For reads: what a result counts, and what makes it right.
    reads: Option<(&'static str, &'static str)>,
}

const fn operation(
    name: &'static str,
    label: &'static str,
    unit: &'static str,
    reads: Option<(&'static str, &'static str)>,
) -> Operation {
    Operation {
        name,
        label,
        unit,
        reads,
    }
}

/// A read's right result: its value, byte for byte.
const BYTES: &str = "found with the bytes written";

/// The script's operations, in the order it runs them.
const OPERATIONS: [Operation; 10] = [
    operation("put_4k", "put 4 KiB", "ops/s", None),
    operation("get_4k", "get 4 KiB", "ops/s", Some(("reads", BYTES))),
    operation(
        "is_exist",
        "is_exist",
        "ops/s",
        Some(("keys", "answered 1")),
    ),
    operation(
        "batch_is_exist_1000",
        "batch_is_exist 1000 keys",
        "keys/s",
        Some(("keys", "answered right (1 present, 0 absent)")),
    ),
    operation("put_1m", "put 1 MiB", "ops/s", None),
    operation("get_1m", "get 1 MiB", "ops/s", Some(("reads", BYTES))),
    operation("put_from_1m", "put_from 1 MiB", "ops/s", None),
    operation(
        "get_into_1m",
        "get_into 1 MiB",
        "ops/s",
        Some(("reads", BYTES)),
    ),
    operation(
        "batch_put_from_32x64k",
        "batch_put_from 32 pages of 64 KiB",
        "pages/s",
        None,
    ),
    operation(
        "batch_get_into_32x64k",
        "batch_get_into 32 pages of 64 KiB",
        "pages/s",
        Some(("pages", BYTES)),
    ),
];

/// What one side measured: its one-client rounds and its run of several clients.
#[derive(Debug, Default)]
struct Side {
    rounds: Vec<Run>,
    shared: Option<Run>,
}

/// Every client's summary of `op` in `run`.
fn summaries<'a>(run: &'a Run, op: &Operation) -> impl Iterator<Item = &'a OpSummary> {
    run.clients.iter().filter_map(|client| client.get(op.name))
}

/// Checks that every client of `run` reported every operation.
fn complete(run: &Run) -> anyhow::Result<()> {
    for op in &OPERATIONS {
        anyhow::ensure!(
            summaries(run, op).count() == run.clients.len(),
            "a client did not report {}",
            op.name
        );
    }
    Ok(())
}

impl Side {
    /// The one-client rate of `op`: its items over its time in every round.
    fn rate(&self, op: &Operation) -> f64 {
        let all = self.rounds.iter().flat_map(|run| summaries(run, op));
        let (items, seconds) = all.fold((0.0, 0.0), |(items, seconds), s| {
            (items + s.items as f64, seconds + s.seconds)
        });
        items / seconds.max(1e-9)
    }

    /// The one-client latency of `op` (`pick` chooses p50 or p99), the mean over
    /// the rounds.
    fn latency(&self, op: &Operation, pick: fn(&OpSummary) -> f64) -> f64 {
        mean(
            self.rounds
                .iter()
                .flat_map(|run| summaries(run, op))
                .map(pick),
        )
    }

    /// Right items and items of `op` over every round.
    fn right(&self, op: &Operation) -> (u64, u64) {
        let all = self.rounds.iter().flat_map(|run| summaries(run, op));
        all.fold((0, 0), |(ok, items), s| (ok + s.ok, items + s.items))
    }

    /// The client processes' CPU time per round, the mean over the rounds.
    fn round_client_cpu(&self) -> f64 {
        mean(self.rounds.iter().map(|run| run.client_cpu))
    }

    /// The servers' CPU time per round, the mean over the rounds.
    fn round_cpu(&self) -> ServerCpu {
        ServerCpu {
            masters: mean(self.rounds.iter().map(|run| run.cpu.masters)),
            nats: mean(self.rounds.iter().map(|run| run.cpu.nats)),
        }
    }
}

/// The mean of `values` (0 for none).
fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let (sum, count) = values.fold((0.0, 0usize), |(sum, count), v| (sum + v, count + 1));
    if count == 0 {
        0.0
    } else {
        sum / count as f64
    }
}

/// The rate of `op` with several clients at once: the sum of their rates.
fn shared_rate(run: &Run, op: &Operation) -> f64 {
    summaries(run, op)
        .map(|s| s.items as f64 / s.seconds.max(1e-9))
        .sum()
}

/// Says on stderr that the Mooncake side (and so the workload) was skipped.
fn skipped(error: &anyhow::Error) {
    eprintln!(
        "bench mooncake: the Mooncake side was skipped ({error:#}); no mooncake rows \
         (HKVM's Python client alone is measured by `hkvm bench python`)"
    );
}

/// One Mooncake run: a fresh master, `count` clients, the master stopped.
async fn mooncake_run(
    mooncake: &Mooncake,
    script: &Path,
    dir: &Path,
    scale: f64,
    count: usize,
) -> anyhow::Result<Run> {
    let master = MooncakeMaster::start(mooncake).await?;
    let spec = Spec {
        python: &mooncake.python,
        script,
        store: "mooncake",
        master: master.address(),
        metadata: Some(master.metadata()),
        scale,
    };
    let run = clients::run(&spec, count, dir, || master.cpu()).await;
    master.stop().await;
    let run = run?;
    complete(&run)?;
    Ok(run)
}

/// What an HKVM run needs besides its sizes.
struct Hkvm<'a> {
    /// The `hkvm` binary that runs the masters.
    binary: &'a Path,
    /// The interpreter with the `hkvm` package.
    python: &'a Path,
    /// The NATS server the user gave, if any.
    given: Option<&'a str>,
}

/// One HKVM run: fresh masters (and nats-server), `count` clients, all stopped.
async fn hkvm_run(
    hkvm: &Hkvm<'_>,
    cluster: &str,
    script: &Path,
    dir: &Path,
    scale: f64,
    count: usize,
) -> anyhow::Result<Run> {
    let servers = HkvmServers::start(hkvm.binary, hkvm.given, cluster).await?;
    let spec = Spec {
        python: hkvm.python,
        script,
        store: "hkvm",
        master: servers.address(),
        metadata: None,
        scale,
    };
    let run = clients::run(&spec, count, dir, || servers.cpu()).await;
    servers.stop().await;
    let run = run.context("the HKVM clients")?;
    complete(&run)?;
    Ok(run)
}

/// Runs the workload.
///
/// # Errors
/// When HKVM's side fails (Mooncake's side being unavailable is reported on
/// stderr and is not an error).
pub async fn run(nats: &BenchNats, quick: bool, printer: &mut Printer) -> anyhow::Result<()> {
    let Some(hkvm_python) = interpreter() else {
        eprintln!(
            "bench mooncake: no interpreter with the hkvm package (run scripts/python, or set \
             HKVM_PYTHON); no mooncake rows"
        );
        return Ok(());
    };
    let binary = hkvm_binary()?;
    let mooncake = match Mooncake::install().await {
        Ok(mooncake) => mooncake,
        Err(error) => {
            skipped(&error);
            return Ok(());
        }
    };
    let hkvm = Hkvm {
        binary: &binary,
        python: &hkvm_python,
        given: nats.pid().is_none().then_some(nats.url.as_str()),
    };
    if hkvm.given.is_some() {
        eprintln!(
            "bench mooncake: HKVM runs on the given NATS server, whose CPU time is not \
             counted: no server CPU row with nats-server"
        );
    }
    let dir = tempfile::tempdir().context("a temp dir for the workload")?;
    let script = dir.path().join("workload.py");
    std::fs::write(&script, clients::SCRIPT).context("writing the workload script")?;
    let (rounds, scale) = if quick { (1, 0.1) } else { (2, 1.0) };
    eprintln!(
        "bench mooncake: Mooncake {} ({}) against HKVM: {rounds} round(s) of 1 client each, \
         then {SHARED_CLIENTS} clients at once",
        mooncake.version,
        mooncake.python.display()
    );
    let (mut theirs, mut ours) = (Side::default(), Side::default());
    for round in 1..=rounds {
        eprintln!("bench mooncake: round {round}: Mooncake, 1 client");
        match mooncake_run(&mooncake, &script, dir.path(), scale, 1).await {
            Ok(run) => theirs.rounds.push(run),
            Err(error) => {
                skipped(&error);
                return Ok(());
            }
        }
        eprintln!("bench mooncake: round {round}: HKVM, 1 client");
        let cluster = format!("bmooncake{round}");
        let run = hkvm_run(&hkvm, &cluster, &script, dir.path(), scale, 1).await?;
        ours.rounds.push(run);
    }
    // Several clients share the pool (one segment each): each writes its share.
    let shared_scale = scale / SHARED_CLIENTS as f64;
    eprintln!("bench mooncake: Mooncake, {SHARED_CLIENTS} clients at once");
    match mooncake_run(&mooncake, &script, dir.path(), shared_scale, SHARED_CLIENTS).await {
        Ok(run) => theirs.shared = Some(run),
        Err(error) => {
            skipped(&error);
            return Ok(());
        }
    }
    eprintln!("bench mooncake: HKVM, {SHARED_CLIENTS} clients at once");
    let run = hkvm_run(
        &hkvm,
        "bmooncakeshared",
        &script,
        dir.path(),
        shared_scale,
        SHARED_CLIENTS,
    )
    .await?;
    ours.shared = Some(run);
    let nats_counted = hkvm.given.is_none();
    print_rounds(printer, &ours, &theirs, nats_counted);
    if let (Some(ours), Some(theirs)) = (&ours.shared, &theirs.shared) {
        print_shared(printer, ours, theirs, nats_counted);
    }
    Ok(())
}

/// One row: HKVM's figure against Mooncake's.
fn row(
    printer: &mut Printer,
    metric: String,
    ours: f64,
    unit: &'static str,
    baseline: &str,
    theirs: f64,
) {
    printer.print(&BenchResult::new(
        WORKLOAD, metric, ours, unit, baseline, theirs,
    ));
}

/// The servers' CPU rows of one phase (the row with nats-server only when its
/// CPU time was counted: a server the bench started).
fn print_cpu(
    printer: &mut Printer,
    phase: &str,
    ours: ServerCpu,
    theirs: ServerCpu,
    nats_counted: bool,
) {
    if nats_counted {
        row(
            printer,
            format!("server CPU, {phase}: HKVM sub-master + global master + nats-server"),
            ours.total(),
            "cpu-s",
            CPU_BASELINE,
            theirs.total(),
        );
    }
    row(
        printer,
        format!("server CPU, {phase}: HKVM sub-master + global master alone"),
        ours.masters,
        "cpu-s",
        CPU_BASELINE,
        theirs.total(),
    );
}

/// The client processes' CPU row of one phase: HKVM's Python clients (their
/// waits spin) against Mooncake's.
fn print_client_cpu(printer: &mut Printer, phase: &str, ours: f64, theirs: f64) {
    row(
        printer,
        format!(
            "client CPU, {phase}: the Python client processes (HKVM's waits spin, HKVM_SPIN_US)"
        ),
        ours,
        "cpu-s",
        "Mooncake's client processes, same calls",
        theirs,
    );
}

/// The one-client rows: per operation its rate, p50, p99 and, for reads, the
/// right results; then the servers' CPU time per round.
fn print_rounds(printer: &mut Printer, ours: &Side, theirs: &Side, nats_counted: bool) {
    for op in &OPERATIONS {
        row(
            printer,
            format!("{}, 1 client", op.label),
            ours.rate(op),
            op.unit,
            BASELINE,
            theirs.rate(op),
        );
        for (name, pick) in [
            ("p50", (|s| s.p50_us) as fn(&OpSummary) -> f64),
            ("p99", |s| s.p99_us),
        ] {
            row(
                printer,
                format!("{} {name}, 1 client", op.label),
                ours.latency(op, pick),
                "us",
                BASELINE,
                theirs.latency(op, pick),
            );
        }
        if let Some((unit, what)) = op.reads {
            let (right, items) = ours.right(op);
            let (their_right, _) = theirs.right(op);
            row(
                printer,
                format!("{}: {unit} {what}, of {items}, 1 client", op.label),
                right as f64,
                unit,
                BASELINE,
                their_right as f64,
            );
        }
    }
    print_cpu(
        printer,
        "1 client (per round)",
        ours.round_cpu(),
        theirs.round_cpu(),
        nats_counted,
    );
    print_client_cpu(
        printer,
        "1 client (per round)",
        ours.round_client_cpu(),
        theirs.round_client_cpu(),
    );
}

/// The rows of several clients at once: per operation the sum of their rates and
/// the mean of their p99, the right results of every read, the wall time, the
/// servers' CPU time.
fn print_shared(printer: &mut Printer, ours: &Run, theirs: &Run, nats_counted: bool) {
    let phase = format!("{SHARED_CLIENTS} clients at once");
    for op in &OPERATIONS {
        row(
            printer,
            format!("{}, {phase} (sum of their rates)", op.label),
            shared_rate(ours, op),
            op.unit,
            BASELINE,
            shared_rate(theirs, op),
        );
        row(
            printer,
            format!("{} p99, {phase} (mean of theirs)", op.label),
            mean(summaries(ours, op).map(|s| s.p99_us)),
            "us",
            BASELINE,
            mean(summaries(theirs, op).map(|s| s.p99_us)),
        );
    }
    let reads = |run: &Run| {
        let mut totals = (0, 0);
        for op in OPERATIONS.iter().filter(|op| op.reads.is_some()) {
            for s in summaries(run, op) {
                totals = (totals.0 + s.ok, totals.1 + s.items);
            }
        }
        totals
    };
    let ((right, items), (their_right, _)) = (reads(ours), reads(theirs));
    row(
        printer,
        format!("{phase}: reads, keys and pages answered right, of {items}"),
        right as f64,
        "items",
        BASELINE,
        their_right as f64,
    );
    row(
        printer,
        format!("{phase}: wall time from their start to the last result"),
        ours.seconds,
        "s",
        BASELINE,
        theirs.seconds,
    );
    print_cpu(printer, &phase, ours.cpu, theirs.cpu, nats_counted);
    print_client_cpu(printer, &phase, ours.client_cpu, theirs.client_cpu);
}
