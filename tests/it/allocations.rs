//! The sync read path allocates no more per call than it must: a counting allocator (installed
//! for this binary in `main.rs`, counting only on the thread that asks) pins the allocations of
//! `Cache::get` and `Cache::get_many` hits on the memory backend, on real memcached servers and on a real Redis.
//!
//! The pinned counts are what a call needs: the decoded value's own heap (a `String` each) and,
//! for a batch, the map it returns and the batch's buffers. A change that adds an allocation per
//! call fails here.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::Duration;

use newcache::Cache;
use serde::{Deserialize, Serialize};

use crate::fixture::{Memcached, shared_server, unique_flavor};

/// The system allocator, counting allocations (a `realloc` counts as one) made by a thread
/// that has turned counting on.
pub struct Counting;

thread_local! {
    static ON: Cell<bool> = const { Cell::new(false) };
    static COUNT: Cell<u64> = const { Cell::new(0) };
}

fn note() {
    // `try_with`: a thread being torn down has no locals left to count in.
    let _ = ON.try_with(|on| {
        if on.get() {
            let _ = COUNT.try_with(|c| c.set(c.get() + 1));
        }
    });
}

// SAFETY: every call is passed to `System` unchanged; the thread-local counters (const
// initialised, without destructors) neither allocate nor affect it.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note();
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note();
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note();
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// The mission's item: a small struct with one heap field.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Value {
    id: u64,
    name: String,
}

const CALLS: u64 = 200;
const BATCH: usize = 100;

/// The allocations per call of `one`, on this thread, after warm-up calls.
fn per_call(mut one: impl FnMut()) -> f64 {
    for _ in 0..10 {
        one();
    }
    let before = COUNT.with(Cell::get);
    ON.with(|on| on.set(true));
    for _ in 0..CALLS {
        one();
    }
    ON.with(|on| on.set(false));
    (COUNT.with(Cell::get) - before) as f64 / CALLS as f64
}

fn filled(cache: &Cache) -> Vec<String> {
    let keys: Vec<String> = (0..BATCH).map(|i| format!("m{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        let v = Value {
            id: i as u64,
            name: format!("value number {i}"),
        };
        cache.set(k, &v, Duration::from_secs(600)).unwrap();
    }
    keys
}

#[track_caller]
fn check(cache: Cache, get: f64, get_many: f64) {
    let keys = filled(&cache);
    let one = per_call(|| {
        let v = cache.get::<Value>("m7").unwrap().unwrap();
        assert_eq!(v.id, 7);
    });
    let many = per_call(|| {
        let found = cache.get_many::<Value>(&keys).unwrap();
        assert_eq!(found.len(), BATCH);
    });
    println!("get: {one} allocations a call; get_many of {BATCH}: {many}");
    assert!(
        one <= get,
        "a get hit allocates {one} times a call, more than {get}"
    );
    assert!(
        many <= get_many,
        "a get_many of {BATCH} hits allocates {many} times a call, more than {get_many}"
    );
}

#[test]
fn sync_reads_on_the_memory_backend_allocate_what_they_return() {
    let cache = Cache::builder()
        .in_memory()
        .flavor(unique_flavor("alloc"))
        .build()
        .unwrap();
    check(cache, 2.0, 207.0);
}

#[test]
fn sync_reads_on_memcached_allocate_what_they_return() {
    let cache = Cache::builder()
        .memcached([shared_server()])
        .flavor(unique_flavor("alloc"))
        .build()
        .unwrap();
    check(cache, 4.0, 216.0);
}

#[test]
fn a_sync_batch_over_three_memcached_servers_allocates_what_it_returns() {
    let servers = [Memcached::start(), Memcached::start(), Memcached::start()];
    let cache = Cache::builder()
        .memcached(servers.iter().map(Memcached::addr))
        .flavor(unique_flavor("alloc"))
        .build()
        .unwrap();
    check(cache, 4.0, 227.0);
}

#[cfg(feature = "redis")]
#[test]
fn sync_reads_on_redis_allocate_what_they_return() {
    let cache = Cache::builder()
        .redis(crate::fixture::shared_redis())
        .flavor(unique_flavor("alloc"))
        .build()
        .unwrap();
    check(cache, 5.0, 324.0);
}
