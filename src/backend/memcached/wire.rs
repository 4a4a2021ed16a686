//! memcached's text protocol: command encoders into a buffer and strict reply parsers over any
//! `BufRead`. No sockets here; every reply is bounded (line length, value size), and anything
//! unexpected is an error that tells the caller the connection is out of step.

use std::io::BufRead;

use bytes::{Bytes, BytesMut};

use crate::backend::server::ServerReply;
pub(crate) use crate::backend::server::{is_server_reply, leaves_connection_usable};
use crate::backend::{Item, StoreMode, StoreOutcome, Write};
use crate::error::{Error, ErrorKind, Result};

/// Longest reply line accepted (a `VALUE` header with a 250-byte key is under 300 bytes).
const MAX_LINE: usize = 1024;

const CLOSED: &str = "the server closed the connection";

/// Whether the server closed the connection instead of replying.
pub(crate) fn is_closed(e: &Error) -> bool {
    e.kind() == ErrorKind::Backend && e.to_string().ends_with(CLOSED)
}

/// The error for a connection the server closed instead of replying ([`is_closed`] says yes).
#[cfg_attr(not(feature = "tokio"), allow(dead_code))]
pub(crate) fn closed() -> Error {
    protocol_error(CLOSED)
}

/// Why a reply could not be used.
pub(crate) fn protocol_error(what: impl Into<String>) -> Error {
    Error::new(ErrorKind::Backend, what.into())
}

/// Refuses a key memcached would not parse as one token: empty, over 250 bytes, or holding
/// whitespace or control bytes. memcached answers `CLIENT_ERROR` to a too-long key *without*
/// reading the data block of a store, so the value's bytes would run as commands.
pub(crate) fn check_key(key: &str) -> Result<()> {
    crate::key::validate_key(key)
}

/// Refuses an `exptime` memcached would misread: it parses the field as a signed 32-bit number,
/// so anything above `i32::MAX` would become negative (an immediate expiry) or a parse error.
/// The kind is [`ErrorKind::Config`]: a caller-supplied setting out of range (there is no
/// TTL-specific kind).
pub(crate) fn check_exptime(exptime: u32) -> Result<()> {
    if exptime > i32::MAX as u32 {
        return Err(Error::new(
            ErrorKind::Config,
            format!(
                "exptime {exptime} is above memcached's limit of {} (a signed 32-bit number)",
                i32::MAX
            ),
        ));
    }
    Ok(())
}

/// Refuses a value above the item limit (`max_value` bytes for this key).
pub(crate) fn check_value(len: usize, max_value: usize) -> Result<()> {
    if len > max_value {
        return Err(crate::backend::memory::too_large(len, max_value));
    }
    Ok(())
}

/// Appends what `encode` writes once `check` has passed; on an error `out` is left as it was, so
/// a command is written whole and valid or not at all.
fn append(
    out: &mut Vec<u8>,
    check: impl FnOnce() -> Result<()>,
    encode: impl FnOnce(&mut Vec<u8>),
) -> Result<()> {
    check()?;
    encode(out);
    Ok(())
}

/// `gets k1 k2 ...\r\n`; every key is checked before anything is written.
pub(crate) fn encode_gets<K: AsRef<str>>(out: &mut Vec<u8>, keys: &[K]) -> Result<()> {
    append(
        out,
        || {
            if keys.is_empty() {
                return Err(Error::new(ErrorKind::InvalidKey, "gets without a key"));
            }
            keys.iter().try_for_each(|k| check_key(k.as_ref()))
        },
        |out| write_gets(out, keys.iter().map(AsRef::as_ref)),
    )
}

/// [`encode_gets`] of keys the caller has checked already ([`check_key`]), at least one: a
/// batch checks each key once, before grouping them by server.
pub(crate) fn write_gets<'k>(out: &mut Vec<u8>, keys: impl Iterator<Item = &'k str>) {
    out.extend_from_slice(b"gets");
    for k in keys {
        out.push(b' ');
        out.extend_from_slice(k.as_bytes());
    }
    out.extend_from_slice(b"\r\n");
}

/// `set|add|cas key flags exptime bytes [cas]\r\n<data>\r\n`, or nothing and an error if the key,
/// the exptime or the value's size (over `max_value`) is invalid.
pub(crate) fn encode_store(out: &mut Vec<u8>, w: &Write<'_>, max_value: usize) -> Result<()> {
    append(
        out,
        || {
            check_key(w.key)?;
            if w.mode == StoreMode::Cas(0) {
                return Err(crate::backend::no_cas(None));
            }
            check_exptime(w.exptime)?;
            check_value(w.value.len(), max_value)
        },
        |out| {
            let verb: &[u8] = match w.mode {
                StoreMode::Set => b"set ",
                StoreMode::Add => b"add ",
                StoreMode::Cas(_) => b"cas ",
            };
            out.extend_from_slice(verb);
            out.extend_from_slice(w.key.as_bytes());
            let (flags, exptime, len) = (w.flags, w.exptime, w.value.len());
            let mut tail = format!(" {flags} {exptime} {len}");
            if let StoreMode::Cas(token) = w.mode {
                tail.push_str(&format!(" {token}"));
            }
            tail.push_str("\r\n");
            out.extend_from_slice(tail.as_bytes());
            out.extend_from_slice(w.value);
            out.extend_from_slice(b"\r\n");
        },
    )
}

/// `delete key\r\n`
pub(crate) fn encode_delete(out: &mut Vec<u8>, key: &str) -> Result<()> {
    append(
        out,
        || check_key(key),
        |out| {
            out.extend_from_slice(b"delete ");
            out.extend_from_slice(key.as_bytes());
            out.extend_from_slice(b"\r\n");
        },
    )
}

/// `touch key exptime\r\n`
pub(crate) fn encode_touch(out: &mut Vec<u8>, key: &str, exptime: u32) -> Result<()> {
    append(
        out,
        || {
            check_key(key)?;
            check_exptime(exptime)
        },
        |out| {
            out.extend_from_slice(b"touch ");
            out.extend_from_slice(key.as_bytes());
            out.extend_from_slice(format!(" {exptime}\r\n").as_bytes());
        },
    )
}

/// `incr|decr key delta\r\n`
pub(crate) fn encode_arith(out: &mut Vec<u8>, incr: bool, key: &str, delta: u64) -> Result<()> {
    append(
        out,
        || check_key(key),
        |out| {
            out.extend_from_slice(if incr { b"incr " } else { b"decr " });
            out.extend_from_slice(key.as_bytes());
            out.extend_from_slice(format!(" {delta}\r\n").as_bytes());
        },
    )
}

/// Reads one CRLF-terminated line (without the CRLF), at most [`MAX_LINE`] bytes.
fn read_line<'a, R: BufRead>(r: &mut R, buf: &'a mut Vec<u8>) -> Result<&'a [u8]> {
    buf.clear();
    let n = std::io::Read::take(&mut *r, MAX_LINE as u64).read_until(b'\n', buf)?;
    if n == 0 {
        return Err(protocol_error(CLOSED));
    }
    if !buf.ends_with(b"\r\n") {
        return Err(protocol_error("reply line too long or not CRLF-terminated"));
    }
    buf.truncate(buf.len() - 2);
    Ok(buf)
}

/// A reply line for an error message.
fn shown(line: &[u8]) -> String {
    String::from_utf8_lossy(line).into_owned()
}

/// Turns the generic error replies into errors; returns other lines unchanged.
fn check_error(line: &[u8]) -> Result<&[u8]> {
    if line == b"ERROR" {
        Err(Error::new(
            ErrorKind::Unsupported,
            "the server does not know this command (ERROR)",
        ))
    } else if let Some(msg) = line.strip_prefix(b"SERVER_ERROR ") {
        let msg = shown(msg);
        if msg.contains("too large") {
            Err(Error::new(ErrorKind::TooLarge, format!("server: {msg}")))
        } else {
            Err(Error::with_source(
                ErrorKind::Backend,
                "the server answered SERVER_ERROR",
                ServerReply {
                    text: msg,
                    client: false,
                },
            ))
        }
    } else if let Some(msg) = line.strip_prefix(b"CLIENT_ERROR ") {
        let msg = shown(msg);
        if msg.contains("non-numeric") {
            Err(Error::new(ErrorKind::NotACounter, format!("server: {msg}")))
        } else {
            // After some CLIENT_ERRORs memcached swallows what follows: the connection is dropped
            // (see `leaves_connection_usable`), but the server is not at fault.
            Err(Error::with_source(
                ErrorKind::Backend,
                "the server refused the command (CLIENT_ERROR)",
                ServerReply {
                    text: msg,
                    client: true,
                },
            ))
        }
    } else {
        Ok(line)
    }
}

/// [`read_slots`] through a reader with a `cap`-byte buffer: its reading, and how many of
/// `reply`'s bytes it left unread.
#[cfg(test)]
pub(crate) fn read_chunked<K: AsRef<str>>(
    reply: &[u8],
    cap: usize,
    max_value: usize,
    keys: &[K],
) -> (Result<Vec<Slot>>, usize) {
    let mut r = std::io::BufReader::with_capacity(cap, reply);
    let mut out: Vec<Slot> = vec![Ok(None); keys.len()];
    let read = read_slots(&mut r, max_value, keys, &mut out).map(|()| out);
    let rest = r.buffer().len() + r.get_ref().len();
    (read, rest)
}

/// One key's answer in a `gets` reply: `Ok(None)` = missing, `Err` = a value over the limit
/// (skipped on the wire; the connection stays in step).
pub(crate) type Slot = Result<Option<Item>>;

/// Reads a `gets` reply for `keys` into `out` (same length, by position, each `Ok(None)` on
/// entry). Values are matched by the key each `VALUE` line names, in one forward pass when the
/// server answers in request order (memcached does) and by search when it does not (twemproxy may
/// reorder). A key that was not requested is an error. A value above `max_value` (another client
/// wrote it to a server with a larger `-I`) is read and discarded, never allocated: its key gets a
/// `TooLarge` error and the connection stays usable.
pub(crate) fn read_slots<R: BufRead, K: AsRef<str>>(
    r: &mut R,
    max_value: usize,
    keys: &[K],
    out: &mut [Slot],
) -> Result<()> {
    // Only for a line that straddles the end of the reader's buffer (allocated then).
    let mut line = Vec::new();
    let mut fill = Fill::default();
    loop {
        // A line whole in the reader's buffer (within MAX_LINE bytes) is read where it is;
        // another is copied out (`read_line`). Either way it is consumed before its verdict is
        // returned. One `fill_buf` a line, as `read_line`'s own.
        let Some(buf) = buffered(r)? else { continue };
        let (value, used) = match memchr::memchr(b'\n', &buf[..buf.len().min(MAX_LINE)]) {
            Some(at) => {
                let value = match buf[..=at].strip_suffix(b"\r\n") {
                    Some(l) => value_slot(l, &fill, keys, out),
                    None => Err(protocol_error("reply line too long or not CRLF-terminated")),
                };
                (value, at + 1)
            }
            None => (value_slot(read_line(r, &mut line)?, &fill, keys, out), 0),
        };
        r.consume(used);
        match value? {
            None => return Ok(()),
            Some((slot, flags, len, cas)) => {
                fill.fill(r, slot, (flags, len, cas), max_value, keys.len(), out)?;
            }
        }
    }
}

/// The reader's buffered bytes, read first if there are none (one `fill_buf`): `None` when the
/// read was interrupted (to be asked again); no bytes at all is the server's close.
#[inline(always)] // Called once a line: a call per line is a visible share of a batch's work.
fn buffered<R: BufRead>(r: &mut R) -> Result<Option<&[u8]>> {
    match r.fill_buf() {
        Ok([]) => Err(protocol_error(CLOSED)),
        Ok(buf) => Ok(Some(buf)),
        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// A `gets` reply's line (without its CRLF): `None` for `END`, else the slot its `VALUE` line's
/// key goes to, with the line's flags, length and CAS.
fn value_slot<K: AsRef<str>>(
    l: &[u8],
    fill: &Fill,
    keys: &[K],
    out: &[Slot],
) -> Result<Option<(usize, u32, usize, u64)>> {
    let l = check_error(l)?;
    if l == b"END" {
        return Ok(None);
    }
    let (key, flags, len, cas) = parse_value_line(l)
        .ok_or_else(|| protocol_error(format!("unexpected reply to gets: {:?}", shown(l))))?;
    Ok(Some((fill.slot(key, keys, out)?, flags, len, cas)))
}

/// A `VALUE` line of a `gets` reply as [`frame_values`] found it: its fields, and where its key
/// and its data block sit in the reply.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "tokio"), allow(dead_code))]
pub(crate) struct ValueAt {
    /// Where the line starts.
    line: usize,
    key_len: usize,
    flags: u32,
    len: usize,
    cas: u64,
    /// Where the data block starts (the line's end).
    data: usize,
}

/// Reads a `gets` reply that [`frame_values`] called whole, `values` being what it found in it:
/// what [`read_slots`] reads from the same bytes, without finding and parsing its lines again.
#[cfg_attr(not(feature = "tokio"), allow(dead_code))]
pub(crate) fn read_framed<K: AsRef<str>>(
    reply: &[u8],
    values: &[ValueAt],
    max_value: usize,
    keys: &[K],
    out: &mut [Slot],
) -> Result<()> {
    let too_long = || protocol_error("reply line too long or not CRLF-terminated");
    let mut fill = Fill::default();
    let mut at = 0;
    for v in values {
        // The checks read_line makes of every line (framing found its end and its fields).
        if v.line != at || v.data - v.line > MAX_LINE {
            return Err(too_long());
        }
        let key = &reply[v.line + b"VALUE ".len()..][..v.key_len];
        let mut r = reply.get(v.data..).unwrap_or_default();
        fill.place(&mut r, (key, v.flags, v.len, v.cas), max_value, keys, out)?;
        at = reply.len() - r.len();
    }
    // The line that ended the reply: END, or an error reply.
    let last = &reply[at..];
    let l = match last.strip_suffix(b"\r\n") {
        Some(l) if last.len() <= MAX_LINE && !l.contains(&b'\n') => l,
        _ => return Err(too_long()),
    };
    match check_error(l)? {
        b"END" => Ok(()),
        l => Err(protocol_error(format!(
            "unexpected reply to gets: {:?}",
            shown(l)
        ))),
    }
}

/// Where the values of one `gets` reply go: each to the slot of the key its `VALUE` line names,
/// read into the arena, or skipped when over the limit.
#[derive(Default)]
struct Fill {
    /// Where the next key is looked for first (the server answers in request order).
    cursor: usize,
    arena: Arena,
    filled: usize,
}

impl Fill {
    /// Places the value of a parsed `VALUE` line, its data block next in `r`.
    fn place<R: BufRead, K: AsRef<str>>(
        &mut self,
        r: &mut R,
        (key, flags, len, cas): (&[u8], u32, usize, u64),
        max_value: usize,
        keys: &[K],
        out: &mut [Slot],
    ) -> Result<()> {
        let slot = self.slot(key, keys, out)?;
        self.fill(r, slot, (flags, len, cas), max_value, keys.len(), out)
    }

    /// The slot of `key`: the first of the requested keys by that name not yet answered,
    /// looked for from the one after the last placed.
    fn slot<K: AsRef<str>>(&self, key: &[u8], keys: &[K], out: &[Slot]) -> Result<usize> {
        let cursor = self.cursor;
        (cursor..keys.len())
            .chain(0..cursor)
            .find(|&i| keys[i].as_ref().as_bytes() == key && matches!(out[i], Ok(None)))
            .ok_or_else(|| {
                protocol_error(format!(
                    "the server returned {:?}, which was not requested",
                    shown(key)
                ))
            })
    }

    /// Fills `slot` with the value whose data block is next in `r`, `keys` being requested.
    fn fill<R: BufRead>(
        &mut self,
        r: &mut R,
        slot: usize,
        (flags, len, cas): (u32, usize, u64),
        max_value: usize,
        keys: usize,
        out: &mut [Slot],
    ) -> Result<()> {
        self.cursor = slot + 1;
        if len > max_value {
            skip_value(r, len)?;
            out[slot] = Err(Error::new(
                ErrorKind::TooLarge,
                format!(
                    "the server holds a {len}-byte value under this key; the item limit is \
                     {max_value} (skipped)"
                ),
            ));
            return Ok(());
        }
        // len is at most max_value (checked above), so this allocation is bounded. Small values
        // share chunks of one arena (one allocation for a batch's values, not one per key).
        let value = self.arena.take(r, len, keys - self.filled)?;
        self.filled += 1;
        out[slot] = Ok(Some(Item { value, flags, cas }));
        Ok(())
    }
}

/// Where [`read_slots`] puts values: small ones side by side in shared chunks, each chunk sized
/// for the values still expected and no larger than the reply bytes at hand (so a lone `get`
/// allocates its value's size, a batch of a hundred small values one chunk, a lone hit among
/// misses its own size); large ones in buffers of their own. A kept small value keeps its
/// chunk: at most [`Arena::CHUNK`] of its own reply's values.
#[derive(Default)]
struct Arena(BytesMut);

impl Arena {
    /// Values up to this size share chunks.
    const SMALL: usize = 4 * 1024;
    /// The largest shared chunk.
    const CHUNK: usize = 64 * 1024;

    /// Reads a `len`-byte data block and its CRLF; `left` values (this one included) are still
    /// expected in the reply.
    fn take<R: BufRead>(&mut self, r: &mut R, len: usize, left: usize) -> Result<Bytes> {
        let need = len + 2;
        let mut own;
        let buf = if len > Self::SMALL {
            own = BytesMut::with_capacity(need);
            &mut own
        } else {
            if self.0.capacity() - self.0.len() < need {
                // Room for the values still expected, but never more than the reply bytes at
                // hand (this value's, and whatever follows it in the buffer: for the engine,
                // which parses whole replies, the rest of the reply): a lone hit in a batch of
                // misses gets its own size, not room for the keys that missed.
                let at_hand = r.fill_buf().map_or(0, <[u8]>::len);
                let want = need
                    .saturating_mul(left.max(1))
                    .min(at_hand)
                    .clamp(need, Self::CHUNK.max(need));
                self.0 = BytesMut::with_capacity(want);
            }
            &mut self.0
        };
        let start = buf.len();
        while buf.len() - start < need {
            let Some(chunk) = buffered(r)? else { continue };
            let n = chunk.len().min(need - (buf.len() - start));
            buf.extend_from_slice(&chunk[..n]);
            r.consume(n);
        }
        if !buf.ends_with(b"\r\n") {
            return Err(protocol_error("value not followed by CRLF"));
        }
        buf.truncate(buf.len() - 2);
        Ok(buf.split().freeze())
    }
}

/// Reads past a `len`-byte data block and its CRLF without keeping it.
fn skip_value<R: BufRead>(r: &mut R, len: usize) -> Result<()> {
    let skipped = std::io::copy(
        &mut std::io::Read::take(&mut *r, len as u64),
        &mut std::io::sink(),
    )?;
    if skipped != len as u64 {
        return Err(protocol_error(CLOSED));
    }
    let mut crlf = [0u8; 2];
    r.read_exact(&mut crlf)?;
    if &crlf != b"\r\n" {
        return Err(protocol_error("value not followed by CRLF"));
    }
    Ok(())
}

/// [`read_slots`] into plain options; the first per-key error (an over-limit value) is returned
/// after the whole reply was read. For the fuzz target.
pub(crate) fn read_values<R: BufRead>(
    r: &mut R,
    max_value: usize,
    keys: &[&str],
    out: &mut [Option<Item>],
) -> Result<()> {
    let mut slots: Vec<Slot> = (0..keys.len()).map(|_| Ok(None)).collect();
    read_slots(r, max_value, keys, &mut slots)?;
    let mut first = Ok(());
    for (o, s) in out.iter_mut().zip(slots) {
        match s {
            Ok(item) => *o = item,
            Err(e) => {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
    }
    first
}

/// `VALUE <key> <flags> <bytes> <cas>`, parsed as bytes (this runs once per value) in one
/// forward pass: the key ends at the first space (memchr), then each number is read up to the
/// space after it, and the last one up to the line's end. A key with a space in it leaves a
/// field that is not digits, so the line fails to parse.
fn parse_value_line(l: &[u8]) -> Option<(&[u8], u32, usize, u64)> {
    let rest = l.strip_prefix(b"VALUE ")?;
    let end = memchr::memchr(b' ', rest)?;
    let (key, mut fields) = (&rest[..end], &rest[end + 1..]);
    if key.is_empty() {
        return None;
    }
    // A field's digits, up to the space that ends it (which must follow).
    let mut field = || -> Option<u64> {
        let n = fields.iter().position(|&b| !b.is_ascii_digit())?;
        let (digits, after) = fields.split_at(n);
        fields = after.strip_prefix(b" ")?;
        decimal(digits)
    };
    let flags = u32::try_from(field()?).ok()?;
    let len = usize::try_from(field()?).ok()?;
    let cas = decimal(fields)?;
    Some((key, flags, len, cas))
}

/// A non-empty run of ASCII digits as a `u64` (None on overflow or anything else).
fn decimal(digits: &[u8]) -> Option<u64> {
    // Up to 19 digits cannot overflow: no check per digit.
    if digits.is_empty() || digits.len() > 19 {
        return decimal_checked(digits);
    }
    let mut n: u64 = 0;
    for &d in digits {
        let d = d.wrapping_sub(b'0');
        if d > 9 {
            return None;
        }
        n = n * 10 + u64::from(d);
    }
    Some(n)
}

/// [`decimal`] with every step checked (20 digits and more, and the empty run).
fn decimal_checked(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() {
        return None;
    }
    let mut n: u64 = 0;
    for &d in digits {
        if !d.is_ascii_digit() {
            return None;
        }
        n = n.checked_mul(10)?.checked_add(u64::from(d - b'0'))?;
    }
    Some(n)
}

/// The shape of a reply, for [`reply_len`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "tokio"), allow(dead_code))]
pub(crate) enum Shape {
    /// One line (`STORED`, `DELETED`, a number, `OK`, `VERSION ..`, an error).
    Line,
    /// `VALUE` blocks up to `END` (the reply to `gets`).
    Values,
    /// A line, then `VALUE` blocks up to `END` (a store pipelined with its read-back).
    LineThenValues,
}

/// How many bytes at the start of `buf` make one whole reply of this shape, or `None` if more
/// must be read first. Sans-I/O: an async reader buffers bytes until this says a reply is
/// whole, then parses it with the strict parsers above (which then never wait for input).
/// Anything malformed is "whole" as far as it goes, so that the parser reports it; a line
/// without CRLF is whole once it is longer than any valid line.
#[cfg_attr(not(feature = "tokio"), allow(dead_code))]
pub(crate) fn reply_len(shape: Shape, buf: &[u8]) -> Option<usize> {
    match shape {
        Shape::Line => line_end(buf, 0),
        Shape::Values => frame_values(buf, 0, usize::MAX, |_| {}),
        Shape::LineThenValues => frame_values(buf, line_end(buf, 0)?, usize::MAX, |_| {}),
    }
}

/// [`reply_len`] of the reply to a `gets` of `keys` distinct keys, its `VALUE` lines put in
/// `values` (for [`read_framed`]). A `VALUE` line past `keys` of them ends the reply as far as
/// it goes (the parser refuses it), so a hostile server cannot make `values` outgrow the line.
///
/// Resumable: `values` holds what earlier calls found of the same reply (empty for a new one;
/// the caller clears it once the reply is read), and framing goes on after the last of them,
/// so a reply that arrives in many reads has each of its lines parsed once, not once a read.
/// `buf` must hold the same reply from the same offset as on those calls (it may have grown).
#[cfg_attr(not(feature = "tokio"), allow(dead_code))]
pub(crate) fn frame_gets(buf: &[u8], keys: usize, values: &mut Vec<ValueAt>) -> Option<usize> {
    let at = match values.last() {
        Some(v) => v.data.checked_add(v.len)?.checked_add(2)?,
        None => 0,
    };
    if at > buf.len() {
        return None;
    }
    let max = keys.saturating_sub(values.len());
    frame_values(buf, at, max, |v| values.push(v))
}

/// The end of the line starting at `from` (past its `\n`), or `None` if more must be read. A
/// line without one is whole once it is longer than any valid line (the parser refuses it).
fn line_end(buf: &[u8], from: usize) -> Option<usize> {
    let mut rest = &buf[from..];
    // A slice's `skip_until` cannot fail; it finds the byte as `read_until` does (memchr).
    let n = rest.skip_until(b'\n').unwrap_or(0);
    match buf[from..from + n].last() {
        Some(b'\n') => Some(from + n),
        _ if n > MAX_LINE => Some(buf.len()),
        _ => None,
    }
}

#[cfg(test)]
thread_local! {
    /// Whole lines [`frame_values`] looked at on this thread (for the tests of its cost).
    static LINES_FRAMED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// The end of the `VALUE` blocks starting at `at` and of the line that ends them, each of the
/// first `max` `VALUE` lines handed to `found`; `None` if more must be read.
fn frame_values(
    buf: &[u8],
    mut at: usize,
    max: usize,
    mut found: impl FnMut(ValueAt),
) -> Option<usize> {
    let mut seen = 0;
    loop {
        let end = line_end(buf, at)?;
        #[cfg(test)]
        LINES_FRAMED.with(|n| n.set(n.get() + 1));
        let value = buf[at..end]
            .strip_suffix(b"\r\n")
            .and_then(parse_value_line)
            .filter(|_| seen < max);
        let Some((key, flags, len, cas)) = value else {
            // END, an error line, garbage, or a value too many: the line ends the reply.
            return Some(end);
        };
        seen += 1;
        found(ValueAt {
            line: at,
            key_len: key.len(),
            flags,
            len,
            cas,
            data: end,
        });
        at = end.checked_add(len)?.checked_add(2)?;
        if at > buf.len() {
            return None;
        }
    }
}

/// Reads the reply to `set`/`add`/`cas`.
pub(crate) fn read_store<R: BufRead>(r: &mut R) -> Result<StoreOutcome> {
    let mut line = Vec::with_capacity(32);
    match check_error(read_line(r, &mut line)?)? {
        b"STORED" => Ok(StoreOutcome::Stored),
        b"NOT_STORED" => Ok(StoreOutcome::NotStored),
        b"EXISTS" => Ok(StoreOutcome::Exists),
        b"NOT_FOUND" => Ok(StoreOutcome::NotFound),
        other => Err(protocol_error(format!(
            "unexpected reply to a store: {:?}",
            shown(other)
        ))),
    }
}

/// Reads the reply to `delete`: whether the key existed.
pub(crate) fn read_delete<R: BufRead>(r: &mut R) -> Result<bool> {
    read_found(r, b"DELETED", "delete")
}

/// Reads the reply to `touch`: `true` if the key existed.
pub(crate) fn read_touch<R: BufRead>(r: &mut R) -> Result<bool> {
    read_found(r, b"TOUCHED", "touch")
}

/// A reply that is `done` (the key existed) or `NOT_FOUND`.
fn read_found<R: BufRead>(r: &mut R, done: &[u8], command: &str) -> Result<bool> {
    let mut line = Vec::with_capacity(32);
    match check_error(read_line(r, &mut line)?)? {
        l if l == done => Ok(true),
        b"NOT_FOUND" => Ok(false),
        other => Err(protocol_error(format!(
            "unexpected reply to {command}: {:?}",
            shown(other)
        ))),
    }
}

/// Reads the reply to `incr`/`decr`: the new value, or `None` when the key is missing.
pub(crate) fn read_arith<R: BufRead>(r: &mut R) -> Result<Option<u64>> {
    let mut line = Vec::with_capacity(32);
    match check_error(read_line(r, &mut line)?)? {
        b"NOT_FOUND" => Ok(None),
        // memcached pads a shrunk counter with spaces in storage; trim in case a server echoes it.
        n => decimal(n.trim_ascii_end()).map(Some).ok_or_else(|| {
            protocol_error(format!("unexpected reply to incr/decr: {:?}", shown(n)))
        }),
    }
}

/// Reads a bare `OK` (the reply to `flush_all`).
pub(crate) fn read_ok<R: BufRead>(r: &mut R) -> Result<()> {
    let mut line = Vec::with_capacity(32);
    match check_error(read_line(r, &mut line)?)? {
        b"OK" => Ok(()),
        other => Err(protocol_error(format!(
            "expected OK, got {:?}",
            shown(other)
        ))),
    }
}

/// Reads `VERSION x.y.z`.
pub(crate) fn read_version<R: BufRead>(r: &mut R) -> Result<String> {
    let mut line = Vec::with_capacity(32);
    let l = check_error(read_line(r, &mut line)?)?;
    l.strip_prefix(b"VERSION ")
        .map(shown)
        .ok_or_else(|| protocol_error(format!("expected VERSION, got {:?}", shown(l))))
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    use crate::backend::Write as W;

    #[test]
    fn encoders() {
        let mut b = Vec::new();
        encode_gets(&mut b, &["a", "b"]).unwrap();
        encode_store(
            &mut b,
            &W::new(StoreMode::Cas(9), "k", b"xy", 0x4E43, 60),
            100,
        )
        .unwrap();
        encode_store(&mut b, &W::new(StoreMode::Add, "k", b"", 0, 0), 100).unwrap();
        encode_delete(&mut b, "k").unwrap();
        encode_arith(&mut b, false, "c", 5).unwrap();
        encode_touch(&mut b, "k", i32::MAX as u32).unwrap();
        assert_eq!(
            String::from_utf8(b).unwrap(),
            "gets a b\r\ncas k 20035 60 2 9\r\nxy\r\nadd k 0 0 0\r\n\r\ndelete k\r\ndecr c 5\r\n\
             touch k 2147483647\r\n"
        );
    }

    /// Every encoder refuses bad input with a typed error and leaves the buffer as it was: a
    /// command is written whole and valid or not at all (memcached answers a too-long key with
    /// CLIENT_ERROR without reading the data block, which then runs as commands).
    #[test]
    fn bad_input_writes_nothing() {
        #[track_caller]
        fn check(encode: impl FnOnce(&mut Vec<u8>) -> Result<()>, kind: ErrorKind) {
            let mut b = b"get before\r\n".to_vec();
            let e = encode(&mut b).unwrap_err();
            assert_eq!(e.kind(), kind, "{e}");
            assert_eq!(b, b"get before\r\n", "the buffer is untouched");
        }
        let long = "k".repeat(251);
        let evil = b"x\r\nflush_all\r\n";
        for key in [
            long.as_str(),
            "",
            "a b",
            "a\nb",
            "a\rb",
            "a\x00b",
            "a\tb",
            "a\x7fb",
        ] {
            check(
                |b| encode_store(b, &W::new(StoreMode::Set, key, evil, 0, 0), 100),
                ErrorKind::InvalidKey,
            );
            check(|b| encode_gets(b, &["ok", key]), ErrorKind::InvalidKey);
            check(|b| encode_delete(b, key), ErrorKind::InvalidKey);
            check(|b| encode_arith(b, true, key, 1), ErrorKind::InvalidKey);
            check(|b| encode_touch(b, key, 0), ErrorKind::InvalidKey);
        }
        check(|b| encode_gets::<&str>(b, &[]), ErrorKind::InvalidKey);
        let over = i32::MAX as u32 + 1;
        for exptime in [over, u32::MAX] {
            check(
                |b| encode_store(b, &W::new(StoreMode::Set, "k", b"v", 0, exptime), 100),
                ErrorKind::Config,
            );
            check(|b| encode_touch(b, "k", exptime), ErrorKind::Config);
        }
        check(
            |b| encode_store(b, &W::new(StoreMode::Add, "k", &[0; 101], 0, 0), 100),
            ErrorKind::TooLarge,
        );
        // the limits themselves are fine
        let max_key = "k".repeat(250);
        let mut b = Vec::new();
        encode_store(
            &mut b,
            &W::new(StoreMode::Set, &max_key, &[0; 100], 0, i32::MAX as u32),
            100,
        )
        .unwrap();
        assert!(b.starts_with(format!("set {max_key} 0 2147483647 100\r\n").as_bytes()));
    }

    #[test]
    fn an_over_limit_value_is_skipped_and_the_reply_read_to_its_end() {
        let mut reply = b"VALUE big 0 300 1\r\n".to_vec();
        reply.extend_from_slice(&[b'z'; 300]);
        reply.extend_from_slice(b"\r\nVALUE small 3 2 2\r\nhi\r\nEND\r\nSTORED\r\n");
        let mut r = &reply[..];
        let mut out: Vec<Slot> = vec![Ok(None), Ok(None), Ok(None)];
        read_slots(&mut r, 100, &["big", "small", "gone"], &mut out).unwrap();
        let e = out[0].as_ref().unwrap_err();
        assert!(e.is_too_large() && leaves_connection_usable(e), "{e}");
        assert_eq!(&out[1].as_ref().unwrap().as_ref().unwrap().value[..], b"hi");
        assert!(matches!(out[2], Ok(None)));
        // in step: the next reply is read as the next reply
        assert_eq!(read_store(&mut r).unwrap(), StoreOutcome::Stored);
        // a value cut short is a transport fault, not a skip
        let mut cut = &reply[..100];
        let mut out: Vec<Slot> = vec![Ok(None)];
        let e = read_slots(&mut cut, 100, &["big"], &mut out).unwrap_err();
        assert!(!is_server_reply(&e), "{e}");
    }

    #[test]
    fn a_batch_of_mixed_sizes_reads_back_exactly_through_any_read_sizes() {
        // Small values share arena chunks, a chunk fills up mid-batch (sizes grow past what the
        // first chunk was sized for), large values get buffers of their own; read whole and one
        // byte at a time.
        let sizes = [
            0usize, 1, 130, 4096, 4097, 9000, 3, 200, 70_000, 2, 4000, 4000, 4000, 1,
        ];
        let keys: Vec<String> = (0..sizes.len()).map(|i| format!("k{i}")).collect();
        let value = |i: usize| -> Vec<u8> { (0..sizes[i]).map(|j| (i * 7 + j) as u8).collect() };
        let mut reply = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            reply.extend_from_slice(format!("VALUE {k} {i} {} {i}\r\n", sizes[i]).as_bytes());
            reply.extend_from_slice(&value(i));
            reply.extend_from_slice(b"\r\n");
        }
        reply.extend_from_slice(b"END\r\n");
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        for capacity in [1, 7, 16 * 1024] {
            let mut r = std::io::BufReader::with_capacity(capacity, &reply[..]);
            let mut out: Vec<Slot> = vec![Ok(None); keys.len()];
            read_slots(&mut r, 1 << 20, &refs, &mut out).unwrap();
            for (i, slot) in out.iter().enumerate() {
                let item = slot.as_ref().unwrap().as_ref().unwrap();
                assert_eq!(
                    &item.value[..],
                    &value(i)[..],
                    "key {i}, capacity {capacity}"
                );
                assert_eq!((item.flags, item.cas), (i as u32, i as u64));
            }
        }
    }

    #[test]
    fn error_replies_are_answers_not_faults() {
        for reply in [
            &b"CLIENT_ERROR line too long\r\n"[..],
            b"SERVER_ERROR out of memory storing object\r\n",
            b"SERVER_ERROR object too large for cache\r\n",
            b"ERROR\r\n",
        ] {
            let e = read_store(&mut &reply[..]).unwrap_err();
            assert!(is_server_reply(&e), "{e}");
        }
        for reply in [&b""[..], b"STORED", b"WHAT\r\n"] {
            let e = read_store(&mut &reply[..]).unwrap_err();
            assert!(!is_server_reply(&e), "{reply:?}: {e}");
        }
    }

    #[test]
    fn values_matched_by_name_in_any_order() {
        let mut r = &b"VALUE b 1 2 7\r\nhi\r\nVALUE a 0 0 8\r\n\r\nEND\r\n"[..];
        let mut out = vec![None; 3];
        read_values(&mut r, 100, &["a", "x", "b"], &mut out).unwrap();
        let hi = Item {
            value: b"hi".to_vec().into(),
            flags: 1,
            cas: 7,
        };
        assert_eq!(out[2], Some(hi));
        assert_eq!(out[0].as_ref().map(|i| i.value.len()), Some(0));
        assert_eq!(out[1], None);
        assert!(r.is_empty());
    }

    #[test]
    fn a_key_that_was_not_requested_is_an_error() {
        let mut r = &b"VALUE z 0 1 1\r\nq\r\nEND\r\n"[..];
        let mut out = vec![None; 1];
        assert!(read_values(&mut r, 100, &["a"], &mut out).is_err());
    }

    #[test]
    fn hostile_replies_are_errors() {
        let cases: &[&[u8]] = &[
            b"",                               // closed
            b"VALUE a 0 5 1\r\nhi\r\nEND\r\n", // short value
            b"VALUE a 0 999999999999 1\r\n",   // huge length
            b"VALUE a x 1 1\r\nh\r\nEND\r\n",  // bad flags
            b"VALUE a 0 1\r\nh\r\nEND\r\n",    // no cas
            b"garbage\r\n",
            b"END", // no CRLF
        ];
        for c in cases {
            let mut out = vec![None; 1];
            let mut r = *c;
            let e = read_values(&mut r, 100, &["a"], &mut out).unwrap_err();
            assert!(!leaves_connection_usable(&e), "{c:?}: {e}");
            assert!(!is_server_reply(&e), "{c:?}: {e}");
        }
        let long = vec![b'x'; 5000];
        assert!(read_store(&mut &long[..]).is_err());
    }

    #[test]
    fn decimals() {
        assert_eq!(decimal(b"0"), Some(0));
        assert_eq!(decimal(b"18446744073709551615"), Some(u64::MAX));
        assert_eq!(
            decimal(b"9999999999999999999"),
            Some(9_999_999_999_999_999_999)
        );
        assert_eq!(decimal(b"00000000000000000000042"), Some(42));
        for bad in [
            &b""[..],
            b"18446744073709551616",
            b"99999999999999999999",
            b"1 ",
            b"-1",
            b"x",
            b"1:",
            b"/",
        ] {
            assert_eq!(decimal(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_gets_reply_read_in_pieces_has_each_line_framed_once() {
        let mut reply = Vec::new();
        let keys: Vec<String> = (0..128).map(|i| format!("key:{i}")).collect();
        for (i, k) in keys.iter().enumerate() {
            let value = vec![b'v'; i % 7 * 40];
            reply.extend_from_slice(format!("VALUE {k} 0 {} {i}\r\n", value.len()).as_bytes());
            reply.extend_from_slice(&value);
            reply.extend_from_slice(b"\r\n");
        }
        reply.extend_from_slice(b"END\r\n");
        let mut whole = Vec::new();
        assert_eq!(
            frame_gets(&reply, keys.len(), &mut whole),
            Some(reply.len())
        );
        assert_eq!(whole.len(), keys.len());
        // As a reader sees it: the reply grows a piece at a time, the values kept between.
        for piece in [1, 7, 100, 4096] {
            let before = LINES_FRAMED.with(|n| n.get());
            let mut values = Vec::new();
            let mut calls = 0;
            let mut have = 0;
            let framed = loop {
                have = (have + piece).min(reply.len());
                calls += 1;
                if let Some(n) = frame_gets(&reply[..have], keys.len(), &mut values) {
                    break n;
                }
                assert!(have < reply.len(), "whole, yet not framed");
            };
            assert_eq!(framed, reply.len(), "piece {piece}");
            assert_eq!(values.len(), whole.len());
            for (a, b) in values.iter().zip(&whole) {
                assert_eq!(
                    (a.line, a.key_len, a.len, a.cas, a.data),
                    (b.line, b.key_len, b.len, b.cas, b.data)
                );
            }
            let lines = LINES_FRAMED.with(|n| n.get()) - before;
            // Each whole line once: the values' and END. Framing from the start on every call
            // looks at about calls x values / 2; framing the last value's line again on every
            // call, at one a call more.
            assert_eq!(
                lines,
                keys.len() + 1,
                "piece {piece}: {lines} lines looked at in {calls} calls"
            );
        }
        // A server answering more values than keys asked: the extra line ends the reply as far
        // as it goes, resumed or not.
        let mut values = Vec::new();
        let cut = whole[99].data + 1;
        assert_eq!(frame_gets(&reply[..cut], 100, &mut values), None);
        assert_eq!(frame_gets(&reply, 100, &mut values), Some(whole[100].data));
        assert_eq!(values.len(), 100);
    }

    #[test]
    fn a_value_length_near_the_top_of_u64_frames_alike_resumed_or_not() {
        for len in [u64::MAX, u64::MAX - 1, u64::MAX - 30, u64::MAX >> 1] {
            let mut reply = format!("VALUE a 0 {len} 1\r\n").into_bytes();
            reply.extend_from_slice(b"xEND\r\nVALUE b 0 1 2\r\nx\r\nEND\r\n");
            for cut in 0..=reply.len() {
                let mut resumed = Vec::new();
                let first = frame_gets(&reply[..cut], 2, &mut resumed);
                let mut fresh = Vec::new();
                let end = frame_gets(&reply, 2, &mut fresh);
                if first.is_none() {
                    assert_eq!(
                        frame_gets(&reply, 2, &mut resumed),
                        end,
                        "{len} cut at {cut}"
                    );
                    assert_eq!(format!("{resumed:?}"), format!("{fresh:?}"));
                }
            }
        }
    }

    /// The parser as it was before the one-pass one: the numbers split off from the end.
    fn value_line_from_the_end(l: &[u8]) -> Option<(&[u8], u32, usize, u64)> {
        let rest = l.strip_prefix(b"VALUE ")?;
        let split = |s: &mut &[u8]| -> Option<u64> {
            let at = s.iter().rposition(|&b| b == b' ')?;
            let field = &s[at + 1..];
            *s = &s[..at];
            decimal_checked(field)
        };
        let mut head = rest;
        let cas = split(&mut head)?;
        let len = usize::try_from(split(&mut head)?).ok()?;
        let flags = u32::try_from(split(&mut head)?).ok()?;
        if head.is_empty() || head.contains(&b' ') {
            return None;
        }
        Some((head, flags, len, cas))
    }

    #[test]
    fn value_lines_parse_as_the_split_from_the_end_did() {
        let lines: &[&[u8]] = &[
            b"VALUE k 0 3 7",
            b"VALUE a-1-0123456789abcdef0123456789abcdef01234567 20035 130 18446744073709551615",
            b"VALUE k 4294967295 0 0",
            b"VALUE k 4294967296 0 0",
            b"VALUE k 0 18446744073709551616 0",
            b"VALUE k 0 3",
            b"VALUE k 0 3 7 9",
            b"VALUE  0 3 7",
            b"VALUE k  0 3 7",
            b"VALUE k 0  3 7",
            b"VALUE k 0 3 7 ",
            b"VALUE k 0 3 ",
            b"VALUE k x 3 7",
            b"VALUE k 0 -3 7",
            b"VALUE k 0 3 7x",
            b"VALUE k\t0 3 7",
            b"VALUE a b 0 3 7",
            b"VALUE k 0 3 7\r",
            b"VALUE ",
            b"VALUE",
            b"END",
            b"value k 0 3 7",
        ];
        for l in lines {
            assert_eq!(
                parse_value_line(l),
                value_line_from_the_end(l),
                "{:?}",
                shown(l)
            );
        }
        // Every line made of a short alphabet, up to 9 bytes after "VALUE ".
        let alphabet = b"k 09";
        let mut line = b"VALUE ".to_vec();
        let mut checked = 0;
        for len in 0..=9u32 {
            for n in 0..alphabet.len().pow(len) {
                line.truncate(6);
                let mut n = n;
                for _ in 0..len {
                    line.push(alphabet[n % alphabet.len()]);
                    n /= alphabet.len();
                }
                assert_eq!(
                    parse_value_line(&line),
                    value_line_from_the_end(&line),
                    "{:?}",
                    shown(&line)
                );
                checked += 1;
            }
        }
        assert!(checked > 300_000);
    }

    #[test]
    fn replies() {
        assert_eq!(
            read_store(&mut &b"NOT_STORED\r\n"[..]).unwrap(),
            StoreOutcome::NotStored
        );
        assert_eq!(
            read_store(&mut &b"EXISTS\r\n"[..]).unwrap(),
            StoreOutcome::Exists
        );
        assert!(read_delete(&mut &b"DELETED\r\n"[..]).unwrap());
        assert_eq!(read_arith(&mut &b"99\r\n"[..]).unwrap(), Some(99));
        assert_eq!(read_arith(&mut &b"NOT_FOUND\r\n"[..]).unwrap(), None);
        let e = read_arith(
            &mut &b"CLIENT_ERROR cannot increment or decrement non-numeric value\r\n"[..],
        )
        .unwrap_err();
        assert!(e.is_not_a_counter() && leaves_connection_usable(&e));
        let e = read_store(&mut &b"SERVER_ERROR object too large for cache\r\n"[..]).unwrap_err();
        assert!(e.is_too_large() && leaves_connection_usable(&e));
        assert!(
            read_ok(&mut &b"ERROR\r\n"[..])
                .unwrap_err()
                .is_unsupported()
        );
        assert_eq!(
            read_version(&mut &b"VERSION 1.6.18\r\n"[..]).unwrap(),
            "1.6.18"
        );
    }

    #[test]
    fn reply_len_waits_for_whole_replies() {
        let v = b"VALUE k 0 3 9\r\nabc\r\nEND\r\nSTORED\r\n";
        assert_eq!(reply_len(Shape::Values, v), Some(25));
        for cut in 0..25 {
            assert_eq!(reply_len(Shape::Values, &v[..cut]), None, "cut at {cut}");
        }
        // A data block containing CRLF and "END" is skipped by length, not scanned.
        let tricky = b"VALUE k 0 5 1\r\nEND\r\n\r\nEND\r\n";
        assert_eq!(reply_len(Shape::Values, tricky), Some(tricky.len()));
        assert_eq!(reply_len(Shape::Line, b"STORED\r\nEND"), Some(8));
        assert_eq!(reply_len(Shape::Line, b"STOR"), None);
        let both = b"STORED\r\nVALUE k 0 1 2\r\nx\r\nEND\r\n";
        assert_eq!(reply_len(Shape::LineThenValues, both), Some(both.len()));
        assert_eq!(
            reply_len(Shape::LineThenValues, &both[..both.len() - 1]),
            None
        );
        // An error line ends a values reply; an endless line is whole once over the limit.
        assert_eq!(reply_len(Shape::Values, b"SERVER_ERROR x\r\n"), Some(16));
        let long = vec![b'x'; MAX_LINE + 1];
        assert_eq!(reply_len(Shape::Line, &long), Some(long.len()));
        // Whatever reply_len calls whole parses without waiting for input.
        let mut r = &v[..25];
        let mut out = vec![Ok(None)];
        read_slots(&mut r, 1 << 20, &["k"], &mut out).unwrap();
        assert_eq!(
            &out[0].as_ref().unwrap().as_ref().unwrap().value[..],
            b"abc"
        );
    }

    /// A batch of 100 keys with one 600-byte hit: an arena sized for 100 values (`need * left`,
    /// counting the misses) would make the lone hit's `Bytes` hold a ~60 KB buffer.
    #[test]
    fn a_lone_hit_in_a_sparse_batch_holds_a_buffer_its_own_size() {
        let keys: Vec<String> = (0..100).map(|i| format!("k{i}")).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let mut reply = b"VALUE k0 0 600 1\r\n".to_vec();
        reply.extend_from_slice(&[b'x'; 600]);
        reply.extend_from_slice(b"\r\nEND\r\n");
        let mut r = &reply[..];
        let mut out: Vec<Slot> = vec![Ok(None); refs.len()];
        read_slots(&mut r, 1 << 20, &refs, &mut out).unwrap();
        let item = out.swap_remove(0).unwrap().unwrap();
        drop(out);
        let held = item.value.try_into_mut().expect("unique").capacity();
        assert!(held < 4 * 1024, "a 600-byte value holds {held} bytes");
    }

    /// What a `gets` reply read into slots says, for comparing two readers: each slot's value
    /// (bytes, flags, cas), miss or error kind; or the whole reply's error kind and whether the
    /// connection stays usable (the messages may differ).
    pub(in crate::backend::memcached) fn outcome(read: Result<Vec<Slot>>) -> String {
        let slot = |s: &Slot| match s {
            Ok(None) => "miss".to_string(),
            Ok(Some(i)) => format!("{:?}/{}/{}", &i.value[..], i.flags, i.cas),
            Err(e) => format!("{:?}", e.kind()),
        };
        match read {
            Ok(slots) => slots.iter().map(slot).collect::<Vec<_>>().join(" "),
            Err(e) => format!(
                "error {:?} usable {} answer {} closed {}",
                e.kind(),
                leaves_connection_usable(&e),
                is_server_reply(&e),
                is_closed(&e)
            ),
        }
    }

    /// A reader of `bytes`, at most `cap` at a time, whose `fill_buf` is interrupted once at
    /// each offset of `interrupt`, answers the end once, then times out.
    struct Rough<'a> {
        bytes: &'a [u8],
        at: usize,
        cap: usize,
        interrupt: Vec<usize>,
        ended: bool,
    }

    impl std::io::Read for Rough<'_> {
        fn read(&mut self, _: &mut [u8]) -> std::io::Result<usize> {
            unreachable!("read_slots reads through fill_buf")
        }
    }

    impl std::io::BufRead for Rough<'_> {
        fn fill_buf(&mut self) -> std::io::Result<&[u8]> {
            if let Some(i) = self.interrupt.iter().position(|&o| o == self.at) {
                self.interrupt.remove(i);
                return Err(std::io::ErrorKind::Interrupted.into());
            }
            if self.at == self.bytes.len() {
                if self.ended {
                    return Err(std::io::ErrorKind::TimedOut.into());
                }
                self.ended = true;
            }
            Ok(&self.bytes[self.at..self.bytes.len().min(self.at + self.cap)])
        }
        fn consume(&mut self, n: usize) {
            self.at += n;
        }
    }

    #[test]
    fn interruptions_and_the_end_of_the_stream_read_as_from_a_slice() {
        let keys = ["a", "bb", "big"];
        let cases: &[&[u8]] = &[
            b"VALUE a 0 3 9\r\nabc\r\nVALUE bb 1 2 7\r\nhi\r\nEND\r\n",
            b"VALUE a 0 3 9\r\nabc\r\nVALUE bb 1 2 7\r\nhi\r\nEN",
            b"VALUE a 0 3 9\r\nabc\r\nVALUE bb 1 2",
            b"VALUE a 0 3 9\r\nabc\r\nSERVER_ERROR out of memory\r\nEND\r\n",
            b"VALUE a 0 3 9\r\nabc\r\nCLIENT_ERROR bad\r\n",
            b"VALUE a 0 3 9\r\nab",
            b"END\n",
            b"",
        ];
        for (i, c) in cases.iter().enumerate() {
            let mut whole: Vec<Slot> = vec![Ok(None); keys.len()];
            let mut r = &c[..];
            let whole = read_slots(&mut r, 100, &keys, &mut whole).map(|()| whole);
            let consumed = c.len() - r.len();
            for cap in [1, 2, 5, 64] {
                for every in [1, 3, 7] {
                    let mut r = Rough {
                        bytes: c,
                        at: 0,
                        cap,
                        interrupt: (0..=c.len()).step_by(every).collect(),
                        ended: false,
                    };
                    let mut out: Vec<Slot> = vec![Ok(None); keys.len()];
                    let read = read_slots(&mut r, 100, &keys, &mut out).map(|()| out);
                    assert_eq!(
                        outcome(read),
                        outcome(whole.clone()),
                        "case {i}, {cap}-byte reads, interrupted every {every}: {:?}",
                        shown(c)
                    );
                    assert_eq!(r.at, consumed, "case {i}, {cap}-byte reads: consumed");
                }
            }
        }
    }

    #[test]
    fn a_framed_reply_reads_as_the_streaming_parser_reads_it() {
        let keys = ["a", "b", "big"];
        let mut big = b"VALUE big 0 300 1\r\n".to_vec();
        big.extend_from_slice(&[b'z'; 300]);
        big.extend_from_slice(b"\r\nVALUE a 3 2 2\r\nhi\r\nEND\r\n");
        let mut long_key = b"VALUE ".to_vec();
        long_key.extend_from_slice(&[b'k'; MAX_LINE]);
        long_key.extend_from_slice(b" 0 1 1\r\nx\r\nEND\r\n");
        let mut long_end = vec![b'x'; MAX_LINE + 5];
        long_end.extend_from_slice(b"\r\n");
        let cases: &[&[u8]] = &[
            b"END\r\n",
            b"VALUE a 0 3 9\r\nabc\r\nEND\r\n",
            b"VALUE b 1 2 7\r\nhi\r\nVALUE a 0 0 8\r\n\r\nEND\r\n",
            b"VALUE a 0 5 1\r\nEND\r\n\r\nEND\r\n",
            b"VALUE a 0 1 1\r\nx\r\nVALUE a 0 1 1\r\ny\r\nEND\r\n",
            b"VALUE a 0 1 1\r\nx\r\nVALUE b 0 1 1\r\ny\r\nVALUE big 0 1 1\r\nz\r\nVALUE a 0 1 1\r\nw\r\nEND\r\n",
            &big,
            b"SERVER_ERROR out of memory\r\n",
            b"CLIENT_ERROR bad data chunk\r\n",
            b"ERROR\r\n",
            b"VALUE a 0 1 1\r\nx\r\nSERVER_ERROR oops\r\n",
            b"VALUE z 0 1 1\r\nq\r\nEND\r\n",
            b"VALUE a 0 5 1\r\nhi\r\nEND\r\n",
            b"VALUE a x 1 1\r\nh\r\nEND\r\n",
            b"VALUE a 0 1\r\nh\r\nEND\r\n",
            b"garbage\r\n",
            b"END\n",
            b"VAL\nUE a 0 1 1\r\nx\r\nEND\r\n",
            b"VALUE a 0 3 1\r\nabcXYEND\r\n",
            b"VALUE a 0 3 1\r\nabc\r\nVALUE b 0 2 2\r\nxy\nZEND\r\n",
            &long_key,
            &long_end,
        ];
        for (i, c) in cases.iter().enumerate() {
            let mut values = Vec::new();
            let n = frame_gets(c, keys.len(), &mut values)
                .unwrap_or_else(|| panic!("case {i}: not whole"));
            assert!(
                values.len() <= keys.len(),
                "case {i}: a value too many recorded"
            );
            let mut streamed: Vec<Slot> = vec![Ok(None); keys.len()];
            let mut r = &c[..n];
            let streamed = read_slots(&mut r, 100, &keys, &mut streamed).map(|()| streamed);
            if streamed.is_ok() {
                assert!(
                    r.is_empty(),
                    "case {i}: the framing and the parser disagree on its end"
                );
            }
            // Through readers whose buffer ends inside its lines: they are copied out, the
            // others read in place; the verdict and what is consumed are the same.
            for cap in [1, 2, 3, 7, 16, 40] {
                let (chunked, rest) = read_chunked(&c[..], cap, 100, &keys);
                assert_eq!(
                    outcome(chunked),
                    outcome(streamed.clone()),
                    "case {i}, a {cap}-byte buffer: {:?}",
                    shown(c)
                );
                assert_eq!(
                    rest,
                    r.len() + c.len() - n,
                    "case {i}, a {cap}-byte buffer: its end"
                );
            }
            let mut framed: Vec<Slot> = vec![Ok(None); keys.len()];
            let framed = read_framed(&c[..n], &values, 100, &keys, &mut framed).map(|()| framed);
            assert_eq!(
                outcome(framed),
                outcome(streamed),
                "case {i}: {:?}",
                shown(c)
            );
        }
        // A lone hit among misses holds a buffer its own size, as read_slots's does.
        let many: Vec<String> = (0..100).map(|i| format!("k{i}")).collect();
        let mut reply = b"VALUE k0 0 600 1\r\n".to_vec();
        reply.extend_from_slice(&[b'x'; 600]);
        reply.extend_from_slice(b"\r\nEND\r\nVALUE k1 0 1 1\r\nx\r\nEND\r\n");
        let mut values = Vec::new();
        let n = frame_gets(&reply, many.len(), &mut values).unwrap();
        let mut out: Vec<Slot> = vec![Ok(None); many.len()];
        read_framed(&reply[..n], &values, 1 << 20, &many, &mut out).unwrap();
        let item = out.swap_remove(0).unwrap().unwrap();
        drop(out);
        let held = item.value.try_into_mut().expect("unique").capacity();
        assert!(held < 4 * 1024, "a 600-byte value holds {held} bytes");
    }

    #[test]
    fn arena_malformed_and_truncated_values() {
        // Bad terminators, small and large, first and after a good value in the same chunk.
        for reply in [
            &b"VALUE a 0 3 1\r\nabcXYEND\r\n"[..],
            b"VALUE a 0 3 1\r\nabc\r\nVALUE b 0 2 2\r\nxy\nZEND\r\n",
            b"VALUE a 0 3 1\r\nabc\r\nVALUE b 0 2 2\r\nxy\r",
            b"VALUE a 0 3 1\r\nab",
        ] {
            let mut r = reply;
            let mut out: Vec<Slot> = vec![Ok(None); 2];
            assert!(read_slots(&mut r, 1 << 20, &["a", "b"], &mut out).is_err());
        }
        let mut big = b"VALUE a 0 5000 1\r\n".to_vec();
        big.extend_from_slice(&[b'q'; 5000]);
        big.extend_from_slice(b"\n\rEND\r\n");
        let mut r = &big[..];
        let mut out: Vec<Slot> = vec![Ok(None); 1];
        assert!(read_slots(&mut r, 1 << 20, &["a"], &mut out).is_err());
        // Interrupted reads are retried.
        struct Flaky<'a>(&'a [u8], bool);
        impl std::io::Read for Flaky<'_> {
            fn read(&mut self, _: &mut [u8]) -> std::io::Result<usize> {
                unreachable!()
            }
        }
        impl std::io::BufRead for Flaky<'_> {
            fn fill_buf(&mut self) -> std::io::Result<&[u8]> {
                self.1 = !self.1;
                if self.1 {
                    return Err(std::io::ErrorKind::Interrupted.into());
                }
                Ok(&self.0[..self.0.len().min(3)])
            }
            fn consume(&mut self, n: usize) {
                self.0 = &self.0[n..];
            }
        }
        let reply = b"VALUE a 0 10 1\r\n0123456789\r\nVALUE b 0 0 2\r\n\r\nEND\r\n";
        let mut r = Flaky(&reply[..], false);
        let mut out: Vec<Slot> = vec![Ok(None); 2];
        read_slots(&mut r, 1 << 20, &["a", "b"], &mut out).unwrap();
        assert_eq!(
            &out[0].as_ref().unwrap().as_ref().unwrap().value[..],
            b"0123456789"
        );
        assert_eq!(out[1].as_ref().unwrap().as_ref().unwrap().value.len(), 0);
    }
}
