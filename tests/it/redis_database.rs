//! The URL's database: the sync pool's own `SELECT` lands in it (RESP3, a password, TLS), a busy
//! server is not reported as lacking it, a user without `SELECT` is told so, a write to a missing
//! database is not queued for replay; also a batch whose `ASK` names a hung master.

use std::time::{Duration, Instant};

use newcache::{Cache, FailurePolicy};

use crate::fixture::{RedisServer, unique_flavor};

const S: fn(u64) -> Duration = Duration::from_secs;
const MS: fn(u64) -> Duration = Duration::from_millis;

fn admin(server: &RedisServer) -> redis::Connection {
    redis::Client::open(server.url())
        .and_then(|c| c.get_connection_with_timeout(S(5)))
        .unwrap()
}

fn exists(admin: &mut redis::Connection, db: i64, key: &str) -> bool {
    let () = redis::cmd("SELECT").arg(db).query(admin).unwrap();
    redis::cmd("EXISTS").arg(key).query::<i64>(admin).unwrap() == 1
}

/// A server busy in a script (past `busy-reply-threshold`) answers `SELECT` with `BUSY`: not
/// a database it lacks. The error should say the server is busy (a refusal of a server not
/// serving yet), not "refused the URL's database".
#[test]
fn a_busy_server_is_not_reported_as_lacking_the_urls_database() {
    let server = RedisServer::start("redis-server");
    let mut a = admin(&server);
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("busy-reply-threshold")
        .arg(50)
        .query(&mut a)
        .unwrap();
    let url = server.url().replace("/0", "/3");
    let cache = Cache::builder()
        .redis(url)
        .flavor(unique_flavor("r8-busy"))
        .read_failures(FailurePolicy::Propagate)
        .write_failures(FailurePolicy::Propagate)
        .build()
        .unwrap();
    let url0 = server.url();
    let cache0 = Cache::builder()
        .redis(url0)
        .flavor(unique_flavor("r8-busy0"))
        .read_failures(FailurePolicy::Propagate)
        .write_failures(FailurePolicy::Propagate)
        .build()
        .unwrap();
    let busy = std::thread::spawn(move || {
        let _: redis::RedisResult<i64> = redis::cmd("EVAL")
            .arg(
                "local s = redis.call('TIME') local t0 = s[1] * 1000000 + s[2] \
                 while true do local n = redis.call('TIME') \
                 if n[1] * 1000000 + n[2] - t0 > 1500000 then break end end return 1",
            )
            .arg(0)
            .query(&mut a);
    });
    std::thread::sleep(MS(300));
    let e = cache.get::<u32>("k").unwrap_err();
    let e0 = cache0.get::<u32>("k").unwrap_err();
    let w = cache.set("k", &1u32, S(60)).unwrap_err();
    busy.join().unwrap();
    eprintln!("db 3: {e}\ndb 0: {e0}\nset db 3: {w}");
    assert!(
        !e.to_string().contains("refused the URL's database"),
        "a busy server reported as lacking database 3: {e} (db 0 says: {e0})"
    );
    // What it is reported as: the server's BUSY (the error's cause), on either database.
    let cause = std::error::Error::source(&e).map(ToString::to_string);
    assert!(
        cause.as_deref().unwrap_or_default().starts_with("BUSY"),
        "{e}: {cause:?}"
    );
    assert!(format!("{e0:?}").contains("BUSY"), "{e0:?}");
}

/// `protocol=resp3` with a password and a database: redis-rs sends `HELLO 3 AUTH`, the pool
/// its own `SELECT`: keys land in the URL's database, and a hung server costs one
/// `connect_timeout`.
#[test]
fn resp3_with_password_and_db_lands_in_the_db_and_a_hung_server_costs_one_connect_timeout() {
    let server = RedisServer::start_with("redis-server", &["--requirepass", "pw"]);
    let url = server
        .url()
        .replace("redis://", "redis://:pw@")
        .replace("/0", "/2")
        + "?protocol=resp3";
    let cache = Cache::builder()
        .redis(url.as_str())
        .flavor(unique_flavor("r8-resp3"))
        .read_failures(FailurePolicy::Propagate)
        .connect_timeout(S(2))
        .io_timeout(S(20))
        .build()
        .unwrap();
    cache.set("k", &1u32, S(60)).unwrap();
    assert_eq!(cache.get::<u32>("k").unwrap(), Some(1));
    let mut a = redis::Client::open(server.url().replace("redis://", "redis://:pw@"))
        .and_then(|c| c.get_connection_with_timeout(S(5)))
        .unwrap();
    assert!(exists(&mut a, 2, &cache.make_key("k")));
    assert!(!exists(&mut a, 0, &cache.make_key("k")));
    let fresh = Cache::builder()
        .redis(url.as_str())
        .flavor(unique_flavor("r8-resp3"))
        .read_failures(FailurePolicy::Propagate)
        .connect_timeout(S(2))
        .io_timeout(S(20))
        .build()
        .unwrap();
    server.signal("STOP");
    let t = Instant::now();
    let e = fresh.get::<u32>("k").unwrap_err();
    let took = t.elapsed();
    server.signal("CONT");
    assert!(e.is_timeout(), "{e}");
    assert!(took < S(2) + MS(1500), "{took:?}: {e}");
}

/// An ACL user without `SELECT` and a database other than 0: a denial, not a fault, and the
/// error names what is missing.
#[test]
fn an_acl_user_without_select_is_denied_clearly() {
    let server = RedisServer::start("redis-server");
    let mut a = admin(&server);
    let () = redis::cmd("ACL")
        .arg(&["SETUSER", "u", "on", ">p", "~*", "+@all", "-select"])
        .query(&mut a)
        .unwrap();
    let url = server
        .url()
        .replace("redis://", "redis://u:p@")
        .replace("/0", "/2");
    let cache = Cache::builder()
        .redis(url.as_str())
        .flavor(unique_flavor("r8-acl"))
        .read_failures(FailurePolicy::Propagate)
        .failure_limit(1)
        .build()
        .unwrap();
    for _ in 0..3 {
        let e = cache.get::<u32>("k").unwrap_err();
        eprintln!("{e}");
        assert!(e.is_denied(), "{e}");
        assert!(!e.to_string().contains("marked dead"), "{e}");
    }
    // The async view too.
    let acache = Cache::builder()
        .redis(url.as_str())
        .flavor(unique_flavor("r8-acl"))
        .read_failures(FailurePolicy::Propagate)
        .failure_limit(1)
        .build_async()
        .unwrap();
    let e = crate::redis::runtime().block_on(async { acache.get::<u32>("k").await.unwrap_err() });
    eprintln!("async: {e}");
}

/// `rediss://` with a database: the rebuilt client keeps the TLS settings, and the keys land
/// in the URL's database.
#[cfg(feature = "redis-tls")]
#[test]
fn rediss_with_a_database_lands_in_it() {
    let (pki, server) = crate::redis_tls::server(false);
    let url = server.url().replace("/0", "/4");
    let cache = Cache::builder()
        .redis(url.as_str())
        .redis_tls(pki.trust())
        .flavor(unique_flavor("r8-tls"))
        .read_failures(FailurePolicy::Propagate)
        .build()
        .unwrap();
    cache.set("k", &5u32, S(60)).unwrap();
    assert_eq!(cache.get::<u32>("k").unwrap(), Some(5));
    let c = redis::Client::build_with_tls(
        server.url(),
        redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(pki.ca_pem_bytes()),
        },
    )
    .unwrap();
    let mut a = c.get_connection_with_timeout(S(5)).unwrap();
    assert!(exists(&mut a, 4, &cache.make_key("k")));
    assert!(!exists(&mut a, 0, &cache.make_key("k")));
}

/// A sync batch over hung masters lasts about one `connect_timeout` plus one `io_timeout`,
/// also when a redirect (`ASK` from a live master) names another hung master: the batch's
/// connects share one `connect_timeout` whatever round they are in (a deadline per round once
/// spent a whole one per round, up to `MAX_REDIRECTS` + 1).
#[test]
fn a_batch_whose_ask_names_a_hung_master_lasts_about_one_connect_timeout() {
    use crate::fixture::RedisCluster;
    use crate::redis_cluster::{begin_migration, keys_on_masters, migrate, no_failover, slot_of};
    let cluster = RedisCluster::start("redis-server");
    no_failover(&cluster);
    // The live master keeps serving its slots while others are down.
    for &p in &cluster.ports {
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("cluster-require-full-coverage")
            .arg("no")
            .arg("cluster-allow-reads-when-down")
            .arg("yes")
            .query(&mut crate::redis_cluster::node(p))
            .unwrap();
    }
    let flavor = unique_flavor("r8-rounds");
    let (ct, io) = (S(3), MS(300));
    let cache_of = |seeds: Vec<String>| {
        Cache::builder()
            .redis_cluster(seeds)
            .flavor(flavor.as_str())
            .read_failures(FailurePolicy::Propagate)
            .failure_limit(100)
            .retry_interval(S(600))
            .io_timeout(io)
            .connect_timeout(ct)
            .build()
            .unwrap()
    };
    let keys = keys_on_masters(&cluster, &cache_of(cluster.seeds()));
    // Map order (the order a refresh asks the masters in).
    let order: Vec<u16> = cluster.masters().iter().map(|(p, _)| *p).collect();
    let key_of = |p: u16| keys.iter().find(|(q, _)| *q == p).unwrap().1.clone();
    let (a, c, b) = (order[0], order[1], order[2]);
    let (ka, kc) = (key_of(a), key_of(c));
    let cache = cache_of(vec![format!("redis://127.0.0.1:{c}")]);
    assert_eq!(cache.get::<u32>(&kc).unwrap(), Some(1)); // the map, a connection to c
    // kc's slot half moved to b, kc with it: c answers ASK -> b.
    let slot = slot_of(c, &cache.make_key(&kc));
    begin_migration(slot, c, b);
    migrate(c, b, &[cache.make_key(&kc)]);
    // a hung; one failed call spends the refresh allowance (asks c, not b).
    cluster.signal(a, "STOP");
    assert!(cache.get::<u32>(&ka).is_err());
    cluster.signal(b, "STOP");
    let t = Instant::now();
    let r = cache.get_many::<u32>(&[ka.as_str(), kc.as_str()]);
    let took = t.elapsed();
    // kc alone: ASK -> hung b (a connect_timeout), rerouted back to c (the map's master),
    // ASK -> b again (what is left of the deadline: LATE).
    let t2 = Instant::now();
    let r2 = cache.get_many::<u32>(&[kc.as_str()]);
    let took_alone = t2.elapsed();
    cluster.signal(a, "CONT");
    cluster.signal(b, "CONT");
    assert!(r.is_err() && r2.is_err(), "{r:?} {r2:?}");
    let bound = ct + io + MS(800);
    assert!(
        took < bound,
        "a batch over two hung masters (connect_timeout {ct:?}, io_timeout {io:?}) took \
         {took:?} (the redirected key alone {took_alone:?}), past the documented \
         ~connect_timeout + io_timeout: {r:?}"
    );
    assert!(
        took_alone < bound,
        "the redirected key alone took {took_alone:?}: {r2:?}"
    );
}

/// A database the server does not have is a configuration error the server answered: a write
/// refused for it did not miss the server, and is not queued for a replay (which could never
/// run: its connect fails the same way).
#[test]
fn a_write_to_a_missing_database_is_not_queued_for_replay() {
    let server = RedisServer::start("redis-server");
    let cache = Cache::builder()
        .redis(server.url().replace("/0", "/99"))
        .flavor(unique_flavor("r8-missing-db"))
        .write_failures(FailurePolicy::Propagate)
        .build()
        .unwrap();
    let e = cache.set("k", &1u32, S(60)).unwrap_err();
    let d = cache.delete("k").unwrap_err();
    eprintln!("set: {e}\ndelete: {d}");
    assert!(!e.to_string().contains("queued for replay"), "{e}");
    assert!(!d.to_string().contains("queued for replay"), "{d}");
}
