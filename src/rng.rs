//! The random sources: a lock-free SplitMix64 stream for XFetch draws and wait jitter, seedable
//! so that tests are exact, and the process's entropy for claim tokens, which no seed reaches.

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

/// One xorshift64 step: never reaches 0 from a non-zero state.
pub(crate) fn xorshift(mut x: u64) -> u64 {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    x
}

/// A number no other process (nor another call in this one) is likely to draw: the OS's
/// entropy (std's `RandomState` keys, read from the OS once per thread and stepped per call),
/// mixed with the process id, the thread and the clock. For claim tokens, which must differ
/// across processes even when every cache shares one `random_seed`.
pub(crate) fn entropy() -> u64 {
    use std::hash::{BuildHasher, Hash, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    std::thread::current().id().hash(&mut h);
    h.finish()
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

    #[test]
    fn entropy_differs_per_call() {
        let drawn: std::collections::HashSet<u64> = (0..1000).map(|_| entropy()).collect();
        assert_eq!(drawn.len(), 1000);
    }
}
