//! The readiness check's answer: which servers did not answer [`Cache::ping`](crate::Cache::ping),
//! and why.

use std::error::Error as StdError;
use std::fmt;

use crate::error::Error;

/// The key a ping reads (`get`): valid on every backend, outside the `{flavor}-{version}-{sha1}`
/// space of derived keys, and normally absent, so the probe's answer is a miss. A `get` is one
/// of the few commands twemproxy forwards (it has no `version` or meta commands).
pub const PING_KEY: &str = "newcache-ping";

/// One server that did not answer a ping: its address and the error.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct PingFailure {
    /// The server's address as configured (`host:port`), or the proxy's behind twemproxy; a
    /// custom backend's own name for it.
    pub server: String,
    /// What went wrong: refused, timed out (`is_timeout()`), marked dead, an error reply.
    pub error: Error,
}

impl PingFailure {
    /// A failure of `server`, for a custom [`Backend::ping`](crate::Backend::ping).
    pub fn new(server: impl Into<String>, error: Error) -> PingFailure {
        PingFailure {
            server: server.into(),
            error,
        }
    }
}

/// The servers that did not answer a [`Cache::ping`](crate::Cache::ping) (at least one), each
/// with its error, out of how many were asked.
///
/// `Display` names every failing server with its error and that error's causes, on one line
/// (what a `/healthz` handler can return as is); [`source`](StdError::source) is `None`, as
/// there may be several.
///
/// ```
/// # fn main() {
/// let cache = newcache::Cache::builder()
///     .memcached(["127.0.0.1:1"]) // nothing listens on port 1
///     .build()
///     .unwrap();
/// let err = cache.ping().unwrap_err();
/// assert_eq!(err.servers(), 1);
/// assert_eq!(err.failures()[0].server, "127.0.0.1:1");
/// assert!(err.failures()[0].error.is_backend());
/// let said = err.to_string();
/// assert!(said.starts_with("1 of 1 servers did not answer: "), "{said}");
/// assert_eq!(said.matches("127.0.0.1:1").count(), 1, "the server named once: {said}");
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct PingError {
    failures: Vec<PingFailure>,
    servers: usize,
}

impl PingError {
    /// The failures of a ping that asked `servers` servers, for a custom
    /// [`Backend::ping`](crate::Backend::ping). `servers` is at least `failures.len()`.
    pub fn new(failures: Vec<PingFailure>, servers: usize) -> PingError {
        let servers = servers.max(failures.len());
        PingError { failures, servers }
    }

    /// The servers that did not answer, in the order they are configured.
    pub fn failures(&self) -> &[PingFailure] {
        &self.failures
    }

    /// How many servers were asked (those that answered are the others).
    pub fn servers(&self) -> usize {
        self.servers
    }

    /// The ping's result: `Ok` when nothing failed.
    pub(crate) fn check(failures: Vec<PingFailure>, servers: usize) -> Result<(), PingError> {
        if failures.is_empty() {
            Ok(())
        } else {
            Err(PingError::new(failures, servers))
        }
    }
}

impl fmt::Display for PingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} of {} servers did not answer",
            self.failures.len(),
            self.servers
        )?;
        for (i, failure) in self.failures.iter().enumerate() {
            let sep = if i == 0 { ": " } else { "; " };
            // An error that names its server already says where (each part said once).
            if failure.error.server() == Some(failure.server.as_str()) {
                write!(f, "{sep}{}", failure.error)?;
            } else {
                write!(f, "{sep}{}: {}", failure.server, failure.error)?;
            }
            let mut cause = failure.error.source();
            while let Some(c) = cause {
                write!(f, ": {c}")?;
                cause = c.source();
            }
        }
        Ok(())
    }
}

impl StdError for PingError {}

/// The failure of a ping of one server, `addr`.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn single(addr: &str, e: Error) -> PingError {
    PingError::new(vec![PingFailure::new(addr, e)], 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_every_failure_with_its_causes() {
        let refused = Error::from(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "connection refused",
        ));
        let e = PingError::new(
            vec![
                PingFailure::new("a:1", refused),
                PingFailure::new("b:2", Error::backend("marked dead")),
            ],
            3,
        );
        assert_eq!(
            e.to_string(),
            "2 of 3 servers did not answer: a:1: backend error: i/o error talking to the \
             server: connection refused; b:2: backend error: marked dead"
        );
        assert!(e.source().is_none());
        assert!(PingError::check(Vec::new(), 2).is_ok());
    }
}
