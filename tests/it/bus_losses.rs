//! Losses on the bus that no receiver sees when they happen (a message lost after a
//! reconnect, after a silence, before a leave; a restarted bus server; a sender that started
//! with its bus down), each covered at the sender's next message; and what is not a loss (a
//! slower sender's heartbeat, a process that drops its cache and exits). The caches' clock is
//! the fixture's mock clock: the near ttl never passes, so a value still served after a write
//! is one the bus failed to cover.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use newcache::{BusEvent, BusListener, BusTransport, Cache, CacheBuilder, Stats};

use crate::fixture::{Env, Kind};

const S: fn(u64) -> Duration = Duration::from_secs;
const MS: fn(u64) -> Duration = Duration::from_millis;

/// An in-process bus whose ports (one per cache, as one per process) can lose their next
/// published messages, be muted, or be told events alone.
#[derive(Default)]
struct Hub {
    listeners: Mutex<Vec<(usize, BusListener)>>,
    lose: Mutex<HashMap<usize, usize>>,
    muted: Mutex<HashSet<usize>>,
    lost: AtomicUsize,
}

struct Port {
    hub: Arc<Hub>,
    id: usize,
}

impl std::fmt::Debug for Hub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Hub")
    }
}

impl std::fmt::Debug for Port {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Port({})", self.id)
    }
}

impl Hub {
    fn port(self: &Arc<Hub>, id: usize) -> Arc<Port> {
        Arc::new(Port {
            hub: self.clone(),
            id,
        })
    }
    fn lose_next(&self, id: usize) {
        *self.lose.lock().unwrap().entry(id).or_default() += 1;
    }
    fn mute(&self, id: usize, on: bool) {
        let mut m = self.muted.lock().unwrap();
        match on {
            true => m.insert(id),
            false => m.remove(&id),
        };
    }
    fn tell(&self, id: usize, event: BusEvent<'_>) {
        let ls: Vec<_> = self.listeners.lock().unwrap().clone();
        for (i, l) in ls {
            if i == id {
                l(event);
            }
        }
    }
    fn wait_lost(&self, n: usize) {
        let deadline = Instant::now() + S(10);
        while self.lost.load(Ordering::SeqCst) < n {
            assert!(Instant::now() < deadline, "the message was never published");
            thread::sleep(MS(1));
        }
    }
}

impl BusTransport for Port {
    fn publish(&self, message: &[u8]) {
        if self.hub.muted.lock().unwrap().contains(&self.id) {
            self.hub.lost.fetch_add(1, Ordering::SeqCst);
            return;
        }
        {
            let mut lose = self.hub.lose.lock().unwrap();
            if let Some(n) = lose.get_mut(&self.id).filter(|n| **n > 0) {
                *n -= 1;
                self.hub.lost.fetch_add(1, Ordering::SeqCst);
                return;
            }
        }
        let ls: Vec<_> = self.hub.listeners.lock().unwrap().clone();
        for (_, l) in ls {
            l(BusEvent::Message(message));
        }
    }
    fn subscribe(&self, listener: BusListener) {
        self.hub
            .listeners
            .lock()
            .unwrap()
            .push((self.id, listener.clone()));
        listener(BusEvent::Reconnected);
    }
}

fn near(env: &Env) -> CacheBuilder {
    env.builder().near_cache(1 << 20)
}

/// The same memcached named otherwise: a cache over it shares no stripes with `near`'s (as a
/// cache of another process).
fn elsewhere(env: &Env) -> CacheBuilder {
    env.builder()
        .memcached([crate::fixture::shared_server().replace("127.0.0.1", "localhost")])
}

fn delta(before: &Stats, after: &Stats, f: fn(&Stats) -> u64) -> u64 {
    f(after) - f(before)
}

/// Waits until `cache` serves `key` = `want` as a near hit (its bus healthy, its copy filled).
fn near_hit(cache: &Cache, key: &str, want: &str) {
    let deadline = Instant::now() + S(10);
    loop {
        assert_eq!(cache.get::<String>(key).unwrap().as_deref(), Some(want));
        let before = cache.stats();
        assert_eq!(cache.get::<String>(key).unwrap().as_deref(), Some(want));
        if delta(&before, &cache.stats(), |s| s.near_hits) == 1 {
            return;
        }
        assert!(Instant::now() < deadline, "{key} never a near hit");
        thread::sleep(MS(5));
    }
}

/// Polls for `within`: true once `cache` reads `key` = `want`.
fn seen_within(cache: &Cache, key: &str, want: &str, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if cache.get::<String>(key).unwrap().as_deref() == Some(want) {
            return true;
        }
        thread::sleep(MS(5));
    }
    false
}

/// A writer whose last announcement was lost and that then leaves (a cache dropped at
/// shutdown): its leave shows the gap, and the receiver stops serving its copies.
#[test]
fn a_leave_after_a_lost_message_flushes() {
    let env = Env::new(Kind::Memcached, "bus_leave");
    let hub = Arc::new(Hub::default());
    let b = near(&env)
        .near_bus(hub.port(1))
        .near_bus_heartbeat(S(5))
        .build()
        .unwrap();
    let a = elsewhere(&env)
        .near_bus(hub.port(2))
        .near_bus_heartbeat(S(5))
        .build()
        .unwrap();
    b.set("k", "v1", S(3600)).unwrap();
    near_hit(&b, "k", "v1");
    hub.lose_next(2);
    a.set("k", "v2", S(3600)).unwrap();
    hub.wait_lost(1);
    drop(a); // sends Leave (seq + 2): a gap, never checked
    assert!(
        seen_within(&b, "k", "v2", S(3)),
        "a lost announcement followed by a Leave is never covered (stats {:?})",
        b.stats()
    );
}

/// A sender silent past three heartbeats is remembered: its next message, a sequence number
/// past the one lost meanwhile, is a gap.
#[test]
fn a_sender_back_from_silence_with_a_gap_flushes() {
    let env = Env::new(Kind::Memcached, "bus_silence");
    let hub = Arc::new(Hub::default());
    let hb = MS(50);
    let b = near(&env)
        .near_bus(hub.port(1))
        .near_bus_heartbeat(hb)
        .build()
        .unwrap();
    let a = elsewhere(&env)
        .near_bus(hub.port(2))
        .near_bus_heartbeat(hb)
        .build()
        .unwrap();
    b.set("k", "v1", S(3600)).unwrap();
    thread::sleep(hb * 2);
    let before = b.stats();
    hub.mute(2, true); // a's publisher cut off (its writes to the store go on)
    let deadline = Instant::now() + S(10);
    while delta(&before, &b.stats(), |s| s.bus_heartbeats_missed) == 0 {
        assert!(Instant::now() < deadline, "a's silence never noticed");
        thread::sleep(MS(5));
    }
    // b flushed once; it reads k again and keeps it.
    near_hit(&b, "k", "v1");
    a.set("k", "v2", S(3600)).unwrap(); // its announcement is lost
    thread::sleep(hb * 2);
    hub.mute(2, false); // a is heard again, its numbering far ahead
    assert!(
        seen_within(&b, "k", "v2", hb * 20),
        "a sender's lost messages after a silence are never covered (stats {:?})",
        b.stats()
    );
}

/// A receiver that reconnected keeps each sender's numbering: a sender whose first message
/// after the reconnect is lost shows the gap with its next one.
#[test]
fn a_loss_after_the_receivers_reconnect_flushes() {
    let env = Env::new(Kind::Memcached, "bus_reconnect");
    let hub = Arc::new(Hub::default());
    let b = near(&env)
        .near_bus(hub.port(1))
        .near_bus_heartbeat(S(5))
        .build()
        .unwrap();
    let a = elsewhere(&env)
        .near_bus(hub.port(2))
        .near_bus_heartbeat(S(5))
        .build()
        .unwrap();
    a.set("warm", "x", S(3600)).unwrap(); // a known to b, and a's heartbeat 5 s away
    b.set("k", "v1", S(3600)).unwrap();
    hub.tell(1, BusEvent::Disconnected);
    hub.tell(1, BusEvent::Reconnected);
    near_hit(&b, "k", "v1"); // b healthy again (it heard itself), k filled after the flush
    hub.lose_next(2);
    a.set("k", "v2", S(3600)).unwrap();
    hub.wait_lost(1);
    let before = b.stats();
    a.set("other", "y", S(3600)).unwrap(); // heard, one sequence number ahead
    let deadline = Instant::now() + S(5);
    while delta(&before, &b.stats(), |s| s.bus_received) == 0 {
        assert!(Instant::now() < deadline, "a never heard");
        thread::sleep(MS(1));
    }
    assert!(
        seen_within(&b, "k", "v2", S(2)),
        "a loss after the receiver's reconnect is never covered (stats {:?})",
        b.stats()
    );
}

/// The bus's server restarts: the subscribers reconnect at once, while an idle writer's
/// publishing connection is still the dead one, so its first announcement after the restart
/// is lost. Its next message, a sequence number ahead, is a gap: the reader reads the new
/// value, whatever the near ttl.
#[cfg(feature = "redis")]
#[test]
fn an_announcement_lost_to_a_redis_restart_is_covered() {
    let mut server = crate::fixture::RedisServer::start("redis-server");
    let env = Env::new(Kind::Memcached, "bus_restart");
    let b = near(&env)
        .near_bus(newcache::RedisBus::new(&server.url(), "bus").unwrap())
        .build()
        .unwrap();
    // A writer whose heartbeat is long (its unhealthy hellos come every 6 s): idle, as a
    // process that writes rarely is between two writes.
    let a = elsewhere(&env)
        .near_bus(newcache::RedisBus::new(&server.url(), "bus").unwrap())
        .near_bus_heartbeat(S(60))
        .build()
        .unwrap();
    b.set("k", "v1", S(3600)).unwrap();
    a.set("warm", "x", S(3600)).unwrap();
    thread::sleep(MS(100));
    server.restart();
    near_hit(&b, "k", "v1"); // b reconnected, heard itself, read k again
    a.set("k", "v2", S(3600)).unwrap(); // announced on a's dead connection: lost
    thread::sleep(MS(100));
    a.set("other", "y", S(3600)).unwrap(); // heard, a sequence number ahead
    assert!(
        // (under 3 s: past that, b would take a's 60 s heartbeat for silence and flush)
        seen_within(&b, "k", "v2", S(2)),
        "the write after the restart is never covered (stats {:?})",
        b.stats()
    );
}

/// Where `exiting_child` finds the bus.
#[cfg(feature = "redis")]
const CHILD_BUS: &str = "NEWCACHE_REVIEW_BUS_URL";
#[cfg(feature = "redis")]
const CHILD_MEMCACHED: &str = "NEWCACHE_REVIEW_MEMCACHED";

/// A child process: a cache on the bus writes a key, is dropped (as a service's cache is at a
/// graceful shutdown), and the process exits.
#[cfg(feature = "redis")]
#[test]
#[ignore = "run by a_process_that_exits_after_dropping_its_cache_flushes_nobody"]
fn exiting_child() {
    let (Ok(url), Ok(mc)) = (std::env::var(CHILD_BUS), std::env::var(CHILD_MEMCACHED)) else {
        return;
    };
    let cache = Cache::builder()
        .memcached([mc.as_str()])
        .flavor("bus-exit")
        .near_bus(newcache::RedisBus::new(&url, "bus").unwrap())
        .near_bus_heartbeat(MS(100))
        .build()
        .unwrap();
    cache.set("k", "v", S(60)).unwrap();
    thread::sleep(MS(300));
    drop(cache); // the station is told to leave...
    std::process::exit(0); // ...and the process ends (as `main` returning does)
}

/// A process that drops its cache (a graceful shutdown) and exits has said it leaves before it
/// exits: its silence then stops nobody's copies (a rolling deploy is no read storm).
#[cfg(feature = "redis")]
#[test]
fn a_process_that_exits_after_dropping_its_cache_flushes_nobody() {
    let server = crate::fixture::RedisServer::start("redis-server");
    let env = Env::new(Kind::Memcached, "bus_exit");
    let b = near(&env)
        .near_bus(newcache::RedisBus::new(&server.url(), "bus").unwrap())
        .near_bus_heartbeat(MS(100))
        .build()
        .unwrap();
    b.set("k", "v1", S(3600)).unwrap();
    near_hit(&b, "k", "v1");
    let before = b.stats();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "bus_losses::exiting_child", "--ignored"])
        .args(["--test-threads", "1"])
        .env(CHILD_BUS, server.url())
        .env(CHILD_MEMCACHED, crate::fixture::shared_server())
        .output()
        .unwrap();
    assert!(out.status.success(), "the child failed");
    assert!(
        delta(&before, &b.stats(), |s| s.bus_received) > 0,
        "the child was heard"
    );
    thread::sleep(MS(1000));
    let after = b.stats();
    assert_eq!(
        delta(&before, &after, |s| s.bus_heartbeats_missed),
        0,
        "the exited process's silence was taken for a loss: {after:?}"
    );
    assert_eq!(delta(&before, &after, |s| s.bus_flushes), 0, "{after:?}");
}

/// A receiver judges a sender's silence by the sender's own heartbeat (each message carries
/// it): an idle sender with a longer heartbeat than the receiver's is no loss.
#[test]
fn a_sender_with_a_longer_heartbeat_is_no_loss() {
    let env = Env::new(Kind::Memcached, "bus_heartbeats");
    let hub = Arc::new(Hub::default());
    let b = near(&env)
        .near_bus(hub.port(1))
        .near_bus_heartbeat(MS(100))
        .build()
        .unwrap();
    let _a = elsewhere(&env)
        .near_bus(hub.port(2))
        .near_bus_heartbeat(S(1))
        .build()
        .unwrap();
    let before = b.stats();
    thread::sleep(S(3));
    let after = b.stats();
    assert_eq!(
        delta(&before, &after, |s| s.bus_flushes),
        0,
        "nothing was lost, yet b flushed: {after:?}"
    );
}

/// A cache built while its bus is down (the build does not fail) writes, and its
/// announcements are lost: when its bus is back, its first message heard, a sequence number
/// past its first, long after the receiver subscribed, is a gap.
#[test]
fn a_sender_that_started_with_its_bus_down_has_its_lost_writes_covered() {
    let env = Env::new(Kind::Memcached, "bus_start_down");
    let hub = Arc::new(Hub::default());
    let b = near(&env)
        .near_bus(hub.port(1))
        .near_bus_heartbeat(MS(100))
        .build()
        .unwrap();
    b.set("k", "v1", S(3600)).unwrap();
    near_hit(&b, "k", "v1");
    hub.mute(2, true); // a's bus is down when it starts
    let a = elsewhere(&env)
        .near_bus(hub.port(2))
        .near_bus_heartbeat(MS(100))
        .connect_timeout(MS(100))
        .io_timeout(MS(100))
        .build()
        .unwrap();
    a.set("k", "v2", S(3600)).unwrap(); // announced, lost
    thread::sleep(MS(100));
    hub.mute(2, false);
    assert!(
        seen_within(&b, "k", "v2", S(2)),
        "a starting sender's lost announcements are never covered (stats {:?})",
        b.stats()
    );
}

/// With the bus on the shared tier's own Redis, an outage of that Redis breaks the
/// subscription too: near hits stop, but copies within their staleness bound are still
/// served through the outage (`serve_stale_on_error`), as without a bus.
#[cfg(feature = "redis")]
#[test]
fn an_outage_of_the_redis_that_carries_the_bus_is_still_bridged() {
    let mut server = crate::fixture::RedisServer::start("redis-server");
    let clock = newcache::testing::MockClock::new();
    let cache = Cache::builder()
        .redis(server.url())
        .flavor(crate::fixture::unique_flavor("bus_outage"))
        .clock(clock.clone())
        .near_cache(1 << 20)
        .near_ttl(S(1))
        .herd_timeout(S(10))
        .serve_stale_on_error(S(3600))
        .near_bus(newcache::RedisBus::new(&server.url(), "bus").unwrap())
        .build()
        .unwrap();
    cache.set("k", "v", S(20)).unwrap();
    near_hit(&cache, "k", "v");
    server.kill();
    thread::sleep(MS(500));
    clock.advance(S(5)); // past the near ttl, within soft expiry + herd timeout
    let got = cache.get::<String>("k");
    assert_eq!(
        got.as_ref().ok().cloned().flatten().as_deref(),
        Some("v"),
        "the copy is not bridged through the outage: {got:?} {:?}",
        cache.stats()
    );
}

/// A second cache on one `RedisBus` (one subscriber for both) counts the subscriber's
/// reconnect as the first does.
#[cfg(feature = "redis")]
#[test]
fn a_second_cache_on_one_redis_bus_counts_its_reconnects() {
    let server = crate::fixture::RedisServer::start("redis-server");
    let env = Env::new(Kind::Memcached, "bus_shared_bus");
    let bus = newcache::RedisBus::new(&server.url(), "bus").unwrap();
    let first = near(&env).near_bus(bus.clone()).build().unwrap();
    let second = elsewhere(&env)
        .near_cache(1 << 20)
        .near_bus(bus)
        .build()
        .unwrap();
    let mut admin = redis::Client::open(server.url())
        .unwrap()
        .get_connection()
        .unwrap();
    let _: redis::Value = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("pubsub")
        .query(&mut admin)
        .unwrap();
    let deadline = Instant::now() + S(10);
    while first.stats().bus_reconnects == 0 {
        assert!(
            Instant::now() < deadline,
            "the first cache never reconnected"
        );
        thread::sleep(MS(10));
    }
    thread::sleep(MS(200));
    assert_eq!(
        second.stats().bus_reconnects,
        first.stats().bus_reconnects,
        "one subscriber, one reconnect: {:?}",
        second.stats()
    );
}

/// A paused bus (the Redis that carries it stopped): the cache stops serving near hits within
/// three heartbeats of its last message heard back (and a tick), though a publish to the
/// paused server blocks its bus thread for longer; and serves them again once it hears itself.
#[cfg(feature = "redis")]
#[test]
fn a_paused_redis_bus_stops_near_hits_within_three_heartbeats() {
    let server = crate::fixture::RedisServer::start("redis-server");
    let env = Env::new(Kind::Memcached, "bus_pause");
    let hb = MS(50);
    let b = near(&env)
        .near_bus(newcache::RedisBus::new(&server.url(), "bus").unwrap())
        .near_bus_heartbeat(hb)
        .build()
        .unwrap();
    b.set("k", "v1", S(3600)).unwrap();
    near_hit(&b, "k", "v1");
    server.signal("STOP");
    let paused = Instant::now();
    let deadline = paused + S(10);
    loop {
        let before = b.stats();
        b.get::<String>("k").unwrap();
        if delta(&before, &b.stats(), |s| s.near_hits) == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the pause was never noticed");
        thread::sleep(MS(1));
    }
    let took = paused.elapsed();
    server.signal("CONT");
    near_hit(&b, "k", "v1");
    // Three heartbeats since the last echo (at most one heartbeat before the pause), the
    // near clock's tick, and a loaded machine's margin.
    assert!(
        took <= hb * 4 + MS(250),
        "a pause was noticed after {took:?}, heartbeat {hb:?}"
    );
}
