//! The command line: how many rounds, how long each is, which paths, where the raw rounds go.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};

/// A headline path of the README, measured through the public API beside its floor.
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
}

/// newcache's headline paths through the public API (`Cache`, `AsyncCache`) on the mission's
/// items (48-byte derived keys, 100-byte values in the envelope), each beside its floor in the
/// same process: `--rounds` interleaved rounds (client then floor, floor then client, ...), one
/// ratio per round, then their median and interquartile range.
///
/// Starts three memcached (`-t 2`) on free loopback ports and stops them on exit. Prints one
/// table on stdout; progress on stderr.
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
    /// a path to run (repeatable) [default: all]
    #[arg(long = "path", value_name = "PATH", value_enum, hide_default_value = true,
          default_values_t = Path::value_variants().to_vec())]
    pub paths: Vec<Path>,
    /// also write every round's figures, the summary and the machine's load to this file
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// memcached worker threads (`-t`)
    #[arg(long, default_value_t = 2)]
    pub memcached_threads: usize,
}

impl Args {
    /// Parses the process's command line and checks what clap cannot.
    pub fn from_command_line() -> Self {
        let args = Self::parse();
        if let Err(msg) = args.check() {
            use clap::CommandFactory;
            Self::command()
                .error(clap::error::ErrorKind::ValueValidation, msg)
                .exit();
        }
        args
    }

    fn check(&self) -> Result<(), String> {
        if self.rounds == 0 || self.slices == 0 || self.memcached_threads == 0 {
            return Err("--rounds, --slices and --memcached-threads must be at least 1".into());
        }
        // A get_many slice makes ops / 10 / slices calls.
        if self.ops < 100 * self.slices {
            return Err("--ops must be at least 100 per slice".into());
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
        assert_eq!(args.paths, Path::value_variants());
        assert!(args.check().is_ok());
        for path in Path::value_variants() {
            assert_eq!(path.to_possible_value().unwrap().get_name(), path.name());
        }
        let args = Args::try_parse_from(["floor", "--ops", "10"]).unwrap();
        assert!(args.check().is_err());
    }
}
