//! One TCP connection to one memcached, and the r2d2 manager that makes them. A connection that
//! saw an I/O or protocol error is marked broken and r2d2 drops it instead of reusing it.

use std::io::{BufReader, Write as _};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

use super::wire;
use crate::backend::{Item, StoreMode, StoreOutcome, Write};
use crate::error::{Error, ErrorKind, Result};

/// Commands written before their replies are read, in a pipelined batch. Bounds what both sides
/// must buffer (memcached stops reading while it cannot write its replies).
pub(crate) const PIPELINE_CHUNK: usize = 512;
/// Keys per `gets` line (bounds the line memcached and proxies must buffer).
const KEYS_PER_LINE: usize = 100;
/// Keys per pipelined write of `gets` lines.
const GETS_PER_WRITE: usize = 2048;

/// A connection to one server.
#[derive(Debug)]
pub(crate) struct Conn {
    stream: BufReader<TcpStream>,
    out: Vec<u8>,
    broken: bool,
}

impl Conn {
    fn connect(
        addrs: &[SocketAddr],
        connect_timeout: Duration,
        io_timeout: Duration,
    ) -> Result<Conn> {
        let mut last = None;
        for addr in addrs {
            match TcpStream::connect_timeout(addr, connect_timeout) {
                Ok(s) => {
                    s.set_nodelay(true)?;
                    s.set_read_timeout(Some(io_timeout))?;
                    s.set_write_timeout(Some(io_timeout))?;
                    return Ok(Conn {
                        stream: BufReader::with_capacity(16 * 1024, s),
                        out: Vec::with_capacity(4096),
                        broken: false,
                    });
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.map_or_else(
            || Error::backend("the address resolved to nothing"),
            Error::from,
        ))
    }

    /// Runs one exchange: `encode` fills the outgoing buffer, which is sent in one write, then
    /// `decode` reads the replies. Any error that may leave unread reply bytes breaks the connection.
    fn exchange<T>(
        &mut self,
        encode: impl FnOnce(&mut Vec<u8>),
        decode: impl FnOnce(&mut BufReader<TcpStream>) -> Result<T>,
    ) -> Result<T> {
        self.out.clear();
        encode(&mut self.out);
        let result = self
            .stream
            .get_mut()
            .write_all(&self.out)
            .map_err(Error::from)
            .and_then(|()| decode(&mut self.stream));
        if let Err(e) = &result {
            if !wire::leaves_connection_usable(e) {
                self.broken = true;
            }
        }
        // Do not keep a multi-megabyte buffer around after a large write.
        if self.out.capacity() > 1 << 20 {
            self.out = Vec::with_capacity(4096);
        }
        result
    }

    /// Reads `keys` (one entry per key, by position).
    pub(crate) fn gets(&mut self, keys: &[&str], max_value: usize) -> Result<Vec<Option<Item>>> {
        let mut out = vec![None; keys.len()];
        for (chunk, out) in keys
            .chunks(GETS_PER_WRITE)
            .zip(out.chunks_mut(GETS_PER_WRITE))
        {
            // Several `gets` lines pipelined in one write: one round trip, bounded lines.
            self.exchange(
                |b| {
                    chunk
                        .chunks(KEYS_PER_LINE)
                        .for_each(|l| wire::encode_gets(b, l))
                },
                |r| {
                    for (keys, out) in chunk
                        .chunks(KEYS_PER_LINE)
                        .zip(out.chunks_mut(KEYS_PER_LINE))
                    {
                        wire::read_values(r, max_value, keys, out)?;
                    }
                    Ok(())
                },
            )?;
        }
        Ok(out)
    }

    pub(crate) fn store(
        &mut self,
        mode: StoreMode,
        key: &str,
        value: &[u8],
        flags: u32,
        exptime: u32,
    ) -> Result<StoreOutcome> {
        self.exchange(
            |b| wire::encode_store(b, mode, key, value, flags, exptime),
            wire::read_store,
        )
    }

    /// A write followed by a read of the same key, pipelined in one round trip.
    pub(crate) fn store_then_get(
        &mut self,
        w: &Write<'_>,
        max_value: usize,
    ) -> Result<(StoreOutcome, Option<Item>)> {
        let mut out = [None];
        let outcome = self.exchange(
            |b| {
                wire::encode_store(b, w.mode, w.key, w.value, w.flags, w.exptime);
                wire::encode_gets(b, &[w.key]);
            },
            |r| {
                // An error reply that leaves the connection in step still has the read's reply
                // behind it: read both before giving up.
                let stored = match wire::read_store(r) {
                    Err(e) if !wire::leaves_connection_usable(&e) => return Err(e),
                    other => other,
                };
                wire::read_values(r, max_value, &[w.key], &mut out)?;
                stored
            },
        )?;
        let [item] = out;
        Ok((outcome, item))
    }

    /// Pipelined writes, one result each: an error reply that leaves the connection in step
    /// (`SERVER_ERROR object too large`, ...) fails only its own write. A transport error fails
    /// the whole call (the connection is out of step).
    pub(crate) fn store_many(&mut self, writes: &[Write<'_>]) -> Result<Vec<Result<StoreOutcome>>> {
        let mut outcomes = Vec::with_capacity(writes.len());
        for chunk in writes.chunks(PIPELINE_CHUNK) {
            self.exchange(
                |b| {
                    for w in chunk {
                        wire::encode_store(b, w.mode, w.key, w.value, w.flags, w.exptime);
                    }
                },
                |r| {
                    for _ in chunk {
                        match wire::read_store(r) {
                            Err(e) if !wire::leaves_connection_usable(&e) => return Err(e),
                            other => outcomes.push(other),
                        }
                    }
                    Ok(())
                },
            )?;
        }
        Ok(outcomes)
    }

    pub(crate) fn delete(&mut self, key: &str) -> Result<bool> {
        self.exchange(|b| wire::encode_delete(b, key), wire::read_delete)
    }

    /// Pipelined deletes; one answer per key (`true` = it existed).
    pub(crate) fn delete_many(&mut self, keys: &[&str]) -> Result<Vec<bool>> {
        let mut out = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(PIPELINE_CHUNK) {
            self.exchange(
                |b| chunk.iter().for_each(|k| wire::encode_delete(b, k)),
                |r| {
                    for _ in chunk {
                        out.push(wire::read_delete(r)?);
                    }
                    Ok(())
                },
            )?;
        }
        Ok(out)
    }

    /// `touch key exptime`: `true` if the key existed.
    pub(crate) fn touch(&mut self, key: &str, exptime: u32) -> Result<bool> {
        self.exchange(|b| wire::encode_touch(b, key, exptime), wire::read_touch)
    }

    pub(crate) fn arith(&mut self, incr: bool, key: &str, delta: u64) -> Result<Option<u64>> {
        self.exchange(
            |b| wire::encode_arith(b, incr, key, delta),
            wire::read_arith,
        )
    }

    pub(crate) fn flush_all(&mut self) -> Result<()> {
        self.exchange(|b| b.extend_from_slice(b"flush_all\r\n"), wire::read_ok)
            .map_err(|e| {
                if wire::is_closed(&e) {
                    // twemproxy answers flush_all by closing the connection.
                    Error::with_source(
                        ErrorKind::Unsupported,
                        "the server closed the connection on flush_all \
                         (a proxy such as twemproxy does not support it)",
                        e,
                    )
                } else {
                    e
                }
            })
    }

    pub(crate) fn version(&mut self) -> Result<String> {
        self.exchange(|b| b.extend_from_slice(b"version\r\n"), wire::read_version)
    }
}

/// Makes connections to one server for its r2d2 pool.
#[derive(Debug)]
pub(crate) struct Manager {
    pub(crate) addr: String,
    pub(crate) connect_timeout: Duration,
    pub(crate) io_timeout: Duration,
}

impl r2d2::ManageConnection for Manager {
    type Connection = Conn;
    type Error = Error;

    fn connect(&self) -> Result<Conn> {
        // Resolved on every connect, so a server that moved (DNS) is found again.
        let addrs: Vec<SocketAddr> = self
            .addr
            .to_socket_addrs()
            .map_err(|e| {
                Error::with_source(
                    ErrorKind::Backend,
                    format!("cannot resolve {}", self.addr),
                    e,
                )
            })?
            .collect();
        Conn::connect(&addrs, self.connect_timeout, self.io_timeout)
    }

    fn is_valid(&self, conn: &mut Conn) -> Result<()> {
        conn.version().map(|_| ())
    }

    fn has_broken(&self, conn: &mut Conn) -> bool {
        conn.broken
    }
}
