//! What both figures share: the values (a 1,000-byte String naming its key and generation),
//! the clock every process reads (CLOCK_MONOTONIC), the buses, and the line-based links to
//! the child processes.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use crate::floor::items::BoxError;

/// The hot keys of the `gets` figure.
pub const KEYS: usize = 1000;

/// Key `i`'s value in its `generation`th write: `"{i} {generation} "` and filler, 1,000
/// bytes (1,003 encoded: below the default LZ4 threshold, stored as it is).
pub fn value(i: usize, generation: u64) -> String {
    let mut s = format!("{i} {generation} ");
    let fill = b"abcdefghijklmnopqrstuvwxyz0123456789";
    while s.len() < 1000 {
        s.push(fill[(s.len() * 7 + i) % fill.len()] as char);
    }
    s
}

/// The key and generation a [`value`] names.
pub fn parse(v: &str) -> Option<(usize, u64)> {
    let mut it = v.splitn(3, ' ');
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}

/// CLOCK_MONOTONIC in ns: one clock for every process of the machine (Linux), where
/// `std::time::Instant`s of two processes cannot be compared.
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid pointer to a timespec; CLOCK_MONOTONIC always exists on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_MONOTONIC)");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The bus a spec names: `redis:URL` (`RedisBus::new`) or `cluster:URL,URL,...`
/// (`RedisBus::cluster`), on `channel`.
pub fn bus(spec: &str, channel: &str) -> Result<Arc<dyn newcache::BusTransport>, BoxError> {
    if let Some(url) = spec.strip_prefix("redis:") {
        return Ok(newcache::RedisBus::new(url, channel)?);
    }
    if let Some(seeds) = spec.strip_prefix("cluster:") {
        return Ok(newcache::RedisBus::cluster(seeds.split(','), channel)?);
    }
    Err(format!("no bus {spec:?}: redis:URL or cluster:URL,...").into())
}

/// How a line reaches a child.
type LineSink = Box<dyn FnMut(&str) -> std::io::Result<()> + Send>;

/// Lines to and from a child (a process, or a thread standing for one): `send` a line,
/// `recv` the next one within a time limit.
pub struct Link {
    to: LineSink,
    from: mpsc::Receiver<String>,
    child: Option<Child>,
    pub name: String,
}

impl Link {
    /// This binary run as `args` (a hidden subcommand), its stdin and stdout the link, its
    /// stderr this process's.
    pub fn spawn(name: &str, args: &[String]) -> Result<Link, BoxError> {
        let mut child = Command::new(std::env::current_exe()?)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let mut stdin: ChildStdin = child.stdin.take().ok_or("no stdin")?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let (tx, from) = mpsc::channel();
        std::thread::Builder::new()
            .name(format!("{name}-out"))
            .spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { return };
                    if tx.send(line).is_err() {
                        return;
                    }
                }
            })?;
        Ok(Link {
            to: Box::new(move |line| {
                stdin.write_all(format!("{line}\n").as_bytes())?;
                stdin.flush()
            }),
            from,
            child: Some(child),
            name: name.to_owned(),
        })
    }

    /// A link to a thread: `body` gets the lines sent here and a way to answer.
    pub fn thread(
        name: &str,
        body: impl FnOnce(mpsc::Receiver<String>, Box<dyn FnMut(String) + Send>) + Send + 'static,
    ) -> Result<Link, BoxError> {
        let (to_tx, to_rx) = mpsc::channel::<String>();
        let (from_tx, from) = mpsc::channel();
        std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                body(
                    to_rx,
                    Box::new(move |line| {
                        let _ = from_tx.send(line);
                    }),
                )
            })?;
        Ok(Link {
            to: Box::new(move |line| {
                to_tx
                    .send(line.to_owned())
                    .map_err(|_| std::io::Error::other("the thread is gone"))
            }),
            from,
            child: None,
            name: name.to_owned(),
        })
    }

    /// The child process's id (none for a thread).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn send(&mut self, line: &str) -> Result<(), BoxError> {
        (self.to)(line).map_err(|e| format!("{}: {e}", self.name).into())
    }

    /// The next line, or an error after `limit`.
    pub fn recv(&mut self, limit: Duration) -> Result<String, BoxError> {
        self.from
            .recv_timeout(limit)
            .map_err(|e| format!("{}: no line within {limit:?}: {e}", self.name).into())
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// SplitMix64: a cheap per-caller picker.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// The counters of `after` minus `before`, by name (every `Stats` field, whichever this build
/// has).
pub fn stats_delta(
    before: &newcache::Stats,
    after: &newcache::Stats,
) -> std::collections::BTreeMap<String, u64> {
    let map = |s: &newcache::Stats| match serde_json::to_value(s) {
        Ok(serde_json::Value::Object(m)) => m,
        _ => serde_json::Map::new(),
    };
    let (b, a) = (map(before), map(after));
    a.iter()
        .filter_map(|(k, v)| {
            let (v, w) = (v.as_u64()?, b.get(k)?.as_u64()?);
            Some((k.clone(), v.wrapping_sub(w)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_name_their_key_and_generation() {
        for (i, g) in [(0, 0), (7, 1), (999, 123_456)] {
            let v = value(i, g);
            assert_eq!(v.len(), 1000);
            assert_eq!(parse(&v), Some((i, g)));
            assert_eq!(rmp_serde::to_vec(&v).unwrap().len(), 1003);
        }
        assert_eq!(parse("x"), None);
    }

    #[test]
    fn the_clock_moves() {
        let a = now_ns();
        std::thread::sleep(Duration::from_millis(2));
        assert!(now_ns() - a >= 2_000_000);
    }
}
