//! What a user reads when the configuration or a server is wrong: the first warning names the
//! real fix, each cause is said once along an error's chain, and a write a server may have
//! missed says what its replay will do. On Redis 7, Valkey 9 and memcached, sync and async.

use std::time::Duration;

use newcache::{Cache, CacheBuilder, FailurePolicy};

use crate::fixture::{RedisServer, free_port, unique_flavor, valkey_server};
use crate::front::{BuildFor, Front};
use crate::obs::logs_at;

const MIN: Duration = Duration::from_secs(60);

/// Each level of `e`'s chain, as a reporter that walks `source()` prints them.
fn chain(e: &dyn std::error::Error) -> Vec<String> {
    let mut out = vec![e.to_string()];
    let mut cur = e.source();
    while let Some(s) = cur {
        out.push(s.to_string());
        cur = s.source();
    }
    out
}

/// `e`'s chain says `cause` once, and no level repeats another.
#[track_caller]
fn says_once(e: &dyn std::error::Error, cause: &str) {
    let levels = chain(e);
    let whole = levels.join(": ");
    assert_eq!(whole.matches(cause).count(), 1, "{levels:#?}");
    for (i, a) in levels.iter().enumerate() {
        for b in &levels[i + 1..] {
            assert!(!a.contains(b.as_str()), "{b:?} is said twice: {levels:#?}");
        }
    }
}

/// A builder that shows every failure to the caller.
fn propagating(b: CacheBuilder, tag: &str) -> CacheBuilder {
    b.flavor(unique_flavor(tag))
        .read_failures(FailurePolicy::Propagate)
        .write_failures(FailurePolicy::Propagate)
}

fn redis_bins() -> [String; 2] {
    ["redis-server".to_owned(), valkey_server()]
}

/// A URL without the password a `requirepass` server wants: the first warning is about the
/// password (NOAUTH), not about the grants of `CLIENT`, which the server refused for the same
/// reason.
#[test]
fn a_missing_password_is_the_first_warning() {
    for bin in redis_bins() {
        let server = RedisServer::start_with(&bin, &["--requirepass", "x"]);
        for front in [Front::Sync, Front::Async] {
            let logs = logs_at(tracing::Level::WARN, || {
                let cache = Cache::builder()
                    .redis(server.url())
                    .flavor(unique_flavor("no-password"))
                    .build_front(front);
                let _ = cache.get::<u32>("k");
                let e = cache.set("k", &1u32, MIN).unwrap_err();
                assert!(e.is_denied() && e.to_string().contains("NOAUTH"), "{e}");
                let _ = cache.delete("k");
            });
            let first = logs.lines().next().unwrap_or_default();
            assert!(
                first.contains("NOAUTH") && first.contains("password"),
                "{bin} {front:?}: {logs}"
            );
            assert!(!logs.contains("CLIENT"), "{bin} {front:?}: {logs}");
        }
    }
}

/// A connect refused (nothing listens on the port): "Connection refused" once on every
/// error's chain and in `ping()`'s message.
#[test]
fn a_refused_connect_is_said_once() {
    let addr = format!("127.0.0.1:{}", free_port());
    let redis = Cache::builder().redis(format!("redis://{addr}/0"));
    let memcached = Cache::builder().memcached([addr.as_str()]);
    for (name, b) in [("redis", redis), ("memcached", memcached)] {
        for front in [Front::Sync, Front::Async] {
            let cache = propagating(b.clone(), "refused").build_front(front);
            let get = cache.get::<u32>("k").unwrap_err();
            let set = cache.set("k", &1u32, MIN).unwrap_err();
            let delete = cache.delete("k").unwrap_err();
            assert!(delete.last_fault().is_some(), "{name} {front:?}: {delete}");
            for e in [&get, &set, &delete] {
                says_once(e, "Connection refused");
            }
            let ping = cache.ping().unwrap_err();
            says_once(&ping, "Connection refused");
        }
    }
}

/// A URL's database the server does not have: the server's reply said once, after what to
/// fix.
#[test]
fn a_missing_database_is_said_once() {
    for bin in redis_bins() {
        let server = RedisServer::start(&bin);
        let url = server.url().replace("/0", "/99");
        for front in [Front::Sync, Front::Async] {
            let cache =
                propagating(Cache::builder().redis(url.as_str()), "db99").build_front(front);
            let e = cache.get::<u32>("k").unwrap_err();
            assert!(
                e.to_string().contains("database 99"),
                "{bin} {front:?}: {e}"
            );
            says_once(&e, "DB index is out of range");
            let ping = cache.ping().unwrap_err();
            says_once(&ping, "DB index is out of range");
        }
    }
}

/// A `set` to a server never reached: its error says what "queued for replay" means for the
/// key (deleted there before anything else once the server is back, so the value the write
/// was to replace is never served).
#[test]
fn a_write_that_missed_its_server_says_what_its_replay_does() {
    let addr = format!("127.0.0.1:{}", free_port());
    let redis = Cache::builder().redis(format!("redis://{addr}/0"));
    let memcached = Cache::builder().memcached([addr.as_str()]);
    for (name, b) in [("redis", redis), ("memcached", memcached)] {
        for front in [Front::Sync, Front::Async] {
            let cache = propagating(b.clone(), "replay").build_front(front);
            let e = cache.set("k", &1u32, MIN).unwrap_err();
            let said = e.to_string();
            for part in [
                "may not have reached",
                "queued for replay",
                "deleted there before anything else is sent",
                "never serves the value this write was to replace",
            ] {
                assert!(said.contains(part), "{name} {front:?}: {said}");
            }
            says_once(&e, "Connection refused");
        }
    }
}

/// `build()`'s log line names the servers the cache will reach, so a wrong `REDIS_URL` shows
/// at start-up; never a URL's password.
#[test]
fn the_build_log_names_the_servers_without_the_password() {
    let builders = [
        (
            Cache::builder().redis("redis://app:s3cret@10.1.2.3:6380/2"),
            "10.1.2.3:6380",
        ),
        (
            Cache::builder().redis_cluster([
                "redis://app:s3cret@10.1.2.3:7000",
                "redis://app:s3cret@10.1.2.4:7001",
            ]),
            "10.1.2.3:7000,10.1.2.4:7001",
        ),
        (
            Cache::builder().memcached(["10.1.2.3:11211", "memcache://10.1.2.4:11212"]),
            "10.1.2.3:11211,10.1.2.4:11212",
        ),
    ];
    for (b, servers) in builders {
        let logs = logs_at(tracing::Level::INFO, || {
            b.clone().build().unwrap();
            let _rt = crate::front::runtime().enter();
            b.build_async().unwrap();
        });
        let built: Vec<&str> = logs.lines().filter(|l| l.contains("built")).collect();
        assert_eq!(built.len(), 2, "{logs}");
        for line in built {
            assert!(line.contains(servers), "{servers}: {line}");
            assert!(!line.contains("s3cret"), "{line}");
        }
    }
}
