//! The typed facade: `Cache` turns user keys and serde values into derived keys and envelopes,
//! and drives the herd protocol ([`protocol`](crate::protocol)) on the backend's bytes.

mod counters;
pub(crate) mod io;
mod near;
pub(crate) mod policy;
pub(crate) mod read;
mod write;

use std::cell::Cell;
use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::Mutex;
use std::time::Instant;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::key::KeyMaker;
use crate::loader::coalesce::Coalescer;
use crate::loader::lease::Renewer;
use crate::ping::PingError;
use crate::protocol::{Now, Settings};
use crate::rng::Rng;
use crate::stats::{Counters, Stats};

pub use self::policy::{DecodePolicy, FailurePolicy, Herd};

/// How many derived keys a cache remembers having warned about (a value too large to cache):
/// each is logged once; past this many, further keys are counted in `Stats::too_large` only
/// (a bound on the memory and on the log).
const WARNED_KEYS: usize = 4096;

/// What every clone and version view of a cache shares.
pub(crate) struct Inner {
    /// The settings it was built with (`keys` there is the builder's; views carry their own).
    pub(crate) config: Config,
    pub(crate) coalescer: Coalescer,
    pub(crate) renewer: Renewer,
    pub(crate) rng: Rng,
    /// The origin of the monotonic times handed to the protocol.
    started: Instant,
    /// The derived keys whose loaded value was logged as too large to cache (each once), up
    /// to [`WARNED_KEYS`].
    warned_too_large: Mutex<HashSet<String>>,
    /// Whether a batch's keys on a server without CAS were logged yet (once).
    pub(crate) warned_no_cas: AtomicBool,
    /// The near tier, if the builder asked for one: its backends above are then fenced
    /// (`near::fence`), so that every write drops its key's copies.
    pub(crate) near: Option<crate::near::Near>,
    /// What the async views of this cache use (`AsyncCache`, however made: `build_async`,
    /// `Cache::to_async`): one engine, one count of background refreshes.
    #[cfg(feature = "tokio")]
    pub(crate) async_io: AsyncIo,
}

/// The async front end's own I/O and bookkeeping, in the core so that every async view of a
/// cache shares them.
#[cfg(feature = "tokio")]
pub(crate) struct AsyncIo {
    /// The same store as the sync backend's: itself (memory, custom), or the pipelined engine
    /// over the same servers with the same health records.
    pub(crate) backend: Arc<dyn crate::backend::AsyncBackend>,
    /// Background refreshes running (`get_or_set_with_background`), for `shutdown`.
    pub(crate) background: std::sync::atomic::AtomicUsize,
    pub(crate) drained: tokio::sync::Notify,
}

/// A typed, herd-safe cache.
///
/// A cheap handle: cloning it clones an `Arc`, and every clone shares the backend, its connection
/// pools and the stats. Build one per application with [`Cache::builder`] and hand clones to every
/// thread. `Cache` is `Send + Sync`. It never needs an async runtime, and may be called from
/// inside one through `tokio::task::spawn_blocking` (its calls block).
///
/// For async code, take its async view with [`to_async`](Cache::to_async) (feature `tokio`):
/// the same cache (store, stats, coalescer, keys, servers' health) with `async` methods and I/O
/// of its own.
///
/// ```
/// use std::time::Duration;
/// use newcache::{Cache, Ttl};
///
/// let cache = Cache::builder().in_memory().flavor("prod").build()?;
/// cache.set("greeting", "hello", Ttl::Default)?;
/// assert_eq!(cache.get::<String>("greeting")?.as_deref(), Some("hello"));
/// assert_eq!(cache.make_key("foo"), "prod-1-0beec7b5ea3f0fdbc95d0dd47f3c5bc275da8a33");
/// # Ok::<(), newcache::Error>(())
/// ```
#[derive(Clone)]
pub struct Cache {
    pub(crate) inner: Arc<Inner>,
    pub(crate) keys: KeyMaker,
    /// Where this handle's operations are counted: the cache's counters, shared by its clones
    /// and version views; a response cache's handle counts in the layer's own.
    pub(crate) stats: Arc<Counters>,
}

impl fmt::Debug for Cache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cache")
            .field("keys", &self.keys)
            .field("backend", &self.inner.config.backend)
            .field("default_ttl", &self.inner.config.default_ttl)
            .field("herd_timeout", &self.inner.config.herd_timeout)
            .finish_non_exhaustive()
    }
}

impl Cache {
    /// A cache from validated settings (what [`CacheBuilder::build`](crate::CacheBuilder::build)
    /// makes).
    pub(crate) fn from_config(mut config: Config) -> Cache {
        let stats = Arc::new(Counters::new(&config.name, &config.servers));
        // Every cache's writes are fenced, with a near tier or not: a near tier of another
        // cache over the same store in this process must see them (a store private to this
        // cache is fenced only for its own near tier).
        let fenced = !config.private_store || config.near.is_some() || config.bus.is_some();
        let domain =
            fenced.then(|| crate::near::fence::Domain::of(&config.servers, &config.backend));
        let mut bus_gate = None;
        if let Some(domain) = &domain {
            let station = config.bus.clone().map(|bus| {
                let station = crate::near::bus::Station::join(
                    bus,
                    domain,
                    config.bus_heartbeat,
                    config.bus_wait,
                    stats.clone(),
                    config.near.is_some(),
                );
                // Serve no copy before the bus is known to carry this cache's messages; wait
                // for that a little (a transport that connects), not for a bus that is down.
                if !station.wait_healthy(config.bus_wait) {
                    tracing::warn!(
                        "newcache: the bus does not carry this cache's messages yet (waited \
                         {:?}); its near tier serves no hits until it does",
                        config.bus_wait
                    );
                }
                bus_gate = Some(station.gate());
                Arc::new(station)
            });
            #[cfg(feature = "tokio")]
            let settle = config.write_settle.max(config.async_backend.settle_time());
            #[cfg(not(feature = "tokio"))]
            let settle = config.write_settle;
            // One fence for both wrappers: the sync and async writes of this cache bump the
            // same stripes and announce on the same bus.
            let fence = Arc::new(crate::near::fence::Fence {
                domain: domain.clone(),
                settle,
                station,
            });
            #[cfg(feature = "tokio")]
            {
                config.async_backend = Arc::new(crate::near::fence::FencedAsync {
                    inner: config.async_backend.clone(),
                    fence: fence.clone(),
                });
            }
            config.backend = Arc::new(crate::near::fence::Fenced {
                inner: config.backend.clone(),
                fence,
            });
        }
        let near = config.near.clone().zip(domain).map(|(settings, domain)| {
            use crate::near::{Near, clock::NearClock};
            let clock = NearClock::new(config.custom_clock.then(|| config.clock.clone()));
            Near::new(
                &settings,
                domain,
                clock,
                stats.clone(),
                config.early_beta,
                bus_gate,
            )
        });
        let renewer = Renewer::new(config.backend.clone(), config.clock.clone());
        let rng = Rng::new(config.seed);
        let keys = config.keys.clone();
        #[cfg(feature = "tokio")]
        let async_io = AsyncIo {
            backend: config.async_backend.clone(),
            background: std::sync::atomic::AtomicUsize::new(0),
            drained: tokio::sync::Notify::new(),
        };
        Cache {
            inner: Arc::new(Inner {
                config,
                coalescer: Coalescer::default(),
                renewer,
                rng,
                started: Instant::now(),
                warned_too_large: Mutex::default(),
                warned_no_cas: AtomicBool::new(false),
                near,
                #[cfg(feature = "tokio")]
                async_io,
            }),
            keys,
            stats,
        }
    }

    /// The memcached key a user key maps to: `{flavor}-{version}-{sha1 hex}` by default.
    pub fn make_key(&self, key: &str) -> String {
        self.keys.make_unchecked(key)
    }

    /// A cache on the same backend (and stats) whose keys use another version. Bumping the
    /// version makes every key written under the old one unreachable.
    pub fn with_version(&self, version: u64) -> Cache {
        let mut keys = self.keys.clone();
        keys.version = version;
        Cache {
            inner: self.inner.clone(),
            keys,
            stats: self.stats.clone(),
        }
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> Stats {
        let mut stats = self.stats.snapshot();
        self.inner.config.backend.report(&mut stats);
        stats
    }

    /// Asks every server whether it answers: a readiness check (a `/healthz` route).
    ///
    /// `Ok(())` when every server answered; otherwise a [`PingError`] naming each server that
    /// did not, with its error. Each server is asked for [`PING_KEY`](crate::PING_KEY) with a
    /// `get` (a miss is an answer), all in one round: connections are opened (or taken from
    /// the pool) server by server, then every request is written and every reply read under
    /// one `io_timeout`. So a refused server fails at once, hung servers (they accept and
    /// never answer) cost one `io_timeout` between them, and only a server that swallows
    /// connects costs its own `connect_timeout`. A server marked dead fails at once until it
    /// is due for a probe; then the ping is that probe.
    ///
    /// - **memory**: always answers.
    /// - **twemproxy** (or another proxy): the configured address is the proxy's, and a `get`
    ///   is one of the few commands twemproxy forwards, so a ping checks the proxy *and* the
    ///   one memcached server behind it that `PING_KEY` maps to, not the others.
    /// - **a custom [`Backend`](crate::Backend)**: its [`ping`](crate::Backend::ping), by
    ///   default one `get`.
    ///
    /// A ping's failures are its answer: they are not counted in [`stats`](Cache::stats) or in
    /// the metrics.
    ///
    /// ```
    /// let cache = newcache::Cache::builder().in_memory().build()?;
    /// assert!(cache.ping().is_ok());
    /// # Ok::<(), newcache::Error>(())
    /// ```
    ///
    /// # Errors
    /// A [`PingError`] listing the servers that did not answer.
    pub fn ping(&self) -> std::result::Result<(), PingError> {
        let span = tracing::debug_span!("newcache", op = "ping", cache = &*self.stats.name);
        let _entered = span.enter();
        self.inner.config.backend.ping()
    }

    /// The span of one operation on derived key `key`: DEBUG, named `newcache`, with the
    /// operation, the cache's name, the key and a `server` the backend records when it picks
    /// one (`backend::note_server`). Unless a subscriber wants it, the span is disabled: no
    /// field is evaluated and nothing is allocated.
    pub(crate) fn span(&self, op: &'static str, key: &str) -> tracing::Span {
        tracing::debug_span!(
            "newcache",
            op,
            cache = &*self.stats.name,
            key,
            server = tracing::field::Empty
        )
    }

    /// The span of a batch (or of `clear`): the number of keys instead of each key.
    pub(crate) fn batch_span(&self, op: &'static str, keys: usize) -> tracing::Span {
        tracing::debug_span!("newcache", op, cache = &*self.stats.name, keys)
    }

    /// The sync backend as the facade's [`io::Io`].
    pub(crate) fn blocking(&self) -> io::Blocking<'_> {
        io::Blocking(&*self.inner.config.backend)
    }

    pub(crate) fn now_ms(&self) -> u64 {
        self.inner.config.clock.now_ms()
    }

    /// The times the protocol is told.
    pub(crate) fn now(&self) -> Now {
        self.now_at(Instant::now())
    }

    /// [`now`](Cache::now), its monotonic part read at `instant` (a clock read the caller
    /// shares).
    pub(crate) fn now_at(&self, instant: Instant) -> Now {
        Now {
            wall_ms: self.now_ms(),
            mono_ms: instant
                .saturating_duration_since(self.inner.started)
                .as_millis() as u64,
        }
    }

    /// The protocol's settings for one call; `xfetch`: a loader's call (it may refresh early, and
    /// wait); `max_value`: the backend's limit for the call's key (`Io::max_value_size`).
    pub(crate) fn settings(&self, xfetch: bool, max_value: usize) -> Settings {
        let i = &self.inner;
        Settings {
            herd_ms: i.config.herd_timeout.as_millis() as u64,
            lease_ms: i.config.lease_ttl.as_millis() as u64,
            max_wait_ms: i.config.max_wait.as_millis() as u64,
            max_load_ms: i.config.max_load_time.as_millis() as u64,
            xfetch: match (xfetch, i.config.early_beta) {
                (true, Some(beta)) => Some(crate::herd::Xfetch {
                    beta,
                    draw: i.rng.draw(),
                }),
                _ => None,
            },
            // Only a loader's call waits (a `get` never does): no draw on the read path.
            jitter: if xfetch { self.jitter() } else { 0 },
            max_value,
        }
    }

    /// A claim token, unique among concurrent claimants of every process with overwhelming
    /// probability, whatever [`random_seed`](crate::CacheBuilder::random_seed) says: two
    /// processes built with one seed must never elect two loaders. Drawn from a per-thread
    /// stream seeded once from OS entropy, the process id and the clock (never from the cache's
    /// seed), so the read path touches no shared state for it.
    pub(crate) fn token(&self) -> u64 {
        thread_local! {
            static STATE: Cell<u64> = const { Cell::new(0) };
        }
        STATE.with(|s| {
            let mut x = s.get();
            if x == 0 {
                x = crate::rng::entropy() | 1;
            }
            x = crate::rng::xorshift(x);
            s.set(x);
            x
        })
    }

    /// The seed of a waiting machine's jitter: a per-thread stream started from the cache's
    /// random source (seeded by `random_seed`), so that a seeded cache's waits are
    /// reproducible on one thread; distinct threads start at distinct points.
    fn jitter(&self) -> u64 {
        static THREADS: AtomicU64 = AtomicU64::new(0);
        thread_local! {
            static STATE: Cell<u64> = const { Cell::new(0) };
        }
        STATE.with(|s| {
            let mut x = s.get();
            if x == 0 {
                let n = THREADS.fetch_add(1, Ordering::Relaxed);
                x = Rng::new(self.inner.rng.next_u64() ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15))
                    .next_u64()
                    | 1;
            }
            x = crate::rng::xorshift(x);
            s.set(x);
            x
        })
    }

    /// Applies the read failure policy: `Ok(None)` for an absorbed backend error.
    pub(crate) fn absorb_read<T>(&self, r: Result<T>) -> Result<Option<T>> {
        self.absorb(r, self.inner.config.read_failures)
    }

    pub(crate) fn absorb_write<T>(&self, r: Result<T>) -> Result<Option<T>> {
        self.absorb(r, self.inner.config.write_failures)
    }

    /// A loaded value too large for the backend, under derived key `derived` (user key
    /// `key`): returned to the callers, not cached (a "not storable" marker takes its place);
    /// counted every time, logged at WARN once per derived key (up to [`WARNED_KEYS`] keys).
    /// The warning names the derived key only (user keys may hold personal data): the user key
    /// is logged at DEBUG, and [`Cache::make_key`] maps a user key to its derived key.
    pub(crate) fn loaded_too_large(&self, derived: &str, key: &str, len: usize) {
        Counters::bump(&self.stats.too_large);
        let limit = self.inner.config.backend.max_value_size(derived);
        tracing::debug!(
            key,
            derived,
            bytes = len,
            limit,
            "newcache: a loaded value is too large to cache"
        );
        let first = {
            let mut warned = self.inner.warned_too_large.lock();
            match warned.len() {
                n if n < WARNED_KEYS => warned.insert(derived.to_string()).then_some(n),
                _ => None,
            }
        };
        match first {
            Some(n) if n + 1 == WARNED_KEYS => tracing::warn!(
                derived,
                bytes = len,
                limit,
                "newcache: a loaded value is too large to cache; it is returned but not stored, \
                 and its callers load it themselves for a while (counted in Stats::too_large; \
                 this is the last key logged: {WARNED_KEYS} keys were; Cache::make_key maps a \
                 user key to its derived key, logged with it at DEBUG)"
            ),
            Some(_) => tracing::warn!(
                derived,
                bytes = len,
                limit,
                "newcache: a loaded value is too large to cache; it is returned but not stored, \
                 and its callers load it themselves for a while (counted in Stats::too_large; \
                 logged once per key; Cache::make_key maps a user key to its derived key, \
                 logged with it at DEBUG)"
            ),
            None => {}
        }
    }

    /// The "not storable" marker a holder stores in place of a value too large to cache,
    /// meant to live `life` ([`protocol::not_storable`](crate::protocol::not_storable)).
    pub(crate) fn not_storable_marker(&self, life: crate::ttl::Lifetime) -> (Vec<u8>, u32) {
        crate::protocol::not_storable(self.now_ms(), life)
    }

    /// Per-key results of a batch under `policy`. Under `Absorb` a key whose server failed is
    /// `None` (and counted), and the other keys keep their results: one dead server costs only
    /// its own keys. Under `Propagate`, or for a failure no policy absorbs, the batch is an error
    /// that names every failed key ([`Error::failed_keys`]), `name(i)` being the caller's i-th key.
    pub(crate) fn absorb_each<T>(
        &self,
        results: Vec<Result<T>>,
        policy: FailurePolicy,
        name: impl Fn(usize) -> String,
    ) -> Result<Vec<Option<T>>> {
        let total = results.len();
        let mut failed = Vec::new();
        let mut first: Option<Error> = None;
        let mut by_server: Vec<Error> = Vec::new();
        let mut fatal = false;
        // Mapped in place (`collect` reuses the results' buffer): batches run this per call.
        let out: Vec<Option<T>> = results
            .into_iter()
            .enumerate()
            .map(|(i, r)| match r {
                Ok(v) => Some(v),
                // A value over the item size (another client wrote it, or a server's limit is
                // lower than ours) is that key's problem alone: a counted miss for reads, a
                // failed key for writes, under either policy.
                Err(e) if e.is_too_large() => {
                    Counters::bump(&self.stats.too_large);
                    failed.push(name(i));
                    None
                }
                Err(e) => {
                    fatal |= !e.is_backend() || policy == FailurePolicy::Propagate;
                    failed.push(name(i));
                    // One backend error per failed server, for the per-server metric.
                    if e.is_backend() && !by_server.iter().any(|b| b.server() == e.server()) {
                        by_server.push(e.clone());
                    }
                    first.get_or_insert(e);
                    None
                }
            })
            .collect();
        let Some(e) = first else {
            return Ok(out);
        };
        // One failed batch counts once in `stats()`, however many keys its failed servers
        // held; the metric counts it once under each failed server.
        if !by_server.is_empty() {
            self.stats.batch_failed(&by_server);
            if !fatal {
                self.stats.absorbed(&e);
            }
        }
        if fatal {
            Err(Error::partial(failed, total, e))
        } else {
            Ok(out)
        }
    }

    fn absorb<T>(&self, r: Result<T>, policy: FailurePolicy) -> Result<Option<T>> {
        match r {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.is_backend() => {
                self.stats.backend_error(&e);
                if policy == FailurePolicy::Absorb {
                    self.stats.absorbed(&e);
                    Ok(None)
                } else {
                    Err(e)
                }
            }
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::WARNED_KEYS;

    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn too_large_is_warned_once_per_key_up_to_a_bound() {
        let cache = super::Cache::builder().in_memory().build().unwrap();
        let buf = Buf::default();
        let writer = buf.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::WARN)
            .with_writer(move || writer.clone())
            .finish();
        crate::test_support::scoped(subscriber, || {
            for _ in 0..2 {
                for i in 0..WARNED_KEYS + 10 {
                    cache.loaded_too_large(&format!("d{i}"), "alice@example.com", 1);
                }
            }
        });
        let logs = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        assert_eq!(logs.lines().count(), WARNED_KEYS);
        assert_eq!(logs.matches("the last key logged").count(), 1);
        assert!(!logs.contains("alice"));
        assert_eq!(cache.inner.warned_too_large.lock().len(), WARNED_KEYS);
        assert_eq!(cache.stats().too_large, 2 * (WARNED_KEYS as u64 + 10));
        // at DEBUG, every occurrence, with the user key beside the derived one
        let buf = Buf::default();
        let writer = buf.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_writer(move || writer.clone())
            .finish();
        crate::test_support::scoped(subscriber, || {
            cache.loaded_too_large("d1", "bob@example.com", 1);
        });
        let logs = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        assert!(
            logs.contains("bob@example.com") && logs.contains("d1"),
            "{logs}"
        );
    }
}
