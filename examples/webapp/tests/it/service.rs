//! The service under test: `App::open` on a small temporary database, `serve` on a free port of
//! this test's runtime, and a reqwest client for it.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use clap::Parser;
use newcache_webapp::{App, Config};
use serde_json::Value;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::server::Memcached;

/// Orders in the test database: small enough to seed in a moment in a debug build.
const ROWS: &str = "2000";

#[derive(Debug, Clone, Copy)]
pub enum Backend {
    Memory,
    /// A memcached of the test's own.
    Memcached,
}

pub struct Service {
    base: String,
    client: reqwest::Client,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), newcache_webapp::Error>>>,
    db: PathBuf,
    memcached: Option<Memcached>,
}

impl Service {
    pub async fn start(backend: Backend) -> Service {
        match backend {
            Backend::Memory => Service::start_with(&[]).await,
            Backend::Memcached => {
                let server = Memcached::start();
                let mut svc = Service::start_with(&[server.addr()]).await;
                svc.memcached = Some(server);
                svc
            }
        }
    }

    /// A service over `servers` (the memory backend if none).
    pub async fn start_with(servers: &[String]) -> Service {
        static N: AtomicU64 = AtomicU64::new(0);
        let db = std::env::temp_dir().join(format!(
            "newcache-webapp-test-{}-{}.sqlite",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let config = config_for(&db, servers);
        let app = App::open(&config).await.unwrap();
        assert!(app.startup().seeded.is_some(), "a new database is seeded");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(newcache_webapp::serve(listener, app, async {
            let _ = stopped.await;
        }));
        Service {
            base,
            client: reqwest::Client::new(),
            stop: Some(stop),
            task: Some(task),
            db,
            memcached: None,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// The port the service listens on.
    pub fn port(&self) -> u16 {
        self.base.rsplit(':').next().unwrap().parse().unwrap()
    }

    pub fn client(&self) -> &reqwest::Client {
        &self.client
    }

    /// The test's own memcached (a `Backend::Memcached` service).
    pub fn memcached(&mut self) -> &mut Memcached {
        self.memcached
            .as_mut()
            .expect("a service on its own memcached")
    }

    /// A request to `path`, to add headers to before sending.
    pub fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.client.request(method, self.url(path))
    }

    pub async fn get(&self, path: &str) -> reqwest::Response {
        self.client.get(self.url(path)).send().await.unwrap()
    }

    /// GET `path`, asserting a 200 with a JSON body.
    pub async fn get_json(&self, path: &str) -> Value {
        let r = self.get(path).await;
        let status = r.status();
        let body = r.text().await.unwrap();
        assert_eq!(status, 200, "GET {path}: {body}");
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("GET {path}: {e}: {body}"))
    }

    /// `n` GETs of `path` at once, each a task of its own; each must answer 200. The bodies.
    pub async fn get_concurrently(&self, path: &str, n: usize) -> Vec<String> {
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..n {
            let (client, url) = (self.client.clone(), self.url(path));
            tasks.spawn(async move {
                let r = client.get(&url).send().await.unwrap();
                assert_eq!(r.status(), 200, "GET {url}");
                r.text().await.unwrap()
            });
        }
        tasks.join_all().await
    }

    /// `"db_queries"` from `/stats`.
    pub async fn db_queries(&self) -> u64 {
        self.get_json("/stats").await["db_queries"]
            .as_u64()
            .expect("db_queries is a number")
    }

    /// Stops the server gracefully and checks that it exited cleanly.
    pub async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        let served = self.task.take().unwrap().await.unwrap();
        assert!(served.is_ok(), "serve: {served:?}");
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        remove_db(&self.db);
    }
}

/// The tests' config: a free port, a 60 s ttl, a small database at `db`, the memory backend if
/// `servers` is empty.
pub fn config_for(db: &Path, servers: &[String]) -> Config {
    let mut config = Config::try_parse_from([
        "webapp",
        "--port",
        "0",
        "--ttl-secs",
        "60",
        "--rows",
        ROWS,
        "--db",
        db.to_str().unwrap(),
    ])
    .unwrap();
    // Explicitly, whatever MEMCACHED_SERVERS says in the environment.
    config.memcached_servers = servers.to_vec();
    config.near_cache_mb = 0;
    config.bus_redis = None;
    config
}

/// Removes an SQLite file and its WAL companions.
pub fn remove_db(db: &Path) {
    for suffix in ["", "-wal", "-shm"] {
        let mut path = db.to_path_buf().into_os_string();
        path.push(suffix);
        let _ = std::fs::remove_file(path);
    }
}
