//! Redis Cluster's routing, without I/O: the nodes met, the slot map, where a key's command
//! is sent and where it goes after each reply ([`Route`] for one command, [`BatchRoute`] for a
//! batch). The drivers (`cluster.rs`, sync and async) send what it says and ask the nodes for
//! the map when it says so.
//!
//! Each master is reached through a [`RedisBackend`] of its own (and its async view), with its
//! own `Server`: health, replay record and connections, so a node down costs only its slots'
//! keys, and nothing of the herd protocol is written twice. Every claim, placeholder and fenced
//! store touches one key, so each runs on one node as it is.
//!
//! The slot map comes from `CLUSTER SLOTS`, asked of the seeds on first use. A `MOVED` patches
//! the map, sends the command again and refreshes the whole map; an `ASK` sends `ASKING` and
//! the command to the node it names, once, the map unchanged. A node's fault, `CLUSTERDOWN`,
//! `TRYAGAIN` (never expected: no command sent names two keys) or a key in a slot with no
//! master refreshes the map at most once per `retry_interval` ([`Router::refresh_due`]); a call
//! of which nothing ran then goes once to its slot's master in the refreshed map
//! ([`Router::rerouted`]). `CLUSTERDOWN` marks no node dead; a write it refuses is queued for
//! the node's replay (`reply::not_serving_yet`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Instant;

use parking_lot::{Mutex, RwLock};
use smallvec::{SmallVec, smallvec};

use super::RedisBackend;
use super::RedisConfig;
use super::config::redacted;
use super::reply::{Redirect, is_cluster_refusal, is_fault, redirect_of};
use super::slots;
use crate::backend::server::health::Health;
use crate::backend::server::outage;
use crate::clock::Clock;
use crate::error::{Error, Result};

/// How many redirects one command follows before it fails (a slot moved on while it was sent
/// again: a resharding in progress).
const MAX_REDIRECTS: usize = 5;

/// No master serves this slot.
const NONE: u16 = u16::MAX;

/// One master's views: sync and async, each also as an asking view (same connections).
pub(super) struct Node {
    /// Its node id, once a slot map named it: a node at the same address with another id is
    /// another node (its disk wiped, started again), reached through views of its own.
    id: OnceLock<String>,
    pub(super) sync: RedisBackend,
    sync_asking: RedisBackend,
    #[cfg(feature = "tokio")]
    pub(super) nonblocking: super::nonblocking::AsyncRedis,
    #[cfg(feature = "tokio")]
    nonblocking_asking: super::nonblocking::AsyncRedis,
}

impl Node {
    pub(super) fn addr(&self) -> &str {
        self.sync.addr()
    }

    /// The sync view, or its asking view.
    pub(super) fn view(&self, asking: bool) -> &RedisBackend {
        if asking {
            &self.sync_asking
        } else {
            &self.sync
        }
    }

    /// The async view, or its asking view.
    #[cfg(feature = "tokio")]
    pub(super) fn nonblocking(&self, asking: bool) -> &super::nonblocking::AsyncRedis {
        if asking {
            &self.nonblocking_asking
        } else {
            &self.nonblocking
        }
    }

    fn health(&self) -> &Arc<Health> {
        self.sync.health()
    }
}

/// Which master serves each slot.
pub(super) struct Map {
    /// Per slot, the index of its master in `masters` (or [`NONE`]).
    slots: Vec<u16>,
    pub(super) masters: Vec<Arc<Node>>,
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
pub(super) struct Router {
    /// The first seed's settings: every node's, its address put in the URL.
    pub(super) template: RedisConfig,
    /// The seeds' `host:port`.
    pub(super) seeds: Vec<String>,
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
    /// The router of the cluster of these seeds, each a node met (none connected yet).
    pub(super) fn new(configs: Vec<RedisConfig>) -> Result<Arc<Router>> {
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
        let router = Arc::new(Router {
            template,
            seeds,
            nodes: Mutex::new(nodes),
            retired: Mutex::new(Vec::new()),
            map: RwLock::new(None),
            refreshing: AtomicBool::new(false),
            asked: Mutex::new(None),
            clock: Mutex::new(None),
            this: OnceLock::new(),
        });
        let _ = router.this.set(Arc::downgrade(&router));
        for node in router.nodes.lock().values() {
            router.link(node);
        }
        Ok(router)
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
    pub(super) fn node(&self, addr: &str) -> Result<Arc<Node>> {
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

    pub(super) fn current(&self) -> Option<Arc<Map>> {
        self.map.read().clone()
    }

    /// Puts the map of `ranges` in place.
    pub(super) fn install(&self, ranges: Vec<slots::Range>) -> Result<Arc<Map>> {
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
    pub(super) fn patch(&self, slot: u16, addr: &str) -> Result<Arc<Node>> {
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
    pub(super) fn candidates(&self, first: Option<&str>, last: &[&str]) -> Vec<Arc<Node>> {
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
    pub(super) fn refresh_due(&self) -> bool {
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
    pub(super) fn hole_refresh_due<'k>(
        &self,
        map: &Map,
        keys: impl Iterator<Item = &'k str>,
    ) -> bool {
        map.misses(keys) && self.refresh_due()
    }

    /// Claims the one refresh after a `MOVED` (`None` if another caller is doing it).
    pub(super) fn claim_refresh(&self) -> Option<RefreshGuard<'_>> {
        (!self.refreshing.swap(true, Ordering::AcqRel)).then_some(RefreshGuard(self))
    }

    /// Where a command goes after `e` from its node, sent `sent` times, if `e` is a redirect:
    /// to the node it names (through its asking view after an `ASK`; after a `MOVED`, the map
    /// patched first), or, sent too often, nowhere.
    fn redirected(&self, e: &Error, sent: usize) -> Option<Result<To>> {
        let redirect = redirect_of(e)?;
        if sent > MAX_REDIRECTS {
            return Some(Err(too_many_redirects()));
        }
        Some(match redirect {
            Redirect::Moved { slot, addr } => self.patch(slot, &addr).map(|node| To {
                node,
                asking: false,
                moved: Some(addr),
            }),
            Redirect::Ask { addr } => self.node(&addr).map(|node| To {
                node,
                asking: true,
                moved: None,
            }),
        })
    }

    pub(super) fn use_clock(&self, clock: Arc<dyn Clock>) {
        for n in self.nodes.lock().values() {
            n.health().missed.use_clock(clock.clone());
        }
        *self.clock.lock() = Some(clock);
    }

    pub(super) fn max_value_size(&self, key: &str) -> usize {
        crate::backend::max_value_size(self.template.item_size, key)
    }

    pub(super) fn report(&self, stats: &mut crate::Stats) {
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
    pub(super) fn every_node(&self) -> Vec<Arc<Node>> {
        let mut all: Vec<Arc<Node>> = self.nodes.lock().values().cloned().collect();
        all.extend(self.retired.lock().iter().cloned());
        all
    }

    /// After every node was asked and none gave a whole map: the fullest map with a hole,
    /// unless the map in place is whole (kept: nodes that serve no slot or miss some never
    /// replace a map that serves every slot); else the last error.
    pub(super) fn settle(&self, answers: Answers) -> Result<Arc<Map>> {
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

/// Where a redirected command goes.
struct To {
    node: Arc<Node>,
    asking: bool,
    /// The address a `MOVED` named, to refresh the map from.
    moved: Option<String>,
}

/// One command's way to its key's master: where it is sent now ([`node`](Route::node), through
/// its asking view if [`asking`](Route::asking)), and where it goes after an error from there
/// ([`told`](Route::told)).
pub(super) struct Route {
    slot: u16,
    pub(super) node: Arc<Node>,
    pub(super) asking: bool,
    /// How many times it was sent.
    sent: usize,
    /// Whether it was sent to another master after its node could not be reached (once only).
    rerouted: bool,
}

/// What a command does after an error from its node, besides sending it again.
#[derive(Debug)]
pub(super) enum Next {
    /// Nothing: send it where its route says now.
    Send,
    /// A `MOVED` to this address patched the map: ask that node for the whole map (unless
    /// another caller is: [`Router::claim_refresh`]), then send it.
    Moved(String),
    /// Its node failed with this error and the map is due to be asked again (that node last):
    /// ask, then hand the error back to [`Route::rerouted`].
    Refresh(Error),
}

impl Route {
    /// `key`'s command to its slot's master in `map`.
    pub(super) fn new(map: &Map, key: &str) -> Result<Route> {
        let slot = slots::slot_of(key.as_bytes());
        let node = map.node_of(slot).ok_or_else(|| unserved(slot))?;
        Ok(Route {
            slot,
            node: node.clone(),
            asking: false,
            sent: 0,
            rerouted: false,
        })
    }

    /// Takes the error `e` its node answered: a redirect is followed, a node's fault or a
    /// cluster's refusal asks for the map once per `retry_interval` ([`map_suspect`]), a call
    /// of which nothing ran goes to its slot's master in the map now; `Err`: the command's
    /// result.
    pub(super) fn told(&mut self, router: &Router, e: Error) -> Result<Next> {
        self.sent += 1;
        if let Some(to) = router.redirected(&e, self.sent) {
            let to = to?;
            self.node = to.node;
            self.asking = to.asking;
            return Ok(to.moved.map_or(Next::Send, Next::Moved));
        }
        if map_suspect(&e) && router.refresh_due() {
            return Ok(Next::Refresh(e));
        }
        self.rerouted(router, e).map(|()| Next::Send)
    }

    /// After its node failed with `e` (and any refresh of the map): `Ok` if it goes once to its
    /// slot's master in the map now, another node ([`Router::rerouted`]); else `e`.
    pub(super) fn rerouted(&mut self, router: &Router, e: Error) -> Result<()> {
        match router.rerouted(&self.node, self.slot, &e) {
            Some(_) if !self.rerouted && self.sent > MAX_REDIRECTS => Err(too_many_redirects()),
            Some(next) if !self.rerouted => {
                self.node = next;
                self.asking = false;
                self.rerouted = true;
                Ok(())
            }
            _ => Err(e),
        }
    }
}

/// The answers of one refresh's nodes, asked in turn: the first whole map (every slot has a
/// master) is put in place at once; failing one, [`Router::settle`] decides.
#[derive(Default)]
pub(super) struct Answers {
    /// The ranges of the fullest map with a hole so far, and how many slots they cover.
    partial: Option<(usize, Vec<slots::Range>)>,
    errors: Vec<Error>,
}

impl Answers {
    /// Takes `node`'s answer: the ranges of a whole map, to put in place.
    pub(super) fn take(
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
pub(super) struct RefreshGuard<'a>(&'a Router);

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
pub(super) type Group = (Arc<Node>, bool, Vec<usize>);

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
pub(super) fn waves(groups: Vec<Group>) -> Vec<Vec<Group>> {
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

/// Whether `e` from a node is to make the map asked again ([`Router::refresh_due`] permitting):
/// a fault (a failover changes the map) or a cluster's refusal.
pub(super) fn map_suspect(e: &Error) -> bool {
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

/// A batch's way through the cluster, round by round: each item's result once it has one, and
/// where the others go next. A driver sends a round's groups ([`take`](BatchRoute::take)), hands
/// each node's results to [`judge`](BatchRoute::judge), asks for the map as told
/// ([`moved`](BatchRoute::moved), [`refresh_last`](BatchRoute::refresh_last)), then goes on while
/// [`next`](BatchRoute::next) finds items to send again.
pub(super) struct BatchRoute<T> {
    out: Vec<Option<Result<T>>>,
    /// Whether each item went to another master after its node could not be reached (once
    /// only).
    rerouted: Vec<bool>,
    /// The round: how many times its items were sent before.
    round: usize,
    groups: Vec<Group>,
    /// The round's items to send again, where.
    next: Vec<Hop>,
    /// A node a `MOVED` named, to refresh the map from.
    moved: Option<String>,
    /// The nodes that failed with a fault or a cluster's refusal ([`map_suspect`]).
    failed: Vec<(Arc<Node>, Error)>,
    /// Items that failed with nothing of them run ([`resendable`]), with their node.
    unsent: Vec<(usize, Arc<Node>, Error)>,
}

impl<T> BatchRoute<T> {
    /// `items` grouped by their slot's master in `map` (in order of first appearance), for the
    /// first round; an item whose slot no master serves has its error. Grouped by the master's
    /// place in the map: no node is cloned or compared per item.
    pub(super) fn new<I>(map: &Map, items: &[I], key: impl Fn(&I) -> &str) -> BatchRoute<T> {
        let mut out: Vec<Option<Result<T>>> = items.iter().map(|_| None).collect();
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
                let node = map.masters[master].clone();
                groups.push((node, false, Vec::with_capacity(share)));
            }
            groups[*g as usize].2.push(at);
        }
        BatchRoute {
            out,
            rerouted: vec![false; items.len()],
            round: 0,
            groups,
            next: Vec::new(),
            moved: None,
            failed: Vec::new(),
            unsent: Vec::new(),
        }
    }

    /// The round's groups, to send: each a node, whether through its asking view, and the
    /// items' positions.
    pub(super) fn take(&mut self) -> Vec<Group> {
        std::mem::take(&mut self.groups)
    }

    /// Takes `node`'s results for the items at `at`: a result stands, a redirected item goes
    /// where it was sent, an item its node could not be sent to waits for
    /// [`next`](BatchRoute::next).
    pub(super) fn judge(
        &mut self,
        router: &Router,
        node: &Arc<Node>,
        at: &[usize],
        results: Vec<Result<T>>,
    ) {
        let mut failed = None;
        for (&i, r) in at.iter().zip(results) {
            let Err(e) = &r else {
                self.out[i] = Some(r);
                continue;
            };
            match router.redirected(e, self.round + 1) {
                Some(Ok(to)) => {
                    if to.moved.is_some() {
                        self.moved = to.moved;
                    }
                    self.next.push(Hop {
                        at: i,
                        node: to.node,
                        asking: to.asking,
                    });
                }
                Some(Err(e)) => self.out[i] = Some(Err(e)),
                None => {
                    if failed.is_none() && map_suspect(e) {
                        failed = Some(e.clone());
                    }
                    if resendable(e) {
                        self.unsent.push((i, node.clone(), e.clone()));
                    } else {
                        self.out[i] = Some(r);
                    }
                }
            }
        }
        if let Some(e) = failed {
            self.failed.push((node.clone(), e));
        }
    }

    /// The node a `MOVED` of this round named: ask it for the map (unless another caller is
    /// asking: [`Router::claim_refresh`]).
    pub(super) fn moved(&self) -> Option<&str> {
        self.moved.as_deref()
    }

    /// The nodes to ask last for the map after this round, if it is to be asked again: a node
    /// met a fault or a cluster's refusal ([`map_suspect`]), and a refresh is due
    /// ([`Router::refresh_due`]). One refresh for them all, which asks them last: a hung master
    /// is asked only if every other node failed too.
    pub(super) fn refresh_last(&self, router: &Router) -> Option<Vec<&str>> {
        (!self.failed.is_empty() && router.refresh_due())
            .then(|| self.failed.iter().map(|(n, _)| n.addr()).collect())
    }

    /// After the round's refreshes: each item its node could not be sent to goes, once, to its
    /// slot's master in the map now if that is another node ([`Router::rerouted`]; the others
    /// keep their error), and the next round is in place. `false`: nothing left to send.
    pub(super) fn next<I>(
        &mut self,
        router: &Router,
        items: &[I],
        key: impl Fn(&I) -> &str,
    ) -> bool {
        for (i, node, e) in std::mem::take(&mut self.unsent) {
            let slot = slots::slot_of(key(&items[i]).as_bytes());
            match router.rerouted(&node, slot, &e) {
                Some(_) if !self.rerouted[i] && self.round == MAX_REDIRECTS => {
                    self.out[i] = Some(Err(too_many_redirects()));
                }
                Some(next) if !self.rerouted[i] => {
                    self.rerouted[i] = true;
                    self.next.push(Hop {
                        at: i,
                        node: next,
                        asking: false,
                    });
                }
                _ => self.out[i] = Some(Err(e)),
            }
        }
        self.round += 1;
        self.moved = None;
        self.failed.clear();
        self.groups = group(std::mem::take(&mut self.next));
        !self.groups.is_empty()
    }

    /// The results, in order.
    pub(super) fn finish(self) -> Vec<Result<T>> {
        self.out
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(Error::backend("no reply for this item"))))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use std::time::Instant;

    use super::{BatchRoute, Group, Next, Route, Router, node_url, slots};
    use crate::backend::redis::{RedisConfig, reply};
    use crate::error::{Error, ErrorKind};

    const A: &str = "127.0.0.1:7000";
    const B: &str = "127.0.0.1:7001";
    /// A key of slot 5061.
    const KEY: &str = "bar";

    /// Slots below 8,192 at `low`, the others at `high`.
    fn halves(low: &str, high: &str) -> Vec<slots::Range> {
        let range = |first, last, addr: &str| slots::Range {
            first,
            last,
            addr: addr.into(),
            id: None,
        };
        vec![range(0, 8191, low), range(8192, 16383, high)]
    }

    fn router() -> Arc<Router> {
        let router = Router::new(vec![RedisConfig::new(format!("redis://{A}"))]).unwrap();
        router.install(halves(A, B)).unwrap();
        router
    }

    /// The error reply `line` as a call's error.
    fn reply(line: &str) -> Error {
        match redis::parse_redis_value(format!("-{line}\r\n").as_bytes()).unwrap() {
            redis::Value::ServerError(e) => reply::refused(e),
            other => panic!("{other:?}"),
        }
    }

    fn fault() -> Error {
        Error::new(ErrorKind::Backend, "i/o error talking to the server")
    }

    /// A command to `KEY`, on [`router`]'s map.
    fn route() -> (Arc<Router>, Route) {
        let router = router();
        let route = Route::new(&router.current().unwrap(), KEY).unwrap();
        (router, route)
    }

    /// What `route` does after `e` (a map refresh due if `due`; `map`, if given, the map that
    /// refresh finds): `send`, `ask` or `moved` and the node it goes to, or `fail` and why.
    #[track_caller]
    fn check(
        (router, route): &mut (Arc<Router>, Route),
        e: Error,
        due: bool,
        map: Option<Vec<slots::Range>>,
        expected: &str,
    ) {
        *router.asked.lock() = (!due).then(Instant::now);
        let to = |route: &Route| {
            let how = if route.asking { "ask" } else { "send" };
            format!("{how} {}", route.node.addr())
        };
        let said = match route.told(router, e) {
            Ok(Next::Send) => to(route),
            Ok(Next::Moved(addr)) => format!("moved {addr}, {}", to(route)),
            Ok(Next::Refresh(e)) => {
                if let Some(ranges) = map {
                    router.install(ranges).unwrap();
                }
                match route.rerouted(router, e) {
                    Ok(()) => format!("refresh, {}", to(route)),
                    Err(e) => format!("refresh, fail: {e}"),
                }
            }
            Err(e) => format!("fail: {e}"),
        };
        assert_eq!(said, expected);
    }

    #[test]
    fn a_command_follows_redirects_five_times() {
        let mut r = route();
        assert_eq!(r.1.node.addr(), A);
        let moved = || reply(&format!("MOVED 5061 {B}"));
        check(&mut r, moved(), true, None, &format!("moved {B}, send {B}"));
        let patched = Route::new(&r.0.current().unwrap(), KEY).unwrap();
        assert_eq!(patched.node.addr(), B, "the map patched");
        let ask = || reply(&format!("ASK 5061 {A}"));
        check(&mut r, ask(), true, None, &format!("ask {A}"));
        let patched = Route::new(&r.0.current().unwrap(), KEY).unwrap();
        assert_eq!(patched.node.addr(), B, "the map as it was");
        for _ in 0..3 {
            check(&mut r, ask(), true, None, &format!("ask {A}"));
        }
        let gave_up = "fail: backend error: redis cluster: still redirected after 5 redirects (a resharding in \
                       progress)";
        check(&mut r, ask(), true, None, gave_up);
    }

    #[test]
    fn a_command_goes_elsewhere_once_only_if_nothing_of_it_ran() {
        let moved_away = || Some(halves(B, A));
        let unsent = || fault().unsent();
        let refused = "fail: backend error: the server refused the command";
        let failed = "refresh, fail: backend error: i/o error talking to the server";
        #[rustfmt::skip]
        let table: &[(Error, bool, Option<Vec<slots::Range>>, &str)] = &[
            // Answers: the command's result, the map left alone.
            (reply("READONLY You can't write against a read only replica."), true, moved_away(), refused),
            (reply("OOM command not allowed"), true, moved_away(), refused),
            (reply("WRONGPASS invalid username-password pair"), true, moved_away(), "fail: denied by the server: the server refused the URL's user and password (WRONGPASS)"),
            // A fault: the map asked again when due; sent, it may have run: not sent again.
            (fault(), true, moved_away(), failed),
            (fault(), false, moved_away(), "fail: backend error: i/o error talking to the server"),
            // Nothing of it ran: to the slot's master in the map now, if another node.
            (unsent(), true, None, failed),
            (unsent(), true, moved_away(), &format!("refresh, send {B}")),
            (reply("CLUSTERDOWN Hash slot not served"), true, moved_away(), &format!("refresh, send {B}")),
            (reply("TRYAGAIN Multiple keys request during rehashing of slot"), true, moved_away(),
                &format!("refresh, send {B}")),
        ];
        for (e, due, map, expected) in table {
            check(&mut route(), e.clone(), *due, map.clone(), expected);
        }
        // Once: the master it went to cannot be reached either.
        let mut r = route();
        check(
            &mut r,
            unsent(),
            true,
            moved_away(),
            &format!("refresh, send {B}"),
        );
        check(&mut r, unsent(), true, Some(halves(A, B)), failed);
    }

    /// One range over every slot, served by the node `id` at `addr`.
    fn whole(addr: &str, id: &str) -> Vec<slots::Range> {
        vec![slots::Range {
            first: 0,
            last: (slots::SLOTS - 1) as u16,
            addr: addr.into(),
            id: Some(id.into()),
        }]
    }

    /// Each group's node, whether through its asking view, and its items.
    fn shown(groups: &[Group]) -> Vec<(&str, bool, &[usize])> {
        groups
            .iter()
            .map(|(n, asking, at)| (n.addr(), *asking, &at[..]))
            .collect()
    }

    #[test]
    fn a_batch_sends_again_only_what_was_redirected_or_never_ran() {
        let router = router();
        // Slots 5061, 12182 (at B), 5061 again, and one of A's half.
        let keys = ["bar", "foo", "{bar}.2", "{bar}.3"];
        let mut batch: BatchRoute<u8> = BatchRoute::new(&router.current().unwrap(), &keys, |k| k);
        let groups = batch.take();
        assert_eq!(
            shown(&groups),
            [(A, false, &[0, 2, 3][..]), (B, false, &[1][..])]
        );
        let (a, b) = (&groups[0].0, &groups[1].0);
        let results = vec![
            Err(reply(&format!("ASK 5061 {B}"))),
            Err(fault().unsent()),
            Ok(3),
        ];
        batch.judge(&router, a, &[0, 2, 3], results);
        batch.judge(
            &router,
            b,
            &[1],
            vec![Err(reply("READONLY You can't write"))],
        );
        assert_eq!(batch.moved(), None);
        *router.asked.lock() = None;
        assert_eq!(
            batch.refresh_last(&router),
            Some(vec![A]),
            "A failed: asked last"
        );
        router.install(halves(B, A)).unwrap();
        assert!(batch.next(&router, &keys, |k| k));
        let again = [(B, true, &[0][..]), (B, false, &[2][..])];
        assert_eq!(shown(&batch.groups), again, "asked, rerouted");
        let groups = batch.take();
        batch.judge(&router, &groups[0].0, &[0], vec![Ok(0)]);
        batch.judge(&router, &groups[1].0, &[2], vec![Ok(2)]);
        assert!(!batch.next(&router, &keys, |k| k));
        let results: Vec<String> = batch
            .finish()
            .into_iter()
            .map(|r| r.map_or_else(|e| e.to_string(), |v| v.to_string()))
            .collect();
        assert_eq!(
            results,
            [
                "0",
                "backend error: the server refused the command",
                "2",
                "3"
            ]
        );
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
