//! newcache's bench tool: the figures of `benches/README.md` beside their floors, one
//! subcommand each (the herd benchmark is `benches/stampede`, the per-operation benches are the
//! library's criterion benches, `cargo bench`).
//!
//! ```text
//! cargo run --release -p newcache-bench -- floor [--rounds 9] [--path NAME ...] ...
//! cargo run --release -p newcache-bench -- hot [--concurrency 1,64,256] ...
//! cargo run --release -p newcache-bench -- near [--figure hit|rewrite|outage] ...
//! ```
//!
//! `floor`: the headline paths through `Cache` / `AsyncCache`, each beside its floor in the same
//! process (paired, interleaved rounds), on memcached, Redis / Valkey or a Redis Cluster.
//! `hot`: gets/s and latency of hot-key GETs from many callers, newcache beside other
//! memcached clients. `near`: the near tier beside quick_cache, under rewrites and in an
//! outage. Each subcommand's `--help` lists its flags. Instruction and allocation
//! counts are the `inproc` binary's (`src/bin/inproc.rs`, `count.sh`): it replaces the global
//! allocator, so it stays out of this one.

mod floor;
mod hot;
mod near;

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
    /// The near tier (near_cache): a hit beside quick_cache, gets/s under rewrites, loads in
    /// an outage
    Near(near::args::Args),
    /// `near --writer process`'s second process: rewrites 1% of the keys until killed
    #[command(hide = true)]
    NearWriter(near::args::WriterArgs),
}

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    match Cli::parse().command {
        Command::Floor(args) => floor::run(args),
        Command::Hot(args) => hot::run(args),
        Command::Near(args) => near::run(args),
        Command::NearWriter(args) => near::rewrite::writer_main(args),
    }
}
