//! Redis (or Valkey) pub/sub as the near tiers' bus (issue 51, work in progress): one channel,
//! a subscriber thread per transport that reconnects and says so (its listeners flush), and a
//! publishing connection made on demand (a message that cannot be sent is lost, which the
//! receivers see as a gap).

use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;

use crate::near::bus::{BusEvent, BusListener, BusTransport};

/// How long the subscriber waits for a message before it checks that its bus still exists.
const POLL: Duration = Duration::from_millis(200);

/// A pub/sub channel on one Redis or Valkey server as a [`BusTransport`].
pub struct RedisBus {
    client: redis::Client,
    channel: String,
    publisher: Mutex<Option<redis::Connection>>,
    listeners: Arc<Mutex<Vec<BusListener>>>,
    subscribed: Mutex<bool>,
}

impl std::fmt::Debug for RedisBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBus")
            .field("channel", &self.channel)
            .finish_non_exhaustive()
    }
}

impl RedisBus {
    /// The bus on `channel` of the server at `url` (`redis://host:port`); nothing connects
    /// before the first message or listener.
    ///
    /// # Errors
    /// `is_config()` for a URL redis-rs does not read.
    pub fn new(url: &str, channel: impl Into<String>) -> crate::Result<Arc<RedisBus>> {
        let client = redis::Client::open(url)
            .map_err(|e| crate::Error::config(format!("the bus's Redis URL: {e}")))?;
        Ok(Arc::new(RedisBus {
            client,
            channel: channel.into(),
            publisher: Mutex::new(None),
            listeners: Arc::default(),
            subscribed: Mutex::new(false),
        }))
    }

    /// The subscriber: connects, subscribes, tells the listeners it (re)connected, and hands
    /// them every message until the connection fails or the bus is gone.
    fn listen(client: redis::Client, channel: String, listeners: Weak<Mutex<Vec<BusListener>>>) {
        let tell = |event: BusEvent<'_>| -> bool {
            let Some(listeners) = listeners.upgrade() else {
                return false;
            };
            let listeners = listeners.lock().clone();
            for l in listeners {
                l(event);
            }
            true
        };
        loop {
            let Ok(mut conn) = client.get_connection_with_timeout(Duration::from_secs(1)) else {
                if listeners.strong_count() == 0 {
                    return;
                }
                std::thread::sleep(POLL);
                continue;
            };
            let _ = conn.set_read_timeout(Some(POLL));
            let mut pubsub = conn.as_pubsub();
            if pubsub.subscribe(&channel).is_err() {
                continue;
            }
            if !tell(BusEvent::Reconnected) {
                return;
            }
            loop {
                match pubsub.get_message() {
                    Ok(msg) => {
                        if !tell(BusEvent::Message(msg.get_payload_bytes())) {
                            return;
                        }
                    }
                    Err(e) if e.is_timeout() => {
                        if listeners.strong_count() == 0 {
                            return;
                        }
                    }
                    Err(_) => break,
                }
            }
        }
    }
}

impl BusTransport for RedisBus {
    fn publish(&self, message: &[u8]) {
        let mut publisher = self.publisher.lock();
        if publisher.is_none() {
            *publisher = self
                .client
                .get_connection_with_timeout(Duration::from_secs(1))
                .ok();
        }
        let Some(conn) = publisher.as_mut() else {
            return;
        };
        let sent: redis::RedisResult<i64> = redis::cmd("PUBLISH")
            .arg(&self.channel)
            .arg(message)
            .query(conn);
        if sent.is_err() {
            *publisher = None;
        }
    }

    fn subscribe(&self, listener: BusListener) {
        self.listeners.lock().push(listener);
        let mut subscribed = self.subscribed.lock();
        if !*subscribed {
            *subscribed = true;
            let (client, channel) = (self.client.clone(), self.channel.clone());
            let listeners = Arc::downgrade(&self.listeners);
            let _ = std::thread::Builder::new()
                .name("newcache-bus-redis".into())
                .spawn(move || RedisBus::listen(client, channel, listeners));
        }
    }
}
