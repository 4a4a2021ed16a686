//! newcache's example web service: an axum app over a 1M-row SQLite database, with newcache's
//! [`AsyncCache`](newcache::AsyncCache) in front of its expensive queries.
//!
//! The example binary (`examples/webapp.rs`), the integration tests and the wrk bench
//! (`benches/webapp/`) all run this library: [`App::open`] seeds or opens the database and builds
//! the cache from a [`Config`], [`build_app`] is the axum [`Router`](axum::Router), [`serve`] runs
//! it on a listener until a shutdown future resolves.
//!
//! ```no_run
//! # async fn run() -> Result<(), newcache_webapp::Error> {
//! use clap::Parser;
//! let config = newcache_webapp::Config::parse_from(["webapp", "--port", "3000", "--rows", "10000"]);
//! let app = newcache_webapp::App::open(&config).await?;
//! let listener = tokio::net::TcpListener::bind(("127.0.0.1", config.port)).await?;
//! newcache_webapp::serve(listener, app, std::future::pending()).await?;
//! # Ok(()) }
//! ```
//!
//! # Routes
//!
//! | route | what it does |
//! |---|---|
//! | `GET /report/{id}` | product `id`'s monthly sales: a full scan of `orders`, through `get_or_set_with` |
//! | `GET /report/{id}?cache=off` | the same query, uncached |
//! | `GET /users/{id}` | a user record, through `get_or_set_with` |
//! | `PUT /users/{id}` | updates the row (JSON `{"name": .., "email": ..}`), then deletes its key and invalidates `/page/{id}` |
//! | `GET /page/{id}` | an HTML page: the user and their latest orders |
//! | `GET /stats` | `db_queries`, `requests`, the cache's `stats()` (`cache`) and the response cache's (`pages`), as JSON |
//! | `GET /metrics` | Prometheus text |
//! | `GET /healthz` | `cache.ping()`: 200, or 503 naming the server that did not answer, as JSON |
//! | `GET /static` | a constant body: the bench's ceiling |
//! | `GET /series` | requests and database queries per second, sampled by the service |
//!
#![deny(missing_docs)]

mod app;
mod config;
mod db;
mod error;
mod page;
mod series;
mod telemetry;

pub use app::{App, Startup, build_app, serve};
pub use config::Config;
pub use db::{Month, Report, User};
pub use error::Error;
pub use series::{Sample, Series};
