//! `AsyncCache`: the facade for tokio. Every operation is the sync `Cache`'s own logic (written
//! once, generic over [`Io`](crate::cache::io::Io)) awaited on an async backend: the memory
//! backend, or the pipelined memcached engine (`backend/engine/`). The herd protocol's machine,
//! the keys, the envelope and the stats are the same objects, so a sync `Cache` and an
//! `AsyncCache` over the same servers interoperate.

#[cfg(test)]
mod cancel_tests;
mod lease;
mod loader;

#[cfg(feature = "tower")]
pub(crate) use loader::{Refresh, inline};

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::backend::AsyncBackend;
use crate::cache::{Cache, Herd};
use crate::error::Result;
use crate::stats::Stats;
use crate::ttl::Ttl;

/// A thundering-herd-safe cache for async code (tokio): the same cache as [`Cache`], with
/// `async` methods. Build one with [`CacheBuilder::build_async`](crate::CacheBuilder::build_async).
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
    pub(crate) cache: Cache,
    pub(crate) shared: Arc<Shared>,
}

pub(crate) struct Shared {
    pub(crate) backend: Arc<dyn AsyncBackend>,
    /// Background refreshes running (`get_or_set_with_background`), for `shutdown`.
    pub(crate) background: AtomicUsize,
    pub(crate) drained: tokio::sync::Notify,
}

impl fmt::Debug for AsyncCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsyncCache")
            .field("cache", &self.cache)
            .field("backend", &self.shared.backend)
            .finish()
    }
}

impl AsyncCache {
    pub(crate) fn new(cache: Cache, backend: Arc<dyn AsyncBackend>) -> AsyncCache {
        AsyncCache {
            cache,
            shared: Arc::new(Shared {
                backend,
                background: AtomicUsize::new(0),
                drained: tokio::sync::Notify::new(),
            }),
        }
    }

    pub(crate) fn io(&self) -> loader::AsyncDriver<'_> {
        loader::AsyncDriver(self)
    }

    /// Reads a value: [`Cache::get`], awaited.
    pub async fn get<T: DeserializeOwned>(&self, key: &str) -> Result<Option<T>> {
        self.cache.get_on(&self.io(), key).await
    }

    /// Stores a value with the herd protection: [`Cache::set`], awaited.
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

    /// Stores a value, choosing whether it gets the herd protection: [`Cache::set_with`].
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

    /// Stores a value only if the key holds no live value: [`Cache::add`], awaited.
    pub async fn add<T: Serialize + Sync + ?Sized>(
        &self,
        key: &str,
        value: &T,
        ttl: impl Into<Ttl>,
    ) -> Result<bool> {
        let ttl = ttl.into();
        self.cache.add_on(&self.io(), key, value, ttl).await
    }

    /// Deletes a key; `true` if something was there: [`Cache::delete`], awaited.
    pub async fn delete(&self, key: &str) -> Result<bool> {
        self.cache.delete_on(&self.io(), key).await
    }

    /// Reads several values, one round trip per server: [`Cache::get_many`], awaited.
    pub async fn get_many<T: DeserializeOwned>(
        &self,
        keys: &[impl AsRef<str> + Sync],
    ) -> Result<HashMap<String, T>> {
        self.cache.get_many_on(&self.io(), keys).await
    }

    /// Stores several values, one round trip per server; returns the keys that could not be
    /// stored: [`Cache::set_many`], awaited.
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

    /// Deletes several keys; returns how many existed: [`Cache::delete_many`], awaited.
    pub async fn delete_many(&self, keys: &[impl AsRef<str> + Sync]) -> Result<usize> {
        self.cache.delete_many_on(&self.io(), keys).await
    }

    /// Gives an existing value a new lifetime without recomputing it: [`Cache::touch`].
    pub async fn touch(&self, key: &str, ttl: impl Into<Ttl>) -> Result<bool> {
        let ttl = ttl.into();
        self.cache.touch_on(&self.io(), key, ttl).await
    }

    /// Stores a counter: [`Cache::set_counter`], awaited.
    pub async fn set_counter(&self, key: &str, value: u64, ttl: impl Into<Ttl>) -> Result<()> {
        let ttl = ttl.into();
        self.cache.set_counter_on(&self.io(), key, value, ttl).await
    }

    /// Adds to a counter: [`Cache::incr`], awaited.
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

    /// Subtracts from a counter: [`Cache::decr`], awaited.
    pub async fn decr(&self, key: &str, delta: u64) -> Result<u64> {
        self.cache.arith_on(&self.io(), key, delta, false).await
    }

    /// Reads a counter: [`Cache::get_counter`], awaited.
    pub async fn get_counter(&self, key: &str) -> Result<Option<u64>> {
        self.cache.get_counter_on(&self.io(), key).await
    }

    /// Removes everything from the backend: [`Cache::clear`], awaited.
    pub async fn clear(&self) -> Result<()> {
        self.cache.clear_on(&self.io()).await
    }

    /// A view of the same cache whose keys carry another version (bumping it invalidates
    /// everything at once): [`Cache::with_version`].
    pub fn with_version(&self, version: u64) -> AsyncCache {
        AsyncCache {
            cache: self.cache.with_version(version),
            shared: self.shared.clone(),
        }
    }

    /// The key as stored in the backend: [`Cache::make_key`].
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
        let span = tracing::debug_span!(
            "newcache",
            op = "ping",
            cache = &*self.cache.inner.stats.name
        );
        // The backend's future is made inside the span too: a backend may do work (or
        // record its server) when it makes it.
        let ping = async { self.shared.backend.ping().await };
        tracing::Instrument::instrument(ping, span).await
    }

    /// What this cache (and its clones and versions) did so far: [`Cache::stats`].
    pub fn stats(&self) -> Stats {
        self.cache.stats()
    }

    /// Waits until the background refreshes started by
    /// [`get_or_set_with_background`](AsyncCache::get_or_set_with_background) have finished
    /// (stored or failed), then closes the backend's connections. The cache still works
    /// afterwards (it reconnects). Without it, dropping the runtime cancels refreshes still
    /// running: their claims lapse after `lease_ttl`, and the next reader of the key refreshes
    /// it.
    pub async fn shutdown(&self) {
        loop {
            let drained = self.shared.drained.notified();
            tokio::pin!(drained);
            drained.as_mut().enable();
            if self.shared.background.load(Ordering::Acquire) == 0 {
                break;
            }
            drained.await;
        }
        self.shared.backend.shutdown().await;
    }
}
