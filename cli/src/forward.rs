//! `hkvm bench …` and `hkvm loadgen …`: the benchmarks and the load generator are
//! the `hkvm-bench` binary, so that the services carry neither their code nor their
//! counting allocator. These subcommands replace this process with it (exec on
//! unix: signals and the exit code are hkvm-bench's own), passing every argument
//! through unchanged, `--help` included.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Command;

use anyhow::Context as _;
use clap::ValueEnum as _;

use hkvm_telemetry::logging::LogFormat;

/// Env var naming the `hkvm-bench` binary; by default the one next to this
/// executable.
pub const BENCH_BIN_ENV: &str = "HKVM_BENCH_BIN";

/// The arguments of a forwarded subcommand, passed through as given.
#[derive(Debug, clap::Args)]
pub struct Forwarded {
    /// Arguments for hkvm-bench (`--help` lists them).
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        num_args = 0..,
        value_name = "ARGS"
    )]
    pub args: Vec<OsString>,
}

/// Which subcommand is forwarded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tool {
    /// `hkvm bench <workload> …`: `hkvm-bench <workload> …`.
    Bench,
    /// `hkvm loadgen …`: `hkvm-bench loadgen …`.
    Loadgen,
}

impl Tool {
    /// The name hkvm-bench runs under (its `argv[0]`), so that its usage lines
    /// and errors name the command that was typed.
    fn arg0(self) -> &'static str {
        match self {
            Self::Bench => "hkvm bench",
            Self::Loadgen => "hkvm",
        }
    }

    /// hkvm-bench's arguments before the forwarded ones.
    fn leading(self) -> &'static [&'static str] {
        match self {
            Self::Bench => &[],
            Self::Loadgen => &["loadgen"],
        }
    }
}

/// The `hkvm-bench` binary: `$HKVM_BENCH_BIN`, else the one in this executable's
/// directory.
///
/// # Errors
/// When `$HKVM_BENCH_BIN` names no file or there is no `hkvm-bench` next to this
/// executable; the message says where it looked.
pub fn find_bench_binary() -> anyhow::Result<PathBuf> {
    if let Some(explicit) = std::env::var_os(BENCH_BIN_ENV) {
        let path = PathBuf::from(explicit);
        anyhow::ensure!(
            path.is_file(),
            "hkvm-bench not found: ${BENCH_BIN_ENV} is {}, which is not a file",
            path.display()
        );
        return Ok(path);
    }
    let exe = std::env::current_exe().context("locating the hkvm binary")?;
    let beside = exe.with_file_name(format!("hkvm-bench{}", std::env::consts::EXE_SUFFIX));
    anyhow::ensure!(
        beside.is_file(),
        "hkvm-bench not found at {} (next to {}): `hkvm bench` and `hkvm loadgen` run \
         that binary; build it (cargo build -p hkvm-bench) or set ${BENCH_BIN_ENV}",
        beside.display(),
        exe.display()
    );
    Ok(beside)
}

/// Runs hkvm-bench for `tool` with `args`, in place of this process on unix. The
/// log format chosen here reaches it through `HKVM_LOG_FORMAT` (a `--log-format`
/// among `args` still wins).
///
/// # Errors
/// When the binary is not found or cannot be executed; otherwise it does not
/// return (on unix) or exits with hkvm-bench's status.
pub fn exec(tool: Tool, args: Vec<OsString>, log_format: LogFormat) -> anyhow::Result<()> {
    let binary = find_bench_binary()?;
    let mut command = Command::new(&binary);
    command.args(tool.leading()).args(args);
    if let Some(format) = log_format.to_possible_value() {
        command.env("HKVM_LOG_FORMAT", format.get_name());
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt as _;
        command.arg0(tool.arg0());
        // Only returns on failure.
        let error = command.exec();
        Err(error).with_context(|| format!("running {}", binary.display()))
    }
    #[cfg(not(unix))]
    {
        let _ = tool.arg0();
        let status = command
            .status()
            .with_context(|| format!("running {}", binary.display()))?;
        std::process::exit(status.code().unwrap_or(1));
    }
}
