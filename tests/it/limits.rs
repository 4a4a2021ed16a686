//! The size limit and the decode limit at their edges: items another build wrote at the item
//! limit (no room for a claim's header), and values whose decoding `set` must count before it
//! stores them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use newcache::{Cache, Compression, Ttl};
use serde::{Deserialize, Serialize};

use crate::fixture::{Env, unique_flavor};
use crate::front::BuildFor;
use crate::values::grown_to;
use std::sync::{Arc, Barrier, Mutex};

use newcache::{Backend, Item, MemoryBackend, StoreMode, StoreOutcome, Write};

use crate::fixture::Kind;

const S: fn(u64) -> Duration = Duration::from_secs;

crate::on_every_backend!(
    a_get_of_a_stale_item_at_the_limit_keeps_it_for_loaders,
    serve_stale_on_error_still_serves_a_stale_item_at_the_limit,
    touch_of_an_item_another_build_wrote_at_the_limit_is_not_too_large,
    a_failed_load_gives_back_the_stale_item_at_the_limit_it_displaced,
);

/// Writes `key` as an item at the backend's very limit, soft-expiring in 10 s (or never).
fn write_full(env: &Env, cache: &crate::front::TestCache, key: &str, ttl: Ttl) -> usize {
    let k = cache.make_key(key);
    cache.set(key, &"x".repeat(100_000), ttl).unwrap();
    let limit = env.backend().max_value_size(&k);
    let full = grown_to(&env.raw_get(&k).unwrap(), limit);
    env.raw_set(&k, &full, newcache::__private::FLAGS);
    limit - usize::from(full[6]) - 5
}

/// A `get` of a stale item with no room for a claim serves it stale, unclaimed: a loader after it
/// is not kept waiting (a placeholder of the herd timeout's length timed every loader out).
fn a_get_of_a_stale_item_at_the_limit_keeps_it_for_loaders(env: &Env) {
    let cache = env
        .builder()
        .max_wait(Duration::from_millis(300))
        .build_front(env.front);
    let n = write_full(env, &cache, "full", Ttl::After(S(10)));
    env.advance(S(11));
    // a `get` cannot claim it (no room): it serves it stale, and leaves it to a loader
    assert_eq!(
        cache.get::<String>("full").unwrap().map(|s| s.len()),
        Some(n)
    );
    let loads = AtomicUsize::new(0);
    let got = cache.get_or_set_with("full", S(60), || {
        loads.fetch_add(1, Ordering::SeqCst);
        Ok::<_, std::io::Error>("fresh".to_string())
    });
    match got {
        Ok(v) => assert_eq!((v.as_str(), loads.load(Ordering::SeqCst)), ("fresh", 1)),
        Err(e) => panic!(
            "a loader after a plain get of a stale value at the limit: {e} (wait timeout: {}; \
             a value with room is served stale here)",
            e.cache().is_some_and(newcache::Error::is_wait_timeout)
        ),
    }
}

/// A loader's placeholder over a stale value at the limit keeps that value: its
/// `serve_stale_on_error` serves it when the refresh fails, as for a value with room.
fn serve_stale_on_error_still_serves_a_stale_item_at_the_limit(env: &Env) {
    let cache = env
        .builder()
        .serve_stale_on_error(S(3600))
        .build_front(env.front);
    // control: a value with room is served stale when its refresh fails
    cache.set("small", &"s".repeat(100), S(10)).unwrap();
    let n = write_full(env, &cache, "full", Ttl::After(S(10)));
    env.advance(S(11));
    let failing = || Err::<String, _>(std::io::Error::other("the database is down"));
    let small = cache.get_or_set_with("small", S(60), failing).unwrap();
    assert_eq!(small.len(), 100);
    let full = cache.get_or_set_with("full", S(60), failing);
    assert_eq!(
        full.as_ref().map(String::len).map_err(ToString::to_string),
        Ok(n),
        "a stale value at the limit, its refresh failed"
    );
}

/// A loader's placeholder over a stale value at the limit (no room for a claim's header) puts
/// that value back when the load fails, on both front ends (the async one from a task of its
/// own): readers keep the stale value rather than find the key empty.
fn a_failed_load_gives_back_the_stale_item_at_the_limit_it_displaced(env: &Env) {
    let cache = env
        .builder()
        .max_wait(Duration::from_millis(300))
        .build_front(env.front);
    let n = write_full(env, &cache, "full", Ttl::After(S(10)));
    env.advance(S(11));
    let r = cache.get_or_set_with("full", S(60), || {
        Err::<String, _>(std::io::Error::other("the database is down"))
    });
    assert!(r.is_err());
    // The async give-back runs on a task: wait for it, within a bound a loaded machine keeps.
    let deadline = std::time::Instant::now() + S(10);
    loop {
        let got = cache.get::<String>("full").unwrap().map(|s| s.len());
        if got == Some(n) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the displaced stale value is not back after a failed load: {got:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `touch` of an item another build wrote at the limit (no room for a re-timed header) falls back
/// to memcached's own touch: never `TooLarge` for a value this caller did not write.
fn touch_of_an_item_another_build_wrote_at_the_limit_is_not_too_large(env: &Env) {
    let cache = env.cache();
    write_full(env, &cache, "forever", Ttl::Never);
    match cache.touch("forever", S(60)) {
        Ok(_) => {}
        Err(e) => panic!(
            "touch of a value at the limit: {e} (too large: {})",
            e.is_too_large()
        ),
    }
}

/// Caches with different item sizes over one server.
mod over_item_size {
    use super::*;
    use crate::front::TestCache;

    /// Each test on every server two caches with their own item sizes can share: not the memory
    /// backend (one item size for every cache on it); a cluster's nodes take the same requests
    /// as one Redis server.
    macro_rules! on_shared_servers {
        ($($name:ident),* $(,)?) => {
            crate::on_backend!(memcached, Memcached, Sync, $($name),*);
            crate::on_backend!(async_memcached, Memcached, Async, $($name),*);
            #[cfg(feature = "redis")]
            crate::on_backend!(redis, Redis, Sync, $($name),*);
            #[cfg(feature = "redis")]
            crate::on_backend!(async_redis, Redis, Async, $($name),*);
            #[cfg(feature = "redis")]
            crate::on_backend!(valkey, Valkey, Sync, $($name),*);
            #[cfg(feature = "redis")]
            crate::on_backend!(async_valkey, Valkey, Async, $($name),*);
        };
    }

    on_shared_servers!(
        a_stale_value_over_this_caches_item_size_stays_in_place,
        a_batch_leaves_a_stale_value_over_its_item_size_in_place,
        a_stale_value_over_this_caches_item_size_is_refreshed_by_a_value_that_fits,
    );

    /// Two caches over one server: `big` with the default item size, `small` with half of it, and a
    /// stale value under `key` that only `big` can store.
    fn over_small_item_size(env: &Env, key: &str) -> (TestCache, TestCache, String) {
        let wait = Duration::from_millis(300);
        let big = env.builder().max_wait(wait).build_front(env.front);
        let small = env
            .builder()
            .item_size(512 * 1024)
            .max_wait(wait)
            .build_front(env.front);
        let stale = "a".repeat(700_000);
        big.set(key, &stale, S(10)).unwrap();
        env.advance(S(11));
        (big, small, stale)
    }

    /// What the cache that wrote `key` finds after another cache's call: its stale value still
    /// under the key (not a placeholder), and a refresh of its own that runs at once.
    #[track_caller]
    fn still_in_place(env: &Env, big: &TestCache, key: &str, stale: &str) {
        let held = env.raw_get(&big.make_key(key)).map(|v| v.len());
        assert!(
            held.is_some_and(|n| n > stale.len()),
            "the stale value is left in place for the cache that can store it: {held:?} bytes"
        );
        let loads = AtomicUsize::new(0);
        let fresh = big.get_or_set_with(key, S(60), || {
            loads.fetch_add(1, Ordering::SeqCst);
            Ok::<_, std::io::Error>("fresh".to_string())
        });
        match fresh {
            Ok(v) => assert_eq!((v.as_str(), loads.load(Ordering::SeqCst)), ("fresh", 1)),
            Err(e) => panic!(
                "the writer's refresh after the other cache's call: {e} (wait timeout: {})",
                e.cache().is_some_and(newcache::Error::is_wait_timeout)
            ),
        }
    }

    /// A stale value larger than this cache's item size is never claimed: a claim would replace
    /// it with a placeholder, and the value could not be written back. A `get` serves it stale
    /// (on memcached, which sends it whole, it reports it too large); a loader returns what it
    /// loads (too large to store here as well) and leaves the value in place, so the cache that
    /// wrote it is neither kept waiting nor left without it.
    fn a_stale_value_over_this_caches_item_size_stays_in_place(env: &Env) {
        let (big, small, stale) = over_small_item_size(env, "big");
        let seen = small.get::<String>("big");
        if env.kind == Kind::Memcached {
            // memcached sends it whole: a reader discards a value over its own limit unread
            assert!(seen.is_err_and(|e| e.is_too_large()));
        } else {
            assert_eq!(seen.unwrap().map(|s| s.len()), Some(stale.len()));
        }
        let loaded = small.get_or_set_with("big", S(60), || {
            Ok::<_, std::io::Error>("b".repeat(700_000))
        });
        assert_eq!(
            loaded.map(|v| v.len()).map_err(|e| e.to_string()),
            Ok(700_000)
        );
        still_in_place(env, &big, "big", &stale);
    }

    /// The same for a batch's key.
    fn a_batch_leaves_a_stale_value_over_its_item_size_in_place(env: &Env) {
        let (big, small, stale) = over_small_item_size(env, "big");
        let loaded = small.get_many_or_set_with(&["big"], S(60), |keys| {
            Ok::<_, std::io::Error>(
                keys.iter()
                    .map(|k| (k.clone(), "b".repeat(700_000)))
                    .collect(),
            )
        });
        let loaded = loaded.map_err(|e| e.to_string()).unwrap();
        assert_eq!(loaded.get("big").map(String::len), Some(700_000));
        still_in_place(env, &big, "big", &stale);
    }

    /// A loaded value that fits this cache replaces the stale one it could not claim, stored with
    /// `cas` against the stale value it read. memcached never sends this cache that value (nor its
    /// CAS): there the stale value stays.
    fn a_stale_value_over_this_caches_item_size_is_refreshed_by_a_value_that_fits(env: &Env) {
        let (big, small, stale) = over_small_item_size(env, "big");
        let loaded =
            small.get_or_set_with("big", S(60), || Ok::<_, std::io::Error>("fits".to_string()));
        assert_eq!(loaded.map_err(|e| e.to_string()).as_deref(), Ok("fits"));
        if env.kind == Kind::Memcached {
            still_in_place(env, &big, "big", &stale);
        } else {
            assert_eq!(big.get::<String>("big").unwrap().as_deref(), Some("fits"));
        }
    }
}

// ---- codec/charge.rs: what `set` charges against what decoding needs ----

fn memory_with_limit(limit: usize) -> Cache {
    Cache::builder()
        .flavor(unique_flavor("charge"))
        .max_decode_size(limit)
        .build()
        .unwrap()
}

/// `set` stored it, so `get` must read it back.
#[track_caller]
fn stored_reads_back<T>(cache: &Cache, v: &T)
where
    T: Serialize + for<'de> Deserialize<'de> + PartialEq + std::fmt::Debug,
{
    match cache.set("v", v, S(60)) {
        Err(e) => assert!(e.is_too_large(), "{e}"),
        Ok(()) => match cache.get::<T>("v") {
            Ok(Some(back)) => assert!(&back == v),
            other => panic!(
                "`set` stored a {} that `get` cannot read: {:?}",
                std::any::type_name::<T>(),
                other.map(|o| o.is_some()).map_err(|e| e.to_string())
            ),
        },
    }
}

/// `None`s in a sequence are charged their `Option`'s size (16 for `Option<u64>`): nine million
/// compress to ~35 KB and need 144 MB decoded, over the default limit.
#[test]
fn nine_million_nones_are_refused_or_readable() {
    let lz4 = Cache::builder()
        .flavor(unique_flavor("nones"))
        .compression(Compression::Lz4 { min_size: 1024 })
        .build()
        .unwrap();
    stored_reads_back(&lz4, &vec![None::<u64>; 9_000_000]);
}

#[test]
fn charge_counts_none_in_a_vec() {
    stored_reads_back(&memory_with_limit(100_000), &vec![None::<u64>; 20_000]);
}

#[test]
fn charge_counts_none_in_a_map() {
    let m: HashMap<String, Option<u64>> = (0..3000).map(|i| (i.to_string(), None)).collect();
    stored_reads_back(&memory_with_limit(100_000), &m);
}

/// A struct in a `Vec` is charged its size with padding: `(u8, u64)` is 16, not 9.
#[derive(Serialize, Deserialize, PartialEq, Debug, Clone)]
struct Row {
    flag: u8,
    id: u64,
}

#[test]
fn charge_counts_padded_structs_in_a_vec() {
    stored_reads_back(
        &memory_with_limit(280_000),
        &vec![Row { flag: 1, id: 2 }; 10_000],
    );
}

/// `Some` of a type with a niche (`String`, `Vec`, `Box`) is charged no tag: a value that decodes
/// under the limit is stored.
#[test]
fn charge_does_not_refuse_a_decodable_vec_of_some_strings() {
    let cache = memory_with_limit(300_000);
    let v = vec![Some(String::new()); 10_000];
    // decoding it needs 240,024 bytes of the 300,000
    cache
        .set("v", &v, S(60))
        .unwrap_or_else(|e| panic!("refused a value that decodes under the limit: {e}"));
}

/// A value whose `Serialize` fails is an encode error, not `TooLarge`.
struct Unserializable;

impl Serialize for Unserializable {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom("this value cannot be serialized"))
    }
}

#[test]
fn a_value_that_cannot_serialize_is_an_encode_error() {
    let cache = memory_with_limit(64 << 20);
    let e = cache.set("v", &Unserializable, S(60)).unwrap_err();
    assert!(e.is_encode(), "is_too_large: {}, {e}", e.is_too_large());
}

/// A value nested deeper than the 256 levels a read decodes is refused at `set`.
#[derive(Serialize, Deserialize, PartialEq, Debug)]
enum Chain {
    End,
    Link(Box<Chain>),
}

#[test]
fn a_value_nested_past_the_decode_depth_is_refused_or_readable() {
    let cache = memory_with_limit(64 << 20);
    let chain = |n| {
        let mut c = Chain::End;
        for _ in 0..n {
            c = Chain::Link(Box::new(c));
        }
        c
    };
    let e = cache.set("v", &chain(300), S(60)).unwrap_err();
    assert!(e.is_encode() && e.to_string().contains("256 levels"), "{e}");
    // as deep as a read goes is stored and read back
    stored_reads_back(&cache, &chain(120));
    // dropping 300 boxes recursively is fine
}

type Hook = Box<dyn FnOnce(&MemoryBackend) + Send>;

/// Runs `hook` once, right after the next read (single or batch) returns: between a reader's
/// read and its claim, which the refused claim and the placeholder `cas` both follow.
struct Racer {
    inner: Arc<MemoryBackend>,
    hook: Mutex<Option<Hook>>,
}

impl std::fmt::Debug for Racer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Racer")
    }
}

impl Racer {
    fn fire(&self) {
        if let Some(h) = self.hook.lock().unwrap().take() {
            h(&self.inner);
        }
    }
}

impl Backend for Racer {
    fn get(&self, key: &str) -> newcache::Result<Option<Item>> {
        let r = self.inner.get(key);
        self.fire();
        r
    }
    fn get_many(&self, keys: &[&str]) -> Vec<newcache::Result<Option<Item>>> {
        let r = self.inner.get_many(keys);
        self.fire();
        r
    }
    fn store(&self, w: Write<'_>) -> newcache::Result<StoreOutcome> {
        self.inner.store(w)
    }
    fn store_then_get(&self, w: Write<'_>) -> newcache::Result<(StoreOutcome, Option<Item>)> {
        self.inner.store_then_get(w)
    }
    fn store_many(&self, w: &[Write<'_>]) -> Vec<newcache::Result<StoreOutcome>> {
        self.inner.store_many(w)
    }
    fn delete(&self, key: &str) -> newcache::Result<bool> {
        self.inner.delete(key)
    }
    fn touch(&self, key: &str, exptime: u32) -> newcache::Result<bool> {
        self.inner.touch(key, exptime)
    }
    fn incr(&self, key: &str, d: u64) -> newcache::Result<Option<u64>> {
        self.inner.incr(key, d)
    }
    fn decr(&self, key: &str, d: u64) -> newcache::Result<Option<u64>> {
        self.inner.decr(key, d)
    }
    fn flush_all(&self) -> newcache::Result<()> {
        self.inner.flush_all()
    }
    fn max_value_size(&self, key: &str) -> usize {
        self.inner.max_value_size(key)
    }
}

#[test]
fn a_write_between_the_refused_claim_and_the_placeholder_wins() {
    for (mode, write) in ["lookup", "load", "batch"]
        .into_iter()
        .flat_map(|m| [(m, "set"), (m, "delete")])
    {
        let clock = newcache::testing::MockClock::new();
        let memory = Arc::new(MemoryBackend::new(64 << 20, clock.clone()));
        let racer = Arc::new(Racer {
            inner: memory.clone(),
            hook: Mutex::new(None),
        });
        let cache = Cache::builder()
            .flavor(unique_flavor("race"))
            .clock(clock.clone())
            .backend(racer.clone())
            .build()
            .unwrap();
        let k = cache.make_key("full");
        cache.set("full", &"x".repeat(100_000), S(10)).unwrap();
        let stored = memory.get(&k).unwrap().unwrap().value.to_vec();
        let full = grown_to(&stored, memory.max_value_size(&k));
        memory
            .store(newcache::Write::new(
                StoreMode::Set,
                &k,
                &full,
                newcache::__private::FLAGS,
                0,
            ))
            .unwrap();
        // theirs: a fresh value written by another client, as newcache writes it
        let other = Cache::builder()
            .flavor("unused")
            .clock(clock.clone())
            .backend(memory.clone())
            .build()
            .unwrap();
        other.set("theirs", "theirs", S(600)).unwrap();
        let theirs = memory
            .get(&other.make_key("theirs"))
            .unwrap()
            .unwrap()
            .value
            .to_vec();
        clock.advance(S(11));
        let key = k.clone();
        *racer.hook.lock().unwrap() = Some(match write {
            "set" => Box::new(move |m: &MemoryBackend| {
                m.store(newcache::Write::new(
                    StoreMode::Set,
                    &key,
                    &theirs,
                    newcache::__private::FLAGS,
                    0,
                ))
                .unwrap();
            }),
            _ => Box::new(move |m: &MemoryBackend| {
                m.delete(&key).unwrap();
            }),
        });
        let loads = AtomicUsize::new(0);
        let load = || {
            loads.fetch_add(1, Ordering::SeqCst);
            Ok::<_, std::io::Error>("loaded".to_string())
        };
        let got: Option<String> = match mode {
            "lookup" => cache.get("full").unwrap(),
            "load" => Some(cache.get_or_set_with("full", S(60), load).unwrap()),
            _ => cache
                .get_many_or_set_with(&["full"], S(60), |keys| {
                    load().map(|v| keys.iter().map(|k| (k.clone(), v.clone())).collect())
                })
                .unwrap()
                .remove("full"),
        };
        let after: Option<String> = cache.get("full").unwrap();
        let ctx = format!("{mode}, {write} in between");
        match write {
            "set" => {
                if mode != "lookup" {
                    assert_eq!(got.as_deref(), Some("theirs"), "{ctx}");
                }
                assert_eq!(loads.load(Ordering::SeqCst), 0, "{ctx}");
                assert_eq!(after.as_deref(), Some("theirs"), "{ctx}: the set stands");
            }
            _ => {
                // the delete stands: nothing stale is served; a loader loads anew
                assert_ne!(got.as_deref().map(str::len), Some(full.len() - 33), "{ctx}");
                if mode == "lookup" {
                    assert_eq!(after, None, "{ctx}");
                } else {
                    assert_eq!(loads.load(Ordering::SeqCst), 1, "{ctx}");
                    assert_eq!(after.as_deref(), Some("loaded"), "{ctx}");
                }
            }
        }
    }
}

/// Eight caches (eight coalescers: as eight processes) on one memcached, a stale item at the
/// limit: the placeholder takeover elects one loader (within one cache, its coalescer alone
/// would make one load).
#[test]
fn eight_processes_take_an_item_at_the_limit_over_with_one_loader() {
    let env = Env::new(Kind::Memcached, "eight");
    let caches: Vec<Cache> = (0..8).map(|_| env.sync_cache()).collect();
    let k = caches[0].make_key("full");
    caches[0].set("full", &"x".repeat(100_000), S(10)).unwrap();
    let limit = env.backend().max_value_size(&k);
    let full = grown_to(&env.raw_get(&k).unwrap(), limit);
    for round in 0..5 {
        env.raw_set(&k, &full, newcache::__private::FLAGS);
        if round == 0 {
            env.advance(S(11));
        }
        let loads = AtomicUsize::new(0);
        let gate = Barrier::new(8);
        std::thread::scope(|s| {
            for c in &caches {
                let (loads, gate) = (&loads, &gate);
                s.spawn(move || {
                    gate.wait();
                    let v: String = c
                        .get_or_set_with("full", S(60), || {
                            loads.fetch_add(1, Ordering::SeqCst);
                            std::thread::sleep(Duration::from_millis(50));
                            Ok::<_, std::io::Error>("fresh".to_string())
                        })
                        .unwrap();
                    assert_eq!(v, "fresh");
                });
            }
        });
        assert_eq!(loads.load(Ordering::SeqCst), 1, "round {round}");
    }
    let _ = Ttl::Never;
}

/// A give-back the server refuses removes the claim: a Redis at its `maxmemory` (no eviction)
/// refuses writes, but not deletes. Nobody waits for the claim's deadline once the value under
/// it is past its staleness bound.
#[cfg(feature = "redis")]
mod full_server {
    use super::*;
    use crate::fixture::{RedisServer, valkey_server};
    use crate::front::Front;

    fn a_give_back_a_full_server_refuses_removes_the_claim(bin: &str, front: Front) {
        let server = RedisServer::start_with(bin, &["--maxmemory-policy", "noeviction"]);
        let clock = newcache::testing::MockClock::new();
        let flavor = unique_flavor("full-server");
        let cache = || {
            Cache::builder()
                .redis(server.url())
                .flavor(flavor.clone())
                .clock(clock.clone())
                .herd_timeout(S(1))
                .max_wait(S(2))
                .build_front(front)
        };
        let (a, b) = (cache(), cache());
        a.set("k", "stale", S(10)).unwrap();
        clock.advance(Duration::from_millis(10_500));
        let failed = a.get_or_set_with("k", S(60), || {
            // the server fills up while the load runs: giving the stale value back is a write
            let mut c = ::redis::Client::open(server.url())
                .and_then(|c| c.get_connection())
                .expect("redis client connects");
            let () = ::redis::cmd("CONFIG")
                .arg("SET")
                .arg("maxmemory")
                .arg(1)
                .query(&mut c)
                .expect("maxmemory set");
            Err::<String, _>(std::io::Error::other("the database is down"))
        });
        assert!(
            failed.is_err_and(|e| e.cache().is_none()),
            "the loader's error"
        );
        // past the stale value's bound, within the claim's lease: nobody is served it
        clock.advance(S(1));
        // the async front end gives a claim back from a task of its own: wait for it, or for
        // the 5 s bound when it leaves the claim in place
        let mut c = ::redis::Client::open(server.url())
            .and_then(|c| c.get_connection())
            .expect("redis client connects");
        let k = a.make_key("k");
        let until = std::time::Instant::now() + S(5);
        while ::redis::cmd("EXISTS").arg(&k).query::<u64>(&mut c).unwrap() == 1
            && std::time::Instant::now() < until
        {
            std::thread::sleep(Duration::from_millis(10));
        }
        let loaded =
            b.get_or_set_with("k", S(60), || Ok::<_, std::io::Error>("loaded".to_string()));
        match loaded {
            Ok(v) => assert_eq!(v, "loaded"),
            Err(e) => panic!(
                "another caller after a refused give-back: {e} (wait timeout: {})",
                e.cache().is_some_and(newcache::Error::is_wait_timeout)
            ),
        }
    }

    #[test]
    fn redis() {
        a_give_back_a_full_server_refuses_removes_the_claim("redis-server", Front::Sync);
    }

    #[test]
    fn async_redis() {
        a_give_back_a_full_server_refuses_removes_the_claim("redis-server", Front::Async);
    }

    #[test]
    fn valkey() {
        a_give_back_a_full_server_refuses_removes_the_claim(&valkey_server(), Front::Sync);
    }

    #[test]
    fn async_valkey() {
        a_give_back_a_full_server_refuses_removes_the_claim(&valkey_server(), Front::Async);
    }
}
