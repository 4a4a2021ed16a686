//! Per-server health, like libmemcached's auto-eject: after `failure_limit` consecutive transport
//! faults a server is marked dead; after a retry interval one caller probes it, and it is back only
//! when that probe succeeds. Every client of a server (memcached's pool and engine, Redis's two
//! views) passes the gate ([`Health::gate`]) and reports to the record ([`Health::fault`],
//! [`Health::answered`]): the rules, and their two warnings, are written here once.
//!
//! Only transport faults count: a refused or timed-out connect, an I/O error or timeout on a
//! request, a reply that cannot be parsed. A complete error reply (`CLIENT_ERROR`,
//! `SERVER_ERROR`), a value over the item limit and a wait for a free pooled connection say
//! nothing against the server and are neither failures nor successes here.
//!
//! # Damping
//!
//! Each transition (alive → dead, dead → alive) is logged once; a server that stays dead logs
//! nothing more, and is probed every retry interval so that it is used again soon after it
//! returns. A server marked dead again within [`MAX_BACKOFF`] retry intervals of coming back is
//! flapping: each such relapse doubles the time until its next probe, up to `MAX_BACKOFF` × the
//! retry interval; once it has stayed up for that long, the next failure starts over at one
//! interval. So a flapping server logs two warnings per cycle, and its cycles stretch to at least
//! `MAX_BACKOFF` retry intervals (32 s with the default 1 s) instead of flooding the log.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::Options;
use crate::error::Error;

/// A duration in whole milliseconds, at least 1, saturating.
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// Milliseconds on the health records' monotonic clock: one for the process, so that records
/// shared by several clients (a sync `Cache`'s pool and engine, an `AsyncCache`'s engine) and
/// a route over many servers read one time.
pub(crate) fn now_ms() -> u64 {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    let origin = ORIGIN.get_or_init(Instant::now);
    u64::try_from(origin.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// The longest wait between probes, in retry intervals.
pub(crate) const MAX_BACKOFF: u32 = 32;

/// What a caller may do with a server right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gate {
    /// Use it.
    Go,
    /// Use it: this caller is the one probing a dead server.
    Probe,
    /// Do not wait on it: it is dead, and someone else is probing (or the interval is not over).
    FailFast,
}

/// Health of one server: its limits (from its [`Options`]), its state, and its record of the
/// invalidations it missed. Times are milliseconds on [`now_ms`]'s clock.
#[derive(Debug)]
pub(crate) struct Health {
    /// What the warnings and the "marked dead" errors call it: `memcached`, `redis`.
    kind: &'static str,
    /// `host:port`.
    addr: String,
    /// At least 1.
    failure_limit: u32,
    retry_interval: Duration,
    failures: AtomicU32,
    /// 0: alive. Otherwise dead until this time (and probed by one caller after it).
    dead_until_ms: AtomicU64,
    /// Doublings of the retry interval (0..=log2(MAX_BACKOFF)).
    level: AtomicU32,
    /// When it last came back (0: never died).
    revived_ms: AtomicU64,
    /// The invalidations it missed, replayed before it serves again.
    pub(crate) missed: super::outage::Missed,
    /// The last transport fault, for the errors of the calls refused while it is dead.
    last_fault: LastFault,
}

/// The last transport fault seen on a server: what its "marked dead" errors give as their
/// source, so a caller can tell a refused connect from a timeout.
#[derive(Debug, Default)]
struct LastFault(parking_lot::Mutex<Option<Error>>);

impl Health {
    /// The record of the `kind` server (`memcached`, `redis`) at `addr`, alive, with the
    /// failure limit and retry interval of `options`.
    pub(crate) fn new(kind: &'static str, addr: impl Into<String>, options: &Options) -> Health {
        Health {
            kind,
            addr: addr.into(),
            failure_limit: options.failure_limit.max(1),
            retry_interval: options.retry_interval,
            failures: AtomicU32::new(0),
            dead_until_ms: AtomicU64::new(0),
            level: AtomicU32::new(0),
            revived_ms: AtomicU64::new(0),
            missed: super::outage::Missed::default(),
            last_fault: LastFault::default(),
        }
    }

    /// The health gate: `Ok(probe)` (`true`: this caller is the one probing a dead server), or
    /// the error of a call refused because the server is marked dead and not due for a probe
    /// (its source the last fault). Reads the clock only for a server marked dead (a live
    /// server's callers read none).
    pub(crate) fn gate(&self) -> Result<bool, Error> {
        match self.gate_at(now_ms) {
            Gate::Go => Ok(false),
            Gate::Probe => Ok(true),
            Gate::FailFast => Err(self.dead_error()),
        }
    }

    /// The error for a call refused because the server is marked dead, its source the last
    /// fault.
    fn dead_error(&self) -> Error {
        Error::marked_dead_on(self.kind, &self.addr, self.last_fault.0.lock().clone())
    }

    /// Whether a remapping ring should count this server as live now (`now_ms` is read only
    /// for a server marked dead: a route over many servers reads it once).
    pub(crate) fn routable(&self, now_ms: impl FnOnce() -> u64) -> bool {
        let until = self.dead_until_ms.load(Ordering::Acquire);
        until == 0 || now_ms() >= until
    }

    /// Records transport fault `e` (`probe`: met by the caller probing the server): `true` if
    /// it marked the server dead, which is warned about once (the caller then drops the
    /// server's connections). The last fault is the source of the calls refused meanwhile.
    pub(crate) fn fault(&self, e: &Error, probe: bool) -> bool {
        *self.last_fault.0.lock() = Some(e.as_last_fault());
        let dead = self.failure(now_ms(), probe);
        if dead {
            tracing::warn!(
                server = %self.addr,
                error = %e,
                "newcache: {} server marked dead after {} consecutive failures; probing it \
                 again after {:?} (doubling while probes fail)",
                self.kind,
                self.failure_limit,
                self.retry_interval
            );
        }
        dead
    }

    /// Records an answer from the server (`probe`: to the caller probing it), which brings a
    /// server marked dead back (warned about once).
    pub(crate) fn answered(&self, probe: bool) {
        if self.success_at(now_ms, probe) {
            tracing::warn!(server = %self.addr, "newcache: {} server is back", self.kind);
        }
    }
}

impl Health {
    fn interval(&self) -> u64 {
        let level = self
            .level
            .load(Ordering::Acquire)
            .min(MAX_BACKOFF.trailing_zeros());
        millis(self.retry_interval).saturating_mul(1 << level)
    }

    /// [`gate_at`](Health::gate_at) at `now_ms` (the tests' form).
    #[cfg(test)]
    fn gate_now(&self, now_ms: u64) -> Gate {
        self.gate_at(|| now_ms)
    }

    /// The gate's decision, reading the clock only for a server marked dead.
    fn gate_at(&self, now_ms: impl FnOnce() -> u64) -> Gate {
        let until = self.dead_until_ms.load(Ordering::Acquire);
        if until == 0 {
            return Gate::Go;
        }
        let now_ms = now_ms();
        if now_ms < until {
            return Gate::FailFast;
        }
        // One prober per interval: whoever moves the deadline on probes.
        let next = now_ms.saturating_add(self.interval());
        match self
            .dead_until_ms
            .compare_exchange(until, next, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => Gate::Probe,
            Err(_) => Gate::FailFast,
        }
    }

    /// Records an answer from the server; `true` if that brought it back from the dead. Only the
    /// probe's answer does: a late reply to a request sent before the server was marked dead
    /// proves nothing about it now. Reads the clock only when a probe brings the server back.
    fn success_at(&self, now_ms: impl FnOnce() -> u64, probe: bool) -> bool {
        if self.dead_until_ms.load(Ordering::Acquire) != 0 {
            if !probe || self.dead_until_ms.swap(0, Ordering::AcqRel) == 0 {
                return false;
            }
            self.failures.store(0, Ordering::Release);
            self.revived_ms.store(now_ms().max(1), Ordering::Release);
            return true;
        }
        // Loads first: the hot path (a healthy server) writes nothing shared.
        if self.failures.load(Ordering::Acquire) != 0 {
            self.failures.store(0, Ordering::Release);
        }
        false
    }

    /// [`success_at`](Health::success_at) at `now_ms` (the tests' form).
    #[cfg(test)]
    fn success(&self, now_ms: u64, probe: bool) -> bool {
        self.success_at(|| now_ms, probe)
    }

    /// Records a transport fault; `true` if this one marked the server dead.
    fn failure(&self, now_ms: u64, probe: bool) -> bool {
        if self.dead_until_ms.load(Ordering::Acquire) != 0 {
            if probe {
                // A failed probe: the next one after the current interval.
                self.dead_until_ms
                    .store(now_ms.saturating_add(self.interval()), Ordering::Release);
            }
            return false;
        }
        let n = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
        if n < self.failure_limit {
            return false;
        }
        // Dead again soon after coming back: flapping, so back off further; otherwise start over.
        let revived = self.revived_ms.load(Ordering::Acquire);
        let settled = millis(self.retry_interval).saturating_mul(u64::from(MAX_BACKOFF));
        if revived != 0 && now_ms.saturating_sub(revived) < settled {
            let _ = self
                .level
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |l| {
                    (l < MAX_BACKOFF.trailing_zeros()).then_some(l + 1)
                });
        } else {
            self.level.store(0, Ordering::Release);
        }
        let next = now_ms.saturating_add(self.interval()).max(1);
        // Only the alive -> dead transition reports.
        self.dead_until_ms
            .compare_exchange(0, next, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RETRY: Duration = Duration::from_millis(1000);

    /// A record marked dead after `failure_limit` faults, probed every second.
    fn health(failure_limit: u32) -> Health {
        let options = Options {
            failure_limit,
            retry_interval: RETRY,
            ..Options::default()
        };
        Health::new("memcached", "a:1", &options)
    }

    #[test]
    fn eject_probe_recover() {
        let h = health(2);
        assert_eq!(h.gate_now(0), Gate::Go);
        assert!(!h.failure(10, false), "one failure is not enough");
        assert!(h.failure(20, false), "the second marks it dead");
        assert!(!h.failure(30, false), "reported once");
        assert_eq!(h.gate_now(500), Gate::FailFast);
        assert!(!h.routable(|| 500));
        assert!(h.routable(|| 1030));
        assert_eq!(h.gate_now(1030), Gate::Probe, "one caller probes");
        assert_eq!(h.gate_now(1031), Gate::FailFast, "the others do not wait");
        assert!(h.success(1032, true), "back");
        assert!(!h.success(1033, true), "reported once");
        assert_eq!(h.gate_now(1034), Gate::Go);
    }

    #[test]
    fn a_fault_marks_it_dead_once_and_the_gate_refuses_with_the_last_fault() {
        let h = health(2);
        let e = Error::backend("connection refused");
        assert!(matches!(h.gate(), Ok(false)));
        assert!(!h.fault(&e, false), "one fault is not enough");
        assert!(h.fault(&e, false), "the second marks it dead");
        assert!(!h.fault(&e, false), "reported once");
        let refused = h.gate().unwrap_err();
        assert!(
            refused
                .to_string()
                .contains("memcached at a:1 is marked dead"),
            "{refused}"
        );
        assert!(refused.last_fault().is_some(), "{refused:?}");
    }

    #[test]
    fn only_the_probe_brings_it_back() {
        let h = health(1);
        assert!(h.failure(0, false));
        // a reply to a request sent before the server was marked dead
        assert!(!h.success(10, false));
        assert_eq!(h.gate_now(20), Gate::FailFast, "still dead");
        assert_eq!(h.gate_now(1000), Gate::Probe);
        assert!(h.success(1001, true));
    }

    #[test]
    fn a_dead_server_is_probed_every_interval() {
        let h = health(1);
        h.failure(0, false);
        let mut now = 1000;
        for _ in 0..5 {
            assert_eq!(h.gate_now(now), Gate::Probe, "at {now}");
            assert!(!h.failure(now + 5, true), "no second report");
            assert_eq!(h.gate_now(now + 1004), Gate::FailFast);
            now += 1005;
        }
    }

    #[test]
    fn a_flapping_server_backs_off_up_to_the_cap() {
        let h = health(1);
        let mut now = 0;
        let mut waits = Vec::new();
        for _ in 0..8 {
            assert!(h.failure(now, false), "each relapse is one transition");
            let until = h.dead_until_ms.load(Ordering::Acquire);
            assert_eq!(h.gate_now(until - 1), Gate::FailFast);
            assert_eq!(h.gate_now(until), Gate::Probe);
            assert!(h.success(until, true));
            waits.push(until - now);
            now = until + 10; // dead again right away
        }
        assert_eq!(waits, [1000, 2000, 4000, 8000, 16000, 32000, 32000, 32000]);
    }

    #[test]
    fn a_flapping_server_backs_off_and_a_settled_one_starts_over() {
        let h = health(1);
        assert!(h.failure(0, false));
        assert_eq!(h.gate_now(1000), Gate::Probe);
        assert!(h.success(1000, true));
        // dead again right away: the next probe waits twice as long
        assert!(h.failure(1100, false), "a transition: logged");
        assert_eq!(h.gate_now(2200), Gate::FailFast);
        assert_eq!(h.gate_now(3100), Gate::Probe);
        assert!(h.success(3100, true));
        // up for longer than the capped interval: back to one retry interval
        let later = 3100 + 33_000;
        assert!(h.failure(later, false));
        assert_eq!(h.gate_now(later + 1000), Gate::Probe);
    }

    #[test]
    fn success_resets_the_count() {
        let h = health(3);
        h.failure(0, false);
        h.failure(0, false);
        h.success(0, false);
        assert!(!h.failure(0, false));
        assert_eq!(h.gate_now(0), Gate::Go);
    }
}
