//! The thundering-herd benchmark: the scenario of `../shared/peers/bench_stampede.py`, with the same
//! rules and the same JSON fields, for newcache's modes.
//!
//! ```text
//! cargo run --release --example stampede -- --servers 127.0.0.1:PORT --procs 4 --threads 16 \
//!     --loader-ms 50 --ttl 2 --duration 10 [--cold] [--mode MODE ...] [--plot FILE.png] --json
//! ```
//!
//! `procs` OS processes x `threads` threads read ONE hot key in a loop: a timed read, then a
//! `--think-ms` pause (default 10 ms), until `--duration` runs out. The loader sleeps `--loader-ms`,
//! then counts itself with a memcached `incr` on a separate key, so every load is counted once
//! across processes. Before the workers start the key is warmed through the same mode (not
//! counted); `--cold` skips that, so the first burst is a cold-start herd.
//!
//! Modes:
//! - `naive`: `get`; on a miss load and `set` (plain memcached items, no herd protection).
//! - `newcache`: django-newcache's original algorithm: plain get/set, the first reader past the
//!   soft expiry re-sets the stale value for the herd timeout *without* CAS and reloads; no lease.
//! - `default`: newcache's `get_or_set_with` (CAS claim, lease, in-process coalescing).
//! - `early`: `get_or_set_with` with XFetch early refresh (β = 1).
//! - `background`: `get_or_set_with_background` (the claimant serves stale and refreshes in a
//!   background thread).
//!
//! One JSON line per mode (fields as the Python script's; `peer` is `newcache-rs:<mode>`), plus
//! `stale_served`, `early_refreshes` and `claims_won` from the cache's own stats.

use std::error::Error;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use newcache::{Backend, Cache, Herd, MemcachedBackend, MemcachedConfig, ServerSpec, StoreMode};
use serde::{Deserialize, Serialize};

const MODES: [&str; 5] = ["naive", "newcache", "default", "early", "background"];

#[derive(Debug, Clone)]
struct Args {
    servers: Vec<String>,
    procs: usize,
    threads: usize,
    loader_ms: f64,
    ttl: u64,
    duration: f64,
    think_ms: f64,
    cold: bool,
    modes: Vec<String>,
    json: bool,
    plot: Option<String>,
    run_id: String,
    // worker-only
    worker: bool,
    key: String,
    start_at_ms: u64,
}

fn parse_args() -> Result<Args, Box<dyn Error>> {
    let mut a = Args {
        servers: Vec::new(),
        procs: 4,
        threads: 16,
        loader_ms: 50.0,
        ttl: 2,
        duration: 10.0,
        think_ms: 10.0,
        cold: false,
        modes: Vec::new(),
        json: false,
        plot: None,
        run_id: run_id(),
        worker: false,
        key: String::new(),
        start_at_ms: 0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--servers" => a.servers.extend(val()?.split(',').map(str::to_string)),
            "--port" => a.servers.push(format!("127.0.0.1:{}", val()?)),
            "--procs" => a.procs = val()?.parse()?,
            "--threads" => a.threads = val()?.parse()?,
            "--loader-ms" => a.loader_ms = val()?.parse()?,
            "--ttl" => a.ttl = val()?.parse()?,
            "--duration" => a.duration = val()?.parse()?,
            "--think-ms" => a.think_ms = val()?.parse()?,
            "--cold" => a.cold = true,
            "--mode" => a.modes.push(val()?),
            "--json" => a.json = true,
            "--plot" => a.plot = Some(val()?),
            "--run-id" => a.run_id = val()?,
            "--worker" => a.worker = true,
            "--key" => a.key = val()?,
            "--start-at-ms" => a.start_at_ms = val()?.parse()?,
            "-h" | "--help" => {
                println!(
                    "{}",
                    include_str!("stampede.rs")
                        .lines()
                        .take(22)
                        .collect::<Vec<_>>()
                        .join("\n")
                );
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?} (see --help)").into()),
        }
    }
    if a.servers.is_empty() {
        a.servers = std::env::var("MEMCACHED_SERVERS")
            .map(|s| s.split(',').map(str::to_string).collect())
            .unwrap_or_default();
    }
    if a.servers.is_empty() {
        return Err("--servers host:port[,host:port] (or MEMCACHED_SERVERS) is required".into());
    }
    if a.modes.is_empty() {
        a.modes = MODES.iter().map(|m| m.to_string()).collect();
    }
    for m in &a.modes {
        if !MODES.contains(&m.as_str()) {
            return Err(format!("unknown mode {m:?}; modes: {MODES:?}").into());
        }
    }
    Ok(a)
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn unix_secs_f64() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn run_id() -> String {
    let s = unix_ms() / 1000;
    // UTC yyyymmddThhmmssZ, as the Python script names runs.
    let (days, rem) = (s / 86_400, s % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!(
        "{y:04}{m:02}{d:02}T{:02}{:02}{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// The cached value, as the Python script's `{"id": 1, "name": "x" * 80, "gen": n}`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Value {
    id: u64,
    name: String,
    generation: u64,
}

fn cache_for(args: &Args, mode: &str) -> Result<Cache, newcache::Error> {
    let b = Cache::builder()
        .memcached(&args.servers)
        .flavor("stampede")
        .lease_ttl(Duration::from_secs(5))
        .pool_size(args.threads as u32 + 4);
    if mode == "early" {
        b.early_refresh(1.0)
    } else {
        b
    }
    .build()
}

thread_local! {
    static LOADED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The expensive computation: sleeps, then counts itself in memcached.
#[derive(Clone)]
struct Loader {
    cache: Cache,
    counter: String,
    sleep: Duration,
    starts: Arc<Mutex<Vec<f64>>>,
}

impl Loader {
    fn load(&self) -> Result<Value, newcache::Error> {
        LOADED.with(|l| l.set(true));
        let t = unix_secs_f64();
        std::thread::sleep(self.sleep);
        let generation = self.cache.incr(&self.counter, 1)?;
        self.starts
            .lock()
            .map_err(|_| newcache::Error::from(std::io::Error::other("poisoned")))?
            .push(t);
        Ok(Value {
            id: 1,
            name: "x".repeat(80),
            generation,
        })
    }
}

/// django-newcache's algorithm on raw memcached, for comparison: (soft expiry in whole seconds,
/// value); the first reader past it re-sets it for the herd timeout without CAS and reloads.
struct OriginalNewcache {
    backend: MemcachedBackend,
    key: String,
}

const HERD_TIMEOUT_S: u64 = 60;

impl OriginalNewcache {
    fn new(args: &Args, cache: &Cache, key: &str) -> Result<Self, Box<dyn Error>> {
        let specs = args
            .servers
            .iter()
            .map(|s| ServerSpec::parse(s))
            .collect::<Result<Vec<_>, _>>()?;
        let mut cfg = MemcachedConfig::new(specs);
        cfg.pool_size = args.threads as u32 + 4;
        Ok(OriginalNewcache {
            backend: MemcachedBackend::new(cfg)?,
            key: cache.make_key(key),
        })
    }
    fn pack(value: &Value, timeout: u64) -> Vec<u8> {
        let soft = unix_ms() / 1000 + timeout;
        bincode::serde::encode_to_vec((soft, value), bincode::config::standard())
            .unwrap_or_default()
    }
    fn get(&self) -> Result<Option<Value>, newcache::Error> {
        let Some(item) = self.backend.get(&self.key)? else {
            return Ok(None);
        };
        let Ok(((soft, v), _)) = bincode::serde::decode_from_slice::<(u64, Value), _>(
            &item.value,
            bincode::config::standard(),
        ) else {
            return Ok(None);
        };
        if soft < unix_ms() / 1000 {
            // newcache: re-set the stale value for the herd timeout, tell this caller "miss".
            let bytes = Self::pack(&v, HERD_TIMEOUT_S);
            self.backend
                .store(StoreMode::Set, &self.key, &bytes, 0, HERD_TIMEOUT_S as u32)?;
            return Ok(None);
        }
        Ok(Some(v))
    }
    fn set(&self, v: &Value, ttl: u64) -> Result<(), newcache::Error> {
        let bytes = Self::pack(v, ttl);
        self.backend
            .store(
                StoreMode::Set,
                &self.key,
                &bytes,
                0,
                (ttl + HERD_TIMEOUT_S) as u32,
            )
            .map(|_| ())
    }
}

/// One read in the given mode.
fn reader<'a>(
    args: &Args,
    mode: &str,
    cache: &Cache,
    key: &str,
    loader: &Loader,
    original: Option<&'a OriginalNewcache>,
) -> impl Fn() -> Result<Value, newcache::Error> + 'a {
    let ttl = Duration::from_secs(args.ttl);
    let (mode, cache, key, loader) = (
        mode.to_string(),
        cache.clone(),
        key.to_string(),
        loader.clone(),
    );
    move || match mode.as_str() {
        "naive" => match cache.get::<Value>(&key)? {
            Some(v) => Ok(v),
            None => {
                let v = loader.load()?;
                cache.set_with(&key, &v, ttl, Herd::Off)?;
                Ok(v)
            }
        },
        "newcache" => {
            let o = original
                .ok_or_else(|| newcache::Error::from(std::io::Error::other("no newcache")))?;
            match o.get()? {
                Some(v) => Ok(v),
                None => {
                    let v = loader.load()?;
                    o.set(&v, ttl.as_secs())?;
                    Ok(v)
                }
            }
        }
        "background" => {
            let l = loader.clone();
            cache.get_or_set_with_background(&key, ttl, move || l.load())
        }
        _ => cache.get_or_set_with(&key, ttl, || loader.load()),
    }
}

/// What one worker process reports.
#[derive(Debug, Default, Serialize, Deserialize)]
struct WorkerReport {
    reads: u64,
    caller_loads: u64,
    stalled: u64,
    bad: u64,
    errors: u64,
    /// (seconds since start, latency seconds) per read.
    lat: Vec<(f32, f32)>,
    /// unix seconds at which this process's loads started.
    starts: Vec<f64>,
    /// the cache's own counters in this process (zero for naive/newcache).
    stale_served: u64,
    early_refreshes: u64,
    claims_won: u64,
}

fn worker(args: &Args) -> Result<(), Box<dyn Error>> {
    let mode = args.modes[0].clone();
    let cache = cache_for(args, &mode)?;
    let original = if mode == "newcache" {
        Some(OriginalNewcache::new(args, &cache, &args.key)?)
    } else {
        None
    };
    let loader = Loader {
        cache: cache.clone(),
        counter: format!("{}:loads", args.key),
        sleep: Duration::from_secs_f64(args.loader_ms / 1000.0),
        starts: Arc::new(Mutex::new(Vec::new())),
    };
    let report = Mutex::new(WorkerReport::default());
    let stall = args.loader_ms / 2000.0;
    let think = Duration::from_secs_f64(args.think_ms / 1000.0);
    let ready = Barrier::new(args.threads);
    let start_at = UNIX_EPOCH + Duration::from_millis(args.start_at_ms);
    std::thread::scope(|s| {
        for _ in 0..args.threads {
            s.spawn(|| {
                let read = reader(args, &mode, &cache, &args.key, &loader, original.as_ref());
                ready.wait();
                if let Ok(wait) = start_at.duration_since(SystemTime::now()) {
                    std::thread::sleep(wait);
                }
                let t_start = Instant::now();
                let deadline = t_start + Duration::from_secs_f64(args.duration);
                let mut mine = WorkerReport::default();
                while Instant::now() < deadline {
                    LOADED.with(|l| l.set(false));
                    let t0 = Instant::now();
                    let v = read();
                    let d = t0.elapsed().as_secs_f64();
                    mine.lat
                        .push(((t0 - t_start).as_secs_f64() as f32, d as f32));
                    mine.reads += 1;
                    mine.caller_loads += u64::from(LOADED.with(|l| l.get()));
                    mine.stalled += u64::from(d >= stall);
                    match v {
                        Ok(v) if v.id == 1 => {}
                        Ok(_) => mine.bad += 1,
                        Err(_) => {
                            mine.errors += 1;
                            mine.bad += 1;
                        }
                    }
                    std::thread::sleep(think);
                }
                let mut r = report.lock().unwrap_or_else(|e| e.into_inner());
                r.reads += mine.reads;
                r.caller_loads += mine.caller_loads;
                r.stalled += mine.stalled;
                r.bad += mine.bad;
                r.errors += mine.errors;
                r.lat.extend(mine.lat);
            });
        }
    });
    // Background refreshes may still be finishing: give them the loader time.
    std::thread::sleep(Duration::from_secs_f64(args.loader_ms / 1000.0 + 0.05));
    let mut report = report.into_inner().unwrap_or_else(|e| e.into_inner());
    report.starts = loader.starts.lock().map(|s| s.clone()).unwrap_or_default();
    let st = cache.stats();
    if mode != "naive" && mode != "newcache" {
        report.stale_served = st.stale_served;
        report.early_refreshes = st.early_refreshes;
        report.claims_won = st.claims_won;
    }
    let line = bincode::serde::encode_to_vec(&report, bincode::config::standard())?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "REPORT {}", hex_encode(&line))?;
    Ok(())
}

fn hex_encode(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn hex_decode(s: &str) -> Option<Vec<u8>> {
    (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
        .collect()
}

fn cluster(starts: &[f64], gap: f64) -> Vec<usize> {
    let mut sorted = starts.to_vec();
    sorted.sort_by(|a, b| a.total_cmp(b));
    let mut sizes = Vec::new();
    let mut prev: Option<f64> = None;
    for t in sorted {
        if prev.is_none_or(|p| t - p > gap) {
            sizes.push(0);
        }
        if let Some(last) = sizes.last_mut() {
            *last += 1;
        }
        prev = Some(t);
    }
    sizes
}

fn pct(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let i = ((q * (sorted.len() - 1) as f64).round() as usize).min(sorted.len() - 1);
    Some(sorted[i])
}

fn ms(x: Option<f64>) -> serde_json_lite::Num {
    serde_json_lite::Num(x.map(|v| (v * 1000.0 * 100.0).round() / 100.0))
}

/// A few lines of JSON writing, to keep the example free of extra dependencies.
mod serde_json_lite {
    use std::fmt::Write;
    pub struct Num(pub Option<f64>);
    pub enum J {
        S(String),
        N(Num),
        I(u64),
        B(bool),
        L(Vec<usize>),
    }
    pub fn object(fields: &[(&str, J)]) -> String {
        let mut s = String::from("{");
        for (i, (k, v)) in fields.iter().enumerate() {
            if i > 0 {
                s.push_str(", ");
            }
            let _ = write!(s, "\"{k}\": ");
            let _ = match v {
                J::S(x) => write!(s, "\"{}\"", x.replace('\\', "\\\\").replace('"', "\\\"")),
                J::N(Num(Some(x))) => write!(s, "{x}"),
                J::N(Num(None)) => write!(s, "null"),
                J::I(x) => write!(s, "{x}"),
                J::B(x) => write!(s, "{x}"),
                J::L(xs) => write!(
                    s,
                    "[{}]",
                    xs.iter()
                        .map(|x| x.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            };
        }
        s.push('}');
        s
    }
}

struct ModeResult {
    mode: String,
    json: String,
    lat: Vec<(f32, f32)>,
    starts: Vec<f64>,
    t0: f64,
}

fn run_mode(args: &Args, mode: &str) -> Result<ModeResult, Box<dyn Error>> {
    use serde_json_lite::J;
    let key = format!("stampede:{mode}:{}:{}", args.run_id, std::process::id());
    let counter = format!("{key}:loads");
    let cache = cache_for(args, mode)?;
    cache.set_counter(&counter, 0, Duration::from_secs(3600))?;
    if !args.cold {
        // Warm the key through the same mode (this load is not counted).
        let original = if mode == "newcache" {
            Some(OriginalNewcache::new(args, &cache, &key)?)
        } else {
            None
        };
        let loader = Loader {
            cache: cache.clone(),
            counter: counter.clone(),
            sleep: Duration::from_secs_f64(args.loader_ms / 1000.0),
            starts: Arc::new(Mutex::new(Vec::new())),
        };
        let v = reader(args, mode, &cache, &key, &loader, original.as_ref())()?;
        assert_eq!(v.id, 1);
    }
    let baseline = cache.get_counter(&counter)?.unwrap_or(0);
    let start_at_ms = unix_ms() + 300 + 50 * args.procs as u64;
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    for _ in 0..args.procs {
        let mut cmd = Command::new(&exe);
        cmd.args(["--worker", "--mode", mode, "--key", &key])
            .args(["--servers", &args.servers.join(",")])
            .args(["--threads", &args.threads.to_string()])
            .args(["--loader-ms", &args.loader_ms.to_string()])
            .args(["--ttl", &args.ttl.to_string()])
            .args(["--duration", &args.duration.to_string()])
            .args(["--think-ms", &args.think_ms.to_string()])
            .args(["--start-at-ms", &start_at_ms.to_string()])
            .stdout(Stdio::piped());
        children.push(cmd.spawn()?);
    }
    let mut reports = Vec::new();
    for mut child in children {
        let out = child.stdout.take().ok_or("no worker stdout")?;
        let mut found = None;
        for line in BufReader::new(out).lines() {
            let line = line?;
            if let Some(hex) = line.strip_prefix("REPORT ") {
                let bytes = hex_decode(hex).ok_or("bad worker report")?;
                let (r, _): (WorkerReport, _) =
                    bincode::serde::decode_from_slice(&bytes, bincode::config::standard())?;
                found = Some(r);
            }
        }
        let status = child.wait()?;
        reports.push(found.ok_or_else(|| format!("a worker failed: {status}"))?);
    }
    let loads_total = cache.get_counter(&counter)?.unwrap_or(0) - baseline;
    let mut lat: Vec<(f32, f32)> = Vec::new();
    let mut starts = Vec::new();
    let (mut reads, mut caller_loads, mut stalled, mut bad, mut errors) = (0, 0, 0, 0, 0);
    let (mut stale_served, mut early_refreshes, mut claims_won) = (0, 0, 0);
    for r in reports {
        stale_served += r.stale_served;
        early_refreshes += r.early_refreshes;
        claims_won += r.claims_won;
        reads += r.reads;
        caller_loads += r.caller_loads;
        stalled += r.stalled;
        bad += r.bad;
        errors += r.errors;
        lat.extend(r.lat);
        starts.extend(r.starts);
    }
    let mut sorted: Vec<f64> = lat.iter().map(|(_, d)| f64::from(*d)).collect();
    sorted.sort_by(|a, b| a.total_cmp(b));
    let gap = (args.ttl as f64 / 2.0).min((3.0 * args.loader_ms / 1000.0).max(0.25));
    let bursts = cluster(&starts, gap);
    let mean = if sorted.is_empty() {
        None
    } else {
        Some(sorted.iter().sum::<f64>() / sorted.len() as f64)
    };
    let per_expiry = if bursts.is_empty() {
        None
    } else {
        Some((loads_total as f64 / bursts.len() as f64 * 100.0).round() / 100.0)
    };
    let json = serde_json_lite::object(&[
        ("bench", J::S("stampede".into())),
        ("run_id", J::S(args.run_id.clone())),
        ("peer", J::S(format!("newcache-rs:{mode}"))),
        ("mode", J::S(mode.into())),
        ("procs", J::I(args.procs as u64)),
        ("threads", J::I(args.threads as u64)),
        ("workers", J::I((args.procs * args.threads) as u64)),
        (
            "loader_ms",
            J::N(serde_json_lite::Num(Some(args.loader_ms))),
        ),
        ("ttl", J::I(args.ttl)),
        ("duration", J::N(serde_json_lite::Num(Some(args.duration)))),
        ("think_ms", J::N(serde_json_lite::Num(Some(args.think_ms)))),
        ("cold", J::B(args.cold)),
        ("loads_total", J::I(loads_total)),
        ("loads_seen", J::I(starts.len() as u64)),
        ("expiries", J::I(bursts.len() as u64)),
        (
            "expected_expiries_approx",
            J::N(serde_json_lite::Num(Some(
                (args.duration / args.ttl as f64 * 10.0).round() / 10.0,
            ))),
        ),
        ("loads_per_expiry", J::N(serde_json_lite::Num(per_expiry))),
        (
            "loads_per_expiry_max",
            J::I(bursts.iter().copied().max().unwrap_or(0) as u64),
        ),
        ("bursts", J::L(bursts.clone())),
        ("burst_gap_s", J::N(serde_json_lite::Num(Some(gap)))),
        ("reads", J::I(reads)),
        (
            "reads_per_s",
            J::N(serde_json_lite::Num(Some(
                (reads as f64 / args.duration * 10.0).round() / 10.0,
            ))),
        ),
        ("caller_loads", J::I(caller_loads)),
        ("stalled_reads", J::I(stalled)),
        ("bad_reads", J::I(bad)),
        ("errors", J::I(errors)),
        ("p50_ms", J::N(ms(pct(&sorted, 0.5)))),
        ("p99_ms", J::N(ms(pct(&sorted, 0.99)))),
        ("max_ms", J::N(ms(sorted.last().copied()))),
        ("mean_ms", J::N(ms(mean))),
        ("stale_served", J::I(stale_served)),
        ("early_refreshes", J::I(early_refreshes)),
        ("claims_won", J::I(claims_won)),
    ]);
    Ok(ModeResult {
        mode: mode.to_string(),
        json,
        lat,
        starts,
        t0: start_at_ms as f64 / 1000.0,
    })
}

fn main() -> Result<(), Box<dyn Error>> {
    let args = parse_args()?;
    if args.worker {
        return worker(&args);
    }
    let mut results = Vec::new();
    for mode in &args.modes {
        let r = run_mode(&args, mode)?;
        if args.json {
            println!("{}", r.json);
        } else {
            println!("{}: {}", r.mode, r.json);
        }
        results.push(r);
    }
    if let Some(path) = &args.plot {
        plot::write(path, &args, &results)?;
        eprintln!("plot written to {path}");
    }
    Ok(())
}

mod plot {
    //! A PNG with one panel per mode: read latency over time (grey dots, log scale) and the
    //! moments loads started (red ticks). No plotting library: a pixel buffer, a 5x7 font, and
    //! the `png` encoder.
    use super::{Args, ModeResult};
    use std::error::Error;

    const W: usize = 1000;
    const PANEL_H: usize = 160;
    const LEFT: usize = 150;
    const RIGHT: usize = 20;

    struct Canvas {
        w: usize,
        h: usize,
        px: Vec<[u8; 3]>,
    }

    impl Canvas {
        fn set(&mut self, x: usize, y: usize, c: [u8; 3]) {
            if x < self.w && y < self.h {
                self.px[y * self.w + x] = c;
            }
        }
        fn text(&mut self, x: usize, y: usize, s: &str, c: [u8; 3]) {
            for (i, ch) in s.chars().enumerate() {
                let g = glyph(ch);
                for (row, bits) in g.iter().enumerate() {
                    for col in 0..5 {
                        if bits & (0x10 >> col) != 0 {
                            self.set(x + i * 6 + col, y + row, c);
                        }
                    }
                }
            }
        }
    }

    /// 5x7 glyphs for what the labels use; anything else is a blank.
    fn glyph(c: char) -> [u8; 7] {
        match c.to_ascii_lowercase() {
            '0' => [14, 17, 19, 21, 25, 17, 14],
            '1' => [4, 12, 4, 4, 4, 4, 14],
            '2' => [14, 17, 1, 2, 4, 8, 31],
            '3' => [30, 1, 1, 14, 1, 1, 30],
            '4' => [2, 6, 10, 18, 31, 2, 2],
            '5' => [31, 16, 30, 1, 1, 17, 14],
            '6' => [6, 8, 16, 30, 17, 17, 14],
            '7' => [31, 1, 2, 4, 8, 8, 8],
            '8' => [14, 17, 17, 14, 17, 17, 14],
            '9' => [14, 17, 17, 15, 1, 2, 12],
            'a' => [0, 0, 14, 1, 15, 17, 15],
            'b' => [16, 16, 30, 17, 17, 17, 30],
            'c' => [0, 0, 14, 16, 16, 17, 14],
            'd' => [1, 1, 15, 17, 17, 17, 15],
            'e' => [0, 0, 14, 17, 31, 16, 14],
            'f' => [6, 9, 8, 28, 8, 8, 8],
            'g' => [0, 15, 17, 17, 15, 1, 14],
            'h' => [16, 16, 22, 25, 17, 17, 17],
            'i' => [4, 0, 12, 4, 4, 4, 14],
            'j' => [2, 0, 6, 2, 2, 18, 12],
            'k' => [16, 16, 18, 20, 24, 20, 18],
            'l' => [12, 4, 4, 4, 4, 4, 14],
            'm' => [0, 0, 26, 21, 21, 17, 17],
            'n' => [0, 0, 22, 25, 17, 17, 17],
            'o' => [0, 0, 14, 17, 17, 17, 14],
            'p' => [0, 0, 30, 17, 30, 16, 16],
            'q' => [0, 0, 15, 17, 15, 1, 1],
            'r' => [0, 0, 22, 25, 16, 16, 16],
            's' => [0, 0, 14, 16, 14, 1, 30],
            't' => [8, 8, 28, 8, 8, 9, 6],
            'u' => [0, 0, 17, 17, 17, 19, 13],
            'v' => [0, 0, 17, 17, 17, 10, 4],
            'w' => [0, 0, 17, 17, 21, 21, 10],
            'x' => [0, 0, 17, 10, 4, 10, 17],
            'y' => [0, 0, 17, 17, 15, 1, 14],
            'z' => [0, 0, 31, 2, 4, 8, 31],
            '.' => [0, 0, 0, 0, 0, 12, 12],
            ':' => [0, 12, 12, 0, 12, 12, 0],
            '-' => [0, 0, 0, 31, 0, 0, 0],
            '/' => [0, 1, 2, 4, 8, 16, 0],
            '=' => [0, 0, 31, 0, 31, 0, 0],
            '(' => [2, 4, 8, 8, 8, 4, 2],
            ')' => [8, 4, 2, 2, 2, 4, 8],
            ',' => [0, 0, 0, 0, 12, 4, 8],
            _ => [0; 7],
        }
    }

    pub fn write(path: &str, args: &Args, results: &[ModeResult]) -> Result<(), Box<dyn Error>> {
        let h = PANEL_H * results.len() + 30;
        let mut c = Canvas {
            w: W,
            h,
            px: vec![[255, 255, 255]; W * h],
        };
        let plot_w = W - LEFT - RIGHT;
        let title = format!(
            "newcache stampede: {}x{} workers, loader {} ms, ttl {} s{}",
            args.procs,
            args.threads,
            args.loader_ms,
            args.ttl,
            if args.cold { ", cold" } else { "" }
        );
        c.text(10, 8, &title, [0, 0, 0]);
        // latency axis: 0.01 ms .. 1000 ms, log scale
        let y_of = |lat_s: f64, top: usize| {
            let ms = (lat_s * 1000.0).clamp(0.01, 1000.0);
            let frac = (ms.log10() + 2.0) / 5.0;
            top + PANEL_H - 20 - (frac * (PANEL_H - 30) as f64) as usize
        };
        for (i, r) in results.iter().enumerate() {
            let top = 30 + i * PANEL_H;
            c.text(10, top + 10, &r.mode, [0, 0, 0]);
            c.text(
                10,
                top + 24,
                &format!("loads {}", r.starts.len()),
                [200, 0, 0],
            );
            for (label, ms) in [("1000ms", 1000.0), ("10ms", 10.0), ("0.1ms", 0.1)] {
                let y = y_of(ms / 1000.0, top);
                c.text(LEFT - 45, y.saturating_sub(3), label, [90, 90, 90]);
                for x in LEFT..W - RIGHT {
                    if x % 4 == 0 {
                        c.set(x, y, [210, 210, 210]);
                    }
                }
            }
            for (t, d) in &r.lat {
                let x = LEFT
                    + ((f64::from(*t) / args.duration).clamp(0.0, 1.0) * (plot_w - 1) as f64)
                        as usize;
                let y = y_of(f64::from(*d), top);
                c.set(x, y, [110, 110, 110]);
            }
            for s in &r.starts {
                let x = LEFT
                    + (((s - r.t0) / args.duration).clamp(0.0, 1.0) * (plot_w - 1) as f64) as usize;
                for y in top + 5..top + PANEL_H - 18 {
                    c.set(x, y, [220, 30, 30]);
                }
            }
            for x in LEFT..W - RIGHT {
                c.set(x, top + PANEL_H - 18, [0, 0, 0]);
            }
            c.text(LEFT, top + PANEL_H - 14, "0 s", [0, 0, 0]);
            c.text(
                W - RIGHT - 40,
                top + PANEL_H - 14,
                &format!("{} s", args.duration),
                [0, 0, 0],
            );
        }
        let file = std::fs::File::create(path)?;
        let mut enc = png::Encoder::new(std::io::BufWriter::new(file), W as u32, h as u32);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        let mut w = enc.write_header()?;
        let data: Vec<u8> = c.px.iter().flat_map(|p| p.iter().copied()).collect();
        w.write_image_data(&data)?;
        Ok(())
    }
}
