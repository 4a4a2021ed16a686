//! What keeps near copies behind this process's writes: the stripes (sequence counters indexed
//! by a hash of the derived key, bumped before and after every write), and the backend wrappers
//! that bump them, so that every write of every caller (the facade, a lease's renewals and
//! completion, the layer) fences the near tier without knowing of it.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;

use crate::backend::{Backend, Item, StoreOutcome, Write};
use crate::error::Result;

/// How many stripes a domain has: a write makes the copies of about 1/`STRIPES` of the keys in
/// process memory fetch again (those whose derived keys share its stripe), never more.
pub(crate) const STRIPES: usize = 1 << 14;

/// What the caches over one store in this process share: the stripes their writes bump, and a
/// flush count `clear` bumps. Two caches built over the same servers share one domain, so a
/// write through either stops the other's copies at once.
#[derive(Debug)]
pub(crate) struct Domain {
    /// Bumped before and after each write of a key hashing here: a copy is served only while
    /// its stripe holds the sequence it was filled under.
    seq: Box<[AtomicU64]>,
    /// Until when (the near clock's age, ms) no read of the stripe may fill: a write whose
    /// async caller went away may still land until then.
    quiet: Box<[AtomicU64]>,
    /// Bumped before and after each `clear` (and `flush_all`): every copy filled before goes.
    flushes: AtomicU64,
    /// Until when no read may fill anything: a `clear` whose caller went away.
    flush_quiet: AtomicU64,
    hasher: std::hash::RandomState,
}

/// Where a read of one key was sent from: the stripe, the sequences, and when (the near
/// clock's age, ms). A copy is filled from the read only under this ticket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ticket {
    pub(crate) stripe: u32,
    pub(crate) seq: u64,
    pub(crate) flush: u64,
    pub(crate) sent_ms: u64,
}

impl Domain {
    fn new() -> Domain {
        let zeros = || (0..STRIPES).map(|_| AtomicU64::new(0)).collect();
        Domain {
            seq: zeros(),
            quiet: zeros(),
            flushes: AtomicU64::new(0),
            flush_quiet: AtomicU64::new(0),
            hasher: std::hash::RandomState::new(),
        }
    }

    /// The domain of the caches over `servers` in this process (a new one for a cache that
    /// names no server: its store is its own).
    pub(crate) fn of(servers: &[String]) -> Arc<Domain> {
        static DOMAINS: Mutex<Option<HashMap<Vec<String>, Weak<Domain>>>> = Mutex::new(None);
        if servers.is_empty() {
            return Arc::new(Domain::new());
        }
        let mut key = servers.to_vec();
        key.sort();
        let mut domains = DOMAINS.lock();
        let domains = domains.get_or_insert_with(HashMap::new);
        domains.retain(|_, d| d.strong_count() > 0);
        if let Some(d) = domains.get(&key).and_then(Weak::upgrade) {
            return d;
        }
        let d = Arc::new(Domain::new());
        domains.insert(key, Arc::downgrade(&d));
        d
    }

    /// The stripe of derived key `derived`.
    pub(crate) fn stripe(&self, derived: &str) -> u32 {
        let mut h = self.hasher.build_hasher();
        h.write(derived.as_bytes());
        (h.finish() as usize % STRIPES) as u32
    }

    /// A ticket for a read of `derived` about to be sent at `now_ms`, or `None` while a write
    /// to its stripe (or a `clear`) may still be landing: such a read fills nothing.
    pub(crate) fn ticket(&self, derived: &str, now_ms: u64) -> Option<Ticket> {
        let stripe = self.stripe(derived);
        let i = stripe as usize;
        let ticket = Ticket {
            stripe,
            seq: self.seq[i].load(Ordering::SeqCst),
            flush: self.flushes.load(Ordering::SeqCst),
            sent_ms: now_ms,
        };
        let quiet = self.quiet[i]
            .load(Ordering::SeqCst)
            .max(self.flush_quiet.load(Ordering::SeqCst));
        (now_ms >= quiet).then_some(ticket)
    }

    /// Whether nothing was written to the ticket's stripe, and nothing cleared, since it was
    /// taken, but `writes` writes of the ticket holder's own (each bumps its stripe twice).
    pub(crate) fn holds(&self, t: &Ticket, writes: u64) -> bool {
        self.seq[t.stripe as usize].load(Ordering::SeqCst) == t.seq + 2 * writes
            && self.flushes.load(Ordering::SeqCst) == t.flush
    }

    /// A write to `keys` begins: their copies stop being served, and no read sent from now
    /// fills until it ends.
    fn begin<'k>(&self, keys: impl IntoIterator<Item = &'k str>) -> Vec<u32> {
        let mut stripes: Vec<u32> = keys.into_iter().map(|k| self.stripe(k)).collect();
        stripes.sort_unstable();
        stripes.dedup();
        for &s in &stripes {
            self.seq[s as usize].fetch_add(1, Ordering::SeqCst);
        }
        stripes
    }

    /// The write to `stripes` ended (answered, or failed): reads sent from now see it.
    fn end(&self, stripes: &[u32]) {
        for &s in stripes {
            self.seq[s as usize].fetch_add(1, Ordering::SeqCst);
        }
    }

    #[cfg(feature = "tokio")]
    /// The write to `stripes` was abandoned by its caller and may land until `until_ms`: no
    /// read sent before then fills.
    fn abandoned(&self, stripes: &[u32], until_ms: u64) {
        for &s in stripes {
            self.quiet[s as usize].fetch_max(until_ms, Ordering::SeqCst);
            self.seq[s as usize].fetch_add(1, Ordering::SeqCst);
        }
    }

    fn flush_begin(&self) {
        self.flushes.fetch_add(1, Ordering::SeqCst);
    }

    fn flush_end(&self) {
        self.flushes.fetch_add(1, Ordering::SeqCst);
    }

    #[cfg(feature = "tokio")]
    fn flush_abandoned(&self, until_ms: u64) {
        self.flush_quiet.fetch_max(until_ms, Ordering::SeqCst);
        self.flushes.fetch_add(1, Ordering::SeqCst);
    }

    /// Whether a copy filled under `t` may still be served: its stripe and the flush count
    /// are as they were.
    #[inline]
    pub(crate) fn current(&self, stripe: u32, seq: u64, flush: u64) -> bool {
        self.seq[stripe as usize].load(Ordering::Acquire) == seq
            && self.flushes.load(Ordering::Acquire) == flush
    }
}

/// A sync backend whose writes fence the near tier.
#[derive(Debug)]
pub(crate) struct Fenced {
    pub(crate) inner: Arc<dyn Backend>,
    pub(crate) domain: Arc<Domain>,
}

impl Fenced {
    fn around<T>(&self, keys: &[&str], write: impl FnOnce() -> T) -> T {
        let stripes = self.domain.begin(keys.iter().copied());
        let r = write();
        self.domain.end(&stripes);
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
        self.around(&[w.key], || self.inner.store(w))
    }
    fn store_then_get(&self, w: Write<'_>) -> Result<(StoreOutcome, Option<Item>)> {
        self.around(&[w.key], || self.inner.store_then_get(w))
    }
    fn store_many(&self, writes: &[Write<'_>]) -> Vec<Result<StoreOutcome>> {
        let keys: Vec<&str> = writes.iter().map(|w| w.key).collect();
        self.around(&keys, || self.inner.store_many(writes))
    }
    fn delete(&self, key: &str) -> Result<bool> {
        self.around(&[key], || self.inner.delete(key))
    }
    fn delete_many(&self, keys: &[&str]) -> Vec<Result<bool>> {
        self.around(keys, || self.inner.delete_many(keys))
    }
    fn touch(&self, key: &str, exptime: u32) -> Result<bool> {
        self.around(&[key], || self.inner.touch(key, exptime))
    }
    fn incr(&self, key: &str, delta: u64) -> Result<Option<u64>> {
        self.around(&[key], || self.inner.incr(key, delta))
    }
    fn decr(&self, key: &str, delta: u64) -> Result<Option<u64>> {
        self.around(&[key], || self.inner.decr(key, delta))
    }
    fn flush_all(&self) -> Result<()> {
        self.domain.flush_begin();
        let r = self.inner.flush_all();
        self.domain.flush_end();
        r
    }
    fn clear(&self, prefix: Option<&str>) -> Result<()> {
        self.domain.flush_begin();
        let r = self.inner.clear(prefix);
        self.domain.flush_end();
        r
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

    use super::Domain;
    use crate::backend::{AsyncBackend, BoxFuture, Item, StoreOutcome, Write};
    use crate::error::Result;
    use crate::near::clock::NearClock;

    /// An async backend whose writes fence the near tier; a write whose caller goes away
    /// fences its stripes until it may have landed (the backend's settle time).
    #[derive(Debug)]
    pub(crate) struct FencedAsync {
        pub(crate) inner: Arc<dyn AsyncBackend>,
        pub(crate) domain: Arc<Domain>,
        pub(crate) clock: NearClock,
    }

    /// A write in flight: ended when it is answered, abandoned when its future is dropped.
    struct InFlight<'a> {
        fenced: &'a FencedAsync,
        /// The stripes written; `None` for a `clear`.
        stripes: Option<Vec<u32>>,
        done: bool,
    }

    impl InFlight<'_> {
        fn end(mut self) {
            self.done = true;
            match &self.stripes {
                Some(s) => self.fenced.domain.end(s),
                None => self.fenced.domain.flush_end(),
            }
        }
    }

    impl Drop for InFlight<'_> {
        fn drop(&mut self) {
            if self.done {
                return;
            }
            let f = self.fenced;
            let until = f
                .clock
                .age_ms()
                .saturating_add(super::millis(f.inner.settle_time()))
                .saturating_add(f.clock.slack_ms());
            match &self.stripes {
                Some(s) => f.domain.abandoned(s, until),
                None => f.domain.flush_abandoned(until),
            }
        }
    }

    impl FencedAsync {
        /// Runs `write` on `keys` (or, with `None`, a clear), fenced from before the write's
        /// future is made (a backend may send when it makes it) until it is answered; dropped
        /// before, the write may still land, and its stripes stay fenced until it may have.
        fn around<'a, T: Send + 'a>(
            &'a self,
            keys: Option<Vec<&'a str>>,
            write: impl FnOnce() -> BoxFuture<'a, T>,
        ) -> BoxFuture<'a, T> {
            let stripes = match keys {
                Some(keys) => Some(self.domain.begin(keys)),
                None => {
                    self.domain.flush_begin();
                    None
                }
            };
            let flight = InFlight {
                fenced: self,
                stripes,
                done: false,
            };
            let write = write();
            Box::pin(async move {
                let r = write.await;
                flight.end();
                r
            })
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
            self.around(Some(vec![w.key]), || self.inner.store(w))
        }
        fn store_then_get<'a>(
            &'a self,
            w: Write<'a>,
        ) -> BoxFuture<'a, Result<(StoreOutcome, Option<Item>)>> {
            self.around(Some(vec![w.key]), || self.inner.store_then_get(w))
        }
        fn store_many<'a>(
            &'a self,
            writes: &'a [Write<'a>],
        ) -> BoxFuture<'a, Vec<Result<StoreOutcome>>> {
            let keys = writes.iter().map(|w| w.key).collect();
            self.around(Some(keys), || self.inner.store_many(writes))
        }
        fn delete<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<bool>> {
            self.around(Some(vec![key]), || self.inner.delete(key))
        }
        fn delete_many<'a>(&'a self, keys: &'a [&'a str]) -> BoxFuture<'a, Vec<Result<bool>>> {
            self.around(Some(keys.to_vec()), || self.inner.delete_many(keys))
        }
        fn touch<'a>(&'a self, key: &'a str, exptime: u32) -> BoxFuture<'a, Result<bool>> {
            self.around(Some(vec![key]), || self.inner.touch(key, exptime))
        }
        fn incr<'a>(&'a self, key: &'a str, delta: u64) -> BoxFuture<'a, Result<Option<u64>>> {
            self.around(Some(vec![key]), || self.inner.incr(key, delta))
        }
        fn decr<'a>(&'a self, key: &'a str, delta: u64) -> BoxFuture<'a, Result<Option<u64>>> {
            self.around(Some(vec![key]), || self.inner.decr(key, delta))
        }
        fn flush_all(&self) -> BoxFuture<'_, Result<()>> {
            self.around(None, || self.inner.flush_all())
        }
        fn clear<'a>(&'a self, prefix: Option<&'a str>) -> BoxFuture<'a, Result<()>> {
            self.around(None, || self.inner.clear(prefix))
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
        fn settle_time(&self) -> std::time::Duration {
            self.inner.settle_time()
        }
    }
}

/// `d` in whole milliseconds, saturating.
pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
