//! Redis Cluster (feature `redis`): the sync and async drivers of the cluster's router
//! (`route.rs`: where each command goes, and why), over one single-node view per master. What
//! a user sees (resharding, a master down, a failover, `CLUSTERDOWN`) is in the module docs of
//! `backend::redis`, "Redis Cluster".

use std::sync::Arc;
use std::time::Instant;

use super::conn::Window;
use super::fence::Fence;
use super::route::{Answers, BatchRoute, Map, Next, Node, Route, Router, waves};
use super::{BatchOp, RedisBackend, RedisConfig};
use crate::backend::{Backend, Item, StoreMode, StoreOutcome, Write};
use crate::clock::Clock;
use crate::error::{Error, Result};
use crate::ping::{PingError, PingFailure};

/// A [`Backend`] on a Redis Cluster (feature `redis`): keys routed by hash slot to their
/// master, one single-node view per master.
///
/// Built by [`CacheBuilder::redis_cluster`](crate::CacheBuilder::redis_cluster) (or
/// `RedisCluster::new` with one [`RedisConfig`] per seed); it never connects until the first
/// call, which asks a seed for the slot map (`CLUSTER SLOTS`). Reads and writes go to masters
/// only. The nodes the map names are reached with the first seed's settings (its scheme, user
/// and password, timeouts, limits), their address put in its URL.
pub struct RedisCluster {
    router: Arc<Router>,
}

impl std::fmt::Debug for RedisCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisCluster")
            .field("seeds", &self.router.seeds)
            .finish_non_exhaustive()
    }
}

impl RedisCluster {
    /// Sets up the cluster's views from its seeds (without connecting).
    ///
    /// # Errors
    ///
    /// A configuration error (`is_config()`) for an empty list of seeds, a seed URL with a
    /// database other than 0 (a cluster has only database 0), and whatever
    /// [`RedisBackend::new`] refuses.
    pub fn new(seeds: Vec<RedisConfig>) -> Result<RedisCluster> {
        Ok(RedisCluster {
            router: Router::new(seeds)?,
        })
    }

    /// Puts every node's record of missed invalidations on the cache's clock.
    pub(crate) fn use_clock(&self, clock: Arc<dyn Clock>) {
        self.router.use_clock(clock);
    }

    /// The async view of the same cluster (same nodes, same map).
    #[cfg(feature = "tokio")]
    pub(crate) fn to_async(&self) -> AsyncRedisCluster {
        AsyncRedisCluster {
            router: self.router.clone(),
        }
    }

    /// The map in place, or one asked of the nodes.
    fn map(&self) -> Result<Arc<Map>> {
        match self.router.current() {
            Some(m) => Ok(m),
            None => self.refresh(None, &[], None),
        }
    }

    /// Asks the nodes (`first` first, the nodes of `last` last) for the map until one answers,
    /// every node asked within what is left until `by`, when given (a batch's connect deadline:
    /// [`RedisBackend::slots_by`]).
    fn refresh(&self, first: Option<&str>, last: &[&str], by: Option<Instant>) -> Result<Arc<Map>> {
        let mut answers = Answers::default();
        for node in self.router.candidates(first, last) {
            if let Some(whole) = answers.take(&node, node.sync.slots_by(by)) {
                return self.router.install(whole);
            }
        }
        self.router.settle(answers)
    }

    /// After `MOVED` to `addr`: the whole map again, unless another caller is asking for it.
    fn refresh_after_move(&self, addr: &str, by: Option<Instant>) {
        if let Some(_one) = self.router.claim_refresh() {
            let _ = self.refresh(Some(addr), &[], by);
        }
    }

    /// The slot of `key` and its master, by the map in place or, if that has no master for the
    /// slot, by the map asked again ([`Router::hole_refresh_due`]).
    fn route(&self, key: &str) -> Result<Route> {
        let map = self.map()?;
        if self.router.hole_refresh_due(&map, std::iter::once(key)) {
            return Route::new(&*self.refresh(None, &[], None)?, key);
        }
        Route::new(&map, key)
    }

    /// `op` on `key`'s master, following redirects; sent once to the slot's master in a
    /// refreshed map if its node could not be reached ([`Router::rerouted`]).
    fn one<T>(&self, key: &str, op: impl Fn(&RedisBackend) -> Result<T>) -> Result<T> {
        let mut route = self.route(key)?;
        loop {
            let e = match op(route.node.view(route.asking)) {
                Ok(v) => return Ok(v),
                Err(e) => e,
            };
            match route.told(&self.router, e)? {
                Next::Send => {}
                Next::Moved(addr) => self.refresh_after_move(&addr, None),
                Next::Refresh(e) => {
                    let _ = self.refresh(None, &[route.node.addr()], None);
                    route.rerouted(&self.router, e)?;
                }
            }
        }
    }

    /// `op` on each node's part of a batch, redirected items sent again where they live now:
    /// one result per item. Every node's part is written, then every reply read (each part one
    /// pipelined round trip, the nodes' concurrently: a batch over three masters costs one
    /// round trip, not three), in one window of `io_timeout` ([`Window`]). The nodes' connects
    /// (or checks of pooled connections, every node's written before any is read) share one
    /// `connect_timeout` ([`within`](super::conn::within)), and the nodes that failed one map
    /// refresh ([`BatchRoute::refresh_last`]): a batch over hung masters
    /// lasts about `connect_timeout` + `io_timeout`. A redirect round (the items a `MOVED` or
    /// `ASK` sent elsewhere, or rerouted after a refresh) reads within an `io_timeout` of its
    /// own, and its connects have what the batch's earlier connects left of theirs (the time
    /// spent reading replies is not counted against it). The map refreshes a batch needs (for
    /// slots no node serves, after a `MOVED`, after failures) and a read's second try on a fresh
    /// connection after a stale pooled one connect within that same deadline; the first map
    /// fetch of a cluster with no map yet asks its seeds one by one, each within its own
    /// `connect_timeout`.
    fn many<I: Copy, T>(
        &self,
        items: &[I],
        key: impl Fn(&I) -> &str,
        op: BatchOp<I, T>,
    ) -> Vec<Result<T>> {
        // The connects' deadline: one `connect_timeout` for all of the batch's connects (and
        // checks), moved on by the time its rounds spend reading replies, so a node a redirect
        // names after a slow round still has what the connects before it left.
        let mut by = Instant::now() + self.router.template.connect_timeout;
        let map = match self.map() {
            Ok(map) if self.router.hole_refresh_due(&map, items.iter().map(&key)) => {
                self.refresh(None, &[], Some(by)).unwrap_or(map)
            }
            Ok(map) => map,
            Err(e) => return items.iter().map(|_| Err(e.clone())).collect(),
        };
        let mut batch = BatchRoute::new(&map, items, &key);
        loop {
            for wave in waves(batch.take()) {
                let parts: Vec<Vec<I>> = wave
                    .iter()
                    .map(|(_, _, at)| at.iter().map(|&i| items[i]).collect())
                    .collect();
                // Every node's connection first (a write's check written on each), then every
                // part written: the checks' replies are read after all were asked for.
                let reserved: Vec<_> = wave
                    .iter()
                    .zip(&parts)
                    .map(|((node, asking, _), part)| {
                        node.view(*asking).reserve_batch(part, &op, Some(by))
                    })
                    .collect();
                let sent: Vec<_> = wave
                    .iter()
                    .zip(reserved)
                    .map(|((node, asking, _), r)| {
                        node.view(*asking).begin_reserved_batch(r, Some(by))
                    })
                    .collect();
                let reading = Instant::now();
                let mut window = Window::new(self.router.template.io_timeout, Some(by));
                for (((node, asking, at), part), sent) in wave.iter().zip(&parts).zip(sent) {
                    let results =
                        node.view(*asking)
                            .finish_batch(part, &op, sent, Some(&mut window));
                    batch.judge(&self.router, node, at, results);
                }
                // A read's connect (its pooled connection found closed) spent `by` itself.
                by += reading.elapsed().saturating_sub(window.connecting());
            }
            if let Some(addr) = batch.moved() {
                self.refresh_after_move(addr, Some(by));
            }
            if let Some(last) = batch.refresh_last(&self.router) {
                let _ = self.refresh(None, &last, Some(by));
            }
            if !batch.next(&self.router, items, &key) {
                return batch.finish();
            }
        }
    }
}

/// What `clear` on every master (`results`, in order) reports: `Ok` if each cleared its keys,
/// else the first failure (naming its node), which says how many masters failed, and which.
fn cleared(masters: &[Arc<Node>], results: Vec<Result<()>>) -> Result<()> {
    let failed: Vec<(&str, Error)> = masters
        .iter()
        .zip(results)
        .filter_map(|(n, r)| r.err().map(|e| (n.addr(), e)))
        .collect();
    let Some((_, first)) = failed.first() else {
        return Ok(());
    };
    let names: Vec<&str> = failed.iter().map(|(a, _)| *a).collect();
    Err(first.clone().with_note(&format!(
        "clear() failed on {} of {} redis cluster masters ({}); the others were cleared",
        failed.len(),
        masters.len(),
        names.join(", ")
    )))
}

impl Backend for RedisCluster {
    fn get(&self, key: &str) -> Result<Option<Item>> {
        self.one(key, |n| n.get(key))
    }

    fn get_many(&self, keys: &[&str]) -> Vec<Result<Option<Item>>> {
        self.many(keys, |k| *k, super::gets())
    }

    fn store(&self, w: Write<'_>) -> Result<StoreOutcome> {
        self.one(w.key, |n| n.store(w))
    }

    fn store_then_get(&self, w: Write<'_>) -> Result<(StoreOutcome, Option<Item>)> {
        self.one(w.key, |n| n.store_then_get(w))
    }

    fn store_many(&self, writes: &[Write<'_>]) -> Vec<Result<StoreOutcome>> {
        // Each node's fence learned first (a batch's placeholders are read back; see
        // `Server::needs_fence`). A `cas` goes as a script only to a node known to run
        // scripts; otherwise each write goes on its own, as its node's own store sends it
        // (read and compared, or refused). A node whose probe failed is left to the batch,
        // where it fails within the batch's bounds.
        let scripted = |w: &Write<'_>| {
            let fence = self.route(w.key).and_then(|r| r.node.sync.fence());
            !matches!(w.mode, StoreMode::Cas(_)) || fence.map_or(true, |f| f == Fence::Lua)
        };
        if !writes.iter().all(scripted) {
            return writes.iter().map(|w| self.store(*w)).collect();
        }
        self.many(writes, |w| w.key, super::stores())
    }

    fn delete(&self, key: &str) -> Result<bool> {
        self.one(key, |n| n.delete(key))
    }

    fn delete_many(&self, keys: &[&str]) -> Vec<Result<bool>> {
        self.many(keys, |k| *k, super::deletes())
    }

    fn touch(&self, key: &str, exptime: u32) -> Result<bool> {
        self.one(key, |n| n.touch(key, exptime))
    }

    fn incr(&self, key: &str, delta: u64) -> Result<Option<u64>> {
        self.one(key, |n| n.incr(key, delta))
    }

    fn decr(&self, key: &str, delta: u64) -> Result<Option<u64>> {
        self.one(key, |n| n.decr(key, delta))
    }

    /// Refused, as on one Redis server: the cache's `clear` removes its own keys instead.
    fn flush_all(&self) -> Result<()> {
        Err(super::refuse_flush())
    }

    /// `SCAN`s every master for the cache's keys and removes them; a master that fails is
    /// reported after the others were cleared.
    fn clear(&self, prefix: Option<&str>) -> Result<()> {
        let map = self.map()?;
        let results = map.masters.iter().map(|n| n.sync.clear(prefix)).collect();
        cleared(&map.masters, results)
    }

    fn max_value_size(&self, key: &str) -> usize {
        self.router.max_value_size(key)
    }

    /// The replays of invalidations the nodes missed, summed over every node.
    fn report(&self, stats: &mut crate::Stats) {
        self.router.report(stats);
    }

    /// Asks every master (`PING`), each named in a failure.
    fn ping(&self) -> std::result::Result<(), PingError> {
        let map = match self.map() {
            Ok(m) => m,
            Err(e) => return Err(no_map_ping(&self.router, e)),
        };
        // Every master's `PING` written, then every reply read (address order: see `waves`).
        let mut masters: Vec<&Arc<Node>> = map.masters.iter().collect();
        masters.sort_by(|a, b| a.addr().cmp(b.addr()));
        // Their connects share one connect_timeout, as a batch's do.
        let by = Instant::now() + self.router.template.connect_timeout;
        let sent: Vec<_> = masters
            .iter()
            .map(|n| n.sync.begin_by(Ok(n.sync.shared.requests.ping()), Some(by)))
            .collect();
        let mut window = Window::new(self.router.template.io_timeout, Some(by));
        let failures: Vec<PingFailure> = masters
            .iter()
            .zip(sent)
            .filter_map(|(n, sent)| {
                sent.and_then(|sent| n.sync.finish(sent, Some(&mut window)))
                    .and_then(|()| n.sync.fence())
                    .and_then(|f| n.sync.shared.usable(f))
                    .err()
                    .map(|e| PingFailure::new(n.addr(), e))
            })
            .collect();
        if failures.is_empty() {
            Ok(())
        } else {
            Err(PingError::new(failures, map.masters.len()))
        }
    }
}

/// A ping whose map no node gave: every seed named.
fn no_map_ping(router: &Router, e: Error) -> PingError {
    let failures = router
        .seeds
        .iter()
        .map(|s| PingFailure::new(s.clone(), e.clone()))
        .collect();
    PingError::new(failures, router.seeds.len())
}

#[cfg(feature = "tokio")]
mod nonblocking {
    use std::sync::Arc;

    use super::{Answers, BatchRoute, Map, Next, Route, Router, cleared, no_map_ping};
    use crate::backend::memcached::engine::join_all;
    use crate::backend::{AsyncBackend, BoxFuture, Item, StoreOutcome, Write};
    use crate::error::Result;
    use crate::ping::{PingError, PingFailure};

    /// The async view of a [`RedisCluster`](super::RedisCluster): the same nodes and map, each
    /// node's async view; a batch's nodes asked concurrently.
    pub(crate) struct AsyncRedisCluster {
        pub(super) router: Arc<Router>,
    }

    impl std::fmt::Debug for AsyncRedisCluster {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("AsyncRedisCluster")
                .field("seeds", &self.router.seeds)
                .finish_non_exhaustive()
        }
    }

    /// `$call` (an async view's future, `$n` the view) on `$key`'s master, following
    /// redirects: the sync view's `one`, awaited (a macro: the future borrows a node the loop
    /// owns).
    macro_rules! one {
        ($self:ident, $key:expr, |$n:ident| $call:expr) => {
            Box::pin(async move {
                let mut route = $self.route($key).await?;
                loop {
                    let e = {
                        let $n = route.node.nonblocking(route.asking);
                        match $call.await {
                            Ok(v) => return Ok(v),
                            Err(e) => e,
                        }
                    };
                    match route.told(&$self.router, e)? {
                        Next::Send => {}
                        Next::Moved(addr) => $self.refresh_after_move(&addr).await,
                        Next::Refresh(e) => {
                            let _ = $self.refresh(None, &[route.node.addr()]).await;
                            route.rerouted(&$self.router, e)?;
                        }
                    }
                }
            })
        };
    }

    /// `$call` (`$n` a node's async view, `$part` its items) on each node's part of the batch
    /// `$items`, the nodes concurrently, redirected items sent again: the sync view's `many`.
    macro_rules! many {
        ($self:ident, $items:expr, |$it:ident| $key:expr, |$n:ident, $part:ident| $call:expr) => {
            Box::pin(async move {
                let items = $items;
                let map = match $self.map().await {
                    Ok(map)
                        if $self
                            .router
                            .hole_refresh_due(&map, items.iter().map(|$it| $key)) =>
                    {
                        $self.refresh(None, &[]).await.unwrap_or(map)
                    }
                    Ok(map) => map,
                    Err(e) => return items.iter().map(|_| Err(e.clone())).collect(),
                };
                let mut batch = BatchRoute::new(&map, items, |$it: &_| $key);
                loop {
                    let groups = batch.take();
                    let parts: Vec<Vec<_>> = groups
                        .iter()
                        .map(|(_, _, at)| at.iter().map(|&i| items[i]).collect())
                        .collect();
                    let calls = groups
                        .iter()
                        .zip(&parts)
                        .map(|((node, asking, _), $part)| {
                            let $n = node.nonblocking(*asking);
                            $call
                        })
                        .collect();
                    let answers = join_all(calls).await;
                    for ((node, _, at), results) in groups.iter().zip(answers) {
                        batch.judge(&$self.router, node, at, results);
                    }
                    if let Some(addr) = batch.moved() {
                        $self.refresh_after_move(addr).await;
                    }
                    if let Some(last) = batch.refresh_last(&$self.router) {
                        let _ = $self.refresh(None, &last).await;
                    }
                    if !batch.next(&$self.router, items, |$it: &_| $key) {
                        return batch.finish();
                    }
                }
            })
        };
    }

    impl AsyncRedisCluster {
        async fn map(&self) -> Result<Arc<Map>> {
            match self.router.current() {
                Some(m) => Ok(m),
                None => self.refresh(None, &[]).await,
            }
        }

        /// The sync view's `route`.
        async fn route(&self, key: &str) -> Result<Route> {
            let map = self.map().await?;
            if self.router.hole_refresh_due(&map, std::iter::once(key)) {
                return Route::new(&*self.refresh(None, &[]).await?, key);
            }
            Route::new(&map, key)
        }

        async fn refresh(&self, first: Option<&str>, last: &[&str]) -> Result<Arc<Map>> {
            let mut answers = Answers::default();
            for node in self.router.candidates(first, last) {
                if let Some(whole) = answers.take(&node, node.nonblocking.slots().await) {
                    return self.router.install(whole);
                }
            }
            self.router.settle(answers)
        }

        async fn refresh_after_move(&self, addr: &str) {
            if let Some(_one) = self.router.claim_refresh() {
                let _ = self.refresh(Some(addr), &[]).await;
            }
        }
    }

    impl AsyncBackend for AsyncRedisCluster {
        fn get<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Option<Item>>> {
            one!(self, key, |n| n.get(key))
        }

        fn get_many<'a>(&'a self, keys: &'a [&'a str]) -> BoxFuture<'a, Vec<Result<Option<Item>>>> {
            many!(self, keys, |k| *k, |n, part| n.get_many(part))
        }

        fn store<'a>(&'a self, w: Write<'a>) -> BoxFuture<'a, Result<StoreOutcome>> {
            one!(self, w.key, |n| n.store(w))
        }

        fn store_then_get<'a>(
            &'a self,
            w: Write<'a>,
        ) -> BoxFuture<'a, Result<(StoreOutcome, Option<Item>)>> {
            one!(self, w.key, |n| n.store_then_get(w))
        }

        fn store_many<'a>(
            &'a self,
            writes: &'a [Write<'a>],
        ) -> BoxFuture<'a, Vec<Result<StoreOutcome>>> {
            many!(self, writes, |w| w.key, |n, part| n.store_many(part))
        }

        fn delete<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<bool>> {
            one!(self, key, |n| n.delete(key))
        }

        fn delete_many<'a>(&'a self, keys: &'a [&'a str]) -> BoxFuture<'a, Vec<Result<bool>>> {
            many!(self, keys, |k| *k, |n, part| n.delete_many(part))
        }

        fn touch<'a>(&'a self, key: &'a str, exptime: u32) -> BoxFuture<'a, Result<bool>> {
            one!(self, key, |n| n.touch(key, exptime))
        }

        fn incr<'a>(&'a self, key: &'a str, delta: u64) -> BoxFuture<'a, Result<Option<u64>>> {
            one!(self, key, |n| n.incr(key, delta))
        }

        fn decr<'a>(&'a self, key: &'a str, delta: u64) -> BoxFuture<'a, Result<Option<u64>>> {
            one!(self, key, |n| n.decr(key, delta))
        }

        fn flush_all(&self) -> BoxFuture<'_, Result<()>> {
            Box::pin(async { Err(crate::backend::redis::refuse_flush()) })
        }

        fn clear<'a>(&'a self, prefix: Option<&'a str>) -> BoxFuture<'a, Result<()>> {
            Box::pin(async move {
                let map = self.map().await?;
                let mut results = Vec::with_capacity(map.masters.len());
                for node in &map.masters {
                    results.push(node.nonblocking.clear(prefix).await);
                }
                cleared(&map.masters, results)
            })
        }

        fn max_value_size(&self, key: &str) -> usize {
            self.router.max_value_size(key)
        }

        fn settle_time(&self) -> std::time::Duration {
            self.router.template.settle_time()
        }

        fn ping(&self) -> BoxFuture<'_, std::result::Result<(), PingError>> {
            Box::pin(async move {
                let map = match self.map().await {
                    Ok(m) => m,
                    Err(e) => return Err(no_map_ping(&self.router, e)),
                };
                let pings = map
                    .masters
                    .iter()
                    .map(|n| n.nonblocking.ping_node())
                    .collect();
                let failures: Vec<PingFailure> = join_all(pings)
                    .await
                    .into_iter()
                    .zip(&map.masters)
                    .filter_map(|(r, n)| r.err().map(|e| PingFailure::new(n.addr(), e)))
                    .collect();
                if failures.is_empty() {
                    Ok(())
                } else {
                    Err(PingError::new(failures, map.masters.len()))
                }
            })
        }

        fn shutdown(&self) -> BoxFuture<'_, ()> {
            Box::pin(async move {
                for n in self.router.every_node() {
                    n.nonblocking.shutdown().await;
                }
            })
        }
    }
}

#[cfg(feature = "tokio")]
pub(crate) use self::nonblocking::AsyncRedisCluster;
