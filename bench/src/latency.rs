//! Latency quantiles of sorted samples, shared by the workloads that time
//! single operations.

use std::time::Duration;

/// The `quantile` (0..=1) of `sorted` latencies (nearest rank); zero when there
/// are none.
pub fn quantile(sorted: &[Duration], quantile: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let index = ((sorted.len() - 1) as f64 * quantile).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

/// [`quantile`] in microseconds.
pub fn quantile_us(sorted: &[Duration], q: f64) -> f64 {
    quantile(sorted, q).as_secs_f64() * 1e6
}

/// [`quantile`] in milliseconds.
pub fn quantile_ms(sorted: &[Duration], q: f64) -> f64 {
    quantile(sorted, q).as_secs_f64() * 1e3
}

/// The mean of `latencies` in microseconds (0 when there are none).
pub fn mean_us(latencies: &[Duration]) -> f64 {
    if latencies.is_empty() {
        return 0.0;
    }
    latencies.iter().map(Duration::as_secs_f64).sum::<f64>() / latencies.len() as f64 * 1e6
}

/// The median of `values` (the upper one of an even count); zero when empty.
pub fn median(values: &mut [f64]) -> f64 {
    values.sort_unstable_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_pick_the_nearest_rank_and_zero_when_empty() {
        let ms = |n| Duration::from_millis(n);
        let sorted: Vec<Duration> = (1..=101).map(ms).collect();
        assert_eq!(quantile(&sorted, 0.5), ms(51));
        assert_eq!(quantile(&sorted, 0.99), ms(100));
        assert_eq!(quantile(&sorted, 1.0), ms(101));
        assert_eq!(quantile(&[], 0.99), Duration::ZERO);
        assert_eq!(quantile_ms(&sorted, 0.0), 1.0);
    }

    #[test]
    fn the_median_is_the_middle_value_and_zero_when_empty() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0]), 4.0);
        assert_eq!(median(&mut []), 0.0);
    }
}
