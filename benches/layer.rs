//! The response cache's hit path, in process: what one request served from a warm page costs
//! through `ResponseCacheLayer` on the memory backend, next to the same origin called directly
//! (it builds the same 1 KB page from a constant, no database), measured in the same run.
//!
//! `cargo bench --features tower --bench layer`

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use http::{Request, Response, header};
use http_body_util::{BodyExt, Full};
use newcache::Cache;
use newcache::layer::ResponseCacheLayer;
use tower::{Layer, Service, ServiceExt, service_fn};

const PAGE: &str = include_str!("layer_page.html");

async fn origin(_: Request<Full<Bytes>>) -> Result<Response<Full<Bytes>>, Infallible> {
    let mut resp = Response::new(Full::new(Bytes::from_static(PAGE.as_bytes())));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        "text/html; charset=utf-8".parse().unwrap(),
    );
    h.insert(header::ETAG, "\"0406b399814b33b1\"".parse().unwrap());
    Ok(resp)
}

fn request() -> Request<Full<Bytes>> {
    Request::builder()
        .uri("/page/1")
        .header(header::HOST, "127.0.0.1:3000")
        .header(header::USER_AGENT, "wrk")
        .body(Full::new(Bytes::new()))
        .unwrap()
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let _guard = rt.enter();
    let cache = Cache::builder().build_async().unwrap();
    let layer = ResponseCacheLayer::builder(cache)
        .ttl(Duration::from_secs(3600))
        .build()
        .unwrap();
    let direct = service_fn(origin);
    let cached = layer.layer(service_fn(origin));
    // Warm the page.
    rt.block_on(async {
        let resp = cached.clone().oneshot(request()).await.unwrap();
        resp.into_body().collect().await.unwrap();
        let resp = cached.clone().oneshot(request()).await.unwrap();
        assert_eq!(resp.headers()["x-cache"], "HIT");
    });
    let mut g = c.benchmark_group("layer");
    g.bench_function("origin", |b| {
        let mut svc = direct;
        b.iter(|| {
            rt.block_on(async {
                let resp = svc.ready().await.unwrap().call(request()).await.unwrap();
                resp.into_body().collect().await.unwrap()
            })
        })
    });
    g.bench_function("hit", |b| {
        let mut svc = cached.clone();
        b.iter(|| {
            rt.block_on(async {
                let resp = svc.ready().await.unwrap().call(request()).await.unwrap();
                resp.into_body().collect().await.unwrap()
            })
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
