//! The floor's Redis paths as a fixed number of gets against a running server, for instruction
//! counts: `Cache::get` / `AsyncCache::get` of the floor's items (`k0`..`k999`, filled here
//! through `Cache::set`) or, as the other side, redis-rs's own `GET` of the same stored bytes
//! on the connection type the backend uses (`--side redis-rs`).
//!
//! Under `valgrind --tool=callgrind`, two runs that differ only in `--calls` give the
//! instructions per get as the difference of their totals over the difference of their calls
//! (`benches/results/2026-12-04-redis-floor/count.sh`); everything before the counted calls
//! (the fill, the connects, the warm-up) is the same in both and cancels. The server's
//! `INFO commandstats` around the counted calls says how the gets went out (`GET`s, `MGET`s).
//!
//! ```text
//! cargo run --release -p newcache-floor --bin redis-count -- --url redis://127.0.0.1:6379/0
//!     [--path sync|multi|current|tasks64] [--side newcache|redis-rs] [--calls N]
//! ```

#[path = "../cpu.rs"]
#[allow(dead_code)]
mod cpu;
#[path = "../items.rs"]
#[allow(dead_code)]
mod items;
#[path = "../redis.rs"]
#[allow(dead_code)]
mod redis;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use items::{BoxError, FLAVOR, Items, VERSION, Value};

/// The floor's hot keys and concurrent tasks (`paths.rs`).
const KEYS: usize = 1000;
const TASKS: usize = 64;

/// The system allocator, counting allocations (a `realloc` counts as one).
struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is passed to `System` unchanged; the counter has no effect on it.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[derive(Clone, Copy, PartialEq)]
enum Side {
    Newcache,
    RedisRs,
}

fn main() -> Result<(), BoxError> {
    let (mut url, mut path, mut side, mut calls) = (None, "sync".to_owned(), Side::Newcache, 2000);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--url" => url = Some(args.next().ok_or("--url needs a redis:// URL")?),
            "--path" => path = args.next().ok_or("--path needs a name")?,
            "--side" => {
                side = match args.next().as_deref() {
                    Some("newcache") => Side::Newcache,
                    Some("redis-rs") => Side::RedisRs,
                    other => return Err(format!("--side newcache|redis-rs, not {other:?}").into()),
                }
            }
            "--calls" => calls = args.next().ok_or("--calls needs a number")?.parse()?,
            other => return Err(format!("unknown argument {other:?}").into()),
        }
    }
    let url = url.ok_or("--url redis://host:port/db is required")?;
    let config = newcache::RedisConfig::new(url.as_str());
    let cache = newcache::Cache::builder()
        .redis(url.as_str())
        .flavor(FLAVOR)
        .version(VERSION)
        .build()?;
    let items = Arc::new(redis::fill(
        &cache,
        KEYS,
        &mut redis::Resp::connect(&url, config.io_timeout)?,
    )?);
    let mut stats = ::redis::Client::open(url.as_str())?.get_connection()?;
    let mut counted =
        |f: &mut dyn FnMut(usize) -> Result<(), BoxError>| -> Result<[u64; 3], BoxError> {
            f(100)?; // warm-up: lazily made buffers, the first connect
            let before = commands(&mut stats)?;
            let allocs = ALLOCS.load(Relaxed);
            f(calls)?;
            let allocs = ALLOCS.load(Relaxed) - allocs;
            let after = commands(&mut stats)?;
            Ok([after[0] - before[0], after[1] - before[1], allocs])
        };
    let [gets, mgets, allocs] = match path.as_str() {
        "sync" => {
            let mut conn = redis::sync_connection(&url, &config)?;
            counted(&mut |n| sync(side, &cache, &mut conn, &items, n))?
        }
        "multi" | "current" | "tasks64" => {
            let rt = match path.as_str() {
                "current" => tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?,
                _ => tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()?,
            };
            let acache = rt.block_on(async {
                newcache::Cache::builder()
                    .redis(url.as_str())
                    .flavor(FLAVOR)
                    .version(VERSION)
                    .build_async()
            })?;
            let mux = rt.block_on(redis::multiplexed(&url, &config))?;
            let tasks = if path == "tasks64" { TASKS } else { 1 };
            counted(&mut |n| rt.block_on(concurrent(side, &acache, &mux, &items, tasks, n)))?
        }
        other => return Err(format!("unknown --path {other:?}").into()),
    };
    println!(
        "{path} {}: {calls} gets; the server saw {gets} GET and {mgets} MGET; {:.2} allocations \
         per get",
        match side {
            Side::Newcache => "newcache",
            Side::RedisRs => "redis-rs",
        },
        allocs as f64 / calls.max(1) as f64,
    );
    Ok(())
}

/// `n` gets on one thread.
fn sync(
    side: Side,
    cache: &newcache::Cache,
    conn: &mut ::redis::Connection,
    items: &Items,
    n: usize,
) -> Result<(), BoxError> {
    for j in 0..n {
        let i = j % KEYS;
        match side {
            Side::Newcache => Value::check(cache.get::<Value>(&items.user[i])?, i)?,
            Side::RedisRs => {
                let found: Option<Vec<u8>> =
                    ::redis::cmd("GET").arg(&items.derived[i]).query(conn)?;
                redis::check_len(found, items, i)?;
            }
        }
    }
    Ok(())
}

/// `n` gets spread over `tasks` tasks (key `(task * 7 + j) % KEYS` for the task's `j`th get).
async fn concurrent(
    side: Side,
    cache: &newcache::AsyncCache,
    mux: &::redis::aio::MultiplexedConnection,
    items: &Arc<Items>,
    tasks: usize,
    n: usize,
) -> Result<(), BoxError> {
    let per_task = n / tasks;
    let handles: Vec<_> = (0..tasks)
        .map(|task| {
            let (cache, mut conn, items) = (cache.clone(), mux.clone(), Arc::clone(items));
            tokio::spawn(async move {
                for j in 0..per_task {
                    let i = (task * 7 + j) % KEYS;
                    match side {
                        Side::Newcache => {
                            Value::check(cache.get::<Value>(&items.user[i]).await?, i)?
                        }
                        Side::RedisRs => {
                            let found: Option<Vec<u8>> = ::redis::cmd("GET")
                                .arg(&items.derived[i])
                                .query_async(&mut conn)
                                .await?;
                            redis::check_len(found, &items, i)?;
                        }
                    }
                }
                Ok::<_, BoxError>(())
            })
        })
        .collect();
    for h in handles {
        h.await??;
    }
    Ok(())
}

/// The server's `GET` and `MGET` calls so far (`INFO commandstats`).
fn commands(conn: &mut ::redis::Connection) -> Result<[u64; 2], BoxError> {
    let info: String = ::redis::cmd("INFO").arg("commandstats").query(conn)?;
    let calls = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.strip_prefix("calls="))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    Ok([calls("cmdstat_get:"), calls("cmdstat_mget:")])
}
