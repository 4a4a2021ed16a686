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
use std::sync::Arc;

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
    /// Nothing to do (its own message, a heartbeat in order, a new sender, a leave).
    Nothing,
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
            return Heard::Nothing;
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
        // its own messages are skipped
        assert_eq!(
            r.on_message(0, Sender::new(1, 9).next(Body::Flush)),
            Heard::Nothing
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

/// What a transport hands its listener.
#[derive(Debug, Clone, Copy)]
pub enum BusEvent<'a> {
    /// A message's bytes.
    Message(&'a [u8]),
    /// The transport reconnected (or was cut off and came back): messages may have been lost.
    Reconnected,
}

/// A listener of a [`BusTransport`].
pub type BusListener = Arc<dyn Fn(BusEvent<'_>) + Send + Sync>;

/// What moves the near tiers' messages between caches: an in-process bus for one process and
/// for tests, Redis pub/sub between processes (issue 51).
pub trait BusTransport: std::fmt::Debug + Send + Sync {
    /// Sends `message` to every listener (this one's own included: a receiver skips its own).
    fn publish(&self, message: &[u8]);
    /// Adds a listener.
    fn subscribe(&self, listener: BusListener);
}

/// A bus within one process: every published message is handed to every listener at once.
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
        for l in listeners {
            l(BusEvent::Message(message));
        }
    }
    fn subscribe(&self, listener: BusListener) {
        self.listeners.lock().push(listener);
    }
}

/// One cache instance on a bus: announces its writes, and applies what it hears to its
/// domain's stripes (a dropped key's stripe bumped, a flush's count bumped).
#[derive(Debug)]
pub(crate) struct Station {
    transport: Arc<dyn BusTransport>,
    sender: parking_lot::Mutex<Sender>,
}

impl Station {
    /// Joins `transport` as a new instance whose copies live in `domain`: a listener applies
    /// what it hears, and a thread sends a heartbeat every `heartbeat` and treats a known
    /// sender silent for three of them as a loss. The thread ends with the station (which
    /// says it leaves).
    pub(crate) fn join(
        transport: Arc<dyn BusTransport>,
        domain: Arc<super::fence::Domain>,
        heartbeat: std::time::Duration,
    ) -> Arc<Station> {
        let id = (u128::from(crate::rng::entropy()) << 64) | u128::from(crate::rng::entropy());
        let epoch = crate::rng::entropy();
        let silent_after_ms = 3 * heartbeat.as_millis() as u64;
        let receiver = Arc::new(parking_lot::Mutex::new(Receiver::new(id, silent_after_ms)));
        let origin = std::time::Instant::now();
        let now = move || origin.elapsed().as_millis() as u64;
        let apply = |domain: &super::fence::Domain, heard: Heard| match heard {
            Heard::Nothing => {}
            Heard::Drop(keys) => domain.dropped(keys.iter().map(String::as_str)),
            Heard::Flush(_) => domain.flushed(),
        };
        let weak = Arc::downgrade(&domain);
        let heard_by = receiver.clone();
        transport.subscribe(Arc::new(move |event| {
            let Some(domain) = weak.upgrade() else {
                return;
            };
            let heard = match event {
                BusEvent::Message(bytes) => heard_by.lock().on_bytes(now(), bytes),
                BusEvent::Reconnected => heard_by.lock().on_reconnect(),
            };
            apply(&domain, heard);
        }));
        let station = Arc::new(Station {
            transport,
            sender: parking_lot::Mutex::new(Sender::new(id, epoch)),
        });
        let (weak_station, weak_domain) = (Arc::downgrade(&station), Arc::downgrade(&domain));
        let _ = std::thread::Builder::new()
            .name("newcache-bus".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(heartbeat);
                    let (Some(station), Some(domain)) =
                        (weak_station.upgrade(), weak_domain.upgrade())
                    else {
                        return;
                    };
                    station.send(Body::Heartbeat);
                    let heard = receiver.lock().on_tick(now());
                    apply(&domain, heard);
                }
            });
        station
    }

    fn send(&self, body: Body) {
        let bytes = self.sender.lock().next(body).encode();
        self.transport.publish(&bytes);
    }

    /// Announces that `keys` were written (after the write).
    pub(crate) fn announce<'k>(&self, keys: impl IntoIterator<Item = &'k str>) {
        self.send(Body::Drop(keys.into_iter().map(str::to_owned).collect()));
    }

    /// Announces a `clear`.
    pub(crate) fn announce_flush(&self) {
        self.send(Body::Flush);
    }
}

impl Drop for Station {
    fn drop(&mut self) {
        // Its silence from now on is not a loss.
        self.send(Body::Leave);
    }
}
