//! The clients measured: how each connects, fills its keys and does one checked GET.
//!
//! The raw clients (async-memcached, memcache-async, bare) share the items `k0`..`k999`, 100 raw
//! bytes each with flags 0; newcache's clients store [`Value`] under the same user keys, which
//! newcache derives into keys of its own (flavor `bench`). A GET that misses or returns the wrong
//! bytes is an error.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_memcached::AsciiProtocol;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::hot::args::Pools;

/// The hot keys.
pub const KEYS: usize = 1000;
/// The raw clients' value size.
pub const RAW_LEN: usize = 100;
/// How long the populated items live (longer than any sitting).
const TTL: Duration = Duration::from_secs(3600);

/// Any error, as the tally counts it.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// newcache's value: encodes to about 100 bytes.
#[derive(Debug, Serialize, Deserialize)]
pub struct Value {
    pub id: u64,
    pub name: String,
}

impl Value {
    fn new(id: usize) -> Value {
        Value {
            id: id as u64,
            name: "x".repeat(80),
        }
    }
}

/// What every client needs: the server, the keys and their expected replies, the pool rule.
pub struct Ctx {
    pub addr: String,
    pub pools: Pools,
    /// `k{i}`.
    names: Vec<String>,
    /// `get k{i}\r\n`.
    requests: Vec<Vec<u8>>,
    /// The length of the whole reply to `requests[i]` on a hit.
    reply_lens: Vec<usize>,
}

impl Ctx {
    pub fn new(addr: String, pools: Pools) -> Ctx {
        let names: Vec<String> = (0..KEYS).map(|i| format!("k{i}")).collect();
        let requests = names.iter().map(|k| format!("get {k}\r\n").into_bytes());
        let reply_lens = names.iter().map(|k| {
            let header = format!("VALUE {k} 0 {RAW_LEN}\r\n");
            header.len() + RAW_LEN + "\r\nEND\r\n".len()
        });
        Ctx {
            addr,
            pools,
            requests: requests.collect(),
            reply_lens: reply_lens.collect(),
            names,
        }
    }

    /// The connection limit of a pooled client with `callers` concurrent callers; `None` means
    /// the client's default.
    fn pool(&self, callers: usize) -> Option<usize> {
        match self.pools {
            Pools::PerTask => Some(callers),
            Pools::Default => None,
        }
    }
}

/// One task's client: a GET of key `i`, checked. One value per task, owned by it.
pub trait AsyncGet: Send + 'static {
    fn get(&mut self, i: usize) -> impl Future<Output = Result<(), BoxError>> + Send;
}

fn raw_value() -> Vec<u8> {
    vec![b'v'; RAW_LEN]
}

fn check_raw(data: Option<&[u8]>) -> Result<(), BoxError> {
    match data {
        Some(d) if d.len() == RAW_LEN => Ok(()),
        Some(d) => Err(format!("{} bytes instead of {RAW_LEN}", d.len()).into()),
        None => Err("miss".into()),
    }
}

fn check_value(found: Option<Value>, i: usize) -> Result<(), BoxError> {
    match found {
        Some(v) if v.id == i as u64 => Ok(()),
        Some(v) => Err(format!("value {} under key {i}", v.id).into()),
        None => Err("miss".into()),
    }
}

// --- async-memcached ---

/// One `async_memcached::Client`: one connection, reopened after an error closed it.
pub struct AsyncMemcached {
    client: async_memcached::Client,
    ctx: Arc<Ctx>,
}

impl AsyncMemcached {
    pub async fn connect(ctx: &Arc<Ctx>) -> Result<AsyncMemcached, BoxError> {
        let client = async_memcached::Client::new(format!("tcp://{}", ctx.addr)).await?;
        Ok(AsyncMemcached {
            client,
            ctx: Arc::clone(ctx),
        })
    }

    pub async fn populate(&mut self) -> Result<(), BoxError> {
        let value = raw_value();
        for k in &self.ctx.names {
            self.client
                .set(k, &value[..], Some(TTL.as_secs() as i64), None)
                .await?;
        }
        Ok(())
    }
}

impl AsyncGet for AsyncMemcached {
    async fn get(&mut self, i: usize) -> Result<(), BoxError> {
        if self.client.is_closed() {
            *self = AsyncMemcached::connect(&self.ctx).await?;
        }
        let found = self.client.get(&self.ctx.names[i]).await?;
        check_raw(found.as_ref().and_then(|v| v.data.as_deref()))
    }
}

// --- memcache::exp::AsyncMemcache ---

/// A clone of one `memcache::exp::AsyncMemcache` (its pool is shared by the clones).
#[derive(Clone)]
pub struct MemcacheAsync {
    cache: memcache::exp::AsyncMemcache,
    ctx: Arc<Ctx>,
}

impl MemcacheAsync {
    /// One client for `callers` callers; connections are made on demand.
    pub async fn connect(ctx: &Arc<Ctx>, callers: usize) -> Result<MemcacheAsync, BoxError> {
        let mut builder = memcache::exp::AsyncMemcache::builder();
        if let Some(n) = ctx.pool(callers) {
            builder = builder.max_idle(n);
        }
        let cache = builder.connect_async([ctx.addr.as_str()]).await?;
        Ok(MemcacheAsync {
            cache,
            ctx: Arc::clone(ctx),
        })
    }

    pub async fn populate(&self) -> Result<(), BoxError> {
        let value = raw_value();
        let ttl = memcache::exp::Ttl::from(TTL);
        for k in &self.ctx.names {
            self.cache.set(k, &value[..], ttl).await?;
        }
        Ok(())
    }
}

impl AsyncGet for MemcacheAsync {
    async fn get(&mut self, i: usize) -> Result<(), BoxError> {
        let found: Option<Vec<u8>> = self.cache.get(&self.ctx.names[i]).await?;
        check_raw(found.as_deref())
    }
}

// --- newcache's sync Cache ---

/// newcache's sync `Cache` for `callers` callers; `pipelined`: concurrent callers on the engine.
pub fn newcache(ctx: &Ctx, callers: usize, pipelined: bool) -> Result<newcache::Cache, BoxError> {
    let mut builder = newcache::Cache::builder()
        .memcached([ctx.addr.as_str()])
        .flavor("bench")
        .pipelined_sync(pipelined);
    if let Some(n) = ctx.pool(callers) {
        builder = builder.pool_size(u32::try_from(n)?);
    }
    Ok(builder.build()?)
}

pub fn populate_newcache(ctx: &Ctx) -> Result<(), BoxError> {
    let cache = newcache(ctx, 1, false)?;
    for (i, k) in ctx.names.iter().enumerate() {
        cache.set(k, &Value::new(i), TTL)?;
    }
    Ok(())
}

/// One GET through the sync `Cache` on the calling thread.
pub fn newcache_get(cache: &newcache::Cache, ctx: &Ctx, i: usize) -> Result<(), BoxError> {
    check_value(cache.get::<Value>(&ctx.names[i])?, i)
}

/// The sync `Cache` called through `spawn_blocking`: every GET hops to the blocking pool.
pub struct NewcacheBlocking {
    pub cache: newcache::Cache,
    pub ctx: Arc<Ctx>,
}

impl AsyncGet for NewcacheBlocking {
    async fn get(&mut self, i: usize) -> Result<(), BoxError> {
        let (cache, ctx) = (self.cache.clone(), Arc::clone(&self.ctx));
        tokio::task::spawn_blocking(move || newcache_get(&cache, &ctx, i)).await?
    }
}

// --- the bare socket ---

/// A tokio `TcpStream`: `get k\r\n`, then read until the reply ends with `END\r\n`.
pub struct Bare {
    stream: TcpStream,
    buf: Vec<u8>,
    ctx: Arc<Ctx>,
}

impl Bare {
    pub async fn connect(ctx: &Arc<Ctx>) -> Result<Bare, BoxError> {
        let stream = TcpStream::connect(&ctx.addr).await?;
        stream.set_nodelay(true)?;
        Ok(Bare {
            stream,
            buf: Vec::with_capacity(4096),
            ctx: Arc::clone(ctx),
        })
    }

    pub async fn populate(&mut self) -> Result<(), BoxError> {
        let (value, ctx) = (raw_value(), Arc::clone(&self.ctx));
        for k in &ctx.names {
            let mut cmd = format!("set {k} 0 {} {RAW_LEN}\r\n", TTL.as_secs()).into_bytes();
            cmd.extend_from_slice(&value);
            cmd.extend_from_slice(b"\r\n");
            self.stream.write_all(&cmd).await?;
            self.read_until(b"\r\n").await?;
            if self.buf != b"STORED\r\n" {
                return Err(format!("set {k}: {}", String::from_utf8_lossy(&self.buf)).into());
            }
        }
        Ok(())
    }

    /// Reads one reply: until the bytes read end with `end` (the values never contain it).
    async fn read_until(&mut self, end: &[u8]) -> Result<(), BoxError> {
        self.buf.clear();
        while !self.buf.ends_with(end) {
            if self.stream.read_buf(&mut self.buf).await? == 0 {
                return Err("connection closed by the server".into());
            }
        }
        Ok(())
    }
}

impl AsyncGet for Bare {
    async fn get(&mut self, i: usize) -> Result<(), BoxError> {
        self.stream.write_all(&self.ctx.requests[i]).await?;
        if let Err(e) = self.read_until(b"END\r\n").await {
            // The stream is out of step: start over on a new one.
            *self = Bare::connect(&self.ctx).await?;
            return Err(e);
        }
        match self.buf.len() == self.ctx.reply_lens[i] && self.buf.starts_with(b"VALUE ") {
            true => Ok(()),
            false if self.buf == b"END\r\n" => Err("miss".into()),
            false => Err(format!("a {}-byte reply", self.buf.len()).into()),
        }
    }
}

// --- newcache's AsyncCache ---

/// A clone of one `newcache::AsyncCache`.
#[cfg(feature = "async-cache")]
#[derive(Clone)]
pub struct AsyncCache {
    cache: newcache::AsyncCache,
    ctx: Arc<Ctx>,
}

#[cfg(feature = "async-cache")]
impl AsyncCache {
    /// One `AsyncCache` for all callers, on its default engine (2 pipelined connections per
    /// server, whatever `--pools` says: the engine does not pool per caller).
    pub fn build(ctx: &Arc<Ctx>, _callers: usize) -> Result<AsyncCache, BoxError> {
        let cache: newcache::AsyncCache = newcache::Cache::builder()
            .memcached([ctx.addr.as_str()])
            .flavor("bench")
            .build_async()?;
        Ok(AsyncCache {
            cache,
            ctx: Arc::clone(ctx),
        })
    }

    pub async fn populate(&self) -> Result<(), BoxError> {
        for (i, k) in self.ctx.names.iter().enumerate() {
            self.cache.set(k, &Value::new(i), TTL).await?;
        }
        Ok(())
    }
}

#[cfg(feature = "async-cache")]
impl AsyncCache {
    /// One GET of key `i` (for callers that share the cache by reference).
    pub async fn get_key(&self, i: usize) -> Result<(), BoxError> {
        check_value(self.cache.get::<Value>(&self.ctx.names[i]).await?, i)
    }
}

#[cfg(feature = "async-cache")]
impl AsyncGet for AsyncCache {
    async fn get(&mut self, i: usize) -> Result<(), BoxError> {
        check_value(self.cache.get::<Value>(&self.ctx.names[i]).await?, i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expected_replies() {
        let ctx = Ctx::new("127.0.0.1:1".into(), Pools::PerTask);
        assert_eq!(ctx.names[999], "k999");
        assert_eq!(ctx.requests[7], b"get k7\r\n");
        let hit = [&b"VALUE k7 0 100\r\n"[..], &raw_value(), b"\r\nEND\r\n"].concat();
        assert_eq!(ctx.reply_lens[7], hit.len());
        assert_eq!(ctx.pool(64), Some(64));
        assert_eq!(Ctx::new(String::new(), Pools::Default).pool(64), None);
    }

    #[test]
    fn checks() {
        assert!(check_raw(Some(&raw_value())).is_ok());
        assert!(check_raw(Some(b"short")).is_err());
        assert!(check_raw(None).is_err());
        assert!(check_value(Some(Value::new(3)), 3).is_ok());
        assert!(check_value(Some(Value::new(3)), 4).is_err());
        assert!(check_value(None, 4).is_err());
    }
}
