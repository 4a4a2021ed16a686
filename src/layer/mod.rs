//! The response cache (feature `tower`): [`ResponseCacheLayer`], a `tower::Layer` that caches
//! whole HTTP responses in an [`AsyncCache`], as a shared cache under the rules of RFC 9111,
//! with the crate's herd protection: one origin request per expiry of a hot URL, across
//! processes. Django's `cache_page` and cache middleware, done right.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::convert::Infallible;
//! use std::time::Duration;
//!
//! use bytes::Bytes;
//! use http::{Request, Response};
//! use http_body_util::{BodyExt, Full};
//! use newcache::layer::ResponseCacheLayer;
//! use tower::{Layer, ServiceExt};
//!
//! let cache = newcache::Cache::builder().in_memory().build_async()?;
//! // With axum: `Router::new().route(...).layer(ResponseCacheLayer::new(cache))`.
//! let layer = ResponseCacheLayer::builder(cache)
//!     .ttl(Duration::from_secs(30)) // when the response says no max-age
//!     .build()?;
//! let page = layer.layer(tower::service_fn(|_req: Request<()>| async {
//!     Ok::<_, Infallible>(Response::new(Full::new(Bytes::from("<h1>hello</h1>"))))
//! }));
//!
//! let first = page.clone().oneshot(Request::get("/hello?b=2&a=1").body(())?).await?;
//! assert_eq!(first.headers()["x-cache"], "MISS");
//! let again = page.oneshot(Request::get("/hello?a=1&b=2&utm_source=x").body(())?).await?;
//! assert_eq!(again.headers()["x-cache"], "HIT");
//! assert_eq!(again.into_body().collect().await?.to_bytes(), "<h1>hello</h1>");
//! # Ok(())
//! # }
//! ```
//!
//! # What is cached
//!
//! - **Requests**: `GET` is looked up and stored. `HEAD` is answered from the `GET` entry (no
//!   body) and otherwise passed to the origin. A request with `Authorization` is served only an
//!   entry whose response said `public` or `s-maxage`, and never fills one. A request with a
//!   `Cookie` follows the [`CookiePolicy`] (passed by default). `Cache-Control: no-store` on a
//!   request passes it, and so do `Range`, `If-Match`, `If-Range` and `If-Unmodified-Since`:
//!   the origin answers those (a `206` or a `412` is not the page), and they neither fill the
//!   cache nor mark it. The key is the host (see [`HostPolicy`]), the path and the query with
//!   its parameters sorted by name (the values of a repeated name keep their order) and the
//!   [ignored ones](ResponseCacheBuilder::ignore_params) (`utm_*`, `_`...) dropped, under a
//!   [namespace](ResponseCacheBuilder::namespace) (`page` by default). The host is the request
//!   URI's authority, else `Host`; a host with characters an authority cannot hold (`Host:
//!   a/b` would otherwise read as another URL's key), two `Host` headers, or an absolute-form
//!   URI whose authority is not its `Host` make the request `PASS`. Headers the origin reads
//!   and the key does not hold (`X-Forwarded-Host`...) must be set by a proxy in front, or named
//!   in the response's `Vary`.
//! - **Unsafe methods**: `POST`, `PUT`, `PATCH`, `DELETE` (any method but `GET`, `HEAD`,
//!   `OPTIONS`, `TRACE`) go to the origin; a `2xx` or `3xx` answer removes the stored page of
//!   their URL before it is returned (RFC 9111 §4.4), every variant with it (and, with
//!   [`CookiePolicy::Key`], the requester's own page of it). An application
//!   whose change shows under other URLs removes those pages with
//!   [`ResponseCacheLayer::invalidate`].
//!
//!   Work under way when the page is removed does not bring it back: a fill's result is
//!   stored with `cas` against its placeholder, a `no-cache` revalidation's with `cas` against
//!   the page it revalidated, a variant fill's at the page key with `cas` against the vary
//!   record it started from; and a `GET` sent after the removal returned does not join, in the
//!   same process, a fill that started before it (the removal takes the page key's call out
//!   of the in-process coalescer).
//! - **Responses**: the [statuses](ResponseCacheBuilder::statuses) configured (`200` by default),
//!   never one with `Set-Cookie`, `Cache-Control: private`, `no-store` or `no-cache`, or
//!   `Vary: *`. The freshness lifetime is `s-maxage`, else `max-age`, else `Expires` minus
//!   `Date` (an invalid or past `Expires`, such as `0`: already stale, not stored), else the
//!   layer's [ttl](ResponseCacheBuilder::ttl); the `Age` the response arrived with is taken off
//!   it (RFC 9111 §4.2.3; the origin's `Date` is not used to compute an age). A body is stored
//!   only when its length is known and at most
//!   [`max_body_size`](ResponseCacheBuilder::max_body_size); any other body streams to the
//!   client as it comes. Bodies are stored as raw bytes (copied into the item once, after the
//!   status and headers; no serializer walks them). Hop-by-hop headers (`Connection`, those it
//!   names, `Keep-Alive`, `Transfer-Encoding`, `Upgrade`...) are not stored.
//! - **`Vary`**: the page's key holds a *vary record* (the header names, and a generation drawn
//!   when the record is stored); each variant is stored under the page key, the generation and
//!   the request's values of those headers (their raw bytes). A page stored again with a new
//!   record, or removed, leaves the old variants unreachable. A revalidation stores its page as
//!   any fill does.
//! - **Conditional requests**: a request's `If-None-Match` (a `*`, or a list of entity tags,
//!   which may hold commas) that matches a `2xx` entry's `ETag` is answered `304 Not
//!   Modified` from the entry; a stored `404` is served as it is (RFC 9110 §13.2.1).
//!   `If-None-Match` and `If-Modified-Since` are not forwarded when the layer fetches a page to
//!   store (the origin would answer 304, which is not a page).
//!
//! # Headers set
//!
//! `X-Cache` says where a response came from: `HIT` (a fresh entry), `STALE` (an expired entry,
//! served while one other request refreshes it), `MISS` (this request fetched the page for the
//! cache), `PASS` (the origin's response, not stored: an uncacheable request or response, or a
//! URL under a hit-for-pass marker). Responses from an entry also get `Age` (seconds since the
//! origin made the response, its own `Age` included).
//!
//! # The herd
//!
//! Every fetch goes through [`AsyncCache::get_or_set_with`]'s protocol, so the guarantees are
//! that method's:
//!
//! - **A cold URL**: one request fetches it; the others (of every process sharing the cache)
//!   wait for that fetch, bounded by the cache's [`max_wait`](crate::CacheBuilder::max_wait),
//!   and are then served its page (`HIT`).
//! - **An expired URL**: one request refreshes it; every other request gets the stale page at
//!   once (`STALE`), for up to the cache's [`herd_timeout`](crate::CacheBuilder::herd_timeout)
//!   past its expiry (the "grace"). A page whose response said `must-revalidate`,
//!   `proxy-revalidate` or `s-maxage` (RFC 9111 §5.2.2.2, §5.2.2.8, §5.2.2.10) is stored with no
//!   grace: once expired it is never served, and requests wait for the one refresh as for a
//!   cold URL.
//! - **A failed fetch**: an origin error or a `5xx` (and, when a page is stored, any status the
//!   layer does not store) is given to the request that fetched, and stores nothing: a stale
//!   page stays, served to the others (nginx's `proxy_cache_use_stale error http_5xx`, Varnish's
//!   grace), and the next request tries again. Requests that waited for a failed fetch of a
//!   cold URL wait for the next one, so a failing origin gets at most one request per URL at a
//!   time; a request that has waited the cache's [`max_wait`](crate::CacheBuilder::max_wait)
//!   goes to the origin, uncached (`PASS`), as nginx's `proxy_cache_lock_timeout` does.
//! - **Hit-for-pass**: a response found unstorable (`private`, `Set-Cookie`, `no-store`, a
//!   stream or a body too large, or a status not stored where no page was: a `404`, a redirect)
//!   leaves a marker for [`hit_for_pass`](ResponseCacheBuilder::hit_for_pass) (5 s by default):
//!   requests for that URL go straight to the origin (`PASS`) instead of queueing behind one
//!   another's fetch. When it expires, one request checks again. A refresh or revalidation of a
//!   stored page that gets such a storable status but an uncacheable response (a `200`
//!   `private`) turns the URL to pass the same way: the origin said the page is no longer
//!   shared.
//! - **`Cache-Control: no-cache` (or `max-age=0`) on a request** revalidates, without a
//!   stampede: a page younger than [`revalidate_after`](ResponseCacheBuilder::revalidate_after)
//!   (1 s by default) is served as it is; an older one is fetched again by one request for all
//!   those that asked to revalidate that same stored page at once (they meet on a key derived
//!   from it, across processes), and the new page replaces it. A flood of reloads therefore
//!   costs at most one origin request per page per `revalidate_after`.
//!
//! The cache never fails a request the origin could serve. With its backend down, each request
//! fetches the page (requests of one process for one URL at once share a fetch) and nothing is
//! stored; a cache error such as a wait that ran out sends the request to the origin (`PASS`).
//! An origin error reaches the request that met it and leaves nothing stored; requests that
//! were waiting for that fetch wait for the next one (see a failed fetch, above).
//!
//! Keys: the page, variant and revalidation keys are long strings (a URL, header values) that
//! the cache's key function turns into memcached keys. The default function hashes them, so any
//! URL fits; a custom [`KeyFunction`](crate::KeyFunction) must accept them too (a key it
//! refuses makes the request `PASS`).
//!
//! # A CDN or a reverse proxy, or this layer?
//!
//! nginx (`proxy_cache_lock on` to send one request per missing page, `proxy_cache_use_stale
//! updating` with `proxy_cache_background_update` to serve the stale page while one request
//! refreshes it) and Varnish (request coalescing by default, *grace* for stale-while-refresh,
//! *hit-for-pass* objects for uncacheable URLs) do what this layer does, in front of the
//! application, with their own storage. Their herd protection is per proxy instance: two nginx
//! boxes each send their own request per expiry (`proxy_cache_lock` is local), while this
//! layer's lock is in memcached, shared by every process of the application. A CDN adds
//! geography (pages served near the client, the origin not reached at all) and absorbs traffic
//! the application's servers never see.
//!
//! Use a CDN or a proxy for public, static-ish pages at high volume, for the bandwidth and
//! offload, and when the cache rules are the same for every route. Use this layer when the
//! application already runs memcached and several processes, when the caching rules live with
//! the routes (a `Router::layer` per group of routes, its own ttl and namespace), when pages must
//! be invalidated from the application ([`ResponseCacheLayer::invalidate`]), or when there
//! is no proxy to configure. The two compose: a CDN in front, honouring the same
//! `Cache-Control`, and this layer behind it turn a CDN's per-edge misses into one origin
//! request.

mod access;
mod body;
mod config;
mod entry;
mod rules;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body::Body as HttpBody;
use tower::{Layer, Service};

use self::entry::{Body, Entry, Page, Recent};
use self::rules::{CacheControl, Uncacheable};
use crate::async_cache::AsyncCache;
use crate::async_cache::loader::{Refresh, inline};
use crate::cache::Herd;
use crate::error::{Error, ErrorKind, Result};
use crate::stats::{Counters, Stats};

pub use self::body::ResponseBody;
use self::config::Settings;
pub use self::config::{
    CookiePolicy, DEFAULT_HIT_FOR_PASS, DEFAULT_IGNORED_PARAMS, DEFAULT_MAX_BODY_SIZE,
    DEFAULT_PAGE_TTL, DEFAULT_REVALIDATE_AFTER, HostPolicy, ResponseCacheBuilder,
};

/// The header that says where a response came from: `HIT`, `STALE`, `MISS` or `PASS`.
pub const X_CACHE: HeaderName = HeaderName::from_static("x-cache");

/// A `tower::Layer` that caches whole responses in an [`AsyncCache`] (see the
/// [module docs](self)). Cheap to clone; every service it makes shares the cache.
///
/// ```
/// # fn main() -> Result<(), newcache::Error> {
/// let cache = newcache::Cache::builder().in_memory().build_async()?;
/// let layer = newcache::layer::ResponseCacheLayer::new(cache);
/// // axum: Router::new().route("/page/{id}", get(page)).layer(layer)
/// # let _ = layer;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct ResponseCacheLayer {
    common: Arc<Common>,
}

/// What every service of a layer, and every request through them, shares: one reference count
/// per request.
struct Common {
    cache: AsyncCache,
    settings: Settings,
    /// The cache's backend answers without waiting (the memory backend): a hit is answered
    /// in `call`.
    answers_at_once: bool,
}

impl fmt::Debug for ResponseCacheLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseCacheLayer")
            .field("settings", &self.common.settings)
            .finish_non_exhaustive()
    }
}

impl ResponseCacheLayer {
    /// A layer with the default settings (see [`ResponseCacheBuilder`]'s setters).
    pub fn new(cache: AsyncCache) -> ResponseCacheLayer {
        ResponseCacheBuilder::new(cache)
            .build()
            .expect("the default settings are valid")
    }

    pub(crate) fn from_parts(cache: AsyncCache, settings: Settings) -> ResponseCacheLayer {
        let config = &cache.cache.inner.config;
        let counters = Counters::labelled(&config.name, &config.servers, Some(&settings.namespace));
        // The layer's reads and fills are counted apart from the application's own calls.
        let cache = AsyncCache {
            cache: cache.cache.counting_in(Arc::new(counters)),
        };
        ResponseCacheLayer {
            common: Arc::new(Common {
                answers_at_once: cache.cache.answers_at_once(),
                cache,
                settings,
            }),
        }
    }

    /// What this layer (every service it made, and their clones) did with the cache so far,
    /// counted apart from the [`AsyncCache`]'s own [`stats`](AsyncCache::stats), which count
    /// the application's calls only. The fields read as for a cache, of pages:
    /// `hits` and `stale_served` are entries served (a page, and each vary record, variant or
    /// hit-for-pass marker read on the way), `misses` entries found missing,
    /// `loader_calls` origin calls made to fill the cache (a `MISS`, a refresh, a
    /// revalidation; not a `PASS`), `loader_errors` those that failed (an origin error, a
    /// `5xx`), `lease_waits` requests that joined another's fill (answered at once with the
    /// stale page it serves, or after its fill: `waited` counts only the latter), and the backend's
    /// errors those of the layer's own reads and writes. With the `metrics` feature the same
    /// counts go to the `newcache_*` metrics labelled `cache` (the cache's name) and `layer`
    /// (the [namespace](ResponseCacheBuilder::namespace)).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::convert::Infallible;
    ///
    /// use http::{Request, Response};
    /// use newcache::layer::ResponseCacheLayer;
    /// use tower::{Layer, ServiceExt};
    ///
    /// let cache = newcache::Cache::builder().in_memory().build_async()?;
    /// let pages = ResponseCacheLayer::new(cache.clone());
    /// let svc = pages.layer(tower::service_fn(|_req: Request<()>| async {
    ///     Ok::<_, Infallible>(Response::new(http_body_util::Full::new(bytes::Bytes::from("hi"))))
    /// }));
    /// svc.clone().oneshot(Request::get("/a").body(())?).await?; // MISS: one fill
    /// svc.oneshot(Request::get("/a").body(())?).await?; // HIT
    /// let s = pages.stats();
    /// assert_eq!((s.loader_calls, s.misses, s.hits), (1, 1, 1));
    /// assert_eq!(cache.stats().loader_calls, 0, "the application loaded nothing");
    /// # Ok(())
    /// # }
    /// ```
    pub fn stats(&self) -> Stats {
        // The layer's own counts only: the backend's (replays) are the cache's.
        self.common.cache.cache.stats.snapshot()
    }

    /// A builder, to change the defaults.
    pub fn builder(cache: AsyncCache) -> ResponseCacheBuilder {
        ResponseCacheBuilder::new(cache)
    }

    /// Removes the stored page of a URL, as a successful `POST`, `PUT`, `PATCH` or `DELETE`
    /// through the layer does for its own URL: for an application whose change shows on other
    /// pages (`PUT /users/7` changes `/page/7`). `true` if something was stored there (a page,
    /// a vary record, a hit-for-pass marker, or the placeholder of a fill under way), as
    /// [`AsyncCache::delete`] says. The next request fetches the page again. A
    /// fill already under way when this runs stores with `cas` against its claim, which the
    /// removal took away: its (older) page is not stored, as with `AsyncCache::delete` during a
    /// `get_or_set_with`; a `no-cache` revalidation under way writes only over the page it
    /// revalidated, and a variant fill only over the vary record it started from, with `cas`:
    /// neither stores either. A request that arrives after this returned does not join a fill
    /// from before it.
    ///
    /// `uri` is a path and query (`/page/7?lang=en`; the query is normalised as the layer's
    /// keys are), or an absolute URL (`http://localhost:3101/page/7`) whose authority is the
    /// host the page was served under (its `Host`, matched case-blind; the port is part of it).
    /// Pages are keyed per host under [`HostPolicy::Key`] (the default), and memcached cannot
    /// list keys, so a path alone cannot find every host's page: there it reaches the page
    /// of each host given to [`served_hosts`](ResponseCacheBuilder::served_hosts) (`true` if
    /// any was there), and without that list it is an error. Under [`HostPolicy::Ignore`] a
    /// path reaches the one page whatever the host. Every variant of a page that varies
    /// (`Vary`) is invalidated with it. Pages stored per cookie ([`CookiePolicy::Key`]) are
    /// not reached.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use newcache::layer::{HostPolicy, ResponseCacheLayer};
    ///
    /// let cache = newcache::Cache::builder().in_memory().build_async()?;
    /// let pages = ResponseCacheLayer::new(cache.clone()); // HostPolicy::Key
    /// assert!(pages.invalidate("/page/7").await.unwrap_err().is_invalid_key());
    /// assert!(!pages.invalidate("http://localhost:3101/page/7").await?); // nothing there
    ///
    /// let single_site = ResponseCacheLayer::builder(cache).hosts(HostPolicy::Ignore).build()?;
    /// assert!(!single_site.invalidate("/page/7").await?);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// An `InvalidKey` error ([`is_invalid_key`](Error::is_invalid_key)) for a `uri` that does
    /// not parse, has no path starting with `/`, or has a host the layer would refuse; and,
    /// under [`HostPolicy::Key`] with no [`served_hosts`](ResponseCacheBuilder::served_hosts),
    /// for a path without a host. The cache's error if a delete fails (with the default write
    /// policy; with several hosts, the first failure, after every delete was tried).
    pub async fn invalidate(&self, uri: &str) -> Result<bool> {
        let invalid = |why: &str| {
            Error::new(
                ErrorKind::InvalidKey,
                format!("cannot invalidate {uri:?}: {why}"),
            )
        };
        let uri: http::Uri = uri.parse().map_err(|_| invalid("not a URI"))?;
        if !uri.path().starts_with('/') {
            return Err(invalid("its path does not start with '/'"));
        }
        let s = &self.common.settings;
        let no_headers = HeaderMap::new();
        let hosts: Vec<Option<String>> = match s.hosts {
            HostPolicy::Ignore => vec![None],
            HostPolicy::Key if uri.authority().is_some() => {
                let host = rules::key_host(&uri, &no_headers).ok_or_else(|| invalid("its host"))?;
                vec![Some(host.into_owned())]
            }
            HostPolicy::Key if s.served_hosts.is_empty() => {
                return Err(invalid(
                    "pages are keyed per host (HostPolicy::Key), and a path names none: pass \
                     the absolute URL the page was served under (http://host:port/path, its \
                     Host), list the hosts with ResponseCacheBuilder::served_hosts, or build \
                     the layer with HostPolicy::Ignore",
                ));
            }
            // The listed hosts, and the pages of requests that sent no Host (HTTP/1.0, a
            // test's `oneshot`), stored under the empty host.
            HostPolicy::Key => s
                .served_hosts
                .iter()
                .cloned()
                .chain([String::new()])
                .map(Some)
                .collect(),
        };
        let cache = &self.common.cache;
        let (mut any, mut failed) = (false, None);
        for host in hosts {
            let key = rules::page_key(&s.namespace, host.as_deref(), &uri, &s.ignored_params);
            match cache.cache.invalidate_on(&cache.io(), &key).await {
                Ok(there) => any |= there,
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        failed.map_or(Ok(any), Err)
    }
}

impl<S> Layer<S> for ResponseCacheLayer {
    type Service = ResponseCache<S>;

    fn layer(&self, inner: S) -> ResponseCache<S> {
        ResponseCache {
            inner,
            common: self.common.clone(),
        }
    }
}

/// The service a [`ResponseCacheLayer`] wraps around an origin service. `Clone` when the origin
/// is.
///
/// Its readiness is the origin's (`poll_ready` polls the origin service), so the origin's
/// backpressure reaches the layers above, and a fill waits for nothing but the origin's answer
/// while other requests wait for it. A request answered from the cache lets go of the readied
/// service as one sent to the origin would: what its readiness reserved is given back. A
/// request waiting for another's fill (or, on memcached, for its read) holds its readiness
/// meanwhile: with a concurrency limit under the cache, each waiter holds a permit.
#[derive(Clone)]
pub struct ResponseCache<S> {
    inner: S,
    common: Arc<Common>,
}

impl<S> fmt::Debug for ResponseCache<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseCache")
            .field("settings", &self.common.settings)
            .finish_non_exhaustive()
    }
}

type Served<B, E> = Result<Response<ResponseBody<B>>, E>;

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for ResponseCache<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Send + 'static,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let (parts, body) = req.into_parts();
        let seen = Seen::of(&parts.headers);
        let ask = Ask {
            common: &self.common,
            parts: &parts,
            seen,
        };
        let plan = ask.plan();
        // On a backend that answers at once (the memory backend), a page that may be served as
        // stored is answered here, without a future to box. The origin service polled ready is
        // let go as if this request had used it (what its readiness reserved, a concurrency
        // permit say, is given back), and a clone waits for the next request.
        if let Plan::Load(page_key) = &plan {
            if self.common.answers_at_once {
                if let Some(resp) = ask.hit_now(page_key) {
                    let clone = self.inner.clone();
                    drop(std::mem::replace(&mut self.inner, clone));
                    return ResponseFuture::ready(Ok(resp));
                }
            }
        }
        // The service that was polled ready serves this request; a clone waits for the next.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let call = Call {
            common: self.common.clone(),
            parts,
            origin: Mutex::new(Some((inner, body))),
            seen,
            fetched: Mutex::new(None),
        };
        ResponseFuture::boxed(Box::pin(async move { call.run(plan).await }))
    }
}

/// The future of a [`ResponseCache`] service: a response made at once (a hit on a backend that
/// answers at once), or the request's work under way.
pub struct ResponseFuture<B: HttpBody, E> {
    state: FutureState<B, E>,
}

enum FutureState<B: HttpBody, E> {
    Ready(Option<Served<B, E>>),
    Boxed(Pin<Box<dyn Future<Output = Served<B, E>> + Send>>),
}

impl<B: HttpBody, E> ResponseFuture<B, E> {
    fn ready(served: Served<B, E>) -> Self {
        ResponseFuture {
            state: FutureState::Ready(Some(served)),
        }
    }

    fn boxed(f: Pin<Box<dyn Future<Output = Served<B, E>> + Send>>) -> Self {
        ResponseFuture {
            state: FutureState::Boxed(f),
        }
    }
}

// Nothing in it is pinned in place: the work under way is boxed, and a ready response is only
// moved out.
impl<B: HttpBody, E> Unpin for ResponseFuture<B, E> {}

impl<B: HttpBody, E> Future for ResponseFuture<B, E> {
    type Output = Served<B, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.get_mut().state {
            FutureState::Ready(served) => Poll::Ready(
                served
                    .take()
                    .expect("a ResponseFuture polled after it finished"),
            ),
            FutureState::Boxed(f) => f.as_mut().poll(cx),
        }
    }
}

impl<B: HttpBody, E> fmt::Debug for ResponseFuture<B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            FutureState::Ready(_) => "ready",
            FutureState::Boxed(_) => "under way",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish()
    }
}

/// Where a served response came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Hit,
    Stale,
    Miss,
    Pass,
}

impl Source {
    fn value(self) -> HeaderValue {
        HeaderValue::from_static(match self {
            Source::Hit => "HIT",
            Source::Stale => "STALE",
            Source::Miss => "MISS",
            Source::Pass => "PASS",
        })
    }
}

/// What this request's own origin call produced, beside what the loader returned to the cache.
enum Fetched<B: HttpBody, E> {
    /// A page it stored (or tried to).
    Page(Entry),
    /// A response it did not store, for this request only.
    Passed(Response<ResponseBody<B>>),
    /// The origin's error.
    Failed(E),
}

/// The origin failed (its error, or a response that is not a page, is in [`Call::fetched`]).
#[derive(Debug)]
struct OriginFailed;

impl fmt::Display for OriginFailed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the origin service failed")
    }
}

impl std::error::Error for OriginFailed {}

/// A page's vary record, as the keys of its variants need it: the header names and the
/// record's generation.
type Record<'a> = (&'a [HeaderName], u64);

/// What the layer decides from a request alone, before any cache read.
enum Plan {
    /// A method the cache does not store (an unsafe one invalidates).
    Other,
    /// Straight to the origin, uncached.
    Pass,
    /// Served from the cache if there, never filled (HEAD, `Authorization`).
    LookUp { page_key: String, authorized: bool },
    /// A GET: served from the cache, or filled.
    Load(String),
}

/// A request as the cache reads it, with its layer: what both the answer made at once (a hit
/// on a backend that answers at once, in `call`) and the request's future use.
struct Ask<'a> {
    common: &'a Common,
    parts: &'a http::request::Parts,
    seen: Seen,
}

/// Which of the request headers the cache reads are present: one pass over the request's
/// header names, instead of a lookup for each (most requests carry none of them).
#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    cookie: bool,
    authorization: bool,
    cache_control: bool,
    if_none_match: bool,
    /// One of [`CLIENT_CONDITIONS`].
    condition: bool,
}

impl Seen {
    fn of(headers: &HeaderMap) -> Seen {
        let mut seen = Seen::default();
        for name in headers.keys() {
            if name == header::COOKIE {
                seen.cookie = true;
            } else if name == header::AUTHORIZATION {
                seen.authorization = true;
            } else if name == header::CACHE_CONTROL {
                seen.cache_control = true;
            } else if name == header::IF_NONE_MATCH {
                seen.if_none_match = true;
            } else if CLIENT_CONDITIONS.contains(name) {
                seen.condition = true;
            }
        }
        seen
    }
}

impl Ask<'_> {
    fn plan(&self) -> Plan {
        let s = &self.common.settings;
        let headers = &self.parts.headers;
        let method = &self.parts.method;
        if method != Method::GET && method != Method::HEAD {
            return Plan::Other;
        }
        let seen = self.seen;
        if (seen.cache_control && CacheControl::parse(headers).no_store)
            || (s.cookies == CookiePolicy::Pass && seen.cookie)
            || seen.condition
        {
            return Plan::Pass;
        }
        let Some(page_key) = self.page_key() else {
            return Plan::Pass;
        };
        let authorized = seen.authorization;
        if method == Method::HEAD || authorized {
            return Plan::LookUp {
                page_key,
                authorized,
            };
        }
        Plan::Load(page_key)
    }

    /// The response to a GET whose page (or variant) may be served as stored, read through
    /// the cache's fast path on its sync backend: `None` for anything else (a miss, a page to
    /// refresh or revalidate, a pass marker), which the request's future then handles from the
    /// start. The read, the verdict and the counters are `get_or_set_with`'s own.
    fn hit_now<B: HttpBody>(&self, page_key: &str) -> Option<Response<ResponseBody<B>>> {
        let cache = &self.common.cache.cache;
        // What was read is counted only if it is served: otherwise the request's future reads
        // it again, and counts it then.
        let mut read = [None, None];
        let (Recent(mut entry), served, mut now) = cache.served_now::<Recent>(page_key)?;
        read[0] = Some(served);
        if let Body::Vary { names, generation } = &entry.body {
            let key = rules::variant_key(page_key, *generation, names, &self.parts.headers);
            let (Recent(variant), served, at) = cache.served_now::<Recent>(&key)?;
            read[1] = Some(served);
            (entry, now) = (variant, at);
        }
        if !matches!(entry.body, Body::Page(_)) {
            return None;
        }
        if self.wants_revalidation(&entry, now) {
            return None;
        }
        for served in read.into_iter().flatten() {
            cache.count_served_now(served);
        }
        Some(self.serve_entry(entry, now))
    }

    /// Whether the request asks to revalidate `entry` (`no-cache`, `max-age=0`) and it is old
    /// enough for that to be heeded.
    fn wants_revalidation(&self, entry: &Entry, now: u64) -> bool {
        let age = Duration::from_millis(now.saturating_sub(entry.stored_ms));
        self.seen.cache_control
            && CacheControl::parse(&self.parts.headers).wants_revalidation()
            && age >= self.common.settings.revalidate_after
    }

    /// The key of this request's page (`None`: a request the cache passes: a host it refuses,
    /// or a target that is not a path). With [`CookiePolicy::Key`] and a cookie, the cookie's
    /// own page.
    fn page_key(&self) -> Option<String> {
        let key = self.url_key()?;
        if self.seen.cookie && self.common.settings.cookies == CookiePolicy::Key {
            return Some(rules::variant_key(
                &key,
                0,
                &[header::COOKIE],
                &self.parts.headers,
            ));
        }
        Some(key)
    }

    /// The key of the page of this request's URL, whatever its cookies.
    fn url_key(&self) -> Option<String> {
        let s = &self.common.settings;
        if !self.parts.uri.path().starts_with('/') {
            return None;
        }
        let host = match s.hosts {
            HostPolicy::Key => Some(rules::key_host(&self.parts.uri, &self.parts.headers)?),
            HostPolicy::Ignore => None,
        };
        Some(rules::page_key(
            &s.namespace,
            host.as_deref(),
            &self.parts.uri,
            &s.ignored_params,
        ))
    }

    fn serve_entry<B: HttpBody>(&self, entry: Entry, now: u64) -> Response<ResponseBody<B>> {
        let source = if entry.is_stale(now) {
            Source::Stale
        } else {
            Source::Hit
        };
        self.serve(entry, source, now)
    }

    /// A response made from a stored page: its status, headers and body (none for HEAD, and
    /// none with a 304 for a matching `If-None-Match` when the page is a 2xx: RFC 9110
    /// §13.2.1), with `Age` and `X-Cache`.
    fn serve<B: HttpBody>(
        &self,
        entry: Entry,
        source: Source,
        now: u64,
    ) -> Response<ResponseBody<B>> {
        let age = entry.age_secs(now);
        let Body::Page(page) = entry.body else {
            unreachable!("only pages are served from the cache")
        };
        let not_modified = page.status.is_success()
            && page.headers.get(header::ETAG).is_some_and(|etag| {
                self.seen.if_none_match && rules::none_match(&self.parts.headers, etag.as_bytes())
            });
        let mut resp = if not_modified {
            let mut r = Response::new(ResponseBody::empty());
            *r.status_mut() = StatusCode::NOT_MODIFIED;
            // What RFC 9110 §15.4.5 asks a 304 to carry, when the 200 would have.
            for name in [
                header::CACHE_CONTROL,
                header::CONTENT_LOCATION,
                header::DATE,
                header::ETAG,
                header::EXPIRES,
                header::VARY,
            ] {
                for v in page.headers.get_all(&name) {
                    r.headers_mut().append(name.clone(), v.clone());
                }
            }
            r
        } else {
            let body = if self.parts.method == Method::HEAD {
                ResponseBody::empty()
            } else {
                ResponseBody::full(page.body)
            };
            let mut r = Response::new(body);
            *r.status_mut() = page.status;
            *r.headers_mut() = page.headers;
            r
        };
        resp.headers_mut().insert(header::AGE, age_value(age));
        resp.headers_mut().insert(X_CACHE, source.value());
        resp
    }
}

/// Which key a fetch fills.
#[derive(Clone, Copy)]
enum Fill<'a> {
    /// The page key: a page, or (the response varies) a vary record, its variant stored beside.
    Page(&'a str),
    /// A variant key of a page whose vary record is `record`.
    Variant {
        page_key: &'a str,
        record: Record<'a>,
    },
    /// A revalidation of the page under `page_key` (`record`: of its variant under that
    /// record): the new page is stored where a normal fill would put it, over the page it
    /// revalidated only (`cas`); the key being loaded gets a marker that the revalidation
    /// happened.
    Revalidate {
        page_key: &'a str,
        record: Option<Record<'a>>,
        /// When the page being revalidated was stored: the revalidation writes only over it
        /// (with `cas`), never over a key invalidated, or refilled, meanwhile.
        stored_ms: u64,
    },
}

impl Fill<'_> {
    /// The key of the page this fetch replaces, or fills.
    fn target(&self, headers: &HeaderMap) -> String {
        match *self {
            Fill::Page(page_key)
            | Fill::Revalidate {
                page_key,
                record: None,
                ..
            } => page_key.to_string(),
            Fill::Variant {
                page_key,
                record: (names, generation),
            }
            | Fill::Revalidate {
                page_key,
                record: Some((names, generation)),
                ..
            } => rules::variant_key(page_key, generation, names, headers),
        }
    }
}

/// The `Age` header for `secs`. The values of the first ten minutes are made once and shared
/// (`HeaderValue::from(u64)` allocates, and every hit sends one).
fn age_value(secs: u64) -> HeaderValue {
    static COMMON: std::sync::LazyLock<Vec<HeaderValue>> = std::sync::LazyLock::new(|| {
        (0..600u64)
            // Leaked once: 600 short strings that live as long as the program, so that a
            // clone is a copy of a pointer (no reference count shared by every hit).
            .map(|n| HeaderValue::from_static(String::leak(n.to_string())))
            .collect()
    });
    match COMMON.get(secs as usize) {
        Some(v) => v.clone(),
        None => HeaderValue::from(secs),
    }
}

/// Request headers that make the origin's answer depend on the client's own copy (a part of
/// the page, a precondition): such requests are passed to the origin, uncached, and never fill
/// the cache (a `206` or `412` is not the page). `If-None-Match` and `If-Modified-Since` are
/// answered by the cache, and removed from a fill.
static CLIENT_CONDITIONS: [HeaderName; 4] = [
    header::RANGE,
    header::IF_MATCH,
    header::IF_RANGE,
    header::IF_UNMODIFIED_SINCE,
];

/// One request through the layer. The origin service and the request sit in `origin` until the
/// one origin call this request may make takes them.
struct Call<S, ReqBody, ResBody: HttpBody, E> {
    common: Arc<Common>,
    /// The request's method, URI and headers (read in place: a hit copies none of them).
    parts: http::request::Parts,
    seen: Seen,
    /// The inner service and the request's body, for this request's one origin call.
    origin: Mutex<Option<(S, ReqBody)>>,
    fetched: Mutex<Option<Fetched<ResBody, E>>>,
}

impl<S, ReqBody, ResBody> Call<S, ReqBody, ResBody, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Send + 'static,
{
    fn ask(&self) -> Ask<'_> {
        Ask {
            common: &self.common,
            parts: &self.parts,
            seen: self.seen,
        }
    }

    async fn run(&self, plan: Plan) -> Served<ResBody, S::Error> {
        let page_key = match plan {
            Plan::Other => return Box::pin(self.other_method()).await,
            Plan::Pass => return self.origin(Some(Source::Pass)).await,
            Plan::LookUp {
                page_key,
                authorized,
            } => return Box::pin(self.look_up(&page_key, authorized)).await,
            Plan::Load(page_key) => page_key,
        };
        // Awaited apart from the match, whose scrutinee's temporaries would live through every
        // arm: the page's load and a variant's then share one place in the future.
        let loaded = self.load(&page_key, Fill::Page(&page_key)).await;
        let entry = match loaded {
            Ok(entry) => entry,
            Err(served) => return served,
        };
        let vary;
        let (record, page) = match entry.body {
            Body::Page(_) => (None, entry),
            Body::Pass => return self.origin(Some(Source::Pass)).await,
            Body::Vary { names, generation } => {
                vary = names;
                let record = (vary.as_slice(), generation);
                let key = rules::variant_key(&page_key, generation, &vary, &self.parts.headers);
                let fill = Fill::Variant {
                    page_key: &page_key,
                    record,
                };
                let loaded = self.load(&key, fill).await;
                match loaded {
                    Ok(
                        e @ Entry {
                            body: Body::Page(_),
                            ..
                        },
                    ) => (Some(record), e),
                    Ok(_) => return self.origin(Some(Source::Pass)).await,
                    Err(served) => return served,
                }
            }
        };
        self.serve_or_revalidate(&page_key, record, page).await
    }

    /// A method the cache does not store. An unsafe one (not GET, HEAD, OPTIONS or TRACE)
    /// answered with a non-error status invalidates the stored page of its URL (RFC 9111 §4.4),
    /// and this cookie's own page under [`CookiePolicy::Key`], before the answer is returned.
    async fn other_method(&self) -> Served<ResBody, S::Error> {
        let safe = matches!(self.parts.method, Method::OPTIONS | Method::TRACE);
        let resp = self.origin(None).await?;
        let status = resp.status();
        if !safe && (status.is_success() || status.is_redirection()) {
            let mut keys: Vec<String> = self.ask().url_key().into_iter().collect();
            if let Some(own) = self.ask().page_key().filter(|k| !keys.contains(k)) {
                keys.push(own);
            }
            for key in keys {
                // A failure is counted in the cache's stats: the change was made, and the
                // client gets its answer.
                let _ = self
                    .common
                    .cache
                    .cache
                    .invalidate_on(&self.common.cache.io(), &key)
                    .await;
            }
        }
        Ok(resp)
    }

    /// `get_or_set_with` on `key`: `Ok` with the entry another request stored (or this one's
    /// marker), or `Err` with this request's answer when it fetched from the origin itself or
    /// the cache failed. When the fetch this request waited for failed, it waits for the next
    /// one (one origin request at a time, or it fetches itself), until the cache's `max_wait`
    /// since it began; then it goes to the origin uncached.
    async fn load(&self, key: &str, fill: Fill<'_>) -> Result<Entry, Served<ResBody, S::Error>> {
        let deadline = Instant::now() + self.common.cache.cache.inner.config.max_wait;
        loop {
            let loaded = self
                .common
                .cache
                .cache
                .coalesced_until(
                    &self.common.cache.io(),
                    key,
                    self.common.settings.ttl.into(),
                    inline(|refresh| self.fetch(fill, refresh)),
                    deadline,
                )
                .await;
            if let Some(fetched) = self.fetched.lock().expect("not poisoned").take() {
                return Err(match fetched {
                    Fetched::Page(entry) => {
                        let now = self.common.cache.cache.now_ms();
                        Ok(self.ask().serve(entry, Source::Miss, now))
                    }
                    Fetched::Passed(mut resp) => {
                        resp.headers_mut().insert(X_CACHE, Source::Pass.value());
                        Ok(resp)
                    }
                    Fetched::Failed(e) => Err(e),
                });
            }
            match loaded {
                Ok(entry) => return Ok(entry),
                // Another request's fetch failed: queue for the next one, not the origin.
                Err(e) if e.is_loader() && Instant::now() < deadline => continue,
                // The cache failed, or the wait ran out: the origin, uncached.
                Err(_) => return Err(self.origin(Some(Source::Pass)).await),
            }
        }
    }

    /// Serves a page from the cache, or revalidates it first if the request asked to and it
    /// is old enough. `record`: the vary record the page is a variant of.
    async fn serve_or_revalidate(
        &self,
        page_key: &str,
        record: Option<Record<'_>>,
        entry: Entry,
    ) -> Served<ResBody, S::Error> {
        let now = self.common.cache.cache.now_ms();
        if !self.ask().wants_revalidation(&entry, now) {
            return Ok(self.ask().serve_entry(entry, now));
        }
        let fill = Fill::Revalidate {
            page_key,
            record,
            stored_ms: entry.stored_ms,
        };
        let key = fill.target(&self.parts.headers);
        // Everyone who asks to revalidate this stored page meets on one key, across processes.
        let revalidation = format!("{key}\nrevalidate:{}", entry.stored_ms);
        if let Err(served) = Box::pin(self.load(&revalidation, fill)).await {
            return served;
        }
        // Another request revalidated: serve what it stored (the page may now vary).
        Box::pin(self.look_up(page_key, false)).await
    }

    /// A request that may be served from the cache but never fills it (HEAD, Authorization).
    async fn look_up(&self, page_key: &str, authorized: bool) -> Served<ResBody, S::Error> {
        let peeked = self.peek(page_key).await;
        match peeked {
            Some(Entry {
                body: Body::Vary { names, generation },
                ..
            }) => {
                let key = rules::variant_key(page_key, generation, &names, &self.parts.headers);
                let peeked = self.peek(&key).await;
                self.serve_peeked(peeked, authorized).await
            }
            _ => self.serve_peeked(peeked, authorized).await,
        }
    }

    async fn peek(&self, key: &str) -> Option<Entry> {
        let io = self.common.cache.io();
        self.common
            .cache
            .cache
            .peek_on::<Entry, _>(&io, key)
            .await
            .ok()?
    }

    async fn serve_peeked(
        &self,
        peeked: Option<Entry>,
        authorized: bool,
    ) -> Served<ResBody, S::Error> {
        match peeked {
            Some(
                e @ Entry {
                    body: Body::Page(Page { shared, .. }),
                    ..
                },
            ) if shared || !authorized => {
                let now = self.common.cache.cache.now_ms();
                Ok(self.ask().serve_entry(e, now))
            }
            _ => self.origin(Some(Source::Pass)).await,
        }
    }

    /// The origin, uncached: this request's one origin call. `source`: the `X-Cache` to set
    /// (none for methods the cache does not handle).
    ///
    /// Boxed: every path that passes a request to the origin shares it, and a hit's future stays
    /// small (the one `call` boxes per request).
    fn origin(
        &self,
        source: Option<Source>,
    ) -> Pin<Box<impl Future<Output = Served<ResBody, S::Error>> + Send + '_>> {
        Box::pin(self.origin_call(source))
    }

    async fn origin_call(&self, source: Option<Source>) -> Served<ResBody, S::Error> {
        let Some((mut inner, body)) = self.origin.lock().expect("not poisoned").take() else {
            unreachable!("a request makes one origin call: a fetch returns its own answer")
        };
        let req = Request::from_parts(self.parts.clone(), body);
        let mut resp = inner.call(req).await?.map(ResponseBody::inner);
        if let Some(source) = source {
            resp.headers_mut().insert(X_CACHE, source.value());
        }
        Ok(resp)
    }

    /// The loader: fetches the page from the origin, for the cache. What this request gets is
    /// left in `fetched`; what the cache stores is returned. `refresh`: whether others are
    /// being served the stale entry this fetch replaces.
    ///
    /// An origin error, a `5xx`, and (when the fetch replaces a page) any status the layer does
    /// not store are a failed load: nothing is stored, the claim is released, a stale page
    /// stays and is served to the others, and requests waiting for this fetch wait for the
    /// next one. Another unstorable response (`private`, `Set-Cookie`, a stream, a `404` where
    /// there was no page) leaves a hit-for-pass marker.
    async fn fetch(&self, fill: Fill<'_>, refresh: Refresh) -> Result<Entry, OriginFailed> {
        let Some((mut inner, body)) = self.origin.lock().expect("not poisoned").take() else {
            return Err(OriginFailed);
        };
        let mut req = Request::from_parts(self.parts.clone(), body);
        // The cache answers conditional requests itself: the origin must send the whole page.
        for name in CLIENT_CONDITIONS
            .iter()
            .chain([&header::IF_NONE_MATCH, &header::IF_MODIFIED_SINCE])
        {
            req.headers_mut().remove(name);
        }
        let set = |f: Fetched<ResBody, S::Error>| {
            *self.fetched.lock().expect("not poisoned") = Some(f);
        };
        let resp = match inner.call(req).await {
            Ok(resp) => resp,
            Err(e) => {
                set(Fetched::Failed(e));
                return Err(OriginFailed);
            }
        };
        let s = &self.common.settings;
        let now = self.common.cache.cache.now_ms();
        let pass = Entry {
            stored_ms: now,
            fresh: s.hit_for_pass,
            body: Body::Pass,
        };
        let (parts, body) = resp.into_parts();
        let storable =
            rules::storable(parts.status, &parts.headers, &s.statuses, s.ttl, now / 1000);
        if storable == Err(Uncacheable::Status)
            && (parts.status.is_server_error() || self.replaces_page(fill, refresh).await)
        {
            set(Fetched::Passed(Response::from_parts(
                parts,
                ResponseBody::inner(body),
            )));
            return Err(OriginFailed);
        }
        let fits = body
            .size_hint()
            .exact()
            .is_some_and(|n| n <= s.max_body_size as u64);
        let storable = match storable {
            Ok(storable) if fits => storable,
            _ => {
                set(Fetched::Passed(Response::from_parts(
                    parts,
                    ResponseBody::inner(body),
                )));
                return Ok(self.leave(fill, pass).await);
            }
        };
        let body = match collect(body, s.max_body_size).await {
            Ok(bytes) => bytes,
            Err(replay) => {
                set(Fetched::Passed(Response::from_parts(parts, replay)));
                return Ok(self.leave(fill, pass).await);
            }
        };
        let origin_age = u32::try_from(rules::age(&parts.headers)).unwrap_or(u32::MAX);
        let mut headers = parts.headers;
        strip_hop_by_hop(&mut headers);
        for name in [&header::AGE, &X_CACHE] {
            headers.remove(name);
        }
        // The body is whole now: its length is known, and a HEAD answered from the page must
        // say it (the server would otherwise take the empty body's).
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
        let page = Entry {
            stored_ms: now,
            fresh: storable.ttl,
            body: Body::Page(Page {
                status: parts.status,
                headers,
                body,
                shared: storable.shared,
                no_stale: storable.no_stale,
                origin_age,
            }),
        };
        set(Fetched::Page(page.clone()));
        Ok(self.place(fill, page, storable.vary).await)
    }

    /// Whether a fetch replaces a stored page (a revalidation, or the refresh of a stale entry
    /// that is a page or a vary record, not a hit-for-pass marker).
    async fn replaces_page(&self, fill: Fill<'_>, refresh: Refresh) -> bool {
        match fill {
            Fill::Revalidate { .. } => true,
            _ if refresh == Refresh::Missing => false,
            // The entry is claimed by this fetch, and a peek never claims.
            _ => self
                .peek(&fill.target(&self.parts.headers))
                .await
                .is_some_and(|e| !matches!(e.body, Body::Pass)),
        }
    }

    /// Puts a fetched page where its `Vary` says, as every fill does: under the page key
    /// (no `Vary`), or under a variant key of a vary record at the page key. Returns what the
    /// key being loaded gets (a page, a record, a revalidation marker, or nothing).
    async fn place(&self, fill: Fill<'_>, page: Entry, vary: Vec<HeaderName>) -> Entry {
        let now = page.stored_ms;
        let nothing = Entry {
            stored_ms: now,
            fresh: Duration::ZERO,
            body: Body::Pass,
        };
        let (page_key, held) = match fill {
            Fill::Page(page_key) => (page_key, None),
            Fill::Variant { page_key, record } => (page_key, Some(record)),
            Fill::Revalidate {
                page_key, record, ..
            } => (page_key, record),
        };
        let revalidation = matches!(fill, Fill::Revalidate { .. });
        // The page varies as the record says: it is that record's variant.
        if let Some((names, generation)) = held.filter(|(names, _)| *names == vary.as_slice()) {
            if !revalidation {
                return page;
            }
            let key = rules::variant_key(page_key, generation, names, &self.parts.headers);
            self.store_revalidated(fill, &key, &page).await;
            return self.revalidated(now);
        }
        if vary.is_empty() {
            // A plain page, under the page key (over a record, if the page stopped varying).
            return match fill {
                Fill::Page(_) => page,
                Fill::Variant { .. } => {
                    self.store_revalidated(fill, page_key, &page).await;
                    nothing
                }
                Fill::Revalidate { .. } => {
                    self.store_revalidated(fill, page_key, &page).await;
                    self.revalidated(now)
                }
            };
        }
        // A new vary record (a new generation: no variant of an older record is reached again),
        // the page stored as its variant.
        let generation = self.common.cache.cache.token().max(1);
        let key = rules::variant_key(page_key, generation, &vary, &self.parts.headers);
        self.store(&key, &page).await;
        let record = Entry {
            stored_ms: now,
            fresh: page.fresh,
            body: Body::Vary {
                names: vary,
                generation,
            },
        };
        match fill {
            Fill::Page(_) => record,
            Fill::Variant { .. } => {
                self.store_revalidated(fill, page_key, &record).await;
                nothing
            }
            Fill::Revalidate { .. } => {
                self.store_revalidated(fill, page_key, &record).await;
                self.revalidated(now)
            }
        }
    }

    /// What the loader returns for a response it did not store: a hit-for-pass marker (for a
    /// revalidation, the marker goes to the page's key: the URL, or that variant, turns to
    /// pass).
    async fn leave(&self, fill: Fill<'_>, pass: Entry) -> Entry {
        match fill {
            Fill::Revalidate { .. } => {
                let target = fill.target(&self.parts.headers);
                self.store_revalidated(fill, &target, &pass).await;
                self.revalidated(pass.stored_ms)
            }
            _ => pass,
        }
    }

    /// The marker a revalidation leaves on its own key: "done, read the page again".
    fn revalidated(&self, now: u64) -> Entry {
        Entry {
            stored_ms: now,
            fresh: self
                .common
                .settings
                .revalidate_after
                .max(Duration::from_secs(1)),
            body: Body::Pass,
        }
    }

    /// Stores an entry with `set` (a variant, a vary record, a revalidated page). A failure
    /// costs a later request a fetch, nothing else: it is counted in the cache's stats, not
    /// returned.
    /// A revalidation's write: only over what the revalidation started from (the page, or
    /// the vary record, stored when the revalidated page was), with `cas`. A key invalidated
    /// (an unsafe method, `invalidate`) or refilled while the origin answered keeps what it
    /// has now: the revalidation's answer, read before that, is not stored.
    ///
    /// A variant fill that writes at the page key (the page stopped varying, or varies on
    /// other headers now) likewise writes only over the vary record it started from.
    async fn store_revalidated(&self, fill: Fill<'_>, key: &str, entry: &Entry) {
        let still = |current: &Entry| match fill {
            // Over the vary record (the page key, when the revalidated page was a variant):
            // the record it was a variant of; over the page itself: that page.
            Fill::Revalidate {
                page_key,
                record: Some((_, generation)),
                ..
            } if key == page_key => {
                matches!(current.body, Body::Vary { generation: g, .. } if g == generation)
            }
            Fill::Revalidate { stored_ms, .. } => current.stored_ms == stored_ms,
            Fill::Variant {
                record: (_, generation),
                ..
            } => matches!(current.body, Body::Vary { generation: g, .. } if g == generation),
            Fill::Page(_) => true,
        };
        if let Fill::Page(_) = fill {
            return self.store(key, entry).await;
        }
        let io = self.common.cache.io();
        let _ = self
            .common
            .cache
            .cache
            .replace_on(&io, key, entry, entry.fresh.into(), Herd::Protected, still)
            .await;
    }

    async fn store(&self, key: &str, entry: &Entry) {
        let io = self.common.cache.io();
        let _ = self
            .common
            .cache
            .cache
            .set_on(&io, key, entry, entry.fresh.into(), Herd::Protected)
            .await;
    }
}

/// Connection-level headers (RFC 9110 §7.6.1), never stored: the fixed ones, and those the
/// `Connection` header names.
static HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for name in HOP_BY_HOP.iter().chain(&named) {
        headers.remove(name);
    }
}

/// Reads a whole body of at most `limit` bytes. A body that turns out longer, has trailers or
/// fails is given back whole as a replay (what was read, then the rest), so nothing is lost.
async fn collect<B>(body: B, limit: usize) -> Result<Bytes, ResponseBody<B>>
where
    B: HttpBody<Data = Bytes>,
{
    let mut body = Box::pin(body);
    let mut frames = Vec::new();
    let mut len = 0usize;
    loop {
        let frame = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await;
        match frame {
            None => break,
            Some(Ok(frame)) => {
                let is_data = frame.is_data();
                if let Some(data) = frame.data_ref() {
                    len += data.remaining();
                }
                frames.push(frame);
                if !is_data || len > limit {
                    return Err(ResponseBody::replay(frames, None, Some(body)));
                }
            }
            Some(Err(e)) => return Err(ResponseBody::replay(frames, Some(e), None)),
        }
    }
    let mut out = BytesMut::with_capacity(len);
    for frame in frames {
        if let Ok(data) = frame.into_data() {
            out.extend_from_slice(&data);
        }
    }
    Ok(out.freeze())
}

#[cfg(test)]
mod tests {
    //! The loader extensions the layer relies on, on the memory backend with a mock clock.

    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::testing::MockClock;

    fn page(stored_ms: u64, fresh: Duration) -> Entry {
        Entry {
            stored_ms,
            fresh,
            body: Body::Page(Page {
                status: StatusCode::OK,
                headers: HeaderMap::new(),
                body: Bytes::from_static(b"body"),
                shared: false,
                no_stale: false,
                origin_age: 0,
            }),
        }
    }

    async fn load(cache: &AsyncCache, loads: &AtomicUsize, fresh: Duration) -> Entry {
        let now = cache.cache.now_ms();
        cache
            .cache
            .coalesced(
                &cache.io(),
                "k",
                Duration::from_secs(3600).into(),
                crate::async_cache::loader::inline(|_| async {
                    loads.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, OriginFailed>(page(now, fresh))
                }),
            )
            .await
            .unwrap()
    }

    /// An origin that counts its clones and its calls.
    #[derive(Clone)]
    struct Counted {
        clones: Arc<AtomicUsize>,
        calls: Arc<AtomicUsize>,
    }

    impl Counted {
        fn new() -> (Counted, Arc<AtomicUsize>, Arc<AtomicUsize>) {
            let (clones, calls) = (Arc::default(), Arc::default());
            let origin = Counted {
                clones: Arc::clone(&clones),
                calls: Arc::clone(&calls),
            };
            (origin, clones, calls)
        }
    }

    struct CountedClone(Counted);

    impl Clone for CountedClone {
        fn clone(&self) -> Self {
            self.0.clones.fetch_add(1, Ordering::SeqCst);
            CountedClone(self.0.clone())
        }
    }

    impl Service<Request<()>> for CountedClone {
        type Response = Response<http_body_util::Full<Bytes>>;
        type Error = std::convert::Infallible;
        type Future = std::future::Ready<std::result::Result<Self::Response, Self::Error>>;
        fn poll_ready(
            &mut self,
            _: &mut Context<'_>,
        ) -> Poll<std::result::Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }
        fn call(&mut self, _: Request<()>) -> Self::Future {
            self.0.calls.fetch_add(1, Ordering::SeqCst);
            std::future::ready(Ok(Response::new(http_body_util::Full::new(
                Bytes::from_static(b"page"),
            ))))
        }
    }

    #[tokio::test]
    async fn a_hit_on_the_memory_backend_is_answered_in_call_without_the_origin() {
        use tower::ServiceExt;
        let cache = crate::Cache::builder().in_memory().build_async().unwrap();
        let (origin, clones, calls) = Counted::new();
        let mut svc = ResponseCacheLayer::new(cache).layer(CountedClone(origin));
        let get = || Request::get("/p").body(()).unwrap();
        let first = svc.ready().await.unwrap().call(get()).await.unwrap();
        assert_eq!(first.headers()[X_CACHE], "MISS");
        let (clones_before, calls_before) =
            (clones.load(Ordering::SeqCst), calls.load(Ordering::SeqCst));
        for _ in 0..10 {
            let fut = svc.ready().await.unwrap().call(get());
            assert!(
                matches!(fut.state, FutureState::Ready(_)),
                "a hit is made in call"
            );
            let resp = fut.await.unwrap();
            assert_eq!(resp.headers()[X_CACHE], "HIT");
            let body = http_body_util::BodyExt::collect(resp.into_body())
                .await
                .ok()
                .unwrap();
            assert_eq!(body.to_bytes(), "page");
        }
        assert_eq!(
            clones.load(Ordering::SeqCst),
            clones_before + 10,
            "one clone per hit: the readied origin is let go, a clone waits for the next request"
        );
        assert_eq!(calls.load(Ordering::SeqCst), calls_before, "no origin call");
    }

    #[tokio::test]
    async fn a_value_chooses_its_lifetime_and_peeking_never_claims() {
        let clock = MockClock::new();
        let cache = crate::Cache::builder()
            .in_memory()
            .clock(clock.clone())
            .build_async()
            .unwrap();
        let loads = AtomicUsize::new(0);
        let first = load(&cache, &loads, Duration::from_secs(5)).await;
        assert_eq!(load(&cache, &loads, Duration::from_secs(5)).await, first);
        assert_eq!(loads.load(Ordering::SeqCst), 1);
        // Fresh for the 5 s it asked for, not the caller's hour.
        clock.advance(Duration::from_secs(6));
        let io = cache.io();
        let peeked: Option<Entry> = cache.cache.peek_on(&io, "k").await.unwrap();
        assert_eq!(peeked, Some(first.clone()), "a stale entry is still served");
        // The peek claimed nothing: the next loader call refreshes at once.
        let second = load(&cache, &loads, Duration::from_secs(5)).await;
        assert_eq!(loads.load(Ordering::SeqCst), 2);
        assert_ne!(second.stored_ms, first.stored_ms);
        // A zero lifetime stores nothing.
        clock.advance(Duration::from_secs(6));
        load(&cache, &loads, Duration::ZERO).await;
        assert_eq!(loads.load(Ordering::SeqCst), 3);
        clock.advance(Duration::from_secs(120));
        load(&cache, &loads, Duration::ZERO).await;
        assert_eq!(loads.load(Ordering::SeqCst), 4);
    }

    /// A body of the given frames that claims an exact length (which may be a lie).
    struct Frames(std::collections::VecDeque<http_body::Frame<Bytes>>, u64);

    impl HttpBody for Frames {
        type Data = Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
            Poll::Ready(self.0.pop_front().map(Ok))
        }
        fn size_hint(&self) -> http_body::SizeHint {
            http_body::SizeHint::with_exact(self.1)
        }
    }

    async fn read_all<B: HttpBody<Data = Bytes>>(body: B) -> (Vec<u8>, Option<HeaderMap>)
    where
        B::Error: fmt::Debug,
    {
        let mut body = std::pin::pin!(body);
        let (mut data, mut trailers) = (Vec::new(), None);
        while let Some(frame) = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
            match frame.unwrap().into_data() {
                Ok(d) => data.extend_from_slice(&d),
                Err(f) => trailers = f.into_trailers().ok(),
            }
        }
        (data, trailers)
    }

    #[tokio::test]
    async fn a_body_that_cannot_be_stored_is_given_back_whole() {
        let data = |s: &'static str| http_body::Frame::data(Bytes::from_static(s.as_bytes()));
        let whole = collect(Frames([data("ab"), data("cd")].into(), 4), 10).await;
        assert_eq!(whole.unwrap(), "abcd");
        // Longer than it said, past the limit: what was read, then the rest.
        let frames = [data("abcdef"), data("ghij"), data("klm")];
        let Err(replay) = collect(Frames(frames.into(), 4), 8).await else {
            panic!("over the limit")
        };
        assert_eq!(read_all(replay).await, (b"abcdefghijklm".to_vec(), None));
        // Trailers are not stored: the body is given back with them.
        let mut t = HeaderMap::new();
        t.insert("checksum", HeaderValue::from_static("x"));
        let frames = [data("ab"), http_body::Frame::trailers(t.clone())];
        let Err(replay) = collect(Frames(frames.into(), 2), 8).await else {
            panic!("trailers")
        };
        assert_eq!(read_all(replay).await, (b"ab".to_vec(), Some(t)));
    }

    #[tokio::test]
    async fn raw_entries_and_codec_values_do_not_read_as_each_other() {
        let cache = crate::Cache::builder().in_memory().build_async().unwrap();
        let io = cache.io();
        let entry = page(1, Duration::from_secs(60));
        cache
            .cache
            .set_on(&io, "page", &entry, entry.fresh.into(), Herd::Protected)
            .await
            .unwrap();
        assert!(cache.get::<Vec<u8>>("page").await.unwrap_err().is_decode());
        cache
            .set("value", &b"body".to_vec(), Duration::from_secs(60))
            .await
            .unwrap();
        let e = cache
            .cache
            .peek_on::<Entry, _>(&io, "value")
            .await
            .unwrap_err();
        assert!(e.is_decode(), "{e}");
        let got: Option<Entry> = cache.cache.peek_on(&io, "page").await.unwrap();
        assert_eq!(got, Some(entry));
    }
}

#[cfg(test)]
mod age_tests {
    use super::*;

    #[test]
    fn shared_ages_read_as_the_number() {
        for secs in [0, 1, 9, 10, 59, 599, 600, 601, 86_400, u64::MAX] {
            assert_eq!(age_value(secs), HeaderValue::from(secs), "{secs}");
        }
    }
}
