//! What production does to containers that testcontainers has no verb for: SIGKILL,
//! cutting a container off its network and healing it, and reading its memory use.
//! Each is one `docker` CLI call against the same engine testcontainers uses.
//!
//! The calls run `std::process` on a blocking thread rather than
//! `tokio::process`: a `docker` child waited for through the runtime's child
//! reaping was seen left a zombie with its call never returning, and a
//! `docker logs` blocked on a full pipe its reader no longer drained.

use std::process::{Command, Output};

use super::topology::Container;

/// Runs `docker <args>` to its end on a blocking thread.
async fn run_docker(args: &[&str]) -> Output {
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    tokio::task::spawn_blocking(move || Command::new("docker").args(&args).output())
        .await
        .expect("the docker call's thread")
        .expect("running docker")
}

async fn docker(args: &[&str]) -> String {
    let output = run_docker(args).await;
    assert!(
        output.status.success(),
        "docker {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The container's stdout and stderr so far (`docker logs`: a plain CLI call,
/// independent of the log streaming of the testcontainers client).
pub async fn logs(container: &Container) -> (String, String) {
    let output = run_docker(&["logs", container.id()]).await;
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Waits until the container's process exits; returns its exit code, stdout and
/// stderr.
pub async fn wait_output(container: &Container) -> (i64, String, String) {
    let code = docker(&["wait", container.id()]).await;
    let (stdout, stderr) = logs(container).await;
    (code.trim().parse().unwrap_or(-1), stdout, stderr)
}

/// SIGKILL of the container's main process (no clean shutdown, no lease handover).
pub async fn kill(container: &Container) {
    docker(&["kill", "--signal", "KILL", container.id()]).await;
}

/// Disconnects the container from `network`: its peers and NATS stop hearing it.
pub async fn disconnect(container: &Container, network: &str) {
    docker(&["network", "disconnect", "--force", network, container.id()]).await;
}

/// Reconnects the container to `network`.
pub async fn connect(container: &Container, network: &str) {
    docker(&["network", "connect", network, container.id()]).await;
}

/// The container's current memory use in bytes (the engine's cgroup accounting).
pub async fn memory_bytes(container: &Container) -> Option<u64> {
    let text = docker(&[
        "stats",
        "--no-stream",
        "--format",
        "{{.MemUsage}}",
        container.id(),
    ])
    .await;
    parse_mem_usage(&text)
}

/// Parses the used part of `docker stats`' `MemUsage` (`"12.5MiB / 23.4GiB"`).
fn parse_mem_usage(text: &str) -> Option<u64> {
    let used = text.split('/').next()?.trim();
    let split = used.find(|c: char| c.is_ascii_alphabetic())?;
    let (number, unit) = used.split_at(split);
    let number: f64 = number.trim().parse().ok()?;
    let scale = match unit {
        "B" => 1.0,
        "KiB" | "kB" => 1024.0,
        "MiB" | "MB" => 1024.0 * 1024.0,
        "GiB" | "GB" => 1024.0 * 1024.0 * 1024.0,
        _ => return None,
    };
    Some((number * scale) as u64)
}

#[test]
fn docker_memory_usage_parses() {
    assert_eq!(parse_mem_usage("1.5KiB / 2GiB"), Some(1536));
    assert_eq!(parse_mem_usage("12MiB / 23.4GiB\n"), Some(12 << 20));
    assert_eq!(parse_mem_usage("--"), None);
}
