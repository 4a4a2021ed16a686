//! Fault tests against real memcached processes: a server killed and restarted under load, a hung
//! server in a cluster, a server restarted empty under a hot key. Each prints what it counted.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use newcache::{Backend, Cache, FailurePolicy, MemcachedBackend, MemcachedConfig, ServerSpec, Ttl};

use crate::fixture::{Memcached, memcached_backend, unique_flavor};

const MS: fn(u64) -> Duration = Duration::from_millis;

/// Which of `keys` the server at `addr` holds (read through a client of that server alone).
fn held_by(cache: &Cache, addr: &str, keys: &[String]) -> Vec<String> {
    let raw = MemcachedBackend::new(MemcachedConfig::new(vec![ServerSpec::parse(addr).unwrap()]))
        .unwrap();
    let derived: Vec<String> = keys.iter().map(|k| cache.make_key(k)).collect();
    let refs: Vec<&str> = derived.iter().map(String::as_str).collect();
    let found = raw.get_many(&refs);
    keys.iter()
        .zip(found)
        .filter(|(_, item)| item.as_ref().unwrap().is_some())
        .map(|(k, _)| k.clone())
        .collect()
}

#[derive(Default, Debug, Clone)]
struct Phase {
    ops: u64,
    errors: u64,
    misses: u64,
    first_error: Option<String>,
}

impl Phase {
    fn error(&mut self, e: newcache::Error) {
        self.errors += 1;
        self.first_error.get_or_insert_with(|| {
            format!(
                "{e} ({:?})",
                std::error::Error::source(&e).map(ToString::to_string)
            )
        });
    }
}

/// Three servers, 16 threads of mixed get/set/get_many/incr for 10 s; one server is killed at 3 s
/// and restarted (empty) at 6 s. No panic, no wrong value, no counter going backwards, and the
/// restarted server serves again within 2 s.
#[test]
fn a_cluster_keeps_serving_through_a_killed_and_restarted_server() {
    let mut servers: Vec<Memcached> = (0..3).map(|_| Memcached::start()).collect();
    let addrs: Vec<String> = servers.iter().map(Memcached::addr).collect();
    let cache = Cache::builder()
        .memcached(&addrs)
        .flavor(unique_flavor("fault"))
        .connect_timeout(MS(200))
        .io_timeout(MS(200))
        .retry_interval(MS(500))
        .build()
        .unwrap();

    // Keys the victim holds, to time its return.
    let probe_keys: Vec<String> = (0..60).map(|i| format!("probe:{i}")).collect();
    for k in &probe_keys {
        cache.set(k, k, Ttl::Never).unwrap();
    }
    let victim_keys = held_by(&cache, &addrs[1], &probe_keys);
    assert!(victim_keys.len() >= 5, "the victim holds some keys");

    let phase = Arc::new(AtomicUsize::new(0)); // 0 before the kill, 1 dead, 2 restarted
    let stop = Arc::new(AtomicBool::new(false));
    let stats: Arc<Mutex<[Phase; 3]>> = Arc::default();
    let wrong = Arc::new(AtomicU64::new(0));
    let first_wrong: Arc<Mutex<Option<String>>> = Arc::default();
    // A second client on the same servers, for per-key answers (the facade folds a batch).
    let raw = MemcachedBackend::new(MemcachedConfig::new(
        addrs
            .iter()
            .map(|a| ServerSpec::parse(a).unwrap())
            .collect(),
    ))
    .unwrap();
    let t0 = Instant::now();
    let mut back_after = None;
    thread::scope(|s| {
        for t in 0..16u64 {
            let (cache, phase, stop, stats, wrong, raw) =
                (&cache, &phase, &stop, &stats, &wrong, &raw);
            let first_wrong = &first_wrong;
            s.spawn(move || {
                let keys: Vec<String> = (0..20).map(|i| format!("t{t}:k{i}")).collect();
                let derived: Vec<String> = keys.iter().map(|k| cache.make_key(k)).collect();
                let on_victim: Vec<bool> = derived.iter().map(|d| raw.server_of(d) == 1).collect();
                // What each key holds: `Some(v)` after a successful set of v; `None` before any,
                // or after a failed set (which may or may not have been applied).
                let mut expected: Vec<Option<String>> = vec![None; keys.len()];
                let bad = |what: String| {
                    wrong.fetch_add(1, Ordering::Relaxed);
                    first_wrong.lock().unwrap().get_or_insert(what);
                };
                let counter = format!("t{t}:hits");
                let mut last_count = 0u64;
                let mut seq = 0u64;
                let mut mine: [Phase; 3] = Default::default();
                while !stop.load(Ordering::Relaxed) {
                    // An op is counted in the phase seen when it ends: one that ends before the
                    // kill was announced ran entirely with every server up.
                    let mut st = Phase::default();
                    // four operations per key in turn: set, get, get_many, incr
                    let ki = ((seq / 4) % 20) as usize;
                    let k = &keys[ki];
                    seq += 1;
                    st.ops += 1;
                    // A key may be missing only if its value is unknown, or its server was killed.
                    let miss_ok = |i: usize, expected: &[Option<String>]| {
                        expected[i].is_none() || (on_victim[i] && phase.load(Ordering::Relaxed) > 0)
                    };
                    match seq % 4 {
                        0 => {
                            let v = format!("{k}={seq}");
                            match cache.set(k, &v, Duration::from_secs(60)) {
                                Ok(()) => expected[ki] = Some(v),
                                Err(e) => {
                                    expected[ki] = None;
                                    st.error(e)
                                }
                            }
                        }
                        1 => match cache.get::<String>(k) {
                            Ok(Some(v)) if expected[ki].as_ref().is_some_and(|e| *e != v) => {
                                bad(format!("get {k}: {v:?}, expected {:?}", expected[ki]));
                            }
                            Ok(Some(_)) => {}
                            Ok(None) => {
                                st.misses += 1;
                                if !miss_ok(ki, &expected) {
                                    bad(format!("get {k}: a miss, expected {:?}", expected[ki]));
                                }
                            }
                            Err(e) => st.error(e),
                        },
                        2 => {
                            let refs: Vec<&str> = derived[..5].iter().map(String::as_str).collect();
                            for (i, r) in raw.get_many(&refs).into_iter().enumerate() {
                                match r {
                                    Ok(Some(item)) => {
                                        let v: String = newcache::__private::decode_envelope(
                                            item.flags,
                                            &item.value,
                                        )
                                        .unwrap();
                                        if expected[i].as_ref().is_some_and(|e| *e != v) {
                                            bad(format!(
                                                "get_many {}: {v:?}, expected {:?}",
                                                keys[i], expected[i]
                                            ));
                                        }
                                    }
                                    Ok(None) => {
                                        st.misses += 1;
                                        if !miss_ok(i, &expected) {
                                            bad(format!(
                                                "get_many {}: a miss, expected {:?}",
                                                keys[i], expected[i]
                                            ));
                                        }
                                    }
                                    Err(e) if on_victim[i] => st.error(e),
                                    Err(e) => bad(format!(
                                        "get_many {}: {e}: a live server's key failed",
                                        keys[i]
                                    )),
                                }
                            }
                        }
                        _ => match cache.incr(&counter, 1) {
                            Ok(n) if n <= last_count => {
                                bad(format!("{counter}: {n} after {last_count}"));
                            }
                            Ok(n) => last_count = n,
                            Err(e) if e.is_not_found() => {
                                // lost with its server: start again from what we had seen
                                st.misses += 1;
                                let _ = cache.set_counter(&counter, last_count, Ttl::Never);
                            }
                            Err(e) => st.error(e),
                        },
                    }
                    let p = phase.load(Ordering::Relaxed);
                    let m = &mut mine[p];
                    m.ops += st.ops;
                    m.errors += st.errors;
                    m.misses += st.misses;
                    if m.first_error.is_none() {
                        m.first_error = st.first_error;
                    }
                }
                let mut all = stats.lock().unwrap();
                for (a, m) in all.iter_mut().zip(mine) {
                    a.ops += m.ops;
                    a.errors += m.errors;
                    a.misses += m.misses;
                    if a.first_error.is_none() {
                        a.first_error = m.first_error;
                    }
                }
            });
        }
        thread::sleep(MS(3000));
        phase.store(1, Ordering::Relaxed);
        servers[1].kill();
        thread::sleep(MS(3000));
        servers[1].restart();
        let restarted = Instant::now();
        phase.store(2, Ordering::Relaxed);
        // Time until a key of the restarted server can be written and read again.
        let k = &victim_keys[0];
        while back_after.is_none() && restarted.elapsed() < Duration::from_secs(3) {
            if cache.set(k, k, Ttl::Never).is_ok()
                && cache.get::<String>(k).ok().flatten().as_ref() == Some(k)
            {
                back_after = Some(restarted.elapsed());
            } else {
                thread::sleep(MS(20));
            }
        }
        thread::sleep(MS(4000).saturating_sub(restarted.elapsed()));
        stop.store(true, Ordering::Relaxed);
    });
    let stats = stats.lock().unwrap().clone();
    for (name, p) in ["before the kill", "one server dead", "after the restart"]
        .iter()
        .zip(&stats)
    {
        println!(
            "fault test, {name}: {} ops, {} errors, {} misses; first error: {:?}",
            p.ops, p.errors, p.misses, p.first_error
        );
    }
    println!(
        "restarted server serving again after {back_after:?}; total {:?}",
        t0.elapsed()
    );
    assert_eq!(
        wrong.load(Ordering::Relaxed),
        0,
        "a wrong value, a lost value, a live server's key failing, or a counter going \
         backwards; first: {:?}",
        first_wrong.lock().unwrap()
    );
    assert_eq!(
        stats[0].errors, 0,
        "no errors while all servers are up: {:?}",
        stats[0].first_error
    );
    assert!(
        stats[1].errors + stats[1].misses > 0,
        "the dead server's keys did fail"
    );
    assert!(
        stats.iter().all(|p| p.ops > 100),
        "every phase made progress: {stats:?}"
    );
    let back = back_after.expect("the restarted server serves again");
    assert!(back < Duration::from_secs(2), "{back:?}");
}

/// A hung server (SIGSTOP) in a cluster: calls on its keys return within the timeout, the other
/// servers are unaffected, and after SIGCONT it is used again.
#[test]
fn a_hung_server_in_a_cluster() {
    let servers: Vec<Memcached> = (0..3).map(|_| Memcached::start()).collect();
    let addrs: Vec<String> = servers.iter().map(Memcached::addr).collect();
    let cache = Cache::builder()
        .memcached(&addrs)
        .flavor(unique_flavor("hung"))
        .read_failures(FailurePolicy::Propagate)
        .io_timeout(MS(300))
        .connect_timeout(MS(300))
        .retry_interval(MS(300))
        .build()
        .unwrap();
    let keys: Vec<String> = (0..60).map(|i| format!("k{i}")).collect();
    for k in &keys {
        cache.set(k, k, Ttl::Never).unwrap();
    }
    let hung = held_by(&cache, &addrs[2], &keys);
    let fine: Vec<&String> = keys.iter().filter(|k| !hung.contains(k)).collect();
    servers[2].signal("STOP");
    let mut slowest = Duration::ZERO;
    for k in hung.iter().take(5) {
        let t = Instant::now();
        assert!(cache.get::<String>(k).unwrap_err().is_backend());
        slowest = slowest.max(t.elapsed());
    }
    for k in fine.iter().take(10) {
        assert_eq!(cache.get::<String>(k).unwrap().as_ref(), Some(*k));
    }
    servers[2].signal("CONT");
    println!("hung server: slowest call {slowest:?}");
    // bounded by io_timeout (300 ms), with generous slack for a loaded machine: a caller is never
    // held by a hung server for long
    assert!(slowest < MS(3000), "{slowest:?}");
    let t = Instant::now();
    let k = &hung[0];
    loop {
        match cache.get::<String>(k) {
            Ok(Some(v)) => {
                assert_eq!(&v, k, "no stale reply read as an answer");
                break;
            }
            _ => {
                assert!(
                    t.elapsed() < Duration::from_secs(2),
                    "not used again after SIGCONT"
                );
                thread::sleep(MS(20));
            }
        }
    }
}

/// A hot key under `get_or_set_with` while its memcached is killed and restarted empty: leases and
/// claims recover by themselves, and no more than one load of the key ever runs at a time.
#[test]
fn herd_protection_and_leases_recover_after_a_restart_empty() {
    let mut server = Memcached::start();
    let cache = Cache::builder()
        .memcached([server.addr()])
        .flavor(unique_flavor("restart"))
        .connect_timeout(MS(200))
        .io_timeout(MS(200))
        .retry_interval(MS(300))
        .lease_ttl(Duration::from_secs(2))
        .build()
        .unwrap();
    let loads = AtomicU64::new(0);
    let running = AtomicU64::new(0);
    let max_running = AtomicU64::new(0);
    let load = || {
        let now = running.fetch_add(1, Ordering::SeqCst) + 1;
        max_running.fetch_max(now, Ordering::SeqCst);
        loads.fetch_add(1, Ordering::SeqCst);
        thread::sleep(MS(30));
        running.fetch_sub(1, Ordering::SeqCst);
        Ok::<_, io::Error>("v".to_string())
    };
    let stop = AtomicBool::new(false);
    let errors = AtomicU64::new(0);
    let mut loads_at: HashMap<&str, u64> = HashMap::new();
    thread::scope(|s| {
        for _ in 0..16 {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    match cache.get_or_set_with("hot", Duration::from_secs(30), load) {
                        Ok(v) => assert_eq!(v, "v"),
                        Err(_) => {
                            errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    thread::sleep(MS(5));
                }
            });
        }
        thread::sleep(MS(1000));
        loads_at.insert("before", loads.load(Ordering::SeqCst));
        server.kill();
        thread::sleep(MS(1000));
        server.restart();
        loads_at.insert("at restart", loads.load(Ordering::SeqCst));
        // Until a probe finds it back (retry interval 300 ms), misses still load, one at a time.
        thread::sleep(MS(600));
        loads_at.insert("0.6 s after", loads.load(Ordering::SeqCst));
        thread::sleep(MS(900));
        loads_at.insert("1.5 s after", loads.load(Ordering::SeqCst));
        stop.store(true, Ordering::Relaxed);
    });
    println!(
        "restart-empty test: loads {loads_at:?}, max concurrent loads {}, errors {}",
        max_running.load(Ordering::SeqCst),
        errors.load(Ordering::SeqCst)
    );
    assert_eq!(loads_at["before"], 1, "warm: one load");
    assert_eq!(
        max_running.load(Ordering::SeqCst),
        1,
        "never two loads of the key at once"
    );
    let settled = loads_at["1.5 s after"] - loads_at["0.6 s after"];
    assert_eq!(
        settled, 0,
        "once the server is back the key is refilled and served: {loads_at:?}"
    );
    // and the key is cached again, no lease left stuck: the loader would panic
    let v: String = cache
        .get_or_set_with("hot", Duration::from_secs(30), || -> io::Result<String> {
            panic!("cached")
        })
        .unwrap();
    assert_eq!(v, "v");
}

/// With `DeadServerPolicy::Remap`, a dead server's keys move to the others (like libmemcached's
/// auto-eject) and come back to it when it answers again.
#[test]
fn remap_moves_a_dead_servers_keys_and_brings_them_back() {
    let mut servers: Vec<Memcached> = (0..3).map(|_| Memcached::start()).collect();
    let addrs: Vec<String> = servers.iter().map(Memcached::addr).collect();
    let cache = Cache::builder()
        .memcached(&addrs)
        .flavor(unique_flavor("remap"))
        .dead_servers(newcache::DeadServerPolicy::Remap)
        .read_failures(FailurePolicy::Propagate)
        .failure_limit(1)
        .retry_interval(MS(300))
        .connect_timeout(MS(200))
        .build()
        .unwrap();
    let keys: Vec<String> = (0..60).map(|i| format!("k{i}")).collect();
    for k in &keys {
        cache.set(k, k, Ttl::Never).unwrap();
    }
    let moved = held_by(&cache, &addrs[0], &keys);
    let k = &moved[0];
    servers[0].kill();
    // the pooled connection fails first (it may just be stale: the pool is dropped, nothing is
    // counted), then a fresh connect is refused: the failure that ejects the server
    assert!(cache.get::<String>(k).is_err(), "the stale connection");
    assert!(
        cache.get::<String>(k).is_err(),
        "the failure that ejects the server"
    );
    // now remapped: a miss on another server, then writable there
    assert_eq!(cache.get::<String>(k).unwrap(), None);
    cache.set(k, &"moved".to_string(), Ttl::Never).unwrap();
    assert_eq!(cache.get::<String>(k).unwrap().as_deref(), Some("moved"));
    let others: Vec<String> = keys
        .iter()
        .filter(|k| !moved.contains(k))
        .cloned()
        .collect();
    assert_eq!(
        cache.get::<String>(&others[0]).unwrap().as_ref(),
        Some(&others[0]),
        "unaffected"
    );
    // back: after the retry interval the key maps to the restarted (empty) server again
    servers[0].restart();
    thread::sleep(MS(400));
    let t = Instant::now();
    loop {
        match cache.get::<String>(k) {
            Ok(None) => break, // on its own, empty, server again
            _ if t.elapsed() < Duration::from_secs(2) => thread::sleep(MS(20)),
            other => panic!("the key did not map back: {other:?}"),
        }
    }
}

/// Failures are visible without flooding: one warning when a server goes bad, one when it is back,
/// however many requests fail in between.
#[test]
fn a_dead_server_logs_once_and_once_more_when_back() {
    use tracing::{Event, Level, Metadata, Subscriber, span};

    #[derive(Default)]
    struct Warnings(Mutex<Vec<String>>);
    struct Counter(Arc<Warnings>);
    impl Subscriber for Counter {
        fn enabled(&self, _: &Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &span::Attributes<'_>) -> span::Id {
            span::Id::from_u64(1)
        }
        fn record(&self, _: &span::Id, _: &span::Record<'_>) {}
        fn record_follows_from(&self, _: &span::Id, _: &span::Id) {}
        fn event(&self, e: &Event<'_>) {
            if *e.metadata().level() == Level::WARN {
                self.0.0.lock().unwrap().push(format!(
                    "{:?}",
                    e.fields().map(|f| f.name()).collect::<Vec<_>>()
                ));
            }
        }
        fn enter(&self, _: &span::Id) {}
        fn exit(&self, _: &span::Id) {}
    }

    // One warning when it goes bad, one when it is back: on memcached, and on Redis (with an
    // eviction policy fit for a cache, so that the check on first contact says nothing).
    let on = |b: newcache::CacheBuilder, switch: &mut dyn FnMut(bool)| {
        let warnings = Arc::new(Warnings::default());
        let cache = b
            .flavor(unique_flavor("log"))
            .retry_interval(MS(200))
            .connect_timeout(MS(100))
            .build()
            .unwrap();
        let warned = || warnings.0.lock().unwrap().len();
        logs_once_each_way(&cache, Counter(warnings.clone()), warned, switch);
        assert_eq!(warned(), 2, "and one when it is back");
    };
    let mut server = Memcached::start();
    let b = Cache::builder().memcached([server.addr()]);
    on(b, &mut |up| match up {
        false => server.kill(),
        true => server.restart(),
    });
    #[cfg(feature = "redis")]
    {
        let mut server = crate::fixture::RedisServer::start_with(
            "redis-server",
            &["--maxmemory-policy", "allkeys-lru"],
        );
        let b = Cache::builder().redis(server.url());
        on(b, &mut |up| match up {
            false => server.kill(),
            true => server.restart(),
        });
    }
}

/// Under `subscriber`: writes a key, takes the server down (`switch(false)`), reads 200 times
/// (each a counted miss, one warning in all by `warned`), brings it back (`switch(true)`) and
/// waits until it serves again.
fn logs_once_each_way<S: tracing::Subscriber + Send + Sync + 'static>(
    cache: &Cache,
    subscriber: S,
    warned: impl Fn() -> usize,
    switch: &mut dyn FnMut(bool),
) {
    crate::obs::scoped(subscriber, || {
        cache.set("k", "v", Ttl::Never).unwrap();
        switch(false);
        for _ in 0..200 {
            assert_eq!(cache.get::<String>("k").unwrap(), None, "a counted miss");
        }
        assert_eq!(warned(), 1, "one warning for 200 failed reads");
        let st = cache.stats();
        assert_eq!(st.backend_errors, 200);
        assert_eq!(st.backend_errors_absorbed, 200);
        switch(true);
        let t = Instant::now();
        while cache.set("k", "v", Ttl::Never).is_err() {
            assert!(t.elapsed() < Duration::from_secs(2), "not back");
            thread::sleep(MS(20));
        }
        for _ in 0..50 {
            assert_eq!(cache.get::<String>("k").unwrap().as_deref(), Some("v"));
        }
    });
}

/// What a batch read of `keys` returned, per key: the value found, `None` for a miss, `Err` for
/// a failed key.
type Answers = Vec<Result<Option<Vec<u8>>, newcache::Error>>;

fn read_all(b: &MemcachedBackend, keys: &[&str]) -> Answers {
    b.get_many(keys)
        .into_iter()
        .map(|r| r.map(|o| o.map(|i| i.value.to_vec())))
        .collect()
}

/// With one of three servers dead, a batch answers every live server's key exactly
/// and fails only the dead server's keys: when the dead server is first found (connect refused),
/// once it is marked dead (fail fast), and for writes and deletes too.
#[test]
fn one_dead_server_costs_only_its_own_keys() {
    let mut servers: Vec<Memcached> = (0..3).map(|_| Memcached::start()).collect();
    let addrs: Vec<String> = servers.iter().map(Memcached::addr).collect();
    let b = memcached_backend(&addrs, |c| {
        c.connect_timeout = MS(300);
        c.retry_interval = Duration::from_secs(30);
    });
    let keys: Vec<String> = (0..60).map(|i| format!("k{i}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let writes: Vec<newcache::Write<'_>> = refs
        .iter()
        .map(|k| newcache::Write {
            mode: newcache::StoreMode::Set,
            key: k,
            value: k.as_bytes(),
            flags: 0,
            exptime: 0,
        })
        .collect();
    assert!(b.store_many(&writes).iter().all(Result::is_ok));
    let dead: Vec<bool> = refs.iter().map(|k| b.server_of(k) == 1).collect();
    let on_dead = dead.iter().filter(|d| **d).count();
    assert!((5..=40).contains(&on_dead), "{on_dead} keys on the victim");
    servers[1].kill();
    // first discovery (refused connect), then past the failure limit (marked dead, fail fast)
    for round in 0..4 {
        let got = read_all(&b, &refs);
        let singles: Answers = refs
            .iter()
            .map(|k| b.get(k).map(|o| o.map(|i| i.value.to_vec())))
            .collect();
        for (i, (batch, single)) in got.iter().zip(&singles).enumerate() {
            if dead[i] {
                assert!(
                    batch.as_ref().unwrap_err().is_backend(),
                    "round {round}: {i}"
                );
                assert!(single.is_err());
            } else {
                assert_eq!(
                    batch.as_ref().unwrap().as_deref(),
                    Some(keys[i].as_bytes()),
                    "round {round}: key {i} of a live server"
                );
                assert_eq!(batch.as_ref().unwrap(), single.as_ref().unwrap());
            }
        }
        let found = got.iter().filter(|r| matches!(r, Ok(Some(_)))).count();
        assert_eq!(found, 60 - on_dead, "round {round}");
    }
    for (i, r) in b.store_many(&writes).iter().enumerate() {
        assert_eq!(r.is_err(), dead[i], "store_many {i}: {r:?}");
    }
    for (i, r) in b.delete_many(&refs).iter().enumerate() {
        match r {
            Ok(found) => assert!(!dead[i] && *found, "delete_many {i}"),
            Err(e) => assert!(dead[i] && e.is_backend(), "delete_many {i}: {e}"),
        }
    }
}

/// Under `DeadServerPolicy::Remap`, once the dead server is ejected its keys move to the live
/// servers: a batch then has no errors at all, and the live servers' keys are unaffected.
#[test]
fn remap_batches_move_an_ejected_servers_keys() {
    let mut servers: Vec<Memcached> = (0..3).map(|_| Memcached::start()).collect();
    let addrs: Vec<String> = servers.iter().map(Memcached::addr).collect();
    let b = memcached_backend(&addrs, |c| {
        c.dead_servers = newcache::DeadServerPolicy::Remap;
        c.failure_limit = 1;
        c.connect_timeout = MS(300);
        c.retry_interval = Duration::from_secs(30);
    });
    let keys: Vec<String> = (0..60).map(|i| format!("k{i}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    for k in &refs {
        b.store(newcache::Write::new(
            newcache::StoreMode::Set,
            k,
            k.as_bytes(),
            0,
            0,
        ))
        .unwrap();
    }
    let dead: Vec<bool> = refs.iter().map(|k| b.server_of(k) == 0).collect();
    servers[0].kill();
    // the batches that find the server dead (its pooled connection, then a refused connect):
    // only its keys fail
    for _ in 0..2 {
        for (i, r) in read_all(&b, &refs).iter().enumerate() {
            assert_eq!(r.is_err(), dead[i], "{i}: {r:?}");
        }
    }
    // ejected: its keys are now misses on the other servers, the rest unchanged
    for (i, r) in read_all(&b, &refs).iter().enumerate() {
        let want = (!dead[i]).then(|| keys[i].as_bytes().to_vec());
        assert_eq!(r.as_ref().unwrap(), &want, "{i}");
    }
}

/// A value over our item limit, written by another client to a server started with a
/// larger `-I`, is an error for its key only. It used to be read as a protocol error, counted as a
/// server failure, and eject a healthy server after two reads.
#[test]
fn a_foreign_over_limit_value_never_ejects_a_healthy_server() {
    let server = Memcached::start_with(&["-I", "2m"]);
    let foreign = memcache::connect(format!("memcache://{}?protocol=ascii", server.addr()))
        .expect("memcache client connects");
    let big = vec![b'z'; 1536 * 1024];
    foreign.set("big", big.as_slice(), 0).unwrap();
    foreign.set("small", b"s".as_slice(), 0).unwrap();
    let b = memcached_backend(&[server.addr()], |c| {
        c.failure_limit = 2;
        c.retry_interval = Duration::from_secs(30);
        c.pool_size = 1; // every call reuses the one connection: it must stay in step
    });
    for _ in 0..5 {
        let e = b.get("big").unwrap_err();
        assert!(e.is_too_large(), "{e}");
        let got = read_all(&b, &["small", "big", "small2"]);
        assert_eq!(got[0].as_ref().unwrap().as_deref(), Some(&b"s"[..]));
        assert!(got[1].as_ref().unwrap_err().is_too_large());
        assert_eq!(got[2].as_ref().unwrap(), &None);
        assert_eq!(
            b.get("small").unwrap().map(|i| i.value).as_deref(),
            Some(&b"s"[..]),
            "the server is still in use"
        );
    }
    // a complete error reply (CLIENT_ERROR ... non-numeric value) is an answer: never a failure
    for _ in 0..3 {
        assert!(b.incr("small", 1).unwrap_err().is_not_a_counter());
    }
    assert!(b.version(0).is_ok());
}

/// A server that swallows SYNs (its accept queue full) holds only the callers of its own keys:
/// with it blackholed, a healthy server's keys are served from threads that need new connections
/// (0.1.0 made every connection on a 2-thread connector shared by all servers, which the
/// blackholed connects filled). A healthy server restarted meanwhile serves again within 1 s.
#[test]
fn a_blackholed_server_never_delays_the_others() {
    // Fill the accept queue of a listener that never accepts: further connects hang.
    let hole = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let hole_addr = hole.local_addr().unwrap();
    let mut queued = Vec::new();
    loop {
        match std::net::TcpStream::connect_timeout(&hole_addr, MS(100)) {
            Ok(s) => queued.push(s),
            Err(_) => break,
        }
        assert!(queued.len() < 5000, "the accept queue never filled");
    }
    let mut healthy = Memcached::start();
    let addrs = vec![hole_addr.to_string(), healthy.addr()];
    let b = memcached_backend(&addrs, |c| {
        c.connect_timeout = MS(300);
        c.io_timeout = MS(300);
        c.retry_interval = MS(100);
        c.failure_limit = u32::MAX; // keep trying the blackholed server
    });
    let keys: Vec<String> = (0..200).map(|i| format!("k{i}")).collect();
    let (holed, fine): (Vec<&String>, Vec<&String>) =
        keys.iter().partition(|k| b.server_of(k) == 0);
    assert!(!holed.is_empty() && fine.len() >= 8);
    let stop = AtomicBool::new(false);
    let hung = AtomicU64::new(0);
    /// Stops the hammering threads however the test ends (a failed assertion included), so that
    /// the scope can join them.
    struct StopOnDrop<'a>(&'a AtomicBool);
    impl Drop for StopOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    thread::scope(|s| {
        let _stop = StopOnDrop(&stop);
        for t in 0..4 {
            let (b, stop, hung, holed) = (&b, &stop, &hung, &holed);
            s.spawn(move || {
                let mut i = t;
                while !stop.load(Ordering::Relaxed) {
                    assert!(b.get(holed[i % holed.len()]).is_err());
                    hung.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
            });
        }
        // 8 threads, each needing a new connection to the healthy server, while the blackholed
        // server's connects are in flight
        thread::sleep(MS(50));
        thread::scope(|s2| {
            for t in 0..8 {
                let (b, fine) = (&b, &fine);
                s2.spawn(move || {
                    for k in fine.iter().skip(t).step_by(8).take(10) {
                        let w = b.store(newcache::Write::new(
                            newcache::StoreMode::Set,
                            k,
                            k.as_bytes(),
                            0,
                            0,
                        ));
                        assert!(w.is_ok(), "set {k}: {w:?}");
                        let r = b.get(k).unwrap().map(|i| i.value);
                        assert_eq!(r.as_deref(), Some(k.as_bytes()));
                    }
                });
            }
        });
        // restart the healthy server under load; it serves again within 1 s
        healthy.restart();
        let restarted = Instant::now();
        let k = fine[0];
        loop {
            let ok = b
                .store(newcache::Write::new(
                    newcache::StoreMode::Set,
                    k,
                    b"again",
                    0,
                    0,
                ))
                .is_ok()
                && b.get(k).ok().flatten().map(|i| i.value).as_deref() == Some(&b"again"[..]);
            if ok {
                break;
            }
            assert!(
                restarted.elapsed() < Duration::from_secs(1),
                "the restarted server is not used again"
            );
            thread::sleep(MS(10));
        }
        stop.store(true, Ordering::Relaxed);
    });
    assert!(hung.load(Ordering::Relaxed) > 0);
    drop(queued);
}

/// A clean restart leaves the pool full of stale connections: the first one to fail drops them
/// all instead of counting toward ejection, so the restarted server serves again at the next
/// call, with the default settings (not ejected for a second with errors meanwhile).
#[test]
fn stale_pooled_connections_do_not_eject_a_restarted_server() {
    let mut server = Memcached::start();
    let cache = Cache::builder()
        .memcached([server.addr()])
        .flavor(unique_flavor("stale-pool"))
        .read_failures(FailurePolicy::Propagate)
        .build()
        .unwrap();
    cache.set("k", "v", Duration::from_secs(60)).unwrap();
    // eight connections in the pool
    let barrier = std::sync::Barrier::new(8);
    thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| {
                barrier.wait();
                for _ in 0..50 {
                    cache.get::<String>("k").unwrap();
                }
            });
        }
    });
    server.restart();
    let mut errors = 0;
    let mut served = false;
    for _ in 0..20 {
        match cache.set("k", "again", Duration::from_secs(60)) {
            Ok(()) => {
                served = true;
                break;
            }
            Err(_) => errors += 1,
        }
    }
    assert!(served, "never served again");
    assert!(
        errors <= 1,
        "{errors} errors before the restarted server served"
    );
    assert_eq!(cache.get::<String>("k").unwrap().as_deref(), Some("again"));
}

/// A timeout is the server's fault even on a connection reused from the pool (only a closed or
/// reset connection may just be stale): a hung server is marked dead after `failure_limit`
/// timeouts, and then fails fast, whatever the pool held.
#[test]
fn timeouts_on_pooled_connections_count_toward_ejection() {
    let server = Memcached::start();
    let cache = Cache::builder()
        .memcached([server.addr()])
        .flavor(unique_flavor("hung-pooled"))
        .read_failures(FailurePolicy::Propagate)
        .io_timeout(MS(200))
        .failure_limit(2)
        .retry_interval(Duration::from_secs(30))
        .build()
        .unwrap();
    cache.set("k", "v", Duration::from_secs(60)).unwrap();
    // warm connections in the pool
    let barrier = std::sync::Barrier::new(4);
    thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                barrier.wait();
                for _ in 0..20 {
                    cache.get::<String>("k").unwrap();
                }
            });
        }
    });
    server.signal("STOP");
    for _ in 0..2 {
        assert!(cache.get::<String>("k").unwrap_err().is_timeout());
    }
    let e = cache.get::<String>("k").unwrap_err();
    server.signal("CONT");
    assert!(
        format!("{e:?}").contains("marked dead"),
        "two timeouts mark it dead: {e}"
    );
}
