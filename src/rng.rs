//! The random source for XFetch draws, wait jitter and claim tokens: a lock-free SplitMix64
//! stream, seedable so that tests are exact.

use std::sync::atomic::{AtomicU64, Ordering};

/// A lock-free SplitMix64 stream.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_are_in_range_and_seeded() {
        let (a, b) = (Rng::new(7), Rng::new(7));
        for _ in 0..10_000 {
            let d = a.draw();
            assert!(d > 0.0 && d <= 1.0);
            assert_eq!(d, b.draw());
        }
        let mean: f64 = (0..10_000).map(|_| a.draw()).sum::<f64>() / 10_000.0;
        assert!((0.48..0.52).contains(&mean), "{mean}");
    }
}
