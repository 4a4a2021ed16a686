//! The sync pool's connection to a Redis server: its TCP socket (TLS over it, feature
//! `redis-tls`), the commands written whole, and the replies read from a buffer of its own.
//!
//! A reply is parsed where it lies in the buffer: a bulk string (a value of a `GET`), an
//! integer, `+OK`, nil and arrays of them are made here, each in one pass and one copy; every
//! other type (an error reply, RESP3's maps, sets, doubles, pushes...) is found whole, then
//! given to redis-rs's parser, so a [`Value`] is always what redis-rs would have made of the
//! same bytes (its sync `Connection` would parse every reply through combinators, a `Vec` a
//! value).
//!
//! A connection that met an I/O error, the server's end of the stream, or bytes that are not
//! RESP is no longer [`open`](Blocking::is_open): the pool drops it.

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use std::ops::Range;

use bytes::Bytes;
use redis::{RedisError, RedisResult, Value};

use super::request::{Replies, Reply};
use crate::backend::tcp::NotConnected;

/// The reply buffer's first size, and the largest kept between calls (one big reply grows it
/// once; it is given back after).
const FIRST_BUFFER: usize = 16 * 1024;
const KEPT_BUFFER: usize = 64 * 1024;

/// The deepest nesting of arrays read (redis-rs's limit): a hostile reply cannot exhaust the
/// stack.
const MAX_DEPTH: usize = 100;

/// The longest bulk string read: twice the largest `item_size` (a server's
/// `proto-max-bulk-len` may be raised past its 512 MiB default). A length beyond it is not a
/// value this cache could have stored, and would grow the buffer without bound.
const MAX_BULK: usize = 2 * crate::MAX_ITEM_SIZE;

/// The most entries kept in [`Blocking::found`] between calls (a batch far larger than any
/// other gives its list back).
const KEPT_FOUND: usize = 4096;

/// A blocking connection to one server.
pub(super) struct Blocking {
    io: Io,
    /// Bytes read: `buf[at..end]` are not yet parsed.
    buf: Vec<u8>,
    at: usize,
    end: usize,
    open: bool,
    /// The replies found whole by [`recv_many`](Blocking::recv_many), before they are handed
    /// out (kept: a batch's list grows once a connection).
    found: Vec<Found>,
    /// How far the scan of the reply at `at` got, if it is not whole yet ([`scan`]).
    scan: Scan,
}

/// How far the scan of a reply not yet whole got ([`scan`]): resumed where it stopped once more
/// bytes came, so that a large reply read in many pieces is scanned once, not once a piece.
#[derive(Default)]
struct Scan {
    /// From the reply's start: where the next value to scan begins.
    at: usize,
    /// How many values each aggregate open around it still awaits, the innermost last.
    open: Vec<u64>,
}

/// A reply found in the buffer: a bulk string where it lies, or any other value.
#[derive(Debug)]
enum Found {
    Bulk(Range<usize>),
    Value(Value),
}

enum Io {
    Tcp(TcpStream),
    #[cfg(feature = "redis-tls")]
    Tls(Box<super::tls::BlockingTls>),
}

impl Blocking {
    /// A TCP connection to `addr` (`host:port`; each address it resolves to tried in turn),
    /// with Nagle's algorithm off, within `timeout` of `started` in all; reads and writes are
    /// then bounded by `timeout` until [`set_timeouts`](Blocking::set_timeouts) says otherwise.
    pub(super) fn connect(addr: &str, started: Instant, timeout: Duration) -> io::Result<Blocking> {
        let spent = || {
            io::Error::new(
                io::ErrorKind::TimedOut,
                "connect_timeout spent resolving the host",
            )
        };
        let s = crate::backend::tcp::connect_first(addr.to_socket_addrs()?, started, timeout)
            .map_err(|n| match n {
                NotConnected { late: true, .. } => spent(),
                NotConnected { last, .. } => last.unwrap_or_else(|| {
                    io::Error::new(io::ErrorKind::NotFound, "the host resolved to no address")
                }),
            })?;
        s.set_nodelay(true)?;
        let c = Blocking::on(Io::Tcp(s));
        let left = timeout.saturating_sub(started.elapsed());
        if left.is_zero() {
            return Err(spent());
        }
        c.set_timeouts(left)?;
        Ok(c)
    }

    /// The connection with TLS over its socket, by `handshake` (made at once: a refused
    /// handshake is an error here, not on the first command).
    #[cfg(feature = "redis-tls")]
    pub(super) fn tls(
        self,
        handshake: impl FnOnce(TcpStream) -> io::Result<super::tls::BlockingTls>,
    ) -> io::Result<Blocking> {
        let Io::Tcp(sock) = self.io else {
            return Ok(self);
        };
        Ok(Blocking::on(Io::Tls(Box::new(handshake(sock)?))))
    }

    fn on(io: Io) -> Blocking {
        Blocking {
            io,
            buf: Vec::new(),
            at: 0,
            end: 0,
            open: true,
            found: Vec::new(),
            scan: Scan::default(),
        }
    }

    fn socket(&self) -> &TcpStream {
        match &self.io {
            Io::Tcp(s) => s,
            #[cfg(feature = "redis-tls")]
            Io::Tls(s) => &s.sock,
        }
    }

    /// Bounds each read and each write by `t` (not zero).
    pub(super) fn set_timeouts(&self, t: Duration) -> io::Result<()> {
        self.set_read_timeout(t)?;
        self.socket().set_write_timeout(Some(t))
    }

    /// Bounds each read by `t` (not zero).
    pub(super) fn set_read_timeout(&self, t: Duration) -> io::Result<()> {
        self.socket().set_read_timeout(Some(t))
    }

    /// Whether it can be used again: no I/O error, end of stream or unreadable reply met.
    pub(super) fn is_open(&self) -> bool {
        self.open
    }

    /// Writes `bytes` (whole commands) and flushes them.
    pub(super) fn send(&mut self, bytes: &[u8]) -> RedisResult<()> {
        let sent = match &mut self.io {
            Io::Tcp(s) => s.write_all(bytes),
            #[cfg(feature = "redis-tls")]
            Io::Tls(s) => s.write_all(bytes).and_then(|()| s.flush()),
        };
        sent.map_err(|e| self.broken(e))
    }

    /// The next reply, read as it comes.
    pub(super) fn recv(&mut self) -> RedisResult<Value> {
        match self.recv_inner(false)? {
            Some(v) => Ok(v),
            None => unreachable!("a read that may not idle never comes back empty"),
        }
    }

    /// The next reply, or `None` if none came within the read timeout: a subscriber's wait,
    /// which leaves the connection open (what was read of a reply so far is kept).
    pub(super) fn recv_or_idle(&mut self) -> RedisResult<Option<Value>> {
        self.recv_inner(true)
    }

    /// The next reply; `None` only if `idle_ok` and the read timed out ([`read_more`](Blocking::read_more)).
    fn recv_inner(&mut self, idle_ok: bool) -> RedisResult<Option<Value>> {
        loop {
            match whole(&self.buf[self.at..self.end], &mut self.scan) {
                Ok(Some((Found::Value(v), used))) => {
                    self.consumed(self.at + used);
                    return Ok(Some(v));
                }
                Ok(Some((Found::Bulk(r), used))) => {
                    let v = Value::BulkString(self.buf[self.at..][r].to_vec());
                    self.consumed(self.at + used);
                    return Ok(Some(v));
                }
                Ok(None) => {
                    if !self.read_more(idle_ok)? {
                        return Ok(None);
                    }
                }
                Err(e) => {
                    self.open = false;
                    return Err(e);
                }
            }
        }
    }

    /// The next `n` replies into `out`, RESP3's pushed data left out. The bulk strings of
    /// replies that came together are slices of one copy of their bytes (one allocation for
    /// them all, not one a value; a lone one is copied alone); other values are made as
    /// [`recv`](Blocking::recv) makes them.
    pub(super) fn recv_many(&mut self, n: usize, out: &mut Replies) -> RedisResult<()> {
        let mut want = n;
        while want > 0 {
            let start = self.at;
            let mut at = start;
            let mut bulks = 0;
            self.found.clear();
            while self.found.len() < want {
                match whole(&self.buf[at..self.end], &mut self.scan) {
                    Ok(Some((f, used))) => {
                        let f = match f {
                            Found::Value(Value::Push { .. }) => None,
                            Found::Bulk(r) => {
                                bulks += 1;
                                Some(Found::Bulk(r.start + at - start..r.end + at - start))
                            }
                            v => Some(v),
                        };
                        self.found.extend(f);
                        at += used;
                    }
                    Ok(None) => break,
                    Err(e) => {
                        self.open = false;
                        return Err(e);
                    }
                }
            }
            let got = self.found.len();
            let read = &self.buf[start..at];
            let block = (bulks > 1).then(|| Bytes::copy_from_slice(read));
            out.extend(self.found.drain(..).map(|f| match f {
                Found::Bulk(r) => Reply::Bulk(match &block {
                    Some(block) => block.slice(r),
                    None => Bytes::copy_from_slice(&read[r]),
                }),
                Found::Value(v) => Reply::Value(v),
            }));
            want -= got;
            if self.found.capacity() > KEPT_FOUND {
                self.found = Vec::new();
            }
            self.consumed(at);
            if want > 0 {
                self.read_more(false)?;
            }
        }
        Ok(())
    }

    /// The bytes up to `at` are parsed (the reply there, if any, is the one [`Scan`] is of):
    /// the buffer is emptied once all are (and given back if a large reply grew it).
    fn consumed(&mut self, at: usize) {
        self.at = at;
        if self.at == self.end {
            self.at = 0;
            self.end = 0;
            if self.buf.len() > KEPT_BUFFER {
                self.buf = Vec::new();
            }
        }
    }

    /// Reads what the server sent next, after the unparsed bytes (moved to the front, or the
    /// buffer grown, when it is full). A timeout is `Ok(false)` if `idle_ok` (nothing broken),
    /// else an error that breaks the connection.
    fn read_more(&mut self, idle_ok: bool) -> RedisResult<bool> {
        if self.end == self.buf.len() {
            if self.at > 0 {
                self.buf.copy_within(self.at..self.end, 0);
                self.end -= self.at;
                self.at = 0;
            } else {
                let size = (2 * self.buf.len()).max(FIRST_BUFFER);
                self.buf.resize(size, 0);
            }
        }
        let read = match &mut self.io {
            Io::Tcp(s) => s.read(&mut self.buf[self.end..]),
            #[cfg(feature = "redis-tls")]
            Io::Tls(s) => s.read(&mut self.buf[self.end..]),
        };
        match read {
            Ok(0) => Err(self.broken(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the server closed the connection",
            ))),
            Ok(n) => {
                self.end += n;
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(true),
            Err(e)
                if idle_ok
                    && matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
            {
                Ok(false)
            }
            Err(e) => Err(self.broken(e)),
        }
    }

    fn broken(&mut self, e: io::Error) -> RedisError {
        self.open = false;
        e.into()
    }
}

/// The reply at the start of `b`, if `b` holds it whole: a bulk string where it lies, any other
/// value made; `None` until then. A reply other than a bulk string is first [`scan`]ned (from
/// where `s` stopped: `s` is of this reply), and made only once whole.
fn whole(b: &[u8], s: &mut Scan) -> RedisResult<Option<(Found, usize)>> {
    if b.first() == Some(&b'$') {
        return Ok(bulk(b)?.map(|(r, used)| {
            let f = match r {
                Some(r) => Found::Bulk(r),
                None => Found::Value(Value::Nil),
            };
            (f, used)
        }));
    }
    let Some(end) = scan(b, s)? else {
        return Ok(None);
    };
    match parse(&b[..end], 0)? {
        Some((v, used)) if used == end => Ok(Some((Found::Value(v), end))),
        _ => Err(garbage("a reply read otherwise than it was scanned")),
    }
}

/// The bulk string at the start of `b` (its type byte checked by the caller): where its bytes
/// lie (`None`: nil) and its length in all, or `None` if `b` holds only part of it.
#[allow(clippy::type_complexity)]
fn bulk(b: &[u8]) -> RedisResult<Option<(Option<Range<usize>>, usize)>> {
    // The length: digits then CRLF (a value's), read here; any other line as [`int`] reads it.
    let mut i = 1;
    let mut len = 0usize;
    while i < b.len().min(10) && b[i].is_ascii_digit() {
        len = len * 10 + usize::from(b[i] - b'0');
        i += 1;
    }
    let crlf = b.get(i) == Some(&b'\r') && b.get(i + 1) == Some(&b'\n');
    let (len, next) = if i > 1 && crlf && len <= MAX_BULK {
        (Some(len), i + 2)
    } else {
        let Some((line, next)) = line(b) else {
            return Ok(None);
        };
        (length(int(line)?)?, next)
    };
    let Some(len) = len else {
        return Ok(Some((None, next)));
    };
    let end = next + len;
    if b.len() < end + 2 {
        return Ok(None);
    }
    if &b[end..end + 2] != b"\r\n" {
        return Err(garbage("a bulk string not ended by CRLF"));
    }
    Ok(Some((Some(next..end), end + 2)))
}

/// The reply at the start of `b` and its length in bytes, or `None` if `b` holds only part of
/// it; `depth`: the arrays it is nested in.
fn parse(b: &[u8], depth: usize) -> RedisResult<Option<(Value, usize)>> {
    if depth >= MAX_DEPTH {
        return Err(garbage("aggregates nested too deep"));
    }
    if b.first() == Some(&b'$') {
        return Ok(bulk(b)?.map(|(r, used)| {
            let v = match r {
                Some(r) => Value::BulkString(b[r].to_vec()),
                None => Value::Nil,
            };
            (v, used)
        }));
    }
    let Some((line, next)) = line(b) else {
        return Ok(None);
    };
    match b[0] {
        b'*' => {
            let n = int(line)?;
            if n < 0 {
                return Ok(Some((Value::Nil, next)));
            }
            let n = usize::try_from(n).map_err(|_| garbage("an array too long"))?;
            let mut at = next;
            let mut items = Vec::with_capacity(n.min(1024));
            for _ in 0..n {
                let Some((v, used)) = parse(&b[at..], depth + 1)? else {
                    return Ok(None);
                };
                items.push(v);
                at += used;
            }
            Ok(Some((Value::Array(items), at)))
        }
        b':' => Ok(Some((Value::Int(int(line)?), next))),
        b'+' if line == b"OK" => Ok(Some((Value::Okay, next))),
        b'_' if line.is_empty() => Ok(Some((Value::Nil, next))),
        // An error line that is not UTF-8 (a server lacking a command copies the call's first
        // arguments, binary ones too, into its refusal) is read lossily: redis-rs's reader
        // refuses it, and the connection would be given up for an answer it could read.
        b'-' if std::str::from_utf8(line).is_err() => {
            let lossy = [b"-", String::from_utf8_lossy(line).as_bytes(), b"\r\n"].concat();
            match redis::parse_redis_value(&lossy) {
                Ok(v) => Ok(Some((v, next))),
                Err(_) => Err(garbage("an error reply redis-rs could not read")),
            }
        }
        // Every other type, found whole, then read by redis-rs (whose error, on bytes the scan
        // took for a whole reply, is of the bytes: never of the connection).
        _ => {
            let Some(end) = scan(b, &mut Scan::default())? else {
                return Ok(None);
            };
            match redis::parse_redis_value(&b[..end]) {
                Ok(v) => Ok(Some((v, end))),
                Err(_) => Err(garbage("a reply redis-rs could not read")),
            }
        }
    }
}

/// The length in bytes of the reply at the start of `b` (of any RESP2 or RESP3 type), once `b`
/// holds it whole; `None` until then, `s` left where the scan stopped, to go on from there when
/// `b` has grown (from the same start). It makes no value; a value at the depth redis-rs refuses,
/// a negative blob or map length, a length or count no reply has, is an error.
fn scan(b: &[u8], s: &mut Scan) -> RedisResult<Option<usize>> {
    loop {
        let v = &b[s.at..];
        let Some((line, next)) = line(v) else {
            return Ok(None);
        };
        if s.open.len() >= MAX_DEPTH {
            return Err(garbage("aggregates nested too deep"));
        }
        let (used, children) = match v[0] {
            b'+' | b'-' | b':' | b'_' | b',' | b'#' | b'(' => (next, 0),
            t @ (b'$' | b'=' | b'!') => match length(int(line)?)? {
                None if t == b'$' => (next, 0),
                None => return Err(garbage("a blob of a negative length")),
                Some(len) => {
                    let end = next + len + 2;
                    if v.len() < end {
                        return Ok(None);
                    }
                    (end, 0)
                }
            },
            t @ (b'*' | b'~' | b'>' | b'%' | b'|') => {
                let n = int(line)?;
                if n < 0 && t != b'*' {
                    return Err(garbage("an aggregate of a negative count"));
                }
                // An attribute's pairs come before the value they describe: one more.
                let n = n.max(0).unsigned_abs();
                let n = match t {
                    b'%' => 2 * n,
                    b'|' => 2 * n + 1,
                    _ => n,
                };
                (next, n)
            }
            _ => return Err(garbage("a reply of an unknown type")),
        };
        s.at += used;
        if children > 0 {
            s.open.push(children);
            continue;
        }
        // A value ended: so did each aggregate it was the last of.
        loop {
            match s.open.last_mut() {
                None => {
                    let end = s.at;
                    *s = Scan::default();
                    return Ok(Some(end));
                }
                Some(left) if *left > 1 => {
                    *left -= 1;
                    break;
                }
                Some(_) => {
                    s.open.pop();
                }
            }
        }
    }
}

/// The first line of `b` after its type byte (up to its first CRLF), and where the next
/// begins; `None` if it is not whole yet. Lines are short (a length, a count, `OK`): a byte
/// loop finds their end sooner than a call to memchr.
fn line(b: &[u8]) -> Option<(&[u8], usize)> {
    let mut i = 1;
    loop {
        let cr = i + b.get(i..)?.iter().position(|&c| c == b'\r')?;
        if *b.get(cr + 1)? == b'\n' {
            return Some((&b[1..cr], cr + 2));
        }
        i = cr + 1;
    }
}

/// A length or count line's number, read as redis-rs reads it.
fn int(line: &[u8]) -> RedisResult<i64> {
    let (neg, digits) = match line {
        [b'-', rest @ ..] => (true, rest),
        _ => (false, line),
    };
    if !digits.is_empty() && digits.len() <= 18 {
        let mut n = 0i64;
        let mut all = true;
        for &d in digits {
            all &= d.is_ascii_digit();
            // Wrapping: a line that is not all digits is read again below.
            n = n
                .wrapping_mul(10)
                .wrapping_add(i64::from(d.wrapping_sub(b'0')));
        }
        if all {
            return Ok(if neg { -n } else { n });
        }
    }
    int_as_text(line)
}

/// [`int`] of a line that is not a plain number of up to 18 digits.
#[cold]
fn int_as_text(line: &[u8]) -> RedisResult<i64> {
    std::str::from_utf8(line)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .ok_or_else(|| garbage("expected an integer"))
}

/// A bulk string's length: `None` for nil (a negative length).
fn length(n: i64) -> RedisResult<Option<usize>> {
    if n < 0 {
        return Ok(None);
    }
    match usize::try_from(n) {
        Ok(n) if n <= MAX_BULK => Ok(Some(n)),
        _ => Err(garbage("a bulk string longer than 2 GiB")),
    }
}

fn garbage(what: &'static str) -> RedisError {
    RedisError::from((
        redis::ErrorKind::Parse,
        "the server's reply is not RESP",
        what.to_owned(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Replies of every type, as a server sends them.
    const REPLIES: &[&[u8]] = &[
        b"$5\r\nhello\r\n",
        b"$0\r\n\r\n",
        b"$-1\r\n",
        b"$4\r\na\r\nb\r\n",
        b"*-1\r\n",
        b"*0\r\n",
        b"*3\r\n$1\r\na\r\n$-1\r\n:42\r\n",
        b"*2\r\n*1\r\n+OK\r\n*2\r\n:-7\r\n$2\r\nhi\r\n",
        b":0\r\n",
        b":-9223372036854775808\r\n",
        b":9223372036854775807\r\n",
        b": 12 \r\n",
        b"+OK\r\n",
        b"+PONG\r\n",
        b"+\r\n",
        b"-ERR unknown command\r\n",
        b"-MOVED 3999 127.0.0.1:6381\r\n",
        b"*2\r\n-ERR no\r\n$1\r\nx\r\n",
        b"_\r\n",
        b",3.25\r\n",
        b"#t\r\n",
        b"(3492890328409238509324850943850943825024385\r\n",
        b"=15\r\ntxt:Some string\r\n",
        b"!21\r\nSYNTAX invalid syntax\r\n",
        b"%2\r\n+first\r\n:1\r\n+second\r\n:2\r\n",
        b"~2\r\n+a\r\n:1\r\n",
        b">3\r\n$7\r\nmessage\r\n$2\r\nch\r\n$3\r\nhey\r\n",
        b"|1\r\n+key-popularity\r\n%1\r\n$1\r\na\r\n,0.19\r\n*2\r\n:2039123\r\n:9543892\r\n",
        b"*2\r\n%1\r\n+k\r\n$1\r\nv\r\n~1\r\n_\r\n",
    ];

    #[test]
    fn every_reply_reads_as_redis_rs_reads_it_and_none_before_it_is_whole() {
        for reply in REPLIES {
            let theirs = redis::parse_redis_value(reply).unwrap();
            let (ours, used) = parse(reply, 0).unwrap().unwrap();
            assert_eq!(ours, theirs, "{}", String::from_utf8_lossy(reply));
            assert_eq!(used, reply.len(), "{}", String::from_utf8_lossy(reply));
            // Followed by another reply: that one is left.
            let two = [*reply, b"+next\r\n"].concat();
            assert_eq!(parse(&two, 0).unwrap().unwrap().1, reply.len());
            for cut in 0..reply.len() {
                assert!(
                    parse(&reply[..cut], 0).unwrap().is_none(),
                    "{} cut at {cut}",
                    String::from_utf8_lossy(reply)
                );
                assert!(
                    whole(&reply[..cut], &mut Scan::default())
                        .unwrap()
                        .is_none()
                );
            }
            // As the connection reads it: whole (a bulk string where it lies), and the same
            // when it comes a byte at a time, its scan resumed where it stopped.
            let (f, used) = whole(reply, &mut Scan::default()).unwrap().unwrap();
            assert_eq!(used, reply.len());
            let as_value = |f: Found| match f {
                Found::Bulk(r) => Value::BulkString(reply[r].to_vec()),
                Found::Value(v) => v,
            };
            assert_eq!(as_value(f), theirs, "{}", String::from_utf8_lossy(reply));
            let mut scan = Scan::default();
            let mut got = None;
            for cut in 0..=reply.len() {
                let before = scan.at;
                got = whole(&reply[..cut], &mut scan).unwrap();
                if got.is_some() {
                    assert_eq!(cut, reply.len());
                    break;
                }
                assert!(
                    scan.at >= before && scan.at <= cut,
                    "the scan never goes back"
                );
            }
            let (f, used) = got.unwrap();
            assert_eq!((as_value(f), used), (theirs, reply.len()));
        }
    }

    #[test]
    fn a_large_reply_read_in_pieces_is_scanned_once() {
        // 20,000 values in an array, offered 1,000 bytes more at a time: each scan goes on
        // from where the last one stopped, so the bytes scanned in all are the reply's.
        let mut reply = b"*20000\r\n".to_vec();
        for i in 0..20_000 {
            reply.extend_from_slice(format!("$6\r\nv{i:05}\r\n").as_bytes());
        }
        let mut state = Scan::default();
        let mut scanned = 0;
        let mut cut = 0;
        let end = loop {
            cut = (cut + 1000).min(reply.len());
            let from = state.at;
            match scan(&reply[..cut], &mut state).unwrap() {
                Some(end) => break end,
                None => scanned += state.at - from,
            }
        };
        assert_eq!(end, reply.len());
        assert!(scanned <= reply.len(), "{scanned}");
        let (v, used) = whole(&reply, &mut Scan::default()).unwrap().unwrap();
        assert_eq!(used, reply.len());
        let Found::Value(Value::Array(vs)) = v else {
            panic!("an array");
        };
        assert_eq!(vs.len(), 20_000);
        assert_eq!(vs[19_999], Value::BulkString(b"v19999".to_vec()));
    }

    #[test]
    fn bytes_that_are_not_resp_are_an_error_not_a_value() {
        for bad in [
            &b"?what\r\n"[..],
            b"$\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\r\n",
            b"$5\r\nhelloXY",
            b"$x\r\n",
            b"*1\r\n@\r\n",
            b"$99999999999\r\n",
            b"$9999999999\r\n",
            b"=-1\r\n",
            b"!-1\r\n",
            b"%-1\r\n",
            b"|-1\r\n",
            b"~-1\r\n",
            b">-2\r\n",
            b"*1\r\n=-1\r\n",
            // Whole by its lengths, but not RESP inside: redis-rs's refusal, as the bytes'.
            b"=3\r\nabc\r\n",
            b"#x\r\n",
        ] {
            for e in [
                parse(bad, 0).unwrap_err(),
                whole(bad, &mut Scan::default()).unwrap_err(),
            ] {
                assert_eq!(e.kind(), redis::ErrorKind::Parse, "{e}");
                assert!(!e.is_connection_dropped(), "{e}");
            }
        }
        // Counts no server sends: waited for, without a panic or an allocation of them.
        for huge in [
            &b"|4611686018427387904\r\n"[..],
            b"%9223372036854775807\r\n",
            b"*9223372036854775807\r\n",
        ] {
            assert!(whole(huge, &mut Scan::default()).unwrap().is_none());
        }
        // redis-rs refuses a value inside 100 aggregates, and reads one inside 99.
        for open in [&b"*1\r\n"[..], b"~1\r\n", b"%1\r\n:0\r\n"] {
            let nested = |n: usize| [open.repeat(n), b":1\r\n".to_vec()].concat();
            for n in [MAX_DEPTH, MAX_DEPTH + 1] {
                assert!(redis::parse_redis_value(&nested(n)).is_err());
                assert!(parse(&nested(n), 0).is_err());
                assert!(whole(&nested(n), &mut Scan::default()).is_err());
            }
            let ok = nested(MAX_DEPTH - 1);
            let theirs = redis::parse_redis_value(&ok).unwrap();
            assert_eq!(parse(&ok, 0).unwrap().unwrap().0, theirs);
            let (Found::Value(ours), _) = whole(&ok, &mut Scan::default()).unwrap().unwrap() else {
                panic!("a value");
            };
            assert_eq!(ours, theirs);
        }
    }

    #[test]
    fn an_error_line_with_bytes_that_are_not_utf8_reads_lossily() {
        // A server without scripting copies a script call's first arguments, binary fence
        // and stamp bytes among them, into its refusal.
        let reply =
            b"-ERR unknown command 'EVALSHA', with args beginning with: '\xa1\x00\xff' \r\n+OK\r\n";
        for (v, used) in [
            parse(reply, 0).unwrap().unwrap(),
            match whole(reply, &mut Scan::default()).unwrap().unwrap() {
                (Found::Value(v), used) => (v, used),
                (f, _) => panic!("an error reply, not {f:?}"),
            },
        ] {
            let Value::ServerError(e) = v else {
                panic!("an error reply, not {v:?}");
            };
            assert_eq!(e.code(), "ERR");
            let detail = e.details().unwrap_or_default();
            assert!(detail.starts_with("unknown command 'EVALSHA'"), "{detail}");
            assert!(detail.contains('\u{fffd}'), "{detail}");
            assert_eq!(
                used,
                reply.len() - b"+OK\r\n".len(),
                "the next reply is left"
            );
        }
    }

    #[test]
    fn replies_split_across_reads_and_larger_than_the_buffer_are_read_whole() {
        use std::net::TcpListener;
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let big = vec![b'v'; 3 * FIRST_BUFFER + 5];
        let mut sent = Vec::new();
        sent.extend_from_slice(format!("${}\r\n", big.len()).as_bytes());
        sent.extend_from_slice(&big);
        sent.extend_from_slice(b"\r\n");
        for reply in REPLIES {
            sent.extend_from_slice(reply);
        }
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            // A few bytes at a time, then the rest a thousand at a time.
            for chunk in sent[..200].chunks(3) {
                s.write_all(chunk).unwrap();
                s.flush().unwrap();
                std::thread::sleep(Duration::from_micros(50));
            }
            for chunk in sent[200..].chunks(1000) {
                s.write_all(chunk).unwrap();
            }
            // Then the end of the stream.
        });
        let mut c = Blocking::connect(&addr, Instant::now(), Duration::from_secs(5)).unwrap();
        assert_eq!(c.recv().unwrap(), Value::BulkString(big));
        for reply in REPLIES {
            assert_eq!(c.recv().unwrap(), redis::parse_redis_value(reply).unwrap());
        }
        assert!(c.is_open());
        server.join().unwrap();
        let e = c.recv().unwrap_err();
        assert!(e.is_connection_dropped() && !c.is_open(), "{e}");
    }

    #[test]
    fn many_replies_come_as_one_by_one_and_pushed_data_is_left_out() {
        use std::net::TcpListener;
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let push = &b">2\r\n$7\r\nmessage\r\n$2\r\nhi\r\n"[..];
        let mut sent = Vec::new();
        let mut wanted = Vec::new();
        // Three rounds: replies that come in one read, and ones cut by the reads.
        for _ in 0..3 {
            for reply in REPLIES.iter().filter(|r| !r.starts_with(b">")) {
                sent.extend_from_slice(reply);
                sent.extend_from_slice(push);
                wanted.push(redis::parse_redis_value(reply).unwrap());
            }
        }
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let (first, rest) = sent.split_at(sent.len() / 3);
            s.write_all(first).unwrap();
            std::thread::sleep(Duration::from_millis(20));
            for chunk in rest.chunks(7) {
                s.write_all(chunk).unwrap();
            }
        });
        let mut c = Blocking::connect(&addr, Instant::now(), Duration::from_secs(5)).unwrap();
        let n = wanted.len() / 3;
        let mut got = Vec::new();
        for _ in 0..3 {
            let mut replies = Replies::new();
            c.recv_many(n, &mut replies).unwrap();
            assert_eq!(replies.len(), n);
            got.extend(replies);
        }
        // A bulk string comes as its bytes; as a value, what redis-rs makes of the same reply.
        assert!(got.iter().any(|r| matches!(r, Reply::Bulk(_))));
        let got: Vec<Value> = got.into_iter().map(Reply::value).collect();
        assert_eq!(got, wanted);
        server.join().unwrap();
        assert!(c.is_open());
    }

    #[test]
    fn a_read_past_its_timeout_is_a_timeout() {
        use std::net::TcpListener;
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let c = Blocking::connect(&addr, Instant::now(), Duration::from_secs(5));
        let mut c = c.unwrap();
        let _held = listener.accept().unwrap();
        c.set_read_timeout(Duration::from_millis(20)).unwrap();
        let e = c.recv().unwrap_err();
        assert!(e.is_timeout() && !c.is_open(), "{e}");
    }
}
