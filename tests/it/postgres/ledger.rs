//! What only the PostgreSQL ledger promises, against a real PostgreSQL server: several
//! ledgers on one database (as several replicas) agree on capacity, request IDs and expiry
//! however they race; replicas starting together migrate once; a database that goes away
//! answers `Unavailable` and is used again when it is back, without reopening.

use crate::support;
use proxy_operator::ledger::DEFAULT_TENANT;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use proxy_operator::ledger::{
    AcquireOutcome, AcquireRequest, Clock, Ledger, LedgerConfig, LedgerError, ManualClock,
    POSTGRES_SCHEMA_VERSION, PostgresLedger, PostgresLedgerCollector, PostgresOptions, RequestKey,
};
use support::ledger::{candidates, granted, request, start};
use support::operator::metric_sum;
use support::postgres::{Database, Postgres};

const MINUTE: Duration = Duration::from_secs(60);

async fn open(database: &Database, clock: &Arc<ManualClock>) -> PostgresLedger {
    let options = PostgresOptions {
        password: None,
        pool_size: 8,
    };
    PostgresLedger::open(
        &database.url(),
        options,
        LedgerConfig::default(),
        clock.clone(),
    )
    .await
    .unwrap()
}

/// `N` ledgers on one fresh database of the shared server, as `N` replicas, with one clock.
async fn replicas<const N: usize>() -> Option<(Database, Arc<ManualClock>, [PostgresLedger; N])> {
    let database = Postgres::shared()?.database();
    let clock = Arc::new(ManualClock::new(start()));
    let mut ledgers = Vec::with_capacity(N);
    for _ in 0..N {
        ledgers.push(open(&database, &clock).await);
    }
    let ledgers = ledgers.try_into().ok()?;
    Some((database, clock, ledgers))
}

/// `ledger`'s answer to the acquire `request` makes, asked again after each `Overloaded`
/// (which decided nothing), as a crawler asks again after a 503: on a loaded machine a batch
/// may wait past its queue deadline.
async fn decided(
    ledger: &PostgresLedger,
    request: impl Fn() -> AcquireRequest,
) -> Result<AcquireOutcome, LedgerError> {
    let started = std::time::Instant::now();
    loop {
        match ledger.acquire(request()).await {
            Err(LedgerError::Overloaded { .. }) if started.elapsed() < support::DEADLINE => {}
            answer => return answer,
        }
    }
}

/// An acquire with request ID `id` for `fingerprint`.
fn keyed(pool: &proxy_operator::ledger::Candidates, id: &str, fingerprint: &str) -> AcquireRequest {
    AcquireRequest {
        request: Some(RequestKey {
            id: id.into(),
            fingerprint: fingerprint.into(),
        }),
        tenant: proxy_operator::ledger::Tenancy::unrestricted(),
        session: None,
        fallback_step: None,
        ..request(pool.clone(), "t.example", MINUTE)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_racing_for_few_slots_never_exceed_max_leases_nor_grant_twice() {
    let Some((database, _, replicas)) = replicas::<3>().await else {
        return;
    };
    // 5 proxies of 3 slots, 120 acquires at once spread over the three replicas.
    let pool = candidates(5, 3);
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..120 {
        let ledger = replicas[i % 3].clone();
        let pool = pool.clone();
        tasks.spawn(async move {
            decided(&ledger, || request(pool.clone(), "t.example", MINUTE)).await
        });
    }
    let mut granted_ids = HashSet::new();
    let mut per_proxy: HashMap<String, u32> = HashMap::new();
    let mut refused = 0;
    while let Some(outcome) = tasks.join_next().await {
        match outcome.unwrap() {
            Ok(AcquireOutcome::Granted(lease)) => {
                assert!(granted_ids.insert(lease.id.clone()), "{} twice", lease.id);
                *per_proxy.entry(lease.proxy.name).or_default() += 1;
            }
            Ok(AcquireOutcome::NoMatch(stats)) => {
                assert_eq!(stats.at_capacity, 5, "{stats:?}");
                refused += 1;
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(granted_ids.len(), 15, "{per_proxy:?}");
    assert_eq!(refused, 105);
    assert!(per_proxy.values().all(|&n| n == 3), "{per_proxy:?}");
    let over = database.psql(
        "SELECT count(*) FROM (SELECT proxy_uid FROM leases WHERE state = 'active' \
         GROUP BY proxy_uid HAVING count(*) > 3) o",
    );
    assert_eq!(over, "0");
    assert_eq!(database.psql("SELECT count(*) FROM leases"), "15");
    assert_eq!(
        database.psql("SELECT count(*) FROM lease_events WHERE kind = 'acquired'"),
        "15"
    );
    // Each replica reads its own grants at once and the others' after a refresh.
    let expected: u64 = 15;
    for replica in &replicas {
        let started = std::time::Instant::now();
        while replica.counts().active_total() != expected {
            assert!(
                started.elapsed() < support::DEADLINE,
                "{}",
                replica.counts().active_total()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A replica starts its selection from its own counts, which show another replica's writes
/// only after a refresh (a second): what those counts get wrong either way is decided on what
/// is committed. Each step runs well within the second (the clock is manual; the refresh is
/// real time), so these are the counts of before the other replica's write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_decides_on_what_is_committed_when_its_counts_are_behind() {
    let Some((_, _, [a, b])) = replicas::<2>().await else {
        return;
    };
    // One proxy with one slot.
    let pool = candidates(1, 1);
    for round in 0..3 {
        // b holds the slot, and its counts know; a releases it on b's behalf: b's counts
        // still show it held, and b's next acquire is granted, not refused.
        let held = granted(b.acquire(request(pool.clone(), "t.example", MINUTE)).await);
        a.release(&held.id, DEFAULT_TENANT).await.unwrap();
        let again = granted(b.acquire(request(pool.clone(), "t.example", MINUTE)).await);
        assert_ne!(again.id, held.id, "round {round}");
        // Now a's counts do not show b's grant: a's acquire is refused, and only one lease
        // holds the slot.
        match a.acquire(request(pool.clone(), "t.example", MINUTE)).await {
            Ok(AcquireOutcome::NoMatch(stats)) => assert_eq!(stats.at_capacity, 1, "{stats:?}"),
            other => panic!("round {round}: {other:?}"),
        }
        b.release(&again.id, DEFAULT_TENANT).await.unwrap();
    }
}

/// A replica's batches carry the acquires and releases that arrive together, and its scrape
/// shows how many batches carried how many writes (their ratio: what one transaction
/// amortises).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_count_the_acquires_and_releases_they_carry_and_the_scrape_shows_them() {
    let Some((_, _, [ledger])) = replicas::<1>().await else {
        return;
    };
    let registry = prometheus::Registry::new();
    registry
        .register(Box::new(
            PostgresLedgerCollector::new(ledger.clone()).unwrap(),
        ))
        .unwrap();
    let pool = candidates(10, 100);
    let mut acquires = tokio::task::JoinSet::new();
    for _ in 0..40 {
        let (ledger, pool) = (ledger.clone(), pool.clone());
        acquires.spawn(
            async move { granted(ledger.acquire(request(pool, "t.example", MINUTE)).await) },
        );
    }
    let mut releases = tokio::task::JoinSet::new();
    while let Some(lease) = acquires.join_next().await {
        let (ledger, lease) = (ledger.clone(), lease.unwrap());
        releases.spawn(async move { ledger.release(&lease.id, DEFAULT_TENANT).await });
    }
    while let Some(released) = releases.join_next().await {
        released.unwrap().unwrap();
    }
    let (batches, writes) = ledger.batched();
    assert_eq!(writes, 80, "{batches} batches");
    assert!((1..=80).contains(&batches), "{batches}");
    let mut text = String::new();
    prometheus::TextEncoder::new()
        .encode_utf8(&registry.gather(), &mut text)
        .unwrap();
    for (series, want) in [
        ("proxy_operator_ledger_batches_total", batches),
        ("proxy_operator_ledger_batched_writes_total", writes),
    ] {
        assert_eq!(
            metric_sum(&text, series, &[]),
            want as f64,
            "{series} in {text}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_id_replays_on_another_replica_until_its_lease_expires() {
    let Some((_, clock, [a, b])) = replicas::<2>().await else {
        return;
    };
    let pool = candidates(3, 1);
    let first = granted(a.acquire(keyed(&pool, "req-1", "fp")).await);
    match b.acquire(keyed(&pool, "req-1", "fp")).await {
        Ok(AcquireOutcome::Replayed(lease)) => assert_eq!(lease, first),
        other => panic!("{other:?}"),
    }
    let reused = b.acquire(keyed(&pool, "req-1", "other")).await;
    assert!(
        matches!(reused, Err(LedgerError::RequestIdReused { .. })),
        "{reused:?}"
    );
    // A renew on one replica moves the window for all; a release does not close it.
    b.renew(&first.id, DEFAULT_TENANT, 2 * MINUTE)
        .await
        .unwrap();
    a.release(&first.id, DEFAULT_TENANT).await.unwrap();
    clock.advance(MINUTE + Duration::from_secs(1));
    match a.acquire(keyed(&pool, "req-1", "fp")).await {
        Ok(AcquireOutcome::Replayed(lease)) => {
            assert_eq!(lease.id, first.id);
            assert_eq!(lease.state, proxy_operator::ledger::LeaseState::Released);
        }
        other => panic!("{other:?}"),
    }
    // Once the lease's window closed, the ID is free: decided afresh, on either replica.
    clock.advance(MINUTE);
    let second = granted(b.acquire(keyed(&pool, "req-1", "other")).await);
    assert_ne!(second.id, first.id);
    match a.acquire(keyed(&pool, "req-1", "other")).await {
        Ok(AcquireOutcome::Replayed(lease)) => assert_eq!(lease.id, second.id),
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_request_id_racing_on_replicas_gets_one_lease() {
    let Some((database, _, replicas)) = replicas::<2>().await else {
        return;
    };
    let pool = candidates(20, 5);
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..40 {
        let ledger = replicas[i % 2].clone();
        let pool = pool.clone();
        tasks.spawn(async move { decided(&ledger, || keyed(&pool, "same", "fp")).await });
    }
    let mut ids = HashSet::new();
    let mut grants = 0;
    while let Some(outcome) = tasks.join_next().await {
        match outcome.unwrap() {
            Ok(AcquireOutcome::Granted(lease)) => {
                grants += 1;
                ids.insert(lease.id);
            }
            Ok(AcquireOutcome::Replayed(lease)) => {
                ids.insert(lease.id);
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(grants, 1);
    assert_eq!(ids.len(), 1, "{ids:?}");
    assert_eq!(database.psql("SELECT count(*) FROM leases"), "1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_sweeping_at_once_record_each_expiry_once() {
    let Some((database, clock, replicas)) = replicas::<3>().await else {
        return;
    };
    let pool = candidates(50, 2);
    for i in 0..100 {
        granted(
            replicas[i % 3]
                .acquire(request(pool.clone(), "t.example", MINUTE))
                .await,
        );
    }
    clock.advance(2 * MINUTE);
    let sweeps = replicas.iter().map(|r| {
        let r = r.clone();
        tokio::spawn(async move { r.sweep().await.unwrap().expired })
    });
    let mut expired = 0;
    for sweep in sweeps {
        expired += sweep.await.unwrap();
    }
    assert_eq!(expired, 100);
    assert_eq!(
        database.psql("SELECT count(*) FROM lease_events WHERE kind = 'expired'"),
        "100"
    );
    assert_eq!(
        database.psql("SELECT count(*) FROM leases WHERE state = 'expired'"),
        "100"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_starting_together_migrate_once() {
    let Some(server) = Postgres::shared() else {
        return;
    };
    // A few rounds: replicas racing to create the schema's first table meet PostgreSQL's
    // catalog race only now and then.
    for _ in 0..4 {
        let database = server.database();
        let clock = Arc::new(ManualClock::new(start()));
        let opening: Vec<_> = (0..6)
            .map(|_| {
                let (database, clock) = (database.clone(), clock.clone());
                tokio::spawn(async move { open(&database, &clock).await })
            })
            .collect();
        for ledger in opening {
            ledger.await.unwrap();
        }
        assert_eq!(
            database.psql("SELECT version FROM ledger_schema"),
            POSTGRES_SCHEMA_VERSION.to_string()
        );
        assert_eq!(database.psql("SELECT count(*) FROM ledger_schema"), "1");
        assert_eq!(
            database.psql("SELECT count(*) FROM pg_tables WHERE tablename = 'leases'"),
            "1"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_that_goes_down_answers_unavailable_and_is_used_again_when_back() {
    let Some(server) = Postgres::start() else {
        return;
    };
    let database = server.database();
    let clock = Arc::new(ManualClock::new(start()));
    let ledger = open(&database, &clock).await;
    let pool = candidates(3, 5);
    let before = granted(
        ledger
            .acquire(request(pool.clone(), "t.example", MINUTE))
            .await,
    );
    assert_eq!(ledger.database().map(|d| d.up), Some(true));

    server.stop();
    let refused = ledger
        .acquire(request(pool.clone(), "t.example", MINUTE))
        .await;
    match refused {
        Err(LedgerError::Unavailable { retry_after, .. }) => {
            assert_eq!(retry_after, Duration::from_secs(1));
        }
        other => panic!("{other:?}"),
    }
    let status = ledger.database().unwrap();
    assert!(!status.up);
    assert!(
        status
            .error
            .is_some_and(|e| !e.contains(database.password()))
    );
    assert!(matches!(
        ledger.release(&before.id, DEFAULT_TENANT).await,
        Err(LedgerError::Unavailable { .. })
    ));
    // Readiness stays: every replica shares the database.
    ledger.check().await.unwrap();
    // What was counted before is still counted while the database is away.
    assert_eq!(ledger.counts().active_total(), 1);

    server.resume();
    let started = std::time::Instant::now();
    let after = loop {
        match ledger
            .acquire(request(pool.clone(), "t.example", MINUTE))
            .await
        {
            Ok(outcome) => break granted(Ok(outcome)),
            Err(LedgerError::Unavailable { .. }) => {
                assert!(started.elapsed() < support::DEADLINE, "never recovered");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(other) => panic!("{other}"),
        }
    };
    assert_ne!(after.id, before.id);
    assert_eq!(ledger.database().map(|d| d.up), Some(true));
    assert_eq!(
        ledger
            .get(&before.id, DEFAULT_TENANT)
            .await
            .unwrap()
            .map(|l| l.id),
        Some(before.id)
    );
    assert_eq!(
        database.psql("SELECT count(*) FROM leases WHERE state = 'active'"),
        "2"
    );
    let _ = clock.now();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_or_a_bad_url_is_refused_at_open_without_showing_the_password() {
    let Some(server) = Postgres::shared() else {
        return;
    };
    let database = server.database();
    let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(start()));
    let wrong = database.with_password("not-the-password");
    let err = PostgresLedger::open(
        &wrong.url(),
        PostgresOptions {
            password: None,
            pool_size: 2,
        },
        LedgerConfig::default(),
        clock.clone(),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(err.contains("password authentication failed"), "{err}");
    assert!(!err.contains("not-the-password"), "{err}");
    // The password given apart from the URL wins over it.
    let ledger = PostgresLedger::open(
        &wrong.url(),
        PostgresOptions {
            password: Some(database.password().to_owned()),
            pool_size: 2,
        },
        LedgerConfig::default(),
        clock.clone(),
    )
    .await;
    assert!(ledger.is_ok(), "{ledger:?}");
    let err = PostgresLedger::open(
        "postgres://db/ledger?nonsense=1",
        PostgresOptions::default(),
        LedgerConfig::default(),
        clock,
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(err.contains("not a PostgreSQL connection URL"), "{err}");
}
