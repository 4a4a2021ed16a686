//! The command line: which figures, how many rounds, how long, who writes.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};

use crate::near::hit::Callers;

/// A figure of `bench near`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Figure {
    /// a near hit through Cache / AsyncCache beside quick_cache (ns/op, paired ratios)
    Hit,
    /// AsyncCache::get of 1,000 hot keys from 64 tasks while another writer rewrites 1% of
    /// them: gets/s with and without the near tier, and its hit ratio
    Rewrite,
    /// memcached killed for `--outage-s` while 64 tasks call get_or_set_with: loads per
    /// second with and without the near tier (serve_stale_on_error on in both)
    Outage,
}

/// The `hit` figure's value kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ValueKind {
    /// a struct of 5 fields, 100 bytes encoded
    Struct,
    /// a 1,000-byte String
    String,
}

/// Who rewrites the 1% of keys in the `rewrite` figure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Writer {
    /// a second process (this binary's hidden `near-writer`), its own sync Cache: its writes
    /// reach this process's near copies only through the near ttl
    Process,
    /// a thread of this process with its own sync Cache (no near tier), built separately over
    /// the same server: its writes do not pass the near tier's write fence (only a cache with
    /// a near tier installs it), so they reach the reader's copies through the near ttl
    Thread,
    /// the same thread, its Cache built with a near tier too: caches of one process over the
    /// same servers share the fence, so each write stops the reader's copy of its key at once
    ThreadNear,
}

/// The near tier (`CacheBuilder::near_cache`) beside what it is measured against, on one
/// memcached started on a free loopback port (`-t 1` by default), stopped on exit; tokio's
/// multi-thread runtime with 2 workers.
///
/// `hit`: `get_arc` / `get` near hits beside quick_cache (100-byte struct, 1,000-byte String;
/// 1,000 keys), four sides interleaved in `--rounds` rounds of `--slices` slices, one ratio per
/// round. `rewrite`: gets/s of `AsyncCache::get` from 64 tasks with and without the near tier,
/// interleaved, while `--writer` rewrites keys k0, k100, ..., k900 (1%). `outage`: the server
/// killed for `--outage-s` seconds, loads per second with and without the near tier.
#[derive(Debug, Clone, Parser)]
#[command(name = "near")]
pub struct Args {
    /// a figure to make (repeatable) [default: hit, rewrite]
    #[arg(long = "figure", value_name = "FIGURE", value_enum)]
    pub figures: Vec<Figure>,
    /// rounds (`hit`: of the four sides; `rewrite`: of with and without, the order alternating)
    #[arg(long, default_value_t = 9)]
    pub rounds: usize,
    /// `hit`: calls per side per round
    #[arg(long, default_value_t = 1_000_000)]
    pub ops: usize,
    /// `hit`: slices per round, the sides' order alternating slice by slice
    #[arg(long, default_value_t = 10)]
    pub slices: usize,
    /// `hit`: a caller mode (repeatable) [default: all]
    #[arg(long = "callers", value_name = "MODE", value_enum)]
    pub callers: Vec<Callers>,
    /// `hit`: a value kind (repeatable) [default: both]
    #[arg(long = "kind", value_name = "KIND", value_enum)]
    pub kinds: Vec<ValueKind>,
    /// `hit`: run only this side (repeatable; 1 `get_arc`, 2 quick_cache's `Arc`, 3 `get`, 4
    /// quick_cache plus a decode), the others skipped: for profiling one side. The ratios
    /// involving a skipped side read NaN
    #[arg(long = "only-side", value_name = "N")]
    pub only_sides: Vec<usize>,
    /// `rewrite`: seconds counted per measurement
    #[arg(long, default_value_t = 3.0)]
    pub duration: f64,
    /// `rewrite`: seconds run and not counted before each measurement
    #[arg(long, default_value_t = 1.0)]
    pub warmup: f64,
    /// `rewrite`: who rewrites the 1% of keys
    #[arg(long, value_enum, default_value_t = Writer::Process)]
    pub writer: Writer,
    /// `rewrite`: writes per second over the 10 rewritten keys (0: as fast as one sync caller
    /// can)
    #[arg(long, default_value_t = 1000)]
    pub writes_per_s: u64,
    /// `rewrite`: the near tier's near_ttl in seconds
    #[arg(long, default_value_t = 5.0)]
    pub near_ttl: f64,
    /// `outage`: seconds the server is down
    #[arg(long, default_value_t = 5)]
    pub outage_s: u64,
    /// `outage`: seconds of requests before the outage and after the server is back
    #[arg(long, default_value_t = 5)]
    pub calm_s: u64,
    /// `outage`: how long a load (a "database query") takes, in ms
    #[arg(long, default_value_t = 2.0)]
    pub loader_ms: f64,
    /// `outage`: runs of each side, alternating
    #[arg(long, default_value_t = 2)]
    pub outage_runs: usize,
    /// memcached worker threads (`-t`)
    #[arg(long, default_value_t = 1)]
    pub memcached_threads: usize,
    /// also write every round's figures and the checks to this file
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
        if self.rounds == 0 || self.slices == 0 || self.memcached_threads == 0 {
            return Err("--rounds, --slices and --memcached-threads must be at least 1".into());
        }
        if self.only_sides.contains(&0) {
            return Err("--only-side counts from 1".into());
        }
        if self.ops < 64 * self.slices {
            return Err("--ops must be at least 64 per slice".into());
        }
        if !(self.duration > 0.0 && self.warmup >= 0.0 && self.outage_s > 0 && self.calm_s > 0) {
            return Err("--duration, --outage-s and --calm-s must be above zero".into());
        }
        if !(self.near_ttl > 0.0 && self.near_ttl <= 3600.0) {
            return Err("--near-ttl must be above zero and at most 3600".into());
        }
        Ok(())
    }

    /// The figures to make: those named, or `hit` and `rewrite`.
    pub fn figures(&self) -> Vec<Figure> {
        match self.figures.is_empty() {
            true => vec![Figure::Hit, Figure::Rewrite],
            false => self.figures.clone(),
        }
    }

    /// The `hit` figure's value kinds: those named, or both.
    pub fn kinds(&self) -> Vec<ValueKind> {
        match self.kinds.is_empty() {
            true => ValueKind::value_variants().to_vec(),
            false => self.kinds.clone(),
        }
    }

    /// The `hit` figure's caller modes: those named, or all.
    pub fn callers(&self) -> Vec<Callers> {
        match self.callers.is_empty() {
            true => Callers::value_variants().to_vec(),
            false => self.callers.clone(),
        }
    }
}

/// The second process of `bench near --figure rewrite --writer process`: rewrites keys k0,
/// k100, ..., k900 of `--flavor` through its own sync Cache until killed.
#[derive(Debug, Clone, Parser)]
#[command(name = "near-writer")]
pub struct WriterArgs {
    #[arg(long, value_name = "HOST:PORT")]
    pub server: String,
    #[arg(long)]
    pub flavor: String,
    /// writes per second (0: unpaced)
    #[arg(long, default_value_t = 1000)]
    pub writes_per_s: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_is_well_formed() {
        Args::command().debug_assert();
        WriterArgs::command().debug_assert();
    }

    #[test]
    fn defaults() {
        let args = Args::try_parse_from(["near"]).unwrap();
        assert_eq!(args.figures(), [Figure::Hit, Figure::Rewrite]);
        assert_eq!(args.callers().len(), 4);
        assert_eq!(args.kinds(), [ValueKind::Struct, ValueKind::String]);
        assert_eq!((args.rounds, args.memcached_threads), (9, 1));
        assert!(args.check().is_ok());
        let args = Args::try_parse_from(["near", "--callers", "async-64"]).unwrap();
        assert_eq!(args.callers(), [Callers::Async64]);
        let args = Args::try_parse_from(["near", "--ops", "10"]).unwrap();
        assert!(args.check().is_err());
    }
}
