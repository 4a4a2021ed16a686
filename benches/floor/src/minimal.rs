//! A minimal client of the 64-task path (a fourth side of `--path async-get-64`): what a
//! client that batches the 64 callers' gets as the ceiling does, and does nothing else but
//! what every get through the public API must, would reach on this machine.
//!
//! Each get of a caller task:
//! - does the facade's own work of that get: `AsyncCache::get` of the same item on a
//!   memory-backend cache (key derivation, decode, herd verdict, and a memory lookup the real
//!   path does not make);
//! - queues the derived key for the one batcher and awaits its value's length on a oneshot (the
//!   wake-up of the caller that 64 tasks, each waiting on its own reply, cannot avoid).
//!
//! The batcher, a task on the same runtime with a bare socket (nodelay), writes what is queued
//! as `get` lines of at most [`KEYS`] keys, [`DEPTH`] lines in flight (the ceiling's fastest
//! shape), reads each reply whole, answers its callers in order, and then yields a scheduler turn
//! so that the callers it woke queue their next gets before it writes again. Like the ceiling it
//! sends `get`, not `gets`, and does not merge a line's repeated keys. It has none of the real
//! client's other duties (cancellation safety, failures, health, commands other than `get`).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{Notify, oneshot};

use crate::items::{BoxError, Items, Value};
use crate::paths::Getter;

/// Keys a line at most.
pub const KEYS: usize = 16;
/// Lines in flight at most.
pub const DEPTH: usize = 4;
/// How long the batcher waits for a reply's bytes (a key missing would leave it short).
const REPLY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// A queued get: its key's index, where its value's length goes.
type Queued = (usize, oneshot::Sender<usize>);

/// What the callers and the batcher share: the queued gets, the batcher's wake-up, the stop.
#[derive(Default)]
pub struct Shared {
    queue: Mutex<VecDeque<Queued>>,
    notify: Notify,
    stop: AtomicBool,
}

impl Shared {
    fn take(&self, n: usize) -> Vec<Queued> {
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        let n = n.min(q.len());
        q.drain(..n).collect()
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
        self.shared
            .queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back((i, tx));
        self.shared.notify.notify_one();
        match rx.await {
            Ok(len) if len == self.items.stored_lens[i] => Ok(()),
            Ok(len) => Err(format!("{len} bytes under key {i}").into()),
            Err(_) => Err("the batcher ended without answering".into()),
        }
    }
}

/// The facade's work alone: `AsyncCache::get` on the memory-backend cache, no I/O (its future
/// is ready at once: no wake-up either). What the minimal client adds to it is its I/O and the
/// wake-up of its callers.
pub struct FacadeGetter {
    pub memory: newcache::AsyncCache,
    pub items: Arc<Items>,
}

impl Getter for FacadeGetter {
    async fn get(&mut self, i: usize) -> Result<(), BoxError> {
        Value::check(self.memory.get::<Value>(&self.items.user[i]).await?, i)
    }
}

/// The batcher's socket and buffers, kept across runs.
pub struct Batcher {
    stream: tokio::net::TcpStream,
    buf: Vec<u8>,
    line: Vec<u8>,
}

/// The byte length of each value in a whole `get` reply, in order, or `None` if it is not one.
fn value_lens(reply: &[u8]) -> Option<Vec<usize>> {
    let (mut at, mut lens) = (0, Vec::with_capacity(KEYS));
    while reply.get(at..)?.starts_with(b"VALUE ") {
        let eol = at + reply[at..].iter().position(|&b| b == b'\n')?;
        let header = reply[at..eol].strip_suffix(b"\r")?;
        let bytes = header.rsplit(|&b| b == b' ').next()?;
        let bytes: usize = std::str::from_utf8(bytes).ok()?.parse().ok()?;
        at = eol + 1 + bytes;
        if reply.get(at..at + 2)? != b"\r\n" {
            return None;
        }
        at += 2;
        lens.push(bytes);
    }
    (reply.get(at..)? == b"END\r\n").then_some(lens)
}

impl Batcher {
    pub async fn connect(addr: &str) -> Result<Batcher, BoxError> {
        let stream = tokio::net::TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(Batcher {
            stream,
            buf: vec![0; 256 * 1024],
            line: Vec::with_capacity(16 * 1024),
        })
    }

    /// Serves `shared`'s queue until its stop is set and nothing is queued or in flight.
    pub async fn run(&mut self, shared: &Shared, items: &Items) -> Result<(), BoxError> {
        // Each line in flight: its callers (in key order) and its whole reply's length.
        let mut in_flight: VecDeque<(Vec<Queued>, usize)> = VecDeque::with_capacity(DEPTH);
        let mut have = 0;
        loop {
            while in_flight.len() < DEPTH {
                let taken = shared.take(KEYS);
                if taken.is_empty() {
                    break;
                }
                self.line.clear();
                self.line.extend_from_slice(b"get");
                let mut len = 5;
                for (i, _) in &taken {
                    self.line.push(b' ');
                    self.line.extend_from_slice(items.derived[*i].as_bytes());
                    len += items.reply_lens[*i] - 5;
                }
                self.line.extend_from_slice(b"\r\n");
                self.stream.write_all(&self.line).await?;
                in_flight.push_back((taken, len));
            }
            if in_flight.is_empty() {
                if shared.stop.load(Ordering::Acquire) {
                    return Ok(());
                }
                shared.notify.notified().await;
                continue;
            }
            let room = in_flight.len() < DEPTH;
            tokio::select! {
                biased;
                r = tokio::time::timeout(REPLY_TIMEOUT, self.stream.read(&mut self.buf[have..])) => match r.map_err(|_| "no reply in time")?? {
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
                let lens = value_lens(&self.buf[..len])
                    .filter(|l| l.len() == callers.len())
                    .ok_or("a line's reply is not one value a key")?;
                for ((_, tx), n) in callers.into_iter().zip(lens) {
                    let _ = tx.send(n);
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
}

/// Runs `getters` (`per_task` gets each) beside a batcher on `batcher`'s socket; returns both
/// back with the run.
pub async fn run(
    mut batcher: Batcher,
    getters: Vec<MinimalGetter>,
    per_task: usize,
) -> Result<(Batcher, Vec<MinimalGetter>, crate::paths::Run), BoxError> {
    let shared = Arc::clone(&getters[0].shared);
    let items = Arc::clone(&getters[0].items);
    shared.stop.store(false, Ordering::Release);
    let served = {
        let shared = Arc::clone(&shared);
        tokio::spawn(async move {
            let r = batcher.run(&shared, &items).await;
            (batcher, r)
        })
    };
    let ran = crate::paths::run_tasks(getters, per_task).await;
    // Its callers are done (or gave up): what is in flight is read, then it ends.
    shared.stop.store(true, Ordering::Release);
    shared.notify.notify_one();
    let (batcher, served) = served.await?;
    let (getters, run) = ran?;
    served?;
    Ok((batcher, getters, run))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_get_reply_gives_each_values_length() {
        let two = b"VALUE a 0 3\r\nabc\r\nVALUE b 1 0\r\n\r\nEND\r\n";
        assert_eq!(value_lens(two), Some(vec![3, 0]));
        assert_eq!(value_lens(b"END\r\n"), Some(vec![]));
        assert_eq!(value_lens(&two[..two.len() - 1]), None, "cut short");
        assert_eq!(value_lens(b"VALUE a 0 9\r\nabc\r\nEND\r\n"), None);
    }
}
