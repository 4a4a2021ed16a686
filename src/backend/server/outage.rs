//! What a server missed while this process could not reach it: the keys it invalidated there
//! (deleted, wrote to another server instead, failed to write), deleted on that server before it
//! serves this process again ("replayed", through the replay gate of `replay.rs`). Held in a
//! server's health record: shared by memcached's blocking pool and async engine, and by the
//! Redis backend's two views.
//!
//! Only deletes are replayed: re-sending a write could overwrite a newer one another process made
//! after the server came back. The record is bounded ([`Missed::note`] refuses keys past its
//! capacity); a key it could not hold is not lost either: from then on, values of that server's
//! keys written before the refusal are judged stale when read ([`Missed::stale_before_ms`],
//! applied by [`distrust`]).

use std::collections::HashMap;
use std::fmt;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::{Condvar, Mutex};

use super::{is_server_reply, leaves_connection_usable};
use crate::backend::Item;
use crate::clock::Clock;
use crate::envelope;
use crate::error::{Error, Result};

/// Whether a key was recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Noted {
    /// Recorded (or already recorded): deleted there before the server serves again.
    Queued,
    /// The record is full: the server's older values are judged stale instead.
    Full,
}

/// One server's record of missed invalidations.
#[derive(Default)]
pub(crate) struct Missed {
    /// Some key is recorded, or a replay is in flight: a caller that sees it replays, or waits
    /// for the replay, before anything else on the server (one load, no lock, when clear).
    pending: AtomicBool,
    /// A caller holds the replay ([`Missed::begin`]); the others wait for it to end.
    replaying: AtomicBool,
    /// Ms (on the cache's clock) before which this server's values are judged stale (0: none):
    /// the latest time a key did not fit the record.
    stale_before_ms: AtomicU64,
    /// Each recorded key, with the other servers that may hold a copy written while this one was
    /// out (`DeadServerPolicy::Remap`).
    keys: Mutex<HashMap<Box<str>, Vec<usize>>>,
    /// The cache's clock (the one its values' write times are on); the system's until set.
    clock: OnceLock<Arc<dyn Clock>>,
    /// Wakes the blocking callers waiting for a replay to end.
    ended: Condvar,
    ended_lock: Mutex<()>,
    /// Wakes the tasks waiting for a replay to end.
    #[cfg(feature = "tokio")]
    ended_tasks: tokio::sync::Notify,
    /// Deletes replayed on this server.
    pub(crate) replayed: AtomicU64,
    /// Keys the record could not hold.
    pub(crate) overflowed: AtomicU64,
    /// Replays that failed part way (their keys kept for the next one).
    pub(crate) incomplete: AtomicU64,
}

impl fmt::Debug for Missed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Missed")
            .field("pending", &self.pending())
            .field("stale_before_ms", &self.stale_before_ms())
            .finish_non_exhaustive()
    }
}

/// The keys taken for one replay.
pub(crate) type Taken = Vec<(Box<str>, Vec<usize>)>;

fn unix_now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// What a caller about to use a server must do first ([`Missed::begin`]).
pub(crate) enum Begin<M: Deref<Target = Missed>> {
    /// Nothing to replay: go on.
    Clear,
    /// Delete these keys there first, then settle the replay ([`Replay::done`] or
    /// [`Replay::failed`]; dropped unsettled, it gives the keys back).
    Mine(Replay<M>),
    /// Another caller is replaying: wait for it ([`Missed::wait`], [`Missed::wait_async`]).
    Busy,
}

/// One caller's replay of a record: the keys it took. Ends the replay when dropped (other
/// callers go on), giving the keys back unless it was settled.
pub(crate) struct Replay<M: Deref<Target = Missed>> {
    missed: M,
    taken: Taken,
    settled: bool,
}

impl Missed {
    /// Puts this record's time stamps on the cache's `clock` (the one its values' write times
    /// are on). Once; later calls are ignored.
    pub(crate) fn use_clock(&self, clock: Arc<dyn Clock>) {
        let _ = self.clock.set(clock);
    }

    fn now_ms(&self) -> u64 {
        self.clock.get().map_or_else(unix_now_ms, |c| c.now_ms())
    }

    /// Records `key` (latest wins: a key is held once), and `elsewhere`, a server that may hold
    /// a copy of it written while this one was out.
    pub(crate) fn note(&self, key: &str, elsewhere: Option<usize>, capacity: usize) -> Noted {
        let mut keys = self.keys.lock();
        if let Some(copies) = keys.get_mut(key) {
            add(copies, elsewhere);
        } else if keys.len() < capacity {
            let mut copies = Vec::new();
            add(&mut copies, elsewhere);
            keys.insert(key.into(), copies);
        } else {
            drop(keys);
            self.overflow();
            return Noted::Full;
        }
        self.pending.store(true, Ordering::Release);
        Noted::Queued
    }

    /// A key did not fit: this server's values from before now are judged stale.
    fn overflow(&self) {
        let first = self.overflowed.fetch_add(1, Ordering::Relaxed) == 0;
        self.stale_before_ms
            .fetch_max(self.now_ms(), Ordering::AcqRel);
        if first {
            tracing::warn!(
                "newcache: a server's record of missed invalidations is full \
                 (replay_capacity); values it holds from before now are judged stale"
            );
        }
    }

    /// Whether some key waits to be replayed, or a replay is in flight.
    pub(crate) fn pending(&self) -> bool {
        self.pending.load(Ordering::Acquire)
    }

    /// What a caller about to use the server must do first: nothing, replay the keys it takes
    /// (through `handle`, this record), or wait for the caller replaying them.
    pub(crate) fn begin<M: Deref<Target = Missed>>(handle: M) -> Begin<M> {
        if !handle.pending() {
            return Begin::Clear;
        }
        if handle
            .replaying
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Begin::Busy;
        }
        let taken: Taken = handle.keys.lock().drain().collect();
        let replay = Replay {
            missed: handle,
            taken,
            settled: false,
        };
        if replay.taken.is_empty() {
            // Another caller's replay ended between the two loads.
            drop(replay);
            return Begin::Clear;
        }
        Begin::Mine(replay)
    }

    /// Blocks until no replay is in flight, or `timeout` passes: `true` if none is.
    pub(crate) fn wait(&self, timeout: Duration) -> bool {
        let until = Instant::now() + timeout;
        let mut g = self.ended_lock.lock();
        while self.replaying.load(Ordering::Acquire) {
            if self.ended.wait_until(&mut g, until).timed_out() {
                return !self.replaying.load(Ordering::Acquire);
            }
        }
        true
    }

    /// [`wait`](Missed::wait), awaited.
    #[cfg(feature = "tokio")]
    pub(crate) async fn wait_async(&self, timeout: Duration) -> bool {
        let ended = self.ended_tasks.notified();
        tokio::pin!(ended);
        ended.as_mut().enable();
        if !self.replaying.load(Ordering::Acquire) {
            return true;
        }
        let _ = tokio::time::timeout(timeout, ended).await;
        !self.replaying.load(Ordering::Acquire)
    }

    /// Records again keys a replay could not delete (within the capacity).
    fn restore(&self, taken: Taken, capacity: usize) {
        self.incomplete.fetch_add(1, Ordering::Relaxed);
        for (key, copies) in taken {
            if copies.is_empty() {
                self.note(&key, None, capacity);
            }
            for c in copies {
                self.note(&key, Some(c), capacity);
            }
        }
    }

    /// Ends a replay: clear unless keys were recorded meanwhile (or given back); wakes waiters.
    fn end(&self) {
        {
            let keys = self.keys.lock();
            self.pending.store(!keys.is_empty(), Ordering::Release);
            self.replaying.store(false, Ordering::Release);
        }
        drop(self.ended_lock.lock());
        self.ended.notify_all();
        #[cfg(feature = "tokio")]
        self.ended_tasks.notify_waiters();
    }

    /// Ms (on the cache's clock) before which this server's values are judged stale (0: never).
    pub(crate) fn stale_before_ms(&self) -> u64 {
        self.stale_before_ms.load(Ordering::Acquire)
    }
}

impl<M: Deref<Target = Missed>> Replay<M> {
    /// The keys to delete.
    pub(crate) fn keys(&self) -> impl Iterator<Item = &str> {
        self.taken.iter().map(|(k, _)| &**k)
    }

    /// The keys were deleted on the server at `addr`, but for `refused` of them, whose delete
    /// it refused with an error reply (passed over): counts those deleted, and hands each copy
    /// written elsewhere on to that server's record (`other(j)`: server `j`'s, if it is
    /// another); a copy that does not fit there makes this server's older values stale instead.
    pub(crate) fn done<'a>(
        mut self,
        addr: &str,
        refused: usize,
        other: impl Fn(usize) -> Option<&'a Missed>,
        capacity: usize,
    ) {
        self.settled = true;
        let missed = &*self.missed;
        let deleted = self.taken.len().saturating_sub(refused);
        missed.replayed.fetch_add(deleted as u64, Ordering::Relaxed);
        for (key, copies) in &self.taken {
            for &j in copies {
                if let Some(there) = other(j) {
                    if there.note(key, None, capacity) == Noted::Full {
                        missed.overflow();
                    }
                }
            }
        }
        tracing::info!(
            server = %addr,
            deletes = deleted,
            refused,
            "newcache: replayed the invalidations a server missed while out of reach"
        );
    }

    /// The replay on the server at `addr` failed with `e`: its keys are recorded again, for the
    /// next attempt; warns.
    pub(crate) fn failed(mut self, addr: &str, e: &Error, capacity: usize) {
        self.settled = true;
        tracing::warn!(
            server = %addr,
            error = %e,
            deletes = self.taken.len(),
            "newcache: could not replay the invalidations a server missed; \
             kept for the next attempt (this process reads nothing there before)"
        );
        let taken = std::mem::take(&mut self.taken);
        self.missed.restore(taken, capacity);
    }
}

impl<M: Deref<Target = Missed>> Drop for Replay<M> {
    fn drop(&mut self) {
        if !self.settled && !self.taken.is_empty() {
            // Dropped mid-way (a cancelled future, a task whose runtime shut down): the keys
            // are kept. Unbounded here: they were in the record a moment ago.
            let taken = std::mem::take(&mut self.taken);
            self.missed.restore(taken, usize::MAX);
        }
        self.missed.end();
    }
}

/// Whether a delete's failure `e` leaves the key as it was and the connection usable (an error
/// reply: twemproxy's `SERVER_ERROR` for a backend it ejected): the replay goes on without that
/// key (an outage behind the proxy is the proxy's) instead of failing every call.
pub(crate) fn refused(e: &Error) -> bool {
    is_server_reply(e) && leaves_connection_usable(e)
}

/// Whether a write that failed with `e` may have missed its server (a transport fault, a
/// server marked dead, an unknown outcome), rather than been refused by it or before sending.
pub(crate) fn missed_by(e: &Error) -> bool {
    (e.is_backend() || e.is_timeout()) && !is_server_reply(e) && !e.is_unsupported()
}

/// What a write to `key` leaves on its home server's record `home`: a copy written `elsewhere`
/// is recorded (again: the home may have come back, and replayed, before it landed); a write
/// the home may have missed is recorded, and its error says so.
pub(crate) fn after_write<T>(
    home: &Missed,
    elsewhere: Option<usize>,
    key: &str,
    r: Result<T>,
    capacity: usize,
) -> Result<T> {
    if elsewhere.is_some() {
        home.note(key, elsewhere, capacity);
        return r;
    }
    r.map_err(|e| match missed_by(&e) {
        true => say_noted(e, home.note(key, None, capacity)),
        false => e,
    })
}

/// A batch's writes as sent: `(position, home server, server sent to)` of each, for
/// [`after_write`] once answered. The pool's and the engine's batches both keep one.
pub(crate) struct SentWrites(Vec<(usize, usize, usize)>);

impl SentWrites {
    /// The writes of `groups` (`(server, positions)`), each copy sent to another server than
    /// its key's home recorded on the home's record (`missed(home)`) before it is sent. With
    /// no server remapped (`remapped` false), each key went to its home: no second hash.
    pub(crate) fn note<'a, 'k>(
        groups: &[(usize, Vec<usize>)],
        remapped: bool,
        key: impl Fn(usize) -> &'k str,
        home: impl Fn(&str) -> usize,
        missed: impl Fn(usize) -> &'a Missed,
        capacity: usize,
    ) -> SentWrites {
        let mut sent = Vec::new();
        for (s, positions) in groups {
            for &p in positions {
                let h = if remapped { home(key(p)) } else { *s };
                if h != *s {
                    missed(h).note(key(p), Some(*s), capacity);
                }
                sent.push((p, h, *s));
            }
        }
        SentWrites(sent)
    }

    /// Runs [`after_write`] on each write's result in `results` (`slot`: the result an entry
    /// holds, if any).
    pub(crate) fn settle<'a, 'k, R, T>(
        self,
        results: &mut [R],
        slot: impl Fn(&mut R) -> Option<&mut Result<T>>,
        key: impl Fn(usize) -> &'k str,
        missed: impl Fn(usize) -> &'a Missed,
        capacity: usize,
    ) {
        for (p, home, s) in self.0 {
            if let Some(r) = slot(&mut results[p]) {
                let taken = std::mem::replace(r, Err(Error::backend("")));
                let elsewhere = (s != home).then_some(s);
                *r = after_write(missed(home), elsewhere, key(p), taken, capacity);
            }
        }
    }
}

/// `e`, saying what became of the write it failed.
pub(crate) fn say_noted(e: Error, noted: Noted) -> Error {
    e.with_note(match noted {
        Noted::Queued => {
            "the write may not have reached that server, so its key is queued for replay: once \
             the server answers again, the key is deleted there before anything else is sent \
             to it, and it never serves the value this write was to replace or delete"
        }
        Noted::Full => {
            "the write may not have reached that server, and its replay queue is full: once \
             the server answers again, every value it stored before now is judged stale, so it \
             never serves the value this write was to replace or delete as fresh"
        }
    })
}

fn add(copies: &mut Vec<usize>, elsewhere: Option<usize>) {
    if let Some(s) = elsewhere {
        if !copies.contains(&s) {
            copies.push(s);
        }
    }
}

/// Adds the replay counts of `records` (one per server) to `stats`.
pub(crate) fn report<'a>(records: impl Iterator<Item = &'a Missed>, stats: &mut crate::Stats) {
    for m in records {
        stats.replayed_deletes += m.replayed.load(Ordering::Relaxed);
        stats.replay_overflows += m.overflowed.load(Ordering::Relaxed);
        stats.replays_failed += m.incomplete.load(Ordering::Relaxed);
    }
}

/// [`distrust`] for an item read for a key: `records` are every server's (one load each: nothing
/// more unless one of them ever overflowed), `home` gives the key's home server's.
pub(crate) fn distrust_read<'a>(
    item: Option<&mut Item>,
    mut records: impl Iterator<Item = &'a Missed>,
    home: impl FnOnce() -> &'a Missed,
) {
    let Some(item) = item else { return };
    if records.all(|m| m.stale_before_ms() == 0) {
        return;
    }
    distrust(item, home().stale_before_ms());
}

/// Judges `item` by the record of its key's home server: a newcache value written before
/// `stale_before_ms` (a key of that server's outage did not fit its record) is given a soft
/// expiry no later than that time, so that readers judge it stale or expired (reloaded)
/// instead of serving it as fresh. Placeholders, values written later and foreign bytes are
/// left as they are.
pub(crate) fn distrust(item: &mut Item, stale_before_ms: u64) {
    if stale_before_ms == 0 || item.flags != envelope::FLAGS {
        return;
    }
    if let Some(bytes) = envelope::stale_from(&item.value, stale_before_ms) {
        item.value = bytes.into();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mine(m: &Missed) -> Replay<&Missed> {
        match Missed::begin(m) {
            Begin::Mine(r) => r,
            Begin::Clear => panic!("nothing to replay"),
            Begin::Busy => panic!("busy"),
        }
    }

    fn sorted(r: &Replay<&Missed>) -> Taken {
        let mut t = r.taken.clone();
        t.sort();
        t
    }

    #[test]
    fn latest_wins_and_copies_accumulate() {
        let m = Missed::default();
        assert!(!m.pending());
        assert_eq!(m.note("a", None, 10), Noted::Queued);
        assert_eq!(m.note("a", Some(2), 10), Noted::Queued);
        assert_eq!(m.note("a", Some(2), 10), Noted::Queued);
        assert_eq!(m.note("b", Some(1), 10), Noted::Queued);
        assert!(m.pending());
        let r = mine(&m);
        assert_eq!(
            sorted(&r),
            vec![("a".into(), vec![2]), ("b".into(), vec![1])],
            "each key once, with the servers that may hold a copy"
        );
        assert!(m.pending(), "pending until the replay ends");
        assert!(
            matches!(Missed::begin(&m), Begin::Busy),
            "one replay at a time"
        );
        assert!(!m.wait(Duration::from_millis(5)), "still in flight");
        r.done("a:1", 0, |_| None, 10);
        assert!(!m.pending());
        assert!(m.wait(Duration::ZERO));
        assert!(matches!(Missed::begin(&m), Begin::Clear));
        assert_eq!(m.replayed.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_full_record_judges_older_values_stale_instead() {
        let m = Missed::default();
        assert_eq!(m.note("a", None, 1), Noted::Queued);
        assert_eq!(m.stale_before_ms(), 0);
        let before = unix_now_ms();
        assert_eq!(m.note("b", None, 1), Noted::Full);
        assert!(m.stale_before_ms() >= before);
        assert_eq!(m.overflowed.load(Ordering::Relaxed), 1);
        assert_eq!(
            m.note("a", Some(3), 1),
            Noted::Queued,
            "a held key still updates"
        );
    }

    #[test]
    fn a_failed_or_dropped_replay_gives_its_keys_back() {
        let m = Missed::default();
        m.note("a", Some(1), 10);
        m.note("b", None, 10);
        let r = mine(&m);
        let e = Error::backend("gone");
        r.failed("a:1", &e, 10);
        assert!(m.pending());
        let r = mine(&m);
        assert_eq!(
            sorted(&r),
            vec![("a".into(), vec![1]), ("b".into(), vec![])]
        );
        drop(r); // a cancelled future, a task dropped with its runtime
        assert!(m.pending());
        assert_eq!(m.incomplete.load(Ordering::Relaxed), 2);
        let kept = mine(&m);
        assert_eq!(sorted(&kept).len(), 2, "kept");
        kept.done("a:1", 0, |_| None, 10);
        assert!(!m.pending());
    }

    #[test]
    fn a_key_recorded_during_a_replay_is_replayed_next() {
        let m = Missed::default();
        m.note("a", None, 10);
        let r = mine(&m);
        m.note("b", None, 10);
        r.done("a:1", 0, |_| None, 10);
        assert!(m.pending());
        assert_eq!(sorted(&mine(&m)), vec![("b".into(), vec![])]);
    }
}
