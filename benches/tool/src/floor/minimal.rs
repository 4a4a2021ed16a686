//! A minimal client of the 64-task path (a side of `--path async-get-64`): one design of
//! a client whose callers are 64 tasks, each awaiting its own reply and doing the facade's work
//! of its get, that batches their gets as the ceiling does and does little else.
//!
//! Each get of a caller task:
//! - does the facade's own work of that get: `AsyncCache::get` of the same item on a
//!   memory-backend cache (key derivation, decode, herd verdict, and a memory lookup the real
//!   path does not make);
//! - queues the derived key for its batcher and awaits its value's length on a oneshot: one
//!   wake-up of the caller a get.
//!
//! Its shape is `--minimal SxDxK` (2x4x16 by default): S batchers, each serving every Sth
//! caller (2: as many as newcache opens connections to a server by default,
//! `async_connections`). Each is a task on the same runtime with a bare socket (nodelay), or
//! with `--minimal-split` two tasks, a writer and a reader ([`Batcher::run_split`]). It writes
//! what is queued as `get` lines of at most K keys, D lines in flight, reads each reply whole,
//! checks each value's key and answers its callers in order, then yields a scheduler turn so
//! that the callers it woke queue their next gets before it writes again. Like the ceiling it
//! sends `get`, not `gets` (but with `--gets`), and does not merge a line's repeated keys. It
//! has none of the real client's other duties (cancellation safety, failures, health, commands
//! other than `get`).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{Notify, oneshot};

use crate::floor::items::{BoxError, Items, Value};
use crate::floor::paths::{Getter, Shape};

/// How long the batcher waits for a reply's bytes (a key missing would leave it short).
const REPLY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// A queued get: its key's index, where its value's length goes (`None`: the reply's value
/// was under another key).
type Queued = (usize, oneshot::Sender<Option<usize>>);

/// Whether batchers on sockets run as two tasks each (`--minimal-split`).
pub static SPLIT: AtomicBool = AtomicBool::new(false);

/// The gets queued for the batcher; closed once it has ended (its callers then fail, not hang).
#[derive(Default)]
struct Queue {
    gets: VecDeque<Queued>,
    closed: bool,
}

/// What the callers and the batcher share: the queued gets, the batcher's wake-up, the stop.
#[derive(Default)]
pub struct Shared {
    queue: Mutex<Queue>,
    notify: Notify,
    stop: AtomicBool,
}

impl Shared {
    fn queue(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn take(&self, n: usize) -> Vec<Queued> {
        let mut q = self.queue();
        let n = n.min(q.gets.len());
        q.gets.drain(..n).collect()
    }

    /// The batcher ended: what is queued is dropped (its callers' oneshots close) and nothing
    /// more is queued.
    fn close(&self) {
        let mut q = self.queue();
        q.closed = true;
        q.gets.clear();
    }
}

/// Closes its queue when dropped: when its batcher's task ends, however it ends.
struct Closing(Arc<Shared>);

impl Drop for Closing {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// One caller task of the minimal client.
pub struct MinimalGetter {
    /// A memory-backend `AsyncCache` holding the same items (the facade's work of each get).
    pub memory: newcache::AsyncCache,
    pub items: Arc<Items>,
    pub shared: Arc<Shared>,
}

impl Getter for MinimalGetter {
    async fn get(&mut self, i: usize) -> Result<(), BoxError> {
        Value::check(self.memory.get::<Value>(&self.items.user[i]).await?, i)?;
        let (tx, rx) = oneshot::channel();
        {
            let mut q = self.shared.queue();
            if q.closed {
                return Err("the batcher has ended".into());
            }
            q.gets.push_back((i, tx));
        }
        self.shared.notify.notify_one();
        match rx.await {
            Ok(Some(len)) if len == self.items.stored_lens[i] => Ok(()),
            Ok(Some(len)) => Err(format!("{len} bytes under key {i}").into()),
            Ok(None) => Err(format!("a value under another key for key {i}").into()),
            Err(_) => Err("the batcher ended without answering".into()),
        }
    }
}

/// The batcher's socket and buffers, kept across runs; no socket: it answers each get at once
/// from its items ([`Batcher::without_socket`]).
pub struct Batcher {
    stream: Option<tokio::net::TcpStream>,
    /// Writes in this task and reads in a task of its own ([`Batcher::split`]).
    split: bool,
    /// Lines in flight at most.
    depth: usize,
    /// Keys a line at most.
    keys: usize,
    buf: Vec<u8>,
    line: Vec<u8>,
    /// Rounds answered, and gets answered in them (for the mean round).
    pub rounds: u64,
    pub answered: u64,
}

/// Writes into `line` the `get` (or `gets`) line of `taken`'s keys, and returns the length of
/// its whole reply.
fn line_of(line: &mut Vec<u8>, taken: &[Queued], items: &Items) -> usize {
    line.clear();
    let (command, reply_lens) = items.command();
    line.extend_from_slice(command);
    let mut len = 5;
    for (i, _) in taken {
        line.push(b' ');
        line.extend_from_slice(items.derived[*i].as_bytes());
        len += reply_lens[*i] - 5;
    }
    line.extend_from_slice(b"\r\n");
    len
}

/// The key and byte length of each value in a whole `get` reply, in order, or `None` if it is
/// not one.
fn values(reply: &[u8]) -> Option<Vec<(&[u8], usize)>> {
    let mut found = Vec::new();
    crate::floor::paths::each_value(reply, |key, len| found.push((key, len)))?;
    Some(found)
}

impl Batcher {
    /// A batcher on a socket to `addr`, with `shape`'s lines in flight and keys a line.
    pub async fn connect(addr: &str, shape: Shape) -> Result<Batcher, BoxError> {
        let stream = tokio::net::TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(Batcher {
            stream: Some(stream),
            split: SPLIT.load(Ordering::Relaxed),
            depth: shape.depth,
            keys: shape.keys,
            buf: vec![0; 256 * 1024],
            line: Vec::with_capacity(16 * 1024),
            rounds: 0,
            answered: 0,
        })
    }

    /// This batcher as two tasks, a writer and a reader ([`Batcher::run_split`]).
    #[cfg(test)]
    pub fn split(mut self) -> Batcher {
        self.split = true;
        self
    }

    /// A batcher with no socket: the minimal client without its socket I/O. It answers its
    /// callers at most a line's keys at a time, as a line's reply would, each with its item's
    /// stored length. While fewer than a line's keys are queued and the queue grew over the
    /// last scheduler turn, it yields another turn before answering, so that its rounds are not
    /// rounds of one. They need not match the socket's: 14 gets on average where the default
    /// shape's lines carry 11, 24-26 where 2x1x64's carry 27 (`benches/results/floor-64-tasks`).
    pub fn without_socket(shape: Shape) -> Batcher {
        Batcher {
            stream: None,
            split: false,
            depth: shape.depth,
            keys: shape.keys,
            buf: Vec::new(),
            line: Vec::new(),
            rounds: 0,
            answered: 0,
        }
    }

    /// Serves `shared`'s queue until its stop is set and nothing is queued or in flight.
    pub async fn run(&mut self, shared: &Shared, items: &Arc<Items>) -> Result<(), BoxError> {
        if self.stream.is_some() && self.split {
            return self.run_split(shared, items).await;
        }
        let Some(stream) = self.stream.as_mut() else {
            return self.answer_at_once(shared, items).await;
        };
        // Each line in flight: its callers (in key order) and its whole reply's length.
        let mut in_flight: VecDeque<(Vec<Queued>, usize)> = VecDeque::with_capacity(self.depth);
        let mut have = 0;
        loop {
            while in_flight.len() < self.depth {
                let taken = shared.take(self.keys);
                if taken.is_empty() {
                    break;
                }
                let len = line_of(&mut self.line, &taken, items);
                stream.write_all(&self.line).await?;
                in_flight.push_back((taken, len));
            }
            if in_flight.is_empty() {
                if shared.stop.load(Ordering::Acquire) {
                    return Ok(());
                }
                shared.notify.notified().await;
                continue;
            }
            let room = in_flight.len() < self.depth;
            tokio::select! {
                biased;
                r = tokio::time::timeout(REPLY_TIMEOUT, stream.read(&mut self.buf[have..])) => match r.map_err(|_| "no reply in time")?? {
                    0 => return Err("connection closed by the server".into()),
                    n => have += n,
                },
                () = shared.notify.notified(), if room => continue,
            }
            let mut answered = false;
            while let Some((_, len)) = in_flight.front() {
                let len = *len;
                if have < len {
                    if self.buf.len() < len {
                        self.buf.resize(len, 0);
                    }
                    break;
                }
                let Some((callers, _)) = in_flight.pop_front() else {
                    break;
                };
                let found = values(&self.buf[..len])
                    .filter(|l| l.len() == callers.len())
                    .ok_or("a line's reply is not one value a key")?;
                self.rounds += 1;
                self.answered += callers.len() as u64;
                for ((i, tx), (key, n)) in callers.into_iter().zip(found) {
                    let _ = tx.send((key == items.derived[i].as_bytes()).then_some(n));
                }
                self.buf.copy_within(len..have, 0);
                have -= len;
                answered = true;
            }
            if answered {
                tokio::task::yield_now().await;
            }
        }
    }

    /// The same batcher as two tasks: this one writes the lines, a reader task of its own reads
    /// the replies and answers the callers (newcache's shape: a writer and a reader task a
    /// connection). When it is a reply freeing room that wakes the writer, it yields a
    /// scheduler turn before it takes what is queued, as the one-task batcher does after
    /// answering; woken by a caller's get first, it writes at once.
    async fn run_split(&mut self, shared: &Shared, items: &Arc<Items>) -> Result<(), BoxError> {
        let stream = self.stream.take().ok_or("no socket")?;
        let (mut rd, mut wr) = stream.into_split();
        let (lines, mut to_read) = tokio::sync::mpsc::unbounded_channel::<(Vec<Queued>, usize)>();
        let room = Arc::new(Notify::new());
        let in_flight = Arc::new(AtomicUsize::new(0));
        let failed = Arc::new(AtomicBool::new(false));
        let reader = {
            let (room, in_flight, failed) = (room.clone(), in_flight.clone(), failed.clone());
            let items = Arc::clone(items);
            let mut buf = std::mem::take(&mut self.buf);
            tokio::spawn(async move {
                let (mut rounds, mut answered, mut have) = (0u64, 0u64, 0usize);
                let r: Result<(), BoxError> = async {
                    while let Some((callers, len)) = to_read.recv().await {
                        while have < len {
                            if buf.len() < len {
                                buf.resize(len, 0);
                            }
                            let read =
                                tokio::time::timeout(REPLY_TIMEOUT, rd.read(&mut buf[have..]));
                            match read.await.map_err(|_| "no reply in time")?? {
                                0 => return Err("connection closed by the server".into()),
                                n => have += n,
                            }
                        }
                        let found = values(&buf[..len])
                            .filter(|l| l.len() == callers.len())
                            .ok_or("a line's reply is not one value a key")?;
                        rounds += 1;
                        answered += callers.len() as u64;
                        for ((i, tx), (key, n)) in callers.into_iter().zip(found) {
                            let _ = tx.send((key == items.derived[i].as_bytes()).then_some(n));
                        }
                        buf.copy_within(len..have, 0);
                        have -= len;
                        in_flight.fetch_sub(1, Ordering::AcqRel);
                        room.notify_one();
                    }
                    Ok(())
                }
                .await;
                if r.is_err() {
                    failed.store(true, Ordering::Release);
                    room.notify_one();
                }
                (rd, buf, rounds, answered, r)
            })
        };
        let wrote: Result<(), BoxError> = async {
            loop {
                if failed.load(Ordering::Acquire) {
                    return Ok(());
                }
                while in_flight.load(Ordering::Acquire) < self.depth {
                    let taken = shared.take(self.keys);
                    if taken.is_empty() {
                        break;
                    }
                    let len = line_of(&mut self.line, &taken, items);
                    wr.write_all(&self.line).await?;
                    in_flight.fetch_add(1, Ordering::AcqRel);
                    lines
                        .send((taken, len))
                        .map_err(|_| "the reader has ended")?;
                }
                match in_flight.load(Ordering::Acquire) {
                    0 if shared.stop.load(Ordering::Acquire) => return Ok(()),
                    0 => shared.notify.notified().await,
                    n if n < self.depth => tokio::select! {
                        () = shared.notify.notified() => {}
                        () = room.notified() => tokio::task::yield_now().await,
                    },
                    _ => {
                        room.notified().await;
                        tokio::task::yield_now().await;
                    }
                }
            }
        }
        .await;
        drop(lines);
        let (rd, buf, rounds, answered, read) = reader.await?;
        self.buf = buf;
        self.rounds += rounds;
        self.answered += answered;
        self.stream = Some(rd.reunite(wr)?);
        read.and(wrote)
    }

    /// [`Batcher::without_socket`]'s loop.
    async fn answer_at_once(&mut self, shared: &Shared, items: &Items) -> Result<(), BoxError> {
        let mut seen = 0;
        loop {
            let queued = shared.queue().gets.len();
            if queued == 0 {
                if shared.stop.load(Ordering::Acquire) {
                    return Ok(());
                }
                seen = 0;
                shared.notify.notified().await;
                continue;
            }
            if queued < self.keys && queued > seen {
                // More may come: let the callers woken last queue theirs first.
                seen = queued;
                tokio::task::yield_now().await;
                continue;
            }
            seen = 0;
            let taken = shared.take(self.keys);
            self.rounds += 1;
            self.answered += taken.len() as u64;
            for (i, tx) in taken {
                let _ = tx.send(Some(items.stored_lens[i]));
            }
            tokio::task::yield_now().await;
        }
    }
}

/// Runs `getters` (`per_task` gets each) beside `batchers`, each serving the getters that share
/// its queue (in the order their queues first appear among the getters); returns both back with
/// the run.
pub async fn run(
    batchers: Vec<Batcher>,
    getters: Vec<MinimalGetter>,
    per_task: usize,
) -> Result<(Vec<Batcher>, Vec<MinimalGetter>, crate::floor::paths::Run), BoxError> {
    let mut shareds: Vec<Arc<Shared>> = Vec::new();
    for g in &getters {
        if !shareds.iter().any(|s| Arc::ptr_eq(s, &g.shared)) {
            shareds.push(Arc::clone(&g.shared));
        }
    }
    assert_eq!(batchers.len(), shareds.len(), "a batcher for each queue");
    let items = Arc::clone(&getters[0].items);
    let mut served = Vec::new();
    for (mut batcher, shared) in batchers.into_iter().zip(&shareds) {
        shared.stop.store(false, Ordering::Release);
        shared.queue().closed = false;
        let shared = Arc::clone(shared);
        let items = Arc::clone(&items);
        served.push(tokio::spawn(async move {
            // Ended (its stop, an error, or a panic): its callers fail rather than wait for it.
            let _closing = Closing(Arc::clone(&shared));
            let r = batcher.run(&shared, &items).await;
            (batcher, r)
        }));
    }
    let ran = crate::floor::paths::run_tasks(getters, per_task).await;
    for shared in &shareds {
        shared.stop.store(true, Ordering::Release);
        shared.notify.notify_one();
    }
    // Every batcher awaited, then the first error (a batcher's first: its callers' errors only
    // say that it ended).
    let mut batchers = Vec::new();
    let mut first_error: Option<BoxError> = None;
    for s in served {
        match s.await {
            Ok((b, r)) => {
                batchers.push(b);
                if let Err(e) = r {
                    first_error.get_or_insert(e);
                }
            }
            Err(e) => {
                first_error.get_or_insert(e.into());
            }
        }
    }
    if let Some(e) = first_error {
        return Err(e);
    }
    let (getters, run) = ran?;
    Ok((batchers, getters, run))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::floor::items::{FLAVOR, TTL, VERSION};
    use std::time::Duration;

    /// A memory-backend cache holding every hot key the callers draw from, and their items
    /// (made-up derived keys; a stored length of its own for each key: 100 + its index).
    async fn memory_and_items() -> (newcache::AsyncCache, Arc<Items>) {
        let memory = newcache::Cache::builder()
            .flavor(FLAVOR)
            .version(VERSION)
            .in_memory()
            .build_async()
            .unwrap();
        // Every hot key the callers draw from.
        let n = crate::floor::paths::KEYS;
        let user: Vec<String> = (0..n).map(|i| format!("k{i}")).collect();
        for (i, k) in user.iter().enumerate() {
            memory.set(k, &Value::new(i), TTL).await.unwrap();
        }
        let items = Arc::new(Items {
            derived: (0..n).map(|i| format!("d{i}")).collect(),
            user,
            requests: Vec::new(),
            reply_lens: (0..n).map(reply_len).collect(),
            gets_reply_lens: (0..n).map(reply_len).collect(),
            stored_lens: (0..n).map(|i| 100 + i).collect(),
            value_lens: vec![100; n],
        });
        (memory, items)
    }

    /// `n` callers of the minimal client sharing one queue.
    fn callers(n: usize, memory: &newcache::AsyncCache, items: &Arc<Items>) -> Vec<MinimalGetter> {
        let shared = Arc::new(Shared::default());
        (0..n)
            .map(|_| MinimalGetter {
                memory: memory.clone(),
                items: Arc::clone(items),
                shared: Arc::clone(&shared),
            })
            .collect()
    }

    #[test]
    fn a_batcher_without_socket_answers_every_caller_with_its_own_item_in_lines() {
        // On a current-thread runtime the callers woken by a round queue their next gets before
        // the batcher, which yields after each round, takes the next: rounds of a whole line.
        // On the multi-thread runtime it is the batcher's turns (after each round, and while
        // the queue grows) that keep them from being rounds of one or two (with neither: about
        // 1.2 gets a round).
        for multi in [false, true] {
            let rt = crate::floor::paths::runtime(multi).unwrap();
            rt.block_on(async {
                let (memory, items) = memory_and_items().await;
                let getters = callers(32, &memory, &items);
                // The socketless batcher has no lines in flight: `depth` is not read.
                let shape = Shape {
                    sockets: 1,
                    depth: 1,
                    keys: 16,
                };
                let ran = tokio::time::timeout(
                    Duration::from_secs(30),
                    run(vec![Batcher::without_socket(shape)], getters, 100),
                )
                .await
                .expect("the run ends");
                // Each caller checks the length it is given against its own key's (each key's
                // is its own): a length of another key fails the run.
                let (batchers, _, _) = ran.expect("every get answered with its own item's length");
                let b = &batchers[0];
                assert_eq!(b.answered, 32 * 100);
                assert!(b.rounds >= 3200 / 16, "no round over a line's keys");
                // Multi-thread, the batcher's turns give 11-16 a round on an idle machine and 3.7
                // at the least seen with another test run beside it; without them, 1.2.
                let least = if multi { 2 } else { 8 };
                assert!(
                    b.answered >= least * b.rounds,
                    "{} gets in {} rounds (multi-thread: {multi}): lines are filled",
                    b.answered,
                    b.rounds
                );
            });
        }
    }

    /// The whole `get` reply to key `i` of [`memory_and_items`] from [`serve_gets`].
    fn reply_len(i: usize) -> usize {
        let n = 100 + i;
        format!("VALUE d{i} 0 {n}\r\n").len() + n + 2 + "END\r\n".len()
    }

    /// A stand-in memcached on a free port that answers each `get` line of
    /// [`memory_and_items`]'s derived keys (`d{i}`) with their values (100 + i bytes each).
    async fn serve_gets() -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    // Each reply in two writes 200 us apart, so that a reader sees it in pieces.
                    s.set_nodelay(true).unwrap();
                    let (rd, mut wr) = s.into_split();
                    let mut lines = tokio::io::BufReader::new(rd);
                    let mut line = String::new();
                    while tokio::io::AsyncBufReadExt::read_line(&mut lines, &mut line)
                        .await
                        .is_ok_and(|n| n > 0)
                    {
                        let mut reply = Vec::new();
                        for key in line.trim_end().split(' ').skip(1) {
                            let n = 100 + key[1..].parse::<usize>().unwrap();
                            reply.extend_from_slice(format!("VALUE {key} 0 {n}\r\n").as_bytes());
                            reply.resize(reply.len() + n, b'v');
                            reply.extend_from_slice(b"\r\n");
                        }
                        reply.extend_from_slice(b"END\r\n");
                        line.clear();
                        let (first, rest) = reply.split_at(reply.len() / 2);
                        if wr.write_all(first).await.is_err() {
                            break;
                        }
                        tokio::time::sleep(Duration::from_micros(200)).await;
                        if wr.write_all(rest).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        addr
    }

    /// `callers` callers doing 100 gets each through one batcher on `addr` with `depth` lines
    /// of 16 in flight, split in two tasks or not; fails the test if the run does not end.
    async fn run_on(
        addr: &str,
        (callers_n, depth, split): (usize, usize, bool),
        memory: &newcache::AsyncCache,
        items: &Arc<Items>,
    ) -> Result<(Vec<Batcher>, Vec<MinimalGetter>, crate::floor::paths::Run), BoxError> {
        let shape = Shape {
            sockets: 1,
            depth,
            keys: 16,
        };
        let mut batcher = Batcher::connect(addr, shape).await.unwrap();
        if split {
            batcher = batcher.split();
        }
        let getters = callers(callers_n, memory, items);
        tokio::time::timeout(Duration::from_secs(30), run(vec![batcher], getters, 100))
            .await
            .expect("the run ends (no caller left waiting)")
    }

    #[test]
    fn a_batcher_answers_every_caller_with_its_own_value_in_one_task_or_two() {
        let rt = crate::floor::paths::runtime(true).unwrap();
        rt.block_on(async {
            let addr = serve_gets().await;
            let (memory, items) = memory_and_items().await;
            for split in [false, true] {
                let ran = run_on(&addr, (32, 4, split), &memory, &items).await;
                // Each caller checks the length it is given against its own key's.
                let (batchers, _, _) = ran.expect("every get answered with its own value");
                assert_eq!(batchers[0].answered, 32 * 100, "split: {split}");
                assert!(
                    batchers[0].stream.is_some(),
                    "the socket is kept for the next run"
                );
            }
        });
    }

    #[test]
    fn a_batcher_that_fails_fails_its_callers_rather_than_leaving_them_waiting() {
        let rt = crate::floor::paths::runtime(true).unwrap();
        rt.block_on(async {
            // A server that answers every line with bytes that are no `get` reply.
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap().to_string();
            tokio::spawn(async move {
                while let Ok((mut s, _)) = listener.accept().await {
                    tokio::spawn(async move {
                        let mut buf = vec![0; 64 * 1024];
                        while let Ok(1..) = s.read(&mut buf).await {
                            if s.write_all(&[b'x'; 8 * 1024]).await.is_err() {
                                break;
                            }
                        }
                    });
                }
            });
            let (memory, items) = memory_and_items().await;
            // Split with one line in flight: the writer waits on the reader's wake with nothing
            // else to wake it, so a reader that fails without waking it hangs the run.
            for (split, depth) in [(false, 4), (true, 4), (true, 1)] {
                let ran = run_on(&addr, (8, depth, split), &memory, &items).await;
                let e = ran
                    .err()
                    .expect("a failed batcher fails the run")
                    .to_string();
                assert!(e.contains("not one value a key"), "split: {split}: {e}");
            }
        });
    }

    #[test]
    fn a_get_reply_gives_each_values_key_and_length() {
        let two = b"VALUE a 0 3\r\nabc\r\nVALUE bc 1 0\r\n\r\nEND\r\n";
        assert_eq!(values(two), Some(vec![(&b"a"[..], 3), (&b"bc"[..], 0)]));
        assert_eq!(values(b"END\r\n"), Some(vec![]));
        assert_eq!(values(&two[..two.len() - 1]), None, "cut short");
        assert_eq!(values(b"VALUE a 0 9\r\nabc\r\nEND\r\n"), None);
    }
}
