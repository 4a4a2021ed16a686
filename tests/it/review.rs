//! An adversarial review of the Redis backend: each test shows one finding (and fails while it
//! stands). Servers and clusters are the tests' own.

use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use newcache::{Cache, FailurePolicy, Ttl};

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

/// A 3-master cluster (no replicas) listening on `::1` only: its ports, and the children (killed
/// on drop).
struct Ipv6Cluster {
    ports: Vec<u16>,
    children: Vec<std::process::Child>,
    dir: std::path::PathBuf,
}

impl Drop for Ipv6Cluster {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Ipv6Cluster {
    fn start() -> Ipv6Cluster {
        let mut ports = Vec::new();
        while ports.len() < 3 {
            let p = TcpListener::bind("[::1]:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            if p < 50_000 && TcpListener::bind(("::1", p + 10_000)).is_ok() && !ports.contains(&p) {
                ports.push(p);
            }
        }
        let dir = std::env::temp_dir().join(format!("newcache-review-v6-{}", ports[0]));
        let mut children = Vec::new();
        for &p in &ports {
            let d = dir.join(p.to_string());
            std::fs::create_dir_all(&d).unwrap();
            let child = std::process::Command::new("redis-server")
                .args([
                    "--port",
                    &p.to_string(),
                    "--bind",
                    "::1",
                    "--cluster-enabled",
                    "yes",
                ])
                .args([
                    "--cluster-config-file",
                    "nodes.conf",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                ])
                .args(["--protected-mode", "no", "--loglevel", "warning"])
                .current_dir(&d)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap();
            children.push(child);
        }
        let cluster = Ipv6Cluster {
            ports,
            children,
            dir,
        };
        for &p in &cluster.ports {
            let deadline = Instant::now() + S(10);
            while TcpStream::connect(("::1", p)).is_err() {
                assert!(Instant::now() < deadline, "node {p} did not come up");
                thread::sleep(Duration::from_millis(20));
            }
        }
        let nodes: Vec<String> = cluster.ports.iter().map(|p| format!("::1:{p}")).collect();
        let out = std::process::Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&nodes)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
        let deadline = Instant::now() + S(30);
        'settle: loop {
            assert!(Instant::now() < deadline, "the IPv6 cluster did not settle");
            thread::sleep(Duration::from_millis(100));
            for &p in &cluster.ports {
                let info: String = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query(&mut cluster.node(p))
                    .unwrap();
                if !info.contains("cluster_state:ok") {
                    continue 'settle;
                }
            }
            break;
        }
        cluster
    }

    fn node(&self, port: u16) -> redis::Connection {
        redis::Client::open(format!("redis://[::1]:{port}/"))
            .and_then(|c| c.get_connection())
            .unwrap()
    }
}

/// Finding: on a cluster reached over IPv6, a `MOVED` names the node as Redis prints it,
/// `MOVED 8831 ::1:7002`, without brackets. `slots::redirect` (src/backend/redis/slots.rs:127)
/// takes an address starting with `:` for "a node that does not know its own address" and
/// answers `None`: the redirect is not followed, and the `MOVED` reaches the caller as "the
/// server refused the command". Being an answer, not a fault, it refreshes no map: every later
/// call of the moved slot fails the same way. (Followed, `::1:7002` would still be another
/// node than the map's `[::1]:7002`, `slots::addr_of`; and `RedisConfig::addr` names a seed
/// `::1:7000` too: two health and replay records for one server.)
#[test]
fn review_a_moved_slot_is_followed_on_an_ipv6_cluster() {
    let cluster = Ipv6Cluster::start();
    let cache = Cache::builder()
        .redis_cluster([format!("redis://[::1]:{}", cluster.ports[0])])
        .flavor(unique_flavor("review-v6"))
        .read_failures(FailurePolicy::Propagate)
        .write_failures(FailurePolicy::Propagate)
        .build()
        .unwrap();
    cache.set("k", &1u32, S(600)).unwrap();
    let key = cache.make_key("k");
    let slot: u16 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(&key)
        .query(&mut cluster.node(cluster.ports[0]))
        .unwrap();
    let holds = |p: u16| -> bool {
        let mut c = cluster.node(p);
        redis::cmd("EXISTS")
            .arg(&key)
            .query::<i64>(&mut c)
            .is_ok_and(|n| n == 1)
    };
    let from = *cluster.ports.iter().find(|&&p| holds(p)).unwrap();
    let to = *cluster.ports.iter().find(|&&p| p != from).unwrap();
    // The slot, empty of keys but k, moves to `to` (k with it).
    let id = |p: u16| -> String {
        redis::cmd("CLUSTER")
            .arg("MYID")
            .query(&mut cluster.node(p))
            .unwrap()
    };
    let (from_id, to_id) = (id(from), id(to));
    let () = redis::cmd("CLUSTER")
        .arg("SETSLOT")
        .arg(slot)
        .arg("IMPORTING")
        .arg(&from_id)
        .query(&mut cluster.node(to))
        .unwrap();
    let () = redis::cmd("CLUSTER")
        .arg("SETSLOT")
        .arg(slot)
        .arg("MIGRATING")
        .arg(&to_id)
        .query(&mut cluster.node(from))
        .unwrap();
    let () = redis::cmd("MIGRATE")
        .arg("::1")
        .arg(to)
        .arg(&key)
        .arg(0)
        .arg(5000)
        .query(&mut cluster.node(from))
        .unwrap();
    for &p in &cluster.ports {
        let () = redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg("NODE")
            .arg(&to_id)
            .query(&mut cluster.node(p))
            .unwrap();
    }
    let moved = redis::cmd("GET")
        .arg(&key)
        .query::<Option<Vec<u8>>>(&mut cluster.node(from));
    eprintln!("the old master now answers: {moved:?}");
    let first = cache.get::<u32>("k");
    let second = cache.get::<u32>("k");
    assert!(
        matches!((&first, &second), (Ok(Some(1)), Ok(Some(1)))),
        "k's slot moved from [::1]:{from} to [::1]:{to}: {first:?}, then {second:?}"
    );
}
