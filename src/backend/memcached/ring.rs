//! Key placement over several servers: libmemcached's weighted ketama continuum, so that newcache,
//! pylibmc and PHP's memcached extension agree on where each key lives. Pure: no I/O.

use md5::{Digest, Md5};

/// Points per server for equal weights: 40 MD5 digests x 4 points each.
const POINTS_PER_SERVER: f32 = 160.0;
const POINTS_PER_HASH: usize = 4;
const DEFAULT_PORT: u16 = 11211;

/// A server as the ring names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Node {
    pub(crate) host: String,
    pub(crate) port: u16,
    pub(crate) weight: u32,
}

/// The ketama continuum: sorted (point, server index) pairs.
#[derive(Debug, Clone)]
pub(crate) struct Ring {
    points: Vec<(u32, usize)>,
}

/// libmemcached's key hash for ketama: the first four bytes of the MD5, little-endian.
pub(crate) fn key_hash(key: &[u8]) -> u32 {
    let d = Md5::digest(key);
    u32::from_le_bytes([d[0], d[1], d[2], d[3]])
}

impl Ring {
    /// Builds the continuum over the servers whose `live` flag is set (index = position in `nodes`).
    pub(crate) fn new(nodes: &[Node], live: &[bool]) -> Ring {
        let live_count = live.iter().filter(|l| **l).count();
        let total_weight: u64 = nodes
            .iter()
            .zip(live)
            .filter(|(_, l)| **l)
            .map(|(n, _)| u64::from(n.weight.max(1)))
            .sum();
        let mut points = Vec::with_capacity(live_count * POINTS_PER_SERVER as usize);
        for (index, node) in nodes.iter().enumerate() {
            if !live[index] {
                continue;
            }
            // libmemcached computes this in single precision, then floors in double.
            let pct = node.weight.max(1) as f32 / total_weight as f32;
            let per_server = ((f64::from(pct * POINTS_PER_SERVER / 4.0 * live_count as f32)
                + 0.000_000_000_1)
                .floor() as usize)
                * 4;
            for i in 0..per_server / POINTS_PER_HASH {
                let name = if node.port == DEFAULT_PORT {
                    format!("{}-{}", node.host, i)
                } else {
                    format!("{}:{}-{}", node.host, node.port, i)
                };
                let d = Md5::digest(name.as_bytes());
                for a in 0..POINTS_PER_HASH {
                    let p =
                        u32::from_le_bytes([d[4 * a], d[4 * a + 1], d[4 * a + 2], d[4 * a + 3]]);
                    points.push((p, index));
                }
            }
        }
        // Stable sort by point only: equal points keep server order, as libmemcached's qsort
        // usually does (ties are astronomically rare with 32-bit points).
        points.sort_by_key(|&(p, _)| p);
        Ring { points }
    }

    /// The server index for a key: the first point at or after the key's hash, wrapping around.
    /// `None` when no server is live.
    pub(crate) fn locate(&self, key: &[u8]) -> Option<usize> {
        let first = self.points.first()?;
        let h = key_hash(key);
        let i = self.points.partition_point(|&(p, _)| p < h);
        Some(self.points.get(i).unwrap_or(first).1)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.points.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(specs: &[(&str, u16, u32)]) -> Vec<Node> {
        specs
            .iter()
            .map(|&(h, p, w)| Node {
                host: h.to_string(),
                port: p,
                weight: w,
            })
            .collect()
    }

    #[test]
    fn equal_weights_give_160_points_each() {
        let n = nodes(&[("a", 11211, 1), ("b", 11211, 1), ("c", 22122, 1)]);
        assert_eq!(Ring::new(&n, &[true; 3]).len(), 480);
        assert_eq!(Ring::new(&n, &[true, false, true]).len(), 320);
    }

    #[test]
    fn weights_scale_points() {
        let n = nodes(&[("a", 11211, 3), ("b", 11211, 1)]);
        // pct 0.75 * 40 * 2 = 60 digests = 240 points; 0.25 -> 20 digests = 80 points
        assert_eq!(Ring::new(&n, &[true, true]).len(), 320);
    }

    #[test]
    fn key_hash_is_md5_prefix_le() {
        // md5("foo") = acbd18db4cc2f85cedef654fccc4a4d8
        assert_eq!(key_hash(b"foo"), 0xdb18bdac);
    }

    #[test]
    fn removing_a_server_moves_only_its_keys() {
        let n = nodes(&[
            ("10.0.0.1", 11211, 1),
            ("10.0.0.2", 11211, 1),
            ("10.0.0.3", 11211, 1),
            ("10.0.0.4", 11211, 1),
        ]);
        let all = Ring::new(&n, &[true; 4]);
        let three = Ring::new(&n, &[true, true, true, false]);
        let keys: Vec<String> = (0..20_000).map(|i| format!("key:{i}")).collect();
        let mut moved = 0;
        for k in &keys {
            let a = all.locate(k.as_bytes()).unwrap();
            let b = three.locate(k.as_bytes()).unwrap();
            if a != b {
                assert_eq!(a, 3, "only keys of the removed server move");
                moved += 1;
            }
        }
        let frac = moved as f64 / keys.len() as f64;
        assert!((0.15..0.35).contains(&frac), "moved {frac}");
        assert_eq!(Ring::new(&n, &[false; 4]).locate(b"k"), None);
    }
}
