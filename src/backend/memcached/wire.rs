//! memcached's text protocol: command encoders into a buffer and strict reply parsers over any
//! `BufRead`. No sockets here; every reply is bounded (line length, value size), and anything
//! unexpected is an error that tells the caller the connection is out of step.

use std::collections::HashMap;
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

/// `incr|decr key delta\r\n`
pub(crate) fn encode_arith(out: &mut Vec<u8>, incr: bool, key: &str, delta: u64) {
    out.extend_from_slice(if incr { b"incr " } else { b"decr " });
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(format!(" {delta}\r\n").as_bytes());
}

/// Reads one CRLF-terminated line (without the CRLF), at most [`MAX_LINE`] bytes.
fn read_line<'a, R: BufRead>(r: &mut R, buf: &'a mut Vec<u8>) -> Result<&'a str> {
    buf.clear();
    let n = std::io::Read::take(&mut *r, MAX_LINE as u64).read_until(b'\n', buf)?;
    if n == 0 {
        return Err(protocol_error(CLOSED));
    }
    if !buf.ends_with(b"\r\n") {
        return Err(protocol_error("reply line too long or not CRLF-terminated"));
    }
    buf.truncate(buf.len() - 2);
    std::str::from_utf8(buf).map_err(|_| protocol_error("reply line is not UTF-8"))
}

/// Turns the generic error replies into errors; returns other lines unchanged.
fn check_error(line: &str) -> Result<&str> {
    if line == "ERROR" {
        Err(Error::new(
            ErrorKind::Unsupported,
            "the server does not know this command (ERROR)",
        ))
    } else if let Some(msg) = line.strip_prefix("SERVER_ERROR ") {
        if msg.contains("too large") {
            Err(Error::new(ErrorKind::TooLarge, format!("server: {msg}")))
        } else {
            Err(Error::new(
                ErrorKind::Backend,
                format!("server error: {msg}"),
            ))
        }
    } else if let Some(msg) = line.strip_prefix("CLIENT_ERROR ") {
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

/// Reads a `gets` reply into `out`, keyed by the key each `VALUE` line names (a proxy may reorder
/// them); values above `max_value` are refused without allocating them.
pub(crate) fn read_values<R: BufRead>(
    r: &mut R,
    max_value: usize,
    out: &mut HashMap<String, Item>,
) -> Result<()> {
    let mut line = Vec::with_capacity(128);
    loop {
        let l = check_error(read_line(r, &mut line)?)?;
        if l == "END" {
            return Ok(());
        }
        let mut parts = l.split(' ');
        let (Some("VALUE"), Some(key), Some(flags), Some(len), Some(cas), None) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            return Err(protocol_error(format!("unexpected reply to gets: {l:?}")));
        };
        let bad = |what: &str| protocol_error(format!("bad {what} in VALUE line {l:?}"));
        let flags: u32 = flags.parse().map_err(|_| bad("flags"))?;
        let len: usize = len.parse().map_err(|_| bad("length"))?;
        let cas: u64 = cas.parse().map_err(|_| bad("cas"))?;
        if len > max_value {
            return Err(Error::new(
                ErrorKind::TooLarge,
                format!("the server sent a {len}-byte value; the item limit is {max_value}"),
            )
            .into_protocol());
        }
        let key = key.to_string();
        let mut value = vec![0u8; len + 2];
        r.read_exact(&mut value)?;
        if !value.ends_with(b"\r\n") {
            return Err(protocol_error("value not followed by CRLF"));
        }
        value.truncate(len);
        out.insert(key, Item { value, flags, cas });
    }
}

/// Reads the reply to `set`/`add`/`cas`.
pub(crate) fn read_store<R: BufRead>(r: &mut R) -> Result<StoreOutcome> {
    let mut line = Vec::with_capacity(32);
    match check_error(read_line(r, &mut line)?)? {
        "STORED" => Ok(StoreOutcome::Stored),
        "NOT_STORED" => Ok(StoreOutcome::NotStored),
        "EXISTS" => Ok(StoreOutcome::Exists),
        "NOT_FOUND" => Ok(StoreOutcome::NotFound),
        other => Err(protocol_error(format!(
            "unexpected reply to a store: {other:?}"
        ))),
    }
}

/// Reads the reply to `delete`: whether the key existed.
pub(crate) fn read_delete<R: BufRead>(r: &mut R) -> Result<bool> {
    let mut line = Vec::with_capacity(32);
    match check_error(read_line(r, &mut line)?)? {
        "DELETED" => Ok(true),
        "NOT_FOUND" => Ok(false),
        other => Err(protocol_error(format!(
            "unexpected reply to delete: {other:?}"
        ))),
    }
}

/// Reads the reply to `incr`/`decr`: the new value, or `None` when the key is missing.
pub(crate) fn read_arith<R: BufRead>(r: &mut R) -> Result<Option<u64>> {
    let mut line = Vec::with_capacity(32);
    match check_error(read_line(r, &mut line)?)? {
        "NOT_FOUND" => Ok(None),
        // memcached pads a shrunk counter with spaces in storage; trim in case a server echoes it.
        n => n
            .trim_end()
            .parse()
            .map(Some)
            .map_err(|_| protocol_error(format!("unexpected reply to incr/decr: {n:?}"))),
    }
}

/// Reads a bare `OK` (the reply to `flush_all`).
pub(crate) fn read_ok<R: BufRead>(r: &mut R) -> Result<()> {
    let mut line = Vec::with_capacity(32);
    match check_error(read_line(r, &mut line)?)? {
        "OK" => Ok(()),
        other => Err(protocol_error(format!("expected OK, got {other:?}"))),
    }
}

/// Reads `VERSION x.y.z`.
pub(crate) fn read_version<R: BufRead>(r: &mut R) -> Result<String> {
    let mut line = Vec::with_capacity(32);
    let l = check_error(read_line(r, &mut line)?)?;
    l.strip_prefix("VERSION ")
        .map(str::to_string)
        .ok_or_else(|| protocol_error(format!("expected VERSION, got {l:?}")))
}

impl Error {
    /// Marks an error as one after which the connection is out of step, whatever its kind.
    fn into_protocol(self) -> Error {
        Error::with_source(
            ErrorKind::Backend,
            "connection dropped after a bad reply",
            self,
        )
    }
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
    fn values_keyed_by_name_in_any_order() {
        let mut r = &b"VALUE b 1 2 7\r\nhi\r\nVALUE a 0 0 8\r\n\r\nEND\r\n"[..];
        let mut m = HashMap::new();
        read_values(&mut r, 100, &mut m).unwrap();
        assert_eq!(
            m["b"],
            Item {
                value: b"hi".to_vec(),
                flags: 1,
                cas: 7
            }
        );
        assert_eq!(m["a"].value, b"");
        assert!(r.is_empty());
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
            let mut m = HashMap::new();
            let mut r = *c;
            let e = read_values(&mut r, 100, &mut m).unwrap_err();
            assert!(!leaves_connection_usable(&e), "{c:?}: {e}");
        }
        let long = vec![b'x'; 5000];
        assert!(read_store(&mut &long[..]).is_err());
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
