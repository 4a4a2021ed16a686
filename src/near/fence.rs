//! What keeps near copies behind this process's writes: the stripes (sequence counters indexed
//! by a hash of the derived key, bumped before and after every write), and the backend wrappers
//! that bump them. Every cache is built over a wrapped backend, with a near tier or without, so
//! that every write of every caller in this process (the facade, a lease's renewals and
//! completion, the layer, a cache that keeps no copies) fences every near tier over the same
//! store.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::backend::{Backend, Item, StoreOutcome, Write};
use crate::error::Result;

/// How many stripes a domain has: a write makes the copies of about 1/`STRIPES` of the keys
/// fetch again (those whose derived keys share its stripe), never more.
pub(crate) const STRIPES: usize = 1 << 14;

/// What the caches over one store in this process share: the stripes their writes bump, and a
/// flush count `clear` bumps. The caches built over the same server list (or the same custom
/// or memory backend) share one domain, so a write through any of them stops the others'
/// copies at once.
pub(crate) struct Domain {
    /// Bumped before and after each write of a key hashing here: a copy is served only while
    /// its stripe holds the sequence it was filled under.
    seq: Box<[AtomicU64]>,
    /// Until when (ms on the domain's own clock, `origin`) no read of the stripe may fill: a
    /// write whose caller went away, or whose outcome is unknown, may still land until then.
    quiet: Box<[AtomicU64]>,
    /// Bumped before and after each `clear` (and `flush_all`): every copy filled before goes.
    flushes: AtomicU64,
    /// Until when no read may fill anything: a `clear` that may still land.
    flush_quiet: AtomicU64,
    /// The origin of the quiet deadlines: one monotonic clock for every cache of the domain,
    /// whatever clock each was built with.
    origin: Instant,
    hasher: std::hash::RandomState,
}

impl std::fmt::Debug for Domain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Domain")
            .field("stripes", &self.seq.len())
            .field("flushes", &self.flushes)
            .finish_non_exhaustive()
    }
}

/// Which store a domain fences: a server list, or a backend object in this process (by
/// address: a backend at a reused address may join a domain still alive, which only fences
/// more).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Store {
    Servers(Vec<String>),
    InProcess(usize),
}

/// Where a read of one key was sent from: the stripe, the sequences, and when (the near
/// clock's age, ms). A copy is filled from the read only under this ticket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ticket {
    pub(crate) stripe: u32,
    pub(crate) seq: u64,
    pub(crate) flush: u64,
    pub(crate) sent_ms: u64,
    /// The bus's generation when it was sent (0 without a bus): a possible loss since stops
    /// its copy from being served as a hit.
    pub(crate) bus: u64,
}

/// The stripes one write bumps.
#[derive(Debug)]
enum Stripes {
    One(u32),
    Many(Vec<u32>),
}

impl Stripes {
    fn as_slice(&self) -> &[u32] {
        match self {
            Stripes::One(s) => std::slice::from_ref(s),
            Stripes::Many(v) => v,
        }
    }
}

impl Domain {
    fn new() -> Domain {
        let zeros = || (0..STRIPES).map(|_| AtomicU64::new(0)).collect();
        Domain {
            seq: zeros(),
            quiet: zeros(),
            flushes: AtomicU64::new(0),
            flush_quiet: AtomicU64::new(0),
            origin: Instant::now(),
            hasher: std::hash::RandomState::new(),
        }
    }

    /// The domain of the caches over `servers` in this process, or, for a cache that names no
    /// server, over `backend`.
    pub(crate) fn of(servers: &[String], backend: &Arc<dyn Backend>) -> Arc<Domain> {
        static DOMAINS: Mutex<Option<HashMap<Store, Weak<Domain>>>> = Mutex::new(None);
        let store = if servers.is_empty() {
            Store::InProcess(Arc::as_ptr(backend).cast::<()>() as usize)
        } else {
            let mut list = servers.to_vec();
            list.sort();
            Store::Servers(list)
        };
        let found = |domains: &mut Option<HashMap<Store, Weak<Domain>>>| {
            let domains = domains.get_or_insert_with(HashMap::new);
            domains.retain(|_, d| d.strong_count() > 0);
            domains.get(&store).and_then(Weak::upgrade)
        };
        if let Some(d) = found(&mut DOMAINS.lock()) {
            return d;
        }
        // Made outside the lock (its stripes are zeroed), then kept unless another build made
        // one meanwhile.
        let made = Arc::new(Domain::new());
        let mut domains = DOMAINS.lock();
        if let Some(d) = found(&mut domains) {
            return d;
        }
        if let Some(domains) = domains.as_mut() {
            domains.insert(store, Arc::downgrade(&made));
        }
        made
    }

    /// Ms since the domain began, on its monotonic clock.
    fn now_ms(&self) -> u64 {
        millis(self.origin.elapsed())
    }

    /// The stripe of derived key `derived`.
    pub(crate) fn stripe(&self, derived: &str) -> u32 {
        let mut h = self.hasher.build_hasher();
        h.write(derived.as_bytes());
        (h.finish() as usize % STRIPES) as u32
    }

    /// A ticket for a read of `derived` about to be sent at `sent_ms` (the near clock's age),
    /// or `None` while a write to its stripe (or a `clear`) may still be landing: such a read
    /// fills nothing.
    pub(crate) fn ticket(&self, derived: &str, sent_ms: u64) -> Option<Ticket> {
        let stripe = self.stripe(derived);
        let i = stripe as usize;
        let ticket = Ticket {
            stripe,
            seq: self.seq[i].load(Ordering::SeqCst),
            flush: self.flushes.load(Ordering::SeqCst),
            sent_ms,
            bus: 0,
        };
        let quiet = self.quiet[i]
            .load(Ordering::SeqCst)
            .max(self.flush_quiet.load(Ordering::SeqCst));
        (quiet == 0 || self.now_ms() >= quiet).then_some(ticket)
    }

    /// Whether nothing was written to the ticket's stripe, and nothing cleared, since it was
    /// taken, but `writes` writes of the ticket holder's own (each bumps its stripe twice).
    pub(crate) fn holds(&self, t: &Ticket, writes: u64) -> bool {
        self.seq[t.stripe as usize].load(Ordering::SeqCst) == t.seq + 2 * writes
            && self.flushes.load(Ordering::SeqCst) == t.flush
    }

    /// A write to `keys` begins: their copies stop being served, and no read sent from now
    /// fills until it ends.
    fn begin<'k>(&self, keys: impl IntoIterator<Item = &'k str>) -> Stripes {
        let mut keys = keys.into_iter();
        let stripes = match (keys.next(), keys.next()) {
            (Some(k), None) => Stripes::One(self.stripe(k)),
            (first, second) => {
                let mut v: Vec<u32> = first
                    .into_iter()
                    .chain(second)
                    .chain(keys)
                    .map(|k| self.stripe(k))
                    .collect();
                v.sort_unstable();
                v.dedup();
                Stripes::Many(v)
            }
        };
        for &s in stripes.as_slice() {
            self.seq[s as usize].fetch_add(1, Ordering::SeqCst);
        }
        stripes
    }

    /// The write to `stripes` ended: reads sent from now see it. `settle`: set when its outcome
    /// is unknown (or its caller went away), how long it may still take to land; no read sent
    /// before then fills.
    fn end(&self, stripes: &Stripes, settle: Option<Duration>) {
        let until = settle.map(|d| self.now_ms().saturating_add(millis(d)).max(1));
        for &s in stripes.as_slice() {
            if let Some(until) = until {
                self.quiet[s as usize].fetch_max(until, Ordering::SeqCst);
            }
            self.seq[s as usize].fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Another cache's write of `keys`, heard on the bus: their copies stop being served.
    pub(crate) fn dropped<'k>(&self, keys: impl IntoIterator<Item = &'k str>) {
        for k in keys {
            self.seq[self.stripe(k) as usize].fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Another cache's `clear`, or a loss on the bus: every copy stops being served.
    pub(crate) fn flushed(&self) {
        self.flushes.fetch_add(1, Ordering::SeqCst);
    }

    /// A `clear` of this process begins: as one heard from another cache, every copy stops
    /// being served.
    fn flush_begin(&self) {
        self.flushed();
    }

    fn flush_end(&self, settle: Option<Duration>) {
        if let Some(d) = settle {
            let until = self.now_ms().saturating_add(millis(d)).max(1);
            self.flush_quiet.fetch_max(until, Ordering::SeqCst);
        }
        self.flushes.fetch_add(1, Ordering::SeqCst);
    }

    /// A write of `derived` whose outcome is unknown, for tests: begun and ended as the
    /// wrappers do it. Always true.
    #[cfg(test)]
    pub(crate) fn settle_unknown_for_tests(&self, derived: &str, settle: Duration) -> bool {
        let stripes = self.begin([derived]);
        self.end(&stripes, Some(settle));
        true
    }

    /// Whether a copy filled under the ticket `(stripe, seq, flush)` may still be served: its
    /// stripe and the flush count are as they were.
    #[inline]
    pub(crate) fn current(&self, stripe: u32, seq: u64, flush: u64) -> bool {
        self.seq[stripe as usize].load(Ordering::Acquire) == seq
            && self.flushes.load(Ordering::Acquire) == flush
    }
}

/// A cache's side of its domain, shared by its sync and async wrappers: the stripes its writes
/// bump, how long a write whose outcome is unknown may still take to land, and the bus it
/// announces its writes on. Ending a write here also announces it, so no wrapper can fence a
/// write and forget to announce it.
#[derive(Debug)]
pub(crate) struct Fence {
    pub(crate) domain: Arc<Domain>,
    /// How long a write whose outcome is unknown may still take to land (the backends' settle
    /// time, at least the cache's).
    pub(crate) settle: Duration,
    /// The bus this cache announces its writes on, if any.
    pub(crate) station: Option<Arc<super::bus::Station>>,
}

impl Fence {
    /// Whether the bus announces `w`: every write but the herd protocol's claims, and none
    /// without a bus (no write's envelope is read then).
    fn announces(&self, w: &Write<'_>) -> bool {
        self.station.is_some() && !crate::envelope::is_claim(w.flags, w.value)
    }

    /// The keys of `writes` the bus announces (none, and nothing allocated, without a bus).
    fn announced<'w, 'k: 'w>(
        &self,
        writes: impl IntoIterator<Item = &'w Write<'k>>,
    ) -> Vec<&'k str> {
        if self.station.is_none() {
            return Vec::new();
        }
        writes
            .into_iter()
            .filter(|w| self.announces(w))
            .map(|w| w.key)
            .collect()
    }

    /// A write to `keys` begins (see `Domain::begin`).
    fn begin(&self, keys: &[&str]) -> Stripes {
        self.domain.begin(keys.iter().copied())
    }

    /// The write to `stripes` ended (see `Domain::end`); `announce`, its keys the bus
    /// carries, are announced now or, with `settle`, once the write may have landed.
    fn end(&self, stripes: &Stripes, announce: &[&str], settle: Option<Duration>) {
        self.domain.end(stripes, settle);
        if let Some(station) = &self.station {
            station.announce(announce, settle);
        }
    }

    /// A `clear` (or `flush_all`) begins: every copy stops being served.
    fn flush_begin(&self) {
        self.domain.flush_begin();
    }

    /// The `clear` ended, and is announced now or, with `settle`, once it may have landed.
    fn flush_end(&self, settle: Option<Duration>) {
        self.domain.flush_end(settle);
        if let Some(station) = &self.station {
            station.announce_flush(settle);
        }
    }

    /// A write's settle time if its outcome is unknown (it may still land).
    fn unknown<T>(&self, r: &Result<T>) -> Option<Duration> {
        match r {
            Err(e) if e.is_outcome_unknown() => Some(self.settle),
            _ => None,
        }
    }

    /// A batch's settle time if any of its writes' outcome is unknown.
    fn any_unknown<T>(&self, rs: &[Result<T>]) -> Option<Duration> {
        rs.iter().find_map(|r| self.unknown(r))
    }
}

/// A sync backend whose writes fence the near tiers of its domain.
#[derive(Debug)]
pub(crate) struct Fenced {
    pub(crate) inner: Arc<dyn Backend>,
    pub(crate) fence: Arc<Fence>,
}

impl Fenced {
    /// Runs `write` of `keys`, fenced, then announces `announce` on the bus.
    fn around<T>(
        &self,
        keys: &[&str],
        announce: &[&str],
        write: impl FnOnce() -> T,
        settle: impl FnOnce(&T) -> Option<Duration>,
    ) -> T {
        /// Ends the fence if the write unwinds (a custom backend that panics): as a write
        /// that may still land.
        struct Unwinding<'a>(&'a Fence, Option<Stripes>, &'a [&'a str]);
        impl Drop for Unwinding<'_> {
            fn drop(&mut self) {
                if let Some(s) = self.1.take() {
                    self.0.end(&s, self.2, Some(self.0.settle));
                }
            }
        }
        let fence = &*self.fence;
        let mut guard = Unwinding(fence, Some(fence.begin(keys)), announce);
        let r = write();
        if let Some(stripes) = guard.1.take() {
            fence.end(&stripes, announce, settle(&r));
        }
        r
    }

    fn one<T>(&self, key: &str, write: impl FnOnce() -> Result<T>) -> Result<T> {
        self.around(&[key], &[key], write, |r| self.fence.unknown(r))
    }

    fn store_one<T>(&self, w: &Write<'_>, write: impl FnOnce() -> Result<T>) -> Result<T> {
        let announce: &[&str] = if self.fence.announces(w) {
            &[w.key]
        } else {
            &[]
        };
        self.around(&[w.key], announce, write, |r| self.fence.unknown(r))
    }

    /// Runs `write`, a `clear` or `flush_all`, fenced, then announces it on the bus.
    fn flush(&self, write: impl FnOnce() -> Result<()>) -> Result<()> {
        self.fence.flush_begin();
        let r = write();
        self.fence.flush_end(self.fence.unknown(&r));
        r
    }
}

impl Backend for Fenced {
    fn get(&self, key: &str) -> Result<Option<Item>> {
        self.inner.get(key)
    }
    fn get_many(&self, keys: &[&str]) -> Vec<Result<Option<Item>>> {
        self.inner.get_many(keys)
    }
    fn store(&self, w: Write<'_>) -> Result<StoreOutcome> {
        self.store_one(&w, || self.inner.store(w))
    }
    fn store_then_get(&self, w: Write<'_>) -> Result<(StoreOutcome, Option<Item>)> {
        self.store_one(&w, || self.inner.store_then_get(w))
    }
    fn store_many(&self, writes: &[Write<'_>]) -> Vec<Result<StoreOutcome>> {
        let keys: Vec<&str> = writes.iter().map(|w| w.key).collect();
        self.around(
            &keys,
            &self.fence.announced(writes),
            || self.inner.store_many(writes),
            |r| self.fence.any_unknown(r),
        )
    }
    fn delete(&self, key: &str) -> Result<bool> {
        self.one(key, || self.inner.delete(key))
    }
    fn delete_many(&self, keys: &[&str]) -> Vec<Result<bool>> {
        self.around(
            keys,
            keys,
            || self.inner.delete_many(keys),
            |r| self.fence.any_unknown(r),
        )
    }
    fn touch(&self, key: &str, exptime: u32) -> Result<bool> {
        // A touch changes no value: nothing to announce.
        self.around(
            &[key],
            &[],
            || self.inner.touch(key, exptime),
            |r| self.fence.unknown(r),
        )
    }
    fn incr(&self, key: &str, delta: u64) -> Result<Option<u64>> {
        self.one(key, || self.inner.incr(key, delta))
    }
    fn decr(&self, key: &str, delta: u64) -> Result<Option<u64>> {
        self.one(key, || self.inner.decr(key, delta))
    }
    fn flush_all(&self) -> Result<()> {
        self.flush(|| self.inner.flush_all())
    }
    fn clear(&self, prefix: Option<&str>) -> Result<()> {
        self.flush(|| self.inner.clear(prefix))
    }
    fn max_value_size(&self, key: &str) -> usize {
        self.inner.max_value_size(key)
    }
    fn report(&self, stats: &mut crate::Stats) {
        self.inner.report(stats)
    }
    fn ping(&self) -> std::result::Result<(), crate::ping::PingError> {
        self.inner.ping()
    }
}

#[cfg(feature = "tokio")]
pub(crate) use self::nonblocking::FencedAsync;

#[cfg(feature = "tokio")]
mod nonblocking {
    use std::sync::Arc;
    use std::time::Duration;

    use super::{Fence, Stripes};
    use crate::backend::{AsyncBackend, BoxFuture, Item, StoreOutcome, Write};
    use crate::error::Result;

    /// An async backend whose writes fence the near tiers of its domain; a write whose caller
    /// goes away, or whose outcome is unknown, fences its stripes until it may have landed.
    #[derive(Debug)]
    pub(crate) struct FencedAsync {
        pub(crate) inner: Arc<dyn AsyncBackend>,
        pub(crate) fence: Arc<Fence>,
    }

    /// A write in flight: ended when it is answered, abandoned when its future is dropped.
    struct InFlight<'a> {
        fence: &'a Fence,
        /// The stripes written; `None` for a `clear`.
        stripes: Option<Stripes>,
        /// The keys written, to announce on the bus (empty without one).
        keys: Vec<&'a str>,
        done: bool,
    }

    impl InFlight<'_> {
        /// Ends the write (once): answered, with `settle` if its outcome is unknown, or
        /// abandoned, as a write that may still land.
        fn end(&mut self, settle: Option<Duration>) {
            if std::mem::replace(&mut self.done, true) {
                return;
            }
            match &self.stripes {
                Some(s) => self.fence.end(s, &self.keys, settle),
                None => self.fence.flush_end(settle),
            }
        }
    }

    impl Drop for InFlight<'_> {
        fn drop(&mut self) {
            self.end(Some(self.fence.settle));
        }
    }

    impl FencedAsync {
        /// Runs `write` on `keys` (or, with `None`, a clear), fenced from before the write's
        /// future is made (a backend may send when it makes it) until it is answered; dropped
        /// before, the write may still land, and its stripes stay fenced until it may have.
        /// `announce`: the keys the bus announces (see `Fence::announced` and
        /// `FencedAsync::announcing`). `settle`: whether its answer leaves its outcome
        /// unknown.
        fn around<'a, T: Send + 'a>(
            &'a self,
            keys: Option<&[&str]>,
            announce: Vec<&'a str>,
            write: impl FnOnce() -> BoxFuture<'a, T>,
            settle: fn(&Fence, &T) -> Option<Duration>,
        ) -> BoxFuture<'a, T> {
            let fence = &*self.fence;
            let stripes = match keys {
                Some(keys) => Some(fence.begin(keys)),
                None => {
                    fence.flush_begin();
                    None
                }
            };
            let mut flight = InFlight {
                fence,
                stripes,
                keys: announce,
                done: false,
            };
            let write = write();
            Box::pin(async move {
                let r = write.await;
                flight.end(settle(fence, &r));
                r
            })
        }

        /// `keys`, to announce: none, and nothing allocated, without a bus.
        fn announcing<'k>(&self, keys: &[&'k str]) -> Vec<&'k str> {
            match &self.fence.station {
                Some(_) => keys.to_vec(),
                None => Vec::new(),
            }
        }
    }

    impl AsyncBackend for FencedAsync {
        fn get<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Option<Item>>> {
            self.inner.get(key)
        }
        fn get_many<'a>(&'a self, keys: &'a [&'a str]) -> BoxFuture<'a, Vec<Result<Option<Item>>>> {
            self.inner.get_many(keys)
        }
        fn store<'a>(&'a self, w: Write<'a>) -> BoxFuture<'a, Result<StoreOutcome>> {
            self.around(
                Some(&[w.key]),
                self.fence.announced([&w]),
                || self.inner.store(w),
                Fence::unknown,
            )
        }
        fn store_then_get<'a>(
            &'a self,
            w: Write<'a>,
        ) -> BoxFuture<'a, Result<(StoreOutcome, Option<Item>)>> {
            self.around(
                Some(&[w.key]),
                self.fence.announced([&w]),
                || self.inner.store_then_get(w),
                Fence::unknown,
            )
        }
        fn store_many<'a>(
            &'a self,
            writes: &'a [Write<'a>],
        ) -> BoxFuture<'a, Vec<Result<StoreOutcome>>> {
            let keys: Vec<&str> = writes.iter().map(|w| w.key).collect();
            self.around(
                Some(&keys),
                self.fence.announced(writes),
                || self.inner.store_many(writes),
                |f, r| f.any_unknown(r),
            )
        }
        fn delete<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<bool>> {
            self.around(
                Some(&[key]),
                self.announcing(&[key]),
                || self.inner.delete(key),
                Fence::unknown,
            )
        }
        fn delete_many<'a>(&'a self, keys: &'a [&'a str]) -> BoxFuture<'a, Vec<Result<bool>>> {
            self.around(
                Some(keys),
                self.announcing(keys),
                || self.inner.delete_many(keys),
                |f, r| f.any_unknown(r),
            )
        }
        fn touch<'a>(&'a self, key: &'a str, exptime: u32) -> BoxFuture<'a, Result<bool>> {
            self.around(
                Some(&[key]),
                Vec::new(),
                || self.inner.touch(key, exptime),
                Fence::unknown,
            )
        }
        fn incr<'a>(&'a self, key: &'a str, delta: u64) -> BoxFuture<'a, Result<Option<u64>>> {
            self.around(
                Some(&[key]),
                self.announcing(&[key]),
                || self.inner.incr(key, delta),
                Fence::unknown,
            )
        }
        fn decr<'a>(&'a self, key: &'a str, delta: u64) -> BoxFuture<'a, Result<Option<u64>>> {
            self.around(
                Some(&[key]),
                self.announcing(&[key]),
                || self.inner.decr(key, delta),
                Fence::unknown,
            )
        }
        fn flush_all(&self) -> BoxFuture<'_, Result<()>> {
            self.around(None, Vec::new(), || self.inner.flush_all(), Fence::unknown)
        }
        fn clear<'a>(&'a self, prefix: Option<&'a str>) -> BoxFuture<'a, Result<()>> {
            self.around(
                None,
                Vec::new(),
                || self.inner.clear(prefix),
                Fence::unknown,
            )
        }
        fn max_value_size(&self, key: &str) -> usize {
            self.inner.max_value_size(key)
        }
        fn ping(&self) -> BoxFuture<'_, std::result::Result<(), crate::ping::PingError>> {
            self.inner.ping()
        }
        fn shutdown(&self) -> BoxFuture<'_, ()> {
            self.inner.shutdown()
        }
        fn settle_time(&self) -> Duration {
            self.inner.settle_time()
        }
    }
}

/// `d` in whole milliseconds, saturating.
pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
