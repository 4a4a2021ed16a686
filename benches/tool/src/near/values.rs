//! The values `bench near` reads: a ~100-byte struct of a few fields and a 1,000-byte `String`,
//! under user keys `k0`..`k999`, and their MessagePack bytes as newcache's default codec writes
//! them (a struct as a map with its field names: `rmp_serde::to_vec_named`).

use serde::{Deserialize, Serialize, de::DeserializeOwned};

use crate::floor::items::BoxError;

/// The hot keys.
pub const KEYS: usize = 1000;

/// The user keys, `k0`..`k999`.
pub fn user_keys() -> Vec<String> {
    (0..KEYS).map(|i| format!("k{i}")).collect()
}

/// A small record: 100 bytes of MessagePack (the unit test checks it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Small {
    pub id: u64,
    pub name: String,
    pub score: f64,
    pub active: bool,
    pub tags: Vec<u32>,
}

/// A value kind: how key `i`'s value is made and recognised.
pub trait Kind: Serialize + DeserializeOwned + Send + Sync + 'static {
    /// The name in the tables.
    const NAME: &'static str;
    fn new(i: usize) -> Self;
    /// The key this value was written for.
    fn key_of(&self) -> Option<usize>;
}

impl Kind for Small {
    const NAME: &'static str = "100 B struct";
    fn new(i: usize) -> Small {
        Small {
            id: 1_000_000 + i as u64,
            name: format!("{:>52}", format!("user {i}")),
            score: i as f64 / 7.0,
            active: i.is_multiple_of(2),
            tags: vec![1, 2, 3],
        }
    }
    fn key_of(&self) -> Option<usize> {
        usize::try_from(self.id.checked_sub(1_000_000)?).ok()
    }
}

/// A 1,000-byte text (1,003 bytes encoded: below the default LZ4 threshold of 1,024, so stored
/// as it is). Key `i`'s starts with `i` and a space.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Text(pub String);

impl Kind for Text {
    const NAME: &'static str = "1 KB String";
    fn new(i: usize) -> Text {
        let mut s = format!("{i} ");
        let fill = b"abcdefghijklmnopqrstuvwxyz0123456789";
        while s.len() < 1000 {
            s.push(fill[(s.len() * 7 + i) % fill.len()] as char);
        }
        Text(s)
    }
    fn key_of(&self) -> Option<usize> {
        self.0.split(' ').next()?.parse().ok()
    }
}

/// Whether `found` is key `i`'s value of kind `K`.
pub fn check<K: Kind>(found: Option<&K>, i: usize) -> Result<(), BoxError> {
    match found.map(K::key_of) {
        Some(Some(k)) if k == i => Ok(()),
        Some(k) => Err(format!("{k:?}'s value under key {i}").into()),
        None => Err(format!("miss on key {i}").into()),
    }
}

/// The MessagePack bytes the default codec stores for `v`.
pub fn encoded<K: Kind>(v: &K) -> Vec<u8> {
    rmp_serde::to_vec_named(v).expect("a value that encodes")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_keys() {
        for i in [0, 7, 999] {
            assert_eq!(encoded(&Small::new(i)).len(), 100, "key {i}");
            assert_eq!(encoded(&Text::new(i)).len(), 1003, "key {i}");
            check(Some(&Small::new(i)), i).unwrap();
            check(Some(&Text::new(i)), i).unwrap();
        }
        assert!(check(Some(&Small::new(1)), 2).is_err());
        assert!(check(Some(&Text::new(10)), 1).is_err());
        assert!(check::<Text>(None, 1).is_err());
    }

    #[test]
    fn the_cache_stores_these_bytes() {
        use newcache::Backend;
        let memory = std::sync::Arc::new(newcache::MemoryBackend::new(
            1 << 20,
            std::sync::Arc::new(newcache::SystemClock),
        ));
        let cache = newcache::Cache::builder()
            .backend(memory.clone())
            .build()
            .unwrap();
        let ttl = std::time::Duration::from_secs(60);
        cache.set("s", &Small::new(3), ttl).unwrap();
        cache.set("t", &Text::new(3), ttl).unwrap();
        let item = |k| memory.get(&cache.make_key(k)).unwrap().unwrap().value;
        assert!(item("s").ends_with(&encoded(&Small::new(3))));
        assert!(item("t").ends_with(&encoded(&Text::new(3))));
    }
}
