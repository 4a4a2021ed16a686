//! Cancellation of AsyncCache futures at the I/O await points of a load, modelled with a backend
//! whose replies come late (as the engine's may: a queued write is applied even if its caller
//! went away).

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use super::AsyncCache;
use crate::backend::{AsyncBackend, Backend, BoxFuture, Item, StoreMode, StoreOutcome, Write};
use crate::cache::Cache;
use crate::error::Result;

/// 0: answers at once. 1: a `cas` store_then_get (a renewal) is applied, its reply never
/// comes. 2: an `add` store_then_get (a placeholder) is applied 50 ms later by a task of its
/// own (its connection is busier than the one the cleanup reads on). 3: an `add`
/// store_then_get is applied at once, its reply comes 50 ms later. 4: an `add` is applied but
/// its read-back misses it, and the re-read never answers. 6: a renewal's `cas` is held back
/// and applied just before the next store (it lands between a give-back's read and its
/// release). Writes settle within 100 ms.
#[derive(Debug)]
struct Late {
    inner: Arc<dyn Backend>,
    mode: AtomicU8,
    /// Mode 6: a renewal's `cas` held back, applied just before the next `store`.
    held: std::sync::Mutex<Option<HeldWrite>>,
}

/// A held-back `cas`: key, value, flags, exptime, CAS token.
type HeldWrite = (String, Vec<u8>, u32, u32, u64);

impl AsyncBackend for Late {
    fn get<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Option<Item>>> {
        // After mode 4: the re-read never answers (the next read, the guard's, does).
        if self
            .mode
            .compare_exchange(5, 0, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            return Box::pin(std::future::pending());
        }
        let r = self.inner.get(key);
        Box::pin(async move { r })
    }
    fn get_many<'a>(&'a self, keys: &'a [&'a str]) -> BoxFuture<'a, Vec<Result<Option<Item>>>> {
        let r = self.inner.get_many(keys);
        Box::pin(async move { r })
    }
    fn store<'a>(&'a self, w: Write<'a>) -> BoxFuture<'a, Result<StoreOutcome>> {
        if let Some((k, v, f, e, cas)) = self.held.lock().unwrap().take() {
            let _ = self
                .inner
                .store(Write::new(StoreMode::Cas(cas), &k, &v, f, e));
        }
        let r = self.inner.store(w);
        Box::pin(async move { r })
    }
    fn store_then_get<'a>(
        &'a self,
        w: Write<'a>,
    ) -> BoxFuture<'a, Result<(StoreOutcome, Option<Item>)>> {
        let mode = self.mode.load(Ordering::SeqCst);
        match (mode, w.mode) {
            (6, StoreMode::Cas(cas)) => {
                *self.held.lock().unwrap() =
                    Some((w.key.to_string(), w.value.to_vec(), w.flags, w.exptime, cas));
                Box::pin(std::future::pending())
            }
            (1, StoreMode::Cas(_)) => {
                let _ = self.inner.store_then_get(w);
                Box::pin(std::future::pending())
            }
            (2, StoreMode::Add) => {
                let inner = self.inner.clone();
                let (key, value, flags, exptime) =
                    (w.key.to_string(), w.value.to_vec(), w.flags, w.exptime);
                let applied = tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    inner.store_then_get(Write {
                        mode: StoreMode::Add,
                        key: &key,
                        value: &value,
                        flags,
                        exptime,
                    })
                });
                Box::pin(async move { applied.await.unwrap() })
            }
            (4, StoreMode::Add) => {
                // twemproxy with server_connections > 1: the pipelined read ran first.
                let r = self.inner.store_then_get(w).map(|(o, _)| (o, None));
                self.mode.store(5, Ordering::SeqCst); // the re-read hangs
                Box::pin(async move { r })
            }
            (3, StoreMode::Add) => {
                let r = self.inner.store_then_get(w);
                Box::pin(async move {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    r
                })
            }
            _ => {
                let r = self.inner.store_then_get(w);
                Box::pin(async move { r })
            }
        }
    }
    fn store_many<'a>(
        &'a self,
        writes: &'a [Write<'a>],
    ) -> BoxFuture<'a, Vec<Result<StoreOutcome>>> {
        let r = self.inner.store_many(writes);
        Box::pin(async move { r })
    }
    fn delete<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<bool>> {
        let r = self.inner.delete(key);
        Box::pin(async move { r })
    }
    fn delete_many<'a>(&'a self, keys: &'a [&'a str]) -> BoxFuture<'a, Vec<Result<bool>>> {
        let r = self.inner.delete_many(keys);
        Box::pin(async move { r })
    }
    fn touch<'a>(&'a self, key: &'a str, exptime: u32) -> BoxFuture<'a, Result<bool>> {
        let r = self.inner.touch(key, exptime);
        Box::pin(async move { r })
    }
    fn incr<'a>(&'a self, key: &'a str, delta: u64) -> BoxFuture<'a, Result<Option<u64>>> {
        let r = self.inner.incr(key, delta);
        Box::pin(async move { r })
    }
    fn decr<'a>(&'a self, key: &'a str, delta: u64) -> BoxFuture<'a, Result<Option<u64>>> {
        let r = self.inner.decr(key, delta);
        Box::pin(async move { r })
    }
    fn flush_all(&self) -> BoxFuture<'_, Result<()>> {
        let r = self.inner.flush_all();
        Box::pin(async move { r })
    }
    fn max_value_size(&self, key: &str) -> usize {
        self.inner.max_value_size(key)
    }
    fn settle_time(&self) -> Duration {
        Duration::from_millis(100)
    }
}

/// The next caller of "k" claims it and loads at once: nothing of a dropped caller holds it
/// (a held claim would make it wait out max_wait, 1 s, and fail).
async fn next_caller_loads_at_once(cache: &AsyncCache, context: impl std::fmt::Display) {
    let t = Instant::now();
    let next = cache
        .get_or_set_with("k", MIN, || async { Ok::<u32, std::io::Error>(2) })
        .await;
    assert!(
        matches!(next, Ok(2)),
        "{context}: the next caller got {next:?} after {:?}",
        t.elapsed()
    );
}

/// lease_ttl 2 s (renewals every 666 ms), max_wait 1 s.
fn late_cache() -> (AsyncCache, Arc<Late>) {
    let sync = Cache::builder()
        .in_memory()
        .lease_ttl(Duration::from_secs(2))
        .max_wait(Duration::from_secs(1))
        .build()
        .unwrap();
    let late = Arc::new(Late {
        inner: sync.inner.config.backend.clone(),
        mode: AtomicU8::new(0),
        held: std::sync::Mutex::new(None),
    });
    (AsyncCache::new(sync, late.clone()), late)
}

const MIN: Duration = Duration::from_secs(60);

/// A `get_or_set_with` of `k` dropped after `after_ms`, its loader still running (`slow`: it
/// sleeps a minute) or not yet started.
async fn drop_a_caller(cache: &AsyncCache, after_ms: u64, slow: bool, why: &str) {
    let load = cache.get_or_set_with("k", MIN, || async move {
        if slow {
            tokio::time::sleep(MIN).await;
        }
        Ok::<u32, std::io::Error>(1)
    });
    let gone = tokio::time::timeout(Duration::from_millis(after_ms), load).await;
    assert!(gone.is_err(), "{why}");
}

/// A leader dropped while its claim's renewal is in flight (the `cas` applied, its reply not
/// yet read): the release reads the claim back and gives it back by its token (a `cas` against
/// the CAS known before the renewal failed, and the claim held every later caller until
/// max_wait ran out). Control: dropped while the loader runs, no renewal in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_dropped_mid_renewal_gives_its_claim_back() {
    for mid_renewal in [false, true] {
        let (cache, late) = late_cache();
        if mid_renewal {
            late.mode.store(1, Ordering::SeqCst);
        }
        // The first renewal is due at 666 ms; the caller goes away at 900 ms.
        drop_a_caller(&cache, 900, true, "the first caller was dropped").await;
        late.mode.store(0, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(50)).await; // the release task runs
        next_caller_loads_at_once(&cache, format!("dropped mid-renewal: {mid_renewal}")).await;
    }
}

/// A caller dropped while its placeholder's `add` is on its way: the claim guard reads the key
/// back and gives the placeholder back, so the next caller loads at once. Mode 3: the write
/// landed before the guard's read (its reply was late). Mode 2: it lands after the guard's
/// first read (queued behind other work on another connection): the guard looks again once
/// writes have settled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_dropped_mid_claim_gives_its_placeholder_back() {
    for mode in [3, 2] {
        placeholder_given_back(mode).await;
    }
}

async fn placeholder_given_back(mode: u8) {
    let (cache, late) = late_cache();
    late.mode.store(mode, Ordering::SeqCst);
    drop_a_caller(&cache, 10, false, "the first caller was dropped mid-claim").await;
    tokio::time::sleep(Duration::from_millis(200)).await; // the write landed; cleanup ran
    late.mode.store(0, Ordering::SeqCst);
    next_caller_loads_at_once(&cache, format!("mode {mode}")).await;
}

/// The claim's `add` answered STORED but its pipelined read-back missed it (twemproxy with
/// server_connections > 1: the protocol's documented reason to re-read). The guard stays armed
/// through the re-read: a caller dropped during it gives its stored placeholder back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_dropped_during_the_claims_reread_gives_its_placeholder_back() {
    let (cache, late) = late_cache();
    late.mode.store(4, Ordering::SeqCst);
    drop_a_caller(&cache, 10, false, "dropped during the re-read").await;
    late.mode.store(0, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(50)).await;
    next_caller_loads_at_once(&cache, "after the drop").await;
}

/// A leader dropped mid-renewal whose renewal (queued on a busier connection) lands between the
/// give-back's read and its release `cas`: the release loses (EXISTS) and is tried again once
/// writes have settled, so the claim, just extended by a full lease, is still given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_landing_after_the_give_backs_read_is_given_back_too() {
    let (cache, late) = late_cache();
    late.mode.store(6, Ordering::SeqCst);
    drop_a_caller(&cache, 900, true, "the first caller was dropped").await;
    late.mode.store(0, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(300)).await; // the release task and its settle
    next_caller_loads_at_once(&cache, "after the drop").await;
}
