//! `get_many_or_set_with`: the herd protocol for many keys at once, in `Batch` mode. Every round
//! of claims and placeholders is one pipelined write and one multi-key read per server; the
//! loader runs once, for every key this caller must compute; what it returns is stored with `cas`
//! against this caller's claims in one more round trip.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;

use crate::backend::Traced;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::driver::{Driver, LeaseHandle};
use super::lease::Completed;
use super::load_ms;
use crate::backend::{StoreMode, StoreOutcome, Write};
use crate::cache::io::{Disarm, ready};
use crate::cache::read::Fetched;
use crate::cache::{Cache, DecodePolicy, Herd};
use crate::envelope;
use crate::error::{Error, LoadError, Result};
use crate::protocol::{Action, Found, Machine, Mode, Refusal};
use crate::stats::Counters;
use crate::ttl::{Lifetime, Ttl};

/// Rounds of claims before a batch gives up on the keys still contended (they are then loaded
/// without a claim, and not stored).
const MAX_ROUNDS: usize = 8;

/// One key of a batch, while its machine runs.
struct Pending {
    /// The caller's key.
    key: String,
    derived: String,
    machine: Machine,
    action: Action,
}

impl Cache {
    /// The batch form of [`get_or_set_with`](Cache::get_or_set_with): one backend round trip (per
    /// server) for the reads, one round of claims for the keys that are missing or stale, one
    /// loader call with every key this caller must compute, and one batched `cas` of what the
    /// loader returned.
    ///
    /// The loader receives the caller's keys it must compute and returns a map from those keys to
    /// values; keys it leaves out are absent from the result (and not cached).
    ///
    /// Keys are claimed as in `get_or_set_with` (a stale key by `cas`, a missing one by a
    /// placeholder), so a `delete` or `set` that lands while the loader runs is never overwritten.
    /// A batch never waits: a key that another caller is loading is loaded by this batch too, and
    /// returned, but not stored. Batches are not coalesced in-process.
    ///
    /// # Errors
    /// As [`get_or_set_with`](Cache::get_or_set_with): the loader's error is
    /// [`LoadError::Loader`] (batches are not coalesced, so it is always this caller's
    /// loader's). If the loader fails, a batch that held stale values for every key it had to
    /// compute returns them when
    /// [`serve_stale_on_error`](crate::CacheBuilder::serve_stale_on_error) allows.
    pub fn get_many_or_set_with<T, K, F, E>(
        &self,
        keys: &[K],
        ttl: impl Into<Ttl>,
        loader: F,
    ) -> Result<HashMap<String, T>, LoadError<E>>
    where
        T: Serialize + DeserializeOwned,
        K: AsRef<str>,
        F: FnOnce(&[String]) -> std::result::Result<HashMap<String, T>, E>,
        E: std::error::Error + Send + Sync + 'static,
    {
        let loader = |keys: &[String]| {
            std::future::ready(loader(keys).map_err(|e| Error::loader(Arc::new(e))))
        };
        ready(self.many_or_set_on(&self.blocking(), keys, ttl.into(), loader))
            .map_err(LoadError::from_error)
    }

    /// `get_many_or_set_with` on any front end. `loader` is called once, with the keys to
    /// compute, while every claim is kept alive.
    pub(crate) async fn many_or_set_on<T, K, D, L, Fut>(
        &self,
        d: &D,
        keys: &[K],
        ttl: Ttl,
        loader: L,
    ) -> Result<HashMap<String, T>>
    where
        T: Serialize + DeserializeOwned,
        K: AsRef<str>,
        D: Driver,
        L: FnOnce(&[String]) -> Fut,
        Fut: Future<Output = Result<HashMap<String, T>>>,
    {
        let span = self.batch_span("get_many_or_set_with", keys.len());
        async {
            let s = &self.stats;
            let (derived, fetched) = self.read_many(d, keys).await?;
            let mut out = HashMap::with_capacity(keys.len());
            // The keys to load, each once and in the caller's order, and the claims held on them.
            let mut wanted: Vec<String> = Vec::new();
            let mut leases: HashMap<String, D::Lease> = HashMap::new();
            let mut held: HashMap<String, (T, u64)> = HashMap::new();
            let now = self.now();
            let mut pending = Vec::new();
            for (i, (user_key, fetched)) in keys.iter().zip(fetched).enumerate() {
                let limit = d.max_value_size(derived.get(i));
                let d = derived.get(i);
                let item = match fetched {
                    Fetched::Duplicate => continue,
                    // Its server failed: load it without a claim (the result cannot be stored).
                    Fetched::Failed => {
                        wanted.push(user_key.as_ref().to_string());
                        continue;
                    }
                    Fetched::Missing => None,
                    Fetched::Item(item) => Some(item),
                };
                let settings = self.settings(true, limit);
                let mut machine = Machine::new(Mode::Batch, settings, self.token(), now);
                let action = machine.on_read(now, item);
                pending.push(Pending {
                    key: user_key.as_ref().to_string(),
                    derived: d.to_string(),
                    machine,
                    action,
                });
            }
            // Keys held under placeholders a server without CAS cannot fence (memcached -C).
            let mut unfenced: Vec<(String, String)> = Vec::new();
            for _ in 0..MAX_ROUNDS {
                if pending.is_empty() {
                    break;
                }
                let mut writing = Vec::new();
                for mut p in pending.drain(..) {
                    let action = std::mem::replace(&mut p.action, Action::Read);
                    match action {
                        Action::StoreThenRead { .. } => {
                            p.action = action;
                            writing.push(p);
                        }
                        Action::Load(claimed)
                            if claimed.claim.store_mode() == StoreMode::Cas(0) =>
                        {
                            unfenced.push((p.key, p.derived));
                        }
                        Action::Load(claimed) => {
                            if let Some(h) = &claimed.value {
                                if claimed.claim.is_claim() {
                                    Counters::bump(&s.claims_won);
                                }
                                if let Ok(v) = self.decode_servable::<T>(h) {
                                    held.insert(p.key.clone(), (v, h.header.written_ms));
                                }
                            }
                            leases.insert(p.key.clone(), d.hold(self, &p.derived, claimed.claim));
                            wanted.push(p.key);
                        }
                        Action::Done(found) => {
                            match found {
                                Found::Value { held, stale } => {
                                    match self.decode_servable::<T>(&held) {
                                        Ok(v) => {
                                            Counters::bump(if stale {
                                                &s.stale_served
                                            } else {
                                                &s.hits
                                            });
                                            out.insert(p.key, v);
                                        }
                                        Err(e) => self.undecodable(e, p, &mut writing, &mut wanted),
                                    }
                                }
                                Found::Foreign(e) => {
                                    self.undecodable(e, p, &mut writing, &mut wanted)
                                }
                                // The last load's value could not be stored: load it, unstored.
                                Found::NotStorable => {
                                    Counters::bump(&s.misses);
                                    Counters::bump(&s.not_storable_loads);
                                    wanted.push(p.key);
                                }
                                // Someone else is loading it, or the backend failed: load, don't store.
                                Found::Busy
                                | Found::Unavailable
                                | Found::Miss { .. }
                                | Found::Newer
                                | Found::TimedOut => {
                                    Counters::bump(&s.misses);
                                    wanted.push(p.key);
                                }
                            }
                        }
                        // A read to settle whether a write landed: done with this round's writes.
                        Action::Read => {
                            p.action = Action::Read;
                            writing.push(p);
                        }
                        // Batches never sleep.
                        Action::Sleep(_) => wanted.push(p.key),
                    }
                }
                pending = self.write_round(d, writing).await?;
            }
            if !unfenced.is_empty() {
                // A server without CAS: those keys are loaded and not stored (nothing could
                // fence their store), as a failed server's keys are; the batch's others go on.
                let keys: Vec<&str> = unfenced.iter().map(|p| p.1.as_str()).collect();
                let e = self.without_cas(d, &keys).await;
                self.no_cas_in_batch(&e);
                wanted.extend(unfenced.into_iter().map(|p| p.0));
            }
            // Keys still contended after every round: load them, don't store them.
            wanted.extend(pending.into_iter().map(|p| p.key));
            if wanted.is_empty() {
                return Ok(out);
            }
            let load = s.load_started();
            let call = load.run(|| loader(&wanted));
            let loaded = d.renewing_all(&mut leases, call).await;
            let started = load.started();
            load.finished(loaded.is_ok());
            let mut loaded = match loaded {
                Ok(m) => m,
                Err(e) => {
                    // Dropping the leases gives the keys back.
                    drop(leases);
                    let all_held = wanted
                        .iter()
                        .all(|k| held.get(k).is_some_and(|(_, w)| self.young_enough(*w)));
                    if all_held {
                        for (k, (v, _)) in held {
                            Counters::bump(&s.stale_on_error);
                            out.insert(k, v);
                        }
                        return Ok(out);
                    }
                    return Err(e);
                }
            };
            let life = ttl.resolve(self.inner.config.default_ttl);
            let mut batch = Vec::new();
            let mut names = Vec::new();
            for k in &wanted {
                let (Some(v), Some(lease)) = (loaded.get(k), leases.remove(k)) else {
                    continue;
                };
                if life == Lifetime::Expired {
                    continue; // dropping the lease removes the placeholder
                }
                let limit = d.max_value_size(lease.key());
                let (bytes, exptime) = match self.encode(v, life, Herd::Protected, load_ms(started))
                {
                    Ok(encoded) if self.check_room(&encoded.0, limit).is_ok() => encoded,
                    Ok((bytes, _)) => {
                        self.loaded_too_large(lease.key(), k, bytes.len());
                        self.too_large_marker(&lease, life)
                    }
                    Err(e) if e.is_too_large() => {
                        self.loaded_too_large(lease.key(), k, 0);
                        self.too_large_marker(&lease, life)
                    }
                    Err(e) => return Err(e),
                };
                // Too large over a stale value others are served: dropping the lease gives
                // it back unclaimed (as `get_or_set_with` does).
                if bytes.is_empty() {
                    continue;
                }
                names.push((k.as_str(), lease.key().to_string()));
                batch.push((lease, bytes, exptime));
            }
            // Leases of keys the loader left out are dropped here (their placeholders go).
            drop(leases);
            if !batch.is_empty() {
                // A value whose write failed is still returned, as `get_or_set_with` returns it: the
                // failure is counted (and its claim released, or left to lapse), never the result.
                let done = d.complete_many(batch).await;
                let mut failed: Vec<Error> = Vec::new();
                for (c, (name, derived)) in done.into_iter().zip(&names) {
                    match c {
                        Ok(Completed::Stored) => {}
                        Ok(Completed::Superseded) => Counters::bump(&s.loads_superseded),
                        Err(e) if e.is_too_large() => self.loaded_too_large(derived, name, 0),
                        Err(e) => {
                            if !failed.iter().any(|f| f.server() == e.server()) {
                                failed.push(e);
                            }
                        }
                    }
                }
                // A failed batch counts once, as everywhere (and once per failed server in
                // the per-server metric).
                if !failed.is_empty() {
                    s.batch_failed(&failed);
                    if let Some(e) = failed.iter().find(|e| e.is_backend()) {
                        s.absorbed(e);
                    }
                }
            }
            let wanted: HashSet<String> = wanted.into_iter().collect();
            out.extend(loaded.drain().filter(|(k, _)| wanted.contains(k)));
            Ok(out)
        }
        .traced(span)
        .await
    }

    /// What a batch stores for a value too large to store: a "not storable" marker, or
    /// nothing (empty bytes) when the claim holds a stale value others are served.
    fn too_large_marker<C: LeaseHandle>(&self, lease: &C, life: Lifetime) -> (Vec<u8>, u32) {
        if lease.serves_others(self.now_ms(), self.kept_ms()) {
            return (Vec::new(), 0);
        }
        self.not_storable_marker(life)
    }

    /// A batch key on a server without CAS (memcached `-C`): loaded and not stored. Counted
    /// as a backend error of that server, and logged once per cache (the single-key loader
    /// fails with this error instead).
    fn no_cas_in_batch(&self, e: &Error) {
        self.stats.backend_error(e);
        if !self
            .inner
            .warned_no_cas
            .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            tracing::warn!(error = %e, "newcache: a batch's keys are loaded but not stored (logged once)");
        }
    }

    /// A key whose bytes do not decode: under `DecodePolicy::Miss` it is taken over; under
    /// `Error` it is loaded without a claim and not stored over the bytes (which `get` of that
    /// key reports), so that one key never fails the batch's others.
    fn undecodable(
        &self,
        e: Error,
        mut p: Pending,
        writing: &mut Vec<Pending>,
        wanted: &mut Vec<String>,
    ) {
        Counters::bump(&self.stats.decode_errors);
        match self.inner.config.decode_policy {
            DecodePolicy::Error => {
                tracing::debug!(error = %e, "newcache: a batch key does not decode; loaded, not stored");
                wanted.push(p.key);
            }
            DecodePolicy::Miss => {
                p.action = p.machine.take_over(self.now());
                writing.push(p);
            }
        }
    }

    /// One round: every pending write in one pipelined batch, then every written key read back
    /// (with the keys that only need a read) in one multi-key read; each machine is told what
    /// happened.
    async fn write_round<D: Driver>(
        &self,
        d: &D,
        mut writing: Vec<Pending>,
    ) -> Result<Vec<Pending>> {
        let (writes_at, reads_at): (Vec<_>, Vec<_>) = writing
            .drain(..)
            .partition(|p| matches!(p.action, Action::StoreThenRead { .. }));
        let mut next = Vec::new();
        let writes: Vec<Write<'_>> = writes_at
            .iter()
            .filter_map(|p| match &p.action {
                Action::StoreThenRead {
                    mode,
                    value,
                    exptime,
                } => Some(Write {
                    mode: *mode,
                    key: &p.derived,
                    value,
                    flags: envelope::FLAGS,
                    exptime: *exptime,
                }),
                _ => None,
            })
            .collect();
        let policy = self.inner.config.read_failures;
        let mut guard_until_read = None;
        let mut refusals: Vec<Option<Refusal>> = vec![None; writes_at.len()];
        let stored = if writes.is_empty() {
            Vec::new()
        } else {
            let guard = d.guard_claims(
                writes_at
                    .iter()
                    .map(|p| (p.derived.clone(), p.machine.token()))
                    .collect(),
            );
            let mut results = d.store_many(&writes).await;
            guard_until_read = Some(guard);
            // Refused before anything was sent (an item at the size limit has no room for a
            // claim's header; a server without CAS takes no `cas`): that machine takes another
            // way, and the batch's other keys go on.
            for (r, refused) in results.iter_mut().zip(&mut refusals) {
                if let Some(why) = r.as_ref().err().and_then(Refusal::of) {
                    if why == Refusal::NoCas {
                        if let Err(e) = r {
                            self.no_cas_in_batch(e);
                        }
                    }
                    *refused = Some(why);
                    *r = Ok(StoreOutcome::NotStored);
                }
            }
            self.absorb_each(results, policy, |i| writes_at[i].key.clone())?
        };
        drop(writes);
        // Read back even when the writes failed: some may have landed, and a machine that finds
        // its token holds the key (and releases it).
        let all: Vec<&Pending> = writes_at.iter().chain(&reads_at).collect();
        let keys: Vec<&str> = all.iter().map(|p| p.derived.as_str()).collect();
        let read_back = d.get_many(&keys).await;
        // The read-back tells each machine whether its claim landed: from here on a claim that
        // did is held (and released on drop) by its lease.
        if let Some(guard) = guard_until_read {
            guard.disarm();
        }
        let after = self.absorb_each(read_back, policy, |i| all[i].key.clone())?;
        drop(all);
        let now = self.now();
        let mut items = after.into_iter();
        let mut outcomes = stored.into_iter();
        for (mut p, refused) in writes_at.into_iter().zip(refusals) {
            let item = items.next().flatten();
            let outcome = outcomes.next().flatten();
            if let Some(why) = refused {
                p.action = p.machine.on_refused(now, why);
                next.push(p);
                continue;
            }
            p.action = match (outcome, item) {
                (Some(o), Some(item)) => p.machine.on_stored(now, o, item),
                (None, Some(item)) => p.machine.on_read(now, item),
                (_, None) => p.machine.on_failed(now),
            };
            next.push(p);
        }
        for mut p in reads_at {
            let item = items.next().flatten();
            p.action = match item {
                Some(item) => p.machine.on_read(now, item),
                None => p.machine.on_failed(now),
            };
            next.push(p);
        }
        Ok(next)
    }
}
