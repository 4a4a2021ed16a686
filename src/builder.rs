//! `CacheBuilder`: every setting with its default, validated by `build()`.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::backend::memcached::{MemcachedBackend, MemcachedConfig, ServerSpec};
use crate::backend::memory::{DEFAULT_CAPACITY, MemoryBackend};
use crate::backend::{Backend, DEFAULT_ITEM_SIZE};
use crate::cache::{Cache, DecodePolicy, FailurePolicy, Inner};
use crate::clock::{Clock, SystemClock};
use crate::error::{Error, Result};
use crate::key::{KeyFunction, KeyMaker, default_key, validate_key};
use crate::stats::Counters;

/// Default fresh lifetime of a value: 300 s (Django's default `TIMEOUT`).
pub const DEFAULT_TTL: Duration = Duration::from_secs(300);
/// Default herd timeout: 60 s (django-newcache's `CACHE_HERD_TIMEOUT`).
pub const DEFAULT_HERD_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Clone)]
enum BackendChoice {
    Memory {
        capacity: usize,
    },
    Memcached {
        servers: Vec<String>,
        weighted: Vec<ServerSpec>,
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
#[must_use]
#[derive(Clone)]
pub struct CacheBuilder {
    backend: BackendChoice,
    flavor: String,
    version: u64,
    default_ttl: Duration,
    herd_timeout: Duration,
    key_function: Option<KeyFunction>,
    clock: Arc<dyn Clock>,
    connect_timeout: Duration,
    io_timeout: Duration,
    pool_size: u32,
    item_size: usize,
    read_failures: FailurePolicy,
    write_failures: FailurePolicy,
    decode_policy: DecodePolicy,
}

impl Default for CacheBuilder {
    fn default() -> Self {
        CacheBuilder {
            backend: BackendChoice::Memory {
                capacity: DEFAULT_CAPACITY,
            },
            flavor: String::new(),
            version: 1,
            default_ttl: DEFAULT_TTL,
            herd_timeout: DEFAULT_HERD_TIMEOUT,
            key_function: None,
            clock: Arc::new(SystemClock),
            connect_timeout: crate::backend::memcached::DEFAULT_CONNECT_TIMEOUT,
            io_timeout: crate::backend::memcached::DEFAULT_IO_TIMEOUT,
            pool_size: crate::backend::memcached::DEFAULT_POOL_SIZE,
            item_size: DEFAULT_ITEM_SIZE,
            read_failures: FailurePolicy::Absorb,
            write_failures: FailurePolicy::Propagate,
            decode_policy: DecodePolicy::Error,
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

    /// Uses the in-process memory backend (the default): memcached's semantics, no server.
    pub fn in_memory(mut self) -> Self {
        self.backend = BackendChoice::Memory {
            capacity: DEFAULT_CAPACITY,
        };
        self
    }

    /// Bounds the memory backend's size in bytes (default 64 MiB); implies [`in_memory`](Self::in_memory).
    pub fn memory_capacity(mut self, bytes: usize) -> Self {
        self.backend = BackendChoice::Memory { capacity: bytes };
        self
    }

    /// Uses a backend of your own.
    pub fn backend(mut self, backend: Arc<dyn Backend>) -> Self {
        self.backend = BackendChoice::Custom(backend);
        self
    }

    /// The key prefix (django-newcache's `FLAVOR`); default `""`.
    pub fn flavor(mut self, flavor: impl Into<String>) -> Self {
        self.flavor = flavor.into();
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
    /// clock. Tests pass a [`MockClock`](crate::MockClock).
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// memcached: the longest an operation waits for a connection, connecting included;
    /// default 500 ms.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// memcached: the longest one socket read or write may block; default 500 ms.
    pub fn io_timeout(mut self, timeout: Duration) -> Self {
        self.io_timeout = timeout;
        self
    }

    /// memcached: connections per server; default 16.
    pub fn pool_size(mut self, size: u32) -> Self {
        self.pool_size = size;
        self
    }

    /// memcached: the servers' item size limit (`memcached -I`); default 1 MiB.
    pub fn item_size(mut self, bytes: usize) -> Self {
        self.item_size = bytes;
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

    /// Validates the settings and builds the cache. Never connects to memcached (connections are
    /// made on first use), so it does not block on an unreachable server.
    ///
    /// # Errors
    /// `is_config()` for an empty or malformed server list, a flavor that breaks memcached's key
    /// rules, or a zero herd timeout.
    pub fn build(self) -> Result<Cache> {
        let probe = default_key(&self.flavor, self.version, "");
        validate_key(&probe).map_err(|e| {
            Error::config(format!(
                "flavor {:?} cannot start a memcached key: {e}",
                self.flavor
            ))
        })?;
        if self.herd_timeout.is_zero() {
            return Err(Error::config("herd_timeout must be more than zero"));
        }
        let backend: Arc<dyn Backend> = match self.backend {
            BackendChoice::Custom(b) => b,
            BackendChoice::Memory { capacity } => {
                Arc::new(MemoryBackend::new(capacity, self.clock.clone()))
            }
            BackendChoice::Memcached { servers, weighted } => {
                let mut specs = weighted;
                for s in &servers {
                    specs.push(ServerSpec::parse(s)?);
                }
                let mut config = MemcachedConfig::new(specs);
                config.connect_timeout = self.connect_timeout;
                config.io_timeout = self.io_timeout;
                config.pool_size = self.pool_size;
                config.item_size = self.item_size;
                Arc::new(MemcachedBackend::new(config)?)
            }
        };
        Ok(Cache {
            inner: Arc::new(Inner {
                backend,
                clock: self.clock,
                default_ttl: self.default_ttl,
                herd_timeout: self.herd_timeout,
                read_failures: self.read_failures,
                write_failures: self.write_failures,
                decode_policy: self.decode_policy,
                stats: Counters::default(),
            }),
            keys: KeyMaker {
                flavor: self.flavor.into(),
                version: self.version,
                function: self.key_function,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_configuration() {
        let e = Cache::builder().flavor("has space").build().unwrap_err();
        assert!(e.is_config() && e.to_string().contains("flavor"), "{e}");
        assert!(
            Cache::builder()
                .flavor("x".repeat(240))
                .build()
                .unwrap_err()
                .is_config()
        );
        let none: [&str; 0] = [];
        let e = Cache::builder().memcached(none).build().unwrap_err();
        assert!(e.is_config() && e.to_string().contains("empty"), "{e}");
        assert!(
            Cache::builder()
                .memcached(["nope"])
                .build()
                .unwrap_err()
                .is_config()
        );
        assert!(
            Cache::builder()
                .herd_timeout(Duration::ZERO)
                .build()
                .unwrap_err()
                .is_config()
        );
    }
}
