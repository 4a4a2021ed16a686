//! The memcached backend: one r2d2 pool per server, keys placed by ketama, batches split by server
//! and sent to the servers concurrently, one pipelined round trip each.

mod conn;
mod health;
pub(crate) mod wire;

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::RwLock;

use scheduled_thread_pool::ScheduledThreadPool;

use self::conn::{Conn, Manager};
use self::health::{Gate, Health};
use super::{Backend, DEFAULT_ITEM_SIZE, Item, StoreMode, StoreOutcome, max_value_size};
use crate::error::{Error, ErrorKind, Result};
use crate::ring::{Node, Ring};

/// Default limit on waiting for a pooled connection, including connecting.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
/// Default limit on one socket read or write.
pub const DEFAULT_IO_TIMEOUT: Duration = Duration::from_millis(500);
/// Default connections per server.
pub const DEFAULT_POOL_SIZE: u32 = 16;
/// Default consecutive failures after which a server is marked dead.
pub const DEFAULT_FAILURE_LIMIT: u32 = 2;
/// Default time a dead server is left alone before one caller probes it.
pub const DEFAULT_RETRY_INTERVAL: Duration = Duration::from_secs(1);

/// What happens to the keys of a server that is marked dead.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum DeadServerPolicy {
    /// Its keys fail fast (a backend error, a miss under the default read policy) until it answers
    /// again: no waiting on a dead server, and no stale copies on other servers when it returns
    /// (the default, and libmemcached's default of not ejecting hosts from the key space).
    #[default]
    FailFast,
    /// Its keys are remapped to the remaining servers (ketama moves only its share) until it
    /// answers again, like libmemcached's `auto_eject_hosts`. Reads of those keys miss at first;
    /// when the server returns, its keys map back to it, and values written elsewhere meanwhile are
    /// no longer seen.
    Remap,
}

/// One memcached server: where it is and its share of the keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerSpec {
    host: String,
    port: u16,
    weight: u32,
}

impl ServerSpec {
    /// Parses `host:port`, `memcache://host:port` or `[v6addr]:port` (weight 1).
    pub fn parse(s: &str) -> Result<ServerSpec> {
        let rest = s.trim();
        let rest = rest.strip_prefix("memcache://").unwrap_or(rest);
        let rest = rest.trim_end_matches('/');
        let bad = |why: &str| Error::config(format!("bad memcached server {s:?}: {why}"));
        let (host, port) = if let Some(v6) = rest.strip_prefix('[') {
            let (h, p) = v6
                .split_once("]:")
                .ok_or_else(|| bad("expected [addr]:port"))?;
            (h, p)
        } else {
            rest.rsplit_once(':')
                .ok_or_else(|| bad("expected host:port"))?
        };
        if host.is_empty() || host.contains(char::is_whitespace) {
            return Err(bad("empty or malformed host"));
        }
        let port: u16 = port.parse().map_err(|_| bad("the port is not a number"))?;
        if port == 0 {
            return Err(bad("port 0"));
        }
        Ok(ServerSpec {
            host: host.to_string(),
            port,
            weight: 1,
        })
    }

    /// The same server with another weight (its share of keys is weight / total weight).
    pub fn with_weight(mut self, weight: u32) -> ServerSpec {
        self.weight = weight.max(1);
        self
    }

    fn addr(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// Connection settings of a [`MemcachedBackend`].
#[derive(Debug, Clone)]
pub struct MemcachedConfig {
    /// The servers; at least one.
    pub servers: Vec<ServerSpec>,
    /// How long an operation may wait for a connection (checkout and connect).
    pub connect_timeout: Duration,
    /// How long one socket read or write may take.
    pub io_timeout: Duration,
    /// Connections per server.
    pub pool_size: u32,
    /// The servers' item size limit (`memcached -I`), 1 MiB by default.
    pub item_size: usize,
    /// Consecutive failures (connect errors, timeouts, I/O errors) that mark a server dead.
    pub failure_limit: u32,
    /// How long a dead server is left alone before one caller probes it again.
    pub retry_interval: Duration,
    /// Fail fast or remap the keys of a dead server.
    pub dead_servers: DeadServerPolicy,
}

impl MemcachedConfig {
    /// Defaults for these servers.
    pub fn new(servers: Vec<ServerSpec>) -> MemcachedConfig {
        MemcachedConfig {
            servers,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            io_timeout: DEFAULT_IO_TIMEOUT,
            pool_size: DEFAULT_POOL_SIZE,
            item_size: DEFAULT_ITEM_SIZE,
            failure_limit: DEFAULT_FAILURE_LIMIT,
            retry_interval: DEFAULT_RETRY_INTERVAL,
            dead_servers: DeadServerPolicy::FailFast,
        }
    }
}

struct Server {
    addr: String,
    /// Replaced when the server is marked dead, so that its idle connections (all broken if it
    /// was restarted) are dropped at once rather than found out one failed probe at a time.
    pool: RwLock<r2d2::Pool<Manager>>,
    make_pool: Box<dyn Fn() -> r2d2::Pool<Manager> + Send + Sync>,
    health: Health,
}

impl fmt::Debug for Server {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Server")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl Server {
    /// Runs `op` on a pooled connection; the connection is dropped if `op` left it out of step.
    fn with_conn<T>(&self, op: impl FnOnce(&mut Conn) -> Result<T>) -> Result<T> {
        let pool = self.pool.read().clone();
        let mut conn = pool.get().map_err(|e| {
            Error::with_source(
                ErrorKind::Timeout,
                format!("no connection to memcached at {} in time", self.addr),
                e,
            )
        })?;
        op(&mut conn).map_err(|e| self.annotate(e))
    }

    fn annotate(&self, e: Error) -> Error {
        if e.is_backend() {
            Error::with_source(e.kind(), format!("memcached at {}", self.addr), e)
        } else {
            e
        }
    }
}

/// memcached over its text protocol (which proxies such as twemproxy and mcrouter also speak).
///
/// `build()` never connects: connections are made on first use, in the background, and an
/// operation waits at most `connect_timeout` for one, so an unreachable server costs a bounded
/// wait and an error, never a hang. A restarted server is used again as soon as it answers.
pub struct MemcachedBackend {
    servers: Vec<Server>,
    nodes: Vec<Node>,
    ring: Ring,
    /// The ring over the servers not marked dead, with the liveness it was built for (Remap).
    live_ring: RwLock<(Vec<bool>, Arc<Ring>)>,
    item_size: usize,
    failure_limit: u32,
    retry_interval: Duration,
    dead_servers: DeadServerPolicy,
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
        let nodes: Vec<Node> = config
            .servers
            .iter()
            .map(|s| Node {
                host: s.host.clone(),
                port: s.port,
                weight: s.weight,
            })
            .collect();
        let all = vec![true; nodes.len()];
        let ring = Ring::new(&nodes, &all);
        Ok(MemcachedBackend {
            servers,
            live_ring: RwLock::new((all, Arc::new(ring.clone()))),
            nodes,
            ring,
            item_size: config.item_size,
            failure_limit: config.failure_limit.max(1),
            retry_interval: config.retry_interval,
            dead_servers: config.dead_servers,
            started: Instant::now(),
        })
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    fn server_index(&self, key: &str) -> usize {
        if self.servers.len() == 1 {
            return 0;
        }
        if self.dead_servers == DeadServerPolicy::Remap {
            let now = self.now_ms();
            if !self.servers.iter().all(|s| s.health.routable(now)) {
                return self.remapped_index(key, now);
            }
        }
        self.ring.locate(key.as_bytes()).unwrap_or(0)
    }

    /// Placement over the servers not marked dead; the ring is rebuilt only when that set changes.
    fn remapped_index(&self, key: &str, now: u64) -> usize {
        let live: Vec<bool> = self
            .servers
            .iter()
            .map(|s| s.health.routable(now))
            .collect();
        let ring = {
            let cached = self.live_ring.read();
            if cached.0 == live {
                Some(cached.1.clone())
            } else {
                None
            }
        };
        let ring = ring.unwrap_or_else(|| {
            let fresh = Arc::new(Ring::new(&self.nodes, &live));
            *self.live_ring.write() = (live, fresh.clone());
            fresh
        });
        // Every server dead: fall back to the full ring (the call fails fast there).
        ring.locate(key.as_bytes())
            .unwrap_or_else(|| self.ring.locate(key.as_bytes()).unwrap_or(0))
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

    /// Groups positions of `keys` by server, preserving order within a server.
    fn by_server<'k>(&self, keys: impl Iterator<Item = &'k str>) -> Vec<(usize, Vec<usize>)> {
        let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
        for (pos, k) in keys.enumerate() {
            let s = self.server_index(k);
            match groups.iter_mut().find(|(i, _)| *i == s) {
                Some((_, v)) => v.push(pos),
                None => groups.push((s, vec![pos])),
            }
        }
        groups
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
        self.ring.locate(derived_key.as_bytes()).unwrap_or(0)
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

    fn get_many(&self, keys: &[&str]) -> Result<Vec<Option<Item>>> {
        let max = self.item_size;
        if self.servers.len() == 1 {
            return self.run(0, |c| c.gets(keys, max));
        }
        let groups = self.by_server(keys.iter().copied());
        let mut out = vec![None; keys.len()];
        let results = self.fan_out(&groups, |server, positions| {
            let ks: Vec<&str> = positions.iter().map(|&i| keys[i]).collect();
            self.run(server, |c| c.gets(&ks, max))
        });
        for ((_, positions), r) in groups.iter().zip(results) {
            for (&i, item) in positions.iter().zip(r?) {
                out[i] = item;
            }
        }
        Ok(out)
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

    fn set_many(&self, items: &[(&str, &[u8])], flags: u32, exptime: u32) -> Result<()> {
        for (k, v) in items {
            let max = self.max_value_size(k);
            if v.len() > max {
                return Err(super::memory::too_large(v.len(), max));
            }
        }
        let groups = self.by_server(items.iter().map(|(k, _)| *k));
        for r in self.fan_out(&groups, |server, positions| {
            let batch: Vec<(&str, &[u8])> = positions.iter().map(|&i| items[i]).collect();
            self.run(server, |c| c.set_many(&batch, flags, exptime))
        }) {
            r?;
        }
        Ok(())
    }

    fn delete(&self, key: &str) -> Result<bool> {
        self.on_key(key, |c| c.delete(key))
    }

    fn delete_many(&self, keys: &[&str]) -> Result<usize> {
        let groups = self.by_server(keys.iter().copied());
        let mut n = 0;
        for r in self.fan_out(&groups, |server, positions| {
            let ks: Vec<&str> = positions.iter().map(|&i| keys[i]).collect();
            self.run(server, |c| c.delete_many(&ks))
        }) {
            n += r?;
        }
        Ok(n)
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
    fn server_specs() {
        let s = ServerSpec::parse("127.0.0.1:11211").unwrap();
        assert_eq!((s.host.as_str(), s.port, s.weight), ("127.0.0.1", 11211, 1));
        assert_eq!(
            ServerSpec::parse("memcache://cache-1:22122")
                .unwrap()
                .addr(),
            "cache-1:22122"
        );
        assert_eq!(
            ServerSpec::parse("[::1]:11211").unwrap().addr(),
            "[::1]:11211"
        );
        for bad in [
            "",
            "host",
            "host:",
            "host:x",
            ":11211",
            "host:0",
            "host:70000",
        ] {
            assert!(ServerSpec::parse(bad).unwrap_err().is_config(), "{bad}");
        }
    }

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
