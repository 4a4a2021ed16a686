//! `AsyncCache`: the facade for tokio. Every operation is the sync `Cache`'s own logic (written
//! once, generic over [`Io`](crate::cache::io::Io)) awaited on an async backend: the memory
//! backend, or the pipelined memcached engine (`backend/memcached/engine/`). The herd protocol's machine,
//! the keys, the envelope and the stats are the same objects, so a sync `Cache` and an
//! `AsyncCache` over the same servers interoperate, and an `AsyncCache` is a `Cache` (its core:
//! store, stats, coalescer, keys) seen through the async backend the core keeps for its async
//! views (`Cache::to_async`, `AsyncCache::to_sync`).

#[cfg(test)]
mod cancel_tests;
mod lease;
pub(crate) mod loader;

use std::collections::HashMap;
use std::fmt;
#[cfg(test)]
use std::sync::Arc;
use std::sync::atomic::Ordering;

use serde::Serialize;
use serde::de::DeserializeOwned;

#[cfg(test)]
use crate::backend::AsyncBackend;
use crate::backend::{Item, StoreOutcome, Write};
use crate::cache::io::Io;
use crate::cache::{Cache, Herd};
use crate::error::Result;
use crate::stats::Stats;
use crate::ttl::Ttl;
use std::future::Future;

/// A thundering-herd-safe cache for async code (tokio): the same cache as [`Cache`], with
/// `async` methods. Build one with [`CacheBuilder::build_async`](crate::CacheBuilder::build_async),
/// or take a `Cache`'s async view ([`Cache::to_async`]); [`to_sync`](AsyncCache::to_sync) gives
/// its sync view. Views of one cache share everything but their I/O: the store, the stats, the
/// in-process coalescer, the keys and the servers' health.
///
/// `AsyncCache` is `Clone + Send + Sync + 'static` (clones share everything), and every future it
/// returns is `Send`: use it from axum handlers and `tokio::spawn`ed tasks alike. It needs a
/// tokio runtime with I/O and timers enabled (`#[tokio::main]`'s default), multi-thread or
/// current-thread: without timers a load panics in tokio. Deadlines (`max_wait`, claims, their
/// renewals) follow the real clock, as they must across processes: under tokio's paused test
/// clock (`start_paused`) a load that sleeps in virtual time still renews in real time, so test
/// expiries with [`MockClock`](crate::testing::MockClock) instead.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), newcache::Error> {
/// use std::time::Duration;
///
/// let cache = newcache::Cache::builder().in_memory().flavor("docs").build_async()?;
/// cache.set("greeting", "hello", Duration::from_secs(60)).await?;
/// assert_eq!(cache.get::<String>("greeting").await?.as_deref(), Some("hello"));
///
/// // One load per expiry, however many tasks ask at once.
/// let report: u64 = cache
///     .get_or_set_with("report", Duration::from_secs(60), || async {
///         Ok::<_, std::io::Error>(42) // e.g. an sqlx query
///     })
///     .await?;
/// assert_eq!(report, 42);
/// # Ok(())
/// # }
/// ```
///
/// # Connections and cancel safety (memcached)
///
/// Per server, a few pipelined connections
/// ([`async_connections`](crate::CacheBuilder::async_connections), 2 by default) carry every
/// task's requests; concurrent gets are merged into multi-key `gets` lines. Their tasks run on
/// the runtime that first used them; used from another runtime after that one shut down (a
/// `#[tokio::test]` per test), the cache reconnects on the current one. Dropping any future of an
/// `AsyncCache` is safe: it never desynchronises a connection or loses another task's reply. A
/// write already handed to a connection may still be applied.
#[derive(Clone)]
pub struct AsyncCache {
    /// The core every view shares, and this view's key maker (its version).
    pub(crate) cache: Cache,
}

impl fmt::Debug for AsyncCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsyncCache")
            .field("cache", &self.cache)
            .field("backend", &self.shared().backend)
            .finish()
    }
}

impl Cache {
    /// This cache for tokio tasks: an [`AsyncCache`] view of the same cache. A cheap handle (an
    /// `Arc` clone); every view, sync or async, shares the store (the memory backend's entries,
    /// or memcached's servers and their health: a server marked dead through one view is dead
    /// for all), the [`stats`](Cache::stats), the in-process coalescer (a sync and an async
    /// caller of one key elect one loader, except that a sync call made inside a tokio context,
    /// `spawn_blocking` or `block_in_place`, never waits for a task's load: it may load too) and
    /// the keys (this view's version). The async view
    /// does its own I/O: on memcached, the pipelined engine
    /// ([`async_connections`](crate::CacheBuilder::async_connections)) on the caller's runtime,
    /// made at build and connected on first use; the sync view keeps its pool (and its engine's
    /// thread).
    ///
    /// [`AsyncCache::to_sync`] goes back. Named as the Rust API guidelines name a conversion from
    /// a borrow to an owned value (`to_`): both are handles onto one core, as redis-rs gives sync
    /// and async connections from one `Client`.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), newcache::Error> {
    /// use std::time::Duration;
    ///
    /// let cache = newcache::Cache::builder().in_memory().build()?;
    /// let tasks = cache.to_async();
    /// cache.set("greeting", "hello", Duration::from_secs(60))?;
    /// assert_eq!(tasks.get::<String>("greeting").await?.as_deref(), Some("hello"));
    /// assert_eq!(tasks.stats().hits, cache.stats().hits); // one cache, one count
    /// # Ok(())
    /// # }
    /// ```
    pub fn to_async(&self) -> AsyncCache {
        AsyncCache {
            cache: self.clone(),
        }
    }
}

impl AsyncCache {
    /// A cache on `backend` for the async view (a test's async backend over the sync one).
    #[cfg(test)]
    pub(crate) fn new(mut cache: Cache, backend: Arc<dyn AsyncBackend>) -> AsyncCache {
        Arc::get_mut(&mut cache.inner)
            .expect("a cache no other handle shares")
            .async_io
            .backend = backend;
        cache.to_async()
    }

    /// This cache for threads: a [`Cache`] view of the same cache, sharing everything but the
    /// I/O with this one (see [`Cache::to_async`], which comes back). On memcached, the sync
    /// view runs on its own connection pool (and, for concurrent callers, its own engine on a
    /// thread of its own), never on this view's runtime.
    ///
    /// # Calling it from a task
    ///
    /// The sync view blocks its thread: call it from a thread of your own or through
    /// `spawn_blocking`. Called on a runtime's thread anyway, it never waits for an async
    /// task's load of the same key (the task may need that very thread to finish): inside a
    /// runtime's context (a task, `block_in_place`, `spawn_blocking`), a sync call whose key a
    /// task of this process is loading goes on as a caller in another process that never
    /// waits: it claims the key itself if the task has not yet (the task then waits for its
    /// value), or runs its own loader and stores nothing (the task's load stores). On a thread
    /// of its own, it waits for the task's load as for any caller's.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    ///
    /// let cache = newcache::Cache::builder().in_memory().build_async()?;
    /// cache.set("k", &1u32, Duration::from_secs(60)).await?;
    /// let sync = cache.to_sync();
    /// let v = tokio::task::spawn_blocking(move || sync.get::<u32>("k")).await??;
    /// assert_eq!(v, Some(1));
    /// # Ok(())
    /// # }
    /// ```
    pub fn to_sync(&self) -> Cache {
        self.cache.clone()
    }

    /// The async I/O every async view of this cache shares.
    pub(crate) fn shared(&self) -> &crate::cache::AsyncIo {
        &self.cache.inner.async_io
    }

    pub(crate) fn io(&self) -> AsyncDriver<'_> {
        AsyncDriver(self)
    }

    /// Reads a value: the async [`Cache::get`].
    ///
    /// `None` when the key is missing, when another caller is loading it, or when this caller is
    /// the one reader that claimed a stale entry (it should recompute the value and
    /// [`set`](AsyncCache::set) it; every other reader keeps getting the stale value meanwhile, at
    /// most until the soft expiry plus the herd timeout). Where an invalidation must not be lost,
    /// prefer [`get_or_set_with`](AsyncCache::get_or_set_with), which stores with `cas`.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), newcache::Error> {
    /// let cache = newcache::Cache::builder().in_memory().build_async()?;
    /// assert_eq!(cache.get::<String>("greeting").await?, None);
    /// cache.set("greeting", "hello", std::time::Duration::from_secs(60)).await?;
    /// assert_eq!(cache.get::<String>("greeting").await?.as_deref(), Some("hello"));
    /// # Ok(())
    /// # }
    /// ```
    /// # Errors
    /// A decode error ([`is_decode`](crate::Error::is_decode)) if the bytes under the key are not a
    /// `T` written by newcache (unless the decode policy is `Miss`); a backend error if the backend
    /// failed and the read failure policy is `Propagate` (by default a failure reads as a miss). An
    /// item of a newer envelope format is a counted miss, never an error.
    ///
    /// # Cancel safety
    /// Cancel-safe: a dropped read changes nothing.
    pub async fn get<T: DeserializeOwned>(&self, key: &str) -> Result<Option<T>> {
        self.cache.get_on(&self.io(), key).await
    }

    /// Reads a value as a shared `Arc<T>`, decoded once: the async
    /// [`Cache::get_arc`](crate::Cache::get_arc). A near hit completes without I/O.
    ///
    /// # Errors
    /// As [`get`](AsyncCache::get).
    ///
    /// # Cancel safety
    /// Cancel-safe: a dropped read changes nothing (and fills no near copy).
    pub async fn get_arc<T: DeserializeOwned + Send + Sync + 'static>(
        &self,
        key: &str,
    ) -> Result<Option<std::sync::Arc<T>>> {
        self.cache.get_arc_on(&self.io(), key).await
    }

    /// Stores a value with the herd protection: the async [`Cache::set`].
    ///
    /// The value is fresh for `ttl`, then stale: the first reader to see it stale recomputes while
    /// the others get the stale value, for up to the herd timeout; after that nobody is served it. A
    /// zero `ttl` deletes the key. A `set` that lands while a loader of this key runs wins: the
    /// load's result is not stored over it.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), newcache::Error> {
    /// let cache = newcache::Cache::builder().in_memory().build_async()?;
    /// cache.set("user:7", &vec![1u32, 2, 3], std::time::Duration::from_secs(60)).await?;
    /// assert_eq!(cache.get::<Vec<u32>>("user:7").await?, Some(vec![1, 2, 3]));
    /// # Ok(())
    /// # }
    /// ```
    /// # Errors
    /// An invalid key ([`is_invalid_key`](crate::Error::is_invalid_key)), a value that cannot be
    /// encoded ([`is_encode`](crate::Error::is_encode)) or is too large for the backend
    /// ([`is_too_large`](crate::Error::is_too_large)); a backend error under the default write
    /// policy (`Propagate`).
    ///
    /// # Cancel safety
    /// Dropping the future is safe, but a write already handed to a connection may still be
    /// applied.
    pub async fn set<T: Serialize + Sync + ?Sized>(
        &self,
        key: &str,
        value: &T,
        ttl: impl Into<Ttl>,
    ) -> Result<()> {
        let ttl = ttl.into();
        self.cache
            .set_on(&self.io(), key, value, ttl, Herd::Protected)
            .await
    }

    /// Stores a value, choosing whether it gets the herd protection: the async
    /// [`Cache::set_with`]. [`Herd::Protected`] is [`set`](AsyncCache::set); [`Herd::Off`] stores it
    /// for exactly `ttl` (no stale window: once expired it is gone, and readers miss together).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), newcache::Error> {
    /// use newcache::Herd;
    ///
    /// let cache = newcache::Cache::builder().in_memory().build_async()?;
    /// cache.set_with("session:1", "token", std::time::Duration::from_secs(600), Herd::Off).await?;
    /// assert_eq!(cache.get::<String>("session:1").await?.as_deref(), Some("token"));
    /// # Ok(())
    /// # }
    /// ```
    /// # Errors
    /// As [`set`](AsyncCache::set).
    ///
    /// # Cancel safety
    /// Dropping the future is safe, but a write already handed to a connection may still be
    /// applied.
    pub async fn set_with<T: Serialize + Sync + ?Sized>(
        &self,
        key: &str,
        value: &T,
        ttl: impl Into<Ttl>,
        herd: Herd,
    ) -> Result<()> {
        let ttl = ttl.into();
        self.cache.set_on(&self.io(), key, value, ttl, herd).await
    }

    /// Stores a value only if the key holds no live value; `true` if it was stored: the async
    /// [`Cache::add`]. A stale value, or the placeholder of a load in progress, does not count as
    /// live: it is replaced through CAS, so two concurrent `add`s still store at most once.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), newcache::Error> {
    /// use std::time::Duration;
    ///
    /// let cache = newcache::Cache::builder().in_memory().build_async()?;
    /// assert!(cache.add("lock:job", "me", Duration::from_secs(30)).await?);
    /// assert!(!cache.add("lock:job", "you", Duration::from_secs(30)).await?, "already there");
    /// assert_eq!(cache.get::<String>("lock:job").await?.as_deref(), Some("me"));
    /// # Ok(())
    /// # }
    /// ```
    /// # Errors
    /// As [`set`](AsyncCache::set).
    ///
    /// # Cancel safety
    /// Dropping the future is safe, but a write already handed to a connection may still be
    /// applied.
    pub async fn add<T: Serialize + Sync + ?Sized>(
        &self,
        key: &str,
        value: &T,
        ttl: impl Into<Ttl>,
    ) -> Result<bool> {
        let ttl = ttl.into();
        self.cache.add_on(&self.io(), key, value, ttl).await
    }

    /// Deletes a key; `true` if something was there: the async [`Cache::delete`]. "Something"
    /// includes the placeholder of a load in progress: the delete removes it, and that load's result
    /// is then not stored.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), newcache::Error> {
    /// let cache = newcache::Cache::builder().in_memory().build_async()?;
    /// cache.set("k", &1u32, std::time::Duration::from_secs(60)).await?;
    /// assert!(cache.delete("k").await?);
    /// assert!(!cache.delete("k").await?, "nothing left");
    /// # Ok(())
    /// # }
    /// ```
    /// # Errors
    /// An invalid key; a backend error under the default write policy (`Propagate`).
    ///
    /// # Cancel safety
    /// Dropping the future is safe, but a write already handed to a connection may still be
    /// applied.
    pub async fn delete(&self, key: &str) -> Result<bool> {
        self.cache.delete_on(&self.io(), key).await
    }

    /// Reads several values, one round trip per server: the async [`Cache::get_many`]. The map
    /// holds the keys that were found (by the caller's key names); a missing key, one being loaded,
    /// or the stale key this caller claimed is left out, as [`get`](AsyncCache::get) would answer
    /// `None`.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), newcache::Error> {
    /// use std::time::Duration;
    ///
    /// let cache = newcache::Cache::builder().in_memory().build_async()?;
    /// cache.set("a", &1u32, Duration::from_secs(60)).await?;
    /// cache.set("b", &2u32, Duration::from_secs(60)).await?;
    /// let found = cache.get_many::<u32>(&["a", "b", "c"]).await?;
    /// assert_eq!((found.len(), found["a"], found["b"]), (2, 1, 2));
    /// # Ok(())
    /// # }
    /// ```
    /// # Errors
    /// An invalid key (nothing is read). With the default read policy
    /// ([`FailurePolicy::Absorb`](crate::FailurePolicy)) a key whose server failed is left out
    /// like a miss; with `Propagate` such a batch is an error naming the failed keys
    /// ([`Error::failed_keys`](crate::Error::failed_keys)). A key whose bytes do not decode is
    /// left out and counted in `decode_errors`, whatever the decode policy.
    ///
    /// # Cancel safety
    /// Cancel-safe: a dropped read changes nothing.
    pub async fn get_many<T: DeserializeOwned>(
        &self,
        keys: &[impl AsRef<str> + Sync],
    ) -> Result<HashMap<String, T>> {
        self.cache.get_many_on(&self.io(), keys).await
    }

    /// Stores several values with the herd protection, one round trip per server; returns the
    /// keys that could not be stored: the async [`Cache::set_many`]. Every value gets the expiry
    /// [`set`](AsyncCache::set) would give it.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), newcache::Error> {
    /// let cache = newcache::Cache::builder().in_memory().build_async()?;
    /// let failed = cache
    ///     .set_many([("a", &1u32), ("b", &2u32)], std::time::Duration::from_secs(60))
    ///     .await?;
    /// assert!(failed.is_empty());
    /// assert_eq!(cache.get::<u32>("b").await?, Some(2));
    /// # Ok(())
    /// # }
    /// ```
    /// # Errors
    /// Nothing is written if a key is invalid or a value cannot be encoded. A value too large for
    /// the backend is not stored, and its key is returned. A key whose server failed is returned
    /// too under [`FailurePolicy::Absorb`](crate::FailurePolicy); under the default write policy
    /// (`Propagate`) the batch is an error naming the failed keys
    /// ([`Error::failed_keys`](crate::Error::failed_keys)), the other keys being stored.
    ///
    /// # Cancel safety
    /// Dropping the future is safe, but a write already handed to a connection may still be
    /// applied.
    #[must_use = "set_many returns the keys it could not store"]
    pub async fn set_many<'v, K, T, I>(&self, items: I, ttl: impl Into<Ttl>) -> Result<Vec<String>>
    where
        K: AsRef<str>,
        T: Serialize + ?Sized + 'v,
        I: IntoIterator<Item = (K, &'v T)>,
    {
        let life = ttl.into().resolve(self.cache.inner.config.default_ttl);
        // Every key derived and value encoded before anything is sent (the items are captured
        // by this future, so they must be `Send` for it to be).
        let encoded = self.cache.encode_many(items, life);
        self.cache.set_many_on(&self.io(), encoded?, life).await
    }

    /// Deletes several keys, one round trip per server; returns how many existed: the async
    /// [`Cache::delete_many`].
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), newcache::Error> {
    /// use std::time::Duration;
    ///
    /// let cache = newcache::Cache::builder().in_memory().build_async()?;
    /// cache.set("a", &1u32, Duration::from_secs(60)).await?;
    /// assert_eq!(cache.delete_many(&["a", "never-set"]).await?, 1);
    /// # Ok(())
    /// # }
    /// ```
    /// # Errors
    /// As [`set_many`](AsyncCache::set_many): an invalid key deletes nothing; under the default
    /// write policy a key whose server failed makes the batch an error naming the failed keys (the
    /// other keys were deleted).
    ///
    /// # Cancel safety
    /// Dropping the future is safe, but a write already handed to a connection may still be
    /// applied.
    pub async fn delete_many(&self, keys: &[impl AsRef<str> + Sync]) -> Result<usize> {
        self.cache.delete_many_on(&self.io(), keys).await
    }

    /// Gives an existing value a new lifetime without recomputing it: the async [`Cache::touch`].
    /// It is fresh for `ttl` from now, then stale for the herd timeout, as if `set` had just stored
    /// it; `true` if it re-timed a value. A zero `ttl` deletes the key. `false` when there is nothing
    /// a reader would be served (no key, a value past its staleness bound, a key being loaded).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), newcache::Error> {
    /// use std::time::Duration;
    ///
    /// let cache = newcache::Cache::builder().in_memory().build_async()?;
    /// cache.set("k", &1u32, Duration::from_secs(60)).await?;
    /// assert!(cache.touch("k", Duration::from_secs(3600)).await?);
    /// assert!(!cache.touch("missing", Duration::from_secs(3600)).await?);
    /// # Ok(())
    /// # }
    /// ```
    /// # Errors
    /// An invalid key; a backend error under the default write policy (`Propagate`).
    ///
    /// # Cancel safety
    /// Dropping the future is safe, but a write already handed to a connection may still be
    /// applied.
    pub async fn touch(&self, key: &str, ttl: impl Into<Ttl>) -> Result<bool> {
        let ttl = ttl.into();
        self.cache.touch_on(&self.io(), key, ttl).await
    }

    /// Stores a counter in memcached's plain decimal form (no envelope, no herd padding), so
    /// that [`incr`](AsyncCache::incr) and [`decr`](AsyncCache::decr) work on it: the async
    /// [`Cache::set_counter`].
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), newcache::Error> {
    /// let cache = newcache::Cache::builder().in_memory().build_async()?;
    /// cache.set_counter("hits", 10, std::time::Duration::from_secs(3600)).await?;
    /// assert_eq!(cache.get_counter("hits").await?, Some(10));
    /// # Ok(())
    /// # }
    /// ```
    /// # Errors
    /// An invalid key; a backend error.
    ///
    /// # Cancel safety
    /// Dropping the future is safe, but a write already handed to a connection may still be
    /// applied.
    pub async fn set_counter(&self, key: &str, value: u64, ttl: impl Into<Ttl>) -> Result<()> {
        let ttl = ttl.into();
        self.cache.set_counter_on(&self.io(), key, value, ttl).await
    }

    /// Adds `delta` to a counter and returns the new value (wrapping at 2^64, as memcached does):
    /// the async [`Cache::incr`]. The counter must exist ([`set_counter`](AsyncCache::set_counter)).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), newcache::Error> {
    /// let cache = newcache::Cache::builder().in_memory().build_async()?;
    /// assert!(cache.incr("visits", 1).await.unwrap_err().is_not_found(), "never created implicitly");
    /// cache.set_counter("visits", 0, std::time::Duration::from_secs(3600)).await?;
    /// assert_eq!(cache.incr("visits", 5).await?, 5);
    /// # Ok(())
    /// # }
    /// ```
    /// # Errors
    /// [`is_not_found`](crate::Error::is_not_found) if the counter does not exist;
    /// [`is_not_a_counter`](crate::Error::is_not_a_counter) if the key holds something else; a
    /// backend error.
    ///
    /// # Cancel safety
    /// Dropping the future is safe, but a write already handed to a connection may still be
    /// applied.
    pub async fn incr(&self, key: &str, delta: u64) -> Result<u64> {
        self.cache.arith_on(&self.io(), key, delta, true).await
    }

    /// Adds to a counter, creating it if it is missing: [`Cache::incr_or_create`], awaited.
    ///
    /// # Cancel safety
    /// A future dropped after its `incr` or `add` was written may have incremented or created
    /// the counter without returning the value (as a dropped `incr` may have incremented it).
    pub async fn incr_or_create(&self, key: &str, delta: u64, ttl: impl Into<Ttl>) -> Result<u64> {
        self.cache
            .incr_or_create_on(&self.io(), key, delta, ttl.into())
            .await
    }

    /// Subtracts `delta` from a counter and returns the new value; memcached clamps at zero: the
    /// async [`Cache::decr`].
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), newcache::Error> {
    /// let cache = newcache::Cache::builder().in_memory().build_async()?;
    /// cache.set_counter("stock", 3, std::time::Duration::from_secs(3600)).await?;
    /// assert_eq!(cache.decr("stock", 2).await?, 1);
    /// assert_eq!(cache.decr("stock", 5).await?, 0, "clamped at zero");
    /// # Ok(())
    /// # }
    /// ```
    /// # Errors
    /// As [`incr`](AsyncCache::incr).
    ///
    /// # Cancel safety
    /// Dropping the future is safe, but a write already handed to a connection may still be
    /// applied.
    pub async fn decr(&self, key: &str, delta: u64) -> Result<u64> {
        self.cache.arith_on(&self.io(), key, delta, false).await
    }

    /// Reads a counter; `None` if it does not exist: the async [`Cache::get_counter`].
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), newcache::Error> {
    /// let cache = newcache::Cache::builder().in_memory().build_async()?;
    /// assert_eq!(cache.get_counter("jobs").await?, None);
    /// cache.set_counter("jobs", 2, std::time::Duration::from_secs(3600)).await?;
    /// assert_eq!(cache.get_counter("jobs").await?, Some(2));
    /// # Ok(())
    /// # }
    /// ```
    /// # Errors
    /// [`is_not_a_counter`](crate::Error::is_not_a_counter) if the key holds something that is not
    /// a decimal counter; a backend error, whatever the read policy (a counter's absence is
    /// an answer, not a miss to absorb).
    ///
    /// # Cancel safety
    /// Cancel-safe: a dropped read changes nothing.
    pub async fn get_counter(&self, key: &str) -> Result<Option<u64>> {
        self.cache.get_counter_on(&self.io(), key).await
    }

    /// Removes everything from the backend (memcached's `flush_all` on every server): the async
    /// [`Cache::clear`]. Every version and flavor is affected, and so is every other client of
    /// those servers.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), newcache::Error> {
    /// use std::time::Duration;
    ///
    /// let cache = newcache::Cache::builder().in_memory().build_async()?;
    /// cache.set("a", &1u32, Duration::from_secs(60)).await?;
    /// cache.clear().await?;
    /// assert_eq!(cache.get::<u32>("a").await?, None);
    /// # Ok(())
    /// # }
    /// ```
    /// # Errors
    /// A backend error if a server failed.
    ///
    /// # Cancel safety
    /// Dropping the future is safe, but a write already handed to a connection may still be
    /// applied.
    pub async fn clear(&self) -> Result<()> {
        self.cache.clear_on(&self.io()).await
    }

    /// A view of the same cache (backend, stats) whose keys carry another version: bumping it
    /// makes every key written under the old one unreachable at once ([`Cache::with_version`]).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), newcache::Error> {
    /// use std::time::Duration;
    ///
    /// let cache = newcache::Cache::builder().in_memory().build_async()?;
    /// cache.set("k", &1u32, Duration::from_secs(60)).await?;
    /// let v2 = cache.with_version(2);
    /// assert_eq!(v2.get::<u32>("k").await?, None, "a new version sees none of the old keys");
    /// # Ok(())
    /// # }
    /// ```
    pub fn with_version(&self, version: u64) -> AsyncCache {
        AsyncCache {
            cache: self.cache.with_version(version),
        }
    }

    /// The key as stored in the backend (`{flavor}-{version}-{sha1 hex}` by default):
    /// [`Cache::make_key`].
    ///
    /// ```
    /// let cache = newcache::Cache::builder().in_memory().flavor("prod").build_async()?;
    /// assert_eq!(cache.make_key("foo"), "prod-1-0beec7b5ea3f0fdbc95d0dd47f3c5bc275da8a33");
    /// # Ok::<(), newcache::Error>(())
    /// ```
    pub fn make_key(&self, key: &str) -> String {
        self.cache.make_key(key)
    }

    /// Asks every server whether it answers: [`Cache::ping`], awaited (the servers are asked
    /// at once on the async connections; each answer is bounded by `io_timeout`).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let cache = newcache::Cache::builder().in_memory().build_async()?;
    /// cache.ping().await?;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// A [`PingError`](crate::PingError) listing the servers that did not answer.
    ///
    /// # Cancel safety
    /// Cancel-safe: a dropped ping leaves its `get`s to be answered and discarded.
    pub async fn ping(&self) -> std::result::Result<(), crate::PingError> {
        let span = tracing::debug_span!("newcache", op = "ping", cache = &*self.cache.stats.name);
        // The backend's future is made inside the span too: a backend may do work (or
        // record its server) when it makes it.
        let ping = async { self.shared().backend.ping().await };
        tracing::Instrument::instrument(ping, span).await
    }

    /// A snapshot of what this cache (its clones and versions) did so far: the counters of
    /// [`Cache::stats`], for this cache's calls. A response cache over it counts its pages
    /// apart (`ResponseCacheLayer::stats`).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), newcache::Error> {
    /// use std::time::Duration;
    ///
    /// let cache = newcache::Cache::builder().in_memory().build_async()?;
    /// let v: u32 = cache
    ///     .get_or_set_with("k", Duration::from_secs(60), || async { Ok::<_, std::io::Error>(1) })
    ///     .await?;
    /// assert_eq!(cache.get::<u32>("k").await?, Some(v));
    /// let s = cache.stats();
    /// assert_eq!((s.misses, s.loader_calls, s.hits), (1, 1, 1));
    /// # Ok(())
    /// # }
    /// ```
    pub fn stats(&self) -> Stats {
        // The sync view's backend shares its servers' records with this view's engine.
        self.cache.stats()
    }

    /// Waits until the background refreshes started by
    /// [`get_or_set_with_background`](AsyncCache::get_or_set_with_background) have finished
    /// (stored or failed), then closes the backend's connections. The cache still works
    /// afterwards (it reconnects). Without it, dropping the runtime cancels refreshes still
    /// running: their claims lapse after `lease_ttl`, and the next reader of the key refreshes
    /// it.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), newcache::Error> {
    /// let cache = newcache::Cache::builder().in_memory().build_async()?;
    /// // ... serve, then on a shutdown signal:
    /// cache.shutdown().await;
    /// assert_eq!(cache.get::<u32>("k").await?, None, "still usable");
    /// # Ok(())
    /// # }
    /// ```
    pub async fn shutdown(&self) {
        loop {
            let drained = self.shared().drained.notified();
            tokio::pin!(drained);
            drained.as_mut().enable();
            if self.shared().background.load(Ordering::Acquire) == 0 {
                break;
            }
            drained.await;
        }
        self.shared().backend.shutdown().await;
    }
}

/// The async front end's [`Io`] and [`Driver`](crate::loader::driver::Driver): the cache's async backend, tokio timers, and
/// claims kept alive inside the caller's future.
#[derive(Clone, Copy)]
pub(crate) struct AsyncDriver<'a>(pub(crate) &'a AsyncCache);

impl Io for AsyncDriver<'_> {
    type ClaimGuard = loader::ClaimGuard;
    fn guard_claims(&self, claims: Vec<(String, u64)>) -> loader::ClaimGuard {
        loader::ClaimGuard {
            cache: Some(self.0.clone()),
            claims,
        }
    }
    fn get<'a>(&'a self, key: &'a str) -> impl Future<Output = Result<Option<Item>>> + Send + 'a {
        self.0.shared().backend.get(key)
    }
    fn get_many<'a>(
        &'a self,
        keys: &'a [&'a str],
    ) -> impl Future<Output = Vec<Result<Option<Item>>>> + Send + 'a {
        self.0.shared().backend.get_many(keys)
    }
    fn store<'a>(&'a self, w: Write<'a>) -> impl Future<Output = Result<StoreOutcome>> + Send + 'a {
        self.0.shared().backend.store(w)
    }
    fn store_then_get<'a>(
        &'a self,
        w: Write<'a>,
    ) -> impl Future<Output = Result<(StoreOutcome, Option<Item>)>> + Send + 'a {
        self.0.shared().backend.store_then_get(w)
    }
    fn store_many<'a>(
        &'a self,
        writes: &'a [Write<'a>],
    ) -> impl Future<Output = Vec<Result<StoreOutcome>>> + Send + 'a {
        self.0.shared().backend.store_many(writes)
    }
    fn delete<'a>(&'a self, key: &'a str) -> impl Future<Output = Result<bool>> + Send + 'a {
        self.0.shared().backend.delete(key)
    }
    fn delete_many<'a>(
        &'a self,
        keys: &'a [&'a str],
    ) -> impl Future<Output = Vec<Result<bool>>> + Send + 'a {
        self.0.shared().backend.delete_many(keys)
    }
    fn touch<'a>(
        &'a self,
        key: &'a str,
        exptime: u32,
    ) -> impl Future<Output = Result<bool>> + Send + 'a {
        self.0.shared().backend.touch(key, exptime)
    }
    fn incr<'a>(
        &'a self,
        key: &'a str,
        delta: u64,
    ) -> impl Future<Output = Result<Option<u64>>> + Send + 'a {
        self.0.shared().backend.incr(key, delta)
    }
    fn decr<'a>(
        &'a self,
        key: &'a str,
        delta: u64,
    ) -> impl Future<Output = Result<Option<u64>>> + Send + 'a {
        self.0.shared().backend.decr(key, delta)
    }
    fn clear<'a>(
        &'a self,
        prefix: Option<&'a str>,
    ) -> impl Future<Output = Result<()>> + Send + 'a {
        self.0.shared().backend.clear(prefix)
    }
    fn max_value_size(&self, key: &str) -> usize {
        self.0.shared().backend.max_value_size(key)
    }
    fn sleep<'a>(&'a self, d: std::time::Duration) -> impl Future<Output = ()> + Send + 'a {
        tokio::time::sleep(d)
    }
    fn cooperate(&self) -> impl Future<Output = ()> + Send + '_ {
        // One unit of tokio's budget every `COOPERATE_EVERY` near hits of this thread: a
        // budget check on the multi-thread runtime costs about half a near hit, and a task that
        // only hits still yields within a few thousand of them.
        const COOPERATE_EVERY: u32 = 16;
        thread_local! {
            static HITS: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
        }
        let due = HITS.with(|h| {
            let n = h.get().wrapping_add(1);
            h.set(n);
            n % COOPERATE_EVERY == 0
        });
        async move {
            if due {
                tokio::task::coop::consume_budget().await;
            }
        }
    }
}
