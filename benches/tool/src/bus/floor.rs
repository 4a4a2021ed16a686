//! The floor of the `latency` figure: the same work on bare sockets, no newcache. The writer
//! stores the key's next value in memcached (a text `set` of the bare 1,000-byte value) and,
//! once it is stored, publishes the key: `PUBLISH` on the server (on a cluster, `SPUBLISH` at
//! the channel's owner), or for the in-process bus a message on a channel to the reader's
//! thread. The reader, blocked in a read of its `SUBSCRIBE` (`SSUBSCRIBE`) connection or on
//! the channel, `get`s the key from memcached when the message comes. A sample is timed as
//! newcache's are: from the store's return to the return of the reader's `get` of the new value.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::mpsc;
use std::time::Duration;

use crate::bus::values::{Link, now_ns, parse, value};
use crate::floor::items::BoxError;

/// How long a socket read may block: a lost message shows as a `timeout` sample.
const PATIENCE: Duration = Duration::from_secs(10);

/// One blocking connection, a request answered by one reply at a time.
struct Wire {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Wire {
    fn connect(addr: &str) -> Result<Wire, BoxError> {
        let stream = TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(PATIENCE))?;
        stream.set_write_timeout(Some(PATIENCE))?;
        Ok(Wire {
            stream,
            buf: Vec::with_capacity(4096),
        })
    }

    /// Writes `request` (if any) and reads until the reply ends with `end`.
    fn ask(&mut self, request: &[u8], end: &[u8]) -> Result<&[u8], BoxError> {
        self.stream.write_all(request)?;
        self.buf.clear();
        let mut chunk = [0u8; 4096];
        while !self.buf.ends_with(end) {
            match self.stream.read(&mut chunk)? {
                0 => return Err("connection closed by the server".into()),
                n => self.buf.extend_from_slice(&chunk[..n]),
            }
        }
        Ok(&self.buf)
    }

    /// Reads exactly `expected` (a push frame of known bytes).
    fn expect(&mut self, expected: &[u8]) -> Result<(), BoxError> {
        self.buf.resize(expected.len(), 0);
        self.stream.read_exact(&mut self.buf)?;
        match self.buf == expected {
            true => Ok(()),
            false => Err(format!(
                "read {:?}, expected {:?}",
                String::from_utf8_lossy(&self.buf),
                String::from_utf8_lossy(expected)
            )
            .into()),
        }
    }
}

/// A RESP command of bulk strings.
fn resp(args: &[&str]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len());
    for a in args {
        out += &format!("${}\r\n{a}\r\n", a.len());
    }
    out.into_bytes()
}

/// A RESP push of bulk strings and, last, an integer (a subscription's confirmation) or none.
fn push(kind: &str, channel: &str, last: Result<&str, i64>) -> Vec<u8> {
    let mut out = format!(
        "*3\r\n${}\r\n{kind}\r\n${}\r\n{channel}\r\n",
        kind.len(),
        channel.len()
    );
    match last {
        Ok(s) => out += &format!("${}\r\n{s}\r\n", s.len()),
        Err(n) => out += &format!(":{n}\r\n"),
    }
    out.into_bytes()
}

/// Where a bus spec publishes and subscribes: `(host:port, sharded)`. `redis:URL` names its
/// server; `cluster:URL,...` the owner of `channel`'s slot (a seed, or where its `MOVED` says).
fn server_of(spec: &str, channel: &str) -> Result<(String, bool), BoxError> {
    let addr = |url: &str| -> Result<String, BoxError> {
        url.strip_prefix("redis://")
            .and_then(|rest| rest.split('/').next())
            .map(str::to_owned)
            .ok_or_else(|| format!("not a redis://host:port URL: {url:?}").into())
    };
    if let Some(url) = spec.strip_prefix("redis:") {
        return Ok((addr(url)?, false));
    }
    let seed = spec
        .strip_prefix("cluster:")
        .and_then(|seeds| seeds.split(',').next())
        .ok_or_else(|| format!("no bus {spec:?}: redis:URL or cluster:URL,..."))?;
    let seed = addr(seed)?;
    let mut wire = Wire::connect(&seed)?;
    let reply = wire.ask(&resp(&["SPUBLISH", channel, "probe"]), b"\r\n")?;
    let reply = String::from_utf8_lossy(reply).trim().to_owned();
    match reply.strip_prefix("-MOVED ") {
        Some(moved) => Ok((
            moved.split(' ').nth(1).ok_or("a bad MOVED")?.to_owned(),
            true,
        )),
        None if reply.starts_with(':') => Ok((seed, true)),
        None => Err(format!("SPUBLISH answered {reply:?}").into()),
    }
}

/// How the writer tells the reader.
enum Publish {
    /// `PUBLISH` (or `SPUBLISH`) of the key on a server.
    Server(Wire, Vec<u8>),
    /// A message to the reader's thread.
    Thread(mpsc::Sender<()>),
}

/// The floor's writer.
pub struct Writer {
    memcached: Wire,
    key: String,
    publish: Publish,
}

impl Writer {
    /// Stores generation `generation` of the key (the bare value), not published.
    pub fn store(&mut self, generation: u64) -> Result<(), BoxError> {
        let v = value(0, generation);
        let request = format!("set {} 0 0 {}\r\n{v}\r\n", self.key, v.len());
        match self.memcached.ask(request.as_bytes(), b"\r\n")? {
            b"STORED\r\n" => Ok(()),
            other => Err(format!("set: {:?}", String::from_utf8_lossy(other)).into()),
        }
    }

    /// Stores generation `generation` and publishes the key: CLOCK_MONOTONIC when the store
    /// returned.
    pub fn write(&mut self, generation: u64) -> Result<u64, BoxError> {
        self.store(generation)?;
        let stored = now_ns();
        match &mut self.publish {
            Publish::Server(wire, request) => {
                let reply = wire.ask(request, b"\r\n")?;
                if !reply.starts_with(b":") {
                    return Err(format!("publish: {:?}", String::from_utf8_lossy(reply)).into());
                }
            }
            Publish::Thread(tx) => tx.send(()).map_err(|_| "the reader's thread is gone")?,
        }
        Ok(stored)
    }
}

/// The floor's writer and its reader for a transport: `spec` `redis:URL` or
/// `cluster:URL,...` (the reader another process), or `None` (the reader a thread); `name` is
/// both the memcached key and the channel.
pub fn pair(memcached: &str, spec: Option<&str>, name: &str) -> Result<(Writer, Link), BoxError> {
    let key = name.to_owned();
    let (publish, reader) = match spec {
        Some(spec) => {
            let (server, sharded) = server_of(spec, name)?;
            let command = if sharded { "SPUBLISH" } else { "PUBLISH" };
            let argv: Vec<String> = [
                "bus-reader",
                "--bare",
                "--memcached",
                memcached,
                "--flavor",
                name,
                "--bus",
                spec,
                "--channel",
                name,
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            let reader = Link::spawn(&format!("floor-reader-{name}"), &argv)?;
            let publish = Publish::Server(Wire::connect(&server)?, resp(&[command, name, &key]));
            (publish, reader)
        }
        None => {
            let (tx, rx) = mpsc::channel();
            let mut memcached = Wire::connect(memcached)?;
            let reader_key = key.clone();
            let reader = Link::thread(&format!("floor-reader-{name}"), move |commands, mut tx| {
                let mut wake = || Ok(rx.recv_timeout(PATIENCE).is_ok());
                if let Err(e) = read(&mut memcached, &reader_key, &mut wake, commands, &mut tx) {
                    tx(format!("error {e}"));
                }
            })?;
            (Publish::Thread(tx), reader)
        }
    };
    let mut writer = Writer {
        memcached: Wire::connect(memcached)?,
        key,
        publish,
    };
    writer.store(0)?;
    Ok((writer, reader))
}

/// The generation of `key` in memcached.
fn generation(memcached: &mut Wire, key: &str) -> Result<u64, BoxError> {
    let reply = memcached.ask(format!("get {key}\r\n").as_bytes(), b"END\r\n")?;
    let data = reply
        .splitn(2, |&b| b == b'\n')
        .nth(1)
        .ok_or("the key is missing")?;
    let text = std::str::from_utf8(data)?;
    Ok(parse(text).ok_or("not a value of this bench")?.1)
}

/// The floor reader's loop, in the protocol of `latency::read`: for each `arm G`, answers
/// `ready`, waits for the message (`wake`: false after [`PATIENCE`]), `get`s the key until it
/// holds a later generation, and answers `seen GENERATION AT_NS LAST_GET_NS POLLS {}` or
/// `timeout`.
fn read(
    memcached: &mut Wire,
    key: &str,
    wake: &mut dyn FnMut() -> Result<bool, BoxError>,
    commands: impl IntoIterator<Item = String>,
    reply: &mut dyn FnMut(String),
) -> Result<(), BoxError> {
    for line in commands {
        let Some(old) = line.strip_prefix("arm ") else {
            return Ok(());
        };
        let old: u64 = old.parse()?;
        reply("ready".into());
        if !wake()? {
            reply("timeout 0".into());
            continue;
        }
        let mut polls = 0u64;
        loop {
            let start = now_ns();
            let g = generation(memcached, key)?;
            let end = now_ns();
            if g > old {
                reply(format!("seen {g} {end} {} {polls} {{}}", end - start));
                break;
            }
            polls += 1;
        }
    }
    Ok(())
}

/// `bench bus-reader --bare`: the floor's reader of key `channel`, subscribed before it answers
/// anything.
pub fn reader_main(
    memcached: &str,
    spec: &str,
    channel: &str,
    commands: impl IntoIterator<Item = String>,
    reply: &mut dyn FnMut(String),
) -> Result<(), BoxError> {
    let (server, sharded) = server_of(spec, channel)?;
    let (subscribe, message) = match sharded {
        true => ("SSUBSCRIBE", "smessage"),
        false => ("SUBSCRIBE", "message"),
    };
    let mut sub = Wire::connect(&server)?;
    sub.stream.write_all(&resp(&[subscribe, channel]))?;
    sub.expect(&push(&subscribe.to_lowercase(), channel, Err(1)))?;
    let frame = push(message, channel, Ok(channel));
    let mut wake = || match sub.expect(&frame) {
        Ok(()) => Ok(true),
        Err(e) => match e.downcast_ref::<std::io::Error>().map(std::io::Error::kind) {
            Some(std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => Ok(false),
            _ => Err(e),
        },
    };
    let mut memcached = Wire::connect(memcached)?;
    read(&mut memcached, channel, &mut wake, commands, reply)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_resp() {
        assert_eq!(
            resp(&["PUBLISH", "c", "k"]),
            b"*3\r\n$7\r\nPUBLISH\r\n$1\r\nc\r\n$1\r\nk\r\n"
        );
        assert_eq!(
            push("subscribe", "ch", Err(1)),
            b"*3\r\n$9\r\nsubscribe\r\n$2\r\nch\r\n:1\r\n"
        );
        assert_eq!(
            push("message", "ch", Ok("k")),
            b"*3\r\n$7\r\nmessage\r\n$2\r\nch\r\n$1\r\nk\r\n"
        );
    }
}
