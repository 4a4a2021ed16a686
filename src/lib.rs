//! A typed cache over memcached, Redis, Valkey, a Redis Cluster or process memory that keeps a
//! hot key from being recomputed by every request at once when it expires: the Rust port of
//! django-newcache.
//!
//! # Quickstart
//!
//! ```
//! use std::time::Duration;
//! use newcache::{Cache, Ttl};
//!
//! #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
//! struct User { id: u64, name: String }
//!
//! // `.memcached(["127.0.0.1:11211"])` instead of `.in_memory()` for a real server.
//! let cache = Cache::builder().in_memory().flavor("prod").build()?;
//!
//! let ann = User { id: 42, name: "ann".into() };
//! cache.set("user:42", &ann, Duration::from_secs(300))?;
//! assert_eq!(cache.get::<User>("user:42")?, Some(ann));
//!
//! cache.set_counter("hits", 41, Ttl::Never)?;
//! assert_eq!(cache.incr("hits", 1)?, 42);
//! # Ok::<(), newcache::Error>(())
//! ```
//!
//! # How the herd protection works
//!
//! Every value is stored in an envelope that carries a *soft* expiry (now + ttl) and the *herd
//! timeout* its writer used (60 s by default). memcached's own (hard) expiry is later: ttl + the
//! herd timeout. When the soft expiry has passed, the first reader *claims* the entry: it
//! re-stores the same value with its own token and a deadline through memcached's `cas`, and reads
//! it back on the same connection. Exactly one reader's `cas` can succeed; that reader recomputes,
//! every other reader gets the stale value at once. Nobody is served a value past its soft expiry
//! plus its herd timeout.
//!
//! ```text
//! t=0      set(k, v, 300 s)        soft expiry 300 s, servable until 360 s, memcached expiry 360 s
//! t=301    A: gets -> stale; cas(claimed by A) + gets -> A's token   -> A recomputes
//! t=301    B: gets -> stale; cas EXISTS + gets -> claimed by A       -> v (stale, at once)
//! t=301.1  C: gets -> stale, claimed                                  -> v (stale, at once)
//! t=301.2  A: cas(v2) against its claim -> STORED                     everyone reads v2
//! (if someone deleted or set k meanwhile, A's cas fails: the newer state stays)
//! ```
//!
//! With [`Cache::get_or_set_with`], a missing key gets a *placeholder* envelope (`add`) that
//! other callers wait on (at most [`CacheBuilder::max_wait`]); the holder keeps its claim alive
//! while its loader runs and stores the result with `cas`, so a load never undoes an
//! invalidation. Claims compare wall clocks across processes: processes sharing a cache are
//! assumed to have clocks within a fraction of [`CacheBuilder::lease_ttl`] of each other.
//!
//! A loaded value too large for the backend is returned but cannot be stored: unless it
//! refreshes a stale value others are served (which stays, unclaimed), its holder stores a
//! small *not storable* marker instead (by `cas` against its claim, as it would the
//! value), for the value's ttl but at most a minute. While it lives, every caller loads the
//! key itself at once, without claiming or waiting (callers of one process still share one
//! load), and [`Cache::get`] reports a miss; a `set`, `add` or `delete` replaces it. The first
//! time per key, a warning names the derived key ([`Cache::make_key`] maps a user key to it;
//! the user key is logged at DEBUG only).
//!
//! # Keys and versions
//!
//! A user key becomes `{flavor}-{version}-{sha1 hex of its UTF-8 bytes}`, byte for byte as
//! django-newcache makes it, so any key (spaces, newlines, 100 KB of text) is safe on the wire.
//! [`Cache::with_version`] (or a new `version` in the builder) makes every old key unreachable. A
//! custom derivation can be set with [`CacheBuilder::key_function`]; its output is validated.
//!
//! # Backends
//!
//! - memcached ([`CacheBuilder::memcached`]): the text protocol (which twemproxy and mcrouter also
//!   speak), one blocking pool per server for a caller alone and pipelined connections for
//!   callers that overlap ([`CacheBuilder::pipelined_sync`]), ketama placement compatible with
//!   libmemcached, batches in one pipelined round trip per server. `build()` never connects;
//!   every wait is bounded.
//! - memory ([`CacheBuilder::in_memory`], the default): the same semantics in process, bounded;
//!   private to the cache built from it (two builds are two stores).
//! - Redis and Valkey (feature `redis`, `CacheBuilder::redis`): one server, the same keys,
//!   envelope and herd protocol; each item a Redis string with a 13-byte header (tag `0xA1`, a
//!   random 63-bit stamp that is its CAS token, the flags, big-endian), fenced writes in a one-key
//!   Lua script comparing the stamp. ACL users in the URL (`redis://user:password@host/0`);
//!   `rediss://` for TLS (feature `redis-tls`), with a CA of your own and client certificates
//!   (`CacheBuilder::redis_tls`).
//! - Redis Cluster (feature `redis`, `CacheBuilder::redis_cluster`): each key on the master of
//!   its hash slot (no hash tags: every herd write touches one key), `MOVED` and `ASK`
//!   followed, batches split by master, one master down failing only its own keys (with
//!   `cluster-require-full-coverage no`; under Redis's default, every key until its failover).
//!
//! What a caller sees when a server is down, hung, restarted or failing over, and what bounds
//! it, is in the module docs: [`backend::memcached`] and `backend::redis` (feature `redis`).
//!
//! A `Cache` and an `AsyncCache` are two views of one cache: [`Cache::to_async`] and
//! [`AsyncCache::to_sync`] share the store, the stats, the coalescer (a sync and an async caller of
//! one key elect one loader; a sync call inside a tokio context never waits for a task's load,
//! and may load too) and the servers' health, each view doing its own I/O.
//! - your own: implement [`Backend`] on bytes, flags and CAS tokens.
//!
//! # Wire format
//!
//! Items written by [`Cache::set`] carry memcached flags `0x4E43` and this layout (format 2,
//! integers little-endian):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 2 | magic `b"NC"` |
//! | 2 | 1 | format version, `2`; a reader treats a newer one as a (counted) miss |
//! | 3 | 1 | kind: `1` value, `2` plain value (`Herd::Off`), `3` placeholder (being loaded) |
//! | 4 | 1 | codec of the payload: `0` bincode 2 (standard configuration), `1` MessagePack (`rmp-serde`, structs as maps with named fields, byte sequences as `bin`) |
//! | 5 | 1 | flags: bit 0 compressed: the payload is the uncompressed length (`u32`) then an LZ4 block; bit 1 raw: the payload is not a codec's (the response cache's pages, feature `tower`); bit 2 not storable: a placeholder with no claim saying the last load's value was too large to store (every caller loads it itself, until the expiry field) |
//! | 6 | 1 | header length; readers skip to it, so fields can be appended |
//! | 7 | 1 | which fields follow, one bit each, in the order below; a field left out is `0` |
//! | 8 | … | the fields present, then the payload |
//!
//! | bit | size | field |
//! |---|---|---|
//! | 0 | 6 | soft expiry, unix ms (`0` = never) |
//! | 1 | 6 | when the value was computed, unix ms |
//! | 2 | 4 | how long computing it took, ms (XFetch's delta), `0` = unknown |
//! | 3 | 4 | the writer's herd timeout, ms: never served at or after soft expiry + this |
//! | 4 | 6 + 8 | until when (unix ms) the claim (or placeholder) holds, and the claim's token |
//! | 5 | 6 | when the writer meant memcached to drop it, unix ms (`0` = never) |
//!
//! Timestamps take 6 bytes (they saturate in the year 10889). A fresh value's header is 28 to
//! 38 bytes; the longest (every field) is 48.
//!
//! A codec id, a flag bit or a field bit this build does not know, like a newer format version,
//! was written by a newer build: a counted miss, never an error, and never overwritten by a load.
//!
//! Counters ([`Cache::set_counter`]) are memcached's plain decimal digits with flags `0`. Bytes
//! that do not match (another client's pickle, a PHP value, an empty value, the never-released
//! format 1) give an error whose [`Error::is_decode`] is true, or a miss with
//! [`DecodePolicy::Miss`]; decoding never allocates more than
//! [`CacheBuilder::max_decode_size`] (64 MiB by default).
//!
//! # Health, metrics and traces
//!
//! - [`Cache::ping`] (and `AsyncCache::ping`): every server answers, or a [`PingError`] names
//!   those that do not. Call it at start-up too: `build()` never connects and a failed read is
//!   a miss by default, so a wrong address, URL or password would show only as every request
//!   going to the database.
//!
//!   ```no_run
//!   let cache = newcache::Cache::builder().memcached(["127.0.0.1:11211"]).build()?;
//!   if let Err(e) = cache.ping() {
//!       eprintln!("the cache does not answer: {e}"); // each server, and why
//!       std::process::exit(1);
//!   }
//!   # Ok::<(), newcache::Error>(())
//!   ```
//! - With the `metrics` feature, counters and histograms through the
//!   [`metrics`](https://docs.rs/metrics) facade, each labelled `cache` with
//!   [`CacheBuilder::name`] (default `"default"`): `newcache_hits_total`,
//!   `newcache_misses_total`, `newcache_stale_served_total`, `newcache_claims_total`,
//!   `newcache_lease_waits_total`, `newcache_waited_total`, `newcache_wait_seconds`
//!   (histogram: one sample per caller that waited), `newcache_loads_total`,
//!   `newcache_load_errors_total`,
//!   `newcache_backend_errors_total` (also labelled `server`: [`Error::server`], or `unknown`;
//!   a batch counts once under each server that failed), `newcache_load_duration_seconds`
//!   (histogram: one sample per loader call, however it ended), and for the other [`Stats`] fields
//!   `newcache_backend_errors_absorbed_total`, `newcache_early_refreshes_total`,
//!   `newcache_stale_on_error_total`, `newcache_decode_errors_total`,
//!   `newcache_newer_format_total`, `newcache_wait_timeouts_total`,
//!   `newcache_loads_superseded_total`, `newcache_too_large_total`,
//!   `newcache_not_storable_loads_total`, `newcache_near_hits_total`,
//!   `newcache_near_misses_total`, `newcache_near_refused_total`,
//!   `newcache_near_evictions_total`, `newcache_near_outage_served_total`, and the bus's
//!   `newcache_bus_sent_total`, `newcache_bus_received_total`,
//!   `newcache_bus_keys_dropped_total`, `newcache_bus_gaps_total`,
//!   `newcache_bus_flushes_total`, `newcache_bus_reconnects_total`,
//!   `newcache_bus_heartbeats_missed_total`. They count what
//!   [`Cache::stats`] counts, but for near hits: `Stats::hits` includes them,
//!   `newcache_hits_total` does not (add `newcache_near_hits_total`). A response cache (`layer::ResponseCacheLayer`) counts its pages
//!   apart: its series carry `layer` (its namespace) beside `cache`, and are its own `stats()`. Install the recorder before building the cache: the handles are
//!   registered when it is built (the per-server error counters too, for each configured server
//!   and `unknown`).
//! - `tracing` spans at DEBUG, one per operation, named `newcache`, with the fields `op`
//!   (`get`, `set`, `add`, `delete`, `touch`, `get_many`, `set_many`, `delete_many`,
//!   `get_or_set_with`, `get_many_or_set_with`, `set_counter`, `incr`, `decr`, `get_counter`,
//!   `clear`, `ping`), `cache`, `key` (the derived key) or, for batches, `keys` (how many), and
//!   `server`: the address a memcached backend routed a single-key operation to (the proxy's
//!   behind twemproxy), recorded on the span when it picks it; batches and the memory backend
//!   leave it empty. A loader runs inside its call's span. No field ever holds a value. Without
//!   a subscriber listening at DEBUG the spans are never built. A near hit (`near_cache`) has
//!   no span: it derives no key and does no I/O.
//!
//! # Cargo features
//!
//! The memcached and memory backends are always built.
//!
//! - `tokio` (on by default): [`AsyncCache`] and its pipelined memcached engine.
//! - `metrics` (off by default): the metrics above, through the `metrics` crate.
//! - `tower` (off by default; implies `tokio`): [`layer::ResponseCacheLayer`], a herd-safe HTTP
//!   response cache for tower and axum 0.8 (http 1.x types).
//! - `redis` (off by default): the Redis / Valkey backend, on the `redis` crate.
//! - `redis-tls` (off by default; implies `redis`): `rediss://` URLs and `RedisTls` (a CA,
//!   client certificates), on rustls with its ring crypto provider. Connections use the
//!   process's rustls `CryptoProvider`; when none is installed, the first TLS connection
//!   installs ring's (which rustls itself does when ring is its only provider built in).
//!
//! # Minimum supported Rust version
//!
//! 1.85 (edition 2024), as `rust-version` in Cargo.toml says, with every feature: at the
//! dependency versions in Cargo.lock, none declares more (redis 1.2 and tokio 1.54 declare
//! 1.85). A later release of a dependency may.

#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs)]
#![warn(missing_debug_implementations)]

#[cfg(feature = "tokio")]
mod async_cache;
pub mod backend;
mod builder;
mod cache;
mod clock;
mod codec;
mod config;
mod envelope;
mod error;
mod herd;
mod key;
#[cfg(feature = "tower")]
pub mod layer;
mod loader;
mod near;
mod ping;
mod protocol;
mod rng;
mod stats;
pub mod testing;
mod ttl;

/// The tests' own helpers (the integration tests include this file too).
#[cfg(test)]
mod test_support;

#[cfg(feature = "tokio")]
pub use async_cache::AsyncCache;
pub use backend::memcached::{DeadServerPolicy, MemcachedBackend, MemcachedConfig, ServerSpec};
pub use backend::memory::MemoryBackend;
#[cfg(feature = "redis-tls")]
pub use backend::redis::RedisTls;
#[cfg(feature = "redis")]
pub use backend::redis::{RedisBackend, RedisBus, RedisCluster, RedisConfig, ReplicaWait};
pub use backend::{Backend, Item, StoreMode, StoreOutcome, Write};
pub use builder::{
    CacheBuilder, DEFAULT_BUS_HEARTBEAT, DEFAULT_HERD_TIMEOUT, DEFAULT_LEASE_TTL,
    DEFAULT_MAX_LOAD_TIME, DEFAULT_MAX_WAIT, DEFAULT_NAME, DEFAULT_TTL, MAX_ITEM_SIZE,
    MAX_NEAR_TTL, MIN_ITEM_SIZE, MIN_LEASE_TTL, MIN_NEAR_CAPACITY,
};
pub use cache::{Cache, DecodePolicy, FailurePolicy, Herd};
pub use clock::{Clock, SystemClock};
pub use codec::{Codec, Compression, DEFAULT_MAX_DECODE_SIZE};
pub use error::{Error, ErrorKind, LoadError, Result};
pub use key::{KeyFunction, MAX_KEY_LEN, default_key, validate_key};
pub use near::bus::{BusEvent, BusListener, BusTransport, InProcessBus};
pub use ping::{PING_KEY, PingError, PingFailure};
pub use stats::Stats;
pub use ttl::{MAX_ABSOLUTE_EXPTIME, Ttl};

#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

/// Entry points for the benches and the fuzz target. Not part of the API: no stability promise.
#[doc(hidden)]
pub mod __private {
    use crate::codec::{Codec, Format};
    use crate::envelope;

    /// The bytes `Cache::set` stores for `value` with `codec` (herd envelope with the given soft
    /// expiry).
    pub fn encode_envelope<T: serde::Serialize + ?Sized>(
        codec: Codec,
        value: &T,
        soft_expiry_ms: u64,
    ) -> crate::Result<Vec<u8>> {
        let mut out = Vec::new();
        let mut header = envelope::Header::value(soft_expiry_ms, soft_expiry_ms, 0, 60_000);
        header.codec = codec;
        header.write(&mut out);
        let format = Format {
            codec,
            ..Format::default()
        };
        format.encode_into(value, &mut out)?;
        Ok(out)
    }

    /// Decodes an item as `Cache::get` does (envelope, then the codec that wrote it, with the
    /// default decode limit), ignoring expiry. An item of a newer format is a decode error here.
    pub fn decode_envelope<T: serde::de::DeserializeOwned>(
        flags: u32,
        bytes: &[u8],
    ) -> crate::Result<T> {
        match envelope::decode(flags, bytes)? {
            envelope::Parsed::Item(h, payload) => {
                Format::default().decode(h.codec, h.compressed, payload)
            }
            envelope::Parsed::Newer(v) => Err(crate::Error::decode(format!("format {v}"))),
        }
    }

    /// A placeholder envelope ("being loaded by `token` until `claim_until_ms`"), as a load in
    /// progress leaves under a key; for tests of dead and stuck holders.
    pub fn placeholder(now_ms: u64, claim_until_ms: u64, token: u64) -> Vec<u8> {
        envelope::Header::placeholder(now_ms, claim_until_ms, token.max(1)).to_bytes()
    }

    /// memcached flags on enveloped items.
    pub const FLAGS: u32 = envelope::FLAGS;

    /// Parses `bytes` as a server's reply to `gets keys...`; for the fuzz target.
    pub fn parse_gets_reply(bytes: &[u8], keys: &[&str]) -> crate::Result<usize> {
        let mut out = vec![None; keys.len()];
        let mut r = bytes;
        crate::backend::memcached::wire::read_values(
            &mut r,
            crate::backend::DEFAULT_ITEM_SIZE,
            keys,
            &mut out,
        )?;
        Ok(out.iter().flatten().count())
    }
}
