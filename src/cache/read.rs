//! The read path: `get` and `get_many` drive the herd protocol in `Lookup` mode (serve fresh or
//! stale values, claim a stale entry for this caller to recompute, never wait), and the one sync
//! driver of the protocol, which the loader family shares.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use crate::backend::Traced;
use bytes::Bytes;
use serde::de::DeserializeOwned;

use super::io::{Disarm, Io, ready};
use super::{Cache, DecodePolicy};
use crate::backend::{Item, StoreMode, Write};
use crate::codec::Decode;
use crate::envelope;
use crate::error::{Error, Result};
use crate::key::{Derived, KeyHash};
use crate::near::Copy;
use crate::near::fence::Ticket;
use crate::protocol::{Action, Claimed, Found, Machine, Mode, Now, Refusal, Servable, Settings};
use crate::stats::{Counters, Tally};

/// Where a sync run of the protocol stopped.
#[derive(Debug)]
pub(crate) enum Step {
    /// This caller holds the key: run the loader.
    Load(Box<Claimed>),
    /// Finished.
    Done(Found),
}

impl Cache {
    /// Runs the protocol for derived key `k` from `action` until it finishes or grants a load,
    /// on any [`Io`]: the one driver of the protocol, for both front ends. Backend failures
    /// follow the read policy: an absorbed one ends the run with what the machine can still
    /// serve (or [`Found::Unavailable`]).
    pub(crate) async fn drive_on<I: Io>(
        &self,
        io: &I,
        k: &str,
        m: &mut Machine,
        mut action: Action,
    ) -> Result<Step> {
        // Started at this call's first pause for another caller's load; counted (`waited`)
        // when the run ends, however it ends.
        let mut wait = None;
        // Armed from this call's first claim or placeholder write until the machine finishes
        // or grants the load (then the caller's lease holds the claim): a future dropped in
        // between, even during a re-read that settles ownership, gives the claim back.
        let mut guard = None;
        loop {
            action = match action {
                Action::Read => {
                    let read = io.get(k).await;
                    self.on_read(m, self.now(), read)?
                }
                Action::StoreThenRead {
                    mode,
                    value,
                    exptime,
                } => {
                    let w = Write {
                        mode,
                        key: k,
                        value: &value,
                        flags: envelope::FLAGS,
                        exptime,
                    };
                    if guard.is_none() {
                        guard = Some(io.guard_claims(vec![(k.to_string(), m.token())]));
                    }
                    let r = io.store_then_get(w).await;
                    // Refused before anything was sent (an item at the size limit has no room
                    // for a claim's header; a server without CAS takes no `cas`): the machine
                    // takes another way, except a loader, which cannot fence its store on a
                    // server without CAS and says so.
                    match r.as_ref().err().and_then(Refusal::of) {
                        Some(Refusal::NoCas) if m.mode() == Mode::Load => {
                            if let Some(g) = guard {
                                g.disarm();
                            }
                            return Err(r.err().unwrap_or_else(|| crate::backend::no_cas(None)));
                        }
                        Some(why) => m.on_refused(self.now(), why),
                        None => match self.absorb_read(r)? {
                            Some((outcome, after)) => {
                                let lost = m.races_lost();
                                let next = m.on_stored(self.now(), outcome, after);
                                if m.races_lost() > lost {
                                    tracing::debug!(
                                        "newcache: claim lost: another caller wrote the key first"
                                    );
                                }
                                next
                            }
                            None => m.on_failed(self.now()),
                        },
                    }
                }
                Action::Sleep(pause) => {
                    if wait.is_none() {
                        Counters::bump(&self.stats.lease_waits);
                        tracing::debug!("newcache: another caller is loading the key; waiting");
                        wait = Some(self.stats.wait_started());
                    }
                    io.sleep(pause).await;
                    m.on_wake(self.now())
                }
                Action::Load(claimed) => {
                    if claimed.claim.store_mode() == StoreMode::Cas(0) {
                        let e = self.without_cas(io, &[k]).await;
                        if let Some(g) = guard {
                            g.disarm();
                        }
                        return Err(e);
                    }
                    if let Some(g) = guard {
                        g.disarm();
                    }
                    tracing::debug!(
                        stale = claimed.value.is_some(),
                        "newcache: claim taken: this caller loads the key"
                    );
                    return Ok(Step::Load(claimed));
                }
                Action::Done(found) => {
                    if let Some(g) = guard {
                        g.disarm();
                    }
                    if let Found::Miss { claimed: true } = found {
                        tracing::debug!(
                            "newcache: claim taken: the stale value's reader recomputes it"
                        );
                    }
                    return Ok(Step::Done(found));
                }
            }
        }
    }

    /// This caller holds `keys` under placeholders it cannot fence: their read-back reported
    /// CAS 0 (memcached started with `-C`). They are removed with a plain `delete`, all `-C`
    /// allows (a write another client made in between goes too), so that nothing keeps other
    /// callers waiting; the call fails with the backend's own error for a `cas` it cannot send
    /// (it names the server), which nothing reaches the wire for.
    pub(crate) async fn without_cas<I: Io>(&self, io: &I, keys: &[&str]) -> Error {
        let _ = io.delete_many(keys).await;
        let probe = Write::new(StoreMode::Cas(0), keys[0], b"", envelope::FLAGS, 0);
        match io.store(probe).await {
            Err(e) if e.is_unsupported() => e,
            _ => crate::backend::no_cas(None),
        }
    }

    /// Reads a value.
    ///
    /// `None` when the key is missing, when another caller is loading it, or when this caller is
    /// the one reader that claimed a stale entry: it should recompute the value and
    /// [`set`](Cache::set) it, while every other reader keeps getting the stale value until then
    /// (at most until the soft expiry plus the herd timeout: no value is served past that).
    ///
    /// The plain `get` → `None` → `set` pattern cannot protect an invalidation: a `delete` that
    /// lands between this caller's read of the database and its `set` is overwritten. The loader
    /// API ([`get_or_set_with`](Cache::get_or_set_with)) stores with `cas` against its claim and
    /// never does.
    ///
    /// # Errors
    /// A decode error if the bytes under the key are not a `T` written by newcache (unless the
    /// decode policy is `Miss`); a backend error if the backend failed and the read failure
    /// policy is `Propagate`. An item of a newer envelope format (a newer newcache wrote it) is
    /// a counted miss, never an error.
    pub fn get<T: DeserializeOwned>(&self, key: &str) -> Result<Option<T>> {
        // A near hit without making the read's future.
        match self.near_hit::<T>(key) {
            Ok(v) => Ok(Some(v)),
            Err(kept) => {
                ready(self.get_shared(&self.blocking(), key, kept)).map(|f| f.map(|(v, _)| v))
            }
        }
    }

    #[cfg(feature = "tokio")]
    pub(crate) async fn get_on<T: Decode, I: Io>(&self, io: &I, key: &str) -> Result<Option<T>> {
        // Before the near tier is read: a future dropped at this yield did nothing.
        if self.inner.near.is_some() {
            io.cooperate().await;
        }
        match self.near_hit::<T>(key) {
            Ok(v) => Ok(Some(v)),
            Err(kept) => Ok(self.get_shared(io, key, kept).await?.map(|(v, _)| v)),
        }
    }

    /// Reads a value as a shared `Arc<T>`: what [`get`](Cache::get) returns, decoded once. With
    /// a [`near_cache`](crate::CacheBuilder::near_cache), a hit returns the `Arc` its copy
    /// keeps (the first type a key is read as is kept; another type is decoded on each read);
    /// without one, it is `get` in an `Arc`.
    ///
    /// ```
    /// # use std::{sync::Arc, time::Duration};
    /// let cache = newcache::Cache::builder().in_memory().near_cache(1 << 20).build()?;
    /// cache.set("greeting", "hello", Duration::from_secs(60))?;
    /// let first: Arc<String> = cache.get_arc("greeting")?.unwrap();
    /// let again: Arc<String> = cache.get_arc("greeting")?.unwrap();
    /// assert!(Arc::ptr_eq(&first, &again), "one decoded value, shared");
    /// # Ok::<(), newcache::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`get`](Cache::get).
    pub fn get_arc<T: DeserializeOwned + Send + Sync + 'static>(
        &self,
        key: &str,
    ) -> Result<Option<Arc<T>>> {
        match self.near_hit_arc::<T>(key) {
            Ok(v) => Ok(Some(v)),
            Err(kept) => ready(self.get_arc_shared(&self.blocking(), key, kept)),
        }
    }

    #[cfg(feature = "tokio")]
    pub(crate) async fn get_arc_on<T: DeserializeOwned + Send + Sync + 'static, I: Io>(
        &self,
        io: &I,
        key: &str,
    ) -> Result<Option<Arc<T>>> {
        if self.inner.near.is_some() {
            io.cooperate().await;
        }
        match self.near_hit_arc::<T>(key) {
            Ok(v) => Ok(Some(v)),
            Err(kept) => self.get_arc_shared(io, key, kept).await,
        }
    }

    /// `get_arc` from the shared store; the value it fills the near copy with is kept there.
    async fn get_arc_shared<T: DeserializeOwned + Send + Sync + 'static, I: Io>(
        &self,
        io: &I,
        key: &str,
        kept: Option<Arc<Copy>>,
    ) -> Result<Option<Arc<T>>> {
        let found = self.get_shared::<T, I>(io, key, kept).await?;
        Ok(found.map(|(v, filled)| {
            let v = Arc::new(v);
            if let Some((copy, charge)) = filled {
                self.near_keep(key, &copy, v.clone(), charge);
            }
            v
        }))
    }

    /// `get` from the shared store (the near tier had no hit; `kept` is the copy it still
    /// holds, served if the store does not answer): the value, and the near copy it filled
    /// with what decoding the value allocated.
    async fn get_shared<T: Decode, I: Io>(
        &self,
        io: &I,
        key: &str,
        kept: Option<Arc<Copy>>,
    ) -> Result<Option<(T, Option<(Arc<Copy>, usize)>)>> {
        let k = self.keys.make(key)?;
        let ticket = self.near_ticket(&k);
        let span = self.span("get", &k);
        async {
            let first = self
                .first_read(
                    io,
                    &k,
                    Mode::Lookup,
                    self.settings(false, io.max_value_size(&k)),
                    None,
                )
                .await;
            let (mut m, first) = match first {
                Ok((m, first, _)) => (m, first),
                Err(e) if e.is_backend() => {
                    return match self.near_outage::<T>(kept.as_ref()) {
                        Some(v) => Ok(Some((v, None))),
                        None => Err(e),
                    };
                }
                Err(e) => return Err(e),
            };
            let found = match first {
                // A fresh value is what a near copy is filled from.
                Action::Done(Found::Value { held, stale: false }) if ticket.is_some() => {
                    return match self.decode_servable_charged::<T>(&held) {
                        Ok((v, charge)) => {
                            Counters::bump(&self.stats.hits);
                            let copy = ticket.and_then(|t| self.near_fill(key, t, &held));
                            Ok(Some((v, copy.map(|c| (c, charge)))))
                        }
                        Err(e) => self.decode_failed(e).map(|v| v.map(|v| (v, None))),
                    };
                }
                Action::Done(found) => found,
                // Boxed: only a stale entry's claim gets here, and a hit's future stays small.
                action => match Box::pin(self.drive_on(io, &k, &mut m, action)).await? {
                    Step::Done(found) => found,
                    // Lookup never loads; a claimed would be a protocol bug. Report a miss.
                    Step::Load(_) => return Ok(None),
                },
            };
            if matches!(found, Found::Unavailable) {
                if let Some(v) = self.near_outage::<T>(kept.as_ref()) {
                    return Ok(Some((v, None)));
                }
            }
            Ok(self.looked_up(found)?.map(|v| (v, None)))
        }
        .traced(span)
        .await
    }

    /// Reads `k`, then starts a machine on what it found: the machine's clock and the verdict
    /// share one clock read (the hot path of every hit).
    ///
    /// With a `deadline` (the call's `max_wait`, counted from its start), the machine waits
    /// only for what is left of it after the read. The clock read is returned too.
    pub(crate) async fn first_read<I: Io>(
        &self,
        io: &I,
        k: &str,
        mode: Mode,
        settings: Settings,
        deadline: Option<Instant>,
    ) -> Result<(Machine, Action, Now)> {
        let read = io.get(k).await;
        self.start(read, mode, settings, deadline)
    }

    /// [`first_read`](Cache::first_read) once the read is back (what a backend that answers at
    /// once runs without a future: `Cache::served_now`).
    pub(crate) fn start(
        &self,
        read: Result<Option<Item>>,
        mode: Mode,
        mut settings: Settings,
        deadline: Option<Instant>,
    ) -> Result<(Machine, Action, Now)> {
        // One monotonic read serves the machine's clock and what is left of the deadline.
        let instant = Instant::now();
        let now = self.now_at(instant);
        if let Some(deadline) = deadline {
            settings.max_wait_ms = deadline.saturating_duration_since(instant).as_millis() as u64;
        }
        let mut m = Machine::new(mode, settings, self.token(), now);
        let first = self.on_read(&mut m, now, read)?;
        Ok((m, first, now))
    }

    /// Tells `m` what a read of its key found. A read refused as too large (a value over this
    /// cache's limit, which the backend discarded unread) goes to the machine, except in
    /// `Lookup` mode, where it is the caller's error; other failures follow the read policy.
    fn on_read(&self, m: &mut Machine, now: Now, read: Result<Option<Item>>) -> Result<Action> {
        if read.as_ref().is_err_and(Error::is_too_large) {
            if let Some(action) = m.on_read_too_large() {
                return Ok(action);
            }
        }
        Ok(match self.absorb_read(read)? {
            Some(item) => m.on_read(now, item),
            None => m.on_failed(now),
        })
    }

    /// What a `Lookup` found, decoded and counted.
    fn looked_up<T: Decode>(&self, found: Found) -> Result<Option<T>> {
        let s = &self.stats;
        self.looked_up_with(found, |stale| {
            Counters::bump(if stale { &s.stale_served } else { &s.hits })
        })
    }

    /// [`looked_up`](Cache::looked_up), a value served counted by `served(stale)` (a batch
    /// tallies its hits: one atomic add for the batch).
    fn looked_up_with<T: Decode>(
        &self,
        found: Found,
        served: impl FnOnce(bool),
    ) -> Result<Option<T>> {
        let s = &self.stats;
        match found {
            Found::Value { held, stale } => match self.decode_servable::<T>(&held) {
                Ok(v) => {
                    served(stale);
                    Ok(Some(v))
                }
                Err(e) => self.decode_failed(e),
            },
            Found::Miss { claimed } => {
                if claimed {
                    Counters::bump(&s.claims_won);
                }
                Counters::bump(&s.misses);
                Ok(None)
            }
            Found::Newer => {
                Counters::bump(&s.newer_format);
                Counters::bump(&s.misses);
                Ok(None)
            }
            Found::Foreign(e) => self.decode_failed(e),
            Found::Busy | Found::TimedOut | Found::Unavailable | Found::NotStorable => {
                Counters::bump(&s.misses);
                Ok(None)
            }
        }
    }

    pub(crate) fn decode_servable<T: Decode>(&self, held: &Servable) -> Result<T> {
        let value = &held.item.value;
        self.decode_payload(&held.header, value, &value[held.offset..])
    }

    /// Decodes `payload`, a slice of `item`, as the envelope's `header` says.
    pub(crate) fn decode_payload<T: Decode>(
        &self,
        header: &envelope::Header,
        item: &Bytes,
        payload: &[u8],
    ) -> Result<T> {
        let how = header.payload();
        T::decode_payload(&self.inner.config.format, header.codec, how, item, payload)
    }

    /// A key of a batch that failed on its own (not its server): left out of the answer as a
    /// miss, and logged, so that the other keys are still served.
    pub(crate) fn batch_key_failed(&self, e: &Error) {
        Counters::bump(&self.stats.misses);
        tracing::debug!(error = %e, "newcache: a key of a batch failed alone; it is left out");
    }

    /// Applies the decode policy: the error, or a counted miss.
    pub(crate) fn decode_failed<T>(&self, e: Error) -> Result<Option<T>> {
        Counters::bump(&self.stats.decode_errors);
        match self.inner.config.decode_policy {
            DecodePolicy::Error => Err(e),
            DecodePolicy::Miss => {
                Counters::bump(&self.stats.misses);
                Ok(None)
            }
        }
    }

    /// Reads several values in one round trip per server.
    ///
    /// The map is keyed by the caller's keys. Missing keys are left out, and so are keys being
    /// loaded by another caller and stale keys that this caller claimed (exactly as
    /// [`get`](Cache::get) reports them as `None`): the caller recomputes what is absent.
    ///
    /// ```
    /// # let cache = newcache::Cache::builder().build()?;
    /// cache.set("a", &1u32, std::time::Duration::from_secs(60))?;
    /// let found = cache.get_many::<u32>(&["a", "b"])?;
    /// assert_eq!(found.get("a"), Some(&1));
    /// assert!(!found.contains_key("b"));
    /// # Ok::<(), newcache::Error>(())
    /// ```
    ///
    /// # Errors
    /// With the default read policy ([`FailurePolicy::Absorb`](crate::FailurePolicy)), a key
    /// whose server failed is left out like a miss, and the keys of the live servers are
    /// returned: one dead server costs only its own keys. With `Propagate`, such a partial batch
    /// is an error naming the failed keys ([`Error::failed_keys`]).
    ///
    /// A key whose bytes do not decode as a `T` (another client's, another type's) is left out
    /// and counted in [`Stats::decode_errors`](crate::Stats::decode_errors), whatever the decode
    /// policy: one key never fails the others ([`get`](Cache::get) of that key returns the
    /// error).
    pub fn get_many<T: DeserializeOwned>(
        &self,
        keys: &[impl AsRef<str>],
    ) -> Result<HashMap<String, T>> {
        ready(self.get_many_on(&self.blocking(), keys))
    }

    pub(crate) async fn get_many_on<T: DeserializeOwned, I: Io>(
        &self,
        io: &I,
        keys: &[impl AsRef<str>],
    ) -> Result<HashMap<String, T>> {
        let span = self.batch_span("get_many", keys.len());
        async {
            let mut out = HashMap::with_capacity(keys.len());
            if self.inner.near.is_none() {
                self.get_many_shared(io, keys, Vec::new(), &mut out).await?;
                return Ok(out);
            }
            // Near hits first; the rest in one batch.
            let mut rest = Vec::new();
            let mut kept = Vec::new();
            io.cooperate().await;
            for k in keys {
                // A key asked for twice is read (and counted) once, as the shared read does.
                if out.contains_key(k.as_ref()) {
                    continue;
                }
                match self.near_hit::<T>(k.as_ref()) {
                    Ok(v) => {
                        out.insert(k.as_ref().to_string(), v);
                    }
                    Err(copy) => {
                        rest.push(k.as_ref());
                        kept.push(copy);
                    }
                }
            }
            if !rest.is_empty() {
                self.get_many_shared(io, &rest, kept, &mut out).await?;
            }
            Ok(out)
        }
        .traced(span)
        .await
    }

    /// `get_many` of `keys` from the shared store into `out`; `kept`: each key's near copy
    /// (served if its read fails), or empty without a near tier.
    async fn get_many_shared<T: DeserializeOwned, I: Io>(
        &self,
        io: &I,
        keys: &[impl AsRef<str>],
        kept: Vec<Option<Arc<Copy>>>,
        out: &mut HashMap<String, T>,
    ) -> Result<()> {
        {
            let (derived, fetched, tickets) = self.read_many_ticketed(io, keys).await?;
            // One clock read, and one set of settings, for the batch.
            let now = self.now();
            let mut settings = self.settings(false, 0);
            let (mut hits, mut stale_served) = (
                Tally::new(&self.stats.hits),
                Tally::new(&self.stats.stale_served),
            );
            for (i, (user_key, fetched)) in keys.iter().zip(fetched).enumerate() {
                let user_key = user_key.as_ref();
                let item = match fetched {
                    Fetched::Item(item) => item,
                    Fetched::Failed => {
                        let copy = kept.get(i).and_then(Option::as_ref);
                        if let Some(v) = self.near_outage::<T>(copy) {
                            out.insert(user_key.to_string(), v);
                        }
                        continue;
                    }
                    Fetched::Missing | Fetched::Duplicate => continue,
                };
                let k = derived.get(i);
                settings.max_value = io.max_value_size(k);
                let mut m = Machine::new(Mode::Lookup, settings, self.token(), now);
                let first = m.on_read(now, Some(item));
                let found = match first {
                    Action::Done(Found::Value { held, stale: false })
                        if tickets.get(i).is_some_and(Option::is_some) =>
                    {
                        match self.decode_servable::<T>(&held) {
                            Ok(v) => {
                                hits.bump();
                                if let Some(t) = tickets[i] {
                                    self.near_fill(user_key, t, &held);
                                }
                                out.insert(user_key.to_string(), v);
                            }
                            // Undecodable (counted in `decode_errors`): this key alone is left
                            // out.
                            Err(e) => {
                                let _ = self.decode_failed::<T>(e);
                            }
                        }
                        continue;
                    }
                    Action::Done(found) => found,
                    action => match self.drive_on(io, k, &mut m, action).await {
                        Ok(Step::Done(found)) => found,
                        Ok(Step::Load(_)) => continue,
                        // A failed server under `Propagate` fails the batch, as a failed read
                        // does; any other failure is this key's alone: a counted miss.
                        Err(e) if e.is_backend() => return Err(e),
                        Err(e) => {
                            self.batch_key_failed(&e);
                            continue;
                        }
                    },
                };
                let served = |stale| match stale {
                    true => stale_served.bump(),
                    false => hits.bump(),
                };
                match self.looked_up_with(found, served) {
                    Ok(Some(v)) => {
                        out.insert(user_key.to_string(), v);
                    }
                    Ok(None) => {}
                    // Undecodable (counted in `decode_errors`): this key alone is left out.
                    Err(e) if e.is_decode() => {}
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        }
    }

    /// Derives every key and reads them in one round trip per server, under the read failure
    /// policy. A key asked for twice is read (and judged) once: its later positions are
    /// [`Fetched::Duplicate`], so that one caller never claims a key twice. Missing and failed
    /// keys are counted as misses here.
    pub(crate) async fn read_many<I: Io>(
        &self,
        io: &I,
        keys: &[impl AsRef<str>],
    ) -> Result<(Derived, Vec<Fetched>)> {
        let (derived, fetched, _) = self.read_many_ticketed(io, keys).await?;
        Ok((derived, fetched))
    }

    /// [`read_many`](Cache::read_many), and with a near tier each key's ticket, taken before
    /// the batch was sent (empty without one).
    async fn read_many_ticketed<I: Io>(
        &self,
        io: &I,
        keys: &[impl AsRef<str>],
    ) -> Result<(Derived, Vec<Fetched>, Vec<Option<Ticket>>)> {
        let derived = self.keys.make_all(keys)?;
        let refs = derived.refs();
        let tickets: Vec<Option<Ticket>> = match self.inner.near {
            Some(_) => refs.iter().map(|k| self.near_ticket(k)).collect(),
            None => Vec::new(),
        };
        let results = io.get_many(&refs).await;
        let read = self.absorb_each(results, self.inner.config.read_failures, |i| {
            keys[i].as_ref().to_string()
        })?;
        let mut seen = HashSet::with_capacity_and_hasher(refs.len(), KeyHash::for_keys(&self.keys));
        // Mapped in place, as `absorb_each` is (one buffer for the batch's items).
        let fetched = read
            .into_iter()
            .zip(&refs)
            .map(|(r, k)| {
                if !seen.insert(*k) {
                    return Fetched::Duplicate;
                }
                match r {
                    Some(Some(item)) => Fetched::Item(item),
                    Some(None) => {
                        Counters::bump(&self.stats.misses);
                        Fetched::Missing
                    }
                    None => {
                        Counters::bump(&self.stats.misses);
                        Fetched::Failed
                    }
                }
            })
            .collect();
        drop(refs);
        Ok((derived, fetched, tickets))
    }
}

/// What a batch read found under one key.
#[derive(Debug)]
pub(crate) enum Fetched {
    /// The key's item.
    Item(Item),
    /// Nothing under the key.
    Missing,
    /// The key's server failed (and the read policy absorbed it).
    Failed,
    /// The key was asked for earlier in the same batch.
    Duplicate,
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::testing::MockClock;

    #[test]
    fn a_batch_counts_each_hit_and_stale_value_it_served() {
        let clock = MockClock::new();
        let cache = crate::Cache::builder()
            .in_memory()
            .clock(clock.clone())
            .build()
            .unwrap();
        let s = Duration::from_secs;
        cache.set("old", &1u8, s(10)).unwrap();
        clock.advance(s(10));
        // Claimed by this `get`: the batch below is served the stale value.
        assert_eq!(cache.get::<u8>("old").unwrap(), None);
        for k in ["a", "b", "c"] {
            cache.set(k, &2u8, s(10)).unwrap();
        }
        let before = cache.stats();
        for _ in 0..2 {
            let found = cache
                .get_many::<u8>(&["a", "old", "b", "gone", "c", "a"])
                .unwrap();
            assert_eq!(found.len(), 4, "{found:?}");
        }
        let after = cache.stats();
        assert_eq!(
            (
                after.hits - before.hits,
                after.stale_served - before.stale_served,
                after.misses - before.misses,
            ),
            // per batch: a, b, c fresh (the second "a" is the same key, read once), "old"
            // stale, "gone" missing
            (6, 2, 2),
        );
    }
}
