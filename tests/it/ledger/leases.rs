//! The lease ledger's behaviour, each test run on both backends (a real SQLite file in a
//! temporary directory, a fresh database on the real PostgreSQL server): acquires and their
//! order, renewals, releases, reports and cooldowns, the sweep, request IDs, reopening, and
//! the history rows each operation writes. Then what only the SQLite file promises: its
//! schema version and WAL, migrating older files, durability, the append-only history
//! trigger, the sqlite3 shell, the state rebuilt at open. Time only moves through the
//! ledger's `ManualClock`.

use crate::support;
use proxy_operator::ledger::DEFAULT_TENANT;

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use jiff::Timestamp;
use proxy_operator::ledger::{
    AcquireOutcome, AcquireRequest, Candidate, Candidates, Durability, Lease, LeaseReport,
    LeaseState, Ledger, LedgerConfig, LedgerError, ManualClock, NoMatch, ReportResult, RequestKey,
    SCHEMA_VERSION, SqliteLedger, SqliteOptions, SweepStats, SystemClock,
};
use support::ledger::{Backend, Fixture, candidate, granted, no_match, start};

const MINUTE: Duration = Duration::from_secs(60);

fn config() -> LedgerConfig {
    LedgerConfig {
        max_ttl: Duration::from_secs(3600),
        cooldown: 10 * MINUTE,
        history_retention: Duration::from_secs(24 * 3600),
        ..LedgerConfig::default()
    }
}

/// What only these tests read from or send to the fixture's ledger.
impl Fixture {
    /// A connection of its own to the SQLite file, for what only SQLite has.
    fn raw(&self) -> rusqlite::Connection {
        rusqlite::Connection::open(&self.path).unwrap()
    }

    /// `(kind, target, result)` of every history row of one lease, in order.
    fn events(&self, lease_id: &str) -> Vec<(String, Option<String>, Option<String>)> {
        self.rows(&format!(
            "SELECT kind, target, result FROM lease_events WHERE lease_id = '{lease_id}' \
             ORDER BY seq"
        ))
        .into_iter()
        .map(|row| match <[Option<String>; 3]>::try_from(row) {
            Ok([Some(kind), target, result]) => (kind, target, result),
            other => panic!("not a history row: {other:?}"),
        })
        .collect()
    }

    async fn acquire(
        &self,
        candidates: &[Candidate],
        target: Option<&str>,
        ttl: Duration,
    ) -> Result<AcquireOutcome, LedgerError> {
        acquire(&*self.ledger, candidates, target, ttl).await
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
                tenant: proxy_operator::ledger::Tenancy::unrestricted(),
                session: None,
                fallback_step: None,
            })
            .await
    }
}

/// An acquire without a request ID.
async fn acquire(
    ledger: &dyn Ledger,
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
            tenant: proxy_operator::ledger::Tenancy::unrestricted(),
            session: None,
            fallback_step: None,
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

/// Text cells, for comparing with [`Fixture::rows`].
fn cells<const N: usize>(row: [Option<&str>; N]) -> Vec<Option<String>> {
    row.into_iter().map(|c| c.map(str::to_owned)).collect()
}

async fn acquire_spreads_over_the_least_loaded_proxies_and_records_history(backend: Backend) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
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
    assert_eq!(
        f.ledger.get(&lease.id, DEFAULT_TENANT).await.unwrap(),
        Some(lease.clone())
    );
    assert_eq!(
        f.events(&lease.id),
        [("acquired".to_owned(), Some("example.com".to_owned()), None)]
    );
    assert_eq!(f.ledger.counts().active_total(), 7);
    assert_eq!(
        f.ledger.counts().active_counts(),
        HashMap::from([
            ("uid-slow".to_owned(), 2),
            ("uid-fast".to_owned(), 2),
            ("uid-unknown".to_owned(), 2),
            ("uid-other".to_owned(), 1),
        ])
    );
}

async fn unhealthy_and_zero_capacity_proxies_are_never_leased(backend: Backend) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
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
    assert_eq!(f.ledger.counts().active_total(), 0);
    assert_eq!(f.count("SELECT COUNT(*) FROM lease_events"), 0);
    assert_eq!(f.count("SELECT COUNT(*) FROM leases"), 0);
    let stats = no_match(f.acquire(&[], None, MINUTE).await);
    assert_eq!(stats, NoMatch::default());
}

async fn ttl_is_capped_and_must_not_be_zero(backend: Backend) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
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
        let err = f
            .ledger
            .renew(&lease.id, DEFAULT_TENANT, ttl)
            .await
            .unwrap_err();
        assert!(matches!(err, LedgerError::InvalidTtl(_)), "{err:?}");
    }
    let renewed = f
        .ledger
        .renew(&lease.id, DEFAULT_TENANT, Duration::MAX)
        .await
        .unwrap();
    assert_eq!(renewed.ttl, Duration::from_secs(3600));
    assert_eq!(f.count("SELECT COUNT(*) FROM leases"), 1);
}

async fn an_expired_lease_stops_counting_before_the_sweep(backend: Backend) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
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
        f.ledger
            .get(&first.id, DEFAULT_TENANT)
            .await
            .unwrap()
            .unwrap()
            .state,
        LeaseState::Expired
    );
    assert_eq!(f.ledger.counts().active_total(), 1);
    assert_eq!(
        f.count("SELECT COUNT(*) FROM leases WHERE state = 'active'"),
        2,
        "the expired row waits for the sweep"
    );
}

async fn renew_extends_active_leases_only(backend: Backend) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
    let c = [candidate("a", 3)];
    let lease = granted(f.acquire(&c, Some("t.example"), MINUTE).await);
    f.clock.advance(Duration::from_secs(50));
    let renewed = f
        .ledger
        .renew(&lease.id, DEFAULT_TENANT, 2 * MINUTE)
        .await
        .unwrap();
    assert_eq!(
        renewed.expires_at,
        start() + Duration::from_secs(50) + 2 * MINUTE
    );
    assert_eq!(renewed.ttl, 2 * MINUTE);
    assert_eq!(renewed.acquired_at, lease.acquired_at);
    assert_eq!(
        f.ledger.get(&lease.id, DEFAULT_TENANT).await.unwrap(),
        Some(renewed.clone())
    );
    f.clock.advance(MINUTE);
    assert_eq!(
        f.ledger.counts().active_total(),
        1,
        "renewed lease still counts"
    );
    assert_eq!(
        f.events(&lease.id),
        [
            ("acquired".to_owned(), Some("t.example".to_owned()), None),
            ("renewed".to_owned(), Some("t.example".to_owned()), None),
        ]
    );
    assert_eq!(
        f.count(&format!(
            "SELECT expires_at FROM lease_events WHERE lease_id = '{}' AND kind = 'renewed'",
            lease.id
        )),
        renewed.expires_at.as_millisecond(),
        "the renewed row carries the new expiry"
    );

    f.ledger.release(&lease.id, DEFAULT_TENANT).await.unwrap();
    let err = f
        .ledger
        .renew(&lease.id, DEFAULT_TENANT, MINUTE)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, LedgerError::NotActive { id, state: LeaseState::Released } if *id == lease.id),
        "{err:?}"
    );

    let short = granted(f.acquire(&c, None, MINUTE).await);
    f.clock.advance(MINUTE);
    let err = f
        .ledger
        .renew(&short.id, DEFAULT_TENANT, MINUTE)
        .await
        .unwrap_err();
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
    assert_eq!(
        f.events(&short.id).len(),
        1,
        "a refused renew writes nothing"
    );

    let err = f
        .ledger
        .renew("no-such-lease", DEFAULT_TENANT, MINUTE)
        .await
        .unwrap_err();
    assert!(matches!(&err, LedgerError::UnknownLease(id) if id == "no-such-lease"));
}

async fn release_is_idempotent_and_frees_the_slot(backend: Backend) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
    let c = [candidate("a", 1)];
    let lease = granted(f.acquire(&c, None, MINUTE).await);
    no_match(f.acquire(&c, None, MINUTE).await);
    f.clock.advance(Duration::from_secs(5));
    f.ledger.release(&lease.id, DEFAULT_TENANT).await.unwrap();
    f.ledger.release(&lease.id, DEFAULT_TENANT).await.unwrap();
    f.ledger
        .release("never-issued", DEFAULT_TENANT)
        .await
        .unwrap();
    let released = f
        .ledger
        .get(&lease.id, DEFAULT_TENANT)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(released.state, LeaseState::Released);
    assert_eq!(released.released_at, Some(start() + Duration::from_secs(5)));
    assert_eq!(released.release_reason, None);
    let kinds: Vec<String> = f.events(&lease.id).into_iter().map(|e| e.0).collect();
    assert_eq!(kinds, ["acquired", "released"]);
    assert_eq!(
        f.count(&format!(
            "SELECT at FROM lease_events WHERE lease_id = '{}' AND kind = 'released'",
            lease.id
        )),
        (start() + Duration::from_secs(5)).as_millisecond()
    );
    granted(f.acquire(&c, None, MINUTE).await);

    // Releasing after the TTL ran out changes nothing: the lease already expired.
    let late = granted(f.acquire(&[candidate("b", 1)], None, MINUTE).await);
    f.clock.advance(2 * MINUTE);
    f.ledger.release(&late.id, DEFAULT_TENANT).await.unwrap();
    assert_eq!(
        f.ledger
            .get(&late.id, DEFAULT_TENANT)
            .await
            .unwrap()
            .unwrap()
            .state,
        LeaseState::Expired
    );
    assert_eq!(f.events(&late.id).len(), 1);
}

async fn rate_limited_and_blocked_reports_cool_the_proxy_down_for_that_target(backend: Backend) {
    for result in [ReportResult::RateLimited, ReportResult::Blocked] {
        let Some(f) = Fixture::on(backend, config()).await else {
            return;
        };
        let c = [measured("a", 5, 1), measured("b", 5, 9)];
        let lease = granted(f.acquire(&c, Some("shop.example"), MINUTE).await);
        assert_eq!(lease.proxy.name, "a");
        f.clock.advance(Duration::from_secs(1));
        let reported = f
            .ledger
            .report(&lease.id, DEFAULT_TENANT, LeaseReport::new(result, None))
            .await
            .unwrap();
        assert_eq!(reported.id, lease.id);
        assert_eq!(f.ledger.counts().cooldowns_active(), 1);
        assert!(
            f.ledger.counts().in_cooldown("uid-a", "shop.example"),
            "{result}"
        );
        assert!(
            !f.ledger.counts().in_cooldown("uid-a", "news.example"),
            "{result}"
        );
        assert_eq!(
            f.events(&lease.id)[1],
            (
                "reported".to_owned(),
                Some("shop.example".to_owned()),
                Some(result.as_str().to_owned())
            )
        );

        // Released, "a" would win on load and latency; the cooldown makes the target skip it.
        f.ledger.release(&lease.id, DEFAULT_TENANT).await.unwrap();
        let next = granted(f.acquire(&c, Some("shop.example"), MINUTE).await);
        assert_eq!(next.proxy.name, "b", "{result}");
        f.ledger.release(&next.id, DEFAULT_TENANT).await.unwrap();
        // Another target and no target are not affected.
        let other = granted(f.acquire(&c, Some("news.example"), MINUTE).await);
        assert_eq!(other.proxy.name, "a");
        f.ledger.release(&other.id, DEFAULT_TENANT).await.unwrap();
        let untargeted = granted(f.acquire(&c, None, MINUTE).await);
        assert_eq!(untargeted.proxy.name, "a");
        f.ledger
            .release(&untargeted.id, DEFAULT_TENANT)
            .await
            .unwrap();

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
        assert_eq!(
            f.count("SELECT until FROM cooldowns WHERE proxy_uid = 'uid-a'"),
            cooldown_end.as_millisecond()
        );
        f.clock.set(cooldown_end);
        assert_eq!(f.ledger.counts().cooldowns_active(), 0);
        let back = granted(f.acquire(&c, Some("shop.example"), MINUTE).await);
        assert_eq!(back.proxy.name, "a");
    }
}

/// A ban on one exit of a proxy with many (a rotating upstream's vendor session) cools that
/// exit for the target, never the proxy: the next acquire for the target still gets the proxy,
/// and the cooldown is kept under `UID/exit` with the proxy's name.
async fn a_ban_on_one_exit_cools_the_exit_not_the_proxy(backend: Backend) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
    let c = [candidate("a", 5)];
    let lease = granted(f.acquire(&c, Some("shop.example"), MINUTE).await);
    let report = LeaseReport {
        exit: Some("sess0001".to_owned()),
        ..LeaseReport::new(ReportResult::RateLimited, None)
    };
    f.ledger
        .report(&lease.id, DEFAULT_TENANT, report)
        .await
        .unwrap();
    let again = granted(f.acquire(&c, Some("shop.example"), MINUTE).await);
    assert_eq!(
        again.proxy.name, "a",
        "the proxy is still choosable for the target"
    );
    let counts = f.ledger.counts();
    assert!(counts.in_cooldown("uid-a/sess0001", "shop.example"));
    assert!(!counts.in_cooldown("uid-a", "shop.example"));
    assert_eq!(
        f.rows("SELECT proxy_uid, proxy_name, target FROM cooldowns"),
        [cells([
            Some("uid-a/sess0001"),
            Some("a"),
            Some("shop.example")
        ])]
    );
}

/// A report may ask for its own cooldown length (a target's `Retry-After`), capped by
/// `max_cooldown`; a later report never shortens a cooldown in force; the history row of each
/// report says how long the cooldown it started is.
async fn a_report_may_ask_for_its_own_cooldown_length(backend: Backend) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
    let c = [candidate("a", 5)];
    let lease = granted(f.acquire(&c, Some("shop.example"), MINUTE).await);
    f.clock.advance(Duration::from_secs(1));
    let t0 = start() + Duration::from_secs(1);
    let report = |result, target, cooldown| LeaseReport {
        cooldown,
        ..LeaseReport::new(result, target)
    };
    let retry_after = async |target: &str| {
        let stats = no_match(f.acquire(&c, Some(target), MINUTE).await);
        assert_eq!(stats.in_cooldown, 1, "{stats:?}");
        stats.retry_after
    };

    let asked = Some(Duration::from_secs(30));
    let r = report(ReportResult::RateLimited, None, asked);
    f.ledger.report(&lease.id, DEFAULT_TENANT, r).await.unwrap();
    assert_eq!(
        retry_after("shop.example").await,
        Some(t0 + Duration::from_secs(30))
    );
    // Longer than `max_cooldown` (an hour): capped, and it outlasts the first.
    let asked = Some(Duration::from_secs(2 * 3600));
    let r = report(ReportResult::Blocked, Some("shop.example"), asked);
    f.ledger.report(&lease.id, DEFAULT_TENANT, r).await.unwrap();
    assert_eq!(
        retry_after("shop.example").await,
        Some(t0 + Duration::from_secs(3600))
    );
    // A shorter one keeps the later end.
    let asked = Some(Duration::from_secs(1));
    let r = report(ReportResult::RateLimited, None, asked);
    f.ledger.report(&lease.id, DEFAULT_TENANT, r).await.unwrap();
    assert_eq!(
        retry_after("shop.example").await,
        Some(t0 + Duration::from_secs(3600))
    );
    // An ok report starts none, whatever it asks; without a length, the configured one.
    let asked = Some(5 * MINUTE);
    let r = report(ReportResult::Ok, None, asked);
    f.ledger.report(&lease.id, DEFAULT_TENANT, r).await.unwrap();
    let r = report(ReportResult::RateLimited, Some("news.example"), None);
    f.ledger.report(&lease.id, DEFAULT_TENANT, r).await.unwrap();
    assert_eq!(retry_after("news.example").await, Some(t0 + 10 * MINUTE));
    assert_eq!(f.ledger.counts().cooldowns_active(), 2);
    assert_eq!(
        f.rows("SELECT target, until, result FROM cooldowns ORDER BY until"),
        [
            cells([
                Some("news.example"),
                Some(&(t0 + 10 * MINUTE).as_millisecond().to_string()),
                Some("rate_limited")
            ]),
            cells([
                Some("shop.example"),
                Some(
                    &(t0 + Duration::from_secs(3600))
                        .as_millisecond()
                        .to_string()
                ),
                Some("rate_limited")
            ]),
        ],
        "a cooldown's row names the last report that set it"
    );

    let reports = f.rows(&format!(
        "SELECT result, target, cooldown_ms FROM lease_events \
         WHERE lease_id = '{}' AND kind = 'reported' ORDER BY seq",
        lease.id
    ));
    assert_eq!(
        reports,
        [
            cells([Some("rate_limited"), Some("shop.example"), Some("30000")]),
            cells([Some("blocked"), Some("shop.example"), Some("3600000")]),
            cells([Some("rate_limited"), Some("shop.example"), Some("1000")]),
            cells([Some("ok"), Some("shop.example"), None]),
            cells([Some("rate_limited"), Some("news.example"), Some("600000")]),
        ]
    );
    let seconds: Vec<Option<f64>> = f
        .rows(&format!(
            "SELECT cooldown_seconds FROM lease_history \
             WHERE lease_id = '{}' AND kind = 'reported' ORDER BY seq",
            lease.id
        ))
        .into_iter()
        .map(|row| row[0].as_deref().map(|s| s.parse().unwrap()))
        .collect();
    assert_eq!(
        seconds,
        [Some(30.0), Some(3600.0), Some(1.0), None, Some(600.0)]
    );

    f.clock.set(t0 + 10 * MINUTE);
    assert_eq!(f.ledger.counts().cooldowns_active(), 1);
    granted(f.acquire(&c, Some("news.example"), MINUTE).await);
    f.clock.set(t0 + Duration::from_secs(3600));
    assert_eq!(f.ledger.counts().cooldowns_active(), 0);
    granted(f.acquire(&c, Some("shop.example"), MINUTE).await);
    f.self_check().await;
}

async fn report_target_defaults_to_the_lease_target_and_without_any_no_cooldown_is_keyed(
    backend: Backend,
) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
    let c = [candidate("a", 5)];
    let untargeted = granted(f.acquire(&c, None, MINUTE).await);
    f.ledger
        .report(
            &untargeted.id,
            DEFAULT_TENANT,
            LeaseReport::new(ReportResult::RateLimited, None),
        )
        .await
        .unwrap();
    assert_eq!(f.ledger.counts().cooldowns_active(), 0);
    assert_eq!(f.count("SELECT COUNT(*) FROM cooldowns"), 0);
    assert_eq!(
        f.events(&untargeted.id)[1],
        ("reported".to_owned(), None, Some("rate_limited".to_owned()))
    );

    // An explicit target overrides (or supplies) the lease's.
    f.ledger
        .report(
            &untargeted.id,
            DEFAULT_TENANT,
            LeaseReport::new(ReportResult::Blocked, Some("explicit.example")),
        )
        .await
        .unwrap();
    assert_eq!(f.ledger.counts().cooldowns_active(), 1);
    assert_eq!(
        f.events(&untargeted.id)[2],
        (
            "reported".to_owned(),
            Some("explicit.example".to_owned()),
            Some("blocked".to_owned())
        )
    );
    let stats = no_match(f.acquire(&c, Some("explicit.example"), MINUTE).await);
    assert_eq!(stats.in_cooldown, 1);

    for result in [ReportResult::Ok, ReportResult::Error] {
        let lease = granted(f.acquire(&c, Some("fine.example"), MINUTE).await);
        f.ledger
            .report(&lease.id, DEFAULT_TENANT, LeaseReport::new(result, None))
            .await
            .unwrap();
        assert_eq!(f.ledger.counts().cooldowns_active(), 1, "{result}");
        assert_eq!(
            f.events(&lease.id)[1],
            (
                "reported".to_owned(),
                Some("fine.example".to_owned()),
                Some(result.as_str().to_owned())
            )
        );
    }

    let err = f
        .ledger
        .report(
            "no-such-lease",
            DEFAULT_TENANT,
            LeaseReport::new(ReportResult::Ok, None),
        )
        .await
        .unwrap_err();
    assert!(matches!(&err, LedgerError::UnknownLease(id) if id == "no-such-lease"));
    assert_eq!(err.to_string(), "unknown lease \"no-such-lease\"");
    assert_eq!(
        f.count("SELECT COUNT(*) FROM lease_events WHERE lease_id = 'no-such-lease'"),
        0
    );
}

async fn a_late_report_on_an_expired_lease_still_lands_until_the_lease_is_pruned(backend: Backend) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
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
        .report(
            &lease.id,
            DEFAULT_TENANT,
            LeaseReport::new(ReportResult::RateLimited, None),
        )
        .await
        .unwrap();
    assert_eq!(reported.state, LeaseState::Expired);
    assert_eq!(f.ledger.counts().cooldowns_active(), 1);
    let stats = no_match(f.acquire(&c, Some("shop.example"), MINUTE).await);
    assert_eq!(stats.in_cooldown, 1);
    let kinds: Vec<String> = f.events(&lease.id).into_iter().map(|e| e.0).collect();
    assert_eq!(kinds, ["acquired", "expired", "reported"]);

    // Retained until its expiry is older than the cooldown window, then gone.
    f.clock.set(lease.expires_at + 10 * MINUTE);
    assert_eq!(f.ledger.sweep().await.unwrap().leases_pruned, 0);
    f.ledger
        .report(
            &lease.id,
            DEFAULT_TENANT,
            LeaseReport::new(ReportResult::Ok, None),
        )
        .await
        .unwrap();
    f.clock.advance(Duration::from_millis(1));
    let stats = f.ledger.sweep().await.unwrap();
    assert_eq!(stats.leases_pruned, 1);
    assert!(matches!(
        f.ledger
            .report(
                &lease.id,
                DEFAULT_TENANT,
                LeaseReport::new(ReportResult::RateLimited, None)
            )
            .await,
        Err(LedgerError::UnknownLease(_))
    ));
    assert_eq!(f.ledger.get(&lease.id, DEFAULT_TENANT).await.unwrap(), None);
    assert_eq!(f.count("SELECT COUNT(*) FROM leases"), 0);
    let kinds: Vec<String> = f.events(&lease.id).into_iter().map(|e| e.0).collect();
    assert_eq!(
        kinds,
        ["acquired", "expired", "reported", "reported"],
        "the history outlives the lease row"
    );
}

async fn a_late_report_on_a_released_lease_lands_and_cools_down(backend: Backend) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
    let c = [candidate("a", 1)];
    let lease = granted(f.acquire(&c, Some("shop.example"), MINUTE).await);
    f.clock.advance(Duration::from_secs(5));
    f.ledger.release(&lease.id, DEFAULT_TENANT).await.unwrap();
    f.clock.advance(Duration::from_secs(5));
    let reported = f
        .ledger
        .report(
            &lease.id,
            DEFAULT_TENANT,
            LeaseReport::new(ReportResult::Blocked, None),
        )
        .await
        .unwrap();
    assert_eq!(reported.state, LeaseState::Released);
    assert_eq!(reported.released_at, Some(start() + Duration::from_secs(5)));
    assert!(f.ledger.counts().in_cooldown("uid-a", "shop.example"));
    let stats = no_match(f.acquire(&c, Some("shop.example"), MINUTE).await);
    assert_eq!(
        stats.retry_after,
        Some(start() + Duration::from_secs(10) + 10 * MINUTE)
    );
    assert_eq!(
        f.events(&lease.id),
        [
            ("acquired".to_owned(), Some("shop.example".to_owned()), None),
            ("released".to_owned(), Some("shop.example".to_owned()), None),
            (
                "reported".to_owned(),
                Some("shop.example".to_owned()),
                Some("blocked".to_owned())
            ),
        ]
    );
}

async fn sweep_expires_prunes_cooldowns_and_old_history(backend: Backend) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
    let c = [candidate("a", 5), candidate("b", 5)];
    let short = granted(f.acquire(&c, Some("t"), MINUTE).await);
    let long = granted(f.acquire(&c, Some("t"), 30 * MINUTE).await);
    let released = granted(f.acquire(&c, None, 30 * MINUTE).await);
    f.ledger
        .release(&released.id, DEFAULT_TENANT)
        .await
        .unwrap();
    f.ledger
        .report(
            &short.id,
            DEFAULT_TENANT,
            LeaseReport::new(ReportResult::RateLimited, None),
        )
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
    let expired_at = f.count(&format!(
        "SELECT at FROM lease_events WHERE lease_id = '{}' AND kind = 'expired'",
        short.id
    ));
    assert_eq!(expired_at, short.expires_at.as_millisecond());
    assert_eq!(
        f.rows(&format!(
            "SELECT state FROM leases WHERE id = '{}'",
            short.id
        )),
        [cells([Some("expired")])]
    );

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
    assert_eq!(f.count("SELECT COUNT(*) FROM cooldowns"), 0);
    // After 30 min + cooldown the long and released leases go; history stays for a day.
    f.clock.set(start() + 41 * MINUTE);
    let stats = f.ledger.sweep().await.unwrap();
    assert_eq!((stats.expired, stats.leases_pruned), (1, 2));
    assert_eq!(f.ledger.get(&long.id, DEFAULT_TENANT).await.unwrap(), None);
    assert_eq!(f.count("SELECT COUNT(*) FROM leases"), 0);
    let history = f.count("SELECT COUNT(*) FROM lease_events");
    assert_eq!(history, 7);
    f.clock
        .set(start() + Duration::from_secs(24 * 3600) + 31 * MINUTE);
    assert_eq!(f.ledger.sweep().await.unwrap().events_pruned, 7);
    assert_eq!(f.count("SELECT COUNT(*) FROM lease_events"), 0);
}

async fn leases_cooldowns_and_history_survive_reopening(backend: Backend) {
    let Some(mut f) = Fixture::on(backend, config()).await else {
        return;
    };
    let c = [candidate("a", 5), candidate("b", 5)];
    let kept = granted(f.acquire(&c, Some("t"), 30 * MINUTE).await);
    let cooled = granted(f.acquire(&c, Some("t"), 30 * MINUTE).await);
    f.ledger
        .report(
            &cooled.id,
            DEFAULT_TENANT,
            LeaseReport::new(ReportResult::Blocked, None),
        )
        .await
        .unwrap();
    f.ledger.release(&cooled.id, DEFAULT_TENANT).await.unwrap();
    assert_eq!(
        (kept.proxy.name.as_str(), cooled.proxy.name.as_str()),
        ("a", "b")
    );
    let history = f.count("SELECT COUNT(*) FROM lease_events");
    f.reopen().await;
    assert_eq!(
        f.ledger.get(&kept.id, DEFAULT_TENANT).await.unwrap(),
        Some(kept.clone())
    );
    assert_eq!(
        f.ledger
            .get(&cooled.id, DEFAULT_TENANT)
            .await
            .unwrap()
            .unwrap()
            .state,
        LeaseState::Released
    );
    assert_eq!(f.ledger.counts().active_total(), 1);
    assert_eq!(f.ledger.counts().cooldowns_active(), 1);
    assert_eq!(f.count("SELECT COUNT(*) FROM lease_events"), history);
    let stats = no_match(f.acquire(&c[1..], Some("t"), MINUTE).await);
    assert_eq!(
        stats.in_cooldown, 1,
        "the cooled proxy is still skipped after reopening"
    );
    f.self_check().await;
}

async fn lease_ids_are_unique_and_carry_128_random_bits(backend: Backend) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
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
    assert_eq!(f.count("SELECT COUNT(DISTINCT id) FROM leases"), 500);
}

async fn a_retried_acquire_with_the_same_request_id_gets_the_same_lease_while_it_runs(
    backend: Backend,
) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
    let c = [measured("a", 5, 1), measured("b", 5, 2)];
    let first = granted(f.acquire_once(&c, "job-1", "fp").await);
    assert_eq!(first.proxy.name, "a");
    let again = replayed(f.acquire_once(&c, "job-1", "fp").await);
    assert_eq!(again, first);
    assert_eq!(
        f.ledger.counts().active_total(),
        1,
        "a replay grants nothing"
    );
    assert_eq!(f.events(&first.id).len(), 1, "a replay records nothing");

    let err = f.acquire_once(&c, "job-1", "other").await.unwrap_err();
    assert!(
        matches!(&err, LedgerError::RequestIdReused { request_id } if request_id == "job-1"),
        "{err:?}"
    );
    let other = granted(f.acquire_once(&c, "job-2", "fp").await);
    assert_eq!(other.proxy.name, "b", "another ID is another acquire");

    // Renewing moves the window; the replay shows the lease as it is now.
    f.clock.advance(Duration::from_secs(50));
    let renewed = f
        .ledger
        .renew(&first.id, DEFAULT_TENANT, 2 * MINUTE)
        .await
        .unwrap();
    f.clock.advance(Duration::from_secs(30));
    assert_eq!(replayed(f.acquire_once(&c, "job-1", "fp").await), renewed);
    // A released lease is still the answer until its expiry...
    f.ledger.release(&first.id, DEFAULT_TENANT).await.unwrap();
    let released = replayed(f.acquire_once(&c, "job-1", "fp").await);
    assert_eq!(released.id, first.id);
    assert_eq!(released.state, LeaseState::Released);
    f.clock.set(renewed.expires_at - Duration::from_millis(1));
    assert!(matches!(
        f.acquire_once(&c, "job-1", "new").await,
        Err(LedgerError::RequestIdReused { .. })
    ));
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

/// A request ID whose window closed is free again even if the sweep has not deleted the
/// lease that had it, and after the sweep it is free all the same.
async fn a_request_id_is_free_after_the_expiry_whether_or_not_the_sweep_ran(backend: Backend) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
    let c = [candidate("a", 5)];
    let first = granted(f.acquire_once(&c, "job", "fp").await);
    f.clock.set(first.expires_at);
    let second = granted(f.acquire_once(&c, "job", "other").await);
    assert_ne!(second.id, first.id);
    f.clock.set(second.expires_at);
    assert_eq!(f.ledger.sweep().await.unwrap().expired, 2);
    let third = granted(f.acquire_once(&c, "job", "fp").await);
    assert_ne!(third.id, second.id);
    assert_eq!(replayed(f.acquire_once(&c, "job", "fp").await), third);
    assert_eq!(
        f.count("SELECT COUNT(*) FROM leases WHERE request_id = 'job'"),
        3,
        "the finished leases are retained for the cooldown window"
    );
    f.self_check().await;
}

async fn request_ids_answer_after_reopening(backend: Backend) {
    let Some(mut f) = Fixture::on(backend, config()).await else {
        return;
    };
    let c = [candidate("a", 5)];
    let kept = granted(f.acquire_once(&c, "kept", "fp").await);
    let released = granted(f.acquire_once(&c, "released", "fp").await);
    f.ledger
        .release(&released.id, DEFAULT_TENANT)
        .await
        .unwrap();
    let short = granted(f.acquire_once(&c, "short", "fp").await);
    f.clock.advance(Duration::from_secs(10));
    let renewed = f
        .ledger
        .renew(&kept.id, DEFAULT_TENANT, 5 * MINUTE)
        .await
        .unwrap();
    f.clock.set(short.expires_at - Duration::from_millis(1));
    f.reopen().await;
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
    f.reopen().await;
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
    f.self_check().await;
}

/// The debugging views an engineer reads (with the sqlite3 shell or psql) show the leases
/// counting now, the cooldowns in force and the history. They count by the database's own
/// clock, so the ledger's clock is put at the real time first.
async fn the_debugging_views_show_leases_cooldowns_and_history(backend: Backend) {
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
    let now = Timestamp::now();
    f.clock.set(now);
    let c = [candidate("a", 5), measured("b", 5, 3)];
    let first = granted(f.acquire(&c, Some("shop.example"), 30 * MINUTE).await);
    let second = granted(f.acquire(&c, Some("shop.example"), 30 * MINUTE).await);
    f.ledger
        .report(
            &first.id,
            DEFAULT_TENANT,
            LeaseReport::new(ReportResult::RateLimited, None),
        )
        .await
        .unwrap();
    f.ledger.release(&first.id, DEFAULT_TENANT).await.unwrap();

    let second_proxy = second.proxy.to_string();
    assert_eq!(
        f.rows("SELECT proxy, proxy_uid, leases FROM active_leases_per_proxy"),
        [cells([
            Some(&second_proxy),
            Some(&second.proxy.uid),
            Some("1")
        ])]
    );
    assert_eq!(
        f.rows("SELECT id, proxy, target FROM active_leases"),
        [cells([
            Some(&second.id),
            Some(&second_proxy),
            Some("shop.example")
        ])]
    );
    assert_eq!(
        f.rows(&format!(
            "SELECT kind, result FROM lease_history WHERE lease_id = '{}'",
            first.id
        )),
        [
            cells([Some("acquired"), None]),
            cells([Some("reported"), Some("rate_limited")]),
            cells([Some("released"), None]),
        ]
    );
    assert_eq!(
        f.rows("SELECT proxy, target, result, lease_id FROM active_cooldowns"),
        [cells([
            Some(&first.proxy.to_string()),
            Some("shop.example"),
            Some("rate_limited"),
            Some(&first.id)
        ])]
    );
    let hour_ago = (now - Duration::from_secs(3600)).as_millisecond();
    assert_eq!(
        f.rows(&format!(
            "SELECT target, COUNT(*) FROM lease_events WHERE kind = 'reported' \
             AND result = 'rate_limited' AND at > {hour_ago} GROUP BY target"
        )),
        [cells([Some("shop.example"), Some("1")])]
    );
}

/// Both backends have the same tables, columns and views, so the same queries read either:
/// the views answer with the same columns in the same order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_views_and_tables_have_the_same_columns_on_both_backends() {
    let sqlite = Fixture::new(config());
    let Some(postgres) = Fixture::on(Backend::Postgres, config()).await else {
        return;
    };
    for view in [
        "active_leases",
        "active_leases_per_proxy",
        "active_cooldowns",
        "lease_history",
        "traffic",
    ] {
        let columns = sqlite.columns(view);
        assert!(!columns.is_empty(), "{view}");
        assert_eq!(postgres.columns(view), columns, "view {view}");
    }
    // Tables too, in the same order, so even `SELECT *` reads alike.
    for table in [
        "leases",
        "cooldowns",
        "lease_events",
        "pool_demand",
        "traffic_hours",
    ] {
        let columns = sqlite.columns(table);
        assert!(!columns.is_empty(), "{table}");
        assert_eq!(postgres.columns(table), columns, "table {table}");
    }
}

async fn concurrent_acquires_never_exceed_max_leases(backend: Backend) {
    const TASKS: usize = 64;
    const ACQUIRES: usize = 150;
    const PROXIES: usize = 10;
    const MAX: u32 = 3;
    const HELD: usize = 4;
    let Some(f) = Fixture::on(backend, config()).await else {
        return;
    };
    let f = Arc::new(f);
    let candidates: Candidates = (0..PROXIES)
        .map(|i| measured(&format!("p{i}"), MAX, i as u64))
        .collect();
    let granted_total = Arc::new(AtomicU32::new(0));
    let refused_total = Arc::new(AtomicU32::new(0));
    let overloaded_total = Arc::new(AtomicU32::new(0));
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
    // An independent reader that checks committed state in the database at arbitrary moments.
    let checker = {
        let (f, done, observe) = (f.clone(), done.clone(), observe.clone());
        std::thread::spawn(move || {
            let sql = format!(
                "SELECT proxy_uid, COUNT(*) FROM leases \
                 WHERE state = 'active' AND expires_at > {} GROUP BY proxy_uid",
                start().as_millisecond()
            );
            let mut checks = 0u32;
            while !done.load(Ordering::Relaxed) {
                let counts = f
                    .rows(&sql)
                    .into_iter()
                    .map(|row| match <[Option<String>; 2]>::try_from(row) {
                        Ok([Some(uid), Some(n)]) => (uid, n.parse().unwrap()),
                        other => panic!("not a count: {other:?}"),
                    })
                    .collect();
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
            let overloaded = overloaded_total.clone();
            tokio::spawn(async move {
                let mut held = std::collections::VecDeque::new();
                for _ in 0..ACQUIRES {
                    let request = AcquireRequest {
                        client: None,
                        candidates: candidates.clone(),
                        target: None,
                        ttl: MINUTE,
                        request: None,
                        tenant: proxy_operator::ledger::Tenancy::unrestricted(),
                        session: None,
                        fallback_step: None,
                    };
                    let outcome = loop {
                        let answer = f.ledger.acquire(request.clone()).await;
                        if let Some(outcome) = decided(f.backend, &overloaded, answer) {
                            break outcome;
                        }
                    };
                    match outcome {
                        AcquireOutcome::Granted(lease) => {
                            granted_total.fetch_add(1, Ordering::Relaxed);
                            // The SQLite writer moves its counts with the commit. PostgreSQL's
                            // are a snapshot each write moves once its transaction is
                            // committed, so another acquire may already have taken a slot a
                            // release freed before the release's own count moved: there the
                            // committed state (the checker) is what must hold.
                            if f.backend == Backend::Sqlite {
                                observe(f.ledger.counts().active_counts());
                            }
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
                        while decided(
                            f.backend,
                            &overloaded,
                            f.ledger.release(&id, DEFAULT_TENANT).await,
                        )
                        .is_none()
                        {}
                    }
                }
                for id in held {
                    while decided(
                        f.backend,
                        &overloaded,
                        f.ledger.release(&id, DEFAULT_TENANT).await,
                    )
                    .is_none()
                    {}
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }
    done.store(true, Ordering::Relaxed);
    assert!(
        checker.join().unwrap() > 0,
        "the database was never checked"
    );
    let granted_total = granted_total.load(Ordering::Relaxed);
    let refused_total = refused_total.load(Ordering::Relaxed);
    let overloaded_total = overloaded_total.load(Ordering::Relaxed);
    if overloaded_total > 0 {
        eprintln!("{backend:?}: {overloaded_total} writes answered Overloaded and were retried");
    }
    assert_eq!(granted_total + refused_total, (TASKS * ACQUIRES) as u32);
    assert!(
        refused_total > 0,
        "capacity was never reached: the test proves nothing"
    );
    assert_eq!(*worst.lock().unwrap(), MAX, "capacity was never filled");
    assert_eq!(f.ledger.counts().active_total(), 0);
    assert_eq!(f.ledger.counts().active_counts(), HashMap::new());
    assert_eq!(
        f.count("SELECT COUNT(*) FROM leases WHERE state = 'active'"),
        0
    );
    assert_eq!(
        f.count("SELECT COUNT(*) FROM lease_events WHERE kind = 'acquired'"),
        i64::from(granted_total)
    );
    assert_eq!(
        f.count("SELECT COUNT(*) FROM lease_events WHERE kind = 'released'"),
        i64::from(granted_total)
    );
    if f.backend == Backend::Sqlite {
        let stats = f.sqlite().writer_stats();
        assert!(
            stats.mean_batch_size() > 1.0,
            "64 concurrent callers were never committed together: {stats:?}"
        );
    }
    f.self_check().await;
}

/// What a write of the concurrency test decided; `None` (counted in `overloaded`): nothing,
/// send it again. The SQLite writer decides every one of them (its queue holds them all), so
/// there any error fails the test. The PostgreSQL ledger answers `Overloaded` (nothing
/// decided: retry) to a write that waited longer than `queue_deadline` for one of its pooled
/// connections, which 64 callers on a loaded machine can make happen.
fn decided<T>(
    backend: Backend,
    overloaded: &AtomicU32,
    answer: Result<T, LedgerError>,
) -> Option<T> {
    match answer {
        Err(LedgerError::Overloaded { .. }) if backend == Backend::Postgres => {
            overloaded.fetch_add(1, Ordering::Relaxed);
            None
        }
        answer => Some(answer.unwrap()),
    }
}

/// A cheap varying bit so workers hold a changing number of leases.
fn fastrand_bit(held: &std::collections::VecDeque<String>) -> bool {
    held.back().is_some_and(|id| id.as_bytes()[0] % 2 == 0)
}

// What only the SQLite file promises.

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
    f.reopen().await;
    f.reopen().await;
    assert_eq!(
        f.ledger.get(&lease.id, DEFAULT_TENANT).await.unwrap(),
        Some(lease)
    );
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
    let ledger =
        SqliteLedger::open(&path, SqliteOptions::default(), config(), clock.clone()).unwrap();
    assert_eq!(ledger.counts().active_total(), 1);
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
    let f = Fixture::with_options(
        SqliteOptions {
            durability: Durability::Full,
            ..SqliteOptions::default()
        },
        config(),
    );
    let lease = granted(f.acquire(&[candidate("a", 1)], None, MINUTE).await);
    // Reopened with the default (Normal) durability.
    let reopened =
        SqliteLedger::open(&f.path, SqliteOptions::default(), config(), f.clock.clone()).unwrap();
    assert_eq!(
        reopened.get(&lease.id, DEFAULT_TENANT).await.unwrap(),
        Some(lease)
    );
}

#[tokio::test]
async fn a_database_from_a_newer_binary_is_refused() {
    let f = Fixture::new(config());
    f.raw()
        .pragma_update(None, "user_version", SCHEMA_VERSION + 1)
        .unwrap();
    let err = SqliteLedger::open(&f.path, SqliteOptions::default(), config(), f.clock.clone())
        .unwrap_err();
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
    let err = SqliteLedger::open(
        &path,
        SqliteOptions::default(),
        config(),
        Arc::new(SystemClock),
    )
    .unwrap_err();
    assert!(matches!(err, LedgerError::Open { .. }), "{err:?}");
    assert!(err.to_string().contains("missing-dir"), "{err}");

    let not_a_db = dir.path().join("notes.txt");
    std::fs::write(
        &not_a_db,
        "this is not a database, just some text ".repeat(200),
    )
    .unwrap();
    let err = SqliteLedger::open(
        &not_a_db,
        SqliteOptions::default(),
        config(),
        Arc::new(SystemClock),
    )
    .unwrap_err();
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
        let err = SqliteLedger::open(
            &dir.path().join("x.db"),
            SqliteOptions::default(),
            bad,
            Arc::new(SystemClock),
        )
        .unwrap_err();
        assert!(matches!(err, LedgerError::Config(_)), "{err:?}");
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
        f.ledger.counts().active_counts(),
        f.ledger.counts().active_total(),
        f.ledger.counts().cooldowns_active(),
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
    f.ledger
        .release(&leases[0].id, DEFAULT_TENANT)
        .await
        .unwrap();
    f.ledger
        .renew(&leases[1].id, DEFAULT_TENANT, 10 * MINUTE)
        .await
        .unwrap();
    for (lease, target) in [(&leases[2], "a.example"), (&leases[3], "b.example")] {
        f.ledger
            .report(
                &lease.id,
                DEFAULT_TENANT,
                LeaseReport::new(ReportResult::RateLimited, Some(target)),
            )
            .await
            .unwrap();
    }
    f.ledger
        .report(
            &leases[4].id,
            DEFAULT_TENANT,
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
    f.self_check().await;
    f.reopen().await;
    f.self_check().await;
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
        .expect("the sqlite3 CLI is installed (see CONTRIBUTING.md)");
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
    let ledger = SqliteLedger::open(
        &path,
        SqliteOptions::default(),
        config(),
        Arc::new(SystemClock),
    )
    .unwrap();
    let c = [candidate("a", 5), measured("b", 5, 3)];
    let first = granted(acquire(&ledger, &c, Some("shop.example"), MINUTE).await);
    let second = granted(acquire(&ledger, &c, Some("shop.example"), MINUTE).await);
    ledger
        .report(
            &first.id,
            DEFAULT_TENANT,
            LeaseReport::new(ReportResult::RateLimited, None),
        )
        .await
        .unwrap();
    ledger.release(&first.id, DEFAULT_TENANT).await.unwrap();

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

crate::on_both_backends!(
    acquire_spreads_over_the_least_loaded_proxies_and_records_history,
    unhealthy_and_zero_capacity_proxies_are_never_leased,
    ttl_is_capped_and_must_not_be_zero,
    an_expired_lease_stops_counting_before_the_sweep,
    renew_extends_active_leases_only,
    release_is_idempotent_and_frees_the_slot,
    rate_limited_and_blocked_reports_cool_the_proxy_down_for_that_target,
    a_report_may_ask_for_its_own_cooldown_length,
    a_ban_on_one_exit_cools_the_exit_not_the_proxy,
    report_target_defaults_to_the_lease_target_and_without_any_no_cooldown_is_keyed,
    a_late_report_on_an_expired_lease_still_lands_until_the_lease_is_pruned,
    a_late_report_on_a_released_lease_lands_and_cools_down,
    sweep_expires_prunes_cooldowns_and_old_history,
    leases_cooldowns_and_history_survive_reopening,
    lease_ids_are_unique_and_carry_128_random_bits,
    a_retried_acquire_with_the_same_request_id_gets_the_same_lease_while_it_runs,
    a_request_id_is_free_after_the_expiry_whether_or_not_the_sweep_ran,
    request_ids_answer_after_reopening,
    the_debugging_views_show_leases_cooldowns_and_history,
    concurrent_acquires_never_exceed_max_leases,
);
