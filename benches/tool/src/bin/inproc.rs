//! Fixed numbers of calls of newcache's headline paths, for instruction and allocation counts.
//!
//! - `--op get-many`: C, the in-process part of `Cache::get_many`: the floor's `sync-get-many`
//!   call on the memory backend (100 of the mission's items, `m0`..`m99`);
//! - `--op get`: the single `Cache::get` of `m0` on the memory backend (a guard: its work must
//!   not grow);
//! - `--op mc-get --server A [--threads N]`: the sync `Cache::get` hit on memcached, keys
//!   `k0`..`k999` in turn (the floor's `sync-get`); with N threads sharing the cache, `--calls`
//!   gets in all (concurrent callers go through the pipelined engine: `bench hot`'s
//!   `newcache-threads`);
//! - `--op mc-get-many --server A --server B --server C`: `Cache::get_many` of `m0`..`m99` over
//!   the servers given (the floor's `sync-get-many`);
//! - `--op async-get --server A [--tasks N] [--runtime multi|current]`: `AsyncCache::get` of
//!   random hot keys `k0`..`k999` from N tasks (default 1; 64 is the floor's concurrent path)
//!   sharing one cache, on a 2-worker (default) or a current-thread runtime; `--calls` gets in
//!   all. `CONNS=N` in the environment sets the cache's `async_connections` (default 2).
//! - `--op async-get-many --server A`: `AsyncCache::get_many` of 1,000 values of ~1 KB
//!   (`large0`..`large999`) from one task on a 2-worker runtime: a batch whose replies arrive
//!   in many reads.
//!
//! Each op fills its items through the cache (memcached is started by the caller), makes 10
//! uncounted calls (per task), then `--calls` counted ones, counting the allocations (and
//! `realloc`s) in its global allocator, and prints the time per call (noise on a loaded
//! machine).
//!
//! Made for instruction counts, which load on a shared machine does not change: under
//! `valgrind --tool=callgrind`, two runs that differ only in `--calls` give the instructions
//! per call as the difference of their totals over the difference of their calls
//! (`benches/tool/count.sh`). memcached runs outside valgrind, so what is
//! counted is the client process alone; the kernel's work is not counted.
//!
//! With `--redis-cluster URL,URL,...` (a running cluster's seeds) or `--redis URL` (one
//! server), `get-many` and `get` run on the Redis Cluster or Redis backend instead: callgrind
//! then counts the client's instructions per call (the servers are other processes), the part
//! of `sync-get-many` on the cluster that is this process's work.
//!
//! ```text
//! cargo run --release -p newcache-bench --bin inproc -- [--op OP] [--calls N] [--server HOST:PORT ...]
//!     [--tasks N] [--threads N] [--runtime multi|current] [--redis-cluster URL,URL,... | --redis URL]
//! ```

#[path = "../floor/items.rs"]
#[allow(dead_code)]
mod items;

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

use items::{BoxError, FLAVOR, TTL, VERSION, Value};

/// The system allocator, counting allocations (a `realloc` counts as one) and their bytes.
struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is passed to `System` unchanged; the counters have no effect on it.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        BYTES.fetch_add(layout.size() as u64, Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        BYTES.fetch_add(new_size as u64, Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// The keys of a `get_many`.
const BATCH: usize = 100;
/// The hot keys of the single-key memcached paths.
const KEYS: usize = 1000;

struct Args {
    op: String,
    calls: u64,
    servers: Vec<String>,
    tasks: usize,
    threads: usize,
    multi: bool,
    cluster: Option<Vec<String>>,
    redis: Option<String>,
}

fn args() -> Result<Args, BoxError> {
    let mut a = Args {
        op: "get-many".to_string(),
        calls: 10_000,
        servers: Vec::new(),
        tasks: 1,
        threads: 1,
        multi: true,
        cluster: None,
        redis: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--op" => a.op = value()?,
            "--calls" => a.calls = value()?.parse()?,
            "--server" => a.servers.push(value()?),
            "--tasks" => a.tasks = value()?.parse()?,
            "--threads" => a.threads = value()?.parse()?,
            "--runtime" => {
                a.multi = match value()?.as_str() {
                    "multi" => true,
                    "current" => false,
                    other => return Err(format!("--runtime {other:?}: multi or current").into()),
                }
            }
            "--redis-cluster" => {
                a.cluster = Some(value()?.split(',').map(str::to_owned).collect());
            }
            "--redis" => a.redis = Some(value()?),
            other => return Err(format!("unknown argument {other:?}").into()),
        }
    }
    Ok(a)
}

fn builder() -> newcache::CacheBuilder {
    newcache::Cache::builder().flavor(FLAVOR).version(VERSION)
}

/// Fills `{prefix}0`..`{prefix}{n-1}` through `cache`.
fn fill(cache: &newcache::Cache, prefix: &str, n: usize) -> Result<Vec<String>, BoxError> {
    let user: Vec<String> = (0..n).map(|i| format!("{prefix}{i}")).collect();
    for (i, k) in user.iter().enumerate() {
        cache.set(k, &Value::new(i), TTL)?;
    }
    Ok(user)
}

/// A sync op: `one` called 10 times uncounted, then `calls` times.
fn counted(calls: u64, mut one: impl FnMut(u64) -> Result<(), BoxError>) -> Result<(), BoxError> {
    // Warm-up: the first calls grow lazily made buffers (thread locals, the span machinery).
    for j in 0..10 {
        one(j)?;
    }
    let (allocs, bytes) = (ALLOCS.load(Relaxed), BYTES.load(Relaxed));
    let t = Instant::now();
    for j in 0..calls {
        one(j)?;
    }
    report(calls, allocs, bytes, t);
    Ok(())
}

fn report(calls: u64, allocs: u64, bytes: u64, t: Instant) {
    let elapsed = t.elapsed();
    let per = |n: u64| n as f64 / calls.max(1) as f64;
    println!(
        "{calls} calls, {:.2} allocations and {:.0} bytes allocated per call, {:.2} us per call",
        per(ALLOCS.load(Relaxed) - allocs),
        per(BYTES.load(Relaxed) - bytes),
        elapsed.as_secs_f64() * 1e6 / calls.max(1) as f64,
    );
}

/// SplitMix64 over the hot keys (the floor's 64-task path's sequence).
struct Rng(u64);

impl Rng {
    fn key(&mut self) -> usize {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) % KEYS as u64) as usize
    }
}

fn async_get(a: &Args) -> Result<(), BoxError> {
    let server = a.servers.first().ok_or("async-get needs --server")?;
    let rt = match a.multi {
        true => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?,
        false => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?,
    };
    let sync = builder().memcached([server.as_str()]).build()?;
    let user = Arc::new(fill(&sync, "k", KEYS)?);
    let conns: u32 = match std::env::var("CONNS") {
        Ok(v) => v.parse().map_err(|e| format!("CONNS={v:?}: {e}"))?,
        Err(_) => 2,
    };
    let cache = rt.block_on(async {
        builder()
            .memcached([server.as_str()])
            .async_connections(conns)
            .build_async()
    })?;
    let tasks = a.tasks.max(1);
    let per_task = (a.calls as usize / tasks).max(1);
    let run = |gets: usize| -> Result<(), BoxError> {
        rt.block_on(async {
            let handles: Vec<_> = (0..tasks)
                .map(|t| {
                    let (cache, user) = (cache.clone(), Arc::clone(&user));
                    tokio::spawn(async move {
                        let mut rng = Rng(t as u64 * 0xA076_1D64_78BD_642F + 1);
                        for _ in 0..gets {
                            let i = rng.key();
                            Value::check(cache.get::<Value>(&user[i]).await?, i)?;
                        }
                        Ok::<_, BoxError>(())
                    })
                })
                .collect();
            for h in handles {
                h.await??;
            }
            Ok(())
        })
    };
    run(10)?;
    let (allocs, bytes) = (ALLOCS.load(Relaxed), BYTES.load(Relaxed));
    let t = Instant::now();
    run(per_task)?;
    report((per_task * tasks) as u64, allocs, bytes, t);
    Ok(())
}

/// `AsyncCache::get_many` of `LARGE_KEYS` values of `LARGE_BYTES` each (~1 MB a call) on one
/// server, from one task on a 2-worker runtime: a batch whose replies come in many reads.
fn async_get_many(a: &Args) -> Result<(), BoxError> {
    const LARGE_KEYS: usize = 1000;
    const LARGE_BYTES: usize = 1000;
    let server = a.servers.first().ok_or("async-get-many needs --server")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let sync = builder().memcached([server.as_str()]).build()?;
    let user: Vec<String> = (0..LARGE_KEYS).map(|i| format!("large{i}")).collect();
    for (i, k) in user.iter().enumerate() {
        let v = Value {
            id: 1_000_000 + i as u64,
            name: "x".repeat(LARGE_BYTES),
        };
        sync.set(k, &v, TTL)?;
    }
    let cache = rt.block_on(async { builder().memcached([server.as_str()]).build_async() })?;
    let run = |calls: u64| -> Result<(), BoxError> {
        rt.block_on(async {
            for _ in 0..calls {
                let found = cache.get_many::<Value>(black_box(&user)).await?;
                if found.len() != LARGE_KEYS || found.values().any(|v| v.name.len() != LARGE_BYTES)
                {
                    return Err(format!("get_many found {} of {LARGE_KEYS}", found.len()).into());
                }
            }
            Ok(())
        })
    };
    run(3)?;
    let (allocs, bytes) = (ALLOCS.load(Relaxed), BYTES.load(Relaxed));
    let t = Instant::now();
    run(a.calls)?;
    report(a.calls, allocs, bytes, t);
    Ok(())
}

fn main() -> Result<(), BoxError> {
    let a = args()?;
    print!("{}: ", a.op);
    match a.op.as_str() {
        "get-many" | "get" => {
            let cache = match (&a.cluster, &a.redis) {
                (Some(seeds), _) => builder().redis_cluster(seeds.iter().cloned()).build()?,
                (None, Some(url)) => builder().redis(url.as_str()).build()?,
                (None, None) => builder().in_memory().build()?,
            };
            let user = fill(&cache, "m", BATCH)?;
            match a.op.as_str() {
                "get" => counted(a.calls, |_| {
                    Value::check(cache.get::<Value>(black_box("m0"))?, 0)
                }),
                _ => counted(a.calls, |_| {
                    let found = cache.get_many::<Value>(black_box(&user))?;
                    match found.len() {
                        BATCH => Ok(()),
                        n => Err(format!("get_many found {n} of {BATCH}").into()),
                    }
                }),
            }
        }
        "mc-get" => {
            let server = a.servers.first().ok_or("mc-get needs --server")?;
            let cache = builder().memcached([server.as_str()]).build()?;
            let user = fill(&cache, "k", KEYS)?;
            let one = |j: u64| {
                let i = j as usize % KEYS;
                Value::check(cache.get::<Value>(black_box(&user[i]))?, i)
            };
            if a.threads <= 1 {
                return counted(a.calls, one);
            }
            let per_thread = (a.calls as usize / a.threads).max(1) as u64;
            let run = |gets: u64| -> Result<(), BoxError> {
                std::thread::scope(|s| {
                    let handles: Vec<_> = (0..a.threads as u64)
                        .map(|t| s.spawn(move || (0..gets).try_for_each(|j| one(t * 7919 + j))))
                        .collect();
                    handles
                        .into_iter()
                        .try_for_each(|h| h.join().map_err(|_| "a thread panicked")?)
                })
            };
            run(10)?;
            let (allocs, bytes) = (ALLOCS.load(Relaxed), BYTES.load(Relaxed));
            let t = Instant::now();
            run(per_thread)?;
            report(per_thread * a.threads as u64, allocs, bytes, t);
            Ok(())
        }
        "mc-get-many" => {
            if a.servers.is_empty() {
                return Err("mc-get-many needs --server (three, for the floor's path)".into());
            }
            let cache = builder()
                .memcached(a.servers.iter().map(String::as_str))
                .build()?;
            let user = fill(&cache, "m", BATCH)?;
            counted(a.calls, |_| {
                let found = cache.get_many::<Value>(black_box(&user))?;
                match found.len() {
                    BATCH => Ok(()),
                    n => Err(format!("get_many found {n} of {BATCH}").into()),
                }
            })
        }
        "async-get" => async_get(&a),
        "async-get-many" => async_get_many(&a),
        other => Err(format!(
            "unknown --op {other:?} (get-many, get, mc-get, mc-get-many, async-get, \
             async-get-many)"
        )
        .into()),
    }
}
