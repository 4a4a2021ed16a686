//! A relay in front of a server that reshapes its replies ([`Relay`]). Used by the integration
//! tests (`fixture`) and by the engine's unit tests (included there by path): std only.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// A relay in front of a server: requests pass at once, replies as its shape says (see
/// [`Relay::bursty`] and [`Relay::paced`]). Stops accepting when dropped; each connection ends
/// with its client's.
pub struct Relay {
    addr: String,
    stop: Arc<AtomicBool>,
}

/// How the server's replies reach the client: reads `from_server`, writes `to_client`.
type Shape = fn(&mut TcpStream, &mut TcpStream, f64);

impl Relay {
    /// Replies held until the server has sent nothing for 10 ms (or 1 MiB is held), then passed
    /// on in one write. What a client whose reader was starved for a moment finds,
    /// deterministically: thousands of short replies waiting for each read.
    pub fn bursty(upstream: &str) -> Relay {
        Relay::start(upstream, bursts, 0.0)
    }

    /// Replies passed on at `rate` bytes a second (a slow link: a healthy server behind it,
    /// every reply coming, at that pace).
    #[allow(dead_code)] // the engine's unit tests use it
    pub fn paced(upstream: &str, rate: f64) -> Relay {
        Relay::start(upstream, paced, rate)
    }

    pub fn addr(&self) -> String {
        self.addr.clone()
    }

    fn start(upstream: &str, shape: Shape, rate: f64) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a free loopback port");
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let stop = Arc::new(AtomicBool::new(false));
        let (upstream, stopped) = (upstream.to_owned(), stop.clone());
        std::thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((client, _)) => {
                        client.set_nonblocking(false).unwrap();
                        let server = TcpStream::connect(&upstream).expect("the upstream server");
                        relay(client, server, shape, rate);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    Err(_) => return,
                }
            }
        });
        Relay { addr, stop }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn relay(client: TcpStream, server: TcpStream, shape: Shape, rate: f64) {
    let (mut from_client, mut to_server) =
        (client.try_clone().unwrap(), server.try_clone().unwrap());
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut from_client, &mut to_server);
        let _ = to_server.shutdown(std::net::Shutdown::Write);
    });
    let (mut from_server, mut to_client) = (server, client);
    std::thread::spawn(move || {
        shape(&mut from_server, &mut to_client, rate);
        let _ = to_client.shutdown(std::net::Shutdown::Write);
    });
}

fn bursts(from_server: &mut TcpStream, to_client: &mut TcpStream, _: f64) {
    const QUIET: Duration = Duration::from_millis(10);
    const MAX: usize = 1 << 20;
    let mut held = Vec::with_capacity(MAX);
    let mut chunk = vec![0; 64 * 1024];
    loop {
        // The first bytes of a burst: wait for them as long as it takes.
        let _ = from_server.set_read_timeout(None);
        let n = match from_server.read(&mut chunk) {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        held.extend_from_slice(&chunk[..n]);
        let _ = from_server.set_read_timeout(Some(QUIET));
        let mut eof = false;
        while held.len() < MAX {
            match from_server.read(&mut chunk) {
                Ok(0) => {
                    eof = true;
                    break;
                }
                Ok(n) => held.extend_from_slice(&chunk[..n]),
                Err(_) => break,
            }
        }
        if to_client.write_all(&held).is_err() || eof {
            return;
        }
        held.clear();
    }
}

fn paced(from_server: &mut TcpStream, to_client: &mut TcpStream, rate: f64) {
    let mut chunk = vec![0; 16 * 1024];
    let mut next = Instant::now();
    loop {
        let n = match from_server.read(&mut chunk) {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        // A token bucket without burst: this chunk goes when the link has carried it.
        next = next.max(Instant::now()) + Duration::from_secs_f64(n as f64 / rate);
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
        if to_client.write_all(&chunk[..n]).is_err() {
            return;
        }
    }
}
