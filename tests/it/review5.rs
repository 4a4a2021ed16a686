//! Adversarial review (round 5) of the engine writer's hold (05cf230) and the Redis backend's
//! checks, waited pools and shared connect deadline (8c1c943, 89dcd40, 1660c83).

use std::time::Duration;

use newcache::{Cache, FailurePolicy};

use crate::fixture::{RedisCluster, unique_flavor};
use crate::redis_cluster::{master_of, no_failover, node, slot_of};

const S: fn(u64) -> Duration = Duration::from_secs;
const MS: fn(u64) -> Duration = Duration::from_millis;

/// Finding: a sync cluster batch's nodes share one `connect_timeout` (`many`'s `by`), and the
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
    let deadline = std::time::Instant::now() + S(20);
    let (hung, busy, other, kh, kb, ko) = loop {
        let masters = cluster.masters();
        let mut ports: Vec<u16> = masters.iter().map(|(p, _)| *p).collect();
        ports.sort_by_key(|p| format!("127.0.0.1:{p}"));
        let key_on = |port: u16| {
            (0..)
                .map(|i| format!("k{i}"))
                .find(|k| master_of(&masters, slot_of(port, &settler.make_key(k))) == port)
                .unwrap()
        };
        let (kh, kb, ko) = (key_on(ports[0]), key_on(ports[1]), key_on(ports[2]));
        let failed = settler.set_many(
            [
                (kh.as_str(), &1u32),
                (kb.as_str(), &1u32),
                (ko.as_str(), &1u32),
            ],
            S(600),
        );
        if failed.is_ok_and(|f| f.is_empty()) {
            break (ports[0], ports[1], ports[2], kh, kb, ko);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the cluster never settled"
        );
        std::thread::sleep(MS(200));
    };
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
    let deadline = std::time::Instant::now() + S(20);
    let (healthy, hung, other, k0, kh, ko) = loop {
        let masters = cluster.masters();
        let mut ports: Vec<u16> = masters.iter().map(|(p, _)| *p).collect();
        ports.sort_by_key(|p| format!("127.0.0.1:{p}"));
        let key_on = |port: u16| {
            (0..)
                .map(|i| format!("k{i}"))
                .find(|k| master_of(&masters, slot_of(port, &settler.make_key(k))) == port)
                .unwrap()
        };
        let (k0, kh, ko) = (key_on(ports[0]), key_on(ports[1]), key_on(ports[2]));
        let failed = settler.set_many(
            [
                (k0.as_str(), &1u32),
                (kh.as_str(), &1u32),
                (ko.as_str(), &1u32),
            ],
            S(600),
        );
        if failed.is_ok_and(|f| f.is_empty()) {
            break (ports[0], ports[1], ports[2], k0, kh, ko);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the cluster never settled"
        );
        std::thread::sleep(MS(200));
    };
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
