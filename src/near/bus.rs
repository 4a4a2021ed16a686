//! The bus: what a message is on the wire, what a receiver does with each one it hears (and
//! with the silence between them), without I/O; the [`BusTransport`] trait and
//! [`InProcessBus`]; and a cache's [`Station`], which sends and hears.
//!
//! Messages carry derived keys, never values; each names its sender (a cache instance), the
//! sender's epoch, a sequence number per sender, the sender's heartbeat interval, and the
//! sequence number of its last announcement (a `Drop` or a `Flush`) before it. A receiver
//! keeps what it knows of each sender across its own reconnects and the sender's silences, so
//! that an announcement it missed is seen at the sender's next message (a heartbeat at the
//! latest), a leave included; a lost heartbeat is no loss. A receiver that sees a loss cannot
//! tell which keys it missed: its near tier stops serving every copy filled before. A new
//! sender flushes nothing (a rolling deploy must not become a read storm); a sender that
//! leaves says so.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::fence::{Domain, millis};
use crate::stats::Counters;

/// What a message says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Body {
    /// These derived keys were written: drop their copies.
    Drop(Vec<String>),
    /// `clear`: drop every copy.
    Flush,
    /// Nothing was written; the sender is alive.
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
    /// The longest the sender stays silent (ms): it sends a heartbeat after this long without
    /// another message.
    pub(crate) heartbeat_ms: u32,
    /// The sequence number of the sender's last announcement (a `Drop` or a `Flush`) before
    /// this message, 0 for none: a receiver that did not hear it missed an announcement (a
    /// lost heartbeat is no loss).
    pub(crate) prev_announce: u64,
    pub(crate) body: Body,
}

/// The first bytes of every message: what tells newcache's messages from anything else
/// published on the channel, then the format.
const MAGIC: [u8; 3] = *b"ncb";
const VERSION: u8 = 1;

/// A message that is not one this build reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Unread {
    /// Not newcache's (no marker): someone else's message on the channel.
    Foreign,
    /// newcache's, but not readable here (another format, truncated, inconsistent).
    Malformed(&'static str),
}

impl Message {
    /// The message's bytes: the marker and format, the kind, the sender (16 bytes), epoch,
    /// sequence (8 bytes each), heartbeat (4 bytes), the last announcement's sequence (8
    /// bytes), all little-endian; then for `Drop` a count (4 bytes) and each key as a length
    /// (2 bytes) and its bytes.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64);
        out.extend_from_slice(&MAGIC);
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
        out.extend_from_slice(&self.heartbeat_ms.to_le_bytes());
        out.extend_from_slice(&self.prev_announce.to_le_bytes());
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

    /// Reads a message: [`Unread::Foreign`] for bytes without the marker, and
    /// [`Unread::Malformed`] for anything else this build cannot read (another format,
    /// truncated, trailing bytes), which a receiver treats as a loss.
    pub(crate) fn decode(bytes: &[u8]) -> Result<Message, Unread> {
        let mut r = Reader(bytes);
        if r.take::<3>().ok() != Some(MAGIC) {
            return Err(Unread::Foreign);
        }
        if r.take::<1>()?[0] != VERSION {
            return Err(Unread::Malformed("another format"));
        }
        let kind = r.take::<1>()?[0];
        let sender = u128::from_le_bytes(r.take()?);
        let epoch = u64::from_le_bytes(r.take()?);
        let seq = u64::from_le_bytes(r.take()?);
        let heartbeat_ms = u32::from_le_bytes(r.take()?);
        let prev_announce = u64::from_le_bytes(r.take()?);
        let body = match kind {
            1 => {
                let n = u32::from_le_bytes(r.take()?) as usize;
                // Each key takes at least its 2-byte length: a count the bytes cannot hold is
                // refused before anything is allocated for it.
                if n > r.0.len() / 2 {
                    return Err(Unread::Malformed("more keys than bytes"));
                }
                let mut keys = Vec::with_capacity(n.min(1024));
                for _ in 0..n {
                    let len = u16::from_le_bytes(r.take()?) as usize;
                    let key = r.bytes(len)?;
                    let key = std::str::from_utf8(key)
                        .map_err(|_| Unread::Malformed("a key not UTF-8"))?;
                    keys.push(key.to_owned());
                }
                Body::Drop(keys)
            }
            2 => Body::Flush,
            3 => Body::Heartbeat,
            4 => Body::Leave,
            _ => return Err(Unread::Malformed("an unknown kind")),
        };
        if !r.0.is_empty() {
            return Err(Unread::Malformed("trailing bytes"));
        }
        Ok(Message {
            sender,
            epoch,
            seq,
            heartbeat_ms,
            prev_announce,
            body,
        })
    }
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], Unread> {
        let (head, rest) = self
            .0
            .split_first_chunk::<N>()
            .ok_or(Unread::Malformed("truncated"))?;
        self.0 = rest;
        Ok(*head)
    }

    fn bytes(&mut self, n: usize) -> Result<&[u8], Unread> {
        if self.0.len() < n {
            return Err(Unread::Malformed("truncated"));
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
    heartbeat_ms: u32,
    seq: u64,
    /// The last announcement's sequence number (0: none yet).
    announced: u64,
}

impl Sender {
    pub(crate) fn new(id: u128, epoch: u64, heartbeat: Duration) -> Sender {
        let heartbeat_ms = u32::try_from(heartbeat.as_millis()).unwrap_or(u32::MAX);
        Sender {
            id,
            epoch,
            heartbeat_ms,
            seq: 0,
            announced: 0,
        }
    }

    /// The next message, saying `body`.
    pub(crate) fn next(&mut self, body: Body) -> Message {
        self.seq += 1;
        let prev_announce = self.announced;
        if matches!(body, Body::Drop(_) | Body::Flush) {
            self.announced = self.seq;
        }
        Message {
            sender: self.id,
            epoch: self.epoch,
            seq: self.seq,
            heartbeat_ms: self.heartbeat_ms,
            prev_announce,
            body,
        }
    }

    /// An announcement not sent (its keys given up): the next message tells the receivers
    /// they missed one.
    pub(crate) fn skip_announcement(&mut self) {
        self.seq += 1;
        self.announced = self.seq;
    }
}

/// What the near tier does with what the receiver heard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Heard {
    /// Nothing to do (a heartbeat in order, a new sender, a leave).
    Nothing,
    /// The receiver's own message, back: the bus carries what this cache sends.
    Echo,
    /// Not a message of newcache's: ignored.
    Foreign,
    /// Drop these keys' copies.
    Drop(Vec<String>),
    /// Another cache's `clear`: drop every copy.
    Cleared,
    /// A message may have been lost (why): serve no copy filled before.
    Lost(Loss),
}

/// Why a receiver judges that it may have missed a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Loss {
    /// A sender's sequence skipped (a message lost), seen at its next message.
    Gap,
    /// A message that did not decode.
    Malformed,
}

/// What a receiver knows of one sender.
#[derive(Debug)]
struct Peer {
    epoch: u64,
    /// The sequence number of the sender's last announcement this receiver accounted for.
    announced: u64,
    heard_ms: u64,
    heartbeat_ms: u64,
    /// Silent past its bound (counted once): its next message is checked against its
    /// sequence still.
    silent: bool,
}

impl Peer {
    /// How long it may stay silent: three of its heartbeats.
    fn bound_ms(&self) -> u64 {
        self.heartbeat_ms.saturating_mul(3)
    }
}

/// How long a silent sender is remembered (a sender back later is checked as a new one: a
/// first message past its first sequence is a loss).
const FORGET_SILENT_MS: u64 = 10 * 60 * 1000;

/// A cache instance's receiver: per sender, its epoch and its last announcement accounted
/// for, and when it was last heard.
#[derive(Debug)]
pub(crate) struct Receiver {
    me: u128,
    peers: HashMap<u128, Peer>,
}

impl Receiver {
    pub(crate) fn new(me: u128) -> Receiver {
        Receiver {
            me,
            peers: HashMap::new(),
        }
    }

    /// A message's bytes heard at `now_ms`.
    pub(crate) fn on_bytes(&mut self, now_ms: u64, bytes: &[u8]) -> Heard {
        match Message::decode(bytes) {
            Ok(m) => self.on_message(now_ms, m),
            Err(Unread::Foreign) => Heard::Foreign,
            Err(Unread::Malformed(_)) => Heard::Lost(Loss::Malformed),
        }
    }

    /// A message heard at `now_ms`.
    pub(crate) fn on_message(&mut self, now_ms: u64, m: Message) -> Heard {
        if m.sender == self.me {
            return Heard::Echo;
        }
        let heartbeat_ms = u64::from(m.heartbeat_ms);
        // A missed announcement: one the sender made before this message that this receiver
        // did not hear. A sender heard for the first time (new, restarted, or new to this
        // receiver) that announced anything before: this receiver cannot tell whether it
        // heard it, and its copies are at most as old as its subscription: a loss.
        let heard_up_to = match self.peers.get(&m.sender) {
            Some(p) if p.epoch == m.epoch => p.announced,
            _ => 0,
        };
        let gap = m.prev_announce > heard_up_to;
        let announced = match m.body {
            Body::Drop(_) | Body::Flush => m.seq,
            _ => m.prev_announce,
        };
        if m.body == Body::Leave {
            self.peers.remove(&m.sender);
        } else {
            let peer = Peer {
                epoch: m.epoch,
                announced,
                heard_ms: now_ms,
                heartbeat_ms,
                silent: false,
            };
            self.peers.insert(m.sender, peer);
        }
        match (gap, m.body) {
            (true, _) => Heard::Lost(Loss::Gap),
            (false, Body::Drop(keys)) => Heard::Drop(keys),
            (false, Body::Flush) => Heard::Cleared,
            (false, Body::Heartbeat | Body::Leave) => Heard::Nothing,
        }
    }

    /// Time passes: how many known senders went silent past their bound since the last tick
    /// (each a possible loss). They are remembered a while, so that their next message is
    /// checked against their sequence.
    pub(crate) fn on_tick(&mut self, now_ms: u64) -> u64 {
        let mut silent = 0;
        self.peers.retain(|_, p| {
            let quiet = now_ms.saturating_sub(p.heard_ms);
            if !p.silent && quiet > p.bound_ms() {
                p.silent = true;
                silent += 1;
            }
            !p.silent || quiet <= FORGET_SILENT_MS.max(p.bound_ms())
        });
        silent
    }

    /// The transport subscribed again at `now_ms`: what was missed meanwhile is the
    /// station's to cover; every known sender gets a fresh silence bound from now.
    pub(crate) fn on_reconnect(&mut self, now_ms: u64) {
        for p in self.peers.values_mut() {
            p.heard_ms = now_ms;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HB: Duration = Duration::from_millis(1000);

    fn drop(keys: &[&str]) -> Body {
        Body::Drop(keys.iter().map(|k| k.to_string()).collect())
    }

    #[test]
    fn messages_round_trip_and_bad_bytes_are_refused() {
        let mut s = Sender::new(7, 3, HB);
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
        assert_eq!(Message::decode(&bytes[..2]), Err(Unread::Foreign));
        for cut in 3..bytes.len() {
            assert!(
                matches!(Message::decode(&bytes[..cut]), Err(Unread::Malformed(_))),
                "cut at {cut}"
            );
        }
        let mut trailing = bytes.clone();
        trailing.push(0);
        assert!(Message::decode(&trailing).is_err());
        let mut huge = bytes[..49].to_vec();
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            Message::decode(&huge),
            Err(Unread::Malformed("more keys than bytes"))
        );
        assert_eq!(Message::decode(b"hello"), Err(Unread::Foreign));
    }

    #[test]
    fn a_receiver_drops_and_tells_losses() {
        let mut r = Receiver::new(1);
        let mut a = Sender::new(2, 1, HB);
        // its own messages are only an echo
        assert_eq!(
            r.on_message(0, Sender::new(1, 9, HB).next(Body::Flush)),
            Heard::Echo
        );
        // a sender first heard after heartbeats only (its hello lost, say): no loss
        a.next(Body::Heartbeat);
        assert_eq!(
            r.on_message(0, a.next(drop(&["k"]))),
            Heard::Drop(vec!["k".into()])
        );
        assert_eq!(r.on_message(1, a.next(Body::Heartbeat)), Heard::Nothing);
        assert_eq!(r.on_message(2, a.next(Body::Flush)), Heard::Cleared);
        // a lost heartbeat is no loss; a lost announcement is, at the sender's next message
        a.next(Body::Heartbeat);
        assert_eq!(r.on_message(3, a.next(Body::Heartbeat)), Heard::Nothing);
        a.next(drop(&["lost"]));
        assert_eq!(
            r.on_message(3, a.next(Body::Heartbeat)),
            Heard::Lost(Loss::Gap)
        );
        assert_eq!(
            r.on_message(4, a.next(drop(&["k"]))),
            Heard::Drop(vec!["k".into()])
        );
        // an announcement given up by its sender is a loss too
        a.skip_announcement();
        assert_eq!(
            r.on_message(4, a.next(Body::Heartbeat)),
            Heard::Lost(Loss::Gap)
        );
        // a restart (new epoch) that announced nothing yet is no loss
        let mut a2 = Sender::new(2, 2, HB);
        assert_eq!(
            r.on_message(5, a2.next(drop(&["j"]))),
            Heard::Drop(vec!["j".into()])
        );
        // silence past three heartbeats is a loss, once; the sender back with nothing missed
        // is none, back past a lost announcement is one
        assert_eq!(r.on_tick(3_005), 0);
        assert_eq!(r.on_tick(3_006), 1);
        assert_eq!(r.on_tick(9_000), 0);
        assert_eq!(
            r.on_message(9_001, a2.next(Body::Heartbeat)),
            Heard::Nothing
        );
        assert_eq!(r.on_tick(20_000), 1);
        a2.next(drop(&["lost"]));
        assert_eq!(
            r.on_message(20_001, a2.next(Body::Heartbeat)),
            Heard::Lost(Loss::Gap)
        );
        // a leaving sender's silence is none; a leave after a lost announcement is a loss
        let mut b = Sender::new(3, 1, HB);
        r.on_message(20_002, b.next(Body::Heartbeat));
        assert_eq!(r.on_message(20_003, b.next(Body::Leave)), Heard::Nothing);
        let mut c = Sender::new(4, 1, HB);
        r.on_message(20_004, c.next(Body::Heartbeat));
        c.next(drop(&["lost"]));
        assert_eq!(
            r.on_message(20_005, c.next(Body::Leave)),
            Heard::Lost(Loss::Gap)
        );
        assert_eq!(r.on_tick(40_000), 1, "a2 only: b and c left");
        // a sender first heard that announced before: this receiver cannot tell it heard
        // that, a loss; one that announced nothing yet, none
        let mut d = Sender::new(5, 1, HB);
        d.next(drop(&["before"]));
        assert_eq!(
            r.on_message(40_001, d.next(Body::Heartbeat)),
            Heard::Lost(Loss::Gap)
        );
        let mut e = Sender::new(6, 1, HB);
        e.next(Body::Heartbeat);
        assert_eq!(
            r.on_message(40_002, e.next(Body::Heartbeat)),
            Heard::Nothing
        );
        // a reconnect keeps what was heard: an announcement lost after it is a gap
        r.on_reconnect(50_000);
        e.next(drop(&["lost"]));
        assert_eq!(
            r.on_message(50_001, e.next(Body::Heartbeat)),
            Heard::Lost(Loss::Gap)
        );
        // a sender with a longer heartbeat is judged by its own
        let mut slow = Sender::new(7, 1, Duration::from_secs(10));
        r.on_message(50_002, slow.next(Body::Heartbeat));
        assert_eq!(r.on_tick(51_000), 0);
        assert_eq!(r.on_tick(54_500), 2, "d and e, not the slower sender");
        // bytes that do not decode are a loss; someone else's bytes are not
        assert_eq!(r.on_bytes(0, b"ncb\x09"), Heard::Lost(Loss::Malformed));
        assert_eq!(r.on_bytes(0, b"{\"json\": 1}"), Heard::Foreign);
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

/// A transport's listeners: an event is handed to each, and one that returns `false` (its
/// cache is gone) is dropped. The fan-out of every transport.
#[derive(Default)]
pub(crate) struct Listeners(Mutex<Vec<BusListener>>);

impl Listeners {
    pub(crate) fn add(&self, listener: BusListener) {
        self.0.lock().push(listener);
    }

    fn len(&self) -> usize {
        self.0.lock().len()
    }

    /// Hands `event` to every listener, the list unlocked meanwhile (a listener may publish,
    /// or a cache join).
    pub(crate) fn tell(&self, event: BusEvent<'_>) {
        let all = self.0.lock().clone();
        let gone: Vec<_> = all.iter().filter(|l| !l(event)).cloned().collect();
        if !gone.is_empty() {
            self.0
                .lock()
                .retain(|l| !gone.iter().any(|g| Arc::ptr_eq(l, g)));
        }
    }
}

/// A bus within one process: every published message is handed to every listener at once, on
/// the publishing thread. For caches of one process that share no store (a store they share
/// is fenced without a bus), and for tests.
#[derive(Default)]
pub struct InProcessBus {
    listeners: Listeners,
}

impl std::fmt::Debug for InProcessBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InProcessBus")
            .field("listeners", &self.listeners.len())
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
        self.listeners.tell(BusEvent::Message(message));
    }
    fn subscribe(&self, listener: BusListener) {
        self.listeners.add(listener.clone());
        // Subscribed at once: say so, as a transport that connects does.
        listener(BusEvent::Reconnected);
    }
}

/// The most key bytes one message carries: a batch larger than this goes in several.
const MAX_BATCH_BYTES: usize = 32 << 10;

/// The most keys waiting to be announced (a bus that does not take them as fast as they are
/// written): past it, they are given up, and the receivers told they missed an announcement.
const MAX_PENDING_KEYS: usize = 100_000;

/// What a cache's near tier reads of its bus on each hit: whether the bus is known to carry
/// this cache's messages (and heard one lately), and its generation (bumped at each possible
/// loss: a copy whose read was sent under an older one is not served as a hit).
#[derive(Debug)]
pub(crate) struct Gate {
    healthy: AtomicBool,
    generation: AtomicU64,
    /// When this cache last heard its own message (ms on [`Gate::now_ms`]): a hit checks it,
    /// so that a bus that stopped carrying them is noticed by the first hit past the bound,
    /// whatever the station's thread is doing (a publish that blocks).
    echo_ms: AtomicU64,
    /// How long without an echo a hit is still served: three heartbeats.
    bound_ms: u64,
    /// The process's ticked clock, which a hit reads (with a near tier): its readings are ms
    /// since `origin`, as the station's are, only coarser.
    ticker: Option<Arc<super::clock::Ticker>>,
    origin: Instant,
}

impl Gate {
    /// A gate for `heartbeat`, its hits on the ticked clock if `ticked` (a near tier reads it
    /// on each hit; a cache that only announces starts no ticker).
    fn new(heartbeat: Duration, ticked: bool) -> Gate {
        let ticker = ticked.then(super::clock::Ticker::shared).flatten();
        Gate {
            healthy: AtomicBool::new(false),
            generation: AtomicU64::new(0),
            echo_ms: AtomicU64::new(0),
            bound_ms: millis(heartbeat * 3),
            origin: ticker.as_ref().map_or_else(Instant::now, |t| t.origin()),
            ticker,
        }
    }

    /// Ms since `origin`, read from the system's monotonic clock: the station's every time
    /// (its peers' silences and its own echo are judged on it, whether or not the ticker
    /// thread keeps time).
    fn now_ms(&self) -> u64 {
        millis(self.origin.elapsed())
    }

    /// This cache's own message came back now.
    fn echoed(&self) {
        self.echo_ms.store(self.now_ms(), Ordering::SeqCst);
    }

    /// Whether this cache last heard its own message longer ago than the bound, at `now_ms`.
    #[inline]
    fn echo_overdue(&self, now_ms: u64) -> bool {
        now_ms.saturating_sub(self.echo_ms.load(Ordering::Relaxed)) > self.bound_ms
    }

    /// The generation a read sent now is filled under.
    #[inline]
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Whether a copy filled from a read sent under `generation` is served as a hit: the bus
    /// is healthy (checked first: a recovery bumps the generation before it says so), carried
    /// this cache's own message within the bound, and nothing may have been lost since the
    /// read was sent.
    #[inline]
    pub(crate) fn serves(&self, generation: u64) -> bool {
        self.healthy.load(Ordering::SeqCst)
            && self.generation.load(Ordering::SeqCst) == generation
            // The ticked reading lags the echo's stamp, if anything: a copy is served past
            // the bound by at most that lag, as every age the near tier judges.
            && !self.echo_overdue(self.ticker.as_ref().map_or_else(|| self.now_ms(), |t| t.age_ms()))
    }
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
    /// Keys were given up (too many waiting): the receivers are to see a missed announcement.
    overflowed: bool,
    /// How many keys `later` holds.
    later_keys: usize,
}

impl Outbox {
    /// Keys written, to announce now (`settle` `None`) or once they may have landed.
    fn push(&mut self, keys: Vec<String>, settle: Option<Duration>) {
        match settle {
            None => self.keys.extend(keys),
            Some(d) => {
                self.later_keys += keys.len();
                self.later.push((Instant::now() + d, Some(keys)));
            }
        }
        if self.keys.len() + self.later_keys > MAX_PENDING_KEYS {
            // Given up: the receivers stop serving every copy instead.
            self.keys = Vec::new();
            self.later.retain(|(_, k)| k.is_none());
            self.later_keys = 0;
            self.overflowed = true;
        }
    }

    /// The writes waiting out their settle time that may have landed by `now`, moved to
    /// those to announce now.
    fn settle(&mut self, now: Instant) {
        let mut due = Vec::new();
        self.later.retain_mut(|(at, keys)| {
            let ready = *at <= now;
            if ready {
                due.push(keys.take());
            }
            !ready
        });
        for keys in due {
            match keys {
                Some(keys) => {
                    self.later_keys -= keys.len();
                    self.keys.extend(keys);
                }
                None => self.flush = true,
            }
        }
    }
}

/// The state a station's listener and thread share.
#[derive(Debug)]
struct Shared {
    transport: Arc<dyn BusTransport>,
    outbox: Mutex<Outbox>,
    wake: Condvar,
    receiver: Mutex<Receiver>,
    gate: Arc<Gate>,
    /// Whether the transport said its subscription broke since it last subscribed.
    disconnected: AtomicBool,
    /// Whether the transport ever said it subscribed.
    subscribed: AtomicBool,
    domain: Weak<Domain>,
    heartbeat: Duration,
    counters: Arc<Counters>,
}

impl Shared {
    fn now_ms(&self) -> u64 {
        self.gate.now_ms()
    }

    /// A message may have been lost: no copy filled before is served as a hit (counted as a
    /// flush while the bus was healthy; a bus already down serves none).
    fn lost(&self) {
        self.gate.generation.fetch_add(1, Ordering::SeqCst);
        if self.gate.healthy.load(Ordering::SeqCst) {
            Counters::add(&self.counters.bus_flushes, 1);
        }
    }

    /// Messages are being missed from now on: stop serving until this cache hears itself.
    fn down(&self) {
        self.lost();
        self.gate.healthy.store(false, Ordering::SeqCst);
    }

    fn on_event(&self, event: BusEvent<'_>) {
        let heard = match event {
            BusEvent::Message(bytes) => self.receiver.lock().on_bytes(self.now_ms(), bytes),
            BusEvent::Disconnected => {
                self.disconnected.store(true, Ordering::SeqCst);
                return self.down();
            }
            BusEvent::Reconnected => {
                self.receiver.lock().on_reconnect(self.now_ms());
                let first = !self.subscribed.swap(true, Ordering::SeqCst);
                let broke = self.disconnected.swap(false, Ordering::SeqCst);
                // Its first subscription: nothing was missed, and no copy exists yet.
                if broke || !first {
                    Counters::add(&self.counters.bus_reconnects, 1);
                    self.down();
                }
                self.wake.notify_one();
                return;
            }
        };
        match heard {
            Heard::Echo => {
                self.gate.echoed();
                // A transport that told `Disconnected` and not yet `Reconnected` (from
                // another thread) is not healthy, whatever came back meanwhile.
                if !self.gate.healthy.load(Ordering::SeqCst)
                    && !self.disconnected.load(Ordering::SeqCst)
                {
                    // Copies filled while messages may have been missed are not served; what
                    // is filled from now on is covered by the messages this cache hears.
                    self.gate.generation.fetch_add(1, Ordering::SeqCst);
                    self.gate.healthy.store(true, Ordering::SeqCst);
                }
            }
            Heard::Foreign => {}
            Heard::Nothing => Counters::add(&self.counters.bus_received, 1),
            Heard::Drop(keys) => {
                Counters::add(&self.counters.bus_received, 1);
                Counters::add(&self.counters.bus_keys_dropped, keys.len() as u64);
                if let Some(domain) = self.domain.upgrade() {
                    domain.dropped(keys.iter().map(String::as_str));
                }
            }
            Heard::Cleared => {
                Counters::add(&self.counters.bus_received, 1);
                Counters::add(&self.counters.bus_flushes, 1);
                // Another cache's `clear`, as this process's own: no copy filled before it
                // is served, not even through an outage.
                if let Some(domain) = self.domain.upgrade() {
                    domain.flushed();
                }
            }
            Heard::Lost(loss) => {
                if loss == Loss::Gap {
                    Counters::add(&self.counters.bus_received, 1);
                    Counters::add(&self.counters.bus_gaps, 1);
                }
                self.lost();
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
            Counters::add(&self.counters.bus_sent, 1);
            *last = Some(Instant::now());
        };
        loop {
            let healthy = self.gate.healthy.load(Ordering::SeqCst);
            // Unhealthy, it says hello often, to hear itself back soon.
            let every = match healthy {
                true => self.heartbeat,
                false => (self.heartbeat / 10).max(Duration::from_millis(10)),
            };
            // Peers are checked often enough to see their silence within a quarter of their
            // own heartbeat, or of this one's, whichever is shorter (and at least every 250
            // ms, whatever the heartbeats).
            let tick = Instant::now()
                + (every / 4)
                    .min(Duration::from_millis(250))
                    .max(Duration::from_millis(2));
            let (keys, flush, leaving) = {
                let mut o = self.outbox.lock();
                loop {
                    let now = Instant::now();
                    o.settle(now);
                    let ready = o.flush || !o.keys.is_empty() || (o.leaving && o.later.is_empty());
                    if ready || now >= tick {
                        break;
                    }
                    let until = o.later.iter().map(|(at, _)| *at).fold(tick, Instant::min);
                    self.wake.wait_until(&mut o, until);
                }
                let leaving = o.leaving && o.later.is_empty();
                if std::mem::take(&mut o.overflowed) {
                    sender.skip_announcement();
                }
                (
                    std::mem::take(&mut o.keys),
                    std::mem::take(&mut o.flush),
                    leaving,
                )
            };
            if flush {
                send(&mut sender, Body::Flush, &mut last_sent);
            } else if keys.iter().map(|k| k.len() + 2).sum::<usize>() < MAX_BATCH_BYTES {
                if !keys.is_empty() {
                    send(&mut sender, Body::Drop(keys), &mut last_sent);
                }
            } else {
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
            let silent = self.receiver.lock().on_tick(self.now_ms());
            if silent > 0 {
                Counters::add(&self.counters.bus_heartbeats_missed, silent);
                self.lost();
            }
            if self.gate.healthy.load(Ordering::SeqCst) && self.gate.echo_overdue(self.now_ms()) {
                // Its own messages stopped coming back: a paused bus, a broken publisher or
                // a subscription that broke without a word.
                Counters::add(&self.counters.bus_heartbeats_missed, 1);
                self.down();
            }
        }
    }
}

/// One cache instance on a bus: announces its writes (after they land) from a thread of its
/// own, and applies what it hears (a dropped key's stripe bumped, a loss's generation bumped).
/// Dropped with its cache: its thread sends what is left and says the cache leaves, and the
/// drop waits for that (at most `linger`).
#[derive(Debug)]
pub(crate) struct Station {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
    linger: Duration,
}

impl Station {
    /// Joins `transport` as a new cache instance whose copies live in `domain`, sending a
    /// heartbeat after each `heartbeat` of silence; its drop waits at most `linger` for its
    /// last messages to go. `near`: the cache has a near tier (its hits read the gate).
    pub(crate) fn join(
        transport: Arc<dyn BusTransport>,
        domain: &Arc<Domain>,
        heartbeat: Duration,
        linger: Duration,
        counters: Arc<Counters>,
        near: bool,
    ) -> Station {
        let id = (u128::from(crate::rng::entropy()) << 64) | u128::from(crate::rng::entropy());
        let epoch = crate::rng::entropy();
        let shared = Arc::new(Shared {
            transport: transport.clone(),
            outbox: Mutex::default(),
            wake: Condvar::new(),
            receiver: Mutex::new(Receiver::new(id)),
            gate: Arc::new(Gate::new(heartbeat, near)),
            disconnected: AtomicBool::new(false),
            subscribed: AtomicBool::new(false),
            domain: Arc::downgrade(domain),
            heartbeat,
            counters,
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
        let thread = std::thread::Builder::new()
            .name("newcache-bus".into())
            .spawn(move || runner.run(Sender::new(id, epoch, heartbeat)));
        let thread = match thread {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::warn!(
                    "newcache: the bus thread did not start ({e}); the near tier serves no hits"
                );
                None
            }
        };
        Station {
            shared,
            thread,
            linger,
        }
    }

    /// What the near tier reads of the bus on each hit.
    pub(crate) fn gate(&self) -> Arc<Gate> {
        self.shared.gate.clone()
    }

    /// Waits up to `timeout` until the bus is known healthy (before the cache's near tier
    /// exists: each recovery of the bus stops what was filled before it).
    pub(crate) fn wait_healthy(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.shared.gate.healthy.load(Ordering::SeqCst) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
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
        self.shared.outbox.lock().push(keys, settle);
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
}

impl Drop for Station {
    fn drop(&mut self) {
        self.shared.outbox.lock().leaving = true;
        self.shared.wake.notify_one();
        // Its last announcements and its leave go before the process may exit (a process
        // that exits silently makes every other one flush); a write still settling, or a
        // transport that does not answer, is not waited for past `linger`.
        let Some(thread) = self.thread.take() else {
            return;
        };
        let deadline = Instant::now() + self.linger;
        while !thread.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

#[cfg(test)]
mod station_tests {
    use super::*;
    use crate::near::fence::Ticket;

    /// A transport over an in-process bus that can lose messages, pause, and break its
    /// subscription.
    #[derive(Debug, Default)]
    struct Lossy {
        bus: InProcessBus,
        lose_next: AtomicBool,
        paused: AtomicBool,
    }

    impl BusTransport for Lossy {
        fn publish(&self, message: &[u8]) {
            if !self.lose_next.swap(false, Ordering::SeqCst) && !self.paused.load(Ordering::SeqCst)
            {
                self.bus.publish(message);
            }
        }
        fn subscribe(&self, listener: BusListener) {
            self.bus.subscribe(listener);
        }
    }

    impl Lossy {
        fn tell(&self, event: BusEvent<'_>) {
            self.bus.listeners.tell(event);
        }
    }

    fn domain(name: &str) -> Arc<Domain> {
        let backend: Arc<dyn crate::backend::Backend> = Arc::new(
            crate::backend::memory::MemoryBackend::new(1 << 20, Arc::new(crate::SystemClock)),
        );
        Domain::of(&[format!("bus-test-{name}")], &backend)
    }

    fn counters() -> Arc<crate::stats::Counters> {
        Arc::new(crate::stats::Counters::new("bus", &[]))
    }

    fn until(what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < deadline, "never: {what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// A read of `key` sent now through a cache on `station` over `d`.
    fn read(d: &Domain, station: &Station, key: &str) -> Ticket {
        let bus = station.gate().generation();
        Ticket {
            bus,
            ..d.ticket(key, 0).unwrap()
        }
    }

    /// Whether a copy filled from `t` would be served as a hit.
    fn serves(d: &Domain, station: &Station, t: &Ticket) -> bool {
        d.current(t.stripe, t.seq, t.flush) && station.gate().serves(t.bus)
    }

    const HB: Duration = Duration::from_millis(50);
    const LINGER: Duration = Duration::from_secs(1);

    #[test]
    fn too_many_keys_waiting_are_given_up_for_a_missed_announcement() {
        let keys = |n: usize| (0..n).map(|i| i.to_string()).collect::<Vec<_>>();
        let mut o = Outbox::default();
        o.push(keys(MAX_PENDING_KEYS / 2), Some(Duration::ZERO));
        o.push(keys(MAX_PENDING_KEYS / 2), None);
        assert!(!o.overflowed);
        o.settle(Instant::now());
        assert_eq!((o.keys.len(), o.later_keys), (MAX_PENDING_KEYS, 0));
        o.push(keys(1), Some(Duration::from_secs(60)));
        assert!(o.overflowed);
        assert_eq!((o.keys.len(), o.later.len(), o.later_keys), (0, 0, 0));
        // The thread skips an announcement for it: receivers see it missing.
        let mut s = Sender::new(1, 1, HB);
        s.skip_announcement();
        let m = s.next(Body::Heartbeat);
        let mut r = Receiver::new(2);
        assert_eq!(r.on_message(0, m), Heard::Lost(Loss::Gap));
    }

    #[test]
    fn a_station_drops_announced_keys_stops_serving_on_losses_and_only_while_it_hears_itself() {
        let bus = Arc::new(Lossy::default());
        let (da, db) = (domain("a"), domain("b"));
        let (ca, cb) = (counters(), counters());
        let a = Station::join(bus.clone(), &da, HB, LINGER, ca.clone(), true);
        let b = Station::join(bus.clone(), &db, HB, LINGER, cb.clone(), true);
        assert!(a.wait_healthy(Duration::from_secs(10)));
        assert!(b.wait_healthy(Duration::from_secs(10)));

        // An announced key's copy goes; another key's stays; its own announcement drops none.
        let k = read(&db, &b, "k");
        let other = read(&db, &b, "another");
        let own = read(&da, &a, "k");
        a.announce(&["k"], None);
        until("k dropped", || !serves(&db, &b, &k));
        assert!(serves(&db, &b, &other));
        assert_eq!(cb.snapshot().bus_keys_dropped, 1);
        assert!(serves(&da, &a, &own), "its own message is no drop");

        // A lost message is a gap: b stops serving when a's next message (a heartbeat) comes,
        // and serves what it reads afterwards.
        let t = read(&db, &b, "another");
        bus.lose_next.store(true, Ordering::SeqCst);
        a.announce(&["lost"], None);
        until("the gap seen", || !serves(&db, &b, &t));
        assert_eq!(cb.snapshot().bus_gaps, 1);
        assert!(serves(&db, &b, &read(&db, &b, "another")));

        // A broken subscription stops serving until the cache hears itself again; a copy
        // read while it was broken is not served after.
        let t = read(&db, &b, "another");
        bus.tell(BusEvent::Disconnected);
        assert!(!serves(&db, &b, &t));
        let during = read(&db, &b, "another");
        bus.tell(BusEvent::Reconnected);
        until("healthy again", || b.gate().healthy.load(Ordering::SeqCst));
        assert!(!serves(&db, &b, &during));
        assert!(serves(&db, &b, &read(&db, &b, "another")));
        assert_eq!(cb.snapshot().bus_reconnects, 1);

        // A sender that leaves is no loss; a new one (a restart) stops nothing.
        let flushes = cb.snapshot().bus_flushes;
        let t = read(&db, &b, "another");
        drop(a);
        let a2 = Station::join(bus.clone(), &da, HB, LINGER, counters(), true);
        assert!(a2.wait_healthy(Duration::from_secs(10)));
        std::thread::sleep(HB * 8);
        assert!(serves(&db, &b, &t), "a restart stops nobody's copies");
        assert_eq!(cb.snapshot().bus_flushes, flushes);
        assert_eq!(cb.snapshot().bus_heartbeats_missed, 0);

        // A paused bus: nobody hears anything; each cache misses its own messages and serves
        // nothing until the bus carries them again.
        let t = read(&db, &b, "another");
        bus.paused.store(true, Ordering::SeqCst);
        until("unhealthy", || !b.gate().healthy.load(Ordering::SeqCst));
        assert!(!serves(&db, &b, &t));
        assert!(cb.snapshot().bus_heartbeats_missed >= 1);
        bus.paused.store(false, Ordering::SeqCst);
        until("healthy after the pause", || {
            b.gate().healthy.load(Ordering::SeqCst)
        });
        assert!(!serves(&db, &b, &t), "nor after it");
        drop(a2);
    }
}
