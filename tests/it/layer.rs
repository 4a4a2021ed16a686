//! The response cache (`newcache::layer`, feature `tower`) on every backend (memory, a real
//! memcached, twemproxy): what a client sees (status, body, `X-Cache`, `Age`) and how often the
//! origin is called. The origin is a `tower::service_fn` that counts its calls; one test runs
//! the layer inside an axum `Router`.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use http_body_util::combinators::BoxBody;
use newcache::AsyncCache;
use newcache::layer::{CookiePolicy, HostPolicy, ResponseCacheBuilder, ResponseCacheLayer};
use tokio::sync::{Barrier, Semaphore};
use tower::{Layer, Service, ServiceExt};

use crate::fixture::{Env, Hooked};

crate::on_every_backend_async!(
    a_page_is_fetched_once_then_served_with_its_age,
    the_query_is_normalised_and_cache_busters_ignored,
    head_is_answered_from_the_get_entry,
    authorization_is_served_only_public_pages,
    cookie_policies,
    uncacheable_responses_are_never_stored,
    statuses_are_configurable,
    vary_headers_key_the_variants,
    s_maxage_over_max_age_over_the_layer_ttl,
    a_stale_page_is_refreshed_once_and_served_stale_meanwhile,
    if_none_match_is_answered_304_from_the_entry,
    streams_and_large_bodies_pass_through_whole,
    bodies_are_stored_as_raw_bytes,
    sixty_four_requests_for_a_cold_url_make_one_origin_call,
    two_processes_share_one_fetch_per_expiry,
    hit_for_pass_sends_requests_straight_to_the_origin,
    a_flood_of_no_cache_requests_revalidates_once,
    other_methods_pass_untouched,
    through_an_axum_router,
    a_host_with_a_path_cannot_take_another_urls_key,
    repeated_params_in_another_order_are_another_url,
    vary_values_that_are_not_utf8_do_not_share_a_variant,
    the_origins_age_counts_against_freshness,
    a_comma_inside_an_etag_is_not_a_wildcard,
    a_refresh_answered_503_keeps_the_stale_page,
    waiters_on_a_failed_fetch_do_not_stampede_the_origin,
    a_cancelled_leader_lets_the_next_request_fetch,
    must_revalidate_is_never_served_stale,
    no_304_for_a_stored_non_2xx,
    a_revalidation_that_finds_a_vary_keeps_the_variants_apart,
    expires_in_the_past_is_not_fresh,
    a_panicking_origin_releases_the_claim,
    an_unsafe_method_invalidates_the_stored_page,
    one_clients_range_request_does_not_turn_the_cache_off,
    a_5xx_on_a_cold_url_leaves_no_marker,
    a_refresh_answered_404_keeps_the_page,
    a_revalidation_under_way_does_not_undo_an_invalidation,
    a_variant_fill_that_stopped_varying_does_not_undo_an_invalidation,
    a_get_after_a_put_does_not_join_a_fill_from_before_it,
    a_revalidated_later_variant_that_stopped_varying_updates_the_page,
    the_first_variant_revalidated_that_stopped_varying_updates_the_page,
    a_revalidation_keeps_the_page_on_an_error_and_passes_on_private,
    hop_by_hop_headers_are_not_stored,
    invalidate_removes_a_page_and_its_variants,
    a_single_site_layer_keys_no_host,
    invalidate_of_a_path_is_refused_where_pages_are_keyed_per_host,
    invalidate_of_a_path_reaches_every_host_the_layer_was_told,
    ignore_only_params_replaces_the_default_list,
    the_layers_fills_are_not_counted_as_the_users_loads,
);

type B = BoxBody<Bytes, Infallible>;

/// What the origin answers: a function of the request and of its call number (1, 2, ...).
type Respond = dyn Fn(&Request<()>, usize) -> Response<B> + Send + Sync;

/// A counting origin. With a gate, each call first waits for a permit of it.
#[derive(Clone)]
struct Origin {
    calls: Arc<AtomicUsize>,
    gate: Option<Arc<Semaphore>>,
    /// Every call waits here until this many calls are in the origin at once.
    together: Option<Arc<Barrier>>,
    /// The request headers each call saw.
    seen: Arc<std::sync::Mutex<Vec<HeaderMap>>>,
    respond: Arc<Respond>,
}

impl Origin {
    fn new(respond: impl Fn(&Request<()>, usize) -> Response<B> + Send + Sync + 'static) -> Self {
        Origin {
            calls: Arc::new(AtomicUsize::new(0)),
            gate: None,
            together: None,
            seen: Arc::default(),
            respond: Arc::new(respond),
        }
    }

    /// An origin answering 200 with `body` and these headers.
    fn page(body: &'static str, headers: &'static [(&'static str, &'static str)]) -> Self {
        Origin::new(move |_, _| response(StatusCode::OK, headers, body))
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    fn service(
        &self,
    ) -> impl Service<Request<()>, Response = Response<B>, Error = Infallible, Future: Send>
    + Clone
    + Send
    + 'static {
        let this = self.clone();
        tower::service_fn(move |req: Request<()>| {
            let this = this.clone();
            async move {
                let n = this.calls.fetch_add(1, Ordering::SeqCst) + 1;
                this.seen.lock().unwrap().push(req.headers().clone());
                if let Some(gate) = &this.gate {
                    gate.acquire().await.expect("gate open").forget();
                }
                if let Some(together) = &this.together {
                    together.wait().await;
                }
                Ok::<_, Infallible>((this.respond)(&req, n))
            }
        })
    }
}

/// Opens `gate` once `ready()` holds (or after 30 s, so that a wrong expectation fails an
/// assertion instead of hanging the test).
fn release_when(gate: Arc<Semaphore>, ready: impl Fn() -> bool + Send + Sync + 'static) {
    tokio::spawn(async move {
        let wait = async {
            while !ready() {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(30), wait).await;
        gate.add_permits(1 << 20);
    });
}

fn response(status: StatusCode, headers: &[(&str, &str)], body: impl Into<Bytes>) -> Response<B> {
    let mut r = Response::new(http_body_util::Full::new(body.into()).boxed());
    *r.status_mut() = status;
    for (n, v) in headers {
        r.headers_mut().append(
            http::HeaderName::from_bytes(n.as_bytes()).unwrap(),
            v.parse().unwrap(),
        );
    }
    r
}

/// A body of unknown length: its chunks, one frame each.
struct Chunks(VecDeque<Bytes>);

impl http_body::Body for Chunks {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.0.pop_front().map(|c| Ok(http_body::Frame::data(c))))
    }
}

fn cache(env: &Env) -> AsyncCache {
    env.builder().build_async().expect("async cache builds")
}

fn layer(env: &Env) -> ResponseCacheBuilder {
    ResponseCacheLayer::builder(cache(env))
}

/// What a client sees.
#[derive(Debug)]
struct Seen {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Seen {
    fn x_cache(&self) -> &str {
        self.headers
            .get("x-cache")
            .map_or("", |v| v.to_str().unwrap())
    }
    fn age(&self) -> u64 {
        self.headers["age"].to_str().unwrap().parse().unwrap()
    }
}

fn get(uri: &str) -> Request<()> {
    Request::get(uri).body(()).unwrap()
}

fn get_with(uri: &str, headers: &[(&str, &str)]) -> Request<()> {
    let mut b = Request::get(uri);
    for (n, v) in headers {
        b = b.header(*n, *v);
    }
    b.body(()).unwrap()
}

async fn send<S, RB>(svc: &S, req: Request<()>) -> Seen
where
    S: Service<Request<()>, Response = Response<RB>> + Clone,
    S::Error: std::fmt::Debug,
    RB: http_body::Body<Data = Bytes>,
    RB::Error: std::fmt::Debug,
{
    let resp = svc.clone().oneshot(req).await.expect("the service answers");
    let (parts, body) = resp.into_parts();
    Seen {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.expect("the body").to_bytes(),
    }
}

/// Runs `n` requests at once (each made by `req(i)`) and returns what each saw.
async fn at_once<S, RB>(svc: &S, n: usize, req: impl Fn(usize) -> Request<()>) -> Vec<Seen>
where
    S: Service<Request<()>, Response = Response<RB>> + Clone + Send + Sync + 'static,
    S::Future: Send,
    S::Error: std::fmt::Debug,
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: std::fmt::Debug,
{
    let start = Arc::new(Barrier::new(n));
    let mut tasks = Vec::new();
    for i in 0..n {
        let (svc, start, req) = (svc.clone(), start.clone(), req(i));
        tasks.push(tokio::spawn(async move {
            start.wait().await;
            send(&svc, req).await
        }));
    }
    let mut seen = Vec::new();
    for t in tasks {
        seen.push(t.await.unwrap());
    }
    seen
}

fn count(seen: &[Seen], x_cache: &str) -> usize {
    seen.iter().filter(|s| s.x_cache() == x_cache).count()
}

async fn a_page_is_fetched_once_then_served_with_its_age(env: Env) {
    let origin = Origin::page("<h1>hello</h1>", &[("content-type", "text/html")]);
    let svc = layer(&env).build().unwrap().layer(origin.service());
    let first = send(&svc, get("/hello")).await;
    assert_eq!((first.status, first.x_cache()), (StatusCode::OK, "MISS"));
    assert_eq!(first.body, "<h1>hello</h1>");
    assert_eq!(first.age(), 0);
    env.advance(Duration::from_secs(7));
    let again = send(&svc, get("/hello")).await;
    assert_eq!((again.status, again.x_cache()), (StatusCode::OK, "HIT"));
    assert_eq!(again.body, "<h1>hello</h1>");
    assert_eq!(again.headers["content-type"], "text/html");
    assert_eq!(again.age(), 7, "seconds since the origin answered");
    assert_eq!(origin.calls(), 1);
    let other = send(&svc, get("/other")).await;
    assert_eq!(other.x_cache(), "MISS");
    assert_eq!(origin.calls(), 2);
}

/// The query is sorted; `ignore_params` adds to the default list (`utm_*`, `_`, `fbclid`,
/// `gclid` stay ignored).
async fn the_query_is_normalised_and_cache_busters_ignored(env: Env) {
    let origin = Origin::page("list", &[]);
    let svc = layer(&env)
        .ignore_params(["ref"])
        .build()
        .unwrap()
        .layer(origin.service());
    assert_eq!(send(&svc, get("/list?b=2&a=1")).await.x_cache(), "MISS");
    for uri in [
        "/list?a=1&b=2",
        "/list?utm_source=mail&b=2&a=1&utm_medium=x",
        "/list?_=1700000000&a=1&b=2",
        "/list?a=1&fbclid=abc&b=2&gclid=def",
        "/list?a=1&ref=home&b=2",
    ] {
        assert_eq!(send(&svc, get(uri)).await.x_cache(), "HIT", "{uri}");
    }
    assert_eq!(origin.calls(), 1);
    assert_eq!(send(&svc, get("/list?a=1&b=3")).await.x_cache(), "MISS");
    assert_eq!(origin.calls(), 2);
}

async fn head_is_answered_from_the_get_entry(env: Env) {
    let origin = Origin::page("0123456789", &[]);
    let svc = layer(&env).build().unwrap().layer(origin.service());
    let head = |uri| Request::head(uri).body(()).unwrap();
    // Nothing stored yet: HEAD goes to the origin and stores nothing.
    let cold = send(&svc, head("/doc")).await;
    assert_eq!(cold.x_cache(), "PASS");
    assert_eq!(origin.calls(), 1);
    assert_eq!(send(&svc, get("/doc")).await.x_cache(), "MISS");
    assert_eq!(origin.calls(), 2);
    let warm = send(&svc, head("/doc")).await;
    assert_eq!((warm.status, warm.x_cache()), (StatusCode::OK, "HIT"));
    assert!(warm.body.is_empty(), "HEAD has no body");
    assert_eq!(warm.headers["content-length"], "10");
    assert_eq!(origin.calls(), 2);
}

async fn authorization_is_served_only_public_pages(env: Env) {
    let private_ish = Origin::page("for anyone", &[]);
    let svc = layer(&env).build().unwrap().layer(private_ish.service());
    assert_eq!(send(&svc, get("/a")).await.x_cache(), "MISS");
    let authed = get_with("/a", &[("authorization", "Bearer t")]);
    let seen = send(&svc, authed).await;
    assert_eq!(
        seen.x_cache(),
        "PASS",
        "a stored page without public or s-maxage"
    );
    assert_eq!(private_ish.calls(), 2);

    for cc in ["public, max-age=60", "s-maxage=60"] {
        let public =
            Origin::new(move |_, _| response(StatusCode::OK, &[("cache-control", cc)], "pub"));
        let svc = layer(&env).build().unwrap().layer(public.service());
        let uri = format!("/pub-{}", cc.len());
        // A request with Authorization never fills the cache.
        let authed = || get_with(&uri, &[("authorization", "Bearer t")]);
        assert_eq!(send(&svc, authed()).await.x_cache(), "PASS");
        assert_eq!(send(&svc, get(&uri)).await.x_cache(), "MISS", "{cc}");
        let seen = send(&svc, authed()).await;
        assert_eq!(
            (seen.x_cache(), &seen.body[..]),
            ("HIT", &b"pub"[..]),
            "{cc}"
        );
        assert_eq!(public.calls(), 2, "{cc}");
    }
}

async fn cookie_policies(env: Env) {
    let with = |c: &'static str| move |uri: &str| get_with(uri, &[("cookie", c)]);
    // Pass (the default): neither served from the cache nor stored.
    let origin = Origin::page("p", &[]);
    let svc = layer(&env).build().unwrap().layer(origin.service());
    assert_eq!(send(&svc, get("/c")).await.x_cache(), "MISS");
    assert_eq!(send(&svc, with("s=1")("/c")).await.x_cache(), "PASS");
    assert_eq!(send(&svc, with("s=1")("/d")).await.x_cache(), "PASS");
    assert_eq!(
        send(&svc, get("/d")).await.x_cache(),
        "MISS",
        "the cookie request stored nothing"
    );
    assert_eq!(origin.calls(), 4);

    // Ignore: the cookie makes no difference.
    let origin = Origin::page("i", &[]);
    let svc = layer(&env)
        .namespace("ignore")
        .cookies(CookiePolicy::Ignore)
        .build()
        .unwrap()
        .layer(origin.service());
    assert_eq!(send(&svc, with("s=1")("/c")).await.x_cache(), "MISS");
    assert_eq!(send(&svc, get("/c")).await.x_cache(), "HIT");
    assert_eq!(send(&svc, with("s=2")("/c")).await.x_cache(), "HIT");
    assert_eq!(origin.calls(), 1);

    // Key: one entry per cookie string.
    let origin = Origin::new(|req, _| {
        let c = req
            .headers()
            .get("cookie")
            .map_or("none", |v| v.to_str().unwrap());
        response(StatusCode::OK, &[], c.to_string())
    });
    let svc = layer(&env)
        .namespace("keyed")
        .cookies(CookiePolicy::Key)
        .build()
        .unwrap()
        .layer(origin.service());
    assert_eq!(send(&svc, with("s=1")("/c")).await.x_cache(), "MISS");
    assert_eq!(send(&svc, with("s=2")("/c")).await.x_cache(), "MISS");
    let one = send(&svc, with("s=1")("/c")).await;
    assert_eq!((one.x_cache(), &one.body[..]), ("HIT", &b"s=1"[..]));
    let two = send(&svc, with("s=2")("/c")).await;
    assert_eq!((two.x_cache(), &two.body[..]), ("HIT", &b"s=2"[..]));
    assert_eq!(send(&svc, get("/c")).await.x_cache(), "MISS");
    assert_eq!(origin.calls(), 3);
}

async fn uncacheable_responses_are_never_stored(env: Env) {
    for (i, headers) in [
        &[("set-cookie", "session=1")][..],
        &[("cache-control", "private, max-age=60")],
        &[("cache-control", "no-store")],
        &[("vary", "*")],
        &[("cache-control", "max-age=0")],
    ]
    .into_iter()
    .enumerate()
    {
        let headers: &'static [(&'static str, &'static str)] = headers;
        let origin = Origin::page("x", headers);
        let svc = layer(&env).build().unwrap().layer(origin.service());
        let uri = format!("/u{i}");
        for n in 1..=3 {
            let seen = send(&svc, get(&uri)).await;
            assert_eq!(
                (seen.x_cache(), &seen.body[..]),
                ("PASS", &b"x"[..]),
                "{headers:?}"
            );
            assert_eq!(
                origin.calls(),
                n,
                "{headers:?}: every request reaches the origin"
            );
        }
        // The origin's own headers reach the client.
        let seen = send(&svc, get(&uri)).await;
        assert_eq!(seen.headers[headers[0].0], headers[0].1);
    }
}

async fn statuses_are_configurable(env: Env) {
    let origin = Origin::new(|_, _| response(StatusCode::NOT_FOUND, &[], "gone"));
    let svc = layer(&env).build().unwrap().layer(origin.service());
    assert_eq!(send(&svc, get("/missing")).await.x_cache(), "PASS");
    assert_eq!(send(&svc, get("/missing")).await.x_cache(), "PASS");
    assert_eq!(origin.calls(), 2, "404 is not stored by default");

    let origin = Origin::new(|_, _| response(StatusCode::NOT_FOUND, &[], "gone"));
    let svc = layer(&env)
        .namespace("s404")
        .statuses([StatusCode::OK, StatusCode::NOT_FOUND])
        .build()
        .unwrap()
        .layer(origin.service());
    assert_eq!(send(&svc, get("/missing")).await.x_cache(), "MISS");
    let seen = send(&svc, get("/missing")).await;
    assert_eq!(
        (seen.status, seen.x_cache()),
        (StatusCode::NOT_FOUND, "HIT")
    );
    assert_eq!(origin.calls(), 1);
}

async fn vary_headers_key_the_variants(env: Env) {
    let origin = Origin::new(|req, _| {
        let lang = req
            .headers()
            .get("accept-language")
            .map_or("none", |v| v.to_str().unwrap());
        let body = format!("page in {lang}");
        response(StatusCode::OK, &[("vary", "Accept-Language")], body)
    });
    let svc = layer(&env).build().unwrap().layer(origin.service());
    let lang = |l| get_with("/v", &[("accept-language", l)]);
    assert_eq!(send(&svc, lang("en")).await.x_cache(), "MISS");
    assert_eq!(send(&svc, lang("fr")).await.x_cache(), "MISS");
    assert_eq!(send(&svc, get("/v")).await.x_cache(), "MISS");
    for (l, body) in [("en", "page in en"), ("fr", "page in fr")] {
        let seen = send(&svc, lang(l)).await;
        assert_eq!((seen.x_cache(), &seen.body[..]), ("HIT", body.as_bytes()));
        assert_eq!(seen.headers["vary"], "Accept-Language");
    }
    let none = send(&svc, get("/v")).await;
    assert_eq!(
        (none.x_cache(), &none.body[..]),
        ("HIT", &b"page in none"[..])
    );
    assert_eq!(origin.calls(), 3);
}

async fn s_maxage_over_max_age_over_the_layer_ttl(env: Env) {
    // (the response's Cache-Control, the seconds it is fresh for) with a layer ttl of 30 s.
    for (i, (cc, fresh)) in [
        ("max-age=10, s-maxage=100", 100),
        ("max-age=10", 10),
        ("public", 30),
    ]
    .into_iter()
    .enumerate()
    {
        let env = Env::new(env.kind, "ttl");
        let origin = Origin::new(move |_, n| {
            response(StatusCode::OK, &[("cache-control", cc)], format!("v{n}"))
        });
        let svc = layer(&env)
            .ttl(Duration::from_secs(30))
            .build()
            .unwrap()
            .layer(origin.service());
        let uri = format!("/t{i}");
        assert_eq!(send(&svc, get(&uri)).await.x_cache(), "MISS");
        env.advance(Duration::from_secs(fresh - 1));
        assert_eq!(
            send(&svc, get(&uri)).await.x_cache(),
            "HIT",
            "{cc} at {}",
            fresh - 1
        );
        env.advance(Duration::from_secs(2));
        // Expired: this request is the one that refreshes it.
        let seen = send(&svc, get(&uri)).await;
        assert_eq!(
            (seen.x_cache(), &seen.body[..]),
            ("MISS", &b"v2"[..]),
            "{cc} at {}",
            fresh + 1
        );
        assert_eq!(origin.calls(), 2, "{cc}");
    }
}

async fn a_stale_page_is_refreshed_once_and_served_stale_meanwhile(env: Env) {
    let mut origin = Origin::new(|_, n| response(StatusCode::OK, &[], format!("v{n}")));
    let gate = Arc::new(Semaphore::new(1));
    origin.gate = Some(gate.clone());
    let svc = layer(&env).build().unwrap().layer(origin.service());
    assert_eq!(send(&svc, get("/hot")).await.body, "v1");
    env.advance(Duration::from_secs(61));
    // The refresh waits at the gate until the others have been answered.
    let refresh = {
        let svc = svc.clone();
        tokio::spawn(async move { send(&svc, get("/hot")).await })
    };
    while origin.calls() < 2 {
        tokio::task::yield_now().await;
    }
    let others = at_once(&svc, 16, |_| get("/hot")).await;
    for seen in &others {
        assert_eq!((seen.x_cache(), &seen.body[..]), ("STALE", &b"v1"[..]));
        assert!(seen.age() >= 61);
    }
    gate.add_permits(1);
    let refreshed = refresh.await.unwrap();
    assert_eq!(
        (refreshed.x_cache(), &refreshed.body[..]),
        ("MISS", &b"v2"[..])
    );
    let after = send(&svc, get("/hot")).await;
    assert_eq!((after.x_cache(), &after.body[..]), ("HIT", &b"v2"[..]));
    assert_eq!(origin.calls(), 2, "one origin call per expiry");
}

async fn if_none_match_is_answered_304_from_the_entry(env: Env) {
    let origin = Origin::page(
        "tagged",
        &[("etag", "\"v1\""), ("cache-control", "max-age=60")],
    );
    let svc = layer(&env).build().unwrap().layer(origin.service());
    let cond = |tag| get_with("/e", &[("if-none-match", tag)]);
    let first = send(&svc, cond("\"v1\"")).await;
    assert_eq!(
        (first.status, first.x_cache()),
        (StatusCode::NOT_MODIFIED, "MISS")
    );
    assert!(first.body.is_empty());
    assert_eq!(first.headers["etag"], "\"v1\"");
    assert_eq!(first.headers["cache-control"], "max-age=60");
    assert!(
        origin.seen.lock().unwrap()[0]
            .get("if-none-match")
            .is_none(),
        "the origin is asked for the page, not a 304"
    );
    let hit = send(&svc, cond("W/\"v1\"")).await;
    assert_eq!(
        (hit.status, hit.x_cache()),
        (StatusCode::NOT_MODIFIED, "HIT")
    );
    let other = send(&svc, cond("\"v0\"")).await;
    assert_eq!((other.status, other.x_cache()), (StatusCode::OK, "HIT"));
    assert_eq!(other.body, "tagged");
    assert_eq!(origin.calls(), 1);
}

async fn streams_and_large_bodies_pass_through_whole(env: Env) {
    let chunks: Vec<Bytes> = (0..50).map(|i| Bytes::from(vec![i as u8; 1000])).collect();
    let whole: Vec<u8> = chunks.iter().flat_map(|c| c.to_vec()).collect();
    let streamed = chunks.clone();
    let origin = Origin::new(move |_, _| Response::new(Chunks(streamed.clone().into()).boxed()));
    let svc = layer(&env).build().unwrap().layer(origin.service());
    for _ in 0..2 {
        let seen = send(&svc, get("/stream")).await;
        assert_eq!(seen.x_cache(), "PASS");
        assert_eq!(seen.body, whole, "never truncated");
    }
    assert_eq!(origin.calls(), 2);

    let big = Bytes::from(vec![7u8; 5000]);
    let body = big.clone();
    let origin = Origin::new(move |_, _| response(StatusCode::OK, &[], body.clone()));
    let svc = layer(&env)
        .namespace("big")
        .max_body_size(4096)
        .build()
        .unwrap()
        .layer(origin.service());
    for _ in 0..2 {
        let seen = send(&svc, get("/big")).await;
        assert_eq!((seen.x_cache(), seen.body.len()), ("PASS", 5000));
        assert_eq!(seen.body, big);
    }
    assert_eq!(origin.calls(), 2);
    // At the limit, it is stored.
    let small = Bytes::from(vec![8u8; 4096]);
    let body = small.clone();
    let origin = Origin::new(move |_, _| response(StatusCode::OK, &[], body.clone()));
    let svc = layer(&env)
        .namespace("fits")
        .max_body_size(4096)
        .build()
        .unwrap()
        .layer(origin.service());
    assert_eq!(send(&svc, get("/big")).await.x_cache(), "MISS");
    assert_eq!(send(&svc, get("/big")).await.body, small);
    assert_eq!(origin.calls(), 1);
}

async fn bodies_are_stored_as_raw_bytes(env: Env) {
    // A body no serializer would leave as it is (MessagePack would prefix it, and a
    // per-element encoding would interleave markers).
    let body: Vec<u8> = (0..=255u8).cycle().take(3000).collect();
    let page = Bytes::from(body.clone());
    let origin = Origin::new(move |_, _| response(StatusCode::OK, &[], page.clone()));
    let cache = cache(&env);
    let svc = ResponseCacheLayer::new(cache.clone()).layer(origin.service());
    assert_eq!(send(&svc, get("/raw")).await.x_cache(), "MISS");
    // No Host header and a relative URI: the page key is the namespace and the path.
    let item = env
        .raw_get(&cache.make_key("page:/raw"))
        .expect("the page is stored under its key");
    assert!(
        item.windows(body.len()).any(|w| w == body.as_slice()),
        "the body's bytes lie contiguous in the item"
    );
    assert!(item.ends_with(&body));
    // The envelope marks the payload raw (flags bit 1 of byte 5): no codec wrote it.
    assert_eq!(item[5] & 2, 2, "a raw payload");
}

async fn sixty_four_requests_for_a_cold_url_make_one_origin_call(env: Env) {
    let origin = Origin::new(|_, _| response(StatusCode::OK, &[], "report"));
    let mut slow = origin.clone();
    // The origin holds each call until a permit arrives, so the 64 overlap for sure.
    let gate = Arc::new(Semaphore::new(0));
    slow.gate = Some(gate.clone());
    let svc = layer(&env).build().unwrap().layer(slow.service());
    let release = tokio::spawn(async move {
        while slow.calls() == 0 {
            tokio::task::yield_now().await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        gate.add_permits(64);
    });
    let seen = at_once(&svc, 64, |_| get("/cold")).await;
    release.await.unwrap();
    assert!(
        seen.iter()
            .all(|s| s.status == StatusCode::OK && s.body == "report")
    );
    assert_eq!(origin.calls(), 1, "64 requests, one origin call");
    assert_eq!(count(&seen, "MISS"), 1);
    assert_eq!(count(&seen, "HIT"), 63);
}

async fn two_processes_share_one_fetch_per_expiry(env: Env) {
    let mut origin = Origin::new(|_, n| response(StatusCode::OK, &[], format!("v{n}")));
    let gate = Arc::new(Semaphore::new(0));
    origin.gate = Some(gate.clone());
    // Two caches over one backend stand in for two processes.
    let (cache_a, cache_b) = (cache(&env), cache(&env));
    let (pages_a, pages_b) = (
        ResponseCacheLayer::new(cache_a),
        ResponseCacheLayer::new(cache_b),
    );
    let a = pages_a.layer(origin.service());
    let b = pages_b.layer(origin.service());
    let both = |i: usize| if i % 2 == 0 { a.clone() } else { b.clone() };
    let svcs: Vec<_> = (0..32).map(both).collect();
    let run = |svcs: Vec<_>| async move {
        let start = Arc::new(Barrier::new(svcs.len()));
        let tasks: Vec<_> = svcs
            .into_iter()
            .map(|svc| {
                let start = start.clone();
                tokio::spawn(async move {
                    start.wait().await;
                    send(&svc, get("/shared")).await
                })
            })
            .collect();
        let mut seen = Vec::new();
        for t in tasks {
            seen.push(t.await.unwrap());
        }
        seen
    };
    // The fetch is held in the origin until every other request waits for it (15 in each
    // process behind its own leader; the other process's leader polls the placeholder), or
    // until a second origin call shows the herd got through.
    let (sa, sb, calls) = (pages_a.clone(), pages_b.clone(), origin.clone());
    release_when(gate.clone(), move || {
        calls.calls() > 1 || (sa.stats().lease_waits >= 15 && sb.stats().lease_waits >= 15)
    });
    let cold = run(svcs.clone()).await;
    assert!(cold.iter().all(|s| s.body == "v1"));
    assert_eq!(
        origin.calls(),
        1,
        "a cold URL: one origin call for both processes"
    );
    for expiry in 2..=4 {
        env.advance(Duration::from_secs(61));
        // The refresh is held in the origin until the 31 others were served the stale page.
        gate.forget_permits(gate.available_permits());
        // Each was served it at once, or waited for its process's claimant to hand it over.
        let served = |c: &ResponseCacheLayer| c.stats().stale_served + c.stats().lease_waits;
        let before = served(&pages_a) + served(&pages_b);
        let (sa, sb, calls) = (pages_a.clone(), pages_b.clone(), origin.clone());
        release_when(gate.clone(), move || {
            calls.calls() > expiry || served(&sa) + served(&sb) >= before + 31
        });
        let seen = run(svcs.clone()).await;
        assert_eq!(origin.calls(), expiry, "one origin call per expiry");
        assert_eq!(count(&seen, "MISS"), 1);
        assert_eq!(count(&seen, "STALE"), 31);
        let fresh = send(&a, get("/shared")).await;
        assert_eq!(fresh.body, format!("v{expiry}"));
    }
}

async fn hit_for_pass_sends_requests_straight_to_the_origin(env: Env) {
    let cacheable = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = cacheable.clone();
    let mut origin = Origin::new(move |_, n| {
        let cc = if flag.load(Ordering::SeqCst) {
            "max-age=60"
        } else {
            "private"
        };
        response(StatusCode::OK, &[("cache-control", cc)], format!("v{n}"))
    });
    // A wait for another request's fetch lasts as long as the test allows (it would otherwise
    // end at max_wait, and the waiter would go to the origin then).
    let patient = || {
        let cache = env
            .builder()
            .max_wait(Duration::from_secs(300))
            .build_async()
            .unwrap();
        ResponseCacheLayer::new(cache)
    };
    let svc = patient().layer(origin.service());
    assert_eq!(send(&svc, get("/me")).await.x_cache(), "PASS");
    // Eight requests that can only finish once all eight are in the origin together: queued
    // behind one another's fetch, they would never get there.
    origin.together = Some(Arc::new(Barrier::new(8)));
    let svc = patient().layer(origin.service());
    let seen = tokio::time::timeout(Duration::from_secs(60), at_once(&svc, 8, |_| get("/me")))
        .await
        .expect("no request waited for another's fetch");
    assert_eq!(count(&seen, "PASS"), 8);
    assert_eq!(origin.calls(), 9);
    // The marker lapses; the page has become cacheable.
    origin.together = None;
    let svc = layer(&env).build().unwrap().layer(origin.service());
    cacheable.store(true, Ordering::SeqCst);
    env.advance(Duration::from_secs(6));
    assert_eq!(send(&svc, get("/me")).await.x_cache(), "MISS");
    assert_eq!(send(&svc, get("/me")).await.x_cache(), "HIT");
    assert_eq!(origin.calls(), 10);
}

async fn a_flood_of_no_cache_requests_revalidates_once(env: Env) {
    let mut origin = Origin::new(|_, n| response(StatusCode::OK, &[], format!("v{n}")));
    let gate = Arc::new(Semaphore::new(1));
    origin.gate = Some(gate.clone());
    let cache = cache(&env);
    let pages = ResponseCacheLayer::new(cache.clone());
    let svc = pages.layer(origin.service());
    let reload = || get_with("/r", &[("cache-control", "no-cache")]);
    let max_age_0 = || get_with("/r", &[("cache-control", "max-age=0")]);
    assert_eq!(send(&svc, get("/r")).await.body, "v1");
    // Younger than revalidate_after (1 s): served as it is.
    assert_eq!(send(&svc, reload()).await.x_cache(), "HIT");
    assert_eq!(origin.calls(), 1);
    env.advance(Duration::from_secs(5));
    // The revalidation is held in the origin until the 31 other reloads wait for it (or a
    // second origin call shows they did not).
    let (stats, calls) = (pages.clone(), origin.clone());
    let waits_before = pages.stats().lease_waits;
    release_when(gate, move || {
        calls.calls() > 2 || stats.stats().lease_waits >= waits_before + 31
    });
    let seen = at_once(
        &svc,
        32,
        |i| if i % 2 == 0 { reload() } else { max_age_0() },
    )
    .await;
    assert_eq!(origin.calls(), 2, "32 reloads, one origin call");
    assert!(
        seen.iter().all(|s| s.body == "v2"),
        "every reload sees the new page"
    );
    assert_eq!(count(&seen, "MISS"), 1);
    let after = send(&svc, get("/r")).await;
    assert_eq!((after.x_cache(), &after.body[..]), ("HIT", &b"v2"[..]));
    assert_eq!(after.age(), 0);
    assert_eq!(origin.calls(), 2);
}

async fn other_methods_pass_untouched(env: Env) {
    let origin = Origin::page("done", &[]);
    let svc = layer(&env).build().unwrap().layer(origin.service());
    for _ in 0..2 {
        let req = Request::builder()
            .method(Method::POST)
            .uri("/form")
            .body(())
            .unwrap();
        let seen = send(&svc, req).await;
        assert_eq!((seen.status, seen.x_cache()), (StatusCode::OK, ""));
    }
    assert_eq!(origin.calls(), 2);
    assert_eq!(send(&svc, get("/form")).await.x_cache(), "MISS");
    assert_eq!(
        send(&svc, get_with("/form", &[("cache-control", "no-store")]))
            .await
            .x_cache(),
        "PASS"
    );
    assert_eq!(origin.calls(), 4);
}

async fn through_an_axum_router(env: Env) {
    use axum::Router;
    use axum::extract::Path;
    use axum::routing::get as route_get;

    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let app: Router = Router::new()
        .route(
            "/page/{id}",
            route_get(move |Path(id): Path<u32>| {
                let calls = counted.clone();
                async move {
                    calls.fetch_add(1, Ordering::SeqCst);
                    ([("content-type", "text/html")], format!("<p>page {id}</p>"))
                }
            }),
        )
        .layer(ResponseCacheLayer::new(cache(&env)));
    let req = |uri: &str| Request::get(uri).body(axum::body::Body::empty()).unwrap();
    let mut seen = Vec::new();
    for uri in ["/page/1", "/page/1", "/page/2", "/page/1?utm_campaign=x"] {
        let resp = app.clone().oneshot(req(uri)).await.unwrap();
        let x = resp.headers()["x-cache"].to_str().unwrap().to_string();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        seen.push((x, body));
    }
    let x: Vec<&str> = seen.iter().map(|(x, _)| x.as_str()).collect();
    assert_eq!(x, ["MISS", "HIT", "MISS", "HIT"]);
    assert_eq!(seen[1].1, "<p>page 1</p>");
    assert_eq!(seen[2].1, "<p>page 2</p>");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[test]
fn bad_settings_are_config_errors() {
    let cache = newcache::Cache::builder()
        .in_memory()
        .build_async()
        .unwrap();
    let b = || ResponseCacheLayer::builder(cache.clone());
    for (what, r) in [
        ("ttl", b().ttl(Duration::ZERO).build()),
        ("hit_for_pass", b().hit_for_pass(Duration::ZERO).build()),
        ("statuses", b().statuses([]).build()),
        ("namespace", b().namespace("").build()),
        ("namespace", b().namespace("a:b").build()),
        ("served_hosts", b().served_hosts(["a/b"]).build()),
        ("served_hosts", b().served_hosts([""]).build()),
    ] {
        let e = r.expect_err(what);
        assert!(e.is_config(), "{what}: {e}");
        assert!(e.to_string().contains(what), "{what}: {e}");
    }
    assert!(b().build().is_ok());
}

/// An origin error reaches the request that met it, and leaves nothing behind: the next request
/// fetches again.
#[test]
fn an_origin_error_reaches_its_request_and_is_not_cached() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let cache = newcache::Cache::builder()
            .in_memory()
            .build_async()
            .unwrap();
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = calls.clone();
        let origin = tower::service_fn(move |_: Request<()>| {
            let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                if n == 1 {
                    return Err(std::io::Error::other("the database is down"));
                }
                Ok(response(StatusCode::OK, &[], "back"))
            }
        });
        let svc = ResponseCacheLayer::new(cache).layer(origin);
        let e = svc.clone().oneshot(get("/flaky")).await.unwrap_err();
        assert_eq!(e.to_string(), "the database is down");
        assert_eq!(send(&svc, get("/flaky")).await.x_cache(), "MISS");
        assert_eq!(send(&svc, get("/flaky")).await.x_cache(), "HIT");
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    });
}

/// With the cache's backend down, every request is still answered by the origin; nothing is
/// stored.
#[test]
fn a_dead_backend_leaves_the_origin_serving() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        // A port nothing listens on.
        let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = dead.local_addr().unwrap().to_string();
        drop(dead);
        let cache = newcache::Cache::builder()
            .memcached([addr.as_str()])
            .connect_timeout(Duration::from_secs(2))
            .build_async()
            .unwrap();
        let origin = Origin::page("still here", &[]);
        let svc = ResponseCacheLayer::new(cache).layer(origin.service());
        for n in 1..=3 {
            let seen = send(&svc, get("/up")).await;
            assert_eq!(
                (seen.status, &seen.body[..]),
                (StatusCode::OK, &b"still here"[..])
            );
            assert_ne!(seen.x_cache(), "HIT");
            assert_eq!(origin.calls(), n);
        }
    });
}

// Cache correctness (RFC 9111/9110), keys, and a failing origin.

/// An origin that echoes the request's path, query and `X-Token` bytes.
fn echo() -> Origin {
    Origin::new(|req, _| {
        let tok = req
            .headers()
            .get("x-token")
            .map(|v| format!("{:?}", v.as_bytes()))
            .unwrap_or_default();
        let body = format!("{} {}", req.uri(), tok);
        response(StatusCode::OK, &[("vary", "X-Token")], body)
    })
}

/// The key holds the host then the path: a `Host` holding a `/` would move the split (`Host:
/// a/b` + `/c` read as `Host: a` + `/b/c`), so such a host is passed uncached, as is an
/// absolute-form URI whose authority is not its `Host`.
async fn a_host_with_a_path_cannot_take_another_urls_key(env: Env) {
    let origin = echo();
    let svc = layer(&env).build().unwrap().layer(origin.service());
    let evil = send(&svc, get_with("/c", &[("host", "a/b")])).await;
    assert_eq!(evil.x_cache(), "PASS");
    let mismatch = send(&svc, get_with("http://a/b/c", &[("host", "evil")])).await;
    assert_eq!(mismatch.x_cache(), "PASS");
    let victim = send(&svc, get_with("/b/c", &[("host", "a")])).await;
    assert_eq!(
        (
            victim.x_cache(),
            String::from_utf8_lossy(&victim.body).into_owned()
        ),
        ("MISS", "/b/c ".to_string()),
        "GET /b/c (Host: a) was served the page of GET /c (Host: a/b)"
    );
    let same = send(&svc, get_with("http://a/b/c", &[("host", "A")])).await;
    assert_eq!(same.x_cache(), "HIT", "the absolute form of the same URL");
}

/// The query's parameters are sorted by name only: `id=2&id=1` and `id=1&id=2` are two URLs
/// to the origin (the first value wins in most frameworks), and two pages.
async fn repeated_params_in_another_order_are_another_url(env: Env) {
    let origin = echo();
    let svc = layer(&env).build().unwrap().layer(origin.service());
    send(&svc, get("/s?id=2&id=1")).await;
    let other = send(&svc, get("/s?id=1&id=2")).await;
    assert_eq!(
        String::from_utf8_lossy(&other.body),
        "/s?id=1&id=2 ",
        "x-cache {}",
        other.x_cache()
    );
}

/// Varied header values are keyed as raw bytes: two values that are not UTF-8 are two
/// variants.
async fn vary_values_that_are_not_utf8_do_not_share_a_variant(env: Env) {
    let origin = echo();
    let svc = layer(&env).build().unwrap().layer(origin.service());
    let with = |b: &'static [u8]| {
        let mut r = get("/v3");
        r.headers_mut()
            .insert("x-token", http::HeaderValue::from_bytes(b).unwrap());
        r
    };
    assert_eq!(send(&svc, with(b"\xff")).await.x_cache(), "MISS");
    let other = send(&svc, with(b"\xfe")).await;
    assert_eq!(
        String::from_utf8_lossy(&other.body),
        "/v3 [254]",
        "X-Token: \\xfe was served the variant of X-Token: \\xff ({})",
        other.x_cache()
    );
}

/// RFC 9111 §4.2: fresh while freshness_lifetime > current_age, and current_age includes the
/// `Age` the response arrived with: an `Age: 50, max-age=60` response is stale 10 s later.
async fn the_origins_age_counts_against_freshness(env: Env) {
    let origin = Origin::page("aged", &[("age", "50"), ("cache-control", "max-age=60")]);
    let svc = layer(&env).build().unwrap().layer(origin.service());
    send(&svc, get("/aged")).await;
    env.advance(Duration::from_secs(30));
    let seen = send(&svc, get("/aged")).await;
    assert!(
        !(seen.x_cache() == "HIT" && seen.age() > 60),
        "served as fresh (HIT) with Age {} > max-age 60",
        seen.age()
    );
}

/// An entity tag may hold commas (etagc = %x21 / %x23-7E): `"v1,*,x"` is one tag, not a
/// list holding `*`.
async fn a_comma_inside_an_etag_is_not_a_wildcard(env: Env) {
    let origin = Origin::page("current", &[("etag", "\"v2\"")]);
    let svc = layer(&env).build().unwrap().layer(origin.service());
    send(&svc, get("/e")).await;
    let seen = send(&svc, get_with("/e", &[("if-none-match", "\"v1,*,x\"")])).await;
    assert_eq!(
        seen.status,
        StatusCode::OK,
        "a 304 for a tag that does not match"
    );
}

/// An expired page whose refresh gets a 503 (the origin is overloaded) stays: the refreshing
/// request gets the 503, the others the stale page, and the origin at most one request at a
/// time (the next request tries again).
async fn a_refresh_answered_503_keeps_the_stale_page(env: Env) {
    let origin = Origin::new(|_, n| {
        if n == 2 {
            response(StatusCode::SERVICE_UNAVAILABLE, &[], "overloaded")
        } else {
            response(StatusCode::OK, &[], format!("v{n}"))
        }
    });
    let svc = layer(&env).build().unwrap().layer(origin.service());
    assert_eq!(send(&svc, get("/busy")).await.body, "v1");
    env.advance(Duration::from_secs(61));
    let refresh = send(&svc, get("/busy")).await;
    assert_eq!(refresh.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refresh.x_cache(), "PASS");
    let seen = at_once(&svc, 16, |_| get("/busy")).await;
    let what: Vec<_> = seen.iter().map(|s| (s.x_cache(), s.body.clone())).collect();
    assert!(
        origin.calls() <= 3,
        "after one failed refresh, {} of 16 requests went to the origin ({what:?})",
        origin.calls() - 2,
    );
    for seen in &seen {
        assert!(
            (seen.x_cache(), &seen.body[..]) == ("STALE", &b"v1"[..])
                || seen.body == "v3" && seen.x_cache() != "PASS",
            "{what:?}"
        );
    }
}

/// A cold URL's fetch fails (the origin errors after a while): the requests that waited for it
/// wait for the next fetch (one of them makes it), instead of all calling the origin at once.
async fn waiters_on_a_failed_fetch_do_not_stampede_the_origin(env: Env) {
    let calls = Arc::new(AtomicUsize::new(0));
    let gate = Arc::new(Semaphore::new(0));
    let (c, g) = (calls.clone(), gate.clone());
    let origin = tower::service_fn(move |_: Request<()>| {
        let n = c.fetch_add(1, Ordering::SeqCst) + 1;
        let g = g.clone();
        async move {
            if n == 1 {
                g.acquire().await.unwrap().forget();
                return Err(std::io::Error::other("timed out"));
            }
            Ok(response(StatusCode::OK, &[], "ok"))
        }
    });
    let svc = layer(&env).build().unwrap().layer(origin);
    // The fetch fails after 300 ms: long enough for the 15 others to be waiting for it.
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        gate.add_permits(1 << 20);
    });
    let start = Arc::new(Barrier::new(16));
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (svc, start) = (svc.clone(), start.clone());
        tasks.push(tokio::spawn(async move {
            start.wait().await;
            tokio::time::sleep(Duration::from_millis(20)).await;
            svc.oneshot(get("/cold-fail")).await.is_ok()
        }));
    }
    for t in tasks {
        let _ = t.await.unwrap();
    }
    assert!(
        calls.load(Ordering::SeqCst) <= 2,
        "one failed fetch, then {} origin calls",
        calls.load(Ordering::SeqCst) - 1
    );
}

/// The leader's client goes away mid-fetch (its future is dropped): the next request must not
/// wait out the claim.
async fn a_cancelled_leader_lets_the_next_request_fetch(env: Env) {
    let mut origin = Origin::new(|_, n| response(StatusCode::OK, &[], format!("v{n}")));
    let gate = Arc::new(Semaphore::new(0));
    origin.gate = Some(gate.clone());
    let cache = env
        .builder()
        .max_wait(Duration::from_secs(60))
        .build_async()
        .unwrap();
    let svc = ResponseCacheLayer::new(cache).layer(origin.service());
    let leader = {
        let svc = svc.clone();
        tokio::spawn(async move { send(&svc, get("/gone")).await })
    };
    while origin.calls() < 1 {
        tokio::task::yield_now().await;
    }
    leader.abort();
    let _ = leader.await;
    gate.add_permits(1 << 20);
    let next = tokio::time::timeout(Duration::from_secs(5), send(&svc, get("/gone"))).await;
    let next = next.expect("the next request waited for a claim whose holder is gone");
    assert_eq!(next.body, "v2");
}

/// RFC 9111 §5.2.2.2: a stale `must-revalidate` response MUST NOT be reused without
/// validation (and `s-maxage` implies `proxy-revalidate` for a shared cache, §5.2.2.10): once
/// expired, requests wait for the one refresh, as for a cold URL.
async fn must_revalidate_is_never_served_stale(env: Env) {
    let mut origin = Origin::new(|_, n| {
        response(
            StatusCode::OK,
            &[("cache-control", "max-age=60, must-revalidate")],
            format!("v{n}"),
        )
    });
    let gate = Arc::new(Semaphore::new(1));
    origin.gate = Some(gate.clone());
    let cache = cache(&env);
    let pages = ResponseCacheLayer::new(cache.clone());
    let svc = pages.layer(origin.service());
    send(&svc, get("/mr")).await;
    env.advance(Duration::from_secs(61));
    let refresh = {
        let svc = svc.clone();
        tokio::spawn(async move { send(&svc, get("/mr")).await })
    };
    while origin.calls() < 2 {
        tokio::task::yield_now().await;
    }
    // The refresh is held in the origin until the other request waits for it (or a third
    // origin call shows it did not).
    let (stats, calls) = (pages.clone(), origin.clone());
    let waits = pages.stats().lease_waits;
    release_when(gate, move || {
        calls.calls() > 2 || stats.stats().lease_waits > waits
    });
    let other = send(&svc, get("/mr")).await;
    let refreshed = refresh.await.unwrap();
    assert_ne!(
        other.x_cache(),
        "STALE",
        "a stale must-revalidate page was served"
    );
    assert_eq!(
        (refreshed.x_cache(), &refreshed.body[..]),
        ("MISS", &b"v2"[..])
    );
    assert_eq!((other.x_cache(), &other.body[..]), ("HIT", &b"v2"[..]));
    assert_eq!(origin.calls(), 2);
    // Nor is it served stale to a HEAD (which never waits): it goes to the origin.
    env.advance(Duration::from_secs(61));
    let head = send(&svc, Request::head("/mr").body(()).unwrap()).await;
    assert_eq!(head.x_cache(), "PASS");
}

/// RFC 9110 §13.2.1: conditional headers are ignored when the response would not be 2xx: a
/// stored 404 carrying an ETag is served as it is to a matching `If-None-Match`, not a 304
/// (which would tell the client its cached 200 is still good).
async fn no_304_for_a_stored_non_2xx(env: Env) {
    let origin = Origin::new(|_, _| response(StatusCode::NOT_FOUND, &[("etag", "\"x\"")], "gone"));
    let svc = layer(&env)
        .statuses([StatusCode::OK, StatusCode::NOT_FOUND])
        .build()
        .unwrap()
        .layer(origin.service());
    send(&svc, get("/nf")).await;
    let seen = send(&svc, get_with("/nf", &[("if-none-match", "\"x\"")])).await;
    assert_eq!(seen.status, StatusCode::NOT_FOUND);
}

/// A revalidation stores its page as any fill does: a page that starts to vary, revalidated by
/// a request for one variant, is stored as that variant, and other values get their own.
async fn a_revalidation_that_finds_a_vary_keeps_the_variants_apart(env: Env) {
    let origin = Origin::new(|req, n| {
        if n == 1 {
            return response(StatusCode::OK, &[], "no vary yet");
        }
        let lang = req
            .headers()
            .get("accept-language")
            .map_or("none", |v| v.to_str().unwrap());
        response(
            StatusCode::OK,
            &[("vary", "Accept-Language")],
            format!("page in {lang}"),
        )
    });
    let svc = layer(&env).build().unwrap().layer(origin.service());
    send(&svc, get("/rv")).await;
    env.advance(Duration::from_secs(2));
    let fr = send(
        &svc,
        get_with(
            "/rv",
            &[("cache-control", "no-cache"), ("accept-language", "fr")],
        ),
    )
    .await;
    assert_eq!(fr.body, "page in fr");
    let en = send(&svc, get_with("/rv", &[("accept-language", "en")])).await;
    assert_eq!(
        String::from_utf8_lossy(&en.body),
        "page in en",
        "Accept-Language: en served the fr variant ({})",
        en.x_cache()
    );
}

/// RFC 9111 §4.2.1 / §5.3: without max-age, `Expires` gives the freshness lifetime, and an
/// invalid one (`Expires: 0`, a common "do not cache") means already expired.
async fn expires_in_the_past_is_not_fresh(env: Env) {
    let origin = Origin::new(|_, n| response(StatusCode::OK, &[("expires", "0")], format!("v{n}")));
    let svc = layer(&env).build().unwrap().layer(origin.service());
    send(&svc, get("/exp")).await;
    let again = send(&svc, get("/exp")).await;
    assert_ne!(
        again.x_cache(),
        "HIT",
        "an already-expired response served as fresh"
    );
}

/// An origin that panics while it is the leader: the claim must be given back, so the next
/// request fetches at once instead of waiting for max_wait.
async fn a_panicking_origin_releases_the_claim(env: Env) {
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let origin = tower::service_fn(move |_: Request<()>| {
        let n = c.fetch_add(1, Ordering::SeqCst) + 1;
        async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            if n == 1 {
                panic!("the origin panicked");
            }
            Ok::<_, Infallible>(response(StatusCode::OK, &[], "ok"))
        }
    });
    let cache = env
        .builder()
        .max_wait(Duration::from_secs(60))
        .build_async()
        .unwrap();
    let svc = ResponseCacheLayer::new(cache).layer(origin);
    let first = {
        let svc = svc.clone();
        tokio::spawn(async move { send(&svc, get("/boom")).await })
    };
    assert!(first.await.is_err(), "the first request panicked");
    let next = tokio::time::timeout(Duration::from_secs(5), send(&svc, get("/boom")))
        .await
        .expect("the next request waited out a dead leader's claim");
    assert_eq!(next.body, "ok");
}

/// RFC 9111 §4.4: a cache MUST invalidate the target URI when an unsafe method (PUT, POST,
/// DELETE) gets a non-error response; an error leaves the page.
async fn an_unsafe_method_invalidates_the_stored_page(env: Env) {
    let origin = Origin::new(|_, n| response(StatusCode::OK, &[], format!("v{n}")));
    let svc = layer(&env).build().unwrap().layer(origin.service());
    assert_eq!(send(&svc, get("/doc")).await.body, "v1");
    let put = Request::put("/doc").body(()).unwrap();
    assert_eq!(send(&svc, put).await.status, StatusCode::OK);
    let after = send(&svc, get("/doc")).await;
    assert_ne!(
        (after.x_cache(), &after.body[..]),
        ("HIT", &b"v1"[..]),
        "the page the PUT changed is still served from the cache"
    );
    assert_eq!((after.x_cache(), &after.body[..]), ("MISS", &b"v3"[..]));
    // A DELETE answered with an error changed nothing: the page stays.
    let refused = Origin::new(|req, n| {
        if req.method() == Method::DELETE {
            response(StatusCode::FORBIDDEN, &[], "no")
        } else {
            response(StatusCode::OK, &[], format!("v{n}"))
        }
    });
    let svc = layer(&env)
        .namespace("refused")
        .build()
        .unwrap()
        .layer(refused.service());
    send(&svc, get("/doc")).await;
    let delete = Request::delete("/doc").body(()).unwrap();
    assert_eq!(send(&svc, delete).await.status, StatusCode::FORBIDDEN);
    assert_eq!(send(&svc, get("/doc")).await.x_cache(), "HIT");
    // With pages per cookie, a POST with a cookie removes the URL's page and its own.
    let origin = Origin::new(|_, n| response(StatusCode::OK, &[], format!("v{n}")));
    let svc = layer(&env)
        .namespace("keyed")
        .cookies(CookiePolicy::Key)
        .build()
        .unwrap()
        .layer(origin.service());
    let mine = || get_with("/doc", &[("cookie", "s=1")]);
    send(&svc, get("/doc")).await;
    send(&svc, mine()).await;
    let post = Request::post("/doc")
        .header("cookie", "s=1")
        .body(())
        .unwrap();
    send(&svc, post).await;
    assert_eq!(send(&svc, get("/doc")).await.x_cache(), "MISS");
    assert_eq!(send(&svc, mine()).await.x_cache(), "MISS");
}

/// A GET with `Range` (or `If-Match`, `If-Range`, `If-Unmodified-Since`) is passed to the
/// origin and neither fills nor marks the cache: its 206 does not turn the URL to pass for
/// everyone.
async fn one_clients_range_request_does_not_turn_the_cache_off(env: Env) {
    let origin = Origin::new(|req, n| {
        if req.headers().contains_key("range") {
            response(
                StatusCode::PARTIAL_CONTENT,
                &[("content-range", "bytes 0-0/2")],
                "v",
            )
        } else {
            response(StatusCode::OK, &[], format!("v{n}"))
        }
    });
    let svc = layer(&env).build().unwrap().layer(origin.service());
    let ranged = send(&svc, get_with("/hot2", &[("range", "bytes=0-0")])).await;
    assert_eq!(ranged.status, StatusCode::PARTIAL_CONTENT);
    let seen = at_once(&svc, 16, |_| get("/hot2")).await;
    assert!(
        origin.calls() <= 2,
        "after one Range request, {} of 16 plain GETs went to the origin ({:?})",
        origin.calls() - 1,
        seen.iter().map(Seen::x_cache).collect::<Vec<_>>()
    );
}

/// A cold URL answered 5xx is a failed fetch, not an uncacheable page: no hit-for-pass marker
/// is left, and the next request fetches (and stores) the page.
async fn a_5xx_on_a_cold_url_leaves_no_marker(env: Env) {
    let origin = Origin::new(|_, n| {
        if n == 1 {
            response(StatusCode::BAD_GATEWAY, &[], "down")
        } else {
            response(StatusCode::OK, &[], format!("v{n}"))
        }
    });
    let svc = layer(&env).build().unwrap().layer(origin.service());
    let failed = send(&svc, get("/down")).await;
    assert_eq!(
        (failed.status, failed.x_cache()),
        (StatusCode::BAD_GATEWAY, "PASS")
    );
    assert_eq!(send(&svc, get("/down")).await.x_cache(), "MISS");
    assert_eq!(send(&svc, get("/down")).await.x_cache(), "HIT");
    assert_eq!(origin.calls(), 2);
}

/// What a revalidation (`Cache-Control: no-cache`) does to the stored page when the origin's
/// answer is not stored: an error (503) leaves the page, served to the next requests; a `200`
/// that says `private` turns the URL to pass (the origin says the page is no longer shared).
async fn a_revalidation_keeps_the_page_on_an_error_and_passes_on_private(env: Env) {
    let origin = Origin::new(|_, n| match n {
        2 => response(StatusCode::SERVICE_UNAVAILABLE, &[], "overloaded"),
        3 => response(StatusCode::OK, &[("cache-control", "private")], "mine"),
        _ => response(StatusCode::OK, &[], format!("v{n}")),
    });
    let svc = layer(&env).build().unwrap().layer(origin.service());
    let reload = || get_with("/rp", &[("cache-control", "no-cache")]);
    assert_eq!(send(&svc, get("/rp")).await.body, "v1");
    env.advance(Duration::from_secs(2));
    let failed = send(&svc, reload()).await;
    assert_eq!(
        (failed.status, failed.x_cache()),
        (StatusCode::SERVICE_UNAVAILABLE, "PASS")
    );
    let kept = send(&svc, get("/rp")).await;
    assert_eq!((kept.x_cache(), &kept.body[..]), ("HIT", &b"v1"[..]));
    let private = send(&svc, reload()).await;
    assert_eq!(
        (private.x_cache(), &private.body[..]),
        ("PASS", &b"mine"[..])
    );
    let passed = send(&svc, get("/rp")).await;
    assert_eq!((passed.x_cache(), &passed.body[..]), ("PASS", &b"v4"[..]));
    assert_eq!(origin.calls(), 4);
}

/// Connection-level headers are the origin's connection's, not the page's: they are not stored
/// (neither the fixed list nor the fields `Connection` names); the others are.
async fn hop_by_hop_headers_are_not_stored(env: Env) {
    let origin = Origin::page(
        "p",
        &[
            ("connection", "x-hop, close"),
            ("x-hop", "1"),
            ("keep-alive", "timeout=5"),
            ("proxy-connection", "keep-alive"),
            ("upgrade", "h2c"),
            ("x-kept", "yes"),
        ],
    );
    let svc = layer(&env).build().unwrap().layer(origin.service());
    for x_cache in ["MISS", "HIT"] {
        let seen = send(&svc, get("/hop")).await;
        assert_eq!(seen.x_cache(), x_cache);
        for gone in [
            "connection",
            "x-hop",
            "keep-alive",
            "proxy-connection",
            "upgrade",
        ] {
            assert!(!seen.headers.contains_key(gone), "{x_cache}: {gone}");
        }
        assert_eq!(seen.headers["x-kept"], "yes");
    }
}

/// `ResponseCacheLayer::invalidate` removes a page and every variant of it; the query is
/// normalised as the keys are, and an absolute URL names the host.
async fn invalidate_removes_a_page_and_its_variants(env: Env) {
    let origin = Origin::new(|req, n| {
        let lang = req
            .headers()
            .get("accept-language")
            .map_or("none", |v| v.to_str().unwrap());
        response(
            StatusCode::OK,
            &[("vary", "Accept-Language")],
            format!("{lang} v{n}"),
        )
    });
    let layer = layer(&env).build().unwrap();
    let svc = layer.layer(origin.service());
    let lang = |l| get_with("/iv?b=1&a=2", &[("accept-language", l), ("host", "c.org")]);
    send(&svc, lang("en")).await;
    send(&svc, lang("fr")).await;
    assert_eq!(send(&svc, lang("fr")).await.x_cache(), "HIT");
    let there = layer.invalidate("http://c.org/iv?a=2&b=1&utm_source=x");
    assert!(there.await.unwrap(), "a vary record was there");
    for l in ["fr", "en"] {
        let seen = send(&svc, lang(l)).await;
        assert_eq!(seen.x_cache(), "MISS", "{l}");
    }
    assert_eq!(origin.calls(), 4);
    // With a host: the absolute URL's.
    let hosted = |h| get_with("/iv", &[("host", h)]);
    send(&svc, hosted("a.org")).await;
    send(&svc, hosted("b.org")).await;
    assert!(layer.invalidate("http://A.org/iv").await.unwrap());
    assert!(!layer.invalidate("http://a.org/iv").await.unwrap(), "gone");
    assert_eq!(send(&svc, hosted("a.org")).await.x_cache(), "MISS");
    assert_eq!(send(&svc, hosted("b.org")).await.x_cache(), "HIT");
    for bad in ["http://u@a/x", "/a b"] {
        let e = layer.invalidate(bad).await.unwrap_err();
        assert!(e.to_string().contains("cannot invalidate"), "{bad}: {e}");
    }
}

/// `HostPolicy::Ignore`: one page per path whatever the host (an app behind `localhost:3000`
/// and `127.0.0.1:3000`), and `invalidate` of a path reaches it.
async fn a_single_site_layer_keys_no_host(env: Env) {
    let origin = Origin::new(|_, n| response(StatusCode::OK, &[], format!("v{n}")));
    let layer = layer(&env).hosts(HostPolicy::Ignore).build().unwrap();
    let svc = layer.layer(origin.service());
    let hosted = |h| get_with("/one", &[("host", h)]);
    assert_eq!(send(&svc, hosted("localhost:3000")).await.x_cache(), "MISS");
    assert_eq!(send(&svc, hosted("127.0.0.1:3000")).await.x_cache(), "HIT");
    assert!(layer.invalidate("/one").await.unwrap());
    let seen = send(&svc, hosted("127.0.0.1:3000")).await;
    assert_eq!((seen.x_cache(), &seen.body[..]), ("MISS", &b"v2"[..]));
}

/// The issue's afternoon: a page served under `Host: localhost:3101` by a layer with the
/// default `HostPolicy::Key`. `invalidate` of its path alone cannot name the host: an
/// `InvalidKey` error that says why, not an `Ok` that left the page a `HIT`. The absolute URL
/// of the host the page was served under removes it, and says it was there.
async fn invalidate_of_a_path_is_refused_where_pages_are_keyed_per_host(env: Env) {
    let origin = Origin::new(|_, n| response(StatusCode::OK, &[], format!("v{n}")));
    let layer = layer(&env).build().unwrap();
    let svc = layer.layer(origin.service());
    let page = || get_with("/page/1", &[("host", "localhost:3101")]);
    assert_eq!(send(&svc, page()).await.x_cache(), "MISS");
    assert_eq!(send(&svc, page()).await.x_cache(), "HIT");
    let e = layer.invalidate("/page/1").await.unwrap_err();
    assert!(e.is_invalid_key(), "{e}");
    let msg = e.to_string();
    for part in ["per host", "http://", "HostPolicy::Ignore"] {
        assert!(msg.contains(part), "{part:?} not in {msg:?}");
    }
    assert_eq!(send(&svc, page()).await.x_cache(), "HIT", "nothing removed");
    assert!(
        layer
            .invalidate("http://localhost:3101/page/1")
            .await
            .unwrap()
    );
    let seen = send(&svc, page()).await;
    assert_eq!((seen.x_cache(), &seen.body[..]), ("MISS", &b"v2"[..]));
    assert!(
        !layer
            .invalidate("http://localhost:3101/other")
            .await
            .unwrap()
    );
}

/// A layer told the hosts it serves (`served_hosts`): `invalidate` of a path reaches the page
/// of each of them (`true`: one was there), and no other host's.
async fn invalidate_of_a_path_reaches_every_host_the_layer_was_told(env: Env) {
    let origin = Origin::new(|_, n| response(StatusCode::OK, &[], format!("v{n}")));
    let layer = layer(&env)
        .served_hosts(["Example.com", "localhost:3101"])
        .build()
        .unwrap();
    let svc = layer.layer(origin.service());
    let hosted = |h| get_with("/p?b=1&a=2", &[("host", h)]);
    let hosts = ["example.com", "localhost:3101", "other.org"];
    for h in hosts {
        assert_eq!(send(&svc, hosted(h)).await.x_cache(), "MISS", "{h}");
    }
    assert!(layer.invalidate("/p?a=2&b=1").await.unwrap());
    let after: Vec<String> = {
        let mut v = Vec::new();
        for h in hosts {
            v.push(send(&svc, hosted(h)).await.x_cache().to_string());
        }
        v
    };
    assert_eq!(after, ["MISS", "MISS", "HIT"]);
    // Only one listed host's page is there now: still `true`.
    assert!(
        layer
            .invalidate("http://localhost:3101/p?a=2&b=1")
            .await
            .unwrap()
    );
    assert!(layer.invalidate("/p?a=2&b=1").await.unwrap());
    assert!(!layer.invalidate("/p?a=2&b=1").await.unwrap(), "gone");
}

/// `ignore_only_params` replaces the default list: a tracker the default ignores keys pages
/// apart again, and only the names given are left out.
async fn ignore_only_params_replaces_the_default_list(env: Env) {
    let origin = Origin::page("list", &[]);
    let svc = layer(&env)
        .ignore_only_params(["ref"])
        .build()
        .unwrap()
        .layer(origin.service());
    assert_eq!(send(&svc, get("/l?a=1")).await.x_cache(), "MISS");
    assert_eq!(send(&svc, get("/l?a=1&ref=x")).await.x_cache(), "HIT");
    assert_eq!(
        send(&svc, get("/l?a=1&utm_source=x")).await.x_cache(),
        "MISS"
    );
    assert_eq!(send(&svc, get("/l?a=1&fbclid=x")).await.x_cache(), "MISS");
    assert_eq!(origin.calls(), 3);
}

/// One cache, used by the layer and by the application's own loader: the cache's stats count
/// the application's calls only (one load, one miss, one hit), and the layer's own stats count
/// its pages (two fills, two misses, one hit).
async fn the_layers_fills_are_not_counted_as_the_users_loads(env: Env) {
    let origin = Origin::new(|_, n| response(StatusCode::OK, &[], format!("v{n}")));
    let cache = cache(&env);
    let layer = ResponseCacheLayer::new(cache.clone());
    let svc = layer.layer(origin.service());
    assert_eq!(send(&svc, get("/a")).await.x_cache(), "MISS");
    assert_eq!(send(&svc, get("/b")).await.x_cache(), "MISS");
    assert_eq!(send(&svc, get("/a")).await.x_cache(), "HIT");
    let user: u64 = cache
        .get_or_set_with("user:1", Duration::from_secs(60), || async {
            Ok::<_, Infallible>(7)
        })
        .await
        .unwrap();
    assert_eq!(user, 7);
    assert_eq!(cache.get::<u64>("user:1").await.unwrap(), Some(7));
    let s = cache.stats();
    assert_eq!(
        (s.loader_calls, s.misses, s.hits, s.stale_served),
        (1, 1, 1, 0),
        "the cache's own counts: {s:?}"
    );
    let p = layer.stats();
    assert_eq!(
        (p.loader_calls, p.misses, p.hits, p.stale_served),
        (2, 2, 1, 0),
        "the layer's counts: {p:?}"
    );
    assert_eq!(origin.calls(), 2);
}

/// A refresh of a stored page answered with a status the layer does not store (a 404: the page
/// went away for a moment, or a misrouted request) is a failed refresh, not an uncacheable
/// page: the page is not replaced by a hit-for-pass marker, and the next request refreshes it.
async fn a_refresh_answered_404_keeps_the_page(env: Env) {
    let origin = Origin::new(|_, n| {
        if n == 2 {
            response(StatusCode::NOT_FOUND, &[], "gone")
        } else {
            response(StatusCode::OK, &[], format!("v{n}"))
        }
    });
    let svc = layer(&env).build().unwrap().layer(origin.service());
    assert_eq!(send(&svc, get("/moved")).await.body, "v1");
    env.advance(Duration::from_secs(61));
    let refresh = send(&svc, get("/moved")).await;
    assert_eq!(
        (refresh.status, refresh.x_cache()),
        (StatusCode::NOT_FOUND, "PASS")
    );
    let next = send(&svc, get("/moved")).await;
    assert!(
        (next.x_cache(), &next.body[..]) == ("STALE", &b"v1"[..])
            || (next.x_cache(), &next.body[..]) == ("MISS", &b"v3"[..]),
        "{next:?}"
    );
    let after = send(&svc, get("/moved")).await;
    assert_ne!(after.x_cache(), "PASS", "{after:?}");
}

/// A `no-cache` revalidation under way when an unsafe method lands (a browser reload, then a
/// PUT) does not store the page it read before the change: the GET after the PUT is a MISS
/// with the new state, not the old page for its whole ttl.
async fn a_revalidation_under_way_does_not_undo_an_invalidation(env: Env) {
    let state = Arc::new(AtomicUsize::new(1));
    let gate = Arc::new(Semaphore::new(0));
    let hold_next_get = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let in_origin = Arc::new(AtomicUsize::new(0));
    let origin = race_origin(
        state.clone(),
        gate.clone(),
        hold_next_get.clone(),
        in_origin.clone(),
        None,
    );
    let svc = layer(&env).build().unwrap().layer(origin);
    assert_eq!(send(&svc, get("/doc")).await.body, "state1");
    env.advance(Duration::from_secs(5));
    // A browser reload revalidates; the origin reads state 1 and is held.
    hold_next_get.store(true, Ordering::SeqCst);
    let reload = {
        let svc = svc.clone();
        tokio::spawn(async move {
            send(&svc, get_with("/doc", &[("cache-control", "max-age=0")])).await
        })
    };
    while in_origin.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // The PUT changes the document and (through the layer) removes its page.
    let put = Request::put("/doc").body(()).unwrap();
    assert_eq!(send(&svc, put).await.status, StatusCode::OK);
    // The reload finishes with what it read before the change.
    gate.add_permits(1);
    assert_eq!(reload.await.unwrap().body, "state1");
    // A GET after the PUT returned must not be served the page from before it.
    let after = send(&svc, get("/doc")).await;
    assert_eq!(
        (after.x_cache(), &after.body[..]),
        ("MISS", &b"state2"[..]),
        "the page the PUT invalidated was stored again by the revalidation under way"
    );
}

/// An origin for the races below: a PUT bumps the document's state; a GET reads the state,
/// then (when `hold` is set) waits at `gate`; it answers `state{n}`, with `vary` on the first
/// GET only.
fn race_origin(
    state: Arc<AtomicUsize>,
    gate: Arc<Semaphore>,
    hold: Arc<std::sync::atomic::AtomicBool>,
    in_origin: Arc<AtomicUsize>,
    first_vary: Option<&'static str>,
) -> impl Service<Request<()>, Response = Response<B>, Error = Infallible, Future: Send>
+ Clone
+ Send
+ 'static {
    let gets = Arc::new(AtomicUsize::new(0));
    tower::service_fn(move |req: Request<()>| {
        let (state, gate, hold, in_origin, gets) = (
            state.clone(),
            gate.clone(),
            hold.clone(),
            in_origin.clone(),
            gets.clone(),
        );
        async move {
            if req.method() == Method::PUT {
                state.fetch_add(1, Ordering::SeqCst);
                return Ok::<_, Infallible>(response(StatusCode::OK, &[], "put"));
            }
            let v = state.load(Ordering::SeqCst);
            let first = gets.fetch_add(1, Ordering::SeqCst) == 0;
            if hold.swap(false, Ordering::SeqCst) {
                in_origin.fetch_add(1, Ordering::SeqCst);
                gate.acquire().await.expect("gate").forget();
            }
            let headers: Vec<(&str, &str)> = match first_vary {
                Some(names) if first => vec![("vary", names)],
                _ => vec![],
            };
            Ok(response(StatusCode::OK, &headers, format!("state{v}")))
        }
    })
}

/// A variant fill under way when a PUT lands, whose response no longer varies: its page is not
/// stored at the page key over the invalidation (it writes only over the vary record it
/// started from).
async fn a_variant_fill_that_stopped_varying_does_not_undo_an_invalidation(env: Env) {
    let state = Arc::new(AtomicUsize::new(1));
    let gate = Arc::new(Semaphore::new(0));
    let hold = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let in_origin = Arc::new(AtomicUsize::new(0));
    let origin = race_origin(
        state.clone(),
        gate.clone(),
        hold.clone(),
        in_origin.clone(),
        Some("accept"),
    );
    let svc = layer(&env).build().unwrap().layer(origin);
    let a = || get_with("/v", &[("accept", "text/a")]);
    assert_eq!(send(&svc, a()).await.body, "state1");
    assert_eq!(send(&svc, a()).await.x_cache(), "HIT");
    // Another variant is filled; the origin reads state 1 and is held.
    hold.store(true, Ordering::SeqCst);
    let other = {
        let svc = svc.clone();
        tokio::spawn(async move { send(&svc, get_with("/v", &[("accept", "text/b")])).await })
    };
    while in_origin.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let put = Request::put("/v").body(()).unwrap();
    assert_eq!(send(&svc, put).await.status, StatusCode::OK);
    gate.add_permits(1);
    assert_eq!(other.await.unwrap().body, "state1");
    let after = send(&svc, a()).await;
    assert_ne!(
        (after.x_cache(), &after.body[..]),
        ("HIT", &b"state1"[..]),
        "the page the PUT invalidated was stored again by the variant fill under way"
    );
}

/// Read-your-writes: a client's GET sent after its PUT returned does not join (in-process) a
/// fill that read the origin before the PUT.
async fn a_get_after_a_put_does_not_join_a_fill_from_before_it(env: Env) {
    let state = Arc::new(AtomicUsize::new(1));
    let gate = Arc::new(Semaphore::new(0));
    let hold = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let in_origin = Arc::new(AtomicUsize::new(0));
    let origin = race_origin(
        state.clone(),
        gate.clone(),
        hold.clone(),
        in_origin.clone(),
        None,
    );
    let svc = layer(&env).build().unwrap().layer(origin);
    hold.store(true, Ordering::SeqCst);
    let first = {
        let svc = svc.clone();
        tokio::spawn(async move { send(&svc, get("/w")).await })
    };
    while in_origin.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let put = Request::put("/w").body(()).unwrap();
    assert_eq!(send(&svc, put).await.status, StatusCode::OK);
    let mine = {
        let svc = svc.clone();
        tokio::spawn(async move { send(&svc, get("/w")).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    gate.add_permits(1);
    assert_eq!(first.await.unwrap().body, "state1");
    let mine = mine.await.unwrap();
    // Nothing old is stored (the fill's cas failed) ...
    let later = send(&svc, get("/w")).await;
    assert_ne!(&later.body[..], b"state1", "the old page was stored");
    // ... but the GET sent after the PUT returned saw the state from before it.
    assert_eq!(
        &mine.body[..],
        b"state2",
        "a GET sent after the PUT returned was served the page from before it ({})",
        mine.x_cache()
    );
}

/// A `no-cache` revalidation of a variant filled after its vary record, whose answer no longer
/// varies, stores the plain page at the page key over that record (the write is checked
/// against the record's generation, not the variant's time): every client gets the new page.
async fn a_revalidated_later_variant_that_stopped_varying_updates_the_page(env: Env) {
    a_variant_that_stopped_varying_is_revalidated(env, "fr", "en").await;
}

/// The same, reloading the variant stored with the record.
async fn the_first_variant_revalidated_that_stopped_varying_updates_the_page(env: Env) {
    a_variant_that_stopped_varying_is_revalidated(env, "en", "fr").await;
}

/// Stores `/lv` varying on `Accept-Language` (`en` with the record, `fr` a second later),
/// reloads the `reload` variant once the origin no longer varies, and checks that the `other`
/// variant's clients get the new plain page.
async fn a_variant_that_stopped_varying_is_revalidated(env: Env, reload: &str, other: &str) {
    let origin = Origin::new(|req, n| {
        if n >= 3 {
            return response(
                StatusCode::OK,
                &[("cache-control", "max-age=60")],
                format!("plain v{n}"),
            );
        }
        let lang = req
            .headers()
            .get("accept-language")
            .map_or("none", |v| v.to_str().unwrap());
        response(
            StatusCode::OK,
            &[("vary", "Accept-Language"), ("cache-control", "max-age=60")],
            format!("v{n} in {lang}"),
        )
    });
    let svc = layer(&env).build().unwrap().layer(origin.service());
    // The record and the en variant (stored together).
    assert_eq!(
        send(&svc, get_with("/lv", &[("accept-language", "en")]))
            .await
            .body,
        "v1 in en"
    );
    env.advance(Duration::from_secs(1));
    // The fr variant, filled a second later.
    assert_eq!(
        send(&svc, get_with("/lv", &[("accept-language", "fr")]))
            .await
            .body,
        "v2 in fr"
    );
    env.advance(Duration::from_secs(2));
    // A reload of one variant: the origin no longer varies.
    let reloaded = send(
        &svc,
        get_with(
            "/lv",
            &[("cache-control", "no-cache"), ("accept-language", reload)],
        ),
    )
    .await;
    assert_eq!(reloaded.body, "plain v3");
    assert_eq!(origin.calls(), 3);
    let seen = send(&svc, get_with("/lv", &[("accept-language", other)])).await;
    assert_eq!(
        String::from_utf8_lossy(&seen.body),
        "plain v3",
        "the revalidated page did not replace the vary record ({})",
        seen.x_cache()
    );
}

// ---------------------------------------------------------------------------------------------
// The hit answered in `call` (a backend that answers at once: memory) and the request's future
// (memcached) must agree: on what is counted, on XFetch's odds, on the origin's readiness.

crate::on_backend_async!(
    at_once_memory,
    Memory,
    false,
    a_pass_marker_read_counts_one_hit,
    a_vary_record_read_counts_one_hit,
    a_revalidated_page_read_counts_one_hit,
    a_hit_answered_in_call_does_not_keep_the_origins_readiness,
    early_refresh_is_drawn_once_per_request
);
crate::on_backend_async!(
    at_once_memcached,
    Memcached,
    false,
    a_pass_marker_read_counts_one_hit,
    a_vary_record_read_counts_one_hit,
    a_revalidated_page_read_counts_one_hit,
    a_hit_answered_in_call_does_not_keep_the_origins_readiness,
    early_refresh_is_drawn_once_per_request
);

/// (hits, misses, stale_served) counted by the layer `pages` while `f` runs.
async fn counted<F: std::future::Future<Output = Seen>>(
    pages: &ResponseCacheLayer,
    f: F,
) -> (Seen, (u64, u64, u64)) {
    let before = pages.stats();
    let seen = f.await;
    (seen, read_counts(&before, &pages.stats()))
}

/// (hits, misses, stale_served) from `before` to `after`.
fn read_counts(before: &newcache::Stats, after: &newcache::Stats) -> (u64, u64, u64) {
    (
        after.hits - before.hits,
        after.misses - before.misses,
        after.stale_served - before.stale_served,
    )
}

/// A request that reads a hit-for-pass marker once counts one hit, on every backend.
async fn a_pass_marker_read_counts_one_hit(env: Env) {
    let origin = Origin::new(|_, n| {
        response(
            StatusCode::OK,
            &[("cache-control", "private")],
            format!("v{n}"),
        )
    });
    let cache = cache(&env);
    let pages = ResponseCacheLayer::new(cache.clone());
    let svc = pages.layer(origin.service());
    assert_eq!(send(&svc, get("/me")).await.x_cache(), "PASS");
    let (seen, counts) = counted(&pages, send(&svc, get("/me"))).await;
    assert_eq!(seen.x_cache(), "PASS");
    assert_eq!(
        counts,
        (1, 0, 0),
        "(hits, misses, stale) of one request past the marker"
    );
}

/// A request whose variant is not stored reads the vary record once: one hit, one miss.
async fn a_vary_record_read_counts_one_hit(env: Env) {
    let origin = Origin::new(|req, _| {
        let lang = req
            .headers()
            .get("accept-language")
            .map_or("none", |v| v.to_str().unwrap());
        response(
            StatusCode::OK,
            &[("vary", "Accept-Language")],
            format!("in {lang}"),
        )
    });
    let cache = cache(&env);
    let pages = ResponseCacheLayer::new(cache.clone());
    let svc = pages.layer(origin.service());
    let lang = |l| get_with("/v", &[("accept-language", l)]);
    assert_eq!(send(&svc, lang("en")).await.x_cache(), "MISS");
    let (seen, counts) = counted(&pages, send(&svc, lang("fr"))).await;
    assert_eq!(seen.x_cache(), "MISS");
    assert_eq!(
        counts,
        (1, 1, 0),
        "(hits, misses, stale): the record hit, the variant missed"
    );
}

/// A no-cache request that revalidates a page reads the page once before the revalidation.
async fn a_revalidated_page_read_counts_one_hit(env: Env) {
    let origin = Origin::new(|_, n| response(StatusCode::OK, &[], format!("v{n}")));
    let cache = cache(&env);
    let pages = ResponseCacheLayer::new(cache.clone());
    let svc = pages.layer(origin.service());
    assert_eq!(send(&svc, get("/r")).await.x_cache(), "MISS");
    env.advance(Duration::from_secs(5));
    let (seen, counts) = counted(
        &pages,
        send(&svc, get_with("/r", &[("cache-control", "no-cache")])),
    )
    .await;
    assert_eq!(seen.body, "v2");
    assert_eq!(counts.0, 1, "hits of one revalidating request: {counts:?}");
}

/// An origin behind a limit of one request at a time, whose readiness holds the permit until
/// `call` (as tower's `ConcurrencyLimit` does); a clone does not share its permit.
struct Limited<S> {
    inner: S,
    sem: Arc<Semaphore>,
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
    acquiring: Option<
        Pin<Box<dyn std::future::Future<Output = tokio::sync::OwnedSemaphorePermit> + Send>>,
    >,
}

impl<S: Clone> Clone for Limited<S> {
    fn clone(&self) -> Self {
        Limited {
            inner: self.inner.clone(),
            sem: self.sem.clone(),
            permit: None,
            acquiring: None,
        }
    }
}

impl<S, Req> Service<Req> for Limited<S>
where
    S: Service<Req>,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn std::future::Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        if self.permit.is_none() {
            let sem = self.sem.clone();
            let acquiring = self
                .acquiring
                .get_or_insert_with(|| Box::pin(async move { sem.acquire_owned().await.unwrap() }));
            match acquiring.as_mut().poll(cx) {
                Poll::Ready(p) => {
                    self.permit = Some(p);
                    self.acquiring = None;
                }
                Poll::Pending => return Poll::Pending,
            }
        }
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let permit = self.permit.take().expect("poll_ready first");
        let f = self.inner.call(req);
        Box::pin(async move {
            let r = f.await;
            drop(permit);
            r
        })
    }
}

/// Two connections' services over an origin limited to one request at a time: once the first
/// connection's request is answered (a hit) and it goes idle, the second one gets the origin.
async fn a_hit_answered_in_call_does_not_keep_the_origins_readiness(env: Env) {
    let origin = Origin::page("page", &[]);
    let sem = Arc::new(Semaphore::new(1));
    let limited = Limited {
        inner: origin.service(),
        sem,
        permit: None,
        acquiring: None,
    };
    let mut a = layer(&env).build().unwrap().layer(limited);
    let mut b = a.clone();
    let first = a.ready().await.unwrap().call(get("/p")).await.unwrap();
    assert_eq!(first.headers()["x-cache"], "MISS");
    let hit = a.ready().await.unwrap().call(get("/p")).await.unwrap();
    assert_eq!(hit.headers()["x-cache"], "HIT");
    // `a` is idle now (a keep-alive connection between requests); `b` has a request for another
    // page.
    let ready = tokio::time::timeout(Duration::from_secs(2), b.ready()).await;
    assert!(
        ready.is_ok(),
        "the idle service still holds the origin's only permit: every other service is stuck"
    );
    let other = b.call(get("/q")).await.unwrap();
    assert_eq!(other.headers()["x-cache"], "MISS");
}

/// XFetch draws once per request: with a stored page `remaining` ms before its soft expiry and
/// a load of L ms, a request refreshes early with probability exp(-remaining / (L * beta)).
async fn early_refresh_is_drawn_once_per_request(env: Env) {
    const N: usize = 300;
    const BETA: f64 = 50.0;
    // The load time the envelope records (L): the origin's own time, about 20 ms, measured
    // where it is spent (a loaded machine stretches the sleep, and the draw sees that).
    let origin_micros = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let spent = Arc::clone(&origin_micros);
    let origin = Origin::new(move |_, n| {
        let t = std::time::Instant::now();
        std::thread::sleep(Duration::from_millis(20));
        let resp = response(
            StatusCode::OK,
            &[("cache-control", "max-age=60")],
            format!("v{n}"),
        );
        spent.fetch_add(
            t.elapsed().as_micros() as u64,
            std::sync::atomic::Ordering::SeqCst,
        );
        resp
    });
    let cache = env.builder().early_refresh(BETA).build_async().unwrap();
    let svc = ResponseCacheLayer::new(cache).layer(origin.service());
    for i in 0..N {
        assert_eq!(send(&svc, get(&format!("/e{i}"))).await.x_cache(), "MISS");
    }
    let load_ms =
        origin_micros.load(std::sync::atomic::Ordering::SeqCst) as f64 / 1000.0 / N as f64;
    // 700 ms before the pages' soft expiry: P(early) = exp(-700 / (L * 50)), about 0.5.
    env.advance(Duration::from_millis(60_000 - 700));
    for i in 0..N {
        send(&svc, get(&format!("/e{i}"))).await;
    }
    let early = origin.calls() - N;
    let p = (-700.0 / (load_ms * BETA)).exp();
    let expected = p * N as f64;
    let sd = (N as f64 * p * (1.0 - p)).sqrt();
    assert!(
        (early as f64 - expected).abs() < 4.0 * sd,
        "{early} early refreshes of {N}; expected {expected:.0} ± {:.0} (p = {p:.2}, p² = {:.2}, \
         L ≈ {load_ms:.1} ms)",
        4.0 * sd,
        p * p
    );
}
// ---------------------------------------------------------------------------------------------
// An always-ready layer would let waiters behind a fill that queued for the origin time out and
// stampede it. Readiness, its errors, a request dropped
// while the origin is busy, and the counts, on memory (at once) and memcached (async).

crate::on_backend_async!(
    origin_capacity_memory,
    Memory,
    false,
    waiters_behind_an_origin_at_capacity_make_one_origin_call,
    a_request_dropped_while_the_origin_is_not_ready_leaves_nothing_behind,
    waiters_holding_the_origins_permits_share_one_fill,
    counts_agree_on_every_backend
);
crate::on_backend_async!(
    origin_capacity_memcached,
    Memcached,
    false,
    waiters_behind_an_origin_at_capacity_make_one_origin_call,
    a_request_dropped_while_the_origin_is_not_ready_leaves_nothing_behind,
    waiters_holding_the_origins_permits_share_one_fill,
    counts_agree_on_every_backend
);

fn limited(
    origin: &Origin,
    sem: &Arc<Semaphore>,
) -> Limited<
    impl Service<Request<()>, Response = Response<B>, Error = Infallible, Future: Send>
    + Clone
    + Send
    + 'static,
> {
    Limited {
        inner: origin.service(),
        sem: sem.clone(),
        permit: None,
        acquiring: None,
    }
}

/// An origin limited to one request at a time whose permit another request holds for a
/// second: eight requests for one cold URL make one origin call. The limit serialises them
/// almost wholly (readiness is the origin's, taken before the cache is read), so this guards
/// against a fill queueing for the origin while it holds the key, whose waiters then ran out of
/// `max_wait` and went to the origin themselves; the herd protection proper is the next test's.
async fn waiters_behind_an_origin_at_capacity_make_one_origin_call(env: Env) {
    let origin = Origin::page("page", &[]);
    let sem = Arc::new(Semaphore::new(1));
    let cache = env
        .builder()
        .max_wait(Duration::from_millis(300))
        .build_async()
        .unwrap();
    let svc = ResponseCacheLayer::new(cache).layer(limited(&origin, &sem));
    // Another request (another URL, a POST...) holds the origin's only permit for a second.
    let busy = sem.clone().acquire_owned().await.unwrap();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        drop(busy);
    });
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let svc = svc.clone();
        tasks.push(tokio::spawn(
            async move { send_owned(svc, get("/cold")).await },
        ));
    }
    let mut x_cache = Vec::new();
    for t in tasks {
        x_cache.push(t.await.unwrap().x_cache().to_string());
    }
    assert_eq!(
        origin.calls(),
        1,
        "origin calls for one cold URL while the origin was at capacity; X-Cache: {x_cache:?}"
    );
}

/// Eight requests for one cold URL, each holding one of the origin's eight permits, while the
/// one fill is held in the origin until the seven others wait for it: one origin call.
async fn waiters_holding_the_origins_permits_share_one_fill(env: Env) {
    let mut origin = Origin::new(|_, n| response(StatusCode::OK, &[], format!("v{n}")));
    let gate = Arc::new(Semaphore::new(0));
    origin.gate = Some(gate.clone());
    let sem = Arc::new(Semaphore::new(8));
    let cache = env.builder().build_async().unwrap();
    let pages = ResponseCacheLayer::new(cache.clone());
    let svc = pages.layer(limited(&origin, &sem));
    let waiting = pages.clone();
    release_when(gate, move || waiting.stats().lease_waits >= 7);
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let svc = svc.clone();
        tasks.push(tokio::spawn(
            async move { send_owned(svc, get("/cold")).await },
        ));
    }
    let mut got = Vec::new();
    for t in tasks {
        let seen = t.await.unwrap();
        got.push((seen.x_cache().to_string(), seen.body.clone()));
    }
    assert_eq!(origin.calls(), 1, "one fill for eight requests: {got:?}");
    assert!(got.iter().all(|(_, body)| &body[..] == b"v1"), "{got:?}");
    assert!(
        pages.stats().lease_waits >= 7,
        "the seven others waited for the fill"
    );
}

/// A request dropped while it waits for the origin's readiness has taken nothing (readiness
/// comes before the cache is read): a request behind it fetches as soon as the origin is ready.
async fn a_request_dropped_while_the_origin_is_not_ready_leaves_nothing_behind(env: Env) {
    let origin = Origin::new(|_, n| response(StatusCode::OK, &[], format!("v{n}")));
    let sem = Arc::new(Semaphore::new(1));
    let cache = env
        .builder()
        .max_wait(Duration::from_secs(60))
        .build_async()
        .unwrap();
    let svc = ResponseCacheLayer::new(cache).layer(limited(&origin, &sem));
    let busy = sem.clone().acquire_owned().await.unwrap();
    let leader = {
        let svc = svc.clone();
        tokio::spawn(async move { send_owned(svc, get("/gone")).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let follower = {
        let svc = svc.clone();
        tokio::spawn(async move { send_owned(svc, get("/gone")).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    leader.abort();
    let _ = leader.await;
    drop(busy);
    let follower = tokio::time::timeout(Duration::from_secs(5), follower)
        .await
        .expect("the follower waited for a claim whose holder is gone")
        .unwrap();
    assert_eq!(
        (follower.x_cache(), &follower.body[..]),
        ("MISS", &b"v1"[..])
    );
    let next = tokio::time::timeout(Duration::from_secs(5), send(&svc, get("/gone")))
        .await
        .unwrap();
    assert_eq!((next.x_cache(), &next.body[..]), ("HIT", &b"v1"[..]));
}

/// What one request counts, the same on every backend (memory answers hits in `call`).
async fn counts_agree_on_every_backend(env: Env) {
    let mut origin = Origin::new(|req, n| {
        let headers: &[(&str, &str)] = match req.uri().path() {
            "/private" => &[("cache-control", "private")],
            "/vary" => &[("vary", "accept-language")],
            _ => &[],
        };
        response(StatusCode::OK, headers, format!("v{n}"))
    });
    // Five origin calls before the stale page's refresh, which waits here.
    let gate = Arc::new(Semaphore::new(5));
    origin.gate = Some(gate.clone());
    let cache = cache(&env);
    let pages = ResponseCacheLayer::new(cache.clone());
    let svc = pages.layer(origin.service());
    let en = || get_with("/vary", &[("accept-language", "en")]);
    send(&svc, get("/page")).await;
    send(&svc, get("/private")).await;
    send(&svc, en()).await;
    let mut got = Vec::new();
    for (what, req) in [
        ("fresh page", get("/page")),
        ("HEAD", Request::head("/page").body(()).unwrap()),
        ("pass marker", get("/private")),
        ("vary record + variant", en()),
        (
            "record + missing variant",
            get_with("/vary", &[("accept-language", "de")]),
        ),
        (
            "If-None-Match",
            get_with("/page", &[("if-none-match", "*")]),
        ),
    ] {
        let (seen, c) = counted(&pages, send(&svc, req)).await;
        got.push((what, seen.x_cache().to_string(), c));
    }
    // A stale page: one request refreshes (held at the gate), another is served it stale.
    env.advance(Duration::from_secs(61));
    let before = pages.stats();
    let refresh = {
        let svc = svc.clone();
        tokio::spawn(async move { send(&svc, get("/page")).await })
    };
    while origin.calls() < 6 {
        tokio::task::yield_now().await;
    }
    let mid = pages.stats();
    let (stale, c) = counted(&pages, send(&svc, get("/page"))).await;
    got.push(("stale page", stale.x_cache().to_string(), c));
    gate.add_permits(1 << 20);
    let refreshed = refresh.await.unwrap();
    got.push((
        "stale refresh",
        refreshed.x_cache().to_string(),
        read_counts(&before, &mid),
    ));
    let expected = [
        ("fresh page", "HIT", (1, 0, 0)),
        ("HEAD", "HIT", (0, 0, 0)),
        ("pass marker", "PASS", (1, 0, 0)),
        ("vary record + variant", "HIT", (2, 0, 0)),
        ("record + missing variant", "MISS", (1, 1, 0)),
        ("If-None-Match", "HIT", (1, 0, 0)),
        ("stale page", "STALE", (0, 0, 1)),
        ("stale refresh", "MISS", (0, 1, 0)),
    ];
    let expected: Vec<_> = expected
        .iter()
        .map(|(w, x, c)| (*w, x.to_string(), *c))
        .collect();
    assert_eq!(got, expected);
}

/// [`send`] for a service that is `Send` but not `Sync`.
async fn send_owned<S, RB>(svc: S, req: Request<()>) -> Seen
where
    S: Service<Request<()>, Response = Response<RB>>,
    S::Error: std::fmt::Debug,
    RB: http_body::Body<Data = Bytes>,
    RB::Error: std::fmt::Debug,
{
    let resp = svc.oneshot(req).await.expect("the service answers");
    let (parts, body) = resp.into_parts();
    Seen {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.expect("the body").to_bytes(),
    }
}

// ---- The at-once memo ----

/// A memory backend on `clock`, seen and steered through the fixture's [`Hooked`].
fn watched(clock: Arc<newcache::testing::MockClock>) -> Arc<Hooked> {
    Arc::new(Hooked::new(Arc::new(newcache::MemoryBackend::new(
        64 << 20,
        clock,
    ))))
}

/// Serves a page twice (a miss, then a hit) on this thread, drops the service, the cache, its
/// backend and the runtime, and says whether anything still holds the page's stored bytes.
fn page_bytes_left_behind(early_refresh: bool) -> bool {
    let clock = newcache::testing::MockClock::new();
    let watched = watched(clock.clone());
    let mut builder = newcache::Cache::builder()
        .backend(watched.clone())
        .clock(clock);
    if early_refresh {
        // XFetch on: no at-once path (a draw this small never refreshes early).
        builder = builder.early_refresh(1e-9);
    }
    let cache = builder.build_async().unwrap();
    let origin = Origin::page("hello", &[("cache-control", "max-age=60")]);
    let svc = ResponseCacheLayer::new(cache.clone()).layer(origin.service());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        assert_eq!(send(&svc, get("/p")).await.x_cache(), "MISS");
        assert_eq!(send(&svc, get("/p")).await.x_cache(), "HIT");
    });
    let held = watched
        .last_get
        .lock()
        .unwrap()
        .take()
        .expect("the hit read the page");
    drop((svc, cache, origin, watched, rt));
    !held.is_unique()
}

/// The at-once hit path's thread-local memo holds no handle on the memory backend's stored
/// buffers (holding each item it read would keep a page's stored bytes alive past their cache
/// on every thread that served it). The async path (XFetch on) is the control.
#[test]
fn a_page_served_at_once_is_not_kept_alive_after_its_cache_is_dropped() {
    assert!(
        !page_bytes_left_behind(true),
        "control: after the async path, nothing holds the page"
    );
    assert!(
        !page_bytes_left_behind(false),
        "after the at-once path, this thread still holds the stored page of a dropped cache"
    );
}

/// The at-once path (its memo included) serves exactly what the request's future serves: the
/// same script on the memory backend, with hits answered at once and with XFetch on at a draw
/// too small to ever refresh early (no at-once path: every hit decodes the item afresh), gives
/// the same responses (status, every header, `Age` and `X-Cache` included, body) and the same
/// counts.
#[test]
fn the_memo_serves_what_a_fresh_decode_serves() {
    /// What a request was, and what it got: status, sorted headers, body.
    type Served = (String, StatusCode, Vec<(String, String)>, Bytes);
    fn script(at_once: bool) -> (Vec<Served>, [u64; 3]) {
        let clock = newcache::testing::MockClock::new();
        let mut builder = newcache::Cache::builder()
            .backend(watched(clock.clone()))
            .clock(clock.clone());
        if !at_once {
            builder = builder.early_refresh(1e-9);
        }
        let cache = builder.build_async().unwrap();
        let origin = Origin::new(|req, n| {
            let lang = req
                .headers()
                .get("accept-language")
                .map_or("none", |v| v.to_str().unwrap())
                .to_string();
            match req.uri().path() {
                "/vary" => response(
                    StatusCode::OK,
                    &[("vary", "accept-language"), ("cache-control", "max-age=60")],
                    format!("{lang}{n}"),
                ),
                "/private" => response(StatusCode::OK, &[("cache-control", "private")], "p"),
                "/gone" => response(
                    StatusCode::NOT_FOUND,
                    &[("cache-control", "max-age=60")],
                    "404",
                ),
                _ => {
                    let etag = format!("\"v{n}\"");
                    let mut r = response(
                        StatusCode::OK,
                        &[
                            ("cache-control", "max-age=60"),
                            ("x-multi", "a"),
                            ("x-multi", "b"),
                        ],
                        format!("v{n}"),
                    );
                    r.headers_mut().insert("etag", etag.parse().unwrap());
                    r
                }
            }
        });
        let mut origin = origin;
        let gate = Arc::new(Semaphore::new(1 << 20));
        origin.gate = Some(gate.clone());
        let pages = ResponseCacheLayer::new(cache.clone());
        let svc = pages.layer(origin.service());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let mut seen = Vec::new();
        rt.block_on(async {
            let go = |what: &str, req: Request<()>| {
                let what = what.to_string();
                let svc = svc.clone();
                async move {
                    let s = send(&svc, req).await;
                    let mut headers: Vec<(String, String)> = s
                        .headers
                        .iter()
                        .map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_string()))
                        .collect();
                    headers.sort();
                    (what, s.status, headers, s.body)
                }
            };
            seen.push(go("miss", get("/page")).await);
            for _ in 0..3 {
                seen.push(go("hit", get("/page")).await);
            }
            seen.push(go("304", get_with("/page", &[("if-none-match", "\"v1\"")])).await);
            seen.push(go("not 304", get_with("/page", &[("if-none-match", "\"v0\"")])).await);
            seen.push(go("HEAD", Request::head("/page").body(()).unwrap()).await);
            clock.advance(Duration::from_secs(10));
            seen.push(go("aged", get("/page")).await);
            for lang in ["en", "en", "fr", "fr", "en", "de"] {
                seen.push(go(lang, get_with("/vary", &[("accept-language", lang)])).await);
            }
            seen.push(go("pass", get("/private")).await);
            seen.push(go("pass again", get("/private")).await);
            seen.push(go("404", get("/gone")).await);
            seen.push(go("404 hit", get("/gone")).await);
            seen.push(
                go(
                    "no-cache",
                    get_with("/page", &[("cache-control", "no-cache")]),
                )
                .await,
            );
            seen.push(go("after no-cache", get("/page")).await);
            clock.advance(Duration::from_secs(65));
            // A stale page: one request refreshes (held at the gate), others are served it
            // stale meanwhile (at once).
            gate.forget_permits(1 << 20);
            let calls = origin.calls();
            let refresh = tokio::spawn(go("stale: refresh", get("/page")));
            while origin.calls() == calls {
                tokio::task::yield_now().await;
            }
            seen.push(go("stale", get("/page")).await);
            seen.push(go("stale again", get("/page")).await);
            gate.add_permits(1 << 20);
            seen.push(refresh.await.unwrap());
            seen.push(go("refreshed", get("/page")).await);
            seen.push(go("put", Request::put("/page").body(()).unwrap()).await);
            seen.push(go("after put", get("/page")).await);
            seen.push(go("hit after put", get("/page")).await);
        });
        let s = pages.stats();
        (seen, [s.hits, s.misses, s.stale_served])
    }
    let (memo, memo_counts) = script(true);
    let (fresh, fresh_counts) = script(false);
    if std::env::var_os("SHOW_SCRIPT").is_some() {
        for m in &memo {
            eprintln!("{m:?}");
        }
        eprintln!("{memo_counts:?}");
    }
    for (m, f) in memo.iter().zip(&fresh) {
        assert_eq!(m, f);
    }
    assert_eq!(memo.len(), fresh.len());
    assert_eq!(memo_counts, fresh_counts, "(hits, misses, stale)");
}

// ---- The at-once path: what an outage counts, what a request without a host invalidates ----

/// One GET through the layer while the backend's reads fail, with hits answered at once or
/// (the control) with XFetch on at a draw too small to ever refresh early: what it counted
/// (backend errors, of them absorbed, misses, hits) under `policy`.
fn counts_of_one_request_during_an_outage(
    at_once: bool,
    policy: newcache::FailurePolicy,
) -> [u64; 4] {
    let clock = newcache::testing::MockClock::new();
    let backend = watched(clock.clone());
    let mut builder = newcache::Cache::builder()
        .backend(backend.clone())
        .clock(clock)
        .read_failures(policy);
    if !at_once {
        builder = builder.early_refresh(1e-9);
    }
    let cache = builder.build_async().unwrap();
    let origin = Origin::page("hello", &[("cache-control", "max-age=60")]);
    let pages = ResponseCacheLayer::new(cache.clone());
    let svc = pages.layer(origin.service());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        assert_eq!(send(&svc, get("/p")).await.x_cache(), "MISS");
        assert_eq!(send(&svc, get("/p")).await.x_cache(), "HIT");
        backend.gets_fail.store(true, Ordering::SeqCst);
        let before = pages.stats();
        let _ = send(&svc, get("/p")).await;
        let after = pages.stats();
        [
            after.backend_errors - before.backend_errors,
            after.backend_errors_absorbed - before.backend_errors_absorbed,
            after.misses - before.misses,
            after.hits - before.hits,
        ]
    })
}

/// `served_now` is documented to count nothing when it does not serve ("having changed
/// nothing and counted nothing ... one that does not goes the whole way, which reads and counts
/// again"), but its read goes through `absorb_read` (in `Cache::start`), which counts the
/// failed read in `backend_errors` (and the per-server metric) and, absorbed, in
/// `backend_errors_absorbed`; the request's future then reads again and counts it again. One
/// request during an outage counts two backend errors on the at-once path, one on the
/// request's future (XFetch on: no at-once path).
#[test]
fn a_failed_read_on_the_at_once_path_is_counted_once_not_twice() {
    let seen: Vec<_> = [
        newcache::FailurePolicy::Absorb,
        newcache::FailurePolicy::Propagate,
    ]
    .into_iter()
    .map(|policy| {
        (
            policy,
            counts_of_one_request_during_an_outage(true, policy),
            counts_of_one_request_during_an_outage(false, policy),
        )
    })
    .collect();
    for (policy, at_once, fresh) in &seen {
        assert_eq!(
            at_once, fresh,
            "{policy:?}: (backend errors, absorbed, misses, hits) of one request, at-once path \
             vs the request's future (all: {seen:?})"
        );
    }
}

/// Under `HostPolicy::Key` a request without `Host` (HTTP/1.0, or a tower `oneshot` in a
/// test) is stored under the empty host: a path-only `invalidate` with `served_hosts` reaches
/// it too.
#[test]
fn the_page_of_a_request_without_host_can_still_be_invalidated() {
    use http::{Request, Response};
    use newcache::layer::ResponseCacheLayer;
    use tower::{Layer, ServiceExt};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let cache = newcache::Cache::builder()
            .in_memory()
            .build_async()
            .unwrap();
        let pages = ResponseCacheLayer::builder(cache)
            .served_hosts(["example.com"])
            .build()
            .unwrap();
        let svc = pages.layer(tower::service_fn(|_req: Request<()>| async {
            Ok::<_, std::convert::Infallible>(Response::new(http_body_util::Full::new(
                bytes::Bytes::from("hi"),
            )))
        }));
        let x_cache = |r: &Response<_>| r.headers()["x-cache"].to_str().unwrap().to_owned();
        let r = svc
            .clone()
            .oneshot(Request::get("/a").body(()).unwrap())
            .await
            .unwrap();
        assert_eq!(x_cache(&r), "MISS");
        let _ = pages.invalidate("/a").await;
        let r = svc
            .clone()
            .oneshot(Request::get("/a").body(()).unwrap())
            .await
            .unwrap();
        assert_eq!(x_cache(&r), "MISS", "the page of /a was not invalidated");
    });
}
