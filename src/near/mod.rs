//! The near tier: copies of hot values in this process's memory, keyed by the caller's own key,
//! served without I/O, without deriving the key, and without a lock shared by every reader. It
//! answers hits only: whatever is not a current, fresh, young copy goes the whole way (the herd
//! protocol, `Cache::drive_on`) to the shared store, which stays the one truth.
//!
//! A copy is filled only from a shared read (or a load's fenced store that was stored), under a
//! [`Ticket`] taken before the read was sent, and served only while its stripe holds the ticket's
//! sequence ([`fence`]): a write of this process bumps its key's stripe before and after, so a
//! copy is never served after a write to its key returned, and a read sent before a write
//! ended never fills.

pub(crate) mod bus;
pub(crate) mod clock;
pub(crate) mod fence;

use std::any::{Any, TypeId};
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use quick_cache::sync::Cache as Copies;
use quick_cache::{Equivalent, Lifecycle, Weighter};

use self::clock::NearClock;
use self::fence::{Domain, Ticket, millis};
use crate::envelope::{Header, Kind};
use crate::stats::Counters;

/// The near ttl when the builder names none.
pub(crate) const DEFAULT_NEAR_TTL: Duration = Duration::from_secs(5);

/// What a copy costs beyond its bytes and its decoded value: the entry, the `Arc`, the key's
/// allocation headers.
const COPY_OVERHEAD: u64 = 160;

/// The largest share of the capacity one copy may take: a larger value stays shared-only.
const MAX_COPY_SHARE: u64 = 16;

/// The near tier's settings, as the builder validated them.
#[derive(Debug, Clone)]
pub(crate) struct NearSettings {
    /// The most bytes its copies may hold (their bytes, decoded values and overhead).
    pub(crate) capacity: u64,
    /// How long after the read that filled it a copy is served.
    pub(crate) ttl: Duration,
}

/// A copy's key: the cache version and the caller's key (one near tier per cache instance,
/// whose views differ only by version).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NearKey {
    version: u64,
    key: Box<str>,
}

impl Hash for NearKey {
    fn hash<H: Hasher>(&self, h: &mut H) {
        Probe(self.version, &self.key).hash(h)
    }
}

/// A lookup's key, borrowed.
#[derive(Hash)]
struct Probe<'a>(u64, &'a str);

impl Equivalent<NearKey> for Probe<'_> {
    fn equivalent(&self, k: &NearKey) -> bool {
        self.0 == k.version && self.1 == &*k.key
    }
}

/// A decoded value a copy keeps for `get_arc`: its type, and what decoding it allocated.
type Decoded = (TypeId, Arc<dyn Any + Send + Sync>);

/// One value held near: its payload (its own buffer, never a slice of a batch's reply), its
/// envelope, where it was filled from, and the value decoded for the first `get_arc` type
/// (charged in its weight).
pub(crate) struct Copy {
    pub(crate) payload: Bytes,
    pub(crate) header: Header,
    ticket: Ticket,
    weight: u64,
    decoded: Option<Decoded>,
}

impl std::fmt::Debug for Copy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Copy")
            .field("bytes", &self.payload.len())
            .field("ticket", &self.ticket)
            .finish_non_exhaustive()
    }
}

impl Copy {
    /// The value decoded as a `T`, if a `T` was kept.
    #[inline]
    pub(crate) fn decoded<T: Send + Sync + 'static>(&self) -> Option<Arc<T>> {
        let (id, v) = self.decoded.as_ref()?;
        if *id != TypeId::of::<T>() {
            return None;
        }
        v.clone().downcast::<T>().ok()
    }

    /// Whether a decoded value is kept (of whichever type).
    pub(crate) fn keeps_decoded(&self) -> bool {
        self.decoded.is_some()
    }
}

#[derive(Clone)]
struct Weigh;

impl Weighter<NearKey, Arc<Copy>> for Weigh {
    fn weight(&self, _: &NearKey, c: &Arc<Copy>) -> u64 {
        c.weight
    }
}

/// Counts evictions in the cache's counters: not the copy an insert replaces (quick_cache
/// reports it as evicted), which the insert names in its request state.
#[derive(Clone)]
struct Evictions(Arc<Counters>);

/// The key an insert writes, if any.
#[derive(Default)]
struct Inserting(Option<NearKey>);

impl Lifecycle<NearKey, Arc<Copy>> for Evictions {
    type RequestState = Inserting;
    fn on_evict(&self, inserting: &mut Inserting, key: NearKey, _: Arc<Copy>) {
        if inserting.0.as_ref() != Some(&key) {
            Counters::bump(&self.0.near_evictions);
        }
    }
}

/// A cache instance's near tier.
pub(crate) struct Near {
    copies: Copies<NearKey, Arc<Copy>, Weigh, hashbrown::DefaultHashBuilder, Evictions>,
    pub(crate) domain: Arc<Domain>,
    pub(crate) clock: NearClock,
    ttl_ms: u64,
    max_copy: u64,
    /// With early refresh (XFetch) on: how far before its soft expiry, in units of its load
    /// time, a copy stops being served, so that reads reach the shared store while XFetch
    /// may still refresh it (past 10 x beta load times, a draw refreshes with probability
    /// e^-10).
    early: Option<f64>,
    /// Whether serving copies past the near ttl in an outage was logged yet (once).
    outage_logged: AtomicBool,
    /// With a bus: whether it carries this cache's messages, and since which possible loss
    /// (copies are served as hits only while it does, and only if filled since).
    bus: Option<Arc<bus::Gate>>,
}

impl std::fmt::Debug for Near {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Near")
            .field("capacity", &self.copies.capacity())
            .field("ttl_ms", &self.ttl_ms)
            .finish_non_exhaustive()
    }
}

impl Near {
    pub(crate) fn new(
        s: &NearSettings,
        domain: Arc<Domain>,
        clock: NearClock,
        counters: Arc<Counters>,
        early_beta: Option<f64>,
        bus: Option<Arc<bus::Gate>>,
    ) -> Near {
        let estimated = usize::try_from(s.capacity / 1024)
            .unwrap_or(usize::MAX)
            .max(64);
        let mut near = Near {
            copies: Copies::with(
                estimated,
                s.capacity,
                Weigh,
                hashbrown::DefaultHashBuilder::default(),
                Evictions(counters),
            ),
            domain,
            clock,
            ttl_ms: millis(s.ttl),
            max_copy: 0,
            early: early_beta.map(|beta| beta * 10.0),
            outage_logged: AtomicBool::new(false),
            bus,
        };
        // A sixteenth of the capacity, and never more than one shard of the copies admits
        // (their shards are per core: many cores, small shards).
        near.max_copy = (s.capacity / MAX_COPY_SHARE).min(near.copies.shard_capacity() * 9 / 10);
        near
    }

    /// The copy of `key` (cache version `version`) if nothing was written to it since it was
    /// filled, fresh or not.
    #[inline]
    pub(crate) fn current(&self, version: u64, key: &str) -> Option<Arc<Copy>> {
        let c = self.copies.get(&Probe(version, key))?;
        let t = &c.ticket;
        self.domain.current(t.stripe, t.seq, t.flush).then_some(c)
    }

    /// Whether `c` is served as a hit: fresh by its envelope (and, with early refresh, not
    /// within its window), and younger than the near ttl.
    #[inline]
    pub(crate) fn serves(&self, c: &Copy) -> bool {
        if let Some(bus) = &self.bus {
            if !bus.serves(c.ticket.bus) {
                return false;
            }
        }
        let slack = self.clock.slack_ms();
        let young = self.clock.age_ms() + slack < c.ticket.sent_ms.saturating_add(self.ttl_ms);
        let ahead = match self.early {
            None => slack,
            Some(window) => slack + (f64::from(c.header.load_ms) * window) as u64,
        };
        young && fresh(&c.header, self.clock.wall_ms() + ahead)
    }

    /// Whether `c` may be served while the shared store does not answer: within its
    /// envelope's staleness bound (soft expiry plus herd timeout), however old the copy.
    pub(crate) fn serves_in_outage(&self, c: &Copy) -> bool {
        let h = &c.header;
        h.kind == Kind::Value
            && (h.soft_expiry_ms == 0
                || self.clock.wall_ms() + self.clock.slack_ms()
                    < h.soft_expiry_ms.saturating_add(u64::from(h.herd_ms)))
    }

    /// Logs, once, that the near tier serves copies past their ttl in an outage.
    pub(crate) fn outage_served(&self) {
        if !self.outage_logged.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "newcache: the shared store does not answer; near copies are served past the \
                 near ttl, within their staleness bound (counted in Stats::near_outage_served; \
                 logged once)"
            );
        }
    }

    /// A ticket for a read of derived key `derived` about to be sent, or `None` while a write
    /// of this process to its stripe may still land (that read fills nothing).
    pub(crate) fn ticket(&self, derived: &str) -> Option<Ticket> {
        let bus = self.bus.as_ref().map_or(0, |b| b.generation());
        let t = self.domain.ticket(derived, self.clock.age_ms())?;
        Some(Ticket { bus, ..t })
    }

    /// Fills the copy of `key` (cache version `version`) from a read sent under `fill.ticket`
    /// (after `fill.writes` writes of the filler's own to the key, each of which bumped its
    /// stripe twice) that found `fill.payload` under `fill.header`, keeping `decoded` (and its
    /// charge) if given. Refused (and counted) when something was written to the stripe
    /// since, or when it is too large; nothing is kept for a value that is not fresh.
    pub(crate) fn fill(
        &self,
        version: u64,
        key: &str,
        fill: Fill<'_>,
        decoded: Option<(Decoded, usize)>,
        counters: &Counters,
    ) -> Option<Arc<Copy>> {
        if !fresh(&fill.header, self.clock.wall_ms() + self.clock.slack_ms()) {
            return None;
        }
        if !self.domain.holds(&fill.ticket, fill.writes) {
            Counters::bump(&counters.near_refused);
            return None;
        }
        let ticket = Ticket {
            seq: fill.ticket.seq + 2 * fill.writes,
            ..fill.ticket
        };
        let payload = Bytes::copy_from_slice(fill.payload);
        self.insert(
            version,
            key,
            payload,
            fill.header,
            ticket,
            decoded,
            counters,
        )
    }

    /// Keeps `decoded` (the payload of `copy`, the copy of `key`, decoded; `charge`: what it
    /// allocated) in a copy charged for it, in place of `copy`. Not kept if the copy would be
    /// too large (each read then decodes).
    pub(crate) fn keep(
        &self,
        version: u64,
        key: &str,
        copy: &Copy,
        decoded: Decoded,
        charge: usize,
        counters: &Counters,
    ) {
        let payload = copy.payload.clone();
        let d = Some((decoded, charge));
        if self.weight(key, &payload, charge) <= self.max_copy {
            self.insert(version, key, payload, copy.header, copy.ticket, d, counters);
        }
    }

    /// What a copy of `key` holding `payload` and a decoded value of `charge` bytes weighs.
    fn weight(&self, key: &str, payload: &[u8], charge: usize) -> u64 {
        (payload.len() + charge + key.len()) as u64 + COPY_OVERHEAD
    }

    // The copy's parts, each needed; bundling them would only rename them.
    #[allow(clippy::too_many_arguments)]
    fn insert(
        &self,
        version: u64,
        key: &str,
        payload: Bytes,
        header: Header,
        ticket: Ticket,
        decoded: Option<(Decoded, usize)>,
        counters: &Counters,
    ) -> Option<Arc<Copy>> {
        let charge = decoded.as_ref().map_or(0, |(_, c)| *c);
        let weight = self.weight(key, &payload, charge);
        if weight > self.max_copy {
            Counters::bump(&counters.near_refused);
            return None;
        }
        let copy = Arc::new(Copy {
            payload,
            header,
            ticket,
            weight,
            decoded: decoded.map(|(d, _)| d),
        });
        let k = NearKey {
            version,
            key: key.into(),
        };
        let mut inserting = Inserting(Some(k.clone()));
        self.copies
            .insert_with_lifecycle(k, copy.clone(), &mut inserting);
        Some(copy)
    }

    /// Drops every copy (their memory too: a flush makes them unservable already).
    pub(crate) fn clear(&self) {
        self.copies.clear();
    }
}

/// What a fill is made of.
pub(crate) struct Fill<'a> {
    pub(crate) ticket: Ticket,
    /// Writes of the filler's own to the key since the ticket (a load's store: 1).
    pub(crate) writes: u64,
    pub(crate) header: Header,
    pub(crate) payload: &'a [u8],
}

/// Whether a value under `h` is fresh at `now_ms`. A value written without herd protection is
/// never held near: its envelope does not say when it expires.
fn fresh(h: &Header, now_ms: u64) -> bool {
    !h.not_storable && h.kind == Kind::Value && (h.soft_expiry_ms == 0 || now_ms < h.soft_expiry_ms)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::clock::NearClock;
    use super::fence::Domain;
    use super::{Fill, Near, NearSettings};
    use crate::clock::Clock;
    use crate::envelope::Header;
    use crate::stats::Counters;
    use crate::testing::MockClock;

    fn near(clock: &Arc<MockClock>, capacity: u64) -> (Near, Arc<Counters>) {
        let counters = Arc::new(Counters::new("t", &[]));
        let settings = NearSettings {
            capacity,
            ttl: Duration::from_secs(5),
        };
        let clock = NearClock::new(Some(clock.clone()));
        let backend: Arc<dyn crate::backend::Backend> =
            Arc::new(crate::backend::memory::MemoryBackend::new(
                1 << 20,
                Arc::new(crate::clock::SystemClock),
            ));
        let near = Near::new(
            &settings,
            Domain::of(&[], &backend),
            clock,
            counters.clone(),
            None,
            None,
        );
        (near, counters)
    }

    fn fill<'a>(n: &Near, derived: &str, header: Header, payload: &'a [u8]) -> Fill<'a> {
        Fill {
            ticket: n.ticket(derived).expect("no write in flight"),
            writes: 0,
            header,
            payload,
        }
    }

    #[test]
    fn a_copy_is_served_while_fresh_and_young_and_no_longer() {
        let clock = MockClock::new();
        let (n, c) = near(&clock, 1 << 20);
        let now = clock.now_ms();
        // fresh for 10 s, near ttl 5 s: the near ttl ends it
        let f = fill(&n, "d", Header::value(now + 10_000, now, 1, 60_000), b"v");
        n.fill(1, "k", f, None, &c).unwrap();
        let copy = n.current(1, "k").unwrap();
        assert!(n.serves(&copy));
        assert!(n.current(2, "k").is_none(), "another version's key");
        clock.advance(Duration::from_millis(4_999));
        assert!(n.serves(&copy));
        clock.advance(Duration::from_millis(1));
        assert!(!n.serves(&copy), "as old as the near ttl");
        assert!(
            n.serves_in_outage(&copy),
            "within soft expiry + herd timeout"
        );
        // fresh for 2 s: the soft expiry ends it, and the staleness bound its outage serve
        let now = clock.now_ms();
        let f = fill(&n, "d2", Header::value(now + 2_000, now, 1, 1_000), b"v");
        n.fill(1, "k2", f, None, &c).unwrap();
        let copy = n.current(1, "k2").unwrap();
        clock.advance(Duration::from_millis(1_999));
        assert!(n.serves(&copy));
        clock.advance(Duration::from_millis(1));
        assert!(!n.serves(&copy), "stale");
        assert!(n.serves_in_outage(&copy));
        clock.advance(Duration::from_millis(1_000));
        assert!(
            !n.serves_in_outage(&copy),
            "past soft expiry + herd timeout"
        );
    }

    #[test]
    fn a_write_begun_after_the_ticket_refuses_the_fill_and_ends_the_copy() {
        let clock = MockClock::new();
        let (n, c) = near(&clock, 1 << 20);
        let now = clock.now_ms();
        let h = Header::value(now + 10_000, now, 1, 60_000);
        let f = fill(&n, "d", h, b"v");
        let fenced = super::fence::Fenced {
            inner: Arc::new(crate::backend::memory::MemoryBackend::new(
                1 << 20,
                clock.clone(),
            )),
            fence: Arc::new(super::fence::Fence {
                domain: n.domain.clone(),
                settle: Duration::ZERO,
                station: None,
            }),
        };
        use crate::backend::Backend;
        fenced.delete("d").unwrap();
        assert!(
            n.fill(1, "k", f, None, &c).is_none(),
            "read sent before the delete ended"
        );
        assert_eq!(c.snapshot().near_refused, 1);
        n.fill(1, "k", fill(&n, "d", h, b"v"), None, &c).unwrap();
        assert!(n.current(1, "k").is_some());
        fenced.delete("d").unwrap();
        assert!(n.current(1, "k").is_none(), "a write ends the copy");
    }

    #[test]
    fn a_load_fills_only_if_its_own_store_was_the_only_write() {
        let clock = MockClock::new();
        let (n, c) = near(&clock, 1 << 20);
        let fenced = super::fence::Fenced {
            inner: Arc::new(crate::backend::memory::MemoryBackend::new(
                1 << 20,
                clock.clone(),
            )),
            fence: Arc::new(super::fence::Fence {
                domain: n.domain.clone(),
                settle: Duration::ZERO,
                station: None,
            }),
        };
        use crate::backend::Backend;
        let now = clock.now_ms();
        let h = Header::value(now + 10_000, now, 1, 60_000);
        let store = || {
            let w = crate::backend::Write::new(crate::backend::StoreMode::Set, "d", b"x", 0, 0);
            fenced.store(w).unwrap();
        };
        let t = n.ticket("d").unwrap();
        store();
        let own = Fill {
            ticket: t,
            writes: 1,
            header: h,
            payload: b"v",
        };
        assert!(
            n.fill(1, "k", own, None, &c).is_some(),
            "its own store only"
        );
        assert!(n.current(1, "k").is_some());
        let t = n.ticket("d").unwrap();
        store();
        store();
        let raced = Fill {
            ticket: t,
            writes: 1,
            header: h,
            payload: b"v",
        };
        assert!(
            n.fill(1, "k", raced, None, &c).is_none(),
            "another write landed too"
        );
    }

    #[test]
    fn copies_are_bounded_by_their_weight() {
        let clock = MockClock::new();
        let (n, c) = near(&clock, 256 << 10);
        let now = clock.now_ms();
        let h = Header::value(now + 10_000, now, 1, 60_000);
        let big = vec![7u8; (256 << 10) / 16];
        let f = fill(&n, "big", h, &big);
        assert!(
            n.fill(1, "big", f, None, &c).is_none(),
            "over a sixteenth of the capacity"
        );
        let small = vec![7u8; 1000];
        for i in 0..1000 {
            let k = format!("k{i}");
            let f = fill(&n, &k, h, &small);
            n.fill(1, &k, f, None, &c);
        }
        assert!(n.copies.weight() <= 256 << 10, "{}", n.copies.weight());
        let s = c.snapshot();
        assert!(s.near_evictions > 0 && s.near_refused == 1, "{s:?}");
    }

    #[test]
    fn a_write_that_may_still_land_keeps_its_stripe_from_filling() {
        let clock = MockClock::new();
        let (n, _) = near(&clock, 1 << 20);
        let fenced = super::fence::Fenced {
            inner: Arc::new(crate::backend::memory::MemoryBackend::new(
                1 << 20,
                clock.clone(),
            )),
            fence: Arc::new(super::fence::Fence {
                domain: n.domain.clone(),
                settle: Duration::from_secs(3600),
                station: None,
            }),
        };
        use crate::backend::Backend;
        fenced.delete("d").unwrap();
        assert!(n.ticket("d").is_some(), "a write answered settles at once");
        assert!(
            n.domain
                .settle_unknown_for_tests("d", Duration::from_secs(3600))
        );
        assert!(n.ticket("d").is_none(), "no fill while it may land");
    }

    #[test]
    fn a_value_that_never_expires_is_served_in_an_outage() {
        let clock = MockClock::new();
        let (n, c) = near(&clock, 1 << 20);
        let now = clock.now_ms();
        let f = fill(&n, "d", Header::value(0, now, 1, 60_000), b"v");
        let copy = n.fill(1, "k", f, None, &c).unwrap();
        clock.advance(Duration::from_secs(3600));
        assert!(!n.serves(&copy), "older than the near ttl");
        assert!(n.serves_in_outage(&copy), "no staleness bound to pass");
    }

    #[test]
    fn a_refill_is_not_an_eviction() {
        let clock = MockClock::new();
        let (n, c) = near(&clock, 1 << 20);
        let now = clock.now_ms();
        let h = Header::value(now + 10_000, now, 1, 60_000);
        for _ in 0..3 {
            n.fill(1, "k", fill(&n, "d", h, b"v"), None, &c).unwrap();
        }
        assert_eq!(c.snapshot().near_evictions, 0);
    }

    #[test]
    fn a_kept_decoded_value_is_charged() {
        let clock = MockClock::new();
        let (n, c) = near(&clock, 1 << 20);
        let now = clock.now_ms();
        let h = Header::value(now + 10_000, now, 1, 60_000);
        let copy = n.fill(1, "k", fill(&n, "d", h, b"v"), None, &c).unwrap();
        let before = n.copies.weight();
        let decoded: super::Decoded = (std::any::TypeId::of::<u8>(), Arc::new(7u8));
        n.keep(1, "k", &copy, decoded, 10_000, &c);
        assert_eq!(n.copies.weight(), before + 10_000);
        let kept = n.current(1, "k").unwrap();
        assert_eq!(kept.decoded::<u8>().as_deref(), Some(&7));
        assert!(
            kept.decoded::<u16>().is_none(),
            "another type decodes on each read"
        );
    }

    #[test]
    fn caches_over_one_store_share_a_domain() {
        let a: Arc<dyn crate::backend::Backend> =
            Arc::new(crate::backend::memory::MemoryBackend::new(
                1 << 20,
                Arc::new(crate::clock::SystemClock),
            ));
        let b: Arc<dyn crate::backend::Backend> =
            Arc::new(crate::backend::memory::MemoryBackend::new(
                1 << 20,
                Arc::new(crate::clock::SystemClock),
            ));
        assert!(Arc::ptr_eq(&Domain::of(&[], &a), &Domain::of(&[], &a)));
        assert!(!Arc::ptr_eq(&Domain::of(&[], &a), &Domain::of(&[], &b)));
        let servers = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let one = Domain::of(&servers(&["h:1", "h:2"]), &a);
        assert!(Arc::ptr_eq(
            &one,
            &Domain::of(&servers(&["h:2", "h:1"]), &b)
        ));
        assert!(!Arc::ptr_eq(&one, &Domain::of(&servers(&["h:1"]), &a)));
    }
}
