//! The Redis backend for `AsyncCache`: the same [`Request`]s as the sync backend, sent on one
//! multiplexed tokio connection (redis-rs's `MultiplexedConnection`: concurrent callers'
//! commands share its writes, replies come back in order to each caller). Plain gets made
//! while another read is on the wire go out together as one `MGET` (`batch.rs`). A write
//! followed by a `WAIT` (`redis_wait`) goes on a connection of its own instead (`waited.rs`):
//! a `WAIT` blocks the connection it arrives on, and must hold up no other caller.
//!
//! The connection's driver task runs on the runtime current when it was opened. If that runtime
//! shuts down, the driver ends: the next call sees it finished and reconnects on its own runtime
//! (not a fault of the server); a read in flight then is sent again once, a write fails with
//! [`is_outcome_unknown`](crate::Error::is_outcome_unknown). Dropping a call's future is safe:
//! the driver reads and discards its reply (a write already sent may still be applied); a
//! waited write's own connection is closed instead (`waited.rs`). As with
//! the memcached engine, a runtime that is alive but no longer driven (a current-thread runtime
//! outside `block_on`) holds the connection it opened: callers on other runtimes time out on it
//! (one `io_timeout`, two for a get queued for a batch; one fault) before one of them
//! reconnects (the connections of waited writes it opened are lent to its own callers only:
//! they cost the others nothing); do not share an `AsyncCache` with such a runtime.
//!
//! The replay of what the server missed while out of reach runs on a task of its own on the
//! caller's runtime (with the connect it may need), which the caller awaits: the first caller
//! after an outage starts it, the others wait for its end, and none of them can hold it up by
//! being dropped or left unpolled (its runtime, though, must be driven, as above).

use std::sync::Arc;

use redis::aio::MultiplexedConnection;
use tokio::task::JoinHandle;

use super::batch::Gets;
use super::clients::{self, ClientId};
use super::fence::{Compared, Fence, compare};
use super::request::{self, Line, Pack, Replies, Reply, Request, noscript_retry};
use super::setup::{Auth, SetUp};
use super::waited::{self, Dialed, Waited};
use super::{BatchOp, Failure, Server, connect_failure, failure_of};
use crate::backend::server::outage::Replay;
use crate::backend::server::replay::{self, MissedOf};
use crate::backend::{AsyncBackend, BoxFuture, Item, StoreOutcome, Write};
use crate::error::{Error, ErrorKind, Result};
use smallvec::{SmallVec, smallvec};

/// An open connection and its driver task.
struct Live {
    /// Which connection this is (a fault is counted once, by the caller that retires it).
    id: u64,
    conn: MultiplexedConnection,
    driver: JoinHandle<()>,
    /// Who it is to the server (if it said): closed by the next replay once retired.
    client: Option<ClientId>,
    /// Its batcher of plain reads.
    gets: Arc<Gets>,
}

/// What a call sends on: a clone of the open connection's handles.
struct Open {
    id: u64,
    conn: MultiplexedConnection,
    gets: Arc<Gets>,
}

impl Live {
    /// Whether its driver task was cancelled: its runtime shut down (a driver that ended by
    /// itself met the connection's end: the server's doing).
    fn cancelled(mut self) -> bool {
        waited::cancelled(&mut self.driver)
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

/// The async view of a Redis server (shares [`Server`] with the sync backend).
///
/// A handle on its state: a replay runs on a task of its own, which holds the state too
/// ([`Inner::replay`]). The calls are `Inner`'s, reached through `Deref`.
pub(crate) struct AsyncRedis(Arc<Inner>);

impl std::ops::Deref for AsyncRedis {
    type Target = Arc<Inner>;

    fn deref(&self) -> &Arc<Inner> {
        &self.0
    }
}

/// The async view's state: the server's [`Server`], its connection and how to open one.
pub(crate) struct Inner {
    shared: Arc<Server>,
    link: Arc<Link>,
    /// Each command is sent after `ASKING` (a cluster node's view for the keys of a slot being
    /// imported, to follow an `ASK` redirect).
    asking: bool,
}

/// The connections of an async view (shared by its asking view).
struct Link {
    /// What redis-rs sends in a connection's set-up (`CLIENT SETINFO`, RESP3's `HELLO`), and
    /// what [`Inner::set_up`] sends after it.
    settings: redis::RedisConnectionInfo,
    set_up: SetUp,
    /// A `rediss://` server's handshake.
    #[cfg(feature = "redis-tls")]
    tls: Option<super::tls::Handshake>,
    live: parking_lot::Mutex<Option<Live>>,
    /// One connect at a time; the others wait for it.
    connecting: tokio::sync::Mutex<()>,
    /// Connections opened so far.
    opened: std::sync::atomic::AtomicU64,
    /// The connections of writes followed by a `WAIT`, one write each at a time.
    waited: Waited,
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
    pub(crate) fn new(shared: Arc<Server>) -> Result<AsyncRedis> {
        let info = shared.config.client()?.get_connection_info().clone();
        let (settings, set_up) = SetUp::split(info.redis_settings(), true);
        Ok(AsyncRedis(Arc::new(Inner {
            link: Arc::new(Link {
                settings,
                set_up,
                #[cfg(feature = "redis-tls")]
                tls: super::tls::Handshake::of(&info, shared.config.tls.as_ref())?,
                live: parking_lot::Mutex::new(None),
                connecting: tokio::sync::Mutex::new(()),
                opened: std::sync::atomic::AtomicU64::new(0),
                waited: Waited::new(shared.options.pool_size, shared.clients.clone()),
            }),
            shared,
            asking: false,
        })))
    }

    /// This view, each command sent after `ASKING` (same server, connection and health).
    pub(super) fn asking(&self) -> AsyncRedis {
        AsyncRedis(Arc::new(Inner {
            shared: self.shared.clone(),
            link: self.link.clone(),
            asking: true,
        }))
    }
}

impl Inner {
    /// `PING`, through the health gate, then (once) the probe of the node's fenced write: a
    /// node without one fails ([`Server::usable`]).
    pub(super) async fn ping_node(self: &Arc<Self>) -> Result<()> {
        self.run(Ok(self.shared.requests.ping())).await?;
        let fence = self.fence().await?;
        self.shared.usable(fence)
    }

    /// The node's fenced write, asked once ([`fence`](super::fence)).
    pub(super) async fn fence(self: &Arc<Self>) -> Result<Fence> {
        let s = &self.shared;
        match s.requests.fence.get() {
            Some(f) => Ok(f),
            None => self
                .run(Ok(s.requests.fence_probe()))
                .await
                .map(|f| s.learned(f)),
        }
    }

    /// `w` written and, with `read_back`, what the key then holds (as the sync view's
    /// `write_one`).
    async fn write_one(
        self: &Arc<Self>,
        w: &Write<'_>,
        read_back: bool,
    ) -> Result<(StoreOutcome, Option<Item>)> {
        let s = &self.shared;
        if s.needs_fence(w, read_back) {
            self.fence().await?;
        }
        s.fenceable(read_back)?;
        if let Some(token) = s.by_comparison(w) {
            let before = self.run(s.requests.get(w.key)).await?;
            return match compare(token, before.as_ref()) {
                Compared::Answer(outcome) => Ok((outcome, before)),
                Compared::Send(seen) => {
                    self.run(s.requests.store_ifeq(w, s.stamp(), &seen, read_back))
                        .await
                }
            };
        }
        if read_back {
            self.run(s.named(s.requests.store_then_get(w, s.stamp())))
                .await
        } else {
            self.run(s.named(s.requests.store(w, s.stamp())))
                .await
                .map(|o| (o, None))
        }
    }

    /// The slot map, as this node sees it.
    pub(super) async fn slots(self: &Arc<Self>) -> Result<Vec<super::slots::Range>> {
        let reply = self
            .run(Ok(super::request::Builder::cluster_slots()))
            .await?;
        super::slots::parse_slots(reply, &self.shared.addr).map_err(|e| self.shared.annotate(e))
    }

    /// The open connection (`None` if it has none or its tasks ended).
    fn current(&self) -> Option<Open> {
        let live = self.link.live.lock();
        live.as_ref()
            .filter(|l| !l.driver.is_finished() && !l.gets.is_finished())
            .map(|l| Open {
                id: l.id,
                conn: l.conn.clone(),
                gets: Arc::clone(&l.gets),
            })
    }

    /// The open connection, or a new one on the current runtime: within one `connect_timeout`
    /// in all, another call's connect waited for included.
    async fn connection(&self) -> std::result::Result<Open, Failure> {
        if let Some(c) = self.current() {
            return Ok(c);
        }
        let s = &self.shared;
        let by = tokio::time::Instant::now() + s.options.connect_timeout;
        let Ok(_one) = tokio::time::timeout_at(by, self.link.connecting.lock()).await else {
            return Err(Failure::Local(Error::new(
                ErrorKind::Timeout,
                "another call's connect did not end within connect_timeout",
            )));
        };
        if let Some(c) = self.current() {
            return Ok(c);
        }
        let rt = runtime()?;
        let Dialed {
            conn,
            driver,
            client,
            ..
        } = self.dial(&rt, by).await?;
        let gets = Arc::new(Gets::start(
            &rt,
            conn.clone(),
            self.shared.options.io_timeout,
        ));
        let id = self
            .link
            .opened
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let replaced = self.link.live.lock().replace(Live {
            id,
            conn: conn.clone(),
            driver,
            client,
            gets: Arc::clone(&gets),
        });
        // Its driver ended (the server's doing, or its runtime's): bytes of a request on it
        // may still be on their way.
        if let Some(old) = replaced {
            self.shared.clients.dropped(old.client.clone());
        }
        Ok(Open { id, conn, gets })
    }

    /// A new connection to the server, its driver spawned on `rt`: the TCP connect, the TLS
    /// handshake of a `rediss://` server, then [`open`](Inner::open)'s set-up, all by `by`
    /// (the call's `connect_timeout` from its start: one for the whole connect, a slow peer
    /// and a wait for another call's connect included, as redis-rs's async connect has).
    async fn dial(
        &self,
        rt: &tokio::runtime::Handle,
        by: tokio::time::Instant,
    ) -> std::result::Result<Dialed, Failure> {
        let s = &self.shared;
        let connect_timeout = s.options.connect_timeout;
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(connect_timeout))
            .set_response_timeout(Some(s.options.io_timeout));
        let connect = async {
            let stream = tokio::net::TcpStream::connect(s.addr.as_str()).await?;
            stream.set_nodelay(true)?;
            Ok::<_, std::io::Error>(stream)
        };
        let cant = |e: Error| Failure::Fault(e);
        let stream = match tokio::time::timeout_at(by, connect).await {
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
        if let Some(tls) = &self.link.tls {
            let settings = tls.config().map_err(Failure::Local)?;
            let handshake = tls.run(settings, stream);
            let stream = match tokio::time::timeout_at(by, handshake).await {
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
            return self.open(rt, stream, config, by).await;
        }
        self.open(rt, stream, config, by).await
    }

    /// A multiplexed connection on `stream`, its driver spawned on `rt`, its set-up done by
    /// `by` (the dial's deadline: what is left of `connect_timeout`, [`set_up`](Inner::set_up)).
    async fn open<C>(
        &self,
        rt: &tokio::runtime::Handle,
        stream: C,
        config: redis::AsyncConnectionConfig,
        by: tokio::time::Instant,
    ) -> std::result::Result<Dialed, Failure>
    where
        C: Unpin + tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + 'static,
    {
        let connect_timeout = self.shared.options.connect_timeout;
        let late = || {
            Failure::Fault(Error::new(
                ErrorKind::Timeout,
                format!(
                    "the connection's set-up (AUTH, SELECT, CLIENT INFO) did not end within \
                     connect_timeout ({connect_timeout:?}, for the whole connect)"
                ),
            ))
        };
        // redis-rs sends `CLIENT SETINFO` and RESP3's `HELLO` ([`SetUp::split`]).
        let (conn, driver) = match tokio::time::timeout_at(
            by,
            MultiplexedConnection::new_with_config(&self.link.settings, stream, config),
        )
        .await
        {
            Ok(Ok(made)) => made,
            Ok(Err(e)) => return Err(connect_failure(e)),
            Err(_) => return Err(late()),
        };
        let driver = rt.spawn(driver);
        let mut conn = conn;
        // The set-up's replies are read within what is left of connect_timeout (a server slow
        // to answer a new connection, a long path), not each within io_timeout.
        conn.set_response_timeout(
            by.saturating_duration_since(tokio::time::Instant::now())
                .max(std::time::Duration::from_millis(1)),
        );
        let client = match tokio::time::timeout_at(by, self.set_up(&mut conn)).await {
            Ok(Ok(client)) => {
                conn.set_response_timeout(self.shared.options.io_timeout);
                client
            }
            Ok(Err(f)) => {
                driver.abort();
                return Err(f);
            }
            Err(_) => {
                driver.abort();
                return Err(late());
            }
        };
        Ok(Dialed {
            conn,
            driver,
            client,
            runtime: rt.id(),
        })
    }

    /// A new connection's set-up ([`SetUp`]), after redis-rs's (`CLIENT SETINFO`, RESP3's
    /// `HELLO`): `AUTH` (RESP2 with a password), `SELECT` (a database other than 0), then
    /// `CLIENT INFO`, which learns its id (`None` if the server refuses the command), pipelined
    /// in one round trip (two for `AUTH`'s old form).
    async fn set_up(
        &self,
        conn: &mut MultiplexedConnection,
    ) -> std::result::Result<Option<ClientId>, Failure> {
        let set_up = &self.link.set_up;
        let select = set_up.select();
        if set_up.auth(false).is_none() && select.is_none() {
            let info = conn.send_packed_command(&clients::info()).await;
            return self.shared.clients.learned(info).map_err(connect_failure);
        }
        let mut again = false;
        loop {
            let auth = set_up.auth(again);
            let mut pipe = redis::pipe();
            for cmd in auth.into_iter().chain(&select) {
                pipe.add_command(cmd.clone());
            }
            pipe.add_command(clients::info());
            let replies = conn
                .send_packed_commands(&pipe, 0, pipe.len())
                .await
                .map_err(connect_failure)?;
            if replies.len() != pipe.len() {
                return Err(Failure::Fault(Error::backend(format!(
                    "could not connect: {} replies to the set-up's {} commands",
                    replies.len(),
                    pipe.len()
                ))));
            }
            let mut replies = replies.into_iter();
            if auth.is_some() {
                let authed = set_up.authenticated(Ok(replies.next().expect("counted")), again)?;
                if authed == Auth::Again {
                    // `SELECT` and `CLIENT INFO` were refused unauthenticated: all go again
                    // with `AUTH`'s old form.
                    again = true;
                    continue;
                }
            }
            if select.is_some() {
                set_up.selected(Ok(replies.next().expect("counted")))?;
            }
            let info = Ok(replies.next().expect("counted"));
            return self.shared.clients.learned(info).map_err(connect_failure);
        }
    }

    /// Drops the connections (on shutdown).
    fn drop_connection(&self) {
        drop(self.link.live.lock().take());
        self.link.waited.clear();
    }

    /// Drops connection `id` after a fault on it: `(retired, orphaned)`: whether this caller
    /// retired it (the others in flight on it find it gone: one fault per connection, not per
    /// waiter), and whether its driver was cancelled (its runtime shut down: not the server's
    /// fault).
    fn retire(&self, id: Option<u64>) -> (bool, bool) {
        let mut live = self.link.live.lock();
        match (&*live, id) {
            (Some(l), Some(id)) if l.id == id => {
                let retired = live.take().expect("matched");
                self.shared.clients.dropped(retired.client.clone());
                (true, retired.cancelled())
            }
            // A failed connect (no id) is a fault of its own.
            (_, None) => (true, false),
            _ => (false, false),
        }
    }

    /// Sends `req` through the health gate and reads its answer.
    async fn run<T>(self: &Arc<Self>, req: Result<Request<T>>) -> Result<T> {
        let s = &self.shared;
        let req = req?;
        crate::backend::note_server(&s.addr);
        let probe = s.gate()?;
        let mut tries = 0;
        let replies = loop {
            tries += 1;
            // Nothing missed (every call of a healthy server): no replay to enter.
            let replayed = match s.missed().pending() {
                true => Box::pin(self.replay()).await,
                false => Ok(()),
            };
            let sent = match replayed {
                Ok(()) => self.send(&req).await,
                // Nothing of `req` was sent.
                Err((id, f)) => Err((id, f.unsent())),
            };
            match sent {
                Ok(replies) => break replies,
                Err((_, Failure::Local(e))) => return Err(s.local_failure(probe, e)),
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
                    // Marked dead: the idle connections of waited writes likely broke too.
                    if retired && s.health.fault(&e, probe) {
                        self.link.waited.clear();
                    }
                    return Err(e);
                }
            }
        };
        s.health.answered(probe);
        if s.first_answer() {
            let ask = s.requests.policy();
            let policy = Box::pin(self.send(&ask)).await.ok();
            let policy = policy.and_then(|r| (ask.read)(r).ok().flatten());
            s.judge_policy(policy.as_deref());
        }
        req.answer(replies).map_err(|e| s.answer_error(e))
    }

    /// A batch of `op` over `items`, in one round trip.
    async fn batch<I, T>(self: &Arc<Self>, items: &[I], op: BatchOp<I, T>) -> Vec<Result<T>> {
        let s = &self.shared;
        let (refused, request) = (op.request)(s, items).split();
        let sent = match request {
            Some(r) => self.run(Ok(r)).await.map(|rs| s.answer_errors(rs)),
            None => Ok(Vec::new()),
        };
        (op.after)(s, items, refused.join(sent))
    }

    /// Deletes the keys the server missed while out of reach, before anything else is sent
    /// (or waits for the caller doing it).
    ///
    /// The replay (with the connect it may need) runs on a task of its own, which this caller
    /// awaits: a caller whose future is dropped, or parked unpolled, never holds it up (others
    /// wait for its end, not for the caller). A replay that fails, or whose task is dropped
    /// unfinished (its runtime shut down), keeps its keys for the next one. A fault it meets is
    /// counted by the caller awaiting it (none if that caller went away: the next call meets
    /// the connection's state itself).
    async fn replay(self: &Arc<Self>) -> std::result::Result<(), (Option<u64>, Failure)> {
        let s = &self.shared;
        let ran = replay::enter_async(&s.health, s.replay_wait(), |replay| async move {
            let rt = runtime().map_err(|f| (None, f))?;
            let this = self.clone();
            let task = rt.spawn(async move { this.replay_now(replay).await });
            match task.await {
                Ok(r) => r,
                // The runtime is shutting down (the task was dropped with it: its keys are
                // kept), or the task panicked.
                Err(e) => Err((
                    None,
                    Failure::Local(Error::with_source(
                        ErrorKind::Backend,
                        "the replay of the invalidations the server missed ended unfinished \
                         (its keys are kept)",
                        e,
                    )),
                )),
            }
        });
        ran.await
            .map_err(|e| (None, Failure::Local(e)))?
            .unwrap_or(Ok(()))
    }

    /// Runs `replay`: its `UNLINK`s, on the open connection or a new one.
    async fn replay_now(
        &self,
        replay: Replay<MissedOf>,
    ) -> std::result::Result<(), (Option<u64>, Failure)> {
        let s = &self.shared;
        let req = {
            let keys: Vec<&str> = replay.keys().collect();
            s.replay_request(&keys)
        };
        let r = match self.send(&req.request).await {
            Ok(vs) => match req.read(vs) {
                Ok(Ok(done)) => Ok(done),
                // Not serving yet: nothing against it, and the keys are kept.
                Ok(Err(e)) => Err((None, Failure::Local(e))),
                Err(e) => Err((None, Failure::Fault(e))),
            },
            Err(x) => Err(x),
        };
        match r {
            Ok(done) => {
                s.replayed(replay, &req, &done);
                Ok(())
            }
            Err((id, f)) => {
                s.replay_failed(replay, &f);
                Err((id, f))
            }
        }
    }

    /// The replies to `req`'s commands (a script the server did not know sent again with its
    /// source).
    /// On failure, which shared connection it met (`None`: connecting failed, or a waited
    /// write's own connection failed: a fault of its own either way).
    async fn send<T>(
        &self,
        req: &Request<T>,
    ) -> std::result::Result<Replies, (Option<u64>, Failure)> {
        if req.wait.is_some() {
            // Boxed: its connect and wait are not every call's.
            return Box::pin(self.send_waited(req)).await.map_err(|f| (None, f));
        }
        let open = match self.current() {
            Some(open) => open,
            // Boxed: a connect's future is large, and a call's own stays small (a boxed
            // future's allocation from the allocator's small-size cache). A failed connect
            // sent nothing.
            None => Box::pin(self.connection())
                .await
                .map_err(|f| (None, f.unsent()))?,
        };
        let Open { id, mut conn, gets } = open;
        let on = |f| (Some(id), f);
        if let (true, false, [one]) = (req.batched, self.asking, &req.commands[..]) {
            let reply = gets.get(&mut conn, &one.cmd.cmd()).await;
            return Ok(smallvec![
                reply.map_err(|e| on(failure_of(e, false)))?.into()
            ]);
        }
        self.request_on(&mut conn, req).await.map_err(on)
    }

    /// [`send`](Inner::send) of a write followed by a `WAIT`: on a connection of its own
    /// (`waited.rs`), so that the wait holds up no other caller's command. A fault there is
    /// its own (the connection dropped, not reused); one met because its runtime shut down
    /// under it is not the server's.
    async fn send_waited<T>(&self, req: &Request<T>) -> std::result::Result<Replies, Failure> {
        // A failed connect sent nothing (a cluster then sends the write to a new master).
        let connect_timeout = self.shared.options.connect_timeout;
        // One connect_timeout for the wait for a connection and its dial together.
        let by = tokio::time::Instant::now() + connect_timeout;
        let dial = async { self.dial(&runtime()?, by).await.map_err(Failure::unsent) };
        let mut lent = self.link.waited.lend(connect_timeout, dial).await?;
        match self.request_on(lent.conn(), req).await {
            Ok(replies) => {
                lent.keep();
                Ok(replies)
            }
            Err(Failure::Fault(e)) if lent.orphaned() => Err(Failure::Local(e)),
            Err(f) => Err(f),
        }
    }

    /// The replies to `req`'s commands on `conn`, a script the server did not know sent again
    /// with its source (and the `WAIT` after it).
    async fn request_on<T>(
        &self,
        conn: &mut MultiplexedConnection,
        req: &Request<T>,
    ) -> std::result::Result<Replies, Failure> {
        let cmds: SmallVec<[&Line; 1]> = req.commands.iter().map(|c| &c.cmd).collect();
        let mut replies = self.exchange(conn, &cmds, req.write).await?;
        let retry = noscript_retry(req, &replies, &self.shared.requests.scripts);
        if !retry.is_empty() {
            let again: Vec<&redis::Cmd> = retry.iter().map(|(_, c)| c).collect();
            let answers = self.exchange(conn, &again, req.write).await?;
            for ((i, _), v) in retry.iter().zip(answers) {
                replies[*i] = v;
            }
        }
        Ok(replies)
    }
}

/// The runtime current on this thread.
fn runtime() -> std::result::Result<tokio::runtime::Handle, Failure> {
    tokio::runtime::Handle::try_current().map_err(|_| {
        Failure::Local(Error::config(
            "an AsyncCache needs a tokio runtime with I/O and timers enabled \
             (Builder::enable_all); none is running on this thread",
        ))
    })
}

impl Inner {
    /// The replies to `cmds` on `conn` (each after `ASKING` for an asking view: its replies
    /// left out).
    async fn exchange<C: Pack>(
        &self,
        conn: &mut MultiplexedConnection,
        cmds: &[&C],
        write: bool,
    ) -> std::result::Result<Replies, Failure> {
        if !self.asking {
            return send_on(conn, cmds, write).await;
        }
        let asking = request::asking();
        let asked = request::after_asking(&asking, cmds);
        send_on(conn, &asked, write)
            .await
            .map(request::asking_answered)
    }
}

/// `cmds` pipelined on `conn`, error replies inline.
async fn send_on<C: Pack + ?Sized>(
    conn: &mut MultiplexedConnection,
    cmds: &[&C],
    write: bool,
) -> std::result::Result<Replies, Failure> {
    let sent = match cmds {
        [one] => {
            let one = one.cmd();
            conn.send_packed_command(&one)
                .await
                .map(|v| smallvec![v.into()])
        }
        many => {
            let mut pipe = redis::pipe();
            for c in many {
                pipe.add_command(c.cmd().into_owned());
            }
            conn.send_packed_commands(&pipe, 0, many.len())
                .await
                .map(|vs| vs.into_iter().map(Reply::from).collect())
        }
    };
    // Error replies come inline (`Value::ServerError`), a single command's as a pipeline's
    // (redis-rs 1.2): an `Err` is the client's own (I/O, a timeout, a dropped connection, a
    // reply it could not parse).
    sent.map_err(|e| failure_of(e, write))
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
        Box::pin(self.batch(keys, super::gets()))
    }

    fn store<'a>(&'a self, w: Write<'a>) -> BoxFuture<'a, Result<StoreOutcome>> {
        Box::pin(async move {
            let r = self.write_one(&w, false).await.map(|(outcome, _)| outcome);
            self.shared.after_write(w.key, r)
        })
    }

    fn store_then_get<'a>(
        &'a self,
        w: Write<'a>,
    ) -> BoxFuture<'a, Result<(StoreOutcome, Option<Item>)>> {
        Box::pin(async move {
            let s = &self.shared;
            let r = self.write_one(&w, true).await;
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
            if writes.iter().any(|w| s.needs_fence(w, true)) {
                if let Err(e) = self.fence().await {
                    return s.unwritten(writes, &e);
                }
            }
            if s.one_by_one(writes) {
                let mut out = Vec::with_capacity(writes.len());
                for w in writes {
                    out.push(AsyncBackend::store(self, *w).await);
                }
                return out;
            }
            self.batch(writes, super::stores()).await
        })
    }

    fn delete<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let s = &self.shared;
            s.after_write(key, self.run(s.requests.delete(key)).await)
        })
    }

    fn delete_many<'a>(&'a self, keys: &'a [&'a str]) -> BoxFuture<'a, Vec<Result<bool>>> {
        Box::pin(self.batch(keys, super::deletes()))
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
            self.fence().await?;
            self.run(s.named(s.requests.arith(key, delta, true, s.stamp())))
                .await
        })
    }

    fn decr<'a>(&'a self, key: &'a str, delta: u64) -> BoxFuture<'a, Result<Option<u64>>> {
        Box::pin(async move {
            let s = &self.shared;
            self.fence().await?;
            self.run(s.named(s.requests.arith(key, delta, false, s.stamp())))
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

    /// A read of [`PING_KEY`](crate::ping::PING_KEY), then (once) the probe of the node's
    /// fenced write, as the sync view's.
    fn ping(&self) -> BoxFuture<'_, std::result::Result<(), crate::ping::PingError>> {
        Box::pin(async move {
            let s = &self.shared;
            let r = match self.get(crate::ping::PING_KEY).await {
                Ok(_) => self.fence().await.and_then(|f| s.usable(f)),
                Err(e) => Err(e),
            };
            r.map_err(|e| crate::ping::single(&s.addr, e))
        })
    }

    fn settle_time(&self) -> std::time::Duration {
        self.shared.config.settle_time()
    }

    fn shutdown(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move { self.drop_connection() })
    }
}
