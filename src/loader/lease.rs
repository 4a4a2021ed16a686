//! Leases: claims kept alive while their loads run. The writes a lease makes (its renewal, its
//! completion with `cas`, its give-back) are written once here, over [`Io`], for both front
//! ends; when to make them, and what their outcomes mean, is `protocol::Lease`'s. The sync
//! front end's leases are renewed by one renewal thread per cache (started on the first load
//! that needs it, gone after a few idle seconds), every third of `lease_ttl`, up to
//! `max_load_time`. A [`BlockingLease`] completes the claim, or releases it; dropped unfinished
//! (a panicking loader), it releases.

use std::fmt;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::backend::{Backend, StoreMode, StoreOutcome, Write};
use crate::cache::io::{Blocking, Io, ready};
use crate::clock::Clock;
use crate::envelope;
use crate::error::Result;
use crate::protocol::{Action, Claim, Lease, Now, Renewal, removal};

/// How long the renewal thread lingers with nothing to renew before it exits.
const IDLE_EXIT: Duration = Duration::from_secs(5);

/// How a completion went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Completed {
    /// The value is stored.
    Stored,
    /// The key was written, deleted or taken over while the load ran: the value is not stored,
    /// so the newer state stays.
    Superseded,
}

fn completed(outcome: StoreOutcome) -> Completed {
    match outcome {
        StoreOutcome::Stored => Completed::Stored,
        _ => Completed::Superseded,
    }
}

/// Renews `lease` on `key` now, if it still renews.
pub(crate) async fn renew_on<I: Io>(io: &I, key: &str, lease: &mut Lease, now: Now) {
    let Some(write) = lease.renewal(now) else {
        return;
    };
    if let Some(Ok((_, after))) = write_on(io, key, &write, true).await {
        if lease.on_renewed(after, false) == Renewal::Unsure {
            // The read ran before the write (a proxy reordered them): read again. A failed
            // read leaves the claim as it was; the next renewal finds out.
            if let Ok(item) = io.get(key).await {
                lease.on_renewed(item, true);
            }
        }
    }
    lease.renewed(Instant::now());
}

/// Stores the loaded `value` against `lease`'s claim (nothing if the claim was lost). On a
/// denial (`is_denied`) the key is deleted before it returns; on another error the lease is
/// still held, and dropping it gives the claim back.
pub(crate) async fn complete_on<I: Io>(
    io: &I,
    key: &str,
    lease: &mut Lease,
    value: &[u8],
    exptime: u32,
) -> Result<Completed> {
    let Some(mode) = lease.completing() else {
        return Ok(Completed::Superseded);
    };
    let outcome = match io
        .store(Write::new(mode, key, value, envelope::FLAGS, exptime))
        .await
    {
        // Refused to this client (its ACL): no store of this claim, nor its fenced release,
        // can ever happen, so it goes by a plain delete while the key still holds the claim
        // (a write landed meanwhile is kept), before the caller returns (safe for
        // invalidation: at most an extra load), and nobody waits behind it.
        Err(e) if e.is_denied() => {
            delete_if_claim(io, key, mode).await;
            lease.finish();
            return Err(e);
        }
        r => r?,
    };
    lease.finish();
    Ok(completed(outcome))
}

/// Stores several loads' values against their leases' claims, one round trip per server; one
/// result per lease, in order. A lease whose write failed is still held.
pub(crate) async fn complete_many_on<I: Io>(
    io: &I,
    mut batch: Vec<(&str, &mut Lease, &[u8], u32)>,
) -> Vec<Result<Completed>> {
    let modes: Vec<Option<StoreMode>> = batch
        .iter_mut()
        .map(|(_, lease, _, _)| lease.completing())
        .collect();
    let writes: Vec<Write<'_>> = batch
        .iter()
        .zip(&modes)
        .filter_map(|((key, _, value, exptime), mode)| {
            mode.map(|m| Write::new(m, key, value, envelope::FLAGS, *exptime))
        })
        .collect();
    let mut outcomes = io.store_many(&writes).await.into_iter();
    drop(writes);
    batch
        .into_iter()
        .zip(modes)
        // Only the leases written took an outcome: a lost one takes none.
        .map(
            |((_, lease, _, _), mode)| match mode.and_then(|_| outcomes.next()) {
                Some(Ok(outcome)) => {
                    lease.finish();
                    Ok(completed(outcome))
                }
                Some(Err(e)) => Err(e),
                None => Ok(Completed::Superseded),
            },
        )
        .collect()
}

/// Writes `release`, the give-back of `key`'s claim ([`Lease::release`], or
/// `protocol::release_abandoned`): `true` once given back. A value the backend failed to
/// write back (refused, `OOM`, a broken connection) must not leave the claim for others to sit
/// out: the claim is removed instead ([`removal`]). A fenced write the server refused (denied
/// to this client, or a write under `OOM`, which a delete is not) is a plain delete while the
/// key still holds the claim; after a write whose outcome is unknown, the claim lapses at its
/// deadline.
pub(crate) async fn give_back_on<I: Io>(io: &I, key: &str, release: &Action) -> bool {
    let Action::StoreThenRead { mode, value, .. } = release else {
        return false;
    };
    let mut r = write_on(io, key, release, false).await;
    if matches!(&r, Some(Err(e)) if !e.is_denied()) && !value.is_empty() {
        r = write_on(io, key, &removal(*mode), false).await;
    }
    match r {
        Some(Ok((outcome, _))) => outcome == StoreOutcome::Stored,
        Some(Err(e)) if !e.is_outcome_unknown() => delete_if_claim(io, key, *mode).await,
        _ => false,
    }
}

/// `action`'s write of `key`, if it is one ([`Action::StoreThenRead`]), with its read-back
/// only if `read_back`.
async fn write_on<I: Io>(
    io: &I,
    key: &str,
    action: &Action,
    read_back: bool,
) -> Option<Result<(StoreOutcome, Option<crate::backend::Item>)>> {
    let Action::StoreThenRead {
        mode,
        value,
        exptime,
    } = action
    else {
        return None;
    };
    let w = Write::new(*mode, key, value, envelope::FLAGS, *exptime);
    Some(if read_back {
        io.store_then_get(w).await
    } else {
        io.store(w).await.map(|outcome| (outcome, None))
    })
}

/// A denied fenced write's fallback: deletes `key` if it still holds the claim `mode` was
/// fenced on (its CAS token), so that a write landed meanwhile (a `set`, an invalidation's
/// value, another process's store or claim) is not deleted with it; `true` if deleted. Not
/// atomic: a write that lands between the read and the delete is still deleted (a miss, an
/// extra load).
async fn delete_if_claim<I: Io>(io: &I, key: &str, mode: StoreMode) -> bool {
    let StoreMode::Cas(claim) = mode else {
        return false;
    };
    matches!(io.get(key).await, Ok(Some(item)) if item.cas == claim) && io.delete(key).await.is_ok()
}

/// The renewal renewals of one cache.
pub(crate) struct Renewer {
    renewals: Arc<Renewals>,
}

/// What the renewal thread and the leases it keeps share.
struct Renewals {
    backend: Arc<dyn Backend>,
    clock: Arc<dyn Clock>,
    started: Instant,
    state: Mutex<State>,
    wake: Condvar,
}

#[derive(Default)]
struct State {
    kept: Vec<Arc<Kept>>,
    thread_running: bool,
}

/// A lease the renewal thread keeps.
struct Kept {
    key: String,
    // Lock order: `State` may be held while taking a `Kept`'s lock, never the reverse.
    lease: Mutex<Lease>,
}

impl fmt::Debug for Renewer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Renewer")
            .field("held", &self.renewals.state.lock().kept.len())
            .finish()
    }
}

impl Renewals {
    fn now(&self) -> Now {
        Now {
            wall_ms: self.clock.now_ms(),
            mono_ms: self.started.elapsed().as_millis() as u64,
        }
    }
}

impl Renewer {
    pub(crate) fn new(backend: Arc<dyn Backend>, clock: Arc<dyn Clock>) -> Renewer {
        Renewer {
            renewals: Arc::new(Renewals {
                backend,
                clock,
                started: Instant::now(),
                state: Mutex::new(State::default()),
                wake: Condvar::new(),
            }),
        }
    }

    /// Starts keeping `claim` on derived key `key` alive until the returned lease completes or
    /// releases it.
    pub(crate) fn hold(&self, key: &str, claim: Claim) -> BlockingLease {
        let kept = Arc::new(Kept {
            key: key.to_string(),
            lease: Mutex::new(Lease::new(claim, Instant::now())),
        });
        let mut st = self.renewals.state.lock();
        st.kept.push(kept.clone());
        if !st.thread_running {
            let renewals = self.renewals.clone();
            let spawned = thread::Builder::new()
                .name("newcache-renew".into())
                .spawn(move || renew_loop(&renewals));
            // Without the thread, claims are not renewed: a load longer than lease_ttl may then
            // be taken over, and its result is not stored. Nothing else breaks.
            st.thread_running = spawned.is_ok();
        }
        drop(st);
        self.renewals.wake.notify_one();
        BlockingLease {
            kept,
            renewals: self.renewals.clone(),
        }
    }
}

fn renew_loop(renewals: &Renewals) {
    let mut st = renewals.state.lock();
    let mut idle_since = Instant::now();
    loop {
        st.kept
            .retain(|k| k.lease.try_lock().is_none_or(|l| !l.is_done()));
        let now = Instant::now();
        let mut due = Vec::new();
        let mut next: Option<Instant> = None;
        for k in &st.kept {
            // A lease busy with I/O (a completion, a release) is skipped, not waited for: the
            // table lock is held here, and new holds must not wait on another key's round trip.
            let Some(l) = k.lease.try_lock() else {
                next = Some(next.map_or(now + Duration::from_millis(5), |n| {
                    n.min(now + Duration::from_millis(5))
                }));
                continue;
            };
            match l.due_at() {
                None => {}
                Some(at) if at <= now => due.push(k.clone()),
                Some(at) => next = Some(next.map_or(at, |n| n.min(at))),
            }
        }
        if !due.is_empty() {
            // No I/O under the table lock: new holds must not wait on a renewal.
            drop(st);
            for k in due {
                // Taken by a completion or a release since (a batch's lasts its whole write):
                // it needs no renewal, and other leases' renewals must not wait behind it.
                let Some(mut l) = k.lease.try_lock() else {
                    continue;
                };
                let io = Blocking(&*renewals.backend);
                ready(renew_on(&io, &k.key, &mut l, renewals.now()));
            }
            st = renewals.state.lock();
            idle_since = Instant::now();
            continue;
        }
        match next {
            Some(at) => {
                idle_since = Instant::now();
                renewals.wake.wait_until(&mut st, at);
            }
            None => {
                if idle_since.elapsed() >= IDLE_EXIT {
                    st.thread_running = false;
                    return;
                }
                renewals.wake.wait_for(&mut st, IDLE_EXIT);
            }
        }
    }
}

/// The sync front end's lease: a claim kept alive by the renewal thread while a loader runs.
/// Complete it with the loaded value, or release it.
pub(crate) struct BlockingLease {
    kept: Arc<Kept>,
    renewals: Arc<Renewals>,
}

impl fmt::Debug for BlockingLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockingLease")
            .field("key", &self.kept.key)
            .finish_non_exhaustive()
    }
}

impl BlockingLease {
    fn io(&self) -> Blocking<'_> {
        Blocking(&*self.renewals.backend)
    }

    /// Stores the loaded `value` with `cas` against the claim ([`complete_on`]).
    pub(crate) fn complete(self, value: &[u8], exptime: u32) -> Result<Completed> {
        let mut l = self.kept.lease.lock();
        ready(complete_on(
            &self.io(),
            &self.kept.key,
            &mut l,
            value,
            exptime,
        ))
    }

    /// Stores several loads' values, one round trip per server ([`complete_many_on`]). A lease
    /// whose write failed is released when the batch is dropped.
    pub(crate) fn complete_many(
        backend: &dyn Backend,
        batch: Vec<(BlockingLease, Vec<u8>, u32)>,
    ) -> Vec<Result<Completed>> {
        let mut locked: Vec<_> = batch.iter().map(|(h, _, _)| h.kept.lease.lock()).collect();
        let each = batch
            .iter()
            .zip(&mut locked)
            .map(|((h, value, exptime), l)| (h.kept.key.as_str(), &mut **l, &value[..], *exptime))
            .collect();
        ready(complete_many_on(&Blocking(backend), each))
    }

    /// The derived key held.
    pub(crate) fn key(&self) -> &str {
        &self.kept.key
    }

    /// Whether the claim holds a value others are served ([`Claim::serves_others`]).
    pub(crate) fn serves_others(&self, now_ms: u64, kept_ms: u64) -> bool {
        self.kept.lease.lock().claim.serves_others(now_ms, kept_ms)
    }
}

impl Drop for BlockingLease {
    fn drop(&mut self) {
        // A failed load, a panicking loader, or an error on the way: never leave a placeholder
        // for waiters to sit out. The key is given back at once, so the next caller retries.
        {
            let mut l = self.kept.lease.lock();
            if let Some(release) = l.release(self.renewals.now()) {
                ready(give_back_on(&self.io(), &self.kept.key, &release));
            }
        }
        let mut st = self.renewals.state.lock();
        st.kept.retain(|k| !Arc::ptr_eq(k, &self.kept));
    }
}
