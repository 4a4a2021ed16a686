//! Per-server health, like libmemcached's auto-eject: after `failure_limit` consecutive transport
//! faults a server is marked dead; after a retry interval one caller probes it, and it is back only
//! when that probe succeeds.
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

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use crate::error::Error;

/// A duration in whole milliseconds, at least 1, saturating.
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// The longest wait between probes, in retry intervals.
pub(crate) const MAX_BACKOFF: u32 = 32;

/// What a caller may do with a server right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Gate {
    /// Use it.
    Go,
    /// Use it: this caller is the one probing a dead server.
    Probe,
    /// Do not wait on it: it is dead, and someone else is probing (or the interval is not over).
    FailFast,
}

/// Health of one server. Times are milliseconds on the backend's monotonic clock (from 1).
#[derive(Debug, Default)]
pub(crate) struct Health {
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

/// A server's record of missed invalidations, held by a replay that outlives its caller (it
/// runs in a task: the engine's connection's, the Redis async view's replay).
#[cfg(feature = "tokio")]
pub(crate) struct MissedOf(pub(crate) std::sync::Arc<Health>);

#[cfg(feature = "tokio")]
impl std::ops::Deref for MissedOf {
    type Target = super::outage::Missed;

    fn deref(&self) -> &super::outage::Missed {
        &self.0.missed
    }
}

/// The last transport fault seen on a server: what its "marked dead" errors give as their
/// source, so a caller can tell a refused connect from a timeout.
#[derive(Debug, Default)]
pub(crate) struct LastFault(parking_lot::Mutex<Option<Error>>);

impl Health {
    /// Remembers `e` as the server's last fault (call it with every [`failure`](Health::failure)).
    pub(crate) fn note_fault(&self, e: &Error) {
        *self.last_fault.0.lock() = Some(e.as_last_fault());
    }

    /// The error for a call refused because the server at `addr` is marked dead, its source
    /// the last fault.
    pub(crate) fn dead_error(&self, addr: &str) -> Error {
        Error::marked_dead(addr, self.last_fault.0.lock().clone())
    }

    /// [`dead_error`](Health::dead_error) naming the kind of server (`redis`).
    #[cfg(feature = "redis")]
    pub(crate) fn dead_error_on(&self, kind: &str, addr: &str) -> Error {
        Error::marked_dead_on(kind, addr, self.last_fault.0.lock().clone())
    }
}

impl Health {
    fn interval(&self, retry: Duration) -> u64 {
        let level = self
            .level
            .load(Ordering::Acquire)
            .min(MAX_BACKOFF.trailing_zeros());
        millis(retry).saturating_mul(1 << level)
    }

    /// [`gate_at`](Health::gate_at) at `now_ms` (the tests' form).
    #[cfg(test)]
    pub(crate) fn gate(&self, now_ms: u64, retry: Duration) -> Gate {
        self.gate_at(|| now_ms, retry)
    }

    /// [`gate`](Health::gate), reading the clock only for a server marked dead (a live server's
    /// callers read none).
    pub(crate) fn gate_at(&self, now_ms: impl FnOnce() -> u64, retry: Duration) -> Gate {
        let until = self.dead_until_ms.load(Ordering::Acquire);
        if until == 0 {
            return Gate::Go;
        }
        let now_ms = now_ms();
        if now_ms < until {
            return Gate::FailFast;
        }
        // One prober per interval: whoever moves the deadline on probes.
        let next = now_ms.saturating_add(self.interval(retry));
        match self
            .dead_until_ms
            .compare_exchange(until, next, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => Gate::Probe,
            Err(_) => Gate::FailFast,
        }
    }

    /// Whether a remapping ring should count this server as live now (`now_ms` is read only
    /// for a server marked dead).
    pub(crate) fn routable(&self, now_ms: impl FnOnce() -> u64) -> bool {
        let until = self.dead_until_ms.load(Ordering::Acquire);
        until == 0 || now_ms() >= until
    }

    /// Records an answer from the server; `true` if that brought it back from the dead. Only the
    /// probe's answer does: a late reply to a request sent before the server was marked dead
    /// proves nothing about it now.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn success(&self, now_ms: u64, probe: bool) -> bool {
        self.success_at(|| now_ms, probe)
    }

    /// [`success`](Health::success), reading the clock only when a probe brings the server
    /// back.
    pub(crate) fn success_at(&self, now_ms: impl FnOnce() -> u64, probe: bool) -> bool {
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

    /// Records a transport fault; `true` if this one marked the server dead.
    pub(crate) fn failure(&self, now_ms: u64, limit: u32, retry: Duration, probe: bool) -> bool {
        if self.dead_until_ms.load(Ordering::Acquire) != 0 {
            if probe {
                // A failed probe: the next one after the current interval.
                self.dead_until_ms.store(
                    now_ms.saturating_add(self.interval(retry)),
                    Ordering::Release,
                );
            }
            return false;
        }
        let n = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
        if n < limit {
            return false;
        }
        // Dead again soon after coming back: flapping, so back off further; otherwise start over.
        let revived = self.revived_ms.load(Ordering::Acquire);
        let settled = millis(retry).saturating_mul(u64::from(MAX_BACKOFF));
        if revived != 0 && now_ms.saturating_sub(revived) < settled {
            let _ = self
                .level
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |l| {
                    (l < MAX_BACKOFF.trailing_zeros()).then_some(l + 1)
                });
        } else {
            self.level.store(0, Ordering::Release);
        }
        let next = now_ms.saturating_add(self.interval(retry)).max(1);
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

    #[test]
    fn eject_probe_recover() {
        let h = Health::default();
        assert_eq!(h.gate(0, RETRY), Gate::Go);
        assert!(!h.failure(10, 2, RETRY, false), "one failure is not enough");
        assert!(h.failure(20, 2, RETRY, false), "the second marks it dead");
        assert!(!h.failure(30, 2, RETRY, false), "reported once");
        assert_eq!(h.gate(500, RETRY), Gate::FailFast);
        assert!(!h.routable(|| 500));
        assert!(h.routable(|| 1030));
        assert_eq!(h.gate(1030, RETRY), Gate::Probe, "one caller probes");
        assert_eq!(
            h.gate(1031, RETRY),
            Gate::FailFast,
            "the others do not wait"
        );
        assert!(h.success(1032, true), "back");
        assert!(!h.success(1033, true), "reported once");
        assert_eq!(h.gate(1034, RETRY), Gate::Go);
    }

    #[test]
    fn only_the_probe_brings_it_back() {
        let h = Health::default();
        assert!(h.failure(0, 1, RETRY, false));
        // a reply to a request sent before the server was marked dead
        assert!(!h.success(10, false));
        assert_eq!(h.gate(20, RETRY), Gate::FailFast, "still dead");
        assert_eq!(h.gate(1000, RETRY), Gate::Probe);
        assert!(h.success(1001, true));
    }

    #[test]
    fn a_dead_server_is_probed_every_interval() {
        let h = Health::default();
        h.failure(0, 1, RETRY, false);
        let mut now = 1000;
        for _ in 0..5 {
            assert_eq!(h.gate(now, RETRY), Gate::Probe, "at {now}");
            assert!(!h.failure(now + 5, 1, RETRY, true), "no second report");
            assert_eq!(h.gate(now + 1004, RETRY), Gate::FailFast);
            now += 1005;
        }
    }

    #[test]
    fn a_flapping_server_backs_off_up_to_the_cap() {
        let h = Health::default();
        let mut now = 0;
        let mut waits = Vec::new();
        for _ in 0..8 {
            assert!(
                h.failure(now, 1, RETRY, false),
                "each relapse is one transition"
            );
            let until = h.dead_until_ms.load(Ordering::Acquire);
            assert_eq!(h.gate(until - 1, RETRY), Gate::FailFast);
            assert_eq!(h.gate(until, RETRY), Gate::Probe);
            assert!(h.success(until, true));
            waits.push(until - now);
            now = until + 10; // dead again right away
        }
        assert_eq!(waits, [1000, 2000, 4000, 8000, 16000, 32000, 32000, 32000]);
    }

    #[test]
    fn a_flapping_server_backs_off_and_a_settled_one_starts_over() {
        let h = Health::default();
        assert!(h.failure(0, 1, RETRY, false));
        assert_eq!(h.gate(1000, RETRY), Gate::Probe);
        assert!(h.success(1000, true));
        // dead again right away: the next probe waits twice as long
        assert!(h.failure(1100, 1, RETRY, false), "a transition: logged");
        assert_eq!(h.gate(2200, RETRY), Gate::FailFast);
        assert_eq!(h.gate(3100, RETRY), Gate::Probe);
        assert!(h.success(3100, true));
        // up for longer than the capped interval: back to one retry interval
        let later = 3100 + 33_000;
        assert!(h.failure(later, 1, RETRY, false));
        assert_eq!(h.gate(later + 1000, RETRY), Gate::Probe);
    }

    #[test]
    fn success_resets_the_count() {
        let h = Health::default();
        h.failure(0, 3, RETRY, false);
        h.failure(0, 3, RETRY, false);
        h.success(0, false);
        assert!(!h.failure(0, 3, RETRY, false));
        assert_eq!(h.gate(0, RETRY), Gate::Go);
    }
}
