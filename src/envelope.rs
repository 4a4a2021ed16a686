//! The envelope: newcache's versioned binary item format (documented in the crate docs, section
//! "Wire format"). Pure: bytes in, bytes out, no I/O and no clock.

use crate::error::{Error, Result};

/// memcached flags on every item newcache writes with an envelope ("NC").
pub(crate) const FLAGS: u32 = 0x4E43;
/// memcached flags on counters (plain decimal, as `incr` needs).
pub(crate) const COUNTER_FLAGS: u32 = 0;

const MAGIC: [u8; 2] = *b"NC";
const FORMAT_VERSION: u8 = 1;
const KIND_HERD: u8 = 1;
const KIND_PLAIN: u8 = 2;
/// Byte length of a herd envelope's header.
pub(crate) const HERD_HEADER_LEN: usize = 32;
/// Byte length of a plain (herd opted out) envelope's header.
pub(crate) const PLAIN_HEADER_LEN: usize = 4;

/// The decoded header of an item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Header {
    /// A herd-protected value.
    Herd {
        /// Unix ms after which the value is stale; 0 = never.
        soft_expiry_ms: u64,
        /// Unix ms at which the value was written by its producer (kept across claims).
        written_ms: u64,
        /// How long the producer's load took, in ms (XFetch's delta); 0 = unknown.
        load_ms: u32,
        /// 0, or until when (unix ms) a reader that claimed the entry is recomputing it.
        claimed_until_ms: u64,
    },
    /// A value written with the herd protection turned off: never stale, only hard-expires.
    Plain,
}

/// Starts an item buffer with a herd header (not claimed); the payload is appended by the caller.
pub(crate) fn herd_header(out: &mut Vec<u8>, soft_expiry_ms: u64, written_ms: u64, load_ms: u32) {
    out.extend_from_slice(&MAGIC);
    out.push(FORMAT_VERSION);
    out.push(KIND_HERD);
    out.extend_from_slice(&soft_expiry_ms.to_le_bytes());
    out.extend_from_slice(&written_ms.to_le_bytes());
    out.extend_from_slice(&load_ms.to_le_bytes());
    out.extend_from_slice(&0u64.to_le_bytes());
}

/// Starts an item buffer with a plain header.
pub(crate) fn plain_header(out: &mut Vec<u8>) {
    out.extend_from_slice(&MAGIC);
    out.push(FORMAT_VERSION);
    out.push(KIND_PLAIN);
}

/// Splits an item into its header and payload. Anything that is not a newcache item of a known
/// format version is a decode error that says what it saw.
pub(crate) fn decode(flags: u32, bytes: &[u8]) -> Result<(Header, &[u8])> {
    if flags != FLAGS {
        return Err(Error::decode(format!(
            "not a newcache item: memcached flags are {flags:#x} (another client wrote this key?)"
        )));
    }
    if bytes.len() < PLAIN_HEADER_LEN || bytes[..2] != MAGIC {
        return Err(Error::decode(format!(
            "not a newcache item: {} bytes without the envelope marker",
            bytes.len()
        )));
    }
    if bytes[2] != FORMAT_VERSION {
        return Err(Error::decode(format!(
            "unknown envelope format version {} (this newcache reads version {FORMAT_VERSION})",
            bytes[2]
        )));
    }
    match bytes[3] {
        KIND_PLAIN => Ok((Header::Plain, &bytes[PLAIN_HEADER_LEN..])),
        KIND_HERD => {
            if bytes.len() < HERD_HEADER_LEN {
                return Err(Error::decode("truncated envelope header"));
            }
            let u64_at = |i: usize| {
                let mut b = [0u8; 8];
                b.copy_from_slice(&bytes[i..i + 8]);
                u64::from_le_bytes(b)
            };
            let mut l = [0u8; 4];
            l.copy_from_slice(&bytes[20..24]);
            let header = Header::Herd {
                soft_expiry_ms: u64_at(4),
                written_ms: u64_at(12),
                load_ms: u32::from_le_bytes(l),
                claimed_until_ms: u64_at(24),
            };
            Ok((header, &bytes[HERD_HEADER_LEN..]))
        }
        k => Err(Error::decode(format!("unknown envelope kind {k}"))),
    }
}

/// A copy of a herd item marked as claimed until `claimed_until_ms`; the soft expiry and the
/// payload bytes are untouched (the claim path never decodes `T`). `None` for a plain item.
pub(crate) fn restamp(bytes: &[u8], claimed_until_ms: u64) -> Option<Vec<u8>> {
    if bytes.len() < HERD_HEADER_LEN || bytes[3] != KIND_HERD {
        return None;
    }
    let mut out = bytes.to_vec();
    out[24..32].copy_from_slice(&claimed_until_ms.to_le_bytes());
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn herd_round_trip_and_layout() {
        let mut b = Vec::new();
        herd_header(&mut b, 0x0102_0304_0506_0708, 77, 50);
        b.extend_from_slice(b"payload");
        assert_eq!(&b[..4], b"NC\x01\x01");
        assert_eq!(b[4], 0x08, "little-endian soft expiry");
        assert_eq!(b.len(), HERD_HEADER_LEN + 7);
        let (h, p) = decode(FLAGS, &b).unwrap();
        assert_eq!(
            h,
            Header::Herd {
                soft_expiry_ms: 0x0102_0304_0506_0708,
                written_ms: 77,
                load_ms: 50,
                claimed_until_ms: 0,
            }
        );
        assert_eq!(p, b"payload");
    }

    #[test]
    fn restamp_keeps_expiry_and_payload() {
        let mut b = Vec::new();
        herd_header(&mut b, 10, 5, 3);
        b.extend_from_slice(b"xyz");
        let c = restamp(&b, 99).unwrap();
        let (h, p) = decode(FLAGS, &c).unwrap();
        assert_eq!(
            h,
            Header::Herd {
                soft_expiry_ms: 10,
                written_ms: 5,
                load_ms: 3,
                claimed_until_ms: 99,
            }
        );
        assert_eq!(p, b"xyz");
        let mut plain = Vec::new();
        plain_header(&mut plain);
        assert!(restamp(&plain, 1).is_none());
    }

    #[test]
    fn plain_round_trip() {
        let mut b = Vec::new();
        plain_header(&mut b);
        b.push(7);
        assert_eq!(decode(FLAGS, &b).unwrap(), (Header::Plain, &[7u8][..]));
    }

    #[track_caller]
    fn rejects(flags: u32, bytes: &[u8]) {
        let e = decode(flags, bytes).unwrap_err();
        assert!(e.is_decode(), "{e}");
    }

    #[test]
    fn foreign_and_corrupt_bytes_are_decode_errors() {
        rejects(FLAGS, b"");
        rejects(FLAGS, b"NC");
        rejects(FLAGS, b"\x80\x04\x95\x00"); // a pickle
        rejects(FLAGS, b"a:1:{s:1:\"x\";i:1;}"); // PHP serialize
        rejects(1, b"NC\x01\x02"); // right bytes, foreign flags (python-memcached's pickle flag)
        rejects(FLAGS, b"NC\x02\x01"); // future format version
        rejects(FLAGS, b"NC\x01\x09"); // unknown kind
        rejects(FLAGS, b"NC\x01\x01\x00\x00"); // truncated herd header
        rejects(
            FLAGS,
            &[
                b'N', b'C', 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
            ],
        );
    }
}
