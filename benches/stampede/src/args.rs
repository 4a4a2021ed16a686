//! The command line. Flags that `bench_stampede.py` also has keep its names and meanings.

use std::fmt;
use std::path::PathBuf;
use std::time::SystemTime;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser, ValueEnum};

/// How the readers get the hot key. Runs go in the order given (default: all, in this order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// `get`; on a miss load and `set` (plain memcached items, no herd protection)
    Naive,
    /// django-newcache's original algorithm: plain get/set, the first reader past the soft expiry
    /// re-sets the stale value for the herd timeout without CAS and reloads; no lease
    Newcache,
    /// newcache's `get_or_set_with` (CAS claim, lease, in-process coalescing)
    Default,
    /// `get_or_set_with` with XFetch early refresh (beta = 1)
    Early,
    /// `get_or_set_with_background` (the claimant serves stale and refreshes in a background
    /// thread)
    Background,
    /// `AsyncCache::get_or_set_with`: `--threads` tokio tasks per process instead of threads,
    /// on a 2-worker runtime and the pipelined engine
    Async,
    /// `AsyncCache::get_or_set_with_background` (the refresh runs in a spawned task)
    AsyncBackground,
}

impl Mode {
    /// The name on the command line and in the JSON.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Naive => "naive",
            Mode::Newcache => "newcache",
            Mode::Default => "default",
            Mode::Early => "early",
            Mode::Background => "background",
            Mode::Async => "async",
            Mode::AsyncBackground => "async-background",
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// newcache's thundering-herd benchmark: the scenario of `../shared/peers/bench_stampede.py`,
/// with the same rules and JSON fields, for newcache's modes.
///
/// `procs` processes x `threads` threads read ONE hot key in a loop (a timed read, then a
/// `--think-ms` pause) until `--duration` runs out. A load sleeps `--loader-ms`, then counts
/// itself with a memcached `incr` on a separate key, so every load is counted once across
/// processes. Unless `--cold`, the key is first warmed through the same mode (not counted).
/// One JSON line per mode.
#[derive(Debug, Clone, Parser)]
#[command(name = "stampede")]
pub struct Args {
    /// memcached servers (comma-separated or repeated) [default: $MEMCACHED_SERVERS]
    #[arg(long, value_name = "HOST:PORT", value_delimiter = ',')]
    pub servers: Vec<String>,
    /// a Redis or Valkey server instead of memcached: redis://host:port/db [default: $REDIS_URL
    /// when no memcached server is given]
    #[arg(long, value_name = "URL")]
    pub redis: Option<String>,
    /// a Redis Cluster instead: its seed URLs (comma-separated or repeated),
    /// redis://host:port
    #[arg(long = "redis-cluster", value_name = "URL", value_delimiter = ',')]
    pub redis_cluster: Vec<String>,
    /// a memcached server on 127.0.0.1 (repeatable; added after --servers)
    #[arg(long = "port", value_name = "PORT")]
    pub ports: Vec<u16>,
    /// worker processes
    #[arg(long, default_value_t = 4)]
    pub procs: usize,
    /// reader threads per process
    #[arg(long, default_value_t = 16)]
    pub threads: usize,
    /// how long one load takes, in milliseconds
    #[arg(long, default_value_t = 50.0)]
    pub loader_ms: f64,
    /// seconds the value lives (memcached's granularity is 1 s)
    #[arg(long, default_value_t = 2)]
    pub ttl: u64,
    /// seconds of reading, per mode
    #[arg(long, default_value_t = 10.0)]
    pub duration: f64,
    /// a reader's pause after each read, in milliseconds
    #[arg(long, default_value_t = 10.0)]
    pub think_ms: f64,
    /// do not warm the key first: the first burst is a cold-start herd
    #[arg(long)]
    pub cold: bool,
    /// a mode to run (repeatable)
    #[arg(
        long = "mode",
        value_name = "MODE",
        value_enum,
        default_values_t = Mode::value_variants().to_vec()
    )]
    pub modes: Vec<Mode>,
    /// print bare JSON lines (otherwise each line is prefixed with its mode)
    #[arg(long)]
    pub json: bool,
    /// also draw read latency and loads over time into this PNG
    #[arg(long, value_name = "FILE.png", value_parser = png_path)]
    pub plot: Option<PathBuf>,
    /// the run's id in the JSON [default: the UTC start time, yyyymmddThhmmssZ]
    #[arg(long, default_value_t = default_run_id(), hide_default_value = true)]
    pub run_id: String,

    // What the parent passes when it re-executes itself as a worker process.
    /// run as one worker process of a run (internal)
    #[arg(long, hide = true)]
    pub worker: bool,
    /// the hot key of the run (internal)
    #[arg(long, hide = true, default_value = "")]
    pub key: String,
    /// unix time in ms at which the workers start reading (internal)
    #[arg(long, hide = true, default_value_t = 0)]
    pub start_at_ms: u64,
}

impl Args {
    /// Parses the process's command line (exiting with a usage error if it is wrong). The
    /// servers are `--servers` then `--port`, or `$MEMCACHED_SERVERS` if neither is given.
    pub fn from_command_line() -> Self {
        let mut args = Self::parse();
        let ports = args.ports.iter().map(|p| format!("127.0.0.1:{p}"));
        args.servers.extend(ports);
        if args.servers.is_empty() && args.redis.is_none() && args.redis_cluster.is_empty() {
            if let Ok(list) = std::env::var("MEMCACHED_SERVERS") {
                let list = list.split(',').filter(|s| !s.is_empty());
                args.servers = list.map(str::to_string).collect();
            }
        }
        if args.servers.is_empty() && args.redis.is_none() && args.redis_cluster.is_empty() {
            args.redis = std::env::var("REDIS_URL").ok().filter(|u| !u.is_empty());
        }
        let chosen = [
            !args.servers.is_empty(),
            args.redis.is_some(),
            !args.redis_cluster.is_empty(),
        ];
        if chosen.iter().filter(|&&c| c).count() != 1 {
            Self::command()
                .error(
                    ErrorKind::MissingRequiredArgument,
                    "one of --servers HOST:PORT[,HOST:PORT] (or MEMCACHED_SERVERS), --redis URL \
                     (or REDIS_URL) and --redis-cluster URL[,URL] is required, not two",
                )
                .exit();
        }
        args
    }
}

/// A `--plot` file name: the image format follows its extension, so it must be `.png`.
fn png_path(name: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(name);
    match path.extension() {
        Some(ext) if ext.eq_ignore_ascii_case("png") => Ok(path),
        _ => Err("the plot is a PNG: its file name must end in .png".to_string()),
    }
}

/// The UTC time now as `yyyymmddThhmmssZ`, as the Python script names its runs.
fn default_run_id() -> String {
    humantime::format_rfc3339_seconds(SystemTime::now())
        .to_string()
        .replace(['-', ':'], "")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_is_well_formed() {
        Args::command().debug_assert();
    }

    #[test]
    fn mode_names_match_the_command_line() {
        for mode in Mode::value_variants() {
            let value = mode.to_possible_value().expect("no mode is skipped");
            assert_eq!(value.get_name(), mode.name());
        }
    }

    #[test]
    fn defaults_and_repeated_flags() {
        let args = Args::try_parse_from(["stampede"]).unwrap();
        assert_eq!(args.modes, Mode::value_variants());
        assert_eq!((args.procs, args.threads, args.ttl), (4, 16, 2));
        assert_eq!(
            (args.loader_ms, args.duration, args.think_ms),
            (50.0, 10.0, 10.0)
        );
        assert_eq!(args.run_id.len(), "20261129T232608Z".len());

        let line = "stampede --servers a:1,b:2 --servers c:3 --port 11211 --mode early --mode naive --cold";
        let args = Args::try_parse_from(line.split(' ')).unwrap();
        assert_eq!(args.servers, ["a:1", "b:2", "c:3"]);
        assert_eq!(args.ports, [11211]);
        assert_eq!(args.modes, [Mode::Early, Mode::Naive]);
        assert!(args.cold);
        assert!(Args::try_parse_from(["stampede", "--mode", "dogpile"]).is_err());
        assert!(Args::try_parse_from(["stampede", "--plot", "out.PNG"]).is_ok());
        assert!(Args::try_parse_from(["stampede", "--plot", "out.svg"]).is_err());
    }
}
