//! What a Redis reply or a redis-rs error means: a transport fault (counts toward marking the
//! server dead) or an answer (an error reply, a denial of credentials or permission), a
//! server not serving yet, a cluster's redirect (`MOVED`, `ASK`) or refusal (`CLUSTERDOWN`,
//! `TRYAGAIN`), a missing script (`NOSCRIPT`), a refused connection (`maxclients`). Every
//! other module asks here; no I/O.

use redis::Value;

use crate::error::{Error, ErrorKind};

/// Why a request got no answer.
#[derive(Debug)]
pub(crate) enum Failure {
    /// A transport fault (I/O, timeout, a dropped connection): it counts against the server.
    Fault(Error),
    /// Nothing against the server (a local wait, a connection whose runtime ended).
    Local(Error),
}

impl Failure {
    pub(super) fn error(&self) -> &Error {
        match self {
            Failure::Fault(e) | Failure::Local(e) => e,
        }
    }

    /// This failure, nothing of the request sent ([`Error::unsent`]).
    pub(crate) fn unsent(self) -> Failure {
        match self {
            Failure::Fault(e) => Failure::Fault(e.unsent()),
            Failure::Local(e) => Failure::Local(e.unsent()),
        }
    }
}

/// A `redis` crate error as the source of an [`Error`]: each cause said once. redis-rs's error
/// prints its cause's text and also returns that cause from `source()` (an I/O error, an error
/// reply), so a reporter walking the chain would say it twice; this prints an error reply as
/// the server sent it (`ERR DB index is out of range`) and passes over a cause that says the
/// same.
#[derive(Debug)]
pub(crate) struct Cause(pub(crate) redis::RedisError);

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.0.code(), self.0.detail()) {
            (Some(code), Some(detail)) => write!(f, "{code} {detail}"),
            (Some(code), None) => f.write_str(code),
            _ => std::fmt::Display::fmt(&self.0, f),
        }
    }
}

impl std::error::Error for Cause {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        let inner = std::error::Error::source(&self.0)?;
        if self.0.code().is_some() || inner.to_string() == self.0.to_string() {
            return inner.source();
        }
        Some(inner)
    }
}

/// The redis-rs error a newcache error's source is, if it is one.
pub(super) fn redis_cause(e: &Error) -> Option<&redis::RedisError> {
    let c = std::error::Error::source(e)?.downcast_ref::<Cause>()?;
    Some(&c.0)
}

/// A `redis` crate error as a transport fault (`write`: the command may have run) or an answer.
pub(crate) fn failure_of(e: redis::RedisError, write: bool) -> Failure {
    classify(e, false, write)
}

/// A failed connect (with its set-up: the TLS handshake, `AUTH`, `SELECT`): a transport fault
/// unless the server answered (refused the credentials, the handshake, the database).
pub(crate) fn connect_failure(e: redis::RedisError) -> Failure {
    classify(e, true, false)
}

/// A failed connect whose `SELECT` of database `db` may have been refused: as
/// [`connect_failure`], but a server without that database (`DB index is out of range`, as
/// Redis and Valkey say) is named for it, a configuration error, not the server's fault.
pub(crate) fn select_failure(e: redis::RedisError, db: i64) -> Failure {
    if e.code() == Some("ERR")
        && e.detail()
            .is_some_and(|d| d.contains("DB index is out of range"))
    {
        // The server's words are the source's, not repeated here.
        let message = format!(
            "the server refused the URL's database {db} (SELECT; a server has `databases` of \
             them, 16 by default, numbered from 0)"
        );
        return Failure::Local(Error::with_source(ErrorKind::Backend, message, Cause(e)));
    }
    connect_failure(e)
}

/// Whether an error reply is a server's refusal of a new connection: at `maxclients` it writes
/// `-ERR max number of clients reached` on accept, before reading anything, and closes the
/// connection, so the reply comes as the answer to the first command of the set-up (`AUTH`,
/// `SELECT`, `CLIENT INFO`). Nothing was run: a fault like a refused connect, not an answer.
/// A cluster node says `max number of clients + cluster connections reached`.
pub(super) fn at_maxclients(code: Option<&str>, detail: Option<&str>) -> bool {
    code == Some("ERR") && detail.is_some_and(|d| d.starts_with("max number of clients"))
}

fn classify(e: redis::RedisError, connect: bool, write: bool) -> Failure {
    if connect && at_maxclients(e.code(), e.detail()) {
        // No source: not the server's answer to a command ([`answered`]), so a delete it
        // refused is queued for replay.
        return Failure::Fault(Error::new(
            ErrorKind::Backend,
            format!(
                "could not connect: the server refused the connection (ERR {}: its \
                 `maxclients`)",
                e.detail().unwrap_or_default()
            ),
        ));
    }
    // The server answered, and said no: the configuration, not the server, is at fault.
    if e.kind() == redis::ErrorKind::AuthenticationFailed {
        return Failure::Local(Error::new(
            ErrorKind::Denied,
            "the server refused the URL's user and password (AUTH failed: a wrong password, \
             an unknown or disabled user)",
        ));
    }
    if let Some(denied) = e.code().and_then(|code| denial(code, e.detail())) {
        return Failure::Local(denied);
    }
    #[cfg(feature = "redis-tls")]
    if let Some(why) = super::tls::refusal(&e) {
        let e = Error::backend(why);
        return Failure::Local(if write { e.with_outcome_unknown() } else { e });
    }
    if e.code().is_some() {
        // An error reply (the client libraries give most inline, as `Value::ServerError`): the
        // server answered.
        // What the server said is the source.
        let message = if connect {
            "could not connect: the server refused the connection's set-up"
        } else {
            "the server refused the command"
        };
        return Failure::Local(Error::with_source(ErrorKind::Backend, message, Cause(e)));
    }
    let kind = if e.is_timeout() {
        ErrorKind::Timeout
    } else {
        ErrorKind::Backend
    };
    let message = match (connect, e.is_timeout()) {
        (true, _) => "could not connect",
        (false, true) => "no reply in time",
        (false, false) => "i/o error talking to the server",
    };
    let fault = Error::with_source(kind, message, Cause(e));
    // A write whose reply never came may have been applied: never retried.
    Failure::Fault(if write {
        fault.with_outcome_unknown()
    } else {
        fault
    })
}

/// The error of a server's refusal by its error code (`code`, then `detail`), if it is one of
/// credentials or permission: `NOPERM` names the command the user's ACL lacks.
pub(super) fn denial(code: &str, detail: Option<&str>) -> Option<Error> {
    let detail = detail.unwrap_or_default();
    let message = match code {
        "NOPERM" => format!(
            "NOPERM {detail} (newcache needs GET, MGET, SET, EXISTS, PERSIST, PEXPIRE, \
             EXPIREAT, UNLINK, SCAN, and EVAL and EVALSHA for its fenced writes and counters; \
             WAIT with redis_wait; SELECT for a database other than 0)"
        ),
        "WRONGPASS" => "the server refused the URL's user and password (WRONGPASS)".to_owned(),
        "NOAUTH" => "the server requires a password (NOAUTH): give it in the URL, \
                     redis://user:password@host:port/db"
            .to_owned(),
        _ => return None,
    };
    Some(Error::new(ErrorKind::Denied, message))
}

/// Whether `e` is the server's own answer (an error reply, a denial) by a server that serves:
/// the command reached it and was refused, so nothing is to be replayed for it. A server not
/// serving yet (`LOADING`, ...) missed the command as one out of reach would.
pub(super) fn answered(e: &Error) -> bool {
    e.is_denied() || (refusal_code(e).is_some() && !refused_not_serving_yet(e))
}

/// Whether an error reply refuses the connection's credentials (`NOAUTH`, `WRONGPASS`): the
/// server refuses every command then.
pub(super) fn refuses_credentials(code: &str) -> bool {
    matches!(code, "NOAUTH" | "WRONGPASS")
}

/// Whether an error reply says the server does not know the command (`ERR unknown command`).
pub(super) fn unknown_command(code: &str, detail: Option<&str>) -> bool {
    code == "ERR" && detail.is_some_and(|d| d.to_ascii_lowercase().starts_with("unknown command"))
}

/// Whether a reply is `NOSCRIPT` (the server ran nothing).
pub(super) fn is_noscript(v: &Value) -> bool {
    matches!(v, Value::ServerError(e) if e.code() == "NOSCRIPT")
}

/// An error reply: the server answered (out of memory, a wrong type, a command the ACL user
/// may not run, ...), nothing against it.
pub(super) fn refused(e: redis::ServerError) -> Error {
    if let Some(denied) = denial(e.code(), e.details()) {
        return denied;
    }
    if e.code() == "CLUSTERDOWN" {
        // Its keys alone: the node serves the others (`cluster-require-full-coverage no`), or
        // refuses every key while the cluster is down. What the node said tells which.
        return Error::with_source(
            ErrorKind::Backend,
            "the cluster refused the command",
            Cause(redis::RedisError::from(e)),
        );
    }
    if e.code() == "NOTCOUNTER" {
        return Error::new(
            ErrorKind::NotACounter,
            "the value is not a counter newcache wrote (decimal digits in its item format)",
        );
    }
    Error::with_source(
        ErrorKind::Backend,
        "the server refused the command",
        Cause(redis::RedisError::from(e)),
    )
}

/// Whether an error reply (its `code`, then its `detail`) says the server is not serving yet:
/// it is loading its data (`LOADING`, after a restart), running a script past its time limit
/// (`BUSY`), a replica that lost its master (`MASTERDOWN`), or a node of a cluster that is
/// down (`CLUSTERDOWN The cluster is down`: a slot unassigned under
/// `cluster-require-full-coverage yes`, no majority; `... and only accepts read commands`
/// too). It refuses every write meanwhile and serves again later with the data it holds: a
/// write or delete it refused this way missed it, as one sent while it was out of reach did.
/// Not `CLUSTERDOWN Hash slot not served`: one slot's keys alone, whose refusal must not hold
/// up the replay of the node's other keys (a failed replay fails every call of the node).
pub(super) fn not_serving_yet(code: &str, detail: Option<&str>) -> bool {
    match code {
        "LOADING" | "BUSY" | "MASTERDOWN" => true,
        "CLUSTERDOWN" => detail.is_some_and(|d| d.starts_with("The cluster is down")),
        _ => false,
    }
}

/// The error reply `e` reports (its code, `READONLY`, `LOADING`, ..., and detail), if it
/// reports one.
fn refusal(e: &Error) -> Option<(&str, Option<&str>)> {
    let r = redis_cause(e)?;
    Some((r.code()?, r.detail()))
}

/// The code of the error reply `e` reports (`READONLY`, `LOADING`, ...), if it reports one.
pub(super) fn refusal_code(e: &Error) -> Option<&str> {
    refusal(e).map(|(code, _)| code)
}

/// Whether `e` is an error reply of a server not serving yet ([`not_serving_yet`]).
pub(super) fn refused_not_serving_yet(e: &Error) -> bool {
    refusal(e).is_some_and(|(code, detail)| not_serving_yet(code, detail))
}

/// The redirect `e` reports, if it is one (`MOVED`, `ASK`).
pub(super) fn redirect_of(e: &Error) -> Option<Redirect> {
    let r = redis_cause(e)?;
    redirect(r.code()?, r.detail())
}

/// Whether `e` may mean the node is gone (a transport fault, a dead node): not an answer (an
/// error reply, a denial, a `WAIT` short of replicas).
pub(super) fn is_fault(e: &Error) -> bool {
    (e.is_backend() || e.is_timeout())
        && !e.is_denied()
        && refusal_code(e).is_none()
        && !is_wait_failure(e)
}

/// Whether `e` is a node's `CLUSTERDOWN` or `TRYAGAIN`: the node ran nothing, and the map may
/// name it for slots it no longer serves (a node wiped and started again at a master's
/// address serves none, knows no cluster and so never redirects: only the other nodes know
/// where its slots went).
pub(super) fn is_cluster_refusal(e: &Error) -> bool {
    matches!(refusal_code(e), Some("CLUSTERDOWN" | "TRYAGAIN"))
}

/// A redirect a node answered for a key of a slot it does not serve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Redirect {
    /// `MOVED slot host:port`: the slot is served there now (the command was not run).
    Moved { slot: u16, addr: String },
    /// `ASK slot host:port`: the slot is migrating and the key may be there: send `ASKING` and
    /// the command to that node, once, without changing the map.
    Ask { addr: String },
}

/// The redirect an error reply's `code` and `detail` (`"3999 127.0.0.1:7002"`) make, if it is
/// one.
pub(super) fn redirect(code: &str, detail: Option<&str>) -> Option<Redirect> {
    let (slot, addr) = detail?.trim().split_once(' ')?;
    let slot: u16 = slot
        .parse()
        .ok()
        .filter(|&s| (s as usize) < super::slots::SLOTS)?;
    // `host:port`, an IPv6 host unbracketed (`::1:7002`): the port follows the last colon.
    let (host, port) = addr.trim().rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    // A node that does not know its own address names it ":port".
    if host.is_empty() {
        return None;
    }
    let addr = super::slots::addr_of(host, port);
    match code {
        "MOVED" => Some(Redirect::Moved { slot, addr }),
        "ASK" => Some(Redirect::Ask { addr }),
        _ => None,
    }
}

/// The start of a [`Request::answer`](super::request::Request::answer) error for a `WAIT` that fell short or was refused.
pub(super) const WAIT_SHORT: &str = "WAIT: ";

/// Whether `e` is a write's `WAIT` that fell short or was refused after the write succeeded
/// ([`Request::answer`](super::request::Request::answer)): the server's answer, never a fault, nor a write it missed.
pub(super) fn is_wait_failure(e: &Error) -> bool {
    e.to_string().contains(WAIT_SHORT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redirects_are_read_from_their_detail() {
        let moved = |slot, addr: &str| {
            Some(Redirect::Moved {
                slot,
                addr: addr.into(),
            })
        };
        let ask = |addr: &str| Some(Redirect::Ask { addr: addr.into() });
        #[rustfmt::skip]
        let table: &[(&str, Option<&str>, Option<Redirect>)] = &[
            ("MOVED", Some("3999 127.0.0.1:6381"), moved(3999, "127.0.0.1:6381")),
            ("ASK", Some("3999 127.0.0.1:6381"), ask("127.0.0.1:6381")),
            // IPv6, as Redis prints it (no brackets), or bracketed: the map's form either way.
            ("MOVED", Some("8831 ::1:37853"), moved(8831, "[::1]:37853")),
            ("MOVED", Some("8831 [::1]:37853"), moved(8831, "[::1]:37853")),
            ("ASK", Some("1 fe80::1:2:7000"), ask("[fe80::1:2]:7000")),
            ("MOVED", Some("3999 :6381"), None),
            ("MOVED", Some("3999 127.0.0.1"), None),
            ("MOVED", Some("99999 127.0.0.1:6381"), None),
            ("ERR", Some("3999 127.0.0.1:6381"), None),
            ("MOVED", None, None),
        ];
        for (code, detail, expected) in table {
            assert_eq!(&redirect(code, *detail), expected, "{code} {detail:?}");
        }
    }

    #[test]
    fn a_server_not_serving_yet_is_told_by_its_refusal() {
        #[rustfmt::skip]
        let table = [
            ("LOADING", Some("Redis is loading the dataset in memory"), true),
            ("BUSY", None, true),
            ("MASTERDOWN", Some("Link with MASTER is down"), true),
            ("CLUSTERDOWN", Some("The cluster is down"), true),
            ("CLUSTERDOWN", Some("The cluster is down and only accepts read commands"), true),
            // One slot's keys alone: an answer, lest it hold up the node's replay.
            ("CLUSTERDOWN", Some("Hash slot not served"), false),
            ("CLUSTERDOWN", None, false),
            ("READONLY", Some("You can't write against a read only replica."), false),
            ("MOVED", Some("3999 127.0.0.1:7002"), false),
        ];
        for (code, detail, expected) in table {
            assert_eq!(not_serving_yet(code, detail), expected, "{code} {detail:?}");
        }
    }
}
