//! Invalidations survive an outage: a memcached or Redis server this process could not reach
//! while it deleted or replaced keys never serves those keys' old values to it when it is back.
//! Real memcached and Redis processes, stopped (SIGSTOP) and resumed, partitioned, or killed and
//! restarted (Redis with its data, from its append-only file); both front ends.

use std::io::{BufRead, BufReader, Write as _};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use newcache::{
    AsyncCache, Cache, CacheBuilder, DeadServerPolicy, Error, FailurePolicy, Stats, Ttl,
};

use crate::fixture::{Memcached, Twemproxy, unique_flavor};

const MS: fn(u64) -> Duration = Duration::from_millis;
const RETRY: Duration = Duration::from_millis(300);

/// One front end, called the same way whichever it is.
enum Front {
    Sync(Cache),
    Async(AsyncCache, tokio::runtime::Runtime),
}

impl Front {
    fn build(builder: CacheBuilder, asynch: bool) -> Front {
        if !asynch {
            return Front::Sync(builder.build().unwrap());
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        Front::Async(builder.build_async().unwrap(), rt)
    }

    fn get(&self, k: &str) -> Result<Option<String>, Error> {
        match self {
            Front::Sync(c) => c.get(k),
            Front::Async(c, rt) => rt.block_on(c.get(k)),
        }
    }

    fn set(&self, k: &str, v: &str) -> Result<(), Error> {
        match self {
            Front::Sync(c) => c.set(k, v, Ttl::Never),
            Front::Async(c, rt) => rt.block_on(c.set(k, v, Ttl::Never)),
        }
    }

    fn delete(&self, k: &str) -> Result<bool, Error> {
        match self {
            Front::Sync(c) => c.delete(k),
            Front::Async(c, rt) => rt.block_on(c.delete(k)),
        }
    }

    fn load(&self, k: &str, v: &str, loads: &mut u32) -> String {
        let mut loader = || {
            *loads += 1;
            Ok::<_, std::io::Error>(v.to_owned())
        };
        match self {
            Front::Sync(c) => c
                .get_or_set_with(k, Duration::from_secs(60), loader)
                .unwrap(),
            Front::Async(c, rt) => rt
                .block_on(c.get_or_set_with(k, Duration::from_secs(60), || {
                    let v = loader();
                    async move { v }
                }))
                .unwrap(),
        }
    }

    fn stats(&self) -> Stats {
        match self {
            Front::Sync(c) => c.stats(),
            Front::Async(c, _) => c.stats(),
        }
    }

    fn make_key(&self, k: &str) -> String {
        match self {
            Front::Sync(c) => c.make_key(k),
            Front::Async(c, _) => c.make_key(k),
        }
    }
}

fn builder(addrs: &[String], tag: &str) -> CacheBuilder {
    outage_settings(Cache::builder().memcached(addrs), tag)
}

/// The settings of every test here: errors propagated, one fault marks a server dead, short
/// timeouts.
fn outage_settings(b: CacheBuilder, tag: &str) -> CacheBuilder {
    b.read_failures(FailurePolicy::Propagate)
        .flavor(unique_flavor(tag))
        .failure_limit(1)
        .retry_interval(RETRY)
        .io_timeout(MS(200))
        .connect_timeout(MS(200))
}

/// A client of the server at `addr` alone: what it holds, by derived key.
fn raw(addr: &str) -> memcache::Client {
    memcache::connect(format!("memcache://{addr}?protocol=ascii&timeout=2")).unwrap()
}

fn holds(addr: &str, derived: &str) -> bool {
    raw(addr).get::<Vec<u8>>(derived).unwrap().is_some()
}

/// `n` user keys whose home is the server at `addr` (of `front`'s servers).
fn keys_on(front: &Front, addr: &str, n: usize) -> Vec<String> {
    let mut found = Vec::new();
    for i in 0.. {
        let k = format!("k{i}");
        front.set(&k, "probe").unwrap();
        if holds(addr, &front.make_key(&k)) {
            found.push(k);
            if found.len() == n {
                return found;
            }
        }
    }
    unreachable!()
}

/// One server an outage test stops and resumes: memcached, or Redis 7.
enum Server {
    Memcached(Memcached),
    #[cfg(feature = "redis")]
    Redis(crate::fixture::RedisServer),
}

impl Server {
    fn memcached() -> Server {
        Server::Memcached(Memcached::start())
    }

    #[cfg(feature = "redis")]
    fn redis() -> Server {
        Server::Redis(crate::fixture::RedisServer::start("redis-server"))
    }

    /// Valkey 9 (the Redis protocol).
    #[cfg(feature = "redis")]
    fn valkey() -> Server {
        Server::Redis(crate::fixture::RedisServer::start(
            &crate::fixture::valkey_server(),
        ))
    }

    /// `host:port`.
    fn addr(&self) -> String {
        match self {
            Server::Memcached(m) => m.addr(),
            #[cfg(feature = "redis")]
            Server::Redis(r) => format!("127.0.0.1:{}", r.port),
        }
    }

    /// A cache on this kind of server at `addr` (this one's, or a forwarder's to it).
    fn builder_at(&self, addr: &str, tag: &str) -> CacheBuilder {
        match self {
            Server::Memcached(_) => builder(&[addr.to_owned()], tag),
            #[cfg(feature = "redis")]
            Server::Redis(_) => {
                outage_settings(Cache::builder().redis(format!("redis://{addr}/0")), tag)
            }
        }
    }

    fn builder(&self, tag: &str) -> CacheBuilder {
        self.builder_at(&self.addr(), tag)
    }

    fn signal(&self, sig: &str) {
        match self {
            Server::Memcached(m) => m.signal(sig),
            #[cfg(feature = "redis")]
            Server::Redis(r) => r.signal(sig),
        }
    }

    /// Whether the server holds `derived`, asked by a client of its own.
    fn holds(&self, derived: &str) -> bool {
        match self {
            Server::Memcached(m) => holds(&m.addr(), derived),
            #[cfg(feature = "redis")]
            Server::Redis(r) => {
                let mut c = redis::Client::open(r.url())
                    .unwrap()
                    .get_connection()
                    .unwrap();
                // A server just restarted with its data accepts connections before it has
                // loaded them, and answers LOADING meanwhile.
                let deadline = Instant::now() + Duration::from_secs(10);
                loop {
                    match redis::cmd("EXISTS").arg(derived).query(&mut c) {
                        Err(e) if e.code() == Some("LOADING") => {
                            assert!(Instant::now() < deadline, "still loading: {e}");
                            thread::sleep(MS(20));
                        }
                        r => return r.unwrap(),
                    }
                }
            }
        }
    }
}

/// Calls `op` until the server it goes to is marked dead (its failure ejects it): at most a
/// few timed-out calls, then one that fails fast or (under `Remap`) succeeds elsewhere.
fn until_ejected(mut op: impl FnMut() -> Result<(), Error>) {
    let mut failed = false;
    for _ in 0..10 {
        match op() {
            Err(e) if e.to_string().contains("marked dead") => return,
            Err(_) => failed = true,
            Ok(()) if failed => return,
            Ok(()) => {}
        }
    }
    panic!("the stopped server was never marked dead");
}

/// Waits out the retry interval, then reads `k` until `replayed` deletes were counted: every
/// read after the server is resumed must be `want` (never an invalidated value).
fn after_revival(front: &Front, k: &str, want: Option<&str>, replayed: u64) {
    thread::sleep(RETRY + MS(100));
    let t = Instant::now();
    loop {
        if let Ok(v) = front.get(k) {
            assert_eq!(v.as_deref(), want, "{k} read after its server came back");
            if front.stats().replayed_deletes >= replayed {
                return;
            }
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "no replay: {:?}",
            front.stats()
        );
        thread::sleep(MS(20));
    }
}

/// The reproduction: two servers, `Remap`. Server A holds k1 and k2; A stops; this
/// process deletes k1 and replaces k2 (both land on B); A resumes and is probed back. It used
/// to serve k1 and k2's old values as fresh for as long as they lived; now both are deleted on A
/// before A serves again, and the copy of k2 written to B goes too.
fn remap_revival(asynch: bool) {
    let servers = [Memcached::start(), Memcached::start()];
    let addrs: Vec<String> = servers.iter().map(Memcached::addr).collect();
    let b = builder(&addrs, "outage-remap").dead_servers(DeadServerPolicy::Remap);
    let front = Front::build(b, asynch);
    let ks = keys_on(&front, &addrs[0], 2);
    let (k1, k2) = (&ks[0], &ks[1]);
    let on_b = keys_on(&front, &addrs[1], 1).remove(0);
    front.set(k1, "v1").unwrap();
    front.set(k2, "v1").unwrap();
    servers[0].signal("STOP");
    until_ejected(|| front.get(k1).map(drop));
    assert!(!front.delete(k1).unwrap(), "on B, which never held it");
    front.set(k2, "v2").unwrap();
    assert_eq!(front.get(k2).unwrap().as_deref(), Some("v2"), "served by B");
    assert!(holds(&addrs[1], &front.make_key(k2)));
    servers[0].signal("CONT");
    after_revival(&front, k1, None, 2);
    assert_eq!(front.get(k2).unwrap(), None, "v1 was deleted on A");
    assert!(!holds(&addrs[0], &front.make_key(k1)));
    assert!(!holds(&addrs[0], &front.make_key(k2)));
    // B's copy is deleted by B's next call (the replay's copies are handed on to B's record).
    front.get(&on_b).unwrap();
    assert!(
        !holds(&addrs[1], &front.make_key(k2)),
        "the copy written to B while A was out is gone (it would come back at A's next outage): {:?}",
        front.stats()
    );
    let s = front.stats();
    // k1 and k2 on A; then on B both (k1's delete and k2's write landed there)
    assert_eq!((s.replayed_deletes, s.replay_overflows), (4, 0), "{s:?}");
}

#[test]
fn remap_a_revived_server_never_serves_what_was_deleted_or_replaced() {
    remap_revival(false);
}

#[test]
fn remap_a_revived_server_never_serves_what_was_deleted_or_replaced_async() {
    remap_revival(true);
}

/// `FailFast` (the default): a delete while the key's server is stopped fails, and says it was
/// queued; when the server is back, this process never reads the deleted value from it. (The
/// server is ejected by a read first, so that the delete of `k` is never sent: one sent to a
/// stopped server waits in its socket and is applied when it resumes.)
fn fail_fast_revival(server: Server, asynch: bool) {
    let front = Front::build(server.builder("outage-failfast"), asynch);
    front.set("k", "v1").unwrap();
    front.set("sent", "v1").unwrap();
    server.signal("STOP");
    let e = front.delete("sent").unwrap_err();
    assert!(
        e.is_timeout() && e.to_string().contains("queued for replay"),
        "{e}"
    );
    until_ejected(|| front.get("k").map(drop));
    let e = front.delete("k").unwrap_err();
    assert!(
        e.to_string().contains("marked dead") && e.to_string().contains("queued for replay"),
        "{e}"
    );
    server.signal("CONT");
    after_revival(&front, "k", None, 2);
    assert!(!server.holds(&front.make_key("k")));
    assert_eq!(front.get("sent").unwrap(), None);
    assert_eq!(front.stats().replayed_deletes, 2, "two keys, once each");
}

#[test]
fn fail_fast_a_delete_during_an_outage_is_replayed() {
    fail_fast_revival(Server::memcached(), false);
}

#[test]
fn fail_fast_a_delete_during_an_outage_is_replayed_async() {
    fail_fast_revival(Server::memcached(), true);
}

#[cfg(feature = "redis")]
#[test]
fn redis_a_delete_during_an_outage_is_replayed() {
    fail_fast_revival(Server::redis(), false);
}

#[cfg(feature = "redis")]
#[test]
fn redis_a_delete_during_an_outage_is_replayed_async() {
    fail_fast_revival(Server::redis(), true);
}

/// Redis keeps its data across a restart (here an append-only file, synced at every write): a
/// key deleted while the server was down is back when it restarts, and this process deletes it
/// there before it reads anything, instead of serving the old value as fresh.
#[cfg(feature = "redis")]
fn redis_restart_with_data(asynch: bool) {
    let dir = std::env::temp_dir().join(format!(
        "newcache-outage-aof-{}-{asynch}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut redis = crate::fixture::RedisServer::start_with(
        "redis-server",
        &[
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--dir",
            dir.to_str().unwrap(),
        ],
    );
    let url = redis.url();
    let front = Front::build(
        outage_settings(Cache::builder().redis(&url), "outage-aof"),
        asynch,
    );
    front.set("k", "v1").unwrap();
    front.set("kept", "v1").unwrap();
    redis.kill();
    let e = front.delete("k").unwrap_err();
    assert!(e.to_string().contains("queued for replay"), "{e}");
    redis.restart();
    let server = Server::Redis(redis);
    assert!(
        server.holds(&front.make_key("k")),
        "the restarted server has its data back"
    );
    after_revival(&front, "k", None, 1);
    assert!(!server.holds(&front.make_key("k")));
    assert_eq!(front.get("kept").unwrap().as_deref(), Some("v1"), "only k");
    assert_eq!(front.stats().replayed_deletes, 1);
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

#[cfg(feature = "redis")]
#[test]
fn redis_a_restarted_server_never_serves_a_key_deleted_while_it_was_down() {
    redis_restart_with_data(false);
}

#[cfg(feature = "redis")]
#[test]
fn redis_a_restarted_server_never_serves_a_key_deleted_while_it_was_down_async() {
    redis_restart_with_data(true);
}

/// A Redis server restarted with a dataset it takes a while to load answers `-LOADING` to
/// every command meanwhile, the replay's `UNLINK`s included. That refusal is not the server
/// passing over a key for good (as twemproxy's for a backend it ejected): the key deleted while
/// the server was down must still be deleted there once it has loaded, not served as fresh.
/// (`key-load-delay`, a Redis test setting, stretches the load of a few thousand keys to
/// seconds.)
#[cfg(feature = "redis")]
fn redis_restart_while_loading(asynch: bool) {
    let dir = std::env::temp_dir().join(format!(
        "newcache-outage-loading-{}-{asynch}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut redis = crate::fixture::RedisServer::start_with(
        "redis-server",
        &[
            "--dir",
            dir.to_str().unwrap(),
            "--key-load-delay",
            "100",
            "--loading-process-events-interval-bytes",
            "1024",
        ],
    );
    let url = redis.url();
    let front = Front::build(
        outage_settings(Cache::builder().redis(&url), "outage-loading"),
        asynch,
    );
    front.set("k", "v1").unwrap();
    {
        let mut c = redis::Client::open(url.as_str())
            .unwrap()
            .get_connection()
            .unwrap();
        let mut fill = redis::pipe();
        for i in 0..20_000 {
            fill.cmd("SET").arg(format!("fill{i}")).arg("x").ignore();
        }
        let () = fill.query(&mut c).unwrap();
        let () = redis::cmd("SAVE").query(&mut c).unwrap();
    }
    redis.kill();
    let e = front.delete("k").unwrap_err();
    assert!(e.to_string().contains("queued for replay"), "{e}");
    redis.restart();
    let t = Instant::now();
    let mut loading = 0;
    let v = loop {
        match front.get("k") {
            Ok(v) => break v,
            Err(e) => {
                if format!("{e:?}").to_lowercase().contains("loading") {
                    loading += 1;
                }
            }
        }
        assert!(t.elapsed() < Duration::from_secs(20), "never back");
        thread::sleep(MS(20));
    };
    assert!(
        loading > 0,
        "the server was read while it loaded (else this proves nothing)"
    );
    assert_eq!(v, None, "k was deleted while the server was down");
    assert!(!Server::Redis(redis).holds(&front.make_key("k")));
    let _ = std::fs::remove_dir_all(&dir);
}

#[cfg(feature = "redis")]
#[test]
fn redis_a_replay_refused_while_the_server_loads_its_data_is_kept() {
    redis_restart_while_loading(false);
}

#[cfg(feature = "redis")]
#[test]
fn redis_a_replay_refused_while_the_server_loads_its_data_is_kept_async() {
    redis_restart_while_loading(true);
}

/// Killed and restarted (empty) under `Remap`: a key written while A was dead went to B. When A
/// is back the key maps to A again, and B's copy is deleted; so when A dies again, B does not
/// serve that older copy in place of what was written to A meanwhile.
fn restart_fallback_copies(asynch: bool) {
    let mut servers = [Memcached::start(), Memcached::start()];
    let addrs: Vec<String> = servers.iter().map(Memcached::addr).collect();
    let b = builder(&addrs, "outage-restart").dead_servers(DeadServerPolicy::Remap);
    let front = Front::build(b, asynch);
    let k = keys_on(&front, &addrs[0], 1).remove(0);
    let on_b = keys_on(&front, &addrs[1], 1).remove(0);
    servers[0].kill();
    until_ejected(|| front.get(&k).map(drop));
    front.set(&k, "v2").unwrap();
    assert!(holds(&addrs[1], &front.make_key(&k)), "written to B");
    servers[0].restart();
    after_revival(&front, &k, None, 1);
    front.set(&k, "v3").unwrap();
    assert!(holds(&addrs[0], &front.make_key(&k)), "written to A");
    front.get(&on_b).unwrap();
    servers[0].kill();
    until_ejected(|| front.get(&k).map(drop));
    assert_eq!(
        front.get(&k).unwrap(),
        None,
        "B's copy from A's first outage is gone"
    );
}

#[test]
fn restart_a_copy_written_elsewhere_never_comes_back() {
    restart_fallback_copies(false);
}

#[test]
fn restart_a_copy_written_elsewhere_never_comes_back_async() {
    restart_fallback_copies(true);
}

/// A record too small for the outage: the keys past it are not replayed, but the values the
/// server holds from before the overflow are judged stale: one herd-protected reload each, and
/// no old value served as fresh. A value written after the server is back is fresh.
fn overflow(server: Server, asynch: bool) {
    let front = Front::build(server.builder("outage-overflow").replay_capacity(2), asynch);
    let keys: Vec<String> = (0..6).map(|i| format!("k{i}")).collect();
    for k in &keys {
        front.set(k, "v1").unwrap();
    }
    server.signal("STOP");
    let said: Vec<String> = keys
        .iter()
        .map(|k| front.delete(k).unwrap_err().to_string())
        .collect();
    assert!(
        said[..2].iter().all(|e| e.contains("queued for replay")),
        "{said:?}"
    );
    assert!(
        said[2..].iter().all(|e| e.contains("queue is full")),
        "{said:?}"
    );
    server.signal("CONT");
    after_revival(&front, &keys[0], None, 2);
    let mut loads = 0;
    for k in &keys {
        assert_eq!(front.load(k, "v2", &mut loads), "v2", "{k}: never v1");
    }
    assert_eq!(loads, 6, "one reload per key");
    for k in &keys {
        assert_eq!(front.get(k).unwrap().as_deref(), Some("v2"), "fresh now");
    }
    front.set("later", "fresh").unwrap();
    assert_eq!(front.get("later").unwrap().as_deref(), Some("fresh"));
    let s = front.stats();
    assert_eq!((s.replayed_deletes, s.replay_overflows), (2, 4), "{s:?}");
}

#[test]
fn an_overflowing_record_judges_older_values_stale() {
    overflow(Server::memcached(), false);
}

#[test]
fn an_overflowing_record_judges_older_values_stale_async() {
    overflow(Server::memcached(), true);
}

#[cfg(feature = "redis")]
#[test]
fn redis_an_overflowing_record_judges_older_values_stale() {
    overflow(Server::redis(), false);
}

#[cfg(feature = "redis")]
#[test]
fn redis_an_overflowing_record_judges_older_values_stale_async() {
    overflow(Server::redis(), true);
}

const CHILD_ADDR: &str = "NEWCACHE_TEST_OUTAGE_ADDR";
const CHILD_FLAVOR: &str = "NEWCACHE_TEST_OUTAGE_FLAVOR";

/// The other process: reads `k` each time the parent writes a line, and answers with what it
/// read. Without the parent's environment: nothing.
#[test]
#[ignore = "run by another_process_sees_the_replay_once_it_is_made"]
fn outage_child() {
    let (Ok(addr), Ok(flavor)) = (std::env::var(CHILD_ADDR), std::env::var(CHILD_FLAVOR)) else {
        return;
    };
    let cache = Cache::builder()
        .memcached([addr.as_str()])
        .flavor(flavor)
        .build()
        .unwrap();
    let mut out = std::io::stdout();
    for line in std::io::stdin().lock().lines() {
        if line.unwrap().is_empty() {
            break;
        }
        let v: Option<String> = cache.get("k").unwrap();
        writeln!(out, "read={}", v.as_deref().unwrap_or("none")).unwrap();
        out.flush().unwrap();
    }
}

/// What another process sees: it never saw the outage, so it has nothing to replay. After the
/// server resumes, it reads the old value until this process (which deleted it during the
/// outage) makes its first call there and replays the delete; from then on, it reads nothing.
#[test]
fn another_process_sees_the_replay_once_it_is_made() {
    let server = Memcached::start();
    let addrs = vec![server.addr()];
    let flavor = unique_flavor("outage-procs");
    let front = Front::build(builder(&addrs, "unused").flavor(flavor.clone()), false);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "outage::outage_child",
            "--ignored",
            "--nocapture",
        ])
        .args(["--test-threads", "1"])
        .env(CHILD_ADDR, server.addr())
        .env(CHILD_FLAVOR, &flavor)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut to_child = child.stdin.take().unwrap();
    let mut from_child = BufReader::new(child.stdout.take().unwrap());
    let mut child_reads = || {
        writeln!(to_child, "read").unwrap();
        to_child.flush().unwrap();
        let mut line = String::new();
        loop {
            line.clear();
            assert!(
                from_child.read_line(&mut line).unwrap() > 0,
                "the child ended"
            );
            // (libtest's "test outage::outage_child ... " may start the first line)
            if let Some((_, v)) = line.trim().split_once("read=") {
                return v.to_owned();
            }
        }
    };
    front.set("k", "v1").unwrap();
    assert_eq!(child_reads(), "v1");
    server.signal("STOP");
    // A read ejects the server, so that the delete is never sent (one sent while the server is
    // stopped would be applied when it resumes).
    until_ejected(|| front.get("k").map(drop));
    let e = front.delete("k").unwrap_err();
    assert!(e.to_string().contains("marked dead"), "{e}");
    server.signal("CONT");
    assert_eq!(
        child_reads(),
        "v1",
        "the other process never saw the outage: it reads the old value until the replay"
    );
    after_revival(&front, "k", None, 1);
    assert_eq!(child_reads(), "none", "the replay reached the server");
    drop(to_child);
    let _ = child.wait();
}

/// A `Clock` an hour behind the system's (what `CacheBuilder::clock` accepts).
#[derive(Debug)]
struct Behind;

impl newcache::Clock for Behind {
    fn now_ms(&self) -> u64 {
        newcache::Clock::now_ms(&newcache::SystemClock) - 3_600_000
    }
}

/// The overflow test with the cache on its own clock (an hour behind the system's): a full
/// record's stale-before time is on the clock the values' write times are on, so the old values
/// are judged stale, not served as fresh.
fn overflow_on_a_clock(server: Server, asynch: bool) {
    let front = Front::build(
        server
            .builder("outage-overflow-clock")
            .replay_capacity(2)
            .clock(std::sync::Arc::new(Behind)),
        asynch,
    );
    let keys: Vec<String> = (0..6).map(|i| format!("k{i}")).collect();
    for k in &keys {
        front.set(k, "v1").unwrap();
    }
    server.signal("STOP");
    for k in &keys {
        let _ = front.delete(k);
    }
    server.signal("CONT");
    after_revival(&front, &keys[0], None, 2);
    let mut loads = 0;
    for k in &keys {
        assert_eq!(front.load(k, "v2", &mut loads), "v2", "{k}: never v1");
    }
}

#[test]
fn an_overflowing_record_is_on_the_cache_clock() {
    overflow_on_a_clock(Server::memcached(), false);
}

#[test]
fn an_overflowing_record_is_on_the_cache_clock_async() {
    overflow_on_a_clock(Server::memcached(), true);
}

#[cfg(feature = "redis")]
#[test]
fn redis_an_overflowing_record_is_on_the_cache_clock() {
    overflow_on_a_clock(Server::redis(), false);
}

#[cfg(feature = "redis")]
#[test]
fn redis_an_overflowing_record_is_on_the_cache_clock_async() {
    overflow_on_a_clock(Server::redis(), true);
}

/// The engine hands a replay to a connection's task, the Redis async view to a task of its
/// own: a task dropped before it ran (its runtime shut down) gives the keys back, and the next
/// caller (on another runtime) replays them before it reads.
#[test]
fn a_replay_dropped_with_its_runtime_is_kept_async() {
    replay_dropped_with_its_runtime(Server::memcached());
}

#[cfg(feature = "redis")]
#[test]
fn redis_a_replay_dropped_with_its_runtime_is_kept_async() {
    replay_dropped_with_its_runtime(Server::redis());
}

fn replay_dropped_with_its_runtime(server: Server) {
    let cache = server.builder("outage-rtdrop").build_async().unwrap();
    let rt = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    };
    async fn get(c: &AsyncCache, k: &str) -> Result<Option<String>, Error> {
        c.get(k).await
    }
    let rt1 = rt();
    rt1.block_on(cache.set("k", "v1", Ttl::Never)).unwrap();
    server.signal("STOP");
    // Ejected by reads of another key: nothing of k's is sent.
    until_ejected(|| rt1.block_on(get(&cache, "other")).map(drop));
    let e = rt1.block_on(cache.delete("k")).unwrap_err();
    assert!(e.to_string().contains("queued for replay"), "{e}");
    server.signal("CONT");
    thread::sleep(RETRY + MS(100));
    // The probe opens its connection (taking the record); its runtime ends before the task runs.
    rt1.block_on(async {
        tokio::select! {
            biased;
            _ = get(&cache, "other") => {}
            () = async {} => {}
        }
    });
    drop(rt1);
    let rt2 = rt();
    let t = Instant::now();
    loop {
        if let Ok(v) = rt2.block_on(get(&cache, "k")) {
            assert_eq!(v, None, "k was deleted while its server was stopped");
            return;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "never revived");
        thread::sleep(MS(50));
    }
}

/// A forwarder to a server that can be cut (every connection closed, new ones closed at once,
/// nothing forwarded) and restored: this process loses the server while it keeps its data and
/// other clients could still reach it (a partition, not a stopped process).
struct Switch {
    addr: String,
    on: std::sync::Arc<std::sync::atomic::AtomicBool>,
    conns: std::sync::Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
}

impl Switch {
    fn new(upstream: String) -> Switch {
        use std::sync::atomic::Ordering;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let on = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let conns = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (on2, conns2) = (on.clone(), conns.clone());
        thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                if !on2.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                let server = std::net::TcpStream::connect(&upstream).unwrap();
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                {
                    let mut c = conns2.lock().unwrap();
                    c.push(client.try_clone().unwrap());
                    c.push(server.try_clone().unwrap());
                }
                for (mut from, mut to) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(std::net::Shutdown::Both);
                    });
                }
            }
        });
        Switch { addr, on, conns }
    }

    fn cut(&self) {
        self.on.store(false, std::sync::atomic::Ordering::SeqCst);
        for c in self.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }

    fn restore(&self) {
        self.on.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Concurrent callers after a partition heals, the server never marked dead (a high
/// `failure_limit`): one caller replays the whole record on its connection; the others wait for
/// that replay to end before they read, so none reads a deleted value.
fn concurrent_readers_after_a_partition(server: Server, asynch: bool) {
    let switch = Switch::new(server.addr());
    let mut b = server
        .builder_at(&switch.addr, "outage-partition")
        .failure_limit(1_000_000);
    if let Server::Memcached(_) = server {
        b = b.pipelined_sync(false);
    }
    let front = Front::build(b, asynch);
    front.set("k", "v1").unwrap();
    switch.cut();
    // k's delete and many others never reach the server: each is recorded.
    let e = front.delete("k").unwrap_err();
    assert!(e.to_string().contains("queued for replay"), "{e}");
    let others: Vec<String> = (0..8_000).map(|i| format!("f{i}")).collect();
    match &front {
        Front::Sync(c) => drop(c.delete_many(&others)),
        Front::Async(c, rt) => drop(rt.block_on(c.delete_many(&others))),
    }
    assert!(server.holds(&front.make_key("k")), "never deleted");
    switch.restore();
    let seen: Vec<Option<String>> = match &front {
        Front::Sync(c) => thread::scope(|s| {
            let readers: Vec<_> = (0..6).map(|_| s.spawn(|| c.get::<String>("k"))).collect();
            readers
                .into_iter()
                .filter_map(|r| r.join().unwrap().ok())
                .collect()
        }),
        Front::Async(c, rt) => rt.block_on(async {
            let (a, b, d, e) = tokio::join!(
                c.get::<String>("x"),
                c.get::<String>("k"),
                c.get::<String>("k"),
                c.get::<String>("k")
            );
            drop(a);
            [b, d, e].into_iter().filter_map(Result::ok).collect()
        }),
    };
    let later = front.get("k").unwrap();
    assert!(
        seen.iter().all(Option::is_none),
        "k was deleted while the server was out of reach, read after: {seen:?} (then {later:?}, \
         once the replay is done)"
    );
}

#[test]
fn concurrent_readers_after_a_partition_wait_for_the_replay() {
    concurrent_readers_after_a_partition(Server::memcached(), false);
}

#[test]
fn concurrent_readers_after_a_partition_wait_for_the_replay_async() {
    concurrent_readers_after_a_partition(Server::memcached(), true);
}

#[cfg(feature = "redis")]
#[test]
fn redis_concurrent_readers_after_a_partition_wait_for_the_replay() {
    concurrent_readers_after_a_partition(Server::redis(), false);
}

#[cfg(feature = "redis")]
#[test]
fn redis_concurrent_readers_after_a_partition_wait_for_the_replay_async() {
    concurrent_readers_after_a_partition(Server::redis(), true);
}

/// Behind twemproxy, a replay's delete of a key whose backend is down is answered
/// `SERVER_ERROR` by the proxy: that key is passed over (an outage behind the proxy is the
/// proxy's), and the calls for keys on the backends that are up go on.
#[test]
fn a_replay_behind_twemproxy_with_a_backend_down_fails_no_call() {
    replay_behind_twemproxy(false);
}

#[test]
fn a_replay_behind_twemproxy_with_a_backend_down_fails_no_call_async() {
    replay_behind_twemproxy(true);
}

fn replay_behind_twemproxy(asynch: bool) {
    let mut m1 = Memcached::start();
    let m2 = Memcached::start();
    let proxy = Twemproxy::start(
        &[m1.addr(), m2.addr()],
        &["auto_eject_hosts: false", "timeout: 400"],
    );
    let switch = Switch::new(proxy.addr());
    let b = builder(std::slice::from_ref(&switch.addr), "outage-twem")
        .failure_limit(1_000_000)
        .pipelined_sync(false);
    let front = Front::build(b, asynch);
    let (mut on1, mut on2) = (None, None);
    for i in 0.. {
        let k = format!("t{i}");
        front.set(&k, "v1").unwrap();
        if holds(&m1.addr(), &front.make_key(&k)) {
            on1.get_or_insert(k);
        } else {
            on2.get_or_insert(k);
        }
        if on1.is_some() && on2.is_some() {
            break;
        }
    }
    let (on1, on2) = (on1.unwrap(), on2.unwrap());
    switch.cut();
    let e = front.delete(&on1).unwrap_err();
    assert!(e.to_string().contains("queued for replay"), "{e}");
    switch.restore();
    m1.kill();
    let got: Vec<_> = (0..5)
        .map(|_| front.get(&on2).map_err(|e| format!("{e:?}").len()))
        .collect();
    let s = front.stats();
    assert!(
        got.iter()
            .all(|g| g.as_ref().is_ok_and(|v| v.as_deref() == Some("v1"))),
        "a key on the backend that is up: {got:?} (error lengths), replays failed: {}",
        s.replays_failed
    );
    assert_eq!(
        s.replayed_deletes, 0,
        "the proxy refused the one replayed delete: nothing was deleted"
    );
}

/// A call's future polled once, as the record is replayed, and then held without being polled
/// (a future pinned outside a `select!` loop whose other arm awaits the cache): the replay it
/// began must not hold up every other call, async or sync, until it is polled again. On
/// memcached the replay belongs to the connection's task, not to the caller.
fn a_parked_call_holds_up_no_other(server: Server) {
    let switch = Switch::new(server.addr());
    let b = server
        .builder_at(&switch.addr, "outage-parked")
        .failure_limit(1_000_000);
    let cache = b.build_async().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(cache.set("k", "v1", Ttl::Never)).unwrap();
    switch.cut();
    let e = rt.block_on(cache.delete("k")).unwrap_err();
    assert!(e.to_string().contains("queued for replay"), "{e}");
    switch.restore();
    let mut parked = Box::pin(cache.get::<String>("other"));
    rt.block_on(std::future::poll_fn(|cx| {
        let _ = std::future::Future::poll(parked.as_mut(), cx);
        std::task::Poll::Ready(())
    }));
    let sync = cache.to_sync();
    let t = Instant::now();
    let mut errors = Vec::new();
    loop {
        match (
            rt.block_on(cache.get::<String>("k")),
            sync.get::<String>("k"),
        ) {
            (Ok(a), Ok(s)) => {
                assert_eq!((a, s), (None, None), "k was deleted while out of reach");
                break;
            }
            (a, s) => errors.push(format!("{:?} / {:?}", a.err(), s.err())),
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "every call failed while another call's future sat unpolled: {errors:?}"
        );
    }
    drop(parked);
}

#[test]
fn a_parked_call_holds_up_no_other_call() {
    a_parked_call_holds_up_no_other(Server::memcached());
}

#[cfg(feature = "redis")]
#[test]
fn redis_a_parked_call_holds_up_no_other_call() {
    a_parked_call_holds_up_no_other(Server::redis());
}

/// A write the server refuses with an error reply (here `-READONLY`: the URL names a replica)
/// did not miss the server: it answered, and the key holds what it held. Such a refusal is not
/// queued for replay, and no replay is counted (none deletes anything: the replica refuses the
/// `UNLINK` too).
#[cfg(feature = "redis")]
fn redis_refused_write(asynch: bool) {
    let nobody = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let master = nobody.local_addr().unwrap().port().to_string();
    drop(nobody);
    let replica = crate::fixture::RedisServer::start_with(
        "redis-server",
        &["--replicaof", "127.0.0.1", &master],
    );
    let front = Front::build(
        outage_settings(Cache::builder().redis(replica.url()), "outage-refused"),
        asynch,
    );
    for k in ["a", "b", "c"] {
        let e = front.set(k, "v").unwrap_err();
        assert!(
            format!("{e:?}").to_lowercase().contains("read only"),
            "{e:?}"
        );
        assert!(!e.to_string().contains("queued for replay"), "{e}");
        let e = front.delete(k).unwrap_err();
        assert!(!e.to_string().contains("queued for replay"), "{e}");
        assert_eq!(front.get(k).unwrap(), None);
    }
    let s = front.stats();
    assert_eq!(
        (s.replayed_deletes, s.replays_failed),
        (0, 0),
        "nothing was deleted: {s:?}"
    );
}

#[cfg(feature = "redis")]
#[test]
fn redis_a_write_the_server_refuses_is_not_queued_for_replay() {
    redis_refused_write(false);
}

#[cfg(feature = "redis")]
#[test]
fn redis_a_write_the_server_refuses_is_not_queued_for_replay_async() {
    redis_refused_write(true);
}

/// A replayed `UNLINK` the server refuses with an error reply (here `NOPERM`: the URL's user
/// may not run `UNLINK`) is passed over: the replay does not fail, and `replayed_deletes`
/// counts none of its keys, since none was deleted.
#[cfg(feature = "redis")]
fn redis_refused_replay(asynch: bool) {
    let server = crate::fixture::RedisServer::start("redis-server");
    let mut admin = redis::Client::open(server.url())
        .unwrap()
        .get_connection()
        .unwrap();
    let () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("no-unlink")
        .arg(&["on", ">secret", "~*", "&*", "+@all", "-unlink"])
        .query(&mut admin)
        .unwrap();
    let switch = Switch::new(format!("127.0.0.1:{}", server.port));
    let url = format!("redis://no-unlink:secret@{}/0", switch.addr);
    let b = outage_settings(Cache::builder().redis(url), "outage-refused-replay")
        .failure_limit(1_000_000);
    let front = Front::build(b, asynch);
    front.set("k", "v1").unwrap();
    switch.cut();
    let e = front.delete("k").unwrap_err();
    assert!(e.to_string().contains("queued for replay"), "{e}");
    switch.restore();
    assert_eq!(
        front.get("k").unwrap().as_deref(),
        Some("v1"),
        "the replayed UNLINK was refused: k is still there"
    );
    let s = front.stats();
    assert_eq!(
        (s.replayed_deletes, s.replays_failed),
        (0, 0),
        "the one replayed delete was refused (passed over, not deleted): {s:?}"
    );
}

#[cfg(feature = "redis")]
#[test]
fn redis_a_replayed_delete_the_server_refuses_is_not_counted() {
    redis_refused_replay(false);
}

#[cfg(feature = "redis")]
#[test]
fn redis_a_replayed_delete_the_server_refuses_is_not_counted_async() {
    redis_refused_replay(true);
}

/// A forwarder whose partition delays what this process sent instead of losing it, as TCP does:
/// while cut, the bytes its connections send are held (none forwarded, none answered); when
/// the partition heals, new connections go through at once, and the held bytes reach the
/// server only when [`deliver_late`](Hold::deliver_late) is called (a retransmission after the
/// backoff of a connection this process has already closed).
struct Hold {
    addr: String,
    cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
    late: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Hold {
    fn new(upstream: String) -> Hold {
        use std::io::Read as _;
        use std::sync::atomic::Ordering;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let cut = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let late = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (cut2, late2) = (cut.clone(), late.clone());
        thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(mut client) = client else { continue };
                let server = std::net::TcpStream::connect(&upstream).unwrap();
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (mut back_from, mut back_to) =
                    (server.try_clone().unwrap(), client.try_clone().unwrap());
                thread::spawn(move || {
                    let _ = std::io::copy(&mut back_from, &mut back_to);
                });
                let (cut, late) = (cut2.clone(), late2.clone());
                let mut server = server;
                thread::spawn(move || {
                    let mut held: Option<Vec<u8>> = None;
                    let mut buf = [0u8; 16 * 1024];
                    client
                        .set_read_timeout(Some(Duration::from_millis(10)))
                        .unwrap();
                    let mut closed = false;
                    loop {
                        if held.is_some() && late.load(Ordering::SeqCst) {
                            let _ = server.write_all(&held.take().unwrap());
                        }
                        if closed {
                            if held.is_none() {
                                let _ = server.shutdown(std::net::Shutdown::Write);
                                return;
                            }
                            thread::sleep(MS(10));
                            continue;
                        }
                        let n = match client.read(&mut buf) {
                            Ok(0) => {
                                closed = true;
                                continue;
                            }
                            Ok(n) => n,
                            Err(e)
                                if matches!(
                                    e.kind(),
                                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                                ) =>
                            {
                                continue;
                            }
                            Err(_) => {
                                closed = true;
                                continue;
                            }
                        };
                        if held.is_none() && cut.load(Ordering::SeqCst) {
                            held = Some(Vec::new());
                        }
                        match &mut held {
                            Some(h) => h.extend_from_slice(&buf[..n]),
                            None => {
                                if server.write_all(&buf[..n]).is_err() {
                                    return;
                                }
                            }
                        }
                    }
                });
            }
        });
        Hold { addr, cut, late }
    }

    /// The partition: from now on, what this process sends is held.
    fn cut(&self) {
        self.cut.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// It heals: connections opened from now on go through.
    fn heal(&self) {
        self.cut.store(false, std::sync::atomic::Ordering::SeqCst);
    }

    /// The bytes held during the partition reach the server.
    fn deliver_late(&self) {
        self.late.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A set whose reply never came (a partition) and a delete of the same key while the server
/// is marked dead: the delete is replayed when the partition heals. The set's bytes, delayed
/// in the network, reach the server after that replay, on the connection this process closed
/// when the set timed out: the server then holds the value this process deleted after writing
/// it, and serves it to this process as fresh.
fn delayed_write(server: Server, asynch: bool) {
    let hold = Hold::new(server.addr());
    let front = Front::build(server.builder_at(&hold.addr, "outage-delayed"), asynch);
    front.set("k", "v1").unwrap();
    hold.cut();
    let e = front.set("k", "v2").unwrap_err();
    assert!(e.is_outcome_unknown(), "{e}");
    let e = front.delete("k").unwrap_err();
    assert!(e.to_string().contains("marked dead"), "{e}");
    assert!(e.to_string().contains("queued for replay"), "{e}");
    hold.heal();
    after_revival(&front, "k", None, 1);
    hold.deliver_late();
    let t = Instant::now();
    while t.elapsed() < MS(500) {
        assert_eq!(
            front.get("k").unwrap(),
            None,
            "k was deleted after its set, read after the set's bytes reached the server"
        );
        thread::sleep(MS(20));
    }
}

#[test]
#[ignore = "known gap, fails: a write delayed in the network past the replay lands after it (memcached has no command to close another connection)"]
fn a_write_delayed_past_the_replay_never_brings_back_a_deleted_key() {
    delayed_write(Server::memcached(), false);
}

/// On Redis and Valkey the replay first closes (`CLIENT KILL ID ... ADDR ...`) the
/// connections this process dropped with a request unanswered: the set's bytes reach a
/// connection the server no longer has.
#[cfg(feature = "redis")]
#[test]
fn redis_a_write_delayed_past_the_replay_never_brings_back_a_deleted_key() {
    delayed_write(Server::redis(), false);
}

#[cfg(feature = "redis")]
#[test]
fn redis_a_write_delayed_past_the_replay_never_brings_back_a_deleted_key_async() {
    delayed_write(Server::redis(), true);
}

#[cfg(feature = "redis")]
#[test]
fn valkey_a_write_delayed_past_the_replay_never_brings_back_a_deleted_key() {
    delayed_write(Server::valkey(), false);
}

#[cfg(feature = "redis")]
#[test]
fn valkey_a_write_delayed_past_the_replay_never_brings_back_a_deleted_key_async() {
    delayed_write(Server::valkey(), true);
}

/// A user the server does not let run `CLIENT KILL` (`-client|kill`; it is `@admin
/// @dangerous`): the replay goes on without it (the deleted key is gone after it), warned
/// once; a write delayed past the replay then lands, as the docs say.
#[cfg(feature = "redis")]
fn redis_delayed_write_without_client_kill(asynch: bool) {
    let server = crate::fixture::RedisServer::start("redis-server");
    let mut admin = redis::Client::open(server.url())
        .unwrap()
        .get_connection()
        .unwrap();
    let () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("no-kill")
        .arg(&["on", ">secret", "~*", "&*", "+@all", "-client|kill"])
        .query(&mut admin)
        .unwrap();
    let hold = Hold::new(format!("127.0.0.1:{}", server.port));
    let url = format!("redis://no-kill:secret@{}/0", hold.addr);
    let logs = crate::obs::logs_at(tracing::Level::WARN, || {
        let front = Front::build(
            outage_settings(Cache::builder().redis(url), "outage-no-kill"),
            asynch,
        );
        front.set("k", "v1").unwrap();
        hold.cut();
        assert!(front.set("k", "v2").unwrap_err().is_outcome_unknown());
        let e = front.delete("k").unwrap_err();
        assert!(e.to_string().contains("queued for replay"), "{e}");
        hold.heal();
        after_revival(&front, "k", None, 1);
        assert_eq!(front.stats().replays_failed, 0);
        hold.deliver_late();
        let t = Instant::now();
        while front.get("k").unwrap().is_none() {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "the set's late bytes never landed"
            );
            thread::sleep(MS(20));
        }
    });
    assert_eq!(
        logs.matches("redis refused CLIENT INFO or CLIENT KILL")
            .count(),
        1,
        "{logs}"
    );
    assert!(logs.contains("NOPERM"), "{logs}");
}

#[cfg(feature = "redis")]
#[test]
fn redis_a_replay_without_client_kill_permission_still_deletes() {
    redis_delayed_write_without_client_kill(false);
}

#[cfg(feature = "redis")]
#[test]
fn redis_a_replay_without_client_kill_permission_still_deletes_async() {
    redis_delayed_write_without_client_kill(true);
}

/// A forwarder that answers new connections late: what a connection sends in its first
/// `delay` (set with [`set_delay`](Slow::set_delay)) reaches the server only then (a server
/// slow to accept, a long path); after that it is forwarded at once.
struct Slow {
    addr: String,
    delay_ms: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Slow {
    fn new(upstream: String) -> Slow {
        use std::sync::atomic::Ordering;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let delay_ms = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let delay2 = delay_ms.clone();
        thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let delay = MS(delay2.load(Ordering::SeqCst));
                let upstream = upstream.clone();
                thread::spawn(move || {
                    thread::sleep(delay);
                    let Ok(server) = std::net::TcpStream::connect(&upstream) else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    for (mut from, mut to) in [
                        (client.try_clone().unwrap(), server.try_clone().unwrap()),
                        (server, client),
                    ] {
                        thread::spawn(move || {
                            let _ = std::io::copy(&mut from, &mut to);
                            let _ = to.shutdown(std::net::Shutdown::Both);
                        });
                    }
                });
            }
        });
        Slow { addr, delay_ms }
    }

    fn set_delay(&self, d: Duration) {
        self.delay_ms
            .store(d.as_millis() as u64, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Concurrent callers after a partition heals, the replaying caller's connect slow (600 ms,
/// well within `connect_timeout`, three times `io_timeout`): the others wait for that replay as
/// long as it may take, and read after it, instead of failing with "another caller's replay
/// ... is still running".
#[cfg(feature = "redis")]
fn redis_callers_wait_out_a_slow_replay(asynch: bool) {
    let server = Server::redis();
    let switch = Switch::new(server.addr());
    let slow = Slow::new(switch.addr.clone());
    let b = server
        .builder_at(&slow.addr, "outage-slow-replay")
        .failure_limit(1_000_000)
        .connect_timeout(Duration::from_secs(3));
    let front = Front::build(b, asynch);
    front.set("k", "v1").unwrap();
    switch.cut();
    let e = front.delete("k").unwrap_err();
    assert!(e.to_string().contains("queued for replay"), "{e}");
    slow.set_delay(MS(600));
    switch.restore();
    let seen: Vec<Result<Option<String>, String>> = match &front {
        Front::Sync(c) => thread::scope(|s| {
            let readers: Vec<_> = (0..4).map(|_| s.spawn(|| c.get::<String>("k"))).collect();
            readers
                .into_iter()
                .map(|r| r.join().unwrap().map_err(|e| e.to_string()))
                .collect()
        }),
        Front::Async(c, rt) => rt.block_on(async {
            let (a, b, d, e) = tokio::join!(
                c.get::<String>("k"),
                c.get::<String>("k"),
                c.get::<String>("k"),
                c.get::<String>("k")
            );
            [a, b, d, e]
                .into_iter()
                .map(|r| r.map_err(|e| e.to_string()))
                .collect()
        }),
    };
    assert!(
        seen.iter().all(|r| matches!(r, Ok(None))),
        "every caller reads k deleted, after the one replay: {seen:?}"
    );
}

#[cfg(feature = "redis")]
#[test]
fn redis_concurrent_callers_wait_out_a_replay_that_connects_slowly() {
    redis_callers_wait_out_a_slow_replay(false);
}

#[cfg(feature = "redis")]
#[test]
fn redis_concurrent_callers_wait_out_a_replay_that_connects_slowly_async() {
    redis_callers_wait_out_a_slow_replay(true);
}

/// A connection to the Redis Cluster node on `port`.
#[cfg(feature = "redis")]
fn cluster_node(port: u16) -> redis::Connection {
    redis::Client::open(format!("redis://127.0.0.1:{port}/"))
        .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(5)))
        .unwrap()
}

/// How far a slot's move got when the replay of a delete of one of its keys runs.
#[cfg(feature = "redis")]
#[derive(Debug, Clone, Copy)]
enum SlotMove {
    /// The key migrated, the slot still the old master's: it answers `ASK`.
    Migrating,
    /// The slot the new master's: the old one answers `MOVED`.
    Done,
}

/// A delete its master refused because it was not serving (`BUSY`: a script past its time
/// limit) is queued for replay; meanwhile its slot moves to another master, the key (with its
/// old value) with it. The replay on the old master is redirected (`MOVED`, or `ASK` while the
/// slot migrates): the key is deleted where it lives now before this process reads it there.
#[cfg(feature = "redis")]
fn redis_cluster_replay_after_a_slot_move(
    cluster: &crate::fixture::RedisCluster,
    asynch: bool,
    how: SlotMove,
) {
    let b = Cache::builder()
        .redis_cluster(cluster.seeds())
        .write_failures(FailurePolicy::Propagate);
    let front = Front::build(
        outage_settings(b, "outage-cluster-move").io_timeout(MS(500)),
        asynch,
    );
    front.set("k", "old").unwrap();
    let key = front.make_key("k");
    let masters = cluster.masters();
    let slot: u16 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(&key)
        .query(&mut cluster_node(masters[0].0))
        .unwrap();
    let from = masters
        .iter()
        .find(|(_, r)| r.iter().any(|&(a, b)| (a..=b).contains(&slot)))
        .map(|(p, _)| *p)
        .unwrap();
    let to = masters
        .iter()
        .map(|(p, _)| *p)
        .find(|&p| p != from)
        .unwrap();

    // The delete misses its master: it is busy in a script (`BUSY`: not serving yet).
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("busy-reply-threshold")
        .arg(50)
        .query(&mut cluster_node(from))
        .unwrap();
    let mut busy = cluster_node(from);
    let script = thread::spawn(move || {
        let _ = redis::cmd("EVAL")
            .arg("while true do end")
            .arg(0)
            .query::<()>(&mut busy);
    });
    // Until the script is past its limit (no wall-clock bet: asked until it says so).
    let deadline = Instant::now() + Duration::from_secs(10);
    while !matches!(
        redis::cmd("PING").query::<String>(&mut cluster_node(from)),
        Err(e) if e.code() == Some("BUSY")
    ) {
        assert!(
            Instant::now() < deadline,
            "the script never made {from} busy"
        );
        thread::sleep(MS(20));
    }
    let e = front.delete("k").unwrap_err();
    let () = redis::cmd("SCRIPT")
        .arg("KILL")
        .query(&mut cluster_node(from))
        .unwrap();
    script.join().unwrap();
    assert!(e.to_string().contains("queued for replay"), "{e}");

    // The slot moves to another master, the key with it (its old value).
    let id = |p: u16| -> String {
        redis::cmd("CLUSTER")
            .arg("MYID")
            .query(&mut cluster_node(p))
            .unwrap()
    };
    let setslot = |on: u16, state: &str, node: &str| {
        let () = redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg(state)
            .arg(node)
            .query(&mut cluster_node(on))
            .unwrap();
    };
    setslot(to, "IMPORTING", &id(from));
    setslot(from, "MIGRATING", &id(to));
    let in_slot: Vec<String> = redis::cmd("CLUSTER")
        .arg("GETKEYSINSLOT")
        .arg(slot)
        .arg(1000)
        .query(&mut cluster_node(from))
        .unwrap();
    assert!(
        in_slot.contains(&key),
        "the delete never reached the server"
    );
    let () = redis::cmd("MIGRATE")
        .arg("127.0.0.1")
        .arg(to)
        .arg("")
        .arg(0)
        .arg(5000)
        .arg("KEYS")
        .arg(&in_slot)
        .query(&mut cluster_node(from))
        .unwrap();
    let finish = || {
        for (p, _) in &masters {
            setslot(*p, "NODE", &id(to));
        }
    };
    if let SlotMove::Done = how {
        finish();
    }

    // The next call on the old master replays the delete first: it is redirected there.
    let got = front.get("k").unwrap();
    let stats = front.stats();
    assert_eq!(
        got, None,
        "{how:?}: k was deleted (queued for replay), then served from the slot's new master \
         ({stats:?})"
    );
    assert_eq!(stats.replayed_deletes, 1, "{how:?}: {stats:?}");
    if let SlotMove::Migrating = how {
        finish();
    }
}

#[cfg(feature = "redis")]
#[test]
fn redis_cluster_a_delete_missed_before_its_slot_moved_is_replayed_where_the_key_went() {
    let cluster = crate::fixture::RedisCluster::start("redis-server");
    for how in [SlotMove::Done, SlotMove::Migrating] {
        redis_cluster_replay_after_a_slot_move(&cluster, false, how);
    }
}

#[cfg(feature = "redis")]
#[test]
fn redis_cluster_a_delete_missed_before_its_slot_moved_is_replayed_where_the_key_went_async() {
    let cluster = crate::fixture::RedisCluster::start("redis-server");
    for how in [SlotMove::Done, SlotMove::Migrating] {
        redis_cluster_replay_after_a_slot_move(&cluster, true, how);
    }
}

/// A whole cluster down (Redis's default `cluster-require-full-coverage yes`, one slot left
/// unassigned: every node answers `CLUSTERDOWN The cluster is down` to every key) does not
/// serve a key this process deleted meanwhile once it is back: the refused delete, absorbed
/// by the write policy, is queued for replay as one a server loading its data refused, and
/// replayed when the cluster serves again. (A slot alone unserved, `Hash slot not served`,
/// fails its own keys and is not recorded: see the docs.)
#[cfg(feature = "redis")]
fn redis_cluster_down_then_back(asynch: bool) {
    let cluster = crate::fixture::RedisCluster::start("redis-server");
    let b = Cache::builder()
        .redis_cluster(cluster.seeds())
        .write_failures(FailurePolicy::Absorb);
    let front = Front::build(outage_settings(b, "outage-cluster-down"), asynch);
    front.set("k", "old").unwrap();
    let key = front.make_key("k");
    let masters = cluster.masters();
    let slot_of = |k: &str| -> u16 {
        redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(k)
            .query(&mut cluster_node(masters[0].0))
            .unwrap()
    };
    // Another slot than k's, unassigned on every node: the cluster is down.
    let hole = (slot_of(&key) + 1) % 16_384;
    let owner = masters
        .iter()
        .find(|(_, r)| r.iter().any(|&(a, b)| (a..=b).contains(&hole)))
        .map(|(p, _)| *p)
        .unwrap();
    for &p in &cluster.ports {
        let () = redis::cmd("CLUSTER")
            .arg("DELSLOTS")
            .arg(hole)
            .query(&mut cluster_node(p))
            .unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let down = |p: u16| {
        matches!(
            redis::cmd("GET").arg(&key).query::<Option<Vec<u8>>>(&mut cluster_node(p)),
            Err(e) if e.code() == Some("CLUSTERDOWN")
        )
    };
    while !masters.iter().all(|(p, _)| down(*p)) {
        assert!(Instant::now() < deadline, "the cluster never went down");
        thread::sleep(MS(50));
    }
    // Absorbed: the caller is told nothing.
    front.delete("k").unwrap();
    // The slot assigned again: the cluster serves again, k's old value with it.
    let () = redis::cmd("CLUSTER")
        .arg("ADDSLOTS")
        .arg(hole)
        .query(&mut cluster_node(owner))
        .unwrap();
    crate::fixture::wait_cluster_ok(&cluster.ports, Duration::from_secs(30));
    let got = front.get("k").unwrap();
    let stats = front.stats();
    assert_eq!(
        got, None,
        "k was deleted while the cluster was down, and is served once it is back ({stats:?})"
    );
    assert_eq!(stats.replayed_deletes, 1, "{stats:?}");
}

#[cfg(feature = "redis")]
#[test]
fn redis_cluster_a_delete_refused_while_the_cluster_was_down_is_replayed_once_it_is_back() {
    redis_cluster_down_then_back(false);
}

#[cfg(feature = "redis")]
#[test]
fn redis_cluster_a_delete_refused_while_the_cluster_was_down_is_replayed_once_it_is_back_async() {
    redis_cluster_down_then_back(true);
}
