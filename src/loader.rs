//! The loader API: `get_or_set_with` and friends. One recompute per expiry: in-process coalescing,
//! the CAS claim for stale entries, and a lease (memcached `add`) for missing ones.

use std::collections::{HashMap, HashSet};
use std::error::Error as StdError;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::backend::{StoreMode, StoreOutcome};
use crate::cache::{Cache, Herd, Read};
use crate::coalesce::{Leader, Outcome, Role};
use crate::error::{Error, Result};
use crate::herd::Xfetch;
use crate::key::lease_key;
use crate::stats::Counters;
use crate::ttl::{self, Lifetime, Ttl};

/// What a loader may fail with.
pub(crate) type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// memcached flags on lease items ("NL").
const LEASE_FLAGS: u32 = 0x4E4C;
/// First pause between polls for a lease holder's value; pauses grow to [`MAX_POLL`].
const FIRST_POLL: Duration = Duration::from_millis(2);
const MAX_POLL: Duration = Duration::from_millis(10);

/// A loader, run inline or (for a stale entry, when allowed) on a background thread.
trait Load<T>: Sized {
    fn call(self) -> std::result::Result<T, BoxError>;
    /// Hands the refresh of a stale entry to a background thread; gives the loader back if this
    /// kind of loader runs inline.
    fn refresh_in_background(self, cache: &Cache, key: &str, ttl: Ttl) -> Option<Self>;
}

struct Inline<F>(F);

impl<T, E, F> Load<T> for Inline<F>
where
    F: FnOnce() -> std::result::Result<T, E>,
    E: Into<BoxError>,
{
    fn call(self) -> std::result::Result<T, BoxError> {
        (self.0)().map_err(Into::into)
    }
    fn refresh_in_background(self, _: &Cache, _: &str, _: Ttl) -> Option<Self> {
        Some(self)
    }
}

struct Background<F>(F);

impl<T, E, F> Load<T> for Background<F>
where
    T: Serialize + Send + 'static,
    F: FnOnce() -> std::result::Result<T, E> + Send + 'static,
    E: Into<BoxError>,
{
    fn call(self) -> std::result::Result<T, BoxError> {
        (self.0)().map_err(Into::into)
    }
    fn refresh_in_background(self, cache: &Cache, key: &str, ttl: Ttl) -> Option<Self> {
        let (cache, key) = (cache.clone(), key.to_string());
        // The claim is ours. A failed refresh (counted in stats) leaves the stale value to be
        // claimed again after the herd timeout; so does a thread that could not be spawned.
        let _ = thread::Builder::new()
            .name("newcache-refresh".into())
            .spawn(move || cache.run_loader(&key, ttl, Inline(self.0)));
        None
    }
}

/// How long a load took, in ms for the envelope (at least 1: 0 means "unknown").
fn load_ms(started: Instant) -> u32 {
    started.elapsed().as_millis().clamp(1, u128::from(u32::MAX)) as u32
}

/// Process-unique lease tokens.
#[derive(Debug)]
pub(crate) struct Tokens {
    next: AtomicU64,
    nonce: u64,
}

impl Tokens {
    pub(crate) fn new(nonce: u64) -> Tokens {
        Tokens {
            next: AtomicU64::new(0),
            nonce,
        }
    }
    fn issue(&self) -> String {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        format!("{}-{:x}-{n}", std::process::id(), self.nonce)
    }
}

/// Deletes a lease on drop if it is still ours (also when the loader panics), so that a waiter
/// takes over at once instead of after the lease ttl.
struct LeaseGuard<'a> {
    cache: &'a Cache,
    key: String,
    token: String,
}

impl Drop for LeaseGuard<'_> {
    fn drop(&mut self) {
        let b = &self.cache.inner.backend;
        if let Ok(Some(item)) = b.get(&self.key) {
            if item.value == self.token.as_bytes() {
                let _ = b.delete(&self.key);
            }
        }
    }
}

impl Cache {
    /// Returns the cached value, or computes it with `loader`, stores it for `ttl` and returns it.
    ///
    /// ```
    /// use std::sync::atomic::{AtomicUsize, Ordering};
    /// use std::time::Duration;
    ///
    /// let cache = newcache::Cache::builder().build()?;
    /// let calls = AtomicUsize::new(0);
    /// std::thread::scope(|s| {
    ///     for _ in 0..8 {
    ///         s.spawn(|| {
    ///             let v: String = cache
    ///                 .get_or_set_with("report", Duration::from_secs(60), || {
    ///                     calls.fetch_add(1, Ordering::SeqCst);
    ///                     std::thread::sleep(Duration::from_millis(50)); // the slow query
    ///                     Ok::<_, std::io::Error>("done".to_string())
    ///                 })
    ///                 .unwrap();
    ///             assert_eq!(v, "done");
    ///         });
    ///     }
    /// });
    /// assert_eq!(calls.load(Ordering::SeqCst), 1, "eight callers, one load");
    /// # Ok::<(), newcache::Error>(())
    /// ```
    ///
    /// # Concurrent calls on the same key
    ///
    /// - **Fresh**: returned.
    /// - **Stale**: the one caller (across all processes sharing the backend) whose CAS claim
    ///   wins runs the loader and stores the result; everyone else gets the stale value at once,
    ///   including the callers of this process that were waiting on the claimant.
    /// - **Missing**: callers in this process share one backend read and one loader call; across
    ///   processes, one caller holds a lease (memcached `add` on `{key}:lease`, lasting
    ///   [`lease_ttl`](crate::CacheBuilder::lease_ttl)) and runs the loader, the others poll for
    ///   the value every 2 to 10 ms (jittered). If the lease holder dies, its lease is deleted or
    ///   expires and one waiter takes over. A caller that has waited
    ///   [`max_wait`](crate::CacheBuilder::max_wait) runs the loader itself.
    /// - **Early refresh** (off by default, [`early_refresh`](crate::CacheBuilder::early_refresh)):
    ///   a reader may claim a still-fresh entry shortly before its soft expiry (XFetch), so a
    ///   steady hot key is almost never seen stale.
    ///
    /// # Errors
    ///
    /// A loader error comes back as an error whose [`is_loader`](Error::is_loader) is true and
    /// whose `source()` is the loader's own error; nothing is cached. Callers of this process
    /// that were waiting for that load get a `Loader` error with the same message (the source
    /// stays with the caller whose loader ran). With
    /// [`serve_stale_on_error`](crate::CacheBuilder::serve_stale_on_error), a claimant whose
    /// loader fails returns the stale value instead, if it is young enough. Decode and invalid-key
    /// errors are returned as by [`get`](Cache::get); backend errors follow the failure policy
    /// (by default the loader runs as if the key were missing).
    ///
    /// # Panics
    ///
    /// A panic in the loader propagates to this caller. Nobody is left waiting: the lease is
    /// released and the callers waiting in this process retry (one of them runs its own loader).
    pub fn get_or_set_with<T, F, E>(&self, key: &str, ttl: impl Into<Ttl>, loader: F) -> Result<T>
    where
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
        F: FnOnce() -> std::result::Result<T, E>,
        E: Into<BoxError>,
    {
        self.coalesced(key, ttl.into(), Inline(loader))
    }

    /// As [`get_or_set_with`](Cache::get_or_set_with), but the claimant of a stale entry returns
    /// the stale value at once and runs the loader on a background thread, so no reader of a warm
    /// key waits for a load. A missing key is still loaded in the foreground (there is nothing to
    /// serve meanwhile).
    pub fn get_or_set_with_background<T, F, E>(
        &self,
        key: &str,
        ttl: impl Into<Ttl>,
        loader: F,
    ) -> Result<T>
    where
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
        F: FnOnce() -> std::result::Result<T, E> + Send + 'static,
        E: Into<BoxError>,
    {
        self.coalesced(key, ttl.into(), Background(loader))
    }

    fn coalesced<T, L>(&self, key: &str, ttl: Ttl, loader: L) -> Result<T>
    where
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
        L: Load<T>,
    {
        let derived = self.keys.make(key)?;
        let deadline = Instant::now() + self.inner.max_wait;
        loop {
            match self.inner.coalescer.join(&derived) {
                Role::Leader(mut leader) => {
                    let r = self.lead(key, &derived, ttl, loader, Some(&mut leader));
                    leader.publish(match &r {
                        Ok(v) => Outcome::Value(Arc::new(v.clone())),
                        Err(e) => Outcome::Failed(e.kind(), e.to_string()),
                    });
                    return r;
                }
                Role::Follower(slot) => {
                    Counters::bump(&self.inner.stats.lease_waits);
                    match slot.wait(deadline) {
                        Outcome::Value(v) => match v.downcast_ref::<T>() {
                            Some(v) => return Ok(v.clone()),
                            // Another type under the same key: do our own read.
                            None => return self.lead(key, &derived, ttl, loader, None),
                        },
                        Outcome::Failed(kind, message) => return Err(Error::new(kind, message)),
                        // The leader panicked: retry, one of us leads.
                        Outcome::Abandoned => continue,
                        // Waited long enough: go it alone.
                        Outcome::Pending => return self.lead(key, &derived, ttl, loader, None),
                    }
                }
            }
        }
    }

    /// The work of one caller (a leader, or one that stopped waiting).
    fn lead<T, L>(
        &self,
        key: &str,
        derived: &str,
        ttl: Ttl,
        loader: L,
        leader: Option<&mut Leader<'_>>,
    ) -> Result<T>
    where
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
        L: Load<T>,
    {
        let xfetch = self.inner.early_beta.map(|beta| Xfetch {
            beta,
            draw: self.inner.rng.draw(),
        });
        let read = self.read::<T>(key, xfetch)?;
        let mut leader = leader;
        match self.settle(read, key, ttl, loader, leader.as_deref_mut()) {
            Ok(done) => done,
            Err(loader) => self.load_missing(key, derived, ttl, loader, leader),
        }
    }

    /// Finishes a call from what a read found: the value, a refresh of what this caller claimed,
    /// or a load when the claimed bytes did not decode. A miss gives the loader back.
    fn settle<T, L>(
        &self,
        read: Read<T>,
        key: &str,
        ttl: Ttl,
        loader: L,
        leader: Option<&mut Leader<'_>>,
    ) -> std::result::Result<Result<T>, L>
    where
        T: Serialize + Clone + Send + Sync + 'static,
        L: Load<T>,
    {
        Ok(match read {
            Read::Fresh(v) | Read::Stale(v) => Ok(v),
            Read::Claimed {
                stale: Some(v),
                written_ms,
                early,
            } => {
                // Followers get the value we hold at once; only this caller waits for the load.
                if let Some(l) = leader {
                    l.publish(Outcome::Value(Arc::new(v.clone())));
                }
                self.refresh_claimed(key, ttl, loader, v, written_ms, early)
            }
            Read::Claimed { stale: None, .. } => self.run_loader(key, ttl, loader),
            Read::Miss => return Err(loader),
        })
    }

    /// Refreshes an entry this caller claimed, holding its current (stale or early) value.
    fn refresh_claimed<T, L>(
        &self,
        key: &str,
        ttl: Ttl,
        loader: L,
        held: T,
        written_ms: u64,
        early: bool,
    ) -> Result<T>
    where
        T: Serialize + Clone,
        L: Load<T>,
    {
        let Some(loader) = loader.refresh_in_background(self, key, ttl) else {
            return Ok(held);
        };
        match self.run_loader(key, ttl, loader) {
            Ok(v) => Ok(v),
            // An early refresh failed: the value we hold is still fresh.
            Err(_) if early => Ok(held),
            Err(e) => match self.inner.stale_on_error {
                Some(max_age)
                    if self.now_ms().saturating_sub(written_ms) <= max_age.as_millis() as u64 =>
                {
                    Counters::bump(&self.inner.stats.stale_on_error);
                    Ok(held)
                }
                _ => Err(e),
            },
        }
    }

    /// A missing key: take the lease and load, or wait for the holder's value.
    fn load_missing<T, L>(
        &self,
        key: &str,
        derived: &str,
        ttl: Ttl,
        mut loader: L,
        mut leader: Option<&mut Leader<'_>>,
    ) -> Result<T>
    where
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
        L: Load<T>,
    {
        let b = &self.inner.backend;
        let lease = lease_key(derived);
        let token = self.inner.tokens.issue();
        let lease_exptime = ttl::exptime(
            Lifetime::For(self.inner.lease_ttl),
            Duration::ZERO,
            self.now_ms() / 1000,
        );
        let deadline = Instant::now() + self.inner.max_wait;
        let mut pause = FIRST_POLL;
        let mut counted_wait = false;
        loop {
            match b.store(
                StoreMode::Add,
                &lease,
                token.as_bytes(),
                LEASE_FLAGS,
                lease_exptime,
            ) {
                Ok(StoreOutcome::Stored) => {
                    let _guard = LeaseGuard {
                        cache: self,
                        key: lease,
                        token,
                    };
                    // The previous holder may have stored the value just before we got the lease.
                    let read = self.read::<T>(key, None)?;
                    return self
                        .settle(read, key, ttl, loader, leader)
                        .unwrap_or_else(|loader| self.run_loader(key, ttl, loader));
                }
                Ok(_) => {}
                // No lease to be had (backend down): load without one.
                Err(e) if e.is_backend() => {
                    self.absorb_read(Err::<(), _>(e))?;
                    return self.run_loader(key, ttl, loader);
                }
                Err(e) => return Err(e),
            }
            if !counted_wait {
                Counters::bump(&self.inner.stats.lease_waits);
                counted_wait = true;
            }
            if Instant::now() >= deadline {
                // Documented: after max_wait the caller loads for itself.
                return self.run_loader(key, ttl, loader);
            }
            // Jittered, bounded pauses: 50-100 % of the current step, steps 2 ms -> 10 ms.
            let jitter = 0.5 + self.inner.rng.draw() / 2.0;
            thread::sleep(
                pause
                    .mul_f64(jitter)
                    .min(deadline.saturating_duration_since(Instant::now())),
            );
            pause = (pause * 3 / 2).min(MAX_POLL);
            let read = self.read::<T>(key, None)?;
            loader = match self.settle(read, key, ttl, loader, leader.as_deref_mut()) {
                Ok(done) => return done,
                // Still loading, or the holder is gone: try the lease again.
                Err(loader) => loader,
            };
        }
    }

    /// Runs the loader, stores its value (recording how long it took, for XFetch) and returns it.
    /// A failed store is counted but does not fail the call: the caller has its value.
    fn run_loader<T, L>(&self, key: &str, ttl: Ttl, loader: L) -> Result<T>
    where
        T: Serialize,
        L: Load<T>,
    {
        let s = &self.inner.stats;
        Counters::bump(&s.loader_calls);
        let started = Instant::now();
        match loader.call() {
            Ok(v) => {
                if let Err(e) = self.set_loaded(key, &v, ttl, Herd::Protected, load_ms(started)) {
                    if !e.is_backend() {
                        return Err(e);
                    }
                }
                Ok(v)
            }
            Err(e) => {
                Counters::bump(&s.loader_errors);
                Err(Error::loader(e))
            }
        }
    }

    /// The batch form of [`get_or_set_with`](Cache::get_or_set_with): one backend round trip (per
    /// server) for the reads, one loader call with every key that is missing or that this caller
    /// claimed stale, and one batched write of what the loader returned.
    ///
    /// The loader receives the caller's keys it must compute and returns a map from those keys to
    /// values; keys it leaves out are absent from the result (and not cached). Batches are not
    /// coalesced in-process and take no lease for missing keys: use them where a few duplicate
    /// loads on a cold start are acceptable.
    ///
    /// # Errors
    /// As [`get_or_set_with`](Cache::get_or_set_with).
    pub fn get_many_or_set_with<T, K, F, E>(
        &self,
        keys: &[K],
        ttl: impl Into<Ttl>,
        loader: F,
    ) -> Result<HashMap<String, T>>
    where
        T: Serialize + DeserializeOwned,
        K: AsRef<str>,
        F: FnOnce(&[String]) -> std::result::Result<HashMap<String, T>, E>,
        E: Into<BoxError>,
    {
        let ttl = ttl.into();
        let xfetch = self.inner.early_beta.map(|beta| {
            move || Xfetch {
                beta,
                draw: self.inner.rng.draw(),
            }
        });
        let reads =
            self.read_many::<T, K>(keys, xfetch.as_ref().map(|f| f as &dyn Fn() -> Xfetch))?;
        let mut out = HashMap::with_capacity(reads.len());
        // The keys to load, each once and in the caller's order.
        let mut wanted = Vec::new();
        let mut wanted_set = HashSet::new();
        let mut held = HashMap::new();
        for (k, read) in reads {
            match read {
                Read::Fresh(v) | Read::Stale(v) => {
                    out.insert(k, v);
                }
                Read::Claimed {
                    stale, written_ms, ..
                } => {
                    if let Some(v) = stale {
                        held.insert(k.clone(), (v, written_ms));
                    }
                    if wanted_set.insert(k.clone()) {
                        wanted.push(k);
                    }
                }
                Read::Miss => {
                    if wanted_set.insert(k.clone()) {
                        wanted.push(k);
                    }
                }
            }
        }
        if wanted.is_empty() {
            return Ok(out);
        }
        let s = &self.inner.stats;
        Counters::bump(&s.loader_calls);
        let started = Instant::now();
        let loaded = match loader(&wanted) {
            Ok(m) => m,
            Err(e) => {
                Counters::bump(&s.loader_errors);
                let now = self.now_ms();
                let young = |w: u64| {
                    self.inner
                        .stale_on_error
                        .is_some_and(|max| now.saturating_sub(w) <= max.as_millis() as u64)
                };
                if !held.is_empty() && held.values().all(|(_, w)| young(*w)) {
                    for (k, (v, _)) in held {
                        Counters::bump(&s.stale_on_error);
                        out.insert(k, v);
                    }
                    return Ok(out);
                }
                return Err(Error::loader(e.into()));
            }
        };
        // A failed store is counted but does not fail the call, as in `run_loader`.
        let fresh = loaded.iter().filter(|(k, _)| wanted_set.contains(*k));
        if let Err(e) = self.set_many_loaded(fresh, ttl, load_ms(started)) {
            if !e.is_backend() {
                return Err(e);
            }
        }
        for (k, v) in loaded {
            if wanted_set.contains(&k) {
                out.insert(k, v);
            }
        }
        Ok(out)
    }
}
