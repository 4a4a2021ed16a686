//! The loader API for tasks: `get_or_set_with`, `get_or_set_with_background` and
//! `get_many_or_set_with` run the shared loader logic (`loader/`) on [`AsyncDriver`]: tokio
//! timers for waits, claims renewed inside the caller's future, refreshes in spawned tasks.
//!
//! A coalesced leader whose future is dropped (a client went away mid-request) publishes
//! "abandoned": its followers wake at once and one of them takes over with its own loader (the
//! dropped leader's loader is not `'static`, so it cannot continue detached). The dropped
//! leader's claim is released from a spawned task, so exactly one load runs to completion.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::lease::{AsyncLease, give_back};
use super::{AsyncCache, AsyncDriver};
use crate::cache::Cache;
use crate::cache::io::Disarm;
use crate::error::{Error, LoadError, Result};
use crate::loader::Load;
use crate::loader::coalesce::{InFlight, Leading, Outcome};
use crate::loader::driver::{Driver, LeaseHandle};
use crate::loader::lease::Completed;
use crate::protocol::Claim;
use crate::ttl::Ttl;

impl Driver for AsyncDriver<'_> {
    type Lease = AsyncLease;

    fn hold(&self, _: &Cache, derived: &str, claim: Claim) -> AsyncLease {
        AsyncLease::new(self.0, derived, claim)
    }

    fn leading(&self) -> Leading {
        Leading::Task(std::thread::current().id())
    }

    /// An await blocks no thread: whoever leads makes progress meanwhile.
    fn may_wait_for(&self, _: &InFlight) -> bool {
        true
    }

    fn wait_for(&self, call: &InFlight, deadline: Instant) -> impl Future<Output = Outcome> + Send {
        call.wait_async(deadline)
    }

    fn renewing_all<F: Future>(
        &self,
        held: &mut HashMap<String, AsyncLease>,
        work: F,
    ) -> impl Future<Output = F::Output> {
        AsyncLease::renewing_all(held.values_mut().collect(), work)
    }

    fn complete_many(
        &self,
        batch: Vec<(AsyncLease, Vec<u8>, u32)>,
    ) -> impl Future<Output = Vec<Result<Completed>>> + Send {
        AsyncLease::complete_many(self, batch)
    }
}

impl LeaseHandle for AsyncLease {
    fn key(&self) -> &str {
        AsyncLease::key(self)
    }
    fn serves_others(&self, now_ms: u64, kept_ms: u64) -> bool {
        AsyncLease::serves_others(self, now_ms, kept_ms)
    }
    fn renewing<F: Future>(&mut self, work: F) -> impl Future<Output = F::Output> {
        AsyncLease::renewing_all(vec![self], work)
    }
    fn complete(
        self,
        value: &[u8],
        exptime: u32,
    ) -> impl Future<Output = Result<Completed>> + Send {
        AsyncLease::complete(self, value, exptime)
    }
}

/// Claims being written by a future that may be dropped before it learns whether they landed
/// (a client went away): dropped armed, it reads each key back from a spawned task and gives
/// back the claims that carry this caller's token, so nobody waits out a claim whose holder is
/// gone.
pub(crate) struct ClaimGuard {
    pub(super) cache: Option<AsyncCache>,
    pub(super) claims: Vec<(String, u64)>,
}

impl Disarm for ClaimGuard {
    fn disarm(mut self) {
        self.cache = None;
    }
}

impl Drop for ClaimGuard {
    fn drop(&mut self) {
        if let Some(cache) = self.cache.take() {
            // Claims taken before a load was granted: no displaced value is known here.
            let claims = std::mem::take(&mut self.claims)
                .into_iter()
                .map(|(key, token)| (key, token, None))
                .collect();
            give_back(&cache, claims);
        }
    }
}

/// An async loader, awaited in the caller's future, told whether it refreshes a stale value
/// that the other callers are served meanwhile ([`Refresh`]), which a failed load then leaves
/// in place (the response cache's fill asks).
pub(crate) struct Inline<F>(F, Refresh);

/// `loader` as an [`Inline`] load of a missing value.
pub(crate) fn inline<F>(loader: F) -> Inline<F> {
    Inline(loader, Refresh::Missing)
}

/// What an [`Inline`] loader's load replaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refresh {
    /// Nothing servable: the key was missing, or its value past its staleness bound (others
    /// wait for this load).
    Missing,
    /// A stale (or early-refreshed) value, served to the others while this load runs.
    Stale,
}

impl<'d, T, F, Fut, E> Load<T, AsyncDriver<'d>> for Inline<F>
where
    F: FnOnce(Refresh) -> Fut,
    Fut: Future<Output = std::result::Result<T, E>>,
    E: std::error::Error + Send + Sync + 'static,
{
    fn call(self) -> impl Future<Output = Result<T>> {
        let fut = (self.0)(self.1);
        async move { fut.await.map_err(|e| Error::loader(Arc::new(e))) }
    }
    fn refresh_in_background(
        self,
        _: &Cache,
        _: &AsyncDriver<'d>,
        held: AsyncLease,
        _: &str,
        _: Ttl,
    ) -> Option<(Self, AsyncLease)> {
        // Called only for a held value that others are being served: the refresh runs inline.
        Some((Inline(self.0, Refresh::Stale), held))
    }
}

/// An async loader whose stale-entry refresh runs in a spawned task.
struct Background<F>(F);

impl<'d, T, F, Fut, E> Load<T, AsyncDriver<'d>> for Background<F>
where
    T: Serialize + Send + 'static,
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = std::result::Result<T, E>> + Send + 'static,
    E: std::error::Error + Send + Sync + 'static,
{
    fn call(self) -> impl Future<Output = Result<T>> {
        let f = self.0;
        inline(move |_| f()).call()
    }
    fn refresh_in_background(
        self,
        cache: &Cache,
        driver: &AsyncDriver<'d>,
        held: AsyncLease,
        key: &str,
        ttl: Ttl,
    ) -> Option<(Self, AsyncLease)> {
        // Without a runtime to spawn on, the refresh runs inline.
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return Some((self, held));
        };
        let running = Running::start(driver.0);
        let cache = cache.clone();
        let key = key.to_string();
        rt.spawn(async move {
            let d = AsyncDriver(&running.0);
            // A failed refresh (counted in stats) gives the claim back: the next reader retries.
            let _ = cache
                .run_loader(&d, held, &key, ttl, inline(move |_| (self.0)()))
                .await;
            drop(running);
        });
        None
    }
}

/// A background refresh in flight, counted for [`AsyncCache::shutdown`].
struct Running(AsyncCache);

impl Running {
    fn start(cache: &AsyncCache) -> Running {
        cache.shared().background.fetch_add(1, Ordering::AcqRel);
        Running(cache.clone())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if self.0.shared().background.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.shared().drained.notify_waiters();
        }
    }
}

impl AsyncCache {
    /// Returns the cached value, or computes it with `loader`, stores it for `ttl` and returns
    /// it: [`Cache::get_or_set_with`] for tasks, with the same guarantees (one load per expiry
    /// across processes, bounded waits, invalidations win). The loader is an async closure, so
    /// it can run an sqlx query; it need not be `'static`.
    ///
    /// # Concurrent calls on the same key
    ///
    /// One caller loads (in this process, and across processes sharing the backend); the
    /// others wait for its value, at most the cache's `max_wait`. Once the value is stale, one
    /// caller reloads while the others are served the stale value at once.
    ///
    /// ```
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), newcache::Error> {
    /// use std::sync::Arc;
    /// use std::sync::atomic::{AtomicUsize, Ordering};
    /// use std::time::Duration;
    ///
    /// let cache = newcache::Cache::builder().in_memory().build_async()?;
    /// let loads = Arc::new(AtomicUsize::new(0));
    /// let tasks: Vec<_> = (0..16)
    ///     .map(|_| {
    ///         let (cache, loads) = (cache.clone(), loads.clone());
    ///         tokio::spawn(async move {
    ///             cache
    ///                 .get_or_set_with("report:1", Duration::from_secs(60), || async move {
    ///                     loads.fetch_add(1, Ordering::SeqCst);
    ///                     tokio::time::sleep(Duration::from_millis(20)).await; // the query
    ///                     Ok::<_, std::io::Error>(42u64)
    ///                 })
    ///                 .await
    ///         })
    ///     })
    ///     .collect();
    /// for t in tasks {
    ///     assert_eq!(t.await.expect("no panic")?, 42);
    /// }
    /// assert_eq!(loads.load(Ordering::SeqCst), 1, "one load for 16 callers");
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Dropping this future is safe. If it was loading for other tasks of this process, they
    /// wake at once and one of them loads instead; its claim on the key is released (from a
    /// spawned task), so other processes do not wait for it either.
    ///
    /// # Errors
    ///
    /// As [`Cache::get_or_set_with`]: the loader's error is [`LoadError::Loader`] (an
    /// `Arc<E>`, shared with the tasks of this process that waited for this load, when their
    /// loader's error type is `E` too; one with another error type gets [`LoadError::Cache`]
    /// with [`is_loader`](crate::Error::is_loader)), a wait that ran out is
    /// [`is_wait_timeout`](crate::Error::is_wait_timeout).
    ///
    /// A loader that cannot fail: [`get_or_set`](AsyncCache::get_or_set).
    pub async fn get_or_set_with<T, F, Fut, E>(
        &self,
        key: &str,
        ttl: impl Into<Ttl>,
        loader: F,
    ) -> Result<T, LoadError<E>>
    where
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
        F: FnOnce() -> Fut + Send,
        Fut: Future<Output = std::result::Result<T, E>> + Send,
        E: std::error::Error + Send + Sync + 'static,
    {
        let ttl = ttl.into();
        self.cache
            .coalesced(&AsyncDriver(self), key, ttl, inline(|_| loader()))
            .await
            .map_err(LoadError::from_error)
    }

    /// [`get_or_set_with`](AsyncCache::get_or_set_with) for a value that is computed, not
    /// loaded from something that can fail: the future `compute` returns yields the value
    /// itself, so no error type is named ([`Cache::get_or_set`] for tasks).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> newcache::Result<()> {
    /// use std::time::Duration;
    ///
    /// let cache = newcache::Cache::builder().build_async()?;
    /// let n = cache
    ///     .get_or_set("answer", Duration::from_secs(60), || async { 42u64 })
    ///     .await?;
    /// assert_eq!(n, 42);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// As [`get_or_set_with`](AsyncCache::get_or_set_with).
    ///
    /// # Errors
    ///
    /// The cache's; and, for a caller that waited for another caller's `get_or_set_with` of the
    /// same key whose loader failed, that error ([`is_loader`](crate::Error::is_loader)).
    pub async fn get_or_set<T, F, Fut>(
        &self,
        key: &str,
        ttl: impl Into<Ttl>,
        compute: F,
    ) -> Result<T>
    where
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
        F: FnOnce() -> Fut + Send,
        Fut: Future<Output = T> + Send,
    {
        let loader = move || {
            let fut = compute();
            async move { Ok::<T, std::convert::Infallible>(fut.await) }
        };
        self.cache
            .coalesced(&AsyncDriver(self), key, ttl.into(), inline(|_| loader()))
            .await
    }

    /// As [`get_or_set_with`](AsyncCache::get_or_set_with), but the claimant of a stale entry
    /// returns the stale value at once and refreshes it in a spawned task: no reader of a warm
    /// key waits for a load. A missing key is still loaded in the foreground. The refresh keeps
    /// its claim alive and stores with `cas`; [`shutdown`](AsyncCache::shutdown) waits for the
    /// refreshes still running.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), newcache::Error> {
    /// use std::time::Duration;
    ///
    /// let cache = newcache::Cache::builder().in_memory().build_async()?;
    /// let load = || async { Ok::<_, std::io::Error>("fresh".to_string()) };
    /// // A missing key is loaded in the foreground; a stale one is refreshed in a task.
    /// let v = cache.get_or_set_with_background("k", Duration::from_secs(60), load).await?;
    /// assert_eq!(v, "fresh");
    /// cache.shutdown().await; // waits for refreshes still running (none here)
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`get_or_set_with`](AsyncCache::get_or_set_with) for a foreground load. A background
    /// refresh has no caller to return an error to: it is counted in the stats'
    /// `loader_errors`, and the stale value stays.
    ///
    /// # Cancel safety
    ///
    /// As [`get_or_set_with`](AsyncCache::get_or_set_with); a refresh already spawned runs on.
    pub async fn get_or_set_with_background<T, F, Fut, E>(
        &self,
        key: &str,
        ttl: impl Into<Ttl>,
        loader: F,
    ) -> Result<T, LoadError<E>>
    where
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = std::result::Result<T, E>> + Send + 'static,
        E: std::error::Error + Send + Sync + 'static,
    {
        let ttl = ttl.into();
        self.cache
            .coalesced(&AsyncDriver(self), key, ttl, Background(loader))
            .await
            .map_err(LoadError::from_error)
    }

    /// The batch form of [`get_or_set_with`](AsyncCache::get_or_set_with):
    /// [`Cache::get_many_or_set_with`] for tasks. The loader gets the keys it must compute (an
    /// owned `Vec`, so the future it returns may own it) and returns a map from those keys to
    /// values. Fresh keys are read in one round trip per server, the loader is called once for
    /// all the others (missing, or stale and claimed by this caller), and its values are stored
    /// in one round trip; a key another caller is loading is loaded here too, unstored (a batch
    /// never waits).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), newcache::Error> {
    /// use std::collections::HashMap;
    /// use std::time::Duration;
    ///
    /// let cache = newcache::Cache::builder().in_memory().build_async()?;
    /// cache.set("user:1", "ann", Duration::from_secs(60)).await?;
    /// let users: HashMap<String, String> = cache
    ///     .get_many_or_set_with(&["user:1", "user:2"], Duration::from_secs(60), |wanted| async move {
    ///         assert_eq!(wanted, ["user:2"], "only what is missing"); // one query for all of them
    ///         Ok::<_, std::io::Error>(wanted.into_iter().map(|k| (k, "bob".to_string())).collect())
    ///     })
    ///     .await?;
    /// assert_eq!((users["user:1"].as_str(), users["user:2"].as_str()), ("ann", "bob"));
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`Cache::get_many_or_set_with`]: the loader's error comes back typed
    /// ([`LoadError::Loader`](crate::LoadError::Loader)), and a failed load stores nothing.
    ///
    /// # Cancel safety
    ///
    /// Dropping this future is safe: the claims it holds are given back, as for
    /// [`get_or_set_with`](AsyncCache::get_or_set_with).
    pub async fn get_many_or_set_with<T, K, F, Fut, E>(
        &self,
        keys: &[K],
        ttl: impl Into<Ttl>,
        loader: F,
    ) -> Result<HashMap<String, T>, LoadError<E>>
    where
        T: Serialize + DeserializeOwned + Send,
        K: AsRef<str> + Sync,
        F: FnOnce(Vec<String>) -> Fut + Send,
        Fut: Future<Output = std::result::Result<HashMap<String, T>, E>> + Send,
        E: std::error::Error + Send + Sync + 'static,
    {
        let ttl = ttl.into();
        let loader = |wanted: &[String]| {
            let fut = loader(wanted.to_vec());
            async move { fut.await.map_err(|e| Error::loader(Arc::new(e))) }
        };
        self.cache
            .many_or_set_on(&AsyncDriver(self), keys, ttl, loader)
            .await
            .map_err(LoadError::from_error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Write;
    use crate::cache::io::Io;
    use crate::envelope;
    use crate::protocol::Action;
    use crate::protocol::Mode;

    /// A cold `get_or_set_with` whose future is dropped after its placeholder was written but
    /// before it learned so: the placeholder is given back (or it would hold every other caller
    /// until it lapsed). Disarmed, it stays: the guard is what gives it back.
    #[tokio::test]
    async fn a_claim_dropped_midway_is_given_back() {
        for dropped in [true, false] {
            let cache = crate::Cache::builder().in_memory().build_async().unwrap();
            let d = AsyncDriver(&cache);
            let k = cache.make_key("k");
            let c = &cache.cache;
            let (m, action, _) = c
                .first_read(
                    &d,
                    &k,
                    Mode::Load,
                    c.settings(true, d.max_value_size(&k)),
                    None,
                )
                .await
                .unwrap();
            let Action::StoreThenRead {
                mode,
                value,
                exptime,
            } = action
            else {
                panic!("a cold key is claimed with a placeholder, got {action:?}")
            };
            let guard = d.guard_claims(vec![(k.clone(), m.token())]);
            let w = Write {
                mode,
                key: &k,
                value: &value,
                flags: envelope::FLAGS,
                exptime,
            };
            d.store_then_get(w).await.unwrap();
            if dropped {
                drop(guard); // the caller went away
            } else {
                guard.disarm();
            }
            // The cleanup runs in a spawned task: give it the runtime.
            for _ in 0..100 {
                tokio::task::yield_now().await;
            }
            let left = cache.shared().backend.get(&k).await.unwrap();
            assert_eq!(left.is_none(), dropped, "dropped: {dropped}");
        }
    }
}
