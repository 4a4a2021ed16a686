//! Several processes on one memcached: the test binary runs copies of itself as the other
//! processes (a child runs `processes::child` or `processes::unstorable_child` with the
//! parent's instructions in its environment).

use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use newcache::Cache;

use crate::fixture::Memcached;

/// Where a child finds its memcached, and when to start (unix ms).
const ADDR: &str = "NEWCACHE_TEST_CHILD_ADDR";
const START: &str = "NEWCACHE_TEST_CHILD_START_MS";
const KEYS: usize = 30;

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// A child: with one `random_seed`, calls `get_or_set_with` on `KEYS` missing keys, each at an
/// instant shared with the other child (spinning until then, so both send their first read
/// together), and prints how many loads it ran. Without the parent's environment: nothing.
#[test]
#[ignore = "run by two_processes_with_one_seed_elect_one_loader"]
fn child() {
    let (Ok(addr), Ok(start)) = (std::env::var(ADDR), std::env::var(START)) else {
        return;
    };
    let start: u64 = start.parse().unwrap();
    let cache = Cache::builder()
        .memcached([addr.as_str()])
        .flavor("seeded")
        .random_seed(42)
        .max_wait(Duration::from_secs(10))
        .build()
        .unwrap();
    cache.get::<u8>("warm the connection").unwrap();
    let mut loads = 0;
    for i in 0..KEYS {
        let at = start + 100 * i as u64;
        while unix_ms() < at {
            std::hint::spin_loop();
        }
        cache
            .get_or_set_with(&format!("k{i}"), Duration::from_secs(60), || {
                loads += 1;
                // Long enough that the other process reads while this load runs.
                std::thread::sleep(Duration::from_millis(30));
                Ok::<_, std::io::Error>(i as u64)
            })
            .unwrap();
    }
    println!("\nloads={loads}");
}

/// Two processes built with the same `random_seed` miss the same keys at the same instants:
/// one load per key between them (equal seeds once gave equal claim tokens, and each process
/// took the other's placeholder for its own).
#[test]
fn two_processes_with_one_seed_elect_one_loader() {
    let server = Memcached::start();
    let start = unix_ms() + 1500;
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..2)
        .map(|_| {
            Command::new(&exe)
                .args(["--exact", "processes::child", "--ignored", "--nocapture"])
                .args(["--test-threads", "1"])
                .env(ADDR, server.addr())
                .env(START, start.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut total = 0;
    for c in children {
        let out = c.wait_with_output().unwrap();
        assert!(out.status.success(), "a child failed");
        let text = String::from_utf8(out.stdout).unwrap();
        let loads: usize = text
            .lines()
            .find_map(|l| l.split_once("loads=").map(|(_, n)| n.trim()))
            .unwrap_or_else(|| panic!("no count in the child's output: {text}"))
            .parse()
            .unwrap();
        total += loads;
    }
    assert_eq!(total, KEYS, "one load per key across both processes");
}

/// Where an `unstorable_child` finds its memcached.
const UNSTORABLE_ADDR: &str = "NEWCACHE_TEST_UNSTORABLE_ADDR";
const BIG: usize = 2 << 20;

fn unstorable_cache(addr: &str) -> Cache {
    Cache::builder()
        .memcached([addr])
        .flavor("unstorable")
        .max_wait(Duration::from_secs(30))
        .build()
        .unwrap()
}

/// A child: says it is ready, then loads key `k` (which the parent holds) with a loader that
/// waits up to 5 s for the other child's loader to run too, and prints whether it did.
#[test]
#[ignore = "run by waiters_in_two_processes_behind_an_unstorable_load_each_load_at_once"]
fn unstorable_child() {
    let Ok(addr) = std::env::var(UNSTORABLE_ADDR) else {
        return;
    };
    let cache = unstorable_cache(&addr);
    cache
        .incr_or_create("ready", 1, Duration::from_secs(60))
        .unwrap();
    let v: Vec<u8> = cache
        .get_or_set_with("k", Duration::from_secs(60), || {
            cache.incr_or_create("arrived", 1, Duration::from_secs(60))?;
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while cache.get_counter("arrived")? < Some(2) {
                if std::time::Instant::now() > deadline {
                    return Ok::<_, newcache::Error>(Vec::new());
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Ok(vec![1u8; BIG])
        })
        .unwrap();
    println!("\nmet={}", v.len() == BIG);
}

/// The parent holds a placeholder while two other processes wait behind it; its value is too
/// large to store. Both then load at once (their loaders meet), instead of one loading behind
/// the other's placeholder in turn.
#[test]
fn waiters_in_two_processes_behind_an_unstorable_load_each_load_at_once() {
    let server = Memcached::start();
    let holder = unstorable_cache(&server.addr());
    let exe = std::env::current_exe().unwrap();
    let (started_tx, started_rx) = std::sync::mpsc::channel::<()>();
    let (finish_tx, finish_rx) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|s| {
        let h = s.spawn(|| {
            holder
                .get_or_set_with("k", Duration::from_secs(60), move || {
                    started_tx.send(()).unwrap();
                    finish_rx.recv().unwrap();
                    Ok::<_, std::io::Error>(vec![7u8; BIG])
                })
                .unwrap()
        });
        started_rx.recv().unwrap();
        let children: Vec<_> = (0..2)
            .map(|_| {
                Command::new(&exe)
                    .args(["--exact", "processes::unstorable_child", "--ignored"])
                    .args(["--nocapture", "--test-threads", "1"])
                    .env(UNSTORABLE_ADDR, server.addr())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::inherit())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while holder.get_counter("ready").unwrap() < Some(2) {
            assert!(
                std::time::Instant::now() < deadline,
                "the children never started"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        // Let them reach their wait (not needed for the outcome: a late one finds the marker).
        std::thread::sleep(Duration::from_millis(300));
        finish_tx.send(()).unwrap();
        assert_eq!(h.join().unwrap().len(), BIG);
        for c in children {
            let out = c.wait_with_output().unwrap();
            assert!(out.status.success(), "a child failed");
            let text = String::from_utf8(out.stdout).unwrap();
            assert!(
                text.lines().any(|l| l.trim() == "met=true"),
                "a child's loader ran alone: {}",
                text.lines()
                    .find(|l| l.starts_with("met="))
                    .unwrap_or("no answer")
            );
        }
    });
}
