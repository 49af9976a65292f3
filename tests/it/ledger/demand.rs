//! ProxyPools' unmet demand in the ledger, each behaviour test run on both backends (a real
//! SQLite file, a fresh database on the real PostgreSQL server): refusals counted per pool
//! per bucket, read back over a window, swept after the retention, kept across a restart.
//! Then what each backend adds: on PostgreSQL, replicas count into the same rows and read
//! each other's refusals (a refusal on a follower reaches the leader), and an existing
//! database is migrated; on SQLite, demand is a write of the writer's batches like any other,
//! without a queue deadline. Time only moves through the ledger's `ManualClock`.

use crate::support;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use proxy_operator::ledger::{
    DEMAND_BUCKET, DEMAND_RETENTION, Ledger, LedgerConfig, LedgerError, ManualClock,
    POSTGRES_SCHEMA_VERSION, PostgresLedger, PostgresOptions, SweepStats,
};
use support::ledger::{Backend, Fixture, candidates, granted, request, start};
use support::postgres::{Database, Postgres};
use support::{FileLock, queue, wait_until};

const MINUTE: Duration = Duration::from_secs(60);

fn config() -> LedgerConfig {
    LedgerConfig {
        max_ttl: Duration::from_secs(3600),
        cooldown: 10 * MINUTE,
        history_retention: Duration::from_secs(24 * 3600),
        ..LedgerConfig::default()
    }
}

/// Pool keys, as the callers pass them.
fn pools(names: &[&str]) -> Vec<String> {
    names.iter().map(|name| (*name).to_owned()).collect()
}

/// The demand a map holds, for comparing with [`Ledger::recent_demand`]'s answer.
fn demand(counts: &[(&str, u64)]) -> HashMap<String, u64> {
    counts
        .iter()
        .map(|(pool, count)| ((*pool).to_owned(), *count))
        .collect()
}

/// Milliseconds after [`start`] (which is on a bucket boundary).
fn at(ms: i64) -> i64 {
    start().as_millisecond() + ms
}

impl Fixture {
    /// `(pool, bucket_start_ms, requests)` of every row of `pool_demand`, in key order, read
    /// behind the ledger's back.
    fn demand_rows(&self) -> Vec<(String, i64, i64)> {
        self.rows("SELECT pool, bucket_start_ms, requests FROM pool_demand ORDER BY pool, 2")
            .into_iter()
            .map(|row| match <[Option<String>; 3]>::try_from(row) {
                Ok([Some(pool), Some(bucket), Some(requests)]) => {
                    (pool, bucket.parse().unwrap(), requests.parse().unwrap())
                }
                other => panic!("not a demand row: {other:?}"),
            })
            .collect()
    }

    async fn refuse_for(&self, names: &[&str]) {
        self.ledger.record_demand(&pools(names)).await.unwrap();
    }

    async fn demand_over(&self, window: Duration) -> HashMap<String, u64> {
        self.ledger.recent_demand(window).await.unwrap()
    }

    /// Sets the clock `ms` after [`start`].
    fn clock_at(&self, ms: u64) {
        self.clock.set(start() + Duration::from_millis(ms));
    }
}

async fn demand_adds_up_per_pool_across_calls_and_across_pools_in_one_call(backend: Backend) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
    for _ in 0..3 {
        f.refuse_for(&["crawl/a"]).await;
    }
    f.refuse_for(&["crawl/a", "crawl/b"]).await;
    f.clock_at(9_999);
    f.refuse_for(&["other/c", "crawl/b"]).await;
    // One request is one request, however often a pool is named in it.
    f.refuse_for(&["crawl/b", "crawl/b"]).await;
    assert_eq!(
        f.demand_over(MINUTE).await,
        demand(&[("crawl/a", 4), ("crawl/b", 3), ("other/c", 1)])
    );
    // Aggregated: one row per pool for the bucket.
    assert_eq!(
        f.demand_rows(),
        [
            ("crawl/a".to_owned(), at(0), 4),
            ("crawl/b".to_owned(), at(0), 3),
            ("other/c".to_owned(), at(0), 1),
        ]
    );
    // The next bucket starts a row of its own.
    f.clock_at(10_000);
    f.refuse_for(&["crawl/a"]).await;
    assert_eq!(f.count("SELECT COUNT(*) FROM pool_demand"), 4);
    assert_eq!(
        f.count(&format!(
            "SELECT requests FROM pool_demand WHERE pool = 'crawl/a' AND bucket_start_ms = {}",
            at(10_000)
        )),
        1
    );
    assert_eq!(f.demand_over(MINUTE).await["crawl/a"], 5);
    // Demand is no lease: the counts do not move.
    assert_eq!(f.ledger.counts().active_total(), 0);
    f.self_check().await;
}

async fn an_empty_slice_records_nothing(backend: Backend) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
    f.ledger.record_demand(&[]).await.unwrap();
    assert_eq!(f.count("SELECT COUNT(*) FROM pool_demand"), 0);
    assert_eq!(f.demand_over(DEMAND_RETENTION).await, HashMap::new());
    if backend == Backend::Sqlite {
        assert_eq!(
            f.sqlite().writer_stats().writes(),
            0,
            "nothing was queued for the writer"
        );
    }
}

async fn recent_demand_counts_only_the_buckets_overlapping_the_window(backend: Backend) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
    assert_eq!(DEMAND_BUCKET, Duration::from_secs(10));
    // Buckets at 0 s (a), 10 s (a, b) and 30 s (b).
    f.refuse_for(&["crawl/a"]).await;
    f.clock_at(15_000);
    f.refuse_for(&["crawl/a", "crawl/b"]).await;
    f.clock_at(35_000);
    f.refuse_for(&["crawl/b"]).await;

    let secs = Duration::from_secs;
    // At 35 s: the last 5 s and the last 10 s reach only the bucket at 30 s (the one at
    // 20 s has nothing), as does an empty window: the bucket holding now.
    assert_eq!(f.demand_over(secs(5)).await, demand(&[("crawl/b", 1)]));
    assert_eq!(f.demand_over(secs(10)).await, demand(&[("crawl/b", 1)]));
    assert_eq!(
        f.demand_over(Duration::ZERO).await,
        demand(&[("crawl/b", 1)])
    );
    // The last 25 s start at 10 s: the bucket at 10 s, not the one ending there.
    assert_eq!(
        f.demand_over(secs(25)).await,
        demand(&[("crawl/a", 1), ("crawl/b", 2)])
    );
    assert_eq!(
        f.demand_over(Duration::from_millis(25_001)).await,
        demand(&[("crawl/a", 2), ("crawl/b", 2)])
    );
    // Later, a minute that holds none of them reads nothing.
    f.clock_at(100_000);
    assert_eq!(f.demand_over(MINUTE).await, HashMap::new());
    assert_eq!(
        f.demand_over(secs(91)).await,
        demand(&[("crawl/a", 2), ("crawl/b", 2)])
    );
    // A clock behind the rows (another replica's ran ahead) counts no bucket that starts
    // after its now.
    f.clock_at(5_000);
    assert_eq!(f.demand_over(MINUTE).await, demand(&[("crawl/a", 1)]));
}

async fn sweep_drops_demand_buckets_older_than_the_retention_and_keeps_newer_ones(
    backend: Backend,
) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
    assert_eq!(DEMAND_RETENTION, Duration::from_secs(600));
    // Buckets at 0 s (a), 10 s (a, b) and 300 s (b).
    f.refuse_for(&["crawl/a"]).await;
    f.clock_at(10_000);
    f.refuse_for(&["crawl/a", "crawl/b"]).await;
    f.clock_at(300_000);
    f.refuse_for(&["crawl/b"]).await;
    assert_eq!(f.ledger.sweep().await.unwrap(), SweepStats::default());

    // At 610 s the last 10 minutes start at 10 s: the bucket at 0 s ended then and goes.
    f.clock_at(610_000);
    assert_eq!(
        f.ledger.sweep().await.unwrap(),
        SweepStats {
            demand_pruned: 1,
            ..SweepStats::default()
        }
    );
    assert_eq!(
        f.demand_over(DEMAND_RETENTION).await,
        demand(&[("crawl/a", 1), ("crawl/b", 2)])
    );
    // The bucket at 10 s is kept while the retention overlaps it, to its last millisecond.
    f.clock_at(619_999);
    assert_eq!(f.ledger.sweep().await.unwrap().demand_pruned, 0);
    f.clock_at(620_000);
    assert_eq!(f.ledger.sweep().await.unwrap().demand_pruned, 2);
    assert_eq!(f.demand_rows(), [("crawl/b".to_owned(), at(300_000), 1)]);
    assert_eq!(
        f.demand_over(2 * DEMAND_RETENTION).await,
        demand(&[("crawl/b", 1)])
    );
    assert_eq!(f.ledger.sweep().await.unwrap(), SweepStats::default());
    f.clock_at(910_000);
    assert_eq!(f.ledger.sweep().await.unwrap().demand_pruned, 1);
    assert_eq!(f.count("SELECT COUNT(*) FROM pool_demand"), 0);
}

async fn demand_survives_reopening_the_ledger(backend: Backend) {
    let Some(mut f) = Fixture::on(backend, config()).await else {
        return;
    };
    f.refuse_for(&["crawl/a", "crawl/b"]).await;
    f.refuse_for(&["crawl/a"]).await;
    f.reopen().await;
    assert_eq!(
        f.demand_over(MINUTE).await,
        demand(&[("crawl/a", 2), ("crawl/b", 1)])
    );
    // Counting goes on in the same row.
    f.refuse_for(&["crawl/a"]).await;
    assert_eq!(
        f.demand_rows(),
        [
            ("crawl/a".to_owned(), at(0), 3),
            ("crawl/b".to_owned(), at(0), 1)
        ]
    );
    f.self_check().await;
}

crate::on_both_backends!(
    demand_adds_up_per_pool_across_calls_and_across_pools_in_one_call,
    an_empty_slice_records_nothing,
    recent_demand_counts_only_the_buckets_overlapping_the_window,
    sweep_drops_demand_buckets_older_than_the_retention_and_keeps_newer_ones,
    demand_survives_reopening_the_ledger,
);

// What only PostgreSQL promises: replicas share the demand.

async fn open_postgres(database: &Database, clock: &Arc<ManualClock>) -> PostgresLedger {
    let options = PostgresOptions {
        password: None,
        pool_size: 8,
    };
    PostgresLedger::open(&database.url(), options, config(), clock.clone())
        .await
        .unwrap()
}

/// Records `names` on `ledger`, again while the pool has no connection free in time
/// (`Overloaded`: nothing was recorded).
async fn record_retrying(ledger: &PostgresLedger, names: &[String]) {
    loop {
        match ledger.record_demand(names).await {
            Ok(()) => return,
            Err(LedgerError::Overloaded { .. }) => tokio::task::yield_now().await,
            Err(other) => panic!("record_demand: {other}"),
        }
    }
}

/// A refusal on a follower reaches the leader: two ledgers on one database (two replicas)
/// count into the same rows, at once, and each reads what the other recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_on_one_postgres_database_see_each_others_demand() {
    const TASKS: usize = 4;
    const REFUSALS: usize = 50;
    let Some(server) = Postgres::shared() else {
        return;
    };
    let database = server.database();
    let clock = Arc::new(ManualClock::new(start()));
    let leader = open_postgres(&database, &clock).await;
    let follower = open_postgres(&database, &clock).await;

    follower.record_demand(&pools(&["crawl/a"])).await.unwrap();
    assert_eq!(
        leader.recent_demand(MINUTE).await.unwrap(),
        demand(&[("crawl/a", 1)]),
        "the leader reads the follower's refusal at once"
    );
    leader.record_demand(&pools(&["crawl/b"])).await.unwrap();
    assert_eq!(
        follower.recent_demand(MINUTE).await.unwrap(),
        demand(&[("crawl/a", 1), ("crawl/b", 1)])
    );

    // Both replicas counting refusals of the same two pools at once, named in either order
    // (each statement takes the rows' locks in pool order: no deadlock), lose no count.
    let workers: Vec<_> = (0..2 * TASKS)
        .map(|i| {
            let ledger = if i % 2 == 0 {
                leader.clone()
            } else {
                follower.clone()
            };
            let names = if i % 4 < 2 {
                pools(&["crawl/a", "crawl/b"])
            } else {
                pools(&["crawl/b", "crawl/a"])
            };
            tokio::spawn(async move {
                for _ in 0..REFUSALS {
                    record_retrying(&ledger, &names).await;
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }
    let each = 1 + (2 * TASKS * REFUSALS) as u64;
    let expected = demand(&[("crawl/a", each), ("crawl/b", each)]);
    assert_eq!(leader.recent_demand(MINUTE).await.unwrap(), expected);
    assert_eq!(follower.recent_demand(MINUTE).await.unwrap(), expected);
    assert_eq!(database.psql("SELECT count(*) FROM pool_demand"), "2");
    // Either replica's sweep keeps what is recent, and both see its result.
    clock.advance(DEMAND_RETENTION + DEMAND_BUCKET);
    assert_eq!(follower.sweep().await.unwrap().demand_pruned, 2);
    assert_eq!(leader.recent_demand(MINUTE).await.unwrap(), HashMap::new());
    assert!(leader.database().is_some_and(|status| status.up));
}

/// A database the previous release created (schema version 1) gets the demand table at the
/// next start, and keeps its leases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_1_postgres_database_is_migrated_and_records_demand() {
    let Some(server) = Postgres::shared() else {
        return;
    };
    let database = server.database();
    let at = start().as_millisecond();
    database.psql(&format!(
        "{} CREATE TABLE ledger_schema (id INT NOT NULL PRIMARY KEY CHECK (id = 1), \
         version INT NOT NULL); INSERT INTO ledger_schema VALUES (1, 1); \
         INSERT INTO leases (id, proxy_namespace, proxy_name, proxy_uid, state, acquired_at, \
         expires_at, ttl_ms) VALUES ('old-held', 'crawl', 'p0', 'uid-p0', 'active', {at}, \
         {exp}, 600000);",
        include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/migrations/postgres/0001_lease_ledger.sql"
        )),
        exp = at + 600_000,
    ));
    let clock = Arc::new(ManualClock::new(start()));
    let ledger = open_postgres(&database, &clock).await;
    assert_eq!(POSTGRES_SCHEMA_VERSION, 5);
    assert_eq!(
        database.psql("SELECT version FROM ledger_schema"),
        POSTGRES_SCHEMA_VERSION.to_string()
    );
    assert_eq!(ledger.counts().active_total(), 1, "the old lease counts");
    assert_eq!(
        database.psql("SELECT tenant FROM leases WHERE id = 'old-held'"),
        "default",
        "a lease from before tenants is the default tenant's"
    );
    ledger.record_demand(&pools(&["crawl/a"])).await.unwrap();
    assert_eq!(
        ledger.recent_demand(MINUTE).await.unwrap(),
        demand(&[("crawl/a", 1)])
    );
}

// What only SQLite promises: demand is a write of the writer's batches.

/// Demand joins the batch queued with it (group commit), and has no queue deadline: it is
/// recorded even when it waited longer than the acquires, which are refused.
#[tokio::test]
async fn sqlite_demand_joins_the_writers_batch_and_has_no_queue_deadline() {
    let f = Fixture::new(LedgerConfig {
        queue_deadline: Duration::from_secs(2),
        ..config()
    });
    let pool = candidates(2, 10);
    let acquire = || Box::pin(f.ledger.acquire(request(pool.clone(), "t.example", MINUTE)));
    let refused = pools(&["crawl/a"]);
    let record = || Box::pin(f.ledger.record_demand(&refused));

    // One batch: an acquire, a refusal's demand, another acquire.
    let lock = FileLock::take(&f.path);
    let mut first = acquire();
    assert!(queue(&mut first).await.is_none());
    wait_until("the writer takes the first write", || {
        f.sqlite().queue_depth() == 0
    })
    .await;
    let mut demanded = record();
    let mut second = acquire();
    assert!(queue(&mut demanded).await.is_none());
    assert!(queue(&mut second).await.is_none());
    assert_eq!(f.count("SELECT COUNT(*) FROM pool_demand"), 0);
    lock.release();
    granted(first.await);
    demanded.await.unwrap();
    granted(second.await);
    let stats = f.sqlite().writer_stats();
    assert_eq!(stats.batches, 1, "{stats:?}");
    assert_eq!(stats.batch_sizes.get(3), Some(&1), "{stats:?}");
    assert_eq!(f.demand_over(MINUTE).await, demand(&[("crawl/a", 1)]));

    // Past the queue deadline: the acquire is refused, the demand still counted.
    let lock = FileLock::take(&f.path);
    let mut late = acquire();
    assert!(queue(&mut late).await.is_none());
    wait_until("the writer takes the late write", || {
        f.sqlite().queue_depth() == 0
    })
    .await;
    let mut demanded = record();
    assert!(queue(&mut demanded).await.is_none());
    f.clock.advance(Duration::from_secs(3));
    lock.release();
    assert!(
        matches!(late.await, Err(LedgerError::Overloaded { .. })),
        "the acquire waited past its deadline"
    );
    demanded.await.unwrap();
    assert_eq!(f.sqlite().writer_stats().refused_deadline, 1);
    assert_eq!(f.demand_over(MINUTE).await, demand(&[("crawl/a", 2)]));
    f.self_check().await;
}

/// A refusal's demand is bounded by the writer's queue like every write: refused at once when
/// the queue is full, never waiting for room.
#[tokio::test]
async fn sqlite_demand_is_refused_at_once_when_the_writers_queue_is_full() {
    const CAPACITY: usize = 2;
    let f = Fixture::new(LedgerConfig {
        queue_capacity: CAPACITY,
        ..config()
    });
    let pool = candidates(2, 10);
    let lock = FileLock::take(&f.path);
    let mut first = Box::pin(f.ledger.acquire(request(pool.clone(), "t.example", MINUTE)));
    assert!(queue(&mut first).await.is_none());
    wait_until("the writer takes the first write", || {
        f.sqlite().queue_depth() == 0
    })
    .await;
    let refused = pools(&["crawl/a"]);
    let mut queued: Vec<_> = (0..CAPACITY)
        .map(|_| Box::pin(f.ledger.record_demand(&refused)))
        .collect();
    for write in &mut queued {
        assert!(queue(write).await.is_none(), "the queue has room");
    }
    let mut excess = Box::pin(f.ledger.record_demand(&refused));
    assert!(
        matches!(
            queue(&mut excess).await,
            Some(Err(LedgerError::Overloaded { .. }))
        ),
        "refused on its first poll"
    );
    lock.release();
    granted(first.await);
    for write in queued {
        write.await.unwrap();
    }
    assert_eq!(f.demand_over(MINUTE).await, demand(&[("crawl/a", 2)]));
}

/// A batch that fails takes its demand with it: the refusal is answered with the batch's
/// error and nothing of it is in the file.
#[tokio::test]
async fn sqlite_demand_in_a_failed_batch_is_not_recorded() {
    let f = Fixture::new(config());
    rusqlite::Connection::open(&f.path)
        .unwrap()
        .execute_batch(
            "CREATE TRIGGER poison BEFORE INSERT ON leases WHEN NEW.target = 'poison.example' \
             BEGIN SELECT RAISE(ABORT, 'poisoned lease'); END;",
        )
        .unwrap();
    let pool = candidates(2, 10);
    let refused = pools(&["crawl/a"]);
    let lock = FileLock::take(&f.path);
    let mut demanded = Box::pin(f.ledger.record_demand(&refused));
    assert!(queue(&mut demanded).await.is_none());
    wait_until("the writer takes the demand", || {
        f.sqlite().queue_depth() == 0
    })
    .await;
    let mut poisoned = Box::pin(
        f.ledger
            .acquire(request(pool.clone(), "poison.example", MINUTE)),
    );
    assert!(queue(&mut poisoned).await.is_none());
    lock.release();
    for answer in [demanded.await.map(drop), poisoned.await.map(drop)] {
        match answer {
            Err(LedgerError::BatchFailed(error)) => {
                assert!(error.to_string().contains("poisoned lease"), "{error}")
            }
            other => panic!("expected the batch to fail, got {other:?}"),
        }
    }
    assert_eq!(f.count("SELECT COUNT(*) FROM pool_demand"), 0);
    assert_eq!(f.demand_over(MINUTE).await, HashMap::new());
    // The next refusal is recorded as usual.
    f.refuse_for(&["crawl/a"]).await;
    assert_eq!(f.demand_over(MINUTE).await, demand(&[("crawl/a", 1)]));
}
