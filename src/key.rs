//! Key derivation: `{flavor}-{version}-{sha1 hex}` as django-newcache makes it, and memcached's key
//! rules. Pure: no I/O.

use std::fmt;
use std::sync::Arc;

use sha1::{Digest, Sha1};

use crate::error::{Error, ErrorKind, Result};

/// memcached's longest key, in bytes.
pub const MAX_KEY_LEN: usize = 250;

/// A replacement for the key derivation (django-newcache's `CACHE_KEY_MODULE`).
///
/// Called as `f(flavor, version, user_key)`; its output is checked against memcached's key rules
/// ([`validate_key`]) before it reaches the wire.
pub type KeyFunction = Arc<dyn Fn(&str, u64, &str) -> String + Send + Sync>;

/// The default derivation: `{flavor}-{version}-{sha1 hex of the key's UTF-8 bytes}`.
///
/// Byte for byte the key django-newcache writes, so both can share a memcached.
///
/// ```
/// assert_eq!(
///     newcache::default_key("prod", 1, "foo"),
///     "prod-1-0beec7b5ea3f0fdbc95d0dd47f3c5bc275da8a33"
/// );
/// ```
pub fn default_key(flavor: &str, version: u64, key: &str) -> String {
    let mut out = Vec::with_capacity(default_key_len(flavor, version));
    push_prefix(flavor, version, &mut out);
    push_digest_hex(key, &mut out);
    // Only the flavor (a `str`), digits, '-' and hex went in.
    String::from_utf8(out).unwrap_or_default()
}

/// Appends `{flavor}-{version}-`, what every default key of this flavor and version starts
/// with (no allocation: this runs once per single-key call).
fn push_prefix(flavor: &str, version: u64, out: &mut Vec<u8>) {
    out.extend_from_slice(flavor.as_bytes());
    out.push(b'-');
    let mut digits = [0u8; 20];
    let mut n = digits.len();
    let mut v = version;
    loop {
        n -= 1;
        digits[n] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[n..]);
    out.push(b'-');
}

/// The length of every key [`default_key`] derives for this flavor and version.
fn default_key_len(flavor: &str, version: u64) -> usize {
    let digits = version.checked_ilog10().unwrap_or(0) as usize + 1;
    flavor.len() + 1 + digits + 1 + 40
}

/// Each byte's two lowercase hex digits.
const HEX_PAIRS: [[u8; 2]; 256] = {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut t = [[0u8; 2]; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = [HEX[i >> 4], HEX[i & 0xf]];
        i += 1;
    }
    t
};

/// Appends the forty lowercase hex digits of the SHA-1 of `key`: the part of a default key
/// that differs from key to key.
fn push_digest_hex(key: &str, out: &mut Vec<u8>) {
    let digest = Sha1::digest(key.as_bytes());
    let mut hex = [0u8; 40];
    for (pair, b) in hex.chunks_exact_mut(2).zip(digest.iter()) {
        pair.copy_from_slice(&HEX_PAIRS[usize::from(*b)]);
    }
    out.extend_from_slice(&hex);
}

/// Checks a derived key against memcached's rules: 1 to 250 bytes, no whitespace, no control bytes.
///
/// ```
/// assert!(newcache::validate_key("prod-1-abc").is_ok());
/// assert!(newcache::validate_key("has space").unwrap_err().is_invalid_key());
/// ```
pub fn validate_key(key: &str) -> Result<()> {
    if key.is_empty() {
        return Err(Error::new(ErrorKind::InvalidKey, "the key is empty"));
    }
    check_len(key)?;
    // The common case, every derived key: printable ASCII. A fold without early exit, so that
    // the compiler can check many bytes at a time (a batch checks every key of it).
    if key
        .bytes()
        .fold(true, |ok, b| ok & (b.wrapping_sub(0x21) < 0x7f - 0x21))
    {
        return Ok(());
    }
    if let Some(b) = key
        .bytes()
        .find(|b| b.is_ascii_whitespace() || b.is_ascii_control())
    {
        return Err(Error::new(
            ErrorKind::InvalidKey,
            format!("the key contains the byte {b:#04x} (whitespace or control)"),
        ));
    }
    if key.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(Error::new(
            ErrorKind::InvalidKey,
            "the key contains a unicode whitespace or control character",
        ));
    }
    Ok(())
}

/// Refuses a key longer than memcached's [`MAX_KEY_LEN`].
pub(crate) fn check_len(key: &str) -> Result<()> {
    if key.len() > MAX_KEY_LEN {
        return Err(Error::new(
            ErrorKind::InvalidKey,
            format!(
                "the key is {} bytes, memcached allows {MAX_KEY_LEN}",
                key.len()
            ),
        ));
    }
    Ok(())
}

/// How user keys become memcached keys: flavor, version and the derivation function.
#[derive(Clone)]
pub(crate) struct KeyMaker {
    pub(crate) flavor: Arc<str>,
    pub(crate) version: u64,
    pub(crate) function: Option<KeyFunction>,
}

impl KeyMaker {
    /// What every derived key starts with (`{flavor}-{version}-`), or `None` with a custom key
    /// function (its keys have no known shape).
    pub(crate) fn prefix(&self) -> Option<String> {
        match &self.function {
            None => Some(format!("{}-{}-", self.flavor, self.version)),
            Some(_) => None,
        }
    }

    /// The derived key, validated: no key that breaks memcached's rules ever reaches a backend
    /// (`with_version(u64::MAX)` on a long flavor would otherwise derive a 262-byte key).
    pub(crate) fn make(&self, key: &str) -> Result<String> {
        match &self.function {
            None => {
                self.check_default_len()?;
                Ok(default_key(&self.flavor, self.version, key))
            }
            Some(f) => {
                let k = f(&self.flavor, self.version, key);
                validate_key(&k)?;
                Ok(k)
            }
        }
    }

    /// The flavor's bytes were checked at build; digits, '-' and hex are safe. Only the length
    /// of a default key can break memcached's rules.
    fn check_default_len(&self) -> Result<()> {
        let len = default_key_len(&self.flavor, self.version);
        if len > MAX_KEY_LEN {
            return Err(Error::new(
                ErrorKind::InvalidKey,
                format!(
                    "flavor {:?} and version {} derive {len}-byte keys; memcached allows \
                     {MAX_KEY_LEN}",
                    self.flavor, self.version
                ),
            ));
        }
        Ok(())
    }

    /// Every key of a batch derived and validated, into one buffer (one allocation, not one per
    /// key: batches derive a hundred keys per call).
    pub(crate) fn make_all<K: AsRef<str>>(&self, keys: &[K]) -> Result<Derived> {
        let mut buf = Vec::with_capacity(keys.len() * (self.flavor.len() + 64));
        let mut ends = Vec::with_capacity(keys.len());
        match &self.function {
            None if keys.is_empty() => {}
            None => {
                // One length check and one prefix cover every key of the batch.
                self.check_default_len()?;
                let mut prefix = Vec::with_capacity(self.flavor.len() + 22);
                push_prefix(&self.flavor, self.version, &mut prefix);
                for k in keys {
                    buf.extend_from_slice(&prefix);
                    push_digest_hex(k.as_ref(), &mut buf);
                    ends.push(buf.len());
                }
            }
            Some(_) => {
                for k in keys {
                    buf.extend_from_slice(self.make(k.as_ref())?.as_bytes());
                    ends.push(buf.len());
                }
            }
        }
        // Every key in it is a `str`, and each ends on a key's boundary.
        let buf = String::from_utf8(buf).unwrap_or_default();
        Ok(Derived { buf, ends })
    }

    /// The derived key without validation (for display through `Cache::make_key`).
    pub(crate) fn make_unchecked(&self, key: &str) -> String {
        match &self.function {
            None => default_key(&self.flavor, self.version, key),
            Some(f) => f(&self.flavor, self.version, key),
        }
    }
}

/// How a batch hashes its derived keys to find duplicates. A default key ends in forty hex
/// digits of SHA-1, so its last eight bytes are as good as any hash, for a fraction of SipHash's
/// cost (batches dedupe a hundred keys per call). A custom key function may pass user input
/// through (keys sharing a suffix would all collide): those keys get std's seeded SipHash.
#[derive(Debug, Clone, Default)]
pub(crate) struct KeyHash(Option<std::collections::hash_map::RandomState>);

impl KeyHash {
    /// The hash for keys made by `maker`.
    pub(crate) fn for_keys(maker: &KeyMaker) -> KeyHash {
        KeyHash(maker.function.as_ref().map(|_| Default::default()))
    }
}

impl std::hash::BuildHasher for KeyHash {
    type Hasher = KeyHasher;
    fn build_hasher(&self) -> KeyHasher {
        match &self.0 {
            None => KeyHasher::Tail(0),
            Some(seeded) => KeyHasher::Seeded(seeded.build_hasher()),
        }
    }
}

/// The hasher of [`KeyHash`].
#[derive(Debug)]
pub(crate) enum KeyHasher {
    /// The last eight bytes of a default key (SHA-1 hex).
    Tail(u64),
    /// Custom keys: the whole key, seeded.
    Seeded(std::collections::hash_map::DefaultHasher),
}

impl std::hash::Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        match self {
            KeyHasher::Tail(h) => {
                let tail = &bytes[bytes.len().saturating_sub(8)..];
                let mut word = [0u8; 8];
                word[..tail.len()].copy_from_slice(tail);
                // Mixed with the length, and spread (a multiplicative hash) so that hex digits
                // fill every bit hashbrown looks at.
                *h = (*h ^ u64::from_le_bytes(word) ^ bytes.len() as u64)
                    .wrapping_mul(0x9E37_79B9_7F4A_7C15);
            }
            KeyHasher::Seeded(s) => s.write(bytes),
        }
    }
    fn write_u8(&mut self, b: u8) {
        // `str`'s terminator byte: nothing for the tail hash.
        if let KeyHasher::Seeded(s) = self {
            s.write_u8(b);
        }
    }
    fn finish(&self) -> u64 {
        match self {
            KeyHasher::Tail(h) => h ^ (h >> 29),
            KeyHasher::Seeded(s) => s.finish(),
        }
    }
}

/// The derived keys of a batch, in one buffer.
#[derive(Debug)]
pub(crate) struct Derived {
    buf: String,
    ends: Vec<usize>,
}

impl Derived {
    /// The i-th derived key.
    pub(crate) fn get(&self, i: usize) -> &str {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.buf[start..self.ends[i]]
    }

    /// Every derived key, in order.
    pub(crate) fn refs(&self) -> Vec<&str> {
        (0..self.ends.len()).map(|i| self.get(i)).collect()
    }
}

impl fmt::Debug for KeyMaker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyMaker")
            .field("flavor", &self.flavor)
            .field("version", &self.version)
            .field("custom_function", &self.function.is_some())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn check(flavor: &str, version: u64, key: &str, expected: &str) {
        assert_eq!(default_key(flavor, version, key), expected);
        validate_key(expected).expect("derived keys are always valid");
    }

    #[test]
    fn matches_django_newcache() {
        // sha1("foo") = 0beec7b5ea3f0fdbc95d0dd47f3c5bc275da8a33
        check(
            "prod",
            1,
            "foo",
            "prod-1-0beec7b5ea3f0fdbc95d0dd47f3c5bc275da8a33",
        );
        check("", 1, "foo", "-1-0beec7b5ea3f0fdbc95d0dd47f3c5bc275da8a33");
        check("", 2, "foo", "-2-0beec7b5ea3f0fdbc95d0dd47f3c5bc275da8a33");
        check(
            "v",
            0,
            "foo",
            "v-0-0beec7b5ea3f0fdbc95d0dd47f3c5bc275da8a33",
        );
        check(
            "v",
            u64::MAX,
            "foo",
            "v-18446744073709551615-0beec7b5ea3f0fdbc95d0dd47f3c5bc275da8a33",
        );
        // sha1("abc"), the value the peers' setup script checks django-newcache against
        check("", 1, "abc", "-1-a9993e364706816aba3e25717850c26c9cd0d89d");
        // UTF-8 bytes are hashed: sha1("é") = sha1(b"\xc3\xa9")
        check("", 1, "é", "-1-bf15be717ac1b080b4f1c456692825891ff5073d");
    }

    #[test]
    fn hostile_keys_hash_to_safe_keys() {
        for k in [
            "a b",
            "x\r\nflush_all\r\n",
            "nul\0byte",
            &"z".repeat(100_000),
        ] {
            let d = default_key("f", 1, k);
            assert_eq!(d.len(), 2 + 1 + 1 + 40);
            validate_key(&d).unwrap();
        }
    }

    #[test]
    fn validation_rules() {
        assert!(validate_key(&"a".repeat(250)).is_ok());
        assert!(validate_key(&"a".repeat(251)).unwrap_err().is_invalid_key());
        assert!(validate_key("").unwrap_err().is_invalid_key());
        for bad in [
            "a b",
            "a\tb",
            "a\r\nb",
            "a\0b",
            "a\x7fb",
            "a\u{a0}b",
            "a\u{2028}b",
        ] {
            assert!(validate_key(bad).unwrap_err().is_invalid_key(), "{bad:?}");
        }
        assert!(validate_key("clé-ünïcode").is_ok());
    }

    #[test]
    fn default_keys_too_long_for_memcached_are_refused() {
        let maker = KeyMaker {
            flavor: "f".repeat(200).into(),
            version: 1,
            function: None,
        };
        assert_eq!(maker.make("k").unwrap().len(), 200 + 1 + 1 + 1 + 40);
        let maker = KeyMaker {
            version: u64::MAX,
            ..maker
        };
        assert_eq!(maker.make_unchecked("k").len(), 262);
        assert!(maker.make("k").unwrap_err().is_invalid_key());
        for v in [0, 9, 10, 99, 100, u64::MAX] {
            assert_eq!(default_key_len("ab", v), default_key("ab", v, "x").len());
        }
    }

    #[test]
    fn batches_derive_the_same_keys_into_one_buffer() {
        let keys = ["a", "", "é", "x y", "a"];
        for function in [
            None,
            Some(
                Arc::new(|f: &str, v: u64, k: &str| format!("{f}:{v}:{}", k.len())) as KeyFunction,
            ),
        ] {
            let maker = KeyMaker {
                flavor: "f".into(),
                version: 7,
                function,
            };
            let d = maker.make_all(&keys).unwrap();
            for (i, k) in keys.iter().enumerate() {
                assert_eq!(d.get(i), maker.make(k).unwrap());
            }
            assert_eq!(d.refs().len(), 5);
        }
        let long = KeyMaker {
            flavor: "f".repeat(200).into(),
            version: u64::MAX,
            function: None,
        };
        assert!(long.make_all(&["k"]).unwrap_err().is_invalid_key());
        // the tail hasher finds duplicates like any other
        let mut seen = std::collections::HashSet::with_capacity_and_hasher(4, KeyHash(None));
        assert!(seen.insert("prod-1-0beec7b5ea3f0fdbc95d0dd47f3c5bc275da8a33"));
        assert!(seen.insert("prod-2-0beec7b5ea3f0fdbc95d0dd47f3c5bc275da8a33"));
        assert!(seen.insert("k"));
        assert!(!seen.insert("prod-1-0beec7b5ea3f0fdbc95d0dd47f3c5bc275da8a33"));
    }

    #[test]
    fn custom_function_is_validated() {
        let maker = KeyMaker {
            flavor: "".into(),
            version: 1,
            function: Some(Arc::new(|_, _, k: &str| k.to_string())),
        };
        assert_eq!(maker.make("plain").unwrap(), "plain");
        assert!(maker.make("with space").unwrap_err().is_invalid_key());
        assert!(maker.make(&"x".repeat(300)).unwrap_err().is_invalid_key());
    }
}
