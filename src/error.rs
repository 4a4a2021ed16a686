//! The crate's one error type and its `Result` alias.

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
/// `Display` gives the kind and what happened; the cause, when there is one, is
/// [`source()`](std::error::Error::source) and is not repeated in the message. `Error` is `Clone`:
/// the callers that waited for one failed load each get it, with the same source.
#[derive(Debug, Clone)]
pub struct Error {
    kind: ErrorKind,
    message: String,
    source: Option<Source>,
    outcome_unknown: bool,
    /// What only some errors carry, behind one thin pointer so that every `Result` stays small
    /// (a batch holds one per key).
    details: Option<Arc<Details>>,
}

/// An [`Error`]'s rarer facts.
#[derive(Debug, Clone, Default)]
struct Details {
    failed_keys: Vec<String>,
    server: Option<String>,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind, self.message)
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
            details: Some(Arc::new(Details {
                failed_keys: failed,
                server: first.server().map(str::to_owned),
            })),
            source: Some(Arc::new(first)),
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

    /// Wraps a loader's error; `source()` returns it unchanged, and the message does not repeat it.
    pub(crate) fn loader(source: BoxError) -> Self {
        Error::with_source(ErrorKind::Loader, "the loader returned an error", source)
    }

    /// A wait for another caller's load that ran out.
    pub(crate) fn wait_timeout(waited: std::time::Duration) -> Self {
        Error::new(
            ErrorKind::WaitTimeout,
            format!("waited {waited:?} (max_wait); the load is still running"),
        )
    }

    /// This error as the source of one that says where it happened (same kind; an unknown
    /// outcome stays unknown).
    pub(crate) fn in_context(self, message: impl Into<String>) -> Self {
        let unknown = self.outcome_unknown;
        let server = self.server().map(str::to_owned);
        let mut e = Error::with_source(self.kind, message, self);
        e.outcome_unknown = unknown;
        if let Some(server) = server {
            e = e.at_server(&server);
        }
        e
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

    /// The backend failed or timed out (a timeout is also a backend error).
    pub fn is_backend(&self) -> bool {
        matches!(self.kind, ErrorKind::Backend | ErrorKind::Timeout)
    }

    /// The backend did not answer in time.
    pub fn is_timeout(&self) -> bool {
        self.kind == ErrorKind::Timeout
    }

    /// The backend does not support the operation.
    pub fn is_unsupported(&self) -> bool {
        self.kind == ErrorKind::Unsupported
    }

    /// The loader failed; [`std::error::Error::source`] is the loader's own error.
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
        let kind = match e.kind() {
            Io::TimedOut | Io::WouldBlock => ErrorKind::Timeout,
            _ => ErrorKind::Backend,
        };
        Error::with_source(kind, "i/o error talking to the server", e)
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
        let e = Error::loader(Box::new(io));
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

    #[test]
    fn error_is_send_sync_static() {
        fn check<T: Send + Sync + 'static>() {}
        check::<Error>();
    }
}
