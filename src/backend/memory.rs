//! The in-process backend: memcached's semantics (expiry and the 30-day rule, CAS, `add`, counters
//! with memcached's space padding, the item size limit) in sharded `parking_lot` maps, with bounded
//! memory and sampled-LRU eviction.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::{
    Backend, DEFAULT_ITEM_SIZE, Item, StoreMode, StoreOutcome, max_value_size, parse_counter,
};
use crate::clock::{Clock, SystemClock};
use crate::error::{Error, ErrorKind, Result};
use crate::ttl::hard_deadline_ms;

const SHARDS: usize = 16;
/// Bytes charged per entry beside key and value (map slot, bookkeeping).
const ENTRY_OVERHEAD: usize = 64;
/// Entries looked at per eviction; the least recently used of them goes.
const EVICTION_SAMPLE: usize = 8;

/// Default memory bound of a [`MemoryBackend`]: 64 MiB.
pub const DEFAULT_CAPACITY: usize = 64 * 1024 * 1024;

#[derive(Debug)]
struct Entry {
    value: Vec<u8>,
    flags: u32,
    cas: u64,
    deadline_ms: Option<u64>,
    last_used: u64,
}

impl Entry {
    fn live(&self, now_ms: u64) -> bool {
        self.deadline_ms.is_none_or(|d| now_ms < d)
    }
    fn cost(key: &str, value: &[u8]) -> usize {
        key.len() + value.len() + ENTRY_OVERHEAD
    }
}

#[derive(Debug, Default)]
struct Shard {
    map: HashMap<String, Entry>,
    bytes: usize,
}

impl Shard {
    /// The live entry under `key`; an expired one is removed on the way (memcached's lazy expiry).
    fn live_mut(&mut self, key: &str, now_ms: u64) -> Option<&mut Entry> {
        let expired = self.map.get(key).is_some_and(|e| !e.live(now_ms));
        if expired {
            self.remove(key);
        }
        self.map.get_mut(key)
    }

    fn remove(&mut self, key: &str) -> Option<Entry> {
        let e = self.map.remove(key)?;
        self.bytes -= Entry::cost(key, &e.value);
        Some(e)
    }

    fn insert(&mut self, key: &str, entry: Entry, capacity: usize, now_ms: u64) {
        self.remove(key);
        let need = Entry::cost(key, &entry.value);
        while self.bytes + need > capacity && !self.map.is_empty() {
            self.evict_one(now_ms);
        }
        self.bytes += need;
        self.map.insert(key.to_string(), entry);
    }

    /// Sampled LRU (as Redis does): of a few entries, drop an expired one or the least recently used.
    fn evict_one(&mut self, now_ms: u64) {
        let victim = self
            .map
            .iter()
            .take(EVICTION_SAMPLE)
            .min_by_key(|(_, e)| if e.live(now_ms) { e.last_used } else { 0 })
            .map(|(k, _)| k.clone());
        if let Some(k) = victim {
            self.remove(&k);
        }
    }
}

/// An in-process cache store with memcached's semantics.
///
/// What the quickstart and the doctests run on. Expiry uses the cache's [`Clock`], so tests can
/// move time. Memory is bounded ([`DEFAULT_CAPACITY`] unless set); when full, a sampled
/// least-recently-used entry is evicted, as memcached evicts under memory pressure.
#[derive(Debug)]
pub struct MemoryBackend {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    shard_capacity: usize,
    item_size: usize,
    next_cas: AtomicU64,
    tick: AtomicU64,
    clock: Arc<dyn Clock>,
}

impl Default for MemoryBackend {
    fn default() -> Self {
        MemoryBackend::new(DEFAULT_CAPACITY, Arc::new(SystemClock))
    }
}

impl MemoryBackend {
    /// A backend holding at most about `capacity` bytes, reading time from `clock`.
    pub fn new(capacity: usize, clock: Arc<dyn Clock>) -> Self {
        MemoryBackend {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            hasher: RandomState::new(),
            // A shard must hold at least one largest item.
            shard_capacity: (capacity / SHARDS).max(DEFAULT_ITEM_SIZE + 1024),
            item_size: DEFAULT_ITEM_SIZE,
            next_cas: AtomicU64::new(1),
            tick: AtomicU64::new(0),
            clock,
        }
    }

    fn shard(&self, key: &str) -> &Mutex<Shard> {
        &self.shards[self.hasher.hash_one(key) as usize % SHARDS]
    }

    fn cas(&self) -> u64 {
        self.next_cas.fetch_add(1, Ordering::Relaxed)
    }

    fn touch_tick(&self) -> u64 {
        self.tick.fetch_add(1, Ordering::Relaxed)
    }

    fn arith(&self, key: &str, f: impl FnOnce(u64) -> u64) -> Result<Option<u64>> {
        let now = self.clock.now_ms();
        let mut shard = self.shard(key).lock();
        let Some(e) = shard.live_mut(key, now) else {
            return Ok(None);
        };
        let current = parse_counter(&e.value).ok_or_else(|| {
            Error::new(
                ErrorKind::NotACounter,
                "cannot increment or decrement a non-numeric value",
            )
        })?;
        let next = f(current);
        let mut digits = next.to_string().into_bytes();
        // memcached rewrites a shorter result in place, padded with spaces to the old length.
        if digits.len() < e.value.len() {
            digits.resize(e.value.len(), b' ');
        }
        let old = e.value.len();
        let new = digits.len();
        e.value = digits;
        e.cas = self.cas();
        e.last_used = self.touch_tick();
        shard.bytes = shard.bytes + new - old;
        Ok(Some(next))
    }
}

impl Backend for MemoryBackend {
    fn get(&self, key: &str) -> Result<Option<Item>> {
        let now = self.clock.now_ms();
        let tick = self.touch_tick();
        let mut shard = self.shard(key).lock();
        Ok(shard.live_mut(key, now).map(|e| {
            e.last_used = tick;
            Item {
                value: e.value.clone(),
                flags: e.flags,
                cas: e.cas,
            }
        }))
    }

    fn store(
        &self,
        mode: StoreMode,
        key: &str,
        value: &[u8],
        flags: u32,
        exptime: u32,
    ) -> Result<StoreOutcome> {
        if value.len() > self.max_value_size(key) {
            return Err(too_large(value.len(), self.max_value_size(key)));
        }
        let now = self.clock.now_ms();
        let mut shard = self.shard(key).lock();
        let current = shard.live_mut(key, now).map(|e| e.cas);
        let outcome = match (mode, current) {
            (StoreMode::Set, _) => StoreOutcome::Stored,
            (StoreMode::Add, None) => StoreOutcome::Stored,
            (StoreMode::Add, Some(_)) => StoreOutcome::NotStored,
            (StoreMode::Cas(_), None) => StoreOutcome::NotFound,
            (StoreMode::Cas(want), Some(have)) if want == have => StoreOutcome::Stored,
            (StoreMode::Cas(_), Some(_)) => StoreOutcome::Exists,
        };
        if outcome == StoreOutcome::Stored {
            let entry = Entry {
                value: value.to_vec(),
                flags,
                cas: self.cas(),
                deadline_ms: hard_deadline_ms(exptime, now),
                last_used: self.touch_tick(),
            };
            shard.insert(key, entry, self.shard_capacity, now);
        }
        Ok(outcome)
    }

    fn delete(&self, key: &str) -> Result<bool> {
        let now = self.clock.now_ms();
        let mut shard = self.shard(key).lock();
        let live = shard.live_mut(key, now).is_some();
        shard.remove(key);
        Ok(live)
    }

    fn touch(&self, key: &str, exptime: u32) -> Result<bool> {
        let now = self.clock.now_ms();
        let tick = self.touch_tick();
        let mut shard = self.shard(key).lock();
        Ok(shard
            .live_mut(key, now)
            .map(|e| {
                e.deadline_ms = hard_deadline_ms(exptime, now);
                e.last_used = tick;
            })
            .is_some())
    }

    fn incr(&self, key: &str, delta: u64) -> Result<Option<u64>> {
        self.arith(key, |v| v.wrapping_add(delta))
    }

    fn decr(&self, key: &str, delta: u64) -> Result<Option<u64>> {
        self.arith(key, |v| v.saturating_sub(delta))
    }

    fn flush_all(&self) -> Result<()> {
        for s in self.shards.iter() {
            let mut s = s.lock();
            s.map.clear();
            s.bytes = 0;
        }
        Ok(())
    }

    fn max_value_size(&self, key: &str) -> usize {
        max_value_size(self.item_size, key)
    }
}

pub(crate) fn too_large(len: usize, max: usize) -> Error {
    Error::new(
        ErrorKind::TooLarge,
        format!(
            "the encoded value is {len} bytes, the backend stores at most {max} under this key"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::MockClock;
    use std::time::Duration;

    fn backend() -> (MemoryBackend, Arc<MockClock>) {
        let clock = MockClock::new();
        (MemoryBackend::new(DEFAULT_CAPACITY, clock.clone()), clock)
    }

    #[test]
    fn expiry_follows_exptime() {
        let (b, clock) = backend();
        b.store(StoreMode::Set, "k", b"v", 0, 2).unwrap();
        clock.advance(Duration::from_millis(1999));
        assert!(b.get("k").unwrap().is_some());
        clock.advance(Duration::from_millis(1));
        assert!(b.get("k").unwrap().is_none());
        // an absolute exptime in the past is gone at once
        b.store(StoreMode::Set, "k", b"v", 0, 2_592_001).unwrap();
        assert!(b.get("k").unwrap().is_none());
    }

    #[test]
    fn add_and_cas() {
        let (b, _) = backend();
        assert_eq!(
            b.store(StoreMode::Add, "k", b"1", 0, 0).unwrap(),
            StoreOutcome::Stored
        );
        assert_eq!(
            b.store(StoreMode::Add, "k", b"2", 0, 0).unwrap(),
            StoreOutcome::NotStored
        );
        let cas = b.get("k").unwrap().unwrap().cas;
        assert_eq!(
            b.store(StoreMode::Cas(cas), "k", b"3", 0, 0).unwrap(),
            StoreOutcome::Stored
        );
        assert_eq!(
            b.store(StoreMode::Cas(cas), "k", b"4", 0, 0).unwrap(),
            StoreOutcome::Exists
        );
        assert_eq!(
            b.store(StoreMode::Cas(cas), "x", b"4", 0, 0).unwrap(),
            StoreOutcome::NotFound
        );
        assert_eq!(b.get("k").unwrap().unwrap().value, b"3");
    }

    #[test]
    fn counters_pad_like_memcached() {
        let (b, _) = backend();
        b.store(StoreMode::Set, "c", b"100", 0, 0).unwrap();
        assert_eq!(b.decr("c", 1).unwrap(), Some(99));
        assert_eq!(b.get("c").unwrap().unwrap().value, b"99 ");
        assert_eq!(b.incr("c", 901).unwrap(), Some(1000));
        assert_eq!(b.decr("c", 5000).unwrap(), Some(0));
        b.store(StoreMode::Set, "c", u64::MAX.to_string().as_bytes(), 0, 0)
            .unwrap();
        assert_eq!(b.incr("c", 2).unwrap(), Some(1));
        assert_eq!(b.incr("missing", 1).unwrap(), None);
        b.store(StoreMode::Set, "t", b"abc", 0, 0).unwrap();
        assert_eq!(b.incr("t", 1).unwrap_err().kind(), ErrorKind::NotACounter);
    }

    #[test]
    fn memory_is_bounded() {
        let clock = MockClock::new();
        let b = MemoryBackend::new(0, clock); // the floor: one largest item per shard
        let v = vec![7u8; 100_000];
        for i in 0..1000 {
            b.store(StoreMode::Set, &format!("k{i}"), &v, 0, 0).unwrap();
        }
        let held: usize = b.shards.iter().map(|s| s.lock().bytes).sum();
        assert!(held <= SHARDS * (DEFAULT_ITEM_SIZE + 1024), "{held}");
        assert!(
            b.get("k999").unwrap().is_some(),
            "the newest entry survives"
        );
    }

    #[test]
    fn too_large_is_refused() {
        let (b, _) = backend();
        let max = b.max_value_size("k");
        assert!(b.store(StoreMode::Set, "k", &vec![0; max], 0, 0).is_ok());
        let e = b
            .store(StoreMode::Set, "k", &vec![0; max + 1], 0, 0)
            .unwrap_err();
        assert!(e.is_too_large());
    }
}
