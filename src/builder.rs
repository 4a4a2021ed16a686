//! `CacheBuilder`: every setting with its default. `build()` validates them into a plain
//! [`Config`], from which the `Cache` is made.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::backend::Backend;
use crate::backend::memcached::{DeadServerPolicy, MemcachedBackend, MemcachedConfig, ServerSpec};
use crate::backend::memory::{DEFAULT_CAPACITY, MemoryBackend};
use crate::backend::server::Options;

/// How many pipelined connections an `AsyncCache` keeps per memcached server by default.
pub const DEFAULT_ASYNC_CONNECTIONS: u32 = 2;
use crate::cache::Cache;
use crate::cache::policy::{DecodePolicy, FailurePolicy};
use crate::clock::{Clock, SystemClock};
use crate::codec::{Codec, Compression, Format};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::key::{KeyFunction, KeyMaker, default_key, validate_key};

/// The name of a cache built without [`CacheBuilder::name`]: its metrics' `cache` label.
pub const DEFAULT_NAME: &str = "default";

/// Default fresh lifetime of a value: 300 s (Django's default `TIMEOUT`).
pub const DEFAULT_TTL: Duration = Duration::from_secs(300);
/// Default herd timeout: 60 s (django-newcache's `CACHE_HERD_TIMEOUT`).
pub const DEFAULT_HERD_TIMEOUT: Duration = Duration::from_secs(60);
/// Default lifetime of a load's claim (or placeholder) between renewals: 5 s.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(5);
/// The shortest `lease_ttl`: memcached's expiry has one-second granularity, so a shorter lease
/// cannot be renewed reliably.
pub const MIN_LEASE_TTL: Duration = Duration::from_secs(2);
/// Default bound on waiting for another caller's load: 5 s.
pub const DEFAULT_MAX_WAIT: Duration = Duration::from_secs(5);
/// The smallest `item_size`: a 250-byte key, memcached's per-item overhead (64 bytes), the
/// largest envelope header (48 bytes) and room for a small value.
pub const MIN_ITEM_SIZE: usize = 512;
/// The largest `item_size`: memcached's own ceiling (`-I 1024m`).
pub const MAX_ITEM_SIZE: usize = 1 << 30;

/// Default longest time a load keeps its claim alive: 60 s (the default herd timeout).
pub const DEFAULT_MAX_LOAD_TIME: Duration = Duration::from_secs(60);

/// The smallest near tier ([`CacheBuilder::near_cache`]): 64 KiB.
pub const MIN_NEAR_CAPACITY: u64 = 64 << 10;

/// The longest [`CacheBuilder::near_ttl`]: how stale another process's write may be seen.
pub const MAX_NEAR_TTL: Duration = Duration::from_secs(3600);

/// The default [`CacheBuilder::near_bus_heartbeat`]: 1 s (a lost message is noticed within
/// about three).
pub const DEFAULT_BUS_HEARTBEAT: Duration = Duration::from_secs(1);

impl Cache {
    /// Starts configuring a cache; see [`CacheBuilder`] for the settings and their defaults.
    pub fn builder() -> CacheBuilder {
        CacheBuilder::default()
    }
}

/// Which backends use a setting: one given explicitly that the chosen backend does not use is
/// named in a warning at build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum UsedBy {
    /// Every server backend: memcached and Redis (the settings of [`Options`]).
    Servers,
    Memcached,
    #[cfg(feature = "redis")]
    Redis,
    Memory,
}

impl BackendChoice {
    /// Whether this backend uses the settings of `by` (a custom backend uses none).
    fn uses(&self, by: UsedBy) -> bool {
        match self {
            BackendChoice::Memory => by == UsedBy::Memory,
            BackendChoice::Memcached { .. } => matches!(by, UsedBy::Servers | UsedBy::Memcached),
            #[cfg(feature = "redis")]
            BackendChoice::Redis { .. } | BackendChoice::RedisCluster { .. } => {
                matches!(by, UsedBy::Servers | UsedBy::Redis)
            }
            BackendChoice::Custom(_) => false,
        }
    }

    fn name(&self) -> &'static str {
        match self {
            BackendChoice::Memory => {
                "memory (in-process, private to this cache: another build is another store; \
                 share it with Cache::to_async / AsyncCache::to_sync)"
            }
            BackendChoice::Memcached { .. } => "memcached",
            #[cfg(feature = "redis")]
            BackendChoice::Redis { .. } => "redis",
            #[cfg(feature = "redis")]
            BackendChoice::RedisCluster { .. } => "redis cluster",
            BackendChoice::Custom(_) => "custom",
        }
    }

    /// The servers it reaches (`host:port`, comma-separated), for the build's log line: never
    /// a URL's user or password. `None` for the memory backend and a custom one.
    fn servers(&self) -> Option<String> {
        let addrs: Vec<String> = match self {
            BackendChoice::Memory | BackendChoice::Custom(_) => return None,
            BackendChoice::Memcached { servers, weighted } => servers
                .iter()
                .map(|s| ServerSpec::parse(s).map_or_else(|_| s.clone(), |spec| spec.addr()))
                .chain(weighted.iter().map(ServerSpec::addr))
                .collect(),
            #[cfg(feature = "redis")]
            BackendChoice::Redis { url } => vec![crate::RedisConfig::new(url.as_str()).addr()],
            #[cfg(feature = "redis")]
            BackendChoice::RedisCluster { seeds } => seeds
                .iter()
                .map(|seed| crate::RedisConfig::new(seed.as_str()).addr())
                .collect(),
        };
        Some(addrs.join(","))
    }
}

/// The one store as each front end reaches it.
struct Backends {
    sync: Arc<dyn Backend>,
    #[cfg(feature = "tokio")]
    nonblocking: Arc<dyn crate::backend::AsyncBackend>,
}

impl Backends {
    /// An in-process store (memory, custom): the async front end calls the same one.
    fn in_process(sync: Arc<dyn Backend>) -> Backends {
        Backends {
            #[cfg(feature = "tokio")]
            nonblocking: Arc::new(crate::backend::Immediate(sync.clone())),
            sync,
        }
    }
}

#[derive(Clone)]
enum BackendChoice {
    Memory,
    Memcached {
        servers: Vec<String>,
        weighted: Vec<ServerSpec>,
    },
    #[cfg(feature = "redis")]
    Redis {
        url: String,
    },
    #[cfg(feature = "redis")]
    RedisCluster {
        seeds: Vec<String>,
    },
    Custom(Arc<dyn Backend>),
}

/// Configures and builds a [`Cache`]. Start from [`Cache::builder`].
///
/// ```
/// use std::time::Duration;
/// let cache = newcache::Cache::builder()
///     .in_memory()
///     .flavor("prod")
///     .version(3)
///     .default_ttl(Duration::from_secs(600))
///     .herd_timeout(Duration::from_secs(30))
///     .build()?;
/// assert!(cache.make_key("k").starts_with("prod-3-"));
/// # Ok::<(), newcache::Error>(())
/// ```
///
/// # Valid ranges
///
/// `build()` refuses, with an `is_config()` error that names the setting, a value outside its
/// range (a setting that could not work, accepted, fails later on every call):
///
/// | setting | default | valid |
/// |---|---|---|
/// | `item_size` | 1 MiB | [`MIN_ITEM_SIZE`] (512 B: a 250-byte key, memcached's per-item overhead, the largest envelope header and a small value) to 1 GiB (memcached's own ceiling) |
/// | `memory_capacity` | 64 MiB | any (a value larger than the whole capacity is refused, as memcached refuses one over `-I`) |
/// | `default_ttl` | 300 s | any (zero: `Ttl::Default` values expire at once, as Django's `TIMEOUT = 0`) |
/// | `herd_timeout` | 60 s | above zero, under 49 days |
/// | `lease_ttl` | 5 s | at least [`MIN_LEASE_TTL`] (2 s) |
/// | `max_wait` | 5 s | above zero (zero fails every caller behind a load at once) |
/// | `max_load_time` | 60 s | above zero |
/// | `max_decode_size` | 64 MiB | above zero |
/// | `early_refresh` β | off | finite and above zero |
/// | `near_cache` | off | at least [`MIN_NEAR_CAPACITY`] (64 KiB) |
/// | `near_ttl` | 5 s | above zero, at most [`MAX_NEAR_TTL`] (an hour); needs `near_cache` |
/// | `near_bus_heartbeat` | 1 s | 10 ms to 60 s; needs `near_bus` |
/// | `connect_timeout`, `io_timeout` | 500 ms | above zero, at most an hour |
/// | `retry_interval` | 1 s | at most a day |
/// | `pool_size`, `async_connections`, `failure_limit` | 16, 2, 2 | at least 1 |
/// | `replay_capacity` | 10,000 keys per server | any (0: judge a revived server's older values stale) |
/// | `flavor` | `""` | what starts a memcached key (no whitespace or control bytes) |
/// | `name` | `"default"` | not empty |
#[must_use]
#[derive(Clone)]
pub struct CacheBuilder {
    backend: BackendChoice,
    memory_capacity: usize,
    /// The settings given explicitly, each with the backends that use it (those the chosen
    /// backend does not use are warned about at build).
    given: Vec<(&'static str, UsedBy)>,
    flavor: String,
    name: String,
    version: u64,
    default_ttl: Duration,
    herd_timeout: Duration,
    key_function: Option<KeyFunction>,
    clock: Arc<dyn Clock>,
    /// What every server connection has (memcached's and Redis's configurations are made
    /// with it), `item_size` included, which the memory backend takes too.
    server: Options,
    async_connections: u32,
    sync_pipelining: bool,
    read_failures: FailurePolicy,
    write_failures: FailurePolicy,
    decode_policy: DecodePolicy,
    dead_servers: DeadServerPolicy,
    lease_ttl: Duration,
    max_wait: Duration,
    max_load_time: Duration,
    early_beta: Option<f64>,
    stale_on_error: Option<Duration>,
    seed: Option<u64>,
    format: Format,
    near: Option<crate::near::NearSettings>,
    bus: Option<Arc<dyn crate::near::bus::BusTransport>>,
    bus_heartbeat: Option<Duration>,
    custom_clock: bool,
    #[cfg(feature = "redis-tls")]
    redis_tls: Option<crate::backend::redis::RedisTls>,
    #[cfg(feature = "redis")]
    redis_wait: Option<crate::backend::redis::ReplicaWait>,
}

impl Default for CacheBuilder {
    fn default() -> Self {
        CacheBuilder {
            backend: BackendChoice::Memory,
            memory_capacity: DEFAULT_CAPACITY,
            given: Vec::new(),
            flavor: String::new(),
            name: DEFAULT_NAME.to_owned(),
            version: 1,
            default_ttl: DEFAULT_TTL,
            herd_timeout: DEFAULT_HERD_TIMEOUT,
            key_function: None,
            clock: Arc::new(SystemClock),
            server: Options::default(),
            async_connections: DEFAULT_ASYNC_CONNECTIONS,
            sync_pipelining: cfg!(feature = "tokio"),
            read_failures: FailurePolicy::Absorb,
            write_failures: FailurePolicy::Propagate,
            decode_policy: DecodePolicy::Error,
            dead_servers: DeadServerPolicy::FailFast,
            lease_ttl: DEFAULT_LEASE_TTL,
            max_wait: DEFAULT_MAX_WAIT,
            max_load_time: DEFAULT_MAX_LOAD_TIME,
            early_beta: None,
            stale_on_error: None,
            seed: None,
            format: Format::default(),
            near: None,
            bus: None,
            bus_heartbeat: None,
            custom_clock: false,
            #[cfg(feature = "redis-tls")]
            redis_tls: None,
            #[cfg(feature = "redis")]
            redis_wait: None,
        }
    }
}

impl fmt::Debug for CacheBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CacheBuilder")
            .field("flavor", &self.flavor)
            .field("version", &self.version)
            .field("default_ttl", &self.default_ttl)
            .field("herd_timeout", &self.herd_timeout)
            .finish_non_exhaustive()
    }
}

impl CacheBuilder {
    /// Uses memcached: one or more servers as `"host:port"` or `"memcache://host:port"`.
    /// Several servers share the keys by ketama (libmemcached's weighted ketama placement).
    ///
    /// Without it (or [`backend`](Self::backend)), a cache is **in-process**: each process gets
    /// a cache of its own, and the herd protection stops at the process. `build()` logs which
    /// backend is in use (`tracing`, info level) so that a missing `.memcached(..)` shows.
    pub fn memcached<I, S>(mut self, servers: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        self.backend = BackendChoice::Memcached {
            servers: servers
                .into_iter()
                .map(|s| s.as_ref().to_string())
                .collect(),
            weighted: Vec::new(),
        };
        self
    }

    /// Uses one Redis or Valkey server (feature `redis`): `redis://[user:password@]host:port/db`,
    /// or `rediss://` for TLS (feature `redis-tls`; see [`redis_tls`](Self::redis_tls)).
    /// Keys, envelope and herd protection are memcached's; items are stored as Redis strings
    /// with a small header (see the crate docs' "Redis"). The timeouts, `pool_size`, health
    /// limits and `item_size` apply as on memcached. `build()` never connects.
    ///
    /// An ACL user and its password go in the URL (`redis://newcache:secret@host:6379/0`); it
    /// needs `GET`, `MGET`, `SET`, `EXISTS`, `PERSIST`, `PEXPIRE`, `EXPIREAT`, `UNLINK`, `SCAN`,
    /// `EVAL` and `EVALSHA` on the cache's keys. A refused password or command is an
    /// [`is_denied`](crate::Error::is_denied) error that does not count against the server. The
    /// password is never printed: not in `Debug`, not in an error.
    ///
    /// ```
    /// let cache = newcache::Cache::builder()
    ///     .redis("redis://127.0.0.1:6379/0")
    ///     .build()?;
    /// # Ok::<(), newcache::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// `build()` refuses (`is_config()`) a URL the `redis` crate cannot read, a scheme other than
    /// `redis://` and `rediss://`, and `rediss://` in a build without the `redis-tls` feature.
    #[cfg(feature = "redis")]
    pub fn redis(mut self, url: impl Into<String>) -> Self {
        self.backend = BackendChoice::Redis { url: url.into() };
        self
    }

    /// Uses a Redis Cluster (feature `redis`), reached first through its `seeds`
    /// (`redis://[user:password@]host:port`, one or more of its nodes): the slot map is asked
    /// of them on first use, and each master is reached with the first seed's scheme, user and
    /// password. Keys go to their hash slot's master (no hash tags are added: each claim,
    /// placeholder and fenced store touches one key); reads and writes go to masters only. A
    /// batch is split by node, and a node down fails only its own keys. The timeouts,
    /// `pool_size`, health limits and `item_size` apply to each node. `build()` never
    /// connects.
    ///
    /// ```
    /// let cache = newcache::Cache::builder()
    ///     .redis_cluster(["redis://127.0.0.1:7000", "redis://127.0.0.1:7001"])
    ///     .build()?;
    /// # Ok::<(), newcache::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// `build()` refuses (`is_config()`) an empty list of seeds, a seed URL with a database
    /// other than 0 (a cluster has database 0 only), and what [`redis`](Self::redis) refuses.
    #[cfg(feature = "redis")]
    pub fn redis_cluster<I>(mut self, seeds: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        self.backend = BackendChoice::RedisCluster {
            seeds: seeds.into_iter().map(Into::into).collect(),
        };
        self
    }

    /// After each store (claims, placeholders, fenced stores, `set`s) and each delete, waits
    /// until `replicas` replicas acknowledge it or `timeout` passes (Redis's `WAIT`), on one
    /// server or a cluster's masters (default: no wait). See [`ReplicaWait`](crate::ReplicaWait)
    /// for what it guarantees and what a wait that falls short returns.
    ///
    /// ```
    /// use std::time::Duration;
    /// let cache = newcache::Cache::builder()
    ///     .redis_cluster(["redis://127.0.0.1:7000"])
    ///     .redis_wait(1, Duration::from_millis(100)) // io_timeout: 500 ms
    ///     .build()?;
    /// # Ok::<(), newcache::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// `build()` refuses (`is_config()`) 0 replicas and a timeout not shorter than
    /// [`io_timeout`](Self::io_timeout) (which bounds the wait's reply too). Another backend ignores the setting (a
    /// warning at `build()` names it, as for the other settings it does not use).
    #[cfg(feature = "redis")]
    pub fn redis_wait(mut self, replicas: u32, timeout: Duration) -> Self {
        self.given("redis_wait", UsedBy::Redis);
        self.redis_wait = Some(crate::backend::redis::ReplicaWait { replicas, timeout });
        self
    }

    /// The TLS settings of a `rediss://` server (feature `redis-tls`): the CA that signed its
    /// certificate (default: the system's trusted roots), and a client certificate for mutual
    /// TLS (default none). The server's certificate is always verified, host name included.
    ///
    /// ```
    /// # let ca_pem = Vec::<u8>::new();
    /// use newcache::{Cache, RedisTls};
    /// let e = Cache::builder()
    ///     .redis("rediss://127.0.0.1:6380/0")
    ///     .redis_tls(RedisTls::new().ca_pem(ca_pem))
    ///     .build()
    ///     .unwrap_err();
    /// assert!(e.is_config(), "{e}"); // an empty PEM: no CA in it
    /// ```
    ///
    /// # Errors
    ///
    /// `build()` refuses (`is_config()`) a PEM without a certificate, a client key that does not
    /// parse or does not match its certificate, and TLS settings for a `redis://` URL.
    #[cfg(feature = "redis-tls")]
    pub fn redis_tls(mut self, tls: crate::backend::redis::RedisTls) -> Self {
        self.given("redis_tls", UsedBy::Redis);
        self.redis_tls = Some(tls);
        self
    }

    /// Uses memcached with the servers of a list as an environment variable holds one
    /// (`MEMCACHED_SERVERS="10.0.0.1:11211,10.0.0.2:11211"`): separated by `,`, `;` or
    /// whitespace ([`ServerSpec::parse_list`]); a malformed list fails at `build()`.
    ///
    /// ```
    /// let cache = newcache::Cache::builder()
    ///     .memcached_list("127.0.0.1:11211, 127.0.0.1:11212")
    ///     .build()?; // never connects
    /// # Ok::<(), newcache::Error>(())
    /// ```
    pub fn memcached_list(self, servers: &str) -> Self {
        match ServerSpec::parse_list(servers) {
            Ok(specs) => self.memcached(specs.iter().map(ServerSpec::addr)),
            // The first bad entry (or the empty list) is kept, so that build() reports it.
            Err(_) => {
                let bad = servers
                    .split(|c: char| c == ',' || c == ';' || c.is_whitespace())
                    .find(|e| !e.is_empty() && ServerSpec::parse(e).is_err())
                    .unwrap_or(servers);
                self.memcached([bad])
            }
        }
    }

    /// Uses memcached with weighted servers: `(address, weight)`; a server's share of the keys is
    /// its weight over the total.
    pub fn memcached_weighted<I, S>(mut self, servers: I) -> Self
    where
        I: IntoIterator<Item = (S, u32)>,
        S: AsRef<str>,
    {
        let mut specs = Vec::new();
        let mut raw = Vec::new();
        for (s, w) in servers {
            match ServerSpec::parse(s.as_ref()) {
                Ok(spec) => specs.push(spec.with_weight(w)),
                // Kept raw so that build() reports the parse error.
                Err(_) => raw.push(s.as_ref().to_string()),
            }
        }
        self.backend = BackendChoice::Memcached {
            servers: raw,
            weighted: specs,
        };
        self
    }

    /// Uses the in-process memory backend (the default): memcached's semantics, no server. The
    /// store is private to the cache built from it: every [`build`](Self::build) or
    /// [`build_async`](Self::build_async) makes a new, empty one, so two builds from one
    /// builder are two stores, and other processes never see it. To use one store from sync
    /// and async code, build once and take the other front end's view of it
    /// ([`Cache::to_async`](crate::Cache::to_async), [`AsyncCache::to_sync`](crate::AsyncCache::to_sync)),
    /// which shares the entries, the stats and the coalescer. Keeps a
    /// [`memory_capacity`](Self::memory_capacity) set before.
    ///
    /// ```
    /// let builder = newcache::Cache::builder().in_memory();
    /// let one = builder.clone().build()?;
    /// let other = builder.build()?;
    /// one.set("k", &1u32, std::time::Duration::from_secs(60))?;
    /// assert_eq!(other.get::<u32>("k")?, None, "two builds, two stores");
    /// # Ok::<(), newcache::Error>(())
    /// ```
    pub fn in_memory(mut self) -> Self {
        self.backend = BackendChoice::Memory;
        self
    }

    /// Bounds the memory backend's size in bytes (default 64 MiB): keys, values and 112 bytes per
    /// entry never add up to more; a value that cannot fit is refused as too large. Implies
    /// [`in_memory`](Self::in_memory). See [`MemoryBackend`] for how it is shared out.
    pub fn memory_capacity(mut self, bytes: usize) -> Self {
        self.given("memory_capacity", UsedBy::Memory);
        self.backend = BackendChoice::Memory;
        self.memory_capacity = bytes;
        self
    }

    /// Uses a backend of your own. An `AsyncCache` built on it calls its methods on the
    /// caller's task, as it does the memory backend's, so they must not block for long (wrap a
    /// network store in a backend of its own thread, or call it from `Cache`).
    pub fn backend(mut self, backend: Arc<dyn Backend>) -> Self {
        self.backend = BackendChoice::Custom(backend);
        self
    }

    /// The key prefix (django-newcache's `FLAVOR`); default `""`.
    pub fn flavor(mut self, flavor: impl Into<String>) -> Self {
        self.flavor = flavor.into();
        self
    }

    /// The cache's name, for operators: the `cache` label of every metric (feature `metrics`)
    /// and the `cache` field of every span; default [`DEFAULT_NAME`] (`"default"`). Give each
    /// cache of a process its own (`"users"`, `"reports"`) to tell them apart on a dashboard.
    /// Not part of the keys: caches of different names share entries when their flavor and
    /// version agree.
    ///
    /// Two caches built with one name (a sync and an async one, say) add up in the metrics,
    /// which are labelled by name, but each [`stats`](crate::Cache::stats) counts its own calls.
    /// Views of one cache ([`Cache::to_async`](crate::Cache::to_async),
    /// [`AsyncCache::to_sync`](crate::AsyncCache::to_sync)) share one count: `stats()` of
    /// either is the whole cache's.
    ///
    /// # Errors
    /// [`build`](Self::build) refuses an empty name (`is_config()`).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// The key version; default 1. Bumping it invalidates every key.
    pub fn version(mut self, version: u64) -> Self {
        self.version = version;
        self
    }

    /// The lifetime used for `Ttl::Default`; default 300 s.
    pub fn default_ttl(mut self, ttl: Duration) -> Self {
        self.default_ttl = ttl;
        self
    }

    /// How long a stale value keeps being served while one caller recomputes it, and how long a
    /// claim lasts before another caller may take over; default 60 s. It is added to every
    /// herd-protected value's memcached expiry.
    pub fn herd_timeout(mut self, timeout: Duration) -> Self {
        self.herd_timeout = timeout;
        self
    }

    /// Replaces the key derivation (`f(flavor, version, key)`); its output is validated against
    /// memcached's key rules on every use. Default: [`default_key`].
    pub fn key_function<F>(mut self, f: F) -> Self
    where
        F: Fn(&str, u64, &str) -> String + Send + Sync + 'static,
    {
        self.key_function = Some(Arc::new(f));
        self
    }

    /// The clock for soft expiry (and the memory backend's hard expiry); default the system
    /// clock. Tests pass a [`MockClock`](crate::testing::MockClock).
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self.custom_clock = true;
        self
    }

    /// memcached and Redis: the longest an operation waits for a connection, connecting
    /// included; default 500 ms. Above zero, at most an hour.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.given("connect_timeout", UsedBy::Servers);
        self.server.connect_timeout = timeout;
        self
    }

    /// memcached and Redis: the longest one operation's I/O may take, however slowly the server
    /// sends (one deadline for all of it; a large batch has one per round of up to 2,048 keys,
    /// from when that round is sent); default 500 ms. Above zero, at most an hour.
    pub fn io_timeout(mut self, timeout: Duration) -> Self {
        self.given("io_timeout", UsedBy::Servers);
        self.server.io_timeout = timeout;
        self
    }

    /// memcached and Redis: connections per server; default 16. (On Redis: the sync `Cache`'s
    /// blocking pool, and with `redis_wait` the most connections a `Cache` or an `AsyncCache`
    /// opens beside it for its waited writes, one write each at a time.)
    pub fn pool_size(mut self, size: u32) -> Self {
        self.given("pool_size", UsedBy::Servers);
        self.server.pool_size = size;
        self
    }

    /// How many pipelined connections an [`AsyncCache`](crate::AsyncCache) keeps per memcached
    /// server (default 2), and the sync [`Cache`] for its concurrent callers (see
    /// [`pipelined_sync`](CacheBuilder::pipelined_sync)). Every caller's requests share them;
    /// concurrent gets are merged into multi-key lines, so a few connections serve thousands of
    /// tasks. A sync cache's async view ([`Cache::to_async`](crate::Cache::to_async)) uses them
    /// too, so [`build`](Self::build) refuses 0 with or without `pipelined_sync`. memcached
    /// only.
    pub fn async_connections(mut self, connections: u32) -> Self {
        self.given("async_connections", UsedBy::Memcached);
        self.async_connections = connections;
        self
    }

    /// Whether the sync [`Cache`] on memcached sends concurrent callers' operations through the
    /// pipelined engine that [`AsyncCache`](crate::AsyncCache) uses; default `true` with the
    /// `tokio` feature (and always `false` without it).
    ///
    /// With it, an operation that starts while another of the same cache is running is queued
    /// on [`async_connections`](CacheBuilder::async_connections) pipelined connections per
    /// server, whose tasks run on a thread the cache starts at the first such operation; the
    /// calling thread blocks until its reply is read. A caller alone uses the blocking pool
    /// ([`pool_size`](CacheBuilder::pool_size)) as before: its thread waits on its own socket,
    /// with no hand-off to another thread. Many threads then share a few connections instead of
    /// waiting for a pooled one each: more gets a second and a far shorter tail than the pool
    /// alone, and a lone thread keeps the pool's latency.
    pub fn pipelined_sync(mut self, on: bool) -> Self {
        self.given("pipelined_sync", UsedBy::Memcached);
        self.sync_pipelining = on && cfg!(feature = "tokio");
        self
    }

    /// The item size limit (`memcached -I`); default 1 MiB. memcached refuses larger items, and the
    /// memory backend refuses the same values, so that what fits in one fits in the other.
    pub fn item_size(mut self, bytes: usize) -> Self {
        self.server.item_size = bytes;
        self
    }

    /// memcached and Redis: consecutive failures (connect errors, timeouts, I/O errors) after
    /// which a server is marked dead; default 2.
    pub fn failure_limit(mut self, failures: u32) -> Self {
        self.given("failure_limit", UsedBy::Servers);
        self.server.failure_limit = failures;
        self
    }

    /// memcached and Redis: how many keys per server this process remembers having invalidated
    /// while that server was out of reach (deleted, written to another server under
    /// [`DeadServerPolicy::Remap`], or failed to write), to delete them there before it serves
    /// this process again; default 10,000. Past it, the values that server holds from before
    /// are judged stale or expired when read (reloaded: one loader per key through
    /// `get_or_set_with`) instead of served as fresh.
    /// See [`backend::memcached`](crate::backend::memcached), "When a server fails".
    pub fn replay_capacity(mut self, keys: usize) -> Self {
        self.given("replay_capacity", UsedBy::Servers);
        self.server.replay_capacity = keys;
        self
    }

    /// memcached and Redis: how long a dead server is left alone before one caller probes it;
    /// default 1 s (doubled each time it fails again soon after coming back, up to 32 intervals).
    pub fn retry_interval(mut self, interval: Duration) -> Self {
        self.given("retry_interval", UsedBy::Servers);
        self.server.retry_interval = interval;
        self
    }

    /// memcached: whether the keys of a dead server fail fast (default) or move to the others.
    pub fn dead_servers(mut self, policy: DeadServerPolicy) -> Self {
        self.given("dead_servers", UsedBy::Memcached);
        self.dead_servers = policy;
        self
    }

    /// What reads do when the backend fails; default [`FailurePolicy::Absorb`] (a miss, counted).
    pub fn read_failures(mut self, policy: FailurePolicy) -> Self {
        self.read_failures = policy;
        self
    }

    /// What `set`/`set_many`/`delete` do when the backend fails; default
    /// [`FailurePolicy::Propagate`].
    pub fn write_failures(mut self, policy: FailurePolicy) -> Self {
        self.write_failures = policy;
        self
    }

    /// What reads do with bytes that are not a newcache value of the requested type; default
    /// [`DecodePolicy::Error`].
    pub fn decode_policy(mut self, policy: DecodePolicy) -> Self {
        self.decode_policy = policy;
        self
    }

    /// How long a load's claim on a key (or its placeholder, for a missing key) lasts without
    /// renewal; default 5 s, at least [`MIN_LEASE_TTL`] (2 s). A running load renews it every
    /// third of this, up to [`max_load_time`](Self::max_load_time); a holder that dies stops
    /// renewing, and one waiter takes over once the claim has lapsed. See
    /// [`Cache::get_or_set_with`].
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl;
        self
    }

    /// The longest a `get_or_set_with` caller waits for another caller's load, end to end (in
    /// this process and across processes); default 5 s. A caller that reaches it gets an error
    /// with [`is_wait_timeout`](crate::Error::is_wait_timeout): it never runs the loader while
    /// the holder is alive. A stale value, where there is one, is served without waiting.
    pub fn max_wait(mut self, wait: Duration) -> Self {
        self.max_wait = wait;
        self
    }

    /// The longest a running load keeps its claim alive by renewing it; default 60 s. A load
    /// still running after that lets its claim lapse (within [`lease_ttl`](Self::lease_ttl)), and
    /// one waiter takes over; the first load's result is then not stored.
    pub fn max_load_time(mut self, limit: Duration) -> Self {
        self.max_load_time = limit;
        self
    }

    /// Turns on XFetch early refresh for the `get_or_set_with` family with this β (1.0 is the
    /// paper's recommendation; larger refreshes earlier). Off by default.
    pub fn early_refresh(mut self, beta: f64) -> Self {
        self.early_beta = Some(beta);
        self
    }

    /// Lets a claimant whose loader fails return the stale value instead of the error, if the
    /// value was computed at most `max_age` ago. Off by default.
    pub fn serve_stale_on_error(mut self, max_age: Duration) -> Self {
        self.stale_on_error = Some(max_age);
        self
    }

    /// Turns on the near tier: copies of the values this cache reads, in this process's
    /// memory, up to `capacity` bytes (each copy is charged its bytes, decompressed, the value
    /// [`get_arc`](crate::Cache::get_arc) keeps decoded with what decoding it allocated, and a
    /// small overhead; a copy over 1/16 of the capacity, or over most of what one of the
    /// tier's shards holds (it has four per core), is not kept). Off by
    /// default.
    ///
    /// A read that finds a fresh copy younger than the [`near_ttl`](CacheBuilder::near_ttl)
    /// is answered from it, without I/O; everything else (misses, stale values, claims,
    /// loads) goes to the shared store as without it, so one load per expiry still holds
    /// across processes. This process's writes drop its copies before they are sent; another
    /// process's writes are seen once the near ttl has passed since the read that filled the
    /// copy. With [`serve_stale_on_error`](CacheBuilder::serve_stale_on_error), a copy is
    /// served past the near ttl, within its staleness bound, while the shared store does not
    /// answer. The near tier is per cache (shared by its clones, version views and async
    /// view); [`get_arc`](crate::Cache::get_arc) reads a value decoded once.
    ///
    /// ```
    /// # use std::time::Duration;
    /// let cache = newcache::Cache::builder()
    ///     .in_memory() // .memcached(..) or .redis(..): a near tier saves their round trips
    ///     .near_cache(64 << 20)
    ///     .build()?;
    /// cache.set("k", &1u32, Duration::from_secs(60))?;
    /// assert_eq!(cache.get::<u32>("k")?, Some(1)); // read from the store, kept near
    /// assert_eq!(cache.get::<u32>("k")?, Some(1)); // from memory
    /// assert_eq!(cache.stats().near_hits, 1);
    /// cache.delete("k")?;
    /// assert_eq!(cache.get::<u32>("k")?, None, "never served after this process's delete");
    /// # Ok::<(), newcache::Error>(())
    /// ```
    ///
    /// # What a near copy may lag
    ///
    /// - **This process's writes**: never. Every write (any method, a load's store, the
    ///   response cache's invalidations, `clear`) stops the copies of its keys before it is
    ///   sent, whichever cache over the same server list (or the same
    ///   [`backend`](CacheBuilder::backend) `Arc`) in this process made it; a read sent
    ///   before a write ended fills nothing; an `AsyncCache` write whose future was dropped
    ///   keeps its keys from being filled until it may have landed.
    /// - **Everything else, up to the near ttl** after the read that filled the copy was sent
    ///   (plus the near clock's tick, about 3 ms), or, for other newcache processes' writes,
    ///   until a [bus](CacheBuilder::near_bus) carries them: another process's writes, writers outside
    ///   newcache, a cache over the same servers named otherwise (`localhost` and `127.0.0.1`,
    ///   or a custom backend of its own over them),
    ///   and changes of routing (a server revived under
    ///   [`DeadServerPolicy::Remap`](crate::DeadServerPolicy), a cluster failover). A near hit
    ///   does no I/O, so a server that is down is not noticed by it either: within the near
    ///   ttl, its keys' copies are served.
    /// - **Expiry**: never. A copy is served only while its value is fresh (with
    ///   [`early_refresh`](CacheBuilder::early_refresh), until shortly before, so that XFetch
    ///   still sees the reads it refreshes on).
    ///
    /// Copies are keyed by the caller's key, so a
    /// [`key_function`](CacheBuilder::key_function) must derive a key from its arguments alone
    /// (one that reads a tenant or a generation from elsewhere would be served across them).
    /// Near hits have no tracing span (they derive no key). A value written with
    /// [`Herd::Off`](crate::Herd) is never kept near (its envelope does not say when it
    /// expires).
    pub fn near_cache(mut self, capacity: u64) -> Self {
        let ttl = self
            .near
            .as_ref()
            .map_or(crate::near::DEFAULT_NEAR_TTL, |n| n.ttl);
        self.near = Some(crate::near::NearSettings { capacity, ttl });
        self
    }

    /// Puts this cache on `bus`, which keeps the near copies of every cache on it coherent
    /// ([`RedisBus`](crate::RedisBus) between processes, [`InProcessBus`](crate::InProcessBus)
    /// within one).
    ///
    /// Each write of this cache (a `set`, a `delete`, a load's store, a `clear`...) is
    /// announced on the bus once it returned, as the keys it wrote (never values; a write
    /// whose outcome is unknown, or whose async caller went away, once it may have landed);
    /// the claims of the herd protocol change no value and are not announced. Every other
    /// cache on the bus drops its copies of those keys as it hears them. Without a near
    /// tier, the cache only announces.
    ///
    /// **What a copy may lag, with the bus** (beyond what [`near_cache`] says of this
    /// process's own writes):
    /// - another newcache process's write: until its message arrives (a publish and a
    ///   delivery: tens of milliseconds on a healthy bus);
    /// - after a lost message, until the loss is seen: a gap in a cache's numbering is seen
    ///   with its next message (its next heartbeat at the latest), a cache silent for three of
    ///   its [heartbeats](CacheBuilder::near_bus_heartbeat) when they are past, a broken
    ///   subscription when the transport says so, and this cache's own messages not coming
    ///   back (a paused bus) by the first hit three heartbeats after the last one came back
    ///   (and the near clock's tick). From then on no copy filled before is served as
    ///   a hit, and while the bus does not carry this cache's own messages, none at all
    ///   (reads go to the shared store). A cache that starts flushes nobody's copies; a cache
    ///   dropped says it leaves (the drop waits for that, at most the connect timeout plus the
    ///   I/O timeout), but a process that exits without dropping its cache (one in a
    ///   `static`, a crash) is a silent cache: every other cache stops serving its copies
    ///   once;
    /// - a writer that dies between its write and its message, and writers outside newcache
    ///   (redis-cli, the memcache crate, django-newcache), announce nothing: their writes are
    ///   seen within the [`near_ttl`](CacheBuilder::near_ttl), as without a bus;
    /// - the shared store down: as [`near_cache`] says (copies within their staleness bound
    ///   are served through the outage, also when the bus went down with it: a loss stops
    ///   hits, not the outage's serving). The deletes another process replays on a server
    ///   that comes back are not announced: a copy read there in between lags them up to the
    ///   near ttl.
    ///
    /// Building a cache on a bus, and dropping it, wait on the calling thread (at most the
    /// connect timeout plus the I/O timeout each: for the bus's first message, for the last
    /// ones and the leave): build and drop caches at start-up and shutdown, not per request.
    ///
    /// `build` waits for the cache to hear its own first message (at most the connect timeout
    /// plus the I/O timeout); a bus that is down does not fail the build: the near tier
    /// serves no hits until it is up. Counted in [`Stats`](crate::Stats)'s `bus_*` fields.
    ///
    /// A bus is one channel: every cache that publishes on it hears every other's messages
    /// (Redis pub/sub ignores the database number), so give each application a channel of its
    /// own; bytes on the channel that are not newcache's are ignored.
    ///
    /// ```
    /// use std::time::Duration;
    /// use newcache::{Cache, InProcessBus};
    ///
    /// // Caches of one process that do not share their store's stripes (a cache over the
    /// // same servers named otherwise), or processes over one RedisBus, stay coherent so.
    /// let bus = InProcessBus::new();
    /// let cache = Cache::builder()
    ///     .in_memory()
    ///     .near_cache(1 << 20)
    ///     .near_bus(bus.clone())
    ///     .near_bus_heartbeat(Duration::from_millis(500))
    ///     .build()?;
    /// cache.set("k", "v1", Duration::from_secs(60))?;
    /// assert_eq!(cache.get::<String>("k")?.as_deref(), Some("v1"));
    /// assert!(cache.stats().bus_sent >= 1); // its hello, at least
    /// # Ok::<(), newcache::Error>(())
    /// ```
    ///
    /// [`near_cache`]: CacheBuilder::near_cache
    pub fn near_bus(mut self, bus: Arc<dyn crate::BusTransport>) -> Self {
        self.bus = Some(bus);
        self
    }

    /// How often this cache's bus thread sends a heartbeat when it has sent nothing else
    /// (every message carries it: the other caches judge this one's silence by it). This
    /// cache's own messages not heard back for three heartbeats stop its near tier's hits.
    /// Default [`DEFAULT_BUS_HEARTBEAT`] (1 s); 10 ms to 60 s.
    /// Only with [`near_bus`](CacheBuilder::near_bus).
    pub fn near_bus_heartbeat(mut self, every: Duration) -> Self {
        self.bus_heartbeat = Some(every);
        self
    }

    /// How long a near copy is served after the shared read that filled it was sent: the most
    /// another process's write to the key goes unseen here. Default 5 s; at most 1 hour. Only
    /// with [`near_cache`](CacheBuilder::near_cache).
    pub fn near_ttl(mut self, ttl: Duration) -> Self {
        match &mut self.near {
            Some(n) => n.ttl = ttl,
            None => {
                self.near = Some(crate::near::NearSettings { capacity: 0, ttl });
            }
        }
        self
    }

    /// How values are serialized; default [`Codec::MessagePack`], which tolerates fields added
    /// (with `#[serde(default)]`) or removed between builds. [`Codec::Bincode`] is more compact
    /// and positional: bump the [`version`](Self::version) whenever a cached struct changes.
    /// Readers decode by the codec recorded in each value, so caches with different codecs read
    /// each other's values.
    pub fn codec(mut self, codec: Codec) -> Self {
        self.format.codec = codec;
        self
    }

    /// Compresses large payloads; default [`Compression::Off`]. Compressed values are marked in
    /// the envelope, and every build reads them whatever its own setting.
    ///
    /// ```
    /// use newcache::Compression;
    /// let cache = newcache::Cache::builder()
    ///     .compression(Compression::Lz4 { min_size: 4096 })
    ///     .build()?;
    /// # Ok::<(), newcache::Error>(())
    /// ```
    pub fn compression(mut self, compression: Compression) -> Self {
        self.format.compression = compression;
        self
    }

    /// The most one decode may build, in bytes; default [`DEFAULT_MAX_DECODE_SIZE`] (64 MiB),
    /// well above the item size: a value's in-memory form is larger than its bytes (a
    /// `Vec<u64>` of 140,000 numbers is 1.1 MB in memory from about 0.7 MB stored). Every
    /// element (its `size_of`), string and byte string a decode builds is counted against it,
    /// and nesting is capped, so hostile or corrupt bytes get a decode error instead of
    /// exhausting memory or the stack. The count is of the values themselves: a collection's
    /// spare capacity and a hash table's overhead come on top. A value whose encoded form alone
    /// exceeds the bound is refused by `set` (`is_too_large`), since no read could decode it.
    ///
    /// [`DEFAULT_MAX_DECODE_SIZE`]: crate::DEFAULT_MAX_DECODE_SIZE
    pub fn max_decode_size(mut self, bytes: usize) -> Self {
        self.format.max_decode = bytes;
        self
    }

    /// Seeds the random source of XFetch draws and wait jitter (for reproducible tests);
    /// default: seeded from the clock and the process id. Claim tokens never come from it:
    /// they are drawn from OS entropy and the process id, so processes built with one seed
    /// still elect one loader per key.
    pub fn random_seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Validates the settings and builds the cache. Never connects to memcached (connections are
    /// made on first use), so it does not block on an unreachable server.
    ///
    /// # Errors
    /// `is_config()` for an empty or malformed server list, and for a setting outside its range
    /// (the table in [`CacheBuilder`]'s docs: a zero `item_size` or `max_wait`, a flavor that
    /// breaks memcached's key rules, a `lease_ttl` under [`MIN_LEASE_TTL`], ...).
    ///
    /// A setting only another kind of backend uses (say `pool_size` with the memory backend,
    /// `memory_capacity` with memcached, or `dead_servers` with Redis) is not an error: one
    /// configuration often serves a development setup in process and a production one on
    /// memcached. `build()` warns once (`tracing`, warn level), naming the settings it ignores.
    pub fn build(self) -> Result<Cache> {
        self.warn_unused();
        let (backend, flavor, version) = (self.backend.name(), self.flavor.clone(), self.version);
        let servers = self.backend.servers();
        let cache = self.into_config().map(Cache::from_config)?;
        tracing::info!(backend, servers, flavor, version, "newcache: cache built");
        Ok(cache)
    }

    /// Builds an [`AsyncCache`](crate::AsyncCache): the same cache for tokio tasks, on the
    /// memory backend or on pipelined memcached connections (see
    /// [`async_connections`](CacheBuilder::async_connections)). Never connects.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), newcache::Error> {
    /// let cache: newcache::AsyncCache = newcache::Cache::builder().in_memory().build_async()?;
    /// cache.set("k", &1u32, std::time::Duration::from_secs(60)).await?;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// A custom [`backend`](CacheBuilder::backend) is called on the task's own thread, so it
    /// must not block (an in-process store is fine; for a blocking one, use
    /// [`build`](CacheBuilder::build) and `spawn_blocking`).
    ///
    /// The same as `build()?.to_async()`: the cache's async view
    /// ([`Cache::to_async`](crate::Cache::to_async)); [`AsyncCache::to_sync`](crate::AsyncCache::to_sync)
    /// gives its sync one.
    ///
    /// # Errors
    /// As [`build`](CacheBuilder::build).
    #[cfg(feature = "tokio")]
    pub fn build_async(self) -> Result<crate::AsyncCache> {
        self.warn_unused();
        let (backend, flavor, version) = (self.backend.name(), self.flavor.clone(), self.version);
        let servers = self.backend.servers();
        let cache = self.into_config().map(Cache::from_config)?.to_async();
        tracing::info!(
            backend,
            servers,
            flavor,
            version,
            "newcache: async cache built"
        );
        Ok(cache)
    }

    /// The memcached backends: the sync cache's (the pool, and the engine for concurrent callers
    /// when [`pipelined_sync`](CacheBuilder::pipelined_sync) is on) and, with `tokio`, the async
    /// front end's engine, which keeps the sync backend's health records (one per server): a
    /// server marked dead through either view is dead for both.
    fn memcached_backends(&self) -> Result<Backends> {
        let config = self.memcached_config()?;
        #[cfg(feature = "tokio")]
        {
            // Both views' engines use it (the sync view's only with `pipelined_sync`).
            if self.async_connections == 0 {
                return Err(Error::config("async_connections must be at least 1"));
            }
            let connections = self.async_connections as usize;
            let (sync, health): (Arc<dyn Backend>, _) = if self.sync_pipelining {
                let b =
                    crate::backend::memcached::blended::Blended::new(config.clone(), connections)?;
                let health = b.health();
                (Arc::new(b), health)
            } else {
                let b = MemcachedBackend::new(config.clone())?;
                let health = b.health();
                (Arc::new(b), health)
            };
            self.clock_records(&health);
            let engine = crate::backend::memcached::engine::Engine::sharing(
                &config,
                connections,
                Some(health),
            )?;
            Ok(Backends {
                sync,
                nonblocking: Arc::new(engine),
            })
        }
        #[cfg(not(feature = "tokio"))]
        {
            let b = MemcachedBackend::new(config)?;
            self.clock_records(&b.health());
            Ok(Backends { sync: Arc::new(b) })
        }
    }

    /// Puts the servers' replay records on the cache's clock (their stale-before times are
    /// compared with the write times of values, which are on it).
    fn clock_records(&self, records: &[Arc<crate::backend::server::health::Health>]) {
        for r in records {
            r.missed.use_clock(self.clock.clone());
        }
    }

    /// The memcached backend's settings (servers parsed).
    fn memcached_config(&self) -> Result<MemcachedConfig> {
        let BackendChoice::Memcached { servers, weighted } = &self.backend else {
            return Err(Error::config("not a memcached backend"));
        };
        let mut specs = weighted.clone();
        for s in servers {
            specs.push(ServerSpec::parse(s)?);
        }
        let mut config = MemcachedConfig::with_options(specs, self.server);
        config.dead_servers = self.dead_servers;
        Ok(config)
    }

    /// The Redis backend's settings.
    #[cfg(feature = "redis")]
    fn redis_config(&self) -> Result<crate::backend::redis::RedisConfig> {
        let BackendChoice::Redis { url } = &self.backend else {
            return Err(Error::config("not a redis backend"));
        };
        Ok(self.redis_config_for(url))
    }

    /// The settings of each seed of a Redis Cluster.
    #[cfg(feature = "redis")]
    fn redis_cluster_configs(&self) -> Result<Vec<crate::backend::redis::RedisConfig>> {
        let BackendChoice::RedisCluster { seeds } = &self.backend else {
            return Err(Error::config("not a redis cluster backend"));
        };
        Ok(seeds.iter().map(|u| self.redis_config_for(u)).collect())
    }

    /// The Redis settings of the server at `url`.
    #[cfg(feature = "redis")]
    fn redis_config_for(&self, url: &str) -> crate::backend::redis::RedisConfig {
        let mut config = crate::backend::redis::RedisConfig::with_options(url, self.server);
        config.wait = self.redis_wait;
        #[cfg(feature = "redis-tls")]
        {
            config.tls = self.redis_tls.clone();
        }
        config
    }

    /// Notes that `setting` was given explicitly, and which backends use it.
    fn given(&mut self, setting: &'static str, by: UsedBy) {
        self.given.push((setting, by));
    }

    /// The settings given explicitly that the chosen backend does not use.
    fn unused(&self) -> Vec<&'static str> {
        let mut unused: Vec<&'static str> = self
            .given
            .iter()
            .filter(|(_, by)| !self.backend.uses(*by))
            .map(|(setting, _)| *setting)
            .collect();
        unused.sort_unstable();
        unused.dedup();
        unused
    }

    fn warn_unused(&self) {
        let unused = self.unused();
        if !unused.is_empty() {
            tracing::warn!(
                backend = self.backend.name(),
                ignored = ?unused,
                "newcache: settings for another kind of backend are ignored"
            );
        }
    }

    fn into_config(self) -> Result<Config> {
        let probe = default_key(&self.flavor, self.version, "");
        validate_key(&probe).map_err(|e| {
            Error::config(format!(
                "flavor {:?} cannot start a memcached key: {e}",
                self.flavor
            ))
        })?;
        if self.name.is_empty() {
            return Err(Error::config("the cache's name must not be empty"));
        }
        if !(MIN_ITEM_SIZE..=MAX_ITEM_SIZE).contains(&self.server.item_size) {
            return Err(Error::config(format!(
                "item_size must be {MIN_ITEM_SIZE} bytes to 1 GiB (a 250-byte key, memcached's \
                 item overhead, the largest envelope header and a small value), got {}",
                self.server.item_size
            )));
        }
        for (setting, d) in [
            ("max_wait", self.max_wait),
            ("max_load_time", self.max_load_time),
        ] {
            if d.is_zero() {
                return Err(Error::config(format!("{setting} must be more than zero")));
            }
        }
        if self.format.max_decode == 0 {
            return Err(Error::config("max_decode_size must be more than zero"));
        }
        if self.server.failure_limit == 0 {
            return Err(Error::config("failure_limit must be at least 1"));
        }
        if self.herd_timeout.is_zero() {
            return Err(Error::config("herd_timeout must be more than zero"));
        }
        if self.herd_timeout.as_millis() > u128::from(u32::MAX) {
            return Err(Error::config("herd_timeout must be under 49 days"));
        }
        if self.lease_ttl < MIN_LEASE_TTL {
            return Err(Error::config(format!(
                "lease_ttl must be at least {MIN_LEASE_TTL:?} (memcached's expiry ticks in whole \
                 seconds, so a shorter lease cannot be renewed reliably), got {:?}",
                self.lease_ttl
            )));
        }
        if let Some(near) = &self.near {
            if near.capacity < MIN_NEAR_CAPACITY {
                return Err(Error::config(format!(
                    "near_cache capacity must be at least {MIN_NEAR_CAPACITY} bytes (near_ttl \
                     alone does not turn the near tier on), got {}",
                    near.capacity
                )));
            }
            if near.ttl.is_zero() || near.ttl > MAX_NEAR_TTL {
                return Err(Error::config(format!(
                    "near_ttl must be above zero and at most {MAX_NEAR_TTL:?}, got {:?}",
                    near.ttl
                )));
            }
        }
        if let Some(every) = self.bus_heartbeat {
            if self.bus.is_none() {
                return Err(Error::config(
                    "near_bus_heartbeat needs near_bus (there is no bus to send heartbeats on)",
                ));
            }
            if !(Duration::from_millis(10)..=Duration::from_secs(60)).contains(&every) {
                return Err(Error::config(format!(
                    "near_bus_heartbeat must be between 10 ms and 60 s, got {every:?}"
                )));
            }
        }
        if let Some(beta) = self.early_beta {
            if !(beta.is_finite() && beta > 0.0) {
                return Err(Error::config(format!(
                    "early_refresh beta must be positive, got {beta}"
                )));
            }
        }
        let servers = match &self.backend {
            BackendChoice::Memcached { .. } => self
                .memcached_config()?
                .servers
                .iter()
                .map(ServerSpec::addr)
                .collect(),
            #[cfg(feature = "redis")]
            BackendChoice::Redis { .. } => vec![self.redis_config()?.addr()],
            #[cfg(feature = "redis")]
            BackendChoice::RedisCluster { .. } => self
                .redis_cluster_configs()?
                .iter()
                .map(crate::backend::redis::RedisConfig::addr)
                .collect(),
            BackendChoice::Memory | BackendChoice::Custom(_) => Vec::new(),
        };
        let private_store = matches!(self.backend, BackendChoice::Memory);
        let backends = match self.backend {
            BackendChoice::Custom(b) => Backends::in_process(b),
            BackendChoice::Memory => Backends::in_process(Arc::new(MemoryBackend::with_item_size(
                self.memory_capacity,
                self.server.item_size,
                self.clock.clone(),
            ))),
            BackendChoice::Memcached { .. } => self.memcached_backends()?,
            #[cfg(feature = "redis")]
            BackendChoice::Redis { .. } => {
                let sync = crate::backend::redis::RedisBackend::new(self.redis_config()?)?;
                self.clock_records(std::slice::from_ref(sync.health()));
                Backends {
                    #[cfg(feature = "tokio")]
                    nonblocking: Arc::new(crate::backend::redis::nonblocking::AsyncRedis::new(
                        sync.shared(),
                    )?),
                    sync: Arc::new(sync),
                }
            }
            #[cfg(feature = "redis")]
            BackendChoice::RedisCluster { .. } => {
                let sync = crate::backend::redis::RedisCluster::new(self.redis_cluster_configs()?)?;
                sync.use_clock(self.clock.clone());
                Backends {
                    #[cfg(feature = "tokio")]
                    nonblocking: Arc::new(sync.to_async()),
                    sync: Arc::new(sync),
                }
            }
        };
        let seed = self.seed.unwrap_or_else(|| {
            // Nanoseconds and the process id: caches built in the same millisecond (or in
            // processes started together) draw differently (claim tokens never use this seed).
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            nanos ^ (u64::from(std::process::id()) << 32) ^ 0x6E63_6163_6865
        });
        Ok(Config {
            backend: backends.sync,
            #[cfg(feature = "tokio")]
            async_backend: backends.nonblocking,
            servers,
            clock: self.clock,
            name: self.name,
            keys: KeyMaker {
                flavor: self.flavor.into(),
                version: self.version,
                function: self.key_function,
            },
            format: self.format,
            default_ttl: self.default_ttl,
            herd_timeout: self.herd_timeout,
            read_failures: self.read_failures,
            write_failures: self.write_failures,
            decode_policy: self.decode_policy,
            lease_ttl: self.lease_ttl,
            max_wait: self.max_wait,
            max_load_time: self.max_load_time,
            early_beta: self.early_beta,
            stale_on_error: self.stale_on_error,
            seed,
            near: self.near,
            write_settle: self
                .server
                .connect_timeout
                .saturating_add(self.server.io_timeout.saturating_mul(2)),
            private_store,
            bus: self.bus,
            bus_heartbeat: self.bus_heartbeat.unwrap_or(DEFAULT_BUS_HEARTBEAT),
            bus_wait: self
                .server
                .connect_timeout
                .saturating_add(self.server.io_timeout),
            custom_clock: self.custom_clock,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `b` fails to build, with a configuration error naming `setting`.
    #[track_caller]
    fn refused(b: CacheBuilder, setting: &str) {
        let e = b.build().unwrap_err();
        assert!(
            e.is_config() && e.to_string().contains(setting),
            "{setting}: {e}"
        );
    }

    #[test]
    fn settings_outside_their_range_are_refused_at_build() {
        let memcached = || Cache::builder().memcached(["127.0.0.1:1"]);
        refused(Cache::builder().item_size(0), "item_size");
        refused(Cache::builder().item_size(MIN_ITEM_SIZE - 1), "item_size");
        refused(
            Cache::builder().near_cache(MIN_NEAR_CAPACITY - 1),
            "near_cache",
        );
        refused(
            Cache::builder().near_ttl(Duration::from_secs(1)),
            "near_cache",
        );
        refused(
            Cache::builder()
                .near_cache(MIN_NEAR_CAPACITY)
                .near_ttl(Duration::ZERO),
            "near_ttl",
        );
        refused(
            Cache::builder()
                .near_ttl(MAX_NEAR_TTL + Duration::from_millis(1))
                .near_cache(MIN_NEAR_CAPACITY),
            "near_ttl",
        );
        refused(Cache::builder().item_size(MAX_ITEM_SIZE + 1), "item_size");
        refused(memcached().item_size(0), "item_size");
        refused(Cache::builder().max_wait(Duration::ZERO), "max_wait");
        refused(
            Cache::builder().max_load_time(Duration::ZERO),
            "max_load_time",
        );
        refused(Cache::builder().max_decode_size(0), "max_decode_size");
        refused(Cache::builder().failure_limit(0), "failure_limit");
        // the bounds themselves build
        assert!(Cache::builder().item_size(MIN_ITEM_SIZE).build().is_ok());
        let cache = Cache::builder()
            .memory_capacity(MIN_ITEM_SIZE * 16)
            .item_size(MIN_ITEM_SIZE)
            .build()
            .unwrap();
        cache.set("k", &1u8, Duration::from_secs(60)).unwrap();
        assert_eq!(cache.get::<u8>("k").unwrap(), Some(1));
    }

    #[test]
    fn rejects_bad_configuration() {
        let memcached = || Cache::builder().memcached(["127.0.0.1:9"]);
        refused(Cache::builder().flavor("has space"), "flavor");
        refused(Cache::builder().flavor("x".repeat(240)), "");
        let none: [&str; 0] = [];
        refused(Cache::builder().memcached(none), "empty");
        refused(Cache::builder().memcached(["nope"]), "");
        refused(Cache::builder().herd_timeout(Duration::ZERO), "");
        // memcached's one-second expiry cannot carry a renewable lease shorter than 2 s
        refused(
            Cache::builder().lease_ttl(Duration::from_millis(1999)),
            "lease_ttl",
        );
        assert!(Cache::builder().lease_ttl(MIN_LEASE_TTL).build().is_ok());
        // a zero timeout could never connect or read a reply
        refused(
            memcached().connect_timeout(Duration::ZERO),
            "connect_timeout",
        );
        refused(memcached().io_timeout(Duration::ZERO), "io_timeout");
        // a retry interval too long to add to a clock
        refused(memcached().retry_interval(Duration::MAX), "retry_interval");
    }

    /// What `build()` logs, captured.
    fn logs_of(build: impl FnOnce()) -> String {
        #[derive(Clone, Default)]
        struct Buf(Arc<parking_lot::Mutex<Vec<u8>>>);
        impl std::io::Write for Buf {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buf = Buf::default();
        let out = buf.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || out.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .finish();
        crate::test_support::scoped(subscriber, build);
        String::from_utf8_lossy(&buf.0.lock()).into_owned()
    }

    #[test]
    fn build_logs_the_backend_and_warns_about_ignored_settings() {
        let logs = logs_of(|| {
            Cache::builder()
                .pool_size(4)
                .io_timeout(Duration::from_secs(1))
                .flavor("f")
                .build()
                .unwrap();
        });
        assert!(
            logs.contains(
                "memory (in-process, private to this cache: another build is another store"
            ),
            "{logs}"
        );
        assert!(logs.contains("WARN") && logs.contains("ignored"), "{logs}");
        assert!(
            logs.contains("pool_size") && logs.contains("io_timeout"),
            "{logs}"
        );
        // memcached with memcached settings: built (never connects), nothing ignored
        let logs = logs_of(|| {
            Cache::builder()
                .memcached(["127.0.0.1:9"])
                .pool_size(4)
                .build()
                .unwrap();
        });
        assert!(logs.contains("backend=\"memcached\""), "{logs}");
        assert!(!logs.contains("WARN"), "{logs}");
        // a memory setting with memcached
        let logs = logs_of(|| {
            Cache::builder()
                .memory_capacity(1 << 20)
                .memcached(["127.0.0.1:9"])
                .build()
                .unwrap();
        });
        assert!(
            logs.contains("WARN") && logs.contains("memory_capacity"),
            "{logs}"
        );
    }
}
