//! The policies a cache applies: whether a write is herd-protected, and what reads and writes do
//! when the backend fails or the bytes under a key are not what was asked for.

/// Whether a write gets the herd protection (django-newcache's `herd=` argument).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Herd {
    /// Soft expiry at the ttl, hard expiry at ttl + herd timeout; one reader recomputes (default).
    #[default]
    Protected,
    /// No envelope expiry, no padding: the value simply disappears at the ttl, like a plain
    /// memcached `set` (newcache's `herd=False`).
    Off,
}

/// What to do when the backend fails (I/O error, timeout, dead server).
///
/// The read policy covers `get`, `get_many` and the reads of the loader family; the write policy
/// covers `set`, `set_with`, `set_many`, `delete` and `delete_many`. `add`, the counters and
/// `clear` always return backend errors: their answers mean something, and a guess would not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum FailurePolicy {
    /// Return the error to the caller (default for writes).
    Propagate,
    /// Count it in [`Stats::backend_errors_absorbed`](crate::Stats) and carry on: a failed read
    /// is a miss, a failed write is skipped (default for reads: a cache that is down should slow a
    /// web app down to its database's speed, not take it down).
    #[default]
    Absorb,
}

/// What to do with bytes under a key that are not a newcache value of the requested type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum DecodePolicy {
    /// Return a decode error (`Error::is_decode`), leaving the bytes in place (default).
    #[default]
    Error,
    /// Count it in [`Stats::decode_errors`](crate::Stats) and report a miss, so the caller
    /// recomputes and overwrites the key.
    Miss,
}
