//! One memcached server as the backend sees it: its address, its connection pool and its health.
//!
//! The pool is written here rather than taken from r2d2: connections are made inline, in the
//! calling thread, within `connect_timeout`, so a server that swallows SYNs holds only the callers
//! that wait for it, never a connector shared with the other servers.

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::conn::Conn;
use crate::backend::server::Options;
use crate::backend::server::health::Health;
use crate::error::{Error, ErrorKind};

/// Idle connections older than this are closed rather than reused (servers and proxies close
/// idle connections on their own schedule). The Redis pool's too.
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(300);

pub(crate) struct Server {
    pub(crate) addr: String,
    /// Shared with the engine of a sync `Cache` (`blended.rs`): both paths see one
    /// record of the server's faults.
    pub(crate) health: Arc<Health>,
    options: Options,
    /// Connections at most (`pool_size`).
    size: usize,
    pool: Mutex<Pool>,
    freed: Condvar,
    /// Bumped when the server is marked dead: connections of an older generation (all broken if
    /// it was restarted) are closed instead of returned, rather than found out one by one.
    generation: AtomicU64,
}

#[derive(Default)]
struct Pool {
    /// Boxed: a checkout and a return move a pointer, not the connection and its buffers'
    /// headers (a few hundred bytes, copied at each step of a get).
    #[allow(clippy::vec_box)]
    // The boxes move into `Pooled` and back: the point is their moves.
    idle: Vec<Box<Conn>>,
    /// Connections checked out or being made.
    busy: usize,
}

impl fmt::Debug for Server {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Server")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

/// Why no connection could be had.
pub(crate) enum CheckoutError {
    /// Every connection stayed busy for `connect_timeout`: a local wait, not the server's fault.
    PoolBusy(Error),
    /// Connecting failed (refused, timed out, unresolvable): a transport fault.
    Connect(Error),
}

/// A checked-out connection; back to the pool on drop unless broken or of an older generation.
pub(crate) struct Pooled<'a> {
    server: &'a Server,
    conn: Option<Box<Conn>>,
    generation: u64,
}

impl Deref for Pooled<'_> {
    type Target = Conn;
    fn deref(&self) -> &Conn {
        self.conn.as_ref().expect("present until drop")
    }
}

impl DerefMut for Pooled<'_> {
    fn deref_mut(&mut self) -> &mut Conn {
        self.conn.as_mut().expect("present until drop")
    }
}

impl Drop for Pooled<'_> {
    fn drop(&mut self) {
        let conn = self.conn.take();
        let current = self.server.generation.load(Ordering::Acquire) == self.generation;
        let mut pool = self.server.pool.lock();
        pool.busy -= 1;
        if let Some(mut c) = conn.filter(|c| !c.broken && current) {
            // Idle since its last syscall (within microseconds of now, for a connection that
            // was used; no clock read).
            c.idle_since = c.last_active();
            pool.idle.push(c);
        }
        drop(pool);
        self.server.freed.notify_one();
    }
}

impl Server {
    pub(crate) fn new(addr: String, options: &Options) -> Server {
        Server {
            health: Arc::new(Health::new("memcached", addr.as_str(), options)),
            addr,
            options: *options,
            size: options.pool_size as usize,
            pool: Mutex::new(Pool::default()),
            freed: Condvar::new(),
            generation: AtomicU64::new(0),
        }
    }

    /// A connection: an idle one (most recently used first), or a new one made in this thread.
    /// Waits at most `connect_timeout` in all (for a free slot, then to connect).
    pub(crate) fn checkout(&self) -> std::result::Result<Pooled<'_>, CheckoutError> {
        let mut now = Instant::now();
        let deadline = now + self.options.connect_timeout;
        let generation = self.generation.load(Ordering::Acquire);
        let mut pool = self.pool.lock();
        while pool.busy >= self.size {
            let waited = self.freed.wait_until(&mut pool, deadline);
            // The idle check below counts from after the wait.
            now = Instant::now();
            if waited.timed_out() && pool.busy >= self.size {
                return Err(CheckoutError::PoolBusy(
                    Error::new(
                        ErrorKind::Timeout,
                        format!(
                            "all {} connections to memcached at {} stayed busy for {:?}",
                            self.size, self.addr, self.options.connect_timeout
                        ),
                    )
                    .at_server(&self.addr),
                ));
            }
        }
        pool.busy += 1;
        let idle = std::iter::from_fn(|| pool.idle.pop())
            .find(|c| now.saturating_duration_since(c.idle_since) < IDLE_TIMEOUT)
            .map(|mut c| {
                c.reused = true;
                c
            });
        drop(pool);
        let mut pooled = Pooled {
            server: self,
            conn: idle,
            generation,
        };
        if pooled.conn.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            match Conn::connect(
                &self.addr,
                left.max(Duration::from_millis(1)),
                self.options.io_timeout,
            ) {
                Ok(c) => pooled.conn = Some(Box::new(c)),
                Err(e) => {
                    // `pooled` drops without a connection: the slot is freed.
                    return Err(CheckoutError::Connect(self.annotate(e)));
                }
            }
        }
        Ok(pooled)
    }

    /// Forgets every idle connection and every one checked out now (they are closed when
    /// returned): called when the server is marked dead.
    pub(crate) fn reset(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        let idle = std::mem::take(&mut self.pool.lock().idle);
        drop(idle);
    }

    /// Drops the idle connections (they may all be stale: the server restarted since they were
    /// opened); connections in use are left to their callers.
    pub(crate) fn drop_idle(&self) {
        let idle = std::mem::take(&mut self.pool.lock().idle);
        drop(idle);
    }

    /// Names the server in a backend error, once: an error that names its server already
    /// (a failed connect, a busy pool, "marked dead") says where it happened.
    pub(crate) fn annotate(&self, e: Error) -> Error {
        if e.is_backend() && e.server().is_none() {
            e.in_context(format!("memcached at {}", self.addr))
                .at_server(&self.addr)
        } else {
            e
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A listener that accepts in the background and counts the connections made to it.
    fn counting_listener() -> (String, Arc<std::sync::atomic::AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = accepted.clone();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for s in listener.incoming().flatten() {
                count.fetch_add(1, Ordering::SeqCst);
                held.push(s);
            }
        });
        (addr, accepted)
    }

    fn server(addr: &str) -> Server {
        let options = Options {
            connect_timeout: Duration::from_secs(2),
            io_timeout: Duration::from_secs(2),
            pool_size: 4,
            ..Options::default()
        };
        Server::new(addr.to_owned(), &options)
    }

    fn accepted_by(n: &std::sync::atomic::AtomicUsize, want: usize) -> usize {
        let deadline = Instant::now() + Duration::from_secs(5);
        while n.load(Ordering::SeqCst) < want && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        n.load(Ordering::SeqCst)
    }

    #[test]
    fn a_connection_back_in_the_pool_is_reused_while_recently_active() {
        let (addr, accepted) = counting_listener();
        let s = server(&addr);
        drop(s.checkout().ok().unwrap());
        let again = s.checkout().ok().unwrap();
        assert!(again.reused, "the pooled connection was taken again");
        drop(again);
        assert_eq!(accepted_by(&accepted, 1), 1, "one connection made");
    }

    #[test]
    fn a_connection_last_active_longer_ago_than_the_idle_timeout_is_not_reused() {
        let (addr, accepted) = counting_listener();
        let s = server(&addr);
        let mut c = s.checkout().ok().unwrap();
        // Its last syscall as if it were IDLE_TIMEOUT and a second ago (skipped where `Instant`
        // cannot reach that far back).
        let Some(long_ago) = Instant::now().checked_sub(IDLE_TIMEOUT + Duration::from_secs(1))
        else {
            return;
        };
        c.set_last_active_for_test(long_ago);
        drop(c);
        let fresh = s.checkout().ok().unwrap();
        assert!(!fresh.reused, "an expired connection is closed, not reused");
        drop(fresh);
        assert_eq!(accepted_by(&accepted, 2), 2, "a second connection made");
    }
}
