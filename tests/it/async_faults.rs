//! Failures as the async front end reports them, beside the sync one: the same kinds, and
//! errors only on the keys whose server failed.

use std::time::Duration;

use newcache::{Cache, Ttl};

use crate::fixture::Memcached;

/// An `incr` sent to a server that stopped answering: both front ends say the outcome is
/// unknown (the counter may have moved; do not retry blindly).
#[test]
fn a_timed_out_incr_is_outcome_unknown_on_both_front_ends() {
    let server = Memcached::start();
    let addr = server.addr();
    let builder = || {
        Cache::builder()
            .memcached([addr.as_str()])
            .io_timeout(Duration::from_millis(300))
    };
    let sync = builder().build().unwrap();
    sync.set_counter("c", 5, Ttl::Never).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let asynch = builder().build_async().unwrap();
    rt.block_on(async { asynch.get_counter("c").await.unwrap() });
    server.signal("STOP");
    let a = rt.block_on(asynch.incr("c", 1)).unwrap_err();
    let s = sync.incr("c", 1).unwrap_err();
    server.signal("CONT");
    eprintln!(
        "async: {a} (timeout {}, unknown {})",
        a.is_timeout(),
        a.is_outcome_unknown()
    );
    eprintln!(
        "sync:  {s} (timeout {}, unknown {})",
        s.is_timeout(),
        s.is_outcome_unknown()
    );
    assert!(a.is_outcome_unknown());
    assert_eq!(
        s.is_outcome_unknown(),
        a.is_outcome_unknown(),
        "the same failure, reported differently"
    );
}

/// Compiled, not run: every AsyncCache future is Send, including with a loader that borrows.
#[allow(dead_code)]
fn every_future_is_send(c: newcache::AsyncCache) {
    use std::collections::HashMap;
    fn is_send<T: Send>(_: T) {}
    let s = Duration::from_secs(60);
    is_send(
        c.get_many_or_set_with(&["a"], s, |_m: Vec<String>| async move {
            Ok::<HashMap<String, u32>, std::io::Error>(HashMap::new())
        }),
    );
    is_send(c.clear());
    is_send(c.shutdown());
    is_send(c.incr("a", 1));
    is_send(c.get_counter("a"));
    is_send(c.set_with("a", &1u32, s, newcache::Herd::Off));
    let db = String::from("pool");
    is_send(c.get_or_set_with("k", s, || async { Ok::<_, std::io::Error>(db.len()) }));
    is_send(c.get_or_set_with_background("k", s, || async { Ok::<_, std::io::Error>(1u32) }));
    is_send(c.touch("k", s));
    is_send(c.set_counter("c", 1, s));
    is_send(c.decr("c", 1));
    is_send(c.get_many::<u32>(&["a"]));
    is_send(c.delete_many(&["a"]));
    is_send(c.set_many([("a", &1u32)], s));
}

/// get_many_or_set_with in a spawned task (an axum handler's future must be Send too).
#[tokio::test]
async fn get_many_or_set_with_in_a_spawned_task() {
    use std::collections::HashMap;
    let c = Cache::builder().in_memory().build_async().unwrap();
    let h = tokio::spawn(async move {
        c.get_many_or_set_with(
            &["a", "b"],
            Duration::from_secs(60),
            |missing: Vec<String>| async move {
                Ok::<_, std::io::Error>(
                    missing
                        .into_iter()
                        .map(|k| (k, 1u32))
                        .collect::<HashMap<_, _>>(),
                )
            },
        )
        .await
    });
    assert_eq!(h.await.unwrap().unwrap().len(), 2);
}

/// twemproxy in front of two memcached, one of them down (auto_eject_hosts off): twemproxy
/// answers that server's keys with `SERVER_ERROR Connection refused` and stays in step. Only
/// those keys fail: the pipelined connection stays up, and writes to the live server that
/// share it succeed.
#[test]
fn a_server_error_for_one_key_fails_only_that_key() {
    use std::process::{Command, Stdio};
    let (a, mut b) = (Memcached::start(), Memcached::start());
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = std::env::temp_dir().join(format!("newcache-async-faults-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let conf = dir.join("nutcracker.yml");
    std::fs::write(
        &conf,
        format!(
            "p:\n  listen: 127.0.0.1:{port}\n  hash: fnv1a_64\n  distribution: ketama\n  \
             auto_eject_hosts: false\n  timeout: 2000\n  servers:\n   - {}:1\n   - {}:1\n",
            a.addr(),
            b.addr()
        ),
    )
    .unwrap();
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let stats_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let _proxy = Kill(
        Command::new("nutcracker")
            .args(["-c", conf.to_str().unwrap(), "-a", "127.0.0.1", "-s"])
            .arg(stats_port.to_string())
            .arg("-o")
            .arg(dir.join("log"))
            .arg("-p")
            .arg(dir.join("pid"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nutcracker"),
    );
    let t = std::time::Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "nutcracker did not come up"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let addr = format!("127.0.0.1:{port}");
    let direct_b = Cache::builder()
        .memcached([b.addr().as_str()])
        .build()
        .unwrap();
    let sync = Cache::builder().memcached([addr.as_str()]).build().unwrap();
    // A key on each server.
    let (mut on_a, mut on_b) = (None, None);
    for i in 0..100 {
        let k = format!("k{i}");
        sync.set(&k, &1u32, Ttl::Never).unwrap();
        if direct_b.get::<u32>(&k).unwrap().is_some() {
            on_b.get_or_insert(k);
        } else {
            on_a.get_or_insert(k);
        }
    }
    let (on_a, on_b) = (on_a.unwrap(), on_b.unwrap());
    b.kill();
    let e = sync.get::<u32>(&on_b);
    eprintln!(
        "sync get of a key on the dead server (absorbed): {e:?}; stats {:?}",
        sync.stats().backend_errors
    );
    sync.set(&on_a, &2u32, Ttl::Never)
        .expect("sync: a write to the live server");

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let cache = Cache::builder()
        .memcached([addr.as_str()])
        .async_connections(1)
        .build_async()
        .unwrap();
    let mut collateral = 0;
    rt.block_on(async {
        for _ in 0..20 {
            let (dead, live) =
                tokio::join!(cache.get::<u32>(&on_b), cache.set(&on_a, &3u32, Ttl::Never));
            assert!(matches!(dead, Ok(None)), "absorbed: {dead:?}");
            if let Err(e) = live {
                eprintln!(
                    "a write to the live server failed: {e} (unknown {})",
                    e.is_outcome_unknown()
                );
                collateral += 1;
            }
        }
    });
    assert_eq!(
        collateral, 0,
        "writes to the live server failed for another key's SERVER_ERROR"
    );
}
