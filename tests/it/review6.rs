//! Adversarial review (round 6) of the Redis batcher's FLIGHTS (d2f83e0) and the cluster
//! batch's reserved checks, `LATE` floor and `starved` connects (b471e03).

use std::time::{Duration, Instant};

use newcache::{Cache, FailurePolicy};

use crate::fixture::{RedisCluster, unique_flavor};

const S: fn(u64) -> Duration = Duration::from_secs;
const MS: fn(u64) -> Duration = Duration::from_millis;

/// A connection to the node on `port`.
fn node(port: u16) -> redis::Connection {
    redis::Client::open(format!("redis://127.0.0.1:{port}/"))
        .and_then(|c| c.get_connection_with_timeout(S(5)))
        .expect("a cluster node answers")
}

fn slot_of(port: u16, key: &str) -> u16 {
    redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(key)
        .query(&mut node(port))
        .unwrap()
}

fn master_of(masters: &[(u16, Vec<(u16, u16)>)], slot: u16) -> u16 {
    masters
        .iter()
        .find(|(_, ranges)| ranges.iter().any(|&(a, b)| (a..=b).contains(&slot)))
        .map(|(p, _)| *p)
        .expect("every slot is served")
}

fn no_failover(cluster: &RedisCluster) {
    for &p in &cluster.ports {
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("cluster-replica-no-failover")
            .arg("yes")
            .query(&mut node(p))
            .unwrap();
    }
}

/// A settled cluster's masters in address order, a key of each (as `cache` names it).
fn keys_on_masters(cluster: &RedisCluster, cache: &Cache) -> Vec<(u16, String)> {
    let deadline = Instant::now() + S(20);
    loop {
        let masters = cluster.masters();
        let mut ports: Vec<u16> = masters.iter().map(|(p, _)| *p).collect();
        ports.sort_by_key(|p| format!("127.0.0.1:{p}"));
        let keys: Vec<(u16, String)> = ports
            .iter()
            .map(|&port| {
                let k = (0..)
                    .map(|i| format!("k{i}"))
                    .find(|k| master_of(&masters, slot_of(port, &cache.make_key(k))) == port)
                    .unwrap();
                (port, k)
            })
            .collect();
        let items: Vec<(&str, &u32)> = keys.iter().map(|(_, k)| (k.as_str(), &1u32)).collect();
        if cache.set_many(items, S(600)).is_ok_and(|f| f.is_empty()) {
            return keys;
        }
        assert!(Instant::now() < deadline, "the cluster never settled");
        std::thread::sleep(MS(200));
    }
}

/// Finding: `conn::starved` turns a connect timeout into `Failure::Local` whenever the budget
/// `within(connect_timeout, by)` is below `connect_timeout` — and in a cluster batch it always
/// is, even for the first node (by = batch start + connect_timeout, so by - now is already a
/// few microseconds short). A master that hangs (or whose host is gone: connect timeouts) is
/// then never counted a fault by a batch: not marked dead after `failure_limit`, no map
/// refresh (`after_failures` skips non-faults), and every batch pays its `connect_timeout`
/// again. A lone `set` to the same master (by = None) counts it.
#[test]
fn a_hung_master_asked_first_in_a_sync_batch_still_counts_its_connect_fault() {
    let cluster = RedisCluster::start("redis-server");
    no_failover(&cluster);
    let flavor = unique_flavor("r6-first-hung");
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
    let settler = cache_of(cluster.seeds());
    let keys = keys_on_masters(&cluster, &settler);
    drop(settler);
    let (hung, kh) = keys[0].clone();
    let (other, ko) = keys[2].clone();
    // No connection to `hung` yet: its first is a fresh connect.
    let cache = cache_of(vec![format!("redis://127.0.0.1:{other}")]);
    assert_eq!(cache.get::<u32>(&ko).unwrap(), Some(1));
    cluster.signal(hung, "STOP");
    let t = Instant::now();
    let first = cache.set_many([(kh.as_str(), &2u32), (ko.as_str(), &2u32)], S(600));
    let took_first = t.elapsed();
    let t = Instant::now();
    let second = cache.set_many([(kh.as_str(), &3u32), (ko.as_str(), &3u32)], S(600));
    let took_second = t.elapsed();
    cluster.signal(hung, "CONT");
    eprintln!("hung {hung}: {took_first:?} {first:?}; then {took_second:?} {second:?}");
    assert!(first.is_err(), "{first:?}");
    assert!(second.is_err(), "{second:?}");
    assert!(
        took_second < MS(500),
        "the second batch took {took_second:?} ({second:?}): the hung master's connect timeout \
         in the first batch (it was asked first, with the whole connect_timeout) was not \
         counted as a fault, so with failure_limit(1) it was not marked dead"
    );
}
