//! `Ledger::end_leases` on both backends (a real SQLite file, a fresh PostgreSQL database):
//! when the operator loses, stops or deletes a proxy's machine, every lease counting on that
//! proxy ends at once as `released` with a reason, the replacement gets the proxy's full
//! capacity straight away, and the `leases` table and the `lease_history` view say why the
//! leases ended. Then what only the SQLite ledger does: its writer's batches around an end,
//! migrating an older file, a failed batch, a full file. Time only moves through the ledger's
//! `ManualClock`.

use crate::support;
use proxy_operator::ledger::DEFAULT_TENANT;

use std::sync::Arc;
use std::time::Duration;

use proxy_operator::ledger::{
    AcquireOutcome, AcquireRequest, Candidate, Clock, Lease, LeaseReport, LeaseState, Ledger,
    LedgerConfig, LedgerError, MIN_MAX_SIZE, ManualClock, ReportResult, RequestKey, SCHEMA_VERSION,
    SqliteLedger, SqliteOptions,
};
use support::ledger::{Backend, Fixture, candidate, count, granted, no_match, request, start};
use support::{FileLock, queue, sqlite3, wait_until};

const MINUTE: Duration = Duration::from_secs(60);

fn config() -> LedgerConfig {
    LedgerConfig {
        cooldown: 10 * MINUTE,
        ..LedgerConfig::default()
    }
}

/// What only these tests do with the fixture's ledger.
impl Fixture {
    /// `count` leases on `proxy` alone, for `ttl`.
    async fn hold(&self, proxy: &Candidate, count: usize, ttl: Duration) -> Vec<Lease> {
        let mut leases = Vec::new();
        for _ in 0..count {
            let outcome = self
                .ledger
                .acquire(request(std::slice::from_ref(proxy), "t.example", ttl))
                .await;
            leases.push(granted(outcome));
        }
        leases
    }

    /// Stops the ledger as a stopping operator does and opens it again: on SQLite its writer
    /// finishes before the file is opened again (unlike a bare `reopen`, which opens the file
    /// before the old handle stops).
    async fn shut_down_and_reopen(&mut self) {
        if self.backend == Backend::Sqlite {
            let ledger = self.sqlite().clone();
            tokio::task::spawn_blocking(move || ledger.shutdown())
                .await
                .unwrap();
        }
        self.reopen().await;
    }
}

/// Text cells, for comparing with [`Fixture::rows`].
fn cells<const N: usize>(row: [Option<&str>; N]) -> Vec<Option<String>> {
    row.into_iter().map(|c| c.map(str::to_owned)).collect()
}

/// Sorted lease IDs.
fn ids(leases: &[Lease]) -> Vec<String> {
    let mut ids: Vec<String> = leases.iter().map(|l| l.id.clone()).collect();
    ids.sort();
    ids
}

async fn ending_a_proxys_leases_releases_all_of_them_and_no_other_proxys(backend: Backend) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
    let (a, b) = (candidate("a", 5), candidate("b", 5));
    let on_a = f.hold(&a, 4, MINUTE).await;
    let on_b = f.hold(&b, 2, MINUTE).await;
    assert_eq!(f.ledger.counts().active_count("uid-a"), 4);
    f.clock.advance(Duration::from_secs(5));

    let ended = f.ledger.end_leases("uid-a", "machine_lost").await.unwrap();

    assert_eq!(ended, 4);
    assert_eq!(f.ledger.counts().active_count("uid-a"), 0);
    assert_eq!(f.ledger.counts().active_count("uid-b"), 2);
    assert_eq!(f.ledger.counts().active_total(), 2);
    let now = f.clock.now();
    for lease in &on_a {
        let read = f
            .ledger
            .get(&lease.id, DEFAULT_TENANT)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(read.state, LeaseState::Released, "{}", lease.id);
        assert_eq!(read.released_at, Some(now));
        assert_eq!(read.release_reason.as_deref(), Some("machine_lost"));
        assert_eq!(
            (read.expires_at, read.target.as_deref()),
            (lease.expires_at, Some("t.example")),
            "the rest of the lease is as it was"
        );
    }
    for lease in &on_b {
        assert_eq!(
            f.ledger
                .get(&lease.id, DEFAULT_TENANT)
                .await
                .unwrap()
                .as_ref(),
            Some(lease)
        );
    }
    assert_eq!(
        f.count("SELECT COUNT(*) FROM leases WHERE proxy_uid = 'uid-b' AND state = 'active'"),
        2
    );
    assert_eq!(
        f.count("SELECT COUNT(*) FROM lease_events WHERE kind = 'released'"),
        4
    );
    assert_eq!(
        f.count(
            "SELECT COUNT(*) FROM lease_events WHERE kind = 'released' \
             AND reason = 'machine_lost' AND proxy_uid = 'uid-a'"
        ),
        4
    );
    f.self_check().await;
}

async fn the_replacement_gets_the_proxys_full_capacity_at_once(backend: Backend) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
    let a = candidate("a", 3);
    f.hold(&a, 3, 10 * MINUTE).await;
    no_match(
        f.ledger
            .acquire(request(std::slice::from_ref(&a), "t.example", MINUTE))
            .await,
    );

    assert_eq!(
        f.ledger.end_leases("uid-a", "machine_gone").await.unwrap(),
        3
    );

    // No sweep, no waiting: the three slots are free now.
    assert_eq!(f.ledger.counts().active_counts().get("uid-a"), None);
    let again = f.hold(&a, 3, MINUTE).await;
    assert_eq!(again.len(), 3);
    assert_eq!(f.ledger.counts().active_count("uid-a"), 3);
    no_match(
        f.ledger
            .acquire(request(std::slice::from_ref(&a), "t.example", MINUTE))
            .await,
    );
    f.self_check().await;
}

/// Acquires queued right behind the end, in the same batch, already see the freed slots: the
/// writer decides in arrival order against memory the end has just changed.
#[tokio::test]
async fn acquires_in_the_same_batch_after_the_end_get_the_freed_slots() {
    let f = Fixture::new(config());
    let a = candidate("a", 2);
    let held = f.hold(&a, 2, 10 * MINUTE).await;

    let lock = FileLock::take(&f.path);
    let mut before = Box::pin(f.ledger.acquire(request(
        std::slice::from_ref(&a),
        "t.example",
        MINUTE,
    )));
    assert!(queue(&mut before).await.is_none());
    wait_until("the writer takes the first write", || {
        f.sqlite().queue_depth() == 0
    })
    .await;
    let mut end = Box::pin(f.ledger.end_leases("uid-a", "machine_lost"));
    let mut after: Vec<_> = (0..3)
        .map(|_| {
            Box::pin(
                f.ledger
                    .acquire(request(std::slice::from_ref(&a), "t.example", MINUTE)),
            )
        })
        .collect();
    assert!(queue(&mut end).await.is_none());
    for acquire in &mut after {
        assert!(queue(acquire).await.is_none());
    }
    lock.release();

    no_match(before.await);
    assert_eq!(end.await.unwrap(), 2);
    let mut after = after.into_iter();
    for acquire in after.by_ref().take(2) {
        granted(acquire.await);
    }
    for acquire in after {
        no_match(acquire.await);
    }
    for lease in &held {
        let read = f
            .ledger
            .get(&lease.id, DEFAULT_TENANT)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(read.state, LeaseState::Released);
    }
    assert_eq!(f.ledger.counts().active_count("uid-a"), 2);
    let stats = f.sqlite().writer_stats();
    assert!(stats.batch_sizes.get(5) >= Some(&1), "{stats:?}");
    f.self_check().await;
}

async fn the_reason_shows_in_leases_and_lease_history(backend: Backend) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
    let (a, b) = (candidate("a", 5), candidate("b", 5));
    let on_a = f.hold(&a, 2, MINUTE).await;
    let on_b = f.hold(&b, 1, MINUTE).await;
    f.clock.advance(Duration::from_millis(1500));
    f.ledger
        .end_leases("uid-a", "machine_stopped")
        .await
        .unwrap();

    let a_ids = ids(&on_a);
    let mut leases = f.rows(
        "SELECT id, state, release_reason, released_at FROM leases WHERE proxy_uid = 'uid-a'",
    );
    leases.sort();
    let ended_at = f.clock.now().as_millisecond().to_string();
    let expected: Vec<_> = a_ids
        .iter()
        .map(|id| {
            cells([
                Some(id),
                Some("released"),
                Some("machine_stopped"),
                Some(&ended_at),
            ])
        })
        .collect();
    assert_eq!(leases, expected);
    let b_row = f.rows(&format!(
        "SELECT state, release_reason, released_at FROM leases WHERE id = '{}'",
        on_b[0].id
    ));
    assert_eq!(b_row, [cells([Some("active"), None, None])]);

    let history = f.rows(
        "SELECT lease_id, kind, proxy, target, reason, at, expires FROM lease_history \
         WHERE proxy_uid = 'uid-a' ORDER BY seq",
    );
    // Acquired in acquisition order, ended in lease-ID order (IDs of one millisecond sort by
    // their random part); the view renders the times in ISO 8601 with milliseconds.
    let (acquired, ended, expires) = (
        "2026-01-01T00:00:00.000Z",
        "2026-01-01T00:00:01.500Z",
        "2026-01-01T00:01:00.000Z",
    );
    let mut expected: Vec<_> = on_a
        .iter()
        .map(|lease| {
            cells([
                Some(&lease.id),
                Some("acquired"),
                Some("crawl/a"),
                Some("t.example"),
                None,
                Some(acquired),
                Some(expires),
            ])
        })
        .collect();
    expected.extend(a_ids.iter().map(|id| {
        cells([
            Some(id),
            Some("released"),
            Some("crawl/a"),
            Some("t.example"),
            Some("machine_stopped"),
            Some(ended),
            Some(expires),
        ])
    }));
    assert_eq!(history, expected);

    // The view's columns, as `sqlite3 -header` or psql show them.
    assert_eq!(
        f.columns("lease_history"),
        [
            "seq",
            "at",
            "lease_id",
            "kind",
            "proxy",
            "proxy_uid",
            "target",
            "result",
            "expires",
            "reason",
            "cooldown_seconds",
            "client",
            "tenant",
            "fallback_step"
        ]
    );
    let why = f.rows(
        "SELECT reason, COUNT(*) FROM lease_history WHERE kind = 'released' \
         GROUP BY reason ORDER BY reason",
    );
    assert_eq!(why, [cells([Some("machine_stopped"), Some("2")])]);
}

async fn leases_a_crawler_released_keep_a_null_reason(backend: Backend) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
    let a = candidate("a", 5);
    let leases = f.hold(&a, 2, MINUTE).await;
    let (by_crawler, by_operator) = (&leases[0], &leases[1]);
    f.ledger
        .renew(&by_crawler.id, DEFAULT_TENANT, 2 * MINUTE)
        .await
        .unwrap();
    f.ledger
        .report(
            &by_crawler.id,
            DEFAULT_TENANT,
            LeaseReport::new(ReportResult::Ok, None),
        )
        .await
        .unwrap();
    f.ledger
        .release(&by_crawler.id, DEFAULT_TENANT)
        .await
        .unwrap();
    assert_eq!(
        f.ledger.end_leases("uid-a", "machine_lost").await.unwrap(),
        1
    );

    let crawler = f
        .ledger
        .get(&by_crawler.id, DEFAULT_TENANT)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (crawler.state, crawler.release_reason),
        (LeaseState::Released, None)
    );
    let operator = f
        .ledger
        .get(&by_operator.id, DEFAULT_TENANT)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(operator.release_reason.as_deref(), Some("machine_lost"));

    let rows = f.rows(&format!(
        "SELECT kind, reason FROM lease_history WHERE lease_id = '{}' ORDER BY seq",
        by_crawler.id
    ));
    assert_eq!(
        rows,
        [
            cells([Some("acquired"), None]),
            cells([Some("renewed"), None]),
            cells([Some("reported"), None]),
            cells([Some("released"), None]),
        ]
    );
    assert_eq!(
        f.rows(&format!(
            "SELECT state, release_reason FROM leases WHERE id = '{}'",
            by_crawler.id
        )),
        [cells([Some("released"), None])]
    );
    assert_eq!(
        f.count("SELECT COUNT(*) FROM lease_events WHERE reason IS NOT NULL"),
        1
    );
}

async fn ending_again_ends_nothing_and_records_nothing(backend: Backend) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
    let a = candidate("a", 5);
    f.hold(&a, 3, MINUTE).await;
    assert_eq!(
        f.ledger.end_leases("uid-a", "machine_lost").await.unwrap(),
        3
    );
    let events = f.count("SELECT COUNT(*) FROM lease_events");
    f.clock.advance(Duration::from_secs(1));

    assert_eq!(
        f.ledger.end_leases("uid-a", "machine_lost").await.unwrap(),
        0
    );
    assert_eq!(
        f.ledger.end_leases("uid-a", "machine_gone").await.unwrap(),
        0,
        "a later reason does not overwrite the first"
    );
    assert_eq!(
        f.ledger
            .end_leases("uid-nobody", "machine_gone")
            .await
            .unwrap(),
        0
    );
    assert_eq!(f.count("SELECT COUNT(*) FROM lease_events"), events);
    assert_eq!(
        f.count("SELECT COUNT(*) FROM leases WHERE release_reason = 'machine_lost'"),
        3
    );
    f.self_check().await;
}

async fn an_ended_lease_answers_its_crawler_like_any_released_lease(backend: Backend) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
    let a = candidate("a", 5);
    let keyed = AcquireRequest {
        request: Some(RequestKey {
            id: "crawl-42".into(),
            fingerprint: "fp".into(),
        }),
        tenant: proxy_operator::ledger::Tenancy::unrestricted(),
        session: None,
        fallback_step: None,
        ..request(std::slice::from_ref(&a), "t.example", MINUTE)
    };
    let lease = granted(f.ledger.acquire(keyed.clone()).await);
    f.ledger.end_leases("uid-a", "machine_lost").await.unwrap();
    let ended = f
        .ledger
        .get(&lease.id, DEFAULT_TENANT)
        .await
        .unwrap()
        .unwrap();

    // Renew: not active (the API's 409 lease_not_active), as for a released lease.
    match f.ledger.renew(&lease.id, DEFAULT_TENANT, MINUTE).await {
        Err(LedgerError::NotActive { id, state }) => {
            assert_eq!(
                (id.as_str(), state),
                (lease.id.as_str(), LeaseState::Released)
            );
        }
        other => panic!("expected NotActive, got {other:?}"),
    }
    // Release: idempotent success (the API's 204) that changes nothing.
    f.ledger.release(&lease.id, DEFAULT_TENANT).await.unwrap();
    assert_eq!(
        f.ledger
            .get(&lease.id, DEFAULT_TENANT)
            .await
            .unwrap()
            .as_ref(),
        Some(&ended)
    );
    // A late report still lands, and its cooldown with it.
    let reported = f
        .ledger
        .report(
            &lease.id,
            DEFAULT_TENANT,
            LeaseReport::new(ReportResult::RateLimited, None),
        )
        .await
        .unwrap();
    assert_eq!(reported, ended);
    assert_eq!(f.ledger.counts().cooldowns_active(), 1);
    assert_eq!(
        f.rows(&format!(
            "SELECT kind, result, reason FROM lease_history WHERE lease_id = '{}' ORDER BY seq",
            lease.id
        )),
        [
            cells([Some("acquired"), None, None]),
            cells([Some("released"), None, Some("machine_lost")]),
            cells([Some("reported"), Some("rate_limited"), None]),
        ]
    );
    // The request ID still names the ended lease while its window is open.
    assert_eq!(
        f.ledger.acquire(keyed).await.unwrap(),
        AcquireOutcome::Replayed(ended)
    );
    f.self_check().await;
}

/// An active lease already past its expiry stopped counting when it expired: ending the
/// proxy's leases leaves it to the sweep, which marks it expired (timed at its expiry, no
/// reason), exactly as without the end.
async fn a_lease_past_its_expiry_is_left_for_the_sweep(backend: Backend) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
    let a = candidate("a", 5);
    let short = f.hold(&a, 1, MINUTE).await.remove(0);
    let long = f.hold(&a, 1, 10 * MINUTE).await.remove(0);
    f.clock.advance(2 * MINUTE);
    assert_eq!(f.ledger.counts().active_count("uid-a"), 1);

    assert_eq!(
        f.ledger.end_leases("uid-a", "machine_lost").await.unwrap(),
        1
    );

    let read = f
        .ledger
        .get(&short.id, DEFAULT_TENANT)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (read.state, read.release_reason),
        (LeaseState::Expired, None)
    );
    assert_eq!(
        f.rows(&format!(
            "SELECT state, release_reason FROM leases WHERE id = '{}'",
            short.id
        )),
        [cells([Some("active"), None])],
        "the row waits for the sweep"
    );
    let stats = f.ledger.sweep().await.unwrap();
    assert_eq!(stats.expired, 1);
    let rows = f.rows(&format!(
        "SELECT CASE WHEN lease_id = '{}' THEN 'long' ELSE 'short' END, kind, \
         CASE WHEN expires = at THEN 'at its expiry' ELSE 'before' END, reason \
         FROM lease_history WHERE kind IN ('released', 'expired') ORDER BY seq",
        long.id
    ));
    assert_eq!(
        rows,
        [
            cells([
                Some("long"),
                Some("released"),
                Some("before"),
                Some("machine_lost")
            ]),
            cells([Some("short"), Some("expired"), Some("at its expiry"), None]),
        ]
    );
    assert_eq!(
        f.rows(&format!(
            "SELECT state, release_reason FROM leases WHERE id = '{}'",
            short.id
        )),
        [cells([Some("expired"), None])]
    );
    f.self_check().await;
}

async fn ended_leases_and_their_reason_survive_reopening(backend: Backend) {
    let Some(mut f) = Fixture::on(backend, config()).await else {
        return;
    };
    let (a, b) = (candidate("a", 3), candidate("b", 3));
    let on_a = f.hold(&a, 3, 10 * MINUTE).await;
    f.hold(&b, 1, 10 * MINUTE).await;
    f.ledger.end_leases("uid-a", "machine_gone").await.unwrap();

    f.shut_down_and_reopen().await;

    assert_eq!(
        f.ledger.counts().active_count("uid-a"),
        0,
        "not counted after reopening"
    );
    assert_eq!(f.ledger.counts().active_count("uid-b"), 1);
    for lease in &on_a {
        let read = f
            .ledger
            .get(&lease.id, DEFAULT_TENANT)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(read.state, LeaseState::Released);
        assert_eq!(read.release_reason.as_deref(), Some("machine_gone"));
    }
    assert_eq!(
        f.rows(
            "SELECT reason, COUNT(*) FROM lease_history WHERE kind = 'released' GROUP BY reason"
        ),
        [cells([Some("machine_gone"), Some("3")])]
    );
    assert_eq!(f.hold(&a, 3, MINUTE).await.len(), 3);
    assert_eq!(
        f.ledger.end_leases("uid-a", "machine_gone").await.unwrap(),
        3
    );
    f.self_check().await;
}

#[tokio::test]
async fn a_version_2_file_is_migrated_and_gets_the_reason_columns() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    let at = start().as_millisecond();
    {
        // The file as the previous release left it: schema version 2, a lease a crawler
        // released (with its history) and one still held.
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/migrations/0001_lease_ledger.sql"
        )))
        .unwrap();
        conn.execute_batch(include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/migrations/0002_acquire_request_ids.sql"
        )))
        .unwrap();
        conn.pragma_update(None, "user_version", 2).unwrap();
        conn.execute_batch(&format!(
            "INSERT INTO leases (id, proxy_namespace, proxy_name, proxy_uid, target, state, \
             acquired_at, expires_at, ttl_ms, released_at) VALUES \
             ('old-released', 'crawl', 'a', 'uid-a', NULL, 'released', {at}, {exp}, 600000, {at}), \
             ('old-held', 'crawl', 'a', 'uid-a', NULL, 'active', {at}, {exp}, 600000, NULL); \
             INSERT INTO lease_events (at, lease_id, kind, proxy_namespace, proxy_name, \
             proxy_uid, expires_at) VALUES \
             ({at}, 'old-released', 'acquired', 'crawl', 'a', 'uid-a', {exp}), \
             ({at}, 'old-released', 'released', 'crawl', 'a', 'uid-a', {exp}), \
             ({at}, 'old-held', 'acquired', 'crawl', 'a', 'uid-a', {exp});",
            exp = at + 600_000,
        ))
        .unwrap();
    }
    let clock = Arc::new(ManualClock::new(start()));
    let ledger =
        SqliteLedger::open(&path, SqliteOptions::default(), config(), clock.clone()).unwrap();

    assert_eq!(SCHEMA_VERSION, 8);
    assert_eq!(count(&path, "PRAGMA user_version"), 8);
    // Rows from before tenants belong to the default tenant.
    assert_eq!(
        sqlite3(
            &path,
            "SELECT DISTINCT tenant FROM leases UNION SELECT DISTINCT tenant FROM lease_events"
        ),
        DEFAULT_TENANT
    );
    let columns = |table: &str| {
        sqlite3(
            &path,
            &format!("SELECT name FROM pragma_table_info('{table}') ORDER BY cid"),
        )
    };
    assert!(
        columns("leases").ends_with("release_reason\nclient\ntenant\nsession"),
        "{}",
        columns("leases")
    );
    assert!(
        columns("lease_events").ends_with("reason\nclient\ncooldown_ms\ntenant\nfallback_step")
    );
    assert!(
        columns("lease_history")
            .ends_with("reason\ncooldown_seconds\nclient\ntenant\nfallback_step")
    );
    assert_eq!(
        columns("pool_demand"),
        "pool\nbucket_start_ms\nrequests",
        "the demand table comes with version 5"
    );
    assert_eq!(
        sqlite3(
            &path,
            "SELECT lease_id, kind, quote(reason) FROM lease_history ORDER BY seq"
        ),
        "old-released|acquired|NULL\nold-released|released|NULL\nold-held|acquired|NULL",
        "old history reads with a NULL reason"
    );
    let old = ledger
        .get("old-released", DEFAULT_TENANT)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (old.state, old.release_reason),
        (LeaseState::Released, None)
    );
    assert_eq!(ledger.counts().active_count("uid-a"), 1);

    assert_eq!(ledger.end_leases("uid-a", "machine_lost").await.unwrap(), 1);
    assert_eq!(
        sqlite3(
            &path,
            "SELECT id, state, quote(release_reason) FROM leases ORDER BY id"
        ),
        "old-held|released|'machine_lost'\nold-released|released|NULL"
    );
    ledger.self_check().await.unwrap();

    // The new columns only take a reason where it belongs.
    let conn = rusqlite::Connection::open(&path).unwrap();
    for (what, sql) in [
        (
            "a reason on an event other than released",
            "INSERT INTO lease_events (at, lease_id, kind, proxy_namespace, proxy_name, \
             proxy_uid, reason) VALUES (1, 'x', 'acquired', 'crawl', 'a', 'uid-a', 'machine_lost')",
        ),
        (
            "a reason on a lease that is not released",
            "INSERT INTO leases (id, proxy_namespace, proxy_name, proxy_uid, state, \
             acquired_at, expires_at, ttl_ms, release_reason) \
             VALUES ('y', 'crawl', 'a', 'uid-a', 'active', 1, 2, 1, 'machine_lost')",
        ),
    ] {
        let error = conn.execute_batch(sql).unwrap_err();
        assert!(
            error.to_string().contains("CHECK constraint failed"),
            "{what}: {error}"
        );
    }
    let appended_only = conn
        .execute_batch("UPDATE lease_events SET reason = NULL WHERE kind = 'released'")
        .unwrap_err();
    assert!(
        appended_only.to_string().contains("append-only"),
        "{appended_only}"
    );
}

async fn a_reason_that_is_not_a_machine_code_is_refused_and_nothing_ends(backend: Backend) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
    let a = candidate("a", 5);
    f.hold(&a, 2, MINUTE).await;
    for reason in [
        "",
        "Machine Lost",
        "machine_lost; DROP TABLE leases",
        &"x".repeat(65),
    ] {
        match f.ledger.end_leases("uid-a", reason).await {
            Err(LedgerError::InvalidReason(got)) => assert_eq!(got, reason),
            other => panic!("{reason:?}: expected InvalidReason, got {other:?}"),
        }
    }
    assert_eq!(f.ledger.counts().active_count("uid-a"), 2);
    assert_eq!(
        f.count("SELECT COUNT(*) FROM leases WHERE state = 'active'"),
        2
    );
}

/// Ways to make the batch holding the end fail for real: `(name, SQL run on another
/// connection, message expected in the error)`.
const FAILURES: [(&str, &str, &str); 2] = [
    (
        "a statement fails",
        "CREATE TRIGGER poison BEFORE INSERT ON lease_events \
         WHEN NEW.reason = 'machine_lost' BEGIN SELECT RAISE(ABORT, 'poisoned end'); END;",
        "poisoned end",
    ),
    (
        "the COMMIT fails (deferred foreign key)",
        "CREATE TABLE poison_parent (id INTEGER PRIMARY KEY); \
         CREATE TABLE poison_child (parent INTEGER \
             REFERENCES poison_parent (id) DEFERRABLE INITIALLY DEFERRED); \
         CREATE TRIGGER poison AFTER INSERT ON lease_events WHEN NEW.reason = 'machine_lost' \
         BEGIN INSERT INTO poison_child VALUES (42); END;",
        "FOREIGN KEY constraint failed",
    ),
];

/// A batch whose transaction fails undoes the end with everything else of the batch: every
/// caller gets the error, the leases still count, and a later end (once the cause is gone)
/// ends them.
#[tokio::test]
async fn a_failed_batch_ends_nothing_and_memory_follows_the_file() {
    for (name, poison, message) in FAILURES {
        let f = Fixture::new(config());
        let (a, b) = (candidate("a", 3), candidate("b", 3));
        let held = f.hold(&a, 3, MINUTE).await;
        rusqlite::Connection::open(&f.path)
            .unwrap()
            .execute_batch(poison)
            .unwrap();
        let rows =
            f.count("SELECT COUNT(*) FROM leases") + f.count("SELECT COUNT(*) FROM lease_events");

        let lock = FileLock::take(&f.path);
        let mut first = Box::pin(f.ledger.acquire(request(
            std::slice::from_ref(&b),
            "t.example",
            MINUTE,
        )));
        assert!(queue(&mut first).await.is_none());
        wait_until("the writer takes the first write", || {
            f.sqlite().queue_depth() == 0
        })
        .await;
        let mut end = Box::pin(f.ledger.end_leases("uid-a", "machine_lost"));
        let mut refill = Box::pin(f.ledger.acquire(request(
            std::slice::from_ref(&a),
            "t.example",
            MINUTE,
        )));
        assert!(queue(&mut end).await.is_none());
        assert!(queue(&mut refill).await.is_none());
        lock.release();
        for answer in [first.await.map(|_| 0), end.await, refill.await.map(|_| 0)] {
            match answer {
                Err(LedgerError::BatchFailed(error)) => {
                    assert!(error.to_string().contains(message), "{name}: {error}");
                }
                other => panic!("{name}: expected the batch to fail, got {other:?}"),
            }
        }

        assert_eq!(f.ledger.counts().active_count("uid-a"), 3, "{name}");
        assert_eq!(f.ledger.counts().active_count("uid-b"), 0, "{name}");
        let file_rows =
            f.count("SELECT COUNT(*) FROM leases") + f.count("SELECT COUNT(*) FROM lease_events");
        assert_eq!(file_rows, rows, "{name}");
        for lease in &held {
            assert_eq!(
                f.ledger
                    .get(&lease.id, DEFAULT_TENANT)
                    .await
                    .unwrap()
                    .as_ref(),
                Some(lease),
                "{name}"
            );
        }
        f.self_check().await;

        rusqlite::Connection::open(&f.path)
            .unwrap()
            .execute_batch("DROP TRIGGER poison")
            .unwrap();
        assert_eq!(
            f.ledger.end_leases("uid-a", "machine_lost").await.unwrap(),
            3,
            "{name}"
        );
        assert_eq!(f.ledger.counts().active_count("uid-a"), 0, "{name}");
        f.self_check().await;
    }
}

/// A ledger at its page limit refuses the end like any write (`Full`, nothing recorded,
/// memory rolled back); once the sweep has made room, the end goes through.
#[tokio::test]
async fn a_full_ledger_refuses_the_end_whole() {
    let f = Fixture::with_options(
        SqliteOptions {
            max_size: MIN_MAX_SIZE,
            ..SqliteOptions::default()
        },
        LedgerConfig {
            cooldown: MINUTE,
            ..LedgerConfig::default()
        },
    );
    let (a, b) = (candidate("a", 1_000_000), candidate("b", 1_000_000));
    let on_a = f.hold(&a, 50, 10 * MINUTE).await;
    // Fill the file with leases on b (which expire first) until not even pruning makes room.
    let mut filled = 0u64;
    loop {
        match f
            .ledger
            .acquire(request(std::slice::from_ref(&b), "t.example", 5 * MINUTE))
            .await
        {
            Ok(AcquireOutcome::Granted(_)) => filled += 1,
            Err(LedgerError::Full { retry_after }) if retry_after > Duration::from_secs(1) => {
                break;
            }
            Err(LedgerError::Full { .. }) => {}
            other => panic!("acquire while filling: {other:?}"),
        }
        assert!(filled < 1_000_000, "the ledger never filled");
    }
    let rows =
        f.count("SELECT COUNT(*) FROM leases") + f.count("SELECT COUNT(*) FROM lease_events");

    match f.ledger.end_leases("uid-a", "machine_lost").await {
        Err(LedgerError::Full { retry_after }) => assert!(retry_after > Duration::ZERO),
        other => panic!("expected the ledger to be full, got {other:?}"),
    }

    assert_eq!(
        f.ledger.counts().active_count("uid-a"),
        50,
        "memory was rolled back"
    );
    let file_rows =
        f.count("SELECT COUNT(*) FROM leases") + f.count("SELECT COUNT(*) FROM lease_events");
    assert_eq!(file_rows, rows, "the file kept nothing of it");
    for lease in &on_a {
        assert_eq!(
            f.ledger
                .get(&lease.id, DEFAULT_TENANT)
                .await
                .unwrap()
                .as_ref(),
            Some(lease)
        );
    }
    f.self_check().await;

    // The leases on b expire and pass the cooldown window; the sweep (which may use the pages
    // kept back from clients) deletes them.
    f.clock.advance(7 * MINUTE);
    assert_eq!(f.ledger.sweep().await.unwrap().expired, filled);
    let mut ended = None;
    for _ in 0..1_000 {
        match f.ledger.end_leases("uid-a", "machine_lost").await {
            Ok(n) => {
                ended = Some(n);
                break;
            }
            Err(LedgerError::Full { .. }) => {}
            Err(other) => panic!("end after the sweep: {other}"),
        }
    }
    assert_eq!(ended, Some(50));
    assert_eq!(f.ledger.counts().active_count("uid-a"), 0);
    f.self_check().await;
}

crate::on_both_backends!(
    ending_a_proxys_leases_releases_all_of_them_and_no_other_proxys,
    the_replacement_gets_the_proxys_full_capacity_at_once,
    the_reason_shows_in_leases_and_lease_history,
    leases_a_crawler_released_keep_a_null_reason,
    ending_again_ends_nothing_and_records_nothing,
    an_ended_lease_answers_its_crawler_like_any_released_lease,
    a_lease_past_its_expiry_is_left_for_the_sweep,
    ended_leases_and_their_reason_survive_reopening,
    a_reason_that_is_not_a_machine_code_is_refused_and_nothing_ends,
);
