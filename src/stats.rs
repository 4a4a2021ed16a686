//! Counters of what the cache did: relaxed atomics, cheap to bump and to read. With the
//! `metrics` feature, each bump also goes to the `metrics` recorder, from here and nowhere else
//! (the metric names are listed in the crate docs, "Metrics and traces").

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::error::Error;

/// One event's count (what [`Stats`] reads) and, with the `metrics` feature, the recorder's
/// handle for the same event, registered once when the cache is built.
#[derive(Debug, Default)]
pub(crate) struct Counter {
    n: AtomicU64,
    #[cfg(feature = "metrics")]
    metric: Option<metrics::Counter>,
}

impl Counter {
    fn load(&self) -> u64 {
        self.n.load(Ordering::Relaxed)
    }
}

/// A counter's recorder handle: none for a counter exported otherwise (or not at all).
#[cfg(feature = "metrics")]
macro_rules! handle {
    () => {
        None
    };
    ($metric:literal, $labels:expr) => {
        Some(metrics::counter!($metric, $labels))
    };
}

macro_rules! stats {
    ($($(#[$doc:meta])* $name:ident $(=> $metric:literal)?),* $(,)?) => {
        #[derive(Debug)]
        pub(crate) struct Counters {
            $(pub(crate) $name: Counter,)*
            /// The cache's name (the `cache` label of its metrics and its spans' `cache` field).
            pub(crate) name: std::sync::Arc<str>,
            #[cfg(feature = "metrics")]
            load_duration: metrics::Histogram,
        }

        /// A snapshot of a cache's counters, from [`Cache::stats`](crate::Cache::stats).
        ///
        /// Counts since the cache was built, shared by every clone and every
        /// [`with_version`](crate::Cache::with_version) view of it.
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        #[non_exhaustive]
        pub struct Stats {
            $($(#[$doc])* pub $name: u64,)*
        }

        impl Counters {
            /// The counters of the cache called `name`; with the `metrics` feature, their
            /// handles are registered with the recorder installed now.
            pub(crate) fn new(name: &str) -> Counters {
                #[cfg(feature = "metrics")]
                let label = [metrics::Label::new("cache", name.to_owned())];
                Counters {
                    $($name: Counter {
                        n: AtomicU64::new(0),
                        #[cfg(feature = "metrics")]
                        metric: handle!($($metric, label.iter())?),
                    },)*
                    name: name.into(),
                    #[cfg(feature = "metrics")]
                    load_duration: metrics::histogram!("newcache_load_duration_seconds", label.iter()),
                }
            }

            pub(crate) fn snapshot(&self) -> Stats {
                Stats { $($name: self.$name.load(),)* }
            }
        }
    };
}

stats! {
    /// Reads that returned a fresh value.
    hits => "newcache_hits_total",
    /// Reads that found nothing (or a value the reader claimed to recompute).
    misses => "newcache_misses_total",
    /// Reads that returned a stale value while another caller recomputes it.
    stale_served => "newcache_stale_served_total",
    /// Stale (or early-refresh) entries this process claimed: each is one recompute.
    claims_won => "newcache_claims_total",
    /// Callers that waited for another caller's load (in this process, or a placeholder or
    /// claim of another process).
    lease_waits => "newcache_lease_waits_total",
    /// Loader calls made by `get_or_set_with` and friends.
    loader_calls => "newcache_loads_total",
    /// Loader calls that returned an error or panicked.
    loader_errors => "newcache_load_errors_total",
    /// Recomputes started early by XFetch.
    early_refreshes => "newcache_early_refreshes_total",
    /// Stale values served because the loader failed.
    stale_on_error => "newcache_stale_on_error_total",
    /// Backend operations that failed (I/O, timeout, protocol, server error). A batch counts
    /// once, however many of its keys failed.
    backend_errors,
    /// Backend errors absorbed as misses or skipped writes by the failure policy.
    backend_errors_absorbed => "newcache_backend_errors_absorbed_total",
    /// Items whose bytes could not be decoded.
    decode_errors => "newcache_decode_errors_total",
    /// Items of a newer envelope format (written by a newer newcache), read as misses.
    newer_format => "newcache_newer_format_total",
    /// `get_or_set_with` calls that gave up after `max_wait` waiting for another caller's load.
    wait_timeouts => "newcache_wait_timeouts_total",
    /// Loads whose result was not stored because the key was written, deleted or taken over
    /// while they ran (the newer state was kept).
    loads_superseded => "newcache_loads_superseded_total",
    /// Loaded values too large to cache: returned to their callers, not stored.
    too_large => "newcache_too_large_total",
}

impl Counters {
    pub(crate) fn bump(counter: &Counter) {
        counter.n.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        if let Some(m) = &counter.metric {
            m.increment(1);
        }
    }

    /// One failed backend operation: counted, and with the `metrics` feature counted again
    /// under its server's address (`server` label; `unknown` for an error that names none).
    /// On the error path only, so the per-server handle is looked up here, each time.
    pub(crate) fn backend_error(&self, e: &Error) {
        Counters::bump(&self.backend_errors);
        #[cfg(feature = "metrics")]
        metrics::counter!(
            "newcache_backend_errors_total",
            "cache" => self.name.to_string(),
            "server" => e.server().unwrap_or("unknown").to_owned()
        )
        .increment(1);
        #[cfg(not(feature = "metrics"))]
        let _ = e;
    }

    /// A loader call that started at `started` has returned (with a value or an error).
    pub(crate) fn load_finished(&self, started: Instant) {
        #[cfg(feature = "metrics")]
        self.load_duration.record(started.elapsed().as_secs_f64());
        #[cfg(not(feature = "metrics"))]
        let _ = started;
    }
}
