//! The memory backend's footprint and read throughput, next to a naive baseline measured in the
//! same run: 16 `Mutex<std::HashMap<String, Item>>` shards with no bookkeeping at all.
//!
//! For each, the whole facade writes `ENTRIES` typed 100-byte values (`Vec<u8>` of 100 bytes,
//! herd-protected envelope), then:
//! - heap bytes per entry, counted by a global allocator (requested sizes: malloc's own headers
//!   and rounding are not included), and the growth of RSS per entry (includes them);
//! - typed `get`s per second on 2 threads over random keys (`GETS` per thread), and the backend's
//!   own `get`s on the same keys derived beforehand.
//!
//! The payload (derived key + stored bytes) is printed beside them, and the ratios the issue asks
//! for: bytes per entry over payload, and each figure over the baseline's.
//!
//! `cargo bench --bench memory` (short: ENTRIES=1000000, GETS=1000000; both settable through the
//! environment, e.g. `ENTRIES=100000 cargo bench --bench memory`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicIsize, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Instant;

use newcache::{
    Backend, Cache, Item, MemoryBackend, Result, StoreOutcome, SystemClock, Ttl, Write,
};

/// Counts the bytes the program has asked for and not yet freed.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: defers to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract is System's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract is System's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        // SAFETY: the caller's contract is System's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn rss_bytes() -> isize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: isize = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The floor: what a map of owned keys and items costs with nothing else.
#[derive(Debug)]
struct Naive {
    shards: Vec<Mutex<HashMap<String, Item>>>,
    hasher: RandomState,
    cas: AtomicU64,
}

impl Naive {
    fn new() -> Naive {
        Naive {
            shards: (0..16).map(|_| Mutex::new(HashMap::new())).collect(),
            hasher: RandomState::new(),
            cas: AtomicU64::new(1),
        }
    }
    fn shard(&self, key: &str) -> &Mutex<HashMap<String, Item>> {
        &self.shards[self.hasher.hash_one(key) as usize % 16]
    }
}

impl Backend for Naive {
    fn get(&self, key: &str) -> Result<Option<Item>> {
        Ok(self.shard(key).lock().unwrap().get(key).cloned())
    }
    fn store(&self, w: Write<'_>) -> Result<StoreOutcome> {
        let item = Item {
            value: w.value.to_vec().into(),
            flags: w.flags,
            cas: self.cas.fetch_add(1, Ordering::Relaxed),
        };
        self.shard(w.key)
            .lock()
            .unwrap()
            .insert(w.key.to_string(), item);
        Ok(StoreOutcome::Stored)
    }
    fn delete(&self, key: &str) -> Result<bool> {
        Ok(self.shard(key).lock().unwrap().remove(key).is_some())
    }
    fn touch(&self, _: &str, _: u32) -> Result<bool> {
        Ok(false)
    }
    fn incr(&self, _: &str, _: u64) -> Result<Option<u64>> {
        Ok(None)
    }
    fn decr(&self, _: &str, _: u64) -> Result<Option<u64>> {
        Ok(None)
    }
    fn flush_all(&self) -> Result<()> {
        Ok(())
    }
    fn max_value_size(&self, _: &str) -> usize {
        1 << 20
    }
}

struct Figures {
    heap_per_entry: f64,
    rss_per_entry: f64,
    payload: f64,
    gets_per_s: f64,
    raw_gets_per_s: f64,
}

/// Runs `op` `n` times on each of 2 threads (on pseudo-random numbers), started together; the
/// operations per second of both.
fn per_second(n: usize, op: impl Fn(usize) + Sync) -> f64 {
    let barrier = Barrier::new(2);
    let start = std::thread::scope(|s| {
        let start = Instant::now();
        for t in 0..2u64 {
            let (op, barrier) = (&op, &barrier);
            s.spawn(move || {
                let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ t;
                barrier.wait();
                for _ in 0..n {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    op(x as usize);
                }
            });
        }
        start
    });
    (2 * n) as f64 / start.elapsed().as_secs_f64()
}

fn key(i: usize) -> String {
    format!("user:{i}")
}

fn measure(name: &str, backend: Arc<dyn Backend>, entries: usize, gets: usize) -> Figures {
    let cache = Cache::builder()
        .backend(backend.clone())
        .clock(Arc::new(SystemClock))
        .build()
        .expect("cache");
    let value = vec![7u8; 100];
    let (heap0, rss0) = (LIVE.load(Ordering::Relaxed), rss_bytes());
    for i in 0..entries {
        cache.set(&key(i), &value, Ttl::Never).expect("set");
    }
    let (heap1, rss1) = (LIVE.load(Ordering::Relaxed), rss_bytes());
    let derived = cache.make_key(&key(entries / 2));
    let stored = backend.get(&derived).expect("get").expect("present");
    let payload = (derived.len() + stored.value.len()) as f64;
    let held = (0..entries)
        .step_by((entries / 1000).max(1))
        .filter(|&i| cache.get::<Vec<u8>>(&key(i)).expect("get").is_some())
        .count();

    let typed = per_second(gets, |x| {
        std::hint::black_box(cache.get::<Vec<u8>>(&key(x % entries)).expect("get"));
    });
    // The backend alone, on keys derived beforehand: what the backend itself costs.
    let derived_keys: Vec<String> = (0..entries).map(|i| cache.make_key(&key(i))).collect();
    let raw = per_second(gets, |x| {
        std::hint::black_box(backend.get(&derived_keys[x % entries]).expect("get"));
    });
    let f = Figures {
        heap_per_entry: (heap1 - heap0) as f64 / entries as f64,
        rss_per_entry: (rss1 - rss0) as f64 / entries as f64,
        payload,
        gets_per_s: typed,
        raw_gets_per_s: raw,
    };
    println!(
        "{name:>8}: heap {:6.1} B/entry ({:.2}x payload), rss {:6.1} B/entry ({:.2}x payload), \
         payload {:.0} B (key {} + stored {}), typed gets on 2 threads {:.2} M/s, \
         backend gets {:.2} M/s, \
         sampled keys held {held}/1000",
        f.heap_per_entry,
        f.heap_per_entry / f.payload,
        f.rss_per_entry,
        f.rss_per_entry / f.payload,
        f.payload,
        derived.len(),
        stored.value.len(),
        f.gets_per_s / 1e6,
        f.raw_gets_per_s / 1e6,
    );
    f
}

fn main() {
    let entries = env("ENTRIES", 1_000_000);
    let gets = env("GETS", 1_000_000);
    // Each backend runs in a process of its own, so that neither reuses the other's freed pages
    // (which would hide its RSS growth).
    match std::env::var("BACKEND").as_deref() {
        Ok("memory") => {
            // Large enough that nothing is evicted: the figures are per entry.
            let b = MemoryBackend::new(4 << 30, Arc::new(SystemClock));
            report(measure("memory", Arc::new(b), entries, gets));
        }
        Ok("naive") => report(measure("naive", Arc::new(Naive::new()), entries, gets)),
        _ => {
            println!("entries {entries}, gets per thread {gets}");
            let memory = child("memory");
            let naive = child("naive");
            println!(
                "memory/naive: heap {:.2}x, rss {:.2}x, typed gets {:.2}x, backend gets {:.2}x",
                memory[0] / naive[0],
                memory[1] / naive[1],
                memory[3] / naive[3],
                memory[4] / naive[4],
            );
        }
    }
}

/// The figures on one line of their own, for the parent.
fn report(f: Figures) {
    println!(
        "figures {} {} {} {} {}",
        f.heap_per_entry, f.rss_per_entry, f.payload, f.gets_per_s, f.raw_gets_per_s
    );
}

fn child(backend: &str) -> Vec<f64> {
    let out = std::process::Command::new(std::env::current_exe().expect("own path"))
        .env("BACKEND", backend)
        .output()
        .expect("the bench runs itself");
    let text = String::from_utf8_lossy(&out.stdout);
    let mut figures = Vec::new();
    for line in text.lines() {
        match line.strip_prefix("figures ") {
            Some(f) => figures = f.split(' ').filter_map(|x| x.parse().ok()).collect(),
            None => println!("{line}"),
        }
    }
    assert_eq!(
        figures.len(),
        5,
        "{backend} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    figures
}
