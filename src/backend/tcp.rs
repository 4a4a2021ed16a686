//! The blocking pools' TCP connect (memcached's and Redis's): each address a host resolves to,
//! in turn, within one `connect_timeout` for them all.

use std::io;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// Why no address took the connection.
pub(crate) struct NotConnected {
    /// `timeout` ran out before the next address was tried (after failed attempts, or none).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) late: bool,
    /// The last attempt's error (none when no address was tried).
    pub(crate) last: Option<io::Error>,
}

/// A connection to the first of `addrs` that takes one, each attempt bounded by what is left of
/// `timeout` since `started`.
pub(crate) fn connect_first(
    addrs: impl IntoIterator<Item = SocketAddr>,
    started: Instant,
    timeout: Duration,
) -> Result<TcpStream, NotConnected> {
    let mut last = None;
    for a in addrs {
        let left = timeout.saturating_sub(started.elapsed());
        if left.is_zero() {
            return Err(NotConnected { late: true, last });
        }
        match TcpStream::connect_timeout(&a, left) {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(NotConnected { late: false, last })
}
