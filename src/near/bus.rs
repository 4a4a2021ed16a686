//! The bus's protocol without I/O (issue 51's core): what a message is on the wire, and what a
//! receiver does with each one it hears (and with the silence between them). A transport
//! (in-process, Redis pub/sub, sharded pub/sub) only moves these bytes and says when it
//! reconnected; the near tier only does what the receiver's [`Heard`] says.
//!
//! Messages carry derived keys, never values; each names its sender (a cache instance), the
//! sender's epoch (a new one per start) and a sequence number per sender. A receiver that sees
//! a sequence gap, or misses a known sender's heartbeats, cannot tell which keys it missed:
//! it flushes. A new sender, or a known sender's new epoch, flushes nothing (a rolling deploy
//! must not become a read storm); a sender that leaves says so and is forgotten.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::fence::Domain;

/// What a message says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Body {
    /// These derived keys were written: drop their copies.
    Drop(Vec<String>),
    /// `clear`: drop every copy.
    Flush,
    /// Nothing was written; the sender is alive (and its last sequence number is this one).
    Heartbeat,
    /// The sender stops: forget it (its silence is not a loss).
    Leave,
}

/// One message on the bus.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Message {
    /// The sending cache instance.
    pub(crate) sender: u128,
    /// The sender's start: a new epoch restarts its sequence.
    pub(crate) epoch: u64,
    /// 1, 2, ... per sender and epoch; every message, heartbeats included, takes the next.
    pub(crate) seq: u64,
    pub(crate) body: Body,
}

/// The first byte of every message: its format.
const VERSION: u8 = 1;

/// A message that is not one this build reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Malformed(pub(crate) &'static str);

impl Message {
    /// The message's bytes: version, kind, sender (16 bytes), epoch, sequence (8 bytes each,
    /// little-endian), then for `Drop` a count (4 bytes) and each key as a length (2 bytes)
    /// and its bytes.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64);
        out.push(VERSION);
        out.push(match self.body {
            Body::Drop(_) => 1,
            Body::Flush => 2,
            Body::Heartbeat => 3,
            Body::Leave => 4,
        });
        out.extend_from_slice(&self.sender.to_le_bytes());
        out.extend_from_slice(&self.epoch.to_le_bytes());
        out.extend_from_slice(&self.seq.to_le_bytes());
        if let Body::Drop(keys) = &self.body {
            out.extend_from_slice(&(keys.len() as u32).to_le_bytes());
            for k in keys {
                // Derived keys are at most 250 bytes (memcached's rule, checked before any
                // write): a u16 holds every one.
                out.extend_from_slice(&(k.len() as u16).to_le_bytes());
                out.extend_from_slice(k.as_bytes());
            }
        }
        out
    }

    /// Reads a message; anything else (another format, truncated, trailing bytes) is
    /// [`Malformed`], which a receiver treats as a loss.
    pub(crate) fn decode(bytes: &[u8]) -> Result<Message, Malformed> {
        let mut r = Reader(bytes);
        if r.take::<1>()?[0] != VERSION {
            return Err(Malformed("another format"));
        }
        let kind = r.take::<1>()?[0];
        let sender = u128::from_le_bytes(r.take()?);
        let epoch = u64::from_le_bytes(r.take()?);
        let seq = u64::from_le_bytes(r.take()?);
        let body = match kind {
            1 => {
                let n = u32::from_le_bytes(r.take()?) as usize;
                // Each key takes at least its 2-byte length: a count the bytes cannot hold is
                // refused before anything is allocated for it.
                if n > r.0.len() / 2 {
                    return Err(Malformed("more keys than bytes"));
                }
                let mut keys = Vec::with_capacity(n);
                for _ in 0..n {
                    let len = u16::from_le_bytes(r.take()?) as usize;
                    let key = r.bytes(len)?;
                    let key = std::str::from_utf8(key).map_err(|_| Malformed("a key not UTF-8"))?;
                    keys.push(key.to_owned());
                }
                Body::Drop(keys)
            }
            2 => Body::Flush,
            3 => Body::Heartbeat,
            4 => Body::Leave,
            _ => return Err(Malformed("an unknown kind")),
        };
        if !r.0.is_empty() {
            return Err(Malformed("trailing bytes"));
        }
        Ok(Message {
            sender,
            epoch,
            seq,
            body,
        })
    }
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], Malformed> {
        let (head, rest) = self
            .0
            .split_first_chunk::<N>()
            .ok_or(Malformed("truncated"))?;
        self.0 = rest;
        Ok(*head)
    }

    fn bytes(&mut self, n: usize) -> Result<&[u8], Malformed> {
        if self.0.len() < n {
            return Err(Malformed("truncated"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
}

/// A sender's numbering: one per cache instance.
#[derive(Debug)]
pub(crate) struct Sender {
    pub(crate) id: u128,
    pub(crate) epoch: u64,
    seq: u64,
}

impl Sender {
    pub(crate) fn new(id: u128, epoch: u64) -> Sender {
        Sender { id, epoch, seq: 0 }
    }

    /// The next message, saying `body`.
    pub(crate) fn next(&mut self, body: Body) -> Message {
        self.seq += 1;
        Message {
            sender: self.id,
            epoch: self.epoch,
            seq: self.seq,
            body,
        }
    }
}

/// What the near tier does with what the receiver heard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Heard {
    /// Nothing to do (a heartbeat in order, a new sender, a leave).
    Nothing,
    /// The receiver's own message, back: the bus carries what this cache sends.
    Echo,
    /// Drop these keys' copies.
    Drop(Vec<String>),
    /// Drop every copy: a `clear`, or a loss (why).
    Flush(Loss),
}

/// Why a receiver flushes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Loss {
    /// A sender's `clear`.
    Cleared,
    /// A sequence number skipped (a message lost).
    Gap,
    /// A known sender went silent past the heartbeat bound.
    Silent,
    /// The transport reconnected (or its subscriber was cut off): anything may have been
    /// missed meanwhile.
    Reconnected,
    /// A message that did not decode.
    Malformed,
}

/// What a receiver knows of one sender.
#[derive(Debug)]
struct Peer {
    epoch: u64,
    seq: u64,
    heard_ms: u64,
}

/// A cache instance's receiver: per sender, the epoch and the last sequence heard, and when.
#[derive(Debug)]
pub(crate) struct Receiver {
    me: u128,
    peers: HashMap<u128, Peer>,
    /// How long a known sender may stay silent (a few heartbeat intervals) before its silence
    /// is a loss.
    silent_after_ms: u64,
}

impl Receiver {
    pub(crate) fn new(me: u128, silent_after_ms: u64) -> Receiver {
        Receiver {
            me,
            peers: HashMap::new(),
            silent_after_ms,
        }
    }

    /// A message's bytes heard at `now_ms`.
    pub(crate) fn on_bytes(&mut self, now_ms: u64, bytes: &[u8]) -> Heard {
        match Message::decode(bytes) {
            Ok(m) => self.on_message(now_ms, m),
            Err(_) => Heard::Flush(Loss::Malformed),
        }
    }

    /// A message heard at `now_ms`.
    pub(crate) fn on_message(&mut self, now_ms: u64, m: Message) -> Heard {
        if m.sender == self.me {
            return Heard::Echo;
        }
        if m.body == Body::Leave {
            self.peers.remove(&m.sender);
            return Heard::Nothing;
        }
        let gap = match self.peers.get_mut(&m.sender) {
            // A new epoch of a known sender restarts its numbering: no loss (what it wrote
            // before it restarted was announced by its previous epoch).
            Some(p) if p.epoch == m.epoch => {
                let gap = m.seq != p.seq + 1;
                p.seq = p.seq.max(m.seq);
                p.heard_ms = now_ms;
                gap
            }
            _ => {
                let peer = Peer {
                    epoch: m.epoch,
                    seq: m.seq,
                    heard_ms: now_ms,
                };
                self.peers.insert(m.sender, peer);
                false
            }
        };
        match (gap, m.body) {
            (true, _) => Heard::Flush(Loss::Gap),
            (false, Body::Drop(keys)) => Heard::Drop(keys),
            (false, Body::Flush) => Heard::Flush(Loss::Cleared),
            (false, Body::Heartbeat | Body::Leave) => Heard::Nothing,
        }
    }

    /// Time passes: a known sender silent past the bound is a loss (it is forgotten: its next
    /// message starts it over, as a new sender's does).
    pub(crate) fn on_tick(&mut self, now_ms: u64) -> Heard {
        let before = self.peers.len();
        let bound = self.silent_after_ms;
        self.peers
            .retain(|_, p| now_ms.saturating_sub(p.heard_ms) <= bound);
        match self.peers.len() < before {
            true => Heard::Flush(Loss::Silent),
            false => Heard::Nothing,
        }
    }

    /// The transport reconnected: anything may have been missed.
    pub(crate) fn on_reconnect(&mut self) -> Heard {
        self.peers.clear();
        Heard::Flush(Loss::Reconnected)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drop(keys: &[&str]) -> Body {
        Body::Drop(keys.iter().map(|k| k.to_string()).collect())
    }

    #[test]
    fn messages_round_trip_and_bad_bytes_are_refused() {
        let mut s = Sender::new(7, 3);
        for body in [
            drop(&["a", "b-1-c"]),
            drop(&[]),
            Body::Flush,
            Body::Heartbeat,
            Body::Leave,
        ] {
            let m = s.next(body);
            assert_eq!(Message::decode(&m.encode()), Ok(m));
        }
        let bytes = s.next(drop(&["k"])).encode();
        for cut in 0..bytes.len() {
            assert!(Message::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut trailing = bytes.clone();
        trailing.push(0);
        assert!(Message::decode(&trailing).is_err());
        let mut huge = bytes[..34].to_vec();
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            Message::decode(&huge),
            Err(Malformed("more keys than bytes"))
        );
    }

    #[test]
    fn a_receiver_drops_flushes_and_tells_losses() {
        let mut r = Receiver::new(1, 3_000);
        let mut a = Sender::new(2, 1);
        // its own messages are only an echo
        assert_eq!(
            r.on_message(0, Sender::new(1, 9).next(Body::Flush)),
            Heard::Echo
        );
        // a new sender starts anywhere in its numbering: no loss
        a.next(Body::Heartbeat);
        assert_eq!(
            r.on_message(0, a.next(drop(&["k"]))),
            Heard::Drop(vec!["k".into()])
        );
        assert_eq!(r.on_message(1, a.next(Body::Heartbeat)), Heard::Nothing);
        assert_eq!(
            r.on_message(2, a.next(Body::Flush)),
            Heard::Flush(Loss::Cleared)
        );
        // a lost message
        a.next(drop(&["lost"]));
        assert_eq!(
            r.on_message(3, a.next(drop(&["k"]))),
            Heard::Flush(Loss::Gap)
        );
        assert_eq!(
            r.on_message(4, a.next(drop(&["k"]))),
            Heard::Drop(vec!["k".into()])
        );
        // a restart (new epoch) is no loss
        let mut a2 = Sender::new(2, 2);
        assert_eq!(
            r.on_message(5, a2.next(drop(&["j"]))),
            Heard::Drop(vec!["j".into()])
        );
        // silence past the bound is a loss, once
        assert_eq!(r.on_tick(3_005), Heard::Nothing);
        assert_eq!(r.on_tick(3_006), Heard::Flush(Loss::Silent));
        assert_eq!(r.on_tick(9_000), Heard::Nothing);
        // a leaving sender's silence is none
        let mut b = Sender::new(3, 1);
        r.on_message(10_000, b.next(Body::Heartbeat));
        assert_eq!(r.on_message(10_001, b.next(Body::Leave)), Heard::Nothing);
        assert_eq!(r.on_tick(20_000), Heard::Nothing);
        // a reconnect, and bytes that do not decode, flush
        assert_eq!(r.on_reconnect(), Heard::Flush(Loss::Reconnected));
        assert_eq!(r.on_bytes(0, b"\x09"), Heard::Flush(Loss::Malformed));
    }
}

/// What a transport hands its listeners.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum BusEvent<'a> {
    /// A message's bytes.
    Message(&'a [u8]),
    /// The transport lost its subscription (a connection that failed, or a subscriber cut
    /// off by the server): messages are being missed until it says [`Reconnected`].
    ///
    /// [`Reconnected`]: BusEvent::Reconnected
    Disconnected,
    /// The transport subscribed (again): messages sent meanwhile may have been missed.
    Reconnected,
}

/// A listener of a [`BusTransport`]: `false` once its cache is gone (the transport may
/// forget it).
pub type BusListener = Arc<dyn Fn(BusEvent<'_>) -> bool + Send + Sync>;

/// What carries the near tiers' messages between caches ([`CacheBuilder::near_bus`]):
/// [`InProcessBus`] within one process, [`RedisBus`](crate::RedisBus) between processes.
///
/// A transport delivers each message to every listener, its sender's own included (a cache
/// hears its own messages back, and knows from them that the bus carries what it sends). It
/// may lose messages: receivers notice (a gap in a sender's numbering, a silent sender, their
/// own messages not heard back) and flush. It must say when its subscription breaks and when
/// it is back ([`BusEvent::Disconnected`], [`BusEvent::Reconnected`]).
///
/// `publish` is called from the cache's bus thread, never from a caller's thread or a runtime.
///
/// [`CacheBuilder::near_bus`]: crate::CacheBuilder::near_bus
pub trait BusTransport: std::fmt::Debug + Send + Sync {
    /// Sends `message` to every listener. A message it cannot send is dropped (receivers see
    /// the loss).
    fn publish(&self, message: &[u8]);
    /// Adds a listener: every message published from now on (once subscribed) is handed to it.
    fn subscribe(&self, listener: BusListener);
}

/// A bus within one process: every published message is handed to every listener at once, on
/// the publishing thread. For caches of one process that share no store (a store they share
/// is fenced without a bus), and for tests.
#[derive(Default)]
pub struct InProcessBus {
    listeners: parking_lot::Mutex<Vec<BusListener>>,
}

impl std::fmt::Debug for InProcessBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InProcessBus")
            .field("listeners", &self.listeners.lock().len())
            .finish()
    }
}

impl InProcessBus {
    /// A bus with no listener yet.
    pub fn new() -> Arc<InProcessBus> {
        Arc::new(InProcessBus::default())
    }
}

impl BusTransport for InProcessBus {
    fn publish(&self, message: &[u8]) {
        let listeners = self.listeners.lock().clone();
        let mut gone = Vec::new();
        for l in &listeners {
            if !l(BusEvent::Message(message)) {
                gone.push(l.clone());
            }
        }
        if !gone.is_empty() {
            self.listeners
                .lock()
                .retain(|l| !gone.iter().any(|g| Arc::ptr_eq(l, g)));
        }
    }
    fn subscribe(&self, listener: BusListener) {
        self.listeners.lock().push(listener.clone());
        // Subscribed at once: say so, as a transport that connects does.
        listener(BusEvent::Reconnected);
    }
}

/// The most key bytes one message carries: a batch larger than this goes in several.
const MAX_BATCH_BYTES: usize = 32 << 10;

/// The bus's counters of one cache (added into its [`Stats`](crate::Stats)).
#[derive(Debug, Default)]
struct BusCounters {
    sent: AtomicU64,
    received: AtomicU64,
    keys_dropped: AtomicU64,
    gaps: AtomicU64,
    flushes: AtomicU64,
    reconnects: AtomicU64,
    heartbeats_missed: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// What the station's thread has to send.
#[derive(Debug, Default)]
struct Outbox {
    /// Keys written (their writes returned).
    keys: Vec<String>,
    /// A `clear` returned: a flush, which covers every key.
    flush: bool,
    /// Writes whose outcome is unknown (or whose caller went away): announced once they may
    /// have landed.
    later: Vec<(Instant, Option<Vec<String>>)>,
    /// The cache is gone: send what is left, say it leaves, stop.
    leaving: bool,
}

/// The state a station's listener and thread share.
#[derive(Debug)]
struct Shared {
    transport: Arc<dyn BusTransport>,
    outbox: Mutex<Outbox>,
    wake: Condvar,
    receiver: Mutex<Receiver>,
    /// Whether the bus is known to carry this cache's messages (its own come back, and its
    /// subscription has not broken since): the near tier serves hits only then.
    healthy: Arc<AtomicBool>,
    /// When this cache last heard its own message (ms since `origin`).
    echo_ms: AtomicU64,
    /// Whether the transport ever said it subscribed (its first subscription is no reconnect).
    subscribed: AtomicBool,
    /// Whether this cache's near tier may hold copies filled while the bus was not known
    /// healthy (set once `build` stopped waiting for it): the bus's recovery flushes them.
    armed: AtomicBool,
    domain: Weak<Domain>,
    heartbeat: Duration,
    origin: Instant,
    counters: BusCounters,
}

impl Shared {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// How long silence (a peer's, or this cache's own echo) may last: three heartbeats.
    fn silent_after(&self) -> Duration {
        self.heartbeat * 3
    }

    /// Every copy stops being served.
    fn flush(&self) {
        bump(&self.counters.flushes, 1);
        if let Some(domain) = self.domain.upgrade() {
            domain.flushed();
        }
    }

    /// Messages may be missed from now on: flush, and serve no copy until this cache hears
    /// itself again.
    fn lose(&self) {
        self.healthy.store(false, Ordering::SeqCst);
        self.flush();
    }

    fn on_event(&self, event: BusEvent<'_>) {
        let heard = match event {
            BusEvent::Message(bytes) => self.receiver.lock().on_bytes(self.now_ms(), bytes),
            BusEvent::Disconnected => return self.lose(),
            BusEvent::Reconnected => {
                self.receiver.lock().on_reconnect();
                self.wake.notify_one();
                // Its first subscription: nothing was missed, and no copy of this cache's
                // exists to flush (nor should its siblings' be).
                if self.subscribed.swap(true, Ordering::SeqCst) {
                    bump(&self.counters.reconnects, 1);
                    self.lose();
                }
                return;
            }
        };
        match heard {
            Heard::Echo => {
                self.echo_ms.store(self.now_ms(), Ordering::SeqCst);
                if !self.healthy.load(Ordering::SeqCst) {
                    // Whatever was filled while messages may have been missed goes; what is
                    // filled from now on is covered by the messages this cache hears.
                    if self.armed.load(Ordering::SeqCst) {
                        self.flush();
                    }
                    self.healthy.store(true, Ordering::SeqCst);
                }
            }
            Heard::Nothing => bump(&self.counters.received, 1),
            Heard::Drop(keys) => {
                bump(&self.counters.received, 1);
                bump(&self.counters.keys_dropped, keys.len() as u64);
                if let Some(domain) = self.domain.upgrade() {
                    domain.dropped(keys.iter().map(String::as_str));
                }
            }
            Heard::Flush(loss) => {
                if loss != Loss::Malformed {
                    bump(&self.counters.received, 1);
                }
                if loss == Loss::Gap {
                    bump(&self.counters.gaps, 1);
                }
                self.flush();
            }
        }
    }

    /// The station's thread: sends what the outbox holds (batched: every key pending when it
    /// wakes goes in one message), a heartbeat after a heartbeat's silence, and watches for
    /// silent peers and its own missing echo.
    fn run(self: Arc<Shared>, mut sender: Sender) {
        let mut last_sent: Option<Instant> = None;
        let send = |sender: &mut Sender, body: Body, last: &mut Option<Instant>| {
            let bytes = sender.next(body).encode();
            self.transport.publish(&bytes);
            bump(&self.counters.sent, 1);
            *last = Some(Instant::now());
        };
        loop {
            let healthy = self.healthy.load(Ordering::SeqCst);
            // Unhealthy, it says hello often, to hear itself back soon.
            let every = match healthy {
                true => self.heartbeat,
                false => (self.heartbeat / 10).max(Duration::from_millis(10)),
            };
            let tick = Instant::now() + (every / 4).max(Duration::from_millis(2));
            let (keys, flush, leaving) = {
                let mut o = self.outbox.lock();
                loop {
                    let now = Instant::now();
                    let mut due = Vec::new();
                    o.later.retain_mut(|(at, keys)| {
                        let ready = *at <= now;
                        if ready {
                            due.push(keys.take());
                        }
                        !ready
                    });
                    for keys in due {
                        match keys {
                            Some(keys) => o.keys.extend(keys),
                            None => o.flush = true,
                        }
                    }
                    let ready = o.flush || !o.keys.is_empty() || (o.leaving && o.later.is_empty());
                    if ready || now >= tick {
                        break;
                    }
                    let until = o.later.iter().map(|(at, _)| *at).fold(tick, Instant::min);
                    self.wake.wait_until(&mut o, until);
                }
                let leaving = o.leaving && o.later.is_empty();
                (
                    std::mem::take(&mut o.keys),
                    std::mem::take(&mut o.flush),
                    leaving,
                )
            };
            if flush {
                send(&mut sender, Body::Flush, &mut last_sent);
            } else if !keys.is_empty() {
                let mut batch = Vec::new();
                let mut bytes = 0;
                for k in keys {
                    bytes += k.len() + 2;
                    batch.push(k);
                    if bytes >= MAX_BATCH_BYTES {
                        send(
                            &mut sender,
                            Body::Drop(std::mem::take(&mut batch)),
                            &mut last_sent,
                        );
                        bytes = 0;
                    }
                }
                if !batch.is_empty() {
                    send(&mut sender, Body::Drop(batch), &mut last_sent);
                }
            }
            if leaving {
                send(&mut sender, Body::Leave, &mut last_sent);
                return;
            }
            if last_sent.is_none_or(|at| at.elapsed() >= every) {
                send(&mut sender, Body::Heartbeat, &mut last_sent);
            }
            let now_ms = self.now_ms();
            if let Heard::Flush(_) = self.receiver.lock().on_tick(now_ms) {
                bump(&self.counters.heartbeats_missed, 1);
                self.flush();
            }
            let silent_ms = u64::try_from(self.silent_after().as_millis()).unwrap_or(u64::MAX);
            let echo = self.echo_ms.load(Ordering::SeqCst);
            if self.healthy.load(Ordering::SeqCst) && now_ms.saturating_sub(echo) > silent_ms {
                // Its own messages stopped coming back: a paused bus, a broken publisher or
                // a subscription that broke without a word.
                bump(&self.counters.heartbeats_missed, 1);
                self.lose();
            }
        }
    }
}

/// One cache instance on a bus: announces its writes (after they land) from a thread of its
/// own, and applies what it hears to its domain's stripes (a dropped key's stripe bumped, a
/// flush's count bumped). Dropped with its cache: the thread sends what is left, says the
/// cache leaves, and ends.
#[derive(Debug)]
pub(crate) struct Station {
    shared: Arc<Shared>,
}

impl Station {
    /// Joins `transport` as a new cache instance whose copies live in `domain`, sending a
    /// heartbeat after each `heartbeat` of silence.
    pub(crate) fn join(
        transport: Arc<dyn BusTransport>,
        domain: &Arc<Domain>,
        heartbeat: Duration,
    ) -> Station {
        let id = (u128::from(crate::rng::entropy()) << 64) | u128::from(crate::rng::entropy());
        let epoch = crate::rng::entropy();
        let silent_after_ms = u64::try_from((heartbeat * 3).as_millis()).unwrap_or(u64::MAX);
        let shared = Arc::new(Shared {
            transport: transport.clone(),
            outbox: Mutex::default(),
            wake: Condvar::new(),
            receiver: Mutex::new(Receiver::new(id, silent_after_ms)),
            healthy: Arc::new(AtomicBool::new(false)),
            echo_ms: AtomicU64::new(0),
            subscribed: AtomicBool::new(false),
            armed: AtomicBool::new(false),
            domain: Arc::downgrade(domain),
            heartbeat,
            origin: Instant::now(),
            counters: BusCounters::default(),
        });
        let weak = Arc::downgrade(&shared);
        transport.subscribe(Arc::new(move |event| match weak.upgrade() {
            Some(shared) => {
                shared.on_event(event);
                true
            }
            None => false,
        }));
        let runner = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("newcache-bus".into())
            .spawn(move || runner.run(Sender::new(id, epoch)));
        if let Err(e) = spawned {
            tracing::warn!(
                "newcache: the bus thread did not start ({e}); the near tier serves no hits"
            );
        }
        Station { shared }
    }

    /// Whether the bus is known to carry this cache's messages: its near tier serves hits
    /// only while this holds.
    pub(crate) fn healthy(&self) -> Arc<AtomicBool> {
        self.shared.healthy.clone()
    }

    /// Waits up to `timeout` until the bus is known healthy, before the cache's near tier
    /// exists; from then on, a recovery of the bus flushes it.
    pub(crate) fn wait_healthy(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let healthy = loop {
            if self.shared.healthy.load(Ordering::SeqCst) {
                break true;
            }
            if Instant::now() >= deadline {
                break false;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        self.shared.armed.store(true, Ordering::SeqCst);
        healthy
    }

    /// Announces that `keys` were written: now, or, for writes that may still land
    /// (`settle`), once they may have.
    pub(crate) fn announce(&self, keys: &[&str], settle: Option<Duration>) {
        if !keys.is_empty() {
            self.announce_owned(keys.iter().map(|k| k.to_string()).collect(), settle);
        }
    }

    /// As [`announce`](Station::announce), keys owned.
    pub(crate) fn announce_owned(&self, keys: Vec<String>, settle: Option<Duration>) {
        if keys.is_empty() {
            return;
        }
        let mut o = self.shared.outbox.lock();
        match settle {
            None => o.keys.extend(keys),
            Some(d) => o.later.push((Instant::now() + d, Some(keys))),
        }
        drop(o);
        self.shared.wake.notify_one();
    }

    /// Announces a `clear` (that may still land, with `settle`).
    pub(crate) fn announce_flush(&self, settle: Option<Duration>) {
        let mut o = self.shared.outbox.lock();
        match settle {
            None => o.flush = true,
            Some(d) => o.later.push((Instant::now() + d, None)),
        }
        drop(o);
        self.shared.wake.notify_one();
    }

    /// Adds the bus's counters to `stats`.
    pub(crate) fn report(&self, stats: &mut crate::Stats) {
        let c = &self.shared.counters;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        stats.bus_sent += load(&c.sent);
        stats.bus_received += load(&c.received);
        stats.bus_keys_dropped += load(&c.keys_dropped);
        stats.bus_gaps += load(&c.gaps);
        stats.bus_flushes += load(&c.flushes);
        stats.bus_reconnects += load(&c.reconnects);
        stats.bus_heartbeats_missed += load(&c.heartbeats_missed);
    }
}

impl Drop for Station {
    fn drop(&mut self) {
        self.shared.outbox.lock().leaving = true;
        self.shared.wake.notify_one();
    }
}
