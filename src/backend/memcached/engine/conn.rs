//! One pipelined connection: a writer task that merges queued gets into shared `gets` lines and
//! writes everything queued at once, and a reader task that hands each whole reply to its waiters.
//! A caller that finds the connection idle writes its op itself (the direct path).
//!
//! ```text
//!  callers ──Op──► [queue] ──► writer: wait while a round is unanswered beyond the one on the
//!     │                                wire; take one op; if ≥ 16 replies are outstanding
//!     │                                and what is pending fills no round, wait for the last
//!     │                                of them (a caller's batch ends the wait); take all
//!     │                                queued (≤ 64 KiB, ≤ 2,048 keys or commands); merge
//!     │                                runs of gets; push the expectations; write
//!     │ idle: push the expectation,   │ Batch (sent time, expectations, in write order)
//!     │ then try_write (no await)     ▼
//!     └──────────────────────► reader: take every batch pushed; buffer bytes; while the oldest
//!                                      expectation's reply is whole (wire::frame_gets, going
//!                                      on from the lines the last read brought, or
//!                                      reply_len), parse it (a gets reply where its framing
//!                                      found its values), answer its waiters; wake a writer
//!                                      waiting for room or for the last reply
//! ```
//!
//! The direct path and the writer never interleave bytes or reorder expectations: each pushes
//! its expectations to the reader, then writes their bytes, inside a section the other cannot
//! enter. The direct path's section is synchronous, under the [`Conn`] lock, and open only
//! while no op is pending (queued, or taken by the writer and not yet written); the writer's
//! section only ever holds pending ops. An op queued before a direct one is therefore written
//! before it (a set queued and not awaited, then a get: the get sees the set). A direct write the
//! socket takes only in part queues its rest, first in the queue, for the writer.
//!
//! A batch of any size goes out in rounds, as the blocking pool's do: the writer starts a round
//! only while at most [`ROUND`] keys and commands are unanswered (one round on the wire, the
//! next being written), so that what is in flight, and what the reader holds, stays bounded,
//! and each round is stamped when it is written: its `io_timeout` counts from then, not from
//! the start of a batch that may take many times that to answer.
//!
//! Either task ending wakes the other: the reader holds the writer's `kill` sender, the writer
//! the reader's `writer_done` one. Whoever hits a fault first poisons the [`Link`] (the first
//! cause wins and is recorded once against the server); then every waiter in flight and every op
//! still queued is failed at once, and the queue is closed, so the next caller reconnects.

use std::collections::VecDeque;
use std::hash::BuildHasher;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use smallvec::{SmallVec, smallvec};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::mpsc::error::{TryRecvError, TrySendError};
use tokio::sync::{Notify, mpsc, oneshot};

use super::Server;
use crate::backend::memcached::wire::{self, Shape, Slot, ValueAt};
use crate::backend::server::outage::{self, Replay};
use crate::backend::server::replay::MissedOf;
use crate::backend::{Item, StoreOutcome};
use crate::error::{Error, ErrorKind, Result};

/// A get's keys: inline for one (most gets), so that a get allocates no vector.
pub(super) type Keys = SmallVec<[String; 1]>;
/// A get's answer, a slot per key in order: inline for one key.
pub(super) type Slots = SmallVec<[Slot; 1]>;
/// The replies a write asks for: inline for one (a lone caller's).
type Expects = SmallVec<[Expect; 1]>;

/// Keys per `Get` op (longer requests are split when submitted) and per merged `gets` line.
pub(super) const KEYS_PER_LINE: usize = 128;
/// Key bytes per merged `gets` line (one op alone may exceed it: at most 128 × 251 bytes).
const LINE_BYTES: usize = 16 * 1024;
/// The writer stops taking queued ops once a write holds this many bytes (one op may exceed it).
const WRITE_BYTES: usize = 64 * 1024;
/// Keys and commands per round (a `gets` line counts its keys): the writer stops taking queued
/// ops once a write asks for this many replies (one op may take it past, by at most
/// [`KEYS_PER_LINE`]), as the blocking pool writes 2,048 keys at a time.
pub(super) const ROUND: usize = 2048;
/// Ops queued per connection before callers wait to submit.
pub(super) const QUEUE: usize = 1024;
/// Keys and commands unanswered (by [`Expect::weight`]) from which a connection counts as busy
/// enough for Nagle's rule: below it, a round goes as soon as the writer has let the ready
/// callers run one scheduler turn, so a few tasks (up to 16 of single gets) keep pipelining.
pub(super) const HOLD: usize = 16;
/// Written batches the reader has not taken yet.
const BATCHES_QUEUED: usize = 64;
/// The reader's buffer grows by this much when it runs low.
const READ_CHUNK: usize = 16 * 1024;
/// A buffer kept past a large reply is given back once it is empty.
const KEEP_BUFFER: usize = 1 << 20;

/// What a caller asks of a connection.
pub(super) enum Op {
    /// Read keys (at most [`KEYS_PER_LINE`], validated); merged with adjacent gets. The answer
    /// has one slot per key, in order.
    Get {
        /// The keys, validated when submitted.
        keys: Keys,
        /// Where the answer goes; closed when the caller gave up (then the get is skipped if it
        /// was not written yet).
        reply: oneshot::Sender<Slots>,
    },
    /// One command, encoded by the validating encoders when submitted: no invalid byte ever
    /// reaches the wire. Written even if its caller gave up (a queued write may be applied).
    Cmd {
        /// The whole command.
        bytes: Vec<u8>,
        /// How to read its reply.
        parse: Parse,
        /// Where the answer goes.
        reply: oneshot::Sender<Result<Reply>>,
    },
    /// The unwritten rest of an op a caller wrote directly, in part: its expectation is with the
    /// reader already, so these bytes go out before anything else (they are queued first).
    Rest(Vec<u8>),
}

/// How to read a command's reply.
#[derive(Debug)]
pub(super) enum Parse {
    /// `set`/`add`/`cas`: a store outcome.
    Store,
    /// A store pipelined with `gets` of this key.
    StoreThenGet(String),
    /// `delete`: whether the key existed.
    Delete,
    /// `touch`: whether the key existed.
    Touch,
    /// `incr`/`decr`: the new value, if the key existed.
    Arith,
    /// `flush_all`: `OK`.
    FlushAll,
}

impl Parse {
    fn shape(&self) -> Shape {
        match self {
            Parse::StoreThenGet(_) => Shape::LineThenValues,
            _ => Shape::Line,
        }
    }
}

/// A command's answer, by [`Parse`] kind.
#[derive(Debug)]
pub(super) enum Reply {
    /// For [`Parse::Store`].
    Store(StoreOutcome),
    /// For [`Parse::StoreThenGet`].
    StoreThenGet(StoreOutcome, Option<Item>),
    /// For [`Parse::Delete`] and [`Parse::Touch`].
    Found(bool),
    /// For [`Parse::Arith`].
    Counter(Option<u64>),
    /// For [`Parse::FlushAll`].
    Done,
}

impl Op {
    /// What it adds to a round: the replies it asks for, as the writer counts a round (a
    /// get's keys, one per command), and about its bytes (a get's keys and separators). A rest
    /// counts neither: its expectation is counted already, and it is never held.
    fn load(&self) -> (usize, usize) {
        match self {
            Op::Get { keys, .. } => (keys.len(), keys.iter().map(|k| k.len() + 1).sum()),
            Op::Cmd { bytes, .. } => (1, bytes.len()),
            Op::Rest(_) => (0, 0),
        }
    }

    /// Answers an op that was never written with `e`.
    fn fail(self, e: &Error) {
        match self {
            Op::Get { keys, reply } => {
                let _ = reply.send(smallvec![Err(e.clone()); keys.len()]);
            }
            Op::Cmd { reply, .. } => {
                let _ = reply.send(Err(e.clone()));
            }
            // Its waiter is the reader's; the writer never fails a rest while the connection
            // lives, and the reader fails every expectation of a dead one.
            Op::Rest(_) => {}
        }
    }
}

/// One caller's part of a merged `gets` line: where each of its keys sits in the line.
struct Waiter {
    reply: oneshot::Sender<Slots>,
    at: SmallVec<[u32; 1]>,
}

/// A reply the reader expects, in write order.
enum Expect {
    /// A (possibly merged) `gets` line: its distinct keys and the callers waiting on them.
    Gets {
        keys: Keys,
        waiters: SmallVec<[Waiter; 1]>,
    },
    /// One command.
    Cmd {
        parse: Parse,
        reply: oneshot::Sender<Result<Reply>>,
    },
}

impl Expect {
    /// What it counts toward the connection's in-flight total: a line's distinct keys, or one
    /// command (so that a round of 16 lines weighs what 2,048 single gets do).
    fn weight(&self) -> usize {
        match self {
            Expect::Gets { keys, .. } => keys.len(),
            Expect::Cmd { .. } => 1,
        }
    }

    fn shape(&self) -> Shape {
        match self {
            Expect::Gets { .. } => Shape::Values,
            Expect::Cmd { parse, .. } => parse.shape(),
        }
    }

    /// The most bytes a valid reply can take before it is whole: a value may exceed the item
    /// size (another client wrote it to a server with a larger `-I`; the parser skips it), so
    /// this is generous. It bounds what a hostile server can make the reader buffer.
    fn reply_bound(&self, item_size: usize) -> usize {
        let per_value = item_size.saturating_mul(2).max(8 << 20) + 1024;
        let values = match self {
            Expect::Gets { keys, .. } => keys.len(),
            Expect::Cmd { parse, .. } => usize::from(parse.shape() == Shape::LineThenValues),
        };
        per_value.saturating_mul(values).saturating_add(4096)
    }

    /// Answers every waiter with `e`; a command that may have been written is marked
    /// [`outcome unknown`](Error::is_outcome_unknown).
    fn fail(self, e: &Error, written: bool) {
        match self {
            Expect::Gets { waiters, .. } => {
                for w in waiters {
                    let _ = w.reply.send(smallvec![Err(e.clone()); w.at.len()]);
                }
            }
            Expect::Cmd { reply, .. } => {
                let e = if written {
                    e.clone().with_outcome_unknown()
                } else {
                    e.clone()
                };
                let _ = reply.send(Err(e));
            }
        }
    }
}

/// Expectations pushed to the reader before their bytes are written, with when that happened.
pub(super) struct Batch {
    sent: Instant,
    expects: Expects,
}

/// A connection as its callers see it (next to its queue's sender): the count of pending ops,
/// and, while its tasks run, the way to write to it directly. Holds no `Server` (the server's
/// slot holds this) and no queue sender (the writer ends when the last one is dropped).
pub(super) struct Conn {
    flow: Mutex<Flow>,
    /// Replies expected and not yet read, by [`Expect::weight`] (the writers add, the reader
    /// subtracts).
    in_flight: AtomicUsize,
    /// Signalled by the reader when `in_flight` falls to [`ROUND`]: the writer waits for it
    /// before a round while more is unanswered.
    room: Notify,
    /// Signalled when a round the writer holds (Nagle's rule) should go: by the reader when
    /// `in_flight` falls to 0, by a caller whose op fills the round or ends its batch. The
    /// writer checks again, so a signal kept from earlier costs a loop.
    go: Notify,
}

/// What the direct path and the writer task order themselves by.
#[derive(Default)]
struct Flow {
    /// Ops queued, or taken by the writer and not yet written. Raised with every queueing,
    /// under this lock; lowered by the writer once a round's bytes are all written.
    pending: usize,
    /// Set while the connection is up and its writer runs.
    open: Option<Open>,
    /// The direct path's buffers (it merges a get's keys as the writer does).
    round: Round,
    /// Replies the pending ops ask for ([`Op::load`]).
    asks: usize,
    /// About the bytes of the pending ops ([`Op::load`]).
    bytes: usize,
    /// A caller queued the last op of a batch: how many pending ops are still to be written
    /// before it is (ops are written in queue order). While any are, a round held goes, so
    /// that a caller's own ops never wait for its own replies.
    flush: usize,
    /// The writer holds a round (Nagle's rule) and waits for `go`.
    holding: bool,
}

impl Flow {
    /// Counts an op queued (its `load`), and tells the writer if the round it holds is now
    /// full.
    fn queued(&mut self, (asks, bytes): (usize, usize), go: &Notify) {
        self.pending += 1;
        self.asks += asks;
        self.bytes += bytes;
        if self.holding && self.full() {
            self.holding = false;
            go.notify_one();
        }
    }

    /// Whether what is pending fills a round (or the queue), or a batch asked for it to go.
    fn full(&self) -> bool {
        self.flush > 0 || self.asks >= ROUND || self.bytes >= WRITE_BYTES || self.pending >= QUEUE
    }

    /// The direct path (the caller checked that nothing is pending or in flight): pushes `op`'s
    /// expectation to the reader, then writes its bytes with a non-blocking write; what the
    /// socket does not take is queued first for the writer. `op` comes back, untouched, if the
    /// connection is not up or its queues have no room.
    fn write(
        &mut self,
        op: Op,
        ops: &mpsc::Sender<Op>,
        in_flight: &AtomicUsize,
        server: &Server,
    ) -> Option<Op> {
        let Some(open) = &self.open else {
            return Some(op);
        };
        // Both permits first: once the expectation is pushed there is no way back, and a rest
        // must find room in the queue.
        let (Ok(rest), Ok(expect)) = (ops.try_reserve(), open.batches.try_reserve()) else {
            return Some(op);
        };
        let round = &mut self.round;
        let mut buf = match op {
            // A command's bytes are written as they are, not copied.
            Op::Cmd {
                bytes,
                parse,
                reply,
            } => {
                round.expects.push(Expect::Cmd { parse, reply });
                bytes
            }
            // A get is encoded as the writer would (its keys merged into one line).
            op => {
                round.push(op, server);
                round.close_line(server);
                std::mem::take(&mut round.out)
            }
        };
        let expects = std::mem::take(&mut round.expects);
        if !expects.is_empty() {
            in_flight.fetch_add(expects.iter().map(Expect::weight).sum(), Ordering::Relaxed);
            expect.send(Batch {
                sent: Instant::now(),
                expects,
            });
            #[cfg(test)]
            {
                server.counters.note_direct();
                server.counters.note_write();
            }
            // An error other than WouldBlock is left for the writer to meet: it poisons the
            // link, and the reader fails this op with the others.
            let n = open.wr.try_write(&buf).unwrap_or(0);
            if n < buf.len() {
                #[cfg(test)]
                server.counters.note_rest();
                rest.send(Op::Rest(buf[n..].to_vec()));
                self.pending += 1;
            }
        }
        // Kept for the next direct get.
        buf.clear();
        if buf.capacity() <= KEEP_BUFFER && round.out.capacity() == 0 {
            round.out = buf;
        }
        None
    }
}

/// A connected link's write side, for the direct path.
struct Open {
    /// The reader's expectations (the writer holds the other sender).
    batches: mpsc::Sender<Batch>,
    wr: Arc<OwnedWriteHalf>,
}

impl Conn {
    pub(super) fn new() -> Conn {
        Conn {
            flow: Mutex::new(Flow::default()),
            in_flight: AtomicUsize::new(0),
            room: Notify::new(),
            go: Notify::new(),
        }
    }

    /// Submits `op`: written now by this caller if the connection is up and idle (nothing
    /// pending, no reply outstanding), queued for the writer otherwise. Never waits: `Full` and
    /// `Closed` are the queue's, and hand `op` back untouched.
    ///
    /// Cancel safety: nothing here awaits, so a caller dropped later finds its op either
    /// queued whole or with the reader and on the wire (in part, the rest queued first).
    pub(super) fn submit(
        &self,
        ops: &mpsc::Sender<Op>,
        op: Op,
        server: &Server,
    ) -> std::result::Result<(), TrySendError<Op>> {
        let mut flow = self.flow.lock();
        // A reply outstanding means the connection is busy: queue, so that the writer merges
        // this op with its neighbours (the direct path is for a lone caller, not throughput).
        let op = if flow.pending == 0 && self.in_flight.load(Ordering::Relaxed) == 0 {
            match flow.write(op, ops, &self.in_flight, server) {
                None => return Ok(()),
                Some(op) => op,
            }
        } else {
            op
        };
        let load = op.load();
        ops.try_send(op)?;
        flow.queued(load, &self.go);
        Ok(())
    }

    /// Queues `op` on a slot reserved after waiting for room.
    pub(super) fn queue(&self, permit: mpsc::Permit<'_, Op>, op: Op) {
        let mut flow = self.flow.lock();
        let load = op.load();
        permit.send(op);
        flow.queued(load, &self.go);
    }

    /// A caller queued the last of several ops it submits together (a batch's lines or
    /// commands): a round the writer holds goes now, rather than wait for replies that may be
    /// the caller's own.
    pub(super) fn flush(&self) {
        let mut flow = self.flow.lock();
        if flow.pending == 0 {
            return;
        }
        flow.flush = flow.pending;
        if flow.holding {
            flow.holding = false;
            self.go.notify_one();
        }
    }

    /// The writer, holding a round of ops taken and queued: whether to go on waiting (then it
    /// waits for `go`). It goes when nothing is in flight any more, or what is pending fills a
    /// round, or a batch ended.
    fn hold(&self) -> bool {
        let mut flow = self.flow.lock();
        let go = flow.full() || self.in_flight.load(Ordering::Relaxed) == 0;
        flow.holding = !go;
        !go
    }

    /// Whether nothing is pending or in flight (a hint: a busy lock counts as busy).
    pub(super) fn idle(&self) -> bool {
        self.in_flight.load(Ordering::Relaxed) == 0
            && self.flow.try_lock().is_some_and(|f| f.pending == 0)
    }

    /// Opens the direct path onto `wr`, as a connected link does.
    #[cfg(test)]
    pub(super) fn open_for_test(&self, batches: mpsc::Sender<Batch>, wr: OwnedWriteHalf) {
        self.flow.lock().open = Some(Open {
            batches,
            wr: Arc::new(wr),
        });
    }

    /// What the reader does on answering an expectation of one key or command.
    #[cfg(test)]
    pub(super) fn answered_for_test(&self) {
        self.answered(1);
    }

    /// The reader read the reply to an expectation of `weight`: wakes the writer if it waits
    /// for room, or for the last reply, and this made it (the writer checks again, so a
    /// wake-up too many costs a loop).
    fn answered(&self, weight: usize) {
        let before = self.in_flight.fetch_sub(weight, Ordering::Relaxed);
        if before > ROUND && before - weight <= ROUND {
            self.room.notify_one();
        }
        if before == weight {
            self.go.notify_one();
        }
    }

    /// The writer wrote `n` pending ops, of `load` ([`Op::load`]) together.
    pub(super) fn written(&self, n: usize, (asks, bytes): (usize, usize)) {
        let mut flow = self.flow.lock();
        flow.pending = flow.pending.saturating_sub(n);
        flow.flush = flow.flush.saturating_sub(n);
        flow.asks = flow.asks.saturating_sub(asks);
        flow.bytes = flow.bytes.saturating_sub(bytes);
    }
}

/// Clears the direct path when the connection's task ends or is dropped (its runtime shut
/// down): callers queue again and find the queue closed. Dropping the last `Arc` of the write
/// half shuts the socket's write side.
struct Closing<'a>(&'a Conn);

impl Drop for Closing<'_> {
    fn drop(&mut self) {
        let open = self.0.flow.lock().open.take();
        drop(open);
    }
}

/// What the writer and reader of one connection share.
struct Link {
    server: Arc<Server>,
    /// Opened by the caller probing a dead server: its first reply brings the server back.
    probe: bool,
    /// Why the connection died (the first cause).
    dead: Mutex<Option<Error>>,
    /// What callers see of the connection.
    conn: Arc<Conn>,
}

impl Link {
    /// Marks the connection dead. The first cause wins, is annotated with the server and, if it
    /// is a transport fault, recorded once against the server; returns the error every waiter
    /// gets.
    fn poison(&self, e: Error, fault: bool) -> Error {
        let mut dead = self.dead.lock();
        if let Some(first) = &*dead {
            return first.clone();
        }
        let e = self.server.annotate(e);
        *dead = Some(e.clone());
        drop(dead);
        #[cfg(test)]
        self.server.counters.note_poison();
        if fault {
            self.server.fault(self.probe, &e);
        }
        e
    }
}

/// The writer's current batch: the bytes to write, the replies they ask for, and an open run
/// of gets being merged into one line.
#[derive(Default)]
struct Round {
    out: Vec<u8>,
    expects: Expects,
    line: Line,
    /// The open line's keys by hash (indices into its `keys`), once it outgrows a linear scan;
    /// emptied for the next line, its room kept.
    table: hashbrown::HashTable<u32>,
    hasher: hashbrown::DefaultHashBuilder,
}

/// A `gets` line being merged: distinct keys, the waiters.
#[derive(Default)]
struct Line {
    keys: Keys,
    bytes: usize,
    waiters: SmallVec<[Waiter; 1]>,
}

/// Up to this many keys, a line finds duplicates by scanning.
const LINEAR: usize = 4;

impl Line {
    fn fits(&self, keys: usize, bytes: usize) -> bool {
        self.keys.is_empty()
            || (self.keys.len() + keys <= KEYS_PER_LINE && self.bytes + bytes <= LINE_BYTES)
    }

    /// The position of `key` in the line, adding it if new (`table`: the line's, empty until
    /// the line outgrows a linear scan).
    fn index(
        &mut self,
        key: String,
        table: &mut hashbrown::HashTable<u32>,
        hasher: &hashbrown::DefaultHashBuilder,
    ) -> u32 {
        let hash = |k: &str| hasher.hash_one(k);
        if self.keys.len() < LINEAR {
            if let Some(i) = self.keys.iter().position(|k| *k == key) {
                return i as u32;
            }
        } else {
            if table.is_empty() {
                // Room for a whole line: its keys are hashed once, never rehashed.
                table.reserve(KEYS_PER_LINE, |&j| hash(&self.keys[j as usize]));
                for (i, k) in self.keys.iter().enumerate() {
                    table.insert_unique(hash(k), i as u32, |&j| hash(&self.keys[j as usize]));
                }
            }
            let h = hash(&key);
            if let Some(&i) = table.find(h, |&i| self.keys[i as usize] == key) {
                return i;
            }
            table.insert_unique(h, self.keys.len() as u32, |&j| hash(&self.keys[j as usize]));
        }
        self.bytes += key.len() + 1;
        self.keys.push(key);
        (self.keys.len() - 1) as u32
    }
}

impl Round {
    /// Adds an op to the batch: a get joins the open line (skipped if its caller is gone); a
    /// command closes the line and follows it, so nothing is ever reordered across a write.
    fn push(&mut self, op: Op, server: &Server) {
        match op {
            Op::Get { keys, reply } => {
                if reply.is_closed() {
                    return;
                }
                let bytes = keys.iter().map(|k| k.len() + 1).sum();
                if !self.line.fits(keys.len(), bytes) {
                    self.close_line(server);
                }
                let at = keys
                    .into_iter()
                    .map(|k| self.line.index(k, &mut self.table, &self.hasher))
                    .collect();
                self.line.waiters.push(Waiter { reply, at });
            }
            Op::Cmd {
                bytes,
                parse,
                reply,
            } => {
                self.close_line(server);
                self.out.extend_from_slice(&bytes);
                self.expects.push(Expect::Cmd { parse, reply });
            }
            Op::Rest(bytes) => {
                self.close_line(server);
                self.out.extend_from_slice(&bytes);
            }
        }
    }

    /// Encodes the open line (the encoder checks its keys once more) and expects its reply.
    fn close_line(&mut self, server: &Server) {
        if self.line.keys.is_empty() {
            return;
        }
        let line = std::mem::take(&mut self.line);
        self.table.clear();
        match wire::encode_gets(&mut self.out, &line.keys) {
            Ok(()) => {
                #[cfg(test)]
                server.counters.note_line(line.waiters.len());
                self.expects.push(Expect::Gets {
                    keys: line.keys,
                    waiters: line.waiters,
                });
            }
            // Unreachable (keys are checked when submitted), and harmless: nothing was written.
            Err(e) => {
                let e = server.annotate(e);
                for w in line.waiters {
                    let _ = w.reply.send(smallvec![Err(e.clone()); w.at.len()]);
                }
            }
        }
    }
}

/// Connects to the server, then runs the connection until it dies or every sender is gone.
/// Ops queued while connecting wait for this one attempt; if it fails, they fail with it.
pub(super) async fn run(
    server: Arc<Server>,
    mut ops: mpsc::Receiver<Op>,
    probe: bool,
    conn: Arc<Conn>,
    replay: Option<Replay<MissedOf>>,
) {
    let closing = Closing(&conn);
    #[cfg(test)]
    server.counters.note_connect();
    let settings = server.options;
    let stream = match tokio::time::timeout(
        settings.connect_timeout,
        TcpStream::connect(server.addr.as_str()),
    )
    .await
    {
        Ok(Ok(s)) => s.set_nodelay(true).map(|()| s).map_err(Error::from),
        Ok(Err(e)) => Err(Error::io(e, "could not connect")),
        Err(_) => Err(Error::new(
            ErrorKind::Timeout,
            format!("could not connect in time ({:?})", settings.connect_timeout),
        )),
    };
    let capacity = settings.replay_capacity;
    let mut stream = match stream {
        Ok(s) => s,
        Err(e) => {
            let e = server.annotate(e);
            if let Some(r) = replay {
                r.failed(&server.addr, &e, capacity);
            }
            server.fault(probe, &e);
            close_queue(&mut ops, &e).await;
            return;
        }
    };
    // What the server missed is deleted before any op is written (those queued wait).
    if let Some(r) = replay {
        let keys: Vec<&str> = r.keys().collect();
        let deleted = delete_all(&mut stream, &keys, settings.io_timeout).await;
        drop(keys);
        match deleted {
            Ok(refused) => r.done(
                &server.addr,
                refused,
                |j| {
                    let there = &server.peers[j];
                    (!Arc::ptr_eq(there, &server.health)).then_some(&there.missed)
                },
                capacity,
            ),
            Err(e) => {
                let e = server.annotate(e);
                r.failed(&server.addr, &e, capacity);
                server.fault(probe, &e);
                close_queue(&mut ops, &e).await;
                return;
            }
        }
    }
    let (rd, wr) = stream.into_split();
    let wr = Arc::new(wr);
    let link = Arc::new(Link {
        server,
        probe,
        dead: Mutex::new(None),
        conn: conn.clone(),
    });
    let (batches_tx, batches_rx) = mpsc::channel(BATCHES_QUEUED);
    let (kill_tx, mut kill_rx) = oneshot::channel();
    let (done_tx, done_rx) = oneshot::channel::<()>();
    let reader = tokio::spawn(read_loop(link.clone(), rd, batches_rx, kill_tx, done_rx));
    conn.flow.lock().open = Some(Open {
        batches: batches_tx.clone(),
        wr: wr.clone(),
    });
    write_loop(&link, &mut ops, wr, batches_tx, &mut kill_rx).await;
    // No direct write from here on: the batches' last sender is gone; tell the reader.
    drop(closing);
    drop(done_tx);
    let e = link.dead.lock().clone();
    let e = e.unwrap_or_else(|| link.server.annotate(wire::closed()));
    close_queue(&mut ops, &e).await;
    // The reader answers what is in flight (or fails it) before it ends.
    let _ = reader.await;
}

/// Deletes every key of `taken` on a connection not yet serving (pipelined, [`ROUND`] per
/// exchange, each exchange within `io_timeout`), whether or not it exists: how many deletes
/// the server refused with an error reply (passed over).
async fn delete_all(stream: &mut TcpStream, keys: &[&str], io_timeout: Duration) -> Result<usize> {
    use tokio::io::AsyncWriteExt;
    let mut refused = 0;
    for part in keys.chunks(ROUND) {
        let mut out = Vec::new();
        for key in part {
            wire::encode_delete(&mut out, key)?;
        }
        let exchange = async {
            stream.write_all(&out).await?;
            // A delete's reply is one line: read until every line is in.
            let mut buf = Vec::with_capacity(part.len() * 12);
            let mut lines = 0;
            while lines < part.len() {
                let before = buf.len();
                if stream.read_buf(&mut buf).await? == 0 {
                    return Err(wire::closed());
                }
                lines += buf[before..].iter().filter(|&&b| b == b'\n').count();
            }
            let mut r = io::Cursor::new(&buf[..]);
            let mut refused = 0;
            for _ in part {
                match wire::read_delete(&mut r) {
                    Err(e) if outage::refused(&e) => refused += 1,
                    Err(e) => return Err(e),
                    Ok(_) => {}
                }
            }
            if usize::try_from(r.position()).ok() != Some(buf.len()) {
                return Err(wire::protocol_error("bytes after the last delete's reply"));
            }
            Ok(refused)
        };
        refused += tokio::time::timeout(io_timeout, exchange)
            .await
            .map_err(|_| {
                Error::new(
                    ErrorKind::Timeout,
                    format!("no reply to a replay of deletes within {io_timeout:?}"),
                )
            })??;
    }
    Ok(refused)
}

/// Refuses new ops (senders see the queue closed and reconnect) and fails the queued ones.
async fn close_queue(ops: &mut mpsc::Receiver<Op>, e: &Error) {
    ops.close();
    while let Some(op) = ops.recv().await {
        op.fail(e);
    }
}

/// Takes one op, then whatever else is queued (a round: at most [`WRITE_BYTES`] and [`ROUND`]
/// keys or commands, one op past either), and writes them as one batch. A full round is
/// written at once: a large batch has two rounds in flight. Before a round, waits while more
/// than [`ROUND`] are unanswered: backpressure, which bounds what the server, the socket and
/// the reader hold, and keeps each round's deadline its own (stamped as it is written, it is
/// not spent waiting behind a whole batch's earlier rounds). Returns when the queue's senders
/// are all gone or the reader ended (`kill`); a write error poisons the link.
///
/// The waits cannot hold up the reader: every reply they count was asked for by bytes written
/// whole (this task's earlier rounds), but for a direct write's rest, which is queued only
/// while its own op is all that is in flight (far below the cap), and written without waiting.
/// Callers waiting for room in the queue meanwhile are not failed; they wait (cancel-safely).
///
/// There is no batching timer (an op on an idle connection does not come here: its caller
/// writes it, [`Conn::submit`]). While fewer than [`HOLD`] keys and commands are outstanding,
/// this task yields scheduler turns so that ready callers add their ops; from [`HOLD`] on, a
/// round that what is pending does not fill waits for the last reply (Nagle's rule). The
/// comments at each wait say why. A full round, or the end of a caller's batch
/// ([`Conn::flush`]), ends the wait: a caller's ops never wait for its own replies.
///
/// Every op taken stays pending in the [`Conn`] until its bytes are all written, which keeps
/// the direct path shut meanwhile: the two never write at once.
///
/// The write has no timer of its own: its expectations reach the reader first, so a write
/// stuck on a server that stopped reading is cut off by the reader's deadline (`kill`).
async fn write_loop(
    link: &Link,
    ops: &mut mpsc::Receiver<Op>,
    wr: Arc<OwnedWriteHalf>,
    batches: mpsc::Sender<Batch>,
    kill: &mut oneshot::Receiver<()>,
) {
    let server = &*link.server;
    let conn = &*link.conn;
    let mut round = Round::default();
    loop {
        // The reader signals `room` when it brings the count down to `ROUND`: one made while
        // this task is between the check and the await is kept for it (`notify_one`).
        while conn.in_flight.load(Ordering::Relaxed) > ROUND {
            tokio::select! {
                biased;
                _ = &mut *kill => return,
                () = conn.room.notified() => {}
            }
        }
        let first = tokio::select! {
            biased;
            _ = &mut *kill => return,
            op = ops.recv() => match op {
                Some(op) => op,
                None => return,
            },
        };
        let busy = conn.in_flight.load(Ordering::Relaxed);
        if busy >= HOLD && !matches!(first, Op::Rest(_)) {
            // Nagle's rule, without a timer: on a busy connection, a round that what is
            // pending does not fill waits for the last reply outstanding, so that a write
            // carries every op its callers queued during a round trip (fewer writes, merged
            // lines, fewer wake-ups of the server). `first` and the rest stay pending, not
            // encoded: a get whose caller gives up meanwhile is still skipped. A full round
            // goes at once (a large batch keeps two rounds in flight), and so does the end of
            // a caller's batch (its ops never wait for its own replies), and a direct write's
            // rest (its own reply needs it).
            while conn.hold() {
                tokio::select! {
                    biased;
                    _ = &mut *kill => {
                        // Nothing of this round was written: its callers get the link's error.
                        let e = link.poison(wire::closed(), false);
                        first.fail(&e);
                        return;
                    }
                    () = conn.go.notified() => {}
                }
            }
        } else if !matches!(first, Op::Rest(_)) {
            // Replies are outstanding but few, or none: give the callers that are ready to
            // run one scheduler turn to queue theirs, and write them together. A few tasks
            // keep requests pipelined (none waits for another's reply). With none
            // outstanding, `first` was queued while the connection was busy, and the reply
            // that made it idle may have woken a caller that runs after this task: written
            // alone now, `first` would make that caller queue behind it in turn, and two
            // tasks would take turns on the wire, one request at a time, for good. For the
            // same reason, a turn in which the reader read a reply (its caller woken, perhaps
            // to run after this task) is followed by another: at most one per reply
            // outstanding, as nothing else lowers the count while `first` is pending.
            loop {
                let before = conn.in_flight.load(Ordering::Relaxed);
                tokio::task::yield_now().await;
                if conn.in_flight.load(Ordering::Relaxed) >= before {
                    break;
                }
            }
        }
        // Asks and bytes taken (what `written` gives back).
        let mut load = first.load();
        round.push(first, server);
        // Every op taken stays pending (the direct path stays shut) until written.
        let mut taken = 1;
        while round.out.len() < WRITE_BYTES && load.0 < ROUND {
            match ops.try_recv() {
                Ok(op) => {
                    let (a, b) = op.load();
                    (load.0, load.1) = (load.0 + a, load.1 + b);
                    round.push(op, server);
                    taken += 1;
                }
                Err(_) => break,
            }
        }
        round.close_line(server);
        if round.out.is_empty() {
            // Every get of this batch had been given up.
            conn.written(taken, load);
            continue;
        }
        let expects = std::mem::take(&mut round.expects);
        let weight = expects.iter().map(Expect::weight).sum();
        conn.in_flight.fetch_add(weight, Ordering::Relaxed);
        #[cfg(test)]
        server
            .counters
            .note_in_flight(conn.in_flight.load(Ordering::Relaxed));
        // `reserve` is cancel-safe: if the reader is gone, the batch is failed here, unwritten.
        let permit = tokio::select! {
            biased;
            _ = &mut *kill => Err(()),
            p = batches.reserve() => p.map_err(|_| ()),
        };
        let Ok(permit) = permit else {
            let e = link.poison(wire::closed(), false);
            expects.into_iter().for_each(|x| x.fail(&e, false));
            return;
        };
        // Stamped as its bytes go out: this round's deadline, whatever came before it.
        permit.send(Batch {
            sent: Instant::now(),
            expects,
        });
        #[cfg(test)]
        server.counters.note_write();
        tokio::select! {
            biased;
            _ = &mut *kill => return,
            r = write_all(&wr, &round.out) => {
                if let Err(e) = r {
                    link.poison(e.into(), true);
                    return;
                }
            }
        }
        conn.written(taken, load);
        round.out.clear();
        if round.out.capacity() > KEEP_BUFFER {
            round.out = Vec::new();
        }
    }
}

/// Writes all of `buf` through a write half the direct path shares (so by `&`, not
/// `AsyncWrite`). Cancel-safe as `write_all` is not: no byte is lost, but a cancelled write
/// may have written part of `buf` (the writer is cancelled only when the link is dead).
async fn write_all(wr: &OwnedWriteHalf, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        match wr.try_write(buf) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => wr.writable().await?,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// How the reader ended.
enum End {
    /// The writer is gone and every reply was read.
    Done,
    /// The connection is dead; every waiter left gets this error.
    Dead { error: Error, fault: bool },
}

/// Reads replies and answers their waiters, oldest first, until the writer is gone and nothing
/// is in flight, or the connection dies: a transport error, the server closing it, a reply the
/// parsers reject, or no whole reply to the oldest request within `io_timeout` of its write or
/// of the last whole reply, whichever is later.
///
/// Expectations are taken when their replies' bytes arrive, not when they are pushed: a push
/// wakes this task only when no deadline is armed (a lone caller's request costs no extra
/// wake-up while its reply is on its way). The armed deadline is some earlier request's
/// (pushed before, so due no later): when it fires, the expectations pushed meanwhile are taken
/// and the oldest one's deadline is armed.
async fn read_loop(
    link: Arc<Link>,
    mut rd: OwnedReadHalf,
    mut batches: mpsc::Receiver<Batch>,
    // Dropped when this returns: wakes the writer.
    _kill: oneshot::Sender<()>,
    // Dropped when the writer is gone (and with it the batches' senders).
    mut writer_done: oneshot::Receiver<()>,
) {
    let settings = link.server.options;
    let item_size = settings.item_size;
    let mut buf: Vec<u8> = Vec::with_capacity(READ_CHUNK);
    let mut start = 0;
    let mut in_flight: VecDeque<(Instant, Expect)> = VecDeque::new();
    let mut writer_gone = false;
    let mut told_done = false;
    // Armed (`armed`) at the oldest request's deadline when it is taken; re-armed only when it
    // fires, so the hot path sets no timer per reply.
    let sleep = tokio::time::sleep(settings.io_timeout);
    tokio::pin!(sleep);
    let mut armed = false;
    // When the last whole reply was answered: the oldest request's deadline counts from its
    // write or from this, whichever is later, so a round written while the one before it was
    // still being answered gets its own io_timeout (a slow link's rounds each have one, as the
    // pool's do), and a server that stops answering fails everything within one.
    let mut progress = Instant::now();
    // The `VALUE` lines of the front `gets` reply, as its framing found them: kept while the
    // reply is not whole, so that each read frames only what it brought.
    let mut values = Vec::new();
    let end = 'conn: loop {
        // The writer pushes a batch before writing it, so the expectation of every byte read
        // so far is here or in the channel: all of it is taken before any byte is judged
        // (bytes beyond what is taken would be declared unasked for). The writer's
        // backpressure bounds how much that is.
        if !writer_gone {
            writer_gone = take_all(&mut batches, &mut in_flight);
        }
        let mut answered = false;
        while let Some((_, front)) = in_flight.front() {
            let at_hand = &buf[start..];
            let whole = match front {
                // Framed once: the parser reads the values where the framing found them.
                Expect::Gets { keys, .. } => wire::frame_gets(at_hand, keys.len(), &mut values),
                Expect::Cmd { .. } => wire::reply_len(front.shape(), at_hand),
            };
            let Some(n) = whole else {
                break;
            };
            let Some((_, expect)) = in_flight.pop_front() else {
                break;
            };
            // Before answering: a caller woken by this reply that queues its next op must find
            // the connection idle (no batching turn for a lone caller).
            link.conn.answered(expect.weight());
            let reply = &buf[start..start + n];
            start += n;
            answered = true;
            let answered_one = answer(expect, reply, &values, item_size, &link.server);
            // The next reply is framed from its start.
            values.clear();
            if let Err((error, fault)) = answered_one {
                break 'conn End::Dead { error, fault };
            }
        }
        if answered {
            // The time of this reply counts only for a request still unanswered (taken, or
            // pushed and not yet taken); one pushed later counts from its own write, which is
            // later. A reader that answered everything reads no clock (a lone caller's get).
            if !in_flight.is_empty() || !batches.is_empty() {
                progress = Instant::now();
            }
            link.server.health.answered(link.probe);
        }
        if start == buf.len() {
            buf.clear();
            start = 0;
            if buf.capacity() > KEEP_BUFFER {
                buf = Vec::with_capacity(READ_CHUNK);
            }
        } else if start > buf.len() - start {
            buf.drain(..start);
            start = 0;
        }
        match in_flight.front() {
            None if writer_gone => {
                if let Some(error) = link.dead.lock().clone() {
                    break End::Dead {
                        error,
                        fault: false,
                    };
                }
                break End::Done;
            }
            // Every expectation pushed before these bytes were read was taken above.
            None if start < buf.len() => {
                break End::Dead {
                    error: wire::protocol_error("the server sent bytes no request asked for"),
                    fault: true,
                };
            }
            Some((_, front)) if buf.len() - start > front.reply_bound(item_size) => {
                break End::Dead {
                    error: wire::protocol_error("a reply larger than any valid one"),
                    fault: true,
                };
            }
            _ => {}
        }
        if writer_gone && link.dead.lock().is_some() {
            // The writer died: what is in flight will not all be answered.
            break End::Dead {
                error: wire::closed(),
                fault: false,
            };
        }
        if buf.capacity() - buf.len() < READ_CHUNK / 4 {
            buf.reserve(READ_CHUNK);
        }
        if !armed {
            if let Some((sent, _)) = in_flight.front() {
                sleep
                    .as_mut()
                    .reset(((*sent).max(progress) + settings.io_timeout).into());
                armed = true;
            }
        }
        tokio::select! {
            biased;
            r = rd.read_buf(&mut buf) => match r {
                Ok(0) => break eof(&mut in_flight),
                #[cfg(test)]
                Ok(n) => link.server.counters.note_read(n),
                #[cfg(not(test))]
                Ok(_) => {}
                Err(e) => break End::Dead { error: e.into(), fault: true },
            },
            // Nothing in flight, no deadline armed: the next push must wake this task.
            b = batches.recv(), if !armed && !writer_gone => match b {
                Some(b) => in_flight.extend(b.expects.into_iter().map(|x| (b.sent, x))),
                None => writer_gone = true,
            },
            _ = &mut writer_done, if !told_done => told_done = true,
            () = &mut sleep, if armed => {
                armed = false;
                let late = in_flight
                    .front()
                    .is_some_and(|(sent, _)| (*sent).max(progress).elapsed() >= settings.io_timeout);
                if late {
                    break End::Dead {
                        error: Error::new(
                            ErrorKind::Timeout,
                            format!("no reply within io_timeout ({:?})", settings.io_timeout),
                        ),
                        fault: true,
                    };
                }
            },
        }
    };
    if let End::Dead { error, fault } = end {
        let e = link.poison(error, fault);
        batches.close();
        while let Ok(b) = batches.try_recv() {
            in_flight.extend(b.expects.into_iter().map(|x| (b.sent, x)));
        }
        for (_, x) in in_flight {
            x.fail(&e, true);
        }
    }
}

/// Moves every batch the channel holds to `in_flight`, in order; whether the writer is gone (the
/// channel closed and empty).
fn take_all(
    batches: &mut mpsc::Receiver<Batch>,
    in_flight: &mut VecDeque<(Instant, Expect)>,
) -> bool {
    loop {
        match batches.try_recv() {
            Ok(b) => in_flight.extend(b.expects.into_iter().map(|x| (b.sent, x))),
            Err(TryRecvError::Empty) => return false,
            Err(TryRecvError::Disconnected) => return true,
        }
    }
}

/// The server closed the connection. Nothing in flight: it closed an idle connection (a
/// restart, an idle timeout), not a fault. A `flush_all` in flight: a proxy (twemproxy) that
/// does not support it, answered as such.
fn eof(in_flight: &mut VecDeque<(Instant, Expect)>) -> End {
    let flush = matches!(
        in_flight.front(),
        Some((
            _,
            Expect::Cmd {
                parse: Parse::FlushAll,
                ..
            }
        ))
    );
    if flush {
        if let Some((_, Expect::Cmd { reply, .. })) = in_flight.pop_front() {
            let _ = reply.send(Err(Error::with_source(
                ErrorKind::Unsupported,
                "the server closed the connection on flush_all \
                 (a proxy such as twemproxy does not support it)",
                wire::closed(),
            )));
        }
    }
    End::Dead {
        error: wire::closed(),
        fault: !flush && !in_flight.is_empty(),
    }
}

/// Parses one whole reply (a `gets` reply's `VALUE` lines are `values`, as its framing found
/// them) and answers its waiters. `Err` when the connection cannot go on: the error, and
/// whether it is a transport fault (an unparseable reply) rather than a complete error reply
/// after which memcached may be out of step.
fn answer(
    expect: Expect,
    reply: &[u8],
    values: &[ValueAt],
    item_size: usize,
    server: &Server,
) -> std::result::Result<(), (Error, bool)> {
    let mut r = reply;
    // The parsers must consume exactly what reply_len called whole.
    let whole = |r: &[u8]| {
        if r.is_empty() {
            Ok(())
        } else {
            Err(wire::protocol_error("a reply with trailing bytes"))
        }
    };
    let fatal = |e: &Error| -> std::result::Result<(), (Error, bool)> {
        if wire::leaves_connection_usable(e) {
            Ok(())
        } else {
            Err((e.clone(), !wire::is_server_reply(e)))
        }
    };
    match expect {
        Expect::Gets { keys, waiters } => {
            let mut slots: Slots = smallvec![Ok(None); keys.len()];
            match wire::read_framed(reply, values, item_size, &keys, &mut slots) {
                Ok(()) => {
                    #[cfg(test)]
                    server
                        .counters
                        .note_orphans(waiters.iter().filter(|w| w.reply.is_closed()).count());
                    distribute(slots, waiters);
                    Ok(())
                }
                Err(e) => {
                    let shown = server.annotate(e.clone());
                    for w in waiters {
                        let _ = w.reply.send(smallvec![Err(shown.clone()); w.at.len()]);
                    }
                    fatal(&e)
                }
            }
        }
        Expect::Cmd { parse, reply } => {
            let parsed = match parse {
                Parse::Store => wire::read_store(&mut r).map(Reply::Store),
                Parse::StoreThenGet(key) => store_then_get(&mut r, &key, item_size),
                Parse::Delete => wire::read_delete(&mut r).map(Reply::Found),
                Parse::Touch => wire::read_touch(&mut r).map(Reply::Found),
                Parse::Arith => wire::read_arith(&mut r).map(Reply::Counter),
                Parse::FlushAll => wire::read_ok(&mut r).map(|()| Reply::Done),
            }
            .and_then(|x| whole(r).map(|()| x));
            let verdict = parsed.as_ref().err().map_or(Ok(()), fatal);
            let _ = reply.send(parsed.map_err(|e| server.annotate(e)));
            verdict
        }
    }
}

/// A store's reply, then the read-back's (as the blocking connection reads them): an error
/// reply to the store that leaves the connection in step still has the read's reply behind it.
fn store_then_get(r: &mut &[u8], key: &str, item_size: usize) -> Result<Reply> {
    let stored = match wire::read_store(r) {
        Err(e) if !wire::leaves_connection_usable(&e) => return Err(e),
        other => other,
    };
    let mut out = [Ok(None)];
    wire::read_slots(r, item_size, &[key], &mut out)?;
    let [item] = out;
    Ok(Reply::StoreThenGet(stored?, item?))
}

/// Hands each waiter its keys' slots: moved on a key's last use, cloned before (a key two
/// callers asked for).
fn distribute(mut slots: Slots, waiters: SmallVec<[Waiter; 1]>) {
    if let [w] = &waiters[..] {
        if w.at.len() == slots.len() && w.at.iter().enumerate().all(|(i, &a)| a as usize == i) {
            if let Some(w) = waiters.into_iter().next() {
                let _ = w.reply.send(slots);
            }
            return;
        }
    }
    let mut uses = vec![0u32; slots.len()];
    for w in &waiters {
        for &a in &w.at {
            uses[a as usize] += 1;
        }
    }
    for w in waiters {
        let mine =
            w.at.iter()
                .map(|&a| {
                    let a = a as usize;
                    uses[a] -= 1;
                    if uses[a] == 0 {
                        std::mem::replace(&mut slots[a], Ok(None))
                    } else {
                        slots[a].clone()
                    }
                })
                .collect();
        let _ = w.reply.send(mine);
    }
}
