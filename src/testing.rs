//! Helpers for testing code that uses newcache: a [`MockClock`] that moves only when told to.
//! Not needed in production code.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::clock::{Clock, SystemClock};

/// A clock that only moves when told to, for tests.
///
/// It starts at the real time (so absolute memcached expiry times stay meaningful) and is shared
/// through an `Arc`:
///
/// ```
/// use std::time::Duration;
/// use newcache::Clock;
/// use newcache::testing::MockClock;
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
