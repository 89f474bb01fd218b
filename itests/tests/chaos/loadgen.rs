//! Running `hkvm loadgen` in a container on the cluster network (node endpoints are
//! container hostnames, reachable only there) and reading back what it saw: one
//! JSON line per result on the container's stdout.

use std::time::Duration;

use hkvm_itests::images::hkvm_image;
use serde_json::Value;
use testcontainers::runners::AsyncRunner as _;
use testcontainers::ImageExt as _;

use crate::topology::{Container, Topology, CLUSTER};

/// What a `put` run reported.
#[derive(Debug, Default)]
pub struct PutRun {
    /// Acknowledged keys with the unix time (ms) of the acknowledgement.
    pub acked: Vec<(String, u64)>,
    /// Keys whose put returned an error.
    pub failed: Vec<String>,
    /// Keys started and revoked on purpose.
    pub revoked: Vec<String>,
    /// The final summary line.
    pub summary: Value,
}

/// A load generator started in the background.
pub struct Running {
    container: Container,
}

/// Starts `hkvm loadgen` against `subcluster` with extra `args`; `files` are copied
/// into the container first (`(path, contents)`).
pub async fn start(
    topology: &Topology,
    subcluster: &str,
    args: &[String],
    files: Vec<(&str, String)>,
) -> Running {
    let mut cmd = vec![
        "loadgen".to_owned(),
        "--nats".to_owned(),
        topology.inside_url(),
        "--cluster".to_owned(),
        CLUSTER.to_owned(),
        "--subcluster".to_owned(),
        subcluster.to_owned(),
    ];
    cmd.extend(args.iter().cloned());
    let mut request = hkvm_image()
        .with_network(&topology.network)
        .with_env_var("RUST_LOG", "error")
        .with_startup_timeout(Duration::from_secs(60));
    for (path, contents) in files {
        request = request.with_copy_to(path, contents.into_bytes());
    }
    let container = request.with_cmd(cmd).start().await.unwrap();
    Running { container }
}

impl Running {
    /// Waits for the load generator to exit and returns its JSON lines.
    pub async fn finish(self) -> Vec<Value> {
        for _ in 0..1200 {
            if let Some(code) = self.container.exit_code().await.unwrap() {
                let stdout = self.container.stdout_to_vec().await.unwrap();
                let stderr = self.container.stderr_to_vec().await.unwrap();
                assert_eq!(
                    code,
                    0,
                    "loadgen failed: {}",
                    String::from_utf8_lossy(&stderr)
                );
                return String::from_utf8_lossy(&stdout)
                    .lines()
                    .filter_map(|line| serde_json::from_str(line).ok())
                    .collect();
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("loadgen did not finish in two minutes");
    }

    /// Waits for a `put` run and sorts its lines.
    pub async fn finish_puts(self) -> PutRun {
        let mut run = PutRun::default();
        for line in self.finish().await {
            let key = line["key"].as_str().unwrap_or_default().to_owned();
            match line["type"].as_str() {
                Some("ack") => run.acked.push((key, line["t"].as_u64().unwrap_or(0))),
                Some("failed") => run.failed.push(key),
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
    let args = [
        "--mode",
        "verify",
        "--keys-file",
        "/data/present.txt",
        "--absent-file",
        "/data/absent.txt",
    ]
    .map(str::to_owned);
    let files = vec![
        ("/data/present.txt", present.join("\n")),
        ("/data/absent.txt", absent.join("\n")),
    ];
    let mut lines = start(topology, subcluster, &args, files)
        .await
        .finish()
        .await;
    lines.pop().unwrap_or_default()
}

/// Asserts that a `verify` line found every key intact and no absent key.
pub fn assert_verified(line: &Value, expected: usize) {
    let empty = |field: &str| line[field].as_array().map_or(true, Vec::is_empty);
    assert!(
        empty("missing") && empty("corrupt") && empty("errors") && empty("appeared"),
        "verification failed: {line}"
    );
    assert_eq!(line["ok"].as_u64(), Some(expected as u64), "{line}");
}
