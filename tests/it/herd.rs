//! The herd protocol at its edges, on every backend: a load never undoes an invalidation that
//! landed while it ran, one load behind a slow database, claims renewed and taken over, the
//! staleness bound, newer envelope formats, and what a call costs in round trips.

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use newcache::Clock;

use crate::fixture::{Env, Hooked, Kind, unique_flavor};
use crate::front::{BuildFor, TestCache};

const S: fn(u64) -> Duration = Duration::from_secs;
const MS: fn(u64) -> Duration = Duration::from_millis;

crate::on_every_backend!(
    invalidations_during_a_stale_refresh_win,
    invalidations_during_a_cold_load_win,
    invalidations_during_an_early_refresh_win,
    invalidations_during_a_background_refresh_win,
    invalidations_during_a_batch_load_win,
    a_batch_load_counts_each_keys_own_outcome,
    a_slow_database_sees_one_load_and_waiters_time_out,
    a_holder_renews_its_claim_past_the_lease,
    a_holder_past_max_load_time_is_replaced_by_one_waiter,
    a_value_is_never_served_past_its_bound,
    a_failing_loader_keeps_nothing_alive,
    a_claim_outlives_the_items_own_expiry,
    a_newer_format_is_a_counted_miss,
    a_get_claim_ends_at_the_bound,
    round_trips_per_call,
    max_wait_counts_from_the_start_of_the_call,
);

/// A loader the test holds mid-load: it says when it started, then waits for the go.
struct Gate {
    started: Barrier,
    go: Barrier,
    calls: AtomicUsize,
}

impl Gate {
    fn new() -> Gate {
        Gate {
            started: Barrier::new(2),
            go: Barrier::new(2),
            calls: AtomicUsize::new(0),
        }
    }

    fn load(&self, v: &str) -> io::Result<String> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.started.wait();
        self.go.wait();
        Ok(v.to_string())
    }
}

/// What lands while a load runs, and what the key must hold afterwards.
struct Invalidation {
    name: &'static str,
    act: fn(&Env, &TestCache),
    /// What `get::<String>` returns afterwards: `Ok(v)`, or `Err(())` for a decode error (a
    /// foreign value written by another client stood).
    after: Result<Option<&'static str>, ()>,
}

const INVALIDATIONS: &[Invalidation] = &[
    Invalidation {
        name: "delete",
        act: |_, c| {
            c.delete("row").unwrap();
        },
        after: Ok(None),
    },
    Invalidation {
        name: "set",
        act: |_, c| c.set("row", "newer", S(60)).unwrap(),
        after: Ok(Some("newer")),
    },
    Invalidation {
        name: "add",
        act: |_, c| {
            assert!(
                c.add("row", "added", S(60)).unwrap(),
                "a load is not a value"
            )
        },
        after: Ok(Some("added")),
    },
    Invalidation {
        name: "set_many",
        act: |_, c| {
            let failed = c.set_many([("row", "batched"), ("other", "x")], S(60));
            assert_eq!(failed.unwrap(), Vec::<String>::new());
        },
        after: Ok(Some("batched")),
    },
    Invalidation {
        name: "another client's delete",
        act: |env, c| env.raw_delete(&c.make_key("row")),
        after: Ok(None),
    },
    Invalidation {
        name: "another client's set",
        act: |env, c| env.raw_set(&c.make_key("row"), b"(dp0\n.", 1),
        after: Err(()),
    },
];

#[track_caller]
fn check_after(cache: &TestCache, inv: &Invalidation) {
    let got = cache.get::<String>("row");
    match inv.after {
        Ok(want) => assert_eq!(
            got.unwrap().as_deref(),
            want,
            "{}: the invalidation stands",
            inv.name
        ),
        Err(()) => assert!(
            got.unwrap_err().is_decode(),
            "{}: foreign value stands",
            inv.name
        ),
    }
}

/// Runs `call` on a thread, holds its loader mid-load while `inv` lands, then lets it finish;
/// returns what the call returned.
fn race<T: Send>(
    env: &Env,
    cache: &TestCache,
    gate: &Gate,
    inv: &Invalidation,
    call: impl FnOnce() -> T + Send,
) -> T {
    thread::scope(|s| {
        let h = s.spawn(call);
        gate.started.wait();
        // Let the loader finish even if the invalidation panics, so the test fails, not hangs.
        let acted =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (inv.act)(env, cache)));
        gate.go.wait();
        let r = h.join().unwrap();
        if let Err(p) = acted {
            std::panic::resume_unwind(p);
        }
        r
    })
}

fn invalidations_during_a_stale_refresh_win(env: &Env) {
    for inv in INVALIDATIONS {
        let cache = env
            .builder()
            .flavor(unique_flavor("inv"))
            .build_front(env.front);
        cache.set("row", "v1", S(10)).unwrap();
        env.advance(S(11));
        let gate = Gate::new();
        let got = race(env, &cache, &gate, inv, || {
            cache.get_or_set_with("row", S(60), || gate.load("read before the update"))
        });
        assert_eq!(
            got.unwrap(),
            "read before the update",
            "{}: the caller gets its load",
            inv.name
        );
        check_after(&cache, inv);
        assert_eq!(cache.stats().loads_superseded, 1, "{}", inv.name);
    }
}

fn invalidations_during_a_cold_load_win(env: &Env) {
    for inv in INVALIDATIONS {
        let cache = env
            .builder()
            .flavor(unique_flavor("inv"))
            .build_front(env.front);
        let gate = Gate::new();
        let got = race(env, &cache, &gate, inv, || {
            cache.get_or_set_with("row", S(60), || gate.load("read before the update"))
        });
        assert_eq!(got.unwrap(), "read before the update", "{}", inv.name);
        check_after(&cache, inv);
        assert_eq!(cache.stats().loads_superseded, 1, "{}", inv.name);
    }
}

fn invalidations_during_an_early_refresh_win(env: &Env) {
    // An `add` finds the value still fresh and is refused: nothing to invalidate.
    for inv in INVALIDATIONS.iter().filter(|i| i.name != "add") {
        let cache = env
            .builder()
            .flavor(unique_flavor("inv"))
            .early_refresh(1e9)
            .random_seed(3)
            .build_front(env.front);
        // A value with a known load time, one second from its soft expiry: XFetch claims it.
        cache
            .get_or_set_with("row", S(10), || {
                thread::sleep(MS(2));
                Ok::<_, io::Error>("v1".to_string())
            })
            .unwrap();
        env.advance(S(9));
        let gate = Gate::new();
        let got = race(env, &cache, &gate, inv, || {
            cache.get_or_set_with("row", S(60), || gate.load("read before the update"))
        });
        assert_eq!(got.unwrap(), "read before the update", "{}", inv.name);
        assert_eq!(cache.stats().early_refreshes, 1, "{}", inv.name);
        check_after(&cache, inv);
        assert_eq!(cache.stats().loads_superseded, 1, "{}", inv.name);
    }
}

fn invalidations_during_a_background_refresh_win(env: &Env) {
    for inv in INVALIDATIONS {
        let cache = env
            .builder()
            .flavor(unique_flavor("inv"))
            .build_front(env.front);
        cache.set("row", "v1", S(10)).unwrap();
        env.advance(S(11));
        let gate = Arc::new(Gate::new());
        let g = gate.clone();
        let stale = cache
            .get_or_set_with_background("row", S(60), move || g.load("read before the update"))
            .unwrap();
        assert_eq!(stale, "v1", "served at once");
        gate.started.wait();
        (inv.act)(env, &cache);
        gate.go.wait();
        let deadline = Instant::now() + S(10);
        while cache.stats().loads_superseded == 0 {
            assert!(
                Instant::now() < deadline,
                "{}: the refresh never finished",
                inv.name
            );
            thread::sleep(MS(2));
        }
        check_after(&cache, inv);
    }
}

fn invalidations_during_a_batch_load_win(env: &Env) {
    for inv in INVALIDATIONS {
        let cache = env
            .builder()
            .flavor(unique_flavor("inv"))
            .build_front(env.front);
        cache.set("stale", "v1", S(10)).unwrap();
        env.advance(S(11));
        let gate = Gate::new();
        let got = race(env, &cache, &gate, inv, || {
            cache.get_many_or_set_with(&["row", "stale"], S(60), |keys| {
                let v = gate.load("loaded")?;
                Ok::<_, io::Error>(keys.iter().map(|k| (k.clone(), v.clone())).collect())
            })
        });
        let got = got.unwrap();
        assert_eq!(
            got.get("row").map(String::as_str),
            Some("loaded"),
            "{}",
            inv.name
        );
        check_after(&cache, inv);
        if inv.name != "set_many" {
            assert_eq!(
                cache.get::<String>("stale").unwrap().as_deref(),
                Some("loaded"),
                "{}: an untouched key is stored",
                inv.name
            );
        }
    }
}

/// A batch load whose first key's claim is lost while it runs (the key deleted, the renewal
/// finding it gone) stores the others and counts only that one as superseded: each key gets its
/// own write's outcome, not its neighbour's.
fn a_batch_load_counts_each_keys_own_outcome(env: &Env) {
    let cache = env
        .timed_builder()
        .lease_ttl(S(2))
        .max_wait(S(10))
        .build_front(env.front);
    let keys = ["gone", "kept1", "kept2", "kept3"];
    let got = with_moving_clock(env, || {
        cache.get_many_or_set_with(&keys, S(60), |missing| {
            cache.delete("gone").unwrap();
            // Past two renewals (every third of the lease): the first finds "gone" deleted.
            thread::sleep(MS(1500));
            Ok::<_, io::Error>(
                missing
                    .iter()
                    .map(|k| (k.clone(), format!("{k}!")))
                    .collect(),
            )
        })
    });
    assert_eq!(got.unwrap().len(), keys.len(), "every load is returned");
    assert_eq!(
        cache.get::<String>("gone").unwrap(),
        None,
        "the delete stands"
    );
    for k in &keys[1..] {
        assert_eq!(
            cache.get::<String>(k).unwrap(),
            Some(format!("{k}!")),
            "{k} is stored"
        );
    }
    assert_eq!(
        cache.stats().loads_superseded,
        1,
        "only the deleted key lost its load"
    );
}

/// max_wait 0.5 s, a 1.5 s loader, 16 threads in two caches (two processes): one load. Every
/// other caller gives up at max_wait with a wait-timeout error instead of loading too.
fn a_slow_database_sees_one_load_and_waiters_time_out(env: &Env) {
    let caches: Vec<TestCache> = (0..2)
        .map(|_| env.builder().max_wait(MS(500)).build_front(env.front))
        .collect();
    let calls = AtomicUsize::new(0);
    let barrier = Barrier::new(16);
    let results: Vec<_> = thread::scope(|s| {
        let hs: Vec<_> = (0..16)
            .map(|i| {
                let (c, calls, barrier) = (&caches[i % 2], &calls, &barrier);
                s.spawn(move || {
                    barrier.wait();
                    c.get_or_set_with("report", S(60), || {
                        calls.fetch_add(1, Ordering::SeqCst);
                        thread::sleep(MS(1500));
                        Ok::<_, io::Error>("slow".to_string())
                    })
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "one load behind a slow database"
    );
    let ok = results
        .iter()
        .filter(|r| r.as_ref().is_ok_and(|v| v == "slow"))
        .count();
    let timed_out = results
        .iter()
        .filter(|r| {
            r.as_ref()
                .is_err_and(|e| e.cache().is_some_and(newcache::Error::is_wait_timeout))
        })
        .count();
    assert_eq!((ok, timed_out), (1, 15), "{results:?}");
    assert_eq!(
        caches[1].get::<String>("report").unwrap().as_deref(),
        Some("slow")
    );
}

/// Keeps a timed cache's clock moving with real time on the memory backend (memcached's caches
/// use the system clock) while `f` runs.
fn with_moving_clock<T>(env: &Env, f: impl FnOnce() -> T) -> T {
    let stop = std::sync::atomic::AtomicBool::new(false);
    thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::SeqCst) {
                thread::sleep(MS(50));
                if env.kind == Kind::Memory {
                    env.advance(MS(50));
                }
            }
        });
        let r = f();
        stop.store(true, Ordering::SeqCst);
        r
    })
}

/// A 3 s load under a 2 s lease: the holder renews its claim, so the waiter (max_wait 10 s) gets
/// the holder's value and never loads.
fn a_holder_renews_its_claim_past_the_lease(env: &Env) {
    let build = || {
        env.timed_builder()
            .lease_ttl(S(2))
            .max_wait(S(10))
            .build_front(env.front)
    };
    let (a, b) = (build(), build());
    let calls = AtomicUsize::new(0);
    let load = |v: &'static str| {
        let calls = &calls;
        move || {
            calls.fetch_add(1, Ordering::SeqCst);
            thread::sleep(MS(3000));
            Ok::<_, io::Error>(v.to_string())
        }
    };
    let (ra, rb) = with_moving_clock(env, || {
        thread::scope(|s| {
            let ha = s.spawn(|| a.get_or_set_with("k", S(60), load("a")));
            thread::sleep(MS(200));
            let hb = s.spawn(|| b.get_or_set_with("k", S(60), load("b")));
            (ha.join().unwrap(), hb.join().unwrap())
        })
    });
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the claim was kept alive");
    assert_eq!((ra.unwrap().as_str(), rb.unwrap().as_str()), ("a", "a"));
}

/// A holder still loading after max_load_time stops renewing; once its claim lapses exactly one
/// waiter takes over, and the first load's late result is not stored over the second's.
fn a_holder_past_max_load_time_is_replaced_by_one_waiter(env: &Env) {
    let build = || {
        env.timed_builder()
            .lease_ttl(S(2))
            .max_load_time(S(2))
            .max_wait(S(10))
            .build_front(env.front)
    };
    let (a, b, c) = (build(), build(), build());
    let calls = AtomicUsize::new(0);
    let load = |v: &'static str, ms: u64| {
        let calls = &calls;
        move || {
            calls.fetch_add(1, Ordering::SeqCst);
            thread::sleep(MS(ms));
            Ok::<_, io::Error>(v.to_string())
        }
    };
    let (ra, rb, rc) = with_moving_clock(env, || {
        thread::scope(|s| {
            let ha = s.spawn(|| a.get_or_set_with("k", S(60), load("a", 6000)));
            thread::sleep(MS(200));
            let hb = s.spawn(|| b.get_or_set_with("k", S(60), load("b", 100)));
            let hc = s.spawn(|| c.get_or_set_with("k", S(60), load("c", 100)));
            (ha.join().unwrap(), hb.join().unwrap(), hc.join().unwrap())
        })
    });
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "the stuck holder and one taker"
    );
    let (rb, rc) = (rb.unwrap(), rc.unwrap());
    assert_eq!(ra.unwrap(), "a", "the first holder still gets its value");
    assert_eq!(rb, rc, "the other waiter got the taker's value");
    assert_eq!(
        a.get::<String>("k").unwrap(),
        Some(rb),
        "the late result was not stored"
    );
    assert_eq!(a.stats().loads_superseded, 1);
}

/// ttl 1 s, herd timeout 1 s: plain readers claim it over and over, nobody sets it. It is served
/// (fresh, then stale) up to 2 s after it was written, and never after.
fn a_value_is_never_served_past_its_bound(env: &Env) {
    let cache = env.builder().herd_timeout(S(1)).build_front(env.front);
    cache.set("k", "v", S(1)).unwrap();
    let mut last_served = None;
    for step in 1..=16u64 {
        env.advance(MS(250));
        for _ in 0..4 {
            if cache.get::<String>("k").unwrap().is_some() {
                last_served = Some(step * 250);
            }
        }
    }
    assert_eq!(last_served, Some(1750), "served until 2 s, never after");
}

/// A loader that keeps failing: the stale value is served to others while it is within its bound,
/// then nobody gets it; with serve_stale_on_error, the failing caller gets it up to max_age.
fn a_failing_loader_keeps_nothing_alive(env: &Env) {
    let failing = || Err::<String, _>(io::Error::other("db is down"));
    let strict = env.builder().herd_timeout(S(1)).build_front(env.front);
    strict.set("k", "v", S(1)).unwrap();
    env.advance(MS(2000));
    for _ in 0..3 {
        assert!(
            strict
                .get_or_set_with("k", S(1), failing)
                .unwrap_err()
                .loader()
                .is_some()
        );
        assert_eq!(strict.get::<String>("k").unwrap(), None);
        env.advance(MS(500));
    }
    let lenient = env
        .builder()
        .herd_timeout(S(1))
        .serve_stale_on_error(S(4))
        .build_front(env.front);
    lenient.set("j", "v", S(1)).unwrap();
    let mut served = Vec::new();
    for _ in 0..12 {
        env.advance(MS(500));
        served.push(lenient.get_or_set_with("j", S(1), failing).is_ok());
    }
    // ages 0.5..=4 s: the value (fresh, then stale on error); 4.5 s on: the error
    assert_eq!(served, [[true; 8], [false; 8]].concat()[..12]);
}

/// A stale entry claimed just before memcached would drop it: the claim keeps the item for the
/// claim's life, so a second caller after the item's own expiry waits instead of loading too.
fn a_claim_outlives_the_items_own_expiry(env: &Env) {
    let build = || {
        env.timed_builder()
            .herd_timeout(S(1))
            .max_wait(MS(300))
            .build_front(env.front)
    };
    let (a, b) = (build(), build());
    a.set("k", "v1", S(1)).unwrap(); // memcached drops it after 2 s
    env.pass(MS(1500));
    let gate = Gate::new();
    let calls = AtomicUsize::new(0);
    thread::scope(|s| {
        let h = s.spawn(|| a.get_or_set_with("k", S(60), || gate.load("v2")));
        gate.started.wait();
        env.pass(MS(1500)); // 3 s: past the item's own expiry, within the claim
        let second = b.get_or_set_with("k", S(60), || {
            calls.fetch_add(1, Ordering::SeqCst);
            Ok::<_, io::Error>("second load".to_string())
        });
        gate.go.wait();
        assert_eq!(h.join().unwrap().unwrap(), "v2");
        let e = newcache::Error::from(second.unwrap_err());
        assert!(e.is_wait_timeout(), "{e}");
    });
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert_eq!(b.get::<String>("k").unwrap().as_deref(), Some("v2"));
}

/// An item of a newer envelope format (a newer build wrote it): a counted miss for readers,
/// never an error; a load runs but does not overwrite it (two builds in a rolling deploy would
/// otherwise keep replacing each other's items).
fn a_newer_format_is_a_counted_miss(env: &Env) {
    let cache = env.cache();
    let k = cache.make_key("k");
    env.raw_set(&k, b"NC\x09a future layout", newcache::__private::FLAGS);
    assert_eq!(cache.get::<String>("k").unwrap(), None);
    assert_eq!(cache.get_many::<String>(&["k"]).unwrap().len(), 0);
    let v = cache
        .get_or_set_with("k", S(60), || Ok::<_, io::Error>("ours".to_string()))
        .unwrap();
    assert_eq!(v, "ours");
    assert_eq!(
        cache.get::<String>("k").unwrap(),
        None,
        "the newer item stays"
    );
    assert_eq!(cache.stats().newer_format, 4);
}

/// A `get` that claims a stale entry late in its herd window does not hold up loaders past the
/// value's bound: its claim ends there.
fn a_get_claim_ends_at_the_bound(env: &Env) {
    let cache = env
        .builder()
        .herd_timeout(S(10))
        .max_wait(MS(300))
        .build_front(env.front);
    cache.set("k", "v1", S(1)).unwrap();
    env.advance(S(9));
    assert_eq!(
        cache.get::<String>("k").unwrap(),
        None,
        "claimed by a plain get"
    );
    env.advance(S(3)); // past soft expiry + herd timeout
    let v = cache
        .get_or_set_with("k", S(60), || Ok::<_, io::Error>("v2".to_string()))
        .unwrap();
    assert_eq!(v, "v2", "the loader ran: nobody was loading");
}

/// A cold miss costs 3 round trips (read; placeholder add + read-back, pipelined; cas), a fresh
/// hit 1 (a near hit none), a stale refresh 3 once per expiry (stale readers 1 each); one key
/// derivation per call that goes to the shared store.
fn round_trips_per_call(env: &Env) {
    let counting = Arc::new(Hooked::new(env.backend()));
    let derivations = Arc::new(AtomicUsize::new(0));
    let d = derivations.clone();
    let cache = env
        .builder()
        .backend(counting.clone())
        .key_function(move |flavor, version, key| {
            d.fetch_add(1, Ordering::SeqCst);
            newcache::default_key(flavor, version, key)
        })
        .build_front(env.front);
    let load = || Ok::<_, io::Error>(1u32);
    // Through twemproxy with two connections per server, the proxy may run a pipelined
    // read-back before its write: the protocol then reads once more (never fewer than 3).
    let reread = usize::from(env.kind == Kind::Twemproxy);
    cache.get_or_set_with("k", S(10), load).unwrap();
    let trips = counting.take();
    assert!((3..=3 + reread).contains(&trips), "cold miss: {trips}");
    assert_eq!(derivations.swap(0, Ordering::SeqCst), 1, "cold miss");
    cache.get_or_set_with("k", S(10), load).unwrap();
    // A near hit neither reads nor derives the key.
    let hit = if env.near { (0, 0) } else { (1, 1) };
    assert_eq!(
        (counting.take(), derivations.swap(0, Ordering::SeqCst)),
        hit,
        "fresh hit"
    );
    env.advance(S(11));
    cache.get_or_set_with("k", S(10), load).unwrap();
    let trips = counting.take();
    assert!(
        (3..=3 + reread).contains(&trips),
        "the refresh of a stale key: {trips}"
    );
}

/// `max_wait` bounds a call's wait end to end, from the call's start: a slow first read (here
/// 1.5 s) is part of it, not added to it (a caller waited 3 s for a 1.5 s `max_wait`).
fn max_wait_counts_from_the_start_of_the_call(env: &Env) {
    let counting = Arc::new(Hooked::new(env.backend()));
    let cache = env
        .builder()
        .backend(counting.clone())
        .max_wait(MS(1500))
        .build_front(env.front);
    // a live holder that will not finish in time
    let now = env.clock.now_ms();
    let stuck = newcache::__private::placeholder(now, now + 60_000, 7);
    env.raw_set_ttl(&cache.make_key("k"), &stuck, newcache::__private::FLAGS, 60);
    *counting.slow_get.lock().unwrap() = Some(MS(1500));
    let t = Instant::now();
    let e = cache
        .get_or_set_with("k", S(60), || Ok::<_, io::Error>(1u8))
        .map_err(newcache::Error::from)
        .unwrap_err();
    let waited = t.elapsed();
    assert!(e.is_wait_timeout(), "{e}");
    // 1.5 s of read already used the whole max_wait; the old code then waited 1.5 s more
    assert!(waited < MS(2600), "{waited:?}");
}
