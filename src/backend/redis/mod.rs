//! The Redis / Valkey backend (feature `redis`): memcached's storage semantics on one Redis or
//! Valkey server, through the `redis` crate (redis-rs).
//!
//! Items are stored as Redis strings with a small header (`item.rs`: a tag, the item's stamp,
//! the flags); the stamp is the item's CAS token, and every fenced write compares it on the
//! server in a one-key Lua script (`script.rs`). Placeholders are `SET … NX`; counters keep
//! memcached's rules through a script. No `WATCH`/`MULTI`.
//!
//! The sync backend keeps a pool of blocking connections (`conn.rs`), each operation under
//! `io_timeout`; health is memcached's (`health.rs`): transport faults mark the server dead after
//! `failure_limit` in a row, one caller probes it every `retry_interval`.

mod config;
mod conn;
mod item;
mod script;

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use redis::Value;

pub use self::config::{DEFAULT_KEY_LIMIT, RedisConfig};
use self::conn::{Pool, Pooled};
use self::item::Expiry;
use self::script::{Script, Scripts};
use super::memcached::health::{Gate, Health};
use super::{Backend, Item, StoreMode, StoreOutcome, Write, max_value_size};
use crate::error::{Error, ErrorKind, Result};
use crate::rng::{Rng, entropy};

/// A [`Backend`] on one Redis or Valkey server (feature `redis`).
///
/// Built by [`CacheBuilder::redis`](crate::CacheBuilder::redis) (or `RedisBackend::new` with a
/// [`RedisConfig`]); it never connects until the first call. Cheap to share (`Arc`).
pub struct RedisBackend {
    config: RedisConfig,
    /// `host:port`.
    addr: String,
    pool: Pool,
    health: Arc<Health>,
    scripts: Scripts,
    stamps: Rng,
    started: Instant,
}

impl std::fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBackend")
            .field("server", &self.addr)
            .finish_non_exhaustive()
    }
}

/// What a call learned about the server.
enum Outcome<T> {
    /// An answer (an error reply included: it says nothing against the server).
    Answer(Result<T>),
    /// A transport fault: it counts toward marking the server dead.
    Fault(Error),
}

impl RedisBackend {
    /// Sets up the pool (without connecting).
    ///
    /// # Errors
    ///
    /// A configuration error (`is_config()`) for a URL the `redis` crate cannot read, a scheme
    /// other than `redis://`, a zero pool size or a zero timeout.
    pub fn new(config: RedisConfig) -> Result<RedisBackend> {
        let client = config.client()?;
        Ok(RedisBackend {
            pool: Pool::new(client, &config),
            health: Arc::new(Health::default()),
            scripts: Scripts::new(),
            stamps: Rng::new(entropy()),
            started: Instant::now(),
            addr: config.addr(),
            config,
        })
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// A fresh stamp.
    fn stamp(&self) -> u64 {
        item::stamp_of(self.stamps.next_u64())
    }

    fn annotate(&self, e: Error) -> Error {
        let addr = &self.addr;
        if e.server().is_none() {
            e.in_context(format!("redis at {addr}")).at_server(&addr)
        } else {
            e
        }
    }

    /// Runs `f` on a pooled connection through the health gate; a fault counts against the
    /// server, an answer from a probe brings it back.
    fn run<T>(&self, f: impl FnOnce(&mut Pooled<'_>) -> Outcome<T>) -> Result<T> {
        super::note_server(&self.addr);
        let probe = match self.health.gate(self.now_ms(), self.config.retry_interval) {
            Gate::FailFast => return Err(self.health.dead_error(&self.addr)),
            Gate::Probe => true,
            Gate::Go => false,
        };
        let mut conn = match self.pool.checkout() {
            Ok(c) => c,
            Err(conn::Checkout::Busy(e)) => return Err(self.annotate(e)),
            Err(conn::Checkout::Connect(e)) => {
                let e = self.annotate(e);
                self.fault(probe, &e);
                return Err(e);
            }
        };
        match f(&mut conn) {
            Outcome::Answer(r) => {
                conn.keep();
                if self.health.success(self.now_ms(), probe) {
                    tracing::warn!(server = %self.addr, "newcache: redis server is back");
                }
                r.map_err(|e| self.annotate(e))
            }
            Outcome::Fault(e) => {
                let e = self.annotate(e);
                self.fault(probe, &e);
                Err(e)
            }
        }
    }

    fn fault(&self, probe: bool, e: &Error) {
        self.health.note_fault(e);
        let c = &self.config;
        if self
            .health
            .failure(self.now_ms(), c.failure_limit, c.retry_interval, probe)
        {
            self.pool.clear();
            tracing::warn!(
                server = %self.addr,
                error = %e,
                "newcache: redis server marked dead after {} consecutive failures; probing it \
                 again after {:?} (doubling while probes fail)",
                c.failure_limit,
                c.retry_interval
            );
        }
    }

    /// Refuses a key over the configured limit, or empty, before anything is sent.
    fn check_key(&self, key: &str) -> Result<()> {
        if key.is_empty() || key.len() > self.config.key_limit {
            return Err(Error::new(
                ErrorKind::InvalidKey,
                format!(
                    "a key must be 1 to {} bytes (RedisConfig::key_limit); this one is {}",
                    self.config.key_limit,
                    key.len()
                ),
            ));
        }
        Ok(())
    }

    fn check_value(&self, key: &str, value: &[u8]) -> Result<()> {
        let max = self.max_value_size(key);
        if value.len() > max {
            return Err(Error::new(
                ErrorKind::TooLarge,
                format!(
                    "a value of {} bytes is over the {max}-byte limit (RedisConfig::item_size)",
                    value.len()
                ),
            ));
        }
        Ok(())
    }

    /// One write's command: `SET` (`NX` for an add), or the fenced-write script for a `cas`.
    fn store_cmd(&self, w: &Write<'_>, read_back: bool) -> Result<redis::Cmd> {
        self.check_key(w.key)?;
        self.check_value(w.key, w.value)?;
        let expiry = Expiry::from_exptime(w.exptime);
        let stored = item::encode(self.stamp(), w.flags, w.value);
        Ok(match w.mode {
            StoreMode::Cas(token) => {
                let (mode, n) = expiry.script_args();
                let mut c = evalsha(&self.scripts.cas, w.key);
                c.arg(item::fence(token))
                    .arg(stored)
                    .arg(mode)
                    .arg(n)
                    .arg(if read_back { "1" } else { "0" });
                c
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
                c
            }
        })
    }

    /// Sends `cmd`; a script the server does not know (`NOSCRIPT`: nothing ran) is sent again
    /// with its source.
    fn query(
        conn: &mut Pooled<'_>,
        cmd: &redis::Cmd,
        script: Option<&Script>,
        write: bool,
    ) -> Outcome<Value> {
        match conn.req(cmd) {
            Err(e) if is_noscript(&e) => match script {
                Some(s) => match conn.req(&with_source(cmd, s)) {
                    Ok(v) => Outcome::Answer(Ok(v)),
                    Err(e) => outcome_of(e, write),
                },
                None => outcome_of(e, write),
            },
            Ok(v) => Outcome::Answer(Ok(v)),
            Err(e) => outcome_of(e, write),
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
fn with_source(cmd: &redis::Cmd, s: &Script) -> redis::Cmd {
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

fn is_noscript(e: &redis::RedisError) -> bool {
    e.code() == Some("NOSCRIPT")
}

/// A transport fault (I/O, timeout, a dropped connection) or an error reply; `write` marks a
/// fault as outcome unknown.
fn outcome_of<T>(e: redis::RedisError, write: bool) -> Outcome<T> {
    if e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_connection_refusal() {
        let kind = if e.is_timeout() {
            ErrorKind::Timeout
        } else {
            ErrorKind::Backend
        };
        let message = if e.is_timeout() {
            "no reply in time"
        } else {
            "i/o error talking to the server"
        };
        let fault = Error::with_source(kind, message, e);
        // A write whose reply never came may have been applied: never retried.
        Outcome::Fault(if write {
            fault.with_outcome_unknown()
        } else {
            fault
        })
    } else if e.code() == Some("NOTCOUNTER") {
        Outcome::Answer(Err(Error::new(
            ErrorKind::NotACounter,
            "the value is not a counter newcache wrote (decimal digits in its item format)",
        )))
    } else {
        Outcome::Answer(Err(Error::with_source(
            ErrorKind::Backend,
            "the server refused the command",
            e,
        )))
    }
}

/// An item from stored bytes (or a foreign value: flags 0, no stamp).
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

/// A store's outcome: `SET` answers `OK` or nil (an add that found the key), the script its word.
fn store_outcome(v: &Value, mode: StoreMode) -> Result<StoreOutcome> {
    Ok(match (v, mode) {
        (Value::Okay, _) => StoreOutcome::Stored,
        (Value::Nil, StoreMode::Add) => StoreOutcome::NotStored,
        (Value::SimpleString(s), _) if s == "OK" => StoreOutcome::Stored,
        (Value::ServerError(e), _) => return Err(refused(e.clone())),
        (Value::BulkString(b), _) => match &b[..] {
            b"STORED" => StoreOutcome::Stored,
            b"EXISTS" => StoreOutcome::Exists,
            b"NOT_FOUND" => StoreOutcome::NotFound,
            _ => return Err(Error::backend("the store script answered an unknown word")),
        },
        (other, _) => {
            return Err(Error::backend(format!(
                "a store answered {other:?}, not OK, nil or an outcome"
            )));
        }
    })
}

impl Backend for RedisBackend {
    fn get(&self, key: &str) -> Result<Option<Item>> {
        self.check_key(key)?;
        let mut cmd = redis::cmd("GET");
        cmd.arg(key);
        self.run(|c| match Self::query(c, &cmd, None, false) {
            Outcome::Answer(r) => Outcome::Answer(r.and_then(item_of)),
            Outcome::Fault(e) => Outcome::Fault(e),
        })
    }

    fn get_many(&self, keys: &[&str]) -> Vec<Result<Option<Item>>> {
        let mut out: Vec<Option<Result<Option<Item>>>> = keys
            .iter()
            .map(|k| self.check_key(k).err().map(Err))
            .collect();
        let valid: Vec<&str> = keys
            .iter()
            .zip(&out)
            .filter(|(_, r)| r.is_none())
            .map(|(k, _)| *k)
            .collect();
        if !valid.is_empty() {
            let mut cmd = redis::cmd("MGET");
            for k in &valid {
                cmd.arg(*k);
            }
            let got = self.run(|c| match Self::query(c, &cmd, None, false) {
                Outcome::Answer(Ok(Value::Array(vs))) if vs.len() == valid.len() => {
                    Outcome::Answer(Ok(vs))
                }
                Outcome::Answer(Ok(other)) => Outcome::Fault(Error::backend(format!(
                    "MGET of {} keys answered {other:?}",
                    valid.len()
                ))),
                Outcome::Answer(Err(e)) => Outcome::Answer(Err(e)),
                Outcome::Fault(e) => Outcome::Fault(e),
            });
            match got {
                Ok(values) => {
                    let mut values = values.into_iter();
                    for slot in out.iter_mut().filter(|s| s.is_none()) {
                        *slot = Some(item_of(values.next().unwrap_or(Value::Nil)));
                    }
                }
                Err(e) => {
                    for slot in out.iter_mut().filter(|s| s.is_none()) {
                        *slot = Some(Err(e.clone()));
                    }
                }
            }
        }
        out.into_iter().map(|r| r.unwrap_or(Ok(None))).collect()
    }

    fn store(
        &self,
        mode: StoreMode,
        key: &str,
        value: &[u8],
        flags: u32,
        exptime: u32,
    ) -> Result<StoreOutcome> {
        let w = Write::new(mode, key, value, flags, exptime);
        let cmd = self.store_cmd(&w, false)?;
        let script = matches!(mode, StoreMode::Cas(_)).then_some(&self.scripts.cas);
        self.run(|c| match Self::query(c, &cmd, script, true) {
            Outcome::Answer(r) => Outcome::Answer(r.and_then(|v| store_outcome(&v, mode))),
            Outcome::Fault(e) => Outcome::Fault(e),
        })
    }

    fn store_then_get(&self, w: Write<'_>) -> Result<(StoreOutcome, Option<Item>)> {
        let cmd = self.store_cmd(&w, true)?;
        let mut get = redis::cmd("GET");
        get.arg(w.key);
        self.run(|c| match w.mode {
            // The script answers the outcome and what the key holds after it, in one step.
            StoreMode::Cas(_) => match Self::query(c, &cmd, Some(&self.scripts.cas), true) {
                Outcome::Answer(Ok(Value::Array(mut vs))) if vs.len() == 2 => {
                    let now = vs.pop().unwrap_or(Value::Nil);
                    let outcome = vs.pop().unwrap_or(Value::Nil);
                    Outcome::Answer(
                        store_outcome(&outcome, w.mode).and_then(|o| Ok((o, item_of(now)?))),
                    )
                }
                Outcome::Answer(Ok(other)) => Outcome::Answer(Err(Error::backend(format!(
                    "the store script answered {other:?}"
                )))),
                Outcome::Answer(Err(e)) => Outcome::Answer(Err(e)),
                Outcome::Fault(e) => Outcome::Fault(e),
            },
            // SET then GET, pipelined: one round trip.
            _ => match c.req_pair(&cmd, &get) {
                Ok((stored, now)) => Outcome::Answer(
                    store_outcome(&stored, w.mode).and_then(|o| Ok((o, item_of(now)?))),
                ),
                Err(e) => outcome_of(e, true),
            },
        })
    }

    fn delete(&self, key: &str) -> Result<bool> {
        self.check_key(key)?;
        let mut cmd = redis::cmd("UNLINK");
        cmd.arg(key);
        self.run(|c| match Self::query(c, &cmd, None, true) {
            Outcome::Answer(r) => Outcome::Answer(r.and_then(|v| int_of(&v).map(|n| n > 0))),
            Outcome::Fault(e) => Outcome::Fault(e),
        })
    }

    fn touch(&self, key: &str, exptime: u32) -> Result<bool> {
        self.check_key(key)?;
        let mut cmd = match Expiry::from_exptime(exptime) {
            Expiry::Never => redis::cmd("PERSIST"),
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
        let never = exptime == 0;
        if never {
            cmd.arg(key);
            // PERSIST answers 0 for a key that exists without an expiry: ask EXISTS too.
            let mut exists = redis::cmd("EXISTS");
            exists.arg(key);
            return self.run(|c| match c.req_pair(&cmd, &exists) {
                Ok((_, e)) => Outcome::Answer(int_of(&e).map(|n| n > 0)),
                Err(e) => outcome_of(e, true),
            });
        }
        self.run(|c| match Self::query(c, &cmd, None, true) {
            Outcome::Answer(r) => Outcome::Answer(r.and_then(|v| int_of(&v).map(|n| n > 0))),
            Outcome::Fault(e) => Outcome::Fault(e),
        })
    }

    fn incr(&self, key: &str, delta: u64) -> Result<Option<u64>> {
        self.arith(key, delta, "+")
    }

    fn decr(&self, key: &str, delta: u64) -> Result<Option<u64>> {
        self.arith(key, delta, "-")
    }

    fn flush_all(&self) -> Result<()> {
        Err(Error::new(
            ErrorKind::Unsupported,
            "flush_all on redis is not built yet: clear() will remove this cache's keys by prefix",
        ))
    }

    fn max_value_size(&self, key: &str) -> usize {
        max_value_size(self.config.item_size, key)
    }
}

impl RedisBackend {
    fn arith(&self, key: &str, delta: u64, op: &str) -> Result<Option<u64>> {
        self.check_key(key)?;
        let mut cmd = evalsha(&self.scripts.arith, key);
        cmd.arg(delta.to_string())
            .arg(op)
            .arg(&self.stamp().to_be_bytes()[..]);
        self.run(
            |c| match Self::query(c, &cmd, Some(&self.scripts.arith), true) {
                Outcome::Answer(Ok(Value::Nil)) => Outcome::Answer(Ok(None)),
                Outcome::Answer(Ok(Value::BulkString(b))) => Outcome::Answer(
                    std::str::from_utf8(&b)
                        .ok()
                        .and_then(|s| s.parse().ok())
                        .map(Some)
                        .ok_or_else(|| Error::backend("the counter script answered no number")),
                ),
                Outcome::Answer(Ok(other)) => Outcome::Answer(Err(Error::backend(format!(
                    "the counter script answered {other:?}"
                )))),
                Outcome::Answer(Err(e)) => Outcome::Answer(Err(e)),
                Outcome::Fault(e) => Outcome::Fault(e),
            },
        )
    }
}

fn int_of(v: &Value) -> Result<i64> {
    match v {
        Value::Int(n) => Ok(*n),
        Value::ServerError(e) => Err(refused(e.clone())),
        other => Err(Error::backend(format!(
            "expected an integer, the server answered {other:?}"
        ))),
    }
}

/// An error reply inside a pipeline (out of memory, a wrong type...): the server answered.
fn refused(e: redis::ServerError) -> Error {
    Error::with_source(
        ErrorKind::Backend,
        "the server refused the command",
        redis::RedisError::from(e),
    )
}
