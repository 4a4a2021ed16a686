//! The near tier (`CacheBuilder::near_cache`) on real servers (memcached, Redis 7, the Redis
//! Cluster) and on the memory backend: a copy is never served after a write of this process to
//! its key returned (however the write was made, whichever view made it, whether its future
//! was awaited or dropped, and however a read raced it); another process's write is seen once
//! the near ttl has passed; an outage is bridged within the staleness bound; the tier stays
//! within its capacity. Time is the caches' `MockClock`: a copy ages only when a test says so.

use std::collections::HashMap;
use std::future::Future;
use std::io::{Read, Write as _};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::task::Poll;
use std::thread;
use std::time::{Duration, Instant};

use newcache::testing::MockClock;
use newcache::{AsyncCache, Cache, CacheBuilder, Stats};

use crate::fixture::{Env, Hooked, Kind, Memcached, unique_flavor};
use crate::front::runtime;

const S: fn(u64) -> Duration = Duration::from_secs;
const MS: fn(u64) -> Duration = Duration::from_millis;

/// The near tier of these tests: 1 MiB, the default near ttl (5 s).
const CAPACITY: u64 = 1 << 20;

/// Generates each listed test once per backend (`memory::name`, `memcached::name`,
/// `redis::name`, `redis_cluster::name`), each calling `name(&Env)`.
macro_rules! on_near_backends {
    ($($name:ident),* $(,)?) => {
        on_near_backend!(memory, Memory, $($name),*);
        on_servers!($($name),*);
    };
}

/// [`on_near_backends`] on the real servers only.
macro_rules! on_servers {
    ($($name:ident),* $(,)?) => {
        on_near_backend!(memcached, Memcached, $($name),*);
        #[cfg(feature = "redis")]
        on_near_backend!(redis, Redis, $($name),*);
        #[cfg(feature = "redis")]
        on_near_backend!(redis_cluster, RedisCluster, $($name),*);
    };
}

macro_rules! on_near_backend {
    ($module:ident, $kind:ident, $($name:ident),*) => {
        mod $module {
            $(
                #[test]
                fn $name() {
                    let env = $crate::fixture::Env::new(
                        $crate::fixture::Kind::$kind,
                        stringify!($name),
                    );
                    super::$name(&env)
                }
            )*
        }
    };
}

mod every_backend {
    use super::*;

    on_near_backends!(
        a_read_answered_before_an_own_write_returned_is_not_kept,
        own_writes_are_never_served_after_they_return,
        a_clear_stops_every_copy,
        the_tier_stays_within_its_capacity,
        large_values_are_never_held_near,
        get_many_serves_near_hits_and_fetches_the_rest_in_one_batch,
        one_key_read_as_two_types,
        a_compressed_value_is_served_near,
        a_task_answered_by_near_hits_lets_other_tasks_run,
        a_key_asked_for_twice_is_one_hit,
    );
}

mod servers {
    use super::*;

    on_servers!(
        another_caches_write_is_seen_once_the_near_ttl_passed,
        caches_over_one_server_list_see_each_others_writes_at_once,
        dropped_futures_leave_no_copy_the_store_does_not_hold,
        on_an_in_process_bus_another_caches_write_is_seen_at_once,
    );
}

/// A builder of `env`'s backend with a near tier.
fn near(env: &Env) -> CacheBuilder {
    env.builder().near_cache(CAPACITY)
}

/// How much the counter `f` reads grew from `before` to `after`.
fn delta(before: &Stats, after: &Stats, f: fn(&Stats) -> u64) -> u64 {
    f(after) - f(before)
}

/// Reads `key` twice through `cache`; the second read must be a near hit (the copy is there to
/// be wrongly served by what follows).
fn filled(cache: &Cache, key: &str, want: &str) {
    assert_eq!(cache.get::<String>(key).unwrap().as_deref(), Some(want));
    let before = cache.stats();
    assert_eq!(cache.get::<String>(key).unwrap().as_deref(), Some(want));
    assert_eq!(
        delta(&before, &cache.stats(), |s| s.near_hits),
        1,
        "the second read of {key} is a near hit"
    );
}

/// What a backend's reader is held at: after its `get` was answered, until the test lets it
/// go. Armed for one `get`.
struct Held {
    armed: AtomicBool,
    answered: Barrier,
    go: Barrier,
}

/// A cache with a near tier over `env`'s backend wrapped in a [`Hooked`] whose next `get`,
/// once armed, is held after its answer.
fn held_cache(env: &Env) -> (Cache, Arc<Hooked>, Arc<Held>) {
    let held = Arc::new(Held {
        armed: AtomicBool::new(false),
        answered: Barrier::new(2),
        go: Barrier::new(2),
    });
    let h = held.clone();
    let hooked = Arc::new(Hooked {
        after_get: Box::new(move || {
            if h.armed.swap(false, Ordering::SeqCst) {
                h.answered.wait();
                h.go.wait();
            }
        }),
        ..Hooked::new(env.backend())
    });
    let cache = near(env).backend(hooked.clone()).build().unwrap();
    (cache, hooked, held)
}

/// The late-read race: a reader's shared read finds the old value, and is answered, before
/// this process's `delete` / `set` of the key is sent; the reader then fills its copy only
/// after the write returned. The reader may return the old value (its read overlapped the
/// write), but the copy is not kept (`near_refused`): the next read sees the write.
fn a_read_answered_before_an_own_write_returned_is_not_kept(env: &Env) {
    type Write = fn(&Cache, &str);
    let writes: [(&str, Write, Option<&str>); 2] = [
        ("delete", |c, k| assert!(c.delete(k).unwrap()), None),
        ("set", |c, k| c.set(k, "new", S(60)).unwrap(), Some("new")),
    ];
    let (cache, _, held) = held_cache(env);
    for (name, write, after) in writes {
        let key = format!("late-{name}");
        cache.set(&key, "old", S(60)).unwrap();
        let before = cache.stats();
        held.armed.store(true, Ordering::SeqCst);
        thread::scope(|s| {
            let reader = s.spawn(|| cache.get::<String>(&key).unwrap());
            held.answered.wait();
            write(&cache, &key);
            held.go.wait();
            assert_eq!(
                reader.join().unwrap().as_deref(),
                Some("old"),
                "the reader's read was answered before the {name}"
            );
        });
        assert_eq!(
            delta(&before, &cache.stats(), |s| s.near_refused),
            1,
            "the late read's copy is refused ({name})"
        );
        for _ in 0..3 {
            assert_eq!(
                cache.get::<String>(&key).unwrap().as_deref(),
                after,
                "a read after the {name} returned"
            );
        }
    }
    // Without a write in between, the same read fills its copy.
    cache.set("late-none", "v", S(60)).unwrap();
    held.armed.store(true, Ordering::SeqCst);
    thread::scope(|s| {
        let reader = s.spawn(|| cache.get::<String>("late-none").unwrap());
        held.answered.wait();
        held.go.wait();
        assert_eq!(reader.join().unwrap().as_deref(), Some("v"));
    });
    let before = cache.stats();
    assert_eq!(
        cache.get::<String>("late-none").unwrap().as_deref(),
        Some("v")
    );
    assert_eq!(delta(&before, &cache.stats(), |s| s.near_hits), 1);
}

/// Runs the sync call or awaits the async one.
macro_rules! either {
    ($asynch:expr, $sync:expr, $fut:expr) => {
        if $asynch {
            runtime().block_on($fut)
        } else {
            $sync
        }
    };
}

/// A read through one view of the cache: the sync one, or the async one.
fn read(cache: &Cache, a: &AsyncCache, asynch: bool, key: &str) -> Option<String> {
    either!(asynch, cache.get(key), a.get(key)).unwrap()
}

/// Every kind of write of this process (`set`, `delete`, `set_many`, `delete_many`, `touch`,
/// `add`, a load's store) drops the key's copy before it returns: the next read through either
/// view of the cache (`Cache`, `to_async`) sees the write, the copy younger than the near ttl
/// notwithstanding. Counters (`incr`) are never held near: a read after one sees it.
fn own_writes_are_never_served_after_they_return(env: &Env) {
    let cache = near(env).herd_timeout(S(1)).build().unwrap();
    let a = cache.to_async();
    for w in [false, true] {
        // Written through `w` (async if true), read through the other view.
        let r = !w;
        let k = |name: &str| format!("{name}-{}", if w { "async" } else { "sync" });
        let fill = |key: &str, v: &str| {
            cache.set(key, v, S(60)).unwrap();
            filled(&cache, key, v);
            assert_eq!(read(&cache, &a, r, key).as_deref(), Some(v));
        };

        let key = k("set");
        fill(&key, "v1");
        either!(w, cache.set(&key, "v2", S(60)), a.set(&key, "v2", S(60))).unwrap();
        assert_eq!(read(&cache, &a, r, &key).as_deref(), Some("v2"), "set");
        assert_eq!(read(&cache, &a, w, &key).as_deref(), Some("v2"), "set");

        let key = k("delete");
        fill(&key, "v1");
        assert!(either!(w, cache.delete(&key), a.delete(&key)).unwrap());
        assert_eq!(read(&cache, &a, r, &key), None, "delete");

        let (k1, k2) = (k("set_many-1"), k("set_many-2"));
        fill(&k1, "v1");
        fill(&k2, "v1");
        let items = [(k1.as_str(), "n1"), (k2.as_str(), "n2")];
        let failed = either!(w, cache.set_many(items, S(60)), a.set_many(items, S(60))).unwrap();
        assert!(failed.is_empty());
        assert_eq!(read(&cache, &a, r, &k1).as_deref(), Some("n1"), "set_many");
        assert_eq!(read(&cache, &a, r, &k2).as_deref(), Some("n2"), "set_many");

        let (k1, k2) = (k("delete_many-1"), k("delete_many-2"));
        fill(&k1, "v1");
        fill(&k2, "v1");
        let keys = [k1.as_str(), k2.as_str()];
        let n = either!(w, cache.delete_many(&keys), a.delete_many(&keys)).unwrap();
        assert_eq!(n, 2);
        assert_eq!(read(&cache, &a, r, &k1), None, "delete_many");
        assert_eq!(read(&cache, &a, r, &k2), None, "delete_many");

        // Fresh for 60 s when its copy was filled; touched to 1 s (+ 1 s herd timeout), so
        // gone 3 s later, while the copy is younger than the near ttl (5 s).
        let key = k("touch");
        fill(&key, "v1");
        assert!(either!(w, cache.touch(&key, S(1)), a.touch(&key, S(1))).unwrap());
        env.advance(S(3));
        assert_eq!(read(&cache, &a, r, &key), None, "touch");

        // Deleted by another client (the copy stays: its near ttl has not passed), then
        // added here.
        let key = k("add");
        fill(&key, "v1");
        env.raw_delete(&cache.make_key(&key));
        assert!(either!(w, cache.add(&key, "v2", S(60)), a.add(&key, "v2", S(60))).unwrap());
        assert_eq!(read(&cache, &a, r, &key).as_deref(), Some("v2"), "add");

        let key = k("incr");
        either!(
            w,
            cache.set_counter(&key, 5, S(60)),
            a.set_counter(&key, 5, S(60))
        )
        .unwrap();
        assert_eq!(cache.get_counter(&key).unwrap(), Some(5));
        assert_eq!(either!(w, cache.incr(&key, 2), a.incr(&key, 2)).unwrap(), 7);
        assert_eq!(
            either!(r, cache.get_counter(&key), a.get_counter(&key)).unwrap(),
            Some(7),
            "incr"
        );

        // A stale value is reloaded; the load's store fills the copy, and a write after it
        // drops it again.
        let key = k("load");
        cache.set(&key, "v1", S(1)).unwrap();
        filled(&cache, &key, "v1");
        env.advance(MS(1500));
        let loaded: String = match w {
            false => cache
                .get_or_set_with(&key, S(60), || Ok::<_, std::io::Error>("v2".to_owned()))
                .unwrap(),
            true => runtime()
                .block_on(a.get_or_set_with(&key, S(60), || async {
                    Ok::<_, std::io::Error>("v2".to_owned())
                }))
                .unwrap(),
        };
        assert_eq!(loaded, "v2");
        assert_eq!(read(&cache, &a, r, &key).as_deref(), Some("v2"), "load");
        let before = cache.stats();
        assert_eq!(cache.get::<String>(&key).unwrap().as_deref(), Some("v2"));
        assert_eq!(
            delta(&before, &cache.stats(), |s| s.near_hits),
            1,
            "the load's store filled the copy"
        );
        either!(w, cache.set(&key, "v3", S(60)), a.set(&key, "v3", S(60))).unwrap();
        assert_eq!(
            read(&cache, &a, r, &key).as_deref(),
            Some("v3"),
            "set after a load"
        );
    }
}

/// `clear` stops every copy of every cache over the same store in this process, through
/// either view. On memcached it flushes the whole server: a server of the test's own. On
/// Redis it removes this cache's keys only, but stops the copies of every cache over the same
/// server list: the servers named otherwise, so that the copies of the tests running beside
/// it are not stopped.
fn a_clear_stops_every_copy(env: &Env) {
    let private = (env.kind == Kind::Memcached).then(Memcached::start);
    let builder = || match (&private, env.kind) {
        (Some(m), _) => near(env).memcached([m.addr()]),
        (None, Kind::Memory) => near(env),
        (None, _) => elsewhere(env).near_cache(CAPACITY),
    };
    let cache = builder().build().unwrap();
    // The memory backend's caches share a store only through one `backend(...)`, not a
    // server list: a second cache's clear is checked on servers only.
    let other = (env.kind != Kind::Memory).then(|| builder().build().unwrap());
    let a = cache.to_async();
    for (i, asynch) in [false, true].into_iter().enumerate() {
        let key = format!("clear-{i}");
        cache.set(&key, "v", S(60)).unwrap();
        filled(&cache, &key, "v");
        either!(asynch, cache.clear(), a.clear()).unwrap();
        assert_eq!(cache.get::<String>(&key).unwrap(), None, "after clear");
        assert_eq!(runtime().block_on(a.get::<String>(&key)).unwrap(), None);
    }
    if let Some(other) = other {
        cache.set("clear-other", "v", S(60)).unwrap();
        filled(&cache, "clear-other", "v");
        other.clear().unwrap();
        assert_eq!(
            cache.get::<String>("clear-other").unwrap(),
            None,
            "another cache's clear"
        );
    }
}

/// The same servers named another way (`localhost` for `127.0.0.1`): a cache over them is
/// not known to share its store with the test's own caches.
fn elsewhere(env: &Env) -> CacheBuilder {
    let b = env.builder();
    match env.kind {
        Kind::Memcached => {
            b.memcached([crate::fixture::shared_server().replace("127.0.0.1", "localhost")])
        }
        #[cfg(feature = "redis")]
        Kind::Redis => b.redis(crate::fixture::shared_redis().replace("127.0.0.1", "localhost")),
        #[cfg(feature = "redis")]
        Kind::RedisCluster => b.redis_cluster(
            crate::fixture::shared_redis_cluster()
                .iter()
                .map(|s| s.replace("127.0.0.1", "localhost")),
        ),
        k => unreachable!("no servers on {k:?}"),
    }
}

/// Another cache (over the same servers named otherwise, as another process's cache is) writes
/// the key: this cache serves its copy until the near ttl has passed since the read that
/// filled it, then the new value.
fn another_caches_write_is_seen_once_the_near_ttl_passed(env: &Env) {
    let cache = near(env).near_ttl(S(2)).build().unwrap();
    let other = elsewhere(env).near_cache(CAPACITY).build().unwrap();
    cache.set("k", "v1", S(3600)).unwrap();
    filled(&cache, "k", "v1");
    other.set("k", "v2", S(3600)).unwrap();
    assert_eq!(other.get::<String>("k").unwrap().as_deref(), Some("v2"));
    env.advance(MS(1900));
    assert_eq!(
        cache.get::<String>("k").unwrap().as_deref(),
        Some("v1"),
        "the copy is served within the near ttl"
    );
    env.advance(MS(200));
    assert_eq!(
        cache.get::<String>("k").unwrap().as_deref(),
        Some("v2"),
        "past the near ttl, the shared value"
    );
}

/// Two caches built over the same server list in one process: a write through either drops
/// the other's copy at once.
fn caches_over_one_server_list_see_each_others_writes_at_once(env: &Env) {
    let (a, b) = (near(env).build().unwrap(), near(env).build().unwrap());
    a.set("k", "v1", S(3600)).unwrap();
    filled(&a, "k", "v1");
    filled(&b, "k", "v1");
    b.set("k", "v2", S(3600)).unwrap();
    assert_eq!(a.get::<String>("k").unwrap().as_deref(), Some("v2"));
    filled(&a, "k", "v2");
    runtime().block_on(b.to_async().delete("k")).unwrap();
    assert_eq!(a.get::<String>("k").unwrap(), None);
}

/// A relay in front of a server whose client-to-server bytes, on the connections it is told to
/// hold, are kept (not forwarded) until it is told to release them: a write sent on a held
/// connection is in flight, unanswered, and lands on release.
struct Valve {
    addr: String,
    accepted: Arc<AtomicUsize>,
    held: Arc<Mutex<Vec<std::ops::Range<usize>>>>,
    /// How many sends are being held now.
    holding: Arc<AtomicUsize>,
}

impl Valve {
    fn start(upstream: &str) -> Valve {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a free loopback port");
        let addr = listener.local_addr().unwrap().to_string();
        let accepted = Arc::new(AtomicUsize::new(0));
        let held = Arc::new(Mutex::new(Vec::new()));
        let holding = Arc::new(AtomicUsize::new(0));
        let (counted, on_hold, upstream) = (accepted.clone(), held.clone(), upstream.to_owned());
        let held_now = holding.clone();
        thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let i = counted.fetch_add(1, Ordering::SeqCst);
                let Ok(server) = TcpStream::connect(&upstream) else {
                    continue;
                };
                let (mut from_client, mut to_server) =
                    (client.try_clone().unwrap(), server.try_clone().unwrap());
                let (on_hold, held_now) = (on_hold.clone(), held_now.clone());
                thread::spawn(move || {
                    let mut buf = vec![0u8; 64 << 10];
                    loop {
                        let n = match from_client.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        let is_held = || {
                            let held = on_hold.lock().unwrap();
                            held.iter().any(|r: &std::ops::Range<usize>| r.contains(&i))
                        };
                        if is_held() {
                            held_now.fetch_add(1, Ordering::SeqCst);
                            while is_held() {
                                thread::sleep(MS(1));
                            }
                            held_now.fetch_sub(1, Ordering::SeqCst);
                        }
                        if to_server.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = to_server.shutdown(std::net::Shutdown::Both);
                });
                let (mut from_server, mut to_client) = (server, client);
                thread::spawn(move || {
                    let _ = std::io::copy(&mut from_server, &mut to_client);
                    let _ = to_client.shutdown(std::net::Shutdown::Both);
                });
            }
        });
        Valve {
            addr,
            accepted,
            held,
            holding,
        }
    }

    /// How many connections it accepted so far (numbered from 0 in that order).
    fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    /// Holds what clients send on the connections `conns` from now on.
    fn hold(&self, conns: std::ops::Range<usize>) {
        self.held.lock().unwrap().push(conns);
    }

    /// Passes on what was held on `conns`, and everything after it.
    fn release(&self, conns: std::ops::Range<usize>) {
        self.held.lock().unwrap().retain(|r| *r != conns);
    }

    /// Waits until `n` sends are being held.
    fn wait_holding(&self, n: usize) {
        let deadline = Instant::now() + S(10);
        while self.holding.load(Ordering::SeqCst) < n {
            assert!(Instant::now() < deadline, "nothing was sent to hold");
            thread::sleep(MS(1));
        }
    }
}

mod dropped_writes {
    use super::*;

    on_near_backend!(
        memcached,
        Memcached,
        a_write_dropped_in_flight_keeps_reads_from_filling
    );
    #[cfg(feature = "redis")]
    on_near_backend!(
        redis,
        Redis,
        a_write_dropped_in_flight_keeps_reads_from_filling
    );
}

/// An async `set` whose future is dropped while its request is in flight (sent on the async
/// view's connection, held there by a relay): a read made meanwhile (the sync view, on a
/// connection of its own) finds the old value, and once the write has landed no read serves
/// the old value again: the read made while the write could still land filled no copy.
fn a_write_dropped_in_flight_keeps_reads_from_filling(env: &Env) {
    let (valve, cache) = behind_a_valve(env);
    let a = cache.to_async();
    cache.set("k", "old", S(3600)).unwrap();
    filled(&cache, "k", "old");
    let sync_conns = valve.accepted();
    runtime().block_on(a.get::<String>("warm")).unwrap();
    let async_conns = valve.accepted();
    assert!(
        async_conns > sync_conns,
        "the async view reads on connections of its own"
    );
    valve.hold(sync_conns..async_conns);
    drop_in_flight(&valve, &a, "k", "new", 1);
    assert_eq!(
        cache.get::<String>("k").unwrap().as_deref(),
        Some("old"),
        "the dropped write has not landed yet"
    );
    valve.release(sync_conns..async_conns);
    let reference = env.builder().build().unwrap();
    let deadline = Instant::now() + S(10);
    while reference.get::<String>("k").unwrap().as_deref() != Some("new") {
        assert!(Instant::now() < deadline, "the dropped write never landed");
        thread::sleep(MS(5));
    }
    for _ in 0..3 {
        assert_eq!(
            cache.get::<String>("k").unwrap().as_deref(),
            Some("new"),
            "after the dropped write landed"
        );
        assert_eq!(
            runtime().block_on(a.get::<String>("k")).unwrap().as_deref(),
            Some("new")
        );
    }
}

mod read_before_a_dropped_write {
    use super::*;

    on_near_backend!(
        memcached,
        Memcached,
        a_read_sent_before_a_write_dropped_in_flight_is_not_kept
    );
    #[cfg(feature = "redis")]
    on_near_backend!(
        redis,
        Redis,
        a_read_sent_before_a_write_dropped_in_flight_is_not_kept
    );
}

/// A read sent (its request held by a relay) before an async `set` whose future is dropped in
/// flight (held too): the read is answered with the old value after the drop, and its copy is
/// not kept; once the write has landed, no read serves the old value.
fn a_read_sent_before_a_write_dropped_in_flight_is_not_kept(env: &Env) {
    let (valve, cache) = behind_a_valve(env);
    let a = cache.to_async();
    cache.set("k", "old", S(3600)).unwrap();
    filled(&cache, "k", "old");
    let sync_conns = 0..valve.accepted();
    runtime().block_on(a.get::<String>("warm")).unwrap();
    let async_conns = sync_conns.end..valve.accepted();
    assert!(
        !async_conns.is_empty(),
        "the async view reads on connections of its own"
    );
    // The copy too old to serve: the reader's read goes to the server.
    env.advance(S(6));
    let before = cache.stats();
    valve.hold(sync_conns.clone());
    thread::scope(|s| {
        let reader = s.spawn(|| cache.get::<String>("k").unwrap());
        valve.wait_holding(1);
        valve.hold(async_conns.clone());
        drop_in_flight(&valve, &a, "k", "new", 2);
        valve.release(sync_conns.clone());
        assert_eq!(
            reader.join().unwrap().as_deref(),
            Some("old"),
            "the read was answered before the write landed"
        );
    });
    assert_eq!(
        delta(&before, &cache.stats(), |s| s.near_refused),
        1,
        "the read's copy is refused"
    );
    valve.release(async_conns);
    let reference = env.builder().build().unwrap();
    let deadline = Instant::now() + S(10);
    while reference.get::<String>("k").unwrap().as_deref() != Some("new") {
        assert!(Instant::now() < deadline, "the dropped write never landed");
        thread::sleep(MS(5));
    }
    for _ in 0..3 {
        assert_eq!(
            cache.get::<String>("k").unwrap().as_deref(),
            Some("new"),
            "after the dropped write landed"
        );
    }
}

/// Polls `a.set(key, value)` once, waits until `valve` holds `n` sends (the write among them:
/// sent, not answered), and drops the write's future.
fn drop_in_flight(valve: &Valve, a: &AsyncCache, key: &str, value: &str, n: usize) {
    runtime().block_on(async {
        let mut set = std::pin::pin!(a.set(key, value, S(3600)));
        let first = std::future::poll_fn(|cx| Poll::Ready(set.as_mut().poll(cx))).await;
        assert!(first.is_pending(), "the write is in flight");
        valve.wait_holding(n);
    });
}

/// A cache with a near tier over `env`'s server reached through a [`Valve`].
fn behind_a_valve(env: &Env) -> (Valve, Cache) {
    let upstream = match env.kind {
        Kind::Memcached => crate::fixture::shared_server().to_owned(),
        #[cfg(feature = "redis")]
        Kind::Redis => crate::fixture::shared_redis()
            .trim_start_matches("redis://")
            .trim_end_matches("/0")
            .to_owned(),
        k => unreachable!("not on {k:?}"),
    };
    let valve = Valve::start(&upstream);
    let b = near(env).io_timeout(S(10));
    let cache = match env.kind {
        Kind::Memcached => b.memcached([valve.addr.as_str()]).async_connections(1),
        #[cfg(feature = "redis")]
        _ => b.redis(format!("redis://{}/0", valve.addr)),
        #[cfg(not(feature = "redis"))]
        _ => unreachable!(),
    }
    .build()
    .unwrap();
    (valve, cache)
}

/// Two caches over one server list: a write of one dropped in flight (held by a relay) keeps
/// the other's reads from filling until it may have landed, whichever clock the other was
/// built with: the default one, or one of its own (`CacheBuilder::clock`, here the system
/// clock itself).
mod dropped_by_another_cache {
    use super::*;

    fn check(clock: Option<Arc<dyn newcache::Clock>>) {
        let valve = Valve::start(crate::fixture::shared_server());
        let flavor = unique_flavor("clocks");
        let builder = || {
            Cache::builder()
                .memcached([valve.addr.as_str()])
                .flavor(flavor.clone())
                .near_cache(CAPACITY)
                .async_connections(1)
                .io_timeout(S(10))
        };
        let writer = builder().build().unwrap();
        let reader = match clock {
            Some(c) => builder().clock(c),
            None => builder(),
        }
        .build()
        .unwrap();
        writer.set("k", "old", S(3600)).unwrap();
        filled(&reader, "k", "old");
        let a = writer.to_async();
        let before = valve.accepted();
        runtime().block_on(a.get::<String>("warm")).unwrap();
        let held = before..valve.accepted();
        valve.hold(held.clone());
        drop_in_flight(&valve, &a, "k", "new", 1);
        assert_eq!(
            reader.get::<String>("k").unwrap().as_deref(),
            Some("old"),
            "the dropped write has not landed yet"
        );
        valve.release(held);
        let reference = Cache::builder()
            .memcached([crate::fixture::shared_server()])
            .flavor(flavor.clone())
            .build()
            .unwrap();
        let deadline = Instant::now() + S(10);
        while reference.get::<String>("k").unwrap().as_deref() != Some("new") {
            assert!(Instant::now() < deadline, "the dropped write never landed");
            thread::sleep(MS(5));
        }
        for _ in 0..3 {
            assert_eq!(
                reader.get::<String>("k").unwrap().as_deref(),
                Some("new"),
                "after the other cache's dropped write landed"
            );
        }
    }

    #[test]
    fn on_the_default_clock() {
        check(None);
    }

    #[test]
    fn on_a_clock_of_its_own() {
        check(Some(Arc::new(newcache::SystemClock)));
    }
}

/// Where a child finds its server (`memcached=ADDR` or `redis=URL`), and its flavor.
const CHILD_TARGET: &str = "NEWCACHE_NEAR_CHILD_TARGET";
const CHILD_FLAVOR: &str = "NEWCACHE_NEAR_CHILD_FLAVOR";

/// A child: another process writing key `k` on the parent's server. Without the parent's
/// environment: nothing.
#[test]
#[ignore = "run by another_process"]
fn child_writes() {
    let (Ok(target), Ok(flavor)) = (std::env::var(CHILD_TARGET), std::env::var(CHILD_FLAVOR))
    else {
        return;
    };
    let b = Cache::builder().flavor(flavor);
    let b = match target.split_once('=') {
        Some(("memcached", addr)) => b.memcached([addr]),
        #[cfg(feature = "redis")]
        Some(("redis", url)) => b.redis(url),
        _ => panic!("unknown target {target}"),
    };
    b.build()
        .unwrap()
        .set("k", "from the child", S(3600))
        .unwrap();
}

/// Another process writes the key: this process serves its copy until the near ttl has passed
/// since the read that filled it, then the value the other process wrote.
mod another_process {
    use super::*;

    fn check(target: String, builder: CacheBuilder) {
        let flavor = unique_flavor("child");
        let clock = MockClock::new();
        let cache = builder
            .clone()
            .flavor(flavor.clone())
            .clock(clock.clone())
            .near_cache(CAPACITY)
            .near_ttl(S(2))
            .build()
            .unwrap();
        cache.set("k", "v1", S(3600)).unwrap();
        filled(&cache, "k", "v1");
        let status = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "near::child_writes", "--ignored"])
            .args(["--test-threads", "1", "--quiet"])
            .env(CHILD_TARGET, target)
            .env(CHILD_FLAVOR, &flavor)
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "the child failed");
        let reference = builder.flavor(flavor).build().unwrap();
        assert_eq!(
            reference.get::<String>("k").unwrap().as_deref(),
            Some("from the child")
        );
        clock.advance(MS(1900));
        assert_eq!(
            cache.get::<String>("k").unwrap().as_deref(),
            Some("v1"),
            "the copy is served within the near ttl"
        );
        clock.advance(MS(200));
        assert_eq!(
            cache.get::<String>("k").unwrap().as_deref(),
            Some("from the child"),
            "past the near ttl, the other process's value"
        );
    }

    #[test]
    fn memcached() {
        let addr = crate::fixture::shared_server();
        check(
            format!("memcached={addr}"),
            Cache::builder().memcached([addr]),
        );
    }

    #[cfg(feature = "redis")]
    #[test]
    fn redis() {
        let url = crate::fixture::shared_redis();
        check(format!("redis={url}"), Cache::builder().redis(url));
    }
}

/// A server of a test's own, to kill.
enum Private {
    Memcached(Memcached),
    #[cfg(feature = "redis")]
    Redis(crate::fixture::RedisServer),
}

impl Private {
    fn start(kind: Kind) -> (Private, CacheBuilder) {
        match kind {
            Kind::Memcached => {
                let m = Memcached::start();
                let b = Cache::builder().memcached([m.addr()]);
                (Private::Memcached(m), b)
            }
            #[cfg(feature = "redis")]
            Kind::Redis => {
                let r = crate::fixture::RedisServer::start("redis-server");
                let b = Cache::builder().redis(r.url());
                (Private::Redis(r), b)
            }
            k => unreachable!("no private server on {k:?}"),
        }
    }

    fn kill(&mut self) {
        match self {
            Private::Memcached(m) => m.kill(),
            #[cfg(feature = "redis")]
            Private::Redis(r) => r.kill(),
        }
    }
}

mod outage {
    use super::*;

    #[test]
    fn memcached() {
        super::an_outage_is_bridged_within_the_staleness_bound(Kind::Memcached);
    }

    #[cfg(feature = "redis")]
    #[test]
    fn redis() {
        super::an_outage_is_bridged_within_the_staleness_bound(Kind::Redis);
    }
}

/// The server killed: with `serve_stale_on_error`, `get` and `get_or_set_with` serve the near
/// copy past the near ttl within its staleness bound (soft expiry + herd timeout), not past it;
/// 16 callers of `get_or_set_with` on a key never read run one load at a time, and the value
/// loaded is kept near, so later calls load nothing.
fn an_outage_is_bridged_within_the_staleness_bound(kind: Kind) {
    let (mut server, builder) = Private::start(kind);
    let clock = MockClock::new();
    let cache = builder
        .flavor(unique_flavor("outage"))
        .clock(clock.clone())
        .near_cache(CAPACITY)
        .near_ttl(S(1))
        .herd_timeout(S(10))
        .serve_stale_on_error(S(3600))
        .connect_timeout(S(1))
        .io_timeout(S(2))
        .build()
        .unwrap();
    cache.set("k", "v", S(20)).unwrap();
    filled(&cache, "k", "v");
    server.kill();

    let loads = AtomicUsize::new(0);
    let (running, most) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let load = |v: &'static str| {
        let n = running.fetch_add(1, Ordering::SeqCst) + 1;
        most.fetch_max(n, Ordering::SeqCst);
        loads.fetch_add(1, Ordering::SeqCst);
        thread::sleep(MS(20));
        running.fetch_sub(1, Ordering::SeqCst);
        Ok::<_, std::io::Error>(v.to_owned())
    };
    let start = Barrier::new(16);
    thread::scope(|s| {
        for _ in 0..16 {
            s.spawn(|| {
                start.wait();
                let v = cache
                    .get_or_set_with("cold", S(20), || load("loaded"))
                    .unwrap();
                assert_eq!(v, "loaded");
            });
        }
    });
    assert_eq!(
        most.load(Ordering::SeqCst),
        1,
        "one load of the key at a time"
    );
    let loaded = loads.load(Ordering::SeqCst);
    for _ in 0..20 {
        assert_eq!(
            cache
                .get_or_set_with("cold", S(20), || load("again"))
                .unwrap(),
            "loaded"
        );
    }
    assert_eq!(
        loads.load(Ordering::SeqCst),
        loaded,
        "the loaded value is kept near"
    );

    // Past the near ttl, within soft expiry (20 s) + herd timeout (10 s).
    let before = cache.stats();
    clock.advance(S(5));
    assert_eq!(cache.get::<String>("k").unwrap().as_deref(), Some("v"));
    assert_eq!(
        cache
            .get_or_set_with("k", S(20), || load("reloaded"))
            .unwrap(),
        "v"
    );
    assert_eq!(
        cache
            .get_or_set_with("cold", S(20), || load("again"))
            .unwrap(),
        "loaded"
    );
    let a = cache.to_async();
    assert_eq!(
        runtime().block_on(a.get::<String>("k")).unwrap().as_deref(),
        Some("v"),
        "the async view too"
    );
    assert_eq!(loads.load(Ordering::SeqCst), loaded, "served, not loaded");
    assert!(delta(&before, &cache.stats(), |s| s.near_outage_served) >= 4);
    clock.advance(MS(24_500));
    assert_eq!(
        cache.get::<String>("k").unwrap().as_deref(),
        Some("v"),
        "29.5 s after the set: within the bound"
    );
    clock.advance(S(1));
    let past = cache.get::<String>("k");
    assert!(
        !matches!(past, Ok(Some(_))),
        "30.5 s after the set: past the bound, never served ({past:?})"
    );
    assert_eq!(
        cache
            .get_or_set_with("k", S(20), || load("reloaded"))
            .unwrap(),
        "reloaded"
    );
    assert_eq!(loads.load(Ordering::SeqCst), loaded + 1);
}

/// Async `set`, `get_or_set_with` and `delete` futures dropped at many points (after one poll,
/// after a few microseconds) while a task keeps reading every key through the near tier:
/// once the writes have landed, every value the near cache serves (`get`, `get_arc`,
/// `get_many`) is the one a cache without a near tier reads from the shared store.
fn dropped_futures_leave_no_copy_the_store_does_not_hold(env: &Env) {
    const LIFE: Duration = Duration::from_secs(86_400);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // Over the servers named otherwise: the stripes its dropped writes keep quiet (in its own
    // clock's time) are not those of the tests running beside it.
    let cache = elsewhere(env)
        .near_cache(CAPACITY)
        .near_ttl(S(3600))
        .build_async()
        .unwrap();
    let fresh = env.builder().build_async().unwrap();
    let keys: Vec<String> = (0..6).map(|i| format!("d{i}")).collect();
    rt.block_on(async {
        for round in 0..8u64 {
            let stop = Arc::new(AtomicBool::new(false));
            let reader = tokio::spawn({
                let (cache, keys, stop) = (cache.clone(), keys.clone(), stop.clone());
                async move {
                    while !stop.load(Ordering::SeqCst) {
                        for k in &keys {
                            let _ = cache.get::<u64>(k).await;
                        }
                        tokio::task::yield_now().await;
                    }
                }
            });
            for i in 0..60u64 {
                let n = round * 1000 + i;
                let k = &keys[(n as usize * 7) % keys.len()];
                let within = Duration::from_micros((n * 37) % 400);
                match n % 5 {
                    0 | 1 => {
                        let _ = tokio::time::timeout(within, cache.set(k, &n, LIFE)).await;
                    }
                    2 => {
                        let load = cache.get_or_set_with(k, LIFE, || async move {
                            tokio::task::yield_now().await;
                            Ok::<_, std::io::Error>(n)
                        });
                        let _ = tokio::time::timeout(within, load).await;
                    }
                    3 => {
                        let _ = tokio::time::timeout(Duration::ZERO, cache.delete(k)).await;
                    }
                    _ => cache.set(k, &n, LIFE).await.unwrap(),
                }
            }
            stop.store(true, Ordering::SeqCst);
            reader.await.unwrap();
            // The dropped writes land (or never will) within a moment; their quiet time (the
            // backend's settle time, on the near clock) passes.
            tokio::time::sleep(MS(300)).await;
            env.advance(S(30));
            for k in &keys {
                let want = fresh.get::<u64>(k).await.unwrap();
                for _ in 0..2 {
                    assert_eq!(
                        cache.get::<u64>(k).await.unwrap(),
                        want,
                        "round {round}, key {k}"
                    );
                }
                assert_eq!(cache.get_arc::<u64>(k).await.unwrap().map(|v| *v), want);
                assert_eq!(fresh.get::<u64>(k).await.unwrap(), want, "settled");
            }
            let near: HashMap<String, u64> = cache.get_many(&keys).await.unwrap();
            let shared: HashMap<String, u64> = fresh.get_many(&keys).await.unwrap();
            assert_eq!(near, shared, "round {round}: get_many");
        }
    });
    let s = cache.stats();
    assert!(s.near_hits > 0, "copies were served: {s:?}");
}

/// 10,000 values of 1 KB through a 1 MiB near tier: copies are evicted, and no more of them
/// are served than the capacity holds. (Over a wrapped backend, so that its 10,000 writes do
/// not bump the stripes of the caches of the tests running beside it.)
fn the_tier_stays_within_its_capacity(env: &Env) {
    let cache = near(env)
        .backend(Arc::new(Hooked::new(env.backend())))
        .build()
        .unwrap();
    let value = |i: usize| format!("{i:05}{}", "x".repeat(995));
    let keys: Vec<String> = (0..10_000).map(|i| format!("b{i}")).collect();
    for (c, chunk) in keys.chunks(500).enumerate() {
        let values: Vec<String> = (0..chunk.len()).map(|i| value(c * 500 + i)).collect();
        let items = chunk
            .iter()
            .map(String::as_str)
            .zip(values.iter().map(String::as_str));
        assert!(cache.set_many(items, S(3600)).unwrap().is_empty());
    }
    let read_all = || {
        for (c, chunk) in keys.chunks(500).enumerate() {
            let got: HashMap<String, String> = cache.get_many(chunk).unwrap();
            assert_eq!(got.len(), chunk.len());
            for (i, k) in chunk.iter().enumerate() {
                assert_eq!(got[k], value(c * 500 + i));
            }
        }
    };
    read_all();
    let filled_once = cache.stats();
    assert!(filled_once.near_evictions > 0, "{filled_once:?}");
    read_all();
    let hits = delta(&filled_once, &cache.stats(), |s| s.near_hits);
    assert!(
        hits <= CAPACITY / 1000,
        "{hits} near hits of 1 KB values from a 1 MiB tier"
    );
    let evicted = delta(&filled_once, &cache.stats(), |s| s.near_evictions);
    assert!(evicted >= 10_000 - CAPACITY / 1000, "{evicted} evictions");
    // The tier still serves what it was just filled with.
    filled(&cache, "b1234", &value(1234));
}

/// A value over 1/16 of the capacity is never held near (counted in `near_refused`), and is
/// read correctly each time.
fn large_values_are_never_held_near(env: &Env) {
    let cache = near(env).build().unwrap();
    let big = "y".repeat(100 << 10);
    let small = "y".repeat((CAPACITY / 64) as usize);
    cache.set("big", &big, S(60)).unwrap();
    cache.set("small", &small, S(60)).unwrap();
    let before = cache.stats();
    for _ in 0..3 {
        assert_eq!(cache.get::<String>("big").unwrap().as_ref(), Some(&big));
        assert_eq!(
            cache.get_arc::<String>("big").unwrap().as_deref(),
            Some(&big)
        );
    }
    let after = cache.stats();
    assert_eq!(delta(&before, &after, |s| s.near_hits), 0);
    assert_eq!(delta(&before, &after, |s| s.near_refused), 6);
    filled(&cache, "small", &small);
}

/// `get_many` answers the keys with copies from the near tier and reads the others in one
/// batch (one round trip), filling their copies.
fn get_many_serves_near_hits_and_fetches_the_rest_in_one_batch(env: &Env) {
    let hooked = Arc::new(Hooked::new(env.backend()));
    let cache = near(env).backend(hooked.clone()).build().unwrap();
    let keys: Vec<String> = (0..10).map(|i| format!("g{i}")).collect();
    let items: Vec<(&str, String)> = keys
        .iter()
        .map(|k| (k.as_str(), format!("v-{k}")))
        .collect();
    let failed = cache
        .set_many(items.iter().map(|(k, v)| (*k, v.as_str())), S(60))
        .unwrap();
    assert!(failed.is_empty());
    for k in &keys[..5] {
        filled(&cache, k, &format!("v-{k}"));
    }
    let mut wanted = keys.clone();
    wanted.push("g-missing".to_owned());
    hooked.take();
    let before = cache.stats();
    let got: HashMap<String, String> = cache.get_many(&wanted).unwrap();
    assert_eq!(got.len(), 10);
    for k in &keys {
        assert_eq!(got[k], format!("v-{k}"));
    }
    assert_eq!(
        hooked.take(),
        1,
        "the five others and the missing key in one batch"
    );
    assert_eq!(delta(&before, &cache.stats(), |s| s.near_hits), 5);
    let before = cache.stats();
    let again: HashMap<String, String> = cache.get_many(&keys).unwrap();
    assert_eq!(again, got);
    assert_eq!(hooked.take(), 0, "every key a near hit");
    assert_eq!(delta(&before, &cache.stats(), |s| s.near_hits), 10);
    let a = cache.to_async();
    let again: HashMap<String, String> = runtime().block_on(a.get_many(&keys)).unwrap();
    assert_eq!(again, got);
    assert_eq!(hooked.take(), 0, "the async view's get_many too");
}

/// One key read as two types with the same encoding, through `get` and `get_arc`, each
/// correct; `get_arc` of the first type read returns the one `Arc` its copy keeps.
fn one_key_read_as_two_types(env: &Env) {
    let cache = near(env).build().unwrap();
    let a = cache.to_async();
    cache.set("t", &(7u32, "seven"), S(60)).unwrap();
    let first: Arc<(u32, String)> = cache.get_arc("t").unwrap().unwrap();
    assert_eq!(*first, (7, "seven".to_owned()));
    let before = cache.stats();
    let again: Arc<(u32, String)> = cache.get_arc("t").unwrap().unwrap();
    assert!(Arc::ptr_eq(&first, &again), "one decoded value, shared");
    let other: Arc<(u64, String)> = cache.get_arc("t").unwrap().unwrap();
    assert_eq!(*other, (7, "seven".to_owned()));
    let other_again: Arc<(u64, String)> = cache.get_arc("t").unwrap().unwrap();
    assert_eq!(other_again, other);
    assert_eq!(
        cache.get::<(u64, String)>("t").unwrap(),
        Some((7, "seven".to_owned()))
    );
    assert_eq!(
        cache.get::<(u32, String)>("t").unwrap(),
        Some((7, "seven".to_owned()))
    );
    let from_async: Arc<(u32, String)> = runtime().block_on(a.get_arc("t")).unwrap().unwrap();
    assert!(Arc::ptr_eq(&first, &from_async), "the async view's too");
    assert_eq!(delta(&before, &cache.stats(), |s| s.near_hits), 6);
    // A write drops the copy and its kept value.
    cache.set("t", &(8u32, "eight"), S(60)).unwrap();
    let after: Arc<(u32, String)> = cache.get_arc("t").unwrap().unwrap();
    assert_eq!(*after, (8, "eight".to_owned()));
}

/// The response cache over memcached with a near tier: a repeated request is answered from
/// the near copy (no read reaches the server), and the layer's own invalidations (a `PUT`
/// through it, `invalidate`) are seen by the next request.
#[cfg(feature = "tower")]
#[test]
fn the_response_cache_answers_a_repeated_request_from_the_near_tier() {
    response_cache_over_a_near_tier(false);
}

/// The requests the response cache answers from the near tier are counted in `near_hits`
/// (the cache's or the layer's stats).
#[cfg(feature = "tower")]
#[test]
fn the_response_caches_near_hits_are_counted() {
    response_cache_over_a_near_tier(true);
}

#[cfg(feature = "tower")]
fn response_cache_over_a_near_tier(count_near_hits: bool) {
    use bytes::Bytes;
    use http_body_util::combinators::BoxBody;
    use http_body_util::{BodyExt, Full};
    use newcache::layer::{HostPolicy, ResponseCacheLayer};
    use tower::{Layer, Service, ServiceExt};

    type B = BoxBody<Bytes, std::convert::Infallible>;

    async fn send<S, RB>(svc: &S, method: http::Method, uri: &str) -> (String, String)
    where
        S: Service<http::Request<()>, Response = http::Response<RB>> + Clone,
        S::Error: std::fmt::Debug,
        RB: http_body::Body<Data = Bytes>,
        RB::Error: std::fmt::Debug,
    {
        let req = http::Request::builder()
            .method(method)
            .uri(uri)
            .body(())
            .unwrap();
        let resp = svc.clone().oneshot(req).await.expect("an answer");
        let x_cache = resp
            .headers()
            .get("x-cache")
            .map_or("", |v| v.to_str().unwrap())
            .to_owned();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (x_cache, String::from_utf8(body.to_vec()).unwrap())
    }

    let server = Memcached::start();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let cache = Cache::builder()
            .memcached([server.addr()])
            .flavor(unique_flavor("layer"))
            .near_cache(CAPACITY)
            .build_async()
            .unwrap();
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = calls.clone();
        let origin = tower::service_fn(move |_req: http::Request<()>| {
            let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                let body: B = Full::new(Bytes::from(format!("page {n}"))).boxed();
                Ok::<_, std::convert::Infallible>(
                    http::Response::builder()
                        .header("cache-control", "max-age=60")
                        .body(body)
                        .unwrap(),
                )
            }
        });
        let pages = ResponseCacheLayer::builder(cache.clone())
            .hosts(HostPolicy::Ignore)
            .build()
            .unwrap();
        let svc = pages.layer(origin);
        use http::Method;
        assert_eq!(
            send(&svc, Method::GET, "/p").await,
            ("MISS".into(), "page 1".into())
        );
        let gets = server.stat("cmd_get");
        let hits = pages.stats().hits;
        let near_hits = cache.stats().near_hits + pages.stats().near_hits;
        for _ in 0..5 {
            assert_eq!(
                send(&svc, Method::GET, "/p").await,
                ("HIT".into(), "page 1".into())
            );
        }
        assert_eq!(
            server.stat("cmd_get"),
            gets,
            "repeated requests read nothing from the server"
        );
        assert_eq!(pages.stats().hits - hits, 5);
        if count_near_hits {
            let counted = cache.stats().near_hits + pages.stats().near_hits;
            assert_eq!(counted - near_hits, 5, "the near hits are counted");
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1);

        assert!(pages.invalidate("/p").await.unwrap());
        assert_eq!(
            send(&svc, Method::GET, "/p").await,
            ("MISS".into(), "page 2".into())
        );
        assert_eq!(
            send(&svc, Method::GET, "/p").await,
            ("HIT".into(), "page 2".into())
        );
        let (_, put) = send(&svc, Method::PUT, "/p").await;
        assert_eq!(put, "page 3");
        assert_eq!(
            send(&svc, Method::GET, "/p").await,
            ("MISS".into(), "page 4".into()),
            "a PUT through the layer invalidates the page"
        );
        assert_eq!(
            send(&svc, Method::GET, "/p").await,
            ("HIT".into(), "page 4".into())
        );
    });
}

/// A value stored compressed (over the LZ4 threshold) is held near and served as it was
/// written, through `get`, `get_arc` and `get_many`.
fn a_compressed_value_is_served_near(env: &Env) {
    let cache = near(env).build().unwrap();
    let text: String = (0..2_000).map(|i| format!("{i} ")).collect();
    cache.set("text", &text, S(60)).unwrap();
    filled(&cache, "text", &text);
    let before = cache.stats();
    assert_eq!(
        cache.get_arc::<String>("text").unwrap().as_deref(),
        Some(&text)
    );
    assert_eq!(cache.get_many::<String>(&["text"]).unwrap()["text"], text);
    assert_eq!(delta(&before, &cache.stats(), |s| s.near_hits), 2);
}

/// A task whose reads are all near hits still yields to its runtime (tokio's cooperative
/// budget): on a one-thread runtime, a task spawned beside it runs before it finishes.
fn a_task_answered_by_near_hits_lets_other_tasks_run(env: &Env) {
    let cache = near(env).build_async().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        cache.set("k", &1u32, S(60)).await.unwrap();
        assert_eq!(cache.get::<u32>("k").await.unwrap(), Some(1));
        let ran = Arc::new(AtomicBool::new(false));
        let r = ran.clone();
        let other = tokio::spawn(async move { r.store(true, Ordering::SeqCst) });
        let before = cache.stats();
        let mut ran_during = false;
        for _ in 0..10_000 {
            assert_eq!(cache.get::<u32>("k").await.unwrap(), Some(1));
            ran_during |= ran.load(Ordering::SeqCst);
        }
        assert_eq!(delta(&before, &cache.stats(), |s| s.near_hits), 10_000);
        assert!(
            ran_during,
            "the spawned task never ran while near hits were served"
        );
        other.await.unwrap();
    });
}

/// `get_many` with a key listed twice counts one hit for it, near or not (as the shared read
/// does), and a cache's `Debug` stays small with a near tier.
fn a_key_asked_for_twice_is_one_hit(env: &Env) {
    let cache = near(env).build().unwrap();
    cache.set("a", &1u8, S(60)).unwrap();
    for _ in 0..2 {
        let before = cache.stats();
        assert_eq!(cache.get_many::<u8>(&["a", "a"]).unwrap()["a"], 1);
        assert_eq!(delta(&before, &cache.stats(), |s| s.hits), 1);
    }
    assert!(format!("{cache:?}").len() < 4096, "{cache:?}");
    assert!(format!("{:?}", cache.to_async()).len() < 8192);
}

/// Polls `cache`'s `k` until it reads `want`: the bus's delivery, not the near ttl (the
/// caches' mock clock stands still), within a bound a loaded machine keeps.
fn seen_on_the_bus(cache: &Cache, k: &str, want: Option<&str>) {
    let deadline = Instant::now() + S(10);
    while cache.get::<String>(k).unwrap().as_deref() != want {
        assert!(
            Instant::now() < deadline,
            "{want:?} never seen through the bus"
        );
        thread::sleep(MS(2));
    }
}

/// Two caches that do not share stripes (the same servers named otherwise), on one in-process
/// bus: a write through either (sync or async, a delete) stops the other's copy once its
/// message is delivered, with the near ttl far off.
fn on_an_in_process_bus_another_caches_write_is_seen_at_once(env: &Env) {
    let bus = newcache::InProcessBus::new();
    let cache = near(env).near_bus(bus.clone()).build().unwrap();
    let other = elsewhere(env)
        .near_cache(CAPACITY)
        .near_bus(bus)
        .build()
        .unwrap();
    cache.set("k", "v1", S(3600)).unwrap();
    filled(&cache, "k", "v1");
    other.set("k", "v2", S(3600)).unwrap();
    seen_on_the_bus(&cache, "k", Some("v2"));
    filled(&cache, "k", "v2");
    runtime()
        .block_on(other.to_async().set("k", "v3", S(3600)))
        .unwrap();
    seen_on_the_bus(&cache, "k", Some("v3"));
    filled(&cache, "k", "v3");
    other.delete("k").unwrap();
    seen_on_the_bus(&cache, "k", None);
    cache.set("j", "w", S(3600)).unwrap();
    filled(&cache, "j", "w");
    let before = cache.stats();
    other.set("unrelated", "x", S(3600)).unwrap();
    let deadline = Instant::now() + S(10);
    while delta(&before, &cache.stats(), |s| s.bus_keys_dropped) == 0 {
        assert!(Instant::now() < deadline, "the announcement never came");
        thread::sleep(MS(2));
    }
    assert_eq!(cache.get::<String>("j").unwrap().as_deref(), Some("w"));
    assert_eq!(
        delta(&before, &cache.stats(), |s| s.near_hits),
        1,
        "another key's announcement leaves this copy"
    );
}

/// Two caches that share no stripes, each on a Redis pub/sub bus of its own over one channel
/// (as two processes would be): once built, each hears the other's writes, while the caches'
/// clock (the mock) never reaches the near ttl. On Redis, on Valkey, and on a Redis Cluster's
/// sharded pub/sub.
#[cfg(feature = "redis")]
mod on_a_redis_bus {
    use super::*;

    fn check(bus: impl Fn() -> Arc<newcache::RedisBus>) {
        let env = Env::new(Kind::Memcached, "redis_bus");
        let cache = near(&env).near_bus(bus()).build().unwrap();
        let other = elsewhere(&env)
            .near_cache(CAPACITY)
            .near_bus(bus())
            .build()
            .unwrap();
        cache.set("k", "v0", S(3600)).unwrap();
        filled(&cache, "k", "v0");
        other.set("k", "v1", S(3600)).unwrap();
        seen_on_the_bus(&cache, "k", Some("v1"));
        filled(&cache, "k", "v1");
        other.delete("k").unwrap();
        seen_on_the_bus(&cache, "k", None);
        let (mine, theirs) = (cache.stats(), other.stats());
        assert!(mine.bus_keys_dropped >= 2, "{mine:?}");
        assert!(theirs.bus_sent >= 2, "{theirs:?}");
        assert_eq!(mine.bus_gaps + mine.bus_reconnects, 0, "{mine:?}");
    }

    #[test]
    fn another_caches_write_is_seen_without_the_near_ttl_on_redis() {
        let url = crate::fixture::shared_redis().to_string();
        let channel = unique_flavor("bus");
        check(|| newcache::RedisBus::new(&url, channel.clone()).unwrap());
    }

    #[test]
    fn another_caches_write_is_seen_without_the_near_ttl_on_valkey() {
        let url = crate::fixture::shared_valkey().to_string();
        let channel = unique_flavor("bus");
        check(|| newcache::RedisBus::new(&url, channel.clone()).unwrap());
    }

    #[test]
    fn another_caches_write_is_seen_without_the_near_ttl_on_a_cluster() {
        let seeds = crate::fixture::shared_redis_cluster();
        let channel = unique_flavor("bus");
        check(|| newcache::RedisBus::cluster(seeds.iter(), channel.clone()).unwrap());
    }
}

/// A subscriber the bus's server cuts off (a message past its pub/sub output-buffer limit), and
/// a message of newcache's this build cannot read: each stops the near tier's copies (a value
/// written meanwhile by a cache off the bus is read, with the near ttl far off), and near hits
/// come back once the cache hears itself again. Someone else's bytes on the channel stop
/// nothing.
#[cfg(feature = "redis")]
#[test]
fn a_subscriber_cut_off_by_the_server_or_foreign_bytes_flush_the_near_tier() {
    let server = crate::fixture::RedisServer::start_with(
        "redis-server",
        &["--client-output-buffer-limit", "pubsub 64kb 0 0"],
    );
    let env = Env::new(Kind::Memcached, "bus_cut_off");
    let bus = newcache::RedisBus::new(&server.url(), "bus").unwrap();
    let cache = near(&env)
        .near_bus(bus)
        .near_bus_heartbeat(MS(100))
        .build()
        .unwrap();
    let off_the_bus = elsewhere(&env).build().unwrap();
    let mut raw = redis::Client::open(server.url())
        .unwrap()
        .get_connection()
        .unwrap();
    let mut publish = |bytes: Vec<u8>| {
        let _: i64 = redis::cmd("PUBLISH")
            .arg("bus")
            .arg(bytes)
            .query(&mut raw)
            .unwrap();
    };
    for (n, bytes) in [vec![7u8; 256 << 10], b"ncb\x09 a newer format".to_vec()]
        .into_iter()
        .enumerate()
    {
        let (old, new) = (format!("v{n}"), format!("w{n}"));
        cache.set("k", &old, S(3600)).unwrap();
        filled(&cache, "k", &old);
        off_the_bus.set("k", &new, S(3600)).unwrap();
        assert_eq!(
            cache.get::<String>("k").unwrap(),
            Some(old),
            "nothing announced it"
        );
        let before = cache.stats();
        publish(bytes);
        seen_on_the_bus(&cache, "k", Some(&new));
        let deadline = Instant::now() + S(10);
        loop {
            let before = cache.stats();
            if cache.get::<String>("k").unwrap().as_deref() == Some(new.as_str())
                && delta(&before, &cache.stats(), |s| s.near_hits) == 1
            {
                break;
            }
            assert!(Instant::now() < deadline, "near hits never came back");
            thread::sleep(MS(5));
        }
        let after = cache.stats();
        assert!(delta(&before, &after, |s| s.bus_flushes) >= 1, "{after:?}");
        if n == 0 {
            assert!(
                delta(&before, &after, |s| s.bus_reconnects) >= 1,
                "{after:?}"
            );
        }
    }
}
