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
//! ```text
//! cargo run --release -p newcache-floor -- [--rounds 9] [--ops 20000] [--slices 10]
//!     [--path NAME ...] [--json FILE]
//! ```
//!
//! Per path: one uncounted warm-up run of each side, then `--rounds` rounds; a round runs the
//! client and its floor in `--slices` slices whose order alternates (A B, B A, ...; the first
//! slice's order alternates by round). Each round's ratio is the client's figure over the
//! floor's from the same round; the table gives their median and interquartile range, and each
//! side's median figure. Three memcached (`-t 2`) are started on free loopback ports and stopped
//! on exit.

mod args;
mod items;
mod paths;
mod report;
#[path = "../../hot/src/server.rs"]
mod server;
mod stats;

use std::time::{SystemTime, UNIX_EPOCH};

use args::{Args, Path};
use items::BoxError;
use server::Memcached;

fn main() -> Result<(), BoxError> {
    let args = Args::from_command_line();
    let started_unix_s = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let loadavg_start = report::loadavg();
    let servers = (0..3)
        .map(|_| Memcached::start(args.memcached_threads, 64))
        .collect::<Result<Vec<_>, _>>()?;
    let addrs: Vec<String> = servers.iter().map(|m| m.addr().to_string()).collect();
    eprintln!("memcached on {addrs:?}; load {loadavg_start}");
    let memcached = memcached_version(&addrs[0])?;
    let setup = paths::Setup::new(addrs)?;
    let sizes = |v: &[usize]| {
        let mut v = v.to_vec();
        v.sort_unstable();
        v.dedup();
        v
    };
    let stored = sizes(&setup.single_items.stored_lens);
    let values = sizes(&setup.single_items.value_lens);
    eprintln!(
        "items: {}-byte keys, {stored:?} bytes stored, of which {values:?} the encoded value",
        setup.single_items.derived[0].len(),
    );

    let (rounds, ops, slices) = (args.rounds, args.ops, args.slices);
    let mut rows = Vec::new();
    for &path in &args.paths {
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
                    Path::AsyncGet64 => {
                        paths::async_get_64(&setup, &rt, &cache, rounds, ops * 10, slices)?
                    }
                    _ => paths::async_get(&setup, &rt, &cache, path.name(), rounds, ops, slices)?,
                });
            }
        }
    }

    let table = report::table(&rows, rounds);
    let loadavg_end = report::loadavg();
    println!("{table}");
    println!("load average: {loadavg_start} at the start, {loadavg_end} at the end");
    if let Some(file) = &args.json {
        let run = report::Run {
            command: std::env::args().collect::<Vec<_>>().join(" "),
            started_unix_s,
            rounds,
            ops,
            slices,
            memcached,
            machine: report::Machine {
                cpus: std::thread::available_parallelism().map_or(0, usize::from),
                cpu_model: report::cpu_model(),
                loadavg_start,
                loadavg_end,
            },
            items: report::ItemSizes {
                key_bytes: setup.single_items.derived[0].len(),
                value_encoded_bytes: values,
                stored_bytes: stored,
            },
            rows,
        };
        std::fs::write(file, serde_json::to_string_pretty(&run)? + "\n")?;
    }
    Ok(())
}

/// The server's `version` reply.
fn memcached_version(addr: &str) -> Result<String, BoxError> {
    use std::io::{BufRead, BufReader, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.write_all(b"version\r\n")?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line)?;
    Ok(line.trim().to_string())
}
