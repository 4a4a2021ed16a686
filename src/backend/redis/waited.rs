//! The async view's connections for waited writes (`redis_wait`): each carries one write and
//! its `WAIT` at a time. A `WAIT` blocks the connection it arrives on until the replicas answer
//! or its timeout passes; on the view's shared multiplexed connection every other caller's
//! command (reads included) would queue behind it, and with a replica gone each write would
//! hold the connection for its whole wait, pushing the others past `io_timeout` as faults. So
//! no `WAIT` is sent on the shared connection: a waited write takes a connection of its own
//! here, and only that write waits.
//!
//! At most `pool_size` are open (a waited write waits `connect_timeout` at most for one, then
//! fails unsent, as the sync pool's callers do); each is opened with the shared connection's
//! set-up (TLS, `AUTH`, `SELECT`, its `CLIENT INFO` id learned) and kept idle after a whole
//! answer. An idle one is lent only to a caller on the runtime its driver runs on: one left on
//! a runtime alive but undriven costs the others nothing (no timeout, no fault), and is closed
//! when a connection of another runtime needs its room. One whose request did not end in a whole answer (a fault, an error the client
//! raised, a caller's future dropped mid-flight) is dropped, never reused, and remembered for
//! the next replay to close (`clients.rs`).
//!
//! Read-your-writes holds: a write runs on the master before its `WAIT` starts, so a caller
//! that awaited its waited write and then reads on the shared connection sees it.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use redis::aio::MultiplexedConnection;
use tokio::sync::{Semaphore, SemaphorePermit};
use tokio::task::JoinHandle;

use super::Failure;
use super::clients::{ClientId, Clients};
use crate::error::{Error, ErrorKind};

/// A connection the async view opened: its handle, its driver task (on the runtime current
/// when it was opened), and who it is to the server (if it said).
pub(super) struct Dialed {
    pub(super) conn: MultiplexedConnection,
    pub(super) driver: JoinHandle<()>,
    pub(super) client: Option<ClientId>,
    /// The runtime its driver runs on: it is lent only to callers on that runtime.
    pub(super) runtime: tokio::runtime::Id,
}

/// Whether `driver` was cancelled: its runtime shut down (a driver that ended by itself met
/// the connection's end: the server's doing).
pub(super) fn cancelled(driver: &mut JoinHandle<()>) -> bool {
    if !driver.is_finished() {
        return false;
    }
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    matches!(
        std::pin::Pin::new(driver).poll(&mut cx),
        std::task::Poll::Ready(Err(e)) if e.is_cancelled()
    )
}

/// One server's connections for waited writes (its async view's, shared by its asking view).
pub(super) struct Waited {
    idle: Mutex<Vec<Dialed>>,
    /// One per connection lent or open to be lent: `pool_size`.
    permits: Semaphore,
    size: u32,
    clients: Arc<Clients>,
}

impl Waited {
    /// At most `size` connections, none open yet; those dropped unanswered are remembered in
    /// `clients`.
    pub(super) fn new(size: u32, clients: Arc<Clients>) -> Waited {
        Waited {
            idle: Mutex::new(Vec::new()),
            permits: Semaphore::new(size as usize),
            size,
            clients,
        }
    }

    /// A connection for one waited write: an idle one, or one `dial` opens. While all `size`
    /// are lent, waits `connect_timeout` at most for one (then a local timeout: nothing was
    /// sent, nothing is against the server).
    pub(super) async fn lend(
        &self,
        connect_timeout: Duration,
        dial: impl Future<Output = Result<Dialed, Failure>>,
    ) -> Result<Lent<'_>, Failure> {
        let Ok(Ok(permit)) = tokio::time::timeout(connect_timeout, self.permits.acquire()).await
        else {
            return Err(Failure::Local(Error::new(
                ErrorKind::Timeout,
                format!(
                    "all {} connections for waited writes (pool_size) stayed busy for \
                     connect_timeout ({connect_timeout:?})",
                    self.size
                ),
            )));
        };
        let here = tokio::runtime::Handle::try_current().ok().map(|h| h.id());
        let mine = {
            let mut idle = self.idle.lock();
            // One whose driver ended (the server closed it while idle, or its runtime shut
            // down) carries nothing: it goes, unremembered.
            idle.retain(|d| !d.driver.is_finished());
            // Only one whose driver runs on the caller's runtime: another runtime may be alive
            // but undriven (a current-thread runtime outside `block_on`), and a write lent its
            // connection would time out on it, a fault against a healthy server.
            match idle.iter().rposition(|d| Some(d.runtime) == here) {
                Some(i) => Some(idle.remove(i)),
                None => {
                    // A new one: room made by closing the oldest idle ones of other runtimes
                    // (answered whole: nothing for a replay), so that at most `size` are open.
                    let lent = self.size as usize - self.permits.available_permits();
                    let room = (self.size as usize).saturating_sub(lent);
                    let excess = idle.len().saturating_sub(room);
                    for d in idle.drain(..excess) {
                        d.driver.abort();
                    }
                    None
                }
            }
        };
        let dialed = match mine {
            Some(d) => d,
            None => dial.await?,
        };
        Ok(Lent {
            pool: self,
            dialed: Some(dialed),
            kept: false,
            _permit: permit,
        })
    }

    /// Drops the idle connections (on shutdown).
    pub(super) fn clear(&self) {
        for d in self.idle.lock().drain(..) {
            d.driver.abort();
        }
    }
}

impl Drop for Waited {
    fn drop(&mut self) {
        self.clear();
    }
}

/// A connection lent to one waited write: given back on drop after [`keep`](Lent::keep) (a
/// whole answer: in step with the server), else dropped and remembered for the next replay
/// (a fault, or the caller's future dropped with its request perhaps in flight).
pub(super) struct Lent<'a> {
    pool: &'a Waited,
    dialed: Option<Dialed>,
    kept: bool,
    /// Released after the connection went back (fields drop after `Drop::drop`).
    _permit: SemaphorePermit<'a>,
}

impl Lent<'_> {
    pub(super) fn conn(&mut self) -> &mut MultiplexedConnection {
        &mut self.dialed.as_mut().expect("lent until dropped").conn
    }

    /// Its request was answered whole: it goes back idle.
    pub(super) fn keep(&mut self) {
        self.kept = true;
    }

    /// Whether its driver was cancelled (its runtime shut down under it: not the server's
    /// fault).
    pub(super) fn orphaned(&mut self) -> bool {
        self.dialed
            .as_mut()
            .is_some_and(|d| cancelled(&mut d.driver))
    }
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        let Some(d) = self.dialed.take() else { return };
        if self.kept && !d.driver.is_finished() {
            self.pool.idle.lock().push(d);
            return;
        }
        d.driver.abort();
        if !self.kept {
            // Its request's bytes may still be on their way: the next replay closes it.
            self.pool.clients.dropped(d.client);
        }
    }
}
