//! The loader API on both backends: exactly one load for cold and stale keys, errors and panics
//! leave no one waiting, lease takeover, early refresh, serve-stale-on-error, background refresh,
//! batches.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use newcache::Ttl;

use newcache::Clock;

use crate::fixture::Env;
use crate::front::{BuildFor, TestCache};

const S: fn(u64) -> Duration = Duration::from_secs;
const MS: fn(u64) -> Duration = Duration::from_millis;

crate::on_every_backend!(
    one_load_among_32_threads_for_a_cold_key,
    one_load_across_four_caches_sharing_a_backend,
    one_load_among_32_threads_for_a_stale_key,
    loader_error_is_typed_and_nothing_is_cached,
    a_loaders_own_error_comes_back_typed_to_its_followers,
    waiters_of_a_failed_load_get_the_error,
    a_panicking_loader_leaves_no_one_waiting,
    lease_takeover_after_a_dead_holder,
    wait_bound_is_an_error_not_a_second_load,
    early_refresh_keeps_a_hot_key_from_going_stale,
    early_refresh_draws_are_seeded,
    serve_stale_on_error_is_bounded,
    background_refresh_returns_the_stale_value_at_once,
    get_many_or_set_with_loads_once_for_missing_and_claimed,
);

/// Runs `n` threads released together; returns their results.
fn herd<T: Send>(n: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let barrier = Barrier::new(n);
    thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|i| {
                let (f, barrier) = (&f, &barrier);
                s.spawn(move || {
                    barrier.wait();
                    f(i)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Waits (polling, up to a generous 10 s) until `count` reaches `n`; whether it did.
fn wait_for(count: &AtomicUsize, n: usize) -> bool {
    let deadline = Instant::now() + S(10);
    while count.load(Ordering::SeqCst) < n {
        if Instant::now() > deadline {
            return false;
        }
        thread::sleep(MS(1));
    }
    true
}

fn slow_loader<'a>(
    calls: &'a AtomicUsize,
    value: &'a str,
) -> impl FnOnce() -> io::Result<String> + 'a {
    move || {
        calls.fetch_add(1, Ordering::SeqCst);
        thread::sleep(MS(50));
        Ok(value.to_string())
    }
}

fn one_load_among_32_threads_for_a_cold_key(env: &Env) {
    let cache = env.cache();
    let calls = AtomicUsize::new(0);
    let got = herd(32, |_| {
        cache
            .get_or_set_with("cold", S(60), slow_loader(&calls, "v"))
            .unwrap()
    });
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert!(got.iter().all(|v| v == "v"));
    assert_eq!(cache.get::<String>("cold").unwrap().as_deref(), Some("v"));
}

/// Four caches with their own coalescers share one backend, as four processes would: the lease
/// makes it one load across all of them.
fn one_load_across_four_caches_sharing_a_backend(env: &Env) {
    let caches: Vec<TestCache> = (0..4).map(|_| env.cache()).collect();
    let calls = AtomicUsize::new(0);
    for round in 0..3 {
        let key = format!("cold-{round}");
        let got = herd(32, |i| {
            caches[i % 4]
                .get_or_set_with(&key, S(60), slow_loader(&calls, "v"))
                .unwrap()
        });
        assert_eq!(calls.load(Ordering::SeqCst), round + 1, "round {round}");
        assert!(got.iter().all(|v| v == "v"));
    }
}

fn one_load_among_32_threads_for_a_stale_key(env: &Env) {
    let caches: Vec<TestCache> = (0..4).map(|_| env.cache()).collect();
    caches[0].set("hot", "old", S(10)).unwrap();
    env.advance(S(11));
    let calls = AtomicUsize::new(0);
    // The loader does not finish until every other caller has its answer: if anyone waited for
    // the load instead of taking the stale value, the gate never opens (no clock involved).
    let served_old = AtomicUsize::new(0);
    let gate = || {
        calls.fetch_add(1, Ordering::SeqCst);
        Ok::<_, io::Error>(if wait_for(&served_old, 31) {
            "new"
        } else {
            "gate timed out"
        })
    };
    let gate = std::sync::Mutex::new(Some(gate));
    let got = herd(32, |i| {
        let v = caches[i % 4]
            .get_or_set_with("hot", S(10), || {
                let loader = gate.lock().unwrap().take().expect("one loader call");
                loader().map(str::to_string)
            })
            .unwrap();
        if v == "old" {
            served_old.fetch_add(1, Ordering::SeqCst);
        }
        v
    });
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let fresh = got.iter().filter(|v| *v == "new").count();
    assert_eq!(fresh, 1, "only the claimant waits for the load: {got:?}");
    assert_eq!(served_old.load(Ordering::SeqCst), 31, "{got:?}");
    assert_eq!(
        caches[1].get::<String>("hot").unwrap().as_deref(),
        Some("new")
    );
}

fn loader_error_is_typed_and_nothing_is_cached(env: &Env) {
    let cache = env.cache();
    let e = cache
        .get_or_set_with::<String, _, _>("k", S(60), || Err(io::Error::other("db down")))
        .unwrap_err();
    let newcache::LoadError::Loader(typed) = &e else {
        panic!("the loader's error, typed: {e}")
    };
    assert_eq!(typed.to_string(), "db down");
    // `?` into newcache::Result: an is_loader error whose source is the loader's
    let e = newcache::Error::from(e);
    assert!(e.is_loader(), "{e}");
    let source = std::error::Error::source(&e).expect("the loader's error");
    assert_eq!(source.to_string(), "db down");
    assert!(source.downcast_ref::<io::Error>().is_some());
    assert_eq!(cache.get::<String>("k").unwrap(), None, "nothing cached");
    // the next call loads again
    let v = cache
        .get_or_set_with("k", S(60), || Ok::<_, io::Error>("ok".to_string()))
        .unwrap();
    assert_eq!(v, "ok");
    assert_eq!(cache.stats().loader_errors, 1);
}

/// A service's own error type, as a loader returns it.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
enum AppError {
    #[error("no such user")]
    NotFound,
}

/// A loader's `AppError::NotFound` comes back typed (no
/// `source()` downcast) to the caller and to the threads of this process that joined its load
/// (the same `Arc`); a follower whose loader has another error type gets the cache's
/// `is_loader()` error, its source the `AppError`; converted with `?` (into newcache's `Error`,
/// then anyhow), the `AppError` is still found by downcasting along the chain.
fn a_loaders_own_error_comes_back_typed_to_its_followers(env: &Env) {
    let cache = env.cache();
    let calls = AtomicUsize::new(0);
    let followers = 7;
    let results = herd(followers + 1, |i| {
        let load = || {
            calls.fetch_add(1, Ordering::SeqCst);
            // Hold the load until every other caller waits on it (a lease wait each).
            let deadline = Instant::now() + S(10);
            while (cache.stats().lease_waits as usize) < followers && Instant::now() < deadline {
                thread::sleep(MS(1));
            }
            Err(AppError::NotFound)
        };
        if i == 0 {
            // another error type, joining the load once it runs
            assert!(wait_for(&calls, 1), "the load started");
            let r = cache.get_or_set_with::<String, _, _>("user:7", S(60), || {
                load().map_err(|_| io::Error::other("never"))
            });
            Err(r.unwrap_err().into_cache_error())
        } else {
            Ok(cache.get_or_set_with::<String, _, _>("user:7", S(60), load))
        }
    });
    assert_eq!(calls.load(Ordering::SeqCst), 1, "one load");
    let mut typed: Vec<Arc<AppError>> = Vec::new();
    for r in results {
        match r {
            Ok(Err(newcache::LoadError::Loader(e))) => typed.push(e),
            Ok(other) => panic!("the loader's error, typed: {other:?}"),
            Err(e) => {
                // the follower with io::Error as its type: the cache's error, the AppError in it
                assert!(e.is_loader(), "{e}");
                let source = std::error::Error::source(&e).expect("the loader's error");
                assert_eq!(source.downcast_ref::<AppError>(), Some(&AppError::NotFound));
            }
        }
    }
    assert_eq!(
        typed.len(),
        followers,
        "the leader and its AppError followers"
    );
    assert!(typed.iter().all(|e| **e == AppError::NotFound));
    assert!(
        typed.windows(2).all(|w| Arc::ptr_eq(&w[0], &w[1])),
        "one shared error"
    );
    assert_eq!(
        cache.get::<String>("user:7").unwrap(),
        None,
        "nothing cached"
    );

    // `?` into newcache::Result, then into anyhow: the AppError is on the chain
    let via =
        |r: Result<String, newcache::LoadError<AppError>>| -> newcache::Result<String> { Ok(r?) };
    let e = via(cache.get_or_set_with("user:8", S(60), || Err(AppError::NotFound))).unwrap_err();
    assert!(e.is_loader(), "{e}");
    let source = std::error::Error::source(&e).expect("the loader's error");
    assert_eq!(source.downcast_ref::<AppError>(), Some(&AppError::NotFound));
    let any = anyhow::Error::from(e);
    assert_eq!(
        any.chain().find_map(|c| c.downcast_ref::<AppError>()),
        Some(&AppError::NotFound)
    );
    assert_eq!(
        format!("{any:#}"),
        "loader failed: the loader returned an error: no such user"
    );
    // a LoadError itself through anyhow: downcast to it, or find the AppError on the chain
    let r = cache.get_or_set_with::<String, _, _>("user:9", S(60), || Err(AppError::NotFound));
    let any = anyhow::Error::from(r.unwrap_err());
    let back = any
        .downcast_ref::<newcache::LoadError<AppError>>()
        .expect("a LoadError");
    assert_eq!(back.loader(), Some(&AppError::NotFound));
    assert_eq!(
        any.chain().find_map(|c| c.downcast_ref::<AppError>()),
        Some(&AppError::NotFound)
    );
    assert_eq!(format!("{any:#}"), "loader failed: no such user");
}

fn waiters_of_a_failed_load_get_the_error(env: &Env) {
    let cache = env.cache();
    let calls = AtomicUsize::new(0);
    let results = herd(16, |_| {
        cache.get_or_set_with::<String, _, _>("k", S(60), || {
            calls.fetch_add(1, Ordering::SeqCst);
            thread::sleep(MS(50));
            Err(io::Error::other("db down"))
        })
    });
    assert!(results.iter().all(|r| {
        r.as_ref()
            .is_err_and(|e| e.loader().is_some_and(|s| s.to_string() == "db down"))
    }));
    // In-process waiters share the failure; a caller that arrived after the lease was released
    // may load once more (serially, never as a herd).
    let n = calls.load(Ordering::SeqCst);
    assert!((1..=2).contains(&n), "{n} loads for 16 callers");
}

fn a_panicking_loader_leaves_no_one_waiting(env: &Env) {
    let cache = env.cache();
    let calls = AtomicUsize::new(0);
    let t0 = Instant::now();
    let results = herd(8, |i| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            cache
                .get_or_set_with("k", S(60), || {
                    let n = calls.fetch_add(1, Ordering::SeqCst);
                    thread::sleep(MS(30));
                    if n == 0 {
                        panic!("loader {i} panicked");
                    }
                    Ok::<_, io::Error>(format!("from {i}"))
                })
                .unwrap()
        }))
    });
    assert_eq!(
        results.iter().filter(|r| r.is_err()).count(),
        1,
        "only the panicking caller"
    );
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "one waiter retried and loaded"
    );
    assert!(
        // the lease is 5 s: a caller that waited for it to expire would take longer than this
        t0.elapsed() < S(4),
        "nobody waited for a lease to expire: {:?}",
        t0.elapsed()
    );
    let values: Vec<&String> = results.iter().flatten().collect();
    assert!(
        values.windows(2).all(|w| w[0] == w[1]),
        "everyone got the retry's value"
    );
}

/// A holder that died without releasing its placeholder: waiters poll until its claim runs out,
/// then exactly one of them takes over.
fn lease_takeover_after_a_dead_holder(env: &Env) {
    let cache = env.cache();
    let now = env.clock.now_ms();
    let dead = newcache::__private::placeholder(now, now + 1_000, 7);
    env.raw_set_ttl(&cache.make_key("k"), &dead, newcache::__private::FLAGS, 30);
    let calls = AtomicUsize::new(0);
    let clock_mover = || {
        thread::sleep(MS(100));
        env.advance(S(2));
    };
    let got = thread::scope(|s| {
        s.spawn(clock_mover);
        herd(8, |_| {
            cache
                .get_or_set_with("k", S(60), slow_loader(&calls, "v"))
                .unwrap()
        })
    });
    assert_eq!(calls.load(Ordering::SeqCst), 1, "one waiter took over");
    assert!(got.iter().all(|v| v == "v"));
    assert!(cache.stats().lease_waits >= 1);
}

/// A live holder that is slow: every caller gives up after max_wait with a wait-timeout error,
/// and none of them runs the loader.
fn wait_bound_is_an_error_not_a_second_load(env: &Env) {
    let cache = env.builder().max_wait(MS(150)).build_front(env.front);
    let now = env.clock.now_ms();
    let stuck = newcache::__private::placeholder(now, now + 30_000, 7);
    env.raw_set_ttl(&cache.make_key("k"), &stuck, newcache::__private::FLAGS, 30);
    let calls = AtomicUsize::new(0);
    let t0 = Instant::now();
    let got = herd(4, |_| {
        cache.get_or_set_with("k", S(60), || {
            calls.fetch_add(1, Ordering::SeqCst);
            Ok::<_, io::Error>(1u8)
        })
    });
    assert_eq!(
        calls.load(Ordering::SeqCst),
        0,
        "no loader runs under a live holder"
    );
    for r in &got {
        let e = r.as_ref().unwrap_err().cache().expect("the cache's error");
        assert!(e.is_wait_timeout() && !e.is_backend(), "{e}");
    }
    // gave up at max_wait (measured in whole milliseconds), not at once, and not much later
    let waited = t0.elapsed();
    assert!(waited >= MS(148) && waited < S(5), "{waited:?}");
    assert_eq!(cache.stats().wait_timeouts, 4);
}

/// A steady hot key: a read every 2 ms of (mock) time for 10 s, a 1 s ttl, a 20 ms loader. With
/// XFetch on, the key is refreshed before it goes stale; without it, every expiry is a miss.
fn early_refresh_keeps_a_hot_key_from_going_stale(env: &Env) {
    let run = |early: bool| {
        let b = env.builder().random_seed(42);
        let cache = if early { b.early_refresh(1.0) } else { b }.build_front(env.front);
        let loads = AtomicUsize::new(0);
        for _ in 0..5000 {
            cache
                .get_or_set_with(if early { "hot-early" } else { "hot" }, S(1), || {
                    loads.fetch_add(1, Ordering::SeqCst);
                    thread::sleep(MS(20));
                    Ok::<_, io::Error>(0u8)
                })
                .unwrap();
            env.advance(MS(2));
        }
        (cache.stats(), loads.load(Ordering::SeqCst))
    };
    let (plain, plain_loads) = run(false);
    assert!(plain.claims_won >= 9, "{plain:?}");
    assert_eq!(plain.early_refreshes, 0);
    let (early, early_loads) = run(true);
    assert!(early.early_refreshes >= 9, "{early:?}");
    assert_eq!(
        early.claims_won, early.early_refreshes,
        "every claim was early: never stale"
    );
    assert_eq!(early.stale_served, 0);
    assert!((9..=12).contains(&early_loads) && (9..=12).contains(&plain_loads));
}

fn early_refresh_draws_are_seeded(env: &Env) {
    // A seeded random source and a stepped clock: the refresh comes before the expiry, near it.
    let cache = env
        .builder()
        .early_refresh(2.0)
        .random_seed(7)
        .build_front(env.front);
    let slept = parking_lot::Mutex::new(MS(30));
    cache
        .get_or_set_with("k", S(1), || {
            // Recorded as the load time, XFetch's delta: real time, which a loaded machine
            // stretches (the bound below scales with what it was).
            let started = std::time::Instant::now();
            thread::sleep(MS(30));
            *slept.lock() = started.elapsed();
            Ok::<_, io::Error>(0u8)
        })
        .unwrap();
    let mut refreshed_at = None;
    for step in 1..=100u64 {
        env.advance(MS(10));
        let v = cache
            .get_or_set_with("k", S(60), || Ok::<_, io::Error>(1u8))
            .unwrap();
        if v == 1 {
            refreshed_at = Some(step);
            break;
        }
    }
    let st = cache.stats();
    let step = refreshed_at.expect("refreshed at some step");
    // With a 30 ms load, the draw of seed 7 refreshes in the last half second; a longer load
    // (the machine was busy) moves it earlier in proportion.
    let earliest = 100u64.saturating_sub(50 * slept.lock().as_millis() as u64 / 30);
    assert!(
        (earliest..100).contains(&step),
        "early, but near the 1 s expiry: {step} x 10 ms (load took {:?})",
        *slept.lock()
    );
    assert_eq!(
        (st.early_refreshes, st.claims_won, st.stale_served),
        (1, 1, 0)
    );
}

fn serve_stale_on_error_is_bounded(env: &Env) {
    let cache = env
        .builder()
        .serve_stale_on_error(S(30))
        .herd_timeout(S(5))
        .build_front(env.front);
    cache.set("k", "old", S(10)).unwrap();
    let failing = || Err::<String, _>(io::Error::other("db down"));
    env.advance(S(11));
    assert_eq!(
        cache.get_or_set_with("k", S(10), failing).unwrap(),
        "old",
        "age 11 s <= 30 s"
    );
    assert_eq!(cache.stats().stale_on_error, 1);
    // past the staleness bound (soft expiry + 5 s) the value is served to nobody else, but a
    // caller whose load fails still gets it, as long as it is younger than max_age
    env.advance(S(5));
    assert_eq!(cache.get::<String>("k").unwrap(), None, "past its bound");
    assert_eq!(
        cache.get_or_set_with("k", S(10), failing).unwrap(),
        "old",
        "age 16 s"
    );
    env.advance(S(20));
    let e = cache.get_or_set_with("k", S(10), failing).unwrap_err();
    assert!(e.loader().is_some(), "age 36 s > 30 s: {e}");
    // without the option the error comes back at once
    let strict = env.cache();
    strict.set("j", "old", S(10)).unwrap();
    env.advance(S(11));
    assert!(
        strict
            .get_or_set_with("j", S(10), failing)
            .unwrap_err()
            .loader()
            .is_some()
    );
}

fn background_refresh_returns_the_stale_value_at_once(env: &Env) {
    let cache = env.cache();
    cache.set("k", "old", S(10)).unwrap();
    env.advance(S(11));
    let calls = Arc::new(AtomicUsize::new(0));
    // The refresh cannot finish before all 16 callers have returned: each got the stale value
    // without waiting for it (no clock involved).
    let returned = Arc::new(AtomicUsize::new(0));
    let got = herd(16, |_| {
        let (calls, all) = (calls.clone(), returned.clone());
        let v = cache
            .get_or_set_with_background("k", S(10), move || {
                calls.fetch_add(1, Ordering::SeqCst);
                assert!(wait_for(&all, 16), "a caller waited for the refresh");
                Ok::<_, io::Error>("new".to_string())
            })
            .unwrap();
        returned.fetch_add(1, Ordering::SeqCst);
        v
    });
    assert!(got.iter().all(|v| v == "old"), "{got:?}");
    let deadline = Instant::now() + S(2);
    while cache.get::<String>("k").unwrap().as_deref() != Some("new") {
        assert!(
            Instant::now() < deadline,
            "the background refresh never landed"
        );
        thread::sleep(MS(10));
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

fn get_many_or_set_with_loads_once_for_missing_and_claimed(env: &Env) {
    let cache = env.cache();
    cache.set("fresh", &1u32, S(100)).unwrap();
    cache.set("stale", &2u32, S(10)).unwrap();
    env.advance(S(11));
    let mut asked: Vec<String> = Vec::new();
    let got = cache
        .get_many_or_set_with(&["fresh", "stale", "missing"], S(60), |keys| {
            asked = keys.to_vec();
            Ok::<_, io::Error>(keys.iter().map(|k| (k.clone(), 10u32)).collect())
        })
        .unwrap();
    asked.sort();
    assert_eq!(asked, ["missing", "stale"]);
    assert_eq!(
        got,
        HashMap::from([
            ("fresh".into(), 1),
            ("stale".into(), 10),
            ("missing".into(), 10)
        ])
    );
    assert_eq!(
        cache.get::<u32>("missing").unwrap(),
        Some(10),
        "written back"
    );
    assert_eq!(cache.get::<u32>("stale").unwrap(), Some(10));
    // all present: the loader is not called
    let got = cache
        .get_many_or_set_with(
            &["fresh", "missing"],
            Ttl::Default,
            |_| -> io::Result<HashMap<String, u32>> { panic!("nothing to load") },
        )
        .unwrap();
    assert_eq!(got.len(), 2);
}
