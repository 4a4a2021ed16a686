//! The crate's error type and its `Result` alias, and [`LoadError`]: a loader call's error,
//! the loader's own error typed.

use std::any::Any;
use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;

/// `Result` with newcache's [`Error`] as the default error type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What a loader may fail with.
pub(crate) type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// The source of an [`Error`], shared: the callers of one coalesced load all get the same one.
type Source = Arc<dyn StdError + Send + Sync + 'static>;

/// Everything that can go wrong in newcache.
///
/// Match on [`Error::kind`] or, simpler, ask with the `is_*` predicates. Client-library types never
/// appear in the payload, so the backend can change without breaking callers.
///
/// `Display` says, on one line, the kind, where (the server, for a backend error) and what
/// went wrong there: `backend error: memcached at 127.0.0.1:11211: could not connect`, or
/// `timed out: memcached at 127.0.0.1:11211: no reply within io_timeout (500ms)`. The cause
/// below that, when there is one (the I/O error, the loader's own error, the fault that marked
/// a server dead), is [`source()`](std::error::Error::source) and is not repeated in the
/// message, so each level of the chain says its part once: anyhow's `{:#}` prints
/// `backend error: memcached at 127.0.0.1:11211: could not connect: Connection refused (os
/// error 111)`. `Error` is `Clone`: the callers that waited for one failed load each get it,
/// with the same source.
#[derive(Debug, Clone)]
pub struct Error {
    kind: ErrorKind,
    message: String,
    source: Option<Source>,
    outcome_unknown: bool,
    shown: Shown,
    /// What only some errors carry, behind one thin pointer so that every `Result` stays small
    /// (a batch holds one per key).
    details: Option<Arc<Details>>,
}

/// How an [`Error`] prints: whole, or as the source of another `Error` that already says
/// its kind (and, for a last fault, its server).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shown {
    Whole,
    /// The first failure of a batch: the batch's error says the kind.
    Cause,
    /// The fault that marked a server dead: the "marked dead" error says the kind and server.
    LastFault,
}

/// An [`Error`]'s rarer facts.
#[derive(Debug, Clone, Default)]
struct Details {
    failed_keys: Vec<String>,
    server: Option<String>,
    /// Where it happened (`memcached at host:port`), printed before the message.
    context: Option<String>,
    /// A loader's error as the loader returned it (an `Arc<E>`), for
    /// [`LoadError::Loader`](crate::LoadError::Loader).
    typed: Option<Typed>,
    /// The source is the fault that marked this error's server dead.
    last_fault: bool,
    /// Nothing of the request was sent ([`Error::unsent`]; only the Redis backend says so).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    unsent: bool,
}

/// A loader's `Arc<E>`, kept as `Any` so that the caller who knows `E` gets it back.
#[derive(Clone)]
struct Typed(Arc<dyn Any + Send + Sync>);

impl fmt::Debug for Typed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Typed(..)")
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.shown {
            Shown::Whole => write!(f, "{}: ", self.kind)?,
            Shown::Cause => {}
            Shown::LastFault => f.write_str("last fault: ")?,
        }
        let context = self.details.as_deref().and_then(|d| d.context.as_deref());
        match context {
            Some(c) if self.shown != Shown::LastFault => write!(f, "{c}: {}", self.message),
            _ => f.write_str(&self.message),
        }
    }
}

impl StdError for Error {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        // The inner error itself (not the `Arc`), so that callers can downcast it.
        self.source
            .as_deref()
            .map(|e| e as &(dyn StdError + 'static))
    }
}

/// What class of failure an [`Error`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The key does not exist (`incr`/`decr` on a missing counter).
    NotFound,
    /// Bytes under a key are not a newcache value of the requested type (foreign, corrupt, or
    /// another type), or a counter holds something that is not a number.
    Decode,
    /// A value could not be serialized.
    Encode,
    /// `incr`/`decr`/`get_counter` found a value that is not a decimal counter.
    NotACounter,
    /// The encoded value is larger than the backend's item limit; nothing was sent.
    TooLarge,
    /// A key (or what a custom key function made of it) breaks memcached's key rules.
    InvalidKey,
    /// The builder was given an invalid configuration.
    Config,
    /// The backend failed: connection refused, I/O error, protocol error, server error.
    Backend,
    /// The backend did not answer within the configured timeout.
    Timeout,
    /// The server refused this client: its credentials (a wrong user or password: Redis's
    /// `WRONGPASS`, `NOAUTH`) or a command its ACL user may not run (`NOPERM`). Also a backend
    /// error ([`Error::is_backend`]), but not a fault: the server is never marked dead for it.
    Denied,
    /// The backend refused a command it does not support (e.g. `flush_all` behind twemproxy).
    Unsupported,
    /// The loader passed to a `get_or_set_with` call failed; the source is its error.
    Loader,
    /// A `get_or_set_with` call waited `max_wait` for another caller's load, which is still
    /// running. Not a backend error: no failure policy turns it into a miss.
    WaitTimeout,
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ErrorKind::NotFound => "not found",
            ErrorKind::Decode => "decode error",
            ErrorKind::Encode => "encode error",
            ErrorKind::NotACounter => "not a counter",
            ErrorKind::TooLarge => "value too large",
            ErrorKind::InvalidKey => "invalid key",
            ErrorKind::Config => "invalid configuration",
            ErrorKind::Backend => "backend error",
            ErrorKind::Timeout => "timed out",
            ErrorKind::Denied => "denied by the server",
            ErrorKind::Unsupported => "unsupported by the backend",
            ErrorKind::Loader => "loader failed",
            ErrorKind::WaitTimeout => "gave up waiting for another caller's load",
        })
    }
}

impl Error {
    pub(crate) fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
            source: None,
            outcome_unknown: false,
            shown: Shown::Whole,
            details: None,
        }
    }

    pub(crate) fn with_source(
        kind: ErrorKind,
        message: impl Into<String>,
        source: impl Into<BoxError>,
    ) -> Self {
        Error {
            kind,
            message: message.into(),
            source: Some(Arc::from(source.into())),
            outcome_unknown: false,
            shown: Shown::Whole,
            details: None,
        }
    }

    /// A batch in which some keys failed: names them (the first few in the message, all in
    /// [`failed_keys`](Error::failed_keys)); kind and source are the first failure's.
    pub(crate) fn partial(failed: Vec<String>, total: usize, first: Error) -> Self {
        let shown: Vec<&str> = failed.iter().take(3).map(String::as_str).collect();
        let more = if failed.len() > 3 { ", ..." } else { "" };
        Error {
            kind: first.kind,
            message: format!(
                "{} of {total} keys failed ({}{more})",
                failed.len(),
                shown.join(", ")
            ),
            outcome_unknown: first.outcome_unknown,
            shown: Shown::Whole,
            details: Some(Arc::new(Details {
                failed_keys: failed,
                server: first.server().map(str::to_owned),
                ..Details::default()
            })),
            // Same kind: the batch's message says it, the first failure says the rest.
            source: Some(Arc::new(Error {
                shown: Shown::Cause,
                ..first
            })),
        }
    }

    /// The caller's keys that failed, for an error from a batch operation (`get_many`,
    /// `set_many`, `delete_many`, `get_many_or_set_with`); empty otherwise.
    pub fn failed_keys(&self) -> &[String] {
        self.details.as_deref().map_or(&[], |d| &d.failed_keys)
    }

    pub(crate) fn decode(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::Decode, message)
    }

    pub(crate) fn backend(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::Backend, message)
    }

    pub(crate) fn config(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::Config, message)
    }

    /// Wraps a loader's error; `source()` returns it unchanged, and the message does not repeat
    /// it. The `Arc<E>` is kept too, for [`LoadError::Loader`](crate::LoadError::Loader).
    pub(crate) fn loader<E: StdError + Send + Sync + 'static>(source: Arc<E>) -> Self {
        let mut e = Error::new(ErrorKind::Loader, "the loader returned an error");
        e.details = Some(Arc::new(Details {
            typed: Some(Typed(source.clone())),
            ..Details::default()
        }));
        e.source = Some(source);
        e
    }

    /// The loader's own error, if this is a loader error and the loader's error type is `E`.
    pub(crate) fn typed_loader<E: Send + Sync + 'static>(&self) -> Option<Arc<E>> {
        let typed = self.details.as_deref()?.typed.as_ref()?;
        typed.0.clone().downcast::<E>().ok()
    }

    /// A call refused at once because the `kind` server (`memcached`, `redis`) at `addr` is
    /// marked dead; its source is the fault that marked it (the last one seen), when the health
    /// record has it.
    pub(crate) fn marked_dead_on(kind: &str, addr: &str, last_fault: Option<Error>) -> Self {
        let mut e = Error::new(
            ErrorKind::Backend,
            format!("{kind} at {addr} is marked dead (probed again later)"),
        )
        .at_server(addr);
        if let Some(fault) = last_fault {
            e.source = Some(Arc::new(fault));
            Arc::make_mut(e.details.get_or_insert_default()).last_fault = true;
        }
        e
    }

    /// This error as a server's last fault, to be the source of its "marked dead" errors: its
    /// kind, message and cause, printed without the kind and server (that error says them).
    pub(crate) fn as_last_fault(&self) -> Error {
        Error {
            kind: self.kind,
            message: self.message.clone(),
            source: self.source.clone(),
            outcome_unknown: false,
            shown: Shown::LastFault,
            details: None,
        }
    }

    /// For an error refusing a call because its server is marked dead, the transport fault
    /// that marked it: a refused connect ([`is_backend`](Error::is_backend)), a timeout
    /// ([`is_timeout`](Error::is_timeout)), with its own cause as `source()`. It is also this
    /// error's `source()`. `None` for other errors.
    pub fn last_fault(&self) -> Option<&Error> {
        if !self.details.as_deref()?.last_fault {
            return None;
        }
        self.source.as_deref()?.downcast_ref::<Error>()
    }

    /// A wait for another caller's load that ran out.
    pub(crate) fn wait_timeout(waited: std::time::Duration) -> Self {
        Error::new(
            ErrorKind::WaitTimeout,
            format!("waited {waited:?} (max_wait); the load is still running"),
        )
    }

    /// Says where this error happened (`memcached at host:port`), before its message: one
    /// level still, so the kind is said once and the source stays the cause.
    pub(crate) fn in_context(mut self, context: impl Into<String>) -> Self {
        let context = context.into();
        let d = Arc::make_mut(self.details.get_or_insert_default());
        d.context = Some(match d.context.take() {
            Some(inner) => format!("{context}: {inner}"),
            None => context,
        });
        self
    }

    /// This error with `note` added to what it says (same kind, source and server).
    pub(crate) fn with_note(mut self, note: &str) -> Self {
        self.message.push_str("; ");
        self.message.push_str(note);
        self
    }

    /// Names the server this error happened at ([`Error::server`]).
    pub(crate) fn at_server(mut self, addr: &str) -> Self {
        Arc::make_mut(self.details.get_or_insert_default()).server = Some(addr.to_owned());
        self
    }

    /// The server (`host:port` as configured) a backend error happened at, when the backend
    /// knows it: the memcached backends name the server (or the proxy) of every transport
    /// error, of every call refused because its server is marked dead and of every wait for a
    /// busy pool. For a batch, the server of its first failure. `None` for other errors and
    /// for a custom backend's.
    pub fn server(&self) -> Option<&str> {
        self.details.as_deref()?.server.as_deref()
    }

    /// Marks a failure that struck before any byte of the request was sent (its server marked
    /// dead, a connect that failed, a replay before it that failed): a router may send it to
    /// another server, a write included.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn unsent(mut self) -> Self {
        Arc::make_mut(self.details.get_or_insert_default()).unsent = true;
        self
    }

    /// Whether the request failed before any byte of it was sent ([`Error::unsent`]).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn is_unsent(&self) -> bool {
        self.details.as_deref().is_some_and(|d| d.unsent)
    }

    /// Marks a failure that struck after a write was sent: the server may or may not have
    /// applied it.
    pub(crate) fn with_outcome_unknown(mut self) -> Self {
        self.outcome_unknown = true;
        self
    }

    /// Whether a write failed after it was sent (the connection broke or timed out with the
    /// command in flight): the server may have applied it or not. newcache never retries such
    /// a write by itself; the caller decides (a `set` can be repeated, an `incr` cannot).
    pub fn is_outcome_unknown(&self) -> bool {
        self.outcome_unknown
    }

    /// The class of this error.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The key (or counter) does not exist.
    pub fn is_not_found(&self) -> bool {
        self.kind == ErrorKind::NotFound
    }

    /// Stored bytes could not be decoded: foreign, corrupt, another type, or not a counter.
    pub fn is_decode(&self) -> bool {
        self.kind == ErrorKind::Decode
    }

    /// The value could not be serialized.
    pub fn is_encode(&self) -> bool {
        self.kind == ErrorKind::Encode
    }

    /// The key holds something that is not a decimal counter.
    pub fn is_not_a_counter(&self) -> bool {
        self.kind == ErrorKind::NotACounter
    }

    /// The encoded value exceeds the backend's item limit.
    pub fn is_too_large(&self) -> bool {
        self.kind == ErrorKind::TooLarge
    }

    /// A key breaks memcached's key rules.
    pub fn is_invalid_key(&self) -> bool {
        self.kind == ErrorKind::InvalidKey
    }

    /// The builder's configuration is invalid.
    pub fn is_config(&self) -> bool {
        self.kind == ErrorKind::Config
    }

    /// The backend failed, timed out or refused this client (a timeout and a denial are also
    /// backend errors).
    pub fn is_backend(&self) -> bool {
        matches!(
            self.kind,
            ErrorKind::Backend | ErrorKind::Timeout | ErrorKind::Denied
        )
    }

    /// The server refused this client's credentials or its ACL user's permission for a
    /// command (Redis's `WRONGPASS`, `NOAUTH`, `NOPERM`): the server is up, the configuration
    /// (the URL's user and password, or the user's ACL) is what to fix.
    pub fn is_denied(&self) -> bool {
        self.kind == ErrorKind::Denied
    }

    /// The backend did not answer in time.
    pub fn is_timeout(&self) -> bool {
        self.kind == ErrorKind::Timeout
    }

    /// The backend does not support the operation.
    pub fn is_unsupported(&self) -> bool {
        self.kind == ErrorKind::Unsupported
    }

    /// The loader failed; [`std::error::Error::source`] is the loader's own error. The loader
    /// methods give it typed ([`LoadError::Loader`]); an `Error` of this kind is what `?` makes
    /// of that, or what a caller gets whose loader's error type is not the one that failed.
    pub fn is_loader(&self) -> bool {
        self.kind == ErrorKind::Loader
    }

    /// A `get_or_set_with` call waited [`max_wait`](crate::CacheBuilder::max_wait) for another
    /// caller's load and gave up; it did not run the loader itself.
    pub fn is_wait_timeout(&self) -> bool {
        self.kind == ErrorKind::WaitTimeout
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        use std::io::ErrorKind as Io;
        let (kind, message) = match e.kind() {
            Io::TimedOut | Io::WouldBlock => (ErrorKind::Timeout, "no reply in time"),
            _ => (ErrorKind::Backend, "i/o error talking to the server"),
        };
        Error::with_source(kind, message, e)
    }
}

impl Error {
    /// An I/O error while doing something this message names (`could not connect`): the kind
    /// from the I/O error's kind, the I/O error as the source.
    pub(crate) fn io(e: std::io::Error, doing: &str) -> Self {
        let mut out = Error::from(e);
        out.message = doing.to_owned();
        out
    }
}

/// The error of a loader call (`get_or_set_with` and friends): the loader's own error, typed,
/// or the cache's.
///
/// The loader's error is shared (`Arc<E>`, as moka's `try_get_with` gives it): the callers of
/// this process that waited for the same load get the same one. Match on it, or ask with
/// [`loader`](LoadError::loader); `?` into [`newcache::Result`](crate::Result) (or anyhow)
/// converts it into an [`Error`] with [`is_loader`](Error::is_loader) whose `source()` is the
/// loader's error.
///
/// The loader's error type must be a [`std::error::Error`] (so that it can be the source of
/// that `Error`). An `anyhow::Error`, a `String` or a `Box<dyn Error>` is not: wrap it in a
/// type of your own, or with `.map_err(std::io::Error::other)` (then read it back with
/// `e.get_ref()` on the `io::Error`):
///
/// ```
/// # use std::time::Duration;
/// # let cache = newcache::Cache::builder().build()?;
/// let fetch = || -> anyhow::Result<u64> { anyhow::bail!("the database is down") };
/// let got = cache.get_or_set_with("n", Duration::from_secs(60), || {
///     fetch().map_err(std::io::Error::other)
/// });
/// assert_eq!(got.unwrap_err().loader().unwrap().to_string(), "the database is down");
/// # Ok::<(), newcache::Error>(())
/// ```
///
/// ```
/// use std::time::Duration;
/// use newcache::LoadError;
///
/// #[derive(Debug, thiserror::Error)]
/// enum AppError {
///     #[error("no such user")]
///     NotFound,
/// }
///
/// let cache = newcache::Cache::builder().build()?;
/// let got = cache.get_or_set_with::<String, _, _>("user:7", Duration::from_secs(60), || {
///     Err(AppError::NotFound)
/// });
/// match got {
///     Err(LoadError::Loader(e)) => assert!(matches!(*e, AppError::NotFound)), // a 404
///     Err(e) => panic!("the cache failed: {e}"),                              // a 500
///     Ok(name) => println!("{name}"),
/// }
/// # Ok::<(), newcache::Error>(())
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum LoadError<E> {
    /// The loader (this caller's, or the in-process leader's it waited for) returned this
    /// error. Nothing was cached.
    Loader(Arc<E>),
    /// The cache failed: the backend, a wait that ran out, a value that does not decode. Also
    /// a loader's error this caller cannot type: the load of another process, or of an
    /// in-process leader with another error type ([`Error::is_loader`], its `source()` the
    /// loader's error).
    Cache(Error),
}

impl<E> LoadError<E> {
    /// The loader's error, if the loader failed (and this caller can type its error).
    pub fn loader(&self) -> Option<&E> {
        match self {
            LoadError::Loader(e) => Some(e),
            LoadError::Cache(_) => None,
        }
    }

    /// The cache's error, if the cache failed.
    pub fn cache(&self) -> Option<&Error> {
        match self {
            LoadError::Loader(_) => None,
            LoadError::Cache(e) => Some(e),
        }
    }

    /// The loader's shared error, or this as the cache's error.
    pub fn into_loader(self) -> std::result::Result<Arc<E>, Error>
    where
        E: StdError + Send + Sync + 'static,
    {
        match self {
            LoadError::Loader(e) => Ok(e),
            LoadError::Cache(e) => Err(e),
        }
    }

    /// This as an [`Error`] (what `?` does): a loader's error becomes an
    /// [`is_loader`](Error::is_loader) error whose `source()` is the loader's error.
    pub fn into_cache_error(self) -> Error
    where
        E: StdError + Send + Sync + 'static,
    {
        self.into()
    }

    /// The call's error from the cache's: the loader's own error when it is of type `E`.
    pub(crate) fn from_error(e: Error) -> Self
    where
        E: Send + Sync + 'static,
    {
        match e.typed_loader::<E>() {
            Some(typed) => LoadError::Loader(typed),
            None => LoadError::Cache(e),
        }
    }
}

impl<E> Clone for LoadError<E> {
    fn clone(&self) -> Self {
        match self {
            LoadError::Loader(e) => LoadError::Loader(e.clone()),
            LoadError::Cache(e) => LoadError::Cache(e.clone()),
        }
    }
}

/// A loader's error prints `loader failed`, its `source()` the loader's error; the cache's
/// prints as the [`Error`] it is (its message says what failed and why, its `source()` the
/// cause), so no level of the chain is said twice.
impl<E> fmt::Display for LoadError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::Loader(_) => f.write_str("loader failed"),
            LoadError::Cache(e) => fmt::Display::fmt(e, f),
        }
    }
}

impl<E: StdError + 'static> StdError for LoadError<E> {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        match self {
            LoadError::Loader(e) => Some(&**e),
            LoadError::Cache(e) => e.source(),
        }
    }
}

impl<E: StdError + Send + Sync + 'static> From<LoadError<E>> for Error {
    fn from(e: LoadError<E>) -> Self {
        match e {
            LoadError::Loader(e) => Error::loader(e),
            LoadError::Cache(e) => e,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn predicates_follow_kind() {
        let e = Error::new(ErrorKind::Timeout, "x");
        assert!(e.is_timeout() && e.is_backend() && !e.is_decode());
        let e = Error::new(ErrorKind::NotFound, "no counter `hits`");
        assert!(e.is_not_found());
        assert_eq!(e.to_string(), "not found: no counter `hits`");
        let e = Error::wait_timeout(std::time::Duration::from_millis(500));
        assert!(e.is_wait_timeout() && !e.is_backend() && !e.is_timeout());
    }

    #[test]
    fn loader_error_keeps_source_and_names_it_once() {
        let io = std::io::Error::other("db down");
        let e = Error::loader(Arc::new(io));
        assert!(e.is_loader());
        assert!(!e.to_string().contains("db down"), "{e}");
        let src = StdError::source(&e).expect("source");
        assert_eq!(src.to_string(), "db down");
        assert!(src.downcast_ref::<std::io::Error>().is_some());
        // a clone (what a coalesced follower gets) shares the same source
        let f = e.clone();
        let fsrc = StdError::source(&f).expect("source");
        assert!(std::ptr::addr_eq(src, fsrc));
    }

    #[test]
    fn a_result_stays_small() {
        // A batch holds one `Result` per key: the rare fields live behind one pointer.
        assert!(
            std::mem::size_of::<Error>() <= 56,
            "{}",
            std::mem::size_of::<Error>()
        );
        let e = Error::backend("x").at_server("a:1");
        assert_eq!(e.clone().in_context("at a").server(), Some("a:1"));
        let batch = Error::partial(vec!["k".into()], 2, e);
        assert_eq!(
            (batch.server(), batch.failed_keys()),
            (Some("a:1"), &["k".to_owned()][..])
        );
    }

    /// Each level of a chain says its part once: the context joins the message (one level),
    /// a batch's first failure and a server's last fault print without the kind their parent
    /// says.
    #[test]
    fn each_level_says_its_part_once() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let e = Error::io(io, "could not connect")
            .in_context("memcached at a:1")
            .at_server("a:1");
        assert_eq!(
            e.to_string(),
            "backend error: memcached at a:1: could not connect"
        );
        assert_eq!(StdError::source(&e).unwrap().to_string(), "refused");
        let batch = Error::partial(vec!["k".into()], 2, e.clone());
        let first = StdError::source(&batch).unwrap();
        assert_eq!(first.to_string(), "memcached at a:1: could not connect");
        let dead = Error::marked_dead_on("memcached", "a:1", Some(e.as_last_fault()));
        let fault = dead.last_fault().expect("the last fault");
        assert!(std::ptr::addr_eq(fault, StdError::source(&dead).unwrap()));
        assert_eq!(fault.to_string(), "last fault: could not connect");
        assert_eq!(StdError::source(fault).unwrap().to_string(), "refused");
        assert!(
            Error::marked_dead_on("memcached", "a:1", None)
                .last_fault()
                .is_none()
        );
        assert!(batch.last_fault().is_none());
    }

    #[test]
    fn a_load_error_round_trips_through_error() {
        #[derive(Debug, PartialEq)]
        struct Mine;
        impl fmt::Display for Mine {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("mine")
            }
        }
        impl StdError for Mine {}
        let arc = Arc::new(Mine);
        let e: Error = LoadError::Loader(arc.clone()).into();
        assert!(e.is_loader());
        assert_eq!(StdError::source(&e).unwrap().to_string(), "mine");
        match LoadError::<Mine>::from_error(e.clone()) {
            LoadError::Loader(back) => assert!(Arc::ptr_eq(&back, &arc)),
            other => panic!("{other:?}"),
        }
        // another type: the cache's error, still is_loader
        let other = LoadError::<std::io::Error>::from_error(e);
        assert!(other.cache().is_some_and(Error::is_loader));
        assert_eq!(
            other.to_string(),
            "loader failed: the loader returned an error"
        );
        let l = LoadError::Loader(arc);
        assert_eq!(l.to_string(), "loader failed");
        assert_eq!(StdError::source(&l).unwrap().to_string(), "mine");
        assert_eq!(l.clone().loader(), Some(&Mine));
    }

    #[test]
    fn error_is_send_sync_static() {
        fn check<T: Send + Sync + 'static>() {}
        check::<Error>();
    }
}
