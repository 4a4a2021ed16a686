//! Each path: its client run and its floor run, as closures the rounds call, and the rows they
//! make.

use std::sync::Arc;
use std::time::Instant;

use hdrhistogram::Histogram;

use crate::floor::items::{Bare, Blocking, BoxError, FLAVOR, Items, VERSION, Value};
use crate::floor::stats::Row;

/// The hot keys of the single-key paths.
pub const KEYS: usize = 1000;
/// The keys of a `get_many`.
pub const BATCH: usize = 100;
/// The tasks of the concurrent path.
pub const TASKS: usize = 64;

/// What one run measured: wall time per call and, for the concurrent path, the p99 latency.
#[derive(Debug, Clone, Copy)]
pub struct Run {
    pub us_per_op: f64,
    pub p99_us: f64,
}

impl Run {
    pub fn timed(start: Instant, ops: usize) -> Run {
        Run {
            us_per_op: start.elapsed().as_secs_f64() * 1e6 / ops as f64,
            p99_us: f64::NAN,
        }
    }
}

/// A side of a path: one run of `ops` calls.
pub type Side<'a> = Box<dyn FnMut(usize) -> Result<Run, BoxError> + 'a>;

/// The sides to run (1-based; empty: all), from `--only-side`.
pub static ONLY_SIDES: std::sync::OnceLock<Vec<usize>> = std::sync::OnceLock::new();

/// Whether side `s` (0-based) runs.
fn runs_side(s: usize) -> bool {
    ONLY_SIDES
        .get()
        .is_none_or(|only| only.is_empty() || only.contains(&(s + 1)))
}

/// Runs every side once per round, in the order given in even rounds and reversed in odd ones,
/// after one uncounted warm-up run of each (a tenth of the calls). With `slices` above 1, a
/// round's calls are cut into that many slices and the order alternates slice by slice as well
/// (A B, B A, A B, ...), so that both sides of a round see the same mix of the machine's fast
/// and slow spells; a side's figure is its total time over its total calls (its p99: the
/// median of its slices' p99s). Returns the runs by side, then by round.
pub fn interleave(
    name: &str,
    rounds: usize,
    ops: usize,
    slices: usize,
    sides: &mut [Side<'_>],
) -> Result<Vec<Vec<Run>>, BoxError> {
    for (s, side) in sides.iter_mut().enumerate() {
        if runs_side(s) {
            side((ops / 10).max(1))?;
        }
    }
    let per_slice = (ops / slices).max(1);
    let mut runs = vec![Vec::with_capacity(rounds); sides.len()];
    let mut spent = vec![crate::floor::cpu::Spent::default(); sides.len()];
    for round in 0..rounds {
        let mut parts: Vec<Vec<Run>> = vec![Vec::with_capacity(slices); sides.len()];
        for slice in 0..slices {
            let mut order: Vec<usize> = (0..sides.len()).collect();
            if (round + slice) % 2 == 1 {
                order.reverse();
            }
            for &s in &order {
                if !runs_side(s) {
                    parts[s].push(Run {
                        us_per_op: f64::NAN,
                        p99_us: f64::NAN,
                    });
                    continue;
                }
                let before = crate::floor::cpu::now();
                parts[s].push(sides[s](per_slice)?);
                spent[s].add(before, crate::floor::cpu::now(), per_slice);
            }
        }
        for (s, parts) in parts.iter().enumerate() {
            let p99s: Vec<f64> = parts.iter().map(|r| r.p99_us).collect();
            runs[s].push(Run {
                us_per_op: parts.iter().map(|r| r.us_per_op).sum::<f64>() / parts.len() as f64,
                p99_us: crate::floor::stats::quantile(&p99s, 0.5),
            });
        }
        let figures: Vec<String> = runs
            .iter()
            .map(|r| format!("{:.2}", r[round].us_per_op))
            .collect();
        eprintln!(
            "{name} round {}/{rounds}: us/op {}",
            round + 1,
            figures.join(" / ")
        );
    }
    for (s, spent) in spent.iter().enumerate() {
        match runs_side(s) {
            true => eprintln!("{name} side {}: {}", s + 1, spent.per_call()),
            false => eprintln!("{name} side {}: skipped (--only-side)", s + 1),
        }
    }
    Ok(runs)
}

pub fn us(runs: &[Run]) -> Vec<f64> {
    runs.iter().map(|r| r.us_per_op).collect()
}

/// The servers and the sync caches over them, filled.
pub struct Setup {
    pub addrs: Vec<String>,
    /// One server (`addrs[0]`), keys `k0`..`k999`.
    pub single: newcache::Cache,
    pub single_items: Arc<Items>,
    /// Three servers, keys `m0`..`m99`.
    pub multi: newcache::Cache,
    pub multi_items: Items,
    /// The server each of `multi_items` lives on.
    pub multi_owner: Vec<usize>,
}

fn builder() -> newcache::CacheBuilder {
    newcache::Cache::builder().flavor(FLAVOR).version(VERSION)
}

impl Setup {
    pub fn new(addrs: Vec<String>) -> Result<Setup, BoxError> {
        let single = builder().memcached([addrs[0].as_str()]).build()?;
        let single_items = Items::fill(&single, "k", KEYS, &mut Blocking::connect(&addrs[0])?)?;

        let multi = builder()
            .memcached(addrs.iter().map(String::as_str))
            .build()?;
        let user: Vec<String> = (0..BATCH).map(|i| format!("m{i}")).collect();
        for (i, k) in user.iter().enumerate() {
            multi.set(k, &Value::new(i), crate::floor::items::TTL)?;
        }
        // Which server holds each key, asked of the servers themselves.
        let mut socks = addrs
            .iter()
            .map(|a| Blocking::connect(a))
            .collect::<Result<Vec<_>, _>>()?;
        let mut multi_owner = Vec::with_capacity(BATCH);
        for k in &user {
            let req = format!("get {}\r\n", multi.make_key(k)).into_bytes();
            let mut owners = Vec::new();
            for (s, sock) in socks.iter_mut().enumerate() {
                if sock.exchange(&req)? != b"END\r\n" {
                    owners.push(s);
                }
            }
            match owners[..] {
                [s] => multi_owner.push(s),
                _ => return Err(format!("{k} is on servers {owners:?}").into()),
            }
        }
        let multi_items = Items::learn(&multi, user, &mut socks, |i| multi_owner[i])?;
        Ok(Setup {
            addrs,
            single,
            single_items: Arc::new(single_items),
            multi,
            multi_items,
            multi_owner,
        })
    }
}

/// sync `Cache::get` hit from one thread against a blocking socket's `get` of the same item.
pub fn sync_get(s: &Setup, rounds: usize, ops: usize, slices: usize) -> Result<Vec<Row>, BoxError> {
    let items = &s.single_items;
    let cache = &s.single;
    let mut floor = Blocking::connect(&s.addrs[0])?;
    let client: Side<'_> = Box::new(move |n| {
        let t = Instant::now();
        for j in 0..n {
            let i = j % KEYS;
            Value::check(cache.get::<Value>(&items.user[i])?, i)?;
        }
        Ok(Run::timed(t, n))
    });
    let bare: Side<'_> = Box::new(move |n| {
        let t = Instant::now();
        for j in 0..n {
            let i = j % KEYS;
            floor.send(&items.requests[i])?;
            floor.recv(items.reply_lens[i])?;
        }
        Ok(Run::timed(t, n))
    });
    let runs = interleave("sync-get", rounds, ops, slices, &mut [client, bare])?;
    Ok(vec![Row::new(
        "sync Cache::get hit, one thread",
        "blocking socket get (nodelay, SO_RCVTIMEO/SO_SNDTIMEO 500 ms)",
        "us",
        us(&runs[0]),
        us(&runs[1]),
    )])
}

/// sync `Cache::get_many` of 100 keys over 3 servers against F (one `get` line per server on 3
/// sockets, all written, then all read) and C (the same call on the memory backend).
pub fn sync_get_many(
    s: &Setup,
    rounds: usize,
    ops: usize,
    slices: usize,
) -> Result<Vec<Row>, BoxError> {
    let items = &s.multi_items;
    let cache = &s.multi;
    let memory = builder().in_memory().build()?;
    for (i, k) in items.user.iter().enumerate() {
        memory.set(k, &Value::new(i), crate::floor::items::TTL)?;
    }
    // F's requests: one `get` line per server holding any of the keys, and its reply's length.
    let mut socks = s
        .addrs
        .iter()
        .map(|a| Blocking::connect(a))
        .collect::<Result<Vec<_>, _>>()?;
    let mut lines: Vec<(usize, Vec<u8>, usize)> = Vec::new();
    for (server, sock) in socks.iter_mut().enumerate() {
        let mine: Vec<&str> = (0..BATCH)
            .filter(|&i| s.multi_owner[i] == server)
            .map(|i| items.derived[i].as_str())
            .collect();
        if !mine.is_empty() {
            let line = format!("get {}\r\n", mine.join(" ")).into_bytes();
            let len = sock.exchange(&line)?.len();
            lines.push((server, line, len));
        }
    }
    let per_server: Vec<usize> = (0..s.addrs.len())
        .map(|srv| s.multi_owner.iter().filter(|&&o| o == srv).count())
        .collect();
    eprintln!("sync-get-many: keys per server {per_server:?}");

    let check = |found: std::collections::HashMap<String, Value>| -> Result<(), BoxError> {
        match found.len() {
            BATCH => Ok(()),
            n => Err(format!("get_many found {n} of {BATCH}").into()),
        }
    };
    let user = &items.user;
    let client: Side<'_> = Box::new(move |n| {
        let t = Instant::now();
        for _ in 0..n {
            check(cache.get_many::<Value>(user)?)?;
        }
        Ok(Run::timed(t, n))
    });
    let wire: Side<'_> = Box::new(move |n| {
        let t = Instant::now();
        for _ in 0..n {
            for (server, line, _) in &lines {
                socks[*server].send(line)?;
            }
            for (server, _, len) in &lines {
                socks[*server].recv(*len)?;
            }
        }
        Ok(Run::timed(t, n))
    });
    let memory = &memory;
    let in_process: Side<'_> = Box::new(move |n| {
        let t = Instant::now();
        for _ in 0..n {
            check(memory.get_many::<Value>(user)?)?;
        }
        Ok(Run::timed(t, n))
    });
    let runs = interleave(
        "sync-get-many",
        rounds,
        (ops / 10).max(1),
        slices,
        &mut [client, wire, in_process],
    )?;
    let (a, f, c) = (us(&runs[0]), us(&runs[1]), us(&runs[2]));
    let f_plus_c: Vec<f64> = f.iter().zip(&c).map(|(f, c)| f + c).collect();
    let path = "sync Cache::get_many, 100 keys, 3 servers";
    Ok(vec![
        Row::new(path, "F + C", "us", a.clone(), f_plus_c),
        Row::new(path, "F: a get line per server, 3 sockets", "us", a, f),
        Row::new(
            "  C: Cache::get_many on the memory backend",
            "(in-process work; ratio to F)",
            "us",
            c,
            us(&runs[1]),
        ),
    ])
}

/// A runtime of the kind `multi` names (2 workers, or the current thread).
pub fn runtime(multi: bool) -> Result<tokio::runtime::Runtime, BoxError> {
    Ok(match multi {
        true => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?,
        false => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?,
    })
}

/// `AsyncCache::get` from one task against a bare tokio socket's `get` of the same item, both
/// spawned on `rt`, timed inside the task.
pub fn async_get(
    s: &Setup,
    rt: &tokio::runtime::Runtime,
    cache: &newcache::AsyncCache,
    name: &str,
    rounds: usize,
    ops: usize,
    slices: usize,
) -> Result<Vec<Row>, BoxError> {
    let items = &s.single_items;
    let mut floor = Some(rt.block_on(Bare::connect(&s.addrs[0]))?);
    let client: Side<'_> = Box::new(|n| {
        let (cache, items) = (cache.clone(), Arc::clone(items));
        rt.block_on(rt.spawn(async move {
            let t = Instant::now();
            for j in 0..n {
                let i = j % KEYS;
                Value::check(cache.get::<Value>(&items.user[i]).await?, i)?;
            }
            Ok::<_, BoxError>(Run::timed(t, n))
        }))?
    });
    let bare: Side<'_> = Box::new(|n| {
        let (mut sock, items) = (floor.take().ok_or("floor socket lost")?, Arc::clone(items));
        let (sock, run) = rt.block_on(rt.spawn(async move {
            let t = Instant::now();
            for j in 0..n {
                let i = j % KEYS;
                if let Err(e) = sock.get(&items.requests[i], items.reply_lens[i]).await {
                    return (sock, Err(e));
                }
            }
            (sock, Ok(Run::timed(t, n)))
        }))?;
        floor = Some(sock);
        run
    });
    let flavor = match name.ends_with("multi") {
        true => "multi-thread runtime (2 workers)",
        false => "current-thread runtime",
    };
    let runs = interleave(name, rounds, ops, slices, &mut [client, bare])?;
    Ok(vec![Row::new(
        format!("AsyncCache::get, one task, {flavor}"),
        "bare tokio socket get (nodelay), same runtime",
        "us",
        us(&runs[0]),
        us(&runs[1]),
    )])
}

/// The longest latency the histograms resolve.
const MAX_NS: u64 = 10_000_000_000;

/// SplitMix64 over the hot keys; task `t` of either side gets the same sequence.
struct Rng(u64);

impl Rng {
    fn key(&mut self) -> usize {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) % KEYS as u64) as usize
    }
}

/// One task's client in the concurrent path: a checked get of hot key `i`.
pub trait Getter: Send + 'static {
    fn get(&mut self, i: usize) -> impl Future<Output = Result<(), BoxError>> + Send;
}

/// A clone of the shared `AsyncCache`.
pub struct CacheGetter {
    pub cache: newcache::AsyncCache,
    pub items: Arc<Items>,
}

impl CacheGetter {
    /// A getter a task ([`TASKS`]), each on `cache`.
    pub fn per_task(cache: &newcache::AsyncCache, items: &Arc<Items>) -> Vec<CacheGetter> {
        (0..TASKS)
            .map(|_| CacheGetter {
                cache: cache.clone(),
                items: Arc::clone(items),
            })
            .collect()
    }
}

impl Getter for CacheGetter {
    async fn get(&mut self, i: usize) -> Result<(), BoxError> {
        Value::check(self.cache.get::<Value>(&self.items.user[i]).await?, i)
    }
}

/// One `async_memcached::Client` (one connection) per task, reading the same derived keys.
struct McGetter {
    client: async_memcached::Client,
    items: Arc<Items>,
}

impl Getter for McGetter {
    async fn get(&mut self, i: usize) -> Result<(), BoxError> {
        use async_memcached::AsciiProtocol;
        let found = self.client.get(&self.items.derived[i]).await?;
        match found.and_then(|v| v.data).map(|d| d.len()) {
            Some(len) if len == self.items.stored_lens[i] => Ok(()),
            Some(len) => Err(format!("{len} bytes under key {i}").into()),
            None => Err(format!("miss on key {i}").into()),
        }
    }
}

/// How the batching ceiling carries its 64 gets: sockets, lines in flight on each, keys a
/// line (their product: [`TASKS`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub sockets: usize,
    pub depth: usize,
    pub keys: usize,
}

impl Shape {
    /// `SxDxK`, e.g. `1x2x32`, whose product is [`TASKS`] (a ceiling's gets in flight).
    pub fn parse(s: &str) -> Result<Shape, String> {
        Shape::parse_any(s)
            .ok()
            .filter(|n| n.sockets * n.depth * n.keys == TASKS)
            .ok_or_else(|| {
                format!("{s:?}: sockets x lines in flight x keys a line, whose product is {TASKS}")
            })
    }

    /// `SxDxK` of any product (a minimal client's lines are filled by whoever is queued).
    pub fn parse_any(s: &str) -> Result<Shape, String> {
        let n: Vec<usize> = s
            .split('x')
            .map(str::parse)
            .collect::<Result<_, _>>()
            .map_err(|e| format!("{s:?}: {e}"))?;
        match n[..] {
            [sockets, depth, keys] if n.iter().all(|&x| (1..=TASKS).contains(&x)) => Ok(Shape {
                sockets,
                depth,
                keys,
            }),
            _ => Err(format!(
                "{s:?}: batchers x lines in flight on each x keys a line, each 1 to {TASKS}"
            )),
        }
    }

    /// `SxDxK`.
    pub fn short(&self) -> String {
        format!("{}x{}x{}", self.sockets, self.depth, self.keys)
    }

    pub fn label(&self) -> String {
        format!(
            "ceiling: bare sockets ({}), the 64 gets in flight as get lines ({} on each, {} keys a line)",
            self.sockets, self.depth, self.keys
        )
    }
}

/// How long the ceiling waits for a reply (a key missing would leave it short: no hang).
const CEILING_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The batching ceiling of the concurrent path: bare tokio sockets (nodelay), a task each,
/// carrying the 64 callers' gets as `get` lines of random hot keys, [`Shape`]'s lines in flight
/// on each (64 gets outstanding in all, as 64 callers have), each reply read whole and its
/// length checked, the next line written as soon as a reply is read. No queue, parse or
/// wake-up of a caller: the server's and the kernel's work per get at that concurrency.
/// The shape measured fastest (a sweep, `--ceiling`) is the default; it sends `get` (newcache
/// sends `gets`, whose replies carry the CAS too: `--gets` sends that) and does not merge a
/// line's repeated keys.
pub struct Ceiling {
    conns: Vec<CeilingConn>,
    shape: Shape,
}

struct CeilingConn {
    stream: tokio::net::TcpStream,
    buf: Vec<u8>,
    line: Vec<u8>,
    rng: Rng,
}

impl Ceiling {
    pub async fn connect(addr: &str, shape: Shape) -> Result<Ceiling, BoxError> {
        let mut conns = Vec::with_capacity(shape.sockets);
        for s in 0..shape.sockets {
            let stream = tokio::net::TcpStream::connect(addr).await?;
            stream.set_nodelay(true)?;
            conns.push(CeilingConn {
                stream,
                buf: vec![0; 256 * 1024],
                line: Vec::with_capacity(64 * 1024),
                rng: Rng(0x5EED_u64.wrapping_add((s as u64).wrapping_mul(0xA076_1D64_78BD_642F))),
            });
        }
        Ok(Ceiling { conns, shape })
    }

    /// At least `gets` gets, spread over the sockets (whole lines, at least `depth` a
    /// socket); returns the gets done.
    pub async fn run(&mut self, items: &Arc<Items>, gets: usize) -> Result<usize, BoxError> {
        let Shape {
            sockets,
            depth,
            keys,
        } = self.shape;
        let lines = gets.div_ceil(keys * sockets).max(depth);
        let tasks: Vec<_> = self
            .conns
            .drain(..)
            .map(|mut c| {
                let items = Arc::clone(items);
                tokio::spawn(async move {
                    let r = tokio::time::timeout(
                        CEILING_TIMEOUT * lines as u32,
                        c.run(&items, lines, depth, keys),
                    )
                    .await;
                    (c, r)
                })
            })
            .collect();
        let mut first_error = None;
        for t in tasks {
            let (c, r) = t.await?;
            self.conns.push(c);
            if let Err(e) = r.map_err(|_| "no reply in time".into()).and_then(|r| r) {
                first_error.get_or_insert(e);
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(lines * keys * sockets),
        }
    }
}

/// The values in a whole `get` reply (`VALUE` blocks, then `END`), or `None` if it is not one.
fn values(reply: &[u8]) -> Option<usize> {
    each_value(reply, |_, _| ())
}

/// Calls `f` with the key and byte length of each value of a whole `get` reply (`VALUE`
/// blocks, then `END`), in order; their count, or `None` if it is not one.
pub fn each_value<'r>(reply: &'r [u8], mut f: impl FnMut(&'r [u8], usize)) -> Option<usize> {
    let (mut at, mut n) = (0, 0);
    while reply.get(at..)?.starts_with(b"VALUE ") {
        let eol = at + reply[at..].iter().position(|&b| b == b'\n')?;
        let header = reply[at..eol].strip_suffix(b"\r")?;
        let mut fields = header.split(|&b| b == b' ');
        let key = fields.nth(1)?;
        let bytes = fields.nth(1)?;
        let bytes: usize = std::str::from_utf8(bytes).ok()?.parse().ok()?;
        at = eol + 1 + bytes;
        if reply.get(at..at + 2)? != b"\r\n" {
            return None;
        }
        at += 2;
        f(key, bytes);
        n += 1;
    }
    (reply.get(at..)? == b"END\r\n").then_some(n)
}

impl CeilingConn {
    /// Writes one line of `keys` random hot keys; returns its whole reply's length.
    async fn send(&mut self, items: &Items, keys: usize) -> Result<usize, BoxError> {
        use tokio::io::AsyncWriteExt;
        self.line.clear();
        let (command, reply_lens) = items.command();
        self.line.extend_from_slice(command);
        // Each key's reply is its single-key reply less its `END\r\n`; the line's ends once
        // (memcached answers a repeated key each time).
        let mut len = 5;
        for _ in 0..keys {
            let i = self.rng.key();
            self.line.push(b' ');
            self.line.extend_from_slice(items.derived[i].as_bytes());
            len += reply_lens[i] - 5;
        }
        self.line.extend_from_slice(b"\r\n");
        self.stream.write_all(&self.line).await?;
        Ok(len)
    }

    /// `lines` lines of `keys` keys, `depth` in flight.
    async fn run(
        &mut self,
        items: &Items,
        lines: usize,
        depth: usize,
        keys: usize,
    ) -> Result<(), BoxError> {
        use tokio::io::AsyncReadExt;
        let mut pending = std::collections::VecDeque::with_capacity(depth);
        for _ in 0..depth {
            pending.push_back(self.send(items, keys).await?);
        }
        let (mut sent, mut have) = (depth, 0);
        while let Some(len) = pending.pop_front() {
            if self.buf.len() < len {
                self.buf.resize(len, 0);
            }
            while have < len {
                match self.stream.read(&mut self.buf[have..]).await? {
                    0 => return Err("connection closed by the server".into()),
                    n => have += n,
                }
            }
            if values(&self.buf[..len]) != Some(keys) {
                return Err(format!("a line's reply of {len} bytes is not {keys} values").into());
            }
            self.buf.copy_within(len..have, 0);
            have -= len;
            if sent < lines {
                pending.push_back(self.send(items, keys).await?);
                sent += 1;
            }
        }
        match have {
            0 => Ok(()),
            n => Err(format!("{n} bytes past the last reply").into()),
        }
    }
}

/// Runs one task per getter, each doing `per_task` gets of random hot keys (recording each
/// latency), and returns the getters, the wall time per get and the merged p99.
pub async fn run_tasks<G: Getter>(
    getters: Vec<G>,
    per_task: usize,
) -> Result<(Vec<G>, Run), BoxError> {
    let hists: Vec<Histogram<u64>> = (0..getters.len())
        .map(|_| Histogram::new_with_bounds(1, MAX_NS, 3))
        .collect::<Result<_, _>>()?;
    let n = getters.len();
    let t = Instant::now();
    let tasks: Vec<_> = getters
        .into_iter()
        .zip(hists)
        .enumerate()
        .map(|(task, (mut g, mut hist))| {
            tokio::spawn(async move {
                let mut rng = Rng((task as u64).wrapping_mul(0xA076_1D64_78BD_642F));
                for _ in 0..per_task {
                    let i = rng.key();
                    let t0 = Instant::now();
                    if let Err(e) = g.get(i).await {
                        return (g, hist, Err(e));
                    }
                    hist.saturating_record(t0.elapsed().as_nanos() as u64);
                }
                (g, hist, Ok(()))
            })
        })
        .collect();
    let mut getters = Vec::with_capacity(n);
    let mut merged = Histogram::<u64>::new_with_bounds(1, MAX_NS, 3)?;
    let mut first_error = None;
    for task in tasks {
        let (g, hist, r) = task.await?;
        getters.push(g);
        merged.add(&hist)?;
        first_error = first_error.or(r.err());
    }
    let wall = t.elapsed();
    if let Some(e) = first_error {
        return Err(e);
    }
    let run = Run {
        us_per_op: wall.as_secs_f64() * 1e6 / (n * per_task) as f64,
        p99_us: merged.value_at_quantile(0.99) as f64 / 1e3,
    };
    Ok((getters, run))
}

/// The minimal client's label ([`crate::floor::minimal`]) in `shape`.
fn minimal_label(shape: Shape) -> String {
    format!(
        "minimal client: the facade's work (memory backend) + a oneshot to a batcher ({})",
        shape.short()
    )
}

/// The facade-alone side's label (a [`CacheGetter`] of the memory-backend cache).
const FACADE: &str = "the facade's work alone: AsyncCache::get on the memory backend, 64 tasks";

/// `AsyncCache::get` from 64 tasks (one shared cache) against async-memcached 0.9 with a
/// client per task, and both against the batching ceiling ([`Ceiling`]); the minimal client
/// ([`crate::floor::minimal`], in `minimal_shape`) against newcache, async-memcached, the facade's
/// work alone and itself without its sockets; all on the 2-worker runtime; `ops` gets per run,
/// spread over the tasks.
pub fn async_get_64(
    s: &Setup,
    rt: &tokio::runtime::Runtime,
    cache: &newcache::AsyncCache,
    (shape, minimal_shape): (Shape, Shape),
    rounds: usize,
    ops: usize,
    slices: usize,
) -> Result<Vec<Row>, BoxError> {
    let items = &s.single_items;
    let minimal_name = minimal_label(minimal_shape);
    let no_socket_name = format!(
        "the minimal client without its socket: its batchers answer at most {} callers at a time at once",
        minimal_shape.keys
    );
    let mut ours: Option<Vec<CacheGetter>> = Some(CacheGetter::per_task(cache, items));
    let theirs: Vec<McGetter> = rt.block_on(async {
        let mut v = Vec::with_capacity(TASKS);
        for _ in 0..TASKS {
            let client = async_memcached::Client::new(format!("tcp://{}", s.addrs[0])).await?;
            v.push(McGetter {
                client,
                items: Arc::clone(items),
            });
        }
        Ok::<_, BoxError>(v)
    })?;
    let mut theirs = Some(theirs);
    let mut ceiling = Some(rt.block_on(Ceiling::connect(&s.addrs[0], shape))?);
    // The minimal client: the facade's work on a memory-backend cache of the same items (built
    // inside the runtime, as users build theirs), its I/O on one batcher's bare socket.
    let memory = rt.block_on(async { builder().in_memory().build_async() })?;
    rt.block_on(async {
        for (i, k) in items.user.iter().enumerate() {
            memory
                .set(k, &Value::new(i), crate::floor::items::TTL)
                .await?;
        }
        Ok::<_, BoxError>(())
    })?;
    // Each caller shares the queue of every `sockets`th caller; the socketless side has queues
    // of its own.
    let callers = || {
        let queues: Vec<_> = (0..minimal_shape.sockets)
            .map(|_| Arc::new(crate::floor::minimal::Shared::default()))
            .collect();
        (0..TASKS)
            .map(|t| crate::floor::minimal::MinimalGetter {
                memory: memory.clone(),
                items: Arc::clone(items),
                shared: Arc::clone(&queues[t % queues.len()]),
            })
            .collect::<Vec<_>>()
    };
    let mut batchers = Vec::with_capacity(minimal_shape.sockets);
    for _ in 0..minimal_shape.sockets {
        batchers.push(rt.block_on(crate::floor::minimal::Batcher::connect(
            &s.addrs[0],
            minimal_shape,
        ))?);
    }
    let mut minimal = Some((batchers, callers()));
    let mut unplugged = Some((
        (0..minimal_shape.sockets)
            .map(|_| crate::floor::minimal::Batcher::without_socket(minimal_shape))
            .collect::<Vec<_>>(),
        callers(),
    ));
    let client: Side<'_> = Box::new(|n| {
        let getters = ours.take().ok_or("getters lost")?;
        let (getters, run) = rt.block_on(run_tasks(getters, (n / TASKS).max(1)))?;
        ours = Some(getters);
        Ok(run)
    });
    let floor: Side<'_> = Box::new(|n| {
        let getters = theirs.take().ok_or("getters lost")?;
        let (getters, run) = rt.block_on(run_tasks(getters, (n / TASKS).max(1)))?;
        theirs = Some(getters);
        Ok(run)
    });
    let bare: Side<'_> = Box::new(|n| {
        let (mut c, items) = (ceiling.take().ok_or("ceiling lost")?, Arc::clone(items));
        let (c, run) = rt.block_on(async move {
            let t = Instant::now();
            let r = c.run(&items, n).await.map(|gets| Run::timed(t, gets));
            (c, r)
        });
        ceiling = Some(c);
        run
    });
    let least: Side<'_> = Box::new(|n| {
        let (batchers, getters) = minimal.take().ok_or("minimal client lost")?;
        let (batchers, getters, run) = rt.block_on(crate::floor::minimal::run(
            batchers,
            getters,
            (n / TASKS).max(1),
        ))?;
        minimal = Some((batchers, getters));
        Ok(run)
    });
    let no_socket: Side<'_> = Box::new(|n| {
        let (batchers, getters) = unplugged.take().ok_or("unplugged client lost")?;
        let (batchers, getters, run) = rt.block_on(crate::floor::minimal::run(
            batchers,
            getters,
            (n / TASKS).max(1),
        ))?;
        unplugged = Some((batchers, getters));
        Ok(run)
    });
    // The facade's work alone: the same calls on the memory-backend cache (no I/O; its future
    // is ready at once, so no wake-up either).
    let mut alone: Option<Vec<CacheGetter>> = Some(CacheGetter::per_task(&memory, items));
    let facade: Side<'_> = Box::new(|n| {
        let getters = alone.take().ok_or("facade getters lost")?;
        let (getters, run) = rt.block_on(run_tasks(getters, (n / TASKS).max(1)))?;
        alone = Some(getters);
        Ok(run)
    });
    let runs = interleave(
        "async-get-64",
        rounds,
        ops,
        slices,
        &mut [client, floor, bare, least, facade, no_socket],
    )?;
    for (name, side) in [
        ("minimal client", &minimal),
        ("without its socket", &unplugged),
    ] {
        if let Some((batchers, _)) = side {
            let rounds: u64 = batchers.iter().map(|b| b.rounds).sum();
            let answered: u64 = batchers.iter().map(|b| b.answered).sum();
            if rounds == 0 {
                // Skipped (`--only-side`).
                continue;
            }
            eprintln!(
                "async-get-64 {name}: {:.1} gets a round ({rounds} rounds)",
                answered as f64 / rounds.max(1) as f64
            );
        }
    }
    let rate = |runs: &[Run]| -> Vec<f64> { runs.iter().map(|r| 1e6 / r.us_per_op).collect() };
    let p99 = |runs: &[Run]| -> Vec<f64> { runs.iter().map(|r| r.p99_us).collect() };
    let path = "AsyncCache::get, 64 tasks, 1,000 hot keys, multi-thread (2 workers)";
    let floor = "async-memcached 0.9, a client per task";
    Ok(vec![
        Row::new(path, floor, "gets/s", rate(&runs[0]), rate(&runs[1])),
        Row::new(
            "  the same, p99 latency",
            floor,
            "us p99",
            p99(&runs[0]),
            p99(&runs[1]),
        ),
        Row::new(
            path,
            shape.label(),
            "gets/s",
            rate(&runs[0]),
            rate(&runs[2]),
        ),
        Row::new(
            "  async-memcached 0.9, a client per task",
            shape.label(),
            "gets/s",
            rate(&runs[1]),
            rate(&runs[2]),
        ),
        Row::new(
            path,
            &minimal_name,
            "gets/s",
            rate(&runs[0]),
            rate(&runs[3]),
        ),
        Row::new(
            format!("  {minimal_name}"),
            floor,
            "gets/s",
            rate(&runs[3]),
            rate(&runs[1]),
        ),
        Row::new(
            "  the same, p99 latency",
            floor,
            "us p99",
            p99(&runs[3]),
            p99(&runs[1]),
        ),
        Row::new(
            format!("  {minimal_name}"),
            FACADE,
            "gets/s",
            rate(&runs[3]),
            rate(&runs[4]),
        ),
        Row::new(
            format!("  {minimal_name}"),
            &no_socket_name,
            "gets/s",
            rate(&runs[3]),
            rate(&runs[5]),
        ),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    #[test]
    fn a_get_reply_counts_its_values() {
        let two = b"VALUE a 0 3\r\nabc\r\nVALUE b 1 0\r\n\r\nEND\r\n";
        assert_eq!(values(two), Some(2));
        assert_eq!(values(b"END\r\n"), Some(0));
        assert_eq!(values(&two[..two.len() - 1]), None, "cut short");
        assert_eq!(
            values(b"VALUE a 0 9\r\nabc\r\nEND\r\n"),
            None,
            "a wrong length"
        );
    }

    #[test]
    fn a_minimal_clients_shape_has_no_zero() {
        let s = Shape::parse_any("2x1x64").unwrap();
        assert_eq!((s.sockets, s.depth, s.keys), (2, 1, 64));
        assert_eq!(s.short(), "2x1x64");
        assert!(Shape::parse_any("64x1x1").is_ok());
        for bad in [
            "0x4x16",
            "2x0x16",
            "2x4x0",
            "65x1x1",
            "1x65x1",
            "1x1x65",
            "1x99999999999999x1",
        ] {
            assert!(Shape::parse_any(bad).is_err(), "{bad}");
        }
        assert!(Shape::parse_any("2x4").is_err());
        assert!(Shape::parse_any("2x4x16x1").is_err());
    }

    #[test]
    fn a_ceiling_shape_carries_64_gets() {
        let s = Shape::parse("2x2x16").unwrap();
        assert_eq!((s.sockets, s.depth, s.keys), (2, 2, 16));
        assert!(Shape::parse("1x2x16").is_err());
        assert!(Shape::parse("0x0x64").is_err());
        assert!(Shape::parse("64").is_err());
    }

    #[test]
    fn rounds_and_slices_alternate_the_order() {
        let log = RefCell::new(Vec::new());
        let side = |name: char, us: f64| -> Side<'_> {
            let log = &log;
            Box::new(move |n| {
                log.borrow_mut().push((name, n));
                Ok(Run {
                    us_per_op: us,
                    p99_us: us * 10.0,
                })
            })
        };
        let runs = interleave("t", 2, 1000, 2, &mut [side('a', 2.0), side('b', 1.0)]).unwrap();
        let order: String = log.borrow().iter().map(|(c, _)| c).collect();
        // Warm-up a b; round 0: ab ba; round 1: ba ab.
        assert_eq!(order, "ababbabaab");
        assert!(
            log.borrow()[..2].iter().all(|&(_, n)| n == 100),
            "warm-up: a tenth"
        );
        assert!(
            log.borrow()[2..].iter().all(|&(_, n)| n == 500),
            "a slice: half a round"
        );
        assert_eq!(runs.len(), 2);
        assert!(runs.iter().all(|r| r.len() == 2));
        assert_eq!((runs[0][1].us_per_op, runs[0][1].p99_us), (2.0, 20.0));
    }
}
