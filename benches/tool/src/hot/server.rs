//! The memcached a harness starts (this one when no `--server` is given; `bench floor`'s too,
//! which includes this file): a free loopback port, stopped on drop.

use std::io;
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::MetadataExt;
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// A memcached child process; killed when dropped (also on an error return or a panic). Ctrl-C
/// in a terminal reaches it directly: it stays in the harness's process group.
pub struct Memcached {
    child: Child,
    addr: String,
    /// `-t` and `-m`, for a restart.
    args: (usize, usize),
}

impl Memcached {
    /// Starts `memcached -l 127.0.0.1 -p PORT -t THREADS -U 0 -m MEGABYTES` on a free port and
    /// waits until it accepts connections. A port taken between the probe and memcached's bind
    /// is retried.
    pub fn start(threads: usize, megabytes: usize) -> io::Result<Memcached> {
        let mut last = None;
        for _ in 0..3 {
            match Self::try_start(threads, megabytes) {
                Ok(server) => return Ok(server),
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("tried at least once"))
    }

    /// The memcached process's id.
    #[allow(dead_code)] // `bench floor` counts its CPU; `bench hot` does not.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    fn try_start(threads: usize, megabytes: usize) -> io::Result<Memcached> {
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let mut server = Memcached {
            child: Self::spawn(port, threads, megabytes)?,
            addr: format!("127.0.0.1:{port}"),
            args: (threads, megabytes),
        };
        server.wait_listening()?;
        Ok(server)
    }

    fn spawn(port: u16, threads: usize, megabytes: usize) -> io::Result<Child> {
        let mut cmd = Command::new("memcached");
        cmd.args(["-l", "127.0.0.1", "-p", &port.to_string()])
            .args(["-t", &threads.to_string(), "-U", "0"])
            .args(["-m", &megabytes.to_string()]);
        // The server runs as it would on its own: an allocator preloaded into the measuring
        // process (`LD_PRELOAD`, to compare allocators) is not preloaded into it.
        cmd.env_remove("LD_PRELOAD");
        // memcached refuses to run as root without being told which user to be.
        if std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0) {
            cmd.args(["-u", "root"]);
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| io::Error::new(e.kind(), format!("cannot start memcached: {e}")))
    }

    fn wait_listening(&mut self) -> io::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if TcpStream::connect(&self.addr).is_ok() {
                return Ok(());
            }
            if let Some(status) = self.child.try_wait()? {
                return Err(io::Error::other(format!("memcached exited: {status}")));
            }
            if Instant::now() > deadline {
                return Err(io::Error::other("memcached did not listen within 5 s"));
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the server (an outage: its items are gone); [`restart`](Memcached::restart)
    /// brings an empty one back on the same port.
    pub fn kill(&mut self) -> io::Result<()> {
        self.child.kill()?;
        self.child.wait().map(drop)
    }

    /// Starts the server again on its port, empty, after [`kill`](Memcached::kill).
    pub fn restart(&mut self) -> io::Result<()> {
        let port = self.addr.rsplit(':').next().and_then(|p| p.parse().ok());
        let port = port.ok_or_else(|| io::Error::other("no port in the address"))?;
        self.child = Self::spawn(port, self.args.0, self.args.1)?;
        self.wait_listening()
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> &str {
        &self.addr
    }
}

impl Drop for Memcached {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
