//! Wall-clock time, injectable: the soft expiry is judged against a [`Clock`] so that tests can move
//! time instead of sleeping.

use std::fmt::Debug;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A source of unix time in milliseconds.
///
/// The cache reads it for soft expiry, herd timeouts and memcached's absolute expiry times; the
/// memory backend reads it for hard expiry. Implementations must be cheap and thread-safe.
pub trait Clock: Debug + Send + Sync {
    /// Milliseconds since the unix epoch.
    fn now_ms(&self) -> u64;
}

/// The system's wall clock (the default).
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0)
    }
}

/// A clock that only moves when told to, for tests.
///
/// It starts at the real time (so absolute memcached expiry times stay meaningful) and is shared
/// through an `Arc`:
///
/// ```
/// use std::time::Duration;
/// use newcache::{Clock, MockClock};
/// let clock = MockClock::new();
/// let t0 = clock.now_ms();
/// clock.advance(Duration::from_millis(1500));
/// assert_eq!(clock.now_ms(), t0 + 1500);
/// ```
#[derive(Debug)]
pub struct MockClock {
    now_ms: AtomicU64,
}

impl MockClock {
    /// A mock clock set to the current system time, ready to share.
    pub fn new() -> Arc<MockClock> {
        Arc::new(MockClock {
            now_ms: AtomicU64::new(SystemClock.now_ms()),
        })
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        self.now_ms
            .fetch_add(by.as_millis() as u64, Ordering::SeqCst);
    }
}

impl Clock for MockClock {
    fn now_ms(&self) -> u64 {
        self.now_ms.load(Ordering::SeqCst)
    }
}
