//! Figure 2: `AsyncCache::get` of 1,000 hot keys from 64 tasks (`bench hot`'s closed loop, its
//! latency histograms) with and without the near tier, the two alternating measurement by
//! measurement, while another writer rewrites keys k0, k100, ..., k900 (1% of them) through a
//! sync `Cache` of its own: a second process (this binary's hidden `near-writer`) or a thread
//! of this process, its cache with or without a near tier (`--writer`). The near hit ratio is the cache's own counters'; the writes
//! are memcached's `cmd_set` over the measurement. Each get is followed by
//! `tokio::task::coop::consume_budget` on both sides (a yield every 128 calls). The latencies
//! are in the JSON but not the table: a get's includes that yield (every 128th waits for the
//! other tasks' turns), which with near hits of ~0.1 us is what the tail is made of.

use std::fmt::Write as _;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::floor::items::BoxError;
use crate::floor::stats::{Spread, quantile};
use crate::hot::clients::AsyncGet;
use crate::hot::measure::{Timing, run_tasks};
use crate::hot::report::Stats;
use crate::near::args::{Args, Writer, WriterArgs};
use crate::near::values::{self, KEYS, Kind, Small};

/// The callers.
const TASKS: usize = 64;
/// The keys rewritten: every 100th.
const REWRITTEN: usize = KEYS / 100;
const FLAVOR: &str = "near-rewrite";
const TTL: Duration = Duration::from_secs(3600);

/// One measurement.
#[derive(Debug, Clone, Serialize)]
pub struct Measurement {
    pub round: usize,
    pub near: bool,
    pub writer: &'static str,
    pub gets_per_s: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub errors: u64,
    pub first_error: Option<String>,
    /// Over the warm-up and the counted window.
    pub near_hits: u64,
    pub near_misses: u64,
    /// The cache's `backend_errors` (a failed read is a miss under the default policy).
    pub backend_errors: u64,
    /// memcached's `cmd_set` over the warm-up and the counted window, per second.
    pub sets_per_s: f64,
}

/// A task's getter: `AsyncCache::get::<Small>` of key `i`, checked.
#[derive(Clone)]
struct Getter {
    cache: newcache::AsyncCache,
    keys: Arc<Vec<String>>,
}

impl AsyncGet for Getter {
    async fn get(&mut self, i: usize) -> Result<(), BoxError> {
        let got = self.cache.get::<Small>(&self.keys[i]).await;
        // A yield every 128 calls, as a handler's own I/O would: a near hit never yields, and
        // a task that never does keeps the engine's tasks (a near miss's read) off its worker.
        tokio::task::coop::consume_budget().await;
        values::check(got?.as_ref(), i)
    }
}

/// Key `i`'s value in its `generation`th rewrite: another name, the same size.
fn rewritten(i: usize, generation: u64) -> Small {
    Small {
        name: format!("{:>52}", format!("gen {generation} of {i}")),
        ..Small::new(i)
    }
}

/// The other writer, stopped on drop.
enum Running {
    Process(Child),
    Thread(
        Arc<AtomicBool>,
        Option<std::thread::JoinHandle<Result<u64, BoxError>>>,
    ),
}

impl Drop for Running {
    fn drop(&mut self) {
        match self {
            Running::Process(child) => {
                let _ = child.kill();
                let _ = child.wait();
            }
            Running::Thread(stop, handle) => {
                stop.store(true, Ordering::Relaxed);
                if let Some(Ok(Ok(n))) = handle.take().map(|h| h.join()) {
                    eprintln!("writer thread: {n} writes");
                }
            }
        }
    }
}

fn start_writer(addr: &str, args: &Args) -> Result<Running, BoxError> {
    Ok(match args.writer {
        Writer::Process => Running::Process(
            Command::new(std::env::current_exe()?)
                .args(["near-writer", "--server", addr, "--flavor", FLAVOR])
                .args(["--writes-per-s", &args.writes_per_s.to_string()])
                .stdin(Stdio::null())
                .spawn()?,
        ),
        Writer::Thread | Writer::ThreadNear => {
            let stop = Arc::new(AtomicBool::new(false));
            let (addr, rate, flag) = (addr.to_string(), args.writes_per_s, Arc::clone(&stop));
            let near = args.writer == Writer::ThreadNear;
            let handle = std::thread::Builder::new()
                .name("writer".into())
                .spawn(move || write_until(&addr, FLAVOR, near, rate, &flag))?;
            Running::Thread(stop, Some(handle))
        }
    })
}

/// Rewrites the 1% of keys through a sync `Cache` built here (with a near tier if `near`),
/// `rate` writes a second (0: as fast as it can), until `stop`: the number of writes.
fn write_until(
    addr: &str,
    flavor: &str,
    near: bool,
    rate: u64,
    stop: &AtomicBool,
) -> Result<u64, BoxError> {
    let builder = newcache::Cache::builder().memcached([addr]).flavor(flavor);
    let cache = match near {
        true => builder.near_cache(1 << 20).build()?,
        false => builder.build()?,
    };
    let keys = values::user_keys();
    // One pass over the rewritten keys every `every`.
    let every = match rate {
        0 => Duration::ZERO,
        r => Duration::from_secs_f64(REWRITTEN as f64 / r as f64),
    };
    let (mut written, mut next) = (0u64, Instant::now());
    for generation in 0.. {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        for i in (0..KEYS).step_by(KEYS / REWRITTEN) {
            cache.set(&keys[i], &rewritten(i, generation), TTL)?;
            written += 1;
        }
        next += every;
        let now = Instant::now();
        match next.checked_duration_since(now) {
            Some(wait) => std::thread::sleep(wait),
            // Behind by more than a second: no burst to catch up.
            None if now - next > Duration::from_secs(1) => next = now,
            None => {}
        }
    }
    Ok(written)
}

/// `bench near-writer`: [`write_until`] until killed.
pub fn writer_main(args: WriterArgs) -> Result<(), BoxError> {
    eprintln!(
        "near-writer (pid {}): rewriting {REWRITTEN} keys of {} on {}, {} writes/s",
        std::process::id(),
        args.flavor,
        args.server,
        args.writes_per_s
    );
    write_until(
        &args.server,
        &args.flavor,
        false,
        args.writes_per_s,
        &AtomicBool::new(false),
    )
    .map(drop)
}

/// memcached's `stats` counter `name`.
fn server_stat(addr: &str, name: &str) -> Result<u64, BoxError> {
    let mut sock = crate::floor::items::Blocking::connect(addr)?;
    let reply = String::from_utf8_lossy(sock.exchange(b"stats\r\n")?).into_owned();
    reply
        .lines()
        .find_map(|l| {
            l.strip_prefix(&format!("STAT {name} "))?
                .trim()
                .parse()
                .ok()
        })
        .ok_or_else(|| format!("no {name} in memcached's stats").into())
}

/// Figure 2 over the memcached at `addr`.
pub fn run(
    rt: &tokio::runtime::Runtime,
    addr: &str,
    args: &Args,
) -> Result<Vec<Measurement>, BoxError> {
    let near_ttl = Duration::from_secs_f64(args.near_ttl);
    let builder = || newcache::Cache::builder().memcached([addr]).flavor(FLAVOR);
    let (near, plain) = rt.block_on(async {
        let near = builder()
            .near_cache(64 << 20)
            .near_ttl(near_ttl)
            .build_async()?;
        Ok::<_, newcache::Error>((near, builder().build_async()?))
    })?;
    let keys = Arc::new(values::user_keys());
    rt.block_on(async {
        for (i, k) in keys.iter().enumerate() {
            plain.set(k, &Small::new(i), TTL).await?;
        }
        Ok::<_, BoxError>(())
    })?;
    let writer = start_writer(addr, args)?;
    let timing = Timing {
        warmup: Duration::from_secs_f64(args.warmup),
        duration: Duration::from_secs_f64(args.duration),
    };
    let writer_name = match args.writer {
        Writer::Process => "process",
        Writer::Thread => "thread",
        Writer::ThreadNear => "thread with a near tier",
    };
    let mut out = Vec::new();
    for round in 0..args.rounds {
        let order = match round % 2 {
            0 => [true, false],
            _ => [false, true],
        };
        for with_near in order {
            let cache = if with_near { &near } else { &plain };
            let getter = Getter {
                cache: cache.clone(),
                keys: Arc::clone(&keys),
            };
            let (before, sets_before, t0) =
                (cache.stats(), server_stat(addr, "cmd_set")?, Instant::now());
            let tally = rt.block_on(run_tasks(vec![getter; TASKS], timing, round as u64));
            let (after, sets_after) = (cache.stats(), server_stat(addr, "cmd_set")?);
            let elapsed = t0.elapsed().as_secs_f64();
            let stats = Stats::new(tally, args.duration);
            let m = Measurement {
                round,
                near: with_near,
                writer: writer_name,
                gets_per_s: stats.gets_per_s,
                p50_us: stats.p50_us,
                p99_us: stats.p99_us,
                errors: stats.errors,
                first_error: stats.first_error,
                near_hits: after.near_hits - before.near_hits,
                near_misses: after.near_misses - before.near_misses,
                backend_errors: after.backend_errors - before.backend_errors,
                sets_per_s: (sets_after - sets_before) as f64 / elapsed,
            };
            eprintln!(
                "rewrite round {}/{} near {:<5} {:>9.0} gets/s p99 {:>6.1} us  near hits {} misses {}  sets/s {:.0}  errors {}  backend errors {}",
                round + 1,
                args.rounds,
                with_near,
                m.gets_per_s,
                m.p99_us,
                m.near_hits,
                m.near_misses,
                m.sets_per_s,
                m.errors,
                m.backend_errors,
            );
            if let Some(e) = &m.first_error {
                eprintln!("  first error: {e}");
            }
            out.push(m);
        }
    }
    drop(writer);
    Ok(out)
}

/// The table: medians over rounds, and the median of the rounds' paired ratios.
pub fn table(ms: &[Measurement]) -> String {
    let side = |near: bool| ms.iter().filter(move |m| m.near == near);
    let med = |near: bool, f: fn(&Measurement) -> f64| {
        quantile(&side(near).map(f).collect::<Vec<_>>(), 0.5)
    };
    let ratios: Vec<f64> = side(true)
        .zip(side(false))
        .map(|(n, p)| n.gets_per_s / p.gets_per_s)
        .collect();
    let hit_ratio = |m: &Measurement| m.near_hits as f64 / (m.near_hits + m.near_misses) as f64;
    let hit_ratios: Vec<f64> = side(true).map(hit_ratio).collect();
    let errors: u64 = ms.iter().map(|m| m.errors).sum();
    let mut out = String::new();
    if ratios.is_empty() {
        return out;
    }
    let r = Spread::of(&ratios);
    let h = Spread::of(&hit_ratios);
    let writer = ms.first().map_or("", |m| m.writer);
    let _ = writeln!(
        out,
        "| AsyncCache::get, 64 tasks, 1,000 keys, 1% rewritten (writer: {writer}) | gets/s (median) | near hit ratio (median; IQR) | sets/s seen by memcached |"
    );
    let _ = writeln!(out, "|---|---|---|---|");
    let _ = writeln!(
        out,
        "| without near tier | {:.0} | - | {:.0} |",
        med(false, |m| m.gets_per_s),
        med(false, |m| m.sets_per_s),
    );
    let _ = writeln!(
        out,
        "| with near tier | {:.0} | {:.5} ({:.5}-{:.5}) | {:.0} |",
        med(true, |m| m.gets_per_s),
        h.median,
        h.q1,
        h.q3,
        med(true, |m| m.sets_per_s),
    );
    let _ = writeln!(
        out,
        "\nwith / without, paired by round: median {:.2}x (IQR {:.2}-{:.2}) over {} rounds; errors {errors}",
        r.median,
        r.q1,
        r.q3,
        ratios.len()
    );
    out
}
