//! Every operation of the Redis backend as a [`Request`]: the commands to send (pipelined, one
//! round trip) and how to read their replies into the storage interface's answer. Built and read
//! here once; the blocking pool (`conn.rs`) and the async connection (`nonblocking.rs`) only
//! send them. No I/O.

use bytes::Bytes;
use redis::Value;

use super::item::{self, Expiry};
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

/// One command and the script it runs, if any.
pub(super) struct Command {
    pub(super) cmd: redis::Cmd,
    pub(super) script: Option<ScriptId>,
}

/// Commands sent in one round trip, and how their replies (error replies inline, as
/// `Value::ServerError`) become the answer.
pub(super) struct Request<T> {
    pub(super) commands: Vec<Command>,
    /// Whether a reply that never came leaves the outcome unknown (the command may have run).
    pub(super) write: bool,
    pub(super) read: fn(Vec<Value>) -> Result<T>,
}

impl<T> Request<T> {
    fn one(
        cmd: redis::Cmd,
        script: Option<ScriptId>,
        write: bool,
        read: fn(Vec<Value>) -> Result<T>,
    ) -> Self {
        Request {
            commands: vec![Command { cmd, script }],
            write,
            read,
        }
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

/// Whether a reply is `NOSCRIPT` (the server ran nothing).
pub(super) fn is_noscript(v: &Value) -> bool {
    matches!(v, Value::ServerError(e) if e.code() == "NOSCRIPT")
}

/// The single reply of a one-command request.
fn only(mut vs: Vec<Value>) -> Result<Value> {
    match (vs.pop(), vs.is_empty()) {
        (Some(Value::ServerError(e)), true) => Err(refused(e)),
        (Some(v), true) => Ok(v),
        _ => Err(Error::backend("expected one reply")),
    }
}

/// An error reply: the server answered (out of memory, a wrong type, ...), nothing against it.
fn refused(e: redis::ServerError) -> Error {
    if e.code() == "NOTCOUNTER" {
        return Error::new(
            ErrorKind::NotACounter,
            "the value is not a counter newcache wrote (decimal digits in its item format)",
        );
    }
    Error::with_source(
        ErrorKind::Backend,
        "the server refused the command",
        redis::RedisError::from(e),
    )
}

/// An item from stored bytes: newcache's (header stripped, its stamp the token) or a foreign
/// value (whole, flags 0, its digest the token).
fn item_of(v: Value) -> Result<Option<Item>> {
    let bytes = match v {
        Value::Nil => return Ok(None),
        Value::BulkString(b) => Bytes::from(b),
        Value::ServerError(e) => return Err(refused(e)),
        other => {
            return Err(Error::backend(format!(
                "expected a string or nil, the server answered {other:?}"
            )));
        }
    };
    Ok(Some(match item::decode(&bytes) {
        Some((stamp, flags)) => Item {
            value: bytes.slice(item::HEADER..),
            flags,
            cas: stamp,
        },
        None => Item {
            cas: item::foreign_token(&bytes),
            value: bytes,
            flags: 0,
        },
    }))
}

/// A store's outcome: `SET` answers `OK`, or nil for an add that found the key (`SET NX` answers
/// nil only then); the script answers its word.
fn store_outcome(v: Value) -> Result<StoreOutcome> {
    Ok(match v {
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

fn int_of(v: Value) -> Result<i64> {
    match v {
        Value::Int(n) => Ok(n),
        Value::ServerError(e) => Err(refused(e)),
        other => Err(Error::backend(format!(
            "expected an integer, the server answered {other:?}"
        ))),
    }
}

fn found(vs: Vec<Value>) -> Result<bool> {
    only(vs).and_then(int_of).map(|n| n > 0)
}

/// What the requests are built from: the limits and the scripts.
#[derive(Debug)]
pub(super) struct Builder {
    pub(super) item_size: usize,
    pub(super) key_limit: usize,
    pub(super) scripts: Scripts,
}

impl Builder {
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
        let mut cmd = redis::cmd("GET");
        cmd.arg(key);
        Ok(Request::one(cmd, None, false, |vs| {
            only(vs).and_then(item_of)
        }))
    }

    /// One `MGET` of `keys` (checked by the caller): one answer per key, in order.
    pub(super) fn mget(&self, keys: &[&str]) -> Request<Vec<Result<Option<Item>>>> {
        let mut cmd = redis::cmd("MGET");
        for k in keys {
            cmd.arg(*k);
        }
        Request::one(cmd, None, false, |vs| match only(vs)? {
            Value::Array(vs) => Ok(vs.into_iter().map(item_of).collect()),
            other => Err(Error::backend(format!("MGET answered {other:?}"))),
        })
    }

    /// One write's command: `SET` (`NX` for an add), or the fenced-write script for a `cas`;
    /// `stamp` is the new item's.
    fn store_command(&self, w: &Write<'_>, stamp: u64, read_back: bool) -> Result<Command> {
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
        let expiry = Expiry::from_exptime(w.exptime);
        let stored = item::encode(stamp, w.flags, w.value);
        Ok(match w.mode {
            StoreMode::Cas(token) => {
                let (mode, n) = expiry.script_args();
                let mut c = evalsha(&self.scripts.cas, w.key);
                c.arg(item::fence(token))
                    .arg(stored)
                    .arg(mode)
                    .arg(n)
                    .arg(if read_back { "1" } else { "0" });
                Command {
                    cmd: c,
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
                Command {
                    cmd: c,
                    script: None,
                }
            }
        })
    }

    pub(super) fn store(&self, w: &Write<'_>, stamp: u64) -> Result<Request<StoreOutcome>> {
        let c = self.store_command(w, stamp, false)?;
        Ok(Request {
            commands: vec![c],
            write: true,
            read: |vs| only(vs).and_then(store_outcome),
        })
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
            return Ok(Request {
                commands: vec![c],
                write: true,
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
            });
        }
        let mut get = redis::cmd("GET");
        get.arg(w.key);
        Ok(Request {
            commands: vec![
                c,
                Command {
                    cmd: get,
                    script: None,
                },
            ],
            write: true,
            read: |mut vs| {
                let now = vs.pop().unwrap_or(Value::Nil);
                let outcome = vs.pop().unwrap_or(Value::Nil);
                Ok((store_outcome(outcome)?, item_of(now)?))
            },
        })
    }

    pub(super) fn delete(&self, key: &str) -> Result<Request<bool>> {
        self.check_key(key)?;
        let mut cmd = redis::cmd("UNLINK");
        cmd.arg(key);
        Ok(Request::one(cmd, None, true, found))
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
                    commands: vec![
                        Command {
                            cmd: persist,
                            script: None,
                        },
                        Command {
                            cmd: exists,
                            script: None,
                        },
                    ],
                    write: true,
                    read: |mut vs| int_of(vs.pop().unwrap_or(Value::Nil)).map(|n| n > 0),
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

    /// `incr` (`up`) or `decr` by `delta`, through the counter script.
    pub(super) fn arith(
        &self,
        key: &str,
        delta: u64,
        up: bool,
        stamp: u64,
    ) -> Result<Request<Option<u64>>> {
        self.check_key(key)?;
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

/// The commands of `req` to send again after `replies` (one per command): those whose script the
/// server did not know, as `EVAL` with the source, with their positions.
pub(super) fn noscript_retry<T>(
    req: &Request<T>,
    replies: &[Value],
    scripts: &Scripts,
) -> Vec<(usize, redis::Cmd)> {
    req.commands
        .iter()
        .zip(replies)
        .enumerate()
        .filter_map(|(i, (c, v))| match c.script {
            Some(id) if is_noscript(v) => Some((i, with_source(&c.cmd, id.of(scripts)))),
            _ => None,
        })
        .collect()
}
