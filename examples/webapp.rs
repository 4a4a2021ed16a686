//! newcache in a web service: axum over a 1M-row SQLite database (sqlx, bundled SQLite), with
//! newcache's `AsyncCache` in front of an expensive aggregate and of user records.
//!
//! What it shows:
//! - `GET /report/{id}`: a full-table aggregate (tens of ms) through `get_or_set_with`: one
//!   database query per expiry however many requests arrive, across every process sharing
//!   the server; `?cache=off` runs it every time, for comparison.
//! - `GET /users/{id}` reads a record through the cache; `PUT /users/{id}` updates the row, then
//!   deletes its key and invalidates `/page/{id}`, and the next `GET` shows the new value.
//! - `GET /page/{id}`: an HTML page cached whole by newcache's response-cache layer
//!   (`newcache::layer`, feature `tower`): `X-Cache: HIT | MISS | STALE | PASS`, `Age`, an
//!   `If-None-Match` answered 304 from the entry, one render per expiry across processes.
//!   `GET /account/{id}` (`private`) and `GET /welcome` (sets a cookie) pass through it unstored.
//! - `GET /stats` (database queries since start and the cache's counters), `GET /metrics`
//!   (Prometheus text: the service's counters and newcache's `newcache_*`), `GET /healthz`
//!   (`cache.ping()`: 200, or 503 naming the server that did not answer), `GET /static` (the
//!   bench's ceiling), `GET /series` (requests and database queries per second).
//! - `--near-cache-mb 64`: hot values served from this process's memory in front of memcached
//!   or Redis; another process's `PUT` is seen here after the near ttl (5 s) at most. With
//!   `--bus-redis URL` too, the processes announce their writes on a Redis pub/sub channel
//!   (`newcache::RedisBus`) and drop each other's written keys: seen within tens of ms.
//!
//! Run it from the project root (the first start seeds target/webapp/webapp-1000000.sqlite in a
//! few seconds; `--rows N` for a smaller one, `--db PATH` elsewhere):
//!
//! ```sh
//! cargo run --release -p newcache-webapp --example webapp -- --port 3000 --ttl-secs 60
//! # over memcached; start a second process on another port to share the herd protection:
//! MEMCACHED_SERVERS=127.0.0.1:11211 cargo run --release -p newcache-webapp --example webapp -- --port 3000
//! # over Redis or Valkey (a Redis Cluster is one builder call away: `redis_cluster`)
//! REDIS_URL=redis://127.0.0.1:6379/0 cargo run --release -p newcache-webapp --example webapp -- --port 3000
//! # two processes over memcached, each with a near tier, kept coherent by a bus on Redis
//! export MEMCACHED_SERVERS=127.0.0.1:11211 NEAR_CACHE_MB=64 BUS_REDIS=redis://127.0.0.1:6379
//! cargo run --release -p newcache-webapp --example webapp -- --port 3000 &
//! cargo run --release -p newcache-webapp --example webapp -- --port 3001
//! ```
//!
//! Then try it:
//!
//! ```sh
//! curl -s localhost:3000/report/1 | head -c 200; echo        # ~50 ms the first time, then cached
//! curl -s 'localhost:3000/report/1?cache=off' -o /dev/null -w '%{time_total}s\n'
//! curl -s localhost:3000/users/42
//! curl -s -X PUT localhost:3000/users/42 -H 'content-type: application/json' -d '{"name":"ann"}'
//! curl -s localhost:3000/users/42                           # "ann": the PUT deleted the key
//! curl -si localhost:3000/page/1 | grep -i '^x-cache\|^age'  # MISS, then HIT with an Age
//! # with the two processes on the bus: a PUT on one, the other's next read shows it
//! curl -s localhost:3001/users/42
//! curl -s -X PUT localhost:3000/users/42 -H 'content-type: application/json' -d '{"name":"bo"}'
//! curl -s localhost:3001/users/42                           # "bo" (without the bus: up to 5 s later)
//! curl -s localhost:3000/stats; curl -s localhost:3000/healthz; curl -s localhost:3000/metrics
//! wrk -t2 -c64 -d10s --latency http://127.0.0.1:3000/report/1
//! wrk -t2 -c64 -d10s --latency 'http://127.0.0.1:3000/report/1?cache=off'
//! ```
//!
//! At start-up the service pings the cache (`cache.ping()`) and exits with its message when a
//! server does not answer: a wrong `REDIS_URL`, password or address stops it there, instead of
//! every request going to the database:
//!
//! ```text
//! webapp: the cache did not answer its ping at startup: 1 of 1 servers did not answer: backend
//! error: redis at 127.0.0.1:6379: could not connect: Connection refused (os error 111)
//! ```
//!
//! The whole bench (both backends, two processes over memcached, a plot):
//! `bash benches/webapp/run.sh benches/results/webapp`; two processes with near tiers, with and
//! without the bus: `bash benches/webapp/bus.sh benches/results/webapp-bus`.
//!
//! The service's code is the `newcache-webapp` crate (`examples/webapp/`), which owns this
//! example so that axum and sqlx stay out of `cargo test -p newcache`.

use std::error::Error;

use clap::Parser;
use newcache_webapp::{App, Config};

#[tokio::main]
async fn main() {
    // Flags: --port, --ttl-secs, --db, --rows; MEMCACHED_SERVERS or REDIS_URL selects the
    // shared cache, NEAR_CACHE_MB its near tier, BUS_REDIS its bus (`--help` lists them all).
    let config = Config::parse();
    if let Err(e) = run(config).await {
        // The error and its causes on one line, e.g. "the cache did not answer its ping at
        // startup: 1 of 1 servers did not answer: ...".
        let mut text = e.to_string();
        let mut cause = e.source();
        while let Some(c) = cause {
            text = format!("{text}: {c}");
            cause = c.source();
        }
        eprintln!("webapp: {text}");
        std::process::exit(1);
    }
}

async fn run(config: Config) -> Result<(), Box<dyn Error>> {
    // Open the database (seeding it on first start), time the expensive query, build the cache.
    let app = App::open(&config).await?;
    let s = app.startup();
    match s.seeded {
        Some(took) => println!(
            "seeded {} orders into {} in {:.1} s",
            s.rows,
            s.db_path.display(),
            took.as_secs_f64()
        ),
        None => println!("database {} ({} orders)", s.db_path.display(), s.rows),
    }
    println!(
        "expensive query (/report/1 uncached): {:.1} ms",
        s.report_query.as_secs_f64() * 1e3
    );
    assert!(!s.report_query.is_zero(), "the report query ran");

    // Serve on 127.0.0.1 until Ctrl-C or SIGTERM.
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", config.port)).await?;
    println!(
        "serving on http://{} (cache: {}, ttl {} s)",
        listener.local_addr()?,
        s.backend,
        config.ttl_secs
    );
    newcache_webapp::serve(listener, app, shutdown_signal()).await?;
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("a SIGTERM handler");
    tokio::select! {
        _ = ctrl_c => {}
        _ = term.recv() => {}
    }
}
