//! The one seam between the facade's logic and I/O. Every operation of the facade (`get`,
//! `set`, `add`, `touch`, the batches, the herd protocol's driver) is written once, as an
//! `async fn` generic over [`Io`]; the sync `Cache` runs it on [`Blocking`] (a sync backend whose
//! futures are ready the moment they are made) with [`ready`], and `AsyncCache` awaits it on its
//! async backend (`async_cache::AsyncDriver`). So the two front ends cannot drift apart, and the sync API never needs a
//! runtime.

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use crate::backend::{Backend, Item, StoreOutcome, Write};
use crate::error::Result;

/// What the facade's logic asks of the world: the backend's operations, and a pause.
pub(crate) trait Io: Sync {
    fn get<'a>(&'a self, key: &'a str) -> impl Future<Output = Result<Option<Item>>> + Send + 'a;
    fn get_many<'a>(
        &'a self,
        keys: &'a [&'a str],
    ) -> impl Future<Output = Vec<Result<Option<Item>>>> + Send + 'a;
    fn store<'a>(&'a self, w: Write<'a>) -> impl Future<Output = Result<StoreOutcome>> + Send + 'a;
    fn store_then_get<'a>(
        &'a self,
        w: Write<'a>,
    ) -> impl Future<Output = Result<(StoreOutcome, Option<Item>)>> + Send + 'a;
    fn store_many<'a>(
        &'a self,
        writes: &'a [Write<'a>],
    ) -> impl Future<Output = Vec<Result<StoreOutcome>>> + Send + 'a;
    fn delete<'a>(&'a self, key: &'a str) -> impl Future<Output = Result<bool>> + Send + 'a;
    fn delete_many<'a>(
        &'a self,
        keys: &'a [&'a str],
    ) -> impl Future<Output = Vec<Result<bool>>> + Send + 'a;
    fn touch<'a>(
        &'a self,
        key: &'a str,
        exptime: u32,
    ) -> impl Future<Output = Result<bool>> + Send + 'a;
    fn incr<'a>(
        &'a self,
        key: &'a str,
        delta: u64,
    ) -> impl Future<Output = Result<Option<u64>>> + Send + 'a;
    fn decr<'a>(
        &'a self,
        key: &'a str,
        delta: u64,
    ) -> impl Future<Output = Result<Option<u64>>> + Send + 'a;
    fn clear<'a>(&'a self, prefix: Option<&'a str>)
    -> impl Future<Output = Result<()>> + Send + 'a;
    fn max_value_size(&self, key: &str) -> usize;
    /// Armed while claims (derived key, token) are being written: if the future is dropped
    /// before their outcome is known, the claims that landed are given back (the async front
    /// end does it from a spawned task; a sync call cannot be dropped midway).
    type ClaimGuard: Disarm;
    fn guard_claims(&self, claims: Vec<(String, u64)>) -> Self::ClaimGuard;
    /// A pause between polls of another caller's load.
    fn sleep<'a>(&'a self, d: Duration) -> impl Future<Output = ()> + Send + 'a;
    /// A point where a task that answered without I/O (a near hit) gives its runtime a
    /// chance to run others once it has used its budget; nothing for a sync caller.
    fn cooperate(&self) -> impl Future<Output = ()> + Send + '_;
}

/// A sync backend: each call does its (blocking) work when the future is made, which is then
/// ready. Only [`ready`] polls these.
#[derive(Clone, Copy)]
pub(crate) struct Blocking<'a>(pub(crate) &'a dyn Backend);

/// A [`Io::ClaimGuard`]: `disarm` once the claims' outcome is known.
pub(crate) trait Disarm {
    fn disarm(self);
}

/// The sync front end's guard: nothing to do.
pub(crate) struct NoGuard;

impl Disarm for NoGuard {
    fn disarm(self) {}
}

impl Io for Blocking<'_> {
    type ClaimGuard = NoGuard;
    fn guard_claims(&self, _: Vec<(String, u64)>) -> NoGuard {
        NoGuard
    }
    fn get<'a>(&'a self, key: &'a str) -> impl Future<Output = Result<Option<Item>>> + Send + 'a {
        std::future::ready(self.0.get(key))
    }
    fn get_many<'a>(
        &'a self,
        keys: &'a [&'a str],
    ) -> impl Future<Output = Vec<Result<Option<Item>>>> + Send + 'a {
        std::future::ready(self.0.get_many(keys))
    }
    fn store<'a>(&'a self, w: Write<'a>) -> impl Future<Output = Result<StoreOutcome>> + Send + 'a {
        std::future::ready(self.0.store(w))
    }
    fn store_then_get<'a>(
        &'a self,
        w: Write<'a>,
    ) -> impl Future<Output = Result<(StoreOutcome, Option<Item>)>> + Send + 'a {
        std::future::ready(self.0.store_then_get(w))
    }
    fn store_many<'a>(
        &'a self,
        writes: &'a [Write<'a>],
    ) -> impl Future<Output = Vec<Result<StoreOutcome>>> + Send + 'a {
        std::future::ready(self.0.store_many(writes))
    }
    fn delete<'a>(&'a self, key: &'a str) -> impl Future<Output = Result<bool>> + Send + 'a {
        std::future::ready(self.0.delete(key))
    }
    fn delete_many<'a>(
        &'a self,
        keys: &'a [&'a str],
    ) -> impl Future<Output = Vec<Result<bool>>> + Send + 'a {
        std::future::ready(self.0.delete_many(keys))
    }
    fn touch<'a>(
        &'a self,
        key: &'a str,
        exptime: u32,
    ) -> impl Future<Output = Result<bool>> + Send + 'a {
        std::future::ready(self.0.touch(key, exptime))
    }
    fn incr<'a>(
        &'a self,
        key: &'a str,
        delta: u64,
    ) -> impl Future<Output = Result<Option<u64>>> + Send + 'a {
        std::future::ready(self.0.incr(key, delta))
    }
    fn decr<'a>(
        &'a self,
        key: &'a str,
        delta: u64,
    ) -> impl Future<Output = Result<Option<u64>>> + Send + 'a {
        std::future::ready(self.0.decr(key, delta))
    }
    fn clear<'a>(
        &'a self,
        prefix: Option<&'a str>,
    ) -> impl Future<Output = Result<()>> + Send + 'a {
        std::future::ready(self.0.clear(prefix))
    }
    fn max_value_size(&self, key: &str) -> usize {
        self.0.max_value_size(key)
    }
    fn sleep<'a>(&'a self, d: Duration) -> impl Future<Output = ()> + Send + 'a {
        std::thread::sleep(d);
        std::future::ready(())
    }
    fn cooperate(&self) -> impl Future<Output = ()> + Send + '_ {
        std::future::ready(())
    }
}

/// Runs a future built on [`Blocking`] to its end on the calling thread: every backend call in
/// it completed when it was made, so it finishes in one poll, without a runtime.
pub(crate) fn ready<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        // Only Blocking's futures are run here, and each is ready when made.
        Poll::Pending => unreachable!("a sync Cache operation awaited something not ready"),
    }
}
