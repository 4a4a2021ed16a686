//! The Redis / Valkey backend (feature `redis`): memcached's storage semantics on one Redis or
//! Valkey server, or a Redis Cluster, through the `redis` crate (redis-rs).
//!
//! The same keys, envelope and herd protection as on memcached: one load per expiry across
//! processes, and a load's store fenced against its claim (a `DEL` or `SET` from any client is
//! never overwritten). Redis 6.2 or later (Lua scripting, `EXAT`, `KEEPTTL`), or Valkey; tested
//! on Redis 7.0 and Valkey 9.1.
//!
//! ```no_run
//! let cache = newcache::Cache::builder()
//!     .redis("redis://user:password@127.0.0.1:6379/0") // never connects
//!     .build()?;                                      // build_async() for an AsyncCache
//! # Ok::<(), newcache::Error>(())
//! ```
//!
//! # Connecting
//!
//! - **URLs**: `redis://[user:password@]host[:port][/db]`; `rediss://` for TLS (feature
//!   `redis-tls`). The password is never printed (`Debug`, errors, logs).
//! - **ACL users** need `GET`, `MGET`, `SET`, `EXISTS`, `PERSIST`, `PEXPIRE`, `EXPIREAT`,
//!   `UNLINK`, `SCAN`, `EVAL` and `EVALSHA` on the cache's keys, and `WAIT` with
//!   [`redis_wait`](crate::CacheBuilder::redis_wait). Optional: `CONFIG GET` (the eviction
//!   policy check) and `CLIENT INFO` and `CLIENT KILL` (`+client|info +client|kill`, for the
//!   replay after an outage). A wrong password or a command the user may not run (`NOPERM`,
//!   named in the error) is an [`is_denied`](crate::Error::is_denied) error, warned about once;
//!   it is an answer, not a fault, so the server is never marked dead for it.
//! - **TLS** ([`redis_tls`](crate::CacheBuilder::redis_tls), feature `redis-tls`, on rustls):
//!   the server's certificate is always verified, its host name included, against the system's
//!   roots or a CA you give; client certificates for `tls-auth-clients yes`. There is no way to
//!   turn verification off (`#insecure` is refused). A refused handshake says why and is not a
//!   fault of the server. Connections use the process's rustls `CryptoProvider`, installing
//!   ring's if none is. Not yet: unix sockets.
//! - **Eviction**: the first answer from a server asks its `maxmemory-policy` and warns on
//!   `noeviction` (writes fail once memory is full) or `volatile-*` (values stored with
//!   `Ttl::Never` are never evicted). A cache wants `allkeys-lru` or `allkeys-lfu`.
//!
//! # What is stored
//!
//! Each item is a Redis string: a 13-byte header (a tag, a random stamp that is the item's CAS
//! token, memcached's flags) and the value. Fenced writes are a one-key Lua script comparing the
//! stamp (`EVALSHA`; no `WATCH`/`MULTI`), placeholders `SET … NX`, expiries `PX`/`EXAT`.
//! Counters keep memcached's rules (a missing counter is `None`, `decr` stops at 0, `incr`
//! wraps), in a script. A value another client wrote reads as foreign bytes (a decode error, or
//! a miss under [`DecodePolicy::Miss`](crate::DecodePolicy::Miss)). Keys are held to memcached's
//! 250 bytes, so a cache moves between the backends unchanged. [`Cache::clear`](crate::Cache::clear)
//! removes only this cache's keys (`SCAN` for its prefix, then `UNLINK`; never `FLUSHDB`), at a
//! cost that grows with the whole database.
//!
//! The sync `Cache` keeps a pool of [`pool_size`](crate::CacheBuilder::pool_size) blocking
//! connections; `AsyncCache` one multiplexed connection, on which `get`s made while another
//! read is on the wire go out together as one `MGET`.
//!
//! # Without scripting
//!
//! What a server offers for a fenced write is learned once per node, before any script is sent:
//!
//! - `EVAL`/`EVALSHA` renamed away or absent, but `SET … IFEQ` (Valkey 8.1 and later, Redis 8.4
//!   and later): a fenced write reads the key and writes only over the bytes it read; loads
//!   work as everywhere.
//! - Neither: the server is treated as a memcached without CAS. Plain reads, writes and deletes
//!   work; a loader fails with an [`is_unsupported`](crate::Error::is_unsupported) error before
//!   it runs, `get` serves a stale value unclaimed, counters are unsupported, and `ping()` fails
//!   saying what the server lacks. This is learned once for the life of the backend: rebuild the
//!   cache after changing a server's scripting.
//! - An ACL user denied `EVAL`/`EVALSHA` (`NOPERM`: the command exists): loaders' values are
//!   returned but not stored, and herd protection across processes falls to turns: the
//!   placeholder is removed and the next call of the key loads at once, while a call from
//!   another process that came during the load waits for it, then loads in turn.
//!
//! # When a server fails
//!
//! As on memcached (see [`backend::memcached`](crate::backend::memcached#when-a-server-fails)):
//! by default a failed read is a miss and a failed write returns its error; after
//! [`failure_limit`](crate::CacheBuilder::failure_limit) transport faults in a row the server is
//! marked dead and fails fast until a probe every
//! [`retry_interval`](crate::CacheBuilder::retry_interval) succeeds; every wait is bounded by
//! [`connect_timeout`](crate::CacheBuilder::connect_timeout) and
//! [`io_timeout`](crate::CacheBuilder::io_timeout). What differs:
//!
//! - **Restarted.** A read that meets a pooled connection the server closed is asked again on a
//!   fresh one. A write on a pooled connection idle more than 100 ms is sent only after a `PING`
//!   on it answered, so the first write after a restart or a failover goes on a fresh
//!   connection; a connection lost after a write was sent fails that write with an
//!   [`is_outcome_unknown`](crate::Error::is_outcome_unknown) error, never sent twice.
//! - **Deletes it missed** are replayed as on memcached, and this matters after a restart too: a
//!   server that persists its data (RDB, AOF) comes back with the keys it held, and this process
//!   deletes the ones it invalidated meanwhile before it reads there. The replay first closes the
//!   connections this process dropped with a request unanswered (`CLIENT KILL`), so a delayed
//!   write lands on no connection; a user not allowed `CLIENT INFO`/`CLIENT KILL` loses only
//!   that, warned once.
//! - A server at its `maxclients`, or loading its data, refuses: a fault, not a denial, and a
//!   delete it refused is queued for replay.
//!
//! # Redis Cluster
//!
//! [`CacheBuilder::redis_cluster`](crate::CacheBuilder::redis_cluster) takes seed URLs (any
//! nodes; IPv6 as `redis://[::1]:7000`; database 0 only). Each key goes to the master of its
//! hash slot (no hash tags: every claim, placeholder and fenced store touches one key, so the
//! herd protection is a single server's, on that master). Reads and writes go to masters only.
//!
//! - **Resharding**: a `MOVED` reply sends the command again where it names and refreshes the
//!   slot map; an `ASK` sends `ASKING` and the command there once. Slots moved under load cost
//!   the callers no error, no lost write and no second load. A delete queued for a master's
//!   replay whose slot moved is made where the key went.
//! - **A master down** fails only its own keys (with `cluster-require-full-coverage no`: see
//!   Failover), in a batch too: each master has its own connections, health record and replay
//!   record. A batch is split by master and costs one
//!   round trip; the sync `Cache` writes every master's part before it reads a reply, so a batch
//!   lasts about one `connect_timeout` plus one `io_timeout` however many masters hang.
//! - **Failover**: a node's fault refreshes the slot map (at most once per `retry_interval`), so
//!   the promoted replica serves its slots. A call of which nothing was sent (its master's
//!   connect refused or timed out, or the master marked dead) goes once to the slot's master in
//!   the refreshed map, so the first calls after a failover succeed; a sync write that meets a
//!   pooled connection the dead master closed fails `is_outcome_unknown()` instead. During the
//!   switch only the failed master's keys fail, if the nodes run with
//!   `cluster-require-full-coverage no`; with Redis's default (`yes`) every node refuses every
//!   key until the replica has taken over.
//! - **`CLUSTERDOWN`** fails only the keys it answers, with an error naming it and the node, and
//!   marks no node dead. A write or delete refused because the whole cluster is down is queued
//!   for replay; one refused because its slot alone has no master is not (its error says so).
//! - [`Cache::clear`](crate::Cache::clear) scans every master and names the one that failed;
//!   `ping()` asks every master. Nothing is detected per Redis version, so a rolling upgrade or a
//!   failover changes nothing in what is sent. The nodes the map names are reached with the first
//!   seed's scheme and credentials.
//!
//! # Replication and `redis_wait`
//!
//! Replication is asynchronous: a `DEL` or a claim the master acknowledged but had not sent to
//! its replica vanishes if that replica is promoted, so an old value can come back as fresh or a
//! key be loaded twice, and the old master's missed invalidations are not replayed to the new
//! one. [`redis_wait(replicas, timeout)`](crate::CacheBuilder::redis_wait) narrows that window:
//! each store and delete is followed by `WAIT`, pipelined with it, on connections of its own (up
//! to `pool_size`), so no other call waits behind it. A write its replicas did not acknowledge
//! in time (or whose `WAIT` was refused) fails with an `is_outcome_unknown()` error (the write
//! is on the master) that the write failure policy returns or absorbs; the server is not marked
//! dead for it. The wait must be shorter than `io_timeout` (`build()` checks). It makes writes
//! several times slower, and it is not consensus: a write acknowledged by one replica is lost if
//! another that lacks it is promoted. Not yet: replica reads.

#[cfg(feature = "tokio")]
mod batch;
mod blocking;
mod bus;
mod clients;
mod cluster;
mod config;
mod conn;
mod fence;
mod item;
#[cfg(feature = "tokio")]
pub(crate) mod nonblocking;
mod reply;
mod request;
mod route;
mod script;
mod setup;
mod slots;
#[cfg(feature = "redis-tls")]
mod tls;
#[cfg(feature = "tokio")]
mod waited;

use std::ops::Deref;
use std::sync::Arc;
use std::time::Instant;

use smallvec::SmallVec;

pub use self::bus::RedisBus;
pub use self::cluster::RedisCluster;
pub use self::config::{DEFAULT_KEY_LIMIT, RedisConfig, ReplicaWait};
use self::conn::{Pool, Window};
use self::fence::{Compared, Fence};
use self::reply::answered;
pub(crate) use self::reply::{Cause, Failure, connect_failure, failure_of};
use self::request::{Replies, Request, noscript_retry};
use self::script::Scripts;
#[cfg(feature = "redis-tls")]
pub use self::tls::RedisTls;
use super::server::Options;
use super::server::health::Health;
use super::server::outage::{self, Missed, Replay};
use super::server::replay::{self, WaitBound};
use super::{Backend, Item, StoreMode, StoreOutcome, Write};
use crate::error::{Error, ErrorKind, Result};
use crate::rng::{Rng, entropy};

/// One Redis server as both views know it: what they share.
#[derive(Debug)]
pub(crate) struct Server {
    config: RedisConfig,
    /// The settings every server connection has, from `config`.
    options: Options,
    /// `host:port`.
    addr: String,
    health: Arc<Health>,
    /// This process's connections to the server that a replay is to close first.
    clients: Arc<clients::Clients>,
    requests: request::Builder,
    stamps: Rng,
    /// Set once the eviction policy was asked for.
    policy_checked: std::sync::atomic::AtomicBool,
    /// Set once a refusal of this client (credentials, ACL) was warned about.
    denial_warned: std::sync::atomic::AtomicBool,
    /// A cluster node's: the health record of the node at an address, where a replayed delete
    /// this node redirected goes.
    peers: std::sync::OnceLock<Peers>,
}

/// The health record (with its record of missed invalidations) of a cluster node by its
/// address, if it can be reached: given to each node's [`Server`] by its cluster's router.
pub(crate) struct Peers(Box<PeerOf>);

/// A node's health record by its address ([`Peers`]).
type PeerOf = dyn Fn(&str) -> Option<Arc<Health>> + Send + Sync;

impl std::fmt::Debug for Peers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Peers")
    }
}

/// How long a caller waits for another's replay of what the server missed before it gives up:
/// as long as that replay may take, its connect included (a wait for the pool or for another
/// caller's connect, the connect, the connection's set-up: a `connect_timeout` each; its
/// `CLIENT INFO`: an `io_timeout`) and its `UNLINK`s (an `io_timeout`; the sync pool's one
/// retry on a stale connection, another).
const REPLAY_WAIT: WaitBound = WaitBound {
    connects: 3,
    ios: 3,
};

impl Server {
    /// A fresh stamp for a write.
    fn stamp(&self) -> u64 {
        item::stamp_of(self.stamps.next_u64())
    }

    /// Names the server in an error that does not name one yet.
    fn annotate(&self, e: Error) -> Error {
        if e.server().is_none() {
            e.in_context(format!("redis at {}", self.addr))
                .at_server(&self.addr)
        } else {
            e
        }
    }

    /// An answer's error, named after the server; a refusal of this client (a wrong password,
    /// a command the ACL user may not run, the `WAIT` after a write included) is warned about
    /// once: under the default failure policy a refused read is a miss and a loader's refused
    /// store is counted, so the warning may be the only sign of it.
    fn answer_error(&self, e: Error) -> Error {
        let e = self.annotate(e);
        if (e.is_denied() || reply::refusal_code(&e) == Some("NOPERM"))
            && !self
                .denial_warned
                .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            tracing::warn!(
                server = %self.addr,
                error = %e,
                "newcache: redis refused this client (warned once); what it refuses fails, or is \
                 absorbed by the failure policy, until the URL's user and password or the \
                 user's ACL are fixed"
            );
        }
        e
    }

    /// [`answer_error`](Server::answer_error) for each error reply of a batch's items (it
    /// names the server, as a single key's does).
    fn answer_errors<T>(&self, results: Vec<Result<T>>) -> Vec<Result<T>> {
        if results.iter().all(Result::is_ok) {
            return results;
        }
        results
            .into_iter()
            .map(|r| r.map_err(|e| self.answer_error(e)))
            .collect()
    }

    /// The error of a request that failed without a fault ([`Failure::Local`]). A denial or
    /// an error reply is the server's answer: it is up, so it counts as one (a probe's brings a
    /// server marked dead back, and the calls after it say what was refused, not "marked
    /// dead").
    fn local_failure(&self, probe: bool, e: Error) -> Error {
        if answered(&e) {
            self.health.answered(probe);
        }
        self.answer_error(e)
    }

    /// The health gate: `Ok(probe)`, or the error of a call refused while the server is dead
    /// (nothing of it sent).
    fn gate(&self) -> Result<bool> {
        self.health.gate().map_err(Error::unsent)
    }

    /// Whether this caller is the first to reach the server (it then checks its eviction
    /// policy, once).
    fn first_answer(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        // A load first: every call asks, and a swap would write the shared line each time.
        !self.policy_checked.load(Relaxed) && !self.policy_checked.swap(true, Relaxed)
    }

    /// Warns about an eviction policy that breaks a cache's expectations.
    fn judge_policy(&self, policy: Option<&str>) {
        match policy {
            Some("noeviction") => tracing::warn!(
                server = %self.addr,
                "newcache: redis maxmemory-policy is noeviction: once memory is full every write \
                 fails (the cache stops storing, placeholders and claims included); set \
                 maxmemory-policy allkeys-lru (or allkeys-lfu) for a cache"
            ),
            Some(p) if p.starts_with("volatile") => tracing::warn!(
                server = %self.addr,
                policy = p,
                "newcache: redis maxmemory-policy evicts only keys with an expiry: values stored \
                 with Ttl::Never are never evicted; allkeys-lru (or allkeys-lfu) suits a cache"
            ),
            Some(_) => {}
            None => tracing::debug!(
                server = %self.addr,
                "newcache: CONFIG GET maxmemory-policy refused; eviction policy not checked"
            ),
        }
    }

    /// Remembers the node's fenced write (the probe's answer); the first time, says what a
    /// node without scripting lacks.
    fn learned(&self, f: Fence) -> Fence {
        let first = self.requests.fence.learn(f);
        if let Some(missing) = f.missing().filter(|_| first) {
            tracing::warn!(server = %self.addr, "newcache: the redis server lacks {missing}");
        }
        f
    }

    /// Whether a write must know the node's fenced write before it is built: a `cas` (a
    /// script, `IFEQ`, or refused), or a write read back (its item's token is 0 on a node
    /// without one). A batch's writes are all read back: the batch loader writes its
    /// placeholders with `store_many` and reads them back with `get_many`.
    fn needs_fence(&self, w: &Write<'_>, read_back: bool) -> bool {
        self.requests.fence.get().is_none() && (read_back || matches!(w.mode, StoreMode::Cas(_)))
    }

    /// A write read back (a claim or placeholder of the herd protocol) on a node without a
    /// fenced write is refused before anything is written: nothing could fence the load
    /// behind it, and nobody is to wait behind a placeholder that is deleted at once.
    fn fenceable(&self, read_back: bool) -> Result<()> {
        match self.requests.fence.get() {
            Some(Fence::None) if read_back => Err(self.annotate(self.requests.unfenced())),
            _ => Ok(()),
        }
    }

    /// The `cas` token of `w` if it is to be fenced by comparison (`SET … IFEQ`).
    fn by_comparison(&self, w: &Write<'_>) -> Option<u64> {
        match w.mode {
            StoreMode::Cas(token)
                if token != 0 && self.requests.fence.get() == Some(Fence::IfEq) =>
            {
                Some(token)
            }
            _ => None,
        }
    }

    /// Whether a batch of `writes` goes one write at a time: it holds a `cas` and the node
    /// has no script for it (each is read and compared, or refused).
    fn one_by_one(&self, writes: &[Write<'_>]) -> bool {
        self.requests.fence.get().is_some_and(|f| f != Fence::Lua)
            && writes.iter().any(|w| matches!(w.mode, StoreMode::Cas(_)))
    }

    /// A request as built, a refusal of a script on a node without scripting named after the
    /// node (a refusal made before anything is sent, as a `cas` on a memcached without CAS
    /// names its server).
    fn named<T>(&self, req: Result<T>) -> Result<T> {
        req.map_err(|e| match e.is_unsupported() {
            true => self.annotate(e),
            false => e,
        })
    }

    /// Each of `writes` failed with `e` before it was sent (the probe of the node's fenced
    /// write failed), recorded as a write that may have missed the server.
    fn unwritten<T>(&self, writes: &[Write<'_>], e: &Error) -> Vec<Result<T>> {
        writes
            .iter()
            .map(|w| self.after_write(w.key, Err(e.clone())))
            .collect()
    }

    /// A ping's answer, given the node's fenced write: a node without one fails it, as
    /// newcache's loader cannot run there.
    fn usable(&self, fence: Fence) -> Result<()> {
        match fence {
            Fence::None => Err(self.annotate(self.requests.unfenced())),
            Fence::Lua | Fence::IfEq => Ok(()),
        }
    }

    /// The invalidations the server missed.
    fn missed(&self) -> &Missed {
        &self.health.missed
    }

    /// What a write to `key` that failed with `r`'s error leaves: if it may have missed the
    /// server, the key is recorded for the replay (and its error says so). An error reply
    /// did not miss it (the key holds what it held: `READONLY`, `OOM`, ...), unless the
    /// server is not serving yet (`reply::not_serving_yet`: loading its data).
    fn after_write<T>(&self, key: &str, r: Result<T>) -> Result<T> {
        match r {
            // The server answered (an error reply, a denial, a `WAIT` short of replicas): it
            // missed nothing.
            Err(e) if answered(&e) || reply::is_wait_failure(&e) => Err(e),
            r => outage::after_write(self.missed(), None, key, r, self.options.replay_capacity),
        }
    }

    /// [`after_write`](Server::after_write) for each write of a batch (`keys` in order).
    fn after_writes<'k, T>(
        &self,
        keys: impl Iterator<Item = &'k str>,
        results: Vec<Result<T>>,
    ) -> Vec<Result<T>> {
        results
            .into_iter()
            .zip(keys)
            .map(|(r, k)| self.after_write(k, r))
            .collect()
    }

    /// Judges an item read by the record: a value written before a key did not fit it is made
    /// stale (`outage::distrust`). On a node without a fenced write its token is 0, as a
    /// memcached without CAS reports, so the herd protocol claims nothing there.
    fn distrust(&self, item: Option<&mut Item>) {
        if let Some(item) = item {
            outage::distrust(item, self.missed().stale_before_ms());
            if self.requests.fence.get() == Some(Fence::None) {
                item.cas = 0;
            }
        }
    }

    /// [`distrust`](Server::distrust) for each read of a batch.
    fn distrust_all(&self, mut items: Vec<Result<Option<Item>>>) -> Vec<Result<Option<Item>>> {
        if self.missed().stale_before_ms() != 0 || self.requests.fence.get() == Some(Fence::None) {
            for item in items.iter_mut().filter_map(|r| r.as_mut().ok()) {
                self.distrust(item.as_mut());
            }
        }
        items
    }

    /// How long a caller waits for another's replay before it gives up ([`REPLAY_WAIT`]).
    fn replay_wait(&self) -> std::time::Duration {
        REPLAY_WAIT.of(&self.options)
    }

    /// The request of a replay of `keys`: first the `CLIENT KILL`s of this process's
    /// connections dropped with a request perhaps still in the network.
    fn replay_request(&self, keys: &[&str]) -> request::ReplayRequest {
        self.requests.replay(self.clients.to_close(), keys)
    }

    /// The keys of `replay` were deleted by `req`, as `done` says (refused ones passed over,
    /// redirected ones handed to the record of the node that holds them now, whose next call
    /// deletes them before anything else), and the connections it was to close are closed (or
    /// the server refused to: warned once).
    fn replayed<M: Deref<Target = Missed>>(
        &self,
        replay: Replay<M>,
        req: &request::ReplayRequest,
        done: &request::Replayed,
    ) {
        if !done.redirected.is_empty() {
            let keys: Vec<&str> = replay.keys().collect();
            for (i, addr) in &done.redirected {
                let there = self.peers.get().and_then(|p| (p.0)(addr));
                match (keys.get(*i), there) {
                    // A key that does not fit there makes that node's older values stale.
                    (Some(key), Some(there)) => {
                        there.missed.note(key, None, self.options.replay_capacity);
                    }
                    // Not a node of this process's cluster (a URL it cannot make).
                    _ => tracing::warn!(
                        server = %self.addr,
                        to = %addr,
                        "newcache: a replayed delete was redirected to a node that cannot be \
                         reached; passed over"
                    ),
                }
            }
        }
        if let Some((code, detail)) = &done.kill_refused {
            self.clients.refused(code, detail.as_deref());
        }
        self.clients.closed(&req.kills);
        if done.refused > 0 {
            tracing::warn!(
                server = %self.addr,
                refused = done.refused,
                "newcache: the redis server refused some of the replayed deletes; their keys \
                 are passed over"
            );
        }
        replay.done(
            &self.addr,
            done.refused + done.redirected.len(),
            |_| None,
            self.options.replay_capacity,
        );
    }

    /// `replay` failed with `f`: its keys are kept for the next attempt.
    fn replay_failed<M: Deref<Target = Missed>>(&self, replay: Replay<M>, f: &Failure) {
        replay.failed(&self.addr, f.error(), self.options.replay_capacity);
    }
}

/// `flush_all`'s refusal.
fn refuse_flush() -> Error {
    Error::new(
        ErrorKind::Unsupported,
        "newcache never sends FLUSHDB or FLUSHALL to redis (other keys share the database): \
         Cache::clear removes the cache's own keys",
    )
}

/// A [`Backend`] on one Redis or Valkey server (feature `redis`).
///
/// Built by [`CacheBuilder::redis`](crate::CacheBuilder::redis) (or `RedisBackend::new` with a
/// [`RedisConfig`]); it never connects until the first call.
pub struct RedisBackend {
    shared: Arc<Server>,
    pool: Arc<Pool>,
    /// The connections of writes followed by a `WAIT` (`redis_wait`), up to `pool_size` beside
    /// `pool`: a `WAIT` holds its connection for as long as it waits, and must not take the
    /// connections the other calls need.
    waited: Arc<Pool>,
    /// Each command is sent after `ASKING` (a cluster node's view for the keys of a slot being
    /// imported, to follow an `ASK` redirect).
    asking: bool,
}

impl std::fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBackend")
            .field("server", &self.shared.addr)
            .finish_non_exhaustive()
    }
}

impl RedisBackend {
    /// Sets up the pool (without connecting).
    ///
    /// # Errors
    ///
    /// A configuration error (`is_config()`) for a URL the `redis` crate cannot read, a scheme
    /// other than `redis://`, a zero pool size or a zero timeout.
    pub fn new(config: RedisConfig) -> Result<RedisBackend> {
        RedisBackend::with(config, false)
    }

    /// A view of one node of a Redis Cluster: its batches name one key per command.
    pub(super) fn node(config: RedisConfig) -> Result<RedisBackend> {
        RedisBackend::with(config, true)
    }

    fn with(config: RedisConfig, cluster: bool) -> Result<RedisBackend> {
        if config.wait.is_some_and(|w| w.replicas == 0) {
            return Err(Error::config(
                "a WAIT for 0 replicas waits for nothing: ask for 1 or more (or no wait)",
            ));
        }
        if let Some(w) = config.wait {
            if w.timeout >= config.io_timeout {
                return Err(Error::config(format!(
                    "a WAIT of {:?} is cut off by the io_timeout of {:?} (the reply comes after \
                     it): make the wait shorter than io_timeout",
                    w.timeout, config.io_timeout
                )));
            }
        }
        let client = config.client()?;
        let clients = Arc::new(clients::Clients::new(config.addr()));
        let options = config.options();
        let shared = Arc::new(Server {
            addr: config.addr(),
            health: Arc::new(Health::new("redis", config.addr(), &options)),
            clients: clients.clone(),
            requests: request::Builder {
                wait: config.wait,
                item_size: options.item_size,
                key_limit: config.key_limit,
                scripts: Scripts::new(),
                fence: Default::default(),
                cluster,
            },
            stamps: Rng::new(entropy()),
            policy_checked: Default::default(),
            denial_warned: Default::default(),
            peers: Default::default(),
            options,
            config,
        });
        let info = client.get_connection_info();
        Ok(RedisBackend {
            waited: Arc::new(Pool::new(info, &shared.config, clients.clone())?),
            pool: Arc::new(Pool::new(info, &shared.config, clients)?),
            shared,
            asking: false,
        })
    }

    /// This view, each command sent after `ASKING` (same server, same pool and health).
    pub(super) fn asking(&self) -> RedisBackend {
        RedisBackend {
            shared: self.shared.clone(),
            pool: self.pool.clone(),
            waited: self.waited.clone(),
            asking: true,
        }
    }

    /// `host:port`.
    pub(super) fn addr(&self) -> &str {
        &self.shared.addr
    }

    /// The slot map, as this node sees it, asked within what is left until `by`, when given (a cluster batch's refresh: its connect
    /// and its reply within the batch's connect deadline, [`LATE`](conn::LATE) at least).
    pub(super) fn slots_by(&self, by: Option<Instant>) -> Result<Vec<slots::Range>> {
        let sent = self.begin_by(Ok(request::Builder::cluster_slots()), by)?;
        let mut window = by.map(|by| Window::until(by, self.shared.options.io_timeout));
        let reply = self.finish(sent, window.as_mut())?;
        slots::parse_slots(reply, &self.shared.addr).map_err(|e| self.shared.annotate(e))
    }

    /// Where this cluster node's replay hands the deletes another node is named for
    /// ([`Peers`]); once.
    pub(super) fn use_peers(
        &self,
        peers: impl Fn(&str) -> Option<Arc<Health>> + Send + Sync + 'static,
    ) {
        let _ = self.shared.peers.set(Peers(Box::new(peers)));
    }

    /// The server's health record (its record of missed invalidations put on the cache's
    /// clock by the builder).
    pub(crate) fn health(&self) -> &Arc<Health> {
        &self.shared.health
    }

    /// What the async view shares with this one.
    #[cfg(feature = "tokio")]
    pub(crate) fn shared(&self) -> Arc<Server> {
        self.shared.clone()
    }

    /// The node's fenced write, asked once ([`fence`]).
    pub(super) fn fence(&self) -> Result<Fence> {
        let s = &self.shared;
        match s.requests.fence.get() {
            Some(f) => Ok(f),
            None => self.run(Ok(s.requests.fence_probe())).map(|f| s.learned(f)),
        }
    }

    /// `w` written and, with `read_back`, what the key then holds; on a node with `IFEQ` and
    /// no scripting a `cas` reads the key first ([`fence::compare`]).
    fn write_one(&self, w: &Write<'_>, read_back: bool) -> Result<(StoreOutcome, Option<Item>)> {
        let s = &self.shared;
        if s.needs_fence(w, read_back) {
            self.fence()?;
        }
        s.fenceable(read_back)?;
        if let Some(token) = s.by_comparison(w) {
            let before = self.run(s.requests.get(w.key))?;
            return match fence::compare(token, before.as_ref()) {
                Compared::Answer(outcome) => Ok((outcome, before)),
                Compared::Send(seen) => {
                    self.run(s.requests.store_ifeq(w, s.stamp(), &seen, read_back))
                }
            };
        }
        if read_back {
            self.run(s.named(s.requests.store_then_get(w, s.stamp())))
        } else {
            self.run(s.named(s.requests.store(w, s.stamp())))
                .map(|o| (o, None))
        }
    }

    /// Sends `req` on a pooled connection through the health gate and reads its answer.
    fn run<T>(&self, req: Result<Request<T>>) -> Result<T> {
        let sent = self.begin(req)?;
        self.finish(sent, None)
    }

    /// The first half of [`run`](RedisBackend::run): through the health gate, the replay of
    /// what the server missed, a connection checked out and `req` written on it. A failure is
    /// judged here (a fault counted); one before any byte of `req` was written is
    /// [`unsent`](Error::unsent).
    fn begin<T>(&self, req: Result<Request<T>>) -> Result<Sent<'_, T>> {
        self.begin_by(req, None)
    }

    /// [`begin`](RedisBackend::begin), its connect (or a check of a pooled connection) within
    /// what is left until `by`, when given (a cluster batch's deadline: [`conn::within`]).
    fn begin_by<T>(&self, req: Result<Request<T>>, by: Option<Instant>) -> Result<Sent<'_, T>> {
        let reserved = self.reserve(req, by)?;
        self.begin_reserved(reserved, by)
    }

    /// The first step of [`begin_by`](RedisBackend::begin_by): through the health gate and the
    /// replay, a connection checked out for `req`, and, if it needs a check, its `PING`
    /// written but not yet read. A cluster batch reserves every node's connection before it
    /// reads any check's reply, so a node asked after a hung one finds its reply waiting
    /// rather than a check timed by what the hung one left of the batch's deadline.
    fn reserve<T>(&self, req: Result<Request<T>>, by: Option<Instant>) -> Result<Reserved<'_, T>> {
        let s = &self.shared;
        let req = req?;
        super::note_server(&s.addr);
        let probe = s.gate()?;
        let conn = self
            .replay()
            .map_err(Failure::unsent)
            .and_then(|()| self.reserve_conn(self.pool_for(&req), &req, by));
        match conn {
            Ok((conn, pinged)) => Ok(Reserved {
                req,
                probe,
                conn,
                pinged,
            }),
            Err(f) => Err(self.judge(probe, f)),
        }
    }

    /// The second step of [`begin_by`](RedisBackend::begin_by): the reserved connection's
    /// check ended (its reply read within what is left until `by`, [`conn::within`]) and the
    /// request written.
    fn begin_reserved<'a, T>(
        &'a self,
        reserved: Reserved<'a, T>,
        by: Option<Instant>,
    ) -> Result<Sent<'a, T>> {
        let Reserved {
            req,
            probe,
            conn,
            pinged,
        } = reserved;
        let pool = self.pool_for(&req);
        let conn = match pinged {
            false => Ok(conn),
            true => self.confirm(pool, &req, conn, by),
        };
        match conn.and_then(|conn| self.put_on(pool, &req, conn, by)) {
            Ok(conn) => Ok(Sent { req, probe, conn }),
            Err(f) => Err(self.judge(probe, f)),
        }
    }

    /// The second half of [`run`](RedisBackend::run): the replies to `sent` read (each read
    /// within what is left of `window`, when given) and judged, the answer made.
    fn finish<T>(&self, sent: Sent<'_, T>, window: Option<&mut Window>) -> Result<T> {
        let s = &self.shared;
        let Sent { req, probe, conn } = sent;
        // A read in a window a batch's deadline cut short that times out says nothing against
        // the server (a late connect's rule, `conn::starved`).
        let cut = window.as_deref().is_some_and(Window::cut);
        let replies = self
            .read(&req, conn, window)
            .map_err(|f| self.judge(probe, conn::starved(f, cut)))?;
        s.health.answered(probe);
        if s.first_answer() {
            let policy = self.send(&s.requests.policy()).ok();
            let policy = policy.and_then(|r| (s.requests.policy().read)(r).ok().flatten());
            s.judge_policy(policy.as_deref());
        }
        req.answer(replies).map_err(|e| s.answer_error(e))
    }

    /// The error of a request that failed with `f`: a fault is counted (and the pool dropped
    /// if it marked the server dead).
    fn judge(&self, probe: bool, f: Failure) -> Error {
        let s = &self.shared;
        match f {
            Failure::Fault(e) => {
                let e = s.annotate(e);
                if s.health.fault(&e, probe) {
                    self.pool.clear();
                    self.waited.clear();
                }
                e
            }
            Failure::Local(e) => s.local_failure(probe, e),
        }
    }

    /// A batch of `op` over `items`, in one round trip.
    fn batch<I, T>(&self, items: &[I], op: BatchOp<I, T>) -> Vec<Result<T>> {
        let sent = self.begin_batch(items, &op, None);
        self.finish_batch(items, &op, sent, None)
    }

    /// The first half of [`batch`](RedisBackend::batch): its request written ([`begin`]).
    ///
    /// [`begin`]: RedisBackend::begin
    fn begin_batch<I, T>(
        &self,
        items: &[I],
        op: &BatchOp<I, T>,
        by: Option<Instant>,
    ) -> BatchSent<'_, T> {
        let reserved = self.reserve_batch(items, op, by);
        self.begin_reserved_batch(reserved, by)
    }

    /// The first step of [`begin_batch`](RedisBackend::begin_batch): its request made and its
    /// connection reserved ([`reserve`](RedisBackend::reserve)).
    fn reserve_batch<I, T>(
        &self,
        items: &[I],
        op: &BatchOp<I, T>,
        by: Option<Instant>,
    ) -> BatchReserved<'_, T> {
        let (refused, request) = (op.request)(&self.shared, items).split();
        BatchReserved {
            refused,
            reserved: request.map(|r| self.reserve(Ok(r), by)),
        }
    }

    /// The second step of [`begin_batch`](RedisBackend::begin_batch): the request written
    /// ([`begin_reserved`](RedisBackend::begin_reserved)).
    fn begin_reserved_batch<'a, T>(
        &'a self,
        reserved: BatchReserved<'a, T>,
        by: Option<Instant>,
    ) -> BatchSent<'a, T> {
        BatchSent {
            refused: reserved.refused,
            sent: reserved
                .reserved
                .map(|r| r.and_then(|r| self.begin_reserved(r, by))),
        }
    }

    /// The second half of [`batch`](RedisBackend::batch): one result per item.
    fn finish_batch<I, T>(
        &self,
        items: &[I],
        op: &BatchOp<I, T>,
        sent: BatchSent<'_, T>,
        window: Option<&mut Window>,
    ) -> Vec<Result<T>> {
        let results = match sent.sent {
            None => Ok(Vec::new()),
            Some(Ok(sent)) => self
                .finish(sent, window)
                .map(|rs| self.shared.answer_errors(rs)),
            Some(Err(e)) => Err(e),
        };
        (op.after)(&self.shared, items, sent.refused.join(results))
    }

    /// Deletes the keys the server missed while out of reach, before anything else is sent
    /// (or waits for the caller doing it). A replay that fails keeps its keys for the next one.
    fn replay(&self) -> std::result::Result<(), Failure> {
        let s = &self.shared;
        let ran = replay::enter(&s.health, s.replay_wait(), |replay| {
            let keys: Vec<&str> = replay.keys().collect();
            let req = s.replay_request(&keys);
            drop(keys);
            let r = self.send(&req.request).and_then(|vs| match req.read(vs) {
                Ok(Ok(done)) => Ok(done),
                // Not serving yet: nothing against it, and the keys are kept.
                Ok(Err(e)) => Err(Failure::Local(e)),
                Err(e) => Err(Failure::Fault(e)),
            });
            match r {
                Ok(done) => {
                    s.replayed(replay, &req, &done);
                    Ok(())
                }
                Err(f) => {
                    s.replay_failed(replay, &f);
                    Err(f)
                }
            }
        });
        ran.map_err(Failure::Local)?.unwrap_or(Ok(()))
    }

    /// The replies to `req`'s commands, outside the health gate (a replay, the policy check).
    fn send<T>(&self, req: &Request<T>) -> std::result::Result<Replies, Failure> {
        let conn = self.write(req, None)?;
        self.read(req, conn, None)
    }

    /// The pool `req` goes on: a write followed by a `WAIT` on connections of its own.
    fn pool_for<T>(&self, req: &Request<T>) -> &Pool {
        if req.wait.is_some() {
            &self.waited
        } else {
            &self.pool
        }
    }

    /// A pooled connection with `req` written on it. A failed checkout (a connect) sent
    /// nothing: [`unsent`](Error::unsent). A reused connection found closed is
    /// [`stale`](RedisBackend::stale).
    fn write<T>(
        &self,
        req: &Request<T>,
        by: Option<Instant>,
    ) -> std::result::Result<conn::Pooled<'_>, Failure> {
        let pool = self.pool_for(req);
        let conn = self.checkout(pool, req, by)?;
        self.put_on(pool, req, conn, by)
    }

    /// `req` written on `conn`, a connection of `pool` (checked, if it needed it); a reused
    /// connection found closed is [`stale`](RedisBackend::stale).
    fn put_on<'a, T>(
        &'a self,
        pool: &'a Pool,
        req: &Request<T>,
        mut conn: conn::Pooled<'a>,
        by: Option<Instant>,
    ) -> std::result::Result<conn::Pooled<'a>, Failure> {
        match self.put(&mut conn, req) {
            Ok(()) => Ok(conn),
            Err(e) if conn.reused() && e.is_connection_dropped() => {
                drop(conn);
                self.stale(pool, req, e)?;
                let mut conn = self.checkout(pool, req, by)?;
                self.put(&mut conn, req)
                    .map_err(|e| failure_of(e, req.write))?;
                Ok(conn)
            }
            Err(e) => Err(failure_of(e, req.write)),
        }
    }

    /// A connection of `pool` for `req`, nothing of it sent yet (a failure is
    /// [`unsent`](Error::unsent)). A write gets one known to be open: a connection idle past
    /// [`conn::CHECK_AFTER`] is [`check`](conn::Pooled::begin_check)ed first, and one found closed
    /// (its server's `timeout`, a restart, a failover) is replaced, not counted as a fault, the
    /// idle ones, as old, dropped with it.
    fn checkout<'a, T>(
        &self,
        pool: &'a Pool,
        req: &Request<T>,
        by: Option<Instant>,
    ) -> std::result::Result<conn::Pooled<'a>, Failure> {
        let (conn, pinged) = self.reserve_conn(pool, req, by)?;
        match pinged {
            false => Ok(conn),
            true => self.confirm(pool, req, conn, by),
        }
    }

    /// A connection of `pool` for `req`, and whether it needs its check's reply read
    /// ([`confirm`](RedisBackend::confirm)): the `PING` of a write's connection idle past
    /// [`conn::CHECK_AFTER`] is written here. Nothing of `req` is sent yet.
    fn reserve_conn<'a, T>(
        &self,
        pool: &'a Pool,
        req: &Request<T>,
        by: Option<Instant>,
    ) -> std::result::Result<(conn::Pooled<'a>, bool), Failure> {
        loop {
            let mut conn = pool.checkout(by).map_err(Failure::unsent)?;
            if !(req.write && conn.unchecked()) {
                return Ok((conn, false));
            }
            match conn.begin_check() {
                Ok(()) => return Ok((conn, true)),
                Err(e) if e.is_connection_dropped() => {
                    drop(conn);
                    pool.drop_idle();
                }
                Err(e) => return Err(failure_of(e, false).unsent()),
            }
        }
    }

    /// The reply to the check [`reserve_conn`](RedisBackend::reserve_conn) wrote on `conn`,
    /// read within `io_timeout` (what is left until `by`, when given: [`conn::within`]); a
    /// connection found closed is replaced ([`checkout`](RedisBackend::checkout)). A check
    /// written after `by` that times out counts no fault ([`conn::starved`]).
    fn confirm<'a, T>(
        &self,
        pool: &'a Pool,
        req: &Request<T>,
        mut conn: conn::Pooled<'a>,
        by: Option<Instant>,
    ) -> std::result::Result<conn::Pooled<'a>, Failure> {
        let timeout = by.map(|_| conn::within(self.shared.options.io_timeout, by));
        let late = conn.checked_late(by);
        match conn.end_check(timeout) {
            Ok(()) => Ok(conn),
            Err(e) if e.is_connection_dropped() => {
                drop(conn);
                pool.drop_idle();
                self.checkout(pool, req, by)
            }
            Err(e) => Err(conn::starved(failure_of(e, false).unsent(), late)),
        }
    }

    /// The replies to `req`, written on `conn` (a script the server did not know sent again
    /// with its source: `NOSCRIPT` means nothing ran; then its `WAIT` again). A reused
    /// connection found closed before the replies came is [`stale`](RedisBackend::stale).
    fn read<'a, T>(
        &'a self,
        req: &Request<T>,
        mut conn: conn::Pooled<'a>,
        window: Option<&mut Window>,
    ) -> std::result::Result<Replies, Failure> {
        let n = req.commands.len();
        let mut window = window;
        let timeout = window.as_deref_mut().and_then(Window::timeout);
        let mut replies = match self.recv(&mut conn, n, timeout) {
            Ok(r) => r,
            Err(e) if conn.reused() && e.is_connection_dropped() => {
                drop(conn);
                self.stale(self.pool_for(req), req, e)?;
                // A read: a connect that fails now sends nothing more. In a cluster batch, the
                // connect has what is left of the batch's connect deadline (and is not counted
                // as reading time), the reply what is left of the window.
                let connecting = Instant::now();
                let by = window.as_deref().and_then(Window::connect_by);
                let fresh = self.pool_for(req).checkout(by);
                if let Some(w) = window.as_deref_mut() {
                    w.connected(connecting.elapsed());
                }
                conn = fresh.map_err(Failure::unsent)?;
                self.put(&mut conn, req)
                    .and_then(|()| {
                        let timeout = window.and_then(Window::timeout);
                        self.recv(&mut conn, n, timeout)
                    })
                    .map_err(|e| failure_of(e, req.write))?
            }
            Err(e) => return Err(failure_of(e, req.write)),
        };
        let retry = noscript_retry(req, &replies, &self.shared.requests.scripts);
        if !retry.is_empty() {
            let again: Vec<&redis::Cmd> = retry.iter().map(|(_, c)| c).collect();
            let answers = self
                .exchange(&mut conn, &again)
                .map_err(|e| failure_of(e, req.write))?;
            for ((i, _), v) in retry.iter().zip(answers) {
                replies[*i] = v;
            }
        }
        conn.keep();
        Ok(replies)
    }

    /// A pooled connection of `pool` reused for `req` was found closed (`e`) after `req` was
    /// written: stale, not a fault (the server, a proxy or a restart closed it while it sat
    /// idle, as its `timeout` does), so nothing is counted and the idle connections, as old,
    /// are dropped. `Ok` for a request that is not a write: it goes once more on a fresh
    /// connection. A write is not sent again: a connection closed while idle cannot be told,
    /// once the write is sent, from one lost after the server ran the write and before its
    /// reply came (a proxy's restart, a `CLIENT KILL`, a reset), so it fails with its outcome
    /// unknown (and never [`unsent`](Error::unsent)). A write meets this only on a connection
    /// idle less than [`conn::CHECK_AFTER`] ([`checkout`](RedisBackend::checkout) checks the
    /// others first).
    fn stale<T>(
        &self,
        pool: &Pool,
        req: &Request<T>,
        e: redis::RedisError,
    ) -> std::result::Result<(), Failure> {
        pool.drop_idle();
        if !req.write {
            return Ok(());
        }
        Err(Failure::Local(
            Error::with_source(
                ErrorKind::Backend,
                "a pooled connection closed before the server answered (closed while idle, or \
                 its reply lost: the write may have run, and is not sent again)",
                Cause(e),
            )
            .with_outcome_unknown(),
        ))
    }

    /// Writes `req`'s commands on `conn` (each after `ASKING` for an asking view).
    fn put<T>(&self, conn: &mut conn::Pooled<'_>, req: &Request<T>) -> redis::RedisResult<()> {
        let cmds: SmallVec<[&request::Line; 1]> = req.commands.iter().map(|c| &c.cmd).collect();
        self.write_cmds(conn, &cmds)
    }

    fn write_cmds<C: request::Pack>(
        &self,
        conn: &mut conn::Pooled<'_>,
        cmds: &[&C],
    ) -> redis::RedisResult<()> {
        if !self.asking {
            return conn.write(cmds);
        }
        let asking = request::asking();
        conn.write(&request::after_asking(&asking, cmds))
    }

    /// The replies to the `n` commands written last on `conn` (those of an asking view's
    /// `ASKING`s left out).
    fn recv(
        &self,
        conn: &mut conn::Pooled<'_>,
        n: usize,
        timeout: Option<std::time::Duration>,
    ) -> redis::RedisResult<Replies> {
        if !self.asking {
            return conn.read(n, timeout);
        }
        conn.read(2 * n, timeout).map(request::asking_answered)
    }

    /// The replies to `cmds` on `conn`, written and read.
    fn exchange(
        &self,
        conn: &mut conn::Pooled<'_>,
        cmds: &[&redis::Cmd],
    ) -> redis::RedisResult<Replies> {
        self.write_cmds(conn, cmds)?;
        self.recv(conn, cmds.len(), None)
    }
}

/// A request written on a connection, its replies not read yet ([`RedisBackend::begin`]).
struct Sent<'a, T> {
    req: Request<T>,
    probe: bool,
    conn: conn::Pooled<'a>,
}

/// A request whose connection is reserved ([`RedisBackend::reserve`]): nothing of it written
/// yet, the connection's check (`pinged`) written and not yet read.
struct Reserved<'a, T> {
    req: Request<T>,
    probe: bool,
    conn: conn::Pooled<'a>,
    pinged: bool,
}

/// A batch written ([`RedisBackend::begin_batch`]): the items refused before sending, and its
/// request (`None`: nothing to send), or the error that kept it from being written.
struct BatchSent<'a, T> {
    refused: request::Refused,
    sent: Option<Result<Sent<'a, Vec<Result<T>>>>>,
}

/// A batch whose connection is reserved ([`RedisBackend::reserve_batch`]), nothing of it
/// written yet.
struct BatchReserved<'a, T> {
    refused: request::Refused,
    reserved: Option<Result<Reserved<'a, Vec<Result<T>>>>>,
}

/// A batch operation of the storage interface on one server: the request of its items, and
/// what its results become there (read through the record of missed invalidations, or written
/// into it). The single-node backend and a cluster's split batches run the same.
struct BatchOp<I, T> {
    request: fn(&Server, &[I]) -> request::Batch<T>,
    after: fn(&Server, &[I], Results<T>) -> Results<T>,
}

/// One result per item of a batch.
type Results<T> = Vec<Result<T>>;

/// `get_many`.
fn gets<'k>() -> BatchOp<&'k str, Option<Item>> {
    BatchOp {
        request: |s, keys| s.requests.get_many(keys),
        after: |s, _, items| s.distrust_all(items),
    }
}

/// `store_many`.
fn stores<'w>() -> BatchOp<Write<'w>, StoreOutcome> {
    BatchOp {
        request: |s, writes| s.requests.store_many(writes, || s.stamp()),
        after: |s, writes, rs| s.after_writes(writes.iter().map(|w| w.key), rs),
    }
}

/// `delete_many`.
fn deletes<'k>() -> BatchOp<&'k str, bool> {
    BatchOp {
        request: |s, keys| s.requests.delete_many(keys),
        after: |s, keys, rs| s.after_writes(keys.iter().copied(), rs),
    }
}

impl Backend for RedisBackend {
    fn get(&self, key: &str) -> Result<Option<Item>> {
        let mut item = self.run(self.shared.requests.get(key))?;
        self.shared.distrust(item.as_mut());
        Ok(item)
    }

    fn get_many(&self, keys: &[&str]) -> Vec<Result<Option<Item>>> {
        self.batch(keys, gets())
    }

    fn store(&self, w: Write<'_>) -> Result<StoreOutcome> {
        let r = self.write_one(&w, false).map(|(outcome, _)| outcome);
        self.shared.after_write(w.key, r)
    }

    fn store_then_get(&self, w: Write<'_>) -> Result<(StoreOutcome, Option<Item>)> {
        let s = &self.shared;
        let r = self.write_one(&w, true);
        let (outcome, mut item) = s.after_write(w.key, r)?;
        s.distrust(item.as_mut());
        Ok((outcome, item))
    }

    fn store_many(&self, writes: &[Write<'_>]) -> Vec<Result<StoreOutcome>> {
        if writes.iter().any(|w| self.shared.needs_fence(w, true)) {
            if let Err(e) = self.fence() {
                return self.shared.unwritten(writes, &e);
            }
        }
        if self.shared.one_by_one(writes) {
            return writes.iter().map(|w| self.store(*w)).collect();
        }
        self.batch(writes, stores())
    }

    fn delete(&self, key: &str) -> Result<bool> {
        let s = &self.shared;
        s.after_write(key, self.run(s.requests.delete(key)))
    }

    fn delete_many(&self, keys: &[&str]) -> Vec<Result<bool>> {
        self.batch(keys, deletes())
    }

    fn touch(&self, key: &str, exptime: u32) -> Result<bool> {
        let s = &self.shared;
        s.after_write(key, self.run(s.requests.touch(key, exptime)))
    }

    fn incr(&self, key: &str, delta: u64) -> Result<Option<u64>> {
        let s = &self.shared;
        self.fence()?;
        self.run(s.named(s.requests.arith(key, delta, true, s.stamp())))
    }

    fn decr(&self, key: &str, delta: u64) -> Result<Option<u64>> {
        let s = &self.shared;
        self.fence()?;
        self.run(s.named(s.requests.arith(key, delta, false, s.stamp())))
    }

    /// Refused: it would empty the whole database, other applications' keys included; the
    /// cache's `clear` removes its own keys instead.
    fn flush_all(&self) -> Result<()> {
        Err(refuse_flush())
    }

    fn clear(&self, prefix: Option<&str>) -> Result<()> {
        let b = &self.shared.requests;
        let pattern = request::prefix_pattern(prefix.ok_or_else(request::no_prefix)?);
        let mut cursor = 0;
        loop {
            let (next, keys) = self.run(Ok(b.scan(cursor, &pattern)))?;
            if !keys.is_empty() {
                self.run(Ok(b.unlink(&keys)))?;
            }
            if next == 0 {
                return Ok(());
            }
            cursor = next;
        }
    }

    fn max_value_size(&self, key: &str) -> usize {
        self.shared.requests.max_value_size(key)
    }

    /// The replays of invalidations the server missed (`replayed_deletes`, `replay_overflows`,
    /// `replays_failed`), through either view.
    fn report(&self, stats: &mut crate::Stats) {
        outage::report(std::iter::once(self.shared.missed()), stats);
    }

    /// A read of [`PING_KEY`](crate::ping::PING_KEY), then (once) the probe of the node's
    /// fenced write: a server without scripting and without `SET IFEQ` fails with an
    /// [`is_unsupported`](Error::is_unsupported) error that says what it lacks.
    fn ping(&self) -> std::result::Result<(), crate::ping::PingError> {
        let s = &self.shared;
        self.get(crate::ping::PING_KEY)
            .and_then(|_| self.fence())
            .and_then(|f| s.usable(f))
            .map_err(|e| crate::ping::single(&s.addr, e))
    }
}
