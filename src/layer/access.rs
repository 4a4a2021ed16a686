//! What the response cache asks of the [`Cache`] beyond its public calls: a read that never
//! claims, a hit served at once on an in-process store, a replace that loses to any write, an
//! invalidation that detaches its key's in-process call, and the layer's own counters.

use std::sync::Arc;

use crate::backend::{StoreMode, StoreOutcome, Write};
use crate::cache::io::Io;
use crate::cache::{Cache, Herd};
use crate::codec::{Decode, Encode};
use crate::envelope::{self, Kind, Parsed};
use crate::error::Result;
use crate::herd;
use crate::protocol::Mode;
use crate::stats::Counters;
use crate::ttl::{Lifetime, Ttl};

/// Where a value [`Cache::served_now`] found came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Served {
    /// A near copy.
    Near,
    /// The store, fresh.
    Fresh,
    /// The store, stale (while another caller refreshes it).
    Stale,
}

impl Cache {
    /// Whether this cache's store is in this process (the memory backend, a custom one: a cache
    /// that names no server), so that its async view's calls complete when made, or whether it
    /// has a near tier: the response cache then answers a hit without a future.
    pub(crate) fn answers_at_once(&self) -> bool {
        self.inner.config.servers.is_empty() || self.inner.near.is_some()
    }

    /// Reads a value without taking part in the herd protocol: a value any reader may be served
    /// (fresh, or stale within its bound) is returned, and nothing is ever claimed. For readers
    /// that never load (the response cache's HEAD and `Authorization` requests): a claim they
    /// would not complete would hold the key's refresh until it lapsed.
    pub(crate) async fn peek_on<T: Decode, I: Io>(&self, io: &I, key: &str) -> Result<Option<T>> {
        let k = self.keys.make(key)?;
        let Some(item) = self.absorb_read(io.get(&k).await)?.flatten() else {
            return Ok(None);
        };
        let Ok(envelope::Parsed::Item(header, payload)) = envelope::decode(item.flags, &item.value)
        else {
            return Ok(None);
        };
        let unclaimed = envelope::Header {
            claim_until_ms: 0,
            ..header
        };
        if header.kind == envelope::Kind::Placeholder
            || !herd::servable(herd::judge(&unclaimed, self.now_ms(), None))
        {
            return Ok(None);
        }
        match self.decode_payload(&header, &item.value, payload) {
            Ok(v) => Ok(Some(v)),
            Err(e) => self.decode_failed(e),
        }
    }

    /// `get_or_set_with`'s fast path alone, on the sync backend: the value (and whether it is
    /// stale) when it may be served as it is, `None` when the call would go on (a miss, a claim
    /// to make or wait for, an error), having changed nothing and counted nothing: a caller that
    /// serves it counts it ([`count_served`](Cache::count_served)); one that does not goes the
    /// whole way, which reads and counts again. For a front end whose backend answers at once
    /// (the response cache on the memory backend). With the value, the wall clock the verdict
    /// was made at (unix ms).
    ///
    /// Always `None` with XFetch on (`early_refresh`): its draw decides whether this read
    /// refreshes early, and a second read (the whole way) would draw again, refreshing at p²
    /// instead of p.
    pub(crate) fn served_now<T: Decode>(&self, key: &str) -> Option<(T, Served, u64)> {
        if self.inner.config.early_beta.is_some() {
            return None;
        }
        if self.inner.near.is_some() {
            // A near hit is answered at once; anything else goes the whole way (on a shared
            // store, a read here would block the task).
            let v = self.near_peek::<T>(key)?;
            return Some((v, Served::Near, self.now_ms()));
        }
        let derived = self.keys.make(key).ok()?;
        let span = self.span("get_or_set_with", &derived);
        let _entered = span.enter();
        // A failed read is left to the request's future, which reads again and counts the
        // failure once (absorbed here too, it would be counted twice).
        let read = self.inner.config.backend.get(&derived).ok()?;
        let limit = self.inner.config.backend.max_value_size(&derived);
        let (_, first, now) = self
            .start(Ok(read), Mode::Load, self.settings(true, limit), None)
            .ok()?;
        let (v, stale) = self.servable(&first)?;
        let served = if stale { Served::Stale } else { Served::Fresh };
        Some((v, served, now.wall_ms))
    }

    /// Counts a value [`served_now`](Cache::served_now) found, once it is served.
    pub(crate) fn count_served_now(&self, served: Served) {
        match served {
            Served::Near => self.near_counted(),
            Served::Fresh => self.count_served(false),
            Served::Stale => self.count_served(true),
        }
    }

    /// Replaces the value under `key` with `value` only if the key still holds a value of this
    /// type for which `still` says yes, with `cas` against what was read: a delete, or any
    /// other write, that lands in between wins. `true` if stored. Nothing is stored over a
    /// missing key, a placeholder, or bytes of another kind. For writers that must not undo
    /// an invalidation that landed while they worked (the response cache's revalidations).
    pub(crate) async fn replace_on<T: Encode + Decode, I: Io>(
        &self,
        io: &I,
        key: &str,
        value: &T,
        ttl: Ttl,
        herd: Herd,
        still: impl FnOnce(&T) -> bool,
    ) -> Result<bool> {
        let k = self.keys.make(key)?;
        let Some(item) = self.absorb_read(io.get(&k).await)?.flatten() else {
            return Ok(false);
        };
        let Ok(Parsed::Item(header, payload)) = envelope::decode(item.flags, &item.value) else {
            return Ok(false);
        };
        if header.kind == Kind::Placeholder {
            return Ok(false);
        }
        match self.decode_payload::<T>(&header, &item.value, payload) {
            Ok(current) if still(&current) => {}
            _ => return Ok(false),
        }
        let life = ttl.resolve(self.inner.config.default_ttl);
        if life == Lifetime::Expired {
            return Ok(false);
        }
        let (bytes, exptime) = self.encode(value, life, herd, 0)?;
        self.check_room(&bytes, io.max_value_size(&k))?;
        let w = Write {
            mode: StoreMode::Cas(item.cas),
            key: &k,
            value: &bytes,
            flags: envelope::FLAGS,
            exptime,
        };
        let outcome = self.absorb_write(io.store(w).await)?;
        Ok(outcome == Some(StoreOutcome::Stored))
    }

    /// [`delete`](Cache::delete), and then a `get_or_set_with` of this process that starts
    /// after it returned does not join a load that started before it (and may have read what
    /// the delete invalidates): it leads a load of its own. That older load still serves its
    /// own callers; its result is not stored (its `cas` fails). For invalidations that must read
    /// their own writes (the response cache's unsafe methods and `invalidate`); plain writes do
    /// not detach, so that a loader that deletes or sets its own key stays one load.
    pub(crate) async fn invalidate_on<I: Io>(&self, io: &I, key: &str) -> Result<bool> {
        let r = self.delete_on(io, key).await;
        if let Ok(k) = self.keys.make(key) {
            self.inner.coalescer.detach(&k, None);
        }
        r
    }

    /// The same cache (backend, keys, coalescer), its operations counted in `stats` instead
    /// of the cache's counters: the response cache's handle, so that its page reads and
    /// fills are not the application's own (`Cache::stats` counts those only).
    pub(crate) fn counting_in(&self, stats: Arc<Counters>) -> Cache {
        Cache {
            inner: self.inner.clone(),
            keys: self.keys.clone(),
            stats,
        }
    }
}
