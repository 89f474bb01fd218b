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
    let (code, stdout, stderr) = wait_output_until(container, |_| false).await;
    (code.expect("the engine recorded the exit"), stdout, stderr)
}

/// As [`wait_output`], but also done once the container's main process is gone
/// from this host and its stdout, read from the engine's log file, satisfies
/// `finished`; the exit code is then `None` (the engine had not recorded it).
///
/// The engine was seen to record a load generator's exit two minutes late, with
/// its last line printed and its process long gone; every `docker` call about
/// that container waited meanwhile. The host's `/proc` and the json-file log
/// need no engine. Where they cannot be read (a remote engine, another log
/// driver), this is [`wait_output`].
pub async fn wait_output_until(
    container: &Container,
    finished: impl Fn(&str) -> bool,
) -> (Option<i64>, String, String) {
    let host = HostView::of(container).await;
    let mut ended: Option<(std::time::Instant, (String, String))> = None;
    loop {
        if let Ok(state) = tokio::time::timeout(INSPECT_TIMEOUT, state(container)).await {
            if matches!(state.status.as_str(), "exited" | "dead") {
                let (stdout, stderr) = logs(container).await;
                return (Some(state.exit_code), stdout, stderr);
            }
        }
        if ended.is_none() {
            ended = host
                .as_ref()
                .and_then(|host| host.finished_output(&finished))
                .map(|output| (std::time::Instant::now(), output));
        }
        if let Some((since, _)) = &ended {
            if since.elapsed() >= ENGINE_GRACE {
                let waited = since.elapsed();
                let (_, (stdout, stderr)) = ended.expect("just matched");
                eprintln!(
                    "container {}: its process ended after its last line, and the engine had \
                     not recorded the exit {} ms later; output read from the engine's log file",
                    container.id(),
                    waited.as_millis()
                );
                return (None, stdout, stderr);
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// How long the engine may take to record the exit of a process that this host
/// already saw end before [`wait_output_until`] goes on without it.
const ENGINE_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// A running container as this host sees it without asking the engine: its main
/// process and the json-file log its output goes to.
struct HostView {
    pid: u32,
    log: std::path::PathBuf,
}

impl HostView {
    /// Asks the engine once, while the container runs; `None` when the process or
    /// the log file is not visible from here.
    async fn of(container: &Container) -> Option<Self> {
        let output = tokio::time::timeout(
            INSPECT_TIMEOUT,
            run_docker(&[
                "inspect",
                "--format",
                "{{.State.Pid}} {{.LogPath}}",
                container.id(),
            ]),
        )
        .await
        .ok()?;
        let text = String::from_utf8_lossy(&output.stdout).into_owned();
        let (pid, log) = text.trim().split_once(' ')?;
        let view = Self {
            pid: pid.parse().ok().filter(|pid| *pid != 0)?,
            log: log.into(),
        };
        let visible = std::path::Path::new(&format!("/proc/{}", view.pid)).exists()
            && std::fs::metadata(&view.log).is_ok();
        visible.then_some(view)
    }

    /// The stdout and stderr once the process has ended (gone, or a zombie) and
    /// its stdout satisfies `finished`.
    fn finished_output(&self, finished: &impl Fn(&str) -> bool) -> Option<(String, String)> {
        if !process_ended(self.pid) {
            return None;
        }
        let text = std::fs::read_to_string(&self.log).ok()?;
        let (stdout, stderr) = parse_json_log(&text);
        finished(&stdout).then_some((stdout, stderr))
    }
}

/// Whether the host process `pid` is gone or a zombie.
fn process_ended(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_none_or(|state| state == "Z" || state == "X"),
    }
}

/// The stdout and stderr held in an engine's json-file log: one JSON object per
/// line, each carrying a piece of one stream (long lines come in pieces).
fn parse_json_log(text: &str) -> (String, String) {
    let (mut stdout, mut stderr) = (String::new(), String::new());
    for entry in text
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
    {
        let piece = entry["log"].as_str().unwrap_or_default();
        match entry["stream"].as_str() {
            Some("stderr") => stderr.push_str(piece),
            _ => stdout.push_str(piece),
        }
    }
    (stdout, stderr)
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

/// The host view on a real container: it sees the process run, then end after a
/// kill, and reads the server's output from the log file without the engine.
#[tokio::test]
async fn the_host_sees_a_container_end_and_reads_its_output_without_the_engine() {
    use testcontainers::runners::AsyncRunner as _;
    use testcontainers::ImageExt as _;
    if !crate::docker_gate::docker_or_skip("chaos::docker::host_view") {
        return;
    }
    let container = hkvm_itests::images::nats_image()
        .with_cmd(["-js"])
        .start()
        .await
        .expect("a NATS container");
    let Some(host) = HostView::of(&container).await else {
        // A remote engine or another log driver: wait_output_until is then
        // wait_output, which the scenarios use.
        return eprintln!("the engine's processes or log files are not visible from here");
    };
    let ready = |_: &str| true;
    assert!(
        host.finished_output(&ready).is_none(),
        "a running process has not ended"
    );
    kill(&container).await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let (_, stderr) = loop {
        if let Some(output) = host.finished_output(&ready) {
            break output;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the host never saw the killed process end"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert!(stderr.contains("Server is ready"), "{stderr}");
}

#[test]
fn json_file_logs_parse_into_their_streams() {
    let text = concat!(
        r#"{"log":"first half ","stream":"stdout","time":"2026-12-02T00:55:22Z"}"#,
        "\n",
        r#"{"log":"INFO connected\n","stream":"stderr","time":"2026-12-02T00:55:22Z"}"#,
        "\n",
        r#"{"log":"second half\n","stream":"stdout","time":"2026-12-02T00:55:23Z"}"#,
        "\n",
        "a torn last line",
    );
    assert_eq!(
        parse_json_log(text),
        (
            "first half second half\n".to_owned(),
            "INFO connected\n".to_owned()
        )
    );
}

#[test]
fn this_process_has_not_ended_and_a_missing_one_has() {
    assert!(!process_ended(std::process::id()));
    assert!(process_ended(u32::MAX));
}

#[test]
fn docker_memory_usage_parses() {
    assert_eq!(parse_mem_usage("1.5KiB / 2GiB"), Some(1536));
    assert_eq!(parse_mem_usage("12MiB / 23.4GiB\n"), Some(12 << 20));
    assert_eq!(parse_mem_usage("--"), None);
}
