//! Time-to-live: the public [`Ttl`] and the pure arithmetic that turns it into a soft expiry and
//! memcached's `exptime` (herd padding first, then the 30-day rule). No I/O, no clock reads.

use std::time::Duration;

/// memcached reads an `exptime` above this many seconds (30 days) as an absolute unix time.
pub const RELATIVE_EXPTIME_MAX: u64 = 2_592_000;

/// The latest absolute `exptime` memcached accepts: it reads the field as a signed 32-bit
/// number, so this is 2038-01-19T03:14:07Z. Anything larger reads as negative: already expired.
pub const MAX_ABSOLUTE_EXPTIME: u32 = i32::MAX as u32;

/// An `exptime` that memcached (and the memory backend) reads as an absolute time in 1970: the
/// item is stored already expired. A `cas` with it is a delete conditional on the CAS token,
/// which the text protocol has no command for.
pub(crate) const EXPIRED: u32 = RELATIVE_EXPTIME_MAX as u32 + 1;

/// How long a value lives.
///
/// `Duration`s convert into `Ttl::After`, so every `ttl` parameter takes either form:
///
/// ```
/// # use std::time::Duration;
/// # use newcache::Ttl;
/// let a: Ttl = Duration::from_secs(60).into();
/// assert_eq!(a, Ttl::After(Duration::from_secs(60)));
/// ```
///
/// A zero duration means "expires now", as in Django: the write removes the key, so nothing is
/// readable afterwards. Sub-second durations are exact for the soft expiry (milliseconds) and round
/// up to a whole second for memcached's hard expiry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Ttl {
    /// The cache's default (`CacheBuilder::default_ttl`, 300 s unless set).
    #[default]
    Default,
    /// Never expires (memcached may still evict it under memory pressure).
    Never,
    /// Expires after this long.
    After(Duration),
}

impl From<Duration> for Ttl {
    fn from(d: Duration) -> Self {
        Ttl::After(d)
    }
}

/// A [`Ttl`] with the default applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lifetime {
    /// Zero: the write deletes instead.
    Expired,
    /// No expiry at all.
    Forever,
    /// Expires after this long (non-zero).
    For(Duration),
}

impl Ttl {
    pub(crate) fn resolve(self, default: Duration) -> Lifetime {
        let d = match self {
            Ttl::Never => return Lifetime::Forever,
            Ttl::Default => default,
            Ttl::After(d) => d,
        };
        if d.is_zero() {
            Lifetime::Expired
        } else {
            Lifetime::For(d)
        }
    }
}

/// Whole seconds, rounded up (saturating: `Duration::MAX` is `u64::MAX` seconds).
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    d.as_secs().saturating_add(u64::from(d.subsec_nanos() > 0))
}

/// memcached's `exptime` for a value that must live `life` plus `padding` (the herd timeout).
///
/// The padding is added *before* the 30-day rule (django-newcache applied the rule first, so a ttl
/// within 60 s of 30 days became a 1970 timestamp). Never returns a negative or past time: `0`
/// means "no expiry" and is only returned for `Lifetime::Forever`. A time past
/// [`MAX_ABSOLUTE_EXPTIME`] (2038-01-19) is clamped to it: memcached would read it as negative and
/// drop the item at once.
pub(crate) fn exptime(life: Lifetime, padding: Duration, now_unix_secs: u64) -> u32 {
    let total = match life {
        Lifetime::Forever => return 0,
        Lifetime::Expired => 1,
        Lifetime::For(d) => ceil_secs(d.saturating_add(padding)).max(1),
    };
    if total <= RELATIVE_EXPTIME_MAX {
        total as u32
    } else {
        // Absolute unix time; memcached reads the field as a signed 32-bit number.
        now_unix_secs
            .saturating_add(total)
            .min(u64::from(MAX_ABSOLUTE_EXPTIME)) as u32
    }
}

/// The soft expiry, in unix milliseconds, of a value written at `now_ms` (0 = never stale).
pub(crate) fn soft_expiry_ms(life: Lifetime, now_ms: u64) -> u64 {
    match life {
        Lifetime::Forever => 0,
        Lifetime::Expired => now_ms,
        Lifetime::For(d) => now_ms.saturating_add(d.as_millis().min(u128::from(u64::MAX)) as u64),
    }
}

/// When memcached should drop a value written at `now_ms` for `life` plus `padding`, in unix
/// milliseconds (0 = never): what the envelope records, so that claims never shorten it.
pub(crate) fn hard_expiry_ms(life: Lifetime, padding: Duration, now_ms: u64) -> u64 {
    match life {
        Lifetime::Forever => 0,
        Lifetime::Expired => now_ms,
        Lifetime::For(d) => now_ms.saturating_add(
            d.saturating_add(padding)
                .as_millis()
                .min(u128::from(u64::MAX)) as u64,
        ),
    }
}

/// When an item written at `now_ms` with memcached `exptime` is gone, in unix milliseconds
/// (`None` = never). This is memcached's own reading of the field; the memory backend uses it.
pub(crate) fn hard_deadline_ms(exptime: u32, now_ms: u64) -> Option<u64> {
    // memcached parses the field as a signed 32-bit number: above i32::MAX it is negative, and a
    // negative exptime is "expired at once".
    let Ok(e) = i32::try_from(exptime) else {
        return Some(0);
    };
    match u64::from(e.unsigned_abs()) {
        0 => None,
        e if e <= RELATIVE_EXPTIME_MAX => Some(now_ms.saturating_add(e * 1000)),
        // An absolute time in the past expires the item at once, as in memcached.
        e => Some(e * 1000),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_790_000_000; // a unix time in 2026

    #[track_caller]
    fn check(life: Lifetime, padding_s: u64, expected: u32) {
        assert_eq!(exptime(life, Duration::from_secs(padding_s), NOW), expected);
    }

    fn secs(s: u64) -> Lifetime {
        Lifetime::For(Duration::from_secs(s))
    }

    #[test]
    fn padding_then_thirty_day_rule() {
        check(secs(300), 60, 360);
        check(Lifetime::Forever, 60, 0);
        check(
            secs(RELATIVE_EXPTIME_MAX - 60),
            60,
            RELATIVE_EXPTIME_MAX as u32,
        );
        // newcache bug 2: 30 days - 30 s + 60 s padding crosses the rule; it must become absolute
        // now + total, never a tiny relative number or a 1970 timestamp.
        check(
            secs(RELATIVE_EXPTIME_MAX - 30),
            60,
            (NOW + RELATIVE_EXPTIME_MAX + 30) as u32,
        );
        check(
            secs(RELATIVE_EXPTIME_MAX + 1),
            0,
            (NOW + RELATIVE_EXPTIME_MAX + 1) as u32,
        );
        check(secs(RELATIVE_EXPTIME_MAX), 0, RELATIVE_EXPTIME_MAX as u32);
    }

    #[test]
    fn far_ttls_clamp_to_2038_and_never_overflow() {
        // 0.1.0: a 12-year TTL became an exptime past i32::MAX, which memcached reads as negative
        // (gone at once); Duration::MAX overflowed on the way.
        let twelve_years = secs(12 * 365 * 86_400);
        check(twelve_years, 60, MAX_ABSOLUTE_EXPTIME);
        check(Lifetime::For(Duration::MAX), 60, MAX_ABSOLUTE_EXPTIME);
        check(Lifetime::For(Duration::MAX), 0, MAX_ABSOLUTE_EXPTIME);
        assert_eq!(ceil_secs(Duration::MAX), u64::MAX);
        assert_eq!(
            soft_expiry_ms(Lifetime::For(Duration::MAX), NOW * 1000),
            u64::MAX
        );
        let hard = hard_expiry_ms(Lifetime::For(Duration::MAX), Duration::from_secs(60), 5);
        assert_eq!(hard, u64::MAX);
        // a clamped exptime is read back as alive until 2038
        let at = hard_deadline_ms(MAX_ABSOLUTE_EXPTIME, NOW * 1000).unwrap();
        assert_eq!(at, u64::from(MAX_ABSOLUTE_EXPTIME) * 1000);
        // and memcached's reading of a larger one: negative, gone
        assert_eq!(
            hard_deadline_ms(MAX_ABSOLUTE_EXPTIME + 1, NOW * 1000),
            Some(0)
        );
    }

    #[test]
    fn sub_second_rounds_up() {
        check(Lifetime::For(Duration::from_millis(1)), 0, 1);
        check(Lifetime::For(Duration::from_millis(1500)), 0, 2);
        check(Lifetime::For(Duration::from_millis(500)), 60, 61);
        assert_eq!(ceil_secs(Duration::from_secs(2)), 2);
    }

    #[test]
    fn resolve_default_and_zero() {
        let d = Duration::from_secs(300);
        assert_eq!(Ttl::Default.resolve(d), secs(300));
        assert_eq!(Ttl::Never.resolve(d), Lifetime::Forever);
        assert_eq!(Ttl::After(Duration::ZERO).resolve(d), Lifetime::Expired);
        assert_eq!(Ttl::Default.resolve(Duration::ZERO), Lifetime::Expired);
    }

    #[test]
    fn soft_expiry_has_millisecond_precision() {
        let life = Lifetime::For(Duration::from_millis(1234));
        assert_eq!(soft_expiry_ms(life, 1_000_000), 1_001_234);
        assert_eq!(soft_expiry_ms(Lifetime::Forever, 5), 0);
    }

    #[test]
    fn memcached_reading_of_exptime() {
        let now_ms = NOW * 1000;
        assert_eq!(hard_deadline_ms(0, now_ms), None);
        assert_eq!(hard_deadline_ms(10, now_ms), Some(now_ms + 10_000));
        let abs = (NOW + 3_000_000) as u32;
        assert_eq!(hard_deadline_ms(abs, now_ms), Some(u64::from(abs) * 1000));
        // absolute and in the past: already gone
        assert!(hard_deadline_ms(RELATIVE_EXPTIME_MAX as u32 + 5, now_ms).unwrap() < now_ms);
    }
}
