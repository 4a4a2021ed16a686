//! newcache against a real memcached, side by side in one run with the raw `memcache` crate client
//! (text protocol, its own pool: the fastest way to use it) and a bare socket speaking the protocol
//! by hand (the physical floor). 100-byte values; `*_many` are 100 keys per call.
//!
//! `cargo bench --bench memcached` starts its own memcached on a free loopback port (set
//! `MEMCACHED_SERVERS=host:port` to use a running one).
//!
//! On a VM whose guest uses the adaptive `haltpoll` cpuidle governor (as the project's machines
//! do), loopback round trips are bimodal: about 15 us while the CPUs poll, about 50 us once they
//! halt between requests. Each group below runs its clients one after the other for seconds, so
//! all of them settle in the same regime; compare clients within a group, not across runs.

use std::hint::black_box;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use newcache::{Backend, Cache, Ttl};
use serde::{Deserialize, Serialize};

/// The cached value: serializes to ~100 bytes, like the Python peers' `{"id": 1, "name": "x"*80}`.
#[derive(Serialize, Deserialize, Clone)]
struct Value {
    id: u64,
    name: String,
}

/// The test suite's fixture: a memcached on a free loopback port, killed on drop.
#[allow(dead_code)]
#[path = "../tests/it/fixture.rs"]
mod fixture;
/// The fixture's front-end wrapper (unused here).
#[allow(dead_code)]
#[path = "../tests/it/front.rs"]
mod front;

/// Where to measure: `MEMCACHED_SERVERS`, or a memcached of our own.
fn server() -> (String, Option<fixture::Memcached>) {
    match std::env::var("MEMCACHED_SERVERS") {
        Ok(addr) => (addr, None),
        Err(_) => {
            let m = fixture::Memcached::start();
            (m.addr(), Some(m))
        }
    }
}

/// The floor: one socket, the text protocol written by hand, replies read just enough to be whole.
struct Bare {
    r: BufReader<TcpStream>,
    line: String,
}

impl Bare {
    fn new(addr: &str) -> Bare {
        let s = TcpStream::connect(addr).expect("connect");
        s.set_nodelay(true).expect("nodelay");
        Bare {
            r: BufReader::new(s),
            line: String::new(),
        }
    }
    fn send(&mut self, cmd: &[u8]) {
        self.r.get_mut().write_all(cmd).expect("write");
    }
    fn read_line(&mut self) -> &str {
        self.line.clear();
        self.r.read_line(&mut self.line).expect("read");
        &self.line
    }
    /// Reads a get reply; returns how many values it held.
    fn read_values(&mut self) -> usize {
        let mut n = 0;
        loop {
            let line = self.read_line().to_string();
            if line.starts_with("END") {
                return n;
            }
            let len: usize = line
                .split_whitespace()
                .nth(3)
                .and_then(|l| l.parse().ok())
                .expect("VALUE line");
            let mut buf = vec![0; len + 2];
            self.r.read_exact(&mut buf).expect("value");
            n += 1;
        }
    }
    fn get(&mut self, keys: &str) -> usize {
        self.send(format!("get {keys}\r\n").as_bytes());
        self.read_values()
    }
    fn set_pipelined(&mut self, keys: &[String], value: &[u8]) {
        let mut out = Vec::with_capacity(keys.len() * (value.len() + 40));
        for k in keys {
            out.extend_from_slice(format!("set {k} 0 300 {}\r\n", value.len()).as_bytes());
            out.extend_from_slice(value);
            out.extend_from_slice(b"\r\n");
        }
        self.send(&out);
        for _ in keys {
            assert!(self.read_line().starts_with("STORED"));
        }
    }
}

fn bench(c: &mut Criterion) {
    let (addr, _server) = server();
    let v = Value {
        id: 1,
        name: "x".repeat(80),
    };
    let raw_value = vec![b'x'; 100];
    let cache = Cache::builder()
        .memcached([addr.as_str()])
        .flavor("bench")
        .build()
        .expect("cache");
    // The memcache crate at its fastest: text protocol, and our own r2d2 pool without r2d2's
    // default `version` round trip on every checkout.
    let url = memcache::Url::parse(&format!(
        "memcache://{}?protocol=ascii&tcp_nodelay=true",
        addr
    ))
    .expect("url");
    let pool = r2d2::Pool::builder()
        .max_size(1)
        .test_on_check_out(false)
        .build(memcache::ConnectionManager::new(url))
        .expect("pool");
    let client = memcache::Client::with_pool(pool).expect("memcache crate client");
    let mut bare = Bare::new(&addr);

    // 1000 keys per client, preloaded, as bench_ops.py does.
    let keys: Vec<String> = (0..1000).map(|i| format!("key:{i}")).collect();
    let raw_keys: Vec<String> = keys
        .iter()
        .map(|k| format!("raw-{}", k.replace(':', "_")))
        .collect();
    for (k, rk) in keys.iter().zip(&raw_keys) {
        cache.set(k, &v, Ttl::Default).expect("set");
        client.set(rk, raw_value.as_slice(), 300).expect("raw set");
    }
    let batch: Vec<&str> = keys[..100].iter().map(String::as_str).collect();
    let raw_batch: Vec<&str> = raw_keys[..100].iter().map(String::as_str).collect();
    let raw_batch_line = raw_batch.join(" ");
    let pairs: Vec<(&str, &Value)> = batch.iter().map(|k| (*k, &v)).collect();

    let mut g = c.benchmark_group("memcached");
    g.measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500))
        .sample_size(50);
    let mut i = 0usize;
    let mut next = || {
        i = (i + 1) % 1000;
        i
    };

    g.bench_function("get_hit/newcache", |b| {
        b.iter(|| {
            cache
                .get::<Value>(&keys[next()])
                .expect("get")
                .expect("hit")
        })
    });
    g.bench_function("get_hit/memcache-crate", |b| {
        b.iter(|| {
            let r: Option<Vec<u8>> = client.get(&raw_keys[next()]).expect("get");
            r.expect("hit")
        })
    });
    g.bench_function("get_hit/bare-socket", |b| {
        b.iter(|| assert_eq!(bare.get(&raw_keys[next()]), 1))
    });

    g.bench_function("get_miss/newcache", |b| {
        b.iter(|| cache.get::<Value>(black_box("never-set")).expect("get"))
    });
    g.bench_function("get_miss/memcache-crate", |b| {
        b.iter(|| {
            let r: Option<Vec<u8>> = client.get("never-set").expect("get");
            r
        })
    });
    g.bench_function("get_miss/bare-socket", |b| b.iter(|| bare.get("never-set")));

    g.bench_function("set/newcache", |b| {
        b.iter(|| cache.set(&keys[next()], &v, Ttl::Default).expect("set"))
    });
    g.bench_function("set/memcache-crate", |b| {
        b.iter(|| {
            client
                .set(&raw_keys[next()], raw_value.as_slice(), 300)
                .expect("set")
        })
    });
    g.bench_function("set/bare-socket", |b| {
        b.iter(|| bare.set_pipelined(&raw_keys[next()..][..1], &raw_value))
    });

    // get_many(100): each measured call is followed by an unmeasured call of its partner (the
    // facade's of the crate on raw items, everyone else's of the facade), so that every client is
    // measured in the same latency regime: loopback round trips here are bimodal (~15 or ~50 us),
    // and a regime that changes between two benchmarks run one after the other moved the
    // facade/crate ratio by 15% between runs.
    //
    // The same 100 items newcache reads (its derived keys, its enveloped values: about 1.8x the
    // bytes of the raw items), read raw, show what the facade itself adds, apart from the wire.
    let derived_batch: Vec<String> = batch.iter().map(|k| cache.make_key(k)).collect();
    let derived_refs: Vec<&str> = derived_batch.iter().map(String::as_str).collect();
    let derived_line = derived_refs.join(" ");
    let facade = || {
        assert_eq!(
            cache.get_many::<Value>(&batch).expect("get_many").len(),
            100
        )
    };
    let crate_gets = |keys: &[&str]| {
        let m: std::collections::HashMap<String, Vec<u8>> = client.gets(keys).expect("gets");
        assert_eq!(m.len(), 100);
    };
    let interleaved =
        |b: &mut criterion::Bencher<'_>, measured: &mut dyn FnMut(), partner: &mut dyn FnMut()| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let t = std::time::Instant::now();
                    measured();
                    total += t.elapsed();
                    partner();
                }
                total
            })
        };
    g.bench_function("get_many_100/newcache", |b| {
        interleaved(b, &mut || facade(), &mut || crate_gets(&raw_batch))
    });
    g.bench_function("get_many_100/memcache-crate", |b| {
        interleaved(b, &mut || crate_gets(&raw_batch), &mut || facade())
    });
    g.bench_function("get_many_100/bare-socket", |b| {
        interleaved(
            b,
            &mut || assert_eq!(bare.get(&raw_batch_line), 100),
            &mut || facade(),
        )
    });
    g.bench_function("get_many_100/memcache-crate-same-items", |b| {
        interleaved(b, &mut || crate_gets(&derived_refs), &mut || facade())
    });
    g.bench_function("get_many_100/bare-socket-same-items", |b| {
        interleaved(
            b,
            &mut || assert_eq!(bare.get(&derived_line), 100),
            &mut || facade(),
        )
    });

    g.bench_function("set_many_100/newcache", |b| {
        b.iter(|| {
            cache
                .set_many(pairs.iter().copied(), Ttl::Default)
                .expect("set_many")
        })
    });
    g.bench_function("set_many_100/memcache-crate", |b| {
        // the crate has no multi-set: 100 round trips
        b.iter(|| {
            for k in &raw_batch {
                client.set(k, raw_value.as_slice(), 300).expect("set");
            }
        })
    });
    g.bench_function("set_many_100/bare-socket", |b| {
        b.iter(|| bare.set_pipelined(&raw_keys[..100], &raw_value))
    });
    g.finish();
}

/// Multi-server batches (issue 9 §3): `MemcachedBackend::get_many` over 3 servers against the
/// physical floor, the same per-server `gets` on plain sockets, every request written first, then
/// every reply read. Each measured iteration of one client is followed by an unmeasured one of the
/// other, so both are measured in the same latency regime (loopback round trips here are bimodal).
fn multiserver(c: &mut Criterion) {
    let servers: Vec<fixture::Memcached> = (0..3).map(|_| fixture::Memcached::start()).collect();
    let addrs: Vec<String> = servers.iter().map(fixture::Memcached::addr).collect();
    let backend = newcache::MemcachedBackend::new(newcache::MemcachedConfig::new(
        addrs
            .iter()
            .map(|a| newcache::ServerSpec::parse(a).expect("address"))
            .collect(),
    ))
    .expect("backend");
    let value = vec![b'x'; 100];
    let keys: Vec<String> = (0..100).map(|i| format!("multi:{i}")).collect();
    for k in &keys {
        backend
            .store(newcache::Write::new(
                newcache::StoreMode::Set,
                k,
                &value,
                0,
                0,
            ))
            .expect("set");
    }
    let mut bare: Vec<Bare> = addrs.iter().map(|a| Bare::new(a)).collect();

    let mut g = c.benchmark_group("multiserver");
    for n in [10, 100] {
        let batch: Vec<&str> = keys[..n].iter().map(String::as_str).collect();
        // The floor's requests: one `gets` line per server holding any of the keys.
        let lines: Vec<(usize, Vec<u8>, usize)> = (0..3)
            .filter_map(|s| {
                let mine: Vec<&str> = batch
                    .iter()
                    .copied()
                    .filter(|k| backend.server_of(k) == s)
                    .collect();
                (!mine.is_empty()).then(|| {
                    (
                        s,
                        format!("gets {}\r\n", mine.join(" ")).into_bytes(),
                        mine.len(),
                    )
                })
            })
            .collect();
        let floor = |bare: &mut [Bare]| {
            for (s, line, _) in &lines {
                bare[*s].send(line);
            }
            for (s, _, want) in &lines {
                assert_eq!(bare[*s].read_values(), *want);
            }
        };
        let ours = |backend: &newcache::MemcachedBackend| {
            let got = backend.get_many(&batch);
            assert!(got.iter().all(|r| matches!(r, Ok(Some(_)))));
        };
        g.bench_function(format!("get_many_{n}/bare-sockets-floor"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let t = std::time::Instant::now();
                    floor(&mut bare);
                    total += t.elapsed();
                    ours(&backend);
                }
                total
            })
        });
        g.bench_function(format!("get_many_{n}/newcache-backend"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    floor(&mut bare);
                    let t = std::time::Instant::now();
                    ours(&backend);
                    total += t.elapsed();
                }
                total
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench, multiserver);

criterion_main!(benches);
