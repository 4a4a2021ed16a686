//! What every server has, whichever client speaks to it (memcached's blocking pool and
//! pipelined engine, Redis's sync and async views): its health (`health.rs`: marked dead after
//! `failure_limit` transport faults in a row, probed by one caller every `retry_interval`) and
//! its record of the invalidations it missed while out of reach (`outage.rs`), replayed before
//! it serves again.

pub(crate) mod health;
pub(crate) mod outage;
