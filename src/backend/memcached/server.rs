//! One memcached server as the backend sees it: its address, its r2d2 pool (replaced when the
//! server is marked dead) and its health.

use std::fmt;

use parking_lot::RwLock;

use super::conn::{Conn, Manager};
use super::health::Health;
use crate::error::{Error, ErrorKind, Result};

pub(crate) struct Server {
    pub(crate) addr: String,
    /// Replaced when the server is marked dead, so that its idle connections (all broken if it
    /// was restarted) are dropped at once rather than found out one failed probe at a time.
    pub(crate) pool: RwLock<r2d2::Pool<Manager>>,
    pub(crate) make_pool: Box<dyn Fn() -> r2d2::Pool<Manager> + Send + Sync>,
    pub(crate) health: Health,
}

impl fmt::Debug for Server {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Server")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl Server {
    /// Runs `op` on a pooled connection; the connection is dropped if `op` left it out of step.
    pub(crate) fn with_conn<T>(&self, op: impl FnOnce(&mut Conn) -> Result<T>) -> Result<T> {
        let pool = self.pool.read().clone();
        let mut conn = pool.get().map_err(|e| {
            Error::with_source(
                ErrorKind::Timeout,
                format!("no connection to memcached at {} in time", self.addr),
                e,
            )
        })?;
        op(&mut conn).map_err(|e| self.annotate(e))
    }

    fn annotate(&self, e: Error) -> Error {
        if e.is_backend() {
            Error::with_source(e.kind(), format!("memcached at {}", self.addr), e)
        } else {
            e
        }
    }
}
