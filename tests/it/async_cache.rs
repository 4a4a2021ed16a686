//! `AsyncCache`: the behaviour and loader guarantees, awaited, on every backend (memory, a real
//! memcached, twemproxy), each test on its own 2-worker multi-thread runtime.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use newcache::{AsyncCache, Cache, Ttl};
use serde::{Deserialize, Serialize};
use tokio::sync::{Barrier, oneshot};

use crate::fixture::{Env, Kind};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Row {
    id: u64,
    version: u32,
}

const S: fn(u64) -> Duration = Duration::from_secs;

crate::on_every_backend_async!(
    every_operation_round_trips,
    futures_are_send_and_the_cache_is_static,
    one_load_for_64_tasks_on_a_cold_key,
    a_stale_key_is_loaded_once_and_served_stale_meanwhile,
    a_delete_during_a_load_is_not_undone,
    a_set_during_a_load_wins,
    a_loader_that_deletes_its_own_key_is_still_one_load_in_process,
    a_dropped_leader_hands_the_load_to_one_follower,
    a_loader_error_reaches_every_waiter,
    background_refresh_serves_stale_and_shutdown_drains_it,
    sync_and_async_caches_interoperate,
    pipelining_256_tasks_by_1000_keys,
    random_cancellations_never_cross_replies,
);

fn cache(env: &Env) -> AsyncCache {
    env.builder().build_async().expect("async cache builds")
}

async fn every_operation_round_trips(env: Env) {
    let cache = cache(&env);
    assert_eq!(cache.get::<Row>("a").await.unwrap(), None);
    let row = Row { id: 1, version: 1 };
    cache.set("a", &row, Ttl::Default).await.unwrap();
    assert_eq!(cache.get::<Row>("a").await.unwrap(), Some(row.clone()));
    assert!(!cache.add("a", &row, S(60)).await.unwrap(), "a live key");
    assert!(cache.add("b", &row, S(60)).await.unwrap());
    let many: HashMap<String, Row> = cache.get_many(&["a", "b", "c"]).await.unwrap();
    assert_eq!(many.len(), 2);
    assert_eq!(many["b"], row);
    let failed = cache
        .set_many([("x", &row), ("y", &row)], S(60))
        .await
        .unwrap();
    assert!(failed.is_empty());
    assert_eq!(cache.delete_many(&["x", "y", "nope"]).await.unwrap(), 2);
    assert!(cache.delete("a").await.unwrap());
    assert!(!cache.delete("a").await.unwrap());
    assert!(cache.touch("b", S(120)).await.unwrap());
    assert!(!cache.touch("a", S(120)).await.unwrap());
    cache.set_counter("c", 5, Ttl::Never).await.unwrap();
    assert_eq!(cache.incr("c", 2).await.unwrap(), 7);
    assert_eq!(cache.decr("c", 10).await.unwrap(), 0);
    assert_eq!(cache.get_counter("c").await.unwrap(), Some(0));
    assert!(cache.incr("missing", 1).await.unwrap_err().is_not_found());
    let v2 = cache.with_version(2);
    assert_eq!(
        v2.get::<Row>("b").await.unwrap(),
        None,
        "a version bump invalidates"
    );
    assert!(v2.make_key("b").contains("-2-"));
    assert_eq!(cache.make_key("b"), env.cache().make_key("b"));
    let s = cache.stats();
    assert!(s.hits >= 2 && s.misses >= 2, "{s:?}");
    // flush_all would wipe the other tests' keys on the shared server (and twemproxy refuses
    // it): memcached's is tested on a server of its own (engine tests).
    if env.kind == Kind::Memory {
        cache.clear().await.unwrap();
        assert_eq!(cache.get::<Row>("b").await.unwrap(), None);
    }
}

fn assert_send<T: Send + 'static>(_: &T) {}

async fn futures_are_send_and_the_cache_is_static(env: Env) {
    let cache = cache(&env);
    // Every future runs in a spawned task (which needs Send + 'static).
    let c = cache.clone();
    let h = tokio::spawn(async move {
        c.set("k", &1u32, S(60)).await?;
        let _ = c.add("k2", &2u32, S(60)).await?;
        let _: Option<u32> = c.get("k").await?;
        let _: HashMap<String, u32> = c.get_many(&["k", "k2"]).await?;
        let _ = c.set_many([("m", &1u32)], S(60)).await?;
        let _ = c.delete_many(&["m"]).await?;
        let _ = c.touch("k", S(60)).await?;
        let v: u32 = c
            .get_or_set_with("l", S(60), || async { Ok::<_, std::io::Error>(3) })
            .await?;
        let w: u32 = c
            .get_or_set_with_background("l", S(60), || async { Ok::<_, std::io::Error>(4) })
            .await?;
        Ok::<_, newcache::Error>((v, w))
    });
    assert_send(&h);
    assert_eq!(h.await.unwrap().unwrap(), (3, 3));
}

async fn one_load_for_64_tasks_on_a_cold_key(env: Env) {
    let cache = cache(&env);
    let loads = Arc::new(AtomicUsize::new(0));
    let start = Arc::new(Barrier::new(64));
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let (cache, loads, start) = (cache.clone(), loads.clone(), start.clone());
        tasks.push(tokio::spawn(async move {
            start.wait().await;
            cache
                .get_or_set_with("report", S(60), || async {
                    loads.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(50)).await; // the slow query
                    Ok::<_, std::io::Error>(Row { id: 42, version: 1 })
                })
                .await
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap().unwrap(), Row { id: 42, version: 1 });
    }
    assert_eq!(loads.load(Ordering::SeqCst), 1, "64 tasks, one load");
}

async fn a_stale_key_is_loaded_once_and_served_stale_meanwhile(env: Env) {
    let cache = env.timed_builder().build_async().unwrap();
    cache
        .set("k", &Row { id: 1, version: 1 }, S(1))
        .await
        .unwrap();
    env.pass(Duration::from_millis(1_500));
    // The claimant's loader waits until every other task has returned: they cannot have
    // waited for it.
    let others_done = Arc::new(tokio::sync::Notify::new());
    let loads = Arc::new(AtomicUsize::new(0));
    let returned = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (cache, loads, returned, others_done) = (
            cache.clone(),
            loads.clone(),
            returned.clone(),
            others_done.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let v = cache
                .get_or_set_with("k", S(60), || async {
                    loads.fetch_add(1, Ordering::SeqCst);
                    let wait = others_done.notified();
                    tokio::pin!(wait);
                    wait.as_mut().enable();
                    if returned.load(Ordering::SeqCst) < 15 {
                        wait.await;
                    }
                    Ok::<_, std::io::Error>(Row { id: 1, version: 2 })
                })
                .await
                .unwrap();
            if v.version == 1 && returned.fetch_add(1, Ordering::SeqCst) + 1 == 15 {
                others_done.notify_waiters();
            }
            v
        }));
    }
    let mut versions = Vec::new();
    for t in tasks {
        versions.push(t.await.unwrap().version);
    }
    versions.sort_unstable();
    assert_eq!(loads.load(Ordering::SeqCst), 1);
    assert_eq!(
        versions.iter().filter(|&&v| v == 1).count(),
        15,
        "{versions:?}"
    );
    assert_eq!(versions.last(), Some(&2));
    assert_eq!(cache.get::<Row>("k").await.unwrap().unwrap().version, 2);
}

/// Starts a load of `key` whose loader returns `row` once `go` fires; returns when it runs.
async fn load_paused(
    cache: &AsyncCache,
    key: &'static str,
    row: Row,
) -> (
    oneshot::Sender<()>,
    tokio::task::JoinHandle<newcache::Result<Row>>,
) {
    let (started_tx, started) = oneshot::channel();
    let (go, go_rx) = oneshot::channel::<()>();
    let c = cache.clone();
    let task = tokio::spawn(async move {
        c.get_or_set_with(key, S(60), move || async move {
            let _ = started_tx.send(());
            let _ = go_rx.await;
            Ok::<_, std::io::Error>(row)
        })
        .await
        .map_err(newcache::Error::from)
    });
    started.await.expect("the loader started");
    (go, task)
}

async fn a_delete_during_a_load_is_not_undone(env: Env) {
    let cache = cache(&env);
    let (go, task) = load_paused(&cache, "row", Row { id: 7, version: 1 }).await;
    assert!(
        cache.delete("row").await.unwrap(),
        "the placeholder was there"
    );
    go.send(()).unwrap();
    assert_eq!(
        task.await.unwrap().unwrap().version,
        1,
        "the loader's caller gets its value"
    );
    assert_eq!(
        cache.get::<Row>("row").await.unwrap(),
        None,
        "the delete stands"
    );
}

async fn a_set_during_a_load_wins(env: Env) {
    let cache = cache(&env);
    let (go, task) = load_paused(&cache, "row", Row { id: 7, version: 1 }).await;
    cache
        .set("row", &Row { id: 7, version: 2 }, S(60))
        .await
        .unwrap();
    go.send(()).unwrap();
    task.await.unwrap().unwrap();
    assert_eq!(cache.get::<Row>("row").await.unwrap().unwrap().version, 2);
    assert_eq!(cache.stats().loads_superseded, 1);
}

async fn a_dropped_leader_hands_the_load_to_one_follower(env: Env) {
    let cache = cache(&env);
    let finished = Arc::new(AtomicUsize::new(0));
    // The leader's loader never finishes: its task is aborted mid-load.
    let (_go, leader) = load_paused(&cache, "k", Row { id: 0, version: 0 }).await;
    let mut followers = Vec::new();
    for _ in 0..8 {
        let (cache, finished) = (cache.clone(), finished.clone());
        followers.push(tokio::spawn(async move {
            cache
                .get_or_set_with("k", S(60), || async {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    finished.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, std::io::Error>(Row { id: 1, version: 1 })
                })
                .await
        }));
    }
    // Let the followers join the leader, then cancel it.
    while cache.stats().lease_waits < 8 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    leader.abort();
    assert!(leader.await.unwrap_err().is_cancelled());
    for f in followers {
        assert_eq!(f.await.unwrap().unwrap(), Row { id: 1, version: 1 });
    }
    assert_eq!(finished.load(Ordering::SeqCst), 1, "one follower loaded");
    assert_eq!(
        cache.get::<Row>("k").await.unwrap(),
        Some(Row { id: 1, version: 1 })
    );
}

async fn a_loader_error_reaches_every_waiter(env: Env) {
    let cache = cache(&env);
    let start = Arc::new(Barrier::new(8));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (cache, start) = (cache.clone(), start.clone());
        tasks.push(tokio::spawn(async move {
            start.wait().await;
            cache
                .get_or_set_with("k", S(60), || async {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    Err::<Row, _>(std::io::Error::other("database down"))
                })
                .await
        }));
    }
    for t in tasks {
        let e = t.await.unwrap().unwrap_err();
        assert!(e.loader().is_some(), "{e}");
    }
    assert_eq!(cache.get::<Row>("k").await.unwrap(), None, "nothing cached");
}

async fn background_refresh_serves_stale_and_shutdown_drains_it(env: Env) {
    let cache = env.timed_builder().build_async().unwrap();
    cache
        .set("k", &Row { id: 1, version: 1 }, S(1))
        .await
        .unwrap();
    env.pass(Duration::from_millis(1_500));
    let v: Row = cache
        .get_or_set_with_background("k", S(60), || async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            Ok::<_, std::io::Error>(Row { id: 1, version: 2 })
        })
        .await
        .unwrap();
    assert_eq!(
        v.version, 1,
        "the claimant is served the stale value at once"
    );
    cache.shutdown().await;
    assert_eq!(
        cache.get::<Row>("k").await.unwrap().unwrap().version,
        2,
        "refreshed"
    );
    assert_eq!(cache.stats().loader_calls, 1);
}

async fn sync_and_async_caches_interoperate(env: Env) {
    let a = cache(&env);
    let s: Cache = env.sync_cache();
    assert_eq!(a.make_key("k"), s.make_key("k"));
    s.set("k", &Row { id: 1, version: 1 }, S(60)).unwrap();
    assert_eq!(a.get::<Row>("k").await.unwrap().unwrap().version, 1);
    a.set("k", &Row { id: 1, version: 2 }, S(60)).await.unwrap();
    let s2 = s.clone();
    let got = tokio::task::spawn_blocking(move || s2.get::<Row>("k").unwrap())
        .await
        .unwrap();
    assert_eq!(got.unwrap().version, 2);
}

/// 256 tasks each read all of 1,000 keys whose values name their key, through one AsyncCache
/// (memcached: two pipelined connections, merged gets): every read gets its own key's value.
async fn pipelining_256_tasks_by_1000_keys(env: Env) {
    let cache = cache(&env);
    let keys: Vec<String> = (0..1000).map(|i| format!("p{i}")).collect();
    let items: Vec<(String, String)> = keys
        .iter()
        .map(|k| (k.clone(), format!("value of {k}")))
        .collect();
    let failed = cache
        .set_many(items.iter().map(|(k, v)| (k, v)), S(600))
        .await
        .unwrap();
    assert!(failed.is_empty());
    let keys = Arc::new(keys);
    let wrong = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for t in 0..256 {
        let (cache, keys, wrong) = (cache.clone(), keys.clone(), wrong.clone());
        tasks.push(tokio::spawn(async move {
            // Each task walks the keys from its own offset, some one by one, some in batches.
            for n in 0..keys.len() {
                let k = &keys[(n + t * 7) % keys.len()];
                if n % 10 == 0 {
                    let batch: Vec<&String> = (0..5).map(|j| &keys[(n + j) % keys.len()]).collect();
                    let got: HashMap<String, String> = cache.get_many(&batch).await.unwrap();
                    for k in batch {
                        if got.get(k.as_str()) != Some(&format!("value of {k}")) {
                            wrong.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }
                if cache.get::<String>(k).await.unwrap() != Some(format!("value of {k}")) {
                    wrong.fetch_add(1, Ordering::SeqCst);
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(wrong.load(Ordering::SeqCst), 0, "wrong values or misses");
}

/// 10,000 random cancellations under 256 tasks: reads and writes dropped at random points
/// (a timeout of 0-50 us around each call), values that name their key. No read, during or
/// after, ever returns another key's value.
async fn random_cancellations_never_cross_replies(env: Env) {
    let cache = cache(&env);
    let keys: Arc<Vec<String>> = Arc::new((0..200).map(|i| format!("c{i}")).collect());
    for k in keys.iter() {
        cache
            .set(k, &format!("value of {k}"), S(600))
            .await
            .unwrap();
    }
    let cancelled = Arc::new(AtomicUsize::new(0));
    let wrong = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for t in 0..256u64 {
        let (cache, keys, cancelled, wrong) = (
            cache.clone(),
            keys.clone(),
            cancelled.clone(),
            wrong.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut x = t.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            let mut next = move || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            // The memory backend answers every call on its first poll: nothing can be cancelled
            // there, so each task stops after its share of calls too.
            for _ in 0..4_000 {
                if cancelled.load(Ordering::SeqCst) >= 10_000 {
                    break;
                }
                let k = &keys[(next() % keys.len() as u64) as usize];
                let budget = Duration::from_micros(next() % 50);
                let op = next() % 4;
                let outcome = tokio::time::timeout(budget, async {
                    match op {
                        0 => cache
                            .set(k, &format!("value of {k}"), S(600))
                            .await
                            .map(|_| None),
                        1 => cache
                            .get_many::<String>(&[k.as_str()])
                            .await
                            .map(|m| m.get(k).cloned()),
                        _ => cache.get::<String>(k).await,
                    }
                })
                .await;
                match outcome {
                    Err(_) => {
                        cancelled.fetch_add(1, Ordering::SeqCst);
                    }
                    Ok(Ok(Some(v))) if v != format!("value of {k}") => {
                        wrong.fetch_add(1, Ordering::SeqCst);
                    }
                    Ok(_) => {}
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    if env.kind != Kind::Memory {
        assert!(cancelled.load(Ordering::SeqCst) >= 10_000);
    }
    assert_eq!(
        wrong.load(Ordering::SeqCst),
        0,
        "a reply reached the wrong caller"
    );
    // Afterwards every key still reads its own value.
    for k in keys.iter() {
        assert_eq!(
            cache.get::<String>(k).await.unwrap(),
            Some(format!("value of {k}"))
        );
    }
}

/// A loader that writes its own key (here: clears it first, as a "refresh" helper used both to
/// invalidate and as the loader might) is still one load for every caller of the process that
/// arrives while it runs (plain writes do not detach the key's in-process call; a version of
/// the code where they did made one load per arrival).
async fn a_loader_that_deletes_its_own_key_is_still_one_load_in_process(env: Env) {
    let cache = cache(&env);
    let loads = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for i in 0..10u32 {
        let c = cache.clone();
        let loads = loads.clone();
        tasks.push(tokio::spawn(async move {
            let c2 = c.clone();
            c.get_or_set_with("self-deleting", S(60), move || async move {
                loads.fetch_add(1, Ordering::SeqCst);
                c2.delete("self-deleting").await.unwrap();
                // Long beside the ten arrivals 10 ms apart, on a loaded machine too.
                tokio::time::sleep(Duration::from_millis(2000)).await;
                Ok::<_, std::io::Error>(Row { id: 1, version: i })
            })
            .await
        }));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(
        loads.load(Ordering::SeqCst),
        1,
        "loads for ten callers in one process"
    );
}
