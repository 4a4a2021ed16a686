//! `AsyncCache` on Redis / Valkey under concurrency: gets that queue while one is in flight
//! go out together as one `MGET`, and every caller still gets its own key's value, whatever
//! the others do (a caller that gives up mid-batch, a key asked twice in one batch).

use std::time::Duration;

use crate::fixture::RedisServer;
use crate::redis::{async_cache_on, on_both, raw, runtime};

const S: fn(u64) -> Duration = Duration::from_secs;
const TASKS: u32 = 64;
const KEYS: u32 = 100;

/// The server's count of calls of `cmd` since its last `CONFIG RESETSTAT`.
fn calls(server: &RedisServer, cmd: &str) -> u64 {
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut raw(server))
        .unwrap();
    stats
        .lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{cmd}:calls=")))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().unwrap())
}

fn reset_stats(server: &RedisServer) {
    let () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(&mut raw(server))
        .unwrap();
}

#[test]
fn concurrent_async_gets_go_out_as_mgets_and_each_caller_gets_its_own_value() {
    on_both(|server| {
        let cache = async_cache_on(server);
        runtime().block_on(async {
            for i in 0..KEYS {
                cache.set(&format!("k{i}"), &i, S(60)).await.unwrap();
            }
            reset_stats(server);
            let per_task = 50;
            let tasks: Vec<_> = (0..TASKS)
                .map(|t| {
                    let c = cache.clone();
                    tokio::spawn(async move {
                        for j in 0..per_task {
                            // Every fourth get is of k0, by every task: one key asked several
                            // times in one batch.
                            let i = if j % 4 == 0 { 0 } else { (t * 7 + j) % KEYS };
                            let v = c.get::<u32>(&format!("k{i}")).await.unwrap();
                            assert_eq!(v, Some(i), "task {t}, get {j}");
                        }
                        // A key nobody stored is a miss, in a batch too.
                        assert_eq!(c.get::<u32>(&format!("none{t}")).await.unwrap(), None);
                    })
                })
                .collect();
            for t in tasks {
                t.await.unwrap();
            }
        });
        let gets = u64::from(TASKS * 51);
        let (get, mget) = (calls(server, "get"), calls(server, "mget"));
        eprintln!("{gets} gets from {TASKS} tasks: {get} GET, {mget} MGET");
        assert!(mget > 0, "no MGET: {get} GET for {gets} gets");
        assert!(
            get + mget <= gets / 2,
            "{get} GET + {mget} MGET for {gets} gets: not batched"
        );
    });
}

#[test]
fn dropping_async_gets_mid_batch_leaves_every_other_callers_value_right() {
    on_both(|server| {
        let cache = async_cache_on(server);
        runtime().block_on(async {
            for i in 0..KEYS {
                cache.set(&format!("k{i}"), &i, S(60)).await.unwrap();
            }
            reset_stats(server);
            for round in 0..40u32 {
                let tasks: Vec<_> = (0..TASKS)
                    .map(|t| {
                        let c = cache.clone();
                        let i = (round * 13 + t * 3) % KEYS;
                        let task = tokio::spawn(async move {
                            let v = c.get::<u32>(&format!("k{i}")).await.unwrap();
                            assert_eq!(v, Some(i), "round {round}, task {t}");
                        });
                        (t, task)
                    })
                    .collect();
                // Let them queue and some batches go out, then drop every third caller's
                // future wherever it is: queued, in a batch on the wire, or answered.
                for _ in 0..round % 4 {
                    tokio::task::yield_now().await;
                }
                let mut kept = Vec::new();
                for (t, task) in tasks {
                    if t % 3 == round % 3 {
                        task.abort();
                    } else {
                        kept.push(task);
                    }
                }
                for task in kept {
                    task.await.unwrap();
                }
            }
            // After it all, the connection still pairs every reply with its caller.
            for i in 0..KEYS {
                let v = cache.get::<u32>(&format!("k{i}")).await.unwrap();
                assert_eq!(v, Some(i));
            }
        });
        assert!(calls(server, "mget") > 0, "no batch was dropped into");
    });
}

/// A server busy in a script refuses every command with `-BUSY`: a batch meeting that refusal
/// fails each of its callers with it (an answer, not a fault: the server is not marked dead),
/// nobody waits for a reply that never comes, and once the script is killed every caller
/// gets its own value again.
#[test]
fn a_refused_batch_fails_each_of_its_callers_and_the_next_batches_serve() {
    on_both(|server| {
        let cache = newcache::Cache::builder()
            .redis(server.url())
            .flavor(crate::fixture::unique_flavor("redis-batch"))
            .io_timeout(S(3))
            .failure_limit(1)
            .read_failures(newcache::FailurePolicy::Propagate)
            .build_async()
            .unwrap();
        let rt = runtime();
        rt.block_on(async {
            for i in 0..KEYS {
                cache.set(&format!("k{i}"), &i, S(60)).await.unwrap();
            }
        });
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("busy-reply-threshold")
            .arg(50)
            .query(&mut raw(server))
            .unwrap();
        let mut busy = raw(server);
        let script = std::thread::spawn(move || {
            let _ = redis::cmd("EVAL")
                .arg("while true do end")
                .arg(0)
                .query::<()>(&mut busy);
        });
        std::thread::sleep(Duration::from_millis(300));
        let crowd = |cache: &newcache::AsyncCache| {
            let cache = cache.clone();
            async move {
                let tasks: Vec<_> = (0..TASKS)
                    .map(|t| {
                        let c = cache.clone();
                        tokio::spawn(async move {
                            let i = t % KEYS;
                            (i, c.get::<u32>(&format!("k{i}")).await)
                        })
                    })
                    .collect();
                let mut out = Vec::new();
                for t in tasks {
                    out.push(t.await.unwrap());
                }
                out
            }
        };
        let refused = rt.block_on(crowd(&cache));
        let () = redis::cmd("SCRIPT")
            .arg("KILL")
            .query(&mut raw(server))
            .unwrap();
        script.join().unwrap();
        for (i, r) in refused {
            let e = r.expect_err("the server was busy");
            assert!(!e.is_timeout(), "k{i}: an answer, not a timeout: {e}");
            assert!(
                e.is_backend() && !e.to_string().contains("marked dead"),
                "k{i}: {e}"
            );
        }
        // Not a fault (failure_limit 1 would have marked it dead): every caller is served.
        for (i, r) in rt.block_on(crowd(&cache)) {
            assert_eq!(r.unwrap(), Some(i), "k{i}");
        }
    });
}

/// A caller alone sends its own `GET`: no batch, no hand-off, even after a crowd has come and
/// gone.
#[test]
fn a_lone_caller_sends_its_own_gets_after_a_crowd() {
    let server = RedisServer::start("redis-server");
    let cache = async_cache_on(&server);
    runtime().block_on(async {
        for i in 0..KEYS {
            cache.set(&format!("k{i}"), &i, S(60)).await.unwrap();
        }
        let crowd: Vec<_> = (0..TASKS)
            .map(|t| {
                let c = cache.clone();
                tokio::spawn(async move { c.get::<u32>(&format!("k{}", t % KEYS)).await })
            })
            .collect();
        for t in crowd {
            t.await.unwrap().unwrap();
        }
        reset_stats(&server);
        for i in 0..KEYS {
            assert_eq!(cache.get::<u32>(&format!("k{i}")).await.unwrap(), Some(i));
        }
    });
    assert_eq!(
        (calls(&server, "get"), calls(&server, "mget")),
        (u64::from(KEYS), 0)
    );
}

/// A get queued for a batch on the connection's own runtime arms no timer of its own: its wait
/// is bounded by the batch's `MGET`, which the connection's response timeout (`io_timeout`)
/// ends. A server that stops answering fails every queued caller in time; none waits for it.
#[test]
fn queued_gets_on_the_connections_own_runtime_fail_in_time_when_the_server_stops() {
    let server = RedisServer::start("redis-server");
    let cache = async_cache_on(&server); // io_timeout 300 ms
    let rt = runtime();
    // The connection (its driver and its batcher) opened on `rt`, where the gets run.
    rt.block_on(async {
        cache.set("k", &1u32, S(60)).await.unwrap();
        assert_eq!(cache.get::<u32>("k").await.unwrap(), Some(1));
    });
    server.signal("STOP");
    rt.block_on(async {
        // The first is alone on the wire; the others queue behind it for a batch.
        let gets: Vec<_> = (0..TASKS)
            .map(|_| {
                let c = cache.clone();
                tokio::spawn(async move { c.get::<u32>("k").await })
            })
            .collect();
        for (n, get) in gets.into_iter().enumerate() {
            // 300 ms io_timeout: 20 s is far past any timeout.
            match tokio::time::timeout(S(20), get).await {
                Ok(r) => assert!(r.unwrap().is_err(), "get {n} answered by a stopped server"),
                Err(_) => panic!("get {n} still waiting after 20 s (io_timeout 300 ms)"),
            }
        }
    });
    server.signal("CONT");
}

/// The documented limit of a runtime that is alive but no longer driven (a current-thread
/// runtime outside `block_on`) holding the connection it opened: callers on other runtimes
/// time out on it (one `io_timeout`) before one of them reconnects. A get that queues for the
/// batcher (another read is on the wire) waits on the batcher's task, which lives on that
/// undriven runtime: it must time out too, not wait forever.
#[test]
fn a_queued_get_behind_an_undriven_runtime_times_out_and_does_not_hang() {
    let server = RedisServer::start("redis-server");
    let cache = async_cache_on(&server); // io_timeout 300 ms
    // The connection (its driver and its batcher) opened on a current-thread runtime that is
    // then left alive but undriven.
    let parked = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    parked.block_on(async {
        cache.set("k", &1u32, S(60)).await.unwrap();
        assert_eq!(cache.get::<u32>("k").await.unwrap(), Some(1));
    });
    runtime().block_on(async {
        // The first get is alone on the wire (it waits out its io_timeout on the undriven
        // driver); the ones after it queue for the batcher.
        let first = {
            let c = cache.clone();
            tokio::spawn(async move { c.get::<u32>("k").await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        let queued: Vec<_> = (0..4)
            .map(|_| {
                let c = cache.clone();
                tokio::spawn(async move { c.get::<u32>("k").await })
            })
            .collect();
        let _ = first.await.unwrap();
        for (n, q) in queued.into_iter().enumerate() {
            // 300 ms io_timeout: 20 s is far past any timeout, connect or retry.
            match tokio::time::timeout(S(20), q).await {
                Ok(r) => {
                    let _ = r.unwrap();
                }
                Err(_) => panic!("queued get {n} still waiting after 20 s (io_timeout 300 ms)"),
            }
        }
    });
    drop(parked);
}
