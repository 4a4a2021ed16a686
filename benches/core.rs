//! Pure-core costs: key derivation, envelope encode and decode alone with each codec (100-byte and 10 KB
//! values), and the whole facade on the memory backend next to the backend's raw byte get.
//!
//! `cargo bench --bench core`

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use newcache::{Backend, Cache, Codec, Compression, MemoryBackend, StoreMode, Ttl, default_key};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Clone)]
struct Value {
    id: u64,
    name: String,
}

fn value(bytes: usize) -> Value {
    Value {
        id: 1,
        name: "x".repeat(bytes.saturating_sub(10)),
    }
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("core");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500));
    g.bench_function("key/default_key", |b| {
        b.iter(|| default_key(black_box("prod"), 1, black_box("user:42:profile")))
    });
    for size in [100usize, 10 * 1024] {
        let v = value(size);
        for (name, codec) in [("msgpack", Codec::MessagePack), ("bincode", Codec::Bincode)] {
            let bytes = newcache::__private::encode_envelope(codec, &v, 1).expect("encode");
            g.bench_with_input(
                BenchmarkId::new(format!("envelope/encode/{name}"), size),
                &size,
                |b, _| {
                    b.iter(|| {
                        newcache::__private::encode_envelope(codec, black_box(&v), 1)
                            .expect("encode")
                    })
                },
            );
            g.bench_with_input(
                BenchmarkId::new(format!("envelope/decode/{name}"), size),
                &size,
                |b, _| {
                    b.iter(|| {
                        newcache::__private::decode_envelope::<Value>(
                            newcache::__private::FLAGS,
                            black_box(&bytes),
                        )
                        .expect("decode")
                    })
                },
            );
            // encode+decode through the cache's envelope on the memory backend (no I/O)
            let cache = Cache::builder()
                .in_memory()
                .codec(codec)
                .build()
                .expect("cache");
            cache.set("k", &v, Ttl::Default).expect("set");
            g.bench_with_input(
                BenchmarkId::new(format!("memory/get/{name}"), size),
                &size,
                |b, _| b.iter(|| cache.get::<Value>(black_box("k")).expect("get")),
            );
            g.bench_with_input(
                BenchmarkId::new(format!("memory/set/{name}"), size),
                &size,
                |b, _| b.iter(|| cache.set(black_box("k"), &v, Ttl::Default).expect("set")),
            );
        }
        // the raw backend alone, to show what the envelope and codec add on top
        let raw = MemoryBackend::default();
        let bytes = vec![7u8; size];
        raw.store(newcache::Write::new(StoreMode::Set, "k", &bytes, 0, 0))
            .expect("store");
        g.bench_with_input(
            BenchmarkId::new("memory-backend/get-bytes", size),
            &size,
            |b, _| b.iter(|| raw.get(black_box("k")).expect("get")),
        );
    }
    // Opt-in compression on a 20 KB HTML page (a rendered table): set + get on the memory
    // backend with and without LZ4; the stored size is printed.
    let page = html_page();
    for (name, compression) in [
        ("plain", Compression::Off),
        ("lz4", Compression::Lz4 { min_size: 4096 }),
    ] {
        let backend = std::sync::Arc::new(MemoryBackend::default());
        let cache = Cache::builder()
            .backend(backend.clone())
            .compression(compression)
            .build()
            .expect("cache");
        cache.set("page", &page, Ttl::Default).expect("set");
        let stored = backend
            .get(&cache.make_key("page"))
            .expect("get")
            .map_or(0, |i| i.value.len());
        println!(
            "html page {} bytes, stored {name}: {stored} bytes",
            page.len()
        );
        g.bench_function(format!("html20k/set/{name}"), |b| {
            b.iter(|| {
                cache
                    .set("page", black_box(&page), Ttl::Default)
                    .expect("set")
            })
        });
        g.bench_function(format!("html20k/get/{name}"), |b| {
            b.iter(|| cache.get::<String>(black_box("page")).expect("get"))
        });
    }
    g.finish();
}

/// About 20 KB of HTML: a table of 280 rows.
fn html_page() -> String {
    let mut page = String::from("<html><head><title>Orders</title></head><body><table>\n");
    for i in 0..280 {
        page.push_str(&format!(
            "<tr class=\"row\"><td>{i}</td><td>customer {}</td><td>{}.{:02} EUR</td></tr>\n",
            i * 7 % 97,
            i * 13 % 500,
            i % 100
        ));
    }
    page.push_str("</table></body></html>\n");
    page
}

criterion_group!(benches, bench);
criterion_main!(benches);
