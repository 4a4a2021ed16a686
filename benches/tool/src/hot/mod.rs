//! The hot-key harness of issue 10 ("async for web apps"): gets/s and p50/p99/p999 latency of GETs
//! of 1,000 hot keys with ~100-byte values on one memcached, at several concurrencies, for:
//!
//! - `async-memcached`: the `async-memcached` crate, one connection per task;
//! - `memcache-async`: the `memcache` crate's async client (`memcache::exp::AsyncMemcache`), one
//!   pooled handle cloned into every task;
//! - `newcache-blocking`: newcache's sync `Cache`, each GET through `spawn_blocking`;
//! - `newcache-threads`: newcache's sync `Cache` from N OS threads;
//! - `pool-threads`: the same on its blocking pool only (`pipelined_sync(false)`);
//! - `bare`: a tokio `TcpStream` per task, `get k\r\n` then read until `END\r\n` (the floor);
//! - `async-cache`: newcache's `AsyncCache`, with the `async-cache` feature.
//!
//! ```text
//! cargo run --release -p newcache-bench -- hot [--server HOST:PORT] [--client NAME ...]
//!     [--concurrency 1,64,256] [--duration 5] [--warmup 1] [--rounds 2]
//!     [--runtime multi-thread|current-thread] [--workers 2] [--pools per-task|default]
//!     [--table FILE]
//! ```
//!
//! Every client first fills its keys. Then, per round, per concurrency, per client (in the order
//! given, reversed in odd rounds, because loopback latency on the VMs drifts between a fast and a
//! slow regime): N callers GET uniformly random hot keys in a closed loop, `--warmup` seconds not
//! counted, then `--duration` seconds counted. Every GET wholly inside the window is recorded in
//! its caller's histogram; a miss or wrong value is an error. One JSON line per measurement on
//! stdout; progress and the table of medians over rounds on stderr (and in `--table FILE`).

pub(crate) mod args;
pub(crate) mod clients;
pub(crate) mod measure;
pub(crate) mod report;
pub(crate) mod server;

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use args::{Args, Client, Runtime};
use clients::{AsyncMemcached, Bare, BoxError, Ctx, MemcacheAsync, NewcacheBlocking};
use measure::{Tally, Timing};
use report::{Record, Stats};
use server::Memcached;

/// Runs `bench hot`.
pub fn run(args: Args) -> Result<(), BoxError> {
    let args = args.checked();
    // Declared before the runtime so that it is dropped (memcached stopped) after it.
    let started;
    let addr = match &args.server {
        Some(addr) => addr.clone(),
        None => {
            started = Memcached::start(4, 256)?;
            eprintln!("memcached started on {}", started.addr());
            started.addr().to_string()
        }
    };
    let rt = match args.runtime {
        Runtime::MultiThread => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(args.workers)
            .enable_all()
            .build()?,
        Runtime::CurrentThread => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?,
    };
    let ctx = Arc::new(Ctx::new(addr, args.pools));
    populate(&rt, &ctx, &args.clients)?;

    let timing = Timing {
        warmup: Duration::from_secs_f64(args.warmup),
        duration: Duration::from_secs_f64(args.duration),
    };
    let mut records = Vec::new();
    for round in 0..args.rounds {
        for &n in &args.concurrency {
            let seed = (round as u64) << 32 | n as u64;
            for (seq, client) in args.order(round).into_iter().enumerate() {
                let started_unix_s = unix_now();
                let tally = measure(&rt, &ctx, client, n, timing, seed)?;
                let stats = Stats::new(tally, args.duration);
                let record = Record {
                    client: client.name(),
                    concurrency: n,
                    round,
                    seq,
                    runtime: args.runtime.name(),
                    workers: if args.runtime == Runtime::MultiThread {
                        args.workers
                    } else {
                        1
                    },
                    pools: args.pools.name(),
                    started_unix_s,
                    duration_s: args.duration,
                    gets: stats.gets,
                    gets_per_s: stats.gets_per_s,
                    mean_us: stats.mean_us,
                    p50_us: stats.p50_us,
                    p99_us: stats.p99_us,
                    p999_us: stats.p999_us,
                    max_us: stats.max_us,
                    errors: stats.errors,
                    first_error: stats.first_error,
                };
                let mut out = std::io::stdout().lock();
                writeln!(out, "{}", serde_json::to_string(&record)?)?;
                out.flush()?;
                eprintln!(
                    "round {}/{} conc {n:>3} {:<18} {:>9.0} gets/s  p50 {:>7.1} us  p99 {:>7.1} us  errors {}",
                    round + 1,
                    args.rounds,
                    client.name(),
                    record.gets_per_s,
                    record.p50_us,
                    record.p99_us,
                    record.errors,
                );
                records.push(record);
            }
        }
    }
    let table = report::table(&records);
    eprint!("\n{table}");
    if let Some(path) = &args.table {
        std::fs::write(path, &table)?;
    }
    Ok(())
}

/// Fills the hot keys through every selected client (newcache's sync clients share one fill).
fn populate(
    rt: &tokio::runtime::Runtime,
    ctx: &Arc<Ctx>,
    clients: &[Client],
) -> Result<(), BoxError> {
    let mut newcache_filled = false;
    for &client in clients {
        match client {
            Client::AsyncMemcached => {
                rt.block_on(async { AsyncMemcached::connect(ctx).await?.populate().await })?
            }
            Client::MemcacheAsync => {
                rt.block_on(async { MemcacheAsync::connect(ctx, 1).await?.populate().await })?
            }
            Client::Bare => rt.block_on(async { Bare::connect(ctx).await?.populate().await })?,
            Client::NewcacheBlocking | Client::NewcacheThreads | Client::PoolThreads
                if !newcache_filled =>
            {
                clients::populate_newcache(ctx)?;
                newcache_filled = true;
            }
            Client::NewcacheBlocking | Client::NewcacheThreads | Client::PoolThreads => {}
            #[cfg(feature = "async-cache")]
            Client::AsyncCache | Client::EngineThreads => {
                rt.block_on(async { clients::AsyncCache::build(ctx, 1)?.populate().await })?
            }
        }
    }
    Ok(())
}

/// One measurement of `client` with `n` callers. Connections are made (or, for the pooled
/// clients, the client built) before the warm-up starts.
fn measure(
    rt: &tokio::runtime::Runtime,
    ctx: &Arc<Ctx>,
    client: Client,
    n: usize,
    timing: Timing,
    seed: u64,
) -> Result<Tally, BoxError> {
    Ok(match client {
        Client::AsyncMemcached => rt.block_on(async {
            let mut getters = Vec::with_capacity(n);
            for _ in 0..n {
                getters.push(AsyncMemcached::connect(ctx).await?);
            }
            Ok::<_, BoxError>(measure::run_tasks(getters, timing, seed).await)
        })?,
        Client::MemcacheAsync => rt.block_on(async {
            let shared = MemcacheAsync::connect(ctx, n).await?;
            Ok::<_, BoxError>(measure::run_tasks(vec![shared; n], timing, seed).await)
        })?,
        Client::NewcacheBlocking => {
            let cache = clients::newcache(ctx, n, true)?;
            let getters = (0..n).map(|_| NewcacheBlocking {
                cache: cache.clone(),
                ctx: Arc::clone(ctx),
            });
            rt.block_on(measure::run_tasks(getters.collect(), timing, seed))
        }
        Client::NewcacheThreads => {
            let cache = clients::newcache(ctx, n, true)?;
            measure::run_threads(n, timing, seed, |i| clients::newcache_get(&cache, ctx, i))
        }
        Client::PoolThreads => {
            let cache = clients::newcache(ctx, n, false)?;
            measure::run_threads(n, timing, seed, |i| clients::newcache_get(&cache, ctx, i))
        }
        Client::Bare => rt.block_on(async {
            let mut getters = Vec::with_capacity(n);
            for _ in 0..n {
                getters.push(Bare::connect(ctx).await?);
            }
            Ok::<_, BoxError>(measure::run_tasks(getters, timing, seed).await)
        })?,
        #[cfg(feature = "async-cache")]
        Client::AsyncCache => rt.block_on(async {
            // Built inside the runtime, in case building spawns tasks.
            let shared = clients::AsyncCache::build(ctx, n)?;
            Ok::<_, BoxError>(measure::run_tasks(vec![shared; n], timing, seed).await)
        })?,
        #[cfg(feature = "async-cache")]
        Client::EngineThreads => {
            // The engine on a runtime of its own; the callers are plain threads that block.
            let engine_rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("engine")
                .enable_all()
                .build()?;
            let cache = clients::AsyncCache::build(ctx, n)?;
            let handle = engine_rt.handle().clone();
            measure::run_threads(n, timing, seed, |i| handle.block_on(cache.get_key(i)))
        }
    })
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}
