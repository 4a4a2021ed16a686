//! The command line: which clients, how many concurrent callers, how long, on which runtime.

use std::fmt;
use std::path::PathBuf;

use clap::{Parser, ValueEnum};

/// A client measured. Runs go in the order given (reversed in odd rounds).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Client {
    /// the `async-memcached` crate, one connection (`Client`) per task
    AsyncMemcached,
    /// the `memcache` crate's async client (`memcache::exp::AsyncMemcache`), one pooled handle
    /// shared by the tasks
    MemcacheAsync,
    /// newcache's sync `Cache`, each GET through `tokio::task::spawn_blocking`
    NewcacheBlocking,
    /// newcache's sync `Cache` from N OS threads (no runtime): a lone caller on its pool,
    /// concurrent ones on the pipelined engine (`pipelined_sync`, the default)
    NewcacheThreads,
    /// newcache's sync `Cache` from N OS threads on its blocking pool only
    /// (`pipelined_sync(false)`: the sync `Cache` before issue 10)
    PoolThreads,
    /// a bare tokio `TcpStream` per task: `get key\r\n`, read until `END\r\n` (the floor)
    Bare,
    /// newcache's `AsyncCache` (built with the `async-cache` feature)
    #[cfg(feature = "async-cache")]
    AsyncCache,
    /// N OS threads, each blocking on an `AsyncCache` GET whose engine runs on a private
    /// 2-worker runtime: what the sync `Cache` would be on the engine (issue 10's experiment)
    #[cfg(feature = "async-cache")]
    EngineThreads,
}

impl Client {
    /// The name on the command line, in the JSON and in the table.
    pub fn name(self) -> &'static str {
        match self {
            Client::AsyncMemcached => "async-memcached",
            Client::MemcacheAsync => "memcache-async",
            Client::NewcacheBlocking => "newcache-blocking",
            Client::NewcacheThreads => "newcache-threads",
            Client::PoolThreads => "pool-threads",
            Client::Bare => "bare",
            #[cfg(feature = "async-cache")]
            Client::AsyncCache => "async-cache",
            #[cfg(feature = "async-cache")]
            Client::EngineThreads => "engine-threads",
        }
    }
}

impl fmt::Display for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The tokio runtime the async clients run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Runtime {
    /// `--workers` worker threads
    MultiThread,
    /// one thread: the tasks take turns on the thread that measures
    CurrentThread,
}

impl Runtime {
    /// The name on the command line and in the JSON.
    pub fn name(self) -> &'static str {
        match self {
            Runtime::MultiThread => "multi-thread",
            Runtime::CurrentThread => "current-thread",
        }
    }
}

/// How many connections a pooled client may keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Pools {
    /// as many as there are callers, like the clients with one connection per task
    PerTask,
    /// the client's default (newcache: 16 per server; memcache-async: 8 idle kept)
    Default,
}

impl Pools {
    /// The name on the command line and in the JSON.
    pub fn name(self) -> &'static str {
        match self {
            Pools::PerTask => "per-task",
            Pools::Default => "default",
        }
    }
}

/// newcache's hot-key harness: gets/s and p50/p99/p999 latency of GETs of 1,000 hot keys
/// (~100-byte values) on one memcached, for several clients at several concurrencies.
///
/// Every measurement is `--warmup` seconds not counted, then `--duration` seconds counted; the
/// clients alternate order over `--rounds` rounds. One JSON line per (client, concurrency, round)
/// on stdout; progress and the table (medians over rounds) on stderr.
#[derive(Debug, Clone, Parser)]
#[command(name = "hot")]
pub struct Args {
    /// the memcached to use [default: start one on a free loopback port, stopped on exit]
    #[arg(long, value_name = "HOST:PORT")]
    pub server: Option<String>,
    /// a client to measure (repeatable) [default: all]
    #[arg(long = "client", value_name = "CLIENT", value_enum, hide_default_value = true,
          default_values_t = Client::value_variants().to_vec())]
    pub clients: Vec<Client>,
    /// concurrent callers (tasks or threads), comma-separated or repeated
    #[arg(long, value_delimiter = ',', default_values_t = [1, 64, 256])]
    pub concurrency: Vec<usize>,
    /// seconds counted per measurement
    #[arg(long, default_value_t = 5.0)]
    pub duration: f64,
    /// seconds run and not counted before each measurement
    #[arg(long, default_value_t = 1.0)]
    pub warmup: f64,
    /// rounds; the clients' order is reversed in every odd round
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    /// the tokio runtime
    #[arg(long, value_enum, default_value_t = Runtime::MultiThread)]
    pub runtime: Runtime,
    /// worker threads of the multi-thread runtime
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// connections of the pooled clients (newcache, memcache-async)
    #[arg(long, value_enum, default_value_t = Pools::PerTask)]
    pub pools: Pools,
    /// also write the table to this file
    #[arg(long, value_name = "FILE")]
    pub table: Option<PathBuf>,
}

impl Args {
    /// Checks what clap cannot (the arguments of `bench SUBCOMMAND`, as parsed by clap).
    pub fn checked(self) -> Self {
        let args = self;
        if let Err(msg) = args.check() {
            use clap::CommandFactory;
            Self::command()
                .error(clap::error::ErrorKind::ValueValidation, msg)
                .exit();
        }
        args
    }

    fn check(&self) -> Result<(), String> {
        if self.concurrency.contains(&0) {
            return Err("--concurrency must be at least 1".into());
        }
        if !(self.duration > 0.0 && self.warmup >= 0.0) {
            return Err("--duration must be positive and --warmup not negative".into());
        }
        if self.rounds == 0 || self.workers == 0 {
            return Err("--rounds and --workers must be at least 1".into());
        }
        Ok(())
    }

    /// The clients in the order of round `round` (0-based): as given, reversed in odd rounds.
    pub fn order(&self, round: usize) -> Vec<Client> {
        let mut order = self.clients.clone();
        if round % 2 == 1 {
            order.reverse();
        }
        order
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_is_well_formed() {
        Args::command().debug_assert();
    }

    #[test]
    fn client_names_match_the_command_line() {
        for client in Client::value_variants() {
            let value = client.to_possible_value().expect("no client is skipped");
            assert_eq!(value.get_name(), client.name());
        }
        for runtime in Runtime::value_variants() {
            assert_eq!(
                runtime.to_possible_value().unwrap().get_name(),
                runtime.name()
            );
        }
        for pools in Pools::value_variants() {
            assert_eq!(pools.to_possible_value().unwrap().get_name(), pools.name());
        }
    }

    #[test]
    fn defaults_and_order() {
        let args = Args::try_parse_from(["hot"]).unwrap();
        assert_eq!(args.clients, Client::value_variants());
        assert_eq!(args.concurrency, [1, 64, 256]);
        assert_eq!((args.duration, args.warmup, args.rounds), (5.0, 1.0, 2));
        assert_eq!((args.runtime, args.workers), (Runtime::MultiThread, 2));
        assert!(args.check().is_ok());

        let line = "hot --client bare --client async-memcached --concurrency 1,8 --rounds 3";
        let args = Args::try_parse_from(line.split(' ')).unwrap();
        assert_eq!(args.concurrency, [1, 8]);
        assert_eq!(args.order(0), [Client::Bare, Client::AsyncMemcached]);
        assert_eq!(args.order(1), [Client::AsyncMemcached, Client::Bare]);
        assert_eq!(args.order(2), args.order(0));

        let args = Args::try_parse_from(["hot", "--concurrency", "0"]).unwrap();
        assert!(args.check().is_err());
    }
}
