//! What only the Redis backend has, on Debian's Redis 7 and Valkey 9, each on a server of the
//! test's own: faults (a killed, hung and restarted server), `clear` by the cache's prefix,
//! values another client wrote, the eviction policy check. The behaviour, herd, limits, loader,
//! values and obs suites run on both servers through `on_every_backend!`.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use newcache::{
    Backend, Cache, DecodePolicy, FailurePolicy, RedisBackend, RedisConfig, StoreMode, Ttl,
};

use crate::fixture::{RedisServer, unique_flavor, valkey_server};
use crate::front::{BuildFor, Front};

const S: fn(u64) -> Duration = Duration::from_secs;

/// Runs `test` on a Redis 7 of its own, then on a Valkey 9 of its own.
pub(crate) fn on_both(test: impl Fn(&mut RedisServer)) {
    for bin in ["redis-server".to_owned(), valkey_server()] {
        let mut server = RedisServer::start(&bin);
        test(&mut server);
    }
}

fn cache_on(server: &RedisServer) -> Cache {
    Cache::builder()
        .redis(server.url())
        .flavor(unique_flavor("redis"))
        .io_timeout(Duration::from_millis(300))
        .retry_interval(Duration::from_millis(200))
        .build()
        .unwrap()
}

pub(crate) fn raw(server: &RedisServer) -> redis::Connection {
    redis::Client::open(server.url())
        .and_then(|c| c.get_connection())
        .unwrap()
}

#[test]
fn a_killed_server_fails_fast_and_serves_again_once_restarted() {
    on_both(|server| {
        let cache = cache_on(server);
        cache.set("k", &1u32, S(60)).unwrap();
        server.kill();
        // Past the 100 ms after which a write's pooled connection answers a `PING` first: the
        // connection the kill closed is found so before the write is sent (not a fault, nothing
        // sent). A longer wait (a loaded machine) changes nothing.
        std::thread::sleep(Duration::from_millis(200));
        // Two transport faults (refused connects) mark it dead (failure_limit 2); then calls
        // fail fast.
        for _ in 0..2 {
            assert!(cache.set("k", &2u32, S(60)).unwrap_err().is_backend());
        }
        let started = Instant::now();
        let e = cache.set("k", &2u32, S(60)).unwrap_err();
        assert!(e.is_backend(), "{e}");
        assert!(e.to_string().contains("redis at"), "{e}");
        assert!(e.to_string().contains("marked dead"), "{e}");
        assert!(started.elapsed() < Duration::from_millis(100), "fails fast");
        server.restart();
        // After retry_interval a probe brings it back (empty: the restart lost the data).
        let deadline = Instant::now() + S(10);
        loop {
            match cache.set("k", &3u32, S(60)) {
                Ok(()) => break,
                Err(e) => assert!(Instant::now() < deadline, "never back: {e}"),
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(cache.get::<u32>("k").unwrap(), Some(3));
    });
}

/// A server that accepts connections but never answers costs a sync connect one
/// `connect_timeout`, its set-up included: redis-rs's `CLIENT SETINFO` (two replies, each read
/// within the whole timeout) once made it two.
#[test]
fn a_hung_server_costs_a_fresh_connect_one_connect_timeout() {
    on_both(|server| {
        let cache = Cache::builder()
            .redis(server.url())
            .flavor(unique_flavor("redis"))
            .read_failures(newcache::FailurePolicy::Propagate)
            .connect_timeout(S(2))
            .io_timeout(S(20))
            .build()
            .unwrap();
        server.signal("STOP");
        let started = Instant::now();
        let e = cache.get::<u32>("k").unwrap_err();
        let took = started.elapsed();
        server.signal("CONT");
        assert!(e.is_timeout(), "{e}");
        // 2 s, with 1.5 s of slack for a loaded machine (two of them took 4 s).
        assert!(took < S(2) + Duration::from_millis(1500), "{took:?}: {e}");
        assert_eq!(cache.get::<u32>("k").unwrap(), None, "back once it answers");
    });
}

/// The URL's database holds the cache's keys, on both views (the sync pool selects it itself,
/// after redis-rs's `AUTH`); a database the server does not have is a clear error.
#[test]
fn the_urls_database_holds_the_cache_keys_and_a_missing_one_is_a_clear_error() {
    on_both(|server| {
        let url = server
            .url()
            .replace("redis://", "redis://:pw@")
            .replace("/0", "/2");
        let mut admin = redis::Client::open(server.url())
            .and_then(|c| c.get_connection_with_timeout(S(5)))
            .unwrap();
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("requirepass")
            .arg("pw")
            .query(&mut admin)
            .unwrap();
        let cache = Cache::builder()
            .redis(url.as_str())
            .flavor(unique_flavor("redis-db"))
            .build()
            .unwrap();
        let async_cache = Cache::builder()
            .redis(url.as_str())
            .flavor(unique_flavor("redis-db-async"))
            .build_async()
            .unwrap();
        cache.set("k", &1u32, S(60)).unwrap();
        runtime().block_on(async { async_cache.set("k", &2u32, S(60)).await.unwrap() });
        let mut exists = |db: i64, key: &str| -> bool {
            let () = redis::cmd("SELECT").arg(db).query(&mut admin).unwrap();
            redis::cmd("EXISTS")
                .arg(key)
                .query::<i64>(&mut admin)
                .unwrap()
                == 1
        };
        for key in [cache.make_key("k"), async_cache.make_key("k")] {
            assert!(exists(2, &key), "{key} is in database 2");
            assert!(!exists(0, &key), "{key} is not in database 0");
        }
        assert_eq!(cache.get::<u32>("k").unwrap(), Some(1));
        let missing = Cache::builder()
            .redis(url.replace("/2", "/99"))
            .flavor(unique_flavor("redis-db"))
            .read_failures(FailurePolicy::Propagate)
            .build()
            .unwrap();
        let e = missing.get::<u32>("k").unwrap_err();
        assert!(
            e.to_string().contains("refused the URL's database 99"),
            "{e}"
        );
        assert!(missing.ping().is_err());
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("requirepass")
            .arg("")
            .query(&mut admin)
            .unwrap();
    });
}

#[test]
fn a_hung_server_costs_one_io_timeout_per_call_and_recovers() {
    on_both(|server| {
        let cache = cache_on(server);
        cache.set("k", &1u32, S(60)).unwrap();
        server.signal("STOP");
        let started = Instant::now();
        let e = cache.set("k", &2u32, S(60)).unwrap_err();
        assert!(e.is_timeout(), "{e}");
        assert!(e.is_outcome_unknown(), "a write without its reply: {e}");
        assert!(e.to_string().contains("queued for replay"), "{e}");
        // A generous bound: one io_timeout (300 ms), not a hang.
        assert!(started.elapsed() < S(3), "{:?}", started.elapsed());
        server.signal("CONT");
        let deadline = Instant::now() + S(10);
        loop {
            match cache.get::<u32>("k") {
                Ok(v) => {
                    // The timed-out set may have landed after all: its key was deleted
                    // before anything else was read there (neither 1 nor 2 is trusted).
                    assert_eq!(v, None);
                    break;
                }
                Err(e) => assert!(Instant::now() < deadline, "never back: {e}"),
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    });
}

#[test]
fn clear_removes_this_caches_keys_and_nothing_else() {
    on_both(|server| {
        let cache = cache_on(server);
        let other = Cache::builder()
            .redis(server.url())
            .flavor(unique_flavor("other"))
            .build()
            .unwrap();
        let newer = cache.with_version(2);
        for i in 0..2_500 {
            cache.set(&format!("k{i}"), &i, S(60)).unwrap();
        }
        other.set("k1", &1u32, S(60)).unwrap();
        newer.set("k1", &1u32, S(60)).unwrap();
        let () = redis::cmd("SET")
            .arg("someone-elses")
            .arg("x")
            .query(&mut raw(server))
            .unwrap();
        cache.clear().unwrap();
        assert_eq!(cache.get::<u32>("k1").unwrap(), None);
        assert_eq!(cache.get::<u32>("k2499").unwrap(), None);
        assert_eq!(
            other.get::<u32>("k1").unwrap(),
            Some(1),
            "another flavor stays"
        );
        assert_eq!(
            newer.get::<u32>("k1").unwrap(),
            Some(1),
            "another version stays"
        );
        let theirs: Option<String> = redis::cmd("GET")
            .arg("someone-elses")
            .query(&mut raw(server))
            .unwrap();
        assert_eq!(theirs.as_deref(), Some("x"), "another client's key stays");
        let custom = Cache::builder()
            .redis(server.url())
            .key_function(|_, _, k| k.to_owned())
            .build()
            .unwrap();
        assert!(custom.clear().unwrap_err().is_unsupported());
    });
}

#[test]
fn a_value_another_client_wrote_is_a_decode_error_and_a_loader_can_replace_it() {
    on_both(|server| {
        let cache = cache_on(server);
        let key = cache.make_key("k");
        let () = redis::cmd("SET")
            .arg(&key)
            .arg("plain text")
            .query(&mut raw(server))
            .unwrap();
        assert!(cache.get::<u32>("k").unwrap_err().is_decode());
        // Under DecodePolicy::Miss a loader replaces exactly that foreign value.
        let miss = Cache::builder()
            .redis(server.url())
            .key_function({
                let key = key.clone();
                move |_, _, _| key.clone()
            })
            .decode_policy(DecodePolicy::Miss)
            .build()
            .unwrap();
        let v: u32 = miss
            .get_or_set_with("anything", S(60), || Ok::<_, std::io::Error>(7))
            .unwrap();
        assert_eq!(v, 7);
        assert_eq!(miss.get::<u32>("anything").unwrap(), Some(7));
    });
}

#[test]
fn a_noeviction_policy_is_warned_about_once() {
    on_both(|server| {
        let cache = cache_on(server);
        let logs = crate::obs::logs_at(tracing::Level::WARN, || {
            cache.set("a", &1u32, S(60)).unwrap();
            cache.set("b", &1u32, S(60)).unwrap();
        });
        assert_eq!(
            logs.matches("maxmemory-policy is noeviction").count(),
            1,
            "{logs}"
        );
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory-policy")
            .arg("allkeys-lru")
            .query(&mut raw(server))
            .unwrap();
        let fine = cache_on(server);
        let logs = crate::obs::logs_at(tracing::Level::WARN, || {
            fine.set("a", &1u32, S(60)).unwrap();
        });
        assert!(!logs.contains("maxmemory-policy"), "{logs}");
    });
}

/// A read on a pooled connection the server closed is asked again on a fresh one; a write is
/// sent only on a connection known to be open (one idle a while answers a `PING` first), so
/// it goes on a fresh one too, never outcome-unknown (a reply lost after a write was sent is:
/// `a_write_whose_reply_was_lost_fails_outcome_unknown_and_is_never_sent_again`). Neither
/// counts a fault: with `failure_limit(1)`, one would mark the server dead.
#[test]
fn a_connection_the_server_closed_while_idle_is_replaced_without_a_fault() {
    on_both(|server| {
        let cache = Cache::builder()
            .redis(server.url())
            .read_failures(FailurePolicy::Propagate)
            .failure_limit(1)
            .build()
            .unwrap();
        // Several pooled connections.
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..50 {
                        cache.set("k", &1u32, S(60)).unwrap();
                    }
                });
            }
        });
        // The server closes clients idle for a second (its `timeout`, as managed services set).
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("timeout")
            .arg("1")
            .query(&mut raw(server))
            .unwrap();
        std::thread::sleep(Duration::from_millis(2500));
        for _ in 0..4 {
            assert_eq!(cache.get::<u32>("k").unwrap(), Some(1));
        }
        // After a restart too: the first write goes through (the pooled connections the
        // restart closed are found so before it is sent), and is not outcome-unknown.
        server.restart();
        // A restart takes seconds in earnest; this one may take milliseconds, and a write on
        // a connection idle less than 100 ms is sent without a `PING` first (a closed one
        // then fails it outcome-unknown): idle past that (a longer wait changes nothing).
        std::thread::sleep(Duration::from_millis(200));
        cache.set("k", &2u32, S(60)).unwrap();
        assert_eq!(cache.get::<u32>("k").unwrap(), Some(2));
        cache.set("k", &3u32, S(60)).unwrap();
        assert_eq!(cache.get::<u32>("k").unwrap(), Some(3));
        // And a read after a restart is asked again.
        server.restart();
        assert_eq!(cache.get::<u32>("k").unwrap(), None);
    });
}

#[test]
fn a_password_in_the_url_is_never_printed() {
    let config = RedisConfig::new("redis://user:s3cret@127.0.0.1:1/0");
    assert!(!format!("{config:?}").contains("s3cret"), "{config:?}");
    for url in [
        "redis://user:s3cret@127.0.0.1:notaport/0",
        "rediss://user:s3cret@127.0.0.1:1/0#insecure",
        "redis+unix://user:s3cret@127.0.0.1:1/0",
    ] {
        let e = Cache::builder().redis(url).build().unwrap_err();
        assert!(e.is_config(), "{e}");
        assert!(!e.to_string().contains("s3cret"), "{e}");
        assert!(!format!("{e:?}").contains("s3cret"), "{e:?}");
    }
    // A cache on it names the server by host and port only.
    let cache = Cache::builder()
        .redis("redis://user:s3cret@127.0.0.1:1/0")
        .connect_timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    let e = cache.set("k", &1u32, S(60)).unwrap_err();
    assert!(!e.to_string().contains("s3cret"), "{e}");
    assert!(!format!("{cache:?}").contains("s3cret"));
}

#[test]
fn clear_leaves_a_flavor_that_starts_like_this_one() {
    on_both(|server| {
        let app = Cache::builder()
            .redis(server.url())
            .flavor("app")
            .build()
            .unwrap();
        let app1 = Cache::builder()
            .redis(server.url())
            .flavor("app-1")
            .build()
            .unwrap();
        app.set("k", &1u32, S(60)).unwrap();
        app1.set("k", &1u32, S(60)).unwrap();
        app.clear().unwrap();
        assert_eq!(app.get::<u32>("k").unwrap(), None);
        assert_eq!(
            app1.get::<u32>("k").unwrap(),
            Some(1),
            "app's clear took app-1's key"
        );
    });
}

#[test]
fn bytes_that_look_like_an_item_with_stamp_zero_are_foreign() {
    let server = RedisServer::start("redis-server");
    let b = RedisBackend::new(RedisConfig::new(server.url())).unwrap();
    let mut bytes = vec![0xA1u8];
    bytes.extend_from_slice(&[0u8; 12]);
    let () = redis::cmd("SET")
        .arg("z")
        .arg(&bytes)
        .query(&mut raw(&server))
        .unwrap();
    let item = b.get("z").unwrap().unwrap();
    assert_eq!(item.value.len(), 13, "read whole, as foreign bytes");
    assert_ne!(item.cas, 0);
    // Its token replaces exactly it; token 0 is refused before anything is sent.
    assert!(
        b.store(newcache::Write::new(StoreMode::Cas(0), "z", b"x", 0, 0))
            .unwrap_err()
            .is_unsupported()
    );
    assert_eq!(
        b.store(newcache::Write::new(
            StoreMode::Cas(item.cas),
            "z",
            b"mine",
            0,
            0
        ))
        .unwrap(),
        newcache::StoreOutcome::Stored
    );
    assert_eq!(&b.get("z").unwrap().unwrap().value[..], b"mine");
}

pub(crate) fn async_cache_on(server: &RedisServer) -> newcache::AsyncCache {
    Cache::builder()
        .redis(server.url())
        .flavor(unique_flavor("redis-async"))
        .io_timeout(Duration::from_millis(300))
        .connect_timeout(Duration::from_millis(300))
        .retry_interval(Duration::from_millis(200))
        .read_failures(FailurePolicy::Propagate)
        .build_async()
        .unwrap()
}

/// A 2-worker multi-thread runtime (the redis-tls suite's too).
pub(crate) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn a_read_that_times_out_is_not_outcome_unknown_and_a_write_is() {
    on_both(|server| {
        let mut config = RedisConfig::new(server.url());
        config.io_timeout = Duration::from_millis(300);
        let b = RedisBackend::new(config).unwrap();
        b.store(newcache::Write::new(StoreMode::Set, "k", b"v", 0, 0))
            .unwrap();
        server.signal("STOP");
        // The write on the open pooled connection: sent, no reply.
        let write = b
            .store(newcache::Write::new(StoreMode::Set, "k", b"w", 0, 0))
            .unwrap_err();
        // The read: on a new connection, whose set-up gets no reply either.
        let read = b.get("k").unwrap_err();
        server.signal("CONT");
        assert!(read.is_timeout() && !read.is_outcome_unknown(), "{read}");
        assert!(write.is_outcome_unknown(), "{write}");
    });
}

#[test]
fn async_calls_on_a_hung_server_time_out_as_one_fault_and_recover() {
    on_both(|server| {
        let cache = async_cache_on(server);
        runtime().block_on(async {
            cache.set("k", &1u32, S(60)).await.unwrap();
            server.signal("STOP");
            let started = Instant::now();
            let waiters: Vec<_> = (0..50)
                .map(|_| {
                    let c = cache.clone();
                    tokio::spawn(async move { c.get::<u32>("k").await })
                })
                .collect();
            for w in waiters {
                let e = w.await.unwrap().unwrap_err();
                assert!(e.is_backend() || e.is_timeout(), "{e}");
                assert!(!e.is_outcome_unknown(), "a read: {e}");
            }
            // One io_timeout for all of them (a generous bound), not one each.
            assert!(started.elapsed() < S(5), "{:?}", started.elapsed());
            // 50 waiters on one connection are one fault: the server is not dead yet, the
            // next call tries it again (and times out: still stopped).
            let e = cache.get::<u32>("k").await.unwrap_err();
            assert!(!e.to_string().contains("marked dead"), "{e}");
            server.signal("CONT");
            let deadline = Instant::now() + S(10);
            loop {
                match cache.get::<u32>("k").await {
                    Ok(v) => break assert_eq!(v, Some(1)),
                    Err(e) => assert!(Instant::now() < deadline, "never back: {e}"),
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
    });
}

#[test]
fn async_calls_fail_fast_on_a_killed_server_and_serve_once_it_is_restarted() {
    on_both(|server| {
        let cache = async_cache_on(server);
        let rt = runtime();
        rt.block_on(async { cache.set("k", &1u32, S(60)).await.unwrap() });
        server.kill();
        rt.block_on(async {
            for _ in 0..2 {
                assert!(cache.set("k", &2u32, S(60)).await.is_err());
            }
            let e = cache.set("k", &2u32, S(60)).await.unwrap_err();
            assert!(e.to_string().contains("redis at"), "{e}");
            assert!(e.to_string().contains("marked dead"), "{e}");
        });
        server.restart();
        rt.block_on(async {
            let deadline = Instant::now() + S(10);
            loop {
                match cache.set("k", &3u32, S(60)).await {
                    Ok(()) => break,
                    Err(e) => assert!(Instant::now() < deadline, "never back: {e}"),
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            assert_eq!(cache.get::<u32>("k").await.unwrap(), Some(3));
        });
    });
}

#[test]
fn dropped_async_calls_never_cross_replies() {
    on_both(|server| {
        let cache = async_cache_on(server);
        runtime().block_on(async {
            for i in 0..200u32 {
                cache.set(&format!("k{i}"), &i, S(60)).await.unwrap();
            }
            for round in 0..400u32 {
                let c = cache.clone();
                let k = format!("k{}", round % 200);
                let dropped = tokio::spawn(async move { c.get::<u32>(&k).await });
                if round % 2 == 0 {
                    tokio::task::yield_now().await;
                    dropped.abort();
                }
                let next = (round + 1) % 200;
                let v = cache.get::<u32>(&format!("k{next}")).await.unwrap();
                assert_eq!(v, Some(next), "round {round}");
            }
        });
    });
}

#[test]
fn an_async_cache_moves_to_a_new_runtime_when_its_first_one_ends() {
    on_both(|server| {
        let cache = async_cache_on(server);
        for i in 0..5u32 {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                cache.set("k", &i, S(60)).await.unwrap();
                assert_eq!(cache.get::<u32>("k").await.unwrap(), Some(i));
            });
        }
    });
}

/// An invalidation another client makes while a load runs (`DEL`, or a `SET` of its own bytes,
/// as from `redis-cli`) is never overwritten by that load's store: on a cold key (the load
/// holds a placeholder) and on a stale one (it holds a claim over the old value).
#[test]
fn an_invalidation_by_another_client_during_a_load_is_never_overwritten() {
    on_both(|server| {
        let cache = cache_on(server);
        for stale in [false, true] {
            for by_set in [false, true] {
                let k = format!("k-{stale}-{by_set}");
                let key = cache.make_key(&k);
                if stale {
                    // Fresh for 1 s of a 60 s life; the cache's clock moves past it.
                    cache.set(&k, &1u32, Duration::from_secs(1)).unwrap();
                    std::thread::sleep(Duration::from_millis(1_100));
                }
                let v: u32 = cache
                    .get_or_set_with(&k, S(60), || {
                        let mut c = raw(server);
                        if by_set {
                            let () = redis::cmd("SET")
                                .arg(&key)
                                .arg("theirs")
                                .query(&mut c)
                                .unwrap();
                        } else {
                            let _: i64 = redis::cmd("DEL").arg(&key).query(&mut c).unwrap();
                        }
                        Ok::<_, std::io::Error>(2)
                    })
                    .unwrap();
                assert_eq!(v, 2, "the caller gets what it loaded");
                let held: Option<Vec<u8>> =
                    redis::cmd("GET").arg(&key).query(&mut raw(server)).unwrap();
                match by_set {
                    true => assert_eq!(
                        held.as_deref(),
                        Some(&b"theirs"[..]),
                        "stale {stale}: their SET stays"
                    ),
                    false => assert_eq!(held, None, "stale {stale}: their DEL stays"),
                }
            }
        }
    });
}

/// What `clear()` costs, as the docs say: it walks the whole database, one `SCAN` round
/// trip per step of about 1,000 keys (this cache's or not), and one `UNLINK` per step that found
/// some of its keys; the other keys stay.
#[test]
fn clear_walks_the_database_a_thousand_keys_a_step() {
    let server = RedisServer::start("redis-server");
    let cache = cache_on(&server);
    let mut c = raw(&server);
    let mut pipe = redis::pipe();
    for i in 0..20_000 {
        pipe.cmd("SET").arg(format!("other:{i}")).arg("x").ignore();
    }
    let () = pipe.query(&mut c).unwrap();
    for i in 0..500 {
        cache.set(&format!("k{i}"), &i, S(60)).unwrap();
    }
    let () = redis::cmd("CONFIG").arg("RESETSTAT").query(&mut c).unwrap();
    let t = Instant::now();
    cache.clear().unwrap();
    let took = t.elapsed();
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut c)
        .unwrap();
    let calls = |cmd: &str| -> u64 {
        stats
            .lines()
            .find_map(|l| l.strip_prefix(&format!("cmdstat_{cmd}:calls=")))
            .and_then(|rest| rest.split(',').next())
            .map_or(0, |n| n.parse().unwrap())
    };
    let (scans, unlinks) = (calls("scan"), calls("unlink"));
    eprintln!("clear() of 500 keys among 20,500: {scans} SCAN, {unlinks} UNLINK, {took:?}");
    assert!(
        (20..=30).contains(&scans),
        "{scans} SCAN calls for 20,500 keys"
    );
    assert!((1..=scans).contains(&unlinks), "{unlinks} UNLINK calls");
    let left: u64 = redis::cmd("DBSIZE").query(&mut c).unwrap();
    assert_eq!(left, 20_000, "only the cache's keys went");
}

#[cfg(not(feature = "redis-tls"))]
#[test]
fn a_rediss_url_without_the_tls_feature_names_the_feature() {
    let e = Cache::builder()
        .redis("rediss://user:s3cret@127.0.0.1:1/0")
        .build()
        .unwrap_err();
    assert!(
        e.is_config() && e.to_string().contains("`redis-tls`"),
        "{e}"
    );
    assert!(!e.to_string().contains("s3cret"), "{e}");
}

/// Creates ACL user `user` with password `secret` and the rules `rules` (after `on`).
fn acl_user(server: &RedisServer, user: &str, rules: &[&str]) {
    let () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg(user)
        .arg("on")
        .arg(">secret")
        .arg(rules)
        .query(&mut raw(server))
        .unwrap();
}

fn as_user(server: &RedisServer, user: &str, password: &str) -> newcache::CacheBuilder {
    Cache::builder()
        .redis(format!(
            "redis://{user}:{password}@127.0.0.1:{}/0",
            server.port
        ))
        .flavor(unique_flavor("acl"))
        .retry_interval(Duration::from_millis(200))
        .read_failures(FailurePolicy::Propagate)
}

#[test]
fn an_acl_user_in_the_url_works_sync_and_async() {
    on_both(|server| {
        acl_user(server, "newcache-user", &["~*", "&*", "+@all"]);
        let cache = as_user(server, "newcache-user", "secret").build().unwrap();
        cache.set("k", &1u32, S(60)).unwrap();
        assert_eq!(cache.get::<u32>("k").unwrap(), Some(1));
        let v: u32 = cache
            .get_or_set_with("loaded", S(60), || Ok::<_, std::io::Error>(2))
            .unwrap();
        assert_eq!(v, 2);
        let cache = as_user(server, "newcache-user", "secret")
            .build_async()
            .unwrap();
        runtime().block_on(async {
            cache.set("k", &3u32, S(60)).await.unwrap();
            assert_eq!(cache.get::<u32>("k").await.unwrap(), Some(3));
            let v: u32 = cache
                .get_or_set_with("loaded", S(60), || async { Ok::<_, std::io::Error>(4) })
                .await
                .unwrap();
            assert_eq!(v, 4);
        });
    });
}

#[test]
fn a_wrong_password_is_denied_without_marking_the_server_dead_or_printing_it() {
    on_both(|server| {
        acl_user(server, "newcache-user", &["~*", "&*", "+@all"]);
        let check = |e: newcache::Error| {
            assert!(e.is_denied() && e.is_backend(), "{e}");
            assert!(e.to_string().contains("user and password"), "{e}");
            // failure_limit is 2: a fault each time would have marked it dead by the third.
            assert!(!e.to_string().contains("marked dead"), "{e}");
            assert!(!format!("{e} {e:?}").contains("n0t-the-s3cret"), "{e:?}");
        };
        let cache = as_user(server, "newcache-user", "n0t-the-s3cret")
            .build()
            .unwrap();
        for _ in 0..4 {
            check(cache.get::<u32>("k").unwrap_err());
        }
        let cache = as_user(server, "newcache-user", "n0t-the-s3cret")
            .build_async()
            .unwrap();
        runtime().block_on(async {
            for _ in 0..4 {
                check(cache.get::<u32>("k").await.unwrap_err());
            }
        });
    });
}

/// RESP3 (`protocol=resp3`): the credentials go in `HELLO`, which newcache sends itself on a
/// sync connect (redis-rs on an async one). The right ones work; a wrong password is the same
/// denial as RESP2's `AUTH`, the server not marked dead, the password never shown.
#[test]
fn resp3_credentials_in_hello_work_and_a_wrong_password_is_denied() {
    on_both(|server| {
        acl_user(server, "newcache-user", &["~*", "&*", "+@all"]);
        let builder = |password: &str| {
            Cache::builder()
                .redis(format!(
                    "redis://newcache-user:{password}@127.0.0.1:{}/0?protocol=resp3",
                    server.port
                ))
                .flavor(unique_flavor("acl-resp3"))
                .retry_interval(Duration::from_millis(200))
                .read_failures(FailurePolicy::Propagate)
        };
        let cache = builder("secret").build().unwrap();
        cache.set("k", &7u32, S(60)).unwrap();
        assert_eq!(cache.get::<u32>("k").unwrap(), Some(7));
        assert_eq!(cache.get_many::<u32>(&["k", "none"]).unwrap().len(), 1);
        let check = |e: newcache::Error| {
            assert!(e.is_denied() && e.is_backend(), "{e}");
            assert!(e.to_string().contains("user and password"), "{e}");
            assert!(!e.to_string().contains("marked dead"), "{e}");
            assert!(!format!("{e} {e:?}").contains("n0t-the-s3cret"), "{e:?}");
        };
        let bad = builder("n0t-the-s3cret").build().unwrap();
        for _ in 0..4 {
            check(bad.get::<u32>("k").unwrap_err());
        }
        let bad = builder("n0t-the-s3cret").build_async().unwrap();
        runtime().block_on(async {
            for _ in 0..4 {
                check(bad.get::<u32>("k").await.unwrap_err());
            }
        });
    });
}

/// A server that answers every command of a connection with `reply` (a stand-in for a proxy or
/// a server that refuses RESP3's `HELLO` for another reason than the credentials: no real
/// Redis 7 does); its port.
fn answering_every_command_with(reply: &'static str) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = conn.read(&mut buf) {
                    if n == 0 || conn.write_all(reply.as_bytes()).is_err() {
                        return;
                    }
                }
            });
        }
    });
    port
}

/// A `HELLO` refused for another reason than the credentials (`NOPROTO`, a proxy's error) is
/// the server's answer with its words, not "a wrong password", and not a fault; a password the
/// refusal echoes is hidden.
#[test]
fn a_hello_refused_for_another_reason_says_so_and_is_no_fault() {
    for (reply, says) in [
        (
            "-NOPROTO sorry, this protocol version is not supported\r\n",
            "refused HELLO (NOPROTO sorry",
        ),
        (
            "-ERR unknown command 'HELLO', with args beginning with: '3' 'AUTH' 'u' 'n0t-the-s3cret'\r\n",
            "does not know HELLO",
        ),
        (
            "-ERR proxy says no to 'n0t-the-s3cret'\r\n",
            "refused HELLO (ERR proxy says no to '***')",
        ),
    ] {
        let port = answering_every_command_with(reply);
        let cache = Cache::builder()
            .redis(format!(
                "redis://u:n0t-the-s3cret@127.0.0.1:{port}/0?protocol=resp3"
            ))
            .flavor(unique_flavor("hello"))
            .read_failures(FailurePolicy::Propagate)
            .build()
            .unwrap();
        // failure_limit is 2: a fault each time would have marked it dead by the third.
        for _ in 0..4 {
            let e = cache.get::<u32>("k").unwrap_err();
            let shown = format!("{e} {e:?}");
            assert!(!e.is_denied() && e.is_backend(), "{e}");
            assert!(e.to_string().contains(says), "{e}");
            assert!(!shown.contains("marked dead"), "{e}");
            assert!(!shown.contains("n0t-the-s3cret"), "{shown}");
        }
    }
}

#[test]
fn a_user_without_scripting_is_denied_its_fenced_writes_and_still_reads() {
    on_both(|server| {
        acl_user(server, "no-scripts", &["~*", "&*", "+@all", "-@scripting"]);
        let url = format!("redis://no-scripts:secret@127.0.0.1:{}/0", server.port);
        // On the backend: a plain set works, the fenced write (a script) is denied by name.
        let b = RedisBackend::new(RedisConfig::new(&url)).unwrap();
        b.store(newcache::Write::new(StoreMode::Set, "k", b"v", 0, 0))
            .unwrap();
        let cas = b.get("k").unwrap().unwrap().cas;
        for _ in 0..3 {
            let e = b
                .store(newcache::Write::new(StoreMode::Cas(cas), "k", b"w", 0, 0))
                .unwrap_err();
            assert!(e.is_denied(), "{e}");
            assert!(!e.is_outcome_unknown(), "the server answered: {e}");
            let shown = e.to_string();
            assert!(shown.contains("NOPERM") && shown.contains("evalsha"), "{e}");
        }
        // Not marked dead: reads go on.
        assert_eq!(&b.get("k").unwrap().unwrap().value[..], b"v");

        // What a cache's user sees. A counter is a script: denied, by name, every time.
        // A loader's value is returned; its store (a fenced write) is denied and counted, and
        // the warning (once, for the cache) names the permission.
        let cache = as_user(server, "no-scripts", "secret").build().unwrap();
        let logs = crate::obs::logs_at(tracing::Level::WARN, || {
            let v = cache
                .get_or_set_with("loaded", S(60), || Ok::<_, std::io::Error>(2u32))
                .unwrap();
            assert_eq!(v, 2);
            for _ in 0..3 {
                let e = cache.incr("n", 1).unwrap_err();
                assert!(e.is_denied() && e.to_string().contains("NOPERM"), "{e}");
            }
        });
        assert_eq!(
            logs.matches("redis refused this client").count(),
            1,
            "{logs}"
        );
        assert!(
            logs.contains("NOPERM") && logs.contains("evalsha"),
            "{logs}"
        );
        assert!(cache.stats().backend_errors_absorbed >= 1);
        // Never marked dead: plain writes and reads go on.
        cache.set("plain", &1u32, S(60)).unwrap();
        assert_eq!(cache.get::<u32>("plain").unwrap(), Some(1));
        let cache = as_user(server, "no-scripts", "secret")
            .build_async()
            .unwrap();
        runtime().block_on(async {
            for _ in 0..3 {
                let e = cache.incr("n", 1).await.unwrap_err();
                assert!(e.is_denied() && e.to_string().contains("NOPERM"), "{e}");
            }
            cache.set("plain", &3u32, S(60)).await.unwrap();
            assert_eq!(cache.get::<u32>("plain").await.unwrap(), Some(3));
        });
    });
}

/// A loader's store the user may not run (`EVALSHA`, `EVAL`: the fenced write) leaves no
/// placeholder behind: the next call of that key loads at once, sync and async, rather than
/// waiting out `max_wait` (5 s here, as long as the claim) behind a holder that never stores.
#[test]
fn a_denied_fenced_store_leaves_no_placeholder_to_wait_behind() {
    on_both(|server| {
        acl_user(server, "no-scripts", &["~*", "&*", "+@all", "-@scripting"]);
        let builder = || as_user(server, "no-scripts", "secret").max_wait(S(5));
        // Well under max_wait: a call that waited behind the placeholder takes 5 s.
        let quick = |started: Instant| {
            assert!(started.elapsed() < S(2), "waited {:?}", started.elapsed());
        };
        let cache = builder().build().unwrap();
        for want in 1..=3u32 {
            let started = Instant::now();
            let v = cache
                .get_or_set_with("k", S(60), || Ok::<_, std::io::Error>(want))
                .unwrap();
            assert_eq!(v, want, "each call loads (nothing can be stored)");
            quick(started);
        }
        // A failed load's placeholder goes too.
        let e = cache
            .get_or_set_with("f", S(60), || Err::<u32, _>(std::io::Error::other("no")))
            .unwrap_err();
        assert!(e.loader().is_some(), "{e}");
        let started = Instant::now();
        let v = cache
            .get_or_set_with("f", S(60), || Ok::<_, std::io::Error>(7u32))
            .unwrap();
        assert_eq!(v, 7);
        quick(started);
        // A batch's placeholders go too.
        let got = cache
            .get_many_or_set_with(&["b1", "b2"], S(60), |keys| {
                Ok::<_, std::io::Error>(keys.iter().map(|k| (k.clone(), 1u32)).collect())
            })
            .unwrap();
        assert_eq!(got.len(), 2);
        let started = Instant::now();
        let v = cache
            .get_or_set_with("b1", S(60), || Ok::<_, std::io::Error>(2u32))
            .unwrap();
        assert_eq!(v, 2);
        quick(started);
        let st = cache.stats();
        assert_eq!((st.loader_calls, st.lease_waits), (7, 0), "{st:?}");
        assert_eq!(st.wait_timeouts, 0, "{st:?}");

        let cache = builder().build_async().unwrap();
        runtime().block_on(async {
            for want in 1..=3u32 {
                let started = Instant::now();
                let v = cache
                    .get_or_set_with("k", S(60), || async move { Ok::<_, std::io::Error>(want) })
                    .await
                    .unwrap();
                assert_eq!(v, want, "each call loads (nothing can be stored)");
                quick(started);
            }
            let st = cache.stats();
            assert_eq!((st.loader_calls, st.lease_waits), (3, 0), "{st:?}");
            let e = cache
                .get_or_set_with("f", S(60), || async {
                    Err::<u32, _>(std::io::Error::other("no"))
                })
                .await
                .unwrap_err();
            assert!(e.loader().is_some(), "{e}");
            let started = Instant::now();
            let v = cache
                .get_or_set_with("f", S(60), || async { Ok::<_, std::io::Error>(7u32) })
                .await
                .unwrap();
            assert_eq!(v, 7);
            quick(started);
            let got = cache
                .get_many_or_set_with(&["b1", "b2"], S(60), |keys| async move {
                    Ok::<_, std::io::Error>(keys.into_iter().map(|k| (k, 1u32)).collect())
                })
                .await
                .unwrap();
            assert_eq!(got.len(), 2);
            let started = Instant::now();
            let v = cache
                .get_or_set_with("b1", S(60), || async { Ok::<_, std::io::Error>(2u32) })
                .await
                .unwrap();
            assert_eq!(v, 2);
            quick(started);
            assert_eq!(cache.stats().wait_timeouts, 0);
        });
    });
}

/// What a server marked dead says once it is back refusing this client's credentials (here
/// restarted without the ACL user): the probe's denial brings it back, and every call then
/// says it is denied, not "marked dead".
#[test]
fn a_dead_server_back_refusing_the_password_is_denied_not_marked_dead() {
    let denied = |e: &newcache::Error| {
        assert!(e.is_denied(), "{e}");
        assert!(!e.to_string().contains("marked dead"), "{e}");
        assert!(e.to_string().contains("user and password"), "{e}");
    };
    on_both(|server| {
        acl_user(server, "newcache-user", &["~*", "&*", "+@all"]);
        let cache = as_user(server, "newcache-user", "secret")
            .io_timeout(Duration::from_millis(300))
            .connect_timeout(Duration::from_millis(300))
            .build()
            .unwrap();
        // A view of the same cache: one health record.
        let async_cache = cache.to_async();
        let rt = runtime();
        cache.set("k", &1u32, S(60)).unwrap();
        rt.block_on(async { async_cache.set("k", &1u32, S(60)).await.unwrap() });
        server.kill();
        // failure_limit 2: marked dead by the third call (both views share the record).
        for _ in 0..3 {
            let _ = cache.set("k", &2u32, S(60));
        }
        let e = cache.set("k", &2u32, S(60)).unwrap_err();
        assert!(e.to_string().contains("marked dead"), "{e}");
        // Restarted empty: the user is gone, so its password is refused.
        server.restart();
        let deadline = Instant::now() + S(10);
        loop {
            match cache.set("k", &3u32, S(60)) {
                Err(e) if e.is_denied() => break,
                Err(e) => assert!(Instant::now() < deadline, "never denied: {e}"),
                Ok(()) => panic!("stored with a refused password"),
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // The server is back: every call, through either view, names the refusal.
        for _ in 0..3 {
            denied(&cache.set("k", &3u32, S(60)).unwrap_err());
            denied(&cache.get::<u32>("k").unwrap_err());
        }
        denied(&cache.ping().unwrap_err().failures()[0].error);
        rt.block_on(async {
            for _ in 0..3 {
                denied(&async_cache.set("k", &3u32, S(60)).await.unwrap_err());
                denied(&async_cache.get::<u32>("k").await.unwrap_err());
            }
            denied(&async_cache.ping().await.unwrap_err().failures()[0].error);
        });
    });
}

/// The same, found by the async view first.
#[test]
fn a_dead_server_back_refusing_the_password_is_denied_async() {
    on_both(|server| {
        acl_user(server, "newcache-user", &["~*", "&*", "+@all"]);
        let cache = as_user(server, "newcache-user", "secret")
            .io_timeout(Duration::from_millis(300))
            .connect_timeout(Duration::from_millis(300))
            .build_async()
            .unwrap();
        let rt = runtime();
        rt.block_on(async { cache.set("k", &1u32, S(60)).await.unwrap() });
        server.kill();
        rt.block_on(async {
            for _ in 0..3 {
                let _ = cache.set("k", &2u32, S(60)).await;
            }
            let e = cache.set("k", &2u32, S(60)).await.unwrap_err();
            assert!(e.to_string().contains("marked dead"), "{e}");
        });
        server.restart();
        rt.block_on(async {
            let deadline = Instant::now() + S(10);
            loop {
                match cache.set("k", &3u32, S(60)).await {
                    Err(e) if e.is_denied() => break,
                    Err(e) => assert!(Instant::now() < deadline, "never denied: {e}"),
                    Ok(()) => panic!("stored with a refused password"),
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            for _ in 0..3 {
                let e = cache.get::<u32>("k").await.unwrap_err();
                assert!(
                    e.is_denied() && !e.to_string().contains("marked dead"),
                    "{e}"
                );
            }
        });
    });
}

/// `ping()` with a refused password, or a user that may not `GET`, says denied (and names
/// the refusal), not that the server is down; it never marks the server dead.
#[test]
fn ping_with_a_denied_user_says_denied_not_down() {
    on_both(|server| {
        acl_user(server, "newcache-user", &["~*", "&*", "+@all"]);
        acl_user(server, "no-get", &["~*", "&*", "+@all", "-get"]);
        for (user, password, says) in [
            ("newcache-user", "n0t-the-s3cret", "user and password"),
            ("no-get", "secret", "NOPERM"),
        ] {
            let check = |e: &newcache::PingError| {
                let f = &e.failures()[0];
                assert!(f.error.is_denied(), "{e}");
                let shown = e.to_string();
                assert!(
                    shown.contains(says) && !shown.contains("marked dead"),
                    "{e}"
                );
                assert!(!shown.contains("n0t-the-s3cret"), "{e}");
            };
            let cache = as_user(server, user, password).build().unwrap();
            for _ in 0..4 {
                check(&cache.ping().unwrap_err());
            }
            let cache = as_user(server, user, password).build_async().unwrap();
            runtime().block_on(async {
                for _ in 0..4 {
                    check(&cache.ping().await.unwrap_err());
                }
            });
        }
    });
}

/// Without `EVAL`/`EVALSHA`, herd protection across processes is reduced to turns: a call of
/// another process (here another cache on the same flavor) that comes while a load runs waits
/// for it, and once that load's store is denied (its placeholder deleted) loads in turn, at
/// once, not after `max_wait`.
#[test]
fn without_scripting_another_process_waits_for_the_load_then_loads_in_turn() {
    on_both(|server| {
        acl_user(server, "no-scripts", &["~*", "&*", "+@all", "-@scripting"]);
        let flavor = unique_flavor("acl-turns");
        let build = || {
            as_user(server, "no-scripts", "secret")
                .flavor(flavor.clone())
                .max_wait(S(5))
                .build()
                .unwrap()
        };
        let (a, b) = (build(), build());
        let (started_tx, started) = std::sync::mpsc::channel();
        let (release, release_rx) = std::sync::mpsc::channel::<()>();
        std::thread::scope(|s| {
            let a = &a;
            let first = s.spawn(move || {
                a.get_or_set_with("k", S(60), || {
                    started_tx.send(()).unwrap();
                    release_rx.recv().unwrap();
                    Ok::<_, std::io::Error>(1u32)
                })
                .unwrap()
            });
            started.recv().unwrap();
            let second = s.spawn(|| {
                b.get_or_set_with("k", S(60), || Ok::<_, std::io::Error>(2u32))
                    .unwrap()
            });
            // The second call waits behind the first's placeholder (herd protection) ...
            let deadline = Instant::now() + S(4);
            while b.stats().lease_waits == 0 {
                assert!(Instant::now() < deadline, "never waited: {:?}", b.stats());
                std::thread::sleep(Duration::from_millis(5));
            }
            let released = Instant::now();
            release.send(()).unwrap();
            assert_eq!(first.join().unwrap(), 1);
            // ... then, the first's store denied and its placeholder gone, loads its own.
            assert_eq!(second.join().unwrap(), 2);
            assert!(released.elapsed() < S(2), "{:?}", released.elapsed());
        });
        let st = b.stats();
        assert_eq!((st.loader_calls, st.wait_timeouts), (1, 0), "{st:?}");
    });
}

/// Read-your-writes for a user without scripting: a `set` that lands while a load of the same
/// key is under way (the set is the newer value; the load's fenced store must lose to it) is
/// what the next `get` reads. The load's store is denied (a script), and the denied store's
/// plain `UNLINK` of "its claim" must not delete the value the set wrote meanwhile.
#[test]
fn a_set_during_a_denied_load_is_read_back_not_unlinked() {
    on_both(|server| {
        acl_user(server, "no-scripts", &["~*", "&*", "+@all", "-@scripting"]);
        let cache = as_user(server, "no-scripts", "secret").build().unwrap();
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let loader = {
            let cache = cache.clone();
            std::thread::spawn(move || {
                cache
                    .get_or_set_with("k", S(60), move || {
                        started_tx.send(()).unwrap();
                        go_rx.recv().unwrap();
                        Ok::<_, std::io::Error>(1u32)
                    })
                    .unwrap()
            })
        };
        started_rx.recv().unwrap();
        cache.set("k", &2u32, S(60)).unwrap();
        go_tx.send(()).unwrap();
        assert_eq!(
            loader.join().unwrap(),
            1,
            "the loader's caller gets its value"
        );
        assert_eq!(
            cache.get::<u32>("k").unwrap(),
            Some(2),
            "sync: the set that returned before this get is read back"
        );

        let cache = as_user(server, "no-scripts", "secret")
            .build_async()
            .unwrap();
        runtime().block_on(async {
            let (started_tx, started_rx) = tokio::sync::oneshot::channel();
            let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
            let loader = {
                let cache = cache.clone();
                tokio::spawn(async move {
                    cache
                        .get_or_set_with("a", S(60), move || async move {
                            started_tx.send(()).unwrap();
                            go_rx.await.unwrap();
                            Ok::<_, std::io::Error>(1u32)
                        })
                        .await
                        .unwrap()
                })
            };
            started_rx.await.unwrap();
            cache.set("a", &2u32, S(60)).await.unwrap();
            go_tx.send(()).unwrap();
            assert_eq!(loader.await.unwrap(), 1);
            assert_eq!(
                cache.get::<u32>("a").await.unwrap(),
                Some(2),
                "async: the set that returned before this get is read back"
            );
        });
    });
}

/// Two processes on one key, one of them without scripting: the other's value, loaded and
/// stored after an invalidation while the first was still loading, is not deleted by the
/// first one's denied store: the next call is served it, without a second load.
#[test]
fn a_denied_store_leaves_another_clients_newer_value() {
    on_both(|server| {
        acl_user(server, "no-scripts", &["~*", "&*", "+@all", "-@scripting"]);
        let flavor = unique_flavor("acl-two");
        let denied = as_user(server, "no-scripts", "secret")
            .flavor(flavor.clone())
            .build()
            .unwrap();
        let full = Cache::builder()
            .redis(server.url())
            .flavor(flavor)
            .read_failures(FailurePolicy::Propagate)
            .build()
            .unwrap();
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let slow = {
            let denied = denied.clone();
            std::thread::spawn(move || {
                denied
                    .get_or_set_with("k", S(60), move || {
                        started_tx.send(()).unwrap();
                        go_rx.recv().unwrap();
                        Ok::<_, std::io::Error>(1u32)
                    })
                    .unwrap()
            })
        };
        started_rx.recv().unwrap();
        // An invalidation lands during the slow load; the other process then loads and stores.
        full.delete("k").unwrap();
        let loads = std::sync::atomic::AtomicU32::new(0);
        let load = || {
            loads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok::<_, std::io::Error>(2u32)
        };
        assert_eq!(full.get_or_set_with("k", S(60), load).unwrap(), 2);
        go_tx.send(()).unwrap();
        assert_eq!(slow.join().unwrap(), 1);
        assert_eq!(full.get_or_set_with("k", S(60), load).unwrap(), 2);
        assert_eq!(
            loads.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "the stored value was deleted by the denied store: loaded again"
        );
        assert_eq!(full.get::<u32>("k").unwrap(), Some(2));
    });
}

/// A user allowed `GET` but not `MGET` (`-mget`): concurrent async gets are batched into
/// `MGET`s behind the user's back; each caller must still get its value as its own `GET`
/// would, not a denial of a command it never asked for.
#[test]
fn concurrent_async_gets_of_a_user_without_mget_are_served() {
    let server = RedisServer::start("redis-server");
    acl_user(&server, "no-mget", &["~*", "&*", "+@all", "-mget"]);
    let cache = as_user(&server, "no-mget", "secret").build_async().unwrap();
    runtime().block_on(async {
        for i in 0..64u32 {
            cache.set(&format!("k{i}"), &i, S(60)).await.unwrap();
        }
        let tasks: Vec<_> = (0..64u32)
            .map(|i| {
                let c = cache.clone();
                tokio::spawn(async move { (i, c.get::<u32>(&format!("k{i}")).await) })
            })
            .collect();
        let mut denied = Vec::new();
        for t in tasks {
            let (i, r) = t.await.unwrap();
            match r {
                Ok(v) => assert_eq!(v, Some(i)),
                Err(e) => denied.push(format!("k{i}: {e}")),
            }
        }
        assert!(
            denied.is_empty(),
            "{} of 64 gets failed: {:?}",
            denied.len(),
            denied.first()
        );
    });
}

/// `touch` of a counter (memcached's plain touch) to no expiry is `PERSIST`: a user whose ACL
/// refuses it gets `is_denied()`, not `Ok(true)`, and the counter keeps its expiry, on both
/// fronts. The server answered: it is not marked dead, and the counter is still served.
#[test]
fn touch_of_a_counter_to_no_expiry_refused_by_the_acl_is_denied_and_it_keeps_its_expiry() {
    on_both(|server| {
        acl_user(server, "no-persist", &["~*", "&*", "+@all", "-persist"]);
        for front in [Front::Sync, Front::Async] {
            let cache = as_user(server, "no-persist", "secret")
                .write_failures(FailurePolicy::Propagate)
                .build_front(front);
            cache.set_counter("k", 1, S(60)).unwrap();
            let e = cache.touch("k", Ttl::Never).unwrap_err();
            assert!(
                e.is_denied() && e.to_string().contains("persist"),
                "{front:?}: {e}"
            );
            let ttl: i64 = redis::cmd("TTL")
                .arg(cache.make_key("k"))
                .query(&mut raw(server))
                .unwrap();
            assert!(ttl > 0, "{front:?}: the key still expires: {ttl}");
            assert_eq!(cache.incr("k", 1).unwrap(), 2, "{front:?}");
            // A touch to an expiry (`PEXPIRE`, allowed) still works.
            assert!(cache.touch("k", S(120)).unwrap(), "{front:?}");
        }
    });
}

/// A user with exactly the commands the docs list, but not `WAIT`, on a cache with
/// `redis_wait`: a `set` stores its value and fails with an error that `is_outcome_unknown()`
/// and names the refused `WAIT` (not `is_denied()`, which would say nothing was written); the
/// write's own refusal still comes first (a `set` of a key the user may not touch is denied).
/// Nothing is queued for a replay: the value stays.
#[test]
fn a_refused_wait_leaves_a_stored_writes_outcome_unknown_and_its_own_refusal_first() {
    on_both(|server| {
        // The `backend::redis` docs' list of ACL commands, the optional ones included; no `WAIT`.
        let listed = [
            "+get",
            "+mget",
            "+set",
            "+exists",
            "+persist",
            "+pexpire",
            "+expireat",
            "+unlink",
            "+scan",
            "+eval",
            "+evalsha",
            "+config|get",
            "+client|info",
            "+client|kill",
        ];
        let mut rules = vec!["&*", "~*"];
        rules.extend(listed);
        acl_user(server, "listed", &rules);
        for front in [Front::Sync, Front::Async] {
            let cache = as_user(server, "listed", "secret")
                .redis_wait(1, Duration::from_millis(50))
                .write_failures(FailurePolicy::Propagate)
                .build_front(front);
            let e = cache.set("s", &1u32, S(60)).unwrap_err();
            assert!(e.is_outcome_unknown() && !e.is_denied(), "{front:?}: {e:?}");
            assert!(e.to_string().contains("refused the WAIT"), "{front:?}: {e}");
            let stored: i64 = redis::cmd("EXISTS")
                .arg(cache.make_key("s"))
                .query(&mut raw(server))
                .unwrap();
            assert_eq!(stored, 1, "{front:?}: the set stored its value");
            assert!(cache.delete("s").unwrap_err().is_outcome_unknown());
            // Not queued for a replay that would delete a later write.
            cache.set("t", &2u32, S(60)).unwrap_err();
            assert_eq!(cache.get::<u32>("t").unwrap(), Some(2), "{front:?}");
            assert_eq!(cache.stats().replayed_deletes, 0, "{front:?}");
        }
        // The write's own refusal first: a key outside the user's pattern is denied as such,
        // not as the WAIT the user may not run either.
        acl_user(
            server,
            "narrow",
            &["resetkeys", "~other:*", "+@all", "-wait"],
        );
        for front in [Front::Sync, Front::Async] {
            let cache = as_user(server, "narrow", "secret")
                .redis_wait(1, Duration::from_millis(50))
                .write_failures(FailurePolicy::Propagate)
                .build_front(front);
            let e = cache.set("s", &1u32, S(60)).unwrap_err();
            assert!(e.is_denied() && !e.is_outcome_unknown(), "{front:?}: {e:?}");
            assert!(!e.to_string().contains("'wait'"), "{front:?}: {e}");
        }
    });
}

/// A replica of `master` (its data in a temp directory of its own, removed on drop), once
/// synced.
struct Replica {
    server: RedisServer,
    dir: std::path::PathBuf,
}

impl Replica {
    fn of(master: &RedisServer) -> Replica {
        let dir = std::env::temp_dir().join(format!(
            "newcache-replica-{}-{}",
            std::process::id(),
            master.port
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let port = master.port.to_string();
        let server = RedisServer::start_with(
            "redis-server",
            &[
                "--replicaof",
                "127.0.0.1",
                &port,
                "--dir",
                dir.to_str().unwrap(),
            ],
        );
        let deadline = Instant::now() + S(20);
        loop {
            let info: String = redis::cmd("INFO")
                .arg("replication")
                .query(&mut raw(master))
                .unwrap();
            if info.contains("connected_slaves:1") && info.contains("state=online") {
                return Replica { server, dir };
            }
            assert!(
                Instant::now() < deadline,
                "the replica never synced: {info}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.server.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// With `redis_wait`, a replica gone makes every write's `WAIT` last its whole timeout and fall
/// short. A `WAIT` blocks the connection it is sent on, so none may share one with other
/// calls: 6 threads writing while another reads, on both fronts, no read of the healthy master
/// fails, and each write fails only with its shortfall (outcome unknown, its value on the
/// master and left there: nothing queued for a replay); the master is never marked dead.
#[test]
fn a_replica_gone_under_redis_wait_holds_up_no_read_and_fails_writes_only_short() {
    let master = RedisServer::start("redis-server");
    drop(Replica::of(&master));
    // The master lost its replica: each WAIT now lasts its 400 ms (and a tick of the server's
    // clock) and answers 0, well within the 2 s io_timeout; six of them in a row would not be.
    for front in [Front::Sync, Front::Async] {
        let cache = Cache::builder()
            .redis(master.url())
            .flavor(unique_flavor("wait-gone"))
            .redis_wait(1, Duration::from_millis(400))
            .io_timeout(S(2))
            .read_failures(FailurePolicy::Propagate)
            .write_failures(FailurePolicy::Propagate)
            .build_front(front);
        let short = |r: &newcache::Result<()>| {
            r.as_ref()
                .is_err_and(|e| e.is_outcome_unknown() && e.to_string().contains("0 of 1 replicas"))
        };
        assert!(short(&cache.set("r", &1u32, S(60))), "{front:?}");
        let writing = std::sync::atomic::AtomicUsize::new(6);
        let (writes, reads) = std::thread::scope(|s| {
            let writers: Vec<_> = (0..6)
                .map(|i| {
                    let (cache, writing) = (&cache, &writing);
                    s.spawn(move || {
                        let out: Vec<_> = (0..3)
                            .map(|j| {
                                (
                                    format!("w{i}-{j}"),
                                    cache.set(&format!("w{i}-{j}"), &1u32, S(60)),
                                )
                            })
                            .collect();
                        writing.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                        out
                    })
                })
                .collect();
            let mut reads = Vec::new();
            while writing.load(std::sync::atomic::Ordering::SeqCst) > 0 {
                std::thread::sleep(Duration::from_millis(20));
                reads.push(cache.get::<u32>("r"));
            }
            let writes: Vec<_> = writers
                .into_iter()
                .flat_map(|w| w.join().unwrap())
                .collect();
            (writes, reads)
        });
        let failed_reads: Vec<_> = reads.iter().filter(|r| !matches!(r, Ok(Some(1)))).collect();
        assert!(
            failed_reads.is_empty(),
            "{front:?}: {} of {} reads of a healthy master failed: {:?}",
            failed_reads.len(),
            reads.len(),
            failed_reads.first()
        );
        let not_short: Vec<_> = writes.iter().filter(|(_, r)| !short(r)).collect();
        assert!(
            not_short.is_empty(),
            "{front:?}: {} of 18 writes failed otherwise than short of the replica: {:?}",
            not_short.len(),
            not_short.first()
        );
        for (key, _) in &writes {
            assert_eq!(cache.get::<u32>(key).unwrap(), Some(1), "{front:?}: {key}");
        }
        assert_eq!(cache.stats().replayed_deletes, 0, "{front:?}");
        assert!(cache.ping().is_ok(), "{front:?}");
    }
}

/// An async waited write dropped while its `WAIT` blocks: its connection is closed, not kept
/// for the next write (which would queue behind the wait); its value is on the master (the
/// write ran before the wait), and the next write and read go on.
#[test]
fn an_async_write_dropped_mid_wait_closes_its_connection() {
    let master = RedisServer::start("redis-server");
    drop(Replica::of(&master));
    let cache = Cache::builder()
        .redis(master.url())
        .flavor(unique_flavor("wait-dropped"))
        .redis_wait(1, S(3))
        .io_timeout(S(5))
        .write_failures(FailurePolicy::Propagate)
        .build_async()
        .unwrap();
    let rt = runtime();
    let waiting = || -> Vec<String> {
        let list: String = redis::cmd("CLIENT")
            .arg("LIST")
            .query(&mut raw(&master))
            .unwrap();
        list.lines()
            .filter(|l| l.contains("cmd=wait") && l.contains("flags=b"))
            .filter_map(|l| {
                l.split(' ')
                    .find(|f| f.starts_with("id="))
                    .map(str::to_owned)
            })
            .collect()
    };
    let task = {
        let cache = cache.clone();
        rt.spawn(async move { cache.set("k", &1u32, S(60)).await })
    };
    let deadline = Instant::now() + S(10);
    let blocked = loop {
        if let [id] = &waiting()[..] {
            break id.clone();
        }
        assert!(Instant::now() < deadline, "no write blocked in its WAIT");
        std::thread::sleep(Duration::from_millis(10));
    };
    task.abort();
    // Its connection goes (kept, it would stay open, idle, for good).
    let deadline = Instant::now() + S(10);
    loop {
        let list: String = redis::cmd("CLIENT")
            .arg("LIST")
            .query(&mut raw(&master))
            .unwrap();
        if !list.lines().any(|l| l.starts_with(&format!("{blocked} "))) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the dropped write's connection ({blocked}) is still open"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let stored: i64 = redis::cmd("EXISTS")
        .arg(cache.make_key("k"))
        .query(&mut raw(&master))
        .unwrap();
    assert_eq!(stored, 1, "the write ran before its WAIT");
    rt.block_on(async {
        let e = cache.set("k", &2u32, S(60)).await.unwrap_err();
        assert!(e.is_outcome_unknown(), "{e}");
        assert_eq!(cache.get::<u32>("k").await.unwrap(), Some(2));
    });
}

/// A forwarder to a server that, once armed, lets the next request through to the server (which
/// runs it and answers) but closes the client's connection instead of passing the reply on: a
/// connection lost after the server ran the command (a proxy's restart, `CLIENT KILL`, a reset
/// on the way back).
struct LoseReply {
    addr: String,
    armed: Arc<AtomicBool>,
}

impl LoseReply {
    fn new(upstream: String) -> LoseReply {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let armed = Arc::new(AtomicBool::new(false));
        let armed2 = armed.clone();
        thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let server = TcpStream::connect(&upstream).unwrap();
                let (mut c_in, mut s_out) =
                    (client.try_clone().unwrap(), server.try_clone().unwrap());
                thread::spawn(move || {
                    let _ = std::io::copy(&mut c_in, &mut s_out);
                    let _ = s_out.shutdown(Shutdown::Both);
                });
                let armed = armed2.clone();
                let (mut s_in, mut c_out) = (server, client);
                thread::spawn(move || {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = match s_in.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        if armed.swap(false, Ordering::SeqCst) {
                            // The server ran it and answered: the client never hears.
                            let _ = c_out.shutdown(Shutdown::Both);
                            let _ = s_in.shutdown(Shutdown::Both);
                            break;
                        }
                        if c_out.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = c_out.shutdown(Shutdown::Both);
                });
            }
        });
        LoseReply { addr, armed }
    }

    fn arm(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }
}

/// A pooled connection lost after the server ran a write, before its reply came, cannot be told
/// from one the server closed while it sat idle: the write is not sent again (an `incr` applied
/// twice, an `add` that stored its value answering that the key was taken), but fails with its
/// outcome unknown. A read is asked again.
#[test]
fn a_write_whose_reply_was_lost_fails_outcome_unknown_and_is_never_sent_again() {
    let server = RedisServer::start("redis-server");
    let proxy = LoseReply::new(format!("127.0.0.1:{}", server.port));
    let cache = Cache::builder()
        .redis(format!("redis://{}/0", proxy.addr))
        .flavor(unique_flavor("lost-reply"))
        .pool_size(1)
        .write_failures(FailurePolicy::Propagate)
        .build()
        .unwrap();
    cache.set_counter("c", 9, S(60)).unwrap();
    // The counter script known to the server (a NOSCRIPT is not what the proxy should lose).
    assert_eq!(cache.incr("c", 1).unwrap(), 10);
    proxy.arm();
    let r = cache.incr("c", 1);
    let now = cache.get_counter("c").unwrap();
    assert_eq!(
        now,
        Some(11),
        "one incr of 1 (answered {r:?}) took the counter from 10 to {now:?}"
    );
    assert!(r.as_ref().is_err_and(|e| e.is_outcome_unknown()), "{r:?}");

    // An add whose reply was lost: sent again, it finds its own value and says "taken".
    proxy.arm();
    let added = cache.add("fresh", &1u32, S(60));
    assert!(
        !matches!(added, Ok(false)),
        "add of a free key stored its value ({:?} now) but answered Ok(false): the key was free",
        cache.get::<u32>("fresh")
    );
    assert!(
        added.as_ref().is_err_and(|e| e.is_outcome_unknown()),
        "{added:?}"
    );

    // A read whose reply was lost is asked again: it changes nothing.
    cache.set("v", &7u32, S(60)).unwrap();
    proxy.arm();
    assert_eq!(cache.get::<u32>("v").unwrap(), Some(7));
}

/// A call that waits for another call's connect gets one `connect_timeout` for that wait and
/// its own dial together, not a whole one for its dial. A server whose first connection is
/// closed after 2 s and whose next ones are accepted and never answered; `connect_timeout`
/// 3 s; two calls made together: the first fails when its connection closes (2 s), the second
/// by 3 s (before: it dialed at 2 s with a `connect_timeout` of its own, and failed at 5 s).
#[test]
fn a_call_waiting_for_another_calls_connect_shares_its_connect_timeout_async() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    thread::spawn(move || {
        let mut silent = Vec::new();
        for (i, c) in l.incoming().enumerate() {
            let Ok(c) = c else { continue };
            match i {
                0 => drop(thread::spawn(move || {
                    thread::sleep(S(2));
                    drop(c);
                })),
                _ => silent.push(c),
            }
        }
    });
    let cache = Cache::builder()
        .redis(format!("redis://127.0.0.1:{port}/0").as_str())
        .flavor(unique_flavor("shared-connect"))
        .connect_timeout(S(3))
        .io_timeout(S(3))
        .read_failures(FailurePolicy::Propagate)
        .build_async()
        .unwrap();
    let timed = || async {
        let r = cache.get::<u32>("k").await;
        (r, Instant::now())
    };
    let started = Instant::now();
    let ((a, a_at), (b, b_at)) = runtime().block_on(async { tokio::join!(timed(), timed()) });
    assert!(a.is_err() && b.is_err(), "{a:?} {b:?}");
    let last = a_at.max(b_at) - started;
    assert!(
        last < Duration::from_millis(4000),
        "the second call failed {last:?} after the start: {a:?} {b:?}"
    );
}

/// On Redis, as on memcached, the settings every server connection has (timeouts, pool,
/// health limits, replay capacity) are used: `build()` warns about none of them. memcached's
/// own (`dead_servers`, `async_connections`, `pipelined_sync`) are not, and the warning names
/// them, on one server and on a cluster. Builds only: nothing connects.
#[test]
fn a_redis_build_names_memcached_only_settings_as_ignored_and_not_the_shared_ones() {
    let shared = |b: newcache::CacheBuilder| {
        b.connect_timeout(S(2))
            .io_timeout(S(1))
            .pool_size(4)
            .failure_limit(3)
            .retry_interval(S(2))
            .replay_capacity(100)
    };
    let every = [
        "connect_timeout",
        "io_timeout",
        "pool_size",
        "failure_limit",
    ];
    let every = [&every[..], &["retry_interval", "replay_capacity"]].concat();
    let memcached_only = ["dead_servers", "async_connections", "pipelined_sync"];
    for b in [
        Cache::builder().redis("redis://127.0.0.1:1/0"),
        Cache::builder().redis_cluster(["redis://127.0.0.1:1"]),
    ] {
        let logs = crate::obs::logs_at(tracing::Level::WARN, || {
            shared(b.clone()).build().unwrap();
        });
        assert!(!logs.contains("ignored"), "{logs}");
        let logs = crate::obs::logs_at(tracing::Level::WARN, || {
            shared(b.clone())
                .dead_servers(newcache::DeadServerPolicy::Remap)
                .async_connections(4)
                .pipelined_sync(false)
                .build()
                .unwrap();
        });
        assert!(logs.contains("ignored"), "{logs}");
        for setting in memcached_only {
            assert!(logs.contains(setting), "{setting} named: {logs}");
        }
        for setting in &every {
            assert!(!logs.contains(setting), "{setting} not named: {logs}");
        }
    }
}
