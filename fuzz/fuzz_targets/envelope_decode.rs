//! Arbitrary bytes under a key: the envelope + bincode decoder must return a value or a decode
//! error, never panic, abort or allocate past the item limit (libFuzzer's -rss_limit_mb and
//! -malloc_limit_mb catch the last two). The memcached reply parser gets the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::collections::HashMap;

#[derive(serde::Deserialize, Debug)]
#[allow(dead_code)]
struct User {
    id: u64,
    name: String,
    tags: Vec<String>,
    scores: HashMap<String, f64>,
    parent: Option<Box<User>>,
}

fuzz_target!(|data: &[u8]| {
    // The first byte picks the memcached flags: newcache's, or whatever the input says.
    let (flags, bytes) = match data.split_first() {
        Some((0, rest)) => (newcache::__private::FLAGS, rest),
        Some((_, rest)) if rest.len() >= 4 => {
            (u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]), &rest[4..])
        }
        _ => (newcache::__private::FLAGS, data),
    };
    if let Err(e) = newcache::__private::decode_envelope::<User>(flags, bytes) {
        assert!(e.is_decode(), "{e}");
    }
    let _ = newcache::__private::decode_envelope::<String>(flags, bytes);
    let _ = newcache::__private::decode_envelope::<Vec<u64>>(flags, bytes);
    let _ = newcache::__private::decode_envelope::<(u8, Option<String>, Vec<(u32, bool)>)>(flags, bytes);
    let _ = newcache::__private::parse_gets_reply(data, &["a", "key:1", "prod-1-0beec7b5ea3f0fdbc95d0dd47f3c5bc275da8a33"]);
});
