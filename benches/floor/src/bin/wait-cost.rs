//! What `CacheBuilder::redis_wait` costs on a Redis Cluster: a `delete` and a `get_or_set_with`
//! miss (a claim, a load of nothing, a fenced store), each with and without `WAIT 1`,
//! interleaved (without, with, with, without, per round), per call, the median of the rounds.
//!
//! ```text
//! cargo run --release --manifest-path benches/floor/Cargo.toml --bin wait-cost -- \
//!     redis://127.0.0.1:7000,redis://127.0.0.1:7001,... [calls-per-round] [rounds]
//! ```

use std::time::{Duration, Instant};

use newcache::Cache;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let seeds: Vec<String> = args
        .next()
        .ok_or("usage: wait-cost SEED_URL,SEED_URL,... [calls] [rounds]")?
        .split(',')
        .map(str::to_owned)
        .collect();
    let calls: usize = args.next().map_or(Ok(2000), |s| s.parse())?;
    let rounds: usize = args.next().map_or(Ok(10), |s| s.parse())?;
    let build = |wait: bool| {
        let b = Cache::builder()
            .redis_cluster(seeds.iter().cloned())
            .flavor(if wait {
                "wait-cost-on"
            } else {
                "wait-cost-off"
            })
            .io_timeout(Duration::from_secs(2));
        let b = if wait {
            b.redis_wait(1, Duration::from_secs(1))
        } else {
            b
        };
        b.build()
    };
    let (off, on) = (build(false)?, build(true)?);
    // Warm: the map, the connections, the scripts.
    for c in [&off, &on] {
        for i in 0..200 {
            let k = format!("warm{i}");
            c.get_or_set_with(&k, Duration::from_secs(600), || {
                Ok::<_, std::io::Error>(1u8)
            })?;
            c.delete(&k)?;
        }
    }
    let mut next = 0u64;
    // Per call, in µs: one round of `calls` calls.
    let mut delete = |c: &Cache| -> Result<f64, newcache::Error> {
        let t = Instant::now();
        for _ in 0..calls {
            next += 1;
            c.delete(&format!("d{next}"))?;
        }
        Ok(t.elapsed().as_secs_f64() * 1e6 / calls as f64)
    };
    let mut d = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        d.0.push(delete(&off)?);
        d.1.push(delete(&on)?);
        d.1.push(delete(&on)?);
        d.0.push(delete(&off)?);
    }
    let mut next = 0u64;
    let mut miss = |c: &Cache| -> Result<f64, Box<dyn std::error::Error>> {
        let t = Instant::now();
        for _ in 0..calls {
            next += 1;
            c.get_or_set_with(&format!("m{next}"), Duration::from_secs(60), || {
                Ok::<_, std::io::Error>(next)
            })?;
        }
        Ok(t.elapsed().as_secs_f64() * 1e6 / calls as f64)
    };
    let mut m = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        m.0.push(miss(&off)?);
        m.1.push(miss(&on)?);
        m.1.push(miss(&on)?);
        m.0.push(miss(&off)?);
    }
    for c in [&off, &on] {
        c.clear()?;
    }
    println!(
        "calls per round {calls}, rounds {rounds} (x2 each side, interleaved off on on off), µs per call, median"
    );
    for (name, (without, with)) in [("delete", d), ("get_or_set_with miss", m)] {
        let (a, b) = (median(without), median(with));
        println!(
            "{name:>22}: without WAIT {a:8.1}  with WAIT 1 {b:8.1}  ratio {:.2}x",
            b / a
        );
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}
