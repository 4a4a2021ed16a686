//! What a node offers for a fenced write (a `cas`: a claim, a placeholder over a dead claim, a
//! loader's store against its claim), learned once per node and remembered.
//!
//! - **Lua**: the compare-and-set script (`script.rs`), one step on the server. Counters need
//!   it too.
//! - **`SET … IFEQ`** (Valkey 8.1 and later, Redis 8.4 and later) without scripting: the key is
//!   read, its token compared here, and the new value written only if the key still holds the
//!   very bytes read ([`compare`]); two round trips, as fenced as the script.
//! - **Neither** (`EVAL`/`EVALSHA` renamed away, a common hardening of managed servers, or a
//!   Redis-compatible server without scripting, and no `IFEQ`): items read from the node carry
//!   the token 0, as a memcached started with `-C` reports, and a `cas` is refused before
//!   anything is sent, so a loader fails before it runs and `get` serves a stale value
//!   unclaimed; plain reads, writes and deletes work.
//!
//! Such a server answers a call to a command it lacks with an error line that copies the
//! call's first arguments, binary ones included: redis-rs's async reader drops the whole
//! connection on an error line that is not UTF-8. So nothing binary is sent as a script before
//! the node is known to run scripts: the probe's words are all ASCII.

use std::sync::atomic::{AtomicU8, Ordering};

use redis::Value;

use super::item;
use crate::backend::{Item, StoreOutcome};

/// A node's fenced write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fence {
    /// Lua scripting: the fenced-write and counter scripts.
    Lua,
    /// No scripting, but `SET … IFEQ`.
    IfEq,
    /// Neither: no fenced write, no counters.
    None,
}

impl Fence {
    /// What the node lacks, for an error or a warning; `None` for a node with scripting.
    pub(crate) fn missing(self) -> Option<&'static str> {
        match self {
            Fence::Lua => None,
            Fence::IfEq => Some(
                "scripting (EVAL and EVALSHA are unknown commands: renamed away or absent); \
                 fenced writes use SET IFEQ, counters (incr, decr) need scripting",
            ),
            Fence::None => Some(
                "scripting (EVAL and EVALSHA are unknown commands: renamed away or absent) and \
                 SET IFEQ; claims, placeholders and a loader's fenced store need one of them, \
                 and counters need scripting (plain get, set, add and delete work)",
            ),
        }
    }
}

/// A node's [`Fence`], once learned (by the probe, [`read_probe`]).
#[derive(Debug, Default)]
pub(crate) struct Known(AtomicU8);

impl Known {
    /// The fence, if learned.
    pub(crate) fn get(&self) -> Option<Fence> {
        match self.0.load(Ordering::Relaxed) {
            1 => Some(Fence::Lua),
            2 => Some(Fence::IfEq),
            3 => Some(Fence::None),
            _ => None,
        }
    }

    /// Remembers `f`; `true` the first time (the caller then says what it learned).
    pub(crate) fn learn(&self, f: Fence) -> bool {
        let code = match f {
            Fence::Lua => 1,
            Fence::IfEq => 2,
            Fence::None => 3,
        };
        self.0.swap(code, Ordering::Relaxed) != code
    }
}

/// The source of the probe's script: it writes nothing.
pub(crate) const PROBE_SCRIPT: &str = "return 1";

/// What the probe's replies say: `EVAL "return 1" 0`, `EVALSHA <its sha> 0` (the script or
/// `NOSCRIPT`), `COMMAND DOCS SET` (does `SET` take `IFEQ`). An answer that says nothing about
/// the command (a server not serving yet: `LOADING`, `BUSY`, ...) is `Err` with that reply, and
/// nothing is learned. A refusal by the ACL (`NOPERM`) says the command exists: scripting is
/// taken as there, and the scripts' refusals say what the ACL lacks, as before.
pub(crate) fn read_probe(eval: &Value, evalsha: &Value, docs: &Value) -> Result<Fence, Value> {
    let absent = |v: &Value| -> Result<bool, Value> {
        match v {
            Value::ServerError(e) if super::reply::unknown_command(e.code(), e.details()) => {
                Ok(true)
            }
            Value::ServerError(e) if super::reply::not_serving_yet(e.code(), e.details()) => {
                Err(v.clone())
            }
            _ => Ok(false),
        }
    };
    if !absent(eval)? && !absent(evalsha)? {
        return Ok(Fence::Lua);
    }
    Ok(if names_ifeq(docs) {
        Fence::IfEq
    } else {
        Fence::None
    })
}

/// Whether a `COMMAND DOCS SET` reply names the `IFEQ` argument anywhere (an error reply, from
/// a server without `COMMAND DOCS` or with `COMMAND` renamed, names nothing).
fn names_ifeq(v: &Value) -> bool {
    match v {
        Value::BulkString(b) => b.eq_ignore_ascii_case(b"ifeq"),
        Value::SimpleString(s) => s.eq_ignore_ascii_case("ifeq"),
        Value::Array(vs) | Value::Set(vs) => vs.iter().any(names_ifeq),
        Value::Map(kvs) => kvs.iter().any(|(k, v)| names_ifeq(k) || names_ifeq(v)),
        _ => false,
    }
}

/// What a fenced write of `token` is on a node with `IFEQ`, given what the key holds
/// (`before`, read just now): answered at once (the key holds another version, or nothing), or
/// written `IFEQ` the stored bytes read, so that a write landing between the read and the `SET`
/// makes the `SET` write nothing.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Compared {
    /// No write: the outcome.
    Answer(StoreOutcome),
    /// `SET … IFEQ` these stored bytes.
    Send(Vec<u8>),
}

/// [`Compared`] for a `cas` of `token` over `before`.
pub(crate) fn compare(token: u64, before: Option<&Item>) -> Compared {
    match before {
        None => Compared::Answer(StoreOutcome::NotFound),
        Some(i) if i.cas != token => Compared::Answer(StoreOutcome::Exists),
        Some(i) => Compared::Send(item::stored(i)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(code: &str, detail: &str) -> Value {
        let e = redis::parse_redis_value(format!("-{code} {detail}\r\n").as_bytes()).unwrap();
        assert!(matches!(e, Value::ServerError(_)), "{e:?}");
        e
    }

    fn docs(words: &[&str]) -> Value {
        Value::Array(vec![
            Value::BulkString(b"set".to_vec()),
            Value::Array(
                words
                    .iter()
                    .map(|w| Value::BulkString(w.as_bytes().to_vec()))
                    .collect(),
            ),
        ])
    }

    #[track_caller]
    fn check(eval: Value, evalsha: Value, docs: Value, expected: Result<Fence, ()>) {
        assert_eq!(read_probe(&eval, &evalsha, &docs).map_err(drop), expected);
    }

    #[test]
    fn a_probe_tells_scripting_ifeq_or_neither() {
        let gone = || {
            error(
                "ERR",
                "unknown command 'EVAL', with args beginning with: 'x'",
            )
        };
        let noscript = || error("NOSCRIPT", "No matching script.");
        let ifeq = || docs(&["token", "IFEQ", "nx"]);
        check(Value::Int(1), Value::Int(1), docs(&[]), Ok(Fence::Lua));
        check(Value::Int(1), noscript(), ifeq(), Ok(Fence::Lua));
        check(gone(), gone(), ifeq(), Ok(Fence::IfEq));
        check(Value::Int(1), gone(), ifeq(), Ok(Fence::IfEq));
        check(gone(), noscript(), docs(&["NX"]), Ok(Fence::None));
        check(
            gone(),
            gone(),
            error("ERR", "unknown command 'COMMAND'"),
            Ok(Fence::None),
        );
        // The ACL's refusal: the command exists.
        let denied = error(
            "NOPERM",
            "this user has no permissions to run the 'eval' command",
        );
        check(denied.clone(), denied, docs(&[]), Ok(Fence::Lua));
        // Not serving yet: nothing learned.
        check(
            error("LOADING", "Redis is loading"),
            noscript(),
            ifeq(),
            Err(()),
        );
    }

    #[test]
    fn a_fence_by_comparison_answers_or_sends_the_stored_bytes() {
        let ours = Item {
            value: bytes::Bytes::from_static(b"abc"),
            flags: 7,
            cas: 42,
        };
        assert_eq!(compare(42, None), Compared::Answer(StoreOutcome::NotFound));
        assert_eq!(
            compare(41, Some(&ours)),
            Compared::Answer(StoreOutcome::Exists)
        );
        assert_eq!(
            compare(42, Some(&ours)),
            Compared::Send(item::encode(42, 7, b"abc"))
        );
        let raw = b"written by another client".to_vec();
        let foreign = Item {
            cas: item::foreign_token(&raw),
            value: raw.clone().into(),
            flags: 0,
        };
        assert_eq!(compare(foreign.cas, Some(&foreign)), Compared::Send(raw));
    }
}
