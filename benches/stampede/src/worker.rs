//! The worker processes: the parent re-executes itself with `--worker` once per process, and each
//! worker prints one `REPORT {json}` line on stdout.

use std::error::Error;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::{Barrier, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::args::{Args, Mode};
use crate::modes::{self, Loader, OriginalNewcache, Reader};

const REPORT_PREFIX: &str = "REPORT ";

/// What worker processes (or the threads of one) measured.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct WorkerReport {
    pub reads: u64,
    pub caller_loads: u64,
    pub stalled: u64,
    pub bad: u64,
    pub errors: u64,
    /// (seconds since start, latency seconds) per read.
    pub lat: Vec<(f32, f32)>,
    /// Unix seconds at which the loads started.
    pub starts: Vec<f64>,
    /// The cache's own counters (zero for naive/newcache).
    pub stale_served: u64,
    pub early_refreshes: u64,
    pub claims_won: u64,
}

impl WorkerReport {
    /// Adds `other`'s counts and samples to these.
    pub fn merge(&mut self, other: WorkerReport) {
        self.reads += other.reads;
        self.caller_loads += other.caller_loads;
        self.stalled += other.stalled;
        self.bad += other.bad;
        self.errors += other.errors;
        self.lat.extend(other.lat);
        self.starts.extend(other.starts);
        self.stale_served += other.stale_served;
        self.early_refreshes += other.early_refreshes;
        self.claims_won += other.claims_won;
    }
}

/// Starts `args.procs` worker processes reading `key` in `mode` from `start_at_ms` (unix ms) on,
/// and collects their reports.
pub fn run_all(
    args: &Args,
    mode: Mode,
    key: &str,
    start_at_ms: u64,
) -> Result<Vec<WorkerReport>, Box<dyn Error>> {
    let exe = std::env::current_exe()?;
    let children = (0..args.procs)
        .map(|_| {
            let mut cmd = Command::new(&exe);
            cmd.args(["--worker", "--mode", mode.name(), "--key", key]);
            match &args.redis {
                _ if !args.redis_cluster.is_empty() => {
                    cmd.args(["--redis-cluster", &args.redis_cluster.join(",")])
                }
                Some(url) => cmd.args(["--redis", url]),
                None => cmd.args(["--servers", &args.servers.join(",")]),
            };
            cmd.args(["--threads", &args.threads.to_string()])
                .args(["--loader-ms", &args.loader_ms.to_string()])
                .args(["--ttl", &args.ttl.to_string()])
                .args(["--duration", &args.duration.to_string()])
                .args(["--think-ms", &args.think_ms.to_string()])
                .args(["--start-at-ms", &start_at_ms.to_string()])
                .stdout(Stdio::piped())
                .spawn()
        })
        .collect::<Result<Vec<_>, _>>()?;
    children.into_iter().map(collect).collect()
}

/// Reads a worker's report from its stdout and waits for it to exit.
fn collect(mut child: Child) -> Result<WorkerReport, Box<dyn Error>> {
    let stdout = child.stdout.take().ok_or("no worker stdout")?;
    let mut report = None;
    for line in BufReader::new(stdout).lines() {
        if let Some(json) = line?.strip_prefix(REPORT_PREFIX) {
            report = Some(serde_json::from_str(json)?);
        }
    }
    let status = child.wait()?;
    report.ok_or_else(|| format!("a worker failed: {status}").into())
}

/// The body of a worker process (`--worker`): `args.threads` readers of `args.key` in the single
/// `--mode`, from `--start-at-ms` for `--duration` seconds.
pub fn run(args: &Args) -> Result<(), Box<dyn Error>> {
    let mode = *args.modes.first().ok_or("a worker needs --mode")?;
    if matches!(mode, Mode::Async | Mode::AsyncBackground) {
        return run_async(args, mode);
    }
    let cache = modes::cache_for(args, mode)?;
    let original = match mode {
        Mode::Newcache => Some(OriginalNewcache::new(args, &cache, &args.key)?),
        _ => None,
    };
    let loader = Loader::new(&cache, &args.key, args.loader_ms);
    let reader = Reader {
        mode,
        cache: &cache,
        key: &args.key,
        ttl: Duration::from_secs(args.ttl),
        loader: &loader,
        original: original.as_ref(),
    };
    let report = Mutex::new(WorkerReport::default());
    let ready = Barrier::new(args.threads);
    let start_at = UNIX_EPOCH + Duration::from_millis(args.start_at_ms);
    std::thread::scope(|s| {
        for _ in 0..args.threads {
            s.spawn(|| {
                ready.wait();
                if let Ok(wait) = start_at.duration_since(SystemTime::now()) {
                    std::thread::sleep(wait);
                }
                let mine = read_loop(args, &reader);
                report
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .merge(mine);
            });
        }
    });
    // Background refreshes may still be finishing: give them the loader time.
    std::thread::sleep(Duration::from_secs_f64(args.loader_ms / 1000.0 + 0.05));
    let mut report = report.into_inner().unwrap_or_else(PoisonError::into_inner);
    report.starts = loader.starts();
    if !matches!(mode, Mode::Naive | Mode::Newcache) {
        let stats = cache.stats();
        report.stale_served = stats.stale_served;
        report.early_refreshes = stats.early_refreshes;
        report.claims_won = stats.claims_won;
    }
    let mut out = std::io::stdout().lock();
    writeln!(out, "{REPORT_PREFIX}{}", serde_json::to_string(&report)?)?;
    Ok(())
}

/// The body of a worker process in an async mode: `args.threads` tasks on a 2-worker runtime.
fn run_async(args: &Args, mode: Mode) -> Result<(), Box<dyn Error>> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let report = rt.block_on(async {
        let cache = modes::async_cache_for(args)?;
        let loader = modes::AsyncLoader::new(&cache, &args.key, args.loader_ms);
        let start_at = UNIX_EPOCH + Duration::from_millis(args.start_at_ms);
        if let Ok(wait) = start_at.duration_since(SystemTime::now()) {
            tokio::time::sleep(wait).await;
        }
        let tasks: Vec<_> = (0..args.threads)
            .map(|_| {
                let (args, cache, loader) = (args.clone(), cache.clone(), loader.clone());
                tokio::spawn(async move { read_loop_async(&args, mode, &cache, &loader).await })
            })
            .collect();
        let mut report = WorkerReport::default();
        for t in tasks {
            report.merge(t.await?);
        }
        // Background refreshes may still be finishing.
        cache.shutdown().await;
        report.starts = loader.starts();
        let stats = cache.stats();
        report.stale_served = stats.stale_served;
        report.early_refreshes = stats.early_refreshes;
        report.claims_won = stats.claims_won;
        Ok::<_, Box<dyn Error>>(report)
    })?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{REPORT_PREFIX}{}", serde_json::to_string(&report)?)?;
    Ok(())
}

/// One reader task: timed reads, each followed by the think time, until the duration is up.
async fn read_loop_async(
    args: &Args,
    mode: Mode,
    cache: &newcache::AsyncCache,
    loader: &modes::AsyncLoader,
) -> WorkerReport {
    let stall = args.loader_ms / 2000.0;
    let think = Duration::from_secs_f64(args.think_ms / 1000.0);
    let ttl = Duration::from_secs(args.ttl);
    let t_start = Instant::now();
    let deadline = t_start + Duration::from_secs_f64(args.duration);
    let mut mine = WorkerReport::default();
    while Instant::now() < deadline {
        let loaded = std::sync::atomic::AtomicBool::new(false);
        let t0 = Instant::now();
        let value = modes::read_async(mode, cache, &args.key, ttl, loader, &loaded).await;
        let d = t0.elapsed().as_secs_f64();
        mine.lat
            .push(((t0 - t_start).as_secs_f64() as f32, d as f32));
        mine.reads += 1;
        mine.caller_loads += u64::from(loaded.load(std::sync::atomic::Ordering::Relaxed));
        mine.stalled += u64::from(d >= stall);
        match value {
            Ok(v) if v.id == 1 => {}
            Ok(_) => mine.bad += 1,
            Err(_) => {
                mine.errors += 1;
                mine.bad += 1;
            }
        }
        tokio::time::sleep(think).await;
    }
    mine
}

/// One reader thread: timed reads, each followed by the think time, until the duration is up.
fn read_loop(args: &Args, reader: &Reader<'_>) -> WorkerReport {
    let stall = args.loader_ms / 2000.0;
    let think = Duration::from_secs_f64(args.think_ms / 1000.0);
    let t_start = Instant::now();
    let deadline = t_start + Duration::from_secs_f64(args.duration);
    let mut mine = WorkerReport::default();
    while Instant::now() < deadline {
        modes::clear_loaded();
        let t0 = Instant::now();
        let value = reader.read();
        let d = t0.elapsed().as_secs_f64();
        mine.lat
            .push(((t0 - t_start).as_secs_f64() as f32, d as f32));
        mine.reads += 1;
        mine.caller_loads += u64::from(modes::loaded());
        mine.stalled += u64::from(d >= stall);
        match value {
            Ok(v) if v.id == 1 => {}
            Ok(_) => mine.bad += 1,
            Err(_) => {
                mine.errors += 1;
                mine.bad += 1;
            }
        }
        std::thread::sleep(think);
    }
    mine
}
