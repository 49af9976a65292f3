//! The lease ledger against real SQLite files in temporary directories.

use crate::support;

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use proxy_operator::ledger::{
    AcquireOutcome, AcquireRequest, Candidate, Durability, Lease, LeaseReport, LeaseState, Ledger,
    LedgerConfig, LedgerError, ManualClock, NoMatch, ReportResult, RequestKey, SCHEMA_VERSION,
    SqliteLedger, SweepStats, SystemClock,
};
use support::ledger::{Fixture, candidate, granted, no_match, start};

const MINUTE: Duration = Duration::from_secs(60);

fn config() -> LedgerConfig {
    LedgerConfig {
        max_ttl: Duration::from_secs(3600),
        cooldown: 10 * MINUTE,
        history_retention: Duration::from_secs(24 * 3600),
        durability: Durability::Normal,
        ..LedgerConfig::default()
    }
}

/// What only these tests read from or send to the fixture's ledger.
impl Fixture {
    fn raw(&self) -> rusqlite::Connection {
        rusqlite::Connection::open(&self.path).unwrap()
    }

    /// `(kind, target, result)` of every history row of one lease, in order.
    fn events(&self, lease_id: &str) -> Vec<(String, Option<String>, Option<String>)> {
        let conn = self.raw();
        let mut stmt = conn
            .prepare(
                "SELECT kind, target, result FROM lease_events WHERE lease_id = ?1 ORDER BY seq",
            )
            .unwrap();
        stmt.query_map([lease_id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    }

    async fn acquire(
        &self,
        candidates: &[Candidate],
        target: Option<&str>,
        ttl: Duration,
    ) -> Result<AcquireOutcome, LedgerError> {
        acquire(&self.ledger, candidates, target, ttl).await
    }

    /// An acquire carrying request ID `id` with fingerprint `fingerprint`.
    async fn acquire_once(
        &self,
        candidates: &[Candidate],
        id: &str,
        fingerprint: &str,
    ) -> Result<AcquireOutcome, LedgerError> {
        self.ledger
            .acquire(AcquireRequest {
                client: None,
                candidates: candidates.into(),
                target: None,
                ttl: MINUTE,
                request: Some(RequestKey {
                    id: id.into(),
                    fingerprint: fingerprint.into(),
                }),
            })
            .await
    }
}

/// An acquire without a request ID.
async fn acquire(
    ledger: &SqliteLedger,
    candidates: &[Candidate],
    target: Option<&str>,
    ttl: Duration,
) -> Result<AcquireOutcome, LedgerError> {
    ledger
        .acquire(AcquireRequest {
            client: None,
            candidates: candidates.into(),
            target: target.map(str::to_owned),
            ttl,
            request: None,
        })
        .await
}

/// A healthy proxy whose last probe took `latency_ms`: the latency orders proxies with the
/// same load.
fn measured(name: &str, max_leases: u32, latency_ms: u64) -> Candidate {
    Candidate {
        latency: Some(Duration::from_millis(latency_ms)),
        ..candidate(name, max_leases)
    }
}

/// The lease a retried acquire answered again; panics with the answer otherwise.
fn replayed(outcome: Result<AcquireOutcome, LedgerError>) -> Lease {
    match outcome {
        Ok(AcquireOutcome::Replayed(lease)) => lease,
        other => panic!("expected a replayed lease, got {other:?}"),
    }
}

#[tokio::test]
async fn open_migrates_once_uses_wal_and_reopening_is_a_no_op() {
    let mut f = Fixture::new(config());
    let version: u32 = f
        .raw()
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(version, SCHEMA_VERSION);
    let mode: String = f
        .raw()
        .query_row("PRAGMA journal_mode", [], |r| r.get(0))
        .unwrap();
    assert_eq!(mode, "wal");
    let lease = granted(f.acquire(&[candidate("a", 1)], None, MINUTE).await);
    f.reopen();
    f.reopen();
    assert_eq!(f.ledger.get(&lease.id).await.unwrap(), Some(lease));
    let version: u32 = f
        .raw()
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(version, SCHEMA_VERSION);
}

#[tokio::test]
async fn a_file_from_before_request_ids_is_migrated_and_its_leases_count() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    let clock = Arc::new(ManualClock::new(start()));
    {
        // The file as the previous release left it: schema version 1, one lease held.
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/migrations/0001_lease_ledger.sql"
        )))
        .unwrap();
        conn.pragma_update(None, "user_version", 1).unwrap();
        conn.execute(
            "INSERT INTO leases (id, proxy_namespace, proxy_name, proxy_uid, target, state, \
             acquired_at, expires_at, ttl_ms) VALUES ('old', 'crawl', 'a', 'uid-a', NULL, \
             'active', ?1, ?2, 60000)",
            [
                start().as_millisecond(),
                (start() + MINUTE).as_millisecond(),
            ],
        )
        .unwrap();
    }
    let ledger = SqliteLedger::open(&path, config(), clock.clone()).unwrap();
    assert_eq!(ledger.active_total(), 1);
    let c = [candidate("a", 1)];
    no_match(acquire(&ledger, &c, None, MINUTE).await);
    let version: u32 = rusqlite::Connection::open(&path)
        .unwrap()
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(version, SCHEMA_VERSION);
    ledger.self_check().await.unwrap();
}

#[tokio::test]
async fn full_durability_opens_and_keeps_leases_across_reopening() {
    let mut f = Fixture::new(LedgerConfig {
        durability: Durability::Full,
        ..config()
    });
    let lease = granted(f.acquire(&[candidate("a", 1)], None, MINUTE).await);
    // Reopened with the default (Normal) durability of `config()`.
    f.ledger = SqliteLedger::open(&f.path, config(), f.clock.clone()).unwrap();
    assert_eq!(f.ledger.get(&lease.id).await.unwrap(), Some(lease));
}

#[tokio::test]
async fn a_database_from_a_newer_binary_is_refused() {
    let f = Fixture::new(config());
    f.raw()
        .pragma_update(None, "user_version", SCHEMA_VERSION + 1)
        .unwrap();
    let err = SqliteLedger::open(&f.path, config(), f.clock.clone()).unwrap_err();
    match &err {
        LedgerError::Newer {
            path,
            found,
            supported,
        } => {
            assert_eq!(path, &f.path);
            assert_eq!((*found, *supported), (SCHEMA_VERSION + 1, SCHEMA_VERSION));
        }
        other => panic!("expected Newer, got {other:?}"),
    }
    let message = err.to_string();
    assert!(message.contains(&f.path.display().to_string()), "{message}");
    assert!(message.contains("newer"), "{message}");
}

#[tokio::test]
async fn open_errors_name_the_file_and_bad_config_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("missing-dir").join("ledger.db");
    let err = SqliteLedger::open(&path, config(), Arc::new(SystemClock)).unwrap_err();
    assert!(matches!(err, LedgerError::Open { .. }), "{err:?}");
    assert!(err.to_string().contains("missing-dir"), "{err}");

    let not_a_db = dir.path().join("notes.txt");
    std::fs::write(
        &not_a_db,
        "this is not a database, just some text ".repeat(200),
    )
    .unwrap();
    let err = SqliteLedger::open(&not_a_db, config(), Arc::new(SystemClock)).unwrap_err();
    assert!(err.to_string().contains("notes.txt"), "{err}");

    for bad in [
        LedgerConfig {
            max_ttl: Duration::ZERO,
            ..config()
        },
        LedgerConfig {
            cooldown: Duration::MAX,
            ..config()
        },
    ] {
        let err =
            SqliteLedger::open(&dir.path().join("x.db"), bad, Arc::new(SystemClock)).unwrap_err();
        assert!(matches!(err, LedgerError::Config(_)), "{err:?}");
    }
}

#[tokio::test]
async fn acquire_spreads_over_the_least_loaded_proxies_and_records_history() {
    let f = Fixture::new(config());
    let candidates = [
        measured("slow", 2, 80),
        measured("fast", 2, 10),
        candidate("unknown", 2),
    ];
    let mut order = Vec::new();
    for _ in 0..6 {
        let outcome = f.acquire(&candidates, Some("example.com"), MINUTE).await;
        order.push(granted(outcome).proxy.name);
    }
    assert_eq!(
        order,
        ["fast", "slow", "unknown", "fast", "slow", "unknown"]
    );

    let stats = no_match(f.acquire(&candidates, None, MINUTE).await);
    assert_eq!(
        stats,
        NoMatch {
            considered: 3,
            at_capacity: 3,
            retry_after: Some(start() + MINUTE),
            ..NoMatch::default()
        }
    );

    let lease = granted(
        f.acquire(&[candidate("other", 1)], Some("example.com"), MINUTE)
            .await,
    );
    assert_eq!(lease.proxy.uid, "uid-other");
    assert_eq!(lease.proxy.namespace, "crawl");
    assert_eq!(lease.target.as_deref(), Some("example.com"));
    assert_eq!(lease.state, LeaseState::Active);
    assert_eq!(lease.acquired_at, start());
    assert_eq!(lease.expires_at, start() + MINUTE);
    assert_eq!(lease.ttl, MINUTE);
    assert_eq!(lease.released_at, None);
    assert_eq!(f.ledger.get(&lease.id).await.unwrap(), Some(lease.clone()));
    assert_eq!(
        f.events(&lease.id),
        [("acquired".to_owned(), Some("example.com".to_owned()), None)]
    );
    assert_eq!(f.ledger.active_total(), 7);
    assert_eq!(
        f.ledger.active_counts(),
        HashMap::from([
            ("uid-slow".to_owned(), 2),
            ("uid-fast".to_owned(), 2),
            ("uid-unknown".to_owned(), 2),
            ("uid-other".to_owned(), 1),
        ])
    );
}

#[tokio::test]
async fn unhealthy_and_zero_capacity_proxies_are_never_leased() {
    let f = Fixture::new(config());
    let candidates = [
        Candidate {
            healthy: false,
            ..measured("sick", 5, 1)
        },
        measured("zero", 0, 1),
    ];
    let stats = no_match(f.acquire(&candidates, None, MINUTE).await);
    assert_eq!(
        stats,
        NoMatch {
            considered: 2,
            at_capacity: 1,
            unhealthy: 1,
            ..NoMatch::default()
        }
    );
    assert_eq!(f.ledger.active_total(), 0);
    assert_eq!(f.count("SELECT COUNT(*) FROM lease_events"), 0);
    let stats = no_match(f.acquire(&[], None, MINUTE).await);
    assert_eq!(stats, NoMatch::default());
}

#[tokio::test]
async fn ttl_is_capped_and_must_not_be_zero() {
    let f = Fixture::new(config());
    let c = [candidate("a", 5)];
    let lease = granted(f.acquire(&c, None, Duration::from_secs(86_400)).await);
    assert_eq!(lease.ttl, Duration::from_secs(3600));
    assert_eq!(lease.expires_at, start() + Duration::from_secs(3600));
    for ttl in [Duration::ZERO, Duration::from_micros(999)] {
        let err = f.acquire(&c, None, ttl).await.unwrap_err();
        assert!(
            matches!(err, LedgerError::InvalidTtl(t) if t == ttl),
            "{err:?}"
        );
        let err = f.ledger.renew(&lease.id, ttl).await.unwrap_err();
        assert!(matches!(err, LedgerError::InvalidTtl(_)), "{err:?}");
    }
    let renewed = f.ledger.renew(&lease.id, Duration::MAX).await.unwrap();
    assert_eq!(renewed.ttl, Duration::from_secs(3600));
}

#[tokio::test]
async fn an_expired_lease_stops_counting_before_the_sweep() {
    let f = Fixture::new(config());
    let c = [candidate("a", 1)];
    let first = granted(f.acquire(&c, None, MINUTE).await);
    f.clock.advance(MINUTE - Duration::from_millis(1));
    assert_eq!(
        no_match(f.acquire(&c, None, MINUTE).await).retry_after,
        Some(first.expires_at)
    );
    f.clock.advance(Duration::from_millis(1));
    let second = granted(f.acquire(&c, None, MINUTE).await);
    assert_ne!(first.id, second.id);
    assert_eq!(
        f.ledger.get(&first.id).await.unwrap().unwrap().state,
        LeaseState::Expired
    );
    assert_eq!(f.ledger.active_total(), 1);
}

#[tokio::test]
async fn renew_extends_active_leases_only() {
    let f = Fixture::new(config());
    let c = [candidate("a", 3)];
    let lease = granted(f.acquire(&c, Some("t.example"), MINUTE).await);
    f.clock.advance(Duration::from_secs(50));
    let renewed = f.ledger.renew(&lease.id, 2 * MINUTE).await.unwrap();
    assert_eq!(
        renewed.expires_at,
        start() + Duration::from_secs(50) + 2 * MINUTE
    );
    assert_eq!(renewed.ttl, 2 * MINUTE);
    assert_eq!(renewed.acquired_at, lease.acquired_at);
    assert_eq!(
        f.ledger.get(&lease.id).await.unwrap(),
        Some(renewed.clone())
    );
    f.clock.advance(MINUTE);
    assert_eq!(f.ledger.active_total(), 1, "renewed lease still counts");
    let kinds: Vec<String> = f.events(&lease.id).into_iter().map(|e| e.0).collect();
    assert_eq!(kinds, ["acquired", "renewed"]);

    f.ledger.release(&lease.id).await.unwrap();
    let err = f.ledger.renew(&lease.id, MINUTE).await.unwrap_err();
    assert!(
        matches!(&err, LedgerError::NotActive { id, state: LeaseState::Released } if *id == lease.id),
        "{err:?}"
    );

    let short = granted(f.acquire(&c, None, MINUTE).await);
    f.clock.advance(MINUTE);
    let err = f.ledger.renew(&short.id, MINUTE).await.unwrap_err();
    assert!(
        matches!(
            err,
            LedgerError::NotActive {
                state: LeaseState::Expired,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!("lease {:?} is expired, not active", short.id)
    );

    let err = f.ledger.renew("no-such-lease", MINUTE).await.unwrap_err();
    assert!(matches!(&err, LedgerError::UnknownLease(id) if id == "no-such-lease"));
}

#[tokio::test]
async fn release_is_idempotent_and_frees_the_slot() {
    let f = Fixture::new(config());
    let c = [candidate("a", 1)];
    let lease = granted(f.acquire(&c, None, MINUTE).await);
    no_match(f.acquire(&c, None, MINUTE).await);
    f.clock.advance(Duration::from_secs(5));
    f.ledger.release(&lease.id).await.unwrap();
    f.ledger.release(&lease.id).await.unwrap();
    f.ledger.release("never-issued").await.unwrap();
    let released = f.ledger.get(&lease.id).await.unwrap().unwrap();
    assert_eq!(released.state, LeaseState::Released);
    assert_eq!(released.released_at, Some(start() + Duration::from_secs(5)));
    let kinds: Vec<String> = f.events(&lease.id).into_iter().map(|e| e.0).collect();
    assert_eq!(kinds, ["acquired", "released"]);
    granted(f.acquire(&c, None, MINUTE).await);

    // Releasing after the TTL ran out changes nothing: the lease already expired.
    let late = granted(f.acquire(&[candidate("b", 1)], None, MINUTE).await);
    f.clock.advance(2 * MINUTE);
    f.ledger.release(&late.id).await.unwrap();
    assert_eq!(
        f.ledger.get(&late.id).await.unwrap().unwrap().state,
        LeaseState::Expired
    );
    assert_eq!(f.events(&late.id).len(), 1);
}

#[tokio::test]
async fn rate_limited_and_blocked_reports_cool_the_proxy_down_for_that_target() {
    for result in [ReportResult::RateLimited, ReportResult::Blocked] {
        let f = Fixture::new(config());
        let c = [measured("a", 5, 1), measured("b", 5, 9)];
        let lease = granted(f.acquire(&c, Some("shop.example"), MINUTE).await);
        assert_eq!(lease.proxy.name, "a");
        f.clock.advance(Duration::from_secs(1));
        let reported = f
            .ledger
            .report(&lease.id, LeaseReport::new(result, None))
            .await
            .unwrap();
        assert_eq!(reported.id, lease.id);
        assert_eq!(f.ledger.cooldowns_active(), 1);
        assert_eq!(
            f.events(&lease.id)[1],
            (
                "reported".to_owned(),
                Some("shop.example".to_owned()),
                Some(result.as_str().to_owned())
            )
        );

        // Released, "a" would win on load and latency; the cooldown makes the target skip it.
        f.ledger.release(&lease.id).await.unwrap();
        let next = granted(f.acquire(&c, Some("shop.example"), MINUTE).await);
        assert_eq!(next.proxy.name, "b", "{result}");
        f.ledger.release(&next.id).await.unwrap();
        // Another target and no target are not affected.
        let other = granted(f.acquire(&c, Some("news.example"), MINUTE).await);
        assert_eq!(other.proxy.name, "a");
        f.ledger.release(&other.id).await.unwrap();
        let untargeted = granted(f.acquire(&c, None, MINUTE).await);
        assert_eq!(untargeted.proxy.name, "a");
        f.ledger.release(&untargeted.id).await.unwrap();

        // Only "a" offered for the cooled target: no match, retry when the cooldown ends.
        let cooldown_end = start() + Duration::from_secs(1) + 10 * MINUTE;
        let stats = no_match(f.acquire(&c[..1], Some("shop.example"), MINUTE).await);
        assert_eq!(
            stats,
            NoMatch {
                considered: 1,
                in_cooldown: 1,
                retry_after: Some(cooldown_end),
                ..NoMatch::default()
            }
        );
        f.clock.set(cooldown_end);
        assert_eq!(f.ledger.cooldowns_active(), 0);
        let back = granted(f.acquire(&c, Some("shop.example"), MINUTE).await);
        assert_eq!(back.proxy.name, "a");
    }
}

#[tokio::test]
async fn report_target_defaults_to_the_lease_target_and_without_any_no_cooldown_is_keyed() {
    let f = Fixture::new(config());
    let c = [candidate("a", 5)];
    let untargeted = granted(f.acquire(&c, None, MINUTE).await);
    f.ledger
        .report(
            &untargeted.id,
            LeaseReport::new(ReportResult::RateLimited, None),
        )
        .await
        .unwrap();
    assert_eq!(f.ledger.cooldowns_active(), 0);
    assert_eq!(
        f.events(&untargeted.id)[1],
        ("reported".to_owned(), None, Some("rate_limited".to_owned()))
    );

    // An explicit target overrides (or supplies) the lease's.
    f.ledger
        .report(
            &untargeted.id,
            LeaseReport::new(ReportResult::Blocked, Some("explicit.example")),
        )
        .await
        .unwrap();
    assert_eq!(f.ledger.cooldowns_active(), 1);
    let stats = no_match(f.acquire(&c, Some("explicit.example"), MINUTE).await);
    assert_eq!(stats.in_cooldown, 1);

    for result in [ReportResult::Ok, ReportResult::Error] {
        let lease = granted(f.acquire(&c, Some("fine.example"), MINUTE).await);
        f.ledger
            .report(&lease.id, LeaseReport::new(result, None))
            .await
            .unwrap();
        assert_eq!(f.ledger.cooldowns_active(), 1, "{result}");
        assert_eq!(f.events(&lease.id)[1].2.as_deref(), Some(result.as_str()));
    }

    let err = f
        .ledger
        .report("no-such-lease", LeaseReport::new(ReportResult::Ok, None))
        .await
        .unwrap_err();
    assert!(matches!(&err, LedgerError::UnknownLease(id) if id == "no-such-lease"));
    assert_eq!(err.to_string(), "unknown lease \"no-such-lease\"");
}

#[tokio::test]
async fn a_late_report_on_an_expired_lease_still_lands_until_the_lease_is_pruned() {
    let f = Fixture::new(config());
    let c = [candidate("a", 1)];
    let lease = granted(f.acquire(&c, Some("shop.example"), MINUTE).await);
    f.clock.advance(MINUTE + Duration::from_secs(30));
    assert_eq!(
        f.ledger.sweep().await.unwrap(),
        SweepStats {
            expired: 1,
            ..SweepStats::default()
        }
    );
    let reported = f
        .ledger
        .report(&lease.id, LeaseReport::new(ReportResult::RateLimited, None))
        .await
        .unwrap();
    assert_eq!(reported.state, LeaseState::Expired);
    assert_eq!(f.ledger.cooldowns_active(), 1);
    let stats = no_match(f.acquire(&c, Some("shop.example"), MINUTE).await);
    assert_eq!(stats.in_cooldown, 1);
    let kinds: Vec<String> = f.events(&lease.id).into_iter().map(|e| e.0).collect();
    assert_eq!(kinds, ["acquired", "expired", "reported"]);

    // Retained until its expiry is older than the cooldown window, then gone.
    f.clock.set(lease.expires_at + 10 * MINUTE);
    assert_eq!(f.ledger.sweep().await.unwrap().leases_pruned, 0);
    f.ledger
        .report(&lease.id, LeaseReport::new(ReportResult::Ok, None))
        .await
        .unwrap();
    f.clock.advance(Duration::from_millis(1));
    let stats = f.ledger.sweep().await.unwrap();
    assert_eq!(stats.leases_pruned, 1);
    assert!(matches!(
        f.ledger
            .report(&lease.id, LeaseReport::new(ReportResult::RateLimited, None))
            .await,
        Err(LedgerError::UnknownLease(_))
    ));
    assert_eq!(f.ledger.get(&lease.id).await.unwrap(), None);
}

#[tokio::test]
async fn sweep_expires_prunes_cooldowns_and_old_history() {
    let f = Fixture::new(config());
    let c = [candidate("a", 5), candidate("b", 5)];
    let short = granted(f.acquire(&c, Some("t"), MINUTE).await);
    let long = granted(f.acquire(&c, Some("t"), 30 * MINUTE).await);
    let released = granted(f.acquire(&c, None, 30 * MINUTE).await);
    f.ledger.release(&released.id).await.unwrap();
    f.ledger
        .report(&short.id, LeaseReport::new(ReportResult::RateLimited, None))
        .await
        .unwrap();

    f.clock.advance(2 * MINUTE);
    assert_eq!(
        f.ledger.sweep().await.unwrap(),
        SweepStats {
            expired: 1,
            ..SweepStats::default()
        }
    );
    assert_eq!(
        f.ledger.sweep().await.unwrap(),
        SweepStats::default(),
        "sweeping twice"
    );
    let expired_at: i64 = f
        .raw()
        .query_row(
            "SELECT at FROM lease_events WHERE lease_id = ?1 AND kind = 'expired'",
            [&short.id],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(expired_at, short.expires_at.as_millisecond());

    // After the cooldown: the cooldown ends, the short lease's retention ends.
    f.clock.set(start() + 12 * MINUTE);
    assert_eq!(
        f.ledger.sweep().await.unwrap(),
        SweepStats {
            leases_pruned: 1,
            cooldowns_pruned: 1,
            ..SweepStats::default()
        }
    );
    // After 30 min + cooldown the long and released leases go; history stays for a day.
    f.clock.set(start() + 41 * MINUTE);
    let stats = f.ledger.sweep().await.unwrap();
    assert_eq!((stats.expired, stats.leases_pruned), (1, 2));
    assert_eq!(f.ledger.get(&long.id).await.unwrap(), None);
    let history = f.count("SELECT COUNT(*) FROM lease_events");
    assert_eq!(history, 7);
    f.clock
        .set(start() + Duration::from_secs(24 * 3600) + 31 * MINUTE);
    assert_eq!(f.ledger.sweep().await.unwrap().events_pruned, 7);
    assert_eq!(f.count("SELECT COUNT(*) FROM lease_events"), 0);
}

#[tokio::test]
async fn leases_cooldowns_and_history_survive_reopening() {
    let mut f = Fixture::new(config());
    let c = [candidate("a", 5), candidate("b", 5)];
    let kept = granted(f.acquire(&c, Some("t"), 30 * MINUTE).await);
    let cooled = granted(f.acquire(&c, Some("t"), 30 * MINUTE).await);
    f.ledger
        .report(&cooled.id, LeaseReport::new(ReportResult::Blocked, None))
        .await
        .unwrap();
    f.ledger.release(&cooled.id).await.unwrap();
    assert_eq!(
        (kept.proxy.name.as_str(), cooled.proxy.name.as_str()),
        ("a", "b")
    );
    let history = f.count("SELECT COUNT(*) FROM lease_events");
    f.reopen();
    assert_eq!(f.ledger.get(&kept.id).await.unwrap(), Some(kept.clone()));
    assert_eq!(
        f.ledger.get(&cooled.id).await.unwrap().unwrap().state,
        LeaseState::Released
    );
    assert_eq!(f.ledger.active_total(), 1);
    assert_eq!(f.ledger.cooldowns_active(), 1);
    assert_eq!(f.count("SELECT COUNT(*) FROM lease_events"), history);
    let stats = no_match(f.acquire(&c[1..], Some("t"), MINUTE).await);
    assert_eq!(
        stats.in_cooldown, 1,
        "the cooled proxy is still skipped after reopening"
    );
}

#[tokio::test]
async fn lease_ids_are_unique_and_carry_128_random_bits() {
    let f = Fixture::new(config());
    let c = [candidate("a", 1000)];
    let mut ids = HashSet::new();
    for _ in 0..500 {
        ids.insert(granted(f.acquire(&c, None, MINUTE).await).id);
    }
    assert_eq!(ids.len(), 500);
    let time_prefix = format!("{:012x}", start().as_millisecond());
    for id in &ids {
        assert_eq!(id.len(), 12 + 32, "{id}");
        assert!(id.starts_with(&time_prefix), "{id}");
        assert!(u128::from_str_radix(&id[12..], 16).is_ok(), "{id}");
    }
}

#[tokio::test]
async fn history_is_append_only() {
    let f = Fixture::new(config());
    let lease = granted(f.acquire(&[candidate("a", 1)], None, MINUTE).await);
    let err = f
        .raw()
        .execute("UPDATE lease_events SET kind = 'released'", [])
        .unwrap_err();
    assert!(err.to_string().contains("append-only"), "{err}");
    assert_eq!(f.events(&lease.id).len(), 1);
}

#[tokio::test]
async fn a_retried_acquire_with_the_same_request_id_gets_the_same_lease_while_it_runs() {
    let f = Fixture::new(config());
    let c = [measured("a", 5, 1), measured("b", 5, 2)];
    let first = granted(f.acquire_once(&c, "job-1", "fp").await);
    assert_eq!(first.proxy.name, "a");
    let again = replayed(f.acquire_once(&c, "job-1", "fp").await);
    assert_eq!(again, first);
    assert_eq!(f.ledger.active_total(), 1, "a replay grants nothing");

    let err = f.acquire_once(&c, "job-1", "other").await.unwrap_err();
    assert!(
        matches!(&err, LedgerError::RequestIdReused { request_id } if request_id == "job-1"),
        "{err:?}"
    );
    let other = granted(f.acquire_once(&c, "job-2", "fp").await);
    assert_eq!(other.proxy.name, "b", "another ID is another acquire");

    // Renewing moves the window; the replay shows the lease as it is now.
    f.clock.advance(Duration::from_secs(50));
    let renewed = f.ledger.renew(&first.id, 2 * MINUTE).await.unwrap();
    f.clock.advance(Duration::from_secs(30));
    assert_eq!(replayed(f.acquire_once(&c, "job-1", "fp").await), renewed);
    // A released lease is still the answer until its expiry...
    f.ledger.release(&first.id).await.unwrap();
    let released = replayed(f.acquire_once(&c, "job-1", "fp").await);
    assert_eq!(released.id, first.id);
    assert_eq!(released.state, LeaseState::Released);
    // ...then the ID is free again and names the newer lease.
    f.clock.set(renewed.expires_at);
    let fresh = granted(f.acquire_once(&c, "job-1", "new").await);
    assert_ne!(fresh.id, first.id);
    assert_eq!(
        replayed(f.acquire_once(&c, "job-1", "new").await).id,
        fresh.id
    );
    assert_eq!(
        f.count("SELECT COUNT(*) FROM leases WHERE request_id = 'job-1'"),
        2,
        "both leases keep the ID for people reading the file"
    );
    assert_eq!(
        f.count(
            "SELECT COUNT(*) FROM lease_events WHERE kind = 'acquired' AND lease_id IN \
             (SELECT id FROM leases WHERE request_id = 'job-1')"
        ),
        2
    );
}

#[tokio::test]
async fn request_ids_answer_after_reopening() {
    let mut f = Fixture::new(config());
    let c = [candidate("a", 5)];
    let kept = granted(f.acquire_once(&c, "kept", "fp").await);
    let released = granted(f.acquire_once(&c, "released", "fp").await);
    f.ledger.release(&released.id).await.unwrap();
    let short = granted(f.acquire_once(&c, "short", "fp").await);
    f.clock.advance(Duration::from_secs(10));
    let renewed = f.ledger.renew(&kept.id, 5 * MINUTE).await.unwrap();
    f.clock.set(short.expires_at - Duration::from_millis(1));
    f.reopen();
    assert_eq!(replayed(f.acquire_once(&c, "kept", "fp").await), renewed);
    assert_eq!(
        replayed(f.acquire_once(&c, "released", "fp").await).state,
        LeaseState::Released
    );
    assert!(matches!(
        f.acquire_once(&c, "short", "changed").await,
        Err(LedgerError::RequestIdReused { .. })
    ));
    f.clock.advance(Duration::from_millis(1));
    f.reopen();
    assert_ne!(
        granted(f.acquire_once(&c, "short", "changed").await).id,
        short.id,
        "the window closed at the expiry, before the restart as after"
    );
    assert_eq!(
        replayed(f.acquire_once(&c, "kept", "fp").await).expires_at,
        renewed.expires_at,
        "the renewed window survives the restart"
    );
    f.ledger.self_check().await.unwrap();
}

/// Active counts by proxy, active total, cooldowns, and the lease each request ID names.
type Observed = (HashMap<String, u32>, u64, u64, Vec<Lease>);

/// What a caller can observe of the lease state: counts, and the answer to every request ID.
async fn observable(f: &Fixture, c: &[Candidate], ids: &[&str]) -> Observed {
    let mut replays = Vec::new();
    for id in ids {
        let answer = match f.acquire_once(c, id, "fp").await {
            Ok(AcquireOutcome::Replayed(lease)) => lease,
            Ok(AcquireOutcome::Granted(lease)) => panic!("{id} was not in the index: {lease:?}"),
            other => panic!("{id}: {other:?}"),
        };
        replays.push(answer);
    }
    (
        f.ledger.active_counts(),
        f.ledger.active_total(),
        f.ledger.cooldowns_active(),
        replays,
    )
}

#[tokio::test]
async fn the_state_rebuilt_at_open_equals_the_state_before_close() {
    let mut f = Fixture::new(config());
    let c: Vec<Candidate> = (0..4).map(|i| measured(&format!("p{i}"), 2, i)).collect();
    let mut leases = Vec::new();
    for i in 0..8 {
        let id = format!("req-{i}");
        leases.push(granted(f.acquire_once(&c, &id, "fp").await));
        f.clock.advance(Duration::from_secs(1));
    }
    f.ledger.release(&leases[0].id).await.unwrap();
    f.ledger.renew(&leases[1].id, 10 * MINUTE).await.unwrap();
    for (lease, target) in [(&leases[2], "a.example"), (&leases[3], "b.example")] {
        f.ledger
            .report(
                &lease.id,
                LeaseReport::new(ReportResult::RateLimited, Some(target)),
            )
            .await
            .unwrap();
    }
    f.ledger
        .report(
            &leases[4].id,
            LeaseReport::new(ReportResult::Ok, Some("a.example")),
        )
        .await
        .unwrap();
    // Leases 0-3 expired and swept, lease 4 expired but not swept, 1 (renewed) and 5-7 open.
    f.clock.advance(MINUTE - Duration::from_secs(5));
    f.ledger.sweep().await.unwrap();
    f.clock.advance(Duration::from_secs(1));
    let ids: Vec<&str> = ["req-1", "req-5", "req-6", "req-7"].into();
    let before = observable(&f, &c, &ids).await;
    f.ledger.self_check().await.unwrap();
    f.reopen();
    f.ledger.self_check().await.unwrap();
    assert_eq!(observable(&f, &c, &ids).await, before);
    assert_eq!(before.1, 4, "{before:?}");
    assert_eq!(before.2, 2, "{before:?}");
    let in_cooldown = no_match(f.acquire(&c[3..4], Some("b.example"), MINUTE).await);
    assert_eq!(in_cooldown.in_cooldown, 1, "{in_cooldown:?}");
}

/// Runs `sql` with the sqlite3 command-line shell, as an engineer would.
fn sqlite3(path: &Path, sql: &str) -> String {
    let out = Command::new("sqlite3")
        .arg(path)
        .arg(sql)
        .output()
        .expect("the sqlite3 CLI is installed (see README)");
    assert!(
        out.status.success(),
        "{sql}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test]
async fn the_debugging_views_answer_in_the_sqlite3_shell() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    let ledger = SqliteLedger::open(&path, config(), Arc::new(SystemClock)).unwrap();
    let c = [candidate("a", 5), measured("b", 5, 3)];
    let first = granted(acquire(&ledger, &c, Some("shop.example"), MINUTE).await);
    let second = granted(acquire(&ledger, &c, Some("shop.example"), MINUTE).await);
    ledger
        .report(&first.id, LeaseReport::new(ReportResult::RateLimited, None))
        .await
        .unwrap();
    ledger.release(&first.id).await.unwrap();

    let per_proxy = sqlite3(&path, "SELECT proxy, leases FROM active_leases_per_proxy;");
    assert_eq!(per_proxy, format!("{}|1\n", second.proxy));
    let active = sqlite3(&path, "SELECT id FROM active_leases;");
    assert_eq!(active, format!("{}\n", second.id));
    let history = sqlite3(
        &path,
        &format!(
            "SELECT kind, result FROM lease_history WHERE lease_id = '{}';",
            first.id
        ),
    );
    assert_eq!(history, "acquired|\nreported|rate_limited\nreleased|\n");
    let cooldowns = sqlite3(&path, "SELECT proxy, target, result FROM active_cooldowns;");
    assert_eq!(
        cooldowns,
        format!("{}|shop.example|rate_limited\n", first.proxy)
    );
    let rate_limited = sqlite3(
        &path,
        "SELECT target, COUNT(*) FROM lease_events WHERE kind = 'reported' \
         AND result = 'rate_limited' \
         AND at > (unixepoch('now') - 3600) * 1000 GROUP BY target;",
    );
    assert_eq!(rate_limited, "shop.example|1\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_acquires_never_exceed_max_leases() {
    const TASKS: usize = 64;
    const ACQUIRES: usize = 150;
    const PROXIES: usize = 10;
    const MAX: u32 = 3;
    const HELD: usize = 4;
    let f = Arc::new(Fixture::new(config()));
    let candidates: Arc<[Candidate]> = (0..PROXIES)
        .map(|i| measured(&format!("p{i}"), MAX, i as u64))
        .collect();
    let granted_total = Arc::new(AtomicU32::new(0));
    let refused_total = Arc::new(AtomicU32::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let worst = Arc::new(Mutex::new(0u32));
    let observe = {
        let worst = worst.clone();
        move |counts: HashMap<String, u32>| {
            let most = counts.values().copied().max().unwrap_or(0);
            let mut worst = worst.lock().unwrap();
            *worst = (*worst).max(most);
            assert!(most <= MAX, "over-granted: {counts:?}");
        }
    };
    // An independent reader that checks committed state in the file at arbitrary moments.
    let checker = {
        let (f, done, observe) = (f.clone(), done.clone(), observe.clone());
        std::thread::spawn(move || {
            let conn = f.raw();
            let now = start().as_millisecond();
            let mut checks = 0u32;
            while !done.load(Ordering::Relaxed) {
                let mut stmt = conn
                    .prepare_cached(
                        "SELECT proxy_uid, COUNT(*) FROM leases \
                         WHERE state = 'active' AND expires_at > ?1 GROUP BY proxy_uid",
                    )
                    .unwrap();
                let counts = stmt
                    .query_map([now], |r| Ok((r.get(0)?, r.get(1)?)))
                    .unwrap()
                    .collect::<Result<HashMap<String, u32>, _>>()
                    .unwrap();
                observe(counts);
                checks += 1;
            }
            checks
        })
    };
    let workers: Vec<_> = (0..TASKS)
        .map(|_| {
            let (f, candidates, observe) = (f.clone(), candidates.clone(), observe.clone());
            let (granted_total, refused_total) = (granted_total.clone(), refused_total.clone());
            tokio::spawn(async move {
                let mut held = std::collections::VecDeque::new();
                for _ in 0..ACQUIRES {
                    let request = AcquireRequest {
                        client: None,
                        candidates: candidates.clone(),
                        target: None,
                        ttl: MINUTE,
                        request: None,
                    };
                    match f.ledger.acquire(request).await.unwrap() {
                        AcquireOutcome::Granted(lease) => {
                            granted_total.fetch_add(1, Ordering::Relaxed);
                            observe(f.ledger.active_counts());
                            held.push_back(lease.id);
                        }
                        AcquireOutcome::NoMatch(stats) => {
                            refused_total.fetch_add(1, Ordering::Relaxed);
                            assert_eq!(stats.at_capacity, PROXIES as u32, "{stats:?}");
                        }
                        other => panic!("no request ID was sent: {other:?}"),
                    }
                    if held.len() >= HELD || (held.len() > 1 && fastrand_bit(&held)) {
                        let id = held.pop_front().unwrap();
                        f.ledger.release(&id).await.unwrap();
                    }
                }
                for id in held {
                    f.ledger.release(&id).await.unwrap();
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }
    done.store(true, Ordering::Relaxed);
    assert!(checker.join().unwrap() > 0, "the file was never checked");
    let granted_total = granted_total.load(Ordering::Relaxed);
    let refused_total = refused_total.load(Ordering::Relaxed);
    assert_eq!(granted_total + refused_total, (TASKS * ACQUIRES) as u32);
    assert!(
        refused_total > 0,
        "capacity was never reached: the test proves nothing"
    );
    assert_eq!(*worst.lock().unwrap(), MAX, "capacity was never filled");
    assert_eq!(f.ledger.active_total(), 0);
    assert_eq!(
        f.count("SELECT COUNT(*) FROM lease_events WHERE kind = 'acquired'"),
        i64::from(granted_total)
    );
    assert_eq!(
        f.count("SELECT COUNT(*) FROM lease_events WHERE kind = 'released'"),
        i64::from(granted_total)
    );
    let stats = f.ledger.writer_stats();
    assert!(
        stats.mean_batch_size() > 1.0,
        "64 concurrent callers were never committed together: {stats:?}"
    );
    f.ledger.self_check().await.unwrap();
}

/// A cheap varying bit so workers hold a changing number of leases.
fn fastrand_bit(held: &std::collections::VecDeque<String>) -> bool {
    held.back().is_some_and(|id| id.as_bytes()[0] % 2 == 0)
}
