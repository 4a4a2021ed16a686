//! Which server holds a key: libmemcached's weighted ketama ring over every server, or (under
//! `DeadServerPolicy::Remap`) over the servers not marked dead, rebuilt only when that set changes.

use std::sync::Arc;

use parking_lot::RwLock;

use super::config::{DeadServerPolicy, ServerSpec};
use super::ring::{self, Node, Ring};

/// Key placement over a fixed server list.
#[derive(Debug)]
pub(crate) struct Routing {
    nodes: Vec<Node>,
    ring: Ring,
    policy: DeadServerPolicy,
    /// The ring over the servers not marked dead, with the liveness it was built for (Remap).
    live_ring: RwLock<(Vec<bool>, Arc<Ring>)>,
}

impl Routing {
    pub(crate) fn new(servers: &[ServerSpec], policy: DeadServerPolicy) -> Routing {
        let nodes: Vec<Node> = servers
            .iter()
            .map(|s| Node {
                host: s.host.clone(),
                port: s.port,
                weight: s.weight,
            })
            .collect();
        let all = vec![true; nodes.len()];
        let ring = Ring::new(&nodes, &all);
        Routing {
            live_ring: RwLock::new((all, Arc::new(ring.clone()))),
            nodes,
            ring,
            policy,
        }
    }

    /// The server of `key` when every server is up.
    pub(crate) fn home(&self, key: &str) -> usize {
        if self.nodes.len() == 1 {
            return 0;
        }
        self.ring.locate(key.as_bytes()).unwrap_or(0)
    }

    /// The server to send `key` to now; `routable(i)` says whether server `i` is not marked dead.
    pub(crate) fn route(&self, key: &str, routable: impl Fn(usize) -> bool) -> usize {
        if self.nodes.len() == 1 {
            return 0;
        }
        if self.policy == DeadServerPolicy::Remap && !(0..self.nodes.len()).all(&routable) {
            return self.remapped(key, (0..self.nodes.len()).map(routable).collect());
        }
        self.home(key)
    }

    /// `(home, route)`: [`home`](Self::home) and [`route`](Self::route) of `key`, hashing it once
    /// when no server is remapped.
    pub(crate) fn home_and_route(
        &self,
        key: &str,
        routable: impl Fn(usize) -> bool,
    ) -> (usize, usize) {
        if self.nodes.len() == 1 {
            return (0, 0);
        }
        let home = self.home(key);
        if self.policy == DeadServerPolicy::Remap && !(0..self.nodes.len()).all(&routable) {
            return (
                home,
                self.remapped(key, (0..self.nodes.len()).map(routable).collect()),
            );
        }
        (home, home)
    }

    fn remapped(&self, key: &str, live: Vec<bool>) -> usize {
        // Every server dead: fall back to the full ring (the call fails fast there).
        self.live_ring(live)
            .locate(key.as_bytes())
            .unwrap_or_else(|| self.home(key))
    }

    /// The ring over the servers whose `live` flag is set, built once per change of that set.
    fn live_ring(&self, live: Vec<bool>) -> Arc<Ring> {
        let cached = {
            let c = self.live_ring.read();
            (c.0 == live).then(|| c.1.clone())
        };
        cached.unwrap_or_else(|| {
            let fresh = Arc::new(Ring::new(&self.nodes, &live));
            *self.live_ring.write() = (live, fresh.clone());
            fresh
        })
    }

    /// Groups positions of `keys` by server, preserving order within a server.
    pub(crate) fn by_server<'k>(
        &self,
        keys: impl Iterator<Item = &'k str>,
        routable: impl Fn(usize) -> bool,
    ) -> Vec<(usize, Vec<usize>)> {
        if self.nodes.len() == 1 {
            // One server: no hashing.
            return match keys.count() {
                0 => Vec::new(),
                n => vec![(0, (0..n).collect())],
            };
        }
        let mut hashes = Vec::with_capacity(keys.size_hint().0);
        // Every key hashed first: side by side, several at a time (`ring::key_hashes`).
        ring::key_hashes(keys.map(str::as_bytes), &mut hashes);
        let n = hashes.len();
        // The ring for the whole batch: every server's, or the live servers' (Remap).
        let live_ring;
        let ring =
            match self.policy == DeadServerPolicy::Remap && !(0..self.nodes.len()).all(&routable) {
                true => {
                    live_ring = self.live_ring((0..self.nodes.len()).map(&routable).collect());
                    &*live_ring
                }
                false => &self.ring,
            };
        let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
        for (pos, &h) in hashes.iter().enumerate() {
            // Every server dead: the full ring (the call fails fast there).
            let s = ring
                .locate_hash(h)
                .or_else(|| self.ring.locate_hash(h))
                .unwrap_or(0);
            match groups.iter_mut().find(|(i, _)| *i == s) {
                Some((_, v)) => v.push(pos),
                None => {
                    // Room for every key left: one allocation per server, not one per doubling
                    // (a batch of a hundred keys on one server grew through seven).
                    let mut v = Vec::with_capacity(n.saturating_sub(pos).max(1));
                    v.push(pos);
                    groups.push((s, v));
                }
            }
        }
        groups
    }
}
