//! Where a sub-master's durable writes spend their time: the mean of each stage of
//! its `hkvm_submaster_write_stage_seconds` histogram between two readings of its
//! metrics (the Prometheus text format, as the metrics endpoint serves it), and
//! the rows that set those stages beside the put_end the clients saw.

use std::collections::BTreeMap;

use hkvm_submaster::metrics::WriteStage;

use super::report::{BenchResult, Printer};

const METRIC: &str = "hkvm_submaster_write_stage_seconds";

/// Where `operation` spends its time with `label`'s clients: the mean of each
/// of the sub-master's stages, and what is left outside it (the route both
/// ways and the clients), each as a share of the `mean` (us) the clients saw.
pub fn print_write_stages(
    workload: &'static str,
    operation: &str,
    label: &str,
    mean: f64,
    stages: &[(String, f64)],
    printer: &mut Printer,
) {
    if mean <= 0.0 {
        return;
    }
    let baseline = format!("{operation} mean, {label}, as the clients see it");
    for (stage, value) in stages {
        printer.print(&BenchResult::new(
            workload,
            format!("{operation}, {label}: sub-master stage {stage} (mean)"),
            *value,
            "us",
            baseline.clone(),
            mean,
        ));
    }
    let inside: f64 = stages.iter().map(|(_, value)| value).sum();
    printer.print(&BenchResult::new(
        workload,
        format!(
            "{operation}, {label}: outside the sub-master (the route both ways, the clients; mean)"
        ),
        mean - inside,
        "us",
        baseline,
        mean,
    ));
}

/// Sum and count of each stage's histogram in one reading.
#[derive(Debug, Default, Clone)]
pub struct StageReading {
    /// Stage name to (sum of seconds, count).
    stages: BTreeMap<String, (f64, u64)>,
}

impl StageReading {
    /// Reads the stage histograms out of a metrics text.
    pub fn parse(text: &str) -> Self {
        let mut stages: BTreeMap<String, (f64, u64)> = BTreeMap::new();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix(METRIC) else {
                continue;
            };
            let (part, rest) = if let Some(rest) = rest.strip_prefix("_sum{") {
                ("sum", rest)
            } else if let Some(rest) = rest.strip_prefix("_count{") {
                ("count", rest)
            } else {
                continue;
            };
            let Some((labels, value)) = rest.split_once("} ") else {
                continue;
            };
            let Some(stage) = labels
                .split(',')
                .find_map(|label| label.strip_prefix("stage=\""))
                .and_then(|stage| stage.strip_suffix('"'))
            else {
                continue;
            };
            let entry = stages.entry(stage.to_owned()).or_default();
            let value = value.trim();
            match part {
                "sum" => entry.0 = value.parse().unwrap_or(0.0),
                _ => entry.1 = value.parse().unwrap_or(0),
            }
        }
        Self { stages }
    }

    /// Each stage's mean in microseconds over the writes recorded after `earlier`,
    /// in the order a request passes them ([`WriteStage::ALL`]); a stage with
    /// no write recorded in between is left out.
    pub fn means_since(&self, earlier: &Self) -> Vec<(String, f64)> {
        WriteStage::ALL
            .iter()
            .map(|stage| stage.name())
            .filter_map(|stage| {
                let (sum, count) = self.stages.get(stage).copied().unwrap_or_default();
                let (sum_before, count_before) =
                    earlier.stages.get(stage).copied().unwrap_or_default();
                let count = count.checked_sub(count_before).filter(|c| *c > 0)?;
                Some((stage.to_owned(), (sum - sum_before) / count as f64 * 1e6))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BEFORE: &str = "\
# HELP hkvm_submaster_write_stage_seconds Time a write request spends
# TYPE hkvm_submaster_write_stage_seconds histogram
hkvm_submaster_write_stage_seconds_sum{stage=\"queued\"} 0.001
hkvm_submaster_write_stage_seconds_count{stage=\"queued\"} 10
hkvm_submaster_write_stage_seconds_bucket{le=\"0.000002\",stage=\"queued\"} 0
hkvm_submaster_write_stage_seconds_sum{stage=\"stored\"} 0.01
hkvm_submaster_write_stage_seconds_count{stage=\"stored\"} 10
hkvm_submaster_request_seconds_sum{op=\"put_end\",result=\"ok\"} 5.0
";

    #[test]
    fn means_are_taken_over_the_writes_between_two_readings() {
        let before = StageReading::parse(BEFORE);
        let after = StageReading::parse(
            &BEFORE
                .replace("0.001\n", "0.004\n")
                .replace("queued\"} 10", "queued\"} 40")
                .replace("0.01\n", "0.07\n")
                .replace("stored\"} 10", "stored\"} 110"),
        );
        let means = after.means_since(&before);
        assert_eq!(means.len(), 2, "a stage without writes is left out");
        assert_eq!(means[0].0, "queued");
        assert!((means[0].1 - 100.0).abs() < 1e-9, "{means:?}");
        assert_eq!(means[1].0, "stored");
        assert!((means[1].1 - 600.0).abs() < 1e-9, "{means:?}");
    }

    #[test]
    fn other_metrics_and_garbage_are_ignored() {
        let reading = StageReading::parse("garbage\nhkvm_submaster_write_stage_seconds_sum{x} 1\n");
        assert!(reading.stages.is_empty());
    }
}
