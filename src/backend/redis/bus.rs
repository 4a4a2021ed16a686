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

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use redis::Value;

use super::blocking::Blocking;
use super::slots::{addr_of, parse_slots, slot_of};
use crate::near::bus::{BusEvent, BusListener, BusTransport};

/// How long the subscriber waits for a message before it checks that its bus still exists.
const POLL: Duration = Duration::from_millis(200);

/// How long a connect, a publish or a subscribe may take: a server that does not answer in
/// this time is treated as gone (the bus's own heartbeats tell its caches).
const IO: Duration = Duration::from_millis(500);

/// Where the channel lives.
#[derive(Debug, Clone)]
enum Where {
    /// One server: `PUBLISH` and `SUBSCRIBE`.
    Server(Box<redis::Client>),
    /// A cluster, reached through these seeds: `SPUBLISH` and `SSUBSCRIBE` on the master
    /// serving the channel's slot.
    Cluster(Vec<redis::Client>),
}

impl Where {
    /// A connection to the server that carries `channel`.
    fn connect(&self, channel: &str) -> Option<redis::Connection> {
        let client = match self {
            Where::Server(client) => (**client).clone(),
            Where::Cluster(seeds) => Where::owner(seeds, channel)?,
        };
        let conn = client.get_connection_with_timeout(IO).ok()?;
        conn.set_read_timeout(Some(IO)).ok()?;
        conn.set_write_timeout(Some(IO)).ok()?;
        Some(conn)
    }

    /// The master that serves `channel`'s slot, asked of the first seed that answers.
    fn owner(seeds: &[redis::Client], channel: &str) -> Option<redis::Client> {
        let slot = slot_of(channel.as_bytes());
        seeds.iter().find_map(|seed| {
            let mut conn = seed.get_connection_with_timeout(IO).ok()?;
            conn.set_read_timeout(Some(IO)).ok()?;
            let reply: Value = redis::cmd("CLUSTER").arg("SLOTS").query(&mut conn).ok()?;
            let asked = seed.get_connection_info().addr().to_string();
            let ranges = parse_slots(reply, &asked).ok()?;
            let range = ranges
                .into_iter()
                .find(|r| (r.first..=r.last).contains(&slot))?;
            let mut info = seed.get_connection_info().clone();
            let (host, port) = range.addr.rsplit_once(':')?;
            let host = host.trim_start_matches('[').trim_end_matches(']');
            info = info.set_addr(redis::ConnectionAddr::Tcp(
                host.to_owned(),
                port.parse().ok()?,
            ));
            redis::Client::open(info).ok()
        })
    }

    fn sharded(&self) -> bool {
        matches!(self, Where::Cluster(_))
    }

    /// A subscriber's connection to the server that carries `channel`, subscribed with
    /// `command` (`SUBSCRIBE` or `SSUBSCRIBE`), its reads bounded by [`POLL`]. Its own
    /// connection, not redis-rs's: a wait for the next message that times out must leave the
    /// connection as it was (redis-rs's sync reader would skip the next reply after it).
    fn subscribe(&self, command: &str, channel: &str) -> Option<Blocking> {
        let client = match self {
            Where::Server(client) => (**client).clone(),
            Where::Cluster(seeds) => Where::owner(seeds, channel)?,
        };
        let info = client.get_connection_info();
        let redis::ConnectionAddr::Tcp(host, port) = info.addr() else {
            return None;
        };
        let mut conn = Blocking::connect(&addr_of(host, *port), Instant::now(), IO).ok()?;
        let settings = info.redis_settings();
        let mut ask = |cmd: redis::Cmd| -> Option<Value> {
            conn.send(&cmd.get_packed_command()).ok()?;
            conn.recv().ok()
        };
        if let Some(password) = settings.password() {
            let mut auth = redis::cmd("AUTH");
            if let Some(user) = settings.username() {
                auth.arg(user);
            }
            match ask(auth.arg(password).clone())? {
                Value::Okay | Value::SimpleString(_) => {}
                _ => return None,
            }
        }
        // The confirmation: `[subscribe, channel, count]`.
        match ask(redis::cmd(command).arg(channel).clone())? {
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
    publisher: Mutex<Option<redis::Connection>>,
    listeners: Arc<Mutex<Vec<BusListener>>>,
    subscribed: Mutex<bool>,
}

impl std::fmt::Debug for RedisBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBus")
            .field("channel", &self.channel)
            .field("sharded", &self.place.sharded())
            .finish_non_exhaustive()
    }
}

fn client(url: &str) -> crate::Result<redis::Client> {
    redis::Client::open(url).map_err(|e| crate::Error::config(format!("the bus's Redis URL: {e}")))
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
            Where::Server(Box::new(client(url)?)),
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
            .map(|s| client(s.as_ref()))
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
            subscribed: Mutex::new(false),
        })
    }

    /// The subscriber: connects, subscribes, tells the listeners it (re)connected, and hands
    /// them every message until the subscription breaks (then says so, and starts over) or
    /// the bus is dropped.
    fn listen(place: Where, channel: String, listeners: Weak<Mutex<Vec<BusListener>>>) {
        let tell = |event: BusEvent<'_>| -> bool {
            let Some(listeners) = listeners.upgrade() else {
                return false;
            };
            let all = listeners.lock().clone();
            let gone: Vec<_> = all.iter().filter(|l| !l(event)).cloned().collect();
            if !gone.is_empty() {
                listeners
                    .lock()
                    .retain(|l| !gone.iter().any(|g| Arc::ptr_eq(l, g)));
            }
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
            loop {
                match conn.recv_or_idle() {
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
        let sent: redis::RedisResult<i64> = redis::cmd(command)
            .arg(&self.channel)
            .arg(message)
            .query(conn);
        if sent.is_err() {
            // A broken connection, a timeout, a slot that moved: connect anew next time.
            *publisher = None;
        }
    }

    fn subscribe(&self, listener: BusListener) {
        self.listeners.lock().push(listener);
        let mut subscribed = self.subscribed.lock();
        if !*subscribed {
            *subscribed = true;
            let (place, channel) = (self.place.clone(), self.channel.clone());
            let listeners = Arc::downgrade(&self.listeners);
            let _ = std::thread::Builder::new()
                .name("newcache-bus-redis".into())
                .spawn(move || RedisBus::listen(place, channel, listeners));
        }
    }
}
