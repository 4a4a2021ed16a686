//! The cluster mode (`--redis-cluster SEED,SEED,...`, a running Redis Cluster): sync
//! `Cache::get_many` of the 100 batch items (`m0`..`m99`) over the cluster's masters, beside
//! F, a bare socket per master with that master's `GET`s pipelined (a node refuses an `MGET`
//! of keys of several slots, `CROSSSLOT`), every master's written, then every reply read, and
//! C, the same call on the memory backend (the in-process work). The rows are those of the
//! memcached `sync-get-many` path: the ratio to F + C, to F, and C; then R, F's requests on
//! sockets of their own whose replies redis-rs's own reader parses (`redis::Parser` on the
//! socket, as redis-rs's sync `Connection` reads): R - F is what that reader costs. The
//! backend's sync pool read that way until 2026-12-07; it now has a reader of its own
//! (`benches/results/floor-redis/NOTES.md`), and R stays a reference.
//!
//! The items are written by `Cache::set` on the cluster (the Redis backend's 13-byte header,
//! then the envelope); which master holds each key and its reply's length are learnt from the
//! masters after the fill (`CLUSTER SLOTS`, `CLUSTER KEYSLOT`, one `GET` each: a hit).

use std::time::Instant;

use crate::floor::items::{BoxError, FLAVOR, TTL, VERSION, Value};
use crate::floor::paths::{BATCH, Run, Side, interleave, us};
use crate::floor::redis::{REDIS_HEADER, Resp, bulk_len, get_request};
use crate::floor::report::ItemSizes;
use crate::floor::stats::Row;

/// One master as the floor sees it: its bare socket, its keys' `GET`s in one buffer, the
/// length of all their replies.
struct Master {
    addr: String,
    sock: Resp,
    requests: Vec<u8>,
    reply_len: usize,
    keys: usize,
    /// The stored bytes of its keys' values, in all.
    stored: usize,
}

/// The masters' `host:port` and slot ranges, from `CLUSTER SLOTS` of the node at `url`.
fn slot_map(url: &str) -> Result<Vec<(i64, i64, String)>, BoxError> {
    use redis::Value as V;
    let mut con = redis::Client::open(url)?.get_connection()?;
    let reply: V = redis::cmd("CLUSTER").arg("SLOTS").query(&mut con)?;
    let V::Array(ranges) = reply else {
        return Err("CLUSTER SLOTS: not a list".into());
    };
    let mut out = Vec::new();
    for r in ranges {
        let V::Array(r) = r else {
            return Err("CLUSTER SLOTS: a range that is not a list".into());
        };
        match (r.first(), r.get(1), r.get(2)) {
            (Some(V::Int(a)), Some(V::Int(b)), Some(V::Array(m))) => {
                let host = match m.first() {
                    Some(V::BulkString(h)) => String::from_utf8_lossy(h).into_owned(),
                    _ => return Err("CLUSTER SLOTS: a master without a host".into()),
                };
                let Some(V::Int(port)) = m.get(1) else {
                    return Err("CLUSTER SLOTS: a master without a port".into());
                };
                out.push((*a, *b, format!("{host}:{port}")));
            }
            _ => return Err("CLUSTER SLOTS: a malformed range".into()),
        }
    }
    Ok(out)
}

/// `redis_version` (or `valkey_version`) of the node at `url`, e.g. `redis 7.0.15`.
fn version(url: &str) -> Result<String, BoxError> {
    let mut con = redis::Client::open(url)?.get_connection()?;
    let info: String = redis::cmd("INFO").arg("server").query(&mut con)?;
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_owned()))
    };
    Ok(match (field("valkey_version:"), field("redis_version:")) {
        (Some(v), _) => format!("valkey {v}"),
        (None, Some(v)) => format!("redis {v}"),
        (None, None) => "?".into(),
    })
}

/// The cluster's server name for the table (`redis 7.0.15 cluster, 3 masters`), the
/// `sync-get-many` rows on it, and the items' sizes.
pub fn sync_get_many(
    seeds: &[String],
    io_timeout: std::time::Duration,
    rounds: usize,
    ops: usize,
    slices: usize,
) -> Result<(String, Vec<Row>, ItemSizes), BoxError> {
    let seed = seeds.first().ok_or("--redis-cluster needs a seed URL")?;
    let cache = newcache::Cache::builder()
        .redis_cluster(seeds.iter().cloned())
        .flavor(FLAVOR)
        .version(VERSION)
        .io_timeout(io_timeout)
        .build()?;
    let memory = newcache::Cache::builder()
        .flavor(FLAVOR)
        .version(VERSION)
        .in_memory()
        .build()?;
    let user: Vec<String> = (0..BATCH).map(|i| format!("m{i}")).collect();
    for (i, k) in user.iter().enumerate() {
        cache.set(k, &Value::new(i), TTL)?;
        memory.set(k, &Value::new(i), TTL)?;
    }

    // Each key's master, by its slot; the masters' sockets; each key's reply learnt.
    let map = slot_map(seed)?;
    let mut seed_con = redis::Client::open(seed.as_str())?.get_connection()?;
    let mut masters: Vec<Master> = Vec::new();
    let (mut key_bytes, mut stored_lens, mut value_lens) = (0, Vec::new(), Vec::new());
    for k in &user {
        let derived = cache.make_key(k);
        let slot: i64 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(&derived)
            .query(&mut seed_con)?;
        let addr = map
            .iter()
            .find(|(a, b, _)| (*a..=*b).contains(&slot))
            .map(|(_, _, addr)| addr.clone())
            .ok_or_else(|| format!("no master serves slot {slot}"))?;
        let at = match masters.iter().position(|m| m.addr == addr) {
            Some(at) => at,
            None => {
                let url = format!("redis://{addr}/0");
                masters.push(Master {
                    sock: Resp::connect(&url, io_timeout)?,
                    addr,
                    requests: Vec::new(),
                    reply_len: 0,
                    keys: 0,
                    stored: 0,
                });
                masters.len() - 1
            }
        };
        let m = &mut masters[at];
        let request = get_request(&derived);
        let reply = m.sock.exchange(&request)?;
        let (data, stored) = bulk_len(reply)?;
        // The envelope after the backend's header: its byte 6 is its own header's length.
        let envelope = reply
            .get(data + REDIS_HEADER + 6)
            .ok_or("a reply shorter than the headers")?;
        key_bytes = derived.len();
        stored_lens.push(stored);
        value_lens.push(stored - REDIS_HEADER - usize::from(*envelope));
        m.reply_len += reply.len();
        m.requests.extend_from_slice(&request);
        m.keys += 1;
        m.stored += stored;
    }
    masters.sort_by(|a, b| a.addr.cmp(&b.addr));
    // R: F's requests on sockets of their own, their replies read by redis-rs's reader.
    let mut read_by_redis_rs: Vec<(Master, redis::Parser)> = masters
        .iter()
        .map(|m| {
            let url = format!("redis://{}/0", m.addr);
            let sock = Resp::connect(&url, io_timeout)?;
            let m = Master {
                addr: m.addr.clone(),
                sock,
                requests: m.requests.clone(),
                reply_len: m.reply_len,
                keys: m.keys,
                stored: m.stored,
            };
            Ok::<_, BoxError>((m, redis::Parser::new()))
        })
        .collect::<Result<_, _>>()?;
    let per_master: Vec<(&str, usize)> =
        masters.iter().map(|m| (m.addr.as_str(), m.keys)).collect();
    eprintln!("redis-cluster sync-get-many: keys per master {per_master:?}");
    let name = format!("{} cluster, {} masters", version(seed)?, masters.len());
    let distinct = |mut v: Vec<usize>| {
        v.sort_unstable();
        v.dedup();
        v
    };
    let sizes = ItemSizes {
        key_bytes,
        value_encoded_bytes: distinct(value_lens),
        stored_bytes: distinct(stored_lens),
    };

    let check = |found: std::collections::HashMap<String, Value>| -> Result<(), BoxError> {
        match found.len() {
            BATCH => Ok(()),
            n => Err(format!("get_many found {n} of {BATCH}").into()),
        }
    };
    let cache = &cache;
    let user = &user;
    let client: Side<'_> = Box::new(move |n| {
        let t = Instant::now();
        for _ in 0..n {
            check(cache.get_many::<Value>(user)?)?;
        }
        Ok(Run::timed(t, n))
    });
    let wire: Side<'_> = Box::new(move |n| {
        let t = Instant::now();
        for _ in 0..n {
            for m in masters.iter_mut() {
                m.sock.send(&m.requests)?;
            }
            for m in masters.iter_mut() {
                m.sock.recv(m.reply_len)?;
            }
        }
        Ok(Run::timed(t, n))
    });
    let parsed: Side<'_> = Box::new(move |n| {
        let t = Instant::now();
        for _ in 0..n {
            for (m, _) in read_by_redis_rs.iter_mut() {
                m.sock.send(&m.requests)?;
            }
            for (m, parser) in read_by_redis_rs.iter_mut() {
                m.sock.recv_values(m.keys, m.stored, parser)?;
            }
        }
        Ok(Run::timed(t, n))
    });
    let memory = &memory;
    let in_process: Side<'_> = Box::new(move |n| {
        let t = Instant::now();
        for _ in 0..n {
            check(memory.get_many::<Value>(user)?)?;
        }
        Ok(Run::timed(t, n))
    });
    let runs = interleave(
        &format!("{name} sync-get-many"),
        rounds,
        (ops / 10).max(1),
        slices,
        &mut [client, wire, in_process, parsed],
    )?;
    let (a, f, c, r) = (us(&runs[0]), us(&runs[1]), us(&runs[2]), us(&runs[3]));
    let f_plus_c: Vec<f64> = f.iter().zip(&c).map(|(f, c)| f + c).collect();
    let r_plus_c: Vec<f64> = r.iter().zip(&c).map(|(r, c)| r + c).collect();
    let path = "sync Cache::get_many, 100 keys, the cluster's masters";
    let floor = "F: each master's GETs pipelined, a socket each, all written then all read";
    Ok((
        name,
        vec![
            Row::new(path, "F + C", "us", a.clone(), f_plus_c),
            Row::new(path, floor, "us", a.clone(), f.clone()),
            Row::new(
                "  C: Cache::get_many on the memory backend",
                "(in-process work; ratio to F)",
                "us",
                c,
                f.clone(),
            ),
            Row::new(
                path,
                "R + C, R: F with its replies read by redis-rs's reader (redis::Parser)",
                "us",
                a,
                r_plus_c,
            ),
            Row::new(
                "  R: F read by redis-rs's reader",
                "F (the reader's cost: the ratio to F)",
                "us",
                r,
                f,
            ),
        ],
        sizes,
    ))
}
