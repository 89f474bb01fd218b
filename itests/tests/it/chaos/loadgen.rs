//! Running `hkvm loadgen` in a container on the cluster network (node endpoints are
//! container hostnames, reachable only there) and reading back what it saw: one
//! JSON line per result on the container's stdout.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use futures::StreamExt as _;

use hkvm_events::subject::submaster_rpc_subject;
use hkvm_events::{ClusterId, SubclusterId};
use hkvm_itests::images::hkvm_image;
use serde_json::Value;
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
}

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
    ];
    cmd.extend(args.iter().cloned());
    let mut servers = Vec::new();
    for (flag, keys) in key_lists {
        let (subject, server) = serve_keys(topology.connect(0).await, keys).await;
        cmd.extend([flag.to_owned(), subject]);
        servers.push(server);
    }
    let container = hkvm_image()
        .with_network(&topology.network)
        .with_env_var("RUST_LOG", "error,hkvm_events::connection=info")
        .with_startup_timeout(Duration::from_secs(60))
        .with_cmd(cmd)
        .start()
        .await
        .unwrap();
    Running { container, servers }
}

/// The `type` of the line each `hkvm loadgen` mode prints last, just before it
/// returns success.
const RESULT_TYPES: [&str; 3] = ["summary", "verify", "query"];

/// Whether a load generator's stdout holds its result line.
fn printed_its_result(stdout: &str) -> bool {
    stdout.lines().any(|line| {
        serde_json::from_str::<Value>(line)
            .is_ok_and(|line| RESULT_TYPES.contains(&line["type"].as_str().unwrap_or_default()))
    })
}

impl Running {
    /// Waits (two minutes at most) for the load generator to exit and returns
    /// its JSON lines.
    pub async fn finish(self) -> Vec<Value> {
        self.finish_with_log().await.0
    }

    /// As [`Running::finish`], with what it logged.
    async fn finish_with_log(self) -> (Vec<Value>, String) {
        let waited = tokio::time::timeout(
            Duration::from_secs(120),
            docker::wait_output_until(&self.container, printed_its_result),
        )
        .await;
        for server in &self.servers {
            server.abort();
        }
        let Ok((code, stdout, stderr)) = waited else {
            // Say what it was doing: the last lines it wrote.
            let (stdout, stderr) = docker::logs(&self.container).await;
            let tail = |text: &str| {
                let lines: Vec<&str> = text.lines().collect();
                lines[lines.len().saturating_sub(20)..].join("\n")
            };
            panic!(
                "loadgen did not finish in two minutes: {}\nstdout tail:\n{}\nstderr tail:\n{}",
                docker::where_stuck(&self.container).await,
                tail(&stdout),
                tail(&stderr)
            );
        };
        // No code: the engine had not recorded the exit of a process that printed
        // its result line, after which `hkvm loadgen` returns success.
        assert_eq!(code.unwrap_or(0), 0, "loadgen failed: {stderr}");
        let lines = stdout
            .lines()
            .filter_map(|line| serde_json::from_str(line).ok())
            .collect();
        (lines, stderr)
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
