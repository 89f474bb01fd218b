//! Rate-limiting a log line that repeats in a steady state (a ping failing
//! every second while its sub-master is away, a purge every few seconds): one
//! line per period, saying how many occurrences it stands for.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The occurrences of one repeating line.
#[derive(Debug)]
pub struct Repeats {
    period: Duration,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    last_logged: Option<Instant>,
    unlogged: u64,
}

impl Repeats {
    /// A line logged at most once per `period`.
    pub const fn every(period: Duration) -> Self {
        Self {
            period,
            state: Mutex::new(State {
                last_logged: None,
                unlogged: 0,
            }),
        }
    }

    /// Counts an occurrence now: `Some(n)` when it is to be logged, `n` being
    /// the occurrences since the last logged one, this one included (1 for the
    /// first); `None` when it is only counted.
    pub fn occur(&self) -> Option<u64> {
        self.occur_at(Instant::now())
    }

    fn occur_at(&self, now: Instant) -> Option<u64> {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        state.unlogged += 1;
        let due = state
            .last_logged
            .is_none_or(|last| now.saturating_duration_since(last) >= self.period);
        if !due {
            return None;
        }
        state.last_logged = Some(now);
        Some(std::mem::take(&mut state.unlogged))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_is_logged_then_one_per_period_with_the_count() {
        let repeats = Repeats::every(Duration::from_secs(10));
        let start = Instant::now();
        assert_eq!(repeats.occur_at(start), Some(1));
        for second in 1..10 {
            assert_eq!(repeats.occur_at(start + Duration::from_secs(second)), None);
        }
        assert_eq!(repeats.occur_at(start + Duration::from_secs(10)), Some(10));
        assert_eq!(repeats.occur_at(start + Duration::from_secs(11)), None);
        assert_eq!(repeats.occur_at(start + Duration::from_secs(25)), Some(2));
    }
}
