//! Counters of what the cache did: relaxed atomics, cheap to bump and to read. With the
//! `metrics` feature, each bump also goes to the `metrics` recorder, from here and nowhere else
//! (the metric names are listed in the crate docs, "Metrics and traces"). The events that have
//! a beginning and an end (a load, a wait) and absorbed failures are logged here too, at DEBUG,
//! where they are counted: a subscriber sees what the counters count.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use crate::error::Error;

/// How many parts a count is split into: threads bump different parts (each on a cache line of
/// its own), so that a hit on one core does not take the line from another core's hit.
const STRIPES: usize = 8;

/// One part of a count, alone on its cache line (two lines: adjacent lines are fetched in
/// pairs).
#[derive(Debug, Default)]
#[repr(align(128))]
struct Stripe(AtomicU64);

/// One event's count (what [`Stats`] reads: the sum of its stripes) and, with the `metrics`
/// feature, the recorder's handle for the same event, registered once when the cache is built.
#[derive(Debug, Default)]
pub(crate) struct Counter {
    n: [Stripe; STRIPES],
    #[cfg(feature = "metrics")]
    metric: Option<metrics::Counter>,
}

impl Counter {
    fn load(&self) -> u64 {
        self.n
            .iter()
            .fold(0u64, |sum, s| sum.wrapping_add(s.0.load(Ordering::Relaxed)))
    }

    fn add(&self, n: u64) {
        self.n[stripe()].0.fetch_add(n, Ordering::Relaxed);
    }
}

/// This thread's stripe, given out round robin as threads first count something.
fn stripe() -> usize {
    use std::sync::atomic::AtomicUsize;
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static MINE: usize = NEXT.fetch_add(1, Ordering::Relaxed) % STRIPES;
    }
    MINE.with(|s| *s)
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
            #[cfg(feature = "metrics")]
            wait_duration: metrics::Histogram,
            #[cfg(feature = "metrics")]
            by_server: ByServer,
        }

        /// A snapshot of a cache's counters, from [`Cache::stats`](crate::Cache::stats).
        ///
        /// Counts since the cache was built, shared by every clone and every
        /// [`with_version`](crate::Cache::with_version) view of it. They count the calls made
        /// on the cache (and its loaders), never a response cache's: a
        /// `ResponseCacheLayer` over it (feature `tower`) counts its page reads and origin
        /// fills in its own `Stats`, from `ResponseCacheLayer::stats`, with the fields read the
        /// same way for pages.
        ///
        /// `Serialize` (serde): an object of the counters by field name, for a `/stats`
        /// route.
        ///
        /// ```
        /// let cache = newcache::Cache::builder().in_memory().build()?;
        /// let n: u32 = cache.get_or_set_with("k", newcache::Ttl::Default, || {
        ///     Ok::<_, std::io::Error>(1)
        /// })?;
        /// let s = cache.stats();
        /// assert_eq!((n, s.misses, s.loader_calls), (1, 1, 1));
        /// // serde: e.g. `serde_json::to_string(&s)` gives {"hits":0,"misses":1,...}.
        /// # fn is_serialize<T: serde::Serialize>(_: &T) {}
        /// # is_serialize(&s);
        /// # Ok::<(), newcache::Error>(())
        /// ```
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
        #[non_exhaustive]
        pub struct Stats {
            $($(#[$doc])* pub $name: u64,)*
        }

        impl Counters {
            /// The counters of the cache called `name` over `servers` (their addresses; none
            /// for a backend that names no server); with the `metrics` feature, their handles
            /// are registered with the recorder installed now.
            pub(crate) fn new(name: &str, servers: &[String]) -> Counters {
                Counters::labelled(name, servers, None)
            }

            /// As [`new`](Counters::new), labelled `layer=namespace` beside `cache=name` with the
            /// `metrics` feature: a response cache's counters, whose page keys are under
            /// `namespace`, series apart from the cache's own.
            pub(crate) fn labelled(name: &str, servers: &[String], layer: Option<&str>) -> Counters {
                #[cfg(not(feature = "metrics"))]
                let _ = (servers, layer);
                #[cfg(feature = "metrics")]
                let label: Vec<metrics::Label> = std::iter::once(metrics::Label::new("cache", name.to_owned()))
                    .chain(layer.map(|l| metrics::Label::new("layer", l.to_owned())))
                    .collect();
                Counters {
                    $($name: Counter {
                        n: Default::default(),
                        #[cfg(feature = "metrics")]
                        metric: handle!($($metric, label.iter())?),
                    },)*
                    name: name.into(),
                    #[cfg(feature = "metrics")]
                    load_duration: metrics::histogram!("newcache_load_duration_seconds", label.iter()),
                    #[cfg(feature = "metrics")]
                    wait_duration: metrics::histogram!("newcache_wait_seconds", label.iter()),
                    #[cfg(feature = "metrics")]
                    by_server: ByServer::new(&label, servers),
                }
            }

            pub(crate) fn snapshot(&self) -> Stats {
                let mut s = Stats { $($name: self.$name.load(),)* };
                // A near hit is counted once, in `near_hits` (one add on the hot path), and is
                // a hit.
                s.hits = s.hits.wrapping_add(s.near_hits);
                s
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
    /// Loader callers that found another caller at work on their key, whether or not they
    /// then waited: a `get_or_set_with` (or `get_or_set`, `get_or_set_with_background`, a
    /// response cache's fill) that joined a load of this process (once per join: also when
    /// the leader answers it at once with the stale value it holds while it refreshes, which a
    /// hot key's expiry does for every caller that arrives during the leader's claim), or that
    /// found another process's claim or placeholder and polled for it (once per run of the
    /// herd protocol: a call that takes over undecodable bytes runs it again). Callers
    /// that really waited, and for how long: [`waited`](Stats::waited) and
    /// [`wait_micros`](Stats::wait_micros).
    lease_waits => "newcache_lease_waits_total",
    /// Loader callers that waited for another caller's load and were answered only when it
    /// ended: a caller that polled at least once for another process's claim or placeholder,
    /// or that joined a load of this process whose leader answered it after loading (or after
    /// waiting itself), failed or gave up. Not a caller answered at once with the stale value
    /// a leader serves while it refreshes (it counts in `lease_waits` only). A caller counts
    /// once per wait: one whose leader panicked and that then waits again counts twice.
    waited => "newcache_waited_total",
    /// How long the [`waited`](Stats::waited) callers waited, in microseconds, in all (their
    /// mean wait: `wait_micros / waited`), by the process's monotonic clock (not the cache's
    /// [`Clock`](crate::Clock), so a mock clock or tokio's paused time do not advance it).
    /// With the `metrics` feature, each wait is a sample of the histogram
    /// `newcache_wait_seconds`.
    wait_micros,
    /// Loader calls: each time `get_or_set_with`, `get_or_set_with_background` or
    /// `get_many_or_set_with` (one call per batch) ran the loader it was given, because the
    /// value was missing, stale and claimed by this caller, or refreshed early. A caller served
    /// another's load runs none (it counts in `lease_waits`). A response cache's origin calls
    /// are its own `loader_calls`, not the cache's.
    loader_calls => "newcache_loads_total",
    /// Loader calls that returned an error or panicked (a call cut short because its caller's
    /// future was dropped is neither: it counts in `loader_calls` only).
    loader_errors => "newcache_load_errors_total",
    /// Recomputes started early by XFetch.
    early_refreshes => "newcache_early_refreshes_total",
    /// Stale values served because the loader failed.
    stale_on_error => "newcache_stale_on_error_total",
    /// Backend operations that failed (I/O, timeout, protocol, server error). A batch counts
    /// once, however many of its keys and servers failed (the metric
    /// `newcache_backend_errors_total{server}` counts it once per failed server).
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
    /// Loaded values too large to cache: returned to their callers, not stored (a "not
    /// storable" marker is stored instead, for a while).
    too_large => "newcache_too_large_total",
    /// Loads run at once, unclaimed and unstored, because the key holds a "not storable"
    /// marker (the last load's value was too large to cache): nobody waited for them.
    not_storable_loads => "newcache_not_storable_loads_total",
    /// Deletes replayed on memcached or Redis servers that came back, before they served
    /// again: keys this process invalidated while it could not reach them (the README's
    /// "Invalidations survive an outage"), each deleted there or found missing (a delete the
    /// server or its proxy refused with an error reply is passed over, not counted).
    replayed_deletes,
    /// Keys not recorded for replay because their server's record was full
    /// (`replay_capacity`): that server's values from before are judged stale instead.
    replay_overflows,
    /// Replays that failed part way (a server that went away again): their keys are kept
    /// for the next attempt, and the server serves nothing before it.
    replays_failed,
    /// Reads answered from the near tier ([`near_cache`](crate::CacheBuilder::near_cache)):
    /// fresh copies in this process's memory, no I/O. Counted in [`hits`](Stats::hits) too
    /// (the metric `newcache_hits_total` counts the shared store's hits only: add
    /// `newcache_near_hits_total` to it).
    near_hits => "newcache_near_hits_total",
    /// Reads of a cache with a near tier that it could not answer (no copy, or one too old,
    /// stale, or written since): they went to the shared store.
    near_misses => "newcache_near_misses_total",
    /// Copies not filled: too large for the near tier, or written by this process while the
    /// read that would have filled it was in flight.
    near_refused => "newcache_near_refused_total",
    /// Copies evicted to keep the near tier within its capacity.
    near_evictions => "newcache_near_evictions_total",
    /// Copies served past the near ttl because the shared store did not answer (within their
    /// staleness bound, with [`serve_stale_on_error`](crate::CacheBuilder::serve_stale_on_error)).
    near_outage_served => "newcache_near_outage_served_total",
    /// Messages this cache handed to its bus ([`near_bus`](crate::CacheBuilder::near_bus)):
    /// its writes' keys (batched), flushes and heartbeats (one the transport could not send
    /// is counted too: the receivers see it missing).
    bus_sent => "newcache_bus_sent_total",
    /// Messages this cache heard from other caches on its bus.
    bus_received => "newcache_bus_received_total",
    /// Keys whose near copies this cache dropped because another cache announced a write.
    bus_keys_dropped => "newcache_bus_keys_dropped_total",
    /// Announcements of another cache this cache did not hear, seen at that cache's next
    /// message: each stops every copy read before it from being served as a hit.
    bus_gaps => "newcache_bus_gaps_total",
    /// Times this cache's bus stopped every near copy from being served as a hit: another
    /// cache's `clear`, or a possible loss while the bus was healthy (a missed announcement, a
    /// silent cache, a broken subscription, its own messages not heard back).
    bus_flushes => "newcache_bus_flushes_total",
    /// Times the bus's subscription broke and came back.
    bus_reconnects => "newcache_bus_reconnects_total",
    /// Heartbeats missed: another cache silent for three heartbeats, or this cache's own
    /// messages not heard back for as long.
    bus_heartbeats_missed => "newcache_bus_heartbeats_missed_total",
}

/// Events of one batch counted in place and added to `counter` once, when the tally is
/// dropped (however the batch ends: a returned error or a dropped future counts what it did):
/// one atomic add per batch instead of one per key.
pub(crate) struct Tally<'c> {
    counter: &'c Counter,
    n: u64,
}

impl<'c> Tally<'c> {
    pub(crate) fn new(counter: &'c Counter) -> Tally<'c> {
        Tally { counter, n: 0 }
    }

    pub(crate) fn bump(&mut self) {
        self.n += 1;
    }
}

impl Drop for Tally<'_> {
    fn drop(&mut self) {
        if self.n > 0 {
            Counters::add(self.counter, self.n);
        }
    }
}

impl Counters {
    pub(crate) fn bump(counter: &Counter) {
        Counters::add(counter, 1);
    }

    /// `n` events at once (one atomic add; a batch's [`Tally`]).
    pub(crate) fn add(counter: &Counter, n: u64) {
        counter.add(n);
        #[cfg(feature = "metrics")]
        if let Some(m) = &counter.metric {
            m.increment(n);
        }
    }

    /// One failed backend operation: counted, and with the `metrics` feature counted again
    /// under its server's address (`server` label; `unknown` for an error that names no server
    /// the cache was built with).
    pub(crate) fn backend_error(&self, e: &Error) {
        Counters::bump(&self.backend_errors);
        #[cfg(feature = "metrics")]
        self.by_server.of(e).1.increment(1);
        #[cfg(not(feature = "metrics"))]
        let _ = e;
    }

    /// One failed backend operation that failed on several servers (a batch; `errors` holds
    /// its keys' errors, several per server perhaps): counted once in [`Stats`], and with the
    /// `metrics` feature once under each server that failed.
    pub(crate) fn batch_failed<'e>(&self, errors: impl IntoIterator<Item = &'e Error>) {
        Counters::bump(&self.backend_errors);
        #[cfg(feature = "metrics")]
        self.by_server.count(errors);
        #[cfg(not(feature = "metrics"))]
        drop(errors);
    }

    /// A backend failure the failure policy absorbed (a read served as a miss, a write
    /// skipped): counted in `backend_errors_absorbed` and logged at DEBUG with its error.
    pub(crate) fn absorbed(&self, e: &Error) {
        Counters::bump(&self.backend_errors_absorbed);
        tracing::debug!(error = %e, "newcache: backend failure absorbed (a read is a miss, a write is skipped)");
    }

    /// A loader call starts: counted in `loader_calls` now; its end is recorded when the
    /// returned [`LoadCall`] finishes or is dropped.
    pub(crate) fn load_started(&self) -> LoadCall<'_> {
        Counters::bump(&self.loader_calls);
        tracing::debug!("newcache: load started");
        LoadCall {
            counters: self,
            started: Instant::now(),
            in_loader: AtomicBool::new(false),
            finished: false,
        }
    }
}

/// The per-server handles of `newcache_backend_errors_total`, registered when the cache is
/// built, so the error path neither looks up the registry nor allocates a label, and counts in
/// the recorder the cache was built with.
#[cfg(feature = "metrics")]
#[derive(Debug)]
struct ByServer {
    /// The configured servers' addresses and handles, in configuration order.
    servers: Vec<(Box<str>, metrics::Counter)>,
    /// For an error that names no configured server (a custom backend's, a memory backend's).
    unknown: metrics::Counter,
}

#[cfg(feature = "metrics")]
impl ByServer {
    fn new(labels: &[metrics::Label], servers: &[String]) -> ByServer {
        let handle = |server: &str| {
            let labels: Vec<metrics::Label> = labels
                .iter()
                .cloned()
                .chain([metrics::Label::new("server", server.to_owned())])
                .collect();
            metrics::counter!("newcache_backend_errors_total", labels)
        };
        ByServer {
            servers: servers
                .iter()
                .map(|s| (Box::from(s.as_str()), handle(s)))
                .collect(),
            unknown: handle("unknown"),
        }
    }

    /// The handle of the server `e` names (`unknown` if none the cache was built with), and
    /// its index (0 for `unknown`).
    fn of(&self, e: &Error) -> (usize, &metrics::Counter) {
        e.server()
            .and_then(|s| self.servers.iter().position(|(a, _)| &**a == s))
            .map_or((0, &self.unknown), |i| (i + 1, &self.servers[i].1))
    }

    /// Counts one failure per server named among `errors` (and `unknown` at most once).
    fn count<'e>(&self, errors: impl IntoIterator<Item = &'e Error>) {
        let mut errors = errors.into_iter();
        let Some(first) = errors.next() else { return };
        let (i, handle) = self.of(first);
        handle.increment(1);
        // A batch that failed on one server (the common case) allocates nothing more.
        let mut seen: Vec<bool> = Vec::new();
        for e in errors {
            let (j, handle) = self.of(e);
            if j == i {
                continue;
            }
            if seen.is_empty() {
                seen = vec![false; self.servers.len() + 1];
                seen[i] = true;
            }
            if !std::mem::replace(&mut seen[j], true) {
                handle.increment(1);
            }
        }
    }
}

/// One loader call in progress ([`Counters::load_started`]). Finished with
/// [`finished`](LoadCall::finished), or dropped before: the loader panicked (counted as a load
/// error) or the caller's future was dropped mid-load (a cancelled load, not an error). Every
/// call records one `newcache_load_duration_seconds` sample, however it ends, so the
/// histogram's count is `newcache_loads_total`.
pub(crate) struct LoadCall<'a> {
    counters: &'a Counters,
    started: Instant,
    /// Set while the loader runs (made, or polled): still set when the call is dropped, the
    /// loader unwound out of it. An atomic only so that the caller's future stays `Send`.
    in_loader: AtomicBool,
    finished: bool,
}

impl LoadCall<'_> {
    /// Runs the loader: `make` makes its future (a sync loader runs in `make`), and the future
    /// returned polls it, noting when a panic unwinds out of either.
    pub(crate) fn run<F: Future>(
        &self,
        make: impl FnOnce() -> F,
    ) -> impl Future<Output = F::Output> {
        self.in_loader.store(true, Ordering::Relaxed);
        let work = make();
        self.in_loader.store(false, Ordering::Relaxed);
        async move {
            let mut work = std::pin::pin!(work);
            std::future::poll_fn(|cx| {
                self.in_loader.store(true, Ordering::Relaxed);
                let r = work.as_mut().poll(cx);
                self.in_loader.store(false, Ordering::Relaxed);
                r
            })
            .await
        }
    }

    /// The loader returned: `ok` or an error (counted in `loader_errors`).
    pub(crate) fn finished(mut self, ok: bool) {
        self.finished = true;
        self.end(!ok);
    }

    fn end(&self, failed: bool) {
        if failed {
            Counters::bump(&self.counters.loader_errors);
        }
        let took = self.started.elapsed();
        tracing::debug!(
            ok = !failed,
            ms = took.as_millis() as u64,
            "newcache: load finished"
        );
        #[cfg(feature = "metrics")]
        self.counters.load_duration.record(took.as_secs_f64());
    }

    /// When the call started.
    pub(crate) fn started(&self) -> Instant {
        self.started
    }
}

impl Drop for LoadCall<'_> {
    fn drop(&mut self) {
        if !self.finished {
            // Unwound out of the loader: it panicked. Otherwise the call was cancelled.
            self.end(self.in_loader.load(Ordering::Relaxed));
        }
    }
}

impl Counters {
    /// A loader caller starts waiting for another caller's load; the wait is counted in
    /// [`Stats::waited`] when the returned [`Wait`] is dropped (the caller was answered, or
    /// went away), unless it turns out the caller was [answered at once](Wait::answered_at_once).
    pub(crate) fn wait_started(&self) -> Wait<'_> {
        Wait {
            counters: self,
            started: Instant::now(),
            counted: true,
        }
    }
}

/// A wait for another caller's load in progress ([`Counters::wait_started`]).
pub(crate) struct Wait<'a> {
    counters: &'a Counters,
    started: Instant,
    counted: bool,
}

impl Wait<'_> {
    /// The caller was answered with a value that was already there (a leader's stale value,
    /// served while it refreshes): no wait for a load, nothing counted.
    pub(crate) fn answered_at_once(mut self) {
        self.counted = false;
    }
}

impl Drop for Wait<'_> {
    fn drop(&mut self) {
        if !self.counted {
            return;
        }
        let took = self.started.elapsed();
        Counters::bump(&self.counters.waited);
        Counters::add(
            &self.counters.wait_micros,
            u64::try_from(took.as_micros()).unwrap_or(u64::MAX),
        );
        tracing::debug!(
            ms = took.as_millis() as u64,
            "newcache: waited for another caller's load"
        );
        #[cfg(feature = "metrics")]
        self.counters.wait_duration.record(took.as_secs_f64());
    }
}
