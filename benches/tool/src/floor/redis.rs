//! The Redis mode's server, items and floors.
//!
//! Items: the same user keys and values as on memcached (`k0`..`k999`, `Cache::make_key`'s
//! 48-byte keys, a 100-byte MessagePack value in the envelope), written by `Cache::set` on the
//! Redis backend, so stored with its 13-byte header before the envelope. The floors read those
//! bytes under the same derived keys: redis-rs's own `GET` (the client the backend is built on,
//! with the connection settings the backend gives it) and a bare socket's RESP `GET`, whose
//! reply lengths are learnt from the server after the fill, one hit per key.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::floor::items::{BoxError, Items, TTL, Value};

/// The Redis backend's header before the envelope: a tag, the stamp, the flags
/// (`src/backend/redis/item.rs`).
pub const REDIS_HEADER: usize = 13;

/// A Redis-protocol server this bench started, killed on drop.
pub struct Server {
    child: Child,
    port: u16,
}

impl Server {
    /// `bin --port PORT --bind 127.0.0.1 --save '' --appendonly no --protected-mode no` on a free
    /// port, once it accepts connections (a port taken meanwhile is retried).
    pub fn start(bin: &str) -> Result<Server, BoxError> {
        let mut last = None;
        for _ in 0..3 {
            match Self::try_start(bin) {
                Ok(server) => return Ok(server),
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("tried at least once"))
    }

    fn try_start(bin: &str) -> Result<Server, BoxError> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let child = Command::new(bin)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start {bin}: {e}"))?;
        let mut server = Server { child, port };
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Ok(server);
            }
            if let Some(status) = server.child.try_wait()? {
                return Err(format!("{bin} exited: {status}").into());
            }
            if Instant::now() > deadline {
                return Err(format!("{bin} did not listen on {port} within 5 s").into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `redis_version` or `valkey_version` from `INFO server`, e.g. `valkey 9.1.2`; its
/// `process_id` is watched for CPU time from then on (`cpu.rs`).
pub fn version(url: &str) -> Result<String, BoxError> {
    let mut con = redis::Client::open(url)?.get_connection()?;
    let info: String = redis::cmd("INFO").arg("server").query(&mut con)?;
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_owned()))
    };
    // Its CPU time is counted beside the client's (a server on this machine).
    if let Some(pid) = field("process_id:").and_then(|p| p.parse().ok()) {
        crate::floor::cpu::watch_server(pid);
    }
    Ok(match (field("valkey_version:"), field("redis_version:")) {
        (Some(v), _) => format!("valkey {v}"),
        (None, Some(v)) => format!("redis {v}"),
        (None, None) => "?".into(),
    })
}

/// `GET key` in RESP.
pub fn get_request(key: &str) -> Vec<u8> {
    format!("*2\r\n$3\r\nGET\r\n${}\r\n{key}\r\n", key.len()).into_bytes()
}

/// Fills `k0`.. through `cache` (`Cache::set`), then learns each reply from `server` (a hit
/// is required): the RESP requests, the whole bulk reply's length, the stored bytes'.
pub fn fill(cache: &newcache::Cache, n: usize, server: &mut Resp) -> Result<Items, BoxError> {
    let user: Vec<String> = (0..n).map(|i| format!("k{i}")).collect();
    for (i, k) in user.iter().enumerate() {
        cache.set(k, &Value::new(i), TTL)?;
    }
    let derived: Vec<String> = user.iter().map(|k| cache.make_key(k)).collect();
    let requests: Vec<Vec<u8>> = derived.iter().map(|k| get_request(k)).collect();
    let (mut reply_lens, mut stored_lens, mut value_lens) = (vec![], vec![], vec![]);
    for req in &requests {
        let reply = server.exchange(req)?;
        let (data, stored) = bulk_len(reply)?;
        let item = reply
            .get(data + REDIS_HEADER..data + stored)
            .ok_or("a reply shorter than the backend's header")?;
        let envelope = usize::from(*item.get(6).ok_or("no envelope after the header")?);
        value_lens.push(item.len() - envelope);
        reply_lens.push(reply.len());
        stored_lens.push(stored);
    }
    Ok(Items {
        user,
        derived,
        requests,
        // Redis has no `gets`: the memcached ceiling's `--gets` does not apply.
        gets_reply_lens: reply_lens.clone(),
        reply_lens,
        stored_lens,
        value_lens,
    })
}

/// Where a bulk reply's bytes start and how many there are (`$N\r\n`); an error for a nil or
/// anything else.
pub fn bulk_len(reply: &[u8]) -> Result<(usize, usize), BoxError> {
    let end = reply
        .windows(2)
        .position(|w| w == b"\r\n")
        .ok_or("no CRLF in the reply")?;
    match reply.first() {
        Some(b'$') => {
            let n: i64 = std::str::from_utf8(&reply[1..end])?.parse()?;
            match usize::try_from(n) {
                Ok(n) => Ok((end + 2, n)),
                Err(_) => Err("not a hit: a nil reply".into()),
            }
        }
        _ => Err(format!("not a bulk reply: {:?}", String::from_utf8_lossy(reply)).into()),
    }
}

/// Whether `buf` holds a whole bulk reply.
fn whole(buf: &[u8]) -> bool {
    bulk_len(buf).is_ok_and(|(data, n)| buf.len() >= data + n + 2)
}

/// Checks a reply read to its expected length: a bulk string ending in CRLF.
fn check_reply(buf: &[u8], len: usize) -> Result<(), BoxError> {
    match buf.len() == len && buf.starts_with(b"$") && buf.ends_with(b"\r\n") {
        true => Ok(()),
        false => Err(format!("a {}-byte reply, {len} expected", buf.len()).into()),
    }
}

/// The sync bare floor: a blocking `TcpStream` with the socket options of the backend's pooled
/// connections (redis-rs's defaults, so no `TCP_NODELAY`; `SO_RCVTIMEO` / `SO_SNDTIMEO` at
/// `io_timeout`). A request is one `write`; the reply is read into one buffer until it is as
/// long as expected.
pub struct Resp {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Resp {
    pub fn connect(url: &str, io_timeout: Duration) -> Result<Resp, BoxError> {
        let stream = TcpStream::connect(addr_of(url)?)?;
        stream.set_read_timeout(Some(io_timeout))?;
        stream.set_write_timeout(Some(io_timeout))?;
        Ok(Resp {
            stream,
            buf: vec![0; 64 * 1024],
        })
    }

    /// One `GET` and its reply of exactly `len` bytes.
    pub fn get(&mut self, request: &[u8], len: usize) -> Result<(), BoxError> {
        self.stream.write_all(request)?;
        let mut have = 0;
        while have < len {
            match self.stream.read(&mut self.buf[have..])? {
                0 => return Err("connection closed by the server".into()),
                n => have += n,
            }
        }
        check_reply(&self.buf[..have], len)
    }

    /// Writes `requests` (one `write`), their replies read by [`recv`](Resp::recv).
    pub fn send(&mut self, requests: &[u8]) -> Result<(), BoxError> {
        Ok(self.stream.write_all(requests)?)
    }

    /// Reads replies until `len` bytes came (checked: bulk replies, so the first is a bulk
    /// string and the last ends in CRLF).
    pub fn recv(&mut self, len: usize) -> Result<(), BoxError> {
        if self.buf.len() < len {
            self.buf.resize(len, 0);
        }
        let mut have = 0;
        while have < len {
            match self.stream.read(&mut self.buf[have..len])? {
                0 => return Err("connection closed by the server".into()),
                n => have += n,
            }
        }
        check_reply(&self.buf[..have], len)
    }

    /// Reads `n` replies with redis-rs's own reader (`redis::Parser` on the socket, as its
    /// sync `Connection` reads), each a bulk string, `bytes` in all.
    pub fn recv_values(
        &mut self,
        n: usize,
        bytes: usize,
        parser: &mut redis::Parser,
    ) -> Result<(), BoxError> {
        let mut read = 0;
        for _ in 0..n {
            match parser.parse_value(&mut self.stream)? {
                redis::Value::BulkString(b) => read += b.len(),
                other => return Err(format!("expected a bulk string, read {other:?}").into()),
            }
        }
        match read == bytes {
            true => Ok(()),
            false => Err(format!("{n} values of {read} bytes, {bytes} expected").into()),
        }
    }

    /// One request and its bulk reply, whatever its length: for learning.
    pub fn exchange(&mut self, request: &[u8]) -> Result<&[u8], BoxError> {
        self.stream.write_all(request)?;
        let mut have = 0;
        while !whole(&self.buf[..have]) {
            if have == self.buf.len() {
                return Err("a reply longer than the buffer".into());
            }
            match self.stream.read(&mut self.buf[have..])? {
                0 => return Err("connection closed by the server".into()),
                n => have += n,
            }
            if self.buf[..have].starts_with(b"$-1\r\n") || self.buf[..have].starts_with(b"-") {
                return Err(format!(
                    "not a hit: {:?}",
                    String::from_utf8_lossy(&self.buf[..have])
                )
                .into());
            }
        }
        Ok(&self.buf[..have])
    }
}

/// The async bare floor: a tokio `TcpStream` with the option the async backend's connection
/// sets (`TCP_NODELAY`); otherwise as [`Resp`].
pub struct RespBare {
    stream: tokio::net::TcpStream,
    buf: Vec<u8>,
}

impl RespBare {
    pub async fn connect(url: &str) -> Result<RespBare, BoxError> {
        let stream = tokio::net::TcpStream::connect(addr_of(url)?).await?;
        stream.set_nodelay(true)?;
        Ok(RespBare {
            stream,
            buf: vec![0; 64 * 1024],
        })
    }

    /// One `GET` and its reply of exactly `len` bytes.
    pub async fn get(&mut self, request: &[u8], len: usize) -> Result<(), BoxError> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        self.stream.write_all(request).await?;
        let mut have = 0;
        while have < len {
            match self.stream.read(&mut self.buf[have..]).await? {
                0 => return Err("connection closed by the server".into()),
                n => have += n,
            }
        }
        check_reply(&self.buf[..have], len)
    }
}

/// `host:port` of a `redis://host:port/db` URL.
fn addr_of(url: &str) -> Result<&str, BoxError> {
    url.strip_prefix("redis://")
        .and_then(|rest| rest.split('/').next())
        .filter(|a| !a.is_empty())
        .ok_or_else(|| format!("expected redis://host:port/db, not {url:?}").into())
}

/// redis-rs's sync floor: a `redis::Connection` opened and set up as the backend's pool opens
/// its connections (`get_connection_with_timeout(connect_timeout)`, then read and write
/// timeouts at `io_timeout`).
pub fn sync_connection(
    url: &str,
    config: &newcache::RedisConfig,
) -> Result<redis::Connection, BoxError> {
    let conn = redis::Client::open(url)?.get_connection_with_timeout(config.connect_timeout)?;
    conn.set_read_timeout(Some(config.io_timeout))?;
    conn.set_write_timeout(Some(config.io_timeout))?;
    Ok(conn)
}

/// redis-rs's async floor: a `MultiplexedConnection` opened as the async backend opens its one
/// (a tokio `TcpStream` with `TCP_NODELAY`, `new_with_config` with the response timeout at
/// `io_timeout`), its driver spawned on the current runtime.
pub async fn multiplexed(
    url: &str,
    config: &newcache::RedisConfig,
) -> Result<redis::aio::MultiplexedConnection, BoxError> {
    let info = redis::Client::open(url)?.get_connection_info().clone();
    let stream = tokio::net::TcpStream::connect(addr_of(url)?).await?;
    stream.set_nodelay(true)?;
    let settings = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(config.connect_timeout))
        .set_response_timeout(Some(config.io_timeout));
    let (conn, driver) =
        redis::aio::MultiplexedConnection::new_with_config(info.redis_settings(), stream, settings)
            .await?;
    tokio::spawn(driver);
    Ok(conn)
}

/// Checks a value read by redis-rs against the stored bytes' length of key `i`.
pub fn check_len(found: Option<Vec<u8>>, items: &Items, i: usize) -> Result<(), BoxError> {
    match found.map(|v| v.len()) {
        Some(n) if n == items.stored_lens[i] => Ok(()),
        Some(n) => Err(format!("{n} bytes under key {i}").into()),
        None => Err(format!("miss on key {i}").into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bulk_replies() {
        assert_eq!(bulk_len(b"$5\r\nhello\r\n").unwrap(), (4, 5));
        assert!(bulk_len(b"$-1\r\n").is_err());
        assert!(bulk_len(b"+OK\r\n").is_err());
        assert!(whole(b"$5\r\nhello\r\n"));
        assert!(!whole(b"$5\r\nhel"));
        assert!(check_reply(b"$5\r\nhello\r\n", 11).is_ok());
        assert!(check_reply(b"$5\r\nhello\r\n", 12).is_err());
    }

    #[test]
    fn a_get_in_resp() {
        assert_eq!(get_request("ab"), b"*2\r\n$3\r\nGET\r\n$2\r\nab\r\n");
        assert_eq!(addr_of("redis://127.0.0.1:7/0").unwrap(), "127.0.0.1:7");
        assert!(addr_of("redis:///0").is_err());
    }
}
