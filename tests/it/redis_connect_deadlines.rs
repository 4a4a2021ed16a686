//! Connect deadlines under a hung server: a healthy master whose check a hung connect starved
//! counts no fault, a hung server's connect with a password and a database costs one
//! `connect_timeout`, and a redirect round after a slow read still has its connect deadline.

use std::time::{Duration, Instant};

use newcache::{Cache, FailurePolicy};

use crate::fixture::{RedisCluster, RedisServer, unique_flavor};
use crate::redis_cluster::{keys_on_masters, no_failover, node};

const S: fn(u64) -> Duration = Duration::from_secs;
const MS: fn(u64) -> Duration = Duration::from_millis;

/// Keeps the node on `port` busy for `busy` (a Lua loop), starting after `after`.
fn busy_node(port: u16, after: Duration, busy: Duration) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        std::thread::sleep(after);
        let _: redis::RedisResult<i64> = redis::cmd("EVAL")
            .arg(
                "local s = redis.call('TIME') local t0 = s[1] * 1000000 + s[2] \
                 while true do local n = redis.call('TIME') \
                 if n[1] * 1000000 + n[2] - t0 > tonumber(ARGV[1]) then break end end return 1",
            )
            .arg(0)
            .arg(busy.as_micros() as u64)
            .query(&mut node(port));
    })
}

/// A healthy master asked after a hung one whose fresh connect spent the batch's deadline has
/// its pooled connection's check (`PING`) written only then, and `LATE` to read its reply: a
/// moment's busyness fails its part, and counts no fault against it (as a connect begun that
/// late counts none).
#[test]
fn a_healthy_master_whose_check_a_hung_connect_starved_counts_no_fault() {
    let cluster = RedisCluster::start("redis-server");
    no_failover(&cluster);
    let flavor = unique_flavor("r7-starved-check");
    let cache_of = |seeds: Vec<String>| {
        Cache::builder()
            .redis_cluster(seeds)
            .flavor(flavor.as_str())
            .write_failures(FailurePolicy::Propagate)
            .failure_limit(1)
            .retry_interval(S(600))
            .io_timeout(S(5))
            .connect_timeout(S(1))
            .build()
            .unwrap()
    };
    let keys = keys_on_masters(&cluster, &cache_of(cluster.seeds()));
    let [(hung, kh), (busy, kb), (other, ko)] = <[_; 3]>::try_from(keys).unwrap();
    // The map learned from `other`; a pooled connection to `busy`, none to `hung`.
    let cache = cache_of(vec![format!("redis://127.0.0.1:{other}")]);
    assert_eq!(cache.get::<u32>(&ko).unwrap(), Some(1));
    cache.set(&kb, &1u32, S(600)).unwrap();
    std::thread::sleep(MS(400)); // idle past CHECK_AFTER: a write checks it first
    cluster.signal(hung, "STOP");
    // `busy` is reached at ~1 s (after the hung connect), inside its 1 s of work.
    let script = busy_node(busy, MS(500), S(1));
    let r = cache.set_many([(kh.as_str(), &2u32), (kb.as_str(), &2u32)], S(600));
    script.join().unwrap();
    cluster.signal(hung, "CONT");
    assert!(r.is_err(), "the hung master's key failed: {r:?}");
    crate::fixture::wait_cluster_ok(&cluster.ports, S(30));
    let after = cache.set(&kb, &3u32, S(600));
    assert!(
        after.is_ok(),
        "a set to the healthy master {busy} failed ({after:?}): its check, written after the \
         hung master's connect spent the deadline and given LATE, was counted a fault"
    );
}

/// With a password and a database other than 0, a blocking connect's set-up sends two
/// commands (`AUTH`, `SELECT`); a hung server still costs it one `connect_timeout`, not one
/// per command.
#[test]
fn a_hung_server_with_password_and_db_costs_one_connect_timeout() {
    let server = RedisServer::start_with("redis-server", &["--requirepass", "pw"]);
    let url = server
        .url()
        .replace("redis://", "redis://:pw@")
        .replace("/0", "/1");
    let cache = Cache::builder()
        .redis(url)
        .flavor(unique_flavor("r7-auth-db"))
        .read_failures(FailurePolicy::Propagate)
        .connect_timeout(S(2))
        .io_timeout(S(20))
        .build()
        .unwrap();
    server.signal("STOP");
    let started = Instant::now();
    let e = cache.get::<u32>("k").unwrap_err();
    let took = started.elapsed();
    server.signal("CONT");
    assert!(e.is_timeout(), "{e}");
    assert!(took < S(2) + MS(1500), "{took:?}: {e}");
    assert_eq!(cache.get::<u32>("k").unwrap(), None);
}

/// A batch's time reading replies does not count against its connects' deadline: an item an
/// `ASK` sends to a node not yet asked, after a round that outlasted the first deadline
/// reading a slow master's replies, still has the `connect_timeout` the round's connects left
/// (none spent here), not `LATE` (a busy moment of that node no longer fails it).
#[test]
fn a_redirect_round_after_a_slow_read_still_has_its_connect_deadline() {
    let cluster = RedisCluster::start("redis-server");
    no_failover(&cluster);
    let flavor = unique_flavor("r7-round-deadline");
    let cache_of = |seeds: Vec<String>| {
        Cache::builder()
            .redis_cluster(seeds)
            .flavor(flavor.as_str())
            .read_failures(FailurePolicy::Propagate)
            .retry_interval(S(600))
            .io_timeout(S(5))
            .connect_timeout(S(1))
            .build()
            .unwrap()
    };
    let keys = keys_on_masters(&cluster, &cache_of(cluster.seeds()));
    let [(slow, ks), (busy, _), (other, ko)] = <[_; 3]>::try_from(keys).unwrap();
    // The map learned from `other`; a pooled connection to `slow`, none to `busy`.
    let cache = cache_of(vec![format!("redis://127.0.0.1:{other}")]);
    // `ko`'s slot half moved to `busy`, `ko` with it: `other` answers `ASK`.
    let slot = crate::redis_cluster::slot_of(other, &cache.make_key(&ko));
    crate::redis_cluster::begin_migration(slot, other, busy);
    crate::redis_cluster::migrate(other, busy, &[cache.make_key(&ko)]);
    assert_eq!(cache.get::<u32>(&ks).unwrap(), Some(1));
    // `slow` answers round 0 at ~1.2 s (past its connect deadline); `ko` is redirected to
    // `busy` then, inside its 1 s of work (from 0.7 s).
    let slow_script = busy_node(slow, MS(0), MS(1200));
    let busy_script = busy_node(busy, MS(700), S(1));
    std::thread::sleep(MS(50));
    let t = Instant::now();
    let r = cache.get_many::<u32>(&[ks.as_str(), ko.as_str()]);
    let took = t.elapsed();
    slow_script.join().unwrap();
    busy_script.join().unwrap();
    let found = r.unwrap_or_else(|e| panic!("after {took:?}: {e:?}"));
    assert_eq!(
        found.get(ko.as_str()),
        Some(&1),
        "the redirected item was read on {busy}"
    );
    assert_eq!(found.get(ks.as_str()), Some(&1));
}
