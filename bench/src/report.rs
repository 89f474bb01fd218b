//! Benchmark results: a human table on stdout, or one JSON object per line with the
//! fields `workload`, `metric`, `value`, `unit`, `baseline`, `baseline_value`, `ratio`.

use serde::Serialize;

/// One measured figure and the baseline it is compared with.
#[derive(Debug, Clone, Serialize)]
pub struct BenchResult {
    /// The workload (`events`, `put`, ...).
    pub workload: &'static str,
    /// What was measured.
    pub metric: String,
    /// The figure.
    pub value: f64,
    /// Its unit.
    pub unit: &'static str,
    /// What it is compared with (measured in the same run).
    pub baseline: String,
    /// The baseline's figure, in the same unit.
    pub baseline_value: f64,
    /// `value / baseline_value`.
    pub ratio: f64,
}

impl BenchResult {
    /// A result with its ratio computed.
    pub fn new(
        workload: &'static str,
        metric: impl Into<String>,
        value: f64,
        unit: &'static str,
        baseline: impl Into<String>,
        baseline_value: f64,
    ) -> Self {
        let ratio = if baseline_value == 0.0 {
            0.0
        } else {
            value / baseline_value
        };
        Self {
            workload,
            metric: metric.into(),
            value,
            unit,
            baseline: baseline.into(),
            baseline_value,
            ratio,
        }
    }
}

/// Prints results as they come.
pub struct Printer {
    json: bool,
    header_done: bool,
}

fn human(value: f64) -> String {
    match value.abs() {
        v if v >= 1e9 => format!("{:.2} G", value / 1e9),
        v if v >= 1e6 => format!("{:.2} M", value / 1e6),
        v if v >= 1e4 => format!("{:.1} k", value / 1e3),
        v if v >= 100.0 => format!("{value:.0}"),
        _ => format!("{value:.3}"),
    }
}

impl Printer {
    /// A printer writing JSON lines or a table.
    pub fn new(json: bool) -> Self {
        Self {
            json,
            header_done: false,
        }
    }

    /// Prints one result.
    pub fn print(&mut self, result: &BenchResult) {
        if self.json {
            match serde_json::to_string(result) {
                Ok(line) => println!("{line}"),
                Err(error) => eprintln!("cannot encode a result: {error}"),
            }
            return;
        }
        if !self.header_done {
            println!(
                "{:<9} {:<44} {:>12} {:<9} {:<38} {:>12} {:>8}",
                "workload", "metric", "value", "unit", "baseline", "baseline", "ratio"
            );
            self.header_done = true;
        }
        println!(
            "{:<9} {:<44} {:>12} {:<9} {:<38} {:>12} {:>8.3}",
            result.workload,
            result.metric,
            human(result.value),
            result.unit,
            result.baseline,
            human(result.baseline_value),
            result.ratio
        );
    }

    /// Ends the output.
    pub fn finish(&mut self) {}
}
