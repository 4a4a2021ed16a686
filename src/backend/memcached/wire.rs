//! memcached's text protocol: command encoders into a buffer and strict reply parsers over any
//! `BufRead`. No sockets here; every reply is bounded (line length, value size), and anything
//! unexpected is an error that tells the caller the connection is out of step.

use std::io::BufRead;

use crate::backend::{Item, StoreMode, StoreOutcome};
use crate::error::{Error, ErrorKind, Result};

/// Longest reply line accepted (a `VALUE` header with a 250-byte key is under 300 bytes).
const MAX_LINE: usize = 1024;

const CLOSED: &str = "the server closed the connection";

/// Whether the server closed the connection instead of replying.
pub(crate) fn is_closed(e: &Error) -> bool {
    e.kind() == ErrorKind::Backend && e.to_string().ends_with(CLOSED)
}

/// Why a reply could not be used.
pub(crate) fn protocol_error(what: impl Into<String>) -> Error {
    Error::new(ErrorKind::Backend, what.into())
}

/// `gets k1 k2 ...\r\n`
pub(crate) fn encode_gets(out: &mut Vec<u8>, keys: &[&str]) {
    out.extend_from_slice(b"gets");
    for k in keys {
        out.push(b' ');
        out.extend_from_slice(k.as_bytes());
    }
    out.extend_from_slice(b"\r\n");
}

/// `set|add|cas key flags exptime bytes [cas]\r\n<data>\r\n`
pub(crate) fn encode_store(
    out: &mut Vec<u8>,
    mode: StoreMode,
    key: &str,
    value: &[u8],
    flags: u32,
    exptime: u32,
) {
    let verb: &[u8] = match mode {
        StoreMode::Set => b"set ",
        StoreMode::Add => b"add ",
        StoreMode::Cas(_) => b"cas ",
    };
    out.extend_from_slice(verb);
    out.extend_from_slice(key.as_bytes());
    let mut tail = format!(" {flags} {exptime} {}", value.len());
    if let StoreMode::Cas(token) = mode {
        tail.push_str(&format!(" {token}"));
    }
    tail.push_str("\r\n");
    out.extend_from_slice(tail.as_bytes());
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// `delete key\r\n`
pub(crate) fn encode_delete(out: &mut Vec<u8>, key: &str) {
    out.extend_from_slice(b"delete ");
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// `touch key exptime\r\n`
pub(crate) fn encode_touch(out: &mut Vec<u8>, key: &str, exptime: u32) {
    out.extend_from_slice(b"touch ");
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(format!(" {exptime}\r\n").as_bytes());
}

/// `incr|decr key delta\r\n`
pub(crate) fn encode_arith(out: &mut Vec<u8>, incr: bool, key: &str, delta: u64) {
    out.extend_from_slice(if incr { b"incr " } else { b"decr " });
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(format!(" {delta}\r\n").as_bytes());
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
            Err(Error::new(
                ErrorKind::Backend,
                format!("server error: {msg}"),
            ))
        }
    } else if let Some(msg) = line.strip_prefix(b"CLIENT_ERROR ") {
        let msg = shown(msg);
        if msg.contains("non-numeric") {
            Err(Error::new(ErrorKind::NotACounter, format!("server: {msg}")))
        } else {
            Err(Error::new(
                ErrorKind::Backend,
                format!("server refused the command: {msg}"),
            ))
        }
    } else {
        Ok(line)
    }
}

/// Whether an error leaves the connection in step with the server (a complete reply was read).
pub(crate) fn leaves_connection_usable(e: &Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::TooLarge | ErrorKind::NotACounter | ErrorKind::Unsupported
    )
}

/// Reads a `gets` reply for `keys` into `out` (same length, by position). Values are matched by
/// the key each `VALUE` line names, in one forward pass when the server answers in request order
/// (memcached does) and by search when it does not (twemproxy may reorder). A key that was not
/// requested, or a value above `max_value`, is an error (nothing that large is allocated).
pub(crate) fn read_values<R: BufRead>(
    r: &mut R,
    max_value: usize,
    keys: &[&str],
    out: &mut [Option<Item>],
) -> Result<()> {
    let mut line = Vec::with_capacity(128);
    let mut cursor = 0;
    loop {
        let l = check_error(read_line(r, &mut line)?)?;
        if l == b"END" {
            return Ok(());
        }
        let (key, flags, len, cas) = parse_value_line(l)
            .ok_or_else(|| protocol_error(format!("unexpected reply to gets: {:?}", shown(l))))?;
        if len > max_value {
            return Err(Error::with_source(
                ErrorKind::Backend,
                "connection dropped after a bad reply",
                Error::new(
                    ErrorKind::TooLarge,
                    format!("the server sent a {len}-byte value; the item limit is {max_value}"),
                ),
            ));
        }
        let slot = (cursor..keys.len())
            .chain(0..cursor)
            .find(|&i| keys[i].as_bytes() == key && out[i].is_none())
            .ok_or_else(|| {
                protocol_error(format!(
                    "the server returned {:?}, which was not requested",
                    shown(key)
                ))
            })?;
        cursor = slot + 1;
        // len is at most max_value (checked above), so this allocation is bounded.
        let mut value = vec![0u8; len + 2];
        r.read_exact(&mut value)?;
        if !value.ends_with(b"\r\n") {
            return Err(protocol_error("value not followed by CRLF"));
        }
        value.truncate(len);
        out[slot] = Some(Item { value, flags, cas });
    }
}

/// `VALUE <key> <flags> <bytes> <cas>`, parsed as bytes (this runs once per value).
fn parse_value_line(l: &[u8]) -> Option<(&[u8], u32, usize, u64)> {
    let rest = l.strip_prefix(b"VALUE ")?;
    let mut fields: [&[u8]; 4] = [&[]; 4];
    let (mut n, mut start) = (0, 0);
    for (i, &b) in rest.iter().enumerate() {
        if b == b' ' {
            *fields.get_mut(n)? = &rest[start..i];
            n += 1;
            start = i + 1;
        }
    }
    *fields.get_mut(n)? = &rest[start..];
    if n != 3 || fields[0].is_empty() {
        return None;
    }
    let flags = u32::try_from(decimal(fields[1])?).ok()?;
    let len = usize::try_from(decimal(fields[2])?).ok()?;
    Some((fields[0], flags, len, decimal(fields[3])?))
}

/// A non-empty run of ASCII digits as a `u64` (None on overflow or anything else).
fn decimal(digits: &[u8]) -> Option<u64> {
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
mod tests {
    use super::*;

    #[test]
    fn encoders() {
        let mut b = Vec::new();
        encode_gets(&mut b, &["a", "b"]);
        encode_store(&mut b, StoreMode::Cas(9), "k", b"xy", 0x4E43, 60);
        encode_store(&mut b, StoreMode::Add, "k", b"", 0, 0);
        encode_delete(&mut b, "k");
        encode_arith(&mut b, false, "c", 5);
        assert_eq!(
            String::from_utf8(b).unwrap(),
            "gets a b\r\ncas k 20035 60 2 9\r\nxy\r\nadd k 0 0 0\r\n\r\ndelete k\r\ndecr c 5\r\n"
        );
    }

    #[test]
    fn values_matched_by_name_in_any_order() {
        let mut r = &b"VALUE b 1 2 7\r\nhi\r\nVALUE a 0 0 8\r\n\r\nEND\r\n"[..];
        let mut out = vec![None; 3];
        read_values(&mut r, 100, &["a", "x", "b"], &mut out).unwrap();
        let hi = Item {
            value: b"hi".to_vec(),
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
        }
        let long = vec![b'x'; 5000];
        assert!(read_store(&mut &long[..]).is_err());
    }

    #[test]
    fn decimals() {
        assert_eq!(decimal(b"0"), Some(0));
        assert_eq!(decimal(b"18446744073709551615"), Some(u64::MAX));
        for bad in [&b""[..], b"18446744073709551616", b"1 ", b"-1", b"x"] {
            assert_eq!(decimal(bad), None, "{bad:?}");
        }
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
}
