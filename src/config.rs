//! The validated settings a [`Cache`](crate::Cache) is built from. [`CacheBuilder`]
//! (crate::CacheBuilder) produces one; `Cache` consumes it. Plain data, no behaviour.

use std::sync::Arc;
use std::time::Duration;

use crate::backend::Backend;
use crate::cache::policy::{DecodePolicy, FailurePolicy};
use crate::clock::Clock;
use crate::codec::Format;
use crate::key::KeyMaker;

/// Everything a cache needs, validated.
#[derive(Debug)]
pub(crate) struct Config {
    pub(crate) backend: Arc<dyn Backend>,
    /// The same store for the async front end: the sync backend itself, called on the task's
    /// thread (memory, custom), or the pipelined engine over the same servers, sharing the sync
    /// backend's health records (memcached). Made at build, unconnected.
    #[cfg(feature = "tokio")]
    pub(crate) async_backend: Arc<dyn crate::backend::AsyncBackend>,
    /// The memcached servers' addresses (`host:port`, as errors name them); empty for the
    /// memory backend and a custom one.
    pub(crate) servers: Vec<String>,
    pub(crate) clock: Arc<dyn Clock>,
    /// The cache's name (metrics' `cache` label, spans' `cache` field).
    pub(crate) name: String,
    pub(crate) keys: KeyMaker,
    pub(crate) format: Format,
    pub(crate) default_ttl: Duration,
    pub(crate) herd_timeout: Duration,
    pub(crate) read_failures: FailurePolicy,
    pub(crate) write_failures: FailurePolicy,
    pub(crate) decode_policy: DecodePolicy,
    pub(crate) lease_ttl: Duration,
    pub(crate) max_wait: Duration,
    pub(crate) max_load_time: Duration,
    pub(crate) early_beta: Option<f64>,
    pub(crate) stale_on_error: Option<Duration>,
    pub(crate) seed: u64,
    /// The near tier, if the builder asked for one.
    pub(crate) near: Option<crate::near::NearSettings>,
    /// How long a write whose outcome is unknown may still take to land (connect and two
    /// I/O timeouts): no near copy is filled from a read of its key sent before then.
    pub(crate) write_settle: Duration,
    /// Whether the store is this cache's alone (the memory backend the builder made): no other
    /// cache's near tier can hold its values, so its writes need no fence unless it has one.
    pub(crate) private_store: bool,
    /// The bus this cache announces its writes on and hears others' on.
    pub(crate) bus: Option<Arc<dyn crate::near::bus::BusTransport>>,
    /// How often its bus thread sends a heartbeat when it sent nothing else.
    pub(crate) bus_heartbeat: Duration,
    /// How long `build` waits for the bus to carry this cache's first message.
    pub(crate) bus_wait: Duration,
    /// Whether `clock` is the builder's own (a caller's clock is read on every near hit; the
    /// system clock is ticked).
    pub(crate) custom_clock: bool,
}
