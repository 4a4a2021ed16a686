//! The response cache's rules (RFC 9111 for a shared cache), as pure functions of headers: what
//! `Cache-Control` says, whether a response may be stored and for how long, the page key (a
//! normalised query, cache-busters dropped), the variant key, and `If-None-Match`. No I/O, no
//! clock.

use std::time::Duration;

use http::header::{self, HeaderMap, HeaderName};
use http::{StatusCode, Uri};

/// What a `Cache-Control` header says, as far as a shared cache cares.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct CacheControl {
    pub(crate) no_store: bool,
    pub(crate) no_cache: bool,
    pub(crate) private: bool,
    pub(crate) public: bool,
    pub(crate) max_age: Option<u64>,
    pub(crate) s_maxage: Option<u64>,
}

impl CacheControl {
    /// Reads every `Cache-Control` header of `headers` (directives are case-insensitive; an
    /// unparseable age counts as 0, which RFC 9111 §4.2.1 asks of a cache: treat it as stale).
    pub(crate) fn parse(headers: &HeaderMap) -> CacheControl {
        let mut cc = CacheControl::default();
        for value in headers.get_all(header::CACHE_CONTROL) {
            let Ok(value) = value.to_str() else {
                continue;
            };
            for directive in value.split(',') {
                let (name, arg) = match directive.split_once('=') {
                    Some((n, a)) => (n.trim(), Some(a.trim().trim_matches('"'))),
                    None => (directive.trim(), None),
                };
                let seconds = || Some(arg.and_then(|a| a.parse().ok()).unwrap_or(0));
                match name.to_ascii_lowercase().as_str() {
                    "no-store" => cc.no_store = true,
                    // `no-cache="field"` and `private="field"` are treated as the whole
                    // directive: stricter, never wrong for a cache.
                    "no-cache" => cc.no_cache = true,
                    "private" => cc.private = true,
                    "public" => cc.public = true,
                    "max-age" => cc.max_age = seconds(),
                    "s-maxage" => cc.s_maxage = seconds(),
                    _ => {}
                }
            }
        }
        cc
    }

    /// Whether a request asks the cache to check with the origin first (`no-cache`, or
    /// `max-age=0`).
    pub(crate) fn wants_revalidation(&self) -> bool {
        self.no_cache || self.max_age == Some(0)
    }
}

/// Why a response is not stored (the page is passed to the client, and a hit-for-pass marker
/// left).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Uncacheable {
    Status,
    SetCookie,
    Private,
    NoStore,
    NoCache,
    VaryStar,
    ZeroTtl,
}

/// What a storable response's headers allow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Storable {
    /// How long it is fresh: `s-maxage`, else `max-age`, else the layer's ttl.
    pub(crate) ttl: Duration,
    /// Whether a request carrying `Authorization` may be served it (`public` or `s-maxage`).
    pub(crate) shared: bool,
    /// The request headers it varies on, lowercased, sorted, without duplicates.
    pub(crate) vary: Vec<HeaderName>,
}

/// Whether a response with this status and these headers may be stored by a shared cache, and
/// for how long.
pub(crate) fn storable(
    status: StatusCode,
    headers: &HeaderMap,
    statuses: &[StatusCode],
    default_ttl: Duration,
) -> Result<Storable, Uncacheable> {
    if !statuses.contains(&status) {
        return Err(Uncacheable::Status);
    }
    if headers.contains_key(header::SET_COOKIE) {
        return Err(Uncacheable::SetCookie);
    }
    let cc = CacheControl::parse(headers);
    if cc.no_store {
        return Err(Uncacheable::NoStore);
    }
    if cc.private {
        return Err(Uncacheable::Private);
    }
    // `no-cache` asks a cache to revalidate every use; this cache does not send conditional
    // requests to the origin, so it does not store such a response at all.
    if cc.no_cache {
        return Err(Uncacheable::NoCache);
    }
    let vary = vary_names(headers).ok_or(Uncacheable::VaryStar)?;
    let ttl = match (cc.s_maxage, cc.max_age) {
        (Some(s), _) | (None, Some(s)) => Duration::from_secs(s),
        (None, None) => default_ttl,
    };
    if ttl.is_zero() {
        return Err(Uncacheable::ZeroTtl);
    }
    Ok(Storable {
        ttl,
        shared: cc.public || cc.s_maxage.is_some(),
        vary,
    })
}

/// The header names a response varies on (lowercased, sorted, deduplicated); `None` for
/// `Vary: *`, which no request can match.
pub(crate) fn vary_names(headers: &HeaderMap) -> Option<Vec<HeaderName>> {
    let mut names = Vec::new();
    for value in headers.get_all(header::VARY) {
        let Ok(value) = value.to_str() else {
            return None;
        };
        for name in value.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            if name == "*" {
                return None;
            }
            // An invalid name is a header no request carries: it cannot change the key.
            if let Ok(n) = HeaderName::from_bytes(name.to_ascii_lowercase().as_bytes()) {
                names.push(n);
            }
        }
    }
    names.sort_by(|a, b| a.as_str().cmp(b.as_str()));
    names.dedup();
    Some(names)
}

/// Whether a query parameter is ignored: its name equals a pattern, or starts with a pattern's
/// text before a final `*` (`utm_*`).
fn ignored(name: &str, patterns: &[String]) -> bool {
    patterns.iter().any(|p| match p.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => name == p,
    })
}

/// The page key of a request: namespace, host, path and the query with its parameters sorted
/// and the ignored ones dropped. Parameters are compared as sent (percent-encoded), so `a=%41`
/// and `a=A` are two pages, as they are to the origin.
pub(crate) fn page_key(
    namespace: &str,
    uri: &Uri,
    headers: &HeaderMap,
    ignore: &[String],
) -> String {
    let host = uri
        .authority()
        .map(|a| a.as_str())
        .or_else(|| headers.get(header::HOST).and_then(|h| h.to_str().ok()))
        .unwrap_or("");
    let mut params: Vec<&str> = uri
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .filter(|p| !ignored(p.split_once('=').map_or(*p, |(n, _)| n), ignore))
        .collect();
    // Sorted whole ("name=value"), so repeated names keep a stable order among themselves.
    params.sort_unstable();
    let mut key = format!("{namespace}:{}{}", host.to_ascii_lowercase(), uri.path());
    if !params.is_empty() {
        key.push('?');
        key.push_str(&params.join("&"));
    }
    key
}

/// The key of one variant of a page: the page key and the request's values of the headers the
/// response varies on (every value of a repeated header, in order; absent and empty differ).
pub(crate) fn variant_key(page_key: &str, vary: &[HeaderName], headers: &HeaderMap) -> String {
    let mut key = String::from(page_key);
    for name in vary {
        key.push('\n');
        key.push_str(name.as_str());
        let mut values = headers.get_all(name).iter().peekable();
        if values.peek().is_none() {
            key.push('!');
            continue;
        }
        key.push(':');
        for (i, v) in values.enumerate() {
            if i > 0 {
                key.push(',');
            }
            key.push_str(&String::from_utf8_lossy(v.as_bytes()));
        }
    }
    key
}

/// Whether a request's `If-None-Match` matches an entity tag (the weak comparison, RFC 9110
/// §13.1.2: `W/` prefixes are ignored; `*` matches any).
pub(crate) fn none_match(request: &HeaderMap, etag: &[u8]) -> bool {
    let strip = |t: &[u8]| -> Vec<u8> { t.strip_prefix(b"W/").unwrap_or(t).to_vec() };
    let ours = strip(etag);
    request.get_all(header::IF_NONE_MATCH).iter().any(|v| {
        v.as_bytes()
            .split(|b| *b == b',')
            .map(|t| t.trim_ascii())
            .any(|t| t == b"*" || strip(t) == ours)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.append(
                HeaderName::from_bytes(n.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    #[track_caller]
    fn check_storable(pairs: &[(&str, &str)], expected: Result<(u64, bool, &[&str]), Uncacheable>) {
        let got = storable(
            StatusCode::OK,
            &headers(pairs),
            &[StatusCode::OK],
            Duration::from_secs(60),
        )
        .map(|s| {
            (
                s.ttl.as_secs(),
                s.shared,
                s.vary
                    .iter()
                    .map(|n| n.as_str().to_string())
                    .collect::<Vec<_>>(),
            )
        });
        let expected = expected.map(|(t, s, v)| (t, s, v.iter().map(|n| n.to_string()).collect()));
        assert_eq!(got, expected, "{pairs:?}");
    }

    #[test]
    fn what_a_shared_cache_stores_and_for_how_long() {
        check_storable(&[], Ok((60, false, &[])));
        check_storable(&[("cache-control", "max-age=30")], Ok((30, false, &[])));
        check_storable(
            &[("cache-control", "max-age=30, s-maxage=300")],
            Ok((300, true, &[])),
        );
        check_storable(
            &[("cache-control", "public, max-age=5")],
            Ok((5, true, &[])),
        );
        check_storable(&[("Cache-Control", "PRIVATE")], Err(Uncacheable::Private));
        check_storable(&[("cache-control", "no-store")], Err(Uncacheable::NoStore));
        check_storable(&[("cache-control", "no-cache")], Err(Uncacheable::NoCache));
        check_storable(&[("cache-control", "max-age=0")], Err(Uncacheable::ZeroTtl));
        check_storable(&[("cache-control", "max-age=x")], Err(Uncacheable::ZeroTtl));
        check_storable(&[("set-cookie", "a=b")], Err(Uncacheable::SetCookie));
        check_storable(&[("vary", "Accept, *")], Err(Uncacheable::VaryStar));
        check_storable(
            &[
                ("vary", "Accept-Encoding, accept"),
                ("vary", "Accept-Language"),
            ],
            Ok((60, false, &["accept", "accept-encoding", "accept-language"])),
        );
        let h = headers(&[]);
        assert_eq!(
            storable(
                StatusCode::NOT_FOUND,
                &h,
                &[StatusCode::OK],
                Duration::from_secs(1)
            ),
            Err(Uncacheable::Status)
        );
    }

    #[test]
    fn request_directives_that_ask_for_revalidation() {
        let cc = |v: &str| CacheControl::parse(&headers(&[("cache-control", v)]));
        assert!(cc("no-cache").wants_revalidation());
        assert!(cc("max-age=0").wants_revalidation());
        assert!(!cc("max-age=10").wants_revalidation());
        assert!(!cc("no-transform").wants_revalidation());
    }

    #[track_caller]
    fn check_key(uri: &str, expected: &str) {
        let ignore = vec!["utm_*".to_string(), "_".to_string()];
        let uri: Uri = uri.parse().unwrap();
        let h = headers(&[("host", "Example.COM")]);
        assert_eq!(page_key("page", &uri, &h, &ignore), expected);
    }

    #[test]
    fn page_keys_normalise_the_query() {
        check_key("/a?b=2&a=1", "page:example.com/a?a=1&b=2");
        check_key("/a?a=1&b=2", "page:example.com/a?a=1&b=2");
        check_key("/a?utm_source=x&a=1&_=123", "page:example.com/a?a=1");
        check_key("/a?_x=1", "page:example.com/a?_x=1");
        check_key("/a?", "page:example.com/a");
        check_key("/a?a=2&a=1", "page:example.com/a?a=1&a=2");
        check_key("/a?flag", "page:example.com/a?flag");
        check_key("http://other.org/a", "page:other.org/a");
    }

    #[test]
    fn variant_keys_carry_the_varied_values() {
        let vary = vec![header::ACCEPT, header::ACCEPT_LANGUAGE];
        let a = variant_key("p", &vary, &headers(&[("accept", "text/html")]));
        let b = variant_key("p", &vary, &headers(&[("accept", "application/json")]));
        let c = variant_key(
            "p",
            &vary,
            &headers(&[("accept", "text/html"), ("accept-language", "")]),
        );
        assert_ne!(a, b);
        assert_ne!(a, c, "an absent header and an empty one differ");
        assert_eq!(
            a,
            variant_key("p", &vary, &headers(&[("accept", "text/html")]))
        );
    }

    #[test]
    fn if_none_match_uses_the_weak_comparison() {
        let h = |v: &str| headers(&[("if-none-match", v)]);
        assert!(none_match(&h("\"a\""), b"\"a\""));
        assert!(none_match(&h("W/\"a\""), b"\"a\""));
        assert!(none_match(&h("\"x\", W/\"a\""), b"W/\"a\""));
        assert!(none_match(&h("*"), b"\"a\""));
        assert!(!none_match(&h("\"b\""), b"\"a\""));
        assert!(!none_match(&headers(&[]), b"\"a\""));
    }
}
