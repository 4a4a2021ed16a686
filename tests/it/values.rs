//! Values and bytes: what `set` accepts `get` reads, rolling deploys across struct and
//! codec changes, no invalid byte on the wire, far TTLs, Django's `touch` and `set_many`. Every
//! test runs on memory, a real memcached and twemproxy.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use newcache::{Codec, Compression, Ttl};
use serde::{Deserialize, Serialize};

use crate::fixture::Env;
use crate::front::BuildFor;

const S: fn(u64) -> Duration = Duration::from_secs;

crate::on_every_backend!(
    values_larger_in_memory_than_the_item_size_round_trip,
    a_struct_gaining_a_field_reads_both_ways,
    bincode_and_message_pack_builds_read_each_other,
    compressed_values_are_read_by_every_build,
    a_loaded_value_too_large_to_cache_is_returned,
    waiters_behind_an_unstorable_load_each_load_at_once,
    a_stale_value_whose_refresh_is_too_large_is_still_served,
    an_over_long_derived_key_never_reaches_the_server,
    far_ttls_are_kept,
    touch_gives_a_value_a_new_lifetime,
    set_many_returns_the_keys_it_could_not_store,
    a_value_at_the_size_limit_goes_through_every_step_of_the_protocol,
    an_item_written_at_the_size_limit_is_taken_over_by_one_loader,
    one_undecodable_key_leaves_the_rest_of_a_batch,
    a_value_its_type_could_not_decode_is_never_stored
);

fn values_larger_in_memory_than_the_item_size_round_trip(env: &Env) {
    // 0.1.0 stored these (about 0.7 MB on the wire) and then failed every read: its decode limit
    // counted the 1.1 MB in-memory size against the 1 MiB item size.
    let numbers: Vec<u64> = (0..140_000u64).map(|i| i * 7919).collect();
    let strings: Vec<String> = (0..70_000).map(|i| format!("s{i}")).collect();
    for codec in [Codec::MessagePack, Codec::Bincode] {
        let cache = env.builder().codec(codec).build_front(env.front);
        cache.set("numbers", &numbers, S(60)).unwrap();
        assert_eq!(
            cache.get::<Vec<u64>>("numbers").unwrap().as_ref(),
            Some(&numbers)
        );
        cache.set("strings", &strings, S(60)).unwrap();
        assert_eq!(
            cache.get::<Vec<String>>("strings").unwrap().as_ref(),
            Some(&strings)
        );
    }
    // The bound still holds, and is configurable.
    let tight = env
        .builder()
        .max_decode_size(100_000)
        .build_front(env.front);
    let e = tight.get::<Vec<u64>>("numbers").unwrap_err();
    assert!(
        e.is_decode() && e.to_string().contains("decode limit"),
        "{e}"
    );
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct UserV1 {
    id: u64,
    name: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct UserV2 {
    id: u64,
    name: String,
    #[serde(default)]
    email: Option<String>,
}

fn a_struct_gaining_a_field_reads_both_ways(env: &Env) {
    // A rolling deploy: the old build and the new one share the cache (same flavor, version).
    let old = env.cache();
    let new = env.cache();
    old.set(
        "u1",
        &UserV1 {
            id: 1,
            name: "ann".into(),
        },
        S(60),
    )
    .unwrap();
    let read = new.get::<UserV2>("u1").unwrap().unwrap();
    assert_eq!((read.id, read.email), (1, None));
    let v2 = UserV2 {
        id: 2,
        name: "bob".into(),
        email: Some("bob@example.com".into()),
    };
    new.set("u2", &v2, S(60)).unwrap();
    assert_eq!(old.get::<UserV1>("u2").unwrap().unwrap().name, "bob");
    // through the loader too: a hit, no recompute, no error
    let calls = AtomicUsize::new(0);
    let got: UserV2 = new
        .get_or_set_with("u1", S(60), || {
            calls.fetch_add(1, Ordering::SeqCst);
            Ok::<_, std::io::Error>(v2.clone())
        })
        .unwrap();
    assert_eq!((got.id, calls.load(Ordering::SeqCst)), (1, 0));
    assert_eq!(new.stats().decode_errors, 0);
}

fn bincode_and_message_pack_builds_read_each_other(env: &Env) {
    let compact = env.builder().codec(Codec::Bincode).build_front(env.front);
    let default = env.cache();
    compact
        .set(
            "a",
            &UserV1 {
                id: 1,
                name: "a".into(),
            },
            S(60),
        )
        .unwrap();
    default
        .set(
            "b",
            &UserV1 {
                id: 2,
                name: "b".into(),
            },
            S(60),
        )
        .unwrap();
    assert_eq!(default.get::<UserV1>("a").unwrap().unwrap().id, 1);
    assert_eq!(compact.get::<UserV1>("b").unwrap().unwrap().id, 2);
}

fn compressed_values_are_read_by_every_build(env: &Env) {
    let page = "<tr><td class=\"name\">row</td><td>42</td></tr>\n".repeat(450);
    let writer = env
        .builder()
        .compression(Compression::Lz4 { min_size: 1024 })
        .build_front(env.front);
    writer.set("page", &page, S(60)).unwrap();
    let reader = env.builder().codec(Codec::Bincode).build_front(env.front);
    assert_eq!(reader.get::<String>("page").unwrap(), Some(page.clone()));
    // compressed on the wire: the raw item is much smaller than the page
    let raw = env
        .backend()
        .get(&writer.make_key("page"))
        .unwrap()
        .unwrap();
    assert!(
        raw.value.len() * 5 < page.len(),
        "{} bytes",
        raw.value.len()
    );
}

fn a_loaded_value_too_large_to_cache_is_returned(env: &Env) {
    let cache = env.cache();
    let big = vec![7u8; 2 << 20];
    const USER_KEY: &str = "report:alice@example.com";
    // tracing caches each callsite's interest when it is first hit: a first hit racing with
    // the registration of this test's subscriber (tests run in parallel) could leave the
    // warning unseen by it. Hit it once first, on a cache of its own.
    let primer = newcache::Cache::builder()
        .in_memory()
        .item_size(1024)
        .build()
        .unwrap();
    let _: Vec<u8> = primer
        .get_or_set_with("primer", S(60), || Ok::<_, std::io::Error>(vec![0u8; 4096]))
        .unwrap();
    let calls = AtomicUsize::new(0);
    let warnings = crate::obs::logs_at(tracing::Level::WARN, || {
        for _ in 0..3 {
            let v: Vec<u8> = cache
                .get_or_set_with(USER_KEY, S(60), || {
                    calls.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, std::io::Error>(big.clone())
                })
                .unwrap();
            assert_eq!(v.len(), big.len());
        }
    });
    // returned on every call, loaded on every call (it cannot be shared through the backend)
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    // one warning, naming the derived key and how to find it, never the user key
    assert_eq!(
        warnings.matches("too large to cache").count(),
        1,
        "{warnings}"
    );
    assert!(warnings.contains(&cache.make_key(USER_KEY)), "{warnings}");
    assert!(warnings.contains("make_key"), "{warnings}");
    assert!(!warnings.contains("alice"), "{warnings}");
    // the first was refused as too large; the next two loaded at once behind its marker
    let stats = cache.stats();
    assert_eq!(
        (stats.too_large, stats.not_storable_loads),
        (1, 2),
        "{stats:?}"
    );
    assert_eq!(stats.lease_waits, 0, "{stats:?}");
    // (that the user key is logged at DEBUG is a unit test: cache::tests)
    // a get sees a miss; an add (or a set) replaces the marker
    assert_eq!(cache.get::<Vec<u8>>(USER_KEY).unwrap(), None);
    assert!(cache.add(USER_KEY, &vec![2u8], S(60)).unwrap());
    assert_eq!(cache.get::<Vec<u8>>(USER_KEY).unwrap(), Some(vec![2u8]));
    cache.set(USER_KEY, &vec![1u8], S(60)).unwrap();
    let v: Vec<u8> = cache
        .get_or_set_with(USER_KEY, S(60), || Ok::<_, std::io::Error>(big.clone()))
        .unwrap();
    assert_eq!(v, vec![1u8], "the set's value is served");
    // the batch form too: the marked key is loaded unstored, the others stored
    cache.delete(USER_KEY).unwrap();
    for _ in 0..2 {
        let got = cache
            .get_many_or_set_with(&["big", "small"], S(60), |keys| {
                Ok::<_, std::io::Error>(
                    keys.iter()
                        .map(|k| (k.clone(), if k == "big" { big.clone() } else { vec![1] }))
                        .collect(),
                )
            })
            .unwrap();
        assert_eq!(got["big"].len(), big.len());
    }
    assert_eq!(
        cache.get::<Vec<u8>>("small").unwrap(),
        Some(vec![1]),
        "{:?}",
        cache.stats()
    );
    assert_eq!(cache.get::<Vec<u8>>("big").unwrap(), None);
    let stats = cache.stats();
    assert_eq!(
        (stats.too_large, stats.not_storable_loads),
        (2, 3),
        "{stats:?}"
    );
}

fn a_stale_value_whose_refresh_is_too_large_is_still_served(env: &Env) {
    let cache = env.cache();
    cache.set("k", &vec![1u8], S(10)).unwrap();
    env.advance(S(11));
    let big = vec![7u8; 2 << 20];
    let v: Vec<u8> = cache
        .get_or_set_with("k", S(10), || Ok::<_, std::io::Error>(big.clone()))
        .unwrap();
    assert_eq!(v.len(), big.len(), "the refresher gets its value");
    // the stale value stays (given back unclaimed; the async front end gives it back from a
    // task): a reader may claim it, the others are served it
    let mut served = None;
    for _ in 0..200 {
        served = cache.get::<Vec<u8>>("k").unwrap();
        if served.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(served, Some(vec![1u8]));
    // a batch that refreshes it (or is served it) leaves it too
    let got = cache
        .get_many_or_set_with(&["k"], S(10), |keys| {
            Ok::<_, std::io::Error>(keys.iter().map(|k| (k.clone(), big.clone())).collect())
        })
        .unwrap();
    assert!(got["k"] == vec![1u8] || got["k"].len() == big.len());
    let stats = cache.stats();
    assert_eq!(stats.not_storable_loads, 0, "no marker: {stats:?}");
    assert!(stats.too_large >= 1, "{stats:?}");
}

/// Callers of two other processes wait behind one caller's placeholder; its value turns out
/// too large to store. Each of them then loads at once (their loaders meet), instead of one
/// loading behind the other's placeholder while the other waits.
fn waiters_behind_an_unstorable_load_each_load_at_once(env: &Env) {
    let build = || env.builder().max_wait(S(30)).build_front(env.front);
    let (holder, a, b) = (build(), build(), build());
    let big = vec![7u8; 2 << 20];
    let (started_tx, started_rx) = std::sync::mpsc::channel::<()>();
    let (finish_tx, finish_rx) = std::sync::mpsc::channel::<()>();
    let met = std::sync::Mutex::new(0usize);
    let arrived = std::sync::Condvar::new();
    // A waiter's loader: arrives, then waits (up to 5 s) for the other waiter's to arrive.
    let meet = || {
        let mut n = met.lock().unwrap();
        *n += 1;
        arrived.notify_all();
        let (n, timeout) = arrived
            .wait_timeout_while(n, Duration::from_secs(5), |n| *n < 2)
            .unwrap();
        assert!(
            !timeout.timed_out(),
            "the other waiter did not load meanwhile ({})",
            *n
        );
        Ok::<_, std::io::Error>(vec![1u8; 2 << 20])
    };
    std::thread::scope(|s| {
        let (holder, big) = (&holder, &big);
        let h = s.spawn(move || {
            holder
                .get_or_set_with("k", S(60), move || {
                    started_tx.send(()).unwrap();
                    finish_rx.recv().unwrap();
                    Ok::<_, std::io::Error>(big.clone())
                })
                .unwrap()
        });
        started_rx.recv().unwrap();
        let wa = s.spawn(|| a.get_or_set_with("k", S(60), meet).unwrap());
        let wb = s.spawn(|| b.get_or_set_with("k", S(60), meet).unwrap());
        // both wait behind the holder's placeholder before its load ends
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while a.stats().lease_waits + b.stats().lease_waits < 2 {
            assert!(
                std::time::Instant::now() < deadline,
                "the waiters never waited"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        finish_tx.send(()).unwrap();
        assert_eq!(h.join().unwrap().len(), big.len());
        assert_eq!(wa.join().unwrap().len(), 2 << 20);
        assert_eq!(wb.join().unwrap().len(), 2 << 20);
    });
    assert_eq!(*met.lock().unwrap(), 2);
    let (sa, sb) = (a.stats(), b.stats());
    assert_eq!(
        sa.not_storable_loads + sb.not_storable_loads,
        2,
        "{sa:?} {sb:?}"
    );
}

fn an_over_long_derived_key_never_reaches_the_server(env: &Env) {
    // 0.1.0: a 200-character flavor at version u64::MAX derived a 262-byte key; memcached
    // answered CLIENT_ERROR without reading the data block, whose bytes then ran as commands.
    let flavor = format!("{}-{}", "f".repeat(191), &env.cache().make_key("")[..8]);
    let cache = env.builder().flavor(flavor).build_front(env.front);
    let witness = env.cache();
    witness.set("witness", &1u8, S(60)).unwrap();
    let hostile = cache.with_version(u64::MAX);
    assert_eq!(hostile.make_key("k").len(), 262);
    let e = hostile.set("k", "x\r\nflush_all\r\n", S(60)).unwrap_err();
    assert!(e.is_invalid_key(), "{e}");
    assert!(hostile.get::<String>("k").unwrap_err().is_invalid_key());
    let e = hostile
        .set_many([("k", "x\r\nflush_all\r\n")], S(60))
        .unwrap_err();
    assert!(e.is_invalid_key(), "{e}");
    assert!(hostile.touch("k", S(1)).unwrap_err().is_invalid_key());
    // nothing was flushed
    assert_eq!(witness.get::<u8>("witness").unwrap(), Some(1));
}

fn far_ttls_are_kept(env: &Env) {
    // 0.1.0: 12 years became an exptime past 2038, which memcached reads as negative (gone at
    // once); Duration::MAX overflowed on the way. Both are clamped to 2038-01-19.
    let cache = env.cache();
    let twelve_years = S(12 * 365 * 86_400);
    cache.set("far", &1u8, twelve_years).unwrap();
    cache.set("max", &2u8, Duration::MAX).unwrap();
    cache.set("never", &3u8, Ttl::Never).unwrap();
    env.advance(S(5));
    assert_eq!(cache.get::<u8>("far").unwrap(), Some(1));
    assert_eq!(cache.get::<u8>("max").unwrap(), Some(2));
    assert_eq!(cache.get::<u8>("never").unwrap(), Some(3));
    assert_eq!(cache.stats().stale_served, 0);
}

fn touch_gives_a_value_a_new_lifetime(env: &Env) {
    let cache = env.cache();
    cache.set("k", &1u8, S(10)).unwrap();
    env.advance(S(8));
    assert!(cache.touch("k", S(600)).unwrap());
    // fresh long past the original ttl (and its herd timeout): a hit, not a stale claim
    env.advance(S(100));
    assert_eq!(cache.get::<u8>("k").unwrap(), Some(1));
    let s = cache.stats();
    assert_eq!((s.hits, s.stale_served, s.claims_won), (1, 0, 0));
    assert!(!cache.touch("missing", S(60)).unwrap());
    // zero deletes, as in Django
    assert!(cache.touch("k", Duration::ZERO).unwrap());
    assert_eq!(cache.get::<u8>("k").unwrap(), None);
    // a value past its staleness bound is not revived (the item still exists: stale-on-error
    // pads its hard expiry to an hour)
    let padded = env
        .builder()
        .serve_stale_on_error(S(3600))
        .build_front(env.front);
    padded.set("old", &2u8, S(10)).unwrap();
    env.advance(S(30 * 60));
    assert!(!padded.touch("old", S(600)).unwrap());
    assert_eq!(padded.get::<u8>("old").unwrap(), None);
    // a counter (not an envelope) is touched too
    cache.set_counter("n", 5, S(60)).unwrap();
    assert!(cache.touch("n", S(600)).unwrap());
    assert_eq!(cache.get_counter("n").unwrap(), Some(5));
}

fn set_many_returns_the_keys_it_could_not_store(env: &Env) {
    let cache = env.cache();
    let big = vec![7u8; 2 << 20];
    let small = vec![1u8];
    let failed = cache
        .set_many([("a", &small), ("big", &big), ("b", &small)], S(60))
        .unwrap();
    assert_eq!(failed, vec!["big".to_string()]);
    let got = cache.get_many::<Vec<u8>>(&["a", "b", "big"]).unwrap();
    assert_eq!((got.len(), got.get("a")), (2, Some(&small)));
}

/// The longest string `set` stores under `key` (a binary search over what it accepts).
fn longest_storable(cache: &crate::front::TestCache, key: &str, ttl: Ttl) -> usize {
    let (mut ok, mut refused) = (0usize, 2usize << 20);
    while refused - ok > 1 {
        let mid = (ok + refused) / 2;
        match cache.set(key, &"x".repeat(mid), ttl) {
            Ok(()) => ok = mid,
            Err(e) if e.is_too_large() => refused = mid,
            Err(e) => panic!("{e}"),
        }
    }
    ok
}

fn a_value_at_the_size_limit_goes_through_every_step_of_the_protocol(env: &Env) {
    // Once stale, the largest value `set` took was claimed with a longer header and refused as
    // too large: `get`, `get_or_set_with` and a `get_many` including it failed for the whole
    // herd window.
    let cache = env.cache();
    let n = longest_storable(&cache, "big", Ttl::After(S(10)));
    let big = "x".repeat(n);
    cache.set("big", &big, S(10)).unwrap();
    cache.set("small", &1u8, S(600)).unwrap();
    env.advance(S(11));
    // the first reader claims it (a miss, to recompute) and the batch's other key is there
    let got = cache.get_many::<String>(&["big", "small"]).unwrap();
    assert!(!got.contains_key("big"), "claimed by this reader");
    // everyone else is served the stale value while it is recomputed
    assert_eq!(cache.get::<String>("big").unwrap().as_deref(), Some(&*big));
    let served: String = cache
        .get_or_set_with("big", S(10), || -> Result<String, std::io::Error> {
            panic!("another caller holds the claim: no load")
        })
        .unwrap();
    assert_eq!(served, big);
    // touch re-times it (its header gains fields)
    assert!(cache.touch("big", S(60)).unwrap());
    assert_eq!(cache.get::<String>("big").unwrap().as_deref(), Some(&*big));
    // a value that never expires gains a soft and a hard expiry when touched
    let m = longest_storable(&cache, "forever", Ttl::Never);
    cache.set("forever", &"y".repeat(m), Ttl::Never).unwrap();
    let refused = cache.stats().too_large;
    assert!(cache.touch("forever", S(10)).unwrap());
    env.advance(S(11));
    // stale now: a loader claims it, serves it to others meanwhile, and stores its result
    let loads = AtomicUsize::new(0);
    let v: String = cache
        .get_or_set_with("forever", S(60), || {
            loads.fetch_add(1, Ordering::SeqCst);
            Ok::<_, std::io::Error>("z".repeat(m))
        })
        .unwrap();
    assert_eq!((v.len(), loads.load(Ordering::SeqCst)), (m, 1));
    assert_eq!(
        cache.get::<String>("forever").unwrap().map(|s| s.len()),
        Some(m)
    );
    assert_eq!(cache.stats().too_large, refused, "{:?}", cache.stats());
}

/// The envelope `set` wrote for a long string, re-written with the string grown so that the
/// item is exactly `len` bytes: what a build with a larger item size (or without room for a
/// claim) leaves in the cache. The payload is MessagePack's str32: 0xdb, a big-endian length.
pub(crate) fn grown_to(stored: &[u8], len: usize) -> Vec<u8> {
    let header = usize::from(stored[6]);
    assert_eq!(stored[header], 0xdb, "a str32 payload");
    let n = len - header - 5;
    let mut out = stored[..header].to_vec();
    out.push(0xdb);
    out.extend_from_slice(&(n as u32).to_be_bytes());
    out.resize(len, b'x');
    out
}

fn an_item_written_at_the_size_limit_is_taken_over_by_one_loader(env: &Env) {
    // An item at the very limit (written by another build, or a process with a larger item
    // size): no room for a claim. A claim falls back to a placeholder over it (cas): one
    // loader, and no reader sees `TooLarge` for a value it did not write.
    let cache = env.cache();
    let k = cache.make_key("full");
    cache.set("full", &"x".repeat(100_000), S(10)).unwrap();
    let limit = env.backend().max_value_size(&k);
    let full = grown_to(&env.raw_get(&k).unwrap(), limit);
    env.raw_set(&k, &full, newcache::__private::FLAGS);
    assert_eq!(
        cache.get::<String>("full").unwrap().map(|s| s.len()),
        Some(limit - full[6] as usize - 5)
    );
    cache.set("other", &2u8, S(600)).unwrap();
    env.advance(S(11));
    // a reader cannot claim it (no room for the claim's header): it is served stale, in a
    // batch too, and left to a loader
    let stale = limit - full[6] as usize - 5;
    let got = cache.get_many::<String>(&["full"]).unwrap();
    assert_eq!(got.get("full").map(String::len), Some(stale));
    let got = cache.get_many::<u8>(&["other", "full"]).unwrap();
    assert_eq!(got.get("other"), Some(&2));
    assert_eq!(
        cache.get::<String>("full").unwrap().map(|s| s.len()),
        Some(stale)
    );
    // loaders: one load among them
    env.raw_set(&k, &full, newcache::__private::FLAGS);
    let loads = AtomicUsize::new(0);
    let gate = std::sync::Barrier::new(8);
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| {
                gate.wait();
                let v: String = cache
                    .get_or_set_with("full", S(60), || {
                        loads.fetch_add(1, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(50));
                        Ok::<_, std::io::Error>("fresh".to_string())
                    })
                    .unwrap();
                // the loader's value, or the displaced one its holder keeps for the others
                assert!(v == "fresh" || v.len() == stale, "{} bytes", v.len());
            });
        }
    });
    assert_eq!(loads.load(Ordering::SeqCst), 1);
    assert_eq!(
        cache.get::<String>("full").unwrap().as_deref(),
        Some("fresh")
    );
    // the batch loader too
    env.raw_set(&k, &full, newcache::__private::FLAGS);
    cache.set("name", "ann", S(600)).unwrap();
    let got = cache
        .get_many_or_set_with(&["full", "name"], S(60), |keys| {
            assert_eq!(keys, ["full".to_string()]);
            Ok::<_, std::io::Error>(
                keys.iter()
                    .map(|k| (k.clone(), "again".to_string()))
                    .collect(),
            )
        })
        .unwrap();
    assert_eq!(got["full"], "again");
    assert_eq!(
        cache.get::<String>("full").unwrap().as_deref(),
        Some("again")
    );
    assert_eq!(cache.stats().too_large, 0, "{:?}", cache.stats());
}

fn a_value_its_type_could_not_decode_is_never_stored(env: &Env) {
    // Compressed, nine million zeros take 35 KB; decoded, 72 MB, over the 64 MiB decode limit:
    // `set` stored them and every `get` failed.
    let lz4 = env
        .builder()
        .compression(Compression::Lz4 { min_size: 1024 })
        .build_front(env.front);
    let zeros = vec![0u64; 9_000_000];
    let e = lz4.set("zeros", &zeros, S(60)).unwrap_err();
    assert!(
        e.is_too_large() && e.to_string().contains("decode limit"),
        "{e}"
    );
    assert_eq!(
        lz4.get::<Vec<u64>>("zeros").unwrap(),
        None,
        "nothing stored"
    );
    // a loader's value is returned, not stored
    let loads = AtomicUsize::new(0);
    let got: Vec<u64> = lz4
        .get_or_set_with("zeros", S(60), || {
            loads.fetch_add(1, Ordering::SeqCst);
            Ok::<_, std::io::Error>(zeros.clone())
        })
        .unwrap();
    assert_eq!((got.len(), loads.load(Ordering::SeqCst)), (zeros.len(), 1));
    assert_eq!(lz4.get::<Vec<u64>>("zeros").unwrap(), None);
    assert_eq!(lz4.stats().too_large, 1);
    // a lowered limit, without compression: 20,000 zeros are 20 KB encoded, 160 KB decoded
    let tight = env
        .builder()
        .max_decode_size(100_000)
        .build_front(env.front);
    let e = tight.set("small", &vec![0u64; 20_000], S(60)).unwrap_err();
    assert!(e.is_too_large() && e.to_string().contains("100000"), "{e}");
    assert!(
        tight
            .set_many([("small", &vec![0u64; 20_000])], S(60))
            .is_err()
    );
    // what fits the limit is stored and read back
    tight.set("small", &vec![0u64; 10_000], S(60)).unwrap();
    assert_eq!(
        tight.get::<Vec<u64>>("small").unwrap().map(|v| v.len()),
        Some(10_000)
    );
}

fn one_undecodable_key_leaves_the_rest_of_a_batch(env: &Env) {
    let cache = env.cache();
    cache.set("good", &1u8, S(60)).unwrap();
    env.raw_set(&cache.make_key("bad"), b"not an envelope", 0);
    // the bad key alone is left out (counted); the good one is served
    let got = cache.get_many::<u8>(&["good", "bad"]).unwrap();
    assert_eq!((got.len(), got.get("good")), (1, Some(&1)));
    assert_eq!(cache.stats().decode_errors, 1);
    // the batch loader loads it without storing over the foreign bytes
    let got = cache
        .get_many_or_set_with(&["good", "bad", "new"], S(60), |keys| {
            Ok::<_, std::io::Error>(keys.iter().map(|k| (k.clone(), 9u8)).collect())
        })
        .unwrap();
    assert_eq!((got["good"], got["bad"], got["new"]), (1, 9, 9));
    assert_eq!(cache.get::<u8>("new").unwrap(), Some(9));
    assert!(
        cache.get::<u8>("bad").unwrap_err().is_decode(),
        "not overwritten"
    );
}

/// Keys from a custom key function that passes user input through share long suffixes: finding
/// a batch's duplicates stays linear (a hash over the key's last bytes made 20,000 such keys
/// take 0.45 s, quadratically more for more). Ten times the keys must cost about ten times the
/// time, not a hundred: a ratio within one test, which machine load does not skew much.
#[test]
fn custom_keys_sharing_a_suffix_batch_in_linear_time() {
    let cache = newcache::Cache::builder()
        .key_function(|_, _, k| k.to_string())
        .build()
        .unwrap();
    let keys: Vec<String> = (0..100_000)
        .map(|i| format!("user:{i:08}:profile:details"))
        .collect();
    cache.set(&keys[7], &7u32, S(60)).unwrap();
    let timed = |n: usize| {
        let t = std::time::Instant::now();
        let got = cache.get_many::<u32>(&keys[..n]).unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[&keys[7]], 7);
        t.elapsed()
    };
    let small = (0..3).map(|_| timed(10_000)).min().unwrap();
    let large = timed(100_000);
    // linear: about 10x; quadratic: about 100x
    assert!(
        large < small * 40,
        "10,000 keys {small:?}, 100,000 keys {large:?}"
    );
}

/// A value past its staleness bound is still kept, claimed, for its claimant's
/// `serve_stale_on_error` (up to `max_age`): a refresh whose result is too large gives the claim
/// back (no "not storable" marker over it), so a later failing load still falls back on it.
#[test]
fn a_too_large_refresh_keeps_the_value_kept_for_serve_stale_on_error() {
    use crate::fixture::{Env, Kind};
    use std::time::Duration;
    let env = Env::new(Kind::Memory, "stale-kept");
    let cache = env
        .builder()
        .herd_timeout(Duration::from_secs(1))
        .serve_stale_on_error(Duration::from_secs(120))
        .build()
        .unwrap();
    cache.set("j", "v", Duration::from_secs(1)).unwrap();
    env.advance(Duration::from_millis(2500)); // past soft expiry + herd timeout: over-age
    let big = "x".repeat(2 << 20);
    let got: String = cache
        .get_or_set_with("j", Duration::from_secs(1), || {
            Ok::<_, std::io::Error>(big.clone())
        })
        .unwrap();
    assert_eq!(got.len(), big.len());
    env.advance(Duration::from_millis(1500));
    let failing = || Err::<String, _>(std::io::Error::other("db is down"));
    let after = cache
        .get_or_set_with("j", Duration::from_secs(1), failing)
        .map_err(|e| e.to_string());
    assert_eq!(
        after,
        Ok("v".to_string()),
        "the 4 s old value (max_age 120 s) is gone"
    );
}
