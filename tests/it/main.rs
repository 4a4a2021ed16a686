//! newcache's integration tests: one binary, public API only.
//!
//! `behaviour` runs every test on the memory backend and on a real memcached (spawned on a free
//! loopback port); `memcached` covers what needs servers of its own.

mod allocations;
mod async_cache;
mod async_faults;
mod behaviour;
mod bus;
mod bus_losses;
mod cluster;
#[cfg(feature = "redis")]
mod cluster_hung_masters;
mod docs;
mod faults;
mod fixture;
mod front;
mod herd;
mod in_tokio;
#[cfg(feature = "tower")]
mod layer;
mod limits;
mod loader;
mod memcached;
mod memory;
#[cfg(feature = "redis")]
mod messages;
mod near;
mod obs;
mod outage;
mod partial;
mod processes;
mod props;
#[cfg(feature = "redis")]
mod redis;
#[cfg(feature = "redis")]
mod redis_batch;
#[cfg(feature = "redis")]
mod redis_cluster;
#[cfg(feature = "redis")]
mod redis_connect_deadlines;
#[cfg(feature = "redis")]
mod redis_connect_setup;
#[cfg(feature = "redis")]
mod redis_database;
#[cfg(feature = "redis")]
mod redis_maxclients;
#[cfg(feature = "redis")]
mod redis_scripting;
#[cfg(feature = "redis-tls")]
mod redis_tls;
#[cfg(feature = "redis")]
mod redis_wait;
#[global_allocator]
static ALLOCATOR: allocations::Counting = allocations::Counting;

#[path = "../../src/test_support.rs"]
mod test_support;
mod values;
mod views;
