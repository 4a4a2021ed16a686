//! `Db`: the SQLite database: seeding it (batched multi-row inserts in one transaction), the
//! service's queries, and the count of queries run against it.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Connection, QueryBuilder, Row, SqliteConnection, SqlitePool};

use crate::error::Error;

/// Products are numbered 1..=PRODUCTS; a report is one product's.
pub(crate) const PRODUCTS: i64 = 100;
/// Rows per INSERT. Four columns a row keeps a batch (4,000 parameters) far below SQLite's limit
/// of 32,766, and the statement text is the same for every full batch, so sqlx prepares it once.
const BATCH: usize = 1_000;
/// 2025-01-01T00:00:00Z: orders are spread over the year after it.
const EPOCH: i64 = 1_735_689_600;
const YEAR_SECS: u64 = 365 * 86_400;
const MONTH_SECS: i64 = 30 * 86_400;

/// A user record (`GET /users/{id}`, `PUT /users/{id}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct User {
    /// Primary key.
    pub id: i64,
    /// Display name.
    pub name: String,
    /// E-mail address.
    pub email: String,
    /// Sales region, 0..8.
    pub region: i64,
}

/// One product's sales by month (`GET /report/{id}`): the expensive query's result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    /// The product.
    pub product: i64,
    /// Orders of it.
    pub orders: i64,
    /// Their total, in cents.
    pub revenue_cents: i64,
    /// Month by month.
    pub months: Vec<Month>,
}

/// One month of a [`Report`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Month {
    /// Months since 2025-01-01 (30-day months).
    pub month: i64,
    /// Orders in the month.
    pub orders: i64,
    /// Their total, in cents.
    pub revenue_cents: i64,
    /// Distinct customers in the month.
    pub customers: i64,
}

/// An order, as the HTML page lists it.
#[derive(Debug, Clone)]
pub(crate) struct Order {
    pub id: i64,
    pub product: i64,
    pub amount_cents: i64,
    pub created_at: i64,
}

/// What opening the database did.
#[derive(Debug, Clone)]
pub(crate) struct Opened {
    pub db: Db,
    /// How long seeding took, when this start seeded.
    pub seeded: Option<Duration>,
}

/// The database pool and the count of queries requests ran on it. A cheap `Clone`.
#[derive(Debug, Clone)]
pub(crate) struct Db {
    pool: SqlitePool,
    queries: Arc<AtomicU64>,
}

impl Db {
    /// Opens (creating if needed) the SQLite file at `path` and seeds it with `rows` orders unless
    /// a finished seed of that size is there already.
    pub async fn open(path: &Path, rows: u64) -> Result<Opened, Error> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| {
                std::io::Error::new(e.kind(), format!("creating {}: {e}", dir.display()))
            })?;
        }
        // No `journal_mode` here: the pool's connections find WAL in the file, where
        // `switch_to_wal` put it before any of them opens.
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(BUSY_TIMEOUT);
        let open_error = |source| Error::Open {
            path: path.to_owned(),
            source,
        };
        switch_to_wal(&options).await.map_err(open_error)?;
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await
            .map_err(open_error)?;
        let db = Db {
            pool,
            queries: Arc::new(AtomicU64::new(0)),
        };
        let done = seeded_rows(&mut *db.pool.acquire().await.map_err(open_error)?).await?;
        let started = Instant::now();
        let seeded = match done == Some(rows) {
            true => None,
            false => match db.seed(rows).await {
                Ok(seeded) => seeded.then(|| started.elapsed()),
                Err(Error::Db(e)) => return Err(open_error(e)),
                Err(e) => return Err(e),
            },
        };
        Ok(Opened { db, seeded })
    }

    /// Replaces the tables with `rows` orders by `max(rows / 100, 10)` users, in one transaction
    /// (all or nothing: `meta.rows` is written last, so an interrupted seed is redone).
    /// Returns false if another process finished the same seed while this one waited for the
    /// write lock (taken first, by `BEGIN IMMEDIATE`).
    async fn seed(&self, rows: u64) -> Result<bool, Error> {
        let users = (rows / 100).max(10);
        let mut rng = SplitMix64(0x5eed);
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        if seeded_rows(&mut tx).await? == Some(rows) {
            return Ok(false); // the transaction rolls back on drop: nothing was written
        }
        sqlx::raw_sql(
            "DROP TABLE IF EXISTS meta;
             DROP TABLE IF EXISTS orders;
             DROP TABLE IF EXISTS users;
             CREATE TABLE users (
                 id INTEGER PRIMARY KEY, name TEXT NOT NULL, email TEXT NOT NULL,
                 region INTEGER NOT NULL);
             CREATE TABLE orders (
                 id INTEGER PRIMARY KEY, user_id INTEGER NOT NULL, product INTEGER NOT NULL,
                 amount_cents INTEGER NOT NULL, created_at INTEGER NOT NULL);
             CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);",
        )
        .execute(&mut *tx)
        .await?;

        let mut next = 1u64;
        while next <= users {
            let end = (next + BATCH as u64).min(users + 1);
            let mut insert = QueryBuilder::new("INSERT INTO users (id, name, email, region) ");
            insert.push_values(next..end, |mut row, id| {
                row.push_bind(id as i64)
                    .push_bind(format!("user-{id}"))
                    .push_bind(format!("user{id}@example.com"))
                    .push_bind((id % 8) as i64);
            });
            insert.build().execute(&mut *tx).await?;
            next = end;
        }

        let mut left = rows;
        while left > 0 {
            let n = left.min(BATCH as u64);
            let mut insert = QueryBuilder::new(
                "INSERT INTO orders (user_id, product, amount_cents, created_at) ",
            );
            insert.push_values(0..n, |mut row, _| {
                row.push_bind(1 + (rng.next() % users) as i64)
                    .push_bind(1 + (rng.next() % PRODUCTS as u64) as i64)
                    .push_bind(100 + (rng.next() % 50_000) as i64)
                    .push_bind(EPOCH + (rng.next() % YEAR_SECS) as i64);
            });
            insert.build().execute(&mut *tx).await?;
            left -= n;
        }

        // The page's query (a user's latest orders) is indexed; the report's is deliberately not.
        sqlx::raw_sql("CREATE INDEX orders_by_user ON orders (user_id, created_at);")
            .execute(&mut *tx)
            .await?;
        sqlx::query("INSERT INTO meta (key, value) VALUES ('rows', ?)")
            .bind(rows as i64)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(true)
    }

    /// Queries requests have run since start (seeding and the startup measurement excluded).
    pub fn queries(&self) -> u64 {
        self.queries.load(Ordering::Relaxed)
    }

    fn count(&self, query: &'static str, started: Instant) {
        self.queries.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("webapp_db_queries_total", "query" => query).increment(1);
        metrics::histogram!("webapp_db_query_seconds", "query" => query)
            .record(started.elapsed().as_secs_f64());
    }

    /// Product `product`'s report: the expensive query, a scan of every order (no index on
    /// `product`) grouped by month.
    pub async fn report(&self, product: i64) -> Result<Report, Error> {
        check_product(product)?; // before counting: no query runs for a product that is not
        let started = Instant::now();
        let result = self.report_uncounted(product).await;
        self.count("report", started);
        result
    }

    /// The report query, not counted (the startup measurement).
    pub async fn report_uncounted(&self, product: i64) -> Result<Report, Error> {
        check_product(product)?;
        let rows = sqlx::query(
            "SELECT (created_at - ?2) / ?3 AS month, COUNT(*) AS orders,
                    SUM(amount_cents) AS revenue, COUNT(DISTINCT user_id) AS customers
             FROM orders WHERE product = ?1 GROUP BY month ORDER BY month",
        )
        .bind(product)
        .bind(EPOCH)
        .bind(MONTH_SECS)
        .fetch_all(&self.pool)
        .await?;
        let months: Vec<Month> = rows
            .iter()
            .map(|r| Month {
                month: r.get("month"),
                orders: r.get("orders"),
                revenue_cents: r.get("revenue"),
                customers: r.get("customers"),
            })
            .collect();
        Ok(Report {
            product,
            orders: months.iter().map(|m| m.orders).sum(),
            revenue_cents: months.iter().map(|m| m.revenue_cents).sum(),
            months,
        })
    }

    /// User `id`; [`Error::NotFound`] if there is none.
    pub async fn user(&self, id: i64) -> Result<User, Error> {
        let started = Instant::now();
        let row = sqlx::query("SELECT id, name, email, region FROM users WHERE id = ?")
            .bind(id)
            .fetch_optional(&self.pool)
            .await;
        self.count("user", started);
        row?.map(|r| user_of(&r))
            .ok_or_else(|| Error::NotFound(format!("user {id}")))
    }

    /// Sets the fields given of user `id` and returns the updated record; [`Error::NotFound`]
    /// if there is none.
    pub async fn update_user(
        &self,
        id: i64,
        name: Option<&str>,
        email: Option<&str>,
    ) -> Result<User, Error> {
        let started = Instant::now();
        let row = sqlx::query(
            "UPDATE users SET name = COALESCE(?1, name), email = COALESCE(?2, email)
             WHERE id = ?3 RETURNING id, name, email, region",
        )
        .bind(name)
        .bind(email)
        .bind(id)
        .fetch_optional(&self.pool)
        .await;
        self.count("update_user", started);
        row?.map(|r| user_of(&r))
            .ok_or_else(|| Error::NotFound(format!("user {id}")))
    }

    /// User `id`'s latest `limit` orders, newest first.
    pub async fn latest_orders(&self, user: i64, limit: i64) -> Result<Vec<Order>, Error> {
        let started = Instant::now();
        let rows = sqlx::query(
            "SELECT id, product, amount_cents, created_at FROM orders
             WHERE user_id = ? ORDER BY created_at DESC LIMIT ?",
        )
        .bind(user)
        .bind(limit)
        .fetch_all(&self.pool)
        .await;
        self.count("latest_orders", started);
        Ok(rows?
            .iter()
            .map(|r| Order {
                id: r.get("id"),
                product: r.get("product"),
                amount_cents: r.get("amount_cents"),
                created_at: r.get("created_at"),
            })
            .collect())
    }

    /// Closes the pool (waits for the connections to finish).
    pub async fn close(&self) {
        self.pool.close().await;
    }
}

/// How long a connection waits for another's lock (SQLite's busy timeout), and how long
/// [`switch_to_wal`] keeps retrying.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// Puts the database in WAL mode (the pool's readers do not block each other, nor a writer:
/// `PUT /users`). The mode is kept in the file, so this is done once, on one connection, before
/// the pool opens any.
///
/// Switching a file to WAL needs an exclusive lock that SQLite does not wait for: the
/// connection already holds a read lock, and the busy handler is not called for that upgrade
/// (it could deadlock). So when several services create the file at once, all but one can
/// get SQLITE_BUSY ("database is locked") at once, whatever the busy timeout. That error is
/// retried here, until [`BUSY_TIMEOUT`]; once one switch is done, the others find WAL in the
/// file and have nothing to change (no write lock needed). Where WAL cannot be used (no shared
/// memory), SQLite answers with the mode the file keeps, and the service runs in that.
async fn switch_to_wal(options: &SqliteConnectOptions) -> Result<(), sqlx::Error> {
    let mut conn = SqliteConnection::connect_with(options).await?;
    let deadline = Instant::now() + BUSY_TIMEOUT;
    let mut pause = Duration::from_millis(1);
    loop {
        match sqlx::query_scalar::<_, String>("PRAGMA journal_mode = WAL")
            .fetch_one(&mut conn)
            .await
        {
            Ok(_) => break,
            Err(e) if is_busy(&e) && Instant::now() < deadline => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(50));
            }
            Err(e) => return Err(e),
        }
    }
    conn.close().await
}

/// Whether `e` is SQLITE_BUSY (any of its extended codes: sqlx reports those).
fn is_busy(e: &sqlx::Error) -> bool {
    const SQLITE_BUSY: i32 = 5;
    e.as_database_error()
        .and_then(|e| e.code())
        .and_then(|code| code.parse::<i32>().ok())
        .is_some_and(|code| code & 0xff == SQLITE_BUSY)
}

/// The row count of a finished seed, if there is one.
async fn seeded_rows(conn: &mut SqliteConnection) -> Result<Option<u64>, Error> {
    let meta: Option<(String,)> =
        sqlx::query_as("SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'meta'")
            .fetch_optional(&mut *conn)
            .await?;
    if meta.is_none() {
        return Ok(None);
    }
    let rows: Option<(i64,)> = sqlx::query_as("SELECT value FROM meta WHERE key = 'rows'")
        .fetch_optional(&mut *conn)
        .await?;
    Ok(rows.map(|(n,)| n as u64))
}

fn check_product(product: i64) -> Result<(), Error> {
    if (1..=PRODUCTS).contains(&product) {
        Ok(())
    } else {
        Err(Error::NotFound(format!(
            "product {product} (products are 1..={PRODUCTS})"
        )))
    }
}

fn user_of(r: &sqlx::sqlite::SqliteRow) -> User {
    User {
        id: r.get("id"),
        name: r.get("name"),
        email: r.get("email"),
        region: r.get("region"),
    }
}

/// A small deterministic generator (SplitMix64), so every seed of N rows is the same data.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Removes an SQLite file and its WAL companions.
    fn remove_db(path: &Path) {
        for suffix in ["", "-wal", "-shm"] {
            let mut file = path.to_path_buf().into_os_string();
            file.push(suffix);
            let _ = std::fs::remove_file(file);
        }
    }

    /// Services starting on one new database at once, many times over: every open succeeds,
    /// exactly one of them seeds, and the file is in WAL mode. Two connections switching a new
    /// file to WAL at the same moment is a race SQLite does not wait out (the loser gets
    /// SQLITE_BUSY at once, whatever the busy timeout), so this opens four at once, on a fresh
    /// file each round: when each connection of the pools switched the mode itself, 20 runs of
    /// 20 failed ("database is locked"), at rounds 0 to 28.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_opens_of_a_new_database_all_succeed_and_seed_once() {
        const ROUNDS: usize = 50;
        for round in 0..ROUNDS {
            let path = std::env::temp_dir().join(format!(
                "newcache-webapp-unit-{}-{round}.sqlite",
                std::process::id()
            ));
            remove_db(&path);
            let opens = tokio::join!(
                Db::open(&path, 200),
                Db::open(&path, 200),
                Db::open(&path, 200),
                Db::open(&path, 200),
            );
            let mut seeds = 0;
            let mut dbs = Vec::new();
            for open in <[_; 4]>::from(opens) {
                match open {
                    Ok(opened) => {
                        seeds += usize::from(opened.seeded.is_some());
                        dbs.push(opened.db);
                    }
                    Err(e) => panic!("round {round}: {}", crate::error::chain(&e)),
                }
            }
            assert_eq!(seeds, 1, "round {round}");
            for db in &dbs {
                let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
                    .fetch_one(&db.pool)
                    .await
                    .unwrap();
                assert_eq!(mode, "wal", "round {round}");
            }
            for db in dbs {
                db.close().await;
            }
            remove_db(&path);
        }
    }
}
