//! The herd verdict: given an item's header and the time, may it be served, and should this reader
//! try to claim it? Pure: no I/O, no clock, no randomness of its own.

use crate::envelope::{Header, Kind};

/// What a reader should do with an item it just read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Serve it.
    Fresh,
    /// Still fresh, but XFetch drew this reader to recompute early: try to claim it; losers (and
    /// this reader if the claim fails) serve it.
    EarlyRefresh,
    /// Past its soft expiry and unclaimed (or its claim lapsed): try to claim it; the winner
    /// recomputes, the others serve it stale.
    Stale,
    /// Past its soft expiry and being recomputed under a live claim: serve it stale.
    Recomputing,
    /// Nothing servable (a placeholder, or a value past its staleness bound), and a live claim:
    /// someone is loading it. Wait, or report a miss.
    Loading,
    /// Nothing servable and no live claim (a dead holder, a value past its bound): claim it to load.
    Expired,
    /// A live "not storable" marker: the last load's value was too large to store. Nobody is
    /// loading it and nobody waits: every caller loads it itself, unclaimed, and stores nothing.
    NotStorable,
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
/// - Stale means `now_ms >= soft_expiry_ms`, at millisecond precision (django-newcache compared
///   whole seconds against a truncated clock).
/// - **The staleness bound**: a value is never served at or after `soft_expiry_ms + herd_ms`,
///   the herd timeout its writer used. memcached may keep the item longer (as a claim marker);
///   readers just never serve it.
/// - A claim is live while `now_ms < claim_until_ms`. Claims compare the claimant's wall clock
///   (which wrote the deadline) with the reader's: processes sharing a cache are assumed to have
///   clocks within a fraction of the lease of each other.
pub(crate) fn judge(h: &Header, now_ms: u64, xfetch: Option<Xfetch>) -> Verdict {
    if h.not_storable {
        // Past its deadline the marker is a dead placeholder: one caller claims the key and
        // tries to store again (the value may have shrunk).
        return if now_ms < h.expires_ms {
            Verdict::NotStorable
        } else {
            Verdict::Expired
        };
    }
    let claimed = now_ms < h.claim_until_ms;
    let loading = if claimed {
        Verdict::Loading
    } else {
        Verdict::Expired
    };
    match h.kind {
        Kind::Plain => return Verdict::Fresh,
        Kind::Placeholder => return loading,
        Kind::Value => {}
    }
    if h.soft_expiry_ms == 0 {
        return Verdict::Fresh;
    }
    let bound = h.soft_expiry_ms.saturating_add(u64::from(h.herd_ms));
    if now_ms >= bound {
        return loading;
    }
    if now_ms >= h.soft_expiry_ms {
        return if claimed {
            Verdict::Recomputing
        } else {
            Verdict::Stale
        };
    }
    if claimed {
        // Claimed early (XFetch): fresh for everyone else, and not refreshed twice.
        return Verdict::Fresh;
    }
    match xfetch {
        Some(x) if h.load_ms > 0 => {
            // now - delta * beta * ln(draw) >= expiry, with ln(draw) <= 0.
            let draw = x.draw.clamp(f64::MIN_POSITIVE, 1.0);
            let ahead = f64::from(h.load_ms) * x.beta * -draw.ln();
            if now_ms as f64 + ahead >= h.soft_expiry_ms as f64 {
                Verdict::EarlyRefresh
            } else {
                Verdict::Fresh
            }
        }
        _ => Verdict::Fresh,
    }
}

/// Whether a value may be served at all (fresh, or stale within its bound).
pub(crate) fn servable(v: Verdict) -> bool {
    matches!(
        v,
        Verdict::Fresh | Verdict::EarlyRefresh | Verdict::Stale | Verdict::Recomputing
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use Verdict::*;

    fn value(claim_until_ms: u64, soft: u64, herd: u32, load_ms: u32) -> Header {
        Header {
            claim_until_ms,
            token: u64::from(claim_until_ms != 0),
            ..Header::value(soft, 0, load_ms, herd)
        }
    }

    #[track_caller]
    fn check(h: Header, now: u64, x: Option<Xfetch>, expected: Verdict) {
        assert_eq!(judge(&h, now, x), expected);
    }

    #[test]
    fn soft_expiry_at_millisecond_precision() {
        let h = value(0, 10_500, 1_000, 0);
        check(h, 10_499, None, Fresh);
        check(h, 10_500, None, Stale);
        check(h, 10_501, None, Stale);
        check(value(0, 0, 0, 0), u64::MAX, None, Fresh);
        check(Header::plain(0), u64::MAX, None, Fresh);
    }

    #[test]
    fn staleness_is_bounded_by_the_writers_herd_timeout() {
        let h = value(0, 10_000, 1_000, 0);
        check(h, 10_999, None, Stale);
        check(h, 11_000, None, Expired);
        // a live claim does not make an over-age value servable: it is being loaded
        check(value(20_000, 10_000, 1_000, 0), 11_000, None, Loading);
        check(value(20_000, 10_000, 1_000, 0), 10_999, None, Recomputing);
        assert!(!servable(Loading) && !servable(Expired));
    }

    #[test]
    fn claims() {
        // claimed stale: recomputing until the claim's deadline; past it (the claimant died), stale
        check(value(2_000, 1_000, 60_000, 0), 1_999, None, Recomputing);
        check(value(2_000, 1_000, 60_000, 0), 2_000, None, Stale);
        // claimed early (before the soft expiry): still fresh for everyone else
        check(value(2_000, 1_500, 60_000, 0), 1_000, None, Fresh);
        check(value(2_000, 1_500, 60_000, 0), 1_500, None, Recomputing);
        // a not-storable marker: load it yourself until its deadline, then claim it
        check(Header::not_storable(0, 500), 499, None, NotStorable);
        check(Header::not_storable(0, 500), 500, None, Expired);
        assert!(!servable(NotStorable));
        // placeholders
        check(Header::placeholder(0, 500, 9), 499, None, Loading);
        check(Header::placeholder(0, 500, 9), 500, None, Expired);
    }

    #[test]
    fn xfetch_draws() {
        let h = value(0, 10_000, 60_000, 100);
        let x = |draw| Some(Xfetch { beta: 1.0, draw });
        // draw = 1: ln(1) = 0, never early
        check(h, 9_999, x(1.0), Fresh);
        // draw = e^-1: 100 ms ahead
        let d = (-1.0f64).exp();
        check(h, 9_899, x(d), Fresh);
        check(h, 9_901, x(d), EarlyRefresh);
        // beta scales the window
        check(h, 9_801, Some(Xfetch { beta: 2.0, draw: d }), EarlyRefresh);
        // an item being refreshed, or with an unknown load time, is never refreshed early
        check(value(20_000, 10_000, 60_000, 100), 9_999, x(1e-9), Fresh);
        check(value(0, 10_000, 60_000, 0), 9_999, x(1e-9), Fresh);
        // once the claim ran out, early refresh is possible again
        check(
            value(9_000, 10_000, 60_000, 100),
            9_999,
            x(1e-9),
            EarlyRefresh,
        );
        // a draw of 0 is clamped (a finite ~70 s window here), not -inf
        check(value(0, 100_000, 60_000, 100), 0, x(0.0), Fresh);
        check(h, 9_000, x(0.0), EarlyRefresh);
    }
}
