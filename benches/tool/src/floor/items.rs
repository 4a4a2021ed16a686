//! The mission's items and the floors' sockets.
//!
//! Items: user keys `k0`..`k999` (and `m0`..`m99` for the 3-server batch) derived by
//! `Cache::make_key` with flavor `bench`, version 1 into 48-byte keys; values a [`Value`] whose
//! MessagePack encoding is 100 bytes, written by `Cache::set` (so in today's envelope). The
//! floors read those same bytes: their requests and expected reply lengths are learnt from the
//! server after the fill, one hit per key.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Any error.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The flavor and version: `bench-1-{40 hex}`, 48 bytes.
pub const FLAVOR: &str = "bench";
pub const VERSION: u64 = 1;
/// How long the filled items live (longer than any run).
pub const TTL: Duration = Duration::from_secs(3600);

/// The cached value. The default codec writes a struct as a MessagePack map with its field
/// names: with `id` at least 2^16 (a 5-byte integer) and 84 bytes of name, that is 1 + (3 + 5)
/// + (5 + 2 + 84) = 100 bytes (the unit test checks it in a stored item).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Value {
    pub id: u64,
    pub name: String,
}

impl Value {
    pub fn new(i: usize) -> Value {
        Value {
            id: 1_000_000 + i as u64,
            name: "x".repeat(84),
        }
    }

    /// Whether this is what [`Value::new`] wrote for key `i`.
    pub fn check(found: Option<Value>, i: usize) -> Result<(), BoxError> {
        match found {
            Some(v) if v.id == 1_000_000 + i as u64 => Ok(()),
            Some(v) => Err(format!("value {} under key {i}", v.id).into()),
            None => Err(format!("miss on key {i}").into()),
        }
    }
}

/// Set by `--gets`: the ceiling and the minimal client send `gets`, as newcache does.
pub static GETS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// One set of items as the floors see them.
#[derive(Debug, Clone)]
pub struct Items {
    /// The user keys the public API is called with.
    pub user: Vec<String>,
    /// `Cache::make_key` of each.
    pub derived: Vec<String>,
    /// `get {derived}\r\n`.
    pub requests: Vec<Vec<u8>>,
    /// The whole reply to `requests[i]` (VALUE line, stored bytes, END), in bytes.
    pub reply_lens: Vec<usize>,
    /// The same for `gets {derived}\r\n` (its VALUE line also carries the CAS).
    pub gets_reply_lens: Vec<usize>,
    /// The stored bytes of each item (the envelope and the encoded value).
    pub stored_lens: Vec<usize>,
    /// The encoded value's bytes in each item: the stored bytes less the envelope header (whose
    /// length is its byte 6).
    pub value_lens: Vec<usize>,
}

impl Items {
    /// The command and the whole replies' lengths the ceiling and the minimal client read
    /// with: `get`, or `gets` as newcache reads (`--gets`).
    pub fn command(&self) -> (&'static [u8], &[usize]) {
        if GETS.load(std::sync::atomic::Ordering::Relaxed) {
            (b"gets", &self.gets_reply_lens)
        } else {
            (b"get", &self.reply_lens)
        }
    }
    /// `{prefix}0`..: fills them through `cache` (`Cache::set`), then learns each reply from
    /// `server` (a hit is required).
    pub fn fill(
        cache: &newcache::Cache,
        prefix: &str,
        n: usize,
        server: &mut Blocking,
    ) -> Result<Items, BoxError> {
        let user: Vec<String> = (0..n).map(|i| format!("{prefix}{i}")).collect();
        for (i, k) in user.iter().enumerate() {
            cache.set(k, &Value::new(i), TTL)?;
        }
        Items::learn(cache, user, std::slice::from_mut(server), |_| 0)
    }

    /// Learns each item's reply from `servers[server_of(i)]` (a hit is required).
    pub fn learn(
        cache: &newcache::Cache,
        user: Vec<String>,
        servers: &mut [Blocking],
        server_of: impl Fn(usize) -> usize,
    ) -> Result<Items, BoxError> {
        let derived: Vec<String> = user.iter().map(|k| cache.make_key(k)).collect();
        let requests: Vec<Vec<u8>> = derived
            .iter()
            .map(|k| format!("get {k}\r\n").into_bytes())
            .collect();
        let (mut reply_lens, mut stored_lens, mut value_lens) = (vec![], vec![], vec![]);
        let mut gets_reply_lens = vec![];
        for (i, req) in requests.iter().enumerate() {
            let gets = format!("gets {}\r\n", derived[i]).into_bytes();
            gets_reply_lens.push(servers[server_of(i)].exchange(&gets)?.len());
            let reply = servers[server_of(i)].exchange(req)?;
            let stored = stored_len(reply)?;
            let data = reply.iter().position(|&b| b == b'\n').map_or(0, |n| n + 1);
            let item = reply
                .get(data..data + stored)
                .ok_or("a reply shorter than its item")?;
            value_lens.push(value_len(item)?);
            reply_lens.push(reply.len());
            stored_lens.push(stored);
        }
        Ok(Items {
            user,
            derived,
            requests,
            reply_lens,
            gets_reply_lens,
            stored_lens,
            value_lens,
        })
    }
}

/// The encoded value's bytes in a stored item: its length less the envelope header's (byte 6).
fn value_len(stored: &[u8]) -> Result<usize, BoxError> {
    let header = stored
        .get(6)
        .ok_or("an item shorter than an envelope header")?;
    Ok(stored.len() - usize::from(*header))
}

/// The byte count of a one-value `get` reply's data block.
fn stored_len(reply: &[u8]) -> Result<usize, BoxError> {
    let text = String::from_utf8_lossy(reply);
    let header = text.lines().next().unwrap_or_default();
    match header.split(' ').collect::<Vec<_>>()[..] {
        ["VALUE", _, _, len] => Ok(len.parse()?),
        _ => Err(format!("not a hit: {:?}", &text[..text.len().min(60)]).into()),
    }
}

/// The sync floor: a blocking `TcpStream` with the options the sync client's pooled connection
/// sets (`TCP_NODELAY`, `SO_RCVTIMEO` and `SO_SNDTIMEO` at the default `io_timeout`). A request
/// is one `write`; the reply is read into one buffer until it is as long as expected.
#[derive(Debug)]
pub struct Blocking {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Blocking {
    pub fn connect(addr: &str) -> Result<Blocking, BoxError> {
        let stream = TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(newcache::backend::memcached::DEFAULT_IO_TIMEOUT))?;
        stream.set_write_timeout(Some(newcache::backend::memcached::DEFAULT_IO_TIMEOUT))?;
        Ok(Blocking {
            stream,
            buf: vec![0; 64 * 1024],
        })
    }

    pub fn send(&mut self, request: &[u8]) -> Result<(), BoxError> {
        Ok(self.stream.write_all(request)?)
    }

    /// Reads a reply of exactly `len` bytes ending in `END\r\n`.
    pub fn recv(&mut self, len: usize) -> Result<(), BoxError> {
        let mut have = 0;
        while have < len {
            match self.stream.read(&mut self.buf[have..])? {
                0 => return Err("connection closed by the server".into()),
                n => have += n,
            }
        }
        match have == len && self.buf[..have].ends_with(b"END\r\n") {
            true => Ok(()),
            false => Err(format!("a {have}-byte reply, {len} expected").into()),
        }
    }

    /// One request and its reply, whatever its length (ends at `END\r\n`): for learning.
    pub fn exchange(&mut self, request: &[u8]) -> Result<&[u8], BoxError> {
        self.send(request)?;
        let mut have = 0;
        while !self.buf[..have].ends_with(b"END\r\n") {
            if have == self.buf.len() {
                return Err("a reply longer than the buffer".into());
            }
            match self.stream.read(&mut self.buf[have..])? {
                0 => return Err("connection closed by the server".into()),
                n => have += n,
            }
        }
        Ok(&self.buf[..have])
    }
}

/// The async floor: a tokio `TcpStream` with the option the async engine's connection sets
/// (`TCP_NODELAY`); otherwise as [`Blocking`].
#[derive(Debug)]
pub struct Bare {
    stream: tokio::net::TcpStream,
    buf: Vec<u8>,
}

impl Bare {
    pub async fn connect(addr: &str) -> Result<Bare, BoxError> {
        let stream = tokio::net::TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(Bare {
            stream,
            buf: vec![0; 64 * 1024],
        })
    }

    /// One `get` and its reply of exactly `len` bytes.
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
        match have == len && self.buf[..have].ends_with(b"END\r\n") {
            true => Ok(()),
            false => Err(format!("a {have}-byte reply, {len} expected").into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mission_items() {
        let cache = newcache::Cache::builder()
            .in_memory()
            .flavor(FLAVOR)
            .version(VERSION)
            .build()
            .unwrap();
        assert_eq!(cache.make_key("k0").len(), 48);
        assert_eq!(cache.make_key("m99").len(), 48);
        assert!(Value::check(Some(Value::new(7)), 7).is_ok());
        assert!(Value::check(Some(Value::new(7)), 8).is_err());
        assert!(Value::check(None, 8).is_err());
    }

    #[test]
    fn the_value_encodes_to_100_bytes() {
        use newcache::Backend;
        let memory = std::sync::Arc::new(newcache::MemoryBackend::new(
            1 << 20,
            std::sync::Arc::new(newcache::SystemClock),
        ));
        let cache = newcache::Cache::builder()
            .backend(memory.clone())
            .flavor(FLAVOR)
            .version(VERSION)
            .build()
            .unwrap();
        cache.set("k1", &Value::new(1), TTL).unwrap();
        let item = memory.get(&cache.make_key("k1")).unwrap().unwrap();
        assert_eq!(value_len(&item.value).unwrap(), 100);
    }

    #[test]
    fn a_reply_names_its_length() {
        assert_eq!(stored_len(b"VALUE k 0 130\r\n...\r\nEND\r\n").unwrap(), 130);
        assert!(stored_len(b"END\r\n").is_err());
    }
}
