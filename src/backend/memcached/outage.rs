//! What a server missed while this process could not reach it: the keys it invalidated there
//! (deleted, wrote to another server instead, failed to write), deleted on that server before it
//! serves this process again ("replayed"). Shared, with the rest of a server's health record, by
//! the blocking pool and the async engine.
//!
//! Only deletes are replayed: re-sending a write could overwrite a newer one another process made
//! after the server came back. The record is bounded ([`Missed::note`] refuses keys past its
//! capacity); a key it could not hold is not lost either: from then on, values of that server's
//! keys written before the refusal are judged stale when read ([`Missed::stale_before_ms`],
//! applied by [`distrust`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

use super::wire;
use crate::backend::Item;
use crate::envelope;
use crate::error::{Error, Result};

/// Keys recorded per server by default before the record overflows.
pub const DEFAULT_REPLAY_CAPACITY: usize = 10_000;

/// Whether a key was recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Noted {
    /// Recorded (or already recorded): deleted there before the server serves again.
    Queued,
    /// The record is full: the server's older values are judged stale instead.
    Full,
}

/// One server's record of missed invalidations.
#[derive(Debug, Default)]
pub(crate) struct Missed {
    /// Some key is recorded (read on every operation: one load, no lock).
    pending: AtomicBool,
    /// Unix ms before which this server's values are judged stale (0: none): the latest time a
    /// key did not fit the record.
    stale_before_ms: AtomicU64,
    /// Each recorded key, with the other servers that may hold a copy written while this one was
    /// out (`DeadServerPolicy::Remap`).
    keys: Mutex<HashMap<Box<str>, Vec<usize>>>,
    /// Deletes replayed on this server.
    pub(crate) replayed: AtomicU64,
    /// Keys the record could not hold.
    pub(crate) overflowed: AtomicU64,
    /// Replays that failed part way (their keys kept for the next one).
    pub(crate) incomplete: AtomicU64,
}

/// The keys taken for one replay.
pub(crate) type Taken = Vec<(Box<str>, Vec<usize>)>;

fn unix_now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Missed {
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
            let first = self.overflowed.fetch_add(1, Ordering::Relaxed) == 0;
            self.stale_before_ms
                .fetch_max(unix_now_ms(), Ordering::AcqRel);
            if first {
                tracing::warn!(
                    capacity,
                    "newcache: a memcached server's record of missed invalidations is full; \
                     values it holds from before now are judged stale when it is back"
                );
            }
            return Noted::Full;
        }
        self.pending.store(true, Ordering::Release);
        Noted::Queued
    }

    /// Whether some key waits to be replayed.
    pub(crate) fn pending(&self) -> bool {
        self.pending.load(Ordering::Acquire)
    }

    /// Takes every recorded key, if any: the caller replays them, then hands the copies on
    /// ([`Missed::note`] on each other server), or gives them back ([`Missed::restore`]).
    pub(crate) fn take(&self) -> Option<Taken> {
        if !self.pending() {
            return None;
        }
        let mut keys = self.keys.lock();
        self.pending.store(false, Ordering::Release);
        (!keys.is_empty()).then(|| keys.drain().collect())
    }

    /// Gives back keys a replay could not delete (recorded again, within the capacity).
    pub(crate) fn restore(&self, taken: Taken, capacity: usize) {
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

    /// Unix ms before which this server's values are judged stale (0: never).
    pub(crate) fn stale_before_ms(&self) -> u64 {
        self.stale_before_ms.load(Ordering::Acquire)
    }
}

/// Whether a write that failed with `e` may have missed its server (a transport fault, a
/// server marked dead, an unknown outcome), rather than been refused by it or before sending.
pub(crate) fn missed_by(e: &Error) -> bool {
    (e.is_backend() || e.is_timeout()) && !wire::is_server_reply(e) && !e.is_unsupported()
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

/// `e`, saying what became of the write it failed.
pub(crate) fn say_noted(e: Error, noted: Noted) -> Error {
    e.with_note(match noted {
        Noted::Queued => {
            "the key is queued for replay: deleted on that server before it serves this \
             process again"
        }
        Noted::Full => {
            "the replay queue is full: that server's values from before now are judged stale \
             when it serves this process again"
        }
    })
}

/// Counts a replay that deleted `taken` on the server at `addr`, and hands each copy written
/// elsewhere on to that server's record (`other(j)`: server `j`'s record, if it is another);
/// a copy that does not fit there makes this server's older values stale instead.
pub(crate) fn replayed<'a>(
    addr: &str,
    missed: &Missed,
    taken: &Taken,
    other: impl Fn(usize) -> Option<&'a Missed>,
    capacity: usize,
) {
    missed
        .replayed
        .fetch_add(taken.len() as u64, Ordering::Relaxed);
    for (key, copies) in taken {
        for &j in copies {
            if let Some(there) = other(j) {
                if there.note(key, None, capacity) == Noted::Full {
                    missed
                        .stale_before_ms
                        .fetch_max(unix_now_ms(), Ordering::AcqRel);
                }
            }
        }
    }
    tracing::info!(
        server = %addr,
        deletes = taken.len(),
        "newcache: replayed the invalidations a memcached server missed while out of reach"
    );
}

/// Gives back the keys of a replay that failed with `e` on the server at `addr`, and warns.
pub(crate) fn failed(addr: &str, missed: &Missed, taken: Taken, e: &Error, capacity: usize) {
    tracing::warn!(
        server = %addr,
        error = %e,
        deletes = taken.len(),
        "newcache: could not replay the invalidations a memcached server missed; \
         kept for the next attempt (it serves nothing before)"
    );
    missed.restore(taken, capacity);
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

/// Judges `item` by the record of its key's home server: a newcache value written before
/// `stale_before_ms` (a key of that server's outage did not fit its record) is given a soft
/// expiry no later than that time, so that readers judge it stale (one herd-protected reload)
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

    #[test]
    fn latest_wins_and_copies_accumulate() {
        let m = Missed::default();
        assert!(!m.pending());
        assert_eq!(m.note("a", None, 10), Noted::Queued);
        assert_eq!(m.note("a", Some(2), 10), Noted::Queued);
        assert_eq!(m.note("a", Some(2), 10), Noted::Queued);
        assert_eq!(m.note("b", Some(1), 10), Noted::Queued);
        assert!(m.pending());
        let mut taken = m.take().unwrap();
        taken.sort();
        assert_eq!(
            taken,
            vec![("a".into(), vec![2]), ("b".into(), vec![1])],
            "each key once, with the servers that may hold a copy"
        );
        assert!(!m.pending());
        assert!(m.take().is_none());
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
    fn a_failed_replay_gives_its_keys_back() {
        let m = Missed::default();
        m.note("a", Some(1), 10);
        m.note("b", None, 10);
        let taken = m.take().unwrap();
        m.restore(taken, 10);
        assert!(m.pending());
        let mut again = m.take().unwrap();
        again.sort();
        assert_eq!(again, vec![("a".into(), vec![1]), ("b".into(), vec![])]);
        assert_eq!(m.incomplete.load(Ordering::Relaxed), 1);
    }
}
