//! The Redis backend's settings: the server's URL, timeouts, pool size, health limits, limits on
//! keys and values.

use std::time::Duration;

use crate::backend::server::{MAX_RETRY_INTERVAL, Options};
use crate::error::{Error, Result};

/// The longest key the Redis backend takes by default: memcached's limit, so that a cache moves
/// between the two backends unchanged.
pub const DEFAULT_KEY_LIMIT: usize = crate::key::MAX_KEY_LEN;

/// Settings of a [`RedisBackend`](super::RedisBackend): what
/// [`CacheBuilder::redis`](crate::CacheBuilder::redis) fills in. The timeouts, pool size and
/// health limits mean what they mean for memcached, with the same defaults.
#[derive(Clone)]
#[non_exhaustive]
pub struct RedisConfig {
    /// `redis://[user:password@]host:port/db` (the `redis` crate's reading), or `rediss://` for
    /// TLS (feature `redis-tls`).
    pub url: String,
    /// Limit on getting a connection (default 500 ms).
    pub connect_timeout: Duration,
    /// Limit on one operation's I/O (default 500 ms).
    pub io_timeout: Duration,
    /// Blocking connections kept for the sync `Cache` (default 16); with [`wait`](Self::wait),
    /// also the most connections `AsyncCache` opens for its writes (each carries one write and
    /// its `WAIT` at a time, beside the connection every other call shares).
    pub pool_size: u32,
    /// Consecutive transport faults after which the server is marked dead (default 2).
    pub failure_limit: u32,
    /// Time a dead server is left alone before one caller probes it (default 1 s, doubling
    /// while it flaps).
    pub retry_interval: Duration,
    /// The largest item (value and key and overhead), as memcached's `-I` (default 1 MiB): a
    /// larger value is refused before anything is sent.
    pub item_size: usize,
    /// The longest key (default [`DEFAULT_KEY_LIMIT`], 250 bytes).
    pub key_limit: usize,
    /// Keys whose invalidation may have missed the server (a delete or a write that failed on
    /// a transport fault or while it was marked dead) kept to be deleted there before it serves
    /// this process again (default 10,000; past it, the server's older values are judged
    /// stale): memcached's `replay_capacity`.
    pub replay_capacity: usize,
    /// A `WAIT` for replicas after each store (claims, placeholders, fenced stores, `set`s)
    /// and each delete (default `None`: none; see [`ReplicaWait`]).
    pub wait: Option<ReplicaWait>,
    /// A `rediss://` server's CA and client certificate (feature `redis-tls`; default `None`:
    /// the system's trusted roots, no client certificate). Refused with a `redis://` URL.
    #[cfg(feature = "redis-tls")]
    pub tls: Option<super::RedisTls>,
}

impl std::fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut f = f.debug_struct("RedisConfig");
        f.field("url", &redacted(&self.url))
            .field("connect_timeout", &self.connect_timeout)
            .field("io_timeout", &self.io_timeout)
            .field("pool_size", &self.pool_size)
            .field("failure_limit", &self.failure_limit)
            .field("retry_interval", &self.retry_interval)
            .field("item_size", &self.item_size)
            .field("key_limit", &self.key_limit)
            .field("replay_capacity", &self.replay_capacity)
            .field("wait", &self.wait);
        #[cfg(feature = "redis-tls")]
        f.field("tls", &self.tls);
        f.finish()
    }
}

/// `text` with the user and password of `url` (if it has them) hidden.
fn hide_userinfo(url: &str, text: &str) -> String {
    let userinfo = url
        .split_once("://")
        .and_then(|(_, rest)| rest.rsplit_once('@'))
        .map(|(info, _)| info)
        .filter(|info| !info.is_empty());
    match userinfo {
        Some(info) => text.replace(info, "***"),
        None => text.to_owned(),
    }
}

/// `url` with its user and password (what comes before `@`) hidden.
pub(crate) fn redacted(url: &str) -> String {
    match (url.split_once("://"), url.rsplit_once('@')) {
        (Some((scheme, _)), Some((_, host))) => format!("{scheme}://***@{host}"),
        _ => url.to_owned(),
    }
}

impl RedisConfig {
    /// The defaults, on the server at `url`.
    pub fn new(url: impl Into<String>) -> RedisConfig {
        RedisConfig::with_options(url, Options::default())
    }

    /// The server at `url` with the settings every server connection has, `options` (and the
    /// defaults of Redis's own).
    pub(crate) fn with_options(url: impl Into<String>, options: Options) -> RedisConfig {
        // Every field named: a new shared setting fails to build here until it is used.
        let Options {
            connect_timeout,
            io_timeout,
            pool_size,
            item_size,
            failure_limit,
            retry_interval,
            replay_capacity,
        } = options;
        RedisConfig {
            url: url.into(),
            connect_timeout,
            io_timeout,
            pool_size,
            failure_limit,
            retry_interval,
            item_size,
            key_limit: DEFAULT_KEY_LIMIT,
            replay_capacity,
            wait: None,
            #[cfg(feature = "redis-tls")]
            tls: None,
        }
    }

    /// The settings every server connection has, as the clients read them.
    pub(crate) fn options(&self) -> Options {
        Options {
            connect_timeout: self.connect_timeout,
            io_timeout: self.io_timeout,
            pool_size: self.pool_size,
            item_size: self.item_size,
            failure_limit: self.failure_limit,
            retry_interval: self.retry_interval,
            replay_capacity: self.replay_capacity,
        }
    }

    /// The `redis` crate's client for the URL, after checking every setting.
    pub(crate) fn client(&self) -> Result<redis::Client> {
        let bad =
            |why: String| Error::config(format!("bad redis URL {:?}: {why}", redacted(&self.url)));
        let tls = self.url.starts_with("rediss://");
        if !tls && !self.url.starts_with("redis://") {
            return Err(bad(
                "expected redis://[user:password@]host:port/db, or rediss:// for TLS (unix \
                 sockets are not supported yet)"
                    .into(),
            ));
        }
        if tls && !cfg!(feature = "redis-tls") {
            return Err(bad(
                "rediss:// (TLS) needs newcache's cargo feature `redis-tls`".into(),
            ));
        }
        // The crate's message may quote the URL: its user and password are hidden there too.
        let client = redis::Client::open(self.url.as_str())
            .map_err(|e| bad(hide_userinfo(&self.url, &e.to_string())))?;
        #[cfg(feature = "redis-tls")]
        let client = self.with_tls(client)?;
        self.options().check()?;
        // Redis refuses a zero interval too (memcached takes one: its dead servers are then
        // probed at every call).
        if self.retry_interval.is_zero() {
            return Err(Error::config(format!(
                "retry_interval must be above zero and at most {MAX_RETRY_INTERVAL:?}"
            )));
        }
        if self.key_limit == 0 {
            return Err(Error::config("key_limit must be at least 1"));
        }
        Ok(client)
    }

    /// The client of a `rediss://` URL with the CA and client certificate of [`tls`](Self::tls)
    /// (checked); a `redis://` URL given TLS settings, or `#insecure`, is refused.
    #[cfg(feature = "redis-tls")]
    fn with_tls(&self, client: redis::Client) -> Result<redis::Client> {
        let info = client.get_connection_info();
        match (info.addr(), &self.tls) {
            (redis::ConnectionAddr::TcpTls { insecure: true, .. }, _) => Err(Error::config(
                "a rediss:// URL with #insecure (no certificate verification) is not supported: \
                 give the server's CA with RedisTls::ca_pem",
            )),
            (redis::ConnectionAddr::TcpTls { host, .. }, tls) => {
                super::tls::server_name(host)?;
                let Some(tls) = tls else {
                    return Ok(client);
                };
                tls.check()?;
                redis::Client::build_with_tls(info.clone(), tls.certificates()).map_err(|e| {
                    Error::config(format!("the redis crate refused the TLS settings: {e}"))
                })
            }
            (_, Some(_)) => Err(Error::config(
                "TLS settings (redis_tls) were given for a redis:// URL: use rediss:// for TLS",
            )),
            _ => Ok(client),
        }
    }

    /// How long after a call a write of the async view whose caller went away may still land
    /// ([`AsyncBackend::settle_time`](crate::backend::AsyncBackend::settle_time)): with a
    /// `WAIT`, writes go on connections of their own (one of them may land after a later read
    /// on the shared connection), within a connect and an operation's I/O; without, none.
    #[cfg(feature = "tokio")]
    pub(crate) fn settle_time(&self) -> Duration {
        match self.wait {
            Some(_) => self.connect_timeout.saturating_add(self.io_timeout),
            None => Duration::ZERO,
        }
    }

    /// `host:port`, as errors, spans and `ping` name the server (an IPv6 host in brackets, as
    /// a cluster's slot map and redirects name it: [`addr_of`](super::slots::addr_of)).
    pub(crate) fn addr(&self) -> String {
        match redis::Client::open(self.url.as_str()) {
            Ok(c) => match c.get_connection_info().addr() {
                redis::ConnectionAddr::Tcp(h, p) => super::slots::addr_of(h, *p),
                redis::ConnectionAddr::TcpTls { host, port, .. } => {
                    super::slots::addr_of(host, *port)
                }
                other => other.to_string(),
            },
            Err(_) => redacted(&self.url),
        }
    }
}

/// How many replicas must have each write before it is acknowledged, and how long to wait for
/// them: Redis's `WAIT replicas timeout`, sent after each store and delete
/// ([`CacheBuilder::redis_wait`](crate::CacheBuilder::redis_wait)).
///
/// Replication is asynchronous: without it an acknowledged delete or claim can vanish when its
/// master fails before a replica has it (an old value back as fresh, or a second load). With
/// it, a write the replicas did not all acknowledge in time, or whose `WAIT` the server refused
/// (an ACL user needs `WAIT`), fails with an error that
/// [`is_outcome_unknown`](crate::Error::is_outcome_unknown) (the write is on the master, but it
/// may not outlive a failover; a write the server refused fails with its own refusal), handled by the write failure policy like any other write
/// error: returned by default (`FailurePolicy::Propagate`), absorbed and counted in
/// `backend_errors_absorbed` with `FailurePolicy::Absorb`. The server is not marked dead for
/// it, and no replay deletes the key later (the master has the write). Even acknowledged by a replica, a write can be lost if a replica
/// that lacks it is promoted: `WAIT` narrows the window, it does not make Redis consistent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplicaWait {
    /// Replicas that must acknowledge (at least 1).
    pub replicas: u32,
    /// The longest wait (rounded to milliseconds; at least 1 ms: `WAIT`'s 0 is forever);
    /// shorter than `io_timeout`, which also bounds the wait's reply.
    pub timeout: Duration,
}
