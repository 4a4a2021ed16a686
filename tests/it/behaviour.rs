//! The behaviour suite: every test runs on the memory backend and on a real memcached.

use std::collections::HashMap;
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::Duration;

use newcache::{Cache, DecodePolicy, Herd, Ttl};
use serde::{Deserialize, Serialize};

use crate::fixture::{Env, Kind};
use crate::front::BuildFor;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct User {
    id: u64,
    name: String,
    tags: Vec<String>,
}

fn user(id: u64) -> User {
    User {
        id,
        name: format!("user {id}"),
        tags: vec!["a".into(), "b".into()],
    }
}

const S: fn(u64) -> Duration = Duration::from_secs;

crate::on_every_backend!(
    round_trip_and_miss,
    keys_are_django_newcache_keys,
    version_bump_invalidates,
    stale_value_is_claimed_by_one_reader_and_served_to_the_rest,
    exactly_one_claim_among_16_threads,
    a_dead_claimants_value_is_served_only_up_to_its_bound,
    soft_expiry_has_millisecond_precision,
    set_many_values_get_herd_protection,
    get_many_claims_stale_keys_and_leaves_them_out,
    ttl_near_and_beyond_thirty_days,
    ttl_never_and_zero,
    herd_off_is_never_claimed,
    add_is_truthful,
    add_is_atomic_among_16_threads,
    add_replaces_a_stale_value,
    delete_and_delete_many,
    counters,
    counters_and_envelopes_do_not_mix,
    incr_or_create_creates_then_increments,
    incr_or_create_sets_the_ttl_at_creation_only,
    incr_or_create_from_16_threads_sums_exactly,
    a_counter_read_as_a_value_points_to_get_counter,
    foreign_and_corrupt_bytes,
    oversized_values_are_refused_and_the_cache_stays_usable,
    hostile_keys_round_trip,
    custom_key_function_is_validated,
    stats_count_what_happened,
);

fn round_trip_and_miss(env: &Env) {
    let cache = env.cache();
    assert_eq!(cache.get::<User>("nobody").unwrap(), None);
    cache.set("u", &user(1), Ttl::Default).unwrap();
    assert_eq!(cache.get::<User>("u").unwrap(), Some(user(1)));
    cache.set("s", "text", S(60)).unwrap();
    assert_eq!(cache.get::<String>("s").unwrap().as_deref(), Some("text"));
    // the wrong type is a decode error, not garbage
    assert!(cache.get::<Vec<u64>>("u").unwrap_err().is_decode());
}

fn keys_are_django_newcache_keys(env: &Env) {
    let cache = env.builder().flavor("prod").build_front(env.front);
    assert_eq!(
        cache.make_key("foo"),
        "prod-1-0beec7b5ea3f0fdbc95d0dd47f3c5bc275da8a33"
    );
    let cache = env.builder().flavor("").build_front(env.front);
    assert_eq!(
        cache.make_key("foo"),
        "-1-0beec7b5ea3f0fdbc95d0dd47f3c5bc275da8a33"
    );
    assert_eq!(
        cache.with_version(7).make_key("foo"),
        "-7-0beec7b5ea3f0fdbc95d0dd47f3c5bc275da8a33"
    );
}

fn version_bump_invalidates(env: &Env) {
    let v1 = env.cache();
    v1.set("k", &1u32, S(60)).unwrap();
    let v2 = v1.with_version(2);
    assert_eq!(v2.get::<u32>("k").unwrap(), None);
    v2.set("k", &2u32, S(60)).unwrap();
    assert_eq!(v1.get::<u32>("k").unwrap(), Some(1));
    assert_eq!(v2.get::<u32>("k").unwrap(), Some(2));
    let bumped = env.builder().version(2).build_front(env.front);
    assert_eq!(bumped.get::<u32>("k").unwrap(), Some(2));
}

fn stale_value_is_claimed_by_one_reader_and_served_to_the_rest(env: &Env) {
    let cache = env.cache();
    cache.set("hot", &user(1), S(10)).unwrap();
    env.advance(Duration::from_millis(9_999));
    assert_eq!(cache.get::<User>("hot").unwrap(), Some(user(1)), "fresh");
    env.advance(Duration::from_millis(1));
    assert_eq!(
        cache.get::<User>("hot").unwrap(),
        None,
        "the first stale reader recomputes"
    );
    for _ in 0..5 {
        assert_eq!(
            cache.get::<User>("hot").unwrap(),
            Some(user(1)),
            "the rest get the stale value"
        );
    }
    cache.set("hot", &user(2), S(10)).unwrap();
    assert_eq!(cache.get::<User>("hot").unwrap(), Some(user(2)));
    let st = cache.stats();
    assert_eq!(st.claims_won, 1);
    assert_eq!(st.stale_served, 5);
}

/// 16 threads read one stale key at the same moment: exactly one is told to recompute.
fn exactly_one_claim_among_16_threads(env: &Env) {
    for round in 0..5 {
        let cache = env.cache();
        let key = format!("hot-{round}");
        cache.set(&key, &user(7), S(10)).unwrap();
        env.advance(S(11));
        let barrier = Arc::new(Barrier::new(16));
        let results: Vec<Option<User>> = thread::scope(|s| {
            let hs: Vec<_> = (0..16)
                .map(|_| {
                    let (cache, barrier, key) = (cache.clone(), barrier.clone(), key.clone());
                    s.spawn(move || {
                        barrier.wait();
                        cache.get::<User>(&key).unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let misses = results.iter().filter(|r| r.is_none()).count();
        assert_eq!(
            misses, 1,
            "round {round}: {misses} readers were told to recompute"
        );
        assert!(results.iter().flatten().all(|u| *u == user(7)));
    }
}

/// A `get` claimant that never `set`s: its claim lasts the herd timeout, and so does the value.
/// Past the soft expiry plus the herd timeout nobody is served it (the staleness bound), however
/// many readers claimed it on the way.
fn a_dead_claimants_value_is_served_only_up_to_its_bound(env: &Env) {
    let cache = env.builder().herd_timeout(S(30)).build_front(env.front);
    cache.set("k", &1u32, S(10)).unwrap();
    env.advance(S(10));
    assert_eq!(
        cache.get::<u32>("k").unwrap(),
        None,
        "claimed; the claimant then dies"
    );
    env.advance(S(29));
    assert_eq!(cache.get::<u32>("k").unwrap(), Some(1), "claim still held");
    env.advance(S(1));
    let results: Vec<Option<u32>> = thread::scope(|s| {
        let hs: Vec<_> = (0..16)
            .map(|_| s.spawn(|| cache.get::<u32>("k").unwrap()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(results.iter().all(Option::is_none), "{results:?}");
}

fn soft_expiry_has_millisecond_precision(env: &Env) {
    let cache = env.cache();
    cache.set("k", &1u8, Duration::from_millis(1500)).unwrap();
    env.advance(Duration::from_millis(1499));
    assert_eq!(cache.get::<u8>("k").unwrap(), Some(1));
    env.advance(Duration::from_millis(1));
    assert_eq!(cache.get::<u8>("k").unwrap(), None);
}

fn set_many_values_get_herd_protection(env: &Env) {
    let cache = env.cache();
    let (a, b) = (user(1), user(2));
    cache.set_many([("a", &a), ("b", &b)], S(10)).unwrap();
    let got: HashMap<String, User> = cache.get_many(&["a", "b"]).unwrap();
    assert_eq!(got.len(), 2);
    // Past the soft expiry (and past where newcache's set_many let memcached drop them): one
    // claim each, stale values for everyone else.
    env.advance(S(11));
    assert_eq!(cache.get::<User>("a").unwrap(), None);
    assert_eq!(cache.get::<User>("a").unwrap(), Some(a));
    assert_eq!(cache.get::<User>("b").unwrap(), None);
    assert_eq!(cache.get::<User>("b").unwrap(), Some(b));
}

fn get_many_claims_stale_keys_and_leaves_them_out(env: &Env) {
    let cache = env.cache();
    cache.set("fresh", &1u32, S(100)).unwrap();
    cache.set("stale", &2u32, S(10)).unwrap();
    env.advance(S(11));
    let keys = ["fresh", "stale", "missing", "fresh"];
    let first: HashMap<String, u32> = cache.get_many(&keys).unwrap();
    assert_eq!(
        first,
        HashMap::from([("fresh".to_string(), 1)]),
        "stale claimed, missing absent"
    );
    let second: HashMap<String, u32> = cache.get_many(&keys).unwrap();
    assert_eq!(
        second,
        HashMap::from([("fresh".to_string(), 1), ("stale".to_string(), 2)])
    );
    let none: HashMap<String, u32> = cache.get_many::<u32>(&[] as &[&str]).unwrap();
    assert!(none.is_empty());
}

fn ttl_near_and_beyond_thirty_days(env: &Env) {
    let cache = env.cache();
    let thirty_days = 2_592_000;
    // newcache turned this one into a 1970 timestamp: gone at once.
    cache.set("near", &1u8, S(thirty_days - 30)).unwrap();
    cache.set("beyond", &2u8, S(thirty_days * 2)).unwrap();
    cache.set_many([("m1", &3u8)], S(thirty_days - 1)).unwrap();
    cache.set_counter("c", 5, S(thirty_days + 5)).unwrap();
    assert_eq!(cache.get::<u8>("near").unwrap(), Some(1));
    assert_eq!(cache.get::<u8>("beyond").unwrap(), Some(2));
    assert_eq!(cache.get::<u8>("m1").unwrap(), Some(3));
    assert_eq!(cache.get_counter("c").unwrap(), Some(5));
}

fn ttl_never_and_zero(env: &Env) {
    let cache = env.cache();
    cache.set("forever", &1u8, Ttl::Never).unwrap();
    env.advance(S(100 * 86_400));
    assert_eq!(cache.get::<u8>("forever").unwrap(), Some(1), "never stale");
    cache.set("k", &1u8, S(60)).unwrap();
    cache.set("k", &2u8, Duration::ZERO).unwrap();
    assert_eq!(
        cache.get::<u8>("k").unwrap(),
        None,
        "a zero ttl expires now"
    );
    cache.set_many([("z", &1u8)], Duration::ZERO).unwrap();
    assert_eq!(cache.get::<u8>("z").unwrap(), None);
    let zero_default = env
        .builder()
        .default_ttl(Duration::ZERO)
        .build_front(env.front);
    zero_default.set("d", &1u8, Ttl::Default).unwrap();
    assert_eq!(zero_default.get::<u8>("d").unwrap(), None);
}

fn herd_off_is_never_claimed(env: &Env) {
    let cache = env.cache();
    cache.set_with("plain", &1u8, S(3600), Herd::Off).unwrap();
    assert_eq!(cache.get::<u8>("plain").unwrap(), Some(1));
    env.advance(S(3599));
    assert_eq!(cache.get::<u8>("plain").unwrap(), Some(1));
    assert_eq!(cache.get::<u8>("plain").unwrap(), Some(1));
    assert_eq!(cache.stats().claims_won, 0);
    if env.kind == Kind::Memory {
        // hard expiry exactly at the ttl: no herd padding
        env.advance(S(1));
        assert_eq!(cache.get::<u8>("plain").unwrap(), None);
    }
}

fn add_is_truthful(env: &Env) {
    let cache = env.cache();
    assert!(cache.add("k", &1u8, S(60)).unwrap());
    assert!(!cache.add("k", &2u8, S(60)).unwrap());
    assert_eq!(cache.get::<u8>("k").unwrap(), Some(1));
    cache.delete("k").unwrap();
    assert!(cache.add("k", &3u8, S(60)).unwrap());
    assert_eq!(cache.get::<u8>("k").unwrap(), Some(3));
    assert!(
        !cache.add("k", &4u8, Duration::ZERO).unwrap(),
        "a live value is there"
    );
    assert!(cache.add("free", &4u8, Duration::ZERO).unwrap());
    assert_eq!(cache.get::<u8>("free").unwrap(), None);
}

fn add_is_atomic_among_16_threads(env: &Env) {
    let cache = env.cache();
    let barrier = Barrier::new(16);
    let wins: usize = thread::scope(|s| {
        let hs: Vec<_> = (0..16u8)
            .map(|i| {
                let (cache, barrier) = (&cache, &barrier);
                s.spawn(move || {
                    barrier.wait();
                    usize::from(cache.add("once", &i, S(60)).unwrap())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).sum()
    });
    assert_eq!(wins, 1);
}

fn add_replaces_a_stale_value(env: &Env) {
    let cache = env.cache();
    cache.set("k", &1u8, S(10)).unwrap();
    env.advance(S(11));
    assert!(
        cache.add("k", &2u8, S(10)).unwrap(),
        "a stale value is not live"
    );
    assert_eq!(cache.get::<u8>("k").unwrap(), Some(2));
}

fn delete_and_delete_many(env: &Env) {
    let cache = env.cache();
    assert!(!cache.delete("nothing").unwrap());
    cache
        .set_many([("a", &1u8), ("b", &2u8), ("c", &3u8)], S(60))
        .unwrap();
    assert!(cache.delete("a").unwrap());
    assert_eq!(cache.get::<u8>("a").unwrap(), None);
    assert_eq!(cache.delete_many(&["a", "b", "c", "d"]).unwrap(), 2);
    let left: HashMap<String, u8> = cache.get_many(&["a", "b", "c"]).unwrap();
    assert!(left.is_empty());
}

fn counters(env: &Env) {
    let cache = env.cache();
    cache.set_counter("hits", 41, Ttl::Never).unwrap();
    assert_eq!(cache.incr("hits", 1).unwrap(), 42);
    assert_eq!(cache.get_counter("hits").unwrap(), Some(42));
    assert_eq!(
        cache.decr("hits", 100).unwrap(),
        0,
        "memcached clamps at zero"
    );
    cache.set_counter("pad", 100, S(60)).unwrap();
    assert_eq!(cache.decr("pad", 1).unwrap(), 99);
    // memcached now stores "99 " (space-padded): get_counter trims it
    assert_eq!(cache.get_counter("pad").unwrap(), Some(99));
    assert_eq!(cache.incr("pad", 1).unwrap(), 100);
    let e = cache.incr("missing", 1).unwrap_err();
    assert!(e.is_not_found(), "{e}");
    assert!(cache.decr("missing", 1).unwrap_err().is_not_found());
    assert_eq!(cache.get_counter("missing").unwrap(), None);
    cache.set_counter("max", u64::MAX, S(60)).unwrap();
    assert_eq!(cache.incr("max", 1).unwrap(), 0, "wraps like memcached");
}

fn counters_and_envelopes_do_not_mix(env: &Env) {
    let cache = env.cache();
    cache.set("obj", &5u64, S(60)).unwrap();
    assert!(cache.incr("obj", 1).unwrap_err().is_not_a_counter());
    assert!(cache.get_counter("obj").unwrap_err().is_not_a_counter());
    cache.set_counter("n", 5, S(60)).unwrap();
    assert!(cache.get::<u64>("n").unwrap_err().is_decode());
    // the cache is still usable after both errors
    assert_eq!(cache.incr("n", 1).unwrap(), 6);
}

fn incr_or_create_creates_then_increments(env: &Env) {
    let cache = env.cache();
    // missing: created holding delta (incr alone fails with not found)
    assert!(cache.incr("visits", 1).unwrap_err().is_not_found());
    assert_eq!(cache.incr_or_create("visits", 5, S(60)).unwrap(), 5);
    assert_eq!(cache.get_counter("visits").unwrap(), Some(5));
    // present: incremented, and incr sees it as a counter
    assert_eq!(cache.incr_or_create("visits", 2, S(60)).unwrap(), 7);
    assert_eq!(cache.incr("visits", 1).unwrap(), 8);
    // wraps at 2^64 as incr does
    cache.set_counter("max", u64::MAX, S(60)).unwrap();
    assert_eq!(cache.incr_or_create("max", 1, S(60)).unwrap(), 0);
    // after a delete it is created again
    assert!(cache.delete("visits").unwrap());
    assert_eq!(cache.incr_or_create("visits", 3, Ttl::Never).unwrap(), 3);
    // a key holding a value is not a counter, and stays as it was
    cache.set("obj", &5u64, S(60)).unwrap();
    let e = cache.incr_or_create("obj", 1, S(60)).unwrap_err();
    assert!(e.is_not_a_counter(), "{e}");
    assert_eq!(cache.get::<u64>("obj").unwrap(), Some(5));
}

fn incr_or_create_sets_the_ttl_at_creation_only(env: &Env) {
    let cache = env.timed_builder().build_front(env.front);
    assert_eq!(cache.incr_or_create("short", 1, S(2)).unwrap(), 1);
    // an increment with a long ttl does not extend the counter's life
    assert_eq!(cache.incr_or_create("short", 1, S(3600)).unwrap(), 2);
    assert_eq!(cache.incr_or_create("long", 1, S(3600)).unwrap(), 1);
    env.pass(S(4));
    assert_eq!(
        cache.get_counter("short").unwrap(),
        None,
        "expired after 2 s"
    );
    assert_eq!(cache.get_counter("long").unwrap(), Some(1));
    assert_eq!(
        cache.incr_or_create("short", 1, S(2)).unwrap(),
        1,
        "created again"
    );
}

fn incr_or_create_from_16_threads_sums_exactly(env: &Env) {
    let cache = env.cache();
    let barrier = Barrier::new(16);
    let results: Vec<u64> = thread::scope(|s| {
        let handles: Vec<_> = (0..16)
            .map(|_| {
                s.spawn(|| {
                    barrier.wait();
                    (0..10)
                        .map(|_| cache.incr_or_create("race", 1, S(60)).unwrap())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    assert_eq!(cache.get_counter("race").unwrap(), Some(160));
    // every caller saw a distinct value: one creation, 159 increments
    let mut sorted = results;
    sorted.sort_unstable();
    assert_eq!(sorted, (1..=160).collect::<Vec<u64>>());
}

fn a_counter_read_as_a_value_points_to_get_counter(env: &Env) {
    let cache = env.cache();
    cache.incr_or_create("hits", 1, S(60)).unwrap();
    let e = cache.get::<u64>("hits").unwrap_err();
    assert!(e.is_decode(), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("get_counter"), "{msg}");
    assert!(!msg.contains("another client"), "{msg}");
}

fn foreign_and_corrupt_bytes(env: &Env) {
    let cache = env.cache();
    let k = cache.make_key("x");
    let mut big_claim = b"NC\x01\x02".to_vec(); // a plain envelope around a lying length prefix
    big_claim.push(0xfd);
    big_claim.extend_from_slice(&(1u64 << 62).to_le_bytes());
    let cases: Vec<(&str, Vec<u8>, u32)> = vec![
        (
            "python pickle",
            b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00}\x94.".to_vec(),
            1,
        ),
        ("php serialize", b"a:1:{s:1:\"x\";i:1;}".to_vec(), 0),
        (
            "zlib blob with flags",
            b"x\x9c\xcbH\xcd\xc9\xc9\x07\x00\x06,\x02\x15".to_vec(),
            2,
        ),
        ("empty", Vec::new(), 0),
        ("envelope flags, empty", Vec::new(), 0x4E43),
        ("truncated envelope", b"NC\x01\x01\x00\x01".to_vec(), 0x4E43),
        ("lying length prefix", big_claim, 0x4E43),
    ];
    let tolerant = env
        .builder()
        .decode_policy(DecodePolicy::Miss)
        .build_front(env.front);
    for (what, bytes, flags) in cases {
        env.raw_set(&k, &bytes, flags);
        let e = cache.get::<Vec<String>>("x").unwrap_err();
        assert!(e.is_decode(), "{what}: {e}");
        // in a batch, the key alone is left out (counted): it never fails the other keys
        let errors = cache.stats().decode_errors;
        let many = cache.get_many::<Vec<String>>(&["x"]).unwrap();
        assert!(many.is_empty(), "{what} via get_many");
        assert_eq!(cache.stats().decode_errors, errors + 1, "{what} counted");
        assert_eq!(
            tolerant.get::<Vec<String>>("x").unwrap(),
            None,
            "{what} as a miss"
        );
    }
    assert!(cache.stats().decode_errors >= 14);
    // nothing was lost: the key can be written again and read
    cache.set("x", &vec!["ok".to_string()], S(60)).unwrap();
    assert_eq!(
        cache.get::<Vec<String>>("x").unwrap(),
        Some(vec!["ok".to_string()])
    );
}

fn oversized_values_are_refused_and_the_cache_stays_usable(env: &Env) {
    let cache = env.cache();
    let big = vec![7u8; 2 * 1024 * 1024];
    let e = cache.set("big", &big, S(60)).unwrap_err();
    assert!(e.is_too_large(), "{e}");
    // Django's set_many: the keys it could not store are returned, the others are stored
    let failed = cache
        .set_many([("ok", &vec![1u8]), ("big", &big)], S(60))
        .unwrap();
    assert_eq!(failed, vec!["big".to_string()]);
    assert_eq!(cache.get::<Vec<u8>>("ok").unwrap(), Some(vec![1u8]));
    assert!(cache.add("big", &big, S(60)).unwrap_err().is_too_large());
    // just under the limit fits
    let fits = vec![1u8; 1024 * 1024 - 400];
    cache.set("fits", &fits, S(60)).unwrap();
    assert_eq!(
        cache.get::<Vec<u8>>("fits").unwrap().map(|v| v.len()),
        Some(fits.len())
    );
    cache.set("after", &1u8, S(60)).unwrap();
    assert_eq!(cache.get::<u8>("after").unwrap(), Some(1));
}

fn hostile_keys_round_trip(env: &Env) {
    let cache = env.cache();
    let long = "k".repeat(10 * 1024);
    let keys = [
        "with spaces in it",
        "new\r\nline\r\nflush_all\r\n",
        "nul\0byte",
        "ünïcödé ключ 鍵 🔑",
        "",
        long.as_str(),
    ];
    for (i, k) in keys.iter().enumerate() {
        cache.set(k, &i, S(60)).unwrap();
    }
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(cache.get::<usize>(k).unwrap(), Some(i), "{k:?}");
    }
    let got: HashMap<String, usize> = cache.get_many(&keys).unwrap();
    assert_eq!(got.len(), keys.len());
    assert_eq!(got[long.as_str()], 5);
    assert_eq!(cache.delete_many(&keys).unwrap(), keys.len());
}

fn custom_key_function_is_validated(env: &Env) {
    let cache = env
        .builder()
        .key_function(|flavor, version, key| format!("{flavor}:{version}:{key}"))
        .build_front(env.front);
    cache.set("plain", &1u8, S(60)).unwrap();
    assert_eq!(cache.get::<u8>("plain").unwrap(), Some(1));
    assert!(cache.make_key("plain").ends_with(":1:plain"));
    for bad in ["has space", "crlf\r\nset x 0 0 1", &"x".repeat(300)] {
        assert!(
            cache.set(bad, &1u8, S(60)).unwrap_err().is_invalid_key(),
            "{bad:?}"
        );
        assert!(cache.get::<u8>(bad).unwrap_err().is_invalid_key());
        assert!(cache.get_many::<u8>(&[bad]).unwrap_err().is_invalid_key());
    }
    assert_eq!(cache.get::<u8>("plain").unwrap(), Some(1), "still usable");
}

fn stats_count_what_happened(env: &Env) {
    let cache = env.cache();
    cache.set("k", &1u8, S(10)).unwrap();
    cache.get::<u8>("k").unwrap();
    cache.get::<u8>("none").unwrap();
    env.advance(S(10));
    cache.get::<u8>("k").unwrap();
    cache.get::<u8>("k").unwrap();
    let st = cache.clone().with_version(1).stats();
    assert_eq!(
        (st.hits, st.misses, st.claims_won, st.stale_served),
        (1, 2, 1, 1)
    );
}

#[test]
fn cache_is_a_cheap_thread_safe_handle() {
    fn check<T: Clone + Send + Sync + 'static>() {}
    check::<Cache>();
}
