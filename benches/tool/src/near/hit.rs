//! Figure 1: a near hit through `Cache` / `AsyncCache` beside quick_cache keyed by the same user
//! keys. `get_arc` against quick_cache's `get` of an `Arc<T>`; `get` against quick_cache's `get`
//! of the stored bytes plus one `rmp_serde::from_slice` of them.
//!
//! One cache per value kind over one memcached, its near tier holding every key (filled by
//! `set`, then read once by `get_arc` so that the copy keeps the decoded value); the timed calls
//! are checked to be near hits by the cache's counters (`near_hits` up by exactly the calls
//! made, `near_misses` unchanged). The near ttl is the longest allowed (an hour) so that no copy
//! ages out during the run; every other setting is the default.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::floor::items::BoxError;
use crate::floor::paths::{Run, Side, interleave, us};
use crate::floor::stats::Row;
use crate::near::args::ValueKind;
use crate::near::values::{self, KEYS, Kind, Small, Text};

/// The tasks of the concurrent mode.
pub const TASKS: usize = 64;

/// The near tier's capacity: every copy fits many times over.
pub const CAPACITY: u64 = 64 << 20;

/// How the calls are made (`--callers`); the tasks run on the multi-thread runtime (2 workers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Callers {
    /// the sync Cache on the main thread
    SyncOne,
    /// AsyncCache from one task
    AsyncOne,
    /// AsyncCache from 64 tasks
    #[value(name = "async-64")]
    Async64,
    /// the sync Cache from 64 tasks (a near hit does not block)
    #[value(name = "sync-64")]
    Sync64,
}

impl Callers {
    fn name(self) -> &'static str {
        match self {
            Callers::SyncOne => "sync Cache, one thread",
            Callers::AsyncOne => "AsyncCache, one task",
            Callers::Async64 => "AsyncCache, 64 tasks",
            Callers::Sync64 => "sync Cache, 64 tasks",
        }
    }

    fn tasks(self) -> usize {
        match self {
            Callers::SyncOne | Callers::AsyncOne => 1,
            Callers::Async64 | Callers::Sync64 => TASKS,
        }
    }

    fn sync(self) -> bool {
        matches!(self, Callers::SyncOne | Callers::Sync64)
    }
}

/// What one call is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    /// `get_arc::<T>` (a near hit).
    NearArc,
    /// `get::<T>` (a near hit, decoded from the copy's bytes).
    NearGet,
    /// quick_cache `get` of an `Arc<T>`.
    QcArc,
    /// quick_cache `get` of the bytes, then `rmp_serde::from_slice::<T>`.
    QcDecode,
}

/// What the sides read: the cache (one near tier, both front ends) and the two quick_caches.
struct Targets<K> {
    cache: newcache::AsyncCache,
    sync: newcache::Cache,
    arcs: quick_cache::sync::Cache<String, Arc<K>>,
    bytes: quick_cache::sync::Cache<String, Arc<[u8]>>,
    keys: Vec<String>,
    /// The key order every side follows: a pseudo-random sequence over the keys.
    order: Vec<u16>,
}

impl<K: Kind> Targets<K> {
    fn key(&self, at: usize) -> (usize, &str) {
        let i = usize::from(self.order[at % self.order.len()]);
        (i, &self.keys[i])
    }

    /// `n` calls of `op` from the sync `Cache` or the quick_caches, from position `at`.
    fn calls(&self, op: Op, at: usize, n: usize) -> Result<(), BoxError> {
        for j in at..at + n {
            let (_, k) = self.key(j);
            match op {
                Op::NearArc => drop(black_box(self.sync.get_arc::<K>(k)?)),
                Op::NearGet => drop(black_box(self.sync.get::<K>(k)?)),
                Op::QcArc => drop(black_box(self.arcs.get(k))),
                Op::QcDecode => self.decode(k)?,
            }
        }
        Ok(())
    }

    /// The same through `AsyncCache` (the quick_caches as above).
    async fn calls_async(&self, op: Op, at: usize, n: usize) -> Result<(), BoxError> {
        for j in at..at + n {
            let (_, k) = self.key(j);
            match op {
                Op::NearArc => drop(black_box(self.cache.get_arc::<K>(k).await?)),
                Op::NearGet => drop(black_box(self.cache.get::<K>(k).await?)),
                Op::QcArc => drop(black_box(self.arcs.get(k))),
                Op::QcDecode => self.decode(k)?,
            }
        }
        Ok(())
    }

    #[inline]
    fn decode(&self, k: &str) -> Result<(), BoxError> {
        let b = self.bytes.get(k).ok_or("quick_cache lost a key")?;
        drop(black_box(rmp_serde::from_slice::<K>(&b)?));
        Ok(())
    }

    /// Every key through every op, each value checked.
    async fn verify(&self) -> Result<(), BoxError> {
        for i in 0..KEYS {
            let k = self.keys[i].as_str();
            values::check(self.sync.get_arc::<K>(k)?.as_deref(), i)?;
            values::check(self.sync.get::<K>(k)?.as_ref(), i)?;
            values::check(self.cache.get_arc::<K>(k).await?.as_deref(), i)?;
            values::check(self.cache.get::<K>(k).await?.as_ref(), i)?;
            values::check(self.arcs.get(k).as_deref(), i)?;
            let b = self.bytes.get(k).ok_or("quick_cache lost a key")?;
            values::check(Some(&rmp_serde::from_slice::<K>(&b)?), i)?;
        }
        Ok(())
    }
}

/// The key order: SplitMix64 over the keys, 64 Ki long.
fn order() -> Vec<u16> {
    let mut x = 0x5eed_u64;
    (0..1 << 16)
        .map(|_| {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) % KEYS as u64) as u16
        })
        .collect()
}

/// Builds kind `K`'s cache over `addr` (inside `rt`: the engine's tasks are its), fills it
/// (`set`), and the quick_caches beside it.
fn targets<K: Kind>(
    rt: &tokio::runtime::Runtime,
    addr: &str,
    flavor: &str,
) -> Result<Arc<Targets<K>>, BoxError> {
    let cache = rt.block_on(async {
        newcache::Cache::builder()
            .memcached([addr])
            .flavor(flavor)
            .near_cache(CAPACITY)
            .near_ttl(Duration::from_secs(3600))
            .build_async()
    })?;
    let keys = values::user_keys();
    // Room for four times the keys: quick_cache's capacity is split among its shards, and a
    // full shard evicts before the whole is full.
    let arcs = quick_cache::sync::Cache::new(4 * KEYS);
    let bytes = quick_cache::sync::Cache::new(4 * KEYS);
    let ttl = Duration::from_secs(3600);
    rt.block_on(async {
        for (i, k) in keys.iter().enumerate() {
            let v = K::new(i);
            cache.set(k, &v, ttl).await?;
            bytes.insert(k.clone(), Arc::from(values::encoded(&v)));
            arcs.insert(k.clone(), Arc::new(v));
        }
        Ok::<_, BoxError>(())
    })?;
    let sync = cache.to_sync();
    Ok(Arc::new(Targets {
        cache,
        sync,
        arcs,
        bytes,
        keys,
        order: order(),
    }))
}

/// Fills the near copies, once every write is done (caches of one process over the same
/// servers share the write fence, and a write stops the copies of every key in its stripe),
/// then checks that each op answers every key with its value, the cache's from its copies.
fn warm<K: Kind>(rt: &tokio::runtime::Runtime, t: &Targets<K>) -> Result<(), BoxError> {
    rt.block_on(async {
        for (i, k) in t.keys.iter().enumerate() {
            // From the store: the copy keeps the decoded `K`.
            values::check(t.cache.get_arc::<K>(k).await?.as_deref(), i)?;
        }
        Ok::<_, BoxError>(())
    })?;
    let before = t.sync.stats();
    rt.block_on(t.verify())?;
    let after = t.sync.stats();
    let hits = after.near_hits - before.near_hits;
    if hits != 4 * KEYS as u64 || after.near_misses != before.near_misses {
        return Err(format!(
            "{}: the near tier did not answer every read: near_hits +{hits}, near_misses +{} \
             ({} reads); near_refused {}, near_evictions {}",
            K::NAME,
            after.near_misses - before.near_misses,
            4 * KEYS,
            after.near_refused,
            after.near_evictions,
        )
        .into());
    }
    Ok(())
}

/// A side: `n` calls of `op` by `callers`, timed; each run carries on where the last stopped.
fn side<'a, K: Kind>(
    rt: &'a tokio::runtime::Runtime,
    t: &Arc<Targets<K>>,
    callers: Callers,
    op: Op,
    made: &'a std::cell::Cell<u64>,
) -> Side<'a> {
    let t = Arc::clone(t);
    let mut at = 0usize;
    Box::new(move |n| {
        let start = at;
        at += n;
        if matches!(op, Op::NearArc | Op::NearGet) {
            made.set(made.get() + n as u64);
        }
        if callers == Callers::SyncOne {
            let clock = Instant::now();
            t.calls(op, start, n)?;
            return Ok(Run::timed(clock, n));
        }
        let tasks = callers.tasks();
        let each = n.div_ceil(tasks);
        let sync = callers.sync();
        let t = Arc::clone(&t);
        rt.block_on(async move {
            let clock = Instant::now();
            let handles: Vec<_> = (0..tasks)
                .map(|task| {
                    let t = Arc::clone(&t);
                    // Tasks start far apart in the order.
                    let from = start + task * 1021;
                    let count = each.min(n - (task * each).min(n));
                    tokio::spawn(async move {
                        match sync || matches!(op, Op::QcArc | Op::QcDecode) {
                            true => t.calls(op, from, count),
                            false => t.calls_async(op, from, count).await,
                        }
                    })
                })
                .collect();
            for h in handles {
                h.await??;
            }
            Ok(Run::timed(clock, n))
        })
    })
}

/// The rows of kind `K` by `callers`: `get_arc` vs quick_cache's `Arc`, `get` vs quick_cache
/// plus a decode, all four sides interleaved.
fn rows<K: Kind>(
    rt: &tokio::runtime::Runtime,
    t: &Arc<Targets<K>>,
    callers: Callers,
    rounds: usize,
    ops: usize,
    slices: usize,
) -> Result<(Vec<Row>, Check), BoxError> {
    let made = std::cell::Cell::new(0);
    let before = t.sync.stats();
    let mut sides = [
        side(rt, t, callers, Op::NearArc, &made),
        side(rt, t, callers, Op::QcArc, &made),
        side(rt, t, callers, Op::NearGet, &made),
        side(rt, t, callers, Op::QcDecode, &made),
    ];
    let name = format!("{}, {}", callers.name(), K::NAME);
    let runs = interleave(&name, rounds, ops, slices, &mut sides)?;
    drop(sides);
    let after = t.sync.stats();
    let check = Check {
        what: name.clone(),
        calls: made.get(),
        near_hits: after.near_hits - before.near_hits,
        near_misses: after.near_misses - before.near_misses,
    };
    eprintln!(
        "{name}: {} calls, near_hits +{}, near_misses +{}",
        check.calls, check.near_hits, check.near_misses
    );
    if check.calls != check.near_hits || check.near_misses != 0 {
        return Err(format!("{name}: not every timed call was a near hit: {check:?}").into());
    }
    let ns = |r: &[Run]| us(r).iter().map(|u| u * 1e3).collect::<Vec<f64>>();
    let front = match callers.sync() {
        true => "Cache",
        false => "AsyncCache",
    };
    Ok((
        vec![
            Row::new(
                format!("{name}: {front}::get_arc"),
                "quick_cache get of an Arc<T>",
                "ns",
                ns(&runs[0]),
                ns(&runs[1]),
            ),
            Row::new(
                format!("{name}: {front}::get"),
                "quick_cache get + rmp_serde::from_slice",
                "ns",
                ns(&runs[2]),
                ns(&runs[3]),
            ),
        ],
        check,
    ))
}

/// The near tier's answer to the timed calls of one measurement.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Check {
    pub what: String,
    pub calls: u64,
    pub near_hits: u64,
    pub near_misses: u64,
}

/// Figure 1 over the memcached at `addr`: every caller mode, both kinds.
pub fn run(
    rt: &tokio::runtime::Runtime,
    addr: &str,
    callers: &[Callers],
    kinds: &[ValueKind],
    rounds: usize,
    ops: usize,
    slices: usize,
) -> Result<(Vec<Row>, Vec<Check>), BoxError> {
    let small = targets::<Small>(rt, addr, "near-small")?;
    let text = targets::<Text>(rt, addr, "near-text")?;
    warm(rt, &small)?;
    warm(rt, &text)?;
    let (mut rows_out, mut checks) = (Vec::new(), Vec::new());
    for &c in callers {
        for &kind in kinds {
            let (r, check) = match kind {
                ValueKind::Struct => rows(rt, &small, c, rounds, ops, slices)?,
                ValueKind::String => rows(rt, &text, c, rounds, ops, slices)?,
            };
            rows_out.extend(r);
            checks.push(check);
        }
    }
    Ok((rows_out, checks))
}
