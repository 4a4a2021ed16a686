//! A new connection's set-up, sent by newcache rather than by redis-rs: `AUTH` (with RESP2),
//! `SELECT` and `CLIENT INFO` ([`clients::info`](super::clients::info)); on the sync pool and
//! the bus, whose connections are newcache's own (`blocking.rs`), RESP3's `HELLO` too
//! ([`SetUp::whole`]), all sent by [`SetUp::open`].
//!
//! On the async view redis-rs is left RESP3's `HELLO`, which carries the credentials (a server
//! refusing it keeps its reply), and `CLIENT SETINFO` ([`SetUp::split`]). Its `AUTH` does not
//! keep the reply: it reads any refusal as "authentication failed" and drops the server's
//! words, and at `maxclients` those are `-ERR max number of clients reached`, written on accept
//! whatever the first command is: a fault (a delete it refused is queued for replay), not wrong
//! credentials. redis-rs's sync connection read each of its set-up's replies within the whole
//! connect timeout, however long the one before took; here, each is read within what is left of
//! it.

use std::time::{Duration, Instant};

use redis::{RedisConnectionInfo, Value};

use super::blocking::Blocking;
use super::reply::{self, Failure, at_maxclients, connect_failure, denial, select_failure};
use crate::error::{Error, ErrorKind};

/// What a connection's set-up sends: on the async view after redis-rs's (RESP3's `HELLO`,
/// `CLIENT SETINFO`), on the sync pool all of it. Not `Debug`: it holds the password.
pub(super) struct SetUp {
    /// `HELLO 3 [AUTH user password]`: RESP3 on a connection of the sync pool ([`SetUp::whole`]).
    hello: Option<redis::Cmd>,
    /// `AUTH [user] password`: RESP2 with a password.
    auth: Option<redis::Cmd>,
    /// `AUTH password`, sent again when `AUTH user password` is refused for its form (a server
    /// older than Redis 6, or a proxy speaking the old form), as redis-rs does.
    old_auth: Option<redis::Cmd>,
    /// The database to `SELECT`, when not 0.
    db: Option<i64>,
    /// The password, hidden in a refusal's words a server may echo it in (`ERR unknown
    /// command 'AUTH', with args beginning with: ...`).
    password: Option<String>,
}

/// What an `AUTH`'s reply says, when not a failure.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Auth {
    /// Authenticated.
    Done,
    /// Send the set-up again with `AUTH`'s old form, without the user.
    Again,
}

impl SetUp {
    /// `settings` split in two: what redis-rs is to send (RESP3's `HELLO`, if any, and with
    /// `set_lib_name` `CLIENT SETINFO`; no `AUTH`, no `SELECT`), and the rest, sent here.
    ///
    /// The async view wants `CLIENT SETINFO` (its replies ignored, refused or not): redis-rs
    /// reads its set-up's replies before the connection's driver runs, so the server's first
    /// words (at `maxclients` its refusal, with TLS a refused handshake's alert) come as their
    /// answer; a command sent after the driver started might find them read and dropped.
    pub(super) fn split(
        settings: &RedisConnectionInfo,
        set_lib_name: bool,
    ) -> (RedisConnectionInfo, SetUp) {
        let resp3 = settings.protocol().supports_resp3();
        let mut left = RedisConnectionInfo::default().set_protocol(settings.protocol());
        if !set_lib_name {
            left = left.set_skip_set_lib_name();
        }
        let (mut auth, mut old_auth) = (None, None);
        if let Some(password) = settings.password() {
            if resp3 {
                left = left.set_password(password);
                if let Some(user) = settings.username() {
                    left = left.set_username(user);
                }
            } else {
                let mut cmd = redis::Cmd::with_capacity(3, 64);
                cmd.arg("AUTH");
                if let Some(user) = settings.username() {
                    let mut old = cmd.clone();
                    old.arg(password);
                    old_auth = Some(old);
                    cmd.arg(user);
                }
                cmd.arg(password);
                auth = Some(cmd);
            }
        }
        let db = (settings.db() != 0).then_some(settings.db());
        let password = settings.password().map(str::to_owned);
        (
            left,
            SetUp {
                hello: None,
                auth,
                old_auth,
                db,
                password,
            },
        )
    }

    /// The whole set-up of `settings`, RESP3's `HELLO` included (with the credentials, as
    /// redis-rs sends it: the user `default` when the URL names none): the sync pool's, on a
    /// connection redis-rs never sees.
    pub(super) fn whole(settings: &RedisConnectionInfo) -> SetUp {
        let (_, mut set_up) = SetUp::split(settings, false);
        if settings.protocol().supports_resp3() {
            let mut hello = redis::cmd("HELLO");
            hello.arg("3");
            if let Some(password) = settings.password() {
                hello
                    .arg("AUTH")
                    .arg(settings.username().unwrap_or("default"))
                    .arg(password);
            }
            set_up.hello = Some(hello);
        }
        set_up
    }

    /// `HELLO`, if sent.
    pub(super) fn hello(&self) -> Option<&redis::Cmd> {
        self.hello.as_ref()
    }

    /// The reply `r` to [`hello`](Self::hello): a map of the server's properties, or a refusal:
    /// of the credentials (`WRONGPASS`, `NOAUTH`, `NOPERM`), as `AUTH`'s; of RESP3, by a server
    /// without `HELLO`; of anything else, the server's words (the password hidden); at
    /// `maxclients`, or with no reply, a failed connect.
    pub(super) fn helloed(&self, r: redis::RedisResult<Value>) -> Result<(), Failure> {
        let e = match r.and_then(Value::extract_error) {
            Ok(_) => return Ok(()),
            Err(e) => e,
        };
        let (Some(code), detail) = (e.code(), e.detail()) else {
            return Err(connect_failure(e));
        };
        if reply::refuses_credentials(code) || code == "NOPERM" {
            return self.refused(e, true).map(drop);
        }
        if at_maxclients(Some(code), detail) {
            return Err(connect_failure(e));
        }
        let detail = self.hidden(detail.unwrap_or_default());
        let why = if reply::unknown_command(code, Some(&detail)) {
            "the server does not know HELLO, so it cannot speak RESP3 (drop protocol=resp3 from \
             the URL)"
                .to_owned()
        } else {
            format!("the server refused HELLO ({code} {detail})")
        };
        // The server answered: not a fault.
        Err(Failure::Local(Error::new(
            ErrorKind::Backend,
            format!("could not connect: {why}"),
        )))
    }

    /// `detail` with the password hidden (a server may echo a command's arguments).
    fn hidden(&self, detail: &str) -> String {
        match &self.password {
            Some(pw) if !pw.is_empty() => detail.replace(pw.as_str(), "***"),
            _ => detail.to_owned(),
        }
    }

    /// `AUTH`, if sent; `again`: its old form (without the user), after [`Auth::Again`].
    pub(super) fn auth(&self, again: bool) -> Option<&redis::Cmd> {
        if again {
            self.old_auth.as_ref()
        } else {
            self.auth.as_ref()
        }
    }

    /// `SELECT`, if sent.
    pub(super) fn select(&self) -> Option<redis::Cmd> {
        self.db.map(|db| {
            let mut cmd = redis::cmd("SELECT");
            cmd.arg(db);
            cmd
        })
    }

    /// The reply `r` to [`auth`](Self::auth)`(again)`: a refusal is of the URL's credentials,
    /// with the server's words; at `maxclients`, or with no reply, a failed connect;
    /// [`Auth::Again`] if the server knows only `AUTH password` (the commands after it, refused
    /// unauthenticated, go again after that form).
    pub(super) fn authenticated(
        &self,
        r: redis::RedisResult<Value>,
        again: bool,
    ) -> Result<Auth, Failure> {
        let e = match r.and_then(Value::extract_error) {
            Ok(Value::Okay) => return Ok(Auth::Done),
            Ok(Value::SimpleString(s)) if s == "OK" => return Ok(Auth::Done),
            // Not a Redis answer to AUTH (a proxy or another protocol): not authenticated,
            // as redis-rs judges it, and no refusal of the credentials either.
            Ok(other) => redis::RedisError::from((
                redis::ErrorKind::Parse,
                "AUTH answered something else than OK",
                format!("{other:?}"),
            )),
            Err(e) => e,
        };
        self.refused(e, again)
    }

    /// What a refusal `e` of the credentials (`AUTH`'s, or `HELLO`'s) means.
    fn refused(&self, e: redis::RedisError, again: bool) -> Result<Auth, Failure> {
        let Some(code) = e.code() else {
            return Err(connect_failure(e));
        };
        let detail = self.hidden(e.detail().unwrap_or_default());
        let detail = detail.as_str();
        if at_maxclients(Some(code), Some(detail)) {
            return Err(connect_failure(e));
        }
        if !again
            && self.old_auth.is_some()
            && detail.contains("wrong number of arguments for 'auth' command")
        {
            return Ok(Auth::Again);
        }
        Err(Failure::Local(denial(code, Some(detail)).unwrap_or_else(
            || {
                Error::new(
                    ErrorKind::Denied,
                    format!(
                        "the server refused the URL's user and password (AUTH: {code} {detail})"
                    ),
                )
            },
        )))
    }

    /// The reply `r` to [`select`](Self::select).
    pub(super) fn selected(&self, r: redis::RedisResult<Value>) -> Result<(), Failure> {
        match r.and_then(Value::extract_error) {
            Ok(_) => Ok(()),
            Err(e) => Err(select_failure(e, self.db.unwrap_or_default())),
        }
    }

    /// A new connection of newcache's own to `addr` (`host:port`), `over` it (the TLS of a
    /// `rediss://` server, or nothing), its set-up done: `HELLO` or `AUTH`, then `SELECT`,
    /// pipelined, each reply read within what is left of `connect_timeout` from `started`
    /// (before any work the caller counts against it). `then`, if given,
    /// is pipelined after the set-up in the same round trip; its reply is left to the caller,
    /// to be read within what is left (the socket's timeouts are set to it).
    ///
    /// The one set-up of every sync connection: the pool's (`then` its `CLIENT INFO`) and the
    /// bus's subscriber and publisher.
    pub(super) fn open(
        &self,
        addr: &str,
        started: Instant,
        connect_timeout: Duration,
        over: impl FnOnce(Blocking) -> std::io::Result<Blocking>,
        then: Option<&redis::Cmd>,
    ) -> Result<Blocking, Failure> {
        // What is left of connect_timeout (a millisecond at least: a zero timeout is refused).
        let left = || {
            connect_timeout
                .saturating_sub(started.elapsed())
                .max(Duration::from_millis(1))
        };
        let io = |e: std::io::Error| connect_failure(e.into());
        let conn = Blocking::connect(addr, started, connect_timeout).map_err(io)?;
        let mut conn = over(conn).map_err(io)?;
        let set_timeouts = |conn: &Blocking, t: Duration| conn.set_timeouts(t).map_err(io);
        set_timeouts(&conn, left())?;
        let hello = self.hello();
        let select = self.select();
        let mut again = false;
        loop {
            let auth = self.auth(again);
            let mut packed = Vec::new();
            for cmd in hello.into_iter().chain(auth).chain(&select).chain(then) {
                cmd.write_packed_command(&mut packed);
            }
            conn.send(&packed).map_err(connect_failure)?;
            set_timeouts(&conn, left())?;
            if hello.is_some() {
                self.helloed(conn.recv())?;
                set_timeouts(&conn, left())?;
            }
            if auth.is_some() {
                let authed = self.authenticated(conn.recv(), again)?;
                set_timeouts(&conn, left())?;
                if authed == Auth::Again {
                    // `SELECT` and `then` were refused unauthenticated: their replies are
                    // skipped, and the set-up goes again with `AUTH`'s old form.
                    for _ in 0..usize::from(select.is_some()) + usize::from(then.is_some()) {
                        set_timeouts(&conn, left())?;
                        if let Err(e) = conn.recv() {
                            if e.code().is_none() {
                                return Err(connect_failure(e));
                            }
                        }
                    }
                    set_timeouts(&conn, left())?;
                    again = true;
                    continue;
                }
            }
            break;
        }
        if select.is_some() {
            self.selected(conn.recv())?;
            set_timeouts(&conn, left())?;
        }
        Ok(conn)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(url: &str) -> RedisConnectionInfo {
        redis::Client::open(url)
            .unwrap()
            .get_connection_info()
            .redis_settings()
            .clone()
    }

    #[test]
    fn resp2_credentials_and_the_database_are_sent_here_not_by_redis_rs() {
        let (left, set_up) = SetUp::split(&settings("redis://u:pw@127.0.0.1:6379/3"), false);
        assert_eq!(
            (left.username(), left.password(), left.db()),
            (None, None, 0)
        );
        assert!(left.skip_set_lib_name());
        let auth = set_up.auth(false).unwrap().get_packed_command();
        assert_eq!(auth, b"*3\r\n$4\r\nAUTH\r\n$1\r\nu\r\n$2\r\npw\r\n");
        let select = set_up.select().unwrap().get_packed_command();
        assert_eq!(select, b"*2\r\n$6\r\nSELECT\r\n$1\r\n3\r\n");
    }

    #[test]
    fn resp3_credentials_stay_with_hello() {
        let (left, set_up) =
            SetUp::split(&settings("redis://u:pw@127.0.0.1:6379/0?protocol=3"), false);
        assert_eq!((left.username(), left.password()), (Some("u"), Some("pw")));
        assert!(left.protocol().supports_resp3());
        assert!(set_up.auth(false).is_none() && set_up.select().is_none());
    }

    #[test]
    fn the_old_auth_form_is_tried_once_when_the_new_one_is_refused_for_its_form() {
        let (_, set_up) = SetUp::split(&settings("redis://u:pw@127.0.0.1:6379"), false);
        let old = set_up.auth(true).unwrap().get_packed_command();
        assert_eq!(old, b"*2\r\n$4\r\nAUTH\r\n$2\r\npw\r\n");
        let form =
            redis::parse_redis_value(b"-ERR wrong number of arguments for 'auth' command\r\n");
        assert_eq!(
            set_up.authenticated(form.clone(), false).unwrap(),
            Auth::Again
        );
        let again = set_up.authenticated(form, true);
        assert!(
            matches!(&again, Err(Failure::Local(e)) if e.is_denied()),
            "{again:?}"
        );
        // Without a user there is no other form to try.
        let (_, no_user) = SetUp::split(&settings("redis://:pw@127.0.0.1:6379"), false);
        assert!(no_user.auth(true).is_none());
    }

    /// redis-rs takes only `OK` for authenticated; so does the set-up: another answer (a
    /// proxy, or not a Redis server) is a failed connect, never a denial of the credentials.
    #[test]
    fn auth_is_done_only_when_the_server_says_ok() {
        let (_, set_up) = SetUp::split(&settings("redis://:pw@127.0.0.1:6379"), false);
        let ok = set_up.authenticated(redis::parse_redis_value(b"+OK\r\n"), false);
        assert_eq!(ok.unwrap(), Auth::Done);
        for other in [
            b":1\r\n".as_slice(),
            b"+QUEUED\r\n",
            b"$2\r\nOK\r\n",
            b"*0\r\n",
        ] {
            let r = set_up.authenticated(redis::parse_redis_value(other), false);
            assert!(
                matches!(&r, Err(Failure::Fault(e)) if !e.is_denied()
                    && format!("{e:?}").contains("AUTH answered")),
                "{:?}: {r:?}",
                String::from_utf8_lossy(other)
            );
        }
    }

    #[test]
    fn a_password_alone_is_sent_without_a_user() {
        let (_, set_up) = SetUp::split(&settings("redis://:pw@127.0.0.1:6379"), false);
        let auth = set_up.auth(false).unwrap().get_packed_command();
        assert_eq!(auth, b"*2\r\n$4\r\nAUTH\r\n$2\r\npw\r\n");
    }

    #[test]
    fn maxclients_in_reply_to_auth_is_a_fault_and_a_wrong_password_a_denial() {
        let (_, set_up) = SetUp::split(&settings("redis://:pw@127.0.0.1:6379"), false);
        let refused = |code: &str, detail: &str| {
            let reply = format!("-{code} {detail}\r\n");
            set_up.authenticated(redis::parse_redis_value(reply.as_bytes()), false)
        };
        let fault =
            |r: &Result<Auth, Failure>| matches!(r, Err(Failure::Fault(e)) if !e.is_denied());
        let full = refused("ERR", "max number of clients reached");
        assert!(fault(&full), "{full:?}");
        let wrong = refused("WRONGPASS", "invalid username-password pair");
        assert!(
            matches!(&wrong, Err(Failure::Local(e)) if e.is_denied()),
            "{wrong:?}"
        );
        let old = refused("ERR", "invalid password");
        assert!(
            matches!(&old, Err(Failure::Local(e)) if e.is_denied() && e.to_string().contains("invalid password")),
            "{old:?}"
        );
        let cluster = refused("ERR", "max number of clients + cluster connections reached");
        assert!(fault(&cluster), "{cluster:?}");
        assert_eq!(
            set_up.authenticated(Ok(Value::Okay), false).unwrap(),
            Auth::Done
        );
        let echoed = refused(
            "ERR",
            "unknown command 'AUTH', with args beginning with: 'pw'",
        );
        assert!(
            matches!(&echoed, Err(Failure::Local(e)) if !e.to_string().contains("'pw'")),
            "{echoed:?}"
        );
    }
}
