//! A claim held by an async load: renewed every third of `lease_ttl` while the loader runs
//! (inside the caller's future, so a loader need not be `'static`), completed with `cas`, or
//! released. Dropped unfinished (the load failed, or its future was cancelled), it releases the
//! key from a spawned task, so the next caller retries at once. The claim logic itself is
//! `protocol::Claim`, shared with the sync front end.

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use crate::backend::{AsyncBackend, Item, StoreMode, StoreOutcome, Write};
use crate::cache::Cache;
use crate::envelope;
use crate::error::Result;
use crate::loader::lease::{Completed, completed};
use crate::protocol::{Action, Claim, Renewal, release_abandoned, removal};

/// The async front end's lease: a claim renewed inside the caller's future while its loader
/// runs, completed with `cas`, or given back (from a spawned task when dropped).
pub(crate) struct AsyncLease {
    key: String,
    lease: Claim,
    backend: Arc<dyn AsyncBackend>,
    cache: Cache,
    /// When the next renewal is due.
    next: Instant,
    /// Renewals stopped (past max_load_time, or the claim was lost).
    idle: bool,
    lost: bool,
    done: bool,
}

impl AsyncLease {
    pub(crate) fn new(
        cache: &Cache,
        backend: Arc<dyn AsyncBackend>,
        key: &str,
        lease: Claim,
    ) -> AsyncLease {
        AsyncLease {
            key: key.to_string(),
            next: Instant::now() + lease.renew_every(),
            lease,
            backend,
            cache: cache.clone(),
            idle: false,
            lost: false,
            done: false,
        }
    }

    pub(crate) fn key(&self) -> &str {
        &self.key
    }

    /// Whether the claim holds a value others are served ([`Claim::serves_others`]).
    pub(crate) fn serves_others(&self, now_ms: u64, kept_ms: u64) -> bool {
        self.lease.serves_others(now_ms, kept_ms)
    }

    /// Renews the claim if a renewal is due.
    async fn renew(&mut self) {
        if self.idle || self.next > Instant::now() {
            return;
        }
        self.renew_now().await;
        self.next = Instant::now() + self.lease.renew_every();
    }

    async fn renew_now(&mut self) {
        let Some(Action::StoreThenRead {
            mode,
            value,
            exptime,
        }) = self.lease.renewal(self.cache.now())
        else {
            // Past max_load_time: let the claim lapse.
            self.idle = true;
            return;
        };
        let w = Write {
            mode,
            key: &self.key,
            value: &value,
            flags: envelope::FLAGS,
            exptime,
        };
        // A failed renewal is tried again next time.
        if let Ok((_, after)) = self.backend.store_then_get(w).await {
            let mut renewal = self.lease.on_renewed(after, false);
            if renewal == Renewal::Unsure {
                // The read ran before the write (a proxy reordered them): read again.
                if let Ok(item) = self.backend.get(&self.key).await {
                    renewal = self.lease.on_renewed(item, true);
                }
            }
            if renewal == Renewal::Lost {
                self.lost = true;
                self.idle = true;
            }
        }
    }

    /// Runs `work` to its end while every claim in `held` is renewed on schedule.
    pub(crate) async fn renewing_all<F: Future>(
        mut held: Vec<&mut AsyncLease>,
        work: F,
    ) -> F::Output {
        tokio::pin!(work);
        loop {
            let Some(next) = held.iter().filter(|h| !h.idle).map(|h| h.next).min() else {
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
    /// result per claim, in order.
    pub(crate) async fn complete_many(
        backend: &dyn AsyncBackend,
        mut batch: Vec<(AsyncLease, Vec<u8>, u32)>,
    ) -> Vec<Result<Completed>> {
        let mut at = Vec::with_capacity(batch.len());
        for (i, (held, _, _)) in batch.iter_mut().enumerate() {
            held.idle = true;
            if held.lost {
                held.done = true;
            } else {
                at.push(i);
            }
        }
        let writes: Vec<Write<'_>> = at
            .iter()
            .map(|&i| {
                let (held, value, exptime) = &batch[i];
                Write {
                    mode: held.lease.store_mode(),
                    key: &held.key,
                    value,
                    flags: envelope::FLAGS,
                    exptime: *exptime,
                }
            })
            .collect();
        let outcomes = backend.store_many(&writes).await;
        drop(writes);
        let mut out: Vec<Result<Completed>> = (0..batch.len())
            .map(|_| Ok(Completed::Superseded))
            .collect();
        for (&i, o) in at.iter().zip(outcomes) {
            if o.is_ok() {
                batch[i].0.done = true;
            }
            out[i] = o.map(completed);
        }
        out
    }

    /// Stores the loaded value with `cas` against the claim (nothing if the claim was lost).
    /// On a denial (`is_denied`) the key is deleted before it returns; on another error,
    /// dropping the lease gives the claim back.
    pub(crate) async fn complete(mut self, value: &[u8], exptime: u32) -> Result<Completed> {
        if self.lost {
            self.done = true;
            return Ok(Completed::Superseded);
        }
        let mode = self.lease.store_mode();
        let w = Write {
            mode,
            key: &self.key,
            value,
            flags: envelope::FLAGS,
            exptime,
        };
        let outcome = match self.backend.store(w).await {
            // Refused to this client (its ACL): no store of this claim, nor its fenced release,
            // can ever happen, so it goes by a plain delete while the key still holds the
            // claim (a write landed meanwhile is kept), before the caller returns (safe for
            // invalidation: at most an extra load), and nobody waits behind it.
            Err(e) if e.is_denied() => {
                if let StoreMode::Cas(claim) = mode {
                    if matches!(self.backend.get(&self.key).await, Ok(Some(item)) if item.cas == claim)
                    {
                        let _ = self.backend.delete(&self.key).await;
                    }
                }
                self.done = true;
                return Err(e);
            }
            r => r?,
        };
        self.done = true;
        Ok(completed(outcome))
    }
}

impl Drop for AsyncLease {
    /// Gives the key back (a failed load, or a future dropped mid-load), from a spawned task:
    /// see [`give_back`]. A renewal whose reply was lost to the drop may have changed the
    /// claim's CAS token, so the claim is found by its token, not by the last CAS known.
    fn drop(&mut self) {
        if self.done || self.lost || !self.lease.is_claim() {
            return;
        }
        let key = std::mem::take(&mut self.key);
        let restore = self.lease.restore().cloned();
        give_back(
            &self.cache,
            &self.backend,
            vec![(key, self.lease.token(), restore)],
        );
    }
}

/// Gives back claims whose holder went away, from a spawned task: each key is read, and a claim
/// or placeholder that still carries its token is released (`release_abandoned`). A write of
/// the dropped caller may still be on its way (queued in the engine, which sends it anyway):
/// a key where nothing of ours was found is read once more after the backend's settle time.
/// Best effort: without a runtime, or if the backend fails, the claims lapse at their
/// deadlines.
pub(crate) fn give_back(
    cache: &Cache,
    backend: &Arc<dyn AsyncBackend>,
    claims: Vec<(String, u64, Option<Item>)>,
) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let (cache, backend) = (cache.clone(), backend.clone());
    rt.spawn(async move {
        let mut missed = Vec::new();
        for (key, token, restore) in claims {
            if !release_if_ours(&cache, &*backend, &key, token, restore.clone()).await {
                missed.push((key, token, restore));
            }
        }
        if missed.is_empty() {
            return;
        }
        tokio::time::sleep(backend.settle_time()).await;
        for (key, token, restore) in missed {
            release_if_ours(&cache, &*backend, &key, token, restore).await;
        }
    });
}

/// Releases `key` if it holds `token`'s claim: `true` once released; `false` if the key holds
/// nothing of ours (yet), or the release lost to a write of ours still landing.
async fn release_if_ours(
    cache: &Cache,
    backend: &dyn AsyncBackend,
    key: &str,
    token: u64,
    restore: Option<Item>,
) -> bool {
    let Ok(Some(item)) = backend.get(key).await else {
        return false;
    };
    let Some(release) = release_abandoned(&item, token, restore, cache.now()) else {
        return false;
    };
    // A release that lost to a write of ours still on its way (a renewal queued on another
    // connection, which moved the CAS token) is looked at again after the settle time. A value
    // the backend failed to write back (refused, `OOM`, a broken connection) must not leave the
    // claim for others to sit out: the claim is removed instead.
    let r = match store_action(backend, key, &release).await {
        Some(Err(e)) if !e.is_denied() => match release {
            Action::StoreThenRead { mode, value, .. } if !value.is_empty() => {
                store_action(backend, key, &removal(mode)).await
            }
            _ => Some(Err(e)),
        },
        r => r,
    };
    let Some(r) = r else {
        return false;
    };
    match r {
        Ok(StoreOutcome::Stored) => true,
        // A fenced write the server refused (denied to this client, or a write under `OOM`,
        // which a delete is not): a plain delete while the key still holds the claim.
        Err(e) if !e.is_outcome_unknown() => {
            matches!(backend.get(key).await, Ok(Some(now)) if now.cas == item.cas)
                && backend.delete(key).await.is_ok()
        }
        _ => false,
    }
}

/// `action`'s write of `key`, if it is one ([`Action::StoreThenRead`], its read-back not
/// needed here).
async fn store_action(
    backend: &dyn AsyncBackend,
    key: &str,
    action: &Action,
) -> Option<Result<StoreOutcome>> {
    let Action::StoreThenRead {
        mode,
        value,
        exptime,
    } = action
    else {
        return None;
    };
    let w = Write {
        mode: *mode,
        key,
        value,
        flags: envelope::FLAGS,
        exptime: *exptime,
    };
    Some(backend.store(w).await)
}
