//! Key placement over several servers: libmemcached's weighted ketama continuum, so that newcache,
//! pylibmc and PHP's memcached extension agree on where each key lives. Pure: no I/O.

use md5::{Digest, Md5};
use wide::u32x8;

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

/// [`key_hash`] of every key, in order, into `out` (cleared first).
///
/// A batch's keys are hashed [`LANES`] at a time, side by side in SIMD lanes (`wide`'s
/// `u32x8`: SSE2, or AVX2 when built for it, on x86-64; NEON on aarch64; plain arrays where
/// there is no SIMD): one MD5 is a chain
/// of 64 dependent steps, while independent keys' steps run together, so a batch's keys cost
/// less side by side than one after another with `md-5` or in plain lanes. Keys of more than 55
/// bytes (more than one MD5 block) are hashed alone by `md-5`, which stays the reference: the
/// tests compare the two.
pub(crate) fn key_hashes<'k>(keys: impl Iterator<Item = &'k [u8]>, out: &mut Vec<u32>) {
    out.clear();
    // Positions in `out` of the short keys waiting for a full set of lanes.
    let mut waiting: [(usize, &[u8]); LANES] = [(0, &[]); LANES];
    let mut n = 0;
    for key in keys {
        if key.len() > ONE_BLOCK {
            out.push(key_hash(key));
            continue;
        }
        waiting[n] = (out.len(), key);
        out.push(0);
        n += 1;
        if n == LANES {
            lanes_into(&waiting, out);
            n = 0;
        }
    }
    match n {
        0 => {}
        // A lone key costs less alone than in a set of lanes.
        1 => out[waiting[0].0] = key_hash(waiting[0].1),
        _ => lanes_into(&waiting[..n], out),
    }
}

/// Keys hashed side by side.
const LANES: usize = 8;
/// The longest message whose MD5 is one block (64 bytes less the 0x80 byte and the length).
const ONE_BLOCK: usize = 55;

type Lanes = u32x8;

/// Hashes the waiting keys (at most [`LANES`], each of at most [`ONE_BLOCK`] bytes) into their
/// positions in `out`; unused lanes hash an all-zero block, and are dropped.
fn lanes_into(waiting: &[(usize, &[u8])], out: &mut [u32]) {
    // The padded block of each lane, as 16 words; word `w` of lane `l` at `m[w][l]`.
    let mut m = [[0u32; LANES]; 16];
    for (l, (_, key)) in waiting.iter().enumerate() {
        let mut block = [0u8; 64];
        block[..key.len()].copy_from_slice(key);
        block[key.len()] = 0x80;
        block[56..].copy_from_slice(&(key.len() as u64 * 8).to_le_bytes());
        for (w, word) in block.chunks_exact(4).enumerate() {
            m[w][l] = u32::from_le_bytes([word[0], word[1], word[2], word[3]]);
        }
    }
    let a = md5_first_word(&m.map(u32x8::from)).to_array();
    for (l, (pos, _)) in waiting.iter().enumerate() {
        out[*pos] = a[l];
    }
}

/// MD5's initial state (RFC 1321).
const INIT: [u32; 4] = [0x6745_2301, 0xefcd_ab89, 0x98ba_dcfe, 0x1032_5476];

/// MD5's per-step constants, `floor(abs(sin(i + 1)) * 2^32)` (RFC 1321).
const K: [u32; 64] = [
    0xd76a_a478,
    0xe8c7_b756,
    0x2420_70db,
    0xc1bd_ceee,
    0xf57c_0faf,
    0x4787_c62a,
    0xa830_4613,
    0xfd46_9501,
    0x6980_98d8,
    0x8b44_f7af,
    0xffff_5bb1,
    0x895c_d7be,
    0x6b90_1122,
    0xfd98_7193,
    0xa679_438e,
    0x49b4_0821,
    0xf61e_2562,
    0xc040_b340,
    0x265e_5a51,
    0xe9b6_c7aa,
    0xd62f_105d,
    0x0244_1453,
    0xd8a1_e681,
    0xe7d3_fbc8,
    0x21e1_cde6,
    0xc337_07d6,
    0xf4d5_0d87,
    0x455a_14ed,
    0xa9e3_e905,
    0xfcef_a3f8,
    0x676f_02d9,
    0x8d2a_4c8a,
    0xfffa_3942,
    0x8771_f681,
    0x6d9d_6122,
    0xfde5_380c,
    0xa4be_ea44,
    0x4bde_cfa9,
    0xf6bb_4b60,
    0xbebf_bc70,
    0x289b_7ec6,
    0xeaa1_27fa,
    0xd4ef_3085,
    0x0488_1d05,
    0xd9d4_d039,
    0xe6db_99e5,
    0x1fa2_7cf8,
    0xc4ac_5665,
    0xf429_2244,
    0x432a_ff97,
    0xab94_23a7,
    0xfc93_a039,
    0x655b_59c3,
    0x8f0c_cc92,
    0xffef_f47d,
    0x8584_5dd1,
    0x6fa8_7e4f,
    0xfe2c_e6e0,
    0xa301_4314,
    0x4e08_11a1,
    0xf753_7e82,
    0xbd3a_f235,
    0x2ad7_d2bb,
    0xeb86_d391,
];

/// The first word of the MD5 state after one block, lane by lane: the key hash's four bytes.
fn md5_first_word(m: &[Lanes; 16]) -> Lanes {
    let [mut a, mut b, mut c, mut d] = INIT.map(u32x8::splat);
    // Rounds of 16 steps: the mixing function, which message word step `i` of the round
    // takes, and the rotations of its four steps in turn.
    let f = |x: Lanes, y: Lanes, z: Lanes| (x & y) | (!x & z);
    let g = |x: Lanes, y: Lanes, z: Lanes| (x & z) | (y & !z);
    let h = |x: Lanes, y: Lanes, z: Lanes| x ^ y ^ z;
    let i = |x: Lanes, y: Lanes, z: Lanes| y ^ (x | !z);
    macro_rules! round {
        ($round:expr, $mix:expr, $word:expr, $s:expr) => {
            for q in 0..4 {
                let j = 4 * q;
                let at = |n: usize| {
                    let step = 16 * $round + j + n;
                    let word: fn(usize) -> usize = $word;
                    (m[word(j + n)], K[step])
                };
                step(&mut a, b, c, d, at(0), $s[0], $mix);
                step(&mut d, a, b, c, at(1), $s[1], $mix);
                step(&mut c, d, a, b, at(2), $s[2], $mix);
                step(&mut b, c, d, a, at(3), $s[3], $mix);
            }
        };
    }
    round!(0, f, |n| n, [7, 12, 17, 22]);
    round!(1, g, |n| (5 * n + 1) % 16, [5, 9, 14, 20]);
    round!(2, h, |n| (3 * n + 5) % 16, [4, 11, 16, 23]);
    round!(3, i, |n| (7 * n) % 16, [6, 10, 15, 21]);
    a + u32x8::splat(INIT[0])
}

/// One MD5 step in every lane: `a = b + ((a + mix(b, c, d) + k + m) <<< s)`.
#[inline(always)]
fn step(
    a: &mut Lanes,
    b: Lanes,
    c: Lanes,
    d: Lanes,
    (m, k): (Lanes, u32),
    s: u32,
    mix: impl Fn(Lanes, Lanes, Lanes) -> Lanes,
) {
    let t = *a + mix(b, c, d) + u32x8::splat(k) + m;
    // The rotation as two shifts: x86-64's SIMD has no rotate before AVX-512.
    *a = b + ((t << s) | (t >> (32 - s)));
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
    #[cfg(test)]
    pub(crate) fn locate(&self, key: &[u8]) -> Option<usize> {
        self.locate_hash(key_hash(key))
    }

    /// [`locate`](Self::locate) of a key whose [`key_hash`] is `h`.
    pub(crate) fn locate_hash(&self, h: u32) -> Option<usize> {
        let first = self.points.first()?;
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
    fn key_hashes_side_by_side_agree_with_md5_one_by_one() {
        // Every length around the one-block limit (55), batches of every size around a few sets
        // of lanes, short and long keys mixed, and bytes of every value.
        let keys: Vec<Vec<u8>> = (0..=130)
            .map(|len: usize| (0..len).map(|i| (i * 131 + len * 7) as u8).collect())
            .collect();
        let mut out = Vec::new();
        for size in 0..=2 * LANES + 3 {
            for start in 0..keys.len() {
                let batch: Vec<&[u8]> = (0..size)
                    .map(|j| keys[(start + j * 17) % keys.len()].as_slice())
                    .collect();
                key_hashes(batch.iter().copied(), &mut out);
                let one_by_one: Vec<u32> = batch.iter().map(|k| key_hash(k)).collect();
                assert_eq!(out, one_by_one, "batch of {size} from {start}");
            }
        }
        // The mission's keys, as `by_server` sees them.
        let derived: Vec<String> = (0..100)
            .map(|i| format!("flavor-1-{:040x}", i as u128 * 0x9e37_79b9_7f4a_7c15))
            .collect();
        key_hashes(derived.iter().map(|k| k.as_bytes()), &mut out);
        let one_by_one: Vec<u32> = derived.iter().map(|k| key_hash(k.as_bytes())).collect();
        assert_eq!(out, one_by_one);
        assert_eq!(out.len(), 100);
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
