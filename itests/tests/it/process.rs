//! `hkvm` (and `hkvm-bench`) child processes: found next to the test executable
//! (`target/<profile>/`), or named by `HKVM_BIN`; built once per test process when
//! missing. A [`Process`] captures its output line by line, waits for readiness by
//! reading those lines, and is killed when dropped (a failing test prints the last
//! lines of each of its processes).
#![allow(dead_code)]

use std::ffi::OsStr;
use std::io::{BufRead as _, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use tokio::sync::watch;

/// Env var naming the `hkvm` executable to run instead of the one next to the
/// test executable.
pub const HKVM_BIN_ENV: &str = "HKVM_BIN";

/// How many output lines a failing test prints per process.
const TAIL_LINES: usize = 40;

/// `target/<profile>`: the test executable lives in `target/<profile>/deps/`.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let mut dir = exe.parent().expect("the test executable's directory");
    if dir.ends_with("deps") {
        dir = dir.parent().expect("the profile directory");
    }
    dir.to_owned()
}

/// `cargo build` of the binaries into the target directory and profile this test
/// executable was built for.
fn build_binaries(profile_dir: &Path) {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace directory");
    let profile = profile_dir
        .file_name()
        .and_then(OsStr::to_str)
        .unwrap_or("debug")
        .to_owned();
    let target_dir = profile_dir.parent().expect("the target directory");
    let cargo = std::env::var_os("CARGO")
        .or_else(|| option_env!("CARGO").map(Into::into))
        .unwrap_or_else(|| "cargo".into());
    let mut command = Command::new(cargo);
    command
        .current_dir(workspace)
        .arg("build")
        .arg("--manifest-path")
        .arg(workspace.join("Cargo.toml"))
        .args(["-p", "hkvm-cli"]);
    if workspace.join("bench").join("Cargo.toml").exists() {
        command.args(["-p", "hkvm-bench"]);
    }
    command
        .arg("--bins")
        .arg("--target-dir")
        .arg(target_dir)
        .args([
            "--profile",
            if profile == "debug" { "dev" } else { &profile },
        ]);
    let status = command.status().unwrap_or_else(|error| {
        panic!("cannot run `{command:?}` to build the hkvm binary: {error}")
    });
    assert!(
        status.success(),
        "building the hkvm binary failed ({status}): `{command:?}`; build it yourself \
         (cargo build -p hkvm-cli --bins) or name one with {HKVM_BIN_ENV}"
    );
}

/// The `hkvm` executable: `$HKVM_BIN`, else `target/<profile>/hkvm` (built once
/// per test process with `cargo build -p hkvm-cli -p hkvm-bench --bins` when
/// missing). Blocks while building: async code uses [`hkvm_bin_async`].
pub fn hkvm_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(path) = std::env::var_os(HKVM_BIN_ENV) {
            let path = PathBuf::from(path);
            assert!(
                path.is_file(),
                "{HKVM_BIN_ENV}={} is not a file",
                path.display()
            );
            return path;
        }
        let dir = profile_dir();
        let path = dir.join(format!("hkvm{}", std::env::consts::EXE_SUFFIX));
        if !path.is_file() {
            build_binaries(&dir);
            assert!(
                path.is_file(),
                "cargo built the binaries, yet {} does not exist",
                path.display()
            );
        }
        path
    })
}

/// [`hkvm_bin`] without blocking the async runtime's threads.
pub async fn hkvm_bin_async() -> PathBuf {
    tokio::task::spawn_blocking(|| hkvm_bin().to_owned())
        .await
        .expect("locating the hkvm binary")
}

/// The `hkvm-bench` executable next to [`hkvm_bin`] (where `hkvm bench` and
/// `hkvm loadgen` look for it; built with it when missing).
pub async fn hkvm_bench_bin() -> PathBuf {
    let path = hkvm_bin_async()
        .await
        .with_file_name(format!("hkvm-bench{}", std::env::consts::EXE_SUFFIX));
    assert!(
        path.is_file(),
        "{} does not exist: build it (cargo build -p hkvm-bench --bins)",
        path.display()
    );
    path
}

/// A command running `hkvm-bench` with `args` (stdin closed).
pub async fn hkvm_bench<I, S>(args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut command = Command::new(hkvm_bench_bin().await);
    command.args(args).stdin(Stdio::null());
    command
}

/// A command running `hkvm` with `args` (stdin closed).
pub async fn hkvm<I, S>(args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut command = Command::new(hkvm_bin_async().await);
    command.args(args).stdin(Stdio::null());
    command
}

/// What a finished `hkvm` command printed.
#[derive(Debug)]
pub struct Ran {
    /// Its exit status.
    pub status: ExitStatus,
    /// Its standard output.
    pub stdout: String,
    /// Its standard error.
    pub stderr: String,
}

impl Ran {
    /// Whether it exited with status 0.
    pub fn success(&self) -> bool {
        self.status.success()
    }
}

/// Runs `command` to its end (on a blocking thread) and returns its output.
pub async fn run(mut command: Command) -> Ran {
    let output = tokio::task::spawn_blocking(move || command.output())
        .await
        .expect("running a command")
        .expect("starting a command");
    Ran {
        status: output.status,
        stdout: String::from_utf8(output.stdout).expect("the output is UTF-8"),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// Runs `hkvm args` to its end.
pub async fn run_hkvm(args: &[&str]) -> Ran {
    run(hkvm(args).await).await
}

/// Which output stream a line came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// Standard output.
    Stdout,
    /// Standard error (where `hkvm` logs).
    Stderr,
}

/// Every line a process wrote so far, in arrival order per stream.
#[derive(Debug, Default, Clone)]
struct Lines {
    lines: Vec<(Stream, String)>,
    /// Streams that reached their end.
    closed: usize,
}

/// A child process, killed (SIGKILL) when dropped.
pub struct Process {
    name: String,
    child: Child,
    lines: watch::Receiver<Lines>,
}

fn read_lines(reader: impl Read, stream: Stream, lines: watch::Sender<Lines>) {
    for line in BufReader::new(reader).lines() {
        let Ok(line) = line else { break };
        lines.send_modify(|all| all.lines.push((stream, line)));
    }
    lines.send_modify(|all| all.closed += 1);
}

impl Process {
    /// Spawns `command` with its stdout and stderr captured; `name` identifies it
    /// in messages.
    pub fn spawn(name: &str, mut command: Command) -> Self {
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|error| panic!("spawning {name} ({command:?}): {error}"));
        let (sender, lines) = watch::channel(Lines::default());
        let stdout = child.stdout.take().expect("piped stdout");
        let stderr = child.stderr.take().expect("piped stderr");
        let out = sender.clone();
        std::thread::spawn(move || read_lines(stdout, Stream::Stdout, out));
        std::thread::spawn(move || read_lines(stderr, Stream::Stderr, sender));
        Self {
            name: name.to_owned(),
            child,
            lines,
        }
    }

    /// Spawns `hkvm args` with `RUST_LOG=rust_log`.
    pub async fn hkvm(name: &str, args: &[&str], rust_log: &str) -> Self {
        let mut command = hkvm(args).await;
        command.env("RUST_LOG", rust_log);
        Self::spawn(name, command)
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its operating-system process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Waits (at most `within`) until a line of `stream` contains `needle`, and
    /// returns that line. Fails the test, with the output so far, if the process
    /// ends its output or the time passes first.
    pub async fn wait_for_line(&self, stream: Stream, needle: &str, within: Duration) -> String {
        let mut lines = self.lines.clone();
        let found = |all: &Lines| {
            all.lines
                .iter()
                .any(|(s, line)| *s == stream && line.contains(needle))
                || all.closed == 2
        };
        // Only whether it timed out: the guard `wait_for` returns must not be held
        // while the lines are read again below.
        let timed_out = tokio::time::timeout(within, lines.wait_for(found))
            .await
            .is_err();
        let all = self.lines.borrow().clone();
        if let Some((_, line)) = all
            .lines
            .iter()
            .find(|(s, line)| *s == stream && line.contains(needle))
        {
            return line.clone();
        }
        let why = if timed_out {
            format!("not within {within:?}")
        } else {
            "its output ended".to_owned()
        };
        panic!(
            "{} never wrote {needle:?} to {stream:?} ({why}); its output:\n{}",
            self.name,
            self.tail(TAIL_LINES)
        );
    }

    /// Its standard output so far.
    pub fn stdout(&self) -> String {
        self.text(Stream::Stdout)
    }

    /// Its standard error so far.
    pub fn stderr(&self) -> String {
        self.text(Stream::Stderr)
    }

    fn text(&self, stream: Stream) -> String {
        let lines = self.lines.borrow();
        let mut text = String::new();
        for (_, line) in lines.lines.iter().filter(|(s, _)| *s == stream) {
            text.push_str(line);
            text.push('\n');
        }
        text
    }

    /// The last `n` lines of both streams.
    pub fn tail(&self, n: usize) -> String {
        let lines = self.lines.borrow();
        let skip = lines.lines.len().saturating_sub(n);
        lines.lines[skip..]
            .iter()
            .map(|(stream, line)| match stream {
                Stream::Stdout => format!("  out| {line}"),
                Stream::Stderr => format!("  err| {line}"),
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// SIGKILL, and waits until the process is gone.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits (at most `within`, polling) until the process exits by itself, and
    /// returns its status; fails the test with its output otherwise.
    pub async fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("polling a child") {
                return status;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{} did not exit within {within:?}; its output:\n{}",
                self.name,
                self.tail(TAIL_LINES)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!(
                "--- last output of {} (pid {}) ---\n{}",
                self.name,
                self.child.id(),
                self.tail(TAIL_LINES)
            );
        }
    }
}
