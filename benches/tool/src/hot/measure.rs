//! One measurement: N callers (tokio tasks or OS threads) GET random hot keys in a closed loop
//! through a warm-up and a counted window; each records its latencies in its own histogram, and
//! the histograms are merged at the end.

use std::thread;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use crate::hot::clients::{AsyncGet, BoxError, KEYS};

/// The longest latency the histograms resolve (longer ones count as this).
const MAX_NS: u64 = 10_000_000_000;

/// Warm-up and counted durations.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    pub warmup: Duration,
    pub duration: Duration,
}

/// The counted window, fixed when the callers start.
#[derive(Debug, Clone, Copy)]
struct Window {
    start: Instant,
    end: Instant,
}

impl Timing {
    fn window(self) -> Window {
        let start = Instant::now() + self.warmup;
        Window {
            start,
            end: start + self.duration,
        }
    }
}

/// What callers saw in the counted window: the latencies of successful GETs (in ns), the
/// errors, and the first error's text.
pub struct Tally {
    pub hist: Histogram<u64>,
    pub errors: u64,
    pub first_error: Option<String>,
}

impl Tally {
    fn new() -> Tally {
        Tally {
            hist: Histogram::new_with_bounds(1, MAX_NS, 3).expect("valid histogram bounds"),
            errors: 0,
            first_error: None,
        }
    }

    /// Counts a GET that ran from `t0` to `t1` if it lies wholly inside the window.
    fn record(&mut self, w: &Window, t0: Instant, t1: Instant, outcome: Result<(), BoxError>) {
        if t0 < w.start || t1 > w.end {
            return;
        }
        match outcome {
            Ok(()) => self.hist.saturating_record((t1 - t0).as_nanos() as u64),
            Err(e) => {
                self.errors += 1;
                self.first_error.get_or_insert_with(|| e.to_string());
            }
        }
    }

    fn merge(mut self, other: Tally) -> Tally {
        self.hist
            .add(&other.hist)
            .expect("histograms of the same bounds");
        self.errors += other.errors;
        self.first_error = self.first_error.or(other.first_error);
        self
    }

    fn merge_all(tallies: impl IntoIterator<Item = Tally>) -> Tally {
        tallies.into_iter().fold(Tally::new(), Tally::merge)
    }
}

/// SplitMix64: a cheap per-caller key picker (uniform over the hot keys).
struct Rng(u64);

impl Rng {
    fn new(caller: usize, seed: u64) -> Rng {
        Rng(seed ^ (caller as u64).wrapping_mul(0xA076_1D64_78BD_642F))
    }

    fn key(&mut self) -> usize {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) % KEYS as u64) as usize
    }
}

/// Runs one task per getter on the current runtime until the window closes.
pub async fn run_tasks<G: AsyncGet>(getters: Vec<G>, timing: Timing, seed: u64) -> Tally {
    // Histograms are allocated before the clock starts.
    let tallies: Vec<Tally> = getters.iter().map(|_| Tally::new()).collect();
    let w = timing.window();
    let tasks: Vec<_> = getters
        .into_iter()
        .zip(tallies)
        .enumerate()
        .map(|(caller, (mut g, mut tally))| {
            tokio::spawn(async move {
                let mut rng = Rng::new(caller, seed);
                loop {
                    let i = rng.key();
                    let t0 = Instant::now();
                    if t0 >= w.end {
                        return tally;
                    }
                    let outcome = g.get(i).await;
                    tally.record(&w, t0, Instant::now(), outcome);
                }
            })
        })
        .collect();
    let mut done = Vec::with_capacity(tasks.len());
    for task in tasks {
        done.push(task.await.expect("a measuring task panicked"));
    }
    Tally::merge_all(done)
}

/// Runs `callers` OS threads, each calling `get(i)`, until the window closes.
pub fn run_threads<F>(callers: usize, timing: Timing, seed: u64, get: F) -> Tally
where
    F: Fn(usize) -> Result<(), BoxError> + Sync,
{
    let tallies: Vec<Tally> = (0..callers).map(|_| Tally::new()).collect();
    let w = timing.window();
    let get = &get;
    thread::scope(|s| {
        let threads: Vec<_> = tallies
            .into_iter()
            .enumerate()
            .map(|(caller, mut tally)| {
                s.spawn(move || {
                    let mut rng = Rng::new(caller, seed);
                    loop {
                        let i = rng.key();
                        let t0 = Instant::now();
                        if t0 >= w.end {
                            return tally;
                        }
                        let outcome = get(i);
                        tally.record(&w, t0, Instant::now(), outcome);
                    }
                })
            })
            .collect();
        let done = threads
            .into_iter()
            .map(|t| t.join().expect("a measuring thread panicked"));
        Tally::merge_all(done.collect::<Vec<_>>())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_window_counts() {
        let t = Instant::now();
        let ms = Duration::from_millis;
        let w = Window {
            start: t + ms(10),
            end: t + ms(20),
        };
        let mut tally = Tally::new();
        tally.record(&w, t, t + ms(11), Ok(())); // started in the warm-up
        tally.record(&w, t + ms(19), t + ms(21), Ok(())); // ended after the window
        tally.record(&w, t + ms(10), t + ms(12), Ok(()));
        tally.record(&w, t + ms(12), t + ms(13), Err("miss".into()));
        tally.record(&w, t + ms(13), t + ms(14), Err("late".into()));
        assert_eq!((tally.hist.len(), tally.errors), (1, 2));
        assert_eq!(tally.first_error.as_deref(), Some("miss"));

        let other = Tally::new();
        let merged = Tally::merge_all([other, tally]);
        assert_eq!((merged.hist.len(), merged.errors), (1, 2));
        assert_eq!(merged.first_error.as_deref(), Some("miss"));
    }

    #[test]
    fn keys_cover_the_range_and_differ_per_caller() {
        let mut a = Rng::new(0, 1);
        let mut seen = vec![false; KEYS];
        for _ in 0..20 * KEYS {
            seen[a.key()] = true;
        }
        assert!(seen.iter().all(|&s| s));
        let (mut a, mut b) = (Rng::new(0, 1), Rng::new(1, 1));
        let (xs, ys): (Vec<_>, Vec<_>) = (0..8).map(|_| (a.key(), b.key())).unzip();
        assert_ne!(xs, ys);
    }

    #[test]
    fn threads_count_their_gets() {
        let timing = Timing {
            warmup: Duration::ZERO,
            duration: Duration::from_millis(50),
        };
        let tally = run_threads(3, timing, 7, |i| {
            assert!(i < KEYS);
            thread::sleep(Duration::from_millis(1));
            Ok(())
        });
        assert!(tally.hist.len() >= 3 * 10, "{}", tally.hist.len());
        assert!(tally.hist.value_at_quantile(0.5) >= 1_000_000);
        assert_eq!(tally.errors, 0);
    }
}
