//! What is measured: the cached value, the loader, and one read of the hot key in each mode.

use std::cell::Cell;
use std::error::Error;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use newcache::{
    AsyncCache, Backend, Cache, Herd, MemcachedBackend, MemcachedConfig, RedisBackend, RedisConfig,
    ServerSpec, StoreMode,
};
use serde::{Deserialize, Serialize};

use crate::args::{Args, Mode};

/// Milliseconds since the unix epoch.
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Seconds since the unix epoch.
pub fn unix_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The cached value, as the Python script's `{"id": 1, "name": "x" * 80, "gen": n}`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Value {
    pub id: u64,
    pub name: String,
    pub generation: u64,
}

/// The cache a mode reads through (`early` turns on XFetch early refresh).
pub fn cache_for(args: &Args, mode: Mode) -> Result<Cache, newcache::Error> {
    let builder = on_server(args)
        .flavor("stampede")
        .lease_ttl(Duration::from_secs(5))
        .pool_size(args.threads as u32 + 4);
    if mode == Mode::Early {
        builder.early_refresh(1.0)
    } else {
        builder
    }
    .build()
}

/// The async cache of the `async` modes, with the settings of [`cache_for`].
pub fn async_cache_for(args: &Args) -> Result<AsyncCache, newcache::Error> {
    on_server(args)
        .flavor("stampede")
        .lease_ttl(Duration::from_secs(5))
        .build_async()
}

/// A builder on the run's server: memcached (`--servers`) or Redis (`--redis`).
fn on_server(args: &Args) -> newcache::CacheBuilder {
    if !args.redis_cluster.is_empty() {
        return Cache::builder().redis_cluster(args.redis_cluster.iter().cloned());
    }
    match &args.redis {
        Some(url) => Cache::builder().redis(url.clone()),
        None => Cache::builder().memcached(&args.servers),
    }
}

/// The loader of the async modes: sleeps (a tokio timer), then counts itself in memcached.
#[derive(Clone)]
pub struct AsyncLoader {
    cache: AsyncCache,
    counter: String,
    sleep: Duration,
    starts: Arc<Mutex<Vec<f64>>>,
}

impl AsyncLoader {
    pub fn new(cache: &AsyncCache, key: &str, loader_ms: f64) -> Self {
        AsyncLoader {
            cache: cache.clone(),
            counter: counter_key(key),
            sleep: Duration::from_secs_f64(loader_ms / 1000.0),
            starts: Arc::default(),
        }
    }

    /// Loads; `loaded` records that this read ran the loader itself.
    pub async fn load(&self, loaded: &AtomicBool) -> Result<Value, newcache::Error> {
        loaded.store(true, Ordering::Relaxed);
        let t = unix_secs();
        tokio::time::sleep(self.sleep).await;
        let generation = self.cache.incr(&self.counter, 1).await?;
        self.starts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(t);
        Ok(Value {
            id: 1,
            name: "x".repeat(80),
            generation,
        })
    }

    pub fn starts(&self) -> Vec<f64> {
        self.starts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// One read of the hot key in an async mode; `loaded` is set if this read ran the loader (a
/// background refresh does not count: it runs in a task of its own, as the sync mode's runs on
/// a thread of its own).
pub async fn read_async(
    mode: Mode,
    cache: &AsyncCache,
    key: &str,
    ttl: Duration,
    loader: &AsyncLoader,
    loaded: &AtomicBool,
) -> Result<Value, newcache::Error> {
    if mode == Mode::AsyncBackground {
        let loader = loader.clone();
        return cache
            .get_or_set_with_background(key, ttl, move || async move {
                loader.load(&AtomicBool::new(false)).await
            })
            .await
            .map_err(Into::into);
    }
    cache
        .get_or_set_with(key, ttl, || loader.load(loaded))
        .await
        .map_err(Into::into)
}

/// The memcached counter that counts a run's loads.
pub fn counter_key(key: &str) -> String {
    format!("{key}:loads")
}

thread_local! {
    static LOADED: Cell<bool> = const { Cell::new(false) };
}

/// Forgets whether this thread ran the loader (before a read).
pub fn clear_loaded() {
    LOADED.set(false);
}

/// Whether this thread ran the loader since [`clear_loaded`]: the read was a caller load.
pub fn loaded() -> bool {
    LOADED.get()
}

/// The expensive computation: sleeps, then counts itself in memcached.
#[derive(Clone)]
pub struct Loader {
    cache: Cache,
    counter: String,
    sleep: Duration,
    /// Unix seconds at which this process's loads started.
    starts: Arc<Mutex<Vec<f64>>>,
}

impl Loader {
    pub fn new(cache: &Cache, key: &str, loader_ms: f64) -> Self {
        Loader {
            cache: cache.clone(),
            counter: counter_key(key),
            sleep: Duration::from_secs_f64(loader_ms / 1000.0),
            starts: Arc::default(),
        }
    }

    pub fn load(&self) -> Result<Value, newcache::Error> {
        LOADED.set(true);
        let t = unix_secs();
        std::thread::sleep(self.sleep);
        let generation = self.cache.incr(&self.counter, 1)?;
        self.starts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(t);
        Ok(Value {
            id: 1,
            name: "x".repeat(80),
            generation,
        })
    }

    /// When the loads so far started (unix seconds).
    pub fn starts(&self) -> Vec<f64> {
        self.starts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// How long django-newcache keeps a stale value for the herd while one reader reloads.
const HERD_TIMEOUT_S: u64 = 60;

/// django-newcache's algorithm on raw memcached (or Redis), for comparison: it stores (soft
/// expiry in whole seconds, value); the first reader past the soft expiry re-sets it for the herd
/// timeout without CAS and reloads.
pub struct OriginalNewcache {
    backend: Box<dyn Backend>,
    key: String,
}

impl OriginalNewcache {
    pub fn new(args: &Args, cache: &Cache, key: &str) -> Result<Self, Box<dyn Error>> {
        if !args.redis_cluster.is_empty() {
            let seeds = args
                .redis_cluster
                .iter()
                .map(|u| {
                    let mut cfg = RedisConfig::new(u.clone());
                    cfg.pool_size = args.threads as u32 + 4;
                    cfg
                })
                .collect();
            return Ok(OriginalNewcache {
                backend: Box::new(newcache::RedisCluster::new(seeds)?),
                key: cache.make_key(key),
            });
        }
        if let Some(url) = &args.redis {
            let mut cfg = RedisConfig::new(url.clone());
            cfg.pool_size = args.threads as u32 + 4;
            return Ok(OriginalNewcache {
                backend: Box::new(RedisBackend::new(cfg)?),
                key: cache.make_key(key),
            });
        }
        let specs = args
            .servers
            .iter()
            .map(|s| ServerSpec::parse(s))
            .collect::<Result<Vec<_>, _>>()?;
        let mut cfg = MemcachedConfig::new(specs);
        cfg.pool_size = args.threads as u32 + 4;
        Ok(OriginalNewcache {
            backend: Box::new(MemcachedBackend::new(cfg)?),
            key: cache.make_key(key),
        })
    }

    fn pack(value: &Value, timeout: u64) -> Vec<u8> {
        let soft = unix_ms() / 1000 + timeout;
        bincode::serde::encode_to_vec((soft, value), bincode::config::standard())
            .unwrap_or_default()
    }

    fn get(&self) -> Result<Option<Value>, newcache::Error> {
        let Some(item) = self.backend.get(&self.key)? else {
            return Ok(None);
        };
        let Ok(((soft, v), _)) = bincode::serde::decode_from_slice::<(u64, Value), _>(
            &item.value,
            bincode::config::standard(),
        ) else {
            return Ok(None);
        };
        if soft < unix_ms() / 1000 {
            // newcache: re-set the stale value for the herd timeout, tell this caller "miss".
            let bytes = Self::pack(&v, HERD_TIMEOUT_S);
            self.backend.store(newcache::Write::new(
                StoreMode::Set,
                &self.key,
                &bytes,
                0,
                HERD_TIMEOUT_S as u32,
            ))?;
            return Ok(None);
        }
        Ok(Some(v))
    }

    fn set(&self, v: &Value, ttl: u64) -> Result<(), newcache::Error> {
        let bytes = Self::pack(v, ttl);
        let hard_ttl = (ttl + HERD_TIMEOUT_S) as u32;
        self.backend
            .store(newcache::Write::new(
                StoreMode::Set,
                &self.key,
                &bytes,
                0,
                hard_ttl,
            ))
            .map(|_| ())
    }
}

/// One read of the hot key in a mode: what the workers time.
pub struct Reader<'a> {
    pub mode: Mode,
    pub cache: &'a Cache,
    pub key: &'a str,
    pub ttl: Duration,
    pub loader: &'a Loader,
    /// The `newcache` mode's store.
    pub original: Option<&'a OriginalNewcache>,
}

impl Reader<'_> {
    pub fn read(&self) -> Result<Value, newcache::Error> {
        let (cache, key, ttl) = (self.cache, self.key, self.ttl);
        match self.mode {
            Mode::Naive => match cache.get::<Value>(key)? {
                Some(v) => Ok(v),
                None => {
                    let v = self.loader.load()?;
                    cache.set_with(key, &v, ttl, Herd::Off)?;
                    Ok(v)
                }
            },
            Mode::Newcache => {
                let original = self
                    .original
                    .ok_or_else(|| newcache::Error::from(std::io::Error::other("no newcache")))?;
                match original.get()? {
                    Some(v) => Ok(v),
                    None => {
                        let v = self.loader.load()?;
                        original.set(&v, ttl.as_secs())?;
                        Ok(v)
                    }
                }
            }
            Mode::Default | Mode::Early => cache
                .get_or_set_with(key, ttl, || self.loader.load())
                .map_err(Into::into),
            Mode::Background => {
                let loader = self.loader.clone();
                cache
                    .get_or_set_with_background(key, ttl, move || loader.load())
                    .map_err(Into::into)
            }
            Mode::Async | Mode::AsyncBackground => Err(newcache::Error::from(
                std::io::Error::other("async modes read through AsyncReader"),
            )),
        }
    }
}
