//! Counters: memcached's own decimal items (no envelope, no herd padding), so that `incr` and
//! `decr` run on the server.

use std::time::Duration;

use crate::backend::Traced;

use super::Cache;
use super::io::{Io, ready};
use crate::backend::{StoreMode, StoreOutcome, Write, parse_counter};
use crate::envelope;
use crate::error::{Error, ErrorKind, Result};
use crate::ttl::{self, Lifetime, Ttl};

/// Rounds of `incr` → `NOT_FOUND` → `add` → `NOT_STORED` before `incr_or_create` gives up.
const CREATE_ROUNDS: usize = 3;

impl Cache {
    /// Stores a counter in memcached's plain decimal form (no envelope, no herd padding), so that
    /// [`incr`](Cache::incr) and [`decr`](Cache::decr) work on it.
    pub fn set_counter(&self, key: &str, value: u64, ttl: impl Into<Ttl>) -> Result<()> {
        ready(self.set_counter_on(&self.blocking(), key, value, ttl.into()))
    }

    pub(crate) async fn set_counter_on<I: Io>(
        &self,
        io: &I,
        key: &str,
        value: u64,
        ttl: Ttl,
    ) -> Result<()> {
        let k = self.keys.make(key)?;
        let span = self.span("set_counter", &k);
        async {
            let life = ttl.resolve(self.inner.config.default_ttl);
            if life == Lifetime::Expired {
                return io.delete(&k).await.map(|_| ());
            }
            let exptime = ttl::exptime(life, Duration::ZERO, self.now_ms() / 1000);
            let digits = value.to_string();
            io.store(Write {
                mode: StoreMode::Set,
                key: &k,
                value: digits.as_bytes(),
                flags: envelope::COUNTER_FLAGS,
                exptime,
            })
            .await
            .map(|_| ())
        }
        .traced(span)
        .await
    }

    /// Adds `delta` to a counter and returns the new value (wrapping at 2^64, as memcached does).
    ///
    /// # Errors
    /// `is_not_found()` if the counter does not exist (it is never created implicitly: see
    /// [`incr_or_create`](Cache::incr_or_create));
    /// `is_not_a_counter()` if the key holds something else.
    pub fn incr(&self, key: &str, delta: u64) -> Result<u64> {
        ready(self.arith_on(&self.blocking(), key, delta, true))
    }

    /// `incr` (or `decr`) on any [`Io`].
    pub(crate) async fn arith_on<I: Io>(
        &self,
        io: &I,
        key: &str,
        delta: u64,
        incr: bool,
    ) -> Result<u64> {
        let k = self.keys.make(key)?;
        let span = self.span(if incr { "incr" } else { "decr" }, &k);
        async {
            let r = if incr {
                io.incr(&k, delta).await
            } else {
                io.decr(&k, delta).await
            };
            r?.ok_or_else(|| not_found(key))
        }
        .traced(span)
        .await
    }

    /// Adds `delta` to a counter, creating it if it is missing, and returns the new value: one
    /// call for a counter that may not exist yet (or was lost in a memcached restart).
    ///
    /// - **Missing**: created holding `delta`, to expire after `ttl` (a counter is never padded
    ///   by the herd timeout).
    /// - **Present**: incremented as by [`incr`](Cache::incr) (wrapping at 2^64), its expiry
    ///   unchanged: `ttl` applies at creation only, so a window counter (`ttl` = the window)
    ///   is not kept alive by its own increments.
    ///
    /// Built from memcached's own commands, so that it works on every backend (twemproxy
    /// included) and concurrent callers of every process add up exactly: `incr`; on
    /// `NOT_FOUND`, `add` of `delta`; on `NOT_STORED` (another caller created it first), `incr`
    /// again. A zero ttl (or [`Ttl::Default`] with a zero default) creates nothing: a
    /// missing counter is not stored, and `delta` is returned.
    ///
    /// ```
    /// # let cache = newcache::Cache::builder().build()?;
    /// use std::time::Duration;
    /// assert_eq!(cache.incr_or_create("logins", 1, Duration::from_secs(60))?, 1);
    /// assert_eq!(cache.incr_or_create("logins", 1, Duration::from_secs(60))?, 2);
    /// assert_eq!(cache.get_counter("logins")?, Some(2));
    /// # Ok::<(), newcache::Error>(())
    /// ```
    ///
    /// # Errors
    /// `is_not_a_counter()` if the key holds something else (it is left as it is);
    /// `is_not_found()` only if the counter vanished between each of 3 rounds of `incr` and
    /// `add` (another client deleting it as fast as it is created); a backend error as for
    /// [`incr`](Cache::incr).
    pub fn incr_or_create(&self, key: &str, delta: u64, ttl: impl Into<Ttl>) -> Result<u64> {
        ready(self.incr_or_create_on(&self.blocking(), key, delta, ttl.into()))
    }

    pub(crate) async fn incr_or_create_on<I: Io>(
        &self,
        io: &I,
        key: &str,
        delta: u64,
        ttl: Ttl,
    ) -> Result<u64> {
        let k = self.keys.make(key)?;
        let span = self.span("incr_or_create", &k);
        async {
            let life = ttl.resolve(self.inner.config.default_ttl);
            let digits = delta.to_string();
            for _ in 0..CREATE_ROUNDS {
                if let Some(v) = io.incr(&k, delta).await? {
                    return Ok(v);
                }
                if life == Lifetime::Expired {
                    return Ok(delta);
                }
                let exptime = ttl::exptime(life, Duration::ZERO, self.now_ms() / 1000);
                let w = Write {
                    mode: StoreMode::Add,
                    key: &k,
                    value: digits.as_bytes(),
                    flags: envelope::COUNTER_FLAGS,
                    exptime,
                };
                if io.store(w).await? == StoreOutcome::Stored {
                    return Ok(delta);
                }
                // NOT_STORED: another caller created it between our incr and add.
            }
            Err(Error::new(
                ErrorKind::NotFound,
                format!(
                    "no counter under {key:?} after {CREATE_ROUNDS} rounds of incr and add \
                     (another client deletes it as fast as it is created?)"
                ),
            ))
        }
        .traced(span)
        .await
    }

    /// Subtracts `delta` from a counter and returns the new value; memcached clamps at zero.
    ///
    /// # Errors
    /// As [`incr`](Cache::incr).
    pub fn decr(&self, key: &str, delta: u64) -> Result<u64> {
        ready(self.arith_on(&self.blocking(), key, delta, false))
    }

    /// Reads a counter; `None` if it does not exist.
    ///
    /// # Errors
    /// `is_not_a_counter()` if the key holds something that is not a decimal counter.
    pub fn get_counter(&self, key: &str) -> Result<Option<u64>> {
        ready(self.get_counter_on(&self.blocking(), key))
    }

    pub(crate) async fn get_counter_on<I: Io>(&self, io: &I, key: &str) -> Result<Option<u64>> {
        let k = self.keys.make(key)?;
        let span = self.span("get_counter", &k);
        async {
            match io.get(&k).await? {
                None => Ok(None),
                Some(item) => parse_counter(&item.value).map(Some).ok_or_else(|| {
                    Error::new(
                        ErrorKind::NotACounter,
                        format!("the value under {key:?} is not a decimal counter"),
                    )
                }),
            }
        }
        .traced(span)
        .await
    }
}

fn not_found(key: &str) -> Error {
    Error::new(ErrorKind::NotFound, format!("no counter under {key:?}"))
}
