//! `hkvm bench …` and `hkvm loadgen …` run the hkvm-bench binary (here a stand-in
//! script named by `HKVM_BENCH_BIN`) with every argument passed through unchanged,
//! `--help` included, the log format in `HKVM_LOG_FORMAT`, and its exit status
//! kept; a missing binary is an error saying where it was looked for.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A stand-in for hkvm-bench: prints its arguments one a line, then the log
/// format, and exits with status 7.
fn stand_in(dir: &Path) -> PathBuf {
    let path = dir.join("fake-hkvm-bench");
    std::fs::write(
        &path,
        "#!/bin/sh\nfor arg in \"$@\"; do echo \"arg=$arg\"; done\necho \"format=$HKVM_LOG_FORMAT\"\nexit 7\n",
    )
    .expect("writing the stand-in");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
        .expect("making the stand-in executable");
    path
}

fn hkvm(bench_bin: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hkvm"))
        .args(args)
        .env("HKVM_BENCH_BIN", bench_bin)
        .env_remove("HKVM_LOG_FORMAT")
        .output()
        .expect("running hkvm")
}

fn lines(output: &Output) -> Vec<String> {
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

#[test]
fn bench_passes_every_argument_through_and_keeps_the_exit_status() {
    let dir = tempfile::tempdir().unwrap();
    let bench = stand_in(dir.path());
    let output = hkvm(
        &bench,
        &[
            "bench", "all", "--quick", "--json", "--help", "-x", "--", "a b",
        ],
    );
    assert_eq!(output.status.code(), Some(7), "{output:?}");
    assert_eq!(
        lines(&output),
        [
            "arg=all",
            "arg=--quick",
            "arg=--json",
            "arg=--help",
            "arg=-x",
            "arg=--",
            "arg=a b",
            "format=text"
        ]
    );
}

#[test]
fn loadgen_runs_the_loadgen_subcommand_with_the_log_format() {
    let dir = tempfile::tempdir().unwrap();
    let bench = stand_in(dir.path());
    let output = hkvm(
        &bench,
        &["--log-format", "json", "loadgen", "--mode", "verify", "-h"],
    );
    assert_eq!(output.status.code(), Some(7), "{output:?}");
    assert_eq!(
        lines(&output),
        [
            "arg=loadgen",
            "arg=--mode",
            "arg=verify",
            "arg=-h",
            "format=json"
        ]
    );
}

#[test]
fn a_missing_hkvm_bench_is_reported_with_where_it_was_looked_for() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-hkvm-bench");
    let output = hkvm(&missing, &["bench", "events", "--quick"]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("HKVM_BENCH_BIN"), "{stderr}");
    assert!(stderr.contains(&missing.display().to_string()), "{stderr}");
}
