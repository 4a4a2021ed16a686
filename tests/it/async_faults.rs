//! Failures as the async front end reports them, beside the sync one: the same kinds, and
//! errors only on the keys whose server failed; and bursts of replies that are no failure.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use newcache::{AsyncCache, Cache, FailurePolicy, Ttl};

use crate::fixture::{Memcached, Relay, Twemproxy};

/// An `incr` sent to a server that stopped answering: both front ends say the outcome is
/// unknown (the counter may have moved; do not retry blindly).
#[test]
fn a_timed_out_incr_is_outcome_unknown_on_both_front_ends() {
    let server = Memcached::start();
    let addr = server.addr();
    let builder = || {
        Cache::builder()
            .memcached([addr.as_str()])
            .io_timeout(Duration::from_millis(300))
    };
    let sync = builder().build().unwrap();
    sync.set_counter("c", 5, Ttl::Never).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let asynch = builder().build_async().unwrap();
    rt.block_on(async { asynch.get_counter("c").await.unwrap() });
    server.signal("STOP");
    let a = rt.block_on(asynch.incr("c", 1)).unwrap_err();
    let s = sync.incr("c", 1).unwrap_err();
    server.signal("CONT");
    eprintln!(
        "async: {a} (timeout {}, unknown {})",
        a.is_timeout(),
        a.is_outcome_unknown()
    );
    eprintln!(
        "sync:  {s} (timeout {}, unknown {})",
        s.is_timeout(),
        s.is_outcome_unknown()
    );
    assert!(a.is_outcome_unknown());
    assert_eq!(
        s.is_outcome_unknown(),
        a.is_outcome_unknown(),
        "the same failure, reported differently"
    );
}

/// Compiled, not run: every AsyncCache future is Send, including with a loader that borrows.
#[allow(dead_code)]
fn every_future_is_send(c: newcache::AsyncCache) {
    use std::collections::HashMap;
    fn is_send<T: Send>(_: T) {}
    let s = Duration::from_secs(60);
    is_send(
        c.get_many_or_set_with(&["a"], s, |_m: Vec<String>| async move {
            Ok::<HashMap<String, u32>, std::io::Error>(HashMap::new())
        }),
    );
    is_send(c.clear());
    is_send(c.shutdown());
    is_send(c.incr("a", 1));
    is_send(c.get_counter("a"));
    is_send(c.set_with("a", &1u32, s, newcache::Herd::Off));
    let db = String::from("pool");
    is_send(c.get_or_set_with("k", s, || async { Ok::<_, std::io::Error>(db.len()) }));
    is_send(c.get_or_set_with_background("k", s, || async { Ok::<_, std::io::Error>(1u32) }));
    is_send(c.touch("k", s));
    is_send(c.set_counter("c", 1, s));
    is_send(c.decr("c", 1));
    is_send(c.get_many::<u32>(&["a"]));
    is_send(c.delete_many(&["a"]));
    is_send(c.set_many([("a", &1u32)], s));
}

/// get_many_or_set_with in a spawned task (an axum handler's future must be Send too).
#[tokio::test]
async fn get_many_or_set_with_in_a_spawned_task() {
    use std::collections::HashMap;
    let c = Cache::builder().in_memory().build_async().unwrap();
    let h = tokio::spawn(async move {
        c.get_many_or_set_with(
            &["a", "b"],
            Duration::from_secs(60),
            |missing: Vec<String>| async move {
                Ok::<_, std::io::Error>(
                    missing
                        .into_iter()
                        .map(|k| (k, 1u32))
                        .collect::<HashMap<_, _>>(),
                )
            },
        )
        .await
    });
    assert_eq!(h.await.unwrap().unwrap().len(), 2);
}

/// twemproxy in front of two memcached, one of them down (auto_eject_hosts off): twemproxy
/// answers that server's keys with `SERVER_ERROR Connection refused` and stays in step. Only
/// those keys fail: the pipelined connection stays up, and writes to the live server that
/// share it succeed.
#[test]
fn a_server_error_for_one_key_fails_only_that_key() {
    let (a, mut b) = (Memcached::start(), Memcached::start());
    let proxy = Twemproxy::start(
        &[a.addr(), b.addr()],
        &["auto_eject_hosts: false", "timeout: 2000"],
    );
    let addr = proxy.addr();
    let direct_b = Cache::builder()
        .memcached([b.addr().as_str()])
        .build()
        .unwrap();
    let sync = Cache::builder().memcached([addr.as_str()]).build().unwrap();
    // A key on each server.
    let (mut on_a, mut on_b) = (None, None);
    for i in 0..100 {
        let k = format!("k{i}");
        sync.set(&k, &1u32, Ttl::Never).unwrap();
        if direct_b.get::<u32>(&k).unwrap().is_some() {
            on_b.get_or_insert(k);
        } else {
            on_a.get_or_insert(k);
        }
    }
    let (on_a, on_b) = (on_a.unwrap(), on_b.unwrap());
    b.kill();
    let e = sync.get::<u32>(&on_b);
    eprintln!(
        "sync get of a key on the dead server (absorbed): {e:?}; stats {:?}",
        sync.stats().backend_errors
    );
    sync.set(&on_a, &2u32, Ttl::Never)
        .expect("sync: a write to the live server");

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let cache = Cache::builder()
        .memcached([addr.as_str()])
        .async_connections(1)
        .build_async()
        .unwrap();
    let mut collateral = 0;
    rt.block_on(async {
        for _ in 0..20 {
            let (dead, live) =
                tokio::join!(cache.get::<u32>(&on_b), cache.set(&on_a, &3u32, Ttl::Never));
            assert!(matches!(dead, Ok(None)), "absorbed: {dead:?}");
            if let Err(e) = live {
                eprintln!(
                    "a write to the live server failed: {e} (unknown {})",
                    e.is_outcome_unknown()
                );
                collateral += 1;
            }
        }
    });
    assert_eq!(
        collateral, 0,
        "writes to the live server failed for another key's SERVER_ERROR"
    );
}

/// A cache on one pipelined connection to `addr` that one transport fault ejects (for a
/// minute), its reads failing loudly: a batch that killed its connection shows in its own
/// result, in `stats()` and in the next call.
fn on_one_connection(addr: &str, io_timeout: Duration) -> AsyncCache {
    Cache::builder()
        .memcached([addr])
        .async_connections(1)
        .io_timeout(io_timeout)
        .failure_limit(1)
        .retry_interval(Duration::from_secs(60))
        .read_failures(FailurePolicy::Propagate)
        .build_async()
        .unwrap()
}

fn two_workers() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Reads a 40 KB value: the connection's reader keeps the buffer it grew for it, so that its
/// later reads take thousands of short replies at once.
async fn read_a_large_value(cache: &AsyncCache) {
    let large = "x".repeat(40 * 1024);
    cache.set("large", &large, Ttl::Never).await.unwrap();
    assert_eq!(cache.get::<String>("large").await.unwrap(), Some(large));
}

/// Nothing failed, and the server still serves the cache (one fault would have ejected it).
async fn still_healthy(cache: &AsyncCache) {
    assert_eq!(cache.stats().backend_errors, 0, "{:?}", cache.stats());
    cache
        .set("after", &1u32, Ttl::Never)
        .await
        .expect("the server is not ejected");
    assert_eq!(cache.get::<u32>("after").await.unwrap(), Some(1));
}

fn keys(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i}")).collect()
}

/// A batch's result, its error shown without the failed keys' list (100,000 of them).
#[track_caller]
fn ok<T>(r: newcache::Result<T>) -> T {
    r.unwrap_or_else(|e| {
        let mut chain = e.to_string();
        let mut cause = std::error::Error::source(&e);
        while let Some(c) = cause {
            chain = format!("{chain}: {c}");
            cause = c.source();
        }
        panic!(
            "{chain} (outcome unknown {}, timeout {})",
            e.is_outcome_unknown(),
            e.is_timeout()
        )
    })
}

/// After a large read, the replies to 20,000 deletes came faster
/// than the reader took their requests' expectations from the writer, and it killed the
/// connection for "bytes no request asked for" (most of the batch failed, outcome unknown, and
/// a fault counted against the server). The relay makes the burst certain.
#[test]
fn a_burst_of_short_replies_after_a_large_read_keeps_the_connection() {
    let server = Memcached::start();
    let relay = Relay::bursty(&server.addr());
    let cache = on_one_connection(&relay.addr(), Duration::from_secs(5));
    two_workers().block_on(async {
        read_a_large_value(&cache).await;
        assert_eq!(ok(cache.delete_many(&keys("absent", 20_000)).await), 0);
        still_healthy(&cache).await;
    });
}

/// The same batch sent to a server paused for 300 ms (well within `io_timeout`): its replies
/// come in bursts when it resumes.
#[test]
fn a_burst_of_replies_after_a_pause_keeps_the_connection() {
    let server = Memcached::start();
    let relay = Relay::bursty(&server.addr());
    let cache = Arc::new(on_one_connection(&relay.addr(), Duration::from_secs(3)));
    let rt = two_workers();
    rt.block_on(read_a_large_value(&cache));
    server.signal("STOP");
    let batch = rt.spawn({
        let cache = cache.clone();
        async move { cache.delete_many(&keys("absent", 20_000)).await }
    });
    std::thread::sleep(Duration::from_millis(300));
    server.signal("CONT");
    assert_eq!(ok(rt.block_on(batch).unwrap()), 0);
    rt.block_on(still_healthy(&cache));
}

/// Batches of 100,000 keys (set, get, delete) on one connection after a large read, straight
/// to memcached and through the relay (replies a few at a time, or thousands at once): each
/// succeeds whole, and the server is never blamed.
#[test]
fn batches_of_100k_keys_on_one_connection_succeed() {
    let server = Memcached::start();
    let relay = Relay::bursty(&server.addr());
    let n = 100_000;
    let keys = keys("k", n);
    let values: Vec<u32> = (0..n as u32).collect();
    for addr in [server.addr(), relay.addr()] {
        eprintln!("to {addr} (the relay is {})", relay.addr());
        let cache = on_one_connection(&addr, Duration::from_secs(5));
        two_workers().block_on(async {
            read_a_large_value(&cache).await;
            let failed = ok(cache.set_many(keys.iter().zip(&values), Ttl::Never).await);
            assert!(failed.is_empty(), "{} keys not stored", failed.len());
            let got: HashMap<String, u32> = ok(cache.get_many(&keys).await);
            assert_eq!(got.len(), n);
            assert!(keys.iter().zip(&values).all(|(k, v)| got.get(k) == Some(v)));
            assert_eq!(ok(cache.delete_many(&keys).await), n);
            let gone: HashMap<String, u32> = ok(cache.get_many(&keys).await);
            assert!(gone.is_empty(), "{} keys left", gone.len());
            still_healthy(&cache).await;
        });
    }
}

/// `io_timeout` bounds each round of a batch, counted from when that round was written, not
/// the whole batch: a get of 100,000 keys during which the server pauses four times for
/// 400 ms (1.6 s in all, past the 1 s `io_timeout`; each pause once more of the batch has been
/// answered) succeeds.
#[test]
fn a_batch_longer_than_io_timeout_succeeds_when_each_round_is_answered_in_time() {
    let server = Memcached::start();
    let io_timeout = Duration::from_secs(1);
    let cache = on_one_connection(&server.addr(), io_timeout);
    let rt = two_workers();
    let n = 100_000;
    let keys = keys("k", n);
    let values: Vec<u32> = (0..n as u32).collect();
    let failed = ok(rt.block_on(cache.set_many(keys.iter().zip(&values), Ttl::Never)));
    assert!(failed.is_empty());
    let done = AtomicBool::new(false);
    let pause = Duration::from_millis(400);
    let started = Instant::now();
    let (got, pauses) = std::thread::scope(|s| {
        let pauser = s.spawn(|| {
            let before = server.stat("cmd_get");
            let mut pauses = 0;
            for at in [10_000, 25_000, 40_000, 55_000] {
                while server.stat("cmd_get") - before < at {
                    if done.load(Ordering::Relaxed) {
                        return pauses;
                    }
                    std::thread::sleep(Duration::from_micros(200));
                }
                server.signal("STOP");
                std::thread::sleep(pause);
                server.signal("CONT");
                pauses += 1;
            }
            pauses
        });
        let got: newcache::Result<HashMap<String, u32>> = rt.block_on(cache.get_many(&keys));
        done.store(true, Ordering::Relaxed);
        (got, pauser.join().unwrap())
    });
    let elapsed = started.elapsed();
    eprintln!("a get of {n} keys with {pauses} pauses of {pause:?}: {elapsed:?}");
    let got = ok(got);
    assert_eq!(
        pauses, 4,
        "the batch ended before the server paused 4 times"
    );
    assert!(elapsed > io_timeout);
    assert_eq!(got.len(), n);
    assert!(keys.iter().zip(&values).all(|(k, v)| got.get(k) == Some(v)));
    rt.block_on(still_healthy(&cache));
}

/// The levels of an error's chain, as anyhow's `{:#}` joins them.
fn levels(e: &newcache::Error) -> Vec<String> {
    let mut out = vec![e.to_string()];
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        out.push(c.to_string());
        cause = c.source();
    }
    out
}

/// Each level of `e`'s chain says its part once: through anyhow's `{:#}`, the kind and the
/// server appear once, and no level repeats another's text. Returns that one line.
#[track_caller]
fn said_once(e: &newcache::Error, addr: &str) -> String {
    let line = format!("{:#}", anyhow::Error::from(e.clone()));
    assert_eq!(line, levels(e).join(": "));
    for phrase in ["backend error", "timed out:", addr] {
        assert!(
            line.matches(phrase).count() <= 1,
            "{phrase:?} twice: {line}"
        );
    }
    let levels = levels(e);
    for (i, a) in levels.iter().enumerate() {
        for b in &levels[i + 1..] {
            assert!(!a.contains(b.as_str()), "{a:?} repeats {b:?}: {line}");
        }
    }
    line
}

/// `{e}` alone says what failed and why (the server, and
/// that it could not connect or got no reply), anyhow's `{:#}` says each level once, and once
/// the server is marked dead its fail-fast error's source is the fault that marked it: a
/// refused connect and a hung server are told apart (`last_fault().is_timeout()`), on both
/// front ends.
#[test]
fn errors_say_what_failed_and_why_once_and_a_dead_server_its_last_fault() {
    use crate::fixture::unique_flavor;
    use crate::front::{BuildFor, Front};
    for front in [Front::Sync, Front::Async] {
        for hung in [false, true] {
            let mut server = Memcached::start();
            let addr = server.addr();
            let cache = Cache::builder()
                .memcached([addr.as_str()])
                .flavor(unique_flavor("why"))
                .read_failures(FailurePolicy::Propagate)
                .connect_timeout(Duration::from_millis(500))
                .io_timeout(Duration::from_millis(200))
                .failure_limit(2)
                .retry_interval(Duration::from_secs(60))
                .build_front(front);
            let case = format!("{front:?}, hung {hung}");
            if hung {
                server.signal("STOP");
            } else {
                server.kill(); // a closed port: every connect is refused
            }
            let first = cache.get::<String>("k").unwrap_err();
            let shown = first.to_string();
            assert!(shown.contains(&addr), "{case}: {shown}");
            if hung {
                assert!(first.is_timeout(), "{case}: {shown}");
                assert!(shown.contains("no reply"), "{case}: {shown}");
            } else {
                assert!(first.is_backend() && !first.is_timeout(), "{case}: {shown}");
                assert!(shown.contains("could not connect"), "{case}: {shown}");
                let line = said_once(&first, &addr);
                assert!(line.to_lowercase().contains("refused"), "{case}: {line}");
            }
            said_once(&first, &addr);
            // the second fault marks it dead; the next call fails fast
            let _ = cache.get::<String>("k").unwrap_err();
            let dead = cache.get::<String>("k").unwrap_err();
            let line = said_once(&dead, &addr);
            assert!(dead.to_string().contains("marked dead"), "{case}: {line}");
            let fault = std::error::Error::source(&dead)
                .and_then(|s| s.downcast_ref::<newcache::Error>())
                .unwrap_or_else(|| panic!("{case}: the last fault is the source: {line}"));
            assert!(
                std::ptr::eq(dead.last_fault().expect("last_fault"), fault),
                "{case}"
            );
            assert_eq!(fault.is_timeout(), hung, "{case}: {line}");
            assert!(
                line.contains(if hung {
                    "no reply"
                } else {
                    "could not connect"
                }),
                "{case}: {line}"
            );
            eprintln!(
                "{case}:\n  {first}\n  {:#}\n  {line}",
                anyhow::Error::from(first.clone())
            );
            if hung {
                server.signal("CONT");
            }
        }
    }
}
