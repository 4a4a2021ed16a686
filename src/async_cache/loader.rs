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
use std::sync::atomic::Ordering;
use std::time::Instant;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::AsyncCache;
use super::lease::{AsyncLease, give_back};
use crate::backend::{Item, StoreOutcome, Write};
use crate::cache::Cache;
use crate::cache::io::{Disarm, Io};
use crate::error::{BoxError, Result};
use crate::loader::Load;
use crate::loader::coalesce::{Outcome, Slot};
use crate::loader::driver::{Claim, Driver};
use crate::loader::lease::Completed;
use crate::protocol::Lease;
use crate::ttl::Ttl;

/// The async front end's [`Io`] and [`Driver`]: the cache's async backend, tokio timers, and
/// claims kept alive inside the caller's future.
#[derive(Clone, Copy)]
pub(crate) struct AsyncDriver<'a>(pub(crate) &'a AsyncCache);

impl Io for AsyncDriver<'_> {
    type ClaimGuard = ClaimGuard;
    fn guard_claims(&self, claims: Vec<(String, u64)>) -> ClaimGuard {
        ClaimGuard {
            cache: Some(self.0.clone()),
            claims,
        }
    }
    fn get<'a>(&'a self, key: &'a str) -> impl Future<Output = Result<Option<Item>>> + Send + 'a {
        self.0.shared.backend.get(key)
    }
    fn get_many<'a>(
        &'a self,
        keys: &'a [&'a str],
    ) -> impl Future<Output = Vec<Result<Option<Item>>>> + Send + 'a {
        self.0.shared.backend.get_many(keys)
    }
    fn store<'a>(&'a self, w: Write<'a>) -> impl Future<Output = Result<StoreOutcome>> + Send + 'a {
        self.0.shared.backend.store(w)
    }
    fn store_then_get<'a>(
        &'a self,
        w: Write<'a>,
    ) -> impl Future<Output = Result<(StoreOutcome, Option<Item>)>> + Send + 'a {
        self.0.shared.backend.store_then_get(w)
    }
    fn store_many<'a>(
        &'a self,
        writes: &'a [Write<'a>],
    ) -> impl Future<Output = Vec<Result<StoreOutcome>>> + Send + 'a {
        self.0.shared.backend.store_many(writes)
    }
    fn delete<'a>(&'a self, key: &'a str) -> impl Future<Output = Result<bool>> + Send + 'a {
        self.0.shared.backend.delete(key)
    }
    fn delete_many<'a>(
        &'a self,
        keys: &'a [&'a str],
    ) -> impl Future<Output = Vec<Result<bool>>> + Send + 'a {
        self.0.shared.backend.delete_many(keys)
    }
    fn touch<'a>(
        &'a self,
        key: &'a str,
        exptime: u32,
    ) -> impl Future<Output = Result<bool>> + Send + 'a {
        self.0.shared.backend.touch(key, exptime)
    }
    fn incr<'a>(
        &'a self,
        key: &'a str,
        delta: u64,
    ) -> impl Future<Output = Result<Option<u64>>> + Send + 'a {
        self.0.shared.backend.incr(key, delta)
    }
    fn decr<'a>(
        &'a self,
        key: &'a str,
        delta: u64,
    ) -> impl Future<Output = Result<Option<u64>>> + Send + 'a {
        self.0.shared.backend.decr(key, delta)
    }
    fn flush_all<'a>(&'a self) -> impl Future<Output = Result<()>> + Send + 'a {
        self.0.shared.backend.flush_all()
    }
    fn max_value_size(&self, key: &str) -> usize {
        self.0.shared.backend.max_value_size(key)
    }
    fn sleep<'a>(&'a self, d: std::time::Duration) -> impl Future<Output = ()> + Send + 'a {
        tokio::time::sleep(d)
    }
}

impl Driver for AsyncDriver<'_> {
    type Held = AsyncLease;

    fn hold(&self, cache: &Cache, derived: &str, lease: Lease) -> AsyncLease {
        AsyncLease::new(cache, self.0.shared.backend.clone(), derived, lease)
    }

    fn wait_for(&self, slot: &Slot, deadline: Instant) -> impl Future<Output = Outcome> + Send {
        slot.wait_async(deadline)
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
        AsyncLease::complete_many(&*self.0.shared.backend, batch)
    }
}

impl Claim for AsyncLease {
    fn key(&self) -> &str {
        AsyncLease::key(self)
    }
    fn serves_others(&self, now_ms: u64) -> bool {
        AsyncLease::serves_others(self, now_ms)
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
    cache: Option<AsyncCache>,
    claims: Vec<(String, u64)>,
}

impl Disarm for ClaimGuard {
    fn disarm(mut self) {
        self.cache = None;
    }
}

impl Drop for ClaimGuard {
    fn drop(&mut self) {
        if let Some(cache) = self.cache.take() {
            give_back(
                &cache.cache,
                &cache.shared.backend,
                std::mem::take(&mut self.claims),
            );
        }
    }
}

/// An async loader, awaited in the caller's future.
pub(crate) struct Inline<F>(F);

/// An async loader for the crate's own callers of the shared loader logic (the response
/// cache), which call [`Cache::coalesced`] with a value type of their own. The loader is told
/// whether it refreshes a stale value that the other callers are served meanwhile
/// ([`Refresh`]), which a failed load then leaves in place.
#[cfg(feature = "tower")]
pub(crate) fn inline<F>(loader: F) -> Told<F> {
    Told(loader, Refresh::Missing)
}

/// What a [`Told`] loader's load replaces.
#[cfg(feature = "tower")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refresh {
    /// Nothing servable: the key was missing, or its value past its staleness bound (others
    /// wait for this load).
    Missing,
    /// A stale (or early-refreshed) value, served to the others while this load runs.
    Stale,
}

/// An inline async loader told what its load replaces: see [`inline`].
#[cfg(feature = "tower")]
pub(crate) struct Told<F>(F, Refresh);

#[cfg(feature = "tower")]
impl<'d, T, F, Fut, E> Load<T, AsyncDriver<'d>> for Told<F>
where
    F: FnOnce(Refresh) -> Fut,
    Fut: Future<Output = std::result::Result<T, E>>,
    E: Into<BoxError>,
{
    fn call(self) -> impl Future<Output = std::result::Result<T, BoxError>> {
        let fut = (self.0)(self.1);
        async move { fut.await.map_err(Into::into) }
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
        Some((Told(self.0, Refresh::Stale), held))
    }
}

impl<'d, T, F, Fut, E> Load<T, AsyncDriver<'d>> for Inline<F>
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = std::result::Result<T, E>>,
    E: Into<BoxError>,
{
    fn call(self) -> impl Future<Output = std::result::Result<T, BoxError>> {
        let fut = (self.0)();
        async move { fut.await.map_err(Into::into) }
    }
    fn refresh_in_background(
        self,
        _: &Cache,
        _: &AsyncDriver<'d>,
        held: AsyncLease,
        _: &str,
        _: Ttl,
    ) -> Option<(Self, AsyncLease)> {
        Some((self, held))
    }
}

/// An async loader whose stale-entry refresh runs in a spawned task.
struct Background<F>(F);

impl<'d, T, F, Fut, E> Load<T, AsyncDriver<'d>> for Background<F>
where
    T: Serialize + Send + 'static,
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = std::result::Result<T, E>> + Send + 'static,
    E: Into<BoxError> + 'static,
{
    fn call(self) -> impl Future<Output = std::result::Result<T, BoxError>> {
        Inline(self.0).call()
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
            let _ = cache.run_loader(&d, held, &key, ttl, Inline(self.0)).await;
            drop(running);
        });
        None
    }
}

/// A background refresh in flight, counted for [`AsyncCache::shutdown`].
struct Running(AsyncCache);

impl Running {
    fn start(cache: &AsyncCache) -> Running {
        cache.shared.background.fetch_add(1, Ordering::AcqRel);
        Running(cache.clone())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if self.0.shared.background.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.shared.drained.notify_waiters();
        }
    }
}

impl AsyncCache {
    /// Returns the cached value, or computes it with `loader`, stores it for `ttl` and returns
    /// it: [`Cache::get_or_set_with`] for tasks, with the same guarantees (one load per expiry
    /// across processes, bounded waits, invalidations win). The loader is an async closure, so
    /// it can run an sqlx query; it need not be `'static`.
    ///
    /// # Cancel safety
    ///
    /// Dropping this future is safe. If it was loading for other tasks of this process, they
    /// wake at once and one of them loads instead; its claim on the key is released (from a
    /// spawned task), so other processes do not wait for it either.
    ///
    /// # Errors
    ///
    /// As [`Cache::get_or_set_with`]: a loader error is
    /// [`is_loader`](crate::Error::is_loader) (shared with the waiting tasks), a wait that ran
    /// out is [`is_wait_timeout`](crate::Error::is_wait_timeout).
    pub async fn get_or_set_with<T, F, Fut, E>(
        &self,
        key: &str,
        ttl: impl Into<Ttl>,
        loader: F,
    ) -> Result<T>
    where
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
        F: FnOnce() -> Fut + Send,
        Fut: Future<Output = std::result::Result<T, E>> + Send,
        E: Into<BoxError>,
    {
        let ttl = ttl.into();
        self.cache
            .coalesced(&AsyncDriver(self), key, ttl, Inline(loader))
            .await
    }

    /// As [`get_or_set_with`](AsyncCache::get_or_set_with), but the claimant of a stale entry
    /// returns the stale value at once and refreshes it in a spawned task: no reader of a warm
    /// key waits for a load. A missing key is still loaded in the foreground. The refresh keeps
    /// its claim alive and stores with `cas`; [`shutdown`](AsyncCache::shutdown) waits for the
    /// refreshes still running.
    pub async fn get_or_set_with_background<T, F, Fut, E>(
        &self,
        key: &str,
        ttl: impl Into<Ttl>,
        loader: F,
    ) -> Result<T>
    where
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = std::result::Result<T, E>> + Send + 'static,
        E: Into<BoxError> + 'static,
    {
        let ttl = ttl.into();
        self.cache
            .coalesced(&AsyncDriver(self), key, ttl, Background(loader))
            .await
    }

    /// The batch form of [`get_or_set_with`](AsyncCache::get_or_set_with):
    /// [`Cache::get_many_or_set_with`] for tasks. The loader gets the keys it must compute (an
    /// owned `Vec`, so the future it returns may own it) and returns a map from those keys to
    /// values.
    pub async fn get_many_or_set_with<T, K, F, Fut, E>(
        &self,
        keys: &[K],
        ttl: impl Into<Ttl>,
        loader: F,
    ) -> Result<HashMap<String, T>>
    where
        T: Serialize + DeserializeOwned + Send,
        K: AsRef<str> + Sync,
        F: FnOnce(Vec<String>) -> Fut + Send,
        Fut: Future<Output = std::result::Result<HashMap<String, T>, E>> + Send,
        E: Into<BoxError>,
    {
        let ttl = ttl.into();
        let loader = |wanted: &[String]| {
            let fut = loader(wanted.to_vec());
            async move { fut.await.map_err(Into::into) }
        };
        self.cache
            .many_or_set_on(&AsyncDriver(self), keys, ttl, loader)
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
                .first_read(&d, &k, Mode::Load, c.settings(true), None)
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
            let left = cache.shared.backend.get(&k).await.unwrap();
            assert_eq!(left.is_none(), dropped, "dropped: {dropped}");
        }
    }
}
