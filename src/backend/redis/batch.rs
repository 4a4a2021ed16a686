//! Auto-batching of the async connection's plain reads: `GET`s that callers make while another
//! read is on the wire go out together as one `MGET`, its replies matched to the callers by
//! position (what the memcached engine does with its `gets` lines). The server's per-command
//! cost is what caps throughput when client and server share a few cores; one `MGET` of 30 keys
//! costs it about what one `GET` does.
//!
//! A lone caller pays nothing for it: while no read is on the wire a caller sends its own `GET`.
//! Otherwise it queues its key for the batcher, a task beside the connection's driver, which
//! takes everything queued (the callers ready to run first queue theirs: it yields once) and
//! sends it as one `MGET`, up to [`FLIGHTS`] of them at a time. Each caller awaits its own
//! answer, so a caller's future dropped at any point takes nothing from the others: its key's
//! answer is dropped with its channel, and the connection (redis-rs's multiplexer) pairs every
//! reply with its command regardless. A failed `MGET` (a timeout, a dropped connection, an
//! error reply) fails each of its callers with the same error.
//!
//! An `MGET` reads a key that holds another type (a list, a hash) as missing, where `GET`
//! refuses it with `WRONGTYPE`: a batched read of such a key is a miss, as `get_many`'s is.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{RedisError, RedisResult, Value};
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio::task::JoinHandle;

/// `MGET`s on the wire at a time: the next batches gather and go while earlier ones are
/// answered. Two in flight leave many tasks' reads queued behind one round trip (a high p99);
/// past eight, more in flight no longer shortens the wait.
const FLIGHTS: usize = 8;
/// Keys per `MGET` at most.
const KEYS: usize = 512;

/// A queued read: its key and where its answer goes.
struct Waiter {
    key: Vec<u8>,
    answer: oneshot::Sender<RedisResult<Value>>,
}

/// The batcher of one connection: its queue and its task.
pub(super) struct Gets {
    queue: mpsc::UnboundedSender<Waiter>,
    /// Reads on the wire: lone `GET`s and `MGET`s.
    busy: Arc<AtomicUsize>,
    /// How long a queued caller on another runtime waits for its answer at most (see
    /// [`Gets::get`]).
    wait: Duration,
    /// The runtime its task runs on.
    runtime: tokio::runtime::Id,
    task: JoinHandle<()>,
}

impl Gets {
    /// The batcher of `conn`, its task spawned on `rt`; each `MGET` answered within
    /// `io_timeout` (the connection's response timeout).
    pub(super) fn start(
        rt: &tokio::runtime::Handle,
        conn: MultiplexedConnection,
        io_timeout: Duration,
    ) -> Gets {
        let (queue, rx) = mpsc::unbounded_channel();
        let busy = Arc::new(AtomicUsize::new(0));
        let task = rt.spawn(batcher(rx, conn, Arc::clone(&busy)));
        // A queued key waits for a flight to land (an `io_timeout` at most: the flights are on
        // the wire together) and for its own `MGET` (another).
        let wait = io_timeout.saturating_mul(2);
        Gets {
            queue,
            busy,
            wait,
            runtime: rt.id(),
            task,
        }
    }

    /// Whether its task ended (its runtime shut down).
    pub(super) fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// The reply to `get`, a `GET key`: sent on `conn` at once while no read is on the wire,
    /// else its key queued for the next `MGET`.
    ///
    /// A queued caller on another runtime than the batcher's waits two `io_timeout`s
    /// at most (then fails with a timeout): the batcher's task runs on the runtime that opened
    /// the connection, which may be alive but no longer driven. A caller on the batcher's own
    /// runtime needs no timer of its own: that runtime is driven while the caller is polled,
    /// and each `MGET` ends within the connection's response timeout (`io_timeout`), so its
    /// answer comes within two of them (a flight landing, then its own).
    pub(super) async fn get(
        &self,
        conn: &mut MultiplexedConnection,
        get: &redis::Cmd,
    ) -> RedisResult<Value> {
        let key = match get.args_iter().nth(1) {
            Some(redis::Arg::Simple(key)) if self.busy.load(Ordering::Acquire) != 0 => key,
            _ => return alone(conn, &self.busy, get).await,
        };
        let (answer, rx) = oneshot::channel();
        let queued = self.queue.send(Waiter {
            key: key.to_vec(),
            answer,
        });
        if queued.is_err() {
            return alone(conn, &self.busy, get).await;
        }
        let here = tokio::runtime::Handle::try_current().is_ok_and(|h| h.id() == self.runtime);
        let answered = match here {
            true => rx.await,
            false => match tokio::time::timeout(self.wait, rx).await {
                Ok(answered) => answered,
                Err(_) => {
                    return Err(RedisError::from(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "a batched GET was not answered in time (the connection's runtime is \
                         not driven, or the server did not answer)",
                    )));
                }
            },
        };
        match answered {
            Ok(r) => r,
            // The batcher is gone (its runtime shut down): the connection's own send says what
            // became of it.
            Err(_) => alone(conn, &self.busy, get).await,
        }
    }
}

impl Drop for Gets {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Counts a read on the wire for as long as it lives (a dropped future included).
struct OnWire(Arc<AtomicUsize>);

impl OnWire {
    fn enter(busy: &Arc<AtomicUsize>) -> OnWire {
        busy.fetch_add(1, Ordering::AcqRel);
        OnWire(Arc::clone(busy))
    }
}

impl Drop for OnWire {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A caller's own `GET`.
async fn alone(
    conn: &mut MultiplexedConnection,
    busy: &Arc<AtomicUsize>,
    get: &redis::Cmd,
) -> RedisResult<Value> {
    let _on = OnWire::enter(busy);
    conn.send_packed_command(get).await
}

/// Takes what is queued and sends it as `MGET`s, [`FLIGHTS`] at a time; ends when the
/// connection (every sender) is gone.
async fn batcher(
    mut rx: mpsc::UnboundedReceiver<Waiter>,
    conn: MultiplexedConnection,
    busy: Arc<AtomicUsize>,
) {
    let flights = Arc::new(Semaphore::new(FLIGHTS));
    while let Some(first) = rx.recv().await {
        let Ok(permit) = Arc::clone(&flights).acquire_owned().await else {
            return;
        };
        // The callers ready to run queue theirs first.
        tokio::task::yield_now().await;
        let mut batch = vec![first];
        while batch.len() < KEYS {
            match rx.try_recv() {
                Ok(w) => batch.push(w),
                Err(_) => break,
            }
        }
        // Callers that gave up while queued are not asked for.
        batch.retain(|w| !w.answer.is_closed());
        if batch.is_empty() {
            continue;
        }
        let on = OnWire::enter(&busy);
        let mut conn = conn.clone();
        tokio::spawn(async move {
            let _held = (permit, on);
            flight(&mut conn, batch).await;
        });
    }
}

/// One `MGET` of `batch`'s keys; each caller gets the reply in its position.
async fn flight(conn: &mut MultiplexedConnection, batch: Vec<Waiter>) {
    // Sized for its arguments: no regrowth per key.
    let bytes = batch.iter().map(|w| w.key.len()).sum::<usize>();
    let mut cmd = redis::Cmd::with_capacity(batch.len() + 1, 4 + bytes);
    cmd.arg("MGET");
    for w in &batch {
        cmd.arg(&w.key[..]);
    }
    let reply = conn.send_packed_command(&cmd).await;
    // A user allowed `GET` but not `MGET`: each key gets the `GET` its caller asked for.
    let no_mget = match &reply {
        Ok(Value::ServerError(e)) => e.code() == "NOPERM",
        Err(e) => e.code() == Some("NOPERM"),
        Ok(_) => false,
    };
    if no_mget {
        return each(conn, batch).await;
    }
    match reply {
        Ok(Value::Array(values)) if values.len() == batch.len() => {
            for (w, v) in batch.into_iter().zip(values) {
                let _ = w.answer.send(Ok(v));
            }
        }
        // An error reply (`BUSY`, `LOADING`, a denial) refuses every key of it: each caller
        // reads it as its own `GET`'s.
        Ok(refused @ Value::ServerError(_)) => {
            for w in batch {
                let _ = w.answer.send(Ok(refused.clone()));
            }
        }
        Ok(other) => {
            let e = RedisError::from((
                redis::ErrorKind::Parse,
                "MGET answered something else than one reply per key",
                format!("{other:?}"),
            ));
            fail(batch, &e);
        }
        Err(e) => fail(batch, &e),
    }
}

/// A `GET` per key of `batch`, pipelined; each caller gets the reply to its own.
async fn each(conn: &mut MultiplexedConnection, batch: Vec<Waiter>) {
    let mut pipe = redis::pipe();
    for w in &batch {
        pipe.cmd("GET").arg(&w.key[..]);
    }
    match conn.send_packed_commands(&pipe, 0, batch.len()).await {
        Ok(values) if values.len() == batch.len() => {
            for (w, v) in batch.into_iter().zip(values) {
                let _ = w.answer.send(Ok(v));
            }
        }
        Ok(other) => {
            let e = RedisError::from((
                redis::ErrorKind::Parse,
                "a pipeline of GETs answered something else than one reply per key",
                format!("{other:?}"),
            ));
            fail(batch, &e);
        }
        Err(e) => fail(batch, &e),
    }
}

fn fail(batch: Vec<Waiter>, e: &RedisError) {
    for w in batch {
        let _ = w.answer.send(Err(e.clone()));
    }
}
