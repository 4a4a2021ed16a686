//! Several processes on one memcached: the test binary runs copies of itself as the other
//! processes (a child runs `processes::child` with the parent's instructions in its environment).

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
