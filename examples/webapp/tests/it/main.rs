//! The service in-process on a free port, driven over HTTP with a real client, on the memory
//! backend and on a real memcached.

mod server;
mod service;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use serde_json::Value;

use server::Memcached;
use service::{Backend, Service};

/// Runs each named `async fn(Backend)` as two tests: `memory::name` and `memcached::name`.
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Backend::Memory).await
                }
            )*
        }
        mod memcached {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Backend::Memcached).await
                }
            )*
        }
    };
}

on_both_backends!(
    put_invalidates_the_cached_user,
    cold_report_under_64_concurrent_requests_runs_one_query,
    cached_report_queries_once_uncached_every_time,
    healthz_answers_200_while_the_cache_answers,
    pages_are_cached_whole_with_their_headers,
    private_and_cookie_setting_pages_are_never_stored,
    head_is_answered_from_the_page_over_http,
    put_user_invalidates_the_users_page,
);

/// `/page/{id}` through the response cache: a miss queries the database (two queries), then hits
/// are served whole from the cache with `Age`, and an `If-None-Match` of its ETag gets a 304;
/// `/stats` counts the page's fill and hits under `pages`, none of them under `cache`.
async fn pages_are_cached_whole_with_their_headers(backend: Backend) {
    let svc = Service::start(backend).await;
    let before = svc.db_queries().await;
    let first = svc.get("/page/5").await;
    assert_eq!(first.status(), 200);
    assert_eq!(first.headers()["x-cache"], "MISS");
    let etag = first.headers()["etag"].clone();
    let body = first.text().await.unwrap();
    let after_miss = svc.db_queries().await;
    assert!(after_miss > before, "the miss ran the page's queries");
    for _ in 0..5 {
        let r = svc.get("/page/5").await;
        assert_eq!(r.headers()["x-cache"], "HIT");
        assert!(r.headers().contains_key("age"), "{:?}", r.headers());
        assert_eq!(r.text().await.unwrap(), body);
    }
    assert_eq!(svc.db_queries().await, after_miss, "hits ran no query");
    let r = svc
        .request(reqwest::Method::GET, "/page/5")
        .header("if-none-match", etag)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 304, "answered from the entry");
    // The page's fill is the response cache's, not one of the service's own loads.
    let stats = svc.get_json("/stats").await;
    assert_eq!(stats["pages"]["loader_calls"], 1, "{stats}");
    assert_eq!(stats["pages"]["hits"], 6, "{stats}");
    assert_eq!(stats["cache"]["loader_calls"], 0, "{stats}");
    svc.stop().await;
}

/// A `private` page and a page that sets a cookie go through the same layer and are never
/// stored: every request reaches the handler, none is a HIT, and no one else gets the cookie.
async fn private_and_cookie_setting_pages_are_never_stored(backend: Backend) {
    let svc = Service::start(backend).await;
    let before = svc.db_queries().await;
    for _ in 0..4 {
        let r = svc.get("/account/6").await;
        assert_eq!(r.status(), 200);
        assert_ne!(r.headers()["x-cache"], "HIT");
        assert!(
            r.headers()["cache-control"]
                .to_str()
                .unwrap()
                .contains("private")
        );
    }
    assert!(
        svc.db_queries().await >= before + 4,
        "every private page reached the database"
    );
    for _ in 0..4 {
        let r = svc.get("/welcome").await;
        assert_ne!(r.headers()["x-cache"], "HIT");
        // The handler's own response each time, never one replayed from the cache.
        assert!(r.headers().contains_key("set-cookie"));
    }
    svc.stop().await;
}

async fn put_invalidates_the_cached_user(backend: Backend) {
    let svc = Service::start(backend).await;
    let before: Value = svc.get_json("/users/5").await;
    assert_eq!(before["name"], "user-5");
    assert_eq!(svc.db_queries().await, 1);
    // A second read is served from the cache.
    assert_eq!(svc.get_json("/users/5").await, before);
    assert_eq!(svc.db_queries().await, 1);

    let put = svc
        .client()
        .put(svc.url("/users/5"))
        .json(&serde_json::json!({ "name": "zed" }))
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), 200);
    let updated: Value = put.json().await.unwrap();
    assert_eq!(updated["name"], "zed");
    assert_eq!(updated["email"], "user5@example.com");

    let after: Value = svc.get_json("/users/5").await;
    assert_eq!(
        after["name"], "zed",
        "the PUT deleted the key: the next GET loads the row"
    );
    // The update, and the reload after it.
    assert_eq!(svc.db_queries().await, 3);
    svc.stop().await;
}

async fn cold_report_under_64_concurrent_requests_runs_one_query(backend: Backend) {
    let svc = Service::start(backend).await;
    let bodies = svc.get_concurrently("/report/3", 64).await;
    assert_eq!(bodies.len(), 64);
    let distinct: HashSet<&String> = bodies.iter().collect();
    assert_eq!(distinct.len(), 1, "every request got the same report");
    let report: Value = serde_json::from_str(&bodies[0]).unwrap();
    assert_eq!(report["product"], 3);
    assert!(report["orders"].as_i64().unwrap() > 0, "{report}");
    assert_eq!(
        svc.db_queries().await,
        1,
        "64 concurrent cold requests, one query"
    );
    let stats = svc.get_json("/stats").await;
    assert_eq!(stats["cache"]["loader_calls"], 1, "{stats}");
    svc.stop().await;
}

async fn cached_report_queries_once_uncached_every_time(backend: Backend) {
    let svc = Service::start(backend).await;
    let cached = svc.get_json("/report/2").await;
    for _ in 0..3 {
        assert_eq!(svc.get_json("/report/2").await, cached);
    }
    assert_eq!(svc.db_queries().await, 1);
    for i in 1..=3 {
        assert_eq!(svc.get_json("/report/2?cache=off").await, cached);
        assert_eq!(
            svc.db_queries().await,
            1 + i,
            "?cache=off queries every time"
        );
    }
    assert_eq!(svc.get_json("/report/2?cache=on").await, cached);
    assert_eq!(svc.db_queries().await, 4);
    let stats = svc.get_json("/stats").await;
    assert!(stats["cache"]["hits"].as_u64().unwrap() >= 4, "{stats}");
    assert_eq!(stats["cache"]["misses"], 1, "{stats}");
    svc.stop().await;
}

async fn healthz_answers_200_while_the_cache_answers(backend: Backend) {
    let svc = Service::start(backend).await;
    let r = svc.get("/healthz").await;
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["status"], "ok", "{body}");
    svc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_answers_503_with_the_error_when_memcached_is_down() {
    let mut svc = Service::start(Backend::Memcached).await;
    assert_eq!(svc.get("/healthz").await.status(), 200);
    svc.memcached().kill();
    let r = svc.get("/healthz").await;
    assert_eq!(r.status(), 503);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["status"], "unavailable", "{body}");
    // `cache.ping()`'s error: which server did not answer.
    let error = body["error"].as_str().unwrap();
    let addr = svc.memcached().addr();
    assert!(error.contains(&addr), "{body}");
    // The app still serves from the database (reads absorb the backend's failure).
    assert_eq!(svc.get_json("/users/1").await["name"], "user-1");
    svc.stop().await;
}

/// Two services (two caches, as two processes would have) over one memcached: a cold report
/// asked of both at once is queried once in all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_services_over_one_memcached_share_the_herd_protection() {
    let server = Memcached::start();
    let a = Service::start_with(&[server.addr()]).await;
    let b = Service::start_with(&[server.addr()]).await;
    let (from_a, from_b) = tokio::join!(
        a.get_concurrently("/report/7", 32),
        b.get_concurrently("/report/7", 32)
    );
    assert_eq!(from_a.len() + from_b.len(), 64);
    assert!(from_a.iter().chain(&from_b).all(|body| *body == from_a[0]));
    assert_eq!(
        a.db_queries().await + b.db_queries().await,
        1,
        "one query across both services"
    );
    a.stop().await;
    b.stop().await;
}

/// Two processes of the example service over one memcached and one database, each with a near
/// tier, on one bus (Redis pub/sub): a `PUT` in one is seen by the other's reads at once, where
/// without the bus the other would serve its near copy for up to the near ttl (5 s). Processes,
/// not two services in this one: caches over one server list in one process share their near
/// tiers' fences, and would see each other's writes without the bus.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_in_one_process_is_seen_by_the_other_at_once_over_the_bus() {
    let memcached = Memcached::start();
    let redis = server::RedisServer::start();
    let db = std::env::temp_dir().join(format!(
        "newcache-webapp-test-{}-bus.sqlite",
        std::process::id()
    ));
    service::remove_db(&db);
    let exe = example_binary();
    let client = reqwest::Client::new();
    let get = async |url: &str| -> Value {
        let r = client.get(url).send().await.unwrap();
        assert_eq!(r.status(), 200, "GET {url}");
        r.json().await.unwrap()
    };
    // One after the other: the first seeds the database.
    let mut processes = Vec::new();
    let mut bases = Vec::new();
    for _ in 0..2 {
        let port = server::free_port();
        processes.push(server::Process::spawn(
            std::process::Command::new(&exe)
                .args(["--port", &port.to_string(), "--rows", "2000", "--db"])
                .arg(&db)
                .env("MEMCACHED_SERVERS", memcached.addr())
                .env("NEAR_CACHE_MB", "16")
                .env("BUS_REDIS", format!("redis://127.0.0.1:{}", redis.port))
                .env_remove("REDIS_URL"),
        ));
        let base = format!("http://127.0.0.1:{port}");
        let started = Instant::now();
        while client.get(format!("{base}/healthz")).send().await.is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "{base} did not start"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bases.push(base);
    }
    let (a, b) = (&bases[0], &bases[1]);
    let user = format!("{b}/users/3");
    let near_hits = async || get(&format!("{b}/stats")).await["cache"]["near_hits"].as_u64();

    // b serves user 3 from its near copy (the first reads after its load may go to memcached).
    let started = Instant::now();
    while near_hits().await < Some(1) {
        assert_eq!(get(&user).await["name"], "user-3");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "b keeps no near copy"
        );
    }
    // A write comes at any time, not just after a read: a quiet second on the bus first.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let hits = near_hits().await;
    assert_eq!(get(&user).await["name"], "user-3");
    assert!(near_hits().await > hits, "b still serves its near copy");

    let r = client
        .put(format!("{a}/users/3"))
        .json(&serde_json::json!({ "name": "bo" }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let written = Instant::now();
    // A fifth of the near ttl: the bus's bound is tens of ms.
    while get(&user).await["name"] != "bo" {
        assert!(
            written.elapsed() < Duration::from_secs(1),
            "b still serves the old name 1 s after the PUT: {}",
            get(&format!("{b}/stats")).await["cache"]
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(processes);
    service::remove_db(&db);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_is_prometheus_text_with_the_service_counters() {
    let svc = Service::start(Backend::Memory).await;
    for _ in 0..3 {
        svc.get_json("/report/1").await;
    }
    let r = svc.get("/metrics").await;
    assert_eq!(r.status(), 200);
    let content_type = r.headers()["content-type"].to_str().unwrap().to_owned();
    assert!(
        content_type.starts_with("text/plain; version=0.0.4"),
        "{content_type}"
    );
    let text = r.text().await.unwrap();
    let samples = prometheus::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    // Other tests of this binary share the process's recorder: at least ours are counted.
    let requests = prometheus::value(
        &samples,
        "webapp_http_requests_total",
        &[("route", "/report/{id}"), ("status", "200")],
    );
    assert!(requests >= 3.0, "{text}");
    let queries = prometheus::value(&samples, "webapp_db_queries_total", &[("query", "report")]);
    assert!(queries >= 1.0, "{text}");
    // newcache's own counters (its `metrics` feature), labelled with the cache's name: the
    // first report was a miss and a load, the other two hits.
    let cache = [("cache", "webapp")];
    assert!(
        prometheus::value(&samples, "newcache_hits_total", &cache) >= 2.0,
        "{text}"
    );
    assert!(
        prometheus::value(&samples, "newcache_loads_total", &cache) >= 1.0,
        "{text}"
    );
    svc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_clear_error() {
    let svc = Service::start(Backend::Memory).await;
    for (path, status, says) in [
        ("/report/abc", 400, "id \"abc\" is not an integer"),
        ("/report/0", 404, "product 0"),
        ("/report/1?cache=maybe", 400, "cache=\"maybe\""),
    ] {
        let r = svc.get(path).await;
        assert_eq!(r.status(), status, "{path}");
        let body: Value = r.json().await.unwrap();
        let error = body["error"].as_str().unwrap();
        assert!(error.contains(says), "{path}: {error}");
    }
    assert_eq!(
        svc.db_queries().await,
        0,
        "no query runs for a malformed id or a product that is not"
    );
    assert_eq!(svc.get("/report/0").await.status(), 404);
    assert_eq!(svc.db_queries().await, 0);
    let put = |body: Value| svc.client().put(svc.url("/users/1")).json(&body).send();
    assert_eq!(put(serde_json::json!({})).await.unwrap().status(), 400);
    assert_eq!(
        put(serde_json::json!({ "name": " " }))
            .await
            .unwrap()
            .status(),
        400
    );
    for path in ["/users/999999", "/page/999999"] {
        let r = svc.get(path).await;
        assert_eq!(r.status(), 404, "{path}");
        let body: Value = r.json().await.unwrap();
        assert!(
            body["error"].as_str().unwrap().contains("user 999999"),
            "{path}: {body}"
        );
    }
    let missing = svc
        .client()
        .put(svc.url("/users/999999"))
        .json(&serde_json::json!({ "name": "x" }))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
    // A missing user is not cached: still a 404 (and a query) the second time.
    let q = svc.db_queries().await;
    assert_eq!(svc.get("/users/999999").await.status(), 404);
    assert_eq!(svc.db_queries().await, q + 1);
    svc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn page_is_html_with_the_user_and_latest_orders() {
    let svc = Service::start(Backend::Memory).await;
    let r = svc.get("/page/4").await;
    assert_eq!(r.status(), 200);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/html")
    );
    let html = r.text().await.unwrap();
    assert!(html.contains("<h1>user-4</h1>"), "{html}");
    assert!(html.contains("user4@example.com"), "{html}");
    assert!(html.matches("<tr><td>").count() >= 1, "{html}");
    let r = svc.get("/static").await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), "newcache webapp\n");
    svc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn series_counts_requests_and_queries_per_second() {
    let svc = Service::start(Backend::Memory).await;
    for _ in 0..5 {
        svc.get("/static").await;
    }
    svc.get_json("/report/1?cache=off").await;
    // The sampler runs every second; wait (boundedly) until it has seen all of it.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let series = svc.get_json("/series").await;
        let samples = series["samples"].as_array().unwrap();
        let sum = |field: &str| {
            samples
                .iter()
                .map(|s| s[field].as_u64().unwrap())
                .sum::<u64>()
        };
        if sum("requests") >= 6 && sum("db_queries") >= 1 {
            assert_eq!(series["interval_ms"], 1000);
            assert_eq!(series["port"].as_u64(), Some(svc.port() as u64));
            assert_eq!(series["ttl_secs"], 60);
            assert_eq!(sum("db_queries"), 1, "{series}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the series never counted them: {series}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    svc.stop().await;
}

/// A strict reader of the Prometheus text format (0.0.4): comments are `# HELP name text` or
/// `# TYPE name kind`; every other non-empty line is `name{label="value",...} number`.
mod prometheus {
    pub struct Sample {
        pub name: String,
        pub labels: Vec<(String, String)>,
        pub value: f64,
    }

    fn is_name(s: &str, first_ok: fn(char) -> bool) -> bool {
        let mut chars = s.chars();
        chars.next().is_some_and(first_ok)
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    }

    fn metric_name(s: &str) -> bool {
        is_name(s, |c| c.is_ascii_alphabetic() || c == '_' || c == ':')
    }

    fn label_name(s: &str) -> bool {
        is_name(s, |c| c.is_ascii_alphabetic() || c == '_') && !s.contains(':')
    }

    pub fn parse(text: &str) -> Result<Vec<Sample>, String> {
        let mut samples = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let bad = |why: &str| format!("line {}: {why}: {line:?}", n + 1);
            if line.is_empty() {
                continue;
            }
            if let Some(comment) = line.strip_prefix("# ") {
                let mut parts = comment.splitn(3, ' ');
                match (parts.next(), parts.next(), parts.next()) {
                    (Some("HELP"), Some(name), _) if metric_name(name) => {}
                    (Some("TYPE"), Some(name), Some(kind))
                        if metric_name(name)
                            && ["counter", "gauge", "histogram", "summary", "untyped"]
                                .contains(&kind) => {}
                    _ => return Err(bad("a comment that is neither HELP nor TYPE")),
                }
                continue;
            }
            let (series, value) = line.rsplit_once(' ').ok_or_else(|| bad("no value"))?;
            let value: f64 = match value {
                "+Inf" => f64::INFINITY,
                "-Inf" => f64::NEG_INFINITY,
                v => v.parse().map_err(|_| bad("a value that is not a number"))?,
            };
            let (name, labels) = match series.split_once('{') {
                None => (series, Vec::new()),
                Some((name, rest)) => {
                    let body = rest
                        .strip_suffix('}')
                        .ok_or_else(|| bad("unclosed labels"))?;
                    (
                        name,
                        labels_of(body).ok_or_else(|| bad("malformed labels"))?,
                    )
                }
            };
            if !metric_name(name) {
                return Err(bad("a bad metric name"));
            }
            samples.push(Sample {
                name: name.to_owned(),
                labels,
                value,
            });
        }
        if samples.is_empty() {
            return Err("no samples".into());
        }
        Ok(samples)
    }

    /// `a="x",b="y\"z"` (a trailing comma allowed).
    fn labels_of(mut body: &str) -> Option<Vec<(String, String)>> {
        let mut labels = Vec::new();
        while !body.is_empty() {
            let (name, rest) = body.split_once("=\"")?;
            if !label_name(name) {
                return None;
            }
            let mut value = String::new();
            let mut chars = rest.char_indices();
            let end = loop {
                match chars.next()? {
                    (i, '"') => break i,
                    (_, '\\') => match chars.next()?.1 {
                        'n' => value.push('\n'),
                        c @ ('\\' | '"') => value.push(c),
                        _ => return None,
                    },
                    (_, c) => value.push(c),
                }
            };
            labels.push((name.to_owned(), value));
            body = &rest[end + 1..];
            body = match body.strip_prefix(',') {
                Some(more) => more,
                None if body.is_empty() => body,
                None => return None,
            };
        }
        Some(labels)
    }

    /// The value of the sample `name` whose labels include `labels`; panics if there is none.
    pub fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
        samples
            .iter()
            .find(|s| {
                s.name == name
                    && labels
                        .iter()
                        .all(|(k, v)| s.labels.iter().any(|(sk, sv)| sk == k && sv == v))
            })
            .unwrap_or_else(|| panic!("no sample {name}{labels:?}"))
            .value
    }

    #[test]
    fn rejects_what_is_not_prometheus_text() {
        assert!(parse("a_total 1\n# TYPE a_total counter\nb{x=\"1\",y=\"a\\\"b\"} 2.5\n").is_ok());
        for bad in [
            "",
            "<html>",
            "a b",
            "1a 1",
            "a{x=1} 1",
            "a{x=\"1\"",
            "# NOTE x",
            "a{x=\"1\"y=\"2\"} 1",
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }
}

/// The example binary (`examples/webapp.rs`), built if it is not (`cargo test --test it`
/// builds no example), beside this test's own binary.
fn example_binary() -> std::path::PathBuf {
    let built = std::process::Command::new(env!("CARGO"))
        .args([
            "build",
            "--quiet",
            "-p",
            "newcache-webapp",
            "--example",
            "webapp",
        ])
        .status()
        .expect("cargo runs");
    assert!(built.success(), "the webapp example builds");
    // target/debug/deps/it-<hash> -> target/debug/examples/webapp
    let exe = std::env::current_exe().unwrap();
    exe.parent()
        .and_then(|deps| deps.parent())
        .unwrap()
        .join("examples/webapp")
}

/// A cache whose server does not answer at startup stops the service at once, non-zero, with
/// `ping()`'s message: what is wrong and where (nothing listens there; the password is wrong),
/// rather than a service that serves every request from the database with one warning logged.
#[test]
fn the_service_will_not_start_without_its_cache_and_says_why() {
    let closed = server::free_port();
    let redis = server::RedisServer::start_with_password("right");
    let cases = [
        (
            format!("redis://127.0.0.1:{closed}/0"),
            format!("127.0.0.1:{closed}"),
            "Connection refused",
        ),
        (
            format!("redis://:n0t-the-one@127.0.0.1:{}/0", redis.port),
            format!("127.0.0.1:{}", redis.port),
            "password",
        ),
    ];
    let exe = example_binary();
    for (url, server, why) in cases {
        let db = std::env::temp_dir().join(format!(
            "newcache-webapp-test-{}-unreachable.sqlite",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&db);
        let mut child = std::process::Command::new(&exe)
            .args(["--port", "0", "--rows", "2000", "--db"])
            .arg(&db)
            .env_remove("MEMCACHED_SERVERS")
            .env("REDIS_URL", &url)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("{url}: the service started without its cache");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut said = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut said).unwrap();
        assert_eq!(status.code(), Some(1), "{url}: {said}");
        assert!(said.contains("did not answer"), "{url}: {said}");
        assert!(
            said.contains(&server) && said.contains(why),
            "{url}: {said}"
        );
        assert!(
            !said.contains("n0t-the-one"),
            "the password is never printed: {said}"
        );
        assert!(!db.exists(), "stopped before seeding: {}", db.display());
    }
}

/// Two processes starting on a new database at once: one seeds, the other waits for its
/// transaction and finds the seed done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_services_starting_on_one_new_database_seed_it_once() {
    let db = std::env::temp_dir().join(format!(
        "newcache-webapp-test-{}-shared.sqlite",
        std::process::id()
    ));
    let config = service::config_for(&db, &[]);
    let (a, b) = tokio::join!(
        newcache_webapp::App::open(&config),
        newcache_webapp::App::open(&config)
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    let seeds = [&a, &b]
        .iter()
        .filter(|app| app.startup().seeded.is_some())
        .count();
    assert_eq!(seeds, 1);
    drop((a, b));
    service::remove_db(&db);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_that_is_not_a_database_is_a_clear_startup_error() {
    let db = std::env::temp_dir().join(format!(
        "newcache-webapp-test-{}-garbage.sqlite",
        std::process::id()
    ));
    std::fs::write(
        &db,
        "not a database, just text long enough to have a header page\n".repeat(100),
    )
    .unwrap();
    let err = newcache_webapp::App::open(&service::config_for(&db, &[]))
        .await
        .unwrap_err();
    assert!(
        matches!(err, newcache_webapp::Error::Open { .. }),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!("cannot open database {}", db.display())
    );
    service::remove_db(&db);
}

/// HEAD over real HTTP (hyper) after the page is stored: the GET's Content-Length, no body.
async fn head_is_answered_from_the_page_over_http(backend: Backend) {
    let svc = Service::start(backend).await;
    let body = svc.get("/page/7").await.bytes().await.unwrap();
    let r = svc
        .request(reqwest::Method::HEAD, "/page/7")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-cache"], "HIT");
    assert_eq!(
        r.headers()["content-length"],
        body.len().to_string().as_str()
    );
    svc.stop().await;
}

/// `PUT /users/{id}` deletes the user's key and invalidates the page that shows the user
/// (`ResponseCacheLayer::invalidate`): the next `/page/{id}` shows the new name.
async fn put_user_invalidates_the_users_page(backend: Backend) {
    let svc = Service::start(backend).await;
    let before = svc.get("/page/8").await.text().await.unwrap();
    assert!(before.contains("user-8"));
    let put = svc
        .client()
        .put(svc.url("/users/8"))
        .json(&serde_json::json!({ "name": "renamed-8" }))
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), 200);
    let after = svc.get("/page/8").await.text().await.unwrap();
    assert!(
        after.contains("renamed-8"),
        "the page still shows the name the PUT replaced"
    );
    svc.stop().await;
}
