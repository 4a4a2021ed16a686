//! This process's connections as the server knows them (`CLIENT INFO`'s `id=` and `addr=`,
//! learned when each is opened), and those it dropped with a request perhaps still in the
//! network: a replay closes them on the server (`CLIENT KILL ID <id> ADDR <addr>`) before its
//! deletes, so that a write delayed past the replay finds no connection to land on.
//!
//! `KILL`'s filters are ANDed: a restarted server hands out ids from 1 again, and the address
//! makes sure no other client's connection is closed. A server or user that refuses `CLIENT`
//! (`NOPERM`: `CLIENT KILL` is `@admin @dangerous`; an old server without `CLIENT INFO`) costs
//! only this protection: warned once, the replay goes on without it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use redis::Value;

use super::reply;

/// Dropped connections remembered at most (the oldest are forgotten first: by then they are
/// long closed, or their delayed bytes long landed).
const REMEMBERED: usize = 1_000;

/// One connection as the server knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ClientId {
    id: u64,
    addr: String,
}

/// `CLIENT INFO`: this connection's id and address, sent once it is open.
pub(super) fn info() -> redis::Cmd {
    let mut cmd = redis::cmd("CLIENT");
    cmd.arg("INFO");
    cmd
}

/// `CLIENT KILL ID <id> ADDR <addr>`: answers how many it closed (0 or 1).
pub(super) fn kill(c: &ClientId) -> redis::Cmd {
    let mut cmd = redis::cmd("CLIENT");
    cmd.arg("KILL").arg("ID").arg(c.id).arg("ADDR").arg(&c.addr);
    cmd
}

/// The id and address in a `CLIENT INFO` reply (`id=7 addr=127.0.0.1:50412 laddr=...`).
fn parse(v: &Value) -> Option<ClientId> {
    let text = match v {
        Value::BulkString(b) => std::str::from_utf8(b).ok()?,
        Value::VerbatimString { text, .. } => text,
        Value::SimpleString(s) => s,
        _ => return None,
    };
    let field = |name: &str| {
        text.split_ascii_whitespace()
            .find_map(|f| f.strip_prefix(name)?.strip_prefix('='))
    };
    Some(ClientId {
        id: field("id")?.parse().ok()?,
        addr: field("addr").filter(|a| !a.is_empty())?.to_owned(),
    })
}

/// One server's record of this process's dropped connections (shared by both views).
#[derive(Debug)]
pub(super) struct Clients {
    /// `host:port`, for the warning.
    server: String,
    dropped: Mutex<VecDeque<ClientId>>,
    /// Set once a refusal of `CLIENT` was warned about.
    warned: AtomicBool,
}

impl Clients {
    pub(super) fn new(server: String) -> Clients {
        Clients {
            server,
            dropped: Mutex::new(VecDeque::new()),
            warned: AtomicBool::new(false),
        }
    }

    /// What the reply `r` to [`info`] says of a connection just opened: its id (`None` if the
    /// server refused the command: warned once); `Err` if no reply came (the connect failed).
    pub(super) fn learned(
        &self,
        r: redis::RedisResult<Value>,
    ) -> redis::RedisResult<Option<ClientId>> {
        match r.and_then(Value::extract_error) {
            Ok(v) => Ok(parse(&v)),
            // The server refused the connection itself, not the command.
            Err(e) if reply::at_maxclients(e.code(), e.detail()) => Err(e),
            Err(e) => match e.code() {
                Some(code) => {
                    self.refused(code, e.detail());
                    Ok(None)
                }
                None => Err(e),
            },
        }
    }

    /// Connection `c` was dropped with a request perhaps unanswered: the next replay closes it.
    pub(super) fn dropped(&self, c: Option<ClientId>) {
        let Some(c) = c else { return };
        let mut dropped = self.dropped.lock();
        if dropped.len() == REMEMBERED {
            dropped.pop_front();
        }
        dropped.push_back(c);
    }

    /// The dropped connections a replay is to close.
    pub(super) fn to_close(&self) -> Vec<ClientId> {
        self.dropped.lock().iter().cloned().collect()
    }

    /// A replay closed `closed` (or was refused: asking again would not help).
    pub(super) fn closed(&self, closed: &[ClientId]) {
        if !closed.is_empty() {
            self.dropped.lock().retain(|c| !closed.contains(c));
        }
    }

    /// The server refused `CLIENT` (`CLIENT INFO` at a connect, or a replay's `CLIENT KILL`)
    /// with error `code`: warned once. Not for a refusal of the credentials (`NOAUTH`,
    /// `WRONGPASS`): the server refuses every command then, and the denial's own warning names
    /// the fix (the URL's password), which a warning about `CLIENT` grants would hide.
    pub(super) fn refused(&self, code: &str, detail: Option<&str>) {
        if reply::refuses_credentials(code) {
            return;
        }
        if !self.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                server = %self.server,
                error = %format!("{code} {}", detail.unwrap_or_default()).trim_end(),
                "newcache: redis refused CLIENT INFO or CLIENT KILL (warned once): a replay \
                 cannot close the connections this process dropped during an outage, so a \
                 write whose bytes were delayed in the network past the replay may bring back \
                 a value it deleted; grant the URL's user +client|info and +client|kill"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn check(reply: &[u8], expected: Option<(u64, &str)>) {
        let v = Value::BulkString(reply.to_vec());
        let got = parse(&v);
        let want = expected.map(|(id, addr)| ClientId {
            id,
            addr: addr.to_owned(),
        });
        assert_eq!(got, want, "{}", String::from_utf8_lossy(reply));
    }

    #[test]
    fn client_info_gives_the_id_and_address() {
        check(
            b"id=7 addr=127.0.0.1:50412 laddr=127.0.0.1:6379 fd=8 name= age=0\n",
            Some((7, "127.0.0.1:50412")),
        );
        check(
            b"id=12 addr=[::1]:40000 laddr=[::1]:6379",
            Some((12, "[::1]:40000")),
        );
        check(
            b"laddr=127.0.0.1:6379 addr=10.0.0.2:1 id=3",
            Some((3, "10.0.0.2:1")),
        );
        check(b"id=x addr=127.0.0.1:1", None);
        check(b"id=1 addr=", None);
        check(b"id=1", None);
        check(b"", None);
    }

    #[test]
    fn dropped_connections_are_bounded_and_closed_once() {
        let c = Clients::new("s:1".into());
        let id = |n| ClientId {
            id: n,
            addr: "a:1".into(),
        };
        for n in 0..(REMEMBERED as u64 + 5) {
            c.dropped(Some(id(n)));
        }
        c.dropped(None);
        let all = c.to_close();
        assert_eq!(all.len(), REMEMBERED);
        assert_eq!(all[0], id(5), "the oldest forgotten first");
        c.dropped(Some(id(9_999)));
        c.closed(&all);
        assert_eq!(
            c.to_close(),
            vec![id(9_999)],
            "one dropped during the replay stays"
        );
    }

    #[test]
    fn a_refused_client_info_is_no_id_and_no_error() {
        let c = Clients::new("s:1".into());
        let refusal = redis::parse_redis_value(b"-NOPERM no permission\r\n").unwrap();
        assert_eq!(c.learned(Ok(refusal)).unwrap(), None);
        let io = redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut));
        assert!(c.learned(Err(io)).is_err(), "no reply: the connect failed");
    }
}
