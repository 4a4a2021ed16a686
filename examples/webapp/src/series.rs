//! The per-second series (`GET /series`): requests and database queries in each second, sampled
//! by the service itself from its counters (wrk reports only totals).

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// How many samples are kept: one hour at one a second.
const KEEP: usize = 3_600;

/// One second of the service's life.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// When the second ended, in seconds since the Unix epoch (so that the series of several
    /// processes line up).
    pub unix_secs: f64,
    /// Requests answered in it.
    pub requests: u64,
    /// Database queries run in it.
    pub db_queries: u64,
}

/// The body of `GET /series`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Series {
    /// The port of the process that recorded it.
    pub port: u16,
    /// The cache's fresh lifetime, in seconds.
    pub ttl_secs: u64,
    /// The sampling interval, in milliseconds (1,000).
    pub interval_ms: u64,
    /// The samples, oldest first (at most the last hour).
    pub samples: Vec<Sample>,
}

/// The samples taken so far, and the counters' values at the last one.
#[derive(Debug, Default)]
pub(crate) struct Recorder {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    last: Option<(u64, u64)>,
    samples: VecDeque<Sample>,
}

impl Recorder {
    pub const INTERVAL: Duration = Duration::from_secs(1);

    /// Records the counters' current totals: the first call only sets the baseline.
    pub fn sample(&self, requests: u64, db_queries: u64) {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64();
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((r, q)) = state.last {
            if state.samples.len() == KEEP {
                state.samples.pop_front();
            }
            state.samples.push_back(Sample {
                unix_secs: now,
                requests: requests.saturating_sub(r),
                db_queries: db_queries.saturating_sub(q),
            });
        }
        state.last = Some((requests, db_queries));
    }

    pub fn samples(&self) -> Vec<Sample> {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.samples.iter().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_differences_of_totals_after_a_baseline() {
        let r = Recorder::default();
        r.sample(10, 1);
        assert!(r.samples().is_empty());
        r.sample(15, 1);
        r.sample(15, 4);
        let got: Vec<(u64, u64)> = r
            .samples()
            .iter()
            .map(|s| (s.requests, s.db_queries))
            .collect();
        assert_eq!(got, [(5, 0), (0, 3)]);
    }

    #[test]
    fn keeps_the_last_hour() {
        let r = Recorder::default();
        for i in 0..=(KEEP as u64 + 5) {
            r.sample(i, 0);
        }
        assert_eq!(r.samples().len(), KEEP);
    }
}
