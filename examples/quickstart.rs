//! The herd protection, happening: a value goes stale, eight concurrent readers ask for it, one
//! recomputes and seven are served the stale value at once.
//!
//! ```text
//! cargo run --example quickstart                                   # in-process memory backend
//! MEMCACHED_SERVERS=127.0.0.1:11211 cargo run --example quickstart  # a real memcached
//! REDIS_URL=redis://127.0.0.1:6379/0 cargo run --features redis --example quickstart  # Redis, Valkey
//! ```

use std::error::Error;
use std::sync::Barrier;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use newcache::Cache;

fn main() -> Result<(), Box<dyn Error>> {
    // 1. Build a cache: memcached if MEMCACHED_SERVERS is set ("host:port,host:port"), Redis or
    //    Valkey if REDIS_URL is ("redis://host:port/db", with the `redis` feature), else memory.
    let builder = Cache::builder()
        .flavor("quickstart")
        .herd_timeout(Duration::from_secs(10));
    let set = |name| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    let (cache, backend) = match (set("MEMCACHED_SERVERS"), set("REDIS_URL")) {
        (Some(list), _) => (builder.memcached_list(&list).build()?, list),
        #[cfg(feature = "redis")]
        (None, Some(url)) => {
            // Printed without a password the URL may hold.
            let at = url.rsplit('@').next().unwrap_or_default().to_string();
            (builder.redis(url).build()?, at)
        }
        #[cfg(not(feature = "redis"))]
        (None, Some(_)) => return Err("REDIS_URL is set: run with `--features redis`".into()),
        (None, None) => (builder.in_memory().build()?, "memory".to_string()),
    };
    println!("backend: {backend}");
    // A fresh key version per run, so a memcached kept from an earlier run starts empty here.
    let cache = cache.with_version(std::process::id().into());

    // 2. An expensive computation we want to run as rarely as possible.
    let loads = AtomicUsize::new(0);
    let compute = || {
        loads.fetch_add(1, Ordering::SeqCst);
        thread::sleep(Duration::from_millis(200)); // the slow database query
        format!("report #{}", loads.load(Ordering::SeqCst))
    };

    // 3. The usual read-through pattern: get; on a miss, compute and set.
    let read = |who: usize, t0: Instant| -> Result<String, newcache::Error> {
        if let Some(v) = cache.get::<String>("report")? {
            println!("  reader {who}: {v:?} served at once ({:?})", t0.elapsed());
            return Ok(v);
        }
        let v = compute();
        cache.set("report", &v, Duration::from_secs(1))?;
        println!(
            "  reader {who}: miss -> recomputed {v:?} ({:?})",
            t0.elapsed()
        );
        Ok(v)
    };

    println!("t=0: cold key, one reader fills it");
    read(0, Instant::now())?;
    println!("t=0: fresh");
    read(0, Instant::now())?;

    // 4. Let the soft expiry (1 s) pass; memcached keeps the value for the herd timeout more.
    thread::sleep(Duration::from_millis(1100));
    println!("t=1.1 s: stale; 8 readers arrive at once");
    let barrier = Barrier::new(8);
    let t0 = Instant::now();
    thread::scope(|s| {
        for who in 1..=8 {
            let (barrier, read) = (&barrier, &read);
            s.spawn(move || {
                barrier.wait();
                read(who, t0).expect("read");
            });
        }
    });

    println!("after the refresh:");
    let v = read(0, Instant::now())?;
    let stats = cache.stats();
    println!(
        "loads: {} (1 cold + 1 refresh); stale served: {}; claims won: {}",
        loads.load(Ordering::SeqCst),
        stats.stale_served,
        stats.claims_won
    );
    // The point: one refresh for eight concurrent readers of a stale key.
    assert_eq!(loads.load(Ordering::SeqCst), 2);
    assert_eq!(stats.claims_won, 1);
    assert_eq!(v, "report #2");
    Ok(())
}
