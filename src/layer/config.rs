//! The response cache's settings: [`ResponseCacheBuilder`], every default in one place, the
//! [`CookiePolicy`] and the [`HostPolicy`].

use std::time::Duration;

use http::StatusCode;

use super::ResponseCacheLayer;
use crate::async_cache::AsyncCache;
use crate::error::{Error, Result};

/// The default [`ResponseCacheBuilder::ttl`]: 60 s.
pub const DEFAULT_PAGE_TTL: Duration = Duration::from_secs(60);
/// The default [`ResponseCacheBuilder::hit_for_pass`]: 5 s.
pub const DEFAULT_HIT_FOR_PASS: Duration = Duration::from_secs(5);
/// The default [`ResponseCacheBuilder::max_body_size`]: 512 KiB (memcached's items are 1 MiB
/// by default, headers and envelope included).
pub const DEFAULT_MAX_BODY_SIZE: usize = 512 << 10;
/// The default [`ResponseCacheBuilder::revalidate_after`]: 1 s.
pub const DEFAULT_REVALIDATE_AFTER: Duration = Duration::from_secs(1);

/// The default of [`ResponseCacheBuilder::ignore_params`]' list: the query parameters left
/// out of page keys (`utm_*` is a prefix).
pub const DEFAULT_IGNORED_PARAMS: [&str; 4] = ["utm_*", "_", "fbclid", "gclid"];

/// What the response cache does with a request that carries a `Cookie` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum CookiePolicy {
    /// The request goes to the origin, uncached (`X-Cache: PASS`): a cookie usually means a
    /// session, and a page made for one user must not be served to another. The default (as in
    /// Varnish's built-in rules).
    #[default]
    Pass,
    /// The cookie is ignored: the request is served from, and may fill, the same entry as a
    /// request without cookies. Only for routes whose pages never depend on a cookie.
    Ignore,
    /// The `Cookie` header's value is part of the key: each distinct cookie string gets its own
    /// entry (sound, but with a low hit rate when cookies carry per-user ids).
    Key,
}

/// Whether the request's host is part of a page's key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum HostPolicy {
    /// The host (the request URI's authority, else the `Host` header, lowercased) is part of
    /// the key, so one layer may serve several sites. A request whose host holds characters an
    /// authority cannot (`/`, `?`, `@`, a space...), with two `Host` headers, or in absolute
    /// form with an authority other than its `Host`, is passed to the origin uncached. The
    /// default. [`invalidate`](ResponseCacheLayer::invalidate) then needs the host: an
    /// absolute URL, or a path with the hosts listed in
    /// [`served_hosts`](ResponseCacheBuilder::served_hosts).
    #[default]
    Key,
    /// The host is left out of the key: for an application that serves one site under several
    /// names (`localhost:3000` and `127.0.0.1:3000`, a load balancer's name and a pod's), whose
    /// pages do not depend on the name they were asked for under. One page per path, and
    /// [`invalidate`](ResponseCacheLayer::invalidate) of a path reaches it whatever the host.
    /// Never for pages that print their host (absolute links): the first host asked would be
    /// served to every other.
    Ignore,
}

/// The settings of a [`ResponseCacheLayer`], validated by [`build`](ResponseCacheBuilder::build).
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) ttl: Duration,
    pub(crate) statuses: Vec<StatusCode>,
    pub(crate) max_body_size: usize,
    pub(crate) ignored_params: Vec<String>,
    pub(crate) cookies: CookiePolicy,
    pub(crate) hit_for_pass: Duration,
    pub(crate) revalidate_after: Duration,
    pub(crate) namespace: String,
    pub(crate) hosts: HostPolicy,
    /// [`ResponseCacheBuilder::served_hosts`], lowercased by `build`.
    pub(crate) served_hosts: Vec<String>,
}

/// Builds a [`ResponseCacheLayer`]: [`ResponseCacheLayer::builder`]. Each setter says its
/// default; [`build`](ResponseCacheBuilder::build) checks them.
#[must_use]
#[derive(Debug, Clone)]
pub struct ResponseCacheBuilder {
    cache: AsyncCache,
    settings: Settings,
}

impl ResponseCacheBuilder {
    pub(crate) fn new(cache: AsyncCache) -> ResponseCacheBuilder {
        ResponseCacheBuilder {
            cache,
            settings: Settings {
                ttl: DEFAULT_PAGE_TTL,
                statuses: vec![StatusCode::OK],
                max_body_size: DEFAULT_MAX_BODY_SIZE,
                ignored_params: DEFAULT_IGNORED_PARAMS.map(String::from).to_vec(),
                cookies: CookiePolicy::Pass,
                hit_for_pass: DEFAULT_HIT_FOR_PASS,
                revalidate_after: DEFAULT_REVALIDATE_AFTER,
                namespace: "page".to_string(),
                hosts: HostPolicy::Key,
                served_hosts: Vec::new(),
            },
        }
    }

    /// How long a response is fresh when it says neither `s-maxage` nor `max-age`; default
    /// [`DEFAULT_PAGE_TTL`] (60 s). After it, a page is served stale to everyone but the one
    /// request that refreshes it, for up to the cache's
    /// [`herd_timeout`](crate::CacheBuilder::herd_timeout) (its "grace"), unless its response
    /// said `must-revalidate`, `proxy-revalidate` or `s-maxage` (no grace).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.settings.ttl = ttl;
        self
    }

    /// The response statuses that may be stored; default `[200]`.
    pub fn statuses(mut self, statuses: impl IntoIterator<Item = StatusCode>) -> Self {
        self.settings.statuses = statuses.into_iter().collect();
        self
    }

    /// The largest body stored, in bytes; default [`DEFAULT_MAX_BODY_SIZE`] (512 KiB). A larger
    /// body, or one whose length is not known in advance (a stream), is passed to the client
    /// as it comes, uncached, and leaves a hit-for-pass marker.
    pub fn max_body_size(mut self, bytes: usize) -> Self {
        self.settings.max_body_size = bytes;
        self
    }

    /// More query parameters to leave out of the key (cache-busters and trackers): exact
    /// names, or prefixes ending in `*`. **Adds to** the list, whose default is
    /// [`DEFAULT_IGNORED_PARAMS`] (`utm_*`, `_`, `fbclid`, `gclid`): `.ignore_params(["ref"])`
    /// ignores `ref` and those four. To replace the list, use
    /// [`ignore_only_params`](Self::ignore_only_params).
    pub fn ignore_params<S: Into<String>>(mut self, params: impl IntoIterator<Item = S>) -> Self {
        self.settings
            .ignored_params
            .extend(params.into_iter().map(Into::into));
        self
    }

    /// The query parameters left out of the key, and no others: **replaces** the list
    /// (default [`DEFAULT_IGNORED_PARAMS`]; `ignore_only_params::<&str>([])` keys every
    /// parameter). To add to it, use [`ignore_params`](Self::ignore_params).
    pub fn ignore_only_params<S: Into<String>>(
        mut self,
        params: impl IntoIterator<Item = S>,
    ) -> Self {
        self.settings.ignored_params = params.into_iter().map(Into::into).collect();
        self
    }

    /// What to do with requests carrying a `Cookie`; default [`CookiePolicy::Pass`].
    pub fn cookies(mut self, policy: CookiePolicy) -> Self {
        self.settings.cookies = policy;
        self
    }

    /// How long a URL whose response was not storable (`private`, `Set-Cookie`, a stream, a
    /// status not in [`statuses`](Self::statuses) such as a 404 where no page was stored)
    /// sends its requests straight to the origin, instead of making them wait for one another's
    /// load; default [`DEFAULT_HIT_FOR_PASS`] (5 s). Varnish's "hit-for-pass". A `5xx` (or an
    /// origin error) leaves no marker: it is a failed fetch, tried again by the next request,
    /// one at a time, while a stale page, if there is one, is served to the others.
    pub fn hit_for_pass(mut self, time: Duration) -> Self {
        self.settings.hit_for_pass = time;
        self
    }

    /// A request's `Cache-Control: no-cache` (or `max-age=0`) is honoured for pages older than
    /// this: such a page is fetched again, once for all the requests that asked to revalidate
    /// it at once, across processes. A younger page was fetched from the origin within this
    /// time and is served as it is. Default [`DEFAULT_REVALIDATE_AFTER`] (1 s); zero honours
    /// every such request (still one origin call at a time per page).
    pub fn revalidate_after(mut self, age: Duration) -> Self {
        self.settings.revalidate_after = age;
        self
    }

    /// Whether the host is part of a page's key; default [`HostPolicy::Key`].
    pub fn hosts(mut self, policy: HostPolicy) -> Self {
        self.settings.hosts = policy;
        self
    }

    /// The hosts this layer serves pages under, as clients send them in `Host` (the port
    /// included when it is not the scheme's default: `localhost:3101`; matched case-blind);
    /// default none. Only [`invalidate`](ResponseCacheLayer::invalidate) reads it: with
    /// [`HostPolicy::Key`] pages are stored per host, and memcached cannot list keys, so a path
    /// alone (`/page/7`) reaches the pages of these hosts, each of them (and the page of a
    /// request that sent no `Host`, stored under the empty host). Without a list, a path
    /// alone is refused there (give an absolute URL). Requests for a host not listed are
    /// still served and stored as before. Unused with [`HostPolicy::Ignore`]. Replaces the
    /// list.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), newcache::Error> {
    /// let cache = newcache::Cache::builder().in_memory().build_async()?;
    /// let pages = newcache::layer::ResponseCacheLayer::builder(cache)
    ///     .served_hosts(["example.com", "localhost:3101"])
    ///     .build()?;
    /// // The page of /page/7 under each host; false: none was stored.
    /// assert!(!pages.invalidate("/page/7").await?);
    /// # Ok(())
    /// # }
    /// ```
    pub fn served_hosts<S: Into<String>>(mut self, hosts: impl IntoIterator<Item = S>) -> Self {
        self.settings.served_hosts = hosts.into_iter().map(Into::into).collect();
        self
    }

    /// The prefix of every page key, so that pages never collide with the application's own
    /// keys in the same cache; default `"page"`.
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.settings.namespace = namespace.into();
        self
    }

    /// The layer.
    ///
    /// # Errors
    ///
    /// [`is_config`](Error::is_config): a zero `ttl` or `hit_for_pass`, no status, or an empty
    /// namespace or one containing `:` (the separator of the key's parts), a
    /// [served host](Self::served_hosts) that is empty or holds a character a `Host` cannot
    /// (`/`, `?`, `@`, a space...).
    pub fn build(mut self) -> Result<ResponseCacheLayer> {
        for host in &mut self.settings.served_hosts {
            if host.is_empty() || !super::rules::valid_host(host) {
                return Err(Error::config(format!(
                    "the response cache's served_hosts holds {host:?}, which is not a host"
                )));
            }
            host.make_ascii_lowercase();
        }
        let s = &self.settings;
        if s.ttl.is_zero() {
            return Err(Error::config("the response cache's ttl must be above zero"));
        }
        if s.hit_for_pass.is_zero() {
            return Err(Error::config(
                "the response cache's hit_for_pass must be above zero",
            ));
        }
        if s.statuses.is_empty() {
            return Err(Error::config(
                "the response cache's statuses must name at least one status",
            ));
        }
        if s.namespace.is_empty() || s.namespace.contains(':') {
            return Err(Error::config(format!(
                "the response cache's namespace {:?} must be non-empty and without ':'",
                s.namespace
            )));
        }
        Ok(ResponseCacheLayer::from_parts(self.cache, self.settings))
    }
}
