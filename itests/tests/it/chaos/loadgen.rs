//! Running `hkvm loadgen` in a container on the cluster network (node endpoints are
//! container hostnames, reachable only there) and reading back what it saw: one
//! JSON line per result, written to a file in a directory of this host mounted into
//! the container.
//!
//! Not its stdout: a container engine that falls behind copying a container's
//! output (seen on a fresh engine, on the first containers of a run) holds the
//! process on a full pipe and writes its last lines to the log late, so a run of
//! two seconds was seen to end only after the test's two minutes.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use futures::StreamExt as _;

use hkvm_events::subject::submaster_rpc_subject;
use hkvm_events::{ClusterId, SubclusterId};
use hkvm_itests::images::hkvm_image;
use serde_json::Value;
use testcontainers::core::Mount;
use testcontainers::runners::AsyncRunner as _;
use testcontainers::ImageExt as _;

use super::docker;
use super::topology::{Container, Topology, CLUSTER};

/// What a `put` run reported.
#[derive(Debug, Default)]
pub struct PutRun {
    /// Acknowledged keys with the unix time (ms) of the acknowledgement.
    pub acked: Vec<(String, u64)>,
    /// Keys whose put failed for certain.
    pub failed: Vec<String>,
    /// Keys whose put timed out: committed or not, nobody can say.
    pub uncertain: Vec<String>,
    /// Keys started and revoked on purpose.
    pub revoked: Vec<String>,
    /// The final summary line.
    pub summary: Value,
    /// What it logged (errors, and its NATS connection's losses and reconnections).
    pub log: String,
}

/// A load generator started in the background.
pub struct Running {
    container: Container,
    /// Tasks answering the load generator's requests for key lists.
    servers: Vec<tokio::task::JoinHandle<()>>,
    /// The host directory mounted at [`RESULTS_DIR`]; removed when dropped.
    results: tempfile::TempDir,
}

/// Where a load generator's container sees this host's results directory.
const RESULTS_DIR: &str = "/results";
/// The file of result lines in the results directory.
const RESULTS_FILE: &str = "lines.jsonl";
/// How long a load generator may run before the test gives up on it.
const RUN_LIMIT: Duration = Duration::from_secs(120);
/// How long the engine may take, after the result line, to report the exit (and
/// hand over what the load generator logged).
const EXIT_LIMIT: Duration = Duration::from_secs(30);

static NEXT_LIST: AtomicU32 = AtomicU32::new(0);

/// Answers every request on a fresh subject with `keys`, one a line (the load
/// generator asks for its key lists over NATS rather than through files copied
/// into its container); returns the subject.
async fn serve_keys(
    nats: async_nats::Client,
    keys: &[String],
) -> (String, tokio::task::JoinHandle<()>) {
    // In the cluster's RPC namespace, where clients may send requests even when
    // NATS runs with per-role permissions.
    let subject = submaster_rpc_subject(
        &ClusterId::new(CLUSTER).unwrap(),
        &SubclusterId::new("test-keys").unwrap(),
        &format!(
            "{}-{}",
            std::process::id(),
            NEXT_LIST.fetch_add(1, Ordering::Relaxed)
        ),
    );
    let mut requests = nats.subscribe(subject.clone()).await.unwrap();
    nats.flush().await.unwrap();
    let body = bytes::Bytes::from(keys.join("\n"));
    let server = tokio::spawn(async move {
        while let Some(request) = requests.next().await {
            if let Some(reply) = request.reply {
                let _ = nats.publish(reply, body.clone()).await;
            }
        }
    });
    (subject, server)
}

/// Starts `hkvm loadgen` against `subcluster` with extra `args`; each of
/// `key_lists` (`(flag, keys)`, e.g. `("--keys-subject", keys)`) is served over
/// NATS and its subject passed with the flag.
pub async fn start(
    topology: &Topology,
    subcluster: &str,
    args: &[String],
    key_lists: Vec<(&str, &[String])>,
) -> Running {
    let mut cmd = vec![
        "loadgen".to_owned(),
        "--nats".to_owned(),
        topology.client_url(),
        "--cluster".to_owned(),
        CLUSTER.to_owned(),
        "--subcluster".to_owned(),
        subcluster.to_owned(),
        "--output".to_owned(),
        format!("{RESULTS_DIR}/{RESULTS_FILE}"),
    ];
    cmd.extend(args.iter().cloned());
    let mut servers = Vec::new();
    for (flag, keys) in key_lists {
        let (subject, server) = serve_keys(topology.connect(0).await, keys).await;
        cmd.extend([flag.to_owned(), subject]);
        servers.push(server);
    }
    let results = tempfile::tempdir().expect("a results directory");
    let host_dir = results
        .path()
        .to_str()
        .expect("a UTF-8 temp path")
        .to_owned();
    let container = hkvm_image()
        .with_network(&topology.network)
        .with_mount(Mount::bind_mount(host_dir, RESULTS_DIR))
        .with_env_var("RUST_LOG", "error,hkvm_log::connection=info")
        .with_startup_timeout(Duration::from_secs(60))
        .with_cmd(cmd)
        .start()
        .await
        .unwrap();
    Running {
        container,
        servers,
        results,
    }
}

/// The `type` of the line each `hkvm loadgen` mode prints last, just before it
/// returns success.
const RESULT_TYPES: [&str; 3] = ["summary", "verify", "query"];

/// The last 20 lines of `text`.
fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// Whether a load generator's output holds its result line.
fn printed_its_result(stdout: &str) -> bool {
    stdout.lines().any(|line| {
        serde_json::from_str::<Value>(line)
            .is_ok_and(|line| RESULT_TYPES.contains(&line["type"].as_str().unwrap_or_default()))
    })
}

/// How a load generator's run ended, as seen from here.
enum Ended {
    /// Its result line is in the results file (the last thing it writes before it
    /// exits with success).
    Result(String),
    /// The engine reports its exit without a result line: it failed.
    Exited(i64, String),
}

impl Running {
    /// Waits (two minutes at most) for the load generator's result and returns its
    /// JSON lines.
    pub async fn finish(self) -> Vec<Value> {
        self.finish_with_log().await.0
    }

    /// The results file's text so far.
    fn results_so_far(&self) -> String {
        std::fs::read_to_string(self.results.path().join(RESULTS_FILE)).unwrap_or_default()
    }

    /// Polls the results file, and the engine for an exit, until one of them says
    /// the run is over.
    async fn ended(&self) -> Ended {
        loop {
            let text = self.results_so_far();
            if printed_its_result(&text) {
                return Ended::Result(text);
            }
            let state =
                tokio::time::timeout(Duration::from_secs(10), docker::state(&self.container)).await;
            if let Ok(state) = state {
                if matches!(state.status.as_str(), "exited" | "dead") {
                    // Read once more: the line may have landed just before the exit.
                    return Ended::Exited(state.exit_code, self.results_so_far());
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// As [`Running::finish`], with what it logged.
    async fn finish_with_log(self) -> (Vec<Value>, String) {
        let ended = tokio::time::timeout(RUN_LIMIT, self.ended()).await;
        for server in &self.servers {
            server.abort();
        }
        let text = match ended {
            Ok(Ended::Result(text)) => text,
            Ok(Ended::Exited(code, text)) if printed_its_result(&text) => {
                assert_eq!(code, 0, "loadgen printed its result and exited with {code}");
                text
            }
            Ok(Ended::Exited(code, _)) => {
                let (_, stderr) = docker::logs(&self.container).await;
                panic!("loadgen failed (exit code {code}): {stderr}");
            }
            Err(_) => {
                // Say what it was doing: the last lines it wrote.
                let (_, stderr) = docker::logs(&self.container).await;
                panic!(
                    "loadgen did not finish in {} s: {}\nresult lines tail:\n{}\nstderr tail:\n{}",
                    RUN_LIMIT.as_secs(),
                    docker::where_stuck(&self.container).await,
                    tail(&self.results_so_far()),
                    tail(&stderr)
                );
            }
        };
        let lines = text
            .lines()
            .filter_map(|line| serde_json::from_str(line).ok())
            .collect();
        (lines, self.log().await)
    }

    /// What the load generator logged, once its exit is known (the result line
    /// is its last output, so it exits at once; an engine that records the exit
    /// late still has its log file read, see [`docker::wait_output_until`]).
    async fn log(&self) -> String {
        let exited = tokio::time::timeout(
            EXIT_LIMIT,
            docker::wait_output_until(&self.container, |_| true),
        )
        .await;
        match exited {
            Ok((code, _, stderr)) => {
                // No code: the engine had not recorded the exit of a process that
                // wrote its result line, after which `hkvm loadgen` returns success.
                assert_eq!(code.unwrap_or(0), 0, "loadgen failed: {stderr}");
                stderr
            }
            Err(_) => {
                eprintln!(
                    "container {}: the load generator wrote its result, and its exit was not \
                     seen within {} s; its log is what the engine holds so far",
                    self.container.id(),
                    EXIT_LIMIT.as_secs()
                );
                tokio::time::timeout(EXIT_LIMIT, docker::logs(&self.container))
                    .await
                    .map(|(_, stderr)| stderr)
                    .unwrap_or_default()
            }
        }
    }

    /// Waits for a `put` run and sorts its lines.
    pub async fn finish_puts(self) -> PutRun {
        let (lines, log) = self.finish_with_log().await;
        let mut run = PutRun {
            log,
            ..PutRun::default()
        };
        for line in lines {
            let key = line["key"].as_str().unwrap_or_default().to_owned();
            match line["type"].as_str() {
                Some("ack") => run.acked.push((key, line["t"].as_u64().unwrap_or(0))),
                Some("failed") => run.failed.push(key),
                Some("uncertain") => run.uncertain.push(key),
                Some("revoked") => run.revoked.push(key),
                Some("summary") => run.summary = line,
                _ => {}
            }
        }
        run
    }
}

/// Puts for `duration` with `clients` writers under `prefix`.
pub async fn puts(
    topology: &Topology,
    subcluster: &str,
    prefix: &str,
    clients: usize,
    duration: &str,
) -> Running {
    let args = [
        "--mode",
        "put",
        "--prefix",
        prefix,
        "--duration",
        duration,
        "--value-size",
        "2048",
        "--replicas",
        "2",
        "--request-timeout",
        "500ms",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .chain(["--clients".to_owned(), clients.to_string()])
    .collect::<Vec<_>>();
    start(topology, subcluster, &args, Vec::new()).await
}

/// Reads every `present` key from `subcluster` (byte-exact against the value the
/// put stored) and checks that no `absent` key exists; returns the `verify` line.
pub async fn verify(
    topology: &Topology,
    subcluster: &str,
    present: &[String],
    absent: &[String],
) -> Value {
    let args = ["--mode", "verify"].map(str::to_owned);
    let files = vec![("--keys-subject", present), ("--absent-subject", absent)];
    let mut lines = start(topology, subcluster, &args, files)
        .await
        .finish()
        .await;
    lines.pop().unwrap_or_default()
}

/// Asserts that a `verify` line found every key intact and no absent key.
pub fn assert_verified(line: &Value, expected: usize) {
    let empty = |field: &str| line[field].as_array().is_none_or(Vec::is_empty);
    assert!(
        empty("missing") && empty("corrupt") && empty("errors") && empty("appeared"),
        "verification failed: {line}"
    );
    assert_eq!(line["ok"].as_u64(), Some(expected as u64), "{line}");
}

#[test]
fn only_a_result_line_ends_a_load_generator() {
    let acks = "{\"type\":\"ack\",\"key\":\"k\"}\nnot json\n";
    assert!(!printed_its_result(acks));
    for kind in RESULT_TYPES {
        assert!(printed_its_result(&format!(
            "{acks}{{\"type\":\"{kind}\",\"ok\":1}}\n"
        )));
    }
}
