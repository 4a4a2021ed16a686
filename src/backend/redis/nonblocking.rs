//! The Redis backend for `AsyncCache`: the same [`Request`]s as the sync backend, sent on one
//! multiplexed tokio connection (redis-rs's `MultiplexedConnection`: concurrent callers'
//! commands share its writes, replies come back in order to each caller). Plain gets made
//! while another read is on the wire go out together as one `MGET` (`batch.rs`).
//!
//! The connection's driver task runs on the runtime current when it was opened. If that runtime
//! shuts down, the driver ends: the next call sees it finished and reconnects on its own runtime
//! (not a fault of the server); a read in flight then is sent again once, a write fails with
//! [`is_outcome_unknown`](crate::Error::is_outcome_unknown). Dropping a call's future is safe:
//! the driver reads and discards its reply (a write already sent may still be applied). As with
//! the memcached engine, a runtime that is alive but no longer driven (a current-thread runtime
//! outside `block_on`) holds the connection it opened: callers on other runtimes time out on it
//! (one `io_timeout`, one fault) before one of them reconnects; do not share an `AsyncCache`
//! with such a runtime.

use std::sync::Arc;

use redis::Value;
use redis::aio::MultiplexedConnection;
use tokio::task::JoinHandle;

use super::batch::Gets;
use super::request::{self, Request, noscript_retry};
use super::{Failure, Shared, connect_failure, failure_of};
use crate::backend::memcached::outage::{Begin, Missed};
use crate::backend::{AsyncBackend, BoxFuture, Item, StoreOutcome, Write};
use crate::error::{Error, ErrorKind, Result};

/// An open connection and its driver task.
struct Live {
    /// Which connection this is (a fault is counted once, by the caller that retires it).
    id: u64,
    conn: MultiplexedConnection,
    driver: JoinHandle<()>,
    /// Its batcher of plain reads.
    gets: Arc<Gets>,
}

/// What a call sends on: a clone of the open connection's handles.
struct Link {
    id: u64,
    conn: MultiplexedConnection,
    gets: Arc<Gets>,
}

impl Live {
    /// Whether its driver task was cancelled: its runtime shut down (a driver that ended by
    /// itself met the connection's end: the server's doing).
    fn cancelled(mut self) -> bool {
        if !self.driver.is_finished() {
            return false;
        }
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        matches!(
            std::pin::Pin::new(&mut self.driver).poll(&mut cx),
            std::task::Poll::Ready(Err(e)) if e.is_cancelled()
        )
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

/// The async view of a Redis server (shares [`Shared`] with the sync backend).
pub(crate) struct AsyncRedis {
    shared: Arc<Shared>,
    info: redis::ConnectionInfo,
    /// A `rediss://` server's handshake.
    #[cfg(feature = "redis-tls")]
    tls: Option<super::tls::Handshake>,
    live: parking_lot::Mutex<Option<Live>>,
    /// One connect at a time; the others wait for it.
    connecting: tokio::sync::Mutex<()>,
    /// Connections opened so far.
    opened: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for AsyncRedis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncRedis")
            .field("server", &self.shared.addr)
            .finish_non_exhaustive()
    }
}

impl AsyncRedis {
    /// The async view of `shared`'s server. Never connects.
    pub(crate) fn new(shared: Arc<Shared>) -> Result<AsyncRedis> {
        let info = shared.config.client()?.get_connection_info().clone();
        Ok(AsyncRedis {
            #[cfg(feature = "redis-tls")]
            tls: super::tls::Handshake::of(&info, shared.config.tls.as_ref())?,
            shared,
            info,
            live: parking_lot::Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
            opened: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// The open connection (`None` if it has none or its tasks ended).
    fn current(&self) -> Option<Link> {
        let live = self.live.lock();
        live.as_ref()
            .filter(|l| !l.driver.is_finished() && !l.gets.is_finished())
            .map(|l| Link {
                id: l.id,
                conn: l.conn.clone(),
                gets: Arc::clone(&l.gets),
            })
    }

    /// The open connection, or a new one on the current runtime.
    async fn connection(&self) -> std::result::Result<Link, Failure> {
        if let Some(c) = self.current() {
            return Ok(c);
        }
        let s = &self.shared;
        let connect_timeout = s.config.connect_timeout;
        let Ok(_one) = tokio::time::timeout(connect_timeout, self.connecting.lock()).await else {
            return Err(Failure::Local(Error::new(
                ErrorKind::Timeout,
                "another call's connect did not end within connect_timeout",
            )));
        };
        if let Some(c) = self.current() {
            return Ok(c);
        }
        let rt = tokio::runtime::Handle::try_current().map_err(|_| {
            Failure::Local(Error::config(
                "an AsyncCache needs a tokio runtime with I/O and timers enabled \
                 (Builder::enable_all); none is running on this thread",
            ))
        })?;
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(connect_timeout))
            .set_response_timeout(Some(s.config.io_timeout));
        let connect = async {
            let stream = tokio::net::TcpStream::connect(s.addr.as_str()).await?;
            stream.set_nodelay(true)?;
            Ok::<_, std::io::Error>(stream)
        };
        let cant = |e: Error| Failure::Fault(e);
        let stream = match tokio::time::timeout(connect_timeout, connect).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) => return Err(cant(Error::io(e, "could not connect"))),
            Err(_) => {
                return Err(cant(Error::new(
                    ErrorKind::Timeout,
                    format!("could not connect within connect_timeout ({connect_timeout:?})"),
                )));
            }
        };
        #[cfg(feature = "redis-tls")]
        if let Some(tls) = &self.tls {
            let settings = tls.config().map_err(Failure::Local)?;
            let handshake = tls.run(settings, stream);
            let stream = match tokio::time::timeout(connect_timeout, handshake).await {
                Ok(Ok(stream)) => stream,
                Ok(Err(e)) => {
                    return Err(match super::tls::refusal(&e) {
                        // The server answered: it is up, and refused (or was refused).
                        Some(why) => Failure::Local(Error::backend(why)),
                        None => cant(Error::io(e, "could not connect (TLS handshake)")),
                    });
                }
                Err(_) => {
                    return Err(cant(Error::new(
                        ErrorKind::Timeout,
                        "the TLS handshake did not end within connect_timeout",
                    )));
                }
            };
            return self.open(rt, stream, config).await;
        }
        self.open(rt, stream, config).await
    }

    /// A multiplexed connection on `stream` (its set-up: `AUTH`, `SELECT`), its driver spawned
    /// on `rt`.
    async fn open<C>(
        &self,
        rt: tokio::runtime::Handle,
        stream: C,
        config: redis::AsyncConnectionConfig,
    ) -> std::result::Result<Link, Failure>
    where
        C: Unpin + tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + 'static,
    {
        let connect_timeout = self.shared.config.connect_timeout;
        let (conn, driver) = match tokio::time::timeout(
            connect_timeout,
            MultiplexedConnection::new_with_config(self.info.redis_settings(), stream, config),
        )
        .await
        {
            Ok(Ok(made)) => made,
            Ok(Err(e)) => return Err(connect_failure(e)),
            Err(_) => {
                return Err(Failure::Fault(Error::new(
                    ErrorKind::Timeout,
                    "the connection's set-up (AUTH, SELECT) did not end within connect_timeout",
                )));
            }
        };
        let driver = rt.spawn(driver);
        let gets = Arc::new(Gets::start(&rt, conn.clone()));
        let id = self
            .opened
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        *self.live.lock() = Some(Live {
            id,
            conn: conn.clone(),
            driver,
            gets: Arc::clone(&gets),
        });
        Ok(Link { id, conn, gets })
    }

    /// Drops the connection (on shutdown).
    fn drop_connection(&self) {
        drop(self.live.lock().take());
    }

    /// Drops connection `id` after a fault on it: `(retired, orphaned)`: whether this caller
    /// retired it (the others in flight on it find it gone: one fault per connection, not per
    /// waiter), and whether its driver was cancelled (its runtime shut down: not the server's
    /// fault).
    fn retire(&self, id: Option<u64>) -> (bool, bool) {
        let mut live = self.live.lock();
        match (&*live, id) {
            (Some(l), Some(id)) if l.id == id => {
                let orphaned = live.take().is_some_and(Live::cancelled);
                (true, orphaned)
            }
            // A failed connect (no id) is a fault of its own.
            (_, None) => (true, false),
            _ => (false, false),
        }
    }

    /// Sends `req` through the health gate and reads its answer.
    async fn run<T>(&self, req: Result<Request<T>>) -> Result<T> {
        let s = &self.shared;
        let req = req?;
        crate::backend::note_server(&s.addr);
        let probe = s.gate()?;
        let mut tries = 0;
        let replies = loop {
            tries += 1;
            let sent = match self.replay().await {
                Ok(()) => self.send(&req).await,
                Err(e) => Err(e),
            };
            match sent {
                Ok(replies) => break replies,
                Err((_, Failure::Local(e))) => return Err(s.answer_error(e)),
                Err((id, Failure::Fault(e))) => {
                    let (retired, orphaned) = self.retire(id);
                    // Its runtime shut down under it: the server is not to blame; a read is
                    // sent again on a connection of this runtime.
                    if orphaned {
                        if !req.write && tries < 3 {
                            continue;
                        }
                        return Err(s.annotate(e));
                    }
                    let e = s.annotate(e);
                    if retired {
                        s.fault(probe, &e);
                    }
                    return Err(e);
                }
            }
        };
        s.answered(probe);
        if s.first_answer() {
            let ask = s.requests.policy();
            let policy = self.send(&ask).await.ok();
            let policy = policy.and_then(|r| (ask.read)(r).ok().flatten());
            s.judge_policy(policy.as_deref());
        }
        (req.read)(replies).map_err(|e| s.answer_error(e))
    }

    /// Deletes the keys the server missed while out of reach, before anything else is sent
    /// (or waits for the caller doing it). A replay that fails, or whose future is dropped,
    /// keeps its keys for the next one.
    async fn replay(&self) -> std::result::Result<(), (Option<u64>, Failure)> {
        let s = &self.shared;
        loop {
            match Missed::begin(s.missed()) {
                Begin::Clear => return Ok(()),
                Begin::Busy => {
                    if !s.missed().wait_async(s.replay_wait()).await {
                        return Err((None, s.replay_busy()));
                    }
                }
                Begin::Mine(replay) => {
                    let req = {
                        let keys: Vec<&str> = replay.keys().collect();
                        s.requests.replay(&keys)
                    };
                    let r = match self.send(&req).await {
                        Ok(vs) => match (req.read)(vs) {
                            Ok(Ok(refused)) => Ok(refused),
                            // Not serving yet: nothing against it, and the keys are kept.
                            Ok(Err(e)) => Err((None, Failure::Local(e))),
                            Err(e) => Err((None, Failure::Fault(e))),
                        },
                        Err(x) => Err(x),
                    };
                    return match r {
                        Ok(refused) => {
                            s.replayed(replay, refused);
                            Ok(())
                        }
                        Err((id, f)) => {
                            s.replay_failed(replay, &f);
                            Err((id, f))
                        }
                    };
                }
            }
        }
    }

    /// The replies to `req`'s commands (a script the server did not know sent again with its
    /// source).
    /// On failure, which connection it met (`None`: connecting failed).
    async fn send<T>(
        &self,
        req: &Request<T>,
    ) -> std::result::Result<Vec<Value>, (Option<u64>, Failure)> {
        let Link { id, mut conn, gets } = self.connection().await.map_err(|f| (None, f))?;
        let on = |f| (Some(id), f);
        if let (true, [one]) = (req.batched, &req.commands[..]) {
            if let Some(redis::Arg::Simple(key)) = one.cmd.args_iter().nth(1) {
                let reply = gets.get(&mut conn, key).await;
                return Ok(vec![reply.map_err(|e| on(failure_of(e, false)))?]);
            }
        }
        let cmds: Vec<&redis::Cmd> = req.commands.iter().map(|c| &c.cmd).collect();
        let mut replies = send_on(&mut conn, &cmds, req.write).await.map_err(on)?;
        let retry = noscript_retry(req, &replies, &self.shared.requests.scripts);
        if !retry.is_empty() {
            let again: Vec<&redis::Cmd> = retry.iter().map(|(_, c)| c).collect();
            let answers = send_on(&mut conn, &again, req.write).await.map_err(on)?;
            for ((i, _), v) in retry.iter().zip(answers) {
                replies[*i] = v;
            }
        }
        Ok(replies)
    }
}

/// `cmds` pipelined on `conn`, error replies inline.
async fn send_on(
    conn: &mut MultiplexedConnection,
    cmds: &[&redis::Cmd],
    write: bool,
) -> std::result::Result<Vec<Value>, Failure> {
    let sent = match cmds {
        [one] => conn.send_packed_command(one).await.map(|v| vec![v]),
        many => {
            let mut pipe = redis::pipe();
            for c in many {
                pipe.add_command((*c).clone());
            }
            conn.send_packed_commands(&pipe, 0, many.len()).await
        }
    };
    match sent {
        Ok(vs) => Ok(vs),
        // An error reply of a single command comes as an error: keep it inline when the
        // client says which.
        Err(e) => Err(failure_of(e, write)),
    }
}

impl AsyncBackend for AsyncRedis {
    fn get<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Option<Item>>> {
        Box::pin(async move {
            let mut item = self.run(self.shared.requests.get(key)).await?;
            self.shared.distrust(item.as_mut());
            Ok(item)
        })
    }

    fn get_many<'a>(&'a self, keys: &'a [&'a str]) -> BoxFuture<'a, Vec<Result<Option<Item>>>> {
        Box::pin(async move {
            let batch = self.shared.requests.get_many(keys);
            let items = batch.answer(|r| self.run(Ok(r))).await;
            self.shared.distrust_all(items)
        })
    }

    fn store<'a>(&'a self, w: Write<'a>) -> BoxFuture<'a, Result<StoreOutcome>> {
        Box::pin(async move {
            let s = &self.shared;
            s.after_write(w.key, self.run(s.requests.store(&w, s.stamp())).await)
        })
    }

    fn store_then_get<'a>(
        &'a self,
        w: Write<'a>,
    ) -> BoxFuture<'a, Result<(StoreOutcome, Option<Item>)>> {
        Box::pin(async move {
            let s = &self.shared;
            let r = self.run(s.requests.store_then_get(&w, s.stamp())).await;
            let (outcome, mut item) = s.after_write(w.key, r)?;
            s.distrust(item.as_mut());
            Ok((outcome, item))
        })
    }

    fn store_many<'a>(
        &'a self,
        writes: &'a [Write<'a>],
    ) -> BoxFuture<'a, Vec<Result<StoreOutcome>>> {
        Box::pin(async move {
            let s = &self.shared;
            let batch = s.requests.store_many(writes, || s.stamp());
            let rs = batch.answer(|r| self.run(Ok(r))).await;
            s.after_writes(writes.iter().map(|w| w.key), rs)
        })
    }

    fn delete<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let s = &self.shared;
            s.after_write(key, self.run(s.requests.delete(key)).await)
        })
    }

    fn delete_many<'a>(&'a self, keys: &'a [&'a str]) -> BoxFuture<'a, Vec<Result<bool>>> {
        Box::pin(async move {
            let s = &self.shared;
            let batch = s.requests.delete_many(keys);
            let rs = batch.answer(|r| self.run(Ok(r))).await;
            s.after_writes(keys.iter().copied(), rs)
        })
    }

    fn touch<'a>(&'a self, key: &'a str, exptime: u32) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let s = &self.shared;
            s.after_write(key, self.run(s.requests.touch(key, exptime)).await)
        })
    }

    fn incr<'a>(&'a self, key: &'a str, delta: u64) -> BoxFuture<'a, Result<Option<u64>>> {
        Box::pin(async move {
            let s = &self.shared;
            self.run(s.requests.arith(key, delta, true, s.stamp()))
                .await
        })
    }

    fn decr<'a>(&'a self, key: &'a str, delta: u64) -> BoxFuture<'a, Result<Option<u64>>> {
        Box::pin(async move {
            let s = &self.shared;
            self.run(s.requests.arith(key, delta, false, s.stamp()))
                .await
        })
    }

    fn flush_all(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async { Err(super::refuse_flush()) })
    }

    fn clear<'a>(&'a self, prefix: Option<&'a str>) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let b = &self.shared.requests;
            let pattern = request::prefix_pattern(prefix.ok_or_else(request::no_prefix)?);
            let mut cursor = 0;
            loop {
                let (next, keys) = self.run(Ok(b.scan(cursor, &pattern))).await?;
                if !keys.is_empty() {
                    self.run(Ok(b.unlink(&keys))).await?;
                }
                if next == 0 {
                    return Ok(());
                }
                cursor = next;
            }
        })
    }

    fn max_value_size(&self, key: &str) -> usize {
        self.shared.requests.max_value_size(key)
    }

    fn shutdown(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move { self.drop_connection() })
    }
}
