//! The workload's client processes: `workload.py` (embedded in this binary and
//! written to a temp dir) under one side's interpreter, led step by step over
//! their stdin and stdout so that several clients run each operation at the same
//! time and the servers' CPU time is read around exactly the measured calls.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context as _;
use serde::Deserialize;
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::time::Instant;

use super::servers::{tail, ServerCpu};
use crate::scale::cpu_seconds;

/// The Python workload both sides run.
pub const SCRIPT: &str = include_str!("workload.py");

/// How long a client may take to reach its next step (its setup, or one
/// operation's calls).
const STEP_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a client may take to remove its keys and close once let go.
const EXIT_TIMEOUT: Duration = Duration::from_secs(120);

/// What one operation's calls measured in one client.
#[derive(Debug, Clone, Copy, Deserialize)]
pub struct OpSummary {
    /// Items moved or asked for (keys, pages; one per call for single calls).
    pub items: u64,
    /// Seconds spent inside the calls.
    pub seconds: f64,
    /// Median call latency.
    pub p50_us: f64,
    /// 99th percentile call latency.
    pub p99_us: f64,
    /// Items whose result was right (acknowledged puts, reads with the right bytes).
    pub ok: u64,
}

/// One client's summaries by operation name.
pub type Results = BTreeMap<String, OpSummary>;

/// A line a client writes.
#[derive(Debug, Deserialize)]
#[serde(tag = "event", rename_all = "lowercase")]
enum Event {
    /// The client reached a step and waits to be let go on.
    Wait { at: String },
    /// The client's summaries.
    Results { results: Results },
}

/// How to start one side's clients.
#[derive(Debug)]
pub struct Spec<'a> {
    /// The interpreter that has the side's store module.
    pub python: &'a Path,
    /// The workload script on disk.
    pub script: &'a Path,
    /// `mooncake` or `hkvm`: which module the script imports.
    pub store: &'static str,
    /// The `master_server_addr` of `setup`.
    pub master: String,
    /// The `metadata_server` of `setup` (the script's default when none).
    pub metadata: Option<String>,
    /// Objects per phase, as a share of the full sizes.
    pub scale: f64,
}

/// One running client.
struct Client {
    child: Child,
    stdin: ChildStdin,
    events: Lines<BufReader<ChildStdout>>,
    log: PathBuf,
}

impl Client {
    fn spawn(spec: &Spec<'_>, index: usize, shared: bool, dir: &Path) -> anyhow::Result<Self> {
        let log = dir.join(format!("{}-client-{index}.log", spec.store));
        let mut command = Command::new(spec.python);
        command
            .arg(spec.script)
            .arg(spec.store)
            .arg("--master")
            .arg(&spec.master)
            .arg("--prefix")
            .arg(format!("c{index}/"))
            .arg("--scale")
            .arg(spec.scale.to_string())
            .env("MC_TCP_BIND_ADDRESS", "127.0.0.1")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log)?)
            .kill_on_drop(true);
        if let Some(metadata) = &spec.metadata {
            command.arg("--metadata").arg(metadata);
        }
        if shared {
            command.arg("--shared");
        }
        let mut child = command
            .spawn()
            .with_context(|| format!("starting {}", spec.python.display()))?;
        let stdin = child.stdin.take().context("no stdin")?;
        let stdout = child.stdout.take().context("no stdout")?;
        Ok(Self {
            child,
            stdin,
            events: BufReader::new(stdout).lines(),
            log,
        })
    }

    /// The client's next event.
    async fn next(&mut self) -> anyhow::Result<Event> {
        let line = tokio::time::timeout(STEP_TIMEOUT, self.events.next_line())
            .await
            .with_context(|| {
                format!(
                    "a {} client gave no sign for {STEP_TIMEOUT:?}: {}",
                    self.log.display(),
                    tail(&self.log)
                )
            })??;
        let Some(line) = line else {
            let status = self.child.wait().await?;
            anyhow::bail!(
                "a workload client exited ({status}) in the middle; its log {}:\n{}",
                self.log.display(),
                tail(&self.log)
            );
        };
        serde_json::from_str(&line).with_context(|| format!("a client wrote {line:?}"))
    }

    /// Lets the client go on past the step it waits at.
    async fn go(&mut self) -> anyhow::Result<()> {
        self.stdin.write_all(b"\n").await?;
        self.stdin.flush().await?;
        Ok(())
    }

    /// Waits for the client's end.
    async fn finish(mut self) -> anyhow::Result<()> {
        drop(self.stdin);
        let status = tokio::time::timeout(EXIT_TIMEOUT, self.child.wait())
            .await
            .with_context(|| format!("a client did not exit: {}", tail(&self.log)))??;
        anyhow::ensure!(
            status.success(),
            "a workload client failed ({status}): {}",
            tail(&self.log)
        );
        Ok(())
    }
}

/// What one run of clients measured.
#[derive(Debug)]
pub struct Run {
    /// Each client's summaries.
    pub clients: Vec<Results>,
    /// The servers' CPU time from the clients' start to their last result.
    pub cpu: ServerCpu,
    /// The client processes' CPU seconds over the same time, together.
    pub client_cpu: f64,
    /// Wall time from the clients' start to their last result.
    pub seconds: f64,
}

/// Runs `count` clients at once (`count > 1`: sharing the pool, each with its own
/// key prefix) and leads them through every step together. `cpu` reads the
/// servers' CPU time.
///
/// # Errors
/// When a client cannot be started, fails, or says something unexpected.
pub async fn run(
    spec: &Spec<'_>,
    count: usize,
    dir: &Path,
    cpu: impl Fn() -> ServerCpu,
) -> anyhow::Result<Run> {
    let mut clients = (0..count)
        .map(|index| Client::spawn(spec, index, count > 1, dir))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let clients_cpu = |clients: &[Client]| -> f64 {
        clients
            .iter()
            .map(|client| cpu_seconds(client.child.id()))
            .sum()
    };
    let mut results = Vec::new();
    let mut started = (Instant::now(), ServerCpu::default(), 0.0);
    let mut ended = None;
    loop {
        let events = futures::future::try_join_all(clients.iter_mut().map(Client::next)).await?;
        let mut steps = Vec::new();
        for event in events {
            match event {
                Event::Results { results: client } => results.push(client),
                Event::Wait { at } => steps.push(at),
            }
        }
        if steps.is_empty() {
            anyhow::ensure!(results.len() == count, "clients out of step at results");
            ended = Some((
                started.0.elapsed(),
                cpu().since(&started.1),
                clients_cpu(&clients) - started.2,
            ));
            continue;
        }
        let step = steps.swap_remove(0);
        anyhow::ensure!(
            steps.len() + 1 == count && steps.iter().all(|other| *other == step),
            "clients out of step: one at {step}, the others at {steps:?}"
        );
        if step == "start" {
            started = (Instant::now(), cpu(), clients_cpu(&clients));
        }
        for client in &mut clients {
            client.go().await?;
        }
        if step == "close" {
            break;
        }
    }
    let (elapsed, cpu, client_cpu) = ended.context("the clients closed without results")?;
    futures::future::try_join_all(clients.into_iter().map(Client::finish)).await?;
    Ok(Run {
        clients: results,
        cpu,
        client_cpu,
        seconds: elapsed.as_secs_f64(),
    })
}
