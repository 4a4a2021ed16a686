//! What every server has, whichever client speaks to it (memcached's blocking pool and
//! pipelined engine, Redis's sync and async views), written once: its settings ([`Options`]),
//! its health (`health.rs`), its record of the invalidations it missed while out of reach
//! (`outage.rs`) and the replay gate in front of it (`replay.rs`).

pub(crate) mod health;
pub(crate) mod outage;
pub(crate) mod replay;

use std::time::Duration;

use crate::backend::DEFAULT_ITEM_SIZE;
use crate::error::{Error, ErrorKind, Result};

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

/// The text of a `CLIENT_ERROR` or `SERVER_ERROR` reply: the server answered, so this is not a
/// transport fault (it never counts toward marking the server dead).
#[derive(Debug)]
pub(crate) struct ServerReply {
    pub(crate) text: String,
    /// `CLIENT_ERROR` (after some of which memcached swallows what follows), not
    /// `SERVER_ERROR` (one complete line: memcached's out-of-memory, twemproxy's "connection
    /// refused" for a key whose server is down; the connection stays in step).
    pub(crate) client: bool,
}

impl std::fmt::Display for ServerReply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

/// The server's own error reply carried by `e`, if any.
fn server_reply(e: &Error) -> Option<&ServerReply> {
    std::error::Error::source(e).and_then(|s| s.downcast_ref::<ServerReply>())
}

impl std::error::Error for ServerReply {}

/// Whether `e` is a complete error reply from the server (`CLIENT_ERROR`, `SERVER_ERROR`, `ERROR`
/// or a refused value), as opposed to a transport fault: an I/O error, a timeout, a closed
/// connection or a reply that could not be parsed.
pub(crate) fn is_server_reply(e: &Error) -> bool {
    leaves_connection_usable(e) || server_reply(e).is_some()
}

/// Whether an error leaves the connection in step with the server (a complete reply was read):
/// a refused value, a non-numeric counter, an unknown command, or a `SERVER_ERROR` line. Not a
/// `CLIENT_ERROR`: after some, memcached runs what follows as commands.
pub(crate) fn leaves_connection_usable(e: &Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::TooLarge | ErrorKind::NotACounter | ErrorKind::Unsupported
    ) || server_reply(e).is_some_and(|r| !r.client)
}
