//! The suite's summary table: every scenario appends exactly one row (scenario,
//! result, the time it measured, keys lost, detail) to
//! `target/chaos-summary.tsv` and prints it; `scripts/test` prints the whole table
//! after the run. The result is `passed`, `failed` (the scenario panicked) or
//! `skipped` (Docker suites off, or the slow scenario in quick mode).

use std::io::Write as _;
use std::path::PathBuf;

use crate::docker_gate::{self, DOCKER_TESTS_ENV, QUICK_ENV};

/// Where the rows go: `$CARGO_TARGET_DIR` or the workspace's `target/`.
pub fn summary_path() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(
            || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"),
            PathBuf::from,
        )
        .join("chaos-summary.tsv")
}

/// The result column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Passed,
    Failed,
    Skipped,
}

impl Outcome {
    fn name(self) -> &'static str {
        match self {
            Self::Passed => "passed",
            Self::Failed => "failed",
            Self::Skipped => "skipped",
        }
    }
}

/// Formats one row (tabs inside fields would shift the columns: they become
/// spaces).
fn format_row(scenario: &str, outcome: Outcome, time: &str, lost: &str, detail: &str) -> String {
    let clean = |field: &str| field.replace(['\t', '\n'], " ");
    format!(
        "{}\t{}\t{}\t{}\t{}\n",
        clean(scenario),
        outcome.name(),
        clean(time),
        clean(lost),
        clean(detail)
    )
}

fn append(line: &str) {
    // stderr as well as stdout: a failing test's output shows stdout only once
    // it ends, and the row of a skipped test belongs next to its SKIPPED line.
    eprint!("chaos summary: {line}");
    let path = summary_path();
    if let Ok(mut file) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
    {
        // One write per row: appends of a short line do not interleave.
        let _ = file.write_all(line.as_bytes());
    }
}

/// One scenario's row, written exactly once: [`Scenario::passed`] at its end, a
/// `failed` row when it is dropped without having passed (a panic unwinding the
/// test), a `skipped` row from [`Scenario::start`] when it does not run.
#[must_use = "a scenario that is dropped at once is reported failed"]
pub struct Scenario {
    name: &'static str,
    written: bool,
}

impl Scenario {
    /// Starts scenario `name`, or records it `skipped` and returns `None` when the
    /// Docker suites are off.
    pub fn start(name: &'static str) -> Option<Self> {
        if !docker_gate::docker_or_skip(name) {
            append(&format_row(
                name,
                Outcome::Skipped,
                "-",
                "-",
                &format!("{DOCKER_TESTS_ENV} is not 1"),
            ));
            return None;
        }
        Some(Self {
            name,
            written: false,
        })
    }

    /// [`Scenario::start`] for the slowest scenario, which quick mode
    /// (`HKVM_ITESTS_QUICK=1`) also skips.
    pub fn start_slow(name: &'static str) -> Option<Self> {
        let mut scenario = Self::start(name)?;
        if docker_gate::quick() {
            scenario.written = true;
            eprintln!("SKIPPED ({QUICK_ENV}=1 skips the slowest scenario): {name}");
            append(&format_row(
                name,
                Outcome::Skipped,
                "-",
                "-",
                &format!("{QUICK_ENV}=1"),
            ));
            return None;
        }
        Some(scenario)
    }

    /// Records the scenario passed: `time` names what was measured (e.g.
    /// `failover 812 ms`), `lost` is the number of acknowledged keys not read
    /// back.
    pub fn passed(mut self, time: &str, lost: usize, detail: &str) {
        self.written = true;
        append(&format_row(
            self.name,
            Outcome::Passed,
            time,
            &lost.to_string(),
            detail,
        ));
    }
}

impl Drop for Scenario {
    fn drop(&mut self) {
        if self.written {
            return;
        }
        let detail = if std::thread::panicking() {
            "panicked: see the test's output"
        } else {
            "ended without a result"
        };
        append(&format_row(self.name, Outcome::Failed, "-", "-", detail));
    }
}

#[test]
fn rows_have_five_tab_separated_fields() {
    let row = format_row("2 kill\t-9", Outcome::Skipped, "-", "0", "a\nb");
    assert_eq!(row, "2 kill -9\tskipped\t-\t0\ta b\n");
}
