//! newcache's own connection set-up (`AUTH`, `SELECT`, `CLIENT INFO`), and a server at
//! `maxclients` in every set-up: RESP3, a database, a cluster node (whose refusal reads
//! differently), `AUTH`'s old form.

use std::io::{BufRead, BufReader, Write};
use std::time::Duration;

use newcache::{Cache, FailurePolicy};

use crate::fixture::{RedisServer, unique_flavor};
use crate::redis::runtime;
use crate::redis_maxclients::maxclients;

const S: fn(u64) -> Duration = Duration::from_secs;
const MS: fn(u64) -> Duration = Duration::from_millis;

/// A cluster-enabled server holding every slot (a one-node cluster), `extra` arguments given
/// (a password), its nodes file under `name`; with an admin connection by `url`, and the
/// nodes file to remove after.
fn one_node_cluster(
    name: &str,
    extra: &[&str],
    url: impl Fn(&RedisServer) -> String,
) -> (RedisServer, redis::Connection, std::path::PathBuf) {
    let conf = std::env::temp_dir().join(format!("{name}-{}.conf", std::process::id()));
    let _ = std::fs::remove_file(&conf);
    let mut args = extra.to_vec();
    args.extend(["--cluster-enabled", "yes", "--cluster-config-file"]);
    args.push(conf.to_str().unwrap());
    let server = RedisServer::start_with("redis-server", &args);
    let mut a = redis::Client::open(url(&server))
        .and_then(|c| c.get_connection_with_timeout(S(5)))
        .unwrap();
    let () = redis::cmd("CLUSTER")
        .arg(&["ADDSLOTSRANGE", "0", "16383"])
        .query(&mut a)
        .unwrap();
    for _ in 0..100 {
        let info: String = redis::cmd("CLUSTER").arg("INFO").query(&mut a).unwrap();
        if info.contains("cluster_state:ok") {
            break;
        }
        std::thread::sleep(MS(100));
    }
    (server, a, conf)
}

/// maxclients behind a password, in the variants `redis_maxclients` does not cover: RESP3 (HELLO AUTH by
/// redis-rs), and RESP2 with a database (the async view's AUTH alone then SELECT + CLIENT INFO
/// pipelined; the sync pool's AUTH + SELECT + CLIENT INFO pipelined).
#[test]
fn a_delete_refused_at_maxclients_is_replayed_with_resp3_and_with_a_database() {
    let server = RedisServer::start_with("redis-server", &["--requirepass", "pw"]);
    let base = server.url().replace("redis://", "redis://:pw@");
    let mut a = redis::Client::open(base.as_str())
        .and_then(|c| c.get_connection_with_timeout(S(5)))
        .unwrap();
    let rt = runtime();
    let mut bad = Vec::new();
    for (name, url) in [
        ("resp3 db0", format!("{base}?protocol=resp3")),
        (
            "resp3 db3",
            format!("{}?protocol=resp3", base.replace("/0", "/3")),
        ),
        ("resp2 db3", base.replace("/0", "/3")),
    ] {
        let flavor = unique_flavor("r10-maxclients");
        let build = || {
            Cache::builder()
                .redis(url.as_str())
                .flavor(flavor.as_str())
                .read_failures(FailurePolicy::Propagate)
                .write_failures(FailurePolicy::Propagate)
        };
        for sync in [true, false] {
            let key = format!("k-{sync}");
            build().build().unwrap().set(&key, &1u32, S(600)).unwrap();
            std::thread::sleep(MS(200));
            maxclients(&mut a, 1);
            let (e, after) = if sync {
                let cache = build().build().unwrap();
                let e = cache.delete(&key).unwrap_err();
                maxclients(&mut a, 10_000);
                (e, cache.get::<u32>(&key))
            } else {
                let cache = build().build_async().unwrap();
                rt.block_on(async {
                    let e = cache.delete(&key).await.unwrap_err();
                    maxclients(&mut a, 10_000);
                    (e, cache.get::<u32>(&key).await)
                })
            };
            eprintln!("{name} sync {sync}: delete: {e}\n      get after: {after:?}");
            if e.is_denied() || !matches!(after, Ok(None)) {
                bad.push(format!("{name} sync {sync}: {e} / {after:?}"));
            }
        }
    }
    assert!(bad.is_empty(), "{bad:#?}");
}

/// An ACL user without CLIENT, with a password and a database other than 0: works, sync and
/// async (the async view's SELECT + CLIENT INFO pipeline keeps the refusal inline).
#[test]
fn an_acl_user_without_client_with_a_password_and_a_database_works() {
    let server = RedisServer::start("redis-server");
    let mut a = redis::Client::open(server.url())
        .and_then(|c| c.get_connection_with_timeout(S(5)))
        .unwrap();
    let () = redis::cmd("ACL")
        .arg(&["SETUSER", "u", "on", ">p", "~*", "+@all", "-client"])
        .query(&mut a)
        .unwrap();
    let url = server
        .url()
        .replace("redis://", "redis://u:p@")
        .replace("/0", "/3");
    let build = || {
        Cache::builder()
            .redis(url.as_str())
            .flavor(unique_flavor("r10-acl"))
            .read_failures(FailurePolicy::Propagate)
            .write_failures(FailurePolicy::Propagate)
    };
    let cache = build().build().unwrap();
    cache.set("k", &1u32, S(60)).unwrap();
    assert_eq!(cache.get::<u32>("k").unwrap(), Some(1));
    let acache = build().build_async().unwrap();
    runtime().block_on(async {
        acache.set("k", &2u32, S(60)).await.unwrap();
        assert_eq!(acache.get::<u32>("k").await.unwrap(), Some(2));
    });
}

/// A server that takes `AUTH password` only (Redis < 6, or a proxy speaking the old form):
/// `AUTH user password` is `ERR wrong number of arguments for 'auth' command`. redis-rs
/// retries without the user (connection.rs check_resp2_auth: ShouldRetryWithoutUsername), and
/// so does newcache's own set-up (setup.rs, `Auth::Again`).
fn old_auth_server() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(s) = s else { continue };
            std::thread::spawn(move || {
                let mut r = BufReader::new(s.try_clone().unwrap());
                let mut w = s;
                loop {
                    let mut line = String::new();
                    if r.read_line(&mut line).unwrap_or(0) == 0 {
                        return;
                    }
                    let n: usize = line.trim()[1..].parse().unwrap();
                    let mut args = Vec::new();
                    for _ in 0..n {
                        let mut len = String::new();
                        r.read_line(&mut len).unwrap();
                        let len: usize = len.trim()[1..].parse().unwrap();
                        let mut buf = vec![0; len + 2];
                        std::io::Read::read_exact(&mut r, &mut buf).unwrap();
                        buf.truncate(len);
                        args.push(String::from_utf8(buf).unwrap());
                    }
                    let reply: &[u8] = match args[0].to_ascii_uppercase().as_str() {
                        "AUTH" if args.len() == 2 && args[1] == "pw" => b"+OK\r\n",
                        "AUTH" if args.len() == 2 => b"-ERR invalid password\r\n",
                        "AUTH" => b"-ERR wrong number of arguments for 'auth' command\r\n",
                        "GET" => b"$-1\r\n",
                        "SELECT" => b"+OK\r\n",
                        "PING" => b"+PONG\r\n",
                        _ => b"-ERR unknown command\r\n",
                    };
                    if w.write_all(reply).is_err() {
                        return;
                    }
                }
            });
        }
    });
    port
}

#[test]
fn a_server_knowing_only_auth_password_is_authenticated_with_a_user_in_the_url() {
    let port = old_auth_server();
    let url = format!("redis://default:pw@127.0.0.1:{port}/0");
    // redis-rs alone (what newcache used to leave AUTH to) connects.
    let mut c = redis::Client::open(url.as_str())
        .unwrap()
        .get_connection_with_timeout(S(2))
        .unwrap();
    let v: Option<u32> = redis::cmd("GET").arg("x").query(&mut c).unwrap();
    assert_eq!(v, None);
    let cache = Cache::builder()
        .redis(url.as_str())
        .flavor(unique_flavor("r10-old-auth"))
        .read_failures(FailurePolicy::Propagate)
        .build()
        .unwrap();
    let r = cache.get::<u32>("k");
    assert!(matches!(r, Ok(None)), "newcache: {r:?}");
    let cache = Cache::builder()
        .redis(url.replace("/0", "/3").as_str())
        .flavor(unique_flavor("r10-old-auth"))
        .read_failures(FailurePolicy::Propagate)
        .build_async()
        .unwrap();
    let r = runtime().block_on(cache.get::<u32>("k"));
    assert!(matches!(r, Ok(None)), "newcache async, database 3: {r:?}");
    let wrong = Cache::builder()
        .redis(url.replace(":pw@", ":nope@").as_str())
        .flavor(unique_flavor("r10-old-auth"))
        .read_failures(FailurePolicy::Propagate)
        .build()
        .unwrap();
    let e = wrong.get::<u32>("k").unwrap_err();
    assert!(
        e.is_denied() && e.to_string().contains("invalid password"),
        "{e}"
    );
}

/// A cluster node at `maxclients` says `-ERR max number of clients + cluster connections
/// reached` (Redis 7 and Valkey, `server.cluster_enabled`), which `at_maxclients` does not
/// match (`starts_with("max number of clients reached")`). One node with every slot, behind a
/// password (RESP2): the refusal comes as AUTH's reply.
#[test]
fn a_delete_a_cluster_node_refused_at_maxclients_behind_a_password_is_replayed() {
    let password = |server: &RedisServer| server.url().replace("redis://", "redis://:pw@");
    let (server, mut a, conf) = one_node_cluster("r10-nodes", &["--requirepass", "pw"], password);
    let url = password(&server);
    let rt = runtime();
    let mut bad = Vec::new();
    for cluster in [false, true] {
        let flavor = unique_flavor("r10-cl-maxclients");
        let build = || {
            let b = Cache::builder();
            let b = if cluster {
                b.redis_cluster(vec![url.clone()])
            } else {
                b.redis(url.as_str())
            };
            // A refused connect is a fault: the node may be marked dead, and is probed again
            // after retry_interval.
            b.flavor(flavor.as_str())
                .retry_interval(MS(100))
                .read_failures(FailurePolicy::Propagate)
                .write_failures(FailurePolicy::Propagate)
        };
        for sync in [true, false] {
            let key = format!("k-{sync}");
            build().build().unwrap().set(&key, &1u32, S(600)).unwrap();
            std::thread::sleep(MS(200));
            // A cluster cache knows its map before it can name a node for a missed delete
            // (one whose first call is refused at maxclients has none: the delete fails, and
            // is not queued anywhere): it reads first, then its connections are closed.
            let warm = |a: &mut redis::Connection| {
                if cluster {
                    let () = redis::cmd("CLIENT")
                        .arg(&["KILL", "TYPE", "normal", "SKIPME", "yes"])
                        .query(a)
                        .map(|_: i64| ())
                        .unwrap();
                    std::thread::sleep(MS(200));
                }
            };
            let (e, after) = if sync {
                let cache = build().build().unwrap();
                if cluster {
                    assert_eq!(cache.get::<u32>(&key).unwrap(), Some(1));
                }
                warm(&mut a);
                maxclients(&mut a, 1);
                let e = cache.delete(&key).unwrap_err();
                maxclients(&mut a, 10_000);
                let mut after = cache.get::<u32>(&key);
                for _ in 0..50 {
                    match &after {
                        Err(e) if e.to_string().contains("marked dead") => {
                            std::thread::sleep(MS(100));
                            after = cache.get::<u32>(&key);
                        }
                        _ => break,
                    }
                }
                (e, after)
            } else {
                let cache = build().build_async().unwrap();
                rt.block_on(async {
                    if cluster {
                        assert_eq!(cache.get::<u32>(&key).await.unwrap(), Some(1));
                    }
                    warm(&mut a);
                    maxclients(&mut a, 1);
                    let e = cache.delete(&key).await.unwrap_err();
                    maxclients(&mut a, 10_000);
                    let mut after = cache.get::<u32>(&key).await;
                    for _ in 0..50 {
                        match &after {
                            Err(e) if e.to_string().contains("marked dead") => {
                                tokio::time::sleep(MS(100)).await;
                                after = cache.get::<u32>(&key).await;
                            }
                            _ => break,
                        }
                    }
                    (e, after)
                })
            };
            eprintln!(
                "cluster backend {cluster} sync {sync}: delete: {e} (denied {})\n      get \
                 after: {after:?}",
                e.is_denied()
            );
            if e.is_denied() || !matches!(after, Ok(None)) {
                bad.push(format!(
                    "cluster backend {cluster} sync {sync}: {e} / {after:?}"
                ));
            }
        }
    }
    let _ = std::fs::remove_file(&conf);
    assert!(bad.is_empty(), "{bad:#?}");
}

/// The same cluster-enabled node, no password (CLIENT INFO's reply) and RESP3 with a password
/// (HELLO's reply), single-server backend, sync.
#[test]
fn a_delete_a_cluster_node_refused_at_maxclients_is_replayed_without_a_password_and_with_resp3() {
    let (server, mut a, conf) = one_node_cluster("r10-nodes2", &[], RedisServer::url);
    let mut bad = Vec::new();
    for (name, url) in [
        ("no password", server.url()),
        ("resp3", format!("{}?protocol=resp3", server.url())),
    ] {
        let flavor = unique_flavor("r10-cl2");
        let build = || {
            Cache::builder()
                .redis(url.as_str())
                .flavor(flavor.as_str())
                .read_failures(FailurePolicy::Propagate)
                .write_failures(FailurePolicy::Propagate)
        };
        build().build().unwrap().set("k", &1u32, S(600)).unwrap();
        std::thread::sleep(MS(200));
        maxclients(&mut a, 1);
        let cache = build().build().unwrap();
        let e = cache.delete("k").unwrap_err();
        maxclients(&mut a, 10_000);
        let after = cache.get::<u32>("k");
        eprintln!(
            "{name}: delete: {e} (denied {})\n      get after: {after:?}",
            e.is_denied()
        );
        if e.is_denied() || !matches!(after, Ok(None)) {
            bad.push(format!("{name}: {e} / {after:?}"));
        }
    }
    let _ = std::fs::remove_file(&conf);
    assert!(bad.is_empty(), "{bad:#?}");
}
