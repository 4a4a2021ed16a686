//! The engine against real memcached processes: round trips, pipelining and merging under load,
//! cancellation, faults (stopped, killed, restarted servers), runtime handoff, bad input.

use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::conn::{HOLD, ROUND};
use super::*;
use crate::backend::memcached::ServerSpec;
use crate::backend::{DEFAULT_ITEM_SIZE, StoreMode};

/// What the engine did, per server (test builds only).
#[derive(Debug, Default)]
pub(super) struct Counters {
    /// `gets` lines written.
    lines: AtomicU64,
    /// Get ops answered by those lines (several per line when merged).
    gets: AtomicU64,
    /// Writes (the writer's `write_all` calls and direct writes).
    writes: AtomicU64,
    /// Ops a caller wrote directly (an idle connection's direct path).
    direct: AtomicU64,
    /// Direct writes the socket took only in part (their rest queued for the writer).
    rests: AtomicU64,
    /// Connection attempts.
    connects: AtomicU64,
    /// Get answers parsed after their caller had given up.
    orphans: AtomicU64,
    /// Connections that died.
    poisonings: AtomicU64,
    /// Bytes the readers read.
    read: AtomicU64,
    /// The most keys and commands in flight on a connection once a round was counted.
    peak: AtomicU64,
    /// The writer's rounds written with two or more keys and commands in flight (theirs
    /// included).
    overlapped: AtomicU64,
}

impl Counters {
    pub(super) fn note_line(&self, gets: usize) {
        self.lines.fetch_add(1, Ordering::Relaxed);
        self.gets.fetch_add(gets as u64, Ordering::Relaxed);
    }
    pub(super) fn note_write(&self) {
        self.writes.fetch_add(1, Ordering::Relaxed);
    }
    pub(super) fn note_direct(&self) {
        self.direct.fetch_add(1, Ordering::Relaxed);
    }
    pub(super) fn note_rest(&self) {
        self.rests.fetch_add(1, Ordering::Relaxed);
    }
    pub(super) fn note_connect(&self) {
        self.connects.fetch_add(1, Ordering::Relaxed);
    }
    pub(super) fn note_read(&self, n: usize) {
        self.read.fetch_add(n as u64, Ordering::Relaxed);
    }
    pub(super) fn note_poison(&self) {
        self.poisonings.fetch_add(1, Ordering::Relaxed);
    }
    pub(super) fn note_orphans(&self, n: usize) {
        self.orphans.fetch_add(n as u64, Ordering::Relaxed);
    }
    pub(super) fn note_in_flight(&self, n: usize) {
        self.peak.fetch_max(n as u64, Ordering::Relaxed);
        if n >= 2 {
            self.overlapped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Engine {
    fn lines(&self) -> u64 {
        self.sum(|c| &c.lines)
    }
    fn gets(&self) -> u64 {
        self.sum(|c| &c.gets)
    }
    fn writes(&self) -> u64 {
        self.sum(|c| &c.writes)
    }
    fn direct(&self) -> u64 {
        self.sum(|c| &c.direct)
    }
    fn rests(&self) -> u64 {
        self.sum(|c| &c.rests)
    }
    fn orphans(&self) -> u64 {
        self.sum(|c| &c.orphans)
    }
    fn read(&self) -> u64 {
        self.sum(|c| &c.read)
    }
    /// Connections that died (for the sync backend's tests too).
    pub(crate) fn poisonings(&self) -> u64 {
        self.sum(|c| &c.poisonings)
    }
    fn overlapped(&self) -> u64 {
        self.sum(|c| &c.overlapped)
    }
    fn peak(&self) -> u64 {
        self.servers
            .iter()
            .map(|s| s.counters.peak.load(Ordering::Relaxed))
            .max()
            .unwrap_or(0)
    }
    fn connects(&self, server: usize) -> u64 {
        self.servers[server]
            .counters
            .connects
            .load(Ordering::Relaxed)
    }
    fn sum(&self, f: impl Fn(&Counters) -> &AtomicU64) -> u64 {
        self.servers
            .iter()
            .map(|s| f(&s.counters).load(Ordering::Relaxed))
            .sum()
    }
}

/// A memcached process on 127.0.0.1:port, killed on drop (a small copy of the integration
/// fixture, which a unit test cannot import).
pub(crate) struct Memcached {
    port: u16,
    child: Option<Child>,
}

impl Memcached {
    pub(crate) fn start() -> Memcached {
        Memcached::start_with(&[])
    }

    /// Starts one with `extra` arguments.
    fn start_with(extra: &[&str]) -> Memcached {
        for _ in 0..5 {
            let port = TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map(|a| a.port())
                .expect("a free port");
            if let Some(m) = Memcached::try_start(port, extra) {
                return m;
            }
        }
        panic!("memcached did not start on any of 5 free ports");
    }

    /// Starts memcached on `port`; `None` if it exited (port taken) or another process answers.
    fn try_start(port: u16, extra: &[&str]) -> Option<Memcached> {
        let mut cmd = Command::new("memcached");
        cmd.args(["-l", "127.0.0.1", "-p", &port.to_string()])
            .args(["-U", "0", "-t", "2", "-m", "64"])
            .args(extra);
        let root = Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|o| o.stdout.starts_with(b"0\n"));
        if root {
            cmd.args(["-u", "root"]);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("memcached is installed");
        let mut m = Memcached {
            port,
            child: Some(child),
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(Ok(Some(_))) = m.child.as_mut().map(Child::try_wait) {
                m.child = None;
                return None;
            }
            if let Some(pid) = server_pid(port) {
                return (pid == m.pid()).then_some(m);
            }
            assert!(Instant::now() < deadline, "memcached did not come up");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub(crate) fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kills it and starts a new one on the same port.
    fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(mut m) = Memcached::try_start(self.port, &[]) {
                self.child = m.child.take();
                return;
            }
            assert!(Instant::now() < deadline, "could not take the port again");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `kill -STOP` / `kill -CONT`, then waits until every thread is (no longer) stopped.
    pub(crate) fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{sig}"), &self.pid().to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -{sig}");
        let stopped = || {
            std::fs::read_dir(format!("/proc/{}/task", self.pid()))
                .map(|tasks| {
                    tasks.flatten().all(|t| {
                        std::fs::read_to_string(t.path().join("stat"))
                            .ok()
                            .and_then(|s| s.rsplit_once(") ").map(|(_, r)| r.starts_with('T')))
                            .unwrap_or(false)
                    })
                })
                .unwrap_or(false)
        };
        let deadline = Instant::now() + Duration::from_secs(2);
        while stopped() != (sig == "STOP") {
            assert!(Instant::now() < deadline, "memcached did not take SIG{sig}");
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Drop for Memcached {
    fn drop(&mut self) {
        if let Some(c) = &self.child {
            // A stopped process must be continued to die promptly.
            let _ = Command::new("kill")
                .args(["-CONT", &c.id().to_string()])
                .status();
        }
        self.kill();
    }
}

/// The pid the memcached on `port` reports (`stats`), if one answers.
fn server_pid(port: u16) -> Option<u32> {
    use std::io::{BufRead, BufReader, Write as _};
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    s.write_all(b"stats\r\n").ok()?;
    let mut r = BufReader::new(s);
    let mut line = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line).ok()? == 0 || line.starts_with("END") {
            return None;
        }
        if let Some(pid) = line.strip_prefix("STAT pid ") {
            return pid.trim().parse().ok();
        }
    }
}

// The integration tests' relay, one file for both.
#[path = "../../../../tests/it/relay.rs"]
mod relay;
pub(crate) use relay::Relay;

pub(crate) fn config(addrs: &[String], tune: impl FnOnce(&mut MemcachedConfig)) -> MemcachedConfig {
    let specs = addrs
        .iter()
        .map(|a| ServerSpec::parse(a).unwrap())
        .collect();
    let mut c = MemcachedConfig::new(specs);
    tune(&mut c);
    c
}

fn engine(addrs: &[String], conns: usize, tune: impl FnOnce(&mut MemcachedConfig)) -> Engine {
    Engine::new(&config(addrs, tune), conns).unwrap()
}

fn set<'a>(key: &'a str, value: &'a [u8]) -> Write<'a> {
    write(StoreMode::Set, key, value)
}

fn write<'a>(mode: StoreMode, key: &'a str, value: &'a [u8]) -> Write<'a> {
    Write {
        mode,
        key,
        value,
        flags: 7,
        exptime: 0,
    }
}

/// A self-identifying value: names its key, padded to about 100 bytes.
fn value_of(key: &str) -> Vec<u8> {
    format!(
        "value-of-{key}-{}",
        ".".repeat(100usize.saturating_sub(key.len() + 10))
    )
    .into_bytes()
}

fn value(r: &Result<Option<Item>>) -> Option<&[u8]> {
    r.as_ref().ok()?.as_ref().map(|i| &i.value[..])
}

/// xorshift64*: a seeded per-task random stream.
struct Rand(u64);

impl Rand {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) as usize % n
    }
}

/// Stores `n` self-identifying keys under `prefix`.
async fn populate(e: &Engine, prefix: &str, n: usize) -> Vec<String> {
    let keys: Vec<String> = (0..n).map(|i| format!("{prefix}:{i}")).collect();
    let values: Vec<Vec<u8>> = keys.iter().map(|k| value_of(k)).collect();
    let writes: Vec<Write<'_>> = keys.iter().zip(&values).map(|(k, v)| set(k, v)).collect();
    for r in e.store_many(&writes).await {
        assert_eq!(r.unwrap(), StoreOutcome::Stored);
    }
    keys
}

/// `tasks` tasks, each making `gets` gets one after another (keys `{prefix}:{task}:{i}`).
async fn gets_from_tasks(e: &Arc<Engine>, tasks: usize, gets: usize, prefix: &'static str) {
    let tasks: Vec<_> = (0..tasks)
        .map(|t| {
            let e = e.clone();
            tokio::spawn(async move {
                for i in 0..gets {
                    e.get(&format!("{prefix}:{t}:{i}")).await.unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
}

/// The answers that were not the asker's own value, counted across tasks.
#[derive(Default)]
struct Tally {
    wrong: AtomicUsize,
    missing: AtomicUsize,
}

impl Tally {
    fn check(&self, k: &str, r: &Result<Option<Item>>) {
        match value(r) {
            Some(v) if v == value_of(k) => {}
            Some(_) => {
                self.wrong.fetch_add(1, Ordering::Relaxed);
            }
            None => {
                self.missing.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    #[track_caller]
    fn none_wrong_or_missing(&self, when: &str) {
        let wrong = self.wrong.load(Ordering::Relaxed);
        assert_eq!(wrong, 0, "wrong values{when}");
        assert_eq!(self.missing.load(Ordering::Relaxed), 0, "misses{when}");
    }
}

/// Every key of `keys` holds its own value, read back in one batch.
async fn each_holds_its_own(e: &Engine, keys: &[String]) {
    let ks: Vec<&str> = keys.iter().map(String::as_str).collect();
    for (k, r) in ks.iter().zip(e.get_many(&ks).await) {
        assert_eq!(value(&r), Some(&value_of(k)[..]), "after");
    }
}

#[tokio::test]
async fn round_trips_of_every_method() {
    use StoreMode::{Add, Cas};
    let mc = Memcached::start();
    let e = engine(&[mc.addr()], 2, |_| {});
    assert_eq!(e.get("rt:a").await.unwrap(), None);
    assert_eq!(
        e.store(set("rt:a", b"1")).await.unwrap(),
        StoreOutcome::Stored
    );
    let item = e.get("rt:a").await.unwrap().unwrap();
    assert_eq!((&item.value[..], item.flags), (&b"1"[..], 7));
    let add = e.store(write(Add, "rt:a", b"2")).await.unwrap();
    assert_eq!(add, StoreOutcome::NotStored);
    let cas = e.store(write(Cas(item.cas), "rt:a", b"3")).await.unwrap();
    assert_eq!(cas, StoreOutcome::Stored);
    let stale = e.store(write(Cas(item.cas), "rt:a", b"4")).await.unwrap();
    assert_eq!(stale, StoreOutcome::Exists);
    let gone = e.store(write(Cas(1), "rt:none", b"4")).await.unwrap();
    assert_eq!(gone, StoreOutcome::NotFound);

    let (o, back) = e.store_then_get(set("rt:b", b"bee")).await.unwrap();
    let back = back.unwrap();
    assert_eq!((o, &back.value[..]), (StoreOutcome::Stored, &b"bee"[..]));
    assert_ne!(back.cas, 0);
    let (o, again) = e.store_then_get(write(Add, "rt:b", b"x")).await.unwrap();
    assert_eq!(o, StoreOutcome::NotStored);
    assert_eq!(again.unwrap(), back, "the read-back shows what is there");

    let got = e
        .get_many(&["rt:a", "rt:none", "rt:b", "rt:a", "bad key"])
        .await;
    assert_eq!(value(&got[0]), Some(&b"3"[..]));
    assert!(matches!(got[1], Ok(None)));
    assert_eq!(value(&got[2]), Some(&b"bee"[..]));
    assert_eq!(
        value(&got[3]),
        Some(&b"3"[..]),
        "a duplicate gets its own copy"
    );
    assert!(got[4].as_ref().unwrap_err().is_invalid_key());

    let big = vec![0u8; DEFAULT_ITEM_SIZE];
    let stored = e
        .store_many(&[
            set("rt:c1", b"c"),
            write(Add, "rt:a", b"x"),
            set("rt:big", &big),
            set("rt:c2", b"c"),
        ])
        .await;
    assert_eq!(stored[0].as_ref().unwrap(), &StoreOutcome::Stored);
    assert_eq!(stored[1].as_ref().unwrap(), &StoreOutcome::NotStored);
    assert!(stored[2].as_ref().unwrap_err().is_too_large());
    assert_eq!(stored[3].as_ref().unwrap(), &StoreOutcome::Stored);

    assert!(e.delete("rt:c1").await.unwrap());
    assert!(!e.delete("rt:c1").await.unwrap());
    let deleted: Vec<bool> = e
        .delete_many(&["rt:c2", "rt:c2", "rt:nope"])
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(deleted, [true, false, false], "in order on one connection");

    assert!(e.touch("rt:a", 100).await.unwrap());
    assert!(!e.touch("rt:nope", 100).await.unwrap());

    assert_eq!(e.incr("rt:n", 1).await.unwrap(), None);
    e.store(set("rt:n", b"10")).await.unwrap();
    assert_eq!(e.incr("rt:n", 5).await.unwrap(), Some(15));
    assert_eq!(e.decr("rt:n", 20).await.unwrap(), Some(0));
    let err = e.incr("rt:b", 1).await.unwrap_err();
    assert!(err.is_not_a_counter(), "{err}");
    assert_eq!(
        value(&e.get("rt:a").await),
        Some(&b"3"[..]),
        "still in step"
    );

    e.flush_all().await.unwrap();
    assert_eq!(e.get("rt:a").await.unwrap(), None);
    assert_eq!(e.max_value_size("k"), DEFAULT_ITEM_SIZE - 1 - 64);
    e.shutdown().await;
    assert_eq!(e.get("rt:a").await.unwrap(), None, "works after shutdown");
}

/// Tests 2 and 3: many tasks, random gets and get_manys over pipelined, merged connections:
/// every answer is the asker's own, and gets were merged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_gets_under_load_get_their_own_values() {
    let mc = Memcached::start();
    let e = Arc::new(engine(&[mc.addr()], 2, |_| {}));
    let keys = Arc::new(populate(&e, "st", 1000).await);
    let (lines0, gets0) = (e.lines(), e.gets());
    let (tally, ops) = (Arc::new(Tally::default()), Arc::new(AtomicUsize::new(0)));
    let tasks: Vec<_> = (0..256u64)
        .map(|t| {
            let (e, keys, tally, ops) = (e.clone(), keys.clone(), tally.clone(), ops.clone());
            tokio::spawn(async move {
                let mut rng = Rand(t * 7919 + 1);
                let check = |k: &str, r: &Result<Option<Item>>| tally.check(k, r);
                for _ in 0..100 {
                    if rng.below(4) == 0 {
                        let n = 1 + rng.below(20);
                        let ks: Vec<&str> = (0..n)
                            .map(|_| keys[rng.below(keys.len())].as_str())
                            .collect();
                        for (k, r) in ks.iter().zip(e.get_many(&ks).await) {
                            check(k, &r);
                        }
                    } else {
                        let k = &keys[rng.below(keys.len())];
                        check(k, &e.get(k).await);
                    }
                    ops.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(ops.load(Ordering::Relaxed), 25_600);
    tally.none_wrong_or_missing("");
    let (lines, gets) = (e.lines() - lines0, e.gets() - gets0);
    eprintln!("{gets} get ops in {lines} gets lines");
    assert!(lines * 2 < gets, "{gets} get ops in {lines} lines: merging");
}

/// Deterministic: gets queued while the writer has not run yet share lines.
#[tokio::test]
async fn concurrent_gets_are_merged_into_few_lines() {
    let mc = Memcached::start();
    let e = Arc::new(engine(&[mc.addr()], 1, |_| {}));
    let keys = populate(&e, "mg", 50).await;
    let (lines0, gets0, writes0) = (e.lines(), e.gets(), e.writes());
    // Spawned tasks run in order on this single thread: all 300 queue their get before the
    // writer (woken by the first) runs.
    let tasks: Vec<_> = (0..300)
        .map(|i| {
            let (e, k) = (e.clone(), keys[i % keys.len()].clone());
            tokio::spawn(async move { value(&e.get(&k).await) == Some(&value_of(&k)[..]) })
        })
        .collect();
    for t in tasks {
        assert!(t.await.unwrap(), "a wrong value");
    }
    let (lines, gets, writes) = (e.lines() - lines0, e.gets() - gets0, e.writes() - writes0);
    eprintln!("{gets} gets in {lines} lines, {writes} writes");
    assert_eq!(gets, 300);
    assert!(lines <= 30, "{gets} gets took {lines} lines");
}

/// 10,000 cancelled calls under load never give anyone a wrong value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancellations_never_cross_replies() {
    let mc = Memcached::start();
    let e = Arc::new(engine(&[mc.addr()], 2, |_| {}));
    let keys = Arc::new(populate(&e, "cx", 1000).await);
    let cancelled = Arc::new(AtomicUsize::new(0));
    let tally = Arc::new(Tally::default());
    let tasks: Vec<_> = (0..256u64)
        .map(|t| {
            let (e, keys, cancelled) = (e.clone(), keys.clone(), cancelled.clone());
            let tally = tally.clone();
            tokio::spawn(async move {
                let mut rng = Rand(t * 104_729 + 3);
                let check = |k: &str, r: &Result<Option<Item>>| tally.check(k, r);
                // Cap the rounds, in case cancellations are rare on some machine.
                for _ in 0..2000 {
                    if cancelled.load(Ordering::Relaxed) >= 10_000 {
                        break;
                    }
                    let yields = rng.below(6);
                    let give_up = async {
                        for _ in 0..yields {
                            tokio::task::yield_now().await;
                        }
                    };
                    let k = keys[rng.below(keys.len())].clone();
                    match rng.below(4) {
                        0 => {
                            let ks: Vec<&str> = (0..1 + rng.below(10))
                                .map(|_| keys[rng.below(keys.len())].as_str())
                                .collect();
                            tokio::select! {
                                got = e.get_many(&ks) => {
                                    ks.iter().zip(&got).for_each(|(k, r)| check(k, r));
                                }
                                () = give_up => { cancelled.fetch_add(1, Ordering::Relaxed); }
                            }
                        }
                        1 => {
                            // A write of the same self-identifying value: applied or not, the
                            // key still names itself.
                            let v = value_of(&k);
                            tokio::select! {
                                r = e.store(set(&k, &v)) => { r.unwrap(); }
                                () = give_up => { cancelled.fetch_add(1, Ordering::Relaxed); }
                            }
                        }
                        _ => {
                            tokio::select! {
                                r = e.get(&k) => check(&k, &r),
                                () = give_up => { cancelled.fetch_add(1, Ordering::Relaxed); }
                            }
                        }
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let n = cancelled.load(Ordering::Relaxed);
    eprintln!("{n} cancellations");
    assert!(n >= 10_000, "only {n} cancellations");
    tally.none_wrong_or_missing(" during");
    each_holds_its_own(&e, &keys).await;
}

/// A get dropped after it was written, its large reply not yet read: the next ops on
/// that connection get their own replies.
#[tokio::test]
async fn a_get_dropped_mid_reply_leaves_the_connection_in_step() {
    let mc = Memcached::start();
    let e = engine(&[mc.addr()], 1, |_| {});
    let big = vec![b'B'; 900 * 1024];
    e.store(set("dm:big", &big)).await.unwrap();
    let keys = populate(&e, "dm", 20).await;
    for (i, k) in keys.iter().enumerate() {
        let written = e.writes();
        let mut get = e.get("dm:big");
        // One poll queues it (no reply can be there yet).
        let queued = tokio::select! {
            biased;
            _ = &mut get => false,
            () = std::future::ready(()) => true,
        };
        assert!(queued);
        // Drop it once it was written, after 0 to 4 more turns: some drops land before its
        // reply, some in the middle of it (900 KiB take several reads).
        while e.writes() == written {
            tokio::task::yield_now().await;
        }
        for _ in 0..i % 5 {
            tokio::task::yield_now().await;
        }
        drop(get);
        assert_eq!(value(&e.get(k).await), Some(&value_of(k)[..]));
        let many = e.get_many(&[k.as_str(), "dm:big"]).await;
        assert_eq!(value(&many[0]), Some(&value_of(k)[..]));
        assert_eq!(value(&many[1]), Some(&big[..]));
    }
    // How many were dropped before their reply was whole varies; the scripted test below
    // makes sure of one dropped mid-reply.
    eprintln!(
        "{} of 20 big gets answered after their caller left",
        e.orphans()
    );
}

/// Deterministic: a server sends half of a large value and waits; the get is dropped
/// once the reader holds that half; the rest arrives, then the next get's reply: it is that
/// get's own.
#[tokio::test]
async fn a_get_dropped_mid_reply_is_skipped_whole() {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    const HALF: usize = 100_000;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let release = Arc::new(tokio::sync::Notify::new());
    let server = {
        let release = release.clone();
        tokio::spawn(async move {
            let (s, _) = listener.accept().await.unwrap();
            let (r, mut w) = s.into_split();
            let mut lines = tokio::io::BufReader::new(r).lines();
            while let Some(line) = lines.next_line().await.unwrap() {
                let Some(keys) = line.strip_prefix("gets ") else {
                    panic!("unexpected request {line:?}");
                };
                let mut out = Vec::new();
                for k in keys.split(' ') {
                    if k == "big" {
                        w.write_all(format!("VALUE big 0 {} 1\r\n", 2 * HALF).as_bytes())
                            .await
                            .unwrap();
                        w.write_all(&[b'B'; HALF]).await.unwrap();
                        release.notified().await;
                        out.extend_from_slice(&[b'B'; HALF]);
                        out.extend_from_slice(b"\r\n");
                    } else {
                        let v = value_of(k);
                        out.extend_from_slice(format!("VALUE {k} 0 {} 2\r\n", v.len()).as_bytes());
                        out.extend_from_slice(&v);
                        out.extend_from_slice(b"\r\n");
                    }
                }
                out.extend_from_slice(b"END\r\n");
                w.write_all(&out).await.unwrap();
            }
        })
    };
    let e = engine(&[addr], 1, |c| c.io_timeout = Duration::from_secs(20));
    let mut get = e.get("big");
    let queued = tokio::select! {
        biased;
        _ = &mut get => false,
        () = std::future::ready(()) => true,
    };
    assert!(queued);
    let t = Instant::now();
    while e.read() < HALF as u64 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the half never arrived"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    drop(get);
    let mut next = e.get("dh:1");
    let queued = tokio::select! {
        biased;
        _ = &mut next => false,
        () = std::future::ready(()) => true,
    };
    assert!(queued);
    release.notify_one();
    assert_eq!(value(&next.await), Some(&value_of("dh:1")[..]));
    assert_eq!(e.orphans(), 1, "the big reply was read whole and dropped");
    let many = e.get_many(&["dh:2", "dh:3", "dh:2"]).await;
    assert_eq!(value(&many[0]), Some(&value_of("dh:2")[..]));
    assert_eq!(value(&many[1]), Some(&value_of("dh:3")[..]));
    assert_eq!(value(&many[2]), Some(&value_of("dh:2")[..]));
    drop(e);
    server.await.unwrap();
}

/// Polls `f` once: whatever it does before its first await (submitting its op) is done.
/// Whether it is still pending (on a multi-thread runtime its reply may be there already).
async fn poll_once<F: std::future::Future + Unpin>(f: &mut F) -> bool {
    tokio::select! {
        biased;
        _ = f => false,
        () = std::future::ready(()) => true,
    }
}

/// The direct path's rule, step by step on one `Conn`: a caller writes directly only while
/// nothing is pending or in flight; an op queued earlier keeps the direct path shut until the
/// writer has written it, so a later op cannot overtake it.
#[tokio::test]
async fn the_direct_path_never_overtakes_a_queued_op() {
    use tokio::io::AsyncReadExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let e = engine(std::slice::from_ref(&addr), 1, |_| {});
    let server = &e.servers[0];
    let client = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let (mut peer, _) = listener.accept().await.unwrap();
    let (_rd, wr) = client.into_split();
    let (ops_tx, mut ops_rx) = mpsc::channel(QUEUE);
    let (batches_tx, mut batches_rx) = mpsc::channel(4);
    let conn = Conn::new();
    conn.open_for_test(batches_tx, wr);
    let get = |k: &str| {
        let (reply, rx) = oneshot::channel();
        (
            Op::Get {
                keys: smallvec::smallvec![k.to_owned()],
                reply,
            },
            rx,
        )
    };
    let wire = |peer: &mut tokio::net::TcpStream| {
        let mut buf = [0u8; 256];
        let n = peer.try_read(&mut buf).unwrap_or(0);
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };

    // Idle: written directly, its expectation with the reader first.
    let (op, _a) = get("a");
    conn.submit(&ops_tx, op, server).map_err(|_| ()).unwrap();
    assert!(batches_rx.try_recv().is_ok(), "expectation pushed");
    peer.readable().await.unwrap();
    assert_eq!(wire(&mut peer), "gets a\r\n");
    // A reply in flight: the next op is queued for the writer.
    let mut set = Vec::new();
    wire::encode_store(&mut set, &self::set("k", b"v"), 1 << 20).unwrap();
    let (reply, _s) = oneshot::channel();
    let cmd = Op::Cmd {
        bytes: set,
        parse: Parse::Store,
        reply,
    };
    conn.submit(&ops_tx, cmd, server).map_err(|_| ()).unwrap();
    // The reply arrives (nothing in flight) while the set is still queued: a get now must
    // queue behind the set, not be written before it.
    conn.answered_for_test();
    let (op, _b) = get("k");
    conn.submit(&ops_tx, op, server).map_err(|_| ()).unwrap();
    assert!(batches_rx.try_recv().is_err(), "nothing pushed directly");
    assert!(
        matches!(ops_rx.try_recv(), Ok(Op::Cmd { .. })),
        "the set first"
    );
    assert!(
        matches!(ops_rx.try_recv(), Ok(Op::Get { .. })),
        "then the get"
    );
    tokio::task::yield_now().await;
    assert_eq!(wire(&mut peer), "", "nothing written by the caller");
    // Once the writer has written both, the connection is idle again (what they weigh, given
    // back whole: more than they do).
    conn.written(2, (usize::MAX, usize::MAX));
    let (op, _c) = get("c");
    conn.submit(&ops_tx, op, server).map_err(|_| ()).unwrap();
    assert!(batches_rx.try_recv().is_ok());
    let mut buf = [0u8; 64];
    let n = peer.read(&mut buf).await.unwrap();
    assert_eq!(&buf[..n], b"gets c\r\n");
}

/// Read-your-writes across the direct path and the queue: a set that was submitted (polled
/// once) and then dropped or not yet awaited is seen by the caller's next get on the
/// connection, whichever way each went. Tasks come and go, so the connection is sometimes idle
/// (direct writes) and sometimes busy (queued, merged).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_after_a_submitted_set_sees_it() {
    let mc = Memcached::start();
    let e = Arc::new(engine(&[mc.addr()], 1, |_| {}));
    e.get("ryw:warm").await.unwrap();
    let (direct0, writes0) = (e.direct(), e.writes());
    let stale = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..6u64)
        .map(|t| {
            let (e, stale) = (e.clone(), stale.clone());
            tokio::spawn(async move {
                let mut rng = Rand(t * 31 + 7);
                let key = format!("ryw:{t}");
                for i in 0..400 {
                    let v = format!("{t}-{i}").into_bytes();
                    let mut store = Some(e.store(set(&key, &v)));
                    if let Some(s) = &mut store {
                        if !poll_once(s).await || rng.below(2) == 0 {
                            store = None;
                        }
                    }
                    // Now and then an idle gap, so that the next op finds the connection idle.
                    for _ in 0..rng.below(3) {
                        tokio::task::yield_now().await;
                    }
                    if value(&e.get(&key).await) != Some(&v[..]) {
                        stale.fetch_add(1, Ordering::Relaxed);
                    }
                    if let Some(store) = store {
                        // Finished after the get: it was written before the get regardless.
                        assert_eq!(store.await.unwrap(), StoreOutcome::Stored);
                    }
                    if rng.below(8) == 0 {
                        tokio::time::sleep(Duration::from_micros(200)).await;
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let (direct, writes) = (e.direct() - direct0, e.writes() - writes0);
    eprintln!("{direct} direct writes, {} by the writer", writes - direct);
    assert_eq!(
        stale.load(Ordering::Relaxed),
        0,
        "a get missed the set before it"
    );
    assert!(direct > 0, "the direct path was taken");
    assert!(writes > direct, "the writer wrote too");
}

/// A large set written directly on an idle connection whose server is not reading: the
/// socket takes part of it, the rest goes first in the queue; ops submitted meanwhile follow it
/// in order and get their own replies.
#[tokio::test]
async fn a_direct_write_taken_in_part_goes_on_in_order() {
    // Larger than a loopback socket's send buffer (up to 4 MiB) and the stopped server's
    // receive buffer together.
    let mc = Memcached::start_with(&["-I", "16m"]);
    let e = engine(&[mc.addr()], 1, |c| {
        c.io_timeout = Duration::from_secs(20);
        c.item_size = 16 << 20;
    });
    e.get("pw:warm").await.unwrap();
    let big = vec![b'B'; 12 << 20];
    let direct = e.direct();
    mc.signal("STOP");
    // On this thread, the connection's tasks run only once the test awaits.
    let mut store = e.store(set("pw:big", &big));
    assert!(poll_once(&mut store).await);
    assert_eq!(e.rests(), 1, "the socket took part of it");
    let mut get_big = e.get("pw:big");
    assert!(poll_once(&mut get_big).await);
    let mut store2 = e.store(set("pw:small", b"s"));
    assert!(poll_once(&mut store2).await);
    let mut get_small = e.get("pw:small");
    assert!(poll_once(&mut get_small).await);
    assert_eq!(
        e.direct() - direct,
        1,
        "the big set; the others were queued behind it"
    );
    mc.signal("CONT");
    assert_eq!(store.await.unwrap(), StoreOutcome::Stored);
    assert_eq!(value(&get_big.await), Some(&big[..]));
    assert_eq!(store2.await.unwrap(), StoreOutcome::Stored);
    assert_eq!(value(&get_small.await), Some(&b"s"[..]));
    assert_eq!(e.poisonings(), 0);
    assert_eq!(
        value(&e.get("pw:small").await),
        Some(&b"s"[..]),
        "still in step"
    );
}

/// A lone caller keeps the connection it used while that one is idle; busy connections share
/// the load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_caller_keeps_one_connection() {
    let mc = Memcached::start();
    let e = Arc::new(engine(&[mc.addr()], 2, |_| {}));
    for i in 0..100 {
        e.get(&format!("lc:{i}")).await.unwrap();
    }
    assert_eq!(e.connects(0), 1);
    // All but maybe the first (queued if it came before the connect).
    assert!(e.direct() >= 99, "{}", e.direct());
    gets_from_tasks(&e, 64, 20, "lc").await;
    assert_eq!(
        e.connects(0),
        2,
        "the busy connection's neighbour was opened"
    );
}

/// Few tasks, random ops, random cancellations, idle gaps: ops go direct and queued in every
/// interleaving, on both kinds of runtime; every answer is the asker's own.
async fn direct_and_queued_never_cross(e: Arc<Engine>, keys: Arc<Vec<String>>) -> (u64, usize) {
    let direct0 = e.direct();
    let (wrong, cancelled) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let tasks: Vec<_> = (0..4u64)
        .map(|t| {
            let (e, keys) = (e.clone(), keys.clone());
            let (wrong, cancelled) = (wrong.clone(), cancelled.clone());
            tokio::spawn(async move {
                let mut rng = Rand(t * 7717 + 5);
                let check = |k: &str, r: &Result<Option<Item>>| {
                    if value(r) != Some(&value_of(k)[..]) {
                        wrong.fetch_add(1, Ordering::Relaxed);
                    }
                };
                for _ in 0..1500 {
                    let yields = rng.below(4);
                    let give_up = async {
                        for _ in 0..yields {
                            tokio::task::yield_now().await;
                        }
                    };
                    let k = keys[rng.below(keys.len())].clone();
                    let v = value_of(&k);
                    let cancel = rng.below(3) == 0;
                    let gave_up = match rng.below(5) {
                        0 => {
                            let ks: Vec<&str> = (0..1 + rng.below(6))
                                .map(|_| keys[rng.below(keys.len())].as_str())
                                .collect();
                            let got = e.get_many(&ks);
                            if cancel {
                                tokio::select! {
                                    got = got => { ks.iter().zip(&got).for_each(|(k, r)| check(k, r)); false }
                                    () = give_up => true,
                                }
                            } else {
                                ks.iter().zip(&got.await).for_each(|(k, r)| check(k, r));
                                false
                            }
                        }
                        1 => {
                            let w = e.store(set(&k, &v));
                            if cancel {
                                tokio::select! {
                                    r = w => { r.unwrap(); false }
                                    () = give_up => true,
                                }
                            } else {
                                w.await.unwrap();
                                false
                            }
                        }
                        2 => {
                            let (o, item) = e.store_then_get(set(&k, &v)).await.unwrap();
                            assert_eq!(o, StoreOutcome::Stored);
                            check(&k, &Ok(item));
                            false
                        }
                        _ => {
                            if cancel {
                                tokio::select! {
                                    r = e.get(&k) => { check(&k, &r); false }
                                    () = give_up => true,
                                }
                            } else {
                                check(&k, &e.get(&k).await);
                                false
                            }
                        }
                    };
                    if gave_up {
                        cancelled.fetch_add(1, Ordering::Relaxed);
                    }
                    if rng.below(16) == 0 {
                        tokio::time::sleep(Duration::from_micros(100)).await;
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(wrong.load(Ordering::Relaxed), 0, "wrong values");
    each_holds_its_own(&e, &keys).await;
    (e.direct() - direct0, cancelled.load(Ordering::Relaxed))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_and_queued_ops_never_cross_replies_multi_thread() {
    let mc = Memcached::start();
    let e = Arc::new(engine(&[mc.addr()], 2, |_| {}));
    let keys = Arc::new(populate(&e, "dq", 200).await);
    let (lines0, gets0) = (e.lines(), e.gets());
    let (direct, cancelled) = direct_and_queued_never_cross(e.clone(), keys).await;
    let (lines, gets) = (e.lines() - lines0, e.gets() - gets0);
    eprintln!("{direct} direct writes, {cancelled} cancelled, {gets} gets in {lines} lines");
    assert!(direct > 0 && cancelled > 0);
    assert!(gets > lines, "some gets were merged (queued)");
    assert_eq!(e.poisonings(), 0);
}

#[tokio::test]
async fn direct_and_queued_ops_never_cross_replies_current_thread() {
    let mc = Memcached::start();
    let e = Arc::new(engine(&[mc.addr()], 1, |_| {}));
    let keys = Arc::new(populate(&e, "dq", 200).await);
    let (lines0, gets0) = (e.lines(), e.gets());
    let (direct, cancelled) = direct_and_queued_never_cross(e.clone(), keys).await;
    let (lines, gets) = (e.lines() - lines0, e.gets() - gets0);
    eprintln!("{direct} direct writes, {cancelled} cancelled, {gets} gets in {lines} lines");
    assert!(direct > 0 && cancelled > 0);
    assert!(gets > lines, "some gets were merged (queued)");
    assert_eq!(e.poisonings(), 0);
}

/// Batches of 100,000 keys (set, get, delete) on one connection after a 40 KB read (the reader's
/// buffer grown), straight to memcached and through a relay that passes replies on in bursts:
/// written in rounds of at most `ROUND` keys or commands, at most two rounds in flight, every
/// key answered, no connection lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_of_100k_go_in_bounded_rounds_whatever_the_read_sizes() {
    let mc = Memcached::start();
    let relay = Relay::bursty(&mc.addr());
    let n = 100_000;
    let keys: Vec<String> = (0..n).map(|i| format!("br:{i}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let values: Vec<Vec<u8>> = keys.iter().map(|k| value_of(k)).collect();
    for addr in [mc.addr(), relay.addr()] {
        let e = engine(&[addr], 1, |c| c.io_timeout = Duration::from_secs(5));
        let large = vec![b'L'; 40 * 1024];
        e.store(set("br:large", &large)).await.unwrap();
        assert_eq!(value(&e.get("br:large").await), Some(&large[..]));
        let absent: Vec<String> = (0..20_000).map(|i| format!("br:absent:{i}")).collect();
        let absent: Vec<&str> = absent.iter().map(String::as_str).collect();
        let deleted = e.delete_many(&absent).await;
        assert!(
            deleted.iter().all(|r| matches!(r, Ok(false))),
            "{:?}",
            deleted.iter().find(|r| r.is_err())
        );
        let writes: Vec<Write<'_>> = refs.iter().zip(&values).map(|(k, v)| set(k, v)).collect();
        let stored = e.store_many(&writes).await;
        assert!(stored.iter().all(|r| matches!(r, Ok(StoreOutcome::Stored))));
        let got = e.get_many(&refs).await;
        assert!(
            got.iter()
                .zip(&values)
                .all(|(r, v)| value(r) == Some(&v[..]))
        );
        let deleted = e.delete_many(&refs).await;
        assert!(deleted.iter().all(|r| matches!(r, Ok(true))));
        assert_eq!(e.poisonings(), 0);
        let (writes, peak) = (e.writes() as usize, e.peak() as usize);
        assert!(
            writes >= (20_000 + 3 * n) / (ROUND + KEYS_PER_LINE),
            "{writes} writes"
        );
        assert!(peak <= 2 * ROUND + KEYS_PER_LINE, "{peak} in flight");
        assert!(peak > ROUND, "{peak}: the rounds overlapped");
    }
}

/// A stopped server: what is queued behind many unanswered requests is held, not
/// written (Nagle's rule); then everything fails together within about io_timeout (the written
/// store as outcome unknown, the held ones not: they never reached the wire); after SIGCONT it
/// serves again.
#[tokio::test]
async fn a_stopped_server_fails_its_waiters_at_once_then_serves_again() {
    let io_timeout = Duration::from_millis(1000);
    let mc = Memcached::start();
    let e = Arc::new(engine(&[mc.addr()], 1, |c| {
        c.io_timeout = io_timeout;
        c.retry_interval = Duration::from_millis(100);
    }));
    let keys = populate(&e, "ss", 100).await;
    mc.signal("STOP");
    let started = Instant::now();
    let finished = Arc::new(AtomicUsize::new(0));
    let spawn = |k: &String, store: bool, written: bool| {
        let (e, k, finished) = (e.clone(), k.clone(), finished.clone());
        tokio::spawn(async move {
            let r = if store {
                let v = value_of(&k);
                e.store(set(&k, &v)).await.map(|_| None)
            } else {
                e.get(&k).await
            };
            finished.fetch_add(1, Ordering::SeqCst);
            (r, started.elapsed(), written)
        })
    };
    let poisonings = e.poisonings();
    // The connection is idle: the first store's caller writes it; then gets enough to make
    // the connection busy (Nagle's rule) go out behind it.
    let mut tasks = vec![spawn(&keys[0], true, true)];
    tasks.extend(keys[1..=HOLD].iter().map(|k| spawn(k, false, false)));
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    let w1 = e.writes();
    tasks.extend(keys[HOLD + 1..].iter().map(|k| spawn(k, false, false)));
    tasks.extend(keys[1..5].iter().map(|k| spawn(k, true, false)));
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    assert_eq!(
        e.writes(),
        w1,
        "written while many replies were outstanding"
    );
    assert_eq!(finished.load(Ordering::SeqCst), 0);
    let mut done = Vec::new();
    for t in tasks {
        let (r, at, written) = tokio::time::timeout(Duration::from_secs(30), t)
            .await
            .expect("no hang")
            .unwrap();
        let err = r.expect_err("the server is stopped");
        assert!(err.is_timeout(), "{err}");
        assert!(err.to_string().contains(&mc.addr()), "{err}");
        assert_eq!(err.is_outcome_unknown(), written, "{err}");
        done.push(at);
    }
    let (first, last) = (done.iter().min().unwrap(), done.iter().max().unwrap());
    eprintln!("failed between {first:?} and {last:?}");
    assert!(*last < io_timeout * 10, "{last:?}");
    // All at once: every waiter (the written store and every op held or queued behind it)
    // failed with the one connection's one poisoning; none sat out a timeout of its own.
    assert_eq!(e.poisonings() - poisonings, 1);
    assert!(*last - *first < io_timeout, "{first:?}..{last:?}");
    mc.signal("CONT");
    let back = Instant::now();
    // (keys[..5], whose stores may have missed the server, are deleted there before it
    // serves again: read one only read)
    loop {
        if let Ok(Some(item)) = e.get(&keys[99]).await {
            assert_eq!(item.value, value_of(&keys[99]));
            break;
        }
        assert!(
            back.elapsed() < Duration::from_secs(10),
            "never served again"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("served again after {:?}", back.elapsed());
}

/// The reader takes a request pushed while an earlier request's deadline is armed without
/// being woken; the request still fails at its own deadline (not earlier, and not never) when
/// the server stops answering.
#[tokio::test]
async fn a_request_pushed_while_a_deadline_is_armed_times_out_on_time() {
    let io_timeout = Duration::from_millis(300);
    let mc = Memcached::start();
    let e = engine(&[mc.addr()], 1, |c| {
        c.io_timeout = io_timeout;
        c.failure_limit = 100;
    });
    for _ in 0..3 {
        e.get("dl:k").await.unwrap();
    }
    // The first get's deadline is still armed: the next get is written without a wake-up.
    tokio::time::sleep(io_timeout / 3).await;
    mc.signal("STOP");
    let t = Instant::now();
    let got = tokio::time::timeout(io_timeout * 20, e.get("dl:k"))
        .await
        .expect("no hang");
    let took = t.elapsed();
    let err = got.expect_err("the server is stopped");
    assert!(err.is_timeout(), "{err}");
    assert!(
        took >= io_timeout,
        "failed before its own deadline: {took:?}"
    );
    eprintln!("timed out after {took:?}");
    mc.signal("CONT");
    let back = Instant::now();
    while e.get("dl:k").await.is_err() {
        assert!(
            back.elapsed() < Duration::from_secs(5),
            "never served again"
        );
    }
}

/// A killed server among three: only its keys fail, it is not connected to in a hot
/// loop while down, and after a restart on the same port it serves again quickly.
#[tokio::test]
async fn a_killed_server_fails_only_its_keys_and_returns_after_a_restart() {
    let mut servers: Vec<Memcached> = (0..3).map(|_| Memcached::start()).collect();
    let addrs: Vec<String> = servers.iter().map(Memcached::addr).collect();
    let retry = Duration::from_millis(100);
    // A killed server refuses connections at once; the live ones get a generous io_timeout,
    // so that a loaded machine cannot turn their answers into timeouts.
    let e = engine(&addrs, 2, |c| {
        c.retry_interval = retry;
        c.io_timeout = Duration::from_secs(5);
    });
    let keys = populate(&e, "kl", 300).await;
    let ks: Vec<&str> = keys.iter().map(String::as_str).collect();
    let home: Vec<usize> = ks.iter().map(|k| e.routing.home(k)).collect();
    assert!((0..3).all(|s| home.contains(&s)), "keys on every server");
    servers[1].kill();
    let check = |got: Vec<Result<Option<Item>>>| {
        for ((k, r), &h) in ks.iter().zip(got).zip(&home) {
            if h == 1 {
                let err = r.expect_err("its server is down");
                assert!(err.is_backend(), "{err}");
            } else {
                assert_eq!(value(&r), Some(&value_of(k)[..]), "{k} lives on {h}");
            }
        }
    };
    check(e.get_many(&ks).await);
    // Hammer it for a second: connects stay bounded by the retry interval.
    let connects = e.connects(1);
    let t = Instant::now();
    let mut calls = 0;
    while t.elapsed() < Duration::from_secs(1) {
        check(e.get_many(&ks).await);
        calls += 1;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let attempts = e.connects(1) - connects;
    eprintln!(
        "{attempts} connect attempts in {:?} ({calls} batches)",
        t.elapsed()
    );
    assert!(
        attempts <= 1 + (t.elapsed().as_millis() / retry.as_millis()) as u64 + 5,
        "{attempts} connects in {calls} batches"
    );
    servers[1].restart();
    // The restarted server is empty: write its keys again once it is back.
    let back = Instant::now();
    let probe = ks[home.iter().position(|&h| h == 1).unwrap()];
    let v = value_of(probe);
    while e.store(set(probe, &v)).await.is_err() {
        assert!(back.elapsed() < Duration::from_secs(5), "never back");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let took = back.elapsed();
    eprintln!("serving again {took:?} after the restart");
    assert!(took < Duration::from_secs(2), "{took:?}");
    assert_eq!(value(&e.get(probe).await), Some(&v[..]));
}

/// An engine used on one runtime, which then shuts down, works on the next one; a
/// get queued on the old runtime's connection while that runtime sat idle is answered once it
/// is gone (retried on a fresh connection), not left hanging.
#[test]
fn a_new_runtime_reconnects() {
    let mc = Memcached::start();
    let e = Arc::new(engine(&[mc.addr()], 2, |_| {}));
    let first = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    first.block_on(async {
        e.store(set("rh:k", b"v")).await.unwrap();
        assert_eq!(value(&e.get("rh:k").await), Some(&b"v"[..]));
    });
    // `first` is alive but idle: its connections take ops and do nothing with them.
    let connects = e.connects(0);
    let second = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let queued = {
        let e = e.clone();
        second.spawn(async move { e.get("rh:k").await })
    };
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        !queued.is_finished(),
        "queued on the idle runtime's connection"
    );
    drop(first);
    second.block_on(async {
        let got = tokio::time::timeout(Duration::from_secs(10), queued)
            .await
            .expect("no hang")
            .unwrap();
        assert_eq!(
            value(&got),
            Some(&b"v"[..]),
            "retried on a new connection: {got:?}"
        );
        let r = tokio::time::timeout(Duration::from_secs(10), async {
            (e.get("rh:k").await, e.store(set("rh:k", b"w")).await)
        })
        .await
        .expect("no hang");
        assert_eq!(value(&r.0), Some(&b"v"[..]));
        assert_eq!(r.1.unwrap(), StoreOutcome::Stored);
    });
    assert!(e.connects(0) > connects, "reconnected");
}

/// Bad input is refused before anything is written, and the connection goes on.
#[tokio::test]
async fn invalid_input_writes_nothing() {
    let mc = Memcached::start();
    let e = engine(&[mc.addr()], 1, |_| {});
    e.store(set("iv:k", b"v")).await.unwrap();
    let writes = e.writes();
    let long = "k".repeat(251);
    for key in ["", "a b", "a\r\nflush_all", long.as_str()] {
        assert!(e.get(key).await.unwrap_err().is_invalid_key());
        assert!(e.store(set(key, b"x")).await.unwrap_err().is_invalid_key());
        assert!(e.delete(key).await.unwrap_err().is_invalid_key());
        assert!(e.touch(key, 0).await.unwrap_err().is_invalid_key());
        assert!(e.incr(key, 1).await.unwrap_err().is_invalid_key());
        let w = write(StoreMode::Set, key, b"x");
        assert!(e.store_then_get(w).await.unwrap_err().is_invalid_key());
        assert!(
            e.get_many(&[key]).await[0]
                .as_ref()
                .unwrap_err()
                .is_invalid_key()
        );
        assert!(
            e.delete_many(&[key]).await[0]
                .as_ref()
                .unwrap_err()
                .is_invalid_key()
        );
    }
    let big = vec![0u8; e.max_value_size("iv:k") + 1];
    assert!(e.store(set("iv:k", &big)).await.unwrap_err().is_too_large());
    assert!(
        e.store_many(&[set("iv:k", &big)]).await[0]
            .as_ref()
            .unwrap_err()
            .is_too_large()
    );
    let mut late = set("iv:k", b"x");
    late.exptime = u32::MAX;
    assert!(e.store(late).await.unwrap_err().is_config());
    assert_eq!(e.writes(), writes, "nothing was written");
    assert_eq!(value(&e.get("iv:k").await), Some(&b"v"[..]));
}

/// A scripted server on a free port: its first connection sends `greeting` on accept and
/// answers its first request with `first`; every other request gets `END` (a miss).
async fn fake_server(greeting: &'static [u8], first: &'static [u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let mut script = Some((greeting, first));
        while let Ok((mut s, _)) = listener.accept().await {
            let (greeting, first) = script.take().unzip();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let mut reply = first;
                let greeting = greeting.unwrap_or_default();
                if !greeting.is_empty() && s.write_all(greeting).await.is_err() {
                    return;
                }
                // The tests send one request at a time.
                while let Ok(n) = s.read(&mut buf).await {
                    if n == 0
                        || s.write_all(reply.take().unwrap_or(b"END\r\n"))
                            .await
                            .is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// Bad bytes from a server are errors for the waiters concerned, never a panic or another
/// caller's answer; the connection is replaced and the next op works.
#[tokio::test]
async fn hostile_replies_are_errors_and_the_engine_recovers() {
    let long_line: &'static [u8] = Box::leak(vec![b'x'; 5000].into_boxed_slice());
    let cases: [(&str, &[u8], &[u8]); 8] = [
        ("unrequested key", b"", b"VALUE zzz 0 1 1\r\nx\r\nEND\r\n"),
        ("garbage", b"", b"garbage\r\n"),
        (
            "no CRLF after the data",
            b"",
            b"VALUE k 0 2 1\r\nabXYEND\r\n",
        ),
        (
            "a huge declared length",
            b"",
            b"VALUE k 0 999999999999 1\r\n",
        ),
        ("an endless line", b"", long_line),
        ("server error", b"", b"SERVER_ERROR out of memory\r\n"),
        ("client error", b"", b"CLIENT_ERROR bad data chunk\r\n"),
        ("unsolicited bytes", b"END\r\nEND\r\n", b"END\r\n"),
    ];
    for (name, greeting, first) in cases {
        let addr = fake_server(greeting, first).await;
        let e = engine(&[addr], 1, |c| {
            c.io_timeout = Duration::from_millis(300);
            c.failure_limit = 100;
        });
        let got = tokio::time::timeout(Duration::from_secs(10), e.get("k"))
            .await
            .expect("no hang");
        if name == "unsolicited bytes" {
            // The greeting may pass for the reply if the get was written before it was read.
            assert!(matches!(got, Ok(None) | Err(_)), "{name}: {got:?}");
        } else {
            let err = got.expect_err(name);
            assert!(err.is_backend(), "{name}: {err}");
            assert_eq!(
                err.is_timeout(),
                name == "a huge declared length",
                "{name}: {err}"
            );
        }
        let t = Instant::now();
        while !matches!(e.get("k").await, Ok(None)) {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "{name}: never recovered"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Dropping the engine closes its connections: their tasks end and release the servers.
#[tokio::test]
async fn dropping_the_engine_ends_its_connections() {
    let mc = Memcached::start();
    let e = engine(&[mc.addr()], 2, |_| {});
    populate(&e, "dr", 10).await;
    // Two at once: the second finds the first's connection busy and opens the other one.
    let (a, b) = tokio::join!(e.get("dr:1"), e.get("dr:2"));
    a.unwrap();
    b.unwrap();
    assert_eq!(e.connects(0), 2);
    let server = Arc::downgrade(&e.servers[0]);
    drop(e);
    let t = Instant::now();
    while server.strong_count() > 0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the connections outlived the engine"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Outside a runtime, the first connect is a clear configuration error, not a panic.
#[test]
fn outside_a_runtime_the_error_says_what_is_needed() {
    let e = engine(&["127.0.0.1:9".to_string()], 2, |_| {});
    let mut get = e.get("k");
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match get.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(Err(err)) => {
            assert!(
                err.is_config() && err.to_string().contains("tokio"),
                "{err}"
            );
        }
        other => panic!("{other:?}"),
    }
}

/// A runtime without timers (no `enable_all`): the connection task panics inside tokio, and
/// the caller gets an error naming the likely cause instead of hanging.
#[test]
fn a_runtime_without_timers_is_an_error_not_a_hang() {
    let mc = Memcached::start();
    let e = engine(&[mc.addr()], 1, |_| {});
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .unwrap();
    let err = rt.block_on(e.get("k")).unwrap_err();
    assert!(err.to_string().contains("enable_all") || format!("{err:?}").contains("enable_all"));
    let err = rt.block_on(e.store(set("k", b"v"))).unwrap_err();
    assert!(err.is_outcome_unknown(), "{err}");
}

#[test]
fn configuration_is_checked() {
    let addr = ["127.0.0.1:9".to_string()];
    let err = Engine::new(&config(&addr, |_| {}), 0).unwrap_err();
    assert!(err.is_config(), "{err}");
    let err = Engine::new(&config(&[], |_| {}), 2).unwrap_err();
    assert!(err.is_config(), "{err}");
    let err = Engine::new(&config(&addr, |c| c.io_timeout = Duration::ZERO), 2).unwrap_err();
    assert!(
        err.is_config() && err.to_string().contains("io_timeout"),
        "{err}"
    );
}

/// `n` keys under `prefix` with values of `size` bytes, stored straight on `addr`.
fn populate_sized(
    rt: &tokio::runtime::Runtime,
    addr: &str,
    prefix: &str,
    n: usize,
    size: usize,
) -> Vec<String> {
    let keys: Vec<String> = (0..n).map(|i| format!("{prefix}:{i}")).collect();
    let value = vec![b'v'; size];
    let e = engine(&[addr.to_owned()], 1, |_| {});
    rt.block_on(async {
        let writes: Vec<Write<'_>> = keys.iter().map(|k| set(k, &value)).collect();
        for r in e.store_many(&writes).await {
            assert_eq!(r.unwrap(), StoreOutcome::Stored);
        }
    });
    keys
}

/// The bytes of one round's replies (`ROUND` keys of `size`-byte values, as `gets` answers).
fn round_bytes(prefix: &str, size: usize) -> f64 {
    (ROUND * (format!("VALUE {prefix}:12345 7 {size} 123456\r\n").len() + size + 2)) as f64
}

fn two_workers() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// A healthy server on a slow link, each round of 2,048 keys taking 0.6 x io_timeout to arrive:
/// the pool (one round in flight, each under its own io_timeout) and the engine (two in flight,
/// the oldest's io_timeout counted from its write or the last whole reply) both serve a get of
/// three rounds, with no fault counted.
#[test]
fn a_slow_link_the_pool_serves_is_served_by_the_engine() {
    use crate::backend::Backend;
    use crate::backend::memcached::MemcachedBackend;
    let io_timeout = Duration::from_secs(1);
    let size = 1000;
    let mc = Memcached::start();
    let rt = two_workers();
    let keys = populate_sized(&rt, &mc.addr(), "slow", 3 * ROUND, size);
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let rate = round_bytes("slow", size) / (0.6 * io_timeout.as_secs_f64());
    let relay = Relay::paced(&mc.addr(), rate);
    let tune = |c: &mut MemcachedConfig| c.io_timeout = io_timeout;
    let pool = MemcachedBackend::new(config(&[relay.addr()], tune)).unwrap();
    let t = Instant::now();
    let got = pool.get_many(&refs);
    let pool_took = t.elapsed();
    let pool_failed = got.iter().filter(|r| r.is_err()).count();
    assert_eq!(
        pool_failed, 0,
        "the pool: {pool_failed} failed in {pool_took:?}"
    );
    let e = engine(&[relay.addr()], 1, tune);
    let t = Instant::now();
    let got = rt.block_on(e.get_many(&refs));
    let took = t.elapsed();
    let failed = got.iter().filter(|r| r.is_err()).count();
    assert_eq!(
        failed,
        0,
        "the engine: {failed} of {} keys failed in {took:?} (the pool served them all in \
         {pool_took:?}): {:?}",
        refs.len(),
        got.iter()
            .find_map(|r| r.as_ref().err().map(ToString::to_string))
    );
}

/// Nagle's rule: while many replies are outstanding, gets queued on the busy connection are not
/// written one scheduler turn later each; they wait for the last reply and go out together, one
/// merged line in one write.
#[tokio::test]
async fn a_busy_connection_gathers_what_is_queued_until_its_reply_is_read() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use writer_hold::{answer_busy, busy, fake, turns, warm};
    let (listener, e) = fake().await;
    let mut peer = warm(&listener, &e).await;
    let get = |k: &'static str| {
        let e = e.clone();
        tokio::spawn(async move { e.get(k).await.unwrap() })
    };
    let replies = busy(&mut peer, &e).await;
    let writes = e.writes();
    // Replies outstanding: `b` is queued, the writer runs, and nothing is written.
    let b = get("b");
    turns().await;
    let c = get("c");
    let d = get("d");
    turns().await;
    let mut buf = [0u8; 256];
    assert!(
        peer.try_read(&mut buf).is_err(),
        "written while replies were outstanding"
    );
    assert_eq!(e.writes(), writes);
    answer_busy(&mut peer, replies).await;
    let n = peer.read(&mut buf).await.unwrap();
    assert_eq!(&buf[..n], b"gets b c d\r\n", "one line, one write");
    peer.write_all(b"VALUE c 0 1 7\r\nx\r\nEND\r\n")
        .await
        .unwrap();
    assert_eq!(b.await.unwrap(), None);
    assert_eq!(
        c.await.unwrap().map(|i| i.value.to_vec()),
        Some(b"x".to_vec())
    );
    assert_eq!(d.await.unwrap(), None);
    assert_eq!(e.writes(), writes + 1);
}

/// The writer's hold (Nagle's rule) and pipelining: what a lone caller, a caller who gave up, a
/// filled round and two tasks sharing a connection get from it; also the fake server the tests
/// of the hold share. Each test is named for the behaviour it expects.
mod writer_hold {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// An engine of one connection to a fake server `listener`, with an `io_timeout` long
    /// enough that nothing here times out: a request held by the writer is held until the test
    /// answers, so a bounded wait for its bytes is a synchronisation, not a measurement.
    pub(super) async fn fake() -> (tokio::net::TcpListener, Arc<Engine>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let e = Arc::new(engine(std::slice::from_ref(&addr), 1, |c| {
            c.io_timeout = Duration::from_secs(60);
        }));
        (listener, e)
    }

    /// Reads from `peer` into `got` until `done(got)`, or 5 s pass; whether it was done.
    pub(super) async fn read_until(
        peer: &mut tokio::net::TcpStream,
        got: &mut Vec<u8>,
        done: impl Fn(&[u8]) -> bool,
    ) -> bool {
        let reading = async {
            while !done(got) {
                let mut buf = [0u8; 16 * 1024];
                let n = peer.read(&mut buf).await.unwrap();
                assert!(n > 0, "the engine closed the connection");
                got.extend_from_slice(&buf[..n]);
            }
        };
        tokio::time::timeout(Duration::from_secs(5), reading)
            .await
            .is_ok()
    }

    /// [`read_until`] a whole line.
    pub(super) async fn read_line(peer: &mut tokio::net::TcpStream, got: &mut Vec<u8>) -> bool {
        read_until(peer, got, |g| g.ends_with(b"\r\n")).await
    }

    /// Accepts the engine's connection and serves one warm-up get on it, so that the connection
    /// is up and idle (the direct path open) when the test's calls start.
    pub(super) async fn warm(
        listener: &tokio::net::TcpListener,
        e: &Arc<Engine>,
    ) -> tokio::net::TcpStream {
        let warm = {
            let e = e.clone();
            tokio::spawn(async move { e.get("warm").await.unwrap() })
        };
        let (mut peer, _) = listener.accept().await.unwrap();
        let mut got = Vec::new();
        assert!(read_line(&mut peer, &mut got).await);
        assert_eq!(got, b"gets warm\r\n");
        peer.write_all(b"END\r\n").await.unwrap();
        assert_eq!(warm.await.unwrap(), None);
        turns().await;
        peer
    }

    /// Puts [`HOLD`] gets (`h0`, `h1`…) in flight on the warm connection `peer` serves, so
    /// that it is busy enough for Nagle's rule to hold what is queued next: their tasks, and
    /// how many `gets` lines carried them (the reply owed is an `END` each).
    pub(super) async fn busy(
        peer: &mut tokio::net::TcpStream,
        e: &Arc<Engine>,
    ) -> (Vec<tokio::task::JoinHandle<Result<Option<Item>>>>, usize) {
        let tasks = (0..HOLD)
            .map(|i| {
                let e = e.clone();
                tokio::spawn(async move { e.get(&format!("h{i}")).await })
            })
            .collect();
        let mut got = Vec::new();
        assert!(
            read_until(peer, &mut got, |g| {
                g.ends_with(b"\r\n") && count(g, b" h") >= HOLD
            })
            .await,
            "the busy gets were written: {:?}",
            String::from_utf8_lossy(&got)
        );
        (tasks, count(&got, b"\r\n"))
    }

    /// Answers the gets [`busy`] put in flight (all misses).
    pub(super) async fn answer_busy(
        peer: &mut tokio::net::TcpStream,
        (tasks, lines): (Vec<tokio::task::JoinHandle<Result<Option<Item>>>>, usize),
    ) {
        peer.write_all(&b"END\r\n".repeat(lines)).await.unwrap();
        for t in tasks {
            assert_eq!(t.await.unwrap().unwrap(), None);
        }
    }

    pub(super) fn count(hay: &[u8], needle: &[u8]) -> usize {
        hay.windows(needle.len()).filter(|w| *w == needle).count()
    }

    pub(super) async fn turns() {
        for _ in 0..50 {
            tokio::task::yield_now().await;
        }
    }

    /// One caller, no other traffic. A `get_many` of 200 keys on one server is two
    /// `gets` lines (128 keys per line): the first goes out directly (the connection is idle),
    /// the second is queued and the writer holds it until the first line's reply is read,
    /// so a lone caller's batch takes two round trips where it took one. Not a "rest": the
    /// claim "a lone caller's direct write never waits" holds only for its first line.
    #[tokio::test]
    async fn a_lone_callers_get_many_of_two_lines_is_written_without_waiting_for_a_reply() {
        let (listener, e) = fake().await;
        let mut peer = warm(&listener, &e).await;
        let keys: Vec<String> = (0..200).map(|i| format!("k{i}")).collect();
        let task = {
            let (e, keys) = (e.clone(), keys.clone());
            tokio::spawn(async move {
                let ks: Vec<&str> = keys.iter().map(String::as_str).collect();
                e.get_many(&ks).await.len()
            })
        };
        let mut got = Vec::new();
        // Both lines, before any reply: nothing else can wake the writer.
        let both = read_until(&mut peer, &mut got, |g| count(g, b"\r\n") >= 2).await;
        let lines_before_reply = count(&got, b"\r\n");
        task.abort();
        assert!(
            both,
            "a lone caller's second gets line was held for the first line's reply: \
             {lines_before_reply} line(s) written before any reply ({} writes)",
            e.writes()
        );
    }

    /// a lone caller's `store_many` of two keys on one server: the first
    /// set goes out directly, the second is held for the first's reply (two round trips).
    #[tokio::test]
    async fn a_lone_callers_store_many_is_written_without_waiting_for_a_reply() {
        let (listener, e) = fake().await;
        let mut peer = warm(&listener, &e).await;
        let task = {
            let e = e.clone();
            tokio::spawn(async move {
                let writes = [set("s1", b"v"), set("s2", b"v")];
                e.store_many(&writes).await.len()
            })
        };
        let mut got = Vec::new();
        let both = read_until(&mut peer, &mut got, |g| count(g, b"set ") >= 2).await;
        task.abort();
        assert!(
            both,
            "a lone caller's second set was held for the first set's reply: written before \
             any reply: {:?}",
            String::from_utf8_lossy(&got)
        );
    }

    /// A get the writer holds (Nagle) whose caller gives up meanwhile is still
    /// written: ARCHITECTURE.md says a get not yet written is skipped (a dropped future costs
    /// the server nothing), but the hold takes the op into its round, so the closed waiter is
    /// not looked at again before the line is encoded a round trip later. (The connection is
    /// made busy first: with fewer replies outstanding nothing is held.)
    #[tokio::test]
    async fn a_held_get_whose_caller_gave_up_is_not_written() {
        let (listener, e) = fake().await;
        let mut peer = warm(&listener, &e).await;
        let get = |k: &'static str| {
            let e = e.clone();
            tokio::spawn(async move { e.get(k).await })
        };
        let busy = busy(&mut peer, &e).await;
        let writes = e.writes();
        // `b` is queued behind the outstanding replies and taken by the holding writer.
        let b = get("b");
        turns().await;
        assert_eq!(e.writes(), writes, "b is held, not written");
        // Its caller gives up (a timeout around the call, a dropped request handler).
        b.abort();
        assert!(b.await.unwrap_err().is_cancelled());
        answer_busy(&mut peer, busy).await;
        let c = get("c");
        let mut got = Vec::new();
        assert!(read_line(&mut peer, &mut got).await);
        let written = String::from_utf8_lossy(&got).into_owned();
        // Answer whatever was asked, so that `c` ends.
        let mut reply = Vec::new();
        for line in written.lines() {
            let _ = line;
            reply.extend_from_slice(b"END\r\n");
        }
        peer.write_all(&reply).await.unwrap();
        if !written.contains(" c") {
            got.clear();
            let _ = read_until(&mut peer, &mut got, |g| g.ends_with(b"\r\n")).await;
            peer.write_all(b"END\r\n").await.unwrap();
        }
        assert_eq!(c.await.unwrap().unwrap(), None);
        assert!(
            !written.split_whitespace().any(|w| w == "b"),
            "the get of a caller that gave up was written: {written:?}"
        );
    }

    /// "a full round goes at once (a large batch keeps two rounds in flight)" does
    /// not hold for a round that fills while the writer holds: the writer sleeps on `drained`
    /// only, nothing wakes it when the queue fills, so 2,048 keys queued behind a held single
    /// get wait for an unrelated reply. The keys come from 16 callers' gets of 128 keys each
    /// (no caller's batch ends: only the round filling can release it).
    #[tokio::test]
    async fn a_round_filled_while_held_goes_at_once() {
        let (listener, e) = fake().await;
        let mut peer = warm(&listener, &e).await;
        let (busy, _) = busy(&mut peer, &e).await;
        let writes = e.writes();
        let b = {
            let e = e.clone();
            tokio::spawn(async move { e.get("b").await })
        };
        turns().await;
        assert_eq!(e.writes(), writes, "b is held");
        // A full round (16 lines of 128 keys, a caller each) queued behind the held `b`.
        let batch: Vec<_> = (0..ROUND / KEYS_PER_LINE)
            .map(|c| {
                let e = e.clone();
                tokio::spawn(async move {
                    let keys: Vec<String> =
                        (0..KEYS_PER_LINE).map(|i| format!("r{c}:{i}")).collect();
                    let ks: Vec<&str> = keys.iter().map(String::as_str).collect();
                    e.get_many(&ks).await.len()
                })
            })
            .collect();
        turns().await;
        let mut got = Vec::new();
        let sent = read_until(&mut peer, &mut got, |g| count(g, b"\r\n") >= 1).await;
        busy.iter().for_each(|t| t.abort());
        b.abort();
        batch.iter().for_each(|t| t.abort());
        assert!(
            sent,
            "a full round ({ROUND} keys and more queued) waited for an unrelated reply \
             ({} writes so far)",
            e.writes()
        );
    }

    /// Two tasks on one connection (a current-thread runtime, as `Blended`'s engine thread and
    /// many services run) must keep two requests on the wire, pipelined, not take turns (each
    /// get waiting a whole extra round trip for the other's). Turns come back if the reader
    /// wakes the writer before the caller whose reply it read, or reads the other task's reply
    /// during the writer's yield. Counted: the writer's rounds written while the other task's
    /// get was in flight (a handful in lockstep, over a hundred pipelined).
    #[tokio::test]
    async fn two_tasks_on_one_connection_keep_two_requests_in_flight() {
        for run in 0..5 {
            let mc = Memcached::start();
            let e = Arc::new(engine(&[mc.addr()], 1, |_| {}));
            e.get("warm").await.unwrap();
            let (w0, d0) = (e.writes(), e.direct());
            gets_from_tasks(&e, 2, 200, "pp").await;
            let (writes, direct) = (e.writes() - w0, e.direct() - d0);
            assert!(
                e.overlapped() >= 50,
                "connection {run}: the two tasks took turns on the wire: {} of {writes} writes \
                 went while the other's get was in flight ({direct} direct, for 400 gets)",
                e.overlapped()
            );
        }
    }

    /// A `gets` reply split at every byte: the reader frames it again at each read (its
    /// `values` record cleared each time) and answers only once it is whole, with what a whole
    /// reply gives; then the connection serves on.
    #[tokio::test]
    async fn a_reply_split_at_every_byte_reads_whole() {
        let (listener, e) = fake().await;
        let mut peer = warm(&listener, &e).await;
        peer.set_nodelay(true).unwrap();
        let task = {
            let e = e.clone();
            tokio::spawn(async move { e.get_many(&["a", "bb", "ccc", "a"]).await })
        };
        let mut got = Vec::new();
        assert!(read_line(&mut peer, &mut got).await);
        assert_eq!(got, b"gets a bb ccc\r\n");
        let reply = b"VALUE a 0 2 1\r\nhi\r\nVALUE ccc 5 4 2\r\nEN\r\n\r\nEND\r\n";
        let reads = e.read();
        for b in reply {
            peer.write_all(std::slice::from_ref(b)).await.unwrap();
            tokio::time::sleep(Duration::from_millis(2)).await;
            assert!(!task.is_finished() || *b == b'\n');
        }
        let out = task.await.unwrap();
        eprintln!("{} bytes read in {} reads", reply.len(), e.read() - reads);
        assert_eq!(value(&out[0]), Some(&b"hi"[..]));
        assert_eq!(out[1].as_ref().unwrap(), &None);
        let c = out[2].as_ref().unwrap().as_ref().unwrap();
        assert_eq!((&c.value[..], c.flags, c.cas), (&b"EN\r\n"[..], 5, 2));
        assert_eq!(value(&out[3]), Some(&b"hi"[..]));
        let next = {
            let e = e.clone();
            tokio::spawn(async move { e.get("d").await })
        };
        got.clear();
        assert!(read_line(&mut peer, &mut got).await);
        assert_eq!(got, b"gets d\r\n");
        peer.write_all(b"END\r\n").await.unwrap();
        assert_eq!(next.await.unwrap().unwrap(), None);
        assert_eq!(e.poisonings(), 0);
    }

    /// The framing parser against the streaming one it replaced, on generated replies (valid,
    /// lying lengths, missing or early `END`, keys not asked, keys twice, error lines, bare
    /// LF, long lines, a next reply behind): the framing's end is where the streaming parser
    /// stops on every reply it accepts, both read the same slots or the same error, and a
    /// prefix of a reply the streaming parser accepts is never whole.
    mod framing {
        use crate::backend::memcached::wire::tests::outcome;
        use crate::backend::memcached::wire::{
            Shape, Slot, frame_gets, read_chunked, read_framed, read_slots, reply_len,
        };
        use proptest::prelude::*;

        const KEYS: [&str; 3] = ["a", "bb", "ccc"];

        fn piece() -> impl Strategy<Value = Vec<u8>> {
            let key = prop::sample::select(vec!["a", "bb", "ccc", "z", "a b", ""]);
            let value = (
                key,
                0u32..3,
                prop::collection::vec(prop::sample::select(vec![b'x', b'\r', b'\n', b'E']), 0..12),
                prop::sample::select(vec![0i64, 0, 0, 1, -1, 3, 1 << 40]),
                prop::sample::select(vec![&b"\r\n"[..], b"\r\n", b"\n", b"XY", b""]),
            )
                .prop_map(|(k, flags, data, lie, term)| {
                    let len = (data.len() as i64 + lie).max(0);
                    let mut v = format!("VALUE {k} {flags} {len} 9\r\n").into_bytes();
                    v.extend_from_slice(&data);
                    v.extend_from_slice(term);
                    v
                });
            let valid = (
                prop::sample::select(vec!["a", "bb", "ccc"]),
                0u32..3,
                prop::collection::vec(prop::sample::select(vec![b'x', b'\r', b'\n', b'E']), 0..12),
            )
                .prop_map(|(k, flags, data)| {
                    let mut v = format!("VALUE {k} {flags} {} 9\r\n", data.len()).into_bytes();
                    v.extend_from_slice(&data);
                    v.extend_from_slice(b"\r\n");
                    v
                });
            prop_oneof![
                8 => valid,
                3 => value,
                1 => Just(b"END\r\n".to_vec()),
                1 => prop::sample::select(vec![
                    &b"END\n"[..],
                    b"SERVER_ERROR out of memory\r\n",
                    b"CLIENT_ERROR bad\r\n",
                    b"ERROR\r\n",
                    b"garbage\r\n",
                    b"VALUE a 0 1\r\n",
                    b"\r\n",
                ])
                .prop_map(<[u8]>::to_vec),
                1 => (1000usize..1100).prop_map(|n| {
                    let mut l = vec![b'q'; n];
                    l.extend_from_slice(b"\r\n");
                    l
                }),
                // Lines over the limit that parse: an error reply, a requested key's value
                // line whose flags are padded with zeros.
                1 => (1000usize..1100).prop_map(|n| {
                    format!("SERVER_ERROR {}\r\n", "x".repeat(n)).into_bytes()
                }),
                1 => (1000usize..1100).prop_map(|n| {
                    format!("VALUE a {}1 1 9\r\nx\r\n", "0".repeat(n)).into_bytes()
                }),
            ]
        }

        fn reply() -> impl Strategy<Value = Vec<u8>> {
            (
                prop::collection::vec(piece(), 0..5),
                prop::sample::select(vec![&b"END\r\n"[..], b"", b"SERVER_ERROR x\r\n"]),
                prop::sample::select(vec![
                    &b""[..],
                    b"VALUE a 0 1 1\r\nn\r\nEND\r\n",
                    b"STORED\r\n",
                ]),
            )
                .prop_map(|(pieces, end, next)| {
                    let mut r = pieces.concat();
                    r.extend_from_slice(end);
                    r.extend_from_slice(next);
                    r
                })
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 20000, ..ProptestConfig::default() })]
            #[test]
            fn a_framed_reply_reads_as_the_streaming_parser_reads_it(buf in reply(), cap in 1usize..80) {
                let mut values = Vec::new();
                let framed_end = frame_gets(&buf, KEYS.len(), &mut values);
                prop_assert!(values.len() <= KEYS.len());
                // Framed as the reader frames it, resumed read after read (`cap` bytes each,
                // the lines found kept between): after every read, what framing all it has
                // from the start finds.
                let mut resumed = Vec::new();
                let mut have = 0;
                loop {
                    have = (have + cap).min(buf.len());
                    let mut fresh = Vec::new();
                    let end = frame_gets(&buf[..have], KEYS.len(), &mut fresh);
                    prop_assert_eq!(frame_gets(&buf[..have], KEYS.len(), &mut resumed), end, "at {}", have);
                    if end.is_some() || have == buf.len() {
                        prop_assert_eq!(format!("{resumed:?}"), format!("{fresh:?}"));
                        break;
                    }
                }
                // The streaming parser on everything at hand.
                let mut streamed: Vec<Slot> = vec![Ok(None); KEYS.len()];
                let mut r = &buf[..];
                let s = read_slots(&mut r, 8, &KEYS, &mut streamed).map(|()| streamed);
                let consumed = buf.len() - r.len();
                // A reader whose buffer ends inside lines (copied out, not read in place) reads
                // it the same, and stops where it stops.
                let (chunked, rest) = read_chunked(&buf, cap, 8, &KEYS);
                prop_assert_eq!(outcome(chunked), outcome(s.clone()), "{:?}", String::from_utf8_lossy(&buf));
                prop_assert_eq!(buf.len() - rest, consumed, "{:?}", String::from_utf8_lossy(&buf));
                if let Ok(ref slots) = s {
                    // A reply it accepts: the framing ends it where it ended, and reads it so.
                    prop_assert_eq!(framed_end, Some(consumed), "{:?}", String::from_utf8_lossy(&buf));
                    prop_assert_eq!(reply_len(Shape::Values, &buf), Some(consumed));
                    let mut framed: Vec<Slot> = vec![Ok(None); KEYS.len()];
                    let f = read_framed(&buf[..consumed], &values, 8, &KEYS, &mut framed).map(|()| framed);
                    prop_assert_eq!(outcome(f), outcome(Ok(slots.clone())));
                    // Never whole before its last byte.
                    for p in 0..consumed {
                        let mut v = Vec::new();
                        prop_assert_eq!(frame_gets(&buf[..p], KEYS.len(), &mut v), None, "prefix {}", p);
                    }
                }
                if let Some(n) = framed_end {
                    let mut again: Vec<Slot> = vec![Ok(None); KEYS.len()];
                    let mut r = &buf[..n];
                    let s2 = read_slots(&mut r, 8, &KEYS, &mut again).map(|()| again);
                    let mut framed: Vec<Slot> = vec![Ok(None); KEYS.len()];
                    let f = read_framed(&buf[..n], &values, 8, &KEYS, &mut framed).map(|()| framed);
                    prop_assert_eq!(outcome(f), outcome(s2), "{:?}", String::from_utf8_lossy(&buf));
                }
            }
        }
    }
}

/// What a cancelled held write does to the wire.
mod cancelled_held_writes {
    use super::writer_hold::{answer_busy, busy, count, fake, read_until, turns, warm};
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// A store held on a busy connection (Nagle's rule) whose caller gives up meanwhile is
    /// still written (a queued write may be applied), exactly once, when the hold ends; its
    /// reply, read for no one, leaves the next caller's reply its own (no desynchronisation).
    #[tokio::test]
    async fn a_held_store_whose_caller_gave_up_is_written_once_and_replies_stay_in_step() {
        let (listener, e) = fake().await;
        let mut peer = warm(&listener, &e).await;
        let b = busy(&mut peer, &e).await;
        let writes = e.writes();
        let s = {
            let e = e.clone();
            tokio::spawn(async move { e.store(set("s", b"1")).await })
        };
        turns().await;
        assert_eq!(e.writes(), writes, "the store is held, not written");
        s.abort();
        assert!(s.await.unwrap_err().is_cancelled());
        answer_busy(&mut peer, b).await;
        let mut got = Vec::new();
        assert!(
            read_until(&mut peer, &mut got, |g| {
                count(g, b"set s ") == 1 && count(g, b"\r\n") >= 2
            })
            .await,
            "the given-up store is written when the hold ends: {:?}",
            String::from_utf8_lossy(&got)
        );
        peer.write_all(b"STORED\r\n").await.unwrap();
        let c = {
            let e = e.clone();
            tokio::spawn(async move { e.get("c").await })
        };
        let mut more = Vec::new();
        assert!(
            read_until(&mut peer, &mut more, |g| {
                count(g, b" c") == 1 && g.ends_with(b"\r\n")
            })
            .await,
            "{:?}",
            String::from_utf8_lossy(&more)
        );
        assert_eq!(count(&more, b"set s "), 0, "the store was written twice");
        peer.write_all(b"VALUE c 0 1 7\r\nx\r\nEND\r\n")
            .await
            .unwrap();
        let r = c.await.unwrap();
        assert_eq!(value(&r), Some(&b"x"[..]), "{r:?}");
    }
}
