//! An adversarial review of the Redis backend: each test shows one finding (and fails while it
//! stands). Servers and clusters are the tests' own.

use std::thread;
use std::time::Duration;

use newcache::{Cache, FailurePolicy};

use crate::fixture::unique_flavor;

const S: fn(u64) -> Duration = Duration::from_secs;

fn raw(port: u16) -> redis::Connection {
    redis::Client::open(format!("redis://127.0.0.1:{port}/"))
        .and_then(|c| c.get_connection())
        .unwrap()
}

/// Finding: a replayed `UNLINK` that a cluster node answers with a redirect (`MOVED`, `ASK`: the
/// key's slot moved on since its delete was missed) is counted as refused and passed over
/// (`ReplayRequest::read`, src/backend/redis/request.rs:165, the `Value::ServerError(_)` arm):
/// the invalidation is dropped, though the key, moved with its old value, is served by the
/// slot's new master. The caller was told the key was "queued for replay".
#[test]
fn review_a_replayed_delete_follows_its_key_to_the_slots_new_master() {
    let cluster = crate::fixture::RedisCluster::start("redis-server");
    let cache = Cache::builder()
        .redis_cluster(cluster.seeds())
        .flavor(unique_flavor("review-replay-moved"))
        .read_failures(FailurePolicy::Propagate)
        .write_failures(FailurePolicy::Propagate)
        .io_timeout(Duration::from_millis(500))
        .retry_interval(Duration::from_millis(200))
        .build()
        .unwrap();
    cache.set("k", "old", S(600)).unwrap();
    let key = cache.make_key("k");
    let slot: u16 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(&key)
        .query(&mut raw(cluster.ports[0]))
        .unwrap();
    let masters: Vec<u16> = cluster.masters().iter().map(|(p, _)| *p).collect();
    let owners = cluster.masters();
    let from = owners
        .iter()
        .find(|(_, r)| r.iter().any(|&(a, b)| (a..=b).contains(&slot)))
        .map(|(p, _)| *p)
        .unwrap();
    let to = *masters.iter().find(|&&p| p != from).unwrap();

    // The delete misses its master: it is busy in a script (`BUSY`: not serving yet).
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("busy-reply-threshold")
        .arg(50)
        .query(&mut raw(from))
        .unwrap();
    let mut busy = raw(from);
    let script = thread::spawn(move || {
        let _ = redis::cmd("EVAL")
            .arg("while true do end")
            .arg(0)
            .query::<()>(&mut busy);
    });
    thread::sleep(Duration::from_millis(200));
    let e = cache.delete("k").unwrap_err();
    let () = redis::cmd("SCRIPT")
        .arg("KILL")
        .query(&mut raw(from))
        .unwrap();
    script.join().unwrap();
    assert!(e.to_string().contains("queued for replay"), "{e}");

    // The slot moves to another master, the key with it (its old value).
    let id = |p: u16| -> String {
        redis::cmd("CLUSTER")
            .arg("MYID")
            .query(&mut raw(p))
            .unwrap()
    };
    let () = redis::cmd("CLUSTER")
        .arg("SETSLOT")
        .arg(slot)
        .arg("IMPORTING")
        .arg(id(from))
        .query(&mut raw(to))
        .unwrap();
    let () = redis::cmd("CLUSTER")
        .arg("SETSLOT")
        .arg(slot)
        .arg("MIGRATING")
        .arg(id(to))
        .query(&mut raw(from))
        .unwrap();
    let in_slot: Vec<String> = redis::cmd("CLUSTER")
        .arg("GETKEYSINSLOT")
        .arg(slot)
        .arg(1000)
        .query(&mut raw(from))
        .unwrap();
    assert!(
        in_slot.contains(&key),
        "the delete never reached the server"
    );
    let () = redis::cmd("MIGRATE")
        .arg("127.0.0.1")
        .arg(to)
        .arg("")
        .arg(0)
        .arg(5000)
        .arg("KEYS")
        .arg(&in_slot)
        .query(&mut raw(from))
        .unwrap();
    let to_id = id(to);
    for &p in &masters {
        let () = redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg("NODE")
            .arg(&to_id)
            .query(&mut raw(p))
            .unwrap();
    }

    // The next call on the old master replays the delete first: it is redirected.
    let got = cache.get::<String>("k").unwrap();
    let stats = cache.stats();
    assert_eq!(
        got, None,
        "k was deleted (the delete queued for replay), then served from the slot's new master \
         ({stats:?})"
    );
}
