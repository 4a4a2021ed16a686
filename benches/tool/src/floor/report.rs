//! The table on stdout and the JSON document of `--json`.

use std::fmt::Write as _;

use serde::Serialize;

use crate::floor::stats::Row;

/// What the JSON holds besides the rows: how it was run and on what.
#[derive(Debug, Serialize)]
pub struct Run {
    pub command: String,
    pub started_unix_s: f64,
    pub rounds: usize,
    pub ops: usize,
    pub slices: usize,
    /// Whether a thread kept one core busy for the run (`--busy-core`).
    pub busy_core: bool,
    /// The memcached version (the memcached paths).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memcached: Option<String>,
    pub machine: Machine,
    pub items: ItemSizes,
    /// The memcached paths' rows.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rows: Vec<Row>,
    /// With `--redis-server-bin` / `--redis`: each server's rows.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub redis: Vec<RedisRows>,
}

/// One Redis / Valkey server's rows.
#[derive(Debug, Serialize)]
pub struct RedisRows {
    /// `redis 7.0.15`, `valkey 9.1.2`.
    pub server: String,
    pub url: String,
    pub rows: Vec<Row>,
}

/// The machine and its load (others may be building on it).
#[derive(Debug, Serialize)]
pub struct Machine {
    pub cpus: usize,
    pub cpu_model: String,
    pub loadavg_start: String,
    pub loadavg_end: String,
}

/// The sizes of the mission's items as stored.
#[derive(Debug, Serialize)]
pub struct ItemSizes {
    pub key_bytes: usize,
    pub value_encoded_bytes: Vec<usize>,
    pub stored_bytes: Vec<usize>,
}

/// `/proc/loadavg`, or `?`.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg").map_or_else(|_| "?".into(), |s| s.trim().into())
}

/// The first `model name` of `/proc/cpuinfo`, or `?`.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "?".into())
}

fn figure(x: f64, unit: &str) -> String {
    match unit {
        "gets/s" => format!("{x:.0} gets/s"),
        unit => format!("{x:.2} {unit}"),
    }
}

/// The table: one line per row, Markdown.
pub fn table(rows: &[Row], rounds: usize) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| path (public API) | floor | client/floor, median of {rounds} rounds | IQR | client (median) | floor (median) |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|");
    for r in rows {
        let _ = writeln!(
            out,
            "| {} | {} | {:.3} | {:.3}-{:.3} | {} | {} |",
            r.path,
            r.floor,
            r.ratio.median,
            r.ratio.q1,
            r.ratio.q3,
            figure(r.client_median, r.unit),
            figure(r.floor_median, r.unit),
        );
    }
    let _ = writeln!(
        out,
        "\nRatios of time (us) and of p99: above 1 = slower than the floor. Ratio of gets/s: above 1 = more gets/s than the floor."
    );
    out
}
