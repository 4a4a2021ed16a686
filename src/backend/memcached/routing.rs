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
        self.locate(None, ring::key_hash(key.as_bytes()))
    }

    /// The server to send `key` to now; `routable(i)` says whether server `i` is not marked dead.
    pub(crate) fn route(&self, key: &str, routable: impl Fn(usize) -> bool) -> usize {
        self.home_and_route(key, routable).1
    }

    /// `(home, route)`: [`home`](Self::home) and [`route`](Self::route) of `key`, hashing it once.
    pub(crate) fn home_and_route(
        &self,
        key: &str,
        routable: impl Fn(usize) -> bool,
    ) -> (usize, usize) {
        if self.nodes.len() == 1 {
            return (0, 0);
        }
        let h = ring::key_hash(key.as_bytes());
        let home = self.locate(None, h);
        match self.remap_ring(routable) {
            Some(remap) => (home, self.locate(Some(&remap), h)),
            None => (home, home),
        }
    }

    /// The ring keys go to now, if not every server's: under `Remap`, with a server marked
    /// dead, the ring over the others.
    fn remap_ring(&self, routable: impl Fn(usize) -> bool) -> Option<Arc<Ring>> {
        let all = 0..self.nodes.len();
        (self.policy == DeadServerPolicy::Remap && !all.clone().all(&routable))
            .then(|| self.live_ring(all.map(routable).collect()))
    }

    /// The server of the key whose hash is `h`: on `remap` if given, else (or with every server
    /// dead, when the call fails fast) on every server's ring.
    fn locate(&self, remap: Option<&Ring>, h: u32) -> usize {
        remap
            .and_then(|r| r.locate_hash(h))
            .or_else(|| self.ring.locate_hash(h))
            .unwrap_or(0)
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
        // One ring for the whole batch.
        let remap = self.remap_ring(routable);
        let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
        for (pos, &h) in hashes.iter().enumerate() {
            let s = self.locate(remap.as_deref(), h);
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn spec(i: usize, weight: u32) -> ServerSpec {
        ServerSpec {
            host: format!("10.0.0.{i}"),
            port: 11211,
            weight,
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        /// A batch places every key where a single-key call would: `by_server` against `route`
        /// and `home`, under both policies, any weights and any servers marked dead.
        #[test]
        fn a_batch_places_each_key_where_its_single_calls_do(
            weights in prop::collection::vec(0u32..4, 1..6),
            live in prop::collection::vec(any::<bool>(), 6),
            remap in any::<bool>(),
            keys in prop::collection::vec("[ -~]{0,70}", 0..14),
        ) {
            let servers: Vec<ServerSpec> =
                weights.iter().enumerate().map(|(i, &w)| spec(i, w)).collect();
            let policy = match remap {
                true => DeadServerPolicy::Remap,
                false => DeadServerPolicy::FailFast,
            };
            let r = Routing::new(&servers, policy);
            let routable = |i: usize| live[i];
            let groups = r.by_server(keys.iter().map(String::as_str), routable);
            let mut placed = vec![None; keys.len()];
            for (server, positions) in &groups {
                prop_assert!(positions.windows(2).all(|w| w[0] < w[1]));
                for &p in positions {
                    prop_assert!(placed[p].is_none());
                    placed[p] = Some(*server);
                }
            }
            let servers: std::collections::HashSet<_> = groups.iter().map(|g| g.0).collect();
            prop_assert_eq!(servers.len(), groups.len());
            for (p, k) in keys.iter().enumerate() {
                let route = r.route(k, routable);
                prop_assert_eq!(placed[p], Some(route), "key {:?}", k);
                prop_assert_eq!(r.home_and_route(k, routable), (r.home(k), route));
            }
        }

        #[test]
        fn key_hashes_of_any_bytes_agree_with_md5(
            keys in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..80), 0..20),
        ) {
            let mut out = vec![7, 7, 7];
            ring::key_hashes(keys.iter().map(Vec::as_slice), &mut out);
            let one_by_one: Vec<u32> = keys.iter().map(|k| ring::key_hash(k)).collect();
            prop_assert_eq!(out, one_by_one);
        }
    }

    #[test]
    fn with_every_server_dead_a_batch_goes_home_under_remap() {
        let servers: Vec<ServerSpec> = (0..3).map(|i| spec(i, 1)).collect();
        let r = Routing::new(&servers, DeadServerPolicy::Remap);
        let keys: Vec<String> = (0..50).map(|i| format!("k{i}")).collect();
        let groups = r.by_server(keys.iter().map(String::as_str), |_| false);
        assert!(groups.len() > 1);
        for (server, positions) in groups {
            for p in positions {
                assert_eq!(server, r.home(&keys[p]));
                assert_eq!(server, r.route(&keys[p], |_| false));
            }
        }
    }
}
