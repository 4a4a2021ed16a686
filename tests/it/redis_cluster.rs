//! The Redis Cluster backend on real clusters (3 masters, 3 replicas, started by the fixture):
//! keys spread over every master, a slot moved (`MOVED`) and one migrating (`ASK`) under a
//! cache that keeps serving, a master killed costing only its own keys, and what `build()`
//! refuses. The behaviour suites run on the shared cluster through `on_every_backend!`.

use std::time::{Duration, Instant};

use newcache::{Cache, FailurePolicy};

use crate::fixture::{Ipv6Cluster, RedisCluster, shared_redis_cluster, unique_flavor};
use crate::front::{BuildFor, Front, TestCache};

const S: fn(u64) -> Duration = Duration::from_secs;
const MS: fn(u64) -> Duration = Duration::from_millis;

/// A connection to the node on `port`.
pub(crate) fn node(port: u16) -> redis::Connection {
    redis::Client::open(format!("redis://127.0.0.1:{port}/"))
        .and_then(|c| c.get_connection_with_timeout(S(5)))
        .expect("a cluster node answers")
}

/// The port in a `redis://127.0.0.1:port` URL.
fn port_of(url: &str) -> u16 {
    url.rsplit(':')
        .next()
        .unwrap()
        .trim_end_matches('/')
        .parse()
        .unwrap()
}

/// The hash slot of `key`, as the cluster computes it (`CLUSTER KEYSLOT`).
pub(crate) fn slot_of(port: u16, key: &str) -> u16 {
    redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(key)
        .query(&mut node(port))
        .unwrap()
}

/// The node id of the node on `port`.
fn id_of(port: u16) -> String {
    redis::cmd("CLUSTER")
        .arg("MYID")
        .query(&mut node(port))
        .unwrap()
}

/// The master serving `slot`.
pub(crate) fn master_of(masters: &[(u16, Vec<(u16, u16)>)], slot: u16) -> u16 {
    masters
        .iter()
        .find(|(_, ranges)| ranges.iter().any(|&(a, b)| (a..=b).contains(&slot)))
        .map(|(p, _)| *p)
        .expect("every slot is served")
}

/// A settled cluster's masters in address order, a key of each (as `cache` names it).
pub(crate) fn keys_on_masters(cluster: &RedisCluster, cache: &Cache) -> Vec<(u16, String)> {
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

/// No replica takes over while a test stops masters.
pub(crate) fn no_failover(cluster: &RedisCluster) {
    for &p in &cluster.ports {
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("cluster-replica-no-failover")
            .arg("yes")
            .query(&mut node(p))
            .unwrap();
    }
}

/// Whether the node on `port` holds `key` itself (a redirect: it does not).
fn holds(port: u16, key: &str) -> bool {
    let mut c = node(port);
    let () = redis::cmd("ASKING").query(&mut c).unwrap();
    match redis::cmd("EXISTS").arg(key).query::<i64>(&mut c) {
        Ok(n) => n == 1,
        Err(e) if matches!(e.code(), Some("MOVED" | "ASK")) => false,
        Err(e) => panic!("EXISTS on {port}: {e}"),
    }
}

fn cache_on(seeds: &[String], flavor: &str, front: Front) -> TestCache {
    Cache::builder()
        .redis_cluster(seeds.iter().cloned())
        .flavor(flavor)
        .read_failures(FailurePolicy::Propagate)
        .write_failures(FailurePolicy::Propagate)
        .io_timeout(S(5))
        .build_front(front)
}

#[test]
fn keys_spread_over_every_master() {
    let seeds = shared_redis_cluster();
    let flavor = unique_flavor("spread");
    let cache = cache_on(seeds, &flavor, Front::Sync);
    let keys: Vec<String> = (0..100).map(|i| format!("k{i}")).collect();
    let failed = cache
        .set_many(keys.iter().map(|k| (k.as_str(), k)), S(600))
        .unwrap();
    assert!(failed.is_empty(), "{failed:?}");
    let got = cache.get_many::<String>(&keys).unwrap();
    assert_eq!(got.len(), 100);
    // Count, on each master, the keys of this flavor it holds itself.
    let ports: Vec<u16> = seeds.iter().map(|u| port_of(u)).collect();
    let mut per_master = Vec::new();
    for p in ports {
        let role: redis::Value = redis::cmd("ROLE").query(&mut node(p)).unwrap();
        let is_master = matches!(&role, redis::Value::Array(v)
            if matches!(v.first(), Some(redis::Value::BulkString(b)) if b == b"master"));
        if !is_master {
            continue;
        }
        let found: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{flavor}-*"))
            .query(&mut node(p))
            .unwrap();
        per_master.push((p, found.len()));
    }
    assert_eq!(per_master.len(), 3, "{per_master:?}");
    assert_eq!(per_master.iter().map(|(_, n)| n).sum::<usize>(), 100);
    assert!(
        per_master.iter().all(|&(_, n)| n > 0),
        "every master holds some of the keys: {per_master:?}"
    );
    assert_eq!(cache.delete_many(&keys).unwrap(), 100);
}

#[test]
fn a_seed_with_a_database_other_than_0_or_no_seed_is_refused_at_build() {
    let e = Cache::builder()
        .redis_cluster([
            "redis://127.0.0.1:7000",
            "redis://u:hunter2@127.0.0.1:7001/3",
        ])
        .build()
        .unwrap_err();
    let text = format!("{e} {e:?}");
    assert!(e.is_config(), "{e}");
    assert!(text.contains("database 3"), "{text}");
    assert!(text.contains("127.0.0.1:7001"), "the seed is named: {text}");
    assert!(!text.contains("hunter2"), "no password: {text}");
    assert!(
        Cache::builder()
            .redis_cluster(["redis://127.0.0.1:7000/1"])
            .build_async()
            .unwrap_err()
            .is_config()
    );
    let none: [&str; 0] = [];
    let e = Cache::builder().redis_cluster(none).build().unwrap_err();
    assert!(e.is_config() && e.to_string().contains("seed"), "{e}");
}

/// Starts moving `slot` from the master on `from` to the one on `to`: `IMPORTING` on the
/// target, `MIGRATING` on the source.
pub(crate) fn begin_migration(slot: u16, from: u16, to: u16) {
    let () = redis::cmd("CLUSTER")
        .arg("SETSLOT")
        .arg(slot)
        .arg("IMPORTING")
        .arg(id_of(from))
        .query(&mut node(to))
        .unwrap();
    let () = redis::cmd("CLUSTER")
        .arg("SETSLOT")
        .arg(slot)
        .arg("MIGRATING")
        .arg(id_of(to))
        .query(&mut node(from))
        .unwrap();
}

/// `MIGRATE`s `keys` from `from` to `to`.
pub(crate) fn migrate(from: u16, to: u16, keys: &[String]) {
    let mut cmd = redis::cmd("MIGRATE");
    cmd.arg("127.0.0.1")
        .arg(to)
        .arg("")
        .arg(0)
        .arg(5000)
        .arg("KEYS")
        .arg(keys);
    let () = cmd.query(&mut node(from)).unwrap();
}

/// Ends the move of `slot`: every master told it is `to`'s now.
fn end_migration(slot: u16, to: u16, masters: &[u16]) {
    let id = id_of(to);
    for &p in masters {
        let () = redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg("NODE")
            .arg(&id)
            .query(&mut node(p))
            .unwrap();
    }
}

#[test]
fn a_moved_slot_keeps_being_served() {
    moved_slot_served("redis-server");
}

/// Valkey 9 (`redis-cli --cluster create` makes its cluster too): the behaviour suites run on
/// the Redis cluster; this checks the routing and `MOVED` on Valkey's.
#[test]
fn a_moved_slot_keeps_being_served_on_valkey() {
    moved_slot_served(&crate::fixture::valkey_server());
}

fn moved_slot_served(bin: &str) {
    let cluster = RedisCluster::start(bin);
    let seeds = cluster.seeds();
    let masters = cluster.masters();
    let ports: Vec<u16> = masters.iter().map(|(p, _)| *p).collect();
    for front in [Front::Sync, Front::Async] {
        let flavor = unique_flavor("moved");
        let cache = cache_on(&seeds, &flavor, front);
        let keys: Vec<String> = (0..20).map(|i| format!("k{i}")).collect();
        cache
            .set_many(keys.iter().map(|k| (k.as_str(), k)), S(600))
            .unwrap();
        // The map is known; now the slot of k0 moves to another master.
        let derived = cache.make_key("k0");
        let slot = slot_of(ports[0], &derived);
        let from = master_of(&cluster.masters(), slot);
        let to = *ports.iter().find(|&&p| p != from).unwrap();
        begin_migration(slot, from, to);
        let in_slot: Vec<String> = redis::cmd("CLUSTER")
            .arg("GETKEYSINSLOT")
            .arg(slot)
            .arg(1000)
            .query(&mut node(from))
            .unwrap();
        migrate(from, to, &in_slot);
        end_migration(slot, to, &ports);
        assert!(holds(to, &derived) && !holds(from, &derived));

        // The cache follows the MOVED: batches (first: the map still names the old master),
        // reads and writes of the moved key work.
        let got = cache.get_many::<String>(&keys).unwrap();
        assert_eq!(got.len(), 20, "{front:?}: {got:?}");
        assert_eq!(
            cache.get::<String>("k0").unwrap().as_deref(),
            Some("k0"),
            "{front:?}"
        );
        cache.set("k0", "again", S(600)).unwrap();
        assert_eq!(cache.get::<String>("k0").unwrap().as_deref(), Some("again"));
        assert!(holds(to, &derived), "written on the slot's new master");
        let loaded = cache
            .get_or_set_with("k0-loaded", S(600), || Ok::<_, std::io::Error>(7u32))
            .unwrap();
        assert_eq!(loaded, 7);
        assert_eq!(cache.delete_many(&keys).unwrap(), 20, "{front:?}");
        assert!(cache.ping().is_ok(), "{front:?}");
    }
}

/// On a cluster reached over IPv6, a `MOVED` names the node as Redis prints it, without
/// brackets (`MOVED 8831 ::1:7002`): the cache follows it, on both fronts, and serves the
/// moved key from its new master, as on IPv4 (the redirect, the slot map and the seed name the
/// node in one form).
#[test]
fn a_moved_slot_keeps_being_served_on_an_ipv6_cluster() {
    let cluster = Ipv6Cluster::start();
    let flavor = unique_flavor("moved-v6");
    let caches: Vec<(Front, TestCache)> = [Front::Sync, Front::Async]
        .into_iter()
        .map(|front| {
            let cache = Cache::builder()
                .redis_cluster([format!("redis://[::1]:{}", cluster.ports[0])])
                .flavor(flavor.as_str())
                .read_failures(FailurePolicy::Propagate)
                .build_front(front);
            (front, cache)
        })
        .collect();
    // Both learn the map; k is on its slot's master.
    for (front, cache) in &caches {
        cache.set("k", &1u32, S(600)).unwrap();
        assert_eq!(cache.get::<u32>("k").unwrap(), Some(1), "{front:?}");
    }
    let key = caches[0].1.make_key("k");
    let slot: u16 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(&key)
        .query(&mut cluster.node(cluster.ports[0]))
        .unwrap();
    let holds = |p: u16| {
        redis::cmd("EXISTS")
            .arg(&key)
            .query::<i64>(&mut cluster.node(p))
            .is_ok_and(|n| n == 1)
    };
    let from = *cluster.ports.iter().find(|&&p| holds(p)).unwrap();
    let to = *cluster.ports.iter().find(|&&p| p != from).unwrap();
    // The slot (k its only key) moves to `to`.
    let id = |p: u16| -> String {
        redis::cmd("CLUSTER")
            .arg("MYID")
            .query(&mut cluster.node(p))
            .unwrap()
    };
    let (from_id, to_id) = (id(from), id(to));
    let setslot = |on: u16, args: &[&str]| {
        let () = redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg(args)
            .query(&mut cluster.node(on))
            .unwrap();
    };
    setslot(to, &["IMPORTING", &from_id]);
    setslot(from, &["MIGRATING", &to_id]);
    let () = redis::cmd("MIGRATE")
        .arg("::1")
        .arg(to)
        .arg(&key)
        .arg(0)
        .arg(5000)
        .query(&mut cluster.node(from))
        .unwrap();
    for &p in &cluster.ports {
        setslot(p, &["NODE", &to_id]);
    }
    assert!(holds(to) && !holds(from));
    for (front, cache) in &caches {
        // The first read meets the MOVED, the second the refreshed map.
        for _ in 0..2 {
            assert_eq!(cache.get::<u32>("k").unwrap(), Some(1), "{front:?}");
        }
    }
    for (n, (front, cache)) in (2u32..).zip(&caches) {
        cache.set("k", &n, S(600)).unwrap();
        assert_eq!(cache.get::<u32>("k").unwrap(), Some(n), "{front:?}");
        assert!(holds(to), "{front:?}: written on the slot's new master");
        assert!(cache.ping().is_ok(), "{front:?}");
    }
}

#[test]
fn a_migrating_slot_is_followed_by_ask() {
    let cluster = RedisCluster::start("redis-server");
    let seeds = cluster.seeds();
    let masters = cluster.masters();
    let ports: Vec<u16> = masters.iter().map(|(p, _)| *p).collect();
    for front in [Front::Sync, Front::Async] {
        let flavor = unique_flavor("ask");
        let cache = cache_on(&seeds, &flavor, front);
        cache.set("moving", "before", S(600)).unwrap();
        cache.set("other", "stays", S(600)).unwrap();
        let derived = cache.make_key("moving");
        let slot = slot_of(ports[0], &derived);
        let from = master_of(&cluster.masters(), slot);
        let to = *ports.iter().find(|&&p| p != from).unwrap();
        // Halfway: the key is on the target, the slot still the source's.
        begin_migration(slot, from, to);
        migrate(from, to, std::slice::from_ref(&derived));
        assert!(holds(to, &derived) && !holds(from, &derived));

        assert_eq!(
            cache.get::<String>("moving").unwrap().as_deref(),
            Some("before"),
            "{front:?}: the source answers ASK, the target serves it after ASKING"
        );
        let got = cache.get_many::<String>(&["moving", "other"]).unwrap();
        assert_eq!(got.len(), 2, "{front:?}: {got:?}");
        cache.set("moving", "during", S(600)).unwrap();
        assert!(holds(to, &derived), "the write followed the ASK");
        assert_eq!(
            cache.get::<String>("moving").unwrap().as_deref(),
            Some("during")
        );
        // An ASK changes no map: the slot is still the source's, which says so.
        let back: Option<Vec<u8>> = redis::cmd("GET")
            .arg(&derived)
            .query(&mut node(from))
            .map_err(|e| e.code().map(str::to_owned))
            .unwrap_or_else(|code| {
                assert_eq!(code.as_deref(), Some("ASK"));
                None
            });
        assert!(back.is_none());
        // The move ends: MOVED from then on, and the cache still serves it.
        end_migration(slot, to, &ports);
        assert_eq!(
            cache.get::<String>("moving").unwrap().as_deref(),
            Some("during")
        );
        assert!(cache.delete("moving").unwrap());
        // Moved back for the other front's turn.
        begin_migration(slot, to, from);
        let left: Vec<String> = redis::cmd("CLUSTER")
            .arg("GETKEYSINSLOT")
            .arg(slot)
            .arg(1000)
            .query(&mut node(to))
            .unwrap();
        if !left.is_empty() {
            migrate(to, from, &left);
        }
        end_migration(slot, from, &ports);
    }
}

#[test]
fn a_killed_master_fails_only_its_own_keys() {
    let mut cluster = RedisCluster::start("redis-server");
    let seeds = cluster.seeds();
    let masters = cluster.masters();
    let flavor = unique_flavor("killed");
    let keys: Vec<String> = (0..60).map(|i| format!("k{i}")).collect();
    let sync = cache_on(&seeds, &flavor, Front::Sync);
    let asynchronous = cache_on(&seeds, &flavor, Front::Async);
    sync.set_many(keys.iter().map(|k| (k.as_str(), k)), S(600))
        .unwrap();
    // Both caches know the map before the kill.
    assert_eq!(asynchronous.get_many::<String>(&keys).unwrap().len(), 60);
    let victim = masters[1].0;
    let dead: Vec<&String> = keys
        .iter()
        .filter(|k| master_of(&masters, slot_of(masters[0].0, &sync.make_key(k))) == victim)
        .collect();
    assert!(!dead.is_empty() && dead.len() < 60, "{} keys", dead.len());
    // No failover (that is the next task's test), and the others serve on with a slot range
    // uncovered: what the test sees does not depend on how fast it runs.
    for &p in &cluster.ports {
        for (setting, value) in [
            ("cluster-replica-no-failover", "yes"),
            ("cluster-require-full-coverage", "no"),
        ] {
            let () = redis::cmd("CONFIG")
                .arg("SET")
                .arg(setting)
                .arg(value)
                .query(&mut node(p))
                .unwrap();
        }
    }
    cluster.kill(victim);
    for cache in [&sync, &asynchronous] {
        let e = cache.get_many::<String>(&keys).unwrap_err();
        let mut named: Vec<String> = e.failed_keys().to_vec();
        named.sort();
        let mut want: Vec<String> = dead.iter().map(|k| k.to_string()).collect();
        want.sort();
        assert_eq!(named, want, "exactly the killed master's keys fail: {e}");
        let mut chain = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            chain.push_str(&format!(": {s}"));
            source = s.source();
        }
        assert!(
            chain.contains(&format!("127.0.0.1:{victim}")),
            "the failure names the killed master: {chain}"
        );
        let ping = cache.ping().unwrap_err();
        assert_eq!(ping.failures().len(), 1, "{ping}");
        assert!(ping.to_string().contains(&victim.to_string()), "{ping}");
    }
    // Absorbing read failures, the other masters' keys are served.
    let lenient = Cache::builder()
        .redis_cluster(seeds.iter().cloned())
        .flavor(flavor.as_str())
        .build()
        .unwrap();
    let got = lenient.get_many::<String>(&keys).unwrap();
    assert_eq!(got.len(), 60 - dead.len());
}

#[test]
fn clear_removes_this_caches_keys_on_every_master() {
    let seeds = shared_redis_cluster();
    for front in [Front::Sync, Front::Async] {
        let cache = cache_on(seeds, &unique_flavor("clear"), front);
        let other = cache_on(seeds, &unique_flavor("clear-other"), front);
        let keys: Vec<String> = (0..300).map(|i| format!("k{i}")).collect();
        cache
            .set_many(keys.iter().map(|k| (k.as_str(), k)), S(600))
            .unwrap();
        other.set("k1", "theirs", S(600)).unwrap();
        cache.clear().unwrap();
        assert!(
            cache.get_many::<String>(&keys).unwrap().is_empty(),
            "{front:?}: every master's keys of this cache are gone"
        );
        assert_eq!(
            other.get::<String>("k1").unwrap().as_deref(),
            Some("theirs"),
            "{front:?}: another flavor stays"
        );
    }
}

/// `clear()` asks every master whatever one of them answers: a master that fails its part
/// (here its ACL refuses the user `SCAN`: ACLs are per node) is reported, by address, after
/// the others were cleared. It is the master of slot 0, which the map lists first.
#[test]
fn clear_clears_every_master_it_can_and_names_the_one_that_failed() {
    let cluster = RedisCluster::start("redis-server");
    let masters = cluster.masters();
    let refusing = master_of(&masters, 0);
    for &p in &cluster.ports {
        let scan = if p == refusing { "-scan" } else { "+scan" };
        let () = redis::cmd("ACL")
            .arg("SETUSER")
            .arg("nc")
            .arg(&["on", ">secret", "~*", "&*", "+@all", scan])
            .query(&mut node(p))
            .unwrap();
    }
    let seeds: Vec<String> = cluster
        .ports
        .iter()
        .map(|p| format!("redis://nc:secret@127.0.0.1:{p}"))
        .collect();
    let keys: Vec<String> = (0..60).map(|i| format!("k{i}")).collect();
    for front in [Front::Sync, Front::Async] {
        let cache = cache_on(&seeds, &unique_flavor("clear-partly"), front);
        cache
            .set_many(keys.iter().map(|k| (k.as_str(), k)), S(600))
            .unwrap();
        let e = cache.clear().unwrap_err();
        assert!(e.is_denied(), "{front:?}: {e}");
        assert!(
            e.to_string().contains(&format!("127.0.0.1:{refusing}")),
            "{front:?}: the master that failed is named: {e}"
        );
        let left = cache.get_many::<String>(&keys).unwrap();
        for k in &keys {
            let master = master_of(&masters, slot_of(refusing, &cache.make_key(k)));
            assert_eq!(
                left.contains_key(k),
                master == refusing,
                "{front:?}: {k} (on 127.0.0.1:{master}): only the refusing master's keys stay"
            );
        }
    }
}

/// A master killed, its replica promoted: a node's fault asks for the map again (at most once
/// per `retry_interval`), so the cache finds the new master and serves its slots again. (No
/// load, no count of what was lost: replication is asynchronous.)
#[test]
fn after_a_failover_the_new_master_serves_its_slots() {
    let mut cluster = RedisCluster::start("redis-server");
    let seeds = cluster.seeds();
    let masters = cluster.masters();
    let flavor = unique_flavor("failover");
    let keys: Vec<String> = (0..30).map(|i| format!("k{i}")).collect();
    let build = |front| {
        Cache::builder()
            .redis_cluster(seeds.iter().cloned())
            .flavor(flavor.as_str())
            .read_failures(FailurePolicy::Propagate)
            .retry_interval(Duration::from_millis(200))
            .build_front(front)
    };
    let caches = [build(Front::Sync), build(Front::Async)];
    caches[0]
        .set_many(keys.iter().map(|k| (k.as_str(), k)), S(600))
        .unwrap();
    for c in &caches {
        assert!(c.get_many::<String>(&keys).is_ok(), "the map is known");
    }
    let victim = masters[0].0;
    cluster.kill(victim);
    let live: Vec<u16> = cluster
        .ports
        .iter()
        .copied()
        .filter(|&p| p != victim)
        .collect();
    // Until a replica took over (the node timeout is 2 s) and every live node agrees.
    let deadline = std::time::Instant::now() + S(60);
    while cluster
        .try_masters()
        .is_none_or(|m| m.iter().any(|(p, _)| *p == victim))
    {
        if std::time::Instant::now() > deadline {
            let nodes: String = redis::cmd("CLUSTER")
                .arg("NODES")
                .query(&mut node(live[0]))
                .unwrap();
            panic!("no replica took over: {nodes}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    crate::fixture::wait_cluster_ok(&live, S(60));
    for c in &caches {
        let deadline = std::time::Instant::now() + S(30);
        loop {
            match c.get_many::<String>(&keys) {
                Ok(_) => break,
                Err(e) => assert!(
                    std::time::Instant::now() < deadline,
                    "the cache never found the new master: {e}"
                ),
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        c.set("after", "failover", S(600)).unwrap();
        assert_eq!(
            c.get::<String>("after").unwrap().as_deref(),
            Some("failover")
        );
    }
}

/// `AsyncCache` batches concurrent gets into one `MGET` on a single server; a cluster node
/// refuses an `MGET` of keys of several slots (`CROSSSLOT`), so on a cluster each get is its
/// own `GET`: 64 tasks reading keys of every master each get their own values.
#[test]
fn concurrent_async_gets_on_a_cluster_each_get_their_own_value() {
    let seeds = shared_redis_cluster();
    let flavor = unique_flavor("cluster-concurrent");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let cache = Cache::builder()
        .redis_cluster(seeds.iter().cloned())
        .flavor(flavor)
        .read_failures(FailurePolicy::Propagate)
        .io_timeout(S(5))
        .build_async()
        .unwrap();
    rt.block_on(async {
        for i in 0..100u32 {
            cache.set(&format!("k{i}"), &i, S(60)).await.unwrap();
        }
        let tasks: Vec<_> = (0..64u32)
            .map(|t| {
                let c = cache.clone();
                tokio::spawn(async move {
                    for j in 0..50u32 {
                        let i = (t * 7 + j) % 100;
                        let v = c.get::<u32>(&format!("k{i}")).await.unwrap();
                        assert_eq!(v, Some(i), "task {t}, get {j}");
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
    });
}

/// What one key saw during a run under load: loads, and each error with when it came.
#[derive(Default)]
struct KeyLog {
    loads: std::sync::atomic::AtomicU64,
    /// When the call was made, when it failed, and the error.
    errors: std::sync::Mutex<Vec<(std::time::Instant, std::time::Instant, String)>>,
}

/// 16 threads of `get_or_set_with` over keys spread across the masters; one master killed
/// (SIGKILL), its replica promoted (the node timeout is 2 s). Errors come only for the killed
/// master's keys, only after the kill, and each thread, once it has been served every key after
/// the cluster settled, sees no error again; the live masters' keys were loaded once each.
fn failover_under_load(front: Front) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Instant;

    const THREADS: usize = 16;
    let mut cluster = RedisCluster::start("redis-server");
    let seeds = cluster.seeds();
    let masters = cluster.masters();
    let flavor = unique_flavor("failover-load");
    let cache = Cache::builder()
        .redis_cluster(seeds.iter().cloned())
        .flavor(flavor.as_str())
        .read_failures(FailurePolicy::Propagate)
        .write_failures(FailurePolicy::Propagate)
        .retry_interval(Duration::from_millis(200))
        .io_timeout(S(2))
        .build_front(front);
    let keys: Vec<String> = (0..48).map(|i| format!("k{i}")).collect();
    // Redis's default (`cluster-require-full-coverage yes`) has every node refuse every key
    // (`CLUSTERDOWN`) from the moment a master is marked failed until its replica took over;
    // with `no`, the other masters serve on: the setting a user keeping the rest of the cache
    // up through a failover runs with.
    for &p in &cluster.ports {
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("cluster-require-full-coverage")
            .arg("no")
            .query(&mut node(p))
            .unwrap();
    }
    let victim = masters[0].0;
    let on_victim: Vec<bool> = keys
        .iter()
        .map(|k| master_of(&masters, slot_of(victim, &cache.make_key(k))) == victim)
        .collect();
    assert!(
        on_victim.iter().any(|&v| v) && !on_victim.iter().all(|&v| v),
        "keys on the victim and elsewhere"
    );
    let logs: Arc<Vec<KeyLog>> = Arc::new(keys.iter().map(|_| KeyLog::default()).collect());
    let stop = Arc::new(AtomicBool::new(false));
    // When the cluster settled after the failover (set once, read by the threads).
    let settled: Arc<std::sync::OnceLock<Instant>> = Arc::new(std::sync::OnceLock::new());
    let killed_at: Arc<std::sync::OnceLock<Instant>> = Arc::new(std::sync::OnceLock::new());
    // Per thread: errors seen after it had been served every key once since the cluster settled.
    let late_errors = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (cache, keys, logs, stop, settled, late) = (
                cache.clone(),
                keys.clone(),
                logs.clone(),
                stop.clone(),
                settled.clone(),
                late_errors.clone(),
            );
            std::thread::spawn(move || {
                let mut served_since_settled = vec![false; keys.len()];
                let mut rounds_after = 0u64;
                let mut i = t;
                while !stop.load(Ordering::Relaxed) {
                    let k = i % keys.len();
                    i += 1;
                    let asked = Instant::now();
                    let got = cache.get_or_set_with(&keys[k], S(600), || {
                        logs[k].loads.fetch_add(1, Ordering::Relaxed);
                        Ok::<_, std::io::Error>(keys[k].clone())
                    });
                    let after_settle = settled.get().is_some_and(|&s| asked >= s);
                    match got {
                        Ok(v) => {
                            assert_eq!(v, keys[k], "a key's own value");
                            if after_settle {
                                served_since_settled[k] = true;
                                if served_since_settled.iter().all(|&s| s) {
                                    rounds_after += 1;
                                }
                            }
                        }
                        Err(e) => {
                            if served_since_settled.iter().all(|&s| s) {
                                late.lock().unwrap().push(format!("{}: {e}", keys[k]));
                            }
                            logs[k].errors.lock().unwrap().push((
                                asked,
                                Instant::now(),
                                e.to_string(),
                            ));
                        }
                    }
                }
                rounds_after
            })
        })
        .collect();
    // Load before the kill: every key loaded and served.
    std::thread::sleep(Duration::from_millis(500));
    killed_at.set(Instant::now()).unwrap();
    cluster.kill(victim);
    let live: Vec<u16> = cluster
        .ports
        .iter()
        .copied()
        .filter(|&p| p != victim)
        .collect();
    let deadline = Instant::now() + S(60);
    while cluster
        .try_masters()
        .is_none_or(|m| m.iter().any(|(p, _)| *p == victim))
    {
        assert!(Instant::now() < deadline, "no replica took over");
        std::thread::sleep(Duration::from_millis(100));
    }
    crate::fixture::wait_cluster_ok(&live, S(60));
    settled.set(Instant::now()).unwrap();
    // Until every thread has been served every key since, and a while of load after that.
    let deadline = Instant::now() + S(60);
    loop {
        let all_served = keys.iter().enumerate().all(|(k, _)| {
            logs[k]
                .errors
                .lock()
                .unwrap()
                .last()
                .is_none_or(|&(at, _, _)| at < *settled.get().unwrap())
        });
        if all_served || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(S(2));
    stop.store(true, Ordering::Relaxed);
    let rounds: Vec<u64> = threads.into_iter().map(|t| t.join().unwrap()).collect();

    let killed = *killed_at.get().unwrap();
    let mut report = Vec::new();
    for (k, key) in keys.iter().enumerate() {
        let loads = logs[k].loads.load(Ordering::Relaxed);
        let errors = logs[k].errors.lock().unwrap();
        report.push(format!(
            "{key}{}: {loads} loads, {} errors",
            if on_victim[k] { " (victim)" } else { "" },
            errors.len()
        ));
        if !on_victim[k] {
            assert!(
                errors.is_empty(),
                "{front:?}: a live master's key {key} failed: {:?}",
                errors.first()
            );
            assert_eq!(loads, 1, "{front:?}: {key} on a live master loaded once");
        } else {
            let early = errors.iter().find(|&&(_, failed, _)| failed < killed);
            assert!(
                early.is_none(),
                "{front:?}: {key} failed before the kill: {early:?}"
            );
        }
    }
    eprintln!("{front:?} failover under load: {}", report.join("; "));
    assert!(
        rounds.iter().all(|&r| r > 0),
        "{front:?}: every thread was served every key after the failover: {rounds:?}"
    );
    let late = late_errors.lock().unwrap();
    assert!(
        late.is_empty(),
        "{front:?}: errors after a thread was served every key again: {late:?}"
    );
    assert!(
        on_victim
            .iter()
            .zip(logs.iter())
            .any(|(&v, l)| v && !l.errors.lock().unwrap().is_empty()),
        "{front:?}: the kill was seen (some of the victim's keys failed during the switch)"
    );
}

#[test]
fn a_failover_under_load_fails_only_the_killed_masters_keys_during_the_switch() {
    failover_under_load(Front::Sync);
}

#[test]
fn a_failover_under_load_fails_only_the_killed_masters_keys_during_the_switch_async() {
    failover_under_load(Front::Async);
}

/// Moves `slot` from `from` to `to` key by key (a pause between keys, so callers meet the
/// half-moved slot and its `ASK`s), then hands it over (`MOVED` from then on).
pub(crate) fn move_slot_slowly(slot: u16, from: u16, to: u16, masters: &[u16]) {
    begin_migration(slot, from, to);
    loop {
        let left: Vec<String> = redis::cmd("CLUSTER")
            .arg("GETKEYSINSLOT")
            .arg(slot)
            .arg(1)
            .query(&mut node(from))
            .unwrap();
        if left.is_empty() {
            break;
        }
        migrate(from, to, &left);
        std::thread::sleep(Duration::from_millis(20));
    }
    end_migration(slot, to, masters);
}

/// How many `code` error replies (`ASK`, `MOVED`) the nodes on `ports` have sent
/// (`INFO errorstats`).
fn replies_of(ports: &[u16], code: &str) -> u64 {
    ports
        .iter()
        .map(|&p| {
            let info: String = redis::cmd("INFO")
                .arg("errorstats")
                .query(&mut node(p))
                .unwrap();
            info.lines()
                .find_map(|l| l.strip_prefix(&format!("errorstat_{code}:count=")))
                .map_or(0, |n| n.trim().parse().unwrap())
        })
        .sum()
}

/// Slots moved one by one while 16 threads read, load and write their keys: the callers see no
/// error, a writer always reads back what it wrote last, and each loaded key is loaded once.
fn resharding_under_load(front: Front) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    let cluster = RedisCluster::start("redis-server");
    let seeds = cluster.seeds();
    let ports: Vec<u16> = cluster.masters().iter().map(|(p, _)| *p).collect();
    let flavor = unique_flavor("reshard-load");
    let cache = cache_on(&seeds, &flavor, front);
    // Loaded keys (get_or_set_with, 12 threads) and written keys (a writer each, 4 threads).
    let loaded: Vec<String> = (0..24).map(|i| format!("l{i}")).collect();
    let written: Vec<String> = (0..4).map(|i| format!("w{i}")).collect();
    let loads: Arc<Vec<AtomicU64>> = Arc::new(loaded.iter().map(|_| AtomicU64::new(0)).collect());
    let errors = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    for t in 0..12 {
        let (cache, keys, loads, errors, stop) = (
            cache.clone(),
            loaded.clone(),
            loads.clone(),
            errors.clone(),
            stop.clone(),
        );
        threads.push(std::thread::spawn(move || {
            let mut i = t;
            while !stop.load(Ordering::Relaxed) {
                let k = i % keys.len();
                i += 1;
                match cache.get_or_set_with(&keys[k], S(600), || {
                    loads[k].fetch_add(1, Ordering::Relaxed);
                    Ok::<_, std::io::Error>(keys[k].clone())
                }) {
                    Ok(v) => assert_eq!(v, keys[k]),
                    Err(e) => errors.lock().unwrap().push(format!("{}: {e}", keys[k])),
                }
            }
            0
        }));
    }
    for key in written.clone() {
        let (cache, errors, stop) = (cache.clone(), errors.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                if let Err(e) = cache.set(&key, &n, S(600)) {
                    errors.lock().unwrap().push(format!("set {key}: {e}"));
                    continue;
                }
                match cache.get::<u64>(&key) {
                    Ok(Some(got)) if got == n => {}
                    Ok(got) => errors
                        .lock()
                        .unwrap()
                        .push(format!("{key}: wrote {n}, read {got:?}")),
                    Err(e) => errors.lock().unwrap().push(format!("get {key}: {e}")),
                }
            }
            n
        }));
    }
    std::thread::sleep(Duration::from_millis(300));
    let (asks, moveds) = (replies_of(&ports, "ASK"), replies_of(&ports, "MOVED"));
    // Every key's slot moves to the next master, one slot after another.
    let mut moved = Vec::new();
    for key in loaded.iter().step_by(3).chain(&written) {
        let slot = slot_of(ports[0], &cache.make_key(key));
        if moved.contains(&slot) {
            continue;
        }
        moved.push(slot);
        let from = master_of(&cluster.masters(), slot);
        let to = ports[(ports.iter().position(|&p| p == from).unwrap() + 1) % ports.len()];
        move_slot_slowly(slot, from, to, &ports);
        assert_eq!(master_of(&cluster.masters(), slot), to);
    }
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    let asks = replies_of(&ports, "ASK") - asks;
    let moveds = replies_of(&ports, "MOVED") - moveds;
    eprintln!(
        "{front:?}: {} slots moved under load: {asks} ASK and {moveds} MOVED replies followed",
        moved.len()
    );
    assert!(
        asks > 0 && moveds > 0,
        "{front:?}: the callers met ASK ({asks}) and MOVED ({moveds})"
    );
    let errors = errors.lock().unwrap();
    assert!(
        errors.is_empty(),
        "{front:?}: {} errors while {} slots moved: {:?}",
        errors.len(),
        moved.len(),
        &errors[..errors.len().min(10)]
    );
    for (k, key) in loaded.iter().enumerate() {
        assert_eq!(
            loads[k].load(Ordering::Relaxed),
            1,
            "{front:?}: {key} loaded once across the moves"
        );
    }
    // Every key is where its slot now is, with its value.
    let got = cache.get_many::<String>(&loaded).unwrap();
    assert_eq!(got.len(), loaded.len(), "{front:?}: no loaded value lost");
}

#[test]
fn slots_moved_under_load_cost_the_callers_no_error_and_no_second_load() {
    resharding_under_load(Front::Sync);
}

#[test]
fn slots_moved_under_load_cost_the_callers_no_error_and_no_second_load_async() {
    resharding_under_load(Front::Async);
}

/// The port of a replica of the master on `port` (`ROLE`), once one is attached (a cluster
/// just started may not have its replicas synced yet).
fn replica_of(port: u16) -> u16 {
    let deadline = std::time::Instant::now() + S(30);
    loop {
        let role: redis::Value = redis::cmd("ROLE").query(&mut node(port)).unwrap();
        let redis::Value::Array(v) = role else {
            panic!("ROLE: {role:?}")
        };
        let Some(redis::Value::Array(replicas)) = v.get(2) else {
            panic!("ROLE of a master: {v:?}")
        };
        match replicas.first() {
            Some(redis::Value::Array(r)) => match r.get(1) {
                Some(redis::Value::BulkString(p)) => {
                    return std::str::from_utf8(p).unwrap().parse().unwrap();
                }
                other => panic!("a replica's port: {other:?}"),
            },
            other => assert!(
                std::time::Instant::now() < deadline,
                "no replica of {port}: {other:?}"
            ),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// How many times the nodes on `ports` ran `command` (`INFO commandstats`).
fn calls_of(ports: &[u16], command: &str) -> u64 {
    ports
        .iter()
        .map(|&p| {
            let info: String = redis::cmd("INFO")
                .arg("commandstats")
                .query(&mut node(p))
                .unwrap();
            info.lines()
                .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:calls=")))
                .map_or(0, |rest| rest.split(',').next().unwrap().parse().unwrap())
        })
        .sum()
}

/// `redis_wait(1, ..)`: each store and delete waits for a replica. Answered, the calls succeed
/// (and the masters ran the `WAIT`s); with the replica of one master stopped (SIGSTOP), a write
/// to that master's keys fails with an error that `is_outcome_unknown` and names the shortfall,
/// the write is on the master, and the other masters' keys are written as before. A shortfall
/// is an answer, not a node's fault: it does not make the cache ask for the slot map again.
#[test]
fn redis_wait_waits_for_a_replica_and_a_shortfall_is_an_outcome_unknown_error() {
    let cluster = RedisCluster::start("redis-server");
    let seeds = cluster.seeds();
    let masters = cluster.masters();
    let ports: Vec<u16> = masters.iter().map(|(p, _)| *p).collect();
    for front in [Front::Sync, Front::Async] {
        let flavor = unique_flavor("wait");
        let cache = Cache::builder()
            .redis_cluster(seeds.iter().cloned())
            .flavor(flavor.as_str())
            // Long enough for a replica on a loaded machine: this part wants the answer.
            .redis_wait(1, S(5))
            .io_timeout(S(10))
            .read_failures(FailurePolicy::Propagate)
            .build_front(front);
        let before = calls_of(&ports, "wait");
        cache.set("a", "1", S(600)).unwrap();
        assert!(cache.delete("a").unwrap());
        let loaded = cache
            .get_or_set_with("loaded", S(600), || Ok::<_, std::io::Error>(5u32))
            .unwrap();
        assert_eq!(loaded, 5);
        let waits = calls_of(&ports, "wait") - before;
        assert!(
            waits >= 4,
            "{front:?}: a WAIT after the set, the delete, the claim and the store: {waits}"
        );
        let keys: Vec<String> = (0..30).map(|i| format!("k{i}")).collect();
        let failed = cache
            .set_many(keys.iter().map(|k| (k.as_str(), k)), S(600))
            .unwrap();
        assert!(failed.is_empty(), "{front:?}: {failed:?}");
    }

    // One master's replica stopped: its WAITs time out with 0 replicas.
    let stalled = ports[0];
    let replica = replica_of(stalled);
    cluster.signal(replica, "STOP");
    for front in [Front::Sync, Front::Async] {
        let flavor = unique_flavor("wait-short");
        let cache = Cache::builder()
            .redis_cluster(seeds.iter().cloned())
            .flavor(flavor.as_str())
            // Long enough for the healthy master's replica on a loaded machine.
            .redis_wait(1, S(1))
            .io_timeout(S(10))
            // A fault would ask for the map again at each call.
            .retry_interval(Duration::from_millis(1))
            .build_front(front);
        let key_on = |want: u16| {
            (0..)
                .map(|i| format!("key{i}"))
                .find(|k| master_of(&masters, slot_of(stalled, &cache.make_key(k))) == want)
                .unwrap()
        };
        let (short, fine) = (key_on(stalled), key_on(ports[1]));
        // The map asked once, by the first call.
        assert_eq!(cache.get::<String>(&fine).unwrap(), None);
        let asked = calls_of(&ports, "cluster|slots");
        let e = cache.set(&short, "v", S(600)).unwrap_err();
        assert!(e.is_outcome_unknown(), "{front:?}: {e}");
        let text = format!("{e}");
        assert!(text.contains("0 of 1 replicas"), "{front:?}: {text}");
        assert!(
            text.contains(&format!("127.0.0.1:{stalled}")),
            "the master is named: {text}"
        );
        assert_eq!(
            cache.get::<String>(&short).unwrap().as_deref(),
            Some("v"),
            "{front:?}: the write is on the master"
        );
        assert!(cache.delete(&short).unwrap_err().is_outcome_unknown());
        assert_eq!(cache.get::<String>(&short).unwrap(), None, "{front:?}");
        cache.set(&fine, "v", S(600)).unwrap();
        assert!(
            cache.delete(&fine).unwrap(),
            "{front:?}: another master's write waits as before"
        );
        assert_eq!(
            calls_of(&ports, "cluster|slots"),
            asked,
            "{front:?}: two shortfalls, and the map was asked again"
        );
        // Absorbed, a shortfall is counted and the call goes on.
        let lenient = Cache::builder()
            .redis_cluster(seeds.iter().cloned())
            .flavor(flavor.as_str())
            .redis_wait(1, Duration::from_millis(200))
            .write_failures(FailurePolicy::Absorb)
            .build_front(front);
        lenient.set(&short, "w", S(600)).unwrap();
        assert!(lenient.stats().backend_errors_absorbed >= 1, "{front:?}");
        // The server was not marked dead for it: reads go on.
        assert_eq!(cache.get::<String>(&short).unwrap().as_deref(), Some("w"));
        assert!(cache.ping().is_ok(), "{front:?}");
    }
    cluster.signal(replica, "CONT");
}

/// With `redis_wait`, a batch item its master redirects (`MOVED`: the slot moved since the
/// cache's map was asked) never ran there, so the `WAIT` that falls short on that master is not
/// its answer: it is sent to the slot's new master and written there, and only the items the
/// short master wrote fail with the shortfall.
#[test]
fn a_batch_item_moved_away_from_a_master_short_of_replicas_is_written_where_its_slot_went() {
    let cluster = RedisCluster::start("redis-server");
    let seeds = cluster.seeds();
    let masters = cluster.masters();
    let ports: Vec<u16> = masters.iter().map(|(p, _)| *p).collect();
    let (short, to) = (ports[0], ports[1]);
    let replica = replica_of(short);
    cluster.signal(replica, "STOP");
    for front in [Front::Sync, Front::Async] {
        let cache = Cache::builder()
            .redis_cluster(seeds.iter().cloned())
            .flavor(unique_flavor("wait-moved").as_str())
            // The healthy master's `WAIT` must not fall short either: its replica, starved of
            // CPU on a loaded machine, took over 200 ms to acknowledge (the short one's costs
            // this wait each time).
            .redis_wait(1, S(1))
            .io_timeout(S(10))
            .connect_timeout(S(10))
            .read_failures(FailurePolicy::Propagate)
            .build_front(front);
        let slot = |k: &str| slot_of(short, &cache.make_key(k));
        let on_short = |k: &String| master_of(&masters, slot(k)) == short;
        let mut keys = (0..).map(|i| format!("key{i}")).filter(on_short);
        let stays = keys.next().unwrap();
        let moves = keys.find(|k| slot(k) != slot(&stays)).unwrap();
        // The cache learns the map; then `moves`'s slot goes to another master.
        assert_eq!(cache.get::<String>(&stays).unwrap(), None);
        let moved = slot(&moves);
        begin_migration(moved, short, to);
        let held: Vec<String> = redis::cmd("CLUSTER")
            .arg("GETKEYSINSLOT")
            .arg(moved)
            .arg(1000)
            .query(&mut node(short))
            .unwrap();
        if !held.is_empty() {
            migrate(short, to, &held);
        }
        // Every master told (the stopped replica cannot be asked to settle).
        end_migration(moved, to, &ports);

        let (failed, why) =
            match cache.set_many([(stays.as_str(), "v"), (moves.as_str(), "v")], S(600)) {
                Ok(failed) => (failed, String::new()),
                Err(e) => {
                    assert!(e.is_outcome_unknown(), "{front:?}: {e}");
                    (e.failed_keys().to_vec(), format!("{e:?}"))
                }
            };
        assert_eq!(
            failed,
            vec![stays.clone()],
            "{front:?}: only the write of the master short of replicas ({short}; {to} took the \
             slot) fails: {why}"
        );
        assert!(
            holds(to, &cache.make_key(&moves)),
            "{front:?}: the moved key is written on its new master"
        );
        assert_eq!(cache.get::<String>(&moves).unwrap().as_deref(), Some("v"));
    }
    cluster.signal(replica, "CONT");
}

#[test]
fn a_wait_for_0_replicas_or_past_the_io_timeout_is_refused_at_build() {
    let e = Cache::builder()
        .redis_cluster(["redis://127.0.0.1:7000"])
        .redis_wait(0, Duration::from_millis(100))
        .build()
        .unwrap_err();
    assert!(e.is_config() && e.to_string().contains("0 replicas"), "{e}");
    let e = Cache::builder()
        .redis("redis://127.0.0.1:7000/0")
        .io_timeout(S(1))
        .redis_wait(1, S(1))
        .build()
        .unwrap_err();
    assert!(e.is_config() && e.to_string().contains("io_timeout"), "{e}");
}

/// This process's sockets (their inodes, from `/proc/self/fd`).
fn our_sockets() -> std::collections::HashSet<u64> {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_str()?.strip_prefix("socket:[")?.strip_suffix(']')?;
            l.parse().ok()
        })
        .collect()
}

/// Per port of `ports`, the bytes this process wrote to the server there that the server has
/// not read yet: for each of this process's TCP connections to that port, what waits in the
/// receive queue of the server's end (`/proc/net/tcp`, Linux).
fn unread_by(ports: &[u16]) -> Vec<u64> {
    let ours = our_sockets();
    // (local port, remote port, receive queue, inode) of every IPv4 socket.
    let port = |a: &str| u16::from_str_radix(a.rsplit(':').next().unwrap(), 16).unwrap();
    let table: Vec<(u16, u16, u64, u64)> = std::fs::read_to_string("/proc/net/tcp")
        .unwrap()
        .lines()
        .skip(1)
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let rx = u64::from_str_radix(f[4].split(':').nth(1).unwrap(), 16).unwrap();
            (port(f[1]), port(f[2]), rx, f[9].parse().unwrap())
        })
        .collect();
    ports
        .iter()
        .map(|&p| {
            table
                .iter()
                .filter(|&&(_, remote, _, inode)| remote == p && ours.contains(&inode))
                .map(|&(local, ..)| {
                    table
                        .iter()
                        .find(|&&(l, r, ..)| l == p && r == local)
                        .map_or(0, |&(_, _, rx, _)| rx)
                })
                .sum()
        })
        .collect()
}

/// A sync batch over the three masters writes every master's part before it reads any reply
/// (one round trip for the batch, not one per master): with every master stopped (SIGSTOP),
/// the requests of one `get_many`, `delete_many`, `set_many` or `ping` wait unread at all
/// three masters at once, where a batch sent one master after another would have written to
/// one and waited for its reply. Continued, each call gets its answer.
#[test]
fn a_sync_batch_writes_to_every_master_before_it_reads_a_reply() {
    let cluster = RedisCluster::start("redis-server");
    let seeds = cluster.seeds();
    let ports: Vec<u16> = cluster.masters().iter().map(|(p, _)| *p).collect();
    // No failover while the masters are stopped, however long the machine takes.
    no_failover(&cluster);
    let cache = Cache::builder()
        .redis_cluster(seeds.iter().cloned())
        .flavor(unique_flavor("one-round-trip").as_str())
        .read_failures(FailurePolicy::Propagate)
        .write_failures(FailurePolicy::Propagate)
        .io_timeout(S(60))
        // A write's check of a pooled connection idle past 100 ms is bounded by the batch's
        // connect deadline: as long as the reads, so a loaded machine's slow STOP/CONT does
        // not time it out.
        .connect_timeout(S(60))
        .build()
        .unwrap();
    let keys: Vec<String> = (0..30).map(|i| format!("k{i}")).collect();
    let set = |c: &Cache| {
        let failed = c
            .set_many(keys.iter().map(|k| (k.as_str(), k)), S(600))
            .unwrap();
        assert!(failed.is_empty(), "{failed:?}");
        "set_many".to_owned()
    };
    set(&cache);
    // Every master's pool holds an idle connection now.
    assert_eq!(cache.get_many::<String>(&keys).unwrap().len(), 30);
    type Call = Box<dyn Fn(&Cache) -> String + Send + Sync>;
    let calls: Vec<Call> = vec![
        Box::new({
            let keys = keys.clone();
            move |c| format!("get_many: {}", c.get_many::<String>(&keys).unwrap().len())
        }),
        Box::new({
            let keys = keys.clone();
            move |c| format!("delete_many: {}", c.delete_many(&keys).unwrap())
        }),
        Box::new({
            let keys = keys.clone();
            move |c| {
                let failed = c
                    .set_many(keys.iter().map(|k| (k.as_str(), k)), S(600))
                    .unwrap();
                format!("set_many: {} failed", failed.len())
            }
        }),
        Box::new(|c| format!("ping: {:?}", c.ping().map(drop))),
    ];
    let want = [
        "get_many: 30",
        "delete_many: 30",
        "set_many: 0 failed",
        "ping: Ok(())",
    ];
    for (call, want) in calls.into_iter().zip(want) {
        assert_eq!(unread_by(&ports), vec![0; 3], "nothing in flight before");
        for &p in &ports {
            cluster.signal(p, "STOP");
        }
        let running = {
            let cache = cache.clone();
            std::thread::spawn(move || call(&cache))
        };
        let deadline = std::time::Instant::now() + S(20);
        let mut unread = unread_by(&ports);
        while unread.contains(&0) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
            unread = unread_by(&ports);
        }
        for &p in &ports {
            cluster.signal(p, "CONT");
        }
        let got = running.join().unwrap();
        assert!(
            !unread.contains(&0),
            "{want}: the call's requests reached every master before any of them answered \
             (bytes unread per master: {unread:?})"
        );
        assert_eq!(got, want);
    }
}

/// A master killed and its replica promoted while the caches sat idle: the first call of each
/// (a single key's write, a batch; sync and async) meets the dead master (a connect refused,
/// nothing sent), asks the other nodes for the map, and goes to the new master: none fails.
#[test]
fn the_first_calls_after_a_failover_go_to_the_new_master() {
    let mut cluster = RedisCluster::start("redis-server");
    let seeds = cluster.seeds();
    let masters = cluster.masters();
    let victim = masters[0].0;
    let flavor = unique_flavor("rerouted");
    let build = |front| {
        Cache::builder()
            .redis_cluster(seeds.iter().cloned())
            .flavor(flavor.as_str())
            .read_failures(FailurePolicy::Propagate)
            .write_failures(FailurePolicy::Propagate)
            .io_timeout(S(5))
            .build_front(front)
    };
    // Every value on a replica before the kill.
    let writer = Cache::builder()
        .redis_cluster(seeds.iter().cloned())
        .flavor(flavor.as_str())
        .redis_wait(1, S(4))
        .io_timeout(S(5))
        .write_failures(FailurePolicy::Propagate)
        .build()
        .unwrap();
    let keys: Vec<String> = (0..30).map(|i| format!("k{i}")).collect();
    // A cache per first call: (front, single key or batch).
    let caches: Vec<(Front, bool, TestCache)> = [
        (Front::Sync, true),
        (Front::Sync, false),
        (Front::Async, true),
        (Front::Async, false),
    ]
    .into_iter()
    .map(|(front, single)| (front, single, build(front)))
    .collect();
    let failed = writer
        .set_many(keys.iter().map(|k| (k.as_str(), k)), S(600))
        .unwrap();
    assert!(failed.is_empty(), "{failed:?}");
    for (_, _, c) in &caches {
        assert_eq!(
            c.get_many::<String>(&keys).unwrap().len(),
            30,
            "the map known"
        );
    }
    let on_victim = keys
        .iter()
        .find(|k| master_of(&masters, slot_of(victim, &caches[0].2.make_key(k))) == victim)
        .unwrap()
        .clone();
    cluster.kill(victim);
    let live: Vec<u16> = cluster
        .ports
        .iter()
        .copied()
        .filter(|&p| p != victim)
        .collect();
    let deadline = std::time::Instant::now() + S(60);
    while cluster
        .try_masters()
        .is_none_or(|m| m.iter().any(|(p, _)| *p == victim))
    {
        assert!(std::time::Instant::now() < deadline, "no replica took over");
        std::thread::sleep(Duration::from_millis(100));
    }
    crate::fixture::wait_cluster_ok(&live, S(60));
    for (front, single, c) in &caches {
        if *single {
            c.set(&on_victim, "after", S(600)).unwrap_or_else(|e| {
                panic!("{front:?}: the first call, a set of a key of the dead master: {e}")
            });
            assert_eq!(
                c.get::<String>(&on_victim).unwrap().as_deref(),
                Some("after")
            );
        } else {
            let got = c.get_many::<String>(&keys).unwrap_or_else(|e| {
                panic!("{front:?}: the first call, a batch over every master: {e}")
            });
            assert_eq!(got.len(), 30, "{front:?}");
        }
    }
}

/// An error's whole chain, each level's text.
fn chain_of(e: &newcache::Error) -> String {
    let mut chain = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        chain.push_str(&format!(": {s}"));
        source = s.source();
    }
    chain
}

/// A slot no master serves (`CLUSTER DELSLOTS` on every node, with
/// `cluster-require-full-coverage no`: the others serve on): its master answers `CLUSTERDOWN`
/// for its keys, which fails those keys alone, in batches too, however often, and marks no node
/// dead; a cache that asks for the map afterwards finds no master for the slot, which fails the
/// same keys with an error that says so. Under the default read policy those keys are misses.
#[test]
fn an_unserved_slot_fails_only_its_own_keys_with_clusterdown() {
    let cluster = RedisCluster::start("redis-server");
    let seeds = cluster.seeds();
    let masters = cluster.masters();
    for &p in &cluster.ports {
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("cluster-require-full-coverage")
            .arg("no")
            .query(&mut node(p))
            .unwrap();
    }
    let keys: Vec<String> = (0..30).map(|i| format!("k{i}")).collect();
    for front in [Front::Sync, Front::Async] {
        let flavor = unique_flavor("unserved");
        let cache = cache_on(&seeds, &flavor, front);
        let failed = cache
            .set_many(keys.iter().map(|k| (k.as_str(), k)), S(600))
            .unwrap();
        assert!(failed.is_empty(), "{failed:?}");
        let down = &keys[0];
        let slot = slot_of(masters[0].0, &cache.make_key(down));
        let owner = master_of(&masters, slot);
        let neighbour = keys
            .iter()
            .find(|k| {
                let s = slot_of(owner, &cache.make_key(k));
                s != slot && master_of(&masters, s) == owner
            })
            .expect("another key of the same master");
        for &p in &cluster.ports {
            let () = redis::cmd("CLUSTER")
                .arg("DELSLOTS")
                .arg(slot)
                .query(&mut node(p))
                .unwrap();
        }
        // More rounds than failure_limit: an answer, never a fault.
        for _ in 0..5 {
            let e = cache.get_many::<String>(&keys).unwrap_err();
            assert_eq!(
                e.failed_keys(),
                std::slice::from_ref(down),
                "{front:?}: {e}"
            );
            let chain = chain_of(&e);
            assert!(chain.contains("CLUSTERDOWN"), "{front:?}: {chain}");
            assert!(
                chain.contains(&format!("127.0.0.1:{owner}")),
                "{front:?}: the node is named: {chain}"
            );
        }
        let e = cache.get::<String>(down).unwrap_err();
        assert!(chain_of(&e).contains("CLUSTERDOWN"), "{front:?}: {e}");
        // A cache that learns the map now finds no master for the slot.
        let fresh = cache_on(&seeds, &flavor, front);
        let e = fresh.get_many::<String>(&keys).unwrap_err();
        assert_eq!(
            e.failed_keys(),
            std::slice::from_ref(down),
            "{front:?}: {e}"
        );
        assert!(
            chain_of(&e).contains(&format!("no redis cluster master serves slot {slot}")),
            "{front:?}: {e}"
        );
        // The default read policy: those keys are misses.
        let lenient = Cache::builder()
            .redis_cluster(seeds.iter().cloned())
            .flavor(flavor.as_str())
            .build_front(front);
        assert_eq!(lenient.get::<String>(down).unwrap(), None, "{front:?}");
        assert_eq!(lenient.get_many::<String>(&keys).unwrap().len(), 29);
        let e = cache.set(down, "v", S(600)).unwrap_err();
        assert!(chain_of(&e).contains("CLUSTERDOWN"), "{front:?}: {e}");
        assert!(!e.is_outcome_unknown(), "{front:?}: refused, not lost: {e}");
        let e = cache
            .set_many(keys.iter().map(|k| (k.as_str(), k)), S(600))
            .unwrap_err();
        assert_eq!(
            e.failed_keys(),
            std::slice::from_ref(down),
            "{front:?}: {e}"
        );
        let e = cache.delete_many(&keys).unwrap_err();
        assert_eq!(
            e.failed_keys(),
            std::slice::from_ref(down),
            "{front:?}: {e}"
        );
        // The master was not marked dead: its other keys are served, its ping answers.
        cache.set(neighbour, "here", S(600)).unwrap();
        assert_eq!(
            cache.get::<String>(neighbour).unwrap().as_deref(),
            Some("here"),
            "{front:?}"
        );
        assert!(cache.ping().is_ok(), "{front:?}");
        // The slot back to its master, for the other front's turn.
        let () = redis::cmd("CLUSTER")
            .arg("ADDSLOTS")
            .arg(slot)
            .query(&mut node(owner))
            .unwrap();
        crate::fixture::wait_cluster_ok(&cluster.ports, S(30));
    }
}

/// `TRYAGAIN` is what a node answers a multi-key command whose keys a migration split between
/// two nodes; newcache sends none to a cluster node (one command per key), so a batch over the
/// keys of a half-migrated slot, some moved and some not, is served whole: each moved key
/// through `ASK`, the others where they are.
#[test]
fn a_batch_over_a_half_migrated_slot_is_served_whole() {
    let cluster = RedisCluster::start("redis-server");
    let seeds = cluster.seeds();
    let masters = cluster.masters();
    let ports: Vec<u16> = masters.iter().map(|(p, _)| *p).collect();
    for front in [Front::Sync, Front::Async] {
        let flavor = unique_flavor("half-moved");
        let cache = cache_on(&seeds, &flavor, front);
        // Two user keys whose derived keys share a slot.
        let mut seen = std::collections::HashMap::new();
        let (a, b, slot) = (0..)
            .find_map(|i| {
                let k = format!("k{i}");
                let s = slot_of(ports[0], &cache.make_key(&k));
                seen.insert(s, k.clone()).map(|other| (other, k, s))
            })
            .unwrap();
        let pair = [a.clone(), b.clone()];
        cache.set(&a, "a", S(600)).unwrap();
        cache.set(&b, "b", S(600)).unwrap();
        let from = master_of(&cluster.masters(), slot);
        let to = *ports.iter().find(|&&p| p != from).unwrap();
        begin_migration(slot, from, to);
        migrate(from, to, &[cache.make_key(&a)]);
        // What a multi-key command meets here.
        let mut mget = redis::cmd("MGET");
        mget.arg(cache.make_key(&a)).arg(cache.make_key(&b));
        let refused = mget.query::<redis::Value>(&mut node(from)).unwrap_err();
        assert_eq!(refused.code(), Some("TRYAGAIN"), "{refused}");

        let got = cache.get_many::<String>(&pair).unwrap();
        assert_eq!(got.get(&a).map(String::as_str), Some("a"), "{front:?}");
        assert_eq!(got.get(&b).map(String::as_str), Some("b"), "{front:?}");
        assert_eq!(cache.delete_many(&pair).unwrap(), 2, "{front:?}");
        assert!(cache.get_many::<String>(&pair).unwrap().is_empty());
        end_migration(slot, to, &ports);
    }
}

/// A fenced store (a `get_or_set_with` miss's `cas`) on a node that forgot the script
/// (`SCRIPT FLUSH`): `NOSCRIPT`, so the script is sent again with its source (`EVAL`) and,
/// with `redis_wait` set, its `WAIT` after it: the master ran the placeholder's `WAIT`, the
/// one after the refused `EVALSHA` and the one after the `EVAL`; the loaded value is stored
/// and on the replica.
#[test]
fn a_script_sent_again_after_noscript_is_waited_for_too() {
    let cluster = RedisCluster::start("redis-server");
    let seeds = cluster.seeds();
    let masters = cluster.masters();
    for front in [Front::Sync, Front::Async] {
        let flavor = unique_flavor("noscript-wait");
        let cache = Cache::builder()
            .redis_cluster(seeds.iter().cloned())
            .flavor(flavor.as_str())
            .redis_wait(1, S(5))
            .io_timeout(S(10))
            .read_failures(FailurePolicy::Propagate)
            .write_failures(FailurePolicy::Propagate)
            .build_front(front);
        let key = "loaded";
        let derived = cache.make_key(key);
        let master = master_of(&masters, slot_of(masters[0].0, &derived));
        // The map learnt first (its CLUSTER SLOTS is no write).
        assert!(cache.ping().is_ok());
        let () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query(&mut node(master))
            .unwrap();
        let (waits, evals) = (calls_of(&[master], "wait"), calls_of(&[master], "eval"));
        let v = cache
            .get_or_set_with(key, S(600), || Ok::<_, std::io::Error>(42u32))
            .unwrap();
        assert_eq!(v, 42, "{front:?}");
        let waits = calls_of(&[master], "wait") - waits;
        let evals = calls_of(&[master], "eval") - evals;
        assert_eq!(
            (evals, waits),
            (1, 3),
            "{front:?}: the script sent again once, and a WAIT after the placeholder, after \
             the refused EVALSHA and after the EVAL"
        );
        assert_eq!(cache.get::<u32>(key).unwrap(), Some(42), "{front:?}");
        let mut replica = node(replica_of(master));
        let () = redis::cmd("READONLY").query(&mut replica).unwrap();
        let on_replica: Option<Vec<u8>> =
            redis::cmd("GET").arg(&derived).query(&mut replica).unwrap();
        assert!(on_replica.is_some(), "{front:?}: the replica has the value");
    }
}

/// A timeout past [`MAX_TIMEOUT`](newcache::backend::memcached::MAX_TIMEOUT) (an hour) is
/// refused at `build()` with a config error naming it, on every server backend, rather than
/// overflowing a deadline later (a sync cluster batch's shared window panicked on
/// `Duration::MAX`); an hour is accepted and a sync cluster batch and `ping` work under it.
#[test]
fn timeouts_past_an_hour_are_refused_at_build_and_an_hour_works() {
    let cluster = || Cache::builder().redis_cluster(shared_redis_cluster().iter().cloned());
    let refused = [
        ("io_timeout", cluster().io_timeout(Duration::MAX).build()),
        (
            "connect_timeout",
            cluster().connect_timeout(Duration::MAX).build(),
        ),
        (
            "io_timeout",
            Cache::builder()
                .redis("redis://127.0.0.1:1/0")
                .io_timeout(Duration::MAX)
                .build(),
        ),
        (
            "io_timeout",
            Cache::builder()
                .memcached(["127.0.0.1:1"])
                .io_timeout(Duration::MAX)
                .build(),
        ),
    ];
    for (name, built) in refused {
        let e = built.expect_err("a timeout past an hour is refused");
        assert!(e.is_config() && e.to_string().contains(name), "{e}");
    }
    let cache = cluster()
        .flavor(unique_flavor("long-timeout").as_str())
        .read_failures(FailurePolicy::Propagate)
        .write_failures(FailurePolicy::Propagate)
        .io_timeout(Duration::from_secs(3_600))
        .build()
        .unwrap();
    let keys: Vec<String> = (0..10).map(|i| format!("k{i}")).collect();
    let items: Vec<(String, &u32)> = keys.iter().map(|k| (k.clone(), &7)).collect();
    assert!(
        cache
            .set_many(items, Duration::from_secs(60))
            .unwrap()
            .is_empty()
    );
    assert_eq!(cache.get_many::<u32>(&keys).unwrap().len(), 10);
    cache.ping().unwrap();
}

/// A slot no master served when the cache asked for the map (a cluster being created, a slot
/// being assigned) is served once the cluster serves it: nothing is sent for a key of a slot
/// with no master, so no node can answer `MOVED`; such a key makes the cache ask for the map
/// again instead (at most once per `retry_interval`). Lone calls and batches, both fronts.
#[test]
fn a_slot_missing_from_the_map_is_served_once_the_cluster_serves_it() {
    let cluster = RedisCluster::start("redis-server");
    let seeds = cluster.seeds();
    let masters = cluster.masters();
    for front in [Front::Sync, Front::Async] {
        let flavor = unique_flavor("hole");
        let build = || {
            Cache::builder()
                .redis_cluster(seeds.iter().cloned())
                .flavor(flavor.as_str())
                .read_failures(FailurePolicy::Propagate)
                .write_failures(FailurePolicy::Propagate)
                .retry_interval(Duration::from_millis(200))
                .build_front(front)
        };
        let (lone, batch) = (build(), build());
        let slot = slot_of(masters[0].0, &lone.make_key("k"));
        let owner = master_of(&masters, slot);
        // The slot unassigned on every node (as before `redis-cli --cluster create` assigns it).
        for &p in &cluster.ports {
            let () = redis::cmd("CLUSTER")
                .arg("DELSLOTS")
                .arg(slot)
                .query(&mut node(p))
                .unwrap();
        }
        // Each cache's first call asks for the map now: it has no master for the slot.
        let unserved = format!("no redis cluster master serves slot {slot}");
        let e = lone.get::<u32>("k").unwrap_err();
        assert!(chain_of(&e).contains(&unserved), "{front:?}: {e}");
        let e = batch.get_many::<u32>(&["k"]).unwrap_err();
        assert!(chain_of(&e).contains(&unserved), "{front:?}: {e}");
        // Assigned again, to the same master; the cluster settles.
        let () = redis::cmd("CLUSTER")
            .arg("ADDSLOTS")
            .arg(slot)
            .query(&mut node(owner))
            .unwrap();
        crate::fixture::wait_cluster_ok(&cluster.ports, S(30));
        // Generous: the map is asked again at most every 200 ms.
        let deadline = std::time::Instant::now() + S(10);
        let last = loop {
            let r = lone
                .set("k", &1u32, S(60))
                .and_then(|()| lone.get::<u32>("k"));
            match r {
                Ok(v) => break Ok(v),
                Err(e) if std::time::Instant::now() > deadline => break Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        };
        assert_eq!(
            last.as_ref().ok(),
            Some(&Some(1)),
            "{front:?}: slot {slot} is served by 127.0.0.1:{owner} again, and the cache still \
             says: {last:?}"
        );
        let last = loop {
            match batch.get_many::<u32>(&["k"]) {
                Ok(got) => break Ok(got),
                Err(e) if std::time::Instant::now() > deadline => break Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        };
        assert_eq!(
            last.as_ref().ok().and_then(|got| got.get("k")),
            Some(&1),
            "{front:?}: a batch of slot {slot}'s key: {last:?}"
        );
    }
}

/// How a killed master's node comes back at its address, wiped (no `nodes.conf`: a new node,
/// of no cluster, serving no slots, which answers `CLUSTERDOWN` for every key).
#[derive(Clone, Copy, Debug)]
enum Wiped {
    /// Once its replica took over and the cluster settled.
    AfterFailover,
    /// At once: the cluster cannot fail over by itself (the old node's address answers with
    /// another id, the old id is `noaddr`), so the operator runs `CLUSTER FAILOVER TAKEOVER`
    /// on the replica.
    AtOnceThenTakeover,
}

/// A master killed and its node back wiped at the same address: once the cluster settled,
/// caches idle through it serve their first call (both front ends, a single key and a batch),
/// and a cache called throughout is served again within a few `retry_interval`s.
fn a_master_back_wiped_at_its_address(how: Wiped) {
    let mut cluster = RedisCluster::start("redis-server");
    let seeds = cluster.seeds();
    let masters = cluster.masters();
    let victim = masters[0].0;
    let replica = replica_of(victim);
    let victim_id = id_of(victim);
    let flavor = unique_flavor("wiped");
    let build = |front| {
        Cache::builder()
            .redis_cluster(seeds.iter().cloned())
            .flavor(flavor.as_str())
            .read_failures(FailurePolicy::Propagate)
            .write_failures(FailurePolicy::Propagate)
            .retry_interval(MS(200))
            .io_timeout(S(5))
            .build_front(front)
    };
    let keys: Vec<String> = (0..30).map(|i| format!("k{i}")).collect();
    // A cache per first call: (front, single key or batch).
    let idle: Vec<(Front, bool, TestCache)> = [
        (Front::Sync, true),
        (Front::Sync, false),
        (Front::Async, true),
        (Front::Async, false),
    ]
    .into_iter()
    .map(|(front, single)| (front, single, build(front)))
    .collect();
    let busy = build(Front::Sync);
    let failed = busy
        .set_many(keys.iter().map(|k| (k.as_str(), k)), S(600))
        .unwrap();
    assert!(failed.is_empty(), "{failed:?}");
    for (_, _, c) in &idle {
        assert_eq!(
            c.get_many::<String>(&keys).unwrap().len(),
            30,
            "the map known"
        );
    }
    let on_victim = keys
        .iter()
        .find(|k| master_of(&masters, slot_of(victim, &busy.make_key(k))) == victim)
        .unwrap()
        .clone();
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = busy.get_many::<String>(&keys);
                let _ = busy.set(&on_victim, "busy", S(600));
                std::thread::sleep(MS(20));
            }
        });
        cluster.kill(victim);
        match how {
            Wiped::AfterFailover => {
                cluster.wait_taken_over(victim, S(60));
                cluster.start_wiped(victim);
            }
            Wiped::AtOnceThenTakeover => {
                cluster.start_wiped(victim);
                let deadline = Instant::now() + S(60);
                loop {
                    let nodes: String = redis::cmd("CLUSTER")
                        .arg("NODES")
                        .query(&mut node(replica))
                        .unwrap();
                    let old = nodes.lines().find(|l| l.starts_with(&victim_id));
                    if old.is_some_and(|l| l.contains("noaddr")) {
                        break;
                    }
                    assert!(
                        Instant::now() < deadline,
                        "the old node never lost its address: {nodes}"
                    );
                    std::thread::sleep(MS(100));
                }
                let () = redis::cmd("CLUSTER")
                    .arg("FAILOVER")
                    .arg("TAKEOVER")
                    .query(&mut node(replica))
                    .unwrap();
                cluster.wait_taken_over(victim, S(60));
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    for (front, single, c) in &idle {
        if *single {
            c.set(&on_victim, "after", S(600)).unwrap_or_else(|e| {
                panic!("{how:?} {front:?}: the first call, a set of a key of the wiped master: {e}")
            });
            assert_eq!(
                c.get::<String>(&on_victim).unwrap().as_deref(),
                Some("after"),
                "{how:?} {front:?}"
            );
        } else {
            let failed = c
                .set_many(keys.iter().map(|k| (k.as_str(), "after")), S(600))
                .unwrap_or_else(|e| {
                    panic!("{how:?} {front:?}: the first call, a batch over every master: {e}")
                });
            assert!(failed.is_empty(), "{how:?} {front:?}: {failed:?}");
            let got = c.get_many::<String>(&keys).unwrap();
            assert_eq!(got.len(), 30, "{how:?} {front:?}");
        }
    }
    // Generous: the map is asked again at most every 200 ms.
    let deadline = Instant::now() + S(10);
    while let Err(e) = busy
        .get_many::<String>(&keys)
        .and_then(|_| busy.set(&on_victim, "busy", S(600)))
    {
        assert!(
            Instant::now() < deadline,
            "{how:?}: the cache called throughout is still refused: {e}"
        );
        std::thread::sleep(MS(50));
    }
    for _ in 0..10 {
        busy.get_many::<String>(&keys).unwrap();
        busy.set(&on_victim, "busy", S(600)).unwrap();
    }
}

#[test]
fn a_master_back_wiped_after_its_failover_is_served_by_the_new_master() {
    a_master_back_wiped_at_its_address(Wiped::AfterFailover);
}

#[test]
fn a_master_back_wiped_at_once_is_served_by_the_replica_the_operator_promoted() {
    a_master_back_wiped_at_its_address(Wiped::AtOnceThenTakeover);
}

/// A cluster really down (a master killed, no replica allowed to take over): every node answers
/// `CLUSTERDOWN The cluster is down`, and the error says what the node said. Each such answer
/// asks the nodes for the slot map again (a failover may have changed it), but a cache asks at
/// most once per `retry_interval`, however many calls and batches are refused meanwhile.
#[test]
fn a_cluster_really_down_is_asked_for_its_map_at_most_once_per_retry_interval() {
    let mut cluster = RedisCluster::start("redis-server");
    no_failover(&cluster);
    let seeds = cluster.seeds();
    let masters = cluster.masters();
    let victim = masters[0].0;
    let live = cluster.others(victim);
    let interval = MS(500);
    let flavor = unique_flavor("down");
    let build = |front| {
        Cache::builder()
            .redis_cluster(seeds.iter().cloned())
            .flavor(flavor.as_str())
            .read_failures(FailurePolicy::Propagate)
            .write_failures(FailurePolicy::Propagate)
            .retry_interval(interval)
            .build_front(front)
    };
    let caches = [
        (Front::Sync, build(Front::Sync)),
        (Front::Async, build(Front::Async)),
    ];
    // Keys of the masters that stay up: refused, never a fault.
    let keys: Vec<String> = (0..)
        .map(|i| format!("k{i}"))
        .filter(|k| master_of(&masters, slot_of(live[0], &caches[0].1.make_key(k))) != victim)
        .take(20)
        .collect();
    for (front, cache) in &caches {
        let failed = cache
            .set_many(keys.iter().map(|k| (k.as_str(), k)), S(600))
            .unwrap();
        assert!(failed.is_empty(), "{front:?}: {failed:?}");
    }
    cluster.kill(victim);
    let deadline = Instant::now() + S(30);
    for &p in &live {
        loop {
            let info: String = redis::cmd("CLUSTER")
                .arg("INFO")
                .query(&mut node(p))
                .unwrap();
            if info.contains("cluster_state:fail") {
                break;
            }
            assert!(Instant::now() < deadline, "the cluster never went down");
            std::thread::sleep(MS(100));
        }
    }
    for (front, cache) in &caches {
        let before = calls_of(&live, "cluster|slots");
        let started = Instant::now();
        for _ in 0..50 {
            let e = cache.get::<String>(&keys[0]).unwrap_err();
            assert!(
                chain_of(&e).contains("CLUSTERDOWN The cluster is down"),
                "{front:?}: {e}"
            );
            let e = cache.get_many::<String>(&keys).unwrap_err();
            assert_eq!(e.failed_keys().len(), keys.len(), "{front:?}: {e}");
            assert!(
                chain_of(&e).contains("CLUSTERDOWN The cluster is down"),
                "{front:?}: {e}"
            );
        }
        let periods = started.elapsed().as_millis() / interval.as_millis() + 1;
        let asked = calls_of(&live, "cluster|slots") - before;
        assert!(
            (1..=periods as u64).contains(&asked),
            "{front:?}: 100 refused calls over {periods} retry intervals asked for the map \
             {asked} times"
        );
    }
}

/// A bus on a cluster's sharded pub/sub whose channel's slot moves to another master: the
/// subscribers are unsubscribed by the server, which counts as a reconnect (no copy read
/// before is served as a hit), they subscribe on the slot's new master, and the writers
/// publish there: a write is seen again through the bus, with the near ttl far off.
#[test]
fn a_bus_whose_channel_slot_moves_follows_it() {
    let cluster = RedisCluster::start("redis-server");
    let seeds = cluster.seeds();
    let ports: Vec<u16> = cluster.masters().iter().map(|(p, _)| *p).collect();
    let channel = unique_flavor("bus-moved");
    let server = crate::fixture::shared_server();
    let flavor = unique_flavor("bus-moved");
    let cache = |addr: String| {
        Cache::builder()
            .memcached([addr])
            .flavor(flavor.clone())
            .near_cache(1 << 20)
            .near_ttl(S(3600))
            .near_bus(newcache::RedisBus::cluster(seeds.iter(), channel.clone()).unwrap())
            .near_bus_heartbeat(MS(100))
            .build()
            .unwrap()
    };
    // Over the same memcached named two ways: caches that share no write fence, as two
    // processes.
    let reader = cache(server.to_string());
    let writer = cache(server.replace("127.0.0.1", "localhost"));
    let seen = |want: &str| {
        let deadline = Instant::now() + S(10);
        loop {
            let before = reader.stats();
            let got = reader.get::<String>("k").unwrap();
            if got.as_deref() == Some(want) && reader.stats().near_hits > before.near_hits {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{want} never served near: {got:?}"
            );
            std::thread::sleep(MS(5));
        }
    };
    writer.set("k", "v1", S(3600)).unwrap();
    seen("v1");
    writer.set("k", "v2", S(3600)).unwrap();
    seen("v2");

    let slot = slot_of(ports[0], &channel);
    let from = master_of(&cluster.masters(), slot);
    let to = *ports.iter().find(|&&p| p != from).unwrap();
    begin_migration(slot, from, to);
    end_migration(slot, to, &ports);
    let deadline = Instant::now() + S(10);
    while reader.stats().bus_reconnects == 0 {
        assert!(
            Instant::now() < deadline,
            "the slot's move was never noticed"
        );
        std::thread::sleep(MS(5));
    }
    writer.set("k", "v3", S(3600)).unwrap();
    seen("v3");
    writer.set("k", "v4", S(3600)).unwrap();
    seen("v4");
}
