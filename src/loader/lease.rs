//! Claims held by running loads, kept alive while the loader runs: one renewal thread per cache
//! (started on the first load that needs it, gone after a few idle seconds) renews each claim
//! every third of `lease_ttl`, up to `max_load_time`, and finds out when a claim is lost (the
//! key was written or deleted meanwhile). A [`BlockingLease`] completes the claim with `cas`, or
//! releases it; dropped unfinished (a panicking loader), it releases.

use std::fmt;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::backend::{Backend, StoreMode, StoreOutcome, Write};
use crate::clock::Clock;
use crate::envelope;
use crate::error::Result;
use crate::protocol::{Action, Claim, Now, Renewal, removal};

/// How long the renewal thread lingers with nothing to renew before it exits.
const IDLE_EXIT: Duration = Duration::from_secs(5);

/// The renewal service of one cache.
pub(crate) struct Renewer {
    shared: Arc<Shared>,
}

struct Shared {
    backend: Arc<dyn Backend>,
    clock: Arc<dyn Clock>,
    started: Instant,
    state: Mutex<State>,
    wake: Condvar,
}

#[derive(Default)]
struct State {
    held: Vec<Arc<Slot>>,
    thread_running: bool,
}

struct Slot {
    key: String,
    // Lock order: `State` may be held while taking a `Slot`'s lock, never the reverse.
    lease: Mutex<SlotState>,
}

struct SlotState {
    lease: Claim,
    next: Instant,
    /// No more renewals: finished, lost, or past `max_load_time`.
    idle: bool,
    /// The claim was lost: the key was written, deleted or taken over meanwhile.
    lost: bool,
    done: bool,
}

impl fmt::Debug for Renewer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Renewer")
            .field("held", &self.shared.state.lock().held.len())
            .finish()
    }
}

impl Shared {
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
            shared: Arc::new(Shared {
                backend,
                clock,
                started: Instant::now(),
                state: Mutex::new(State::default()),
                wake: Condvar::new(),
            }),
        }
    }

    /// Starts keeping `lease` on derived key `key` alive until the returned guard completes or
    /// releases it. `started_mono_ms` must be on the same clock as the protocol's `Now`.
    pub(crate) fn hold(&self, key: &str, lease: Claim) -> BlockingLease {
        let slot = Arc::new(Slot {
            key: key.to_string(),
            lease: Mutex::new(SlotState {
                next: Instant::now() + lease.renew_every(),
                lease,
                idle: false,
                lost: false,
                done: false,
            }),
        });
        let mut st = self.shared.state.lock();
        st.held.push(slot.clone());
        if !st.thread_running {
            let shared = self.shared.clone();
            let spawned = thread::Builder::new()
                .name("newcache-renew".into())
                .spawn(move || renew_loop(&shared));
            // Without the thread, claims are not renewed: a load longer than lease_ttl may then
            // be taken over, and its result is not stored. Nothing else breaks.
            st.thread_running = spawned.is_ok();
        }
        drop(st);
        self.shared.wake.notify_one();
        BlockingLease {
            slot,
            shared: self.shared.clone(),
        }
    }
}

fn renew_loop(shared: &Shared) {
    let mut st = shared.state.lock();
    let mut idle_since = Instant::now();
    loop {
        st.held
            .retain(|s| s.lease.try_lock().is_none_or(|l| !l.done));
        let now = Instant::now();
        let mut due = Vec::new();
        let mut next: Option<Instant> = None;
        for s in &st.held {
            // A slot busy with I/O (a completion, a release) is skipped, not waited for: the
            // table lock is held here, and new holds must not wait on another key's round trip.
            let Some(l) = s.lease.try_lock() else {
                next = Some(next.map_or(now + Duration::from_millis(5), |n| {
                    n.min(now + Duration::from_millis(5))
                }));
                continue;
            };
            if l.idle {
                continue;
            }
            if l.next <= now {
                due.push(s.clone());
            } else {
                next = Some(next.map_or(l.next, |n| n.min(l.next)));
            }
        }
        if !due.is_empty() {
            // No I/O under the table lock: new holds must not wait on a renewal.
            drop(st);
            for s in due {
                renew(shared, &s);
            }
            st = shared.state.lock();
            idle_since = Instant::now();
            continue;
        }
        match next {
            Some(at) => {
                idle_since = Instant::now();
                shared.wake.wait_until(&mut st, at);
            }
            None => {
                if idle_since.elapsed() >= IDLE_EXIT {
                    st.thread_running = false;
                    return;
                }
                shared.wake.wait_for(&mut st, IDLE_EXIT);
            }
        }
    }
}

fn renew(shared: &Shared, slot: &Slot) {
    let mut l = slot.lease.lock();
    if l.done || l.idle {
        return;
    }
    let Some(Action::StoreThenRead {
        mode,
        value,
        exptime,
    }) = l.lease.renewal(shared.now())
    else {
        // Past max_load_time: let the claim lapse.
        l.idle = true;
        return;
    };
    let w = Write {
        mode,
        key: &slot.key,
        value: &value,
        flags: envelope::FLAGS,
        exptime,
    };
    // A failed renewal is tried again next time; two failures in a row still leave a third of
    // the lease.
    if let Ok((_, after)) = shared.backend.store_then_get(w) {
        let mut renewal = l.lease.on_renewed(after, false);
        if renewal == Renewal::Unsure {
            // The read ran before the write (a proxy reordered them): read again. A failed
            // read leaves the claim as it was; the next renewal finds out.
            if let Ok(item) = shared.backend.get(&slot.key) {
                renewal = l.lease.on_renewed(item, true);
            }
        }
        if renewal == Renewal::Lost {
            l.lost = true;
            l.idle = true;
        }
    }
    l.next = Instant::now() + l.lease.renew_every();
}

/// The sync front end's lease: a claim kept alive by the renewal thread while a loader runs.
/// Complete it with the loaded value, or release it.
pub(crate) struct BlockingLease {
    slot: Arc<Slot>,
    shared: Arc<Shared>,
}

impl fmt::Debug for BlockingLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockingLease")
            .field("key", &self.slot.key)
            .finish_non_exhaustive()
    }
}

/// How a completion went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Completed {
    /// The value is stored.
    Stored,
    /// The key was written, deleted or taken over while the load ran: the value is not stored,
    /// so the newer state stays.
    Superseded,
}

impl BlockingLease {
    /// Stores the loaded `value` with `cas` against the claim.
    /// On an error the claim is still held, and dropping the guard releases it; on a denial
    /// (`is_denied`) the key is deleted at once.
    pub(crate) fn complete(self, value: &[u8], exptime: u32) -> Result<Completed> {
        let mut l = self.slot.lease.lock();
        l.idle = true;
        if l.lost {
            l.done = true;
            return Ok(Completed::Superseded);
        }
        let mode = l.lease.store_mode();
        let outcome = self.shared.backend.store(Write::new(
            mode,
            &self.slot.key,
            value,
            envelope::FLAGS,
            exptime,
        ));
        let outcome = match outcome {
            // The fenced write is refused to this client (its ACL): no store of this claim, nor
            // its fenced release, can ever happen, so it goes by a plain delete while the key
            // still holds the claim (safe for invalidation: at most an extra load of a value
            // written between the read and the delete), and nobody waits behind it.
            Err(e) if e.is_denied() => {
                delete_if_claim(&*self.shared.backend, &self.slot.key, mode);
                l.done = true;
                return Err(e);
            }
            r => r?,
        };
        l.done = true;
        Ok(completed(outcome))
    }

    /// Stores several loads' values, one round trip per server; one result per lease, in order.
    /// A lease whose write failed is still held, and released when the batch is dropped.
    pub(crate) fn complete_many(
        backend: &dyn Backend,
        batch: Vec<(BlockingLease, Vec<u8>, u32)>,
    ) -> Vec<Result<Completed>> {
        let mut guards = Vec::with_capacity(batch.len());
        let mut writes = Vec::with_capacity(batch.len());
        let mut at = Vec::with_capacity(batch.len());
        for (i, (held, _, _)) in batch.iter().enumerate() {
            let mut l = held.slot.lease.lock();
            l.idle = true;
            if l.lost {
                l.done = true;
            } else {
                at.push(i);
            }
            guards.push(l.lease.store_mode());
        }
        for &i in &at {
            let (held, value, exptime) = &batch[i];
            writes.push(Write {
                mode: guards[i],
                key: &held.slot.key,
                value,
                flags: envelope::FLAGS,
                exptime: *exptime,
            });
        }
        let outcomes = backend.store_many(&writes);
        let mut out: Vec<Result<Completed>> = (0..batch.len())
            .map(|_| Ok(Completed::Superseded))
            .collect();
        for (&i, o) in at.iter().zip(outcomes) {
            if o.is_ok() {
                batch[i].0.slot.lease.lock().done = true;
            }
            out[i] = o.map(completed);
        }
        out
    }

    /// The derived key held.
    pub(crate) fn key(&self) -> &str {
        &self.slot.key
    }

    /// Whether the claim holds a value others are served ([`Claim::serves_others`]).
    pub(crate) fn serves_others(&self, now_ms: u64, kept_ms: u64) -> bool {
        self.slot.lease.lock().lease.serves_others(now_ms, kept_ms)
    }

    /// Gives the key back after a failed load (what dropping an unfinished lease does): a
    /// placeholder is removed, a value unclaimed, so the next caller retries at once.
    fn release_now(&self) {
        let mut l = self.slot.lease.lock();
        if l.done {
            return;
        }
        l.done = true;
        l.idle = true;
        if l.lost {
            return;
        }
        let Some(Action::StoreThenRead {
            mode,
            value,
            exptime,
        }) = l.lease.release(self.shared.now())
        else {
            return;
        };
        let backend = &*self.shared.backend;
        let key = &self.slot.key;
        let mut r = backend.store(Write::new(mode, key, &value, envelope::FLAGS, exptime));
        if r.as_ref().is_err_and(|e| !e.is_denied()) && !value.is_empty() {
            // A value the backend failed to write back (refused, `OOM`, a broken connection)
            // must not leave the claim for others to sit out: the claim is removed instead.
            if let Action::StoreThenRead {
                mode,
                value,
                exptime,
            } = removal(mode)
            {
                r = backend.store(Write::new(mode, key, &value, envelope::FLAGS, exptime));
            }
        }
        // Best effort. A fenced write the server refused (denied to this client, or a write
        // under `OOM`, which a delete is not) is a plain delete of the claim instead; after a
        // write whose outcome is unknown, the claim lapses at its deadline.
        if r.is_err_and(|e| !e.is_outcome_unknown()) {
            delete_if_claim(backend, key, mode);
        }
    }
}

/// A denied fenced write's fallback: deletes `key` if it still holds the claim `mode` was
/// fenced on (its CAS token), so that a write landed meanwhile (a `set`, an invalidation's
/// value, another process's store or claim) is not deleted with it. Not atomic: a write that
/// lands between the read and the delete is still deleted (a miss, an extra load).
fn delete_if_claim(backend: &dyn Backend, key: &str, mode: StoreMode) {
    let StoreMode::Cas(claim) = mode else { return };
    if matches!(backend.get(key), Ok(Some(item)) if item.cas == claim) {
        let _ = backend.delete(key);
    }
}

pub(crate) fn completed(outcome: StoreOutcome) -> Completed {
    match outcome {
        StoreOutcome::Stored => Completed::Stored,
        _ => Completed::Superseded,
    }
}

impl Drop for BlockingLease {
    fn drop(&mut self) {
        // A failed load, a panicking loader, or an error on the way: never leave a placeholder
        // for waiters to sit out.
        self.release_now();
        let mut st = self.shared.state.lock();
        st.held.retain(|s| !Arc::ptr_eq(s, &self.slot));
    }
}
