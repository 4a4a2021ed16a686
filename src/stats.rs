//! Counters of what the cache did: relaxed atomics, cheap to bump and to read.

use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! stats {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        #[derive(Debug, Default)]
        pub(crate) struct Counters {
            $(pub(crate) $name: AtomicU64,)*
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
            pub(crate) fn snapshot(&self) -> Stats {
                Stats { $($name: self.$name.load(Ordering::Relaxed),)* }
            }
        }
    };
}

stats! {
    /// Reads that returned a fresh value.
    hits,
    /// Reads that found nothing (or a value the reader claimed to recompute).
    misses,
    /// Reads that returned a stale value while another caller recomputes it.
    stale_served,
    /// Stale (or early-refresh) entries this process claimed: each is one recompute.
    claims_won,
    /// Callers that waited for another caller's load (in this process, or a placeholder or
    /// claim of another process).
    lease_waits,
    /// Loader calls made by `get_or_set_with` and friends.
    loader_calls,
    /// Loader calls that returned an error or panicked.
    loader_errors,
    /// Recomputes started early by XFetch.
    early_refreshes,
    /// Stale values served because the loader failed.
    stale_on_error,
    /// Backend operations that failed (I/O, timeout, protocol, server error). A batch counts
    /// once, however many of its keys failed.
    backend_errors,
    /// Backend errors absorbed as misses or skipped writes by the failure policy.
    backend_errors_absorbed,
    /// Items whose bytes could not be decoded.
    decode_errors,
    /// Items of a newer envelope format (written by a newer newcache), read as misses.
    newer_format,
    /// `get_or_set_with` calls that gave up after `max_wait` waiting for another caller's load.
    wait_timeouts,
    /// Loads whose result was not stored because the key was written, deleted or taken over
    /// while they ran (the newer state was kept).
    loads_superseded,
    /// Loaded values too large to cache: returned to their callers, not stored.
    too_large,
}

impl Counters {
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}
