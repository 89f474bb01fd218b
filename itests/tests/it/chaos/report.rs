//! The suite's summary table: every scenario that passes appends one row (scenario,
//! result, the time it measured, keys lost) to `target/chaos-summary.tsv`, prints
//! it, and `scripts/test` prints the whole table after the run.

use std::io::Write as _;
use std::path::PathBuf;

/// Where the rows go: `$CARGO_TARGET_DIR` or the workspace's `target/`.
pub fn summary_path() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(
            || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"),
            PathBuf::from,
        )
        .join("chaos-summary.tsv")
}

/// Records one passed scenario: `time` names what was measured (e.g.
/// `failover 812 ms`), `lost` is the number of acknowledged keys not read back.
pub fn row(scenario: &str, time: &str, lost: usize, detail: &str) {
    let line = format!("{scenario}\tpass\t{time}\t{lost}\t{detail}\n");
    print!("chaos summary: {line}");
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
