//! The memcached backend's settings: servers (with weights), timeouts, pool size, health limits,
//! and what happens to a dead server's keys.

use std::time::Duration;

use crate::backend::server::Options;
use crate::error::{Error, Result};

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
    pub(crate) host: String,
    pub(crate) port: u16,
    pub(crate) weight: u32,
}

impl ServerSpec {
    /// Parses one server: `host:port`, `memcache://host:port` or `[v6addr]:port` (weight 1).
    /// The host is kept as written, byte for byte (ketama names its points `host:port-i`:
    /// another spelling of one host would move its keys).
    ///
    /// A list (`a:11211,b:11211`), another scheme (`tcp://`, `unix:`) or a bare IPv6 address is
    /// an error that says so: split lists with [`ServerSpec::parse_list`].
    pub fn parse(s: &str) -> Result<ServerSpec> {
        let rest = s.trim();
        let rest = rest.strip_prefix("memcache://").unwrap_or(rest);
        let rest = rest.trim_end_matches('/');
        let bad = |why: &str| Error::config(format!("bad memcached server {s:?}: {why}"));
        if rest.contains([',', ';']) || rest.contains(char::is_whitespace) {
            return Err(bad(
                "one server per entry; split a list of servers with ServerSpec::parse_list \
                 (or CacheBuilder::memcached_list)",
            ));
        }
        if let Some((scheme, _)) = rest.split_once("://") {
            return Err(bad(&format!(
                "scheme {scheme}:// is not supported (write host:port, or memcache://host:port)"
            )));
        }
        if rest.starts_with("unix:") || rest.starts_with('/') {
            return Err(bad("unix sockets are not supported: write host:port"));
        }
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
        if host.contains(':') && !rest.starts_with('[') {
            return Err(bad("an IPv6 address is written in brackets: [addr]:port"));
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

    /// Parses a list of servers as Django's `LOCATION` and pylibmc users write one in an
    /// environment variable: separated by `,`, `;` or whitespace, each as [`parse`] takes it
    /// (`[::1]:11211` included). Empty entries are skipped; an empty list is an error.
    ///
    /// ```
    /// use newcache::ServerSpec;
    /// let servers = ServerSpec::parse_list("10.0.0.1:11211, 10.0.0.2:11211;[::1]:11211")?;
    /// assert_eq!(servers.len(), 3);
    /// assert!(ServerSpec::parse("10.0.0.1:11211,10.0.0.2:11211").is_err());
    /// # Ok::<(), newcache::Error>(())
    /// ```
    ///
    /// [`parse`]: ServerSpec::parse
    pub fn parse_list(s: &str) -> Result<Vec<ServerSpec>> {
        let specs = s
            .split(|c: char| c == ',' || c == ';' || c.is_whitespace())
            .filter(|e| !e.is_empty())
            .map(ServerSpec::parse)
            .collect::<Result<Vec<_>>>()?;
        if specs.is_empty() {
            return Err(Error::config(format!("no memcached server in {s:?}")));
        }
        Ok(specs)
    }

    /// The same server with another weight (its share of keys is weight / total weight).
    pub fn with_weight(mut self, weight: u32) -> ServerSpec {
        self.weight = weight.max(1);
        self
    }

    pub(crate) fn addr(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// Connection settings of a [`MemcachedBackend`](super::MemcachedBackend).
#[derive(Debug, Clone)]
pub struct MemcachedConfig {
    /// The servers; at least one.
    pub servers: Vec<ServerSpec>,
    /// How long an operation may wait for a connection: a free pool slot, then connecting (in the
    /// calling thread). Above zero.
    pub connect_timeout: Duration,
    /// How long an operation may take to send its request and read its replies: one deadline for
    /// the whole operation, however slowly the server sends (a batch: one deadline for all its
    /// servers, per round of up to 512 writes or 2048 keys per server; on the pipelined
    /// connections, per round of up to 2048 keys or commands, from when it is written). Above
    /// zero.
    pub io_timeout: Duration,
    /// Connections per server.
    pub pool_size: u32,
    /// The servers' item size limit (`memcached -I`), 1 MiB by default.
    pub item_size: usize,
    /// Consecutive transport faults (refused or timed-out connects, I/O errors, timeouts,
    /// unparseable replies) that mark a server dead. Error replies (`CLIENT_ERROR`,
    /// `SERVER_ERROR`), values over `item_size` and waits for a free pooled connection never
    /// count.
    pub failure_limit: u32,
    /// How long a dead server is left alone before one caller probes it again; it is used again
    /// only after a probe succeeds. A server that fails again soon after coming back (flapping)
    /// waits twice as long each time, up to 32 intervals.
    pub retry_interval: Duration,
    /// Fail fast or remap the keys of a dead server.
    pub dead_servers: DeadServerPolicy,
    /// How many keys per server this process remembers having invalidated while that server
    /// was out of reach (deleted, written to another server under `Remap`, or failed to
    /// write), to delete them there before it serves again; 10,000 by default
    /// ([`DEFAULT_REPLAY_CAPACITY`](super::DEFAULT_REPLAY_CAPACITY)). Past it, values
    /// that server holds from before are judged stale instead (one reload each). 0 records
    /// nothing: every outage then judges the server's older values stale.
    pub replay_capacity: usize,
}

impl MemcachedConfig {
    /// The checks every memcached client of this crate makes (the blocking backend and the async
    /// engine): a server, and what every server's settings must be ([`Options::check`]).
    pub(crate) fn check(&self) -> Result<()> {
        if self.servers.is_empty() {
            return Err(Error::config("the memcached server list is empty"));
        }
        self.options().check()
    }

    /// Defaults for these servers.
    pub fn new(servers: Vec<ServerSpec>) -> MemcachedConfig {
        MemcachedConfig::with_options(servers, Options::default())
    }

    /// These servers with the settings every server connection has, `options` (and failing
    /// fast on a dead server's keys).
    pub(crate) fn with_options(servers: Vec<ServerSpec>, options: Options) -> MemcachedConfig {
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
        MemcachedConfig {
            servers,
            connect_timeout,
            io_timeout,
            pool_size,
            item_size,
            failure_limit,
            replay_capacity,
            retry_interval,
            dead_servers: DeadServerPolicy::FailFast,
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
            "127.0.0.1:21311,127.0.0.1:21312",
            "a:1;b:2",
            "a:1 b:2",
            "tcp://host:11211",
            "unix:/tmp/memcached.sock",
            "/tmp/memcached.sock",
            "::1:11211",
        ] {
            assert!(ServerSpec::parse(bad).unwrap_err().is_config(), "{bad}");
        }
        let e = ServerSpec::parse("127.0.0.1:21311,127.0.0.1:21312").unwrap_err();
        assert!(e.to_string().contains("parse_list"), "{e}");
    }

    #[test]
    fn server_lists() {
        let addrs = |s: &str| -> Vec<String> {
            ServerSpec::parse_list(s)
                .unwrap()
                .iter()
                .map(ServerSpec::addr)
                .collect()
        };
        assert_eq!(
            addrs(" a:1, b:2;c:3\td:4\n[::1]:11211 ,, "),
            ["a:1", "b:2", "c:3", "d:4", "[::1]:11211"]
        );
        // spellings are kept as written: ketama places by them
        assert_eq!(addrs("Cache-1.Example:11211"), ["Cache-1.Example:11211"]);
        assert!(ServerSpec::parse_list(" ,; ").unwrap_err().is_config());
        assert!(ServerSpec::parse_list("a:1,b").unwrap_err().is_config());
    }
}
