//! Redis Cluster's key space: a key's hash slot (CRC16 of the key or of its hash tag, mod
//! 16,384), the slot map `CLUSTER SLOTS` answers (which master serves which slots) and the
//! one form of a node's address. No I/O.

use redis::Value;

use crate::error::{Error, Result};

/// The number of hash slots.
pub(super) const SLOTS: usize = 16_384;

/// CRC16-CCITT (XMODEM: polynomial 0x1021, initial value 0), as the cluster specification's
/// `HASH_SLOT` uses it.
fn crc16(bytes: &[u8]) -> u16 {
    /// Slice-by-16 tables (8 KiB): a derived key is 48 bytes or more.
    const XMODEM: crc::Crc<u16, crc::Table<16>> =
        crc::Crc::<u16, crc::Table<16>>::new(&crc::CRC_16_XMODEM);
    XMODEM.checksum(bytes)
}

/// The hash slot of `key`: of its hash tag (what lies between the first `{` and the first `}`
/// after it, if not empty), else of the whole key.
pub(super) fn slot_of(key: &[u8]) -> u16 {
    let tagged = memchr::memchr(b'{', key).and_then(|open| {
        let rest = &key[open + 1..];
        let close = memchr::memchr(b'}', rest)?;
        (close > 0).then(|| &rest[..close])
    });
    crc16(tagged.unwrap_or(key)) % SLOTS as u16
}

/// One range of `CLUSTER SLOTS`: `first..=last` served by the master at `addr` (`host:port`),
/// whose node id is `id` (if the reply gives it: a node wiped and started again at the same
/// address has a new one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Range {
    pub(crate) first: u16,
    pub(crate) last: u16,
    pub(crate) addr: String,
    pub(crate) id: Option<String>,
}

/// `host:port`, the host in brackets if it is an IPv6 address: the one form a server's address
/// takes here, whoever names it (a seed's URL, `CLUSTER SLOTS`, a `MOVED` or `ASK`), so that
/// one server has one view (one health and replay record).
pub(super) fn addr_of(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// The ranges of a `CLUSTER SLOTS` reply (each `[first, last, master, replicas...]`, a node
/// `[host, port, id, ...]`, the id since Redis 4), masters only. A node that gives no host (`""`, `"?"`: it does not
/// know its own address) is reached at `asked`'s host, as the specification says.
pub(super) fn parse_slots(reply: Value, asked: &str) -> Result<Vec<Range>> {
    let bad = |why: &str| Error::backend(format!("CLUSTER SLOTS answered {why}"));
    let Value::Array(ranges) = reply else {
        return Err(bad("no list of ranges"));
    };
    let asked_host = asked.rsplit_once(':').map_or(asked, |(h, _)| h);
    let mut out = Vec::with_capacity(ranges.len());
    for r in ranges {
        let Value::Array(r) = r else {
            return Err(bad("a range that is not a list"));
        };
        let int = |v: Option<&Value>| match v {
            Some(Value::Int(n)) => u16::try_from(*n).ok().filter(|&n| (n as usize) < SLOTS),
            _ => None,
        };
        let (Some(first), Some(last)) = (int(r.first()), int(r.get(1))) else {
            return Err(bad("a range without its slots"));
        };
        let Some(Value::Array(master)) = r.get(2) else {
            return Err(bad("a range without its master"));
        };
        let host = match master.first() {
            Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
            Some(Value::SimpleString(s)) => s.clone(),
            _ => return Err(bad("a master without a host")),
        };
        let host = if host.is_empty() || host == "?" {
            asked_host.to_owned()
        } else {
            host
        };
        let port = match master.get(1) {
            Some(Value::Int(p)) => u16::try_from(*p).ok(),
            _ => None,
        };
        let Some(port) = port else {
            return Err(bad("a master without a port"));
        };
        if first > last {
            return Err(bad("a range that ends before it starts"));
        }
        let id = match master.get(2) {
            Some(Value::BulkString(b)) if !b.is_empty() => {
                Some(String::from_utf8_lossy(b).into_owned())
            }
            Some(Value::SimpleString(s)) if !s.is_empty() => Some(s.clone()),
            _ => None,
        };
        out.push(Range {
            first,
            last,
            addr: addr_of(&host, port),
            id,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn check(key: &str, slot: u16) {
        assert_eq!(slot_of(key.as_bytes()), slot, "{key}");
    }

    #[test]
    fn slots_are_the_specifications() {
        // The specification's check value.
        assert_eq!(crc16(b"123456789"), 0x31C3);
        check("123456789", 0x31C3); // under 16,384: the slot is the CRC
        // Values from redis-cli's CLUSTER KEYSLOT.
        check("foo", 12182);
        check("bar", 5061);
        check("", 0);
        // Hash tags: the first {...} with something inside.
        check("{user1000}.following", slot_of(b"user1000"));
        check("foo{}{bar}", slot_of(b"foo{}{bar}"));
        check("foo{{bar}}zap", slot_of(b"{bar"));
        check("foo{bar}{zap}", slot_of(b"bar"));
        // Keys past the table's 16-byte stride (Redis 7's CLUSTER KEYSLOT): a key as
        // `make_key` makes it, and a longer one.
        check("newcache-1-0beec7b5ea3f0fdbc95d0dd47f3c5bc275da8a33", 10181);
        check(
            "a-very-long-key-name-that-is-over-sixteen-bytes-long-indeed-0123456789",
            3364,
        );
    }

    /// The table-driven CRC is the bitwise one (CRC-16/XMODEM: polynomial 0x1021, initial 0)
    /// at every length up to a few strides, every byte value included.
    #[test]
    fn the_crc_is_the_bitwise_reference_at_every_length() {
        fn bitwise(bytes: &[u8]) -> u16 {
            let mut crc = 0u16;
            for &b in bytes {
                crc ^= u16::from(b) << 8;
                for _ in 0..8 {
                    crc = if crc & 0x8000 != 0 {
                        (crc << 1) ^ 0x1021
                    } else {
                        crc << 1
                    };
                }
            }
            crc
        }
        let bytes: Vec<u8> = (0..=255u8).chain((0..=255u8).rev()).collect();
        for len in 0..=bytes.len() {
            for start in [0, 1, 7, 15] {
                let key = &bytes[start.min(len)..len];
                assert_eq!(crc16(key), bitwise(key), "{len} bytes from {start}");
            }
        }
    }

    #[test]
    fn a_slot_map_names_masters() {
        let node = |host: &str, port: i64| {
            Value::Array(vec![
                Value::BulkString(host.as_bytes().to_vec()),
                Value::Int(port),
                Value::BulkString(b"id".to_vec()),
            ])
        };
        let reply = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(5460),
                node("127.0.0.1", 7000),
                node("127.0.0.1", 7003),
            ]),
            Value::Array(vec![Value::Int(5461), Value::Int(16383), node("", 7001)]),
        ]);
        let ranges = parse_slots(reply, "10.0.0.1:7000").unwrap();
        assert_eq!(
            ranges,
            vec![
                Range {
                    first: 0,
                    last: 5460,
                    addr: "127.0.0.1:7000".into(),
                    id: Some("id".into()),
                },
                Range {
                    first: 5461,
                    last: 16383,
                    addr: "10.0.0.1:7001".into(),
                    id: Some("id".into()),
                },
            ]
        );
        assert!(parse_slots(Value::Okay, "a:1").is_err());
        assert_eq!(addr_of("::1", 7000), "[::1]:7000");
    }

    #[test]
    fn a_seed_a_slot_map_and_a_redirect_name_one_ipv6_node_alike() {
        use crate::backend::redis::reply::{Redirect, redirect};
        let seed = crate::backend::redis::RedisConfig::new("redis://[::1]:7000").addr();
        let reply = Value::Array(vec![Value::Array(vec![
            Value::Int(0),
            Value::Int(16383),
            Value::Array(vec![Value::BulkString(b"::1".to_vec()), Value::Int(7000)]),
        ])]);
        let mapped = parse_slots(reply, &seed).unwrap().remove(0).addr;
        let Some(Redirect::Moved { addr: moved, .. }) = redirect("MOVED", Some("1 ::1:7000"))
        else {
            panic!("a MOVED to an IPv6 node is a redirect");
        };
        assert_eq!(
            (seed.as_str(), mapped.as_str()),
            ("[::1]:7000", "[::1]:7000")
        );
        assert_eq!(moved, seed);
        let other = crate::backend::redis::RedisConfig::new("redis://[fe80::1]:6379/0").addr();
        assert_eq!(other, "[fe80::1]:6379");
        assert_eq!(
            crate::backend::redis::RedisConfig::new("redis://10.0.0.1:7000").addr(),
            "10.0.0.1:7000"
        );
    }
}
