//! Redis (or Valkey) pub/sub as the near tiers' bus: one channel (`PUBLISH`/`SUBSCRIBE`), or
//! on a Redis Cluster one sharded channel (`SPUBLISH`/`SSUBSCRIBE` on the master that owns the
//! channel's slot). Per transport, a subscriber thread that says when its subscription breaks
//! and when it is back (a slot that moves breaks it), and one publishing connection made on
//! demand: a message it cannot send is lost, which its receivers see as a gap.
//!
//! Redis's own client-side caching (`CLIENT TRACKING`, invalidations pushed over RESP3 or
//! redirected to a subscriber) was weighed as a transport and not built: it would also see
//! writes made outside newcache, but it serves a Redis shared tier only (not memcached or
//! twemproxy, which the bus serves too); it is per connection, so every pooled and pipelined
//! connection of both front ends (and every cluster node's) would have to be tracked and
//! redirected to one subscriber per server; its pushes carry no sequence, so a missed one is
//! noticed only as a broken connection, as here; and in broadcast mode (a `{flavor}-` prefix,
//! no per-key table on the server) every write under the prefix is pushed, the herd protocol's
//! claims included, which pub/sub's announcements leave out.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use redis::Value;

use super::blocking::Blocking;
use super::request::{self, Replies, pack_all};
use super::setup::SetUp;
use super::slots::{addr_of, parse_slots, slot_of};
use crate::near::bus::{BusEvent, BusListener, BusTransport, Listeners};

/// How long the subscriber waits for a message before it checks that its bus still exists.
const POLL: Duration = Duration::from_millis(200);

/// How long the subscriber hears nothing before it asks the server (a `PING`), and again before
/// it takes its connection for dead.
const SILENT: Duration = Duration::from_secs(1);

/// How long a connect, a publish or a subscribe may take: a server that does not answer in
/// this time is treated as gone (the bus's own heartbeats tell its caches).
const IO: Duration = Duration::from_millis(500);

/// A server: its address, and its URL's settings (credentials, database, protocol).
#[derive(Clone)]
struct Node {
    /// `host:port` ([`addr_of`]).
    addr: String,
    settings: redis::RedisConnectionInfo,
}

impl Node {
    /// The node of the URL `url`.
    fn of(url: &str) -> crate::Result<Node> {
        let client = redis::Client::open(url)
            .map_err(|e| crate::Error::config(format!("the bus's Redis URL: {e}")))?;
        let info = client.get_connection_info();
        match info.addr() {
            redis::ConnectionAddr::Tcp(host, port) => Ok(Node {
                addr: addr_of(host, *port),
                settings: info.redis_settings().clone(),
            }),
            _ => Err(crate::Error::config(
                "the bus's Redis URL: the bus speaks plain TCP (redis://), not TLS or a Unix socket",
            )),
        }
    }

    /// A connection to it, set up as the pool's are ([`SetUp::open`]), each step and then
    /// each read and write bounded by [`IO`]. Newcache's own connection, not redis-rs's: a
    /// subscriber's wait for the next message that times out must leave the connection as
    /// it was (redis-rs's sync reader would skip the next reply after it).
    fn open(&self) -> Option<Blocking> {
        let conn = SetUp::whole(&self.settings)
            .open(&self.addr, Instant::now(), IO, Ok, None)
            .ok()?;
        conn.set_timeouts(IO).ok()?;
        Some(conn)
    }

    /// The same server's credentials at `addr` (a cluster's master, found through a seed).
    fn at(&self, addr: String) -> Node {
        Node {
            addr,
            settings: self.settings.clone(),
        }
    }
}

/// Where the channel lives.
#[derive(Clone)]
enum Where {
    /// One server: `PUBLISH` and `SUBSCRIBE`.
    Server(Node),
    /// A cluster, reached through these seeds: `SPUBLISH` and `SSUBSCRIBE` on the master
    /// serving the channel's slot.
    Cluster(Vec<Node>),
}

impl Where {
    /// A connection to the server that carries `channel`.
    fn connect(&self, channel: &str) -> Option<Blocking> {
        match self {
            Where::Server(node) => node.open(),
            Where::Cluster(seeds) => Where::owner(seeds, channel)?.open(),
        }
    }

    /// The master that serves `channel`'s slot, asked of the first seed that answers.
    fn owner(seeds: &[Node], channel: &str) -> Option<Node> {
        let slot = slot_of(channel.as_bytes());
        seeds.iter().find_map(|seed| {
            let mut conn = seed.open()?;
            let ask = request::Builder::cluster_slots();
            let cmds: Vec<_> = ask.commands.iter().map(|c| &c.cmd).collect();
            let mut packed = Vec::new();
            pack_all(&cmds, &mut packed);
            conn.send(&packed).ok()?;
            let mut replies = Replies::new();
            conn.recv_many(cmds.len(), &mut replies).ok()?;
            let reply = ask.answer(replies).ok()?;
            let range = parse_slots(reply, &seed.addr)
                .ok()?
                .into_iter()
                .find(|r| (r.first..=r.last).contains(&slot))?;
            Some(seed.at(range.addr))
        })
    }

    fn sharded(&self) -> bool {
        matches!(self, Where::Cluster(_))
    }

    /// A subscriber's connection to the server that carries `channel`, subscribed with
    /// `command` (`SUBSCRIBE` or `SSUBSCRIBE`), its reads bounded by [`POLL`].
    fn subscribe(&self, command: &str, channel: &str) -> Option<Blocking> {
        let mut conn = self.connect(channel)?;
        conn.send(&redis::cmd(command).arg(channel).get_packed_command())
            .ok()?;
        // The confirmation: `[subscribe, channel, count]`.
        match conn.recv().ok()? {
            Value::Array(v) | Value::Push { data: v, .. } if v.len() == 3 => {}
            _ => return None,
        }
        conn.set_read_timeout(POLL).ok()?;
        Some(conn)
    }
}

/// A Redis or Valkey pub/sub channel as a [`BusTransport`]: [`RedisBus::new`] on one server
/// (beside any shared tier: memcached, Redis), [`RedisBus::cluster`] on a Redis Cluster.
///
/// One subscriber connection and one publishing connection per `RedisBus`, shared by every
/// cache given it; the subscriber runs on a thread of its own (on either front end: it never
/// takes a runtime's worker, and a bus needs no runtime). A server that restarts, a
/// subscriber killed or cut off by its output-buffer limit, a slot that moves: the subscriber
/// says it lost its subscription, reconnects, and says so (its caches flush their near
/// tiers, and serve no near hits until they hear themselves again).
///
/// ```no_run
/// use newcache::{Cache, RedisBus};
///
/// let cache = Cache::builder()
///     .memcached(["127.0.0.1:11211"])
///     .near_cache(64 << 20)
///     .near_bus(RedisBus::new("redis://127.0.0.1:6379", "newcache-bus")?)
///     .build()?;
/// # Ok::<(), newcache::Error>(())
/// ```
pub struct RedisBus {
    place: Where,
    channel: String,
    publisher: Mutex<Option<Blocking>>,
    listeners: Arc<Listeners>,
    subscribed: AtomicBool,
}

impl std::fmt::Debug for RedisBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBus")
            .field("channel", &self.channel)
            .field("sharded", &self.place.sharded())
            .finish_non_exhaustive()
    }
}

impl RedisBus {
    /// The bus on `channel` of the server at `url` (`redis://host:port`, with a user and
    /// password as redis-rs reads them; the bus speaks plain TCP, not `rediss://`). Nothing
    /// connects before the first cache joins it. Publishes and subscribes wait at most 500 ms
    /// for the server.
    ///
    /// # Errors
    /// `is_config()` for a URL redis-rs does not read.
    pub fn new(url: &str, channel: impl Into<String>) -> crate::Result<Arc<RedisBus>> {
        Ok(RedisBus::with(
            Where::Server(Node::of(url)?),
            channel.into(),
        ))
    }

    /// The bus on the sharded channel `channel` of the Redis Cluster that `seeds` (URLs of
    /// some of its nodes) belong to: published with `SPUBLISH` and heard with `SSUBSCRIBE` on
    /// the master that serves the channel's slot, so the bus loads one shard, not every node.
    /// A slot that moves ends the subscription: it counts as a reconnect.
    ///
    /// # Errors
    /// `is_config()` for no seed, or a URL redis-rs does not read.
    pub fn cluster(
        seeds: impl IntoIterator<Item = impl AsRef<str>>,
        channel: impl Into<String>,
    ) -> crate::Result<Arc<RedisBus>> {
        let seeds = seeds
            .into_iter()
            .map(|s| Node::of(s.as_ref()))
            .collect::<crate::Result<Vec<_>>>()?;
        if seeds.is_empty() {
            return Err(crate::Error::config("RedisBus::cluster needs a seed"));
        }
        Ok(RedisBus::with(Where::Cluster(seeds), channel.into()))
    }

    fn with(place: Where, channel: String) -> Arc<RedisBus> {
        Arc::new(RedisBus {
            place,
            channel,
            publisher: Mutex::new(None),
            listeners: Arc::default(),
            subscribed: AtomicBool::new(false),
        })
    }

    /// The subscriber: connects, subscribes, tells the listeners it (re)connected, and hands
    /// them every message until the subscription breaks (then says so, and starts over) or
    /// the bus is dropped.
    fn listen(place: Where, channel: String, listeners: Weak<Listeners>) {
        let tell = |event: BusEvent<'_>| -> bool {
            let Some(listeners) = listeners.upgrade() else {
                return false;
            };
            listeners.tell(event);
            true
        };
        let (subscribe, message, unsubscribe) = match place.sharded() {
            true => ("SSUBSCRIBE", "smessage", "sunsubscribe"),
            false => ("SUBSCRIBE", "message", "unsubscribe"),
        };
        loop {
            let Some(mut conn) = place.subscribe(subscribe, &channel) else {
                if listeners.strong_count() == 0 {
                    return;
                }
                std::thread::sleep(POLL);
                continue;
            };
            if !tell(BusEvent::Reconnected) {
                return;
            }
            // A connection that went silently dead (no FIN or RST: a partition, a vanished
            // host) is found by a PING after a second without a word, unanswered for another.
            let mut heard = Instant::now();
            let mut pinged = false;
            loop {
                let got = conn.recv_or_idle();
                if matches!(got, Ok(Some(_))) {
                    heard = Instant::now();
                    pinged = false;
                }
                match got {
                    Ok(Some(Value::Array(parts) | Value::Push { data: parts, .. })) => {
                        match (parts.first(), parts.get(2)) {
                            (Some(Value::BulkString(kind)), Some(Value::BulkString(payload)))
                                if kind == message.as_bytes()
                                    && !tell(BusEvent::Message(payload)) =>
                            {
                                return;
                            }
                            // Unsubscribed by the server (a sharded channel's slot moved).
                            (Some(Value::BulkString(kind)), _)
                                if kind == unsubscribe.as_bytes() =>
                            {
                                break;
                            }
                            _ => {}
                        }
                    }
                    Ok(Some(_)) => {}
                    Ok(None) => {
                        if listeners.strong_count() == 0 {
                            return;
                        }
                        let quiet = heard.elapsed();
                        if quiet >= SILENT * 2 {
                            break;
                        }
                        if quiet >= SILENT && !pinged {
                            pinged = true;
                            if conn.send(&redis::cmd("PING").get_packed_command()).is_err() {
                                break;
                            }
                        }
                    }
                    Err(_) => break,
                }
            }
            if !tell(BusEvent::Disconnected) {
                return;
            }
        }
    }
}

impl BusTransport for RedisBus {
    fn publish(&self, message: &[u8]) {
        let mut publisher = self.publisher.lock();
        if publisher.is_none() {
            *publisher = self.place.connect(&self.channel);
        }
        let Some(conn) = publisher.as_mut() else {
            return;
        };
        let command = match self.place.sharded() {
            true => "SPUBLISH",
            false => "PUBLISH",
        };
        let packed = redis::cmd(command)
            .arg(&self.channel)
            .arg(message)
            .get_packed_command();
        // The reply: how many subscribers heard it.
        let sent = conn.send(&packed).and_then(|()| conn.recv());
        if !matches!(sent, Ok(Value::Int(_))) {
            // A broken connection, a timeout, a refusal, a slot that moved: connect anew
            // next time.
            *publisher = None;
        }
    }

    fn subscribe(&self, listener: BusListener) {
        self.listeners.add(listener);
        if !self.subscribed.swap(true, Ordering::AcqRel) {
            let (place, channel) = (self.place.clone(), self.channel.clone());
            let listeners = Arc::downgrade(&self.listeners);
            let _ = std::thread::Builder::new()
                .name("newcache-bus-redis".into())
                .spawn(move || RedisBus::listen(place, channel, listeners));
        }
    }
}
