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

/// The state `docker inspect` reports for a container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct State {
    /// `created`, `running`, `exited`, `dead`, ….
    pub status: String,
    /// The exit code once it exited.
    pub exit_code: i64,
    /// The main process's pid on the host (0 when not running).
    pub pid: u32,
}

/// The container's state.
pub async fn state(container: &Container) -> State {
    let text = docker(&[
        "inspect",
        "--format",
        "{{.State.Status}} {{.State.ExitCode}} {{.State.Pid}}",
        container.id(),
    ])
    .await;
    let mut fields = text.split_whitespace();
    State {
        status: fields.next().unwrap_or_default().to_owned(),
        exit_code: fields.next().and_then(|f| f.parse().ok()).unwrap_or(-1),
        pid: fields.next().and_then(|f| f.parse().ok()).unwrap_or(0),
    }
}

/// How long one `docker inspect` of [`wait_output`]'s poll may take.
const INSPECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Waits until the container's process exits; returns its exit code, stdout and
/// stderr.
///
/// It polls `docker inspect` rather than holding one `docker wait` open: a long
/// `docker wait` was seen never to return for a load generator that had printed
/// its last line, and a poll both cannot miss the exit and leaves the state to
/// report (see [`where_stuck`]) when the caller's deadline passes.
///
/// One `docker inspect` that does not answer within [`INSPECT_TIMEOUT`] is left
/// behind and the poll asks again, so a single stuck CLI call cannot use up the
/// caller's whole deadline.
pub async fn wait_output(container: &Container) -> (i64, String, String) {
    let code = loop {
        if let Ok(state) = tokio::time::timeout(INSPECT_TIMEOUT, state(container)).await {
            if matches!(state.status.as_str(), "exited" | "dead") {
                break state.exit_code;
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    let (stdout, stderr) = logs(container).await;
    (code, stdout, stderr)
}

/// What a container that should have exited is doing: its state, and for a
/// running one each thread of its main process with the kernel's state and wait
/// channel (read from the host's /proc, which sees every container's processes).
pub async fn where_stuck(container: &Container) -> String {
    let state = state(container).await;
    let mut report = format!("container {} (exit code {})", state.status, state.exit_code);
    if state.pid == 0 {
        return report;
    }
    let tasks = format!("/proc/{}/task", state.pid);
    let Ok(entries) = std::fs::read_dir(&tasks) else {
        report.push_str(&format!("; {tasks} unreadable"));
        return report;
    };
    for entry in entries.flatten() {
        let dir = entry.path();
        let read = |name: &str| {
            std::fs::read_to_string(dir.join(name))
                .map(|text| text.trim().to_owned())
                .unwrap_or_default()
        };
        // stat: "tid (comm) S …": the state letter follows the command's ')'.
        let stat = read("stat");
        let run_state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .unwrap_or("?")
            .to_owned();
        report.push_str(&format!(
            "\n  thread {} {:?}: state {run_state}, waiting in {}",
            entry.file_name().to_string_lossy(),
            read("comm"),
            read("wchan"),
        ));
    }
    report
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
