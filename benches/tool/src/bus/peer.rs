//! Figure 2's peer process (`bench bus-peer`): every tier's three caches (near tier and bus,
//! near tier alone, no near tier), and the measurements it is told to run: 64 tasks calling
//! `AsyncCache::get` on random keys of k0..k999 while a task rewrites this peer's 10 keys
//! (1%). Each write's return time goes in a log both peers map (`log.rs`), so that a read can
//! be judged against every write that returned before it started: a read of a rewritten key that returns generation g when generation g + 1's write
//! returned before the read started is stale, by the time between the two.

use std::collections::{BTreeMap, HashMap};
use std::io::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::bus::args::PeerArgs;
use crate::bus::log::{Next, WriteLog};
use crate::bus::values::{KEYS, Rng, now_ns, parse, stats_delta, value};
use crate::floor::items::BoxError;

/// The callers.
pub const TASKS: usize = 64;
const TTL: Duration = Duration::from_secs(3600);

/// The variants measured.
pub const VARIANTS: [&str; 3] = ["near-bus", "near", "none"];

/// Whether key `i` is rewritten (by peer 0 if `i % 100 == 0`, by peer 1 if `i % 100 == 50`).
pub fn rewritten(i: usize) -> bool {
    i.is_multiple_of(50)
}

/// One peer's figures of one measurement (the counted window).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PeerResult {
    pub peer: usize,
    pub tier: String,
    pub variant: String,
    pub round: usize,
    pub window_s: f64,
    pub gets: u64,
    pub errors: u64,
    pub first_error: Option<String>,
    /// Reads of a rewritten key that returned an older generation than one whose write had
    /// returned when the read started.
    pub stale: u64,
    /// Of those, the ones older by more than the bound.
    pub stale_past_bound: u64,
    pub max_stale_ms: f64,
    /// This peer's writes in the window.
    pub writes: u64,
    /// The cache's counters over the window.
    pub stats: BTreeMap<String, u64>,
}

/// A task's figures.
#[derive(Default)]
struct Tally {
    gets: u64,
    errors: u64,
    first_error: Option<String>,
    stale: u64,
    stale_past_bound: u64,
    max_stale_ns: u64,
}

impl Tally {
    fn merge(mut self, o: Tally) -> Tally {
        self.gets += o.gets;
        self.errors += o.errors;
        self.first_error = self.first_error.or(o.first_error);
        self.stale += o.stale;
        self.stale_past_bound += o.stale_past_bound;
        self.max_stale_ns = self.max_stale_ns.max(o.max_stale_ns);
        self
    }
}

/// Reads of random keys until `end`, counted from `start`.
async fn read(
    cache: newcache::AsyncCache,
    keys: Arc<Vec<String>>,
    (log, combo): (Arc<WriteLog>, usize),
    seed: u64,
    (start, end): (Instant, Instant),
    bound_ns: u64,
) -> Tally {
    let mut t = Tally::default();
    let mut rng = Rng(seed);
    loop {
        let i = (rng.next() % KEYS as u64) as usize;
        let t0 = Instant::now();
        if t0 >= end {
            return t;
        }
        let counted = t0 >= start;
        // Only the rewritten keys can be stale: only their reads are timed.
        let begun = match rewritten(i) {
            true => now_ns(),
            false => 0,
        };
        let got = cache.get::<String>(&keys[i]).await;
        tokio::task::coop::consume_budget().await;
        if !counted {
            continue;
        }
        t.gets += 1;
        let err = match got {
            Ok(Some(v)) => match parse(&v) {
                Some((k, g)) if k == i => {
                    // Stale if the next generation's write returned before this read began.
                    let age = match rewritten(i).then(|| log.next(combo, i, g)) {
                        Some(Next::At(next)) => begun.checked_sub(next).filter(|&a| a > 0),
                        Some(Next::LongAgo) => Some(u64::MAX),
                        _ => None,
                    };
                    if let Some(age) = age {
                        t.stale += 1;
                        t.stale_past_bound += u64::from(age > bound_ns);
                        t.max_stale_ns = t.max_stale_ns.max(age);
                    }
                    None
                }
                _ => Some(format!("key {i}: a value of key {:?}", parse(&v))),
            },
            Ok(None) => Some(format!("key {i}: a miss")),
            Err(e) => Some(e.to_string()),
        };
        if let Some(e) = err {
            t.errors += 1;
            t.first_error.get_or_insert(e);
        }
    }
}

/// Rewrites this peer's keys through `cache` (a sync view of the measured cache, on a thread
/// of its own: the readers' tasks do not delay it), `rate` writes a second in passes over the
/// keys, until `end`: the writes counted from `start`. Each write's return goes in the log.
fn write(
    cache: newcache::Cache,
    keys: &[String],
    (log, combo): (&WriteLog, usize),
    generations: &mut [u64],
    mine: &[usize],
    rate: u64,
    (start, end): (Instant, Instant),
) -> Result<u64, BoxError> {
    let every = Duration::from_secs_f64(mine.len() as f64 / rate as f64);
    let (mut writes, mut next) = (0, Instant::now());
    while Instant::now() < end {
        for &i in mine {
            generations[i] += 1;
            let g = generations[i];
            cache.set(&keys[i], &value(i, g), TTL)?;
            log.record(combo, i, g, now_ns());
            writes += u64::from(Instant::now() >= start);
        }
        next += every;
        let now = Instant::now();
        match next.checked_duration_since(now) {
            Some(wait) => std::thread::sleep(wait),
            // Behind by more than a second: no burst to catch up.
            None if now - next > Duration::from_secs(1) => next = now,
            None => {}
        }
    }
    Ok(writes)
}

/// The tiers' addresses this peer builds caches over.
fn builder(args: &PeerArgs, tier: &str, variant: &str) -> newcache::CacheBuilder {
    // The near tier alone names its server otherwise than the bus's cache does: caches of one
    // process over the same servers share a write fence and the bus's copy drops.
    let host = |s: &str| match variant {
        "near" => s.replace("127.0.0.1", "localhost"),
        _ => s.to_owned(),
    };
    let b = newcache::Cache::builder().flavor(format!("bus-gets-{variant}"));
    match tier {
        "memcached" => b.memcached([host(args.memcached.as_deref().unwrap_or("?"))]),
        _ => b.redis(host(&args.redis)),
    }
}

/// The log's index of a tier and variant.
pub fn combo(tier: &str, variant: &str) -> usize {
    let t = usize::from(tier != "memcached");
    t * VARIANTS.len() + VARIANTS.iter().position(|&v| v == variant).unwrap_or(0)
}

/// `bench bus-peer`.
pub fn peer_main(args: PeerArgs) -> Result<(), BoxError> {
    let rt = crate::floor::paths::runtime(true)?;
    let tiers: Vec<&str> = match args.memcached {
        Some(_) => vec!["memcached", "redis"],
        None => vec!["redis"],
    };
    let near_ttl = Duration::from_secs_f64(args.near_ttl);
    let log = Arc::new(WriteLog::open(&args.log)?);
    let mut caches = HashMap::new();
    let mut generations = HashMap::new();
    let _guard = rt.enter();
    for &tier in &tiers {
        for variant in VARIANTS {
            let b = builder(&args, tier, variant);
            let b = match variant {
                "none" => b,
                _ => b.near_cache(64 << 20).near_ttl(near_ttl),
            };
            let b = match variant {
                "near-bus" => b.near_bus(newcache::RedisBus::new(
                    &args.redis,
                    format!("{}-{tier}", args.channel),
                )?),
                _ => b,
            };
            caches.insert(combo(tier, variant), b.build_async()?);
            generations.insert(combo(tier, variant), vec![0u64; KEYS]);
        }
    }
    let keys: Arc<Vec<String>> = Arc::new((0..KEYS).map(|i| format!("k{i}")).collect());
    let mine: Vec<usize> = (0..KEYS).filter(|i| i % 100 == 50 * args.id).collect();
    let say = |line: &str| -> Result<(), BoxError> {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{line}")?;
        out.flush()?;
        Ok(())
    };
    say("ready")?;
    for line in std::io::stdin().lines() {
        let line = line?;
        let f: Vec<&str> = line.split(' ').collect();
        let ["run", tier, variant, round, warmup, duration] = f.as_slice() else {
            break;
        };
        let c = combo(tier, variant);
        let cache = caches.get(&c).ok_or("no such cache")?.clone();
        let start = Instant::now() + Duration::from_secs_f64(warmup.parse()?);
        let window = Duration::from_secs_f64(duration.parse()?);
        let end = start + window;
        let bound_ns = (args.bound_ms * 1e6) as u64;
        let gens = generations.get_mut(&c).ok_or("no such cache")?;
        let (tally, writes, before, after) = std::thread::scope(|s| {
            let writer = s.spawn(|| {
                write(
                    cache.to_sync(),
                    &keys,
                    (&log, c),
                    gens,
                    &mine,
                    args.writes_per_s,
                    (start, end),
                )
            });
            let read = rt.block_on(async {
                let readers: Vec<_> = (0..TASKS)
                    .map(|t| {
                        let seed = now_ns() ^ ((t as u64 + 1) << 32) ^ args.id as u64;
                        tokio::spawn(read(
                            cache.clone(),
                            Arc::clone(&keys),
                            (Arc::clone(&log), c),
                            seed,
                            (start, end),
                            bound_ns,
                        ))
                    })
                    .collect();
                tokio::time::sleep_until(start.into()).await;
                let before = cache.stats();
                tokio::time::sleep_until(end.into()).await;
                let after = cache.stats();
                let mut tally = Tally::default();
                for r in readers {
                    tally = tally.merge(r.await?);
                }
                Ok::<_, BoxError>((tally, before, after))
            });
            let writes = writer.join().map_err(|_| "the writer panicked")?;
            let (tally, before, after) = read?;
            Ok::<_, BoxError>((tally, writes?, before, after))
        })?;
        let result = PeerResult {
            peer: args.id,
            tier: tier.to_string(),
            variant: variant.to_string(),
            round: round.parse()?,
            window_s: window.as_secs_f64(),
            gets: tally.gets,
            errors: tally.errors,
            first_error: tally.first_error,
            stale: tally.stale,
            stale_past_bound: tally.stale_past_bound,
            max_stale_ms: tally.max_stale_ns as f64 / 1e6,
            writes,
            stats: stats_delta(&before, &after),
        };
        say(&format!("result {}", serde_json::to_string(&result)?))?;
    }
    Ok(())
}
