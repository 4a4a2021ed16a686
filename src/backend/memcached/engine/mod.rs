//! The pipelined, auto-batching memcached engine (tokio): the async twin of `MemcachedBackend`.
//!
//! Per server, a few long-lived connections (round-robin while busy; an idle one is kept), each
//! a writer task and a reader task (`conn.rs` says how the writer merges gets and writes in
//! rounds, and when a caller writes its own op). Callers encode and validate their command,
//! queue it on a connection and await a oneshot. There is no batching timer: while a few
//! replies are outstanding the writer lets the ready callers run one scheduler turn first, and
//! under load a round waits for the last reply (Nagle's rule), so that a write carries every op
//! asked for during a round trip. Placement (`routing.rs`) and the protocol (`wire.rs`) are the
//! blocking backend's, health and the replay record every server's (`backend/server/`).
//!
//! # Faults
//!
//! A connection dies on a transport fault (an I/O error, a reply the parsers reject, no whole
//! reply to its oldest request within `io_timeout` of its round's write): every caller in
//! flight or queued on it fails at once (a written command with [`Error::is_outcome_unknown`]), and the server's
//! health records one fault. The next op reconnects through the health gate: while a server is
//! dead its ops fail fast and one probe per `retry_interval` connects.
//!
//! # Runtimes
//!
//! A connection's tasks run on the tokio runtime current when it was opened (an `AsyncCache`
//! needs one, built with `enable_all`). If that runtime shuts down (each `#[tokio::test]` has
//! its own), its tasks are dropped: the connection's queue closes, and the next op treats it as
//! a dead connection (not a server fault) and reconnects on the caller's runtime; a get that
//! was queued on it is queued again (up to 3 times), a command fails as outcome unknown. Nothing waits on a
//! runtime that is gone. A runtime that is alive but never driven (a current-thread runtime
//! outside `block_on`) would hold its connections' callers; do not share an engine with one.

mod conn;
#[cfg(test)]
pub(crate) mod tests;

use std::cell::OnceCell;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::Poll;
use std::time::Duration;

use parking_lot::Mutex;
use smallvec::smallvec;
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use self::conn::{Conn, KEYS_PER_LINE, Op, Parse, QUEUE, Reply, Slots};
use super::MemcachedConfig;
use super::routing::Routing;
use super::wire::{self, Slot};
use crate::backend::server::Options;
use crate::backend::server::health::{Health, now_ms};
use crate::backend::server::outage::{self, Replay};
use crate::backend::server::replay::{self, MissedOf, WaitBound};
use crate::backend::{AsyncBackend, BoxFuture, Item, StoreOutcome, Write, max_value_size};
use crate::error::{Error, Result};
use crate::ping::{PING_KEY, PingError, PingFailure};

/// How long a caller waits for another caller's replay of what a server missed: a connect and
/// two `io_timeout`s. That replay runs on a new connection's task, which connects first, then
/// deletes within an `io_timeout` per round.
const REPLAY_WAIT: WaitBound = WaitBound {
    connects: 1,
    ios: 2,
};

/// A pipelined memcached client on tokio: what `AsyncCache` runs on.
///
/// `new` never connects; connections open on first use, on the caller's runtime. Every method
/// is cancellation-safe: a dropped future never desynchronises a connection or loses another
/// caller's reply (the reader task parses, not the caller, and a caller writing directly does
/// so without awaiting); a write already queued or written may still be applied.
pub(crate) struct Engine {
    /// In configuration order (the routing's server indices).
    servers: Vec<Arc<Server>>,
    /// Which server holds a key (ketama; dead servers' keys remapped under `Remap`).
    routing: Routing,
    options: Options,
}

impl fmt::Debug for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let addrs: Vec<&str> = self.servers.iter().map(|s| s.addr.as_str()).collect();
        f.debug_struct("Engine")
            .field("servers", &addrs)
            .field("item_size", &self.options.item_size)
            .finish_non_exhaustive()
    }
}

/// One server: address, health, and its connections (a queue sender each, or none yet).
struct Server {
    /// `host:port`, resolved on every connect.
    addr: String,
    health: Arc<Health>,
    /// Every server's health record, in configuration order (a replay hands the copies written
    /// elsewhere on to their servers' records).
    peers: Arc<[Arc<Health>]>,
    options: Options,
    /// `connections_per_server` connections. A short lock: taken to queue an op (`try_send`)
    /// or replace the connection, never across an await.
    slots: Box<[Mutex<Option<Live>>]>,
    /// Round-robin cursor over `slots`.
    next: AtomicUsize,
    /// The slot `pick` chose last.
    last: AtomicUsize,
    #[cfg(test)]
    counters: tests::Counters,
}

/// An open (or opening) connection: its queue, its direct path, and its task (for `shutdown`).
/// What a caller does when its connection's queue is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WhenFull {
    /// Waits for room: the queue's backpressure.
    Wait,
    /// Sends on a connection of its own, opened for this op and closed once it is answered:
    /// a ping, whose answer must say whether the server answers within `io_timeout`, not
    /// wait first for a hung connection's queue to be cut (another `io_timeout`).
    OwnConnection,
}

struct Live {
    ops: mpsc::Sender<Op>,
    conn: Arc<Conn>,
    task: JoinHandle<()>,
}

impl Server {
    /// Names the server in a backend error (others are the caller's, and say so already).
    fn annotate(&self, e: Error) -> Error {
        // Once: an error that names its server already says where it happened.
        if e.is_backend() && e.server().is_none() {
            e.in_context(format!("memcached at {}", self.addr))
                .at_server(&self.addr)
        } else {
            e
        }
    }

    /// Records one transport fault (one per dead connection or failed connect, never per
    /// waiter). If it marked the server dead, its connections are closed: their queued and
    /// in-flight ops still get answers, then they end; the next ops fail fast until a probe.
    fn fault(&self, probe: bool, e: &Error) {
        if self.health.fault(e, probe) {
            for slot in self.slots.iter() {
                drop(slot.lock().take());
            }
        }
    }

    /// The connection the next op (or batch) of this server goes to: the last one chosen while
    /// it is idle (nothing queued or in flight), else the next in turn. Busy connections share
    /// the load round-robin; a lone caller keeps one connection, and so one memcached thread,
    /// warm (alternating between two idle ones makes each round trip slower).
    fn pick(&self) -> usize {
        let last = self.last.load(Ordering::Relaxed);
        let idle = self.slots[last]
            .try_lock()
            .is_some_and(|l| l.as_ref().is_some_and(|l| l.conn.idle()));
        if idle {
            return last;
        }
        let next = self.next.fetch_add(1, Ordering::Relaxed) % self.slots.len();
        self.last.store(next, Ordering::Relaxed);
        next
    }

    /// Submits `op` on connection `slot` through the health gate: fails fast while the server
    /// is dead; opens the connection if it has none or its queue closed (dead, or its runtime
    /// shut down), or if this caller is the probe. On an idle connection the op is written
    /// here and now (`Conn::submit`); otherwise it is queued. Ops queued while it connects
    /// wait for that one attempt. When the queue is full, does as `full` says.
    async fn send(self: &Arc<Self>, slot: usize, mut op: Op, full: WhenFull) -> Result<()> {
        // A closed queue is retried on a fresh connection (the op was never queued); a queue
        // that closes again and again means connections die as soon as they open.
        for _ in 0..3 {
            let probe = self.health.gate()?;
            // Keys this server missed are deleted there first, by a fresh connection, before it
            // writes anything (this op included); while another caller's replay runs, wait.
            let replay = self.replay_first().await?;
            let (ops, conn) = {
                let mut live = self.slots[slot].lock();
                let l = match &*live {
                    Some(l) if !probe && !l.ops.is_closed() && replay.is_none() => l,
                    _ => live.insert(self.open(probe, replay)?),
                };
                match l.conn.submit(&l.ops, op, self) {
                    Ok(()) => return Ok(()),
                    Err(TrySendError::Full(o)) if full == WhenFull::OwnConnection => {
                        // Dropping `own` closes its queue: its task answers `o`, then ends.
                        let own = self.open(probe, None)?;
                        return own.conn.submit(&own.ops, o, self).map_err(|_| {
                            self.annotate(Error::backend("a new connection refused a request"))
                        });
                    }
                    Err(TrySendError::Full(o)) => {
                        op = o;
                        (l.ops.clone(), l.conn.clone())
                    }
                    Err(TrySendError::Closed(o)) => {
                        op = o;
                        *live = None;
                        continue;
                    }
                }
            };
            // `reserve` is cancel-safe, and keeps `op` if the queue closed meanwhile.
            if let Ok(permit) = ops.reserve().await {
                conn.queue(permit, op);
                return Ok(());
            }
        }
        Err(self.annotate(Error::backend(
            "its connections kept closing before taking the request",
        )))
    }

    /// The replay this caller must run first, if the server's record holds keys: `None` when
    /// it holds none (or another caller's replay of them ended while this one waited).
    async fn replay_first(self: &Arc<Self>) -> Result<Option<Replay<MissedOf>>> {
        let wait = REPLAY_WAIT.of(&self.options);
        // The replay runs later, on the new connection's task (`conn::run`).
        replay::enter_async(&self.health, wait, std::future::ready)
            .await
            .map_err(|e| self.annotate(e))
    }

    /// Starts a connection's task on the current runtime; it connects, runs `replay` (deletes
    /// what the server missed), then serves the queue. A replay that never runs (no runtime,
    /// the task dropped) gives its keys back.
    fn open(self: &Arc<Self>, probe: bool, replay: Option<Replay<MissedOf>>) -> Result<Live> {
        let rt = tokio::runtime::Handle::try_current().map_err(|_| {
            Error::config(
                "an AsyncCache needs a tokio runtime with I/O and timers enabled \
                 (Builder::enable_all); none is running on this thread",
            )
        })?;
        let (ops, queue) = mpsc::channel(QUEUE);
        let conn = Arc::new(Conn::new());
        let task = rt.spawn(conn::run(self.clone(), queue, probe, conn.clone(), replay));
        Ok(Live { ops, conn, task })
    }

    /// A caller queued several ops on connection `slot` together (a batch): a round its
    /// writer holds goes now ([`Conn::flush`]), so that the batch is written whole.
    fn flush(&self, slot: usize) {
        if let Some(l) = &*self.slots[slot].lock() {
            l.conn.flush();
        }
    }

    /// Reads `keys` (at most [`KEYS_PER_LINE`], validated) on connection `slot`.
    async fn get_on(self: &Arc<Self>, slot: usize, keys: &[&str]) -> Slots {
        match self.queue_get(slot, keys).await {
            Ok(reply) => self.get_reply(reply, keys).await,
            Err(e) => smallvec![Err(e); keys.len()],
        }
    }

    /// Queues a get; the answer comes on the returned receiver.
    async fn queue_get(
        self: &Arc<Self>,
        slot: usize,
        keys: &[&str],
    ) -> Result<oneshot::Receiver<Slots>> {
        self.queue_get_or(slot, keys, WhenFull::Wait).await
    }

    /// [`queue_get`](Self::queue_get), doing as `full` says if the queue is full.
    async fn queue_get_or(
        self: &Arc<Self>,
        slot: usize,
        keys: &[&str],
        full: WhenFull,
    ) -> Result<oneshot::Receiver<Slots>> {
        let (reply, rx) = oneshot::channel();
        let keys = keys.iter().map(|k| (*k).to_owned()).collect();
        self.send(slot, Op::Get { keys, reply }, full).await?;
        Ok(rx)
    }

    /// Awaits a get's answer. If its connection ended without answering (its runtime shut
    /// down: no reply will ever come), the get is queued again on a fresh connection, a few
    /// times (while a runtime shuts down, its other connections may not have ended yet).
    async fn get_reply(
        self: &Arc<Self>,
        mut reply: oneshot::Receiver<Slots>,
        keys: &[&str],
    ) -> Slots {
        for _ in 0..3 {
            if let Ok(slots) = reply.await {
                return slots;
            }
            reply = match self.queue_get(self.pick(), keys).await {
                Ok(reply) => reply,
                Err(e) => return smallvec![Err(e); keys.len()],
            };
        }
        reply.await.unwrap_or_else(|_| {
            let lost = self.annotate(Error::backend(
                "its connections ended without answering (their tokio runtime shut down, or \
                 lacks enable_all)",
            ));
            smallvec![Err(lost); keys.len()]
        })
    }

    /// Queues an encoded command; the answer comes on the returned receiver.
    async fn queue_cmd(
        self: &Arc<Self>,
        slot: usize,
        bytes: Vec<u8>,
        parse: Parse,
    ) -> Result<oneshot::Receiver<Result<Reply>>> {
        let (reply, rx) = oneshot::channel();
        self.send(
            slot,
            Op::Cmd {
                bytes,
                parse,
                reply,
            },
            WhenFull::Wait,
        )
        .await?;
        Ok(rx)
    }

    /// Awaits a command's answer. A connection that ended without answering (its runtime shut
    /// down) may or may not have written it: outcome unknown, never retried.
    async fn cmd_reply(&self, reply: oneshot::Receiver<Result<Reply>>) -> Result<Reply> {
        reply.await.unwrap_or_else(|_| {
            Err(self
                .annotate(Error::backend(
                    "the connection ended without answering (its tokio runtime shut down, or \
                     lacks enable_all)",
                ))
                .with_outcome_unknown())
        })
    }

    /// One command on a round-robin connection.
    async fn cmd(self: &Arc<Self>, bytes: Vec<u8>, parse: Parse) -> Result<Reply> {
        let reply = self.queue_cmd(self.pick(), bytes, parse).await?;
        self.cmd_reply(reply).await
    }
}

/// A reply of another kind than the command's (cannot happen: the reader parses by the kind
/// it was given). An error, never a panic.
fn mismatch(r: Reply) -> Error {
    Error::backend(format!("internal: unexpected reply {r:?}"))
}

impl Engine {
    /// Sets up `connections_per_server` connections per server (the design default is 2),
    /// without connecting.
    ///
    /// # Errors
    ///
    /// A configuration error (`is_config()`) for what `MemcachedBackend::new` refuses (no
    /// server, a zero timeout, a `retry_interval` over a day, a zero `pool_size`, which is the
    /// blocking backend's and is not used here) or zero connections per server.
    #[cfg(test)]
    pub(crate) fn new(config: &MemcachedConfig, connections_per_server: usize) -> Result<Engine> {
        Engine::sharing(config, connections_per_server, None)
    }

    /// [`Engine::new`], keeping the health records `shared` (one per configured server) with
    /// another backend: a sync `Cache`'s pool, so that a server marked dead (or remapped) by
    /// one path is dead (or remapped) for the other.
    pub(crate) fn sharing(
        config: &MemcachedConfig,
        connections_per_server: usize,
        shared: Option<Vec<Arc<Health>>>,
    ) -> Result<Engine> {
        config.check()?;
        if connections_per_server == 0 {
            return Err(Error::config("connections per server must be at least 1"));
        }
        let options = config.options();
        let mut records = shared.map(Vec::into_iter);
        let peers: Arc<[Arc<Health>]> = config
            .servers
            .iter()
            .map(|spec| {
                records
                    .as_mut()
                    .and_then(Iterator::next)
                    .unwrap_or_else(|| Arc::new(Health::new("memcached", spec.addr(), &options)))
            })
            .collect();
        let servers = config
            .servers
            .iter()
            .zip(peers.iter())
            .map(|(spec, health)| {
                Arc::new(Server {
                    addr: spec.addr(),
                    health: health.clone(),
                    peers: peers.clone(),
                    options,
                    slots: (0..connections_per_server)
                        .map(|_| Mutex::new(None))
                        .collect(),
                    next: AtomicUsize::new(0),
                    last: AtomicUsize::new(0),
                    #[cfg(test)]
                    counters: tests::Counters::default(),
                })
            })
            .collect();
        Ok(Engine {
            servers,
            routing: Routing::new(&config.servers, config.dead_servers),
            options,
        })
    }

    /// Refuses a `cas` with token 0 (a server without CAS reported it), naming the server.
    fn check_cas(&self, w: &Write<'_>) -> Result<()> {
        if w.mode != crate::backend::StoreMode::Cas(0) {
            return Ok(());
        }
        let i = self.routing.route(w.key, self.routable());
        Err(crate::backend::no_cas(Some(&self.servers[i].addr)))
    }

    /// Whether server `i` may be routed to; the clock is read once, and only if a server is
    /// marked dead.
    fn routable(&self) -> impl Fn(usize) -> bool + '_ {
        let now = OnceCell::new();
        move |i| self.servers[i].health.routable(|| *now.get_or_init(now_ms))
    }

    /// The server to send `key` to now.
    fn route(&self, key: &str) -> &Arc<Server> {
        &self.servers[self.route_index(key)]
    }

    fn route_index(&self, key: &str) -> usize {
        let i = self.routing.route(key, self.routable());
        crate::backend::note_server(&self.servers[i].addr);
        i
    }

    fn missed(&self, server: usize) -> &outage::Missed {
        &self.servers[server].health.missed
    }

    /// Sends a write of `key` with `send` to the server it routes to, recording it for replay
    /// on its home server where that one may miss it ([`outage::after_write`]).
    async fn write<'s, T, F>(
        &'s self,
        key: &str,
        send: impl FnOnce(&'s Arc<Server>) -> F,
    ) -> Result<T>
    where
        F: Future<Output = Result<T>>,
    {
        let (home, i) = self.routing.home_and_route(key, self.routable());
        crate::backend::note_server(&self.servers[i].addr);
        let elsewhere = (i != home).then_some(i);
        let capacity = self.options.replay_capacity;
        if elsewhere.is_some() {
            self.missed(home).note(key, elsewhere, capacity);
        }
        let r = send(&self.servers[i]).await;
        outage::after_write(self.missed(home), elsewhere, key, r, capacity)
    }

    /// Judges an item read for `key` by its home server's record ([`outage::distrust`]).
    fn distrust(&self, key: &str, item: Option<&mut Item>) {
        let records = self.servers.iter().map(|s| &s.health.missed);
        outage::distrust_read(item, records, || self.missed(self.routing.home(key)));
    }

    /// Groups positions `0..n` (those `check` passes; the others get its error) by server:
    /// `(server, positions)` in input order within a server.
    fn by_server<'k, T>(
        &self,
        n: usize,
        key: impl Fn(usize) -> &'k str,
        check: impl Fn(usize) -> Result<()>,
        out: &mut [Option<Result<T>>],
    ) -> Vec<(usize, Vec<usize>)> {
        let sendable: Vec<usize> = (0..n)
            .filter(|&i| match check(i) {
                Ok(()) => true,
                Err(e) => {
                    out[i] = Some(Err(e));
                    false
                }
            })
            .collect();
        self.routing
            .by_server(sendable.iter().map(|&i| key(i)), self.routable())
            .into_iter()
            .map(|(s, ps)| (s, ps.into_iter().map(|p| sendable[p]).collect()))
            .collect()
    }

    /// One command per entry (`encode` makes it, validating; an entry it refuses fails alone,
    /// nothing sent), routed by `key`; each server's commands queued in order on one of its
    /// connections (so a batch's writes to one key apply in order), then every answer awaited.
    async fn commands<'k, T>(
        &self,
        n: usize,
        key: impl Fn(usize) -> &'k str,
        encode: impl Fn(usize) -> Result<(Vec<u8>, Parse)>,
        unpack: impl Fn(Reply) -> Result<T>,
    ) -> Vec<Result<T>> {
        let mut encoded: Vec<Option<(Vec<u8>, Parse)>> = Vec::with_capacity(n);
        let mut out: Vec<Option<Result<T>>> = Vec::with_capacity(n);
        for i in 0..n {
            match encode(i) {
                Ok(c) => {
                    encoded.push(Some(c));
                    out.push(None);
                }
                Err(e) => {
                    encoded.push(None);
                    out.push(Some(Err(e)));
                }
            }
        }
        let all_up = || (0..self.servers.len()).all(self.routable());
        let up_before = all_up();
        let groups = self.by_server(n, &key, |_| Ok(()), &mut out);
        // Each command is a write.
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
        let mut pending = Vec::new();
        for (s, positions) in groups {
            let server = &self.servers[s];
            let slot = server.pick();
            let several = positions.len() > 1;
            for p in positions {
                let Some((bytes, parse)) = encoded[p].take() else {
                    continue;
                };
                match server.queue_cmd(slot, bytes, parse).await {
                    Ok(rx) => pending.push((s, p, rx)),
                    Err(e) => out[p] = Some(Err(e)),
                }
            }
            if several {
                server.flush(slot);
            }
        }
        for (s, p, rx) in pending {
            out[p] = Some(self.servers[s].cmd_reply(rx).await.and_then(&unpack));
        }
        sent.settle(&mut out, Option::as_mut, &key, |i| self.missed(i), capacity);
        out.into_iter()
            .map(|o| o.unwrap_or_else(|| Err(Error::backend("no reply for this entry"))))
            .collect()
    }

    /// Closes every connection and waits (at most `connect_timeout` + `io_timeout`) for their
    /// tasks to end: queued ops are written and in-flight replies read first.
    async fn close_all(&self) {
        let tasks: Vec<JoinHandle<()>> = self
            .servers
            .iter()
            .flat_map(|s| s.slots.iter())
            .filter_map(|slot| slot.lock().take())
            .map(|live| live.task)
            .collect();
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let bound = self
            .options
            .connect_timeout
            .saturating_add(self.options.io_timeout);
        let _ = tokio::time::timeout(bound, async {
            for t in tasks {
                let _ = t.await;
            }
        })
        .await;
    }
}

impl Drop for Engine {
    /// Closes the connections: their tasks hold the servers (and so the queues' senders) alive,
    /// so without this they would outlive the engine. Queued ops are still written and their
    /// replies read; then the tasks end.
    fn drop(&mut self) {
        for slot in self.servers.iter().flat_map(|s| s.slots.iter()) {
            drop(slot.lock().take());
        }
    }
}

impl AsyncBackend for Engine {
    fn get<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Option<Item>>> {
        Box::pin(async move {
            wire::check_key(key)?;
            let server = self.route(key);
            let mut slots = server.get_on(server.pick(), &[key]).await;
            let mut item = slots.pop().unwrap_or(Ok(None))?;
            self.distrust(key, item.as_mut());
            Ok(item)
        })
    }

    fn get_many<'a>(&'a self, keys: &'a [&'a str]) -> BoxFuture<'a, Vec<Result<Option<Item>>>> {
        Box::pin(async move {
            let mut out: Vec<Option<Slot>> = (0..keys.len()).map(|_| None).collect();
            let groups = self.by_server(
                keys.len(),
                |i| keys[i],
                |i| wire::check_key(keys[i]),
                &mut out,
            );
            // Queue every server's gets first, then await them all: the servers work at once.
            let mut pending = Vec::new();
            for (s, positions) in &groups {
                let server = &self.servers[*s];
                let slot = server.pick();
                for part in positions.chunks(KEYS_PER_LINE) {
                    let ks: Vec<&str> = part.iter().map(|&p| keys[p]).collect();
                    match server.queue_get(slot, &ks).await {
                        Ok(rx) => pending.push((server, part, ks, rx)),
                        Err(e) => part.iter().for_each(|&p| out[p] = Some(Err(e.clone()))),
                    }
                }
                if positions.len() > KEYS_PER_LINE {
                    server.flush(slot);
                }
            }
            for (server, part, ks, rx) in pending {
                let slots = server.get_reply(rx, &ks).await;
                for (&p, slot) in part.iter().zip(slots) {
                    out[p] = Some(slot);
                }
            }
            out.into_iter()
                .zip(keys)
                .map(|(o, key)| {
                    let mut item =
                        o.unwrap_or_else(|| Err(Error::backend("no reply for this key")))?;
                    self.distrust(key, item.as_mut());
                    Ok(item)
                })
                .collect()
        })
    }

    fn store<'a>(&'a self, w: Write<'a>) -> BoxFuture<'a, Result<StoreOutcome>> {
        Box::pin(async move {
            let mut bytes = Vec::new();
            self.check_cas(&w)?;
            wire::encode_store(&mut bytes, &w, self.max_value_size(w.key))?;
            match self.write(w.key, |s| s.cmd(bytes, Parse::Store)).await? {
                Reply::Store(o) => Ok(o),
                other => Err(mismatch(other)),
            }
        })
    }

    fn store_then_get<'a>(
        &'a self,
        w: Write<'a>,
    ) -> BoxFuture<'a, Result<(StoreOutcome, Option<Item>)>> {
        Box::pin(async move {
            let mut bytes = Vec::new();
            self.check_cas(&w)?;
            wire::encode_store(&mut bytes, &w, self.max_value_size(w.key))?;
            wire::encode_gets(&mut bytes, &[w.key])?;
            let parse = Parse::StoreThenGet(w.key.to_owned());
            match self.write(w.key, |s| s.cmd(bytes, parse)).await? {
                Reply::StoreThenGet(o, mut item) => {
                    self.distrust(w.key, item.as_mut());
                    Ok((o, item))
                }
                other => Err(mismatch(other)),
            }
        })
    }

    fn store_many<'a>(
        &'a self,
        writes: &'a [Write<'a>],
    ) -> BoxFuture<'a, Vec<Result<StoreOutcome>>> {
        Box::pin(self.commands(
            writes.len(),
            |i| writes[i].key,
            |i| {
                let mut bytes = Vec::new();
                let w = &writes[i];
                self.check_cas(w)?;
                wire::encode_store(&mut bytes, w, self.max_value_size(w.key))?;
                Ok((bytes, Parse::Store))
            },
            |r| match r {
                Reply::Store(o) => Ok(o),
                other => Err(mismatch(other)),
            },
        ))
    }

    fn delete<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let mut bytes = Vec::new();
            wire::encode_delete(&mut bytes, key)?;
            match self.write(key, |s| s.cmd(bytes, Parse::Delete)).await? {
                Reply::Found(f) => Ok(f),
                other => Err(mismatch(other)),
            }
        })
    }

    fn delete_many<'a>(&'a self, keys: &'a [&'a str]) -> BoxFuture<'a, Vec<Result<bool>>> {
        Box::pin(self.commands(
            keys.len(),
            |i| keys[i],
            |i| {
                let mut bytes = Vec::new();
                wire::encode_delete(&mut bytes, keys[i])?;
                Ok((bytes, Parse::Delete))
            },
            |r| match r {
                Reply::Found(f) => Ok(f),
                other => Err(mismatch(other)),
            },
        ))
    }

    fn touch<'a>(&'a self, key: &'a str, exptime: u32) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let mut bytes = Vec::new();
            wire::encode_touch(&mut bytes, key, exptime)?;
            match self.write(key, |s| s.cmd(bytes, Parse::Touch)).await? {
                Reply::Found(f) => Ok(f),
                other => Err(mismatch(other)),
            }
        })
    }

    fn incr<'a>(&'a self, key: &'a str, delta: u64) -> BoxFuture<'a, Result<Option<u64>>> {
        Box::pin(self.arith(true, key, delta))
    }

    fn decr<'a>(&'a self, key: &'a str, delta: u64) -> BoxFuture<'a, Result<Option<u64>>> {
        Box::pin(self.arith(false, key, delta))
    }

    fn flush_all(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            // Every server's flush is queued before any answer is awaited.
            let mut queued = Vec::new();
            for server in &self.servers {
                let bytes = b"flush_all\r\n".to_vec();
                let q = server
                    .queue_cmd(server.pick(), bytes, Parse::FlushAll)
                    .await;
                queued.push((server, q));
            }
            let mut first = Ok(());
            for (server, q) in queued {
                let r = match q {
                    Ok(rx) => server.cmd_reply(rx).await.and_then(|r| match r {
                        Reply::Done => Ok(()),
                        other => Err(mismatch(other)),
                    }),
                    Err(e) => Err(e),
                };
                if first.is_ok() {
                    first = r;
                }
            }
            first
        })
    }

    /// Every server asked at once: a `get` of [`PING_KEY`](crate::PING_KEY) queued on each
    /// concurrently (a server whose queue is full waits for room without holding up the
    /// others), every answer awaited together (each bounded by its connection's `io_timeout`).
    fn ping(&self) -> BoxFuture<'_, std::result::Result<(), PingError>> {
        Box::pin(async move {
            let asks = self.servers.iter().map(|server| async move {
                let queued = server
                    .queue_get_or(server.pick(), &[PING_KEY], WhenFull::OwnConnection)
                    .await;
                match queued {
                    Ok(rx) => server.get_reply(rx, &[PING_KEY]).await.pop(),
                    Err(e) => Some(Err(e)),
                }
            });
            let answers = join_all(asks.collect()).await;
            let failures = self
                .servers
                .iter()
                .zip(answers)
                .filter_map(|(server, answer)| match answer {
                    Some(Err(e)) => Some(PingFailure::new(server.addr.clone(), e)),
                    _ => None,
                })
                .collect();
            PingError::check(failures, self.servers.len())
        })
    }

    fn max_value_size(&self, key: &str) -> usize {
        max_value_size(self.options.item_size, key)
    }

    /// A queued write is written and answered within `io_timeout` of reaching its socket, or
    /// its connection is given up; it may wait its turn behind a connect first. Behind another
    /// caller's large batch it also waits for that batch's rounds: it may land later than this
    /// (its claim then lapses after `lease_ttl`, as ARCHITECTURE.md's cancellation invariant
    /// says of writes that land late).
    fn settle_time(&self) -> Duration {
        self.options
            .connect_timeout
            .saturating_add(self.options.io_timeout)
    }

    fn shutdown(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.close_all())
    }
}

/// Polls every future until all are done; their outputs in order. Each is polled only while
/// pending, so one waiting (for room in a full queue, for its reply) holds up none of the others.
pub(crate) async fn join_all<F: Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut futures: Vec<Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut done = true;
        for (future, output) in futures.iter_mut().zip(outputs.iter_mut()) {
            if output.is_none() {
                match future.as_mut().poll(cx) {
                    Poll::Ready(o) => *output = Some(o),
                    Poll::Pending => done = false,
                }
            }
        }
        if done { Poll::Ready(()) } else { Poll::Pending }
    })
    .await;
    outputs
        .into_iter()
        .map(|o| o.expect("every future is done"))
        .collect()
}

impl Engine {
    /// `incr` or `decr`.
    async fn arith(&self, incr: bool, key: &str, delta: u64) -> Result<Option<u64>> {
        let mut bytes = Vec::new();
        wire::encode_arith(&mut bytes, incr, key, delta)?;
        match self.route(key).cmd(bytes, Parse::Arith).await? {
            Reply::Counter(n) => Ok(n),
            other => Err(mismatch(other)),
        }
    }
}
