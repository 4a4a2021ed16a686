//! newcache's headline paths through its public API (`Cache`, `AsyncCache`) on the mission's
//! items, each beside its floor in the same process:
//!
//! | path | floor |
//! |---|---|
//! | sync `Cache::get` hit, one thread | a blocking socket's `get` of the same item, the pool connection's socket options |
//! | sync `Cache::get_many`, 100 keys, 3 servers | F: a `get` line per server on 3 sockets, all written then all read; C: the same call on the memory backend |
//! | `AsyncCache::get`, one task, multi-thread (2 workers) and current-thread runtimes | a bare tokio socket's `get` on the same runtime |
//! | `AsyncCache::get`, 64 tasks, 1,000 hot keys, multi-thread | async-memcached 0.9, a client per task |
//!
//! The 64-task path has four more sides: the batching ceiling (bare sockets carrying the 64
//! gets as `get` lines, `--ceiling`), a minimal client (the facade's work of each get on the
//! memory backend, its I/O by one of two batchers on bare sockets that answer each caller
//! through a oneshot: `minimal.rs`, `--minimal`), the same without its sockets (its batchers
//! answer at once), and the facade's work alone; each side's CPU a get (client and servers) is
//! printed once the path is done, and the minimal client's mean gets a round. With `--gets`
//! the ceiling and the minimal client send `gets`, as newcache does (memcached's CPU a get is
//! the same either way here: `benches/results/floor-memcached/NOTES.md`).
//!
//! On Redis / Valkey (`--redis-server-bin PATH` starts one, `--redis URL` uses a running one;
//! each repeatable), the same paths but `get_many` run on the Redis backend, each beside
//! redis-rs's own `GET` of the same stored bytes (a `Connection` with the backend's timeouts;
//! a `MultiplexedConnection` as the async backend opens it, one shared by the 64 tasks) and a
//! bare socket's RESP `GET` (a socket per task for 64 tasks).
//!
//! On a running Redis Cluster (`--redis-cluster URL,URL,...`, its seeds), `sync-get-many`
//! alone: the same call over the cluster's masters, beside F, a bare socket per master with
//! its `GET`s pipelined (all written, then all read), and C.
//!
//! ```text
//! cargo run --release -p newcache-bench -- floor [--rounds 9] [--ops 20000] [--slices 10]
//!     [--path NAME ...] [--json FILE] [--redis-server-bin PATH ...] [--redis URL ...]
//!     [--redis-cluster URL,URL,...]
//! ```
//!
//! Per path: one uncounted warm-up run of each side, then `--rounds` rounds; a round runs the
//! client and its floor in `--slices` slices whose order alternates (A B, B A, ...; the first
//! slice's order alternates by round). Each round's ratio is the client's figure over the
//! floor's from the same round; the table gives their median and interquartile range, and each
//! side's median figure. Three memcached (`-t 2`) are started on free loopback ports and stopped
//! on exit.

pub(crate) mod args;
pub(crate) mod cpu;
pub(crate) mod items;
pub(crate) mod minimal;
pub(crate) mod paths;
pub(crate) mod redis;
pub(crate) mod redis_cluster;
pub(crate) mod redis_paths;
pub(crate) mod report;
pub(crate) mod stats;

use std::time::{SystemTime, UNIX_EPOCH};

use crate::hot::server::Memcached;
use args::{Args, Path};
use items::BoxError;

/// Runs `bench floor`.
pub fn run(args: Args) -> Result<(), BoxError> {
    let args = args.checked();
    items::GETS.store(args.gets, std::sync::atomic::Ordering::Relaxed);
    let _ = paths::ONLY_SIDES.set(args.only_sides.clone());
    minimal::SPLIT.store(args.minimal_split, std::sync::atomic::Ordering::Relaxed);
    let started_unix_s = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let loadavg_start = report::loadavg();
    if args.busy_core {
        eprintln!("--busy-core: a thread spins on one core until the run ends");
        cpu::spin_one_core();
    }
    let (memcached, rows, redis, items) = match args.on_redis() {
        false if args.on_cluster() => {
            let (redis, items) = on_redis_cluster(&args, &loadavg_start)?;
            (None, Vec::new(), redis, items)
        }
        false => {
            let (version, rows, items) = on_memcached(&args, &loadavg_start)?;
            (Some(version), rows, Vec::new(), items)
        }
        true => {
            let (redis, items) = on_redis(&args, &loadavg_start)?;
            (None, Vec::new(), redis, items)
        }
    };
    let rounds = args.rounds;
    let loadavg_end = report::loadavg();
    if !rows.is_empty() {
        println!("{}", report::table(&rows, rounds));
    }
    for server in &redis {
        println!("### {} ({})\n", server.server, server.url);
        println!("{}", report::table(&server.rows, rounds));
    }
    let busy = match args.busy_core {
        true => " (one of them the --busy-core thread)",
        false => "",
    };
    println!("load average: {loadavg_start} at the start, {loadavg_end} at the end{busy}");
    if let Some(file) = &args.json {
        let run = report::Run {
            command: std::env::args().collect::<Vec<_>>().join(" "),
            started_unix_s,
            rounds,
            ops: args.ops,
            slices: args.slices,
            busy_core: args.busy_core,
            memcached,
            machine: report::Machine {
                cpus: std::thread::available_parallelism().map_or(0, usize::from),
                cpu_model: report::cpu_model(),
                loadavg_start,
                loadavg_end,
            },
            items,
            rows,
            redis,
        };
        std::fs::write(file, serde_json::to_string_pretty(&run)? + "\n")?;
    }
    Ok(())
}

/// The sizes of a set of items as stored.
fn item_sizes(items: &items::Items) -> report::ItemSizes {
    let sizes = |v: &[usize]| {
        let mut v = v.to_vec();
        v.sort_unstable();
        v.dedup();
        v
    };
    let sizes = report::ItemSizes {
        key_bytes: items.derived[0].len(),
        value_encoded_bytes: sizes(&items.value_lens),
        stored_bytes: sizes(&items.stored_lens),
    };
    eprintln!(
        "items: {}-byte keys, {:?} bytes stored, of which {:?} the encoded value",
        sizes.key_bytes, sizes.stored_bytes, sizes.value_encoded_bytes,
    );
    sizes
}

/// Every path on three memcached: their version, the rows, the items' sizes.
fn on_memcached(
    args: &Args,
    load: &str,
) -> Result<(String, Vec<stats::Row>, report::ItemSizes), BoxError> {
    let servers = (0..3)
        .map(|_| Memcached::start(args.memcached_threads, 64))
        .collect::<Result<Vec<_>, _>>()?;
    let addrs: Vec<String> = servers.iter().map(|m| m.addr().to_string()).collect();
    eprintln!("memcached on {addrs:?}; load {load}");
    // Their CPU time is counted beside the client's (the three, summed: a path idles the
    // servers it does not use).
    for m in &servers {
        cpu::watch_server(m.pid());
    }
    let memcached = memcached_version(&addrs[0])?;
    let setup = paths::Setup::new(addrs)?;
    let sizes = item_sizes(&setup.single_items);

    let (rounds, ops, slices) = (args.rounds, args.ops, args.slices);
    let mut rows = Vec::new();
    for path in args.paths() {
        match path {
            Path::SyncGet => rows.extend(paths::sync_get(&setup, rounds, ops, slices)?),
            Path::SyncGetMany => rows.extend(paths::sync_get_many(&setup, rounds, ops, slices)?),
            Path::AsyncGetMulti | Path::AsyncGetCurrent | Path::AsyncGet64 => {
                let rt = paths::runtime(path != Path::AsyncGetCurrent)?;
                // Built inside the runtime: the engine's tasks belong to it.
                let cache = rt.block_on(async {
                    newcache::Cache::builder()
                        .memcached([setup.addrs[0].as_str()])
                        .flavor(items::FLAVOR)
                        .version(items::VERSION)
                        .build_async()
                })?;
                rows.extend(match path {
                    Path::AsyncGet64 => paths::async_get_64(
                        &setup,
                        &rt,
                        &cache,
                        (args.ceiling, args.minimal),
                        rounds,
                        ops * 10,
                        slices,
                    )?,
                    _ => paths::async_get(&setup, &rt, &cache, path.name(), rounds, ops, slices)?,
                });
            }
        }
    }
    Ok((memcached, rows, sizes))
}

/// The paths on each Redis / Valkey server, one after another (those started here are stopped
/// once measured): each server's rows, the items' sizes (the first server's).
fn on_redis(
    args: &Args,
    load: &str,
) -> Result<(Vec<report::RedisRows>, report::ItemSizes), BoxError> {
    let mut servers: Vec<(Option<String>, String)> = args
        .redis_server_bin
        .iter()
        .map(|bin| (Some(bin.clone()), String::new()))
        .collect();
    servers.extend(args.redis.iter().map(|url| (None, url.clone())));
    let (rounds, ops, slices) = (args.rounds, args.ops, args.slices);
    let (mut out, mut sizes) = (Vec::new(), None);
    for (bin, url) in servers {
        let started = bin.as_deref().map(redis::Server::start).transpose()?;
        let url = started.as_ref().map_or(url, redis::Server::url);
        let setup = redis_paths::Setup::new(&url)?;
        eprintln!("{} on {url}; load {load}", setup.version);
        let these = item_sizes(&setup.items);
        sizes.get_or_insert(these);
        let mut rows = Vec::new();
        for path in args.paths() {
            match path {
                Path::SyncGet => rows.extend(redis_paths::sync_get(&setup, rounds, ops, slices)?),
                Path::SyncGetMany => unreachable!("refused by Args::check"),
                Path::AsyncGetMulti | Path::AsyncGetCurrent | Path::AsyncGet64 => {
                    let multi = path != Path::AsyncGetCurrent;
                    let rt = paths::runtime(multi)?;
                    let cache = setup.async_cache(&rt)?;
                    rows.extend(match path {
                        Path::AsyncGet64 => redis_paths::async_get_64(
                            &setup,
                            &rt,
                            &cache,
                            rounds,
                            ops * 10,
                            slices,
                        )?,
                        _ => {
                            redis_paths::async_get(&setup, &rt, &cache, multi, rounds, ops, slices)?
                        }
                    });
                }
            }
        }
        out.push(report::RedisRows {
            server: setup.version.clone(),
            url,
            rows,
        });
    }
    Ok((out, sizes.ok_or("no server")?))
}

/// `sync-get-many` on the running Redis Cluster of `--redis-cluster`: its rows, the items'
/// sizes (the batch's, as stored on the cluster).
fn on_redis_cluster(
    args: &Args,
    load: &str,
) -> Result<(Vec<report::RedisRows>, report::ItemSizes), BoxError> {
    let seeds = &args.redis_cluster;
    eprintln!("redis cluster, seeds {seeds:?}; load {load}");
    let config = newcache::RedisConfig::new(seeds[0].as_str());
    let (server, rows, sizes) =
        redis_cluster::sync_get_many(seeds, config.io_timeout, args.rounds, args.ops, args.slices)?;
    eprintln!(
        "items: {}-byte keys, {:?} bytes stored, of which {:?} the encoded value",
        sizes.key_bytes, sizes.stored_bytes, sizes.value_encoded_bytes,
    );
    Ok((
        vec![report::RedisRows {
            server,
            url: seeds.join(","),
            rows,
        }],
        sizes,
    ))
}

/// The server's `version` reply.
pub(crate) fn memcached_version(addr: &str) -> Result<String, BoxError> {
    use std::io::{BufRead, BufReader, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.write_all(b"version\r\n")?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line)?;
    Ok(line.trim().to_string())
}
