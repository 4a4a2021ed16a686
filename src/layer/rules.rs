//! The response cache's rules (RFC 9111 for a shared cache), as pure functions of headers: what
//! `Cache-Control` says, whether a response may be stored and for how long (`Age` and `Expires`
//! included), the page key (a validated host, a normalised query, cache-busters dropped), the
//! variant key, and `If-None-Match`. No I/O, no clock (the time is an argument).

use std::borrow::Cow;
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
    pub(crate) must_revalidate: bool,
    pub(crate) proxy_revalidate: bool,
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
                    "must-revalidate" => cc.must_revalidate = true,
                    "proxy-revalidate" => cc.proxy_revalidate = true,
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
    /// How long it is fresh from now: its freshness lifetime (`s-maxage`, else `max-age`, else
    /// `Expires` minus `Date`, else the layer's ttl) less the `Age` it arrived with.
    pub(crate) ttl: Duration,
    /// Whether it must never be served stale (`must-revalidate`, `proxy-revalidate`, or
    /// `s-maxage`, which implies `proxy-revalidate` for a shared cache: RFC 9111 §5.2.2.10).
    pub(crate) no_stale: bool,
    /// Whether a request carrying `Authorization` may be served it (`public` or `s-maxage`).
    pub(crate) shared: bool,
    /// The request headers it varies on, lowercased, sorted, without duplicates.
    pub(crate) vary: Vec<HeaderName>,
}

/// Whether a response with this status and these headers may be stored by a shared cache, and
/// for how long, at `now` (seconds since the Unix epoch, by the cache's clock).
pub(crate) fn storable(
    status: StatusCode,
    headers: &HeaderMap,
    statuses: &[StatusCode],
    default_ttl: Duration,
    now: u64,
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
    let lifetime = match (cc.s_maxage, cc.max_age) {
        (Some(s), _) | (None, Some(s)) => Duration::from_secs(s),
        (None, None) => match expires_lifetime(headers, now) {
            Some(life) => life,
            None => default_ttl,
        },
    };
    // RFC 9111 §4.2.3: the age it arrived with counts against its lifetime. The origin's `Date`
    // is not used for the apparent age: clocks differ, and `Age` is what caches in between
    // report.
    let ttl = lifetime.saturating_sub(Duration::from_secs(age(headers)));
    if ttl.is_zero() {
        return Err(Uncacheable::ZeroTtl);
    }
    Ok(Storable {
        ttl,
        no_stale: cc.must_revalidate || cc.proxy_revalidate || cc.s_maxage.is_some(),
        shared: cc.public || cc.s_maxage.is_some(),
        vary,
    })
}

/// The `Age` a response arrived with, in seconds (0 when absent or invalid).
pub(crate) fn age(headers: &HeaderMap) -> u64 {
    headers
        .get(header::AGE)
        .and_then(|v| v.to_str().ok()?.trim().parse().ok())
        .unwrap_or(0)
}

/// The freshness lifetime `Expires` gives (RFC 9111 §4.2.1, §5.3): `Expires` minus `Date` (or
/// minus `now`, without a valid `Date`); zero for an `Expires` that is invalid (`0`, `-1`),
/// repeated or in the past: already stale. `None` without `Expires`.
fn expires_lifetime(headers: &HeaderMap, now: u64) -> Option<Duration> {
    let mut all = headers.get_all(header::EXPIRES).iter();
    let first = all.next()?;
    let secs = |v: &http::HeaderValue| -> Option<u64> {
        let t = httpdate::parse_http_date(v.to_str().ok()?).ok()?;
        Some(t.duration_since(std::time::UNIX_EPOCH).ok()?.as_secs())
    };
    if all.next().is_some() {
        return Some(Duration::ZERO);
    }
    let Some(expires) = secs(first) else {
        return Some(Duration::ZERO);
    };
    let date = headers.get(header::DATE).and_then(secs).unwrap_or(now);
    Some(Duration::from_secs(expires.saturating_sub(date)))
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

/// Whether a `Host` (or a request URI's authority) is one a key may hold: RFC 3986 authority
/// characters only (`host[:port]`: letters, digits, `-._~`, `%`, sub-delims, `:`, `[` `]`), so
/// that no host can hold a `/`, `?`, `@` or a space and move where the path begins.
pub(crate) fn valid_host(host: &str) -> bool {
    host.bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"-._~%!$&'()*+,;=:[]".contains(&b))
}

/// The host part of a request's key: the request URI's authority (absolute form, HTTP/2's
/// `:authority`), else `Host`, lowercased; empty when there is neither. `None`: a host the
/// cache refuses (the request is passed uncached): one with characters an authority cannot
/// hold, or an absolute-form URI whose authority is not the `Host` header's (the origin may
/// read either: RFC 9112 §3.2.2 says the URI wins, many applications read `Host`).
pub(crate) fn key_host<'a>(uri: &'a Uri, headers: &'a HeaderMap) -> Option<Cow<'a, str>> {
    let mut hosts = headers.get_all(header::HOST).iter();
    let header = match (hosts.next(), hosts.next()) {
        (None, _) => None,
        (Some(h), None) => Some(h.to_str().ok()?),
        // Two Host headers: RFC 9112 §3.2 says a 400; the cache does not guess.
        (Some(_), Some(_)) => return None,
    };
    let host = match (uri.authority(), header) {
        (Some(a), Some(h)) if !a.as_str().eq_ignore_ascii_case(h) => return None,
        (Some(a), _) => a.as_str(),
        (None, Some(h)) => h,
        (None, None) => "",
    };
    if !valid_host(host) {
        return None;
    }
    // Most requests send it lowercased already: then it is not copied.
    Some(if host.bytes().any(|b| b.is_ascii_uppercase()) {
        Cow::Owned(host.to_ascii_lowercase())
    } else {
        Cow::Borrowed(host)
    })
}

/// The page key of a request: namespace, host (`None`: left out, a single-site layer), path
/// and the query with its parameters sorted by name and the ignored ones dropped. Parameters
/// are compared as sent (percent-encoded), so `a=%41` and `a=A` are two pages, as they are to
/// the origin; a repeated name keeps its values in the order sent (`id=2&id=1` is not
/// `id=1&id=2`: most frameworks read the first). The host was validated ([`key_host`]): it
/// holds no `/`, and the path begins with one, so the key reads back one way only.
pub(crate) fn page_key(
    namespace: &str,
    host: Option<&str>,
    uri: &Uri,
    ignore: &[String],
) -> String {
    let name = |p: &&str| -> usize { p.find('=').unwrap_or(p.len()) };
    let mut params: Vec<&str> = uri
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .filter(|p| !ignored(&p[..name(p)], ignore))
        .collect();
    // A stable sort by name only: values of one name keep their order.
    params.sort_by(|a, b| a[..name(a)].cmp(&b[..name(b)]));
    let host = host.unwrap_or("");
    let query: usize = params.iter().map(|p| p.len() + 1).sum();
    let mut key =
        String::with_capacity(namespace.len() + 1 + host.len() + uri.path().len() + query);
    key.push_str(namespace);
    key.push(':');
    key.push_str(host);
    key.push_str(uri.path());
    for (i, p) in params.iter().enumerate() {
        key.push(if i == 0 { '?' } else { '&' });
        key.push_str(p);
    }
    key
}

/// The key of one variant of a page: the page key, the vary record's generation (a page
/// stored again starts a new one, leaving the variants of the old unreachable), and the
/// request's values of the headers the response varies on (every value of a repeated header,
/// in order; absent and empty differ). Values are keyed as raw bytes: any byte outside
/// printable ASCII, and `%` and `,`, is written `%XX`.
pub(crate) fn variant_key(
    page_key: &str,
    generation: u64,
    vary: &[HeaderName],
    headers: &HeaderMap,
) -> String {
    use std::fmt::Write as _;
    let mut key = String::from(page_key);
    if generation != 0 {
        let _ = write!(key, "\n#{generation:x}");
    }
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
            for &b in v.as_bytes() {
                if (0x20..0x7f).contains(&b) && b != b'%' && b != b',' {
                    key.push(char::from(b));
                } else {
                    let _ = write!(key, "%{b:02X}");
                }
            }
        }
    }
    key
}

/// Whether a request's `If-None-Match` matches an entity tag (the weak comparison, RFC 9110
/// §13.1.2: `W/` prefixes are ignored). The field is `*` (the whole field: any tag matches) or
/// a list of entity tags, each a quoted string that may hold commas; a malformed list matches
/// nothing from where it goes wrong.
pub(crate) fn none_match(request: &HeaderMap, etag: &[u8]) -> bool {
    let ours = opaque(etag);
    let mut values = request.get_all(header::IF_NONE_MATCH).iter().peekable();
    if values.peek().is_none() {
        return false;
    }
    let field: Vec<&[u8]> = values.map(|v| v.as_bytes()).collect();
    if field.len() == 1 && field[0].trim_ascii() == b"*" {
        return true;
    }
    field
        .iter()
        .any(|v| entity_tags(v).any(|t| Some(t) == ours))
}

/// An entity tag's opaque part, quotes included, without its `W/`; `None` if malformed.
fn opaque(tag: &[u8]) -> Option<&[u8]> {
    let t = tag.trim_ascii();
    let t = t.strip_prefix(b"W/").unwrap_or(t);
    (t.len() >= 2 && t[0] == b'"' && t[t.len() - 1] == b'"' && !t[1..t.len() - 1].contains(&b'"'))
        .then_some(t)
}

/// The opaque tags of an `If-None-Match` list (`#entity-tag`), in order, until one is malformed.
fn entity_tags(mut rest: &[u8]) -> impl Iterator<Item = &[u8]> {
    std::iter::from_fn(move || {
        loop {
            rest = rest.trim_ascii_start();
            match rest.first() {
                None => return None,
                // Empty list elements are allowed (RFC 9110 §5.6.1).
                Some(b',') => rest = &rest[1..],
                Some(_) => break,
            }
        }
        let t = rest.strip_prefix(b"W/").unwrap_or(rest);
        if t.first() != Some(&b'"') {
            rest = &[];
            return None;
        }
        let Some(end) = t[1..].iter().position(|b| *b == b'"') else {
            rest = &[];
            return None;
        };
        let (tag, after) = t.split_at(end + 2);
        let after = after.trim_ascii_start();
        if !(after.is_empty() || after[0] == b',') {
            rest = &[];
            return None;
        }
        rest = after;
        Some(tag)
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

    /// Sun, 06 Nov 1994 08:49:37 GMT.
    const NOW: u64 = 784_111_777;

    #[track_caller]
    fn check_storable(pairs: &[(&str, &str)], expected: Result<(u64, bool, &[&str]), Uncacheable>) {
        let got = storable(
            StatusCode::OK,
            &headers(pairs),
            &[StatusCode::OK],
            Duration::from_secs(60),
            NOW,
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
    #[rustfmt::skip]
    fn what_a_shared_cache_stores_and_for_how_long() {
        check_storable(&[], Ok((60, false, &[])));
        check_storable(&[("cache-control", "max-age=30")], Ok((30, false, &[])));
        check_storable(&[("cache-control", "max-age=30, s-maxage=300")], Ok((300, true, &[])));
        check_storable(&[("cache-control", "public, max-age=5")], Ok((5, true, &[])));
        check_storable(&[("Cache-Control", "PRIVATE")], Err(Uncacheable::Private));
        check_storable(&[("cache-control", "no-store")], Err(Uncacheable::NoStore));
        check_storable(&[("cache-control", "no-cache")], Err(Uncacheable::NoCache));
        check_storable(&[("cache-control", "max-age=0")], Err(Uncacheable::ZeroTtl));
        check_storable(&[("cache-control", "max-age=x")], Err(Uncacheable::ZeroTtl));
        check_storable(&[("set-cookie", "a=b")], Err(Uncacheable::SetCookie));
        check_storable(&[("vary", "Accept, *")], Err(Uncacheable::VaryStar));
        check_storable(
            &[("vary", "Accept-Encoding, accept"), ("vary", "Accept-Language")],
            Ok((60, false, &["accept", "accept-encoding", "accept-language"])),
        );
        let h = headers(&[]);
        let status = storable(StatusCode::NOT_FOUND, &h, &[StatusCode::OK], Duration::from_secs(1), NOW);
        assert_eq!(status, Err(Uncacheable::Status));
    }

    #[test]
    #[rustfmt::skip]
    fn age_and_expires_shorten_the_lifetime() {
        // The Age it arrived with counts against max-age (and the layer's ttl).
        check_storable(&[("cache-control", "max-age=60"), ("age", "50")], Ok((10, false, &[])));
        check_storable(&[("age", "15")], Ok((45, false, &[])));
        check_storable(&[("cache-control", "max-age=60"), ("age", "60")], Err(Uncacheable::ZeroTtl));
        // Expires, relative to Date (or to now), when there is no max-age.
        let date = "Sun, 06 Nov 1994 08:49:37 GMT";
        check_storable(&[("date", date), ("expires", "Sun, 06 Nov 1994 08:51:37 GMT")], Ok((120, false, &[])));
        check_storable(&[("expires", "Sun, 06 Nov 1994 08:50:37 GMT")], Ok((60, false, &[])));
        // max-age wins over Expires.
        check_storable(&[("cache-control", "max-age=5"), ("expires", "0")], Ok((5, false, &[])));
        for past in ["0", "-1", "not a date", "Sun, 06 Nov 1994 08:49:36 GMT"] {
            check_storable(&[("expires", past)], Err(Uncacheable::ZeroTtl));
        }
        check_storable(
            &[("expires", date), ("expires", "Sun, 06 Nov 1994 08:59:37 GMT")],
            Err(Uncacheable::ZeroTtl),
        );
    }

    #[test]
    fn revalidation_directives_forbid_serving_stale() {
        let no_stale = |cc: &str| {
            storable(
                StatusCode::OK,
                &headers(&[("cache-control", cc)]),
                &[StatusCode::OK],
                Duration::from_secs(60),
                NOW,
            )
            .unwrap()
            .no_stale
        };
        assert!(no_stale("max-age=60, must-revalidate"));
        assert!(no_stale("max-age=60, Proxy-Revalidate"));
        assert!(no_stale("s-maxage=60"));
        assert!(!no_stale("max-age=60, public"));
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
        let host = key_host(&uri, &h);
        assert_eq!(page_key("page", host.as_deref(), &uri, &ignore), expected);
    }

    #[test]
    fn page_keys_normalise_the_query() {
        check_key("/a?b=2&a=1", "page:example.com/a?a=1&b=2");
        check_key("/a?a=1&b=2", "page:example.com/a?a=1&b=2");
        check_key("/a?utm_source=x&a=1&_=123", "page:example.com/a?a=1");
        check_key("/a?_x=1", "page:example.com/a?_x=1");
        check_key("/a?", "page:example.com/a");
        // Sorted by name; a repeated name keeps the order its values were sent in.
        check_key("/a?a=2&a=1", "page:example.com/a?a=2&a=1");
        check_key("/a?b=1&a=2&a=1", "page:example.com/a?a=2&a=1&b=1");
        check_key("/a?flag", "page:example.com/a?flag");
        check_key("http://example.com/a", "page:example.com/a");
        let uri: Uri = "/a".parse().unwrap();
        assert_eq!(page_key("page", None, &uri, &[]), "page:/a");
    }

    #[test]
    fn hosts_that_could_move_the_path_are_refused() {
        let host = |uri: &str, hosts: &[&str]| {
            let pairs: Vec<(&str, &str)> = hosts.iter().map(|h| ("host", *h)).collect();
            let uri: Uri = uri.parse().unwrap();
            key_host(&uri, &headers(&pairs)).map(Cow::into_owned)
        };
        assert_eq!(
            host("/c", &["Example.com:8080"]),
            Some("example.com:8080".into())
        );
        assert_eq!(host("/c", &["[::1]:3000"]), Some("[::1]:3000".into()));
        assert_eq!(host("/c", &[]), Some("".into()));
        for bad in ["a/b", "a?b", "a b", "user@a", "a#b", "a\\b"] {
            assert_eq!(host("/c", &[bad]), None, "{bad}");
        }
        assert_eq!(host("/c", &["a", "b"]), None, "two Host headers");
        // Absolute form: the URI's authority, which must agree with Host.
        assert_eq!(host("http://a.org/c", &[]), Some("a.org".into()));
        assert_eq!(host("http://a.org/c", &["A.org"]), Some("a.org".into()));
        assert_eq!(host("http://a.org/c", &["b.org"]), None);
        assert_eq!(host("http://u@a.org/c", &[]), None);
    }

    #[test]
    fn variant_keys_carry_the_varied_values() {
        let vary = vec![header::ACCEPT, header::ACCEPT_LANGUAGE];
        let key = |pairs: &[(&str, &str)]| variant_key("p", 0, &vary, &headers(pairs));
        let a = key(&[("accept", "text/html")]);
        let b = key(&[("accept", "application/json")]);
        let c = key(&[("accept", "text/html"), ("accept-language", "")]);
        assert_ne!(a, b);
        assert_ne!(a, c, "an absent header and an empty one differ");
        assert_eq!(a, key(&[("accept", "text/html")]));
        assert_ne!(
            a,
            variant_key("p", 7, &vary, &headers(&[("accept", "text/html")]))
        );
        // Raw bytes, escaped: values that are not UTF-8 stay apart, and an escape is not a value.
        let raw = |v: &'static [u8]| {
            let mut h = HeaderMap::new();
            h.insert(header::ACCEPT, http::HeaderValue::from_bytes(v).unwrap());
            variant_key("p", 0, &vary, &h)
        };
        assert_ne!(raw(b"\xff"), raw(b"\xfe"));
        assert_ne!(raw(b"\xff"), raw(b"%FF"));
        assert_ne!(raw(b"a,b"), key(&[("accept", "a"), ("accept", "b")]));
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

    #[test]
    fn if_none_match_lists_are_parsed_not_split() {
        let h = |v: &str| headers(&[("if-none-match", v)]);
        // A comma inside a tag is part of it.
        assert!(!none_match(&h("\"v1,*,x\""), b"\"v2\""));
        assert!(none_match(&h("\"v1,*,x\""), b"\"v1,*,x\""));
        assert!(none_match(&h(" , \"x\" ,, W/\"a,b\" "), b"\"a,b\""));
        // `*` only as the whole field.
        assert!(!none_match(&h("\"x\", *"), b"\"a\""));
        assert!(!none_match(
            &headers(&[("if-none-match", "\"x\""), ("if-none-match", "*")]),
            b"\"a\""
        ));
        // Unquoted or unterminated tags match nothing.
        assert!(!none_match(&h("a"), b"a"));
        assert!(!none_match(&h("\"a"), b"\"a\""));
        // Several header lines are one list.
        assert!(none_match(
            &headers(&[("if-none-match", "\"x\""), ("if-none-match", "\"a\"")]),
            b"\"a\""
        ));
    }
}
