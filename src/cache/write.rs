//! The write path: `set`, `add`, `delete` and their batch forms. Every herd-protected write
//! records its soft expiry and the herd timeout it was written with, and pads memcached's expiry
//! by that timeout before the 30-day rule.

use std::time::Duration;

use crate::backend::Traced;
use serde::Serialize;

use super::io::{Io, ready};
use super::{Cache, Herd};
use crate::backend::{Item, StoreMode, StoreOutcome, Write};
use crate::codec::{Encode, Payload};
use crate::envelope::{self, Header, Kind, Parsed};
use crate::error::{Error, ErrorKind, Result};
use crate::herd::{self, Verdict};
use crate::stats::Counters;
use crate::ttl::{self, Lifetime, Ttl};

impl Cache {
    /// The envelope bytes for a value, and the exptime to store them with.
    pub(crate) fn encode<T: Encode + ?Sized>(
        &self,
        value: &T,
        life: Lifetime,
        herd: Herd,
        load_ms: u32,
    ) -> Result<(Vec<u8>, u32)> {
        let now = self.now_ms();
        let mut buf = Vec::with_capacity(64);
        let format = &self.inner.config.format;
        let (mut header, padding) = match herd {
            Herd::Protected => {
                let herd_ms = if value.serve_stale() {
                    self.inner.config.herd_timeout.as_millis() as u32
                } else {
                    0
                };
                let h = Header::value(ttl::soft_expiry_ms(life, now), now, load_ms, herd_ms);
                (h, self.hard_padding(life))
            }
            Herd::Off => (Header::plain(now), Duration::ZERO),
        };
        header.expires_ms = ttl::hard_expiry_ms(life, padding, now);
        header.codec = format.codec;
        header.write(&mut buf);
        match value.encode_payload(format, &mut buf)? {
            Payload::Coded => {}
            Payload::Compressed => envelope::mark_compressed(&mut buf),
            Payload::Raw => envelope::mark_raw(&mut buf),
        }
        Ok((buf, ttl::exptime(life, padding, now / 1000)))
    }

    /// Refuses an envelope that would leave no room under `max` (the backend's limit for its
    /// key) for what later steps of the protocol add to its header ([`envelope::growth`]): a
    /// value `set` stores can always be claimed and touched.
    pub(crate) fn check_room(&self, bytes: &[u8], max: usize) -> Result<()> {
        let room = envelope::growth(bytes);
        if bytes.len().saturating_add(room) <= max {
            return Ok(());
        }
        Err(Error::new(
            ErrorKind::TooLarge,
            format!(
                "the encoded value is {} bytes; with the {room} bytes a claim or a touch may add \
                 to its header, the backend stores at most {max} under this key",
                bytes.len()
            ),
        ))
    }

    /// How long memcached keeps a herd-protected value past its ttl: the herd timeout, or longer
    /// when `serve_stale_on_error(max_age)` needs the value to exist until it is `max_age` old.
    fn hard_padding(&self, life: Lifetime) -> Duration {
        let herd = self.inner.config.herd_timeout;
        match (life, self.inner.config.stale_on_error) {
            (Lifetime::For(d), Some(max_age)) => herd.max(max_age.saturating_sub(d)),
            _ => herd,
        }
    }

    /// Stores a value with the herd protection.
    ///
    /// The value is fresh for `ttl`, then stale: the first reader to see it stale recomputes while
    /// the others get the stale value, for up to the herd timeout (which memcached's own expiry
    /// includes); after that nobody is served it. A zero `ttl` deletes the key (nothing is
    /// readable afterwards). A `set` that lands while a loader of this key runs wins: the load's
    /// result is not stored over it.
    pub fn set<T: Serialize + ?Sized>(
        &self,
        key: &str,
        value: &T,
        ttl: impl Into<Ttl>,
    ) -> Result<()> {
        self.set_with(key, value, ttl, Herd::Protected)
    }

    /// Stores a value, choosing whether it gets the herd protection.
    pub fn set_with<T: Serialize + ?Sized>(
        &self,
        key: &str,
        value: &T,
        ttl: impl Into<Ttl>,
        herd: Herd,
    ) -> Result<()> {
        ready(self.set_on(&self.blocking(), key, value, ttl.into(), herd))
    }

    pub(crate) async fn set_on<T: Encode + ?Sized, I: Io>(
        &self,
        io: &I,
        key: &str,
        value: &T,
        ttl: Ttl,
        herd: Herd,
    ) -> Result<()> {
        let k = self.keys.make(key)?;
        let span = self.span("set", &k);
        async {
            let life = ttl.resolve(self.inner.config.default_ttl);
            if life == Lifetime::Expired {
                return self.absorb_write(io.delete(&k).await).map(|_| ());
            }
            let (bytes, exptime) = self.encode(value, life, herd, 0)?;
            self.check_room(&bytes, io.max_value_size(&k))?;
            let w = Write {
                mode: StoreMode::Set,
                key: &k,
                value: &bytes,
                flags: envelope::FLAGS,
                exptime,
            };
            self.absorb_write(io.store(w).await).map(|_| ())
        }
        .traced(span)
        .await
    }

    /// Stores a value only if the key holds no live value; `true` if it was stored.
    ///
    /// A stale value (past its soft expiry), or a placeholder of a load in progress, does not
    /// count as live: it is replaced through CAS, so two concurrent `add`s still store at most
    /// once, and the load's result is not stored over the added value.
    pub fn add<T: Serialize + ?Sized>(
        &self,
        key: &str,
        value: &T,
        ttl: impl Into<Ttl>,
    ) -> Result<bool> {
        ready(self.add_on(&self.blocking(), key, value, ttl.into()))
    }

    pub(crate) async fn add_on<T: Serialize + ?Sized, I: Io>(
        &self,
        io: &I,
        key: &str,
        value: &T,
        ttl: Ttl,
    ) -> Result<bool> {
        let k = self.keys.make(key)?;
        let span = self.span("add", &k);
        async {
            let life = ttl.resolve(self.inner.config.default_ttl);
            let k = k.as_str();
            if life == Lifetime::Expired {
                // Like Django: stored and expired at once, if the key was free.
                let Some(item) = io.get(k).await? else {
                    return Ok(true);
                };
                if self.is_live(&item) {
                    return Ok(false);
                }
                let w = Write::new(StoreMode::Cas(item.cas), k, b"", 0, ttl::EXPIRED);
                let outcome = io.store(w).await?;
                return Ok(outcome == StoreOutcome::Stored);
            }
            let (bytes, exptime) = self.encode(value, life, Herd::Protected, 0)?;
            self.check_room(&bytes, io.max_value_size(k))?;
            for _ in 0..3 {
                let w = Write::new(StoreMode::Add, k, &bytes, envelope::FLAGS, exptime);
                if io.store(w).await? == StoreOutcome::Stored {
                    return Ok(true);
                }
                let Some(item) = io.get(k).await? else {
                    continue; // expired or deleted in between: try the add again
                };
                if self.is_live(&item) {
                    return Ok(false);
                }
                let w = Write::new(
                    StoreMode::Cas(item.cas),
                    k,
                    &bytes,
                    envelope::FLAGS,
                    exptime,
                );
                return Ok(io.store(w).await? == StoreOutcome::Stored);
            }
            Ok(false)
        }
        .traced(span)
        .await
    }

    /// Whether an item counts as a live value for `add`: a fresh newcache value, or bytes newcache
    /// does not judge (a plain value, another client's, a newer format's).
    fn is_live(&self, item: &Item) -> bool {
        match envelope::decode(item.flags, &item.value) {
            Ok(Parsed::Item(h, _)) => matches!(
                herd::judge(&h, self.now_ms(), None),
                Verdict::Fresh | Verdict::EarlyRefresh
            ),
            _ => true,
        }
    }

    /// Deletes a key; `true` if something was there.
    ///
    /// "Something" includes the placeholder of a load in progress: the delete removes it, and
    /// that load's result is then not stored (its `cas` finds the key gone).
    pub fn delete(&self, key: &str) -> Result<bool> {
        ready(self.delete_on(&self.blocking(), key))
    }

    pub(crate) async fn delete_on<I: Io>(&self, io: &I, key: &str) -> Result<bool> {
        let k = self.keys.make(key)?;
        let span = self.span("delete", &k);
        async { Ok(self.absorb_write(io.delete(&k).await)?.unwrap_or(false)) }
            .traced(span)
            .await
    }

    /// Stores several values with the herd protection, one round trip per server; returns the
    /// keys that could not be stored, as Django's `set_many` does.
    ///
    /// Every value gets the same soft and hard expiry as [`set`](Cache::set) would give it
    /// (django-newcache's `set_many` forgot the herd padding).
    ///
    /// ```
    /// # let cache = newcache::Cache::builder().build()?;
    /// let failed = cache.set_many([("a", &1u32), ("b", &2u32)], std::time::Duration::from_secs(60))?;
    /// assert!(failed.is_empty());
    /// # Ok::<(), newcache::Error>(())
    /// ```
    ///
    /// # Errors
    /// Nothing is written if a key is invalid or a value cannot be serialized: that is an error.
    /// A value too large for the backend is not stored, and its key is returned. A key whose
    /// server failed is returned too when the write policy is
    /// [`FailurePolicy::Absorb`](crate::FailurePolicy); with the default write policy
    /// (`Propagate`) the batch is an error that names the failed keys
    /// ([`Error::failed_keys`](crate::Error::failed_keys)), the other keys being stored.
    #[must_use = "set_many returns the keys it could not store"]
    pub fn set_many<'v, K, T, I>(&self, items: I, ttl: impl Into<Ttl>) -> Result<Vec<String>>
    where
        K: AsRef<str>,
        T: Serialize + ?Sized + 'v,
        I: IntoIterator<Item = (K, &'v T)>,
    {
        let life = ttl.into().resolve(self.inner.config.default_ttl);
        let encoded = self.encode_many(items, life)?;
        ready(self.set_many_on(&self.blocking(), encoded, life))
    }

    /// Every key derived and every value encoded before anything is sent: the caller's key
    /// names, and the derived keys with their bytes and exptime.
    pub(crate) fn encode_many<'v, K, T, I>(&self, items: I, life: Lifetime) -> Result<Encoded>
    where
        K: AsRef<str>,
        T: Serialize + ?Sized + 'v,
        I: IntoIterator<Item = (K, &'v T)>,
    {
        // Every key derived and every value encoded before anything is sent.
        let mut names = Vec::new();
        let mut encoded: Vec<(String, Vec<u8>)> = Vec::new();
        let mut exptime = 0;
        for (k, v) in items {
            let user_key = k.as_ref();
            let k = self.keys.make(user_key)?;
            names.push(user_key.to_string());
            if life == Lifetime::Expired {
                encoded.push((k, Vec::new()));
                continue;
            }
            let (bytes, e) = self.encode(v, life, Herd::Protected, 0)?;
            exptime = e;
            encoded.push((k, bytes));
        }
        Ok(Encoded {
            names,
            encoded,
            exptime,
        })
    }

    pub(crate) async fn set_many_on<I: Io>(
        &self,
        io: &I,
        batch: Encoded,
        life: Lifetime,
    ) -> Result<Vec<String>> {
        let span = self.batch_span("set_many", batch.names.len());
        async {
            let Encoded {
                names,
                encoded,
                exptime,
            } = batch;
            if encoded.is_empty() {
                return Ok(Vec::new());
            }
            if life == Lifetime::Expired {
                let keys: Vec<&str> = encoded.iter().map(|(k, _)| k.as_str()).collect();
                let done = self.absorb_each(
                    io.delete_many(&keys).await,
                    self.inner.config.write_failures,
                    |i| names[i].clone(),
                )?;
                return Ok(failed_names(&names, &done));
            }
            let mut failed = Vec::new();
            let mut writes = Vec::with_capacity(encoded.len());
            let mut at = Vec::with_capacity(encoded.len());
            for (i, (k, v)) in encoded.iter().enumerate() {
                if self.check_room(v, io.max_value_size(k)).is_err() {
                    Counters::bump(&self.stats.too_large);
                    failed.push(names[i].clone());
                    continue;
                }
                at.push(i);
                writes.push(Write {
                    mode: StoreMode::Set,
                    key: k,
                    value: v,
                    flags: envelope::FLAGS,
                    exptime,
                });
            }
            let results = io.store_many(&writes).await;
            let done = self.absorb_each(results, self.inner.config.write_failures, |j| {
                names[at[j]].clone()
            })?;
            failed.extend(
                at.iter()
                    .zip(&done)
                    .filter(|(_, d)| d.is_none())
                    .map(|(&i, _)| names[i].clone()),
            );
            Ok(failed)
        }
        .traced(span)
        .await
    }

    /// Deletes several keys, one round trip per server; returns how many existed.
    ///
    /// # Errors
    /// As [`set_many`](Cache::set_many): under the default write policy a key whose server failed
    /// makes the batch an error naming the failed keys (the other keys were deleted).
    pub fn delete_many(&self, keys: &[impl AsRef<str>]) -> Result<usize> {
        ready(self.delete_many_on(&self.blocking(), keys))
    }

    pub(crate) async fn delete_many_on<I: Io>(
        &self,
        io: &I,
        keys: &[impl AsRef<str>],
    ) -> Result<usize> {
        let derived = keys
            .iter()
            .map(|k| self.keys.make(k.as_ref()))
            .collect::<Result<Vec<_>>>()?;
        let span = self.batch_span("delete_many", derived.len());
        async {
            let refs: Vec<&str> = derived.iter().map(String::as_str).collect();
            let done = self.absorb_each(
                io.delete_many(&refs).await,
                self.inner.config.write_failures,
                |i| keys[i].as_ref().to_string(),
            )?;
            Ok(done.into_iter().filter(|d| *d == Some(true)).count())
        }
        .traced(span)
        .await
    }

    /// Gives an existing value a new lifetime without recomputing it (Django's `touch`): it is
    /// fresh for `ttl` from now, then stale for the herd timeout, exactly as if `set` had just
    /// stored it. Returns `true` if it re-timed a value. A zero `ttl` deletes the key, as in
    /// Django. `false` when there is nothing a reader would be served: no key, a value past its
    /// staleness bound, a key being loaded (no value yet); and when other writers replaced the
    /// value three times while `touch` tried (theirs stands). A value being recomputed is
    /// touched, and the running load's result is then not stored over it. Counters and values
    /// of other clients get memcached's plain `touch`.
    pub fn touch(&self, key: &str, ttl: impl Into<Ttl>) -> Result<bool> {
        ready(self.touch_on(&self.blocking(), key, ttl.into()))
    }

    pub(crate) async fn touch_on<I: Io>(&self, io: &I, key: &str, ttl: Ttl) -> Result<bool> {
        let k = self.keys.make(key)?;
        let span = self.span("touch", &k);
        async {
            let life = ttl.resolve(self.inner.config.default_ttl);
            if life == Lifetime::Expired {
                return Ok(self.absorb_write(io.delete(&k).await)?.unwrap_or(false));
            }
            // A read, then a `cas` of the re-timed envelope; another writer in between wins, and
            // the touch is retried on what it wrote.
            for _ in 0..3 {
                let Some(item) = self.absorb_write(io.get(&k).await)?.flatten() else {
                    return Ok(false);
                };
                let now = self.now_ms();
                let header = match envelope::decode(item.flags, &item.value) {
                    Ok(Parsed::Item(h, _)) => h,
                    // Not an envelope this build writes: memcached's own touch.
                    _ => {
                        let exptime = ttl::exptime(life, Duration::ZERO, now / 1000);
                        return Ok(self
                            .absorb_write(io.touch(&k, exptime).await)?
                            .unwrap_or(false));
                    }
                };
                // Only what a reader would serve is touched: a value past its staleness bound is
                // gone for readers (Django's touch of an expired key is false), and a key being
                // loaded has no value yet.
                if !herd::servable(herd::judge(&header, now, None)) {
                    return Ok(false);
                }
                let padding = match header.kind {
                    Kind::Placeholder => return Ok(false),
                    Kind::Plain => Duration::ZERO,
                    Kind::Value => self.hard_padding(life),
                };
                let soft = match header.kind {
                    Kind::Value => ttl::soft_expiry_ms(life, now),
                    _ => 0,
                };
                let expires = ttl::hard_expiry_ms(life, padding, now);
                let Some(bytes) = envelope::retime(&item.value, soft, expires) else {
                    return Ok(false);
                };
                let exptime = ttl::exptime(life, padding, now / 1000);
                let stored = io
                    .store(Write {
                        mode: StoreMode::Cas(item.cas),
                        key: &k,
                        value: &bytes,
                        flags: envelope::FLAGS,
                        exptime,
                    })
                    .await;
                if matches!(&stored, Err(e) if e.is_too_large()) {
                    // An item another build wrote at the size limit has no room for the
                    // re-timed header: memcached's own touch gives it the new hard expiry (its
                    // soft expiry stays; when it goes, the key is a herd-protected miss).
                    return Ok(self
                        .absorb_write(io.touch(&k, exptime).await)?
                        .unwrap_or(false));
                }
                match self.absorb_write(stored)? {
                    Some(StoreOutcome::Stored) => return Ok(true),
                    Some(StoreOutcome::NotFound) | None => return Ok(false),
                    Some(_) => continue,
                }
            }
            // Other writers replaced the value three times in a row: theirs stands, with the
            // lifetime they gave it.
            Ok(false)
        }
        .traced(span)
        .await
    }

    /// Removes everything from the backend (memcached's `flush_all` on every server), as
    /// Django's and django-newcache's `clear` do; every version and flavor is affected. With a
    /// [`near_cache`](crate::CacheBuilder::near_cache), every near copy of every cache over the
    /// same servers in this process stops being served before anything is sent.
    ///
    /// On Redis (feature `redis`), only this cache's keys go (those starting with its
    /// `{flavor}-{version}-`), never the whole database: `SCAN` over every key of the database
    /// with that pattern, in steps of 1,000, and `UNLINK` (freed in the background) of those it
    /// finds; the cost grows with the database's size, not the cache's. A cache with a custom
    /// [`key_function`](crate::CacheBuilder::key_function) has no known prefix there: its
    /// `clear` is an [`is_unsupported`](crate::Error::is_unsupported) error.
    pub fn clear(&self) -> Result<()> {
        ready(self.clear_on(&self.blocking()))
    }

    pub(crate) async fn clear_on<I: Io>(&self, io: &I) -> Result<()> {
        let span = tracing::debug_span!("newcache", op = "clear", cache = &*self.stats.name);
        let prefix = self.keys.prefix();
        async {
            let r = io.clear(prefix.as_deref()).await;
            // Unservable already (the clear bumped the near tiers' flush count); their memory
            // goes too.
            if let Some(near) = &self.inner.near {
                near.clear();
            }
            r
        }
        .traced(span)
        .await
    }
}

/// A `set_many` batch, encoded whole before anything is sent.
pub(crate) struct Encoded {
    /// The caller's keys, in order.
    names: Vec<String>,
    /// Derived keys and their bytes (empty for a batch of deletes).
    encoded: Vec<(String, Vec<u8>)>,
    exptime: u32,
}

/// The names of the keys whose per-key result is absent (failed and absorbed).
fn failed_names<T>(names: &[String], done: &[Option<T>]) -> Vec<String> {
    names
        .iter()
        .zip(done)
        .filter(|(_, d)| d.is_none())
        .map(|(n, _)| n.clone())
        .collect()
}
