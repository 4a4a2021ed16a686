//! The bus (`CacheBuilder::near_bus`): near copies kept coherent between caches that share no
//! fence domain, as the caches of different processes are (the same servers named otherwise,
//! or the backend behind a wrapper of its own, or another process). Each test's caches keep
//! their mock clock where it is, so that a copy never reaches its near ttl: a write seen by
//! another cache was told it by the bus. Losses (a lost message, a cut subscriber, a paused
//! bus) are made by wrapping a transport ([`Lossy`]) or by acting on a Redis server of the
//! test's own; their bounds are heartbeats of real time, asserted with a wide margin.

use std::io::{BufRead, BufReader, Write as _};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use newcache::testing::MockClock;
use newcache::{BusEvent, BusListener, BusTransport, Cache, CacheBuilder, InProcessBus, Stats};

use crate::fixture::{Env, Kind, Memcached, unique_flavor};
use crate::front::runtime;

const S: fn(u64) -> Duration = Duration::from_secs;
const MS: fn(u64) -> Duration = Duration::from_millis;

/// The near tier of these tests: 1 MiB, the default near ttl (5 s, never reached: the clock
/// does not move unless a test says so).
const CAPACITY: u64 = 1 << 20;

/// How long a test waits for what a healthy bus does within tens of milliseconds: a wide
/// margin for a loaded two-core machine. Only the bus can do it at all: the clock stays.
const WITHIN: Duration = Duration::from_secs(5);

/// The heartbeat of the loss tests: short, so that their bounds (a few heartbeats) are short.
const HEARTBEAT: Duration = Duration::from_millis(200);

/// How long the loss tests give a flush that the bus promises within about three heartbeats.
const LOSS_BOUND: Duration = Duration::from_millis(15 * 200);

/// The heartbeat of the tests that check that nothing is flushed: long enough that a loaded
/// machine does not delay a cache's own messages past three of them.
const CALM_HEARTBEAT: Duration = Duration::from_millis(500);

/// How the counter `f` grew from `before` to `after`.
fn delta(before: &Stats, after: &Stats, f: fn(&Stats) -> u64) -> u64 {
    f(after) - f(before)
}

/// Reads `key` through `cache`: its value, and whether the read was a near hit.
fn read(cache: &Cache, key: &str) -> (Option<String>, bool) {
    let before = cache.stats();
    let v = cache.get::<String>(key).unwrap();
    (v, delta(&before, &cache.stats(), |s| s.near_hits) == 1)
}

/// Reads `key` twice through `cache`; the second read must be a near hit (the copy is there to
/// be wrongly served by what follows).
#[track_caller]
fn filled(cache: &Cache, key: &str, want: &str) {
    assert_eq!(cache.get::<String>(key).unwrap().as_deref(), Some(want));
    let (v, hit) = read(cache, key);
    assert_eq!(v.as_deref(), Some(want));
    assert!(hit, "the second read of {key} is a near hit");
}

/// Waits until `cache` reads `want` for `key`, within `bound` (of real time: the caches' clock
/// does not move); how long it took.
#[track_caller]
fn seen_within(
    cache: &Cache,
    key: &str,
    want: Option<&str>,
    bound: Duration,
    what: &str,
) -> Duration {
    let start = Instant::now();
    loop {
        let got = cache.get::<String>(key).unwrap();
        if got.as_deref() == want {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < bound,
            "{what}: {key} still read as {got:?}, not {want:?}, {:?} after the write: {:?}",
            start.elapsed(),
            cache.stats()
        );
        thread::sleep(MS(2));
    }
}

#[track_caller]
fn seen(cache: &Cache, key: &str, want: Option<&str>, what: &str) -> Duration {
    seen_within(cache, key, want, WITHIN, what)
}

/// Waits until `cache` serves `key` from its near tier again (a read, then a near hit), within
/// `bound`; the value it serves.
#[track_caller]
fn serves_again(cache: &Cache, key: &str, bound: Duration, what: &str) -> Option<String> {
    let start = Instant::now();
    loop {
        let _ = cache.get::<String>(key).unwrap();
        let (v, hit) = read(cache, key);
        if hit {
            return v;
        }
        assert!(
            start.elapsed() < bound,
            "{what}: no near hit of {key} {:?} on: {:?}",
            start.elapsed(),
            cache.stats()
        );
        thread::sleep(MS(10));
    }
}

/// `b` with a connect timeout for a loaded machine (the default, 500 ms, is short with a dozen
/// processes on two cores); `build` waits up to it (and the I/O timeout) for the bus too.
fn patient(b: CacheBuilder) -> CacheBuilder {
    b.connect_timeout(S(5))
}

/// Which transport a test's caches are on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Via {
    InProcess,
    /// Pub/sub on the shared Redis 7.
    #[cfg(feature = "redis")]
    Redis,
    /// Pub/sub on the shared Valkey 9.
    #[cfg(feature = "redis")]
    Valkey,
    /// Sharded pub/sub on the shared Redis Cluster.
    #[cfg(feature = "redis")]
    RedisCluster,
}

/// A test's bus: a channel no other test uses, reached through transports of `via`.
struct Bus {
    via: Via,
    channel: String,
    in_process: Arc<InProcessBus>,
}

impl Bus {
    fn new(via: Via) -> Bus {
        Bus {
            via,
            channel: unique_flavor("bus"),
            in_process: InProcessBus::new(),
        }
    }

    /// A transport on the test's channel: a new one each call (a subscriber of its own, as
    /// another process has), except in process, where there is one bus.
    fn transport(&self) -> Arc<dyn BusTransport> {
        match self.via {
            Via::InProcess => self.in_process.clone(),
            #[cfg(feature = "redis")]
            Via::Redis => {
                newcache::RedisBus::new(crate::fixture::shared_redis(), self.channel.clone())
                    .unwrap()
            }
            #[cfg(feature = "redis")]
            Via::Valkey => {
                newcache::RedisBus::new(crate::fixture::shared_valkey(), self.channel.clone())
                    .unwrap()
            }
            #[cfg(feature = "redis")]
            Via::RedisCluster => newcache::RedisBus::cluster(
                crate::fixture::shared_redis_cluster(),
                self.channel.clone(),
            )
            .unwrap(),
        }
    }
}

/// The env of a test on `kind`, on servers of the test's own where it can be (memcached,
/// Redis, Valkey: `clear` flushes a whole memcached, and the test's caches then share their
/// fence domains with no other test's), and the handle that keeps them alive.
fn tier(kind: Kind, tag: &str) -> (Env, Box<dyn std::any::Any>) {
    let env = Env::new(kind, tag);
    match kind {
        Kind::Memcached => {
            let m = Memcached::start();
            (env.at(m.addr()), Box::new(m))
        }
        #[cfg(feature = "redis")]
        Kind::Redis | Kind::Valkey => {
            let bin = match kind {
                Kind::Redis => "redis-server".to_owned(),
                _ => crate::fixture::valkey_server(),
            };
            let r = crate::fixture::RedisServer::start(&bin);
            (env.at(r.url()), Box::new(r))
        }
        _ => (env, Box::new(())),
    }
}

/// The builders of the test's three caches, over `env`'s store reached three ways that share
/// no fence domain ([`Env::apart`]). On the shared cluster, the first is not the way the other
/// tests reach it: it names one node (a different one on each transport `via`, so that the
/// cluster tests of this file do not share it either) as `localhost`, so that the flushes of
/// this test (its `clear`) do not drop the copies of the tests running beside it, nor theirs
/// this test's. Each with whether it can `clear`: a cache over a wrapped Redis backend cannot
/// (its `clear` is the backend's `flush_all`, which Redis refuses).
fn three_ways(env: &Env, via: Via) -> [(CacheBuilder, bool); 3] {
    let wrapped = !env.kind.is_redis();
    match env.kind {
        #[cfg(feature = "redis")]
        Kind::RedisCluster => {
            let seeds = crate::fixture::shared_redis_cluster();
            let seed = seeds[via as usize % seeds.len()].replace("127.0.0.1", "localhost");
            [
                (env.builder().redis_cluster([seed]), true),
                (env.apart(2), wrapped),
                (env.apart(3), wrapped),
            ]
        }
        _ => [
            (env.apart(0), true),
            (env.apart(1), true),
            (env.apart(2), wrapped),
        ],
    }
}

/// A cache that is on no bus and shares no fence domain with the test's caches: it writes the
/// values the test starts from without telling anyone.
fn seeder(env: &Env) -> Cache {
    patient(env.apart(3)).build().unwrap()
}

/// Sets every key to `value` through `seeder` (announced to no one).
fn seed(seeder: &Cache, keys: &[&str], value: &str) {
    let failed = seeder
        .set_many(keys.iter().map(|k| (*k, value)), S(3600))
        .unwrap();
    assert!(failed.is_empty());
}

// ---------------------------------------------------------------------------------------------
// A write is seen by the other caches within the bus bound.

/// The keys no one writes in [`writes_are_seen_by_the_other_caches`]: their copies stay.
const UNTOUCHED: [&str; 4] = ["untouched-0", "untouched-1", "untouched-2", "untouched-3"];

/// Generates [`writes_are_seen_by_the_other_caches`] on `kind` over each transport.
macro_rules! over_each_bus {
    ($module:ident, $kind:ident) => {
        mod $module {
            use super::*;

            #[test]
            fn in_process_bus() {
                writes_are_seen_by_the_other_caches(Kind::$kind, Via::InProcess);
            }

            #[cfg(feature = "redis")]
            #[test]
            fn redis_bus() {
                writes_are_seen_by_the_other_caches(Kind::$kind, Via::Redis);
            }

            #[cfg(feature = "redis")]
            #[test]
            fn valkey_bus() {
                writes_are_seen_by_the_other_caches(Kind::$kind, Via::Valkey);
            }

            #[cfg(feature = "redis")]
            #[test]
            fn redis_cluster_bus() {
                writes_are_seen_by_the_other_caches(Kind::$kind, Via::RedisCluster);
            }
        }
    };
}

mod seen_by_the_others {
    use super::*;

    over_each_bus!(memory, Memory);
    over_each_bus!(memcached, Memcached);
    #[cfg(feature = "redis")]
    over_each_bus!(redis, Redis);
    #[cfg(feature = "redis")]
    over_each_bus!(valkey, Valkey);
    #[cfg(feature = "redis")]
    over_each_bus!(redis_cluster, RedisCluster);
}

/// Three caches over one store that share no fence domain, on one bus (the first two through
/// one transport, the third through a transport of its own, as another process is): each kind
/// of write (`set`, `set_many`, an async `set`, `delete`, `delete_many`, `clear`) through any
/// of them is seen by the other two within the bus bound, while their clock never reaches the
/// near ttl. The announcements name their keys: a copy of a key no one wrote is still served.
/// The messages are counted (`bus_sent` by the writer, `bus_received` and `bus_keys_dropped`
/// by the others).
fn writes_are_seen_by_the_other_caches(kind: Kind, via: Via) {
    let (env, _servers) = tier(kind, "seen");
    let bus = Bus::new(via);
    let one = bus.transport();
    let [(a, a_clears), (b, b_clears), (c, c_clears)] = three_ways(&env, via);
    let caches = [
        a.near_bus(one.clone()),
        b.near_bus(one),
        c.near_bus(bus.transport()),
    ]
    .map(|b| patient(b).near_cache(CAPACITY).build().unwrap());
    let clears = |w: usize| [a_clears, b_clears, c_clears][w];
    let seeder = seeder(&env);
    seed(&seeder, &UNTOUCHED, "u");
    for c in &caches {
        for key in UNTOUCHED {
            filled(c, key, "u");
        }
    }
    for (w, writer) in caches.iter().enumerate() {
        let k = |name: &str| format!("{name}-{w}");
        let (set, async_set, delete) = (k("set"), k("async-set"), k("delete"));
        let (many, dm) = ([k("many-a"), k("many-b")], [k("dm-a"), k("dm-b")]);
        let keys: Vec<&str> = [
            &set, &async_set, &delete, &many[0], &many[1], &dm[0], &dm[1],
        ]
        .into_iter()
        .map(String::as_str)
        .collect();
        seed(&seeder, &keys, "old");
        for c in &caches {
            for key in &keys {
                filled(c, key, "old");
            }
        }
        let before: Vec<Stats> = caches.iter().map(Cache::stats).collect();
        let check = |keys: &[&String], want: Option<&str>, what: &str| {
            for o in (0..3).filter(|&o| o != w) {
                for key in keys {
                    let what = format!("{what} through cache {w}, read by cache {o}");
                    seen(&caches[o], key, want, &what);
                }
            }
        };

        writer.set(&set, "new", S(3600)).unwrap();
        check(&[&set], Some("new"), "set");

        let items = [(many[0].as_str(), "new-a"), (many[1].as_str(), "new-b")];
        assert!(writer.set_many(items, S(3600)).unwrap().is_empty());
        check(&[&many[0]], Some("new-a"), "set_many");
        check(&[&many[1]], Some("new-b"), "set_many");

        runtime()
            .block_on(writer.to_async().set(&async_set, "new", S(3600)))
            .unwrap();
        check(&[&async_set], Some("new"), "async set");

        assert!(writer.delete(&delete).unwrap());
        check(&[&delete], None, "delete");

        assert_eq!(writer.delete_many(&dm).unwrap(), 2);
        check(&[&dm[0], &dm[1]], None, "delete_many");

        // A dropped key drops the copies of the keys that share its stripe (1 in 16,384):
        // one untouched copy of four may go, a flush takes them all.
        for o in (0..3).filter(|&o| o != w) {
            let mut hits = 0;
            for key in UNTOUCHED {
                let (v, hit) = read(&caches[o], key);
                assert_eq!(v.as_deref(), Some("u"));
                hits += usize::from(hit);
            }
            assert!(
                hits >= UNTOUCHED.len() - 1,
                "cache {o} still serves the keys no one wrote (writer {w}), {hits} near hits: \
                 {:?} -> {:?}",
                before[o],
                caches[o].stats()
            );
        }

        let after: Vec<Stats> = caches.iter().map(Cache::stats).collect();
        assert!(
            delta(&before[w], &after[w], |s| s.bus_sent) >= 1,
            "the writer's messages are counted: {:?}",
            after[w]
        );
        for o in (0..3).filter(|&o| o != w) {
            assert!(
                delta(&before[o], &after[o], |s| s.bus_received) >= 1,
                "cache {o} counts what it heard: {:?}",
                after[o]
            );
            assert!(
                delta(&before[o], &after[o], |s| s.bus_keys_dropped) >= 1,
                "cache {o} counts the keys it dropped: {:?}",
                after[o]
            );
        }

        // `clear`: the others' copies of every key go (the keys are gone from the store).
        if clears(w) {
            seed(&seeder, &["clear"], "old");
            for c in &caches {
                filled(c, "clear", "old");
            }
            writer.clear().unwrap();
            check(&[&"clear".to_owned()], None, "clear");
            seed(&seeder, &UNTOUCHED, "u");
            for c in &caches {
                for key in UNTOUCHED {
                    filled(c, key, "u");
                }
            }
        }
    }
}

/// A cache without a near tier on the bus (a process that only writes) announces its writes:
/// another cache's copy is dropped within the bus bound.
fn a_cache_without_a_near_tier_announces_its_writes(via: Via) {
    let env = Env::new(Kind::Memcached, "writer_only");
    let bus = Bus::new(via);
    let writer = patient(env.apart(1))
        .near_bus(bus.transport())
        .build()
        .unwrap();
    let reader = patient(env.apart(2))
        .near_cache(CAPACITY)
        .near_bus(bus.transport())
        .build()
        .unwrap();
    seed(&seeder(&env), &["k"], "old");
    filled(&reader, "k", "old");
    writer.set("k", "new", S(3600)).unwrap();
    seen(
        &reader,
        "k",
        Some("new"),
        "a write of a cache without a near tier",
    );
    runtime().block_on(writer.to_async().delete("k")).unwrap();
    seen(&reader, "k", None, "its async delete");
}

mod writer_only {
    use super::*;

    #[test]
    fn in_process_bus() {
        a_cache_without_a_near_tier_announces_its_writes(Via::InProcess);
    }

    #[cfg(feature = "redis")]
    #[test]
    fn redis_bus() {
        a_cache_without_a_near_tier_announces_its_writes(Via::Redis);
    }
}

/// `near_bus_heartbeat` takes 10 ms to 60 s; `build()` refuses anything else (`is_config`).
#[test]
fn the_heartbeat_is_checked_when_the_cache_is_built() {
    let build = |d: Duration| {
        Cache::builder()
            .in_memory()
            .near_cache(CAPACITY)
            .near_bus(InProcessBus::new())
            .near_bus_heartbeat(d)
            .build()
    };
    for bad in [MS(0), MS(9), S(61)] {
        let e = build(bad).expect_err("out of range");
        assert!(e.is_config(), "{bad:?}: {e}");
    }
    for good in [MS(10), S(1), S(60)] {
        build(good).unwrap();
    }
}

// ---------------------------------------------------------------------------------------------
// Across processes.

/// What a child is told: `target` (`memcached=ADDR` or `redis=URL`), flavor, the bus's Redis
/// URL, its channel, and how to behave (`near`: a near tier of its own; `exit`: exits as soon
/// as its write returned, else waits for its stdin to close), one per line.
const CHILD: &str = "NEWCACHE_BUS_CHILD";

/// A child: another process on the parent's bus, writing key `k` on the parent's shared tier.
/// Prints `written` once its write returned. Without the parent's environment: nothing.
#[cfg(feature = "redis")]
#[test]
#[ignore = "run by another_process"]
fn child_writes_on_the_bus() {
    let Ok(spec) = std::env::var(CHILD) else {
        return;
    };
    let [target, flavor, bus_url, channel, mode]: [&str; 5] =
        spec.lines().collect::<Vec<_>>().try_into().unwrap();
    let b = Cache::builder().flavor(flavor);
    let b = match target.split_once('=') {
        Some(("memcached", addr)) => b.memcached([addr]),
        Some(("redis", url)) => b.redis(url),
        _ => panic!("unknown target {target}"),
    };
    let b = match mode.contains("near") {
        true => b.near_cache(CAPACITY),
        false => b,
    };
    let cache = patient(b)
        .near_bus(newcache::RedisBus::new(bus_url, channel).unwrap())
        .build()
        .unwrap();
    cache.set("k", "from the child", S(3600)).unwrap();
    println!("written");
    std::io::stdout().flush().unwrap();
    if !mode.contains("exit") {
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut std::io::stdin(), &mut rest);
    }
    drop(cache);
}

/// Another process on the same bus writes the key on the shared tier: this process's copy is
/// dropped within the bus bound, its clock never reaching the near ttl; the other process is a
/// new sender, which flushes nothing (another key's copy is still served).
#[cfg(feature = "redis")]
mod another_process {
    use super::*;

    fn check(target: String, builder: CacheBuilder, child_near: bool, child_exits: bool) {
        let flavor = unique_flavor("child");
        let channel = unique_flavor("bus");
        let bus_url = crate::fixture::shared_redis();
        let clock = MockClock::new();
        let cache = patient(builder.clone())
            .flavor(flavor.clone())
            .clock(clock.clone())
            .near_cache(CAPACITY)
            .near_bus(newcache::RedisBus::new(bus_url, channel.clone()).unwrap())
            .build()
            .unwrap();
        cache.set("k", "v1", S(3600)).unwrap();
        filled(&cache, "k", "v1");
        cache.set("j", "w", S(3600)).unwrap();
        filled(&cache, "j", "w");
        let before = cache.stats();
        let mode = match (child_near, child_exits) {
            (true, true) => "near exit",
            (true, false) => "near",
            (false, true) => "exit",
            (false, false) => "plain",
        };
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "bus::child_writes_on_the_bus", "--ignored"])
            .args(["--test-threads", "1", "--quiet", "--nocapture"])
            .env(
                CHILD,
                [target.as_str(), &flavor, bus_url, &channel, mode].join("\n"),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        // Read to its end before the child is waited for: a child whose stdout is closed fails
        // to print its test summary.
        let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
        let written = out
            .by_ref()
            .map_while(Result::ok)
            .any(|l| l.contains("written"));
        assert!(written, "the child wrote (its stdout closed first)");
        let drain = thread::spawn(move || out.for_each(drop));
        let reference = builder.flavor(flavor).build().unwrap();
        assert_eq!(
            reference.get::<String>("k").unwrap().as_deref(),
            Some("from the child")
        );
        if child_exits {
            assert!(child.wait().unwrap().success(), "the child failed");
        }
        let took = seen(
            &cache,
            "k",
            Some("from the child"),
            "another process's write",
        );
        eprintln!("another process's write seen after {took:?}");
        let (_, hit) = read(&cache, "j");
        let after = cache.stats();
        assert!(hit, "another key's copy is still served: {after:?}");
        assert_eq!(delta(&before, &after, |s| s.bus_flushes), 0, "{after:?}");
        assert!(
            delta(&before, &after, |s| s.bus_keys_dropped) >= 1,
            "{after:?}"
        );
        drop(child.stdin.take());
        drain.join().unwrap();
        assert!(child.wait().unwrap().success(), "the child failed");
    }

    /// The parent's and the child's store: a server of the test's own (the parent's copies
    /// share their fence domain with no other test's), and the handle that keeps it alive.
    fn memcached_of_its_own() -> (String, CacheBuilder, Memcached) {
        let m = Memcached::start();
        let b = Cache::builder().memcached([m.addr()]);
        (format!("memcached={}", m.addr()), b, m)
    }

    fn redis_of_its_own() -> (String, CacheBuilder, crate::fixture::RedisServer) {
        let r = crate::fixture::RedisServer::start("redis-server");
        let b = Cache::builder().redis(r.url());
        (format!("redis={}", r.url()), b, r)
    }

    #[test]
    fn memcached() {
        let (target, builder, _server) = memcached_of_its_own();
        check(target, builder, false, false);
    }

    #[test]
    fn memcached_from_a_process_with_a_near_tier() {
        let (target, builder, _server) = memcached_of_its_own();
        check(target, builder, true, false);
    }

    #[test]
    fn redis() {
        let (target, builder, _server) = redis_of_its_own();
        check(target, builder, false, false);
    }

    #[test]
    fn redis_from_a_process_with_a_near_tier() {
        let (target, builder, _server) = redis_of_its_own();
        check(target, builder, true, false);
    }

    /// A process that exits (its cache dropped) as soon as its write returned has announced
    /// the write.
    #[test]
    fn memcached_from_a_process_that_exits_at_once() {
        let (target, builder, _server) = memcached_of_its_own();
        check(target, builder, false, true);
    }
}

// ---------------------------------------------------------------------------------------------
// A quiet bus.

/// A transport that carried nothing for a while (its subscriber idle for a second) delivers
/// every message published after that, in order, to a listener.
fn a_quiet_transport_delivers_every_later_message(via: Via) {
    let bus = Bus::new(via);
    let transport = bus.transport();
    let heard: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
    let up = Arc::new(AtomicBool::new(false));
    let (h, u) = (heard.clone(), up.clone());
    transport.subscribe(Arc::new(move |event| {
        match event {
            BusEvent::Message(m) => h.lock().unwrap().push(m.to_vec()),
            BusEvent::Reconnected => u.store(true, Ordering::SeqCst),
            _ => {}
        }
        true
    }));
    let deadline = Instant::now() + WITHIN;
    while !up.load(Ordering::SeqCst) {
        assert!(Instant::now() < deadline, "never subscribed");
        thread::sleep(MS(5));
    }
    thread::sleep(S(1));
    let sent: Vec<Vec<u8>> = (0..5u8).map(|i| vec![b'm', i]).collect();
    for m in &sent {
        transport.publish(m);
        thread::sleep(MS(300));
    }
    let deadline = Instant::now() + WITHIN;
    while heard.lock().unwrap().len() < sent.len() {
        assert!(
            Instant::now() < deadline,
            "heard {:?} of {sent:?}",
            heard.lock().unwrap()
        );
        thread::sleep(MS(5));
    }
    assert_eq!(*heard.lock().unwrap(), sent);
}

/// A cache on a healthy bus that nothing writes to keeps serving its copies: it hears its own
/// heartbeats, so many heartbeats of quiet flush nothing (`bus_heartbeats_missed`,
/// `bus_flushes` unchanged) and every read is a near hit.
fn a_quiet_bus_keeps_the_copies(via: Via) {
    let env = Env::new(Kind::Memory, "quiet");
    let bus = Bus::new(via);
    let cache = on_bus_every(env.apart(2), bus.transport(), CALM_HEARTBEAT);
    let _peer = on_bus_every(env.apart(1), bus.transport(), CALM_HEARTBEAT);
    seed(&seeder(&env), &["j"], "old");
    filled(&cache, "j", "old");
    let before = cache.stats();
    for _ in 0..8 {
        thread::sleep(CALM_HEARTBEAT);
        let (v, hit) = read(&cache, "j");
        assert_eq!(v.as_deref(), Some("old"));
        assert!(
            hit,
            "a near hit after quiet heartbeats: {:?}",
            cache.stats()
        );
    }
    let after = cache.stats();
    assert_eq!(
        delta(&before, &after, |s| s.bus_heartbeats_missed),
        0,
        "{after:?}"
    );
    assert_eq!(delta(&before, &after, |s| s.bus_flushes), 0, "{after:?}");
}

macro_rules! on_each_transport {
    ($module:ident, $test:ident) => {
        mod $module {
            use super::*;

            #[test]
            fn in_process_bus() {
                $test(Via::InProcess);
            }

            #[cfg(feature = "redis")]
            #[test]
            fn redis_bus() {
                $test(Via::Redis);
            }

            #[cfg(feature = "redis")]
            #[test]
            fn valkey_bus() {
                $test(Via::Valkey);
            }

            #[cfg(feature = "redis")]
            #[test]
            fn redis_cluster_bus() {
                $test(Via::RedisCluster);
            }
        }
    };
}

on_each_transport!(
    quiet_transport,
    a_quiet_transport_delivers_every_later_message
);
on_each_transport!(quiet_bus, a_quiet_bus_keeps_the_copies);

// ---------------------------------------------------------------------------------------------
// Without the bus: the near ttl.

/// A transport that moves nothing: what it is given to publish goes nowhere, and its
/// listeners never hear anything (a bus stopped, or never reachable).
#[derive(Debug)]
struct Stopped;

impl BusTransport for Stopped {
    fn publish(&self, _: &[u8]) {}
    fn subscribe(&self, _: BusListener) {}
}

/// A writer whose bus is stopped (nothing it announces arrives): another cache, on a healthy
/// bus, serves its copy until the near ttl has passed (however many heartbeats pass meanwhile),
/// then the new value.
fn a_write_not_announced_is_seen_once_the_near_ttl_passed(kind: Kind) {
    let env = Env::new(kind, "stopped");
    let bus = InProcessBus::new();
    let reader = patient(env.apart(2))
        .near_cache(CAPACITY)
        .near_ttl(S(2))
        .near_bus(bus.clone())
        .near_bus_heartbeat(HEARTBEAT)
        .build()
        .unwrap();
    // Another cache on the healthy bus: the reader hears a sender besides itself.
    let _peer = patient(env.apart(1))
        .near_cache(CAPACITY)
        .near_bus(bus)
        .near_bus_heartbeat(HEARTBEAT)
        .build()
        .unwrap();
    let writer = env
        .apart(3)
        .near_cache(CAPACITY)
        .near_bus(Arc::new(Stopped))
        .near_bus_heartbeat(HEARTBEAT)
        .connect_timeout_if_servers(kind, MS(200))
        .build()
        .unwrap();
    seed(&seeder(&env), &["k"], "v1");
    filled(&reader, "k", "v1");
    writer.set("k", "v2", S(3600)).unwrap();
    assert_eq!(writer.get::<String>("k").unwrap().as_deref(), Some("v2"));
    // Ten heartbeats of real time: the bus says nothing of the write.
    thread::sleep(10 * HEARTBEAT);
    let (v, hit) = read(&reader, "k");
    assert_eq!(
        v.as_deref(),
        Some("v1"),
        "the copy is served: nothing told the reader"
    );
    assert!(hit);
    env.advance(MS(1900));
    assert_eq!(
        reader.get::<String>("k").unwrap().as_deref(),
        Some("v1"),
        "the copy is served within the near ttl"
    );
    env.advance(MS(200));
    assert_eq!(
        reader.get::<String>("k").unwrap().as_deref(),
        Some("v2"),
        "past the near ttl, the shared value"
    );
}

/// `connect_timeout`, on the backends it applies to.
trait ConnectTimeout {
    fn connect_timeout_if_servers(self, kind: Kind, d: Duration) -> Self;
}

impl ConnectTimeout for CacheBuilder {
    fn connect_timeout_if_servers(self, kind: Kind, d: Duration) -> Self {
        match kind {
            Kind::Memory => self,
            _ => self.connect_timeout(d),
        }
    }
}

mod stopped {
    use super::*;

    #[test]
    fn memory() {
        a_write_not_announced_is_seen_once_the_near_ttl_passed(Kind::Memory);
    }

    #[test]
    fn memcached() {
        a_write_not_announced_is_seen_once_the_near_ttl_passed(Kind::Memcached);
    }

    #[cfg(feature = "redis")]
    #[test]
    fn redis() {
        a_write_not_announced_is_seen_once_the_near_ttl_passed(Kind::Redis);
    }
}

/// A cache whose bus never delivers its own first message is built all the same (within a
/// generous bound of its connect timeout), and its near tier serves no hits: every read goes
/// to the shared tier (a near miss), so another cache's write is seen at once.
#[test]
fn a_cache_that_never_hears_itself_serves_no_near_hits() {
    let env = Env::new(Kind::Memcached, "never_heard");
    let start = Instant::now();
    let cache = env
        .apart(2)
        .near_cache(CAPACITY)
        .near_bus(Arc::new(Stopped))
        .connect_timeout(MS(300))
        .build()
        .unwrap();
    assert!(start.elapsed() < S(10), "built after {:?}", start.elapsed());
    let seeder = seeder(&env);
    seed(&seeder, &["k"], "v1");
    let before = cache.stats();
    for _ in 0..3 {
        assert_eq!(cache.get::<String>("k").unwrap().as_deref(), Some("v1"));
    }
    let after = cache.stats();
    assert_eq!(delta(&before, &after, |s| s.near_hits), 0, "{after:?}");
    assert!(delta(&before, &after, |s| s.near_misses) >= 3, "{after:?}");
    seed(&seeder, &["k"], "v2");
    assert_eq!(cache.get::<String>("k").unwrap().as_deref(), Some("v2"));
}

// ---------------------------------------------------------------------------------------------
// Losses.

/// A transport in front of another that a test steers: it drops the next message that names
/// a given derived key, or every message while paused; and it can tell its listeners that the
/// connection dropped or came back.
struct Lossy {
    inner: Arc<dyn BusTransport>,
    /// The derived key whose next announcement is dropped.
    drop_naming: Mutex<Option<Vec<u8>>>,
    /// How many announcements were dropped so.
    dropped: AtomicUsize,
    paused: AtomicBool,
    listeners: Mutex<Vec<BusListener>>,
}

impl std::fmt::Debug for Lossy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lossy")
            .field("inner", &self.inner)
            .field("paused", &self.paused)
            .finish_non_exhaustive()
    }
}

impl Lossy {
    fn new(inner: Arc<dyn BusTransport>) -> Arc<Lossy> {
        Arc::new(Lossy {
            inner,
            drop_naming: Mutex::new(None),
            dropped: AtomicUsize::new(0),
            paused: AtomicBool::new(false),
            listeners: Mutex::new(Vec::new()),
        })
    }

    /// Drops the next message that names `derived_key`.
    fn drop_next_naming(&self, derived_key: &str) {
        *self.drop_naming.lock().unwrap() = Some(derived_key.as_bytes().to_vec());
    }

    /// Waits until a message was dropped so.
    fn wait_dropped(&self) {
        let deadline = Instant::now() + WITHIN;
        while self.dropped.load(Ordering::SeqCst) == 0 {
            assert!(Instant::now() < deadline, "no message named the key");
            thread::sleep(MS(1));
        }
    }

    fn pause(&self, paused: bool) {
        self.paused.store(paused, Ordering::SeqCst);
    }

    /// Tells every listener `event`, as the transport would.
    fn tell(&self, event: BusEvent<'_>) {
        let listeners = self.listeners.lock().unwrap().clone();
        for l in listeners {
            let _ = l(event);
        }
    }
}

impl BusTransport for Lossy {
    fn publish(&self, message: &[u8]) {
        if self.paused.load(Ordering::SeqCst) {
            return;
        }
        {
            let mut naming = self.drop_naming.lock().unwrap();
            let names = |k: &[u8]| message.windows(k.len()).any(|w| w == k);
            if naming.as_deref().is_some_and(names) {
                *naming = None;
                self.dropped.fetch_add(1, Ordering::SeqCst);
                return;
            }
        }
        self.inner.publish(message);
    }

    fn subscribe(&self, listener: BusListener) {
        self.listeners.lock().unwrap().push(listener.clone());
        self.inner.subscribe(listener);
    }
}

/// A cache of the loss tests: a near tier, on `transport`, heartbeats every [`HEARTBEAT`].
fn on_bus(b: CacheBuilder, transport: Arc<dyn BusTransport>) -> Cache {
    on_bus_every(b, transport, HEARTBEAT)
}

fn on_bus_every(b: CacheBuilder, transport: Arc<dyn BusTransport>, heartbeat: Duration) -> Cache {
    patient(b)
        .near_cache(CAPACITY)
        .near_bus(transport)
        .near_bus_heartbeat(heartbeat)
        .build()
        .unwrap()
}

/// The announcement of a write is lost (the writer's transport drops it: a sequence gap): the
/// reader flushes its copies when the writer's next message (a heartbeat at the latest)
/// arrives, well within the heartbeat bound, though its clock never reaches the near ttl: the
/// written key is seen, and the copy of a key no one wrote is read from the shared tier once
/// (`bus_gaps`, `bus_flushes`).
fn a_lost_message_flushes_within_the_heartbeat_bound(via: Via) {
    let env = Env::new(Kind::Memory, "gap");
    let bus = Bus::new(via);
    let reader = on_bus(env.apart(2), bus.transport());
    let lossy = Lossy::new(bus.transport());
    let writer = on_bus(env.apart(1), lossy.clone());
    seed(&seeder(&env), &["k", "j"], "old");
    filled(&reader, "k", "old");
    filled(&reader, "j", "old");
    // The writer is a sender the reader knows (its first messages arrived).
    writer.set("warm", "w", S(3600)).unwrap();
    seen(&reader, "warm", Some("w"), "the writer's first write");
    let before = reader.stats();
    lossy.drop_next_naming(&writer.make_key("k"));
    writer.set("k", "new", S(3600)).unwrap();
    lossy.wait_dropped();
    let took = seen_within(
        &reader,
        "k",
        Some("new"),
        LOSS_BOUND,
        "a write whose message was lost",
    );
    eprintln!("a lost message's key seen after {took:?}");
    let (v, hit) = read(&reader, "j");
    assert_eq!(v.as_deref(), Some("old"));
    assert!(!hit, "every copy was flushed");
    let after = reader.stats();
    assert!(delta(&before, &after, |s| s.bus_gaps) >= 1, "{after:?}");
    assert!(delta(&before, &after, |s| s.bus_flushes) >= 1, "{after:?}");
    // And the bus goes on: the next write is seen.
    writer.set("k", "newer", S(3600)).unwrap();
    seen(&reader, "k", Some("newer"), "the write after the gap");
}

mod lost_message {
    use super::*;

    #[test]
    fn in_process_bus() {
        a_lost_message_flushes_within_the_heartbeat_bound(Via::InProcess);
    }

    #[cfg(feature = "redis")]
    #[test]
    fn redis_bus() {
        a_lost_message_flushes_within_the_heartbeat_bound(Via::Redis);
    }
}

/// The transport says its connection dropped (and the cache's own messages are not heard):
/// at once every copy is flushed and the near tier serves no hits, so a write no one announced
/// is read; once the transport is back and the cache hears itself, it serves hits again
/// (`bus_reconnects`).
#[test]
fn a_disconnected_bus_serves_no_near_hits_until_it_hears_itself() {
    let env = Env::new(Kind::Memory, "disconnected");
    let lossy = Lossy::new(InProcessBus::new());
    let cache = on_bus(env.apart(2), lossy.clone());
    let seeder = seeder(&env);
    seed(&seeder, &["j"], "old");
    filled(&cache, "j", "old");
    let before = cache.stats();
    lossy.pause(true);
    lossy.tell(BusEvent::Disconnected);
    seed(&seeder, &["j"], "new");
    for _ in 0..3 {
        let (v, hit) = read(&cache, "j");
        assert_eq!(v.as_deref(), Some("new"), "read from the shared tier");
        assert!(!hit, "no near hit while the bus is down");
    }
    let during = cache.stats();
    assert!(
        delta(&before, &during, |s| s.near_misses) >= 3,
        "{during:?}"
    );
    lossy.pause(false);
    lossy.tell(BusEvent::Reconnected);
    let v = serves_again(&cache, "j", LOSS_BOUND, "after the reconnect");
    assert_eq!(v.as_deref(), Some("new"));
    let after = cache.stats();
    assert!(
        delta(&before, &after, |s| s.bus_reconnects) >= 1,
        "{after:?}"
    );
    assert!(delta(&before, &after, |s| s.bus_flushes) >= 1, "{after:?}");
}

/// A bus whose URL names an ACL user subscribes and publishes as that user (the set-up every
/// sync connection sends), on a server that refuses a connection that does not authenticate.
#[cfg(feature = "redis")]
#[test]
fn a_bus_url_with_an_acl_user_subscribes_and_publishes_as_it() {
    let server = crate::fixture::RedisServer::start("redis-server");
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_connection().unwrap();
    let () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("bus-user")
        .arg("on")
        .arg(">secret")
        .arg(&["~*", "&*", "+@all"])
        .query(&mut conn)
        .unwrap();
    let () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("default")
        .arg("off")
        .query(&mut conn)
        .unwrap();
    let url = format!("redis://bus-user:secret@127.0.0.1:{}/0", server.port);
    let bus = newcache::RedisBus::new(&url, unique_flavor("acl-bus")).unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<Option<Vec<u8>>>();
    let tx = Mutex::new(tx);
    let listener: BusListener = Arc::new(move |e: BusEvent<'_>| {
        let heard = match e {
            BusEvent::Message(m) => Some(m.to_vec()),
            _ => None,
        };
        let _ = tx.lock().unwrap().send(heard);
        true
    });
    bus.subscribe(listener);
    assert_eq!(
        rx.recv_timeout(Duration::from_secs(10)),
        Ok(None),
        "the subscriber authenticated and subscribed"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        assert!(Instant::now() < deadline, "the publisher never got through");
        bus.publish(b"hello");
        if let Ok(Some(m)) = rx.recv_timeout(Duration::from_millis(200)) {
            assert_eq!(m, b"hello");
            break;
        }
    }
}

/// The server cuts the subscribers off (`CLIENT KILL TYPE pubsub` on a Redis of the test's
/// own, the bus's): the reader counts a reconnect, its copies filled before are flushed (read
/// from the shared tier once), it serves hits again once it hears itself, and hears the
/// writer's writes again.
#[cfg(feature = "redis")]
#[test]
fn a_killed_subscriber_flushes_and_serves_again_once_back() {
    let server = crate::fixture::RedisServer::start("redis-server");
    let channel = unique_flavor("bus");
    let transport = || -> Arc<dyn BusTransport> {
        newcache::RedisBus::new(&server.url(), channel.clone()).unwrap()
    };
    let env = Env::new(Kind::Memory, "killed");
    let reader = on_bus(env.apart(2), transport());
    let writer = on_bus(env.apart(1), transport());
    seed(&seeder(&env), &["k", "j"], "old");
    filled(&reader, "k", "old");
    filled(&reader, "j", "old");
    let before = reader.stats();
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_connection().unwrap();
    let killed: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("pubsub")
        .query(&mut conn)
        .unwrap();
    assert!(killed >= 1, "the subscribers were cut off ({killed})");
    let deadline = Instant::now() + LOSS_BOUND;
    while reader.stats().bus_reconnects == before.bus_reconnects {
        assert!(
            Instant::now() < deadline,
            "no reconnect: {:?}",
            reader.stats()
        );
        thread::sleep(MS(5));
    }
    let (v, hit) = read(&reader, "j");
    assert_eq!(v.as_deref(), Some("old"));
    assert!(!hit, "the copy filled before the cut was flushed");
    assert_eq!(
        serves_again(&reader, "j", LOSS_BOUND, "after the reconnect").as_deref(),
        Some("old")
    );
    filled(&reader, "k", "old");
    writer.set("k", "new", S(3600)).unwrap();
    seen(&reader, "k", Some("new"), "a write after the reconnect");
    let after = reader.stats();
    assert!(delta(&before, &after, |s| s.bus_flushes) >= 1, "{after:?}");
}

/// The bus stops delivering anything (a transport that drops every message, as a paused
/// server does): within a few heartbeats the cache, not hearing itself, stops serving near
/// hits (`bus_heartbeats_missed`), so a write no one could announce is read; once the bus
/// delivers again it serves hits again.
#[test]
fn a_paused_bus_stops_near_hits_within_a_few_heartbeats() {
    let env = Env::new(Kind::Memory, "paused");
    let lossy = Lossy::new(InProcessBus::new());
    let cache = on_bus(env.apart(2), lossy.clone());
    let other = on_bus(env.apart(1), lossy.clone());
    let seeder = seeder(&env);
    seed(&seeder, &["j"], "old");
    filled(&cache, "j", "old");
    let before = cache.stats();
    lossy.pause(true);
    stops_serving(&cache, "j", "a paused bus");
    seed(&seeder, &["j"], "new");
    for _ in 0..3 {
        let (v, hit) = read(&cache, "j");
        assert_eq!(v.as_deref(), Some("new"), "read from the shared tier");
        assert!(!hit, "no near hit while the bus is paused");
    }
    // The pause is counted while it lasts.
    let start = Instant::now();
    while cache.stats().bus_heartbeats_missed == before.bus_heartbeats_missed {
        assert!(
            start.elapsed() < LOSS_BOUND,
            "no missed heartbeat counted: {:?}",
            cache.stats()
        );
        thread::sleep(MS(10));
    }
    lossy.pause(false);
    assert_eq!(
        serves_again(&cache, "j", LOSS_BOUND, "after the pause").as_deref(),
        Some("new")
    );
    // The bus works again: the other cache's write is seen.
    other.set("j", "newer", S(3600)).unwrap();
    seen(&cache, "j", Some("newer"), "a write after the pause");
}

/// Waits until `cache` stops serving its copy of `key` (whose second read must then be no near
/// hit either), within [`LOSS_BOUND`]; the time it took is printed.
#[track_caller]
fn stops_serving(cache: &Cache, key: &str, what: &str) {
    let start = Instant::now();
    loop {
        let (_, hit) = read(cache, key);
        if !hit {
            let (_, again) = read(cache, key);
            assert!(!again, "{what}: the copy read again was served");
            eprintln!("{what}: no near hits after {:?}", start.elapsed());
            return;
        }
        assert!(
            start.elapsed() < LOSS_BOUND,
            "{what}: near hits {:?} on: {:?}",
            start.elapsed(),
            cache.stats()
        );
        thread::sleep(MS(10));
    }
}

/// The bus's own server is stopped (SIGSTOP of a Redis of the test's own): within a few
/// heartbeats the cache stops serving near hits (`bus_heartbeats_missed`); once the server
/// runs again (SIGCONT) it serves hits again and hears the other cache's writes.
#[cfg(feature = "redis")]
#[test]
fn a_stopped_bus_server_stops_near_hits_until_it_runs_again() {
    let server = crate::fixture::RedisServer::start("redis-server");
    let channel = unique_flavor("bus");
    let transport = || -> Arc<dyn BusTransport> {
        newcache::RedisBus::new(&server.url(), channel.clone()).unwrap()
    };
    let env = Env::new(Kind::Memory, "sigstop");
    let cache = on_bus(env.apart(2), transport());
    let other = on_bus(env.apart(1), transport());
    let seeder = seeder(&env);
    seed(&seeder, &["j"], "old");
    filled(&cache, "j", "old");
    let before = cache.stats();
    server.signal("STOP");
    let stopped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        stops_serving(&cache, "j", "the bus's server stopped");
        seed(&seeder, &["j"], "new");
        let (v, hit) = read(&cache, "j");
        assert_eq!(v.as_deref(), Some("new"));
        assert!(!hit);
        // The pause is counted while it lasts.
        let start = Instant::now();
        while cache.stats().bus_heartbeats_missed == before.bus_heartbeats_missed {
            assert!(
                start.elapsed() < LOSS_BOUND,
                "no missed heartbeat counted: {:?}",
                cache.stats()
            );
            thread::sleep(MS(10));
        }
    }));
    server.signal("CONT");
    if let Err(e) = stopped {
        std::panic::resume_unwind(e);
    }
    assert_eq!(
        serves_again(&cache, "j", WITHIN, "after SIGCONT").as_deref(),
        Some("new")
    );
    other.set("j", "newer", S(3600)).unwrap();
    seen(&cache, "j", Some("newer"), "a write after SIGCONT");
}

/// A sender that is dropped says it leaves: its silence, many heartbeats long, flushes
/// nothing. A new cache instance on the bus (a restarted process) is a new sender: it flushes
/// nothing either (the reader's copies are still served, `bus_flushes` unchanged), and its
/// writes are heard.
fn a_restarted_sender_flushes_nothing(via: Via) {
    let env = Env::new(Kind::Memory, "restart");
    let bus = Bus::new(via);
    let reader = on_bus_every(env.apart(2), bus.transport(), CALM_HEARTBEAT);
    let writer = on_bus_every(env.apart(1), bus.transport(), CALM_HEARTBEAT);
    seed(&seeder(&env), &["k", "j"], "old");
    filled(&reader, "j", "old");
    filled(&reader, "k", "old");
    writer.set("k", "v1", S(3600)).unwrap();
    seen(&reader, "k", Some("v1"), "the first writer's write");
    filled(&reader, "k", "v1");
    let before = reader.stats();
    drop(writer);
    thread::sleep(5 * CALM_HEARTBEAT);
    for key in ["j", "k"] {
        let (_, hit) = read(&reader, key);
        assert!(
            hit,
            "a sender that left: {key}'s copy is still served: {before:?} -> {:?}",
            reader.stats()
        );
    }
    let restarted = on_bus_every(env.apart(1), bus.transport(), CALM_HEARTBEAT);
    restarted.set("other", "x", S(3600)).unwrap();
    thread::sleep(5 * CALM_HEARTBEAT);
    for key in ["j", "k"] {
        let (_, hit) = read(&reader, key);
        assert!(hit, "a new sender: {key}'s copy is still served");
    }
    let after = reader.stats();
    assert_eq!(
        delta(&before, &after, |s| s.bus_flushes),
        0,
        "no flush: {after:?}"
    );
    restarted.set("k", "v2", S(3600)).unwrap();
    seen(&reader, "k", Some("v2"), "the restarted writer's write");
}

mod restarted_sender {
    use super::*;

    #[test]
    fn in_process_bus() {
        a_restarted_sender_flushes_nothing(Via::InProcess);
    }

    #[cfg(feature = "redis")]
    #[test]
    fn redis_bus() {
        a_restarted_sender_flushes_nothing(Via::Redis);
    }
}

// ---------------------------------------------------------------------------------------------
// An invalidation storm.

/// How many keys the storm writes, and how many times each.
const STORM_KEYS: usize = 1_000;
const STORM_ROUNDS: u64 = 3;

/// How long after a write returned a replaced value may still be read, in the storm: the bus
/// bound (tens of milliseconds) with a wide margin for 64 readers and a writer on two cores.
const STORM_BOUND: Duration = Duration::from_secs(1);

/// 1,000 keys written three times by one cache while 64 tasks read them through another
/// (an `AsyncCache` with a near tier, the two on a Redis bus): no read that began later than
/// the bus bound after a write returned gets the value that write replaced; once the writes
/// are done, every key reads its last value. The reads were mostly near hits (the storm is
/// not won by serving nothing near).
#[cfg(feature = "redis")]
fn a_storm_leaves_no_replaced_value_served(kind: Kind) {
    let (env, _servers) = tier(kind, "storm");
    let bus = Bus::new(Via::Redis);
    let writer = patient(env.apart(1))
        .near_cache(CAPACITY)
        .near_bus(bus.transport())
        .build()
        .unwrap();
    let reader = patient(env.apart(0))
        .near_cache(CAPACITY)
        .near_bus(bus.transport())
        .build_async()
        .unwrap();
    let keys: Arc<Vec<String>> = Arc::new((0..STORM_KEYS).map(|i| format!("s{i}")).collect());
    for chunk in keys.chunks(500) {
        let items = chunk.iter().map(|k| (k.as_str(), &0u64));
        assert!(writer.set_many(items, S(3600)).unwrap().is_empty());
    }
    // When each key's version v was written (ns after `origin`; 0: not yet).
    let origin = Instant::now();
    let returned: Arc<Vec<Vec<AtomicU64>>> = Arc::new(
        (0..STORM_KEYS)
            .map(|_| (0..=STORM_ROUNDS).map(|_| AtomicU64::new(0)).collect())
            .collect(),
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let late: Arc<Mutex<Vec<String>>> = Arc::default();
    let most_behind = Arc::new(AtomicU64::new(0));
    let reads = Arc::new(AtomicU64::new(0));
    let bound = STORM_BOUND.as_nanos() as u64;
    let before = reader.stats();
    rt.block_on(async {
        for k in keys.iter() {
            assert_eq!(reader.get::<u64>(k).await.unwrap(), Some(0));
        }
        let tasks: Vec<_> = (0..64u64)
            .map(|t| {
                let (reader, keys, returned) = (reader.clone(), keys.clone(), returned.clone());
                let (stop, late, most_behind) = (stop.clone(), late.clone(), most_behind.clone());
                let reads = reads.clone();
                tokio::spawn(async move {
                    let mut x = t.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
                    while !stop.load(Ordering::SeqCst) {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let i = (x % STORM_KEYS as u64) as usize;
                        let began = origin.elapsed().as_nanos() as u64;
                        let got = reader.get::<u64>(&keys[i]).await.unwrap().unwrap();
                        reads.fetch_add(1, Ordering::Relaxed);
                        if got < STORM_ROUNDS {
                            let next = returned[i][got as usize + 1].load(Ordering::SeqCst);
                            if next != 0 && began > next {
                                most_behind.fetch_max(began - next, Ordering::Relaxed);
                                if began > next + bound {
                                    late.lock().unwrap().push(format!(
                                        "{}: read {got} {:?} after version {} was written",
                                        keys[i],
                                        Duration::from_nanos(began - next),
                                        got + 1
                                    ));
                                }
                            }
                        }
                        tokio::task::yield_now().await;
                    }
                })
            })
            .collect();
        let writing = {
            let (keys, returned) = (keys.clone(), returned.clone());
            tokio::task::spawn_blocking(move || {
                for v in 1..=STORM_ROUNDS {
                    for (i, k) in keys.iter().enumerate() {
                        writer.set(k, &v, S(3600)).unwrap();
                        let at = origin.elapsed().as_nanos() as u64;
                        returned[i][v as usize].store(at, Ordering::SeqCst);
                    }
                }
            })
        };
        writing.await.unwrap();
        tokio::time::sleep(STORM_BOUND).await;
        stop.store(true, Ordering::SeqCst);
        for t in tasks {
            t.await.unwrap();
        }
        for k in keys.iter() {
            assert_eq!(
                reader.get::<u64>(k).await.unwrap(),
                Some(STORM_ROUNDS),
                "{k} after the storm"
            );
        }
    });
    let late = late.lock().unwrap();
    let n = reads.load(Ordering::Relaxed);
    let after = reader.stats();
    eprintln!(
        "storm: {n} reads, {} near hits, a replaced value read at most {:?} after its \
         replacement returned",
        delta(&before, &after, |s| s.near_hits),
        Duration::from_nanos(most_behind.load(Ordering::Relaxed)),
    );
    assert!(
        late.is_empty(),
        "{} of {n} reads got a replaced value past the bound, e.g. {:?}",
        late.len(),
        &late[..late.len().min(5)]
    );
    assert!(
        delta(&before, &after, |s| s.near_hits) > n / 2,
        "most reads were near hits: {after:?}"
    );
}

#[cfg(feature = "redis")]
mod storm {
    use super::*;

    #[test]
    fn memcached() {
        a_storm_leaves_no_replaced_value_served(Kind::Memcached);
    }

    #[test]
    fn redis() {
        a_storm_leaves_no_replaced_value_served(Kind::Redis);
    }
}
