//! A relay that turns a server's replies into bursts (see [`Bursty`]). Used by the integration
//! tests (`fixture`) and by the engine's unit tests (included there by path): std only.

use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// A relay in front of a server: requests pass at once, the server's replies are held until it
/// has sent nothing for 10 ms (or 1 MiB is held) and then passed on in one write. What a client
/// whose reader was starved for a moment finds, deterministically: thousands of short replies
/// waiting for each read. Stops accepting when dropped; each connection ends with its client's.
pub struct Bursty {
    addr: String,
    stop: Arc<AtomicBool>,
}

impl Bursty {
    pub fn new(upstream: &str) -> Bursty {
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
                        Bursty::relay(client, server);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    Err(_) => return,
                }
            }
        });
        Bursty { addr, stop }
    }

    pub fn addr(&self) -> String {
        self.addr.clone()
    }

    fn relay(client: TcpStream, server: TcpStream) {
        use std::io::{Read, Write};
        let (mut from_client, mut to_server) =
            (client.try_clone().unwrap(), server.try_clone().unwrap());
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut from_client, &mut to_server);
            let _ = to_server.shutdown(std::net::Shutdown::Write);
        });
        let (mut from_server, mut to_client) = (server, client);
        std::thread::spawn(move || {
            const QUIET: Duration = Duration::from_millis(10);
            const MAX: usize = 1 << 20;
            let mut held = Vec::with_capacity(MAX);
            let mut chunk = vec![0; 64 * 1024];
            loop {
                // The first bytes of a burst: wait for them as long as it takes.
                let _ = from_server.set_read_timeout(None);
                let n = match from_server.read(&mut chunk) {
                    Ok(0) | Err(_) => break,
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
                    break;
                }
                held.clear();
            }
            let _ = to_client.shutdown(std::net::Shutdown::Write);
        });
    }
}

impl Drop for Bursty {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}
