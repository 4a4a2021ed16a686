//! A server at `maxclients` is a failed connect, not a refused database or password: a delete it
//! refused is replayed; a missing database is named by the async view too; cluster batches whose
//! slot-map refresh or stale connections meet hung masters last about one `connect_timeout`.

use std::time::{Duration, Instant};

use newcache::{Cache, FailurePolicy};

use crate::fixture::{RedisCluster, RedisServer, unique_flavor};
use crate::redis::{on_both, runtime};
use crate::redis_cluster::{keys_on_masters, no_failover, node};

const S: fn(u64) -> Duration = Duration::from_secs;
const MS: fn(u64) -> Duration = Duration::from_millis;

fn admin(server: &RedisServer) -> redis::Connection {
    redis::Client::open(server.url())
        .and_then(|c| c.get_connection_with_timeout(S(5)))
        .unwrap()
}

/// Sets the server's `maxclients` to `n` on the admin connection `a`.
pub(crate) fn maxclients(a: &mut redis::Connection, n: u32) {
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxclients")
        .arg(n)
        .query(a)
        .unwrap();
}

/// A server at `maxclients` writes `-ERR max number of clients reached` on accept, before any
/// command, and closes the connection: the reply comes as the answer to the set-up's first
/// command (`SELECT` with database 3, `CLIENT INFO` with 0). The delete it refused never
/// reached the server, so it is queued for replay, sync and async, on Redis and Valkey; and the
/// error does not blame the database. Giving the sync `SELECT`'s error the reply as its
/// source made it "answered" (`mod.rs::answered`): the delete was not queued and the
/// old value survived.
#[test]
fn a_delete_refused_at_maxclients_is_replayed_and_not_blamed_on_the_database() {
    on_both(|server| {
        let flavor = unique_flavor("r9-maxclients");
        let url = |db: u32| server.url().replace("/0", &format!("/{db}"));
        let build = |db: u32| {
            Cache::builder()
                .redis(url(db))
                .flavor(flavor.as_str())
                .read_failures(FailurePolicy::Propagate)
                .write_failures(FailurePolicy::Propagate)
        };
        let mut a = admin(server);
        let rt = runtime();
        let mut outcome = Vec::new();
        for db in [0, 3] {
            for sync in [true, false] {
                let key = format!("k-{sync}");
                build(db).build().unwrap().set(&key, &1u32, S(600)).unwrap();
                std::thread::sleep(MS(200)); // the writer's connection closed
                maxclients(&mut a, 1); // the admin connection is the one
                let (e, after) = if sync {
                    let cache = build(db).build().unwrap();
                    let e = cache.delete(&key).unwrap_err();
                    maxclients(&mut a, 10_000);
                    (e, cache.get::<u32>(&key))
                } else {
                    let cache = build(db).build_async().unwrap();
                    rt.block_on(async {
                        let e = cache.delete(&key).await.unwrap_err();
                        maxclients(&mut a, 10_000);
                        (e, cache.get::<u32>(&key).await)
                    })
                };
                eprintln!("db {db}, sync {sync}: delete: {e}\n      get after: {after:?}");
                outcome.push((db, sync, e, after));
            }
        }
        for (db, sync, e, after) in &outcome {
            assert!(
                matches!(after, Ok(None)),
                "db {db}, sync {sync}: the delete refused at maxclients was lost (not queued \
                 for replay): {after:?} ({e})"
            );
            assert!(
                !e.to_string().contains("refused the URL's database"),
                "db {db}, sync {sync}: a server at maxclients reported as lacking the \
                 database: {e}"
            );
        }
    });
}

/// The async view names a missing database as the sync one does.
#[test]
fn a_missing_database_is_named_by_the_async_view_too() {
    on_both(|server| {
        let cache = Cache::builder()
            .redis(server.url().replace("/0", "/99"))
            .flavor(unique_flavor("r9-db-async"))
            .read_failures(FailurePolicy::Propagate)
            .build_async()
            .unwrap();
        let e = runtime().block_on(cache.get::<u32>("k")).unwrap_err();
        assert!(
            e.to_string().contains("refused the URL's database 99"),
            "{e}"
        );
    });
}

/// The failed masters' map refresh asks the other masters first, a hung one too (it is not
/// known to have failed): a batch over one hung master whose refresh meets another hung
/// master lasts two `connect_timeout`s, where the docs say "about one `connect_timeout` plus
/// one `io_timeout` however many masters hang".
#[test]
fn a_batch_whose_refresh_meets_another_hung_master_lasts_about_one_connect_timeout() {
    let cluster = RedisCluster::start("redis-server");
    no_failover(&cluster);
    for &p in &cluster.ports {
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("cluster-require-full-coverage")
            .arg("no")
            .arg("cluster-allow-reads-when-down")
            .arg("yes")
            .query(&mut node(p))
            .unwrap();
    }
    let flavor = unique_flavor("r9-refresh");
    let (ct, io) = (S(2), MS(300));
    let cache_of = |seeds: Vec<String>| {
        Cache::builder()
            .redis_cluster(seeds)
            .flavor(flavor.as_str())
            .read_failures(FailurePolicy::Propagate)
            .failure_limit(100)
            .io_timeout(io)
            .connect_timeout(ct)
            .build()
            .unwrap()
    };
    let keys = keys_on_masters(&cluster, &cache_of(cluster.seeds()));
    // Map order: the order a refresh asks the masters in.
    let order: Vec<u16> = cluster.masters().iter().map(|(p, _)| *p).collect();
    let key_of = |p: u16| keys.iter().find(|(q, _)| *q == p).unwrap().1.clone();
    let (first, hung, live) = (order[0], order[1], order[2]);
    let (kh, kl) = (key_of(hung), key_of(live));
    let cache = cache_of(vec![format!("redis://127.0.0.1:{live}")]);
    assert_eq!(cache.get::<u32>(&kl).unwrap(), Some(1)); // the map, a connection to `live`
    // `first` holds none of the batch's keys; `hung` holds one. Both hang.
    cluster.signal(first, "STOP");
    cluster.signal(hung, "STOP");
    let t = Instant::now();
    let r = cache.get_many::<u32>(&[kh.as_str(), kl.as_str()]);
    let took = t.elapsed();
    cluster.signal(first, "CONT");
    cluster.signal(hung, "CONT");
    eprintln!("order {order:?}: took {took:?}: {r:?}");
    let bound = ct + io + MS(800);
    assert!(
        took < bound,
        "a batch over one hung master (another hung master in the cluster; connect_timeout \
         {ct:?}, io_timeout {io:?}) took {took:?}, past the documented ~connect_timeout + \
         io_timeout: {r:?}"
    );
}

/// A read whose pooled connection is found closed is sent again on a fresh connection: in a
/// batch that connect takes a whole `connect_timeout` (`checkout(None)`), not what is left of
/// the batch's shared one, and its reply a whole `io_timeout`, not the window's; counting
/// that connect as reading time would move the connects' deadline on by it. Two masters
/// whose connections were closed (a restart, a proxy's idle timeout) and that then hang cost
/// a batch two `connect_timeout`s.
#[test]
fn a_batch_whose_stale_connections_meet_hung_masters_lasts_about_one_connect_timeout() {
    let cluster = RedisCluster::start("redis-server");
    no_failover(&cluster);
    for &p in &cluster.ports {
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("cluster-require-full-coverage")
            .arg("no")
            .arg("cluster-allow-reads-when-down")
            .arg("yes")
            .query(&mut node(p))
            .unwrap();
    }
    let flavor = unique_flavor("r9-stale");
    let (ct, io) = (S(2), MS(300));
    let cache = Cache::builder()
        .redis_cluster(cluster.seeds())
        .flavor(flavor.as_str())
        .read_failures(FailurePolicy::Propagate)
        .failure_limit(100)
        .retry_interval(S(600))
        .io_timeout(io)
        .connect_timeout(ct)
        .build()
        .unwrap();
    let keys = keys_on_masters(&cluster, &cache);
    let names: Vec<&str> = keys.iter().map(|(_, k)| k.as_str()).collect();
    // A pooled connection to every master.
    assert_eq!(cache.get_many::<u32>(&names).unwrap().len(), 3);
    let (a, b) = (keys[0].0, keys[1].0);
    for p in [a, b] {
        let _: redis::Value = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("normal")
            .query(&mut node(p))
            .unwrap();
    }
    std::thread::sleep(MS(200));
    cluster.signal(a, "STOP");
    cluster.signal(b, "STOP");
    let t = Instant::now();
    let r = cache.get_many::<u32>(&names);
    let took = t.elapsed();
    cluster.signal(a, "CONT");
    cluster.signal(b, "CONT");
    eprintln!("took {took:?}: {r:?}");
    let bound = ct + io + MS(800);
    assert!(
        took < bound,
        "a batch over two hung masters whose pooled connections were closed took {took:?}, \
         past the documented ~connect_timeout ({ct:?}) + io_timeout ({io:?}): {r:?}"
    );
}

/// At `maxclients` behind a password, the refusal comes as `AUTH`'s reply: a delete it refused
/// is replayed, and the credentials are not blamed.
#[test]
fn a_delete_refused_at_maxclients_behind_a_password_is_replayed() {
    let server = RedisServer::start_with("redis-server", &["--requirepass", "pw"]);
    let url = server.url().replace("redis://", "redis://:pw@");
    let mut a = redis::Client::open(url.as_str())
        .and_then(|c| c.get_connection_with_timeout(S(5)))
        .unwrap();
    let flavor = unique_flavor("r9-maxclients-pw");
    let build = || {
        Cache::builder()
            .redis(url.as_str())
            .flavor(flavor.as_str())
            .read_failures(FailurePolicy::Propagate)
            .write_failures(FailurePolicy::Propagate)
    };
    let rt = runtime();
    for sync in [true, false] {
        let key = format!("k-{sync}");
        build().build().unwrap().set(&key, &1u32, S(600)).unwrap();
        std::thread::sleep(MS(200));
        maxclients(&mut a, 1);
        let (e, after) = if sync {
            let cache = build().build().unwrap();
            let e = cache.delete(&key).unwrap_err();
            maxclients(&mut a, 10_000);
            (e, cache.get::<u32>(&key))
        } else {
            let cache = build().build_async().unwrap();
            rt.block_on(async {
                let e = cache.delete(&key).await.unwrap_err();
                maxclients(&mut a, 10_000);
                (e, cache.get::<u32>(&key).await)
            })
        };
        eprintln!("sync {sync}: delete: {e}\n      get after: {after:?}");
        assert!(!e.is_denied(), "sync {sync}: {e}");
        assert!(matches!(after, Ok(None)), "sync {sync}: {after:?} ({e})");
    }
}
