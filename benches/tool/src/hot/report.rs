//! The JSON line of one measurement, and the table of medians over rounds.

use std::fmt::Write;

use serde::Serialize;

use crate::hot::measure::Tally;

/// One (client, concurrency, round): a JSON line on stdout.
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    pub client: &'static str,
    pub concurrency: usize,
    /// 0-based.
    pub round: usize,
    /// The position within the round's order of clients at this concurrency (0-based).
    pub seq: usize,
    pub runtime: &'static str,
    pub workers: usize,
    pub pools: &'static str,
    /// Unix time at which the callers started (the warm-up's start).
    pub started_unix_s: f64,
    pub duration_s: f64,
    /// Successful GETs in the counted window.
    pub gets: u64,
    pub gets_per_s: f64,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
    pub errors: u64,
    pub first_error: Option<String>,
}

/// The fields of a [`Record`] that its [`Tally`] gives.
pub struct Stats {
    pub gets: u64,
    pub gets_per_s: f64,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
    pub errors: u64,
    pub first_error: Option<String>,
}

impl Stats {
    pub fn new(tally: Tally, duration_s: f64) -> Stats {
        let h = &tally.hist;
        let us = |ns: u64| ns as f64 / 1000.0;
        let empty = h.is_empty();
        let q = |q: f64| {
            if empty {
                0.0
            } else {
                us(h.value_at_quantile(q))
            }
        };
        Stats {
            gets: h.len(),
            gets_per_s: h.len() as f64 / duration_s,
            mean_us: if empty { 0.0 } else { h.mean() / 1000.0 },
            p50_us: q(0.5),
            p99_us: q(0.99),
            p999_us: q(0.999),
            max_us: if empty { 0.0 } else { us(h.max()) },
            errors: tally.errors,
            first_error: tally.first_error,
        }
    }
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    match xs.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => xs[n / 2],
        n => (xs[n / 2 - 1] + xs[n / 2]) / 2.0,
    }
}

/// Medians over rounds per (concurrency, client), in the order the records first appear
/// (concurrency as given, clients in round 0's order); errors are summed.
pub fn table(records: &[Record]) -> String {
    let mut rows: Vec<(usize, &str)> = Vec::new();
    for r in records {
        if !rows.contains(&(r.concurrency, r.client)) {
            rows.push((r.concurrency, r.client));
        }
    }
    let mut out = String::new();
    if let Some(r) = records.first() {
        let rounds = records.iter().map(|r| r.round).max().unwrap_or(0) + 1;
        let workers = match r.runtime {
            "multi-thread" => format!(" ({} workers)", r.workers),
            _ => String::new(),
        };
        let _ = writeln!(
            out,
            "medians over {rounds} round(s) of {} s; runtime {}{workers}; pools {}",
            r.duration_s, r.runtime, r.pools
        );
    }
    let _ = writeln!(
        out,
        "| client | conc | gets/s | p50 us | p99 us | p999 us | errors |\n|---|---:|---:|---:|---:|---:|---:|"
    );
    for (conc, client) in rows {
        let of = |f: fn(&Record) -> f64| {
            let xs = records
                .iter()
                .filter(|r| r.concurrency == conc && r.client == client);
            median(xs.map(f).collect())
        };
        let errors: u64 = records
            .iter()
            .filter(|r| r.concurrency == conc && r.client == client)
            .map(|r| r.errors)
            .sum();
        let _ = writeln!(
            out,
            "| {client} | {conc} | {:.0} | {:.1} | {:.1} | {:.1} | {errors} |",
            of(|r| r.gets_per_s),
            of(|r| r.p50_us),
            of(|r| r.p99_us),
            of(|r| r.p999_us),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(client: &'static str, concurrency: usize, round: usize, gets_per_s: f64) -> Record {
        Record {
            client,
            concurrency,
            round,
            seq: 0,
            runtime: "multi-thread",
            workers: 2,
            pools: "per-task",
            started_unix_s: 0.0,
            duration_s: 5.0,
            gets: 0,
            gets_per_s,
            mean_us: 0.0,
            p50_us: gets_per_s / 1000.0,
            p99_us: 0.0,
            p999_us: 0.0,
            max_us: 0.0,
            errors: round as u64,
            first_error: None,
        }
    }

    #[test]
    fn medians() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0]), 2.5);
        assert!(median(vec![]).is_nan());
    }

    #[test]
    fn one_row_per_client_and_concurrency() {
        let records = [
            record("bare", 1, 0, 1000.0),
            record("a", 1, 0, 3000.0),
            record("a", 1, 1, 5000.0),
            record("bare", 1, 1, 2000.0),
            record("bare", 64, 1, 9000.0),
        ];
        let t = table(&records);
        let lines: Vec<&str> = t.lines().collect();
        let head =
            "medians over 2 round(s) of 5 s; runtime multi-thread (2 workers); pools per-task";
        assert_eq!(lines[0], head);
        assert_eq!(lines[3], "| bare | 1 | 1500 | 1.5 | 0.0 | 0.0 | 1 |");
        assert_eq!(lines[4], "| a | 1 | 4000 | 4.0 | 0.0 | 0.0 | 1 |");
        assert_eq!(lines[5], "| bare | 64 | 9000 | 9.0 | 0.0 | 0.0 | 1 |");
        assert_eq!(lines.len(), 6);
    }
}
