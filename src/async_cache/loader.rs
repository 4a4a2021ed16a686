//! The loader API for tasks: `get_or_set_with` and `get_or_set_with_background`, on the same
//! herd protocol, coalescer and claims as the sync API (`loader/`). What differs is only how the
//! protocol's waits and the claim's renewals run: tokio timers, inside the caller's future.
//!
//! A coalesced leader whose future is dropped (a client went away mid-request) publishes
//! "abandoned": its followers wake at once and one of them takes over with its own loader (the
//! dropped leader's loader is not `'static`, so it cannot continue detached). Its claim is
//! released from a spawned task, so exactly one load runs to completion.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::AsyncCache;
use super::lease::AsyncLease;
use crate::cache::read::Step;
use crate::cache::{DecodePolicy, Herd};
use crate::error::{BoxError, Error, Result};
use crate::loader::coalesce::{Leader, Outcome, Role};
use crate::loader::lease::Completed;
use crate::loader::load_ms;
use crate::protocol::{Action, Found, Grant, Machine, Mode};
use crate::stats::Counters;
use crate::ttl::{Lifetime, Ttl};

/// A loader, awaited inline or (for a stale entry, when allowed) in a spawned task.
trait AsyncLoad<T>: Send + Sized {
    fn call(self) -> impl Future<Output = std::result::Result<T, BoxError>> + Send;
    /// Hands the refresh of a claimed stale entry to a spawned task; gives the loader and the
    /// claim back if this kind of loader runs inline.
    fn refresh_in_background(
        self,
        cache: &AsyncCache,
        lease: AsyncLease,
        ttl: Ttl,
    ) -> Option<(Self, AsyncLease)>;
}

struct Inline<F>(F);

impl<T, F, Fut, E> AsyncLoad<T> for Inline<F>
where
    F: FnOnce() -> Fut + Send,
    Fut: Future<Output = std::result::Result<T, E>> + Send,
    E: Into<BoxError>,
{
    fn call(self) -> impl Future<Output = std::result::Result<T, BoxError>> + Send {
        let fut = (self.0)();
        async move { fut.await.map_err(Into::into) }
    }
    fn refresh_in_background(
        self,
        _: &AsyncCache,
        lease: AsyncLease,
        _: Ttl,
    ) -> Option<(Self, AsyncLease)> {
        Some((self, lease))
    }
}

struct Background<F>(F);

impl<T, F, Fut, E> AsyncLoad<T> for Background<F>
where
    T: Serialize + Send + 'static,
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = std::result::Result<T, E>> + Send + 'static,
    E: Into<BoxError> + 'static,
{
    fn call(self) -> impl Future<Output = std::result::Result<T, BoxError>> + Send {
        Inline(self.0).call()
    }
    fn refresh_in_background(
        self,
        cache: &AsyncCache,
        lease: AsyncLease,
        ttl: Ttl,
    ) -> Option<(Self, AsyncLease)> {
        // Without a runtime to spawn on, the refresh runs inline.
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return Some((self, lease));
        };
        cache.shared.background.fetch_add(1, Ordering::AcqRel);
        let running = Running(cache.clone());
        rt.spawn(async move {
            let cache = running.0.clone();
            // A failed refresh (counted in stats) lets the claim go: the next reader retries.
            let _ = cache.run_loader(lease, ttl, Inline(self.0)).await;
            drop(running);
        });
        None
    }
}

/// Decrements the running-refresh count when a background refresh ends (or is dropped).
struct Running(AsyncCache);

impl Drop for Running {
    fn drop(&mut self) {
        if self.0.shared.background.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.shared.drained.notify_waiters();
        }
    }
}

impl AsyncCache {
    /// Returns the cached value, or computes it with `loader`, stores it for `ttl` and returns
    /// it: [`Cache::get_or_set_with`](crate::Cache::get_or_set_with) for tasks, with the same
    /// guarantees (one load per expiry across processes, bounded waits, invalidations win).
    /// The loader is an async closure, so it can run an sqlx query; it need not be `'static`.
    ///
    /// # Cancellation
    ///
    /// Dropping this future is safe. If it was loading for other tasks of this process, they
    /// wake at once and one of them loads instead; its claim on the key is released, so other
    /// processes do not wait for it either.
    ///
    /// # Errors
    ///
    /// As [`Cache::get_or_set_with`](crate::Cache::get_or_set_with): a loader error is
    /// [`is_loader`](Error::is_loader) (shared with the waiting tasks), a wait that ran out is
    /// [`is_wait_timeout`](Error::is_wait_timeout).
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
        self.coalesced(key, ttl, Inline(loader)).await
    }

    /// As [`get_or_set_with`](AsyncCache::get_or_set_with), but the claimant of a stale entry
    /// returns the stale value at once and refreshes it in a spawned task: no reader of a warm
    /// key waits for a load. A missing key is still loaded in the foreground. The refresh keeps
    /// its claim alive and stores with `cas`; [`shutdown`](AsyncCache::shutdown) waits for
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
        self.coalesced(key, ttl, Background(loader)).await
    }

    async fn coalesced<T, L>(&self, key: &str, ttl: Ttl, loader: L) -> Result<T>
    where
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
        L: AsyncLoad<T>,
    {
        let c = &self.cache;
        let derived = c.keys.make(key)?;
        let deadline = Instant::now() + c.inner.config.max_wait;
        let (m, first) = c
            .first_read(
                &self.io(),
                &derived,
                Mode::Load,
                c.settings(true),
                Some(deadline),
            )
            .await?;
        if let Action::Done(Found::Value { held, stale }) = &first {
            if let Ok(v) = c.decode_held::<T>(held) {
                let s = &c.inner.stats;
                Counters::bump(if *stale { &s.stale_served } else { &s.hits });
                return Ok(v);
            }
        }
        let mut first = Some((m, first));
        let mut loader = Some(loader);
        loop {
            match c.inner.coalescer.join(&derived) {
                Role::Leader(mut leader) => {
                    let (m, action) = first
                        .take()
                        .unwrap_or_else(|| (self.load_machine(deadline), Action::Read));
                    let Some(loader) = loader.take() else {
                        return Err(Error::backend("loader already used"));
                    };
                    let r = self
                        .lead(&derived, ttl, loader, Some(&mut leader), m, action)
                        .await;
                    leader.publish(match &r {
                        Ok(v) => Outcome::Value(Arc::new(v.clone())),
                        Err(e) => Outcome::Failed(e.clone()),
                    });
                    return r;
                }
                Role::Follower(slot) => {
                    first = None;
                    Counters::bump(&c.inner.stats.lease_waits);
                    match slot.wait_async(deadline).await {
                        Outcome::Value(v) => match v.downcast_ref::<T>() {
                            Some(v) => return Ok(v.clone()),
                            // Another type under the same key: do our own call.
                            None => {
                                let m = self.load_machine(deadline);
                                let Some(loader) = loader.take() else {
                                    return Err(Error::backend("loader already used"));
                                };
                                return self
                                    .lead(&derived, ttl, loader, None, m, Action::Read)
                                    .await;
                            }
                        },
                        Outcome::Failed(e) => {
                            if e.is_wait_timeout() {
                                Counters::bump(&c.inner.stats.wait_timeouts);
                            }
                            return Err(e);
                        }
                        // The leader was dropped or panicked: one of us leads now.
                        Outcome::Abandoned => continue,
                        Outcome::Pending => return Err(self.waited_out()),
                    }
                }
            }
        }
    }

    fn load_machine(&self, deadline: Instant) -> Machine {
        let c = &self.cache;
        let mut settings = c.settings(true);
        settings.max_wait_ms = deadline
            .saturating_duration_since(Instant::now())
            .as_millis() as u64;
        Machine::new(Mode::Load, settings, c.token(), c.now())
    }

    fn waited_out(&self) -> Error {
        let c = &self.cache;
        Counters::bump(&c.inner.stats.wait_timeouts);
        Error::wait_timeout(c.inner.config.max_wait)
    }

    async fn lead<T, L>(
        &self,
        derived: &str,
        ttl: Ttl,
        loader: L,
        leader: Option<&mut Leader<'_>>,
        mut m: Machine,
        mut action: Action,
    ) -> Result<T>
    where
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
        L: AsyncLoad<T>,
    {
        let c = &self.cache;
        let s = &c.inner.stats;
        loop {
            let found = match c.drive_on(&self.io(), derived, &mut m, action).await? {
                Step::Load(grant) => {
                    return self
                        .load_granted(derived, ttl, loader, grant, leader)
                        .await;
                }
                Step::Done(found) => found,
            };
            let failed = match found {
                Found::Value { held, stale } => match c.decode_held::<T>(&held) {
                    Ok(v) => {
                        Counters::bump(if stale { &s.stale_served } else { &s.hits });
                        return Ok(v);
                    }
                    Err(e) => e,
                },
                Found::Foreign(e) => e,
                Found::TimedOut => return Err(self.waited_out()),
                Found::Newer => {
                    Counters::bump(&s.newer_format);
                    Counters::bump(&s.misses);
                    return self.load_unclaimed(loader).await;
                }
                Found::Unavailable | Found::Miss { .. } | Found::Busy => {
                    Counters::bump(&s.misses);
                    return self.load_unclaimed(loader).await;
                }
            };
            Counters::bump(&s.decode_errors);
            match c.inner.config.decode_policy {
                DecodePolicy::Error => return Err(failed),
                DecodePolicy::Miss => action = m.take_over(c.now()),
            }
        }
    }

    /// Runs the loader without a claim (nothing can be claimed): its value is returned, not
    /// stored.
    async fn load_unclaimed<T, L: AsyncLoad<T>>(&self, loader: L) -> Result<T> {
        let s = &self.cache.inner.stats;
        Counters::bump(&s.loader_calls);
        loader.call().await.map_err(|e| {
            Counters::bump(&s.loader_errors);
            Error::loader(e)
        })
    }

    async fn load_granted<T, L>(
        &self,
        derived: &str,
        ttl: Ttl,
        loader: L,
        grant: Grant,
        leader: Option<&mut Leader<'_>>,
    ) -> Result<T>
    where
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
        L: AsyncLoad<T>,
    {
        let c = &self.cache;
        let s = &c.inner.stats;
        if grant.held.is_some() {
            Counters::bump(&s.claims_won);
        }
        let held = grant.held.and_then(|h| {
            let v = c.decode_held::<T>(&h).ok()?;
            Some((v, h.header, h.early, h.expired))
        });
        let lease = AsyncLease::new(c, self.shared.backend.clone(), derived, grant.lease);
        let (v, held_header, early) = match held {
            // Past its bound: kept only for this caller's serve-stale-on-error.
            Some((v, header, _, true)) => {
                Counters::bump(&s.misses);
                return match self.run_loader(lease, ttl, loader).await {
                    Err(e) if e.is_loader() && c.young_enough(header.written_ms) => {
                        Counters::bump(&s.stale_on_error);
                        Ok(v)
                    }
                    r => r,
                };
            }
            Some((v, header, early, false)) => (v, header, early),
            None => {
                Counters::bump(&s.misses);
                return self.run_loader(lease, ttl, loader).await;
            }
        };
        Counters::bump(if early { &s.early_refreshes } else { &s.misses });
        // Followers get the value we hold at once; only this caller waits for the load.
        if let Some(l) = leader {
            l.publish(Outcome::Value(Arc::new(v.clone())));
        }
        let Some((loader, lease)) = loader.refresh_in_background(self, lease, ttl) else {
            return Ok(v);
        };
        match self.run_loader(lease, ttl, loader).await {
            Ok(fresh) => Ok(fresh),
            Err(e) if e.is_loader() && early && c.still_servable(&held_header) => Ok(v),
            Err(e) if e.is_loader() && c.young_enough(held_header.written_ms) => {
                Counters::bump(&s.stale_on_error);
                Ok(v)
            }
            Err(e) => Err(e),
        }
    }

    /// Runs the loader under a held claim (renewing it meanwhile) and stores its value with
    /// `cas` against the claim. A result that cannot be stored is still returned, and counted.
    async fn run_loader<T, L>(&self, mut lease: AsyncLease, ttl: Ttl, loader: L) -> Result<T>
    where
        T: Serialize,
        L: AsyncLoad<T>,
    {
        let c = &self.cache;
        let s = &c.inner.stats;
        Counters::bump(&s.loader_calls);
        let started = Instant::now();
        let v = match lease.renewing(loader.call()).await {
            Ok(v) => v,
            Err(e) => {
                Counters::bump(&s.loader_errors);
                // Dropping the lease gives the key back.
                return Err(Error::loader(e));
            }
        };
        let life = ttl.resolve(c.inner.config.default_ttl);
        if life == Lifetime::Expired {
            return Ok(v);
        }
        let (bytes, exptime) = match c.encode(&v, life, Herd::Protected, load_ms(started)) {
            Ok(encoded) => encoded,
            Err(e) if e.is_too_large() => {
                c.loaded_too_large(lease.key(), 0);
                return Ok(v);
            }
            Err(e) => return Err(e),
        };
        if bytes.len() > self.shared.backend.max_value_size(lease.key()) {
            c.loaded_too_large(lease.key(), bytes.len());
            return Ok(v);
        }
        let key_of_lease = lease.key().to_string();
        match lease.complete(&bytes, exptime).await {
            Ok(Completed::Stored) => {}
            Ok(Completed::Superseded) => Counters::bump(&s.loads_superseded),
            // The caller has its value: a store that failed is counted, not returned.
            Err(e) if e.is_too_large() => c.loaded_too_large(&key_of_lease, bytes.len()),
            Err(e) => {
                Counters::bump(&s.backend_errors);
                if e.is_backend() {
                    Counters::bump(&s.backend_errors_absorbed);
                }
            }
        }
        Ok(v)
    }
}
