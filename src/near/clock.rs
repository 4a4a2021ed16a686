//! The near tier's clock: read on every near hit, so it never calls the system clock. With the
//! system clock, one thread per process ticks a coarse copy of it (wall time for envelopes,
//! monotonic time for copies' ages) every 2 ms; a reading lags by at most that while the
//! thread is scheduled on time (a starved thread lags more, and copies live longer by as much).
//! A custom [`Clock`] (a test's mock) is read as it is, for both times.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

use crate::clock::Clock;

/// How often the ticker updates its times: the most a ticked reading lags the system clock
/// (what [`NearClock::slack_ms`] makes up for).
const TICK: Duration = Duration::from_millis(2);

/// The coarse times the ticker keeps: unix ms, and ms since the ticker began.
#[derive(Debug)]
pub(crate) struct Ticker {
    wall_ms: AtomicU64,
    age_ms: AtomicU64,
    origin: Instant,
}

impl Ticker {
    /// Ms since the ticker began, ticked.
    #[inline]
    pub(crate) fn age_ms(&self) -> u64 {
        self.age_ms.load(Ordering::Relaxed)
    }

    /// When the ticker began: [`Ticker::age_ms`] counts from it.
    pub(crate) fn origin(&self) -> Instant {
        self.origin
    }

    fn tick(&self) {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        self.wall_ms.store(wall, Ordering::Relaxed);
        self.age_ms
            .store(self.origin.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// The process's ticker, started if no near tier holds one; its thread ends when the last
    /// holder goes. `None` if no thread could be started.
    pub(crate) fn shared() -> Option<Arc<Ticker>> {
        static TICKER: Mutex<Weak<Ticker>> = Mutex::new(Weak::new());
        let mut held = TICKER.lock();
        if let Some(t) = held.upgrade() {
            return Some(t);
        }
        let t = Arc::new(Ticker {
            wall_ms: AtomicU64::new(0),
            age_ms: AtomicU64::new(0),
            origin: Instant::now(),
        });
        t.tick();
        let weak = Arc::downgrade(&t);
        std::thread::Builder::new()
            .name("newcache-near-clock".into())
            .spawn(move || {
                while let Some(t) = weak.upgrade() {
                    t.tick();
                    drop(t);
                    std::thread::sleep(TICK);
                }
            })
            .ok()?;
        *held = Arc::downgrade(&t);
        Some(t)
    }
}

/// What the near tier reads the time from.
#[derive(Debug, Clone)]
pub(crate) enum NearClock {
    /// The system clock, ticked.
    Ticked(Arc<Ticker>),
    /// A custom clock, read on each call: both its times are its `now_ms`.
    Direct(Arc<dyn Clock>),
}

impl NearClock {
    /// The ticked system clock, or `custom` read directly (and the system clock read directly
    /// if no ticker thread can be started).
    pub(crate) fn new(custom: Option<Arc<dyn Clock>>) -> NearClock {
        match custom {
            Some(c) => NearClock::Direct(c),
            None => Ticker::shared().map_or_else(
                || NearClock::Direct(Arc::new(crate::clock::SystemClock)),
                NearClock::Ticked,
            ),
        }
    }

    /// Unix ms, to judge an envelope by.
    #[inline]
    pub(crate) fn wall_ms(&self) -> u64 {
        match self {
            NearClock::Ticked(t) => t.wall_ms.load(Ordering::Relaxed),
            NearClock::Direct(c) => c.now_ms(),
        }
    }

    /// Ms on a clock that never goes back (a custom clock's own): a copy's age.
    #[inline]
    pub(crate) fn age_ms(&self) -> u64 {
        match self {
            NearClock::Ticked(t) => t.age_ms.load(Ordering::Relaxed),
            NearClock::Direct(c) => c.now_ms(),
        }
    }

    /// How far a reading may lag the time it stands for: each bound is shortened by it.
    #[inline]
    pub(crate) fn slack_ms(&self) -> u64 {
        match self {
            NearClock::Ticked(_) => TICK.as_millis() as u64 + 1,
            NearClock::Direct(_) => 0,
        }
    }
}
