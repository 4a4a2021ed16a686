//! The thundering-herd benchmark: the scenario of `../shared/peers/bench_stampede.py`, with the same
//! rules and the same JSON fields, for newcache's modes.
//!
//! ```text
//! cargo run --release -p newcache-stampede -- --servers 127.0.0.1:PORT --procs 4 --threads 16 \
//!     --loader-ms 50 --ttl 2 --duration 10 [--cold] [--mode MODE ...] [--plot FILE.png] --json
//! ```
//!
//! `procs` OS processes x `threads` threads read ONE hot key in a loop: a timed read, then a
//! `--think-ms` pause (default 10 ms), until `--duration` runs out. The loader sleeps `--loader-ms`,
//! then counts itself with a memcached `incr` on a separate key, so every load is counted once
//! across processes. Before the workers start the key is warmed through the same mode (not
//! counted); `--cold` skips that, so the first burst is a cold-start herd. The worker processes
//! are this program again, run with `--worker`.
//!
//! Modes (see [`args::Mode`]): `naive`, `newcache` (django-newcache's algorithm re-implemented),
//! `default`, `early` and `background` (newcache's).
//!
//! One JSON line per mode (fields as the Python script's; `peer` is `newcache-rs:<mode>`), plus
//! `stale_served`, `early_refreshes` and `claims_won` from the cache's own stats.

mod args;
mod modes;
mod plot;
mod report;
mod worker;

use std::error::Error;
use std::time::Duration;

use args::{Args, Mode};
use modes::{Loader, OriginalNewcache, Reader};
use report::Summary;
use worker::WorkerReport;

/// One mode's run: its JSON line and the samples the plot draws.
pub struct ModeRun {
    pub mode: Mode,
    pub summary: Summary,
    /// (seconds since the start, latency seconds) per read.
    pub lat: Vec<(f32, f32)>,
    /// Unix seconds at which loads started.
    pub starts: Vec<f64>,
    /// Unix seconds at which the workers started reading.
    pub t0: f64,
}

fn main() -> Result<(), Box<dyn Error>> {
    let args = Args::from_command_line();
    if args.worker {
        return worker::run(&args);
    }
    let mut runs = Vec::new();
    for &mode in &args.modes {
        let run = run_mode(&args, mode)?;
        let json = serde_json::to_string(&run.summary)?;
        if args.json {
            println!("{json}");
        } else {
            println!("{mode}: {json}");
        }
        runs.push(run);
    }
    if let Some(path) = &args.plot {
        plot::write(path, &args, &runs)?;
        eprintln!("plot written to {}", path.display());
    }
    Ok(())
}

/// Runs one mode: a fresh hot key and load counter, the optional warm-up, then the workers.
fn run_mode(args: &Args, mode: Mode) -> Result<ModeRun, Box<dyn Error>> {
    let key = format!("stampede:{mode}:{}:{}", args.run_id, std::process::id());
    let counter = modes::counter_key(&key);
    let cache = modes::cache_for(args, mode)?;
    cache.set_counter(&counter, 0, Duration::from_secs(3600))?;
    if !args.cold {
        // Warm the key through the same mode (this load is not counted).
        let original = match mode {
            Mode::Newcache => Some(OriginalNewcache::new(args, &cache, &key)?),
            _ => None,
        };
        let loader = Loader::new(&cache, &key, args.loader_ms);
        // The async modes warm through the sync API (same keys, same envelope).
        let warm = match mode {
            Mode::Async => Mode::Default,
            Mode::AsyncBackground => Mode::Background,
            other => other,
        };
        let reader = Reader {
            mode: warm,
            cache: &cache,
            key: &key,
            ttl: Duration::from_secs(args.ttl),
            loader: &loader,
            original: original.as_ref(),
        };
        let value = reader.read()?;
        assert_eq!(value.id, 1);
    }
    let baseline = cache.get_counter(&counter)?.unwrap_or(0);
    let start_at_ms = modes::unix_ms() + 300 + 50 * args.procs as u64;
    let reports = worker::run_all(args, mode, &key, start_at_ms)?;
    let loads_total = cache.get_counter(&counter)?.unwrap_or(0) - baseline;
    let mut total = WorkerReport::default();
    for report in reports {
        total.merge(report);
    }
    Ok(ModeRun {
        mode,
        summary: Summary::new(args, mode, loads_total, &total),
        lat: total.lat,
        starts: total.starts,
        t0: start_at_ms as f64 / 1000.0,
    })
}
