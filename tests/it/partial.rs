//! One dead server costs only its own keys, through the facade: `get_many`,
//! `get_many_or_set_with`, `set_many` and `delete_many` with one of three servers killed, under
//! both failure policies.

use std::collections::HashMap;
use std::io;
use std::sync::Mutex;
use std::time::Duration;

use newcache::{Cache, FailurePolicy, MemcachedBackend, MemcachedConfig, ServerSpec};

use crate::fixture::{Memcached, unique_flavor};

const S: fn(u64) -> Duration = Duration::from_secs;

struct Cluster {
    servers: Vec<Memcached>,
    addrs: Vec<String>,
    flavor: String,
    keys: Vec<String>,
}

impl Cluster {
    /// Three servers holding 60 keys (`k0`..`k59` = their names); then one server is killed.
    fn with_one_dead(tag: &str) -> (Cluster, Vec<String>) {
        let servers: Vec<Memcached> = (0..3).map(|_| Memcached::start()).collect();
        let addrs: Vec<String> = servers.iter().map(Memcached::addr).collect();
        let mut c = Cluster {
            servers,
            addrs,
            flavor: unique_flavor(tag),
            keys: (0..60).map(|i| format!("k{i}")).collect(),
        };
        let cache = c.cache(FailurePolicy::Absorb, FailurePolicy::Propagate);
        let failed = cache
            .set_many(c.keys.iter().map(|k| (k.as_str(), k)), S(600))
            .unwrap();
        assert!(failed.is_empty());
        // the dead server's keys, by where the cluster placed them
        let ring = MemcachedBackend::new(MemcachedConfig::new(
            c.addrs
                .iter()
                .map(|a| ServerSpec::parse(a).unwrap())
                .collect(),
        ))
        .unwrap();
        let dead: Vec<String> = c
            .keys
            .iter()
            .filter(|k| ring.server_of(&cache.make_key(k)) == 2)
            .cloned()
            .collect();
        assert!(
            !dead.is_empty() && dead.len() < 60,
            "{} keys on server 2",
            dead.len()
        );
        c.servers[2].kill();
        (c, dead)
    }

    fn cache(&self, reads: FailurePolicy, writes: FailurePolicy) -> Cache {
        Cache::builder()
            .memcached(&self.addrs)
            .flavor(self.flavor.clone())
            .read_failures(reads)
            .write_failures(writes)
            .connect_timeout(Duration::from_millis(500))
            .build()
            .unwrap()
    }
}

#[test]
fn get_many_returns_what_the_live_servers_hold() {
    let (c, dead) = Cluster::with_one_dead("partial-get");
    let cache = c.cache(FailurePolicy::Absorb, FailurePolicy::Propagate);
    // 0.1.0 returned no value at all here.
    let got = cache.get_many::<String>(&c.keys).unwrap();
    let live: Vec<&String> = c.keys.iter().filter(|k| !dead.contains(k)).collect();
    assert_eq!(got.len(), live.len(), "dead: {dead:?}");
    for k in &live {
        assert_eq!(got.get(*k), Some(*k));
    }
    // the same as single gets
    let singles = c
        .keys
        .iter()
        .filter(|k| cache.get::<String>(k).unwrap().is_some());
    assert_eq!(singles.count(), live.len());

    // Propagate: a partial batch is an error naming exactly the dead server's keys.
    let strict = c.cache(FailurePolicy::Propagate, FailurePolicy::Propagate);
    let e = strict.get_many::<String>(&c.keys).unwrap_err();
    assert!(e.is_backend(), "{e}");
    let mut named = e.failed_keys().to_vec();
    named.sort();
    let mut want = dead.clone();
    want.sort();
    assert_eq!(named, want);
}

#[test]
fn get_many_or_set_with_loads_only_what_it_could_not_read() {
    let (c, dead) = Cluster::with_one_dead("partial-load");
    let cache = c.cache(FailurePolicy::Absorb, FailurePolicy::Propagate);
    let asked = Mutex::new(Vec::new());
    let got = cache
        .get_many_or_set_with(&c.keys, S(600), |missing| {
            asked.lock().unwrap().extend(missing.iter().cloned());
            Ok::<_, io::Error>(
                missing
                    .iter()
                    .map(|k| (k.clone(), format!("loaded {k}")))
                    .collect::<HashMap<_, _>>(),
            )
        })
        .unwrap();
    let mut asked = asked.into_inner().unwrap();
    asked.sort();
    let mut want = dead.clone();
    want.sort();
    assert_eq!(asked, want, "only the dead server's keys are loaded");
    assert_eq!(got.len(), 60);
    for k in &c.keys {
        let v = &got[k];
        if dead.contains(k) {
            assert_eq!(v, &format!("loaded {k}"));
        } else {
            assert_eq!(v, k);
        }
    }
}

#[test]
fn set_many_and_delete_many_name_the_failed_keys() {
    let (c, dead) = Cluster::with_one_dead("partial-write");
    let mut want = dead.clone();
    want.sort();
    // Absorb: the failed keys are returned, the others written.
    let lenient = c.cache(FailurePolicy::Absorb, FailurePolicy::Absorb);
    let mut failed = lenient
        .set_many(c.keys.iter().map(|k| (k.as_str(), "new")), S(600))
        .unwrap();
    failed.sort();
    assert_eq!(failed, want);
    let got = lenient.get_many::<String>(&c.keys).unwrap();
    assert!(got.values().all(|v| v == "new") && got.len() == 60 - dead.len());
    // Propagate (the default write policy): an error naming them; the others were written.
    let strict = c.cache(FailurePolicy::Absorb, FailurePolicy::Propagate);
    let e = strict
        .set_many(c.keys.iter().map(|k| (k.as_str(), "newer")), S(600))
        .unwrap_err();
    let mut named = e.failed_keys().to_vec();
    named.sort();
    assert_eq!(named, want);
    let live = c.keys.iter().find(|k| !dead.contains(k)).unwrap();
    assert_eq!(
        strict.get::<String>(live).unwrap().as_deref(),
        Some("newer")
    );
    let e = strict.delete_many(&c.keys).unwrap_err();
    assert_eq!(e.failed_keys().len(), dead.len());
    assert_eq!(
        strict.get::<String>(live).unwrap(),
        None,
        "live keys were deleted"
    );
    assert_eq!(lenient.delete_many(&c.keys).unwrap(), 0);
}

#[test]
fn a_server_dying_mid_load_costs_no_loaded_value() {
    let servers: Vec<Memcached> = (0..3).map(|_| Memcached::start()).collect();
    let addrs: Vec<String> = servers.iter().map(Memcached::addr).collect();
    let servers = Mutex::new(servers);
    // The default write policy (Propagate): a failed store of a loaded value is counted, and the
    // value still returned, as get_or_set_with does.
    let cache = Cache::builder()
        .memcached(&addrs)
        .flavor(unique_flavor("partial-midload"))
        .connect_timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    let keys: Vec<String> = (0..30).map(|i| format!("m{i}")).collect();
    let got = cache
        .get_many_or_set_with(&keys, S(600), |missing| {
            assert_eq!(missing.len(), 30);
            servers.lock().unwrap()[2].kill();
            Ok::<_, io::Error>(
                missing
                    .iter()
                    .map(|k| (k.clone(), k.clone()))
                    .collect::<HashMap<_, _>>(),
            )
        })
        .unwrap();
    assert_eq!(got.len(), 30);
    assert!(keys.iter().all(|k| got[k] == *k));
    assert!(
        cache.stats().backend_errors > 0,
        "the failed stores are counted"
    );
}

/// A 1.5 MB value another client wrote (the server runs with `-I 2m`) is its key's problem
/// alone: `get_many` returns the other keys, and `get_many_or_set_with` loads only that key.
#[test]
fn a_foreign_over_limit_value_costs_only_its_key() {
    let server = Memcached::start_with(&["-I", "2m"]);
    let cache = Cache::builder()
        .memcached([server.addr()])
        .flavor(unique_flavor("partial-big"))
        .build()
        .unwrap();
    cache.set("small", "s", S(600)).unwrap();
    let foreign = memcache::connect(format!("memcache://{}?protocol=ascii", server.addr()))
        .expect("memcache client connects");
    foreign
        .set(
            &cache.make_key("big"),
            vec![b'z'; 1536 * 1024].as_slice(),
            0,
        )
        .unwrap();
    let got = cache.get_many::<String>(&["small", "big"]).unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got["small"], "s");
    let asked = Mutex::new(Vec::new());
    let got = cache
        .get_many_or_set_with(&["small", "big"], S(600), |missing| {
            asked.lock().unwrap().extend(missing.iter().cloned());
            Ok::<_, io::Error>(
                missing
                    .iter()
                    .map(|k| (k.clone(), "loaded".to_string()))
                    .collect::<HashMap<_, _>>(),
            )
        })
        .unwrap();
    assert_eq!(asked.into_inner().unwrap(), vec!["big".to_string()]);
    assert_eq!(
        (got["small"].as_str(), got["big"].as_str()),
        ("s", "loaded")
    );
    assert!(cache.stats().too_large >= 2);
}

/// A hung server read first in a batch does not take the other servers' keys down with it,
/// nor get them ejected: their replies are already waiting when its timeout ends.
#[test]
fn a_hung_server_in_a_batch_costs_only_its_keys() {
    let servers: Vec<Memcached> = (0..3).map(|_| Memcached::start()).collect();
    let addrs: Vec<String> = servers.iter().map(Memcached::addr).collect();
    let cache = Cache::builder()
        .memcached(&addrs)
        .flavor(unique_flavor("partial-hung"))
        .io_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let keys: Vec<String> = (0..60).map(|i| format!("h{i}")).collect();
    assert!(
        cache
            .set_many(keys.iter().map(|k| (k.as_str(), k)), S(600))
            .unwrap()
            .is_empty()
    );
    let ring = MemcachedBackend::new(MemcachedConfig::new(
        addrs
            .iter()
            .map(|a| ServerSpec::parse(a).unwrap())
            .collect(),
    ))
    .unwrap();
    // Server 0 is read first in every batch.
    let on_hung: Vec<&String> = keys
        .iter()
        .filter(|k| ring.server_of(&cache.make_key(k)) == 0)
        .collect();
    servers[0].signal("STOP");
    for round in 0..3 {
        let got = cache.get_many::<String>(&keys).unwrap();
        assert_eq!(got.len(), 60 - on_hung.len(), "round {round}");
    }
    // the healthy servers were not ejected: single gets of their keys still work
    for k in keys.iter().filter(|k| !on_hung.contains(k)) {
        assert_eq!(cache.get::<String>(k).unwrap().as_ref(), Some(k));
    }
    servers[0].signal("CONT");
}
