//! The in-process backend: memcached's semantics (expiry and the 30-day rule, signed `exptime`,
//! CAS, `add`, counters with memcached's space padding, the item size limit) in sharded
//! `parking_lot` tables, with an exact memory bound and CLOCK (approximate LRU) eviction.

mod shard;

use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::{
    Backend, DEFAULT_ITEM_SIZE, Item, StoreMode, StoreOutcome, Write, max_value_size, parse_counter,
};
use crate::clock::{Clock, SystemClock};
use crate::error::{Error, ErrorKind, Result};
use crate::ttl::hard_deadline_ms;
use shard::{ENTRY_OVERHEAD, Shard, Slot};

/// The most shards a backend has; fewer when the capacity is small (see [`MemoryBackend::new`]).
const MAX_SHARDS: usize = 16;
/// A shard holds at least this many largest items, so one large value never empties a shard.
const ITEMS_PER_SHARD: usize = 4;

/// Default memory bound of a [`MemoryBackend`]: 64 MiB.
pub const DEFAULT_CAPACITY: usize = 64 * 1024 * 1024;

/// An in-process cache store with memcached's semantics.
///
/// What the quickstart and the doctests run on. Expiry uses the cache's [`Clock`], so tests can
/// move time. Memory is bounded ([`DEFAULT_CAPACITY`] unless set): every entry is charged its key,
/// its value and 112 bytes of bookkeeping, and the charges never exceed the capacity. When a write
/// needs room, CLOCK (second chance, an approximation of least-recently-used) evicts: entries
/// read or written since the eviction hand last passed them stay, the others go, so a small hot
/// set survives a scan of keys read once.
///
/// The capacity is split between up to 16 shards (each with its own lock), each at least four
/// items of the item size (1 MiB unless set): a capacity under 8 MiB has one shard. A value whose
/// entry does not fit in one shard is refused with a `TooLarge` error, like a value over the item
/// size.
///
/// A read hands out the stored bytes themselves (a shared [`Bytes`](bytes::Bytes), no copy). A
/// value kept after its entry is replaced, deleted or evicted keeps its entry's bytes alive:
/// they are no longer charged to the backend, but are not freed before the value is dropped.
pub struct MemoryBackend {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    shard_capacity: usize,
    item_size: usize,
    next_cas: AtomicU64,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for MemoryBackend {
    // Not the entries: a cache of a million would print them all.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryBackend")
            .field("shards", &self.shards.len())
            .field("shard_capacity", &self.shard_capacity)
            .field("item_size", &self.item_size)
            .finish_non_exhaustive()
    }
}

impl Default for MemoryBackend {
    fn default() -> Self {
        MemoryBackend::new(DEFAULT_CAPACITY, Arc::new(SystemClock))
    }
}

impl MemoryBackend {
    /// A backend holding at most `capacity` bytes (keys, values and 112 bytes per entry), with
    /// memcached's default item size (1 MiB), reading time from `clock`.
    pub fn new(capacity: usize, clock: Arc<dyn Clock>) -> Self {
        MemoryBackend::with_item_size(capacity, DEFAULT_ITEM_SIZE, clock)
    }

    /// As [`new`](Self::new), refusing values as memcached started with `-I item_size` would
    /// (what [`CacheBuilder::item_size`](crate::CacheBuilder::item_size) sets).
    pub fn with_item_size(capacity: usize, item_size: usize, clock: Arc<dyn Clock>) -> Self {
        let mut shards = MAX_SHARDS;
        while shards > 1 && capacity / shards < ITEMS_PER_SHARD.saturating_mul(item_size) {
            shards /= 2;
        }
        let hasher = RandomState::new();
        let shard_capacity = capacity / shards;
        MemoryBackend {
            shards: (0..shards)
                .map(|_| Mutex::new(Shard::new(shard_capacity, hasher.clone())))
                .collect(),
            hasher,
            shard_capacity,
            item_size,
            next_cas: AtomicU64::new(1),
            clock,
        }
    }

    /// The key's hash and its shard. The shard is chosen by bits the shard's table does not use
    /// for its buckets (hashbrown takes the low bits for the bucket, the top 7 for its tag).
    fn locate(&self, key: &str) -> (u64, &Mutex<Shard>) {
        let hash = self.hasher.hash_one(key.as_bytes());
        let shard = (hash >> 32) as usize % self.shards.len();
        (hash, &self.shards[shard])
    }

    fn cas(&self) -> u64 {
        self.next_cas.fetch_add(1, Ordering::Relaxed)
    }

    fn arith(&self, key: &str, f: impl FnOnce(u64) -> u64) -> Result<Option<u64>> {
        let now = self.clock.now_ms();
        let (hash, shard) = self.locate(key);
        let mut shard = shard.lock();
        let Some(e) = shard.live_mut(hash, key, now) else {
            return Ok(None);
        };
        let current = parse_counter(e.value()).ok_or_else(|| {
            Error::new(
                ErrorKind::NotACounter,
                "cannot increment or decrement a non-numeric value",
            )
        })?;
        let next = f(current);
        let mut digits = next.to_string().into_bytes();
        // memcached rewrites a shorter result in place, padded with spaces to the old length.
        if digits.len() < e.value().len() {
            digits.resize(e.value().len(), b' ');
        }
        if key.len() + digits.len() + ENTRY_OVERHEAD > self.shard_capacity {
            // Only a shard of a few dozen bytes; memcached answers "out of memory" there.
            return Err(too_large(digits.len(), self.max_value_size(key)));
        }
        shard.rewrite(hash, key, &digits, self.cas(), now);
        Ok(Some(next))
    }
}

/// memcached's reading of `exptime` as unix milliseconds (0 = never): a signed 32-bit number,
/// so anything above `i32::MAX` is negative and expires the item at once; otherwise
/// [`hard_deadline_ms`].
fn deadline_ms(exptime: u32, now_ms: u64) -> u64 {
    if i32::try_from(exptime).is_err() {
        return 1;
    }
    hard_deadline_ms(exptime, now_ms).map_or(0, |d| d.max(1))
}

fn expired(deadline_ms: u64, now_ms: u64) -> bool {
    deadline_ms != 0 && deadline_ms <= now_ms
}

impl Backend for MemoryBackend {
    fn get(&self, key: &str) -> Result<Option<Item>> {
        let now = self.clock.now_ms();
        let (hash, shard) = self.locate(key);
        let mut shard = shard.lock();
        Ok(shard.live_mut(hash, key, now).map(|e| e.item()))
    }

    /// One clock read for the whole batch (a hundred `get`s each read it otherwise): the batch
    /// is read at one instant, as a `gets` line is answered by memcached.
    fn get_many(&self, keys: &[&str]) -> Vec<Result<Option<Item>>> {
        let now = self.clock.now_ms();
        keys.iter()
            .map(|key| {
                let (hash, shard) = self.locate(key);
                Ok(shard.lock().live_mut(hash, key, now).map(|e| e.item()))
            })
            .collect()
    }

    fn store(&self, w: Write<'_>) -> Result<StoreOutcome> {
        let Write {
            mode,
            key,
            value,
            flags,
            exptime,
        } = w;
        crate::key::check_len(key)?;
        if mode == StoreMode::Cas(0) {
            return Err(crate::backend::no_cas(None));
        }
        let max = self.max_value_size(key);
        // The second test catches a key that alone (with its overhead) overflows a tiny shard.
        if value.len() > max || key.len() + value.len() + ENTRY_OVERHEAD > self.shard_capacity {
            return Err(too_large(value.len(), max));
        }
        let now = self.clock.now_ms();
        let deadline = deadline_ms(exptime, now);
        let (hash, shard) = self.locate(key);
        // The check and the write happen under one lock: an `add` or `cas` is one step, whatever
        // its exptime.
        let mut shard = shard.lock();
        let current = shard.live_mut(hash, key, now).map(|e| e.cas);
        let outcome = match (mode, current) {
            (StoreMode::Set, _) => StoreOutcome::Stored,
            (StoreMode::Add, None) => StoreOutcome::Stored,
            (StoreMode::Add, Some(_)) => StoreOutcome::NotStored,
            (StoreMode::Cas(_), None) => StoreOutcome::NotFound,
            (StoreMode::Cas(want), Some(have)) if want == have => StoreOutcome::Stored,
            (StoreMode::Cas(_), Some(_)) => StoreOutcome::Exists,
        };
        if outcome == StoreOutcome::Stored {
            if expired(deadline, now) {
                // Stored and expired at once, as memcached does: nothing to keep.
                shard.remove(hash, key, now);
            } else {
                let slot = Slot::new(key, value, flags, self.cas(), deadline);
                shard.insert(hash, key, slot, now);
            }
        }
        Ok(outcome)
    }

    fn delete(&self, key: &str) -> Result<bool> {
        let now = self.clock.now_ms();
        let (hash, shard) = self.locate(key);
        Ok(shard.lock().remove(hash, key, now))
    }

    fn touch(&self, key: &str, exptime: u32) -> Result<bool> {
        let now = self.clock.now_ms();
        let deadline = deadline_ms(exptime, now);
        let (hash, shard) = self.locate(key);
        let mut shard = shard.lock();
        let Some(e) = shard.live_mut(hash, key, now) else {
            return Ok(false);
        };
        e.deadline_ms = deadline;
        if expired(deadline, now) {
            shard.remove(hash, key, now);
        }
        Ok(true)
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
            *s = Shard::new(self.shard_capacity, self.hasher.clone());
        }
        Ok(())
    }

    fn max_value_size(&self, key: &str) -> usize {
        let in_shard = self
            .shard_capacity
            .saturating_sub(key.len() + ENTRY_OVERHEAD);
        max_value_size(self.item_size, key).min(in_shard)
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

    /// `b.store` of a write made from its fields.
    fn put(
        b: &MemoryBackend,
        mode: StoreMode,
        key: &str,
        value: &[u8],
        flags: u32,
        exptime: u32,
    ) -> Result<StoreOutcome> {
        b.store(Write::new(mode, key, value, flags, exptime))
    }

    fn backend() -> (MemoryBackend, Arc<MockClock>) {
        let clock = MockClock::new();
        (MemoryBackend::new(DEFAULT_CAPACITY, clock.clone()), clock)
    }

    #[test]
    fn expiry_follows_exptime() {
        let (b, clock) = backend();
        put(&b, StoreMode::Set, "k", b"v", 0, 2).unwrap();
        clock.advance(Duration::from_millis(1999));
        assert!(b.get("k").unwrap().is_some());
        clock.advance(Duration::from_millis(1));
        assert!(b.get("k").unwrap().is_none());
        // an absolute exptime in the past is gone at once
        put(&b, StoreMode::Set, "k", b"v", 0, 2_592_001).unwrap();
        assert!(b.get("k").unwrap().is_none());
    }

    #[test]
    fn a_batch_reads_what_single_gets_read() {
        let (b, clock) = backend();
        put(&b, StoreMode::Set, "live", b"1", 7, 0).unwrap();
        put(&b, StoreMode::Set, "short", b"2", 0, 1).unwrap();
        clock.advance(Duration::from_millis(1000));
        let keys = ["live", "short", "missing", "live"];
        let batch = b.get_many(&keys);
        assert_eq!(batch.len(), keys.len());
        for (k, got) in keys.iter().zip(batch) {
            let one = b.get(k).unwrap().map(|i| (i.value, i.flags, i.cas));
            assert_eq!(got.unwrap().map(|i| (i.value, i.flags, i.cas)), one, "{k}");
        }
        assert!(b.get_many(&["short"])[0].as_ref().unwrap().is_none());
    }

    #[test]
    fn a_value_read_is_the_stored_buffer_and_outlives_its_entry() {
        let (b, _) = backend();
        put(&b, StoreMode::Set, "k", b"first", 0, 0).unwrap();
        let one = b.get("k").unwrap().unwrap().value;
        let two = b.get("k").unwrap().unwrap().value;
        // Not copied: both reads are the stored buffer.
        assert_eq!(one.as_ptr(), two.as_ptr());
        // Written again, deleted, flushed: what was read stays as it was read.
        put(&b, StoreMode::Set, "k", b"other", 0, 0).unwrap();
        let three = b.get("k").unwrap().unwrap().value;
        assert_ne!(three.as_ptr(), one.as_ptr());
        assert_eq!(&three[..], b"other");
        b.delete("k").unwrap();
        b.flush_all().unwrap();
        assert_eq!(&one[..], b"first");
        assert_eq!(&two[..], b"first");
        assert_eq!(&three[..], b"other");
    }

    #[test]
    fn add_and_cas() {
        use StoreMode::{Add, Cas};
        use StoreOutcome::{Exists, NotFound, NotStored, Stored};
        let (b, _) = backend();
        let put = |mode, key: &str, value: &[u8]| put(&b, mode, key, value, 0, 0).unwrap();
        assert_eq!(put(Add, "k", b"1"), Stored);
        assert_eq!(put(Add, "k", b"2"), NotStored);
        let cas = b.get("k").unwrap().unwrap().cas;
        assert_eq!(put(Cas(cas), "k", b"3"), Stored);
        assert_eq!(put(Cas(cas), "k", b"4"), Exists);
        assert_eq!(put(Cas(cas), "x", b"4"), NotFound);
        assert_eq!(&b.get("k").unwrap().unwrap().value[..], b"3");
    }

    #[test]
    fn counters_pad_like_memcached() {
        let (b, _) = backend();
        put(&b, StoreMode::Set, "c", b"100", 0, 0).unwrap();
        assert_eq!(b.decr("c", 1).unwrap(), Some(99));
        assert_eq!(&b.get("c").unwrap().unwrap().value[..], b"99 ");
        assert_eq!(b.incr("c", 901).unwrap(), Some(1000));
        assert_eq!(b.decr("c", 5000).unwrap(), Some(0));
        let max = u64::MAX.to_string();
        put(&b, StoreMode::Set, "c", max.as_bytes(), 0, 0).unwrap();
        assert_eq!(b.incr("c", 2).unwrap(), Some(1));
        assert_eq!(b.incr("missing", 1).unwrap(), None);
        put(&b, StoreMode::Set, "t", b"abc", 0, 0).unwrap();
        assert_eq!(b.incr("t", 1).unwrap_err().kind(), ErrorKind::NotACounter);
    }

    #[test]
    fn memory_is_bounded() {
        let b = MemoryBackend::new(1 << 20, MockClock::new());
        let v = vec![7u8; 10_000];
        for i in 0..1000 {
            put(&b, StoreMode::Set, &format!("k{i}"), &v, 0, 0).unwrap();
        }
        let held: usize = b.shards.iter().map(|s| s.lock().bytes()).sum();
        assert!(held <= 1 << 20, "{held}");
        assert!(held >= (1 << 20) * 9 / 10, "{held}: the capacity is used");
        assert!(
            b.get("k999").unwrap().is_some(),
            "the newest entry survives"
        );
    }

    #[test]
    fn shards_hold_four_largest_items() {
        #[track_caller]
        fn check(capacity: usize, item_size: usize, shards: usize, max_value: usize) {
            let b = MemoryBackend::with_item_size(capacity, item_size, MockClock::new());
            assert_eq!(b.shards.len(), shards);
            assert_eq!(b.max_value_size("k"), max_value);
        }
        let mib = 1 << 20;
        check(DEFAULT_CAPACITY, mib, 16, mib - 1 - 64);
        check(64 * mib, 4 * mib, 4, 4 * mib - 1 - 64);
        check(8 * mib, mib, 2, mib - 1 - 64);
        check(8 * mib - 1, mib, 1, mib - 1 - 64);
        // a capacity under the item size bounds the value
        check(64 * 1024, mib, 1, 64 * 1024 - 1 - ENTRY_OVERHEAD);
        check(0, mib, 1, 0);
        // nothing fits in a shard smaller than one entry's overhead, not even an empty value
        let b = MemoryBackend::new(ENTRY_OVERHEAD, MockClock::new());
        let e = b
            .store(Write::new(StoreMode::Set, "k", b"", 0, 0))
            .unwrap_err();
        assert!(e.is_too_large());
        // nor a counter that outgrows it
        let b = MemoryBackend::new(1 + 2 + ENTRY_OVERHEAD, MockClock::new());
        put(&b, StoreMode::Set, "c", b"99", 0, 0).unwrap();
        assert!(b.incr("c", 1).unwrap_err().is_too_large());
        assert_eq!(&b.get("c").unwrap().unwrap().value[..], b"99", "unchanged");
    }

    #[test]
    fn touch_reads_exptime_as_store_does() {
        let (b, clock) = backend();
        assert!(!b.touch("k", 10).unwrap(), "missing");
        put(&b, StoreMode::Set, "k", b"v", 0, 1).unwrap();
        assert!(b.touch("k", 10).unwrap());
        clock.advance(Duration::from_millis(9999));
        assert!(
            b.get("k").unwrap().is_some(),
            "relative: 10 s from the touch"
        );
        assert!(b.touch("k", 0).unwrap());
        clock.advance(Duration::from_secs(86_400));
        assert!(b.get("k").unwrap().is_some(), "0: never");
        let later = (clock.now_ms() / 1000 + 5) as u32;
        assert!(b.touch("k", later).unwrap());
        clock.advance(Duration::from_secs(5));
        assert!(
            b.get("k").unwrap().is_none(),
            "absolute: gone at that second"
        );
        for gone in [2_592_001, 1 << 31, u32::MAX] {
            put(&b, StoreMode::Set, "k", b"v", 0, 0).unwrap();
            assert!(b.touch("k", gone).unwrap(), "it existed");
            assert!(b.get("k").unwrap().is_none(), "{gone}: expired at once");
            assert!(!b.touch("k", 0).unwrap(), "{gone}: removed");
        }
    }

    #[test]
    fn a_counter_keeps_flags_and_expiry() {
        let (b, clock) = backend();
        put(&b, StoreMode::Set, "c", b"9", 42, 10).unwrap();
        let cas = b.get("c").unwrap().unwrap().cas;
        assert_eq!(b.incr("c", 1).unwrap(), Some(10));
        let item = b.get("c").unwrap().unwrap();
        assert_eq!((&item.value[..], item.flags), (&b"10"[..], 42));
        assert_ne!(item.cas, cas, "a new version");
        clock.advance(Duration::from_secs(10));
        assert_eq!(b.incr("c", 1).unwrap(), None, "the expiry is kept");
    }

    #[test]
    fn too_large_is_refused() {
        let (b, _) = backend();
        let max = b.max_value_size("k");
        assert!(put(&b, StoreMode::Set, "k", &vec![0; max], 0, 0).is_ok());
        let e = b
            .store(Write::new(StoreMode::Set, "k", &vec![0; max + 1], 0, 0))
            .unwrap_err();
        assert!(e.is_too_large());
    }
}
