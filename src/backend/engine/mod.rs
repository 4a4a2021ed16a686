//! The pipelined, auto-batching memcached engine (tokio).
