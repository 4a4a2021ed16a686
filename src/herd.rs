//! The herd decision: given an item's header and the time, is it fresh, stale (to be claimed by one
//! reader), or due for an early (XFetch) refresh? Pure: no I/O, no clock, no randomness of its own.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::envelope::Header;

/// A lock-free SplitMix64 stream: XFetch draws and wait jitter. Seedable, so tests are exact.
#[derive(Debug)]
pub(crate) struct Rng(AtomicU64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(AtomicU64::new(seed))
    }

    pub(crate) fn next_u64(&self) -> u64 {
        let mut z = self
            .0
            .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed)
            .wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    pub(crate) fn draw(&self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }
}

/// What a reader should do with an item it just read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Serve it.
    Fresh,
    /// Past its soft expiry, but claimed by a reader who is recomputing it (and whose claim has not
    /// run out): serve it, counted as stale.
    Recomputing,
    /// Past its soft expiry: try to claim it (CAS); the winner recomputes, the others serve it.
    Stale,
    /// Still fresh, but XFetch drew this reader to recompute early: try to claim it like a stale
    /// item; losers (and this reader if the claim fails) serve it.
    EarlyRefresh,
}

/// XFetch (Vattani, Chierichetti, Lowenstein, VLDB 2015) parameters for one read.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Xfetch {
    /// The β of the paper; 1.0 is its recommended default, larger refreshes earlier.
    pub(crate) beta: f64,
    /// A uniform draw from (0, 1].
    pub(crate) draw: f64,
}

/// Judges an item at `now_ms`.
///
/// Stale means `now_ms >= soft_expiry_ms`, at millisecond precision (django-newcache compared whole
/// seconds with a strict `<` against a truncated clock). An item whose claim is still running is
/// being recomputed: served as it is (fresh until its soft expiry, then counted as stale) and never
/// claimed or refreshed early again. A claim that ran out (its claimant died) no longer counts.
pub(crate) fn judge(header: &Header, now_ms: u64, xfetch: Option<Xfetch>) -> Verdict {
    let Header::Herd {
        soft_expiry_ms,
        load_ms,
        claimed_until_ms,
        ..
    } = *header
    else {
        return Verdict::Fresh;
    };
    let expired = soft_expiry_ms != 0 && now_ms >= soft_expiry_ms;
    if now_ms < claimed_until_ms {
        return if expired {
            Verdict::Recomputing
        } else {
            Verdict::Fresh
        };
    }
    if expired {
        return Verdict::Stale;
    }
    match xfetch {
        Some(x) if load_ms > 0 && soft_expiry_ms != 0 => {
            // now - delta * beta * ln(draw) >= expiry, with ln(draw) <= 0.
            let draw = x.draw.clamp(f64::MIN_POSITIVE, 1.0);
            let ahead = f64::from(load_ms) * x.beta * -draw.ln();
            if now_ms as f64 + ahead >= soft_expiry_ms as f64 {
                Verdict::EarlyRefresh
            } else {
                Verdict::Fresh
            }
        }
        _ => Verdict::Fresh,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn herd(claimed_until_ms: u64, soft: u64, load_ms: u32) -> Header {
        Header::Herd {
            soft_expiry_ms: soft,
            written_ms: 0,
            load_ms,
            claimed_until_ms,
        }
    }

    #[track_caller]
    fn check(h: Header, now: u64, x: Option<Xfetch>, expected: Verdict) {
        assert_eq!(judge(&h, now, x), expected);
    }

    #[test]
    fn soft_expiry_at_millisecond_precision() {
        let h = herd(0, 10_500, 0);
        check(h, 10_499, None, Verdict::Fresh);
        check(h, 10_500, None, Verdict::Stale);
        check(h, 10_501, None, Verdict::Stale);
        check(herd(0, 0, 0), u64::MAX, None, Verdict::Fresh);
        check(Header::Plain, u64::MAX, None, Verdict::Fresh);
    }

    #[test]
    fn claims() {
        // claimed stale: recomputing until the claim's deadline; past it (the claimant died), stale
        check(herd(2_000, 1_000, 0), 1_999, None, Verdict::Recomputing);
        check(herd(2_000, 1_000, 0), 2_000, None, Verdict::Stale);
        // claimed early (before the soft expiry): still fresh for everyone else
        check(herd(2_000, 1_500, 0), 1_000, None, Verdict::Fresh);
        check(herd(2_000, 1_500, 0), 1_500, None, Verdict::Recomputing);
    }

    #[test]
    fn rng_draws_are_in_range_and_seeded() {
        let (a, b) = (Rng::new(7), Rng::new(7));
        for _ in 0..10_000 {
            let d = a.draw();
            assert!(d > 0.0 && d <= 1.0);
            assert_eq!(d, b.draw());
        }
        let mean: f64 = (0..10_000).map(|_| a.draw()).sum::<f64>() / 10_000.0;
        assert!((0.48..0.52).contains(&mean), "{mean}");
    }

    #[test]
    fn xfetch_draws() {
        let h = herd(0, 10_000, 100);
        let x = |draw| Some(Xfetch { beta: 1.0, draw });
        // draw = 1: ln(1) = 0, never early
        check(h, 9_999, x(1.0), Verdict::Fresh);
        // draw = e^-1: 100 ms ahead
        let d = (-1.0f64).exp();
        check(h, 9_899, x(d), Verdict::Fresh);
        check(h, 9_901, x(d), Verdict::EarlyRefresh);
        // beta scales the window
        check(
            h,
            9_801,
            Some(Xfetch { beta: 2.0, draw: d }),
            Verdict::EarlyRefresh,
        );
        // an item being refreshed, or with an unknown load time, is never refreshed early
        check(herd(20_000, 10_000, 100), 9_999, x(1e-9), Verdict::Fresh);
        check(herd(0, 10_000, 0), 9_999, x(1e-9), Verdict::Fresh);
        // once the claim ran out, early refresh is possible again
        check(
            herd(9_000, 10_000, 100),
            9_999,
            x(1e-9),
            Verdict::EarlyRefresh,
        );
        // a draw of 0 is clamped (a finite ~70 s window here), not -inf
        check(herd(0, 100_000, 100), 0, x(0.0), Verdict::Fresh);
        check(h, 9_000, x(0.0), Verdict::EarlyRefresh);
    }
}
