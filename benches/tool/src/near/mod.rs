//! The near tier (`CacheBuilder::near_cache`, issue 50) beside what it is measured against, on
//! one memcached started here:
//!
//! | figure | what | beside |
//! |---|---|---|
//! | `hit` | a near hit: `get_arc` / `get` through `Cache` and `AsyncCache`, one caller and 64 tasks | quick_cache `get` of an `Arc<T>`; quick_cache `get` of the bytes + one `rmp_serde` decode |
//! | `rewrite` | `AsyncCache::get` of 1,000 hot keys from 64 tasks while another writer rewrites 1% of them | the same cache without a near tier |
//! | `outage` | `AsyncCache::get_or_set_with` from 64 tasks while memcached is down | the same cache without a near tier |
//!
//! ```text
//! cargo run --release -p newcache-bench -- near [--figure hit|rewrite|outage ...] [--rounds 9]
//!     [--ops 1000000] [--callers sync-one|async-one|async-64|sync-64 ...]
//!     [--kind struct|string ...] [--only-side N ...]
//!     [--writer process|thread|thread-near] [--writes-per-s 1000] [--json FILE]
//! ```
//!
//! `hit` interleaves its four sides as `bench floor` does (slices of alternating order, one
//! ratio per round, the median of the rounds'); `rewrite` alternates with and without the near
//! tier measurement by measurement; `outage` alternates them run by run.

pub(crate) mod args;
pub(crate) mod hit;
pub(crate) mod outage;
pub(crate) mod rewrite;
pub(crate) mod values;

use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::floor::items::BoxError;
use crate::floor::report;
use crate::floor::stats::Row;
use crate::hot::server::Memcached;
use args::{Args, Figure};

/// What `--json` holds.
#[derive(Debug, Serialize)]
struct Run {
    command: String,
    started_unix_s: f64,
    memcached: String,
    machine: report::Machine,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    hit_rows: Vec<Row>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    hit_checks: Vec<hit::Check>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    rewrite: Vec<rewrite::Measurement>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    outage: Vec<outage::Timeline>,
}

/// Runs `bench near`.
pub fn run(args: Args) -> Result<(), BoxError> {
    let args = args.checked();
    let _ = crate::floor::paths::ONLY_SIDES.set(args.only_sides.clone());
    let started_unix_s = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let loadavg_start = report::loadavg();
    // Declared before the runtime, so that it is stopped after it.
    let mut server = Memcached::start(args.memcached_threads, 256)?;
    let version = crate::floor::memcached_version(server.addr())?;
    eprintln!("{version} on {}; load {loadavg_start}", server.addr());
    crate::floor::cpu::watch_server(server.pid());
    let rt = crate::floor::paths::runtime(true)?;
    let mut out = Run {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        started_unix_s,
        memcached: version,
        machine: report::Machine {
            cpus: std::thread::available_parallelism().map_or(0, usize::from),
            cpu_model: report::cpu_model(),
            loadavg_start,
            loadavg_end: String::new(),
        },
        hit_rows: Vec::new(),
        hit_checks: Vec::new(),
        rewrite: Vec::new(),
        outage: Vec::new(),
    };
    for figure in args.figures() {
        match figure {
            Figure::Hit => {
                let (rows, checks) = hit::run(
                    &rt,
                    server.addr(),
                    &args.callers(),
                    &args.kinds(),
                    args.rounds,
                    args.ops,
                    args.slices,
                )?;
                println!("{}", report::table(&rows, args.rounds));
                out.hit_rows = rows;
                out.hit_checks = checks;
            }
            Figure::Rewrite => {
                let measured = rewrite::run(&rt, server.addr(), &args)?;
                println!("{}", rewrite::table(&measured));
                out.rewrite = measured;
            }
            Figure::Outage => {
                let timelines = outage::run(&rt, &mut server, &args)?;
                println!("{}", outage::table(&timelines, &args));
                out.outage = timelines;
            }
        }
    }
    out.machine.loadavg_end = report::loadavg();
    println!(
        "load average: {} at the start, {} at the end",
        out.machine.loadavg_start, out.machine.loadavg_end
    );
    if let Some(file) = &args.json {
        std::fs::write(file, serde_json::to_string_pretty(&out)? + "\n")?;
    }
    Ok(())
}
