//! A claim held by an async load: renewed every third of `lease_ttl` while the loader runs
//! (inside the caller's future, so a loader need not be `'static`), completed with `cas`, or
//! released. Dropped unfinished (the load failed, or its future was cancelled), it releases the
//! key from a spawned task, so the next caller retries at once. When to renew and what comes
//! of it is `protocol::Lease`, the writes `loader::lease`'s: both shared with the sync front
//! end.

use std::future::Future;
use std::time::Instant;

use super::AsyncCache;
use super::AsyncDriver;
use crate::backend::Item;
use crate::cache::io::Io;
use crate::error::Result;
use crate::loader::lease::{Completed, complete_many_on, complete_on, give_back_on, renew_on};
use crate::protocol::{Claim, Lease, release_abandoned};

/// The async front end's lease: a claim renewed inside the caller's future while its loader
/// runs, completed with `cas`, or given back (from a spawned task when dropped).
pub(crate) struct AsyncLease {
    key: String,
    lease: Lease,
    cache: AsyncCache,
}

impl AsyncLease {
    pub(crate) fn new(cache: &AsyncCache, key: &str, claim: Claim) -> AsyncLease {
        AsyncLease {
            key: key.to_string(),
            lease: Lease::new(claim, Instant::now()),
            cache: cache.clone(),
        }
    }

    pub(crate) fn key(&self) -> &str {
        &self.key
    }

    /// Whether the claim holds a value others are served ([`Claim::serves_others`]).
    pub(crate) fn serves_others(&self, now_ms: u64, kept_ms: u64) -> bool {
        self.lease.claim.serves_others(now_ms, kept_ms)
    }

    /// Renews the claim if a renewal is due.
    async fn renew(&mut self) {
        if self.lease.due_at().is_some_and(|at| at <= Instant::now()) {
            let now = self.cache.cache.now();
            renew_on(&AsyncDriver(&self.cache), &self.key, &mut self.lease, now).await;
        }
    }

    /// Runs `work` to its end while every claim in `held` is renewed on schedule.
    pub(crate) async fn renewing_all<F: Future>(
        mut held: Vec<&mut AsyncLease>,
        work: F,
    ) -> F::Output {
        tokio::pin!(work);
        loop {
            let Some(next) = held.iter().filter_map(|h| h.lease.due_at()).min() else {
                return work.await;
            };
            tokio::select! {
                out = &mut work => return out,
                () = tokio::time::sleep_until(tokio::time::Instant::from_std(next)) => {
                    for h in held.iter_mut() {
                        h.renew().await;
                    }
                }
            }
        }
    }

    /// Stores several loads' values against their claims (one round trip per server); one
    /// result per claim, in order ([`complete_many_on`]).
    pub(crate) async fn complete_many(
        d: &AsyncDriver<'_>,
        mut batch: Vec<(AsyncLease, Vec<u8>, u32)>,
    ) -> Vec<Result<Completed>> {
        let each = batch
            .iter_mut()
            .map(|(h, value, exptime)| (h.key.as_str(), &mut h.lease, &value[..], *exptime))
            .collect();
        complete_many_on(d, each).await
    }

    /// Stores the loaded value with `cas` against the claim ([`complete_on`]).
    pub(crate) async fn complete(mut self, value: &[u8], exptime: u32) -> Result<Completed> {
        let d = AsyncDriver(&self.cache);
        complete_on(&d, &self.key, &mut self.lease, value, exptime).await
    }
}

impl Drop for AsyncLease {
    /// Gives the key back (a failed load, or a future dropped mid-load), from a spawned task:
    /// see [`give_back`]. A renewal whose reply was lost to the drop may have changed the
    /// claim's CAS token, so the claim is found by its token, not by the last CAS known.
    fn drop(&mut self) {
        let Some((token, restore)) = self.lease.abandoned() else {
            return;
        };
        let key = std::mem::take(&mut self.key);
        give_back(&self.cache, vec![(key, token, restore)]);
    }
}

/// Gives back claims whose holder went away, from a spawned task: each key is read, and a claim
/// or placeholder that still carries its token is released (`release_abandoned`). A write of
/// the dropped caller may still be on its way (queued in the engine, which sends it anyway):
/// a key where nothing of ours was found is read once more after the backend's settle time.
/// Best effort: without a runtime, or if the backend fails, the claims lapse at their
/// deadlines.
pub(crate) fn give_back(cache: &AsyncCache, claims: Vec<(String, u64, Option<Item>)>) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let cache = cache.clone();
    rt.spawn(async move {
        let d = AsyncDriver(&cache);
        let mut missed = Vec::new();
        for (key, token, restore) in claims {
            if !release_if_ours(&d, &key, token, restore.clone()).await {
                missed.push((key, token, restore));
            }
        }
        if missed.is_empty() {
            return;
        }
        tokio::time::sleep(cache.shared().backend.settle_time()).await;
        for (key, token, restore) in missed {
            release_if_ours(&d, &key, token, restore).await;
        }
    });
}

/// Releases `key` if it holds `token`'s claim: `true` once released; `false` if the key holds
/// nothing of ours (yet), or the release lost to a write of ours still landing (a renewal
/// queued on another connection, which moved the CAS token): looked at again after the settle
/// time.
async fn release_if_ours(
    d: &AsyncDriver<'_>,
    key: &str,
    token: u64,
    restore: Option<Item>,
) -> bool {
    let Ok(Some(item)) = d.get(key).await else {
        return false;
    };
    let Some(release) = release_abandoned(&item, token, restore, d.0.cache.now()) else {
        return false;
    };
    give_back_on(d, key, &release).await
}
