//! A Redis Cluster master that hangs, seen by the sync cluster batch: each master's connect and
//! connection check have their own time, a hung master's faults are counted (it is marked dead,
//! the slot map asked again) and a healthy one's are not, and concurrent batches that reserve
//! checked connections on every master neither deadlock nor mix up their replies.

use std::time::{Duration, Instant};

use newcache::{Cache, FailurePolicy};

use crate::fixture::{RedisCluster, unique_flavor};
use crate::redis_cluster::{keys_on_masters, master_of, no_failover, node, slot_of};

const S: fn(u64) -> Duration = Duration::from_secs;
const MS: fn(u64) -> Duration = Duration::from_millis;

/// A sync cluster batch's nodes share one `connect_timeout` (`many`'s `by`), and the
/// `PING` check of a pooled connection idle past 100 ms is bounded by it too
/// (`checkout`: `within(io_timeout, by)`), floored at GRACE = 10 ms. A hung master asked first
/// (address order) spends the whole deadline; a healthy master asked next gets 10 ms for its
/// check, so a moment's busyness (a 1 s script, well inside `io_timeout` = 5 s) fails its part
/// of `set_many` and counts a fault against it, where a lone `set` to it at the same moment
/// waits up to `io_timeout` and succeeds.
#[test]
fn a_healthy_master_behind_a_hung_one_in_a_sync_set_many_gets_its_io_timeout() {
    let cluster = RedisCluster::start("redis-server");
    no_failover(&cluster);
    let cache = Cache::builder()
        .redis_cluster(cluster.seeds())
        .flavor(unique_flavor("r5-shared-deadline").as_str())
        .write_failures(FailurePolicy::Propagate)
        .failure_limit(100)
        .io_timeout(S(5))
        .connect_timeout(S(1))
        .build()
        .unwrap();
    // Pooled connections on both masters, the keys where the test thinks they are (a cluster
    // just created may still be settling its view).
    let deadline = std::time::Instant::now() + S(20);
    let (hung, busy, kh, kb) = loop {
        let masters = cluster.masters();
        // Waves are begun in address order: `hung` first, `busy` after it.
        let mut ports: Vec<u16> = masters.iter().map(|(p, _)| *p).collect();
        ports.sort_by_key(|p| format!("127.0.0.1:{p}"));
        let (hung, busy) = (ports[0], ports[1]);
        let key_on = |port: u16| {
            (0..)
                .map(|i| format!("k{i}"))
                .find(|k| master_of(&masters, slot_of(port, &cache.make_key(k))) == port)
                .unwrap()
        };
        let (kh, kb) = (key_on(hung), key_on(busy));
        let failed = cache.set_many([(kh.as_str(), &1u32), (kb.as_str(), &1u32)], S(600));
        let held = |port: u16, k: &str| {
            redis::cmd("EXISTS")
                .arg(cache.make_key(k))
                .query::<i64>(&mut node(port))
                .ok()
                == Some(1)
        };
        if failed.is_ok_and(|f| f.is_empty()) && held(hung, &kh) && held(busy, &kb) {
            break (hung, busy, kh, kb);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the cluster never settled"
        );
        std::thread::sleep(MS(200));
    };
    // Idle past CHECK_AFTER (100 ms).
    std::thread::sleep(MS(400));
    cluster.signal(hung, "STOP");
    // `busy` runs a 1 s script from 0.5 s to 1.5 s after the batch starts: it is asked (after
    // `hung`'s check has spent the 1 s deadline) at about 1 s, and answers within 0.5 s.
    let script = std::thread::spawn(move || {
        std::thread::sleep(MS(500));
        let _: redis::RedisResult<i64> = redis::cmd("EVAL")
            .arg(
                "local s = redis.call('TIME') local t0 = s[1] * 1000000 + s[2] \
                 while true do local n = redis.call('TIME') \
                 if n[1] * 1000000 + n[2] - t0 > tonumber(ARGV[1]) then break end end return 1",
            )
            .arg(0)
            .arg(1_000_000)
            .query(&mut node(busy));
    });
    let t = std::time::Instant::now();
    let r = cache.set_many([(kh.as_str(), &2u32), (kb.as_str(), &2u32)], S(600));
    eprintln!(
        "hung {hung} {kh}, busy {busy} {kb}: {:?} {r:?}",
        t.elapsed()
    );
    script.join().unwrap();
    cluster.signal(hung, "CONT");
    std::thread::sleep(MS(300));
    eprintln!(
        "after: {kh} = {:?}, {kb} = {:?}",
        cache.get::<u32>(&kh),
        cache.get::<u32>(&kb)
    );
    // Propagate: an error naming the failed keys, "... failed (k0, k3)".
    let failed: Vec<String> = match &r {
        Ok(f) => f.clone(),
        Err(e) => {
            let text = e.to_string();
            let listed = text
                .rsplit_once('(')
                .map_or("", |(_, l)| l.trim_end_matches(')'));
            listed.split(", ").map(str::to_owned).collect()
        }
    };
    assert!(
        failed.contains(&kh),
        "the hung master's key {kh} did not fail: {r:?}"
    );
    assert!(
        !failed.contains(&kb),
        "the healthy master's key {kb} failed ({r:?}): its check had what was left of the \
         hung master's connect_timeout (10 ms), not its io_timeout"
    );
}

/// The same batch on connections not yet open: the hung master's connect spends the batch's
/// `connect_timeout`, and the healthy master asked after it, busy for a moment, fails to connect
/// in the 100 ms left to it. Its keys fail, but that is the batch's deadline, not the server:
/// no fault is counted against it (with `failure_limit(1)` one would mark it dead, and the next
/// `set` to it would fail fast for `retry_interval`).
#[test]
fn a_healthy_master_whose_connect_a_hung_one_starved_counts_no_fault() {
    let cluster = RedisCluster::start("redis-server");
    no_failover(&cluster);
    let flavor = unique_flavor("r5-starved-connect");
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
    let [(hung, kh), (busy, kb), (other, ko)]: [(u16, String); 3] = keys.try_into().unwrap();
    drop(settler);
    // A cache whose map is learned from the third master alone, and which holds no connection
    // to the other two.
    let cache = cache_of(vec![format!("redis://127.0.0.1:{other}")]);
    assert_eq!(
        cache.get::<u32>(&ko).unwrap(),
        Some(1),
        "the map is learned on {other}"
    );
    cluster.signal(hung, "STOP");
    let script = std::thread::spawn(move || {
        std::thread::sleep(MS(500));
        let _: redis::RedisResult<i64> = redis::cmd("EVAL")
            .arg(
                "local s = redis.call('TIME') local t0 = s[1] * 1000000 + s[2] \
                 while true do local n = redis.call('TIME') \
                 if n[1] * 1000000 + n[2] - t0 > tonumber(ARGV[1]) then break end end return 1",
            )
            .arg(0)
            .arg(1_000_000)
            .query(&mut node(busy));
    });
    let r = cache.set_many([(kh.as_str(), &2u32), (kb.as_str(), &2u32)], S(600));
    script.join().unwrap();
    assert!(r.is_err(), "the hung master's key failed: {r:?}");
    cluster.signal(hung, "CONT");
    // The cluster itself may have marked the stopped master failed (node timeout 2 s).
    crate::fixture::wait_cluster_ok(&cluster.ports, S(30));
    // `busy` answers again: a `set` to it is sent, not refused as to a server marked dead.
    let after = cache.set(&kb, &3u32, S(600));
    assert!(
        after.is_ok(),
        "a set to the healthy master {busy} after the batch failed ({after:?}): its starved \
         connect was counted as a fault"
    );
    assert_eq!(cache.get::<u32>(&kb).unwrap(), Some(3));
}

/// The other side of the rule above: a hung master that had (nearly) the whole shared
/// `connect_timeout` for its connect, a healthy master's connect before it, is a fault like any
/// other: with `failure_limit(1)` it is marked dead, and the next call to it fails fast.
#[test]
fn a_hung_master_asked_after_a_quick_connect_still_counts_its_fault() {
    let cluster = RedisCluster::start("redis-server");
    no_failover(&cluster);
    let flavor = unique_flavor("r5-hung-second");
    let cache_of = |seeds: Vec<String>| {
        Cache::builder()
            .redis_cluster(seeds)
            .flavor(flavor.as_str())
            .write_failures(FailurePolicy::Propagate)
            .read_failures(FailurePolicy::Propagate)
            .failure_limit(1)
            .retry_interval(S(600))
            .io_timeout(S(5))
            .connect_timeout(S(1))
            .build()
            .unwrap()
    };
    let settler = cache_of(cluster.seeds());
    let keys = keys_on_masters(&cluster, &settler);
    let [(healthy, k0), (hung, kh), (other, ko)]: [(u16, String); 3] = keys.try_into().unwrap();
    drop(settler);
    // The map learned from the third master alone: the first two need a connect, the healthy
    // one (first in address order) before the hung one.
    let cache = cache_of(vec![format!("redis://127.0.0.1:{other}")]);
    assert_eq!(
        cache.get::<u32>(&ko).unwrap(),
        Some(1),
        "the map is learned on {other}"
    );
    cluster.signal(hung, "STOP");
    let r = cache.set_many([(k0.as_str(), &2u32), (kh.as_str(), &2u32)], S(600));
    let next = cache.get::<u32>(&kh);
    cluster.signal(hung, "CONT");
    let failed = format!("{r:?}");
    assert!(
        failed.contains(&kh) && !failed.contains(&format!("\"{k0}\"")),
        "only the hung master's key fails: {r:?}"
    );
    let e = next.expect_err("the hung master answers nothing");
    assert!(
        e.to_string().contains("marked dead"),
        "the hung master {hung} (after {healthy}'s connect) was not counted a fault: {e}"
    );
}

/// `conn::starved` turns a connect timeout into `Failure::Local` whenever the budget
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

/// Seen from a failover: a batch's connect timeout to a master that
/// hung is `Failure::Local` (`conn::starved`), so `Round::judge` neither lists the node as
/// failed (no map refresh: `after_failures` wants a fault) nor reroutes its items (`reroute`
/// wants `is_unsent() && is_fault`). After the cluster promotes the hung master's replica, a
/// process that talks to that slot range only in batches, and holds no pooled connection to
/// the old master, keeps sending them to the old master: every batch fails its keys and pays
/// `connect_timeout`, however long after the failover. The first such batch must refresh the
/// map and send the keys to the new master.
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
