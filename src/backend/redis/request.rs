//! Every operation of the Redis backend as a [`Request`]: the commands to send (pipelined, one
//! round trip) and how to read their replies into the storage interface's answer. Built and read
//! here once; the blocking pool (`conn.rs`) and the async connection (`nonblocking.rs`) only
//! send them. No I/O.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;

use bytes::{Buf, Bytes};
use redis::Value;
use smallvec::{SmallVec, smallvec};

use super::clients::{self, ClientId};
use super::fence::{self, Fence};
use super::item::{self, Expiry};
use super::reply::{self, Redirect, WAIT_SHORT, not_serving_yet, refused};
use super::script::{Script, Scripts};
use crate::backend::{Item, StoreMode, StoreOutcome, Write};
use crate::error::{Error, ErrorKind, Result};

/// Which script a command runs (`EVALSHA`), so that a `NOSCRIPT` answer can be sent again as
/// `EVAL` with the source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ScriptId {
    Cas,
    Arith,
}

impl ScriptId {
    pub(super) fn of(self, scripts: &Scripts) -> &Script {
        match self {
            ScriptId::Cas => &scripts.cas,
            ScriptId::Arith => &scripts.arith,
        }
    }
}

/// A request's commands: inline for one (most requests), so that a `GET` allocates no list.
pub(super) type Commands = SmallVec<[Command; 1]>;
/// The replies to a request's commands, in order: inline for one.
pub(super) type Replies = SmallVec<[Reply; 1]>;

/// A reply to a command: a bulk string read by the sync pool (a slice of the bytes its
/// connection read, shared by the replies that came with it: no allocation a value, as the
/// memcached engine's items), or any other value.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Reply {
    Bulk(Bytes),
    Value(Value),
}

impl From<Value> for Reply {
    fn from(v: Value) -> Reply {
        Reply::Value(v)
    }
}

impl Reply {
    /// As redis-rs's type (a bulk string copied out).
    pub(super) fn value(self) -> Value {
        match self {
            Reply::Bulk(b) => Value::BulkString(b.into()),
            Reply::Value(v) => v,
        }
    }

    /// The value, unless a bulk string.
    pub(super) fn as_value(&self) -> Option<&Value> {
        match self {
            Reply::Bulk(_) => None,
            Reply::Value(v) => Some(v),
        }
    }
}

/// One command and the script it runs, if any.
pub(super) struct Command {
    pub(super) cmd: Line,
    pub(super) script: Option<ScriptId>,
}

impl Command {
    /// `cmd`, not a script.
    fn plain(cmd: redis::Cmd) -> Command {
        Command {
            cmd: cmd.into(),
            script: None,
        }
    }
}

/// A command's words: built by redis-rs, or a one-key command of a batch (`GET` or `UNLINK`, a
/// command per key on a cluster node), kept as its name and key until it is written, so that a
/// batch of a hundred keys makes no hundred [`redis::Cmd`]s (two allocations each). Either is
/// written in redis-rs's encoding ([`Pack`]).
pub(super) enum Line {
    Cmd(redis::Cmd),
    /// `name` and the key at `at` in `keys`, a buffer the batch's commands share (an
    /// allocation a batch, not one a key).
    Key {
        name: &'static str,
        keys: Arc<str>,
        at: Range<usize>,
    },
}

impl From<redis::Cmd> for Line {
    fn from(cmd: redis::Cmd) -> Line {
        Line::Cmd(cmd)
    }
}

impl Line {
    /// `name key` for each of `keys`, in order.
    fn each<'k, I>(name: &'static str, keys: I) -> impl Iterator<Item = Line>
    where
        I: Iterator<Item = &'k str> + Clone,
    {
        let mut all = String::with_capacity(keys.clone().map(str::len).sum());
        keys.clone().for_each(|k| all.push_str(k));
        let all: Arc<str> = all.into();
        let mut start = 0;
        keys.map(move |k| {
            let at = start..start + k.len();
            start = at.end;
            Line::Key {
                name,
                keys: all.clone(),
                at,
            }
        })
    }
}

/// What a connection writes: a command in redis-rs's encoding, appended to a write buffer (the
/// blocking pool's) or as a [`redis::Cmd`] (what the multiplexed connection takes).
pub(super) trait Pack: Sync {
    /// Appends the command's encoding to `out`, with `packer`, one per write.
    fn pack(&self, out: &mut Vec<u8>, packer: &mut Packer);
    /// The command, as redis-rs's type.
    fn cmd(&self) -> Cow<'_, redis::Cmd>;
}

impl Pack for redis::Cmd {
    fn pack(&self, out: &mut Vec<u8>, _: &mut Packer) {
        self.write_packed_command(out);
    }

    fn cmd(&self) -> Cow<'_, redis::Cmd> {
        Cow::Borrowed(self)
    }
}

impl Pack for Line {
    fn pack(&self, out: &mut Vec<u8>, packer: &mut Packer) {
        match self {
            Line::Cmd(c) => c.write_packed_command(out),
            Line::Key { name, keys, at } => packer.key(out, name, &keys[at.clone()]),
        }
    }

    fn cmd(&self) -> Cow<'_, redis::Cmd> {
        match self {
            Line::Cmd(c) => Cow::Borrowed(c),
            Line::Key { name, keys, at } => {
                let key = &keys[at.clone()];
                // Sized for its two arguments: no regrowth.
                let mut c = redis::Cmd::with_capacity(2, name.len() + key.len());
                c.arg(*name).arg(key);
                Cow::Owned(c)
            }
        }
    }
}

/// Writes a write's one-key commands ([`Line::Key`]) in redis-rs's encoding without a
/// [`redis::Cmd`] each. The encoding of `name key` (RESP: an array of two bulk strings) is a
/// header that depends only on the name and the key's length, then the key and `\r\n`: the
/// header is cut from redis-rs's encoding of the first such command of the write, and reused
/// for the next ones with that name and length (a batch's derived keys are one length).
#[derive(Default)]
pub(super) struct Packer {
    name: &'static str,
    len: usize,
    header: Vec<u8>,
}

impl Packer {
    fn key(&mut self, out: &mut Vec<u8>, name: &'static str, key: &str) {
        if self.header.is_empty() || !std::ptr::eq(self.name, name) || self.len != key.len() {
            let start = out.len();
            let mut cmd = redis::Cmd::with_capacity(2, name.len() + key.len());
            cmd.arg(name).arg(key).write_packed_command(out);
            let end = out.len() - key.len() - 2;
            self.header.clear();
            self.header.extend_from_slice(&out[start..end]);
            self.name = name;
            self.len = key.len();
            return;
        }
        out.reserve(self.header.len() + key.len() + 2);
        out.extend_from_slice(&self.header);
        out.extend_from_slice(key.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
}

/// `cmds` packed one after another into `out`, as a connection writes them.
pub(super) fn pack_all<C: Pack + ?Sized>(cmds: &[&C], out: &mut Vec<u8>) {
    let mut packer = Packer::default();
    for c in cmds {
        c.pack(out, &mut packer);
    }
}

/// Commands sent in one round trip, and how their replies (error replies inline, as
/// `Value::ServerError`) become the answer.
pub(super) struct Request<T> {
    pub(super) commands: Commands,
    /// Whether a reply that never came leaves the outcome unknown (the command may have run).
    pub(super) write: bool,
    /// A plain `GET` (its key the command's second argument): the async connection may send
    /// it in a batch, as an `MGET` with other callers' (`batch.rs`; only the async view,
    /// feature `tokio`, reads it).
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(super) batched: bool,
    /// The `WAIT` sent last ([`Builder::waited`]): its reply is read here, not by `read`.
    pub(super) wait: Option<Wait<T>>,
    pub(super) read: fn(Replies) -> Result<T>,
}

/// The `WAIT` after a request's writes: the replicas it asks for, and how its failure (short
/// of replicas, or refused) becomes the answer of writes that succeeded.
pub(super) struct Wait<T> {
    replicas: u32,
    /// The answer `read` gave, and the `WAIT`'s error: the answer made of them (that error for
    /// a single write; for a batch, [`each_fails`]).
    fail: fn(T, Error) -> Result<T>,
}

impl<T> Request<T> {
    /// The answer to the replies `vs`: `read`'s, then the `WAIT`'s if one was sent.
    ///
    /// The writes' own replies come first and decide first: a write the server refused fails
    /// with its refusal, whatever the `WAIT` said. After a write that succeeded, a `WAIT` that
    /// fell short, or that the server refused (an ACL user without `WAIT`), fails it with an
    /// error that [`is_outcome_unknown`](Error::is_outcome_unknown): the write is on the master,
    /// but whether it outlives a failover is not known.
    pub(super) fn answer(&self, mut vs: Replies) -> Result<T> {
        let Some(wait) = &self.wait else {
            return (self.read)(vs);
        };
        let waited = vs.pop().map(Reply::value);
        let answer = (self.read)(vs)?;
        let wanted = wait.replicas;
        let failed = match waited {
            Some(Value::Int(acked)) if acked >= i64::from(wanted) => return Ok(answer),
            Some(Value::Int(acked)) => Error::backend(format!(
                "{WAIT_SHORT}{acked} of {wanted} replicas acknowledged the write in time (it is on \
                 the master; a failover before a replica has it may lose it)"
            )),
            Some(Value::ServerError(e)) => Error::with_source(
                ErrorKind::Backend,
                format!(
                    "{WAIT_SHORT}the server refused the WAIT sent after the write (it is on the \
                     master; whether a replica has it is not known; with redis_wait the URL's \
                     user needs WAIT)"
                ),
                super::Cause(redis::RedisError::from(e)),
            ),
            other => Error::backend(format!(
                "{WAIT_SHORT}answered {other:?}, not a count of replicas (the write is on the \
                 master)"
            )),
        };
        (wait.fail)(answer, failed.with_outcome_unknown())
    }
}

/// [`Wait::fail`] of a single write: the `WAIT`'s error.
fn fails<T>(_: T, e: Error) -> Result<T> {
    Err(e)
}

/// [`Wait::fail`] of a batch: the `WAIT`'s error for each write that succeeded; a write refused
/// keeps its own error.
fn each_fails<T>(answers: Vec<Result<T>>, e: Error) -> Result<Vec<Result<T>>> {
    Ok(answers
        .into_iter()
        .map(|r| r.and_then(|_| Err(e.clone())))
        .collect())
}

impl<T> Request<T> {
    fn one(
        cmd: redis::Cmd,
        script: Option<ScriptId>,
        write: bool,
        read: fn(Replies) -> Result<T>,
    ) -> Self {
        Request {
            commands: smallvec![Command {
                cmd: cmd.into(),
                script
            }],
            write,
            batched: false,
            wait: None,
            read,
        }
    }
}

/// A replay's commands ([`Builder::replay`]), and what their replies say ([`ReplayRequest::read`]).
pub(super) struct ReplayRequest {
    /// The commands; its replies come back as they are.
    pub(super) request: Request<Replies>,
    /// The connections its `CLIENT KILL`s close, sent first.
    pub(super) kills: Vec<ClientId>,
    /// How many keys each `UNLINK` names, in order, sent after.
    unlinks: Vec<usize>,
    /// Each `UNLINK` is sent after an `ASKING` (a cluster node: see [`Builder::replay`]).
    asking: bool,
}

/// What a replay's replies said.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Replayed {
    /// Keys the server deleted or did not hold (their `UNLINK` answered with a count).
    pub(super) deleted: usize,
    /// Keys whose `UNLINK` the server refused with an error reply: passed over (as memcached's
    /// replay passes over a delete its proxy refuses).
    pub(super) refused: usize,
    /// Keys whose `UNLINK` a cluster node redirected (`MOVED`, `ASK`: their slot is served, or
    /// their key held, elsewhere now), by position in the replay's keys, and where to: not
    /// deleted here, to be deleted there.
    pub(super) redirected: Vec<(usize, String)>,
    /// The error code and detail of a refused `CLIENT KILL` (`NOPERM`, ...), if one was: the
    /// replay goes on without it.
    pub(super) kill_refused: Option<(String, Option<String>)>,
}

impl ReplayRequest {
    /// The answer to the replies `vs`: what was deleted and passed over, or, inside, the
    /// refusal of a server not serving yet ([`not_serving_yet`]: loading its data, say), whose
    /// keys are kept for the next replay.
    pub(super) fn read(&self, vs: Replies) -> Result<Result<Replayed>> {
        let per_unlink = if self.asking { 2 } else { 1 };
        if vs.len() != self.kills.len() + per_unlink * self.unlinks.len() {
            return Err(Error::backend(
                "a replay's replies do not match its commands",
            ));
        }
        let mut done = Replayed {
            deleted: 0,
            refused: 0,
            redirected: Vec::new(),
            kill_refused: None,
        };
        let mut vs = vs.into_iter().map(Reply::value);
        for v in vs.by_ref().take(self.kills.len()) {
            match v {
                // How many it closed (0: gone already), or `+OK`.
                Value::Int(_) | Value::Okay => {}
                Value::ServerError(e) => {
                    let why = (e.code().to_owned(), e.details().map(str::to_owned));
                    done.kill_refused.get_or_insert(why);
                }
                other => {
                    return Err(Error::backend(format!(
                        "a replay's CLIENT KILL answered {other:?}"
                    )));
                }
            }
        }
        // The `ASKING`s' replies (`OK`) left out.
        let unlinked = vs.skip(per_unlink - 1).step_by(per_unlink);
        let mut at = 0;
        for (v, &keys) in unlinked.zip(&self.unlinks) {
            let first = at;
            at += keys;
            match v {
                Value::Int(_) => done.deleted += keys,
                Value::ServerError(e) if not_serving_yet(e.code(), e.details()) => {
                    return Ok(Err(refused(e)));
                }
                Value::ServerError(e) => match reply::redirect(e.code(), e.details()) {
                    Some(Redirect::Moved { addr, .. } | Redirect::Ask { addr }) => done
                        .redirected
                        .extend((first..at).map(|i| (i, addr.clone()))),
                    None => done.refused += keys,
                },
                other => {
                    return Err(Error::backend(format!(
                        "a replayed UNLINK answered {other:?}, not a count"
                    )));
                }
            }
        }
        Ok(Ok(done))
    }
}

/// `EVALSHA sha 1 key` (the arguments follow).
fn evalsha(s: &Script, key: &str) -> redis::Cmd {
    let mut c = redis::cmd("EVALSHA");
    c.arg(&s.sha).arg(1).arg(key);
    c
}

/// The same call as `EVAL source ...`.
pub(super) fn with_source(cmd: &redis::Cmd, s: &Script) -> redis::Cmd {
    let mut c = redis::cmd("EVAL");
    c.arg(s.source);
    // After `EVALSHA` and the SHA: the key count, the key, the arguments.
    for a in cmd.args_iter().skip(2) {
        if let redis::Arg::Simple(bytes) = a {
            c.arg(bytes);
        }
    }
    c
}

/// The single reply of a one-command request.
fn only(vs: Replies) -> Result<Value> {
    only_reply(vs).map(Reply::value)
}

/// The single reply of a one-command request, a bulk string as read.
fn only_reply(mut vs: Replies) -> Result<Reply> {
    match (vs.pop(), vs.is_empty()) {
        (Some(Reply::Value(Value::ServerError(e))), true) => Err(refused(e)),
        (Some(r), true) => Ok(r),
        _ => Err(Error::backend("expected one reply")),
    }
}

/// An item from stored bytes: newcache's (header stripped, its stamp the token) or a foreign
/// value (whole, flags 0, its digest the token).
fn item_of(r: impl Into<Reply>) -> Result<Option<Item>> {
    let mut bytes = match r.into() {
        Reply::Bulk(b) => b,
        Reply::Value(Value::Nil) => return Ok(None),
        Reply::Value(Value::BulkString(b)) => Bytes::from(b),
        Reply::Value(Value::ServerError(e)) => return Err(refused(e)),
        Reply::Value(other) => {
            return Err(Error::backend(format!(
                "expected a string or nil, the server answered {other:?}"
            )));
        }
    };
    Ok(Some(match item::decode(&bytes) {
        Some((stamp, flags)) => {
            // Past the header in place: a `slice` would share the buffer (an allocation).
            bytes.advance(item::HEADER);
            Item {
                value: bytes,
                flags,
                cas: stamp,
            }
        }
        None => Item {
            cas: item::foreign_token(&bytes),
            value: bytes,
            flags: 0,
        },
    }))
}

/// A store's outcome: `SET` answers `OK`, or nil for an add that found the key (`SET NX` answers
/// nil only then); the script answers its word.
fn store_outcome(r: impl Into<Reply>) -> Result<StoreOutcome> {
    Ok(match r.into().value() {
        Value::Okay => StoreOutcome::Stored,
        Value::SimpleString(s) if s == "OK" => StoreOutcome::Stored,
        Value::Nil => StoreOutcome::NotStored,
        Value::BulkString(b) => match &b[..] {
            b"STORED" => StoreOutcome::Stored,
            b"EXISTS" => StoreOutcome::Exists,
            b"NOT_FOUND" => StoreOutcome::NotFound,
            _ => return Err(Error::backend("the store script answered an unknown word")),
        },
        Value::ServerError(e) => return Err(refused(e)),
        other => {
            return Err(Error::backend(format!(
                "a store answered {other:?}, not OK, nil or an outcome"
            )));
        }
    })
}

fn int_of(r: impl Into<Reply>) -> Result<i64> {
    match r.into().value() {
        Value::Int(n) => Ok(n),
        Value::ServerError(e) => Err(refused(e)),
        other => Err(Error::backend(format!(
            "expected an integer, the server answered {other:?}"
        ))),
    }
}

fn found(vs: Replies) -> Result<bool> {
    only(vs).and_then(int_of).map(|n| n > 0)
}

/// A batch: the request of the items that may be sent, and the errors of those refused before.
pub(super) struct Batch<T> {
    /// One per item, in order: `Some` for an item refused before sending.
    pub(super) refused: Vec<Option<Error>>,
    /// Answers one result per item not refused, in order (a command each, or one `MGET`).
    pub(super) request: Request<Vec<Result<T>>>,
}

impl<T> Batch<T> {
    /// The request of the items to send (`None` if every item was refused), and the
    /// refusals its results are joined with ([`Refused::join`]).
    pub(super) fn split(self) -> (Refused, Option<Request<Vec<Result<T>>>>) {
        let n = self.refused.iter().filter(|r| r.is_none()).count();
        let request = (n > 0).then_some(self.request);
        (
            Refused {
                refused: self.refused,
                sent: n,
            },
            request,
        )
    }
}

/// The items of a [`Batch`] refused before sending, and how many were sent.
pub(super) struct Refused {
    refused: Vec<Option<Error>>,
    sent: usize,
}

impl Refused {
    /// One result per item: the refusals, and the results of the request sent (or its error,
    /// for every item sent).
    pub(super) fn join<T>(self, sent: Result<Vec<Result<T>>>) -> Vec<Result<T>> {
        let n = self.sent;
        let sent = match sent {
            // Nothing refused: the results are the request's.
            Ok(rs) if rs.len() == n && n == self.refused.len() => return rs,
            other => other,
        };
        let mut sent = match sent {
            Ok(rs) if rs.len() == n => rs.into_iter(),
            Ok(_) => {
                let e = Error::backend("another count of replies than items sent");
                (0..n)
                    .map(|_| Err(e.clone()))
                    .collect::<Vec<_>>()
                    .into_iter()
            }
            Err(e) => (0..n)
                .map(|_| Err(e.clone()))
                .collect::<Vec<_>>()
                .into_iter(),
        };
        self.refused
            .into_iter()
            .map(|r| match r {
                Some(e) => Err(e),
                None => sent
                    .next()
                    .unwrap_or_else(|| Err(Error::backend("no reply for this item"))),
            })
            .collect()
    }
}

/// Keys `SCAN` looks at per step of a `clear`.
const CLEAR_STEP: u32 = 1000;

/// The `SCAN` pattern of the cache's keys: `prefix` (its glob characters escaped) and exactly
/// the 40 characters of a SHA-1 in hex, so that another flavor that starts like this one
/// (`app-1` beside `app`: `app-1-1-…` starts with `app-1-`) is left alone.
pub(super) fn prefix_pattern(prefix: &str) -> String {
    let mut out = String::with_capacity(prefix.len() + 48);
    for c in prefix.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out.push_str(&"?".repeat(40));
    out
}

/// The error of a `clear` without a prefix.
pub(super) fn no_prefix() -> Error {
    Error::new(
        ErrorKind::Unsupported,
        "clear() on redis removes the cache's own keys by their prefix, and a cache with a custom \
         key function has none: delete its keys one by one, or give them a common prefix",
    )
}

/// What the requests are built from: the limits and the scripts.
#[derive(Debug)]
pub(super) struct Builder {
    /// `WAIT replicas timeout-ms` after each store and delete ([`RedisConfig::wait`](super::RedisConfig::wait)).
    pub(super) wait: Option<super::ReplicaWait>,
    pub(super) item_size: usize,
    pub(super) key_limit: usize,
    pub(super) scripts: Scripts,
    /// The node's fenced write, once learned ([`Builder::fence_probe`]): no script is built
    /// for a node known to lack scripting.
    pub(super) fence: fence::Known,
    /// A node of a Redis Cluster: no command names keys of two slots (`CROSSSLOT`), so a batch
    /// is one command per key, pipelined, rather than one `MGET` or one `UNLINK` of many.
    pub(super) cluster: bool,
}

impl Builder {
    /// `req` with a `WAIT` sent last, if the configuration asks for one (its failure fails the
    /// request: see [`Request::answer`]).
    fn waited<T>(&self, mut req: Request<T>) -> Request<T> {
        if let Some(w) = self.wait {
            let mut cmd = redis::cmd("WAIT");
            cmd.arg(w.replicas).arg(
                u64::try_from(w.timeout.as_millis())
                    .unwrap_or(u64::MAX)
                    .max(1),
            );
            req.commands.push(Command::plain(cmd));
            req.wait = Some(Wait {
                replicas: w.replicas,
                fail: fails,
            });
        }
        req
    }

    /// A batch's `req` with a `WAIT` sent last, if the configuration asks for one (its failure
    /// fails each write that succeeded, the others keeping their own error).
    fn waited_each<T>(&self, req: Request<Vec<Result<T>>>) -> Request<Vec<Result<T>>> {
        let mut req = self.waited(req);
        if let Some(w) = &mut req.wait {
            w.fail = each_fails;
        }
        req
    }

    /// Refuses an empty key or one over the limit, before anything is sent.
    pub(super) fn check_key(&self, key: &str) -> Result<()> {
        if key.is_empty() || key.len() > self.key_limit {
            return Err(Error::new(
                ErrorKind::InvalidKey,
                format!(
                    "a key must be 1 to {} bytes (RedisConfig::key_limit); this one is {}",
                    self.key_limit,
                    key.len()
                ),
            ));
        }
        Ok(())
    }

    pub(super) fn max_value_size(&self, key: &str) -> usize {
        crate::backend::max_value_size(self.item_size, key)
    }

    pub(super) fn get(&self, key: &str) -> Result<Request<Option<Item>>> {
        self.check_key(key)?;
        // Sized for its two arguments: no regrowth.
        let mut cmd = redis::Cmd::with_capacity(2, 3 + key.len());
        cmd.arg("GET").arg(key);
        Ok(Request {
            // Never on a cluster node: an `MGET` of keys of several slots is refused there.
            batched: !self.cluster,
            ..Request::one(cmd, None, false, |vs| only_reply(vs).and_then(item_of))
        })
    }

    /// One `MGET` of the keys that pass the checks (a `GET` per key, pipelined, on a cluster
    /// node): one answer per key, in order.
    pub(super) fn get_many(&self, keys: &[&str]) -> Batch<Option<Item>> {
        if self.cluster {
            return self.get_each(keys);
        }
        let mut cmd = redis::cmd("MGET");
        let refused = keys
            .iter()
            .map(|k| {
                let refused = self.check_key(k).err();
                if refused.is_none() {
                    cmd.arg(*k);
                }
                refused
            })
            .collect();
        Batch {
            refused,
            request: Request::one(cmd, None, false, |vs| match only(vs)? {
                Value::Array(vs) => Ok(vs.into_iter().map(item_of).collect()),
                other => Err(Error::backend(format!("MGET answered {other:?}"))),
            }),
        }
    }

    /// `name key` for each key that passes the checks, and each key's refusal (`None` for a
    /// key whose command is in the list).
    fn per_key(&self, name: &'static str, keys: &[&str]) -> (Vec<Option<Error>>, Commands) {
        let refused: Vec<Option<Error>> = keys.iter().map(|k| self.check_key(k).err()).collect();
        let sent = keys
            .iter()
            .zip(&refused)
            .filter(|(_, r)| r.is_none())
            .map(|(k, _)| *k);
        let mut commands = Commands::with_capacity(keys.len());
        commands.extend(Line::each(name, sent).map(|cmd| Command { cmd, script: None }));
        (refused, commands)
    }

    /// A `GET` per key that passes the checks, pipelined: each reply read alone (a node of a
    /// cluster may redirect some keys and serve the others).
    fn get_each(&self, keys: &[&str]) -> Batch<Option<Item>> {
        let (refused, commands) = self.per_key("GET", keys);
        Batch {
            refused,
            request: Request {
                commands,
                write: false,
                batched: false,
                wait: None,
                read: |vs| Ok(vs.into_iter().map(item_of).collect()),
            },
        }
    }

    /// `PING`: whether the server answers.
    pub(super) fn ping(&self) -> Request<()> {
        Request::one(redis::cmd("PING"), None, false, |vs| only(vs).map(drop))
    }

    /// `CLUSTER SLOTS`: which master serves which slots.
    pub(super) fn cluster_slots() -> Request<Value> {
        let mut cmd = redis::cmd("CLUSTER");
        cmd.arg("SLOTS");
        Request::one(cmd, None, false, only)
    }

    /// The keys of one command of a multi-key deletion: all of them, or one on a cluster node.
    fn unlink_step(&self) -> usize {
        if self.cluster { 1 } else { CLEAR_STEP as usize }
    }

    /// A write's key and size, checked before anything of it is built.
    fn check_write(&self, w: &Write<'_>) -> Result<()> {
        self.check_key(w.key)?;
        let max = self.max_value_size(w.key);
        if w.value.len() > max {
            return Err(Error::new(
                ErrorKind::TooLarge,
                format!(
                    "a value of {} bytes is over the {max}-byte limit (item_size)",
                    w.value.len()
                ),
            ));
        }
        Ok(())
    }

    /// One write's command: `SET` (`NX` for an add), or the fenced-write script for a `cas`;
    /// `stamp` is the new item's.
    fn store_command(&self, w: &Write<'_>, stamp: u64, read_back: bool) -> Result<Command> {
        self.check_write(w)?;
        let expiry = Expiry::from_exptime(w.exptime);
        let stored = item::encode(stamp, w.flags, w.value);
        Ok(match w.mode {
            StoreMode::Cas(_) if self.fence.get().is_some_and(|f| f != Fence::Lua) => {
                return Err(self.unfenced());
            }
            // No item of this backend has token 0 (stamps and foreign digests never are).
            StoreMode::Cas(0) => {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    "a cas with token 0: no item on redis has that token (it is the token of \
                     a server without CAS)",
                ));
            }
            StoreMode::Cas(token) => {
                let (mode, n) = expiry.script_args();
                let mut c = evalsha(&self.scripts.cas, w.key);
                c.arg(item::fence(token))
                    .arg(stored)
                    .arg(mode)
                    .arg(n)
                    .arg(if read_back { "1" } else { "0" });
                Command {
                    cmd: c.into(),
                    script: Some(ScriptId::Cas),
                }
            }
            mode => {
                let mut c = redis::cmd("SET");
                c.arg(w.key).arg(stored);
                if mode == StoreMode::Add {
                    c.arg("NX");
                }
                if let Some((unit, n)) = expiry.set_args() {
                    c.arg(unit).arg(n);
                }
                Command::plain(c)
            }
        })
    }

    /// The refusal of a script (a fenced write, a counter) on a node known to lack scripting,
    /// before anything is sent.
    pub(super) fn unfenced(&self) -> Error {
        let missing = self
            .fence
            .get()
            .and_then(Fence::missing)
            .unwrap_or("scripting");
        Error::new(
            ErrorKind::Unsupported,
            format!("the server lacks {missing}"),
        )
    }

    /// The probe of the node's fenced write ([`fence::read_probe`]), all its words ASCII:
    /// `EVAL` of a script that writes nothing, `EVALSHA` of its SHA-1, `COMMAND DOCS SET`.
    pub(super) fn fence_probe(&self) -> Request<Fence> {
        let mut eval = redis::cmd("EVAL");
        eval.arg(fence::PROBE_SCRIPT).arg(0);
        let mut evalsha = redis::cmd("EVALSHA");
        evalsha.arg(Script::sha_of(fence::PROBE_SCRIPT)).arg(0);
        let mut docs = redis::cmd("COMMAND");
        docs.arg("DOCS").arg("SET");
        Request {
            commands: smallvec![
                Command::plain(eval),
                Command::plain(evalsha),
                Command::plain(docs)
            ],
            write: false,
            batched: false,
            wait: None,
            read: |vs| {
                let vs: Vec<Value> = vs.into_iter().map(Reply::value).collect();
                let [eval, evalsha, docs] = &vs[..] else {
                    return Err(Error::backend("expected three replies"));
                };
                fence::read_probe(eval, evalsha, docs).map_err(|v| match v {
                    Value::ServerError(e) => refused(e),
                    _ => Error::backend("the probe of scripting was not answered"),
                })
            },
        }
    }

    /// A fenced write on a node without scripting: `SET … IFEQ seen` (the stored bytes the
    /// token was read from, [`fence::compare`]), then, with `read_back`, `GET`. `SET IFEQ`
    /// answers nil when the key no longer holds `seen`: `EXISTS`, or `NOT_FOUND` when the
    /// key then holds nothing.
    pub(super) fn store_ifeq(
        &self,
        w: &Write<'_>,
        stamp: u64,
        seen: &[u8],
        read_back: bool,
    ) -> Result<Request<(StoreOutcome, Option<Item>)>> {
        self.check_write(w)?;
        let mut set = redis::cmd("SET");
        set.arg(w.key)
            .arg(item::encode(stamp, w.flags, w.value))
            .arg("IFEQ")
            .arg(seen);
        if let Some((unit, n)) = Expiry::from_exptime(w.exptime).set_args() {
            set.arg(unit).arg(n);
        }
        let mut commands: Commands = smallvec![Command::plain(set)];
        if read_back {
            let mut get = redis::cmd("GET");
            get.arg(w.key);
            commands.push(Command::plain(get));
        }
        Ok(self.waited(Request {
            commands,
            write: true,
            batched: false,
            wait: None,
            read: |mut vs| {
                let nil = || Reply::Value(Value::Nil);
                let now = match vs.len() {
                    2 => Some(item_of(vs.pop().unwrap_or_else(nil))?),
                    _ => None,
                };
                let outcome = match (store_outcome(vs.pop().unwrap_or_else(nil))?, &now) {
                    (StoreOutcome::NotStored, Some(None)) => StoreOutcome::NotFound,
                    (StoreOutcome::NotStored, _) => StoreOutcome::Exists,
                    (o, _) => o,
                };
                Ok((outcome, now.flatten()))
            },
        }))
    }

    pub(super) fn store(&self, w: &Write<'_>, stamp: u64) -> Result<Request<StoreOutcome>> {
        let c = self.store_command(w, stamp, false)?;
        Ok(self.waited(Request {
            commands: smallvec![c],
            write: true,
            batched: false,
            wait: None,
            read: |vs| only(vs).and_then(store_outcome),
        }))
    }

    /// The write, then what the key holds: in the script itself for a `cas` (one step on the
    /// server), else `SET` and `GET` pipelined.
    pub(super) fn store_then_get(
        &self,
        w: &Write<'_>,
        stamp: u64,
    ) -> Result<Request<(StoreOutcome, Option<Item>)>> {
        let c = self.store_command(w, stamp, true)?;
        if c.script.is_some() {
            return Ok(self.waited(Request {
                commands: smallvec![c],
                write: true,
                batched: false,
                wait: None,
                read: |vs| match only(vs)? {
                    Value::Array(mut pair) if pair.len() == 2 => {
                        let now = pair.pop().unwrap_or(Value::Nil);
                        let outcome = pair.pop().unwrap_or(Value::Nil);
                        Ok((store_outcome(outcome)?, item_of(now)?))
                    }
                    other => Err(Error::backend(format!(
                        "the store script answered {other:?}"
                    ))),
                },
            }));
        }
        let mut get = redis::cmd("GET");
        get.arg(w.key);
        Ok(self.waited(Request {
            commands: smallvec![c, Command::plain(get)],
            write: true,
            batched: false,
            wait: None,
            read: |mut vs| {
                let nil = || Reply::Value(Value::Nil);
                let now = vs.pop().unwrap_or_else(nil);
                let outcome = vs.pop().unwrap_or_else(nil);
                Ok((store_outcome(outcome)?, item_of(now)?))
            },
        }))
    }

    /// Every write of a batch, pipelined (one round trip); the writes refused before sending
    /// (a bad key, a value over the limit) are left out and keep their error.
    pub(super) fn store_many(
        &self,
        writes: &[Write<'_>],
        mut stamp: impl FnMut() -> u64,
    ) -> Batch<StoreOutcome> {
        let mut refused = Vec::with_capacity(writes.len());
        let mut commands = Commands::new();
        for w in writes {
            match self.store_command(w, stamp(), false) {
                Ok(c) => {
                    commands.push(c);
                    refused.push(None);
                }
                Err(e) => refused.push(Some(e)),
            }
        }
        Batch {
            refused,
            request: self.waited_each(Request {
                commands,
                write: true,
                batched: false,
                wait: None,
                read: |vs| Ok(vs.into_iter().map(store_outcome).collect()),
            }),
        }
    }

    /// An `UNLINK` per key, pipelined.
    pub(super) fn delete_many(&self, keys: &[&str]) -> Batch<bool> {
        let (refused, commands) = self.per_key("UNLINK", keys);
        Batch {
            refused,
            request: self.waited_each(Request {
                commands,
                write: true,
                batched: false,
                wait: None,
                read: |vs| Ok(vs.into_iter().map(|v| int_of(v).map(|n| n > 0)).collect()),
            }),
        }
    }

    pub(super) fn delete(&self, key: &str) -> Result<Request<bool>> {
        self.check_key(key)?;
        let mut cmd = redis::cmd("UNLINK");
        cmd.arg(key);
        Ok(self.waited(Request::one(cmd, None, true, found)))
    }

    /// `PEXPIRE` / `EXPIREAT`, or for no expiry `PERSIST` with `EXISTS` (`PERSIST` answers 0 for
    /// a key that exists without an expiry).
    pub(super) fn touch(&self, key: &str, exptime: u32) -> Result<Request<bool>> {
        self.check_key(key)?;
        let cmd = match Expiry::from_exptime(exptime) {
            Expiry::Never => {
                let mut persist = redis::cmd("PERSIST");
                persist.arg(key);
                let mut exists = redis::cmd("EXISTS");
                exists.arg(key);
                return Ok(Request {
                    commands: smallvec![Command::plain(persist), Command::plain(exists)],
                    write: true,
                    batched: false,
                    wait: None,
                    read: |mut vs| {
                        let exists = vs.pop().unwrap_or(Reply::Value(Value::Nil));
                        // A refused `PERSIST` (`NOPERM`, `READONLY`, ...) is the answer: the
                        // key keeps its expiry, whatever `EXISTS` found.
                        if let Some(Reply::Value(Value::ServerError(e))) = vs.pop() {
                            return Err(refused(e));
                        }
                        int_of(exists).map(|n| n > 0)
                    },
                });
            }
            Expiry::In(ms) => {
                let mut c = redis::cmd("PEXPIRE");
                c.arg(key).arg(ms);
                c
            }
            Expiry::At(s) => {
                let mut c = redis::cmd("EXPIREAT");
                c.arg(key).arg(s);
                c
            }
        };
        Ok(Request::one(cmd, None, true, found))
    }

    /// `CONFIG GET maxmemory-policy`: the policy, or `None` where `CONFIG` is refused (managed
    /// services rename or forbid it).
    pub(super) fn policy(&self) -> Request<Option<String>> {
        let mut cmd = redis::cmd("CONFIG");
        cmd.arg("GET").arg("maxmemory-policy");
        Request::one(cmd, None, false, |vs| {
            Ok(match vs.into_iter().next().map(Reply::value) {
                Some(Value::Array(pair)) => match pair.get(1) {
                    Some(Value::BulkString(b)) => Some(String::from_utf8_lossy(b).into_owned()),
                    _ => None,
                },
                Some(Value::Map(pairs)) => pairs.into_iter().find_map(|(_, v)| match v {
                    Value::BulkString(b) => Some(String::from_utf8_lossy(&b).into_owned()),
                    _ => None,
                }),
                _ => None,
            })
        })
    }

    /// One `SCAN` step over the keys matching `pattern`: the next cursor (0: done) and the keys.
    pub(super) fn scan(&self, cursor: u64, pattern: &str) -> Request<(u64, Vec<Vec<u8>>)> {
        let mut cmd = redis::cmd("SCAN");
        cmd.arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(CLEAR_STEP);
        Request::one(cmd, None, false, |vs| match only(vs)? {
            Value::Array(mut pair) if pair.len() == 2 => {
                let keys = match pair.pop() {
                    Some(Value::Array(keys)) => keys
                        .into_iter()
                        .filter_map(|k| match k {
                            Value::BulkString(b) => Some(b),
                            _ => None,
                        })
                        .collect(),
                    _ => return Err(Error::backend("SCAN answered no key list")),
                };
                let cursor = match pair.pop() {
                    Some(Value::BulkString(b)) => std::str::from_utf8(&b)
                        .ok()
                        .and_then(|s| s.parse().ok())
                        .ok_or_else(|| Error::backend("SCAN answered no cursor"))?,
                    _ => return Err(Error::backend("SCAN answered no cursor")),
                };
                Ok((cursor, keys))
            }
            other => Err(Error::backend(format!("SCAN answered {other:?}"))),
        })
    }

    /// `UNLINK` of keys `SCAN` found (an `UNLINK` per key, pipelined, on a cluster node): how
    /// many it removed.
    pub(super) fn unlink(&self, keys: &[Vec<u8>]) -> Request<i64> {
        let commands = keys
            .chunks(self.unlink_step())
            .map(|chunk| {
                let mut cmd = redis::cmd("UNLINK");
                for k in chunk {
                    cmd.arg(k);
                }
                Command::plain(cmd)
            })
            .collect();
        Request {
            commands,
            write: true,
            batched: false,
            wait: None,
            read: |vs| vs.into_iter().map(int_of).sum(),
        }
    }

    /// The deletes of a replay (the keys the server missed while out of reach): `UNLINK`s of up
    /// to [`CLEAR_STEP`] keys each (one each on a cluster node), pipelined. Not a write in the sense of `write`: deleting a
    /// key again is harmless, so a replay whose reply never came is simply made again.
    ///
    /// On a cluster node each `UNLINK` goes after an `ASKING`: a key handed to this node by
    /// another's replay (`ASK`: its slot migrating here, the key moved already) is deleted
    /// here, not redirected back; where the node serves the slot itself, `ASKING` changes
    /// nothing.
    ///
    /// First, in the same round trip, a `CLIENT KILL` of each connection in `kills` (this
    /// process's, dropped with a request perhaps still in the network: `clients.rs`), so that
    /// no write delayed past the replay lands on one of them.
    pub(super) fn replay(&self, kills: Vec<ClientId>, keys: &[&str]) -> ReplayRequest {
        let chunks = keys.chunks(self.unlink_step());
        let sizes = chunks.clone().map(<[&str]>::len).collect();
        let asking = self.cluster;
        let unlinks = chunks.flat_map(|chunk| {
            let mut cmd = redis::cmd("UNLINK");
            for k in chunk {
                cmd.arg(*k);
            }
            asking.then(self::asking).into_iter().chain([cmd])
        });
        let commands = kills
            .iter()
            .map(clients::kill)
            .chain(unlinks)
            .map(Command::plain)
            .collect();
        ReplayRequest {
            request: Request {
                commands,
                write: false,
                batched: false,
                wait: None,
                read: Ok,
            },
            kills,
            unlinks: sizes,
            asking,
        }
    }

    /// `incr` (`up`) or `decr` by `delta`, through the counter script.
    pub(super) fn arith(
        &self,
        key: &str,
        delta: u64,
        up: bool,
        stamp: u64,
    ) -> Result<Request<Option<u64>>> {
        self.check_key(key)?;
        if self.fence.get().is_some_and(|f| f != Fence::Lua) {
            return Err(self.unfenced());
        }
        let mut cmd = evalsha(&self.scripts.arith, key);
        cmd.arg(delta.to_string())
            .arg(if up { "+" } else { "-" })
            .arg(&stamp.to_be_bytes()[..]);
        Ok(Request::one(
            cmd,
            Some(ScriptId::Arith),
            true,
            |vs| match only(vs)? {
                Value::Nil => Ok(None),
                Value::BulkString(b) => std::str::from_utf8(&b)
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .map(Some)
                    .ok_or_else(|| Error::backend("the counter script answered no number")),
                other => Err(Error::backend(format!(
                    "the counter script answered {other:?}"
                ))),
            },
        ))
    }
}

/// `ASKING`: the next command may touch a key of a slot this node is importing.
pub(super) fn asking() -> redis::Cmd {
    redis::cmd("ASKING")
}

/// `cmds`, each after `asking` (`ASKING` is good for one command).
pub(super) fn after_asking<'a, C: Pack>(
    asking: &'a redis::Cmd,
    cmds: &[&'a C],
) -> Vec<&'a dyn Pack> {
    cmds.iter()
        .flat_map(|c| [asking as &dyn Pack, *c as &dyn Pack])
        .collect()
}

/// The replies of commands sent [`after_asking`], those of the `ASKING`s left out.
pub(super) fn asking_answered(replies: Replies) -> Replies {
    replies.into_iter().skip(1).step_by(2).collect()
}

/// The commands of `req` to send again after `replies` (one per command): those whose script the
/// server did not know, as `EVAL` with the source, with their positions.
///
/// They run after the request's other commands, which is safe only while no request holds a
/// script and another command for one key: a batch names each key once where it holds
/// scripts (the loader's claim rounds skip repeated keys, `Fetched::Duplicate`; its
/// completions are one per claim), `set_many`'s repeated keys are plain `SET`s, and a
/// single write's read-back is in its script or a plain `GET` after a plain `SET`.
pub(super) fn noscript_retry<T>(
    req: &Request<T>,
    replies: &[Reply],
    scripts: &Scripts,
) -> Vec<(usize, redis::Cmd)> {
    let mut retry = req
        .commands
        .iter()
        .zip(replies)
        .enumerate()
        .filter_map(|(i, (c, v))| match c.script {
            Some(id) if v.as_value().is_some_and(reply::is_noscript) => {
                Some((i, with_source(&c.cmd.cmd(), id.of(scripts))))
            }
            _ => None,
        })
        .collect::<Vec<_>>();
    // The `WAIT` ran before the scripts sent again: it goes again after them.
    if !retry.is_empty() && req.wait.is_some() {
        if let Some(last) = req.commands.last() {
            retry.push((req.commands.len() - 1, last.cmd.cmd().into_owned()));
        }
    }
    retry
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Replies of these values.
    macro_rules! replies {
        ($($v:expr),* $(,)?) => {
            Replies::from_iter([$(Reply::from($v)),*])
        };
    }
    use proptest::prelude::*;

    /// A cluster node's builder: a command per key in a batch.
    fn cluster_builder() -> Builder {
        Builder {
            wait: None,
            item_size: 1 << 20,
            key_limit: 250,
            scripts: Scripts::new(),
            fence: Default::default(),
            cluster: true,
        }
    }

    /// The bytes a connection writes for `commands` (each after `ASKING` if `asking`), packed
    /// as the blocking pool packs them.
    fn packed(commands: &Commands, asking: bool) -> Vec<u8> {
        let lines: Vec<&Line> = commands.iter().map(|c| &c.cmd).collect();
        let ask = super::asking();
        let mut out = Vec::new();
        match asking {
            true => pack_all(&after_asking(&ask, &lines), &mut out),
            false => pack_all(&lines, &mut out),
        }
        out
    }

    /// A key: as `make_key` makes them (one length: the header reused), any text (CR, LF and
    /// multi-byte characters included), or runs of one byte whose lengths cross the header's
    /// digit counts (9/10, 99/100) and the key limit (250: refused), or empty (refused).
    fn key() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a-z]{2,6}-[0-9]-[0-9a-f]{40}",
            "(?s).{0,12}",
            (0usize..300).prop_map(|n| "k".repeat(n)),
            // Two bytes a character: a limit counted in characters would pass 126 of them.
            (120usize..130).prop_map(|n| "¡".repeat(n)),
        ]
    }

    proptest! {
        /// The bytes a cluster node's batch writes (`GET`s of `get_many`, `UNLINK`s of
        /// `delete_many`, each after `ASKING` as an asking view sends them) are redis-rs's encoding of
        /// `name key` for each key not refused, in order, built here from the keys given; the
        /// refused keys (empty, over the limit) are the ones refused, and write nothing.
        #[test]
        fn a_cluster_batch_writes_redis_rs_encoding_of_each_key(
            keys in prop::collection::vec(key(), 0..40),
            unlink in any::<bool>(),
            asking in any::<bool>(),
        ) {
            let b = cluster_builder();
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            let (name, refused, commands) = match unlink {
                false => {
                    let batch = b.get_many(&keys);
                    ("GET", batch.refused, batch.request.commands)
                }
                true => {
                    let batch = b.delete_many(&keys);
                    ("UNLINK", batch.refused, batch.request.commands)
                }
            };
            let mut want = Vec::new();
            for (k, r) in keys.iter().zip(&refused) {
                let valid = !k.is_empty() && k.len() <= 250;
                prop_assert_eq!(r.is_none(), valid, "key {:?}", k);
                if valid {
                    if asking {
                        want.extend(redis::cmd("ASKING").get_packed_command());
                    }
                    want.extend(redis::cmd(name).arg(*k).get_packed_command());
                }
            }
            prop_assert_eq!(packed(&commands, asking), want);
            // The async connection's commands are the same words.
            let words: Vec<Vec<u8>> = commands.iter().map(|c| c.cmd.cmd().get_packed_command()).collect();
            let each: Vec<Vec<u8>> = keys
                .iter()
                .zip(&refused)
                .filter(|(_, r)| r.is_none())
                .map(|(k, _)| redis::cmd(name).arg(*k).get_packed_command())
                .collect();
            prop_assert_eq!(words, each);
        }
    }

    #[test]
    fn one_key_commands_of_several_names_and_lengths_and_built_ones_pack_in_order() {
        // A header cut for one name and length is not reused for another name of that
        // length, nor another length; a command redis-rs built between them changes neither.
        let gets: Vec<Line> = Line::each("GET", ["a", "bb", "cc", "d"].into_iter()).collect();
        let unlinks: Vec<Line> = Line::each("UNLINK", ["cc", "¡", " "].into_iter()).collect();
        let mut set = redis::cmd("SET");
        set.arg("cc").arg("v");
        let set = Line::Cmd(set);
        let lines: Vec<&Line> = gets[..3]
            .iter()
            .chain(&unlinks[..1])
            .chain(&gets[3..])
            .chain([&set])
            .chain(&unlinks[1..])
            .collect();
        let mut out = Vec::new();
        pack_all(&lines, &mut out);
        let mut want = Vec::new();
        for k in ["a", "bb", "cc"] {
            want.extend(redis::cmd("GET").arg(k).get_packed_command());
        }
        want.extend(redis::cmd("UNLINK").arg("cc").get_packed_command());
        want.extend(redis::cmd("GET").arg("d").get_packed_command());
        want.extend(redis::cmd("SET").arg("cc").arg("v").get_packed_command());
        for k in ["¡", " "] {
            want.extend(redis::cmd("UNLINK").arg(k).get_packed_command());
        }
        assert_eq!(
            String::from_utf8_lossy(&out),
            String::from_utf8_lossy(&want)
        );
    }

    #[test]
    fn a_prefix_matches_only_itself() {
        let any40 = "?".repeat(40);
        assert_eq!(prefix_pattern("prod-3-"), format!("prod-3-{any40}"));
        assert_eq!(
            prefix_pattern("a*b?[c]\\-1-"),
            format!("a\\*b\\?\\[c\\]\\\\-1-{any40}")
        );
    }
    #[test]
    fn a_wait_short_of_replicas_or_refused_is_an_outcome_unknown_error_after_the_writes_answer() {
        let b = Builder {
            wait: Some(crate::backend::redis::ReplicaWait {
                replicas: 2,
                timeout: std::time::Duration::from_millis(50),
            }),
            item_size: 1 << 20,
            key_limit: 250,
            scripts: Scripts::new(),
            fence: Default::default(),
            cluster: false,
        };
        let req = b.delete("k").unwrap();
        let sent: Vec<Vec<u8>> = req
            .commands
            .iter()
            .map(|c| c.cmd.cmd().get_packed_command())
            .collect();
        assert_eq!(sent.len(), 2);
        assert_eq!(
            sent[1],
            redis::cmd("WAIT").arg(2).arg(50).get_packed_command()
        );
        assert!(req.answer(replies![Value::Int(1), Value::Int(2)]).unwrap());
        let e = req
            .answer(replies![Value::Int(1), Value::Int(1)])
            .unwrap_err();
        assert!(
            e.is_outcome_unknown() && e.to_string().contains("1 of 2 replicas"),
            "{e}"
        );
        // The write's own reply decides first; a refused WAIT after a write that succeeded
        // leaves its outcome unknown (the write is on the master) and names the refusal.
        let no = |text: &[u8]| redis::parse_redis_value(text).unwrap();
        let oom = no(b"-OOM command not allowed when used memory > 'maxmemory'\r\n");
        let noperm = no(b"-NOPERM this user has no permissions to run the 'wait' command\r\n");
        let e = req
            .answer(replies![oom.clone(), noperm.clone()])
            .unwrap_err();
        assert!(
            !e.is_outcome_unknown() && reply::refusal_code(&e) == Some("OOM"),
            "{e:?}"
        );
        let e = req
            .answer(replies![Value::Int(1), noperm.clone()])
            .unwrap_err();
        assert!(
            e.is_outcome_unknown() && !e.is_denied() && reply::refusal_code(&e) == Some("NOPERM"),
            "{e:?}"
        );
        assert!(e.to_string().contains("refused the WAIT"), "{e}");
        // In a batch, each write that succeeded gets the WAIT's error; a refused one its own.
        let batch = b.delete_many(&["a", "b"]).request;
        let each = batch
            .answer(replies![Value::Int(1), oom, Value::Int(0)])
            .unwrap();
        assert!(
            each[0].as_ref().is_err_and(|e| e.is_outcome_unknown()),
            "{each:?}"
        );
        assert!(
            each[1]
                .as_ref()
                .is_err_and(|e| !e.is_outcome_unknown() && reply::refusal_code(e) == Some("OOM")),
            "{each:?}"
        );
        // Without a wait, nothing is added.
        let plain = Builder { wait: None, ..b };
        assert_eq!(plain.delete("k").unwrap().commands.len(), 1);
    }

    #[test]
    fn a_touch_to_no_expiry_answers_persists_refusal() {
        let b = Builder {
            wait: None,
            item_size: 1 << 20,
            key_limit: 250,
            scripts: Scripts::new(),
            fence: Default::default(),
            cluster: false,
        };
        let req = b.touch("k", 0).unwrap();
        assert_eq!(req.commands.len(), 2, "PERSIST, then EXISTS");
        assert!(req.answer(replies![Value::Int(0), Value::Int(1)]).unwrap());
        assert!(!req.answer(replies![Value::Int(0), Value::Int(0)]).unwrap());
        let readonly =
            redis::parse_redis_value(b"-READONLY You can't write against a read only replica.\r\n")
                .unwrap();
        let e = req.answer(replies![readonly, Value::Int(1)]).unwrap_err();
        assert_eq!(reply::refusal_code(&e), Some("READONLY"), "{e:?}");
    }

    #[test]
    fn a_replay_unlinks_in_steps_and_passes_over_refusals() {
        let b = Builder {
            wait: None,
            item_size: 1 << 20,
            key_limit: 250,
            scripts: Scripts::new(),
            fence: Default::default(),
            cluster: false,
        };
        let keys: Vec<String> = (0..2_500).map(|i| format!("k{i}")).collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        let req = b.replay(Vec::new(), &keys);
        assert_eq!(req.request.commands.len(), 3, "1,000 keys a command");
        assert!(
            !req.request.write,
            "a delete made again is harmless: retried like a read"
        );
        let refusal = redis::parse_redis_value(b"-NOPERM no permission\r\n").unwrap();
        assert!(matches!(refusal, Value::ServerError(_)), "{refusal:?}");
        let refused = req.read(replies![Value::Int(1000), Value::Int(3), refusal.clone()]);
        assert_eq!(
            refused.unwrap().unwrap(),
            Replayed {
                deleted: 2_000,
                refused: 500,
                redirected: Vec::new(),
                kill_refused: None,
            },
            "the refused command's keys are passed over, not counted as deleted"
        );
        assert!(
            req.read(replies![Value::Okay, Value::Int(1), Value::Int(1)])
                .is_err(),
            "not a count"
        );
        assert!(
            req.read(replies![Value::Int(1)]).is_err(),
            "a reply missing"
        );
        let loading =
            redis::parse_redis_value(b"-LOADING Redis is loading the dataset in memory\r\n")
                .unwrap();
        let kept = req
            .read(replies![Value::Int(1000), loading, Value::Int(3)])
            .unwrap();
        let e = kept.unwrap_err();
        assert!(format!("{e:?}").contains("loading the dataset"), "{e:?}");
    }

    /// A `CLUSTERDOWN` refusal's message is one sentence, not a string literal's source
    /// indentation (a line break in `refused`'s literal without its `\` leaves spaces inside
    /// the text every caller and log line shows).
    #[test]
    fn a_clusterdown_refusal_reads_as_one_sentence() {
        let v = redis::parse_redis_value(b"-CLUSTERDOWN Hash slot not served\r\n").unwrap();
        let Value::ServerError(e) = v else {
            panic!("an error reply: {v:?}")
        };
        let e = refused(e);
        assert!(!e.to_string().contains("  "), "{e}");
        // What the node said is the cause, in its words, said once.
        let cause = std::error::Error::source(&e).expect("the node's reply");
        assert_eq!(cause.to_string(), "CLUSTERDOWN Hash slot not served");
        assert!(cause.source().is_none());
        assert!(!e.to_string().contains("CLUSTERDOWN"), "{e}");
    }

    #[test]
    fn a_cluster_nodes_replay_asks_and_hands_back_redirected_keys() {
        let b = Builder {
            wait: None,
            item_size: 1 << 20,
            key_limit: 250,
            scripts: Scripts::new(),
            fence: Default::default(),
            cluster: true,
        };
        let req = b.replay(Vec::new(), &["a", "b", "c", "d"]);
        let names: Vec<String> = req
            .request
            .commands
            .iter()
            .map(|c| String::from_utf8_lossy(&c.cmd.cmd().get_packed_command()).into_owned())
            .collect();
        assert_eq!(names.len(), 8, "{names:?}");
        assert!(
            names[0].contains("ASKING") && names[1].contains("UNLINK"),
            "{names:?}"
        );
        let reply = |bytes: &[u8]| redis::parse_redis_value(bytes).unwrap();
        let done = req
            .read(replies![
                Value::Okay,
                Value::Int(1),
                Value::Okay,
                reply(b"-MOVED 15495 127.0.0.1:7002\r\n"),
                Value::Okay,
                reply(b"-ASK 15495 [::1]:7003\r\n"),
                Value::Okay,
                reply(b"-READONLY You can't write against a read only replica.\r\n"),
            ])
            .unwrap()
            .unwrap();
        assert_eq!(
            done,
            Replayed {
                deleted: 1,
                refused: 1,
                redirected: vec![(1, "127.0.0.1:7002".into()), (2, "[::1]:7003".into())],
                kill_refused: None,
            },
            "a redirected key is handed back with where it lives now, not passed over"
        );
    }
}
