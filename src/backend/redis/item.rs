//! How an item is stored in a Redis string, and what stands for memcached's CAS token and
//! `exptime` there. Pure functions: no I/O.
//!
//! ```text
//!  byte 0      1 .. 9                  9 .. 13          13 ..
//!  [0xA1 tag] [stamp: u64 big-endian] [flags: u32 BE]  [value bytes]
//! ```
//!
//! Redis has no CAS token, so every write newcache makes carries a fresh random **stamp**: the
//! item's token is its stamp, read back for free with the value, and a fenced write (a `cas`)
//! compares the stored stamp in a one-key Lua script (`script.rs`) before it writes. Chosen over
//! a digest of the value: a digest must be computed over every value read, on the client, and
//! over the stored value on the server at every fenced write (up to a megabyte hashed per claim),
//! and two writes of the same bytes would share a token; a stamp costs 8 bytes and one
//! comparison, and is new with every write, as memcached's CAS is.
//!
//! A value another client wrote (no tag, or shorter than the header) is **foreign**: it reads as
//! an item with flags 0, whole, so the cache's decode policy sees bytes it cannot read; its token
//! is a digest of its bytes (the top bit set, which no stamp has), so a fenced write replaces
//! exactly that value and nothing another client wrote after it.

/// The first byte of every item newcache writes (format version 1).
pub(crate) const TAG: u8 = 0xA1;
/// Tag, stamp and flags.
pub(crate) const HEADER: usize = 13;
/// memcached's boundary between a relative `exptime` (seconds from now) and an absolute one.
const RELATIVE_LIMIT: u32 = 60 * 60 * 24 * 30;

/// `value` with its header, as stored.
pub(crate) fn encode(stamp: u64, flags: u32, value: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + value.len());
    out.push(TAG);
    out.extend_from_slice(&stamp.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(value);
    out
}

/// The stamp and flags of stored bytes, and where the value starts; `None` for bytes newcache did
/// not write (foreign).
pub(crate) fn decode(stored: &[u8]) -> Option<(u64, u32)> {
    if stored.len() < HEADER || stored[0] != TAG {
        return None;
    }
    let stamp = u64::from_be_bytes(stored[1..9].try_into().ok()?);
    let flags = u32::from_be_bytes(stored[9..13].try_into().ok()?);
    // newcache never writes a stamp of 0 nor one with the top bit (a foreign token's).
    (stamp != 0 && stamp & FOREIGN == 0).then_some((stamp, flags))
}

/// The top bit of a token: set for a foreign value's digest, clear for newcache's stamps.
pub(crate) const FOREIGN: u64 = 1 << 63;

/// A fresh stamp from 64 random bits: the top bit cleared, never 0.
pub(crate) fn stamp_of(random: u64) -> u64 {
    (random & !FOREIGN).max(1)
}

/// The token of a value another client wrote: its SHA-1's first 8 bytes with the top bit set
/// (no stamp has it), so that a fenced write can still replace exactly that value.
pub(crate) fn foreign_token(stored: &[u8]) -> u64 {
    use sha1::{Digest, Sha1};
    let d = Sha1::digest(stored);
    u64::from_be_bytes(d[..8].try_into().unwrap_or_default()) | FOREIGN
}

/// The bytes stored under a key that read as `item`: newcache's header and value again (the
/// encoding is one-to-one), or a foreign value whole.
pub(crate) fn stored(item: &crate::backend::Item) -> Vec<u8> {
    if item.cas & FOREIGN != 0 {
        return item.value.to_vec();
    }
    encode(item.cas, item.flags, &item.value)
}

/// What a fenced write compares against for `token`: the tag and the stamp, or (for a foreign
/// value's token) 16 hex digits of the value's SHA-1 with the top bit cleared.
pub(crate) fn fence(token: u64) -> Vec<u8> {
    if token & FOREIGN != 0 {
        return format!("{:016x}", token & !FOREIGN).into_bytes();
    }
    let mut out = Vec::with_capacity(9);
    out.push(TAG);
    out.extend_from_slice(&token.to_be_bytes());
    out
}

/// A write's expiry in Redis's terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Expiry {
    /// No expiry (`exptime` 0).
    Never,
    /// `PX ms`: milliseconds from now.
    In(u64),
    /// `EXAT s`: an absolute unix time in seconds (may be in the past: the key is then removed,
    /// as memcached drops an item whose absolute `exptime` has passed).
    At(u64),
}

impl Expiry {
    /// memcached's `exptime`, read as memcached reads it: 0 never, up to 30 days relative
    /// seconds, above that an absolute unix time. The storage interface keeps memcached's field
    /// (the envelope's soft expiry and the staleness bound are computed above it, unchanged);
    /// this backend converts it.
    pub(crate) fn from_exptime(exptime: u32) -> Expiry {
        match exptime {
            0 => Expiry::Never,
            s if s <= RELATIVE_LIMIT => Expiry::In(u64::from(s) * 1000),
            s => Expiry::At(u64::from(s)),
        }
    }

    /// The `SET` arguments: `[]`, `["PX", ms]` or `["EXAT", s]`.
    pub(crate) fn set_args(self) -> Option<(&'static str, u64)> {
        match self {
            Expiry::Never => None,
            Expiry::In(ms) => Some(("PX", ms)),
            Expiry::At(s) => Some(("EXAT", s)),
        }
    }

    /// For a script: the mode (`""`, `"PX"`, `"EXAT"`) and its number.
    pub(crate) fn script_args(self) -> (&'static str, u64) {
        self.set_args().unwrap_or(("", 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_item_round_trips_with_its_stamp_and_flags() {
        let stored = encode(0x0102_0304_0506_0708, 0xDEAD_BEEF, b"value");
        assert_eq!(stored.len(), HEADER + 5);
        assert_eq!(decode(&stored), Some((0x0102_0304_0506_0708, 0xDEAD_BEEF)));
        assert_eq!(&stored[HEADER..], b"value");
        assert_eq!(&stored[..9], &fence(0x0102_0304_0506_0708)[..]);
    }

    #[test]
    fn bytes_another_client_wrote_are_foreign() {
        assert_eq!(decode(b"hello"), None);
        assert_eq!(decode(b""), None);
        // Long enough, but without the tag.
        assert_eq!(decode(&[0u8; 40]), None);
        let t = foreign_token(b"hello");
        assert_ne!(t & FOREIGN, 0);
        // The script compares the SHA-1's first 16 hex digits, top bit cleared.
        let hex = String::from_utf8(fence(t)).unwrap();
        assert_eq!(hex.len(), 16);
        // sha1("hello") = aaf4c61ddcc5e8a2...; 0xa with its top bit cleared is 0x2.
        assert_eq!(hex, "2af4c61ddcc5e8a2");
    }

    #[test]
    fn stamps_never_look_foreign_nor_zero() {
        assert_eq!(stamp_of(0), 1);
        assert_eq!(stamp_of(u64::MAX), u64::MAX >> 1);
        assert_eq!(stamp_of(FOREIGN), 1);
    }

    #[test]
    fn exptimes_read_as_memcached_reads_them() {
        assert_eq!(Expiry::from_exptime(0), Expiry::Never);
        assert_eq!(Expiry::from_exptime(1), Expiry::In(1000));
        assert_eq!(
            Expiry::from_exptime(RELATIVE_LIMIT),
            Expiry::In(u64::from(RELATIVE_LIMIT) * 1000)
        );
        assert_eq!(
            Expiry::from_exptime(RELATIVE_LIMIT + 1),
            Expiry::At(u64::from(RELATIVE_LIMIT) + 1)
        );
    }
}
