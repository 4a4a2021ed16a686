//! Figure 2: two peer processes (`bench bus-peer`, `peer.rs`), each `AsyncCache::get` of keys
//! k0..k999 (a 1,000-byte String each) from 64 tasks on tokio's multi-thread runtime (2
//! workers) while one of its tasks rewrites its 10 keys (1%: k0, k100, ... in one, k50, k150,
//! ... in the other) at `--writes-per-s`, each get followed by
//! `tokio::task::coop::consume_budget` (as a handler's own I/O would yield). Three variants:
//! the near tier on a RedisBus (the Redis server started here, a channel per tier), the near
//! tier alone, no near tier; over memcached and over Redis as the shared tier. Every tier and
//! variant runs in each round, both peers at once, the order rotating round by round. Each
//! process's writer is a thread with a sync view of the measured cache (`to_sync`), so that the
//! readers' tasks do not slow the writes down.

use std::fmt::Write as _;
use std::time::Duration;

use serde::Serialize;

use crate::bus::args::{Args, Tier};
use crate::bus::log::WriteLog;
use crate::bus::peer::{PeerResult, TASKS, VARIANTS};
use crate::bus::values::{KEYS, Link, value};
use crate::floor::items::BoxError;
use crate::floor::stats::{Spread, quantile};

/// One measurement: both peers' figures.
#[derive(Debug, Clone, Serialize)]
pub struct Measurement {
    pub tier: String,
    pub variant: String,
    pub round: usize,
    /// Both peers' gets over the window.
    pub gets_per_s: f64,
    pub peers: Vec<PeerResult>,
}

impl Measurement {
    fn sum(&self, f: impl Fn(&PeerResult) -> u64) -> u64 {
        self.peers.iter().map(f).sum()
    }

    fn stat(&self, name: &str) -> Option<u64> {
        self.peers
            .iter()
            .map(|p| p.stats.get(name).copied())
            .sum::<Option<u64>>()
    }

    fn near_hit_ratio(&self) -> f64 {
        let (h, m) = (
            self.stat("near_hits").unwrap_or(0),
            self.stat("near_misses").unwrap_or(0),
        );
        h as f64 / (h + m) as f64
    }

    /// The cache's hits (near hits included) over its reads.
    fn hit_ratio(&self) -> f64 {
        let (h, m) = (
            self.stat("hits").unwrap_or(0),
            self.stat("misses").unwrap_or(0),
        );
        h as f64 / (h + m) as f64
    }

    /// Gets that returned the current value: not stale.
    fn current_ratio(&self) -> f64 {
        1.0 - self.sum(|p| p.stale) as f64 / self.sum(|p| p.gets) as f64
    }
}

pub fn variant_name(v: &str) -> &'static str {
    match v {
        "near-bus" => "near tier + RedisBus",
        "near" => "near tier alone",
        _ => "no near tier",
    }
}

fn tier_name(t: Tier) -> &'static str {
    match t {
        Tier::Memcached => "memcached",
        Tier::Redis => "redis",
    }
}

/// The figure, over the memcached at `memcached` (if any) and the Redis at `redis`.
pub fn run(
    args: &Args,
    memcached: Option<&str>,
    redis: &str,
) -> Result<Vec<Measurement>, BoxError> {
    let tiers: Vec<&str> = args.tiers().into_iter().map(tier_name).collect();
    // The values every generation-0 read returns, written once.
    for &tier in &tiers {
        for variant in VARIANTS {
            let b = newcache::Cache::builder().flavor(format!("bus-gets-{variant}"));
            let cache = match tier {
                "memcached" => b.memcached([memcached.ok_or("no memcached")?]),
                _ => b.redis(redis),
            }
            .build()?;
            for i in 0..KEYS {
                cache.set(&format!("k{i}"), &value(i, 0), Duration::from_secs(3600))?;
            }
        }
    }
    let dir = match std::path::Path::new("/dev/shm").is_dir() {
        true => "/dev/shm".into(),
        false => std::env::temp_dir(),
    };
    let log_path = dir.join(format!("newcache-bench-bus-{}", std::process::id()));
    let _ = std::fs::remove_file(&log_path);
    let _log = WriteLog::create(&log_path)?;
    let mut peers = Vec::new();
    for id in 0..2 {
        let mut argv: Vec<String> = vec!["bus-peer".into(), "--id".into(), id.to_string()];
        if let Some(m) = memcached.filter(|_| tiers.contains(&"memcached")) {
            argv.extend(["--memcached".into(), m.to_owned()]);
        }
        argv.extend(
            [
                "--redis",
                redis,
                "--channel",
                "bus-gets",
                "--near-ttl",
                &args.near_ttl.to_string(),
                "--writes-per-s",
                &args.writes_per_s.to_string(),
                "--bound-ms",
                &args.bound_ms.to_string(),
                "--log",
                &log_path.to_string_lossy(),
            ]
            .map(String::from),
        );
        peers.push(Link::spawn(&format!("peer-{id}"), &argv)?);
    }
    for p in &mut peers {
        let line = p.recv(Duration::from_secs(60))?;
        if line != "ready" {
            return Err(format!("{}: {line}", p.name).into());
        }
    }
    let combos: Vec<(&str, &str)> = tiers
        .iter()
        .flat_map(|&t| VARIANTS.iter().map(move |&v| (t, v)))
        .collect();
    let limit = Duration::from_secs_f64(args.warmup + args.duration + 60.0);
    let mut out = Vec::new();
    for round in 0..args.rounds {
        for k in 0..combos.len() {
            let (tier, variant) = combos[(round + k) % combos.len()];
            let cmd = format!(
                "run {tier} {variant} {round} {} {}",
                args.warmup, args.duration
            );
            for p in &mut peers {
                p.send(&cmd)?;
            }
            let mut results = Vec::new();
            for p in &mut peers {
                let line = p.recv(limit)?;
                let json = line
                    .strip_prefix("result ")
                    .ok_or_else(|| format!("{}: {line}", p.name))?;
                results.push(serde_json::from_str::<PeerResult>(json)?);
            }
            let gets: u64 = results.iter().map(|r| r.gets).sum();
            let m = Measurement {
                tier: tier.into(),
                variant: variant.into(),
                round,
                gets_per_s: gets as f64 / args.duration,
                peers: results,
            };
            eprintln!(
                "gets round {}/{} {tier:<9} {:<20} {:>9.0} gets/s  near hit {:.5}  hit {:.5}  stale {} (past bound {}, max {:.1} ms)  writes {}  errors {}  bus sent {:?} received {:?} dropped {:?} flushes {:?}",
                round + 1,
                args.rounds,
                variant_name(variant),
                m.gets_per_s,
                m.near_hit_ratio(),
                m.hit_ratio(),
                m.sum(|p| p.stale),
                m.sum(|p| p.stale_past_bound),
                m.peers.iter().map(|p| p.max_stale_ms).fold(0.0, f64::max),
                m.sum(|p| p.writes),
                m.sum(|p| p.errors),
                m.stat("bus_sent"),
                m.stat("bus_received"),
                m.stat("bus_keys_dropped"),
                m.stat("bus_flushes"),
            );
            for p in &m.peers {
                if let Some(e) = &p.first_error {
                    eprintln!("  peer {} first error: {e}", p.peer);
                }
            }
            out.push(m);
        }
    }
    for p in &mut peers {
        let _ = p.send("quit");
    }
    drop(peers);
    let _ = std::fs::remove_file(&log_path);
    Ok(out)
}

/// One table per tier: medians over the rounds.
pub fn table(ms: &[Measurement], args: &Args) -> String {
    let mut out = String::new();
    let mut tiers: Vec<&str> = ms.iter().map(|m| m.tier.as_str()).collect();
    tiers.dedup();
    tiers.sort();
    tiers.dedup();
    for tier in tiers {
        let _ = writeln!(
            out,
            "{tier}: two processes x {TASKS} tasks, 1,000 keys (1 KB String), each process rewriting its 10 keys (1%) at {} writes/s; medians of {} rounds; stale: a get returning an older value than one whose write returned before the get began; the bound {} ms\n",
            args.writes_per_s, args.rounds, args.bound_ms
        );
        let _ = writeln!(
            out,
            "| variant | gets/s, both processes (IQR) | near hit ratio | hit ratio (hits / gets) | gets returning the current value | stale reads past the bound (total) | stalest read ms (max) | writes/s | bus sent / received / keys dropped / flushes (a round) |"
        );
        let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|");
        for variant in VARIANTS {
            let mine: Vec<&Measurement> = ms
                .iter()
                .filter(|m| m.tier == tier && m.variant == variant)
                .collect();
            if mine.is_empty() {
                continue;
            }
            let med = |f: &dyn Fn(&Measurement) -> f64| {
                quantile(&mine.iter().map(|m| f(m)).collect::<Vec<_>>(), 0.5)
            };
            let g = Spread::of(&mine.iter().map(|m| m.gets_per_s).collect::<Vec<_>>());
            let past: u64 = mine.iter().map(|m| m.sum(|p| p.stale_past_bound)).sum();
            let stalest = mine
                .iter()
                .flat_map(|m| m.peers.iter().map(|p| p.max_stale_ms))
                .fold(0.0, f64::max);
            let near = match variant {
                "none" => "-".to_string(),
                _ => format!("{:.5}", med(&|m| m.near_hit_ratio())),
            };
            let bus = match variant {
                "near-bus" => {
                    let median_of = |name: &str| {
                        let xs: Vec<f64> = mine
                            .iter()
                            .filter_map(|m| m.stat(name).map(|x| x as f64))
                            .collect();
                        match xs.is_empty() {
                            true => "-".to_string(),
                            false => format!("{:.0}", quantile(&xs, 0.5)),
                        }
                    };
                    format!(
                        "{} / {} / {} / {}",
                        median_of("bus_sent"),
                        median_of("bus_received"),
                        median_of("bus_keys_dropped"),
                        median_of("bus_flushes")
                    )
                }
                _ => "-".into(),
            };
            let _ = writeln!(
                out,
                "| {} | {:.0} ({:.0}-{:.0}) | {} | {:.5} | {:.5} | {} | {:.1} ({:.1}) | {:.0} | {} |",
                variant_name(variant),
                g.median,
                g.q1,
                g.q3,
                near,
                med(&|m| m.hit_ratio()),
                med(&|m| m.current_ratio()),
                past,
                med(&|m| m.peers.iter().map(|p| p.max_stale_ms).fold(0.0, f64::max)),
                stalest,
                med(&|m| m.sum(|p| p.writes) as f64 / m.peers[0].window_s),
                bus,
            );
        }
        let errors: u64 = ms
            .iter()
            .filter(|m| m.tier == tier)
            .map(|m| m.sum(|p| p.errors))
            .sum();
        let _ = writeln!(out, "\nerrors (wrong values, misses, failures): {errors}\n");
    }
    out
}
