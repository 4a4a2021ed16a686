//! The command line: how many rounds, how long each is, which paths, on which servers, where the
//! raw rounds go.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};

/// A headline path of the README, measured through the public API beside its floor. On Redis
/// (`--redis-server-bin`, `--redis`) every path but `sync-get-many` runs, each beside redis-rs's
/// own `GET` and a bare socket's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Path {
    /// sync `Cache::get` hit, one thread; floor: a blocking socket's `get` of the same item
    SyncGet,
    /// sync `Cache::get_many` of 100 keys over 3 servers; floors: one `get` line per server on
    /// 3 plain sockets (F) and the same call on the memory backend (C)
    SyncGetMany,
    /// `AsyncCache::get`, one task, tokio multi-thread runtime (2 workers); floor: a bare tokio
    /// socket's `get` on the same runtime
    AsyncGetMulti,
    /// `AsyncCache::get`, one task, tokio current-thread runtime; floor: the same bare socket
    AsyncGetCurrent,
    /// `AsyncCache::get` from 64 tasks over 1,000 hot keys, multi-thread runtime; floor:
    /// async-memcached 0.9, a client per task
    #[value(name = "async-get-64")]
    AsyncGet64,
}

impl Path {
    /// The name on the command line and in the JSON.
    pub fn name(self) -> &'static str {
        match self {
            Path::SyncGet => "sync-get",
            Path::SyncGetMany => "sync-get-many",
            Path::AsyncGetMulti => "async-get-multi",
            Path::AsyncGetCurrent => "async-get-current",
            Path::AsyncGet64 => "async-get-64",
        }
    }

    /// Whether it runs on Redis as well as on memcached.
    pub fn on_redis(self) -> bool {
        self != Path::SyncGetMany
    }
}

/// newcache's headline paths through the public API (`Cache`, `AsyncCache`) on the mission's
/// items (48-byte derived keys, 100-byte values in the envelope), each beside its floor in the
/// same process: `--rounds` interleaved rounds (client then floor, floor then client, ...), one
/// ratio per round, then their median and interquartile range.
///
/// Starts three memcached (`-t 2`) on free loopback ports and stops them on exit. Prints one
/// table on stdout; progress on stderr.
///
/// With `--redis-server-bin` or `--redis`, the paths run on each Redis / Valkey server instead
/// (no memcached), each beside redis-rs's own `GET` of the same stored bytes (the client the
/// backend is built on, with the backend's connection settings) and a bare socket's: one table
/// per server.
#[derive(Debug, Clone, Parser)]
#[command(name = "floor")]
pub struct Args {
    /// rounds per path (each a client run and a floor run, their order alternating)
    #[arg(long, default_value_t = 9)]
    pub rounds: usize,
    /// single gets per run; a `get_many` run makes a tenth as many calls, a 64-task run ten
    /// times as many gets (spread over the tasks)
    #[arg(long, default_value_t = 20_000)]
    pub ops: usize,
    /// slices per round: a round's calls cut into this many, the sides' order alternating slice
    /// by slice too (1: one run of each side per round)
    #[arg(long, default_value_t = 10)]
    pub slices: usize,
    /// run only this side of each path (repeatable; 1 is the client, 2 its floor, then the
    /// path's other sides in the order its CPU lines print), the others skipped: for profiling
    /// one side (callgrind; `perf record` of the client's threads). The ratios involving a
    /// skipped side read NaN (null in `--json`); a number past a path's sides skips them all
    #[arg(long = "only-side", value_name = "N")]
    pub only_sides: Vec<usize>,
    /// a path to run (repeatable) [default: all; on Redis, all but sync-get-many]
    #[arg(long = "path", value_name = "PATH", value_enum)]
    pub paths: Vec<Path>,
    /// also write every round's figures, the summary and the machine's load to this file
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// memcached worker threads (`-t`)
    #[arg(long, default_value_t = 2)]
    pub memcached_threads: usize,
    /// keep one core busy for the whole run (a thread spinning, its CPU time not counted as
    /// the client's), as on a loaded machine: on a VM whose idle vCPUs halt at once, a lone
    /// caller's round trip otherwise pays for waking them, and how much varies by client and
    /// by run. It takes a core from the client and the server alike (the 64-task path runs
    /// without it)
    #[arg(long)]
    pub busy_core: bool,
    /// the 64-task path's batching ceiling: bare sockets x lines in flight on each x keys a
    /// line (their product 64); the default measured fastest of eight shapes
    #[arg(long, default_value = "1x4x16", value_parser = crate::floor::paths::Shape::parse)]
    pub ceiling: crate::floor::paths::Shape,
    /// the 64-task path's minimal client: batchers (a bare socket each) x lines in flight on
    /// each x keys a line at most; the default as fast as any of six shapes tried
    /// (benches/results/floor-64-tasks/sitting.sh)
    #[arg(long, default_value = "2x4x16", value_parser = crate::floor::paths::Shape::parse_any)]
    pub minimal: crate::floor::paths::Shape,
    /// the minimal client's batchers as two tasks each, a writer and a reader (newcache's shape
    /// of a connection), instead of one
    #[arg(long)]
    pub minimal_split: bool,
    /// the 64-task path's ceiling and minimal client send `gets`, as newcache does, instead of
    /// `get` (whose replies carry no CAS)
    #[arg(long)]
    pub gets: bool,
    /// start this `redis-server` / `valkey-server` on a free loopback port (`--save ''
    /// --appendonly no`) and measure the paths on it instead of memcached (repeatable: one
    /// server after another)
    #[arg(long, value_name = "PATH")]
    pub redis_server_bin: Vec<String>,
    /// measure the paths on this running Redis / Valkey server instead of memcached
    /// (`redis://host:port/db`; repeatable)
    #[arg(long, value_name = "URL")]
    pub redis: Vec<String>,
    /// measure `sync-get-many` on this running Redis Cluster instead (its seed URLs,
    /// `redis://host:port`, comma-separated): over its masters, beside a bare socket per
    /// master (F) and the memory backend (C)
    #[arg(long, value_name = "URL,URL,...", value_delimiter = ',')]
    pub redis_cluster: Vec<String>,
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

    /// Whether the paths run on Redis servers rather than memcached.
    pub fn on_redis(&self) -> bool {
        !self.redis_server_bin.is_empty() || !self.redis.is_empty()
    }

    /// Whether `sync-get-many` runs on a Redis Cluster.
    pub fn on_cluster(&self) -> bool {
        !self.redis_cluster.is_empty()
    }

    /// The paths to run: those named, or all the mode's.
    pub fn paths(&self) -> Vec<Path> {
        match self.paths.is_empty() {
            true => Path::value_variants()
                .iter()
                .copied()
                .filter(|p| !self.on_redis() || p.on_redis())
                .collect(),
            false => self.paths.clone(),
        }
    }

    fn check(&self) -> Result<(), String> {
        if self.rounds == 0 || self.slices == 0 || self.memcached_threads == 0 {
            return Err("--rounds, --slices and --memcached-threads must be at least 1".into());
        }
        if self.only_sides.contains(&0) {
            return Err("--only-side counts from 1 (the client)".into());
        }
        // A get_many slice makes ops / 10 / slices calls.
        if self.ops < 100 * self.slices {
            return Err("--ops must be at least 100 per slice".into());
        }
        if self.on_redis() && self.paths.contains(&Path::SyncGetMany) {
            return Err(
                "--path sync-get-many runs on memcached or a Redis Cluster (3 servers)".into(),
            );
        }
        if self.on_cluster() {
            if self.on_redis() {
                return Err(
                    "--redis-cluster runs alone (not with --redis, --redis-server-bin)".into(),
                );
            }
            if self.paths.iter().any(|&p| p != Path::SyncGetMany) {
                return Err("--redis-cluster runs sync-get-many only".into());
            }
        }
        Ok(())
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
    fn defaults_and_names() {
        let args = Args::try_parse_from(["floor"]).unwrap();
        assert_eq!((args.rounds, args.ops, args.slices), (9, 20_000, 10));
        assert_eq!(args.paths(), Path::value_variants());
        assert!(!args.on_redis());
        assert!(args.check().is_ok());
        for path in Path::value_variants() {
            assert_eq!(path.to_possible_value().unwrap().get_name(), path.name());
        }
        let args = Args::try_parse_from(["floor", "--ops", "10"]).unwrap();
        assert!(args.check().is_err());
        let one = Args::try_parse_from(["floor", "--only-side", "1", "--only-side", "4"]).unwrap();
        assert_eq!(one.only_sides, [1, 4]);
        assert!(one.check().is_ok());
        let zero = Args::try_parse_from(["floor", "--only-side", "0"]).unwrap();
        assert!(zero.check().is_err());
    }

    #[test]
    fn redis_mode_runs_the_single_server_paths() {
        let args = Args::try_parse_from(["floor", "--redis-server-bin", "redis-server"]).unwrap();
        assert!(args.on_redis() && args.check().is_ok());
        assert!(!args.paths().contains(&Path::SyncGetMany));
        assert_eq!(args.paths().len(), Path::value_variants().len() - 1);
        let named = [
            "floor",
            "--redis",
            "redis://127.0.0.1:6379/0",
            "--path",
            "sync-get",
        ];
        let args = Args::try_parse_from(named).unwrap();
        assert_eq!(args.paths(), [Path::SyncGet]);
        let many = [
            "floor",
            "--redis",
            "redis://h:1/0",
            "--path",
            "sync-get-many",
        ];
        assert!(Args::try_parse_from(many).unwrap().check().is_err());
    }

    #[test]
    fn cluster_mode_runs_the_batch_path() {
        let seeds = ["floor", "--redis-cluster", "redis://h:1,redis://h:2"];
        let args = Args::try_parse_from(seeds).unwrap();
        assert!(args.on_cluster() && !args.on_redis() && args.check().is_ok());
        assert_eq!(args.redis_cluster, ["redis://h:1", "redis://h:2"]);
        let other = [
            "floor",
            "--redis-cluster",
            "redis://h:1",
            "--path",
            "sync-get",
        ];
        assert!(Args::try_parse_from(other).unwrap().check().is_err());
    }
}
