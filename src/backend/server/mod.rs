//! What every server has, whichever client speaks to it (memcached's blocking pool and
//! pipelined engine, Redis's sync and async views), written once: its settings ([`Options`]),
//! its health (`health.rs`), its record of the invalidations it missed while out of reach
//! (`outage.rs`) and the replay gate in front of it (`replay.rs`).

pub(crate) mod health;
pub(crate) mod outage;
pub(crate) mod replay;

use std::time::Duration;

use crate::backend::DEFAULT_ITEM_SIZE;
use crate::error::{Error, Result};

/// Default limit on getting a connection: waiting for a free pool slot, then connecting.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
/// Default limit on one operation's I/O: sending its request and reading its replies.
pub const DEFAULT_IO_TIMEOUT: Duration = Duration::from_millis(500);
/// Default connections per server.
pub const DEFAULT_POOL_SIZE: u32 = 16;
/// Default consecutive transport faults after which a server is marked dead.
pub const DEFAULT_FAILURE_LIMIT: u32 = 2;
/// Default time a dead server is left alone before one caller probes it.
pub const DEFAULT_RETRY_INTERVAL: Duration = Duration::from_secs(1);
/// Keys recorded per server by default before the record overflows.
pub const DEFAULT_REPLAY_CAPACITY: usize = 10_000;

/// The longest `retry_interval`: a day. A dead server is always probed again eventually.
pub const MAX_RETRY_INTERVAL: Duration = Duration::from_secs(86_400);

/// The longest `connect_timeout` and `io_timeout`: an hour (a deadline is the time of a call
/// plus one of them; "no limit" is not offered: a hung server would hold its callers forever).
pub const MAX_TIMEOUT: Duration = Duration::from_secs(3_600);

/// The settings of every server connection: the public configurations' fields of the same
/// names ([`MemcachedConfig`](crate::MemcachedConfig), `RedisConfig`) say what each means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Options {
    pub(crate) connect_timeout: Duration,
    pub(crate) io_timeout: Duration,
    pub(crate) pool_size: u32,
    /// The largest item (value, key and overhead), memcached's `-I`.
    pub(crate) item_size: usize,
    pub(crate) failure_limit: u32,
    pub(crate) retry_interval: Duration,
    pub(crate) replay_capacity: usize,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            io_timeout: DEFAULT_IO_TIMEOUT,
            pool_size: DEFAULT_POOL_SIZE,
            item_size: DEFAULT_ITEM_SIZE,
            failure_limit: DEFAULT_FAILURE_LIMIT,
            retry_interval: DEFAULT_RETRY_INTERVAL,
            replay_capacity: DEFAULT_REPLAY_CAPACITY,
        }
    }
}

impl Options {
    /// The checks every server client makes: a pool of at least one connection, timeouts
    /// above zero (no connection could ever be made, no reply ever read) and at most
    /// [`MAX_TIMEOUT`], a `retry_interval` of at most [`MAX_RETRY_INTERVAL`].
    pub(crate) fn check(&self) -> Result<()> {
        if self.pool_size == 0 {
            return Err(Error::config("pool_size must be at least 1"));
        }
        for (name, t) in [
            ("connect_timeout", self.connect_timeout),
            ("io_timeout", self.io_timeout),
        ] {
            if t.is_zero() || t > MAX_TIMEOUT {
                return Err(Error::config(format!(
                    "{name} must be above zero and at most {MAX_TIMEOUT:?}, got {t:?}"
                )));
            }
        }
        if self.retry_interval > MAX_RETRY_INTERVAL {
            return Err(Error::config(format!(
                "retry_interval must be at most {MAX_RETRY_INTERVAL:?} (a dead server is probed \
                 again after it, doubling while it flaps), got {:?}",
                self.retry_interval
            )));
        }
        Ok(())
    }
}
