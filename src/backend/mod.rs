//! The storage interface: bytes, flags and CAS tokens, memcached's semantics. Backends never see a
//! typed value, a user key or a `Ttl`: keys arrive derived and validated, expiries as memcached's
//! `exptime`.

use std::fmt::Debug;

use bytes::Bytes;

use crate::error::Result;
use crate::ping::{PING_KEY, PingError, PingFailure};

pub mod memcached;
pub mod memory;
#[cfg(feature = "redis")]
pub mod redis;
pub(crate) mod server;
pub(crate) mod tcp;

#[cfg(feature = "tokio")]
pub(crate) use self::nonblocking::{AsyncBackend, BoxFuture};

#[cfg(feature = "tokio")]
mod nonblocking {
    use std::future::Future;
    use std::pin::Pin;

    use super::{Item, StoreOutcome, Write};
    use crate::error::Result;

    /// A boxed, `Send` future: what [`AsyncBackend`]'s methods return (object-safe).
    pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

    /// [`Backend`](super::Backend)'s semantics, asynchronously: what `AsyncCache` runs on. The
    /// memory backend answers at once; the memcached engine (`backend/memcached/engine/`) pipelines.
    /// Every future is cancellation-safe: dropping one never desynchronises a connection or
    /// loses another caller's reply (a write already queued may still be applied).
    pub(crate) trait AsyncBackend: std::fmt::Debug + Send + Sync {
        fn get<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Option<Item>>>;
        /// One result per key, in order; a failed server fails only its own keys.
        fn get_many<'a>(&'a self, keys: &'a [&'a str]) -> BoxFuture<'a, Vec<Result<Option<Item>>>>;
        fn store<'a>(&'a self, w: Write<'a>) -> BoxFuture<'a, Result<StoreOutcome>>;
        /// The write, then a read of the key, on one connection, in order.
        fn store_then_get<'a>(
            &'a self,
            w: Write<'a>,
        ) -> BoxFuture<'a, Result<(StoreOutcome, Option<Item>)>>;
        /// One result per write, in order; a value over the limit fails alone (nothing sent).
        fn store_many<'a>(
            &'a self,
            writes: &'a [Write<'a>],
        ) -> BoxFuture<'a, Vec<Result<StoreOutcome>>>;
        fn delete<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<bool>>;
        fn delete_many<'a>(&'a self, keys: &'a [&'a str]) -> BoxFuture<'a, Vec<Result<bool>>>;
        fn touch<'a>(&'a self, key: &'a str, exptime: u32) -> BoxFuture<'a, Result<bool>>;
        fn incr<'a>(&'a self, key: &'a str, delta: u64) -> BoxFuture<'a, Result<Option<u64>>>;
        fn decr<'a>(&'a self, key: &'a str, delta: u64) -> BoxFuture<'a, Result<Option<u64>>>;
        fn flush_all(&self) -> BoxFuture<'_, Result<()>>;
        /// [`Backend::clear`](super::Backend::clear), whose default this is too.
        fn clear<'a>(&'a self, prefix: Option<&'a str>) -> BoxFuture<'a, Result<()>> {
            let _ = prefix;
            self.flush_all()
        }
        fn max_value_size(&self, key: &str) -> usize;
        /// Asks every server whether it answers ([`Backend::ping`](super::Backend::ping), whose
        /// default this is too).
        fn ping(&self) -> BoxFuture<'_, std::result::Result<(), crate::ping::PingError>> {
            use crate::ping::{PING_KEY, PingError, PingFailure};
            Box::pin(async move {
                self.get(PING_KEY).await.map(drop).map_err(|e| {
                    let server = e.server().unwrap_or("backend").to_owned();
                    PingError::new(vec![PingFailure::new(server, e)], 1)
                })
            })
        }
        /// Waits for background work (connection tasks) to wind down; after it, the backend
        /// still works (it reconnects on demand).
        fn shutdown(&self) -> BoxFuture<'_, ()> {
            Box::pin(async {})
        }
        /// How long a write whose caller went away may still take to land (queued behind
        /// others, then written and answered or its connection given up): a read issued this
        /// long after it sees it, if it landed. Zero for a backend that applies writes when
        /// they are made.
        fn settle_time(&self) -> std::time::Duration {
            std::time::Duration::ZERO
        }
    }

    /// Any sync backend that never blocks (the memory backend) is an async one that answers
    /// at once.
    impl AsyncBackend for Immediate {
        fn get<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Option<Item>>> {
            let r = self.0.get(key);
            Box::pin(async move { r })
        }
        fn get_many<'a>(&'a self, keys: &'a [&'a str]) -> BoxFuture<'a, Vec<Result<Option<Item>>>> {
            let r = self.0.get_many(keys);
            Box::pin(async move { r })
        }
        fn store<'a>(&'a self, w: Write<'a>) -> BoxFuture<'a, Result<StoreOutcome>> {
            let r = self.0.store(w);
            Box::pin(async move { r })
        }
        fn store_then_get<'a>(
            &'a self,
            w: Write<'a>,
        ) -> BoxFuture<'a, Result<(StoreOutcome, Option<Item>)>> {
            let r = self.0.store_then_get(w);
            Box::pin(async move { r })
        }
        fn store_many<'a>(
            &'a self,
            writes: &'a [Write<'a>],
        ) -> BoxFuture<'a, Vec<Result<StoreOutcome>>> {
            let r = self.0.store_many(writes);
            Box::pin(async move { r })
        }
        fn delete<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<bool>> {
            let r = self.0.delete(key);
            Box::pin(async move { r })
        }
        fn delete_many<'a>(&'a self, keys: &'a [&'a str]) -> BoxFuture<'a, Vec<Result<bool>>> {
            let r = self.0.delete_many(keys);
            Box::pin(async move { r })
        }
        fn touch<'a>(&'a self, key: &'a str, exptime: u32) -> BoxFuture<'a, Result<bool>> {
            let r = self.0.touch(key, exptime);
            Box::pin(async move { r })
        }
        fn incr<'a>(&'a self, key: &'a str, delta: u64) -> BoxFuture<'a, Result<Option<u64>>> {
            let r = self.0.incr(key, delta);
            Box::pin(async move { r })
        }
        fn decr<'a>(&'a self, key: &'a str, delta: u64) -> BoxFuture<'a, Result<Option<u64>>> {
            let r = self.0.decr(key, delta);
            Box::pin(async move { r })
        }
        fn flush_all(&self) -> BoxFuture<'_, Result<()>> {
            let r = self.0.flush_all();
            Box::pin(async move { r })
        }
        fn clear<'a>(&'a self, prefix: Option<&'a str>) -> BoxFuture<'a, Result<()>> {
            let r = self.0.clear(prefix);
            Box::pin(async move { r })
        }
        fn max_value_size(&self, key: &str) -> usize {
            self.0.max_value_size(key)
        }
        fn ping(&self) -> BoxFuture<'_, std::result::Result<(), crate::ping::PingError>> {
            let r = self.0.ping();
            Box::pin(async move { r })
        }
    }

    /// A sync backend whose calls never block (the memory backend), as an [`AsyncBackend`].
    #[derive(Debug)]
    pub(crate) struct Immediate(pub(crate) std::sync::Arc<dyn super::Backend>);
}

#[cfg(feature = "tokio")]
pub(crate) use self::nonblocking::Immediate;

/// An item as a backend returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item {
    /// The stored bytes. Values read in one reply may share one buffer (cloning is cheap; a
    /// kept value keeps its reply's buffer alive: copy it out with `to_vec` to keep it long).
    pub value: Bytes,
    /// memcached's client flags.
    pub flags: u32,
    /// The CAS token of this version of the item (memcached's `gets`). 0 means the backend
    /// has no CAS for it (memcached started with `-C` reports 0 for every item, and a CAS-enabled
    /// memcached never issues 0): a backend refuses a [`StoreMode::Cas`] of 0 with an
    /// [`is_unsupported`](crate::Error::is_unsupported) error before sending anything, and
    /// newcache's herd protection, which needs CAS, fails with that error.
    pub cas: u64,
}

/// How [`Backend::store`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreMode {
    /// Unconditional write.
    Set,
    /// Only if the key holds nothing.
    Add,
    /// Only if the key still holds the version with this CAS token.
    Cas(u64),
}

/// What a conditional write did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreOutcome {
    /// Written.
    Stored,
    /// `Add` found the key present.
    NotStored,
    /// `Cas` found another version.
    Exists,
    /// `Cas` found no item.
    NotFound,
}

/// One write: what [`Backend::store`] makes, and each of a batch's ([`Backend::store_many`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Write<'a> {
    /// How to write.
    pub mode: StoreMode,
    /// The derived key.
    pub key: &'a str,
    /// The bytes.
    pub value: &'a [u8],
    /// memcached's client flags.
    pub flags: u32,
    /// memcached's `exptime`.
    pub exptime: u32,
}

impl<'a> Write<'a> {
    /// A write from its fields.
    pub fn new(
        mode: StoreMode,
        key: &'a str,
        value: &'a [u8],
        flags: u32,
        exptime: u32,
    ) -> Write<'a> {
        Write {
            mode,
            key,
            value,
            flags,
            exptime,
        }
    }
}

/// A cache store speaking memcached's semantics on bytes.
///
/// Object-safe; `newcache` holds it as `Arc<dyn Backend>`. The batch methods have default
/// implementations that loop over the single-key ones; real backends override them with one round
/// trip per server. `exptime` is memcached's field: 0 = never, up to 30 days relative seconds,
/// above that an absolute unix time; never negative (a zero TTL is a delete in the layer above).
///
/// Every call is made inside its operation's `tracing` span (see the crate docs, "Health,
/// metrics and traces"); a backend that spreads keys over servers may name the one it picked with
/// [`note_server`], as the memcached backends do. (Not with `Span::current().record(..)`: when
/// newcache's span is disabled, the current span may be the application's own, with a `server`
/// field of its own.)
pub trait Backend: Debug + Send + Sync {
    /// Reads one item with its CAS token.
    fn get(&self, key: &str) -> Result<Option<Item>>;

    /// Reads several items: one result per requested key, in the same order (`Ok(None)` =
    /// missing). A key whose server failed gets that server's error; the other keys are
    /// unaffected (one dead server costs only its own keys).
    fn get_many(&self, keys: &[&str]) -> Vec<Result<Option<Item>>> {
        keys.iter().map(|k| self.get(k)).collect()
    }

    /// Writes one item as its `mode` says.
    fn store(&self, w: Write<'_>) -> Result<StoreOutcome>;

    /// Writes one item, then reads the key back, on the same connection (one round trip on
    /// memcached): what the herd protocol uses to learn the CAS token of what it just wrote.
    /// Another client's write may land between the two; the caller checks the token it wrote.
    fn store_then_get(&self, w: Write<'_>) -> Result<(StoreOutcome, Option<Item>)> {
        let outcome = self.store(w)?;
        Ok((outcome, self.get(w.key)?))
    }

    /// Writes several items, each with its own mode, in one round trip per server; one result
    /// per write, in order. A value over [`max_value_size`](Backend::max_value_size) fails alone
    /// (`TooLarge`, nothing sent for it); a failed server fails only its own writes.
    fn store_many(&self, writes: &[Write<'_>]) -> Vec<Result<StoreOutcome>> {
        writes.iter().map(|w| self.store(*w)).collect()
    }

    /// Deletes one item; `true` if it existed.
    fn delete(&self, key: &str) -> Result<bool>;

    /// Deletes several items; one result per key, in order (`Ok(true)` = it existed).
    fn delete_many(&self, keys: &[&str]) -> Vec<Result<bool>> {
        keys.iter().map(|k| self.delete(k)).collect()
    }

    /// Gives an existing item a new `exptime` without rewriting it; `true` if the key existed.
    fn touch(&self, key: &str, exptime: u32) -> Result<bool>;

    /// Adds `delta` to a decimal counter (wrapping at 2^64 as memcached does); `None` if missing.
    fn incr(&self, key: &str, delta: u64) -> Result<Option<u64>>;

    /// Subtracts `delta` from a decimal counter, clamping at 0; `None` if missing.
    fn decr(&self, key: &str, delta: u64) -> Result<Option<u64>>;

    /// Removes everything (memcached's `flush_all` on every server).
    fn flush_all(&self) -> Result<()>;

    /// Removes one cache's items: those whose keys start with `prefix` (`{flavor}-{version}-`),
    /// or, with `None`, those of a cache whose keys come from a custom key function (no prefix
    /// known). What [`Cache::clear`](crate::Cache::clear) calls. The default is
    /// [`flush_all`](Backend::flush_all): memcached cannot list its keys, so everything goes,
    /// every flavor and version, as Django's `clear` does.
    fn clear(&self, prefix: Option<&str>) -> Result<()> {
        let _ = prefix;
        self.flush_all()
    }

    /// The largest value, in bytes, that can be stored under `key`; larger values are refused with
    /// a `TooLarge` error before anything is sent.
    fn max_value_size(&self, key: &str) -> usize;

    /// Adds this backend's own counts to a snapshot of the cache's, for
    /// [`Cache::stats`](crate::Cache::stats): the memcached backend's replays of invalidations
    /// its servers missed (`replayed_deletes`, `replay_overflows`, `replays_failed`). The
    /// default adds nothing.
    fn report(&self, stats: &mut crate::Stats) {
        let _ = stats;
    }

    /// Asks every server whether it answers: what [`Cache::ping`](crate::Cache::ping) returns.
    ///
    /// The default reads [`PING_KEY`] with [`get`](Backend::get) (a miss is an
    /// answer) and, if that fails, reports one failure named by the error's
    /// [`server`](crate::Error::server), or `"backend"`. Override it when the backend spreads
    /// keys over several servers, to ask each one (build the error with
    /// [`PingError::new`](crate::PingError::new)).
    fn ping(&self) -> std::result::Result<(), PingError> {
        match self.get(PING_KEY) {
            Ok(_) => Ok(()),
            Err(e) => {
                let server = e.server().unwrap_or("backend").to_owned();
                Err(PingError::new(vec![PingFailure::new(server, e)], 1))
            }
        }
    }
}

/// Records `addr` as the `server` of the current operation's span: for a [`Backend`] that has
/// picked the server of a single-key operation (call it from the `Backend` method, on the
/// caller's thread). Only when a subscriber listens at DEBUG (otherwise one comparison with the
/// global maximum level), and only on newcache's own span: with that span disabled, the current
/// one may be the application's, which may have a `server` field of its own, and is left alone.
/// An operation makes several backend calls (a read, a claim, a store): the first one's server
/// is recorded, once, since a subscriber that formats spans (`tracing_subscriber::fmt`)
/// appends each record to the span's fields.
///
/// ```
/// // Outside any newcache operation: records nothing.
/// newcache::backend::note_server("10.0.0.7:11211");
/// ```
pub fn note_server(addr: &str) {
    if tracing::level_enabled!(tracing::Level::DEBUG) {
        let span = tracing::Span::current();
        if span
            .metadata()
            .is_some_and(|m| m.name() == "newcache" && m.target().starts_with("newcache"))
            && !SERVER_NOTED.get().unwrap_or(false)
        {
            span.record("server", addr);
            if SERVER_NOTED.get().is_some() {
                SERVER_NOTED.set(Some(true));
            }
        }
    }
}

thread_local! {
    /// Whether the operation being polled on this thread ([`Traced::traced`]) has recorded its
    /// server: `None` outside one.
    static SERVER_NOTED: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// An operation's future run in its span, whose `server` [`note_server`] records once however
/// many backend calls the operation makes, on whichever threads it is polled.
pub(crate) trait Traced: std::future::Future + Sized {
    /// `self` instrumented with `span`; when the span is enabled, the operation's "server
    /// recorded" flag is this thread's while `self` is polled.
    fn traced(self, span: tracing::Span) -> InSpan<Self> {
        let noted = (!span.is_disabled()).then_some(false);
        InSpan {
            op: tracing::Instrument::instrument(self, span),
            noted,
        }
    }
}

pin_project_lite::pin_project! {
    /// An operation's future in its span ([`Traced::traced`]): as small as the instrumented
    /// future itself (a hit's future is moved through its caller's), plus the flag.
    pub(crate) struct InSpan<F> {
        #[pin]
        op: tracing::instrument::Instrumented<F>,
        // Whether the operation has recorded its server; `None` while its span is disabled
        // (nothing is recorded).
        noted: Option<bool>,
    }
}

impl<F: std::future::Future> std::future::Future for InSpan<F> {
    type Output = F::Output;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        let this = self.project();
        let Some(noted) = this.noted else {
            return this.op.poll(cx);
        };
        let polling = Polling(SERVER_NOTED.replace(Some(*noted)));
        let r = this.op.poll(cx);
        *noted = SERVER_NOTED.get().unwrap_or(false);
        drop(polling);
        r
    }
}

impl<F: std::future::Future> Traced for F {}

/// Gives this thread back the flag of the operation polled around this one (a loader's own
/// cache calls run inside their caller's poll), also when a poll unwinds.
struct Polling(Option<bool>);

impl Drop for Polling {
    fn drop(&mut self) {
        SERVER_NOTED.set(self.0);
    }
}

/// The error for a `cas` store with token 0, which no CAS-enabled server issues: the server
/// (named, when the backend knows it) runs without CAS, and the herd protection needs it.
pub(crate) fn no_cas(server: Option<&str>) -> crate::Error {
    use crate::error::{Error, ErrorKind};
    let at = server.map_or_else(|| "the backend".to_owned(), |s| format!("memcached at {s}"));
    let e = Error::new(
        ErrorKind::Unsupported,
        format!(
            "{at} reports no CAS tokens (memcached started with -C, CAS disabled): claims, \
             placeholders and a loader's fenced store need CAS; restart it without -C"
        ),
    );
    match server {
        Some(s) => e.at_server(s),
        None => e,
    }
}

/// memcached's default item size limit (`-I 1m`).
pub const DEFAULT_ITEM_SIZE: usize = 1024 * 1024;

/// What memcached 1.6 needs beside the value inside one item: its item header, CAS, the key and
/// the "\r\n" terminator, rounded up (the largest value memcached stores under a 42-byte key
/// with `-I 1m` is `DEFAULT_ITEM_SIZE - 42 - ITEM_OVERHEAD` or a little more).
pub(crate) const ITEM_OVERHEAD: usize = 64;

/// The value limit both backends apply, so that what fits in one fits in the other.
pub(crate) fn max_value_size(item_size: usize, key: &str) -> usize {
    item_size.saturating_sub(key.len() + ITEM_OVERHEAD)
}

/// memcached's reading of a counter: decimal digits, optionally followed by the spaces memcached
/// pads a shrunk counter with.
pub(crate) fn parse_counter(bytes: &[u8]) -> Option<u64> {
    let s = std::str::from_utf8(bytes).ok()?.trim_end_matches(' ');
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::Traced;

    /// An operation's future in its span is the instrumented future and a flag: a hit's future
    /// is moved through its caller's, and holding the operation twice doubled it.
    #[test]
    fn a_traced_future_holds_its_operation_once() {
        let op = async {
            let buf = [7u8; 512];
            std::future::ready(()).await;
            buf[3]
        };
        let alone = std::mem::size_of_val(&op);
        let traced = op.traced(tracing::Span::none());
        let span = std::mem::size_of::<tracing::Span>();
        assert!(
            std::mem::size_of_val(&traced) <= alone.next_multiple_of(8) + span + 8,
            "{} bytes for an operation of {alone}",
            std::mem::size_of_val(&traced)
        );
    }
}
