//! What only the Redis backend has, on Debian's Redis 7 and Valkey 9, each on a server of the
//! test's own: faults (a killed, hung and restarted server), `clear` by the cache's prefix,
//! values another client wrote, the eviction policy check. The behaviour, herd, limits, loader,
//! values and obs suites run on both servers through `on_every_backend!`.

use std::time::{Duration, Instant};

use newcache::{Cache, DecodePolicy};

use crate::fixture::{RedisServer, unique_flavor, valkey_server};

const S: fn(u64) -> Duration = Duration::from_secs;

/// Runs `test` on a Redis 7 of its own, then on a Valkey 9 of its own.
fn on_both(test: impl Fn(&mut RedisServer)) {
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

fn raw(server: &RedisServer) -> redis::Connection {
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
        // Two transport faults mark it dead (failure_limit 2); then calls fail fast.
        for _ in 0..2 {
            assert!(cache.set("k", &2u32, S(60)).unwrap_err().is_backend());
        }
        let started = Instant::now();
        let e = cache.set("k", &2u32, S(60)).unwrap_err();
        assert!(e.is_backend(), "{e}");
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
        // A generous bound: one io_timeout (300 ms), not a hang.
        assert!(started.elapsed() < S(3), "{:?}", started.elapsed());
        server.signal("CONT");
        let deadline = Instant::now() + S(10);
        loop {
            match cache.get::<u32>("k") {
                Ok(v) => {
                    // The timed-out set may have landed after all.
                    assert!(matches!(v, Some(1 | 2)), "{v:?}");
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
