//! What the loader needs beyond the backend's operations, for each front end: holding a claim
//! while a loader runs (renewed by the sync renewal thread, or inside an async caller's future),
//! waiting for an in-process leader, and storing loaded values against claims. The loader's
//! logic (`loader/mod.rs`, `loader/batch.rs`) is written once, generic over a [`Driver`].

use std::collections::HashMap;
use std::future::Future;
use std::time::Instant;

use super::coalesce::{InFlight, Leading, Outcome};
use super::lease::{BlockingLease, Completed};
use crate::cache::Cache;
use crate::cache::io::{Blocking, Io};
use crate::error::Result;
use crate::protocol::Claim;

/// A front end's way of running loads: the backend's operations ([`Io`]) plus claims and
/// waits.
pub(crate) trait Driver: Io {
    /// A claim kept while a loader runs.
    type Lease: LeaseHandle;
    /// Keeps `claim` on `derived` until its lease is completed or dropped (dropped: released).
    fn hold(&self, cache: &Cache, derived: &str, claim: Claim) -> Self::Lease;
    /// What this caller is if it leads a coalesced call.
    fn leading(&self) -> Leading;
    /// Whether this caller may wait for `call`'s leader without keeping it from finishing.
    fn may_wait_for(&self, call: &InFlight) -> bool;
    /// Waits for an in-process leader's outcome, up to `deadline`.
    fn wait_for(&self, call: &InFlight, deadline: Instant) -> impl Future<Output = Outcome> + Send;
    /// Runs `work` (a batch's loader) while every claim in `held` is kept alive.
    fn renewing_all<F: Future>(
        &self,
        held: &mut HashMap<String, Self::Lease>,
        work: F,
    ) -> impl Future<Output = F::Output>;
    /// Stores several loads' values against their claims, one round trip per server.
    fn complete_many(
        &self,
        batch: Vec<(Self::Lease, Vec<u8>, u32)>,
    ) -> impl Future<Output = Vec<Result<Completed>>> + Send;
}

/// A front end's lease: a [`Claim`] kept alive while a loader runs (by the renewal thread:
/// `BlockingLease`; inside the caller's future: `AsyncLease`), then completed or given back.
pub(crate) trait LeaseHandle: Send + Sized {
    /// The derived key claimed.
    fn key(&self) -> &str;
    /// Whether the claim holds a value other readers are served meanwhile
    /// ([`Claim::serves_others`]).
    fn serves_others(&self, now_ms: u64, kept_ms: u64) -> bool;
    /// Runs `work` (the loader) while the claim is kept alive.
    fn renewing<F: Future>(&mut self, work: F) -> impl Future<Output = F::Output>;
    /// Stores the loaded value with `cas` against the claim.
    fn complete(self, value: &[u8], exptime: u32)
    -> impl Future<Output = Result<Completed>> + Send;
}

/// The sync front end: claims are renewed by the cache's renewal thread, waits block the
/// calling thread.
impl Driver for Blocking<'_> {
    type Lease = BlockingLease;

    fn hold(&self, cache: &Cache, derived: &str, claim: Claim) -> BlockingLease {
        cache.inner.renewer.hold(derived, claim)
    }

    fn leading(&self) -> Leading {
        Leading::Thread
    }

    /// A sync leader runs on its own thread: always. A task's load needs its runtime's threads,
    /// and this wait blocks the caller's: only on a thread outside every runtime's context
    /// (none of a task, `block_in_place` or `spawn_blocking`, where no runtime can need it),
    /// and not the thread the task took the lead on (a current-thread runtime's, between two
    /// `block_on`s). Inside a context this thread may be the one the task needs (a worker, a
    /// current-thread runtime's own; even the task itself, `join!`ed with this call), and tokio
    /// says not which: so it never waits there.
    fn may_wait_for(&self, call: &InFlight) -> bool {
        match call.leading {
            Leading::Thread => true,
            #[cfg(feature = "tokio")]
            Leading::Task(thread) => {
                thread != std::thread::current().id()
                    && tokio::runtime::Handle::try_current().is_err()
            }
        }
    }

    fn wait_for(&self, call: &InFlight, deadline: Instant) -> impl Future<Output = Outcome> + Send {
        std::future::ready(call.wait(deadline))
    }

    fn renewing_all<F: Future>(
        &self,
        _: &mut HashMap<String, BlockingLease>,
        work: F,
    ) -> impl Future<Output = F::Output> {
        // The renewal thread keeps the claims alive meanwhile.
        work
    }

    fn complete_many(
        &self,
        batch: Vec<(BlockingLease, Vec<u8>, u32)>,
    ) -> impl Future<Output = Vec<Result<Completed>>> + Send {
        std::future::ready(BlockingLease::complete_many(self.0, batch))
    }
}

impl LeaseHandle for BlockingLease {
    fn key(&self) -> &str {
        BlockingLease::key(self)
    }

    fn serves_others(&self, now_ms: u64, kept_ms: u64) -> bool {
        BlockingLease::serves_others(self, now_ms, kept_ms)
    }

    fn renewing<F: Future>(&mut self, work: F) -> impl Future<Output = F::Output> {
        // The renewal thread keeps the claim alive meanwhile.
        work
    }

    fn complete(
        self,
        value: &[u8],
        exptime: u32,
    ) -> impl Future<Output = Result<Completed>> + Send {
        std::future::ready(BlockingLease::complete(self, value, exptime))
    }
}
