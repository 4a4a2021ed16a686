//! Figure 1: write-to-invalidation latency. A reader (another process, or for the in-process
//! bus a thread with a cache of its own) holds a near copy of one key and, once it says so,
//! calls `Cache::get` in a tight loop; this process then writes the key's next value through
//! its own cache on the same bus. A sample is the time from the write's return here to the
//! return of the reader's first `get` that gives the new value, both read from
//! CLOCK_MONOTONIC. Every cache has a near tier with a near ttl of one hour (no copy ages
//! out), over one memcached. Beside each transport, its floor (`floor.rs`): the same store,
//! publish and read on bare sockets. The transports and floors alternate in rounds of
//! `--samples` samples.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::bus::args::{Args, ReaderArgs, Transport};
use crate::bus::floor;
use crate::bus::values::{Link, Rng, bus, now_ns, parse, stats_delta, value};
use crate::floor::items::BoxError;
use crate::floor::stats::quantile;

/// The key every sample writes (under a flavor per transport).
const KEY: &str = "bus-latency";
const NEAR_TTL: Duration = Duration::from_secs(3600);
const TTL: Duration = Duration::from_secs(3600);
/// How long a sample may take before the reader's threads are shown.
const STUCK: Duration = Duration::from_millis(500);
/// How long a reader waits for a value before it gives up on a sample.
const PATIENCE: Duration = Duration::from_secs(10);

/// One sample.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    pub transport: &'static str,
    pub round: usize,
    /// From the write's return (here) to the reader's `get` returning the new value.
    pub latency_us: f64,
    /// That last `get`'s own time (a near miss: the shared tier's round trip).
    pub last_get_us: f64,
    /// The reader's `get`s that still returned the old value.
    pub polls: u64,
    /// The reader's bus counters that moved from its `ready` to its `seen`.
    pub reader_bus: BTreeMap<String, u64>,
    /// The writer's bus counters that moved from just before its write to the reader's `seen`.
    pub writer_bus: BTreeMap<String, u64>,
}

/// A sample's figures, before it is named.
struct Seen {
    latency_us: f64,
    last_get_us: f64,
    polls: u64,
    reader_bus: BTreeMap<String, u64>,
    writer_bus: BTreeMap<String, u64>,
}

/// The bus counters of a delta that moved.
fn bus_moved(delta: BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    delta
        .into_iter()
        .filter(|(k, v)| k.starts_with("bus_") && *v > 0)
        .collect()
}

/// A transport's figures over every round.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub transport: &'static str,
    pub server: String,
    pub samples: usize,
    pub timeouts: usize,
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    pub last_get_p50_us: f64,
    /// The lowest and highest of the rounds' medians.
    pub round_p50_us: (f64, f64),
}

/// What a pair measures: a transport through newcache, or (`floor`) on bare sockets.
pub fn name(t: Transport, floor: bool) -> &'static str {
    match (t, floor) {
        (Transport::Redis, false) => "RedisBus, redis-server",
        (Transport::Redis, true) => "floor: set, PUBLISH, get on bare sockets, redis-server",
        (Transport::Valkey, false) => "RedisBus, valkey-server",
        (Transport::Valkey, true) => "floor: set, PUBLISH, get on bare sockets, valkey-server",
        (Transport::Cluster, false) => "RedisBus::cluster, Redis Cluster",
        (Transport::Cluster, true) => {
            "floor: set, SPUBLISH at the owner, get on bare sockets, Redis Cluster"
        }
        (Transport::InProcess, false) => "InProcessBus (reader a thread of the writer's process)",
        (Transport::InProcess, true) => "floor: set, a channel to a thread, get on a bare socket",
    }
}

/// The writer of a pair.
enum Writer {
    Cache(newcache::Cache),
    Floor(floor::Writer),
}

impl Writer {
    fn stats(&self) -> Option<newcache::Stats> {
        match self {
            Writer::Cache(c) => Some(c.stats()),
            Writer::Floor(_) => None,
        }
    }

    /// Writes generation `generation` of the key: CLOCK_MONOTONIC when the write returned.
    fn write(&mut self, generation: u64) -> Result<u64, BoxError> {
        match self {
            Writer::Cache(c) => {
                c.set(KEY, &value(0, generation), TTL)?;
                Ok(now_ns())
            }
            Writer::Floor(f) => f.write(generation),
        }
    }
}

/// A transport (or its floor) under test: the writer here and the reader.
struct Pair {
    name: &'static str,
    server: String,
    writer: Writer,
    reader: Link,
    generation: u64,
}

impl Pair {
    /// One sample: the reader arms (holds a near copy of the current value), this side waits a
    /// random jitter, writes the next value, and hears when the reader saw it.
    fn sample(&mut self, rng: &mut Rng, jitter: Duration) -> Result<Option<Seen>, BoxError> {
        let old = self.generation;
        self.reader.send(&format!("arm {old}"))?;
        let ready = self.reader.recv(PATIENCE * 2)?;
        if ready != "ready" {
            return Err(format!("{}: {ready}", self.reader.name).into());
        }
        let wait = jitter.mul_f64((rng.next() % 1_000_000) as f64 / 1e6);
        std::thread::sleep(wait);
        self.generation += 1;
        let before = self.writer.stats();
        let written = self.writer.write(self.generation)?;
        let seen = match self.reader.recv(STUCK) {
            Ok(seen) => seen,
            Err(_) => {
                // Slow: what the reader's threads are doing now.
                if let Some(pid) = self.reader.pid() {
                    eprintln!(
                        "  {}: no word after {STUCK:?}; the reader's threads:\n{}",
                        self.name,
                        threads(pid)
                    );
                }
                self.reader.recv(PATIENCE * 2)?
            }
        };
        let writer_bus = match (before, self.writer.stats()) {
            (Some(before), Some(after)) => bus_moved(stats_delta(&before, &after)),
            _ => BTreeMap::new(),
        };
        let f: Vec<&str> = seen.splitn(6, ' ').collect();
        match f.as_slice() {
            ["seen", generation, at, last, polls, reader_bus] => {
                let g: u64 = generation.parse()?;
                if g != self.generation {
                    return Err(
                        format!("the reader saw generation {g}, not {}", self.generation).into(),
                    );
                }
                let at: u64 = at.parse()?;
                let latency = (at as i128 - written as i128) as f64 / 1e3;
                Ok(Some(Seen {
                    latency_us: latency,
                    last_get_us: last.parse::<f64>()? / 1e3,
                    polls: polls.parse()?,
                    reader_bus: serde_json::from_str(reader_bus)?,
                    writer_bus,
                }))
            }
            ["timeout", ..] => Ok(None),
            _ => Err(format!("{}: {seen}", self.reader.name).into()),
        }
    }
}

/// Each thread of process `pid`: its name, state, kernel wait channel and current system call
/// (from /proc).
fn threads(pid: u32) -> String {
    let mut out = String::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for t in tasks.flatten() {
        let p = t.path();
        let read = |f: &str| std::fs::read_to_string(p.join(f)).unwrap_or_default();
        let stat = read("stat");
        let state = stat
            .rsplit(") ")
            .next()
            .and_then(|r| r.split(' ').next())
            .unwrap_or("?");
        let _ = writeln!(
            out,
            "    {} {:<22} {state} wchan {:<24} syscall {}",
            t.file_name().to_string_lossy(),
            read("comm").trim(),
            read("wchan").trim(),
            read("syscall")
                .split(' ')
                .take(2)
                .collect::<Vec<_>>()
                .join(" ")
                .trim(),
        );
    }
    out
}

fn builder(memcached: &str, flavor: &str) -> newcache::CacheBuilder {
    newcache::Cache::builder()
        .memcached([memcached])
        .flavor(flavor)
        .near_cache(1 << 20)
        .near_ttl(NEAR_TTL)
}

/// The figure: every transport in `args.transports()`, over the memcached at `memcached`, the
/// Redis-protocol servers at `redis` and `valkey` (URL, version).
pub fn run(
    args: &Args,
    memcached: &str,
    redis: &(String, String),
    valkey: &Option<(String, String)>,
) -> Result<(Vec<Summary>, Vec<Sample>), BoxError> {
    let mut pairs = Vec::new();
    for t in args.transports() {
        let flavor = format!("bus-latency-{t:?}").to_lowercase();
        let channel = flavor.clone();
        let (spec, server) = match t {
            Transport::Redis => (format!("redis:{}", redis.0), redis.1.clone()),
            Transport::Valkey => {
                let v = valkey.as_ref().ok_or("no valkey-server")?;
                (format!("redis:{}", v.0), v.1.clone())
            }
            Transport::Cluster => (
                format!("cluster:{}", args.redis_cluster.join(",")),
                "Redis Cluster".into(),
            ),
            Transport::InProcess => (String::new(), "-".into()),
        };
        let (writer, reader) = match t {
            Transport::InProcess => {
                let bus = newcache::InProcessBus::new();
                let writer = builder(memcached, &flavor).near_bus(bus.clone()).build()?;
                // The same server named otherwise: caches of one process over the same servers
                // share a write fence, which would stop the reader's copy without the bus.
                let elsewhere = memcached.replace("127.0.0.1", "localhost");
                let reader_cache = builder(&elsewhere, &flavor).near_bus(bus).build()?;
                let spin = args.reader_spin;
                let reader = Link::thread("reader-in-process", move |rx, mut tx| {
                    if let Err(e) = read(&reader_cache, spin, rx.into_iter(), &mut tx) {
                        tx(format!("error {e}"));
                    }
                })?;
                (writer, reader)
            }
            _ => {
                let writer = builder(memcached, &flavor)
                    .near_bus(bus(&spec, &channel)?)
                    .build()?;
                let mut argv: Vec<String> = [
                    "bus-reader",
                    "--memcached",
                    memcached,
                    "--flavor",
                    &flavor,
                    "--bus",
                    &spec,
                    "--channel",
                    &channel,
                ]
                .iter()
                .map(|s| s.to_string())
                .collect();
                if args.reader_spin {
                    argv.push("--spin".into());
                }
                let reader = Link::spawn(&format!("reader-{t:?}"), &argv)?;
                (writer, reader)
            }
        };
        writer.set(KEY, &value(0, 0), TTL)?;
        let (floor_writer, floor_reader) = floor::pair(
            memcached,
            (t != Transport::InProcess).then_some(spec.as_str()),
            &format!("{flavor}-floor"),
        )?;
        pairs.push(Pair {
            name: name(t, false),
            server: server.clone(),
            writer: Writer::Cache(writer),
            reader,
            generation: 0,
        });
        pairs.push(Pair {
            name: name(t, true),
            server,
            writer: Writer::Floor(floor_writer),
            reader: floor_reader,
            generation: 0,
        });
    }
    let jitter = Duration::from_secs_f64(args.jitter_ms / 1e3);
    let mut rng = Rng(now_ns());
    // Until the bus delivers (its subscribers connect in the background), then the warm-up.
    for p in &mut pairs {
        let t0 = Instant::now();
        loop {
            match p.sample(&mut rng, jitter)? {
                Some(seen) if seen.latency_us < 1e6 => break,
                _ if t0.elapsed() > Duration::from_secs(60) => {
                    return Err(format!("{}: the bus never delivered", p.name).into());
                }
                _ => {}
            }
        }
        eprintln!("{}: delivering after {:?}", p.name, t0.elapsed());
        for _ in 0..args.warmup_samples {
            p.sample(&mut rng, jitter)?;
        }
    }
    let mut samples = Vec::new();
    let mut timeouts = vec![0usize; pairs.len()];
    for round in 0..args.rounds {
        let n = pairs.len();
        for k in 0..n {
            let j = (round + k) % n;
            let p = &mut pairs[j];
            let mut lat = Vec::new();
            for i in 0..args.samples {
                match p.sample(&mut rng, jitter)? {
                    Some(seen) => {
                        lat.push(seen.latency_us);
                        if seen.latency_us > 10_000.0 {
                            eprintln!(
                                "  {}: sample {i}: {:.1} ms; the reader's bus counters {:?}, the writer's {:?}",
                                p.name,
                                seen.latency_us / 1e3,
                                seen.reader_bus,
                                seen.writer_bus
                            );
                        }
                        samples.push(Sample {
                            transport: p.name,
                            round,
                            latency_us: seen.latency_us,
                            last_get_us: seen.last_get_us,
                            polls: seen.polls,
                            reader_bus: seen.reader_bus,
                            writer_bus: seen.writer_bus,
                        });
                    }
                    None => timeouts[j] += 1,
                }
            }
            eprintln!(
                "latency round {}/{} {:<40} p50 {:>8.1} us  p99 {:>8.1} us  max {:>8.1} us",
                round + 1,
                args.rounds,
                p.name,
                quantile(&lat, 0.5),
                quantile(&lat, 0.99),
                lat.iter().copied().fold(f64::MIN, f64::max),
            );
        }
    }
    let summaries = pairs
        .iter()
        .zip(&timeouts)
        .map(|(p, &timeouts)| {
            let mine: Vec<&Sample> = samples.iter().filter(|s| s.transport == p.name).collect();
            let lat: Vec<f64> = mine.iter().map(|s| s.latency_us).collect();
            let last: Vec<f64> = mine.iter().map(|s| s.last_get_us).collect();
            let per_round: Vec<f64> = (0..args.rounds)
                .map(|r| {
                    let xs: Vec<f64> = mine
                        .iter()
                        .filter(|s| s.round == r)
                        .map(|s| s.latency_us)
                        .collect();
                    quantile(&xs, 0.5)
                })
                .collect();
            Summary {
                transport: p.name,
                server: p.server.clone(),
                samples: lat.len(),
                timeouts,
                p50_us: quantile(&lat, 0.5),
                p99_us: quantile(&lat, 0.99),
                max_us: lat.iter().copied().fold(f64::MIN, f64::max),
                last_get_p50_us: quantile(&last, 0.5),
                round_p50_us: (
                    per_round.iter().copied().fold(f64::MAX, f64::min),
                    per_round.iter().copied().fold(f64::MIN, f64::max),
                ),
            }
        })
        .collect();
    for mut p in pairs {
        let _ = p.reader.send("quit");
    }
    Ok((summaries, samples))
}

/// The table.
pub fn table(summaries: &[Summary]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| transport | server | samples (timeouts) | p50 us | p99 us | max us | rounds' p50s us | the reader's last get, p50 us |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|");
    for s in summaries {
        let _ = writeln!(
            out,
            "| {} | {} | {} ({}) | {:.0} | {:.0} | {:.0} | {:.0}-{:.0} | {:.0} |",
            s.transport,
            s.server,
            s.samples,
            s.timeouts,
            s.p50_us,
            s.p99_us,
            s.max_us,
            s.round_p50_us.0,
            s.round_p50_us.1,
            s.last_get_p50_us,
        );
    }
    out
}

/// The reader's loop: for each `arm G`, holds a near copy of generation `G` (a `get` counted
/// as a near hit returned it), answers `ready`, then calls `get` until it returns a later
/// generation and answers `seen GENERATION AT_NS LAST_GET_NS POLLS BUS_COUNTERS` (the bus
/// counters that moved meanwhile, JSON) or `timeout`. Between two `get`s it yields its core,
/// unless `spin`: a thread that never yields holds its core until the scheduler takes it, and
/// on a machine of two cores the bus's subscriber thread can wait that long for one.
fn read(
    cache: &newcache::Cache,
    spin: bool,
    commands: impl Iterator<Item = String>,
    reply: &mut dyn FnMut(String),
) -> Result<(), BoxError> {
    let generation = |cache: &newcache::Cache| -> Result<u64, BoxError> {
        let v = cache.get::<String>(KEY)?.ok_or("the key is missing")?;
        Ok(parse(&v).ok_or("not a value of this bench")?.1)
    };
    for line in commands {
        let Some(old) = line.strip_prefix("arm ") else {
            return Ok(());
        };
        let old: u64 = old.parse()?;
        let t0 = Instant::now();
        loop {
            if generation(cache)? == old {
                let before = cache.stats().near_hits;
                if generation(cache)? == old && cache.stats().near_hits == before + 1 {
                    break;
                }
            }
            if t0.elapsed() > PATIENCE {
                return Err(format!("no near copy of generation {old}").into());
            }
        }
        let before = cache.stats();
        reply("ready".into());
        let (t0, mut polls) = (now_ns(), 0u64);
        loop {
            let start = now_ns();
            let g = generation(cache)?;
            let end = now_ns();
            if g > old {
                let moved = bus_moved(stats_delta(&before, &cache.stats()));
                let moved = serde_json::to_string(&moved)?;
                reply(format!("seen {g} {end} {} {polls} {moved}", end - start));
                break;
            }
            polls += 1;
            if !spin {
                std::thread::yield_now();
            }
            if end - t0 > PATIENCE.as_nanos() as u64 {
                reply(format!("timeout {polls}"));
                break;
            }
        }
    }
    Ok(())
}

/// `bench bus-reader`: [`read`] over stdin and stdout, through a cache of its own on the bus
/// (with `--bare`, the floor's reader).
pub fn reader_main(args: ReaderArgs) -> Result<(), BoxError> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let mut reply = |line: String| {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    };
    let done = match args.bare {
        true => floor::reader_main(&args.memcached, &args.bus, &args.channel, rx, &mut reply),
        false => builder(&args.memcached, &args.flavor)
            .near_bus(bus(&args.bus, &args.channel)?)
            .build()
            .map_err(BoxError::from)
            .and_then(|cache| read(&cache, args.spin, rx.into_iter(), &mut reply)),
    };
    if let Err(e) = done {
        reply(format!("error {e}"));
    }
    Ok(())
}
