//! `App` (the shared state: cache, database, counters), the routes, and `serve`.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Path, Query, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use newcache::layer::{HostPolicy, ResponseCacheLayer};
use newcache::{AsyncCache, Cache, RedisBus};
use serde::Deserialize;
use serde_json::json;

use crate::config::Config;
use crate::db::{Db, Report, User};
use crate::error::Error;
use crate::page;
use crate::series::{Recorder, Series};
use crate::telemetry;

/// The service's state: its cache, database and counters. A cheap `Clone` (an `Arc` inside).
#[derive(Clone)]
pub struct App {
    inner: Arc<Inner>,
}

struct Inner {
    cache: AsyncCache,
    db: Db,
    ttl: Duration,
    /// The port `serve` listens on (0 until it does).
    port: AtomicU16,
    requests: AtomicU64,
    series: Recorder,
    prometheus: PrometheusHandle,
    startup: Startup,
    /// The response cache on `/page/{id}`.
    pages: ResponseCacheLayer,
}

impl std::fmt::Debug for App {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("App")
            .field("startup", &self.inner.startup)
            .field("ttl", &self.inner.ttl)
            .finish_non_exhaustive()
    }
}

/// What [`App::open`] did, for the startup banner.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Startup {
    /// The database file.
    pub db_path: PathBuf,
    /// Orders in it.
    pub rows: u64,
    /// How long seeding took, if this start seeded the database.
    pub seeded: Option<Duration>,
    /// How long the expensive query (`/report/1`, uncached) took: the fastest of three runs.
    pub report_query: Duration,
    /// The cache backend: `memory`, `memcached host:port,...` or `redis URL`, then its near tier
    /// and its bus, if any.
    pub backend: String,
}

impl App {
    /// Opens (seeding on first start) the database, measures the expensive query, and builds
    /// the cache: memcached when `config` names servers, else Redis when it names a URL, else
    /// the memory backend; with a near tier and on a bus when `config` asks for them.
    ///
    /// # Errors
    /// [`Error::Db`] or [`Error::Io`] if the database cannot be opened or seeded,
    /// [`Error::Cache`] (`is_config`) for a malformed server address or bus URL,
    /// [`Error::Unreachable`] when the cache's servers do not answer its ping (nothing listens
    /// there, a wrong password or database): without it, every request would go to the
    /// database, and the only sign would be a warning in the log.
    pub async fn open(config: &Config) -> Result<App, Error> {
        let servers = config.servers();
        // The recorder first: the cache registers its metrics' handles when it is built.
        let prometheus = telemetry::prometheus();
        let builder = Cache::builder()
            .flavor("webapp")
            .name("webapp")
            .default_ttl(config.ttl());
        let (builder, backend) = match (servers.is_empty(), config.redis()) {
            (false, _) => {
                let named = format!("memcached {}", servers.join(","));
                (builder.memcached(&servers), named)
            }
            (true, Some(url)) => (builder.redis(url), format!("redis {}", address_of(url))),
            (true, None) => (builder.in_memory(), "memory".to_string()),
        };
        let (builder, backend) = match config.near_cache_mb {
            0 => (builder, backend),
            mb => (
                builder.near_cache(mb << 20),
                format!("{backend} with a {mb} MiB near tier"),
            ),
        };
        // The bus: every process on the channel announces its writes there, and drops its near
        // copies of the keys the others announce (all of them when a message may have been
        // lost), so that a `PUT` here is seen by the other processes' next reads within tens of
        // ms, not after the near ttl.
        let (builder, backend) = match config.bus() {
            None => (builder, backend),
            Some(url) => {
                let bus = RedisBus::new(url, config.bus_channel.as_str())?;
                let named = format!(
                    "{backend}, on the bus redis {} channel {}",
                    address_of(url),
                    config.bus_channel
                );
                (builder.near_bus(bus), named)
            }
        };
        // Built and pinged before seeding, so that a bad address, URL or password fails at
        // once (`build` never connects; `ping` asks every server).
        let cache = builder.build_async()?;
        cache.ping().await.map_err(Error::Unreachable)?;
        // One site, asked for under several names (localhost, 127.0.0.1, a balancer's): one
        // page per path, which `PUT /users/{id}` invalidates by its path.
        let pages = ResponseCacheLayer::builder(cache.clone())
            .ttl(config.ttl())
            .hosts(HostPolicy::Ignore)
            .build()?;

        let db_path = config.db_path();
        let opened = Db::open(&db_path, config.rows).await?;
        let mut report_query = Duration::MAX;
        for _ in 0..3 {
            let started = Instant::now();
            opened.db.report_uncounted(1).await?;
            report_query = report_query.min(started.elapsed());
        }
        Ok(App {
            inner: Arc::new(Inner {
                cache,
                db: opened.db,
                ttl: config.ttl(),
                port: AtomicU16::new(0),
                requests: AtomicU64::new(0),
                series: Recorder::default(),
                prometheus,
                pages,
                startup: Startup {
                    db_path,
                    rows: config.rows,
                    seeded: opened.seeded,
                    report_query,
                    backend,
                },
            }),
        })
    }

    /// What opening did.
    pub fn startup(&self) -> &Startup {
        &self.inner.startup
    }

    /// The cache the routes use.
    pub fn cache(&self) -> &AsyncCache {
        &self.inner.cache
    }

    /// Database queries requests have run since start (`"db_queries"` in `/stats`).
    pub fn db_queries(&self) -> u64 {
        self.inner.db.queries()
    }

    /// Requests answered since start.
    pub fn requests(&self) -> u64 {
        self.inner.requests.load(Ordering::Relaxed)
    }

    fn cache_key(&self, kind: &str, id: i64) -> String {
        format!("{kind}:{id}")
    }
}

/// A Redis URL as the banner names it: without its scheme, user and password.
fn address_of(url: &str) -> &str {
    url.rsplit('@')
        .next()
        .unwrap_or(url)
        .trim_start_matches("redis://")
}

/// The service's routes over `app`.
pub fn build_app(app: App) -> Router {
    // Whole pages through newcache's response cache (`X-Cache`, `Age`, ETag/304, one origin
    // call per expiry across processes); the other routes cache values, or nothing.
    // `/account/{id}` (`Cache-Control: private`) and `/welcome` (sets a cookie) go through the
    // same layer, which never stores them (`X-Cache: PASS`).
    let pages = Router::new()
        .route("/page/{id}", get(page_handler))
        .route("/account/{id}", get(account))
        .route("/welcome", get(welcome))
        .layer(app.inner.pages.clone());

    Router::new()
        .route("/report/{id}", get(report))
        .route("/users/{id}", get(user).put(update_user))
        .route("/stats", get(stats))
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(healthz))
        .route("/static", get(static_page))
        .route("/series", get(series))
        .merge(pages)
        .route_layer(middleware::from_fn_with_state(app.clone(), count_requests))
        .with_state(app)
}

/// Serves `app` on `listener` until `shutdown` resolves, sampling the per-second series
/// meanwhile; then waits for the requests in flight and the cache's background refreshes.
///
/// # Errors
/// An I/O error of the listener.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: App,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let port = listener.local_addr()?.port();
    app.inner.port.store(port, Ordering::Relaxed);
    let sampler = tokio::spawn(sample_every_second(app.clone()));
    let served = axum::serve(listener, build_app(app.clone()))
        .with_graceful_shutdown(shutdown)
        .await;
    sampler.abort();
    app.inner.cache.shutdown().await;
    app.inner.db.close().await;
    Ok(served?)
}

async fn sample_every_second(app: App) {
    let mut tick = tokio::time::interval(Recorder::INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        app.inner.series.sample(app.requests(), app.db_queries());
        // Summaries in the Prometheus text decay only when the handle is kept up.
        app.inner.prometheus.run_upkeep();
    }
}

async fn count_requests(State(app): State<App>, request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_default();
    let response = next.run(request).await;
    app.inner.requests.fetch_add(1, Ordering::Relaxed);
    metrics::counter!(
        "webapp_http_requests_total",
        "route" => route,
        "status" => response.status().as_u16().to_string()
    )
    .increment(1);
    response
}

/// A path id: a clear 400 for anything but an integer.
fn id_of(raw: &str) -> Result<i64, Error> {
    raw.parse()
        .map_err(|_| Error::BadRequest(format!("id {raw:?} is not an integer")))
}

#[derive(Deserialize)]
struct ReportQuery {
    cache: Option<String>,
}

async fn report(
    State(app): State<App>,
    Path(id): Path<String>,
    Query(query): Query<ReportQuery>,
) -> Result<Json<Report>, Error> {
    let id = id_of(&id)?;
    let cached = match query.cache.as_deref() {
        None | Some("on") => true,
        Some("off") => false,
        Some(other) => {
            return Err(Error::BadRequest(format!(
                "cache={other:?}: expected \"on\" or \"off\""
            )));
        }
    };
    let db = &app.inner.db;
    let report = if cached {
        app.inner
            .cache
            .get_or_set_with(&app.cache_key("report", id), app.inner.ttl, || {
                db.report(id)
            })
            .await?
    } else {
        db.report(id).await?
    };
    Ok(Json(report))
}

async fn user(State(app): State<App>, Path(id): Path<String>) -> Result<Json<User>, Error> {
    let id = id_of(&id)?;
    let db = &app.inner.db;
    let user = app
        .inner
        .cache
        .get_or_set_with(&app.cache_key("user", id), app.inner.ttl, || db.user(id))
        .await?;
    Ok(Json(user))
}

#[derive(Deserialize)]
struct UserUpdate {
    name: Option<String>,
    email: Option<String>,
}

async fn update_user(
    State(app): State<App>,
    Path(id): Path<String>,
    Json(update): Json<UserUpdate>,
) -> Result<Json<User>, Error> {
    let id = id_of(&id)?;
    if update.name.is_none() && update.email.is_none() {
        return Err(Error::BadRequest(
            "nothing to update: give \"name\" and/or \"email\"".into(),
        ));
    }
    if [&update.name, &update.email]
        .iter()
        .any(|f| f.as_deref().is_some_and(|s| s.trim().is_empty()))
    {
        return Err(Error::BadRequest(
            "\"name\" and \"email\" must not be empty".into(),
        ));
    }
    let user = app
        .inner
        .db
        .update_user(id, update.name.as_deref(), update.email.as_deref())
        .await?;
    // The row first, then the key: a reader between the two sees the old value at most until
    // the delete; `get_or_set_with` stores with cas, so a load that raced the update is not
    // stored over the delete. The page that shows the user goes too (the same holds for it).
    app.inner.cache.delete(&app.cache_key("user", id)).await?;
    app.inner.pages.invalidate(&format!("/page/{id}")).await?;
    Ok(Json(user))
}

async fn page_handler(State(app): State<App>, Path(id): Path<String>) -> Result<Response, Error> {
    let id = id_of(&id)?;
    let db = &app.inner.db;
    let user = db.user(id).await?;
    let orders = db.latest_orders(id, 10).await?;
    let html = page::render(&user, &orders);
    // A validator, so that a client (and the response cache) can answer `If-None-Match`.
    let etag = {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        html.hash(&mut h);
        format!("\"{:016x}\"", h.finish())
    };
    Ok(([(header::ETAG, etag)], Html(html)).into_response())
}

/// The user's own page: the same HTML, marked `private` (a shared cache must not store it).
async fn account(State(app): State<App>, Path(id): Path<String>) -> Result<Response, Error> {
    let mut page = page_handler(State(app), Path(id)).await?;
    page.headers_mut().insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("private, max-age=60"),
    );
    Ok(page)
}

/// A landing page that sets a cookie: a shared cache must not store it (nor hand the cookie to
/// anyone else).
async fn welcome() -> Response {
    (
        [(
            header::SET_COOKIE,
            "newcache_demo=welcomed; Path=/; HttpOnly",
        )],
        Html("<!doctype html><title>welcome</title><p>Welcome.</p>"),
    )
        .into_response()
}

async fn stats(State(app): State<App>) -> Json<serde_json::Value> {
    // `Stats` is `Serialize`: every counter by its field name. The cache's count the service's
    // own calls (reports, users); the response cache's pages are counted apart.
    Json(json!({
        "db_queries": app.db_queries(),
        "requests": app.requests(),
        "backend": app.inner.startup.backend,
        "ttl_secs": app.inner.ttl.as_secs(),
        "cache": app.inner.cache.stats(),
        "pages": app.inner.pages.stats(),
    }))
}

async fn metrics_text(State(app): State<App>) -> impl IntoResponse {
    // The service's own counters and newcache's (its `metrics` feature, `newcache_*`, labelled
    // `cache="webapp"`) through one recorder.
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        app.inner.prometheus.render(),
    )
}

async fn healthz(State(app): State<App>) -> Response {
    // Every server answers, or the error names those that did not.
    match app.inner.cache.ping().await.map_err(|e| e.to_string()) {
        Ok(()) => {
            Json(json!({ "status": "ok", "backend": app.inner.startup.backend })).into_response()
        }
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({
                "status": "unavailable",
                "backend": app.inner.startup.backend,
                "error": why,
            })),
        )
            .into_response(),
    }
}

/// A constant body: the ceiling the bench measures the cached routes against.
async fn static_page() -> &'static str {
    "newcache webapp\n"
}

async fn series(State(app): State<App>) -> Json<Series> {
    Json(Series {
        port: app.inner.port.load(Ordering::Relaxed),
        ttl_secs: app.inner.ttl.as_secs(),
        interval_ms: Recorder::INTERVAL.as_millis() as u64,
        samples: app.inner.series.samples(),
    })
}
