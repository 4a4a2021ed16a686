//! The sync `Cache`'s memcached backend under the `tokio` feature: a lone caller drives its own
//! pooled connection (its thread waits on its own socket), concurrent callers queue on the
//! pipelined engine (`engine/`), which runs on a runtime thread of its own.
//!
//! Why both: a blocking thread pays one wake-up per operation either way, but on the pool every
//! operation is also its own request, syscalls and memcached dispatch, while the engine merges
//! the gets of many threads into one line and one reply. Alone, the pool is the shorter path (no
//! hand-off to the engine's thread and back); together, the engine serves more.
//!
//! The choice is made per operation from how many of this cache's callers are inside an
//! operation at that moment: one (this caller) takes the pool, more take the engine. The caller's
//! thread waits on the engine parked (`wait`), on any thread, a tokio runtime's included (the
//! engine's runtime is its own). An operation finishes before the call returns, so a thread's own operations are
//! ordered whichever path each took. The two paths keep their own connections but share one
//! health record per server (`MemcachedBackend::health`, `Engine::sharing`): a server marked
//! dead, or its keys remapped, by one path is so for the other at once, so that both place every
//! key on the same server.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use super::engine::Engine;
use super::{MemcachedBackend, MemcachedConfig};
use crate::backend::{AsyncBackend, Backend, BoxFuture, Item, StoreOutcome, Write};
use crate::error::{Error, ErrorKind, Result};

/// The engine and the runtime its connections' tasks run on (a current-thread runtime driven by
/// a thread of its own), made on first concurrent use.
struct Lane {
    engine: Engine,
    handle: tokio::runtime::Handle,
    /// Dropped to end the thread.
    _stop: tokio::sync::oneshot::Sender<()>,
    /// Gone when the thread has ended.
    #[cfg(test)]
    alive: std::sync::Weak<()>,
}

/// A [`MemcachedBackend`] for lone callers and the pipelined engine for concurrent ones.
pub(crate) struct Blended {
    pool: MemcachedBackend,
    config: MemcachedConfig,
    connections: usize,
    /// Callers inside an operation now.
    active: AtomicUsize,
    lane: OnceLock<Lane>,
    /// When the engine last failed to start (it is tried again after [`RETRY_START`]).
    start_failed: parking_lot::Mutex<Option<Instant>>,
}

/// How long after a failed start the engine is tried again.
const RETRY_START: Duration = Duration::from_secs(1);

impl fmt::Debug for Blended {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Blended")
            .field("pool", &self.pool)
            .field("engine_started", &self.lane.get().is_some())
            .finish_non_exhaustive()
    }
}

/// Leaves the active count when an operation ends (or unwinds).
struct Inside<'a>(&'a AtomicUsize);

impl Drop for Inside<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Release);
    }
}

impl Blended {
    /// Never connects and starts nothing: the pool connects on first use, the engine's thread
    /// starts at the first operation that finds another one running.
    pub(crate) fn new(config: MemcachedConfig, connections: usize) -> Result<Blended> {
        Ok(Blended {
            pool: MemcachedBackend::new(config.clone())?,
            config,
            connections,
            active: AtomicUsize::new(0),
            lane: OnceLock::new(),
            start_failed: parking_lot::Mutex::new(None),
        })
    }

    /// Every server's health record: one with the pool, its own engine's and any other engine
    /// built with them (`Engine::sharing`).
    pub(crate) fn health(&self) -> Vec<Arc<crate::backend::server::health::Health>> {
        self.pool.health()
    }

    /// Whether the engine's thread has been started (for tests).
    #[cfg(test)]
    pub(crate) fn engine_started(&self) -> bool {
        self.lane.get().is_some()
    }

    /// The engine, started on first use. One caller starts it while the others wait for the
    /// outcome; if it cannot start (no thread to be had), the pool serves and a new attempt is
    /// made after [`RETRY_START`].
    fn lane(&self) -> Option<&Lane> {
        if let Some(lane) = self.lane.get() {
            return Some(lane);
        }
        let mut failed_at = self.start_failed.lock();
        if let Some(lane) = self.lane.get() {
            return Some(lane);
        }
        if failed_at.is_some_and(|t| t.elapsed() < RETRY_START) {
            return None;
        }
        match self.start() {
            Ok(lane) => Some(self.lane.get_or_init(|| lane)),
            Err(e) => {
                if failed_at.is_none() {
                    // Once: the pool still works, a machine short of threads is not an outage.
                    tracing::warn!(
                        error = %e,
                        "newcache: the pipelined engine did not start; concurrent callers use \
                         the pool"
                    );
                }
                *failed_at = Some(Instant::now());
                None
            }
        }
    }

    /// Starts the engine's thread. Its runtime is built and dropped on that thread, never on the
    /// caller's (which may be a runtime's own, where dropping a runtime panics).
    fn start(&self) -> Result<Lane> {
        let engine = Engine::sharing(&self.config, self.connections, Some(self.pool.health()))?;
        let (ready, handle) = std::sync::mpsc::sync_channel(1);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let token = Arc::new(());
        #[cfg(test)]
        let alive = Arc::downgrade(&token);
        std::thread::Builder::new()
            .name("newcache-engine".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime,
                    Err(e) => {
                        let _ = ready.send(Err(e));
                        return;
                    }
                };
                let _ = ready.send(Ok(runtime.handle().clone()));
                runtime.block_on(async {
                    let _ = stopped.await;
                });
                drop(runtime);
                drop(token);
            })
            .map_err(|e| Error::with_source(ErrorKind::Backend, "cannot start a thread", e))?;
        let handle = handle
            .recv()
            .map_err(|_| Error::backend("the engine's thread ended at once"))?
            .map_err(|e| Error::with_source(ErrorKind::Backend, "cannot start a runtime", e))?;
        Ok(Lane {
            engine,
            handle,
            _stop: stop,
            #[cfg(test)]
            alive,
        })
    }

    /// Runs one operation on the pool (`pool`) when this caller is alone, else on the engine.
    fn route<'a, T>(
        &'a self,
        pool: impl FnOnce(&'a MemcachedBackend) -> T,
        engine: impl FnOnce(&'a Engine) -> BoxFuture<'a, T>,
    ) -> T {
        let before = self.active.fetch_add(1, Ordering::Acquire);
        let _inside = Inside(&self.active);
        if before == 0 {
            return pool(&self.pool);
        }
        match self.lane() {
            Some(lane) => wait(&lane.handle, engine(&lane.engine)),
            None => pool(&self.pool),
        }
    }
}

/// Runs `f` to completion on this thread, parked between polls; `f` sees the engine's runtime
/// as the current one (`Handle::enter`: the engine opens connections and arms timers on it).
/// Unlike `Handle::block_on` this does not start running a runtime on this thread, so it works
/// on any thread, a tokio runtime's own included (the engine does not need that runtime to make
/// progress).
fn wait<F: Future>(handle: &tokio::runtime::Handle, f: F) -> F::Output {
    /// Wakes the waiting thread.
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
        fn wake_by_ref(self: &Arc<Self>) {
            self.0.unpark();
        }
    }
    let _context = handle.enter();
    let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    // Unconstrained: on a tokio task's thread, the task's cooperative budget would otherwise
    // run out after a hundred-odd engine calls in one poll, and every later poll of the reply
    // would return pending and wake at once, forever.
    let mut f = std::pin::pin!(tokio::task::unconstrained(f));
    loop {
        if let std::task::Poll::Ready(out) = f.as_mut().poll(&mut cx) {
            return out;
        }
        // A wake-up that came before this park makes it return at once; a spurious one polls
        // again.
        std::thread::park();
    }
}

impl Backend for Blended {
    fn get(&self, key: &str) -> Result<Option<Item>> {
        self.route(|p| p.get(key), |e| e.get(key))
    }

    fn get_many(&self, keys: &[&str]) -> Vec<Result<Option<Item>>> {
        self.route(|p| p.get_many(keys), |e| e.get_many(keys))
    }

    fn store(&self, w: Write<'_>) -> Result<StoreOutcome> {
        self.route(|p| p.store(w), move |e| e.store(w))
    }

    fn store_then_get(&self, w: Write<'_>) -> Result<(StoreOutcome, Option<Item>)> {
        self.route(|p| p.store_then_get(w), move |e| e.store_then_get(w))
    }

    fn store_many(&self, writes: &[Write<'_>]) -> Vec<Result<StoreOutcome>> {
        self.route(|p| p.store_many(writes), |e| e.store_many(writes))
    }

    fn delete(&self, key: &str) -> Result<bool> {
        self.route(|p| p.delete(key), |e| e.delete(key))
    }

    fn delete_many(&self, keys: &[&str]) -> Vec<Result<bool>> {
        self.route(|p| p.delete_many(keys), |e| e.delete_many(keys))
    }

    fn touch(&self, key: &str, exptime: u32) -> Result<bool> {
        self.route(|p| p.touch(key, exptime), |e| e.touch(key, exptime))
    }

    fn incr(&self, key: &str, delta: u64) -> Result<Option<u64>> {
        self.route(|p| p.incr(key, delta), |e| e.incr(key, delta))
    }

    fn decr(&self, key: &str, delta: u64) -> Result<Option<u64>> {
        self.route(|p| p.decr(key, delta), |e| e.decr(key, delta))
    }

    fn flush_all(&self) -> Result<()> {
        // Rare, and every server in turn: the pool's way.
        self.pool.flush_all()
    }

    fn max_value_size(&self, key: &str) -> usize {
        self.pool.max_value_size(key)
    }

    /// The pool's records are the engine's too (one per server).
    fn report(&self, stats: &mut crate::Stats) {
        self.pool.report(stats);
    }

    fn ping(&self) -> std::result::Result<(), crate::ping::PingError> {
        // Every server at once in one round, from this thread: the pool's way.
        self.pool.ping()
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;
    use std::sync::Barrier;
    use std::time::{Duration, Instant};

    use super::*;
    use crate::backend::StoreMode;
    use crate::backend::memcached::engine::tests::{Memcached, Relay, config};

    fn blended(addr: String) -> Blended {
        Blended::new(config(&[addr], |_| {}), 2).unwrap()
    }

    fn set(b: &Blended, key: &str, value: &[u8]) {
        let outcome = b
            .store(Write::new(StoreMode::Set, key, value, 7, 0))
            .unwrap();
        assert_eq!(outcome, StoreOutcome::Stored);
    }

    fn value(b: &Blended, key: &str) -> Option<Vec<u8>> {
        b.get(key).unwrap().map(|i| i.value.to_vec())
    }

    /// Another caller is inside an operation for as long as this lives: the next one takes the
    /// engine.
    struct Busy<'a>(&'a Blended);
    impl<'a> Busy<'a> {
        fn new(b: &'a Blended) -> Busy<'a> {
            b.active.fetch_add(1, Ordering::AcqRel);
            Busy(b)
        }
    }
    impl Drop for Busy<'_> {
        fn drop(&mut self) {
            self.0.active.fetch_sub(1, Ordering::AcqRel);
        }
    }

    #[test]
    fn a_lone_caller_uses_the_pool_and_starts_no_thread() {
        let m = Memcached::start();
        let b = blended(m.addr());
        for i in 0..50 {
            let k = format!("k{i}");
            set(&b, &k, b"v");
            assert_eq!(value(&b, &k).as_deref(), Some(&b"v"[..]));
            assert_eq!(b.get_many(&[k.as_str(), "missing"]).len(), 2);
            assert!(b.delete(&k).unwrap());
        }
        // Callers one after another, on different threads, are each alone.
        for _ in 0..4 {
            std::thread::scope(|s| {
                s.spawn(|| set(&b, "t", b"x"));
            });
        }
        assert!(!b.engine_started(), "no operation overlapped another");
    }

    #[test]
    fn concurrent_callers_share_the_engine_and_read_their_own_writes() {
        let m = Memcached::start();
        let b = blended(m.addr());
        let threads = 16;
        let start = Barrier::new(threads);
        std::thread::scope(|s| {
            for t in 0..threads {
                let (b, start) = (&b, &start);
                s.spawn(move || {
                    start.wait();
                    for i in 0..200 {
                        let k = format!("t{t}-{i}");
                        let v = format!("value of {k}");
                        set(b, &k, v.as_bytes());
                        assert_eq!(value(b, &k).as_deref(), Some(v.as_bytes()), "{k}");
                        let c = format!("c{t}");
                        if i == 0 {
                            set(b, &c, b"0");
                        }
                        assert_eq!(b.incr(&c, 1).unwrap(), Some(i + 1), "{c}");
                        let got = b.get_many(&[k.as_str(), c.as_str(), "nothing"]);
                        assert_eq!(got[0].as_ref().unwrap().as_ref().unwrap().flags, 7);
                        assert!(got[2].as_ref().unwrap().is_none());
                        assert!(b.delete(&k).unwrap());
                        assert_eq!(value(b, &k), None);
                    }
                });
            }
        });
        assert!(b.engine_started(), "16 threads from one barrier overlapped");
    }

    #[test]
    fn a_caller_on_a_runtime_thread_waits_on_the_engine_without_panicking() {
        // `Handle::block_on` would panic here ("cannot start a runtime from within a runtime").
        let m = Memcached::start();
        let b = blended(m.addr());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let _busy = Busy::new(&b);
            set(&b, "k", b"from a task");
            assert_eq!(value(&b, "k").as_deref(), Some(&b"from a task"[..]));
        });
        assert!(b.engine_started());
    }

    #[test]
    fn a_hung_server_fails_engine_callers_within_the_io_timeout() {
        // Accepts (the kernel's backlog) and never answers.
        let hung = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = hung.local_addr().unwrap().to_string();
        let io_timeout = Duration::from_millis(300);
        let b = Blended::new(config(&[addr], |c| c.io_timeout = io_timeout), 2).unwrap();
        let _busy = Busy::new(&b);
        let started = Instant::now();
        let e = b.get("k").unwrap_err();
        assert!(e.is_timeout(), "{e}");
        // Generous: the point is that it returns, not how fast.
        assert!(
            started.elapsed() < io_timeout * 20,
            "{:?}",
            started.elapsed()
        );
        let e = b
            .store(Write::new(StoreMode::Set, "k", b"v", 0, 0))
            .unwrap_err();
        assert!(e.is_timeout() || e.is_outcome_unknown(), "{e}");
    }

    /// On one engine connection, for callers that overlap others, in a sync `Cache` whose
    /// server one transport fault would mark dead (for a minute).
    fn on_one_engine_connection(addr: String) -> Blended {
        let tune = |c: &mut MemcachedConfig| {
            c.io_timeout = Duration::from_secs(5);
            c.failure_limit = 1;
            c.retry_interval = Duration::from_secs(60);
        };
        Blended::new(config(&[addr], tune), 1).unwrap()
    }

    /// No engine connection died, and the server is not marked dead (one fault would have
    /// done it: this write would fail fast).
    fn still_healthy(b: &Blended) {
        let lane = b.lane.get().expect("the engine served");
        assert_eq!(lane.engine.poisonings(), 0, "an engine connection died");
        set(b, "after", b"v");
        assert_eq!(value(b, "after").as_deref(), Some(&b"v"[..]));
    }

    /// A 40 KB read on the engine: its reader keeps the buffer grown for it, so that its later
    /// reads take thousands of short replies at once.
    fn read_a_large_value(b: &Blended) {
        let large = vec![b'L'; 40 * 1024];
        set(b, "large", &large);
        assert_eq!(value(b, "large"), Some(large));
    }

    fn keys(prefix: &str, n: usize) -> Vec<String> {
        (0..n).map(|i| format!("{prefix}{i}")).collect()
    }

    /// On the sync `Cache`'s pipelined path: after a 40 KB read,
    /// deletes of 20,000 absent keys whose replies come in bursts (the relay); then batches of
    /// 100,000 keys, straight to memcached and through the relay: every key answered, no
    /// connection lost, the server never blamed.
    #[test]
    fn engine_callers_get_whole_batches_of_100k_keys_whatever_the_read_sizes() {
        let m = Memcached::start();
        let relay = Relay::bursty(&m.addr());
        let n = 100_000;
        let keys = keys("b:", n);
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        for addr in [relay.addr(), m.addr()] {
            let b = on_one_engine_connection(addr);
            let _busy = Busy::new(&b);
            read_a_large_value(&b);
            let absent = self::keys("absent:", 20_000);
            let absent: Vec<&str> = absent.iter().map(String::as_str).collect();
            let deleted = b.delete_many(&absent);
            let failed = deleted.iter().filter(|r| r.is_err()).count();
            assert_eq!(failed, 0, "{:?}", deleted.iter().find(|r| r.is_err()));
            assert!(deleted.iter().all(|r| matches!(r, Ok(false))));
            let writes: Vec<Write<'_>> = refs
                .iter()
                .map(|k| Write::new(StoreMode::Set, k, k.as_bytes(), 0, 0))
                .collect();
            let stored = b.store_many(&writes);
            assert!(stored.iter().all(|r| matches!(r, Ok(StoreOutcome::Stored))));
            let got = b.get_many(&refs);
            assert!(
                got.iter()
                    .zip(&refs)
                    .all(|(r, k)| matches!(r, Ok(Some(i)) if i.value[..] == *k.as_bytes()))
            );
            let deleted = b.delete_many(&refs);
            assert!(deleted.iter().all(|r| matches!(r, Ok(true))));
            still_healthy(&b);
        }
    }

    /// The same 20,000 deletes on the engine, sent to a server paused for 300 ms (well within
    /// `io_timeout`): their replies come in bursts once it resumes.
    #[test]
    fn an_engine_callers_batch_outlasts_a_paused_server() {
        let m = Memcached::start();
        let relay = Relay::bursty(&m.addr());
        let b = on_one_engine_connection(relay.addr());
        let _busy = Busy::new(&b);
        read_a_large_value(&b);
        let absent = keys("absent:", 20_000);
        let absent: Vec<&str> = absent.iter().map(String::as_str).collect();
        m.signal("STOP");
        let deleted = std::thread::scope(|s| {
            let batch = s.spawn(|| b.delete_many(&absent));
            std::thread::sleep(Duration::from_millis(300));
            m.signal("CONT");
            batch.join().unwrap()
        });
        let failed = deleted.iter().filter(|r| r.is_err()).count();
        assert_eq!(failed, 0, "{:?}", deleted.iter().find(|r| r.is_err()));
        assert!(deleted.iter().all(|r| matches!(r, Ok(false))));
        still_healthy(&b);
    }

    #[test]
    fn dropping_the_backend_ends_the_engine_thread() {
        let m = Memcached::start();
        let b = blended(m.addr());
        {
            let _busy = Busy::new(&b);
            set(&b, "k", b"v");
        }
        let alive = match b.lane.get() {
            Some(lane) => lane.alive.clone(),
            _ => panic!("the engine started"),
        };
        assert_eq!(alive.strong_count(), 1, "the engine's thread runs");
        drop(b);
        let deadline = Instant::now() + Duration::from_secs(10);
        while alive.strong_count() > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(alive.strong_count(), 0, "the engine's thread ended");
    }
}

#[cfg(test)]
mod coop_tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;
    use crate::backend::StoreMode;
    use crate::backend::memcached::engine::tests::{Memcached, config};

    /// A tokio task that calls the sync backend many times in one poll (a loop over keys in
    /// an async fn, `#[tokio::main]`'s body) while another caller keeps it on the engine: the
    /// task's coop budget runs out inside `wait`, every poll of the engine's oneshot returns
    /// Pending and wakes at once, and `wait` spins forever.
    #[test]
    fn many_engine_calls_in_one_task_poll_finish() {
        let m = Memcached::start();
        let b = Arc::new(Blended::new(config(&[m.addr()], |_| {}), 2).unwrap());
        b.active.fetch_add(1, Ordering::AcqRel); // another caller is always inside
        let (tx, rx) = mpsc::channel();
        let b2 = b.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                for i in 0..300 {
                    let _ = tx.send(i);
                    b2.store(Write::new(StoreMode::Set, "k", b"v", 0, 0))
                        .unwrap();
                }
            });
            let _ = tx.send(usize::MAX);
        });
        let mut last = 0;
        loop {
            match rx.recv_timeout(Duration::from_secs(10)) {
                Ok(usize::MAX) => break,
                Ok(i) => last = i,
                Err(_) => panic!("hung in wait() after {last} engine calls in one task poll"),
            }
        }
    }
}

#[cfg(test)]
mod health_tests {
    use std::time::Duration;

    use super::*;
    use crate::backend::StoreMode;
    use crate::backend::memcached::DeadServerPolicy;
    use crate::backend::memcached::engine::tests::{Memcached, config};

    /// The pool and the engine keep separate health records. Under `DeadServerPolicy::Remap`,
    /// once the pool alone has marked a server dead (a stall only lone callers saw), a key of
    /// that server lives on another server for lone callers and on its own server for
    /// concurrent ones: one thread writes through the pool and then reads (through the engine,
    /// because another caller was busy at that moment) the value it had overwritten.
    #[test]
    fn remap_one_thread_reads_its_own_write_across_paths() {
        let a = Memcached::start();
        let b_srv = Memcached::start();
        let tune = |c: &mut MemcachedConfig| {
            c.dead_servers = DeadServerPolicy::Remap;
            c.io_timeout = Duration::from_millis(200);
            c.retry_interval = Duration::from_secs(30);
        };
        let b = Blended::new(config(&[a.addr(), b_srv.addr()], tune), 1).unwrap();
        let only_a = MemcachedBackend::new(config(&[a.addr()], |_| {})).unwrap();
        // A key that lives on server a.
        let key = (0..1000)
            .map(|i| format!("key{i}"))
            .find(|k| {
                b.store(Write::new(StoreMode::Set, k, b"probe", 0, 0))
                    .unwrap();
                only_a.get(k).unwrap().is_some()
            })
            .unwrap();
        b.store(Write::new(StoreMode::Set, &key, b"v1", 0, 0))
            .unwrap();
        {
            // The engine's connection to a is open (a concurrent caller).
            b.active.fetch_add(1, Ordering::AcqRel);
            assert_eq!(&b.get(&key).unwrap().unwrap().value[..], b"v1");
            b.active.fetch_sub(1, Ordering::AcqRel);
        }
        // a stalls for a moment; two lone callers time out on it: the pool marks it dead.
        a.signal("STOP");
        assert!(b.get(&key).is_err());
        assert!(b.get(&key).is_err());
        a.signal("CONT");
        // This thread, alone: its write goes to b (remapped).
        assert_eq!(
            b.store(Write::new(StoreMode::Set, &key, b"v2", 0, 0))
                .unwrap(),
            StoreOutcome::Stored
        );
        // Same thread, next call, while another caller happens to be inside: the engine.
        b.active.fetch_add(1, Ordering::AcqRel);
        let got = b.get(&key).unwrap().map(|i| i.value.to_vec());
        b.active.fetch_sub(1, Ordering::AcqRel);
        assert_eq!(got.as_deref(), Some(&b"v2"[..]), "read its own write");
    }
}

#[cfg(test)]
mod spawn_tests {
    use super::*;
    use crate::backend::StoreMode;
    use crate::backend::memcached::engine::tests::{Memcached, config};

    const NAME: &str = "backend::memcached::blended::spawn_tests::a_thread_that_cannot_start_falls_back_to_the_pool_on_a_runtime_thread";

    /// `lane()` says a machine that cannot start a thread is not an outage (the pool serves).
    /// On a runtime's thread (which `wait` supports), the failed `spawn` drops its closure,
    /// and with it the engine's `Runtime`, inside an async context: tokio panics.
    /// Run in a child process whose thread spawns fail (RUST_MIN_STACK far beyond memory:
    /// pthread_create fails with EAGAIN; libtest then runs the test on its main thread).
    #[test]
    fn a_thread_that_cannot_start_falls_back_to_the_pool_on_a_runtime_thread() {
        if std::env::var_os("NEWCACHE_SPAWN_CHILD").is_none() {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args([NAME, "--exact", "--test-threads=1", "--nocapture"])
                .env("NEWCACHE_SPAWN_CHILD", "1")
                .env("RUST_MIN_STACK", (1usize << 50).to_string())
                .output()
                .unwrap();
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(out.status.success(), "child failed:\n{text}");
            assert!(text.contains("1 passed"), "{text}");
            return;
        }
        assert!(
            std::thread::Builder::new().spawn(|| {}).is_err(),
            "spawns fail here"
        );
        let m = Memcached::start();
        let b = Blended::new(config(&[m.addr()], |_| {}), 2).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            b.active.fetch_add(1, Ordering::AcqRel); // another caller is inside
            b.store(Write::new(StoreMode::Set, "k", b"v", 0, 0))
                .unwrap();
            assert_eq!(&b.get("k").unwrap().unwrap().value[..], b"v");
            b.active.fetch_sub(1, Ordering::AcqRel);
        });
        assert!(!b.engine_started());
    }
}
