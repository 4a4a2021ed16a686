//! The paths on one Redis / Valkey server: each through the public API on the Redis backend,
//! beside redis-rs's own `GET` of the same stored bytes (the client the backend is built on,
//! connected as the backend connects) and a bare socket's RESP `GET`; the rows they make.

use std::sync::Arc;
use std::time::Instant;

use crate::floor::items::{BoxError, FLAVOR, Items, VERSION, Value};
use crate::floor::paths::{CacheGetter, Getter, KEYS, Run, Side, TASKS, interleave, run_tasks, us};
use crate::floor::redis::{self, Resp, RespBare, check_len};
use crate::floor::stats::Row;

/// One server, its sync cache, filled, and the connection settings the backend uses.
pub struct Setup {
    pub url: String,
    /// `redis 7.0.15`, `valkey 9.1.2`.
    pub version: String,
    /// The backend's defaults: the floors' connections use its timeouts.
    pub config: newcache::RedisConfig,
    pub cache: newcache::Cache,
    pub items: Arc<Items>,
}

impl Setup {
    pub fn new(url: &str) -> Result<Setup, BoxError> {
        let config = newcache::RedisConfig::new(url);
        let cache = newcache::Cache::builder()
            .redis(url)
            .flavor(FLAVOR)
            .version(VERSION)
            .build()?;
        let items = redis::fill(&cache, KEYS, &mut Resp::connect(url, config.io_timeout)?)?;
        Ok(Setup {
            url: url.to_owned(),
            version: redis::version(url)?,
            config,
            cache,
            items: Arc::new(items),
        })
    }

    /// The async cache on this server, built inside `rt` (its connection's driver belongs to
    /// it).
    pub fn async_cache(
        &self,
        rt: &tokio::runtime::Runtime,
    ) -> Result<newcache::AsyncCache, BoxError> {
        Ok(rt.block_on(async {
            newcache::Cache::builder()
                .redis(self.url.as_str())
                .flavor(FLAVOR)
                .version(VERSION)
                .build_async()
        })?)
    }

    fn name(&self, path: &str) -> String {
        format!("{} {path}", self.version)
    }
}

const MUX: &str = "redis-rs MultiplexedConnection GET";

/// Three rows of three sides measured together: the client over redis-rs, over the bare
/// socket, and redis-rs over the bare socket.
fn three_rows(
    path: &str,
    client_redis: &str,
    bare: &str,
    unit: &'static str,
    figures: [Vec<f64>; 3],
) -> Vec<Row> {
    let [client, rs, socket] = figures;
    vec![
        Row::new(path, client_redis, unit, client.clone(), rs.clone()),
        Row::new(path, bare, unit, client, socket.clone()),
        Row::new(
            format!("  {client_redis} (context)"),
            bare,
            unit,
            rs,
            socket,
        ),
    ]
}

/// sync `Cache::get` hit from one thread against redis-rs's `Connection` `GET` and a blocking
/// socket's.
pub fn sync_get(s: &Setup, rounds: usize, ops: usize, slices: usize) -> Result<Vec<Row>, BoxError> {
    let items = &s.items;
    let cache = &s.cache;
    let mut conn = redis::sync_connection(&s.url, &s.config)?;
    let mut bare = Resp::connect(&s.url, s.config.io_timeout)?;
    let client: Side<'_> = Box::new(move |n| {
        let t = Instant::now();
        for j in 0..n {
            let i = j % KEYS;
            Value::check(cache.get::<Value>(&items.user[i])?, i)?;
        }
        Ok(Run::timed(t, n))
    });
    let rs: Side<'_> = Box::new(move |n| {
        let t = Instant::now();
        for j in 0..n {
            let i = j % KEYS;
            let found: Option<Vec<u8>> = ::redis::cmd("GET")
                .arg(&items.derived[i])
                .query(&mut conn)?;
            check_len(found, items, i)?;
        }
        Ok(Run::timed(t, n))
    });
    let socket: Side<'_> = Box::new(move |n| {
        let t = Instant::now();
        for j in 0..n {
            let i = j % KEYS;
            bare.get(&items.requests[i], items.reply_lens[i])?;
        }
        Ok(Run::timed(t, n))
    });
    let runs = interleave(
        &s.name("sync-get"),
        rounds,
        ops,
        slices,
        &mut [client, rs, socket],
    )?;
    let bare = format!(
        "blocking socket GET (SO_RCVTIMEO/SO_SNDTIMEO {:?})",
        s.config.io_timeout
    );
    Ok(three_rows(
        "sync Cache::get hit, one thread",
        "redis-rs Connection GET",
        &bare,
        "us",
        [us(&runs[0]), us(&runs[1]), us(&runs[2])],
    ))
}

/// `AsyncCache::get` from one task against redis-rs's `MultiplexedConnection` `GET` and a bare
/// tokio socket's, each spawned on `rt`, timed inside the task.
pub fn async_get(
    s: &Setup,
    rt: &tokio::runtime::Runtime,
    cache: &newcache::AsyncCache,
    multi: bool,
    rounds: usize,
    ops: usize,
    slices: usize,
) -> Result<Vec<Row>, BoxError> {
    let items = &s.items;
    let mux = rt.block_on(redis::multiplexed(&s.url, &s.config))?;
    let mut floor = Some(rt.block_on(RespBare::connect(&s.url))?);
    let client: Side<'_> = Box::new(|n| {
        let (cache, items) = (cache.clone(), Arc::clone(items));
        rt.block_on(rt.spawn(async move {
            let t = Instant::now();
            for j in 0..n {
                let i = j % KEYS;
                Value::check(cache.get::<Value>(&items.user[i]).await?, i)?;
            }
            Ok::<_, BoxError>(Run::timed(t, n))
        }))?
    });
    let rs: Side<'_> = Box::new(|n| {
        let (mut conn, items) = (mux.clone(), Arc::clone(items));
        rt.block_on(rt.spawn(async move {
            let t = Instant::now();
            for j in 0..n {
                let i = j % KEYS;
                let found: Option<Vec<u8>> = ::redis::cmd("GET")
                    .arg(&items.derived[i])
                    .query_async(&mut conn)
                    .await?;
                check_len(found, &items, i)?;
            }
            Ok::<_, BoxError>(Run::timed(t, n))
        }))?
    });
    let socket: Side<'_> = Box::new(|n| {
        let (mut sock, items) = (floor.take().ok_or("floor socket lost")?, Arc::clone(items));
        let (sock, run) = rt.block_on(rt.spawn(async move {
            let t = Instant::now();
            for j in 0..n {
                let i = j % KEYS;
                if let Err(e) = sock.get(&items.requests[i], items.reply_lens[i]).await {
                    return (sock, Err(e));
                }
            }
            (sock, Ok(Run::timed(t, n)))
        }))?;
        floor = Some(sock);
        run
    });
    let (name, flavor) = match multi {
        true => ("async-get-multi", "multi-thread runtime (2 workers)"),
        false => ("async-get-current", "current-thread runtime"),
    };
    let runs = interleave(
        &s.name(name),
        rounds,
        ops,
        slices,
        &mut [client, rs, socket],
    )?;
    Ok(three_rows(
        &format!("AsyncCache::get, one task, {flavor}"),
        MUX,
        "bare tokio socket GET (nodelay), same runtime",
        "us",
        [us(&runs[0]), us(&runs[1]), us(&runs[2])],
    ))
}

/// A clone of the one `MultiplexedConnection` the 64 tasks share.
struct MuxGetter {
    conn: ::redis::aio::MultiplexedConnection,
    items: Arc<Items>,
}

impl Getter for MuxGetter {
    async fn get(&mut self, i: usize) -> Result<(), BoxError> {
        let found: Option<Vec<u8>> = ::redis::cmd("GET")
            .arg(&self.items.derived[i])
            .query_async(&mut self.conn)
            .await?;
        check_len(found, &self.items, i)
    }
}

/// A bare tokio socket per task.
struct BareGetter {
    sock: RespBare,
    items: Arc<Items>,
}

impl Getter for BareGetter {
    async fn get(&mut self, i: usize) -> Result<(), BoxError> {
        let items = &self.items;
        self.sock.get(&items.requests[i], items.reply_lens[i]).await
    }
}

/// `AsyncCache::get` from 64 tasks (one shared cache) against redis-rs's `MultiplexedConnection`
/// shared by 64 tasks (as the backend shares its one) and a bare tokio socket per task, on the
/// 2-worker runtime; `ops` gets per run, spread over the tasks.
pub fn async_get_64(
    s: &Setup,
    rt: &tokio::runtime::Runtime,
    cache: &newcache::AsyncCache,
    rounds: usize,
    ops: usize,
    slices: usize,
) -> Result<Vec<Row>, BoxError> {
    let items = &s.items;
    let mut ours: Option<Vec<CacheGetter>> = Some(CacheGetter::per_task(cache, items));
    let mux = rt.block_on(redis::multiplexed(&s.url, &s.config))?;
    let mut rs: Option<Vec<MuxGetter>> = Some(
        (0..TASKS)
            .map(|_| MuxGetter {
                conn: mux.clone(),
                items: Arc::clone(items),
            })
            .collect(),
    );
    let bares = rt.block_on(async {
        let mut v = Vec::with_capacity(TASKS);
        for _ in 0..TASKS {
            v.push(BareGetter {
                sock: RespBare::connect(&s.url).await?,
                items: Arc::clone(items),
            });
        }
        Ok::<_, BoxError>(v)
    })?;
    let mut bares = Some(bares);
    fn side<'a, G: Getter>(
        rt: &'a tokio::runtime::Runtime,
        slot: &'a mut Option<Vec<G>>,
    ) -> Side<'a> {
        Box::new(move |n| {
            let getters = slot.take().ok_or("getters lost")?;
            let (getters, run) = rt.block_on(run_tasks(getters, (n / TASKS).max(1)))?;
            *slot = Some(getters);
            Ok(run)
        })
    }
    let mut sides = [side(rt, &mut ours), side(rt, &mut rs), side(rt, &mut bares)];
    let runs = interleave(&s.name("async-get-64"), rounds, ops, slices, &mut sides)?;
    let rate = |runs: &[Run]| -> Vec<f64> { runs.iter().map(|r| 1e6 / r.us_per_op).collect() };
    let p99 = |runs: &[Run]| -> Vec<f64> { runs.iter().map(|r| r.p99_us).collect() };
    let path = "AsyncCache::get, 64 tasks, 1,000 hot keys, multi-thread (2 workers)";
    let shared = "redis-rs MultiplexedConnection, one shared by the 64 tasks";
    let bare = "bare tokio socket per task";
    let mut rows = three_rows(
        path,
        shared,
        bare,
        "gets/s",
        [rate(&runs[0]), rate(&runs[1]), rate(&runs[2])],
    );
    rows.insert(
        1,
        Row::new(
            "  the same, p99 latency",
            shared,
            "us p99",
            p99(&runs[0]),
            p99(&runs[1]),
        ),
    );
    rows.push(Row::new(
        "  redis-rs, one shared connection, p99 (context)",
        bare,
        "us p99",
        p99(&runs[1]),
        p99(&runs[2]),
    ));
    Ok(rows)
}
