//! Behaviour that needs real memcached processes of its own: flushing, dead, hung and restarted
//! servers, several servers, and the few tests that must sleep through memcached's own expiry.

use std::collections::HashMap;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use newcache::{
    Backend, Cache, FailurePolicy, MemcachedBackend, MemcachedConfig, ServerSpec, StoreMode,
    StoreOutcome,
};

use crate::fixture::{Hooked, Memcached, memcached_backend, shared_server, unique_flavor};
use crate::front::{BuildFor, Front};

const S: fn(u64) -> Duration = Duration::from_secs;

fn cache_on(addrs: &[String]) -> Cache {
    Cache::builder()
        .memcached(addrs)
        .flavor(unique_flavor("mc"))
        .build()
        .unwrap()
}

#[test]
fn clear_flushes_the_server() {
    let server = Memcached::start();
    let cache = cache_on(&[server.addr()]);
    cache.set("a", &1u8, S(60)).unwrap();
    cache.with_version(9).set("b", &2u8, S(60)).unwrap();
    cache.clear().unwrap();
    assert_eq!(cache.get::<u8>("a").unwrap(), None);
    assert_eq!(cache.with_version(9).get::<u8>("b").unwrap(), None);
}

/// memcached's own expiry, in real time: set_many's values must outlive their soft expiry by the
/// herd timeout (django-newcache's set_many let memcached drop them at the soft expiry).
#[test]
fn set_many_hard_expiry_is_padded_in_real_time() {
    let cache = Cache::builder()
        .memcached([shared_server()])
        .flavor(unique_flavor("pad"))
        .herd_timeout(S(5))
        .build()
        .unwrap();
    cache.set_many([("a", &1u8), ("b", &2u8)], S(1)).unwrap();
    cache
        .set_with("plain", &3u8, S(1), newcache::Herd::Off)
        .unwrap();
    std::thread::sleep(Duration::from_millis(2100));
    assert_eq!(
        cache.get::<u8>("a").unwrap(),
        None,
        "claimed by this reader"
    );
    assert_eq!(
        cache.get::<u8>("a").unwrap(),
        Some(1),
        "still in memcached, served stale"
    );
    assert_eq!(cache.get::<u8>("b").unwrap(), None);
    assert_eq!(cache.get::<u8>("b").unwrap(), Some(2));
    assert_eq!(
        cache.get::<u8>("plain").unwrap(),
        None,
        "herd off: memcached dropped it at 1 s"
    );
}

#[test]
fn build_never_blocks_and_a_dead_server_fails_fast() {
    // build() never connects: a listener that never accepts sees no connection attempt.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let cache = Cache::builder()
        .memcached([listener.local_addr().unwrap().to_string()])
        .build()
        .unwrap();
    thread::sleep(Duration::from_millis(50));
    let accepted = listener.accept();
    assert!(
        matches!(&accepted, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "build() connected: {accepted:?}"
    );
    drop(cache);
    let port = {
        let s = Memcached::start();
        s.port
    }; // killed: nothing listens there now
    let strict = Cache::builder()
        .memcached([format!("127.0.0.1:{port}")])
        .read_failures(FailurePolicy::Propagate)
        .connect_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let t = Instant::now();
    let e = strict.get::<u8>("k").unwrap_err();
    assert!(e.is_backend(), "{e}");
    // a refused connection is not a timeout (0.1.0 reported every failed checkout as one)
    assert!(!e.is_timeout(), "{e}");
    // refused at once; bounded by connect_timeout in any case (generous slack for a busy host)
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    assert!(strict.set("k", &1u8, S(1)).unwrap_err().is_backend());
    assert!(strict.incr("k", 1).unwrap_err().is_backend());

    // the default read policy serves a miss and counts it
    let lenient = Cache::builder()
        .memcached([format!("127.0.0.1:{port}")])
        .connect_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    assert_eq!(lenient.get::<u8>("k").unwrap(), None);
    let st = lenient.stats();
    assert_eq!((st.backend_errors, st.backend_errors_absorbed), (1, 1));
}

#[test]
fn a_restarted_server_is_used_again() {
    let mut server = Memcached::start();
    let cache = Cache::builder()
        .memcached([server.addr()])
        .read_failures(FailurePolicy::Propagate)
        .connect_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    // several pooled connections, all of which the restart breaks
    std::thread::scope(|s| {
        for i in 0..8u8 {
            let cache = &cache;
            s.spawn(move || cache.set(&format!("k{i}"), &i, S(60)).unwrap());
        }
    });
    server.kill();
    assert!(cache.get::<u8>("k1").is_err());
    server.restart();
    let deadline = Instant::now() + S(2);
    loop {
        match cache.set("k1", &9u8, S(60)) {
            Ok(()) => break,
            Err(e) => assert!(Instant::now() < deadline, "not used again within 2 s: {e}"),
        }
    }
    // every pooled connection works again (the broken ones were dropped, not reused)
    for i in 0..32u8 {
        assert_eq!(
            cache.get::<u8>(&format!("k{}", i % 8)).unwrap(),
            if i % 8 == 1 { Some(9) } else { None }
        );
    }
}

#[test]
fn a_hung_server_cannot_hold_a_caller_past_the_timeout() {
    let server = Memcached::start();
    let cache = Cache::builder()
        .memcached([server.addr()])
        .read_failures(FailurePolicy::Propagate)
        .io_timeout(Duration::from_millis(300))
        .connect_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    cache.set("k", &1u8, S(60)).unwrap();
    server.signal("STOP");
    let t = Instant::now();
    let e = cache.get::<u8>("k").unwrap_err();
    let waited = t.elapsed();
    server.signal("CONT");
    assert!(e.is_timeout(), "{e}");
    // io_timeout (300 ms) plus generous slack for a loaded machine
    assert!(waited < Duration::from_secs(3), "{waited:?}");
    // the timed-out connection was dropped; its late reply cannot be read as another answer
    assert_eq!(cache.get::<u8>("k").unwrap(), Some(1));
    cache.set("k", &2u8, S(60)).unwrap();
    assert_eq!(cache.get::<u8>("k").unwrap(), Some(2));
}

#[test]
fn keys_spread_over_several_servers_and_batches_find_them() {
    let servers: Vec<Memcached> = (0..3).map(|_| Memcached::start()).collect();
    let addrs: Vec<String> = servers.iter().map(Memcached::addr).collect();
    let cache = cache_on(&addrs);
    let keys: Vec<String> = (0..300).map(|i| format!("key:{i}")).collect();
    let values: Vec<u32> = (0..300).collect();
    cache
        .set_many(
            keys.iter().zip(values.iter()).map(|(k, v)| (k.as_str(), v)),
            S(60),
        )
        .unwrap();
    let got: HashMap<String, u32> = cache.get_many(&keys).unwrap();
    assert_eq!(got.len(), 300);
    assert!(keys.iter().zip(&values).all(|(k, v)| got[k] == *v));
    // every server holds a fair share (ketama, 160 points each)
    let derived: Vec<String> = keys.iter().map(|k| cache.make_key(k)).collect();
    let refs: Vec<&str> = derived.iter().map(String::as_str).collect();
    for s in &servers {
        let raw = MemcachedBackend::new(MemcachedConfig::new(vec![
            ServerSpec::parse(&s.addr()).unwrap(),
        ]))
        .unwrap();
        let held = raw
            .get_many(&refs)
            .into_iter()
            .filter(|r| r.as_ref().unwrap().is_some())
            .count();
        assert!(
            (50..=150).contains(&held),
            "server {} holds {held} of 300",
            s.addr()
        );
    }
    assert_eq!(cache.delete_many(&keys).unwrap(), 300);
}

/// newcache bug 4: a late claim must never overwrite a fresh value written after the stale read.
#[test]
fn a_claim_never_overwrites_a_newer_value() {
    let clock = newcache::testing::MockClock::new();
    let flavor = unique_flavor("cas");
    let writer = Cache::builder()
        .memcached([shared_server()])
        .flavor(flavor.clone())
        .clock(clock.clone())
        .build()
        .unwrap();
    writer.set("k", &1u32, S(10)).unwrap();
    clock.advance(S(11));
    // Between the reader's gets and its cas, another process stores a fresh value.
    let fresh = writer.clone();
    let mut hooked = Hooked::new(Arc::new(
        MemcachedBackend::new(MemcachedConfig::new(vec![
            ServerSpec::parse(shared_server()).unwrap(),
        ]))
        .unwrap(),
    ));
    hooked.after_get = Box::new(move || {
        fresh.set("k", &2u32, S(1000)).unwrap();
    });
    let reader = Cache::builder()
        .backend(Arc::new(hooked))
        .flavor(flavor)
        .clock(clock.clone())
        .build()
        .unwrap();
    assert_eq!(
        reader.get::<u32>("k").unwrap(),
        Some(2),
        "lost the claim: serves what won (read back in the same round trip)"
    );
    assert_eq!(reader.stats().claims_won, 0);
    assert_eq!(
        writer.get::<u32>("k").unwrap(),
        Some(2),
        "the fresh value survived"
    );
    assert_eq!(writer.get::<u32>("k").unwrap(), Some(2));
}

/// twemproxy refuses `flush_all` (it closes the connection): `clear()` says so, and the cache
/// stays usable.
#[test]
fn clear_behind_twemproxy_is_a_clear_error() {
    let cache = Cache::builder()
        .memcached([crate::fixture::shared_twemproxy()])
        .flavor(unique_flavor("twem"))
        .build()
        .unwrap();
    cache.set("k", &1u8, S(60)).unwrap();
    let e = cache.clear().unwrap_err();
    assert!(e.is_unsupported(), "{e}");
    assert!(e.to_string().contains("flush_all"), "{e}");
    assert_eq!(cache.get::<u8>("k").unwrap(), Some(1));
    assert_eq!(
        cache.stats().backend_errors,
        0,
        "not counted as a server failure"
    );
}

/// memcached answers a too-long key with CLIENT_ERROR without reading the data block,
/// so the value's bytes ran as commands: this value flushed the server. Bad input is refused with
/// a typed error and nothing reaches the wire; in a batch, the bad entry fails alone.
#[test]
fn a_too_long_key_never_reaches_the_wire() {
    let server = Memcached::start();
    let backend = memcached_backend(&[server.addr()], |_| {});
    backend
        .store(newcache::Write::new(
            StoreMode::Set,
            "before",
            b"kept",
            0,
            0,
        ))
        .unwrap();
    let long = "k".repeat(262);
    let evil = b"x\r\nflush_all\r\n";
    let e = backend
        .store(newcache::Write::new(StoreMode::Set, &long, evil, 0, 0))
        .unwrap_err();
    assert!(e.is_invalid_key(), "{e}");
    let w = |key: &'static str| newcache::Write {
        mode: StoreMode::Set,
        key,
        value: evil,
        flags: 0,
        exptime: 0,
    };
    let long: &'static str = Box::leak(long.into_boxed_str());
    let results = backend.store_many(&[w("a"), w(long), w("b")]);
    assert_eq!(results[0].as_ref().unwrap(), &StoreOutcome::Stored);
    assert!(results[1].as_ref().unwrap_err().is_invalid_key());
    assert_eq!(results[2].as_ref().unwrap(), &StoreOutcome::Stored);
    assert!(backend.get(long).unwrap_err().is_invalid_key());
    assert!(backend.delete("a b").unwrap_err().is_invalid_key());
    let many = backend.get_many(&["a", long, "b"]);
    assert!(many[1].as_ref().unwrap_err().is_invalid_key());
    // an exptime memcached would read as negative (signed 32-bit) is refused, not sent
    let e = backend
        .store(newcache::Write::new(
            StoreMode::Set,
            "c",
            b"v",
            0,
            i32::MAX as u32 + 1,
        ))
        .unwrap_err();
    assert!(e.is_config(), "{e}");
    assert!(backend.touch("before", u32::MAX).unwrap_err().is_config());
    // nothing was flushed, and the values are exactly what was written
    let value = |k: &str| backend.get(k).unwrap().map(|i| i.value);
    assert_eq!(value("before").as_deref(), Some(&b"kept"[..]));
    assert_eq!(value("a").as_deref(), Some(&evil[..]));
    assert_eq!(value("b").as_deref(), Some(&evil[..]));
    assert_eq!(value("c"), None);
    assert_eq!(
        many[0].as_ref().unwrap().as_ref().map(|i| &i.value[..]),
        Some(&evil[..])
    );
}

/// A server that trickles its reply (one byte every 100 ms) cannot hold a caller past
/// `io_timeout`: the timeout bounds the whole operation, not each read.
#[test]
fn a_trickling_server_cannot_hold_a_caller_past_io_timeout() {
    use std::io::{BufRead, BufReader, Write as _};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            std::thread::spawn(move || {
                let mut line = String::new();
                let _ = BufReader::new(stream.try_clone().unwrap()).read_line(&mut line);
                let reply = format!("VALUE k 0 40 1\r\n{}\r\nEND\r\n", "v".repeat(40));
                for b in reply.bytes() {
                    if stream.write_all(&[b]).is_err() {
                        return; // the client gave up
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            });
        }
    });
    let backend = memcached_backend(&[addr], |c| {
        c.io_timeout = Duration::from_millis(300);
        c.connect_timeout = Duration::from_millis(300);
    });
    let t = Instant::now();
    let e = backend.get("k").unwrap_err();
    let waited = t.elapsed();
    assert!(e.is_timeout(), "{e}");
    // io_timeout is 300 ms; the trickle would take 6.5 s (generous slack for a busy host)
    assert!(waited < Duration::from_secs(3), "{waited:?}");
}

/// An error reply that leaves a connection usable for one command (`ERROR`, a proxy's refusal)
/// arriving in the middle of a pipelined batch: the decoder stops there, so the rest of the
/// batch's replies are unread and the connection is never reused; the next command gets its own
/// reply, not a stale one.
#[test]
fn an_error_reply_mid_batch_never_leaves_a_connection_out_of_step() {
    use std::io::{BufRead, BufReader, Write as _};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    // commands counted across connections
    let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let seen = seen.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut line = String::new();
                while reader.read_line(&mut line).unwrap_or(0) > 0 {
                    let n = seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                    // the first three deletes are one pipelined batch
                    let reply: &[u8] = match n {
                        1 => b"ERROR\r\n",
                        2 | 3 => b"DELETED\r\n",
                        _ => b"NOT_FOUND\r\n",
                    };
                    if stream.write_all(reply).is_err() {
                        return;
                    }
                    line.clear();
                }
            });
        }
    });
    let backend = memcached_backend(&[addr], |c| c.pool_size = 1);
    let got = backend.delete_many(&["a", "b", "c"]);
    assert!(got.iter().all(|r| r.is_err()), "{got:?}");
    // a fresh connection: the server's reply to this delete, not the batch's leftover DELETED
    assert!(!backend.delete("z").unwrap());
}

/// The sync cache from many threads at once, on memcached and through twemproxy, with and
/// without `pipelined_sync`: every thread reads its own writes and its own counter, and a value
/// written by one thread is read by all.
#[test]
fn many_threads_at_once_read_their_writes_pipelined_or_pooled() {
    for (server, pipelined) in [
        (shared_server(), true),
        (shared_server(), false),
        (crate::fixture::shared_twemproxy(), true),
    ] {
        let cache = Cache::builder()
            .memcached([server])
            .flavor(unique_flavor("threads"))
            .pipelined_sync(pipelined)
            .io_timeout(S(5))
            .build()
            .unwrap();
        cache.set("shared", &"everyone", S(60)).unwrap();
        let threads = 32;
        let start = std::sync::Barrier::new(threads);
        thread::scope(|s| {
            for t in 0..threads {
                let (cache, start) = (&cache, &start);
                s.spawn(move || {
                    start.wait();
                    let counter = format!("n{t}");
                    cache.set_counter(&counter, 0, S(60)).unwrap();
                    for i in 0..100u64 {
                        let key = format!("t{t}-{i}");
                        cache.set(&key, &(t, i), S(60)).unwrap();
                        assert_eq!(cache.get::<(usize, u64)>(&key).unwrap(), Some((t, i)));
                        assert_eq!(cache.incr(&counter, 1).unwrap(), i + 1);
                        let many: HashMap<String, String> =
                            cache.get_many(&["shared", "never-set"]).unwrap();
                        assert_eq!(many.get("shared").map(String::as_str), Some("everyone"));
                        assert!(cache.delete(&key).unwrap());
                    }
                });
            }
        });
        if pipelined {
            // 32 threads from one barrier overlapped: this cache's engine thread runs (other
            // tests' engines can only add to the count, and this one lives until `cache` drops).
            assert!(
                engine_threads() >= 1,
                "the concurrent callers used the engine"
            );
        }
    }
}

/// Threads named `newcache-engine` in this process.
fn engine_threads() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |tasks| {
        tasks
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .filter(|name| name.trim() == "newcache-engine")
            .count()
    })
}

#[test]
fn pipelined_sync_needs_a_connection() {
    let err = Cache::builder()
        .memcached([shared_server()])
        .async_connections(0)
        .build()
        .unwrap_err();
    assert!(err.is_config(), "{err}");
    // Without it too: the cache's async view (`to_async`) uses them.
    let err = Cache::builder()
        .memcached([shared_server()])
        .async_connections(0)
        .pipelined_sync(false)
        .build()
        .unwrap_err();
    assert!(err.is_config(), "{err}");
}

/// The sync `Cache` called from a tokio task (a `#[tokio::main]` body, say) while
/// another thread also uses it: after about 128 calls that went through the engine in one
/// poll of the task, the task's coop budget is spent and the call never returns (it spins).
#[test]
fn a_tokio_task_making_many_sync_calls_while_another_thread_works_finishes() {
    let cache = Cache::builder()
        .memcached([shared_server()])
        .flavor(unique_flavor("coop"))
        .build()
        .unwrap();
    cache.set("y", &1u32, S(60)).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let background = {
        let (cache, stop) = (cache.clone(), stop.clone());
        thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = cache.get::<u32>("x");
            }
        })
    };
    {
        let cache = cache.clone();
        thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                for _ in 0..2000 {
                    assert_eq!(cache.get::<u32>("y").unwrap(), Some(1));
                }
            });
            let _ = done_tx.send(());
        });
    }
    let finished = done_rx
        .recv_timeout(std::time::Duration::from_secs(20))
        .is_ok();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    background.join().unwrap();
    assert!(
        finished,
        "2000 sync gets from one tokio task did not finish in 20 s"
    );
}

/// A cache of `front` on `addr` with a flavor of its own, and the mock clock it runs on.
fn on_mock_clock(
    addr: &str,
    front: Front,
) -> (crate::front::TestCache, Arc<newcache::testing::MockClock>) {
    let clock = newcache::testing::MockClock::new();
    let cache = Cache::builder()
        .memcached([addr])
        .flavor(unique_flavor("nocas"))
        .clock(clock.clone())
        .build_front(front);
    (cache, clock)
}

/// memcached started with `-C` reports cas 0 for every item and answers EXISTS to every `cas`:
/// each load used to be returned and never stored, its placeholder left to keep other
/// processes waiting until `max_wait`, and `touch` said `false`. Now what needs CAS fails with
/// an error that names the server and `-C`, nothing is left behind, and the rest works.
#[test]
fn a_server_without_cas_fails_clearly_and_blocks_no_one() {
    use std::sync::atomic::{AtomicUsize, Ordering};

    let server = Memcached::start_with(&["-C"]);
    let addr = server.addr();
    let raw = memcache::connect(format!("memcache://{addr}?protocol=ascii")).unwrap();
    for front in [Front::Sync, Front::Async] {
        let (cache, clock) = on_mock_clock(&addr, front);
        let no_cas = |e: newcache::Error| {
            assert!(
                e.is_unsupported() && e.to_string().contains("-C") && e.server() == Some(&addr),
                "{front:?}: {e}"
            );
        };
        // what needs no CAS works
        cache.set("k", &1u8, S(60)).unwrap();
        assert_eq!(cache.get::<u8>("k").unwrap(), Some(1));
        assert!(cache.delete("k").unwrap());
        cache.set_counter("n", 1, S(60)).unwrap();
        assert_eq!(cache.incr("n", 2).unwrap(), 3);
        // a load: the error before the loader runs, and no placeholder left behind
        let loads = AtomicUsize::new(0);
        let e = cache
            .get_or_set_with("k", S(60), || {
                loads.fetch_add(1, Ordering::SeqCst);
                Ok::<_, std::io::Error>(5u8)
            })
            .unwrap_err();
        no_cas(e.into());
        assert_eq!(loads.load(Ordering::SeqCst), 0);
        assert_eq!(raw.get::<Vec<u8>>(&cache.make_key("k")).unwrap(), None);
        // the batch loader loads its keys without storing them (as a failed server's): the
        // batch's other keys go on
        let got = cache
            .get_many_or_set_with(&["x", "y"], S(60), |keys| {
                loads.fetch_add(1, Ordering::SeqCst);
                Ok::<_, std::io::Error>(keys.iter().map(|k| (k.clone(), 1u8)).collect())
            })
            .unwrap();
        assert_eq!(
            (got["x"], got["y"], loads.load(Ordering::SeqCst)),
            (1, 1, 1)
        );
        for k in ["x", "y"] {
            assert_eq!(raw.get::<Vec<u8>>(&cache.make_key(k)).unwrap(), None);
        }
        // touch, and an add over a stale value, need CAS; a stale read is served unclaimed
        cache.set("old", &2u8, S(10)).unwrap();
        no_cas(cache.touch("old", S(60)).unwrap_err());
        clock.advance(S(11));
        assert_eq!(cache.get::<u8>("old").unwrap(), Some(2));
        assert_eq!(cache.get_many::<u8>(&["old"]).unwrap().get("old"), Some(&2));
        no_cas(cache.add("old", &3u8, S(60)).unwrap_err());
        let e = cache
            .get_or_set_with("old", S(60), || Ok::<_, std::io::Error>(9u8))
            .unwrap_err();
        no_cas(e.into());
    }
}

/// A batch on a `-C` server with one stale key and one missing key: both are loaded, neither is
/// stored, and no placeholder is left under the missing key (other callers would wait on it).
#[test]
fn a_batch_on_a_server_without_cas_leaves_no_placeholder() {
    let server = Memcached::start_with(&["-C"]);
    let addr = server.addr();
    let raw = memcache::connect(format!("memcache://{addr}?protocol=ascii")).unwrap();
    for front in [Front::Sync, Front::Async] {
        let (cache, clock) = on_mock_clock(&addr, front);
        cache.set("stale", &1u8, S(10)).unwrap();
        clock.advance(S(11));
        // both keys are loaded (nothing can fence their store) and not stored
        let got = cache
            .get_many_or_set_with(&["stale", "missing"], S(60), |keys| {
                Ok::<_, std::io::Error>(keys.iter().map(|k| (k.clone(), 2u8)).collect())
            })
            .unwrap();
        assert_eq!((got["stale"], got["missing"]), (2, 2), "{front:?}");
        assert_eq!(
            raw.get::<Vec<u8>>(&cache.make_key("missing")).unwrap(),
            None,
            "{front:?}: the batch left a placeholder under the missing key"
        );
    }
}

/// Two servers, one with `-C`: a batch over both loads and stores the healthy server's keys; the
/// `-C` server's keys are loaded unstored, never the batch's error.
#[test]
fn a_server_without_cas_fails_only_its_own_keys_in_a_batch() {
    let good = Memcached::start();
    let nocas = Memcached::start_with(&["-C"]);
    let addrs = [good.addr(), nocas.addr()];
    let raw_good = memcache::connect(format!("memcache://{}?protocol=ascii", addrs[0])).unwrap();
    let cache = Cache::builder()
        .memcached(addrs.iter().map(String::as_str))
        .flavor(unique_flavor("nocas-mixed"))
        .build()
        .unwrap();
    // one key on each server
    let (mut on_good, mut on_nocas) = (None, None);
    for i in 0..64 {
        let k = format!("k{i}");
        cache.set(&k, &0u8, S(60)).unwrap();
        if raw_good
            .get::<Vec<u8>>(&cache.make_key(&k))
            .unwrap()
            .is_some()
        {
            on_good.get_or_insert(k);
        } else {
            on_nocas.get_or_insert(k);
        }
    }
    let (a, b) = (on_good.unwrap(), on_nocas.unwrap());
    cache.delete_many(&[&a, &b]).unwrap();
    // the good server's key alone loads and stores
    let alone: u8 = cache
        .get_or_set_with(&a, S(60), || Ok::<_, std::io::Error>(1u8))
        .unwrap();
    assert_eq!(alone, 1);
    cache.delete(&a).unwrap();
    let got = cache.get_many_or_set_with(&[&a, &b], S(60), |keys| {
        Ok::<_, std::io::Error>(keys.iter().map(|k| (k.clone(), 7u8)).collect())
    });
    match got {
        Ok(m) => assert_eq!(m.get(&a), Some(&7)),
        Err(e) => panic!("the -C server's key failed the healthy server's key too: {e}"),
    }
}

/// A server list from an environment variable: `.memcached([list])` built as one server named
/// `127.0.0.1:21311,127.0.0.1` and failed at the first write; it is refused at `build()` now,
/// and `memcached_list` splits it (keys placed as on the same servers given one by one).
#[test]
fn a_server_list_is_split_by_memcached_list_and_refused_whole() {
    let e = Cache::builder()
        .memcached(["127.0.0.1:21311,127.0.0.1:21312"])
        .build()
        .unwrap_err();
    assert!(e.is_config() && e.to_string().contains("parse_list"), "{e}");
    for bad in ["tcp://127.0.0.1:11211", "unix:/tmp/mc.sock"] {
        let e = Cache::builder().memcached([bad]).build().unwrap_err();
        assert!(e.is_config(), "{bad}: {e}");
    }
    let e = Cache::builder()
        .memcached_list("127.0.0.1:1, nohost")
        .build()
        .unwrap_err();
    assert!(e.is_config() && e.to_string().contains("nohost"), "{e}");
    let (a, b) = (Memcached::start(), Memcached::start());
    let flavor = unique_flavor("list");
    let listed = Cache::builder()
        .memcached_list(&format!(" {}, {} ", a.addr(), b.addr()))
        .flavor(&flavor)
        .build()
        .unwrap();
    let one_by_one = Cache::builder()
        .memcached([a.addr(), b.addr()])
        .flavor(&flavor)
        .build()
        .unwrap();
    for i in 0..20 {
        listed.set(&format!("k{i}"), &i, S(60)).unwrap();
        assert_eq!(one_by_one.get::<i32>(&format!("k{i}")).unwrap(), Some(i));
    }
}
