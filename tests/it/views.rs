//! One cache, two front ends: `Cache::to_async` and `AsyncCache::to_sync` are views of one core
//! (the store, the stats, the coalescer, the keys and, on memcached, the servers' health), each
//! doing its own I/O. And a sync call on a runtime's thread never waits for a task's load.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use newcache::{AsyncCache, Cache, CacheBuilder, FailurePolicy};

use crate::fixture::{Memcached, shared_server, unique_flavor};
use crate::front::runtime;

const MIN: Duration = Duration::from_secs(60);

/// The two views of one cache built from `builder`: the sync one built, the async one its view.
fn views(builder: CacheBuilder) -> (Cache, AsyncCache) {
    let sync = builder.build().expect("test cache builds");
    let tasks = sync.to_async();
    (sync, tasks)
}

fn memory() -> CacheBuilder {
    Cache::builder().in_memory()
}

fn memcached() -> CacheBuilder {
    Cache::builder()
        .memcached([shared_server()])
        .flavor(unique_flavor("views"))
        .io_timeout(Duration::from_secs(5))
}

/// What one view writes, the other reads; and a view made back from the async view (`to_sync`)
/// is the same cache again.
fn a_value_set_through_one_view_is_read_through_the_other(builder: CacheBuilder) {
    let (sync, tasks) = views(builder);
    sync.set("from-sync", &1u32, MIN).unwrap();
    runtime().block_on(async {
        assert_eq!(tasks.get::<u32>("from-sync").await.unwrap(), Some(1));
        tasks.set("from-task", &2u32, MIN).await.unwrap();
    });
    assert_eq!(sync.get::<u32>("from-task").unwrap(), Some(2));
    assert_eq!(tasks.to_sync().get::<u32>("from-sync").unwrap(), Some(1));
    // versions carry over: a view of version 2 sees what version 2 wrote, not version 1's
    let v2 = sync.with_version(2);
    v2.set("from-sync", &3u32, MIN).unwrap();
    let v2_tasks = v2.to_async();
    runtime().block_on(async {
        assert_eq!(v2_tasks.get::<u32>("from-sync").await.unwrap(), Some(3));
        assert_eq!(v2_tasks.make_key("k"), v2.make_key("k"));
    });
}

#[test]
fn memory_views_share_one_store() {
    a_value_set_through_one_view_is_read_through_the_other(memory());
}

#[test]
fn memcached_views_share_one_store() {
    a_value_set_through_one_view_is_read_through_the_other(memcached());
}

/// `in_memory()` is a store private to the cache built from it: a second build from the same
/// builder is another, empty store (the views are how two front ends share one).
#[test]
fn two_builds_in_memory_are_two_stores() {
    let builder = memory();
    let first = builder.clone().build().unwrap();
    let second = builder.build_async().unwrap();
    first.set("k", &1u32, MIN).unwrap();
    runtime().block_on(async {
        assert_eq!(second.get::<u32>("k").await.unwrap(), None);
        assert_eq!(first.to_async().get::<u32>("k").await.unwrap(), Some(1));
    });
}

/// `stats()` of either view counts both views' calls (what the metrics of one `name` merge).
fn stats_of_either_view_count_both(builder: CacheBuilder) {
    let (sync, tasks) = views(builder);
    sync.set("k", &1u32, MIN).unwrap();
    assert_eq!(sync.get::<u32>("k").unwrap(), Some(1));
    assert_eq!(sync.get::<u32>("absent").unwrap(), None);
    runtime().block_on(async {
        assert_eq!(tasks.get::<u32>("k").await.unwrap(), Some(1));
        assert_eq!(tasks.get::<u32>("absent").await.unwrap(), None);
    });
    for (view, stats) in [("sync", sync.stats()), ("async", tasks.stats())] {
        assert_eq!((stats.hits, stats.misses), (2, 2), "{view}: {stats:?}");
    }
}

#[test]
fn memory_views_share_their_stats() {
    stats_of_either_view_count_both(memory());
}

#[test]
fn memcached_views_share_their_stats() {
    stats_of_either_view_count_both(memcached());
}

/// How long a loader waits for the other view's caller to join its load (it then returns); a
/// caller that never joins (another store, another coalescer) makes it two loads.
const JOIN_BOUND: Duration = Duration::from_secs(10);

/// A thread's sync call and a task's async call of one key, at once: one loader call, whichever
/// leads (the leader's loader returns only once the other caller waits for it).
fn one_load_for_a_sync_thread_and_an_async_task(builder: CacheBuilder) {
    let (sync, tasks) = views(builder.max_wait(Duration::from_secs(30)));
    let calls = Arc::new(AtomicUsize::new(0));
    let start = Arc::new(std::sync::Barrier::new(2));
    let thread = {
        let (sync, calls, start) = (sync.clone(), calls.clone(), start.clone());
        std::thread::spawn(move || {
            start.wait();
            sync.get_or_set_with("k", MIN, || {
                calls.fetch_add(1, Ordering::SeqCst);
                let t = Instant::now();
                while sync.stats().lease_waits == 0 && t.elapsed() < JOIN_BOUND {
                    std::thread::sleep(Duration::from_millis(1));
                }
                Ok::<_, std::io::Error>("v".to_string())
            })
        })
    };
    let from_task = runtime().block_on(async {
        let task = {
            let (tasks, calls) = (tasks.clone(), calls.clone());
            tokio::spawn(async move {
                let ready = tasks.clone();
                tasks
                    .get_or_set_with("k", MIN, || async move {
                        calls.fetch_add(1, Ordering::SeqCst);
                        let t = Instant::now();
                        while ready.stats().lease_waits == 0 && t.elapsed() < JOIN_BOUND {
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                        Ok::<_, std::io::Error>("v".to_string())
                    })
                    .await
            })
        };
        start.wait();
        task.await.unwrap()
    });
    let from_thread = thread.join().unwrap();
    assert_eq!(from_task.unwrap(), "v");
    assert_eq!(from_thread.unwrap(), "v");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "one load for both views");
    assert_eq!(sync.stats().loader_calls, 1);
}

#[test]
fn memory_views_load_once() {
    one_load_for_a_sync_thread_and_an_async_task(memory());
}

#[test]
fn memcached_views_load_once() {
    one_load_for_a_sync_thread_and_an_async_task(memcached());
}

/// A server marked dead through one view is dead for the other: the other fails at once with
/// "marked dead" instead of trying the server itself.
#[test]
fn a_server_marked_dead_through_one_view_is_dead_for_the_other() {
    for marked_by_sync in [true, false] {
        let mut server = Memcached::start();
        let (sync, tasks) = views(
            Cache::builder()
                .memcached([server.addr()])
                .flavor(unique_flavor("views-dead"))
                .read_failures(FailurePolicy::Propagate)
                .failure_limit(1)
                .retry_interval(Duration::from_secs(600)),
        );
        sync.set("k", &1u32, MIN).unwrap();
        runtime().block_on(async { tasks.get::<u32>("k").await.unwrap() });
        server.kill();
        let sync_get = || format!("{:?}", sync.get::<u32>("k").unwrap_err());
        let task_get = || {
            format!(
                "{:?}",
                runtime().block_on(tasks.get::<u32>("k")).unwrap_err()
            )
        };
        let (mark, check): (Failing, Failing) = if marked_by_sync {
            (Box::new(sync_get), Box::new(task_get))
        } else {
            (Box::new(task_get), Box::new(sync_get))
        };
        // A connection the kill closed is stale (not the server's fault); the refused connect
        // after it is, and marks the server dead (failure_limit 1).
        let mut seen = Vec::new();
        while !seen
            .last()
            .is_some_and(|e: &String| e.contains("marked dead"))
        {
            assert!(seen.len() < 5, "marked by sync: {marked_by_sync}: {seen:?}");
            seen.push(mark());
        }
        let other = check();
        assert!(
            other.contains("marked dead"),
            "marked by sync: {marked_by_sync}: the other view's first call finds it dead: {other}"
        );
    }
}

/// A view's call that fails, as the `Debug` of its error.
type Failing<'a> = Box<dyn Fn() -> String + 'a>;

/// How the sync call is made on the runtime's thread.
#[derive(Clone, Copy, Debug)]
enum OnRuntime {
    /// In the task `block_on` runs (the runtime's own thread).
    BlockOn,
    /// In a spawned task.
    Task,
    /// In a spawned task, inside `block_in_place` (multi-thread runtimes only).
    BlockInPlace,
}

/// A task leads `"k"`'s load, its loader waiting until the sync call has returned; the sync call
/// of `"k"` is made on the runtime's thread. It must not wait for the task (which cannot finish
/// first, and on these runtimes needs that thread): it loads itself and returns, and the task's
/// load is the one stored. Bounded: a call that waits fails the test instead of hanging it.
fn a_sync_call_on_a_runtime_thread_never_waits_for_a_task(
    builder: fn() -> CacheBuilder,
    runtime: tokio::runtime::Runtime,
    how: OnRuntime,
) {
    let sync = builder()
        .max_wait(Duration::from_secs(120))
        .build()
        .unwrap();
    let tasks = sync.to_async();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let check = sync.clone();
    std::thread::spawn(move || {
        let out = runtime.block_on(async move {
            let (loading_tx, loading_rx) = tokio::sync::oneshot::channel::<()>();
            let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
            let leader = tokio::spawn(async move {
                tasks
                    .get_or_set_with("k", MIN, || async move {
                        let _ = loading_tx.send(());
                        let _ = release_rx.await;
                        Ok::<_, std::io::Error>(1u32)
                    })
                    .await
            });
            loading_rx.await.expect("the task leads the load");
            let load = move || sync.get_or_set_with("k", MIN, || Ok::<_, std::io::Error>(2u32));
            let got = match how {
                OnRuntime::BlockOn => load(),
                OnRuntime::Task => tokio::spawn(async move { load() }).await.unwrap(),
                OnRuntime::BlockInPlace => {
                    tokio::spawn(async move { tokio::task::block_in_place(load) })
                        .await
                        .unwrap()
                }
            };
            let _ = release_tx.send(());
            (got, leader.await.unwrap())
        });
        let _ = done_tx.send(out);
    });
    let (got, led) = done_rx
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("{how:?}: the sync call waited for the task's load"));
    assert_eq!(got.unwrap(), 2, "{how:?}: the sync call loads itself");
    assert_eq!(led.unwrap(), 1, "{how:?}");
    assert_eq!(
        check.get::<u32>("k").unwrap(),
        Some(1),
        "{how:?}: the task's load stored"
    );
    assert_eq!(check.stats().loader_calls, 2, "{how:?}");
}

fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn one_worker() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn a_sync_call_in_a_current_thread_runtime_never_waits_for_a_task() {
    for builder in [memory, memcached] {
        for how in [OnRuntime::BlockOn, OnRuntime::Task] {
            a_sync_call_on_a_runtime_thread_never_waits_for_a_task(builder, current_thread(), how);
        }
    }
}

#[test]
fn a_sync_call_on_a_one_worker_runtime_never_waits_for_a_task() {
    for builder in [memory, memcached] {
        for how in [OnRuntime::Task, OnRuntime::BlockInPlace] {
            a_sync_call_on_a_runtime_thread_never_waits_for_a_task(builder, one_worker(), how);
        }
    }
}
