//! Figure 3: memcached killed for `--outage-s` seconds (its items lost; an empty one restarted
//! on the same port) while 64 tasks call `AsyncCache::get_or_set_with` on 1,000 hot keys, with
//! and without the near tier, `serve_stale_on_error` on in both. The loader counts its calls
//! (the "database queries") and takes `--loader-ms`. Runs alternate with and without; each
//! builds its cache afresh (a version of its own) and fills it by `set` before the clock starts.
//! Each call is followed by `tokio::task::coop::consume_budget` (a yield every 128 calls), as a
//! handler's own I/O would yield: a near hit never does.

use std::convert::Infallible;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::floor::items::BoxError;
use crate::floor::stats::quantile;
use crate::hot::server::Memcached;
use crate::near::args::Args;
use crate::near::values::{self, KEYS, Kind, Small};

const TASKS: usize = 64;
const FLAVOR: &str = "near-outage";
/// The values' ttl: longer than a run, so that only the outage makes loads.
const TTL: Duration = Duration::from_secs(120);
/// `serve_stale_on_error`'s bound.
const STALE_MAX_AGE: Duration = Duration::from_secs(300);

/// One second of a run, as the callers saw it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Second {
    pub loads: u64,
    pub gets: u64,
    pub errors: u64,
    /// The cache's counters over the second.
    pub near_hits: u64,
    pub near_outage_served: u64,
    pub backend_errors: u64,
    /// `AsyncCache::ping` at the end of the second: `None` if it answered.
    pub ping_error: Option<String>,
}

/// One run: its seconds, when the server was down, and the cache's counters over it.
#[derive(Debug, Clone, Serialize)]
pub struct Timeline {
    pub run: usize,
    pub near: bool,
    pub seconds: Vec<Second>,
    /// The seconds of `seconds` the server was down (killed at the first one's start,
    /// restarted at the end of the last).
    pub down: (usize, usize),
    pub near_hits: u64,
    pub near_outage_served: u64,
    pub stale_served: u64,
    pub first_error: Option<String>,
}

impl Timeline {
    fn per_s(&self, range: std::ops::Range<usize>, f: fn(&Second) -> u64) -> f64 {
        let n = range.len().max(1) as f64;
        self.seconds[range].iter().map(f).sum::<u64>() as f64 / n
    }
}

#[derive(Default)]
struct Counts {
    loads: AtomicU64,
    gets: AtomicU64,
    errors: AtomicU64,
    first_error: std::sync::Mutex<Option<String>>,
}

impl Counts {
    fn second(&self, cache: &newcache::AsyncCache, last: &mut Second) -> Second {
        let stats = cache.stats();
        let now = Second {
            loads: self.loads.load(Ordering::Relaxed),
            gets: self.gets.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            near_hits: stats.near_hits,
            near_outage_served: stats.near_outage_served,
            backend_errors: stats.backend_errors,
            ping_error: None,
        };
        let s = Second {
            loads: now.loads - last.loads,
            gets: now.gets - last.gets,
            errors: now.errors - last.errors,
            near_hits: now.near_hits - last.near_hits,
            near_outage_served: now.near_outage_served - last.near_outage_served,
            backend_errors: now.backend_errors - last.backend_errors,
            ping_error: None,
        };
        *last = now;
        s
    }
}

/// One caller: `get_or_set_with` of random keys until `stop`.
async fn caller(
    cache: newcache::AsyncCache,
    keys: Arc<Vec<String>>,
    counts: Arc<Counts>,
    stop: Arc<AtomicBool>,
    loader: Duration,
    mut x: u64,
) {
    while !stop.load(Ordering::Relaxed) {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let i = ((x >> 33) % KEYS as u64) as usize;
        let loads = &counts.loads;
        let got = cache
            .get_or_set_with(&keys[i], TTL, || async move {
                loads.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(loader).await;
                Ok::<_, Infallible>(Small::new(i))
            })
            .await;
        let checked = match got {
            Ok(v) => values::check(Some(&v), i),
            Err(e) => Err(e.into()),
        };
        // As a call of a tokio resource would: a near hit is ready at once, and a task that
        // never yields would keep the engine's tasks (the probe of the server that came
        // back) off its worker.
        tokio::task::coop::consume_budget().await;
        match checked {
            Ok(()) => counts.gets.fetch_add(1, Ordering::Relaxed),
            Err(e) => {
                let mut first = counts.first_error.lock().unwrap_or_else(|e| e.into_inner());
                first.get_or_insert_with(|| e.to_string());
                counts.errors.fetch_add(1, Ordering::Relaxed)
            }
        };
    }
}

fn one_run(
    rt: &tokio::runtime::Runtime,
    server: &mut Memcached,
    args: &Args,
    run: usize,
    near: bool,
) -> Result<Timeline, BoxError> {
    let addr = server.addr().to_string();
    let cache = rt.block_on(async {
        let b = newcache::Cache::builder()
            .memcached([addr.as_str()])
            .flavor(FLAVOR)
            .version(run as u64 + 1)
            .serve_stale_on_error(STALE_MAX_AGE);
        match near {
            true => b.near_cache(64 << 20).build_async(),
            false => b.build_async(),
        }
    })?;
    let keys = Arc::new(values::user_keys());
    rt.block_on(async {
        for (i, k) in keys.iter().enumerate() {
            cache.set(k, &Small::new(i), TTL).await?;
        }
        Ok::<_, BoxError>(())
    })?;
    let (counts, stop) = (
        Arc::new(Counts::default()),
        Arc::new(AtomicBool::new(false)),
    );
    let before = cache.stats();
    let loader = Duration::from_secs_f64(args.loader_ms / 1e3);
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            rt.spawn(caller(
                cache.clone(),
                Arc::clone(&keys),
                Arc::clone(&counts),
                Arc::clone(&stop),
                loader,
                (run * TASKS + t) as u64,
            ))
        })
        .collect();
    let (calm, down) = (args.calm_s as usize, args.outage_s as usize);
    let total = 2 * calm + down;
    let (t0, mut seconds) = (Instant::now(), Vec::new());
    let mut last = Second::default();
    counts.second(&cache, &mut last);
    for s in 0..total {
        if s == calm {
            server.kill()?;
            eprintln!("outage run {run} near {near}: memcached killed");
        }
        if s == calm + down {
            server.restart()?;
            eprintln!("outage run {run} near {near}: memcached restarted (empty)");
        }
        let tick = t0 + Duration::from_secs(s as u64 + 1);
        std::thread::sleep(tick.saturating_duration_since(Instant::now()));
        let mut second = counts.second(&cache, &mut last);
        second.ping_error = rt.block_on(cache.ping()).err().map(|e| e.to_string());
        seconds.push(second);
    }
    stop.store(true, Ordering::Relaxed);
    let (tail, stopped) = (counts.second(&cache, &mut last), Instant::now());
    rt.block_on(async {
        for t in tasks {
            t.await?;
        }
        Ok::<_, BoxError>(())
    })?;
    let after = cache.stats();
    let first_error = counts
        .first_error
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take();
    let timeline = Timeline {
        run,
        near,
        seconds,
        down: (calm, calm + down),
        near_hits: after.near_hits - before.near_hits,
        near_outage_served: after.near_outage_served - before.near_outage_served,
        stale_served: after.stale_served - before.stale_served,
        first_error,
    };
    let per = |f: fn(&Second) -> u64| {
        timeline
            .seconds
            .iter()
            .map(|s| f(s).to_string())
            .collect::<Vec<_>>()
            .join(" ")
    };
    eprintln!(
        "outage run {run} near {near}: per second: loads [{}]; gets [{}]; errors [{}]; near hits [{}]; near outage served [{}]; backend errors [{}]; after the last second, until the tasks stopped ({:.1} s): {tail:?}; over the run: near hits {}, near outage served {}, stale served {}",
        per(|s| s.loads),
        per(|s| s.gets),
        per(|s| s.errors),
        per(|s| s.near_hits),
        per(|s| s.near_outage_served),
        per(|s| s.backend_errors),
        stopped.elapsed().as_secs_f64(),
        timeline.near_hits,
        timeline.near_outage_served,
        timeline.stale_served,
    );
    if let Some(e) = &timeline.first_error {
        eprintln!("  first error: {e}");
    }
    for (i, s) in timeline.seconds.iter().enumerate() {
        if let Some(e) = &s.ping_error {
            eprintln!("  ping at the end of second {i}: {e}");
        }
    }
    Ok(timeline)
}

/// Figure 3 on `server` (killed and restarted by each run).
pub fn run(
    rt: &tokio::runtime::Runtime,
    server: &mut Memcached,
    args: &Args,
) -> Result<Vec<Timeline>, BoxError> {
    let mut out = Vec::new();
    for run in 0..args.outage_runs {
        let order = match run % 2 {
            0 => [true, false],
            _ => [false, true],
        };
        for near in order {
            out.push(one_run(rt, server, args, out.len(), near)?);
        }
    }
    Ok(out)
}

/// The table: per side, the median over runs of loads/s before and while the server is down,
/// the loads from its restart to the end, gets/s while it is down.
pub fn table(ts: &[Timeline], args: &Args) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| get_or_set_with, 64 tasks, 1,000 keys, loader {} ms, memcached down {} s | loads/s before | loads/s while down | loads from the restart (empty) to the end ({} s) | gets/s while down | errors while down | near outage served (run) | runs |",
        args.loader_ms, args.outage_s, args.calm_s
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|");
    for near in [false, true] {
        let side: Vec<&Timeline> = ts.iter().filter(|t| t.near == near).collect();
        if side.is_empty() {
            continue;
        }
        let med = |f: &dyn Fn(&Timeline) -> f64| {
            quantile(&side.iter().map(|t| f(t)).collect::<Vec<_>>(), 0.5)
        };
        let before = |t: &Timeline| t.per_s(0..t.down.0, |s| s.loads);
        let during = |t: &Timeline| t.per_s(t.down.0..t.down.1, |s| s.loads);
        let after = |t: &Timeline| {
            let n = t.seconds.len() - t.down.1;
            t.per_s(t.down.1..t.seconds.len(), |s| s.loads) * n as f64
        };
        let gets = |t: &Timeline| t.per_s(t.down.0..t.down.1, |s| s.gets);
        let errors = |t: &Timeline| {
            let n = t.down.1 - t.down.0;
            t.per_s(t.down.0..t.down.1, |s| s.errors) * n as f64
        };
        let served = |t: &Timeline| t.near_outage_served as f64;
        let _ = writeln!(
            out,
            "| {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {} |",
            match near {
                true => "with near tier",
                false => "without near tier",
            },
            med(&before),
            med(&during),
            med(&after),
            med(&gets),
            med(&errors),
            med(&served),
            side.len(),
        );
    }
    out
}
