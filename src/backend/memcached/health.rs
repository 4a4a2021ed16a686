//! Per-server health, like libmemcached's auto-eject: after `failure_limit` consecutive failures a
//! server is marked dead for `retry_interval`; then one caller probes it, and it is back on the
//! first success. Each transition is logged once (through `tracing`), never once per request.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

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

/// Health of one server. Times are milliseconds on the backend's monotonic clock.
#[derive(Debug, Default)]
pub(crate) struct Health {
    failures: AtomicU32,
    /// 0: alive. Otherwise dead until this time (and probed by one caller after it).
    dead_until_ms: AtomicU64,
}

impl Health {
    pub(crate) fn gate(&self, now_ms: u64, retry: Duration) -> Gate {
        let until = self.dead_until_ms.load(Ordering::Acquire);
        if until == 0 {
            return Gate::Go;
        }
        if now_ms < until {
            return Gate::FailFast;
        }
        // One prober per interval: whoever moves the deadline on probes.
        let next = now_ms + retry.as_millis() as u64;
        match self
            .dead_until_ms
            .compare_exchange(until, next, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => Gate::Probe,
            Err(_) => Gate::FailFast,
        }
    }

    /// Whether a remapping ring should count this server as live now.
    pub(crate) fn routable(&self, now_ms: u64) -> bool {
        let until = self.dead_until_ms.load(Ordering::Acquire);
        until == 0 || now_ms >= until
    }

    /// Records an answer from the server; `true` if that brought it back from the dead.
    pub(crate) fn success(&self) -> bool {
        // Loads first: the hot path (a healthy server) writes nothing shared.
        if self.failures.load(Ordering::Acquire) != 0 {
            self.failures.store(0, Ordering::Release);
        }
        self.dead_until_ms.load(Ordering::Acquire) != 0
            && self.dead_until_ms.swap(0, Ordering::AcqRel) != 0
    }

    /// Records a failure; `true` if this one marked the server dead.
    pub(crate) fn failure(&self, now_ms: u64, limit: u32, retry: Duration) -> bool {
        let n = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
        if n < limit {
            return false;
        }
        let next = now_ms + retry.as_millis() as u64;
        // Only the alive -> dead transition reports; a failed probe just extends the deadline.
        self.dead_until_ms.swap(next.max(1), Ordering::AcqRel) == 0
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
        assert!(!h.failure(10, 2, RETRY), "one failure is not enough");
        assert!(h.failure(20, 2, RETRY), "the second marks it dead");
        assert!(!h.failure(30, 2, RETRY), "reported once");
        assert_eq!(h.gate(500, RETRY), Gate::FailFast);
        assert!(!h.routable(500));
        assert!(h.routable(1030));
        assert_eq!(h.gate(1030, RETRY), Gate::Probe, "one caller probes");
        assert_eq!(
            h.gate(1031, RETRY),
            Gate::FailFast,
            "the others do not wait"
        );
        assert!(h.success(), "back");
        assert!(!h.success(), "reported once");
        assert_eq!(h.gate(1032, RETRY), Gate::Go);
    }

    #[test]
    fn a_failed_probe_extends_the_deadline() {
        let h = Health::default();
        h.failure(0, 1, RETRY);
        assert_eq!(h.gate(1000, RETRY), Gate::Probe);
        assert!(!h.failure(1001, 1, RETRY));
        assert_eq!(h.gate(1500, RETRY), Gate::FailFast);
        assert_eq!(h.gate(2001, RETRY), Gate::Probe);
    }

    #[test]
    fn success_resets_the_count() {
        let h = Health::default();
        h.failure(0, 3, RETRY);
        h.failure(0, 3, RETRY);
        h.success();
        assert!(!h.failure(0, 3, RETRY));
        assert_eq!(h.gate(0, RETRY), Gate::Go);
    }
}
