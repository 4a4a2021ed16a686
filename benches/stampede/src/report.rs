//! A mode's JSON line: the fields of `bench_stampede.py`'s output, plus the cache's own counters.

use serde::Serialize;

use crate::args::{Args, Mode};
use crate::worker::WorkerReport;

/// One mode's result. Field names and meanings are those of `bench_stampede.py` (`peer` is
/// `newcache-rs:<mode>`), plus `mode`, `stale_served`, `early_refreshes` and `claims_won`.
#[derive(Debug, Serialize)]
pub struct Summary {
    pub bench: &'static str,
    pub run_id: String,
    pub peer: String,
    pub mode: &'static str,
    pub procs: usize,
    pub threads: usize,
    pub workers: usize,
    pub loader_ms: f64,
    pub ttl: u64,
    pub duration: f64,
    pub think_ms: f64,
    pub cold: bool,
    /// Loads counted by the memcached counter during the run.
    pub loads_total: u64,
    /// Loads the workers recorded.
    pub loads_seen: usize,
    /// Bursts of loads (loads closer than `burst_gap_s` to the previous one).
    pub expiries: usize,
    pub expected_expiries_approx: f64,
    pub loads_per_expiry: Option<f64>,
    pub loads_per_expiry_max: usize,
    pub bursts: Vec<usize>,
    pub burst_gap_s: f64,
    pub reads: u64,
    pub reads_per_s: f64,
    /// Reads in which the caller ran the loader itself.
    pub caller_loads: u64,
    /// Reads that took at least half the loader time.
    pub stalled_reads: u64,
    /// Reads that returned no (valid) value, errors included.
    pub bad_reads: u64,
    pub errors: u64,
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    pub max_ms: Option<f64>,
    pub mean_ms: Option<f64>,
    pub stale_served: u64,
    pub early_refreshes: u64,
    pub claims_won: u64,
}

impl Summary {
    /// Sums up a mode's run from all its workers' reports and the counted loads.
    pub fn new(args: &Args, mode: Mode, loads_total: u64, total: &WorkerReport) -> Self {
        let mut sorted: Vec<f64> = total.lat.iter().map(|&(_, d)| f64::from(d)).collect();
        sorted.sort_by(f64::total_cmp);
        let gap = (args.ttl as f64 / 2.0).min((3.0 * args.loader_ms / 1000.0).max(0.25));
        let bursts = cluster(&total.starts, gap);
        let mean = (!sorted.is_empty()).then(|| sorted.iter().sum::<f64>() / sorted.len() as f64);
        Summary {
            bench: "stampede",
            run_id: args.run_id.clone(),
            peer: format!("newcache-rs:{mode}"),
            mode: mode.name(),
            procs: args.procs,
            threads: args.threads,
            workers: args.procs * args.threads,
            loader_ms: args.loader_ms,
            ttl: args.ttl,
            duration: args.duration,
            think_ms: args.think_ms,
            cold: args.cold,
            loads_total,
            loads_seen: total.starts.len(),
            expiries: bursts.len(),
            expected_expiries_approx: round_to(args.duration / args.ttl as f64, 1),
            loads_per_expiry: (!bursts.is_empty())
                .then(|| round_to(loads_total as f64 / bursts.len() as f64, 2)),
            loads_per_expiry_max: bursts.iter().copied().max().unwrap_or(0),
            burst_gap_s: gap,
            bursts,
            reads: total.reads,
            reads_per_s: round_to(total.reads as f64 / args.duration, 1),
            caller_loads: total.caller_loads,
            stalled_reads: total.stalled,
            bad_reads: total.bad,
            errors: total.errors,
            p50_ms: ms(percentile(&sorted, 0.5)),
            p99_ms: ms(percentile(&sorted, 0.99)),
            max_ms: ms(sorted.last().copied()),
            mean_ms: ms(mean),
            stale_served: total.stale_served,
            early_refreshes: total.early_refreshes,
            claims_won: total.claims_won,
        }
    }
}

/// `x` rounded to `digits` decimals.
fn round_to(x: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    (x * scale).round() / scale
}

/// Seconds to milliseconds, rounded to 2 decimals.
fn ms(seconds: Option<f64>) -> Option<f64> {
    seconds.map(|s| round_to(s * 1000.0, 2))
}

/// Groups load start times into expiry bursts: a new burst when the gap to the previous load is
/// more than `gap`. Returns the burst sizes.
fn cluster(starts: &[f64], gap: f64) -> Vec<usize> {
    let mut sorted = starts.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mut sizes: Vec<usize> = Vec::new();
    let mut prev: Option<f64> = None;
    for t in sorted {
        match sizes.last_mut() {
            Some(last) if prev.is_some_and(|p| t - p <= gap) => *last += 1,
            _ => sizes.push(1),
        }
        prev = Some(t);
    }
    sizes
}

/// The `q` quantile of sorted values (nearest rank, as the Python script's `pct`).
fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    let last = sorted.len().checked_sub(1)?;
    let i = ((q * last as f64).round() as usize).min(last);
    Some(sorted[i])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bursts_split_on_gaps_larger_than_the_gap() {
        assert_eq!(cluster(&[], 0.25), Vec::<usize>::new());
        assert_eq!(cluster(&[5.0, 1.0, 1.1, 1.2, 3.0, 3.25], 0.25), [3, 2, 1]);
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        assert_eq!(percentile(&[], 0.5), None);
        let v: Vec<f64> = (0..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), Some(50.0));
        assert_eq!(percentile(&v, 0.99), Some(99.0));
        assert_eq!(percentile(&[7.0], 0.99), Some(7.0));
    }

    #[test]
    fn milliseconds_keep_two_decimals() {
        assert_eq!(ms(Some(0.050_266)), Some(50.27));
        assert_eq!(ms(None), None);
    }
}
