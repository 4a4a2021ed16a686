//! The memcached backend: one r2d2 pool per server, keys placed by ketama, batches split by server
//! and sent to the servers concurrently, one pipelined round trip each.

mod config;
mod conn;
mod health;
mod ring;
mod routing;
mod server;
pub(crate) mod wire;

pub use self::config::{
    DEFAULT_CONNECT_TIMEOUT, DEFAULT_FAILURE_LIMIT, DEFAULT_IO_TIMEOUT, DEFAULT_POOL_SIZE,
    DEFAULT_RETRY_INTERVAL, DeadServerPolicy, MemcachedConfig, ServerSpec,
};

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::RwLock;

use scheduled_thread_pool::ScheduledThreadPool;

use self::conn::{Conn, Manager};
use self::health::{Gate, Health};
use self::routing::Routing;
use self::server::Server;
use super::{Backend, Item, StoreMode, StoreOutcome, Write, max_value_size};
use crate::error::{Error, ErrorKind, Result};

/// memcached over its text protocol (which proxies such as twemproxy and mcrouter also speak).
///
/// `build()` never connects: connections are made on first use, in the background, and an
/// operation waits at most `connect_timeout` for one, so an unreachable server costs a bounded
/// wait and an error, never a hang. A restarted server is used again as soon as it answers.
pub struct MemcachedBackend {
    servers: Vec<Server>,
    routing: Routing,
    item_size: usize,
    failure_limit: u32,
    retry_interval: Duration,
    started: Instant,
}

impl fmt::Debug for MemcachedBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemcachedBackend")
            .field("servers", &self.servers)
            .field("item_size", &self.item_size)
            .finish_non_exhaustive()
    }
}

impl MemcachedBackend {
    /// Sets up the pools (without connecting).
    pub fn new(config: MemcachedConfig) -> Result<MemcachedBackend> {
        if config.servers.is_empty() {
            return Err(Error::config("the memcached server list is empty"));
        }
        if config.pool_size == 0 {
            return Err(Error::config("pool_size must be at least 1"));
        }
        let connector = Arc::new(
            ScheduledThreadPool::builder()
                .num_threads(2)
                .thread_name_pattern("newcache-connect-{}")
                .build(),
        );
        let servers = config
            .servers
            .iter()
            .map(|spec| {
                let addr = spec.addr();
                let (connect_timeout, io_timeout) = (config.connect_timeout, config.io_timeout);
                let (pool_size, connector) = (config.pool_size, connector.clone());
                let pool_addr = addr.clone();
                let make_pool = move || {
                    let manager = Manager {
                        addr: pool_addr.clone(),
                        connect_timeout,
                        io_timeout,
                    };
                    r2d2::Pool::builder()
                        .max_size(pool_size)
                        .min_idle(Some(0))
                        // r2d2 defaults to a `version` round trip on every checkout, which doubles
                        // the cost of a get. Broken connections are caught by `has_broken` instead.
                        .test_on_check_out(false)
                        .connection_timeout(connect_timeout)
                        .idle_timeout(Some(Duration::from_secs(300)))
                        .error_handler(Box::new(r2d2::NopErrorHandler))
                        .thread_pool(connector.clone())
                        .build_unchecked(manager)
                };
                Server {
                    addr,
                    pool: RwLock::new(make_pool()),
                    make_pool: Box::new(make_pool),
                    health: Health::default(),
                }
            })
            .collect();
        Ok(MemcachedBackend {
            servers,
            routing: Routing::new(&config.servers, config.dead_servers),
            item_size: config.item_size,
            failure_limit: config.failure_limit.max(1),
            retry_interval: config.retry_interval,
            started: Instant::now(),
        })
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    fn routable(&self) -> impl Fn(usize) -> bool + '_ {
        let now = self.now_ms();
        move |i| self.servers[i].health.routable(now)
    }

    fn server_index(&self, key: &str) -> usize {
        self.routing.route(key, self.routable())
    }

    fn by_server<'k>(&self, keys: impl Iterator<Item = &'k str>) -> Vec<(usize, Vec<usize>)> {
        self.routing.by_server(keys, self.routable())
    }

    /// Runs `op` on server `i`, through its health gate, recording the outcome.
    fn run<T>(&self, i: usize, op: impl FnOnce(&mut Conn) -> Result<T>) -> Result<T> {
        let server = &self.servers[i];
        if server.health.gate(self.now_ms(), self.retry_interval) == Gate::FailFast {
            return Err(Error::new(
                ErrorKind::Backend,
                format!(
                    "memcached at {} is marked dead (probed again every {:?})",
                    server.addr, self.retry_interval
                ),
            ));
        }
        let r = server.with_conn(op);
        match &r {
            Err(e) if e.is_backend() => {
                if server
                    .health
                    .failure(self.now_ms(), self.failure_limit, self.retry_interval)
                {
                    *server.pool.write() = (server.make_pool)();
                    tracing::warn!(
                        server = %server.addr,
                        error = %e,
                        "newcache: memcached server marked dead after {} consecutive failures; \
                         probing it every {:?}",
                        self.failure_limit,
                        self.retry_interval
                    );
                }
            }
            _ => {
                if server.health.success() {
                    tracing::warn!(server = %server.addr, "newcache: memcached server is back");
                }
            }
        }
        r
    }

    /// Runs `op` on the server that holds `key`.
    fn on_key<T>(&self, key: &str, op: impl FnOnce(&mut Conn) -> Result<T>) -> Result<T> {
        self.run(self.server_index(key), op)
    }

    /// Runs `op` once per server group, concurrently when there are several; results in group order.
    fn fan_out<T: Send>(
        &self,
        groups: &[(usize, Vec<usize>)],
        op: impl Fn(usize, &[usize]) -> Result<T> + Sync,
    ) -> Vec<Result<T>> {
        match groups {
            [] => Vec::new(),
            [(s, positions)] => vec![op(*s, positions)],
            [(s0, p0), rest @ ..] => std::thread::scope(|scope| {
                let handles: Vec<_> = rest
                    .iter()
                    .map(|(s, p)| {
                        let op = &op;
                        scope.spawn(move || op(*s, p))
                    })
                    .collect();
                let mut out = vec![op(*s0, p0)];
                out.extend(handles.into_iter().map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(Error::backend("a batch worker thread panicked")))
                }));
                out
            }),
        }
    }

    /// Which configured server (index into the server list) holds a derived key when every
    /// server is up: libmemcached's weighted ketama placement. For diagnostics and for checking
    /// that other clients (pylibmc, PHP's memcached) agree.
    pub fn server_of(&self, derived_key: &str) -> usize {
        self.routing.home(derived_key)
    }

    /// The server's version string (a cheap liveness probe).
    pub fn version(&self, server: usize) -> Result<String> {
        if server >= self.servers.len() {
            return Err(Error::config(format!("no server #{server}")));
        }
        self.run(server, |c| c.version())
    }
}

impl Backend for MemcachedBackend {
    fn get(&self, key: &str) -> Result<Option<Item>> {
        let max = self.item_size;
        Ok(self.on_key(key, |c| c.gets(&[key], max))?.pop().flatten())
    }

    fn get_many(&self, keys: &[&str]) -> Vec<Result<Option<Item>>> {
        let max = self.item_size;
        if self.servers.len() == 1 {
            return match self.run(0, |c| c.gets(keys, max)) {
                Ok(items) => items.into_iter().map(Ok).collect(),
                Err(e) => vec![Err(e); keys.len()],
            };
        }
        let groups = self.by_server(keys.iter().copied());
        let mut out: Vec<Result<Option<Item>>> = (0..keys.len()).map(|_| Ok(None)).collect();
        let results = self.fan_out(&groups, |server, positions| {
            let ks: Vec<&str> = positions.iter().map(|&i| keys[i]).collect();
            self.run(server, |c| c.gets(&ks, max))
        });
        for ((_, positions), r) in groups.iter().zip(results) {
            match r {
                Ok(items) => {
                    for (&i, item) in positions.iter().zip(items) {
                        out[i] = Ok(item);
                    }
                }
                Err(e) => positions.iter().for_each(|&i| out[i] = Err(e.clone())),
            }
        }
        out
    }

    fn store(
        &self,
        mode: StoreMode,
        key: &str,
        value: &[u8],
        flags: u32,
        exptime: u32,
    ) -> Result<StoreOutcome> {
        let max = self.max_value_size(key);
        if value.len() > max {
            return Err(super::memory::too_large(value.len(), max));
        }
        self.on_key(key, |c| c.store(mode, key, value, flags, exptime))
    }

    fn store_then_get(&self, w: Write<'_>) -> Result<(StoreOutcome, Option<Item>)> {
        let max = self.max_value_size(w.key);
        if w.value.len() > max {
            return Err(super::memory::too_large(w.value.len(), max));
        }
        let item_max = self.item_size;
        self.on_key(w.key, |c| c.store_then_get(&w, item_max))
    }

    fn store_many(&self, writes: &[Write<'_>]) -> Vec<Result<StoreOutcome>> {
        let mut out: Vec<Result<StoreOutcome>> = writes
            .iter()
            .map(|w| {
                let max = self.max_value_size(w.key);
                if w.value.len() > max {
                    Err(super::memory::too_large(w.value.len(), max))
                } else {
                    Ok(StoreOutcome::NotStored)
                }
            })
            .collect();
        let sendable: Vec<usize> = (0..writes.len()).filter(|&i| out[i].is_ok()).collect();
        let groups = self.by_server(sendable.iter().map(|&i| writes[i].key));
        let results = self.fan_out(&groups, |server, positions| {
            let batch: Vec<Write<'_>> = positions.iter().map(|&p| writes[sendable[p]]).collect();
            self.run(server, |c| c.store_many(&batch))
        });
        for ((_, positions), r) in groups.iter().zip(results) {
            match r {
                Ok(outcomes) => {
                    for (&p, o) in positions.iter().zip(outcomes) {
                        out[sendable[p]] = o;
                    }
                }
                Err(e) => positions
                    .iter()
                    .for_each(|&p| out[sendable[p]] = Err(e.clone())),
            }
        }
        out
    }

    fn delete(&self, key: &str) -> Result<bool> {
        self.on_key(key, |c| c.delete(key))
    }

    fn delete_many(&self, keys: &[&str]) -> Vec<Result<bool>> {
        let groups = self.by_server(keys.iter().copied());
        let mut out: Vec<Result<bool>> = (0..keys.len()).map(|_| Ok(false)).collect();
        let results = self.fan_out(&groups, |server, positions| {
            let ks: Vec<&str> = positions.iter().map(|&i| keys[i]).collect();
            self.run(server, |c| c.delete_many(&ks))
        });
        for ((_, positions), r) in groups.iter().zip(results) {
            match r {
                Ok(found) => {
                    for (&i, f) in positions.iter().zip(found) {
                        out[i] = Ok(f);
                    }
                }
                Err(e) => positions.iter().for_each(|&i| out[i] = Err(e.clone())),
            }
        }
        out
    }

    fn touch(&self, key: &str, exptime: u32) -> Result<bool> {
        self.on_key(key, |c| c.touch(key, exptime))
    }

    fn incr(&self, key: &str, delta: u64) -> Result<Option<u64>> {
        self.on_key(key, |c| c.arith(true, key, delta))
    }

    fn decr(&self, key: &str, delta: u64) -> Result<Option<u64>> {
        self.on_key(key, |c| c.arith(false, key, delta))
    }

    fn flush_all(&self) -> Result<()> {
        let groups: Vec<(usize, Vec<usize>)> =
            (0..self.servers.len()).map(|i| (i, vec![])).collect();
        for r in self.fan_out(&groups, |server, _| self.run(server, |c| c.flush_all())) {
            r?;
        }
        Ok(())
    }

    fn max_value_size(&self, key: &str) -> usize {
        max_value_size(self.item_size, key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn build_never_connects() {
        // Port 9 on loopback: nothing listens. Building must not block or fail.
        let cfg = MemcachedConfig::new(vec![ServerSpec::parse("127.0.0.1:9").unwrap()]);
        let b = MemcachedBackend::new(cfg).unwrap();
        let t = std::time::Instant::now();
        let e = b.get("k").unwrap_err();
        assert!(e.is_backend(), "{e}");
        assert!(t.elapsed() < DEFAULT_CONNECT_TIMEOUT + Duration::from_millis(400));
    }
}
