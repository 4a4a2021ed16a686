//! A Redis or Valkey server without scripting (`EVAL` and `EVALSHA` renamed away, as hardened
//! managed servers do): Redis 7 has no other fenced write, so a loader fails before it runs
//! and leaves nothing behind, while plain calls and stale values keep being served; Valkey 9
//! fences with `SET IFEQ`, and loads work as everywhere. Both front ends.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use newcache::Cache;
use newcache::testing::MockClock;
use redis::Commands;

use crate::fixture::{RedisServer, unique_flavor, valkey_server};
use crate::front::{BuildFor, Front, TestCache, runtime};

const TTL: Duration = Duration::from_secs(60);

/// A server of `bin` with scripting renamed away.
fn without_scripting(bin: &str) -> RedisServer {
    RedisServer::start_with(
        bin,
        &[
            "--rename-command",
            "EVAL",
            "",
            "--rename-command",
            "EVALSHA",
            "",
        ],
    )
}

fn cache_on(server: &RedisServer, clock: &Arc<MockClock>, flavor: &str, front: Front) -> TestCache {
    Cache::builder()
        .redis(server.url())
        .flavor(flavor)
        .clock(clock.clone())
        .failure_limit(2)
        .io_timeout(Duration::from_millis(500))
        .build_front(front)
}

/// The raw bytes under a cache's key, read by another client.
fn raw_get(server: &RedisServer, key: &str) -> Option<Vec<u8>> {
    crate::redis::raw(server).get(key).unwrap()
}

#[derive(Debug)]
struct Failed;

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the loader failed")
    }
}

impl std::error::Error for Failed {}

#[test]
fn redis_without_scripting_refuses_loads_before_they_run_and_serves_everything_else() {
    let server = without_scripting("redis-server");
    for front in [Front::Sync, Front::Async] {
        let clock = MockClock::new();
        let cache = cache_on(&server, &clock, &unique_flavor("noscript"), front);
        let loads = AtomicUsize::new(0);
        let load = |v: u32| {
            let loads = &loads;
            move || {
                loads.fetch_add(1, Ordering::SeqCst);
                Ok::<_, Failed>(v)
            }
        };

        // A batch first, on a cache that has not yet asked the server anything: its keys are
        // loaded and returned, nothing is stored, and nothing is left for others to wait on.
        let got = cache
            .get_many_or_set_with(&["x1", "x2"], TTL, |keys| {
                Ok::<_, Failed>(keys.iter().map(|k| (k.clone(), 4u32)).collect())
            })
            .unwrap();
        assert_eq!(got.len(), 2, "{front:?}");
        for k in ["x1", "x2"] {
            assert_eq!(raw_get(&server, &cache.make_key(k)), None, "{front:?}: {k}");
        }
        let e = cache.get_or_set_with("x1", TTL, load(1)).unwrap_err();
        assert!(e.cache().is_some_and(|e| e.is_unsupported()), "{e}");
        assert_eq!(cache.stats().wait_timeouts, 0, "{front:?}");
        // The batch reports its unstored keys once (as on a memcached without CAS); what
        // follows counts nothing.
        let errors = cache.stats().backend_errors;
        assert!(errors <= 1, "{front:?}: {errors}");

        // A missing key: the loader never runs, and no placeholder is written.
        for _ in 0..4 {
            let e = cache.get_or_set_with("k", TTL, load(1)).unwrap_err();
            let e = e.cache().expect("a cache error, not the loader's");
            assert!(e.is_unsupported(), "{front:?}: {e}");
            let said = e.to_string();
            assert!(
                said.contains(&format!("127.0.0.1:{}", server.port)),
                "names the server: {said}"
            );
            assert!(
                said.contains("scripting") && said.contains("IFEQ"),
                "{said}"
            );
            assert_eq!(raw_get(&server, &cache.make_key("k")), None, "{front:?}");
        }
        assert_eq!(loads.load(Ordering::SeqCst), 0, "{front:?}");
        let commands: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut crate::redis::raw(&server))
            .unwrap();
        let set_calls = |s: &str| {
            s.lines()
                .find(|l| l.starts_with("cmdstat_set:"))
                .map(str::to_owned)
                .unwrap_or_default()
        };
        let sets_before = set_calls(&commands);
        for _ in 0..3 {
            assert!(cache.get_or_set_with("y", TTL, load(1)).is_err());
        }
        let commands: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut crate::redis::raw(&server))
            .unwrap();
        assert_eq!(set_calls(&commands), sets_before, "no placeholder written");

        // Plain calls work, the server was never marked dead, and no fault was counted.
        cache.set("k", &7u32, TTL).unwrap();
        assert_eq!(cache.get::<u32>("k").unwrap(), Some(7));
        assert!(cache.add("a", &1u32, TTL).unwrap());
        assert!(!cache.add("a", &2u32, TTL).unwrap());
        assert!(cache.delete("a").unwrap());
        assert_eq!(cache.stats().backend_errors, errors, "{front:?}");

        // A stale value: served, unclaimed (its bytes untouched), and a loader still refused.
        let before = raw_get(&server, &cache.make_key("k"));
        clock.advance(TTL + Duration::from_secs(1));
        assert_eq!(cache.get::<u32>("k").unwrap(), Some(7), "{front:?}");
        assert_eq!(cache.get::<u32>("k").unwrap(), Some(7), "{front:?}");
        assert_eq!(raw_get(&server, &cache.make_key("k")), before, "unclaimed");
        let e = cache.get_or_set_with("k", TTL, load(2)).unwrap_err();
        assert!(e.cache().is_some_and(|e| e.is_unsupported()), "{e}");
        assert_eq!(loads.load(Ordering::SeqCst), 0);
        assert_eq!(raw_get(&server, &cache.make_key("k")), before, "unclaimed");

        // Counters need scripting, and say so.
        cache.set_counter("n", 1, TTL).unwrap();
        let e = cache.incr("n", 1).unwrap_err();
        assert!(e.is_unsupported(), "{e}");
        assert!(e.to_string().contains("counters"), "{e}");
        assert_eq!(cache.get_counter("n").unwrap(), Some(1));

        // ping says what the server lacks.
        let e = cache.ping().unwrap_err();
        let failure = &e.failures()[0];
        assert!(failure.error.is_unsupported(), "{e}");
        assert_eq!(cache.stats().backend_errors, errors, "{front:?}");
        assert_eq!(cache.get::<u32>("k").unwrap(), Some(7), "still served");
    }
}

/// The async view's connection is shared by every call: a refusal that echoed binary bytes
/// once killed it, and with it the reads in flight beside the load.
#[test]
fn reads_in_flight_beside_refused_loads_on_redis_without_scripting_all_succeed() {
    let server = without_scripting("redis-server");
    let clock = MockClock::new();
    let flavor = unique_flavor("noscript-async");
    let TestCache::Async(cache) = cache_on(&server, &clock, &flavor, Front::Async) else {
        unreachable!()
    };
    runtime().block_on(async {
        for i in 0..20u32 {
            cache.set(&format!("r{i}"), &i, TTL).await.unwrap();
        }
        let mut tasks = Vec::new();
        for round in 0..10u32 {
            for i in 0..20u32 {
                let c = cache.clone();
                tasks.push(tokio::spawn(async move {
                    c.get::<u32>(&format!("r{i}")).await.map(|v| v == Some(i))
                }));
            }
            let c = cache.clone();
            tasks.push(tokio::spawn(async move {
                let r = c
                    .get_or_set_with(&format!("load{round}"), TTL, || async {
                        Ok::<_, Failed>(0u32)
                    })
                    .await;
                Ok(r.is_err_and(|e| e.cache().is_some_and(|e| e.is_unsupported())))
            }));
        }
        for t in tasks {
            assert!(
                t.await.unwrap().unwrap(),
                "every read served, every load refused"
            );
        }
    });
    assert_eq!(cache.stats().backend_errors, 0);
}

#[test]
fn valkey_without_scripting_fences_loads_with_set_ifeq() {
    let server = without_scripting(&valkey_server());
    for front in [Front::Sync, Front::Async] {
        let clock = MockClock::new();
        let cache = cache_on(&server, &clock, &unique_flavor("ifeq"), front);
        cache.ping().unwrap();
        let loads = AtomicUsize::new(0);
        let load = |v: u32| {
            let loads = &loads;
            move || {
                loads.fetch_add(1, Ordering::SeqCst);
                Ok::<_, Failed>(v)
            }
        };

        // Loaded once, stored, then served.
        assert_eq!(cache.get_or_set_with("k", TTL, load(1)).unwrap(), 1);
        assert_eq!(cache.get_or_set_with("k", TTL, load(9)).unwrap(), 1);
        assert_eq!(loads.load(Ordering::SeqCst), 1, "{front:?}");

        // Stale: claimed by one reader, served to the others, reloaded and stored.
        clock.advance(TTL + Duration::from_secs(1));
        assert_eq!(cache.get::<u32>("k").unwrap(), None, "the claiming reader");
        assert_eq!(cache.get::<u32>("k").unwrap(), Some(1), "the others: stale");
        cache.set("k", &2u32, TTL).unwrap();
        clock.advance(TTL + Duration::from_secs(1));
        assert_eq!(cache.get_or_set_with("k", TTL, load(3)).unwrap(), 3);
        assert_eq!(cache.get::<u32>("k").unwrap(), Some(3));
        assert_eq!(loads.load(Ordering::SeqCst), 2, "{front:?}");

        // A delete while the load runs: its fenced store does not undo it.
        let key = cache.make_key("gone");
        let r = cache.get_or_set_with("gone", TTL, || {
            let _: () = crate::redis::raw(&server).del(&key).unwrap();
            Ok::<_, Failed>(5u32)
        });
        assert_eq!(r.unwrap(), 5, "the caller gets its load");
        assert_eq!(raw_get(&server, &key), None, "the invalidation holds");
        assert_eq!(cache.get::<u32>("gone").unwrap(), None);

        // Batches too.
        let got = cache
            .get_many_or_set_with(&["b1", "b2"], TTL, |keys| {
                Ok::<_, Failed>(keys.iter().map(|k| (k.clone(), 4u32)).collect())
            })
            .unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(cache.get::<u32>("b1").unwrap(), Some(4));

        // Counters need scripting.
        cache.set_counter("n", 1, TTL).unwrap();
        assert!(cache.incr("n", 1).unwrap_err().is_unsupported());
        assert_eq!(cache.stats().backend_errors, 0, "{front:?}");
    }
}

/// The probe of what a node offers is sent once per node, whatever the calls after it.
#[test]
fn a_node_is_probed_for_scripting_once() {
    crate::redis::on_both(|server| {
        let clock = MockClock::new();
        let flavor = unique_flavor("probed-once");
        for front in [Front::Sync, Front::Async] {
            let cache = cache_on(server, &clock, &flavor, front);
            for i in 0..5u32 {
                let key = format!("k{i}");
                assert_eq!(
                    cache
                        .get_or_set_with(&key, TTL, || Ok::<_, Failed>(i))
                        .unwrap(),
                    i
                );
                cache.set_counter("n", 1, TTL).unwrap();
                assert_eq!(cache.incr("n", 1).unwrap(), 2);
            }
            cache.ping().unwrap();
        }
        let stats: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut crate::redis::raw(server))
            .unwrap();
        let docs = stats
            .lines()
            .find(|l| l.starts_with("cmdstat_command|docs:"))
            .unwrap_or_default();
        // One per view (each front end builds its own cache here).
        assert!(docs.starts_with("cmdstat_command|docs:calls=2,"), "{docs}");
    });
}

/// A forwarder to a server that, when a client's bytes hold a `SET … IFEQ`, first runs the
/// armed write on the server itself: a write landing between a fenced store's read of the key
/// and its `SET`.
struct Interpose {
    addr: String,
    armed: Armed,
}

/// The write an [`Interpose`] runs next, if armed.
type Armed = Arc<Mutex<Option<Box<dyn FnOnce() + Send>>>>;

impl Interpose {
    fn new(upstream: String) -> Interpose {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let armed: Armed = Arc::default();
        let hook = armed.clone();
        thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let server = TcpStream::connect(&upstream).unwrap();
                let (mut s_in, mut c_out) =
                    (server.try_clone().unwrap(), client.try_clone().unwrap());
                thread::spawn(move || {
                    let _ = std::io::copy(&mut s_in, &mut c_out);
                    let _ = c_out.shutdown(Shutdown::Both);
                });
                let hook = hook.clone();
                let (mut c_in, mut s_out) = (client, server);
                thread::spawn(move || {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = match c_in.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        if buf[..n].windows(4).any(|w| w == b"IFEQ") {
                            if let Some(write) = hook.lock().unwrap().take() {
                                write();
                            }
                        }
                        if s_out.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = s_out.shutdown(Shutdown::Both);
                });
            }
        });
        Interpose { addr, armed }
    }

    /// Runs `write` before the next `SET … IFEQ` reaches the server.
    fn arm(&self, write: impl FnOnce() + Send + 'static) {
        *self.armed.lock().unwrap() = Some(Box::new(write));
    }

    fn fired(&self) -> bool {
        self.armed.lock().unwrap().is_none()
    }
}

/// On Valkey without scripting a loader's store is `SET … IFEQ` the bytes it read: a write or a
/// delete that lands after that read and before the `SET` is kept, never overwritten.
#[test]
fn a_write_between_the_read_and_the_set_ifeq_is_kept() {
    let server = without_scripting(&valkey_server());
    let proxy = Interpose::new(format!("127.0.0.1:{}", server.port));
    let url = format!("redis://{}/0", proxy.addr);
    for front in [Front::Sync, Front::Async] {
        let cache = Cache::builder()
            .redis(url.clone())
            .flavor(unique_flavor("ifeq-window"))
            .build_front(front);

        // Another client's value lands in the window: the load is returned, not stored.
        let key = cache.make_key("w");
        let (raw_url, k) = (server.url(), key.clone());
        proxy.arm(move || {
            let mut c = redis::Client::open(raw_url)
                .unwrap()
                .get_connection()
                .unwrap();
            let _: () = c.set(&k, "another client's value").unwrap();
        });
        assert_eq!(
            cache
                .get_or_set_with("w", TTL, || Ok::<_, Failed>(5u32))
                .unwrap(),
            5
        );
        assert!(proxy.fired(), "{front:?}: the store went as SET IFEQ");
        assert_eq!(
            raw_get(&server, &key).as_deref(),
            Some(&b"another client's value"[..]),
            "{front:?}"
        );
        assert_eq!(cache.stats().loads_superseded, 1, "{front:?}");

        // A delete lands in the window: the invalidation holds.
        let key = cache.make_key("d");
        let (raw_url, k) = (server.url(), key.clone());
        proxy.arm(move || {
            let mut c = redis::Client::open(raw_url)
                .unwrap()
                .get_connection()
                .unwrap();
            let _: () = c.del(&k).unwrap();
        });
        assert_eq!(
            cache
                .get_or_set_with("d", TTL, || Ok::<_, Failed>(6u32))
                .unwrap(),
            6
        );
        assert!(proxy.fired(), "{front:?}");
        assert_eq!(raw_get(&server, &key), None, "{front:?}");
    }
}
