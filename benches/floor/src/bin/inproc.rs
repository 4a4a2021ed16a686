//! C, the in-process part of `Cache::get_many`: the floor's `sync-get-many` call on the memory
//! backend (100 of the mission's items, `m0`..`m99`), run `--calls` times, with the
//! allocations each call makes counted by this binary's global allocator. `--op get` runs the
//! single `Cache::get` of `m0` instead (the guard: its work must not grow).
//!
//! Made for instruction counts, which load on a shared machine does not change: under
//! `valgrind --tool=callgrind`, two runs that differ only in `--calls` give the instructions
//! per call as the difference of their totals over the difference of their calls
//! (`benches/results/2026-12-02-getmany/count.sh`). Without valgrind it also prints the time
//! per call (noise on a loaded machine).
//!
//! With `--redis-cluster URL,URL,...` (a running cluster's seeds) or `--redis URL` (one
//! server) the same calls run on the Redis Cluster or Redis backend instead: callgrind then counts the client's instructions per call
//! (the servers are other processes), the part of `sync-get-many` on the cluster that is this
//! process's work.
//!
//! ```text
//! cargo run --release -p newcache-floor --bin inproc -- [--op get-many|get] [--calls N]
//!     [--redis-cluster URL,URL,... | --redis URL]
//! ```

#[path = "../items.rs"]
#[allow(dead_code)]
mod items;

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
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

const BATCH: usize = 100;

fn main() -> Result<(), BoxError> {
    let mut op = "get-many".to_string();
    let mut calls: u64 = 10_000;
    let mut cluster: Option<Vec<String>> = None;
    let mut redis: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--op" => op = args.next().ok_or("--op needs get-many or get")?,
            "--calls" => calls = args.next().ok_or("--calls needs a number")?.parse()?,
            "--redis-cluster" => {
                let seeds = args.next().ok_or("--redis-cluster needs URL,URL,...")?;
                cluster = Some(seeds.split(',').map(str::to_owned).collect());
            }
            "--redis" => redis = Some(args.next().ok_or("--redis needs a URL")?),
            other => return Err(format!("unknown argument {other:?}").into()),
        }
    }
    let builder = newcache::Cache::builder().flavor(FLAVOR).version(VERSION);
    let cache = match (cluster, redis) {
        (Some(seeds), _) => builder.redis_cluster(seeds).build()?,
        (None, Some(url)) => builder.redis(url).build()?,
        (None, None) => builder.in_memory().build()?,
    };
    let user: Vec<String> = (0..BATCH).map(|i| format!("m{i}")).collect();
    for (i, k) in user.iter().enumerate() {
        cache.set(k, &Value::new(i), TTL)?;
    }
    let one = || -> Result<(), BoxError> {
        match op.as_str() {
            "get-many" => {
                let found = cache.get_many::<Value>(black_box(&user))?;
                match found.len() {
                    BATCH => Ok(()),
                    n => Err(format!("get_many found {n} of {BATCH}").into()),
                }
            }
            "get" => Value::check(cache.get::<Value>(black_box("m0"))?, 0),
            other => Err(format!("unknown --op {other:?} (get-many or get)").into()),
        }
    };
    // Warm-up: the first calls grow lazily made buffers (thread locals, the span machinery).
    for _ in 0..10 {
        one()?;
    }
    let (allocs, bytes) = (ALLOCS.load(Relaxed), BYTES.load(Relaxed));
    let t = Instant::now();
    for _ in 0..calls {
        one()?;
    }
    let elapsed = t.elapsed();
    let per = |n: u64| n as f64 / calls.max(1) as f64;
    println!(
        "{op}: {calls} calls, {:.2} allocations and {:.0} bytes allocated per call, {:.2} us per call",
        per(ALLOCS.load(Relaxed) - allocs),
        per(BYTES.load(Relaxed) - bytes),
        elapsed.as_secs_f64() * 1e6 / calls.max(1) as f64,
    );
    Ok(())
}
