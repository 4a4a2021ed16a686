//! The front end a behaviour test drives: the sync `Cache`, or the `AsyncCache` awaited on a
//! shared multi-thread runtime. Every suite that runs `on_every_backend!` runs on both, so the
//! async front end is held to exactly the sync one's guarantees.

use std::collections::HashMap;
use std::sync::OnceLock;

use newcache::{AsyncCache, Cache, CacheBuilder, Herd, LoadError, Result, Stats, Ttl};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Which front end a test drives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Front {
    Sync,
    Async,
}

/// The runtime the async front end's futures are awaited on (2 workers, as on CI), from any
/// test thread (`block_on` runs the future on the calling thread).
pub fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("test runtime")
    })
}

/// A cache of either front end, with the sync API.
#[derive(Clone, Debug)]
pub enum TestCache {
    Sync(Cache),
    Async(AsyncCache),
}

/// Builds a [`TestCache`] for a front end.
pub trait BuildFor {
    fn build_front(self, front: Front) -> TestCache;
}

impl BuildFor for CacheBuilder {
    fn build_front(self, front: Front) -> TestCache {
        match front {
            Front::Sync => TestCache::Sync(self.build().expect("test cache builds")),
            Front::Async => TestCache::Async(self.build_async().expect("test cache builds")),
        }
    }
}

type Boxed<R> = std::pin::Pin<Box<dyn std::future::Future<Output = R> + Send>>;

fn wait<F: std::future::Future>(f: F) -> F::Output {
    runtime().block_on(f)
}

/// Runs `call` with an async loader that, when called, runs the sync `loader` on a scoped
/// thread and awaits its result.
fn off_thread<A, R, F, O>(
    loader: F,
    call: impl FnOnce(Box<dyn FnOnce(A) -> Boxed<R> + Send + '_>) -> O,
) -> O
where
    A: Send,
    R: Send + 'static,
    F: FnOnce(A) -> R + Send,
{
    let (args_tx, args_rx) = std::sync::mpsc::channel::<A>();
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<R>();
    std::thread::scope(|s| {
        s.spawn(move || {
            // Never called: the sender is dropped with the loader, and this thread ends.
            if let Ok(args) = args_rx.recv() {
                let _ = done_tx.send(loader(args));
            }
        });
        call(Box::new(move |args: A| {
            let _ = args_tx.send(args);
            Box::pin(async move { done_rx.await.expect("the loader thread did not panic") })
        }))
    })
}

impl TestCache {
    pub fn get<T: DeserializeOwned>(&self, key: &str) -> Result<Option<T>> {
        match self {
            TestCache::Sync(c) => c.get(key),
            TestCache::Async(c) => wait(c.get(key)),
        }
    }

    pub fn set<T: Serialize + Sync + ?Sized>(
        &self,
        key: &str,
        value: &T,
        ttl: impl Into<Ttl>,
    ) -> Result<()> {
        match self {
            TestCache::Sync(c) => c.set(key, value, ttl),
            TestCache::Async(c) => wait(c.set(key, value, ttl)),
        }
    }

    pub fn set_with<T: Serialize + Sync + ?Sized>(
        &self,
        key: &str,
        value: &T,
        ttl: impl Into<Ttl>,
        herd: Herd,
    ) -> Result<()> {
        match self {
            TestCache::Sync(c) => c.set_with(key, value, ttl, herd),
            TestCache::Async(c) => wait(c.set_with(key, value, ttl, herd)),
        }
    }

    pub fn add<T: Serialize + Sync + ?Sized>(
        &self,
        key: &str,
        value: &T,
        ttl: impl Into<Ttl>,
    ) -> Result<bool> {
        match self {
            TestCache::Sync(c) => c.add(key, value, ttl),
            TestCache::Async(c) => wait(c.add(key, value, ttl)),
        }
    }

    pub fn delete(&self, key: &str) -> Result<bool> {
        match self {
            TestCache::Sync(c) => c.delete(key),
            TestCache::Async(c) => wait(c.delete(key)),
        }
    }

    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub fn clear(&self) -> Result<()> {
        match self {
            TestCache::Sync(c) => c.clear(),
            TestCache::Async(c) => wait(c.clear()),
        }
    }

    pub fn get_many<T: DeserializeOwned>(
        &self,
        keys: &[impl AsRef<str> + Sync],
    ) -> Result<HashMap<String, T>> {
        match self {
            TestCache::Sync(c) => c.get_many(keys),
            TestCache::Async(c) => wait(c.get_many(keys)),
        }
    }

    pub fn set_many<'v, K, T, I>(&self, items: I, ttl: impl Into<Ttl>) -> Result<Vec<String>>
    where
        K: AsRef<str>,
        T: Serialize + ?Sized + 'v,
        I: IntoIterator<Item = (K, &'v T)>,
    {
        match self {
            TestCache::Sync(c) => c.set_many(items, ttl),
            TestCache::Async(c) => wait(c.set_many(items, ttl)),
        }
    }

    pub fn delete_many(&self, keys: &[impl AsRef<str> + Sync]) -> Result<usize> {
        match self {
            TestCache::Sync(c) => c.delete_many(keys),
            TestCache::Async(c) => wait(c.delete_many(keys)),
        }
    }

    pub fn touch(&self, key: &str, ttl: impl Into<Ttl>) -> Result<bool> {
        match self {
            TestCache::Sync(c) => c.touch(key, ttl),
            TestCache::Async(c) => wait(c.touch(key, ttl)),
        }
    }

    pub fn set_counter(&self, key: &str, value: u64, ttl: impl Into<Ttl>) -> Result<()> {
        match self {
            TestCache::Sync(c) => c.set_counter(key, value, ttl),
            TestCache::Async(c) => wait(c.set_counter(key, value, ttl)),
        }
    }

    pub fn incr(&self, key: &str, delta: u64) -> Result<u64> {
        match self {
            TestCache::Sync(c) => c.incr(key, delta),
            TestCache::Async(c) => wait(c.incr(key, delta)),
        }
    }

    pub fn incr_or_create(&self, key: &str, delta: u64, ttl: impl Into<Ttl>) -> Result<u64> {
        match self {
            TestCache::Sync(c) => c.incr_or_create(key, delta, ttl),
            TestCache::Async(c) => wait(c.incr_or_create(key, delta, ttl)),
        }
    }

    pub fn decr(&self, key: &str, delta: u64) -> Result<u64> {
        match self {
            TestCache::Sync(c) => c.decr(key, delta),
            TestCache::Async(c) => wait(c.decr(key, delta)),
        }
    }

    pub fn get_counter(&self, key: &str) -> Result<Option<u64>> {
        match self {
            TestCache::Sync(c) => c.get_counter(key),
            TestCache::Async(c) => wait(c.get_counter(key)),
        }
    }

    pub fn make_key(&self, key: &str) -> String {
        match self {
            TestCache::Sync(c) => c.make_key(key),
            TestCache::Async(c) => c.make_key(key),
        }
    }

    pub fn with_version(&self, version: u64) -> TestCache {
        match self {
            TestCache::Sync(c) => TestCache::Sync(c.with_version(version)),
            TestCache::Async(c) => TestCache::Async(c.with_version(version)),
        }
    }

    pub fn ping(&self) -> std::result::Result<(), newcache::PingError> {
        match self {
            TestCache::Sync(c) => c.ping(),
            TestCache::Async(c) => wait(c.ping()),
        }
    }

    pub fn stats(&self) -> Stats {
        match self {
            TestCache::Sync(c) => c.stats(),
            TestCache::Async(c) => c.stats(),
        }
    }

    /// The loader is a sync closure that may block (sleep, wait on a barrier). The async front
    /// end runs it on a thread of its own and awaits its result, as an async loader awaits a
    /// database, so that the future keeps being polled meanwhile (claims are renewed inside it).
    pub fn get_or_set_with<T, F, E>(
        &self,
        key: &str,
        ttl: impl Into<Ttl>,
        loader: F,
    ) -> Result<T, LoadError<E>>
    where
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
        F: FnOnce() -> std::result::Result<T, E> + Send,
        E: std::error::Error + Send + Sync + 'static,
    {
        match self {
            TestCache::Sync(c) => c.get_or_set_with(key, ttl, loader),
            TestCache::Async(c) => off_thread(
                move |()| loader(),
                |load| wait(c.get_or_set_with(key, ttl, move || load(()))),
            ),
        }
    }

    pub fn get_or_set_with_background<T, F, E>(
        &self,
        key: &str,
        ttl: impl Into<Ttl>,
        loader: F,
    ) -> Result<T, LoadError<E>>
    where
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
        F: FnOnce() -> std::result::Result<T, E> + Send + 'static,
        E: std::error::Error + Send + Sync + 'static,
    {
        match self {
            TestCache::Sync(c) => c.get_or_set_with_background(key, ttl, loader),
            TestCache::Async(c) => wait(c.get_or_set_with_background(key, ttl, || async move {
                // A sync loader that may block: off the runtime's workers.
                tokio::task::spawn_blocking(loader)
                    .await
                    .expect("the loader did not panic")
            })),
        }
    }

    pub fn get_many_or_set_with<T, K, F, E>(
        &self,
        keys: &[K],
        ttl: impl Into<Ttl>,
        loader: F,
    ) -> Result<HashMap<String, T>, LoadError<E>>
    where
        T: Serialize + DeserializeOwned + Send + 'static,
        K: AsRef<str> + Sync,
        F: FnOnce(&[String]) -> std::result::Result<HashMap<String, T>, E> + Send,
        E: std::error::Error + Send + Sync + 'static,
    {
        match self {
            TestCache::Sync(c) => c.get_many_or_set_with(keys, ttl, loader),
            TestCache::Async(c) => off_thread(
                move |wanted: Vec<String>| loader(&wanted),
                |load| wait(c.get_many_or_set_with(keys, ttl, load)),
            ),
        }
    }
}
