//! newcache's bench tool: the figures of `benches/README.md` beside their floors, one
//! subcommand each (the herd benchmark is `benches/stampede`, the per-operation benches are the
//! library's criterion benches, `cargo bench`).
//!
//! ```text
//! cargo run --release -p newcache-bench -- floor [--rounds 9] [--path NAME ...] ...
//! cargo run --release -p newcache-bench -- hot [--concurrency 1,64,256] ...
//! ```
//!
//! `floor`: the headline paths through `Cache` / `AsyncCache`, each beside its floor in the same
//! process (paired, interleaved rounds), on memcached, Redis / Valkey or a Redis Cluster.
//! `hot`: gets/s and latency of hot-key GETs from many callers, newcache beside other
//! memcached clients. Each subcommand's `--help` lists its flags. Instruction and allocation
//! counts are the `inproc` binary's (`src/bin/inproc.rs`, `count.sh`): it replaces the global
//! allocator, so it stays out of this one.

mod floor;
mod hot;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "bench",
    about = "newcache's bench tool: the figures of benches/README.md"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// newcache's headline paths through the public API, each beside its floor in the same
    /// process (paired, interleaved rounds), on memcached or on Redis / Valkey
    Floor(floor::args::Args),
    /// The hot-key harness: gets/s and latency of async clients and the sync Cache
    Hot(hot::args::Args),
}

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    match Cli::parse().command {
        Command::Floor(args) => floor::run(args),
        Command::Hot(args) => hot::run(args),
    }
}
