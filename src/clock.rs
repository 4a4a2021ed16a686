//! Wall-clock time, injectable: the soft expiry is judged against a [`Clock`] so that tests can move
//! time instead of sleeping ([`testing::MockClock`](crate::testing::MockClock)).

use std::fmt::Debug;
use std::time::{SystemTime, UNIX_EPOCH};

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
