//! One TCP connection to one memcached: pipelined exchanges under a per-operation deadline. A
//! connection that saw an I/O error, a timeout or a reply it could not follow is marked broken
//! (its pool drops it); a transport fault is also recorded so that only those count toward
//! marking the server dead.

use std::io::{self, BufReader, Read, Write as _};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::wire;
use crate::backend::{Item, StoreOutcome, Write, tcp};
use crate::error::{Error, ErrorKind, Result};

/// Commands written before their replies are read, in a pipelined batch. Bounds what both sides
/// must buffer (memcached stops reading while it cannot write its replies).
pub(crate) const PIPELINE_CHUNK: usize = 512;
/// Keys per `gets` line (bounds the line memcached and proxies must buffer).
pub(crate) const KEYS_PER_LINE: usize = 100;
/// Keys per pipelined write of `gets` lines.
pub(crate) const GETS_PER_WRITE: usize = 2048;

/// A socket whose every read and write ends by one deadline: before each syscall the socket
/// timeout is set to the time left, so a server that trickles bytes cannot stretch an operation
/// past `io_timeout` one syscall at a time.
#[derive(Debug)]
pub(crate) struct DeadlineStream {
    stream: TcpStream,
    deadline: Instant,
    /// The socket's current read and write timeouts (a `setsockopt` only when they must change).
    armed: [Duration; 2],
    /// Until when an exchange that reached its socket late may still wait: the deadline plus
    /// [`GRACE`], one window for the whole batch however many servers are late.
    grace_until: Instant,
    /// Per direction (read, write): whether the deadline had passed before this exchange's
    /// first syscall in it (`None`: none yet).
    started_late: [Option<bool>; 2],
    /// The clock as the deadline was set, for the syscall that follows at once (an exchange's
    /// write): one clock read fewer. Cleared by every other setting of the deadline.
    fresh: Option<Instant>,
    /// When the last syscall began (or the connection was made): when it was last active.
    last: Instant,
}

/// How long an exchange that reaches its socket (to read, or to write) only after the deadline
/// may still wait: one window, opened when a batch's first late server gets its turn and shared
/// by every later one (a single call's window ends this long after its deadline). A batch reads its servers one after another under one deadline: a
/// hung server read first must not starve the others, whose replies are already waiting in their
/// sockets (reading them takes no waiting at all), and a server whose turn came too late is not
/// blamed. An exchange that started in time gets no grace: `io_timeout` bounds it.
pub(crate) const GRACE: Duration = Duration::from_millis(10);

/// How far a syscall may end past the deadline before its timeout is set again (saves a
/// `setsockopt` on nearly every call; far below any timeout a caller would configure).
const SLACK: Duration = Duration::from_millis(2);

impl DeadlineStream {
    fn new(stream: TcpStream, io_timeout: Duration) -> io::Result<DeadlineStream> {
        stream.set_read_timeout(Some(io_timeout))?;
        stream.set_write_timeout(Some(io_timeout))?;
        let now = Instant::now();
        Ok(DeadlineStream {
            stream,
            deadline: now + io_timeout,
            armed: [io_timeout; 2],
            grace_until: now + io_timeout + GRACE,
            started_late: [None; 2],
            fresh: None,
            last: now,
        })
    }

    /// Whether this exchange reached its socket (in either direction) only after its deadline:
    /// its time was spent on other servers of the batch.
    pub(crate) fn started_late(&self) -> bool {
        self.started_late.contains(&Some(true))
    }

    /// Runs one syscall (`write` = index 1) with the socket timeout at most the time left;
    /// retries a timeout that fired early (a timeout set for an earlier, shorter remainder).
    fn call<T>(
        &mut self,
        dir: usize,
        mut op: impl FnMut(&mut TcpStream) -> io::Result<T>,
    ) -> io::Result<T> {
        loop {
            let now = self.fresh.take().unwrap_or_else(Instant::now);
            self.last = now;
            let mut left = self.deadline.saturating_duration_since(now);
            let on_grace = left.is_zero();
            let late = *self.started_late[dir].get_or_insert(on_grace);
            if on_grace {
                left = self.grace_until.saturating_duration_since(now);
                if !late || left.is_zero() {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "io_timeout reached",
                    ));
                }
            }
            if self.armed[dir] > left + SLACK || self.armed[dir] + SLACK < left {
                if dir == 0 {
                    self.stream.set_read_timeout(Some(left))?;
                } else {
                    self.stream.set_write_timeout(Some(left))?;
                }
                self.armed[dir] = left;
            }
            match op(&mut self.stream) {
                // Early (armed for a longer remainder), at the deadline, or out of grace: the
                // top of the loop decides.
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock
                            | io::ErrorKind::TimedOut
                            | io::ErrorKind::Interrupted
                    ) => {}
                other => return other,
            }
        }
    }
}

impl Read for DeadlineStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.call(0, |s| s.read(buf))
    }
}

impl io::Write for DeadlineStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.call(1, |s| s.write(buf))
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The reader a reply decoder gets.
pub(crate) type Reader = BufReader<DeadlineStream>;

/// A connection to one server.
#[derive(Debug)]
pub(crate) struct Conn {
    stream: Reader,
    out: Vec<u8>,
    io_timeout: Duration,
    /// Out of step with the server: never reused.
    pub(crate) broken: bool,
    /// Saw a transport fault (I/O error, timeout, closed, unparseable reply): counts toward
    /// marking the server dead. A complete error reply (`CLIENT_ERROR`, ...) does not.
    pub(crate) fault: bool,
    /// Read a complete reply (a value or an error reply) since this was last reset: the server
    /// answered.
    pub(crate) answered: bool,
    /// When it was last returned to its pool (idle connections expire).
    pub(crate) idle_since: Instant,
    /// Taken from the pool's idle connections (not made for this checkout): if it fails before
    /// any answer, it may simply be stale (the server restarted since).
    pub(crate) reused: bool,
}

impl Conn {
    /// Resolves `addr` (on every connect, so a server that moved is found again) and connects
    /// within `connect_timeout`.
    pub(crate) fn connect(
        addr: &str,
        connect_timeout: Duration,
        io_timeout: Duration,
    ) -> Result<Conn> {
        let addrs: Vec<SocketAddr> = addr
            .to_socket_addrs()
            .map_err(|e| Error::with_source(ErrorKind::Backend, "cannot resolve its address", e))?
            .collect();
        let s = tcp::connect_first(addrs, Instant::now(), connect_timeout).map_err(|n| {
            n.last.map_or_else(
                || {
                    Error::new(
                        ErrorKind::Timeout,
                        format!("could not connect in time ({connect_timeout:?})"),
                    )
                },
                |e| Error::io(e, "could not connect"),
            )
        })?;
        s.set_nodelay(true)?;
        Ok(Conn {
            stream: BufReader::with_capacity(16 * 1024, DeadlineStream::new(s, io_timeout)?),
            out: Vec::with_capacity(4096),
            io_timeout,
            broken: false,
            fault: false,
            answered: false,
            idle_since: Instant::now(),
            reused: false,
        })
    }

    /// Sets the deadline of the next reads and writes.
    pub(crate) fn set_deadline(&mut self, deadline: Instant) {
        let s = self.stream.get_mut();
        s.deadline = deadline;
        s.grace_until = deadline + GRACE;
        s.started_late = [None; 2];
        s.fresh = None;
    }

    /// When this connection last made a syscall (or was made): when it fell idle, once back in
    /// its pool.
    pub(crate) fn last_active(&self) -> Instant {
        self.stream.get_ref().last
    }

    /// Sets when this connection was last active (its idle expiry's tests).
    #[cfg(test)]
    pub(crate) fn set_last_active_for_test(&mut self, at: Instant) {
        self.stream.get_mut().last = at;
    }

    /// Moves the end of the grace window (a batch shares one among its late servers).
    pub(crate) fn set_grace_until(&mut self, until: Instant) {
        self.stream.get_mut().grace_until = until;
    }

    /// Whether the current exchange reached its socket only after its deadline.
    pub(crate) fn started_late(&self) -> bool {
        self.stream.get_ref().started_late()
    }

    /// Records an error of an exchange: anything that may leave unread reply bytes breaks the
    /// connection; anything but a complete error reply is a transport fault.
    pub(crate) fn note(&mut self, e: &Error) {
        if !wire::leaves_connection_usable(e) {
            self.broken = true;
        }
        if !wire::is_server_reply(e) {
            self.fault = true;
        }
    }

    /// Encodes with `encode` and writes the request in one write. An encoder error (bad input)
    /// is returned before anything is sent and leaves the connection as it was.
    pub(crate) fn send(&mut self, encode: impl FnOnce(&mut Vec<u8>) -> Result<()>) -> Result<()> {
        self.out.clear();
        encode(&mut self.out)?;
        let r = self
            .stream
            .get_mut()
            .write_all(&self.out)
            .map_err(Error::from);
        if let Err(e) = &r {
            self.note(e);
        }
        // Do not keep a multi-megabyte buffer around after a large write.
        if self.out.capacity() > 1 << 20 {
            self.out = Vec::with_capacity(4096);
        }
        r
    }

    /// Reads replies with `decode`.
    pub(crate) fn recv<T>(&mut self, decode: impl FnOnce(&mut Reader) -> Result<T>) -> Result<T> {
        let r = decode(&mut self.stream);
        match &r {
            Ok(_) => self.answered = true,
            Err(e) => {
                self.note(e);
                self.answered |= !self.fault;
            }
        }
        r
    }

    /// One exchange under a fresh `io_timeout` deadline: send, then read the replies.
    fn exchange<T>(
        &mut self,
        encode: impl FnOnce(&mut Vec<u8>) -> Result<()>,
        decode: impl FnOnce(&mut Reader) -> Result<T>,
    ) -> Result<T> {
        let now = Instant::now();
        self.set_deadline(now + self.io_timeout);
        // The write follows at once, after the encoding: it reads no clock of its own. Its
        // socket timeout is armed longer by the encoding's time (a few hundred nanoseconds, more
        // for a value of megabytes): it may fire that much late, never early.
        self.stream.get_mut().fresh = Some(now);
        self.send(encode)?;
        self.recv(decode)
    }

    /// [`exchange`](Conn::exchange) for a command that changes the server: a transport failure
    /// after its first byte may have been written (a write error, a timeout or a closed
    /// connection while waiting for the reply) leaves the outcome unknown, and says so. An error
    /// reply, or a command refused before sending, is not unknown: it was not applied.
    fn write_exchange<T>(
        &mut self,
        encode: impl FnOnce(&mut Vec<u8>) -> Result<()>,
        decode: impl FnOnce(&mut Reader) -> Result<T>,
    ) -> Result<T> {
        self.exchange(encode, decode).map_err(unknown_if_sent)
    }

    /// Reads one key.
    pub(crate) fn get(&mut self, key: &str, item_size: usize) -> Result<Option<Item>> {
        let mut out = [Ok(None)];
        self.exchange(
            |b| wire::encode_gets(b, &[key]),
            |r| wire::read_slots(r, item_size, &[key], &mut out),
        )?;
        let [item] = out;
        item
    }

    /// Deletes one key: `true` if it existed.
    pub(crate) fn delete(&mut self, key: &str) -> Result<bool> {
        self.write_exchange(|b| wire::encode_delete(b, key), wire::read_delete)
    }

    /// Deletes every key (pipelined, [`PIPELINE_CHUNK`] per exchange), whether or not it exists;
    /// a key the server refuses with an error reply is passed over.
    pub(crate) fn delete_all(&mut self, keys: &[&str]) -> Result<usize> {
        let mut refused = 0;
        for part in keys.chunks(PIPELINE_CHUNK) {
            refused += self.write_exchange(
                |b| part.iter().try_for_each(|k| wire::encode_delete(b, k)),
                |r| {
                    let mut refused = 0;
                    for _ in part {
                        match wire::read_delete(r) {
                            Err(e) if crate::backend::server::outage::refused(&e) => refused += 1,
                            Err(e) => return Err(e),
                            Ok(_) => {}
                        }
                    }
                    Ok(refused)
                },
            )?;
        }
        Ok(refused)
    }

    pub(crate) fn store(&mut self, w: &Write<'_>, max_value: usize) -> Result<StoreOutcome> {
        self.write_exchange(|b| wire::encode_store(b, w, max_value), wire::read_store)
    }

    /// A write followed by a read of the same key, pipelined in one round trip.
    pub(crate) fn store_then_get(
        &mut self,
        w: &Write<'_>,
        max_value: usize,
        item_size: usize,
    ) -> Result<(StoreOutcome, Option<Item>)> {
        let mut out = [Ok(None)];
        let outcome = self.write_exchange(
            |b| {
                wire::encode_store(b, w, max_value)?;
                wire::encode_gets(b, &[w.key])
            },
            |r| {
                // An error reply that leaves the connection in step still has the read's reply
                // behind it: read both before giving up.
                let stored = match wire::read_store(r) {
                    Err(e) if !wire::leaves_connection_usable(&e) => return Err(e),
                    other => other,
                };
                wire::read_slots(r, item_size, &[w.key], &mut out)?;
                stored
            },
        )?;
        let [item] = out;
        Ok((outcome, item?))
    }

    /// `touch key exptime`: `true` if the key existed.
    pub(crate) fn touch(&mut self, key: &str, exptime: u32) -> Result<bool> {
        self.write_exchange(|b| wire::encode_touch(b, key, exptime), wire::read_touch)
    }

    pub(crate) fn arith(&mut self, incr: bool, key: &str, delta: u64) -> Result<Option<u64>> {
        self.write_exchange(
            |b| wire::encode_arith(b, incr, key, delta),
            wire::read_arith,
        )
    }

    pub(crate) fn flush_all(&mut self) -> Result<()> {
        self.write_exchange(
            |b| {
                b.extend_from_slice(b"flush_all\r\n");
                Ok(())
            },
            wire::read_ok,
        )
        .map_err(|e| {
            if wire::is_closed(&e) {
                // An answer of sorts: the proxy is alive, and not at fault.
                self.fault = false;
                // twemproxy answers flush_all by closing the connection.
                Error::with_source(
                    ErrorKind::Unsupported,
                    "the server closed the connection on flush_all \
                     (a proxy such as twemproxy does not support it)",
                    e,
                )
            } else {
                e
            }
        })
    }

    pub(crate) fn version(&mut self) -> Result<String> {
        self.exchange(
            |b| {
                b.extend_from_slice(b"version\r\n");
                Ok(())
            },
            wire::read_version,
        )
    }
}

/// Marks a write's transport failure as outcome unknown: a backend error (I/O, timeout, closed,
/// unparseable reply) that is not the server's own error reply. Refusals before sending (an
/// invalid key, a value too large) are other kinds and pass unchanged.
pub(crate) fn unknown_if_sent(e: Error) -> Error {
    if e.is_backend() && !wire::is_server_reply(&e) {
        e.with_outcome_unknown()
    } else {
        e
    }
}
