//! An adversarial review of the Redis backend: each test shows one finding (and fails while it
//! stands). Servers and clusters are the tests' own.

use std::thread;
use std::time::{Duration, Instant};

use newcache::{Cache, FailurePolicy};

use crate::fixture::{RedisServer, unique_flavor};

const S: fn(u64) -> Duration = Duration::from_secs;

fn raw(port: u16) -> redis::Connection {
    redis::Client::open(format!("redis://127.0.0.1:{port}/"))
        .and_then(|c| c.get_connection())
        .unwrap()
}

/// Finding: with `redis_wait`, the async view sends each write's `WAIT` on its one multiplexed
/// connection (src/backend/redis/nonblocking.rs, `send`; request.rs `Builder::waited`). `WAIT`
/// blocks the connection it came on: every other caller's command queued behind it (reads
/// included) waits until it returns. With a replica gone, each write's `WAIT` holds the shared
/// connection for the whole wait; a few concurrent writes push the reads behind them past
/// `io_timeout`: they fail as transport faults and the healthy master is marked dead (README:
/// "The server is not marked dead for it").
#[test]
fn review_a_replicas_absence_never_fails_reads_nor_marks_the_master_dead_async() {
    let master = RedisServer::start("redis-server");
    // Its copy of the master's data in a directory of its own, not the working directory.
    let dir = std::env::temp_dir().join(format!("newcache-review-replica-{}", master.port));
    std::fs::create_dir_all(&dir).unwrap();
    let mut replica = RedisServer::start_with(
        "redis-server",
        &[
            "--replicaof",
            "127.0.0.1",
            &master.port.to_string(),
            "--dir",
            dir.to_str().unwrap(),
        ],
    );
    let deadline = Instant::now() + S(20);
    loop {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query(&mut raw(master.port))
            .unwrap();
        if info.contains("connected_slaves:1") && info.contains("state=online") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the replica never synced: {info}"
        );
        thread::sleep(Duration::from_millis(50));
    }
    let cache = Cache::builder()
        .redis(master.url())
        .flavor(unique_flavor("review-wait"))
        .redis_wait(1, Duration::from_millis(150))
        .io_timeout(Duration::from_millis(500))
        .read_failures(FailurePolicy::Propagate)
        .write_failures(FailurePolicy::Propagate)
        .build_async()
        .unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async { cache.set("r", &1u32, S(60)).await.unwrap() });
    // The replica dies: each WAIT now lasts its whole 150 ms and answers 0.
    replica.kill();
    let (reads, writes) = rt.block_on(async {
        let writers: Vec<_> = (0..6)
            .map(|i| {
                let c = cache.clone();
                tokio::spawn(async move {
                    let mut out = Vec::new();
                    for j in 0..3 {
                        out.push(c.set(&format!("w{i}-{j}"), &1u32, S(60)).await);
                    }
                    out
                })
            })
            .collect();
        let mut reads = Vec::new();
        for _ in 0..30 {
            tokio::time::sleep(Duration::from_millis(30)).await;
            reads.push(cache.get::<u32>("r").await);
        }
        let mut writes = Vec::new();
        for w in writers {
            writes.extend(w.await.unwrap());
        }
        (reads, writes)
    });
    let failed_reads: Vec<String> = reads
        .iter()
        .filter_map(|r| r.as_ref().err().map(|e| e.to_string()))
        .collect();
    // A write may fail only with its shortfall (the master has it, and answered).
    let faulted_writes: Vec<String> = writes
        .iter()
        .filter_map(|r| r.as_ref().err().map(|e| e.to_string()))
        .filter(|e| !e.contains("replicas acknowledged the write"))
        .collect();
    assert!(
        failed_reads.is_empty() && faulted_writes.is_empty(),
        "a replica gone, {} of 30 reads of a healthy master failed ({:?}) and {} of 18 writes \
         failed as transport faults, each queued for a replay that deletes it ({:?})",
        failed_reads.len(),
        failed_reads.first(),
        faulted_writes.len(),
        faulted_writes.first()
    );
}
