//! The sync API inside a tokio application: called through `spawn_blocking`, as a web handler
//! would until the async API lands. Same guarantees: one load for a herd of tasks.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::fixture::{Env, Kind};

fn herd_of_tasks_loads_once(kind: Kind) {
    let env = Env::new(kind, "tokio-herd");
    let cache = env.cache();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let got: Vec<String> = rt.block_on(async {
        let tasks: Vec<_> = (0..16)
            .map(|_| {
                let (cache, calls) = (cache.clone(), calls.clone());
                tokio::task::spawn_blocking(move || {
                    cache.get_or_set_with("k", Duration::from_secs(60), || {
                        calls.fetch_add(1, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(50));
                        Ok::<_, std::io::Error>("v".to_string())
                    })
                })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap().unwrap());
        }
        out
    });
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert!(got.iter().all(|v| v == "v"));
}

#[test]
fn spawn_blocking_on_memory() {
    herd_of_tasks_loads_once(Kind::Memory);
}

#[test]
fn spawn_blocking_on_memcached() {
    herd_of_tasks_loads_once(Kind::Memcached);
}
