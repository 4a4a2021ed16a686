//! Key placement over several servers: the same as a real libmemcached client, and stable when
//! the cluster changes. No server needed: placement is computed, not observed.

use newcache::{MemcachedBackend, MemcachedConfig, ServerSpec};

fn backend(servers: &[(&str, u16, u32)]) -> MemcachedBackend {
    let specs = servers
        .iter()
        .map(|(h, p, w)| {
            ServerSpec::parse(&format!("{h}:{p}"))
                .unwrap()
                .with_weight(*w)
        })
        .collect();
    MemcachedBackend::new(MemcachedConfig::new(specs)).unwrap()
}

/// `tests/data/ketama_vectors.json` was written by `tests/data/ketama_vectors.py`: pylibmc
/// (libmemcached) with ketama + ketama_weighted put these keys on real servers, including servers
/// on port 11211 (named without the port in the continuum) and weighted ones.
#[test]
fn placement_matches_libmemcached_weighted_ketama() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/ketama_vectors.json"
    ))
    .unwrap();
    let data: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut checked = 0;
    for config in data["configs"].as_array().unwrap() {
        let servers: Vec<(String, u16, u32)> = config["servers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                (
                    s["host"].as_str().unwrap().to_string(),
                    s["port"].as_u64().unwrap() as u16,
                    s["weight"].as_u64().unwrap() as u32,
                )
            })
            .collect();
        let refs: Vec<(&str, u16, u32)> = servers
            .iter()
            .map(|(h, p, w)| (h.as_str(), *p, *w))
            .collect();
        let b = backend(&refs);
        for (key, want) in config["placement"].as_object().unwrap() {
            let want = want.as_u64().unwrap() as usize;
            assert_eq!(b.server_of(key), want, "{}: key {key:?}", config["name"]);
            checked += 1;
        }
    }
    assert!(checked >= 1600, "{checked} placements checked");
}

/// Adding or removing one of N servers moves about 1/N of the keys, and only to or from it.
#[test]
fn changing_the_cluster_moves_about_one_nth_of_the_keys() {
    let five: Vec<(&str, u16, u32)> = vec![
        ("10.0.0.1", 11211, 1),
        ("10.0.0.2", 11211, 1),
        ("10.0.0.3", 11211, 1),
        ("10.0.0.4", 11211, 1),
        ("10.0.0.5", 11211, 1),
    ];
    let four = &five[..4];
    let (b5, b4) = (backend(&five), backend(four));
    let keys: Vec<String> = (0..20_000)
        .map(|i| newcache::default_key("", 1, &format!("k{i}")))
        .collect();
    let mut moved = 0;
    for k in &keys {
        let (a, b) = (b4.server_of(k), b5.server_of(k));
        if a != b {
            assert_eq!(b, 4, "a key only moves to the added server");
            moved += 1;
        }
    }
    let frac = moved as f64 / keys.len() as f64;
    println!(
        "adding a 5th server moved {:.1} % of the keys (1/5 = 20 %)",
        frac * 100.0
    );
    assert!((0.14..0.26).contains(&frac), "{frac}");
}
