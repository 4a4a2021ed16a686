//! The sync backend's pool of blocking connections: at most `pool_size` open at once, each
//! opened within `connect_timeout` (its set-up and `CLIENT INFO` included) and under
//! `io_timeout` per operation; a connection that met a fault is dropped, not returned (and
//! remembered, by its id on the server, for the next replay to close), and one idle past
//! memcached's [`IDLE_TIMEOUT`] is closed rather than reused (servers and proxies close idle
//! connections on their own schedule). A write is sent only on a connection known to be open:
//! one idle past [`CHECK_AFTER`] answers a `PING` first ([`Pooled::begin_check`]), since a write
//! found stale after it was sent is not sent again (its reply may be what was lost).

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::blocking::Blocking;
use super::request::{Pack, Replies, pack_all};

use super::clients::{self, ClientId, Clients};
use super::setup::SetUp;
use super::{Failure, RedisConfig};
use crate::backend::memcached::IDLE_TIMEOUT;
use crate::error::{Error, ErrorKind};

pub(super) struct Pool {
    /// `host:port`, resolved at each connect.
    addr: String,
    /// The TLS of a `rediss://` server.
    #[cfg(feature = "redis-tls")]
    tls: Option<super::tls::Handshake>,
    /// The set-up each connect sends itself (RESP3's `HELLO`, `AUTH` with RESP2, `SELECT`),
    /// pipelined with `CLIENT INFO` ([`Pool::connect_within`]).
    set_up: SetUp,
    connect_timeout: Duration,
    io_timeout: Duration,
    size: usize,
    state: Mutex<State>,
    freed: Condvar,
    clients: Arc<Clients>,
}

/// How long a pooled connection may sit idle before a write on it is preceded by a `PING`
/// whose reply is read first ([`Pooled::begin_check`]): a connection the server closed meanwhile (its
/// `timeout`, a restart, a failover) is then found before the write is sent, not after. A
/// connection in steady use is never idle this long, and pays nothing.
pub(super) const CHECK_AFTER: Duration = Duration::from_millis(100);

/// The largest write buffer a pooled connection keeps (one of a batch of large values is
/// given back).
const KEPT_BUFFER: usize = 64 * 1024;

/// An open connection, and who it is to the server (if it said).
struct Open {
    conn: Blocking,
    client: Option<ClientId>,
    /// The bytes of the commands written last (kept up to [`KEPT_BUFFER`]: a batch's buffer
    /// grows once per connection, not once per call).
    packed: Vec<u8>,
    /// When it was last given back (or opened).
    idle_since: Instant,
}

#[derive(Default)]
struct State {
    /// Boxed: a connection is large, and moves in and out of the list (into a `Pooled` and
    /// back) on every call.
    #[allow(clippy::vec_box)]
    idle: Vec<Box<Open>>,
    /// Connections open (idle or checked out).
    open: usize,
    /// Raised by `clear`: connections checked out before it are not given back.
    generation: u64,
}

impl Pool {
    /// The pool of `config`'s server, `info` its URL's settings (checked by
    /// [`RedisConfig::client`]). Its connections are newcache's own ([`Blocking`]): the TCP
    /// connect, the TLS handshake and the whole set-up ([`SetUp::whole`]) are made here, each
    /// step within what is left of `connect_timeout`.
    pub(super) fn new(
        info: &redis::ConnectionInfo,
        config: &RedisConfig,
        clients: Arc<Clients>,
    ) -> crate::Result<Pool> {
        #[cfg(feature = "redis-tls")]
        let tls = super::tls::Handshake::of(info, config.tls.as_ref())?;
        Ok(Pool {
            addr: config.addr(),
            #[cfg(feature = "redis-tls")]
            tls,
            clients,
            set_up: SetUp::whole(info.redis_settings()),
            connect_timeout: config.connect_timeout,
            io_timeout: config.io_timeout,
            size: config.pool_size as usize,
            state: Mutex::new(State::default()),
            freed: Condvar::new(),
        })
    }

    /// An idle connection, or a new one while fewer than `size` are open; otherwise waits up to
    /// `connect_timeout` for one to be given back. Each wait or connect within what is left
    /// until `by`, when given ([`within`]).
    pub(super) fn checkout(&self, by: Option<Instant>) -> Result<Pooled<'_>, Failure> {
        let mut deadline = None;
        let mut state = self.state.lock();
        loop {
            let generation = state.generation;
            if let Some(conn) = state.idle.pop() {
                let idle = conn.idle_since.elapsed();
                if idle < IDLE_TIMEOUT {
                    return Ok(Pooled::new(self, conn, generation, Some(idle)));
                }
                // The most recently used is past the age: the others, idle longer, are too.
                // Closed whole (every request on them was answered): nothing for a replay.
                let old = std::mem::take(&mut state.idle);
                state.open -= old.len() + 1;
                drop(state);
                drop((conn, old));
                self.freed.notify_all();
                state = self.state.lock();
                continue;
            }
            if state.open < self.size {
                state.open += 1;
                drop(state);
                return match self.connect(by) {
                    Ok(conn) => Ok(Pooled::new(self, conn, generation, None)),
                    Err(f) => {
                        self.closed(generation);
                        Err(f)
                    }
                };
            }
            let deadline =
                *deadline.get_or_insert_with(|| Instant::now() + within(self.connect_timeout, by));
            if self.freed.wait_until(&mut state, deadline).timed_out() {
                // A local wait: nothing against the server.
                return Err(Failure::Local(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "all {} pooled connections stayed busy for connect_timeout ({:?})",
                        self.size, self.connect_timeout
                    ),
                )));
            }
        }
    }

    /// A new connection, its set-up done (RESP3's `HELLO` or RESP2's `AUTH`, `SELECT` and
    /// `CLIENT INFO`, which learns its id, pipelined in one round trip, two for `AUTH`'s old
    /// form: [`SetUp`]), all within `connect_timeout`: a server that accepts connections but
    /// does not answer (hung) costs a connect that, not a connect and an `io_timeout`. Less
    /// when `by` is near ([`within`]).
    ///
    /// The bound is kept by socket timeouts, each set to what is left before a step, and they
    /// bound each read, not a step: a server that sends a step's bytes a few at a time, each
    /// within the time left, can stretch a connect past `connect_timeout` (the async connect
    /// has one timer for the whole).
    fn connect(&self, by: Option<Instant>) -> Result<Box<Open>, Failure> {
        // Reached after the deadline: it gets [`LATE`] alone.
        let late = by.is_some_and(|by| by.saturating_duration_since(Instant::now()) < LATE);
        let connect_timeout = within(self.connect_timeout, by);
        self.connect_within(connect_timeout)
            .map_err(|f| starved(f, late))
    }

    fn connect_within(&self, connect_timeout: Duration) -> Result<Box<Open>, Failure> {
        let started = Instant::now();
        let io = |e: std::io::Error| super::connect_failure(e.into());
        // The TLS settings first (the system's roots read): the handshake then has what the
        // TCP connect left of connect_timeout.
        #[cfg(feature = "redis-tls")]
        let tls = match &self.tls {
            Some(tls) => Some((tls, tls.config().map_err(Failure::Local)?)),
            None => None,
        };
        let over = |conn: Blocking| {
            #[cfg(feature = "redis-tls")]
            if let Some((tls, settings)) = tls {
                return conn.tls(|sock| tls.run_blocking(settings, sock));
            }
            Ok(conn)
        };
        // `CLIENT INFO` pipelined with the set-up, its reply read within what is left.
        let info = clients::info();
        let mut conn = self
            .set_up
            .open(&self.addr, started, connect_timeout, over, Some(&info))?;
        let client = self
            .clients
            .learned(conn.recv())
            .map_err(super::connect_failure)?;
        conn.set_timeouts(self.io_timeout).map_err(io)?;
        Ok(Box::new(Open {
            conn,
            client,
            packed: Vec::new(),
            idle_since: Instant::now(),
        }))
    }

    /// A checked-out connection was dropped (not given back).
    fn closed(&self, generation: u64) {
        let mut state = self.state.lock();
        if state.generation == generation {
            state.open -= 1;
        }
        drop(state);
        self.freed.notify_one();
    }

    fn give_back(&self, mut conn: Box<Open>, generation: u64) {
        conn.idle_since = Instant::now();
        let mut state = self.state.lock();
        if state.generation == generation {
            state.idle.push(conn);
        }
        drop(state);
        self.freed.notify_one();
    }

    /// Drops the idle connections (one was found closed by the server: the others, idle as
    /// long, likely are too).
    pub(super) fn drop_idle(&self) {
        let mut state = self.state.lock();
        let n = state.idle.len();
        state.idle.clear();
        state.open -= n;
        drop(state);
        self.freed.notify_all();
    }

    /// Drops every idle connection and forgets those checked out (the server was marked dead:
    /// they are not given back).
    pub(super) fn clear(&self) {
        let mut state = self.state.lock();
        state.idle.clear();
        state.open = 0;
        state.generation += 1;
        drop(state);
        self.freed.notify_all();
    }
}

/// A checked-out connection: dropped on drop unless [`keep`](Pooled::keep) was called (after a
/// whole answer: the connection is in step with the server).
pub(super) struct Pooled<'a> {
    pool: &'a Pool,
    conn: Option<Box<Open>>,
    generation: u64,
    keep: bool,
    /// How long it sat idle, if taken from the idle list (it may have been closed by the server
    /// meanwhile); `None` for a fresh connect.
    idle: Option<Duration>,
    /// When its check's `PING` was written ([`begin_check`](Pooled::begin_check)).
    check_written: Option<Instant>,
}

impl<'a> Pooled<'a> {
    fn new(pool: &'a Pool, conn: Box<Open>, generation: u64, idle: Option<Duration>) -> Pooled<'a> {
        Pooled {
            pool,
            conn: Some(conn),
            generation,
            keep: false,
            idle,
            check_written: None,
        }
    }

    /// Whether it came from the idle list (rather than a fresh connect) and was not
    /// [`check`](Pooled::begin_check)ed since.
    pub(super) fn reused(&self) -> bool {
        self.idle.is_some()
    }

    /// Whether it sat idle past [`CHECK_AFTER`]: a write is sent on it only after a
    /// [`check`](Pooled::begin_check).
    pub(super) fn unchecked(&self) -> bool {
        self.idle.is_some_and(|idle| idle > CHECK_AFTER)
    }

    /// A check's `PING` written; [`end_check`](Pooled::end_check) reads its reply (a cluster
    /// batch writes every node's before it reads any reply).
    pub(super) fn begin_check(&mut self) -> redis::RedisResult<()> {
        self.check_written = Some(Instant::now());
        self.write(&[&redis::cmd("PING")])
    }

    /// Whether its check was written after a cluster batch's deadline `by` (less than [`LATE`]
    /// before it: another node's connect spent it), so that its reply had [`LATE`] alone
    /// ([`starved`]).
    pub(super) fn checked_late(&self, by: Option<Instant>) -> bool {
        self.check_written
            .is_some_and(|at| by.is_some_and(|by| by.saturating_duration_since(at) < LATE))
    }

    /// The reply to [`begin_check`](Pooled::begin_check)'s `PING` read (any reply: an error
    /// reply, a `NOPERM` of a user without `PING`, is the server's too): the connection is
    /// open, and nothing is pending on it. An error says it is not (closed:
    /// `is_connection_dropped`) or the server did not answer in `timeout` (else
    /// `io_timeout`); nothing else was written on it.
    pub(super) fn end_check(&mut self, timeout: Option<Duration>) -> redis::RedisResult<()> {
        self.read(1, timeout)?;
        self.idle = None;
        Ok(())
    }

    pub(super) fn keep(&mut self) {
        self.keep = true;
    }

    fn conn(&mut self) -> &mut Blocking {
        &mut self
            .conn
            .as_mut()
            .expect("a pooled connection until dropped")
            .conn
    }

    /// Writes `cmds`, pipelined; [`read`](Pooled::read) reads their replies.
    pub(super) fn write<C: Pack + ?Sized>(&mut self, cmds: &[&C]) -> redis::RedisResult<()> {
        let open = self
            .conn
            .as_mut()
            .expect("a pooled connection until dropped");
        open.packed.clear();
        pack_all(cmds, &mut open.packed);
        let sent = open.conn.send(&open.packed);
        if open.packed.capacity() > KEPT_BUFFER {
            open.packed = Vec::new();
        }
        sent
    }

    /// The replies to the `n` commands written last, error replies inline; each read within
    /// `timeout` when given (what is left of a batch's window), else `io_timeout`.
    pub(super) fn read(
        &mut self,
        n: usize,
        timeout: Option<Duration>,
    ) -> redis::RedisResult<Replies> {
        let io_timeout = self.pool.io_timeout;
        let conn = self.conn();
        if let Some(t) = timeout {
            conn.set_read_timeout(t)?;
        }
        let mut replies = Replies::with_capacity(n);
        // RESP3 may put pushed data between replies: left out.
        conn.recv_many(n, &mut replies)?;
        if timeout.is_some() {
            conn.set_read_timeout(io_timeout)?;
        }
        Ok(replies)
    }
}

/// The time of one exchange with several servers (a cluster's batch: every node's part
/// written, then every reply read): its replies are read within `io_timeout` of the first read,
/// and the servers read after that share one grace window ([`GRACE`]), as memcached's batches
/// do, so one hung server costs the batch one `io_timeout`, not one per server.
pub(super) struct Window {
    /// When it opened.
    opened: Instant,
    start: Instant,
    deadline: Instant,
    grace: Option<Instant>,
    /// The batch's deadline for its connects ([`within`]) when the window opened: a read sent
    /// again on a fresh connection (its pooled one found closed) connects within what is left
    /// of it, moved on by the time read since ([`connect_by`](Window::connect_by)).
    connect_by: Option<Instant>,
    /// The time the reads spent on such connects (not reading time).
    connecting: Duration,
    /// Given [`LATE`] alone (a refresh's, begun after the batch's connect deadline): a read
    /// that times out in it says nothing against the server ([`starved`]).
    cut: bool,
    /// Spends the batch's connect deadline itself ([`until`](Window::until)): its reads and a
    /// reconnect share `connect_by`, which neither reading nor connecting moves on.
    shares: bool,
}

/// The grace window of servers read late (memcached's).
const GRACE: Duration = crate::backend::memcached::GRACE;

/// What a node reached after a cluster batch's connect deadline still gets for its connect
/// (or its pooled connection's check, or a wait for a free connection): a connect to a live
/// server, TLS included, takes far less; each hung node after the first costs a batch this.
pub(super) const LATE: Duration = Duration::from_millis(100);

/// `t`, or what is left until `by` if that is less (a cluster batch's deadline for its
/// connects: one `connect_timeout` for them all, not one per node), [`LATE`] at least.
pub(super) fn within(t: Duration, by: Option<Instant>) -> Duration {
    match by {
        Some(by) => t.min(by.saturating_duration_since(Instant::now()).max(LATE)),
        None => t,
    }
}

/// A connect's (or a check's) failure `f`; `late`: it was begun after its cluster batch's
/// shared deadline (another node's connect spent it) and had [`LATE`] alone. A timeout then
/// says nothing against the server, and is not counted as a fault; a node that had more of the
/// deadline and did not answer in it is one.
pub(super) fn starved(f: Failure, late: bool) -> Failure {
    match f {
        Failure::Fault(e) if late && e.kind() == ErrorKind::Timeout => Failure::Local(e),
        f => f,
    }
}

impl Window {
    /// A window of `io_timeout` from now, the batch's connects due by `connect_by`.
    pub(super) fn new(io_timeout: Duration, connect_by: Option<Instant>) -> Window {
        let start = Instant::now();
        Window {
            opened: start,
            start,
            deadline: start + io_timeout,
            grace: None,
            connect_by,
            connecting: Duration::ZERO,
            cut: false,
            shares: false,
        }
    }

    /// A window ending at `end` (a cluster batch's refresh of its map, within what is left of
    /// the batch's connect deadline), or `io_timeout` from now if that is sooner; [`LATE`] from
    /// now at least. A read that times out in a window that got [`LATE`] alone counts no fault
    /// ([`cut`](Window::cut)).
    pub(super) fn until(end: Instant, io_timeout: Duration) -> Window {
        let now = Instant::now();
        let deadline = end.max(now + LATE).min(now + io_timeout);
        Window {
            opened: now,
            // As if opened `io_timeout` before its end: a read is timed by the window only once
            // less than the connection's own `io_timeout` is left of it.
            start: deadline.checked_sub(io_timeout).unwrap_or(now),
            deadline,
            grace: None,
            connect_by: Some(end),
            connecting: Duration::ZERO,
            cut: end <= now + LATE,
            shares: true,
        }
    }

    /// The batch's deadline for its connects, moved on by the time read since the window
    /// opened (reading time is not counted against the connects).
    pub(super) fn connect_by(&self) -> Option<Instant> {
        if self.shares {
            return self.connect_by;
        }
        let read = self.opened.elapsed().saturating_sub(self.connecting);
        self.connect_by.map(|by| by + read)
    }

    /// A read spent `took` connecting: not reading time, so the window moves on by it (the
    /// read sent again on the fresh connection has what was left of the window before).
    pub(super) fn connected(&mut self, took: Duration) {
        self.connecting += took;
        if self.shares {
            return;
        }
        self.start += took;
        self.deadline += took;
        self.grace = None;
    }

    /// Given [`LATE`] alone by a batch's connect deadline ([`until`](Window::until)).
    pub(super) fn cut(&self) -> bool {
        self.cut
    }

    /// The time the reads spent connecting.
    pub(super) fn connecting(&self) -> Duration {
        self.connecting
    }

    /// The read timeout of a server read now: `None` (the connection's own `io_timeout`) while
    /// that ends within [`GRACE`] of the deadline, which spares a batch the system calls that
    /// change it; else what is left of the window (the grace window, past the deadline).
    pub(super) fn timeout(&mut self) -> Option<Duration> {
        let now = Instant::now();
        if now <= self.start + GRACE {
            return None;
        }
        let end = if now < self.deadline {
            self.deadline
        } else {
            *self.grace.get_or_insert(now + GRACE)
        };
        // A zero read timeout is refused: a millisecond at least.
        Some(
            end.saturating_duration_since(now)
                .max(Duration::from_millis(1)),
        )
    }
}

impl Drop for Pooled<'_> {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            if self.keep && conn.conn.is_open() {
                self.pool.give_back(conn, self.generation);
            } else {
                // Its request's bytes may still be on their way: the next replay closes it.
                self.pool.clients.dropped(conn.client);
                self.pool.closed(self.generation);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn a_reads_reconnect_is_not_reading_time() {
        let by = Instant::now() + MS(1_000);
        let mut w = Window::new(MS(500), Some(by));
        let (start, deadline) = (w.start, w.deadline);
        w.connected(MS(300));
        // The read sent again has what was left of the window before its connect.
        assert_eq!((w.start, w.deadline), (start + MS(300), deadline + MS(300)));
        assert_eq!(w.connecting(), MS(300));
        // The connects' deadline moves on by the time read, not by the time connecting.
        assert_eq!(
            w.connect_by(),
            Some(by),
            "nothing read yet (300 ms were connecting)"
        );
        let mut w = Window::new(MS(500), Some(by));
        std::thread::sleep(MS(50));
        let moved = w.connect_by().unwrap() - by;
        assert!(moved >= MS(50) && moved <= w.opened.elapsed(), "{moved:?}");
        w.connected(MS(30));
        let moved = w.connect_by().unwrap() - by;
        assert!(
            moved >= MS(20) && moved <= w.opened.elapsed() - MS(30),
            "{moved:?}"
        );
    }

    #[test]
    fn a_refresh_window_cut_short_by_the_batch_deadline_excuses_its_timeouts() {
        let now = Instant::now();
        assert!(Window::until(now + MS(10), MS(1_000)).cut());
        assert!(
            !Window::until(now + MS(400), MS(1_000)).cut(),
            "more than LATE: a fault"
        );
        assert!(!Window::until(now + MS(5_000), MS(1_000)).cut());
        // A refresh's window spends the batch's deadline: a reconnect moves nothing on.
        let mut w = Window::until(now + MS(400), MS(1_000));
        let deadline = w.deadline;
        w.connected(MS(300));
        assert_eq!(
            (w.deadline, w.connect_by()),
            (deadline, Some(now + MS(400)))
        );
        assert!(!Window::new(MS(1_000), Some(now)).cut());
        let timeout = || Failure::Fault(Error::new(ErrorKind::Timeout, "no reply in time"));
        assert!(matches!(starved(timeout(), true), Failure::Local(_)));
        assert!(matches!(starved(timeout(), false), Failure::Fault(_)));
        let io = Failure::Fault(Error::new(ErrorKind::Backend, "i/o error"));
        assert!(matches!(starved(io, true), Failure::Fault(_)));
    }
}
