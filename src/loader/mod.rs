//! The loader API: `get_or_set_with` and friends. One recompute per expiry: in-process
//! coalescing ([`coalesce`]), then the herd protocol in `Load` mode (claims and placeholders on
//! the value key itself), claims kept alive while the loader runs ([`lease`]), and the result
//! stored with `cas` against the claim, so that a load never undoes an invalidation.

mod batch;
pub(crate) mod coalesce;
pub(crate) mod driver;
pub(crate) mod lease;

use std::future::Future;
use std::sync::Arc;
use std::thread;
use std::time::Instant;

use crate::backend::Traced;
use serde::Serialize;
use serde::de::DeserializeOwned;

use self::coalesce::{Leader, Outcome, Role};
use self::driver::{Driver, LeaseHandle};
use self::lease::Completed;
use crate::cache::io::{Blocking, ready};
use crate::cache::read::Step;
use crate::cache::{Cache, DecodePolicy, Herd};
use crate::codec::{Decode, Encode};
use crate::error::{Error, LoadError, Result};
use crate::protocol::{Action, Claimed, Found, Machine, Mode};
use crate::stats::Counters;
use crate::ttl::{Lifetime, Ttl};

/// A loader as the shared logic sees it: called (inline, or awaited), or handed with its claim
/// to the background when the front end allows it.
pub(crate) trait Load<T, D: Driver>: Sized {
    /// Runs the loader; its error comes back as an [`Error::loader`] (keeping the typed
    /// `Arc<E>`).
    fn call(self) -> impl Future<Output = Result<T>>;
    /// Hands the refresh of a claimed stale entry to the background (a thread, or a task);
    /// gives the loader and the claim back if this kind of loader runs inline (the default).
    fn refresh_in_background(
        self,
        _: &Cache,
        _: &D,
        held: D::Lease,
        _: &str,
        _: Ttl,
    ) -> Option<(Self, D::Lease)> {
        Some((self, held))
    }
}

/// A sync loader, run inline.
pub(crate) struct Inline<F>(pub(crate) F);

impl<'d, T, E, F> Load<T, Blocking<'d>> for Inline<F>
where
    F: FnOnce() -> std::result::Result<T, E>,
    E: std::error::Error + Send + Sync + 'static,
{
    fn call(self) -> impl Future<Output = Result<T>> {
        std::future::ready((self.0)().map_err(|e| Error::loader(Arc::new(e))))
    }
}

/// A sync loader that refreshes a stale entry on a thread of its own.
struct Background<F>(F);

impl<'d, T, E, F> Load<T, Blocking<'d>> for Background<F>
where
    T: Serialize + Send + 'static,
    F: FnOnce() -> std::result::Result<T, E> + Send + 'static,
    E: std::error::Error + Send + Sync + 'static,
{
    fn call(self) -> impl Future<Output = Result<T>> {
        Inline(self.0).call()
    }
    fn refresh_in_background(
        self,
        cache: &Cache,
        _: &Blocking<'d>,
        held: <Blocking<'d> as Driver>::Lease,
        key: &str,
        ttl: Ttl,
    ) -> Option<(Self, <Blocking<'d> as Driver>::Lease)> {
        let cache = cache.clone();
        let key = key.to_string();
        // A failed refresh (counted in stats) lets the claim lapse, and the entry is claimed again
        // after lease_ttl; so does a thread that could not be spawned (the lease is dropped).
        let _ = thread::Builder::new()
            .name("newcache-refresh".into())
            .spawn(move || {
                let io = cache.blocking();
                ready(cache.run_loader(&io, held, &key, ttl, Inline(self.0)))
            });
        None
    }
}

/// How long a load took, in ms for the envelope (at least 1: 0 means "unknown").
pub(crate) fn load_ms(started: Instant) -> u32 {
    started.elapsed().as_millis().clamp(1, u128::from(u32::MAX)) as u32
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
    /// - **Stale**: the one caller (across all processes sharing the backend) whose `cas` claim
    ///   wins runs the loader and stores the result; everyone else gets the stale value at once,
    ///   including the callers of this process that were waiting on the claimant. No value is
    ///   served past its soft expiry plus the herd timeout it was written with; past that, callers
    ///   wait for the load like for a missing key.
    /// - **Missing**: callers in this process share one loader call; across
    ///   processes, one caller stores a *placeholder* under the key (memcached `add`) and runs the
    ///   loader, the others poll for the value every 2 to 10 ms (jittered).
    /// - **Waiting is bounded** by [`max_wait`](crate::CacheBuilder::max_wait), end to end: a
    ///   caller that waited that long for someone else's load gets an error with
    ///   [`is_wait_timeout`](Error::is_wait_timeout). It never runs the loader while the holder is
    ///   alive, so a slow database sees one query, not one per waiter.
    /// - **A slow load keeps its claim**: the holder renews it every third of
    ///   [`lease_ttl`](crate::CacheBuilder::lease_ttl) for up to
    ///   [`max_load_time`](crate::CacheBuilder::max_load_time). A holder that dies (or outlives
    ///   that) stops renewing; once the claim lapses, exactly one waiter takes over.
    /// - **Invalidations win**: a `delete`, `set`, `add` or `set_many` of the key (by this cache or
    ///   any other memcached client) that lands while the loader runs is never overwritten by its
    ///   result: the result is stored with `cas` against the claim, and any write or delete
    ///   changed the key's CAS token. The callers still get the value they loaded.
    /// - **Early refresh** (off by default, [`early_refresh`](crate::CacheBuilder::early_refresh)):
    ///   a reader may claim a still-fresh entry shortly before its soft expiry (XFetch), so a
    ///   steady hot key is almost never seen stale.
    /// - **A value too large to store** is returned. A stale value it was to replace stays
    ///   (served to the others, unclaimed); otherwise its holder stores a small "not
    ///   storable" marker (for the ttl, at most a minute): meanwhile every caller
    ///   (across processes; one per process, coalesced) loads the key at once, without waiting
    ///   for another's load, and stores nothing. Counted in
    ///   [`Stats::too_large`](crate::Stats::too_large) and
    ///   [`Stats::not_storable_loads`](crate::Stats::not_storable_loads), logged once per key.
    /// - **A stale value over this cache's [`item_size`](crate::CacheBuilder::item_size)**
    ///   (another process, with a larger one, wrote it) is not claimed, since it could not be
    ///   put back: the loader's value is returned, and stored over it only if it fits; the
    ///   stale value stays otherwise.
    /// - **The backend down**: nothing can be claimed. Each call (coalesced in this process) runs
    ///   the loader and stores nothing, with the default read policy; with
    ///   `read_failures(Propagate)` it returns the backend error.
    ///
    /// # Errors
    ///
    /// [`LoadError::Loader`] with the loader's own error (an `Arc<E>`); nothing is cached.
    /// Callers of this process that were waiting for that load (threads joined on the same
    /// key) get the same `Arc`, if their loader's error type is `E` too; one whose loader has
    /// another error type gets [`LoadError::Cache`] with an error whose
    /// [`is_loader`](Error::is_loader) is true and whose `source()` is the loader's error. A
    /// caller of another process that waited for a load that failed there learns nothing of its
    /// error: it finds the key free and loads itself. With
    /// [`serve_stale_on_error`](crate::CacheBuilder::serve_stale_on_error), a claimant whose
    /// loader fails returns the stale value instead, if it is young enough.
    ///
    /// Everything else is [`LoadError::Cache`]: a wait that ran out is
    /// [`is_wait_timeout`](Error::is_wait_timeout); decode and invalid-key errors are returned
    /// as by [`get`](Cache::get). `?` into [`newcache::Result`](crate::Result) turns a
    /// `LoadError` into an [`Error`] (a loader's with `is_loader()` and the loader's error as
    /// `source()`).
    ///
    /// A loader that cannot fail: [`get_or_set`](Cache::get_or_set).
    ///
    /// # Panics
    ///
    /// A panic in the loader propagates to this caller. Nobody is left waiting: the placeholder
    /// is removed and the callers waiting in this process retry (one of them loads).
    pub fn get_or_set_with<T, F, E>(
        &self,
        key: &str,
        ttl: impl Into<Ttl>,
        loader: F,
    ) -> Result<T, LoadError<E>>
    where
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
        F: FnOnce() -> std::result::Result<T, E>,
        E: std::error::Error + Send + Sync + 'static,
    {
        ready(self.coalesced(&self.blocking(), key, ttl.into(), Inline(loader)))
            .map_err(LoadError::from_error)
    }

    /// [`get_or_set_with`](Cache::get_or_set_with) for a value that is computed, not loaded
    /// from something that can fail: `compute` returns the value itself (Django's
    /// `get_or_set` takes such a callable default), so no error type is named. The same
    /// guarantees (one computation per expiry across processes, bounded waits, invalidations
    /// win); errors are the cache's only.
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// let cache = newcache::Cache::builder().build()?;
    /// let n = cache.get_or_set("answer", Duration::from_secs(60), || 42u64)?;
    /// assert_eq!(n, 42);
    /// # Ok::<(), newcache::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`get`](Cache::get), and a wait that ran out
    /// ([`is_wait_timeout`](Error::is_wait_timeout)). Its own compute cannot fail, but a caller
    /// that waited for another caller's `get_or_set_with` of the same key whose loader failed
    /// gets that error ([`is_loader`](Error::is_loader)).
    ///
    /// # Panics
    ///
    /// As [`get_or_set_with`](Cache::get_or_set_with).
    pub fn get_or_set<T, F>(&self, key: &str, ttl: impl Into<Ttl>, compute: F) -> Result<T>
    where
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
        F: FnOnce() -> T,
    {
        let loader = Inline(move || Ok::<T, std::convert::Infallible>(compute()));
        ready(self.coalesced(&self.blocking(), key, ttl.into(), loader))
    }

    /// As [`get_or_set_with`](Cache::get_or_set_with), but the claimant of a stale entry returns
    /// the stale value at once and runs the loader on a background thread, so no reader of a warm
    /// key waits for a load. A missing key is still loaded in the foreground (there is nothing to
    /// serve meanwhile). The background load keeps its claim alive and stores with `cas`, as in
    /// the foreground.
    ///
    /// # Errors
    ///
    /// As [`get_or_set_with`](Cache::get_or_set_with). A background load's error reaches no
    /// caller (it is counted in [`stats`](Cache::stats)).
    pub fn get_or_set_with_background<T, F, E>(
        &self,
        key: &str,
        ttl: impl Into<Ttl>,
        loader: F,
    ) -> Result<T, LoadError<E>>
    where
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
        F: FnOnce() -> std::result::Result<T, E> + Send + 'static,
        E: std::error::Error + Send + Sync + 'static,
    {
        ready(self.coalesced(&self.blocking(), key, ttl.into(), Background(loader)))
            .map_err(LoadError::from_error)
    }

    /// `get_or_set_with` on any front end: the fast path, then the in-process coalescer, then
    /// the protocol.
    pub(crate) async fn coalesced<T, D, L>(
        &self,
        d: &D,
        key: &str,
        ttl: Ttl,
        loader: L,
    ) -> Result<T>
    where
        T: Encode + Decode + Clone + Send + Sync + 'static,
        D: Driver,
        L: Load<T, D>,
    {
        let deadline = Instant::now() + self.inner.config.max_wait;
        self.coalesced_until(d, key, ttl, loader, deadline).await
    }

    /// [`coalesced`](Cache::coalesced) whose waits end at `deadline` instead of `max_wait` from
    /// now: for a caller that tries again after another caller's load failed (the response
    /// cache), within one bound.
    pub(crate) async fn coalesced_until<T, D, L>(
        &self,
        d: &D,
        key: &str,
        ttl: Ttl,
        loader: L,
        deadline: Instant,
    ) -> Result<T>
    where
        T: Encode + Decode + Clone + Send + Sync + 'static,
        D: Driver,
        L: Load<T, D>,
    {
        // A near hit: no key derivation, no I/O (the yield first: a future dropped there did
        // nothing).
        if self.inner.near.is_some() {
            d.cooperate().await;
        }
        let kept = match self.near_hit::<T>(key) {
            Ok(v) => return Ok(v),
            Err(kept) => kept,
        };
        // One key derivation per call.
        let derived = self.keys.make(key)?;
        let span = self.span("get_or_set_with", &derived);
        async {
            let ticket = self.near_ticket(&derived);
            // The fast path: a value that may be served is served without joining the coalescer (no
            // lock shared by every caller); only a caller with work to do (a claim, a placeholder,
            // a wait) coordinates with the others of this process.
            let first = self
                .first_read(
                    d,
                    &derived,
                    Mode::Load,
                    self.settings(true, d.max_value_size(&derived)),
                    Some(deadline),
                )
                .await;
            let (m, first) = match first {
                Ok((m, first, _)) => (m, first),
                Err(e) if e.is_backend() => match self.near_outage::<T>(kept.as_ref()) {
                    Some(v) => return Ok(v),
                    None => return Err(e),
                },
                Err(e) => return Err(e),
            };
            if let Some(v) = self.served_filling::<T>(&first, key, ticket) {
                return Ok(v);
            }
            if matches!(first, Action::Done(Found::Unavailable)) {
                if let Some(v) = self.near_outage::<T>(kept.as_ref()) {
                    return Ok(v);
                }
            }
            // Everything past a hit is boxed: the future of a hit stays small (every caller
            // moves it, and a web framework boxes it per request).
            let keys = (key, derived.as_str());
            Box::pin(self.coalesce_or_lead(d, keys, ttl, loader, deadline, (m, first))).await
        }
        .traced(span)
        .await
    }

    /// The fast path's verdict: the value of a first read that may be served as it is (fresh,
    /// or stale while another caller refreshes it), counted; a fresh one read under a near
    /// `ticket` fills `key`'s near copy.
    fn served_filling<T: Decode>(
        &self,
        first: &Action,
        key: &str,
        ticket: Option<crate::near::fence::Ticket>,
    ) -> Option<T> {
        if let (Some(t), Action::Done(Found::Value { held, stale: false })) = (ticket, first) {
            let v = self.decode_servable::<T>(held).ok()?;
            self.near_fill(key, t, held);
            self.count_served(false);
            return Some(v);
        }
        let (v, stale) = self.servable::<T>(first)?;
        self.count_served(stale);
        Some(v)
    }

    /// [`served`](Cache::served) without the count: the value, and whether it is stale.
    pub(crate) fn servable<T: Decode>(&self, first: &Action) -> Option<(T, bool)> {
        let Action::Done(Found::Value { held, stale }) = first else {
            return None;
        };
        Some((self.decode_servable::<T>(held).ok()?, *stale))
    }

    /// Counts a value served by the fast path (a hit, or a stale value served).
    pub(crate) fn count_served(&self, stale: bool) {
        let s = &self.stats;
        Counters::bump(if stale { &s.stale_served } else { &s.hits });
    }

    /// The rest of a `get_or_set_with` that did not hit: the in-process coalescer (lead, or wait
    /// for this process's leader), then the protocol from where the first read left it.
    async fn coalesce_or_lead<T, D, L>(
        &self,
        d: &D,
        keys: (&str, &str),
        ttl: Ttl,
        loader: L,
        deadline: Instant,
        first: (Machine, Action),
    ) -> Result<T>
    where
        T: Encode + Decode + Clone + Send + Sync + 'static,
        D: Driver,
        L: Load<T, D>,
    {
        let mut first = Some(first);
        let mut loader = Some(loader);
        loop {
            match self.inner.coalescer.join(keys.1, d.leading()) {
                Role::Leader(mut leader) => {
                    let (m, action) = first
                        .take()
                        .unwrap_or_else(|| (self.load_machine(d, keys.1, deadline), Action::Read));
                    let Some(loader) = loader.take() else {
                        return Err(self.waited_out());
                    };
                    let r = self
                        .lead(d, keys, ttl, loader, Some(&mut leader), m, action)
                        .await;
                    leader.publish(match &r {
                        Ok(v) => Outcome::Value(Arc::new(v.clone())),
                        Err(e) => Outcome::Failed(e.clone()),
                    });
                    return r;
                }
                Role::Follower(call) => {
                    first = None;
                    if !d.may_wait_for(&call) {
                        // A sync caller on a thread the leading task may need: no in-process
                        // wait. The protocol instead, as a caller of another process that
                        // never waits: it claims the key if the task has not yet (the task
                        // then waits for this load), or loads and stores nothing (the task's
                        // load stores).
                        let Some(loader) = loader.take() else {
                            return Err(self.waited_out());
                        };
                        let m = self.machine(d, keys.1, Mode::Batch, deadline);
                        return self.lead(d, keys, ttl, loader, None, m, Action::Read).await;
                    }
                    Counters::bump(&self.stats.lease_waits);
                    let wait = self.stats.wait_started();
                    let outcome = match d.wait_for(&call, deadline).await {
                        Outcome::Served(v) => {
                            wait.answered_at_once();
                            Outcome::Value(v)
                        }
                        outcome => {
                            drop(wait);
                            outcome
                        }
                    };
                    match outcome {
                        Outcome::Value(v) => match v.downcast_ref::<T>() {
                            Some(v) => return Ok(v.clone()),
                            // Another type under the same key: do our own call.
                            None => {
                                let m = self.load_machine(d, keys.1, deadline);
                                let Some(loader) = loader.take() else {
                                    return Err(self.waited_out());
                                };
                                return self
                                    .lead(d, keys, ttl, loader, None, m, Action::Read)
                                    .await;
                            }
                        },
                        Outcome::Failed(e) => {
                            if e.is_wait_timeout() {
                                Counters::bump(&self.stats.wait_timeouts);
                            }
                            return Err(e);
                        }
                        // The leader panicked (or, in a task, was dropped): retry, one of us
                        // leads.
                        Outcome::Abandoned => continue,
                        Outcome::Pending | Outcome::Served(_) => return Err(self.waited_out()),
                    }
                }
            }
        }
    }

    /// A `Load` machine for derived key `derived` whose waits end at `deadline` (what is left of
    /// this call's max_wait).
    fn load_machine<D: Driver>(&self, d: &D, derived: &str, deadline: Instant) -> Machine {
        self.machine(d, derived, Mode::Load, deadline)
    }

    /// A loader's machine for derived key `derived` in `mode`, its waits ending at `deadline`.
    fn machine<D: Driver>(&self, d: &D, derived: &str, mode: Mode, deadline: Instant) -> Machine {
        let mut settings = self.settings(true, d.max_value_size(derived));
        settings.max_wait_ms = deadline
            .saturating_duration_since(Instant::now())
            .as_millis() as u64;
        Machine::new(mode, settings, self.token(), self.now())
    }

    fn waited_out(&self) -> Error {
        Counters::bump(&self.stats.wait_timeouts);
        Error::wait_timeout(self.inner.config.max_wait)
    }

    /// The work of one caller: run the protocol from `action`, then serve, load, or give up
    /// waiting.
    // The driver, the call's key and ttl, its loader, its coalescer role and its machine: each
    // is needed, and bundling them would only rename them.
    #[allow(clippy::too_many_arguments)]
    async fn lead<T, D, L>(
        &self,
        d: &D,
        keys: (&str, &str),
        ttl: Ttl,
        loader: L,
        leader: Option<&mut Leader<'_>>,
        mut m: Machine,
        mut action: Action,
    ) -> Result<T>
    where
        T: Encode + Decode + Clone + Send + Sync + 'static,
        D: Driver,
        L: Load<T, D>,
    {
        let s = &self.stats;
        loop {
            let found = match self.drive_on(d, keys.1, &mut m, action).await? {
                Step::Load(claimed) => {
                    return self
                        .load_claimed(d, keys, ttl, loader, *claimed, leader)
                        .await;
                }
                Step::Done(found) => found,
            };
            let failed = match found {
                Found::Value { held, stale } => match self.decode_servable::<T>(&held) {
                    Ok(v) => {
                        Counters::bump(if stale { &s.stale_served } else { &s.hits });
                        // Found there, not waited for: the followers were not kept waiting
                        // for a load either.
                        if let (Some(l), false) = (leader, m.slept()) {
                            l.publish(Outcome::Served(Arc::new(v.clone())));
                        }
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
                // The last load's value could not be stored: load it at once, unclaimed.
                Found::NotStorable => {
                    Counters::bump(&s.misses);
                    Counters::bump(&s.not_storable_loads);
                    return self.load_unclaimed(loader).await;
                }
                // The backend is down (and the read policy absorbed it): nothing can be claimed.
                // With a near tier and `serve_stale_on_error`, the value loaded is kept near, so
                // that this process does not load it again on every request while the store is
                // down.
                Found::Unavailable
                    if self.inner.near.is_some() && self.inner.config.stale_on_error.is_some() =>
                {
                    Counters::bump(&s.misses);
                    let ticket = self.near_ticket(keys.1);
                    let started = Instant::now();
                    let v = self.load_unclaimed(loader).await?;
                    if let Some(t) = ticket {
                        let life = v
                            .lifetime()
                            .map_or(ttl, Ttl::from)
                            .resolve(self.inner.config.default_ttl);
                        if life != Lifetime::Expired {
                            if let Ok((bytes, _)) =
                                self.encode(&v, life, Herd::Protected, load_ms(started))
                            {
                                self.near_fill_written(keys.0, t, 0, &bytes);
                            }
                        }
                    }
                    return Ok(v);
                }
                Found::Unavailable | Found::Miss { .. } | Found::Busy => {
                    Counters::bump(&s.misses);
                    return self.load_unclaimed(loader).await;
                }
            };
            Counters::bump(&s.decode_errors);
            match self.inner.config.decode_policy {
                DecodePolicy::Error => return Err(failed),
                // Overwrite what cannot be read: take the key over, as for a dead claim.
                DecodePolicy::Miss => action = m.take_over(self.now()),
            }
        }
    }

    /// This caller holds the key: load (or hand the load to a background thread).
    async fn load_claimed<T, D, L>(
        &self,
        d: &D,
        (key, derived): (&str, &str),
        ttl: Ttl,
        loader: L,
        claimed: Claimed,
        leader: Option<&mut Leader<'_>>,
    ) -> Result<T>
    where
        T: Encode + Decode + Clone + Send + Sync + 'static,
        D: Driver,
        L: Load<T, D>,
    {
        let s = &self.stats;
        if claimed.value.is_some() && claimed.claim.is_claim() {
            Counters::bump(&s.claims_won);
        }
        let held = claimed.value.and_then(|h| {
            let v = self.decode_servable::<T>(&h).ok()?;
            Some((v, h.header, h.early, h.expired))
        });
        let lease = d.hold(self, derived, claimed.claim);
        let (v, held_header, early) = match held {
            // Past its bound: kept only for this caller's serve-stale-on-error.
            Some((v, header, _, true)) => {
                let written_ms = header.written_ms;
                Counters::bump(&s.misses);
                return match self.run_loader(d, lease, key, ttl, loader).await {
                    Err(e) if e.is_loader() && self.young_enough(written_ms) => {
                        Counters::bump(&s.stale_on_error);
                        Ok(v)
                    }
                    r => r,
                };
            }
            Some((v, header, early, false)) => (v, header, early),
            None => {
                Counters::bump(&s.misses);
                return self.run_loader(d, lease, key, ttl, loader).await;
            }
        };
        Counters::bump(if early { &s.early_refreshes } else { &s.misses });
        // Followers get the value we hold at once; only this caller waits for the load.
        if let Some(l) = leader {
            l.publish(Outcome::Served(Arc::new(v.clone())));
        }
        let Some((loader, lease)) = loader.refresh_in_background(self, d, lease, key, ttl) else {
            return Ok(v);
        };
        match self.run_loader(d, lease, key, ttl, loader).await {
            Ok(fresh) => Ok(fresh),
            // An early refresh failed: the value we hold is served while it may be.
            Err(e) if e.is_loader() && early && self.still_servable(&held_header) => Ok(v),
            Err(e) if e.is_loader() && self.young_enough(held_header.written_ms) => {
                Counters::bump(&s.stale_on_error);
                Ok(v)
            }
            Err(e) => Err(e),
        }
    }

    /// Whether a value with this header may still be served to anyone (within its bound).
    pub(crate) fn still_servable(&self, h: &crate::envelope::Header) -> bool {
        let unclaimed = crate::envelope::Header {
            claim_until_ms: 0,
            ..*h
        };
        crate::herd::servable(crate::herd::judge(&unclaimed, self.now_ms(), None))
    }

    /// How old (ms) a value may be and still be served when its refresh fails
    /// ([`serve_stale_on_error`](crate::CacheBuilder::serve_stale_on_error)); 0: never.
    pub(crate) fn kept_ms(&self) -> u64 {
        self.inner
            .config
            .stale_on_error
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }

    /// Whether a value computed at `written_ms` may be served when its refresh failed.
    pub(crate) fn young_enough(&self, written_ms: u64) -> bool {
        self.inner.config.stale_on_error.is_some_and(|max_age| {
            self.now_ms().saturating_sub(written_ms) <= max_age.as_millis() as u64
        })
    }

    /// Runs the loader under a held claim and stores its value with `cas` against the claim.
    /// A result that cannot be stored (the key changed meanwhile, too large, the backend failed)
    /// is still returned, and counted: the caller has its value.
    pub(crate) async fn run_loader<T, D, L>(
        &self,
        d: &D,
        mut lease: D::Lease,
        key: &str,
        ttl: Ttl,
        loader: L,
    ) -> Result<T>
    where
        T: Encode,
        D: Driver,
        L: Load<T, D>,
    {
        let s = &self.stats;
        let load = s.load_started();
        let v = lease.renewing(load.run(|| loader.call())).await;
        let started = load.started();
        load.finished(v.is_ok());
        let v = match v {
            Ok(v) => v,
            Err(e) => {
                // Dropping the lease gives the key back.
                return Err(e);
            }
        };
        // A value may choose its own lifetime (a page: its response's max-age, or a short
        // hit-for-pass marker).
        let ttl = v.lifetime().map_or(ttl, Ttl::from);
        let life = ttl.resolve(self.inner.config.default_ttl);
        if life == Lifetime::Expired {
            // A zero ttl stores nothing; the placeholder goes.
            return Ok(v);
        }
        let limit = d.max_value_size(lease.key());
        let encoded = match self.encode(&v, life, Herd::Protected, load_ms(started)) {
            Ok(encoded) if self.check_room(&encoded.0, limit).is_ok() => Some(encoded),
            Ok((bytes, _)) => {
                self.loaded_too_large(lease.key(), key, bytes.len());
                None
            }
            Err(e) if e.is_too_large() => {
                self.loaded_too_large(lease.key(), key, 0);
                None
            }
            Err(e) => return Err(e),
        };
        let (bytes, exptime) = match encoded {
            Some(encoded) => encoded,
            // Too large to store, over a stale value others are served: dropping the lease
            // gives it back unclaimed, and one caller at a time refreshes it while it may be
            // served.
            None if lease.serves_others(self.now_ms(), self.kept_ms()) => return Ok(v),
            // Too large, and nothing servable: the claim is completed with a "not storable"
            // marker instead (the same fenced `cas`), so that callers load it at once rather
            // than in turn behind each other's placeholders.
            None => self.not_storable_marker(life),
        };
        let key_of_lease = lease.key().to_string();
        let ticket = self.near_ticket(&key_of_lease);
        match lease.complete(&bytes, exptime).await {
            // Stored under this caller's claim: the near copy may hold it (unless anything
            // else was written to the key meanwhile).
            Ok(Completed::Stored) => {
                if let Some(t) = ticket {
                    self.near_fill_written(key, t, 1, &bytes);
                }
            }
            Ok(Completed::Superseded) => Counters::bump(&s.loads_superseded),
            // The caller has its value: a store that failed (the guard, dropped, released the
            // claim) is counted, not returned.
            Err(e) if e.is_too_large() => self.loaded_too_large(&key_of_lease, key, bytes.len()),
            Err(e) => {
                s.backend_error(&e);
                if e.is_backend() {
                    s.absorbed(&e);
                }
            }
        }
        Ok(v)
    }

    /// A load with no claim (the backend is down): nothing is stored.
    async fn load_unclaimed<T, D: Driver, L: Load<T, D>>(&self, loader: L) -> Result<T> {
        let s = &self.stats;
        let load = s.load_started();
        let v = load.run(|| loader.call()).await;
        load.finished(v.is_ok());
        v
    }
}
