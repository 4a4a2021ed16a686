//! The memcached backend: one connection pool per server, keys placed by ketama, batches split by
//! server: every server's request is written, then every reply read, in the calling thread.
//!
//! Built by [`CacheBuilder::memcached`](crate::CacheBuilder::memcached) (one server per entry),
//! [`memcached_weighted`](crate::CacheBuilder::memcached_weighted) or
//! [`memcached_list`](crate::CacheBuilder::memcached_list) (`"a:11211,b:11211"`, split on `,`,
//! `;` and whitespace). It speaks memcached's text protocol, which twemproxy and mcrouter speak
//! too. `build()` never connects.
//!
//! # Connections
//!
//! The sync [`Cache`](crate::Cache) keeps one small blocking pool per server
//! ([`pool_size`](crate::CacheBuilder::pool_size)) for a caller alone and, for callers that
//! overlap ([`pipelined_sync`](crate::CacheBuilder::pipelined_sync), on by default),
//! [`async_connections`](crate::CacheBuilder::async_connections) (2) pipelined connections per
//! server on a thread it starts at the first overlap. `AsyncCache` uses the pipelined
//! connections only. Both share one health record per server. Keys, expiries and value sizes are
//! checked before a byte is written: a command goes whole and valid, or not at all.
//!
//! # Placement
//!
//! libmemcached's weighted ketama (MD5, 160 points per server at equal weights, named
//! `host:port-i`, or `host-i` on port 11211), checked against placements a real libmemcached
//! made: a Python app using pylibmc with `behaviors={"ketama": True, "ketama_weighted": True}`
//! puts each key on the same server (`{"ketama": True}` alone hashes differently). Adding or
//! removing one of N servers moves about 1/N of the keys. A batch is split by server and costs
//! about one round trip however many servers it spans.
//!
//! # When a server fails
//!
//! What a caller sees depends on the failure policies: by default a failed read is a miss,
//! counted in [`Stats::backend_errors_absorbed`](crate::Stats::backend_errors_absorbed), and a
//! failed write returns its error
//! ([`read_failures`](crate::CacheBuilder::read_failures),
//! [`write_failures`](crate::CacheBuilder::write_failures)).
//!
//! - **Down** (connection refused, reset, an unparseable reply). After
//!   [`failure_limit`](crate::CacheBuilder::failure_limit) (2) consecutive transport faults the
//!   server is marked dead for [`retry_interval`](crate::CacheBuilder::retry_interval) (1 s),
//!   with one `tracing` warning. An error reply, a value too large or a wait for a busy pool is
//!   not a fault. While it is dead its keys fail at once ([`DeadServerPolicy::FailFast`], the
//!   default) or move to the other servers ([`DeadServerPolicy::Remap`], libmemcached's
//!   auto-eject; the copies written there are deleted when it returns). After the interval one
//!   caller probes it; only a successful probe brings it back, with a fresh pool and a second
//!   warning. A server that fails again soon after coming back waits twice as long before its
//!   next probe, up to 32 times the interval. A batch fails only the dead server's keys.
//! - **Hung** (stopped, a full network, a reply that trickles). A caller waits at most
//!   [`connect_timeout`](crate::CacheBuilder::connect_timeout) (500 ms) for a connection and
//!   [`io_timeout`](crate::CacheBuilder::io_timeout) (500 ms) for all of an operation's I/O
//!   (for each round of a large batch), however slowly bytes arrive. A connection that timed
//!   out or saw an error is dropped, never reused mid-reply. Each server has its own pool, and
//!   connections are made in the calling thread, so a blackholed server costs only its own
//!   callers. On a pipelined connection an operation queued behind another caller's large batch
//!   waits for the rounds ahead of it, each within `io_timeout` of the one before.
//! - **Restarted.** The first pooled connection found closed before any answer drops the idle
//!   ones and counts no fault, so the next call connects afresh; a connection idle for 5 minutes
//!   is closed rather than reused. The call that found it fails. A connection lost after a
//!   write was sent cannot be told from a lost reply: that write fails with an
//!   [`is_outcome_unknown`](crate::Error::is_outcome_unknown) error and is never sent twice.
//!   The restarted server is empty: the next reads miss and reload, one loader per key.
//! - **Deletes it missed.** While a server is out of reach, this process records (up to
//!   [`replay_capacity`](crate::CacheBuilder::replay_capacity), 10,000 keys per server) the keys
//!   it deleted, wrote elsewhere (`Remap`) or failed to write there (the error says `queued for
//!   replay`). When the server answers again those keys are deleted there before this process
//!   reads anything from it. Only deletes are replayed. If the record overflows, the values the
//!   server held from before are judged stale and reloaded rather than served as fresh. Counted
//!   in `replayed_deletes`, `replay_overflows` and `replays_failed`. Not covered: another
//!   process that never saw the outage reads the server's old values until one that did makes
//!   its first call there; counters are not recorded; a plain `set` whose bytes reach the
//!   server only after the replay lands after it.
//! - **Without CAS** (memcached started with `-C`: every `gets` reports cas 0). `set`, `get`
//!   (a stale value is served unclaimed), `delete` and counters work; what needs CAS
//!   (`get_or_set_with`, `touch`, `add` over a stale value) fails with an
//!   [`is_unsupported`](crate::Error::is_unsupported) error naming the server and `-C`, and
//!   blocks no one. A batch loader loads that server's keys without storing them.
//!
//! # Behind twemproxy or mcrouter
//!
//! newcache uses only commands they forward (`gets`, `cas`, `add`, `incr`, ...), and matches a
//! multi-get's replies by key, so a proxy may reorder them. [`Cache::clear`](crate::Cache::clear)
//! returns an `is_unsupported()` error (the proxy refuses `flush_all`). An outage behind the
//! proxy is the proxy's: the client sees its errors, not a dead server, and a replayed delete the
//! proxy refuses is passed over. A ping checks the proxy and the server its key maps to.

#[cfg(feature = "tokio")]
pub(crate) mod blended;
mod config;
mod conn;
#[cfg(feature = "tokio")]
pub(crate) mod engine;
mod ring;
pub(crate) mod routing;
mod server;
pub(crate) mod wire;

pub use self::config::{DeadServerPolicy, MemcachedConfig, ServerSpec};
// Every server's (Redis's too), where memcached's users have always found them.
pub use crate::backend::server::{
    DEFAULT_CONNECT_TIMEOUT, DEFAULT_FAILURE_LIMIT, DEFAULT_IO_TIMEOUT, DEFAULT_POOL_SIZE,
    DEFAULT_REPLAY_CAPACITY, DEFAULT_RETRY_INTERVAL, MAX_RETRY_INTERVAL, MAX_TIMEOUT,
};
// The grace window of servers read late in a batch (the Redis Cluster's batches share it).
#[cfg(feature = "redis")]
pub(crate) use self::conn::GRACE;
#[cfg(feature = "redis")]
pub(crate) use self::server::IDLE_TIMEOUT;

use std::cell::OnceCell;
use std::fmt;
use std::time::Instant;

use self::conn::{Conn, GETS_PER_WRITE, KEYS_PER_LINE, PIPELINE_CHUNK, Reader};
use self::routing::Routing;
use self::server::{CheckoutError, Pooled, Server};
use super::server::Options;
use super::server::health::{self, now_ms};
use super::server::outage;
use super::server::replay::{self, WaitBound};
use super::{Backend, Item, StoreMode, StoreOutcome, Write, max_value_size};
use crate::error::{Error, Result};
use crate::ping::{PING_KEY, PingError, PingFailure};

/// memcached over its text protocol (which proxies such as twemproxy and mcrouter also speak).
///
/// `build()` never connects: connections are made on first use, in the calling thread, and an
/// operation waits at most `connect_timeout` for one and at most `io_timeout` for its replies
/// (one deadline for the whole operation, however slowly the server sends), so an unreachable or
/// hung server costs a bounded wait and an error, never a hang, and never delays the callers of
/// other servers. A restarted server is used again as soon as a probe finds it answering.
pub struct MemcachedBackend {
    servers: Vec<Server>,
    routing: Routing,
    options: Options,
}

impl fmt::Debug for MemcachedBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemcachedBackend")
            .field("servers", &self.servers)
            .field("item_size", &self.options.item_size)
            .finish_non_exhaustive()
    }
}

/// Why [`MemcachedBackend::open`] gave no connection.
struct Refused {
    /// The caller had passed the health gate as the probe of a dead server.
    probe: bool,
    /// Connecting failed (a transport fault); otherwise the server was skipped as dead or the
    /// pool stayed busy, which say nothing new about it.
    connect_fault: bool,
    error: Error,
}

/// One server's part of a batch: its positions in the caller's list, its connection, and the
/// error that ended it (its remaining positions get that error).
struct Leg<'a> {
    server: usize,
    positions: Vec<usize>,
    probe: bool,
    conn: Option<Pooled<'a>>,
    connect_fault: bool,
    error: Option<Error>,
    /// Some of its request may have reached the server (a send was attempted).
    sent_any: bool,
}

/// Whether an error (or one in its source chain) says the peer closed or reset the connection:
/// what a connection opened before a server restarted gets on first use.
/// Whether a connection's failure is that of a stale connection: reused from the pool, closed
/// or reset by the peer before any answer. Only the signature of a restart makes a reused
/// connection suspect; a timeout is the server's.
fn stale(c: &Conn, error: Option<&Error>) -> bool {
    c.fault && c.reused && !c.answered && error.is_some_and(closed_by_peer)
}

fn closed_by_peer(e: &Error) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if let Some(e) = c.downcast_ref::<Error>() {
            if wire::is_closed(e) {
                return true;
            }
        }
        if let Some(io) = c.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind as K;
            if matches!(
                io.kind(),
                K::ConnectionReset | K::ConnectionAborted | K::BrokenPipe | K::UnexpectedEof
            ) {
                return true;
            }
        }
        cause = c.source();
    }
    false
}

/// How long a caller of the pool waits for another caller's replay of what a server missed:
/// two `io_timeout`s. That replay runs on a connection its caller holds already (no connect to
/// wait for), its deletes within an `io_timeout` per exchange of [`PIPELINE_CHUNK`] keys.
const REPLAY_WAIT: WaitBound = WaitBound {
    connects: 0,
    ios: 2,
};

impl MemcachedBackend {
    /// Sets up the pools (without connecting).
    ///
    /// # Errors
    ///
    /// A configuration error (`is_config()`) for an empty server list, a zero `pool_size`, a zero
    /// `connect_timeout` (no connection could ever be made) or a zero `io_timeout` (no reply could
    /// ever be read).
    pub fn new(config: MemcachedConfig) -> Result<MemcachedBackend> {
        config.check()?;
        let options = config.options();
        let servers = config
            .servers
            .iter()
            .map(|spec| Server::new(spec.addr(), &options))
            .collect();
        Ok(MemcachedBackend {
            servers,
            routing: Routing::new(&config.servers, config.dead_servers),
            options,
        })
    }

    /// Whether server `i` may be routed to; the clock is read once, and only if a server is
    /// marked dead.
    fn routable(&self) -> impl Fn(usize) -> bool + '_ {
        let now = OnceCell::new();
        move |i| self.servers[i].health.routable(|| *now.get_or_init(now_ms))
    }

    fn server_index(&self, key: &str) -> usize {
        self.routing.route(key, self.routable())
    }

    /// Passes server `i`'s health gate and checks out a connection: `Ok((probe, conn))`, where
    /// `probe` says this caller is probing a dead server.
    fn open(&self, i: usize) -> std::result::Result<(bool, Pooled<'_>), Refused> {
        let server = &self.servers[i];
        let probe = server.health.gate().map_err(|error| Refused {
            probe: false,
            connect_fault: false,
            error,
        })?;
        match server.checkout() {
            Ok(conn) => Ok((probe, conn)),
            // A local wait: says nothing about the server.
            Err(CheckoutError::PoolBusy(error)) => Err(Refused {
                probe,
                connect_fault: false,
                error,
            }),
            Err(CheckoutError::Connect(error)) => Err(Refused {
                probe,
                connect_fault: true,
                error,
            }),
        }
    }

    /// Records what an operation on server `i` learned: a transport fault counts toward marking
    /// it dead; an answer resets the count (and, from a probe, brings it back); anything else
    /// (bad input refused before sending, a busy pool) says nothing.
    fn record(&self, i: usize, probe: bool, fault: Option<&Error>, answered: bool) {
        let server = &self.servers[i];
        if let Some(e) = fault {
            if server.health.fault(e, probe) {
                server.reset();
            }
        } else if answered {
            server.health.answered(probe);
        }
    }

    /// Whether a connection's fault counts against server `i`. Not when its exchange reached the
    /// socket only after the batch's deadline (other servers of the batch used the time), and
    /// not when a connection reused from the pool failed before any answer: it may just be
    /// stale (the server restarted since it was opened). The server's other pooled connections
    /// are dropped then, so the next call connects afresh, and a fault there counts.
    fn counts(&self, i: usize, c: &Conn, error: Option<&Error>) -> bool {
        if !c.fault || c.started_late() {
            return false;
        }
        if stale(c, error) {
            self.servers[i].drop_idle();
            return false;
        }
        true
    }

    /// Runs `op` on server `i`, through its health gate, recording the outcome.
    fn run<T>(&self, i: usize, op: impl FnOnce(&mut Conn) -> Result<T>) -> Result<T> {
        let server = &self.servers[i];
        let (probe, mut conn) = match self.open(i) {
            Ok(x) => x,
            Err(r) => {
                self.record(i, r.probe, r.connect_fault.then_some(&r.error), false);
                return Err(r.error);
            }
        };
        conn.answered = false;
        let r = self.replay(i, &mut conn).and_then(|()| op(&mut conn));
        let (fault, answered) = (self.counts(i, &conn, r.as_ref().err()), conn.answered);
        drop(conn);
        match &r {
            Err(e) if fault => self.record(i, probe, Some(e), false),
            _ => self.record(i, probe, None, answered),
        }
        r.map_err(|e| server.annotate(e))
    }

    /// Runs `op` on the server that holds `key`.
    fn on_key<T>(&self, key: &str, op: impl FnOnce(&mut Conn) -> Result<T>) -> Result<T> {
        let i = self.server_index(key);
        super::note_server(&self.servers[i].addr);
        self.run(i, op)
    }

    /// [`on_key`](Self::on_key) for a write (a store, a delete, a touch): one that may not reach
    /// the key's home server, or that lands on another, is recorded for replay there.
    fn on_write<T>(&self, key: &str, op: impl FnOnce(&mut Conn) -> Result<T>) -> Result<T> {
        let (home, i) = self.routing.home_and_route(key, self.routable());
        super::note_server(&self.servers[i].addr);
        if i != home {
            self.missed(home)
                .note(key, Some(i), self.options.replay_capacity);
        }
        let r = self.run(i, op);
        let elsewhere = (i != home).then_some(i);
        outage::after_write(
            self.missed(home),
            elsewhere,
            key,
            r,
            self.options.replay_capacity,
        )
    }

    fn missed(&self, server: usize) -> &outage::Missed {
        &self.servers[server].health.missed
    }

    /// Deletes on server `i`, over `conn`, the keys it missed while out of reach (before
    /// anything else is done there), then hands the copies written elsewhere meanwhile on to
    /// their servers' records; through the replay gate, so that while another caller replays
    /// them this one waits ([`REPLAY_WAIT`]). A replay that fails keeps its keys for the next
    /// attempt.
    fn replay(&self, i: usize, conn: &mut Conn) -> Result<()> {
        let server = &self.servers[i];
        let capacity = self.options.replay_capacity;
        replay::enter(&server.health, REPLAY_WAIT.of(&self.options), |replay| {
            let keys: Vec<&str> = replay.keys().collect();
            match conn.delete_all(&keys) {
                Ok(refused) => {
                    let other = |j| (j != i).then(|| self.missed(j));
                    replay.done(&server.addr, refused, other, capacity);
                    Ok(())
                }
                Err(e) => {
                    replay.failed(&server.addr, &e, capacity);
                    Err(e)
                }
            }
        })
        .map_err(|e| e.at_server(&server.addr))?
        .unwrap_or(Ok(()))
    }

    /// Judges an item read for `key` by its home server's record ([`outage::distrust`]).
    fn distrust(&self, key: &str, item: Option<&mut Item>) {
        let records = self.servers.iter().map(|s| &s.health.missed);
        outage::distrust_read(item, records, || self.missed(self.routing.home(key)));
    }

    /// A batch over `n` entries: entries that fail `check` are answered with that error and never
    /// sent; the others are grouped by the server of `key(i)`. One connection per server is
    /// checked out, then each server's request is written (in chunks of `chunk` entries), then
    /// each server's replies read, under one `io_timeout` deadline per round of chunks (a batch of
    /// up to `chunk` entries per server is one round). `decode` fills `out` for the positions it
    /// is given; an error it returns ends that server's part: its remaining entries get the error,
    /// the other servers' entries are unaffected.
    #[allow(clippy::too_many_arguments)]
    fn batch<'k, T>(
        &self,
        writes: bool,
        n: usize,
        check: impl Fn(usize) -> Result<()>,
        key: impl Fn(usize) -> &'k str,
        chunk: usize,
        encode: impl Fn(&[usize], &mut Vec<u8>) -> Result<()>,
        decode: impl Fn(&mut Reader, &[usize], &mut [Option<Result<T>>]) -> Result<()>,
    ) -> Vec<Result<T>> {
        let out: Vec<Option<Result<T>>> = (0..n).map(|i| check(i).err().map(Err)).collect();
        let mut sendable: Vec<usize> = Vec::with_capacity(n);
        sendable.extend((0..n).filter(|&i| out[i].is_none()));
        let all_up = || (0..self.servers.len()).all(self.routable());
        let up_before = all_up();
        let mut groups = self
            .routing
            .by_server(sendable.iter().map(|&i| key(i)), self.routable());
        // Positions among the sendable entries, made positions in the caller's list in place.
        for p in groups.iter_mut().flat_map(|(_, ps)| ps.iter_mut()) {
            *p = sendable[*p];
        }
        if !writes {
            return self.run_legs(writes, out, groups, chunk, encode, decode, None);
        }
        let capacity = self.options.replay_capacity;
        let remapped = !(up_before && all_up());
        let sent = outage::SentWrites::note(
            &groups,
            remapped,
            &key,
            |k| self.routing.home(k),
            |i| self.missed(i),
            capacity,
        );
        let mut results = self.run_legs(writes, out, groups, chunk, encode, decode, None);
        sent.settle(
            &mut results,
            |r| Some(r),
            &key,
            |i| self.missed(i),
            capacity,
        );
        results
    }

    /// The I/O of a [`batch`](Self::batch) whose entries are grouped by server already:
    /// `groups` holds `(server, positions)`; `out` the entries answered without sending.
    /// `stale`, if given, receives the servers whose leg failed only because its pooled
    /// connection was stale (their idle connections are dropped: a retry connects afresh).
    #[allow(clippy::too_many_arguments)]
    fn run_legs<T>(
        &self,
        writes: bool,
        mut out: Vec<Option<Result<T>>>,
        mut groups: Vec<(usize, Vec<usize>)>,
        chunk: usize,
        encode: impl Fn(&[usize], &mut Vec<u8>) -> Result<()>,
        decode: impl Fn(&mut Reader, &[usize], &mut [Option<Result<T>>]) -> Result<()>,
        mut stale: Option<&mut Vec<usize>>,
    ) -> Vec<Result<T>> {
        // Connections are checked out in server order: two batches waiting on each other's full
        // pools cannot form a cycle.
        groups.sort_unstable_by_key(|(server, _)| *server);
        let mut legs: Vec<Leg<'_>> = groups
            .into_iter()
            .map(|(server, positions)| Leg {
                server,
                positions,
                probe: false,
                conn: None,
                connect_fault: false,
                error: None,
                sent_any: false,
            })
            .collect();
        for leg in &mut legs {
            match self.open(leg.server) {
                Ok((probe, mut conn)) => {
                    conn.answered = false;
                    leg.probe = probe;
                    if let Err(e) = self.replay(leg.server, &mut conn) {
                        leg.error = Some(e);
                    }
                    leg.conn = Some(conn);
                }
                Err(r) => {
                    leg.probe = r.probe;
                    leg.connect_fault = r.connect_fault;
                    leg.error = Some(r.error);
                }
            }
        }
        let rounds = legs
            .iter()
            .map(|l| l.positions.len().div_ceil(chunk))
            .max()
            .unwrap_or(0);
        for round in 0..rounds {
            let deadline = Instant::now() + self.options.io_timeout;
            // The one grace window of this round: it opens when the first server's turn comes
            // after the deadline (a hung server before it used the time), and every later late
            // server shares it, however many there are.
            let mut grace: Option<Instant> = None;
            let mut late = |conn: &mut Conn| {
                let now = Instant::now();
                if now >= deadline {
                    conn.set_grace_until(*grace.get_or_insert(now + conn::GRACE));
                }
            };
            let mut sent = vec![false; legs.len()];
            for (leg, sent) in legs.iter_mut().zip(&mut sent) {
                let Some(part) = leg.positions.chunks(chunk).nth(round) else {
                    continue;
                };
                if let (Some(conn), None) = (&mut leg.conn, &leg.error) {
                    conn.set_deadline(deadline);
                    late(conn);
                    leg.sent_any = true;
                    match conn.send(|b| encode(part, b)) {
                        Ok(()) => *sent = true,
                        Err(e) => leg.error = Some(e),
                    }
                }
            }
            for (leg, _) in legs.iter_mut().zip(&sent).filter(|(_, s)| **s) {
                let part = leg.positions.chunks(chunk).nth(round).unwrap_or(&[]);
                let conn = leg.conn.as_mut().expect("a leg that sent has a connection");
                late(conn);
                if let Err(e) = conn.recv(|r| decode(r, part, &mut out)) {
                    // The decoder stopped early: whatever the error, replies to the rest of
                    // this server's part may be unread. Never reuse the connection.
                    conn.broken = true;
                    leg.error = Some(e);
                }
            }
        }
        for leg in legs {
            let (fault, answered) = match &leg.conn {
                Some(c) => {
                    if let Some(stale) = stale.as_deref_mut() {
                        if !c.started_late() && self::stale(c, leg.error.as_ref()) {
                            stale.push(leg.server);
                        }
                    }
                    (self.counts(leg.server, c, leg.error.as_ref()), c.answered)
                }
                None => (leg.connect_fault, false),
            };
            drop(leg.conn);
            self.record(
                leg.server,
                leg.probe,
                leg.error.as_ref().filter(|_| fault),
                answered,
            );
            if let Some(e) = leg.error {
                let mut e = self.servers[leg.server].annotate(e);
                // A write batch whose server failed after its first byte went out: any of its
                // writes may have been applied.
                if writes && leg.sent_any {
                    e = conn::unknown_if_sent(e);
                }
                for &p in &leg.positions {
                    out[p].get_or_insert_with(|| Err(e.clone()));
                }
            }
        }
        out.into_iter()
            .map(|o| o.unwrap_or_else(|| Err(Error::backend("no reply for this entry"))))
            .collect()
    }

    /// Which configured server (index into the server list) holds a derived key when every
    /// server is up: libmemcached's weighted ketama placement. For diagnostics and for checking
    /// that other clients (pylibmc, PHP's memcached) agree.
    pub fn server_of(&self, derived_key: &str) -> usize {
        self.routing.home(derived_key)
    }

    /// Every server's health record, in configuration order: an engine built with them
    /// (`Engine::sharing`) keeps one record with this pool.
    pub(crate) fn health(&self) -> Vec<std::sync::Arc<health::Health>> {
        self.servers.iter().map(|s| s.health.clone()).collect()
    }

    /// Asks every server at once (each one's `get` of [`PING_KEY`](crate::PING_KEY) written,
    /// then every reply read, under one `io_timeout`), through the health gate: a server marked
    /// dead and not due for a probe fails at once; one due for a probe is probed. A server whose
    /// pooled connection turned out stale (closed by a restart before it answered) is asked
    /// once more, on a fresh connection, in a second round of those servers only.
    fn ping_all(&self) -> std::result::Result<(), PingError> {
        let n = self.servers.len();
        let max = self.options.item_size;
        let ask = |servers: &[usize], stale: Option<&mut Vec<usize>>| {
            self.run_legs(
                false,
                (0..n).map(|_| None).collect(),
                servers.iter().map(|&i| (i, vec![i])).collect(),
                1,
                |_, b| wire::encode_gets(b, &[PING_KEY]),
                |r, part, out| {
                    let mut slots: Vec<wire::Slot> = vec![Ok(None)];
                    wire::read_slots(r, max, &[PING_KEY], &mut slots)?;
                    for (&i, s) in part.iter().zip(slots) {
                        out[i] = Some(s.map(drop));
                    }
                    Ok(())
                },
                stale,
            )
        };
        let all: Vec<usize> = (0..n).collect();
        let mut stale = Vec::new();
        let mut results = ask(&all, Some(&mut stale));
        if !stale.is_empty() {
            let mut again = ask(&stale, None);
            for &i in &stale {
                results[i] = std::mem::replace(&mut again[i], Ok(()));
            }
        }
        let failures = results
            .into_iter()
            .zip(&self.servers)
            .filter_map(|(r, s)| r.err().map(|e| PingFailure::new(s.addr.clone(), e)))
            .collect();
        PingError::check(failures, n)
    }

    /// The server's version string (a cheap liveness probe).
    pub fn version(&self, server: usize) -> Result<String> {
        if server >= self.servers.len() {
            return Err(Error::config(format!("no server #{server}")));
        }
        self.run(server, |c| c.version())
    }
}

impl Backend for MemcachedBackend {
    fn report(&self, stats: &mut crate::Stats) {
        outage::report(self.servers.iter().map(|s| &s.health.missed), stats);
    }

    /// Every server asked in one round, one `io_timeout` for all; behind twemproxy, the proxy and the
    /// server [`PING_KEY`] maps to.
    fn ping(&self) -> std::result::Result<(), PingError> {
        self.ping_all()
    }

    fn get(&self, key: &str) -> Result<Option<Item>> {
        wire::check_key(key)?;
        let max = self.options.item_size;
        let mut item = self.on_key(key, |c| c.get(key, max))?;
        self.distrust(key, item.as_mut());
        Ok(item)
    }

    fn get_many(&self, keys: &[&str]) -> Vec<Result<Option<Item>>> {
        let max = self.options.item_size;
        let mut items = self.batch(
            false,
            keys.len(),
            |i| wire::check_key(keys[i]),
            |i| keys[i],
            GETS_PER_WRITE,
            |part, b| {
                // Several `gets` lines pipelined in one write: one round trip, bounded lines.
                // Every key passed `check` above: it is not checked again.
                for line in part.chunks(KEYS_PER_LINE) {
                    wire::write_gets(b, line.iter().map(|&i| keys[i]));
                }
                Ok(())
            },
            |r, part, out| {
                for line in part.chunks(KEYS_PER_LINE) {
                    let ks: Vec<&str> = line.iter().map(|&i| keys[i]).collect();
                    let mut slots: Vec<wire::Slot> = line.iter().map(|_| Ok(None)).collect();
                    wire::read_slots(r, max, &ks, &mut slots)?;
                    for (&i, s) in line.iter().zip(slots) {
                        out[i] = Some(s);
                    }
                }
                Ok(())
            },
        );
        for (key, item) in keys.iter().zip(&mut items) {
            if let Ok(item) = item {
                self.distrust(key, item.as_mut());
            }
        }
        items
    }

    fn store(&self, w: Write<'_>) -> Result<StoreOutcome> {
        self.check_write(&w)?;
        let max = self.max_value_size(w.key);
        self.on_write(w.key, |c| c.store(&w, max))
    }

    fn store_then_get(&self, w: Write<'_>) -> Result<(StoreOutcome, Option<Item>)> {
        self.check_write(&w)?;
        let (max, item_size) = (self.max_value_size(w.key), self.options.item_size);
        let (outcome, mut item) = self.on_write(w.key, |c| c.store_then_get(&w, max, item_size))?;
        self.distrust(w.key, item.as_mut());
        Ok((outcome, item))
    }

    /// Pipelined writes, one result each: an invalid write (key, exptime, size) fails alone and
    /// nothing of it is sent; an error reply that leaves the connection in step (`SERVER_ERROR
    /// object too large`, ...) fails only its own write; a transport error fails the rest of its
    /// server's writes.
    fn store_many(&self, writes: &[Write<'_>]) -> Vec<Result<StoreOutcome>> {
        self.batch(
            true,
            writes.len(),
            |i| self.check_write(&writes[i]),
            |i| writes[i].key,
            PIPELINE_CHUNK,
            |part, b| {
                part.iter().try_for_each(|&i| {
                    wire::encode_store(b, &writes[i], self.max_value_size(writes[i].key))
                })
            },
            |r, part, out| {
                for &i in part {
                    match wire::read_store(r) {
                        Err(e) if !wire::leaves_connection_usable(&e) => return Err(e),
                        other => out[i] = Some(other),
                    }
                }
                Ok(())
            },
        )
    }

    fn delete(&self, key: &str) -> Result<bool> {
        wire::check_key(key)?;
        self.on_write(key, |c| c.delete(key))
    }

    fn delete_many(&self, keys: &[&str]) -> Vec<Result<bool>> {
        self.batch(
            true,
            keys.len(),
            |i| wire::check_key(keys[i]),
            |i| keys[i],
            PIPELINE_CHUNK,
            |part, b| {
                part.iter()
                    .try_for_each(|&i| wire::encode_delete(b, keys[i]))
            },
            |r, part, out| {
                for &i in part {
                    out[i] = Some(Ok(wire::read_delete(r)?));
                }
                Ok(())
            },
        )
    }

    fn touch(&self, key: &str, exptime: u32) -> Result<bool> {
        wire::check_key(key)?;
        wire::check_exptime(exptime)?;
        self.on_write(key, |c| c.touch(key, exptime))
    }

    fn incr(&self, key: &str, delta: u64) -> Result<Option<u64>> {
        wire::check_key(key)?;
        self.on_key(key, |c| c.arith(true, key, delta))
    }

    fn decr(&self, key: &str, delta: u64) -> Result<Option<u64>> {
        wire::check_key(key)?;
        self.on_key(key, |c| c.arith(false, key, delta))
    }

    fn flush_all(&self) -> Result<()> {
        (0..self.servers.len()).try_for_each(|i| self.run(i, |c| c.flush_all()))
    }

    fn max_value_size(&self, key: &str) -> usize {
        max_value_size(self.options.item_size, key)
    }
}

impl MemcachedBackend {
    /// What `encode_store` would refuse, checked before a server is chosen: the key, the
    /// exptime, and the value's size (`TooLarge`, nothing sent).
    fn check_write(&self, w: &Write<'_>) -> Result<()> {
        wire::check_key(w.key)?;
        if w.mode == StoreMode::Cas(0) {
            let server = &self.servers[self.server_index(w.key)].addr;
            return Err(super::no_cas(Some(server)));
        }
        wire::check_exptime(w.exptime)?;
        wire::check_value(w.value.len(), self.max_value_size(w.key))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A zero `connect_timeout` used to panic inside r2d2 and a zero `io_timeout` made every
    /// connect fail: both are configuration errors now.
    #[test]
    fn zero_timeouts_are_config_errors() {
        let base = || MemcachedConfig::new(vec![ServerSpec::parse("127.0.0.1:9").unwrap()]);
        let mut c = base();
        c.connect_timeout = Duration::ZERO;
        let e = MemcachedBackend::new(c).unwrap_err();
        assert!(
            e.is_config() && e.to_string().contains("connect_timeout"),
            "{e}"
        );
        let mut c = base();
        c.io_timeout = Duration::ZERO;
        let e = MemcachedBackend::new(c).unwrap_err();
        assert!(e.is_config() && e.to_string().contains("io_timeout"), "{e}");
        let mut c = base();
        c.io_timeout = Duration::from_nanos(1);
        c.connect_timeout = Duration::from_nanos(1);
        assert!(
            MemcachedBackend::new(c).is_ok(),
            "tiny but not zero is allowed"
        );
    }
    #[test]
    fn build_never_connects() {
        // Port 9 on loopback: nothing listens. Building must not block or fail.
        let cfg = MemcachedConfig::new(vec![ServerSpec::parse("127.0.0.1:9").unwrap()]);
        let b = MemcachedBackend::new(cfg).unwrap();
        let t = std::time::Instant::now();
        let e = b.get("k").unwrap_err();
        assert!(e.is_backend(), "{e}");
        assert!(t.elapsed() < DEFAULT_CONNECT_TIMEOUT + Duration::from_millis(400));
    }
}
