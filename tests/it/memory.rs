//! The memory backend's own promises: approximate LRU eviction, an exact capacity, the item size
//! limit, and memcached's reading of `exptime` (zero-TTL `add`, signed expiry times).

use std::sync::Arc;
use std::time::Duration;

use newcache::testing::MockClock;
use newcache::{Backend, Cache, MemoryBackend, StoreMode, StoreOutcome, Ttl};

/// memcached reads an `exptime` above 30 days as a unix time; this one is in 1970.
const EXPIRED: u32 = 2_592_001;

/// How many of `keys` a cache still serves.
fn held(cache: &Cache, keys: impl Iterator<Item = String>) -> usize {
    keys.filter(|k| cache.get::<Vec<u8>>(k).expect("get").is_some())
        .count()
}

#[test]
fn a_hot_set_survives_a_scan_of_cold_keys() {
    const VALUE: usize = 4000;
    const CAPACITY: usize = 16 << 20;
    // About 4000 entries fit; a tenth of that is hot.
    let fit = CAPACITY / (VALUE + 100);
    let hot = fit / 10;
    let b = MemoryBackend::new(CAPACITY, MockClock::new());
    let v = vec![1u8; VALUE];
    for h in 0..hot {
        b.store(newcache::Write::new(
            StoreMode::Set,
            &format!("hot{h}"),
            &v,
            0,
            0,
        ))
        .unwrap();
    }
    // Twice the capacity of keys written once and never read, while the hot keys are read in
    // turn (each one once every `hot` writes).
    for c in 0..2 * fit {
        b.store(newcache::Write::new(
            StoreMode::Set,
            &format!("cold{c}"),
            &v,
            0,
            0,
        ))
        .unwrap();
        b.get(&format!("hot{}", c % hot)).unwrap();
    }
    let survivors = (0..hot)
        .filter(|h| b.get(&format!("hot{h}")).unwrap().is_some())
        .count();
    assert!(
        survivors * 10 >= hot * 9,
        "{survivors} of {hot} hot keys survived the scan"
    );
    // and the cache is full of something: the newest cold keys
    let recent = (fit..2 * fit)
        .filter(|c| b.get(&format!("cold{c}")).unwrap().is_some())
        .count();
    assert!(recent > fit / 2, "{recent} of the newest {fit} cold keys");
}

#[test]
fn capacity_bounds_what_is_held() {
    let cache = Cache::builder().memory_capacity(64 * 1024).build().unwrap();
    let v = vec![3u8; 1000];
    for i in 0..1000 {
        cache.set(&format!("k{i}"), &v, Ttl::Never).unwrap();
    }
    let n = held(&cache, (0..1000).map(|i| format!("k{i}")));
    assert!(n * 1000 <= 64 * 1024, "{n} values of 1000 bytes held");
    assert!(n >= 32, "only {n} values of 1000 bytes held in 64 KiB");
    // a value larger than the whole capacity is refused, as memcached refuses one over -I
    let e = cache
        .set("big", &vec![0u8; 70_000], Ttl::Never)
        .unwrap_err();
    assert!(e.is_too_large(), "{e}");
}

#[test]
fn in_memory_keeps_the_capacity() {
    let cache = Cache::builder()
        .memory_capacity(64 * 1024)
        .in_memory()
        .build()
        .unwrap();
    let v = vec![3u8; 1000];
    for i in 0..1000 {
        cache.set(&format!("k{i}"), &v, Ttl::Never).unwrap();
    }
    let n = held(&cache, (0..1000).map(|i| format!("k{i}")));
    assert!(n * 1000 <= 64 * 1024, "{n} values of 1000 bytes held");
}

#[test]
fn item_size_limits_the_memory_backend() {
    let cache = Cache::builder().item_size(4096).build().unwrap();
    let e = cache.set("k", &vec![0u8; 5000], Ttl::Never).unwrap_err();
    assert!(e.is_too_large(), "{e}");
    cache.set("k", &vec![0u8; 3000], Ttl::Never).unwrap();
    assert_eq!(cache.get::<Vec<u8>>("k").unwrap(), Some(vec![0u8; 3000]));
}

#[test]
fn an_expired_add_is_one_step() {
    let b = MemoryBackend::new(1 << 20, MockClock::new());
    // a free key: stored, and expired at once
    assert_eq!(
        b.store(newcache::Write::new(StoreMode::Add, "k", b"x", 0, EXPIRED))
            .unwrap(),
        StoreOutcome::Stored
    );
    assert_eq!(b.get("k").unwrap(), None);
    // a live key: not stored, the value untouched
    b.store(newcache::Write::new(StoreMode::Set, "k", b"live", 0, 0))
        .unwrap();
    assert_eq!(
        b.store(newcache::Write::new(StoreMode::Add, "k", b"x", 0, EXPIRED))
            .unwrap(),
        StoreOutcome::NotStored
    );
    assert_eq!(&b.get("k").unwrap().unwrap().value[..], b"live");
    // two threads race an expired add against a live one on the same keys: whenever the live add
    // reports Stored, its value is readable (an add that checked, then removed, could lose it)
    let b = Arc::new(b);
    std::thread::scope(|s| {
        s.spawn(|| {
            for i in 0..20_000 {
                b.store(newcache::Write::new(
                    StoreMode::Add,
                    &format!("r{i}"),
                    b"",
                    0,
                    EXPIRED,
                ))
                .unwrap();
            }
        });
        s.spawn(|| {
            for i in 0..20_000 {
                let k = format!("r{i}");
                if b.store(newcache::Write::new(StoreMode::Add, &k, b"v", 0, 0))
                    .unwrap()
                    == StoreOutcome::Stored
                {
                    assert!(b.get(&k).unwrap().is_some(), "{k} vanished");
                }
            }
        });
    });
}

#[test]
fn a_zero_ttl_add_through_the_cache() {
    let clock = MockClock::new();
    let cache = Cache::builder()
        .clock(clock.clone())
        .memory_capacity(1 << 20)
        .build()
        .unwrap();
    // free: "stored and expired at once", nothing readable
    assert!(cache.add("free", &1u32, Duration::ZERO).unwrap());
    assert_eq!(cache.get::<u32>("free").unwrap(), None);
    // live: refused, the value stays
    cache.set("live", &2u32, Duration::from_secs(60)).unwrap();
    assert!(!cache.add("live", &3u32, Duration::ZERO).unwrap());
    assert_eq!(cache.get::<u32>("live").unwrap(), Some(2));
}

#[test]
fn exptime_is_a_signed_32_bit_number() {
    // memcached 1.6 reads exptime as an int32: 2^31 and above are negative, expired at once
    // (checked against memcached 1.6.18 with `set` and `touch`).
    let b = MemoryBackend::new(1 << 20, MockClock::new());
    b.store(newcache::Write::new(
        StoreMode::Set,
        "max",
        b"v",
        0,
        i32::MAX as u32,
    ))
    .unwrap();
    assert!(b.get("max").unwrap().is_some(), "2038 is in the future");
    for e in [1u32 << 31, u32::MAX] {
        b.store(newcache::Write::new(StoreMode::Set, "neg", b"v", 0, e))
            .unwrap();
        assert_eq!(b.get("neg").unwrap(), None, "set with exptime {e}");
        b.store(newcache::Write::new(StoreMode::Set, "t", b"v", 0, 0))
            .unwrap();
        assert!(b.touch("t", e).unwrap(), "the key existed");
        assert_eq!(b.get("t").unwrap(), None, "touch with exptime {e}");
    }
    // touch reads the field as store does: relative, absolute in the past, never
    b.store(newcache::Write::new(StoreMode::Set, "t", b"v", 0, 0))
        .unwrap();
    assert!(b.touch("t", EXPIRED).unwrap());
    assert_eq!(b.get("t").unwrap(), None);
    assert!(!b.touch("t", 0).unwrap(), "gone");
}
