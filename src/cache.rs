//! The typed facade: `Cache` turns user keys and serde values into derived keys and envelopes, and
//! applies the herd protection (stale entries are claimed by exactly one reader through CAS).

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::backend::memory::parse_counter;
use crate::backend::{Backend, Item, StoreMode, StoreOutcome};
use crate::builder::CacheBuilder;
use crate::clock::Clock;
use crate::coalesce::Coalescer;
use crate::codec;
use crate::envelope::{self, Header};
use crate::error::{Error, ErrorKind, Result};
use crate::herd::{self, Rng, Verdict, Xfetch};
use crate::key::KeyMaker;
use crate::loader::Tokens;
use crate::stats::{Counters, Stats};
use crate::ttl::{self, Lifetime, Ttl};

/// Whether a write gets the herd protection (django-newcache's `herd=` argument).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Herd {
    /// Soft expiry at the ttl, hard expiry at ttl + herd timeout; one reader recomputes (default).
    #[default]
    Protected,
    /// No envelope expiry, no padding: the value simply disappears at the ttl, like a plain
    /// memcached `set` (newcache's `herd=False`).
    Off,
}

/// What to do when the backend fails (I/O error, timeout, dead server).
///
/// The read policy covers `get`, `get_many` and the reads of the loader family; the write policy
/// covers `set`, `set_with`, `set_many`, `delete` and `delete_many`. `add`, the counters and
/// `clear` always return backend errors: their answers mean something, and a guess would not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum FailurePolicy {
    /// Return the error to the caller (default for writes).
    Propagate,
    /// Count it in [`Stats::backend_errors_absorbed`] and carry on: a failed read is a miss, a
    /// failed write is skipped (default for reads: a cache that is down should slow a web app
    /// down to its database's speed, not take it down).
    #[default]
    Absorb,
}

/// What to do with bytes under a key that are not a newcache value of the requested type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum DecodePolicy {
    /// Return a decode error (`Error::is_decode`), leaving the bytes in place (default).
    #[default]
    Error,
    /// Count it in [`Stats::decode_errors`] and report a miss, so the caller recomputes and
    /// overwrites the key.
    Miss,
}

pub(crate) struct Inner {
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) default_ttl: Duration,
    pub(crate) herd_timeout: Duration,
    pub(crate) read_failures: FailurePolicy,
    pub(crate) write_failures: FailurePolicy,
    pub(crate) decode_policy: DecodePolicy,
    pub(crate) stats: Counters,
    pub(crate) coalescer: Coalescer,
    pub(crate) lease_ttl: Duration,
    pub(crate) max_wait: Duration,
    pub(crate) early_beta: Option<f64>,
    pub(crate) stale_on_error: Option<Duration>,
    pub(crate) rng: Rng,
    pub(crate) tokens: Tokens,
}

/// A typed, herd-safe cache.
///
/// A cheap handle: cloning it clones an `Arc`, and every clone shares the backend, its connection
/// pools and the stats. Build one per application with [`Cache::builder`] and hand clones to every
/// thread. `Cache` is `Send + Sync`.
///
/// ```
/// use std::time::Duration;
/// use newcache::{Cache, Ttl};
///
/// let cache = Cache::builder().in_memory().flavor("prod").build()?;
/// cache.set("greeting", "hello", Ttl::Default)?;
/// assert_eq!(cache.get::<String>("greeting")?.as_deref(), Some("hello"));
/// assert_eq!(cache.make_key("foo"), "prod-1-0beec7b5ea3f0fdbc95d0dd47f3c5bc275da8a33");
/// # Ok::<(), newcache::Error>(())
/// ```
#[derive(Clone)]
pub struct Cache {
    pub(crate) inner: Arc<Inner>,
    pub(crate) keys: KeyMaker,
}

impl fmt::Debug for Cache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cache")
            .field("keys", &self.keys)
            .field("backend", &self.inner.backend)
            .field("default_ttl", &self.inner.default_ttl)
            .field("herd_timeout", &self.inner.herd_timeout)
            .finish_non_exhaustive()
    }
}

/// What reading one item amounted to.
pub(crate) enum Read<T> {
    /// A fresh value.
    Fresh(T),
    /// A stale value (someone else is recomputing it).
    Stale(T),
    /// This reader claimed the entry and should recompute it. `stale` is the value it held (if it
    /// decoded), `written_ms` when that value was computed, `early` whether the claim was an
    /// XFetch early refresh of a still-fresh value.
    Claimed {
        stale: Option<T>,
        written_ms: u64,
        early: bool,
    },
    /// Nothing usable.
    Miss,
}

impl Cache {
    /// Starts configuring a cache; see [`CacheBuilder`] for the settings and their defaults.
    pub fn builder() -> CacheBuilder {
        CacheBuilder::default()
    }

    /// The memcached key a user key maps to: `{flavor}-{version}-{sha1 hex}` by default.
    pub fn make_key(&self, key: &str) -> String {
        self.keys.make_unchecked(key)
    }

    /// A cache on the same backend (and stats) whose keys use another version. Bumping the
    /// version makes every key written under the old one unreachable.
    pub fn with_version(&self, version: u64) -> Cache {
        let mut keys = self.keys.clone();
        keys.version = version;
        Cache {
            inner: self.inner.clone(),
            keys,
        }
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> Stats {
        self.inner.stats.snapshot()
    }

    pub(crate) fn now_ms(&self) -> u64 {
        self.inner.clock.now_ms()
    }

    // ----- reads ---------------------------------------------------------------------------

    /// Reads a value.
    ///
    /// `None` when the key is missing, or when this caller is the one reader that claimed a
    /// stale entry: it should recompute the value and [`set`](Cache::set) it, while every other
    /// reader keeps getting the stale value until then (or until the herd timeout passes).
    ///
    /// # Errors
    /// A decode error if the bytes under the key are not a `T` written by newcache (unless the
    /// decode policy is `Miss`); a backend error if the backend failed and the read failure
    /// policy is `Propagate`.
    pub fn get<T: DeserializeOwned>(&self, key: &str) -> Result<Option<T>> {
        Ok(match self.read::<T>(key, None)? {
            Read::Fresh(v) | Read::Stale(v) => Some(v),
            Read::Claimed { .. } | Read::Miss => None,
        })
    }

    /// Reads one item and applies the herd decision; `xfetch` enables early refresh.
    pub(crate) fn read<T: DeserializeOwned>(
        &self,
        key: &str,
        xfetch: Option<Xfetch>,
    ) -> Result<Read<T>> {
        let k = self.keys.make(key)?;
        let item = self.absorb_read(self.inner.backend.get(&k))?.flatten();
        match item {
            None => {
                Counters::bump(&self.inner.stats.misses);
                Ok(Read::Miss)
            }
            Some(item) => self.judge_item(&k, item, xfetch, self.now_ms()),
        }
    }

    /// The herd decision for one item read under derived key `k`.
    fn judge_item<T: DeserializeOwned>(
        &self,
        k: &str,
        item: Item,
        xfetch: Option<Xfetch>,
        now: u64,
    ) -> Result<Read<T>> {
        let s = &self.inner.stats;
        let (header, payload) = match envelope::decode(item.flags, &item.value) {
            Ok(x) => x,
            Err(e) => return self.decode_failed(e),
        };
        let verdict = herd::judge(&header, now, xfetch);
        let decoded = codec::decode::<T>(payload);
        let (soft_expiry_ms, written_ms) = match header {
            Header::Herd {
                soft_expiry_ms,
                written_ms,
                ..
            } => (soft_expiry_ms, written_ms),
            Header::Plain => (0, 0),
        };
        if matches!(verdict, Verdict::Stale | Verdict::EarlyRefresh)
            && self.claim(k, &item, soft_expiry_ms, now)?
        {
            let early = verdict == Verdict::EarlyRefresh;
            Counters::bump(&s.claims_won);
            Counters::bump(if early { &s.early_refreshes } else { &s.misses });
            return Ok(Read::Claimed {
                stale: decoded.ok(),
                written_ms,
                early,
            });
        }
        let v = match decoded {
            Ok(v) => v,
            Err(e) => return self.decode_failed(e),
        };
        Ok(match verdict {
            Verdict::Fresh | Verdict::EarlyRefresh => {
                Counters::bump(&s.hits);
                Read::Fresh(v)
            }
            Verdict::Stale | Verdict::Recomputing => {
                Counters::bump(&s.stale_served);
                Read::Stale(v)
            }
        })
    }

    /// Claims a stale (or early-refresh) entry: re-stores it, still enveloped and marked claimed
    /// until now + herd timeout, with CAS against the version just read. Exactly one reader of that
    /// version wins; if the entry changed meanwhile (another claim, a fresh `set`), the claim fails
    /// and nothing is written.
    fn claim(&self, k: &str, item: &Item, soft_expiry_ms: u64, now: u64) -> Result<bool> {
        let herd = self.inner.herd_timeout;
        let deadline = now.saturating_add(herd.as_millis() as u64);
        let Some(bytes) = envelope::restamp(&item.value, deadline) else {
            return Ok(false);
        };
        // memcached keeps it a herd timeout past whichever comes last, the claim's deadline or the
        // soft expiry (an early claim must not cut a fresh value's life short).
        let until = deadline.max(soft_expiry_ms);
        let life = Lifetime::For(Duration::from_millis(until.saturating_sub(now)));
        let exptime = ttl::exptime(life, herd, now / 1000);
        let outcome =
            self.inner
                .backend
                .store(StoreMode::Cas(item.cas), k, &bytes, item.flags, exptime);
        // A claim that failed to reach the backend is not a claim: serve the stale value.
        Ok(self.absorb_read(outcome)? == Some(StoreOutcome::Stored))
    }

    fn decode_failed<T>(&self, e: Error) -> Result<Read<T>> {
        Counters::bump(&self.inner.stats.decode_errors);
        match self.inner.decode_policy {
            DecodePolicy::Error => Err(e),
            DecodePolicy::Miss => {
                Counters::bump(&self.inner.stats.misses);
                Ok(Read::Miss)
            }
        }
    }

    /// Applies the read failure policy: `Ok(None)` for an absorbed backend error.
    pub(crate) fn absorb_read<T>(&self, r: Result<T>) -> Result<Option<T>> {
        self.absorb(r, self.inner.read_failures)
    }

    fn absorb_write<T>(&self, r: Result<T>) -> Result<Option<T>> {
        self.absorb(r, self.inner.write_failures)
    }

    fn absorb<T>(&self, r: Result<T>, policy: FailurePolicy) -> Result<Option<T>> {
        match r {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.is_backend() => {
                Counters::bump(&self.inner.stats.backend_errors);
                if policy == FailurePolicy::Absorb {
                    Counters::bump(&self.inner.stats.backend_errors_absorbed);
                    Ok(None)
                } else {
                    Err(e)
                }
            }
            Err(e) => Err(e),
        }
    }

    /// Reads several values in one round trip per server.
    ///
    /// The map is keyed by the caller's keys. Missing keys are left out, and so are stale keys
    /// that this caller claimed (exactly as [`get`](Cache::get) reports them as `None`): the
    /// caller recomputes what is absent.
    pub fn get_many<T: DeserializeOwned, K: AsRef<str>>(
        &self,
        keys: &[K],
    ) -> Result<HashMap<String, T>> {
        let mut out = HashMap::with_capacity(keys.len());
        for (user_key, read) in self.read_many::<T, K>(keys, None)? {
            if let Read::Fresh(v) | Read::Stale(v) = read {
                out.insert(user_key, v);
            }
        }
        Ok(out)
    }

    /// Reads several items and applies the herd decision to each; missing keys come back as
    /// `Read::Miss`, in the caller's order (a key asked for twice comes back twice).
    pub(crate) fn read_many<T: DeserializeOwned, K: AsRef<str>>(
        &self,
        keys: &[K],
        xfetch: Option<&dyn Fn() -> Xfetch>,
    ) -> Result<Vec<(String, Read<T>)>> {
        // Every derived key in one buffer: one allocation per batch, not one per key.
        let mut buf = String::with_capacity(keys.len() * (self.keys.flavor.len() + 48));
        let mut ends = Vec::with_capacity(keys.len());
        for k in keys {
            self.keys.make_into(k.as_ref(), &mut buf)?;
            ends.push(buf.len());
        }
        let dkeys: Vec<&str> = ends
            .iter()
            .scan(0, |start, &end| {
                let k = &buf[*start..end];
                *start = end;
                Some(k)
            })
            .collect();
        let items = match self.absorb_read(self.inner.backend.get_many(&dkeys))? {
            Some(items) => items,
            None => vec![None; dkeys.len()],
        };
        // One clock read for the batch; keys claimed so far, so that a key asked for twice is
        // claimed once and reported claimed both times (rare: a short linear list).
        let now = self.now_ms();
        let mut claimed: Vec<&str> = Vec::new();
        let mut out = Vec::with_capacity(items.len());
        for ((d, user_key), item) in dkeys.iter().zip(keys).zip(items) {
            let read = match item {
                None => {
                    Counters::bump(&self.inner.stats.misses);
                    Read::Miss
                }
                Some(_) if claimed.contains(d) => Read::Claimed {
                    stale: None,
                    written_ms: 0,
                    early: false,
                },
                Some(item) => {
                    let read = self.judge_item(d, item, xfetch.map(|f| f()), now)?;
                    if matches!(read, Read::Claimed { .. }) {
                        claimed.push(d);
                    }
                    read
                }
            };
            out.push((user_key.as_ref().to_string(), read));
        }
        Ok(out)
    }

    // ----- writes --------------------------------------------------------------------------

    /// The envelope bytes for a value, and the exptime to store them with.
    pub(crate) fn encode<T: Serialize + ?Sized>(
        &self,
        value: &T,
        life: Lifetime,
        herd: Herd,
        load_ms: u32,
    ) -> Result<(Vec<u8>, u32)> {
        let now = self.now_ms();
        let mut buf = Vec::with_capacity(64);
        let padding = match herd {
            Herd::Protected => {
                envelope::herd_header(&mut buf, ttl::soft_expiry_ms(life, now), now, load_ms);
                self.inner.herd_timeout
            }
            Herd::Off => {
                envelope::plain_header(&mut buf);
                Duration::ZERO
            }
        };
        codec::encode_into(value, &mut buf)?;
        Ok((buf, ttl::exptime(life, padding, now / 1000)))
    }

    /// Stores a value with the herd protection.
    ///
    /// The value is fresh for `ttl`, then stale: the first reader to see it stale recomputes while
    /// the others get the stale value, for up to the herd timeout (which memcached's own expiry
    /// includes). A zero `ttl` deletes the key (nothing is readable afterwards).
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
        self.set_loaded(key, value, ttl.into(), herd, 0)
    }

    /// `set` that records how long the value took to compute (XFetch's delta).
    pub(crate) fn set_loaded<T: Serialize + ?Sized>(
        &self,
        key: &str,
        value: &T,
        ttl: Ttl,
        herd: Herd,
        load_ms: u32,
    ) -> Result<()> {
        let k = self.keys.make(key)?;
        let life = ttl.resolve(self.inner.default_ttl);
        if life == Lifetime::Expired {
            return self.absorb_write(self.inner.backend.delete(&k)).map(|_| ());
        }
        let (bytes, exptime) = self.encode(value, life, herd, load_ms)?;
        self.absorb_write(self.inner.backend.store(
            StoreMode::Set,
            &k,
            &bytes,
            envelope::FLAGS,
            exptime,
        ))
        .map(|_| ())
    }

    /// Stores a value only if the key holds no live value; `true` if it was stored.
    ///
    /// A stale value (past its soft expiry) does not count as live: it is replaced, through CAS,
    /// so two concurrent `add`s still store at most once.
    pub fn add<T: Serialize + ?Sized>(
        &self,
        key: &str,
        value: &T,
        ttl: impl Into<Ttl>,
    ) -> Result<bool> {
        let k = self.keys.make(key)?;
        let life = ttl.into().resolve(self.inner.default_ttl);
        let b = &self.inner.backend;
        if life == Lifetime::Expired {
            // Like Django: stored and expired at once, if the key was free.
            let free = !self.holds_live(&k)?;
            if free {
                b.delete(&k)?;
            }
            return Ok(free);
        }
        let (bytes, exptime) = self.encode(value, life, Herd::Protected, 0)?;
        for _ in 0..3 {
            if b.store(StoreMode::Add, &k, &bytes, envelope::FLAGS, exptime)?
                == StoreOutcome::Stored
            {
                return Ok(true);
            }
            let Some(item) = b.get(&k)? else {
                continue; // expired or deleted in between: try the add again
            };
            if self.is_live(&item) {
                return Ok(false);
            }
            return Ok(b.store(
                StoreMode::Cas(item.cas),
                &k,
                &bytes,
                envelope::FLAGS,
                exptime,
            )? == StoreOutcome::Stored);
        }
        Ok(false)
    }

    fn is_live(&self, item: &Item) -> bool {
        match envelope::decode(item.flags, &item.value) {
            Ok((h @ Header::Herd { .. }, _)) => {
                herd::judge(&h, self.now_ms(), None) == Verdict::Fresh
            }
            // Plain values and foreign bytes are live until memcached expires them.
            _ => true,
        }
    }

    fn holds_live(&self, k: &str) -> Result<bool> {
        Ok(self.inner.backend.get(k)?.is_some_and(|i| self.is_live(&i)))
    }

    /// Deletes a key; `true` if something was there.
    pub fn delete(&self, key: &str) -> Result<bool> {
        let k = self.keys.make(key)?;
        Ok(self
            .absorb_write(self.inner.backend.delete(&k))?
            .unwrap_or(false))
    }

    /// Stores several values with the herd protection, one round trip per server.
    ///
    /// Every value gets the same soft and hard expiry as [`set`](Cache::set) would give it
    /// (django-newcache's `set_many` forgot the herd padding).
    pub fn set_many<'v, K, T, I>(&self, items: I, ttl: impl Into<Ttl>) -> Result<()>
    where
        K: AsRef<str>,
        T: Serialize + ?Sized + 'v,
        I: IntoIterator<Item = (K, &'v T)>,
    {
        self.set_many_loaded(items, ttl.into(), 0)
    }

    /// `set_many` that records how long the values took to compute (XFetch's delta).
    pub(crate) fn set_many_loaded<'v, K, T, I>(
        &self,
        items: I,
        ttl: Ttl,
        load_ms: u32,
    ) -> Result<()>
    where
        K: AsRef<str>,
        T: Serialize + ?Sized + 'v,
        I: IntoIterator<Item = (K, &'v T)>,
    {
        let life = ttl.resolve(self.inner.default_ttl);
        let mut encoded: Vec<(String, Vec<u8>)> = Vec::new();
        let mut exptime = 0;
        for (k, v) in items {
            let k = self.keys.make(k.as_ref())?;
            if life == Lifetime::Expired {
                encoded.push((k, Vec::new()));
                continue;
            }
            let (bytes, e) = self.encode(v, life, Herd::Protected, load_ms)?;
            exptime = e;
            encoded.push((k, bytes));
        }
        if encoded.is_empty() {
            return Ok(());
        }
        if life == Lifetime::Expired {
            let keys: Vec<&str> = encoded.iter().map(|(k, _)| k.as_str()).collect();
            return self
                .absorb_write(self.inner.backend.delete_many(&keys))
                .map(|_| ());
        }
        let batch: Vec<(&str, &[u8])> = encoded
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_slice()))
            .collect();
        self.absorb_write(
            self.inner
                .backend
                .set_many(&batch, envelope::FLAGS, exptime),
        )
        .map(|_| ())
    }

    /// Deletes several keys, one round trip per server; returns how many existed.
    pub fn delete_many<K: AsRef<str>>(&self, keys: &[K]) -> Result<usize> {
        let derived = keys
            .iter()
            .map(|k| self.keys.make(k.as_ref()))
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&str> = derived.iter().map(String::as_str).collect();
        Ok(self
            .absorb_write(self.inner.backend.delete_many(&refs))?
            .unwrap_or(0))
    }

    /// Removes everything from the backend (memcached's `flush_all` on every server), as
    /// Django's and django-newcache's `clear` do; every version and flavor is affected.
    pub fn clear(&self) -> Result<()> {
        self.inner.backend.flush_all()
    }

    // ----- counters ------------------------------------------------------------------------

    /// Stores a counter in memcached's plain decimal form (no envelope, no herd padding), so that
    /// [`incr`](Cache::incr) and [`decr`](Cache::decr) work on it.
    pub fn set_counter(&self, key: &str, value: u64, ttl: impl Into<Ttl>) -> Result<()> {
        let k = self.keys.make(key)?;
        let life = ttl.into().resolve(self.inner.default_ttl);
        if life == Lifetime::Expired {
            return self.inner.backend.delete(&k).map(|_| ());
        }
        let exptime = ttl::exptime(life, Duration::ZERO, self.now_ms() / 1000);
        self.inner
            .backend
            .store(
                StoreMode::Set,
                &k,
                value.to_string().as_bytes(),
                envelope::COUNTER_FLAGS,
                exptime,
            )
            .map(|_| ())
    }

    /// Adds `delta` to a counter and returns the new value (wrapping at 2^64, as memcached does).
    ///
    /// # Errors
    /// `is_not_found()` if the counter does not exist (it is never created implicitly);
    /// `is_not_a_counter()` if the key holds something else.
    pub fn incr(&self, key: &str, delta: u64) -> Result<u64> {
        let k = self.keys.make(key)?;
        self.inner
            .backend
            .incr(&k, delta)?
            .ok_or_else(|| not_found(key))
    }

    /// Subtracts `delta` from a counter and returns the new value; memcached clamps at zero.
    ///
    /// # Errors
    /// As [`incr`](Cache::incr).
    pub fn decr(&self, key: &str, delta: u64) -> Result<u64> {
        let k = self.keys.make(key)?;
        self.inner
            .backend
            .decr(&k, delta)?
            .ok_or_else(|| not_found(key))
    }

    /// Reads a counter; `None` if it does not exist.
    ///
    /// # Errors
    /// `is_not_a_counter()` if the key holds something that is not a decimal counter.
    pub fn get_counter(&self, key: &str) -> Result<Option<u64>> {
        let k = self.keys.make(key)?;
        match self.inner.backend.get(&k)? {
            None => Ok(None),
            Some(item) => parse_counter(&item.value).map(Some).ok_or_else(|| {
                Error::new(
                    ErrorKind::NotACounter,
                    format!("the value under {key:?} is not a decimal counter"),
                )
            }),
        }
    }
}

fn not_found(key: &str) -> Error {
    Error::new(ErrorKind::NotFound, format!("no counter under {key:?}"))
}
