//! What operators see: `ping()` (every server answers, or which does not), the metrics (feature
//! `metrics`) and the tracing spans, on both front ends and every backend.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use newcache::{Cache, PingError};

use crate::fixture::{Env, Hooked, Kind, shared_server};
use crate::front::{BuildFor, Front};
use crate::on_every_backend;

on_every_backend!(
    every_server_answers,
    traces_name_op_key_and_server_never_values,
    debug_logs_say_what_a_loader_did,
    debug_logs_say_when_a_claim_is_lost_and_a_failure_absorbed
);

// The wait counts are the same code on both front ends (the coalescer and the protocol's
// driver); the tests hold callers on threads, so they run on the sync one.
crate::on_backend!(
    waits_memory,
    Memory,
    Sync,
    followers_served_the_stale_value_at_once_did_not_wait,
    callers_that_waited_for_a_load_count_with_their_wait
);
crate::on_backend!(
    waits_memcached,
    Memcached,
    Sync,
    followers_served_the_stale_value_at_once_did_not_wait,
    callers_that_waited_for_a_load_count_with_their_wait
);
#[cfg(feature = "redis")]
crate::on_backend!(
    waits_redis,
    Redis,
    Sync,
    followers_served_the_stale_value_at_once_did_not_wait,
    callers_that_waited_for_a_load_count_with_their_wait
);
#[cfg(feature = "redis")]
crate::on_backend!(
    waits_valkey,
    Valkey,
    Sync,
    followers_served_the_stale_value_at_once_did_not_wait,
    callers_that_waited_for_a_load_count_with_their_wait
);

/// An address where nothing listens: connects are refused at once.
fn dead_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    drop(l);
    addr
}

/// A server that accepts connections (the kernel completes them into the backlog) and never
/// answers a byte: a hung memcached. Kept open while the returned listener lives.
fn hung_server() -> (std::net::TcpListener, String) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    (l, addr)
}

fn fronts() -> [Front; 2] {
    [Front::Sync, Front::Async]
}

fn every_server_answers(env: &Env) {
    let cache = env.cache();
    cache.ping().expect("every server answers");
    // A ping reads a key outside newcache's key space: it leaves nothing behind and counts
    // nothing (the bus of the near variants counts its own messages, a ping none).
    let mut stats = cache.stats();
    stats.bus_sent = 0;
    stats.bus_received = 0;
    assert_eq!(stats, newcache::Stats::default());
}

fn failure_names(e: &PingError) -> Vec<&str> {
    e.failures().iter().map(|f| f.server.as_str()).collect()
}

#[test]
fn a_dead_server_is_named_with_its_error() {
    let dead = dead_addr();
    for front in fronts() {
        let cache = Cache::builder()
            .memcached([dead.as_str()])
            .build_front(front);
        let e = cache.ping().expect_err("nothing listens there");
        assert_eq!(e.servers(), 1, "{front:?}");
        assert_eq!(failure_names(&e), [dead.as_str()], "{front:?}");
        let f = &e.failures()[0];
        assert!(f.error.is_backend(), "{front:?}: {}", f.error);
        assert_eq!(f.error.server(), Some(dead.as_str()), "{front:?}");
        let text = e.to_string();
        assert!(
            text.starts_with("1 of 1 servers did not answer: "),
            "{front:?}: {text}"
        );
        assert_eq!(text.matches(dead.as_str()).count(), 1, "named once: {text}");
        assert!(text.contains("refused"), "{front:?}: {text}");
    }
}

#[test]
fn a_hung_server_fails_within_the_io_timeout() {
    let (_hung, addr) = hung_server();
    for front in fronts() {
        let cache = Cache::builder()
            .memcached([addr.as_str()])
            .io_timeout(Duration::from_millis(300))
            .build_front(front);
        let started = Instant::now();
        let e = cache.ping().expect_err("a hung server does not answer");
        let took = started.elapsed();
        assert_eq!(failure_names(&e), [addr.as_str()], "{front:?}");
        assert!(
            e.failures()[0].error.is_timeout(),
            "{front:?}: {}",
            e.failures()[0].error
        );
        // Bounded by the io timeout (300 ms), not by anything longer; generous for a loaded
        // machine, far below the default io timeout of a cache left to hang.
        assert!(took >= Duration::from_millis(250), "{front:?}: {took:?}");
        assert!(took < Duration::from_secs(10), "{front:?}: {took:?}");
    }
}

#[test]
fn a_mixed_cluster_names_only_the_server_that_is_down() {
    let live = shared_server();
    let dead = dead_addr();
    let (_hung, hung) = hung_server();
    for front in fronts() {
        let cache = Cache::builder()
            .memcached([live, dead.as_str(), hung.as_str()])
            .io_timeout(Duration::from_millis(300))
            .build_front(front);
        let e = cache.ping().expect_err("two of three are down");
        assert_eq!(e.servers(), 3, "{front:?}");
        assert_eq!(
            failure_names(&e),
            [dead.as_str(), hung.as_str()],
            "{front:?}"
        );
        assert!(e.failures()[1].error.is_timeout(), "{front:?}");
        let text = e.to_string();
        assert!(text.starts_with("2 of 3 servers did not answer"), "{text}");
        assert!(
            !text.contains(live),
            "{front:?}: the live server is not named: {text}"
        );

        let ok = Cache::builder().memcached([live]).build_front(front);
        ok.ping().expect("the live server alone answers");
    }
}

#[test]
fn a_custom_backend_pings_with_a_get_by_default() {
    // Hooked forwards to its inner backend and does not override `ping`: the trait's default
    // (one `get`) runs.
    let memory = Arc::new(Hooked::new(Arc::new(newcache::MemoryBackend::new(
        1 << 20,
        Arc::new(newcache::SystemClock),
    ))));
    let cache = Cache::builder().backend(memory.clone()).build().unwrap();
    cache.ping().expect("the memory backend always answers");
    assert_eq!(memory.take(), 1, "one get");

    let dead = dead_addr();
    let inner = crate::fixture::memcached_backend(std::slice::from_ref(&dead), |_| {});
    let cache = Cache::builder()
        .backend(Arc::new(Hooked::new(Arc::new(inner))))
        .build()
        .unwrap();
    let e = cache.ping().expect_err("its one server is down");
    // The default names the failure by the error's server when the backend gives one.
    assert_eq!(failure_names(&e), [dead.as_str()]);
}

// ---- traces ----

/// Held while a test's scoped subscriber is alive. tracing caches each callsite's interest,
/// rebuilt whenever a subscriber is registered; two registrations racing on other threads can
/// leave a callsite cached with the view of a subscriber that ignores it (one filtering on
/// the `app` target), and the other test then misses its events. One at a time, they cannot.
fn scoped_subscribers() -> std::sync::MutexGuard<'static, ()> {
    static ONE: Mutex<()> = Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `f` under `subscriber` on this thread, one such test at a time ([`scoped_subscribers`]),
/// with tracing's interest cache kept honest ([`crate::test_support::scoped`]).
pub(crate) fn scoped<S, R>(subscriber: S, f: impl FnOnce() -> R) -> R
where
    S: tracing::Subscriber + Send + Sync + 'static,
{
    let _one_at_a_time = scoped_subscribers();
    crate::test_support::scoped(subscriber, f)
}

/// What a test subscriber writes, shared with the test.
#[derive(Clone, Default)]
struct Buf(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Buf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Buf {
    fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).expect("utf-8 logs")
    }
}

/// Every event a subscriber at `level` on this thread writes while `f` runs.
pub(crate) fn logs_at(level: tracing::Level, f: impl FnOnce()) -> String {
    let buf = Buf::default();
    let writer = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(move || writer.clone())
        .finish();
    scoped(subscriber, f);
    buf.text()
}

/// Everything a TRACE subscriber on this thread writes while `f` runs: every event, and every
/// span when it is created, entered, exited and closed, with all its fields.
fn traces_of(f: impl FnOnce()) -> String {
    let buf = Buf::default();
    let writer = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::FULL)
        .with_writer(move || writer.clone())
        .finish();
    scoped(subscriber, f);
    buf.text()
}

fn traces_name_op_key_and_server_never_values(env: &Env) {
    const SECRET: &str = "s3cr3t-v4lue-0f-the-user-7d1e";
    let cache = env.builder().name("traced").build_front(env.front);
    let logs = traces_of(|| {
        cache
            .set("user:1", SECRET, Duration::from_secs(60))
            .unwrap();
        assert_eq!(
            cache.get::<String>("user:1").unwrap().as_deref(),
            Some(SECRET)
        );
        let loaded: String = cache
            .get_or_set_with("user:2", Duration::from_secs(60), || {
                Ok::<_, std::io::Error>(SECRET.to_owned())
            })
            .unwrap();
        assert_eq!(loaded, SECRET);
        let unstored = cache
            .set_many(
                [("user:3", SECRET), ("user:4", SECRET)],
                Duration::from_secs(60),
            )
            .unwrap();
        assert!(unstored.is_empty());
        let many = cache
            .get_many::<String>(&["user:1", "user:3", "user:4"])
            .unwrap();
        assert_eq!(many.len(), 3);
    });
    // Each operation is a span with its name, the cache's name and the derived key; batches
    // carry their number of keys.
    let key = cache.make_key("user:1");
    for needle in [
        "newcache{op=\"set\" cache=\"traced\" key=\"".to_owned() + &key,
        "newcache{op=\"get\" cache=\"traced\" key=\"".to_owned() + &key,
        "newcache{op=\"get_or_set_with\" cache=\"traced\" key=\"".to_owned()
            + &cache.make_key("user:2"),
        "newcache{op=\"set_many\" cache=\"traced\" keys=2".to_owned(),
        "newcache{op=\"get_many\" cache=\"traced\" keys=3".to_owned(),
    ] {
        assert!(
            logs.contains(&needle),
            "{:?}: no {needle:?} in:\n{logs}",
            env.kind
        );
    }
    // memcached backends record the server they picked on the operation's span, once,
    // however many backend calls the operation made (a loader's: a read, a placeholder, a
    // store).
    if env.kind != Kind::Memory {
        let server = format!("server=\"{}\"", shared_addr(env.kind));
        assert!(
            logs.contains(&server),
            "{:?}: no {server} in:\n{logs}",
            env.kind
        );
        let loader_lines: Vec<&str> = logs
            .lines()
            .filter(|l| l.contains("op=\"get_or_set_with\""))
            .collect();
        assert!(
            loader_lines.iter().any(|l| l.contains("server=\"")),
            "{:?}: {logs}",
            env.kind
        );
        for line in loader_lines {
            assert!(
                line.matches("server=").count() <= 1,
                "{:?}: a field named twice: {line}",
                env.kind
            );
        }
    }
    // The value never appears: not as text, not as hex, not as a list of bytes.
    let hex: String = SECRET.bytes().map(|b| format!("{b:02x}")).collect();
    let list = format!("{:?}", SECRET.as_bytes());
    let list = &list[1..list.len() - 1];
    for (form, needle) in [("text", SECRET), ("hex", &hex[..]), ("bytes", list)] {
        assert!(
            !logs.contains(needle),
            "{:?}: the value appears as {form} in:\n{logs}",
            env.kind
        );
    }
}

fn shared_addr(kind: Kind) -> &'static str {
    match kind {
        Kind::Memcached => shared_server(),
        Kind::Twemproxy => crate::fixture::shared_twemproxy(),
        #[cfg(feature = "redis")]
        Kind::Redis => host_port(crate::fixture::shared_redis()),
        #[cfg(feature = "redis")]
        Kind::Valkey => host_port(crate::fixture::shared_valkey()),
        #[cfg(feature = "redis")]
        Kind::RedisCluster => host_port(&crate::fixture::shared_redis_cluster()[0]),
        Kind::Memory => unreachable!(),
    }
}

/// `host:port` of a `redis://host:port/db` URL.
#[cfg(feature = "redis")]
fn host_port(url: &'static str) -> &'static str {
    let rest = url.trim_start_matches("redis://");
    rest.split('/').next().unwrap_or(rest)
}

/// What a loader's work looks like under `newcache=debug` (no span events): a load started
/// and finished, the claim it took, a wait for another process's load; a hit logs nothing.
fn debug_logs_say_what_a_loader_did(env: &Env) {
    let cache = env
        .builder()
        .max_wait(Duration::from_millis(100))
        .build_front(env.front);
    cache.set("fresh", "v", Duration::from_secs(60)).unwrap();
    let hit = logs_at(tracing::Level::DEBUG, || {
        assert_eq!(cache.get::<String>("fresh").unwrap().as_deref(), Some("v"));
        let v: String = cache
            .get_or_set_with("fresh", Duration::from_secs(60), || {
                Ok::<_, std::io::Error>("unused".to_owned())
            })
            .unwrap();
        assert_eq!(v, "v");
    });
    assert_eq!(hit, "", "{:?}: a hit logs nothing at DEBUG", env.kind);

    // Another process is loading "busy" (its placeholder, alive for a minute).
    let now = newcache::Clock::now_ms(&*env.clock);
    let busy = newcache::__private::placeholder(now, now + 60_000, 7);
    env.raw_set_ttl(
        &cache.make_key("busy"),
        &busy,
        newcache::__private::FLAGS,
        60,
    );
    let logs = logs_at(tracing::Level::DEBUG, || {
        let v: u32 = cache
            .get_or_set_with("cold", Duration::from_secs(60), || {
                Ok::<_, std::io::Error>(1)
            })
            .unwrap();
        assert_eq!(v, 1);
        let e = cache
            .get_or_set_with("busy", Duration::from_secs(60), || {
                Ok::<_, std::io::Error>(1)
            })
            .map_err(newcache::Error::from)
            .unwrap_err();
        assert!(e.is_wait_timeout(), "{e}");
    });
    for needle in [
        "newcache: claim taken",
        "newcache: load started",
        "newcache: load finished",
        "newcache: another caller is loading the key; waiting",
        "newcache: waited for another caller's load",
    ] {
        assert!(
            logs.contains(needle),
            "{:?} {:?}: no {needle:?} in:\n{logs}",
            env.kind,
            env.front
        );
    }
}

/// A claim another caller's write beat, and a backend failure the read policy absorbed, are
/// logged at DEBUG.
fn debug_logs_say_when_a_claim_is_lost_and_a_failure_absorbed(env: &Env) {
    let key = env.sync_cache().make_key("raced");
    let inner = env.backend();
    let mut hooked = Hooked::new(inner.clone());
    // Between this caller's read (the key missing) and its placeholder, another process
    // writes its own placeholder: this caller's `add` loses.
    let now = newcache::Clock::now_ms(&*env.clock);
    let theirs = newcache::__private::placeholder(now, now + 60_000, 7);
    let race = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let armed = race.clone();
    hooked.after_get = Box::new(move || {
        if armed.swap(false, std::sync::atomic::Ordering::SeqCst) {
            inner
                .store(newcache::Write::new(
                    newcache::StoreMode::Set,
                    &key,
                    &theirs,
                    newcache::__private::FLAGS,
                    60,
                ))
                .unwrap();
        }
    });
    let hooked = Arc::new(hooked);
    let cache = env
        .builder()
        .backend(hooked.clone())
        .max_wait(Duration::from_millis(100))
        .build_front(env.front);
    let logs = logs_at(tracing::Level::DEBUG, || {
        let e = cache
            .get_or_set_with("raced", Duration::from_secs(60), || {
                Ok::<_, std::io::Error>(1)
            })
            .map_err(newcache::Error::from)
            .unwrap_err();
        assert!(e.is_wait_timeout(), "{e}");
        hooked
            .gets_fail
            .store(true, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(cache.get::<String>("down").unwrap(), None);
    });
    assert!(
        !race.load(std::sync::atomic::Ordering::SeqCst),
        "the race ran"
    );
    for needle in ["newcache: claim lost", "newcache: backend failure absorbed"] {
        assert!(
            logs.contains(needle),
            "{:?} {:?}: no {needle:?} in:\n{logs}",
            env.kind,
            env.front
        );
    }
}

/// A door a backend hook stops at, once it is armed, until the test opens it.
#[derive(Default)]
struct Door {
    armed: std::sync::atomic::AtomicBool,
    open: Mutex<bool>,
    opened: std::sync::Condvar,
}

impl Door {
    fn pass(&self) {
        if self.armed.swap(false, std::sync::atomic::Ordering::SeqCst) {
            let mut open = self.open.lock().unwrap();
            while !*open {
                open = self.opened.wait(open).unwrap();
            }
        }
    }

    /// Whether a caller reached the armed door (it waits there until [`Door::open`]).
    fn reached(&self) -> bool {
        !self.armed.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }
}

/// Polls `done` until it holds (a generous bound: a loaded machine's threads start late).
#[track_caller]
fn until(what: &str, done: impl Fn() -> bool) {
    let t = Instant::now();
    while !done() {
        assert!(t.elapsed() < Duration::from_secs(30), "never: {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A hot key's expiry: callers that join the leader while it claims the stale entry are
/// answered at once with the stale value. They count in `lease_waits` (joined another's
/// load), not in `waited` (nobody waited for a load).
fn followers_served_the_stale_value_at_once_did_not_wait(env: &Env) {
    const FOLLOWERS: u64 = 4;
    let door = Arc::new(Door::default());
    let mut hooked = Hooked::new(env.backend());
    let at_claim = door.clone();
    hooked.before_claim = Box::new(move || at_claim.pass());
    let cache = env.builder().backend(Arc::new(hooked)).build().unwrap();
    cache.set("hot", "old", Duration::from_secs(10)).unwrap();
    env.advance(Duration::from_secs(11));
    door.armed.store(true, std::sync::atomic::Ordering::SeqCst);
    let load = || {
        cache
            .get_or_set_with("hot", Duration::from_secs(60), || {
                Ok::<_, std::io::Error>("new".to_owned())
            })
            .unwrap()
    };
    std::thread::scope(|s| {
        let leader = s.spawn(load);
        until("the leader is at its claim", || door.reached());
        let followers: Vec<_> = (0..FOLLOWERS).map(|_| s.spawn(load)).collect();
        until("every follower joined the leader", || {
            cache.stats().lease_waits == FOLLOWERS
        });
        door.open();
        assert_eq!(leader.join().unwrap(), "new", "the leader loads");
        for f in followers {
            assert_eq!(
                f.join().unwrap(),
                "old",
                "followers are served the stale value"
            );
        }
    });
    let st = cache.stats();
    assert_eq!(
        (st.lease_waits, st.waited, st.wait_micros),
        (FOLLOWERS, 0, 0),
        "{:?}: {st:?}",
        env.kind
    );
}

/// Callers answered only when another caller's load ended are counted in `waited`, with
/// their time in `wait_micros`: followers of a load of this process, and a caller polling
/// for another process's placeholder.
fn callers_that_waited_for_a_load_count_with_their_wait(env: &Env) {
    const FOLLOWERS: u64 = 3;
    // The loads are held at least this long after every caller started waiting.
    const PAUSE: Duration = Duration::from_millis(50);
    let cache = env.builder().build().unwrap();
    let (release, released) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|s| {
        let leader = s.spawn(|| {
            cache
                .get_or_set_with("cold", Duration::from_secs(60), move || {
                    released.recv().unwrap();
                    Ok::<_, std::io::Error>("loaded".to_owned())
                })
                .unwrap()
        });
        until("the leader loads", || cache.stats().loader_calls == 1);
        let followers: Vec<_> = (0..FOLLOWERS)
            .map(|_| {
                s.spawn(|| {
                    cache
                        .get_or_set_with("cold", Duration::from_secs(60), || {
                            Ok::<_, std::io::Error>("unused".to_owned())
                        })
                        .unwrap()
                })
            })
            .collect();
        until("every follower waits", || {
            cache.stats().lease_waits == FOLLOWERS
        });
        std::thread::sleep(PAUSE);
        release.send(()).unwrap();
        assert_eq!(leader.join().unwrap(), "loaded");
        for f in followers {
            assert_eq!(f.join().unwrap(), "loaded");
        }
    });
    let st = cache.stats();
    assert_eq!(
        (st.lease_waits, st.waited),
        (FOLLOWERS, FOLLOWERS),
        "{st:?}"
    );
    assert!(
        st.wait_micros >= FOLLOWERS * PAUSE.as_micros() as u64,
        "{:?}: {st:?}",
        env.kind
    );

    // Another process is loading "busy": this caller polls until that process stores.
    let now = newcache::Clock::now_ms(&*env.clock);
    let busy = newcache::__private::placeholder(now, now + 60_000, 7);
    env.raw_set_ttl(
        &cache.make_key("busy"),
        &busy,
        newcache::__private::FLAGS,
        60,
    );
    let before = cache.stats();
    std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            cache
                .get_or_set_with("busy", Duration::from_secs(60), || {
                    Ok::<_, std::io::Error>("mine".to_owned())
                })
                .unwrap()
        });
        until("the caller waits", || {
            cache.stats().lease_waits > before.lease_waits
        });
        std::thread::sleep(PAUSE);
        env.sync_cache()
            .set("busy", "theirs", Duration::from_secs(60))
            .unwrap();
        assert_eq!(waiter.join().unwrap(), "theirs");
    });
    let after = cache.stats();
    assert_eq!(after.waited - before.waited, 1, "{after:?}");
    assert!(
        after.wait_micros - before.wait_micros >= PAUSE.as_micros() as u64,
        "{:?}: {after:?}",
        env.kind
    );
}

/// Under `newcache=debug`, a server marked dead and back is logged (memcached, Redis 7,
/// Valkey 9).
#[test]
fn debug_logs_say_when_a_server_is_marked_dead_and_back() {
    let check = |b: newcache::CacheBuilder, switch: &mut dyn FnMut(bool)| {
        let cache = b
            .retry_interval(Duration::from_millis(200))
            .connect_timeout(Duration::from_millis(100))
            .build()
            .unwrap();
        let logs = logs_at(tracing::Level::DEBUG, || {
            cache.set("k", "v", newcache::Ttl::Never).unwrap();
            switch(false);
            for _ in 0..5 {
                assert_eq!(cache.get::<String>("k").unwrap(), None);
            }
            switch(true);
            until("the server serves again", || {
                cache.set("k", "v", newcache::Ttl::Never).is_ok()
            });
        });
        for needle in [
            "marked dead",
            "is back",
            "newcache: backend failure absorbed",
        ] {
            assert!(logs.contains(needle), "no {needle:?} in:\n{logs}");
        }
    };
    let mut server = crate::fixture::Memcached::start();
    check(Cache::builder().memcached([server.addr()]), &mut |up| {
        if up { server.restart() } else { server.kill() }
    });
    #[cfg(feature = "redis")]
    for bin in ["redis-server".to_owned(), crate::fixture::valkey_server()] {
        let mut server =
            crate::fixture::RedisServer::start_with(&bin, &["--maxmemory-policy", "allkeys-lru"]);
        check(Cache::builder().redis(server.url()), &mut |up| {
            if up { server.restart() } else { server.kill() }
        });
    }
}

/// Whether the span current inside a loader is enabled, and its name, under a subscriber that
/// listens at `level`.
fn loader_span_under(level: tracing::Level) -> (bool, Option<String>) {
    let cache = Cache::builder().in_memory().build().unwrap();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::sink)
        .finish();
    scoped(subscriber, || {
        cache
            .get_or_set_with("k", Duration::from_secs(60), || {
                let span = tracing::Span::current();
                Ok::<_, std::io::Error>((
                    !span.is_disabled(),
                    span.metadata().map(|m| m.name().to_owned()),
                ))
            })
            .unwrap()
    })
}

#[test]
fn operation_spans_exist_only_for_a_subscriber_at_debug() {
    // The loader runs inside its operation's span when someone listens at DEBUG...
    assert_eq!(
        loader_span_under(tracing::Level::DEBUG),
        (true, Some("newcache".to_owned()))
    );
    // ...and under INFO the span is disabled: never built, so no field of it is formatted.
    assert_eq!(loader_span_under(tracing::Level::INFO), (false, None));
}

// ---- metrics ----

/// A panicking loader is counted as a load and as a load error (the panic propagates).
#[test]
fn a_panicking_loader_counts_as_a_load_error() {
    let cache = Cache::builder().in_memory().build().unwrap();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        cache.get_or_set_with(
            "k",
            Duration::from_secs(60),
            || -> Result<u32, std::io::Error> { panic!("db driver bug") },
        )
    }));
    assert!(r.is_err(), "the panic propagates");
    let s = cache.stats();
    assert_eq!((s.loader_calls, s.loader_errors), (1, 1));
}

/// `Stats` serializes (serde) as an object of its counters by field name, for a `/stats`
/// route: `serde_json::to_value(cache.stats())`.
#[test]
fn stats_serialize_by_field_name() {
    let cache = Cache::builder().in_memory().build().unwrap();
    let v: u32 = cache
        .get_or_set_with("k", Duration::from_secs(60), || Ok::<_, std::io::Error>(1))
        .unwrap();
    assert_eq!(v, 1);
    let json = serde_json::to_value(cache.stats()).unwrap();
    assert_eq!(json["loader_calls"], 1, "{json}");
    assert_eq!(json["misses"], 1, "{json}");
    assert_eq!(json["hits"], 0, "{json}");
    let fields = json.as_object().unwrap();
    assert!(fields.values().all(serde_json::Value::is_u64), "{json}");
}

/// A ping's `Display` names each failing server once, with its causes (the pool's connect
/// failure is not annotated twice).
#[test]
fn a_ping_failure_names_its_server_once() {
    let dead = dead_addr();
    for front in fronts() {
        let cache = Cache::builder()
            .memcached([dead.as_str()])
            .build_front(front);
        let text = cache.ping().unwrap_err().to_string();
        let times = text.matches(&format!("memcached at {dead}")).count();
        assert!(times <= 1, "{front:?}: {text}");
    }
}

/// A ping queues every server's get before awaiting any answer: two hung servers whose one
/// connection's queue is full (20,000 gets in flight) and a live one; the ping ends within
/// about one io_timeout, not one per hung server.
#[test]
fn an_async_ping_behind_a_full_queue_stays_within_its_bound() {
    let (_hung, hung_addr) = hung_server();
    let (_hung2, hung2_addr) = hung_server();
    let live = shared_server();
    // Long enough that a loaded machine's delays stay well below a second io_timeout.
    let io = Duration::from_millis(1000);
    let cache = Cache::builder()
        .memcached([hung_addr.as_str(), hung2_addr.as_str(), live])
        .io_timeout(io)
        .async_connections(1)
        .build_async()
        .unwrap();
    let rt = crate::front::runtime();
    rt.block_on(async {
        // Fill the hung servers' one connection queue each.
        let mut tasks = Vec::new();
        for i in 0..20000 {
            let c = cache.clone();
            tasks.push(tokio::spawn(async move {
                let _ = c.get::<String>(&format!("k{i}")).await;
            }));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let started = Instant::now();
        let r = cache.ping().await;
        let took = started.elapsed();
        assert_eq!(r.unwrap_err().failures().len(), 2);
        for t in tasks {
            let _ = t.await;
        }
        // one io_timeout, not one per hung server (2 s)
        assert!(
            took < io + io * 7 / 10,
            "ping took {took:?} (io_timeout {io:?})"
        );
    });
}

/// A readiness probe right after a memcached restart: the pool's idle connection is to the old
/// process (stale, closed by the peer). The ping retries that server once on a fresh
/// connection instead of reporting a live server down.
#[test]
fn a_ping_after_a_restart_does_not_report_a_live_server_down() {
    let mut server = crate::fixture::Memcached::start();
    let addr = server.addr();
    for front in [Front::Async, Front::Sync] {
        let cache = Cache::builder()
            .memcached([addr.as_str()])
            .build_front(front);
        cache.ping().expect("up");
        server.restart();
        // The restarted server answers a fresh client at once.
        let fresh = Cache::builder()
            .memcached([addr.as_str()])
            .build_front(front);
        fresh.ping().expect("the restarted server answers");
        let r = cache.ping();
        assert!(
            r.is_ok(),
            "{front:?}: a live server reported down: {}",
            r.unwrap_err()
        );
    }
}

/// Hung servers (they accept, never answer) share one io_timeout: three of them fail a ping
/// within about one io_timeout, on both front ends.
#[test]
fn hung_servers_share_one_io_timeout() {
    let hung: Vec<(std::net::TcpListener, String)> = (0..3).map(|_| hung_server()).collect();
    let io = Duration::from_millis(300);
    for front in fronts() {
        let cache = Cache::builder()
            .memcached(hung.iter().map(|(_, a)| a.as_str()))
            .io_timeout(io)
            .build_front(front);
        let started = Instant::now();
        let e = cache.ping().unwrap_err();
        let took = started.elapsed();
        assert_eq!(e.failures().len(), 3, "{front:?}");
        assert!(took < io * 2, "{front:?}: {took:?} for 3 hung servers");
    }
}

/// A single-key call refused because its server's pool stayed busy names that server (for
/// `Error::server` and the metrics' `server` label), as a batch's does.
#[test]
fn a_busy_pool_names_its_server() {
    use newcache::Backend;
    let (_hung, addr) = hung_server();
    let backend = crate::fixture::memcached_backend(std::slice::from_ref(&addr), |c| {
        c.pool_size = 1;
        c.connect_timeout = Duration::from_millis(100);
        c.io_timeout = Duration::from_millis(800);
    });
    std::thread::scope(|s| {
        s.spawn(|| {
            let _ = backend.get("holder"); // holds the one connection for io_timeout
        });
        std::thread::sleep(Duration::from_millis(100));
        let e = backend.get("waiter").unwrap_err();
        assert!(e.is_timeout(), "{e}");
        assert_eq!(e.server(), Some(addr.as_str()), "{e}");
        assert_eq!(
            e.to_string()
                .matches(&format!("memcached at {addr}"))
                .count(),
            1,
            "{e}"
        );
    });
}

#[cfg(feature = "metrics")]
mod metrics_tests {
    use super::*;
    use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

    /// Every metric recorded so far, as (name, labels, value). (A snapshot drains the
    /// recorder: take one per check.)
    struct Metrics(Vec<Metric>);

    /// A metric's name, labels and value.
    type Metric = (String, Vec<(String, String)>, DebugValue);

    fn metrics(snap: &Snapshotter) -> Metrics {
        Metrics(
            snap.snapshot()
                .into_vec()
                .into_iter()
                .map(|(key, _, _, v)| {
                    let key = key.key();
                    let labels = key
                        .labels()
                        .map(|l| (l.key().to_owned(), l.value().to_owned()))
                        .collect();
                    (key.name().to_owned(), labels, v)
                })
                .collect(),
        )
    }

    impl Metrics {
        /// The value of the metric `name` whose labels include every one of `labels`.
        fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<&DebugValue> {
            self.0
                .iter()
                .find(|(n, ls, _)| {
                    n == name
                        && labels
                            .iter()
                            .all(|(k, v)| ls.iter().any(|(lk, lv)| lk == k && lv == v))
                })
                .map(|(.., v)| v)
        }

        /// The sum of the counters `name` whose labels include every one of `labels` (say, a
        /// cache's backend errors over all its servers).
        #[track_caller]
        fn sum(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
            self.0
                .iter()
                .filter(|(n, ls, _)| {
                    n == name
                        && labels
                            .iter()
                            .all(|(k, v)| ls.iter().any(|(lk, lv)| lk == k && lv == v))
                })
                .map(|(.., v)| match v {
                    DebugValue::Counter(n) => *n,
                    other => panic!("{name} is not a counter: {other:?}"),
                })
                .sum()
        }

        #[track_caller]
        fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
            match self.value(name, labels) {
                Some(DebugValue::Counter(n)) => *n,
                None => 0,
                other => panic!("{name} is not a counter: {other:?}"),
            }
        }
    }

    /// A response cache's reads and fills are its own series, labelled `layer` (its namespace)
    /// beside `cache`: the cache's own series count the application's calls only, as
    /// `stats()` does.
    #[cfg(feature = "tower")]
    #[test]
    fn a_response_caches_counts_carry_its_layer_label() {
        use tower::{Layer, ServiceExt};
        let recorder = DebuggingRecorder::new();
        let snap = recorder.snapshotter();
        let (cache, pages) = metrics::with_local_recorder(&recorder, || {
            let cache = Cache::builder()
                .in_memory()
                .name("site")
                .build_async()
                .unwrap();
            let pages = newcache::layer::ResponseCacheLayer::builder(cache.clone())
                .namespace("pages")
                .build()
                .unwrap();
            (cache, pages)
        });
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let svc = pages.layer(tower::service_fn(|_req: http::Request<()>| async {
                let body = http_body_util::Full::new(bytes::Bytes::from("page"));
                Ok::<_, std::convert::Infallible>(http::Response::new(body))
            }));
            let req = http::Request::get("/a").body(()).unwrap();
            let resp = svc.oneshot(req).await.unwrap();
            assert_eq!(resp.headers()["x-cache"], "MISS");
            assert_eq!(cache.get::<u32>("k").await.unwrap(), None);
        });
        let m = metrics(&snap);
        // Exactly these labels (`Metrics::counter` matches a superset).
        let exact = |name: &str, labels: &[(&str, &str)]| -> u64 {
            m.0.iter()
                .filter(|(n, ls, _)| {
                    n == name
                        && ls.len() == labels.len()
                        && labels
                            .iter()
                            .all(|(k, v)| ls.iter().any(|(lk, lv)| lk == k && lv == v))
                })
                .map(|(.., v)| match v {
                    DebugValue::Counter(n) => *n,
                    other => panic!("{name} is not a counter: {other:?}"),
                })
                .sum()
        };
        let own = [("cache", "site")];
        let layer = [("cache", "site"), ("layer", "pages")];
        assert_eq!(exact("newcache_loads_total", &own), 0);
        assert_eq!(exact("newcache_misses_total", &own), 1);
        assert_eq!(exact("newcache_loads_total", &layer), 1);
        assert_eq!(exact("newcache_misses_total", &layer), 1);
        assert_eq!((cache.stats().misses, pages.stats().misses), (1, 1));
    }

    /// A hit, a miss, a load, a failing load, a stale entry (claimed once, served stale once)
    /// and a wait for another process's load, with the counts a user expects, on one front
    /// end and backend.
    fn scenario(env: &Env) {
        let recorder = DebuggingRecorder::new();
        let snap = recorder.snapshotter();
        let name = format!("users-{:?}-{:?}", env.kind, env.front);
        let cache: crate::front::TestCache = metrics::with_local_recorder(&recorder, || {
            env.builder()
                .name(name.clone())
                .max_wait(Duration::from_millis(200))
                .build_front(env.front)
        });
        assert_eq!(cache.get::<String>("absent").unwrap(), None); // a miss
        cache.set("present", "v", Duration::from_secs(60)).unwrap();
        assert!(cache.get::<String>("present").unwrap().is_some()); // a hit
        let v: u32 = cache
            .get_or_set_with("computed", Duration::from_secs(60), || {
                Ok::<_, std::io::Error>(7)
            })
            .unwrap(); // a miss, then a load
        assert_eq!(v, 7);
        let e = cache
            .get_or_set_with("failing", Duration::from_secs(60), || {
                Err::<u32, _>(std::io::Error::other("db down"))
            })
            .unwrap_err(); // a miss, then a failing load
        assert!(e.loader().is_some());
        cache.set("aging", "old", Duration::from_secs(1)).unwrap();
        env.advance(Duration::from_secs(2));
        // The first reader of a stale entry claims it (a miss: it recomputes); the next is
        // served the stale value meanwhile.
        assert_eq!(cache.get::<String>("aging").unwrap(), None);
        assert_eq!(
            cache.get::<String>("aging").unwrap().as_deref(),
            Some("old")
        );

        // Another process is loading "busy" (its placeholder, alive for a minute): this caller
        // waits for it (a lease wait) until max_wait runs out.
        let now = newcache::Clock::now_ms(&*env.clock);
        let busy = newcache::__private::placeholder(now, now + 60_000, 7);
        env.raw_set_ttl(
            &cache.make_key("busy"),
            &busy,
            newcache::__private::FLAGS,
            60,
        );
        let e = cache
            .get_or_set_with("busy", Duration::from_secs(60), || {
                Ok::<_, std::io::Error>(1)
            })
            .map_err(newcache::Error::from)
            .unwrap_err();
        assert!(e.is_wait_timeout(), "{e}");

        let m = metrics(&snap);
        let c = |metric: &str| m.counter(metric, &[("cache", name.as_str())]);
        let kind = (env.kind, env.front);
        assert_eq!(c("newcache_hits_total"), 1, "{kind:?}");
        assert_eq!(c("newcache_misses_total"), 4, "{kind:?}");
        assert_eq!(c("newcache_stale_served_total"), 1, "{kind:?}");
        assert_eq!(c("newcache_claims_total"), 1, "{kind:?}");
        assert_eq!(c("newcache_loads_total"), 2, "{kind:?}");
        assert_eq!(c("newcache_load_errors_total"), 1, "{kind:?}");
        assert_eq!(c("newcache_lease_waits_total"), 1, "{kind:?}");
        assert_eq!(c("newcache_waited_total"), 1, "{kind:?}");
        assert_eq!(c("newcache_wait_timeouts_total"), 1, "{kind:?}");
        assert_eq!(c("newcache_backend_errors_total"), 0, "{kind:?}");
        // The same counts as stats(): one place counts both.
        let s = cache.stats();
        assert_eq!(
            (
                s.hits,
                s.misses,
                s.stale_served,
                s.claims_won,
                s.loader_calls,
                s.loader_errors
            ),
            (1, 4, 1, 1, 2, 1),
            "{kind:?}"
        );
        match m.value("newcache_load_duration_seconds", &[("cache", &name)]) {
            Some(DebugValue::Histogram(samples)) => {
                assert_eq!(samples.len(), 2, "{kind:?}: one sample per load");
                assert!(
                    samples.iter().all(|s| s.0 >= 0.0 && s.0 < 60.0),
                    "{samples:?}"
                );
            }
            other => panic!("{kind:?}: no load histogram: {other:?}"),
        }
        match m.value("newcache_wait_seconds", &[("cache", &name)]) {
            Some(DebugValue::Histogram(samples)) => {
                assert_eq!(samples.len(), 1, "{kind:?}: one sample per wait");
                assert!(samples[0].0 > 0.0, "{samples:?}");
            }
            other => panic!("{kind:?}: no wait histogram: {other:?}"),
        }
    }

    on_every_backend!(scenario);

    #[test]
    fn a_dead_server_counts_backend_errors_under_its_address() {
        let dead = dead_addr();
        for front in fronts() {
            let recorder = DebuggingRecorder::new();
            let snap = recorder.snapshotter();
            metrics::with_local_recorder(&recorder, || {
                let cache = Cache::builder()
                    .memcached([dead.as_str()])
                    .name("sessions")
                    .build_front(front);
                // The default read policy absorbs the failure: a miss, and one backend error.
                assert_eq!(cache.get::<String>("k").unwrap(), None);
                assert_eq!(cache.get::<String>("k").unwrap(), None);
                assert_eq!(cache.stats().backend_errors, 2);
            });
            let labels = [("cache", "sessions"), ("server", dead.as_str())];
            let m = metrics(&snap);
            assert_eq!(
                m.counter("newcache_backend_errors_total", &labels),
                2,
                "{front:?}"
            );
            assert_eq!(
                m.counter("newcache_misses_total", &[("cache", "sessions")]),
                2,
                "{front:?}"
            );
        }
    }

    /// A batch whose keys fail on two servers counts once in `stats()` (documented), and once
    /// under each failed server in the labelled metric.
    #[test]
    fn a_batch_over_two_dead_servers_counts_each_server() {
        let (a, b) = (dead_addr(), dead_addr());
        for front in fronts() {
            let recorder = DebuggingRecorder::new();
            let snap = recorder.snapshotter();
            metrics::with_local_recorder(&recorder, || {
                let cache = Cache::builder()
                    .memcached([a.as_str(), b.as_str()])
                    .name("batch")
                    .build_front(front);
                let keys: Vec<String> = (0..64).map(|i| format!("k{i}")).collect();
                for _ in 0..3 {
                    assert!(cache.get_many::<String>(&keys).unwrap().is_empty());
                }
                assert_eq!(cache.stats().backend_errors, 3, "{front:?}: once per batch");
            });
            let m = metrics(&snap);
            let on = |server: &str| {
                m.counter(
                    "newcache_backend_errors_total",
                    &[("cache", "batch"), ("server", server)],
                )
            };
            assert_eq!(
                (on(&a), on(&b)),
                (3, 3),
                "{front:?}: once per server per batch"
            );
            assert_eq!(on("unknown"), 0, "{front:?}");
        }
    }

    /// Like every other counter, `newcache_backend_errors_total` goes to the recorder the cache
    /// was built with, whatever recorder is current when the error happens.
    #[test]
    fn backend_errors_go_to_the_recorder_the_cache_was_built_with() {
        let dead = dead_addr();
        let recorder = DebuggingRecorder::new();
        let snap = recorder.snapshotter();
        let cache = metrics::with_local_recorder(&recorder, || {
            Cache::builder()
                .memcached([dead.as_str()])
                .name("order")
                .build()
                .unwrap()
        });
        assert_eq!(cache.get::<String>("k").unwrap(), None);
        assert_eq!(cache.stats().backend_errors, 1);
        let labels = [("cache", "order")];
        let m = metrics(&snap);
        assert_eq!(m.counter("newcache_misses_total", &labels), 1);
        assert_eq!(m.sum("newcache_backend_errors_total", &labels), 1);
        assert_eq!(
            m.counter(
                "newcache_backend_errors_total",
                &[("cache", "order"), ("server", dead.as_str())]
            ),
            1
        );
    }

    /// A panicking loader is a failed load, and every load leaves one duration sample however
    /// it ends: returned, failed, panicked, or (async) dropped mid-load.
    #[test]
    fn every_load_records_a_duration_even_a_panicking_or_cancelled_one() {
        let recorder = DebuggingRecorder::new();
        let snap = recorder.snapshotter();
        let (sync, async_cache) = metrics::with_local_recorder(&recorder, || {
            let sync = Cache::builder().in_memory().name("sync").build().unwrap();
            let async_cache = Cache::builder()
                .in_memory()
                .name("async")
                .build_async()
                .unwrap();
            (sync, async_cache)
        });
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            sync.get_or_set_with(
                "k",
                Duration::from_secs(60),
                || -> Result<u32, std::io::Error> { panic!("db driver bug") },
            )
        }));
        assert!(r.is_err(), "the panic propagates");
        let rt = crate::front::runtime();
        rt.block_on(async {
            // A panicking async loader (its task fails), then one cancelled mid-load.
            let c = async_cache.clone();
            let panicked = tokio::spawn(async move {
                c.get_or_set_with("p", Duration::from_secs(60), || async {
                    if true {
                        panic!("db driver bug");
                    }
                    Ok::<u32, std::io::Error>(1)
                })
                .await
            })
            .await;
            assert!(panicked.unwrap_err().is_panic());
            let cancelled = tokio::time::timeout(
                Duration::from_millis(20),
                async_cache.get_or_set_with("c", Duration::from_secs(60), || async {
                    tokio::time::sleep(Duration::from_secs(60)).await;
                    Ok::<u32, std::io::Error>(1)
                }),
            )
            .await;
            assert!(cancelled.is_err(), "timed out");
        });
        let s = sync.stats();
        assert_eq!((s.loader_calls, s.loader_errors), (1, 1), "sync");
        let s = async_cache.stats();
        assert_eq!(
            (s.loader_calls, s.loader_errors),
            (2, 1),
            "async: the panic is an error, the cancellation is not"
        );
        let m = metrics(&snap);
        for (name, loads) in [("sync", 1), ("async", 2)] {
            let labels = [("cache", name)];
            assert_eq!(m.counter("newcache_loads_total", &labels), loads, "{name}");
            assert_eq!(
                m.counter("newcache_load_errors_total", &labels),
                1,
                "{name}"
            );
            match m.value("newcache_load_duration_seconds", &labels) {
                Some(DebugValue::Histogram(samples)) => {
                    assert_eq!(samples.len(), loads as usize, "{name}: one sample per load")
                }
                other => panic!("{name}: no load histogram: {other:?}"),
            }
        }
    }

    #[test]
    fn an_unnamed_cache_is_labelled_default() {
        let recorder = DebuggingRecorder::new();
        let snap = recorder.snapshotter();
        let cache = metrics::with_local_recorder(&recorder, || {
            Cache::builder().in_memory().build().unwrap()
        });
        cache.get::<String>("k").unwrap();
        assert_eq!(
            metrics(&snap).counter(
                "newcache_misses_total",
                &[("cache", newcache::DEFAULT_NAME)]
            ),
            1
        );
        assert_eq!(newcache::DEFAULT_NAME, "default");
    }
}

#[test]
fn an_empty_name_is_refused() {
    let e = Cache::builder().name("").build().unwrap_err();
    assert!(e.is_config(), "{e}");
    assert!(e.to_string().contains("name"), "{e}");
}

#[test]
fn the_server_is_recorded_only_on_newcache_spans() {
    use tracing_subscriber::layer::SubscriberExt;
    // The application listens at DEBUG to its own target only: newcache's spans are disabled,
    // and the current span is the application's, which has a `server` field of its own.
    let buf = Buf::default();
    let writer = buf.clone();
    let layer = tracing_subscriber::fmt::layer()
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .with_writer(move || writer.clone());
    let only_app =
        tracing_subscriber::filter::Targets::new().with_target("app", tracing::Level::DEBUG);
    let subscriber = tracing_subscriber::registry()
        .with(tracing_subscriber::Layer::with_filter(layer, only_app));
    let cache = Cache::builder()
        .memcached([shared_server()])
        .build()
        .unwrap();
    scoped(subscriber, || {
        let request = tracing::debug_span!(target: "app", "request", server = "web-1");
        let _in = request.enter();
        cache.get::<String>("k").unwrap();
    });
    let logs = buf.text();
    assert!(logs.contains("server=\"web-1\""), "{logs}");
    assert!(!logs.contains(shared_server()), "{logs}");
}

/// A custom backend names its server with the public `backend::note_server`: recorded on
/// newcache's span when it is enabled, and never on the application's span when it is not.
#[test]
fn a_custom_backend_names_its_server_safely() {
    use tracing_subscriber::layer::SubscriberExt;
    let memory = Arc::new(newcache::MemoryBackend::new(
        1 << 20,
        Arc::new(newcache::SystemClock),
    ));
    let mut hooked = Hooked::new(memory);
    hooked.after_get = Box::new(|| newcache::backend::note_server("shard-7:11211"));
    let cache = Cache::builder().backend(Arc::new(hooked)).build().unwrap();

    let logs = traces_of(|| {
        cache.get::<String>("k").unwrap();
    });
    assert!(logs.contains("server=\"shard-7:11211\""), "{logs}");

    let buf = Buf::default();
    let writer = buf.clone();
    let layer = tracing_subscriber::fmt::layer()
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .with_writer(move || writer.clone());
    let only_app =
        tracing_subscriber::filter::Targets::new().with_target("app", tracing::Level::DEBUG);
    let subscriber = tracing_subscriber::registry()
        .with(tracing_subscriber::Layer::with_filter(layer, only_app));
    scoped(subscriber, || {
        let request = tracing::debug_span!(target: "app", "request", server = "web-1");
        let _in = request.enter();
        cache.get::<String>("k").unwrap();
    });
    let logs = buf.text();
    assert!(logs.contains("server=\"web-1\""), "{logs}");
    assert!(!logs.contains("shard-7"), "{logs}");
}

/// A callsite another thread hits first while a test's scoped subscriber is the only one
/// registered is still heard on this thread (`scoped` keeps a second dispatcher alive).
#[test]
fn a_callsite_first_hit_by_another_thread_under_a_scoped_subscriber_is_heard() {
    fn emit() {
        tracing::info!(target: "obs-first-hit", "first hit elsewhere");
    }
    let text = logs_at(tracing::Level::INFO, || {
        std::thread::spawn(emit).join().unwrap();
        emit();
    });
    assert!(
        text.contains("first hit elsewhere"),
        "nothing logged: {text:?}"
    );
}
