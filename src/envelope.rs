//! The envelope: newcache's versioned binary item format (layout in the crate docs, "Wire
//! format"). Pure: bytes in, bytes out, no I/O and no clock.

use crate::codec::{Codec, Payload};
use crate::error::{Error, Result};

/// memcached flags on every item newcache writes with an envelope ("NC").
pub(crate) const FLAGS: u32 = 0x4E43;
/// memcached flags on counters (plain decimal, as `incr` needs).
pub(crate) const COUNTER_FLAGS: u32 = 0;

const MAGIC: [u8; 2] = *b"NC";
/// The format this build writes. Readers accept it, and treat any newer one as a miss.
pub(crate) const FORMAT_VERSION: u8 = 2;
/// Byte length of the fixed part of the header: magic, version, kind, codec, flags, header
/// length, and the byte saying which fields follow.
const FIXED_LEN: usize = 8;
/// The longest header this build writes (every field present).
const MAX_HEADER_LEN: usize = FIXED_LEN + 6 + 6 + 4 + 4 + 6 + 8 + 6;
/// The largest timestamp a 6-byte field holds (unix ms in the year 10889): later ones saturate.
const U48_MAX: u64 = (1 << 48) - 1;

/// Which fields follow the fixed part (byte 7), in this order. A field not present is 0.
mod field {
    pub(super) const SOFT_EXPIRY: u8 = 1 << 0;
    pub(super) const WRITTEN: u8 = 1 << 1;
    pub(super) const LOAD: u8 = 1 << 2;
    pub(super) const HERD: u8 = 1 << 3;
    /// The claim deadline (6 bytes) and its token (8 bytes).
    pub(super) const CLAIM: u8 = 1 << 4;
    pub(super) const EXPIRES: u8 = 1 << 5;
    /// Every bit this build knows; any other was set by a newer build.
    pub(super) const KNOWN: u8 = (1 << 6) - 1;
}

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
    /// Whether the payload is a type's own bytes, not a codec's (flags bit 1): the response
    /// cache's pages.
    pub(crate) raw: bool,
    /// A "not storable" marker (flags bit 2, on a placeholder with no claim): the last load's
    /// value was too large to store, so every caller loads the key itself, unclaimed and
    /// without waiting, until `expires_ms`. A build that does not know the bit reads the
    /// item as a newer build's (a miss, loaded unclaimed, never overwritten by a load): the
    /// same. A new kind byte would have been corrupt ("unknown envelope kind") to it.
    pub(crate) not_storable: bool,
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
    /// How the payload under this header is encoded.
    pub(crate) fn payload(&self) -> Payload {
        match (self.raw, self.compressed) {
            (true, _) => Payload::Raw,
            (false, true) => Payload::Compressed,
            (false, false) => Payload::Coded,
        }
    }

    /// A fresh value's header (`expires_ms` 0: set it for a value that hard-expires).
    pub(crate) fn value(soft_expiry_ms: u64, written_ms: u64, load_ms: u32, herd_ms: u32) -> Self {
        Header {
            expires_ms: 0,
            kind: Kind::Value,
            codec: Codec::Bincode,
            compressed: false,
            raw: false,
            not_storable: false,
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

    /// A "not storable" marker written at `now_ms`, live until `until_ms`: no claim, no value.
    pub(crate) fn not_storable(now_ms: u64, until_ms: u64) -> Self {
        Header {
            kind: Kind::Placeholder,
            not_storable: true,
            expires_ms: until_ms,
            ..Header::value(0, now_ms, 0, 0)
        }
    }

    /// Appends the header's bytes to `out` (the payload follows). Only non-zero fields are
    /// written; timestamps take 6 bytes and saturate in the year 10889.
    pub(crate) fn write(&self, out: &mut Vec<u8>) {
        let mut buf = [0u8; MAX_HEADER_LEN];
        buf[..2].copy_from_slice(&MAGIC);
        buf[2] = FORMAT_VERSION;
        buf[3] = self.kind.byte();
        buf[4] = self.codec.id();
        buf[5] = u8::from(self.compressed)
            | (u8::from(self.raw) << 1)
            | (u8::from(self.not_storable) << 2);
        let mut at = FIXED_LEN;
        let mut fields = 0;
        let mut put = |bit: u8, bytes: &[u8]| {
            fields |= bit;
            buf[at..at + bytes.len()].copy_from_slice(bytes);
            at += bytes.len();
        };
        let u48 = |v: u64| {
            let b = v.min(U48_MAX).to_le_bytes();
            [b[0], b[1], b[2], b[3], b[4], b[5]]
        };
        if self.soft_expiry_ms != 0 {
            put(field::SOFT_EXPIRY, &u48(self.soft_expiry_ms));
        }
        if self.written_ms != 0 {
            put(field::WRITTEN, &u48(self.written_ms));
        }
        if self.load_ms != 0 {
            put(field::LOAD, &self.load_ms.to_le_bytes());
        }
        if self.herd_ms != 0 {
            put(field::HERD, &self.herd_ms.to_le_bytes());
        }
        if self.claim_until_ms != 0 || self.token != 0 {
            let mut claim = [0u8; 14];
            claim[..6].copy_from_slice(&u48(self.claim_until_ms));
            claim[6..].copy_from_slice(&self.token.to_le_bytes());
            put(field::CLAIM, &claim);
        }
        if self.expires_ms != 0 {
            put(field::EXPIRES, &u48(self.expires_ms));
        }
        buf[6] = at as u8; // at most MAX_HEADER_LEN (48)
        buf[7] = fields;
        out.extend_from_slice(&buf[..at]);
    }

    /// The header's bytes alone (a placeholder's whole item).
    pub(crate) fn to_bytes(self) -> Vec<u8> {
        let mut out = Vec::with_capacity(MAX_HEADER_LEN);
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

/// Whether `bytes` (stored with `flags`) are a claim of the herd protocol: a placeholder, or a
/// value re-stored under a claim token. A claim changes no value a reader is served, so the
/// bus does not announce it.
pub(crate) fn is_claim(flags: u32, bytes: &[u8]) -> bool {
    matches!(decode(flags, bytes), Ok(Parsed::Item(h, _)) if h.token != 0 || h.kind == Kind::Placeholder)
}

/// Splits an item into its header and payload.
///
/// Anything that is not a newcache item (other flags, no marker, a truncated or inconsistent
/// header, the 0.1.0 format) is a decode error that says what it saw. A newer format is not an
/// error: readers count it as a miss, so a rolling deploy never turns reads into errors.
pub(crate) fn decode(flags: u32, bytes: &[u8]) -> Result<Parsed<'_>> {
    if flags == COUNTER_FLAGS && crate::backend::parse_counter(bytes).is_some() {
        return Err(Error::decode(
            "a counter, not a value: memcached flags 0 and decimal digits (read it with \
             get_counter, change it with incr or incr_or_create)",
        ));
    }
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
    if bytes.len() < FIXED_LEN {
        return Err(Error::decode("truncated envelope header"));
    }
    let kind = match bytes[3] {
        1 => Kind::Value,
        2 => Kind::Plain,
        3 => Kind::Placeholder,
        k => return Err(Error::decode(format!("unknown envelope kind {k}"))),
    };
    // A codec, a flag or a field this build does not know was written by a newer build: a
    // miss, as a newer format is (never an error, never overwritten).
    let Some(codec) = Codec::from_id(bytes[4]) else {
        return Ok(Parsed::Newer(version));
    };
    let fields = bytes[7];
    if bytes[5] & !7 != 0 || fields & !field::KNOWN != 0 {
        return Ok(Parsed::Newer(version));
    }
    let header_len = usize::from(bytes[6]);
    let known_len = fields_len(fields);
    if header_len < known_len || header_len > bytes.len() {
        return Err(Error::decode(format!(
            "envelope header length {header_len} does not fit its fields or a {}-byte item",
            bytes.len()
        )));
    }
    // Every read below is within known_len <= header_len <= bytes.len(). Fixed-size reads
    // (a const length each) so that the compiler inlines them: this runs once per key read.
    let mut at = FIXED_LEN;
    let soft_expiry_ms = le::<6>(bytes, &mut at, fields & field::SOFT_EXPIRY != 0);
    let written_ms = le::<6>(bytes, &mut at, fields & field::WRITTEN != 0);
    let load_ms = le::<4>(bytes, &mut at, fields & field::LOAD != 0) as u32;
    let herd_ms = le::<4>(bytes, &mut at, fields & field::HERD != 0) as u32;
    let claimed = fields & field::CLAIM != 0;
    let claim_until_ms = le::<6>(bytes, &mut at, claimed);
    let token = le::<8>(bytes, &mut at, claimed);
    let expires_ms = le::<6>(bytes, &mut at, fields & field::EXPIRES != 0);
    let header = Header {
        kind,
        codec,
        compressed: bytes[5] & 1 != 0,
        raw: bytes[5] & 2 != 0,
        not_storable: bytes[5] & 4 != 0,
        soft_expiry_ms,
        written_ms,
        load_ms,
        herd_ms,
        claim_until_ms,
        token,
        expires_ms,
    };
    Ok(Parsed::Item(header, &bytes[header_len..]))
}

/// The length of a header with `fields` (byte 7) and nothing appended.
fn fields_len(fields: u8) -> usize {
    let has = |bit: u8| usize::from(fields & bit != 0);
    FIXED_LEN
        + 6 * has(field::SOFT_EXPIRY)
        + 6 * has(field::WRITTEN)
        + 4 * has(field::LOAD)
        + 4 * has(field::HERD)
        + 14 * has(field::CLAIM)
        + 6 * has(field::EXPIRES)
}

/// The `N`-byte little-endian field at `*at` if `present` (moving `*at` past it), else 0. The
/// caller has checked that the header's fields lie within `bytes`.
fn le<const N: usize>(bytes: &[u8], at: &mut usize, present: bool) -> u64 {
    if !present {
        return 0;
    }
    let mut word = [0u8; 8];
    word[..N].copy_from_slice(&bytes[*at..*at + N]);
    *at += N;
    u64::from_le_bytes(word)
}

/// How many bytes the header of `item` (as this build wrote it) may still grow by in later
/// steps of the protocol: a claim adds its deadline and token, a `touch` of a value that never
/// expired adds a soft and a hard expiry. A write leaves this much room under the item limit,
/// so that whatever `set` stores can still be claimed, renewed, touched and released.
pub(crate) fn growth(item: &[u8]) -> usize {
    item.get(6).map_or(MAX_HEADER_LEN, |&len| {
        MAX_HEADER_LEN.saturating_sub(usize::from(len))
    })
}

/// A copy of a value's item with a new soft expiry and hard expiry (`touch`); the claim, the
/// payload and everything else untouched. `None` if `bytes` is not an item of this format.
pub(crate) fn retime(bytes: &[u8], soft_expiry_ms: u64, expires_ms: u64) -> Option<Vec<u8>> {
    rewrite(bytes, |h| {
        h.soft_expiry_ms = soft_expiry_ms;
        h.expires_ms = expires_ms;
    })
}

/// A copy of a value's item judged stale from `before_ms` on, if it was written before then
/// (an unknown write time counts as before): its soft expiry moved back to `before_ms` (a plain
/// value becomes a value stale from then, with no herd window). `None` when the item is left as
/// it is: written at or after `before_ms`, already stale by then, a placeholder, or not an item
/// of this format.
pub(crate) fn stale_from(bytes: &[u8], before_ms: u64) -> Option<Vec<u8>> {
    let Ok(Parsed::Item(h, _)) = decode(FLAGS, bytes) else {
        return None;
    };
    let already = h.kind == Kind::Value && h.soft_expiry_ms != 0 && h.soft_expiry_ms <= before_ms;
    if h.written_ms >= before_ms || h.kind == Kind::Placeholder || already {
        return None;
    }
    rewrite(bytes, |h| {
        if h.kind == Kind::Plain {
            h.kind = Kind::Value;
            h.herd_ms = 0;
        }
        h.soft_expiry_ms = before_ms;
    })
}

/// Marks an item's payload as compressed (flags bit 0), after the payload was written.
pub(crate) fn mark_compressed(item: &mut [u8]) {
    item[5] |= 1;
}

/// Marks an item's payload as raw (flags bit 1): a type's own bytes, not a codec's.
pub(crate) fn mark_raw(item: &mut [u8]) {
    item[5] |= 2;
}

/// A copy of an item of this build's format with its header changed by `f`: the header is
/// written anew (its length may change); bytes a newer build appended to the header, and the
/// payload, are copied untouched. `None` if `bytes` is not such an item.
fn rewrite(bytes: &[u8], f: impl FnOnce(&mut Header)) -> Option<Vec<u8>> {
    if bytes.get(2) != Some(&FORMAT_VERSION) {
        return None;
    }
    let Ok(Parsed::Item(mut h, payload)) = decode(FLAGS, bytes) else {
        return None;
    };
    let appended = &bytes[fields_len(bytes[7])..bytes.len() - payload.len()];
    f(&mut h);
    let mut out = Vec::with_capacity(bytes.len() + 14);
    h.write(&mut out);
    let header_len = u8::try_from(out.len() + appended.len()).ok()?;
    out[6] = header_len;
    out.extend_from_slice(appended);
    out.extend_from_slice(payload);
    Some(out)
}

/// A copy of an item with a new claim (`claim_until_ms`, `token`); everything else, the payload
/// included, is untouched (a claim never decodes the value). `None` if `bytes` is not an item of
/// this format.
pub(crate) fn restamp(bytes: &[u8], claim_until_ms: u64, token: u64) -> Option<Vec<u8>> {
    rewrite(bytes, |h| {
        h.claim_until_ms = claim_until_ms;
        h.token = token;
    })
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
        let h = Header::value(0x0102_0304_0506, 77, 50, 60_000);
        let b = item(h, b"payload");
        // Soft expiry, written, load and herd present (0x0f): 8 + 6 + 6 + 4 + 4 bytes.
        assert_eq!(&b[..8], b"NC\x02\x01\x00\x00\x1c\x0f");
        assert_eq!(
            &b[8..14],
            b"\x06\x05\x04\x03\x02\x01",
            "6-byte little-endian"
        );
        assert_eq!(b.len(), 28 + 7);
        assert_eq!(decode(FLAGS, &b).unwrap(), Parsed::Item(h, &b"payload"[..]));
        // Every field present, the longest header.
        let full = Header {
            claim_until_ms: 9,
            token: u64::MAX,
            expires_ms: 11,
            ..h
        };
        let b = item(full, b"p");
        assert_eq!(b.len(), MAX_HEADER_LEN + 1);
        assert_eq!(decode(FLAGS, &b).unwrap(), Parsed::Item(full, &b"p"[..]));
        // Zero fields take no bytes: a placeholder is small.
        assert_eq!(Header::placeholder(5, 10, 42).to_bytes().len(), 8 + 6 + 14);
    }

    #[test]
    fn the_raw_flag_round_trips_and_survives_a_claim() {
        let h = Header {
            raw: true,
            ..Header::value(10, 5, 3, 1000)
        };
        let b = item(h, b"page");
        assert_eq!(b[5], 2, "flags bit 1");
        assert_eq!(decode(FLAGS, &b).unwrap(), Parsed::Item(h, &b"page"[..]));
        let mut marked = item(Header::value(10, 5, 3, 1000), b"page");
        mark_raw(&mut marked);
        assert_eq!(marked, b);
        let c = restamp(&b, 99, 7).unwrap();
        let Parsed::Item(claimed, rest) = decode(FLAGS, &c).unwrap() else {
            panic!("a claimed item decodes")
        };
        assert!(claimed.raw && !claimed.compressed);
        assert_eq!(rest, b"page");
    }

    #[test]
    fn growth_is_what_later_steps_can_add() {
        let mut h = Header::value(2_000, 1_000, 0, 60_000);
        h.expires_ms = 0;
        let set = item(h, b"payload");
        // a claim, then a touch of a value that never expired
        let claimed = restamp(&set, 5_000, 9).unwrap();
        let touched = retime(&claimed, 3_000, 4_000).unwrap();
        let with_load = item(
            Header {
                load_ms: 5,
                ..Header::value(2_000, 1_000, 0, 60_000)
            },
            b"payload",
        );
        let full = restamp(&retime(&with_load, 3_000, 4_000).unwrap(), 5_000, 9).unwrap();
        assert_eq!(growth(&full), 0);
        assert!(touched.len() - set.len() <= growth(&set));
        assert_eq!(set.len() + growth(&set), full.len());
        assert_eq!(growth(b""), MAX_HEADER_LEN);
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
    fn a_not_storable_marker_round_trips_and_is_newer_to_a_build_without_the_bit() {
        let b = Header::not_storable(1_000, 61_000).to_bytes();
        assert_eq!(b[5], 4, "flags bit 2");
        let Parsed::Item(h, rest) = decode(FLAGS, &b).unwrap() else {
            panic!()
        };
        assert!(h.not_storable && rest.is_empty());
        assert_eq!(
            (h.kind, h.claim_until_ms, h.token, h.expires_ms),
            (Kind::Placeholder, 0, 0, 61_000)
        );
        // What a build that knows flag bits 0 and 1 only does with it (its check, verbatim).
        assert!(b[5] & !3 != 0, "read as a newer build's item: a miss");
    }

    #[test]
    fn a_longer_header_is_skipped() {
        let h = Header::value(1, 2, 3, 4);
        let mut b = item(h, b"");
        b[6] += 8; // 8 bytes of fields this build does not know, appended by a newer build
        b.extend_from_slice(&[0xAA; 8]);
        b.extend_from_slice(b"pl");
        let Parsed::Item(_, payload) = decode(FLAGS, &b).unwrap() else {
            panic!()
        };
        assert_eq!(payload, b"pl");
        // A claim rewrites the header (it grows by the claim) and keeps the appended bytes.
        let c = restamp(&b, 99, 7).unwrap();
        assert_eq!(c.len(), b.len() + 14);
        assert_eq!(&c[c.len() - 10..], b"\xAA\xAA\xAA\xAA\xAA\xAA\xAA\xAApl");
        let want = Header {
            claim_until_ms: 99,
            token: 7,
            ..h
        };
        assert_eq!(decode(FLAGS, &c).unwrap(), Parsed::Item(want, &b"pl"[..]));
        let back = restamp(&c, 0, 0).unwrap();
        assert_eq!(back, b, "clearing the claim gives the original bytes back");
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
        let counter = decode(COUNTER_FLAGS, b"42 ").unwrap_err();
        assert!(counter.to_string().contains("get_counter"), "{counter}");
        let other = decode(COUNTER_FLAGS, b"text").unwrap_err();
        assert!(other.to_string().contains("another client"), "{other}");
        rejects(FLAGS, b"NC\x01\x01\x00\x00"); // the 0.1.0 format
        rejects(FLAGS, &good[..good.len() - 2]); // truncated
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
        newer[5] = 0x08; // the first flag bit after compressed (0), raw (1), not storable (2)
        assert_eq!(
            decode(FLAGS, &newer).unwrap(),
            Parsed::Newer(FORMAT_VERSION)
        );
        let mut newer = good.clone();
        newer[5] = 0x80;
        assert_eq!(
            decode(FLAGS, &newer).unwrap(),
            Parsed::Newer(FORMAT_VERSION)
        );
        let mut newer = good.clone();
        newer[7] |= 0x40; // a field this build does not know
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

    #[test]
    fn values_written_before_a_lost_invalidation_are_judged_stale() {
        use crate::herd::{Verdict, judge};
        let before = 1_000_000;
        let stale = |h: Header| {
            let b = stale_from(&item(h, b"p"), before)?;
            let Parsed::Item(h, payload) = decode(FLAGS, &b).unwrap() else {
                panic!("newer")
            };
            assert_eq!(payload, b"p");
            Some(h)
        };
        // a fresh value that never expires, written before: stale from `before` on
        let h = stale(Header::value(0, before - 1, 0, 60_000)).unwrap();
        assert_eq!(h.soft_expiry_ms, before);
        assert_eq!(h.written_ms, before - 1, "its write time is kept");
        assert_eq!(judge(&h, before + 10, None), Verdict::Stale);
        // one fresh until later: the same
        let h = stale(Header::value(before + 5_000, before - 1, 0, 60_000)).unwrap();
        assert_eq!(judge(&h, before + 10, None), Verdict::Stale);
        // a plain value: not servable at all
        let h = stale(Header::plain(before - 1)).unwrap();
        assert_eq!(judge(&h, before + 10, None), Verdict::Expired);
        // written at or after, already stale, a placeholder: left alone
        assert!(stale(Header::value(0, before, 0, 60_000)).is_none());
        assert!(stale(Header::value(before - 5, 1, 0, 60_000)).is_none());
        assert!(stale(Header::placeholder(1, before * 2, 7)).is_none());
        assert!(stale_from(b"foreign", before).is_none());
    }
}
