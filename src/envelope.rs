//! The envelope: newcache's versioned binary item format (layout in the crate docs, "Wire
//! format"). Pure: bytes in, bytes out, no I/O and no clock.

use crate::codec::Codec;
use crate::error::{Error, Result};

/// memcached flags on every item newcache writes with an envelope ("NC").
pub(crate) const FLAGS: u32 = 0x4E43;
/// memcached flags on counters (plain decimal, as `incr` needs).
pub(crate) const COUNTER_FLAGS: u32 = 0;

const MAGIC: [u8; 2] = *b"NC";
/// The format this build writes. Readers accept it, and treat any newer one as a miss.
pub(crate) const FORMAT_VERSION: u8 = 2;
/// Byte length of the header this build writes. Readers of format 2 honour a longer
/// `header_len`, so fields can be appended without a version bump.
pub(crate) const HEADER_LEN: usize = 56;

/// What an item is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A herd-protected value: fresh until the soft expiry, then stale (served while one caller
    /// recomputes) until the soft expiry plus the writer's herd timeout.
    Value,
    /// A value written with the herd protection off: never stale, it only hard-expires.
    Plain,
    /// No value: the key is being loaded by the holder of `token` until `claim_until_ms`.
    Placeholder,
}

impl Kind {
    fn byte(self) -> u8 {
        match self {
            Kind::Value => 1,
            Kind::Plain => 2,
            Kind::Placeholder => 3,
        }
    }
}

/// The decoded header of an item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) kind: Kind,
    /// Which codec wrote the payload.
    pub(crate) codec: Codec,
    /// Whether the payload is LZ4-compressed (flags bit 0).
    pub(crate) compressed: bool,
    /// Unix ms after which the value is stale; 0 = never.
    pub(crate) soft_expiry_ms: u64,
    /// Unix ms at which the value was computed (kept across claims).
    pub(crate) written_ms: u64,
    /// How long computing it took, in ms (XFetch's delta); 0 = unknown.
    pub(crate) load_ms: u32,
    /// The writer's herd timeout in ms: nobody serves the value at or after
    /// `soft_expiry_ms + herd_ms`.
    pub(crate) herd_ms: u32,
    /// 0, or until when (unix ms) the holder of `token` is loading this key.
    pub(crate) claim_until_ms: u64,
    /// The claim's (or placeholder's) token; 0 when unclaimed.
    pub(crate) token: u64,
    /// Unix ms at which the writer meant memcached to drop the item; 0 = never. A claim
    /// re-stores the item, and keeps it at least this long: a claim never shortens an item's life.
    pub(crate) expires_ms: u64,
}

impl Header {
    /// A fresh value's header (`expires_ms` 0: set it for a value that hard-expires).
    pub(crate) fn value(soft_expiry_ms: u64, written_ms: u64, load_ms: u32, herd_ms: u32) -> Self {
        Header {
            expires_ms: 0,
            kind: Kind::Value,
            codec: Codec::Bincode,
            compressed: false,
            soft_expiry_ms,
            written_ms,
            load_ms,
            herd_ms,
            claim_until_ms: 0,
            token: 0,
        }
    }

    /// A plain (herd off) value's header.
    pub(crate) fn plain(written_ms: u64) -> Self {
        Header {
            kind: Kind::Plain,
            herd_ms: 0,
            ..Header::value(0, written_ms, 0, 0)
        }
    }

    /// A placeholder: "being loaded by `token` until `claim_until_ms`".
    pub(crate) fn placeholder(now_ms: u64, claim_until_ms: u64, token: u64) -> Self {
        Header {
            kind: Kind::Placeholder,
            claim_until_ms,
            token,
            ..Header::value(0, now_ms, 0, 0)
        }
    }

    /// Appends the header's bytes to `out` (the payload follows).
    pub(crate) fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&MAGIC);
        out.push(FORMAT_VERSION);
        out.push(self.kind.byte());
        out.push(self.codec.id());
        out.push(u8::from(self.compressed));
        out.extend_from_slice(&(HEADER_LEN as u16).to_le_bytes());
        out.extend_from_slice(&self.soft_expiry_ms.to_le_bytes());
        out.extend_from_slice(&self.written_ms.to_le_bytes());
        out.extend_from_slice(&self.load_ms.to_le_bytes());
        out.extend_from_slice(&self.herd_ms.to_le_bytes());
        out.extend_from_slice(&self.claim_until_ms.to_le_bytes());
        out.extend_from_slice(&self.token.to_le_bytes());
        out.extend_from_slice(&self.expires_ms.to_le_bytes());
    }

    /// The header's bytes alone (a placeholder's whole item).
    pub(crate) fn to_bytes(self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN);
        self.write(&mut out);
        out
    }
}

/// What a reader found under a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Parsed<'a> {
    /// A newcache item of the format this build reads.
    Item(Header, &'a [u8]),
    /// A newcache item of a newer format (written by a newer build): a counted miss.
    Newer(u8),
}

/// Splits an item into its header and payload.
///
/// Anything that is not a newcache item (other flags, no marker, a truncated or inconsistent
/// header, the 0.1.0 format) is a decode error that says what it saw. A newer format is not an
/// error: readers count it as a miss, so a rolling deploy never turns reads into errors.
pub(crate) fn decode(flags: u32, bytes: &[u8]) -> Result<Parsed<'_>> {
    if flags != FLAGS {
        return Err(Error::decode(format!(
            "not a newcache item: memcached flags are {flags:#x} (another client wrote this key?)"
        )));
    }
    if bytes.len() < 3 || bytes[..2] != MAGIC {
        return Err(Error::decode(format!(
            "not a newcache item: {} bytes without the envelope marker",
            bytes.len()
        )));
    }
    let version = bytes[2];
    if version > FORMAT_VERSION {
        return Ok(Parsed::Newer(version));
    }
    if version < FORMAT_VERSION {
        return Err(Error::decode(format!(
            "envelope format {version} is older than this newcache reads ({FORMAT_VERSION})"
        )));
    }
    if bytes.len() < HEADER_LEN {
        return Err(Error::decode("truncated envelope header"));
    }
    let u64_at = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().unwrap_or_default());
    let u32_at = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().unwrap_or_default());
    let header_len = usize::from(u16::from_le_bytes([bytes[6], bytes[7]]));
    if header_len < HEADER_LEN || header_len > bytes.len() {
        return Err(Error::decode(format!(
            "envelope header length {header_len} does not fit a {}-byte item",
            bytes.len()
        )));
    }
    let kind = match bytes[3] {
        1 => Kind::Value,
        2 => Kind::Plain,
        3 => Kind::Placeholder,
        k => return Err(Error::decode(format!("unknown envelope kind {k}"))),
    };
    // A codec or a flag this build does not know was written by a newer build: a miss, as a
    // newer format is (never an error, never overwritten).
    let Some(codec) = Codec::from_id(bytes[4]) else {
        return Ok(Parsed::Newer(version));
    };
    if bytes[5] & !1 != 0 {
        return Ok(Parsed::Newer(version));
    }
    let header = Header {
        kind,
        codec,
        compressed: bytes[5] & 1 != 0,
        soft_expiry_ms: u64_at(8),
        written_ms: u64_at(16),
        load_ms: u32_at(24),
        herd_ms: u32_at(28),
        claim_until_ms: u64_at(32),
        token: u64_at(40),
        expires_ms: u64_at(48),
    };
    Ok(Parsed::Item(header, &bytes[header_len..]))
}

/// A copy of a value's item with a new soft expiry and hard expiry (`touch`); the claim, the
/// payload and everything else untouched. `None` if `bytes` is not an item of this format.
pub(crate) fn retime(bytes: &[u8], soft_expiry_ms: u64, expires_ms: u64) -> Option<Vec<u8>> {
    let mut out = copy_of_current(bytes)?;
    out[8..16].copy_from_slice(&soft_expiry_ms.to_le_bytes());
    out[48..56].copy_from_slice(&expires_ms.to_le_bytes());
    Some(out)
}

/// Marks an item's payload as compressed (flags bit 0), after the payload was written.
pub(crate) fn mark_compressed(item: &mut [u8]) {
    item[5] |= 1;
}

/// A copy of `bytes` if they are an item of this build's format (header fields can be patched).
fn copy_of_current(bytes: &[u8]) -> Option<Vec<u8>> {
    (bytes.len() >= HEADER_LEN && bytes[..2] == MAGIC && bytes[2] == FORMAT_VERSION)
        .then(|| bytes.to_vec())
}

/// A copy of an item with a new claim (`claim_until_ms`, `token`); everything else, the payload
/// included, is untouched (a claim never decodes the value). `None` if `bytes` is not an item of
/// this format.
pub(crate) fn restamp(bytes: &[u8], claim_until_ms: u64, token: u64) -> Option<Vec<u8>> {
    let mut out = copy_of_current(bytes)?;
    out[32..40].copy_from_slice(&claim_until_ms.to_le_bytes());
    out[40..48].copy_from_slice(&token.to_le_bytes());
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(h: Header, payload: &[u8]) -> Vec<u8> {
        let mut b = Vec::new();
        h.write(&mut b);
        b.extend_from_slice(payload);
        b
    }

    #[test]
    fn layout_and_round_trip() {
        let h = Header::value(0x0102_0304_0506_0708, 77, 50, 60_000);
        let b = item(h, b"payload");
        assert_eq!(&b[..8], b"NC\x02\x01\x00\x00\x38\x00");
        assert_eq!(b[8], 0x08, "little-endian soft expiry");
        assert_eq!(b.len(), HEADER_LEN + 7);
        assert_eq!(decode(FLAGS, &b).unwrap(), Parsed::Item(h, &b"payload"[..]));
    }

    #[test]
    fn restamp_changes_only_the_claim() {
        let h = Header::value(10, 5, 3, 1000);
        let b = item(h, b"xyz");
        let c = restamp(&b, 99, 7).unwrap();
        let want = Header {
            claim_until_ms: 99,
            token: 7,
            ..h
        };
        assert_eq!(decode(FLAGS, &c).unwrap(), Parsed::Item(want, &b"xyz"[..]));
        assert!(restamp(b"NC\x01\x01", 1, 1).is_none());
    }

    #[test]
    fn placeholder_and_plain() {
        let p = Header::placeholder(5, 10, 42).to_bytes();
        let Parsed::Item(h, rest) = decode(FLAGS, &p).unwrap() else {
            panic!()
        };
        assert_eq!(
            (h.kind, h.claim_until_ms, h.token),
            (Kind::Placeholder, 10, 42)
        );
        assert!(rest.is_empty());
        let Parsed::Item(h, _) = decode(FLAGS, &item(Header::plain(1), b"v")).unwrap() else {
            panic!()
        };
        assert_eq!((h.kind, h.soft_expiry_ms, h.herd_ms), (Kind::Plain, 0, 0));
    }

    #[test]
    fn a_longer_header_is_skipped() {
        let mut b = item(Header::value(1, 2, 3, 4), b"");
        b[6] = 64; // header_len 64: 8 bytes of fields this build does not know
        b.extend_from_slice(&[0xAA; 8]);
        b.extend_from_slice(b"pl");
        let Parsed::Item(_, payload) = decode(FLAGS, &b).unwrap() else {
            panic!()
        };
        assert_eq!(payload, b"pl");
    }

    #[test]
    fn a_newer_format_is_not_an_error() {
        assert_eq!(decode(FLAGS, b"NC\x03anything").unwrap(), Parsed::Newer(3));
        assert_eq!(decode(FLAGS, b"NC\xff").unwrap(), Parsed::Newer(255));
    }

    #[track_caller]
    fn rejects(flags: u32, bytes: &[u8]) {
        let e = decode(flags, bytes).unwrap_err();
        assert!(e.is_decode(), "{e}");
    }

    #[test]
    fn foreign_and_corrupt_bytes_are_decode_errors() {
        let good = item(Header::value(1, 1, 1, 1), b"v");
        rejects(FLAGS, b"");
        rejects(FLAGS, b"NC");
        rejects(FLAGS, b"\x80\x04\x95\x00"); // a pickle
        rejects(FLAGS, b"a:1:{s:1:\"x\";i:1;}"); // PHP serialize
        rejects(1, &good); // right bytes, foreign flags
        rejects(FLAGS, b"NC\x01\x01\x00\x00"); // the 0.1.0 format
        rejects(FLAGS, &good[..HEADER_LEN - 1]); // truncated
        let mut bad = good.clone();
        bad[3] = 9; // unknown kind
        rejects(FLAGS, &bad);
        let mut bad = good.clone();
        bad[6] = 200; // header longer than the item
        rejects(FLAGS, &bad);
        let mut bad = good.clone();
        bad[6] = 8; // header shorter than format 2's
        rejects(FLAGS, &bad);
        // A codec or flag bit this build does not know: written by a newer build, a miss.
        let mut newer = good.clone();
        newer[5] = 0x80;
        assert_eq!(
            decode(FLAGS, &newer).unwrap(),
            Parsed::Newer(FORMAT_VERSION)
        );
        let mut newer = good;
        newer[4] = 7;
        assert_eq!(
            decode(FLAGS, &newer).unwrap(),
            Parsed::Newer(FORMAT_VERSION)
        );
    }
}
