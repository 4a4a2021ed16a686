//! `Error`: what can go wrong in the service, and the HTTP answer each cause gets.

use std::fmt;

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// An error of the service: at startup, or in a request (then answered as JSON
/// `{"error": "..."}` with the status [`Error::status`] names).
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// The thing asked for does not exist (404).
    NotFound(String),
    /// The request was malformed (400).
    BadRequest(String),
    /// A database error (500).
    Db(sqlx::Error),
    /// A cache error (503 for the backend or a wait that ran out, else 500).
    Cache(newcache::Error),
    /// An I/O error (at startup: the database directory, the listener).
    Io(std::io::Error),
    /// The cache's servers did not answer its ping at startup: a wrong address, URL or
    /// password. The service stops there, rather than serving every request from the database.
    Unreachable(newcache::PingError),
    /// The database file could not be opened, created or seeded (at startup).
    Open {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        source: sqlx::Error,
    },
}

impl Error {
    /// The HTTP status a request that failed with this error gets. A loader's error keeps its
    /// own status: a user that does not exist is a 404 whether or not it went through the cache.
    pub fn status(&self) -> StatusCode {
        match self {
            Error::NotFound(_) => StatusCode::NOT_FOUND,
            Error::BadRequest(_) => StatusCode::BAD_REQUEST,
            Error::Db(_) | Error::Io(_) | Error::Open { .. } => StatusCode::INTERNAL_SERVER_ERROR,
            Error::Unreachable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Error::Cache(e) => match loader_error(e) {
                Some(inner) => inner.status(),
                None if e.is_backend() || e.is_timeout() || e.is_wait_timeout() => {
                    StatusCode::SERVICE_UNAVAILABLE
                }
                None => StatusCode::INTERNAL_SERVER_ERROR,
            },
        }
    }
}

/// This crate's error inside a newcache loader error, if it is one.
fn loader_error(e: &newcache::Error) -> Option<&Error> {
    if !e.is_loader() {
        return None;
    }
    std::error::Error::source(e)?.downcast_ref::<Error>()
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::NotFound(what) => write!(f, "not found: {what}"),
            Error::BadRequest(why) => write!(f, "bad request: {why}"),
            Error::Db(_) => f.write_str("database error"),
            Error::Cache(e) => match loader_error(e) {
                // The loader's own error, as if there were no cache in between.
                Some(inner) => inner.fmt(f),
                None => f.write_str("cache error"),
            },
            Error::Io(_) => f.write_str("i/o error"),
            Error::Unreachable(_) => f.write_str("the cache did not answer its ping at startup"),
            Error::Open { path, .. } => write!(f, "cannot open database {}", path.display()),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::NotFound(_) | Error::BadRequest(_) => None,
            Error::Db(e) => Some(e),
            Error::Cache(e) => match loader_error(e) {
                Some(inner) => inner.source(),
                None => Some(e),
            },
            Error::Io(e) => Some(e),
            Error::Unreachable(e) => Some(e),
            Error::Open { source, .. } => Some(source),
        }
    }
}

impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        Error::Db(e)
    }
}

impl From<newcache::Error> for Error {
    fn from(e: newcache::Error) -> Self {
        Error::Cache(e)
    }
}

/// A cached call's error: the loader's own (this crate's `Error`, shared with the requests
/// that waited for the same load) keeps its status through `Error::Cache`'s `is_loader` form.
impl From<newcache::LoadError<Error>> for Error {
    fn from(e: newcache::LoadError<Error>) -> Self {
        Error::Cache(e.into())
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Io(e)
    }
}

/// The whole chain in one line, for the JSON body and the log.
pub(crate) fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let status = self.status();
        let message = chain(&self);
        if status.is_server_error() {
            eprintln!("webapp: {status}: {message}");
        }
        (status, Json(serde_json::json!({ "error": message }))).into_response()
    }
}
