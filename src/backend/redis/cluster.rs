//! Redis Cluster (feature `redis`): a router over one single-node view per master.
//! What a user sees (resharding, a master down, a failover, `CLUSTERDOWN`) is in the
//! module docs of `backend::redis`, "Redis Cluster"; this says how it is done.
//!
//! Each master the slot map names is reached through a [`RedisBackend`] of its own (and its
//! async view), with its own `Shared`: its own health record, replay record of missed
//! invalidations and connections, so a node down costs only its slots' keys, and nothing of
//! the herd protocol, the health rules or the stored format is written twice. Every claim,
//! placeholder and fenced store touches one key, so each runs on one node as it is.
//!
//! The slot map comes from `CLUSTER SLOTS`, asked of the seeds on first use. A `MOVED` reply
//! (nothing was run) patches the map, sends the command again to the node it names and
//! refreshes the whole map; an `ASK` reply sends `ASKING` and the command to the node it names,
//! once, the map unchanged. A node's transport fault, `CLUSTERDOWN` or `TRYAGAIN` refreshes
//! the map at most once per `retry_interval` for the whole cluster (a failover changes it; a
//! node wiped and started again at its master's address answers `CLUSTERDOWN` for every key
//! and never redirects), and so does a key whose slot the map has no master for (no node can
//! redirect it: nothing is sent); a call of which nothing ran (its node's connect refused or
//! timed out, the node marked dead, a `CLUSTERDOWN`) goes once to its slot's master in the
//! refreshed map, if that is another node. A refresh takes the first whole map a node gives
//! (every slot has a master); a map with a hole only if no node gives a whole one and the map
//! in place has a hole too. A node is known by its node id: another id at a known address is
//! a new node, with views of its own. A batch is split by node; each node's
//! part is the single-node batch's request (one command per key on a cluster node), every
//! node's written, then every reply read; its redirected keys are sent again where they now
//! live; a node's failure fails only its own keys.
//!
//! A node's error replies are answers, per key: `CLUSTERDOWN` (the key's slot unserved, or
//! the whole cluster down) fails the keys it names, unless the refreshed map sends them
//! elsewhere, and marks no node dead; refused because the whole cluster is down, a write is
//! queued for the node's replay (`request::not_serving_yet`). `TRYAGAIN` should never come:
//! it answers a multi-key command whose keys a migration split, and no command sent to a
//! cluster node names two keys; it is taken as `CLUSTERDOWN` is.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Instant;

use parking_lot::{Mutex, RwLock};
use smallvec::{SmallVec, smallvec};

use super::RedisConfig;
use super::config::redacted;
use super::conn::Window;
use super::fence::Fence;
use super::slots::{self, Redirect};
use super::{BatchOp, RedisBackend};
use crate::backend::memcached::health::Health;
use crate::backend::memcached::outage;
use crate::backend::{Backend, Item, StoreMode, StoreOutcome, Write};
use crate::clock::Clock;
use crate::error::{Error, Result};
use crate::ping::{PingError, PingFailure};

/// How many redirects one command follows before it fails (a slot moved on while it was sent
/// again: a resharding in progress).
const MAX_REDIRECTS: usize = 5;

/// No master serves this slot.
const NONE: u16 = u16::MAX;

/// One master's views: sync and async, each also as an asking view (same connections).
struct Node {
    /// Its node id, once a slot map named it: a node at the same address with another id is
    /// another node (its disk wiped, started again), reached through views of its own.
    id: OnceLock<String>,
    sync: RedisBackend,
    sync_asking: RedisBackend,
    #[cfg(feature = "tokio")]
    nonblocking: super::nonblocking::AsyncRedis,
    #[cfg(feature = "tokio")]
    nonblocking_asking: super::nonblocking::AsyncRedis,
}

impl Node {
    fn addr(&self) -> &str {
        self.sync.addr()
    }

    /// The sync view, or its asking view.
    fn view(&self, asking: bool) -> &RedisBackend {
        if asking {
            &self.sync_asking
        } else {
            &self.sync
        }
    }

    fn health(&self) -> &Arc<Health> {
        self.sync.health()
    }
}

/// Which master serves each slot.
struct Map {
    /// Per slot, the index of its master in `masters` (or [`NONE`]).
    slots: Vec<u16>,
    masters: Vec<Arc<Node>>,
    /// Whether every slot has a master (a map with a hole is asked again when a key falls in
    /// it: see [`Router::refresh_due`]; a whole map is never replaced by one with a hole:
    /// see [`Answers`]).
    whole: bool,
}

impl Map {
    fn new(slots: Vec<u16>, masters: Vec<Arc<Node>>) -> Map {
        let whole = !slots.contains(&NONE);
        Map {
            slots,
            masters,
            whole,
        }
    }

    /// Whether a key of `keys` falls in a slot no master serves.
    fn misses<'k>(&self, mut keys: impl Iterator<Item = &'k str>) -> bool {
        !self.whole && keys.any(|k| self.node_of(slots::slot_of(k.as_bytes())).is_none())
    }

    fn node_of(&self, slot: u16) -> Option<&Arc<Node>> {
        self.master_of(slot).map(|i| &self.masters[i])
    }

    /// The place in `masters` of `slot`'s master.
    fn master_of(&self, slot: u16) -> Option<usize> {
        match self.slots[slot as usize] {
            NONE => None,
            i => ((i as usize) < self.masters.len()).then_some(i as usize),
        }
    }
}

/// What the sync and async views of one cluster share: the nodes met so far (each kept, with
/// its health and replay record, for the life of the cache) and the slot map.
struct Router {
    /// The first seed's settings: every node's, its address put in the URL.
    template: RedisConfig,
    /// The seeds' `host:port`.
    seeds: Vec<String>,
    /// The node at each address now.
    nodes: Mutex<HashMap<String, Arc<Node>>>,
    /// The nodes replaced at their address by a node of another id, kept for the counts of
    /// their replays ([`Router::report`]) and their shutdown.
    retired: Mutex<Vec<Arc<Node>>>,
    map: RwLock<Option<Arc<Map>>>,
    /// Set while a caller refreshes the map after a `MOVED` (the others go on with the patched
    /// map rather than ask too).
    refreshing: AtomicBool,
    /// When a node's fault or a key in a slot the map has no master for last refreshed it.
    asked: Mutex<Option<Instant>>,
    /// The cache's clock, for every node's replay record.
    clock: Mutex<Option<Arc<dyn Clock>>>,
    /// This router, for its nodes' replays to reach the others' records ([`Router::link`]).
    this: OnceLock<Weak<Router>>,
}

/// The URL of the node at `addr`: `template`'s, its `host:port` replaced (scheme, user and
/// password kept).
fn node_url(template: &str, addr: &str) -> String {
    let (scheme, rest) = template.split_once("://").unwrap_or(("redis", template));
    let (userinfo, hostpart) = match rest.rsplit_once('@') {
        Some((info, host)) => (Some(info), host),
        None => (None, rest),
    };
    let tail = hostpart
        .find(['/', '?', '#'])
        .map_or("", |i| &hostpart[i..]);
    match userinfo {
        Some(info) => format!("{scheme}://{info}@{addr}{tail}"),
        None => format!("{scheme}://{addr}{tail}"),
    }
}

/// The redirect `e` reports, if it is one (`MOVED`, `ASK`).
fn redirect_of(e: &Error) -> Option<Redirect> {
    let r = super::redis_cause(e)?;
    slots::redirect(r.code()?, r.detail())
}

/// Whether `e` may mean the node is gone (a transport fault, a dead node): not an answer (an
/// error reply, a denial, a `WAIT` short of replicas).
fn is_fault(e: &Error) -> bool {
    (e.is_backend() || e.is_timeout())
        && !e.is_denied()
        && super::request::refusal_code(e).is_none()
        && !super::request::is_wait_failure(e)
}

/// Whether `e` is a node's `CLUSTERDOWN` or `TRYAGAIN`: the node ran nothing, and the map may
/// name it for slots it no longer serves (a node wiped and started again at a master's
/// address serves none, knows no cluster and so never redirects: only the other nodes know
/// where its slots went).
fn is_cluster_refusal(e: &Error) -> bool {
    matches!(
        super::request::refusal_code(e),
        Some("CLUSTERDOWN" | "TRYAGAIN")
    )
}

/// Whether `e` from a node is to make the map asked again ([`Router::refresh_due`] permitting):
/// a fault (a failover changes the map) or a cluster's refusal.
fn map_suspect(e: &Error) -> bool {
    is_fault(e) || is_cluster_refusal(e)
}

/// Whether a call that failed with `e` may go to another node: nothing of it ran on this one
/// (never sent, [`Error::unsent`]), or the cluster refused it (`CLUSTERDOWN`, `TRYAGAIN`: a
/// command so refused ran nothing). Of a pipelined write and its read-back, a refused write
/// is the call's error; a write that ran before its read-back was refused (the cluster's state
/// changing between the two) is sent again as the same bytes, stamp included: written twice,
/// it is the same item.
fn resendable(e: &Error) -> bool {
    (e.is_unsent() && is_fault(e)) || is_cluster_refusal(e)
}

/// The error of a key whose slot no master serves (a map not known yet, or a cluster missing
/// slots).
fn unserved(slot: u16) -> Error {
    Error::backend(format!(
        "no redis cluster master serves slot {slot} (the slot map has no node for it)"
    ))
}

fn too_many_redirects() -> Error {
    Error::backend(format!(
        "redis cluster: still redirected after {MAX_REDIRECTS} redirects (a resharding in \
         progress)"
    ))
}

impl Router {
    fn new(configs: Vec<RedisConfig>) -> Result<Router> {
        let Some(template) = configs.first().cloned() else {
            return Err(Error::config(
                "a redis cluster needs at least one seed URL (redis://host:port)",
            ));
        };
        let mut seeds = Vec::with_capacity(configs.len());
        let mut nodes = HashMap::new();
        for c in configs {
            let client = c.client()?;
            let db = client.get_connection_info().redis_settings().db();
            if db != 0 {
                return Err(Error::config(format!(
                    "redis cluster seed {}: database {db}, but a Redis Cluster has database 0 \
                     only (drop the /{db} from the URL)",
                    redacted(&c.url)
                )));
            }
            let addr = c.addr();
            if !nodes.contains_key(&addr) {
                nodes.insert(addr.clone(), Arc::new(Router::make_node(c)?));
                seeds.push(addr);
            }
        }
        Ok(Router {
            template,
            seeds,
            nodes: Mutex::new(nodes),
            retired: Mutex::new(Vec::new()),
            map: RwLock::new(None),
            refreshing: AtomicBool::new(false),
            asked: Mutex::new(None),
            clock: Mutex::new(None),
            this: OnceLock::new(),
        })
    }

    fn make_node(config: RedisConfig) -> Result<Node> {
        let sync = RedisBackend::node(config)?;
        #[cfg(feature = "tokio")]
        let nonblocking = super::nonblocking::AsyncRedis::new(sync.shared())?;
        Ok(Node {
            id: OnceLock::new(),
            #[cfg(feature = "tokio")]
            nonblocking_asking: nonblocking.asking(),
            #[cfg(feature = "tokio")]
            nonblocking,
            sync_asking: sync.asking(),
            sync,
        })
    }

    /// The node at `addr` now (met before, or a new one on the template's settings).
    fn node(&self, addr: &str) -> Result<Arc<Node>> {
        self.node_named(addr, None)
    }

    /// The node at `addr` whose node id is `id` (when known): the one met there before,
    /// unless a map named that one with another id. A node wiped and started again at an old
    /// address is a new node: new connections, its own health and replay record (the old
    /// one's missed keys belong to slots served elsewhere now); the old node is retired.
    fn node_named(&self, addr: &str, id: Option<&str>) -> Result<Arc<Node>> {
        let mut nodes = self.nodes.lock();
        if let Some(n) = nodes.get(addr) {
            // Ids are set under the `nodes` lock: the first map that names a node names it.
            let same = match (id, n.id.get()) {
                (Some(id), Some(known)) => id == known,
                (Some(id), None) => n.id.set(id.to_owned()).is_ok(),
                (None, _) => true,
            };
            if same {
                return Ok(n.clone());
            }
        }
        let mut config = self.template.clone();
        config.url = node_url(&self.template.url, addr);
        let node = Arc::new(Router::make_node(config)?);
        if let Some(id) = id {
            let _ = node.id.set(id.to_owned());
        }
        if let Some(clock) = &*self.clock.lock() {
            node.health().missed.use_clock(clock.clone());
        }
        self.link(&node);
        if let Some(old) = nodes.insert(addr.to_owned(), node.clone()) {
            self.retired.lock().push(old);
        }
        Ok(node)
    }

    /// Lets `node`'s replay hand a delete another node is named for (`MOVED`, `ASK`: the
    /// key's slot moved on since the delete was missed) to that node's record of missed
    /// invalidations, so that its next call deletes the key there before anything else.
    fn link(&self, node: &Node) {
        let Some(this) = self.this.get().cloned() else {
            return;
        };
        node.sync.use_peers(move |addr| {
            let node = this.upgrade()?.node(addr).ok()?;
            Some(node.health().clone())
        });
    }

    fn current(&self) -> Option<Arc<Map>> {
        self.map.read().clone()
    }

    /// Puts the map of `ranges` in place.
    fn install(&self, ranges: Vec<slots::Range>) -> Result<Arc<Map>> {
        let mut slots = vec![NONE; slots::SLOTS];
        let mut masters: Vec<Arc<Node>> = Vec::new();
        for r in ranges {
            let i = match masters.iter().position(|m| m.addr() == r.addr) {
                Some(i) => i,
                None => {
                    masters.push(self.node_named(&r.addr, r.id.as_deref())?);
                    masters.len() - 1
                }
            };
            let i = u16::try_from(i).map_err(|_| Error::backend("too many cluster masters"))?;
            slots[r.first as usize..=r.last as usize].fill(i);
        }
        let map = Arc::new(Map::new(slots, masters));
        *self.map.write() = Some(map.clone());
        Ok(map)
    }

    /// A `MOVED`: `slot` is served at `addr` now; the node to send the command to.
    fn patch(&self, slot: u16, addr: &str) -> Result<Arc<Node>> {
        let node = self.node(addr)?;
        let mut map = self.map.write();
        let (mut slots, mut masters) = match &*map {
            Some(m) => (m.slots.clone(), m.masters.clone()),
            None => (vec![NONE; slots::SLOTS], Vec::new()),
        };
        let i = match masters.iter().position(|m| m.addr() == addr) {
            Some(i) => i,
            None => {
                masters.push(node.clone());
                masters.len() - 1
            }
        };
        slots[slot as usize] = u16::try_from(i).unwrap_or(NONE);
        *map = Some(Arc::new(Map::new(slots, masters)));
        Ok(node)
    }

    /// The nodes to ask for the map, in order: `first`, the masters, the seeds (each once),
    /// `last` at the end (nodes that just failed).
    fn candidates(&self, first: Option<&str>, last: &[&str]) -> Vec<Arc<Node>> {
        let mut addrs: Vec<String> = first.into_iter().map(str::to_owned).collect();
        if let Some(m) = self.current() {
            addrs.extend(m.masters.iter().map(|n| n.addr().to_owned()));
        }
        addrs.extend(self.seeds.iter().cloned());
        let mut seen = std::collections::HashSet::new();
        addrs.retain(|a| !last.contains(&a.as_str()) && seen.insert(a.clone()));
        addrs.extend(last.iter().map(|a| (*a).to_owned()));
        addrs.iter().filter_map(|a| self.node(a).ok()).collect()
    }

    /// Where a call that failed with `e` on `node` for a key of `slot` goes instead: the slot's
    /// master in the map now, if nothing of the call ran on `node` ([`resendable`]: a connect
    /// that failed, a node marked dead, a `CLUSTERDOWN`: safe to send elsewhere, a write
    /// included) and that master is another node (the map was refreshed after a failover).
    fn rerouted(&self, node: &Arc<Node>, slot: u16, e: &Error) -> Option<Arc<Node>> {
        if !resendable(e) {
            return None;
        }
        let map = self.current()?;
        map.node_of(slot).filter(|n| !Arc::ptr_eq(n, node)).cloned()
    }

    /// Whether a node's fault, or a key whose slot the map has no master for, is to refresh
    /// the map now (at most once per `retry_interval`): a failover changes the map, and a slot
    /// unserved when the map was asked (a cluster being created, a slot being assigned) may be
    /// served now, though no node will say so (nothing is sent for its keys: no `MOVED`).
    fn refresh_due(&self) -> bool {
        let mut last = self.asked.lock();
        let now = Instant::now();
        match *last {
            Some(t) if now.duration_since(t) < self.template.retry_interval => false,
            _ => {
                *last = Some(now);
                true
            }
        }
    }

    /// Whether `map` is to be asked again before `keys` are routed by it: one of them falls in
    /// a slot it has no master for, and a refresh is due ([`refresh_due`](Router::refresh_due)).
    fn hole_refresh_due<'k>(&self, map: &Map, keys: impl Iterator<Item = &'k str>) -> bool {
        map.misses(keys) && self.refresh_due()
    }

    /// Claims the one refresh after a `MOVED` (`None` if another caller is doing it).
    fn claim_refresh(&self) -> Option<RefreshGuard<'_>> {
        (!self.refreshing.swap(true, Ordering::AcqRel)).then_some(RefreshGuard(self))
    }

    /// The slot of `key`, and its master in `map`.
    fn route(map: &Map, key: &str) -> Result<(u16, Arc<Node>)> {
        let slot = slots::slot_of(key.as_bytes());
        map.node_of(slot)
            .cloned()
            .map(|n| (slot, n))
            .ok_or_else(|| unserved(slot))
    }

    fn use_clock(&self, clock: Arc<dyn Clock>) {
        for n in self.nodes.lock().values() {
            n.health().missed.use_clock(clock.clone());
        }
        *self.clock.lock() = Some(clock);
    }

    fn max_value_size(&self, key: &str) -> usize {
        crate::backend::max_value_size(self.template.item_size, key)
    }

    fn report(&self, stats: &mut crate::Stats) {
        let nodes = self.nodes.lock();
        let retired = self.retired.lock();
        outage::report(
            nodes
                .values()
                .chain(retired.iter())
                .map(|n| &n.health().missed),
            stats,
        );
    }

    /// Every node met, retired ones too.
    #[cfg(feature = "tokio")]
    fn every_node(&self) -> Vec<Arc<Node>> {
        let mut all: Vec<Arc<Node>> = self.nodes.lock().values().cloned().collect();
        all.extend(self.retired.lock().iter().cloned());
        all
    }

    /// After every node was asked and none gave a whole map: the fullest map with a hole,
    /// unless the map in place is whole (kept: nodes that serve no slot or miss some never
    /// replace a map that serves every slot); else the last error.
    fn settle(&self, answers: Answers) -> Result<Arc<Map>> {
        let Some((_, ranges)) = answers.partial else {
            return Err(answers.errors.into_iter().last().unwrap_or_else(|| {
                Error::backend("no redis cluster node to ask for the slot map")
            }));
        };
        match self.current() {
            Some(map) if map.whole => Ok(map),
            _ => self.install(ranges),
        }
    }
}

/// The answers of one refresh's nodes, asked in turn: the first whole map (every slot has a
/// master) is put in place at once; failing one, [`Router::settle`] decides.
#[derive(Default)]
struct Answers {
    /// The ranges of the fullest map with a hole so far, and how many slots they cover.
    partial: Option<(usize, Vec<slots::Range>)>,
    errors: Vec<Error>,
}

impl Answers {
    /// Takes `node`'s answer: the ranges of a whole map, to put in place.
    fn take(
        &mut self,
        node: &Node,
        answer: Result<Vec<slots::Range>>,
    ) -> Option<Vec<slots::Range>> {
        let ranges = match answer {
            Ok(ranges) => ranges,
            Err(e) => {
                self.errors.push(e);
                return None;
            }
        };
        let mut served = vec![false; slots::SLOTS];
        for r in &ranges {
            served[r.first as usize..=r.last as usize].fill(true);
        }
        let covered = served.iter().filter(|&&s| s).count();
        if covered == slots::SLOTS {
            return Some(ranges);
        }
        if covered == 0 {
            // A node of no cluster yet, or one wiped and started again.
            self.errors.push(Error::backend(format!(
                "redis at {} serves no slots (not a cluster node yet?)",
                node.addr()
            )));
        } else if self.partial.as_ref().is_none_or(|(c, _)| covered > *c) {
            self.partial = Some((covered, ranges));
        }
        None
    }
}

/// Releases the refresh claim on drop.
struct RefreshGuard<'a>(&'a Router);

impl Drop for RefreshGuard<'_> {
    fn drop(&mut self) {
        self.0.refreshing.store(false, Ordering::Release);
    }
}

/// Where one item of a batch goes next.
struct Hop {
    /// Its position in the batch.
    at: usize,
    node: Arc<Node>,
    asking: bool,
}

/// A batch's items on one node: the node, whether through its asking view, their positions.
type Group = (Arc<Node>, bool, Vec<usize>);

/// The items of a batch grouped by node and view (in order of first appearance).
fn group(hops: Vec<Hop>) -> Vec<Group> {
    let mut groups: Vec<Group> = Vec::new();
    for h in hops {
        match groups
            .iter_mut()
            .find(|(n, a, _)| Arc::ptr_eq(n, &h.node) && *a == h.asking)
        {
            Some((_, _, at)) => at.push(h.at),
            None => groups.push((h.node, h.asking, vec![h.at])),
        }
    }
    groups
}

/// `groups` in waves, each naming a node once (a node's asking view after its plain one, as
/// both take connections of one pool), each wave's nodes in address order (two batches
/// checking out connections of full pools cannot wait for each other in a cycle).
fn waves(groups: Vec<Group>) -> Vec<Vec<Group>> {
    let mut waves: Vec<Vec<Group>> = Vec::new();
    for g in groups {
        match waves
            .iter_mut()
            .find(|w| !w.iter().any(|(n, _, _)| Arc::ptr_eq(n, &g.0)))
        {
            Some(w) => w.push(g),
            None => waves.push(vec![g]),
        }
    }
    for w in &mut waves {
        w.sort_by(|a, b| a.0.addr().cmp(b.0.addr()));
    }
    waves
}

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
        let router = Arc::new(Router::new(seeds)?);
        let _ = router.this.set(Arc::downgrade(&router));
        for node in router.nodes.lock().values() {
            router.link(node);
        }
        Ok(RedisCluster { router })
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
            None => self.refresh(None, None),
        }
    }

    /// Asks the nodes (`first` first, `last` last) for the map until one answers.
    fn refresh(&self, first: Option<&str>, last: Option<&str>) -> Result<Arc<Map>> {
        self.refresh_by(first, last.as_slice(), None)
    }

    /// [`refresh`](RedisCluster::refresh) (the nodes of `last` last), every node asked within
    /// what is left until `by`, when given (a batch's connect deadline: [`RedisBackend::slots_by`]).
    fn refresh_by(
        &self,
        first: Option<&str>,
        last: &[&str],
        by: Option<Instant>,
    ) -> Result<Arc<Map>> {
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
            let _ = self.refresh_by(Some(addr), &[], by);
        }
    }

    /// After `e` from `node`: the map again if it was a fault or a cluster's refusal (at most
    /// once per `retry_interval`: [`map_suspect`]).
    fn after_failure(&self, node: &Node, e: &Error) {
        if map_suspect(e) && self.router.refresh_due() {
            let _ = self.refresh(None, Some(node.addr()));
        }
    }

    /// After a batch's round in which the nodes of `failed` failed: the map again if one of
    /// them met a fault or a cluster's refusal (at most once per `retry_interval`), one refresh
    /// for them all, which asks them last (a hung master is asked only if every other node
    /// failed too).
    fn after_failures(&self, failed: &[(Arc<Node>, Error)], by: Instant) {
        if failed.iter().any(|(_, e)| map_suspect(e)) && self.router.refresh_due() {
            let last: Vec<&str> = failed.iter().map(|(n, _)| n.addr()).collect();
            let _ = self.refresh_by(None, &last, Some(by));
        }
    }

    /// The slot of `key` and its master, by the map in place or, if that has no master for the
    /// slot, by the map asked again ([`Router::hole_refresh_due`]).
    fn route(&self, key: &str) -> Result<(u16, Arc<Node>)> {
        let map = self.map()?;
        if self.router.hole_refresh_due(&map, std::iter::once(key)) {
            return Router::route(&*self.refresh(None, None)?, key);
        }
        Router::route(&map, key)
    }

    /// `op` on `key`'s master, following redirects; sent once to the slot's master in a
    /// refreshed map if its node could not be reached ([`Router::rerouted`]).
    fn one<T>(&self, key: &str, op: impl Fn(&RedisBackend) -> Result<T>) -> Result<T> {
        let (slot, mut node) = self.route(key)?;
        let mut asking = false;
        let mut rerouted = false;
        for _ in 0..=MAX_REDIRECTS {
            let view = if asking {
                &node.sync_asking
            } else {
                &node.sync
            };
            let r = op(view);
            let Err(e) = &r else { return r };
            match redirect_of(e) {
                Some(Redirect::Moved { slot, addr }) => {
                    node = self.router.patch(slot, &addr)?;
                    self.refresh_after_move(&addr, None);
                    asking = false;
                }
                Some(Redirect::Ask { addr }) => {
                    node = self.router.node(&addr)?;
                    asking = true;
                }
                None => {
                    self.after_failure(&node, e);
                    match self.router.rerouted(&node, slot, e) {
                        Some(next) if !rerouted => {
                            node = next;
                            asking = false;
                            rerouted = true;
                        }
                        _ => return r,
                    }
                }
            }
        }
        Err(too_many_redirects())
    }

    /// `op` on each node's part of a batch, redirected items sent again where they live now:
    /// one result per item. Every node's part is written, then every reply read (each part one
    /// pipelined round trip, the nodes' concurrently: a batch over three masters costs one
    /// round trip, not three), in one window of `io_timeout` ([`Window`]). The nodes' connects
    /// (or checks of pooled connections, every node's written before any is read) share one
    /// `connect_timeout` ([`within`](super::conn::within)), and the nodes that failed one map
    /// refresh ([`after_failures`](RedisCluster::after_failures)): a batch over hung masters
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
        let mut out: Vec<Option<Result<T>>> = items.iter().map(|_| None).collect();
        let mut rerouted = vec![false; items.len()];
        let mut groups = match self.map() {
            Ok(map) if self.router.hole_refresh_due(&map, items.iter().map(&key)) => {
                let map = self.refresh_by(None, &[], Some(by)).unwrap_or(map);
                first_groups(&map, items, &key, &mut out)
            }
            Ok(map) => first_groups(&map, items, &key, &mut out),
            Err(e) => return items.iter().map(|_| Err(e.clone())).collect(),
        };
        for round in 0..=MAX_REDIRECTS {
            let mut round_of = Round::default();
            for wave in waves(groups) {
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
                    round_of.judge(&self.router, node, at, results, round, &mut out);
                }
                // A read's connect (its pooled connection found closed) spent `by` itself.
                by += reading.elapsed().saturating_sub(window.connecting());
            }
            if let Some(addr) = &round_of.moved {
                self.refresh_after_move(addr, Some(by));
            }
            self.after_failures(&round_of.failed, by);
            round_of.reroute(&self.router, items, &key, &mut rerouted, &mut out);
            if round_of.next.is_empty() {
                break;
            }
            groups = group(round_of.next);
        }
        finish(out)
    }
}

/// What one round of a batch left: the items to send again, a node a `MOVED` named (to refresh
/// the map from), the nodes that failed, the items whose node could not be reached.
#[derive(Default)]
struct Round {
    next: Vec<Hop>,
    moved: Option<String>,
    failed: Vec<(Arc<Node>, Error)>,
    /// Items that failed with nothing of them run ([`resendable`]), with their node.
    unsent: Vec<(usize, Arc<Node>, Error)>,
}

impl Round {
    /// Takes `node`'s results for the items at `at` in redirect round `round`: a final result
    /// into `out`, a redirected item into `next`, an item its node could not be sent to into
    /// `unsent`.
    fn judge<T>(
        &mut self,
        router: &Router,
        node: &Arc<Node>,
        at: &[usize],
        results: Vec<Result<T>>,
        round: usize,
        out: &mut [Option<Result<T>>],
    ) {
        let mut failed = None;
        for (&i, r) in at.iter().zip(results) {
            let redirect = match &r {
                Ok(_) => None,
                Err(e) => redirect_of(e),
            };
            let hop = match redirect {
                None => {
                    if let Err(e) = &r {
                        if failed.is_none() && map_suspect(e) {
                            failed = Some(e.clone());
                        }
                        if resendable(e) {
                            self.unsent.push((i, node.clone(), e.clone()));
                            continue;
                        }
                    }
                    out[i] = Some(r);
                    continue;
                }
                Some(_) if round == MAX_REDIRECTS => Err(too_many_redirects()),
                Some(Redirect::Moved { slot, addr }) => {
                    let node = router.patch(slot, &addr);
                    self.moved = Some(addr);
                    node.map(|node| (node, false))
                }
                Some(Redirect::Ask { addr }) => router.node(&addr).map(|node| (node, true)),
            };
            match hop {
                Ok((node, asking)) => self.next.push(Hop {
                    at: i,
                    node,
                    asking,
                }),
                Err(e) => out[i] = Some(Err(e)),
            }
        }
        if let Some(e) = failed {
            self.failed.push((node.clone(), e));
        }
    }

    /// After the map's refresh: each item its node could not be sent to goes, once, to its
    /// slot's master in the map now if that is another node ([`Router::rerouted`]); the others
    /// keep their error.
    fn reroute<I, T>(
        &mut self,
        router: &Router,
        items: &[I],
        key: &impl Fn(&I) -> &str,
        rerouted: &mut [bool],
        out: &mut [Option<Result<T>>],
    ) {
        for (i, node, e) in std::mem::take(&mut self.unsent) {
            let slot = slots::slot_of(key(&items[i]).as_bytes());
            match router.rerouted(&node, slot, &e) {
                Some(next) if !rerouted[i] => {
                    rerouted[i] = true;
                    self.next.push(Hop {
                        at: i,
                        node: next,
                        asking: false,
                    });
                }
                _ => out[i] = Some(Err(e)),
            }
        }
    }
}

/// A batch's items grouped by their slot's master in `map` (in order of first appearance), for
/// its first round; an item whose slot no master serves gets its error in `out`. Grouped by
/// the master's place in the map: no node is cloned or compared per item.
fn first_groups<I, T>(
    map: &Map,
    items: &[I],
    key: &impl Fn(&I) -> &str,
    out: &mut [Option<Result<T>>],
) -> Vec<Group> {
    let mut group_of: SmallVec<[u16; 16]> = smallvec![NONE; map.masters.len()];
    let mut groups: Vec<Group> = Vec::new();
    // A master's share, twice over: one growth at most for a batch spread as keys hash.
    let share = (2 * items.len() / map.masters.len().max(1)).min(items.len()) + 1;
    for (at, item) in items.iter().enumerate() {
        let slot = slots::slot_of(key(item).as_bytes());
        let Some(master) = map.master_of(slot) else {
            out[at] = Some(Err(unserved(slot)));
            continue;
        };
        let g = &mut group_of[master];
        if *g == NONE {
            *g = groups.len() as u16;
            groups.push((
                map.masters[master].clone(),
                false,
                Vec::with_capacity(share),
            ));
        }
        groups[*g as usize].2.push(at);
    }
    groups
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

/// The results of a batch, in order.
fn finish<T>(out: Vec<Option<Result<T>>>) -> Vec<Result<T>> {
    out.into_iter()
        .map(|r| r.unwrap_or_else(|| Err(Error::backend("no reply for this item"))))
        .collect()
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
        // `Shared::needs_fence`). A `cas` goes as a script only to a node known to run
        // scripts; otherwise each write goes on its own, as its node's own store sends it
        // (read and compared, or refused). A node whose probe failed is left to the batch,
        // where it fails within the batch's bounds.
        let scripted = |w: &Write<'_>| {
            let fence = self.route(w.key).and_then(|(_, n)| n.sync.fence());
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

    use super::{
        Answers, MAX_REDIRECTS, Map, Node, Redirect, Round, Router, cleared, finish, first_groups,
        group, map_suspect, no_map_ping, redirect_of, too_many_redirects,
    };
    use crate::backend::engine::join_all;
    use crate::backend::{AsyncBackend, BoxFuture, Item, StoreOutcome, Write};
    use crate::error::{Error, Result};
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
                let (slot, mut node) = $self.route($key).await?;
                let mut asking = false;
                let mut rerouted = false;
                for _ in 0..=MAX_REDIRECTS {
                    let r = {
                        let $n = if asking {
                            &node.nonblocking_asking
                        } else {
                            &node.nonblocking
                        };
                        $call.await
                    };
                    let Err(e) = &r else { return r };
                    match redirect_of(e) {
                        Some(Redirect::Moved { slot, addr }) => {
                            node = $self.router.patch(slot, &addr)?;
                            $self.refresh_after_move(&addr).await;
                            asking = false;
                        }
                        Some(Redirect::Ask { addr }) => {
                            node = $self.router.node(&addr)?;
                            asking = true;
                        }
                        None => {
                            $self.after_failure(&node, e).await;
                            match $self.router.rerouted(&node, slot, e) {
                                Some(next) if !rerouted => {
                                    node = next;
                                    asking = false;
                                    rerouted = true;
                                }
                                _ => return r,
                            }
                        }
                    }
                }
                Err(too_many_redirects())
            })
        };
    }

    /// `$call` (`$n` a node's async view, `$part` its items) on each node's part of the batch
    /// `$items`, the nodes concurrently, redirected items sent again: the sync view's `many`.
    macro_rules! many {
        ($self:ident, $items:expr, |$it:ident| $key:expr, |$n:ident, $part:ident| $call:expr) => {
            Box::pin(async move {
                let items = $items;
                let mut out: Vec<Option<Result<_>>> = items.iter().map(|_| None).collect();
                let mut rerouted = vec![false; items.len()];
                let mut groups = match $self.map().await {
                    Ok(map)
                        if $self
                            .router
                            .hole_refresh_due(&map, items.iter().map(|$it| $key)) =>
                    {
                        let map = $self.refresh(None, None).await.unwrap_or(map);
                        first_groups(&map, items, &|$it: &_| $key, &mut out)
                    }
                    Ok(map) => first_groups(&map, items, &|$it: &_| $key, &mut out),
                    Err(e) => return items.iter().map(|_| Err(e.clone())).collect(),
                };
                for round in 0..=MAX_REDIRECTS {
                    let parts: Vec<Vec<_>> = groups
                        .iter()
                        .map(|(_, _, at)| at.iter().map(|&i| items[i]).collect())
                        .collect();
                    let calls = groups
                        .iter()
                        .zip(&parts)
                        .map(|((node, asking, _), $part)| {
                            let $n = if *asking {
                                &node.nonblocking_asking
                            } else {
                                &node.nonblocking
                            };
                            $call
                        })
                        .collect();
                    let answers = join_all(calls).await;
                    let mut round_of = Round::default();
                    for ((node, _, at), results) in groups.iter().zip(answers) {
                        round_of.judge(&$self.router, node, at, results, round, &mut out);
                    }
                    if let Some(addr) = &round_of.moved {
                        $self.refresh_after_move(addr).await;
                    }
                    for (node, e) in &round_of.failed {
                        $self.after_failure(node, e).await;
                    }
                    round_of.reroute(
                        &$self.router,
                        items,
                        &|$it: &_| $key,
                        &mut rerouted,
                        &mut out,
                    );
                    if round_of.next.is_empty() {
                        break;
                    }
                    groups = group(round_of.next);
                }
                finish(out)
            })
        };
    }

    impl AsyncRedisCluster {
        async fn map(&self) -> Result<Arc<Map>> {
            match self.router.current() {
                Some(m) => Ok(m),
                None => self.refresh(None, None).await,
            }
        }

        /// The sync view's `route`.
        async fn route(&self, key: &str) -> Result<(u16, Arc<Node>)> {
            let map = self.map().await?;
            if self.router.hole_refresh_due(&map, std::iter::once(key)) {
                return Router::route(&*self.refresh(None, None).await?, key);
            }
            Router::route(&map, key)
        }

        async fn refresh(&self, first: Option<&str>, last: Option<&str>) -> Result<Arc<Map>> {
            let mut answers = Answers::default();
            for node in self.router.candidates(first, last.as_slice()) {
                if let Some(whole) = answers.take(&node, node.nonblocking.slots().await) {
                    return self.router.install(whole);
                }
            }
            self.router.settle(answers)
        }

        async fn refresh_after_move(&self, addr: &str) {
            if let Some(_one) = self.router.claim_refresh() {
                let _ = self.refresh(Some(addr), None).await;
            }
        }

        async fn after_failure(&self, node: &Node, e: &Error) {
            if map_suspect(e) && self.router.refresh_due() {
                let _ = self.refresh(None, Some(node.addr())).await;
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::{Router, node_url, slots};
    use crate::backend::redis::RedisConfig;

    /// One range over every slot, served by the node `id` at `addr`.
    fn whole(addr: &str, id: &str) -> Vec<slots::Range> {
        vec![slots::Range {
            first: 0,
            last: (slots::SLOTS - 1) as u16,
            addr: addr.into(),
            id: Some(id.into()),
        }]
    }

    #[test]
    fn a_new_node_id_at_a_known_address_is_a_new_node() {
        let router = Router::new(vec![RedisConfig::new("redis://127.0.0.1:7000")]).unwrap();
        let seed = router.node("127.0.0.1:7000").unwrap();
        // The seed's first map names it: the same node, now known by its id.
        let map = router.install(whole("127.0.0.1:7000", "old")).unwrap();
        assert!(Arc::ptr_eq(&map.masters[0], &seed));
        let map = router.install(whole("127.0.0.1:7000", "old")).unwrap();
        assert!(Arc::ptr_eq(&map.masters[0], &seed));
        // Wiped and started again: another id at the same address.
        let map = router.install(whole("127.0.0.1:7000", "new")).unwrap();
        assert!(!Arc::ptr_eq(&map.masters[0], &seed));
        let now = router.node("127.0.0.1:7000").unwrap();
        assert!(
            Arc::ptr_eq(&map.masters[0], &now),
            "a redirect there finds the new node"
        );
        assert_eq!(
            router.retired.lock().len(),
            1,
            "the old one kept for its counts"
        );
    }

    #[test]
    fn a_node_url_keeps_the_seeds_scheme_and_credentials() {
        assert_eq!(
            node_url("redis://127.0.0.1:7000", "10.0.0.2:7001"),
            "redis://10.0.0.2:7001"
        );
        assert_eq!(
            node_url(
                "rediss://user:p%40ss@seed:7000/0?protocol=resp3",
                "10.0.0.2:7001"
            ),
            "rediss://user:p%40ss@10.0.0.2:7001/0?protocol=resp3"
        );
    }
}
