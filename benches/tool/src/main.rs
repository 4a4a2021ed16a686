//! newcache's bench tool: the figures of `benches/README.md` beside their floors, one
//! subcommand each (the herd benchmark is `benches/stampede`, the per-operation benches are the
//! library's criterion benches, `cargo bench`).
//!
//! ```text
//! cargo run --release -p newcache-bench -- floor [--rounds 9] [--path NAME ...] ...
//! cargo run --release -p newcache-bench -- hot [--concurrency 1,64,256] ...
//! cargo run --release -p newcache-bench -- near [--figure hit|rewrite|outage] ...
//! cargo run --release -p newcache-bench -- bus [--figure latency|gets] ...
//! ```
//!
//! `floor`: the headline paths through `Cache` / `AsyncCache`, each beside its floor in the same
//! process (paired, interleaved rounds), on memcached, Redis / Valkey or a Redis Cluster.
//! `hot`: gets/s and latency of hot-key GETs from many callers, newcache beside other
//! memcached clients. `near`: the near tier beside quick_cache, under rewrites and in an
//! outage. `bus`: the near tier's bus across processes (invalidation latency; gets, hit ratio
//! and stale reads under rewrites). Each subcommand's `--help` lists its flags. Instruction and allocation
//! counts are the `inproc` binary's (`src/bin/inproc.rs`, `count.sh`): it replaces the global
//! allocator, so it stays out of this one.

mod bus;
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
    /// The near tier's bus (near_bus) across processes: write-to-invalidation latency per
    /// transport; gets/s, hit ratio and stale reads of two processes under rewrites
    Bus(bus::args::Args),
    /// `bus --figure latency`'s reader process
    #[command(hide = true)]
    BusReader(bus::args::ReaderArgs),
    /// `bus --figure gets`'s peer process
    #[command(hide = true)]
    BusPeer(bus::args::PeerArgs),
}

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    match Cli::parse().command {
        Command::Floor(args) => floor::run(args),
        Command::Hot(args) => hot::run(args),
        Command::Near(args) => near::run(args),
        Command::NearWriter(args) => near::rewrite::writer_main(args),
        Command::Bus(args) => bus::run(args),
        Command::BusReader(args) => bus::latency::reader_main(args),
        Command::BusPeer(args) => bus::peer::peer_main(args),
    }
}
