//! Adversarial review (round 6) of the Redis batcher's FLIGHTS (d2f83e0) and the cluster
//! batch's reserved checks, `LATE` floor and `starved` connects (b471e03).

use std::time::{Duration, Instant};

use newcache::{Cache, FailurePolicy};

use crate::fixture::{RedisCluster, unique_flavor};
use crate::redis_cluster::{keys_on_masters, master_of, no_failover, slot_of};

const S: fn(u64) -> Duration = Duration::from_secs;
const MS: fn(u64) -> Duration = Duration::from_millis;

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

/// Finding (the same cause, seen from a failover): a batch's connect timeout to a master that
/// hung is `Failure::Local` (`conn::starved`), so `Round::judge` neither lists the node as
/// failed (no map refresh: `after_failures` wants a fault) nor reroutes its items (`reroute`
/// wants `is_unsent() && is_fault`). After the cluster promotes the hung master's replica, a
/// process that talks to that slot range only in batches, and holds no pooled connection to
/// the old master, keeps sending them to the old master: every batch fails its keys and pays
/// `connect_timeout`, however long after the failover. Before b471e03 the first such batch
/// refreshed the map and sent the keys to the new master.
#[test]
fn after_a_hung_master_fails_over_a_sync_batch_finds_the_new_master() {
    let cluster = RedisCluster::start("redis-server");
    let flavor = unique_flavor("r6-failover-batch");
    let cache_of = |seeds: Vec<String>| {
        Cache::builder()
            .redis_cluster(seeds)
            .flavor(flavor.as_str())
            .write_failures(FailurePolicy::Propagate)
            .io_timeout(S(1))
            .connect_timeout(S(1))
            .build()
            .unwrap()
    };
    let settler = cache_of(cluster.seeds());
    let keys = keys_on_masters(&cluster, &settler);
    drop(settler);
    let (hung, kh) = keys[0].clone();
    let (other, ko) = keys[2].clone();
    // The map is learned (from `other`); no connection to `hung` yet.
    let cache = cache_of(vec![format!("redis://127.0.0.1:{other}")]);
    assert_eq!(cache.get::<u32>(&ko).unwrap(), Some(1));
    let slot = slot_of(other, &cache.make_key(&kh));
    cluster.signal(hung, "STOP");
    // The cluster promotes `hung`'s replica (node timeout 2 s).
    let deadline = Instant::now() + S(40);
    let promoted = loop {
        if let Some(masters) = cluster.try_masters() {
            let now = master_of(&masters, slot);
            if now != hung {
                break now;
            }
        }
        assert!(Instant::now() < deadline, "no failover of {hung}");
        std::thread::sleep(MS(300));
    };
    let mut tries = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        let r = cache.set_many([(kh.as_str(), &2u32), (ko.as_str(), &2u32)], S(600));
        let ok = r.as_ref().is_ok_and(|f| f.is_empty());
        tries.push((t.elapsed(), r));
        if ok {
            break;
        }
    }
    cluster.signal(hung, "CONT");
    eprintln!("hung {hung}, promoted {promoted}: {tries:?}");
    assert!(
        tries.last().unwrap().1.as_ref().is_ok_and(|f| f.is_empty()),
        "three batches after {promoted} took over {hung}'s slots, {kh} still failed: the \
         batches' connect timeouts to {hung} counted no fault, so no map refresh and no \
         reroute: {tries:?}"
    );
}

/// Coverage: batches over every master from several threads, each pool one connection, the
/// connections idle past `CHECK_AFTER` between rounds (so each reservation writes a `PING`
/// check): reservations taken in address order never wait for each other in a cycle, and no
/// check's reply is read as a later command's (every value read back is the one written).
#[test]
fn concurrent_sync_batches_reserving_checked_connections_on_every_master_neither_deadlock_nor_desync()
 {
    let cluster = RedisCluster::start("redis-server");
    let cache = Cache::builder()
        .redis_cluster(cluster.seeds())
        .flavor(unique_flavor("r6-reserve-order").as_str())
        .write_failures(FailurePolicy::Propagate)
        .read_failures(FailurePolicy::Propagate)
        .pool_size(1)
        .io_timeout(S(2))
        .connect_timeout(S(2))
        .build()
        .unwrap();
    let keys = keys_on_masters(&cluster, &cache);
    let keys: Vec<String> = keys.into_iter().map(|(_, k)| k).collect();
    let started = Instant::now();
    std::thread::scope(|s| {
        for t in 0..4u32 {
            let (cache, keys) = (&cache, &keys);
            s.spawn(move || {
                for round in 0..15u32 {
                    // Idle past CHECK_AFTER (100 ms): the next writes check first.
                    std::thread::sleep(MS(120 + u64::from(t) * 7));
                    let v = t * 1000 + round;
                    // Keys of this thread (a suffix) on each master's slots: hash tags keep
                    // them there.
                    let mine: Vec<String> = keys.iter().map(|k| format!("{{{k}}}-{t}")).collect();
                    let items: Vec<(&str, &u32)> = mine.iter().map(|k| (k.as_str(), &v)).collect();
                    let failed = cache.set_many(items, S(600)).unwrap();
                    assert!(failed.is_empty(), "{failed:?}");
                    let got = cache
                        .get_many::<u32>(&mine.iter().map(String::as_str).collect::<Vec<_>>())
                        .unwrap();
                    for k in &mine {
                        assert_eq!(got.get(k.as_str()).copied(), Some(v), "{k} in {got:?}");
                    }
                }
            });
        }
    });
    let took = started.elapsed();
    assert!(took < S(30), "{took:?}");
}
