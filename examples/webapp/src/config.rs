//! `Config`: the service's flags (clap), and where its database lives by default.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// The service's settings, from its command line (and `MEMCACHED_SERVERS`, `REDIS_URL`,
/// `NEAR_CACHE_MB`, `BUS_REDIS`, `BUS_CHANNEL`).
///
/// Parse it with [`clap::Parser`] (`Config::parse()`, or `Config::try_parse_from` in tests).
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "webapp",
    about = "newcache's example web service: axum + SQLite, with newcache in front of the expensive queries"
)]
#[non_exhaustive]
pub struct Config {
    /// Port to serve on, on 127.0.0.1 (0 picks a free one).
    #[arg(long, default_value_t = 3000)]
    pub port: u16,

    /// Fresh lifetime of cached reports and users, in seconds (at most 30 days).
    #[arg(long = "ttl-secs", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=2_592_000))]
    pub ttl_secs: u64,

    /// The SQLite file; seeded on first start. Default: target/webapp/webapp-ROWS.sqlite in the
    /// project.
    #[arg(long)]
    pub db: Option<PathBuf>,

    /// How many orders to seed (users: one per 100 orders, at least 10).
    #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    pub rows: u64,

    /// memcached servers, host:port[,host:port...]; the in-process memory backend when unset.
    #[arg(
        long = "memcached-servers",
        env = "MEMCACHED_SERVERS",
        value_delimiter = ','
    )]
    pub memcached_servers: Vec<String>,

    /// A Redis or Valkey server instead, redis://host:port/db (memcached wins if both are set).
    #[arg(long = "redis-url", env = "REDIS_URL")]
    pub redis_url: Option<String>,

    /// MiB of near copies kept in this process in front of memcached or Redis (0: none): hot
    /// reports and pages served from memory, another process's writes seen within 5 s.
    #[arg(long = "near-cache-mb", env = "NEAR_CACHE_MB", default_value_t = 0)]
    pub near_cache_mb: u64,

    /// A Redis or Valkey server (redis://host:port) whose pub/sub is this cache's bus: the
    /// processes on it announce their writes there and drop their near copies of the keys the
    /// others write, so that another process's write is seen within tens of ms instead of the
    /// near ttl. Without --near-cache-mb the process only announces its writes.
    #[arg(long = "bus-redis", env = "BUS_REDIS")]
    pub bus_redis: Option<String>,

    /// The bus's pub/sub channel: the processes that share a cache share a channel.
    #[arg(
        long = "bus-channel",
        env = "BUS_CHANNEL",
        default_value = "newcache-bus-webapp"
    )]
    pub bus_channel: String,
}

impl Config {
    /// The fresh lifetime of cached values.
    pub fn ttl(&self) -> Duration {
        Duration::from_secs(self.ttl_secs)
    }

    /// The database file: `--db`, or `target/webapp/webapp-ROWS.sqlite` under the project root.
    pub fn db_path(&self) -> PathBuf {
        self.db.clone().unwrap_or_else(|| {
            // examples/webapp/ is two levels under the project root.
            let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
            let root = manifest.ancestors().nth(2).unwrap_or(manifest);
            root.join("target/webapp")
                .join(format!("webapp-{}.sqlite", self.rows))
        })
    }

    /// The Redis URL, if one is set and not empty.
    pub fn redis(&self) -> Option<&str> {
        self.redis_url
            .as_deref()
            .map(str::trim)
            .filter(|u| !u.is_empty())
    }

    /// The bus's Redis URL, if one is set and not empty.
    pub fn bus(&self) -> Option<&str> {
        self.bus_redis
            .as_deref()
            .map(str::trim)
            .filter(|u| !u.is_empty())
    }

    /// The memcached servers named, without empty entries (`MEMCACHED_SERVERS=""` is unset).
    pub fn servers(&self) -> Vec<&str> {
        self.memcached_servers
            .iter()
            .map(|s| s.trim())
            .filter(|s| !s.is_empty())
            .collect()
    }
}
