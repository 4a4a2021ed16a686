//! Property tests: envelope and cache round trips for arbitrary values, and key derivation
//! against an independent SHA-1 + hex reference.

use std::collections::BTreeMap;
use std::time::Duration;

use newcache::__private::{FLAGS, decode_envelope, encode_envelope};
use newcache::{Cache, Codec, Ttl, default_key, validate_key};
use proptest::prelude::*;
use serde::{Deserialize, Serialize};
use sha1::{Digest, Sha1};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Record {
    id: u64,
    name: String,
    score: Option<i32>,
    tags: Vec<String>,
    attrs: BTreeMap<String, Vec<u8>>,
}

fn record() -> impl Strategy<Value = Record> {
    (
        any::<u64>(),
        ".{0,40}",
        any::<Option<i32>>(),
        prop::collection::vec(".{0,10}", 0..5),
        prop::collection::btree_map(".{0,8}", prop::collection::vec(any::<u8>(), 0..32), 0..4),
    )
        .prop_map(|(id, name, score, tags, attrs)| Record {
            id,
            name,
            score,
            tags,
            attrs,
        })
}

proptest! {
    #[test]
    fn envelope_round_trip(r in record(), soft in any::<u64>(), bincode in any::<bool>()) {
        let codec = if bincode { Codec::Bincode } else { Codec::MessagePack };
        let bytes = encode_envelope(codec, &r, soft).unwrap();
        prop_assert_eq!(decode_envelope::<Record>(FLAGS, &bytes).unwrap(), r);
    }

    #[test]
    fn truncated_envelopes_are_decode_errors(r in record(), cut in 0usize..200, bincode in any::<bool>()) {
        let codec = if bincode { Codec::Bincode } else { Codec::MessagePack };
        let bytes = encode_envelope(codec, &r, 1).unwrap();
        let cut = cut.min(bytes.len().saturating_sub(1));
        let e = decode_envelope::<Record>(FLAGS, &bytes[..cut]).unwrap_err();
        prop_assert!(e.is_decode());
    }

    #[test]
    fn cache_round_trip(key in "\\PC{0,300}", r in record()) {
        let cache = Cache::builder().in_memory().build().unwrap();
        cache.set(&key, &r, Duration::from_secs(60)).unwrap();
        prop_assert_eq!(cache.get::<Record>(&key).unwrap(), Some(r.clone()));
        cache.set_many([(key.as_str(), &r)], Ttl::Default).unwrap();
        let got = cache.get_many::<Record>(&[key.as_str()]).unwrap();
        prop_assert_eq!(got.get(&key), Some(&r));
    }

    #[test]
    fn key_derivation_matches_a_reference(flavor in "[a-z0-9_.:-]{0,20}", version in any::<u64>(), key in "\\PC{0,200}") {
        let want = format!("{flavor}-{version}-{}", hex::encode(Sha1::digest(key.as_bytes())));
        let got = default_key(&flavor, version, &key);
        prop_assert_eq!(&got, &want);
        prop_assert!(validate_key(&got).is_ok());
    }
}
