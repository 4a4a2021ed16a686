//! A real memcached on a free loopback port, killed on drop: the start/stop part of the
//! library's `tests/it/fixture.rs`.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A memcached process on 127.0.0.1:port, killed when dropped.
pub struct Memcached {
    pub port: u16,
    child: Option<Child>,
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

impl Memcached {
    /// Starts memcached on a free port and waits until it answers. Another test may take the
    /// port between the probe and memcached's bind: then another port is tried.
    pub fn start() -> Memcached {
        for _ in 0..5 {
            if let Some(m) = Memcached::try_start(free_port()) {
                return m;
            }
        }
        panic!("memcached did not start on any of 5 free ports");
    }

    fn try_start(port: u16) -> Option<Memcached> {
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

    fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// Kills the server now and waits for it to exit.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Memcached {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The pid the memcached on `port` reports (`stats`), if one answers.
fn server_pid(port: u16) -> Option<u32> {
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

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| o.stdout.starts_with(b"0"))
        .unwrap_or(false)
}

/// A `redis-server` on 127.0.0.1:port, killed when dropped.
pub struct RedisServer {
    pub port: u16,
    child: Child,
}

impl RedisServer {
    /// One that wants no password.
    pub fn start() -> RedisServer {
        RedisServer::start_with_args(&[])
    }

    pub fn start_with_password(password: &str) -> RedisServer {
        RedisServer::start_with_args(&["--requirepass", password])
    }

    fn start_with_args(args: &[&str]) -> RedisServer {
        let port = free_port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is installed (see .ci/run)");
        let deadline = Instant::now() + Duration::from_secs(5);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not come up");
            std::thread::sleep(Duration::from_millis(10));
        }
        RedisServer { port, child }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A child process, killed when dropped.
pub struct Process(Child);

impl Process {
    pub fn spawn(command: &mut Command) -> Process {
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("the process starts");
        Process(child)
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
